"""Type stubs of the Cython extension shmeval.bench._timing (the benchmark's
timing in C: the futex ping-pong reference and the workers' timed loop)."""
from typing import Any, Callable, TypeVar

import numpy as np

_T = TypeVar("_T")
_R = TypeVar("_R")

def pingpong(buf: Any, side: int, lat: np.ndarray, spin_ns: int = ...,
             timeout_ns: int = ...) -> int: ...
def timed_calls(fn: Callable[[_T], _R], arg: _T, t_end: int, lat: np.ndarray) -> tuple[int, _R]: ...
def timed_pipelined(submit: Callable[[_T], Any], states: _T, pendings: Any, t_end: int,
                    lat: np.ndarray) -> tuple[int, Any]: ...
