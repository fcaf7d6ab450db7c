"""What an evaluator serves: input shape/dtype, named outputs, capacities.

The spec is validated here (bad arguments raise ValueError/TypeError), stored
as JSON in the segment header and compared on attach.
"""
from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Tuple, Union

import numpy as np

ShapeLike = Union[int, Sequence[int]]
DTypeLike = Any
OutputsLike = Mapping[str, Tuple[ShapeLike, DTypeLike]]

_ALIGN = 8  # each output field of a result row starts 8-byte aligned


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
class OutputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    offset: int  # within a result row
    nbytes: int


@dataclass(frozen=True)
class Spec:
    input_shape: tuple[int, ...]
    input_dtype: np.dtype[Any]
    outputs: tuple[OutputSpec, ...]
    max_batch: int
    max_clients: int
    slots_per_client: int

    @property
    def in_bytes(self) -> int:
        return math.prod(self.input_shape) * self.input_dtype.itemsize

    @property
    def out_bytes(self) -> int:
        last = self.outputs[-1]
        return max(_ALIGN, last.offset + last.nbytes)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.outputs)

    @classmethod
    def build(
        cls,
        input_shape: ShapeLike,
        input_dtype: DTypeLike,
        outputs: OutputsLike,
        max_batch: int,
        max_clients: int,
        slots_per_client: int,
    ) -> "Spec":
        shape = _shape(input_shape, "input_shape")
        dtype = _dtype(input_dtype, "input_dtype")
        if not isinstance(outputs, Mapping) or not outputs:
            raise TypeError(
                "outputs must be a non-empty dict {name: (shape, dtype)}, got %r" % (outputs,))
        outs = []
        offset = 0
        for name, desc in outputs.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"output names must be non-empty str, got {name!r}")
            try:
                oshape, odtype = desc
            except (TypeError, ValueError):
                raise TypeError(
                    f"outputs[{name!r}] must be (shape, dtype), got {desc!r}") from None
            s = _shape(oshape, f"outputs[{name!r}] shape")
            d = _dtype(odtype, f"outputs[{name!r}] dtype")
            nbytes = math.prod(s) * d.itemsize
            offset = -(-offset // _ALIGN) * _ALIGN
            outs.append(OutputSpec(name, s, d, offset, nbytes))
            offset += nbytes
        for what, v, hi in (("max_batch", max_batch, 65536), ("max_clients", max_clients, 4096),
                            ("slots_per_client", slots_per_client, 64)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise TypeError(f"{what} must be an int, got {v!r}")
            if not 1 <= v <= hi:
                raise ValueError(f"{what} must be in 1..{hi}, got {v}")
        spec = cls(shape, dtype, tuple(outs), int(max_batch), int(max_clients),
                   int(slots_per_client))
        if spec.in_bytes == 0:
            raise ValueError(f"input_shape {shape} has no elements")
        for what, nbytes in (("one input", spec.in_bytes), ("one result", spec.out_bytes)):
            if nbytes > _MAX_ROW_BYTES:
                raise ValueError(f"{what} would take {nbytes} bytes; at most {_MAX_ROW_BYTES} "
                                 "are supported")
        return spec

    def to_json(self) -> bytes:
        return json.dumps({
            "input_shape": list(self.input_shape),
            "input_dtype": self.input_dtype.str,
            "outputs": [[o.name, list(o.shape), o.dtype.str] for o in self.outputs],
            "max_batch": self.max_batch,
            "max_clients": self.max_clients,
            "slots_per_client": self.slots_per_client,
        }, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Spec":
        d = json.loads(raw.decode())
        return cls.build(d["input_shape"], d["input_dtype"],
                         {n: (s, t) for n, s, t in d["outputs"]},
                         d["max_batch"], d["max_clients"], d["slots_per_client"])

    def describe_outputs(self) -> str:
        return ", ".join(f"{o.name}: {o.shape} {o.dtype}" for o in self.outputs)
