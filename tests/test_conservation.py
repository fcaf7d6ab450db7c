"""Conservation: every request is answered exactly once, with its own result.

16 worker processes each send REQUESTS requests with random small delays,
mixing evaluate and evaluate_many (batches larger than a client's slots
included).  Every answer must equal the fake model's output for that worker's
own state (no cross-talk, none lost), and the evaluator must have served
exactly as many requests as were sent (none twice).  Run with spawn and fork
workers against a thread evaluator, and with spawn workers against
Evaluator.spawn.
"""
from __future__ import annotations

import multiprocessing as mp
import random
import time
from typing import Any

import numpy as np
import pytest

import shmeval
from helpers import INPUT_SHAPE, OUTPUTS, fake_factory, fake_model, make_state, run_threads

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


def run_workers(ev: Any, ctx_name: str) -> None:
    ctx = mp.get_context(ctx_name)
    q = ctx.Queue()
    procs = [ctx.Process(target=conservation_worker, args=(ev, w, 1234 + w, q))
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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ctx_name", ["spawn", "fork"])
def test_thread_evaluator(ctx_name: str) -> None:
    with shmeval.Evaluator(fake_model, **KW) as ev:
        run_workers(ev, ctx_name)


@pytest.mark.timeout(300)
def test_spawned_evaluator() -> None:
    with shmeval.Evaluator.spawn(fake_factory, **KW) as ev:
        run_workers(ev, "spawn")


@pytest.mark.timeout(120)
def test_threads_of_one_process() -> None:
    """Several threads of one process share its client entry's slots."""

    errors: list[str] = []
    sent: list[int] = []
    with shmeval.Evaluator(fake_model, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                           slots_per_client=4) as ev:
        def run(t: int) -> None:
            for j in range(500):
                tag = tag_of(t, j)
                if j % 3:
                    out = ev.evaluate(make_state(tag))
                    sent.append(1)
                    if out["value"] != -tag:
                        errors.append(f"{tag}: {out}")
                else:
                    tags = [tag_of(t, j + 50_000 + i) for i in range(6)]
                    many = ev.evaluate_many(np.stack([make_state(x) for x in tags]))
                    sent.append(len(tags))
                    if not (many["value"] == -np.array(tags, np.float32)).all():
                        errors.append(f"{tags}: {many}")

        run_threads(run, 8, 60)
        assert not errors, errors[:3]
        assert ev.stats()["requests"] == sum(sent)
