"""What ``shmeval bench`` prints and draws: the progress line, the summary of
the repetitions, the tables per state, the machine description and the plot."""
from __future__ import annotations

import shutil
import statistics
import sys
import time
from typing import Any, Iterable, Sequence, TextIO

from .._util.display import Display, format_duration
from .._util.machine import machine_info as _machine_info
from .roundtrip import CDF_GRID

# shmeval's rows are compared with these, in this order, when they were run.
COMPARED_BASELINES = ("pipe", "faster_fifo", "locksem")
SHMEVAL_METHODS = ("shmeval", "shm_thread")


class Progress:
    """One line on a stream: ``[#####.....] 12/40 trials, ETA 1m20s, last: ...``.

    On a terminal the line is redrawn in place; otherwise each update is a
    line of its own.  Steps carry a weight (their expected duration in any
    unit): the bar and the ETA follow the weight done, at the rate observed
    so far.  The first ``trials`` steps are counted as trials; the steps
    after them (the reference, the batch path) only add to the bar.
    """

    def __init__(self, weights: Sequence[float], trials: int, stream: TextIO | None = None,
                 width: int = 20) -> None:
        self.weights = list(weights)
        self.trials = trials
        self.display = Display(stream if stream is not None else sys.stderr)
        self.width = width
        self.done = 0
        self.done_weight = 0.0
        self.began = time.monotonic()

    def line(self, last: str) -> str:
        total = sum(self.weights)
        filled = round(self.width * self.done_weight / total) if total else self.width
        text = f"[{'#' * filled}{'.' * (self.width - filled)}] {min(self.done, self.trials)}/{self.trials} trials"
        remaining = total - self.done_weight
        if self.done_weight > 0 and remaining > 1e-9:
            rate = (time.monotonic() - self.began) / self.done_weight
            text += f", ETA {format_duration(rate * remaining)}"
        return f"{text}, last: {last}" if last else text

    def step(self, last: str) -> None:
        """Marks the next step done; ``last`` says what it gave."""
        self.done_weight += self.weights[self.done] if self.done < len(self.weights) else 0.0
        self.done += 1
        self.show(last)

    def show(self, last: str) -> None:
        text = self.line(last)
        if self.display.tty:
            # Cut to the terminal's width: a wrapped line could not be redrawn.
            self.display.status(text[: max(20, shutil.get_terminal_size().columns - 1)])
        else:
            self.display.line(text)  # every step, not only every few seconds

    def note(self, text: str) -> None:
        """A message that must not be drawn over (a warning, a failure)."""
        self.display.line(text)

    def close(self) -> None:
        self.display.end_status()


# --- machine and summary ------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """The machine, with the version of faster-fifo (a baseline)."""
    return _machine_info(faster_fifo=("faster-fifo",))


def describe_machine(machine: dict[str, Any]) -> str:
    load = machine.get("loadavg")
    return (f"machine: {machine['cpu_model']}, {machine['cpus_usable']}/{machine['cpu_count']} cpus usable, "
            f"{machine['platform']}, {machine['python']}, numpy {machine['numpy']}, "
            f"shmeval {machine['shmeval']}, faster-fifo {machine['faster_fifo']}, "
            f"load {' '.join(f'{v:.2f}' for v in load) if load else '?'}")


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(trials: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and range over the repetitions, per (state, workers, method);
    failed trials are counted, not summarised."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for t in trials:
        groups.setdefault((t["state"], t["workers"], t["method"]), []).append(t)
    rows = []
    for (state, workers, method), ts in groups.items():
        ok = [t for t in ts if "error" not in t]
        row: dict[str, Any] = {"state": state, "workers": workers, "method": method, "repeats": len(ok),
                               "failed": len(ts) - len(ok)}
        for metric in ("throughput", "p50_us", "p99_us", "p999_us", "fairness", "mean_batch"):
            row[metric] = _spread([t[metric] for t in ok if t.get(metric) is not None])
        rows.append(row)
    return rows


# --- tables -------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 2) -> str:
    """Aligned columns, the first ``left`` left-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([fmt(headers), *(fmt(r) for r in rows)])


def _median(stat: dict[str, float] | None, fmt: str) -> str:
    return "-" if stat is None else format(stat["median"], fmt)


def _with_range(stat: dict[str, float] | None, fmt: str) -> str:
    if stat is None:
        return "-"
    text = format(stat["median"], fmt)
    if stat["min"] == stat["max"]:
        return text
    return f"{text} [{format(stat['min'], fmt)}-{format(stat['max'], fmt)}]"


def _ratio(a: dict[str, float] | None, b: dict[str, float] | None, invert: bool = False) -> str:
    if a is None or b is None or not a["median"] or not b["median"]:
        return "-"
    return f"{(b['median'] / a['median'] if invert else a['median'] / b['median']):.2f}x"


def format_state_report(state_label: str, summary: Sequence[dict[str, Any]], methods: Sequence[str],
                        workers: Sequence[int], repeats: int, seconds: float) -> str:
    """The table of one state, then shmeval against the other baselines."""
    rows_by_key = {(r["workers"], r["method"]): r for r in summary}
    lines = [f"state {state_label}: round trips/s median [min-max] over {repeats} repetition(s) of a "
             f"{seconds:g} s window; other columns medians"]
    rows = []
    for n in workers:
        queue = rows_by_key.get((n, "queue"))
        for m in methods:
            r = rows_by_key.get((n, m))
            if r is None:
                continue
            if not r["repeats"]:
                rows.append([str(n), m, f"FAILED ({r['failed']}x)", *["-"] * 6])
                continue
            rows.append([
                str(n), m, _with_range(r["throughput"], ",.0f") + (f" ({r['failed']} failed)" if r["failed"] else ""),
                _median(r["p50_us"], ".1f"), _median(r["p99_us"], ".1f"), _median(r["p999_us"], ".1f"),
                _median(r["mean_batch"], ".2f"), _median(r["fairness"], ".2f"),
                _ratio(r["throughput"], queue["throughput"] if queue else None),
            ])
    lines.append(format_table(["workers", "method", "round trips/s", "p50 µs", "p99 µs", "p99.9 µs",
                               "mean batch", "fairness", "x queue"], rows))
    lines.append("fairness: slowest worker's round trips / mean worker's; x queue: round trips/s over "
                 "multiprocessing.Queue's")

    candidates = [m for m in SHMEVAL_METHODS if m in methods]
    baselines = [m for m in COMPARED_BASELINES if m in methods]
    comparisons = []
    for n in workers:
        for c in candidates:
            for b in baselines:
                rc, rb = rows_by_key.get((n, c)), rows_by_key.get((n, b))
                if rc is None or rb is None or not rc["repeats"] or not rb["repeats"]:
                    continue
                comparisons.append([str(n), f"{c} vs {b}", _ratio(rc["throughput"], rb["throughput"]),
                                    _ratio(rc["p50_us"], rb["p50_us"], invert=True),
                                    _ratio(rc["p99_us"], rb["p99_us"], invert=True)])
    if comparisons:
        lines += ["", "ratios of medians, >1 = shmeval better (round trips/s a/b; latency b/a)",
                  format_table(["workers", "comparison", "round trips/s", "p50", "p99"], comparisons)]
    return "\n".join(lines)


# --- plot ---------------------------------------------------------------------------


def plot_workers(trials: Sequence[dict[str, Any]], state: str) -> int | None:
    """The worker count whose latencies the plot shows: 16, or the largest
    run below it, or the smallest run above it."""
    counts = sorted({int(t["workers"]) for t in trials if t["state"] == state and "error" not in t})
    if not counts:
        return None
    below = [n for n in counts if n <= 16]
    return below[-1] if below else counts[0]


def plot(path: str, trials: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]],
         states: Sequence[tuple[str, str]], methods: Sequence[str]) -> None:
    """One PNG: round trips/s against workers (top row) and the latency CDF at
    one worker count (bottom row), one column per state (name, label)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # checked when the arguments are parsed; this is the fallback
        raise RuntimeError("--plot needs matplotlib: pip install 'shmeval[bench]'") from e

    fig = Figure(figsize=(7 * len(states), 9.5), layout="constrained")
    axes = fig.subplots(2, len(states), squeeze=False)
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    for col, (state, label) in enumerate(states):
        top, bottom = axes[0][col], axes[1][col]
        for m in methods:
            rows = sorted((r for r in summary if r["state"] == state and r["method"] == m and r["repeats"]),
                          key=lambda r: int(r["workers"]))
            if not rows:
                continue
            x = [r["workers"] for r in rows]
            med = [r["throughput"]["median"] for r in rows]
            err = [[r["throughput"]["median"] - r["throughput"]["min"] for r in rows],
                   [r["throughput"]["max"] - r["throughput"]["median"] for r in rows]]
            top.errorbar(x, med, yerr=err, marker="o", capsize=3, color=colors[m], label=m)
        top.set_xscale("log", base=2)
        counts = sorted({int(r["workers"]) for r in summary if r["state"] == state})
        top.set_xticks(counts, [str(c) for c in counts])
        top.minorticks_off()
        top.set_yscale("log")
        top.set_xlabel("worker processes")
        top.set_ylabel("round trips/s (median, min-max)")
        top.set_title(f"{label}: throughput")
        top.grid(True, which="both", alpha=0.3)
        top.legend(fontsize="small")

        n = plot_workers(trials, state)
        for m in methods:
            curves = [t["latency_cdf_us"] for t in trials
                      if t["state"] == state and t["method"] == m and t["workers"] == n and "error" not in t]
            for k, curve in enumerate(curves):  # one line per repetition
                bottom.plot(curve, CDF_GRID[: len(curve)], color=colors[m], alpha=0.8,
                            label=m if k == 0 else None)
        bottom.set_xscale("log")
        bottom.set_xlabel("round-trip latency (µs)")
        bottom.set_ylabel("fraction of round trips")
        bottom.set_title(f"{label}: latency, {n} workers\n(CDF of the pooled round trips, a line per repetition)")
        bottom.grid(True, which="both", alpha=0.3)
        bottom.legend(fontsize="small")
    fig.savefig(path, dpi=100)


def versus_reference(summary: list[dict[str, Any]], reference: dict[str, Any],
                     cpus: int) -> list[dict[str, Any]]:
    """shmeval's round trip as a multiple of the machine's limit, per state
    and worker count.  One worker (both sides spin on a free core): its p50
    against the spinning futex ping-pong's p50.  More workers: the CPU time
    per round trip (usable CPUs / round trips per s) against the sleeping
    futex ping-pong pinned to one CPU (one sleep and one wake-up each way
    on one CPU: what a blocking round trip cannot go below)."""
    rows = {(r["kind"], r["pinned"], r["spin_us"] > 0): r for r in reference.get("pingpong", [])}
    spinning, sleeping = rows.get(("futex", False, True)), rows.get(("futex", True, False))
    out: list[dict[str, Any]] = []
    for r in summary:
        if r["method"] != "shmeval" or not r["repeats"]:
            continue
        if r["workers"] == 1 and spinning:
            ours, ref, basis = r["p50_us"]["median"], spinning["p50_us"], "p50 vs spinning ping-pong p50"
        elif r["workers"] > 1 and sleeping:
            ours, ref = cpus * 1e6 / r["throughput"]["median"], sleeping["p50_us"]
            basis = "CPU µs per round trip vs pinned sleeping ping-pong p50"
        else:
            continue
        out.append({"state": r["state"], "workers": r["workers"], "shmeval_us": ours, "reference_us": ref,
                    "multiple": ours / ref if ref else None, "basis": basis})
    return out


def format_versus_reference(rows: list[dict[str, Any]]) -> str:
    lines = ["shmeval against the machine's limit (futex ping-pong, same run)",
             "  1 worker: p50 against the spinning ping-pong's p50; more: CPU µs per round trip",
             "  (usable CPUs / round trips per s) against the sleeping ping-pong pinned to one CPU"]
    table = [[r["state"], str(r["workers"]), f"{r['shmeval_us']:.2f}", f"{r['reference_us']:.2f}",
              f"{r['multiple']:.2f}x" if r["multiple"] is not None else "-"] for r in rows]
    lines.append(format_table(["state", "workers", "shmeval µs", "limit µs", "multiple"], table))
    return "\n".join(lines)
