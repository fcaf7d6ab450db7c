"""Connect Four (6 rows x 7 columns) on bitboards.

A position is a :class:`State`, an immutable named tuple of two Python ints
and two small fields, so copying one is free and playing a move builds a new
one in about a microsecond.

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

import operator
from typing import Iterable, List, NamedTuple, Optional, Sequence, SupportsIndex

import numpy as np

ROWS = 6
COLS = 7
N_ACTIONS = 7
INPUT_SHAPE = (6, 7, 2)

_H = ROWS + 1                      # bits per column, with the sentinel
_BOTTOM = [1 << (_H * c) for c in range(COLS)]
_TOP = [1 << (_H * c + ROWS - 1) for c in range(COLS)]
_COLUMN = [((1 << ROWS) - 1) << (_H * c) for c in range(COLS)]
_CELLS = ROWS * COLS
_TOP_ALL = sum(_TOP)
# the playable columns for each combination of full columns (key: their top bits)
_LEGAL_BY_TOP = {sum(_TOP[c] for c in range(COLS) if full >> c & 1):
                 tuple(c for c in range(COLS) if not full >> c & 1)
                 for full in range(1 << COLS)}
# the bit of each encoded cell: [row from the top, column, plane]
_CELL_BITS = np.array([[[_H * c + ROWS - 1 - r] for c in range(COLS)] for r in range(ROWS)],
                      dtype=np.uint64)


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


def initial() -> State:
    """The empty board, first player to move."""
    return _INITIAL


def _has_four(b: int) -> bool:
    """Whether bitboard ``b`` holds four in a row in any direction."""
    m = b & (b >> 7)               # horizontal
    if m & (m >> 14):
        return True
    m = b & (b >> 6)               # diagonal going down to the right
    if m & (m >> 12):
        return True
    m = b & (b >> 8)               # diagonal going up to the right
    if m & (m >> 16):
        return True
    m = b & (b >> 1)               # vertical
    return bool(m & (m >> 2))


def is_terminal(s: State) -> bool:
    """Whether the game is over (a four was connected or the board is full)."""
    return s.last_move_won or s.moves == _CELLS


def terminal_value(s: State) -> Optional[float]:
    """The result from the view of the player to move: -1.0 lost, 0.0 draw,
    ``None`` while the game goes on.  (The player to move can never have
    won: only the player who just moved can complete a four.)"""
    if s.last_move_won:
        return -1.0
    if s.moves == _CELLS:
        return 0.0
    return None


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


def legal_moves(s: State) -> List[int]:
    """The playable columns in increasing order; empty once the game is over."""
    if s.last_move_won:
        return []
    return list(_LEGAL_BY_TOP[s.mask & _TOP_ALL])


def legal_mask(s: State) -> np.ndarray:
    """Boolean ``(7,)`` array, True for each playable column (all False once
    the game is over)."""
    out = np.zeros(COLS, dtype=bool)
    out[legal_moves(s)] = True
    return out


def play(s: State, col: SupportsIndex) -> State:
    """The position after the player to move drops a stone into ``col``.

    Raises ``ValueError`` when ``col`` is not in 0..6, the column is full or
    the game is already over (``TypeError`` when ``col`` is not an integer;
    NumPy integers are fine).
    """
    c = operator.index(col)
    if not 0 <= c < COLS:
        raise ValueError(f"column {c} out of range 0..{COLS - 1}")
    if s.last_move_won or s.moves == _CELLS:
        raise ValueError("the game is over")
    mask = s.mask
    if mask & _TOP[c]:
        raise ValueError(f"column {c} is full")
    new_mask = mask | (mask + _BOTTOM[c])
    mover = s.cur | (new_mask ^ mask)
    return State(mover ^ new_mask, new_mask, s.moves + 1, _has_four(mover))


def from_moves(cols: Iterable[int], start: Optional[State] = None) -> State:
    """Plays ``cols`` in turn from ``start`` (default: the empty board)."""
    s = _INITIAL if start is None else start
    for c in cols:
        s = play(s, c)
    return s


def encode_many(states: Sequence[State], out: Optional[np.ndarray] = None) -> np.ndarray:
    """Encodes ``states`` into ``out[:n]`` (``out`` of shape ``(m, 6, 7, 2)``,
    ``m >= n``, any float dtype; allocated as float32 when ``None``) and
    returns ``out[:n]``.  See the module docstring for the layout."""
    n = len(states)
    if out is None:
        out = np.empty((n,) + INPUT_SHAPE, dtype=np.float32)
    elif out.shape[1:] != INPUT_SHAPE or out.shape[0] < n:
        raise ValueError(f"out has shape {out.shape}; expected (>= {n}, 6, 7, 2)")
    boards = np.array([(s.cur, s.cur ^ s.mask) for s in states], dtype=np.uint64)
    # (n, 1, 1, 2 planes) >> (6, 7, 1) -> (n, 6, 7, 2): one bit per cell and plane
    out[:n] = (boards.reshape(n, 1, 1, 2) >> _CELL_BITS) & np.uint64(1)
    return out[:n]


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
