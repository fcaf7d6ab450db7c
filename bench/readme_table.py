#!/usr/bin/env python
"""Prints the README's performance tables (Markdown) from a `shmeval bench
--json` file, so that the figures quoted there are the committed run's.

    python bench/readme_table.py bench/results/bench.json
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


def main(path: str) -> None:
    with open(path) as f:
        run = json.load(f)
    for state in dict.fromkeys(r["state"] for r in run["summary"]):
        print(f"\n{state}:\n")
        print(table(run["summary"], state))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/bench.json")
