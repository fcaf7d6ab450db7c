"""Ceilings of this machine and of shmeval's core, measured in one run.

* the machine's wake-up cost: a C futex ping-pong between two processes,
  pinned to one core and free (bench/c/futex_pingpong.c);
* the core without Python clients: N client processes written in C against
  ring.h (bench/c/ring_client.c) served by Evaluator.spawn with a null model,
  beside the same evaluator serving N Python workers that call evaluate()
  (from the benchmark's C loop, shmeval.bench._timing.timed_calls, as the
  workers of shmeval bench do);
* with --timers, each of those again with a 100 ms timer on every sleep
  (the ping-pong) or without the client's ticker, so that every sleep has
  one (the clients): what sleeping without a timer saves.  Runs alternate
  within each repeat.

Needs gcc.  Usage: python bench/ceiling.py [--workers 16] [--seconds 3]
[--repeats 3] [--timers] [--json PATH]
"""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

import shmeval
from shmeval.bench.roundtrip import NullModel
from shmeval.bench._timing import timed_calls

HERE = os.path.dirname(os.path.abspath(__file__))
INPUT_SHAPE = (6, 7, 2)
OUTPUTS = {"policy": ((7,), "float32"), "value": ((), "float32")}


# The benchmark's null model, for the Connect Four state's 7 moves.
null_factory = functools.partial(NullModel, 7)


def build(tmp: str) -> tuple[str, str]:
    core = os.path.join(os.path.dirname(shmeval.__file__), "_core")
    out = []
    for name in ("futex_pingpong", "ring_client"):
        exe = os.path.join(tmp, name)
        subprocess.run(["gcc", "-O2", "-std=gnu11", "-D_GNU_SOURCE", f"-I{core}", "-o", exe,
                        os.path.join(HERE, "c", name + ".c"), "-lrt", "-pthread"], check=True)
        out.append(exe)
    return out[0], out[1]


def python_worker(ev: Any, seconds: float, start: Any, q: Any, timer: bool = False) -> None:
    state = np.zeros(INPUT_SHAPE, np.float32)
    for _ in range(200):
        ev.evaluate(state)
    if timer:  # as if no ticker could be started: every sleep has a timer
        ev._attach().stop_ticker()
    start.wait()
    # The loop in C, as in shmeval bench: the calls of evaluate() without
    # the interpreter's loop around them.
    n, _ = timed_calls(ev.evaluate, state, time.perf_counter_ns() + int(seconds * 1e9),
                       np.empty(0, np.int64))
    q.put(n)


def run_c_clients(client_exe: str, workers: int, seconds: float, timer: bool = False) -> float:
    with shmeval.Evaluator.spawn(null_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS) as ev:
        procs = [subprocess.Popen([client_exe, ev.address, str(seconds)] + ["timer"] * timer,
                                  stdout=subprocess.PIPE)
                 for _ in range(workers)]
        total = sum(int(p.communicate(timeout=seconds + 60)[0]) for p in procs)
    return total / seconds


def run_python_clients(workers: int, seconds: float, timer: bool = False) -> float:
    ctx = mp.get_context("spawn")
    with shmeval.Evaluator.spawn(null_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS) as ev:
        q: Any = ctx.Queue()
        start = ctx.Event()
        procs = [ctx.Process(target=python_worker, args=(ev, seconds, start, q, timer))
                 for _ in range(workers)]
        for p in procs:
            p.start()
        time.sleep(1.0 + 0.1 * workers)  # let every worker attach and warm up
        start.set()
        total: int = sum(q.get(timeout=seconds + 120) for _ in procs)
        for p in procs:
            p.join(30)
    return total / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timers", action="store_true",
                    help="also measure each with a timer on every sleep")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    variants = [False, True] if args.timers else [False]
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pingpong, client = build(tmp)

        def measure(key: str, fn: Any, order: list[bool]) -> None:
            for timer in order:
                results.setdefault(key + ("_timer" if timer else ""), []).append(fn(timer))

        for r in range(args.repeats):
            order = variants[::-1] if r % 2 else variants  # alternate which goes first
            measure("pingpong_free_us", lambda t: float(subprocess.check_output(
                [pingpong] + ["timer"] * t)), order)
            measure("pingpong_pinned_us", lambda t: float(subprocess.check_output(
                [pingpong, "pin"] + ["timer"] * t)), order)
            measure("c_clients_per_s", lambda t: run_c_clients(client, args.workers, args.seconds, t), order)
            measure("python_clients_per_s", lambda t: run_python_clients(args.workers, args.seconds, t),
                    order)
            print(f"[{r + 1}/{args.repeats}] " + "  ".join(
                f"{k} {v[-1]:,.1f}" for k, v in results.items()), flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nmachine: {os.cpu_count()} CPUs, {sys.version.split()[0]}; medians of {args.repeats}")
    for timer in variants:
        x = "_timer" if timer else ""
        if args.timers:
            print("with a timer on every sleep:" if timer else "sleeping without a timer:")
        print(f"futex ping-pong, free          {med['pingpong_free_us' + x]:8.2f} µs per round trip")
        print(f"futex ping-pong, one core      {med['pingpong_pinned_us' + x]:8.2f} µs per round trip")
        c, py = med["c_clients_per_s" + x], med["python_clients_per_s" + x]
        print(f"{args.workers} C clients -> shmeval      {c:10,.0f} round trips/s")
        print(f"{args.workers} Python clients -> shmeval {py:10,.0f} round trips/s"
              f"  ({py / c:.2f} of the C clients)")
    if args.timers:
        print("without a timer against with one: " + ", ".join(
            f"{k} {med[k] / med[k + '_timer']:.2f}x" for k in
            ("pingpong_pinned_us", "c_clients_per_s", "python_clients_per_s")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "medians": med}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
