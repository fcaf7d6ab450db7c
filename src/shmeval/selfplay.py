"""The self-play demo: ``shmeval selfplay``.

Worker processes play Connect Four against themselves with the batched PUCT
search of :mod:`shmeval.mcts`, several games per worker, and evaluate the
leaves of all their games together with a Keras residual policy-value net
(:mod:`shmeval.games.connect4_net`).  How the net is reached is the mode:

``shmeval``
    one evaluator process (:meth:`shmeval.Evaluator.spawn`, the net wrapped in
    :class:`shmeval.backends.tensorflow.TFModel`); each search step of a
    worker is one ``evaluate_many`` round trip through shared memory.  The
    workers never import TensorFlow.
``queue``
    one TensorFlow evaluator process behind a ``multiprocessing.Queue``: a
    worker puts ``(worker id, leaf batch as raw bytes)``, the evaluator takes
    one request, drains what else is queued with ``get_nowait``, calls the
    same traced net once on the concatenation and sends each worker its rows
    back on the worker's own queue (a ``multiprocessing.SimpleQueue``).
``local``
    every worker builds its own copy of the net (same weights) and calls it
    one state at a time (a ``FrozenGraph`` of it, or with ``--no-freeze`` a
    pre-traced concrete function; one TensorFlow thread per worker).
``local-batched``
    as ``local``, but the worker evaluates its whole leaf batch in one call.

All modes use the same seeded initial weights, the same number of games per
worker and of simulations per move.  The central evaluators (``shmeval`` and
``queue``) run TensorFlow with ``evaluator_threads`` intra- and inter-op
threads; by default each gets its best on a 2-core machine: one for
shmeval (two serving threads run calls on both cores; TensorFlow's pools
made its calls slower and costlier), TensorFlow's default pools for queue
(its one evaluator thread otherwise leaves a core to the workers alone;
with 16 games per worker the default pools gave it 3-5% more).

Moves/s and evals/s are measured over a window that opens ``warmup`` seconds
after every worker has started playing and lasts ``seconds``.  Finished games
go to the main process (a ``multiprocessing.Queue``), which can save them to
an ``.npz`` (:func:`save_games` / :func:`load_games`) and, with ``train``,
feeds them to a learner that trains the same net on a replay buffer
(:class:`ReplayBuffer`, left-right mirror augmentation) and pushes its
weights into the running evaluator with ``Evaluator.set_weights``.

This module does not import TensorFlow; only the processes that run the net
do (the evaluator, the queue server, the local workers, and the main process
when it trains).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import importlib.metadata
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import signal
import statistics
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import mcts
from .display import Display
from .jsonout import json_default
from .procstat import cpu_bfloat16, cpu_model, cpu_s, gpu_visible, machine_busy_s, rss_mb
from .sched import use_batch_scheduling
from .games import connect4
from .games.connect4_net import NetConfig

MODES = ("shmeval", "queue", "local", "local-batched")
#: What ``--compare`` runs, in this order.
COMPARE_MODES = ("shmeval", "queue", "local")
OUTPUTS = {"policy": ((connect4.N_ACTIONS,), "float32"), "value": ((), "float32")}
STATE_BYTES = int(np.prod(connect4.INPUT_SHAPE)) * 4
GAMES_FORMAT = "shmeval-selfplay-games/1"

# Per-worker counters (int64 each) in one shared array, NF slots per worker.
MOVES, EVALS, CALLS, GAMES, EVAL_WALL_NS, EVAL_CPU_NS = range(6)
NF = 8
# Flags shared by all workers.
STOP = 0

READY_TIMEOUT_S = 600.0
#: CPU cores used by other programs in a window above which the summary warns.
OTHER_LOAD_WARN = 0.2
TICK_S = 0.5


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on (recorded in the JSON and the .npz)."""

    workers: int = 8
    games_per_worker: int = 16
    simulations: int = 32
    seconds: float = 10.0
    warmup: float = 1.0
    repeats: int = 1
    seed: int = 0
    evaluator_threads: Optional[int] = None
    serving_threads: int = 2
    worker_sched: str = "auto"
    freeze: bool = True
    precision: str = "auto"
    max_batch: int = 256
    pin: bool = False
    net: NetConfig = field(default_factory=NetConfig)
    c_puct: float = 1.5
    dirichlet_alpha: float = 1.0
    dirichlet_fraction: float = 0.25
    temperature_moves: int = 10
    # learner (mode shmeval with train=True)
    train: bool = False
    push_every: float = 2.0
    batch_size: int = 128
    buffer_size: int = 100_000
    sample_reuse: float = 4.0
    learner_threads: int = 1

    def tf_threads(self, mode: str) -> int:
        """TensorFlow threads of ``mode``'s central evaluator (0: TensorFlow's
        default): ``evaluator_threads`` when set, else the mode's best on a
        2-core machine (docs/selfplay.md): 1 for shmeval, whose serving
        threads run calls on both cores; TensorFlow's default for queue,
        whose one evaluator thread needs TensorFlow's pool to use both."""
        if self.evaluator_threads is not None:
            return self.evaluator_threads
        return 1 if mode == "shmeval" else 0

    def worker_policy(self, cpus: Optional[int] = None) -> str:
        """Scheduling policy of every mode's workers, "batch" (``SCHED_BATCH``,
        :func:`shmeval.use_batch_scheduling`) or "normal": ``worker_sched``
        when set, else ("auto") batch when the workers outnumber the CPUs
        (``cpus``, default: those this process may use).  Measured on a
        2-core machine with 8 workers, batch raised every mode a little: a
        woken worker no longer preempts the running evaluator or model
        (docs/selfplay.md)."""
        if self.worker_sched != "auto":
            return self.worker_sched
        if cpus is None:
            cpus = len(os.sched_getaffinity(0))
        return "batch" if self.workers > cpus else "normal"

    def net_precision(self, mode: str) -> str:
        """What ``mode``'s net computes in, "bfloat16" or "float32":
        ``precision`` when set, else ("auto") each mode's faster one:
        bfloat16 when the net is frozen, runs on the CPU (no GPU visible:
        :func:`shmeval.procstat.gpu_visible`), the CPU computes in bfloat16
        natively (:func:`shmeval.procstat.cpu_bfloat16`) and the mode calls
        the net with batches (19-33% less per row from 16 rows on);
        float32 for ``local``, whose calls of one row cost about 9% more in
        bfloat16 (docs/performance.md, finding 31)."""
        if self.precision != "auto":
            return self.precision
        batched = mode != "local"
        on_cpu = not gpu_visible()
        return ("bfloat16" if self.freeze and batched and on_cpu and cpu_bfloat16()
                else "float32")

    def check(self) -> None:
        if self.workers < 1 or self.games_per_worker < 1 or self.simulations < 1:
            raise ValueError("workers, games per worker and simulations must be >= 1")
        if not self.seconds > 0 or self.warmup < 0 or self.repeats < 1:
            raise ValueError("seconds must be > 0, warmup >= 0 and repeats >= 1")
        if self.train and self.repeats != 1:
            raise ValueError("--train runs once (no --repeats)")
        if (self.evaluator_threads or 0) < 0 or self.learner_threads < 0:
            raise ValueError("thread counts must be >= 0 (0: TensorFlow's default)")
        if not 1 <= self.serving_threads <= 8:
            raise ValueError("serving threads must be from 1 to 8")
        if self.worker_sched not in ("auto", "normal", "batch"):
            raise ValueError(f"worker_sched must be auto, normal or batch, "
                             f"got {self.worker_sched!r}")
        if self.precision not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"precision must be auto, float32 or bfloat16, "
                             f"got {self.precision!r}")
        if self.precision == "bfloat16" and not self.freeze:
            raise ValueError("bfloat16 needs the frozen net (drop --no-freeze)")
        if self.precision == "bfloat16" and gpu_visible():
            raise ValueError("bfloat16 is a rewrite for the CPU, and the net would run on "
                             "this machine's GPU")
        if self.push_every <= 0 or self.batch_size < 1 or self.buffer_size < self.batch_size:
            raise ValueError("need push_every > 0, batch_size >= 1, buffer_size >= batch_size")
        if self.sample_reuse <= 0:
            raise ValueError("sample_reuse must be > 0")


def _one(values: set[Any]) -> Any:
    """The one value of a set, None when empty, "mixed" when several."""
    if len(values) > 1:
        return "mixed"
    return next(iter(values), None)


class WorkerError(RuntimeError):
    """A worker process or an evaluator failed; the message holds its traceback."""


class _Stopped(Exception):
    """Raised inside a worker's search when the main process asks it to stop."""


# --------------------------------------------------------------------------- games


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


def mirror_samples(states: np.ndarray, policies: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The left-right mirror images (copies) of encoded states ``[n, 6, 7, 2]``
    and their policies ``[n, 7]`` (Connect Four's one symmetry; outcomes do
    not change)."""
    return (np.ascontiguousarray(connect4.mirror(states)),
            np.ascontiguousarray(connect4.mirror_policy(policies)))


class ReplayBuffer:
    """The most recent ``capacity`` samples (state, visit-count policy,
    outcome), in a ring.  Samples are stored once; :meth:`sample` mirrors
    each drawn sample left-right with probability 1/2."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = int(capacity)
        self.states = np.zeros((self.capacity,) + connect4.INPUT_SHAPE, np.uint8)
        self.policies = np.zeros((self.capacity, connect4.N_ACTIONS), np.float32)
        self.outcomes = np.zeros(self.capacity, np.float32)
        self.size = 0
        self.added = 0  # samples ever added
        self._next = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.size

    def add(self, states: np.ndarray, policies: np.ndarray, outcomes: np.ndarray) -> None:
        """Appends samples (states 0/1 ``[n, 6, 7, 2]``, any numeric dtype),
        overwriting the oldest once full."""
        n = len(states)
        if policies.shape != (n, connect4.N_ACTIONS) or np.shape(outcomes) != (n,) or \
                states.shape[1:] != connect4.INPUT_SHAPE:
            raise ValueError(f"add: shapes {states.shape}, {policies.shape}, "
                             f"{np.shape(outcomes)} do not line up")
        with self._lock:
            if n > self.capacity:
                states, policies, outcomes = (states[-self.capacity:], policies[-self.capacity:],
                                              outcomes[-self.capacity:])
                self.added += n - self.capacity
                n = self.capacity
            idx = (self._next + np.arange(n)) % self.capacity
            self.states[idx] = states
            self.policies[idx] = policies
            self.outcomes[idx] = outcomes
            self._next = int((self._next + n) % self.capacity)
            self.size = min(self.capacity, self.size + n)
            self.added += n

    def add_games(self, games: Games) -> None:
        self.add(games.states, games.policies, games.outcomes)

    def batch(self, indices: np.ndarray, flip: np.ndarray
              ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Samples ``indices`` as float32 training arrays, the rows where
        ``flip`` is True mirrored left-right."""
        with self._lock:
            x = self.states[indices].astype(np.float32)
            p = self.policies[indices].copy()
            z = self.outcomes[indices].copy()
        if flip.any():
            x[flip], p[flip] = mirror_samples(x[flip], p[flip])
        return x, p, z

    def sample(self, n: int, rng: np.random.Generator, mirror: bool = True
               ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``n`` samples drawn uniformly (with replacement), each mirrored
        with probability 1/2 when ``mirror``."""
        if self.size == 0:
            raise ValueError("the replay buffer is empty")
        idx = rng.integers(0, self.size, n)
        flip = rng.random(n) < 0.5 if mirror else np.zeros(n, bool)
        return self.batch(idx, flip)


# --------------------------------------------------------------------------- processes


def _child_setup() -> None:
    """In every process started here: Ctrl-C is the main process's to handle,
    and the process dies with the main process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os._exit(1)


def _probe_states() -> np.ndarray:
    """A few fixed positions every mode evaluates before it starts, so the
    runs can be checked to serve the same initial weights."""
    games: Tuple[List[int], ...] = ([], [3], [3, 3, 4], [0, 1, 2, 3, 4, 5, 6], [3, 2, 3, 2, 3])
    return connect4.encode_many([connect4.from_moves(m) for m in games])


def cpu_split(pin: bool) -> Tuple[Optional[set[int]], Optional[set[int]]]:
    """With ``pin`` and at least two CPUs allowed: (the central evaluator's
    CPU, the workers' CPUs) -- the last allowed CPU for the evaluator, the
    others for the workers.  Else (None, None): nothing is pinned."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return None, None
    return {cpus[-1]}, set(cpus[:-1])


def _pin(cpus: Optional[set[int]]) -> None:
    """Restricts this process (and the threads it starts later) to ``cpus``."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def _evaluator_factory(net: NetConfig, seed: int, threads: int,
                       cpus: Optional[set[int]] = None, serving_threads: int = 1,
                       freeze: bool = False, bfloat16: bool = False) -> Any:
    """Evaluator.spawn's factory: runs in the evaluator process, the only
    process of the shmeval mode that imports TensorFlow.  ``threads`` intra-op
    threads per model call; with several serving threads, as many inter-op
    threads as calls in flight (with fewer, concurrent calls partly wait for
    each other: `bench/tf_model_cost.py --concurrent`)."""
    from .games.connect4_net import build_resnet, import_tensorflow

    _pin(cpus)  # before TensorFlow starts its threads
    import_tensorflow()
    from .backends.tensorflow import TFModel, configure

    # Before the net is built: building it initialises TensorFlow.
    configure(intra_op_threads=threads or None,
              inter_op_threads=max(threads, serving_threads) if threads else None)
    return TFModel(build_resnet(net, seed=seed, compile=False), freeze=freeze,
                   bfloat16=bfloat16)


EvaluateBatch = Callable[[np.ndarray], Tuple[np.ndarray, np.ndarray]]


def _net_function(tf: Any, model: Any, rows: Optional[int], s: Settings, mode: str
                  ) -> Callable[[np.ndarray], Dict[str, np.ndarray]]:
    """The queue and local modes' net, ndarrays in and out: the Keras
    model's concrete function for batches of ``rows`` (None: any); with
    ``s.freeze`` its weights folded in and run in the caller's thread by a
    FrozenGraph (in ``s.net_precision(mode)``), as TFModel(freeze=True)
    serves it in the shmeval mode."""
    fn = tf.function(lambda x: model(x, training=False)).get_concrete_function(
        tf.TensorSpec((rows,) + connect4.INPUT_SHAPE, tf.float32))
    if s.freeze:
        from .backends.tensorflow import FrozenGraph
        return FrozenGraph(fn, bfloat16=s.net_precision(mode) == "bfloat16")
    constant = tf.constant

    def run(x: np.ndarray) -> Dict[str, np.ndarray]:
        return {k: t.numpy() for k, t in fn(constant(x)).items()}

    return run


def _open_local(s: Settings, batched: bool) -> EvaluateBatch:
    """The worker's own copy of the net, traced once for batches of one (or
    any size when ``batched``)."""
    from .games.connect4_net import build_resnet, import_tensorflow

    tf = import_tensorflow(1)
    model = build_resnet(s.net, seed=s.seed, compile=False)
    rows = None if batched else 1
    fn = _net_function(tf, model, rows, s, "local-batched" if batched else "local")
    n_actions = connect4.N_ACTIONS

    if batched:
        def evaluate_batch(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
            out = fn(x)
            return out["policy"], out["value"].reshape(len(x))
        return evaluate_batch

    def evaluate_one_by_one(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        n = len(x)
        policy = np.empty((n, n_actions), np.float32)
        value = np.empty(n, np.float32)
        for i in range(n):
            out = fn(x[i:i + 1])
            policy[i] = out["policy"][0]
            value[i] = out["value"][0, 0]
        return policy, value

    return evaluate_one_by_one


def _open_queue(wid: int, requests: Any, response: Any) -> EvaluateBatch:
    put, get = requests.put, response.get
    frombuffer = np.frombuffer
    width = connect4.N_ACTIONS + 1

    def evaluate_batch(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        put((wid, x.tobytes()))
        r = frombuffer(get(), dtype=np.float32).reshape(len(x), width)
        return r[:, :-1], r[:, -1]

    return evaluate_batch


def _open(mode: str, wid: int, s: Settings, link: Any) -> EvaluateBatch:
    if mode == "shmeval":
        return mcts.evaluator_fn(link)
    if mode == "queue":
        return _open_queue(wid, *link)
    if mode in ("local", "local-batched"):
        return _open_local(s, mode == "local-batched")
    raise ValueError(f"unknown mode {mode!r}")


def _worker_main(mode: str, wid: int, s: Settings, counters_raw: Any, flags_raw: Any, go: Any,
                 out_q: Any, link: Any, cpus: Optional[set[int]] = None) -> None:
    """One self-play worker: opens its way to the net, evaluates the probe
    states (worker 0), reports ready, waits for ``go``, then plays until the
    stop flag is set.  Sends ("ready" | "done" | "error", worker id, info)
    and ("game", worker id, moves, policies) on ``out_q``."""
    _child_setup()
    # Decided before pinning, on the CPUs the run was given.
    policy = s.worker_policy()
    _pin(cpus)
    t0 = time.monotonic()
    code = 0
    try:
        if policy == "batch":
            use_batch_scheduling()
        inner = _open(mode, wid, s, link)
        probe = _probe_states()
        p, v = inner(probe)
        info: Dict[str, Any] = {"pid": os.getpid(), "tensorflow": "tensorflow" in sys.modules,
                                "startup_s": time.monotonic() - t0,
                                "sched": ("batch" if os.sched_getscheduler(0) == os.SCHED_BATCH
                                          else "normal")}
        if wid == 0:
            info["probe"] = {"policy": np.asarray(p, np.float64).round(6).tolist(),
                             "value": np.asarray(v, np.float64).reshape(-1).round(6).tolist()}
        flags = np.frombuffer(flags_raw, dtype=np.int64)
        out_q.put(("ready", wid, info))
        while not go.wait(0.1):
            pass
        if not flags[STOP]:
            with contextlib.suppress(_Stopped):
                _play(wid, s, inner, counters_raw, flags, out_q)
        out_q.put(("done", wid, {"tensorflow": "tensorflow" in sys.modules}))
    except BaseException:
        code = 1
        with contextlib.suppress(Exception):
            out_q.put(("error", wid, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            out_q.close()
            out_q.join_thread()
    if "tensorflow" in sys.modules:
        # Tearing TensorFlow down takes seconds of CPU; nothing is left to save.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)


def _play(wid: int, s: Settings, inner: EvaluateBatch, counters_raw: Any, flags: np.ndarray,
          out_q: Any) -> None:
    """Plays ``games_per_worker`` games at a time, starting a new game each
    time one ends, until the stop flag is set (raises _Stopped)."""
    c = np.frombuffer(counters_raw, dtype=np.int64)[wid * NF:(wid + 1) * NF]
    perf_ns, cpu_ns = time.perf_counter_ns, time.process_time_ns

    def evaluate_batch(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        if flags[STOP]:
            raise _Stopped
        w0, c0 = perf_ns(), cpu_ns()
        out = inner(x)
        c[EVAL_CPU_NS] += cpu_ns() - c0
        c[EVAL_WALL_NS] += perf_ns() - w0
        c[EVALS] += len(x)
        c[CALLS] += 1
        return out

    rng = np.random.default_rng([s.seed, 7, wid])
    search = mcts.MCTS(connect4, evaluate_batch, c_puct=s.c_puct,
                       dirichlet_alpha=s.dirichlet_alpha, dirichlet_fraction=s.dirichlet_fraction)
    G = s.games_per_worker
    trees = [search.new_tree(connect4.initial()) for _ in range(G)]
    moves: List[List[int]] = [[] for _ in range(G)]
    policies: List[List[np.ndarray]] = [[] for _ in range(G)]
    while not flags[STOP]:
        counts = search.search(trees, s.simulations, rng, noise=True)
        for j, t in enumerate(trees):
            cj = counts[j]
            temp = 1.0 if len(moves[j]) < s.temperature_moves else 0.0
            a = mcts.select_move(cj, temp, rng)
            policies[j].append((cj / cj.sum()).astype(np.float32))
            moves[j].append(a)
            t.advance(connect4, a)
            if t.term[t.root] is not None:
                out_q.put(("game", wid, moves[j], np.stack(policies[j])))
                c[GAMES] += 1
                trees[j] = search.new_tree(connect4.initial())
                moves[j], policies[j] = [], []
        c[MOVES] += G


# The queue evaluator's shared counters.
Q_REQUESTS, Q_ROWS, Q_BATCHES, Q_MODEL_NS, Q_BUSY_NS = range(5)


def _queue_server_main(s: Settings, requests: Any, responses: List[Any], counters_raw: Any,
                       conn: Any, cpus: Optional[set[int]] = None) -> None:
    """The queue mode's evaluator: one request, then whatever else is queued
    (get_nowait), one call of the traced net on the concatenated rows, each
    worker's rows back on its own queue.  Stops at a None request."""
    _child_setup()
    _pin(cpus)
    try:
        from .games.connect4_net import build_resnet, import_tensorflow

        tf = import_tensorflow(s.tf_threads("queue") or None)
        model = build_resnet(s.net, seed=s.seed, compile=False)
        fn = _net_function(tf, model, None, s, "queue")
        for n in (1, s.workers * s.games_per_worker):
            fn(np.zeros((n,) + connect4.INPUT_SHAPE, np.float32))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        os._exit(1)
    conn.send(("ready", os.getpid()))
    counters = np.frombuffer(counters_raw, dtype=np.int64)
    get, get_nowait = requests.get, requests.get_nowait
    shape = (-1,) + connect4.INPUT_SHAPE
    width = connect4.N_ACTIONS + 1
    max_rows = s.max_batch
    stopping = False
    while not stopping:
        first = get()
        if first is None:
            break
        items = [first]
        rows = len(first[1]) // STATE_BYTES
        while rows < max_rows:
            try:
                item = get_nowait()
            except queue_mod.Empty:
                break
            if item is None:
                stopping = True
                break
            items.append(item)
            rows += len(item[1]) // STATE_BYTES
        t0 = time.perf_counter_ns()
        batch = np.frombuffer(b"".join(b for _, b in items), dtype=np.float32).reshape(shape)
        t1 = time.perf_counter_ns()
        out = fn(batch)
        packed = np.empty((len(batch), width), np.float32)
        packed[:, :-1] = out["policy"]
        packed[:, -1] = out["value"].reshape(-1)
        t2 = time.perf_counter_ns()
        off = 0
        for wid, b in items:
            k = len(b) // STATE_BYTES
            responses[wid].put(packed[off:off + k].tobytes())
            off += k
        t3 = time.perf_counter_ns()
        counters[Q_REQUESTS] += len(items)
        counters[Q_ROWS] += len(batch)
        counters[Q_BATCHES] += 1
        counters[Q_MODEL_NS] += t2 - t1
        counters[Q_BUSY_NS] += t3 - t0
    sys.stdout.flush()
    os._exit(0)


# --------------------------------------------------------------------------- /proc

def _version(*dists: str) -> Optional[str]:
    for d in dists:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(d)
    return None


def machine_info() -> Dict[str, Any]:
    cpu = cpu_model() or platform.processor() or ""
    return {"cpus": len(os.sched_getaffinity(0)), "cpu": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__,
            "tensorflow": _version("tensorflow", "tensorflow-cpu"), "keras": _version("keras"),
            "loadavg_at_start": list(os.getloadavg())}


# --------------------------------------------------------------------------- learner


class Learner:
    """Trains the net in a thread of the main process on a replay buffer and
    pushes the weights into the running evaluator every ``push_every``
    seconds.  It trains only while every sample added has been drawn fewer
    than ``sample_reuse`` times on average (a batch draws ``batch_size``)."""

    def __init__(self, s: Settings, buffer: ReplayBuffer) -> None:
        from .games.connect4_net import build_resnet, import_tensorflow

        import_tensorflow(s.learner_threads or None)
        self.s = s
        self.buffer = buffer
        self.model = build_resnet(s.net, seed=s.seed, compile=True)
        self.rng = np.random.default_rng([s.seed, 99])
        self.steps = 0
        self.pushes = 0
        self.version = 0
        self.history: List[Dict[str, float]] = []  # one entry per step
        self.push_log: List[Dict[str, float]] = []
        self.error: Optional[str] = None
        self._steps_at_push = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._ev: Any = None
        self._t0 = time.monotonic()
        self._lock = threading.Lock()

    @property
    def loss(self) -> Optional[float]:
        """Mean loss of the last 20 steps."""
        with self._lock:
            recent = self.history[-20:]
        return statistics.fmean(h["loss"] for h in recent) if recent else None

    def start(self, ev: Any) -> None:
        self._ev = ev
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="shmeval-learner", daemon=True)
        self._thread.start()

    def _can_train(self) -> bool:
        b = self.buffer
        return (len(b) >= self.s.batch_size
                and self.steps * self.s.batch_size < self.s.sample_reuse * b.added)

    def _run(self) -> None:
        last_push = time.monotonic()
        try:
            while not self._stop.is_set():
                if self._can_train():
                    self.step()
                else:
                    self._stop.wait(0.05)
                if time.monotonic() - last_push >= self.s.push_every:
                    self.push()
                    last_push = time.monotonic()
        except BaseException:
            self.error = traceback.format_exc()

    def step(self) -> Dict[str, float]:
        x, p, z = self.buffer.sample(self.s.batch_size, self.rng)
        r = self.model.train_on_batch(x, {"policy": p, "value": z[:, None]}, return_dict=True)
        rec = {"t": time.monotonic() - self._t0, "step": float(self.steps + 1)}
        for k in ("loss", "policy_loss", "value_loss"):
            if k in r:
                rec[k] = float(r[k])
        with self._lock:
            self.history.append(rec)
        self.steps += 1
        return rec

    def push(self) -> None:
        """Sends the weights to the evaluator if they changed since the last push."""
        if self._ev is None or self.steps == self._steps_at_push:
            return
        self.version = int(self._ev.set_weights(self.model.get_weights()))
        self._steps_at_push = self.steps
        self.pushes += 1
        self.push_log.append({"t": time.monotonic() - self._t0, "version": self.version,
                              "step": self.steps})

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30.0)
        if self.error is None:
            self.push()  # the last steps reach the evaluator too

    def abort(self) -> None:
        """Stops training without a last push."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def summary(self) -> Dict[str, Any]:
        h = self.history

        def mean(part: List[Dict[str, float]], key: str) -> Optional[float]:
            vals = [r[key] for r in part if key in r]
            return statistics.fmean(vals) if vals else None

        first, last = h[:10], h[-10:]
        return {"steps": self.steps, "pushes": self.pushes, "model_version": self.version,
                "batch_size": self.s.batch_size, "samples_in_buffer": len(self.buffer),
                "samples_added": self.buffer.added,
                "loss_first": mean(first, "loss"), "loss_last": mean(last, "loss"),
                "policy_loss_first": mean(first, "policy_loss"),
                "policy_loss_last": mean(last, "policy_loss"),
                "value_loss_first": mean(first, "value_loss"),
                "value_loss_last": mean(last, "value_loss"),
                "history": h[:: max(1, len(h) // 200)], "pushes_log": self.push_log}


# --------------------------------------------------------------------------- one mode


def _fmt_rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


class ModeRun:
    """One mode: start its evaluator (if any) and workers, let them play,
    measure the window, stop everything.  :meth:`run` returns the results."""

    def __init__(self, mode: str, s: Settings, display: Display, store: GameStore,
                 buffer: Optional[ReplayBuffer] = None, learner: Optional[Learner] = None) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        self.mode = mode
        self.s = s
        self.display = display
        self.store = store
        self.buffer = buffer
        self.learner = learner
        self.ctx: Any = mp.get_context("spawn")
        self.procs: List[Any] = []
        self.infos: Dict[int, Dict[str, Any]] = {}
        self.done: Dict[int, Dict[str, Any]] = {}
        self.ev: Any = None
        self.server: Any = None
        self.server_pid: Optional[int] = None
        self.requests: Any = None
        self.responses: List[Any] = []
        self.games_total = 0
        self.t_go = 0.0
        self._phase = ""
        self.pinned = False
        self.startup_s = 0.0

    # -- messages from the workers ------------------------------------------------

    def _handle(self, msg: Tuple[Any, ...]) -> None:
        kind, wid = msg[0], msg[1]
        if kind == "game":
            states, pol, z = self.store.add(self.mode, wid, msg[2], msg[3])
            self.games_total += 1
            if self.buffer is not None:
                self.buffer.add(states, pol, z)
        elif kind == "ready":
            self.infos[wid] = msg[2]
        elif kind == "done":
            self.done[wid] = msg[2]
        elif kind == "error":
            raise WorkerError(f"{self.mode} worker {wid} failed:\n{msg[2]}")

    def _drain(self, timeout: float = 0.0) -> None:
        """Handles every queued message; waits up to ``timeout`` for the first."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                msg = self.out_q.get(timeout=left) if left > 0 else self.out_q.get_nowait()
            except queue_mod.Empty:
                return
            self._handle(msg)
            deadline = 0.0  # after the first message, only what is already there

    def _check_alive(self) -> None:
        for i, p in enumerate(self.procs):
            if not p.is_alive() and i not in self.done:
                self._drain()  # its error message may be queued
                if i not in self.done:
                    raise WorkerError(f"{self.mode} worker {i} exited with code {p.exitcode}")
        if self.server is not None and not self.server.is_alive():
            raise WorkerError(f"the queue evaluator exited with code {self.server.exitcode}")
        if self.ev is not None and self.ev.stats()["state"] not in ("serving", "starting"):
            raise WorkerError(f"the shmeval evaluator is {self.ev.stats()['state']}")

    # -- start ----------------------------------------------------------------------

    def _start_process(self, target: Callable[..., None], name: str, args: Tuple[Any, ...]) -> Any:
        p = self.ctx.Process(target=target, name=name, args=args, daemon=True)
        # Started with SIGINT ignored, the child (a fresh interpreter) keeps
        # ignoring it: Ctrl-C is handled here, which stops the children.
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            p.start()
        finally:
            signal.signal(signal.SIGINT, old)
        return p

    def start(self) -> None:
        s, ctx = self.s, self.ctx
        t0 = time.monotonic()
        self.counters = ctx.RawArray("q", s.workers * NF)
        self.flags = ctx.RawArray("q", 4)
        self.go = ctx.Event()
        self.out_q = ctx.Queue()
        self.display.status(f"[{self.mode}] starting "
                            + ("the evaluator ..." if self.mode in ("shmeval", "queue")
                               else f"{s.workers} workers, each with its own TensorFlow ..."),
                            force=True)
        links: List[Any] = [None] * s.workers
        central = self.mode in ("shmeval", "queue")
        ev_cpus, worker_cpus = cpu_split(s.pin and central)
        self.pinned = ev_cpus is not None
        if self.mode == "shmeval":
            import shmeval

            G = s.games_per_worker
            self.ev = shmeval.Evaluator.spawn(
                functools.partial(_evaluator_factory, s.net, s.seed, s.tf_threads("shmeval"),
                                  ev_cpus, s.serving_threads, s.freeze,
                                  s.net_precision("shmeval") == "bfloat16"),
                input_shape=connect4.INPUT_SHAPE, outputs=OUTPUTS, max_batch=s.max_batch,
                max_clients=max(64, s.workers + 8), slots_per_client=min(64, max(16, G)),
                serving_threads=s.serving_threads)
            self.server_pid = self.ev.pid
            links = [self.ev] * s.workers
        elif self.mode == "queue":
            self.requests = ctx.Queue()
            self.responses = [ctx.SimpleQueue() for _ in range(s.workers)]
            self.q_counters = ctx.RawArray("q", 8)
            self.server_conn, child_end = ctx.Pipe()
            self.server = self._start_process(
                _queue_server_main, "selfplay-queue-evaluator",
                (s, self.requests, self.responses, self.q_counters, child_end, ev_cpus))
            child_end.close()
            links = [(self.requests, r) for r in self.responses]
        for i in range(s.workers):
            self.procs.append(self._start_process(
                _worker_main, f"selfplay-{self.mode}-{i}",
                (self.mode, i, s, self.counters, self.flags, self.go, self.out_q, links[i],
                 worker_cpus)))
        if self.server is not None:
            while not self.server_conn.poll(0.1):
                if not self.server.is_alive():
                    raise WorkerError(f"the queue evaluator exited with code "
                                      f"{self.server.exitcode} during start-up")
                self._drain()
                self._startup_status(t0)
            kind, detail = self.server_conn.recv()
            if kind != "ready":
                raise WorkerError(f"the queue evaluator failed to start:\n{detail}")
            self.server_pid = int(detail)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(self.infos) < s.workers:
            self._drain(TICK_S)
            self._check_alive()
            self._startup_status(t0)
            if time.monotonic() > deadline:
                raise WorkerError(f"{self.mode}: workers not ready within {READY_TIMEOUT_S:.0f} s")
        self.startup_s = time.monotonic() - t0

    def _startup_status(self, t0: float) -> None:
        self.display.status(f"[{self.mode}] starting: {len(self.infos)}/{self.s.workers} workers "
                            f"ready ({time.monotonic() - t0:.0f} s)")

    # -- the window -------------------------------------------------------------------

    def _snapshot(self) -> Dict[str, Any]:
        c = np.frombuffer(self.counters, dtype=np.int64).reshape(self.s.workers, NF).sum(axis=0)
        snap: Dict[str, Any] = {
            "t": time.monotonic(), "moves": int(c[MOVES]), "evals": int(c[EVALS]),
            "calls": int(c[CALLS]), "games": int(c[GAMES]), "eval_wall_ns": int(c[EVAL_WALL_NS]),
            "eval_cpu_ns": int(c[EVAL_CPU_NS]),
            "cpu_workers": sum(cpu_s(p.pid) for p in self.procs),
            "cpu_evaluator": cpu_s(self.server_pid) if self.server_pid else 0.0,
            "cpu_main": cpu_s(os.getpid()), "cpu_machine": machine_busy_s()}
        if self.ev is not None:
            st = self.ev.stats()
            snap.update(requests=int(st["requests"]), batches=int(st["batches"]),
                        model_s=float(st["model_time_share"]) * float(st["uptime_s"]),
                        overhead_s=float(st["overhead_us_per_batch"]) * int(st["batches"]) / 1e6,
                        model_version=int(st["model_version"]))
        elif self.server is not None:
            q = np.frombuffer(self.q_counters, dtype=np.int64)
            snap.update(requests=int(q[Q_ROWS]), batches=int(q[Q_BATCHES]),
                        messages=int(q[Q_REQUESTS]), model_s=q[Q_MODEL_NS] / 1e9,
                        overhead_s=(q[Q_BUSY_NS] - q[Q_MODEL_NS]) / 1e9)
        return snap

    @staticmethod
    def _mean_batch(a: Dict[str, Any], b: Dict[str, Any]) -> Optional[float]:
        if "batches" in a:
            nb = b["batches"] - a["batches"]
            return (b["requests"] - a["requests"]) / nb if nb else None
        nc = b["calls"] - a["calls"]
        return (b["evals"] - a["evals"]) / nc if nc else None

    def _live(self, phase: str, a: Dict[str, Any], b: Dict[str, Any]) -> None:
        dt = max(1e-9, b["t"] - a["t"])
        mb = self._mean_batch(a, b)
        if self.mode == "local":
            mb = 1.0
        text = (f"[{self.mode}] {phase} {b['t'] - self.t_go:5.1f} s  games {self.games_total:,}  "
                f"moves/s {_fmt_rate((b['moves'] - a['moves']) / dt)}  "
                f"evals/s {_fmt_rate((b['evals'] - a['evals']) / dt)}  "
                + (f"mean batch {mb:.1f}" if mb is not None else "mean batch -"))
        if self.ev is not None:
            text += f"  model v{b.get('model_version', 0)}"
        if self.learner is not None:
            loss = self.learner.loss
            text += f"  loss {loss:.3f}" if loss is not None else "  loss -"
            text += f"  buffer {len(self.learner.buffer):,}"
        self.display.status(text, force=phase != self._phase)
        self._phase = phase

    def measure(self) -> Dict[str, Any]:
        s = self.s
        self.t_go = time.monotonic()
        if self.learner is not None:
            self.learner.start(self.ev)
        self.go.set()
        start = self._snapshot()
        warm_end = self.t_go + s.warmup
        while time.monotonic() < warm_end:
            self._drain(min(TICK_S, max(0.0, warm_end - time.monotonic())))
            self._check_alive()
            self._live("warm-up", start, self._snapshot())
        games_before = self.games_total
        a = self._snapshot()
        t_end = a["t"] + s.seconds
        rss: Dict[int, List[float]] = {p.pid: [] for p in self.procs}
        server_rss: List[float] = []
        main_rss: List[float] = []
        marks = [a["t"] + f * s.seconds for f in (0.25, 0.5, 0.75)]
        while True:
            now = time.monotonic()
            if now >= t_end:
                break
            self._drain(min(TICK_S, t_end - now))
            self._check_alive()
            if self.learner is not None and self.learner.error:
                raise WorkerError(f"the learner failed:\n{self.learner.error}")
            if marks and time.monotonic() >= marks[0]:
                marks.pop(0)
                for pid in rss:
                    r = rss_mb(pid)
                    if r is not None:
                        rss[pid].append(r)
                if self.server_pid:
                    r = rss_mb(self.server_pid)
                    if r is not None:
                        server_rss.append(r)
                r = rss_mb(os.getpid())
                if r is not None:
                    main_rss.append(r)
            self._live("measuring", a, self._snapshot())
        b = self._snapshot()
        if not any(rss.values()):  # a very short window: sample once now
            for pid in rss:
                r = rss_mb(pid)
                if r is not None:
                    rss[pid].append(r)
        self._live("measured", a, b)
        self.display.end_status()
        train = None
        if self.learner is not None:
            self.learner.stop()
            if self.learner.error:
                raise WorkerError(f"the learner failed:\n{self.learner.error}")
            train = self.learner.summary()
        return self._result(a, b, games_before, rss, server_rss, main_rss, train)

    def _result(self, a: Dict[str, Any], b: Dict[str, Any], games_before: int,
                rss: Dict[int, List[float]], server_rss: List[float], main_rss: List[float],
                train: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        s = self.s
        dt = b["t"] - a["t"]
        per_worker_rss = [max(v) for v in rss.values() if v]
        leaves_per_call = (b["evals"] - a["evals"]) / max(1, b["calls"] - a["calls"])
        # Rows per call of the net: the evaluator's batches, or the workers' calls.
        mean_batch = 1.0 if self.mode == "local" else self._mean_batch(a, b)
        d = {k: b[k] - a[k] for k in a if isinstance(a[k], (int, float))}
        worker_time = dt * s.workers
        eval_cpu = d["eval_cpu_ns"] / 1e9
        r: Dict[str, Any] = {
            "mode": self.mode,
            "moves_per_s": d["moves"] / dt,
            "evals_per_s": d["evals"] / dt,
            "mean_batch": mean_batch,
            "worker_rss_mb": statistics.median(per_worker_rss) if per_worker_rss else None,
            "evaluator_rss_mb": max(server_rss) if server_rss else None,
            "main_rss_mb": max(main_rss) if main_rss else None,
            "games": d["games"],
            "games_received": self.games_total,
            "games_received_in_window": self.games_total - games_before,
            "moves": d["moves"], "evals": d["evals"], "evaluate_calls": d["calls"],
            "leaves_per_search_step": leaves_per_call,
            "window_s": dt, "startup_s": self.startup_s, "pinned": self.pinned,
            "evaluator_tf_threads": (s.tf_threads(self.mode)
                                     if self.mode in ("shmeval", "queue") else None),
            "tensorflow_in_workers": sum(bool(i.get("tensorflow")) for i in self.infos.values()),
            # As the workers reported it: one policy, or "mixed".
            "worker_sched": _one({i.get("sched") for i in self.infos.values()}),
            "precision": s.net_precision(self.mode),
            "probe": self.infos.get(0, {}).get("probe"),
            "cpu": {
                "workers_cores": d["cpu_workers"] / dt,
                "evaluator_cores": d["cpu_evaluator"] / dt if self.server_pid else None,
                "main_cores": d["cpu_main"] / dt,
                "machine_busy_cores": d["cpu_machine"] / dt,
                "other_cores": (d["cpu_machine"] - d["cpu_workers"] - d["cpu_evaluator"]
                                - d["cpu_main"]) / dt,
                # Inside evaluate_batch (waiting for or computing the net),
                # as a share of the workers' wall time and CPU time:
                "worker_wall_share_in_evaluate": d["eval_wall_ns"] / 1e9 / worker_time,
                "worker_cpu_s_in_evaluate": eval_cpu,
                "worker_cpu_s_outside_evaluate": d["cpu_workers"] - eval_cpu,
                "worker_cpu_us_per_move_outside_evaluate":
                    1e6 * (d["cpu_workers"] - eval_cpu) / d["moves"] if d["moves"] else None,
                "worker_cpu_us_per_eval_outside_evaluate":
                    1e6 * (d["cpu_workers"] - eval_cpu) / d["evals"] if d["evals"] else None,
            },
        }
        if "batches" in d:
            r["evaluator"] = {
                "batches": d["batches"], "rows": d["requests"],
                "model_busy_share": d["model_s"] / dt,
                "model_ms_per_batch": 1e3 * d["model_s"] / d["batches"] if d["batches"] else None,
                "model_us_per_row": 1e6 * d["model_s"] / d["requests"] if d["requests"] else None,
                "outside_model_us_per_batch":
                    1e6 * d["overhead_s"] / d["batches"] if d["batches"] else None,
            }
            if "messages" in d:
                r["evaluator"]["messages"] = d["messages"]
        if self.ev is not None:
            r["model_version"] = int(self.ev.stats()["model_version"])
        if train is not None:
            r["train"] = train
            r["pushes"] = train["pushes"]
            r["loss"] = train["loss_last"]
            r["model_version"] = int(self.ev.stats()["model_version"])
        return r

    # -- stop ---------------------------------------------------------------------------

    def stop(self, abort: bool = False) -> Dict[str, Any]:
        """Stops the workers (they finish their current search step), then
        the evaluator; kills what does not stop in time.  Returns what it
        had to kill."""
        t0 = time.monotonic()
        killed: List[str] = []
        # Ctrl-C (or SIGTERM) while stopping makes the stop quick instead of
        # interrupting it half-way; it is raised once everything is stopped.
        interrupted: List[int] = []

        def defer(signum: int, frame: Any) -> None:
            interrupted.append(signum)

        saved = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                saved[sig] = signal.signal(sig, defer)
        if self.learner is not None and abort:
            self.learner.abort()
        flags = getattr(self, "flags", None)
        if flags is not None:
            np.frombuffer(flags, dtype=np.int64)[STOP] = 1
            self.go.set()
        deadline = t0 + (1.5 if abort else 20.0)
        try:
            while any(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
                if interrupted:
                    deadline = min(deadline, time.monotonic() + 1.5)
                try:
                    self._drain(0.05)
                except WorkerError:
                    if not abort:
                        raise
        finally:
            for p in self.procs:
                if p.is_alive():
                    killed.append(p.name)
                    p.terminate()
            for p in self.procs:
                p.join(1.0)
                if p.is_alive():
                    p.kill()
                    p.join(1.0)
            with contextlib.suppress(Exception):
                self._drain()
            if self.ev is not None:
                self.ev.close(timeout=1.0 if abort else 10.0)
                self.ev = None
            if self.server is not None:
                self.server_pid = None
                with contextlib.suppress(Exception):
                    self.requests.put(None)
                self.server.join(1.0 if abort else 5.0)
                if self.server.is_alive():
                    killed.append(self.server.name)
                    self.server.terminate()
                    self.server.join(1.0)
                    if self.server.is_alive():
                        self.server.kill()
                        self.server.join(1.0)
                self.requests.cancel_join_thread()
                self.requests.close()
                for r in self.responses:
                    r.close()
                self.server_conn.close()
                self.server = None
            out_q = getattr(self, "out_q", None)
            if out_q is not None:
                out_q.cancel_join_thread()
                out_q.close()
            for sig, handler in saved.items():
                signal.signal(sig, handler)
        if interrupted and not abort:
            raise KeyboardInterrupt(f"signal {interrupted[0]}")
        return {"stop_s": time.monotonic() - t0, "killed": killed}

    def run(self) -> Dict[str, Any]:
        try:
            self.start()
            result = self.measure()
        except BaseException:
            self.display.end_status()
            self.stop(abort=True)
            raise
        result.update(self.stop())
        return result


# --------------------------------------------------------------------------- the command


#: The modes the summary compares shmeval with, in this order.
COMPARED = ("local", "queue", "local-batched")


def _ratios(results: Dict[str, Dict[str, Any]]) -> Dict[str, float]:
    out: Dict[str, float] = {}
    shm = results.get("shmeval")
    if shm is None:
        return out
    for other in COMPARED:
        o = results.get(other)
        if o is None:
            continue
        for k in ("moves_per_s", "evals_per_s"):
            if o[k]:
                out[f"shmeval/{other} {k}"] = shm[k] / o[k]
        if other == "local" and shm["worker_rss_mb"] and o["worker_rss_mb"]:
            out["worker RSS local/shmeval"] = o["worker_rss_mb"] / shm["worker_rss_mb"]
    return out


def round_ratios(runs: Dict[str, List[Dict[str, Any]]]) -> Dict[str, List[Optional[float]]]:
    """With --repeats: shmeval's moves/s over each other mode's, round by
    round (a round runs the modes one after the other, within a minute or
    two): the paired figures, which show how much of a ratio is the
    machine's window.  None where the other mode made no move; empty with
    fewer than two rounds."""
    out: Dict[str, List[Optional[float]]] = {}
    shm = runs.get("shmeval", [])
    for other in COMPARED:
        o = runs.get(other, [])
        if len(shm) < 2 or len(o) != len(shm):
            continue
        out[f"shmeval/{other} moves_per_s"] = [
            a["moves_per_s"] / b["moves_per_s"] if b["moves_per_s"] else None
            for a, b in zip(shm, o)]
    return out


#: Figures a mode's summary takes as the median over its runs (--repeats).
MEDIAN_FIELDS = ("moves_per_s", "evals_per_s", "mean_batch", "worker_rss_mb", "evaluator_rss_mb",
                 "games", "startup_s")


def combine_runs(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One mode's summary over its runs: the run with the median moves/s,
    the figures of MEDIAN_FIELDS (and the other load) replaced by their
    medians over all runs, ``range`` holding their [min, max] and ``runs``
    every run."""
    if len(runs) == 1:
        return runs[0]
    order = sorted(runs, key=lambda r: r["moves_per_s"])
    out = dict(order[len(order) // 2])
    out["cpu"] = dict(out["cpu"])
    out["range"] = {}
    for k in MEDIAN_FIELDS + ("other_cores",):
        vals = [r["cpu"][k] if k == "other_cores" else r[k] for r in runs]
        vals = [v for v in vals if v is not None]
        if not vals:
            continue
        med = statistics.median(vals)
        if k == "other_cores":
            out["cpu"][k] = med
        else:
            out[k] = med
        out["range"][k] = [min(vals), max(vals)]
    out["runs"] = runs
    return out


def format_table(results: Dict[str, Dict[str, Any]], workers: int) -> str:
    headers = ["mode", "moves/s", "evals/s", "mean batch", "games", "worker RSS MB",
               "evaluator RSS MB", "TF in workers", "start-up s", "other load"]
    rows = []

    def rate(r: Dict[str, Any], k: str) -> str:
        text = _fmt_rate(r[k])
        if "range" in r:
            lo, hi = r["range"][k]
            text += f" [{_fmt_rate(lo)}-{_fmt_rate(hi)}]"
        return text

    for mode, r in results.items():
        rows.append([mode, rate(r, "moves_per_s"), rate(r, "evals_per_s"),
                     f"{r['mean_batch']:.1f}" if r["mean_batch"] else "-", f"{round(r['games']):,}",
                     f"{r['worker_rss_mb']:.0f}" if r["worker_rss_mb"] else "-",
                     f"{r['evaluator_rss_mb']:.0f}" if r["evaluator_rss_mb"] else "-",
                     f"{r['tensorflow_in_workers']}/{workers}", f"{r['startup_s']:.1f}",
                     f"{r['cpu']['other_cores']:.2f}"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                       for i, (h, w) in enumerate(zip(headers, widths)))]
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def run(s: Settings, modes: Sequence[str], display: Optional[Display] = None,
        games_path: Optional[str] = None, load_games_path: Optional[str] = None,
        json_path: Optional[str] = None) -> Dict[str, Any]:
    """Runs ``modes`` one after the other with settings ``s``; prints the
    live status and the summary; returns everything the JSON holds."""
    s.check()
    if s.train and list(modes) != ["shmeval"]:
        raise ValueError("--train runs in shmeval mode only (the learner pushes its weights "
                         "into the shmeval evaluator)")
    display = display or Display()
    began = time.monotonic()
    machine = machine_info()
    store = GameStore()
    buffer: Optional[ReplayBuffer] = None
    learner: Optional[Learner] = None
    if importlib.util.find_spec("tensorflow") is None:
        raise ValueError("the self-play demo needs TensorFlow: pip install 'shmeval[tensorflow]'")
    if load_games_path and not s.train:
        raise ValueError("--load-games seeds the learner's replay buffer: use it with --train")
    loaded = load_games(load_games_path) if load_games_path else None
    net = s.net
    display.line(
        f"shmeval selfplay: Connect Four, {s.workers} workers x {s.games_per_worker} games, "
        f"{s.simulations} simulations/move; net {net.blocks} residual blocks x {net.filters} "
        f"filters; modes {', '.join(modes)}; {s.seconds:g} s each after {s.warmup:g} s warm-up; "
        f"central evaluators' TF threads: shmeval {s.tf_threads('shmeval') or 'default'}, "
        f"queue {s.tf_threads('queue') or 'default'}; workers "
        f"{'under SCHED_BATCH' if s.worker_policy() == 'batch' else 'scheduled normally'}"
        f"; weights "
        f"{'folded into the graph' if s.freeze else 'in variables'}; net in "
        + ", ".join(f"{m} {s.net_precision(m)}" for m in modes)
        + ("; central evaluator pinned to its own CPU" if s.pin else ""))
    if s.train:
        buffer = ReplayBuffer(s.buffer_size)
        if loaded is not None:
            buffer.add_games(loaded)
        display.line(f"learner: builds the net in this process (TensorFlow, "
                     f"{s.learner_threads or 'default'} thread(s)), minibatches of "
                     f"{s.batch_size}, pushes weights every {s.push_every:g} s; replay buffer "
                     f"seeded with {len(buffer):,} samples")
        learner = Learner(s, buffer)
    runs: Dict[str, List[Dict[str, Any]]] = {m: [] for m in modes}
    for round_ in range(s.repeats):
        if s.repeats > 1:
            display.line(f"round {round_ + 1} of {s.repeats}")
        for mode in modes:
            r = ModeRun(mode, s, display, store, buffer, learner).run()
            runs[mode].append(r)
            if r["tensorflow_in_workers"] and mode in ("shmeval", "queue"):
                display.line(f"warning: {r['tensorflow_in_workers']} {mode} workers "
                             "imported TensorFlow")
    results = {m: combine_runs(rs) for m, rs in runs.items()}
    wall = time.monotonic() - began
    display.line()
    if s.repeats > 1:
        display.line(f"medians [min-max] of {s.repeats} runs per mode")
    display.line(format_table(results, s.workers))
    busy = [m for m, r in results.items() if r["cpu"]["other_cores"] > OTHER_LOAD_WARN]
    if busy:
        display.line(f"warning: other programs kept the CPUs busy during the window of "
                     f"{', '.join(busy)} ('other load', in cores): those figures are skewed")
    ratios = _ratios(results)
    if ratios:
        display.line("ratios: " + "; ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    paired = round_ratios(runs)
    if paired:
        display.line("round by round: " + "; ".join(
            f"{k} " + " ".join("-" if v is None else f"{v:.2f}x" for v in vs)
            for k, vs in paired.items()))
    for mode, r in results.items():
        if "train" in r:
            t = r["train"]
            lf, ll = t["loss_first"], t["loss_last"]
            display.line(f"learner: {t['steps']} steps of {t['batch_size']}, {t['pushes']} weight "
                         f"pushes, model version {r['model_version']}, loss "
                         + (f"{lf:.3f} (first 10 steps) -> {ll:.3f} (last 10)"
                            if lf is not None and ll is not None else "- (no training step)"))
        elif mode == "shmeval":
            display.line(f"shmeval workers that imported TensorFlow: "
                         f"{r['tensorflow_in_workers']} of {s.workers}")
    out: Dict[str, Any] = {
        "settings": {**asdict(s), "modes": list(modes)}, "machine": machine,
        "modes": results, "ratios": ratios, "round_ratios": paired, "wall_s": wall,
        "games_received": len(store), "loaded_samples": len(loaded) if loaded is not None else 0}
    if games_path:
        meta = {"settings": out["settings"], "machine": machine}
        save_games(games_path, store.to_games(meta))
        display.line(f"games: {len(store):,} finished games, {sum(len(m) for m in store.moves):,} "
                     f"positions -> {games_path}")
        out["games_path"] = games_path
    if json_path:
        d = os.path.dirname(os.path.abspath(json_path))
        os.makedirs(d, exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1, default=json_default)
        display.line(f"results: {json_path}")
    display.line(f"wall time {wall:.0f} s")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Settings()
    n = NetConfig()
    p.add_argument("--mode", choices=MODES, default="shmeval",
                   help="how the workers reach the net (default shmeval)")
    p.add_argument("--compare", action="store_true",
                   help=f"run {', '.join(COMPARE_MODES)} one after the other, same settings")
    p.add_argument("--workers", type=int, default=d.workers, help=f"(default {d.workers})")
    p.add_argument("--games-per-worker", type=int, default=d.games_per_worker,
                   help=f"games each worker plays at once, leaves evaluated together "
                        f"(default {d.games_per_worker})")
    p.add_argument("--simulations", type=int, default=d.simulations,
                   help=f"MCTS simulations per move (default {d.simulations})")
    p.add_argument("--seconds", type=float, default=d.seconds,
                   help=f"measured window per mode (default {d.seconds:g})")
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="run each mode this many times (with --compare: in rounds, "
                        "shmeval, queue, local, shmeval, ...) and report medians (default 1)")
    p.add_argument("--warmup", type=float, default=d.warmup,
                   help=f"seconds of play before the window opens (default {d.warmup:g})")
    p.add_argument("--seed", type=int, default=d.seed, help="initial weights and games (default 0)")
    p.add_argument("--evaluator-threads", type=int, default=d.evaluator_threads,
                   help="TensorFlow intra/inter-op threads of the central evaluators (shmeval "
                        "and queue; 0 = TensorFlow's default of one per core). Default: each "
                        "mode's best on a 2-core machine: 1 for shmeval (its serving threads "
                        "use the cores), TensorFlow's default for queue (its one evaluator "
                        "thread needs TensorFlow's pool to use both)")
    p.add_argument("--serving-threads", type=int, default=d.serving_threads,
                   help="shmeval mode: model calls the evaluator runs at once (Evaluator("
                        "serving_threads=...)): while one batch is computed the next is "
                        f"gathered and computed on another core (default {d.serving_threads})")
    p.add_argument("--worker-sched", choices=("auto", "normal", "batch"), default=d.worker_sched,
                   help="scheduling policy of every mode's workers: batch puts them under "
                        "SCHED_BATCH (shmeval.use_batch_scheduling: a woken worker does not "
                        "preempt the running evaluator or model), normal leaves the default. "
                        "Default auto: batch when the workers outnumber the CPUs")
    p.add_argument("--no-freeze", action="store_true",
                   help="every mode: run the net with its weights in variables instead of "
                        "folded into the graph as constants and run in the calling thread "
                        "(TFModel(freeze=True), a FrozenGraph in the queue and local modes: "
                        "cheaper calls; docs/performance.md findings 27 and 30)")
    p.add_argument("--precision", choices=("auto", "float32", "bfloat16"), default=d.precision,
                   help="what every mode's frozen net computes in: bfloat16 lets TensorFlow's "
                        "oneDNN rewrite run the convolutions in bfloat16 (19-33%% less per "
                        "row from 16 rows on, on CPUs with native bfloat16; outputs move by "
                        "about 1e-3; CPU only). Default auto: bfloat16 on such CPUs "
                        "(avx512_bf16 or amx_bf16) when no GPU is visible, for every mode but "
                        "local, whose one-row calls are faster in float32")
    p.add_argument("--pin", action="store_true",
                   help="give the central evaluator (shmeval, queue) a CPU of its own and "
                        "keep the workers on the others (needs 2+ CPUs; local modes are not "
                        "pinned)")
    p.add_argument("--max-batch", type=int, default=d.max_batch,
                   help=f"most rows per model call of the central evaluators (default {d.max_batch})")
    p.add_argument("--blocks", type=int, default=n.blocks, help=f"residual blocks (default {n.blocks})")
    p.add_argument("--filters", type=int, default=n.filters,
                   help=f"conv filters (default {n.filters})")
    p.add_argument("--json", metavar="PATH", help="write settings, machine and results here")
    p.add_argument("--games", metavar="PATH.npz", help="save the finished games here")
    p.add_argument("--train", action="store_true",
                   help="shmeval mode: train the net on the games in this process and push the "
                        "weights into the running evaluator")
    p.add_argument("--push-every", type=float, default=d.push_every,
                   help=f"seconds between weight pushes (default {d.push_every:g})")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"learner minibatch (default {d.batch_size})")
    p.add_argument("--buffer-size", type=int, default=d.buffer_size,
                   help=f"replay buffer samples (default {d.buffer_size:,})")
    p.add_argument("--sample-reuse", type=float, default=d.sample_reuse,
                   help=f"the learner trains while each sample added has been drawn fewer "
                        f"than this many times on average (default {d.sample_reuse:g})")
    p.add_argument("--learning-rate", type=float, default=n.learning_rate,
                   help=f"Adam (default {n.learning_rate:g})")
    p.add_argument("--load-games", metavar="PATH.npz",
                   help="seed the replay buffer with games saved by --games")


def settings_from_args(args: argparse.Namespace) -> Settings:
    net = replace(NetConfig(), blocks=args.blocks, filters=args.filters,
                  learning_rate=args.learning_rate)
    return Settings(workers=args.workers, games_per_worker=args.games_per_worker,
                    simulations=args.simulations, seconds=args.seconds, warmup=args.warmup,
                    repeats=args.repeats,
                    seed=args.seed, evaluator_threads=args.evaluator_threads,
                    serving_threads=args.serving_threads, worker_sched=args.worker_sched,
                    freeze=not args.no_freeze, precision=args.precision,
                    max_batch=args.max_batch, pin=args.pin, net=net, train=args.train,
                    push_every=args.push_every, batch_size=args.batch_size,
                    buffer_size=args.buffer_size, sample_reuse=args.sample_reuse)


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(args: argparse.Namespace) -> int:
    """``shmeval selfplay``: returns the exit code."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # inherited by every child
    modes = list(COMPARE_MODES) if args.compare else [args.mode]
    display = Display()
    try:
        s = settings_from_args(args)
        s.check()
    except ValueError as e:
        print(f"shmeval selfplay: {e}", file=sys.stderr)
        return 2
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        run(s, modes, display, games_path=args.games, load_games_path=args.load_games,
            json_path=args.json)
    except KeyboardInterrupt:
        display.end_status()
        print("\ninterrupted: every process stopped", file=sys.stderr)
        return 130
    except (WorkerError, ValueError) as e:
        display.end_status()
        print(f"\nshmeval selfplay failed: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old)
    return 0


__all__ = ["Settings", "Games", "GameStore", "ReplayBuffer", "Learner", "ModeRun", "Display",
           "WorkerError", "load_games", "save_games", "mirror_samples", "replay_game", "run",
           "main", "add_arguments", "MODES", "COMPARE_MODES"]
