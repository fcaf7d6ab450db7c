"""JSON output of benchmark and demo results."""
from __future__ import annotations

import json
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


def write_json(path: str, results: Any) -> None:
    """Writes ``results`` to ``path`` (its folder created if missing), one
    space of indent, NumPy values converted by :func:`json_default`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=json_default)
