"""The client side: a handle on an evaluator.

A ``Client`` is a light handle (an address and a spec).  It attaches on first
use in each process and claims one client-table entry per process
(``shmeval.entry.ProcessEntry``); the threads of a process share that
entry's K slots through a process-local free list, so each slot is used by
one thread at a time.  Every request goes through the entry's port
(``_ring.ClientPort``, written in Cython): ``evaluate``, ``evaluate_many``
and ``submit`` below each call one of its methods.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, Dict, Iterable, Iterator, Literal, Optional, Union, overload

import numpy as np

from . import _ring, entry, pipeline, segment
from .errors import EvaluatorClosed, ShmevalError
from .spec import Spec
from .stats import summarize
from .checks import AUTO
from .stats import DEVICE_LOST, read_report
from .waiting import check_spin_auto

Outputs = Dict[str, np.ndarray]
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
        self._entry: Optional[entry.ProcessEntry] = None  # this process's
        self._port: Optional[_ring.ClientPort] = None     # ... and its port
        self._lock = threading.Lock()
        self._lock_pid = os.getpid()
        self._finalizer: Optional["weakref.finalize[Any, Any]"] = None
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

    def _register(self) -> "_ring.ClientPort":
        """The port of this process's client entry, claimed on first use
        (a forked child claims its own, and a closed handle a new one)."""
        pid = os.getpid()
        if self._pid == pid and self._port is not None:
            return self._port
        if self._lock_pid != pid:
            # First use after a fork: a lock inherited from the parent may be
            # held by a thread that does not exist here.
            self._lock = threading.Lock()
            self._lock_pid = pid
        with self._lock:
            if self._pid != pid or self._port is None:
                seg = self._attach()
                e = entry.ProcessEntry(self._address, seg, self.spec, self._spin_us)
                self._entry, self._port = e, e.port
                self._c = e.c
                self._pid = pid
                self._finalizer = weakref.finalize(self, _detach, seg, e.c, pid)
            return self._port

    # ------------------------------------------------------------ public API
    @overload
    def evaluate(self, state: Any, *, key: Optional[int] = None,
                 method: Optional[str] = None) -> Outputs: ...
    @overload
    def evaluate(self, state: Any, return_version: Literal[False],
                 key: Optional[int] = None, method: Optional[str] = None) -> Outputs: ...
    @overload
    def evaluate(self, state: Any, return_version: Literal[True],
                 key: Optional[int] = None,
                 method: Optional[str] = None) -> tuple[Outputs, int]: ...
    @overload
    def evaluate(self, state: Any, return_version: bool, key: Optional[int] = None,
                 method: Optional[str] = None) -> Outputs | tuple[Outputs, int]: ...

    def evaluate(self, state: Any, return_version: bool = False, key: Optional[int] = None,
                 method: Optional[str] = None) -> Outputs | tuple[Outputs, int]:
        """Evaluates one state; returns ``{name: array of the output's shape}``,
        or ``(outputs, model_version)`` with ``return_version=True``: the
        version of the weights that computed it (0 for the model the
        evaluator started with, then as set by ``Evaluator.set_weights``).
        With an evaluation cache (``cache_entries``), ``key`` is the state's
        cache key (any int, e.g. a Zobrist hash; taken modulo 2**64) instead
        of a hash of its bytes; without one it is ignored.  Where the inputs
        are named (``inputs=``, ``methods=``), ``state`` is a dict ``{name:
        array}``; where there are several methods, ``method`` names the one
        to call."""
        return _ring.port_of(self).evaluate(state, return_version, key, method)  # type: ignore[no-any-return]

    @overload
    def evaluate_many(self, states: Any, *, keys: Any = None,
                      method: Optional[str] = None) -> Outputs: ...
    @overload
    def evaluate_many(self, states: Any, return_version: Literal[False], keys: Any = None,
                      method: Optional[str] = None) -> Outputs: ...
    @overload
    def evaluate_many(self, states: Any, return_version: Literal[True], keys: Any = None,
                      method: Optional[str] = None) -> tuple[Outputs, np.ndarray]: ...
    @overload
    def evaluate_many(self, states: Any, return_version: bool, keys: Any = None,
                      method: Optional[str] = None) -> Outputs | tuple[Outputs, np.ndarray]: ...

    def evaluate_many(self, states: Any, return_version: bool = False, keys: Any = None,
                      method: Optional[str] = None) -> Outputs | tuple[Outputs, np.ndarray]:
        """Evaluates a batch ``[n, *input_shape]``; returns arrays with a
        leading dimension n.  Any n works: more than the client's slots are
        sent in several rounds.  With ``return_version=True`` returns
        ``(outputs, versions)``, versions an int64 array of n model versions
        (rows may be computed in different batches, so versions may differ).
        ``keys``: n evaluation-cache keys (ints), instead of hashes of
        the states' bytes; rows the cache holds are answered at once and
        only the others are sent.  Named inputs: a dict of arrays, each
        with the same leading dimension n; ``method``: as for
        :meth:`evaluate`."""
        return _ring.port_of(self).evaluate_many(states, return_version, keys, method)  # type: ignore[no-any-return]

    # Pipelined evaluation: shmeval.pipeline (docs/guide.md, Pipelining).
    def submit(self, states: Any, *, block: bool = True, return_version: bool = False,
               keys: Any = None, method: Optional[str] = None) -> "pipeline.Pending":
        """Posts states ``[n, *input_shape]`` (n at most ``slots_per_client``)
        and returns at once a :class:`~shmeval.pipeline.Pending`, whose
        ``result()`` returns what ``evaluate_many`` would (``keys``: as
        there).  With too few free slots it waits for the evaluator to
        answer this process's other requests, or with ``block=False``
        raises :class:`~shmeval.pipeline.NoFreeSlots`.  ``states`` and
        ``method``: as for :meth:`evaluate_many`."""
        return _ring.port_of(self).submit(states, block, return_version, keys, method)

    def wait_any(self, pendings: Iterable["pipeline.Pending"],
                 timeout: Optional[float] = None) -> "pipeline.Pending":
        """The first of ``pendings`` (submitted through this handle in this
        process) whose ``result()`` returns or raises without waiting;
        TimeoutError after ``timeout`` seconds."""
        return pipeline.wait_any(self._process_entry(), pendings, timeout)

    def as_completed(self, pendings: Iterable["pipeline.Pending"],
                     timeout: Optional[float] = None) -> Iterator["pipeline.Pending"]:
        """Yields each of ``pendings`` as it is done, the first done first;
        TimeoutError once ``timeout`` seconds from the call have passed."""
        return pipeline.as_completed(self._process_entry(), pendings, timeout)

    async def evaluate_async(self, states: Any, return_version: bool = False,
                             keys: Any = None, method: Optional[str] = None) -> Any:
        """``evaluate_many`` for asyncio: ``await client.evaluate_async(states)``.
        The event loop is never blocked: one waiter thread per process
        watches every awaited request."""
        return await pipeline.evaluate_async(self._process_entry(), states, return_version, keys,
                                             method)

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
        ``replicas`` entry).  A replica that ended itself because its
        model's device failed (``DeviceLost``) has that error in its
        ``replicas`` entry as ``device_lost`` until it is restarted.
        ``client_spin``, once this process has
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
        if len(seg.layouts) > 1:
            raw["methods"] = [(lay.name, counts)
                              for lay, counts in zip(seg.layouts, seg.method_stats())]
        st = summarize(raw)
        reports = [read_report(seg, r) for r in range(len(raw["replicas"]))]
        # A replica that ended itself because its device failed published
        # that error in place of its tuner's report.
        for entry, report in zip(st["replicas"], reports):
            if report is not None and DEVICE_LOST in report:
                entry["device_lost"] = report[DEVICE_LOST]
                if st["state"] == "died":
                    st["stopped_because"] = f"its model's device failed: {report[DEVICE_LOST]}"
        tuners = [r if r is None or DEVICE_LOST not in r else None for r in reports]
        if tuners and tuners[0] is not None:
            st["tuner"] = tuners[0]
        if len(tuners) > 1:
            for entry, report in zip(st["replicas"], tuners):
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
            e = self._entry
            mine = self._finalizer is not None and self._pid == os.getpid()
            self._pid = -1
            self._c = -1
            self._port = None
            self._entry = None
            if e is not None:
                e.port.retired = True  # takes no new request from now on
        if not mine:
            return
        if e is not None and self._seg is not None:
            e.drain(timeout)
        assert self._finalizer is not None
        self._finalizer()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _process_entry(self) -> entry.ProcessEntry:
        """This process's entry (registering it on first use)."""
        _ring.port_of(self)
        e = self._entry
        if e is None:  # closed by another thread just now
            raise EvaluatorClosed(f"{self} was closed in this process")
        return e

    def _check_state(self, seg: "_ring.Segment") -> None:
        entry.check_state(seg, self._address)

    def _check_alive(self, seg: "_ring.Segment") -> None:
        entry.check_alive(seg, self._address)


# The three request methods run as Cython functions of the same one line
# each (_ring.client_evaluate, client_evaluate_many, client_submit, bound as
# methods, with the docstrings above): with a Python frame around every
# request, `python bench/ab_builds.py --a 69f5c90 --b . --workers 16` read
# 0.89 of the old build's round trips on 2 cores, without it 0.95.
for _name in ("evaluate", "evaluate_many", "submit"):
    _call = getattr(_ring, "client_" + _name)
    _call.__doc__ = getattr(Client, _name).__doc__
    setattr(Client, _name, _call)
del _name, _call


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
