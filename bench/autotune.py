#!/usr/bin/env python
"""The tuner's settings (every knob "auto", the default) against settings
chosen by hand, for each load: does "no knobs" cost throughput anywhere?

Each cell of the table is one load: N worker processes (1, 2, 4, 16, 64),
each evaluating one Connect Four state at a time in a closed loop, against
one model:

  null    a NumPy function of the batch (the evaluator's own cost only)
  device  a fixed 200 µs plus 5 µs per row, with the GIL released: the
          calls sleep, one at a time, on a lock standing for a device;
          it declares max_concurrency = 2 (two calls may overlap)
  tfnet   the self-play demo's residual net (2 blocks of 32 filters) in
          TFModel, loaded from a .keras file

on 1 or 2 CPUs: the whole run (this script's process, the evaluator, the
workers) under `taskset -c 0` or `taskset -c 0,1`.  In each cell every
setting serves the same workers:

  auto      Evaluator.spawn's defaults (max_wait_us, spin_us,
            evaluator_spin_us, serving_threads "auto"; TFModel's defaults)
  today     the defaults before the tuner: greedy, client spin 100 µs,
            evaluator spin 50 µs, one serving thread, TFModel(path)
            unfrozen with TensorFlow's default thread pools
  threads2, wait100, nospin
            hand settings: two serving threads, max_wait_us 100, or no
            spinning (and, on request, wait500, threads2-wait100 and
            client300: today's with a 300 µs client spin, longer than the
            device model's call); the
            TensorFlow net then frozen with one intra-op and two inter-op
            threads (the README's hand-tuned factory before the tuner)
  client-spin, evaluator-spin, auto-clients, auto-evaluator
            on request, to tell the two spins apart: today's with only
            the clients' spin (evaluator 0) or only the evaluator's
            (clients 0); auto with the evaluator's spin fixed at today's
            50 µs (the clients' spin arms alone) or the clients' at
            today's 100 µs (the evaluator's tuner alone); the two auto
            ones are columns of the table, never its best hand setting

Each setting has its own evaluator, all of a model's up at once; each
worker count serves every setting in turn, --repeats rounds with the order
rotated each round, a window of --seconds after a warm-up (--warmup for
auto's first window of a cell, since it must settle after every change of
the worker count; --hand-warmup otherwise), and the cell's figure is the
median of its windows.  The table prints each cell's rates, the best hand
setting and the ratios auto/best and auto/today; the targets are auto >=
0.9x the best hand setting and >= today's in every cell.  The best of
several noisy figures overstates the setting it picks, so the table also
holds that comparison out: the best hand setting chosen on the first half
of the rounds, against auto on the other half (held_out).  Where today and
nospin are one setting (same_setting: the spin rule lets no one spin), the
summary gives their ratio, the noise any comparison of the run carries.
The summary's sign tests name the cells where auto is below 0.9x the best
hand setting, or below today's, in more rounds than chance allows (one
round of each setting after another, so a round's speed falls on both);
the same test of today against nospin where they are one setting shows
how often it errs.  --summarize prints the table and summary of a grid's
JSON file again, running nothing.

--timeline runs a second experiment instead, on the CPUs it has: the device
model served with every knob "auto" while 16 workers become 64 and then
16 again, then the model's cost doubles, then a busy loop runs on every
CPU (another program taking them), sampling ev.stats() every 0.2 s: the
plot shows throughput and the wait the tuner chose over time, and the
table how long each phase took to settle.

    python bench/autotune.py --json bench/results/autotune.json --plot docs/img/autotune.png
    python bench/autotune.py --quick                        # 2 CPUs, 1 and 16 workers, 3 settings
    python bench/autotune.py --summarize bench/results/autotune.json   # read a grid again
    python bench/autotune.py --timeline --json bench/results/autotune-timeline.json \\
        --plot docs/img/autotune-timeline.png

The full grid takes about 25 minutes on 2 cores; --workers, --models,
--cpus and --settings select part of it, and --reports prints what auto's
tuner was doing (its phase, choice and reasons) after each of its windows.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing import shared_memory
from typing import Any, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import shmeval  # noqa: E402
from shmeval._util.children import (child_setup, start_busy_loops, start_process,  # noqa: E402
                                    stop_busy_loops)
from shmeval._util.jsonout import write_json  # noqa: E402
from shmeval._util.machine import machine_info  # noqa: E402
from shmeval._util.procstat import machine_steal_s  # noqa: E402

INPUT_SHAPE = (6, 7, 2)
OUTPUTS = {"policy": ((7,), "float32"), "value": ((), "float32")}
MODELS = ("null", "device", "tfnet")
WORKERS = (1, 2, 4, 16, 64)
CPUS = (1, 2)
TODAY = dict(max_wait_us=0, spin_us=100, evaluator_spin_us=50, serving_threads=1)
#: name -> (Evaluator.spawn keyword arguments, how the TensorFlow net is built)
SETTINGS: Dict[str, Tuple[Dict[str, Any], str]] = {
    "auto": ({}, "auto"),
    "today": (TODAY, "plain"),
    "threads2": (dict(TODAY, serving_threads=2), "hand"),
    "wait100": (dict(TODAY, max_wait_us=100), "hand"),
    "wait500": (dict(TODAY, max_wait_us=500), "hand"),
    "client300": (dict(TODAY, spin_us=300), "hand"),
    "threads2-wait100": (dict(TODAY, serving_threads=2, max_wait_us=100), "hand"),
    "nospin": (dict(TODAY, spin_us=0, evaluator_spin_us=0), "hand"),
    "client-spin": (dict(TODAY, evaluator_spin_us=0), "hand"),
    "evaluator-spin": (dict(TODAY, spin_us=0), "hand"),
    "auto-clients": (dict(evaluator_spin_us=TODAY["evaluator_spin_us"]), "auto"),
    "auto-evaluator": (dict(spin_us=TODAY["spin_us"]), "auto"),
}
#: Settings that leave part of the choice to the tuner: columns of the
#: table for taking a cell apart, never the best hand setting.
PARTLY_AUTO = ("auto-clients", "auto-evaluator")
#: The grid run by default (the others on request: --settings).
DEFAULT_SETTINGS = ("auto", "today", "threads2", "wait100", "nospin")
QUICK_SETTINGS = ("auto", "today", "threads2")
#: The significance level of the sign tests (:func:`sign_test`).
ALPHA = 0.05
START_DELAY_S = 0.3  # the workers are past their queue.get() when the warm-up begins
#: The device model: fixed and per-row cost.
DEVICE_FIXED_S, DEVICE_ROW_S = 200e-6, 5e-6


# --- the models (built in the evaluator process) ----------------------------------------


class NullModel:
    """Uniform policy, the state's mean as value."""

    def __call__(self, batch: np.ndarray) -> Dict[str, np.ndarray]:
        n = len(batch)
        return {"policy": np.full((n, 7), 1 / 7, np.float32),
                "value": batch.reshape(n, -1).mean(axis=1)}


class DeviceModel:
    """A fixed cost plus a cost per row, the GIL released: each call sleeps
    on a lock standing for one device (calls from two threads overlap only
    outside it).  ``scale`` (the name of a shared-memory block holding a
    float64, default: none, 1) multiplies the cost: --timeline doubles it."""

    max_concurrency = 2

    def __init__(self, scale: Optional[str] = None) -> None:
        self.shm = shared_memory.SharedMemory(scale) if scale else None
        self.scale = np.ndarray((1,), np.float64, self.shm.buf) if self.shm else None
        self.device = threading.Lock()
        self.local = threading.local()

    def __call__(self, batch: np.ndarray) -> Dict[str, np.ndarray]:
        if not getattr(self.local, "slack", False):
            shmeval._ring.set_timer_slack_ns(1000)  # sleeps of tens of µs stay precise
            self.local.slack = True
        n = len(batch)
        k = float(self.scale[0]) if self.scale is not None else 1.0
        with self.device:
            time.sleep(k * (DEVICE_FIXED_S + DEVICE_ROW_S * n))
        return {"policy": np.full((n, 7), 1 / 7, np.float32),
                "value": batch.reshape(n, -1).mean(axis=1)}


def make_model(kind: str, style: str, net_path: str, scale: Optional[str] = None) -> Any:
    """Evaluator.spawn's factory (module-level: it is pickled)."""
    if kind == "null":
        return NullModel()
    if kind == "device":
        return DeviceModel(scale)
    from shmeval.backends.tensorflow import TFModel
    if style == "auto":
        return TFModel(net_path)
    if style == "plain":  # TFModel's defaults before the tuner
        return TFModel(net_path, freeze=False, intra_op_threads=None, inter_op_threads=None)
    return TFModel(net_path, freeze=True, intra_op_threads=1, inter_op_threads=2)


def save_net(path: str) -> None:
    """The demo's net, saved as a .keras file (in a process of its own, so
    that this one never imports TensorFlow)."""
    from shmeval.games.connect4_net import NetConfig, build_resnet, import_tensorflow
    import_tensorflow()
    build_resnet(NetConfig(), seed=0, compile=False).save(path)


# --- the workers ---------------------------------------------------------------------------


def worker_main(i: int, commands: Any, results: Any) -> None:
    """Runs each command (handle, start, measure_from, end; CLOCK_MONOTONIC
    seconds): from start, evaluates one state at a time until end, and
    reports the calls that returned in [measure_from, end)."""
    child_setup()
    rng = np.random.default_rng(i)
    state = rng.integers(0, 2, INPUT_SHAPE).astype(np.float32)
    while True:
        cmd = commands.get()
        if cmd is None:
            return
        handle, start, measure_from, end = cmd
        delay = start - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        counted = 0
        now = time.monotonic
        evaluate = handle.evaluate
        while True:
            evaluate(state)
            t = now()
            if t >= end:
                break
            if t >= measure_from:
                counted += 1
        handle.close()
        results.put((i, counted))


class Pool:
    """Worker processes started once and reused by every cell."""

    def __init__(self, n: int) -> None:
        self.ctx = mp.get_context("spawn")
        self.results = self.ctx.Queue()
        self.commands = [self.ctx.Queue() for _ in range(n)]
        self.procs = [start_process(self.ctx, worker_main, f"autotune-worker-{i}",
                                    (i, self.commands[i], self.results)) for i in range(n)]

    def run(self, ev: Any, plan: Sequence[Tuple[int, float, float, float]]) -> List[int]:
        """plan: (worker, start, measure_from, end) each; returns the counts
        in plan order."""
        for w, start, measure_from, end in plan:
            self.commands[w].put((ev, start, measure_from, end))
        got: Dict[int, int] = {}
        while len(got) < len(plan):
            i, counted = self.results.get(timeout=600)
            got[i] = counted
        return [got[w] for w, *_ in plan]

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


# --- the grid ------------------------------------------------------------------------------


def spawn(kind: str, setting: str, net_path: str, scale: Optional[str] = None) -> Any:
    kwargs, style = SETTINGS[setting]
    factory = functools.partial(make_model, kind, style, net_path, scale)
    return shmeval.Evaluator.spawn(factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                   max_batch=256, max_clients=128, **kwargs)


def run_grid(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """This process's part of the grid: its CPUs, every model, setting and
    worker count asked for.  A model's evaluators (one per setting) are
    started together and stay up; each worker count then serves every
    setting in turn, --repeats times, the order rotated each round, so
    that the settings of a cell are measured in the same minute; a cell's
    figure is the median of its windows."""
    workers = sorted(args.workers)
    pool = Pool(max(workers))
    rows: List[Dict[str, Any]] = []
    settings = list(args.settings)
    try:
        for kind in args.models:
            evs: Dict[str, Any] = {}
            startup: Dict[str, float] = {}
            try:
                for setting in settings:
                    t_start = time.monotonic()
                    evs[setting] = spawn(kind, setting, args.net)
                    startup[setting] = time.monotonic() - t_start
                for k, n in enumerate(workers):
                    rates: Dict[str, List[float]] = {s: [] for s in settings}
                    # Each setting's stats as its own last window ended: read
                    # after the cell, auto's tuner would report the load of
                    # the settings served after it (their workers spinning).
                    ended: Dict[str, Dict[str, Any]] = {}
                    for r in range(args.repeats):
                        shift = (k + r) % len(settings)
                        for setting in settings[shift:] + settings[:shift]:
                            # auto settles after the worker count changed (its
                            # first window of the cell); later rounds find the
                            # same load and no settling to do.
                            warm = (args.warmup if setting == "auto" and r == 0
                                    else args.hand_warmup)
                            t0 = time.monotonic() + START_DELAY_S
                            plan = [(w, t0, t0 + warm, t0 + warm + args.seconds)
                                    for w in range(n)]
                            rates[setting].append(sum(pool.run(evs[setting], plan)) /
                                                  args.seconds)
                            ended[setting] = evs[setting].stats()
                            if args.reports and setting == "auto":
                                print_report(n, r, rates[setting][-1], evs[setting])
                    for setting in settings:
                        st = ended[setting]
                        row = {"cpus": args.ncpu, "model": kind, "setting": setting,
                               "workers": n, "rate": statistics.median(rates[setting]),
                               "rates": rates[setting], "mean_batch": st["mean_batch"],
                               "startup_s": startup[setting], "load_avg": os.getloadavg()[0],
                               "tuner": st.get("tuner")}
                        rows.append(row)
                        print(f"  {args.ncpu} cpu  {kind:6s} {setting:17s} {n:3d} workers  "
                              f"{row['rate']:10,.0f}/s  ({', '.join(f'{x:,.0f}' for x in rates[setting])})",
                              flush=True)
            finally:
                for ev in evs.values():
                    ev.close()
    finally:
        pool.close()
    return rows


def print_report(workers: int, round_: int, rate: float, ev: Any) -> None:
    """--reports: what auto's tuner was doing when one of its windows ended."""
    t = ev.stats().get("tuner") or {}
    print(f"    auto report  {workers:3d} workers, round {round_}: {rate:10,.0f}/s  "
          f"{t.get('phase')}; wait {t.get('max_wait_us')} µs, {t.get('serving_threads')} "
          f"calls in flight, spin {t.get('spin')}; {t.get('why_threads')}; {t.get('why_wait')}",
          flush=True)


def held_out(rates: Dict[str, List[float]],
             hand: Sequence[str]) -> Optional[Tuple[str, float, float]]:
    """The best hand setting chosen on the first half of a cell's rounds and
    measured on the other half: (setting, its median there, auto's median
    in the same rounds), or None with fewer than two rounds.

    Chosen and measured on the same windows, the best of several settings
    is biased upwards: the largest of k noisy figures exceeds the true
    rate of the setting it picks (with four settings alike and each
    window off by 15%, by about 15% on average), so auto would look
    behind settings that are no better.  Held-out rounds measure the
    chosen setting without that bias, against auto in the same rounds."""
    rounds = min(len(rates[s]) for s in ["auto", *hand])
    if rounds < 2 or not hand:
        return None
    k = rounds // 2
    chosen = max(hand, key=lambda s: statistics.median(rates[s][:k]))
    return (chosen, statistics.median(rates[chosen][k:rounds]),
            statistics.median(rates["auto"][k:rounds]))


def paired(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
    """The median over rounds of a's window over b's in the same round.

    A cell's settings take their windows of a round within seconds of each
    other, its rounds a minute or more apart; on a shared host the
    machine's speed moves between rounds by more than the settings differ
    (the noise pairs).  The ratio within each round cancels what the
    round's minute did to both, which the ratio of the medians over all
    rounds does not."""
    ratios = [x / y for x, y in zip(a, b) if y > 0]
    return statistics.median(ratios) if ratios else None


def sign_test(a: Sequence[float], b: Sequence[float], factor: float = 1.0
              ) -> Optional[Tuple[int, int, float]]:
    """Whether a is below ``factor`` times b in more rounds than chance
    allows: (rounds a < factor * b, rounds, one-sided p), or None without
    rounds.  p is the chance of at least that many such rounds if each
    round went either way with even odds (the exact binomial tail), so it
    asks nothing of how far apart the windows are, and a shared host's
    swings between rounds cancel as in :func:`paired`.  With n rounds the
    least p is 2**-n: 4 rounds can never reach ALPHA, 5 can only with
    every round one way, 8 with 7 of them."""
    pairs = [(x, y) for x, y in zip(a, b) if y > 0]
    if not pairs:
        return None
    n = len(pairs)
    below = sum(x < factor * y for x, y in pairs)
    return below, n, sum(math.comb(n, k) for k in range(below, n + 1)) / 2 ** n


def apart(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
    """The two-sided :func:`sign_test` p of a against b."""
    lo, hi = sign_test(a, b), sign_test(b, a)
    if lo is None or hi is None:
        return None
    return min(1.0, 2 * min(lo[2], hi[2]))


def same_setting(model: str, cpus: int, workers: int) -> bool:
    """``today`` and ``nospin`` are one setting in this cell: a model
    without TensorFlow (the two differ in the net's style only for tfnet),
    and more processes (the workers and the evaluator) than one per CPU
    plus one, where the spin rule (``_ring.spin_policy``) lets neither the
    clients nor the evaluator spin, whatever their budgets.  Their ratio
    there is the grid's noise: what two runs of one setting differ by."""
    return model != "tfnet" and workers > cpus


def noise(cells: Dict[Tuple[str, int, int], Dict[str, float]],
          windows: Optional[Dict[Tuple[str, int, int], Dict[str, List[float]]]] = None
          ) -> Dict[str, Any]:
    """today against nospin where they are one setting (same_setting):
    the larger over the smaller in each such cell; with ``windows`` (each
    setting's windows, by round), the same of their paired ratio."""
    ones = [k for k, r in cells.items()
            if same_setting(*k) and r.get("today") and r.get("nospin")]
    ratios = [max(cells[k]["today"], cells[k]["nospin"]) /
              min(cells[k]["today"], cells[k]["nospin"]) for k in ones]
    out = {"cells": len(ratios),
           "median": statistics.median(ratios) if ratios else None,
           "max": max(ratios) if ratios else None,
           "cells_apart_by_more_than_0.9": sum(x > 1 / 0.9 for x in ratios)}
    if windows is not None:
        each = [paired(windows[k]["today"], windows[k]["nospin"]) for k in ones]
        pr = [max(x, 1 / x) for x in each if x]
        out["paired_median"] = statistics.median(pr) if pr else None
        out["paired_max"] = max(pr) if pr else None
        # Two-sided: one setting, so either may come out ahead.
        ps = [p for p in (apart(windows[k]["today"], windows[k]["nospin"]) for k in ones)
              if p is not None]
        out["cells_apart_by_sign_test"] = sum(p < ALPHA for p in ps)
    return out


def table(rows: List[Dict[str, Any]], settings: Sequence[str]) -> Tuple[str, Dict[str, Any]]:
    """The Markdown table of the grid and its summary.  ``best hand`` and
    ``auto / best`` take the best of the hand settings' medians over all
    rounds (biased towards the hand settings: held_out); ``held out``
    chooses it on the first half of the rounds and compares it with auto
    on the others.  ``paired`` compares auto with each hand setting round
    by round (:func:`paired`): ``auto / best`` there is the least of
    those ratios (the hand setting auto fares worst against, a choice
    biased against auto), ``auto / today`` the one against today's."""
    cells: Dict[Tuple[str, int, int], Dict[str, Dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["model"], r["cpus"], r["workers"]), {})[r["setting"]] = r
    columns = [s for s in settings if s != "auto"]
    hand = [s for s in columns if s not in PARTLY_AUTO]
    head = ("| model | CPUs | workers | auto | " + " | ".join(columns) +
            " | best hand | auto / best | held out: best, auto / best | auto / today |"
            " paired: best, auto / best | paired: auto / today |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    ratios: Dict[str, List[float]] = {"best": [], "held_out": [], "today": [],
                                      "paired_best": [], "paired_today": []}
    # Cells where auto is below the target in more rounds than chance
    # allows (sign_test), against the best hand setting by median (the
    # choice biased towards the hand settings) and against today's.
    below: Dict[str, List[str]] = {"0.9_best": [], "today": []}
    tested: Dict[str, int] = {"0.9_best": 0, "today": 0}
    for (model, cpus, n), got in sorted(cells.items(), key=lambda kv: (
            MODELS.index(kv[0][0]) if kv[0][0] in MODELS else 9, kv[0][1], kv[0][2])):
        rates = {s: r["rate"] for s, r in got.items()}
        auto = rates.get("auto")
        hands = {s: rates[s] for s in hand if s in rates}
        best = max(hands, key=lambda s: hands[s]) if hands else None
        rb = auto / hands[best] if auto and best else None
        rt = auto / rates["today"] if auto and rates.get("today") else None
        windows = {s: r["rates"] for s, r in got.items()}
        ho = held_out(windows, list(hands)) if auto else None
        rh = ho[2] / ho[1] if ho and ho[1] else None
        against: Dict[str, float] = {}
        for s in hands if auto else []:
            x = paired(windows["auto"], windows[s])
            if x is not None:
                against[s] = x
        pbest = min(against, key=lambda s: against[s]) if against else None
        pb = against[pbest] if pbest else None
        pt = against.get("today")
        for key, x in (("best", rb), ("held_out", rh), ("today", rt),
                       ("paired_best", pb), ("paired_today", pt)):
            if x is not None:
                ratios[key].append(x)
        for key, versus, factor in (("0.9_best", best, 0.9), ("today", "today", 1.0)):
            test = (sign_test(windows["auto"], windows[versus], factor)
                    if auto and versus in windows else None)
            if test is not None:
                tested[key] += 1
                if test[2] < ALPHA:
                    below[key].append(f"{model}, {cpus} CPUs, {n} workers: {test[0]} of "
                                      f"{test[1]} rounds below {versus}"
                                      f"{' x 0.9' if factor != 1.0 else ''}, p {test[2]:.3f}")

        def fmt(x: Optional[float]) -> str:
            return f"{x:,.0f}" if x is not None else "-"

        lines.append(f"| {model} | {cpus} | {n} | **{fmt(auto)}** | " +
                     " | ".join(fmt(rates.get(s)) for s in columns) +
                     f" | {best or '-'} | {f'{rb:.2f}' if rb else '-'} | " +
                     (f"{ho[0]}, {rh:.2f}" if ho and rh else "-") +
                     f" | {f'{rt:.2f}' if rt else '-'} | " +
                     (f"{pbest}, {pb:.2f}" if pbest and pb else "-") +
                     f" | {f'{pt:.2f}' if pt else '-'} |")

    def figures(xs: List[float], versus: str, at_least: str, bar: float) -> Dict[str, Any]:
        """The least and median ratio, and the cells at ``bar`` or more."""
        return {f"min_auto_over_{versus}": min(xs) if xs else None,
                f"median_auto_over_{versus}": statistics.median(xs) if xs else None,
                f"cells_auto_at_least_{at_least}": sum(r >= bar for r in xs)}

    summary = {
        "cells": len(cells),
        **figures(ratios["best"], "best", "0.9_best", 0.9),
        "held_out_cells": len(ratios["held_out"]),
        **figures(ratios["held_out"], "best_held_out", "0.9_best_held_out", 0.9),
        **figures(ratios["today"], "today", "today", 1.0),
        **figures(ratios["paired_best"], "best_paired", "0.9_best_paired", 0.9),
        **figures(ratios["paired_today"], "today_paired", "today_paired", 1.0),
        "sign_tests": {"alpha": ALPHA, "cells_tested": tested,
                       "cells_significantly_below": {k: len(v) for k, v in below.items()},
                       "significantly_below": below},
        "same_setting_today_nospin": noise({k: {s: r["rate"] for s, r in v.items()}
                                            for k, v in cells.items()},
                                           {k: {s: r["rates"] for s, r in v.items()}
                                            for k, v in cells.items()}),
    }
    return "\n".join(lines), summary


def plot_grid(rows: List[Dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in MODELS if any(r["model"] == m for r in rows)]
    cpus = sorted({r["cpus"] for r in rows})
    fig, axes = plt.subplots(len(cpus), len(models), figsize=(4.2 * len(models), 3.4 * len(cpus)),
                             squeeze=False)
    for i, c in enumerate(cpus):
        for j, m in enumerate(models):
            ax = axes[i][j]
            mine = [r for r in rows if r["cpus"] == c and r["model"] == m]
            ws = sorted({r["workers"] for r in mine})
            for setting in sorted({r["setting"] for r in mine}, key=lambda s: s != "auto"):
                ys = [next((r["rate"] for r in mine if r["workers"] == w and
                            r["setting"] == setting), np.nan) for w in ws]
                style = dict(lw=2.5, color="k", zorder=3) if setting == "auto" else (
                    dict(lw=1.5, color="tab:red", ls="--") if setting == "today" else
                    dict(lw=0.8, alpha=0.6))
                ax.plot(ws, ys, marker="o", ms=3, label=setting, **style)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ws, [str(w) for w in ws])
            ax.set_title(f"{m}, {c} CPU{'s' if c > 1 else ''}", fontsize=10)
            ax.set_xlabel("workers")
            if j == 0:
                ax.set_ylabel("evaluations/s")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


# --- the timeline --------------------------------------------------------------------------


def phases(few: int, many: int) -> List[Tuple[str, int, float, bool]]:
    """The timeline's phases: (name, workers, the model's cost factor,
    whether a busy loop runs on every CPU, as another program would)."""
    return [(f"{few} workers", few, 1.0, False), (f"{many} workers", many, 1.0, False),
            (f"{few} workers", few, 1.0, False), (f"{few} workers, model cost x2", few, 2.0, False),
            (f"{few} workers, cost x2, a busy loop per CPU", few, 2.0, True)]


def run_timeline(args: argparse.Namespace) -> Dict[str, Any]:
    plan_phases = phases(*args.timeline_workers)
    shm = shared_memory.SharedMemory(create=True, size=8)
    scale = np.ndarray((1,), np.float64, shm.buf)
    scale[0] = 1.0
    pool = Pool(max(n for _, n, _, _ in plan_phases))
    ev = spawn("device", "auto", args.net, shm.name)
    samples: List[Dict[str, Any]] = []
    busy: List[subprocess.Popen[bytes]] = []
    try:
        t0 = time.monotonic() + 1.0
        spans: Dict[int, List[float]] = {}
        for k, (_, n, _, _) in enumerate(plan_phases):
            a, b = t0 + k * args.phase, t0 + (k + 1) * args.phase
            for w in range(n):
                if w in spans and spans[w][1] == a:
                    spans[w][1] = b
                else:
                    spans.setdefault(w, [a, b])
        # The extra workers run in the second phase only; the first few
        # throughout.
        plan = [(w, s, s, e) for w, (s, e) in sorted(spans.items())]
        done: List[List[int]] = []
        runner = threading.Thread(target=lambda: done.append(pool.run(ev, plan)), daemon=True)
        runner.start()
        end = t0 + len(plan_phases) * args.phase
        prev = None
        while time.monotonic() < end:
            now = time.monotonic()
            phase = int((now - t0) // args.phase) if now >= t0 else -1
            scale[0] = plan_phases[phase][2] if phase >= 0 else 1.0
            if phase >= 0 and plan_phases[phase][3] and not busy:
                busy = start_busy_loops(len(os.sched_getaffinity(0)))
            st = ev.stats()
            tuner = st.get("tuner") or {}
            s = {"t": now - t0, "phase": phase, "requests": st["requests"],
                 "clients": st["clients"], "max_wait_us": tuner.get("max_wait_us"),
                 "serving_threads": tuner.get("serving_threads"),
                 "batch_cap": tuner.get("batch_cap"), "spin": tuner.get("spin"),
                 "crowding": tuner.get("crowding"), "runnable": tuner.get("runnable"),
                 "tuner_phase": tuner.get("phase"), "mean_batch_total": st["mean_batch"],
                 "model_us_at_mean_batch": tuner.get("model_us_at_mean_batch")}
            if prev is not None:
                s["rate"] = (s["requests"] - prev["requests"]) / (s["t"] - prev["t"])
            samples.append(s)
            prev = s
            time.sleep(max(0.0, 0.2 - (time.monotonic() - now)))
        stop_busy_loops(busy)   # the workers' last calls need the CPUs
        runner.join(60)
    finally:
        stop_busy_loops(busy)
        ev.close()
        pool.close()
        del scale
        shm.close()
        shm.unlink()
    names = [p[0] for p in plan_phases]
    return {"samples": samples, "phases": names, "phase_s": args.phase,
            "settle": settle_times(samples, args.phase, names)}


def settle_times(samples: List[Dict[str, Any]], phase_s: float,
                 names: Sequence[str]) -> List[Dict[str, Any]]:
    """Per phase: when the tuner's choice (wait, threads, the clients'
    crowding) last changed, and from when on the 1 s rolling throughput
    stayed within 15% of the phase's last half's mean."""
    out = []
    for k, name in enumerate(names):
        mine = [s for s in samples if s["phase"] == k and "rate" in s]
        if not mine:
            continue
        start = k * phase_s
        choice = [(s["max_wait_us"], s["serving_threads"], s.get("crowding")) for s in mine]
        last_change = start
        for t, a, b in zip([s["t"] for s in mine[1:]], choice, choice[1:]):
            if a != b:
                last_change = t
        rates = np.array([s["rate"] for s in mine])
        ts = np.array([s["t"] for s in mine])
        roll = np.array([rates[max(0, i - 4):i + 1].mean() for i in range(len(rates))])
        final = rates[ts >= start + phase_s / 2].mean()
        ok = np.abs(roll / final - 1) <= 0.15
        settled_at = ts[-1]
        for i in range(len(ok) - 1, -1, -1):
            if not ok[i]:
                break
            settled_at = ts[i]
        out.append({"phase": name, "choice_settled_s": round(last_change - start, 2),
                    "rate_settled_s": round(float(settled_at) - start, 2),
                    "final_rate": float(final), "final_choice": list(choice[-1])})
    return out


def plot_timeline(res: Dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = [x for x in res["samples"] if "rate" in x and x["t"] >= 0]
    t = [x["t"] for x in s]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    a1.plot(t, [x["rate"] for x in s], color="k", lw=1)
    a1.set_ylabel("evaluations/s")
    a1.set_ylim(bottom=0)
    a2.step(t, [x["max_wait_us"] or 0 for x in s], where="post", color="tab:blue",
            label="max wait (µs)")
    a2.set_ylabel("chosen wait (µs)")
    a3 = a2.twinx()
    a3.step(t, [x["serving_threads"] or 0 for x in s], where="post", color="tab:orange",
            label="calls in flight")
    a3.set_ylabel("calls in flight")
    a3.set_ylim(0, 3)
    for k, name in enumerate(res["phases"]):
        for ax in (a1, a2):
            ax.axvline(k * res["phase_s"], color="grey", lw=0.6, ls=":")
        # Alternate heights: the longer names run past their phase.
        a1.text(k * res["phase_s"] + 0.2, 0.02 + 0.08 * (k % 2), name,
                transform=a1.get_xaxis_transform(), fontsize=8, color="grey")
    a2.set_xlabel("seconds")
    a1.set_title("the device model (200 µs + 5 µs/row), every knob \"auto\"", fontsize=10)
    fig.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


# --- the command line ----------------------------------------------------------------------


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="2 CPUs, null and device models, 1 and 16 workers, auto/today/threads2, "
                        "short windows (about 2 minutes)")
    p.add_argument("--timeline", action="store_true",
                   help="the timeline experiment instead of the grid")
    p.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")],
                   default=list(WORKERS))
    p.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    p.add_argument("--cpus", type=lambda s: [int(x) for x in s.split(",")], default=list(CPUS),
                   help="CPU counts to run under taskset (default 1,2)")
    p.add_argument("--settings", type=lambda s: s.split(","), default=list(DEFAULT_SETTINGS),
                   help=f"default {','.join(DEFAULT_SETTINGS)}; also: "
                        f"{','.join(s for s in SETTINGS if s not in DEFAULT_SETTINGS)}")
    p.add_argument("--seconds", type=float, default=1.2, help="measured window")
    p.add_argument("--repeats", type=int, default=4,
                   help="windows per setting and cell, in rotated rounds (median)")
    p.add_argument("--warmup", type=float, default=4.5,
                   help="auto's warm-up before each window: it settles after each change")
    p.add_argument("--hand-warmup", type=float, default=0.5)
    p.add_argument("--phase", type=float, default=10.0, help="--timeline: seconds per phase")
    p.add_argument("--timeline-workers", type=lambda s: [int(x) for x in s.split(",")],
                   default=[16, 64], help="--timeline: the few and the many workers (16,64)")
    p.add_argument("--reports", action="store_true",
                   help="print auto's tuner report (phase, choice, why) after each of its windows")
    p.add_argument("--summarize", metavar="PATH",
                   help="run nothing: print the table and summary of a grid's JSON file "
                        "(the current reading of its windows)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH.png")
    p.add_argument("--net", help=argparse.SUPPRESS)          # the .keras file (children)
    p.add_argument("--ncpu", type=int, help=argparse.SUPPRESS)  # a child under taskset
    p.add_argument("--rows-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.cpus, args.workers, args.models = [2], [1, 16], ["null", "device"]
        args.settings = list(QUICK_SETTINGS)
        args.seconds, args.warmup, args.repeats = 1.0, 4.0, 1
    for s in args.settings:
        if s not in SETTINGS:
            p.error(f"unknown setting {s!r} (choose from {', '.join(SETTINGS)})")
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r} (choose from {', '.join(MODELS)})")
    if "auto" not in args.settings:
        args.settings.insert(0, "auto")
    if len(args.timeline_workers) != 2 or not 0 < args.timeline_workers[0] < args.timeline_workers[1]:
        p.error("--timeline-workers takes two counts, the few then the many (e.g. 16,64)")
    return args


def print_grid(text: str, summary: Dict[str, Any]) -> None:
    print(text)
    print()
    print(json.dumps(summary, indent=1))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    if args.summarize:
        with open(args.summarize) as f:
            grid = json.load(f)
        if grid.get("experiment") != "grid":
            print(f"{args.summarize} holds no grid (experiment "
                  f"{grid.get('experiment')!r})", file=sys.stderr)
            return 2
        print_grid(*table(grid["rows"], grid["args"]["settings"]))
        return 0
    if args.ncpu is not None:  # a child: this CPU count's part of the grid
        write_json(args.rows_out, run_grid(args))
        return 0
    tmp = tempfile.mkdtemp(prefix="shmeval-autotune-")
    if args.net is None:
        args.net = os.path.join(tmp, "net.keras")
        if "tfnet" in args.models and not args.timeline:   # the timeline serves "device"
            proc = mp.get_context("spawn").Process(target=save_net, args=(args.net,))
            proc.start()
            proc.join()
    t_start, steal_start = time.monotonic(), machine_steal_s()
    if args.timeline:
        res = run_timeline(args)
        print("| phase | choice settled after | throughput settled after | evaluations/s | "
              "wait µs, calls in flight, crowding |\n|---|---|---|---|---|")
        for s in res["settle"]:
            wait, threads, crowding = s["final_choice"]
            print(f"| {s['phase']} | {s['choice_settled_s']:.1f} s | {s['rate_settled_s']:.1f} s | "
                  f"{s['final_rate']:,.0f} | {wait or 0:.0f}, {threads}, {crowding} |")
        out: Dict[str, Any] = {"experiment": "timeline", "machine": machine_info(), **res}
        if args.plot:
            plot_timeline(res, args.plot)
    else:
        rows: List[Dict[str, Any]] = []
        for c in args.cpus:
            cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))[:c]))
            rows_out = os.path.join(tmp, f"rows-{c}.json")
            cmd = ["taskset", "-c", cpus, sys.executable, os.path.abspath(__file__),
                   "--ncpu", str(c), "--rows-out", rows_out, "--net", args.net,
                   "--workers", ",".join(map(str, args.workers)),
                   "--models", ",".join(args.models), "--settings", ",".join(args.settings),
                   "--seconds", str(args.seconds), "--warmup", str(args.warmup),
                   "--repeats", str(args.repeats),
                   "--hand-warmup", str(args.hand_warmup)] + \
                (["--reports"] if args.reports else [])
            print(f"taskset -c {cpus}: ...", flush=True)
            subprocess.run(cmd, check=True)
            with open(rows_out) as f:
                rows += json.load(f)
        text, summary = table(rows, args.settings)
        print()
        print_grid(text, summary)
        out = {"experiment": "grid", "machine": machine_info(),
               "args": {k: v for k, v in vars(args).items() if k not in ("net", "rows_out")},
               "rows": rows, "summary": summary, "table": text}
        if args.plot:
            plot_grid(rows, args.plot)
    out["wall_s"] = time.monotonic() - t_start
    # The host's share of the CPU time, which moves every figure of a
    # virtual machine (all its CPUs, whatever the taskset).
    out["steal_share"] = (machine_steal_s() - steal_start) / (out["wall_s"] * (os.cpu_count() or 1))
    print(f"{out['wall_s']:.0f} s; the host took {out['steal_share']:.1%} of the CPU time "
          "as steal")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
