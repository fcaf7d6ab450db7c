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
                       "--call-cost-workers", "2", "--call-us", "2000", timeout=400)
    result = json.loads(out.read_text())
    assert "partial" not in result  # the last write is the whole run's
    assert all(phase["ok"] for phase in result["phases"].values()), result["phases"]
    assert result["versions"]["torch"]
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
    # The call-cost phase, with the CPU's sleeping stand-in.
    cells = {c["cell"]: c for c in result["call_cost"]}
    assert sorted(cells) == ["one model", "two replicas, one device",
                             "two serving threads (streams)"]
    for c in cells.values():
        assert c["evals_per_s"] > 0 and c["closed_loop_best"] == 2 / 0.002, c
    assert len(cells["two replicas, one device"]["mean_batch_per_replica"]) == 2
    assert cells["two serving threads (streams)"]["serving_threads"] == 2


def test_call_cost_cells(gpu_module: Any) -> None:
    """Several replicas on one device (as processes, and as streams of one
    process) everywhere; one per GPU where there are several."""
    assert gpu_module.call_cost_cells("cpu", 0) == [
        ("one model", ["cpu"], 1), ("two serving threads (streams)", ["cpu"], 2),
        ("two replicas, one device", ["cpu", "cpu"], 1)]
    on_gpus = gpu_module.call_cost_cells("cuda:0", 4)
    assert on_gpus[2] == ("two replicas, one device", ["cuda:0", "cuda:0"], 1)
    assert on_gpus[3] == ("one replica per GPU (4)", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"], 1)
    assert len(gpu_module.call_cost_cells("cuda:0", 1)) == 3


@pytest.mark.timeout(120)
def test_a_failing_phase_is_recorded_and_the_rest_runs(gpu_module: Any, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The model-alone phase raising does not end the one run: its error
    goes into its entry of "phases", the methods still run, and the JSON
    file is written, the last time without "partial"."""
    def failing_model_alone(*args: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access (made up)")

    measured: list[tuple[list[int], list[str]]] = []

    def fake_measure(args: Any, *rest: Any, **kw: Any) -> Any:
        measured.append((args.workers, args.methods))
        return [], [{"method": args.methods[0], "workers": args.workers[0], "made_up": True}]

    monkeypatch.setattr(gpu_module, "model_alone", failing_model_alone)
    monkeypatch.setattr(gpu_module, "measure", fake_measure)
    out = tmp_path / "gpu.json"
    rc = gpu_module.main(["--device", "cpu", "--workers", "1,2", "--methods", "queue,shmeval",
                          "--call-cost-workers", "0", "--json", str(out)])
    assert rc == 1  # a phase failed
    assert measured == [([1], ["queue"]), ([1], ["shmeval"]), ([2], ["queue"]),
                        ([2], ["shmeval"])]
    result = json.loads(out.read_text())
    assert "partial" not in result and "interrupted" not in result
    phases = result["phases"]
    assert phases["model_alone"]["ok"] is False
    assert phases["model_alone"]["error"] == ("RuntimeError: CUDA error: an illegal memory "
                                              "access (made up)")
    assert "Traceback" in phases["model_alone"]["traceback"]
    assert phases["methods"]["ok"] and phases["report"]["ok"] and phases["versions"]["ok"]
    assert result["model_alone"] is None
    assert [run["made_up"] for run in result["runs"]] == [True] * 4
    versions = result["versions"]
    assert versions["torch"] and "torch_cuda" in versions and "driver" in versions


@pytest.mark.timeout(300)
def test_sigterm_writes_what_was_measured(tmp_path: Path) -> None:
    """SIGTERM (the ``timeout`` wrapper on the device) in the middle of the
    run: the JSON file is whole and says it was interrupted, and the script
    exits soon after."""
    import os
    import signal
    import subprocess

    out = tmp_path / "gpu.json"
    p = subprocess.Popen([sys.executable, str(BENCH / "gpu.py"), "--device", "cpu",
                          "--workers", "2", "--seconds", "30", "--repeats", "4",
                          "--warmup", "5", "--batches", "1,4", "--sweep-seconds", "0.05",
                          "--max-batch", "16", "--json", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert p.stdout is not None
    seen = []
    for line in p.stdout:  # until the first method has started and checked answers
        seen.append(line)
        if line.startswith("check "):
            break
    p.send_signal(signal.SIGTERM)
    rest, _ = p.communicate(timeout=120)
    assert p.returncode == 130, "".join(seen) + rest
    result = json.loads(out.read_text())
    assert result["interrupted"] == "signal 15" and result["partial"] is True
    assert result["phases"]["model_alone"]["ok"] is True
    assert result["phases"]["methods"]["ok"] is None  # under way when it was stopped
    assert not [f for f in os.listdir(tmp_path) if f != "gpu.json"]  # no temporary left
