"""JSON output of benchmark and demo results."""
from __future__ import annotations

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
