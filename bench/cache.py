#!/usr/bin/env python
"""The evaluation cache (``cache_entries``): what a hit and a miss cost in
the client, how many lookups hit at each table size and replacement policy,
and what the shared cache does for self-play against no cache and against
a cache in each worker.

Three parts, each optional (--parts):

  micro     One process, a null model served from a thread, a table of 2^16
            entries warmed by 4 x --calls states: per call of
            ``evaluate(state)`` on a Connect Four state, a hit (the state is
            cached), a miss (a new state each call: hash, lookup, round
            trip, store) and a round trip without a cache; per state, the
            C hash alone (``Segment.cache_keys``).  Percentiles of --calls
            timed calls each, and the ratio of a round trip to a hit.

  trace     The demo's self-play (its workers' code, --workers threads of
            this process, the demo's net with its initial weights) records
            the positions every worker evaluates, in order, until
            --trace-evals evaluations.  The trace is then replayed through
            tables of 2^10 .. 2^20 entries: the shared table as shmeval
            builds it (4-way buckets; entries never hit out first, then the
            least recently used), the same with other choices (least
            recently used alone; first in first out; the position with the
            most stones out, which keeps the openings that recur across
            games but needs to know the game; one way per bucket, as
            KataGo's table), and a table of the same total size split over
            the workers (each its own, least recently used out: the
            engines' scheme).  Prints the hit rates: the table sizes and the
            policies compared on the same positions.

  selfplay  ``shmeval selfplay`` with --workers workers, in rounds of three
            runs, alternating: no cache, ``--local-cache N/workers`` (a
            cache in each worker, the same total entries), ``--cache N``
            (shared).  Medians of moves/s and hit rates, and the ratios.

    python bench/cache.py --json bench/results/cache.json        # about 12 minutes
    python bench/cache.py --parts micro                          # seconds

Figures depend on the machine: the micro part on its CPU, the self-play
part on its cores (2 cores here; each run says what else kept the CPUs
busy).  Hit rates depend on the search (simulations, games per worker,
noise) and on the net: an untrained net spreads its visits more evenly
than a trained one.
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
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

SIZES = [2 ** k for k in range(10, 21, 2)]


# ---------------------------------------------------------------- micro
def _percentiles(ns: List[int]) -> Dict[str, float]:
    a = np.sort(np.asarray(ns, np.float64)) / 1e3
    return {"p50_us": float(np.percentile(a, 50)), "p90_us": float(np.percentile(a, 90)),
            "p99_us": float(np.percentile(a, 99)), "mean_us": float(a.mean())}


def micro(calls: int) -> Dict[str, Any]:
    import shmeval
    from shmeval.games import connect4

    shape = connect4.INPUT_SHAPE
    outputs = {"policy": ((connect4.N_ACTIONS,), "float32"), "value": ((1,), "float32")}
    policy = np.full((1, connect4.N_ACTIONS), 1 / connect4.N_ACTIONS, np.float32)

    def null_model(x: np.ndarray) -> Dict[str, np.ndarray]:
        n = len(x)
        return {"policy": np.broadcast_to(policy, (n, connect4.N_ACTIONS)).copy(),
                "value": np.zeros((n, 1), np.float32)}

    rng = np.random.default_rng(0)
    states = (rng.random((calls,) + tuple(shape)) < 0.3).astype(np.float32)
    warm = (rng.random((4 * calls,) + tuple(shape)) < 0.3).astype(np.float32)
    perf = time.perf_counter_ns
    out: Dict[str, Any] = {}
    with shmeval.Evaluator(null_model, input_shape=shape, outputs=outputs,
                           cache_entries=1 << 16) as ev:
        # Warm: every page of the table touched once (a first touch of a
        # page of shared memory is a page fault, a few us), as in a run
        # that has been going for a while.
        for i in range(0, len(warm), 16):
            ev.evaluate_many(warm[i:i + 16])
        s0 = states[0]
        ev.evaluate(s0)
        for _ in range(1000):
            ev.evaluate(s0)
        t = []
        for _ in range(calls):
            t0 = perf()
            ev.evaluate(s0)
            t.append(perf() - t0)
        out["hit"] = _percentiles(t)
        t = []
        for i in range(calls):
            t0 = perf()
            ev.evaluate(states[i])
            t.append(perf() - t0)
        out["miss"] = _percentiles(t)
        seg = ev._attach()
        t0 = perf()
        for _ in range(10):
            seg.cache_keys(states)
        out["hash_ns_per_state"] = (perf() - t0) / (10 * calls)
        st = ev.stats()["cache"]
        out["check"] = {"hits": st["hits"], "misses": st["misses"]}
    with shmeval.Evaluator(null_model, input_shape=shape, outputs=outputs) as ev:
        for _ in range(1000):
            ev.evaluate(s0)
        t = []
        for i in range(calls):
            t0 = perf()
            ev.evaluate(states[i])
            t.append(perf() - t0)
        out["round_trip_no_cache"] = _percentiles(t)
    out["round_trip_over_hit"] = out["round_trip_no_cache"]["p50_us"] / out["hit"]["p50_us"]
    return out


def print_micro(m: Dict[str, Any]) -> None:
    print("\nOne evaluate() of a Connect Four state (6x7x2 float32), null model, "
          "evaluator in a thread of the same process (us)")
    print(f"{'':28} {'p50':>8} {'p90':>8} {'p99':>8}")
    for key, label in (("hit", "hit"), ("miss", "miss (hash, lookup, trip, store)"),
                       ("round_trip_no_cache", "round trip, no cache")):
        p = m[key]
        print(f"{label:28.28} {p['p50_us']:8.2f} {p['p90_us']:8.2f} {p['p99_us']:8.2f}")
    print(f"hash of one state (two 64-bit keys, C): {m['hash_ns_per_state']:.0f} ns")
    print(f"a round trip costs {m['round_trip_over_hit']:.1f}x a hit (p50)")


# ---------------------------------------------------------------- trace
class _NullQueue:
    def put(self, msg: Any) -> None:
        pass


def record_trace(workers: int, evals: int, seed: int) -> Tuple[List[Tuple[int, List[int]]],
                                                             Dict[int, int]]:
    """The positions the demo's workers evaluate, call by call: [(worker,
    [key, ...])], and each key's stone count.  The workers run as threads
    of this process on one copy of the demo's net."""
    from shmeval.selfplay import worker as W
    from shmeval.selfplay.net import local_net
    from shmeval.selfplay.settings import Settings

    s = Settings(workers=workers, seed=seed)
    net = local_net(s, batched=True)
    lock = threading.Lock()
    calls: List[Tuple[int, List[int]]] = []
    stones: Dict[int, int] = {}
    total = [0]
    counters = np.zeros(workers * W.NF, np.int64)
    flags = np.zeros(W.N_FLAGS, np.int64)

    def run(wid: int) -> None:
        def inner(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
            keys = [hash(row.tobytes()) for row in x]
            with lock:
                calls.append((wid, keys))
                for k, row in zip(keys, x):
                    stones.setdefault(k, int(row.sum()))
                total[0] += len(keys)
                if total[0] >= evals:
                    flags[W.STOP] = 1
            return net(x)

        try:
            W._play(wid, s, inner, counters.data, flags, _NullQueue())
        except W._Stopped:
            pass

    threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return calls, stones


def _bucket(key: int, buckets: int) -> int:
    return ((key * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) % buckets


def simulate_shared(calls: List[Tuple[int, List[int]]], stones: Dict[int, int], entries: int,
                    policy: str) -> float:
    """Hit rate of one table of `entries` over the trace: each call looks
    all its positions up, then stores its misses."""
    ways = 1 if policy == "direct" else 4
    nb = max(1, entries // ways)
    table: List[Dict[int, int]] = [dict() for _ in range(nb)]  # key -> stamp
    used: Dict[int, int] = {}  # key -> hits while in the table ("hits")
    clock = hits = lookups = 0
    for _, keys in calls:
        miss = []
        for k in keys:
            clock += 1
            b = table[_bucket(k, nb)]
            if k in b:
                hits += 1
                if policy in ("lru", "hits"):
                    b[k] = clock
                used[k] = used.get(k, 0) + 1
            else:
                miss.append(k)
        lookups += len(keys)
        for k in miss:
            clock += 1
            b = table[_bucket(k, nb)]
            if k not in b and len(b) >= ways:
                if policy == "stones":
                    victim = max(b, key=lambda x: (stones[x], -b[x]))
                elif policy == "hits":  # never hit first, then least recent
                    victim = min(b, key=lambda x: (used.get(x, 0) > 0, b[x]))
                else:  # lru, fifo: the oldest stamp; direct: the only one
                    victim = min(b, key=b.__getitem__)
                del b[victim]
                used.pop(victim, None)
            b[k] = clock
    return hits / lookups if lookups else 0.0


def simulate_local(calls: List[Tuple[int, List[int]]], entries: int, workers: int) -> float:
    """Hit rate when each worker has its own table of entries/workers (a
    dict, least recently used out)."""
    per = max(1, entries // workers)
    tables: Dict[int, "collections.OrderedDict[int, None]"] = collections.defaultdict(
        collections.OrderedDict)
    hits = lookups = 0
    for wid, keys in calls:
        t = tables[wid]
        miss = []
        for k in keys:
            if k in t:
                hits += 1
                t.move_to_end(k)
            else:
                miss.append(k)
        lookups += len(keys)
        for k in miss:
            t[k] = None
            if len(t) > per:
                t.popitem(last=False)
    return hits / lookups if lookups else 0.0


def trace_part(workers: int, evals: int, seed: int, path: Optional[str]) -> Dict[str, Any]:
    t0 = time.monotonic()
    if path and os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        calls = [(w, k) for w, k in saved["calls"]]
        stones = {int(k): v for k, v in saved["stones"].items()}
    else:
        calls, stones = record_trace(workers, evals, seed)
        if path:
            with open(path, "w") as f:
                json.dump({"calls": calls, "stones": stones}, f)
    n = sum(len(k) for _, k in calls)
    distinct = len(stones)
    rows = []
    for size in SIZES:
        row = {"entries": size,
               "shared": simulate_shared(calls, stones, size, "hits"),
               "shared_lru": simulate_shared(calls, stones, size, "lru"),
               "shared_fifo": simulate_shared(calls, stones, size, "fifo"),
               "shared_stones": simulate_shared(calls, stones, size, "stones"),
               "shared_direct": simulate_shared(calls, stones, size, "direct"),
               "per_worker_lru": simulate_local(calls, size, workers)}
        row["shared_over_per_worker"] = (row["shared"] / row["per_worker_lru"]
                                         if row["per_worker_lru"] else None)
        rows.append(row)
    unbounded = simulate_shared(calls, stones, 1 << 24, "hits")
    return {"workers": workers, "evaluations": n, "distinct_positions": distinct,
            "calls": len(calls), "unbounded_shared": unbounded,
            "unbounded_per_worker": simulate_local(calls, (1 << 24) * workers, workers),
            "rows": rows, "seconds": time.monotonic() - t0}


def print_trace(t: Dict[str, Any]) -> None:
    print(f"\nHit rates over one trace: {t['evaluations']:,} evaluations of "
          f"{t['distinct_positions']:,} distinct positions by {t['workers']} workers "
          f"(the demo's search and untrained net)")
    print("shared tables by policy: shmeval's (never-hit entries out first, then least "
          "recently used), lru, fifo, stones (most stones out), 1-way (one entry per bucket); "
          "per-worker: the same entries split over the workers, lru each")
    print(f"{'entries':>9} {'shmeval':>8} {'lru':>8} {'fifo':>8} {'stones':>8} "
          f"{'1-way':>8} {'per-worker':>11} {'shmeval/per-worker':>19}")
    for r in t["rows"]:
        ratio = r["shared_over_per_worker"]
        print(f"{r['entries']:>9,} {r['shared']:8.1%} {r['shared_lru']:8.1%} "
              f"{r['shared_fifo']:8.1%} {r['shared_stones']:8.1%} {r['shared_direct']:8.1%} "
              f"{r['per_worker_lru']:11.1%} {ratio:18.2f}x" if ratio else "")
    print(f"no limit: shared {t['unbounded_shared']:.1%}, per worker "
          f"{t['unbounded_per_worker']:.1%}")


# ---------------------------------------------------------------- selfplay
def selfplay_run(args: argparse.Namespace, extra: List[str]) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "run.json")
        cmd = [sys.executable, "-m", "shmeval", "selfplay", "--workers", str(args.workers),
               "--seconds", str(args.seconds), "--json", path] + extra
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=900)
        with open(path) as f:
            return dict(json.load(f)["modes"]["shmeval"])


def selfplay_part(args: argparse.Namespace) -> Dict[str, Any]:
    n = args.entries
    # The demo caches by default: "none" and "per_worker" turn its shared
    # cache off.
    variants = {"none": ["--cache", "0"],
                "per_worker": ["--cache", "0", "--local-cache", str(n // args.workers)],
                "shared": ["--cache", str(n)]}
    runs: Dict[str, List[Dict[str, Any]]] = {k: [] for k in variants}
    for r in range(args.rounds):
        for name, extra in variants.items():
            res = selfplay_run(args, extra)
            cache = res.get("cache") or res.get("local_cache") or {}
            runs[name].append({"moves_per_s": res["moves_per_s"],
                               "evals_per_s": res["evals_per_s"],
                               "mean_batch": res["mean_batch"],
                               "hit_rate": cache.get("hit_rate"),
                               "other_cores": res["cpu"]["other_cores"]})
            print(f"  round {r + 1} {name:10} moves/s {res['moves_per_s']:7.1f}  "
                  f"hit rate {cache.get('hit_rate', 0.0):6.1%}  other load "
                  f"{res['cpu']['other_cores']:.2f} cores", flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) if v[0][m] is not None else None
               for m in v[0]} for k, v in runs.items()}
    return {"workers": args.workers, "entries": n, "seconds": args.seconds,
            "rounds": args.rounds, "runs": runs, "median": med,
            "shared_over_none": med["shared"]["moves_per_s"] / med["none"]["moves_per_s"],
            "shared_over_per_worker_moves": (med["shared"]["moves_per_s"]
                                             / med["per_worker"]["moves_per_s"]),
            "shared_over_per_worker_hit_rate": (med["shared"]["hit_rate"]
                                                / med["per_worker"]["hit_rate"]
                                                if med["per_worker"]["hit_rate"] else None)}


def print_selfplay(p: Dict[str, Any]) -> None:
    print(f"\nSelf-play, {p['workers']} workers, {p['seconds']:g} s windows, medians of "
          f"{p['rounds']} alternating rounds, caches of {p['entries']:,} entries in all")
    print(f"{'cache':12} {'moves/s':>9} {'evals/s':>9} {'mean batch':>11} {'hit rate':>9}")
    for k, m in p["median"].items():
        hr = f"{m['hit_rate']:9.1%}" if m["hit_rate"] is not None else f"{'-':>9}"
        print(f"{k:12} {m['moves_per_s']:9.1f} {m['evals_per_s']:9.0f} "
              f"{m['mean_batch']:11.1f} {hr}")
    print(f"shared cache: {p['shared_over_none']:.2f}x the moves/s of no cache, "
          f"{p['shared_over_per_worker_moves']:.2f}x those of the per-worker caches, "
          f"hit rate {p['shared_over_per_worker_hit_rate']:.2f}x theirs")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="micro,trace,selfplay",
                    help="which parts, comma-separated (default: all three)")
    ap.add_argument("--calls", type=int, default=20000, help="timed calls per micro case")
    ap.add_argument("--workers", type=int, default=8, help="self-play workers (default 8)")
    ap.add_argument("--trace-evals", type=int, default=400_000,
                    help="evaluations the trace records (default 400,000)")
    ap.add_argument("--trace-file", metavar="PATH.json",
                    help="trace part: replay this trace if it exists, else record it there")
    ap.add_argument("--entries", type=int, default=1 << 16,
                    help="self-play part: cache entries in all (default 65,536)")
    ap.add_argument("--seconds", type=float, default=20.0,
                    help="self-play part: measured window per run (default 20)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="self-play part: rounds of the three runs (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= {"micro", "trace", "selfplay"}:
        ap.error(f"unknown part in {args.parts!r}")
    out: Dict[str, Any] = {"argv": sys.argv[1:], "cpus": len(os.sched_getaffinity(0))}
    if "micro" in parts:
        out["micro"] = micro(args.calls)
        print_micro(out["micro"])
    if "trace" in parts:
        out["trace"] = trace_part(args.workers, args.trace_evals, args.seed, args.trace_file)
        print_trace(out["trace"])
    if "selfplay" in parts:
        out["selfplay"] = selfplay_part(args)
        print_selfplay(out["selfplay"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"\nresults: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
