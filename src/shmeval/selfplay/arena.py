"""``shmeval selfplay --train --eval-every SECONDS``: is the net learning?

A process beside the workers plays matches of the current net (the
search of the workers, ``simulations`` per move, through the shmeval
evaluator, so each answer carries the weights' version) against a fixed
opponent: the same search with uniform priors and one random rollout as
each leaf's value.  Every ``eval_every`` seconds it plays ``eval_games``
games, the net first in half of them, and sends the result to the main
process."""
from __future__ import annotations

import random
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from .. import mcts
from .._util.children import child_setup
from ..games import connect4
from ..sched import use_batch_scheduling
from .settings import Settings
from .worker import ARENA_STOP, STOP

#: Moves of each game, from the start, drawn in proportion to the visit
#: counts instead of the most visited: two deterministic players would
#: otherwise play the same few games over and over.
OPENING_MOVES = 2
#: The id the arena's messages carry in place of a worker's.
ARENA = "arena"

#: Bit of each cell of an encoded state's planes (connect4's layout: row 0
#: the top row, column c owns bits 7c..7c+5 from the bottom).
_CELL_BITS = np.array([[1 << (7 * c + connect4.ROWS - 1 - r) for c in range(connect4.COLS)]
                       for r in range(connect4.ROWS)], dtype=np.uint64)


def decode_many(x: np.ndarray) -> List[connect4.State]:
    """The positions of encoded, unfinished states ``[n, 6, 7, 2]`` (the
    search sends only those to an evaluator)."""
    planes = x > 0.5
    cur = (planes[..., 0] * _CELL_BITS).sum(axis=(1, 2), dtype=np.uint64)
    opp = (planes[..., 1] * _CELL_BITS).sum(axis=(1, 2), dtype=np.uint64)
    stones = planes.sum(axis=(1, 2, 3))
    return [connect4.State(int(c), int(c) | int(o), int(n), False)
            for c, o, n in zip(cur, opp, stones)]


def rollout_value(s: connect4.State, rng: random.Random) -> float:
    """The result of one game played on from ``s`` with uniformly random
    moves, from the view of the player to move in ``s``."""
    sign = 1.0
    while (v := connect4.terminal_value(s)) is None:
        s = connect4.play(s, rng.choice(connect4.legal_moves(s)))
        sign = -sign
    return sign * v


def rollout_evaluator(rng: random.Random) -> mcts.EvaluateBatch:
    """The fixed opponent's evaluate_batch: uniform priors, one random
    rollout per leaf as its value."""
    uniform = mcts.uniform_model(connect4.N_ACTIONS)

    def evaluate_batch(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        policy, _ = uniform(x)
        return policy, np.array([rollout_value(s, rng) for s in decode_many(x)])

    return evaluate_batch


class VersionedNet:
    """The net's evaluate_batch through an shmeval handle, remembering the
    lowest and highest weights' version that answered."""

    def __init__(self, evaluator: Any) -> None:
        self.evaluator = evaluator
        self.versions: List[int] = []

    def __call__(self, x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        out, versions = self.evaluator.evaluate_many(x, return_version=True)
        self.versions += [int(versions.min()), int(versions.max())]
        return out["policy"], out["value"]


def play_match(net: mcts.EvaluateBatch, opponent: mcts.EvaluateBatch, s: Settings,
               games: int, rng: np.random.Generator,
               stopped: Callable[[], bool] = lambda: False) -> Dict[str, int]:
    """Plays ``games`` games of the net against the opponent, all at once,
    the net moving first in the even-numbered ones; returns the net's wins,
    draws and losses (an empty dict when ``stopped()`` turned true first)."""
    sides = [mcts.MCTS(connect4, net, c_puct=s.c_puct),
             mcts.MCTS(connect4, opponent, c_puct=s.c_puct)]
    states = [connect4.initial()] * games
    # The side (0 the net, 1 the opponent) that moves first in each game.
    first = [g % 2 for g in range(games)]
    while not all(connect4.is_terminal(st) for st in states):
        for side, search in enumerate(sides):
            if stopped():
                return {}
            turn = [g for g, st in enumerate(states) if not connect4.is_terminal(st)
                    and (connect4.to_move(st) == 0) == (first[g] == side)]
            if not turn:
                continue
            counts = search.search([search.new_tree(states[g]) for g in turn], s.simulations)
            for j, g in enumerate(turn):
                temp = 1.0 if states[g].moves < OPENING_MOVES else 0.0
                states[g] = connect4.play(states[g], mcts.select_move(counts[j], temp, rng))
    # connect4.winner: +1 when the first player won; the net is first when first[g] == 0.
    results = [(connect4.winner(st) or 0) * (1 if first[g] == 0 else -1)
               for g, st in enumerate(states)]
    return {"wins": results.count(1), "draws": results.count(0), "losses": results.count(-1)}


def arena_main(s: Settings, evaluator: Any, flags_raw: Any, out_q: Any, t_go: float) -> None:
    """The arena process: a match every ``s.eval_every`` seconds from
    ``t_go`` (the main process's ``time.monotonic()``, the same clock here)
    until the measured window ends (the arena stop flag) or the run
    stops.  Sends ("arena", "arena", result) after each
    match and ("error", "arena", traceback) if it fails."""
    child_setup()
    try:
        if s.worker_policy() == "batch":
            use_batch_scheduling()
        flags = np.frombuffer(flags_raw, dtype=np.int64)
        rng = np.random.default_rng([s.seed, 31])
        opponent = rollout_evaluator(random.Random(s.seed + 31))
        next_start = t_go
        while not (flags[STOP] or flags[ARENA_STOP]):
            if time.monotonic() < next_start:
                time.sleep(min(0.1, next_start - time.monotonic()))
                continue
            net = VersionedNet(evaluator)
            t0 = time.monotonic()
            result = play_match(net, opponent, s, s.eval_games, rng,
                                lambda: bool(flags[STOP] or flags[ARENA_STOP]))
            if not result:
                break
            out_q.put(("arena", ARENA, {
                "t_start_s": t0 - t_go, "t_s": time.monotonic() - t_go,
                "version_min": min(net.versions), "version_max": max(net.versions),
                "games": s.eval_games, **result,
                "score": (result["wins"] + 0.5 * result["draws"]) / s.eval_games}))
            next_start = t0 + s.eval_every
    except BaseException:
        out_q.put(("error", ARENA, traceback.format_exc()))
    finally:
        out_q.close()
        out_q.join_thread()
