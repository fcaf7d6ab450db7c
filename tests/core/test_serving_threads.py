"""Pipelined serving (``serving_threads=N``): N threads of the evaluator take
turns collecting batches (one at a time) and run up to N model calls at once.

What must hold, checked under load with a model whose calls really overlap
(it sleeps with the GIL released):
- every request answered exactly once with its own result (no slot taken by
  two threads, none lost), the statistics exact (counters written from
  several threads);
- the calls did overlap (else the tests below would prove nothing);
- model errors and slow-path outputs in one thread's batch fail or convert
  only that batch;
- weight updates and closing under load: see test_hotswap.py and
  test_reliability.py ("serving_threads" variants).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest

import shmeval
from shmeval import _ring, segment
from helpers import INPUT_SHAPE, OUTPUTS, fake_model, gen, is_final, make_state, serve_config
from conservation import KW, run_workers


class OverlapModel:
    """helpers.fake_model, sleeping (GIL released) inside every call, and
    counting how many calls were in progress at once."""

    def __init__(self, sleep_s: float = 200e-6) -> None:
        self.sleep_s = sleep_s
        self.lock = threading.Lock()
        self.active = 0
        self.max_active = 0
        self.calls = 0

    def __call__(self, x: np.ndarray) -> dict[str, np.ndarray]:
        with self.lock:
            self.active += 1
            self.calls += 1
            self.max_active = max(self.max_active, self.active)
        try:
            time.sleep(self.sleep_s)
            return {"policy": x[:, 0, :, 0] * 2 + np.arange(7, dtype=np.float32),
                    "value": x[:, 5, 6, 1].copy()}
        finally:
            with self.lock:
                self.active -= 1


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["overlapping", "contended"])
def test_conservation(case: str) -> None:
    """overlapping: model calls of 200 µs overlap; contended: instant model
    calls and batches of at most 2, so the 4 threads collect back to back.
    A scan collision without the collect lock is rare enough that these
    runs pass without it; test_one_collector_at_a_time is the test that
    fails then."""
    if case == "overlapping":
        model, kw = OverlapModel(), dict(KW, serving_threads=3)
    else:
        model, kw = OverlapModel(0), dict(KW, serving_threads=4, max_batch=2)
    with shmeval.Evaluator(model, **kw) as ev:
        run_workers(ev, "spawn")  # every answer right, stats exact
        assert ev.stats()["batches"] == model.calls
    assert model.max_active >= 2, "the serving threads never overlapped their model calls"


class Flaky(OverlapModel):
    """Raises for batches holding a tag divisible by 7; returns float64
    (the slow path: converted) for batches holding a tag divisible by 5."""

    def __call__(self, x: np.ndarray) -> Any:
        out = super().__call__(x)
        tags = -x[:, 5, 6, 1]
        if (tags % 7 == 0).any():
            raise RuntimeError("seven")
        if (tags % 5 == 0).any():
            return {k: v.astype(np.float64) for k, v in out.items()}
        return out


@pytest.mark.timeout(120)
def test_errors_fail_only_their_batch() -> None:
    """Each request alone in its batch (max_batch=1), from 6 threads: those
    whose model call raised fail, the converted ones and the rest are
    answered, from whichever serving thread took them."""
    model = Flaky()
    with shmeval.Evaluator(model, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=1,
                           serving_threads=3) as ev:
        wrong: list[str] = []

        def run(t: int) -> None:
            for j in range(1, 150):
                tag = t * 1000 + j
                try:
                    out = ev.evaluate(make_state(tag))
                except shmeval.ModelError as e:
                    if tag % 7 or "seven" not in str(e):
                        wrong.append(f"{tag}: {e}")
                    continue
                if tag % 7 == 0 or float(out["value"]) != -tag:
                    wrong.append(f"{tag}: {out}")

        threads = [threading.Thread(target=run, args=(t,)) for t in range(1, 7)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads)
        assert not wrong, wrong[:5]
        s = ev.stats()
        assert s["requests"] == 6 * 149
        assert s["failed_requests"] == sum(1 for t in range(1, 7) for j in range(1, 150)
                                           if (t * 1000 + j) % 7 == 0)
    assert model.max_active >= 2


@pytest.mark.parametrize("bad", [0, 9, 1.5, "2"])
def test_bad_thread_count(bad: Any) -> None:
    with pytest.raises(ValueError, match="serving_threads"):
        shmeval.Evaluator(OverlapModel(), input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                          serving_threads=bad)


def test_one_thread_is_the_default() -> None:
    with shmeval.Evaluator(OverlapModel(0), input_shape=INPUT_SHAPE, outputs=OUTPUTS) as ev:
        assert float(ev.evaluate(make_state(4))["value"]) == -4
        assert ev._config.policy.threads == 1



@pytest.mark.timeout(60)
def test_one_collector_at_a_time() -> None:
    """While one Server of a group holds the collect lock (serve() returned
    IDLE with it), another Server of the group does not take requests; it
    takes them once the lock is released.  in_flight counts outstanding
    batches."""
    from test_ring_unit import Rig

    rig = Rig()
    try:
        rig.serve()
        group = _ring.ServeGroup()
        batch_a = np.zeros_like(rig.batch)
        a = _ring.Server(rig.seg, batch_a, group, 1)
        b = _ring.Server(rig.seg, np.zeros_like(rig.batch), group, 2)
        a.configure(serve_config(8), 1_000_000)
        b.configure(serve_config(8), 300_000_000)
        kind = a.serve(fake_model, 0)
        assert kind[0] == _ring.SERVE_IDLE  # nothing posted: a holds the lock
        c = rig.seg.register(os.getpid(), 0, 0)
        rig.post(c, [0], [11])
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(
            b.serve(fake_model, 0)))
        t.start()
        time.sleep(0.3)
        assert rig.seg.slot_state(c, 0)[0] == 2, "b collected while a held the lock"  # READY
        assert group.in_flight == 0
        a.unlock()
        t.join(10)
        assert not t.is_alive() and got[0][0] == _ring.SERVE_IDLE
        assert is_final(rig.seg, c, 0)
        outs = rig.outs()
        rig.seg.fetch(c, 0, gen(rig.seg, c, 0), outs, 0)
        assert outs[1][0] == -11
        b.unlock()
        # A batch taken by collect() counts as in flight until finished.
        rig.post(c, [1], [12])
        assert a.collect(8, 0, 0, 10_000_000) == 1 and group.in_flight == 1
        out = fake_model(batch_a[:1])
        a.complete([np.ascontiguousarray(out[k]) for k in rig.spec.output_names], 0)
        assert group.in_flight == 0
        rig.seg.fetch(c, 1, gen(rig.seg, c, 1), outs, 0)
        assert outs[1][0] == -12
    finally:
        segment.unlink(rig.name)
