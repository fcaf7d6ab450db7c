"""CPU time a worker spends inside one call that sends R states.

N worker processes (default 8) each loop: one call that sends R Connect
Four states (default 8) and waits for the answers, then a busy loop standing in for the search (default
350 µs, about 8 leaves of the self-play search).  An ``Evaluator.spawn``
evaluator serves them with a model that sleeps (default 1 ms per batch, a
stand-in for a small net; it leaves the CPUs to the workers).  Each worker
measures the process CPU time inside its calls.  Three ways to send the
same rows, alternating round by round in the same run:

  many     ``evaluate_many(states)``
  submit   ``submit(states).result()``: the pipelined call, used blocking
  single   one ``evaluate`` per row (for scale)

All three post through the port's one request path
(``ClientPort._post`` and ``Pending._collect``); they differ in what
each adds around it.

Usage: python bench/evaluate_many_cpu.py [--workers 8] [--rows 8]
       [--search-us 350] [--model-ms 1] [--calls 400] [--rounds 2]
"""
from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import time
from typing import Any

import numpy as np

import shmeval

SHAPE = (6, 7, 2)
OUTPUTS = {"policy": ((7,), "float32"), "value": ((), "float32")}
WAYS = ("many", "submit", "single")


def _model(x: np.ndarray, seconds: float) -> dict[str, np.ndarray]:
    time.sleep(seconds)
    return {"policy": np.zeros((len(x), 7), np.float32), "value": x[:, 0, 0, 0].copy()}


def _factory(seconds: float) -> Any:
    return functools.partial(_model, seconds=seconds)


def _busy(us: int) -> None:
    end = time.perf_counter_ns() + us * 1000
    while time.perf_counter_ns() < end:
        pass


def _worker(ev: Any, way: str, rows: int, search_us: int, calls: int, q: Any) -> None:
    x = np.random.default_rng().random((rows,) + SHAPE, dtype=np.float32)
    want = x[:, 0, 0, 0].copy()

    def call() -> np.ndarray:
        if way == "many":
            return np.asarray(ev.evaluate_many(x)["value"])
        if way == "submit":
            return np.asarray(ev.submit(x).result()["value"])
        return np.array([ev.evaluate(x[i])["value"] for i in range(rows)])

    for _ in range(20):  # registers, warms up
        call()
    cpu = 0
    clock = time.process_time_ns
    for _ in range(calls):
        c0 = clock()
        got = call()
        cpu += clock() - c0
        _busy(search_us)
    if not np.array_equal(got, want):
        raise RuntimeError(f"{way}: wrong answers")
    q.put(cpu / calls / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--search-us", type=int, default=350)
    ap.add_argument("--model-ms", type=float, default=1.0)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    ev = shmeval.Evaluator.spawn(functools.partial(_factory, a.model_ms / 1e3),
                                 input_shape=SHAPE, outputs=OUTPUTS, max_batch=256,
                                 slots_per_client=max(16, a.rows))
    results: dict[str, list[float]] = {w: [] for w in WAYS}
    with ev:
        for _ in range(a.rounds):
            for way in WAYS:
                q = ctx.Queue()
                ps = [ctx.Process(target=_worker, args=(ev, way, a.rows, a.search_us, a.calls, q))
                      for _ in range(a.workers)]
                for p in ps:
                    p.start()
                per = [q.get(timeout=600) for _ in ps]
                for p in ps:
                    p.join(timeout=60)
                    if p.exitcode != 0:
                        raise SystemExit(f"a {way} worker failed (exit code {p.exitcode})")
                results[way].append(float(np.median(per)))
    print(f"{a.workers} workers, {a.rows} rows per call, search {a.search_us} µs, "
          f"model {a.model_ms} ms per batch; CPU µs inside one call, median over the "
          f"workers, per round:")
    for way in WAYS:
        print(f"  {way:8s} " + "  ".join(f"{v:6.1f}" for v in results[way]))
    many = np.median(results["many"])
    print("over many, medians of the rounds: " + "  ".join(
        f"{way} {np.median(results[way]) / many:.2f}x" for way in WAYS[1:]))


if __name__ == "__main__":
    main()
