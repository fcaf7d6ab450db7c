"""``shmeval selfplay``'s record of progress: the per-second time series of
``--json`` and the arena of ``--train --eval-every``, which plays the net
against a plain MCTS with uniform priors and random rollouts.

In-process, without TensorFlow: encoded states decode to their positions,
a rollout scores from the view of the player to move, a match counts each
game for the right side, the time series differences its snapshots.
:func:`check_training_run` checks a short ``--train --eval-every`` run
through the CLI (test_selfplay's training run): the JSON holds the series
and the matches, the status line and the summary the win rate, and
``shmeval plot`` draws it."""
from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shmeval import mcts
from shmeval.games import connect4 as c4
from shmeval.selfplay.arena import decode_many, play_match, rollout_evaluator, rollout_value
from shmeval.selfplay.series import COLUMNS, TimeSeries
from shmeval.selfplay.settings import Settings



def random_positions(n: int, seed: int) -> list[c4.State]:
    """Unfinished positions after random moves."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        s = c4.initial()
        for _ in range(rng.randrange(40)):
            nxt = c4.play(s, rng.choice(c4.legal_moves(s)))
            if c4.is_terminal(nxt):
                break
            s = nxt
        out.append(s)
    return out


def test_encoded_states_decode_to_their_positions() -> None:
    states = random_positions(300, seed=1)
    assert decode_many(c4.encode_many(states)) == states


def test_a_rollout_scores_for_the_player_to_move() -> None:
    rng = random.Random(3)
    # Random play favours the first player: positive from X's view at the
    # start, negative from O's view after X's move in the centre.
    start = [rollout_value(c4.initial(), rng) for _ in range(3000)]
    after = [rollout_value(c4.play(c4.initial(), 3), rng) for _ in range(3000)]
    assert set(start) <= {-1.0, 0.0, 1.0}
    assert statistics.fmean(start) > 0.05 and statistics.fmean(after) < -0.05


def test_a_match_counts_each_game_for_the_right_side() -> None:
    s = Settings(simulations=16)
    uniform = mcts.uniform_model(c4.N_ACTIONS)
    rollouts = rollout_evaluator(random.Random(5))
    weak = play_match(uniform, rollouts, s, 10, np.random.default_rng(0))
    strong = play_match(rollouts, uniform, s, 10, np.random.default_rng(0))
    for r in (weak, strong):
        assert r["wins"] + r["draws"] + r["losses"] == 10
    assert strong["wins"] > strong["losses"] and weak["losses"] > weak["wins"]
    assert play_match(uniform, rollouts, s, 4, np.random.default_rng(0), lambda: True) == {}


def test_the_time_series_is_the_change_over_each_second() -> None:
    snap = {"t": 10.0, "moves": 0, "evals": 0, "games": 0, "model_version": 0}
    ts = TimeSeries(snap)
    assert not ts.due(10.5) and ts.due(11.0)
    ts.add({**snap, "t": 11.0, "moves": 50, "evals": 800, "games": 2}, 25.0, None, 100)
    ts.add({**snap, "t": 13.0, "moves": 150, "evals": 2800, "games": 4, "model_version": 3},
           30.0, 2.5, 300)
    cols = ts.to_json()
    assert list(cols) == list(COLUMNS)
    assert cols["t_s"] == [1.0, 3.0] and cols["moves_per_s"] == [50.0, 50.0]
    assert cols["evals_per_s"] == [800.0, 1000.0] and cols["games_per_s"] == [2.0, 1.0]
    assert cols["model_version"] == [0, 3] and cols["loss"] == [None, 2.5]


def test_eval_every_needs_train() -> None:
    with pytest.raises(ValueError, match="--eval-every"):
        Settings(eval_every=5).check()
    Settings(eval_every=5, train=True).check()


def check_training_run(js: Path, stdout: str) -> None:
    """What a ``--train --eval-every`` run records: the per-second series,
    the matches against the rollout MCTS, and ``shmeval plot`` of it.
    Called by test_selfplay's training run (one run serves both)."""
    result = json.loads(js.read_text())["modes"]["shmeval"]
    series = result["series"]
    n = len(series["t_s"])
    assert n >= 3 and all(len(series[c]) == n for c in COLUMNS)
    assert series["t_s"] == sorted(series["t_s"])
    assert all(v >= 0 for v in series["model_version"])
    matches = result["win_rate"]
    assert matches, stdout
    for m in matches:
        assert m["games"] == 2 and m["wins"] + m["draws"] + m["losses"] == 2
        assert m["score"] == (m["wins"] + 0.5 * m["draws"]) / 2
        assert 0 <= m["version_min"] <= m["version_max"]
        assert m["t_start_s"] < m["t_s"] <= series["t_s"][-1] + 1.0
    assert "win rate" in stdout and "arena: " in stdout
    p = subprocess.run([sys.executable, "-m", "shmeval", "plot", str(js)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "score vs rollout MCTS" in p.stdout and js.with_suffix(".png").exists()
