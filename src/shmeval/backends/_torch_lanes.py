"""``TorchModel`` on a CUDA device: lanes.  A lane is what one call in
flight needs: a CUDA stream, and for each method page-locked staging
buffers for its inputs and outputs, device buffers for its inputs and,
with CUDA graphs, one graph per batch size.  Each serving thread keeps a
lane, so that one thread's batch is copied to the GPU while another's
computes, and the page-locked outputs a call returned are not overwritten
by another thread before the evaluator has copied them into the slots.

Imported by ``shmeval.backends.torch`` only (it imports PyTorch).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..errors import ModelError
from ._torch_method import ServedMethod, naming


@dataclass
class LaneMethod:
    """One method's buffers in a lane, for batches of up to the lane's
    rows: page-locked inputs (and NumPy views of them), their device
    copies, page-locked outputs (and views), and its CUDA graphs by batch
    size, each with the tensors it writes its outputs to."""

    host_in: list[Any]
    host_in_np: list[np.ndarray]
    device_in: list[Any]
    host_out: list[Any]
    host_out_np: list[np.ndarray]
    graphs: dict[int, tuple[Any, list[Any]]] = field(default_factory=dict)


@dataclass
class Lane:
    """A stream, and each method's buffers (``methods[i]`` for the
    TorchModel's i-th method); all its graphs share one memory pool, since
    a lane runs one call at a time and its outputs are copied out before
    the next."""

    stream: Any
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
    method's largest first)."""
    with torch.inference_mode():
        lane = Lane(stream=torch.cuda.Stream(device))
        for m in methods:
            assert m.spec is not None
            host_in = [torch.empty((rows, *f.shape), dtype=dt, pin_memory=True)
                       for f, dt in zip(m.spec.inputs, m.in_dtypes)]
            host_out = [torch.empty((rows, *o.shape), dtype=want, pin_memory=True)
                        for o, want in zip(m.spec.outputs, m.want)]
            lane.methods.append(LaneMethod(
                host_in=host_in, host_in_np=[t.numpy() for t in host_in],
                device_in=[torch.zeros_like(t, device=device) for t in host_in],
                host_out=host_out, host_out_np=[t.numpy() for t in host_out]))
        if cuda_graphs:
            for m, buffers in zip(methods, lane.methods):
                with naming(m):
                    for n in sorted(graph_sizes, reverse=True):
                        buffers.graphs[n] = _capture(device, lane, buffers, m, n)
    return lane


def _capture(device: Any, lane: Lane, buffers: LaneMethod, m: ServedMethod,
             rows: int) -> tuple[Any, list[Any]]:
    """One CUDA graph of the method's fitted function for ``rows`` rows of
    the lane's device buffers, and the tensors it writes its outputs to."""
    xs = [x[:rows] for x in buffers.device_in]
    # The buffers were zeroed on the current stream.
    lane.stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(lane.stream):
        # Warm-up runs before capture: lazy initialisation, cuDNN's choice
        # of algorithms and torch.compile happen outside the graph.
        for _ in range(2):
            m.fitted(xs)
    lane.stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=lane.pool, stream=lane.stream):
            out = m.fitted(xs)
    except ModelError:
        raise
    except Exception as e:
        raise ModelError(f"TorchModel could not capture the model in a CUDA graph for a "
                         f"batch of {rows} ({type(e).__name__}: {e}); serve it with "
                         "cuda_graphs=False") from e
    if lane.pool is None:
        lane.pool = graph.pool()
    lane.captures += 1
    return graph, out


def call_on_lane(lane: Lane, index: int, m: ServedMethod,
                 xs: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """Method ``m`` (the TorchModel's ``index``-th) on the batch ``xs``
    (its inputs in the declared order) on ``lane``: its outputs as views
    of the lane's page-locked buffers, which the lane's next call
    overwrites."""
    rows = len(xs[0])
    buffers = lane.methods[index]
    for host, x in zip(buffers.host_in_np, xs):
        np.copyto(host[:rows], x, casting="same_kind")
    with torch.cuda.stream(lane.stream):
        device_in = [x[:rows] for x in buffers.device_in]
        for x, host in zip(device_in, buffers.host_in):
            x.copy_(host[:rows], non_blocking=True)
        graph = buffers.graphs.get(rows)
        if graph is not None:
            graph[0].replay()
            out = graph[1]
        else:
            out = m.fitted(device_in)
        for host, t in zip(buffers.host_out, out):
            host[:rows].copy_(t, non_blocking=True)
    # Releases the GIL while it waits: another serving thread's batch is
    # gathered and copied meanwhile.
    lane.stream.synchronize()
    return {name: a[:rows] for name, a in zip(m.names, buffers.host_out_np)}
