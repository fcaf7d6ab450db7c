#!/usr/bin/env python
"""Model replicas: shmeval's replicas behind one address against replicas
pulling from one multiprocessing.Queue, with a model whose cost is a fixed
part per call plus a part per row.

The model (SleepModel) sleeps --call-ms plus --row-us per row on every call:
like a GPU call it releases the GIL and costs the host no CPU, and what a
batch costs is known exactly.  Its answer is each state's cells weighted by
their index (exact in float32), so a worker can check that every answer is
its own.  Two designs serve it to W worker processes, each evaluating one
Connect Four state at a time in a loop, with 1, 2, 4 ... replicas:

  shmeval  Evaluator.spawn(factory, replicas=N): N replica processes behind
           one address; they take turns collecting, a replica taking a
           batch whenever its model is free; greedy batching and one call
           in flight per replica (max_wait_us=0, serving_threads=1), as in
           the queue design, so that the two differ in the hand-out only
           and no tuner trial runs inside a window
  queue    N consumer processes pulling from one multiprocessing.Queue (the
           scheme of lc0's multiplexing backend and KataGo's server threads
           per GPU): each waits for one request, takes whatever else is
           queued up to the batch limit (shmeval._util.queue_batches), calls
           the same model and puts each answer on the worker's own Queue

    python bench/replicas.py --json bench/results/replicas.json   # about 6 minutes
    python bench/replicas.py --row-us 20 --json bench/results/replicas-row20us.json
    python bench/replicas.py --row-us 20 --max-batch 8 --workers 64 \\
        --json bench/results/replicas-capped.json              # every model kept busy
    python bench/replicas.py --quick                              # seconds: what the test runs

For each worker count the workers, one evaluator per replica count and the
consumers of every replica count start once; then --repeats rounds each
measure a window of --seconds of every replica count and design in turn, so
that the machine's drift touches every cell alike.  Every worker checks its
answers from every evaluator before the first window.

Per cell (medians of the windows): evaluations/s, as a multiple of the same
design with one replica; p50 and p99 latency; the mean batch per replica
(requests per model call over all the cell's windows, with the range over
the replicas) and the rows of those calls at their 10th, 50th and 90th
percentile; each replica's
model busy share (its time inside the model over the window, counted as
each call ends, so off by up to one call; the smallest and largest
replica); the busy cores of the machine, and the part of them that belongs
to none of the cell's processes (other load).  A cell is model-bound when
every replica's model was busy at least 90% of the window.

How far replicas can scale here.  W workers keep W requests in flight, so N
replicas that are never idle hold about W/N rows per call and serve about
W / (c + r W/N) evaluations/s, c the model's cost per call and r per row.
As a multiple of one replica that is (c + r W) / (c + r W/N), the "even
split" column: a target of 0.9 x N is within reach only where
r W >= (9N - 10) c, that is where the rows, not the calls, make the model's
cost.  The default (2 ms per call, 2 ms per row) puts 16 and 64 workers
there for 2 replicas, and 64 workers for 4.  With a small cost per row
(--row-us 20) the cost per call dominates: more replicas mostly split the
same W requests into smaller batches, and what tells the designs apart is
how small the batches get and what the hand-out costs in CPU.  On a 2-core
machine the workers' and the Queue's CPU can bound a cell before the model
does: the busy cores and the model busy shares say which.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Optional, Sequence

import numpy as np

# What the throughput benchmarks share: the states, the window's timing, the
# process helpers and the table.
from tf_throughput import (START_DELAY_NS, STATE_SHAPE, Window, _await, _int_list, _join,
                           _on_sigterm, _print_table, _stat, random_states)

import shmeval
from shmeval._util.children import child_setup, start_process
from shmeval._util.jsonout import write_json
from shmeval._util.machine import machine_info
from shmeval._util.procstat import cpu_s, machine_busy_s
from shmeval._util.queue_batches import queued_batches
from shmeval.bench.roundtrip import weighted_quantiles

DESIGNS = ("shmeval", "queue")
# Above any worker count run here: a batch is never cut by the limit.
MAX_BATCH = 256
POOL_SIZE = 256
# Answers every worker checks per design and replica count before it reports ready.
N_CHECKS = 8
# A cell is model-bound when every replica's model was busy this share of the window.
MODEL_BOUND_SHARE = 0.9
# The target: N replicas serve at least this times N one replica's evaluations/s.
TARGET_PER_REPLICA = 0.9
# Spawning 64 workers, each importing NumPy and shmeval, on a loaded 2-core machine.
READY_TIMEOUT_S = 300.0
JOIN_TIMEOUT_S = 10.0
PR_SET_TIMERSLACK = 29
CELL_WEIGHTS = np.arange(int(np.prod(STATE_SHAPE)), dtype=np.float32)


# --- the model ------------------------------------------------------------------------

class SleepModel:
    """Sleeps ``call_s`` plus ``row_s`` per row, then answers each state's
    cells weighted by their index: a model with a known cost per call and
    per row that releases the GIL and uses no CPU meanwhile."""

    def __init__(self, call_s: float, row_s: float) -> None:
        self.call_s = call_s
        self.row_s = row_s
        # Sleeps overshoot by the thread's timer slack (50 us by default);
        # shmeval's serving thread sets 1 us, so the queue's consumers must
        # too for both designs to run the same model.
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)

    def __call__(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        rows = len(batch)
        time.sleep(self.call_s + self.row_s * rows)
        return {"value": batch.reshape(rows, -1) @ CELL_WEIGHTS}


def expected_value(state: np.ndarray) -> float:
    return float(state.reshape(-1) @ CELL_WEIGHTS)


OUTPUTS = {"value": ((), "float32")}


# --- the worker ------------------------------------------------------------------------
#
# A step evaluates one state and returns its value: the timed operation.

Step = Callable[[np.ndarray], float]


def shmeval_step(client: Any) -> Step:
    evaluate = client.evaluate

    def step(state: np.ndarray) -> float:
        return float(evaluate(state)["value"])

    return step


def queue_step(requests: Any, response: Any, worker_id: int) -> Step:
    put, get = requests.put, response.get

    def step(state: np.ndarray) -> float:
        put((worker_id, state.tobytes()))
        return float(np.frombuffer(get(), dtype=np.float32)[0])

    return step


def worker_main(worker_id: int, addresses: dict[int, str], requests: dict[int, Any],
                response: Any, n_warmup: int, conn: Connection) -> None:
    """Connects to every evaluator, checks its answers from each design and
    replica count, warms up, reports ready, then runs one measured window
    per ("run", design, replicas, start_ns, end_ns, n_samples) message until
    ("stop",) or the pipe closes."""
    child_setup()
    clients = []
    try:
        pool = random_states(np.random.default_rng(1000 + worker_id), POOL_SIZE)
        steps: dict[tuple[str, int], Step] = {}
        for replicas, address in addresses.items():
            clients.append(shmeval.connect(address))
            steps["shmeval", replicas] = shmeval_step(clients[-1])
            steps["queue", replicas] = queue_step(requests[replicas], response, worker_id)
        for (design, replicas), step in steps.items():
            for state in pool[:N_CHECKS]:
                got, want = step(state), expected_value(state)
                if got != want:
                    raise RuntimeError(f"{design} with {replicas} replicas answered {got} "
                                       f"for a state whose value is {want}")
            for i in range(n_warmup):
                step(pool[i % POOL_SIZE])
        conn.send(("ready", os.getpid()))
        window = Window()
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg[0] != "run":
                break
            _, design, replicas, start_ns, end_ns, n_samples = msg
            step = steps[design, replicas]

            def one(i: int, step: Callable[[np.ndarray], Any] = step) -> int:
                step(pool[i % POOL_SIZE])
                return 1

            count, _, recorded = window.run(one, start_ns, end_ns, n_samples)
            conn.send(("done", count, recorded))
    except Exception:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        for client in clients:
            client.close()


# --- the queue design's consumers --------------------------------------------------------

# Per consumer, in a shared array of doubles: requests, batches, seconds in the model.
COUNTERS = 3

# What a design has counted so far: (requests, batches, model seconds) per
# replica, and the model calls by rows (index: rows per call).
Counts = tuple[list[tuple[float, float, float]], np.ndarray]


def consumer_main(index: int, requests: Any, responses: list[Any], call_s: float, row_s: float,
                  counters: Any, calls: Any, conn: Connection, max_batch: int = MAX_BATCH) -> None:
    """One replica of the queue design: batches of what is queued, one model
    call each, every answer put on its worker's Queue."""
    child_setup()
    model = SleepModel(call_s, row_s)
    conn.send(("ready", os.getpid()))
    conn.close()
    base = COUNTERS * index
    calls_base = (MAX_BATCH + 1) * index  # each consumer its own row: no lost increments
    for items in queued_batches(requests, max_batch):
        batch = np.frombuffer(b"".join(s for _, s in items), dtype=np.float32)
        t0 = time.perf_counter_ns()
        values = model(batch.reshape((len(items), *STATE_SHAPE)))["value"]
        counters[base + 2] += (time.perf_counter_ns() - t0) / 1e9
        for (worker_id, _), value in zip(items, values):
            responses[worker_id].put(value.tobytes())
        counters[base] += len(items)
        counters[base + 1] += 1
        calls[calls_base + len(items)] += 1


class QueueReplicas:
    """N consumers of one request Queue; the workers' answer Queues are
    shared by every replica count."""

    def __init__(self, ctx: Any, replicas: int, responses: list[Any], call_s: float,
                 row_s: float, max_batch: int = MAX_BATCH) -> None:
        self.requests = ctx.Queue()
        self.counters = ctx.Array("d", COUNTERS * replicas, lock=False)
        self.calls = ctx.Array("q", (MAX_BATCH + 1) * replicas, lock=False)
        self.procs: list[BaseProcess] = []
        conns = []
        for r in range(replicas):
            parent_end, child_end = ctx.Pipe()
            self.procs.append(start_process(
                ctx, consumer_main, f"bench-queue-{replicas}-{r}",
                (r, self.requests, responses, call_s, row_s, self.counters, self.calls,
                 child_end, max_batch)))
            child_end.close()
            conns.append(parent_end)
        self.pids: list[int] = []
        try:
            for r, (proc, conn) in enumerate(zip(self.procs, conns)):
                self.pids.append(_await(conn, proc, READY_TIMEOUT_S,
                                        f"queue consumer {r} of {replicas}")[1])
        except BaseException:
            _join(self.procs, 0.0)  # terminates them: nobody else knows of them yet
            raise
        finally:
            for conn in conns:
                conn.close()

    def counts(self) -> Counts:
        c = self.counters
        calls = np.ctypeslib.as_array(self.calls).reshape(-1, MAX_BATCH + 1).sum(axis=0)
        return [(c[i], c[i + 1], c[i + 2]) for i in range(0, len(c), COUNTERS)], calls

    def stop(self) -> list[str]:
        for _ in self.procs:
            with contextlib.suppress(Exception):
                self.requests.put(None)
        stuck = _join(self.procs, JOIN_TIMEOUT_S)
        self.requests.cancel_join_thread()  # nothing we sent may keep this process from exiting
        self.requests.close()
        return stuck


def shmeval_counts(ev: Any) -> Counts:
    st = ev.stats()
    calls = np.zeros(MAX_BATCH + 1, dtype=np.int64)
    for rows, n in st["batch_hist"].items():
        calls[rows] = n
    return [(r["requests"], r["batches"], r["model_time_share"] * st["uptime_s"])
            for r in st["replicas"]], calls


def rows_per_call(calls: np.ndarray, q: float) -> int:
    """The rows of the model call at quantile ``q`` of the calls."""
    return int(np.searchsorted(np.cumsum(calls), q * calls.sum()))


# --- one worker count --------------------------------------------------------------------

class WorkerCount:
    """W workers, one shmeval evaluator per replica count and the queue
    design's consumers for every replica count, all started once."""

    def __init__(self, n_workers: int, args: argparse.Namespace) -> None:
        self.n_workers = n_workers
        self.args = args
        self.ctx = mp.get_context("spawn")
        self.evaluators: dict[int, Any] = {}
        self.queues: dict[int, QueueReplicas] = {}
        self.responses: list[Any] = []
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self.pids: list[int] = []

    def start(self) -> None:
        args = self.args
        call_s, row_s = args.call_ms / 1e3, args.row_us / 1e6
        for n in args.replicas:
            self.evaluators[n] = shmeval.Evaluator.spawn(
                functools.partial(SleepModel, call_s, row_s), input_shape=STATE_SHAPE,
                outputs=OUTPUTS, max_batch=args.max_batch, max_clients=max(64, self.n_workers),
                max_wait_us=0.0, serving_threads=1, replicas=n)
        self.responses = [self.ctx.Queue() for _ in range(self.n_workers)]
        for n in args.replicas:
            self.queues[n] = QueueReplicas(self.ctx, n, self.responses, call_s, row_s,
                                           args.max_batch)
        addresses = {n: ev.address for n, ev in self.evaluators.items()}
        requests = {n: q.requests for n, q in self.queues.items()}
        for i in range(self.n_workers):
            parent_end, child_end = self.ctx.Pipe()
            self.procs.append(start_process(
                self.ctx, worker_main, f"bench-replicas-worker-{i}",
                (i, addresses, requests, self.responses[i], args.warmup, child_end)))
            child_end.close()
            self.conns.append(parent_end)
        for i, (p, conn) in enumerate(zip(self.procs, self.conns)):
            msg = _await(conn, p, READY_TIMEOUT_S, f"worker {i} start-up")
            if msg[0] != "ready":
                raise RuntimeError(f"worker {i} failed to start:\n{msg[1]}")
            self.pids.append(msg[1])

    def server_pids(self, design: str, replicas: int) -> list[int]:
        if design == "shmeval":
            return list(self.evaluators[replicas].pids)
        return self.queues[replicas].pids

    def counts(self, design: str, replicas: int) -> Counts:
        if design == "shmeval":
            return shmeval_counts(self.evaluators[replicas])
        return self.queues[replicas].counts()

    def window(self, design: str, replicas: int, repeat: int) -> dict[str, Any]:
        args = self.args
        start_ns = time.perf_counter_ns() + START_DELAY_NS
        end_ns = start_ns + int(args.seconds * 1e9)
        for conn in self.conns:
            conn.send(("run", design, replicas, start_ns, end_ns, args.samples))
        servers = self.server_pids(design, replicas)
        time.sleep(max(0.0, (start_ns - time.perf_counter_ns()) / 1e9))
        busy0, (before, calls0) = machine_busy_s(), self.counts(design, replicas)
        cpu0 = [cpu_s(p) for p in self.pids], [cpu_s(p) for p in servers]
        time.sleep(max(0.0, (end_ns - time.perf_counter_ns()) / 1e9))
        busy1, (after, calls1) = machine_busy_s(), self.counts(design, replicas)
        cpu1 = [cpu_s(p) for p in self.pids], [cpu_s(p) for p in servers]

        label = f"{design} x{replicas}, {self.n_workers} workers"
        counts, samples = [], []
        for i, (p, conn) in enumerate(zip(self.procs, self.conns)):
            msg = _await(conn, p, args.seconds + 120.0, f"{label}: worker {i}")
            if msg[0] != "done":
                raise RuntimeError(f"{label}: worker {i} failed:\n{msg[1]}")
            counts.append(msg[1])
            samples.append(msg[2])
        total = sum(counts)
        if total == 0:
            raise RuntimeError(f"{label}: nothing completed in the window")
        p50, p99 = weighted_quantiles(samples, counts, [0.5, 0.99]) / 1e6
        requests = [y[0] - x[0] for x, y in zip(before, after)]
        batches = [y[1] - x[1] for x, y in zip(before, after)]
        busy_share = [(y[2] - x[2]) / args.seconds for x, y in zip(before, after)]
        cpu_workers = sum(y - x for x, y in zip(cpu0[0], cpu1[0]))
        cpu_servers = sum(y - x for x, y in zip(cpu0[1], cpu1[1]))
        calls = calls1 - calls0
        return {
            "design": design, "replicas": replicas, "workers": self.n_workers, "repeat": repeat,
            "seconds": args.seconds, "evaluations": total, "throughput": total / args.seconds,
            "p50_ms": float(p50), "p99_ms": float(p99), "worker_counts": counts,
            "replica_requests": requests, "replica_batches": batches,
            "replica_mean_batch": [r / b if b else None for r, b in zip(requests, batches)],
            "mean_batch": sum(requests) / sum(batches) if sum(batches) else None,
            "model_busy_share": busy_share,
            "rows_per_call": {f"p{q:g}": rows_per_call(calls, q / 100) for q in (10, 50, 90)},
            "calls_by_rows": {int(rows): int(calls[rows]) for rows in np.flatnonzero(calls)},
            "busy_cores": (busy1 - busy0) / args.seconds,
            "cpu_cores_workers": cpu_workers / args.seconds,
            "cpu_cores_servers": cpu_servers / args.seconds,
            # What the cores spent beyond the workers and this cell's replicas
            # (this process, the idle replicas, other programs): other load
            # skews every figure.
            "other_load_cores": (busy1 - busy0 - cpu_workers - cpu_servers) / args.seconds,
        }

    def stop(self, abort: bool = False) -> list[str]:
        """Stops the workers (politely unless aborting), the consumers, then
        the evaluators; returns the names of processes that had to be
        terminated."""
        stuck: list[str] = []
        try:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    if abort:
                        conn.close()
                    else:
                        conn.send(("stop",))
            stuck += _join(self.procs, JOIN_TIMEOUT_S)
        finally:
            for conn in self.conns:
                conn.close()
            for q in self.queues.values():
                stuck += q.stop()
            for response in self.responses:
                response.cancel_join_thread()
                response.close()
            for ev in self.evaluators.values():
                ev.close()
        return stuck

    def record(self) -> dict[str, Any]:
        """The pid of every process this worker count started, and each
        evaluator's stats() (its settings, its batches over all windows)."""
        return {"worker_pids": self.pids,
                "shmeval_replica_pids": {n: list(ev.pids) for n, ev in self.evaluators.items()},
                "queue_consumer_pids": {n: q.pids for n, q in self.queues.items()},
                "shmeval_stats": {n: ev.stats() for n, ev in self.evaluators.items()}}


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every worker count, its cells in rounds: (trials, a record of each
    worker count), printing a line per window.  Any error stops every
    process of the worker count in progress."""
    trials: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    for n_workers in args.workers:
        run = WorkerCount(n_workers, args)
        try:
            t0 = time.monotonic()
            run.start()
            print(f"{n_workers} workers: started in {time.monotonic() - t0:.1f} s",
                  file=sys.stderr)
            for repeat in range(args.repeats):
                for replicas in args.replicas:
                    for design in DESIGNS:
                        t = run.window(design, replicas, repeat)
                        trials.append(t)
                        busy = t["model_busy_share"]
                        print(f"[{n_workers:>2} workers, {design:<7} x{replicas} "
                              f"{repeat + 1}/{args.repeats}] {t['throughput']:>8,.0f} evals/s  "
                              f"p50 {t['p50_ms']:6.2f} ms  p99 {t['p99_ms']:6.2f} ms  "
                              f"batch/replica {t['mean_batch']:5.1f}  rows/call "
                              f"{'-'.join(str(v) for v in t['rows_per_call'].values())}  model busy "
                              f"{min(busy):.2f}-{max(busy):.2f}  busy cores "
                              f"{t['busy_cores']:.2f}", file=sys.stderr)
        except BaseException:
            run.stop(abort=True)
            raise
        records.append({"workers": n_workers, **run.record()})
        stuck = run.stop()
        if stuck:
            print(f"warning: {n_workers} workers: had to terminate {', '.join(stuck)}",
                  file=sys.stderr)
        gc.collect()  # finalises the worker count's queues and pipes now
    return trials, records


# --- the report --------------------------------------------------------------------------

def closed_loop_best(call_s: float, row_s: float, workers: int, replicas: int,
                     max_batch: int) -> float:
    """The most evaluations/s ``workers`` clients of one request each can
    get from ``replicas`` replicas of a model costing ``call_s`` per call
    and ``row_s`` per row: every model busy all the time with an even
    split of the requests (at most ``max_batch`` rows each), nothing lost
    between calls.  With a cost per call only, W clients never get more
    than W per call's time, however many replicas serve them."""
    rows = min(workers / replicas, float(max_batch))
    return replicas * rows / (call_s + row_s * rows)


def _best(args: argparse.Namespace, workers: int, replicas: int) -> float:
    return closed_loop_best(args.call_ms / 1e3, args.row_us / 1e6, workers, replicas,
                            args.max_batch)


def even_split_multiple(args: argparse.Namespace, workers: int, replicas: int) -> float:
    """The multiple of one replica's evaluations/s that ``replicas`` replicas
    reach at best (closed_loop_best of each)."""
    return _best(args, workers, replicas) / _best(args, workers, 1)


def summarise(trials: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Medians [min, max] over the windows of each cell (batches and rows
    per call: over all its windows' calls), with the multiple of the same
    design's one replica and whether the cell is model-bound."""
    groups: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for t in trials:
        groups.setdefault((t["workers"], t["replicas"], t["design"]), []).append(t)
    rows = []
    for (workers, replicas, design), ts in groups.items():
        busy = [statistics.median(t["model_busy_share"][r] for t in ts) for r in range(replicas)]
        requests = np.sum([t["replica_requests"] for t in ts], axis=0)
        batches = np.sum([t["replica_batches"] for t in ts], axis=0)
        calls = np.zeros(MAX_BATCH + 1, dtype=np.int64)
        for t in ts:
            for n_rows, n_calls in t["calls_by_rows"].items():
                calls[n_rows] += n_calls
        rows.append({
            "workers": workers, "replicas": replicas, "design": design, "repeats": len(ts),
            **{key: _stat([t[key] for t in ts])
               for key in ("throughput", "p50_ms", "p99_ms", "busy_cores",
                           "cpu_cores_workers", "cpu_cores_servers", "other_load_cores")},
            "mean_batch": requests.sum() / max(1, batches.sum()),
            "replica_mean_batch": (requests / np.maximum(1, batches)).tolist(),
            "model_busy_share": busy,
            "rows_per_call": {f"p{q:g}": rows_per_call(calls, q / 100) for q in (10, 50, 90)},
            "model_bound": min(busy) >= MODEL_BOUND_SHARE,
            "even_split_multiple": even_split_multiple(args, workers, replicas),
            "closed_loop_best": _best(args, workers, replicas),
        })
    for row in rows:
        one = groups.get((row["workers"], 1, row["design"]))
        row["multiple_of_one"] = (row["throughput"]["median"]
                                  / statistics.median(t["throughput"] for t in one)
                                  if one else None)
    return rows


def targets(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's target for every shmeval cell with more than one replica:
    at least 0.9 x N of one replica, where both cells are model-bound."""
    by = {(r["workers"], r["replicas"], r["design"]): r for r in summary}
    out = []
    for row in summary:
        one = by.get((row["workers"], 1, row["design"]))
        if row["design"] != "shmeval" or row["replicas"] == 1 or one is None:
            continue
        goal = TARGET_PER_REPLICA * row["replicas"]
        out.append({"workers": row["workers"], "replicas": row["replicas"],
                    "multiple": row["multiple_of_one"], "target": goal,
                    "met": row["multiple_of_one"] >= goal,
                    "model_bound": row["model_bound"] and one["model_bound"],
                    "even_split_multiple": row["even_split_multiple"],
                    "reachable": row["even_split_multiple"] >= goal})
    return out


def print_report(summary: list[dict[str, Any]], checked: list[dict[str, Any]],
                 args: argparse.Namespace) -> None:
    print(f"\nmedians of {args.repeats} window(s) of {args.seconds:g} s (batches: over all "
          f"their calls); model: "
          f"{args.call_ms:g} ms per call + {args.row_us:g} us per row; model-bound: every "
          f"replica's model busy >= {MODEL_BOUND_SHARE:.0%} of the window")
    for workers in args.workers:
        rows = sorted((r for r in summary if r["workers"] == workers),
                      key=lambda r: (r["replicas"], DESIGNS.index(r["design"])))
        print(f"\n{workers} workers")
        _print_table(
            ["replicas", "design", "evals/s", "best", "of best", "x 1 replica", "even split",
             "p50 ms", "p99 ms",
             "batch/replica", "rows/call p10-p50-p90", "model busy", "model-bound",
             "busy cores", "other load"],
            [[str(r["replicas"]), r["design"], f"{r['throughput']['median']:,.0f}",
              f"{r['closed_loop_best']:,.0f}",
              f"{r['throughput']['median'] / r['closed_loop_best']:.2f}",
              f"{r['multiple_of_one']:.2f}x", f"{r['even_split_multiple']:.2f}x",
              f"{r['p50_ms']['median']:.2f}", f"{r['p99_ms']['median']:.2f}",
              _range(r["mean_batch"], r["replica_mean_batch"], ".1f"),
              "-".join(f"{v:g}" for v in r["rows_per_call"].values()),
              _range(None, r["model_busy_share"], ".2f"),
              "yes" if r["model_bound"] else "no", f"{r['busy_cores']['median']:.2f}",
              f"{r['other_load_cores']['median']:.2f}"]
             for r in rows])
    if checked:
        print(f"\ntarget: shmeval with N replicas >= {TARGET_PER_REPLICA:g} x N of one replica "
              f"while the model is the bottleneck (reported, not enforced)")
    for c in checked:
        print(f"  {c['workers']} workers, {c['replicas']} replicas: {c['multiple']:.2f}x "
              f"(target {c['target']:.2f}x: {'met' if c['met'] else 'NOT met'}; "
              f"{'model-bound' if c['model_bound'] else 'not model-bound'}; even split "
              f"{c['even_split_multiple']:.2f}x"
              f"{'' if c['reachable'] else ', below the target'})")


def _range(overall: Optional[float], per_replica: Sequence[float], spec: str) -> str:
    """``overall [least-most]`` over the replicas (or just the range)."""
    lo, hi = format(min(per_replica), spec), format(max(per_replica), spec)
    spread = lo if lo == hi else f"{lo}-{hi}"
    if overall is None:
        return spread
    text = format(overall, spec)
    return text if lo == hi else f"{text} [{spread}]"


# --- the command line ---------------------------------------------------------------------

def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--workers", type=_int_list, default=[16, 64],
                        help="worker counts (default 16,64)")
    parser.add_argument("--replicas", type=_int_list, default=[1, 2, 4],
                        help="replica counts; 1 is added if missing, the base of the "
                             "multiples (default 1,2,4)")
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="measured window (default 5)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of windows, every cell once per round (default 3)")
    parser.add_argument("--call-ms", type=float, default=2.0,
                        help="the model's sleep per call, ms (default 2)")
    parser.add_argument("--row-us", type=float, default=2000.0,
                        help="the model's sleep per row, us (default 2000)")
    parser.add_argument("--max-batch", type=int, default=MAX_BATCH,
                        help="rows per model call at most, both designs (default 256): below "
                             "W/N it keeps every replica's model busy, the regime where N "
                             "replicas can serve N times one")
    parser.add_argument("--warmup", type=int, default=20,
                        help="untimed evaluations per worker, design and replica count "
                             "before ready (default 20)")
    parser.add_argument("--samples", type=int, default=20000,
                        help="latencies each worker reports per window (default 20000)")
    parser.add_argument("--json", metavar="PATH",
                        help="write the machine, the settings, every window and the summary "
                             "here")
    parser.add_argument("--quick", action="store_true",
                        help="4 workers, 1 and 2 replicas, one 0.5 s window each: seconds")
    args = parser.parse_args(argv)
    if args.quick:
        args.workers, args.replicas, args.seconds, args.repeats, args.warmup = [4], [1, 2], 0.5, 1, 5
    if args.seconds <= 0 or min(args.repeats, args.warmup, args.samples) < 1:
        parser.error("--seconds, --repeats, --warmup and --samples must be positive")
    if args.call_ms < 0 or args.row_us < 0:
        parser.error("--call-ms and --row-us must not be negative")
    if not 1 <= args.max_batch <= MAX_BATCH:
        parser.error(f"--max-batch must be 1 to {MAX_BATCH}")
    args.replicas = sorted({1, *args.replicas})
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    machine = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))
    print(f"model: {args.call_ms:g} ms per call + {args.row_us:g} us per row (sleeping); "
          f"workers {','.join(map(str, args.workers))}; replicas "
          f"{','.join(map(str, args.replicas))}; {args.repeats} x {args.seconds:g} s windows")
    began = time.monotonic()
    try:
        trials, records = measure(args)
    except KeyboardInterrupt:
        return 130
    elapsed = time.monotonic() - began
    summary = summarise(trials, args)
    checked = targets(summary)
    print_report(summary, checked, args)
    print(f"\nwall time {elapsed:.0f} s")
    if args.json:
        settings = {**vars(args), "shmeval_max_wait_us": 0.0,
                    "shmeval_serving_threads": 1,
                    "model_bound_share": MODEL_BOUND_SHARE,
                    "target_per_replica": TARGET_PER_REPLICA}
        write_json(args.json, {"machine": machine, "settings": settings, "trials": trials,
                               "summary": summary, "targets": checked, "runs": records,
                               "wall_s": elapsed})
        print(f"raw results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
