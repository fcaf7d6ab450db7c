"""Fake model and states shared by the tests (importable by spawn children)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from shmeval._util import children

INPUT_SHAPE = (6, 7, 2)
OUTPUTS = {"policy": ((7,), "float32"), "value": ((), "float32")}


def serve_config(max_batch: int = 8, **kw: Any) -> Any:
    """The settings of a Server driven by hand (Server.configure): fixed,
    so that no tuner is needed (greedy, no spin, one serving thread);
    ``kw`` changes any of them."""
    from shmeval.config import ServeConfig

    return ServeConfig(**{"input_shape": INPUT_SHAPE, "outputs": OUTPUTS, "max_batch": max_batch,
                          "max_wait_us": 0, "evaluator_spin_us": 0, "serving_threads": 1, **kw})


def fake_model(x: np.ndarray) -> dict[str, np.ndarray]:
    """Deterministic function of each row: policy[k] = 2*x[0,k,0] + k,
    value = x[5,6,1].  Exact in float32 for the integers the tests use."""
    return {"policy": x[:, 0, :, 0] * 2 + np.arange(7, dtype=np.float32),
            "value": x[:, 5, 6, 1].copy()}


def fake_factory() -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    return fake_model


def make_state(tag: int) -> np.ndarray:
    """A state whose fake-model result identifies tag."""
    s = np.zeros(INPUT_SHAPE, np.float32)
    s[0, :, 0] = tag
    s[5, 6, 1] = -tag
    return s

class WeightedModel:
    """fake_model with value = -tag + w; w set by set_weights([w]) (one
    scalar; anything else is refused) or load_weights(an .npz of it)."""

    def __init__(self) -> None:
        self.w = np.float32(0)

    def __call__(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return {"policy": x[:, 0, :, 0] * 2 + np.arange(7, dtype=np.float32),
                "value": x[:, 5, 6, 1] + self.w}

    def set_weights(self, weights: list[np.ndarray]) -> None:
        if len(weights) != 1 or np.shape(weights[0]) != ():
            raise ValueError(f"expected one scalar weight, got {len(weights)} arrays")
        self.w = np.float32(weights[0])

    def load_weights(self, path: str) -> None:
        with np.load(path) as f:
            self.set_weights([f["arr_0"]])



def expected(tag: int) -> tuple[np.ndarray, float]:
    return np.full(7, 2.0 * tag, np.float32) + np.arange(7, dtype=np.float32), float(-tag)


def settled_stats(ev: Any, key: str, value: Any, timeout: float = 5.0) -> dict[str, Any]:
    """ev.stats() once stats[key] == value, waiting up to timeout (counters
    written by another process are read with relaxed loads: a snapshot)."""
    s: dict[str, Any] = ev.stats()
    deadline = time.monotonic() + timeout
    while s[key] != value and time.monotonic() < deadline:
        time.sleep(0.005)
        s = ev.stats()
    assert s[key] == value, (key, s[key], value, s)
    return s


def own_segments() -> set[str]:
    """Segments created by this process (their names embed the creator pid)."""
    prefix = f"shmeval-{os.getpid()}-"
    return {e for e in os.listdir("/dev/shm") if e.startswith(prefix)}


def make_ev(model: Callable[[np.ndarray], Any] = fake_model, **kw: Any) -> Any:
    """A thread Evaluator over the fake-model spec, small capacities."""
    import shmeval

    args: dict[str, Any] = dict(input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=32,
                                max_clients=8, slots_per_client=8)
    args.update(kw)
    return shmeval.Evaluator(model, **args)


def check_answer(out: dict[str, np.ndarray], tag: int) -> None:
    """out is the fake model's answer for make_state(tag), dtypes and shapes too."""
    policy, value = expected(tag)
    assert out["policy"].shape == (7,) and out["policy"].dtype == np.float32
    assert out["value"].shape == () and out["value"].dtype == np.float32
    np.testing.assert_array_equal(out["policy"], policy)
    assert float(out["value"]) == value


def run_threads(target: Callable[[int], None], n: int, timeout: float) -> None:
    """Runs target(0..n-1) in n threads; fails if any is still running after
    timeout seconds (a hang fails the test instead of blocking it)."""
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    assert not any(th.is_alive() for th in threads), "a thread hung"


def wait_for_requests(ev: Any, n: int, deadline: float) -> None:
    """Returns once ev has served n requests, or once time.monotonic()
    passes deadline, whichever comes first."""
    while ev.stats()["requests"] < n and time.monotonic() < deadline:
        time.sleep(0.01)


@contextlib.contextmanager
def running(processes: Sequence[Any], stop: Any, timeout: float) -> Iterator[None]:
    """Starts the processes; on leaving (also on an error), sets the event
    stop and joins each process, killing one still alive after timeout
    seconds."""
    for p in processes:
        p.start()
    try:
        yield
    finally:
        stop.set()
        for p in processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()


def run_python(code: str, timeout: float = 50.0) -> "subprocess.CompletedProcess[str]":
    """Runs ``python -c code`` in a fresh interpreter (this one's
    executable), with the tests directory importable; returns the finished
    process, output captured as text."""

    paths = [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=env)


#: A figure as the benchmark scripts print it (thousands separated by commas).
NUMBER = r"[\d,]+(?:\.\d+)?"


def number(text: str) -> float:
    """The value of a figure that matched NUMBER."""
    return float(text.replace(",", ""))


def run_bench(script: str, *args: str, timeout: float, **env: str) -> str:
    """Runs ``bench/<script> args`` in this interpreter with unbuffered
    output (and the environment variables ``env`` set); asserts that it
    exited 0 (showing the ends of its output when not) and returns its
    stdout."""
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    r = subprocess.run([sys.executable, os.path.join(bench, script), *args],
                       capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, PYTHONUNBUFFERED="1", **env))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def slow_fake_model(x: np.ndarray, seconds: float) -> dict[str, np.ndarray]:
    time.sleep(seconds)
    return fake_model(x)


def slow_fake_factory(seconds: float) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """For Evaluator.spawn(functools.partial(slow_fake_factory, s)): the
    fake model, taking s seconds per batch."""
    import functools

    return functools.partial(slow_fake_model, seconds=seconds)


def gen(seg: Any, c: int, k: int) -> int:
    """A slot's generation now (low-level Segment tests): what a client that
    began the slot's current request names in its wait, fetch and release
    (the tests of stale generations pass others on purpose)."""
    return int(seg.slot_state(c, k)[2])


def is_final(seg: Any, c: int, k: int) -> bool:
    """The slot holds an answer (DONE) or an error (FAILED)."""
    from shmeval import _ring

    return seg.slot_state(c, k)[0] in (_ring.DONE, _ring.FAILED)


#: The command line of a busy loop (bench/ab_builds.py --busy, bench/autotune.py
#: --timeline) after the interpreter, as /proc/<pid>/cmdline holds it.
BUSY_LOOP = [arg.encode() for arg in children.BUSY_LOOP]


def command_lines() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, argv) of every process this user can see."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    yield int(entry), f.read().split(b"\0")
            except OSError:
                continue
