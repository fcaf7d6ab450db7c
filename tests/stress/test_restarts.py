"""Evaluator.spawn(restarts=N): a serving process that dies is started
again by the owner, its requests in flight served by the new one, the
weights serving applied before it serves; workers see nothing until the
restarts run out, then EvaluatorDied as without restarts."""
from __future__ import annotations

import functools
import multiprocessing as mp
import os
import signal
import time
from typing import Any, Optional

import numpy as np
import pytest

import shmeval
from conservation import KW
from helpers import WeightedModel, expected, make_state, running, slow_fake_model

JOIN_S = 120
WORKERS = 6
#: Requests served between two kills, and how long one may take.
BETWEEN_KILLS = 300
STEP_S = 60.0


def slow_factory() -> Any:
    return functools.partial(slow_fake_model, seconds=0.002)


def slow_device_factory(device: str) -> Any:
    return slow_factory()


def load(ev: Any, worker: int, stop: Any, q: Any) -> None:
    """Evaluates in a loop, checking every answer, until stop or an error:
    (worker, answered, wrong, the error or None, when it came)."""
    sent = bad = 0
    error: Optional[str] = None
    try:
        while not stop.is_set():
            tag = worker * 100_000 + sent
            out = ev.evaluate(make_state(tag))
            policy, value = expected(tag)
            bad += int(out["value"] != value or not np.array_equal(out["policy"], policy))
            sent += 1
    except shmeval.ShmevalError as e:
        error = f"{type(e).__name__}: {e}"
    q.put((worker, sent, bad, error, time.monotonic()))


def served(ev: Any, n: int, replica: Optional[int] = None) -> None:
    """Waits until ev (or one replica of it) served n more requests."""
    def count() -> int:
        st = ev.stats()
        return int(st["requests"] if replica is None else st["replicas"][replica]["requests"])
    deadline = time.monotonic() + STEP_S
    target = count() + n
    while count() < target:
        assert time.monotonic() < deadline, f"serving stopped (replica {replica})"
        time.sleep(0.01)


def kill_and_await_restart(ev: Any, replica: int, restarts: int) -> None:
    """SIGKILLs one replica's process and waits until its restart serves."""
    old = ev.pids[replica]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + STEP_S
    while len(ev.stats()["restarts"]) < restarts:
        assert time.monotonic() < deadline, "the killed process was not restarted"
        time.sleep(0.01)
    rec = ev.stats()["restarts"][-1]
    assert rec["replica"] == replica and rec["pid"] == old, rec
    assert rec["why"] == "killed by signal 9" and rec["error"] == "", rec
    assert ev.pids[replica] == rec["new_pid"] != old


@pytest.mark.timeout(300)
def test_a_killed_evaluator_is_restarted_until_the_restarts_run_out() -> None:
    """One replica, SIGKILLed three times under load with restarts=3: no
    worker sees an error, every answer is right, every request is answered
    (a lost one would hang its worker).  A fourth kill: every worker raises
    EvaluatorDied within a bounded time."""
    ctx = mp.get_context("spawn")
    with shmeval.Evaluator.spawn(slow_factory, restarts=3, **KW) as ev:
        stop, q = ctx.Event(), ctx.Queue()
        ps = [ctx.Process(target=load, args=(ev, w, stop, q)) for w in range(WORKERS)]
        with running(ps, stop, JOIN_S):
            for i in range(3):
                served(ev, BETWEEN_KILLS)
                kill_and_await_restart(ev, 0, i + 1)
            served(ev, BETWEEN_KILLS)
            assert q.empty(), "a worker stopped before the restarts ran out"
            killed = time.monotonic()
            os.kill(ev.pid, signal.SIGKILL)
            results = [q.get(timeout=JOIN_S) for _ in ps]
        assert all(r[2] == 0 for r in results), results
        assert all(r[3] is not None and r[3].startswith("EvaluatorDied") for r in results), \
            results
        assert max(r[4] for r in results) - killed < 5.0, results
        st = ev.stats()
        assert st["state"] == "died"
        assert len(st["restarts"]) == 3
        assert all(r["why"] == "killed by signal 9" for r in st["restarts"])


@pytest.mark.timeout(300)
def test_a_killed_replica_is_restarted_and_serves_again() -> None:
    """Two replicas, one SIGKILLed three times under load: no worker sees
    an error or a wrong answer, and after each restart the new process
    serves requests again (capacity comes back)."""
    ctx = mp.get_context("spawn")
    with shmeval.Evaluator.spawn(slow_device_factory, devices=["cpu:0", "cpu:1"], restarts=3,
                                 **KW) as ev:
        stop, q = ctx.Event(), ctx.Queue()
        ps = [ctx.Process(target=load, args=(ev, w, stop, q)) for w in range(WORKERS)]
        with running(ps, stop, JOIN_S):
            for i in range(3):
                served(ev, BETWEEN_KILLS, replica=1)
                kill_and_await_restart(ev, 1, i + 1)
            served(ev, BETWEEN_KILLS, replica=1)  # the last new process serves
            assert q.empty(), "a worker stopped"
            stop.set()
            results = [q.get(timeout=JOIN_S) for _ in ps]
        assert all(r[3] is None and r[2] == 0 and r[1] > 0 for r in results), results
        st = ev.stats()
        assert st["state"] == "serving"
        assert [r["state"] for r in st["replicas"]] == ["serving", "serving"]
        assert [r["pid"] for r in st["replicas"]] == ev.pids
        assert [r["replica"] for r in st["restarts"]] == [1, 1, 1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_restarted_replica_serves_the_current_weights(replicas: int) -> None:
    """set_weights(v1), then the serving process is killed: the restarted
    one answers with v1's weights, stamped version 1, never 0."""
    with shmeval.Evaluator.spawn(WeightedModel, replicas=replicas, restarts=replicas + 1,
                                 **KW) as ev:
        assert ev.set_weights([np.float32(1000.0)]) == 1
        for r in range(replicas):
            kill_and_await_restart(ev, r, r + 1)
        for i in range(200):
            out, version = ev.evaluate(make_state(i), return_version=True)
            assert version == 1 and out["value"] == -i + 1000.0, (i, version, out)
        assert [rep["model_version"] for rep in ev.stats()["replicas"]] == [1] * replicas
        assert ev.set_weights([np.float32(2000.0)]) == 2  # the new pipes carry updates
        out, version = ev.evaluate(make_state(7), return_version=True)
        assert version == 2 and out["value"] == -7 + 2000.0
        # An update while replica 0 is down (between its death and its
        # restart): the others, or the restarted one, apply it.
        os.kill(ev.pids[0], signal.SIGKILL)
        assert ev.set_weights([np.float32(3000.0)]) == 3
        out, version = ev.evaluate(make_state(8), return_version=True)
        assert version == 3 and out["value"] == -8 + 3000.0
        deadline = time.monotonic() + STEP_S
        while len(ev.stats()["restarts"]) < replicas + 1:
            assert time.monotonic() < deadline, "the killed process was not restarted"
            time.sleep(0.01)
        assert [rep["model_version"] for rep in ev.stats()["replicas"]] == [3] * replicas


@pytest.mark.timeout(60)
@pytest.mark.parametrize("restarts", [-1, 1.5, "3", True])
def test_restarts_is_checked(restarts: Any) -> None:
    with pytest.raises(ValueError, match="restarts must be an int >= 0"):
        shmeval.Evaluator.spawn(slow_factory, restarts=restarts, **KW)


CRASH_TAG = 4242


def crash_once(flag: str, x: np.ndarray) -> dict[str, np.ndarray]:
    """The fake model, whose first batch holding CRASH_TAG ends the serving
    loop (an error that is not an Exception, which no batch catches)."""
    if (x[:, 0, 0, 0] == CRASH_TAG).any() and not os.path.exists(flag):
        open(flag, "w").close()
        raise SystemExit("the serving loop ends")
    return WeightedModel()(x)


def crash_once_factory(flag: str) -> Any:
    return functools.partial(crash_once, flag)


@pytest.mark.timeout(120)
def test_a_crashed_serving_loop_is_restarted(tmp_path: Any) -> None:
    """The serving loop raises out (its process exits with code 1): the
    evaluator stays open, the restarted process answers the request whose
    batch crashed, and later ones."""
    factory = functools.partial(crash_once_factory, str(tmp_path / "crashed"))
    with shmeval.Evaluator.spawn(factory, restarts=1, serving_threads=1, **KW) as ev:
        old = ev.pid
        out = ev.evaluate(make_state(CRASH_TAG))
        assert out["value"] == -CRASH_TAG
        deadline = time.monotonic() + STEP_S
        while not ev.stats()["restarts"]:  # the answer may come before the record
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert ev.pid != old
        rec, = ev.stats()["restarts"]
        assert rec["why"] == "exited with code 1" and rec["error"] == "", rec
        for i in range(20):
            assert ev.evaluate(make_state(i))["value"] == -i


@pytest.mark.timeout(300)
def test_every_replica_killed_at_once_is_restarted() -> None:
    """Both replicas SIGKILLed at once under load: the first restarted one
    finds nobody serving and puts its own batches back, then takes the
    lock over from the other dead one; the second waits until the first
    put its batches back.  No worker sees an error or a wrong answer."""
    ctx = mp.get_context("spawn")
    with shmeval.Evaluator.spawn(slow_device_factory, devices=["cpu:0", "cpu:1"], restarts=2,
                                 **KW) as ev:
        stop, q = ctx.Event(), ctx.Queue()
        ps = [ctx.Process(target=load, args=(ev, w, stop, q)) for w in range(WORKERS)]
        with running(ps, stop, JOIN_S):
            served(ev, BETWEEN_KILLS)
            for pid in ev.pids:
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + STEP_S
            while len(ev.stats()["restarts"]) < 2:
                assert time.monotonic() < deadline, "the killed processes were not restarted"
                time.sleep(0.01)
            served(ev, BETWEEN_KILLS, replica=0)
            served(ev, BETWEEN_KILLS, replica=1)
            assert q.empty(), "a worker stopped"
            stop.set()
            results = [q.get(timeout=JOIN_S) for _ in ps]
        assert all(r[3] is None and r[2] == 0 and r[1] > 0 for r in results), results
        st = ev.stats()
        assert [r["state"] for r in st["replicas"]] == ["serving", "serving"]
        assert sorted(r["replica"] for r in st["restarts"]) == [0, 1]


def slow_to_restart(flag: str) -> Any:
    """The fake model; built again (a restart), it takes 2 s to build."""
    if os.path.exists(flag):
        time.sleep(2.0)
    else:
        open(flag, "w").close()
    return slow_factory()


@pytest.mark.timeout(120)
def test_a_process_being_restarted_reads_restarting(tmp_path: Any) -> None:
    """Between a serving process's death and its restart, readers of the
    segment say "restarting" (not "died": the owner will start it again),
    and "serving" once the new process serves."""
    factory = functools.partial(slow_to_restart, str(tmp_path / "built"))
    with shmeval.Evaluator.spawn(factory, restarts=1, **KW) as ev:
        ev.evaluate(make_state(1))
        os.kill(ev.pid, signal.SIGKILL)
        seen = set()
        deadline = time.monotonic() + STEP_S
        while not ev.stats()["restarts"] or ev.stats()["state"] != "serving":
            assert time.monotonic() < deadline, "the killed process was not restarted"
            seen.add(ev.stats()["state"])
            time.sleep(0.01)
        assert "restarting" in seen and "died" not in seen, seen
        policy, value = expected(2)
        out = ev.evaluate(make_state(2))
        assert out["value"] == value and np.array_equal(out["policy"], policy)
