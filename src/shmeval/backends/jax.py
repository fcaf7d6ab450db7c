"""JAX backend: ``JaxModel`` serves ``apply_fn(params, batch)`` (a Flax
``model.apply``, a Haiku ``transformed.apply`` or any function of a params
pytree and a batch) to a shmeval evaluator; with ``methods=``, several such
functions of one params pytree (a MuZero net's initial and recurrent
inference).

Import this module only in the process that runs the model (it imports
JAX)::

    def factory():
        from shmeval.backends.jax import JaxModel
        return JaxModel(net.apply, params)

    ev = shmeval.Evaluator.spawn(factory, input_shape=..., outputs=...)

What it does for the evaluator:

* ``prepare(spec, buckets)`` compiles ``apply_fn`` (with methods, each
  method's function) once per batch size (XLA
  compiles one program per shape, so batches are padded to buckets),
  matching the outputs to the declared ones (by name, else by order) and
  reshaping and casting them inside the compiled program, then runs each
  size once, so that a mismatch raises ``ModelError`` at start-up and
  serving never traces again;
* ``__call__(batch)`` (with methods, ``model.<method name>(batch)``) runs
  the compiled program for the batch's size and returns ``{name: ndarray}``
  with exactly the declared dtypes and shapes; a batch is an array, or a
  dict of arrays by input name for named inputs;
* ``set_weights`` / ``load_weights`` swap the params for new arrays of the
  same structure, shapes and dtypes, which the compiled programs (of every
  method) take as they are: nothing is traced again.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ModelError
from ..spec import MethodSpec, OutputSpec, Spec
from ._contract import (PathLike, castable, check_method_outputs, check_named_batch,
                        checked_weights, expose_methods, for_method, match_outputs,
                        method_not_served, methods_arg, needs_reshape, npz_weights, own_buckets,
                        serving_sizes, zero_inputs)
from ._device import cuda_index


def _device(device: Any) -> Any:
    """A JAX device: the given one, the first of a platform ("cpu", "gpu"),
    GPU N for PyTorch's name "cuda:N" (what ``Evaluator.spawn(devices=...)``
    hands each replica's factory), or (None) JAX's default device."""
    if device is None:
        return jax.devices()[0]
    if isinstance(device, str):
        index = cuda_index(device)
        platform = device if index is None else "gpu"
        try:
            found = jax.devices(platform)
        except RuntimeError as e:
            raise ValueError(f"JaxModel: no {device!r} device here ({e})") from None
        if index is not None and index >= len(found):
            raise ValueError(f"JaxModel: no {device!r} device here ({len(found)} GPU(s))")
        return found[index or 0]
    return device


def _fit(t: Any, o: OutputSpec, rows: int) -> Any:
    """One output, reshaped to ``[rows, *o.shape]`` when it holds as many
    values per row, and cast to the declared dtype (traced code)."""
    if not (hasattr(t, "shape") and hasattr(t, "dtype")):
        raise ModelError(f"model output {o.name!r} is a {type(t).__name__}, not an array")
    if t.ndim == 0 or t.shape[0] != rows:
        raise ModelError(f"model output {o.name!r} has shape {tuple(t.shape)} for a batch of "
                         f"{rows}, expected {(rows, *o.shape)}")
    if needs_reshape(o.name, tuple(t.shape[1:]), o.shape):
        t = t.reshape(rows, *o.shape)
    want = o.dtype.newbyteorder("=")
    if t.dtype != want:
        if not castable(t.dtype, want, bool(jnp.issubdtype(t.dtype, jnp.floating))):
            raise ModelError(f"model output {o.name!r} has dtype {t.dtype}, which cannot be "
                             f"cast to the declared {o.dtype} under 'same_kind' casting")
        t = t.astype(want)
    return t


class _Method:
    """One function a :class:`JaxModel` serves, ``fn(params, inputs)``: its
    ``apply_fn`` (name "") or one of its ``methods``.  ``prepare`` compiles
    it for the spec's method of its name, once per batch size; calling it
    evaluates a batch of that method's inputs."""

    def __init__(self, owner: "JaxModel", name: str, fn: Callable[..., Any]) -> None:
        self.owner = owner
        self.name = name
        self.fn = fn
        self.m: Optional[MethodSpec] = None  # the spec's method, once prepared
        self.by_rows: dict[int, Any] = {}  # compiled programs by batch size
        self.native = True  # every input's declared dtype is in native byte order

    def _body(self, params: Any, x: Any) -> Any:
        # Runs only while JAX traces: count traces here.
        self.owner.trace_count += 1
        m = self.m
        assert m is not None
        out = self.fn(params, x)
        given = match_outputs(out, m.output_names, getattr(out, "_fields", ()))
        rows = jax.tree_util.tree_leaves(x)[0].shape[0]
        return tuple(_fit(t, o, rows) for t, o in zip(given, m.outputs))

    def compile(self, m: MethodSpec, sizes: Sequence[int]) -> None:
        """Compiles for method ``m``'s inputs at each batch size; a mismatch
        of its outputs raises ModelError naming the method."""
        self.m = m
        self.native = all(f.dtype.isnative for f in m.inputs)
        jitted = jax.jit(self._body)
        self.by_rows = {}
        for rows in sizes:
            x = jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype.newbyteorder("=")),
                zero_inputs(m, rows))
            try:
                self.by_rows[rows] = jitted.lower(self.owner.params, x).compile()
            except Exception as e:
                if not m.name:  # the evaluator's only method: as it is
                    raise
                why = str(e) if isinstance(e, ModelError) else (
                    f"tracing it for a batch of {rows} failed: {type(e).__name__}: {e}")
                raise ModelError(for_method(m, why)) from e

    def warm_up(self, rows: int) -> None:
        """Runs a batch of zeros and checks the exact outputs."""
        assert self.m is not None
        try:
            out = self(zero_inputs(self.m, rows))
        except Exception as e:
            raise ModelError(for_method(self.m, f"the model failed on a batch of {rows} zero "
                                                f"states: {type(e).__name__}: {e}")) from e
        check_method_outputs(out, self.m, rows)

    def __call__(self, batch: Any) -> Any:
        """Evaluates ``batch``: ``[rows, *input_shape]``, or a dict of such
        arrays by input name.  After ``prepare``: a dict ``{name:
        ndarray}`` of the declared dtypes and shapes, ``rows`` one of the
        sizes compiled for.  Before it (a standalone call): the function's
        outputs as ndarrays, in its own structure."""
        m = self.m
        if m is None:
            out = jax.jit(self.fn)(self.owner.params, jax.tree_util.tree_map(jnp.asarray, batch))
            return jax.tree_util.tree_map(np.asarray, out)
        if m.named:
            rows = check_named_batch(batch, m, "JaxModel")
            if not self.native:
                batch = {k: a.astype(a.dtype.newbyteorder("=")) for k, a in batch.items()}
        else:
            rows = len(batch)
            f = m.inputs[0]
            if batch.shape[1:] != f.shape or batch.dtype != f.dtype:
                raise ValueError(f"JaxModel was prepared for batches of shape [n, *{f.shape}] "
                                 f"{f.dtype}, got {batch.shape} {batch.dtype}")
            if not self.native:
                batch = batch.astype(batch.dtype.newbyteorder("="))
        fn = self.by_rows.get(rows)
        if fn is None:
            raise ValueError(for_method(m, f"JaxModel was compiled for batches of "
                                           f"{sorted(self.by_rows)} rows, got {rows} (the "
                                           "evaluator pads to these sizes)"))
        out = fn(self.owner.params, batch)
        # On the CPU a view of the result's buffer, elsewhere one copy to
        # the host; the evaluator copies it into the slots.
        return {o.name: np.asarray(t) for o, t in zip(m.outputs, out)}


class JaxModel:
    """A JAX model as a shmeval evaluator model: ``apply_fn(params, batch)``
    with ``batch [rows, *input_shape]``, returning an array, a tuple or list
    (a named tuple's fields name its entries) or a dict of arrays.

    **Named inputs** (``Evaluator(inputs={"planes": ..., "mask": ...})``):
    ``batch`` is a dict ``{input name: array [rows, *shape]}`` (a pytree,
    as JAX functions take several inputs), ``apply_fn(params, {"planes":
    p, "mask": m})``.

    **Several methods** (``Evaluator(methods={"initial": Method(...),
    "recurrent": Method(...)})``): ``methods={"initial": initial_fn,
    "recurrent": recurrent_fn}``, each a function ``(params, inputs) ->
    outputs`` called with that method's dict of inputs; or, with
    ``apply_fn`` a Flax module's ``apply``, the name of one of the
    module's methods (``JaxModel(net.apply, params, methods={"initial":
    "initial_inference", ...})`` calls ``net.apply(params, inputs,
    method="initial_inference")``).  ``model.initial`` and
    ``model.recurrent`` (the attribute of each method's name) evaluate a
    batch of that method's inputs: what the evaluator calls.  ``apply_fn``
    may then be left out (``JaxModel(params=params, methods=...)``).  One
    params pytree serves every method: ``set_weights`` changes them all at
    once.

    ``params``: a pytree of arrays (put on ``device``).  ``device``: a JAX
    device, a platform name (``"cpu"``, ``"gpu"``) or ``"cuda:N"`` (the
    N-th of ``jax.devices("gpu")``); default JAX's first device (a GPU
    when the installed jaxlib has one).  ``buckets``: batch
    sizes to compile for and pad to, used when the evaluator has none
    (default: powers of two up to ``max_batch``).

    After ``prepare``: ``trace_count`` (times a function was traced: once
    per method and batch size; constant while serving and across weight
    updates) and ``warmup_s`` (seconds ``prepare`` took).

    ``max_concurrency`` (2): calls from two serving threads may overlap (a
    compiled program runs without the GIL, and a call reads the params
    without changing anything); the evaluator's tuner keeps two in flight
    where that serves more.
    """

    max_concurrency = 2

    def __init__(self, apply_fn: Optional[Callable[..., Any]] = None, params: Any = None, *,
                 methods: Optional[Mapping[str, Union[Callable[..., Any], str]]] = None,
                 buckets: Optional[Sequence[int]] = None, device: Any = None) -> None:
        if not callable(apply_fn) and (methods is None or apply_fn is not None):
            raise TypeError(f"JaxModel needs a callable apply_fn, got {type(apply_fn).__name__}")
        fns: dict[str, Callable[..., Any]] = {} if apply_fn is None else {"": apply_fn}
        for name, f in ({} if methods is None else methods_arg(methods, "JaxModel")).items():
            if isinstance(f, str):
                if apply_fn is None:
                    raise TypeError(f"JaxModel(methods=...): {name!r} is the name {f!r}, which "
                                    "needs apply_fn (a Flax module's apply, called with "
                                    f"method={f!r})")
                fns[name] = functools.partial(apply_fn, method=f)
            elif callable(f):
                fns[name] = f
            else:
                raise TypeError(f"JaxModel(methods=...): {name!r} must be a function (params, "
                                "inputs) -> outputs, or the name of a method of the Flax "
                                f"module whose apply is apply_fn; got {type(f).__name__}")
        self.apply_fn = apply_fn
        self.device = _device(device)
        self.buckets = own_buckets(buckets, "JaxModel")
        leaves, self._treedef = jax.tree_util.tree_flatten(params)
        self._names = [jax.tree_util.keystr(path) for path, _ in
                       jax.tree_util.tree_flatten_with_path(params)[0]]
        self.params = jax.device_put(params, self.device)
        self.spec: Optional[Spec] = None
        self.trace_count = 0
        self.warmup_s = 0.0
        self._methods = {name: _Method(self, name, f) for name, f in fns.items()}
        # What model(batch) calls: the evaluator's only method, once prepared.
        self._one: Optional[_Method] = self._methods.get("")
        expose_methods(self, {n: f for n, f in self._methods.items() if n}, "JaxModel")

    def prepare(self, spec: Spec, buckets: Optional[Sequence[int]]) -> Optional[tuple[int, ...]]:
        """Compiles every method of the spec for every batch size the
        evaluator will use, checking the outputs against the spec while
        tracing, and runs each once.  Returns the buckets this model wants
        when the evaluator has none: its own, or powers of two up to
        max_batch."""
        t0 = time.perf_counter()
        sizes = serving_sizes(spec, buckets, self.buckets, True, "JaxModel")
        assert sizes is not None
        served = []
        for m in spec.methods:
            method = self._methods.get(m.name)
            if method is None:
                raise method_not_served(m, list(self._methods), "JaxModel")
            served.append((method, m))
        self.spec = spec
        for method in self._methods.values():
            method.m, method.by_rows = None, {}
        for method, m in served:
            method.compile(m, sizes)
        self._one = served[0][0] if len(served) == 1 else None
        for method, _ in served:
            for rows in sizes:
                method.warm_up(rows)
        self.warmup_s = time.perf_counter() - t0
        return None if buckets else sizes

    def __call__(self, batch: Any) -> Any:
        """Evaluates ``batch [rows, *input_shape]`` (named inputs: a dict of
        such arrays by input name).  After ``prepare``: a dict ``{name:
        ndarray}`` of the declared dtypes and shapes, ``rows`` one of the
        sizes compiled for.  Before it (a standalone call): the model's
        outputs as ndarrays, in the model's structure.  With several
        methods, each is called by its name (``model.recurrent(batch)``)."""
        one = self._one
        if one is None:
            raise TypeError(f"this JaxModel serves the methods "
                            f"{[n for n in self._methods if n]}: call model.<method>(batch)")
        return one(batch)

    # -- weights ---------------------------------------------------------------------

    def get_weights(self) -> list[np.ndarray]:
        """Copies of the params' leaves in ``jax.tree_util.tree_flatten``
        order."""
        return [np.array(leaf) for leaf in jax.tree_util.tree_leaves(self.params)]

    def set_weights(self, weights: Union[Sequence[Any], Mapping[str, Any], Any]) -> None:
        """Replaces the params: a list of arrays in ``tree_flatten`` order
        (``get_weights()``), or a pytree of the same structure.  Count,
        structure, shapes and dtypes are checked first: a bad update raises
        ValueError and the old params keep serving.  Nothing is traced or
        compiled again."""
        if isinstance(weights, (list, tuple)) and all(hasattr(w, "shape") for w in weights):
            leaves = list(weights)
        else:
            leaves, treedef = jax.tree_util.tree_flatten(weights)
            if treedef != self._treedef:
                raise ValueError(f"set_weights: the params' structure is {self._treedef}, "
                                 f"got {treedef}")
        old = jax.tree_util.tree_leaves(self.params)
        arrays = checked_weights(leaves, [(name, tuple(leaf.shape), np.dtype(leaf.dtype))
                                          for name, leaf in zip(self._names, old)])
        self.params = jax.device_put(jax.tree_util.tree_unflatten(self._treedef, arrays),
                                     self.device)

    def load_weights(self, path: PathLike) -> None:
        """Loads params from a ``.npz`` file of arrays in ``tree_flatten``
        order (``np.savez(path, *model.get_weights())``).  A failed load
        leaves the old params."""
        self.set_weights(npz_weights(path))


__all__ = ["JaxModel"]
