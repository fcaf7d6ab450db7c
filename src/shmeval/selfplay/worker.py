"""A self-play worker process: plays Connect Four against itself, several
games at once, and counts what it does in shared counters the main process
reads."""
from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, runtime_checkable

import numpy as np

from .. import mcts
from .._util.children import child_setup
from ..games import connect4
from ..sched import use_batch_scheduling
from .net import EvaluateBatch
from .pinning import pin
from .settings import Settings

# Per-worker counters (int64 each) in one shared array, NF slots per worker.
MOVES, EVALS, CALLS, GAMES, EVAL_WALL_NS, EVAL_CPU_NS, LOCAL_HITS, LOCAL_LOOKUPS = range(8)
NF = 8
# Flags shared by all workers (and the arena).
STOP = 0
#: The measured window is over: the arena starts no more matches.
ARENA_STOP = 1
N_FLAGS = 4


class NetLink(Protocol):
    """What a worker is given to reach the net (one kind per mode, picklable):
    ``open`` runs in the worker and returns its evaluate function."""

    def open(self, s: Settings) -> EvaluateBatch: ...


@runtime_checkable
class PipelinedLink(NetLink, Protocol):
    """A link whose net can be submitted to (``--pipeline``, the shmeval
    mode): ``open_submit`` returns the pipelined search's submit_batch."""

    def open_submit(self, s: Settings) -> mcts.SubmitBatch: ...


class _Stopped(Exception):
    """Raised inside a worker's search when the main process asks it to stop."""


class LocalCache:
    """``--local-cache``: an evaluate function behind a cache of this
    worker's own, the scheme of engines that run one search per process
    (a dict from the position's bytes to its answer, the least recently
    used out when full), counted in the worker's counters."""

    def __init__(self, inner: EvaluateBatch, entries: int, counters: np.ndarray) -> None:
        self.inner = inner
        self.entries = entries
        self.c = counters
        self.table: "OrderedDict[bytes, Tuple[np.ndarray, float]]" = OrderedDict()

    def __call__(self, x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        table = self.table
        keys = [row.tobytes() for row in x]
        found = [table.get(k) for k in keys]
        misses = [i for i, f in enumerate(found) if f is None]
        for k, f in zip(keys, found):
            if f is not None:
                table.move_to_end(k)
        if misses:
            p_new, v_new = self.inner(x[misses] if len(misses) < len(x) else x)
            for j, i in enumerate(misses):
                found[i] = (np.array(p_new[j]), float(v_new[j]))
                table[keys[i]] = found[i]  # type: ignore[assignment]
                if len(table) > self.entries:
                    table.popitem(last=False)
        self.c[LOCAL_HITS] += len(x) - len(misses)
        self.c[LOCAL_LOOKUPS] += len(x)
        return (np.stack([f[0] for f in found]),  # type: ignore[index]
                np.array([f[1] for f in found]))  # type: ignore[index]


def probe_states() -> np.ndarray:
    """A few fixed positions every mode evaluates before it starts, so the
    runs can be checked to serve the same initial weights."""
    games: Tuple[List[int], ...] = ([], [3], [3, 3, 4], [0, 1, 2, 3, 4, 5, 6], [3, 2, 3, 2, 3])
    return connect4.encode_many([connect4.from_moves(m) for m in games])


def worker_main(wid: int, s: Settings, counters_raw: Any, flags_raw: Any, go: Any,
                out_q: Any, link: NetLink, local_cache: int,
                cpus: Optional[set[int]] = None) -> None:
    """One self-play worker: opens its way to the net (behind a
    :class:`LocalCache` of ``local_cache`` entries unless 0), evaluates the
    probe states (worker 0), reports ready, waits for ``go``, then plays
    until the stop flag is set.  Sends ("ready" | "done" | "error", worker id, info)
    and ("game", worker id, moves, policies) on ``out_q``."""
    child_setup()
    # Decided before pinning, on the CPUs the run was given.
    policy = s.worker_policy()
    pin(cpus)
    t0 = time.monotonic()
    code = 0
    try:
        if policy == "batch":
            use_batch_scheduling()
        inner = link.open(s)
        if local_cache:
            c = np.frombuffer(counters_raw, dtype=np.int64)[wid * NF:(wid + 1) * NF]
            inner = LocalCache(inner, local_cache, c)
        submit: Optional[mcts.SubmitBatch] = None
        if s.pipeline > 1:
            if not isinstance(link, PipelinedLink):
                raise TypeError(f"--pipeline needs the shmeval mode, not {type(link).__name__}")
            submit = link.open_submit(s)
        p, v = inner(probe_states())
        info: Dict[str, Any] = {"pid": os.getpid(), "tensorflow": "tensorflow" in sys.modules,
                                "startup_s": time.monotonic() - t0,
                                "sched": ("batch" if os.sched_getscheduler(0) == os.SCHED_BATCH
                                          else "normal")}
        if wid == 0:
            info["probe"] = {"policy": np.asarray(p, np.float64).round(6).tolist(),
                             "value": np.asarray(v, np.float64).reshape(-1).round(6).tolist()}
        flags = np.frombuffer(flags_raw, dtype=np.int64)
        out_q.put(("ready", wid, info))
        while not go.wait(0.1):
            pass
        if not flags[STOP]:
            with contextlib.suppress(_Stopped):
                _play(wid, s, inner, counters_raw, flags, out_q, submit)
        out_q.put(("done", wid, {"tensorflow": "tensorflow" in sys.modules}))
    except BaseException:
        code = 1
        with contextlib.suppress(Exception):
            out_q.put(("error", wid, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            out_q.close()
            out_q.join_thread()
    if "tensorflow" in sys.modules:
        # Tearing TensorFlow down takes seconds of CPU; nothing is left to save.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)


def _play(wid: int, s: Settings, inner: EvaluateBatch, counters_raw: Any, flags: np.ndarray,
          out_q: Any, submit: Optional[mcts.SubmitBatch] = None) -> None:
    """Plays ``games_per_worker`` games at a time, starting a new game each
    time one ends, until the stop flag is set (raises _Stopped).  With
    ``s.pipeline`` K > 1, K groups of them, through ``submit``: while one
    group is searched, the leaves of the others are evaluated
    (:func:`shmeval.mcts.run_pipelined`)."""
    c = np.frombuffer(counters_raw, dtype=np.int64)[wid * NF:(wid + 1) * NF]
    perf_ns, cpu_ns = time.perf_counter_ns, time.process_time_ns

    def evaluate_batch(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        if flags[STOP]:
            raise _Stopped
        w0, c0 = perf_ns(), cpu_ns()
        out = inner(x)
        c[EVAL_CPU_NS] += cpu_ns() - c0
        c[EVAL_WALL_NS] += perf_ns() - w0
        c[EVALS] += len(x)
        c[CALLS] += 1
        return out

    def submit_batch(x: np.ndarray) -> Callable[[], Tuple[Any, Any]]:
        if flags[STOP]:
            raise _Stopped
        assert submit is not None
        w0, c0 = perf_ns(), cpu_ns()
        collect = submit(x)
        c[EVAL_CPU_NS] += cpu_ns() - c0
        c[EVAL_WALL_NS] += perf_ns() - w0
        c[EVALS] += len(x)
        c[CALLS] += 1

        def timed_collect() -> Tuple[Any, Any]:
            w0, c0 = perf_ns(), cpu_ns()
            out = collect()
            c[EVAL_CPU_NS] += cpu_ns() - c0
            c[EVAL_WALL_NS] += perf_ns() - w0
            return out

        return timed_collect

    rng = np.random.default_rng([s.seed, 7, wid])
    G = s.games_per_worker

    def group() -> mcts.Steps[None]:
        """G games, played until the stop flag is set, as search steps."""
        search = mcts.MCTS(connect4, evaluate_batch, c_puct=s.c_puct,
                           dirichlet_alpha=s.dirichlet_alpha,
                           dirichlet_fraction=s.dirichlet_fraction)
        trees = [search.new_tree(connect4.initial()) for _ in range(G)]
        moves: List[List[int]] = [[] for _ in range(G)]
        policies: List[List[np.ndarray]] = [[] for _ in range(G)]
        while not flags[STOP]:
            counts = yield from search.search_steps(trees, s.simulations, rng, noise=True)
            for j, t in enumerate(trees):
                cj = counts[j]
                temp = 1.0 if len(moves[j]) < s.temperature_moves else 0.0
                a = mcts.select_move(cj, temp, rng)
                policies[j].append((cj / cj.sum()).astype(np.float32))
                moves[j].append(a)
                t.advance(connect4, a)
                if t.term[t.root] is not None:
                    out_q.put(("game", wid, moves[j], np.stack(policies[j])))
                    c[GAMES] += 1
                    trees[j] = search.new_tree(connect4.initial())
                    moves[j], policies[j] = [], []
            c[MOVES] += G

    if s.pipeline == 1:
        mcts.drive(group(), evaluate_batch)
    else:
        mcts.run_pipelined([group() for _ in range(s.pipeline)], submit_batch)
