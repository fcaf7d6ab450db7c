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

import numpy as np
import pytest

import shmeval
from conservation import KW, run_workers, tag_of
from helpers import INPUT_SHAPE, OUTPUTS, fake_factory, fake_model, make_state, run_threads


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
