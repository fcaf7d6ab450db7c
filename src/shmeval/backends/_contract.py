"""What every framework backend (``TFModel``, ``TorchModel``, ``JaxModel``)
checks the same way, without importing a framework: the batch sizes a
model is prepared for, how its outputs are matched to the declared ones
and fitted to them, the checks of a weight update, and when a faster
form of the model is rebuilt after one (:class:`Refold`).

The rules are those of the evaluator (docs/guide.md, *The model*): outputs
matched by name when the model names them, by order otherwise; an output
whose rows hold as many values as the declared shape is reshaped to it; a
dtype is cast under NumPy's 'same_kind' casting (and any float to any
float, since bfloat16 is no NumPy dtype).
"""
from __future__ import annotations

import math
import os
import re
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar, Union

import numpy as np

from ..errors import ModelError
from ..spec import MethodSpec, Spec

PathLike = Union[str, "os.PathLike[str]"]

#: The keys a TensorFlow SavedModel signature gives outputs that had no name.
_UNNAMED = re.compile(r"output_(\d+)")

T = TypeVar("T")


def best_ns(call: Callable[[], Any], repeats: int = 3) -> int:
    """The fastest of ``repeats`` calls, in ns."""
    best = None
    for _ in range(repeats):
        t = time.perf_counter_ns()
        call()
        dt = time.perf_counter_ns() - t
        best = dt if best is None else min(best, dt)
    assert best is not None
    return best


class Refold:
    """When to rebuild a form of the model that is faster per call but
    holds the weights (``TFModel``'s folded graphs, ``TorchModel``'s frozen
    trace): after a weight update the slower form serves, each call adds
    what it lost against the faster one (``saving``: ns per call and per
    row, measured at start-up; at least ``floor_ns``), and the faster form
    is rebuilt, in the calling thread, once the losses reach what the last
    rebuild cost (``cost_ns``).  Updates that come often then cost little
    and rare ones are rebuilt soon: never more than twice the better choice
    made in hindsight (ski rental)."""

    def __init__(self, floor_ns: float = 0.0) -> None:
        self.saving = (0.0, 0.0)
        self.cost_ns = 0
        self.lost_ns = 0.0
        self.floor_ns = floor_ns
        self._lock = threading.Lock()

    def timed(self, rebuild: Callable[[], T]) -> T:
        """``rebuild()``, its time kept as ``cost_ns``."""
        t = time.perf_counter_ns()
        out = rebuild()
        self.cost_ns = time.perf_counter_ns() - t
        return out

    def charge(self, rows: int, rebuild: Callable[[], Any]) -> None:
        """A call of ``rows`` rows by the slower form: adds its loss, and
        calls ``rebuild`` once the losses reach ``cost_ns``, unless another
        thread is at it (``rebuild`` then finds it done, or not due)."""
        a, b = self.saving
        self.lost_ns += max(self.floor_ns, a + b * rows)
        if self.lost_ns < self.cost_ns or not self._lock.acquire(blocking=False):
            return
        try:
            rebuild()
        finally:
            self._lock.release()


def pow2_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two below ``max_batch``, and ``max_batch``."""
    return tuple(sorted({1 << i for i in range(max_batch.bit_length())
                         if 1 << i < max_batch} | {max_batch}))


def own_buckets(buckets: Optional[Sequence[int]], who: str) -> Optional[tuple[int, ...]]:
    """A backend's ``buckets=`` argument, sorted, or None."""
    if buckets is None:
        return None
    sizes = tuple(sorted({int(x) for x in buckets}))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"{who} buckets must be positive ints, got {buckets!r}")
    return sizes


def serving_sizes(spec: Spec, evaluator_buckets: Optional[Sequence[int]],
                  own: Optional[tuple[int, ...]], static_shapes: bool,
                  who: str) -> Optional[tuple[int, ...]]:
    """The batch sizes a model serves: the evaluator's buckets, else the
    backend's own, else (for a backend that compiles one program per
    shape) powers of two up to max_batch; None means any size."""
    sizes = tuple(evaluator_buckets) if evaluator_buckets else own
    if sizes is None and static_shapes:
        sizes = pow2_buckets(spec.max_batch)
    if sizes is not None and max(sizes) < spec.max_batch:
        raise ModelError(f"{who} buckets {sizes}: the largest must be >= max_batch "
                         f"({spec.max_batch})")
    return sizes


def match_outputs(out: Any, declared: Sequence[str], model_names: Sequence[str] = ()) -> list[Any]:
    """The model's outputs in declaration order.

    By name when the model names them (dict keys; ``model_names`` for a
    list or tuple, such as Keras ``output_names`` or a named tuple's
    fields) with exactly the declared names; by order otherwise (a list or
    tuple, or the ``output_0``, ``output_1``... keys a SavedModel signature
    gives unnamed outputs); one output as it is.
    """
    if isinstance(out, Mapping):
        keys = [str(k) for k in out]
        if sorted(keys) == sorted(declared):
            given = [out[k] for k in declared]
        elif all(_UNNAMED.fullmatch(k) for k in keys):
            given = [out[k] for k in sorted(keys, key=lambda k: int(k[7:]))]
        else:
            raise ModelError(f"the model's outputs are named {sorted(keys)}, the spec "
                             f"declares {list(declared)}")
    elif isinstance(out, (list, tuple)):
        given = list(out)
        if len(model_names) == len(given) and sorted(model_names) == sorted(declared):
            given = [given[list(model_names).index(k)] for k in declared]
    else:
        given = [out]
    if len(given) != len(declared):
        raise ModelError(f"the model gives {len(given)} output(s), the spec declares "
                         f"{len(declared)} ({', '.join(declared)})")
    return given


def needs_reshape(name: str, per_row: tuple[int, ...], declared: tuple[int, ...]) -> bool:
    """Whether an output of ``per_row`` values per row must be reshaped to
    the declared shape; ModelError when it holds another number of values."""
    if per_row == declared:
        return False
    if math.prod(per_row) != math.prod(declared):
        raise ModelError(f"model output {name!r} has shape {per_row} per row "
                         f"({math.prod(per_row)} values), the spec declares {declared} "
                         f"({math.prod(declared)} values)")
    return True


def castable(have: Any, want: np.dtype[Any], is_float: bool) -> bool:
    """NumPy 'same_kind' casting from ``have`` (anything ``np.dtype``
    takes) to ``want``, plus any float to any float (``is_float``: ``have``
    is a floating type, which bfloat16 is without being a NumPy float)."""
    if is_float and want.kind == "f":
        return True
    try:
        return bool(np.can_cast(np.dtype(have), want, "same_kind"))
    except TypeError:
        return False


def check_warm_outputs(out: Mapping[str, Any], spec: Union[Spec, MethodSpec], rows: int) -> None:
    """The outputs of a warm-up batch of ``rows`` have the declared shapes
    (``spec``: an evaluator's of one method, or one method's)."""
    for o in spec.outputs:
        shape = tuple(out[o.name].shape)
        if shape != (rows, *o.shape):
            raise ModelError(f"model output {o.name!r} has shape {shape} for a batch "
                             f"of {rows}, expected {(rows, *o.shape)}")


def checked_weights(weights: Sequence[Any],
                    expected: Sequence[tuple[str, tuple[int, ...], np.dtype[Any]]]
                    ) -> list[np.ndarray]:
    """``weights`` as arrays of the expected (name, shape, dtype), checked
    all before any is used: ValueError naming the first that does not fit
    (its count, a shape, a dtype that 'same_kind' casting cannot reach)."""
    if len(weights) != len(expected):
        raise ValueError(f"set_weights: got {len(weights)} arrays, the model has "
                         f"{len(expected)} weights")
    arrays = []
    for i, ((name, shape, want), w) in enumerate(zip(expected, weights)):
        a = np.asarray(w)
        if a.shape != shape:
            raise ValueError(f"set_weights: weight {i} ({name}) has shape {shape}, got an "
                             f"array of shape {a.shape}")
        if a.dtype != want and not np.can_cast(a.dtype, want, "same_kind"):
            raise ValueError(f"set_weights: weight {i} ({name}) is {want}, got {a.dtype}, "
                             "which cannot be cast to it")
        arrays.append(a.astype(want, copy=False))
    return arrays


def npz_weights(path: PathLike) -> list[np.ndarray]:
    """The arrays of a ``.npz`` file written by ``np.savez(path, *weights)``,
    in order (``arr_0, arr_1, ...``)."""
    path = os.fspath(path)
    with np.load(path) as z:
        keys = sorted(z.files, key=lambda k: (len(k), k))
        if keys != [f"arr_{i}" for i in range(len(keys))]:
            raise ValueError(f"load_weights: {path} holds {sorted(z.files)}, expected "
                             "arr_0, arr_1, ... (np.savez(path, *weights))")
        return [z[k] for k in keys]


# -- named inputs and several methods ------------------------------------------------
# An evaluator's spec may declare named inputs (the model gets a dict of
# batched arrays) and several methods (the callable of each is the model's
# attribute of that name); see shmeval.spec.


def methods_arg(methods: Any, who: str) -> dict[str, Any]:
    """A backend's ``methods=`` argument: a non-empty dict whose keys are
    method names (identifiers, as ``Evaluator(methods=...)`` takes them)."""
    if not isinstance(methods, Mapping) or not methods:
        raise TypeError(f"{who}(methods=...) must be a non-empty dict {{method name: "
                        f"function}}, got {methods!r}")
    for name in methods:
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(f"{who}(methods=...): method names must be identifiers, got "
                            f"{name!r}")
    return dict(methods)


def expose_methods(owner: Any, callables: Mapping[str, Callable[[Any], Any]], who: str) -> None:
    """Sets each method's callable as the attribute of its name on the
    backend's object ``owner`` (where the evaluator looks it up); a name
    that is already one of ``owner``'s attributes is refused."""
    for name, call in callables.items():
        if hasattr(owner, name):
            raise ValueError(f"{who}(methods=...): {name!r} is an attribute of {who} itself; "
                             "give the method another name (here and in the evaluator's "
                             "methods=)")
    for name, call in callables.items():
        setattr(owner, name, call)


def for_method(m: MethodSpec, message: str) -> str:
    """``message`` naming method ``m`` ("method 'recurrent': ..."), as it is
    for an evaluator's only method."""
    return f"{m.describe()}: {message}" if m.name else message


def method_not_served(m: MethodSpec, served: Sequence[str], who: str) -> ModelError:
    """The error of a declared method the backend has no function for."""
    if not m.name:
        return ModelError(f"the evaluator serves one method, called as the model itself; "
                          f"{who} was given only methods= ({', '.join(map(repr, served))})")
    have = ", ".join(repr(s) for s in served if s) or "none"
    return ModelError(f"{m.describe()} is declared by the evaluator, but {who} has no function "
                      f"for it (its methods=: {have})")


def check_method_outputs(out: Mapping[str, Any], m: MethodSpec, rows: int) -> None:
    """The outputs of a warm-up batch of ``rows`` of method ``m`` have the
    declared shapes (ModelError naming the method and the output)."""
    for o in m.outputs:
        shape = tuple(out[o.name].shape)
        if shape != (rows, *o.shape):
            raise ModelError(for_method(m, f"model output {o.name!r} has shape {shape} for a "
                                           f"batch of {rows}, expected {(rows, *o.shape)}"))


def zero_inputs(m: MethodSpec, rows: int) -> Any:
    """A batch of ``rows`` zero states of method ``m``, as the evaluator
    passes them: an array for one unnamed input, else a dict by input name."""
    if not m.named:
        f = m.inputs[0]
        return np.zeros((rows, *f.shape), f.dtype)
    return {f.name: np.zeros((rows, *f.shape), f.dtype) for f in m.inputs}


def check_named_batch(batch: Any, m: MethodSpec, who: str) -> int:
    """The rows of ``batch``, a dict ``{input name: ndarray [rows, *shape]}``
    holding exactly method ``m``'s inputs with their declared shapes and
    dtypes; TypeError / ValueError naming the method and the input
    otherwise."""
    where = f"{who} ({m.describe()})" if m.name else who
    if not isinstance(batch, Mapping):
        raise TypeError(f"{where} takes a dict {{input name: array}} of the inputs "
                        f"{list(m.input_names)}, got a {type(batch).__name__}")
    if len(batch) != len(m.inputs) or not all(f.name in batch for f in m.inputs):
        missing = [n for n in m.input_names if n not in batch]
        extra = [str(k) for k in batch if k not in m.input_names]
        raise ValueError(f"{where} takes the inputs {list(m.input_names)}; "
                         + "; ".join(w for w in (f"missing {missing}" if missing else "",
                                                 f"not declared {extra}" if extra else "") if w))
    rows = -1
    for f in m.inputs:
        a = batch[f.name]
        if not (isinstance(a, np.ndarray) and a.ndim == len(f.shape) + 1
                and a.shape[1:] == f.shape and a.dtype == f.dtype):
            got = (f"an array of shape {a.shape}, dtype {a.dtype}" if isinstance(a, np.ndarray)
                   else f"a {type(a).__name__}")
            raise ValueError(f"{where}: input {f.name!r} must be an ndarray [rows, *{f.shape}] "
                             f"{f.dtype}, got {got}")
        if rows not in (-1, len(a)):
            raise ValueError(f"{where}: input {f.name!r} has {len(a)} rows, the inputs before "
                             f"it {rows}")
        rows = len(a)
    return rows
