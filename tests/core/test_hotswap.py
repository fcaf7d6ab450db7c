"""Weight hot-swap: ``Evaluator.set_weights`` / ``load_weights`` between
batches, and the model version stamped on every result.

The model here is the fake model of helpers.py plus a weight w added to the
value: the weights of version v are w = WEIGHT_STEP * v, so every answer can
be checked against the weights of the version it says computed it.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import random
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

import shmeval
from helpers import (INPUT_SHAPE, OUTPUTS, WeightedModel, make_state, run_threads, running,
                     settled_stats, wait_for_requests)

WEIGHT_STEP = 1000.0
JOIN_TIMEOUT = 120


class SlowWeightedModel(WeightedModel):
    """WeightedModel that reads its weight, then sleeps with the GIL released
    before using it: with several serving threads, calls overlap, and an
    update applied during a call would be stamped on outputs computed with
    the old weight."""

    def __call__(self, x: np.ndarray) -> dict[str, np.ndarray]:
        w = self.w
        time.sleep(100e-6)
        return {"policy": x[:, 0, :, 0] * 2 + np.arange(7, dtype=np.float32),
                "value": x[:, 5, 6, 1] + w}


class NoWeights:
    def __call__(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return WeightedModel()(x)


def weights_of(version: int) -> list[np.ndarray]:
    return [np.float32(WEIGHT_STEP * version)]


def good(tags: np.ndarray, policy: np.ndarray, value: np.ndarray,
         versions: np.ndarray) -> np.ndarray:
    """Rows whose outputs are the model's for their tag under the weights
    of the version stamped on them."""
    t = tags.astype(np.float32)
    want_policy = 2 * t[:, None] + np.arange(7, dtype=np.float32)
    want_value = -t + (WEIGHT_STEP * versions).astype(np.float32)
    return (policy == want_policy).all(axis=1) & (value == want_value)


def make(mode: str, **kw: Any) -> shmeval.Evaluator:
    args: dict[str, Any] = dict(input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=32,
                                max_clients=16, slots_per_client=8)
    args.update(kw)
    if mode == "thread":
        return shmeval.Evaluator(WeightedModel(), **args)
    if mode == "serving_threads":
        return shmeval.Evaluator.spawn(SlowWeightedModel, serving_threads=3, **args)
    if mode == "replicas":
        return shmeval.Evaluator.spawn(SlowWeightedModel, replicas=2, serving_threads=2, **args)
    return shmeval.Evaluator.spawn(args.pop("factory", WeightedModel), **args)


# ---------------------------------------------------------------- basics
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["thread", "spawn", "replicas"])
def test_versions_are_stamped(mode: str, tmp_path: Any) -> None:
    with make(mode) as ev:
        out, v = ev.evaluate(make_state(3), return_version=True)
        assert v == 0 and ev.model_version == 0 and float(out["value"]) == -3.0
        assert ev.set_weights(weights_of(1)) == 1
        out, v = ev.evaluate(make_state(3), return_version=True)
        assert v == 1 and float(out["value"]) == -3.0 + WEIGHT_STEP
        # Plain evaluate returns the dict alone, as before.
        assert float(ev.evaluate(make_state(3))["value"]) == -3.0 + WEIGHT_STEP
        # A chosen version (e.g. the learner's step) must increase.
        np.savez(tmp_path / "w.npz", np.float32(WEIGHT_STEP * 7))
        assert ev.load_weights(tmp_path / "w.npz", version=7) == 7
        outs, vs = ev.evaluate_many(np.stack([make_state(t) for t in range(40)]),
                                    return_version=True)
        assert vs.dtype == np.int64 and vs.tolist() == [7] * 40
        assert good(np.arange(40), outs["policy"], outs["value"], vs).all()
        with pytest.raises(ValueError, match="larger than the current model version 7"):
            ev.set_weights(weights_of(8), version=7)
        s = settled_stats(ev, "model_version", 7)
        assert s["weight_updates"] == 2 and s["failed_requests"] == 0
        assert ev.model_version == 7
        # Through a pickled handle (another process's view) too.
        h = pickle.loads(pickle.dumps(ev))
        assert h.evaluate(make_state(1), return_version=True)[1] == 7
        assert h.evaluate_many(np.zeros((0,) + INPUT_SHAPE, np.float32),
                               return_version=True)[1].shape == (0,)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["thread", "spawn", "replicas"])
def test_refused_updates_change_nothing(mode: str, tmp_path: Any) -> None:
    with make(mode) as ev:
        with pytest.raises(shmeval.ModelError, match="expected one scalar weight"):
            ev.set_weights([np.zeros(3), np.zeros(2)])
        with pytest.raises(shmeval.ModelError, match="load_weights failed"):
            ev.load_weights(tmp_path / "missing.npz")
        assert ev.model_version == 0
        out, v = ev.evaluate(make_state(5), return_version=True)
        assert v == 0 and float(out["value"]) == -5.0
        # A refused update does not use up its version number.
        assert ev.set_weights(weights_of(1)) == 1
        assert settled_stats(ev, "model_version", 1)["weight_updates"] == 1


@pytest.mark.timeout(60)
def test_model_without_set_weights() -> None:
    with shmeval.Evaluator(NoWeights(), input_shape=INPUT_SHAPE, outputs=OUTPUTS) as ev:
        with pytest.raises(shmeval.ModelError, match=r"has no set_weights\(\) method"):
            ev.set_weights(weights_of(1))
        assert ev.evaluate(make_state(2), return_version=True)[1] == 0


@pytest.mark.timeout(60)
def test_set_weights_only_in_the_owner() -> None:
    with make("thread") as ev:
        ctx = mp.get_context("fork")
        q = ctx.Queue()

        def child() -> None:
            try:
                ev.set_weights(weights_of(1))
                q.put("no error")
            except shmeval.ShmevalError as e:
                q.put(str(e))

        p = ctx.Process(target=child)
        p.start()
        msg = q.get(timeout=30)
        p.join(30)
        assert "only the process that created the evaluator" in msg
        assert ev.model_version == 0


@pytest.mark.timeout(60)
def test_set_weights_after_close_and_after_death() -> None:
    ev = make("thread")
    ev.close()
    with pytest.raises(shmeval.EvaluatorClosed):
        ev.set_weights(weights_of(1))
    ev = make("spawn", restarts=0)  # with restarts: tests/stress/test_restarts.py
    try:
        os.kill(ev.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(shmeval.EvaluatorDied):
            ev.set_weights(weights_of(1), timeout=30)
        assert time.monotonic() - t0 < 20
    finally:
        ev.close()


# ---------------------------------------------------------------- under load
def swap_worker(ev: Any, worker: int, stop: Any, q: Any) -> None:
    """Evaluates until stop is set; checks every answer against the weights
    of its stamped version and that versions never go backwards."""
    rng = random.Random(worker)
    sent = bad = backwards = 0
    last = 0
    seen: set[int] = set()
    first_bad = ""
    j = 0
    while not stop.is_set() or sent < 200:
        if rng.random() < 0.5:
            tags = np.array([worker * 100_000 + j])
            out, v = ev.evaluate(make_state(int(tags[0])), return_version=True)
            policy, value, vs = out["policy"][None], out["value"][None], np.array([v])
        else:
            m = rng.randint(1, 20)
            tags = worker * 100_000 + j + np.arange(m)
            out, vs = ev.evaluate_many(np.stack([make_state(int(t)) for t in tags]),
                                       return_version=True)
            policy, value = out["policy"], out["value"]
        ok = good(tags, policy, value, vs)
        if not ok.all() and not first_bad:
            i = int(np.argmin(ok))
            first_bad = f"tag {tags[i]} version {vs[i]}: value {value[i]}"
        bad += int((~ok).sum())
        # Rows of one call may come from different batches; all of them are
        # at least as new as anything this worker saw before the call.
        if vs.min() < last:
            backwards += 1
        last = max(last, int(vs.max()))
        seen.update(int(v) for v in vs)
        sent += len(tags)
        j += len(tags)
        if j > 90_000:
            j = 0
    q.put((worker, sent, bad, backwards, sorted(seen), first_bad))


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["thread", "spawn", "serving_threads", "replicas"])
def test_hot_swap_under_load(mode: str) -> None:
    """Requests keep flowing while weights change 40 times: none fails or is
    lost, each answer matches the weights of the version stamped on it, and
    no worker sees versions go backwards."""
    workers, updates = 6, 40
    ctx = mp.get_context("spawn")
    with make(mode) as ev:
        stop, q = ctx.Event(), ctx.Queue()
        ps = [ctx.Process(target=swap_worker, args=(ev, i, stop, q)) for i in range(workers)]
        with running(ps, stop, JOIN_TIMEOUT):
            # Let every worker get going (each does >= 200 requests anyway).
            wait_for_requests(ev, 2000, time.monotonic() + 60)
            before = ev.stats()["requests"]
            for v in range(1, updates + 1):
                assert ev.set_weights(weights_of(v)) == v
                time.sleep(0.01)
            during = ev.stats()["requests"] - before
            stop.set()
            results = [q.get(timeout=JOIN_TIMEOUT) for _ in ps]
        assert all(p.exitcode == 0 for p in ps), [p.exitcode for p in ps]
        sent = sum(r[1] for r in results)
        s = settled_stats(ev, "requests", sent)
        assert s["failed_requests"] == 0 and s["stale_completions"] == 0
        assert s["model_version"] == updates and s["weight_updates"] == updates
        assert during > 0, "requests stopped flowing during the updates"
        for worker, n, bad, backwards, seen, first_bad in results:
            assert bad == 0, (worker, bad, first_bad)
            assert backwards == 0, (worker, backwards)
        # The swaps happened under load: answers came from many versions.
        versions_seen = set().union(*(set(r[4]) for r in results))
        assert len(versions_seen) > updates // 2, sorted(versions_seen)


@pytest.mark.timeout(60)
def test_concurrent_updates_from_threads() -> None:
    """Several threads of the owner updating at once: each update gets its
    own version, applied in order."""
    with make("thread") as ev:
        got: list[int] = []
        lock = threading.Lock()

        def updater(i: int) -> None:
            for _ in range(10):
                v = ev.set_weights([np.float32(0)])
                with lock:
                    got.append(v)

        run_threads(updater, 4, timeout=50)
        assert sorted(got) == list(range(1, 41))
        assert ev.model_version == 40
        assert ev.evaluate(make_state(1), return_version=True)[1] == 40


class RefusingOnOne(WeightedModel):
    """WeightedModel whose replica on cpu:1 refuses every update."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device

    def set_weights(self, weights: list[np.ndarray]) -> None:
        if self.device == "cpu:1":
            raise ValueError("this replica refuses updates")
        super().set_weights(weights)


@pytest.mark.timeout(120)
def test_an_update_one_replica_refused_outlives_the_others() -> None:
    """Replica 1 refuses an update that replica 0 applies: from the moment
    set_weights returns, every answer is of the new weights (replica 1 waits
    for an update it can take).  When replica 0 dies, replica 1 serves again
    with the weights it has (a floor nobody serves must not hang every
    client)."""
    with make("spawn", devices=["cpu:0", "cpu:1"], factory=RefusingOnOne) as ev:
        with pytest.raises(shmeval.ModelError, match="replica 1: .*refuses updates"):
            ev.set_weights(weights_of(1))
        for i in range(40):
            out, v = ev.evaluate(make_state(i), return_version=True)
            assert v == 1 and float(out["value"]) == -i + WEIGHT_STEP, (i, v)
        os.kill(ev.pids[0], signal.SIGKILL)
        p = ev.submit(np.stack([make_state(7)]), return_version=True)
        outs, versions = p.result(timeout=30)
        assert versions.tolist() == [0] and float(outs["value"][0]) == -7.0
