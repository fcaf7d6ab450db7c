# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The hot part of :mod:`shmeval.games.connect4` in C: ``play``,
``terminal_value``, ``legal_moves`` and ``encode_many`` on the module's
bitboards (see its docstring for the layout).  The search calls the first
three once per new node and ``encode_many`` once per batch: in Python they
would be about half of a self-play worker's CPU outside the network.
:mod:`shmeval.games.connect4` exports them under its own names; the
positions stay its ``State`` named tuples.
"""
from cpython.number cimport PyNumber_Index

import numpy as np

ctypedef unsigned long long u64

cdef enum:
    ROWS = 6
    COLS = 7
    H = 7           # bits per column, with the sentinel
    CELLS = 42

cdef object _State = None
cdef object _tuple_new = tuple.__new__


def bind(state_class):
    """Sets the named-tuple class that :func:`play` builds (called once by
    :mod:`shmeval.games.connect4`)."""
    global _State
    _State = state_class


cdef inline bint _has_four(u64 b) noexcept:
    cdef u64 m = b & (b >> 7)          # horizontal
    if m & (m >> 14):
        return True
    m = b & (b >> 6)                   # diagonal going down to the right
    if m & (m >> 12):
        return True
    m = b & (b >> 8)                   # diagonal going up to the right
    if m & (m >> 16):
        return True
    m = b & (b >> 1)                   # vertical
    return (m & (m >> 2)) != 0


cdef inline u64 _top(Py_ssize_t c) noexcept:
    return (<u64>1) << (H * c + ROWS - 1)


def play(s, col):
    """The position after the player to move drops a stone into ``col``.

    Raises ``ValueError`` when ``col`` is not in 0..6, the column is full or
    the game is already over (``TypeError`` when ``col`` is not an integer;
    NumPy integers are fine).
    """
    idx = PyNumber_Index(col)
    if not 0 <= idx < COLS:
        raise ValueError(f"column {idx} out of range 0..{COLS - 1}")
    cdef Py_ssize_t c = idx
    cdef u64 cur = s[0], mask = s[1], new_mask, mover
    cdef long moves = s[2]
    if s[3] or moves == CELLS:
        raise ValueError("the game is over")
    if mask & _top(c):
        raise ValueError(f"column {c} is full")
    new_mask = mask | (mask + ((<u64>1) << (H * c)))
    mover = cur | (new_mask ^ mask)
    return _tuple_new(_State, (mover ^ new_mask, new_mask, moves + 1, _has_four(mover)))


def terminal_value(s):
    """The result from the view of the player to move: -1.0 lost, 0.0 draw,
    ``None`` while the game goes on.  (The player to move can never have
    won: only the player who just moved can complete a four.)"""
    if s[3]:
        return -1.0
    if s[2] == CELLS:
        return 0.0
    return None


def legal_moves(s):
    """The playable columns in increasing order; empty once the game is over."""
    cdef list out = []
    cdef u64 mask
    cdef Py_ssize_t c
    if s[3]:
        return out
    mask = s[1]
    for c in range(COLS):
        if not mask & _top(c):
            out.append(c)
    return out


cdef void _encode_into(float[:, :, :, ::1] o, Py_ssize_t i, u64 cur, u64 opp) noexcept:
    cdef Py_ssize_t r, c, bit
    for r in range(ROWS):
        for c in range(COLS):
            bit = H * c + ROWS - 1 - r
            o[i, r, c, 0] = <float>((cur >> bit) & 1)
            o[i, r, c, 1] = <float>((opp >> bit) & 1)


def encode_many(states, out=None):
    """Encodes ``states`` into ``out[:n]`` (``out`` of shape ``(m, 6, 7, 2)``,
    ``m >= n``, any float dtype; allocated as float32 when ``None``) and
    returns ``out[:n]``.  See :mod:`shmeval.games.connect4` for the layout."""
    cdef Py_ssize_t n = len(states), i
    cdef u64 cur
    cdef float[:, :, :, ::1] o
    if out is None:
        out = np.empty((n, ROWS, COLS, 2), dtype=np.float32)
    elif out.shape[1:] != (ROWS, COLS, 2) or out.shape[0] < n:
        raise ValueError(f"out has shape {out.shape}; expected (>= {n}, {ROWS}, {COLS}, 2)")
    rows = out[:n]
    if rows.dtype != np.float32 or not rows.flags.c_contiguous:
        rows[...] = encode_many(states)
        return rows
    o = rows
    for i in range(n):
        s = states[i]
        cur = s[0]
        _encode_into(o, i, cur, cur ^ <u64>s[1])
    return rows
