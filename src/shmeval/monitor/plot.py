"""``shmeval plot RUN.json``: the time series of a ``shmeval selfplay
--json`` run as one PNG, a panel per figure: moves and evaluations per
second, the mean batch, the model version, the learner's loss, and the
net's score against the rollout MCTS (``--eval-every``), each mode (and
each run of ``--repeats``) a line of its own."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from matplotlib.axes import Axes
from matplotlib.figure import Figure

#: A run as plotted: its label and its result (the "modes" entry of the JSON).
Run = Tuple[str, Dict[str, Any]]


class PlotError(Exception):
    """The file is not a self-play run with a time series."""


def load_runs(path: str) -> Tuple[List[Run], Dict[str, Any]]:
    """The runs of a ``shmeval selfplay --json`` file that have a time
    series, labelled by mode (and run number with ``--repeats``), and the
    file's settings.  Raises PlotError saying what is wrong."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise PlotError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise PlotError(f"{path} is not JSON: {e}") from None
    modes = data.get("modes") if isinstance(data, dict) else None
    if not isinstance(modes, dict):
        raise PlotError(f"{path} is not a 'shmeval selfplay --json' file (no \"modes\")")
    runs: List[Run] = []
    for mode, result in modes.items():
        every = result.get("runs", [result])
        for i, r in enumerate(every):
            if r.get("series", {}).get("t_s"):
                runs.append((mode if len(every) == 1 else f"{mode} run {i + 1}", r))
    if not runs:
        raise PlotError(f"{path} holds no time series (shmeval selfplay --json writes one)")
    return runs, data.get("settings", {})


def _has(runs: List[Run], column: str) -> bool:
    return any(v is not None for _, r in runs for v in r["series"].get(column, []))


def _lines(ax: Axes, runs: List[Run], column: str, step: bool = False) -> None:
    for label, r in runs:
        s = r["series"]
        ys = [math.nan if v is None else v for v in s.get(column, [])]
        if step:
            ax.step(s["t_s"], ys, where="post", label=label)
        else:
            ax.plot(s["t_s"], ys, label=label)


def _win_rate(ax: Axes, runs: List[Run]) -> None:
    for label, r in runs:
        matches = r.get("win_rate") or []
        ts = [m["t_s"] for m in matches]
        scores = [m["score"] for m in matches]
        # One standard error of a score over m["games"] games.
        errs = [math.sqrt(max(m["score"] * (1 - m["score"]), 0.0) / m["games"]) for m in matches]
        ax.errorbar(ts, scores, yerr=errs, marker="o", capsize=3, label=label)
        for m in matches:
            ax.annotate(f"v{m['version_max']}", (m["t_s"], m["score"]),
                        textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7)
    ax.set_ylim(-0.05, 1.05)
    ax.axhline(0.5, color="grey", lw=0.8, ls=":")


def _panels(runs: List[Run]) -> List[Tuple[str, Callable[[Axes], None]]]:
    """The panels this file has data for: (y label, drawing function)."""
    out: List[Tuple[str, Callable[[Axes], None]]] = [
        ("moves/s", lambda ax: _lines(ax, runs, "moves_per_s")),
        ("evaluations/s", lambda ax: _lines(ax, runs, "evals_per_s")),
        ("mean batch", lambda ax: _lines(ax, runs, "mean_batch"))]
    if _has(runs, "model_version"):
        out.append(("model version", lambda ax: _lines(ax, runs, "model_version", step=True)))
    if _has(runs, "loss"):
        out.append(("learner loss", lambda ax: _lines(ax, runs, "loss")))
    if any(r.get("win_rate") for _, r in runs):
        out.append(("score vs rollout MCTS", lambda ax: _win_rate(ax, runs)))
    return out


def plot(path: str, out: str, title: Optional[str] = None) -> List[str]:
    """Draws the run in ``path`` to the PNG ``out``; returns the panels'
    names.  Raises PlotError for a file without a time series."""
    runs, settings = load_runs(path)
    panels = _panels(runs)
    fig = Figure(figsize=(9, 2.1 * len(panels) + 0.6), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    warmup = settings.get("warmup")
    for ax, (name, draw) in zip(axes, panels):
        draw(ax)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if warmup:
            ax.axvline(warmup, color="grey", lw=0.8, ls="--")
    axes[0].legend(loc="best", fontsize=8)
    axes[-1].set_xlabel("seconds since the workers started (dashed: the measured window opens)")
    fig.suptitle(title or _title(path, settings))
    fig.savefig(out, dpi=100)
    return [name for name, _ in panels]


def _title(path: str, settings: Dict[str, Any]) -> str:
    text = os.path.basename(path)
    if settings:
        text += (f": {settings.get('workers')} workers x {settings.get('games_per_worker')} games, "
                 f"{settings.get('simulations')} simulations/move"
                 + (", training" if settings.get("train") else ""))
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN.json", help="a file written by shmeval selfplay --json")
    p.add_argument("-o", "--output", metavar="PATH.png",
                   help="where to write the picture (default: RUN.png beside RUN.json)")
    p.add_argument("--title", help="the picture's title (default: the file's name and settings)")


def main(args: argparse.Namespace) -> int:
    """``shmeval plot``: returns the exit code."""
    out = args.output or os.path.splitext(args.run)[0] + ".png"
    try:
        panels = plot(args.run, out, args.title)
    except PlotError as e:
        print(f"shmeval plot: {e}", file=sys.stderr)
        return 1
    print(f"{out}: {', '.join(panels)}")
    return 0
