"""TensorFlow backend: ``TFModel`` serves a Keras model, a ``tf.function`` /
``tf.Module`` or a saved model to a shmeval evaluator; with ``methods=``,
several of its functions on its one set of weights (a MuZero net's initial
and recurrent inference).

Import this module only in the process that runs the model (it imports
TensorFlow)::

    def factory():
        from shmeval.backends.tensorflow import TFModel
        return TFModel("net.keras")

    ev = shmeval.Evaluator.spawn(factory, input_shape=..., outputs=...)

What it does for the evaluator:

* ``prepare(spec, buckets)`` traces the model (with methods, each method's
  function) once per batch shape it will see, matches the model's outputs to the declared ones (by name, else by
  order), reshapes and casts them inside the traced function, and runs each
  shape once, so that serving never retraces and the evaluator's fast path
  takes the outputs as they are;
* ``__call__(batch)`` (with methods, ``model.<method name>(batch)``) calls
  the traced function and returns ``{name: ndarray}`` with exactly the
  declared dtypes and shapes; a batch is an array, or a dict of arrays by
  input name for named inputs;
* ``set_weights`` / ``load_weights`` swap the weights in place (variables are
  assigned, nothing is retraced; with ``freeze=True`` the weights are folded
  into new graphs instead, see :class:`FrozenGraph`).
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from ..errors import ModelError
from ..spec import MethodSpec, OutputSpec, Spec
from ._contract import (PathLike, Refold, best_ns, castable, check_method_outputs,
                        check_named_batch, checked_weights, expose_methods, for_method,
                        match_outputs, method_not_served, methods_arg, needs_reshape,
                        npz_weights, own_buckets, serving_sizes, zero_inputs)
from ._device import cuda_index, threads_per_call


def configure(memory_growth: bool = True, memory_limit_mb: Optional[int] = None,
              intra_op_threads: Optional[int] = None,
              inter_op_threads: Optional[int] = None) -> None:
    """Process-wide TensorFlow settings; they only apply before TensorFlow
    initialises its runtime (the first op or device query that creates it).

    ``memory_growth`` lets every visible GPU allocate memory as needed instead
    of reserving nearly all of it up front (so the evaluator leaves room for
    other processes); ``memory_limit_mb`` instead caps each GPU at that many
    MB (one logical device per GPU).  ``intra_op_threads`` /
    ``inter_op_threads`` size TensorFlow's CPU thread pools (None: leave
    TensorFlow's default, one thread per core).  A setting that can no longer
    be applied, because TensorFlow was initialised with another value, gives a
    warning instead of an error; setting the value already in force is a
    no-op.
    """
    def apply(what: str, setter: Callable[..., None], *args: Any) -> None:
        try:
            setter(*args)
        except (RuntimeError, ValueError) as e:
            warnings.warn(f"shmeval could not set TensorFlow's {what}: {e}; the current "
                          "setting stays (configure TensorFlow before it initialises)",
                          RuntimeWarning, stacklevel=3)

    for gpu in tf.config.list_physical_devices("GPU"):
        if memory_limit_mb is not None:
            limit = [tf.config.LogicalDeviceConfiguration(memory_limit=int(memory_limit_mb))]
            apply(f"memory limit of {gpu.name}", tf.config.set_logical_device_configuration,
                  gpu, limit)
        elif memory_growth:
            apply(f"memory growth of {gpu.name}", tf.config.experimental.set_memory_growth,
                  gpu, True)
    if intra_op_threads is not None:
        apply("intra-op thread count", tf.config.threading.set_intra_op_parallelism_threads,
              int(intra_op_threads))
    if inter_op_threads is not None:
        apply("inter-op thread count", tf.config.threading.set_inter_op_parallelism_threads,
              int(inter_op_threads))


def tf_device(device: Optional[str]) -> Optional[str]:
    """TensorFlow's name for ``device``: ``/GPU:N`` for PyTorch's
    ``cuda:N`` (what ``Evaluator.spawn(devices=...)`` hands each replica's
    factory), any other name as it is."""
    index = None if device is None else cuda_index(device)
    return device if index is None else f"/GPU:{index}"


def _auto_threads(concurrency: int) -> None:
    """``intra_op_threads`` / ``inter_op_threads`` "auto": as many inter-op
    threads as model calls may be in flight (``TFModel.max_concurrency``),
    and the CPUs this process may use split between those calls for each
    call's ops.  Applied only while TensorFlow has not initialised (a model
    built before TFModel was made did that: then its settings stay)."""
    for setter, n in ((tf.config.threading.set_inter_op_parallelism_threads, concurrency),
                      (tf.config.threading.set_intra_op_parallelism_threads,
                       threads_per_call(concurrency))):
        try:
            setter(n)
        except (RuntimeError, ValueError):
            pass


def _is_keras(obj: Any) -> bool:
    # Without importing Keras: an object can only be a Keras model if Keras
    # (or legacy tf_keras) is loaded already.
    for name in ("keras", "tf_keras"):
        mod = sys.modules.get(name)
        if mod is not None and isinstance(obj, getattr(mod, "Model", ())):
            return True
    return False


def _load(source: Any, methods_only: bool = False) -> Any:
    """The model object: ``source`` itself, or what a path holds
    (``methods_only``: served by named functions of it, so it need not be
    callable itself)."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            return tf.saved_model.load(path)
        if path.endswith((".keras", ".h5")):
            import keras
            return keras.models.load_model(path, compile=False)
        raise ValueError(f"TFModel: {path!r} is neither a SavedModel directory nor a "
                         ".keras / .h5 file")
    if not callable(source) and not methods_only:
        raise TypeError(f"TFModel needs a Keras model, a tf.function / tf.Module, a .keras "
                        f"file or a SavedModel directory, got {type(source).__name__}, which "
                        "is not callable (a model served by its named functions takes "
                        "methods=)")
    return source


def _fit(t: Any, o: OutputSpec) -> Any:
    """One output tensor, reshaped to ``[rows, *o.shape]`` when it holds as
    many values per row, and cast to the declared dtype (traced code)."""
    if not tf.is_tensor(t):
        raise ModelError(f"model output {o.name!r} is a {type(t).__name__}, not a tensor")
    if t.shape.rank == 0:
        raise ModelError(f"model output {o.name!r} is a scalar; expected one row per input "
                         f"row of shape {o.shape}")
    per_row = t.shape[1:]
    if per_row.is_fully_defined():
        if needs_reshape(o.name, tuple(per_row.as_list()), o.shape):
            t = tf.reshape(t, [tf.shape(t)[0], *o.shape])
    elif not per_row.is_compatible_with(o.shape):
        # Unknown dimensions: reshape; the warm-up run shows whether it fits.
        t = tf.reshape(t, [tf.shape(t)[0], *o.shape])
    want = o.dtype.newbyteorder("=")
    if t.dtype != tf.as_dtype(want):
        if not castable(t.dtype.as_numpy_dtype, want, t.dtype.is_floating):
            raise ModelError(f"model output {o.name!r} has dtype {t.dtype.name}, which cannot "
                             f"be cast to the declared {o.dtype} under 'same_kind' casting")
        t = tf.cast(t, want)
    return t


def _arrange(out: Any, outputs: Sequence[OutputSpec], model_names: Sequence[str]) -> tuple[Any, ...]:
    """The model's outputs in declaration order (matched by
    :func:`~shmeval.backends._contract.match_outputs`), fitted (traced
    code)."""
    given = match_outputs(out, [o.name for o in outputs], model_names)
    return tuple(_fit(t, o) for t, o in zip(given, outputs))


def _plain(out: Any) -> Any:
    """Without a spec: the model's own structure, lists as tuples."""
    if isinstance(out, Mapping):
        return {str(k): v for k, v in out.items()}
    if isinstance(out, (list, tuple)):
        return tuple(out)
    return out


def _freeze(concrete: Any, what: str) -> tuple[Any, list[str], list[str], Any]:
    """The graph of ``concrete`` (a concrete function of one tensor, or of
    one dict of tensors) with the values its variables hold now as
    constants: (graph_def, the inputs' tensor names in ``tf.nest.flatten``
    order, the outputs' tensor names, the output structure)."""
    # The converter lives in TensorFlow's framework package (what
    # tf.compat.v1.graph_util's converter is for TF1 graphs); what it returns
    # is run with public API only.
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2)

    args, kwargs = concrete.structured_input_signature
    if len(args) != 1 or kwargs:
        raise ValueError(f"{what}: the concrete function must take one tensor (or one dict "
                         "of tensors)")
    specs = tf.nest.flatten(args[0])
    converted = convert_variables_to_constants_v2(concrete)
    feeds = [t.name for t in converted.inputs]
    if len(feeds) != len(specs):
        raise ValueError(f"{what}: the frozen graph still takes {len(feeds)} inputs "
                         f"({feeds}); only the state's {len(specs)} should be left")
    return (converted.graph.as_graph_def(), feeds, [t.name for t in converted.outputs],
            concrete.structured_outputs)


def frozen_function(concrete: Any, jit_compile: bool = False) -> Any:
    """``concrete`` (a concrete function of one tensor, or of one dict of
    tensors) with the values its
    variables hold now folded into its graph as constants: a new concrete
    function of the same input signature and output structure.

    TensorFlow's graph optimiser can then fold what only depends on the
    weights (a batch norm after a convolution becomes the convolution's
    bias) and drops the variable reads, which lowers the fixed cost of a
    call; for the self-play net 17-27% at batches 1-16, nothing by 64
    (``bench/tf_model_cost.py --net selfplay --freeze``, against the same
    command without ``--freeze``).  Later changes to the variables do
    not reach the frozen function: freeze again after them.  Without XLA,
    :class:`FrozenGraph` runs the same graph for less per call."""
    graph_def, feeds, fetches, structure = _freeze(concrete, "frozen_function")
    # The import maps the placeholders' uses to the new inputs but still
    # imports the placeholders, which XLA cannot compile: make them unused
    # scalar constants.
    feed_ops = {feed.rsplit(":", 1)[0] for feed in feeds}
    for node in graph_def.node:
        if node.name in feed_ops and node.op == "Placeholder":
            dtype = node.attr["dtype"].type
            node.op = "Const"
            node.ClearField("attr")
            node.attr["dtype"].type = dtype
            node.attr["value"].tensor.CopyFrom(
                tf.make_tensor_proto(np.zeros((), tf.dtypes.as_dtype(dtype).as_numpy_dtype)))

    def run(x: Any) -> Any:
        flat = tf.graph_util.import_graph_def(
            graph_def, input_map=dict(zip(feeds, tf.nest.flatten(x))),
            return_elements=fetches, name="frozen")
        return tf.nest.pack_sequence_as(structure, flat)

    return tf.function(run, jit_compile=jit_compile).get_concrete_function(
        concrete.structured_input_signature[0][0])


class FrozenGraph:
    """``concrete`` (a concrete function of one tensor, or of one dict of
    tensors) with the values its
    variables hold now folded in as constants, run by a TensorFlow session
    in the calling thread.

    ``fg(x)`` takes an ndarray of the function's input dtype (a dict of
    them for a dict of tensors) and returns
    the concrete function's output structure with ndarrays in place of
    tensors; ``fg.run_flat(x)`` returns the outputs as a flat list (in
    ``tf.nest.flatten`` order).  No output shares memory with the input, so
    the caller may refill it after the call.  Any batch size the concrete
    function accepts is served by the same graph, without tracing again.

    Why: an eager call of a ``tf.function`` hands the graph to TensorFlow's
    inter-op thread pool and waits to be woken, under several layers of
    Python; a session configured with ``inter_op_parallelism_threads=-1``
    runs the graph in the caller's thread.  For the self-play demo's net
    (one intra-op thread) a call costs 231 µs at batch 1 and 1.25 ms at
    batch 33, against 0.40 and 1.35 ms for :func:`frozen_function`
    (``bench/tf_model_cost.py --net selfplay --styles --batches 1,33``).
    The ops' own parallelism is
    TensorFlow's process-wide intra-op pool (see :func:`configure`).  Calls
    from several threads at once are safe and run in parallel.  Later
    changes to the variables do not reach the graph: freeze again after
    them.  The session's GPU memory grows as needed; the process-wide
    settings of :func:`configure` apply where TensorFlow set up the GPU
    before (``TFModel`` does that first).

    ``bfloat16=True`` lets the session's graph optimiser compute what
    oneDNN can in bfloat16 (TensorFlow's ``auto_mixed_precision_onednn_
    bfloat16`` rewrite: convolutions and matrix products in bfloat16, casts
    around them, float32 in and out).  On a CPU with native bfloat16
    (:func:`shmeval.backends._device.cpu_bfloat16`) the self-play net costs
    19-33% less per row from 16 rows on, and about 9% more at one row; its
    outputs move by up to about 1e-3 (``bench/tf_model_cost.py --net
    selfplay --freeze --bfloat16``, against the same command without
    ``--bfloat16``).  The rewrite
    is for the CPU: ops placed on a GPU stay as they are."""

    def __init__(self, concrete: Any, bfloat16: bool = False) -> None:
        graph_def, feeds, fetches, self.structure = _freeze(concrete, "FrozenGraph")
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=-1,
                                          allow_soft_placement=True)
        config.gpu_options.allow_growth = True
        self.bfloat16 = bool(bfloat16)
        if self.bfloat16:
            from tensorflow.core.protobuf import rewriter_config_pb2

            config.graph_options.rewrite_options.auto_mixed_precision_onednn_bfloat16 = (
                rewriter_config_pb2.RewriterConfig.ON)
        self.config = config
        self.session = tf.compat.v1.Session(graph=self.graph, config=config)
        run = self.session.make_callable(
            [self.graph.get_tensor_by_name(name) for name in fetches],
            [self.graph.get_tensor_by_name(feed) for feed in feeds])
        self.run_flat: Callable[[Any], list[np.ndarray]] = run
        if not isinstance(concrete.structured_input_signature[0][0], tf.TensorSpec):
            # A dict of tensors: its arrays fed in tf.nest.flatten order (sorted keys).
            self.run_flat = lambda x: run(*tf.nest.flatten(x))

    def __call__(self, x: Any) -> Any:
        return tf.nest.pack_sequence_as(self.structure, self.run_flat(x))

    def close(self) -> None:
        """Frees the session (also done when the object is collected)."""
        self.session.close()


#: Describes the inputs a function is traced for: (name, row shape, dtype)
#: per input ("" for one unnamed input).
Fields = tuple[tuple[str, tuple[int, ...], np.dtype[Any]], ...]


def _signature_call(signature: Any, what: str) -> Callable[[Any], Any]:
    """A SavedModel signature as a function of one tensor (a signature of
    one input) or of a dict of tensors by input name (the signature's
    keyword arguments), each cast to the signature's dtype (traced code)."""
    kwargs = signature.structured_input_signature[1]

    def call(x: Any) -> Any:
        if isinstance(x, Mapping):
            if sorted(x) != sorted(kwargs):
                raise ModelError(f"{what} takes the inputs {sorted(kwargs)}, the evaluator "
                                 f"declares {sorted(x)}")
            return signature(**{k: tf.cast(t, kwargs[k].dtype) for k, t in x.items()})
        if len(kwargs) != 1:
            raise ModelError(f"{what} takes {len(kwargs)} inputs ({sorted(kwargs)}); declare "
                             "them by name (Evaluator(inputs=...)) to serve it")
        (name, spec), = kwargs.items()
        return signature(**{name: tf.cast(x, spec.dtype)})

    return call


class _Method:
    """One function a :class:`TFModel` serves: the model's call (name "")
    or one of its ``methods``, traced for one input structure (one tensor,
    or a dict of tensors by input name), per batch size or for any.

    ``call(inputs)`` runs the model's function in traced code.  What serves
    a batch size is ``by_rows[rows]`` (else ``general``): the traced
    concrete function, or with freeze its FrozenGraph (with jit_compile,
    its frozen_function); ``traced`` keeps the traced ones, which read the
    variables."""

    def __init__(self, owner: "TFModel", name: str, call: Callable[[Any], Any],
                 keras_model: Any = None) -> None:
        self.owner = owner
        self.name = name
        self.call = call
        # What a Keras model says of its outputs' and inputs' names, if it does.
        self.model_names = tuple(map(str, getattr(keras_model, "output_names", None) or ()))
        self.input_names: tuple[str, ...] = ()
        try:
            self.input_names = tuple(str(t.name) for t in keras_model.inputs)
        except (AttributeError, TypeError, ValueError):  # no model, or not a functional one
            pass
        self.trace_error: Optional[ModelError] = None  # raised while tracing
        self.reset()

    def reset(self) -> None:
        """Forgets the spec and what was traced."""
        self.m: Optional[MethodSpec] = None  # the spec's method, once prepared
        self.names: tuple[str, ...] = ()  # its outputs, in order
        self.fields: Fields = ()  # the inputs traced for
        self.named = False
        # One unnamed input: its row shape and dtype (compared on every call).
        self.row_shape: Optional[tuple[int, ...]] = None
        self.dtype: Optional[np.dtype[Any]] = None
        self.native = True
        self.function: Any = None  # tf.function over _body
        self.general: Any = None
        self.by_rows: dict[int, Any] = {}
        self.traced: dict[Optional[int], Any] = {}

    def _body(self, x: Any) -> Any:
        # Runs only while TensorFlow traces: count traces here.
        self.owner.trace_count += 1
        try:
            with tf.device(self.owner.device):
                out = self.call(x)
                if self.m is None:
                    return _plain(out)
                return _arrange(out, self.m.outputs, self.model_names)
        except ModelError as e:
            self.trace_error = e  # autograph re-raises it wrapped in its own error
            raise

    def build(self, fields: Fields, named: bool) -> None:
        """Starts over for inputs of ``fields``."""
        self.fields, self.named = fields, named
        self.row_shape, self.dtype = (None, None) if named else fields[0][1:]
        self.native = all(dtype.isnative for _, _, dtype in fields)
        self.function = tf.function(self._body, jit_compile=self.owner.jit_compile)
        self.general = None
        self.by_rows = {}
        self.traced = {}

    def prepare_for(self, m: MethodSpec) -> None:
        if m.named and self.input_names and sorted(self.input_names) != sorted(m.input_names):
            raise ModelError(for_method(m, f"the model's inputs are named "
                                           f"{sorted(self.input_names)}, the evaluator declares "
                                           f"{sorted(m.input_names)}"))
        self.m = m
        self.names = m.output_names
        self.build(tuple((f.name, f.shape, f.dtype) for f in m.inputs), m.named)

    def trace(self, rows: Optional[int]) -> Any:
        """_body's concrete function for batches of ``rows`` (None: any);
        ModelError naming the method when it does not fit the spec."""
        specs = {name: tf.TensorSpec((rows, *shape), tf.as_dtype(dtype.newbyteorder("=")))
                 for name, shape, dtype in self.fields}
        self.trace_error = None
        try:
            fn = self.function.get_concrete_function(specs if self.named else specs[""])
        except Exception as e:
            err, m = self.trace_error, self.m
            if m is None or not m.name:  # the evaluator's only method: as it is
                if err is not None:
                    raise err from None
                raise
            why = str(err) if err is not None else (
                f"tracing it for batches of {rows or 'any size'} failed: "
                f"{type(e).__name__}: {e}")
            raise ModelError(for_method(m, why)) from (None if err is not None else e)
        self.traced[rows] = fn
        return fn

    def zeros(self, rows: int) -> Any:
        """A batch of zero states in native byte order, as the served
        functions take it."""
        z = {name: np.zeros((rows, *shape), dtype.newbyteorder("="))
             for name, shape, dtype in self.fields}
        return z if self.named else z[""]

    def warm_up(self, rows: int) -> None:
        """Runs a batch of zeros: compiles, and checks the exact outputs."""
        m = self.m
        assert m is not None
        try:
            out = self(zero_inputs(m, rows))
        except tf.errors.OpError as e:
            raise ModelError(for_method(m, f"the model failed on a batch of {rows} zero "
                                           f"states: {type(e).__name__}: {e.message}")) from e
        check_method_outputs(out, m, rows)

    def __call__(self, batch: Any) -> Any:
        """Evaluates ``batch``: ``[rows, *input_shape]``, or a dict of such
        arrays by input name.  After ``prepare``: a dict ``{name:
        ndarray}`` of the declared dtypes and shapes.  Before it (a
        standalone call): the function's outputs as numpy arrays, in its
        own structure, traced for the batch's shapes."""
        if type(batch) is not np.ndarray:
            if isinstance(batch, Mapping) or (self.named and self.m is not None):
                return self._call_named(batch)
            batch = np.asarray(batch)
        elif self.named and self.m is not None:
            return self._call_named(batch)  # which refuses it, naming the inputs
        if batch.shape[1:] != self.row_shape or batch.dtype != self.dtype:
            if self.m is not None:
                raise ValueError(f"TFModel was prepared for batches of shape "
                                 f"[n, *{self.row_shape}] {self.dtype}, "
                                 f"got {batch.shape} {batch.dtype}")
            self.build((("", batch.shape[1:], batch.dtype),), False)
        if not self.native:  # TensorFlow takes native byte order only
            batch = batch.astype(batch.dtype.newbyteorder("="))
        return self._run(batch, batch.shape[0])

    def _call_named(self, batch: Any) -> Any:
        m = self.m
        if m is not None:
            rows = check_named_batch(batch, m, "TFModel")
        else:
            if not batch:
                raise ValueError("TFModel: a dict of inputs with no input")
            batch = {str(k): np.asarray(a) for k, a in batch.items()}
            fields = tuple((k, a.shape[1:], a.dtype) for k, a in batch.items())
            if not self.named or fields != self.fields:
                self.build(fields, True)
            rows = len(next(iter(batch.values())))
        if not self.native:
            batch = {k: a.astype(a.dtype.newbyteorder("=")) for k, a in batch.items()}
        return self._run(batch, rows)

    def _run(self, batch: Any, rows: int) -> Any:
        owner = self.owner
        fn = self.by_rows.get(rows)
        if fn is None:
            fn = self.general
            if fn is None:
                fn = self.general = owner._concrete(self, None)
        if owner.auto_freeze and not owner.freeze:
            owner._unfrozen_call(rows)
        if isinstance(fn, FrozenGraph):
            # No output of a FrozenGraph aliases the batch (its docstring says why).
            if self.m is None:
                return fn(batch)
            return dict(zip(self.names, fn.run_flat(batch)))
        # Calling style: the concrete function, with a tf.constant copy of the
        # batch (it copies: nothing aliases the evaluator's reused buffer).  The
        # fastest of the ways compared by `bench/tf_model_cost.py --styles`
        # (figures in docs/performance.md).
        if self.named:
            out = fn({k: tf.constant(a) for k, a in batch.items()})
        else:
            out = fn(tf.constant(batch))
        if self.m is None:
            return tf.nest.map_structure(lambda t: t.numpy(), out)
        return {name: t.numpy() for name, t in zip(self.names, out)}


class TFModel:
    """A TensorFlow model as a shmeval evaluator model.

    ``model_or_path``: a Keras model (functional, sequential or subclassed;
    outputs a tensor, a list/tuple or a dict), a ``tf.function`` or callable
    ``tf.Module``, a ``.keras`` file, or a SavedModel directory (its
    ``serving_default`` signature if it has one, else the object's
    ``__call__``).

    **Named inputs** (``Evaluator(inputs={"planes": ..., "mask": ...})``):
    the model is called with a dict of tensors by input name, as a Keras
    functional model with inputs of those names
    (``keras.Input(shape, name="planes")``) takes them; a SavedModel
    signature gets them as its keyword arguments.

    **Several methods** (``Evaluator(methods={"initial": Method(...),
    "recurrent": Method(...)})``): ``methods={"initial":
    "initial_inference", "recurrent": "recurrent_inference"}`` names, for
    each method, a function of the model: an attribute (a ``tf.function``
    or method of a ``tf.Module`` or Keras model, a sub-model), or else one
    of a SavedModel's signatures; a callable is taken as it is.  Each is
    called with that method's dict of input tensors (a signature with its
    keyword arguments).  ``tm.initial`` and ``tm.recurrent`` (the attribute
    of each method's name) evaluate a batch of that method's inputs: what
    the evaluator calls.  Every method is traced, checked and (with
    freeze) folded like the model's own call; the model's variables are
    the one set of weights of all of them: ``set_weights`` changes every
    method at once.  A model that is not callable itself (a ``tf.Module``
    with methods only) is then accepted.

    ``buckets``: batch sizes to pad batches to, used when the evaluator has
    none (``prepare`` returns them).  ``jit_compile``: compile with XLA, once
    per batch size; without buckets anywhere, the batch sizes default to
    powers of two up to ``max_batch``.  ``memory_growth``,
    ``memory_limit_mb``, ``intra_op_threads``, ``inter_op_threads``: passed
    to :func:`configure` before the model is loaded.  ``device``: where the
    model runs, a TensorFlow device name or ``cuda:N`` (read as ``/GPU:N``;
    default ``/GPU:0`` if there is a GPU, else ``/CPU:0``).
    ``freeze``: serve the traced functions with the weights folded in as
    constants, run in the calling thread by a session (:class:`FrozenGraph`;
    with ``jit_compile``, :func:`frozen_function`): cheaper calls, but every
    ``set_weights`` / ``load_weights`` folds again and runs each batch size
    once before it returns (while the evaluator serves nothing): about
    0.1 s per traced batch size for the self-play demo's net, 1 s with nine
    buckets, more for bigger nets.  ``"auto"`` (the default) serves frozen
    functions while that pays: ``prepare`` measures what folding saves per
    call and what one fold costs; a weight update is assigned to the
    variables at once (and served by the unfrozen functions), and the
    weights are folded again once the calls since the update have lost as
    much time as a fold takes (so frequent updates are never folded, rare
    ones almost at once, and the total is never more than twice the better
    choice made in hindsight).  A model that cannot be frozen, or on a
    device where freezing saves nothing, is served unfrozen.
    ``bfloat16``: with ``freeze`` (and no ``jit_compile``), compute in
    bfloat16 what oneDNN can (see :class:`FrozenGraph`), for CPUs with
    native bfloat16; the outputs move by about 1e-3, so it is never chosen
    for you (with ``freeze="auto"`` it keeps the graphs frozen).  On a GPU
    it is refused (the rewrite is the CPU's).  ``intra_op_threads`` /
    ``inter_op_threads`` "auto" (the default): see :func:`_auto_threads`
    (None: TensorFlow's own default).

    ``max_concurrency`` (2): calls from two serving threads may overlap
    (TensorFlow releases the GIL and its functions and sessions are safe to
    call from several threads); the evaluator's tuner keeps two in flight
    where that serves more.

    After ``prepare``: ``trace_count`` (times the model was traced: once
    per method and traced batch shape; constant while serving) and
    ``warmup_s`` (seconds ``prepare`` took).
    """

    max_concurrency = 2

    def __init__(self, model_or_path: Any, *, buckets: Optional[Sequence[int]] = None,
                 methods: Optional[Mapping[str, Union[str, Callable[..., Any]]]] = None,
                 jit_compile: bool = False, memory_growth: bool = True,
                 memory_limit_mb: Optional[int] = None,
                 intra_op_threads: Union[int, str, None] = "auto",
                 inter_op_threads: Union[int, str, None] = "auto",
                 device: Optional[str] = None,
                 freeze: Union[bool, str] = "auto", bfloat16: bool = False) -> None:
        if freeze not in (True, False, "auto"):
            raise ValueError(f"TFModel(freeze=...) must be True, False or 'auto', got {freeze!r}")
        for name, n in (("intra_op_threads", intra_op_threads),
                        ("inter_op_threads", inter_op_threads)):
            if isinstance(n, str) and n != "auto":
                raise ValueError(f"TFModel({name}=...) must be 'auto', None or an int, got {n!r}")
        if bfloat16 and (not freeze or jit_compile):
            raise ValueError("TFModel(bfloat16=True) needs freeze=True (or 'auto') without "
                             "jit_compile (the frozen graph's session does the rewrite)")
        table = None if methods is None else methods_arg(methods, "TFModel")
        configure(memory_growth, memory_limit_mb,
                  None if isinstance(intra_op_threads, str) else intra_op_threads,
                  None if isinstance(inter_op_threads, str) else inter_op_threads)
        if "auto" in (intra_op_threads, inter_op_threads):
            _auto_threads(self.max_concurrency)
        self.buckets = own_buckets(buckets, "TFModel")
        self.jit_compile = bool(jit_compile)
        # freeze="auto": frozen to start with; the updates decide later
        # (_unfrozen_call).  bfloat16 lives in the frozen graphs only.
        self.auto_freeze = freeze == "auto" and not bfloat16
        self.freeze = bool(freeze)
        self.bfloat16 = bool(bfloat16)
        # Served by FrozenGraph objects (ndarrays in and out), not concrete
        # functions (tensors).
        self._sessions = self.freeze and not self.jit_compile
        self.device = tf_device(device) or ("/GPU:0" if tf.config.list_physical_devices("GPU")
                                            else "/CPU:0")
        if self.bfloat16 and "GPU" in self.device.upper():
            raise ValueError(f"TFModel(bfloat16=True) rewrites the graph for the CPU; this "
                             f"model runs on {self.device} (pass device='/CPU:0' or drop "
                             "bfloat16)")
        self.model = _load(model_or_path, methods_only=table is not None)
        self.keras = _is_keras(self.model)
        self.signature: Any = None  # a SavedModel's serving_default
        signatures = getattr(self.model, "signatures", None)
        self._methods: dict[str, _Method] = {}
        if not self.keras and signatures is not None and "serving_default" in signatures:
            self.signature = signatures["serving_default"]
            self._methods[""] = _Method(self, "", _signature_call(
                self.signature, "the serving_default signature"))
        elif self.keras:
            model = self.model
            self._methods[""] = _Method(self, "", lambda x: model(x, training=False), model)
        elif callable(self.model):
            self._methods[""] = _Method(self, "", self.model)
        elif table is None:
            raise TypeError(f"TFModel: the loaded {type(self.model).__name__} has neither a "
                            "serving_default signature nor __call__")
        for name, what in (table or {}).items():
            self._methods[name] = self._method(name, what, signatures)
        self.spec: Optional[Spec] = None
        self.trace_count = 0
        self.warmup_s = 0.0
        # What model(batch) calls: the evaluator's only method, once prepared.
        self._one: Optional[_Method] = self._methods.get("")
        # freeze="auto": when the weights are folded again after an update.
        self._fold = Refold()
        expose_methods(self, {n: f for n, f in self._methods.items() if n}, "TFModel")

    def _method(self, name: str, what: Any, signatures: Any) -> _Method:
        """The function that serves method ``name`` (``methods[name]``)."""
        if isinstance(what, str):
            fn = getattr(self.model, what, None)
            if fn is None and signatures is not None and what in signatures:
                return _Method(self, name, _signature_call(signatures[what],
                                                           f"the signature {what!r}"))
            if not callable(fn):
                model = type(self.model).__name__
                found = (f"the {model} has no attribute {what!r}" if fn is None else
                         f"the {model}'s {what!r} is a {type(fn).__name__}, not a function")
                raise ValueError(f"TFModel(methods=...): {found} (for method {name!r})"
                                 + (f"; its signatures: {sorted(signatures)}" if signatures
                                    else ""))
        elif callable(what):
            fn = what
        else:
            raise TypeError(f"TFModel(methods=...): {name!r} must be the name of a function of "
                            f"the model, or a callable; got {type(what).__name__}")
        if _is_keras(fn):  # a Keras model or layer: in inference mode, as the model itself
            sub = fn
            return _Method(self, name, lambda x: sub(x, training=False), sub)
        return _Method(self, name, fn)

    # The evaluator's only method's functions (for tests and tools).
    @property
    def _general(self) -> Any:
        return None if self._one is None else self._one.general

    @property
    def _by_rows(self) -> dict[int, Any]:
        return {} if self._one is None else self._one.by_rows

    # -- tracing ---------------------------------------------------------------

    def _concrete(self, method: _Method, rows: Optional[int]) -> Any:
        """The function that serves ``method``'s batches of ``rows`` (None:
        any)."""
        fn = method.trace(rows)
        if not self.freeze:
            return fn
        try:
            return self._frozen(fn, method)
        except ModelError:
            if not self.auto_freeze:
                raise
            # freeze="auto": a model that cannot be frozen is served as it is.
            self.auto_freeze = self.freeze = self._sessions = False
            return fn

    def _frozen(self, fn: Any, method: _Method) -> Any:
        try:
            if self._sessions:
                return FrozenGraph(fn, self.bfloat16)
            return frozen_function(fn, self.jit_compile)
        except Exception as e:
            # e.g. a model that assigns a variable while it runs
            why = (f"TFModel(freeze=True) could not fold the model's weights into its graph "
                   f"({type(e).__name__}: {e}); serve it with freeze=False")
            raise ModelError(for_method(method.m, why) if method.m else why) from e

    def _traced_methods(self) -> list[_Method]:
        return [m for m in self._methods.values() if m.traced]

    def _refreeze(self) -> None:
        """With freeze: folds the current weights into new functions (every
        method's), runs each once (the optimiser's work happens at the first
        call), then serves them."""
        if not self.freeze:
            return
        folded = []
        for method in self._traced_methods():
            by_rows = {n: self._frozen(method.traced[n], method) for n in method.by_rows}
            general = (self._frozen(method.traced[None], method)
                       if method.general is not None else None)
            for n, fn in [*by_rows.items(), (1, general)]:
                if fn is not None:
                    zeros = method.zeros(n)
                    fn(zeros if self._sessions else tf.nest.map_structure(tf.constant, zeros))
            folded.append((method, by_rows, general))
        for method, by_rows, general in folded:
            method.by_rows, method.general = by_rows, general

    # -- the evaluator's protocol ---------------------------------------------

    def prepare(self, spec: Spec, buckets: Optional[Sequence[int]]) -> Optional[tuple[int, ...]]:
        """Traces every method of the spec for its inputs, checks the
        outputs against it and runs every batch size the evaluator will use
        once (each bucket, or 1 and max_batch without buckets).  Returns the
        buckets this model wants when the evaluator has none: its own, or
        with ``jit_compile`` powers of two up to max_batch."""
        t0 = time.perf_counter()
        sizes = serving_sizes(spec, buckets, self.buckets, self.jit_compile, "TFModel")
        served = []
        for m in spec.methods:
            method = self._methods.get(m.name)
            if method is None:
                raise method_not_served(m, list(self._methods), "TFModel")
            served.append(method)
        self.spec = spec
        for method in self._methods.values():
            method.reset()
        for method, m in zip(served, spec.methods):
            method.prepare_for(m)
            if sizes is not None:
                method.by_rows = {n: self._concrete(method, n) for n in sizes}
            else:
                method.general = self._concrete(method, None)
        if not self.freeze:  # a method that cannot be frozen: none is
            self._unfreeze()
        self._one = served[0] if len(served) == 1 else None
        warm = sizes if sizes is not None else tuple(sorted({1, spec.max_batch}))
        for method in served:
            for rows in warm:
                method.warm_up(rows)
        if self.auto_freeze:
            self._measure_freezing(warm)
        self.warmup_s = time.perf_counter() - t0
        return None if buckets else sizes

    def _measure_freezing(self, sizes: Sequence[int]) -> None:
        """freeze="auto": times the frozen and the unfrozen functions of
        every method at the batch sizes warmed up (the best of three calls
        each) and one fold; serves unfrozen from now on if folding saves
        nothing."""
        rows_of, saved = [], []
        for method in self._traced_methods():
            for rows in sizes:
                x = method.zeros(rows)
                frozen = method.by_rows.get(rows) or method.general
                plain = method.traced.get(rows) or method.traced[None]
                rows_of.append(rows)
                saved.append(best_ns(lambda: self._run(plain, x)) -
                             best_ns(lambda: self._run(frozen, x)))
        if len(set(rows_of)) > 1:
            slope, intercept = np.polyfit(np.asarray(rows_of, np.float64), saved, 1)
        else:
            slope, intercept = 0.0, float(np.mean(saved))
        self._fold.saving = (float(intercept), float(slope))
        self._fold.timed(self._refreeze)
        if max(saved) <= 0:
            self._unfreeze()
            self.auto_freeze = False

    def _run(self, fn: Any, x: Any) -> Any:
        return fn.run_flat(x) if isinstance(fn, FrozenGraph) else [
            t.numpy() for t in tf.nest.flatten(fn(tf.nest.map_structure(tf.constant, x)))]

    def _unfreeze(self) -> None:
        """Serves the traced functions, which read the variables."""
        self.freeze = False
        for method in self._methods.values():
            if method.traced:
                method.general = method.traced[None] if method.general is not None else None
                method.by_rows = {n: method.traced[n] for n in method.by_rows}

    def _unfrozen_call(self, rows: int) -> None:
        """freeze="auto", unfrozen since an update: counts what the call
        lost against a frozen one, and folds once that reaches what a fold
        costs (Refold; in this call's thread, another serving thread keeps
        serving unfrozen meanwhile)."""
        self._fold.charge(rows, self._fold_again)

    def _fold_again(self) -> None:
        if self.freeze:  # another thread folded
            return
        self.freeze = True
        try:
            self._fold.timed(self._refreeze)
        except BaseException:
            self.freeze = False
            raise

    def __call__(self, batch: Any) -> Any:
        """Evaluates ``batch [rows, *input_shape]`` (named inputs: a dict of
        such arrays by input name).  After ``prepare``: a dict ``{name:
        ndarray}`` of the declared dtypes and shapes.  Before it (a
        standalone call): the model's outputs as numpy arrays, in the
        model's structure (dict, tuple or one array), traced for the batch's
        shape.  With several methods, each is called by its name
        (``tm.recurrent(batch)``)."""
        one = self._one
        if one is None:
            raise TypeError(f"this TFModel serves the methods "
                            f"{[n for n in self._methods if n]}: call tm.<method>(batch)")
        return one(batch)

    # -- weights -----------------------------------------------------------------

    def _variables(self) -> list[Any]:
        """The weights in get_weights() order."""
        if self.keras:
            return list(self.model.weights)
        found = getattr(self.model, "variables", None)
        if found is None and self.signature is not None:
            found = self.signature.variables
        if found is None:
            # A plain tf.function, or a loaded object served by its methods:
            # what the traced functions captured, each once.
            seen: dict[Any, Any] = {}
            for method in self._traced_methods():
                for fn in method.traced.values():
                    for v in fn.variables:
                        seen.setdefault(v.ref(), v)
            if not seen:
                raise RuntimeError("TFModel: the weights of a plain tf.function are known once "
                                   "it was traced; call prepare() or the model first")
            found = list(seen.values())
        return list(found)

    def get_weights(self) -> list[np.ndarray]:
        """Copies of the weights (Keras ``get_weights()`` order; for other
        models their ``variables`` in order)."""
        if self.keras:
            return list(self.model.get_weights())
        return [np.array(v.numpy()) for v in self._variables()]

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Assigns new values to the weights in place (no retracing; with
        freeze, folds them into new functions before it returns).  Counts,
        shapes and dtypes are checked first: a bad update raises ValueError
        and leaves every weight as it was; a mapping (a state dict is
        PyTorch's) raises TypeError."""
        if isinstance(weights, Mapping):
            raise TypeError(f"TFModel.set_weights takes a list of arrays in get_weights() "
                            f"order, got a {type(weights).__name__} with keys "
                            f"{list(weights)[:3]}... (a state dict is what TorchModel takes)")
        variables = self._variables()
        arrays = checked_weights(weights, [
            (v.name, tuple(v.shape),
             np.dtype(getattr(v.dtype, "as_numpy_dtype", v.dtype)))  # Keras 3: a str
            for v in variables])
        if self.auto_freeze:
            # Served unfrozen from now on, until folding pays (_unfrozen_call).
            self._assign(variables, arrays)
            self._unfreeze()
            self._fold.lost_ns = 0.0
            return
        old = self.get_weights() if self.freeze else None
        self._assign(variables, arrays)
        if old is not None:
            try:
                self._refreeze()
            except BaseException:
                self._assign(variables, old)  # the weights that still serve
                raise

    def _assign(self, variables: list[Any], arrays: list[np.ndarray]) -> None:
        if self.keras:
            self.model.set_weights(arrays)
        else:
            for v, a in zip(variables, arrays):
                v.assign(a)

    def load_weights(self, path: PathLike) -> None:
        """Loads weights from a ``.npz`` file holding ``arr_0, arr_1, ...`` in
        get_weights() order (``np.savez(path, *weights)``), or, for a Keras
        model, any file Keras' ``load_weights`` reads (``.weights.h5``).  A
        failed load leaves the old weights in place."""
        path = os.fspath(path)
        if path.endswith(".npz"):
            self.set_weights(npz_weights(path))
        elif self.keras:
            old = self.model.get_weights()
            try:
                self.model.load_weights(path)
                if self.auto_freeze:
                    self._unfreeze()
                    self._fold.lost_ns = 0.0
                self._refreeze()
            except BaseException:
                self.model.set_weights(old)
                raise
        else:
            raise ValueError(f"load_weights: {path} is not a .npz file; other formats need "
                             "a Keras model")


__all__ = ["FrozenGraph", "TFModel", "configure", "frozen_function"]
