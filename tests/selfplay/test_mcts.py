"""PUCT search: tactics with a null model, batching across games, root
noise, temperature, self-play records, and the shmeval adapter."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmeval import mcts
from shmeval.mcts._tree import Tree
from shmeval.games import connect4 as c4
from shmeval.games.connect4 import State


class CountingModel:
    """Wraps a model function and records the size of every batch."""

    def __init__(self, policy: Optional[np.ndarray] = None,
                 value_of: Optional[Dict[State, float]] = None) -> None:
        self.policy = np.full(7, 1 / 7) if policy is None else policy
        self.value_of = value_of or {}
        self.batches: List[int] = []
        self._lookup: Dict[bytes, float] = {
            c4.encode(s).tobytes(): v for s, v in self.value_of.items()}

    def __call__(self, states: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        assert states.dtype == np.float32 and states.shape[1:] == (6, 7, 2)
        n = len(states)
        self.batches.append(n)
        values = np.array([self._lookup.get(x.tobytes(), 0.0) for x in states])
        return np.tile(self.policy, (n, 1)), values


def immediate_wins(s: State) -> List[int]:
    return [m for m in c4.legal_moves(s) if c4.play(s, m).last_move_won]


def opponent_threats(s: State) -> List[int]:
    """Columns where the opponent would win if it were its move."""
    return immediate_wins(State(s.cur ^ s.mask, s.mask, s.moves + 1, False))


# (moves, the winning column): the player to move wins at once
WIN_POSITIONS = [
    ([0, 0, 1, 1, 2, 2], 3),                             # X, horizontal
    ([6, 0, 6, 1, 5, 2, 6], 3),                          # O, horizontal
    ([0, 1, 0, 1, 0, 1], 0),                             # X, vertical (O threatens 1 too)
    ([0, 1, 1, 2, 2, 3, 2, 3, 3, 6], 3),                 # X, diagonal /
    ([6, 5, 5, 4, 4, 3, 4, 3, 3, 0], 3),                 # X, diagonal \
    ([6, 0, 1, 1, 2, 2, 3, 2, 3, 3, 5], 3),              # O, diagonal / (X threatens 4)
]
# (moves, the only move that stops the opponent's immediate win)
BLOCK_POSITIONS = [
    ([0, 6, 1, 6, 2], 3),                                # horizontal
    ([3, 0, 3, 0, 3], 3),                                # vertical
    ([5, 3, 2, 4, 4, 2, 1, 2, 1, 2], 2),                 # vertical, X blocks O
    ([0, 4, 4, 3, 0, 4, 0, 2, 1, 2, 6, 4, 3, 6, 6, 0], 5),   # horizontal
    ([3, 1, 5, 2, 2, 4, 2, 3, 0, 0, 6, 3, 3, 3, 3, 2, 0], 1),  # diagonal /
    ([0, 2, 1, 2, 2, 6, 4, 1, 0, 5, 6, 3, 3, 3, 5, 4], 2),     # diagonal \
]


def test_positions_are_what_they_claim() -> None:
    for moves, col in WIN_POSITIONS:
        assert col in immediate_wins(c4.from_moves(moves))
    for moves, col in BLOCK_POSITIONS:
        s = c4.from_moves(moves)
        assert immediate_wins(s) == [] and opponent_threats(s) == [col]
        assert immediate_wins(c4.play(s, col)) == []       # blocking does not lose at once
        for other in c4.legal_moves(s):
            if other != col:
                assert col in immediate_wins(c4.play(s, other))


@pytest.mark.parametrize("simulations", [200, 400])
def test_finds_wins_and_blocks_searched_together(simulations: int) -> None:
    positions = WIN_POSITIONS + BLOCK_POSITIONS
    model = CountingModel()
    counts = mcts.search_many(c4, [c4.from_moves(m) for m, _ in positions], model,
                              simulations, np.random.default_rng(0))
    assert counts.shape == (len(positions), 7)
    assert (counts.sum(axis=1) == simulations).all()
    best = counts.argmax(axis=1).tolist()
    assert best == [col for _, col in positions], counts
    # one call per step for all trees (plus one for the roots), several leaves per call
    assert len(model.batches) <= simulations + 1
    assert model.batches[0] == len(positions)
    assert max(model.batches) == len(positions)
    assert np.mean(model.batches) > 3


def test_value_sign_of_network_values() -> None:
    """The network says the position after column 5 is lost for the player
    to move there (the opponent): the search must prefer column 5; and the
    position after column 1 won for the opponent: avoid it."""
    root = c4.from_moves([3, 3])
    model = CountingModel(value_of={c4.play(root, 5): -1.0, c4.play(root, 1): 1.0})
    m = mcts.MCTS(c4, model)
    t = m.new_tree(root)
    counts = m.search([t], 100)[0]
    assert counts.argmax() == 5
    assert counts[1] == counts.min()
    q = t.root_q(7)
    # the deeper, value-0 nodes dilute the +-1 of these two edges
    assert q[5] == np.nanmax(q) and q[5] > 0 > q[1] == np.nanmin(q)


def test_visit_counts_sum_and_tree_reuse() -> None:
    m = mcts.MCTS(c4, CountingModel())
    trees = [m.new_tree(c4.from_moves(mv)) for mv in ([], [3], [3, 3, 2])]
    counts = m.search(trees, 50)
    assert (counts.sum(axis=1) == 50).all()
    counts = m.search(trees, 30)                 # searching on adds visits
    assert (counts.sum(axis=1) == 80).all()
    # moving on keeps the child's subtree
    child_visits = int(counts[0, 3])
    trees[0].advance(c4, 3)
    assert trees[0].root_state == c4.from_moves([3])
    assert trees[0].visit_counts(7).sum() == child_visits - 1   # its own expansion is not an edge visit
    assert (m.search(trees[:1], 10).sum() == child_visits - 1 + 10)
    # an illegal move cannot be advanced through, a full column has no visits
    full = m.new_tree(c4.from_moves([0] * 6))
    assert m.search([full], 40)[0, 0] == 0
    with pytest.raises(ValueError):
        full.advance(c4, 0)


def test_dirichlet_noise_only_at_the_root() -> None:
    policy = np.arange(1, 8, dtype=np.float64)          # distinctive priors
    root = c4.from_moves([0] * 6)                       # column 0 full: 6 legal moves
    clean = policy[1:] / policy[1:].sum()
    m = mcts.MCTS(c4, CountingModel(policy), dirichlet_alpha=0.3, dirichlet_fraction=0.25)
    t = m.new_tree(root)
    m.search([t], 60, np.random.default_rng(1), noise=True)
    noisy = np.array(t.priors(t.root))
    assert t.actions(t.root) == [1, 2, 3, 4, 5, 6]
    assert not np.allclose(noisy, clean)
    assert noisy.sum() == pytest.approx(1.0) and (noisy > 0).all()
    # at least 0.75 of each clean prior survives the mix
    assert (noisy >= 0.75 * clean - 1e-12).all()
    expanded = [i for i in range(len(t)) if t.is_expanded(i) and i != t.root]
    assert len(expanded) > 10
    for i in expanded:
        legal = c4.legal_moves(t.state[i])
        np.testing.assert_allclose(t.priors(i), policy[legal] / policy[legal].sum())
    # noise is drawn afresh from the clean priors each search, never stacked
    m.search([t], 1, np.random.default_rng(2), noise=True)
    noisy2 = np.array(t.priors(t.root))
    assert not np.allclose(noisy2, noisy)
    assert ((noisy2 - 0.75 * clean) >= -1e-12).all()
    m.search([t], 1, noise=False)          # no noise: the clean priors come back
    np.testing.assert_allclose(t.priors(t.root), clean)
    # without noise the root priors are the model's
    t2 = m.new_tree(root)
    m.search([t2], 20)
    np.testing.assert_allclose(t2.priors(t2.root), clean)
    with pytest.raises(ValueError):
        m.search([m.new_tree(root)], 5, None, noise=True)


def test_select_move_temperature() -> None:
    rng = np.random.default_rng(0)
    counts = np.array([3, 0, 9, 1, 0, 2, 4])
    assert all(mcts.select_move(counts, 0.0, rng) == 2 for _ in range(20))
    ties = np.array([5, 0, 1, 5, 0, 0, 0])
    picked = {mcts.select_move(ties, 0.0, rng) for _ in range(50)}
    assert picked == {0, 3}
    drawn = [mcts.select_move(counts, 1.0, rng) for _ in range(400)]
    assert set(drawn) <= {0, 2, 3, 5, 6} and len(set(drawn)) >= 3   # never an unvisited move
    assert max(set(drawn), key=drawn.count) == 2
    # a low temperature concentrates on the most visited move
    assert all(mcts.select_move(counts, 0.05, rng) == 2 for _ in range(20))
    with pytest.raises(ValueError):
        mcts.select_move(np.zeros(7), 1.0, rng)


def check_record(rec: mcts.GameRecord[State]) -> None:
    s = c4.initial()
    assert len(rec.samples) == len(rec.moves) > 0
    states = []
    for mv in rec.moves:
        states.append(s)
        s = c4.play(s, mv)
    assert rec.final_state == s and c4.is_terminal(s)
    w = c4.winner(s)
    assert w is not None
    for state, sample, mv in zip(states, rec.samples, rec.moves):
        np.testing.assert_array_equal(sample.state, c4.encode(state))
        assert sample.policy.shape == (7,)
        assert sample.policy.sum() == pytest.approx(1.0)
        assert (sample.policy[~c4.legal_mask(state)] == 0).all()
        assert sample.policy[mv] > 0
        # outcome from the view of the player to move in the sample's state
        assert sample.outcome == (w if c4.to_move(state) == 0 else -w)
    if w != 0:     # the player who made the last move won
        assert rec.samples[-1].outcome == 1.0 and rec.samples[-2].outcome == -1.0


def test_play_games_batches_across_games() -> None:
    model = CountingModel()
    n_games = 6
    records = mcts.play_games(c4, model, n_games, 24, np.random.default_rng(3),
                              temperature_moves=8)
    assert len(records) == n_games
    for rec in records:
        check_record(rec)
    assert len({tuple(r.moves) for r in records}) > 1          # noise + temperature vary games
    # every step of the first moves sends all games' leaves in one call
    assert model.batches[0] == n_games
    assert max(model.batches) == n_games
    longest = max(len(r.moves) for r in records)
    assert len(model.batches) <= longest * (24 + 1)
    assert sum(model.batches) / len(model.batches) > 2


def test_play_games_without_reuse_and_greedy() -> None:
    model = CountingModel()
    records = mcts.MCTS(c4, model, c_puct=1.0).play_games(
        2, 16, np.random.default_rng(4), temperature_moves=0, noise=False, reuse_tree=False)
    for rec in records:
        check_record(rec)


def test_play_games_refills_finished_slots() -> None:
    model = CountingModel()
    start = c4.from_moves([3, 3, 2, 2])          # games from a given opening
    records = mcts.play_games(c4, model, 7, 12, np.random.default_rng(5), concurrent=3,
                              start=start, temperature_moves=4)
    assert len(records) == 7
    for rec in records:
        assert rec.final_state == c4.from_moves(rec.moves, start) and c4.is_terminal(
            rec.final_state)
        np.testing.assert_array_equal(rec.samples[0].state, c4.encode(start))
    assert max(model.batches) == 3
    # while games remain to be started every step has three games in play
    assert model.batches[:13] == [3] * 13


def test_errors() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="finished"):
        mcts.search_many(c4, [c4.from_moves([0, 1, 0, 1, 0, 1, 0])], CountingModel(), 5, rng)

    m = mcts.MCTS(c4, CountingModel())
    t = m.new_tree(c4.initial())
    with pytest.raises(ValueError, match="twice"):
        m.search([t, t], 5)

    def logits_model(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        return np.full((len(x), 7), -2.0), np.zeros(len(x))

    with pytest.raises(ValueError, match="logits"):
        mcts.search_many(c4, [c4.initial()], logits_model, 5, rng)

    def wrong_shape(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        return np.full((len(x), 6), 0.1), np.zeros(len(x))

    with pytest.raises(ValueError, match="expected"):
        mcts.search_many(c4, [c4.initial()], wrong_shape, 5, rng)

    def zero_policy(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        return np.zeros((len(x), 7)), np.zeros((len(x), 1))     # [n, 1] values are fine

    def nan_value(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        return np.full((len(x), 7), 0.1), np.full(len(x), np.nan)

    with pytest.raises(ValueError, match="non-finite"):
        mcts.search_many(c4, [c4.initial()], nan_value, 5, rng)

    counts = mcts.search_many(c4, [c4.initial()], zero_policy, 14, rng)
    assert counts.sum() == 14 and (counts > 0).all()            # uniform over legal moves


def reference_search(root: State, model: Any, simulations: int, c_puct: float = 1.5,
                     fpu: float = 0.0) -> np.ndarray:
    """PUCT written out plainly (recursion, one state per call, nodes keyed
    by the moves from the root so that transpositions stay apart as in a
    tree): the oracle for the C tree's choices."""
    stats: Dict[Tuple[int, ...], Tuple[List[int], List[float], List[int], List[float]]] = {}

    def expand(s: State, path: Tuple[int, ...]) -> float:
        p, v = model(c4.encode_many([s]))
        acts = c4.legal_moves(s)
        ps = [float(p[0][a]) for a in acts]
        total = sum(ps)
        stats[path] = (acts, [x / total for x in ps], [0] * len(acts), [0.0] * len(acts))
        return float(np.asarray(v).reshape(-1)[0])

    def simulate(s: State, path: Tuple[int, ...]) -> float:
        """One simulation below ``s``; returns the leaf's value from the
        view of the player to move at ``s``."""
        term = c4.terminal_value(s)
        if term is not None:
            return term
        if path not in stats:
            return expand(s, path)
        acts, prior, n, w = stats[path]
        sq = c_puct * np.sqrt(sum(n) + 1)
        u = [w[i] / n[i] + sq * prior[i] / (n[i] + 1) if n[i] else fpu + sq * prior[i]
             for i in range(len(acts))]
        i = int(np.argmax(u))
        v = -simulate(c4.play(s, acts[i]), path + (acts[i],))
        n[i] += 1
        w[i] += v
        return v

    expand(root, ())
    for _ in range(simulations):
        simulate(root, ())
    out = np.zeros(7, dtype=np.int64)
    acts, _, n, _ = stats[()]
    out[acts] = n
    return out


def hashed_model(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """A deterministic, position-dependent stand-in for a net."""
    h = (x.reshape(len(x), -1) * np.arange(1, 85)).sum(axis=1)
    return np.abs(np.sin(np.outer(h, np.arange(1, 8)))) + 0.01, np.tanh(np.cos(h))


@pytest.mark.parametrize("moves", [[], [3, 3], [0, 1, 0, 1, 0]])
def test_c_tree_matches_a_plain_reference(moves: List[int]) -> None:
    root = c4.from_moves(moves)
    expected = reference_search(root, hashed_model, 300)
    got = mcts.search_many(c4, [root], hashed_model, 300)[0]
    np.testing.assert_array_equal(got, expected)


@settings(max_examples=25, deadline=None)
@given(moves=st.lists(st.integers(0, 6), max_size=12), seed=st.integers(0, 2**16),
       simulations=st.integers(1, 120))
def test_c_tree_matches_the_reference_anywhere(moves: List[int], seed: int,
                                               simulations: int) -> None:
    """Random openings (illegal moves skipped), random position-dependent
    models: the same visit counts as the plain reference, and the tree's
    counts add up (every node's visits are the sum of its edges' counts)."""
    s = c4.initial()
    for mv in moves:
        if c4.terminal_value(s) is None and mv in c4.legal_moves(s):
            s = c4.play(s, mv)
    if c4.terminal_value(s) is not None:
        return
    weights = np.random.default_rng(seed).standard_normal((84, 8))

    def model(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        z = x.reshape(len(x), -1) @ weights
        return np.exp(z[:, :7] - z[:, :7].max(axis=1, keepdims=True)), np.tanh(z[:, 7])

    m = mcts.MCTS(c4, model)
    t = m.new_tree(s)
    got = m.search([t], simulations)[0]
    np.testing.assert_array_equal(got, reference_search(s, model, simulations))
    assert got.sum() == simulations
    for node in range(len(t)):
        _, _, n, _, child = t.edges(node)
        for k, ch in zip(n, child):
            assert (ch >= 0) == (k > 0)            # a child exists once its edge is taken
            if ch >= 0 and t.is_expanded(ch):
                assert sum(t.edges(ch)[2]) == k - 1     # its first visit expanded it


def test_tree_inspection_and_errors() -> None:
    t = Tree(c4, c4.initial())
    assert len(t) == 1 and t.root == 0 and not t.is_expanded(0)
    assert t.edges(0) == ([], [], [], [], []) and t.visit_counts(7).sum() == 0
    row = np.arange(1, 8, dtype=np.float64)
    t.expand(0, [0, 2, 4], row)
    acts, prior, n, w, child = t.edges(0)
    assert acts == [0, 2, 4] and n == [0, 0, 0] and w == [0.0] * 3 and child == [-1] * 3
    np.testing.assert_allclose(prior, [1 / 9, 3 / 9, 5 / 9])
    with pytest.raises(ValueError, match="already expanded"):
        t.expand(0, [0], row)
    with pytest.raises(IndexError):
        t.is_expanded(1)
    with pytest.raises(ValueError, match="noise values"):
        t.add_noise([0.5, 0.5], 0.25)
    t.add_noise([1.0, 0.0, 0.0], 0.5)
    np.testing.assert_allclose(t.priors(0), [1 / 18 + 0.5, 3 / 18, 5 / 18])
    t.clear_noise()
    np.testing.assert_allclose(t.priors(0), [1 / 9, 3 / 9, 5 / 9])
    with pytest.raises(ValueError, match="not a legal move"):
        t.advance(c4, 1)
    t.advance(c4, 2)
    assert t.root == 1 and t.root_state == c4.from_moves([2]) and len(t) == 2
    u = Tree(c4, c4.initial())
    with pytest.raises(ValueError, match="outside"):
        u.expand(0, [0, 7], row)
    with pytest.raises(ValueError, match="no moves"):
        u.expand(0, [], row)
    assert not u.is_expanded(0)                    # a refused expansion leaves nothing
    # the two steps, called directly: a tree listed twice is refused
    from shmeval.mcts._tree import expand_backup, select_leaves
    u.expand(0, c4.legal_moves(u.root_state), row)
    waiting, states = select_leaves([u, u], c4.play, c4.terminal_value, 1.5, 0.0)
    assert len(waiting) == 2 and states[0] == states[1]      # the same new leaf
    with pytest.raises(ValueError, match="twice"):
        expand_backup(waiting, c4.legal_moves, np.full((2, 7), 1 / 7), np.zeros(2))


def test_game_mistakes_are_reported() -> None:
    class NoMoves:
        N_ACTIONS, INPUT_SHAPE = 7, (6, 7, 2)
        initial, play, terminal_value = c4.initial, c4.play, c4.terminal_value
        encode_many = c4.encode_many

        @staticmethod
        def legal_moves(s: State) -> List[int]:
            return c4.legal_moves(s) if s.moves == 0 else []

    with pytest.raises(ValueError, match="no moves"):
        mcts.search_many(NoMoves, [c4.initial()], CountingModel(), 5)


class FakeClient:
    """Stands in for an shmeval client: evaluate_many -> dict of arrays."""

    def __init__(self, logits: bool) -> None:
        self.logits = logits
        self.calls: List[int] = []

    def evaluate_many(self, states: Any) -> Dict[str, np.ndarray]:
        n = len(states)
        self.calls.append(n)
        p = np.tile(np.arange(7, dtype=np.float32), (n, 1))
        return {"pi": p if self.logits else p / p.sum(axis=1, keepdims=True),
                "v": np.full(n, 0.25, np.float32)}


@pytest.mark.parametrize("logits", [False, True])
def test_evaluator_fn_adapter(logits: bool) -> None:
    client = FakeClient(logits)
    fn = mcts.evaluator_fn(client, "pi", "v", logits=logits)
    p, v = fn(np.zeros((3, 6, 7, 2), np.float32))
    assert p.shape == (3, 7) and v.shape == (3,) and (v == 0.25).all()
    expected = np.exp(np.arange(7)) / np.exp(np.arange(7)).sum() if logits else np.arange(7) / 21
    np.testing.assert_allclose(p[0], expected, rtol=1e-6)
    counts = mcts.search_many(c4, [c4.initial(), c4.from_moves([1])], fn, 10)
    assert counts.sum() == 20 and client.calls == [3] + [2] * 11   # roots, then 10 steps


@pytest.mark.timeout(60)
def test_search_through_an_shmeval_evaluator() -> None:
    """The adapter on a real evaluator (thread mode) with the demo's net."""
    import shmeval
    from shmeval.bench.demo import OUTPUTS, TinyNet

    with shmeval.Evaluator(TinyNet(), input_shape=c4.INPUT_SHAPE, outputs=OUTPUTS,
                           max_batch=64) as ev:
        m = mcts.MCTS(c4, mcts.evaluator_fn(ev))
        positions = WIN_POSITIONS + BLOCK_POSITIONS
        trees = [m.new_tree(c4.from_moves(mv)) for mv, _ in positions]
        counts = m.search(trees, 300)
        assert (counts.sum(axis=1) == 300).all()
        assert counts.argmax(axis=1).tolist() == [col for _, col in positions]
        assert ev.stats()["requests"] == m.evaluated
        assert m.calls <= 301
        assert m.evaluated > 3 * m.calls       # several states per evaluate_many
