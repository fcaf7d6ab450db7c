"""PyTorch backend: ``TorchModel`` serves an ``nn.Module``, a TorchScript
file or an exported program (``torch.export``) to a shmeval evaluator.

Import this module only in the process that runs the model (it imports
PyTorch)::

    def factory():
        from shmeval.backends.torch import TorchModel
        return TorchModel("net.pt2")

    ev = shmeval.Evaluator.spawn(factory, input_shape=..., outputs=...,
                                 serving_threads=2)

What it does for the evaluator:

* ``prepare(spec, buckets)`` compiles the model for every batch size it
  will serve (``torch.compile`` and CUDA graphs are optional), runs each
  size once, and checks the outputs against the declared ones (matched by
  name, else by order; reshaped and cast as the evaluator's rules say), so
  that a mismatch raises ``ModelError`` at start-up and serving never
  compiles again;
* ``__call__(batch)`` runs the model under ``torch.inference_mode`` and
  returns ``{name: ndarray}`` with exactly the declared dtypes and shapes;
  on a GPU the batch travels through a page-locked staging buffer on a
  CUDA stream of its own, and the outputs come back into page-locked
  buffers that the evaluator reads directly;
* on the CPU an ``nn.Module`` is traced and frozen (``torch.jit.trace``,
  ``torch.jit.freeze``) where the frozen module answers as the module does:
  it runs without Python between its ops, so it is cheaper per call and
  two serving threads overlap their calls (``max_concurrency``); small
  batches go to a second frozen form whose convolutions run on PyTorch's
  own kernel instead of oneDNN's, up to the batch size where start-up
  timing found it no longer cheaper (``own_conv_rows``);
* ``set_weights`` / ``load_weights`` copy new values into the parameters
  and buffers in place (compiled code and CUDA graphs keep serving them; a
  frozen module is frozen again).
"""
from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from ..errors import ModelError
from ..spec import Spec
from ._contract import (PathLike, Refold, best_ns, castable, check_warm_outputs,
                        checked_weights, match_outputs, needs_reshape, npz_weights, own_buckets,
                        pow2_buckets, serving_sizes)
from ._device import threads_per_call

#: Autocast dtypes ``dtype=`` accepts.
_AUTOCAST = {"float16": torch.float16, "bfloat16": torch.bfloat16}

#: How close the frozen module's answers must be to the module's for
#: freeze="auto" to serve it (float outputs; others must be equal).
FREEZE_RTOL, FREEZE_ATOL = 1e-4, 1e-6


def _default_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _device(device: Union[None, str, torch.device]) -> torch.device:
    """The device to serve on; ValueError when this machine has no such
    device (a CUDA index beyond the GPUs, or CUDA without a GPU)."""
    d = _default_device() if device is None else torch.device(device)
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"TorchModel: device {str(d)!r} is not available here "
                             "(torch.cuda.is_available() is False)")
        d = torch.device("cuda", torch.cuda.current_device() if d.index is None else d.index)
        if d.index >= torch.cuda.device_count():
            raise ValueError(f"TorchModel: device {str(d)!r} is not available here "
                             f"({torch.cuda.device_count()} CUDA device(s))")
    elif d.type != "cpu":
        raise ValueError(f"TorchModel serves on a CPU or a CUDA device, got {str(d)!r}")
    return d


def _load(source: Any, device: torch.device) -> Any:
    """The module to serve, on ``device``: ``source`` itself, or what a path
    holds (``.pt2``: an exported program, else a TorchScript file)."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if path.endswith(".pt2"):
            source = torch.export.load(path)
        else:
            try:
                return torch.jit.load(path, map_location=device)
            except (RuntimeError, ValueError) as e:
                raise ValueError(f"TorchModel: {path!r} is neither an exported program "
                                 "(torch.export.save, a .pt2 file) nor a TorchScript file "
                                 f"(torch.jit.save): {e}") from None
    if isinstance(source, torch.export.ExportedProgram):
        from torch.export.passes import move_to_device_pass

        return move_to_device_pass(source, device).module()
    if isinstance(source, torch.nn.Module):
        return source.to(device)
    raise TypeError(f"TorchModel needs an nn.Module, an ExportedProgram, a TorchScript file "
                    f"or a .pt2 file, got {type(source).__name__}")


@functools.lru_cache(maxsize=None)
def _numpy_dtype(dtype: Any) -> Optional[np.dtype[Any]]:
    """The NumPy dtype of a torch dtype (None for bfloat16 and others
    NumPy lacks)."""
    try:
        found: np.dtype[Any] = torch.empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        return None
    return found


def _torch_dtype(dtype: np.dtype[Any], what: str) -> Any:
    try:
        return torch.from_numpy(np.empty(0, dtype.newbyteorder("="))).dtype
    except TypeError:
        raise ModelError(f"TorchModel: PyTorch has no dtype for the {what} {dtype}") from None


def _own_convolutions(frozen: Any) -> int:
    """Rewrites, in place, the 2-d convolutions of a frozen TorchScript
    module's graph that PyTorch's own kernel can run (a constant 4-d weight,
    not transposed, no dilation, one group, numeric padding) into
    ``aten::thnn_conv2d``, the kernel PyTorch itself picks for a batch of
    one row (from two rows on it calls oneDNN's, whose set-up per call can
    cost more than a small batch's arithmetic).  Returns how many."""
    graph = frozen.graph
    done = 0
    for node in list(graph.nodes()):
        if node.kind() != "aten::_convolution":
            continue
        x, w, bias, stride, padding, dilation, transposed, _, groups = list(node.inputs())[:9]
        weight = w.toIValue()
        pads = padding.toIValue()
        if not isinstance(weight, torch.Tensor) or weight.dim() != 4 or transposed.toIValue() \
                or groups.toIValue() != 1 or dilation.toIValue() != [1, 1] \
                or not isinstance(pads, list) or not isinstance(stride.toIValue(), list):
            continue
        with graph.insert_point_guard(node):
            kernel = graph.insertConstant(list(weight.shape[2:]))
            own = graph.create("aten::thnn_conv2d", [x, w, kernel, bias, stride, padding])
            graph.insertNode(own)
        own.output().setType(node.output().type())
        node.output().replaceAllUsesWith(own.output())
        node.destroy()
        done += 1
    if done:
        torch._C._jit_pass_lint(graph)
    return done


def _as_array(w: Any) -> np.ndarray:
    """A weight as an ndarray: a tensor on any device (bfloat16 as
    float32), or anything NumPy takes."""
    if isinstance(w, torch.Tensor):
        t = w.detach().cpu()
        if _numpy_dtype(t.dtype) is None:
            t = t.float()
        return np.asarray(t.numpy())
    return np.asarray(w)


@dataclass
class _Lane:
    """What one CUDA call in flight needs: its stream, page-locked staging
    buffers for the batch and the outputs, the batch's device buffer, and
    with CUDA graphs one graph per batch size, with its output tensors."""

    stream: Any
    host_in: Any
    host_in_np: np.ndarray
    device_in: Any
    host_out: list[Any]
    host_out_np: list[np.ndarray]
    graphs: dict[int, tuple[Any, list[Any]]] = field(default_factory=dict)
    pool: Any = None


class _ThreadLane(threading.local):
    """The lane a thread calls the model on: each serving thread keeps one,
    so that the page-locked outputs it returned are not overwritten by
    another thread before the evaluator has copied them into the slots."""

    lane: Optional[_Lane] = None


class TorchModel:
    """A PyTorch model as a shmeval evaluator model.

    ``module_or_path``: an ``nn.Module`` (moved to ``device`` and put in
    eval mode), a ``torch.export.ExportedProgram``, a TorchScript file
    (``torch.jit.save``) or an exported program's ``.pt2`` file
    (``torch.export.save``).  Its forward takes one tensor ``[rows,
    *input_shape]`` and returns a tensor, a tuple or list (a named tuple's
    fields name its entries) or a dict of tensors.

    ``device``: where it runs (default the first CUDA device if there is
    one, else the CPU).  ``compile``: ``True`` compiles the forward with
    ``torch.compile`` (inductor), a string names another ``torch.compile``
    backend; once per batch size, so batches are padded to buckets.
    ``cuda_graphs`` (default: on a CUDA device): capture one CUDA graph per
    batch size and replay it, which saves the launch cost of every kernel;
    needs buckets too, and a model that CUDA graphs can capture (no
    synchronisation with the host inside).  ``freeze`` (CPU only; default
    ``"auto"``): serve the module traced and frozen (``torch.jit.trace``
    then ``torch.jit.freeze``, which folds the weights into the graph), a
    graph that runs without Python between its ops, so it costs less per
    call and two serving threads overlap their calls.  ``"auto"`` freezes
    an ``nn.Module`` or TorchScript module on the CPU (without ``compile``
    or ``dtype``) when tracing raises no error or warning and the frozen
    module's answers to random batches of two sizes match the module's;
    otherwise it serves the module as it is, and ``freeze_reason`` says
    why.  A frozen module's 2-d convolutions go to oneDNN from two rows on,
    whose set-up per call can outweigh a small batch's arithmetic; where
    PyTorch's own kernel computes the same convolution (no dilation, one
    group, not transposed), a second frozen form calls it, answers as the
    module does (checked), and serves the batches up to ``own_conv_rows``:
    both forms are timed at start-up at each batch size served (powers of
    two without buckets) from 2 rows up, and the split falls where their
    costs cross (0: the frozen module serves every size).  Tracing records
    the tensor operations of one call: Python side effects in ``forward``
    (counters, prints, sleeps) do not run in the frozen module;
    ``freeze=False`` keeps them.  After a weight update ``"auto"`` serves
    the module until its calls have lost, against frozen ones (measured at
    start-up), what freezing again costs, then freezes again
    (``freeze_s``): updates that come often cost little, rare ones are
    frozen again soon.  ``True``: freeze, also at once after every
    update, or raise ``ModelError``.  ``dtype``: ``"float16"`` or
    ``"bfloat16"`` runs the forward under ``torch.autocast`` (for the GPU;
    outputs are cast back to the declared dtypes).  ``buckets``: batch
    sizes to pad to when the evaluator has none; with ``compile`` or
    ``cuda_graphs`` and no buckets anywhere, powers of two up to
    ``max_batch``.  ``lanes`` (CUDA only, default 2): lanes built at
    start-up, each a CUDA stream with its own page-locked buffers and
    graphs, kept by the first thread that calls on it: give the evaluator
    as many ``serving_threads``, so that one batch is copied to the GPU
    while the previous one computes (a thread beyond them builds a lane
    of its own at its first call, while serving, with a warning).
    ``intra_op_threads``: ``torch.set_num_threads``, a process-wide
    setting.  ``"auto"`` (the default; on the CPU only, at ``prepare``):
    the CPUs this process may use split between the calls that may be in
    flight (``max_concurrency``), as ``TFModel`` does: one thread each on
    2 CPUs with two serving threads, where PyTorch's own default (one per
    core for every call) puts two threads of each call on every core.  An
    int sets that many at once; None leaves PyTorch's default.

    After ``prepare``: ``compile_count`` (graphs ``torch.compile``
    produced; constant while serving), ``graph_captures`` (CUDA graphs
    captured), ``frozen`` (whether the frozen module serves),
    ``freeze_reason``, ``own_conv_rows``, ``freeze_s`` (seconds the last
    freeze took, both frozen forms) and
    ``warmup_s`` (seconds ``prepare`` took).

    ``max_concurrency`` (read by the evaluator's tuner after ``prepare``):
    on a GPU ``lanes`` (a thread's batch is copied while another's
    computes); on the CPU 2 while the frozen module serves (its calls hold
    the GIL only to enter and leave the graph), else 1 (an unfrozen
    module's Python between ops makes two threads slower than one).
    """

    def __init__(self, module_or_path: Any, *, device: Union[None, str, Any] = None,
                 compile: Union[bool, str] = False, cuda_graphs: Optional[bool] = None,
                 dtype: Union[None, str, Any] = None, buckets: Optional[Sequence[int]] = None,
                 lanes: int = 2, intra_op_threads: Union[int, str, None] = "auto",
                 freeze: Union[bool, str] = "auto") -> None:
        if freeze not in (True, False, "auto"):
            raise ValueError(f"TorchModel(freeze=...) must be True, False or 'auto', "
                             f"got {freeze!r}")
        self.device = _device(device)
        cuda = self.device.type == "cuda"
        self.cuda_graphs = cuda if cuda_graphs is None else bool(cuda_graphs)
        if self.cuda_graphs and not cuda:
            raise ValueError(f"TorchModel(cuda_graphs=True) needs a CUDA device, not "
                             f"{str(self.device)!r}")
        self.autocast: Any = None
        if dtype is not None:
            name = str(dtype).removeprefix("torch.")
            if name not in _AUTOCAST:
                raise ValueError(f"TorchModel dtype must be float16 or bfloat16 (autocast), "
                                 f"got {dtype!r}")
            self.autocast = _AUTOCAST[name]
        if type(lanes) is not int or lanes < 1:
            raise ValueError(f"TorchModel lanes must be a positive int, got {lanes!r}")
        self.lanes = lanes
        if intra_op_threads is not None and intra_op_threads != "auto" and (
                type(intra_op_threads) is not int or intra_op_threads < 1):
            raise ValueError(f"TorchModel intra_op_threads must be a positive int, 'auto' or "
                             f"None, got {intra_op_threads!r}")
        self.intra_op_threads = intra_op_threads
        if type(intra_op_threads) is int:
            torch.set_num_threads(intra_op_threads)
        self.buckets = own_buckets(buckets, "TorchModel")
        self.compile: Union[bool, str] = compile
        self.module = _load(module_or_path, self.device)
        with contextlib.suppress(NotImplementedError):  # an exported program's module
            self.module.eval()
        self.compile_count = 0
        self.graph_captures = 0
        self.warmup_s = 0.0
        self.freeze: Union[bool, str] = freeze
        self.frozen = False
        self.freeze_reason = "not prepared yet"
        # The frozen form whose convolutions run on PyTorch's own kernel,
        # served for batches of up to own_conv_rows rows.
        self._small: Any = None
        self.own_conv_rows = 0
        # freeze="auto" after a weight update: the module serves (_refold),
        # and is frozen again once its calls have lost what freezing costs
        # (each call at least 1 us, so that it comes however the saving was
        # measured).
        self._refold = False
        self._fold = Refold(floor_ns=1000.0)
        why_not = self._freeze_unsupported()
        if freeze is True and why_not:
            raise ValueError(f"TorchModel(freeze=True): {why_not}")
        if why_not:
            self.freeze = False
            self.freeze_reason = f"served unfrozen: {why_not}"
        self.spec: Optional[Spec] = None
        self._forward: Callable[[Any], Any] = self.module
        if compile:
            backend = "inductor" if compile is True else str(compile)
            self._forward = torch.compile(self.module, backend=self._counting(backend),
                                          dynamic=False)
        self._want: list[Any] = []       # the declared output dtypes, as torch dtypes
        self._names: tuple[str, ...] = ()
        self._declared: list[tuple[tuple[int, ...], Any]] = []  # (shape per row, dtype)
        self._input_dtype: Any = None
        # CUDA: lanes no thread has taken yet, and what a lane is built for.
        self._free_lanes: Optional[queue.SimpleQueue[_Lane]] = None
        self._lane_rows = 0
        self._graph_sizes: tuple[int, ...] = ()
        self._thread = _ThreadLane()

    @property
    def freeze_s(self) -> float:
        """Seconds the last trace and freeze took (0 before any)."""
        return self._fold.cost_ns / 1e9

    @property
    def max_concurrency(self) -> int:
        """Calls that may overlap usefully: on a GPU one per lane, on the
        CPU 2 while the frozen module serves, else 1 (see the class's
        docstring)."""
        if self.device.type == "cuda":
            return self.lanes
        return 2 if self.frozen or self._refold else 1

    # -- freezing -------------------------------------------------------------------

    def _freeze_unsupported(self) -> str:
        """Why this model cannot be served frozen ("" when it can)."""
        if not self.freeze:
            return "freeze=False"
        if self.device.type != "cpu":
            return f"freezing is for the CPU; on {self.device} CUDA graphs save the calls' cost"
        if self.compile:
            return "compile= is set (torch.compile serves it)"
        if self.autocast is not None:
            return "dtype= is set (autocast)"
        if isinstance(self.module, torch.fx.GraphModule):
            return "an exported program"
        return ""

    def _example(self, rows: int) -> Any:
        """A batch of ``rows`` random states of the declared input dtype."""
        assert self.spec is not None
        g = torch.Generator().manual_seed(rows)
        shape = (rows, *self.spec.input_shape)
        if self._input_dtype.is_floating_point:
            return torch.randn(shape, generator=g).to(self._input_dtype).to(self.device)
        return torch.randint(0, 2, shape, generator=g).to(self._input_dtype).to(self.device)

    def _traced(self) -> Any:
        """The module traced (a TorchScript module as it is) and frozen;
        ModelError when tracing warns that the trace may not generalise."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", torch.jit.TracerWarning)
            with torch.no_grad():
                m = self.module
                if not isinstance(m, torch.jit.ScriptModule):
                    m = torch.jit.trace(m, self._example(2), strict=False, check_trace=False)
                frozen = torch.jit.freeze(m.eval())
        for w in caught:
            if issubclass(w.category, torch.jit.TracerWarning):
                raise ModelError(f"tracing warned: {str(w.message).splitlines()[0]}")
        return frozen

    def _answers(self, forward: Any, x: Any) -> list[Any]:
        assert self.spec is not None
        with torch.inference_mode():
            out = forward(x)
        return list(match_outputs(out, self.spec.output_names, getattr(out, "_fields", ())))

    def _same_answers(self, frozen: Any) -> str:
        """"" when ``frozen`` answers random batches of 1 and 5 rows as the
        module does, else how they differ."""
        for rows in (1, 5):
            x = self._example(rows)
            assert self.spec is not None
            for name, a, b in zip(self.spec.output_names,
                                  self._answers(self.module, x), self._answers(frozen, x)):
                if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or \
                        a.shape != b.shape or a.dtype != b.dtype:
                    return f"output {name!r} differs in type, shape or dtype ({rows} rows)"
                same = (torch.allclose(a, b, rtol=FREEZE_RTOL, atol=FREEZE_ATOL, equal_nan=True)
                        if a.is_floating_point() else torch.equal(a, b))
                if not same:
                    return f"output {name!r} differs from the module's ({rows} rows)"
        return ""

    def _try_freeze(self, sizes: Optional[Sequence[int]]) -> None:
        """prepare(): serves the frozen module where ``freeze`` allows it and
        it answers as the module does, and for small batches its form with
        PyTorch's own convolution where that is cheaper.  freeze=True:
        ModelError when it cannot freeze."""
        if not self.freeze:
            return
        try:
            frozen = self._fold.timed(self._traced)
            why = self._same_answers(frozen)
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            why = (str(e) if isinstance(e, ModelError)
                   else f"tracing failed: {type(e).__name__}: {first[:200]}")
        if why:
            if self.freeze is True:
                raise ModelError(f"TorchModel(freeze=True) cannot freeze this module: {why}")
            self.freeze_reason = f"served unfrozen: {why}"
            return
        self._forward = frozen
        self.frozen = True
        self.freeze_reason = "traced and frozen; its answers match the module's"
        if self.freeze == "auto":
            self._fold.saving = self._measure_saving(frozen)
        self._try_own_convolutions(frozen, sizes)

    def _own_conv_form(self) -> Any:
        """The module traced, frozen, and its convolutions rewritten to
        PyTorch's own kernel (_own_convolutions); None when none could be."""
        small = self._traced()
        return small if _own_convolutions(small) else None

    def _try_own_convolutions(self, frozen: Any, sizes: Optional[Sequence[int]]) -> None:
        """prepare(), the frozen module serving: serves batches of up to
        ``own_conv_rows`` rows with its form on PyTorch's own convolution
        where that answers as the module does and is cheaper at two rows.
        Any failure leaves the frozen module serving every size."""
        t = time.perf_counter_ns()
        try:
            small = self._own_conv_form()
            if small is None or self._same_answers(small):
                return
        except Exception:
            return
        cost = time.perf_counter_ns() - t
        rows = self._own_conv_rows(frozen, small, sizes)
        if rows >= 2:
            self._small, self.own_conv_rows = small, rows
            self._fold.cost_ns += cost  # rebuilt with the frozen module

    @staticmethod
    def _call_ns(forward: Any, x: Any) -> float:
        """ns per call of ``forward(x)``, once warm: fastest of three rounds
        of five calls."""
        forward(x)
        forward(x)
        return best_ns(lambda: [forward(x) for _ in range(5)]) / 5

    def _own_conv_rows(self, frozen: Any, small: Any, sizes: Optional[Sequence[int]]) -> int:
        """The largest batch the form on PyTorch's own convolution serves
        more cheaply than the frozen module on oneDNN's: both timed at each
        size served (powers of two without buckets) from 2 rows up, until
        the first where oneDNN's is cheaper; the sizes between that and the
        last where it was not are split where the two costs, taken as a line
        between them, cross."""
        assert self.spec is not None
        points = [n for n in (sizes or pow2_buckets(self.spec.max_batch)) if n >= 2]
        last: Optional[tuple[int, float]] = None  # (rows, ns saved) of the last win
        with torch.inference_mode():
            for rows in points:
                x = self._example(rows)
                cost = [self._call_ns(f, x) for f in (frozen, small)]
                saved = cost[0] - cost[1]
                if saved <= 0:
                    if last is None:
                        return 0
                    r0, s0 = last
                    return r0 + int((rows - r0) * s0 / (s0 - saved))
                last = (rows, saved)
        return points[-1] if points else 0

    def _measure_saving(self, frozen: Any) -> tuple[float, float]:
        """What a frozen call saves against the module's, in ns per call and
        per row (a line through 1 row and a larger batch; fastest of three
        rounds each)."""
        assert self.spec is not None
        big = max(2, min(self.spec.max_batch, 16))
        cost = {}
        with torch.inference_mode():
            for rows in (1, big):
                x = self._example(rows)
                for name, f in (("module", self.module), ("frozen", frozen)):
                    f(x)
                    cost[name, rows] = best_ns(lambda: [f(x) for _ in range(5)]) / 5
        s1 = cost["module", 1] - cost["frozen", 1]
        sb = cost["module", big] - cost["frozen", big]
        per_row = (sb - s1) / (big - 1)
        return s1 - per_row, per_row

    def _after_update(self) -> None:
        """The weights changed, and the frozen graph holds the old ones:
        freeze=True freezes again now; "auto" serves the module until its
        calls have lost what freezing costs (_count_loss), so that updates
        that come often cost little and rare ones are frozen again soon."""
        if self.freeze is True:
            try:
                self._freeze_again()
            except Exception as e:
                self._unfreeze(f"freezing again after a weight update failed: {e}")
                raise ModelError(f"TorchModel(freeze=True) cannot freeze the new weights: "
                                 f"{e}") from e
            return
        self._unfreeze("unfrozen since a weight update; frozen again once its calls have "
                       f"lost what freezing costs ({self._fold.cost_ns / 1e6:.0f} ms)")
        self._refold = True
        self._fold.lost_ns = 0.0

    def _count_loss(self, rows: int) -> None:
        """freeze="auto", unfrozen since an update: counts what this call lost
        against a frozen one (at least 1 us), and freezes again, in this
        call's thread, once that reaches what freezing costs (Refold)."""
        self._fold.charge(rows, self._refreeze_due)

    def _refreeze_due(self) -> None:
        if not self._refold:  # another thread did it
            return
        self._refold = False
        try:
            self._freeze_again()
        except Exception as e:
            self.freeze_reason = f"served unfrozen: freezing again failed: {e}"

    def _freeze_again(self) -> None:
        """Traces and freezes the module with its current weights and serves
        that, with its form on PyTorch's own convolution where that served
        (the answers were checked at start-up)."""
        frozen, small = self._fold.timed(
            lambda: (self._traced(), self._own_conv_form() if self.own_conv_rows else None))
        self._small = small
        self._forward = frozen
        self.frozen = True
        self.freeze_reason = "traced and frozen again after a weight update"

    def _unfreeze(self, why: str) -> None:
        self._small = None
        self._forward = self.module
        self.frozen = False
        self.freeze_reason = f"served unfrozen: {why}"

    def _counting(self, backend: str) -> Callable[..., Any]:
        """``backend`` (a torch.compile backend's name), counting the graphs
        it compiles in ``compile_count``."""
        from torch._dynamo import lookup_backend

        compile_graph = lookup_backend(backend)

        def counted(graph: Any, example_inputs: Any) -> Any:
            self.compile_count += 1
            return compile_graph(graph, example_inputs)

        return counted

    # -- running the model ----------------------------------------------------------

    def _autocast(self) -> Any:
        if self.autocast is None:
            return contextlib.nullcontext()
        # No cached casts of the weights: a CUDA graph must read the
        # parameters themselves, which weight updates overwrite in place.
        return torch.autocast(self.device.type, dtype=self.autocast, cache_enabled=False)

    def _fitted(self, x: Any) -> list[Any]:
        """The model's outputs for ``x``, in declaration order, each reshaped
        to ``[rows, *declared shape]`` and cast to the declared dtype, on
        the model's device; ModelError when one does not fit."""
        rows = x.shape[0]
        forward, small = self._forward, self._small
        if small is not None and rows <= self.own_conv_rows:
            forward = small
        if self.autocast is None:
            out = forward(x)
        else:
            with self._autocast():
                out = forward(x)
        fitted = self._as_declared(out, rows)
        return fitted if fitted is not None else self._fit(out, rows)

    def _as_declared(self, out: Any, rows: int) -> Optional[list[Any]]:
        """``out`` in declaration order when it is already what the spec
        declares: a dict with exactly the declared names, a plain tuple or
        list, or one tensor, whose tensors are on the model's device with
        the declared dtype and shape.  None for anything else, which
        ``_fit`` then reshapes, casts or rejects.  The calls of a model
        whose outputs fit take this path alone: a few attribute reads per
        output."""
        names = self._names
        kind = type(out)
        given: Sequence[Any]
        if kind is dict:
            if len(out) != len(names):
                return None
            given = [out.get(k) for k in names]
        elif kind is tuple or kind is list:
            if len(out) != len(names):
                return None
            given = out
        elif len(names) == 1:
            given = (out,)
        else:
            return None
        device, tensor = self.device, torch.Tensor
        for t, (shape, want) in zip(given, self._declared):
            if (type(t) is not tensor or t.dtype is not want or t.device != device
                    or t.shape != (rows, *shape)):
                return None
        return list(given)

    def _fit(self, out: Any, rows: int) -> list[Any]:
        """``_fitted`` for outputs that need matching by name, a reshape or
        a cast, or that do not fit at all (ModelError)."""
        assert self.spec is not None
        given = match_outputs(out, self._names, getattr(out, "_fields", ()))
        fitted = []
        for t, o, want in zip(given, self.spec.outputs, self._want):
            if not isinstance(t, torch.Tensor):
                raise ModelError(f"model output {o.name!r} is a {type(t).__name__}, not a "
                                 "tensor")
            if t.device != self.device:
                raise ModelError(f"model output {o.name!r} is on {t.device}, the model "
                                 f"serves on {self.device}: the model moves its work to "
                                 "another device")
            if t.dim() == 0 or t.shape[0] != rows:
                raise ModelError(f"model output {o.name!r} has shape {tuple(t.shape)} for "
                                 f"a batch of {rows}, expected {(rows, *o.shape)}")
            if needs_reshape(o.name, tuple(t.shape[1:]), o.shape):
                t = t.reshape(rows, *o.shape)
            if t.dtype != want:
                if not castable(_numpy_dtype(t.dtype) or str(t.dtype), o.dtype,
                                t.dtype.is_floating_point):
                    raise ModelError(f"model output {o.name!r} has dtype {t.dtype}, which "
                                     f"cannot be cast to the declared {o.dtype} under "
                                     "'same_kind' casting")
                t = t.to(want)
            fitted.append(t)
        return fitted

    def __call__(self, batch: np.ndarray) -> Any:
        """Evaluates ``batch [rows, *input_shape]``.  After ``prepare``: a dict
        ``{name: ndarray}`` of the declared dtypes and shapes; on a CUDA
        device its arrays are views of page-locked buffers that the next
        call from the same thread overwrites (the evaluator copies them into
        the slots first).  Before it (a standalone call): the model's
        outputs as new ndarrays, in the model's structure (dict, tuple or
        one array)."""
        if type(batch) is not np.ndarray:
            batch = np.asarray(batch)
        if self.spec is None:
            return self._standalone(batch)
        if batch.shape[1:] != self.spec.input_shape or batch.dtype != self.spec.input_dtype:
            raise ValueError(f"TorchModel was prepared for batches of shape "
                             f"[n, *{self.spec.input_shape}] {self.spec.input_dtype}, "
                             f"got {batch.shape} {batch.dtype}")
        try:
            with torch.inference_mode():
                if self._free_lanes is None:
                    return self._call_cpu(batch)
                return self._call_cuda(batch)
        except torch.cuda.OutOfMemoryError as e:
            # What this batch allocated is free again; the next, smaller or
            # not, may fit.  The evaluator fails this batch only.
            torch.cuda.empty_cache()
            raise ModelError(f"out of memory on {self.device} for a batch of {len(batch)} "
                             f"rows (lower max_batch, or the buckets): {e}") from e

    def _standalone(self, batch: np.ndarray) -> Any:
        with torch.inference_mode(), self._autocast():
            out = self._forward(torch.from_numpy(batch.astype(batch.dtype.newbyteorder("=")))
                                .to(self.device))

        def array(t: Any) -> Any:
            return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t

        if isinstance(out, Mapping):
            return {str(k): array(v) for k, v in out.items()}
        if isinstance(out, (list, tuple)):
            return tuple(array(v) for v in out)
        return array(out)

    def _call_cpu(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        assert self.spec is not None
        if not batch.dtype.isnative:  # PyTorch takes native byte order only
            batch = batch.astype(batch.dtype.newbyteorder("="))
        # The tensor shares the batch's memory: nothing is copied in.
        out = self._fitted(torch.from_numpy(batch))
        if self._refold:
            self._count_loss(len(batch))
        return {name: t.numpy() for name, t in zip(self._names, out)}

    def _call_cuda(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        assert self.spec is not None
        rows = len(batch)
        lane = self._thread.lane or self._take_lane()
        np.copyto(lane.host_in_np[:rows], batch, casting="same_kind")
        with torch.cuda.stream(lane.stream):
            x = lane.device_in[:rows]
            x.copy_(lane.host_in[:rows], non_blocking=True)
            graph = lane.graphs.get(rows)
            if graph is not None:
                graph[0].replay()
                out = graph[1]
            else:
                out = self._fitted(x)
            for host, t in zip(lane.host_out, out):
                host[:rows].copy_(t, non_blocking=True)
        # Releases the GIL while it waits: another serving thread's batch is
        # gathered and copied meanwhile.
        lane.stream.synchronize()
        return {name: a[:rows] for name, a in zip(self._names, lane.host_out_np)}

    def _use_device(self) -> None:
        """Makes the model's GPU the calling thread's current device (CUDA's
        current device is per thread, and 0 in a new one; ``.to("cuda:1")``
        does not change it): ``torch.cuda.graph`` synchronises the current
        device, and work that names no device (a lane's stream, the
        allocator's) lands there.  Without it a replica on GPU 1 makes a
        context on GPU 0 too and waits on the wrong GPU."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _take_lane(self) -> _Lane:
        """A lane for this thread, kept by it from now on."""
        assert self._free_lanes is not None
        self._use_device()  # the thread's first call: set once, kept
        try:
            lane = self._free_lanes.get_nowait()
        except queue.Empty:
            warnings.warn(f"TorchModel: more threads call the model than it has lanes "
                          f"({self.lanes}); building another one while serving (pass "
                          "lanes=serving_threads)", RuntimeWarning, stacklevel=2)
            lane = self._lane()
        self._thread.lane = lane
        return lane

    # -- start-up -------------------------------------------------------------------

    def prepare(self, spec: Spec, buckets: Optional[Sequence[int]]) -> Optional[tuple[int, ...]]:
        """Checks the outputs against the spec, compiles for every batch
        size the evaluator will use and runs each once (each bucket, or 1
        and max_batch without buckets).  Returns the buckets this model
        wants when the evaluator has none: its own, or with ``compile`` or
        ``cuda_graphs`` powers of two up to max_batch.  On a GPU the
        model's device is the calling thread's current device meanwhile,
        and the caller's own again afterwards."""
        if self.device.type != "cuda":
            return self._prepare(spec, buckets)
        previous = torch.cuda.current_device()
        self._use_device()
        try:
            return self._prepare(spec, buckets)
        finally:
            torch.cuda.set_device(previous)

    def _prepare(self, spec: Spec, buckets: Optional[Sequence[int]]
                 ) -> Optional[tuple[int, ...]]:
        t0 = time.perf_counter()
        sizes = serving_sizes(spec, buckets, self.buckets,
                              bool(self.compile) or self.cuda_graphs, "TorchModel")
        self.spec = spec
        self._input_dtype = _torch_dtype(spec.input_dtype, "input dtype")
        self._want = [_torch_dtype(o.dtype, f"dtype of output {o.name!r}") for o in spec.outputs]
        self._names = spec.output_names
        self._declared = [(o.shape, w) for o, w in zip(spec.outputs, self._want)]
        if self.compile:
            # One graph per batch size (dynamic=False).  torch.compile keeps at
            # most recompile_limit graphs per code object (the forward method,
            # shared by every model of its class in this process), then runs
            # the code eagerly: make room for this model's graphs.
            import torch._dynamo

            config = torch._dynamo.config
            name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, name, getattr(config, name) + len(sizes or ()))
        auto_threads = self.intra_op_threads == "auto" and self.device.type == "cpu"
        if auto_threads:  # timed as it will serve: as if frozen (two calls in flight)
            self._split_cpus(2 if self.freeze else 1)
        self._try_freeze(sizes)
        if auto_threads:  # then for what serves
            self._split_cpus(self.max_concurrency)
        warm = sizes or tuple(sorted({1, spec.max_batch}))
        if self.device.type == "cuda":
            self._thread.lane = None
            self._lane_rows, self._graph_sizes = max(warm), sizes or ()
            lanes: queue.SimpleQueue[_Lane] = queue.SimpleQueue()
            for _ in range(self.lanes):
                lanes.put(self._lane())
            self._free_lanes = lanes
        for rows in warm:
            self._warm_up(rows)
        if self._free_lanes is not None and self._thread.lane is not None:
            # The warm-up's lane goes back: serving threads take the lanes.
            self._free_lanes.put(self._thread.lane)
            self._thread.lane = None
        self.warmup_s = time.perf_counter() - t0
        return None if buckets else sizes

    @staticmethod
    def _split_cpus(calls: int) -> None:
        """intra_op_threads="auto": this process's CPUs split between
        ``calls`` calls in flight."""
        threads = threads_per_call(calls)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def _warm_up(self, rows: int) -> None:
        """Runs a batch of zeros through ``__call__`` and checks the exact
        output shapes."""
        assert self.spec is not None
        batch = np.zeros((rows, *self.spec.input_shape), self.spec.input_dtype)
        try:
            out = self(batch)
        except ModelError:
            raise
        except Exception as e:
            hint = ""
            if isinstance(self.module, torch.fx.GraphModule):
                hint = (" (an exported program runs only the shapes it was exported for; "
                        "export it with a dynamic batch dimension: torch.export.export(net, "
                        "(example,), dynamic_shapes=({0: torch.export.Dim('batch')},)))")
            raise ModelError(f"the model failed on a batch of {rows} zero states: "
                             f"{type(e).__name__}: {e}{hint}") from e
        check_warm_outputs(out, self.spec, rows)

    def _lane(self) -> _Lane:
        """A lane for batches of up to ``_lane_rows``, with a CUDA graph per
        size in ``_graph_sizes`` when ``cuda_graphs`` is on (largest first,
        all in one memory pool: a lane runs one at a time, and its outputs
        are copied out before the next)."""
        assert self.spec is not None
        rows = self._lane_rows
        with torch.inference_mode():
            host_in = torch.empty((rows, *self.spec.input_shape), dtype=self._input_dtype,
                                  pin_memory=True)
            host_out = [torch.empty((rows, *o.shape), dtype=want, pin_memory=True)
                        for o, want in zip(self.spec.outputs, self._want)]
            lane = _Lane(stream=torch.cuda.Stream(self.device), host_in=host_in,
                         host_in_np=host_in.numpy(),
                         device_in=torch.zeros_like(host_in, device=self.device),
                         host_out=host_out, host_out_np=[t.numpy() for t in host_out])
            if self.cuda_graphs:
                for n in sorted(self._graph_sizes, reverse=True):
                    lane.graphs[n] = self._capture(lane, n)
        return lane

    def _capture(self, lane: _Lane, rows: int) -> tuple[Any, list[Any]]:
        """One CUDA graph of the fitted forward for ``rows`` rows of the
        lane's device buffer, and the tensors it writes its outputs to."""
        x = lane.device_in[:rows]
        # The buffers were zeroed on the current stream.
        lane.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(lane.stream):
            # Warm-up runs before capture: lazy initialisation, cuDNN's choice
            # of algorithms and torch.compile happen outside the graph.
            for _ in range(2):
                self._fitted(x)
        lane.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=lane.pool, stream=lane.stream):
                out = self._fitted(x)
        except ModelError:
            raise
        except Exception as e:
            raise ModelError(f"TorchModel could not capture the model in a CUDA graph for a "
                             f"batch of {rows} ({type(e).__name__}: {e}); serve it with "
                             "cuda_graphs=False") from e
        if lane.pool is None:
            lane.pool = graph.pool()
        self.graph_captures += 1
        return graph, out

    # -- weights --------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        """The parameters and buffers by name, in state_dict order (tensors
        sharing the module's storage)."""
        return dict(self.module.state_dict())

    def get_weights(self) -> list[np.ndarray]:
        """Copies of the parameters and buffers in ``state_dict`` order
        (bfloat16 ones as float32)."""
        return [np.array(_as_array(t)) for t in self._state().values()]

    def set_weights(self, weights: Union[Sequence[Any], Mapping[str, Any]]) -> None:
        """Copies new values into the parameters and buffers in place: a
        list of arrays in ``state_dict`` order (``get_weights()``), or a
        state dict (the same names).  Everything is checked, and moved to
        the device, before anything is overwritten: a bad update raises
        ValueError (a failed move, its error) and leaves every weight as it
        was.  Compiled code and CUDA graphs read the new values; nothing is
        compiled again.  A frozen module is frozen again: at once with
        ``freeze=True``, with "auto" once its unfrozen calls have lost what
        that costs."""
        state = self._state()
        if isinstance(weights, Mapping):
            missing = [k for k in state if k not in weights]
            unexpected = [str(k) for k in weights if k not in state]
            if missing or unexpected:
                raise ValueError(f"set_weights: the state dict lacks {missing} and has "
                                 f"unexpected {unexpected}")
            weights = [weights[k] for k in state]
        expected = [(name, tuple(t.shape), _numpy_dtype(t.dtype) or np.dtype(np.float32))
                    for name, t in state.items()]
        arrays = checked_weights([_as_array(w) for w in weights], expected)
        with torch.inference_mode():
            new = [torch.from_numpy(np.require(a, requirements="C")).to(t.device, t.dtype)
                   for a, t in zip(arrays, state.values())]
        with torch.no_grad():
            for t, value in zip(state.values(), new):
                t.copy_(value)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.frozen or self._refold:
            self._after_update()

    def load_weights(self, path: PathLike) -> None:
        """Loads weights from a state dict file (``torch.save(module.
        state_dict(), path)``, read with ``weights_only=True``) or a
        ``.npz`` file of arrays in ``state_dict`` order (``np.savez(path,
        *model.get_weights())``).  A failed load leaves the old weights."""
        path = os.fspath(path)
        if path.endswith(".npz"):
            self.set_weights(npz_weights(path))
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, Mapping):
            raise ValueError(f"load_weights: {path} holds a {type(state).__name__}, not a "
                             "state dict")
        self.set_weights(state)


__all__ = ["TorchModel"]
