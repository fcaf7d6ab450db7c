"""bench/torch_model_cost.py runs and prints one row per style with a
figure for each batch size asked for, and TorchModel's own cost per call
at each.  No timed assertions."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "torch_model_cost.py"


@pytest.mark.timeout(200)
def test_prints_every_style_and_batch() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--batches", "1,3", "--rounds", "1",
                        "--calls", "1"], capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| ([a-z-]+) \| (.*) \|$", r.stdout,
                                                         re.M)}
    assert rows.pop("style") == "1 row | 3 rows"
    assert set(rows) == {"module", "frozen", "frozen-no-onednn", "frozen-own-conv", "served"}
    for cells in rows.values():
        figures = cells.split(" | ")
        assert len(figures) == 2 and all(re.fullmatch(r"[\d,]+ \([\d,]+\)", f) for f in figures)
    own = re.search(r"^TorchModel's own cost per call .*: (.*)$", r.stdout, re.M)
    assert own is not None, r.stdout[-3000:]
    sizes = [re.fullmatch(r"(\d+) rows? [\d,]+ - [\d,]+ = [+-][\d,]+", part)
             for part in own.group(1).split(", ")]
    assert [m.group(1) for m in sizes if m] == ["1", "3"], own.group(1)
