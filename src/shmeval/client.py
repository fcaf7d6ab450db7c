"""The client side: input checks, copy into slots, doorbell, wait, copy out.

A ``Client`` is a light handle (an address and a spec).  It attaches on first
use in each process and claims one client-table entry per process; the
threads of a process share that entry's K slots through a process-local free
list, so each slot is used by one thread at a time.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Dict, List, Optional

import numpy as np

from . import _ring, segment
from .errors import EvaluatorClosed, EvaluatorDied, ModelError, ShmevalError
from .spec import Spec
from .stats import summarize

Outputs = Dict[str, np.ndarray]

#: How long one blocking wait lasts before the evaluator's liveness is checked.
WAIT_TIMEOUT_NS = 100_000_000
#: Default client spin budget (µs) while the attached processes fit on the cores.
DEFAULT_SPIN_US = 50.0


def _ncpu() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class Client:
    """A handle on an evaluator: ``evaluate``, ``evaluate_many``, ``stats``.

    Obtained by pickling an :class:`~shmeval.Evaluator` into a child process,
    or from :func:`shmeval.connect`.  Safe to use from several threads.
    """

    def __init__(self, address: str, spec: Optional[Spec] = None,
                 spin_us: Optional[float] = None,
                 _segment: Optional["_ring.Segment"] = None) -> None:
        self._address = address
        self._spec = spec
        self._spin_us = DEFAULT_SPIN_US if spin_us is None else float(spin_us)
        if self._spin_us < 0:
            raise ValueError(f"spin_us must be >= 0, got {spin_us}")
        self._seg: Optional[_ring.Segment] = _segment
        self._pid = -1           # process that owns the registration below
        self._c = -1             # client-table index in this process
        self._free: List[int] = []
        self._abandoned: List[int] = []
        self._lock = threading.Lock()
        self._slot_freed = threading.Condition(self._lock)
        self._lock_pid = os.getpid()
        self._closed = False
        self._finalizer: Optional["weakref.finalize[Any, Any]"] = None
        self._ncpu = _ncpu()

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
        return self._seg

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
            if self._closed:
                raise EvaluatorClosed(f"{self} was closed in this process")
            seg = self._attach()
            self._check_state(seg)
            c = seg.register(pid, segment.process_starttime(pid) or 0)
            self._free = list(range(self.spec.slots_per_client))
            self._abandoned = []
            self._c = c
            self._pid = pid
            self._finalizer = weakref.finalize(self, _detach, seg, c, pid)
        return c

    # ------------------------------------------------------------ public API
    def evaluate(self, state: Any) -> Outputs:
        """Evaluates one state; returns ``{name: array of the output's shape}``."""
        spec = self.spec
        a = self._as_input(state, spec.input_shape, "state")
        outs = [np.empty(o.shape, o.dtype) for o in spec.outputs]
        self._roundtrip(a, 1, outs)
        return dict(zip(spec.output_names, outs))

    def evaluate_many(self, states: Any) -> Outputs:
        """Evaluates a batch ``[n, *input_shape]``; returns arrays with a
        leading dimension n.  Any n works: more than the client's slots are
        sent in several rounds."""
        spec = self.spec
        a = self._as_input(states, None, "states")
        n = a.shape[0]
        outs = [np.empty((n,) + o.shape, o.dtype) for o in spec.outputs]
        if n:
            self._roundtrip(a, n, outs)
        return dict(zip(spec.output_names, outs))

    def stats(self) -> Dict[str, Any]:
        """Evaluator statistics read from the segment (any process may ask)."""
        return summarize(self._attach().raw_stats())

    def close(self) -> None:
        """Detaches this process's client entry; the handle stays usable
        from other processes."""
        with self._lock:
            if self._finalizer is not None and self._pid == os.getpid():
                self._finalizer()
            self._pid = -1
            self._c = -1
            self._free = []

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _as_input(self, x: Any, shape: Optional[tuple[int, ...]], what: str) -> np.ndarray:
        spec = self.spec
        a = x if type(x) is np.ndarray else np.asarray(x)
        if a.dtype != spec.input_dtype:
            if a.dtype.hasobject or not np.can_cast(a.dtype, spec.input_dtype, "same_kind"):
                raise TypeError(
                    f"{what} has dtype {a.dtype}, which cannot be cast to the expected "
                    f"{spec.input_dtype} under 'same_kind' casting")
            a = a.astype(spec.input_dtype)
        if shape is not None:
            if a.shape != shape:
                raise ValueError(f"{what} has shape {a.shape}, expected {shape}")
        elif a.ndim != len(spec.input_shape) + 1 or a.shape[1:] != spec.input_shape:
            raise ValueError(
                f"{what} has shape {a.shape}, expected (n, {', '.join(map(str, spec.input_shape))}"
                f"{',' if len(spec.input_shape) == 1 else ''})")
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        return a

    def _check_state(self, seg: "_ring.Segment") -> None:
        st = seg.ev_state()
        if st == _ring.DIED:
            raise EvaluatorDied(f"the evaluator serving {self._address} died")
        if st >= _ring.CLOSING:
            raise EvaluatorClosed(f"the evaluator serving {self._address} is closed")

    def _check_alive(self, seg: "_ring.Segment") -> None:
        """Called after every wait timeout: raises instead of waiting forever
        on an evaluator that is closed or gone."""
        self._check_state(seg)
        pid, starttime = seg.ev_pid()
        if pid == 0:  # not serving yet: its creator must at least be alive
            pid, starttime = seg.owner_pid, 0
        if not segment.is_alive(pid, starttime):
            raise EvaluatorDied(
                f"the evaluator process {pid} serving {self._address} is gone")

    def _acquire(self, m: int) -> List[int]:
        """Takes m slots from this process's free list, waiting for other
        threads to return theirs if needed."""
        seg = self._seg
        assert seg is not None
        with self._lock:
            if self._abandoned:
                self._recover_abandoned(seg)
            while len(self._free) < m:
                if not self._slot_freed.wait(WAIT_TIMEOUT_NS / 1e9):
                    self._recover_abandoned(seg)
                    self._check_alive(seg)
            slots = self._free[-m:]
            del self._free[-m:]
        return slots

    def _recover_abandoned(self, seg: "_ring.Segment") -> None:
        # Slots of requests whose waiting thread was interrupted: they come
        # back once the evaluator has finished with them.  Lock held.
        still = []
        for k in self._abandoned:
            if seg.is_final(self._c, k) and seg.release(self._c, k):
                self._free.append(k)
            else:
                still.append(k)
        self._abandoned = still

    def _give_back(self, slots: List[int], abandoned: List[int]) -> None:
        with self._lock:
            self._free.extend(slots)
            self._abandoned.extend(abandoned)
            self._slot_freed.notify_all()

    def _roundtrip(self, a: np.ndarray, n: int, outs: List[np.ndarray]) -> None:
        c = self._register()
        seg = self._seg
        assert seg is not None
        K = self.spec.slots_per_client
        spin_ns = int(self._spin_us * 1000)
        error: Optional[str] = None
        done = 0
        while done < n:
            m = min(K, n - done)
            slots = self._acquire(m)
            fetched = 0
            posted = False
            try:
                self._check_state(seg)
                seg.post(c, slots, a, done)
                posted = True
                for i, k in enumerate(slots):
                    while True:
                        rc = seg.wait(c, k, spin_ns, WAIT_TIMEOUT_NS, self._ncpu)
                        if rc > 0:
                            break
                        if rc == _ring.CLOSED:
                            self._check_state(seg)
                            raise EvaluatorClosed(f"the evaluator serving {self._address} "
                                                  "closed before answering")
                        self._check_alive(seg)
                    r = seg.fetch(c, k, outs, done + i)
                    fetched += 1
                    if isinstance(r, str):
                        error = r
            finally:
                if posted:
                    self._give_back(slots[:fetched], slots[fetched:])
                else:
                    self._give_back(slots, [])
            done += m
        if error is not None:
            raise ModelError(error)


def _detach(seg: "_ring.Segment", c: int, pid: int) -> None:
    if os.getpid() == pid:
        try:
            seg.detach(c)
        except ShmevalError:  # pragma: no cover - defensive at exit
            pass


def _unpickle(address: str, spec_json: Optional[bytes], spin_us: float) -> Client:
    spec = Spec.from_json(spec_json) if spec_json is not None else None
    return Client(address, spec, spin_us)


def connect(address: str, spin_us: Optional[float] = None) -> Client:
    """Attaches to a running evaluator by its address (``ev.address``).

    Raises :class:`~shmeval.SegmentError` when there is no such segment or it
    is not a compatible shmeval segment.
    """
    client = Client(address, spin_us=spin_us)
    client._attach()
    return client
