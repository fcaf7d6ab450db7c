"""Connect Four (6 rows x 7 columns) on bitboards.

A position is a :class:`State`, an immutable named tuple of two Python ints
and two small fields, so copying one is free and playing a move builds a new
one in a fraction of a microsecond.

The functions the search calls most (:func:`play`, :func:`terminal_value`,
:func:`legal_moves`, :func:`encode_many`) are written in Cython
(``shmeval.games._connect4``, the same bitboard arithmetic); the rest is
Python.

Bitboard layout
---------------
Column ``c`` (0..6, left to right) owns bits ``7*c .. 7*c+6``; bit ``7*c+r``
is row ``r`` counted from the bottom (0..5).  Bit ``7*c+6`` of every column
is a sentinel that is always 0, so a shift by 1 (vertical), 7 (horizontal),
6 or 8 (the two diagonals) never carries a line from one column into the
next.  ``State.cur`` holds the stones of the player to move, ``State.mask``
all stones; the opponent's stones are ``mask ^ cur``.

Players and values
------------------
The first player is "X", the second "O".  Every value here is from the view
of the player to move unless a name says otherwise: :func:`terminal_value`
is -1.0 when the player to move has lost (the previous move connected four),
0.0 for a draw (full board, no four), ``None`` while the game goes on.
:func:`winner` is the absolute result (+1 first player won, -1 second, 0
draw, ``None`` not over).

Encoding
--------
:func:`encode` gives a ``(6, 7, 2)`` float32 array: ``[row, col, plane]``
with row 0 the *top* row (as :func:`render` prints it), plane 0 the stones
of the player to move and plane 1 the opponent's.  :func:`encode_many`
writes a batch into a preallocated ``(n, 6, 7, 2)`` array.  The board's only
symmetry is the left-right reflection: :func:`mirror` for encoded states (one
or a batch), :func:`mirror_policy` for policy vectors, :func:`mirror_state`
for positions.

This module provides the game interface that :mod:`shmeval.mcts` searches
(:class:`shmeval.mcts.Game`): pass the module itself.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple, Optional

import numpy as np

from . import _connect4 as _c4
from ._connect4 import encode_many, legal_moves, play, terminal_value

__all__ = ["ROWS", "COLS", "N_ACTIONS", "INPUT_SHAPE", "State", "initial", "play", "legal_moves",
           "legal_mask", "terminal_value", "is_terminal", "winner", "to_move", "from_moves",
           "encode", "encode_many", "mirror", "mirror_policy", "mirror_state", "render"]

ROWS = 6
COLS = 7
N_ACTIONS = 7
INPUT_SHAPE = (6, 7, 2)

_H = ROWS + 1                      # bits per column, with the sentinel
_CELLS = ROWS * COLS


class State(NamedTuple):
    """A Connect Four position (immutable; compare and hash by value).

    ``cur``: bitboard of the player to move.  ``mask``: bitboard of all
    stones.  ``moves``: stones on the board (the first player moves when it
    is even).  ``last_move_won``: the previous move connected four, so the
    player to move has lost and the game is over.
    """

    cur: int
    mask: int
    moves: int
    last_move_won: bool


_INITIAL = State(0, 0, 0, False)

# play, terminal_value, legal_moves and encode_many run in C (_connect4.pyx);
# they build and read this module's State
_c4.bind(State)


def initial() -> State:
    """The empty board, first player to move."""
    return _INITIAL


def is_terminal(s: State) -> bool:
    """Whether the game is over (a four was connected or the board is full)."""
    return s.last_move_won or s.moves == _CELLS


def winner(s: State) -> Optional[int]:
    """The absolute result: +1 the first player (X) won, -1 the second (O)
    won, 0 draw, ``None`` while the game goes on."""
    if s.last_move_won:
        return 1 if s.moves % 2 == 1 else -1
    if s.moves == _CELLS:
        return 0
    return None


def to_move(s: State) -> int:
    """0 when the first player (X) is to move, 1 for the second (O)."""
    return s.moves & 1


def legal_mask(s: State) -> np.ndarray:
    """Boolean ``(7,)`` array, True for each playable column (all False once
    the game is over)."""
    out = np.zeros(COLS, dtype=bool)
    out[legal_moves(s)] = True
    return out


def from_moves(cols: Iterable[int], start: Optional[State] = None) -> State:
    """Plays ``cols`` in turn from ``start`` (default: the empty board)."""
    s = _INITIAL if start is None else start
    for c in cols:
        s = play(s, c)
    return s


def encode(s: State) -> np.ndarray:
    """``(6, 7, 2)`` float32: plane 0 the player to move, plane 1 the
    opponent, row 0 the top row."""
    out: np.ndarray = encode_many([s])[0]
    return out


def mirror(x: np.ndarray) -> np.ndarray:
    """Left-right reflection of an encoded state ``(..., 6, 7, 2)`` (one or a
    batch); returns a view."""
    return x[..., ::-1, :]


def mirror_policy(p: np.ndarray) -> np.ndarray:
    """Left-right reflection of policy vectors ``(..., 7)``; returns a view."""
    return p[..., ::-1]


def _mirror_board(b: int) -> int:
    out = 0
    for c in range(COLS):
        out |= ((b >> (_H * c)) & 0x3F) << (_H * (COLS - 1 - c))
    return out


def mirror_state(s: State) -> State:
    """The left-right reflected position (same player to move, same result)."""
    return State(_mirror_board(s.cur), _mirror_board(s.mask), s.moves, s.last_move_won)


def render(s: State) -> str:
    """Text picture: X first player, O second, '.' empty; top row first,
    column numbers underneath, then whose move it is or the result."""
    if s.moves % 2 == 0:
        x, o = s.cur, s.cur ^ s.mask
    else:
        x, o = s.cur ^ s.mask, s.cur
    lines = []
    for r in range(ROWS - 1, -1, -1):
        row = []
        for c in range(COLS):
            bit = 1 << (_H * c + r)
            row.append("X" if x & bit else "O" if o & bit else ".")
        lines.append(" ".join(row))
    lines.append(" ".join(str(c) for c in range(COLS)))
    w = winner(s)
    if w is None:
        lines.append(f"{'XO'[to_move(s)]} to move")
    else:
        lines.append({1: "X won", -1: "O won", 0: "draw"}[w])
    return "\n".join(lines)
