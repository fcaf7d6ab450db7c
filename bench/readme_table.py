#!/usr/bin/env python
"""Prints the null-model performance tables (Markdown) of docs/performance.md
from a `shmeval bench --json` file, so that the figures quoted there are the
committed run's; given a second run (the same suite with batch workers), also
the table of the two side by side for Connect Four.

    python bench/readme_table.py bench/results/bench.json bench/results/bench-batch.json
"""
from __future__ import annotations

import json
import sys
from typing import Any

NAMES = {"queue": "Queue", "pipe": "Pipe", "faster_fifo": "faster-fifo", "locksem": "Lock+Sem"}


def table(summary: list[dict[str, Any]], state: str) -> str:
    rows = {(r["workers"], r["method"]): r for r in summary if r["state"] == state and r["repeats"]}
    methods = [m for m in NAMES if any(k[1] == m for k in rows)]
    counts = sorted({w for w, _ in rows})
    head = (["workers"] + [f"{NAMES[m]} /s" for m in methods]
            + ["**shmeval** /s", "shmeval p50 / p99 µs", "fairness"]
            + [f"x {NAMES[m]}" for m in methods])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in counts:
        s = rows.get((w, "shmeval"))
        if s is None:
            continue
        tp = s["throughput"]["median"]
        cells = [str(w)]
        cells += [f"{rows[w, m]['throughput']['median']:,.0f}" if (w, m) in rows else "-" for m in methods]
        cells += [f"**{tp:,.0f}**", f"{s['p50_us']['median']:.1f} / {s['p99_us']['median']:.0f}",
                  f"{s['fairness']['median']:.2f}"]
        cells += [f"{tp / rows[w, m]['throughput']['median']:.1f}x" if (w, m) in rows else "-" for m in methods]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def side_by_side(a: list[dict[str, Any]], b: list[dict[str, Any]], state: str = "c4") -> str:
    """shmeval in run a (normal workers) and run b (batch workers): round
    trips/s, p99 and ratios to three baselines of the same run."""
    def rows(summary: list[dict[str, Any]]) -> dict[tuple[int, str], dict[str, Any]]:
        return {(r["workers"], r["method"]): r for r in summary if r["state"] == state and r["repeats"]}

    ra, rb = rows(a), rows(b)
    base = ["queue", "pipe", "locksem"]
    half = ["shmeval /s", "p99 µs"] + [f"x {NAMES[m]}" for m in base]
    head = ["workers"] + [f"normal: {half[0]}"] + half[1:] + [f"batch: {half[0]}"] + half[1:]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in sorted({w for w, m in ra if m == "shmeval" and (w, "shmeval") in rb}):
        cells = [str(w)]
        for r in (ra, rb):
            tp = r[w, "shmeval"]["throughput"]["median"]
            cells += [f"{tp:,.0f}", f"{r[w, 'shmeval']['p99_us']['median']:,.0f}"]
            cells += [f"{tp / r[w, m]['throughput']['median']:.1f}x" if (w, m) in r else "-" for m in base]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(path: str, batch_path: str | None = None) -> None:
    with open(path) as f:
        run = json.load(f)
    for state in dict.fromkeys(r["state"] for r in run["summary"]):
        print(f"\n{state}:\n")
        print(table(run["summary"], state))
    if batch_path:
        with open(batch_path) as f:
            batch = json.load(f)
        print("\nc4, normal and batch workers:\n")
        print(side_by_side(run["summary"], batch["summary"]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/bench.json",
         sys.argv[2] if len(sys.argv) > 2 else None)
