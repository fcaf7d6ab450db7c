"""``--pin``: a CPU of its own for the central evaluator, the others for
the workers."""
from __future__ import annotations

import os
from typing import Optional, Tuple


def cpu_split(pin: bool) -> Tuple[Optional[set[int]], Optional[set[int]]]:
    """With ``pin`` and at least two CPUs allowed: (the central evaluator's
    CPU, the workers' CPUs) -- the last allowed CPU for the evaluator, the
    others for the workers.  Else (None, None): nothing is pinned."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return None, None
    return {cpus[-1]}, set(cpus[:-1])


def pin(cpus: Optional[set[int]]) -> None:
    """Restricts this process (and the threads it starts later) to ``cpus``."""
    if cpus:
        os.sched_setaffinity(0, cpus)
