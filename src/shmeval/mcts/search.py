"""The search: :class:`MCTS` steps the trees of several games together,
one ``evaluate_batch`` call per simulation step for the leaves of all of
them; :func:`select_move` picks a move from the visit counts;
:func:`search_many` and :func:`play_games` are one-call forms.  The
interface a game and an evaluator provide, the sign convention and the
selection formula are in :mod:`shmeval.mcts`.

The searches are written as *steps*: generators that yield each batch of
encoded leaves and are sent back its ``(policy, value)``
(:meth:`MCTS.search_steps`, :meth:`MCTS.play_steps`).  :func:`shmeval.mcts.steps.drive`
runs one against ``evaluate_batch``, a call at a time;
:func:`shmeval.mcts.pipelined.run_pipelined` runs several, keeping the
leaves of all but the one being searched in flight."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import (Any, Generator, Generic, List, NamedTuple, Optional, Protocol,
                    Sequence, Tuple, TypeVar)

import numpy as np

from ._tree import Tree, expand_backup, select_leaves
from .pipelined import run_pipelined
from .steps import EvaluateBatch, Steps, SubmitBatch, drive

S = TypeVar("S")


class Game(Protocol[S]):
    """What the search needs from a game (a module with these names works).

    States must be immutable values (the tree keeps them).  The game is
    two-player, zero-sum, alternating turns.
    """

    @property
    def N_ACTIONS(self) -> int:
        """Number of actions; actions are ints ``0 .. N_ACTIONS - 1``."""

    @property
    def INPUT_SHAPE(self) -> Tuple[int, ...]:
        """Shape of one encoded state."""

    def initial(self) -> S:
        """The start position."""

    def legal_moves(self, s: S, /) -> Sequence[int]:
        """Legal actions in ``s`` (non-empty unless ``s`` is terminal)."""

    def play(self, s: S, a: int, /) -> S:
        """The state after the player to move plays ``a`` (raises
        ``ValueError`` for an illegal action)."""

    def terminal_value(self, s: S, /) -> Optional[float]:
        """``None`` while the game goes on, else the result in [-1, 1] from
        the view of the player to move in ``s``."""

    def encode_many(self, states: Sequence[S], out: Optional[np.ndarray] = None, /) -> np.ndarray:
        """Encodes ``states`` into ``out[:n]`` (shape ``[m >= n,
        *INPUT_SHAPE]``) and returns ``out[:n]``; allocates when ``out`` is
        ``None``."""


class Sample(NamedTuple):
    """One training sample: the encoded state, the search's visit-count
    distribution over actions (sums to 1), and the game's final result from
    the view of the player to move in that state (+1 win, -1 loss, 0 draw)."""

    state: np.ndarray
    policy: np.ndarray
    outcome: float


@dataclass
class GameRecord(Generic[S]):
    """One finished self-play game: the moves, one :class:`Sample` per move,
    and the final state."""

    moves: List[int] = field(default_factory=list)
    samples: List[Sample] = field(default_factory=list)
    final_state: Optional[S] = None


def select_move(counts: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """Picks an action from visit ``counts``: the most visited one when
    ``temperature`` is 0 (ties broken at random), else one drawn with
    probability proportional to ``counts ** (1 / temperature)``."""
    c = np.asarray(counts, dtype=np.float64)
    if c.max() <= 0:
        raise ValueError("no visits to choose from")
    if temperature <= 0:
        best = np.flatnonzero(c == c.max())
        return int(best[0] if len(best) == 1 else rng.choice(best))
    p = (c / c.max()) ** (1.0 / temperature)
    return int(rng.choice(len(c), p=p / p.sum()))


class MCTS(Generic[S]):
    """PUCT search for ``game`` evaluating leaves with ``evaluate_batch``.

    ``c_puct``: exploration weight.  ``fpu``: Q of an unvisited edge.
    ``dirichlet_alpha``, ``dirichlet_fraction``: root noise (applied when a
    search is asked for ``noise=True``; alpha 1.0 suits Connect Four's 7
    moves -- AlphaZero scaled alpha inversely with the typical number of
    legal moves, 0.3 for chess, 0.03 for Go).  ``calls`` and ``evaluated`` count
    ``evaluate_batch`` calls and the states sent.
    """

    def __init__(self, game: Game[S], evaluate_batch: EvaluateBatch, *, c_puct: float = 1.5,
                 fpu: float = 0.0, dirichlet_alpha: float = 1.0,
                 dirichlet_fraction: float = 0.25) -> None:
        if c_puct < 0 or dirichlet_alpha <= 0 or not 0 <= dirichlet_fraction <= 1:
            raise ValueError("need c_puct >= 0, dirichlet_alpha > 0, 0 <= dirichlet_fraction <= 1")
        self.game = game
        self.evaluate_batch = evaluate_batch
        self.c_puct = float(c_puct)
        self.fpu = float(fpu)
        self.dirichlet_alpha = float(dirichlet_alpha)
        self.dirichlet_fraction = float(dirichlet_fraction)
        self.n_actions = int(game.N_ACTIONS)
        self.input_shape = tuple(game.INPUT_SHAPE)
        self.calls = 0
        self.evaluated = 0
        self._buf = np.empty((0,) + self.input_shape, dtype=np.float32)

    def new_tree(self, state: S) -> Tree[S]:
        """A fresh tree rooted at ``state``."""
        return Tree(self.game, state)

    # -- evaluation ----------------------------------------------------------

    def _evaluate(self, states: Sequence[S]) -> Steps[Tuple[np.ndarray, np.ndarray]]:
        """Encodes ``states`` and yields them (one evaluation); returns the
        policy ``float64 [k, n_actions]`` and values ``float64 [k]``
        (C-contiguous, checked).  The encoding buffer is the search's own,
        reused by its next batch: whoever is sent a batch copies it (or is
        done with it) before the search resumes."""
        k = len(states)
        if len(self._buf) < k:
            self._buf = np.empty((max(k, 2 * len(self._buf)),) + self.input_shape,
                                 dtype=np.float32)
        x = self.game.encode_many(states, self._buf)
        policy, value = yield x
        self.calls += 1
        self.evaluated += k
        p = np.ascontiguousarray(policy, dtype=np.float64)
        v = np.ascontiguousarray(value, dtype=np.float64).reshape(-1)
        if p.shape != (k, self.n_actions) or v.shape != (k,):
            raise ValueError(f"evaluate_batch returned policy {p.shape} and value {v.shape} "
                             f"for {k} states; expected ({k}, {self.n_actions}) and ({k},)")
        if not np.isfinite(v).all():
            raise ValueError(f"evaluate_batch returned non-finite values: {v}")
        return p, v

    def _add_noise(self, t: Tree[S], rng: np.random.Generator) -> None:
        t.clear_noise()
        m = len(t.actions(t.root))
        if m > 1 and self.dirichlet_fraction > 0:
            t.add_noise(rng.dirichlet([self.dirichlet_alpha] * m).tolist(),
                        self.dirichlet_fraction)

    # -- search --------------------------------------------------------------

    def search(self, trees: Sequence[Tree[S]], simulations: int,
               rng: Optional[np.random.Generator] = None, *, noise: bool = False) -> np.ndarray:
        """Runs ``simulations`` more simulations in each tree, all trees
        stepping together (one ``evaluate_batch`` call per step for the
        non-terminal leaves of all trees).  Unexpanded roots are evaluated
        first in one extra call; that does not count as a simulation, so a
        fresh root's visit counts sum to ``simulations``.  ``noise``: mix
        Dirichlet noise into each root's priors (needs ``rng``).

        Returns the root visit counts, ``int64 [len(trees), n_actions]``.
        """
        return drive(self.search_steps(trees, simulations, rng, noise=noise), self.evaluate_batch)

    def search_steps(self, trees: Sequence[Tree[S]], simulations: int,
                     rng: Optional[np.random.Generator] = None, *,
                     noise: bool = False) -> Steps[np.ndarray]:
        """:meth:`search` as steps (see the module): yields each batch of
        leaves instead of calling ``evaluate_batch``."""
        if simulations < 0:
            raise ValueError("simulations must be >= 0")
        if len({id(t) for t in trees}) != len(trees):
            raise ValueError("the same tree appears twice")
        for t in trees:
            if t.term[t.root] is not None:
                raise ValueError("cannot search a finished game")
        if noise and rng is None:
            raise ValueError("noise=True needs an rng")
        game = self.game
        fresh = [t for t in trees if not t.is_expanded(t.root)]
        if fresh:
            p, _ = yield from self._evaluate([t.root_state for t in fresh])
            for j, t in enumerate(fresh):
                t.expand(t.root, game.legal_moves(t.root_state), p[j])
        for t in trees:
            if noise:
                assert rng is not None
                self._add_noise(t, rng)
            else:
                t.clear_noise()                   # noise from an earlier search
        forest = list(trees)
        play, terminal_value, legal_moves = game.play, game.terminal_value, game.legal_moves
        c_puct, fpu = self.c_puct, self.fpu
        for _ in range(simulations):
            waiting, states = select_leaves(forest, play, terminal_value, c_puct, fpu)
            if waiting:
                p, v = yield from self._evaluate(states)
                expand_backup(waiting, legal_moves, p, v)
        out = np.zeros((len(trees), self.n_actions), dtype=np.int64)
        for j, t in enumerate(trees):
            out[j] = t.visit_counts(self.n_actions)
        return out

    def play_games(self, n_games: int, simulations: int, rng: np.random.Generator, *,
                   temperature: float = 1.0, temperature_moves: int = 10, noise: bool = True,
                   reuse_tree: bool = True, concurrent: Optional[int] = None,
                   start: Optional[S] = None, pipeline: int = 1,
                   submit_batch: Optional[SubmitBatch] = None) -> List[GameRecord[S]]:
        """Plays ``n_games`` games against themselves, concurrently, to the
        end; returns one :class:`GameRecord` per game, in the order started.

        ``concurrent`` games (default: all ``n_games``) are in play at once;
        when one ends the next starts, so the batches stay full until the
        last games.  Each move runs :meth:`search` over all games in play
        together (``simulations`` new simulations per move, with root noise
        when ``noise``), records a sample (encoded state, normalized visit
        counts), and picks the move with ``temperature`` for the first
        ``temperature_moves`` moves of a game and the most visited move
        after that.  ``reuse_tree`` keeps the chosen child's subtree for the
        next move.  ``start``: the start position (default ``game.initial()``).

        ``pipeline`` K > 1 splits the games into K groups, each searched on
        its own, and evaluates through ``submit_batch``
        (:func:`shmeval.mcts.pipelined.run_pipelined`): while one group is
        searched, the leaves of the others are being evaluated.
        """
        if pipeline < 1:
            raise ValueError("pipeline must be >= 1")
        if pipeline == 1:
            return drive(self.play_steps(n_games, simulations, rng, temperature=temperature,
                                         temperature_moves=temperature_moves, noise=noise,
                                         reuse_tree=reuse_tree, concurrent=concurrent,
                                         start=start), self.evaluate_batch)
        if submit_batch is None:
            raise ValueError("pipeline > 1 needs a submit_batch (shmeval.mcts.submitter_fn)")

        k = min(pipeline, n_games)
        width = n_games if concurrent is None else max(1, min(int(concurrent), n_games))
        # Group g plays games g, g + k, g + 2k, ... with its share of the width.
        sizes = [len(range(g, n_games, k)) for g in range(k)]
        groups = [MCTS(self.game, self.evaluate_batch, c_puct=self.c_puct, fpu=self.fpu,
                       dirichlet_alpha=self.dirichlet_alpha,
                       dirichlet_fraction=self.dirichlet_fraction) for _ in range(k)]
        steps = [m.play_steps(sizes[g], simulations, rng, temperature=temperature,
                              temperature_moves=temperature_moves, noise=noise,
                              reuse_tree=reuse_tree,
                              concurrent=max(1, len(range(g, width, k))), start=start)
                 for g, m in enumerate(groups)]
        played = run_pipelined(steps, submit_batch)
        for m in groups:
            self.calls += m.calls
            self.evaluated += m.evaluated
        records: List[GameRecord[S]] = [GameRecord() for _ in range(n_games)]
        for g, recs in enumerate(played):
            records[g::k] = recs
        return records

    def play_steps(self, n_games: int, simulations: int, rng: np.random.Generator, *,
                   temperature: float = 1.0, temperature_moves: int = 10, noise: bool = True,
                   reuse_tree: bool = True, concurrent: Optional[int] = None,
                   start: Optional[S] = None) -> Steps[List[GameRecord[S]]]:
        """:meth:`play_games` (one group) as steps (see the module)."""
        game = self.game
        s0 = game.initial() if start is None else start
        width = n_games if concurrent is None else max(1, min(int(concurrent), n_games))
        records: List[GameRecord[S]] = [GameRecord() for _ in range(n_games)]
        seen: List[List[Tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(n_games)]
        trees: dict[int, Tree[S]] = {}
        started = 0
        active: List[int] = []
        while True:
            while len(active) < width and started < n_games:
                trees[started] = self.new_tree(s0)
                active.append(started)
                started += 1
            done = [g for g in active if trees[g].term[trees[g].root] is not None]
            if done:
                for g in done:
                    self._finish(records[g], trees.pop(g), seen[g])
                active = [g for g in active if g in trees]
                continue
            if not active:
                return records
            counts = yield from self.search_steps([trees[g] for g in active], simulations, rng,
                                                  noise=noise)
            enc = game.encode_many([trees[g].root_state for g in active])
            for j, g in enumerate(active):
                t, rec = trees[g], records[g]
                c = counts[j]
                seen[g].append((enc[j], c / c.sum()))
                temp = temperature if len(rec.moves) < temperature_moves else 0.0
                a = select_move(c, temp, rng)
                rec.moves.append(a)
                if reuse_tree:
                    t.advance(game, a)
                else:
                    trees[g] = self.new_tree(game.play(t.root_state, a))

    def _finish(self, rec: GameRecord[S], t: Tree[S],
                seen: List[Tuple[np.ndarray, np.ndarray]]) -> None:
        final = t.root_state
        v_end = t.term[t.root]
        assert v_end is not None
        m = len(rec.moves)
        rec.final_state = final
        # two players alternate: the player to move after ply i is the one to
        # move at the end when (m - i) is even
        rec.samples = [Sample(x, p, v_end if (m - i) % 2 == 0 else -v_end)
                       for i, (x, p) in enumerate(seen)]


def search_many(game: Game[S], roots: Sequence[S], evaluate_batch: EvaluateBatch,
                simulations: int, rng: Optional[np.random.Generator] = None, *,
                noise: bool = False, **options: float) -> np.ndarray:
    """Searches fresh trees from each of ``roots`` together; returns the
    root visit counts ``int64 [len(roots), n_actions]`` (each row sums to
    ``simulations``).  ``options``: ``c_puct``, ``fpu``, ``dirichlet_alpha``,
    ``dirichlet_fraction`` (see :class:`MCTS`)."""
    m = MCTS(game, evaluate_batch, **options)
    return m.search([m.new_tree(s) for s in roots], simulations, rng, noise=noise)


def play_games(game: Game[S], evaluate_batch: EvaluateBatch, n_games: int, simulations: int,
               rng: np.random.Generator, *, temperature: float = 1.0,
               temperature_moves: int = 10, noise: bool = True, reuse_tree: bool = True,
               concurrent: Optional[int] = None, start: Optional[S] = None,
               pipeline: int = 1, submit_batch: Optional[SubmitBatch] = None,
               **options: float) -> List[GameRecord[S]]:
    """:meth:`MCTS.play_games` with an MCTS built from ``options``
    (``c_puct``, ``fpu``, ``dirichlet_alpha``, ``dirichlet_fraction``)."""
    return MCTS(game, evaluate_batch, **options).play_games(
        n_games, simulations, rng, temperature=temperature,
        temperature_moves=temperature_moves, noise=noise, reuse_tree=reuse_tree,
        concurrent=concurrent, start=start, pipeline=pipeline, submit_batch=submit_batch)

