"""``shmeval selfplay --ray [ADDRESS] --nodes N``: the self-play demo on a
Ray cluster.

One evaluator per node (:class:`~shmeval.ray.ClusterEvaluator`, the
shmeval mode's TensorFlow net) and ``--workers`` worker actors per node,
each playing as a ``shmeval selfplay`` worker does (the same search loop)
and evaluating through its own node's evaluator's shared memory.  The
driver collects the finished games and the counters twice a second (Ray
calls, never per evaluation); with ``--train`` its learner pushes the
weights to every node.  A node that leaves takes its workers with it and
the others keep playing; a node that joins gets an evaluator and workers.
Without ADDRESS the cluster is simulated on this machine.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import queue
import threading
import time
import traceback
from dataclasses import asdict
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .. import mcts
from .._util.display import Display, fmt_rate
from .._util.jsonout import write_json
from .._util.machine import machine_info
from ..sched import use_batch_scheduling
from ..selfplay.errors import WorkerError
from ..selfplay.learner import Learner
from ..selfplay.modes import ShmevalMode
from ..selfplay.records import GameStore, load_games, save_games
from ..selfplay.replay_buffer import ReplayBuffer
from ..selfplay.settings import Settings
from ..selfplay.worker import (EVALS, GAMES, MOVES, N_FLAGS, NF, STOP, _play, _Stopped,
                               probe_states)
from .cluster_evaluator import ClusterEvaluator
from .simulated import simulated_cluster

#: Seconds between two polls of the workers.
TICK_S = 0.5
#: How long the nodes' evaluators and workers may take to start.
START_TIMEOUT_S = 600.0
#: Nodes of the simulated cluster when --nodes is not given.
DEFAULT_NODES = 2


class SelfPlayWorker:
    """A self-play worker on one node, as a Ray actor: the search loop of
    ``shmeval selfplay``'s workers in a thread, evaluating through this
    node's evaluator; :meth:`poll` hands over its counters and finished
    games (a second actor thread answers while the first plays)."""

    def __init__(self, wid: int, s: Settings, evaluators: Any) -> None:
        if s.worker_policy() == "batch":
            use_batch_scheduling()
        self.wid = wid
        self.s = s
        self.node_id = str(ray.get_runtime_context().get_node_id())
        self.inner = mcts.evaluator_fn(evaluators.connect(timeout=START_TIMEOUT_S))
        self.inner(probe_states())  # attached and answered before the clock starts
        # _play indexes a run-wide counter array by worker id: this worker
        # holds the rows up to its own and reads its own.
        self.counters = np.zeros((wid + 1) * NF, np.int64)
        self.flags = np.zeros(N_FLAGS, np.int64)
        self.games: "queue.SimpleQueue[Tuple[Any, ...]]" = queue.SimpleQueue()
        self.error: Optional[str] = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with contextlib.suppress(_Stopped):
                _play(self.wid, self.s, self.inner, self.counters, self.flags, self.games)
        except BaseException:
            self.error = traceback.format_exc()

    def start(self) -> str:
        """Starts playing; returns this worker's node id."""
        self.thread.start()
        return self.node_id

    def poll(self) -> Tuple[List[int], List[Tuple[Any, ...]], Optional[str]]:
        """This worker's counters, the games finished since the last poll,
        and its error if it failed."""
        games = []
        while True:
            try:
                games.append(self.games.get_nowait())
            except queue.Empty:
                break
        own = self.counters[self.wid * NF:(self.wid + 1) * NF]
        return own.tolist(), games, self.error

    def stop(self) -> None:
        """Stops after the current search step."""
        self.flags[STOP] = 1
        self.thread.join(60.0)


_remote_worker = ray.remote(num_cpus=1, max_concurrency=2)(SelfPlayWorker)


@contextlib.contextmanager
def _cluster(address: Optional[str], nodes: Optional[int], workers: int,
             display: Display) -> Iterator[str]:
    """Connects to the cluster at ``address`` (waiting for ``nodes`` nodes
    when given), or simulates one of ``nodes`` here; yields its description."""
    if address is None:
        n = nodes or DEFAULT_NODES
        display.status(f"[ray] starting a simulated cluster of {n} nodes ...", force=True)
        # Each node declares a CPU per worker: Ray places them all.
        with simulated_cluster(n, num_cpus=workers + 1):
            yield f"simulated, {n} nodes on this machine"
        return
    ray.init(address=address, logging_level=logging.WARNING)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while nodes and len(_alive()) < nodes:
            if time.monotonic() > deadline:
                raise WorkerError(f"the cluster at {address} has {len(_alive())} nodes, "
                                  f"not {nodes}, after {START_TIMEOUT_S:.0f} s")
            display.status(f"[ray] waiting for {nodes} nodes: {len(_alive())} alive")
            time.sleep(1.0)
        yield f"{address}, {len(_alive())} nodes"
    finally:
        ray.shutdown()


def _alive() -> List[str]:
    return [n["NodeID"] for n in ray.nodes() if n["Alive"]]


class RayRun:
    """The workers of every node, their counters and games, and the nodes
    that come and go while they play."""

    def __init__(self, s: Settings, evaluators: ClusterEvaluator, store: GameStore,
                 buffer: Optional[ReplayBuffer], display: Display) -> None:
        self.s = s
        self.evaluators = evaluators
        self.store = store
        self.buffer = buffer
        self.display = display
        self.workers: Dict[int, Any] = {}       # worker id -> actor
        self.node_of: Dict[int, str] = {}       # worker id -> node id
        self.counters: Dict[int, List[int]] = {}  # last counters of every worker ever
        self.gone: set[int] = set()             # workers whose node left
        self.nodes_seen: set[str] = set()
        self.nodes_left: set[str] = set()
        self.games = 0

    def add_nodes(self, nodes: List[str]) -> List[Any]:
        """Starts ``--workers`` workers on each of ``nodes``; returns their
        start calls (each answers its node id once playing)."""
        started = []
        for node_id in nodes:
            self.nodes_seen.add(node_id)
            for _ in range(self.s.workers):
                wid = len(self.node_of)
                actor = _remote_worker.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                ).remote(wid, self.s, self.evaluators)
                self.workers[wid], self.node_of[wid] = actor, node_id
                self.counters[wid] = [0] * NF
                started.append(actor.start.remote())
        return started

    def start(self) -> None:
        started = self.add_nodes(_alive())
        try:
            ray.get(started, timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise WorkerError(f"the workers did not start within {START_TIMEOUT_S:.0f} s (does "
                              f"every node have {self.s.workers} CPUs for Ray?)") from None
        except ray.exceptions.RayError as e:
            raise WorkerError(f"a worker failed to start: {e}") from None

    def poll(self) -> None:
        """Collects counters and games; forgets the workers of nodes that
        left; starts workers on nodes that joined."""
        live = {w: a for w, a in self.workers.items() if w not in self.gone}
        refs = {w: a.poll.remote() for w, a in live.items()}
        for wid, ref in refs.items():
            try:
                counters, games, error = ray.get(ref, timeout=60.0)
            except ray.exceptions.RayActorError:
                self.gone.add(wid)
                continue
            if error:
                raise WorkerError(f"worker {wid} on Ray node {self.node_of[wid]} failed:\n{error}")
            self.counters[wid] = counters
            for _, _, moves, policies in games:
                states, pol, z = self.store.add("shmeval", wid, moves, policies)
                if self.buffer is not None:
                    self.buffer.add(states, pol, z)
                self.games += 1
        # A node has left when none of its workers answers any more.
        lost = ({self.node_of[w] for w in self.gone}
                - {self.node_of[w] for w in refs if w not in self.gone})
        for node_id in sorted(lost - self.nodes_left):
            self.display.line(f"Ray node {node_id[:8]} left with its workers; the others play on")
        self.nodes_left |= lost
        joined = [n for n in _alive() if n not in self.nodes_seen]
        for node_id in joined:
            self.display.line(f"Ray node {node_id[:8]} joined: its evaluator and "
                              f"{self.s.workers} workers start")
        self.add_nodes(joined)

    def totals(self) -> Dict[str, Any]:
        c = np.array(list(self.counters.values()), np.int64).reshape(-1, NF).sum(axis=0)
        return {"t": time.monotonic(), "moves": int(c[MOVES]), "evals": int(c[EVALS]),
                "games": int(c[GAMES])}

    def per_node(self) -> Dict[str, Dict[str, int]]:
        out: Dict[str, Dict[str, int]] = {}
        for wid, c in self.counters.items():
            d = out.setdefault(self.node_of[wid], {"workers": 0, "moves": 0, "evals": 0})
            d["workers"] += 1
            d["moves"] += c[MOVES]
            d["evals"] += c[EVALS]
        return out

    def stop(self) -> None:
        live = [a for w, a in self.workers.items() if w not in self.gone]
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get([a.stop.remote() for a in live], timeout=90.0)
            self.poll()  # the games finished since the last poll
        for a in self.workers.values():
            ray.kill(a)


def run_on_ray(s: Settings, display: Display, address: Optional[str], nodes: Optional[int],
               games_path: Optional[str] = None, load_games_path: Optional[str] = None,
               json_path: Optional[str] = None) -> Dict[str, Any]:
    """Plays on the Ray cluster at ``address`` (None: ``nodes`` simulated
    here) with ``s.workers`` workers per node; prints the live status and
    the summary; returns everything the JSON holds."""
    s.check()
    if s.repeats != 1 or s.pin or s.eval_every:
        raise ValueError("--ray runs once, without --repeats, --pin or --eval-every")
    if nodes is not None and nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {nodes}")
    if importlib.util.find_spec("tensorflow") is None:
        raise ValueError("the self-play demo needs TensorFlow: pip install 'shmeval[tensorflow]'")
    if load_games_path and not s.train:
        raise ValueError("--load-games seeds the learner's replay buffer: use it with --train")
    began = time.monotonic()
    machine = machine_info(tensorflow=("tensorflow", "tensorflow-cpu"), ray=("ray",))
    store = GameStore()
    buffer = ReplayBuffer(s.buffer_size) if s.train else None
    if buffer is not None and load_games_path:
        buffer.add_games(load_games(load_games_path))
    learner = Learner(s, buffer) if buffer is not None else None
    mode = ShmevalMode(s)
    factory, kwargs = mode.spawn_args(None)
    with _cluster(address, nodes, s.workers, display) as where:
        display.line(f"shmeval selfplay on Ray ({where}): one evaluator per node, "
                     f"{s.workers} workers x {s.games_per_worker} games per node, "
                     f"{s.simulations} simulations/move; net {s.net.blocks} x {s.net.filters}"
                     + ("; learner in this process pushes to every node" if learner else ""))
        display.status("[ray] starting the evaluators ...", force=True)
        with ClusterEvaluator(factory, start_timeout=START_TIMEOUT_S, **kwargs) as evaluators:
            run = RayRun(s, evaluators, store, buffer, display)
            display.status("[ray] starting the workers ...", force=True)
            t0 = time.monotonic()
            try:
                run.start()
                startup_s = time.monotonic() - t0
                if learner is not None:
                    learner.start(evaluators)
                result = _measure(s, run, evaluators, learner, display)
            except BaseException:
                if learner is not None:
                    learner.abort()
                raise
            finally:
                run.stop()
            result["startup_s"] = startup_s
            stats = evaluators.stats()
        result["nodes"] = _node_table(run, stats, result["window_s"], result.pop("at_start"))
    display.end_status()
    wall = time.monotonic() - began
    _print_summary(display, result)
    out: Dict[str, Any] = {"settings": {**asdict(s), "ray": address or "simulated",
                                        "nodes": nodes}, "machine": machine,
                           "ray": result, "wall_s": wall, "games_received": len(store)}
    if games_path:
        save_games(games_path, store.to_games({"settings": out["settings"], "machine": machine}))
        display.line(f"games: {len(store):,} finished games -> {games_path}")
    if json_path:
        write_json(json_path, out)
        display.line(f"results: {json_path}")
    display.line(f"wall time {wall:.0f} s")
    return out


def _measure(s: Settings, run: RayRun, evaluators: ClusterEvaluator,
             learner: Optional[Learner], display: Display) -> Dict[str, Any]:
    """Warm-up, then the measured window; returns the totals over it."""
    t_go = time.monotonic()
    a = run.totals()
    at_start = run.per_node()
    for phase, until in (("warm-up", t_go + s.warmup), ("measuring", t_go + s.warmup + s.seconds)):
        if phase == "measuring":
            a = run.totals()
            at_start = run.per_node()
        while time.monotonic() < until:
            time.sleep(min(TICK_S, max(0.0, until - time.monotonic())))
            run.poll()
            if learner is not None and learner.error:
                raise WorkerError(f"the learner failed:\n{learner.error}")
            b = run.totals()
            dt = max(1e-9, b["t"] - a["t"])
            live = len(run.workers) - len(run.gone)
            text = (f"[ray] {phase} {b['t'] - t_go:5.1f} s  nodes "
                    f"{len(run.nodes_seen - run.nodes_left)}  workers {live}  games {run.games:,}  "
                    f"moves/s {fmt_rate((b['moves'] - a['moves']) / dt)}  "
                    f"evals/s {fmt_rate((b['evals'] - a['evals']) / dt)}  "
                    f"model v{evaluators.model_version}")
            if learner is not None and learner.loss is not None:
                text += f"  loss {learner.loss:.3f}"
            display.status(text)
    b = run.totals()
    dt = b["t"] - a["t"]
    result: Dict[str, Any] = {
        "moves_per_s": (b["moves"] - a["moves"]) / dt,
        "evals_per_s": (b["evals"] - a["evals"]) / dt,
        "games_in_window": b["games"] - a["games"], "window_s": dt, "at_start": at_start,
        "workers": len(run.workers), "workers_lost": len(run.gone),
        "model_version": evaluators.model_version}
    if learner is not None:
        learner.stop()
        if learner.error:
            raise WorkerError(f"the learner failed:\n{learner.error}")
        result["train"] = learner.summary()
        result["model_version"] = evaluators.model_version
    return result


def _node_table(run: RayRun, stats: Dict[str, Dict[str, Any]], window_s: float,
                at_start: Dict[str, Dict[str, int]]) -> Dict[str, Dict[str, Any]]:
    """Per node: its workers' rates over the window, its evaluator's figures."""
    out = {}
    for node_id, d in run.per_node().items():
        before = at_start.get(node_id, {"moves": 0, "evals": 0})
        st = stats.get(node_id)
        out[node_id] = {
            "workers": d["workers"],
            "moves_per_s": (d["moves"] - before["moves"]) / window_s,
            "evals_per_s": (d["evals"] - before["evals"]) / window_s,
            "serving": st is not None,
            "mean_batch": st["mean_batch"] if st else None,
            "model_version": st["model_version"] if st else None}
    return out


def _print_summary(display: Display, r: Dict[str, Any]) -> None:
    display.line()
    display.line(f"{'node':<10} {'workers':>7} {'moves/s':>9} {'evals/s':>9} {'mean batch':>10} "
                 f"{'model':>6}")
    for node_id, n in r["nodes"].items():
        mb = f"{n['mean_batch']:.1f}" if n["mean_batch"] else "-"
        version = "left" if not n["serving"] else f"v{n['model_version']}"
        display.line(f"{node_id[:8]:<10} {n['workers']:>7} {fmt_rate(n['moves_per_s']):>9} "
                     f"{fmt_rate(n['evals_per_s']):>9} {mb:>10} {version:>6}")
    display.line(f"{'all':<10} {r['workers']:>7} {fmt_rate(r['moves_per_s']):>9} "
                 f"{fmt_rate(r['evals_per_s']):>9}")
    if "train" in r:
        t = r["train"]
        lf, ll = t["loss_first"], t["loss_last"]
        display.line(f"learner: {t['steps']} steps, {t['pushes']} pushes to every node, model "
                     f"version {r['model_version']}, loss "
                     + (f"{lf:.3f} -> {ll:.3f}" if lf is not None and ll is not None else "-"))
