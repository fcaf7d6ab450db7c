"""An evaluator's settings, defined, documented and checked in one place.

:class:`ServeConfig` holds the settings of ``Evaluator(model, ...)``;
:class:`SpawnConfig` adds those of ``Evaluator.spawn(factory, ...)`` (its
processes), and ``shmeval.ray``'s ``ClusterConfig`` those of a
``ClusterEvaluator``.  Each setting is one field here: its name, type and
default, and the docstring under it, the only description of it in the
code.  Building the object checks every setting, before anything is
created, and keeps the checked values (a shape as a tuple, a dtype as a
NumPy dtype, ``None`` for ``spin_us`` as ``"auto"``), with what the serving
side reads: the :class:`~shmeval.spec.Spec` and the :class:`BatchPolicy`.
The frozen object then travels whole: to the serving loop, to each serving
process (by pickle), and to the Cython ``Server`` (``Server.configure``),
which copies what it reads per batch into C fields once.

The public methods take the settings as keyword arguments, not as an
object, and their signatures are not written out: :func:`takes_settings`
makes each from the config class, for ``inspect.signature`` and
``help()`` at run time, and, through a ``ParamSpec``, for mypy and IDEs,
which check each keyword's name and type against the field.  So
``Evaluator``, ``Evaluator.spawn`` and ``ClusterEvaluator`` take exactly
their config's fields, a setting added here reaches all three, and no
signature restates a default that could drift from the field's.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import multiprocessing as mp
import textwrap
import typing
from dataclasses import dataclass, field
from typing import (Any, Callable, Concatenate, Mapping, Optional, ParamSpec, Sequence, TypeVar,
                    Union)

from . import _ring
from .checks import AUTO, as_number, check_auto
from .spec import InputsLike, Method, OutputsLike, ShapeLike, Spec
from .tuning import Overrides
from .waiting import check_spin_auto, check_spin_us

Buckets = Union[None, str, Sequence[int]]

#: Most serving threads (model calls in flight at once) one replica runs.
MAX_SERVING_THREADS = 8
#: Serving threads started with serving_threads="auto": the tuner keeps one
#: or two model calls in flight (a second overlaps one batch's gathering
#: and answering with another's computation).
AUTO_SERVING_THREADS = 2
#: Most model replicas behind one address (ring.h SHM_MAX_REPLICAS).
MAX_REPLICAS = 64


@dataclass(frozen=True)
class BatchPolicy:
    """How the evaluator forms batches.

    ``max_wait_us``: after the first request, wait up to that long for a
    fuller batch (0: greedy, take every ready request up to ``max_batch``
    the moment the model is free).  ``buckets`` pads each batch up to the
    next bucket size (spare rows of the batch buffer, no extra copy) for
    models that want few distinct shapes.  ``spin_us``: the idle
    evaluator's spin budget.  ``threads``: serving threads (model calls in
    flight).  ``"auto"`` (the Evaluator's default of the three) leaves a
    setting to the tuner (:mod:`shmeval.tuning`); with ``threads="auto"``,
    ``threads`` is AUTO_SERVING_THREADS and ``auto_threads`` is set.
    """

    max_batch: int
    max_wait_us: Union[float, str] = 0.0
    buckets: Optional[tuple[int, ...]] = None
    spin_us: Union[float, str] = 50.0
    threads: int = 1
    auto_threads: bool = False

    @classmethod
    def make(cls, max_batch: int, max_wait_us: Union[float, str] = 0.0,
             buckets: Buckets = None, spin_us: Union[float, str] = 50.0,
             threads: Union[int, str] = 1) -> "BatchPolicy":
        max_wait_us = check_auto("max_wait_us", max_wait_us, _check_wait)
        spin_us = check_auto("evaluator_spin_us", spin_us, check_spin_us)
        auto_threads = threads == AUTO
        if auto_threads:
            threads = AUTO_SERVING_THREADS
        elif type(threads) is not int or not 1 <= threads <= MAX_SERVING_THREADS:
            raise ValueError(f"serving_threads must be 'auto' or an int from 1 to "
                             f"{MAX_SERVING_THREADS}, got {threads!r}")
        assert isinstance(threads, int)
        return cls(max_batch, max_wait_us, _buckets(buckets, max_batch), spin_us, threads,
                   auto_threads)

    @property
    def rows(self) -> int:
        """Rows of the batch buffer."""
        return max(self.max_batch, self.buckets[-1]) if self.buckets else self.max_batch

    @property
    def tuned(self) -> bool:
        """Whether the tuner sets anything."""
        return AUTO in (self.max_wait_us, self.spin_us) or self.auto_threads

    def overrides(self) -> Overrides:
        """The settings the caller fixed, for the tuner (and, as they
        start, for ``Server.configure``)."""
        return Overrides(
            None if self.max_wait_us == AUTO else int(float(self.max_wait_us) * 1000),
            None if self.spin_us == AUTO else int(float(self.spin_us) * 1000),
            None if self.auto_threads else self.threads)


def _check_wait(name: str, us: float) -> float:
    if not us >= 0:
        raise ValueError(f"{name} must be 'auto' or >= 0, got {us}")
    return us


def _buckets(buckets: Buckets, max_batch: int) -> Optional[tuple[int, ...]]:
    """The padded batch sizes, ascending (None: no padding)."""
    if buckets is None:
        return None
    if isinstance(buckets, str):
        if buckets != "pow2":
            raise ValueError(f"buckets must be None, 'pow2' or a list of ints, got {buckets!r}")
        return tuple(sorted({1 << i for i in range(max_batch.bit_length())
                             if 1 << i < max_batch} | {max_batch}))
    try:
        b = tuple(sorted({int(x) for x in buckets}))
    except (TypeError, ValueError):
        raise TypeError(f"buckets must be a list of ints, got {buckets!r}") from None
    if not b or b[0] < 1:
        raise ValueError(f"buckets must be positive ints, got {buckets!r}")
    if b[-1] < max_batch:
        raise ValueError(f"the largest bucket ({b[-1]}) must be >= max_batch ({max_batch})")
    return b


def _set(obj: object, name: str, value: Any) -> None:
    """Stores a checked value in a frozen config while it is being built."""
    object.__setattr__(obj, name, value)


def _checked_io(spec: Spec) -> tuple[tuple[str, Any], ...]:
    """The checked values of the input and output settings: those of one
    unnamed input, of named inputs, or of methods, as the spec holds them."""
    def fields(fs: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
        return {f.name: (f.shape, f.dtype) for f in fs}

    if len(spec.methods) > 1 or spec.methods[0].name:
        return (("methods", {m.name: Method(fields(m.inputs), fields(m.outputs))
                             for m in spec.methods}),)
    m = spec.methods[0]
    if m.named:
        return (("inputs", fields(m.inputs)), ("outputs", fields(m.outputs)))
    return (("input_shape", m.inputs[0].shape), ("input_dtype", m.inputs[0].dtype),
            ("outputs", fields(m.outputs)))


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """The settings of an evaluator: the keyword arguments of
    ``Evaluator(model, ...)``, checked once.  ``spec`` and ``policy`` are
    built from them."""

    input_shape: Optional[ShapeLike] = None
    """The shape of one state, an array (one unnamed input).  Give this,
    ``inputs`` or ``methods``."""
    outputs: Optional[OutputsLike] = None
    """``{name: (shape, dtype)}`` of one result: the model returns a dict of
    arrays by these names, a tuple or list in this order, or one array when
    one output is declared, each with a leading dimension of the batch's
    rows.  (With ``methods``, each Method has its own.)"""
    input_dtype: Any = "float32"
    """The dtype of one state: a fixed-size numeric or bool NumPy dtype.
    Client inputs are cast to it under NumPy's 'same_kind' casting."""
    inputs: Optional[InputsLike] = None
    """Named inputs, ``{name: (shape, dtype)}``, in place of
    ``input_shape``: a request is a dict of arrays by these names (each
    checked by name), and the model is called with a dict of batched
    arrays.  For nets of several inputs (board planes and a legal-move
    mask, spatial planes and global features)."""
    methods: Optional[Mapping[str, Method]] = None
    """Several functions of one set of weights, ``{name:
    shmeval.Method(inputs=..., outputs=...)}``, in place of ``inputs`` and
    ``outputs`` (MuZero's ``initial`` and ``recurrent`` inference): a
    request names its method (``evaluate(x, method="recurrent")``), each
    method's requests are batched with each other, and the model's function
    of that name (``model[name]`` of a dict, else ``getattr(model, name)``)
    is called with them.  Slots are sized for the largest method."""
    max_batch: int = 256
    """Most requests per model call (1 to 65536)."""
    max_wait_us: Union[float, str] = AUTO
    """After the first request, wait up to this long (µs) for a fuller batch
    (0: greedy, take what is ready the moment the model is free).
    ``"auto"``: the tuner waits only where its measurements show that
    waiting serves more (:mod:`shmeval.tuning`)."""
    buckets: Buckets = None
    """Pad each batch up to the next of these batch sizes: ``"pow2"``
    (powers of two up to ``max_batch``) or a list whose largest is at
    least ``max_batch``; None: no padding.  Padding rows are spare rows of
    the batch buffer holding stale states; their outputs are dropped."""
    max_clients: int = 64
    """Most processes attached at once, one client-table entry each (1 to
    4096)."""
    slots_per_client: int = 16
    """Most requests one process has in flight at once (1 to 64);
    ``evaluate_many`` sends larger batches in rounds."""
    spin_us: Union[float, str, None] = AUTO
    """The client's spin budget (µs, 0 to 1 s) before it sleeps: a plain spin
    while the attached processes and the evaluator fit on the CPU cores, a
    spin that yields the CPU between looks when they are one more than the
    cores, none beyond (docs/protocol.md, *Waiting*).  ``"auto"``: two
    budgets, the measured cost of a sleep and a wake-up in the client's
    process and a longer one, each timed by blocks of waits and the
    shorter mean wait serving (``stats()["client_spin"]``).  None is an
    alias of ``"auto"``.  A pickled handle keeps it."""
    evaluator_spin_us: Union[float, str] = AUTO
    """How long the idle evaluator spins (µs, 0 to 1 s) before it sleeps on
    its doorbell, by the same rule as ``spin_us``.  ``"auto"``: the tuner's
    budget, with no spin while the runnable tasks fill the CPUs."""
    reject_nonfinite: bool = True
    """Fail the requests whose float outputs hold NaN or inf
    (``ModelError``), and only those: the rest of the batch is answered."""
    name: Optional[str] = None
    """The segment's name, the address clients connect to (None:
    ``/shmeval-<pid>-<random>``)."""
    serving_threads: Union[int, str] = AUTO
    """Model calls in flight at once (1 to 8): N threads take turns
    collecting batches and overlap their model calls, which pays when the
    model releases the GIL and a core would otherwise idle while it
    computes.  The model must be safe to call from several threads; weight
    updates and housekeeping wait until no call is in flight.  ``"auto"``:
    one, or two where the model's ``max_concurrency`` allows it (TFModel's
    does) and the tuner measures two serving more."""
    cache_entries: int = 0
    """An evaluation cache of this many entries (a power of two from 4 to
    2**32; 0: none) in shared memory: every client looks a state up there
    before it sends it and stores the answers it gets, so that a state any
    process had evaluated is answered in any other without a round trip.
    Entries carry the model version; once ``set_weights`` returns no lookup
    accepts an older answer.  An entry takes 32 bytes plus a result row
    (docs/guide.md, *The evaluation cache*)."""
    metrics_port: Optional[int] = None
    """Serve Prometheus metrics of the evaluator on this port of 127.0.0.1
    (0: a port the system picks) from a thread of the creating process
    (the ``[monitor]`` extra); ``close()`` stops it."""

    spec: Spec = field(init=False, repr=False, compare=False)
    """What the segment serves, built from the settings above."""
    policy: BatchPolicy = field(init=False, repr=False, compare=False)
    """How batches are formed.  Starts as the settings say; the model's
    ``prepare()`` may choose the buckets, and a model whose calls may not
    overlap gets one serving thread (``serving.prepare``,
    ``serving.fit_threads``)."""

    def __post_init__(self) -> None:
        _ring.cache_log2_of(self.cache_entries)
        if self.metrics_port is not None and (type(self.metrics_port) is not int
                                              or not 0 <= self.metrics_port <= 65535):
            raise ValueError(f"metrics_port must be a port from 0 to 65535 (0: one the system "
                             f"picks), got {self.metrics_port!r}")
        _set(self, "spin_us", check_spin_auto(self.spin_us))
        spec = Spec.build(self.input_shape, self.input_dtype, self.outputs, self.max_batch,
                          self.max_clients, self.slots_per_client, inputs=self.inputs,
                          methods=self.methods)
        policy = BatchPolicy.make(spec.max_batch, self.max_wait_us, self.buckets,
                                  self.evaluator_spin_us, self.serving_threads)
        # The checked values, plain Python and NumPy: the object pickles
        # into a serving process without the caller's types (a framework's
        # dtype, a list) and builds again the same (dataclasses.replace).
        for name, value in (*_checked_io(spec),
                            ("max_batch", spec.max_batch), ("max_clients", spec.max_clients),
                            ("slots_per_client", spec.slots_per_client),
                            ("max_wait_us", policy.max_wait_us), ("buckets", policy.buckets),
                            ("evaluator_spin_us", policy.spin_us),
                            ("reject_nonfinite", bool(self.reject_nonfinite)),
                            ("spec", spec), ("policy", policy)):
            _set(self, name, value)

    def with_policy(self, policy: BatchPolicy) -> "ServeConfig":
        """This config serving with ``policy`` (fitted to the model)."""
        new = dataclasses.replace(self)
        _set(new, "policy", policy)
        return new

    def keywords(self, of: Optional[type["ServeConfig"]] = None) -> dict[str, Any]:
        """The settings as keyword arguments; those of ``of``'s fields only
        when given (a subclass's config as its base's)."""
        return {f.name: getattr(self, f.name)
                for f in dataclasses.fields(of or self) if f.init}


@dataclass(frozen=True, kw_only=True)
class SpawnConfig(ServeConfig):
    """The settings of ``Evaluator.spawn(factory, ...)``: an evaluator's,
    and its serving processes'."""

    start_timeout: float = 600.0
    """Seconds each serving process may take to build and warm up its model
    before ``EvaluatorDied`` is raised."""
    mp_context: str = "spawn"
    """The start method of the serving processes (a ``multiprocessing``
    context name)."""
    replicas: Optional[int] = None
    """Serve from this many model replicas behind the one address, each in
    a process of its own calling ``factory()`` (1 to 64; None: one, or one
    per device)."""
    devices: Optional[Sequence[str]] = None
    """One replica per device (such as ``["cuda:0", "cuda:1"]``), each
    process calling ``factory(device)``."""
    restarts: int = 3
    """Start a serving process that died (killed, a crash in the
    framework, out of memory) again, up to this many times in the
    evaluator's life (0: never): the factory is called again and the weights
    serving now applied before it serves, after a backoff of 0.2 s doubling
    per restart; its requests in flight are served again."""

    replica_devices: tuple[str, ...] = field(init=False, repr=False, compare=False)
    """One device name per replica ("": a factory called without one)."""

    def __post_init__(self) -> None:
        if type(self.restarts) is not int or self.restarts < 0:
            raise ValueError(f"restarts must be an int >= 0, got {self.restarts!r}")
        if not as_number("start_timeout", self.start_timeout) > 0:
            raise ValueError(f"start_timeout must be > 0 seconds, got {self.start_timeout!r}")
        mp.get_context(self.mp_context)  # ValueError for a start method there is not
        devices = _replica_devices(self.replicas, self.devices)
        _set(self, "replica_devices", devices)
        if self.devices is not None:
            _set(self, "devices", devices)
        super().__post_init__()


def _replica_devices(replicas: Optional[int],
                     devices: Optional[Sequence[str]]) -> tuple[str, ...]:
    """One device name per replica ("" for a factory called without one)."""
    if devices is not None:
        if isinstance(devices, str) or not all(isinstance(d, str) and d for d in devices):
            raise TypeError(f"devices must be a list of device names such as 'cuda:0', "
                            f"got {devices!r}")
        if not devices:
            raise ValueError("devices must name at least one device")
        if replicas is not None and replicas != len(devices):
            raise ValueError(f"replicas={replicas} but {len(devices)} devices: give one of "
                             f"them, or as many replicas as devices")
        if len(devices) > MAX_REPLICAS:
            raise ValueError(f"at most {MAX_REPLICAS} replicas, got {len(devices)} devices")
        return tuple(devices)
    n = 1 if replicas is None else replicas
    if type(n) is not int or not 1 <= n <= MAX_REPLICAS:
        raise ValueError(f"replicas must be an int from 1 to {MAX_REPLICAS}, got {replicas!r}")
    return ("",) * n


# -- the methods that take the settings as keyword arguments ------------------------------

P = ParamSpec("P")
C = TypeVar("C", bound=ServeConfig)
S = TypeVar("S")
A = TypeVar("A")
R = TypeVar("R")


def takes_settings(config_type: Callable[P, C]) -> Callable[
        [Callable[[S, A, C], R]], Callable[Concatenate[S, A, P], R]]:
    """Makes ``fn(self, first, config)`` a method called as ``fn(self,
    first, **settings)``, with ``config_type``'s fields as its keyword-only
    parameters: the settings are checked by building the config, which
    ``fn`` gets.  The method's signature (``inspect.signature``) comes from
    the config class; its type (``Concatenate[S, A, P]``, P the config's
    constructor) lets mypy check each keyword.  Its docstring says where
    the settings are described: parsing the attribute docstrings costs
    milliseconds, too much for every import (:func:`settings_help` does it
    when asked)."""
    cls = typing.cast(type[ServeConfig], config_type)
    if not (isinstance(cls, type) and issubclass(cls, ServeConfig)):
        raise TypeError(f"takes_settings needs a ServeConfig class, got {config_type!r}")

    def wrap(fn: Callable[[S, A, C], R]) -> Callable[Concatenate[S, A, P], R]:
        head = list(inspect.signature(fn).parameters.values())[:2]
        settings = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                      default=(inspect.Parameter.empty
                                               if f.default is dataclasses.MISSING
                                               else f.default),
                                      annotation=f.type)
                    for f in dataclasses.fields(cls) if f.init]
        signature = inspect.Signature(head + settings)
        names = {p.name for p in settings}

        @functools.wraps(fn)
        def method(*args: Any, **kwargs: Any) -> R:
            try:
                bound = signature.bind(*args, **kwargs).arguments
            except TypeError as e:
                raise TypeError(f"{fn.__qualname__}() {e}") from None
            config = typing.cast(C, cls(**{k: v for k, v in bound.items() if k in names}))
            return fn(bound[head[0].name], bound[head[1].name], config)

        method.__signature__ = signature  # type: ignore[attr-defined]
        where = f"{cls.__module__}.{cls.__qualname__}"
        method.__doc__ = (f"{inspect.cleandoc(fn.__doc__ or '')}\n\n"
                          f"Settings: keyword arguments, the fields of ``{where}``, each "
                          f"described there (``print({__name__}.settings_help("
                          f"{where}))`` lists them).").strip()
        return method

    return wrap


def settings_help(cls: type[ServeConfig]) -> str:
    """The settings of ``cls`` in words: each field with its default and
    its attribute docstring, which Python does not keep at run time (so
    ``help()`` cannot show it), read from the source ("" where the source
    is not at hand)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        docs.update(_attribute_docs(klass))
    lines = ["Settings (keyword arguments):"]
    for f in dataclasses.fields(cls):
        if f.init and f.name in docs:
            default = "" if f.default is dataclasses.MISSING else f" = {f.default!r}"
            lines.append(f"{f.name}{default}")
            lines.append(textwrap.indent(docs[f.name], "    "))
    return "\n".join(lines) if len(lines) > 1 else ""


@functools.lru_cache(maxsize=None)
def _attribute_docs(klass: type) -> Mapping[str, str]:
    """{field: its docstring} of the fields ``klass`` itself declares."""
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body
    if not body or not isinstance(body[0], ast.ClassDef):
        return {}
    stmts = body[0].body
    return {a.target.id: inspect.cleandoc(d.value.value)
            for a, d in zip(stmts, stmts[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
            and isinstance(d, ast.Expr) and isinstance(d.value, ast.Constant)
            and isinstance(d.value.value, str)}


__all__ = ["ServeConfig", "SpawnConfig", "BatchPolicy", "takes_settings", "settings_help"]
