"""One function of a PyTorch module as ``TorchModel`` serves it
(:class:`ServedMethod`): how it is called (one unnamed input, or named
inputs as keyword arguments), the forms that serve it (the module's own
function, ``torch.compile``'s, a traced and frozen graph, and that graph
with PyTorch's own convolution for small batches), when it is frozen again
after a weight update, and how its outputs are fitted to the declared
ones.  A ``TorchModel`` holds one per method, all over the one module and
its one set of weights.

Imported by ``shmeval.backends.torch`` only (it imports PyTorch).
"""
from __future__ import annotations

import contextlib
import functools
import time
import warnings
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from ..errors import ModelError
from ..spec import MethodSpec
from ._contract import Refold, best_ns, castable, match_outputs, needs_reshape, pow2_buckets

#: How close the frozen module's answers must be to the module's for
#: freeze="auto" to serve it (float outputs; others must be equal).
FREEZE_RTOL, FREEZE_ATOL = 1e-4, 1e-6

#: What ``TorchModel(methods=...)`` takes for each method: the name of one
#: of the module's functions, or a function called as ``fn(module, **inputs)``.
Target = Union[str, Callable[..., Any]]


@functools.lru_cache(maxsize=None)
def numpy_dtype(dtype: Any) -> Optional[np.dtype[Any]]:
    """The NumPy dtype of a torch dtype (None for bfloat16 and others
    NumPy lacks)."""
    try:
        found: np.dtype[Any] = torch.empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        return None
    return found


def torch_dtype(dtype: np.dtype[Any], what: str) -> Any:
    try:
        return torch.from_numpy(np.empty(0, dtype.newbyteorder("="))).dtype
    except TypeError:
        raise ModelError(f"TorchModel: PyTorch has no dtype for the {what} {dtype}") from None


def own_convolutions(frozen: Any) -> int:
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


def function_of(module: Any, target: Target, where: str) -> Callable[..., Any]:
    """The module's function ``target`` names: the module itself for
    "forward" (its hooks run as in ``module(x)``), a bound method for
    another name, or ``target(module, **inputs)``; ValueError naming
    ``where`` when the module has no such function."""
    if callable(target):
        return functools.partial(target, module)
    if not isinstance(target, str) or not target:
        raise TypeError(f"TorchModel {where} must be the name of one of the module's "
                        f"functions or a function (module, **inputs), got {target!r}")
    if target == "forward":
        return module  # type: ignore[no-any-return]
    fn = getattr(module, target, None)
    if not callable(fn):
        raise ValueError(f"TorchModel {where}: the module ({type(module).__name__}) has no "
                         f"function {target!r}" + (" (a TorchScript module has the methods "
                                                   "marked @torch.jit.export only)"
                                                   if isinstance(module, torch.jit.ScriptModule)
                                                   else ""))
    return fn  # type: ignore[no-any-return]


def _keywords(module: Any, fn: Callable[..., Any], names: tuple[str, ...]) -> Any:
    """A function of the module taking named inputs as keyword arguments,
    as a module taking them positionally in the declared order: what
    ``torch.jit.trace`` traces.  The module is its submodule, so that the
    trace finds its parameters; the function is no attribute of it (a
    method marked ``@torch.jit.export`` would be scripted as one of its)."""

    class Keywords(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = module

        def forward(self, *xs: Any) -> Any:
            return fn(**dict(zip(names, xs)))

    return Keywords().eval()


@contextlib.contextmanager
def naming(method: "ServedMethod") -> Iterator[None]:
    """A ModelError raised inside names the method first (one of several)."""
    try:
        yield
    except ModelError as e:
        if not method.name:
            raise
        raise ModelError(f"method {method.name!r}: {e}") from e


class ServedMethod:
    """One function of the module, served.  ``name``: the evaluator's name
    for it ("" for a TorchModel of one function); ``fn``: the module's
    function (:func:`function_of`), called with the batch as one tensor
    for one unnamed input, else with a tensor per input as keyword
    arguments.  Every form that serves it is called positionally, inputs
    in the declared order.

    After ``bind`` and ``try_freeze`` (``TorchModel.prepare``): ``frozen``,
    ``freeze_reason``, ``own_conv_rows`` and ``freeze_s`` say how it
    serves, as for ``TorchModel`` itself (whose attributes of those names
    sum up its methods').
    """

    def __init__(self, name: str, fn: Callable[..., Any], module: Any, device: Any,
                 autocast: Any, freeze: Union[bool, str], freeze_reason: str,
                 compiled: Optional[Callable[..., Any]]) -> None:
        self.name = name
        self.fn = fn
        self.module = module
        self.device = device
        self.autocast = autocast
        self.freeze = freeze
        self.freeze_reason = freeze_reason
        self.compiled = compiled
        self.spec: Optional[MethodSpec] = None
        self.max_batch = 0
        self.named = False
        self.input_names: tuple[str, ...] = ()
        self.input_set: frozenset[str] = frozenset()
        self.in_dtypes: list[Any] = []   # the declared input dtypes, as torch dtypes
        self.names: tuple[str, ...] = ()  # the declared outputs'
        self.want: list[Any] = []         # the declared output dtypes, as torch dtypes
        self.declared: list[tuple[tuple[int, ...], Any]] = []  # (shape per row, dtype)
        self.eager: Callable[..., Any] = fn
        self.forward: Callable[..., Any] = fn
        self.frozen = False
        # The frozen form whose convolutions run on PyTorch's own kernel,
        # served for batches of up to own_conv_rows rows.
        self.small: Any = None
        self.own_conv_rows = 0
        # freeze="auto" after a weight update: the function serves (refold),
        # and is frozen again once its calls have lost what freezing costs
        # (each call at least 1 us, so that it comes however the saving was
        # measured).
        self.refold = False
        self.fold = Refold(floor_ns=1000.0)

    def describe(self) -> str:
        """"TorchModel method 'recurrent'", or "TorchModel" for the only one."""
        return f"TorchModel method {self.name!r}" if self.name else "TorchModel"

    @property
    def freeze_s(self) -> float:
        """Seconds its last trace and freeze took (0 before any)."""
        return self.fold.cost_ns / 1e9

    def positional(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` of the batch (one unnamed input) or of keyword inputs, as
        a function of the inputs positionally, in the declared order."""
        if not self.named:
            return fn
        names = self.input_names

        def call(*xs: Any) -> Any:
            return fn(**dict(zip(names, xs)))

        return call

    def bind(self, spec: MethodSpec, max_batch: int) -> None:
        """Serves ``spec``'s inputs and outputs: the module's function (or
        its compiled form) until ``try_freeze``."""
        self.spec, self.max_batch = spec, max_batch
        self.named = spec.named
        self.input_names = spec.input_names
        self.input_set = frozenset(spec.input_names)
        self.in_dtypes = [torch_dtype(f.dtype, f"dtype of input {f.name!r}" if f.name
                                      else "input dtype") for f in spec.inputs]
        self.names = spec.output_names
        self.want = [torch_dtype(o.dtype, f"dtype of output {o.name!r}") for o in spec.outputs]
        self.declared = [(o.shape, w) for o, w in zip(spec.outputs, self.want)]
        self.eager = self.positional(self.fn)
        self.forward = (self.eager if self.compiled is None else self.positional(self.compiled))
        self.small, self.own_conv_rows, self.frozen, self.refold = None, 0, False, False

    # -- the batch --------------------------------------------------------------------

    def arrays(self, batch: Any) -> tuple[np.ndarray, ...]:
        """The batch's arrays in the declared order: one ndarray for one
        unnamed input, else a dict by input name; ValueError naming the
        input that is missing, extra or not of the declared shape and dtype."""
        assert self.spec is not None
        if not self.named:
            if type(batch) is not np.ndarray:
                batch = np.asarray(batch)
            f = self.spec.inputs[0]
            if batch.shape[1:] != f.shape or batch.dtype != f.dtype:
                raise ValueError(f"{self.describe()} was prepared for batches of shape "
                                 f"[n, *{f.shape}] {f.dtype}, got {batch.shape} {batch.dtype}")
            return (batch,)
        if not isinstance(batch, Mapping) or batch.keys() != self.input_set:
            given = sorted(map(str, batch)) if isinstance(batch, Mapping) else type(batch).__name__
            raise ValueError(f"{self.describe()} takes a dict of the inputs "
                             f"{list(self.input_names)}, got {given}")
        xs = []
        rows = -1
        for f in self.spec.inputs:
            a = batch[f.name]
            if type(a) is not np.ndarray:
                a = np.asarray(a)
            if a.shape[1:] != f.shape or a.dtype != f.dtype or (rows >= 0 and len(a) != rows):
                raise ValueError(f"{self.describe()}: input {f.name!r} was prepared for "
                                 f"[n, *{f.shape}] {f.dtype} with n the batch's rows, got "
                                 f"{a.shape} {a.dtype}")
            rows = len(a)
            xs.append(a)
        return tuple(xs)

    def example(self, rows: int) -> list[Any]:
        """A batch of ``rows`` random rows of each input, of its declared
        dtype (floats normal, integers and bools 0 or 1)."""
        assert self.spec is not None
        g = torch.Generator().manual_seed(rows)
        xs = []
        for f, dtype in zip(self.spec.inputs, self.in_dtypes):
            shape = (rows, *f.shape)
            x = (torch.randn(shape, generator=g) if dtype.is_floating_point
                 else torch.randint(0, 2, shape, generator=g))
            xs.append(x.to(dtype).to(self.device))
        return xs

    # -- freezing ---------------------------------------------------------------------

    def traced(self) -> Any:
        """The function traced (a TorchScript module's forward of one
        unnamed input as it is) and frozen, a module taking the inputs
        positionally; ModelError when tracing warns that the trace may not
        generalise."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", torch.jit.TracerWarning)
            with torch.no_grad():
                m = self.module
                if self.named:
                    m = _keywords(m, self.fn, self.input_names)
                if not isinstance(m, torch.jit.ScriptModule):
                    m = torch.jit.trace(m, tuple(self.example(2)), strict=False,
                                        check_trace=False)
                frozen = torch.jit.freeze(m.eval())
        for w in caught:
            if issubclass(w.category, torch.jit.TracerWarning):
                raise ModelError(f"tracing warned: {str(w.message).splitlines()[0]}")
        return frozen

    def answers(self, forward: Any, xs: Sequence[Any]) -> list[Any]:
        with torch.inference_mode():
            out = forward(*xs)
        return list(match_outputs(out, self.names, getattr(out, "_fields", ())))

    def same_answers(self, frozen: Any) -> str:
        """"" when ``frozen`` answers random batches of 1 and 5 rows as the
        function does, else how they differ."""
        for rows in (1, 5):
            xs = self.example(rows)
            for name, a, b in zip(self.names, self.answers(self.eager, xs),
                                  self.answers(frozen, xs)):
                if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or \
                        a.shape != b.shape or a.dtype != b.dtype:
                    return f"output {name!r} differs in type, shape or dtype ({rows} rows)"
                same = (torch.allclose(a, b, rtol=FREEZE_RTOL, atol=FREEZE_ATOL, equal_nan=True)
                        if a.is_floating_point() else torch.equal(a, b))
                if not same:
                    return f"output {name!r} differs from the module's ({rows} rows)"
        return ""

    def try_freeze(self, sizes: Optional[Sequence[int]]) -> None:
        """Serves the frozen form where ``freeze`` allows it and it answers
        as the function does, and for small batches its form with PyTorch's
        own convolution where that is cheaper.  freeze=True: ModelError
        when it cannot freeze."""
        if not self.freeze:
            return
        try:
            frozen = self.fold.timed(self.traced)
            why = self.same_answers(frozen)
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            why = (str(e) if isinstance(e, ModelError)
                   else f"tracing failed: {type(e).__name__}: {first[:200]}")
        if why:
            if self.freeze is True:
                raise ModelError(f"TorchModel(freeze=True) cannot freeze this module: {why}")
            self.freeze_reason = f"served unfrozen: {why}"
            return
        self.forward = frozen
        self.frozen = True
        self.freeze_reason = "traced and frozen; its answers match the module's"
        if self.freeze == "auto":
            self.fold.saving = self.measure_saving(frozen)
        self.try_own_convolutions(frozen, sizes)

    def own_conv_form(self) -> Any:
        """The function traced, frozen, and its convolutions rewritten to
        PyTorch's own kernel (own_convolutions); None when none could be."""
        small = self.traced()
        return small if own_convolutions(small) else None

    def try_own_convolutions(self, frozen: Any, sizes: Optional[Sequence[int]]) -> None:
        """The frozen form serving: serves batches of up to
        ``own_conv_rows`` rows with its form on PyTorch's own convolution
        where that answers as the function does and is cheaper at two rows.
        Any failure leaves the frozen form serving every size."""
        t = time.perf_counter_ns()
        try:
            small = self.own_conv_form()
            if small is None or self.same_answers(small):
                return
        except Exception:
            return
        cost = time.perf_counter_ns() - t
        rows = self.own_conv_split(frozen, small, sizes)
        if rows >= 2:
            self.small, self.own_conv_rows = small, rows
            self.fold.cost_ns += cost  # rebuilt with the frozen form

    @staticmethod
    def call_ns(forward: Any, xs: Sequence[Any]) -> float:
        """ns per call of ``forward(*xs)``, once warm: fastest of three
        rounds of five calls."""
        forward(*xs)
        forward(*xs)
        return best_ns(lambda: [forward(*xs) for _ in range(5)]) / 5

    def own_conv_split(self, frozen: Any, small: Any,
                              sizes: Optional[Sequence[int]]) -> int:
        """The largest batch the form on PyTorch's own convolution serves
        more cheaply than the frozen form on oneDNN's: both timed at each
        size served (powers of two without buckets) from 2 rows up, until
        the first where oneDNN's is cheaper; the sizes between that and the
        last where it was not are split where the two costs, taken as a line
        between them, cross."""
        points = [n for n in (sizes or pow2_buckets(self.max_batch)) if n >= 2]
        last: Optional[tuple[int, float]] = None  # (rows, ns saved) of the last win
        with torch.inference_mode():
            for rows in points:
                xs = self.example(rows)
                cost = [self.call_ns(f, xs) for f in (frozen, small)]
                saved = cost[0] - cost[1]
                if saved <= 0:
                    if last is None:
                        return 0
                    r0, s0 = last
                    return r0 + int((rows - r0) * s0 / (s0 - saved))
                last = (rows, saved)
        return points[-1] if points else 0

    def measure_saving(self, frozen: Any) -> tuple[float, float]:
        """What a frozen call saves against the function's, in ns per call
        and per row (a line through 1 row and a larger batch; fastest of
        three rounds each)."""
        big = max(2, min(self.max_batch, 16))
        cost = {}
        with torch.inference_mode():
            for rows in (1, big):
                xs = self.example(rows)
                for name, f in (("eager", self.eager), ("frozen", frozen)):
                    f(*xs)
                    cost[name, rows] = best_ns(lambda: [f(*xs) for _ in range(5)]) / 5
        s1 = cost["eager", 1] - cost["frozen", 1]
        sb = cost["eager", big] - cost["frozen", big]
        per_row = (sb - s1) / (big - 1)
        return s1 - per_row, per_row

    def after_update(self) -> None:
        """The weights changed, and the frozen graph holds the old ones:
        freeze=True freezes again now (ModelError, unfrozen, when that
        fails); "auto" serves the function until its calls have lost what
        freezing costs (count_loss), so that updates that come often cost
        little and rare ones are frozen again soon."""
        if self.freeze is True:
            try:
                self.freeze_again()
            except Exception as e:
                self.unfreeze(f"freezing again after a weight update failed: {e}")
                raise ModelError(f"TorchModel(freeze=True) cannot freeze the new weights: "
                                 f"{e}") from e
            return
        self.unfreeze("unfrozen since a weight update; frozen again once its calls have "
                      f"lost what freezing costs ({self.fold.cost_ns / 1e6:.0f} ms)")
        self.refold = True
        self.fold.lost_ns = 0.0

    def count_loss(self, rows: int) -> None:
        """freeze="auto", unfrozen since an update: counts what this call lost
        against a frozen one (at least 1 us), and freezes again, in this
        call's thread, once that reaches what freezing costs (Refold)."""
        self.fold.charge(rows, self.refreeze_due)

    def refreeze_due(self) -> None:
        if not self.refold:  # another thread did it
            return
        self.refold = False
        try:
            self.freeze_again()
        except Exception as e:
            self.freeze_reason = f"served unfrozen: freezing again failed: {e}"

    def freeze_again(self) -> None:
        """Traces and freezes the function with the current weights and
        serves that, with its form on PyTorch's own convolution where that
        served (the answers were checked at start-up)."""
        frozen, small = self.fold.timed(
            lambda: (self.traced(), self.own_conv_form() if self.own_conv_rows else None))
        self.small = small
        self.forward = frozen
        self.frozen = True
        self.freeze_reason = "traced and frozen again after a weight update"

    def unfreeze(self, why: str) -> None:
        self.small = None
        self.forward = self.eager
        self.frozen = False
        self.freeze_reason = f"served unfrozen: {why}"

    # -- running it -------------------------------------------------------------------

    def autocast_context(self) -> Any:
        if self.autocast is None:
            return contextlib.nullcontext()
        # No cached casts of the weights: a CUDA graph must read the
        # parameters themselves, which weight updates overwrite in place.
        return torch.autocast(self.device.type, dtype=self.autocast, cache_enabled=False)

    def fitted(self, xs: Sequence[Any]) -> list[Any]:
        """The outputs for the inputs ``xs`` (tensors on the model's device,
        in the declared order), in declaration order, each reshaped to
        ``[rows, *declared shape]`` and cast to the declared dtype, on the
        model's device; ModelError when one does not fit."""
        rows = xs[0].shape[0]
        forward, small = self.forward, self.small
        if small is not None and rows <= self.own_conv_rows:
            forward = small
        if self.autocast is None:
            out = forward(*xs)
        else:
            with self.autocast_context():
                out = forward(*xs)
        fitted = self.as_declared(out, rows)
        return fitted if fitted is not None else self.fit(out, rows)

    def as_declared(self, out: Any, rows: int) -> Optional[list[Any]]:
        """``out`` in declaration order when it is already what the spec
        declares: a dict with exactly the declared names, a plain tuple or
        list, or one tensor, whose tensors are on the model's device with
        the declared dtype and shape.  None for anything else, which
        ``fit`` then reshapes, casts or rejects.  The calls of a model
        whose outputs fit take this path alone: a few attribute reads per
        output."""
        names = self.names
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
        for t, (shape, want) in zip(given, self.declared):
            if (type(t) is not tensor or t.dtype is not want or t.device != device
                    or t.shape != (rows, *shape)):
                return None
        return list(given)

    def fit(self, out: Any, rows: int) -> list[Any]:
        """``fitted`` for outputs that need matching by name, a reshape or
        a cast, or that do not fit at all (ModelError)."""
        assert self.spec is not None
        given = match_outputs(out, self.names, getattr(out, "_fields", ()))
        fitted = []
        for t, o, want in zip(given, self.spec.outputs, self.want):
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
                if not castable(numpy_dtype(t.dtype) or str(t.dtype), o.dtype,
                                t.dtype.is_floating_point):
                    raise ModelError(f"model output {o.name!r} has dtype {t.dtype}, which "
                                     f"cannot be cast to the declared {o.dtype} under "
                                     "'same_kind' casting")
                t = t.to(want)
            fitted.append(t)
        return fitted

    def standalone(self, batch: Any) -> Any:
        """A call before ``prepare``: the batch (an array, or a dict of
        arrays by input name) through the module's function, its outputs
        as new ndarrays in the model's structure (dict, tuple or one array)."""
        def tensor(a: Any) -> Any:
            a = np.asarray(a)
            return torch.from_numpy(a.astype(a.dtype.newbyteorder("="))).to(self.device)

        fn = self.fn if self.compiled is None else self.compiled
        with torch.inference_mode(), self.autocast_context():
            if isinstance(batch, Mapping):
                out = fn(**{str(k): tensor(v) for k, v in batch.items()})
            else:
                out = fn(tensor(batch))

        def array(t: Any) -> Any:
            return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t

        if isinstance(out, Mapping):
            return {str(k): array(v) for k, v in out.items()}
        if isinstance(out, (list, tuple)):
            return tuple(array(v) for v in out)
        return array(out)
