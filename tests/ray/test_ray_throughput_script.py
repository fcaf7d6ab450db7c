"""bench/ray_throughput.py end to end with 2 worker actors and 1 s windows:
shmeval on Ray, a Ray Serve deployment with ``@serve.batch``, a Ray actor
holding the model and shmeval without Ray each run and are measured, and
the JSON holds the README row's figures and ratios.  Figures are not
checked: this is the script working, not a measurement (about 30 s)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_bench

WAYS = ["shmeval-ray", "ray-serve", "ray-actor", "shmeval"]


@pytest.mark.timeout(300)
def test_ray_throughput_script_runs(tmp_path: Path) -> None:
    out = tmp_path / "ray.json"
    stdout = run_bench("ray_throughput.py", "--workers", "2", "--nodes", "2", "--seconds", "1",
                       "--json", str(out), timeout=280)
    result = json.loads(out.read_text())
    assert sorted(result["evals_per_s"]) == sorted(WAYS)
    assert all(v > 0 for v in result["evals_per_s"].values()), result["evals_per_s"]
    assert sorted(result["shmeval_ray_over"]) == sorted(WAYS)
    assert result["shmeval_ray_over"]["shmeval-ray"] == 1.0
    # One evaluator per simulated node, each of which served.
    per_node = result["runs"]["shmeval-ray"][0]["mean_batch_per_node"]
    assert len(per_node) == 2 and all(b >= 1 for b in per_node.values()), per_node
    assert "shmeval-ray / way" in stdout
