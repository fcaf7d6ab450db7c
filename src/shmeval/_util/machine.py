"""The description of the machine that every result file records."""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
from typing import Any, Dict, Optional, Sequence

import numpy as np

from ..backends._device import cpu_model


def _version(distributions: Sequence[str]) -> Optional[str]:
    """The version of the first of ``distributions`` that is installed."""
    for d in distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(d)
    return None


def machine_info(**versions: Sequence[str]) -> Dict[str, Any]:
    """CPU, CPUs usable, platform, Python, NumPy, shmeval and the load
    average, plus one entry per keyword: the version of the first of its
    distributions that is installed (``tensorflow=("tensorflow",
    "tensorflow-cpu")``), None when none is."""
    info: Dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model() or platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "numpy": np.__version__,
        "shmeval": _version(("shmeval",)),
    }
    info.update({key: _version(dists) for key, dists in versions.items()})
    # Other load on the machine skews every figure; this makes it visible.
    info["loadavg"] = list(os.getloadavg())
    return info
