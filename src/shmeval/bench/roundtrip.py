"""The round-trip harness: one server, N worker processes, one timed window.

Each worker is a separate process (context "spawn") that sends one state at a
time and waits for the reply, the pattern of self-play workers evaluating MCTS
leaves.  Every method serves the same null model (:class:`NullModel`) from one
server, so the figures are the cost of the transport and the batching.

A trial starts a fresh server and fresh worker processes.  The workers warm
up, meet at a barrier, then all run over one shared time window and record
each round trip's latency; their results are pickled back only after the
window.  The null model echoes each state's first element as "value", and the
harness puts the worker's id there: a reply routed to the wrong worker fails
the trial.

A method is an object with ``start(ctx, n_workers, spec, max_batch)`` -> one
client per worker (picklable, with ``evaluate(state)`` -> mapping of arrays)
and ``stop()`` -> the server's counters; the registry is
:data:`shmeval.bench.METHODS`.
"""
from __future__ import annotations

import functools
import math
import multiprocessing as mp
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Mapping, Protocol, Sequence, TypeAlias

import numpy as np

from ._timing import timed_calls

# Latencies a worker can record in one window.  8 MiB of int64 per worker, but
# np.empty only commits the pages actually written.
LATENCY_CAP = 1 << 20
# Headroom between the start signal and the window, so that every worker is
# past go.wait() before it opens even when 64 of them share 2 cores.
START_DELAY_NS = 100_000_000
JOIN_TIMEOUT_S = 10.0
# How long a client waits for one reply before it calls the server dead (the
# baselines' clients; shmeval has its own liveness checks).  Far above any
# real round trip, so it never fires in a healthy run.
REPLY_TIMEOUT_S = 30.0
QUANTILES = {"p1": 0.01, "p10": 0.10, "p50": 0.50, "p90": 0.90, "p99": 0.99, "p99.9": 0.999, "max": 1.0}
# Where each trial's latency distribution is sampled for the JSON and the plot:
# every percent, then the tail more finely.
CDF_GRID: tuple[float, ...] = (*(i / 100 for i in range(100)), 0.995, 0.999, 0.9995, 0.9999, 1.0)


def setup_timeout_s(n_workers: int) -> float:
    """Bound on spawning and warming up n workers.  64 interpreters importing
    NumPy on 2 busy cores take 20-40 s; this leaves several times that."""
    return 60.0 + 2.0 * n_workers


@dataclass(frozen=True)
class StateSpec:
    name: str
    shape: tuple[int, ...]
    policy_size: int

    @property
    def nbytes(self) -> int:
        return 4 * math.prod(self.shape)  # float32

    def describe(self) -> str:
        return f"{self.name} ({'x'.join(map(str, self.shape))} float32, {self.nbytes:,} B)"


STATES = {
    "c4": StateSpec("c4", (6, 7, 2), 7),  # Connect Four: 336 bytes
    "go": StateSpec("go", (19, 19, 17), 19 * 19 + 1),  # AlphaGo Zero input: 24,548 bytes
}

Model: TypeAlias = Callable[[np.ndarray], dict[str, np.ndarray]]
# Called in the server with the policy size; must be picklable (a class or a
# module-level function) because the servers run in their own processes.
ModelFactory: TypeAlias = Callable[[int], Model]


class NullModel:
    """The model every method serves: no compute, but it reads the input.

    A class, so that it is its own picklable factory: ``NullModel(policy_size)``.
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


def server_counters(requests: int, batches: int) -> dict[str, Any]:
    """The subset of shmeval's Evaluator.stats() the baseline servers also report."""
    return {"requests": requests, "batches": batches, "mean_batch": requests / batches if batches else None}


def join_processes(procs: Sequence[BaseProcess], timeout: float) -> list[str]:
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
    return [p.name or "?" for p in stuck]


# --- shmeval itself -----------------------------------------------------------------


class ShmevalMethod:
    """shmeval.Evaluator.spawn (the evaluator in its own process) or, threaded,
    shmeval.Evaluator (a thread of this process).  The Evaluator is its own
    client: it pickles into the workers as a handle."""

    def __init__(self, threaded: bool = False, model: ModelFactory = NullModel) -> None:
        self.threaded = threaded
        self.model = model
        self.evaluator: Any = None

    def start(self, ctx: SpawnContext, n_workers: int, spec: StateSpec, max_batch: int) -> list[Client]:
        import shmeval

        kwargs: dict[str, Any] = dict(
            input_shape=spec.shape,
            input_dtype="float32",
            outputs={"policy": ((spec.policy_size,), "float32"), "value": ((), "float32")},
            max_batch=max_batch,
        )
        if self.threaded:
            self.evaluator = shmeval.Evaluator(self.model(spec.policy_size), **kwargs)
        else:
            self.evaluator = shmeval.Evaluator.spawn(functools.partial(self.model, spec.policy_size), **kwargs)
        return [self.evaluator] * n_workers

    def stop(self) -> dict[str, Any]:
        if self.evaluator is None:
            return {}
        try:
            return dict(self.evaluator.stats())
        finally:
            self.evaluator.close()
            self.evaluator = None


# --- worker -------------------------------------------------------------------------

# Each worker's own pipe to the parent: (worker_id, "ready", None) after the
# warm-up, then (worker_id, "ok", (count, latency sample in ns)); or
# (worker_id, "error", traceback) instead of either.  A pipe, not a
# multiprocessing.Queue: a Queue's put starts a feeder thread in the worker,
# and a worker with a second thread is not the single-threaded process a
# self-play worker usually is (shmeval's client keeps the GIL while it
# waits only when its thread is the process's only Python thread).
ResultPipe: TypeAlias = Connection
# start_ns holds this when the parent calls the trial off before the window.
ABORTED = -1


@dataclass(frozen=True)
class TrialConfig:
    seconds: float = 2.0
    warmup: int = 200  # untimed round trips per worker
    samples: int = 20_000  # latencies each worker reports
    max_batch: int = 256
    # Every method's workers run under this policy: "normal" (the default
    # policy) or "batch" (SCHED_BATCH, what shmeval.use_batch_scheduling sets).
    worker_sched: str = "normal"
    # The workers' timed loop: "c" (shmeval.bench._timing.timed_calls, the
    # default) or "python" (the same loop in bytecode, which adds its own CPU
    # to every method's round trip).
    loop: str = "c"

    def __post_init__(self) -> None:
        if self.loop not in ("c", "python"):
            raise ValueError(f"loop must be 'c' or 'python', got {self.loop!r}")
        if self.worker_sched not in ("normal", "batch"):
            raise ValueError(f"worker_sched must be 'normal' or 'batch', got {self.worker_sched!r}")


def check_reply(out: Mapping[str, Any], worker_id: int, spec: StateSpec) -> None:
    """The routing check: the null model echoes the state's first element,
    which holds the worker's id.  A batch of one (the pipelined client's
    outputs) is checked as its row."""
    policy, value = np.asarray(out["policy"]), np.asarray(out["value"])
    if policy.shape == (1, spec.policy_size) and value.shape == (1,):
        policy, value = policy[0], value[0]
    if policy.shape != (spec.policy_size,) or value.shape != () or value != worker_id:
        raise RuntimeError(f"worker {worker_id}: bad reply: policy shape {policy.shape}, value {value!r}")


def _python_loop(evaluate: Callable[[np.ndarray], Mapping[str, Any]], state: np.ndarray, t_end: int,
                 latencies: np.ndarray) -> tuple[int, Mapping[str, Any]]:
    """``timed_calls`` written in Python (``--loop python``)."""
    # Locals keep attribute lookups out of the timed loop, and a memoryview's
    # item store is cheaper than an ndarray's.
    clock = time.perf_counter_ns
    record = latencies.data  # a memoryview of it
    cap = len(latencies)
    count = 0
    try:
        before = clock()
        while True:
            out = evaluate(state)
            after = clock()
            if after > t_end:  # count only round trips completed inside the window
                break
            if count < cap:
                record[count] = after - before
            count += 1
            before = after
    finally:
        record.release()
    return count, out


def worker_main(client: Client, worker_id: int, spec: StateSpec, config: TrialConfig, setup_timeout: float,
                go: threading.Event, start_ns: Any, results: ResultPipe) -> None:
    try:
        if config.worker_sched == "batch":
            from shmeval import use_batch_scheduling

            use_batch_scheduling()
        state = np.random.default_rng(worker_id).random(spec.shape, dtype=np.float32)
        state.flat[0] = worker_id  # see check_reply
        for _ in range(config.warmup):
            check_reply(client.evaluate(state), worker_id, spec)
        latencies = np.empty(LATENCY_CAP, dtype=np.int64)
        results.send((worker_id, "ready", None))
        # Bounded: an orphaned worker must not wait forever.
        if not go.wait(setup_timeout) or start_ns.value == ABORTED:
            return
        # One window for all workers, in perf_counter_ns: CLOCK_MONOTONIC on
        # Linux, the same clock in every process.
        t_start = start_ns.value
        t_end = t_start + int(config.seconds * 1e9)
        time.sleep(max(0.0, (t_start - time.perf_counter_ns()) / 1e9))
        if config.loop == "c":
            # The loop in C: what the window measures is the method's call,
            # not the interpreter running the loop around it, which costs
            # about 1 us of CPU per call at 16 workers on 2 cores.  A client
            # with calls in flight brings its own (PipelinedClient).
            timed_loop = getattr(client, "timed_loop", None)
            if timed_loop is not None:
                count, out = timed_loop(state, t_end, latencies)
            else:
                count, out = timed_calls(client.evaluate, state, t_end, latencies)
        else:
            count, out = _python_loop(client.evaluate, state, t_end, latencies)
        check_reply(out, worker_id, spec)  # once more, off the clock
    except Exception:
        results.send((worker_id, "error", traceback.format_exc()))
        return
    recorded = latencies[: min(count, LATENCY_CAP)]
    if len(recorded) > config.samples:
        # Evenly spaced, so the sample covers the whole window.
        recorded = recorded[np.linspace(0, len(recorded) - 1, config.samples).astype(np.int64)]
    results.send((worker_id, "ok", (count, recorded.copy())))


# --- one trial ----------------------------------------------------------------------


def _collect(results: Sequence[ResultPipe], procs: Sequence[BaseProcess], status: str, timeout: float,
             label: str) -> dict[int, Any]:
    """One message of ``status`` from every worker.  Raises RuntimeError with
    the first worker error, when a worker dies without a word, or when the
    timeout passes (a round trip hung)."""
    received: dict[int, Any] = {}
    closed: set[int] = set()  # pipes that ended without the message
    deadline = time.monotonic() + timeout
    while len(received) < len(procs):
        waiting = {id(r): i for i, r in enumerate(results) if i not in received and i not in closed}
        for r in wait_for([results[i] for i in waiting.values()], timeout=0.25):
            i = waiting[id(r)]
            try:
                worker_id, got, payload = results[i].recv()
            except EOFError:
                closed.add(i)
                continue
            if got == "error":
                raise RuntimeError(f"{label}: worker {worker_id} failed:\n{payload}")
            received[worker_id] = payload
        # A worker that failed reported it before exiting: a closed pipe or a
        # non-zero exit code means it died before it could.
        dead = [i for i, p in enumerate(procs)
                if i not in received and (i in closed or p.exitcode not in (None, 0))]
        if dead:
            raise RuntimeError(f"{label}: worker {dead[0]} died (exit code {procs[dead[0]].exitcode})")
        if len(received) < len(procs) and time.monotonic() > deadline:
            raise RuntimeError(f"{label}: {len(procs) - len(received)} worker(s) silent for {timeout:.0f} s "
                               f"waiting for '{status}': hung round trip?")
    return received


def weighted_quantiles(samples: Sequence[np.ndarray], counts: Sequence[int], qs: Sequence[float]) -> np.ndarray:
    """Quantiles of all round trips pooled, from per-worker samples.

    A worker sends at most ``samples`` latencies however many round trips it
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


def run_trial(method: Method, name: str, n_workers: int, spec: StateSpec, config: TrialConfig) -> dict[str, Any]:
    """One window of ``method`` serving ``n_workers`` fresh worker processes.

    Raises RuntimeError when a worker fails (a bad reply included), dies,
    hangs, or no round trip completes; the server and every worker are
    stopped first.
    """
    ctx = mp.get_context("spawn")
    label = f"{name} x{n_workers} ({spec.name})"
    setup_timeout = setup_timeout_s(n_workers)
    go = ctx.Event()
    start_ns = ctx.Value("q", 0, lock=False)
    pipes = [ctx.Pipe(duplex=False) for _ in range(n_workers)]
    results = [r for r, _ in pipes]
    procs: list[BaseProcess] = []
    terminated: list[str] = []
    try:
        clients = method.start(ctx, n_workers, spec, config.max_batch)
        procs = [
            ctx.Process(target=worker_main, name=f"bench-worker-{i}", daemon=True,
                        args=(client, i, spec, config, setup_timeout, go, start_ns, pipes[i][1]))
            for i, client in enumerate(clients)
        ]
        for p in procs:
            p.start()
        for _, w in pipes:  # the workers hold them now; closing ours makes a death an EOF
            w.close()
        # The workers hold their own copies; the pipe baseline relies on the
        # parent dropping its ends (see baselines.PipeMethod.start).
        del clients
        _collect(results, procs, "ready", setup_timeout, f"{label}: warm-up")
        start_ns.value = time.perf_counter_ns() + START_DELAY_NS
        go.set()
        replies = _collect(results, procs, "ok", config.seconds + setup_timeout, label)
    finally:
        if not go.is_set():  # called off: free the workers waiting for the window
            start_ns.value = ABORTED
            go.set()
        try:
            terminated = join_processes(procs, JOIN_TIMEOUT_S)
        finally:
            server = method.stop()
            for r, w in pipes:
                r.close()
                w.close()
    if terminated:
        print(f"warning: {label}: terminated hung {', '.join(terminated)}", file=sys.stderr)

    counts = [int(replies[i][0]) for i in range(n_workers)]
    samples = [replies[i][1] for i in range(n_workers)]
    total = sum(counts)
    if total == 0:
        raise RuntimeError(f"{label}: no round trip completed in the window")
    quantiles = weighted_quantiles(samples, counts, [*QUANTILES.values(), *CDF_GRID]) / 1e3
    latency_us = dict(zip(QUANTILES, quantiles[: len(QUANTILES)].tolist()))
    return {
        "method": name,
        "state": spec.name,
        "workers": n_workers,
        "seconds": config.seconds,
        "round_trips": total,
        "throughput": total / config.seconds,
        "p50_us": latency_us["p50"],
        "p99_us": latency_us["p99"],
        "p999_us": latency_us["p99.9"],
        "mean_batch": server.get("mean_batch"),
        "fairness": min(counts) / (total / n_workers),
        "worker_counts": counts,
        "worker_p50_us": [float(np.percentile(s, 50)) / 1e3 if len(s) else None for s in samples],
        "worker_p99_us": [float(np.percentile(s, 99)) / 1e3 if len(s) else None for s in samples],
        "latency_us": latency_us,
        # At the quantiles of CDF_GRID, rounded to 10 ns.
        "latency_cdf_us": np.round(quantiles[len(QUANTILES):], 2).tolist(),
        "server": server,
        "terminated": terminated,
    }
