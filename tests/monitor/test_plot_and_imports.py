"""``shmeval plot`` draws a self-play run's time series to a PNG with a
panel per figure it holds; the monitoring commands stay out of what
``shmeval stats``, ``ls`` and ``cleanup`` load."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import numpy as np

import shmeval
from core.test_cli_imports import run_recorded

TIMEOUT_S = 60
#: What only the monitoring commands may load.
MONITOR_MODULES = ("shmeval.monitor", "rich", "prometheus_client", "matplotlib")


def series(n: int, train: bool) -> Dict[str, Any]:
    t = [float(i + 1) for i in range(n)]
    return {"t_s": t, "moves_per_s": [100.0 + i for i in range(n)],
            "evals_per_s": [3000.0] * n, "games_per_s": [5.0] * n, "mean_batch": [20.0] * n,
            "model_version": [i // 2 for i in range(n)] if train else [0] * n,
            "loss": [None] + [3.0 - 0.1 * i for i in range(n - 1)] if train else [None] * n,
            "buffer": [100 * i for i in range(n)] if train else [None] * n}


def run_file(tmp_path: Path, result: Dict[str, Any], name: str = "run.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"settings": {"workers": 2, "games_per_worker": 4,
                                             "simulations": 8, "warmup": 1.0, "train": True},
                                "modes": result}))
    return path


def plot(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmeval", "plot", *argv], capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def test_a_training_run_with_its_win_rate(tmp_path: Path) -> None:
    matches = [{"t_start_s": 0.5, "t_s": 2.0, "version_min": 0, "version_max": 0, "games": 10,
                "wins": 2, "draws": 1, "losses": 7, "score": 0.25},
               {"t_start_s": 5.0, "t_s": 7.0, "version_min": 2, "version_max": 3, "games": 10,
                "wins": 6, "draws": 0, "losses": 4, "score": 0.6}]
    path = run_file(tmp_path, {"shmeval": {"series": series(10, True), "win_rate": matches}})
    r = plot(str(path))
    assert r.returncode == 0, r.stderr
    png = tmp_path / "run.png"
    assert r.stdout == (f"{png}: moves/s, evaluations/s, mean batch, model version, learner loss, "
                        "score vs rollout MCTS\n")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_modes_and_repeats_each_a_line_only_the_panels_with_data(tmp_path: Path) -> None:
    runs = [{"series": series(5, False)}, {"series": series(6, False)}]
    path = run_file(tmp_path, {"shmeval": {**runs[0], "runs": runs},
                               "queue": {"series": series(4, False)},
                               "local": {"moves_per_s": 1.0}})       # a run without a series
    out = tmp_path / "other.png"
    r = plot(str(path), "-o", str(out), "--title", "compare")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{out}: moves/s, evaluations/s, mean batch, model version\n"
    assert out.stat().st_size > 10_000


def test_stats_ls_and_cleanup_load_no_monitoring_module(tmp_path: Path) -> None:
    with shmeval.Evaluator(lambda x: x.sum(axis=1), input_shape=(2,), input_dtype="float32",
                           outputs={"total": ((), "float32")}) as ev:
        ev.evaluate(np.ones(2, np.float32))
        for argv in (["stats", ev.address], ["ls"], ["cleanup", "--dry-run"]):
            r, modules = run_recorded(argv, tmp_path)
            assert r.returncode == 0, r.stderr
            loaded = [m for m in modules
                      if any(m == f or m.startswith(f + ".") for f in MONITOR_MODULES)]
            assert loaded == [], (argv, loaded)
