"""``TorchModel`` on a CUDA device: lanes.  A lane is what one call in
flight needs: a CUDA stream, an event that says when the call's work is
done, and for each method page-locked staging buffers for its inputs, their
device copies, one device buffer and one page-locked buffer that hold all
its outputs packed together (one copy back per call) and, with CUDA graphs,
one graph per batch size.  Each serving thread keeps a lane, so that one
thread's batch is copied to the GPU while another's computes, and the
page-locked outputs a call returned are not overwritten by another thread
before the evaluator has copied them into the slots.

How a thread waits for its lane's work is :class:`GpuWait`.  Lanes are
built one at a time in the process (:data:`BUILD_LOCK`), and their graphs
captured in CUDA's thread-local capture mode, so that serving threads and
a training thread beside them may use CUDA while a lane is built.

Imported by ``shmeval.backends.torch`` only (it imports PyTorch).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from ..errors import ModelError
from ..waiting import MAX_SPIN_US, wake_cost_ns
from ._torch_method import ServedMethod, naming

#: Runs of a function on the lane's buffers before its capture, as in
#: PyTorch's own CUDA graph examples: lazy initialisation, the choices of
#: cuDNN's and cuBLAS's algorithms and torch.compile's work happen outside
#: the graph.
WARMUPS = 3

#: Each output's bytes in a packed output buffer start at a multiple of
#: this (the largest NumPy item size), so that every output's view of them
#: is aligned.
ALIGN = 16

#: Held while a lane is built.  PyTorch allows one graph capture at a time
#: per process, and a lane built while serving (a thread beyond the lanes
#: built at start-up) must not capture while another thread builds one.
BUILD_LOCK = threading.Lock()

#: ``TorchModel(gpu_wait=...)``'s named policies.
BLOCK, SPIN = "block", "spin"


@dataclass(frozen=True)
class GpuWait:
    """How a serving thread waits for its lane's work on the GPU: it looks
    at the lane's event (``query``) for up to ``spin_us`` µs, yielding its
    CPU and the GIL between looks, then blocks on it (``synchronize``).
    The event is made blocking (``torch.cuda.Event(blocking=True)``, CUDA's
    ``cudaEventBlockingSync``), so the block sleeps in the driver until the
    GPU is done; a stream's own ``synchronize`` would spin a CPU for the
    whole wait, one per serving thread, which the workers on the same
    machine then lack.

    ``spin_us``: 0 blocks at once (``"block"``); None spins for one
    wake-up's cost first (``"spin"``: :func:`shmeval.waiting.wake_cost_ns`,
    measured in this process at the first wait), which is never worse than
    twice the better of spinning and sleeping chosen in hindsight."""

    spin_us: Optional[float]

    @classmethod
    def of(cls, setting: Union[str, float]) -> "GpuWait":
        """``"block"``, ``"spin"`` or a spin budget in µs (0 to
        MAX_SPIN_US); ValueError for anything else."""
        if setting == BLOCK:
            return cls(0.0)
        if setting == SPIN:
            return cls(None)
        if isinstance(setting, (int, float)) and not isinstance(setting, bool) \
                and 0 <= setting <= MAX_SPIN_US:
            return cls(float(setting))
        raise ValueError(f"TorchModel gpu_wait must be {BLOCK!r}, {SPIN!r} or a spin budget in "
                         f"µs from 0 to {MAX_SPIN_US:g}, got {setting!r}")

    def spin_ns(self) -> int:
        """The spin budget in ns."""
        return wake_cost_ns() if self.spin_us is None else int(self.spin_us * 1000)

    def wait(self, event: Any) -> None:
        """Returns once the work ``event`` was recorded after is done."""
        budget = self.spin_ns()
        if budget > 0:
            end = time.perf_counter_ns() + budget
            while not event.query():
                if time.perf_counter_ns() >= end:
                    break
                os.sched_yield()  # releases the GIL: another serving thread runs meanwhile
            else:
                return
        event.synchronize()  # releases the GIL while it sleeps


def packed_offsets(rows: int, row_bytes: Sequence[int]) -> list[int]:
    """Where each output's ``rows`` rows start in a packed buffer (each
    output's rows follow the previous output's, at ALIGN-byte offsets),
    and after them the bytes the batch fills."""
    offsets, at = [], 0
    for b in row_bytes:
        offsets.append(at)
        at = -(-(at + rows * b) // ALIGN) * ALIGN
    return offsets + [at]


@dataclass
class Cut:
    """A method's lane buffers cut to one batch size, made once per size
    (LaneMethod.cut): what a call of that many rows copies in, runs on and
    copies back, and what it returns."""

    #: Where the batch is copied to (page-locked), as arrays and as tensors.
    host_in: list[np.ndarray]
    host_in_t: list[Any]
    #: The model's inputs on the device.
    device_in: list[Any]
    #: Each output's place in the packed device buffer (several outputs).
    device_out: list[Any]
    #: The device bytes copied back (several outputs; else the output).
    device_packed: Any
    #: Where they are copied to (page-locked).
    host_packed: Any
    #: The outputs by name, as the caller reads them: views of host_packed.
    host_out: dict[str, np.ndarray]

    def pack(self, out: Sequence[Any]) -> Any:
        """Packs the outputs ``out`` (the fitted function's) on the device
        and returns what to copy into ``host_packed``: the packed bytes,
        or the only output itself."""
        if len(out) == 1:
            return out[0]
        for dst, t in zip(self.device_out, out):
            dst.copy_(t)
        return self.device_packed


class LaneMethod:
    """One method's buffers in a lane, for batches of up to ``rows`` rows:
    page-locked inputs and their device copies; the outputs packed into one
    device buffer (with several outputs; one output is copied back from
    where the function wrote it) and one page-locked buffer; and the CUDA
    graphs by batch size, each with what it leaves to be copied back
    (which also keeps the graph's outputs alive: no later capture into the
    lane's memory pool reuses their memory).  ``pin`` is False only where
    tests build one on the CPU."""

    def __init__(self, m: ServedMethod, rows: int, device: Any, pin: bool = True) -> None:
        assert m.spec is not None
        self.names = m.names
        self.shapes = [o.shape for o in m.spec.outputs]
        self.dtypes = list(m.want)
        self.row_bytes = [int(np.prod(s, dtype=np.int64)) * t.itemsize
                          for s, t in zip(self.shapes, self.dtypes)]
        self.host_in = [torch.empty((rows, *f.shape), dtype=dt, pin_memory=pin)
                        for f, dt in zip(m.spec.inputs, m.in_dtypes)]
        self.host_in_np = [t.numpy() for t in self.host_in]
        self.device_in = [torch.zeros((rows, *f.shape), dtype=dt, device=device)
                          for f, dt in zip(m.spec.inputs, m.in_dtypes)]
        size = packed_offsets(rows, self.row_bytes)[-1]
        self.host_out = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        self.device_out = (torch.empty(size, dtype=torch.uint8, device=device)
                           if len(self.names) > 1 else None)
        self.graphs: dict[int, tuple[Any, Any]] = {}
        self._cuts: dict[int, Cut] = {}

    def cut(self, rows: int) -> Cut:
        """The buffers cut to ``rows`` rows (made at the first call for
        that many, then the same views)."""
        found = self._cuts.get(rows)
        if found is None:
            found = self._cuts[rows] = self._make_cut(rows)
        return found

    def _make_cut(self, rows: int) -> Cut:
        at = packed_offsets(rows, self.row_bytes)
        host_views, device_out = [], []
        for j, (shape, dtype) in enumerate(zip(self.shapes, self.dtypes)):
            start, stop = at[j], at[j] + rows * self.row_bytes[j]
            host_views.append(self.host_out[start:stop].view(dtype).view(rows, *shape))
            if self.device_out is not None:
                device_out.append(self.device_out[start:stop].view(dtype).view(rows, *shape))
        if self.device_out is not None:
            device_packed, host_packed = self.device_out[:at[-1]], self.host_out[:at[-1]]
        else:  # the only output is copied back as the function left it
            device_packed, host_packed = None, host_views[0]
        return Cut(host_in=[a[:rows] for a in self.host_in_np],
                   host_in_t=[t[:rows] for t in self.host_in],
                   device_in=[t[:rows] for t in self.device_in],
                   device_out=device_out, device_packed=device_packed,
                   host_packed=host_packed,
                   host_out={name: t.numpy() for name, t in zip(self.names, host_views)})


@dataclass
class Lane:
    """A stream, the event recorded after each call's work on it, and each
    method's buffers (``methods[i]`` for the TorchModel's i-th method); all
    its graphs share one memory pool, since a lane runs one call at a time
    and its outputs are copied out before the next."""

    stream: Any
    done: Any
    methods: list[LaneMethod] = field(default_factory=list)
    pool: Any = None
    captures: int = 0


class ThreadLane(threading.local):
    """The lane a thread calls the model on (None until its first call)."""

    lane: Optional[Lane] = None


def build_lane(device: Any, methods: Sequence[ServedMethod], rows: int,
               graph_sizes: Sequence[int], cuda_graphs: bool) -> Lane:
    """A lane for batches of up to ``rows`` of each method, with a CUDA
    graph per size in ``graph_sizes`` when ``cuda_graphs`` is on (each
    method's largest first).  The caller holds BUILD_LOCK, and has made
    ``device`` its thread's current device (torch.cuda.graph synchronises
    the current device)."""
    assert BUILD_LOCK.locked()
    with torch.inference_mode():
        stream = torch.cuda.Stream(device)
        # The lane's work comes after what this thread queued before it (the
        # module's weights moved to the device, on this thread's stream).
        stream.wait_stream(torch.cuda.current_stream(device))
        lane = Lane(stream=stream, done=torch.cuda.Event(blocking=True))
        # Made, and the device inputs zeroed, on the lane's stream: its
        # first copy in cannot overtake the zeroing.
        with torch.cuda.stream(stream):
            lane.methods = [LaneMethod(m, rows, device) for m in methods]
        if cuda_graphs:
            for m, buffers in zip(methods, lane.methods):
                with naming(m):
                    for n in sorted(graph_sizes, reverse=True):
                        buffers.graphs[n] = _capture(lane, buffers, m, n)
    return lane


def _capture(lane: Lane, buffers: LaneMethod, m: ServedMethod, rows: int) -> tuple[Any, Any]:
    """One CUDA graph of the method's fitted function for ``rows`` rows of
    the lane's device inputs, packing its outputs as a call does, and what
    it leaves to be copied back (Cut.pack)."""
    cut = buffers.cut(rows)
    with torch.cuda.stream(lane.stream):
        for _ in range(WARMUPS):
            cut.pack(m.fitted(cut.device_in))
    lane.stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        # Thread-local: CUDA calls of other threads (serving threads, a
        # training thread) do not invalidate this capture; only this
        # thread's own would.
        with torch.cuda.graph(graph, pool=lane.pool, stream=lane.stream,
                              capture_error_mode="thread_local"):
            source = cut.pack(m.fitted(cut.device_in))
    except ModelError:
        raise
    except Exception as e:
        raise ModelError(f"TorchModel could not capture the model in a CUDA graph for a "
                         f"batch of {rows} ({type(e).__name__}: {e}); serve it with "
                         "cuda_graphs=False") from e
    if lane.pool is None:
        lane.pool = graph.pool()
    lane.captures += 1
    return graph, source


def call_on_lane(lane: Lane, index: int, m: ServedMethod, xs: Sequence[np.ndarray],
                 wait: GpuWait) -> dict[str, np.ndarray]:
    """Method ``m`` (the TorchModel's ``index``-th) on the batch ``xs``
    (its inputs in the declared order) on ``lane``, waiting as ``wait``
    says: its outputs as views of the lane's page-locked buffer, which the
    lane's next call overwrites.  The batch is copied into the page-locked
    inputs (the evaluator's batch is ordinary memory), and the outputs come
    back in one copy."""
    cut = lane.methods[index].cut(len(xs[0]))
    for host, x in zip(cut.host_in, xs):
        np.copyto(host, x, casting="same_kind")
    with torch.cuda.stream(lane.stream):
        for x, host in zip(cut.device_in, cut.host_in_t):
            x.copy_(host, non_blocking=True)
        graph = lane.methods[index].graphs.get(len(xs[0]))
        if graph is not None:
            graph[0].replay()
            source = graph[1]
        else:
            source = cut.pack(m.fitted(cut.device_in))
        cut.host_packed.copy_(source, non_blocking=True)
        lane.done.record(lane.stream)
    wait.wait(lane.done)
    return dict(cut.host_out)
