"""What an evaluator serves: its methods (each with its inputs and named
outputs) and its capacities.

An evaluator serves one or more *methods*, functions of one set of
weights: most serve one (``Evaluator(model, input_shape=..., outputs=...)``:
one unnamed input, one method); a net with several inputs names them
(``inputs={"planes": ..., "mask": ...}``); a MuZero-style net has two
methods, ``initial`` and ``recurrent``, each with its own inputs and
outputs (``methods={"initial": Method(...), "recurrent": Method(...)}``).

A request travels as one row of ``in_bytes``: with several methods, an
8-byte header first (the method's index, read by the evaluator to batch
each method's requests with each other), then each input's bytes at an
8-byte aligned offset.  Results likewise: each output at an 8-byte aligned
offset of ``out_bytes``.  Every slot is sized for the largest method, so a
smaller method's request copies its own bytes into a slot as large as the
largest's (the segment's memory, not the copies, grows with the largest).

The spec is validated here (bad arguments raise ValueError/TypeError),
stored as JSON in the segment header and compared on attach.
"""
from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

ShapeLike = Union[int, Sequence[int]]
DTypeLike = Any
OutputsLike = Mapping[str, Tuple[ShapeLike, DTypeLike]]
InputsLike = Mapping[str, Tuple[ShapeLike, DTypeLike]]

_ALIGN = 8  # each field of a request or result row starts 8-byte aligned
#: Bytes before the inputs of a request when an evaluator has several
#: methods: the method's index (uint32), then 4 bytes of zeros.
HEADER_BYTES = 8
#: The most methods one evaluator serves.
MAX_METHODS = 16

_MAX_DIM = 1 << 31
_MAX_NDIM = 32
_MAX_ROW_BYTES = 1 << 30  # ring.h: SHM_MAX_ROW_BYTES


def _shape(x: ShapeLike, what: str) -> tuple[int, ...]:
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        x = (x,)
    try:
        dims = list(x)  # type: ignore[arg-type]
        if any(isinstance(d, (bool, np.bool_)) for d in dims):
            raise TypeError
        shape = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise TypeError(f"{what} must be a tuple of ints, got {x!r}") from None
    if len(shape) > _MAX_NDIM:
        raise ValueError(f"{what} has {len(shape)} dimensions, at most {_MAX_NDIM} are supported")
    if any(d < 0 or d > _MAX_DIM for d in shape):
        raise ValueError(f"{what} dimensions must be in 0..{_MAX_DIM}, got {shape}")
    return shape


def _dtype(x: DTypeLike, what: str) -> np.dtype[Any]:
    try:
        dt = np.dtype(x)
    except TypeError:
        raise TypeError(f"{what}: {x!r} is not a NumPy dtype") from None
    if dt.hasobject or dt.kind in "OUSV" or dt.itemsize == 0:
        raise TypeError(f"{what} must be a fixed-size numeric or bool dtype, got {dt}")
    return dt


@dataclass(frozen=True)
class Field:
    """One input or output of a method: its place in a request or result row."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    offset: int  # within the row
    nbytes: int


#: The outputs of a spec are Fields (the name the backends know them by).
OutputSpec = Field


def _fields(desc: Any, what: str, kind: str, start: int) -> tuple[Field, ...]:
    """Fields of {name: (shape, dtype)} (what: the argument; kind: "input"
    or "output"), laid out from byte `start`."""
    if not isinstance(desc, Mapping) or not desc:
        raise TypeError(f"{what} must be a non-empty dict {{name: (shape, dtype)}}, "
                        f"got {desc!r}")
    out = []
    offset = start
    for name, d in desc.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"{kind} names must be non-empty str, got {name!r}")
        try:
            shape, dtype = d
        except (TypeError, ValueError):
            raise TypeError(f"{what}[{name!r}] must be (shape, dtype), got {d!r}") from None
        s = _shape(shape, f"{what}[{name!r}] shape")
        t = _dtype(dtype, f"{what}[{name!r}] dtype")
        nbytes = math.prod(s) * t.itemsize
        offset = -(-offset // _ALIGN) * _ALIGN
        out.append(Field(name, s, t, offset, nbytes))
        offset += nbytes
    return tuple(out)


@dataclass(frozen=True)
class Method:
    """One function an evaluator serves, for ``Evaluator(methods=...)``:
    its named inputs and outputs, each ``{name: (shape, dtype)}``.  A
    request to it gives every input by name (``evaluate({"obs": x},
    method="initial")``); the model's function of that name gets a dict
    of batched arrays keyed by input name, and returns its outputs as
    for an evaluator of one method."""

    inputs: InputsLike
    outputs: OutputsLike


@dataclass(frozen=True)
class MethodSpec:
    """A method as laid out in the segment."""

    #: Its name ("" for the one method of an evaluator without methods=).
    name: str
    #: Its index, the header of its requests with several methods.
    index: int
    #: True when requests give the inputs by name (a dict); False for one
    #: unnamed input (an array), which is inputs[0] with the name "".
    named: bool
    inputs: tuple[Field, ...]
    outputs: tuple[Field, ...]

    @property
    def in_bytes(self) -> int:
        last = self.inputs[-1]
        return last.offset + last.nbytes

    @property
    def out_bytes(self) -> int:
        last = self.outputs[-1]
        return max(_ALIGN, last.offset + last.nbytes)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.outputs)

    def describe(self) -> str:
        """"method 'recurrent'", or "" for an evaluator's only method."""
        return f"method {self.name!r}" if self.name else ""

    def unpack(self, raw: np.ndarray) -> dict[str, np.ndarray]:
        """The named inputs of request rows ``raw`` (uint8, n x at least
        in_bytes): {name: C-contiguous array (n, *shape) of its dtype},
        what the model's function is called with."""
        n = raw.shape[0]
        # A copy, also of one row: a slice of one row counts as contiguous
        # to NumPy and would keep the request row's stride, which
        # frameworks refuse (torch.from_numpy) when it is no multiple of
        # the item size.
        return {f.name: raw[:, f.offset:f.offset + f.nbytes].copy()
                .view(f.dtype).reshape((n,) + f.shape) for f in self.inputs}

    def describe_outputs(self) -> str:
        return ", ".join(f"{o.name}: {o.shape} {o.dtype}" for o in self.outputs)

    def to_json(self) -> list[Any]:
        return [self.name, self.named,
                [[f.name, list(f.shape), f.dtype.str] for f in self.inputs],
                [[f.name, list(f.shape), f.dtype.str] for f in self.outputs]]


def _method(name: str, index: int, inputs: Optional[InputsLike], input_shape: Any,
            input_dtype: Any, outputs: OutputsLike, header: int) -> MethodSpec:
    where = f"methods[{name!r}]." if name else ""
    if inputs is None:  # one unnamed input
        s = _shape(input_shape, "input_shape")
        t = _dtype(input_dtype, "input_dtype")
        ins: tuple[Field, ...] = (Field("", s, t, header, math.prod(s) * t.itemsize),)
    else:
        ins = _fields(inputs, f"{where}inputs", "input", header)
    outs = _fields(outputs, f"{where}outputs", "output", 0)
    m = MethodSpec(name, index, inputs is not None, ins, outs)
    for f in ins:
        if f.nbytes == 0:
            raise ValueError(f"input_shape {f.shape} has no elements" if not f.name else
                             f"{where}inputs[{f.name!r}] shape {f.shape} has no elements")
    for what, nbytes in (("one input", m.in_bytes), ("one result", m.out_bytes)):
        if nbytes > _MAX_ROW_BYTES:
            raise ValueError(f"{what} would take {nbytes} bytes; at most {_MAX_ROW_BYTES} "
                             "are supported")
    return m


@dataclass(frozen=True)
class Spec:
    methods: tuple[MethodSpec, ...]
    max_batch: int
    max_clients: int
    slots_per_client: int

    @property
    def header_bytes(self) -> int:
        """Bytes before a request's inputs: the method's index, with several."""
        return HEADER_BYTES if len(self.methods) > 1 else 0

    @property
    def in_bytes(self) -> int:
        """A slot's request bytes: the largest method's."""
        return max(m.in_bytes for m in self.methods)

    @property
    def out_bytes(self) -> int:
        """A slot's result bytes: the largest method's."""
        return max(m.out_bytes for m in self.methods)

    def method(self, name: Optional[str]) -> MethodSpec:
        """The method called name (None: the only one); ValueError naming
        the methods there are otherwise."""
        if name is None:
            if len(self.methods) == 1:
                return self.methods[0]
            raise ValueError(f"this evaluator serves methods {self.method_names}: "
                             "say which (method=...)")
        for m in self.methods:
            if m.name == name:
                return m
        raise ValueError(f"method {name!r} is not declared; this evaluator serves "
                         f"{self.method_names if self.method_names != ('',) else 'one method'}")

    @property
    def method_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.methods)

    # The one method of an evaluator of one unnamed input (most evaluators):
    # its input's shape and dtype, and its outputs.
    @property
    def input_shape(self) -> tuple[int, ...]:
        return self._plain().inputs[0].shape

    @property
    def input_dtype(self) -> np.dtype[Any]:
        return self._plain().inputs[0].dtype

    @property
    def outputs(self) -> tuple[Field, ...]:
        return self._only().outputs

    @property
    def output_names(self) -> tuple[str, ...]:
        return self._only().output_names

    def describe_outputs(self) -> str:
        return self._only().describe_outputs()

    def _only(self) -> MethodSpec:
        if len(self.methods) != 1:
            raise ValueError(f"this evaluator serves methods {self.method_names}: their "
                             "inputs and outputs are each method's (spec.method(name))")
        return self.methods[0]

    def _plain(self) -> MethodSpec:
        m = self._only()
        if m.named:
            raise ValueError(f"this evaluator's inputs are named {m.input_names}: each "
                             "input's shape and dtype are in spec.methods[0].inputs")
        return m

    @classmethod
    def build(
        cls,
        input_shape: Optional[ShapeLike],
        input_dtype: DTypeLike,
        outputs: Optional[OutputsLike],
        max_batch: int,
        max_clients: int,
        slots_per_client: int,
        *,
        inputs: Optional[InputsLike] = None,
        methods: Optional[Mapping[str, Method]] = None,
    ) -> "Spec":
        """One of: input_shape (and input_dtype) with outputs, one unnamed
        input; inputs with outputs, named inputs; methods, several."""
        given = [w for w, v in (("input_shape", input_shape), ("inputs", inputs),
                                ("methods", methods)) if v is not None]
        if len(given) != 1:
            raise TypeError("give exactly one of input_shape (one unnamed input), inputs "
                            "(named inputs) and methods (several functions), got "
                            f"{', '.join(given) or 'none'}")
        if methods is not None:
            if outputs is not None:
                raise TypeError("with methods=, each Method has its own outputs; "
                                "outputs= is not taken")
            if not isinstance(methods, Mapping) or not methods:
                raise TypeError("methods must be a non-empty dict {name: shmeval.Method}, "
                                f"got {methods!r}")
            if len(methods) > MAX_METHODS:
                raise ValueError(f"at most {MAX_METHODS} methods, got {len(methods)}")
            header = HEADER_BYTES if len(methods) > 1 else 0
            ms = []
            for i, (name, m) in enumerate(methods.items()):
                if not isinstance(name, str) or not name.isidentifier():
                    raise TypeError(f"method names must be identifiers, got {name!r}")
                if not isinstance(m, Method):
                    raise TypeError(f"methods[{name!r}] must be a shmeval.Method, got "
                                    f"{type(m).__name__}")
                ms.append(_method(name, i, m.inputs, None, None, m.outputs, header))
            methods_t = tuple(ms)
        else:
            if outputs is None:
                raise TypeError("outputs must be a non-empty dict {name: (shape, dtype)}, "
                                "got None")
            methods_t = (_method("", 0, inputs, input_shape, input_dtype, outputs, 0),)
        for what, v, hi in (("max_batch", max_batch, 65536), ("max_clients", max_clients, 4096),
                            ("slots_per_client", slots_per_client, 64)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise TypeError(f"{what} must be an int, got {v!r}")
            if not 1 <= v <= hi:
                raise ValueError(f"{what} must be in 1..{hi}, got {v}")
        return cls(methods_t, int(max_batch), int(max_clients), int(slots_per_client))

    def to_json(self) -> bytes:
        return json.dumps({
            "methods": [m.to_json() for m in self.methods],
            "max_batch": self.max_batch,
            "max_clients": self.max_clients,
            "slots_per_client": self.slots_per_client,
        }, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Spec":
        d = json.loads(raw.decode())
        caps = (d["max_batch"], d["max_clients"], d["slots_per_client"])

        def fields(rows: list[Any]) -> dict[str, tuple[Any, Any]]:
            return {n: (s, t) for n, s, t in rows}

        ms = d["methods"]
        if len(ms) == 1 and ms[0][0] == "":
            name, named, ins, outs = ms[0]
            if named:
                return cls.build(None, None, fields(outs), *caps, inputs=fields(ins))
            (_, shape, dtype), = ins
            return cls.build(shape, dtype, fields(outs), *caps)
        return cls.build(None, None, None, *caps, methods={
            name: Method(fields(ins), fields(outs)) for name, _named, ins, outs in ms})
