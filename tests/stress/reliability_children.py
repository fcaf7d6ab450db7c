"""Child-process bodies of test_reliability.py and the tagged states they send.

Kept apart from the test module so that a spawned child imports NumPy,
shmeval and helpers only, not pytest (which doubles a spawn child's start-up
CPU), and so that the fork server can preload it.
"""
from __future__ import annotations

import os
import random
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

import numpy as np

import shmeval
from shmeval import segment
from helpers import INPUT_SHAPE, fake_model, make_state


# ---------------------------------------------------------------- states

def tagged_states(wid: int, j0: int, n: int) -> np.ndarray:
    """n states whose fake-model answers name their sender and request number:
    policy = [2*wid, 2*j + 1, ..., 2*j + 6], value = -j for j = j0 .. j0+n-1
    (make_state's scheme with the worker id in the first column).  Exact in
    float32 while j < 2**22."""
    s = np.zeros((n,) + INPUT_SHAPE, np.float32)
    j = np.arange(j0, j0 + n, dtype=np.float32)
    s[:, 0, 0, 0] = wid
    s[:, 0, 1:, 0] = j[:, None]
    s[:, 5, 6, 1] = -j
    return s


def count_bad(wid: int, j0: int, policy: np.ndarray, value: np.ndarray) -> tuple[int, str]:
    """How many of the rows are not the answers to tagged_states(wid, j0, n)."""
    n = len(value)
    j = np.arange(j0, j0 + n, dtype=np.float32)
    want = np.empty((n, 7), np.float32)
    want[:, 0] = 2 * wid
    want[:, 1:] = 2 * j[:, None] + np.arange(1, 7, dtype=np.float32)
    ok = (policy == want).all(axis=1) & (value == -j)
    if ok.all():
        return 0, ""
    i = int(np.argmin(ok))
    return int((~ok).sum()), (f"worker {wid} request {j0 + i}: got policy {policy[i]} "
                              f"value {value[i]}")


def one_request(ev: Any, rng: random.Random, wid: int, j: int) -> tuple[int, int, str]:
    """evaluate (half the time) or evaluate_many of 1..20 rows; returns
    (rows sent, wrong answers, first wrong answer)."""
    if rng.random() < 0.5:
        out = ev.evaluate(tagged_states(wid, j, 1)[0])
        return (1,) + count_bad(wid, j, out["policy"][None], out["value"][None])
    n = rng.randint(1, 20)
    out = ev.evaluate_many(tagged_states(wid, j, n))
    return (n,) + count_bad(wid, j, out["policy"], out["value"])


# ---------------------------------------------------------------- child bodies
# (module level: spawn and forkserver children import them)

def noop() -> None:
    pass


def load_worker(ev: Any, wid: int, seed: int, counters: Any, conn: Any) -> None:
    """Evaluates without pause until told to stop; says "ready" after its first
    answer (it holds a client entry then), and reports
    ("done", wid, sent, verified, bad, first_bad, error) at the end.
    counters[wid] (if given) follows the verified count."""
    rng = random.Random(seed)
    sent = verified = bad = 0
    first_bad = error = ""
    j = 0
    next_poll = 0.0
    try:
        while True:
            n, b, what = one_request(ev, rng, wid, j)
            sent += n
            verified += n - b
            bad += b
            first_bad = first_bad or what
            j += n
            if counters is not None:
                counters[wid] = verified
            if j == n:
                conn.send(("ready", wid, os.getpid(), ev._c))
            now = time.monotonic()
            if now >= next_poll:
                next_poll = now + 0.01
                if conn.poll():
                    break
    except Exception as e:  # noqa: BLE001 - reported, the test fails on it
        error = f"{type(e).__name__}: {e}"
    conn.send(("done", wid, sent, verified, bad, first_bad, error))
    conn.close()


def writing_victim(address: str, nslots: int, conn: Any) -> None:
    """Claims a client entry with the low-level Segment API, moves nslots slots
    to WRITING (begun, never published), reports (entry, slot states), then
    sleeps until it is killed."""
    try:
        seg, spec = segment.attach(address)
        pid = os.getpid()
        c = seg.register(pid, segment.process_starttime(pid) or 0, segment.namespaces().pid)
        for k in range(nslots):
            seg.begin(c, k)
        conn.send(("writing", c, [seg.slot_state(c, k) for k in range(nslots)]))
    except Exception as e:  # noqa: BLE001
        conn.send(("error", f"{type(e).__name__}: {e}"))
    time.sleep(120)


def slow_forever_model(x: np.ndarray) -> Any:
    time.sleep(30)
    return fake_model(x)


def slow_forever_factory() -> Callable[[np.ndarray], Any]:
    return slow_forever_model


def wait_for_answer(ev: Any, wid: int, j: int, many: bool) -> tuple[str, float]:
    """One request; returns (outcome, time.monotonic() when it came back)."""
    try:
        if many:
            out = ev.evaluate_many(tagged_states(wid, j, 3))
            bad = count_bad(wid, j, out["policy"], out["value"])[0]
        else:
            out = ev.evaluate(tagged_states(wid, j, 1)[0])
            bad = count_bad(wid, j, out["policy"][None], out["value"][None])[0]
        what = "answered" if not bad else "wrong answer"
    except shmeval.ShmevalError as e:
        what = type(e).__name__
    except Exception as e:  # noqa: BLE001
        what = f"{type(e).__name__}: {e}"
    return what, time.monotonic()


def death_waiter(ev: Any, wid: int, conn: Any) -> None:
    """Two threads, one evaluate and one evaluate_many(3), both waiting on a
    model that never finishes; reports their outcomes and times."""
    results: list[tuple[str, float]] = []
    threads = [threading.Thread(target=lambda m=many: results.append(
        wait_for_answer(ev, wid, 100 * m, m))) for many in (False, True)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    conn.send(("done", results, [th.is_alive() for th in threads]))
    conn.close()


def until_closed(ev: Any, wid: int, seed: int, report: Callable[[Any], None],
                 ready: Callable[[], None]) -> None:
    """Evaluates until EvaluatorClosed; reports ("done", wid, completed, bad,
    first_bad, completion times of the last 64 requests, time of the
    EvaluatorClosed, what a further request raised, error)."""
    rng = random.Random(seed)
    completed = bad = 0
    first_bad = error = second = ""
    recent: deque[float] = deque(maxlen=64)
    t_raise: Optional[float] = None
    j = 0
    try:
        while True:
            try:
                n, b, what = one_request(ev, rng, wid, j)
            except shmeval.EvaluatorClosed:
                t_raise = time.monotonic()
                break
            recent.append(time.monotonic())
            completed += n - b
            bad += b
            first_bad = first_bad or what
            j += n
            if j == n:
                ready()
        try:
            ev.evaluate(make_state(1))
            second = "answered"
        except shmeval.ShmevalError as e:
            second = type(e).__name__
    except Exception as e:  # noqa: BLE001
        import traceback
        error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    report(("done", wid, completed, bad, first_bad, list(recent), t_raise, second, error))


def close_worker(ev: Any, wid: int, seed: int, conn: Any) -> None:
    until_closed(ev, wid, seed, conn.send, lambda: conn.send(("ready", wid, os.getpid(), 0)))
    conn.close()
