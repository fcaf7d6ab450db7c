"""The checks of a setting that is a number or ``"auto"``, shared by the
client, the evaluator and the tuner: each caller passes its own range check,
and these give the errors one wording (the argument's name, what it must
be, what it got).  Kept apart from every one of them so that none imports
another for the checks."""
from __future__ import annotations

import numbers
from typing import Any, Callable

import numpy as np

#: The value of a setting that is measured while serving rather than fixed
#: by the caller.
AUTO = "auto"


def check_auto(name: str, value: Any, check: Callable[[str, float], Any]) -> Any:
    """``value`` if it is ``"auto"``, else ``check(name, number)`` with the
    value as a float (check raises ValueError when it is out of range);
    any other string is a ValueError, and anything else that is not a
    number (None, a list) a TypeError, naming the argument and both forms."""
    if isinstance(value, str):
        if value != AUTO:
            raise ValueError(f"{name} must be 'auto' or a number, got {value!r}")
        return AUTO
    return check(name, as_number(name, value, "'auto' or a number"))


def as_number(name: str, value: Any, expected: str = "a number") -> float:
    """``value`` as a float; TypeError naming the argument and what it
    must be for anything but a real number (None, a bool, a list)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    return float(value)
