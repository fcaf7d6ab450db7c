"""The round-trip demo, ``shmeval demo``: N worker processes evaluate
Connect Four-sized states one at a time through one evaluator serving a
small NumPy policy-value network, and it prints throughput, latency and the
evaluator's statistics.  It needs nothing beyond shmeval itself (no
TensorFlow): the shortest look at the core at work.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any, Dict

import numpy as np

import shmeval

INPUT_SHAPE = (6, 7, 2)
OUTPUTS = {"policy": ((7,), "float32"), "value": ((), "float32")}


class TinyNet:
    """A two-layer NumPy policy-value network with fixed random weights: the
    built-in default model (no TensorFlow, no downloads)."""

    def __init__(self, hidden: int = 64, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        n_in = int(np.prod(INPUT_SHAPE))
        self.w1 = (rng.standard_normal((n_in, hidden)) / np.sqrt(n_in)).astype(np.float32)
        self.w2 = (rng.standard_normal((hidden, 8)) / np.sqrt(hidden)).astype(np.float32)

    def __call__(self, x: np.ndarray) -> Dict[str, np.ndarray]:
        h = np.maximum(x.reshape(len(x), -1) @ self.w1, 0)
        z = h @ self.w2
        logits = z[:, :7] - z[:, :7].max(axis=1, keepdims=True)
        p = np.exp(logits)
        return {"policy": p / p.sum(axis=1, keepdims=True), "value": np.tanh(z[:, 7])}


def tiny_net() -> TinyNet:
    return TinyNet()


def _worker(ev: Any, seed: int, seconds: float, start: Any, q: Any) -> None:
    rng = np.random.default_rng(seed)
    states = rng.integers(0, 2, size=(64,) + INPUT_SHAPE).astype(np.float32)
    for i in range(100):  # attach and warm up before the clock starts
        ev.evaluate(states[i % 64])
    start.wait()
    lat = np.empty(1_000_000, np.int64)
    n = 0
    t_end = time.perf_counter() + seconds
    while n < len(lat):
        t0 = time.perf_counter_ns()
        ev.evaluate(states[n % 64])
        lat[n] = time.perf_counter_ns() - t0
        n += 1
        if (n & 127) == 0 and time.perf_counter() >= t_end:
            break
    q.put((n, lat[:n][:: max(1, n // 20000)]))


def run(workers: int = 8, seconds: float = 5.0, max_batch: int = 256) -> Dict[str, Any]:
    """Runs the demo; returns its figures."""
    ctx = mp.get_context("spawn")
    with shmeval.Evaluator.spawn(tiny_net, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                 max_batch=max_batch) as ev:
        q: Any = ctx.Queue()
        start = ctx.Event()
        procs = [ctx.Process(target=_worker, args=(ev, i, seconds, start, q))
                 for i in range(workers)]
        for p in procs:
            p.start()
        time.sleep(0.5)
        t0 = time.perf_counter()
        start.set()
        results = [q.get(timeout=seconds + 120) for _ in procs]
        elapsed = time.perf_counter() - t0
        for p in procs:
            p.join(30)
        stats = ev.stats()
    counts = np.array([r[0] for r in results])
    lat = np.concatenate([r[1] for r in results]) / 1e3
    return {
        "workers": workers,
        "seconds": elapsed,
        "round_trips_per_s": float(counts.sum() / seconds),
        "p50_us": float(np.percentile(lat, 50)),
        "p99_us": float(np.percentile(lat, 99)),
        "slowest_worker_share": float(counts.min() / counts.mean()),
        "mean_batch": stats["mean_batch"],
        "stats": stats,
    }
