"""The client side: input checks, copy into slots, doorbell, wait, copy out.

A ``Client`` is a light handle (an address and a spec).  It attaches on first
use in each process and claims one client-table entry per process; the
threads of a process share that entry's K slots through a process-local free
list, so each slot is used by one thread at a time.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from typing import (TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Literal, Optional,
                    Sequence, Union, overload)

import numpy as np

from . import _ring, pipeline, segment
from .errors import EvaluatorClosed, EvaluatorDied, ModelError, ShmevalError
from .spec import Spec
from .stats import summarize
from .tuning import AUTO, SPIN_LONG_WAKES, check_auto, read_report, usable_cpus, wake_cost_ns

Outputs = Dict[str, np.ndarray]

#: How long one blocking wait lasts before the evaluator's liveness is checked.
WAIT_TIMEOUT_NS = 100_000_000
#: The largest spin budget (µs) either side accepts: a second.  (A budget
#: in ns must also leave ring.h's SHM_SPIN_YIELD bit clear.)
MAX_SPIN_US = 1_000_000.0


def check_spin_us(name: str, us: float) -> float:
    """A spin budget in µs (``spin_us``, ``evaluator_spin_us``; check_auto
    made it a float) from 0 to MAX_SPIN_US; ValueError otherwise (NaN
    included)."""
    if not 0 <= us <= MAX_SPIN_US:
        raise ValueError(f"{name} must be from 0 to {MAX_SPIN_US:g}, got {us}")
    return us


def check_spin_auto(spin_us: Union[float, str, None]) -> Union[float, str]:
    """The client's ``spin_us``: "auto" or a budget; None is an alias of
    "auto" (the default before it was spelled so), kept for callers that
    pass it."""
    return AUTO if spin_us is None else check_auto("spin_us", spin_us, check_spin_us)


class Client(_ring.ClientBase):
    """A handle on an evaluator: ``evaluate``, ``evaluate_many``, ``stats``.

    Obtained by pickling an :class:`~shmeval.Evaluator` into a child process,
    or from :func:`shmeval.connect`.  Safe to use from several threads.
    """

    def __init__(self, address: str, spec: Optional[Spec] = None,
                 spin_us: Union[float, str, None] = AUTO,
                 _segment: Optional["_ring.Segment"] = None) -> None:
        self._address = address
        self._spec = spec
        # "auto": two budgets measured against each other by the waits
        # themselves (_ring.SpinArms).
        self._spin_us: Union[float, str] = check_spin_auto(spin_us)
        self._seg: Optional[_ring.Segment] = _segment
        self._pid = -1           # process that owns the registration below
        self._c = -1             # client-table index in this process
        self._port: Optional[_ring.ClientPort] = None
        self._lock = threading.Lock()
        self._slot_freed = threading.Condition(self._lock)
        self._lock_pid = os.getpid()
        self._finalizer: Optional["weakref.finalize[Any, Any]"] = None
        self._ncpu = usable_cpus()
        self._key_scheme = b""  # set_key_scheme, in this process

    # ------------------------------------------------------------ identity
    @property
    def address(self) -> str:
        """The segment's name; ``shmeval.connect(address)`` attaches to it."""
        return self._address

    @property
    def spec(self) -> Spec:
        if self._spec is None:
            self._attach()
        assert self._spec is not None
        return self._spec

    def __reduce__(self) -> Any:
        spec = self._spec.to_json() if self._spec is not None else None
        return (_unpickle, (self._address, spec, self._spin_us))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._address}>"

    def _spin_ns(self) -> int:
        """The spin budget in ns (``spin_us``; "auto": wake_cost_ns, the
        short arm of _ring.SpinArms)."""
        return wake_cost_ns() if self._spin_us == AUTO else int(float(self._spin_us) * 1000)

    def _spin_long_ns(self) -> int:
        """The long arm of _ring.SpinArms with ``spin_us="auto"``
        (SPIN_LONG_WAKES wake-ups); 0 with a fixed budget."""
        return SPIN_LONG_WAKES * wake_cost_ns() if self._spin_us == AUTO else 0

    # ------------------------------------------------------------ attach
    def _attach(self) -> "_ring.Segment":
        if self._seg is None:
            self._seg, spec = segment.attach(self._address, self._spec)
            self._spec = spec
            self._seg.set_key_scheme(self._key_scheme)
        return self._seg

    def set_key_scheme(self, scheme: Any) -> None:
        """Names what this process's own cache keys (``key=``, ``keys=``)
        mean: an answer stored under a key is served only to lookups of the
        same key in the same scheme, in any process.  Set it, in every
        process, from whatever defines your keys: for Zobrist hashing, the
        table (``ev.set_key_scheme(zobrist_table)``), so that processes
        that built different tables never take each other's answers.  A
        str, bytes, int or NumPy array; without it every process's keys
        share one scheme.  Hashes of the states' bytes (no ``key``) need
        none."""
        if isinstance(scheme, np.ndarray):
            b = f"{scheme.dtype.str}{scheme.shape}".encode() + \
                np.ascontiguousarray(scheme).tobytes()
        elif isinstance(scheme, (bytes, bytearray, memoryview)):
            b = bytes(scheme)
        elif isinstance(scheme, str):
            b = scheme.encode()
        elif isinstance(scheme, (int, np.integer)):
            b = str(int(scheme)).encode()
        else:
            raise TypeError(f"key scheme: a str, bytes, int or NumPy array, not "
                            f"{type(scheme).__name__}")
        self._key_scheme = b"scheme:" + b
        if self._seg is not None:
            self._seg.set_key_scheme(self._key_scheme)

    def _register(self) -> int:
        """Client-table entry of this process (claimed on first use; a forked
        child claims its own).  Returns its index."""
        pid = os.getpid()
        if self._pid == pid:
            return self._c
        if self._lock_pid != pid:
            # First use after a fork: a lock inherited from the parent may be
            # held by a thread that does not exist here.
            self._lock = threading.Lock()
            self._slot_freed = threading.Condition(self._lock)
            self._lock_pid = pid
        with self._lock:
            if self._pid == pid:
                return self._c
            seg = self._attach()
            self._check_state(seg)
            c = seg.register(pid, segment.process_starttime(pid) or 0,
                             segment.namespaces().pid)
            spec = self.spec
            # The port holds this entry's free-slot list and abandoned slots.
            self._port = _ring.ClientPort(
                seg, c, list(range(spec.slots_per_client)), spec.input_dtype,
                spec.input_shape, self._spin_ns(), WAIT_TIMEOUT_NS, self._ncpu,
                self._notify_waiters, self._spin_long_ns())
            # Waits then sleep without a timer; the ticker wakes them every
            # WAIT_TIMEOUT_NS to check on the evaluator (docs/protocol.md,
            # Waiting).  Without it (no thread to be had) they use timers.
            seg.start_ticker(c, WAIT_TIMEOUT_NS)
            self._c = c
            self._pid = pid
            self._finalizer = weakref.finalize(self, _detach, seg, c, pid)
        return c

    # ------------------------------------------------------------ public API
    if TYPE_CHECKING:
        @overload
        def evaluate(self, state: Any, *, key: Optional[int] = None) -> Outputs: ...
        @overload
        def evaluate(self, state: Any, return_version: Literal[False],
                     key: Optional[int] = None) -> Outputs: ...
        @overload
        def evaluate(self, state: Any, return_version: Literal[True],
                     key: Optional[int] = None) -> tuple[Outputs, int]: ...
        @overload
        def evaluate(self, state: Any, return_version: bool,
                     key: Optional[int] = None) -> Outputs | tuple[Outputs, int]: ...

        def evaluate(self, state: Any, return_version: bool = False,
                     key: Optional[int] = None) -> Outputs | tuple[Outputs, int]:
            """Evaluates one state; returns ``{name: array of the output's shape}``,
            or ``(outputs, model_version)`` with ``return_version=True``.
            ``key``: the state's evaluation-cache key (e.g. a Zobrist hash)
            instead of a hash of its bytes."""
            return _ring.client_evaluate(self, state, return_version, key)  # type: ignore[no-any-return]
    else:
        # Written in Cython (_ring.client_evaluate): the common case runs no
        # Python frame; anything unusual calls _evaluate_slow below.
        evaluate = _ring.client_evaluate

    def _evaluate_slow(self, state: Any, r: Any, port: Optional["_ring.ClientPort"],
                       versioned: bool, key: Optional[int] = None
                       ) -> Outputs | tuple[Outputs, int]:
        spec = self.spec
        version = np.zeros(1, np.int64)
        if r is None:  # the fast path did not apply: the general one
            a = self._as_input(state, spec.input_shape, "state")
            outs = [np.empty(o.shape, o.dtype) for o in spec.outputs]
            self._roundtrip(a, 1, outs, version, None if key is None else _cache_keys([key], 1))
        else:
            if isinstance(r, str):
                raise ModelError(r)
            # The wait timed out, the evaluator closed, or the slot was reclaimed.
            rc, k, gen, outs = r
            seg = self._seg
            assert seg is not None and port is not None
            try:
                r = self._wait_slow(seg, port, k, gen, outs, 0, rc)
            except BaseException:
                self._give_back(port, [], [(k, gen)])
                raise
            self._give_back(port, [k], [])
            if isinstance(r, str):
                raise ModelError(r)
            version[0] = r
        result = dict(zip(spec.output_names, outs))
        return (result, int(version[0])) if versioned else result

    if TYPE_CHECKING:
        @overload
        def evaluate_many(self, states: Any, *, keys: Any = None) -> Outputs: ...
        @overload
        def evaluate_many(self, states: Any, return_version: Literal[False],
                          keys: Any = None) -> Outputs: ...
        @overload
        def evaluate_many(self, states: Any, return_version: Literal[True],
                          keys: Any = None) -> tuple[Outputs, np.ndarray]: ...
        @overload
        def evaluate_many(self, states: Any, return_version: bool,
                          keys: Any = None) -> Outputs | tuple[Outputs, np.ndarray]: ...

        def evaluate_many(self, states: Any, return_version: bool = False,
                          keys: Any = None) -> Outputs | tuple[Outputs, np.ndarray]:
            """Evaluates a batch ``[n, *input_shape]``; returns arrays with a
            leading dimension n.  Any n works: more than the client's slots are
            sent in several rounds.  With ``return_version=True`` returns
            ``(outputs, versions)``, versions an int64 array of n model versions
            (rows may be computed in different batches, so versions may differ).
            ``keys``: n evaluation-cache keys (ints), instead of hashes of
            the states' bytes; rows the cache holds are answered at once and
            only the others are sent."""
            return _ring.client_evaluate_many(self, states, return_version, keys)  # type: ignore[no-any-return]
    else:
        # Written in Cython (_ring.client_evaluate_many): a batch that fits in
        # the free slots runs no Python frame; anything else calls
        # _evaluate_many_slow below.
        evaluate_many = _ring.client_evaluate_many

    def _evaluate_many_slow(self, states: Any, r: Any, port: Optional["_ring.ClientPort"],
                            versioned: bool, keys: Any = None
                            ) -> Outputs | tuple[Outputs, np.ndarray]:
        spec = self.spec
        if r is None:  # the fast path did not apply: the general one
            a = self._as_input(states, None, "states")
            n = a.shape[0]
            outs = [np.empty((n,) + o.shape, o.dtype) for o in spec.outputs]
            versions = np.zeros(n, np.int64) if versioned else None
            if keys is not None:
                keys = _cache_keys(keys, n)
            if n:
                self._roundtrip(a, n, outs, versions, keys)
        else:
            if isinstance(r, str):
                raise ModelError(r)
            # Rows `rows` are in flight in `slots` ((slot, generation)
            # pairs); `error`: an earlier row's batch failed.
            rc, rows, slots, outs, versions, exc, error = r
            assert port is not None
            if exc is not None:
                self._give_back(port, [], slots)
                raise exc
            error = self._answer_posted(port, slots, outs, rows, versions, rc) or error
            if error is not None:
                raise ModelError(error)
        result = dict(zip(spec.output_names, outs))
        if versions is not None:
            return result, versions
        return result

    # Pipelined evaluation: shmeval.pipeline (docs/guide.md, Pipelining).
    if TYPE_CHECKING:
        def submit(self, states: Any, *, block: bool = True, return_version: bool = False,
                   keys: Any = None) -> "pipeline.Pending":
            """Posts states ``[n, *input_shape]`` (n at most ``slots_per_client``)
            and returns at once a :class:`~shmeval.pipeline.Pending`, whose
            ``result()`` returns what ``evaluate_many`` would (``keys``: as
            there).  With too few free slots it waits for the evaluator to
            answer this process's other requests, or with ``block=False``
            raises :class:`~shmeval.pipeline.NoFreeSlots`."""
            return _ring.client_submit(self, states, block=block,
                                       return_version=return_version, keys=keys)
    else:
        # Written in Cython (_ring.client_submit): a batch the process has
        # free slots for is posted with no Python frame; anything else
        # calls _submit_slow below.
        submit = _ring.client_submit

    def _submit_slow(self, states: Any, block: bool, return_version: bool,
                     keys: Any) -> "pipeline.Pending":
        return pipeline.submit(self, states, block, return_version, keys)

    def wait_any(self, pendings: Iterable["pipeline.Pending"],
                 timeout: Optional[float] = None) -> "pipeline.Pending":
        """The first of ``pendings`` (submitted through this handle in this
        process) whose ``result()`` returns or raises without waiting;
        TimeoutError after ``timeout`` seconds."""
        return pipeline.wait_any(self, pendings, timeout)

    def as_completed(self, pendings: Iterable["pipeline.Pending"],
                     timeout: Optional[float] = None) -> Iterator["pipeline.Pending"]:
        """Yields each of ``pendings`` as it is done, the first done first;
        TimeoutError once ``timeout`` seconds from the call have passed."""
        return pipeline.as_completed(self, pendings, timeout)

    async def evaluate_async(self, states: Any, return_version: bool = False,
                             keys: Any = None) -> Any:
        """``evaluate_many`` for asyncio: ``await client.evaluate_async(states)``.
        The event loop is never blocked: one waiter thread per process
        watches every awaited request."""
        return await pipeline.evaluate_async(self, states, return_version, keys)

    def stats(self) -> Dict[str, Any]:
        """Evaluator statistics read from the segment (any process may ask).
        ``clients`` counts the processes attached now: an exited process's
        entry is not counted, even before the evaluator reclaims it.  The
        serving processes are judged alive when read (pid and start time):
        a killed one's replica reads ``dead``, and with none left serving
        the evaluator reads ``restarting`` while its owner will start one
        again (``Evaluator.spawn(restarts=)``), else ``died``,
        ``stopped_because`` saying that its process vanished.
        ``tuner``, while any setting is ``"auto"``: what the tuner chose and
        why (the first replica's; with several, each replica's in its
        ``replicas`` entry).  ``client_spin``, once this process has
        evaluated through this handle: its spin budgets (``spin_us="auto"``:
        the short and the long arm, each one's mean wait and the arm that
        serves; see ``_ring.SpinArms``)."""
        seg = self._attach()
        raw = seg.raw_stats()
        raw["clients"] = live_clients(seg)
        raw["stop"] = seg.stop_reason()
        raw["replicas"] = seg.replicas()
        # A serving process killed outright (SIGKILL) leaves its replica
        # "serving" in the segment: judge it here, by pid and start time.
        raw["vanished"] = []
        for rep in raw["replicas"]:
            if rep["state"] == "serving" and not segment.is_alive(rep["pid"], rep["starttime"]):
                rep["state"] = "dead"
                raw["vanished"].append(rep["pid"])
        # With restarts left and its owner alive, a vanished process is
        # about to be started again (Evaluator.spawn(restarts=)).
        raw["restarting"] = bool(raw["vanished"]) and seg.restarts_left() > 0 and \
            segment.is_alive(seg.owner_pid, seg.owner_starttime)
        if seg.cache_entries:
            raw["cache"] = _cache_raw(seg)
        st = summarize(raw)
        reports = [read_report(seg, r) for r in range(len(raw["replicas"]))]
        if reports and reports[0] is not None:
            st["tuner"] = reports[0]
        if len(reports) > 1:
            for entry, report in zip(st["replicas"], reports):
                if report is not None:
                    entry["tuner"] = report
        port = self._port
        if port is not None and self._pid == os.getpid():
            st["client_spin"] = port.spin
        return st

    def set_weights(self, weights: Any, *, version: Optional[int] = None,
                    timeout: float = 60.0) -> int:
        """Weights are pushed from the process that created the evaluator,
        through its :class:`~shmeval.Evaluator` object; this handle (a
        pickled Evaluator, or :func:`shmeval.connect`) raises ShmevalError
        saying so."""
        raise ShmevalError(self._not_the_owner("set_weights"))

    def load_weights(self, path: Union[str, "os.PathLike[str]"], *,
                     version: Optional[int] = None, timeout: float = 60.0) -> int:
        """As :meth:`set_weights`: only from the process that created the
        evaluator."""
        raise ShmevalError(self._not_the_owner("load_weights"))

    def _not_the_owner(self, method: str) -> str:
        owner = self._attach().owner_pid
        where = ("this is another handle of it in the same process: call it on the "
                 "Evaluator object" if owner == os.getpid() else
                 f"this is a handle of it in process {os.getpid()}.  Send the weights to that "
                 f"process (for example, let the learner that trains them own the "
                 f"Evaluator), or create the evaluator in the process that has them")
        return (f"{method}: weights are pushed from the process that created the evaluator "
                f"(pid {owner}), through its Evaluator object; {where}")

    def close(self, timeout: float = 10.0) -> None:
        """Detaches this process's client entry; the handle stays usable
        from other processes (and from this one, which then claims a new
        entry).  Requests that other threads of this process have in flight
        are answered first, for up to ``timeout`` seconds; those still
        waiting then raise EvaluatorClosed.  The entry is detached only
        after that, so that no slot of it is ever used by two processes."""
        with self._lock:
            port = self._port
            mine = self._finalizer is not None and self._pid == os.getpid()
            self._pid = -1
            self._c = -1
            self._port = None
            if port is not None:
                port.retired = True  # takes no new request from now on
        if not mine:
            return
        if port is not None and self._seg is not None:
            K = self.spec.slots_per_client
            deadline = time.monotonic() + timeout
            while (len(port.free) + len(port.abandoned) < K
                   and self._seg.ev_state() < _ring.CLOSING and time.monotonic() < deadline):
                # Answers of submissions not collected yet go into their
                # Pendings, which stay collectable.
                if not pipeline.harvest_port(self, port):
                    time.sleep(0.001)
            port.detached = True
        assert self._finalizer is not None
        self._finalizer()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _as_input(self, x: Any, shape: Optional[tuple[int, ...]], what: str) -> np.ndarray:
        spec = self.spec
        a = x if type(x) is np.ndarray else np.asarray(x)
        if a.dtype != spec.input_dtype and (
                a.dtype.hasobject or not np.can_cast(a.dtype, spec.input_dtype, "same_kind")):
            raise TypeError(
                f"{what} has dtype {a.dtype}, which cannot be cast to the expected "
                f"{spec.input_dtype} under 'same_kind' casting")
        # The shape before any cast: a wrong-shaped array is never copied.
        if shape is not None:
            if a.shape != shape:
                raise ValueError(f"{what} has shape {a.shape}, expected {shape}")
        elif a.ndim != len(spec.input_shape) + 1 or a.shape[1:] != spec.input_shape:
            raise ValueError(
                f"{what} has shape {a.shape}, expected (n, {', '.join(map(str, spec.input_shape))}"
                f"{',' if len(spec.input_shape) == 1 else ''})")
        if a.dtype != spec.input_dtype:
            a = a.astype(spec.input_dtype)
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        return a

    def _check_state(self, seg: "_ring.Segment") -> None:
        st = seg.ev_state()
        if st == _ring.DIED:
            raise EvaluatorDied(self._why_died(seg))
        if st >= _ring.CLOSING:
            raise EvaluatorClosed(f"the evaluator serving {self._address} is closed")

    def _why_died(self, seg: "_ring.Segment") -> str:
        """EvaluatorDied's message: what the segment says stopped it."""
        reason, detail = seg.stop_reason()
        who = f"the evaluator serving {self._address}"
        if reason == _ring.STOP_OWNER_DIED:
            return (f"{who} stopped because the process that created it (pid "
                    f"{seg.owner_pid}) died")
        if reason == _ring.STOP_CRASHED:
            return f"{who} died: its serving loop raised (the traceback is on its stderr)"
        if reason == _ring.STOP_EXITED:
            how = f"was killed by signal {-detail}" if detail < 0 else f"exited with code {detail}"
            return f"{who} died: its process {how}"
        return f"{who} died"

    def _check_port(self, port: "_ring.ClientPort", detached: bool = False) -> None:
        """Raises EvaluatorClosed once the handle was closed in this process:
        for new work as soon as the port is retired, for a waiter only once
        the entry is detached (close() waits for answers in flight first)."""
        if port.detached or (port.retired and not detached):
            raise EvaluatorClosed(f"{self} was closed in this process while a request waited")

    def _check_alive(self, seg: "_ring.Segment") -> None:
        """Called after every wait timeout: raises instead of waiting forever
        on an evaluator that is closed or gone (every replica of it)."""
        self._check_state(seg)
        replicas = seg.replicas()
        serving = [r for r in replicas if r["state"] == "serving"]
        if any(segment.is_alive(r["pid"], r["starttime"]) for r in serving):
            return
        if seg.restarts_left() and segment.is_alive(seg.owner_pid):
            # Its owner restarts a dead serving process: this request is
            # served by the new one (Evaluator.spawn(restarts=)).
            return
        if not serving and all(r["state"] == "empty" for r in replicas):
            # Not serving yet: its creator must at least be alive.
            if segment.is_alive(seg.owner_pid, seg.owner_starttime):
                return
            pids = [seg.owner_pid]
        else:
            pids = [r["pid"] for r in replicas if r["pid"]]
        if len(replicas) == 1:
            raise EvaluatorDied(
                f"the evaluator process {pids[0]} serving {self._address} is gone")
        raise EvaluatorDied(f"every replica of the evaluator serving {self._address} is gone "
                            f"(processes {', '.join(map(str, pids))})")

    # Slot allocation.  Single list operations are atomic under the GIL, so
    # the common case (a free slot is there) takes no lock; only a thread that
    # finds too few free slots takes the lock and waits for others to return
    # theirs.  Slots are taken one at a time and all put back before waiting,
    # so threads never hold part of what they need while they wait.
    def _acquire(self, m: int, port: "_ring.ClientPort") -> List[int]:
        """Takes m slots from the free list of port (this process's entry)."""
        free = port.free
        slots: List[int] = []
        if port.abandoned:
            with self._lock:
                self._recover_abandoned(port)
        while True:
            try:
                while len(slots) < m:
                    slots.append(free.pop())
            except IndexError:
                free.extend(slots)
                slots = []
            else:
                if port.retired:  # closed meanwhile: close() waits for what we hold
                    self._give_back(port, slots, [])
                    self._check_port(port)
                return slots
            with self._lock:
                port.waiters += 1
                try:
                    if len(free) < m and not self._slot_freed.wait(WAIT_TIMEOUT_NS / 1e9):
                        self._check_port(port)
                        self._recover_abandoned(port)
                        assert self._seg is not None
                        self._check_alive(self._seg)
                finally:
                    port.waiters -= 1

    def _recover_abandoned(self, port: "_ring.ClientPort") -> None:
        # Slots of requests whose waiting thread was interrupted: they come
        # back once the evaluator has finished with them (or once they were
        # reclaimed: the entry is then unusable, and its next begin says so).
        # Lock held.  One pop or append at a time: a dropped Pending's
        # finalizer appends without the lock (pipeline._Lane.abandon).
        seg = self._seg
        assert seg is not None
        if port.detached:
            return
        abandoned = port.abandoned
        for _ in range(len(abandoned)):
            k, gen = abandoned.pop(0)
            if seg.release(port.c, k, gen) in (0, _ring.STALE):
                port.free.append(k)
            else:
                abandoned.append((k, gen))

    def _give_back(self, port: "_ring.ClientPort", slots: List[int],
                   abandoned: List[tuple[int, int]]) -> None:
        """Returns slots to the free list, and requests in flight (slot,
        generation) to the abandoned list, whose slots come back once
        answered."""
        port.free.extend(slots)
        if abandoned:
            with self._lock:
                port.abandoned.extend(abandoned)
        if port.waiters:
            self._notify_waiters()

    def _notify_waiters(self) -> None:
        with self._lock:
            self._slot_freed.notify_all()

    def _wait_slow(self, seg: "_ring.Segment", port: "_ring.ClientPort", k: int, gen: int,
                   outs: List[np.ndarray], row: int, rc: int) -> int | str:
        """After a wait ended without an answer (rc: timed out, closed, or
        the slot was reclaimed): check the evaluator, wait again or raise."""
        spin_ns = self._spin_ns()
        c = port.c
        while True:
            self._check_port(port, detached=True)
            if rc == _ring.STALE:
                raise EvaluatorClosed(
                    f"{self}: this process's client entry was reclaimed while a request "
                    "waited (the handle was closed here, or the evaluator judged this "
                    "process gone)")
            if rc == _ring.CLOSED:
                self._check_state(seg)
                raise EvaluatorClosed(f"the evaluator serving {self._address} "
                                      "closed before answering")
            self._check_alive(seg)
            r = seg.answer(c, k, gen, outs, row, spin_ns, WAIT_TIMEOUT_NS, self._ncpu)
            if type(r) is not int or r >= 0:
                return r
            rc = r

    def _roundtrip(self, a: np.ndarray, n: int, outs: List[np.ndarray],
                   versions: Optional[np.ndarray] = None, keys: Any = None) -> None:
        """Answers rows 0..n of a into outs (and versions): from the
        evaluation cache where it holds them (by keys, or by the hashes of
        the rows), the others through the evaluator, a client's slots at a
        time."""
        c = self._c if self._pid == os.getpid() else self._register()
        port = self._port  # this call stays on this entry, even if closed meanwhile
        seg = self._seg
        assert seg is not None
        if port is None or port.c != c:  # closed by another thread just now
            raise EvaluatorClosed(f"{self} was closed in this process")
        if seg.cache_entries and seg.ev_state() < _ring.CLOSING:
            rows, k1, k2 = seg.cache_lookup(c, a, keys, outs, versions)
        else:
            rows, k1, k2 = list(range(n)), None, None
        K = self.spec.slots_per_client
        error: Optional[str] = None
        done = 0
        while done < len(rows):
            sent = rows[done:done + K]
            slots = self._acquire(len(sent), port)
            try:
                if seg.ev_state() >= _ring.CLOSING:
                    self._check_state(seg)
                gens = seg.post(c, slots, a, sent, k1, k2, keys is None)
            except BaseException:
                self._give_back(port, slots, [])
                raise
            error = self._answer_posted(port, list(zip(slots, gens)), outs, sent,
                                        versions) or error
            done += len(sent)
        if error is not None:
            raise ModelError(error)

    def _answer_posted(self, port: "_ring.ClientPort", slots: List[tuple[int, int]],
                       outs: List[np.ndarray], row: Union[int, Sequence[int]],
                       versions: Optional[np.ndarray],
                       rc: Optional[int] = None) -> Optional[str]:
        """Waits for and fetches posted requests: slots[i] = (slot,
        generation) holds row rows[i] (row + i when row is an int).  rc: how the wait for slots[0] already
        ended (timed out, closed or reclaimed: the fast path of
        evaluate_many handing over), or None.  Gives every slot back (those
        not answered as abandoned) and returns the error text of the last
        failed row, or None."""
        seg = self._seg
        assert seg is not None
        spin_ns = self._spin_ns()
        error: Optional[str] = None
        rows = range(row, row + len(slots)) if isinstance(row, int) else row
        fetched = 0
        try:
            for (k, gen), i in zip(slots, rows):
                if fetched == 0 and rc is not None:
                    r: Any = rc
                else:
                    r = seg.answer(port.c, k, gen, outs, i, spin_ns, WAIT_TIMEOUT_NS, self._ncpu)
                if type(r) is int and r < 0:
                    r = self._wait_slow(seg, port, k, gen, outs, i, r)
                if type(r) is str:
                    error = r
                elif versions is not None:
                    versions[i] = r
                fetched += 1
        finally:
            self._give_back(port, [k for k, _ in slots[:fetched]], slots[fetched:])
        return error


#: Cache entries stats() looks at to estimate how many are held (a sample
#: spread over a larger table).
CENSUS_SAMPLE = 1 << 16


def _cache_raw(seg: "_ring.Segment") -> Dict[str, Any]:
    """The evaluation cache's counters and census, for stats.summarize."""
    total, per = seg.cache_stats()
    scanned, held, old = seg.cache_census(CENSUS_SAMPLE)
    pids = {c: pid for c, pid, _, _, _ in seg.clients()}
    return dict(total, entries=seg.cache_entries, scanned=scanned, held=held, old=old,
                version=seg.cache_version(),
                clients=[(c, pids.get(c, 0)) + counts for c, counts in sorted(per.items())])


def _cache_keys(keys: Any, n: int) -> Any:
    """The caller's evaluation-cache keys for n states, checked: n ints
    (an int array or a sequence of ints)."""
    if isinstance(keys, np.ndarray):
        if keys.dtype.kind not in "iu":
            raise TypeError(f"keys must be integers, got an array of {keys.dtype}")
        if keys.shape != (n,):
            raise ValueError(f"keys has shape {keys.shape}; {n} states need ({n},)")
        return keys
    keys = list(keys)
    if len(keys) != n:
        raise ValueError(f"{len(keys)} keys for {n} states")
    for k in keys:
        if isinstance(k, (bool, np.bool_)) or not hasattr(k, "__index__"):
            raise TypeError(f"keys must be integers, got {type(k).__name__}")
    return keys


def live_clients(seg: "_ring.Segment") -> int:
    """Client entries whose process is attached now: not detached, and alive
    (an entry recorded from another pid namespace is counted, as it cannot
    be judged from here)."""
    mine = segment.namespaces().pid
    return sum(1 for _c, pid, starttime, pid_ns, detached in seg.clients()
               if not detached and ((pid_ns and mine and pid_ns != mine)
                                    or segment.is_alive(pid, starttime)))


def _detach(seg: "_ring.Segment", c: int, pid: int) -> None:
    if os.getpid() == pid:
        try:
            seg.detach(c)
        except ShmevalError:  # pragma: no cover - defensive at exit
            pass


def _unpickle(address: str, spec_json: Optional[bytes], spin_us: Union[float, str]) -> Client:
    spec = Spec.from_json(spec_json) if spec_json is not None else None
    return Client(address, spec, spin_us)


def connect(address: str, spin_us: Union[float, str, None] = AUTO) -> Client:
    """Attaches to a running evaluator by its address (``ev.address``).

    Raises :class:`~shmeval.SegmentError` when there is no such segment or it
    is not a compatible shmeval segment.
    """
    client = Client(address, spin_us=spin_us)
    client._attach()
    return client
