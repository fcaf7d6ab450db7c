"""CPU per answer of the blocking and the pipelined client: W worker
processes evaluate one state at a time against a spawned evaluator with
the null model, either blocking (``evaluate``, timed in C by
``timed_calls``) or with K submissions in flight (``submit`` and
``result()``, timed in C by ``timed_pipelined``), for a window of
``--seconds``.  Prints answers/s and, per answer, the workers' user and
system CPU, their voluntary context switches and the evaluator process's
user and system CPU (from /proc).  Alternates the two clients
``--rounds`` times.

    python bench/pipelined_cpu.py --workers 16 --depth 4 --rounds 2
"""
from __future__ import annotations

import argparse
import collections
import functools
import multiprocessing as mp
import resource
import time
from typing import Any

import numpy as np

import shmeval
from shmeval._util.procstat import cpu_split_s
from shmeval.bench._timing import timed_calls, timed_pipelined
from shmeval.bench.roundtrip import NullModel

SHAPE = (6, 7, 2)


def worker(ev: Any, q: Any, seconds: float, depth: int, go: Any) -> None:
    s = np.zeros(SHAPE, np.float32)
    s1 = s[None]
    lat = np.zeros(1, np.int64)
    pend = collections.deque(ev.submit(s1) for _ in range(depth)) if depth else None
    for _ in range(2000):  # warm-up
        if pend is not None:
            pend.popleft().result()
            pend.append(ev.submit(s1))
        else:
            ev.evaluate(s)
    go.wait()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t_end = time.perf_counter_ns() + int(seconds * 1e9)
    if pend is not None:
        n, _ = timed_pipelined(ev.submit, s1, pend, t_end, lat)
    else:
        n, _ = timed_calls(ev.evaluate, s, t_end, lat)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    q.put((n, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, r1.ru_nvcsw - r0.ru_nvcsw))


def run(workers: int, depth: int, seconds: float) -> None:
    ctx = mp.get_context("spawn")
    ev = shmeval.Evaluator.spawn(functools.partial(NullModel, 7), input_shape=SHAPE,
                                 input_dtype="float32",
                                 outputs={"policy": ((7,), "float32"), "value": ((), "float32")})
    try:
        q, go = ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=worker, args=(ev, q, seconds, depth, go))
                 for _ in range(workers)]
        for p in procs:
            p.start()
        time.sleep(3 + 0.3 * workers)  # started and warmed up
        e0 = cpu_split_s(ev.pid)
        go.set()
        time.sleep(seconds)
        e1 = cpu_split_s(ev.pid)
        rs = [q.get(timeout=120) for _ in procs]
        for p in procs:
            p.join()
        n = sum(r[0] for r in rs)
        us = 1e6 / n
        name = f"K = {depth}" if depth else "blocking"
        print(f"{workers} workers, {name:8s}: {n / seconds:>9,.0f} answers/s; per answer: "
              f"worker user {sum(r[1] for r in rs) * us:.2f} µs, system "
              f"{sum(r[2] for r in rs) * us:.2f} µs, {sum(r[3] for r in rs) / n:.3f} sleeps; "
              f"evaluator user {(e1[0] - e0[0]) * us:.2f} µs, system {(e1[1] - e0[1]) * us:.2f} µs",
              flush=True)
    finally:
        ev.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--depth", type=int, default=4, help="submissions in flight per worker")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    for _ in range(args.rounds):
        for depth in (0, args.depth):
            run(args.workers, depth, args.seconds)


if __name__ == "__main__":
    main()
