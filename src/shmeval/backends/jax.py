"""JAX backend: ``JaxModel`` serves ``apply_fn(params, batch)`` (a Flax
``model.apply``, a Haiku ``transformed.apply`` or any function of a params
pytree and a batch) to a shmeval evaluator.

Import this module only in the process that runs the model (it imports
JAX)::

    def factory():
        from shmeval.backends.jax import JaxModel
        return JaxModel(net.apply, params)

    ev = shmeval.Evaluator.spawn(factory, input_shape=..., outputs=...)

What it does for the evaluator:

* ``prepare(spec, buckets)`` compiles ``apply_fn`` once per batch size (XLA
  compiles one program per shape, so batches are padded to buckets),
  matching the outputs to the declared ones (by name, else by order) and
  reshaping and casting them inside the compiled program, then runs each
  size once, so that a mismatch raises ``ModelError`` at start-up and
  serving never traces again;
* ``__call__(batch)`` runs the compiled program for the batch's size and
  returns ``{name: ndarray}`` with exactly the declared dtypes and shapes;
* ``set_weights`` / ``load_weights`` swap the params for new arrays of the
  same structure, shapes and dtypes, which the compiled programs take as
  they are: nothing is traced again.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ModelError
from ..spec import OutputSpec, Spec
from ._contract import (PathLike, castable, check_warm_outputs, checked_weights,
                        match_outputs, needs_reshape, npz_weights, own_buckets, serving_sizes)
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


class JaxModel:
    """A JAX model as a shmeval evaluator model: ``apply_fn(params, batch)``
    with ``batch [rows, *input_shape]``, returning an array, a tuple or list
    (a named tuple's fields name its entries) or a dict of arrays.

    ``params``: a pytree of arrays (put on ``device``).  ``device``: a JAX
    device, a platform name (``"cpu"``, ``"gpu"``) or ``"cuda:N"`` (the
    N-th of ``jax.devices("gpu")``); default JAX's first device (a GPU
    when the installed jaxlib has one).  ``buckets``: batch
    sizes to compile for and pad to, used when the evaluator has none
    (default: powers of two up to ``max_batch``).

    After ``prepare``: ``trace_count`` (times ``apply_fn`` was traced: once
    per batch size; constant while serving and across weight updates) and
    ``warmup_s`` (seconds ``prepare`` took).

    ``max_concurrency`` (2): calls from two serving threads may overlap (a
    compiled program runs without the GIL, and a call reads the params
    without changing anything); the evaluator's tuner keeps two in flight
    where that serves more.
    """

    max_concurrency = 2

    def __init__(self, apply_fn: Callable[..., Any], params: Any, *,
                 buckets: Optional[Sequence[int]] = None, device: Any = None) -> None:
        if not callable(apply_fn):
            raise TypeError(f"JaxModel needs a callable apply_fn, got {type(apply_fn).__name__}")
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
        self._by_rows: dict[int, Any] = {}  # compiled programs by batch size

    def _body(self, params: Any, x: Any) -> Any:
        # Runs only while JAX traces: count traces here.
        self.trace_count += 1
        out = self.apply_fn(params, x)
        assert self.spec is not None
        given = match_outputs(out, self.spec.output_names, getattr(out, "_fields", ()))
        return tuple(_fit(t, o, x.shape[0]) for t, o in zip(given, self.spec.outputs))

    def prepare(self, spec: Spec, buckets: Optional[Sequence[int]]) -> Optional[tuple[int, ...]]:
        """Compiles for every batch size the evaluator will use, checking the
        outputs against the spec while tracing, and runs each once.
        Returns the buckets this model wants when the evaluator has none:
        its own, or powers of two up to max_batch."""
        t0 = time.perf_counter()
        sizes = serving_sizes(spec, buckets, self.buckets, True, "JaxModel")
        assert sizes is not None
        self.spec = spec
        jitted = jax.jit(self._body)
        dtype = spec.input_dtype.newbyteorder("=")
        self._by_rows = {}
        for rows in sizes:
            x = jax.ShapeDtypeStruct((rows, *spec.input_shape), dtype)
            self._by_rows[rows] = jitted.lower(self.params, x).compile()
        for rows in sizes:
            batch = np.zeros((rows, *spec.input_shape), dtype)
            try:
                out = self(batch)
            except Exception as e:
                raise ModelError(f"the model failed on a batch of {rows} zero states: "
                                 f"{type(e).__name__}: {e}") from e
            check_warm_outputs(out, spec, rows)
        self.warmup_s = time.perf_counter() - t0
        return None if buckets else sizes

    def __call__(self, batch: np.ndarray) -> Any:
        """Evaluates ``batch [rows, *input_shape]``.  After ``prepare``: a dict
        ``{name: ndarray}`` of the declared dtypes and shapes, ``rows`` one
        of the sizes compiled for.  Before it (a standalone call): the
        model's outputs as ndarrays, in the model's structure."""
        if self.spec is None:
            out = jax.jit(self.apply_fn)(self.params, jnp.asarray(batch))
            return jax.tree_util.tree_map(np.asarray, out)
        fn = self._by_rows.get(len(batch))
        if fn is None:
            raise ValueError(f"JaxModel was compiled for batches of {sorted(self._by_rows)} "
                             f"rows, got {len(batch)} (the evaluator pads to these sizes)")
        if batch.shape[1:] != self.spec.input_shape or batch.dtype != self.spec.input_dtype:
            raise ValueError(f"JaxModel was prepared for batches of shape "
                             f"[n, *{self.spec.input_shape}] {self.spec.input_dtype}, "
                             f"got {batch.shape} {batch.dtype}")
        if not batch.dtype.isnative:
            batch = batch.astype(batch.dtype.newbyteorder("="))
        out = fn(self.params, batch)
        # On the CPU a view of the result's buffer, elsewhere one copy to
        # the host; the evaluator copies it into the slots.
        return {name: np.asarray(t) for name, t in zip(self.spec.output_names, out)}

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
