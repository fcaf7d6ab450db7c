"""bench/gpu.py end to end on the CPU (``--device cpu``): the model-alone
sweep, every method at 2 workers, the checks of the answers, the JSON
file; so that on a GPU machine the script works the first time.  Also
the interpolation that reads the model alone's rows/s at a batch size."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import run_bench

BENCH = Path(__file__).resolve().parents[2] / "bench"
METHODS = ["local", "queue", "torchrl", "shmeval"]


@pytest.fixture(scope="module")
def gpu_module() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import gpu
    finally:
        sys.path.remove(str(BENCH))
    return gpu


def test_rows_per_s_at(gpu_module: Any) -> None:
    sweep = [{"batch": 1, "served_rows_per_s": 100.0}, {"batch": 4, "served_rows_per_s": 300.0},
             {"batch": 16, "served_rows_per_s": 500.0}]
    assert gpu_module.rows_per_s_at(sweep, 4) == 300.0
    assert gpu_module.rows_per_s_at(sweep, 2) == 200.0  # half way in log2
    assert gpu_module.rows_per_s_at(sweep, 64) == 500.0  # past the end: the last


@pytest.mark.timeout(420)
def test_gpu_script_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    stdout = run_bench("gpu.py", "--device", "cpu", "--workers", "2", "--seconds", "0.2",
                       "--repeats", "1", "--warmup", "5", "--batches", "1,4,16",
                       "--sweep-seconds", "0.05", "--max-batch", "16", "--json", str(out),
                       timeout=400)
    result = json.loads(out.read_text())
    assert "partial" not in result  # the last write is the whole run's
    assert [row["batch"] for row in result["model_alone"]] == [1, 4, 16]
    assert all(row["served_rows_per_s"] > 0 and row["device_rows_per_s"] > 0
               for row in result["model_alone"])
    assert result["device"]["device_name"] == "cpu" and not result["device"]["cuda_graphs"]
    assert sorted(row["method"] for row in result["summary"]) == sorted(METHODS)
    for row in result["summary"]:
        assert row["workers"] == 2 and row["throughput"]["median"] > 0, row
        assert row["gpu_busy_share"] is None  # no GPU
    runs = {run["method"]: run for run in result["runs"]}
    assert all(run["check"]["ok"] for run in runs.values())
    assert runs["shmeval"]["workers_that_imported_torch"] == 0
    assert runs["queue"]["workers_that_imported_torch"] == 0
    assert runs["local"]["workers_that_imported_torch"] == 2
    assert runs["shmeval"]["evaluator_stats"]["failed_requests"] == 0
    assert "shmeval / model alone rows/s at its batch" in result["ratios"]["2"]
    assert "2 workers: median of windows" in stdout
