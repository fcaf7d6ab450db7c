"""The evaluator: the serving loop and the public ``Evaluator`` class.

Serving loop: collect (C, GIL released) -> pad to a bucket -> model ->
check and cast outputs into the preallocated result rows -> scatter and wake
(C, GIL released).  Between batches, and whenever it is idle for 100 ms, it
reclaims the client entries of dead or detached processes.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import operator
import os
import pickle
import signal
import threading
import time
import typing
import warnings
import weakref
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from . import _ring, segment
from ._main_script import unreachable_reason
from .backends._device import share_gpus
from .checks import AUTO, as_number, check_auto
from .client import Client
from .errors import (EvaluatorDied, ModelError, NotTheMainProcess, ShmevalError, ShmevalTimeout,
                     exception_text)
from .restarts import DEFAULT_RESTARTS, Healer, Restart, WeightsUpdate, check_restarts
from .spec import OutputsLike, ShapeLike, Spec
from .tuning import Board, Overrides, ServingTuner, model_concurrency
from .waiting import check_spin_auto, check_spin_us
from .weights import plain_weights

Model = Callable[[np.ndarray], Any]
Buckets = Union[None, str, Sequence[int]]

#: The serving loop wakes at least this often to reclaim dead clients.
IDLE_TIMEOUT_NS = 100_000_000
#: And checks client liveness at most this often while busy.
HOUSEKEEPING_NS = 200_000_000
#: A control request announced in the segment (the owner bumps its ticket
#: just before it sends the message) is looked for in the pipe this often,
#: between batches, for at most CONTROL_WAIT_NS.
CONTROL_POLL_NS = 1_000_000
CONTROL_WAIT_NS = 1_000_000_000
#: Most serving threads (model calls in flight at once) one replica runs.
MAX_SERVING_THREADS = 8
#: Most model replicas behind one address (ring.h SHM_MAX_REPLICAS).
MAX_REPLICAS = 64
#: How long the serving loop waits for its other threads when it stops.
THREAD_JOIN_S = 10.0
#: How often set_weights looks whether a restarted replica serves, when
#: every one died before it applied an update.
RESTART_POLL_S = 0.05
#: The exit code of a replica process that ends itself because a serving
#: thread did not return within THREAD_JOIN_S (_ServingLoop.leave).
EXIT_STUCK = 70
#: Serving threads started with serving_threads="auto": the tuner keeps one
#: or two model calls in flight (a second overlaps one batch's gathering
#: and answering with another's computation).
AUTO_SERVING_THREADS = 2
#: A batch whose model call raises is split to find the rows that raise
#: (_ServingLoop.isolate): at most this many extra model calls per batch
#: (enough to find one bad row in 65536, or a few in a full batch); rows
#: still undecided then fail with the error of the part that held them.
ISOLATE_CALLS = 32
#: After this many failed batches in a row where no row could be answered
#: (a model that raises on everything), batches that raise fail whole,
#: without extra calls, for ISOLATE_PAUSE_NS; the next failure after that
#: is isolated again.
ISOLATE_GIVE_UP = 3
ISOLATE_PAUSE_NS = 1_000_000_000


@dataclass(frozen=True)
class BatchPolicy:
    """How the evaluator forms batches.

    ``max_wait_us``: after the first request, wait up to that long for a
    fuller batch (0: greedy, take every ready request up to ``max_batch``
    the moment the model is free).  ``buckets`` pads each batch up to the
    next bucket size (spare rows of the batch buffer, no extra copy) for
    models that want few distinct shapes.  ``spin_us``: the idle
    evaluator's spin budget.  ``threads``: serving threads (model calls in
    flight).  ``"auto"`` (the Evaluator's default of the three) leaves a
    setting to the tuner (:mod:`shmeval.tuning`); with ``threads="auto"``,
    ``threads`` is AUTO_SERVING_THREADS and ``auto_threads`` is set.
    """

    max_batch: int
    max_wait_us: Union[float, str] = 0.0
    buckets: Optional[tuple[int, ...]] = None
    spin_us: Union[float, str] = 50.0
    threads: int = 1
    auto_threads: bool = False

    @classmethod
    def make(cls, max_batch: int, max_wait_us: Union[float, str] = 0.0,
             buckets: Buckets = None, spin_us: Union[float, str] = 50.0,
             threads: Union[int, str] = 1) -> "BatchPolicy":
        max_wait_us = check_auto("max_wait_us", max_wait_us, _check_wait)
        spin_us = check_auto("evaluator_spin_us", spin_us, check_spin_us)
        auto_threads = threads == AUTO
        if auto_threads:
            threads = AUTO_SERVING_THREADS
        elif type(threads) is not int or not 1 <= threads <= MAX_SERVING_THREADS:
            raise ValueError(f"serving_threads must be 'auto' or an int from 1 to "
                             f"{MAX_SERVING_THREADS}, got {threads!r}")
        assert isinstance(threads, int)
        b: Optional[tuple[int, ...]]
        if buckets is None:
            b = None
        elif isinstance(buckets, str):
            if buckets != "pow2":
                raise ValueError(f"buckets must be None, 'pow2' or a list of ints, got {buckets!r}")
            b = tuple(sorted({1 << i for i in range(max_batch.bit_length())
                              if 1 << i < max_batch} | {max_batch}))
        else:
            try:
                b = tuple(sorted({int(x) for x in buckets}))
            except (TypeError, ValueError):
                raise TypeError(f"buckets must be a list of ints, got {buckets!r}") from None
            if not b or b[0] < 1:
                raise ValueError(f"buckets must be positive ints, got {buckets!r}")
            if b[-1] < max_batch:
                raise ValueError(f"the largest bucket ({b[-1]}) must be >= max_batch "
                                 f"({max_batch})")
        return cls(max_batch, max_wait_us, b, spin_us, threads, auto_threads)

    @property
    def rows(self) -> int:
        """Rows of the batch buffer."""
        return max(self.max_batch, self.buckets[-1]) if self.buckets else self.max_batch

    @property
    def tuned(self) -> bool:
        """Whether the tuner sets anything."""
        return AUTO in (self.max_wait_us, self.spin_us) or self.auto_threads

    def overrides(self) -> Overrides:
        """The settings the caller fixed, for the tuner."""
        return Overrides(
            None if self.max_wait_us == AUTO else int(float(self.max_wait_us) * 1000),
            None if self.spin_us == AUTO else int(float(self.spin_us) * 1000),
            None if self.auto_threads else self.threads)


def _check_wait(name: str, us: float) -> float:
    if not us >= 0:
        raise ValueError(f"{name} must be 'auto' or >= 0, got {us}")
    return us



def _prepare(model: Model, spec: Spec, policy: BatchPolicy) -> BatchPolicy:
    """Calls the model's optional ``prepare(spec, buckets)`` hook (build,
    check the outputs against the spec, warm up every batch size): errors
    surface at start-up, not at the first request.  The hook may return the
    bucket sizes it wants batches padded to, when the evaluator has none."""
    hook = getattr(model, "prepare", None)
    if hook is None:
        return policy
    try:
        wanted = hook(spec, policy.buckets)
    except ModelError:
        raise
    except Exception as e:
        raise ModelError(f"the model failed to prepare: {type(e).__name__}: {e}") from e
    if wanted is None or policy.buckets is not None:
        return policy
    try:
        b = tuple(sorted({int(x) for x in wanted}))
    except (TypeError, ValueError):
        raise ModelError(f"prepare() returned {wanted!r}, not a list of batch sizes") from None
    if not b or b[0] < 1 or b[-1] < policy.max_batch:
        raise ModelError(f"prepare() returned buckets {b}: they must be positive and the "
                         f"largest must be >= max_batch ({policy.max_batch})")
    return replace(policy, buckets=b)


def _fit_threads(model: Model, policy: BatchPolicy) -> BatchPolicy:
    """serving_threads="auto" serves a model whose calls may not overlap
    (tuning.model_concurrency) from one thread (a thread evaluator knows
    its model before it allocates its servers; an evaluator process keeps
    the second one parked)."""
    if policy.auto_threads and model_concurrency(model) < 2:
        return replace(policy, threads=1)
    return policy


class _ServingLoop:
    """Serves the segment for one model replica from policy.threads threads:
    each runs Server.serve() with its own batch buffer; they take turns
    collecting (the ServeGroup's lock, and with several replicas the
    segment's collect lock, shared with the other replicas' threads) and
    overlap their model calls, so that with a model that releases the GIL
    (TensorFlow does) one batch is computed while the next is gathered and
    computed on another core.  Whichever thread holds the lock with no batch
    in flight does the rest: housekeeping (which also finds other replicas
    that died and puts their batches back), weight updates, stopping."""

    def __init__(self, seg: "_ring.Segment", spec: Spec, model: Model, policy: BatchPolicy,
                 reject_nonfinite: bool, control: Any = None, replica: int = 0,
                 device: str = "") -> None:
        self.seg = seg
        self.spec = spec
        self.model = model
        self.policy = policy
        self.control = control  # our end of the owner's control pipe
        self.reject_nonfinite = reject_nonfinite
        self.replica = replica
        self.device = device
        self.group = _ring.ServeGroup()
        # Each server's batch buffer; isolate() reads a failed batch there.
        self.batches = [np.zeros((policy.rows,) + spec.input_shape, spec.input_dtype)
                        for _ in range(policy.threads)]
        self.servers = [_ring.Server(seg, batch, self.group, replica * policy.threads + i,
                                     replica)
                        for i, batch in enumerate(self.batches)]
        # Row isolation (isolate()): failed batches in a row where no row
        # could be answered, and until when isolating is paused.
        self.hopeless = 0
        self.isolate_paused_until = 0
        self.version = 0
        self.housekeeping_at = 0
        self.control_until = 0  # a control message is announced but not here yet
        self.owner, self.owner_starttime = seg.owner_pid, seg.owner_starttime
        self.pid_ns = segment.namespaces().pid
        self.stop_reason = _ring.STOP_CLOSED  # why serving stops, unless it raises
        self.warned_extra = False  # about outputs the spec does not declare
        self.errors: list[BaseException] = []
        # Client entries seen with no start time: (entry, pid) -> when first
        # seen, in clock ticks since boot (reclaim_dead_clients).
        self.unstamped: dict[tuple[int, int], int] = {}
        # The "auto" settings' tuner; it reads the calls the servers record.
        self.tuner = (ServingTuner(seg, model, self.servers, policy.max_batch, policy.threads,
                                   policy.overrides(), Board(seg, replica), HOUSEKEEPING_NS,
                                   _ring.SPIN_YIELD)
                      if policy.tuned else None)

    def run(self, started: Optional[Callable[[], None]] = None) -> None:
        """Serves until closed; calls ``started()`` once this replica
        serves (its entry says so: a restart counts as done then)."""
        seg = self.seg
        me = os.getpid()
        _ring.set_timer_slack_ns(1000)  # this thread's max_wait_us sleeps stay precise
        seg.set_serving(self.replica, me, segment.process_starttime(me) or 0, self.device)
        self.housekeeping_at = _ring.now_ns() + HOUSEKEEPING_NS
        others = [threading.Thread(target=self.serve_guarded, args=(server,), daemon=True,
                                   name=f"{threading.current_thread().name} #{i + 1}")
                  for i, server in enumerate(self.servers[1:])]
        for t in others:
            t.start()
        if started is not None:
            started()
        try:
            self.serve(self.servers[0])
        except BaseException:
            self.stop_reason = _ring.STOP_CRASHED
            raise
        finally:
            self.group.stop = True
            if self.tuner is not None:
                self.tuner.release()
            for t in others:
                t.join(THREAD_JOIN_S)
            if self.errors:
                self.stop_reason = _ring.STOP_CRASHED
            self.leave(joined=not any(t.is_alive() for t in others))
        if self.errors:
            raise self.errors[0]

    def leave(self, joined: bool) -> None:
        """This replica stops serving.  The last replica out closes the
        evaluator for its clients, waking every waiter (the requests of a
        batch it held when it crashed, too: they raise EvaluatorDied saying
        why).  While others serve, what its batch tables still hold (a batch
        it crashed with) is put back by one of them once this process is
        gone (check_replicas): nothing of it can write into those slots any
        more then.

        A replica whose serving thread did not return within THREAD_JOIN_S
        (stuck in a model call) ends its process at once when others serve,
        rather than leave a thread that could still complete a batch the
        others had taken again (each replica has a process of its own)."""
        if not joined and self.seg.replicas_serving() > 1:
            os._exit(EXIT_STUCK)
        if self.seg.replica_stop(self.replica, "stopped") == 0 and not self.restarted():
            self.seg.close_and_wake(self.stop_reason)

    def restarted(self) -> bool:
        """Whether the owner will start this crashed replica again
        (Evaluator.spawn(restarts=)): then the last one out leaves the
        evaluator open, its batches to be put back by the next process."""
        return (self.stop_reason == _ring.STOP_CRASHED and self.seg.restarts_left() > 0
                and self.owner != os.getpid() and segment.is_alive(self.owner))

    def serve_guarded(self, server: "_ring.Server") -> None:
        """serve() in one of the other threads: an error there stops this
        replica's threads, and run() re-raises it.  Only this replica: the
        evaluator stays open for the others (a thread asleep in collect sees
        the stop within IDLE_TIMEOUT_NS)."""
        try:
            self.serve(server)
        except BaseException as e:
            self.errors.append(e)
            self.group.stop = True

    def serve(self, server: "_ring.Server") -> None:
        pol, group, tuner = self.policy, self.group, self.tuner
        model, max_batch = self.model, pol.max_batch
        spin_ns = wait_ns = 0
        if tuner is None:
            spin_ns = int(float(pol.spin_us) * 1000)
            wait_ns = int(float(pol.max_wait_us) * 1000)
        buckets = list(pol.buckets) if pol.buckets else None
        index = self.servers.index(server)
        me = os.getpid()
        while True:
            if tuner is not None:
                # The tuner's settings of this period; a thread it does not
                # use waits here.
                if not tuner.wait_turn(index, IDLE_TIMEOUT_NS / 1e9):
                    if group.stop:
                        return
                    continue
                d = tuner.decision
                max_batch = d.batch_cap
                spin_ns, wait_ns = d.spin_ns, d.max_wait_ns
            until = self.housekeeping_at
            if self.control_until:
                until = min(until, _ring.now_ns() + CONTROL_POLL_NS)
            # Batches are served in C until something needs Python.
            kind, n, rows, detail, model_ns = server.serve(
                model, max_batch, spin_ns, wait_ns, IDLE_TIMEOUT_NS,
                self.reject_nonfinite, buckets, until)
            if kind == _ring.SERVE_SLOW:
                self.finish_slow(server, detail, n, rows, model_ns)
                continue
            if kind == _ring.SERVE_RAISED:
                self.finish_failed(server, detail, n, rows, model_ns)
                continue
            # IDLE, CONTROL, CLOSED, LOCKED_OUT, BEHIND: we hold our group's
            # lock; once the other threads' batches are answered, nothing of
            # this replica is in flight.
            try:
                server.end_busy()
                quiet = group.quiesce()
                if kind == _ring.SERVE_CLOSED or not quiet:
                    # Closing, or stopping with batches still in flight:
                    # nothing that needs quiet (reclaiming, weight updates)
                    # may happen now.
                    group.stop = True
                    return
                if kind == _ring.SERVE_CONTROL:
                    self.handle_control()
                    continue
                if kind == _ring.SERVE_BEHIND:
                    # Until the update comes, or until no replica that took
                    # it is left (marked here: then the floor comes down).
                    self.catch_up()
                    self.check_replicas(None)
                    if self.owner_gone(me):
                        return
                    continue
                if kind == _ring.SERVE_LOCKED_OUT:
                    # Another replica holds the collect lock: fine, unless it
                    # died holding it.  Then take it over (which puts the
                    # dead one's batches back) and keep house.
                    self.check_replicas(None)
                    if not server.take_over_lock(detail):
                        # Locked out for a while (the others took every
                        # turn): a weight update must still be applied.
                        self.poll_control(_ring.now_ns())
                        continue
                if detail is True and self.tuner is not None:
                    self.tuner.paused = True
                now = _ring.now_ns()
                self.poll_control(now)
                if self.control_until and now < self.housekeeping_at and \
                        kind == _ring.SERVE_IDLE:
                    continue  # only a look at the control pipe was due
                # Housekeeping: idle, or due while busy (with the collect
                # lock, so no scan runs while entries are reclaimed).
                self.housekeeping_at = now + HOUSEKEEPING_NS
                self.reclaim_dead_clients()
                self.check_replicas(server)
                if self.tuner is not None:
                    self.tuner.tick(now)
                if self.owner_gone(me):
                    return
            finally:
                server.unlock()

    def owner_gone(self, me: int) -> bool:
        """True (and the group stopping) when the process that created the
        evaluator died: nobody else will close or unlink it."""
        if self.owner == me or segment.is_alive(self.owner, self.owner_starttime):
            return False
        self.stop_reason = _ring.STOP_OWNER_DIED
        segment.unlink(self.seg.name)
        self.group.stop = True
        return True

    def check_replicas(self, holder: Optional["_ring.Server"]) -> None:
        """Finds the other replicas whose process is gone: each is marked
        dead, once.  Given the server that holds the collect lock (the
        housekeeping's: no scan runs), also puts back the batches of every
        replica that is gone, dead or stopped (Server.requeue_replica; a
        replica already put back has empty tables).  Without the lock it
        only marks: a replica that died holding the lock may have listed a
        request it had not yet taken, which another's scan could take
        meanwhile, and only a put-back before any scan tells the two apart
        (take_over_lock does it)."""
        seg = self.seg
        for rep in seg.replicas():
            r = rep["replica"]
            if r == self.replica or rep["state"] not in ("serving", "stopped", "dead"):
                continue
            if rep["state"] != "dead" and segment.is_alive(rep["pid"], rep["starttime"]):
                continue
            if rep["state"] == "serving":
                # Named by the process judged: one restarted meanwhile serves.
                seg.replica_stop(r, "dead", rep["pid"])
            if holder is not None:
                holder.requeue_replica(r)
    def catch_up(self) -> None:
        """Another replica collects with newer weights than this one: wait,
        between batches, for this replica's copy of the update, which the
        owner sends to every replica."""
        if self.control is not None and self.control.poll(0.1):
            self.handle_control()

    def poll_control(self, now: int) -> None:
        """Between batches: applies a control message that came after its
        announcement (or one whose announcement was missed), and stops
        looking for an announced one after CONTROL_WAIT_NS."""
        if self.control is not None and self.control.poll():
            self.handle_control()
        elif self.control_until and now >= self.control_until:
            self.control_until = 0

    def handle_control(self) -> None:
        """Applies the owner's pending control requests (weight updates),
        between batches: requests in flight are answered by the model as it
        was before or after an update, never during one.  Messages are
        (ticket, method, argument, version); each gets a reply
        (ticket, True, version) or (ticket, False, error text).

        The owner bumps the ticket in the segment just before it sends, so
        a message may not be here yet.  It is not waited for: the serving
        loop looks again every CONTROL_POLL_NS between batches, for up to
        CONTROL_WAIT_NS (poll_control).  Any process of the user can bump
        the ticket; one with no message behind it costs a few polls of the
        pipe, never a stall of the serving loop."""
        seg, conn = self.seg, self.control
        req, done = seg.control_pending(self.replica)
        while conn is not None:
            try:
                if not conn.poll(0):
                    break
                ticket, method, arg, version = conn.recv()
            except (EOFError, OSError):  # the owner is gone
                self.control = conn = None
                break
            reply = (ticket,) + self.apply(method, arg, version)
            try:
                conn.send(reply)
            except OSError:
                self.control = conn = None
            done = ticket
            req, _ = seg.control_pending(self.replica)
        waiting = conn is not None and (req - done) % 2**32 != 0
        self.control_until = _ring.now_ns() + CONTROL_WAIT_NS if waiting else 0
        # Whatever happened, the loop must not come straight back here.
        seg.control_done(self.replica, req)

    def resume(self, restart: Restart) -> None:
        """A restarted replica takes up where its dead process left off,
        before it serves: the weights serving now, applied as any update
        is, and the control requests made before counted as handled (the
        owner makes none while it restarts a replica)."""
        if restart.update is not None:
            u = restart.update
            ok, detail = self.apply(u.method, u.arg, u.version)
            if not ok:
                raise ModelError(detail)
        req, _ = self.seg.control_pending(self.replica)
        self.seg.control_done(self.replica, req)

    def apply(self, method: str, arg: Any, version: int) -> tuple[bool, Any]:
        if version <= self.version:
            return False, (f"model version {version} is not newer than the one serving "
                           f"({self.version})")
        fn = getattr(self.model, method, None)
        if not callable(fn):
            return False, (f"the model ({type(self.model).__name__}) has no {method}() method: "
                           "wrap a Keras model in shmeval.backends.tensorflow.TFModel, or "
                           f"give your model a {method}() method")
        try:
            fn(arg)
        except Exception as e:
            return False, f"{method} failed in the evaluator: {type(e).__name__}: {e}"
        self.version = version
        self.group.version = version
        self.seg.replica_version(self.replica, version)
        return True, version

    def finish_slow(self, server: "_ring.Server", out: Any, n: int, rows: int,
                    model_ns: int) -> None:
        """Outputs that finish_fast could not take as they are: convert them,
        or fail the batch with a message saying what is wrong (outputs that
        do not fit the spec are the model's fault, not a row's: the whole
        batch fails)."""
        try:
            arrays = self.check_outputs(out, n, rows)
        except Exception as e:
            server.record(n, rows, model_ns, True)
            server.fail(self.error_text(e))
            return
        # Statistics first: a client that sees its answer also sees them.
        server.record(n, rows, model_ns, False)
        self.answer(server, arrays, n, {})

    def finish_failed(self, server: "_ring.Server", e: Exception, n: int, rows: int,
                      model_ns: int) -> None:
        """The model raised for the batch: the rows that raise on their own
        get ModelError with the model's message, every other row is answered
        (isolate()).  A call of one row (no padding) fails at once, and so
        does every batch while isolating is paused: after ISOLATE_GIVE_UP
        failed batches in a row where no row could be answered, for
        ISOLATE_PAUSE_NS."""
        now = _ring.now_ns()
        if rows == 1 or now < self.isolate_paused_until:
            server.record(n, rows, model_ns, True)
            server.fail(self.error_text(e))
            return
        server.record(n, rows, model_ns, False)
        arrays, failed = self.isolate(server, e, n, rows)
        if len(failed) == n:
            self.seg.stat_inc("failed_batches", 1)
            self.hopeless += 1
            if self.hopeless >= ISOLATE_GIVE_UP:
                self.isolate_paused_until = now + ISOLATE_PAUSE_NS
        else:
            self.hopeless = 0
        self.answer(server, arrays, n, failed)

    def isolate(self, server: "_ring.Server", error: Exception, n: int,
                rows: int) -> tuple[list[np.ndarray], dict[int, str]]:
        """Finds the rows of a batch that make the model raise: each part of
        the batch that raised is split in two and the model called on each
        half, down to single rows, with at most ISOLATE_CALLS calls; a part
        left undecided then fails with the error of the call that held it.
        Runs in the serving thread that holds the batch (other threads keep
        serving meanwhile); the normal path never comes here.  Returns the
        outputs (n rows, zeros where a row failed) and {row: error text}
        of the rows that fail."""
        batch = self.batches[self.servers.index(server)]
        part = np.empty_like(batch)
        arrays = [np.zeros((n,) + o.shape, o.dtype) for o in self.spec.outputs]
        failed: dict[int, str] = {}
        # Parts [lo, hi) of the batch, with the error of the call that
        # raised for them (or for the part that held them), and whether
        # they raised on their own: a padded batch's call also held stale
        # rows of earlier batches, so it is tried again first.
        todo: list[tuple[int, int, Exception, bool]] = [(0, n, error, rows == n)]
        calls = isolated = 0
        while todo:
            lo, hi, err, tested = todo.pop()
            if not tested and calls < ISOLATE_CALLS:
                calls += 1
                try:
                    got = self.call_part(batch[lo:hi], part)
                except Exception as e:
                    todo.append((lo, hi, e, True))
                    continue
                for dst, src in zip(arrays, got):
                    dst[lo:hi] = src
            elif not tested or hi - lo == 1:  # out of calls, or a row that raises
                isolated += tested
                failed.update(dict.fromkeys(range(lo, hi), self.error_text(err)))
            else:
                mid = (lo + hi) // 2
                todo += [(mid, hi, err, False), (lo, mid, err, False)]
        self.seg.stat_inc("isolation_calls", calls)
        self.seg.stat_inc("isolated_rows", isolated)
        return arrays, failed

    def call_part(self, x: np.ndarray, part: np.ndarray) -> list[np.ndarray]:
        """The model's checked outputs for the rows x (isolate()): called
        on them in ``part``, padded to a bucket size with copies of x's
        first row, so that no other request's state (nor a stale one) is
        in the call."""
        m = len(x)
        b = next(s for s in self.policy.buckets if s >= m) if self.policy.buckets else m
        part[:m] = x
        part[m:b] = x[0]
        return [a[:m] for a in self.check_outputs(self.model(part[:b]), m, b)]

    def answer(self, server: "_ring.Server", arrays: list[np.ndarray], n: int,
               failed: dict[int, str]) -> None:
        """Answers the outstanding batch's n requests with the rows of
        ``arrays``, except the rows in ``failed`` ({row: error text}) and,
        with reject_nonfinite, those whose outputs hold NaN or inf: these
        get ModelError with their text (a NaN in one client's state must
        not fail the others batched with it)."""
        bad, name = self.nonfinite_rows(arrays, n)
        if bad.size:
            text = ModelError(f"model output {name!r} holds NaN or infinite values for this "
                              "request (pass reject_nonfinite=False to allow them)").message
            for r in bad.tolist():
                failed.setdefault(r, text)
        if failed:
            self.seg.stat_inc("failed_requests", len(failed))
            by_text: dict[str, list[int]] = {}
            for r in sorted(failed):
                by_text.setdefault(failed[r], []).append(r)
            left = np.arange(n)  # the batch rows still outstanding
            for text, failing in by_text.items():
                at = np.searchsorted(left, failing)
                server.fail_rows(at.tolist(), text)
                left = np.delete(left, at)
            if not left.size:
                return
            arrays = [a[left] for a in arrays]
        try:
            server.complete(arrays, self.version)
        except ValueError as e:  # a shape check_outputs let through: fail, keep serving
            server.fail(f"ModelError: {e}")

    def error_text(self, e: Exception) -> str:
        """A failed request's text for e: its type and message first, fitted
        to what a slot carries (exception_text)."""
        limit = self.seg.error_bytes
        text = e.message if isinstance(e, ModelError) else exception_text(e, limit)
        return (text if len(text.encode("utf-8", "replace")) <= limit
                else exception_text(e, limit))

    def check_outputs(self, out: Any, n: int, rows: int) -> list[np.ndarray]:
        """The model's outputs as C-contiguous arrays of the declared dtypes,
        in declaration order; ModelError when they do not fit the spec.

        The rules, the same for every model (TFModel applies them in the
        traced function): an output whose rows hold as many values as the
        declared shape is reshaped to it (a value head of shape (n, 1) for
        a declared scalar ``()``, say); a dtype is cast under 'same_kind'
        casting; a dict may hold more outputs than declared, which are
        dropped, with one warning."""
        spec = self.spec
        names = spec.output_names
        if isinstance(out, dict):
            missing = [k for k in names if k not in out]
            if missing:
                raise ModelError(f"model output lacks {missing}; it returned keys "
                                 f"{sorted(map(str, out))}, expected {list(names)}")
            if len(out) > len(names):
                self.warn_extra_outputs(sorted(str(k) for k in out if k not in names))
            given = [out[k] for k in names]
        elif isinstance(out, (tuple, list)):
            if len(out) != len(names):
                raise ModelError(f"model returned {len(out)} outputs, expected {len(names)} "
                                 f"({', '.join(names)})")
            given = list(out)
        elif len(names) == 1:
            given = [out]
        else:
            raise ModelError(f"model returned one {type(out).__name__}, expected a dict or "
                             f"tuple of {len(names)} outputs ({', '.join(names)})")
        arrays = []
        for o, arr in zip(spec.outputs, given):
            a = arr if type(arr) is np.ndarray else np.asarray(arr)
            if a.shape != (rows,) + o.shape:
                if a.ndim == 0 or a.shape[0] != rows or \
                        math.prod(a.shape[1:]) != math.prod(o.shape):
                    raise ModelError(
                        f"model output {o.name!r} has shape {a.shape}, expected "
                        f"{(rows,) + o.shape} for a batch of {rows} (or any shape "
                        f"(rows, ...) with {math.prod(o.shape)} values per row)")
                a = a.reshape((rows,) + o.shape)
            if a.dtype != o.dtype:
                if a.dtype.hasobject or not np.can_cast(a.dtype, o.dtype, "same_kind"):
                    raise ModelError(f"model output {o.name!r} has dtype {a.dtype}, which "
                                     f"cannot be cast to {o.dtype} under 'same_kind' casting")
                a = a.astype(o.dtype)
            elif not a.flags.c_contiguous:
                a = np.ascontiguousarray(a)
            arrays.append(a)
        return arrays

    def warn_extra_outputs(self, extra: list[str]) -> None:
        """Warns once that the model returns outputs the spec does not
        declare, then lets the fast path take such outputs as they are."""
        if not self.warned_extra:
            self.warned_extra = True
            warnings.warn(f"the model returns outputs {extra} that are not declared in "
                          f"outputs=; they are dropped (declare them to receive them)",
                          UserWarning, stacklevel=2)
        for server in self.servers:
            server.extra_outputs_ok = True

    def nonfinite_rows(self, arrays: list[np.ndarray], n: int) -> tuple[np.ndarray, str]:
        """Rows (< n) whose float outputs hold NaN or inf when those are
        rejected, and the name of the first output holding one."""
        bad = np.zeros(n, bool)
        name = ""
        if self.reject_nonfinite:
            for o, a in zip(self.spec.outputs, arrays):
                if o.dtype.kind in "fc" and _ring.all_finite(a, n) is not True:
                    rows_bad = ~np.isfinite(a[:n].reshape(n, -1)).all(axis=1)
                    if rows_bad.any() and not name:
                        name = o.name
                    bad |= rows_bad
        return np.flatnonzero(bad), name

    def reclaim_dead_clients(self) -> None:
        """Frees the entries of detached clients and of processes that are
        gone.  Only with no batch in flight (the core refuses an entry with a
        slot in a batch).  An entry recorded from another pid namespace is
        never judged by its pid, which means another process here: it is
        freed when it detaches (attach refuses such processes, so only one
        that bypassed it can have one)."""
        unstamped = {}
        for c, pid, starttime, pid_ns, detached in self.seg.clients():
            foreign = bool(pid_ns and self.pid_ns and pid_ns != self.pid_ns)
            if not foreign and not detached and starttime == 0 and pid > 0:
                # A claimer killed between its claim and the store of its
                # start time leaves 0, "whichever process has this pid":
                # once the pid is reused, by a process started after the
                # entry was first seen so, it is not the claimer's.
                first = self.unstamped.get((c, pid)) or _boot_ticks()
                unstamped[(c, pid)] = first
                if (segment.process_starttime(pid) or 0) > first:
                    detached = True
            if detached or (not foreign and not segment.is_alive(pid, starttime)):
                self.seg.reclaim(c)
                unstamped.pop((c, pid), None)
        self.unstamped = unstamped


def _boot_ticks() -> int:
    """Now, in the clock ticks since boot that /proc gives start times in."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def _configure(input_shape: ShapeLike, input_dtype: Any, outputs: OutputsLike, max_batch: int,
               max_wait_us: Union[float, str], buckets: Buckets, max_clients: int,
               slots_per_client: int, evaluator_spin_us: Union[float, str],
               spin_us: Union[float, str, None],
               serving_threads: Union[int, str] = AUTO) -> tuple[Spec, BatchPolicy]:
    # Every argument is checked before the segment is created.
    check_spin_auto(spin_us)
    spec = Spec.build(input_shape, input_dtype, outputs, max_batch, max_clients,
                      slots_per_client)
    policy = BatchPolicy.make(spec.max_batch, max_wait_us, buckets, evaluator_spin_us,
                              serving_threads)
    return spec, policy


def _shutdown(seg: "_ring.Segment", address: str, owner_pid: int,
              thread: Optional[threading.Thread], processes: Sequence[Any],
              timeout: float = 10.0, healer: Optional[Healer] = None) -> None:
    """Stops serving, wakes every waiter, removes the segment's name.
    The watcher that restarts dead serving processes stops first: nothing
    is restarted during a close."""
    if os.getpid() != owner_pid:
        return
    if healer is not None:
        healer.close()
    seg.request_close()
    reason, detail = _ring.STOP_CLOSED, 0
    if thread is not None:
        thread.join(timeout)
    deadline = time.monotonic() + timeout
    for process in processes:
        if process.pid is None:  # never started
            continue
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.terminate()
            process.join(1.0)
            if process.is_alive():
                process.kill()
                process.join(1.0)
        if process.exitcode not in (0, None) and reason == _ring.STOP_CLOSED:
            reason, detail = _ring.STOP_EXITED, process.exitcode
    if seg.ev_state() < _ring.CLOSED_STATE:
        # No replica got to it (their processes were killed, or one is stuck
        # in a model call past the timeout): wake the clients ourselves.
        seg.close_and_wake(reason, detail)
    segment.unlink(address)


def _replica_devices(replicas: Optional[int], devices: Optional[Sequence[str]]) -> list[str]:
    """One device name per replica ("" for a factory called without one)."""
    if devices is not None:
        if isinstance(devices, str) or not all(isinstance(d, str) and d for d in devices):
            raise TypeError(f"devices must be a list of device names such as 'cuda:0', "
                            f"got {devices!r}")
        if not devices:
            raise ValueError("devices must name at least one device")
        if replicas is not None and replicas != len(devices):
            raise ValueError(f"replicas={replicas} but {len(devices)} devices: give one of "
                             f"them, or as many replicas as devices")
        n = len(devices)
    else:
        n = 1 if replicas is None else replicas
        if type(n) is not int or not 1 <= n <= MAX_REPLICAS:
            raise ValueError(f"replicas must be an int from 1 to {MAX_REPLICAS}, got {replicas!r}")
        devices = [""] * n
    if n > MAX_REPLICAS:
        raise ValueError(f"at most {MAX_REPLICAS} replicas, got {n} devices")
    return list(devices)


class Evaluator(Client):
    """Serves ``model`` to any number of processes through shared memory.

    ``Evaluator(model, ...)`` serves from a thread of this process;
    ``Evaluator.spawn(factory, ...)`` serves from a process of its own.
    The object pickles into child processes (spawn or fork) as a light
    :class:`~shmeval.client.Client` handle that attaches on first use.

    Parameters
    ----------
    model:
        callable taking an ``ndarray [n, *input_shape]`` and returning a dict
        of arrays (by name), a tuple/list (in the order of ``outputs``) or one
        array (when one output is declared), each with a leading dim n.
        When it raises for a batch, the evaluator calls it again on halves
        of the batch to find the rows that raise, which alone get
        ModelError (at most ISOLATE_CALLS extra calls per batch, paused
        for a model that raises on everything; docs/guide.md, *Errors*).
    input_shape, input_dtype:
        of one state.  Client inputs are cast with NumPy 'same_kind' casting.
    outputs:
        ``{name: (shape, dtype)}`` of one result.
    max_batch:
        most requests per model call.
    max_wait_us:
        after the first request, wait up to this long for a fuller batch (0:
        greedy).  ``"auto"`` (default): the tuner waits only where its
        measurements show that waiting serves more (:mod:`shmeval.tuning`).
    buckets:
        None (no padding), ``"pow2"`` or a list of batch sizes to pad to.
    max_clients:
        most processes attached at once (one client-table entry each).
    slots_per_client:
        most requests one process has in flight (``evaluate_many`` sends
        larger batches in rounds).
    spin_us:
        client spin budget before sleeping: a plain spin while the attached
        processes and the evaluator fit on the CPU cores, a spin that yields
        the CPU between looks when they are one more than the cores, none
        beyond (docs/protocol.md, *Waiting*).  ``"auto"`` (default): the
        measured cost of a sleep and a wake-up in the client's process
        (None is an alias of ``"auto"``).
    evaluator_spin_us:
        how long the idle evaluator spins before it sleeps on its doorbell,
        by the same rule.  ``"auto"`` (default): the tuner's budget, and
        sleep while the runnable tasks fill the CPUs.
    serving_threads:
        ``"auto"`` (default): one or two model calls in flight, two only for
        a model whose ``max_concurrency`` allows it (TFModel's does) and
        where two serve more.  1: one model call at a time.  N > 1: N threads take turns
        collecting batches and run up to N model calls at once, which pays
        when the model releases the GIL and a core would otherwise idle
        while the evaluator computes (TensorFlow: give it as many inter-op
        threads, see ``TFModel(inter_op_threads=...)``).  The model must be
        safe to call from several threads; weight updates still happen with
        no call in flight.
    reject_nonfinite:
        fail the requests whose float outputs hold NaN or inf (ModelError),
        and only those: the rest of the batch is answered.
    cache_entries:
        an evaluation cache of this many entries (a power of two; 0: none)
        in shared memory: every client looks a state up there before it
        sends it, and stores the answers it gets, so a state any process
        had evaluated is answered in any other without a round trip.
        Entries carry the model version; after ``set_weights`` returns no
        lookup accepts an older answer.  Keys are hashes of the states'
        bytes, or the caller's (``evaluate(state, key=...)``).  One entry
        takes 32 bytes plus a result row, its outputs each 8-byte aligned
        (docs/guide.md, *The evaluation cache*).
    metrics_port:
        serve Prometheus metrics of the evaluator on this port of 127.0.0.1
        (0: a port the system picks, see ``metrics_port``), from a thread of
        this process (needs the ``[monitor]`` extra); stopped by ``close()``.
    """

    def __init__(self, model: Model, *, input_shape: ShapeLike, outputs: OutputsLike,
                 input_dtype: Any = "float32", max_batch: int = 256,
                 max_wait_us: Union[float, str] = AUTO, buckets: Buckets = None,
                 max_clients: int = 64, slots_per_client: int = 16,
                 spin_us: Union[float, str, None] = AUTO,
                 evaluator_spin_us: Union[float, str] = AUTO, reject_nonfinite: bool = True,
                 name: Optional[str] = None, serving_threads: Union[int, str] = AUTO,
                 cache_entries: int = 0, metrics_port: Optional[int] = None) -> None:
        if not callable(model):
            raise TypeError(f"model must be callable, got {type(model).__name__}")
        _ring.cache_log2_of(cache_entries)
        _check_metrics_port(metrics_port)
        _check_not_bootstrapping("Evaluator()")
        spec, policy = _configure(input_shape, input_dtype, outputs, max_batch, max_wait_us,
                                  buckets, max_clients, slots_per_client, evaluator_spin_us,
                                  spin_us, serving_threads)
        t0 = time.perf_counter_ns()
        policy = _fit_threads(model, _prepare(model, spec, policy))  # before any segment exists
        warmup_ns = time.perf_counter_ns() - t0
        seg, address = segment.create(spec, name, replicas=1, servers=policy.threads,
                                      cache_entries=cache_entries)
        super().__init__(address, spec, spin_us, _segment=seg)
        self._owner_pid = os.getpid()
        self._policy = policy
        seg.stat_put("warmup_ns", warmup_ns)
        control, loop_end = mp.Pipe()
        self._controls = [control]
        self._init_control()
        loop = _ServingLoop(seg, spec, model, policy, reject_nonfinite, loop_end)
        started = threading.Event()
        thread = threading.Thread(target=loop.run, args=(started.set,),
                                  name=f"shmeval-evaluator {address}", daemon=True)
        thread.start()
        started.wait(10.0)
        self._thread: Optional[threading.Thread] = thread
        self._processes: list[Any] = []
        self._healer = None  # a thread evaluator is not restarted
        self._shutdown = weakref.finalize(self, _shutdown, seg, address, self._owner_pid,
                                          thread, [])
        self._start_metrics(metrics_port)

    @classmethod
    def spawn(cls, factory: Callable[..., Model], *, input_shape: ShapeLike,
              outputs: OutputsLike, input_dtype: Any = "float32", max_batch: int = 256,
              max_wait_us: Union[float, str] = AUTO, buckets: Buckets = None,
              max_clients: int = 64, slots_per_client: int = 16,
              spin_us: Union[float, str, None] = AUTO,
              evaluator_spin_us: Union[float, str] = AUTO, reject_nonfinite: bool = True,
              name: Optional[str] = None, start_timeout: float = 600.0,
              mp_context: str = "spawn", serving_threads: Union[int, str] = AUTO,
              replicas: Optional[int] = None,
              devices: Optional[Sequence[str]] = None, cache_entries: int = 0,
              metrics_port: Optional[int] = None,
              restarts: int = DEFAULT_RESTARTS) -> "Evaluator":
        """Serves from new processes, each of which calls the picklable
        ``factory`` to build its model (so e.g. TensorFlow is imported only
        there).  Returns once every model is built and serving.

        ``replicas=N`` serves N model replicas behind the one address, each in
        a process of its own calling ``factory()``; ``devices=["cuda:0",
        "cuda:1"]`` serves one replica per device, calling
        ``factory(device)``.  The replicas take turns collecting batches, a
        replica whenever its model is free and at most its share of the
        work outstanding, so that their batches stay even; workers do not
        know how many there are.  Weight updates reach every replica, and a worker never
        sees versions go backwards.  A replica that dies has its requests
        served by the others; the evaluator dies with its last replica.

        ``restarts=N`` (default 3): a serving process that dies (killed, a
        crash in the framework, an out-of-memory) is started again, the
        factory called again and the weights serving now applied before it
        serves, after a backoff of 0.2 s doubling per restart; its requests
        in flight are served again, and workers see nothing.  At most N
        restarts in the evaluator's life; after that a death is final as
        before (``EvaluatorDied`` once no replica is left).  0: none.
        ``stats()["restarts"]`` lists each one and why it happened."""
        if not callable(factory):
            raise TypeError(f"factory must be callable, got {type(factory).__name__}")
        check_restarts(restarts)
        _ring.cache_log2_of(cache_entries)
        _check_metrics_port(metrics_port)
        if not as_number("start_timeout", start_timeout) > 0:
            raise ValueError(f"start_timeout must be > 0 seconds, got {start_timeout!r}")
        _check_not_bootstrapping("Evaluator.spawn()")
        method = mp.get_context(mp_context).get_start_method()
        if method != "fork":
            _check_picklable(factory)
            why = unreachable_reason(factory, method)
            if why:
                raise TypeError(f"the evaluator process cannot find its factory: {why}")
        devs = _replica_devices(replicas, devices)
        spec, policy = _configure(input_shape, input_dtype, outputs, max_batch, max_wait_us,
                                  buckets, max_clients, slots_per_client, evaluator_spin_us,
                                  spin_us, serving_threads)
        seg, address = segment.create(spec, name, replicas=len(devs),
                                      servers=len(devs) * policy.threads,
                                      cache_entries=cache_entries)
        self = cls.__new__(cls)
        Client.__init__(self, address, spec, spin_us, _segment=seg)
        self._owner_pid = os.getpid()
        self._policy = policy
        self._thread = None
        self._launcher = _Launcher(mp.get_context(mp_context), address, spec, factory, policy,
                                   reject_nonfinite, devs, start_timeout)
        # One pipe per replica, for its start-up report and then for control
        # requests.
        self._controls, senders, self._processes = [], [], []
        for r in range(len(devs)):
            proc, receiver, sender = self._launcher.process(r, None)
            self._controls.append(receiver)
            senders.append(sender)
            self._processes.append(proc)
        self._init_control()
        self._healer = Healer(seg, restarts, self._processes)
        self._shutdown = weakref.finalize(self, _shutdown, seg, address, self._owner_pid,
                                          None, self._processes, 10.0, self._healer)
        try:
            for proc, sender in zip(self._processes, senders):
                proc.start()
                sender.close()
            deadline = time.monotonic() + start_timeout
            for r, (proc, receiver) in enumerate(zip(self._processes, self._controls)):
                self._launcher.await_ready(r, proc, receiver, deadline)
        except BaseException:
            # Start-up failed: nothing was served, so there is nothing to wait
            # for before terminating the processes (start_timeout is honoured).
            self._shutdown.detach()
            _shutdown(seg, address, self._owner_pid, None, self._processes, timeout=0.5)
            for receiver in self._controls:
                receiver.close()
            raise
        if restarts:
            # A weak reference: the watcher must not keep the evaluator alive.
            restart = weakref.WeakMethod(self._restart)
            self._healer.run_in_thread(
                lambda r: _call_weak(restart, r), f"shmeval-restarts {address}")
        self._start_metrics(metrics_port)
        return self

    def _restart(self, r: int) -> tuple[int, str]:
        """Starts replica r again after its process died, with the weights
        serving now (the last update applied), and swaps it in once it
        serves.  Under the control lock, so that no update is sent meanwhile
        (the new process would miss it).  Returns (its pid, "") or (0, why
        it failed to start)."""
        assert self._healer is not None
        with self._control_lock:
            if self._healer.stop.is_set():
                return 0, "the evaluator is closing"
            proc, receiver, sender = self._launcher.process(r, Restart(self._last_update))
            proc.start()
            sender.close()
            try:
                self._launcher.await_ready(r, proc, receiver,
                                           time.monotonic() + self._launcher.start_timeout,
                                           self._healer.stop)
            except Exception as e:
                receiver.close()
                if proc.is_alive():
                    proc.kill()
                proc.join(1.0)
                return 0, f"{type(e).__name__}: {e}"
            self._controls[r].close()
            self._controls[r] = receiver
            self._processes[r] = proc
            return proc.pid, ""

    def stats(self) -> dict[str, Any]:
        """As :meth:`Client.stats`; for ``Evaluator.spawn``, in the
        process that created it, also ``restarts``: one entry per restart
        of a dead serving process (when, which replica, the dead process and
        how it ended, the new one, or why it failed to start)."""
        st = super().stats()
        if self._healer is not None and os.getpid() == self._owner_pid:
            st["restarts"] = [asdict(rec) for rec in self._healer.records]
        return st

    _controls: list[Any]  # our ends of the control pipes, one per replica
    _launcher: "_Launcher"  # starts the serving processes (spawn)
    _healer: Optional[Healer]  # restarts dead ones (spawn; watching if restarts > 0)
    _exporter: Any = None  # the Prometheus exporter (metrics_port)

    def _start_metrics(self, port: Optional[int]) -> None:
        """Serves Prometheus metrics of this evaluator on ``port`` from a
        thread of this process (shmeval.monitor, the [monitor] extra); the
        evaluator is closed again if that fails."""
        if port is None:
            return
        try:
            try:
                from .monitor.prometheus import start_exporter
            except ImportError as e:
                raise ImportError(f"metrics_port needs: pip install 'shmeval[monitor]' "
                                  f"({e.name} missing)") from None
            self._exporter = start_exporter(self._address, port)
        except BaseException:
            self.close()
            raise

    @property
    def metrics_port(self) -> Optional[int]:
        """The port the Prometheus metrics are served on (the one the system
        chose for ``metrics_port=0``), or None."""
        return self._exporter.port if self._exporter is not None else None

    def _init_control(self) -> None:
        self._control_lock = threading.Lock()
        self._version = 0
        # What a restarted replica applies before it serves.
        self._last_update: Optional[WeightsUpdate] = None

    @property
    def model_version(self) -> int:
        """The version of the weights serving now (0: as started)."""
        return self._version

    def set_weights(self, weights: Union[Sequence[Any], Mapping[str, Any]], *,
                    version: Optional[int] = None, timeout: float = 60.0) -> int:
        """Replaces the model's weights between two batches, with what the
        model's framework hands out: a Keras ``get_weights()`` list, a
        PyTorch ``state_dict()`` (tensors or arrays, matched by name), a
        JAX params pytree.  Requests in flight are not failed or dropped.
        Tensors are copied to NumPy arrays here (shmeval.weights); the
        model's ``set_weights`` gets the same structure (TFModel,
        TorchModel and JaxModel match it, and say what is missing or
        extra).  TypeError here for anything but a mapping, a list or a
        tuple.

        Returns the new model version: ``version`` if given (it must be
        larger than the current one), else the current one plus 1.  Every
        result computed with these weights carries it (``evaluate(...,
        return_version=True)``).  Returns once the evaluator applied them;
        raises :class:`ModelError` (weights unchanged) if the model refused
        them.  Only the process that created the evaluator can call this."""
        return self._request("set_weights", plain_weights(weights), version, timeout)

    def load_weights(self, path: Union[str, "os.PathLike[str]"], *,
                     version: Optional[int] = None, timeout: float = 60.0) -> int:
        """As :meth:`set_weights`, but the evaluator process loads them from
        ``path`` with the model's ``load_weights(path)`` (for TFModel: a
        Keras weights file or an ``.npz`` of arrays in ``get_weights()``
        order)."""
        return self._request("load_weights", os.fspath(path), version, timeout)

    def _request(self, method: str, arg: Any, version: Optional[int], timeout: float) -> int:
        """Sends the update to every replica.  When every replica died
        before applying it and the owner restarts them (restarts=), it is
        sent again once one serves, within the timeout."""
        if os.getpid() != self._owner_pid:
            raise ShmevalError(f"only the process that created the evaluator "
                               f"({self._owner_pid}) can change its model")
        seg = self._seg
        assert seg is not None
        deadline = time.monotonic() + timeout
        while True:
            new = self._request_once(seg, method, arg, version, deadline, timeout)
            if new is not None:
                return new
            while seg.restarts_left() and not any(p.is_alive() for p in self._processes):
                self._check_alive(seg)  # EvaluatorDied once no restart is left
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the evaluator did not apply {method} within "
                                       f"{timeout} s: its serving processes are restarting")
                time.sleep(RESTART_POLL_S)

    def _request_once(self, seg: "_ring.Segment", method: str, arg: Any,
                      version: Optional[int], deadline: float,
                      timeout: float) -> Optional[int]:
        """One round of _request: the new version, or None when no replica
        applied the update because every one died, and a restart is
        coming."""
        with self._control_lock:
            new = self._version + 1 if version is None else operator.index(version)
            if new <= self._version:
                raise ValueError(f"version must be larger than the current model version "
                                 f"{self._version}, got {new}")
            self._check_state(seg)
            ticket = seg.request_control()
            # Every replica gets the update; one whose pipe is gone has died
            # (the others serve its requests).
            pending: dict[mp_connection.Connection, int] = {}
            for r, conn in enumerate(self._controls):
                try:
                    conn.send((ticket, method, arg, new))
                    pending[conn] = r
                except OSError:
                    continue
            if not pending:
                self._raise_unless_restarting(seg)
                return None
            applied, refused = 0, dict[int, str]()
            while pending:
                for ready in mp_connection.wait(list(pending), timeout=0.05):
                    conn = typing.cast(mp_connection.Connection, ready)
                    r = pending[conn]
                    try:
                        t, ok, detail = conn.recv()
                    except (EOFError, OSError):  # this replica died meanwhile
                        del pending[conn]
                        continue
                    if ok:  # also the late reply of a request that timed out
                        self._version = max(self._version, detail)
                    if t == ticket:
                        del pending[conn]
                        if ok:
                            applied += 1
                        else:
                            refused[r] = detail
                if not pending:
                    break
                self._check_alive(seg)
                if time.monotonic() > deadline:
                    raise ShmevalTimeout(f"the evaluator did not apply {method} within "
                                         f"{timeout} s (it may still do so)")
            if applied:
                # Before returning: no cache lookup accepts older answers now,
                # and no replica that refused the update collects any more
                # while one that applied it serves.
                seg.cache_set_version(new)
                seg.raise_version_floor(new)
                self._last_update = WeightsUpdate(method, arg, new)
            if refused:
                if len(self._controls) == 1:
                    raise ModelError(next(iter(refused.values())))
                raise ModelError("; ".join(f"replica {r}: {why}" for r, why in sorted(
                    refused.items())) + (f" (applied by {applied} other replicas, which "
                                         f"serve alone until these accept a newer version)"
                                         if applied else ""))
            if not applied:
                self._raise_unless_restarting(seg)
                return None
            # Counted once per update, however many replicas applied it.
            seg.stat_put("model_version", new)
            seg.stat_inc("weight_updates", 1)
            return new

    def _raise_unless_restarting(self, seg: "_ring.Segment") -> None:
        """No replica got an update: EvaluatorDied, unless a restart is
        coming."""
        self._check_alive(seg)
        if not seg.restarts_left():
            raise EvaluatorDied(f"the evaluator serving {self._address} is gone")

    @property
    def pid(self) -> int:
        """The serving process's pid (the first replica's; this process for
        a thread evaluator)."""
        return self._processes[0].pid if self._processes else self._owner_pid

    @property
    def pids(self) -> list[int]:
        """The pid of every replica's process (this process for a thread
        evaluator)."""
        return [p.pid for p in self._processes] if self._processes else [self._owner_pid]

    def close(self, timeout: float = 10.0) -> None:
        """Stops serving: requests in flight complete or raise EvaluatorClosed;
        the shared segment is removed.  Idempotent.  In a child process that
        inherited this object by fork it only detaches that process."""
        if os.getpid() == self._owner_pid and self._shutdown.alive:
            if self._exporter is not None:
                self._exporter.close()
            # Stop serving first: this process's threads still waiting then
            # raise EvaluatorClosed, and its client entry can go at once.
            self._shutdown.detach()
            assert self._seg is not None
            _shutdown(self._seg, self._address, self._owner_pid, self._thread,
                      self._processes, timeout, self._healer)
            with self._control_lock:
                for conn in self._controls:
                    conn.close()
        super().close(timeout)

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_metrics_port(port: Optional[int]) -> None:
    if port is not None and (type(port) is not int or not 0 <= port <= 65535):
        raise ValueError(f"metrics_port must be a port from 0 to 65535 (0: one the system "
                         f"picks), got {port!r}")


def _call_weak(method: "weakref.WeakMethod[Any]", r: int) -> tuple[int, str]:
    """Evaluator._restart through a weak reference (the healer's thread
    must not keep the evaluator alive)."""
    fn = method()
    return typing.cast("tuple[int, str]", fn(r)) if fn is not None else (
        0, "the evaluator is gone")


class _Launcher:
    """Starts the serving processes of an Evaluator.spawn: each replica's
    at start-up, and again for a restart, by the one path."""

    def __init__(self, ctx: Any, address: str, spec: Spec, factory: Callable[..., Model],
                 policy: BatchPolicy, reject_nonfinite: bool, devices: list[str],
                 start_timeout: float) -> None:
        self.ctx = ctx
        self.address = address
        self.spec_json = spec.to_json()
        self.factory = factory
        self.policy = policy
        self.reject_nonfinite = reject_nonfinite
        self.devices = devices
        self.start_timeout = start_timeout

    def process(self, r: int, restart: Optional[Restart]) -> tuple[Any, Any, Any]:
        """Replica r's process (not started yet) and the two ends of its
        pipe: ours, and the one it takes (close it once it started)."""
        receiver, sender = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=_serve_in_process, name=f"shmeval-evaluator {self.address} #{r}",
            args=(self.address, self.spec_json, self.factory, self.policy,
                  self.reject_nonfinite, sender, r, self.devices[r], restart),
            daemon=True)
        return proc, receiver, sender

    def await_ready(self, r: int, proc: Any, receiver: Any, deadline: float,
                    stop: Optional[threading.Event] = None) -> None:
        d = self.devices
        _await_ready(proc, receiver, deadline, self.start_timeout,
                     f" (replica {r}{', ' + d[r] if d[r] else ''})" if len(d) > 1 else "", stop)


def _await_ready(proc: Any, receiver: Any, deadline: float, start_timeout: float,
                 which: str, stop: Optional[threading.Event] = None) -> None:
    """Waits for one evaluator process's start-up report; raises what went
    wrong ('which' names the replica in the message).  A restart also gives
    up when ``stop`` is set (the evaluator is closing)."""
    while not receiver.poll(0.05):
        if not proc.is_alive():
            raise EvaluatorDied(_died_starting(proc) + which)
        if time.monotonic() > deadline:
            raise EvaluatorDied(f"the evaluator{which} did not start within {start_timeout} s")
        if stop is not None and stop.is_set():
            raise EvaluatorDied("the evaluator is closing")
    try:
        kind, detail = receiver.recv()
    except EOFError:
        proc.join(1.0)
        raise EvaluatorDied(_died_starting(proc) + which) from None
    if kind != "ready":
        raise ModelError(f"the model factory failed in the evaluator process{which}: {detail}")


def _died_starting(proc: Any) -> str:
    """Why Evaluator.spawn failed when its process died before it reported."""
    return (f"the evaluator process exited (code {proc.exitcode}) during start-up, before "
            f"it could build the model; its error is on stderr.  If it says the script ran "
            f"again in the new process, guard the script's entry point with "
            f"`if __name__ == \"__main__\":`")


def _check_not_bootstrapping(what: str) -> None:
    """Refuses to create an evaluator in a process that multiprocessing's
    spawn or forkserver start method is still starting: that is the user's
    script running again in the child, because its entry point is not
    guarded, and the child would create an evaluator of its own."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise NotTheMainProcess(
            f"{what} was called while this process was starting as a child process "
            f"(multiprocessing's spawn start method runs the main script again in each "
            f"child): guard the script's entry point with `if __name__ == \"__main__\":` "
            f"so that the evaluator is created in the main process only")


def _check_picklable(factory: Callable[[], Model]) -> None:
    """The factory travels to the evaluator process by pickle."""
    try:
        pickle.dumps(factory)
    except Exception as e:
        raise TypeError(
            f"the factory must be picklable to reach the evaluator process: a module-level "
            f"function, or a functools.partial of one, not a lambda or a nested function "
            f"({factory!r} cannot be pickled: {type(e).__name__}: {e})") from None


def _serve_in_process(address: str, spec_json: bytes, factory: Callable[..., Model],
                      policy: BatchPolicy, reject_nonfinite: bool, conn: Any, replica: int = 0,
                      device: str = "", restart: Optional[Restart] = None) -> None:
    # Ctrl-C reaches the whole process group: the parent decides when to
    # close, so the evaluator ignores SIGINT rather than dying mid-batch.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Before the factory imports a framework: JAX and TensorFlow would
    # otherwise take every GPU for this one replica (_device.GPU_SHARING_ENV).
    share_gpus()
    seg, spec = segment.attach(address, Spec.from_json(spec_json))
    if restart is not None:
        _take_back(seg, replica)  # before its servers are set up
    t0 = time.perf_counter_ns()
    try:
        model = factory(device) if device else factory()
        if not callable(model):
            raise TypeError(f"factory returned a {type(model).__name__}, not a callable")
        policy = _prepare(model, spec, policy)
        loop = _ServingLoop(seg, spec, model, policy, reject_nonfinite, conn, replica, device)
        if restart is not None:
            loop.resume(restart)
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        conn.close()
        raise SystemExit(1)
    if restart is None:
        seg.stat_put("warmup_ns", time.perf_counter_ns() - t0)
    loop.run(lambda: conn.send(("ready", os.getpid())))


#: How often a restarted replica looks whether the others put back what its
#: dead process held.
TAKE_BACK_POLL_S = 0.01


def _take_back(seg: "_ring.Segment", replica: int) -> None:
    """A restarted replica's first step: the requests its dead process had
    taken go back to READY, exactly once, before its servers are set up
    again (which empties its batch tables in the segment).  With other
    replicas serving, their housekeeping does it (it holds the collect lock,
    which a put-back needs: docs/protocol.md, *Replicas*), and takes the
    lock over if the dead process held it; this process waits for that.
    With none (one replica, or every other dead too) nobody scans, and it
    puts them back itself."""
    me = os.getpid()
    seg.replica_restart(replica, me, segment.process_starttime(me) or 0)
    while not seg.replica_settled(replica):
        if not any(rep["replica"] != replica and rep["state"] == "serving"
                   and segment.is_alive(rep["pid"], rep["starttime"])
                   for rep in seg.replicas()):
            seg.requeue_restarted(replica)
            return
        if seg.ev_state() >= _ring.CLOSING:
            return
        time.sleep(TAKE_BACK_POLL_S)


__all__ = ["Evaluator", "BatchPolicy", "ShmevalError"]
