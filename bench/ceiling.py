"""Ceilings of this machine and of shmeval's core, measured in one run.

* the machine's wake-up cost: a C futex ping-pong between two processes,
  pinned to one core and free (bench/c/futex_pingpong.c);
* the core without Python clients: N client processes written in C against
  ring.h (bench/c/ring_client.c) served by Evaluator.spawn with a null model,
  beside the same evaluator serving N Python workers that call evaluate().

Needs gcc.  Usage: python bench/ceiling.py [--workers 16] [--seconds 3]
[--repeats 3] [--json PATH]
"""
from __future__ import annotations

import argparse
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

HERE = os.path.dirname(os.path.abspath(__file__))
INPUT_SHAPE = (6, 7, 2)
OUTPUTS = {"policy": ((7,), "float32"), "value": ((), "float32")}


def null_model(x: np.ndarray) -> dict[str, np.ndarray]:
    n = len(x)
    return {"policy": np.zeros((n, 7), np.float32), "value": x.reshape(n, -1)[:, 0]}


def null_factory() -> Any:
    return null_model


def build(tmp: str) -> tuple[str, str]:
    core = os.path.join(os.path.dirname(shmeval.__file__), "_core")
    out = []
    for name in ("futex_pingpong", "ring_client"):
        exe = os.path.join(tmp, name)
        subprocess.run(["gcc", "-O2", "-std=gnu11", "-D_GNU_SOURCE", f"-I{core}", "-o", exe,
                        os.path.join(HERE, "c", name + ".c"), "-lrt", "-pthread"], check=True)
        out.append(exe)
    return out[0], out[1]


def python_worker(ev: Any, seconds: float, start: Any, q: Any) -> None:
    state = np.zeros(INPUT_SHAPE, np.float32)
    for _ in range(200):
        ev.evaluate(state)
    start.wait()
    n = 0
    end = time.perf_counter() + seconds
    evaluate = ev.evaluate
    while time.perf_counter() < end:
        evaluate(state)
        n += 1
    q.put(n)


def run_c_clients(client_exe: str, workers: int, seconds: float) -> float:
    with shmeval.Evaluator.spawn(null_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS) as ev:
        procs = [subprocess.Popen([client_exe, ev.address, str(seconds)], stdout=subprocess.PIPE)
                 for _ in range(workers)]
        total = sum(int(p.communicate(timeout=seconds + 60)[0]) for p in procs)
    return total / seconds


def run_python_clients(workers: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    with shmeval.Evaluator.spawn(null_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS) as ev:
        q: Any = ctx.Queue()
        start = ctx.Event()
        procs = [ctx.Process(target=python_worker, args=(ev, seconds, start, q))
                 for _ in range(workers)]
        for p in procs:
            p.start()
        time.sleep(1.0 + 0.1 * workers)  # let every worker attach and warm up
        start.set()
        total = sum(q.get(timeout=seconds + 120) for _ in procs)
        for p in procs:
            p.join(30)
    return total / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    results: dict[str, list[float]] = {"pingpong_free_us": [], "pingpong_pinned_us": [],
                                       "c_clients_per_s": [], "python_clients_per_s": []}
    with tempfile.TemporaryDirectory() as tmp:
        pingpong, client = build(tmp)
        for r in range(args.repeats):
            results["pingpong_free_us"].append(float(subprocess.check_output([pingpong])))
            results["pingpong_pinned_us"].append(float(subprocess.check_output([pingpong, "pin"])))
            results["c_clients_per_s"].append(run_c_clients(client, args.workers, args.seconds))
            results["python_clients_per_s"].append(run_python_clients(args.workers, args.seconds))
            print(f"[{r + 1}/{args.repeats}] " + "  ".join(
                f"{k} {v[-1]:,.1f}" for k, v in results.items()), flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nmachine: {os.cpu_count()} CPUs, {sys.version.split()[0]}; medians of {args.repeats}")
    print(f"futex ping-pong, free          {med['pingpong_free_us']:8.2f} µs per round trip")
    print(f"futex ping-pong, one core      {med['pingpong_pinned_us']:8.2f} µs per round trip")
    print(f"{args.workers} C clients -> shmeval      {med['c_clients_per_s']:10,.0f} round trips/s")
    print(f"{args.workers} Python clients -> shmeval {med['python_clients_per_s']:10,.0f} round trips/s"
          f"  ({med['python_clients_per_s'] / med['c_clients_per_s']:.2f} of the C clients)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "medians": med}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
