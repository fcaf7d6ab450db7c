"""bench/replicas.py end to end with ``--quick`` (4 workers, 1 and 2
replicas, one short window per cell): every cell of both designs in the
JSON with its per-replica figures, the table and the target on stdout, and
no process left running.  No timed assertions."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "replicas.py"
RUN_TIMEOUT = 150


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if os.path.exists(f"/proc/{p}")]


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "replicas.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=RUN_TIMEOUT,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["settings"]["workers"] == [4] and result["settings"]["replicas"] == [1, 2]
    assert "loadavg" in result["machine"]

    cells = {(row["replicas"], row["design"]): row for row in result["summary"]}
    assert set(cells) == {(n, d) for n in (1, 2) for d in ("shmeval", "queue")}
    for (replicas, design), row in cells.items():
        assert row["workers"] == 4 and row["throughput"]["median"] > 0, row
        assert len(row["model_busy_share"]) == replicas
        assert len(row["replica_mean_batch"]) == replicas
        assert all(b >= 1 for b in row["replica_mean_batch"]), row
        assert row["multiple_of_one"] > 0
    for trial in result["trials"]:
        # Every request is counted by exactly one replica.
        assert sum(trial["replica_requests"]) > 0
        assert 0 < trial["p50_ms"] <= trial["p99_ms"]
        # The calls by rows add up to the replicas' batches and requests, but
        # for a batch per replica being recorded while the counters were read.
        calls = {int(rows): n for rows, n in trial["calls_by_rows"].items()}
        replicas = trial["replicas"]
        assert abs(sum(calls.values()) - sum(trial["replica_batches"])) <= replicas
        assert abs(sum(rows * n for rows, n in calls.items())
                   - sum(trial["replica_requests"])) <= 4 * replicas
        assert 1 <= trial["rows_per_call"]["p10"] <= trial["rows_per_call"]["p90"] <= 4

    [target] = result["targets"]
    assert target["workers"] == 4 and target["replicas"] == 2 and target["target"] == 1.8
    assert "4 workers" in r.stdout and "target: shmeval with N replicas" in r.stdout

    [run] = result["runs"]
    assert run["shmeval_stats"]["2"]["failed_requests"] == 0
    assert run["workers"] == 4
    pids = [*run["worker_pids"], *(p for ps in run["shmeval_replica_pids"].values() for p in ps),
            *(p for ps in run["queue_consumer_pids"].values() for p in ps)]
    assert len(pids) == 4 + 3 + 3
    deadline = time.monotonic() + 5.0
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pids), "processes left running"
