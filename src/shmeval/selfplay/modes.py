"""The modes: how the workers reach the net.  One class per mode says what
runs besides the workers, what each worker is given to reach the net (a
picklable link whose ``open`` runs in the worker), and the evaluator's
side of the figures; :class:`shmeval.selfplay.mode_run.ModeRun` does the
rest, the same for every mode.

``shmeval``
    one evaluator process (:meth:`shmeval.Evaluator.spawn`, the net wrapped in
    :class:`shmeval.backends.tensorflow.TFModel`); each search step of a
    worker is one ``evaluate_many`` round trip through shared memory.  The
    workers never import TensorFlow.
``queue``
    one TensorFlow evaluator process behind a ``multiprocessing.Queue``
    (:mod:`shmeval.selfplay.queue_evaluator`).
``local``
    every worker builds its own copy of the net (same weights) and calls it
    one state at a time (a ``FrozenGraph`` of it, or with ``--no-freeze`` a
    pre-traced concrete function; one TensorFlow thread per worker).
``local-batched``
    as ``local``, but the worker evaluates its whole leaf batch in one call.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

import numpy as np

from .. import mcts
from .._util.children import start_process
from .._util.simdevice import SimLink
from ..evaluator import Evaluator
from ..games import connect4
from .errors import WorkerError
from .net import OUTPUTS, EvaluateBatch, evaluator_model, local_net
from .pinning import cpu_split
from .queue_evaluator import (N_COUNTERS, Q_BATCHES, Q_BUSY_NS, Q_MODEL_NS, Q_REQUESTS, Q_ROWS,
                              QueueLink, queue_evaluator_main)
from .settings import CacheSetting, Settings
from .worker import NetLink

Snapshot = Dict[str, Any]


def _rate(hits: float, misses: float) -> float:
    return hits / (hits + misses) if hits + misses else 0.0


def _per(a: Snapshot, b: Snapshot, rows: str, calls: str) -> Optional[float]:
    """Rows per call between two snapshots (None without a call)."""
    n = b[calls] - a[calls]
    return (b[rows] - a[rows]) / n if n else None


class Mode:
    """A way for the workers to reach the net.  The defaults are those of a
    mode with no process besides the workers."""

    name = ""
    #: One evaluator process serves every worker: ``--pin`` gives it a CPU
    #: of its own, and its TensorFlow threads are recorded.
    central = False
    #: The net is called with batches of rows, not one row at a time.
    batched = True
    #: The evaluator has a cache shared by every worker (``--cache``); the
    #: other modes' only cache is one in each worker (``--local-cache``).
    #: The queue evaluator has none: a table there would save rows of the
    #: net but not a hit's round trip through the queues.
    shared_cache = False

    def __init__(self, s: Settings) -> None:
        self.s = s
        #: The evaluator process, whose CPU time and memory are measured.
        self.evaluator_pid: Optional[int] = None
        #: The simulated GPU every net call of the run goes through (set by
        #: the run before :meth:`start` under ``--device sim``), or None.
        self.sim: Optional[SimLink] = None

    def starting(self) -> str:
        """What the status line says while the mode starts."""
        raise NotImplementedError

    def start(self, ctx: Any, cpus: Optional[set[int]]) -> List[NetLink]:
        """Starts what runs besides the workers (on ``cpus`` when given);
        returns each worker's link to the net."""
        raise NotImplementedError

    def mean_batch(self, a: Snapshot, b: Snapshot) -> Optional[float]:
        """Rows per call of the net between two snapshots."""
        raise NotImplementedError

    def wait_ready(self, while_waiting: Callable[[], None]) -> None:
        """Once the workers are starting: waits until the evaluator serves,
        calling ``while_waiting`` every tenth of a second."""

    def check_alive(self) -> None:
        """Raises WorkerError when the evaluator is gone."""

    def snapshot(self) -> Snapshot:
        """The evaluator's counters now."""
        return {}

    def status(self, snap: Snapshot) -> str:
        """What the live status line adds for this mode."""
        return ""

    def tf_threads(self) -> Optional[int]:
        """TensorFlow threads of the central evaluator (None: none runs)."""
        return None

    def precision(self) -> str:
        """What the net computes in (:meth:`Settings.net_precision`)."""
        return self.s.net_precision(self.batched)

    def cache(self) -> CacheSetting:
        """The mode's one cache (:meth:`Settings.cache_of`)."""
        return self.s.cache_of(self.shared_cache)

    def result(self, d: Snapshot, dt: float) -> Dict[str, Any]:
        """What the mode's result adds, from the counters' change ``d``
        over the window of ``dt`` seconds."""
        return {}

    def weights_receiver(self) -> Any:
        """What the learner pushes its weights into."""
        raise WorkerError(f"--train needs the shmeval mode, not {self.name}")

    def arena_evaluator(self) -> Any:
        """The handle through which the arena's net evaluates (``--eval-every``)."""
        raise WorkerError(f"--eval-every needs the shmeval mode, not {self.name}")

    def stop(self, abort: bool) -> List[str]:
        """Stops the evaluator; returns the names of the processes it had to kill."""
        return []


class _CentralMode(Mode):
    """A mode with one evaluator process that batches for every worker."""

    central = True
    #: TensorFlow threads unless ``--evaluator-threads`` says otherwise (0:
    #: TensorFlow's default, one per CPU).
    default_tf_threads = 0

    def starting(self) -> str:
        return "the evaluator ..."

    def mean_batch(self, a: Snapshot, b: Snapshot) -> Optional[float]:
        return _per(a, b, "requests", "batches")

    def tf_threads(self) -> int:
        threads = self.s.evaluator_threads
        return self.default_tf_threads if threads is None else threads

    def result(self, d: Snapshot, dt: float) -> Dict[str, Any]:
        nb, rows = d["batches"], d["requests"]
        return {"evaluator": {
            "batches": nb, "rows": rows,
            "model_busy_share": d["model_s"] / dt,
            "model_ms_per_batch": 1e3 * d["model_s"] / nb if nb else None,
            "model_us_per_row": 1e6 * d["model_s"] / rows if rows else None,
            "outside_model_us_per_batch": 1e6 * d["overhead_s"] / nb if nb else None,
        }}


@dataclass
class ShmevalLink:
    """A worker's handle on the shmeval evaluator."""

    evaluator: Evaluator

    def open(self, s: Settings) -> EvaluateBatch:
        return mcts.evaluator_fn(self.evaluator)

    def open_submit(self, s: Settings) -> mcts.SubmitBatch:
        """The pipelined search's way (``--pipeline``): ``Client.submit``."""
        return mcts.submitter_fn(self.evaluator)


class ShmevalMode(_CentralMode):
    """One ``Evaluator.spawn`` process; each search step of a worker is one
    ``evaluate_many`` round trip through shared memory."""

    name = "shmeval"
    shared_cache = True

    def tf_threads(self) -> int:
        """``--evaluator-threads``, else the CPUs the evaluator may use (one
        with ``--pin``) split between the calls it keeps in flight: its
        calls already run side by side, and TensorFlow's pools for each
        would only make each call slower and costlier (docs/selfplay.md)."""
        if self.s.evaluator_threads is not None:
            return self.s.evaluator_threads
        pinned, _ = cpu_split(self.s.pin)
        cpus = len(pinned) if pinned else len(os.sched_getaffinity(0))
        return max(1, cpus // self.s.calls_in_flight())

    def __init__(self, s: Settings) -> None:
        super().__init__(s)
        self.ev: Optional[Evaluator] = None

    def spawn_args(self, cpus: Optional[set[int]]) -> Tuple[Callable[[], Any], Dict[str, Any]]:
        """The factory and keyword arguments of the evaluator's
        ``Evaluator.spawn`` (``--ray`` places the same on every node)."""
        s = self.s
        factory = functools.partial(evaluator_model, s.net, s.seed, self.tf_threads(), cpus,
                                    s.serving_threads, s.freeze, self.precision() == "bfloat16",
                                    self.sim)
        return factory, dict(input_shape=connect4.INPUT_SHAPE, outputs=OUTPUTS,
                             max_batch=s.max_batch, max_clients=max(64, s.workers + 8),
                             slots_per_client=min(64, max(16, s.pipeline * s.games_per_worker)),
                             serving_threads=s.serving_threads, cache_entries=s.cache,
                             # A death ends the run: its figures are one
                             # process's, not a restart's.
                             restarts=0)

    def start(self, ctx: Any, cpus: Optional[set[int]]) -> List[NetLink]:
        factory, kwargs = self.spawn_args(cpus)
        self.ev = Evaluator.spawn(factory, **kwargs)
        self.evaluator_pid = self.ev.pid
        return [ShmevalLink(self.ev)] * self.s.workers

    def _stats(self) -> Dict[str, Any]:
        assert self.ev is not None
        return self.ev.stats()

    def check_alive(self) -> None:
        if self.ev is not None and self._stats()["state"] not in ("serving", "starting"):
            st = self._stats()
            raise WorkerError(f"the shmeval evaluator is no longer serving ({st['state']}: "
                              f"{st['stopped_because']})")

    def snapshot(self) -> Snapshot:
        st = self._stats()
        snap = {"requests": int(st["requests"]), "batches": int(st["batches"]),
                "model_s": float(st["model_time_share"]) * float(st["uptime_s"]),
                "overhead_s": float(st["overhead_us_per_batch"]) * int(st["batches"]) / 1e6,
                "model_version": int(st["model_version"])}
        if st["cache"] is not None:
            snap.update(cache_hits=st["cache"]["hits"], cache_misses=st["cache"]["misses"],
                        cache_held=st["cache"]["held"])
        return snap

    def status(self, snap: Snapshot) -> str:
        text = f"  model v{snap.get('model_version', 0)}"
        if "cache_hits" in snap:
            text += f"  cache {_rate(snap['cache_hits'], snap['cache_misses']):.0%} hits"
        return text

    def result(self, d: Snapshot, dt: float) -> Dict[str, Any]:
        out = {**super().result(d, dt), "model_version": int(self._stats()["model_version"])}
        if "cache_hits" in d:
            out["cache"] = {"entries": self.s.cache, "hits": d["cache_hits"],
                            "misses": d["cache_misses"],
                            "hit_rate": _rate(d["cache_hits"], d["cache_misses"])}
        return out

    def weights_receiver(self) -> Any:
        return self.ev

    def arena_evaluator(self) -> Any:
        return self.ev

    def stop(self, abort: bool) -> List[str]:
        if self.ev is not None:
            self.ev.close(timeout=1.0 if abort else 10.0)
            self.ev = None
        return []


class QueueMode(_CentralMode):
    """One TensorFlow evaluator process behind a ``multiprocessing.Queue``
    (:mod:`shmeval.selfplay.queue_evaluator`)."""

    name = "queue"
    # Its one evaluator thread needs TensorFlow's pool to use both cores
    # (with 16 games per worker the default pools give it 3-5% more).
    default_tf_threads = 0

    def __init__(self, s: Settings) -> None:
        super().__init__(s)
        self.server: Any = None

    def start(self, ctx: Any, cpus: Optional[set[int]]) -> List[NetLink]:
        self.requests = ctx.Queue()
        self.responses = [ctx.SimpleQueue() for _ in range(self.s.workers)]
        self.counters = ctx.RawArray("q", N_COUNTERS)
        self.conn, child_end = ctx.Pipe()
        self.server = start_process(
            ctx, queue_evaluator_main, "selfplay-queue-evaluator",
            (self.s, self.tf_threads(), self.requests, self.responses, self.counters, child_end,
             cpus, self.sim))
        child_end.close()
        return [QueueLink(i, self.requests, r) for i, r in enumerate(self.responses)]

    def wait_ready(self, while_waiting: Callable[[], None]) -> None:
        while not self.conn.poll(0.1):
            if not self.server.is_alive():
                raise WorkerError(f"the queue evaluator exited with code "
                                  f"{self.server.exitcode} during start-up")
            while_waiting()
        kind, detail = self.conn.recv()
        if kind != "ready":
            raise WorkerError(f"the queue evaluator failed to start:\n{detail}")
        self.evaluator_pid = int(detail)

    def check_alive(self) -> None:
        if self.server is not None and not self.server.is_alive():
            raise WorkerError(f"the queue evaluator exited with code {self.server.exitcode}")

    def snapshot(self) -> Snapshot:
        q = np.frombuffer(self.counters, dtype=np.int64)
        return {"requests": int(q[Q_ROWS]), "batches": int(q[Q_BATCHES]),
                "messages": int(q[Q_REQUESTS]), "model_s": q[Q_MODEL_NS] / 1e9,
                "overhead_s": (q[Q_BUSY_NS] - q[Q_MODEL_NS]) / 1e9}

    def result(self, d: Snapshot, dt: float) -> Dict[str, Any]:
        r = super().result(d, dt)
        r["evaluator"]["messages"] = d["messages"]
        return r

    def stop(self, abort: bool) -> List[str]:
        killed: List[str] = []
        server = self.server
        if server is None:
            return killed
        self.evaluator_pid = None
        with contextlib.suppress(Exception):
            self.requests.put(None)
        server.join(1.0 if abort else 5.0)
        if server.is_alive():
            killed.append(server.name)
            server.terminate()
            server.join(1.0)
            if server.is_alive():
                server.kill()
                server.join(1.0)
        self.requests.cancel_join_thread()
        self.requests.close()
        for r in self.responses:
            r.close()
        self.conn.close()
        self.server = None
        return killed


@dataclass
class LocalLink:
    """A local worker builds its own net: one row per call, or its whole
    leaf batch per call when ``batched``; behind the simulated GPU ``sim``
    when there is one."""

    batched: bool
    sim: Optional[SimLink] = None

    def open(self, s: Settings) -> EvaluateBatch:
        return local_net(s, self.batched, self.sim)


class LocalMode(Mode):
    """Every worker runs its own copy of the net, one state per call."""

    name = "local"
    batched = False

    def starting(self) -> str:
        return f"{self.s.workers} workers, each with its own TensorFlow ..."

    def start(self, ctx: Any, cpus: Optional[set[int]]) -> List[NetLink]:
        return [LocalLink(self.batched, self.sim)] * self.s.workers

    def mean_batch(self, a: Snapshot, b: Snapshot) -> Optional[float]:
        return 1.0


class LocalBatchedMode(LocalMode):
    """Every worker runs its own copy of the net on its whole leaf batch."""

    name = "local-batched"
    batched = True

    def mean_batch(self, a: Snapshot, b: Snapshot) -> Optional[float]:
        return _per(a, b, "evals", "calls")


MODE_CLASSES: Dict[str, Type[Mode]] = {
    m.name: m for m in (ShmevalMode, QueueMode, LocalMode, LocalBatchedMode)}
