"""Finished self-play games: :class:`GameStore` collects them as the
workers send them (each checked by replaying it), :class:`Games` holds them
as arrays, :func:`save_games` and :func:`load_games` write and read them as
an ``.npz`` (``shmeval selfplay --games``)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..games import connect4

GAMES_FORMAT = "shmeval-selfplay-games/1"


def replay_game(moves: Sequence[int]) -> Tuple[np.ndarray, np.ndarray, int]:
    """Plays ``moves`` from the empty board.  Returns the encoded state before
    each move (``uint8 [m, 6, 7, 2]``), the outcome of each of those states
    from the view of its player to move (``int8 [m]``: +1 won, -1 lost, 0
    draw) and the winner (+1 first player, -1 second, 0 draw).  Raises
    ``ValueError`` for an illegal move or a game that is not over."""
    s = connect4.initial()
    states = []
    for a in moves:
        states.append(s)
        s = connect4.play(s, int(a))
    w = connect4.winner(s)
    if w is None:
        raise ValueError(f"the game {list(moves)} is not over")
    enc = connect4.encode_many(states).astype(np.uint8) if states else np.zeros(
        (0,) + connect4.INPUT_SHAPE, np.uint8)
    sign = np.where(np.arange(len(states)) % 2 == 0, 1, -1)
    return enc, (sign * w).astype(np.int8), int(w)


@dataclass
class Games:
    """Self-play games as arrays, one row per position (sample).

    Per sample: ``states`` (float32 ``[n, 6, 7, 2]``, the encoding of
    :func:`shmeval.games.connect4.encode`), ``policies`` (float32 ``[n, 7]``,
    the search's visit-count distribution, sums to 1), ``outcomes`` (float32
    ``[n]``, the game's result from the view of the player to move: +1, 0,
    -1), ``moves`` (int8, the move played), ``game`` (int32, index of its
    game), ``ply`` (int16).  Per game: ``offsets`` (int64 ``[g + 1]``: game
    ``i`` is rows ``offsets[i]:offsets[i + 1]``), ``winner`` (int8: +1 first
    player, -1 second, 0 draw), ``worker`` (int16), ``mode`` (str).
    ``meta``: the settings of the run(s) that played them.  Mirrored copies
    are never stored; augmentation happens when sampling
    (:class:`ReplayBuffer`)."""

    states: np.ndarray
    policies: np.ndarray
    outcomes: np.ndarray
    moves: np.ndarray
    game: np.ndarray
    ply: np.ndarray
    offsets: np.ndarray
    winner: np.ndarray
    worker: np.ndarray
    mode: np.ndarray
    meta: Dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(len(self.outcomes))

    @property
    def n_games(self) -> int:
        return int(len(self.winner))

    def game_moves(self, i: int) -> List[int]:
        """The moves of game ``i``."""
        return [int(a) for a in self.moves[self.offsets[i]:self.offsets[i + 1]]]


class GameStore:
    """Collects finished games as they arrive from the workers."""

    def __init__(self) -> None:
        self.states: List[np.ndarray] = []
        self.policies: List[np.ndarray] = []
        self.outcomes: List[np.ndarray] = []
        self.moves: List[np.ndarray] = []
        self.winner: List[int] = []
        self.worker: List[int] = []
        self.mode: List[str] = []

    def __len__(self) -> int:
        return len(self.winner)

    def add(self, mode: str, worker: int, moves: Sequence[int], policies: np.ndarray
            ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Checks a game a worker sent and keeps it; returns its samples
        (states uint8, policies float32, outcomes int8)."""
        mv = np.asarray(moves, dtype=np.int8)
        pol = np.asarray(policies, dtype=np.float32)
        if pol.shape != (len(mv), connect4.N_ACTIONS):
            raise ValueError(f"a game of {len(mv)} moves came with policies of shape {pol.shape}")
        states, outcomes, w = replay_game(mv.tolist())
        self.states.append(states)
        self.policies.append(pol)
        self.outcomes.append(outcomes)
        self.moves.append(mv)
        self.winner.append(w)
        self.worker.append(worker)
        self.mode.append(mode)
        return states, pol, outcomes

    def to_games(self, meta: Optional[Dict[str, Any]] = None) -> Games:
        lengths = [len(m) for m in self.moves]
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])

        def cat(parts: List[np.ndarray], shape: Tuple[int, ...], dtype: Any) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros((0,) + shape, dtype)

        return Games(
            states=cat(self.states, connect4.INPUT_SHAPE, np.uint8).astype(np.float32),
            policies=cat(self.policies, (connect4.N_ACTIONS,), np.float32),
            outcomes=cat(self.outcomes, (), np.int8).astype(np.float32),
            moves=cat(self.moves, (), np.int8),
            game=np.repeat(np.arange(len(lengths), dtype=np.int32), lengths),
            ply=np.concatenate([np.arange(n, dtype=np.int16) for n in lengths]) if lengths
            else np.zeros(0, np.int16),
            offsets=offsets,
            winner=np.asarray(self.winner, np.int8),
            worker=np.asarray(self.worker, np.int16),
            mode=np.asarray(self.mode, dtype=str) if self.mode else np.zeros(0, dtype="<U1"),
            meta=dict(meta or {}))


def save_games(path: str, games: Games) -> None:
    """Writes ``games`` to ``path`` (an ``.npz``; states stored as uint8)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    np.savez_compressed(
        path, format=np.array(GAMES_FORMAT),
        states=games.states.astype(np.uint8), policies=games.policies.astype(np.float32),
        outcomes=games.outcomes.astype(np.int8), moves=games.moves.astype(np.int8),
        game=games.game.astype(np.int32), ply=games.ply.astype(np.int16),
        offsets=games.offsets.astype(np.int64), winner=games.winner.astype(np.int8),
        worker=games.worker.astype(np.int16), mode=np.asarray(games.mode, dtype=str),
        meta=np.array(json.dumps(games.meta, default=str)))


def load_games(path: str) -> Games:
    """Reads games written by :func:`save_games` (``shmeval selfplay --games``)
    and checks that they are consistent: shapes, offsets, policies summing to
    1, outcomes in {-1, 0, 1} and matching the winners.  Raises
    ``ValueError`` when they are not."""
    with np.load(path, allow_pickle=False) as z:
        files = set(z.files)
        need = {"format", "states", "policies", "outcomes", "moves", "game", "ply", "offsets",
                "winner", "worker", "mode", "meta"}
        if not need <= files:
            raise ValueError(f"{path}: not a self-play games file (missing {sorted(need - files)})")
        if str(z["format"]) != GAMES_FORMAT:
            raise ValueError(f"{path}: format {str(z['format'])!r}, expected {GAMES_FORMAT!r}")
        g = Games(states=z["states"].astype(np.float32), policies=z["policies"].astype(np.float32),
                  outcomes=z["outcomes"].astype(np.float32), moves=z["moves"].astype(np.int8),
                  game=z["game"].astype(np.int32), ply=z["ply"].astype(np.int16),
                  offsets=z["offsets"].astype(np.int64), winner=z["winner"].astype(np.int8),
                  worker=z["worker"].astype(np.int16), mode=z["mode"].astype(str),
                  meta=json.loads(str(z["meta"])))
    n, k = len(g.outcomes), g.n_games
    problems = []
    if g.states.shape != (n,) + connect4.INPUT_SHAPE:
        problems.append(f"states have shape {g.states.shape}")
    if g.policies.shape != (n, connect4.N_ACTIONS):
        problems.append(f"policies have shape {g.policies.shape}")
    for name in ("moves", "game", "ply"):
        if getattr(g, name).shape != (n,):
            problems.append(f"{name} has shape {getattr(g, name).shape}, expected ({n},)")
    for name in ("worker", "mode"):
        if getattr(g, name).shape != (k,):
            problems.append(f"{name} has shape {getattr(g, name).shape}, expected ({k},)")
    off = g.offsets
    if off.shape != (k + 1,) or off[0] != 0 or off[-1] != n or np.any(np.diff(off) < 1):
        problems.append("offsets do not split the samples into non-empty games")
    if not problems:
        lengths = np.diff(off)
        if not np.array_equal(g.game, np.repeat(np.arange(k), lengths)):
            problems.append("per-sample game indices disagree with the offsets")
        if not np.array_equal(g.ply, np.arange(n) - np.repeat(off[:-1], lengths)):
            problems.append("per-sample plies disagree with the offsets")
        if not np.isin(g.outcomes, (-1.0, 0.0, 1.0)).all():
            problems.append("outcomes outside {-1, 0, 1}")
        sign = np.where(g.ply % 2 == 0, 1, -1)
        if n and not np.array_equal(g.outcomes, sign * g.winner[g.game]):
            problems.append("outcomes disagree with the winners")
        if n and (np.any(g.policies < 0) or not np.allclose(g.policies.sum(axis=1), 1.0, atol=1e-4)):
            problems.append("policies are not probability distributions")
        if n and not np.isin(g.states, (0.0, 1.0)).all():
            problems.append("states hold values other than 0 and 1")
    if problems:
        raise ValueError(f"{path}: inconsistent games file: {'; '.join(problems)}")
    return g
