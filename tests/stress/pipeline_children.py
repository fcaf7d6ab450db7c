"""Child-process bodies of test_pipeline_faults.py (importable by spawned
and fork-server children without pytest)."""
from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from typing import Any

import shmeval
from reliability_children import count_bad, tagged_states

#: Most submissions a load worker keeps in flight (more rows than its slots
#: at times: submit then copies out answers already there to free slots).
MAX_IN_FLIGHT = 6


def slots_back(ev: Any, timeout: float) -> bool:
    """Every slot of this process's entry is free again, waiting up to
    timeout for the abandoned ones to be answered."""
    port = ev._port
    deadline = time.monotonic() + timeout
    while True:
        with ev._entry.lock:
            ev._entry.recover_abandoned()
        if len(port.free) == ev.spec.slots_per_client:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)


def pipelined_load_worker(ev: Any, wid: int, seed: int, conn: Any) -> None:
    """Submits batches of 1-4 tagged states, keeping up to MAX_IN_FLIGHT in
    flight, collects them in random order (result or wait_any) and drops
    one now and then uncollected, until told to stop; says ("ready", wid,
    pid) after its first answer and reports ("done", wid, verified, bad,
    first_bad, dropped, every slot back, error)."""
    rng = random.Random(seed)
    verified = bad = dropped = 0
    first_bad = error = ""
    back = False
    j = 0
    pending: list[tuple[Any, int, int]] = []  # (Pending, first request, rows)
    ready = False
    next_poll = 0.0
    try:
        while True:
            if len(pending) < MAX_IN_FLIGHT and (not pending or rng.random() < 0.5):
                n = rng.randint(1, 4)
                pending.append((ev.submit(tagged_states(wid, j, n)), j, n))
                j += n
                continue
            if rng.random() < 0.03:
                del pending[rng.randrange(len(pending))]  # dropped uncollected
                dropped += 1
                continue
            if rng.random() < 0.5:
                p, j0, n = pending.pop(rng.randrange(len(pending)))
            else:
                first = ev.wait_any([x[0] for x in pending])
                i = next(i for i, x in enumerate(pending) if x[0] is first)
                p, j0, n = pending.pop(i)
            out = p.result()
            b, what = count_bad(wid, j0, out["policy"], out["value"])
            verified += n - b
            bad += b
            first_bad = first_bad or what
            if not ready:
                conn.send(("ready", wid, os.getpid()))
                ready = True
            now = time.monotonic()
            if now >= next_poll:
                next_poll = now + 0.01
                if conn.poll():
                    break
        pending.clear()
        back = slots_back(ev, 10.0)
    except Exception as e:  # noqa: BLE001 - reported, the test fails on it
        error = f"{type(e).__name__}: {e}"
    conn.send(("done", wid, verified, bad, first_bad, dropped, back, error))
    conn.close()


def _outcome(fn: Any) -> str:
    try:
        fn()
        return "answered"
    except shmeval.ShmevalError as e:
        return type(e).__name__
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def stranded_waiter(ev: Any, wid: int, conn: Any) -> None:
    """Submissions that the evaluator will not answer (its model never
    returns), waited for in three threads: result(), wait_any() and
    evaluate_async().  Says ("ready", wid, pid) once they wait, then reports
    ("done", outcomes, hung threads, what a new submit raised)."""
    pendings = [ev.submit(tagged_states(wid, 10 * i, 2)) for i in range(2)]
    outcomes: list[str] = []

    async def awaited() -> None:
        await ev.evaluate_async(tagged_states(wid, 100, 1))

    bodies = [lambda: pendings[0].result(),
              lambda: ev.wait_any(pendings[1:]).result(),
              lambda: asyncio.run(awaited())]
    threads = [threading.Thread(target=lambda f=f: outcomes.append(_outcome(f)), daemon=True)
               for f in bodies]
    for th in threads:
        th.start()
    time.sleep(0.2)
    conn.send(("ready", wid, os.getpid()))
    for th in threads:
        th.join(60)
    after = _outcome(lambda: ev.submit(tagged_states(wid, 200, 1)).result())
    conn.send(("done", outcomes, [th.is_alive() for th in threads], after))
    conn.close()
