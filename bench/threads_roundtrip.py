#!/usr/bin/env python
"""Round trips/s of several threads of one process against one evaluator.

The threads share the process's client entry, hence one doorbell bit
(docs/protocol.md, *Doorbells*): a ring for one thread's answer wakes every
thread of the process that sleeps, and those whose answer is not there yet
sleep again.  This measures what that costs, e.g.

    python bench/threads_roundtrip.py --threads 8 --repeats 3

against an earlier commit's build on PYTHONPATH (docs/performance.md,
*Reproducing*).  The evaluator is spawned with the benchmark's null model
(Connect Four shapes; it echoes the state's first element); each thread calls evaluate() in a loop and counts the round trips
that end inside the window.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import threading
import time

import numpy as np

import shmeval
from shmeval.bench.roundtrip import NullModel


def one_run(ev: shmeval.Evaluator, threads: int, seconds: float, warmup: float) -> float:
    counts = [0] * threads
    start = time.monotonic() + warmup
    end = start + seconds

    def loop(i: int) -> None:
        state = np.zeros((6, 7, 2), np.float32)
        state[0, 0, 0] = i
        n = 0
        while True:
            out = ev.evaluate(state)
            now = time.monotonic()
            if now > end:
                break
            if now > start:
                n += 1
        if out["value"] != i:
            raise RuntimeError(f"thread {i} got another thread's answer")
        counts[i] = n

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(seconds + warmup + 30)
        if t.is_alive():
            raise RuntimeError("a thread did not finish")
    return sum(counts) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with shmeval.Evaluator.spawn(functools.partial(NullModel, 7), input_shape=(6, 7, 2),
                                 outputs={"policy": ((7,), "float32"), "value": ((), "float32")},
                                 max_batch=64) as ev:
        rates = [one_run(ev, args.threads, args.seconds, args.warmup) for _ in range(args.repeats)]
    print(f"{args.threads} threads of one process: {statistics.median(rates):,.0f} round trips/s "
          f"(median of {args.repeats}; " + ", ".join(f"{r:,.0f}" for r in rates) + ")")


if __name__ == "__main__":
    main()
