"""JSON output of benchmark and demo results."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
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
    space of indent, NumPy values converted by :func:`json_default`.

    The text goes to a temporary file in the same folder, which is then
    renamed over ``path`` (rename(2) replaces atomically within a file
    system): the file on disk is always a whole one, the previous version
    or the new, never part of one, even when the process is killed
    mid-write (bench/gpu.py rewrites its file after every phase of its one
    run on a borrowed GPU)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.",
                                     suffix=".part")
    try:
        # mkstemp makes it 0600; a result file is for everyone to read.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(results, f, indent=1, default=json_default)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
