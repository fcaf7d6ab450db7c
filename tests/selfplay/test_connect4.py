"""Connect Four rules on bitboards, checked against a naive array version."""
from __future__ import annotations

from typing import List, Optional, Set, Tuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmeval.games import connect4 as c4

# -- a naive reimplementation: 6x7 array, row 0 at the bottom, 1 = X, 2 = O --

DIRECTIONS = {"horizontal": (0, 1), "vertical": (1, 0), "diag_up": (1, 1), "diag_down": (-1, 1)}


class Naive:
    def __init__(self) -> None:
        self.board = np.zeros((6, 7), dtype=int)
        self.moves = 0

    def legal(self) -> List[int]:
        if self.fours():
            return []
        return [c for c in range(7) if self.board[5, c] == 0]

    def play(self, col: int) -> None:
        r = int(np.flatnonzero(self.board[:, col] == 0)[0])
        self.board[r, col] = 1 + self.moves % 2
        self.moves += 1

    def fours(self) -> Set[Tuple[int, str]]:
        """(player, direction) of every four on the board."""
        found = set()
        for r in range(6):
            for c in range(7):
                p = self.board[r, c]
                if not p:
                    continue
                for name, (dr, dc) in DIRECTIONS.items():
                    cells = [(r + k * dr, c + k * dc) for k in range(4)]
                    if all(0 <= rr < 6 and 0 <= cc < 7 and self.board[rr, cc] == p
                           for rr, cc in cells):
                        found.add((int(p), name))
        return found

    def winner(self) -> Optional[int]:
        players = {p for p, _ in self.fours()}
        assert len(players) <= 1
        if players:
            return 1 if players.pop() == 1 else -1
        return 0 if self.moves == 42 else None

    def encode(self) -> np.ndarray:
        me = 1 + self.moves % 2
        them = 3 - me
        top_first = self.board[::-1]
        return np.stack([top_first == me, top_first == them], axis=-1).astype(np.float32)


def naive_from(moves: List[int]) -> Naive:
    n = Naive()
    for m in moves:
        n.play(m)
    return n


def mirrored(moves: List[int]) -> List[int]:
    return [6 - m for m in moves]


# -- wins in every direction, for both players --

X_HORIZONTAL = [0, 0, 1, 1, 2, 2, 3]
O_HORIZONTAL = [6, 0, 6, 1, 5, 2, 6, 3]
X_VERTICAL = [0, 1, 0, 1, 0, 1, 0]
O_VERTICAL = [6, 0, 1, 0, 1, 0, 2, 0]
X_DIAG_UP = [0, 1, 1, 2, 2, 3, 2, 3, 3, 6, 3]
O_DIAG_UP = [6, 0, 1, 1, 2, 2, 3, 2, 3, 3, 5, 3]

WINS = [
    (X_HORIZONTAL, 1, "horizontal"), (O_HORIZONTAL, -1, "horizontal"),
    (mirrored(X_HORIZONTAL), 1, "horizontal"), (mirrored(O_HORIZONTAL), -1, "horizontal"),
    (X_VERTICAL, 1, "vertical"), (O_VERTICAL, -1, "vertical"),
    (mirrored(X_VERTICAL), 1, "vertical"), (mirrored(O_VERTICAL), -1, "vertical"),
    (X_DIAG_UP, 1, "diag_up"), (O_DIAG_UP, -1, "diag_up"),
    (mirrored(X_DIAG_UP), 1, "diag_down"), (mirrored(O_DIAG_UP), -1, "diag_down"),
    # lines elsewhere: right edge, and fours none of whose cells is in rows 0-1
    ([3, 3, 4, 4, 5, 5, 6], 1, "horizontal"),
    ([1, 0, 6, 0, 1, 6, 1, 1, 6, 1, 2, 2, 1, 5, 6, 6, 2, 2, 6, 2, 4, 3, 0, 3, 4, 2, 3], 1,
     "horizontal"),
    ([0, 2, 4, 4, 4, 1, 2, 5, 4, 3, 3, 3, 1, 3, 2, 3, 5, 3], -1, "vertical"),
    ([3, 2, 6, 1, 2, 5, 1, 6, 5, 0, 0, 3, 1, 2, 6, 3, 5, 2, 3, 6, 6, 4, 5, 3, 2, 5, 4, 4, 2, 6,
      5, 0, 1, 4], -1, "diag_up"),
    ([1, 2, 0, 4, 0, 2, 3, 6, 2, 1, 0, 0, 6, 4, 2, 2, 3, 1, 6, 6, 6, 6, 3, 3, 1, 3, 3, 0, 1, 5,
      0], 1, "diag_down"),
]


@pytest.mark.parametrize("moves,result,direction", WINS)
def test_wins(moves: List[int], result: int, direction: str) -> None:
    naive = naive_from(moves)
    assert {name for _, name in naive.fours()} == {direction}   # the test data is what it says
    assert naive.winner() == result
    s = c4.from_moves(moves[:-1])
    assert not c4.is_terminal(s) and c4.winner(s) is None and c4.terminal_value(s) is None
    s = c4.play(s, moves[-1])
    assert c4.is_terminal(s)
    assert s.last_move_won
    assert c4.winner(s) == result
    assert c4.terminal_value(s) == -1.0          # the player to move has lost
    assert c4.legal_moves(s) == []
    assert not c4.legal_mask(s).any()
    with pytest.raises(ValueError, match="over"):
        c4.play(s, 4 if moves[-1] != 4 else 5)
    assert ("X won" if result == 1 else "O won") in c4.render(s)


DRAW = [1, 4, 6, 6, 6, 0, 2, 0, 3, 6, 3, 3, 5, 3, 6, 1, 0, 3, 0, 4, 3, 5, 0, 6, 5, 2, 2, 5, 1,
        2, 2, 0, 2, 5, 4, 5, 4, 4, 4, 1, 1, 1]


def test_draw() -> None:
    assert naive_from(DRAW).fours() == set()
    s = c4.from_moves(DRAW[:-1])
    assert not c4.is_terminal(s) and c4.legal_moves(s) == [1]
    s = c4.play(s, 1)
    assert s.moves == 42 and not s.last_move_won
    assert c4.is_terminal(s)
    assert c4.terminal_value(s) == 0.0 and c4.winner(s) == 0
    assert c4.legal_moves(s) == [] and not c4.legal_mask(s).any()
    for col in range(7):
        with pytest.raises(ValueError):
            c4.play(s, col)
    assert "draw" in c4.render(s)


def test_illegal_moves() -> None:
    s = c4.initial()
    for bad in (-1, 7, 100, 10**30):
        with pytest.raises(ValueError, match="range"):
            c4.play(s, bad)
    with pytest.raises(TypeError):
        c4.play(s, 2.0)  # type: ignore[arg-type]
    s = c4.from_moves([3] * 6)
    assert not c4.is_terminal(s)
    with pytest.raises(ValueError, match="full"):
        c4.play(s, 3)
    assert c4.legal_moves(s) == [0, 1, 2, 4, 5, 6]
    assert c4.legal_mask(s).tolist() == [True, True, True, False, True, True, True]
    assert c4.play(s, np.int64(2)).moves == 7     # NumPy ints are fine
    over = c4.from_moves([0, 1, 0, 1, 0, 1, 0])
    with pytest.raises(ValueError, match="over"):
        c4.play(over, 2)
    assert c4.legal_moves(over) == [] and c4.terminal_value(over) == -1.0


def test_initial_and_constants() -> None:
    s = c4.initial()
    assert c4.legal_moves(s) == list(range(7)) and c4.legal_mask(s).all()
    assert c4.to_move(s) == 0 and c4.to_move(c4.play(s, 0)) == 1
    assert c4.INPUT_SHAPE == (6, 7, 2) and c4.N_ACTIONS == 7
    assert not c4.encode(s).any() and c4.encode(s).dtype == np.float32
    # states are values
    assert c4.from_moves([3, 4]) == c4.from_moves([3, 4]) != c4.from_moves([4, 3])
    assert len({c4.from_moves([3, 4]), c4.from_moves([3, 4])}) == 1


def test_encode_perspective() -> None:
    s = c4.from_moves([3])             # X in the bottom middle, O to move
    x = c4.encode(s)
    assert x.shape == (6, 7, 2)
    assert x[..., 0].sum() == 0        # O (to move) has no stones
    assert x[5, 3, 1] == 1 and x[..., 1].sum() == 1   # X's stone: bottom row (last), column 3
    s = c4.play(s, 3)                  # O on top of it, X to move
    x = c4.encode(s)
    assert x[5, 3, 0] == 1 and x[4, 3, 1] == 1 and x.sum() == 2


def test_encode_many_into_buffer() -> None:
    states = [c4.from_moves(m) for m in ([], [0], [0, 6], X_DIAG_UP[:-1])]
    buf = np.full((8, 6, 7, 2), 7.0, np.float32)
    out = c4.encode_many(states, buf)
    assert out.shape == (4, 6, 7, 2) and np.shares_memory(out, buf)
    for i, s in enumerate(states):
        np.testing.assert_array_equal(buf[i], c4.encode(s))
    assert (buf[4:] == 7.0).all()      # rows past n untouched
    with pytest.raises(ValueError):
        c4.encode_many(states, np.empty((3, 6, 7, 2), np.float32))
    assert c4.encode_many([]).shape == (0, 6, 7, 2)
    # other dtypes and strided buffers take the general path, same values
    wide = np.zeros((4, 6, 7, 2), np.float64)
    strided = np.zeros((8, 6, 7, 2), np.float32)[::2]
    for other in (wide, strided):
        got = c4.encode_many(states, other)
        assert got.dtype == other.dtype and np.shares_memory(got, other)
        np.testing.assert_array_equal(got, buf[:4])
    # a strided buffer whose first row alone is contiguous takes the fast path
    np.testing.assert_array_equal(c4.encode_many(states[:1], strided), buf[:1])


def test_mirror() -> None:
    s = c4.from_moves([0, 1, 1, 5, 6, 6, 6])
    m = c4.mirror_state(s)
    assert m == c4.from_moves([6, 5, 5, 1, 0, 0, 0])
    assert c4.mirror_state(m) == s
    x = c4.encode(s)
    np.testing.assert_array_equal(c4.mirror(x), c4.encode(m))
    np.testing.assert_array_equal(c4.mirror(c4.mirror(x)), x)
    batch = c4.encode_many([s, m])
    np.testing.assert_array_equal(c4.mirror(batch), c4.encode_many([m, s]))
    p = np.arange(7, dtype=np.float32)
    assert c4.mirror_policy(p).tolist() == [6, 5, 4, 3, 2, 1, 0]
    pb = np.stack([p, p * 2])
    np.testing.assert_array_equal(c4.mirror_policy(pb), pb[:, ::-1])
    # legal moves mirror too
    full = c4.from_moves([1] * 6)
    assert c4.legal_mask(c4.mirror_state(full)).tolist() == c4.mirror_policy(
        c4.legal_mask(full)).tolist()


def test_render() -> None:
    text = c4.render(c4.from_moves([3, 3, 4]))
    lines = text.splitlines()
    assert lines[5] == ". . . X X . ."
    assert lines[4] == ". . . O . . ."
    assert lines[6] == "0 1 2 3 4 5 6"
    assert lines[7] == "O to move"


# -- property-based: random legal games against the naive version --

@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 6), max_size=60), st.booleans())
def test_random_games_match_naive(choices: List[int], mirror: bool) -> None:
    s = c4.initial()
    naive = Naive()
    for k in choices:
        legal = c4.legal_moves(s)
        assert legal == naive.legal()
        assert c4.legal_mask(s).tolist() == [c in legal for c in range(7)]
        np.testing.assert_array_equal(c4.encode(s), naive.encode())
        assert c4.winner(s) == naive.winner()
        if not legal:
            break
        col = legal[k % len(legal)]
        s = c4.play(s, col)
        naive.play(col)
        assert s.mask.bit_count() == s.moves == naive.moves
        assert c4.is_terminal(s) == (naive.winner() is not None)
        if mirror:
            ms = c4.mirror_state(s)
            np.testing.assert_array_equal(c4.encode(ms), c4.mirror(c4.encode(s)))
            assert c4.winner(ms) == c4.winner(s)
    assert c4.winner(s) == naive.winner()
    if c4.is_terminal(s):
        assert not naive.legal()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.integers(0, 6), max_size=42), min_size=1, max_size=12))
def test_encode_many_matches_encode(games: List[List[int]]) -> None:
    states = []
    for choices in games:
        s = c4.initial()
        for k in choices:
            legal = c4.legal_moves(s)
            if not legal:
                break
            s = c4.play(s, legal[k % len(legal)])
        states.append(s)
    batch = c4.encode_many(states)
    assert batch.dtype == np.float32
    for i, s in enumerate(states):
        np.testing.assert_array_equal(batch[i], c4.encode(s))
        # the two planes never overlap and hold all stones
        assert not (batch[i, ..., 0] * batch[i, ..., 1]).any()
        assert batch[i].sum() == s.moves
