"""``shmeval selfplay --ray --nodes 2 --train``: the self-play demo on a
simulated two-node Ray cluster, end to end, as a user runs it: every node
serves and plays, the learner's weights reach every node, the JSON says
so, and the run leaves no Ray process and no segment behind.  About
60-80 s on 2 cores (a cluster, a TensorFlow evaluator per node and the
learner start)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("tensorflow")

#: What the processes a Ray node runs have in their command line.
RAY_DAEMONS = ("/ray/core/src/ray/raylet/raylet", "/ray/core/src/ray/gcs/gcs_server")


def ray_daemons() -> set[int]:
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if any(d in cmd for d in RAY_DAEMONS):
                pids.add(int(entry))
    return pids


@pytest.mark.timeout(600)
def test_selfplay_on_a_simulated_cluster_trains_every_node(tmp_path: Path) -> None:
    before = ray_daemons()
    out = tmp_path / "ray.json"
    r = subprocess.run(
        [sys.executable, "-m", "shmeval", "selfplay", "--ray", "--nodes", "2", "--workers", "1",
         "--games-per-worker", "4", "--simulations", "8", "--seconds", "3", "--warmup", "1",
         "--train", "--push-every", "0.5", "--batch-size", "16", "--json", str(out)],
        capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "2 nodes on this machine" in r.stdout
    d = json.loads(out.read_text())["ray"]
    assert len(d["nodes"]) == 2 and d["workers"] == 2 and d["workers_lost"] == 0
    assert d["train"]["pushes"] >= 1
    for node in d["nodes"].values():
        assert node["serving"] and node["workers"] == 1 and node["evals_per_s"] > 0
        assert node["model_version"] == d["model_version"] >= 1  # every node got the last push
    deadline = time.monotonic() + 30
    while ray_daemons() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_daemons() - before, "the run left Ray's processes running"


def test_ray_refuses_the_other_modes_before_starting_anything() -> None:
    before = ray_daemons()
    r = subprocess.run([sys.executable, "-m", "shmeval", "selfplay", "--ray", "--compare"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "--ray plays in the shmeval mode only" in r.stderr
    assert not ray_daemons() - before
