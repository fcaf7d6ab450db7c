"""What ``set_weights`` takes: the weights as each framework hands them out
(a Keras ``get_weights()`` list, a PyTorch ``state_dict()``, a JAX params
pytree), made plain for the trip to the evaluator process: the same
structure, with NumPy arrays at the leaves.  The model's own
``set_weights`` then matches them (by name, by order or by structure).
No framework is imported here."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

EXPECTED = ("a list of arrays (Keras get_weights(), or the model's get_weights() order), "
            "a state dict (PyTorch state_dict()) or a params pytree of dicts, lists and "
            "tuples (JAX)")


def plain_weights(weights: Any) -> Any:
    """``weights`` with every leaf a NumPy array (a tensor on any device is
    copied to the host; bfloat16, which NumPy lacks, as float32).
    TypeError naming what was passed and what is expected for anything
    but a mapping, a list or a tuple."""
    if not isinstance(weights, (Mapping, list, tuple)):
        raise TypeError(f"set_weights takes {EXPECTED}; got {_what(weights)}")
    return _plain(weights)


def _plain(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(_plain(v) for v in x))
    if type(x) in (list, tuple):
        return type(x)(_plain(v) for v in x)
    return _array(x)


def _array(w: Any) -> np.ndarray:
    if isinstance(w, np.ndarray):
        return w
    if callable(getattr(w, "detach", None)) and callable(getattr(w, "cpu", None)):
        t = w.detach().cpu()  # a PyTorch tensor
        try:
            return np.asarray(t.numpy())
        except TypeError:  # bfloat16
            return np.asarray(t.float().numpy())
    a = np.asarray(w)
    if a.dtype.hasobject:
        raise TypeError(f"set_weights: a weight must be an array, got {_what(w)}; it takes "
                        f"{EXPECTED}")
    return a


def _what(x: Any) -> str:
    """What was passed, for a message: its type, and its shape if it has one."""
    t = type(x)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    shape = getattr(x, "shape", None)
    return f"a {name}" + (f" of shape {tuple(shape)}" if shape is not None else "")
