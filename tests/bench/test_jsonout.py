"""shmeval._util.jsonout.write_json: the file on disk is always whole.
bench/gpu.py rewrites its one JSON file after every phase; a kill (the
device's time limit, SIGTERM) in the middle of a write must leave the
previous version, not a truncated one."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmeval._util import jsonout


class Killed(BaseException):
    """Stands for the process being stopped in the middle of the write."""


def test_a_write_cut_short_leaves_the_previous_file_whole(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    path = tmp_path / "out" / "gpu.json"
    jsonout.write_json(str(path), {"phase": 1, "rows": np.arange(3)})
    assert json.loads(path.read_text()) == {"phase": 1, "rows": [0, 1, 2]}
    real_dump = json.dump

    def dump_half_then_die(obj: Any, f: Any, **kw: Any) -> None:
        text = json.dumps(obj, **kw)
        f.write(text[:len(text) // 2])
        f.flush()  # half of the new text is in the file being written
        raise Killed

    monkeypatch.setattr(jsonout.json, "dump", dump_half_then_die)
    with pytest.raises(Killed):
        jsonout.write_json(str(path), {"phase": 2, "rows": list(range(1000))})
    # The old version, whole; the half-written one is gone.
    assert json.loads(path.read_text()) == {"phase": 1, "rows": [0, 1, 2]}
    assert sorted(p.name for p in path.parent.iterdir()) == ["gpu.json"]
    monkeypatch.setattr(jsonout.json, "dump", real_dump)
    jsonout.write_json(str(path), {"phase": 3})
    assert json.loads(path.read_text()) == {"phase": 3}
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    assert sorted(p.name for p in path.parent.iterdir()) == ["gpu.json"]
