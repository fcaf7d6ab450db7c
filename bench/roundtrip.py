#!/usr/bin/env python
"""Round-trip benchmark: shmeval against multiprocessing.Queue and multiprocessing.Pipe.

Many worker processes each send one small state at a time to a single evaluator
and wait for the reply (the pattern of self-play workers evaluating MCTS
leaves).  Every method serves the same null model from one server, so the
figures are the cost of the transport and the batching, nothing else.

    python bench/roundtrip.py --workers 1,4,16 --seconds 3 --repeats 3 \\
        --methods queue,pipe,shmeval --json results.json

Methods:
  queue       one shared request multiprocessing.Queue, one response Queue per worker
  pipe        one duplex multiprocessing.Pipe per worker, raw bytes, connection.wait
  shmeval     shmeval.Evaluator.spawn: the evaluator in its own process
  shm_thread  shmeval.Evaluator: the evaluator in a thread of this (the parent) process

A method is a class with start() -> one client per worker (picklable, with
evaluate(state) -> dict of arrays) and stop() -> server counters; see METHODS.

Each trial starts a fresh server and fresh worker processes (context "spawn").
Workers warm up, wait on a barrier, then all run over one shared time window
and record each round trip's latency; results are pickled only after the
window.  Within each repetition the methods alternate, so slow drifts in the
machine (thermal, other load) hit them alike.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.metadata
import importlib.util
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Mapping, Protocol, Sequence, TypeAlias, cast

import numpy as np

# Latencies a worker can record in one window.  8 MiB of int64 per worker, but
# np.empty only commits the pages actually written.
LATENCY_CAP = 1 << 20
# Headroom between the start signal and the window, so that every worker is
# past go.wait() before it opens even when 16 of them share 2 cores.
START_DELAY_NS = 100_000_000
# Spawning 16 interpreters that import numpy on 2 cores takes seconds, not minutes.
SETUP_TIMEOUT_S = 120.0
JOIN_TIMEOUT_S = 10.0
SHM_METHODS = ("shmeval", "shm_thread")
BASELINES = ("queue", "pipe")
QUANTILES = {"p1": 0.01, "p10": 0.10, "p50": 0.50, "p90": 0.90, "p99": 0.99, "p99.9": 0.999, "max": 1.0}


@dataclass(frozen=True)
class StateSpec:
    name: str
    shape: tuple[int, ...]
    policy_size: int

    @property
    def nbytes(self) -> int:
        return 4 * math.prod(self.shape)  # float32


STATES = {
    "c4": StateSpec("c4", (6, 7, 2), 7),  # Connect Four: 336 bytes
    "go": StateSpec("go", (19, 19, 17), 19 * 19 + 1),  # AlphaGo Zero input: 24,548 bytes
}


class NullModel:
    """The model every method serves: no compute, but it reads the input.

    A class rather than a closure so that functools.partial(NullModel, n) is the
    picklable zero-argument factory Evaluator.spawn needs.
    """

    def __init__(self, policy_size: int) -> None:
        self.policy_size = policy_size

    def __call__(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        n = len(batch)
        return {
            "policy": np.zeros((n, self.policy_size), dtype=np.float32),
            "value": batch.reshape(n, -1)[:, 0],
        }


class Client(Protocol):
    def evaluate(self, state: np.ndarray) -> Mapping[str, Any]: ...


class Method(Protocol):
    def start(self, ctx: SpawnContext, n_workers: int, spec: StateSpec, max_batch: int) -> list[Client]: ...

    def stop(self) -> dict[str, Any]: ...


def _counters(requests: int, batches: int) -> dict[str, Any]:
    """The subset of shmeval's Evaluator.stats() the baseline servers also report."""
    return {"requests": requests, "batches": batches, "mean_batch": requests / batches if batches else None}


# --- (a) multiprocessing.Queue ------------------------------------------------------


# None is the server's stop sentinel.
RequestQueue: TypeAlias = "mp.Queue[tuple[int, np.ndarray] | None]"
ResponseQueue: TypeAlias = "mp.Queue[Mapping[str, Any]]"


class QueueClient:
    def __init__(self, worker_id: int, requests: RequestQueue, responses: ResponseQueue) -> None:
        self.worker_id = worker_id
        self.requests = requests
        self.responses = responses

    def evaluate(self, state: np.ndarray) -> Mapping[str, Any]:
        self.requests.put((self.worker_id, state))
        return self.responses.get()


def queue_server(requests: RequestQueue, responses: list[ResponseQueue], spec: StateSpec, max_batch: int,
                 control: Connection) -> None:
    model = NullModel(spec.policy_size)
    n_requests = n_batches = 0
    stopping = False
    while not stopping:
        first = requests.get()  # block for one request, then take whatever else is already queued
        if first is None:
            break
        items = [first]
        while len(items) < max_batch:
            try:
                item = requests.get_nowait()
            except queue.Empty:
                break
            if item is None:  # stop sentinel: answer this batch, then exit
                stopping = True
                break
            items.append(item)
        out = model(np.stack([state for _, state in items]))
        policy, value = out["policy"], out["value"]
        for i, (worker_id, _) in enumerate(items):
            responses[worker_id].put({"policy": policy[i], "value": value[i]})
        n_requests += len(items)
        n_batches += 1
    control.send(_counters(n_requests, n_batches))


# --- (b) multiprocessing.Pipe -------------------------------------------------------


class PipeClient:
    def __init__(self, conn: Connection, policy_size: int) -> None:
        self.conn = conn
        self.policy_size = policy_size

    def evaluate(self, state: np.ndarray) -> Mapping[str, Any]:
        self.conn.send_bytes(state.data)  # the array's own buffer: no pickling, no copy
        reply = np.frombuffer(self.conn.recv_bytes(), dtype=np.float32)
        return {"policy": reply[: self.policy_size], "value": reply[self.policy_size]}


def pipe_server(conns: list[Connection], spec: StateSpec, max_batch: int, control: Connection) -> None:
    model = NullModel(spec.policy_size)
    watched = [*conns, control]
    n_requests = n_batches = 0
    while True:
        ready = cast(list[Connection], wait(watched))
        if control in ready:
            break
        # Each worker has at most one request in flight, so one read per ready
        # end drains it; ends beyond max_batch stay ready for the next wait().
        batch_conns: list[Connection] = []
        payloads: list[bytes] = []
        for conn in ready[:max_batch]:
            try:
                payloads.append(conn.recv_bytes())
            except EOFError:  # the worker exited (end of its window, or crashed)
                watched.remove(conn)
                continue
            batch_conns.append(conn)
        if not batch_conns:
            continue
        batch = np.frombuffer(b"".join(payloads), dtype=np.float32).reshape(len(payloads), *spec.shape)
        out = model(batch)
        # One contiguous float32 row per worker: policy followed by value.
        replies = np.empty((len(batch_conns), spec.policy_size + 1), dtype=np.float32)
        replies[:, :-1] = out["policy"]
        replies[:, -1] = out["value"]
        for conn, row in zip(batch_conns, replies):
            conn.send_bytes(row.data)
        n_requests += len(batch_conns)
        n_batches += 1
    control.send(_counters(n_requests, n_batches))


class _ServerProcess:
    """Lifecycle shared by the baselines: a server process that reports its
    counters on a control pipe when it stops."""

    server: BaseProcess | None = None
    control: Connection | None = None

    def _launch(self, ctx: SpawnContext, target: Callable[..., None], *args: Any) -> None:
        self.control, server_end = ctx.Pipe()
        self.server = ctx.Process(target=target, args=(*args, server_end), name=f"bench-{target.__name__}",
                                  daemon=True)
        self.server.start()
        server_end.close()  # the child holds its own duplicate

    def _finish(self) -> dict[str, Any]:
        """Collect the counters after the stop signal, then join the server."""
        if self.server is None or self.control is None:
            return {}
        try:
            stats = self.control.recv() if self.control.poll(JOIN_TIMEOUT_S) else {}
        except EOFError:  # the server died without reporting
            stats = {}
        finally:
            _join([self.server], JOIN_TIMEOUT_S)
            self.control.close()
            self.server = self.control = None
        return stats


class QueueMethod(_ServerProcess):
    def start(self, ctx: SpawnContext, n_workers: int, spec: StateSpec, max_batch: int) -> list[Client]:
        self.requests = ctx.Queue()
        self.responses = [ctx.Queue() for _ in range(n_workers)]
        self._launch(ctx, queue_server, self.requests, self.responses, spec, max_batch)
        return [QueueClient(i, self.requests, q) for i, q in enumerate(self.responses)]

    def stop(self) -> dict[str, Any]:
        if self.server is None:
            return {}
        self.requests.put(None)
        stats = self._finish()
        for q in (self.requests, *self.responses):
            q.close()
            q.join_thread()
        return stats


class PipeMethod(_ServerProcess):
    def start(self, ctx: SpawnContext, n_workers: int, spec: StateSpec, max_batch: int) -> list[Client]:
        pairs = [ctx.Pipe(duplex=True) for _ in range(n_workers)]
        self._launch(ctx, pipe_server, [server_end for server_end, _ in pairs], spec, max_batch)
        for server_end, _ in pairs:
            server_end.close()
        # The worker ends live only in the clients: once the harness drops them
        # after spawning the workers, a worker's exit shows as EOF at the server.
        return [PipeClient(worker_end, spec.policy_size) for _, worker_end in pairs]

    def stop(self) -> dict[str, Any]:
        if self.control is not None:
            with contextlib.suppress(OSError):  # a dead server cannot be told; _finish reaps it
                self.control.send(None)
        return self._finish()


# --- (c) shmeval --------------------------------------------------------------------


class ShmevalMethod:
    """The Evaluator is its own client: it pickles into the workers."""

    def __init__(self, threaded: bool) -> None:
        self.threaded = threaded
        self.evaluator: Any = None

    def start(self, ctx: SpawnContext, n_workers: int, spec: StateSpec, max_batch: int) -> list[Client]:
        import shmeval  # only here: the baselines must run where shmeval is not installed

        kwargs: dict[str, Any] = dict(
            input_shape=spec.shape,
            input_dtype="float32",
            outputs={"policy": ((spec.policy_size,), "float32"), "value": ((), "float32")},
            max_batch=max_batch,
        )
        if self.threaded:
            self.evaluator = shmeval.Evaluator(NullModel(spec.policy_size), **kwargs)
        else:
            self.evaluator = shmeval.Evaluator.spawn(functools.partial(NullModel, spec.policy_size), **kwargs)
        return [self.evaluator] * n_workers

    def stop(self) -> dict[str, Any]:
        if self.evaluator is None:
            return {}
        try:
            return dict(self.evaluator.stats())
        finally:
            self.evaluator.close()
            self.evaluator = None


METHODS: dict[str, Callable[[], Method]] = {
    "queue": QueueMethod,
    "pipe": PipeMethod,
    "shmeval": functools.partial(ShmevalMethod, threaded=False),
    "shm_thread": functools.partial(ShmevalMethod, threaded=True),
}


# --- worker -------------------------------------------------------------------------

# (worker_id, "ok", (count, latency sample in ns)) or (worker_id, "error", traceback)
ResultQueue: TypeAlias = "mp.Queue[tuple[int, str, Any]]"


def _check_reply(out: Mapping[str, Any], worker_id: int, spec: StateSpec) -> None:
    policy, value = np.asarray(out["policy"]), np.asarray(out["value"])
    if policy.shape != (spec.policy_size,) or value.shape != () or value != worker_id:
        raise RuntimeError(f"worker {worker_id}: bad reply: policy shape {policy.shape}, value {value!r}")


def worker_main(client: Client, worker_id: int, spec: StateSpec, warmup: int, seconds: float, n_samples: int,
                ready: threading.Barrier, go: threading.Event, start_ns: Any, results: ResultQueue) -> None:
    try:
        state = np.random.default_rng(worker_id).random(spec.shape, dtype=np.float32)
        # The null model echoes this element back as "value": a reply routed to
        # the wrong worker fails the check below.
        state.flat[0] = worker_id
        for _ in range(warmup):
            _check_reply(client.evaluate(state), worker_id, spec)
        latencies = np.empty(LATENCY_CAP, dtype=np.int64)
        ready.wait(SETUP_TIMEOUT_S)  # bounded: an orphaned worker must not wait forever
        if not go.wait(SETUP_TIMEOUT_S):
            raise RuntimeError("no start signal")
        # One window for all workers, in perf_counter_ns: CLOCK_MONOTONIC on
        # Linux, the same clock in every process.
        t_start = start_ns.value
        t_end = t_start + int(seconds * 1e9)
        time.sleep(max(0.0, (t_start - time.perf_counter_ns()) / 1e9))
        evaluate = client.evaluate  # keeps the attribute lookup out of the timed loop
        count = 0
        before = time.perf_counter_ns()
        while True:
            evaluate(state)
            after = time.perf_counter_ns()
            if after > t_end:  # count only round trips completed inside the window
                break
            if count < LATENCY_CAP:
                latencies[count] = after - before
            count += 1
            before = after
    except Exception:
        ready.abort()  # frees the parent and the other workers from the barrier
        results.put((worker_id, "error", traceback.format_exc()))
        return
    recorded = latencies[: min(count, LATENCY_CAP)]
    if len(recorded) > n_samples:
        # Evenly spaced, so the sample covers the whole window.
        recorded = recorded[np.linspace(0, len(recorded) - 1, n_samples).astype(np.int64)]
    results.put((worker_id, "ok", (count, recorded.copy())))


# --- one trial ----------------------------------------------------------------------


def _join(procs: Sequence[BaseProcess], timeout: float) -> list[str]:
    """Join with one shared deadline, then terminate (and if need be kill) the
    stragglers.  Returns the names of those that had to be stopped."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    stuck = [p for p in procs if p.is_alive()]
    for p in stuck:
        p.terminate()
        p.join(1.0)
        if p.is_alive():
            p.kill()
            p.join()
    return [p.name for p in stuck]


def _worker_errors(results: ResultQueue, timeout: float) -> str:
    """Tracebacks the workers reported, the root cause first: after one worker
    fails the others only report the broken barrier."""
    errors: list[str] = []
    try:
        while True:
            _, status, payload = results.get(timeout=timeout)
            if status == "error":
                errors.append(payload)
    except queue.Empty:
        pass
    errors.sort(key=lambda tb: "BrokenBarrierError" in tb)
    return errors[0] if errors else "(no worker reported an error: did a round trip hang?)"


def weighted_quantiles(samples: list[np.ndarray], counts: list[int], qs: Sequence[float]) -> np.ndarray:
    """Quantiles of all round trips pooled, from per-worker samples.

    A worker sends at most n_samples latencies however many round trips it
    made; weighting each by count / len(sample) keeps a starved worker (few,
    slow trips) from counting as much as a busy one.
    """
    kept = [(s, c) for s, c in zip(samples, counts) if len(s)]
    values = np.concatenate([s for s, _ in kept])
    weights = np.concatenate([np.full(len(s), c / len(s)) for s, c in kept])
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    idx = np.searchsorted(cumulative, np.asarray(qs) * cumulative[-1])
    quantiles: np.ndarray = values[order][np.minimum(idx, len(values) - 1)]
    return quantiles


def run_trial(method_name: str, n_workers: int, spec: StateSpec, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    method = METHODS[method_name]()
    ready = ctx.Barrier(n_workers + 1)  # the workers and this process
    go = ctx.Event()
    start_ns = ctx.Value("q", 0, lock=False)
    results = ctx.Queue()
    procs: list[BaseProcess] = []
    try:
        clients = method.start(ctx, n_workers, spec, args.max_batch)
        procs = [
            ctx.Process(target=worker_main, name=f"bench-worker-{i}", daemon=True,
                        args=(client, i, spec, args.warmup, args.seconds, args.samples, ready, go, start_ns, results))
            for i, client in enumerate(clients)
        ]
        for p in procs:
            p.start()
        del clients  # the workers hold their own copies (see PipeMethod.start)
        try:
            ready.wait(SETUP_TIMEOUT_S)
        except threading.BrokenBarrierError:
            raise RuntimeError(f"{method_name} x{n_workers}: warm-up failed:\n{_worker_errors(results, 2.0)}") from None
        start_ns.value = time.perf_counter_ns() + START_DELAY_NS
        go.set()
        replies = {}
        for _ in procs:
            try:
                worker_id, status, payload = results.get(timeout=args.seconds + SETUP_TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"{method_name} x{n_workers}: a worker never reported: hung round trip?") from None
            if status == "error":
                raise RuntimeError(f"{method_name} x{n_workers}: worker {worker_id} failed:\n{payload}")
            replies[worker_id] = payload
    finally:
        ready.abort()  # no-op on success; on failure releases workers still at the barrier
        terminated = _join(procs, JOIN_TIMEOUT_S)
        server = method.stop()
    if terminated:
        print(f"warning: {method_name} x{n_workers}: terminated hung {', '.join(terminated)}", file=sys.stderr)

    counts = [replies[i][0] for i in range(n_workers)]
    samples = [replies[i][1] for i in range(n_workers)]
    total = sum(counts)
    if total == 0:
        raise RuntimeError(f"{method_name} x{n_workers}: no round trip completed in the window")
    latency_us = dict(zip(QUANTILES, (weighted_quantiles(samples, counts, list(QUANTILES.values())) / 1e3).tolist()))
    return {
        "method": method_name,
        "workers": n_workers,
        "seconds": args.seconds,
        "round_trips": total,
        "throughput": total / args.seconds,
        "p50_us": latency_us["p50"],
        "p99_us": latency_us["p99"],
        "fairness": min(counts) / (total / n_workers),
        "worker_counts": counts,
        "worker_p50_us": [float(np.percentile(s, 50)) / 1e3 if len(s) else None for s in samples],
        "worker_p99_us": [float(np.percentile(s, 99)) / 1e3 if len(s) else None for s in samples],
        "latency_us": latency_us,
        "server": server,
        "terminated": terminated,
    }


# --- reporting ----------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    cpu_model = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    try:
        shmeval_version: str | None = importlib.metadata.version("shmeval")
    except importlib.metadata.PackageNotFoundError:
        shmeval_version = None
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model or platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "numpy": np.__version__,
        "shmeval": shmeval_version,
        # Other load on the machine skews every figure; this makes it visible.
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def summarise(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and range over the repetitions, per (workers, method)."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for t in trials:
        groups.setdefault((t["workers"], t["method"]), []).append(t)
    rows = []
    for (workers, method), ts in groups.items():
        row: dict[str, Any] = {"workers": workers, "method": method, "repeats": len(ts)}
        metrics = {
            "throughput": [t["throughput"] for t in ts],
            "p50_us": [t["p50_us"] for t in ts],
            "p99_us": [t["p99_us"] for t in ts],
            "fairness": [t["fairness"] for t in ts],
            "mean_batch": [t["server"]["mean_batch"] for t in ts if t["server"].get("mean_batch") is not None],
        }
        for name, values in metrics.items():
            row[name] = (
                {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None
            )
        rows.append(row)
    return rows


def _print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def _cell(stat: dict[str, float] | None, fmt: str, ranges: bool) -> str:
    if stat is None:
        return "-"
    text = format(stat["median"], fmt)
    return f"{text} [{format(stat['min'], fmt)}-{format(stat['max'], fmt)}]" if ranges else text


def print_report(summary: list[dict[str, Any]], methods: list[str], args: argparse.Namespace) -> None:
    ranges = args.repeats > 1
    print()
    print(f"results: median{' [min-max]' if ranges else ''} over {args.repeats} repetition(s) "
          f"of a {args.seconds:g} s window")
    _print_table(
        ["workers", "method", "round trips/s", "p50 us", "p99 us", "fairness", "mean batch"],
        [
            [str(r["workers"]), r["method"], _cell(r["throughput"], ",.0f", ranges), _cell(r["p50_us"], ".1f", ranges),
             _cell(r["p99_us"], ".1f", ranges), _cell(r["fairness"], ".2f", ranges),
             _cell(r["mean_batch"], ".2f", ranges)]
            for r in summary
        ],
    )
    print("fairness: slowest worker's round trips / mean worker's")

    # shmeval against each baseline; with no shmeval method selected, Pipe
    # against Queue is the comparison left.
    candidates = [m for m in methods if m in SHM_METHODS] or [m for m in methods if m == "pipe"]
    baselines = [m for m in BASELINES if m in methods and m not in candidates]
    by_key = {(r["workers"], r["method"]): r for r in summary}
    rows = []
    for workers in args.workers:
        for candidate in candidates:
            for baseline in baselines:
                c, b = by_key[workers, candidate], by_key[workers, baseline]
                rows.append([
                    str(workers), f"{candidate} vs {baseline}",
                    f"{c['throughput']['median'] / b['throughput']['median']:.2f}x",
                    f"{b['p50_us']['median'] / c['p50_us']['median']:.2f}x",
                    f"{b['p99_us']['median'] / c['p99_us']['median']:.2f}x",
                ])
    if rows:
        print()
        print("ratios of medians, >1 = first method better (throughput a/b; latency b/a)")
        _print_table(["workers", "comparison", "round trips/s", "p50", "p99"], rows)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    # Whatever else Evaluator.stats() may hold: losing the run at the last
    # step over one field would be worse than a string.
    return repr(obj)


def _dev_shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def _mapped_by_others() -> set[str]:
    """/dev/shm names that another live process has mapped.  Every process the
    benchmark started has exited by the time this is asked, so such entries
    belong to something running alongside (a test suite, say), not to us."""
    names: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                names.update(line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line)
        except OSError:  # the process exited meanwhile, or is not ours to read
            continue
    return names


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=_int_list, default=[1, 4, 16], help="worker counts (default 1,4,16)")
    parser.add_argument("--methods", default="queue,pipe,shmeval", help=f"from {','.join(METHODS)} "
                        "(default queue,pipe,shmeval)")
    parser.add_argument("--state", choices=sorted(STATES), default="c4", help="c4: 6x7x2, go: 19x19x17 float32")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed window per trial (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument("--warmup", type=int, default=200, help="untimed round trips per worker (default 200)")
    parser.add_argument("--samples", type=int, default=20000, help="latencies each worker reports (default 20000)")
    parser.add_argument("--max-batch", type=int, default=256, help="server batch limit (default 256)")
    parser.add_argument("--json", metavar="PATH", help="write machine info, every trial and the summary here")
    args = parser.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods:
        parser.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    if any(m in SHM_METHODS for m in args.methods) and importlib.util.find_spec("shmeval") is None:
        parser.error("shmeval is not installed; run with --methods queue,pipe")
    if args.seconds <= 0 or args.repeats < 1 or args.warmup < 1 or args.samples < 1 or args.max_batch < 1:
        parser.error("--seconds, --repeats, --warmup, --samples and --max-batch must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    spec = STATES[args.state]
    shm_before = _dev_shm()
    machine = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))
    print(f"state: {spec.name} {'x'.join(map(str, spec.shape))} float32 ({spec.nbytes:,} bytes), "
          f"policy ({spec.policy_size},); methods {','.join(args.methods)}; workers "
          f"{','.join(map(str, args.workers))}; max_batch {args.max_batch}; warm-up {args.warmup}")

    trials = []
    began = time.monotonic()
    for repeat in range(args.repeats):
        for n_workers in args.workers:
            for method in args.methods:
                trial = run_trial(method, n_workers, spec, args)
                trial["repeat"] = repeat
                trials.append(trial)
                gc.collect()  # finalises the trial's queues and semaphores now, not at exit
                print(f"[{repeat + 1}/{args.repeats}] {n_workers:>3} x {method:<10} "
                      f"{trial['throughput']:>10,.0f}/s  p50 {trial['p50_us']:8.1f} us  "
                      f"p99 {trial['p99_us']:8.1f} us  fairness {trial['fairness']:.2f}", file=sys.stderr)
    elapsed = time.monotonic() - began

    summary = summarise(trials)
    print_report(summary, args.methods, args)
    leftovers = sorted(_dev_shm() - shm_before - _mapped_by_others())
    print(f"\nwall time {elapsed:.0f} s; new entries in /dev/shm: {', '.join(leftovers) or 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "config": {**vars(args), "state_shape": spec.shape,
                                                      "policy_size": spec.policy_size},
                       "trials": trials, "summary": summary, "dev_shm_leftovers": leftovers, "wall_s": elapsed},
                      f, indent=1, default=_json_default)
        print(f"raw results: {args.json}")
    return 1 if leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
