"""``shmeval selfplay --pipeline K``: a short pipelined run through the CLI
(its games replay, its settings are recorded, the workers keep K groups'
leaves in flight) and the arguments it refuses."""
from __future__ import annotations

import json
from typing import Any

import pytest

from shmeval import selfplay
from test_selfplay import (RUN_TIMEOUT, TINY, WORKERS, _cli, check_games,
                           exit_codes_in_a_fresh_interpreter)


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_pipelined_run(tmp_path: Any) -> None:
    js, npz = str(tmp_path / "p.json"), str(tmp_path / "p.npz")
    r = _cli([*TINY, "--pipeline", "3", "--json", js, "--games", npz])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 pipelined groups of" in r.stdout
    with open(js) as f:
        out = json.load(f)
    assert out["settings"]["pipeline"] == 3
    m = out["modes"]["shmeval"]
    assert m["moves_per_s"] > 0 and m["tensorflow_in_workers"] == 0
    # Up to 3 groups of 2 games' leaves per worker reach the evaluator at once.
    assert 1.0 <= m["mean_batch"] <= 3 * WORKERS * 2
    g = selfplay.load_games(npz)
    check_games(g, "shmeval")


def test_pipeline_argument_errors() -> None:
    codes, tf = exit_codes_in_a_fresh_interpreter([
        ["selfplay", "--pipeline", "0"],
        ["selfplay", "--pipeline", "5", "--games-per-worker", "16"],
        ["selfplay", "--pipeline", "2", "--compare", "--seconds", "1"],
        ["selfplay", "--pipeline", "2", "--mode", "queue", "--seconds", "1"],
        ["selfplay", "--pipeline", "2", "--ray"]])
    assert codes == [2, 2, 1, 1, 1]
    assert not tf
