"""bench/tf_throughput.py end to end at 2 workers with short windows: every
method starts, answers the check states as Keras does, is measured and
stopped; the large-batch phase runs; the JSON file holds what the README's
row and docs/performance.md quote from it.  Figures are not checked: this
is the script working, not a measurement."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_bench

METHODS = ["local", "queue", "tfserver", "shmeval"]


@pytest.mark.timeout(420)
def test_tf_throughput_script_runs(tmp_path: Path) -> None:
    out = tmp_path / "tf.json"
    stdout = run_bench("tf_throughput.py", "--workers", "2", "--seconds", "0.3", "--repeats",
                       "1", "--warmup", "5", "--max-batch", "32", "--overhead-workers", "1",
                       "--overhead-seconds", "0.3", "--overhead-rows", "16,32",
                       "--json", str(out), timeout=400)
    result = json.loads(out.read_text())
    assert sorted(result["checks"]) == sorted(METHODS)
    assert all(check["ok"] for check in result["checks"].values()), result["checks"]
    assert sorted(row["method"] for row in result["summary"]) == sorted(METHODS)
    for row in result["summary"]:
        assert row["workers"] == 2 and row["throughput"]["median"] > 0, row
    runs = {run["method"]: run for run in result["runs"]}
    assert runs["shmeval"]["tensorflow_imported_in_workers"] == 0
    assert runs["queue"]["tensorflow_imported_in_workers"] == 0
    assert runs["local"]["tensorflow_imported_in_workers"] == 2
    assert runs["shmeval"]["evaluator_stats"]["failed_requests"] == 0
    assert set(result["ratios"]["2"]) >= {"shmeval/local evals/s", "shmeval/queue evals/s",
                                          "shmeval/tfserver evals/s"}
    overhead = result["overhead_phase"]["summary"]
    assert overhead["overhead_us_per_batch"]["median"] > 0
    assert overhead["mean_batch"]["median"] > 1
    assert result["dev_shm_leftovers"] == []
    assert "targets at 2 workers" in stdout
