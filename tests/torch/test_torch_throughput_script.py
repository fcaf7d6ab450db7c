"""bench/torch_throughput.py end to end at 2 workers with short windows:
the per-worker models, the Queue evaluator, TorchRL's inference server and
shmeval each start, answer the check states as the net does and are
measured, and the JSON holds what the README's PyTorch row quotes.
Figures are not checked: this is the script working, not a measurement."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_bench

METHODS = ["local", "queue", "torchrl", "shmeval"]


@pytest.mark.timeout(300)
def test_torch_throughput_script_runs(tmp_path: Path) -> None:
    out = tmp_path / "torch.json"
    stdout = run_bench("torch_throughput.py", "--workers", "2", "--seconds", "0.3",
                       "--repeats", "1", "--warmup", "5", "--max-batch", "16",
                       "--json", str(out), timeout=280)
    result = json.loads(out.read_text())
    assert sorted(row["method"] for row in result["summary"]) == sorted(METHODS)
    for row in result["summary"]:
        assert row["workers"] == 2 and row["throughput"]["median"] > 0, row
    runs = {run["method"]: run for run in result["runs"]}
    assert sorted(runs) == sorted(METHODS)
    assert all(run["check"]["ok"] for run in runs.values()), runs
    assert runs["shmeval"]["workers_that_imported_torch"] == 0
    assert runs["local"]["workers_that_imported_torch"] == 2
    assert set(result["targets"]) == {"shmeval/torchrl evals/s", "shmeval/queue evals/s",
                                      "shmeval/local evals/s", "worker RSS local/shmeval"}
    assert "targets at 2 workers (reported, not enforced):" in stdout


@pytest.mark.timeout(200)
def test_torch_throughput_fixes_the_wait_and_threads_on_request(tmp_path: Path) -> None:
    out = tmp_path / "fixed.json"
    run_bench("torch_throughput.py", "--methods", "shmeval", "--workers", "1", "--seconds",
              "0.2", "--repeats", "1", "--warmup", "3", "--max-batch", "8",
              "--serving-threads", "1", "--max-wait-us", "40", "--json", str(out), timeout=180)
    tuner = json.loads(out.read_text())["runs"][0]["evaluator_stats"]["tuner"]
    assert tuner["max_wait_us"] == pytest.approx(40.0), tuner
    assert tuner["serving_threads"] == 1, tuner


def test_torch_throughput_refuses_a_wait_that_is_not_a_number() -> None:
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "bench", "torch_throughput.py")
    r = subprocess.run([sys.executable, script, "--max-wait-us", "soon"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "argument --max-wait-us: must be auto or a number, got 'soon'" in r.stderr


class _FailingRun:
    """A method whose start fails, as a server out of GPU memory would."""

    def __init__(self, *args: object) -> None:
        pass

    def start(self) -> None:
        raise RuntimeError("CUDA out of memory (made up)")

    def stop(self, abort: bool = False) -> list[str]:
        return []


@pytest.mark.timeout(120)
def test_measure_keeps_going_past_a_failing_method(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/gpu.py's one run on a borrowed GPU keeps the other methods'
    figures when one method fails: measure(keep_going=True) records the
    error in that run's entry and calls ``after`` as each method ends;
    without keep_going the error is raised."""
    import argparse
    import sys

    bench = str(Path(__file__).resolve().parents[2] / "bench")
    sys.path.insert(0, bench)
    try:
        import torch_throughput as tt
    finally:
        sys.path.remove(bench)
    monkeypatch.setitem(tt.RUNS, "queue", _FailingRun)
    args = argparse.Namespace(workers=[1], methods=["queue"], repeats=1, seconds=0.1)
    cfg = tt.NetConfig(filters=4, layers=1)
    weights = tt.make_weights(cfg)
    seen: list[int] = []
    trials, runs = tt.measure(args, cfg, weights, keep_going=True,
                              after=lambda trials, runs: seen.append(len(runs)))
    assert trials == [] and seen == [1]
    assert runs[0]["method"] == "queue" and runs[0]["workers"] == 1
    assert runs[0]["error"] == "RuntimeError: CUDA out of memory (made up)"
    assert "Traceback" in runs[0]["traceback"]
    with pytest.raises(RuntimeError, match="made up"):
        tt.measure(args, cfg, weights)
