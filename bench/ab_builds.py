#!/usr/bin/env python
"""Two builds of shmeval, the same load, measured in alternating turns:
does a change of the core make a request method faster or slower?

On a shared machine the throughput of a latency-bound load (one worker, a
trivial model) moves by a factor of two or more from one minute to the
next with what the host's other tenants do (steal), far more than most
changes of the core.  Runs one after the other then compare the host's
minutes, not the builds.  Here each build has its own evaluator and
workers, started once and kept up, and the two take turns of --turn-s
seconds, in the order A B, B A, A B, ...: each pair of adjacent turns
sees nearly the same host, and the ratio B/A per pair is the measure.

The load is one request method in a loop in every worker (--call):
``evaluate`` of one state, ``evaluate_many`` of --rows states, or
``submit`` of --rows states with --depth submissions in flight, the
oldest collected (``result()``) before the next is submitted (the
pipelined method; a turn starts with the worker's --depth submissions and
collects what is still in flight after its end uncounted, so no request
of one build waits through the other's turn).  A rate is states answered
per second.  The three have had the same public signatures since 69f5c90,
so any build since then serves any of them.

The script prints each build's median rate and how evenly its workers
shared it (the slowest worker's rate over the mean's, median over the
turns), the ratio's median and quartiles, and in how many pairs B was
ahead.  --busy N runs N busy loops beside both builds: other programs
taking the CPUs.

A build is a git revision (built into a temporary directory: the sources
of that commit, with the extensions compiled in place by this
interpreter), "." (the shmeval this interpreter imports: this checkout
built in place, or the copy installed from it), or a directory holding a
built ``shmeval`` package (a revision built once for several runs).  The model is a
NumPy function of the batch (the evaluator's own cost only); --settings is
a JSON object of Evaluator.spawn keywords, the same for both builds unless
--settings-b gives B its own (then one build against itself compares two
settings the same way).

    python bench/ab_builds.py --a 62897fd --b . --workers 1 --cpus 0,1
    python bench/ab_builds.py --a 69f5c90 --b . --workers 16 --call submit --rows 1 --depth 4
    python bench/ab_builds.py --a 62897fd --b . --settings '{"spin_us": 100, "evaluator_spin_us": 50}'
    python bench/ab_builds.py --a . --b . --cpus 0 --workers 2 \
        --settings '{"spin_us": 100, "evaluator_spin_us": 50}' --settings-b '{}'
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (6, 7, 2)
CALLS = ("evaluate", "evaluate_many", "submit")
#: Evaluator.spawn's default slots_per_client (a submit of more rows in
#: flight than this gets its own, unless --settings names one).
SLOTS_PER_CLIENT = 16


# --- one build's side (run as: ab_builds.py --serve SETTINGS WORKERS LOAD) ----------------


class NullModel:
    """Uniform policy, the state's mean as value."""

    def __call__(self, batch: Any) -> Dict[str, Any]:
        import numpy as np
        n = len(batch)
        return {"policy": np.full((n, 7), 1 / 7, np.float32),
                "value": batch.reshape(n, -1).mean(axis=1)}


def make_model() -> NullModel:
    return NullModel()


def evaluate_until(handle: Any, end: float, rows: int, depth: Optional[int]) -> int:
    """``evaluate`` of one state until ``end``; the states answered."""
    import numpy as np
    state = np.zeros(SHAPE, np.float32)
    evaluate = handle.evaluate
    n = 0
    while time.monotonic() < end:
        evaluate(state)
        n += 1
    return n


def evaluate_many_until(handle: Any, end: float, rows: int, depth: Optional[int]) -> int:
    """``evaluate_many`` of ``rows`` states until ``end``; the states
    answered."""
    import numpy as np
    states = np.zeros((rows,) + SHAPE, np.float32)
    evaluate_many = handle.evaluate_many
    n = 0
    while time.monotonic() < end:
        evaluate_many(states)
        n += rows
    return n


def submit_until(handle: Any, end: float, rows: int, depth: Optional[int]) -> int:
    """``depth`` submissions of ``rows`` states in flight until ``end``,
    the oldest collected before the next is submitted; the states answered
    by then.  Those still in flight at ``end`` are collected uncounted."""
    import numpy as np
    assert depth is not None
    states = np.zeros((rows,) + SHAPE, np.float32)
    submit = handle.submit
    pending = collections.deque(submit(states) for _ in range(depth))
    n = 0
    while time.monotonic() < end:
        pending.popleft().result()
        pending.append(submit(states))
        n += rows
    for p in pending:
        p.result()
    return n


UNTIL = {"evaluate": evaluate_until, "evaluate_many": evaluate_many_until,
         "submit": submit_until}


def worker(handle: Any, load: Dict[str, Any], turns: Any, results: Any) -> None:
    """Runs the load's call for each turn's seconds; reports its states
    answered per second, or the error that stopped it."""
    until = UNTIL[load["call"]]
    while True:
        seconds = turns.get()
        if seconds is None:
            break
        try:
            n = until(handle, time.monotonic() + seconds, load["rows"], load["depth"])
        except Exception as e:
            results.put(f"{type(e).__name__}: {e}")
            raise
        results.put(n / seconds)
    handle.close()


def serve(settings: Dict[str, Any], n_workers: int, load: Dict[str, Any]) -> None:
    """One build: an evaluator and its workers, each running ``load``
    (``{"call", "rows", "depth"}``); a turn per line of stdin (its
    seconds), answered with the workers' summed rate."""
    import multiprocessing as mp

    import shmeval
    ctx = mp.get_context("spawn")
    in_flight = load["rows"] * load["depth"] if load["call"] == "submit" else 0
    if in_flight > SLOTS_PER_CLIENT:
        settings = {"slots_per_client": in_flight, **settings}
    ev = shmeval.Evaluator.spawn(make_model, input_shape=SHAPE,
                                 outputs={"policy": ((7,), "float32"), "value": ((), "float32")},
                                 max_batch=256, max_clients=max(16, n_workers), **settings)
    turns = [ctx.Queue() for _ in range(n_workers)]
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(ev, load, turns[i], results), daemon=True)
             for i in range(n_workers)]
    for p in procs:
        p.start()
    print("ready", shmeval.__file__, flush=True)
    try:
        for line in sys.stdin:
            if not line.strip():
                break
            for q in turns:
                q.put(float(line))
            got = [results.get(timeout=120) for _ in procs]
            failed = [g for g in got if isinstance(g, str)]
            if failed:
                raise RuntimeError(f"a worker failed: {failed[0]}")
            print(sum(got), min(got) * len(got) / max(sum(got), 1e-9), flush=True)
    finally:
        for q in turns:
            q.put(None)
        for p in procs:
            p.join(10)
        tuner = ev.stats().get("tuner")
        print(json.dumps(tuner), flush=True)
        ev.close()


# --- the driver ---------------------------------------------------------------------------


def build(rev: str, into: str) -> str:
    """The directory holding the package of revision ``rev``, built
    (``"."``: the one this interpreter imports; a directory holding a built
    ``shmeval`` package: that one, so that a grid of runs builds a revision
    once)."""
    if rev == ".":
        import shmeval
        return os.path.dirname(os.path.dirname(os.path.abspath(shmeval.__file__)))
    if os.path.isdir(os.path.join(rev, "shmeval")):
        return os.path.abspath(rev)
    tree = os.path.join(into, rev.replace("/", "_"))
    os.makedirs(tree)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], capture_output=True)
    if archive.returncode:
        raise SystemExit(f"ab_builds: no revision {rev!r}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
    made = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"],
                          cwd=tree, capture_output=True, text=True)
    if made.returncode:
        raise SystemExit(f"ab_builds: {rev} did not build:\n{made.stderr[-3000:]}")
    return os.path.join(tree, "src")


def describe(rev: str) -> str:
    """The commit ``rev`` names ("." : this checkout's, with -dirty when
    its tree differs)."""
    args = ["describe", "--always", "--dirty"] if rev == "." else ["rev-parse", "--short", rev]
    r = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True)
    return r.stdout.strip() or rev


class Side:
    """A build's serving process."""

    def __init__(self, name: str, src: str, settings: str, workers: int, load: str) -> None:
        env = dict(os.environ, PYTHONPATH=src)
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", settings, str(workers), load],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        ready = self.proc.stdout.readline().split()
        if not ready or ready[0] != "ready":
            raise RuntimeError(f"build {name} did not start (its output: {ready})")
        if not ready[1].startswith(src):
            raise RuntimeError(f"build {name} imported {ready[1]}, not its own {src}")

    def turn(self, seconds: float) -> Tuple[float, float]:
        """One turn: the workers' summed rate, and the slowest worker's
        rate over the mean worker's."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{seconds}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().split()
        if len(line) != 2:
            raise RuntimeError(f"build {self.name} stopped serving (its error is above)")
        rate, fairness = line
        return float(rate), float(fairness)

    def close(self) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it stopped on an error
            self.proc.wait(30)
            return None
        tuner = json.loads(self.proc.stdout.readline() or "null")
        self.proc.wait(30)
        return tuner


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--serve":
        serve(json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="the first build: a git revision, or '.'")
    p.add_argument("--b", default=".", help="the second build (default '.': this checkout)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--call", choices=CALLS, default="evaluate",
                   help="the request method each worker runs (default evaluate)")
    p.add_argument("--rows", type=int, default=8,
                   help="states per call of evaluate_many and submit (default 8)")
    p.add_argument("--depth", type=int, default=2,
                   help="submissions each worker keeps in flight, for submit (default 2)")
    p.add_argument("--cpus", default=None,
                   help="CPUs for the whole run, as for taskset -c (e.g. 0,1; default: all)")
    p.add_argument("--settings", default="{}", help="Evaluator.spawn keywords, as JSON")
    p.add_argument("--settings-b", default=None, help="B's own keywords (default: --settings)")
    p.add_argument("--turns", type=int, default=80, help="turns of each build")
    p.add_argument("--turn-s", type=float, default=0.5)
    p.add_argument("--warmup", type=float, default=5.0,
                   help="seconds each build serves before the first turn (the tuner settles)")
    p.add_argument("--busy", type=int, default=0,
                   help="busy loops run beside both builds, from before the warm-up to the end "
                        "(other programs taking CPUs; within --cpus)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    if args.settings_b is None:
        args.settings_b = args.settings
    json.loads(args.settings), json.loads(args.settings_b)  # fail early on a typo
    if args.rows < 1 or args.depth < 1:
        p.error("--rows and --depth take at least 1")
    rows = 1 if args.call == "evaluate" else args.rows
    depth = args.depth if args.call == "submit" else None
    load = json.dumps({"call": args.call, "rows": rows, "depth": depth})
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    from shmeval._util.children import start_busy_loops, stop_busy_loops
    from shmeval._util.procstat import machine_steal_s

    with tempfile.TemporaryDirectory(prefix="shmeval-ab-") as tmp:
        srcs = {name: build(rev, tmp) for name, rev in (("A", args.a), ("B", args.b))}
        sides = [Side(name, srcs[name], settings, args.workers, load)
                 for name, settings in (("A", args.settings), ("B", args.settings_b))]
        busy = start_busy_loops(args.busy)
        try:
            for side in sides:
                side.turn(args.warmup)
            t0, steal0 = time.monotonic(), machine_steal_s()
            rates: Dict[str, List[float]] = {"A": [], "B": []}
            fairness: Dict[str, List[float]] = {"A": [], "B": []}
            for t in range(args.turns):
                for side in (sides if t % 2 == 0 else sides[::-1]):
                    rate, fair = side.turn(args.turn_s)
                    rates[side.name].append(rate)
                    fairness[side.name].append(fair)
            wall = time.monotonic() - t0
            steal = (machine_steal_s() - steal0) / (wall * (os.cpu_count() or 1))
        finally:
            stop_busy_loops(busy)
            tuners = {side.name: side.close() for side in sides}
    ratios = [b / a for a, b in zip(rates["A"], rates["B"])]
    q1, med, q3 = statistics.quantiles(ratios, n=4)
    ahead = sum(r > 1 for r in ratios)
    out = {"a": args.a, "b": args.b, "a_commit": describe(args.a), "b_commit": describe(args.b),
           "workers": args.workers, "call": args.call, "rows": rows, "depth": depth,
           "cpus": args.cpus,
           "settings": json.loads(args.settings), "settings_b": json.loads(args.settings_b),
           "turn_s": args.turn_s, "busy": args.busy,
           "median_a": statistics.median(rates["A"]), "median_b": statistics.median(rates["B"]),
           "fairness_a": statistics.median(fairness["A"]),
           "fairness_b": statistics.median(fairness["B"]),
           "ratio_median": med, "ratio_quartiles": [q1, q3], "b_ahead": ahead,
           "pairs": len(ratios), "steal_share": steal, "rates": rates, "fairness": fairness,
           "tuners": tuners}
    label = {"A": args.a, "B": args.b}
    if args.settings_b != args.settings:
        label = {"A": f"{args.a} {args.settings}", "B": f"{args.b} {args.settings_b}"}
    what = {"evaluate": "evaluate of 1 state",
            "evaluate_many": f"evaluate_many of {rows} states",
            "submit": f"submit of {rows} states, {depth} in flight per worker"}[args.call]
    print(f"{args.workers} workers, {what}; rates in states answered per second")
    print(f"A {label['A']}: median {out['median_a']:,.0f}/s (slowest worker "
          f"{out['fairness_a']:.2f} of the mean)   B {label['B']}: median {out['median_b']:,.0f}/s "
          f"({out['fairness_b']:.2f})")
    print(f"B/A per pair of turns: median {med:.2f} (quartiles {q1:.2f}-{q3:.2f}); "
          f"B ahead in {ahead} of {len(ratios)}; the host took {steal:.1%} of the CPU time as steal")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
