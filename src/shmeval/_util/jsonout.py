"""JSON output of benchmark and demo results."""
from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np


def json_default(obj: Any) -> Any:
    """``json.dump(default=...)`` for results: NumPy scalars and arrays as
    Python numbers and lists; anything else (whatever ``Evaluator.stats()``
    may hold) as its repr, since losing a run at the last step over one
    field would be worse than a string."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return repr(obj)


def nan_to_null(obj: Any) -> Any:
    """``obj`` with every float that strict JSON cannot spell (NaN, inf)
    as None, in nested dicts, lists and tuples: ``stats()`` reports a
    percentile of nothing measured yet as NaN, and strict parsers reject a
    bare ``NaN``."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: nan_to_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [nan_to_null(v) for v in obj]
    return obj


def write_json(path: str, results: Any) -> None:
    """Writes ``results`` to ``path`` (its folder created if missing), one
    space of indent, NumPy values converted by :func:`json_default`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=json_default)
