"""A simulated GPU: one device shared by every process of a run, which
computes one call at a time, a call of ``rows`` rows costing
``CALL_US + ROW_US x rows`` microseconds.  The answers still come from the
real model; the device only decides when each call's answers are handed
back.  ``--device sim[:CALL_US,ROW_US]`` of ``shmeval selfplay`` puts every
mode's net behind it (docs/selfplay.md, *A simulated GPU*).

The device is a timeline in a small shared-memory file (``/dev/shm``,
``shmeval-<pid>-simgpu-<random>``, made by :class:`SimDevice` and unlinked
by its ``close``): the time it is busy until, and counters.  A call
(:class:`SimModel`):

1. takes the device's lock (``flock`` on that file, and a thread lock for
   the threads of one process), books the interval ``[start, end)`` with
   ``start`` the later of now and the end of the last booked call, and
   releases the lock: calls are served one at a time, in the order they
   came, and their intervals never overlap;
2. computes the real answers with the wrapped model;
3. sleeps until ``end`` (``time.sleep``: the GIL is released and the
   caller costs no CPU while it waits, as a caller blocked on a GPU).

The device's busy time is booked, not slept under the lock, so a caller
that wakes late (a busy host, the sleep's own overshoot) does not hold the
device: the next call starts when the device is free, as on a GPU.

**The real model's own compute.** Step 2 runs outside the lock, while the
device is (simulated to be) busy, so its time is hidden behind the wait
for the device whenever it is shorter.  Where it is longer, the call
returns when the answers are ready, after its device interval: the host,
not the device, sets the pace, and the device counts it
(``late_calls``, ``late_ms_per_call``).  The real compute also takes the
CPU that the callers' other work (the search) would have: a GPU would take
it off the host.  On a machine with fewer cores than processes this is
the simulation's limit; ``busy_share`` (the share of a window the device
was booked) says whether a run was held by the device or by the host.

**The defaults** (:data:`DEFAULT_CALL_US`, :data:`DEFAULT_ROW_US`) are
estimates for the self-play demo's net (2 residual blocks of 32 filters on
a 6 x 7 board: 29 kernels per forward, 1.58 M multiply-adds per row) on
one H100-class GPU, served as shmeval's ``TorchModel`` serves a net on a
GPU, one CUDA graph replay per call:

- per call 80 us: the copy in and the copy out, about 5-7 us each to
  submit (``cudaMemcpyAsync``, measured in *DualPath*, arXiv 2602.21548),
  and the graph's 29 small kernels at about 2 us each (CUDA.jl's
  documentation: an 8-kernel MLP at batch 16 takes 16 us as one graph, 50 us
  launched kernel by kernel), and the graph's launch.  Launched op by op from eager PyTorch the same forward
  costs more per call (5-25 us of host time per op); the simulation
  charges every mode the graph's cost, which favours the modes that make
  many small calls.
- per row 0.25 us: 3.2 MFLOP per row at 13 TFLOPS, a fifth of the H100
  SXM's FP32 peak (67 TFLOPS) for such small convolutions (Leela Zero's
  5 x 64 net reached a third of a GTX 1080 Ti's FP32 peak per added row:
  leela-zero issue #1601).  At the demo's batches (14-128 rows) the rows
  add 4-32 us, so an error of 2x here moves a call's cost by 25% at most.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import math
import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import posix_ipc

#: Microseconds per call and per row of ``--device sim`` (see the module's
#: docstring for where they come from).
DEFAULT_CALL_US = 80.0
DEFAULT_ROW_US = 0.25

# The shared file: int64 fields.
FREE_AT_NS, CALLS, ROWS, BUSY_NS, QUEUE_NS, HOST_NS, LATE_CALLS, LATE_NS, OVERSLEEP_NS = range(9)
N_FIELDS = 16
SIZE = N_FIELDS * 8

#: A call's times (``time.monotonic_ns``, the same clock in every process):
#: booked, device start, device end, answers ready, returned.
Trace = Tuple[int, int, int, int, int]

_PR_SET_TIMERSLACK = 29


@dataclass(frozen=True)
class SimSpec:
    """What a call of the simulated device costs."""

    call_us: float = DEFAULT_CALL_US
    row_us: float = DEFAULT_ROW_US

    def cost_ns(self, rows: int) -> int:
        return round(1000.0 * (self.call_us + self.row_us * rows))

    def __str__(self) -> str:
        return f"sim:{self.call_us:g},{self.row_us:g}"


def parse_device(text: str) -> Optional[SimSpec]:
    """``--device``: "cpu" (None: the net runs as it is), "sim" (the
    default costs) or "sim:CALL_US,ROW_US" (microseconds, >= 0, finite).
    ValueError saying what is wrong otherwise."""
    t = text.strip()
    if t == "cpu":
        return None
    if t == "sim":
        return SimSpec()
    if not t.startswith("sim:"):
        raise ValueError(f"device must be cpu, sim or sim:CALL_US,ROW_US, got {text!r}")
    parts = t[4:].split(",")
    if len(parts) != 2:
        raise ValueError(f"sim:CALL_US,ROW_US takes two numbers (microseconds per call and "
                         f"per row), got {text!r}")
    try:
        call_us, row_us = (float(p) for p in parts)
    except ValueError:
        raise ValueError(f"sim:CALL_US,ROW_US takes two numbers (microseconds per call and "
                         f"per row), got {text!r}") from None
    if not (math.isfinite(call_us) and math.isfinite(row_us)) or call_us < 0 or row_us < 0:
        raise ValueError(f"the simulated device's costs must be finite and >= 0, got {text!r}")
    if call_us + row_us == 0:
        raise ValueError(f"a simulated device that costs nothing per call and per row is no "
                         f"device: {text!r}")
    return SimSpec(call_us, row_us)


_slack = threading.local()


def _fine_timer_slack() -> None:
    """Once per thread: 1 us of timer slack instead of Linux's 50 us, so that
    a sleep until a call's end overshoots by about 20 us, not 70."""
    if getattr(_slack, "set", False):
        return
    _slack.set = True
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)


def sleep_until(t_ns: int) -> None:
    """Sleeps (the GIL released) until ``time.monotonic_ns()`` reaches ``t_ns``."""
    _fine_timer_slack()
    while True:
        left = t_ns - time.monotonic_ns()
        if left <= 0:
            return
        time.sleep(left / 1e9)


class SimLink:
    """A process's way to the device: picklable (the file's name and the
    costs); it opens the file in the process that first uses it."""

    def __init__(self, name: str, spec: SimSpec) -> None:
        self.name = name
        self.spec = spec
        self._pid = 0
        self._fd = -1
        self._map: Optional[mmap.mmap] = None
        self._c: Optional[memoryview] = None
        self._tlock = threading.Lock()

    def __getstate__(self) -> Dict[str, Any]:
        return {"name": self.name, "spec": self.spec}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["name"], state["spec"])  # type: ignore[misc]

    def _counters(self) -> memoryview:
        # A forked child must open its own file description: flock locks
        # belong to the description, which fork shares with the parent.
        if self._c is None or self._pid != os.getpid():
            shm = posix_ipc.SharedMemory(self.name)
            self._fd = shm.fd
            self._map = mmap.mmap(shm.fd, SIZE)
            self._c = memoryview(self._map).cast("q")
            self._pid = os.getpid()
        return self._c

    def book(self, rows: int) -> Tuple[int, int, int]:
        """Books a call of ``rows`` rows: (booked, start, end) in
        ``time.monotonic_ns`` time."""
        cost = self.spec.cost_ns(rows)
        c = self._counters()
        with self._tlock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                now = time.monotonic_ns()
                start = max(now, c[FREE_AT_NS])
                end = start + cost
                c[FREE_AT_NS] = end
                c[CALLS] += 1
                c[ROWS] += rows
                c[BUSY_NS] += cost
                c[QUEUE_NS] += start - now
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        return now, start, end

    def settle(self, booked: int, end: int, ready: int, returned: int) -> None:
        """Counts how a call ended: the real compute's time, whether its
        answers came after the device's end, the sleep's overshoot."""
        c = self._counters()
        with self._tlock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                c[HOST_NS] += ready - booked
                if ready > end:
                    c[LATE_CALLS] += 1
                    c[LATE_NS] += ready - end
                else:
                    c[OVERSLEEP_NS] += returned - end
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def counters(self) -> Dict[str, int]:
        """The device's counters now (read without the lock: each field is
        whole, the fields may be a call apart)."""
        c = self._counters()
        return {"calls": c[CALLS], "rows": c[ROWS], "busy_ns": c[BUSY_NS],
                "queue_ns": c[QUEUE_NS], "host_ns": c[HOST_NS], "late_calls": c[LATE_CALLS],
                "late_ns": c[LATE_NS], "oversleep_ns": c[OVERSLEEP_NS]}

    def close(self) -> None:
        """Unmaps this process's view (the file stays until the owner's close)."""
        if self._map is not None:
            if self._c is not None:
                self._c.release()
                self._c = None
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        if self._fd >= 0 and self._pid == os.getpid():
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = -1


class SimModel:
    """``model`` behind the simulated device: each call books the device
    for its rows, computes the real answers and returns them at the end of
    its booked interval (or when they are ready, if later).  Every other
    attribute (``prepare``, ``set_weights``, ``max_concurrency``...) is the
    model's own, so the evaluator serves it as it serves the model.
    ``trace``: a list to which each call appends its :data:`Trace`."""

    def __init__(self, model: Any, link: SimLink, trace: Optional[List[Trace]] = None) -> None:
        self.model = model
        self.link = link
        self.trace = trace

    def __call__(self, batch: Any) -> Any:
        link = self.link
        booked, start, end = link.book(len(batch))
        out = self.model(batch)
        ready = time.monotonic_ns()
        sleep_until(end)
        returned = time.monotonic_ns()
        link.settle(booked, end, ready, returned)
        if self.trace is not None:
            self.trace.append((booked, start, end, ready, returned))
        return out

    def __getattr__(self, name: str) -> Any:
        if name in ("model", "link", "trace"):  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.model, name)


class SimDevice:
    """The device of one run: creates the shared file (unique name) and
    unlinks it on :meth:`close` (or at the end of a ``with`` block).
    ``link`` is what the run's processes are given."""

    def __init__(self, spec: SimSpec, name: Optional[str] = None) -> None:
        self.spec = spec
        self.name = name or f"/shmeval-{os.getpid()}-simgpu-{secrets.token_hex(6)}"
        shm = posix_ipc.SharedMemory(self.name, posix_ipc.O_CREX, mode=0o600, size=SIZE)
        os.close(shm.fd)  # zero-filled: free at time 0, every counter 0
        self.link = SimLink(self.name, spec)
        self._closed = False

    def counters(self) -> Dict[str, int]:
        return self.link.counters()

    def close(self) -> None:
        """Unlinks the file; processes that still map it keep their view."""
        if self._closed:
            return
        self._closed = True
        self.link.close()
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.name)

    def __enter__(self) -> "SimDevice":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def device_result(d: Dict[str, Any], window_s: float) -> Dict[str, Any]:
    """What a run reports of the device from its counters' change ``d``
    (keys as :meth:`SimLink.counters`) over a window of ``window_s``."""
    calls = d["calls"]

    def per_call(ns: float) -> Optional[float]:
        return ns / 1e6 / calls if calls else None

    return {
        "calls": calls, "rows": d["rows"],
        "rows_per_call": d["rows"] / calls if calls else None,
        # The share of the window the device was booked: near 1, the
        # device set the pace; well below, the host did.
        "busy_share": d["busy_ns"] / 1e9 / window_s if window_s > 0 else None,
        "queue_ms_per_call": per_call(d["queue_ns"]),
        "host_ms_per_call": per_call(d["host_ns"]),
        "late_calls": d["late_calls"],
        # (a call booked before the window and settled in it counts in
        # late_calls only: at most a call per caller)
        "late_share": min(1.0, d["late_calls"] / calls) if calls else None,
        "late_ms_per_call": per_call(d["late_ns"]),
        # How far past its end a call whose answers were ready in time
        # woke up: the host's wake-up, not the device's time.
        "oversleep_us_per_call": (d["oversleep_ns"] / 1e3 / (calls - d["late_calls"])
                                  if calls > d["late_calls"] else None),
    }


def device_bound_rate(spec: SimSpec, rows_per_call: Optional[float]) -> Optional[float]:
    """Rows/s the device serves when always busy with calls of
    ``rows_per_call`` rows: what a mode would reach if the host kept up."""
    if not rows_per_call:
        return None
    return 1e6 * rows_per_call / (spec.call_us + spec.row_us * rows_per_call)


def wrap_if(link: Optional[SimLink], model: Callable[..., Any]) -> Any:
    """``model`` behind the device when there is one, else ``model``."""
    return model if link is None else SimModel(model, link)
