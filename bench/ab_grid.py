#!/usr/bin/env python
"""Two builds of shmeval over a grid of loads: bench/ab_builds.py for each
request method (evaluate, evaluate_many, submit) at each worker count, the
older build built once.  Prints one row per cell, each build's median rate
(states answered per second) and the ratio B/A per pair of turns with its
quartiles, and writes every cell's figures as JSON.

    python bench/ab_grid.py --a 69f5c90 --b . --json bench/results/ab-request-path.json

A ratio's quartiles that hold 1.0 read as "within noise"; each cell's
turns alternate A B, B A, ... so that both builds see the same host.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ab_builds import build, describe  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", required=True, help="the first build: a git revision, or '.'")
    p.add_argument("--b", default=".", help="the second build (default '.': this checkout)")
    p.add_argument("--workers", default="1,16,64", help="worker counts, comma-separated")
    p.add_argument("--calls", default="evaluate,evaluate_many,submit")
    p.add_argument("--turns", type=int, default=20, help="turns of each build per cell")
    p.add_argument("--turn-s", type=float, default=0.5)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    cells: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="shmeval-grid-") as tmp:
        builds = {side: build(rev, tmp) if rev != "." else "." for side, rev in
                  (("a", args.a), ("b", args.b))}
        for call in args.calls.split(","):
            for workers in (int(w) for w in args.workers.split(",")):
                out = os.path.join(tmp, f"{call}-{workers}.json")
                cmd = [sys.executable, os.path.join(HERE, "ab_builds.py"), "--a", builds["a"],
                       "--b", builds["b"], "--workers", str(workers), "--call", call,
                       "--turns", str(args.turns), "--turn-s", str(args.turn_s), "--json", out]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                with open(out) as f:
                    cell = json.load(f)
                cells.append(cell)
                q1, q3 = cell["ratio_quartiles"]
                print(f"{call:14s} {workers:3d} workers  A {cell['median_a']:>12,.0f}/s  "
                      f"B {cell['median_b']:>12,.0f}/s  B/A {cell['ratio_median']:.2f} "
                      f"({q1:.2f}-{q3:.2f}), B ahead in {cell['b_ahead']} of {cell['pairs']}",
                      flush=True)
    if args.json:
        result = {"a": args.a, "b": args.b, "a_commit": describe(args.a),
                  "b_commit": describe(args.b), "cells": cells}
        with open(args.json + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
