"""The conservation harness: WORKERS processes each send REQUESTS requests
with random small delays, mixing evaluate and evaluate_many (batches larger
than a client's slots included), and check every answer against the fake
model's output for that worker's own state.  Used by
stress/test_conservation.py and core/test_serving_threads.py; a module of its
own so that spawned workers can import it.  pipelined_worker sends them
through submit instead and collects them in random order
(stress/test_pipeline_faults.py)."""
from __future__ import annotations

import multiprocessing as mp
import random
import time
from typing import Any

import numpy as np

from helpers import INPUT_SHAPE, OUTPUTS, make_state

WORKERS = 16
REQUESTS = 2000
SLOTS = 8          # per client; evaluate_many batches of up to 20 need rounds
JOIN_TIMEOUT = 240


def tag_of(worker: int, j: int) -> int:
    return worker * 100_000 + j  # < 2**24: exact in float32


def conservation_worker(ev: Any, worker: int, seed: int, q: Any) -> None:
    rng = random.Random(seed)
    sent = bad = 0
    j = 0
    first_bad = ""
    while j < REQUESTS:
        if rng.random() < 0.5:
            tags = [tag_of(worker, j)]
            out = ev.evaluate(make_state(tags[0]))
            policy, value = out["policy"][None], out["value"][None]
        else:
            m = min(rng.randint(1, 20), REQUESTS - j)
            tags = [tag_of(worker, j + i) for i in range(m)]
            out = ev.evaluate_many(np.stack([make_state(t) for t in tags]))
            policy, value = out["policy"], out["value"]
        t = np.array(tags, np.float32)
        want_policy = 2 * t[:, None] + np.arange(7, dtype=np.float32)
        ok = (policy == want_policy).all(axis=1) & (value == -t)
        if not ok.all() and not first_bad:
            i = int(np.argmin(ok))
            first_bad = f"tag {tags[i]}: got policy {policy[i]} value {value[i]}"
        bad += int((~ok).sum())
        sent += len(tags)
        j += len(tags)
        if rng.random() < 0.05:
            time.sleep(rng.random() * 200e-6)
    q.put((worker, sent, bad, first_bad))


def pipelined_worker(ev: Any, worker: int, seed: int, q: Any) -> None:
    """As conservation_worker, through ev.submit: batches of 1-3 states,
    more in flight at times than the client has slots, each collected in a
    random order by result(), wait_any or as_completed."""
    rng = random.Random(seed)
    sent = bad = 0
    j = 0
    first_bad = ""
    pending: list[tuple[Any, list[int]]] = []
    while j < REQUESTS or pending:
        if j < REQUESTS and (not pending or rng.random() < 0.55):
            m = min(rng.randint(1, 3), REQUESTS - j)
            tags = [tag_of(worker, j + i) for i in range(m)]
            pending.append((ev.submit(np.stack([make_state(t) for t in tags])), tags))
            j += m
            continue
        how = rng.random()
        if how < 0.4:
            done = [pending.pop(rng.randrange(len(pending)))]
        elif how < 0.8:
            first = ev.wait_any([p for p, _ in pending])
            done = [x for x in pending if x[0] is first]
            pending = [x for x in pending if x[0] is not first]
        else:
            by_id = {id(p): (p, tags) for p, tags in pending}
            done = [by_id[id(p)] for p in ev.as_completed([p for p, _ in pending])]
            pending = []
        for p, tags in done:
            out = p.result()
            t = np.array(tags, np.float32)
            want_policy = 2 * t[:, None] + np.arange(7, dtype=np.float32)
            ok = (out["policy"] == want_policy).all(axis=1) & (out["value"] == -t)
            if not ok.all() and not first_bad:
                i = int(np.argmin(ok))
                first_bad = f"tag {tags[i]}: got policy {out['policy'][i]} value {out['value'][i]}"
            bad += int((~ok).sum())
            sent += len(tags)
        if rng.random() < 0.05:
            time.sleep(rng.random() * 200e-6)
    q.put((worker, sent, bad, first_bad))


def run_workers(ev: Any, ctx_name: str, worker: Any = conservation_worker) -> None:
    ctx = mp.get_context(ctx_name)
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(ev, w, 1234 + w, q))
             for w in range(WORKERS)]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + JOIN_TIMEOUT
    try:
        for _ in procs:
            results.append(q.get(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert sorted(r[0] for r in results) == list(range(WORKERS))
    bad = [r for r in results if r[2]]
    assert not bad, f"cross-talk or corrupt answers: {bad[:3]}"
    assert sum(r[1] for r in results) == WORKERS * REQUESTS
    # None lost, none twice: the evaluator served exactly what was sent.
    stats = ev.stats()
    assert stats["requests"] == WORKERS * REQUESTS, stats
    assert stats["failed_requests"] == 0
    assert stats["stale_completions"] == 0


KW = dict(input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=64, slots_per_client=SLOTS)
