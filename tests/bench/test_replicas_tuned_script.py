"""bench/replicas_tuned.py end to end with ``--quick`` (the call model at
1 ms, 4 workers, 1 and 2 replicas, 2 runs of 3 s): every run and cell in
the JSON with sane figures, the table on stdout, /dev/shm clean after every
run and no process left running.  No timed assertions: what the tuner
decides on a shared machine is the benchmark's to report, not the test's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "replicas_tuned.py"
RUN_TIMEOUT = 180


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if os.path.exists(f"/proc/{p}")]


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "tuned.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=RUN_TIMEOUT,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    settings = result["settings"]
    assert result["complete"] is True
    assert settings["workers"] == [4] and settings["replicas"] == [1, 2]
    assert settings["runs"] == 2 and settings["models"] == [
        {"name": "call", "call_ms": 1.0, "row_us": 0.0}]
    assert "loadavg" in result["machine"] and "loadavg_after" in result["machine"]

    runs = result["runs"]
    assert sorted((run["replicas"], run["run"]) for run in runs) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for run in runs:
        assert run["throughput"] > 0 and run["answered"] > 0, run
        # The closed loop's best for a cost per call only: W / c, whatever N.
        assert run["best"] == pytest.approx(4 / 1e-3)
        assert run["of_best"] == pytest.approx(run["throughput"] / run["best"])
        assert len(run["per_second"]) == 3 and all(v >= 0 for v in run["per_second"])
        times = [t for t, _ in run["samples"]]
        totals = [n for _, n in run["samples"]]
        assert times == sorted(times) and totals == sorted(totals) and totals[0] == 0
        assert totals[-1] <= run["answered"]
        assert len(run["rows_per_call"]) == run["replicas"]
        assert all(rows is None or 1 <= rows <= 4 for rows in run["rows_per_call"]), run
        assert run["even_split"] == 4 / run["replicas"]
        assert run["verdict"] and run["verdict_key"] in {"greedy", "wait", "unsettled"}
        assert run["tuner"]["replicas"] == run["replicas"]
        assert len(run["replica_tuners"]) == run["replicas"]
        settled = run["settled_after_s"]
        assert (settled is None) == (run["tuner"]["phase"] != "settled")
        assert settled is None or settled <= run["seconds"] + 0.5
        assert run["failed_requests"] == 0 and run["shm_clean"] is True

    cells = {s["replicas"]: s for s in result["summary"]}
    assert set(cells) == {1, 2}
    for replicas, cell in cells.items():
        assert cell["runs"] == 2 and cell["throughput"]["median"] > 0 and cell["best"] > 0
        assert 0 <= cell["agreement"] <= cell["runs"]
        assert 0 <= cell["settled_within_target"] <= cell["settled_runs"] <= cell["runs"]
        assert len(cell["verdicts"]) == 2 and cell["verdicts_shown"]
        assert cell["multiple_of_one"] > 0
    assert cells[1]["multiple_of_one"] == 1.0
    assert "call: 1 ms per call" in r.stdout and "agreement" in r.stdout

    pids = [p for run in runs for p in (*run["worker_pids"], *run["replica_pids"])]
    deadline = time.monotonic() + 5.0
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pids), "processes left running"
