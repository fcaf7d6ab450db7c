"""PyTorch backend: ``TorchModel`` serves an ``nn.Module``, a TorchScript
file or an exported program (``torch.export``) to a shmeval evaluator.

Import this module only in the process that runs the model (it imports
PyTorch)::

    def factory():
        from shmeval.backends.torch import TorchModel
        return TorchModel("net.pt2")

    ev = shmeval.Evaluator.spawn(factory, input_shape=..., outputs=...,
                                 serving_threads=2)

A net of several inputs takes them as keyword arguments by input name
(``Evaluator(inputs={"planes": ..., "mask": ...})`` calls
``net(planes=..., mask=...)``), and a net of several functions serves each
as a method of the evaluator
(``TorchModel(net, methods={"initial": "initial_inference", "recurrent":
"recurrent_inference"})``, whose ``initial`` and ``recurrent`` the
evaluator calls), all over one set of weights.

What it does for the evaluator:

* ``prepare(spec, buckets)`` compiles each method for every batch size it
  will serve (``torch.compile`` and CUDA graphs are optional), runs each
  size once, and checks the outputs against the declared ones (matched by
  name, else by order; reshaped and cast as the evaluator's rules say), so
  that a mismatch raises ``ModelError``, naming the method, at start-up and
  serving never compiles again;
* ``__call__(batch)`` (or a method's callable) runs the model under
  ``torch.inference_mode`` and returns ``{name: ndarray}`` with exactly the
  declared dtypes and shapes; on a GPU the batch travels through
  page-locked staging buffers on a CUDA stream of its own, and the outputs
  come back into page-locked buffers that the evaluator reads directly
  (``_torch_lanes``);
* on the CPU each function is traced and frozen (``torch.jit.trace``,
  ``torch.jit.freeze``) where the frozen form answers as the module does:
  it runs without Python between its ops, so it is cheaper per call and
  two serving threads overlap their calls (``max_concurrency``); small
  batches go to a second frozen form whose convolutions run on PyTorch's
  own kernel instead of oneDNN's, up to the batch size where start-up
  timing found it no longer cheaper (``own_conv_rows``; ``_torch_method``);
* ``set_weights`` / ``load_weights`` copy new values into the parameters
  and buffers in place, for every method at once (compiled code and CUDA
  graphs keep serving them; a frozen function is frozen again).
"""
from __future__ import annotations

import contextlib
import os
import queue
import time
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from ..errors import ModelError
from ..spec import Spec
from ._contract import (PathLike, check_warm_outputs, checked_weights, npz_weights, own_buckets,
                        serving_sizes)
from ._device import threads_per_call
from ._torch_lanes import BUILD_LOCK, SPIN, GpuWait, Lane, ThreadLane, build_lane, call_on_lane
from ._torch_method import ServedMethod, Target, function_of, naming, numpy_dtype, own_convolutions

#: Autocast dtypes ``dtype=`` accepts.
_AUTOCAST = {"float16": torch.float16, "bfloat16": torch.bfloat16}

#: The rewrite of a frozen graph's convolutions to PyTorch's own kernel
#: (bench/torch_model_cost.py times it).
_own_convolutions = own_convolutions


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


def _as_array(w: Any) -> np.ndarray:
    """A weight as an ndarray: a tensor on any device (bfloat16 as
    float32), or anything NumPy takes."""
    if isinstance(w, torch.Tensor):
        t = w.detach().cpu()
        if numpy_dtype(t.dtype) is None:
            t = t.float()
        return np.asarray(t.numpy())
    return np.asarray(w)




class _MethodCall:
    """``TorchModel(methods=...)``'s callable for one method, the
    attribute of the method's name: ``tm.recurrent(inputs)``, inputs a
    dict ``{input name: ndarray (rows, *shape)}``."""

    __slots__ = ("_model", "_method", "_index")

    def __init__(self, model: "TorchModel", method: ServedMethod, index: int) -> None:
        self._model, self._method, self._index = model, method, index

    def __call__(self, inputs: Mapping[str, Any]) -> Any:
        try:
            return self._model._run(self._method, self._index, inputs)
        except ModelError as e:
            raise ModelError(f"method {self._method.name!r}: {e}") from e

    def __repr__(self) -> str:
        return f"<{self._method.describe()}>"


class TorchModel:
    """A PyTorch model as a shmeval evaluator model.

    ``module_or_path``: an ``nn.Module`` (moved to ``device`` and put in
    eval mode), a ``torch.export.ExportedProgram``, a TorchScript file
    (``torch.jit.save``) or an exported program's ``.pt2`` file
    (``torch.export.save``).  Its forward takes one tensor ``[rows,
    *input_shape]`` (an evaluator of one unnamed input, ``input_shape=``),
    or one tensor ``[rows, *shape]`` per input as keyword arguments by
    input name (``inputs=``: ``net(planes=..., mask=...)``), and returns a
    tensor, a tuple or list (a named tuple's fields name its entries) or a
    dict of tensors.

    ``methods`` (for an evaluator of several methods, ``methods=``): for
    each of the evaluator's methods, the module's function that serves it,
    by name (``{"initial": "initial_inference", "recurrent":
    "recurrent_inference"}``; ``"forward"`` calls the module) or as a
    function called ``fn(module, **inputs)``.  Each is called with its
    inputs as keyword arguments by input name, and is served as the
    attribute of its method's name (``tm.initial(inputs)``, which the
    evaluator calls), prepared, frozen and checked as one function would
    be; the module and its weights are one, so a weight update changes
    every method at once.  A name the module has no function of raises
    ValueError here, as does a method named like one of TorchModel's own
    attributes; ``prepare`` raises ModelError when the evaluator's methods
    are not these.

    ``device``: where it runs (default the first CUDA device if there is
    one, else the CPU).  ``compile``: ``True`` compiles each function with
    ``torch.compile`` (inductor), a string names another ``torch.compile``
    backend; once per batch size, so batches are padded to buckets.
    ``cuda_graphs`` (default: on a CUDA device): capture one CUDA graph per
    method and batch size and replay it, which saves the launch cost of
    every kernel; needs buckets too, and a model that CUDA graphs can
    capture (no synchronisation with the host inside).  ``freeze`` (CPU
    only; default ``"auto"``): serve each function traced and frozen
    (``torch.jit.trace`` then ``torch.jit.freeze``, which folds the weights
    into the graph), a graph that runs without Python between its ops, so
    it costs less per call and two serving threads overlap their calls.
    ``"auto"`` freezes an ``nn.Module`` or TorchScript module on the CPU
    (without ``compile`` or ``dtype``) when tracing raises no error or
    warning and the frozen form's answers to random batches of two sizes
    match the module's (floats drawn normal, integers and bools 0 or 1);
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
    (``freeze_s``; each method on its own count): updates that come often
    cost little, rare ones are frozen again soon.  ``True``: freeze, also
    at once after every update, or raise ``ModelError``.  ``dtype``:
    ``"float16"`` or ``"bfloat16"`` runs the functions under
    ``torch.autocast`` (for the GPU; outputs are cast back to the declared
    dtypes).  ``buckets``: batch sizes to pad to when the evaluator has
    none; with ``compile`` or ``cuda_graphs`` and no buckets anywhere,
    powers of two up to ``max_batch``.  ``lanes`` (CUDA only, default 2):
    lanes built at start-up, each a CUDA stream with its own page-locked
    buffers and graphs for every method, kept by the first thread that
    calls on it: give the evaluator as many ``serving_threads`` (or pass
    them to ``prepare``), so that one batch is copied to the GPU while the
    previous one computes (a thread beyond them builds a lane of its own at
    its first call, while serving, with a warning; lanes are built one at a
    time in the process, and captured in CUDA's thread-local mode, so the
    other threads' CUDA work goes on meanwhile).  ``gpu_wait`` (CUDA only):
    how a serving thread waits for its call's work on the GPU
    (``_torch_lanes.GpuWait``): ``"block"`` sleeps in the driver at once
    (a blocking CUDA event; no CPU spent, a wake-up's latency added);
    ``"spin"`` (the default) first looks at the event for one wake-up's
    cost (measured here), yielding the CPU between looks; a number spins
    that many µs first.  ``intra_op_threads``:
    ``torch.set_num_threads``, a process-wide setting.  ``"auto"`` (the
    default; on the CPU only, at ``prepare``): the CPUs this process may
    use split between the calls that may be in flight
    (``max_concurrency``), as ``TFModel`` does: one thread each on 2 CPUs
    with two serving threads, where PyTorch's own default (one per core
    for every call) puts two threads of each call on every core.  An int
    sets that many at once; None leaves PyTorch's default.

    A CUDA graph reads the tensors that existed when it was captured:
    change the weights only through ``set_weights`` / ``load_weights``,
    which copy into those tensors.  A module changed in another way after
    ``prepare`` (``.half()``, ``.to(...)``, ``load_state_dict(...,
    assign=True)``, a parameter or submodule replaced) leaves the graphs
    reading memory that has been freed: they answer garbage or crash, and
    nothing says why.

    After ``prepare``: ``compile_count`` (graphs ``torch.compile``
    produced; constant while serving), ``graph_captures`` (CUDA graphs
    captured), ``frozen`` (whether every method serves frozen),
    ``freeze_reason`` (each method's, with several), ``own_conv_rows``
    (the largest of the methods'), ``freeze_s`` (seconds the last freeze
    of every method took, both frozen forms), ``warmup_s`` (seconds
    ``prepare`` took), and ``methods``: each method by name ("" for the
    only one of a TorchModel without ``methods=``), with its own
    ``frozen``, ``freeze_reason``, ``own_conv_rows`` and ``freeze_s``.

    ``max_concurrency`` (read by the evaluator's tuner after ``prepare``):
    on a GPU ``lanes`` (a thread's batch is copied while another's
    computes); on the CPU 2 while every method serves frozen (their calls
    hold the GIL only to enter and leave the graph), else 1 (an unfrozen
    module's Python between ops makes two threads slower than one).
    """

    def __init__(self, module_or_path: Any, *, methods: Optional[Mapping[str, Target]] = None,
                 device: Union[None, str, Any] = None, compile: Union[bool, str] = False,
                 cuda_graphs: Optional[bool] = None, dtype: Union[None, str, Any] = None,
                 buckets: Optional[Sequence[int]] = None, lanes: int = 2,
                 intra_op_threads: Union[int, str, None] = "auto",
                 freeze: Union[bool, str] = "auto", gpu_wait: Union[str, float] = SPIN) -> None:
        if freeze not in (True, False, "auto"):
            raise ValueError(f"TorchModel(freeze=...) must be True, False or 'auto', "
                             f"got {freeze!r}")
        if methods is not None and (not isinstance(methods, Mapping) or not methods):
            raise TypeError("TorchModel methods must be a non-empty dict {method name: the "
                            f"module's function}}, got {methods!r}")
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
        #: How a serving thread waits for its call's work on the GPU
        #: (``GpuWait``; may be replaced between calls, as benchmarks do).
        self.gpu_wait = GpuWait.of(gpu_wait)
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
        why_not = self._freeze_unsupported()
        if freeze is True and why_not:
            raise ValueError(f"TorchModel(freeze=True): {why_not}")
        if why_not:
            self.freeze = False
        self.spec: Optional[Spec] = None
        # Whether the evaluator's methods are named (methods=), each served
        # as the attribute of its name, or it has one, served by __call__.
        self._by_name = methods is not None
        targets: Mapping[str, Target] = methods if methods is not None else {"": "forward"}
        served = []
        for name, target in targets.items():
            where = f"methods[{name!r}]" if self._by_name else "forward"
            fn = function_of(self.module, target, where)
            compiled = None
            if compile:
                backend = "inductor" if compile is True else str(compile)
                # The module itself for its forward, so that its hooks run as
                # they do uncompiled.
                compiled = torch.compile(fn, backend=self._counting(backend), dynamic=False)
            served.append(ServedMethod(
                name, fn, self.module, self.device, self.autocast, self.freeze,
                f"served unfrozen: {why_not}" if why_not else "not prepared yet", compiled))
        self._served: tuple[ServedMethod, ...] = tuple(served)
        #: The methods by name ("" for the only one without methods=).
        self.methods: dict[str, ServedMethod] = {m.name: m for m in served}
        # CUDA: lanes no thread has taken yet, and what a lane is built for.
        self._free_lanes: Optional[queue.SimpleQueue[Lane]] = None
        self._lane_rows = 0
        self._graph_sizes: tuple[int, ...] = ()
        self._thread = ThreadLane()
        if self._by_name:
            for i, m in enumerate(served):
                if not isinstance(m.name, str) or not m.name.isidentifier():
                    raise TypeError(f"TorchModel method names must be identifiers, got "
                                    f"{m.name!r}")
                if hasattr(self, m.name):
                    raise ValueError(f"TorchModel methods: {m.name!r} is the name of one of "
                                     "TorchModel's own attributes; name the method otherwise")
                setattr(self, m.name, _MethodCall(self, m, i))

    @property
    def frozen(self) -> bool:
        """Whether every method serves frozen."""
        return all(m.frozen for m in self._served)

    @property
    def freeze_reason(self) -> str:
        """How the functions serve, and why not frozen: the only one's, or
        each method's ("method 'initial': ...; method 'recurrent': ...")."""
        if len(self._served) == 1:
            return self._served[0].freeze_reason
        return "; ".join(f"method {m.name!r}: {m.freeze_reason}" for m in self._served)

    @property
    def own_conv_rows(self) -> int:
        """The largest batch a method serves with PyTorch's own convolution."""
        return max(m.own_conv_rows for m in self._served)

    @property
    def freeze_s(self) -> float:
        """Seconds the last trace and freeze of every method took (0 before any)."""
        return sum(m.freeze_s for m in self._served)

    @property
    def max_concurrency(self) -> int:
        """Calls that may overlap usefully: on a GPU one per lane, on the
        CPU 2 while every method serves frozen, else 1 (see the class's
        docstring)."""
        if self.device.type == "cuda":
            return self.lanes
        return 2 if all(m.frozen or m.refold for m in self._served) else 1

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

    def _counting(self, backend: str) -> Any:
        """``backend`` (a torch.compile backend's name), counting the graphs
        it compiles in ``compile_count``."""
        from torch._dynamo import lookup_backend

        compile_graph = lookup_backend(backend)

        def counted(graph: Any, example_inputs: Any) -> Any:
            self.compile_count += 1
            return compile_graph(graph, example_inputs)

        return counted

    # -- running the model ----------------------------------------------------------

    def __call__(self, batch: Any) -> Any:
        """Evaluates a batch of the only method: an ndarray ``[rows,
        *input_shape]`` (one unnamed input), or a dict ``{input name:
        ndarray [rows, *shape]}`` (named inputs).  After ``prepare``: a dict
        ``{name: ndarray}`` of the declared dtypes and shapes; on a CUDA
        device its arrays are views of page-locked buffers that the next
        call from the same thread overwrites (the evaluator copies them into
        the slots first).  Before it (a standalone call): the model's
        outputs as new ndarrays, in the model's structure (dict, tuple or
        one array).  With several ``methods=``, call a method by its name
        instead (``tm.initial(inputs)``)."""
        if self._by_name:
            if len(self._served) > 1:
                raise TypeError(f"TorchModel serves the methods {tuple(self.methods)}: call "
                                f"one by its name (tm.{self._served[0].name}(inputs))")
            return getattr(self, self._served[0].name)(batch)
        return self._run(self._served[0], 0, batch)

    def _run(self, m: ServedMethod, index: int, batch: Any) -> Any:
        """Method ``m`` (the ``index``-th) on ``batch``, as ``__call__`` says."""
        if m.spec is None:
            return m.standalone(batch)
        xs = m.arrays(batch)
        try:
            with torch.inference_mode():
                if self._free_lanes is None:
                    return self._call_cpu(m, xs)
                return call_on_lane(self._thread.lane or self._take_lane(), index, m, xs,
                                    self.gpu_wait)
        except torch.cuda.OutOfMemoryError as e:
            # What this batch allocated is free again; the next, smaller or
            # not, may fit.  The evaluator fails this batch only.
            torch.cuda.empty_cache()
            raise ModelError(f"out of memory on {self.device} for a batch of {len(xs[0])} "
                             f"rows (lower max_batch, or the buckets): {e}") from e

    def _call_cpu(self, m: ServedMethod, xs: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        # PyTorch takes native byte order only.  The tensors share the
        # arrays' memory: nothing is copied in.
        out = m.fitted([torch.from_numpy(x if x.dtype.isnative
                                         else x.astype(x.dtype.newbyteorder("=")))
                        for x in xs])
        if m.refold:
            m.count_loss(len(xs[0]))
        return {name: t.numpy() for name, t in zip(m.names, out)}

    def _use_device(self) -> None:
        """Makes the model's GPU the calling thread's current device (CUDA's
        current device is per thread, and 0 in a new one; ``.to("cuda:1")``
        does not change it): ``torch.cuda.graph`` synchronises the current
        device, and work that names no device (a lane's stream, the
        allocator's) lands there.  Without it a replica on GPU 1 makes a
        context on GPU 0 too and waits on the wrong GPU."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _take_lane(self) -> Lane:
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

    def _lane(self) -> Lane:
        """A lane for batches of up to ``_lane_rows`` of every method, with
        its CUDA graphs when ``cuda_graphs`` is on; built under BUILD_LOCK,
        one lane at a time in this process (one capture at a time)."""
        with BUILD_LOCK:
            lane = build_lane(self.device, self._served, self._lane_rows, self._graph_sizes,
                              self.cuda_graphs)
            self.graph_captures += lane.captures
        return lane

    # -- start-up -------------------------------------------------------------------

    def prepare(self, spec: Spec, buckets: Optional[Sequence[int]],
                serving_threads: Optional[int] = None) -> Optional[tuple[int, ...]]:
        """Checks every method's outputs against the spec, compiles for
        every batch size the evaluator will use and runs each once (each
        bucket, or 1 and max_batch without buckets); a mismatch raises
        ModelError naming the method (with several) and the input or
        output.  Returns the buckets this model wants when the evaluator
        has none: its own, or with ``compile`` or ``cuda_graphs`` powers of
        two up to max_batch.  On a GPU the model's device is the calling
        thread's current device meanwhile (``torch.cuda.device``), and the
        caller's own again afterwards, without making a context on the
        caller's GPU where it has none (``torch.cuda.set_device`` would,
        under CUDA 12: a replica on GPU 1 would hold one on GPU 0).  The
        lanes are built here: ``serving_threads`` of them when given (the
        threads that will call the model; ``lanes`` becomes that), so that
        none is built while serving."""
        if serving_threads is not None:
            if type(serving_threads) is not int or serving_threads < 1:
                raise ValueError(f"TorchModel.prepare: serving_threads must be a positive "
                                 f"int, got {serving_threads!r}")
            if self.device.type == "cuda":
                self.lanes = serving_threads
        if self.device.type != "cuda":
            return self._prepare(spec, buckets)
        with torch.cuda.device(self.device):
            return self._prepare(spec, buckets)

    def _bind(self, spec: Spec) -> None:
        """Each method serves the spec's method of its name (the only one's
        without methods=); ModelError when they are not the same methods."""
        declared = spec.method_names
        if not self._by_name:
            if len(declared) != 1:
                raise ModelError(f"the evaluator serves the methods {declared}; TorchModel "
                                 "serves one function: name the module's function for each "
                                 "(TorchModel(net, methods={method: function name}))")
            self._served[0].bind(spec.methods[0], spec.max_batch)
            return
        if sorted(declared) != sorted(self.methods):
            raise ModelError(f"TorchModel serves the methods {tuple(self.methods)}, the "
                             "evaluator " + ("has none (no methods=)" if declared == ("",)
                                             else f"declares {declared}"))
        for m in self._served:
            with naming(m):
                m.bind(spec.method(m.name), spec.max_batch)

    def _prepare(self, spec: Spec, buckets: Optional[Sequence[int]]
                 ) -> Optional[tuple[int, ...]]:
        t0 = time.perf_counter()
        sizes = serving_sizes(spec, buckets, self.buckets,
                              bool(self.compile) or self.cuda_graphs, "TorchModel")
        self._bind(spec)
        self.spec = spec
        if self.compile:
            # One graph per batch size (dynamic=False).  torch.compile keeps at
            # most recompile_limit graphs per code object (the forward method,
            # shared by every model of its class in this process), then runs
            # the code eagerly: make room for this model's graphs.
            import torch._dynamo

            config = torch._dynamo.config
            name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, name,
                    getattr(config, name) + len(sizes or ()) * len(self._served))
        auto_threads = self.intra_op_threads == "auto" and self.device.type == "cpu"
        if auto_threads:  # timed as it will serve: as if frozen (two calls in flight)
            self._split_cpus(2 if self.freeze else 1)
        for m in self._served:
            with naming(m):
                m.try_freeze(sizes)
        if auto_threads:  # then for what serves
            self._split_cpus(self.max_concurrency)
        warm = sizes or tuple(sorted({1, spec.max_batch}))
        if self.device.type == "cuda":
            self._thread.lane = None
            self._lane_rows, self._graph_sizes = max(warm), sizes or ()
            lanes: queue.SimpleQueue[Lane] = queue.SimpleQueue()
            for _ in range(self.lanes):
                lanes.put(self._lane())
            self._free_lanes = lanes
        for i, m in enumerate(self._served):
            with naming(m):
                for rows in warm:
                    self._warm_up(m, i, rows)
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

    def _warm_up(self, m: ServedMethod, index: int, rows: int) -> None:
        """Runs a batch of zeros of the method's inputs through it and
        checks the exact output shapes."""
        assert m.spec is not None
        zeros = [np.zeros((rows, *f.shape), f.dtype) for f in m.spec.inputs]
        batch = dict(zip(m.input_names, zeros)) if m.named else zeros[0]
        try:
            out = self._run(m, index, batch)
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
        check_warm_outputs(out, m.spec, rows)

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
        was.  Every method serves the new values at once: compiled code and
        CUDA graphs read them, nothing is compiled again.  A frozen method
        is frozen again: at once with ``freeze=True``, with "auto" once its
        unfrozen calls have lost what that costs."""
        state = self._state()
        if isinstance(weights, Mapping):
            missing = [k for k in state if k not in weights]
            unexpected = [str(k) for k in weights if k not in state]
            if missing or unexpected:
                raise ValueError(f"set_weights: the state dict lacks {missing} and has "
                                 f"unexpected {unexpected}")
            weights = [weights[k] for k in state]
        expected = [(name, tuple(t.shape), numpy_dtype(t.dtype) or np.dtype(np.float32))
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
        self._after_update()

    def _after_update(self) -> None:
        """Every method frozen (or to be frozen again) holds the old weights
        in its frozen graph: each is frozen again, or served unfrozen until
        that pays (ServedMethod.after_update).  With freeze=True every
        method is tried before the first failure is raised, so that none
        keeps serving the old weights."""
        failed: Optional[ModelError] = None
        for m in self._served:
            if not (m.frozen or m.refold):
                continue
            try:
                with naming(m):
                    m.after_update()
            except ModelError as e:
                failed = failed or e
        if failed is not None:
            raise failed

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
