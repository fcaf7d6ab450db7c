"""The serving loop: one model replica serving the segment.

Collect (C, GIL released) -> pad to a bucket -> model -> check and cast the
outputs into the preallocated result rows -> scatter and wake (C, GIL
released), batch after batch in ``Server.serve`` until something needs
Python: then :class:`ServingLoop` answers a batch whose outputs need
converting or whose model call raised (finding the rows that raise), applies
weight updates, and keeps house (between batches, and whenever it is idle
for 100 ms: reclaims the client entries of dead or detached processes, finds
replicas that died, ticks the tuner).  A thread evaluator runs it in a thread
of its creator; ``Evaluator.spawn`` in each serving process
(:mod:`shmeval.launch`).

A model error that leaves its device unusable (``backends._fatal``: a
sticky CUDA error, say) ends the loop with ``DeviceLost`` instead of
failing the batch: the batches this replica holds stay in its batch tables
and are put back once its process is gone, for the other replicas or the
restarted process, and the error is published in the segment, for the
``EvaluatorDied`` of clients left with no replica.
"""
from __future__ import annotations

import inspect
import math
import os
import threading
import time
import warnings
from dataclasses import replace
from typing import Any, Callable, Mapping, Optional

import numpy as np

from . import _ring, segment
from .backends._fatal import device_lost
from .config import ServeConfig
from .errors import DeviceLost, ModelError, exception_text
from .restarts import Restart
from .stats import DEVICE_LOST_BYTES, publish_device_lost
from .spec import MethodSpec, Spec
from .tuning import Board, Decision, ServingTuner, model_concurrency

Model = Callable[[np.ndarray], Any]

#: The serving loop wakes at least this often to reclaim dead clients.
IDLE_TIMEOUT_NS = 100_000_000
#: And checks client liveness at most this often while busy.
HOUSEKEEPING_NS = 200_000_000
#: A control request announced in the segment (the owner bumps its ticket
#: just before it sends the message) is looked for in the pipe this often,
#: between batches, for at most CONTROL_WAIT_NS.
CONTROL_POLL_NS = 1_000_000
CONTROL_WAIT_NS = 1_000_000_000
#: How long the serving loop waits for its other threads when it stops.
THREAD_JOIN_S = 10.0
#: The exit code of a replica process that ends itself because a serving
#: thread did not return within THREAD_JOIN_S (ServingLoop.leave).
EXIT_STUCK = 70
#: A batch whose model call raises is split to find the rows that raise
#: (ServingLoop.isolate): at most this many extra model calls per batch
#: (enough to find one bad row in 65536, or a few in a full batch); rows
#: still undecided then fail with the error of the part that held them.
ISOLATE_CALLS = 32
#: After this many failed batches in a row where no row could be answered
#: (a model that raises on everything), batches that raise fail whole,
#: without extra calls, for ISOLATE_PAUSE_NS; the next failure after that
#: is isolated again.
ISOLATE_GIVE_UP = 3
ISOLATE_PAUSE_NS = 1_000_000_000


def method_calls(model: Any, spec: Spec) -> Any:
    """What serves each method's requests: the model itself when there is
    one method; else a list, by method index, of the model's function of
    each method's name (``model[name]`` of a dict, else ``getattr(model,
    name)``).  ModelError naming a method the model lacks."""
    if len(spec.methods) == 1:
        return model
    calls = []
    for m in spec.methods:
        fn = model.get(m.name) if isinstance(model, Mapping) else getattr(model, m.name, None)
        if not callable(fn):
            raise ModelError(f"the model ({type(model).__name__}) has no function for "
                             f"{m.describe()}: give a dict of callables by method name, or "
                             f"an object with a callable attribute {m.name!r}")
        calls.append(fn)
    return calls


def prepare(model: Model, config: ServeConfig) -> ServeConfig:
    """The config after the model's optional ``prepare(spec, buckets)``
    hook (build, check the outputs against the spec, warm up every batch
    size: errors surface at start-up, not at the first request), which may
    return the bucket sizes it wants batches padded to when the settings
    name none.  A hook that takes a ``serving_threads`` keyword is told
    how many serving threads may call the model at once (TorchModel
    builds a CUDA lane for each up front)."""
    policy = config.policy
    method_calls(model, config.spec)  # a method the model lacks fails here
    hook = getattr(model, "prepare", None)
    if hook is None:
        return config
    try:
        if _takes_keyword(hook, "serving_threads"):
            wanted = hook(config.spec, policy.buckets, serving_threads=policy.threads)
        else:
            wanted = hook(config.spec, policy.buckets)
    except ModelError:
        raise
    except Exception as e:
        raise ModelError(f"the model failed to prepare: {type(e).__name__}: {e}") from e
    if wanted is None or policy.buckets is not None:
        return config
    try:
        b = tuple(sorted({int(x) for x in wanted}))
    except (TypeError, ValueError):
        raise ModelError(f"prepare() returned {wanted!r}, not a list of batch sizes") from None
    if not b or b[0] < 1 or b[-1] < policy.max_batch:
        raise ModelError(f"prepare() returned buckets {b}: they must be positive and the "
                         f"largest must be >= max_batch ({policy.max_batch})")
    return config.with_policy(replace(policy, buckets=b))


def _takes_keyword(f: Callable[..., Any], name: str) -> bool:
    """Whether f can be called with the keyword ``name``."""
    try:
        params = inspect.signature(f).parameters
    except (TypeError, ValueError):
        return False
    p = params.get(name)
    return (p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) or \
        any(q.kind is q.VAR_KEYWORD for q in params.values())


def fit_threads(model: Model, config: ServeConfig) -> ServeConfig:
    """serving_threads="auto" serves a model whose calls may not overlap
    (tuning.model_concurrency) from one thread.  Only where the model is
    known before the segment is made (a thread evaluator): an evaluator
    process serves the server indices its segment was made with, and keeps
    the second thread parked (the tuner never gives it a turn)."""
    policy = config.policy
    if policy.auto_threads and model_concurrency(model) < 2:
        return config.with_policy(replace(policy, threads=1))
    return config


class ServingLoop:
    """Serves the segment for one model replica from config.policy.threads
    threads: each runs Server.serve() with its own batch buffer; they take
    turns collecting (the ServeGroup's lock, and with several replicas the
    segment's collect lock, shared with the other replicas' threads) and
    overlap their model calls, so that with a model that releases the GIL
    (TensorFlow does) one batch is computed while the next is gathered and
    computed on another core.  Whichever thread holds the lock with no batch
    in flight does the rest: housekeeping (which also finds other replicas
    that died and puts their batches back), weight updates, stopping."""

    def __init__(self, seg: "_ring.Segment", model: Model, config: ServeConfig,
                 control: Any = None, replica: int = 0, device: str = "") -> None:
        self.seg = seg
        self.model = model
        self.config = config  # as prepare() and fit_threads() left it
        self.spec = spec = config.spec
        self.policy = policy = config.policy
        self.control = control  # our end of the owner's control pipe
        self.replica = replica
        self.device = device
        self.group = _ring.ServeGroup()
        # What each method's requests are served by: the model (one
        # method), or its function of each method's name.
        self.calls = method_calls(model, spec)
        # Each server's batch buffer: states of the one unnamed input, or
        # request rows (named inputs, methods), from which the server makes
        # the model's inputs.
        plain = len(spec.methods) == 1 and not spec.methods[0].named
        self.batches = [np.zeros((policy.rows,) + spec.input_shape, spec.input_dtype) if plain
                        else np.zeros((policy.rows, spec.in_bytes), np.uint8)
                        for _ in range(policy.threads)]
        self.servers = [_ring.Server(seg, batch, self.group, replica * policy.threads + i,
                                     replica)
                        for i, batch in enumerate(self.batches)]
        for server in self.servers:
            server.configure(config, IDLE_TIMEOUT_NS)
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
                                   _ring.SPIN_YIELD, replica)
                      if policy.tuned else None)
        if self.tuner is None:
            # Nothing of a dead process of this replica is left in its
            # report (a lost device: publish_device_lost).
            seg.set_report(replica, b"")
        #: Why this replica ended itself, if its model's device failed.
        self.lost: Optional[DeviceLost] = None

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
        raised: list[BaseException] = []
        try:
            self.serve(self.servers[0])
        except BaseException as e:
            raised.append(e)
            raise
        finally:
            self.group.stop = True
            if self.tuner is not None:
                self.tuner.release()
            for t in others:
                t.join(THREAD_JOIN_S)
            errors = raised + self.errors
            if errors:
                self.stop_reason = _ring.STOP_CRASHED
            self.lost = next((e for e in errors if isinstance(e, DeviceLost)), None)
            if self.lost is not None:
                # Before leaving: a client the last replica's leaving wakes
                # reads it (entry.why_died), and so does the owner's healer.
                publish_device_lost(self.seg, self.replica, self.lost.message)
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
        """One serving thread's loop: batches are served in C
        (``Server.serve``) until one needs Python (outputs to convert, a
        model that raised) or the loop does (housekeeping, a control
        request, closing: between_batches)."""
        tuner = self.tuner
        tuned: Optional[Decision] = None  # the decision the server has
        index = self.servers.index(server)
        while True:
            if tuner is not None:
                # The tuner's settings of this period; a thread it does not
                # use waits here.
                if not tuner.wait_turn(index, IDLE_TIMEOUT_NS / 1e9):
                    if self.group.stop:
                        return
                    continue
                if tuner.decision is not tuned:
                    tuned = tuner.decision
                    server.tune(tuned.batch_cap, tuned.spin_ns, tuned.max_wait_ns)
            until = self.housekeeping_at
            if self.control_until:
                until = min(until, _ring.now_ns() + CONTROL_POLL_NS)
            kind, n, rows, detail, model_ns = server.serve(self.calls, until)
            if kind == _ring.SERVE_SLOW:
                self.finish_slow(server, detail, n, rows, model_ns)
            elif kind == _ring.SERVE_RAISED:
                self.finish_failed(server, detail, n, rows, model_ns)
            else:
                try:
                    if not self.between_batches(server, kind, detail):
                        return
                finally:
                    server.unlock()

    def between_batches(self, server: "_ring.Server", kind: int, detail: Any) -> bool:
        """What Server.serve returned for (IDLE, CONTROL, CLOSED, LOCKED_OUT,
        BEHIND), holding our group's lock: once the other threads' batches
        are answered, nothing of this replica is in flight.  False when
        this thread stops serving."""
        server.end_busy()
        quiet = self.group.quiesce()
        if kind == _ring.SERVE_CLOSED or not quiet:
            # Closing, or stopping with batches still in flight: nothing
            # that needs quiet (reclaiming, weight updates) may happen now.
            self.group.stop = True
            return False
        if kind == _ring.SERVE_CONTROL:
            self.handle_control()
            return True
        if kind == _ring.SERVE_BEHIND:
            # Until the update comes, or until no replica that took it is
            # left (marked here: then the floor comes down).
            self.catch_up()
            self.check_replicas(None)
            return not self.owner_gone()
        if kind == _ring.SERVE_LOCKED_OUT:
            # Another replica holds the collect lock: fine, unless it died
            # holding it.  Then take it over (which puts the dead one's
            # batches back) and keep house.
            self.check_replicas(None)
            if not server.take_over_lock(detail):
                # Locked out for a while (the others took every turn): a
                # weight update must still be applied.
                self.poll_control(_ring.now_ns())
                return True
        if detail is True and self.tuner is not None:
            self.tuner.paused = True
        return self.keep_house(server, kind)

    def keep_house(self, server: "_ring.Server", kind: int) -> bool:
        """Housekeeping, idle or due while busy, with the collect lock (so
        no scan runs while entries are reclaimed); before it, a look at the
        control pipe.  False when the owner is gone."""
        now = _ring.now_ns()
        self.poll_control(now)
        if self.control_until and now < self.housekeeping_at and kind == _ring.SERVE_IDLE:
            return True  # only a look at the control pipe was due
        self.housekeeping_at = (self.tuner.next_at(now) if self.tuner is not None
                                else now + HOUSEKEEPING_NS)
        self.reclaim_dead_clients()
        self.check_replicas(server)
        if self.tuner is not None:
            self.tuner.tick(now)
        return not self.owner_gone()

    def owner_gone(self) -> bool:
        """True (and the group stopping) when the process that created the
        evaluator died: nobody else will close or unlink it."""
        if self.owner == os.getpid() or segment.is_alive(self.owner, self.owner_starttime):
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
            lost: Optional[DeviceLost] = None
            try:
                reply = (ticket,) + self.apply(method, arg, version)
            except DeviceLost as e:
                lost, reply = e, (ticket, False, f"{method} failed in the evaluator, whose "
                                                 f"device is lost: {e.message}")
            try:
                conn.send(reply)
            except OSError:
                self.control = conn = None
            if lost is not None:
                raise lost
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
            if device_lost(e):
                raise self.device_failed(e)
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
            arrays = self.check_outputs(out, n, rows, self.spec.methods[server.method])
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
        ISOLATE_PAUSE_NS.  An error that leaves the device unusable
        (backends._fatal) raises DeviceLost instead, the batch still held:
        no row is to blame, and no later call would succeed."""
        if device_lost(e):
            raise self.device_failed(e)
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
        method = self.spec.methods[server.method]
        batch = server.request_rows().copy()  # the group's requests
        part = np.empty((self.policy.rows,) + batch.shape[1:], batch.dtype)
        arrays = [np.zeros((n,) + o.shape, o.dtype) for o in method.outputs]
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
                    got = self.call_part(batch[lo:hi], part, method)
                except Exception as e:
                    if device_lost(e):  # the device failed meanwhile
                        raise self.device_failed(e)
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

    def call_part(self, x: np.ndarray, part: np.ndarray, method: MethodSpec) -> list[np.ndarray]:
        """The checked outputs of ``method``'s function for the rows x
        (isolate(); states, or request rows of named inputs): called on them
        in ``part``, padded to a bucket size with copies of x's first row,
        so that no other request's state (nor a stale one) is in the call."""
        m = len(x)
        b = next(s for s in self.policy.buckets if s >= m) if self.policy.buckets else m
        part[:m] = x
        part[m:b] = x[0]
        call = self.calls[method.index] if isinstance(self.calls, list) else self.calls
        inputs = method.unpack(part[:b]) if method.named else part[:b]
        return [a[:m] for a in self.check_outputs(call(inputs), m, b, method)]

    def answer(self, server: "_ring.Server", arrays: list[np.ndarray], n: int,
               failed: dict[int, str]) -> None:
        """Answers the outstanding batch's n requests with the rows of
        ``arrays``, except the rows in ``failed`` ({row: error text}) and,
        with reject_nonfinite, those whose outputs hold NaN or inf: these
        get ModelError with their text (a NaN in one client's state must
        not fail the others batched with it)."""
        bad, name = self.nonfinite_rows(arrays, n, self.spec.methods[server.method])
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

    def device_failed(self, e: BaseException) -> DeviceLost:
        """The DeviceLost that ends this replica for the model's error e
        (backends._fatal.device_lost): e's type and message, without the
        stack frames (its traceback goes to the process's stderr); e itself
        when the model raised DeviceLost."""
        if isinstance(e, DeviceLost):
            return e
        lost = DeviceLost(exception_text(e, DEVICE_LOST_BYTES, frames=False))
        lost.__cause__ = e
        return lost

    def error_text(self, e: Exception) -> str:
        """A failed request's text for e: its type and message first, fitted
        to what a slot carries (exception_text)."""
        limit = self.seg.error_bytes
        text = e.message if isinstance(e, ModelError) else exception_text(e, limit)
        return (text if len(text.encode("utf-8", "replace")) <= limit
                else exception_text(e, limit))

    def check_outputs(self, out: Any, n: int, rows: int,
                      method: MethodSpec) -> list[np.ndarray]:
        """The outputs of ``method``'s function as C-contiguous arrays of the
        declared dtypes, in declaration order; ModelError when they do not
        fit the spec (naming the method, where there are several).

        The rules, the same for every model (TFModel applies them in the
        traced function): an output whose rows hold as many values as the
        declared shape is reshaped to it (a value head of shape (n, 1) for
        a declared scalar ``()``, say); a dtype is cast under 'same_kind'
        casting; a dict may hold more outputs than declared, which are
        dropped, with one warning."""
        names = method.output_names
        who = f"{method.describe()}: model" if method.name else "model"
        if isinstance(out, dict):
            missing = [k for k in names if k not in out]
            if missing:
                raise ModelError(f"{who} output lacks {missing}; it returned keys "
                                 f"{sorted(map(str, out))}, expected {list(names)}")
            if len(out) > len(names):
                self.warn_extra_outputs(sorted(str(k) for k in out if k not in names))
            given = [out[k] for k in names]
        elif isinstance(out, (tuple, list)):
            if len(out) != len(names):
                raise ModelError(f"{who} returned {len(out)} outputs, expected {len(names)} "
                                 f"({', '.join(names)})")
            given = list(out)
        elif len(names) == 1:
            given = [out]
        else:
            raise ModelError(f"{who} returned one {type(out).__name__}, expected a dict or "
                             f"tuple of {len(names)} outputs ({', '.join(names)})")
        arrays = []
        for o, arr in zip(method.outputs, given):
            a = arr if type(arr) is np.ndarray else np.asarray(arr)
            if a.shape != (rows,) + o.shape:
                if a.ndim == 0 or a.shape[0] != rows or \
                        math.prod(a.shape[1:]) != math.prod(o.shape):
                    raise ModelError(
                        f"{who} output {o.name!r} has shape {a.shape}, expected "
                        f"{(rows,) + o.shape} for a batch of {rows} (or any shape "
                        f"(rows, ...) with {math.prod(o.shape)} values per row)")
                a = a.reshape((rows,) + o.shape)
            if a.dtype != o.dtype:
                if a.dtype.hasobject or not np.can_cast(a.dtype, o.dtype, "same_kind"):
                    raise ModelError(f"{who} output {o.name!r} has dtype {a.dtype}, which "
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

    def nonfinite_rows(self, arrays: list[np.ndarray], n: int,
                       method: MethodSpec) -> tuple[np.ndarray, str]:
        """Rows (< n) whose float outputs (of ``method``) hold NaN or inf
        when those are rejected, and the name of the first output holding
        one."""
        bad = np.zeros(n, bool)
        name = ""
        if self.config.reject_nonfinite:
            for o, a in zip(method.outputs, arrays):
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


