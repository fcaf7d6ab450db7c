#!/usr/bin/env python
"""Self-play with the blocking search against the pipelined one
(``shmeval selfplay --pipeline K``), at several worker counts, in one run.

Each cell is one run of the demo's shmeval mode (a fresh evaluator process
and fresh workers, a warm-up, then a window of --seconds): --workers W worker
processes, each playing --games-per-worker games at a time with the blocking
search (K = 1: every search step waits for its leaves) or K groups of them
with the pipelined one (while one group is searched, the leaves of the
others are evaluated; Client.submit).  The cells run in rounds, every
(W, K) once per round, the order of K rotating from round to round, so that
the machine's drift touches every cell alike.

    python bench/pipeline_selfplay.py --json bench/results/pipeline_selfplay.json
    python bench/pipeline_selfplay.py --workers 2 --pipeline 1,2 --seconds 3   # a quick look

Printed per cell (medians over the rounds): moves/s and evals/s, the ratio
of moves/s to the blocking search at the same worker count, the mean batch,
the workers' share of wall time spent waiting in the evaluation calls, the
median worker RSS, the busy cores and the other load (cores busy with
programs outside the run: a cell measured while they were high is skewed).
Then the two headline comparisons: pipelined over blocking at the smallest
worker count, and the best pipelined cell against the best blocking one,
with the worker processes (and the worker memory) each needs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import asdict, replace
from typing import Any, Dict, List, Tuple

from shmeval._util.display import Display
from shmeval._util.jsonout import write_json
from shmeval._util.machine import machine_info
from shmeval.selfplay.mode_run import ModeRun
from shmeval.selfplay.records import GameStore
from shmeval.selfplay.settings import Settings


def _ints(text: str) -> List[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=_ints, default=[2, 4, 8], help="worker counts (2,4,8)")
    p.add_argument("--pipeline", type=_ints, default=[1, 2, 3],
                   help="K: 1 the blocking search, more pipelined groups (1,2,3)")
    p.add_argument("--games-per-worker", type=int, default=Settings().games_per_worker,
                   help="games per group (default: the demo's)")
    p.add_argument("--seconds", type=float, default=10.0, help="measured window per cell (10)")
    p.add_argument("--warmup", type=float, default=2.0, help="play before the window (2)")
    p.add_argument("--repeats", type=int, default=1, help="rounds (1)")
    p.add_argument("--json", metavar="PATH", help="write the settings, machine and cells here")
    args = p.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    base = Settings(games_per_worker=args.games_per_worker, seconds=args.seconds,
                    warmup=args.warmup)
    display = Display()
    machine = machine_info(tensorflow=("tensorflow", "tensorflow-cpu"))
    print(f"self-play, shmeval mode: workers {args.workers}, K {args.pipeline} (1: blocking), "
          f"{base.games_per_worker} games per group, {base.simulations} simulations/move, "
          f"{args.seconds:g} s windows after {args.warmup:g} s, {args.repeats} round(s); "
          f"{machine.get('cpus_usable')} CPUs", flush=True)
    runs: Dict[Tuple[int, int], List[Dict[str, Any]]] = {}
    for round_ in range(args.repeats):
        for w in args.workers:
            shift = round_ % len(args.pipeline)
            for k in args.pipeline[shift:] + args.pipeline[:shift]:
                s = replace(base, workers=w, pipeline=k)
                s.check()
                r = ModeRun("shmeval", s, display, GameStore()).run()
                runs.setdefault((w, k), []).append(r)
                display.line(f"round {round_ + 1}: {w} workers, K {k}: "
                             f"{r['moves_per_s']:,.0f} moves/s "
                             f"(other load {r['cpu']['other_cores']:.2f} cores)")
    cells = [_cell(w, k, rs) for (w, k), rs in sorted(runs.items())]
    blocking = {c["workers"]: c for c in cells if c["pipeline"] == 1}
    for c in cells:
        b = blocking.get(c["workers"])
        c["vs_blocking"] = c["moves_per_s"] / b["moves_per_s"] if b else None
    print()
    print(_table(cells))
    headline = _headline(cells)
    for line in headline["lines"]:
        print(line)
    if args.json:
        write_json(args.json, {"settings": {**asdict(base), "workers": args.workers,
                                            "pipeline": args.pipeline,
                                            "repeats": args.repeats},
                               "machine": machine, "cells": cells,
                               "headline": {k: v for k, v in headline.items() if k != "lines"},
                               "runs": {f"{w}x{k}": rs for (w, k), rs in runs.items()}})
        print(f"results: {args.json}")
    return 0


def _med(rs: List[Dict[str, Any]], get: Any) -> Any:
    vals = [v for v in (get(r) for r in rs) if v is not None]
    return statistics.median(vals) if vals else None


def _cell(w: int, k: int, rs: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {
        "workers": w, "pipeline": k, "rounds": len(rs),
        "moves_per_s": _med(rs, lambda r: r["moves_per_s"]),
        "moves_per_s_range": [min(r["moves_per_s"] for r in rs),
                              max(r["moves_per_s"] for r in rs)],
        "evals_per_s": _med(rs, lambda r: r["evals_per_s"]),
        "mean_batch": _med(rs, lambda r: r["mean_batch"]),
        "worker_rss_mb": _med(rs, lambda r: r["worker_rss_mb"]),
        "wait_share": _med(rs, lambda r: r["cpu"]["worker_wall_share_in_evaluate"]),
        "busy_cores": _med(rs, lambda r: r["cpu"]["machine_busy_cores"]),
        "other_cores": _med(rs, lambda r: r["cpu"]["other_cores"]),
    }


def _table(cells: List[Dict[str, Any]]) -> str:
    headers = ["workers", "K", "moves/s", "vs blocking", "evals/s", "mean batch",
               "waiting", "worker RSS MB", "busy cores", "other load"]
    rows = []
    for c in cells:
        lo, hi = c["moves_per_s_range"]
        rows.append([str(c["workers"]), "blocking" if c["pipeline"] == 1 else str(c["pipeline"]),
                     f"{c['moves_per_s']:,.0f}" + (f" [{lo:,.0f}-{hi:,.0f}]"
                                                   if c["rounds"] > 1 else ""),
                     f"{c['vs_blocking']:.2f}x" if c["vs_blocking"] else "-",
                     f"{c['evals_per_s']:,.0f}",
                     f"{c['mean_batch']:.1f}" if c["mean_batch"] else "-",
                     f"{c['wait_share']:.0%}" if c["wait_share"] is not None else "-",
                     f"{c['worker_rss_mb']:.0f}" if c["worker_rss_mb"] else "-",
                     f"{c['busy_cores']:.2f}", f"{c['other_cores']:.2f}"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    return "\n".join("  ".join(x.rjust(wd) for x, wd in zip(r, widths))
                     for r in [headers] + rows)


def _headline(cells: List[Dict[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {"lines": []}
    blocking = [c for c in cells if c["pipeline"] == 1]
    piped = [c for c in cells if c["pipeline"] > 1]
    if not blocking or not piped:
        return out
    w0 = min(c["workers"] for c in cells)
    few = [c for c in piped if c["workers"] == w0 and c["vs_blocking"]]
    if few:
        best_few = max(few, key=lambda c: c["moves_per_s"])
        out["smallest_workers"] = {"workers": w0, "pipeline": best_few["pipeline"],
                                   "ratio": best_few["vs_blocking"]}
        out["lines"].append(f"{w0} workers: pipelined (K {best_few['pipeline']}) "
                            f"{best_few['vs_blocking']:.2f}x the blocking search's moves/s")
    bb = max(blocking, key=lambda c: c["moves_per_s"])
    bp = max(piped, key=lambda c: c["moves_per_s"])
    # The fewest workers with which a pipelined cell matches the best blocking one.
    matching = [c for c in piped if c["moves_per_s"] >= bb["moves_per_s"]]
    fewest = min(matching, key=lambda c: (c["workers"], -c["moves_per_s"])) if matching else None
    out["best_blocking"] = {k: bb[k] for k in ("workers", "moves_per_s", "worker_rss_mb")}
    out["best_pipelined"] = {k: bp[k] for k in ("workers", "pipeline", "moves_per_s",
                                                "worker_rss_mb")}
    out["lines"].append(f"best blocking: {bb['moves_per_s']:,.0f} moves/s with {bb['workers']} "
                        f"workers; best pipelined: {bp['moves_per_s']:,.0f} moves/s with "
                        f"{bp['workers']} workers x K {bp['pipeline']} "
                        f"({bp['moves_per_s'] / bb['moves_per_s']:.2f}x)")
    if fewest is not None:
        out["fewest_workers_matching"] = {"workers": fewest["workers"],
                                          "pipeline": fewest["pipeline"]}
        mem_b = bb["worker_rss_mb"] * bb["workers"] if bb["worker_rss_mb"] else None
        mem_p = fewest["worker_rss_mb"] * fewest["workers"] if fewest["worker_rss_mb"] else None
        out["lines"].append(
            f"pipelined matches the best blocking with {fewest['workers']} workers (K "
            f"{fewest['pipeline']}) instead of {bb['workers']}"
            + (f": worker memory {mem_p:.0f} MB instead of {mem_b:.0f} MB" if mem_b and mem_p
               else ""))
    else:
        out["lines"].append("no pipelined cell matches the best blocking one")
    return out


if __name__ == "__main__":
    sys.exit(main())
