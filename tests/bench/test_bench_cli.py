"""``shmeval bench``, run as the installed console command (``python -m
shmeval``, never src/ itself: CI installs the package non-editable), with a
tiny configuration: every method and worker count in the JSON, a PNG, the
tables on stdout, and clear errors for bad arguments.  No timed assertions.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

RUN_TIMEOUT = 240
METHODS = ["queue", "pipe", "faster_fifo", "locksem", "shmeval", "shm_thread"]
WORKERS = [1, 2]
TINY = ["--workers", ",".join(map(str, WORKERS)), "--seconds", "0.3", "--repeats", "1", "--state", "c4",
        "--warmup", "20", "--samples", "2000", "--methods", ",".join(METHODS),
        "--reference-seconds", "0.1", "--batch-path-seconds", "0.02"]
TRIAL_KEYS = ("throughput", "round_trips", "p50_us", "p99_us", "p999_us", "mean_batch", "fairness",
              "worker_counts", "latency_us", "latency_cdf_us", "server", "repeat")


def _bench(args: List[str], cwd: Path, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
    # cwd is a scratch directory, so that `-m shmeval` can only find the
    # installed package.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "shmeval", "bench", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Tuple[subprocess.CompletedProcess[str], Dict[str, Any], Path]:
    tmp = tmp_path_factory.mktemp("bench")
    r = _bench([*TINY, "--json", str(tmp / "bench.json"), "--plot", str(tmp / "bench.png")], tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(tmp / "bench.json") as f:
        return r, json.load(f), tmp


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_json_has_every_trial(tiny_run: Tuple[subprocess.CompletedProcess[str], Dict[str, Any], Path]) -> None:
    _, data, _ = tiny_run
    assert data["failures"] == [] and data["dev_shm_leftovers"] == []
    for key in ("cpu_model", "cpu_count", "platform", "python", "numpy", "loadavg", "shmeval"):
        assert key in data["machine"]
    assert data["config"]["methods"] == METHODS and data["config"]["workers"] == WORKERS
    assert data["config"]["states"] == ["c4"]
    assert data["config"]["trial"]["worker_sched"] == "normal"  # the default
    trials = {(t["state"], t["workers"], t["method"]): t for t in data["trials"]}
    assert set(trials) == {("c4", n, m) for n in WORKERS for m in METHODS}
    grid = data["config"]["cdf_grid"]
    for t in trials.values():
        assert "error" not in t
        for key in TRIAL_KEYS:
            assert key in t, key
        assert t["throughput"] > 0 and min(t["worker_counts"]) > 0
        assert 0 < t["p50_us"] <= t["p99_us"] <= t["p999_us"]
        assert len(t["latency_cdf_us"]) == len(grid)
        assert t["latency_cdf_us"] == sorted(t["latency_cdf_us"])
    assert {(r["workers"], r["method"]) for r in data["summary"]} == {(n, m) for n in WORKERS for m in METHODS}


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_reference_and_batch_path(tiny_run: Tuple[subprocess.CompletedProcess[str], Dict[str, Any], Path]) -> None:
    r, data, _ = tiny_run
    ref = data["reference"]
    assert ref["pingpong"] and ref["copy"]
    for row in ref["pingpong"]:
        assert row["kind"] in ("futex", "semaphore") and row["round_trips_per_s"] > 0
    # shmeval's round trip against the ping-pong: one row per worker count,
    # the multiple recomputable from the two figures.
    versus = data["versus_reference"]
    assert sorted(v["workers"] for v in versus) == sorted(WORKERS)
    for v in versus:
        assert v["shmeval_us"] > 0 and v["reference_us"] > 0
        assert v["multiple"] == pytest.approx(v["shmeval_us"] / v["reference_us"])
    assert "machine's limit" in r.stdout
    rows = data["batch_path"]["c4"]
    assert [row["batch"] for row in rows] == [1, 4, 16, 64, 256, 1024]
    for row in rows:
        for key in ("collect_us", "finish_us", "total_us", "memcpy_us"):
            assert row[key] > 0, key


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_tables_and_plot(tiny_run: Tuple[subprocess.CompletedProcess[str], Dict[str, Any], Path]) -> None:
    r, _, tmp = tiny_run
    out = r.stdout
    assert "round trips/s" in out and "x queue" in out
    for m in METHODS:
        assert f" {m} " in out, m
    assert "shmeval vs pipe" in out and "shmeval vs locksem" in out
    assert "new entries in /dev/shm: none" in out
    # The progress went to stderr, as plain lines (not a terminal here).
    assert f"{len(WORKERS) * len(METHODS)}/{len(WORKERS) * len(METHODS)} trials" in r.stderr
    with open(tmp / "bench.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["--methods", "nope"], "unknown method(s) nope"),
    (["--workers", "0"], "expected positive integers"),
    (["--workers", "1,x"], "expected positive integers"),
    (["--state", "chess"], "unknown state(s) chess"),
    (["--seconds", "-1"], "expected a positive number"),
    (["--worker-sched", "fifo"], "invalid choice"),
])
def test_bad_arguments_exit_2(args: List[str], message: str, tmp_path: Path) -> None:
    r = _bench(args, tmp_path, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr
    assert "usage: shmeval bench" in r.stderr
