"""What a self-play run depends on: :class:`Settings`, recorded in the
JSON and the games file, and the defaults each mode derives from them."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Union

from .._util.simdevice import SimSpec, parse_device
from ..backends._device import cpu_bfloat16, gpu_visible
from ..games.connect4_net import NetConfig

#: The ways the workers reach the net (see :mod:`shmeval.selfplay.modes`).
MODES = ("shmeval", "queue", "local", "local-batched")
#: What ``--compare`` runs unless told otherwise, in this order: shmeval
#: and the two baselines a user would build (``local``, one call per leaf,
#: only on request: it adds half a minute and compares with what nobody
#: would run).
COMPARE_MODES = ("shmeval", "queue", "local-batched")
#: The most games a pipelined worker keeps in flight: an evaluator client's
#: slots (``slots_per_client`` <= 64), one per game.
MAX_PIPELINED_GAMES = 64


@dataclass(frozen=True)
class CacheSetting:
    """Where a mode's workers find answers before they reach the net:
    ``kind`` "shared" (the shmeval evaluator's table), "per worker" (a
    table in each worker, ``--local-cache``) or "none"; ``entries`` the
    shared table's, or each worker's."""

    kind: str
    entries: int = 0

    @property
    def per_worker(self) -> int:
        """Entries of each worker's own table (0: none)."""
        return self.entries if self.kind == "per worker" else 0

    def label(self) -> str:
        """As the summary names it: "shared 262,144", "per worker 8,192", "none"."""
        return self.kind if self.kind == "none" else f"{self.kind} {self.entries:,}"

    def to_json(self) -> Dict[str, Any]:
        return {"kind": self.kind, "entries": self.entries}


NO_CACHE = CacheSetting("none")


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on (recorded in the JSON and the .npz)."""

    workers: int = 8
    games_per_worker: int = 16
    simulations: int = 32
    #: Groups of games_per_worker games per worker, each searched while the
    #: others' leaves are evaluated (Client.submit); 1: the blocking search.
    pipeline: int = 1
    #: Entries of the shmeval evaluator's shared evaluation cache (0: none;
    #: a power of two).  On by default: 16 MiB hold about all the demo
    #: revisits (bench/cache.py), and a miss costs well under a microsecond.
    #: ``--compare`` defaults to 0 (the cli), every mode without a cache.
    cache: int = 1 << 18
    #: Entries of a cache in each worker (a dict, least recently used out;
    #: 0: none): the per-process scheme, in the modes without the shared
    #: one (:meth:`Settings.cache_of`).
    local_cache: int = 0
    seconds: float = 10.0
    warmup: float = 1.0
    repeats: int = 1
    seed: int = 0
    evaluator_threads: Optional[int] = None
    #: The shmeval evaluator's serving_threads ("auto": its tuner's choice).
    serving_threads: Union[int, str] = "auto"
    worker_sched: str = "auto"
    freeze: bool = True
    precision: str = "auto"
    max_batch: int = 256
    pin: bool = False
    #: Where the net's calls go: "cpu" (as they are) or a simulated GPU,
    #: "sim:CALL_US,ROW_US" (shmeval._util.simdevice): one device for every
    #: process of a mode's run, one call at a time.
    device: str = "cpu"
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
    # the arena (train=True): 0 plays no match
    eval_every: float = 0.0
    eval_games: int = 40

    def worker_policy(self, cpus: Optional[int] = None) -> str:
        """Scheduling policy of every mode's workers, "batch" (``SCHED_BATCH``,
        :func:`shmeval.use_batch_scheduling`) or "normal": ``worker_sched``
        when set, else ("auto") batch when the workers outnumber the CPUs
        (``cpus``, default: those this process may use).  On a 2-core
        machine with 8 workers batch raises every mode a little
        (docs/selfplay.md): a woken worker does not preempt the running
        evaluator or model."""
        if self.worker_sched != "auto":
            return self.worker_sched
        if cpus is None:
            cpus = len(os.sched_getaffinity(0))
        return "batch" if self.workers > cpus else "normal"

    def cache_of(self, shared: bool) -> CacheSetting:
        """The one cache of a mode whose evaluator has a shared table
        (``shared``: the shmeval mode) or has none: the shared table when
        ``cache`` is set, else a table in each worker when ``local_cache``
        is, else none.  One cache per mode, so that a comparison compares
        caches (shared against per worker), not one cache against two."""
        if shared and self.cache:
            return CacheSetting("shared", self.cache)
        if self.local_cache:
            return CacheSetting("per worker", self.local_cache)
        return NO_CACHE

    def sim(self) -> Optional[SimSpec]:
        """The simulated GPU's costs, or None when the net runs as it is."""
        return parse_device(self.device)

    def calls_in_flight(self) -> int:
        """The most model calls the shmeval evaluator keeps in flight:
        ``serving_threads``, or with "auto" the two ``TFModel`` allows."""
        return self.serving_threads if isinstance(self.serving_threads, int) else 2

    def net_precision(self, batched: bool) -> str:
        """What the net computes in, "bfloat16" or "float32", in a mode
        that calls it with batches of rows (``batched``) or one row at a
        time: ``precision`` when set, else ("auto") the faster one:
        bfloat16 when the net is frozen, runs on the CPU (no GPU visible:
        :func:`shmeval.backends._device.gpu_visible`), the CPU computes in
        bfloat16 natively (:func:`shmeval.backends._device.cpu_bfloat16`)
        and the calls are batched (19-33% less per row from 16 rows on);
        float32 for calls of one row, which cost about 9% more in bfloat16
        (``bench/tf_model_cost.py --net selfplay --freeze --bfloat16``,
        docs/performance.md)."""
        if self.precision != "auto":
            return self.precision
        on_cpu = not gpu_visible()
        return ("bfloat16" if self.freeze and batched and on_cpu and cpu_bfloat16()
                else "float32")

    def check(self) -> None:
        if self.workers < 1 or self.games_per_worker < 1 or self.simulations < 1:
            raise ValueError("workers, games per worker and simulations must be >= 1")
        if self.pipeline < 1:
            raise ValueError("pipeline must be >= 1")
        if self.pipeline > 1 and self.pipeline * self.games_per_worker > MAX_PIPELINED_GAMES:
            raise ValueError(f"--pipeline x --games-per-worker must be at most "
                             f"{MAX_PIPELINED_GAMES} (a worker's slots), got {self.pipeline} x "
                             f"{self.games_per_worker}")
        if self.cache:
            from .._ring import cache_log2_of
            cache_log2_of(self.cache)  # ValueError naming the limits
        if self.local_cache < 0:
            raise ValueError(f"local_cache must be >= 0, got {self.local_cache}")
        if not self.seconds > 0 or self.warmup < 0 or self.repeats < 1:
            raise ValueError("seconds must be > 0, warmup >= 0 and repeats >= 1")
        if self.train and self.repeats != 1:
            raise ValueError("--train runs once (no --repeats)")
        if (self.evaluator_threads or 0) < 0 or self.learner_threads < 0:
            raise ValueError("thread counts must be >= 0 (0: TensorFlow's default)")
        if self.serving_threads != "auto" and not (
                isinstance(self.serving_threads, int) and 1 <= self.serving_threads <= 8):
            raise ValueError(f"serving threads must be 'auto' or from 1 to 8, "
                             f"got {self.serving_threads!r}")
        if self.worker_sched not in ("auto", "normal", "batch"):
            raise ValueError(f"worker_sched must be auto, normal or batch, "
                             f"got {self.worker_sched!r}")
        parse_device(self.device)  # ValueError saying what is wrong
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
        if self.eval_every < 0 or self.eval_games < 1:
            raise ValueError("need eval_every >= 0 and eval_games >= 1")
        if self.eval_every and not self.train:
            raise ValueError("--eval-every measures the learner's progress: use it with --train")
