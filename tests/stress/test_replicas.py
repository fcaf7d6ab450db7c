"""Several model replicas behind one address (Evaluator.spawn(replicas=N) or
devices=[...]): they share the work, a dead replica's requests are served
by the others, and the evaluator dies with its last replica.  (Weight
updates across replicas: core/test_hotswap.py, mode "replicas".)"""
from __future__ import annotations

import functools
import multiprocessing as mp
import os
import signal
import time
from typing import Any, Callable, Optional

import numpy as np
import pytest

import shmeval
from conservation import KW, run_workers
from helpers import (check_answer, fake_model, make_state, own_segments, running,
                     slow_fake_factory, wait_for_requests)

JOIN_S = 120


def device_model(device: str) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """factory(device): the fake model, sleeping 2 ms per batch (the GIL
    released, as a device call would)."""
    return functools.partial(sleepy, seconds=0.002)


def sleepy(x: np.ndarray, seconds: float) -> dict[str, np.ndarray]:
    time.sleep(seconds)
    return fake_model(x)


def refusing_factory(device: str) -> Any:
    if device == "cpu:1":
        raise RuntimeError(f"no such device: {device}")
    return fake_model


class DeclaredModel:
    """A model whose prepare() checks the spec against what it computes: the
    replica on cpu:1 computes a 9-way policy, not the declared 7."""

    def __init__(self, device: str) -> None:
        self.width = 9 if device == "cpu:1" else 7

    def prepare(self, spec: Any, buckets: Any) -> None:
        if spec.outputs[0].shape != (self.width,):
            raise ValueError(f"this net's policy has {self.width} moves, the spec "
                             f"declares {spec.outputs[0].shape}")

    def __call__(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return fake_model(x)


@pytest.mark.timeout(300)
def test_replicas_share_the_work_and_lose_nothing() -> None:
    with shmeval.Evaluator.spawn(device_model, devices=["cpu:0", "cpu:1"], **KW) as ev:
        assert len(ev.pids) == 2 and len(set(ev.pids)) == 2 and ev.pid == ev.pids[0]
        run_workers(ev, "spawn")     # every request answered once, with its own answer
        reps = ev.stats()["replicas"]
        assert [r["device"] for r in reps] == ["cpu:0", "cpu:1"]
        assert [r["pid"] for r in reps] == ev.pids
        assert all(r["state"] == "serving" and r["requests"] > 0 and r["batches"] > 0
                   for r in reps), reps
        assert sum(r["requests"] for r in reps) == ev.stats()["requests"]


def load(ev: Any, worker: int, stop: Any, q: Any) -> None:
    sent = bad = 0
    error: Optional[str] = None
    try:
        while not stop.is_set():
            tag = worker * 100_000 + sent
            out = ev.evaluate(make_state(tag))
            bad += int(out["value"] != -tag)
            sent += 1
    except shmeval.ShmevalError as e:
        error = f"{type(e).__name__}: {e}"
    q.put((worker, sent, bad, error))


@pytest.mark.timeout(300)
def test_a_dead_replica_is_replaced_by_the_others_until_none_is_left() -> None:
    """SIGKILL of one replica under load: no worker notices (its batch in
    flight is served by the other), stats() says it is dead.  SIGKILL of the
    last one: every worker raises EvaluatorDied.  Without restarts
    (restarts=0: tests/stress/test_restarts.py has them)."""
    ctx = mp.get_context("spawn")
    with shmeval.Evaluator.spawn(functools.partial(slow_fake_factory, 0.003), replicas=2,
                                 restarts=0, **KW) as ev:
        stop, q = ctx.Event(), ctx.Queue()
        ps = [ctx.Process(target=load, args=(ev, w, stop, q)) for w in range(6)]
        with running(ps, stop, JOIN_S):
            deadline = time.monotonic() + 60
            wait_for_requests(ev, 300, deadline)
            os.kill(ev.pids[1], signal.SIGKILL)
            while ev.stats()["replicas"][1]["state"] != "dead":
                assert time.monotonic() < deadline, "the dead replica was never found"
                time.sleep(0.01)
            before = ev.stats()["requests"]
            while ev.stats()["requests"] < before + 300:
                assert time.monotonic() < deadline, "serving stopped with one replica left"
                time.sleep(0.01)
            stop.set()
            results = [q.get(timeout=JOIN_S) for _ in ps]
        assert all(r[3] is None and r[2] == 0 for r in results), results
        check_answer(ev.evaluate(make_state(11)), 11)
        os.kill(ev.pids[0], signal.SIGKILL)
        with pytest.raises(shmeval.EvaluatorDied, match="every replica of the evaluator"):
            for _ in range(100):
                ev.evaluate(make_state(12))
    assert ev.stats()["state"] == "died"
    assert ev.stats()["restarts"] == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("factory,words", [
    (refusing_factory, "replica 1, cpu:1.*no such device: cpu:1"),
    (DeclaredModel, "replica 1, cpu:1.*policy has 9 moves"),
])
def test_a_replica_that_fails_to_start_fails_the_evaluator_cleanly(
        factory: Any, words: str) -> None:
    before = own_segments()
    with pytest.raises(shmeval.ModelError, match=words):
        shmeval.Evaluator.spawn(factory, devices=["cpu:0", "cpu:1"], **KW)
    assert own_segments() == before
    children = mp.active_children()
    assert not [c for c in children if c.name.startswith("shmeval-evaluator")], children


@pytest.mark.parametrize("kw,error", [
    (dict(replicas=0), ValueError), (dict(replicas=65), ValueError),
    (dict(replicas=2, devices=["cpu:0"]), ValueError), (dict(devices=[]), ValueError),
    (dict(devices="cuda:0"), TypeError), (dict(replicas=1.5), ValueError),
])
def test_replica_arguments_are_checked_first(kw: dict[str, Any], error: type) -> None:
    before = own_segments()
    with pytest.raises(error):
        shmeval.Evaluator.spawn(device_model, **kw, **KW)
    assert own_segments() == before


CRASH_TAG = 666


def crashing_on_one(device: str) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """factory(device): the fake model, 2 ms a call; on cpu:1 a batch with
    CRASH_TAG ends its serving thread (an error that is not an Exception,
    which no batch catches)."""
    return functools.partial(crash_or_answer, crash=device == "cpu:1")


def crash_or_answer(x: np.ndarray, crash: bool) -> dict[str, np.ndarray]:
    time.sleep(0.002)
    if crash and (x[:, 0, 0, 0] == CRASH_TAG).any():
        raise SystemExit("a serving thread ends")
    return fake_model(x)


@pytest.mark.timeout(120)
def test_a_crashed_serving_thread_stops_only_its_replica() -> None:
    """One serving thread of replica 1 raises out of its loop: replica 1
    stops (its batch is served by replica 0 once its process is gone), the
    evaluator stays open, and every request is answered, the crashing one
    too.  Without restarts (restarts=0), which would start replica 1 again."""
    with shmeval.Evaluator.spawn(crashing_on_one, devices=["cpu:0", "cpu:1"],
                                 serving_threads=2, restarts=0, **KW) as ev:
        deadline = time.monotonic() + 60
        while ev.stats()["replicas"][1]["state"] in ("empty", "serving"):
            assert time.monotonic() < deadline, "replica 1 never took the crashing request"
            check_answer(ev.evaluate(make_state(CRASH_TAG)), CRASH_TAG)
        for i in range(50):
            check_answer(ev.evaluate(make_state(i)), i)
        assert ev.stats()["state"] == "serving"
        assert [r["state"] for r in ev.stats()["replicas"]] == ["serving", "stopped"]
