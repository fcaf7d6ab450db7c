"""Every method of the benchmark suite serves each worker its own answers, and
the harness's routing check fails when a server gets the routing wrong.

Short windows, no timed assertions: these check correctness, not speed.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
from multiprocessing.synchronize import SemLock
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from shmeval.bench import METHODS, STATES
from shmeval.bench._timing import timed_calls, timed_pipelined
from shmeval.bench.baselines import LocksemMethod, QueueMethod
from shmeval.bench.roundtrip import NullModel, ShmevalMethod, TrialConfig, run_trial

WORKERS = 3
CONFIG = TrialConfig(seconds=0.3, warmup=20, samples=1_000, max_batch=256)
SPEC = STATES["c4"]


class DyingClient:
    """Evaluates through ``inner``, then ends its worker process with exit
    code 3 on call ``die_at``: a worker that dies without reporting."""

    def __init__(self, inner: Any, die_at: int) -> None:
        self.inner = inner
        self.die_at = die_at
        self.calls = 0

    def evaluate(self, state: np.ndarray) -> Any:
        self.calls += 1
        if self.calls == self.die_at:
            os._exit(3)
        return self.inner.evaluate(state)


class WrappingMethod(ShmevalMethod):
    """shmeval, its clients passed through ``wrap`` in the parent (only the
    wrapped clients travel to the workers)."""

    def __init__(self, wrap: Callable[[list[Any]], list[Any]]) -> None:
        super().__init__()
        self.wrap = wrap

    def start(self, *args: Any) -> list[Any]:
        return self.wrap(super().start(*args))


class PolicyCheckingClient:
    """Evaluates through ``inner`` after checking the worker's scheduling
    policy."""

    def __init__(self, inner: Any, policy: int) -> None:
        self.inner = inner
        self.policy = policy

    def evaluate(self, state: np.ndarray) -> Any:
        got = os.sched_getscheduler(0)
        if got != self.policy:
            raise RuntimeError(f"worker scheduling policy {got}, expected {self.policy}")
        return self.inner.evaluate(state)


class NextWorkersValue(NullModel):
    """Answers worker i with worker i+1's value: what a server that mixed up
    its replies would send.  Module level, so spawned servers can import it."""

    def __call__(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        out = super().__call__(batch)
        return {"policy": out["policy"], "value": out["value"] + 1}


def _live_semlocks() -> dict[int, str]:
    return {id(o): o._semlock.name for o in gc.get_objects() if isinstance(o, SemLock)}


@pytest.fixture(autouse=True)
def no_semaphore_outlives_its_trial() -> Iterator[None]:
    """Every multiprocessing semaphore a trial made (Queue locks, Events,
    locksem's wake-ups) is gone after it, hence unlinked from /dev/shm: a
    spawn-context semaphore's name is unlinked when its object is finalised.
    (The names themselves cannot be checked in /dev/shm: other programs on
    the machine make and drop such names at any time.)"""
    before = _live_semlocks()
    yield
    gc.collect()
    left = {k: v for k, v in _live_semlocks().items() if k not in before}
    assert not left, f"semaphores still alive after the trial: {sorted(left.values())}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(METHODS))
def test_each_worker_gets_its_own_answers(name: str) -> None:
    method = METHODS[name]()
    trial = run_trial(method, name, WORKERS, SPEC, CONFIG)
    # run_trial raises on any reply whose value is not the worker's id; here
    # every worker also made progress inside the window.
    assert len(trial["worker_counts"]) == WORKERS
    assert min(trial["worker_counts"]) > 0
    assert trial["round_trips"] == sum(trial["worker_counts"])
    assert trial["throughput"] > 0
    assert trial["terminated"] == []
    server = trial["server"]
    # Every round trip went through the server: the warm-ups, the window's,
    # and the last one of each worker, which ended after the window.
    assert server["requests"] >= trial["round_trips"] + WORKERS * (CONFIG.warmup + 1)
    # A pipelined client keeps `depth` requests of each worker in flight.
    assert 1 <= server["mean_batch"] <= WORKERS * getattr(method, "depth", 1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(METHODS))
def test_misrouted_answers_fail_the_trial(name: str) -> None:
    with pytest.raises(RuntimeError, match="bad reply"):
        run_trial(METHODS[name](model=NextWorkersValue), name, WORKERS, SPEC, CONFIG)


@pytest.mark.timeout(120)
def test_locksem_unlinks_its_block() -> None:
    method = LocksemMethod()
    run_trial(method, "locksem", 2, STATES["go"], CONFIG)
    assert method.shm_name is not None
    assert not os.path.exists(os.path.join("/dev/shm", method.shm_name.lstrip("/")))


@pytest.mark.timeout(120)
def test_a_failed_method_fails_the_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The run goes on past a failed trial, reports it and exits 1."""
    from shmeval import cli

    monkeypatch.setitem(METHODS, "queue", functools.partial(QueueMethod, model=NextWorkersValue))
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "--workers", "1", "--methods", "queue,pipe", "--state", "c4", "--seconds", "0.2",
                     "--repeats", "1", "--warmup", "5", "--no-reference", "--no-batch-path", "--json", str(out)])
    assert code == 1
    data = json.loads(out.read_text())
    assert data["failures"] == ["queue x1 (c4, repetition 1)"]
    by_method = {t["method"]: t for t in data["trials"]}
    assert "bad reply" in by_method["queue"]["error"]
    assert by_method["pipe"]["throughput"] > 0  # the run went on
    printed = capsys.readouterr()
    assert "FAILED" in printed.out and "bad reply" in printed.err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("die_at", [CONFIG.warmup // 2, CONFIG.warmup + 50])
def test_a_worker_that_dies_fails_the_trial(die_at: int) -> None:
    """A worker that exits without a word, during its warm-up or in the
    window, fails the trial at once (its result pipe ends) instead of
    leaving the harness waiting for the setup timeout."""
    with pytest.raises(RuntimeError, match="worker 0 died"):
        method = WrappingMethod(lambda cs: [DyingClient(cs[0], die_at), *cs[1:]])
        run_trial(method, "shmeval", WORKERS, SPEC, CONFIG)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sched, policy", [("batch", os.SCHED_BATCH), ("normal", os.SCHED_OTHER)])
def test_workers_run_under_the_chosen_policy(sched: str, policy: int) -> None:
    """--worker-sched reaches every worker of the trial (checked on every call)."""
    method = WrappingMethod(lambda cs: [PolicyCheckingClient(c, policy) for c in cs])
    run_trial(method, "shmeval", 2, SPEC, dataclasses.replace(CONFIG, worker_sched=sched))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["shmeval", "queue"])
def test_python_loop_serves_each_worker(name: str) -> None:
    """--loop python: the same trial with the timed loop in bytecode."""
    trial = run_trial(METHODS[name](), name, WORKERS, SPEC, dataclasses.replace(CONFIG, loop="python"))
    assert min(trial["worker_counts"]) > 0
    assert trial["round_trips"] == sum(trial["worker_counts"])


class Recorder:
    """A callable that returns a fresh object per call, and notes whether the
    previous one was still alive while it ran (the caller held it)."""

    def __init__(self, sleep_ns: int = 0) -> None:
        self.calls = 0
        self.previous: Any = None
        self.previous_alive: list[bool] = []
        self.sleep_ns = sleep_ns

    def __call__(self, arg: int) -> Any:
        import time
        import weakref

        if self.previous is not None:
            self.previous_alive.append(self.previous() is not None)
        if self.sleep_ns:
            end = time.perf_counter_ns() + self.sleep_ns
            while time.perf_counter_ns() < end:
                pass
        self.calls += 1
        out = Box(arg, self.calls)
        self.previous = weakref.ref(out)
        return out


@dataclasses.dataclass
class Box:
    arg: int
    call: int


def test_timed_calls_counts_times_and_holds_results() -> None:
    import time

    fn = Recorder(sleep_ns=200_000)
    lat = np.zeros(5, np.int64)
    count, out = timed_calls(fn, 7, time.perf_counter_ns() + 200_000_000, lat)
    # Every call but the last ended inside the window; the last is returned.
    assert count == fn.calls - 1 and count > len(lat)
    assert out == Box(7, fn.calls)
    # Each latency is one call's (at least its busy wait), none left unset.
    assert (lat >= 200_000).all() and (lat < 200_000_000).all()
    # As in `out = fn(arg)`: each result lives until the next call returns.
    assert fn.previous_alive and all(fn.previous_alive)


class FakePending:
    def __init__(self, n: int) -> None:
        self.n = n

    def result(self) -> int:
        return self.n


def test_timed_pipelined_collects_the_oldest_and_keeps_the_depth() -> None:
    import collections
    import time

    submitted = []

    def submit(states: str) -> FakePending:
        assert states == "s"
        submitted.append(FakePending(len(submitted)))
        return submitted[-1]

    pendings = collections.deque(submit("s") for _ in range(3))
    lat = np.zeros(4, np.int64)
    count, out = timed_pipelined(submit, "s", pendings, time.perf_counter_ns() + 50_000_000, lat)
    calls = len(submitted) - 3  # one submit per collect
    assert count == calls - 1 and count > len(lat) and (lat > 0).all()
    # Collected in submission order: the last result is the oldest of the
    # three in flight before the last call, and three are still in flight,
    # oldest first.
    assert out == calls - 1
    assert [p.n for p in pendings] == [calls, calls + 1, calls + 2]
    with pytest.raises(ValueError, match="at least one"):
        timed_pipelined(submit, "s", [], time.perf_counter_ns(), lat)

    def failing(states: str) -> None:
        raise KeyError(states)

    pendings = collections.deque([FakePending(0), FakePending(1)])
    with pytest.raises(KeyError):
        timed_pipelined(failing, "s", pendings, time.perf_counter_ns() + 10**9, lat)
    assert len(pendings) == 2  # nothing lost from the deque


def test_timed_calls_passes_on_errors_and_signals() -> None:
    import signal
    import time

    lat = np.zeros(4, np.int64)
    with pytest.raises(ValueError, match="int64"):
        timed_calls(abs, 1, 0, np.zeros(4, np.int32))

    def failing(arg: int) -> None:
        raise KeyError(arg)

    with pytest.raises(KeyError):
        timed_calls(failing, 3, time.perf_counter_ns() + 10**9, lat)

    class Alarm(Exception):
        pass

    def handler(signum: int, frame: Any) -> None:
        raise Alarm

    # abs runs no bytecode: only the loop's own signal check can stop it
    # before its 30 s window ends.
    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        t0 = time.monotonic()
        with pytest.raises(Alarm):
            timed_calls(abs, -1, time.perf_counter_ns() + 30 * 10**9, lat)
        assert time.monotonic() - t0 < 20
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_trial_config_refuses_unknown_choices() -> None:
    with pytest.raises(ValueError, match="loop"):
        TrialConfig(loop="cython")
    with pytest.raises(ValueError, match="worker_sched"):
        TrialConfig(worker_sched="fifo")
