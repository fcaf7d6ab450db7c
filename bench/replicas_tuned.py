#!/usr/bin/env python
"""Model replicas at their defaults: N replicas behind one address with the
tuner deciding (nothing but the model, the shapes, ``max_batch`` and
``replicas`` set), each run a fresh evaluator, so that every run shows what
the tuner decides from nothing and how soon.

bench/replicas.py compares the hand-out of shmeval's replicas with a Queue's
under fixed greedy settings; this script asks what the defaults make of
the same replicas.  With several replicas one tuner decides for them all:
replica 0 (the leader) runs the trials, the others apply its decision
(shmeval.tuning.ServingTuner).  Per cell (a model, W workers, N replicas)
and run, it records:

  evals/s     over the window from --after seconds of load to the end
              (--seconds), and the rate of every second of load
  verdict     the leader's settings at the end: "greedy" or "wait <us> cap
              <rows>", with the serving threads where more than one; the
              runs of a cell agree when the verdicts match in wait-or-greedy
              and serving threads (the wait's length follows the fitted cost
              per call and differs by a few µs from run to run).  A leader
              still in its trials at the end has none (shown with its
              phase).  Agreement is the count of the most common verdict out
              of the runs; the issue's target is 4 of 5
  settled     when the leader's trials settled, in seconds of load (the
              report says how long before it was written that they did; it
              is rewritten every 200 ms, so the moment is late by up to
              that); none when the leader is not settled at the end
  rows/call   each replica's requests per model call over the same window
              as evals/s, against the even split W/N (at most --max-batch)

and compares the rate with the closed loop's best: every replica always
busy with an even split of the W requests and no time between calls, N b /
(c + r b) with b = min(W/N, --max-batch) rows per call, c the model's cost
per call and r per row.  "of best" is the rate over that; "x 1 replica" the
median rate over the same model and worker count's with one replica.

What replicas can gain.  A closed loop of W clients has at most W requests
outstanding, and each waits at least one model call, so no number of
replicas serves more than W / c.  One replica that waits for all W requests
(the tuner's wait) and calls the model on them serves W / (c + r W); N
replicas with W/N each at best W / (c + r W/N).  Where the cost is per call
(r W small against c) one replica that waits already serves close to W / c,
and a second replica cannot double the rate: it can only split the same W
requests into smaller batches that cost the same per call.  Where the cost
is per row (r W large against c), the replicas share the rows and N of them
approach N times one.  The three models put the defaults on both sides:

  call   --call-ms 4, no cost per row: a GPU-like call, where replicas
         cannot gain
  mixed  2 ms per call + 100 µs per row
  row    2 ms per call + 2000 µs per row (bench/replicas.py's default):
         replicas gain nearly N times

The model is bench/replicas.py's SleepModel: it sleeps the cost and answers
each state's cells weighted by their index, and every worker checks every
answer against the value its state must have.  W worker processes (spawn)
start once per worker count and serve every model, replica count and run in
turn: each run they attach to the fresh evaluator (one evaluation each),
report ready, and wait on one start event, so that the load starts at once
and the tuner sees none before it (its idle windows count as paused).  Then
each loops on evaluate, one state at a time, until told to stop; the parent
reads the completions every 0.25 s.  The runs go in rounds over the replica
counts, so that the machine's drift touches every cell alike.

    python bench/replicas_tuned.py --json bench/results/replicas-tuned.json
        # 3 models x 6 cells x 5 runs of about 17 s: about 25 minutes
    python bench/replicas_tuned.py --models call --runs 3 \\
        --json bench/results/replicas-tuned-call.json        # about 5 minutes
    python bench/replicas_tuned.py --models row=2/500,call=8/0  # a model of one's own
    python bench/replicas_tuned.py --quick                     # seconds: what the test runs

On a 2-core machine 64 workers keep the CPUs busy by themselves: the
workers' CPU, not the model, can then bound a cell, and the load average
each run records says how much else ran.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from replicas import (CELL_WEIGHTS, JOIN_TIMEOUT_S, OUTPUTS, POOL_SIZE, READY_TIMEOUT_S,
                      SleepModel, closed_loop_best)
from tf_throughput import STATE_SHAPE, _await, _int_list, _join, _on_sigterm, _print_table, \
    _stat, random_states

import shmeval
from shmeval._util.children import child_setup, start_process
from shmeval._util.jsonout import write_json
from shmeval._util.machine import machine_info
from shmeval.segment import SHM_DIR

MAX_BATCH = 256
#: The parent reads the completions this often.
SAMPLE_S = 0.25
#: Between the attach and the load: longer than the evaluator's idle timeout
#: (0.1 s) plus a housekeeping period (0.2 s).
QUIET_S = 0.5
#: The issue's targets: the trials settle within this many seconds of load,
#: and this share of the runs of a cell (4 of 5) reach the same verdict.
SETTLE_TARGET_S = 5.0
AGREEMENT_TARGET = 0.8
#: Rows per call within this share of the even split count as even.
EVEN_TOLERANCE = 0.2
#: Each worker's counter in a line of its own (8 int64 = 64 bytes): 64
#: workers adding to neighbouring words would pass cache lines around.
STRIDE = 8


class Model(NamedTuple):
    name: str
    call_ms: float
    row_us: float

    def describe(self) -> str:
        return f"{self.name} ({self.call_ms:g} ms/call + {self.row_us:g} us/row)"


PRESETS = {"call": Model("call", 4.0, 0.0), "mixed": Model("mixed", 2.0, 100.0),
           "row": Model("row", 2.0, 2000.0)}


# --- the worker ---------------------------------------------------------------------------

def worker_main(index: int, counts: Any, stop: Any, start: Any, conn: Connection) -> None:
    """Per ("run", address) message: attaches (one checked evaluation),
    reports ready, waits for ``start``, then evaluates one state at a time,
    checking every answer and adding one to its counter per answer, until
    ``stop`` is set; closes the client and reports ("done", answers).
    Ends on ("stop",) or when the pipe closes."""
    child_setup()
    pool = random_states(np.random.default_rng(1000 + index), POOL_SIZE)
    expected = (pool.reshape(POOL_SIZE, -1) @ CELL_WEIGHTS).tolist()
    slot = index * STRIDE
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg[0] != "run":
                return
            client = shmeval.connect(msg[1])
            try:
                evaluate = client.evaluate
                answers = 0

                def check(i: int) -> None:
                    got = float(evaluate(pool[i % POOL_SIZE])["value"])
                    if got != expected[i % POOL_SIZE]:
                        raise RuntimeError(f"worker {index}: answer {got} for a state whose "
                                           f"value is {expected[i % POOL_SIZE]}")

                check(index)
                conn.send(("ready", os.getpid()))
                start.wait()
                i = index + 1
                # A plain shared word, not an Event: is_set() takes the
                # Event's lock, which every worker would contend for on every
                # request.
                while not stop.value:
                    check(i)
                    i += 1
                    answers += 1
                    counts[slot] = answers
            finally:
                client.close()
            conn.send(("done", answers))
    except Exception:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))


class Workers:
    """W worker processes and what they share: the counters, the stop word,
    the start event."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.ctx = mp.get_context("spawn")
        self.counts = self.ctx.RawArray("q", n * STRIDE)
        self.view = np.ctypeslib.as_array(self.counts)
        self.stop = self.ctx.RawValue("i", 0)
        self.start = self.ctx.Event()
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self.pids: list[int] = []
        for i in range(n):
            parent_end, child_end = self.ctx.Pipe()
            self.procs.append(start_process(self.ctx, worker_main, f"bench-tuned-worker-{i}",
                                            (i, self.counts, self.stop, self.start, child_end)))
            child_end.close()
            self.conns.append(parent_end)

    def total(self) -> int:
        return int(self.view[::STRIDE].sum())

    def attach(self, address: str) -> None:
        """Every worker attached to ``address`` and waiting for the start."""
        self.view[:] = 0
        self.stop.value = 0
        self.start.clear()
        for conn in self.conns:
            conn.send(("run", address))
        pids = []
        for i, (p, conn) in enumerate(zip(self.procs, self.conns)):
            msg = _await(conn, p, READY_TIMEOUT_S, f"worker {i} attaching")
            if msg[0] != "ready":
                raise RuntimeError(f"worker {i} failed to attach:\n{msg[1]}")
            pids.append(msg[1])
        self.pids = pids

    def finish(self) -> int:
        """Stops the load; the answers of every worker."""
        self.stop.value = 1
        total = 0
        for i, (p, conn) in enumerate(zip(self.procs, self.conns)):
            msg = _await(conn, p, 60.0, f"worker {i} stopping")
            if msg[0] != "done":
                raise RuntimeError(f"worker {i} failed:\n{msg[1]}")
            total += msg[1]
        return total

    def close(self, abort: bool = False) -> list[str]:
        """Ends the workers (politely unless aborting); the names of those
        that had to be terminated."""
        try:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    if abort:
                        conn.close()
                    else:
                        conn.send(("stop",))
            return _join(self.procs, JOIN_TIMEOUT_S)
        finally:
            for conn in self.conns:
                conn.close()


# --- one run ------------------------------------------------------------------------------

def verdict(report: dict[str, Any]) -> tuple[str, str]:
    """(what the leader decided, as shown; the part the runs must agree on:
    waiting or greedy, and the serving threads).  A leader still in its
    trials (or measuring) has no verdict: what it applies then is a trial's
    turn, and its key is "unsettled"."""
    threads = report["serving_threads"]
    more = f" threads {threads}" if threads > 1 else ""
    if report["max_wait_us"] > 0:
        shown, key = f"wait {report['max_wait_us']:.0f}us cap {report['batch_cap']}{more}", \
            f"wait{more}"
    else:
        shown, key = f"greedy{more}", f"greedy{more}"
    if report["phase"] != "settled":
        return f"{shown} ({report['phase']})", "unsettled"
    return shown, key


def verdicts_shown(runs: list[dict[str, Any]]) -> str:
    """The runs' verdicts, alike ones together: "wait cap 16 [4010-4032us]
    x3; greedy x2"."""
    groups: dict[str, list[float]] = {}
    for r in runs:
        t = r["tuner"]
        label = r["verdict_key"] if r["verdict_key"] == "unsettled" or t["max_wait_us"] == 0 \
            else r["verdict_key"].replace("wait", f"wait cap {t['batch_cap']}", 1)
        groups.setdefault(label, []).append(t["max_wait_us"])
    parts = []
    for label, waits in sorted(groups.items(), key=lambda g: -len(g[1])):
        if label.startswith("wait"):
            lo, hi = f"{min(waits):.0f}", f"{max(waits):.0f}"
            label += f" [{lo if lo == hi else lo + '-' + hi}us]"
        parts.append(f"{label} x{len(waits)}")
    return "; ".join(parts)


def since_load(report: dict[str, Any], key: str, read_s: float) -> Optional[float]:
    """The moment ``read_s - report[key]`` (a "seconds ago" field), or None."""
    ago = report.get(key)
    return None if ago is None else round(read_s - ago, 2)


def one_run(workers: Workers, model: Model, replicas: int, run: int,
            args: argparse.Namespace) -> dict[str, Any]:
    """A fresh evaluator at its defaults, W workers loading it for
    --seconds: the record of the run."""
    loadavg = os.getloadavg()
    t_spawn = time.monotonic()
    ev = shmeval.Evaluator.spawn(
        functools.partial(SleepModel, model.call_ms / 1e3, model.row_us / 1e6),
        input_shape=STATE_SHAPE, outputs=OUTPUTS, max_batch=args.max_batch,
        max_clients=max(64, workers.n), replicas=replicas)
    address, replica_pids = ev.address, list(ev.pids)
    try:
        spawn_s = time.monotonic() - t_spawn
        t_attach = time.monotonic()
        workers.attach(address)
        attach_s = time.monotonic() - t_attach
        # Quiet before the load: the tuner's window of the attach calls
        # ends, and the next one waits an idle timeout and counts as paused,
        # so that its first trial reads the load, not the attach.
        time.sleep(QUIET_S)

        n_samples = round(args.seconds / SAMPLE_S)
        after_k = min(n_samples - 1, int(np.ceil(args.after / SAMPLE_S - 1e-9)))
        times, totals = [0.0], [0]
        at_after = ev.stats() if after_k == 0 else {}
        t0 = time.monotonic()
        workers.start.set()
        for k in range(1, n_samples + 1):
            time.sleep(max(0.0, t0 + k * SAMPLE_S - time.monotonic()))
            totals.append(workers.total())
            times.append(time.monotonic() - t0)
            if k == after_k:
                at_after = ev.stats()
        st = ev.stats()
        read_s = time.monotonic() - t0
        answered = workers.finish()
    finally:
        ev.close()
    shm_clean = not os.path.exists(os.path.join(SHM_DIR, address.lstrip("/")))

    window_s = times[-1] - times[after_k]
    rate = (totals[-1] - totals[after_k]) / window_s
    per_second = _per_second(times, totals)
    leader = st["tuner"]
    shown, key = verdict(leader)
    even = min(workers.n / replicas, float(args.max_batch))
    rows = []
    for before, after in zip(at_after["replicas"], st["replicas"]):
        batches = after["batches"] - before["batches"]
        rows.append((after["requests"] - before["requests"]) / batches if batches else None)
    known = [r for r in rows if r is not None]
    mean_rows = statistics.mean(known) if known else None
    best = closed_loop_best(model.call_ms / 1e3, model.row_us / 1e6, workers.n, replicas,
                            args.max_batch)
    settled = leader["phase"] == "settled"
    return {
        "model": model.name, "call_ms": model.call_ms, "row_us": model.row_us,
        "workers": workers.n, "replicas": replicas, "run": run,
        "loadavg_before": list(loadavg), "spawn_s": round(spawn_s, 2),
        "attach_s": round(attach_s, 2),
        "seconds": times[-1], "after_s": times[after_k], "throughput": rate,
        "per_second": per_second, "samples": list(zip(times, totals)),
        "answered": answered, "best": best, "of_best": rate / best,
        # Little's law: W requests always in flight.
        "mean_latency_ms": 1e3 * workers.n / rate if rate else None,
        "rows_per_call": rows, "mean_rows_per_call": mean_rows, "even_split": even,
        "even": mean_rows is not None and abs(mean_rows - even) <= EVEN_TOLERANCE * even,
        "mean_batch_since_spawn": st["mean_batch"],
        "verdict": shown, "verdict_key": key,
        "settled_after_s": since_load(leader, "settled_s_ago", read_s) if settled else None,
        "changed_after_s": since_load(leader, "changed_s_ago", read_s),
        # Wait, cap and calls in flight (the spin budget is each replica's).
        "followers_agree": all(_settings(r["tuner"]) == _settings(leader)
                               for r in st["replicas"] if r.get("tuner")),
        "tuner": leader, "replica_tuners": [r.get("tuner") for r in st["replicas"]],
        "failed_requests": st["failed_requests"], "shm_clean": shm_clean,
        "worker_pids": workers.pids, "replica_pids": replica_pids,
    }


def _settings(report: dict[str, Any]) -> tuple[Any, ...]:
    wait, cap, _, threads = report["decision"]
    return wait, cap, threads


def _per_second(times: list[float], totals: list[int]) -> list[float]:
    """The rate of every whole second of load (the samples one second apart)."""
    step = round(1 / SAMPLE_S)
    return [(totals[k + step] - totals[k]) / (times[k + step] - times[k])
            for k in range(0, len(totals) - step, step)]


def run_line(r: dict[str, Any]) -> str:
    settled = "-" if r["settled_after_s"] is None else f"{r['settled_after_s']:.1f}"
    rows = "-" if r["mean_rows_per_call"] is None else f"{r['mean_rows_per_call']:.1f}"
    return (f"[{r['model']} {r['workers']:>2}w x{r['replicas']} run {r['run'] + 1}] "
            f"{r['throughput']:>8,.0f} evals/s ({r['of_best']:.0%} of best)  rows/call "
            f"{rows} (even {r['even_split']:.1f})  {r['verdict']}  settled {settled} s  "
            f"phase {r['tuner']['phase']}  load {r['loadavg_before'][0]:.1f}  "
            f"spawn {r['spawn_s']:.1f} s")


# --- the grid -----------------------------------------------------------------------------

def measure(args: argparse.Namespace, models: list[Model],
            save: Any) -> list[dict[str, Any]]:
    """Every worker count's workers once; for each model, the runs in rounds
    over the replica counts.  ``save(records)`` after every run."""
    records: list[dict[str, Any]] = []
    for n_workers in args.workers:
        t0 = time.monotonic()
        workers = Workers(n_workers)
        try:
            for model in models:
                for run in range(args.runs):
                    for replicas in args.replicas:
                        if replicas > n_workers:
                            continue
                        r = one_run(workers, model, replicas, run, args)
                        records.append(r)
                        print(run_line(r), file=sys.stderr, flush=True)
                        if not r["shm_clean"]:
                            print("warning: the segment is still in /dev/shm", file=sys.stderr)
                        save(records)
        except BaseException:
            workers.close(abort=True)
            raise
        stuck = workers.close()
        if stuck:
            print(f"warning: {n_workers} workers: had to terminate {', '.join(stuck)}",
                  file=sys.stderr)
        print(f"{n_workers} workers: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return records


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell: medians and ranges over the runs, settling, agreement."""
    cells: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in records:
        cells.setdefault((r["model"], r["workers"], r["replicas"]), []).append(r)
    medians = {cell: statistics.median(r["throughput"] for r in runs)
               for cell, runs in cells.items()}
    out = []
    for (model, workers, replicas), runs in cells.items():
        rate = medians[model, workers, replicas]
        one = medians.get((model, workers, 1))
        best = runs[0]["best"]
        rows = _stat([r["mean_rows_per_call"] for r in runs])
        even = runs[0]["even_split"]
        settled = [r["settled_after_s"] for r in runs if r["settled_after_s"] is not None]
        keys = collections.Counter(r["verdict_key"] for r in runs
                                   if r["verdict_key"] != "unsettled")
        common, agree = keys.most_common(1)[0] if keys else (None, 0)
        out.append({
            "model": model, "call_ms": runs[0]["call_ms"], "row_us": runs[0]["row_us"],
            "workers": workers, "replicas": replicas, "runs": len(runs),
            "throughput": _stat([r["throughput"] for r in runs]), "best": best,
            "of_best": rate / best, "multiple_of_one": rate / one if one else None,
            "mean_rows_per_call": rows, "even_split": even,
            "even": rows is not None and abs(rows["median"] - even) <= EVEN_TOLERANCE * even,
            "settled_after_s": _stat(settled),
            "settled_runs": len(settled),
            "settled_within_target": sum(s <= SETTLE_TARGET_S for s in settled),
            "verdicts": [r["verdict"] for r in runs], "verdicts_shown": verdicts_shown(runs),
            "verdict": common, "agreement": agree,
            "agreement_met": agree >= AGREEMENT_TARGET * len(runs),
            "followers_agree": all(r["followers_agree"] for r in runs),
            "mean_latency_ms": _stat([r["mean_latency_ms"] for r in runs]),
            "loadavg_before": _stat([r["loadavg_before"][0] for r in runs]),
        })
    return out


def print_summary(summary: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nmedians [min-max] of {args.runs} run(s), each a fresh evaluator at its "
          f"defaults; evals/s from {args.after:g} s of load to {args.seconds:g} s; best: "
          f"every replica busy with W/N rows per call (at most {args.max_batch}); even: "
          f"rows/call within {EVEN_TOLERANCE:.0%} of W/N; settled: s of load (-: not "
          f"settled at the end)")
    for model in dict.fromkeys(s["model"] for s in summary):
        rows = sorted((s for s in summary if s["model"] == model),
                      key=lambda s: (s["workers"], s["replicas"]))
        print(f"\n{model}: {rows[0]['call_ms']:g} ms per call + {rows[0]['row_us']:g} us per row")
        _print_table(
            ["W", "N", "evals/s", "best", "of best", "x 1 replica", "rows/call", "even split",
             "even", "settled s med/max", f"<= {SETTLE_TARGET_S:g} s", "verdicts",
             "agreement", "latency ms"],
            [[str(s["workers"]), str(s["replicas"]), _range(s["throughput"], ",.0f"),
              f"{s['best']:,.0f}", f"{s['of_best']:.0%}",
              "-" if s["multiple_of_one"] is None else f"{s['multiple_of_one']:.2f}x",
              _range(s["mean_rows_per_call"], ".1f"), f"{s['even_split']:.1f}",
              "yes" if s["even"] else "no",
              "-" if s["settled_after_s"] is None else
              f"{s['settled_after_s']['median']:.1f}/{s['settled_after_s']['max']:.1f}",
              f"{s['settled_within_target']}/{s['runs']}", s["verdicts_shown"],
              f"{s['agreement']}/{s['runs']}",
              "-" if s["mean_latency_ms"] is None else f"{s['mean_latency_ms']['median']:.1f}"]
             for s in rows])


def _range(stat: Optional[dict[str, float]], spec: str) -> str:
    if stat is None:
        return "-"
    text = format(stat["median"], spec)
    lo, hi = format(stat["min"], spec), format(stat["max"], spec)
    return text if lo == hi else f"{text} [{lo}-{hi}]"


# --- the command line ---------------------------------------------------------------------

def parse_models(text: str) -> list[Model]:
    """``call,mixed,row``, or ``NAME=CALL_MS/ROW_US`` for a model of one's own
    (or to change a preset's costs)."""
    models = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, _, costs = item.partition("=")
        if costs:
            try:
                call_ms, row_us = (float(v) for v in costs.split("/"))
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{item!r}: expected NAME=CALL_MS/ROW_US") from None
            if call_ms < 0 or row_us < 0:
                raise argparse.ArgumentTypeError(f"{item!r}: costs must not be negative")
            models.append(Model(name, call_ms, row_us))
        elif name in PRESETS:
            models.append(PRESETS[name])
        else:
            raise argparse.ArgumentTypeError(
                f"unknown model {name!r}: {', '.join(PRESETS)} or NAME=CALL_MS/ROW_US")
    if not models:
        raise argparse.ArgumentTypeError("no model named")
    return models


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", type=parse_models, default=None,
                        help="presets call (4 ms/call), mixed (2 ms/call + 100 us/row), row "
                             "(2 ms/call + 2000 us/row), or NAME=CALL_MS/ROW_US "
                             "(default call,mixed,row)")
    parser.add_argument("--call-ms", type=float,
                        help="the cost per call of every model run, ms (default: the model's)")
    parser.add_argument("--row-us", type=float,
                        help="the cost per row of every model run, us (default: the model's)")
    parser.add_argument("--workers", type=_int_list, default=None,
                        help="worker counts (default 16,64)")
    parser.add_argument("--replicas", type=_int_list, default=None,
                        help="replica counts; 1 is added if missing, the base of "
                             "'x 1 replica'; counts above the workers are skipped "
                             "(default 1,2,4)")
    parser.add_argument("--runs", type=int, default=None,
                        help="runs per cell, each a fresh evaluator (default 5)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="seconds of load per run (default 12)")
    parser.add_argument("--after", type=float, default=None,
                        help="evals/s counts from this many seconds of load (default 5)")
    parser.add_argument("--max-batch", type=int, default=MAX_BATCH,
                        help=f"the evaluator's max_batch (default {MAX_BATCH})")
    parser.add_argument("--json", metavar="PATH",
                        help="write the settings, the machine, every run and the summary "
                             "here (rewritten after every run)")
    parser.add_argument("--quick", action="store_true",
                        help="the call model at 1 ms, 4 workers, 1 and 2 replicas, 2 runs of "
                             "3 s: seconds")
    args = parser.parse_args(argv)
    quick = args.quick
    for name, full, short in (("models", [PRESETS["call"], PRESETS["mixed"], PRESETS["row"]],
                               [PRESETS["call"]]),
                              ("call_ms", None, 1.0), ("workers", [16, 64], [4]),
                              ("replicas", [1, 2, 4], [1, 2]), ("runs", 5, 2),
                              ("seconds", 12.0, 3.0), ("after", 5.0, 1.0)):
        if getattr(args, name) is None:
            setattr(args, name, short if quick else full)
    args.models = [m._replace(call_ms=m.call_ms if args.call_ms is None else args.call_ms,
                              row_us=m.row_us if args.row_us is None else args.row_us)
                   for m in args.models]
    if len({m.name for m in args.models}) < len(args.models):
        parser.error("two models of one name")
    if args.runs < 1 or args.max_batch < 1:
        parser.error("--runs and --max-batch must be positive")
    if min(args.call_ms or 0, args.row_us or 0) < 0:
        parser.error("--call-ms and --row-us must not be negative")
    if not 0 <= args.after < args.seconds - SAMPLE_S or args.seconds < 1:
        parser.error(f"--seconds must be at least 1 and --after from 0 to --seconds - "
                     f"{SAMPLE_S:g}")
    args.replicas = sorted({1, *args.replicas})
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    machine = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))
    print(f"models: {'; '.join(m.describe() for m in args.models)}; workers "
          f"{','.join(map(str, args.workers))}; replicas {','.join(map(str, args.replicas))}; "
          f"{args.runs} run(s) of {args.seconds:g} s, evals/s from {args.after:g} s")
    settings = {**vars(args), "models": [m._asdict() for m in args.models],
                "sample_s": SAMPLE_S, "settle_target_s": SETTLE_TARGET_S,
                "agreement_target": AGREEMENT_TARGET, "even_tolerance": EVEN_TOLERANCE}
    began = time.monotonic()

    def save(records: list[dict[str, Any]], final: bool = False) -> None:
        if args.json:
            write_json(args.json, {"machine": machine, "settings": settings,
                                   "complete": final, "runs": records,
                                   "summary": summarise(records),
                                   "wall_s": time.monotonic() - began})

    try:
        records = measure(args, args.models, save)
    except KeyboardInterrupt:
        return 130
    summary = summarise(records)
    print_summary(summary, args)
    machine["loadavg_after"] = list(os.getloadavg())
    print(f"\nwall time {time.monotonic() - began:.0f} s; load average at the end "
          f"{machine['loadavg_after'][0]:.1f}")
    if args.json:
        save(records, final=True)
        print(f"raw results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
