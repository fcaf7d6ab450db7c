"""One run of one mode: start its evaluator (if any) and workers, let them
play, measure the window, stop everything.  The same for every mode; what
differs is the :class:`~shmeval.selfplay.modes.Mode`."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import statistics
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .._util.children import start_process
from .._util.display import Display, fmt_rate
from .._util.procstat import cpu_s, machine_busy_s, rss_mb
from .._util.simdevice import SimDevice, device_bound_rate, device_result
from .arena import arena_main
from .errors import WorkerError
from .learner import Learner
from .modes import MODE_CLASSES, Snapshot
from .pinning import cpu_split
from .records import GameStore
from .replay_buffer import ReplayBuffer
from .series import TimeSeries
from .settings import Settings
from .worker import (ARENA_STOP, CALLS, EVAL_CPU_NS, EVAL_WALL_NS, EVALS, GAMES, LOCAL_HITS,
                     LOCAL_LOOKUPS, MOVES, N_FLAGS, NF, STOP, worker_main)

READY_TIMEOUT_S = 600.0
TICK_S = 0.5


def _one(values: set[Any]) -> Any:
    """The one value of a set, None when empty, "mixed" when several."""
    if len(values) > 1:
        return "mixed"
    return next(iter(values), None)


def _sample_rss(pid: int, samples: List[float]) -> None:
    """Appends the RSS of ``pid`` (MB) to ``samples`` unless it is gone."""
    r = rss_mb(pid)
    if r is not None:
        samples.append(r)


class ModeRun:
    """One mode: start its evaluator (if any) and workers, let them play,
    measure the window, stop everything.  :meth:`run` returns the results."""

    def __init__(self, mode: str, s: Settings, display: Display, store: GameStore,
                 buffer: Optional[ReplayBuffer] = None, learner: Optional[Learner] = None) -> None:
        self.name = mode
        self.mode = MODE_CLASSES[mode](s)
        #: The mode's one cache (shared, per worker or none).
        self.cache = self.mode.cache()
        self.s = s
        self.display = display
        self.store = store
        self.buffer = buffer
        self.learner = learner
        self.ctx: Any = mp.get_context("spawn")
        self.counters = self.ctx.RawArray("q", s.workers * NF)
        self.flags = self.ctx.RawArray("q", N_FLAGS)
        self.go = self.ctx.Event()
        self.out_q = self.ctx.Queue()
        self.procs: List[Any] = []
        self.infos: Dict[int, Dict[str, Any]] = {}
        self.done: Dict[int, Dict[str, Any]] = {}
        self.games_total = 0
        self.t_go = 0.0
        self._phase = ""
        self.pinned = False
        self.startup_s = 0.0
        #: The arena process (``--eval-every``) and its matches' results.
        self.arena: Optional[Any] = None
        self.win_rate: List[Dict[str, Any]] = []
        self.series: Optional[TimeSeries] = None
        #: The simulated GPU of this run (``--device sim``), made in start().
        self.device: Optional[SimDevice] = None

    # -- messages from the workers ------------------------------------------------

    def _handle(self, msg: Tuple[Any, ...]) -> None:
        kind, wid = msg[0], msg[1]
        if kind == "game":
            states, pol, z = self.store.add(self.name, wid, msg[2], msg[3])
            self.games_total += 1
            if self.buffer is not None:
                self.buffer.add(states, pol, z)
        elif kind == "ready":
            self.infos[wid] = msg[2]
        elif kind == "done":
            self.done[wid] = msg[2]
        elif kind == "arena":
            self.win_rate.append(msg[2])
        elif kind == "error":
            who = f"worker {wid}" if isinstance(wid, int) else wid
            raise WorkerError(f"{self.name} {who} failed:\n{msg[2]}")

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
                    raise WorkerError(f"{self.name} worker {i} exited with code {p.exitcode}")
        if self.arena is not None and not self.arena.is_alive():
            self._drain()  # its error message may be queued
            raise WorkerError(f"{self.name}: the arena exited with code {self.arena.exitcode}")
        self.mode.check_alive()

    # -- start ----------------------------------------------------------------------

    def start(self) -> None:
        s = self.s
        t0 = time.monotonic()
        self.display.status(f"[{self.name}] starting {self.mode.starting()}", force=True)
        ev_cpus, worker_cpus = cpu_split(s.pin and self.mode.central)
        self.pinned = ev_cpus is not None
        spec = s.sim()
        if spec is not None:
            self.device = SimDevice(spec)
            self.mode.sim = self.device.link
        links = self.mode.start(self.ctx, ev_cpus)
        for i in range(s.workers):
            self.procs.append(start_process(
                self.ctx, worker_main, f"selfplay-{self.name}-{i}",
                (i, s, self.counters, self.flags, self.go, self.out_q, links[i],
                 self.cache.per_worker, worker_cpus)))

        def while_waiting() -> None:
            self._drain()
            self._startup_status(t0)

        self.mode.wait_ready(while_waiting)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(self.infos) < s.workers:
            self._drain(TICK_S)
            self._check_alive()
            self._startup_status(t0)
            if time.monotonic() > deadline:
                raise WorkerError(f"{self.name}: workers not ready within {READY_TIMEOUT_S:.0f} s")
        self.startup_s = time.monotonic() - t0

    def _startup_status(self, t0: float) -> None:
        self.display.status(f"[{self.name}] starting: {len(self.infos)}/{self.s.workers} workers "
                            f"ready ({time.monotonic() - t0:.0f} s)")

    # -- the window -------------------------------------------------------------------

    def _snapshot(self) -> Snapshot:
        c = np.frombuffer(self.counters, dtype=np.int64).reshape(self.s.workers, NF).sum(axis=0)
        pid = self.mode.evaluator_pid
        snap: Snapshot = {
            "t": time.monotonic(), "moves": int(c[MOVES]), "evals": int(c[EVALS]),
            "calls": int(c[CALLS]), "games": int(c[GAMES]), "eval_wall_ns": int(c[EVAL_WALL_NS]),
            "eval_cpu_ns": int(c[EVAL_CPU_NS]),
            "local_hits": int(c[LOCAL_HITS]), "local_lookups": int(c[LOCAL_LOOKUPS]),
            "cpu_workers": sum(cpu_s(p.pid) for p in self.procs),
            "cpu_evaluator": cpu_s(pid) if pid else 0.0,
            "cpu_main": cpu_s(os.getpid()), "cpu_machine": machine_busy_s()}
        snap.update(self.mode.snapshot())
        if self.device is not None:
            snap.update({f"device_{k}": v for k, v in self.device.counters().items()})
        return snap

    def _live(self, phase: str, a: Snapshot, b: Snapshot) -> None:
        dt = max(1e-9, b["t"] - a["t"])
        mb = self.mode.mean_batch(a, b)
        text = (f"[{self.name}] {phase} {b['t'] - self.t_go:5.1f} s  games {self.games_total:,}  "
                f"moves/s {fmt_rate((b['moves'] - a['moves']) / dt)}  "
                f"evals/s {fmt_rate((b['evals'] - a['evals']) / dt)}  "
                + (f"mean batch {mb:.1f}" if mb is not None else "mean batch -"))
        text += self.mode.status(b)
        if "device_busy_ns" in b:
            text += f"  sim GPU busy {(b['device_busy_ns'] - a['device_busy_ns']) / 1e9 / dt:.0%}"
        if self.cache.per_worker and b["local_lookups"]:
            text += f"  local caches {b['local_hits'] / b['local_lookups']:.0%} hits"
        if self.learner is not None:
            loss = self.learner.loss
            text += f"  loss {loss:.3f}" if loss is not None else "  loss -"
            text += f"  buffer {len(self.learner.buffer):,}"
        if self.s.eval_every:
            m = self.win_rate[-1] if self.win_rate else None
            text += f"  win rate {m['score']:.2f} (v{m['version_max']})" if m else "  win rate -"
        self.display.status(text, force=phase != self._phase)
        self._phase = phase

    def _record(self, snap: Snapshot) -> Snapshot:
        """Adds a point to the time series when one is due; returns ``snap``."""
        series = self.series
        if series is not None and series.due(snap["t"]):
            learner = self.learner
            series.add(snap, self.mode.mean_batch(series.last, snap),
                       learner.loss if learner is not None else None,
                       len(learner.buffer) if learner is not None else None)
        return snap

    def measure(self) -> Dict[str, Any]:
        s = self.s
        self.t_go = time.monotonic()
        if self.learner is not None:
            self.learner.start(self.mode.weights_receiver())
        self.go.set()
        if s.eval_every:
            self.arena = start_process(
                self.ctx, arena_main, f"selfplay-{self.name}-arena",
                (s, self.mode.arena_evaluator(), self.flags, self.out_q, self.t_go))
        start = self._snapshot()
        self.series = TimeSeries(start)
        warm_end = self.t_go + s.warmup
        while time.monotonic() < warm_end:
            self._drain(min(TICK_S, max(0.0, warm_end - time.monotonic())))
            self._check_alive()
            self._live("warm-up", start, self._record(self._snapshot()))
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
                for pid, samples in rss.items():
                    _sample_rss(pid, samples)
                if self.mode.evaluator_pid:
                    _sample_rss(self.mode.evaluator_pid, server_rss)
                _sample_rss(os.getpid(), main_rss)
            self._live("measuring", a, self._record(self._snapshot()))
        b = self._snapshot()
        # A match that would end after the window belongs to no point of it.
        np.frombuffer(self.flags, dtype=np.int64)[ARENA_STOP] = 1
        if not any(rss.values()):  # a very short window: sample once now
            for pid, samples in rss.items():
                _sample_rss(pid, samples)
        self._live("measured", a, b)
        self.display.end_status()
        train = None
        if self.learner is not None:
            self.learner.stop()
            if self.learner.error:
                raise WorkerError(f"the learner failed:\n{self.learner.error}")
            train = self.learner.summary()
        return self._result(a, b, games_before, rss, server_rss, main_rss, train)

    def _result(self, a: Snapshot, b: Snapshot, games_before: int,
                rss: Dict[int, List[float]], server_rss: List[float], main_rss: List[float],
                train: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        s = self.s
        dt = b["t"] - a["t"]
        per_worker_rss = [max(v) for v in rss.values() if v]
        leaves_per_call = (b["evals"] - a["evals"]) / max(1, b["calls"] - a["calls"])
        d = {k: b[k] - a[k] for k in a if isinstance(a[k], (int, float))}
        worker_time = dt * s.workers
        eval_cpu = d["eval_cpu_ns"] / 1e9
        r: Dict[str, Any] = {
            "mode": self.name,
            "moves_per_s": d["moves"] / dt,
            "evals_per_s": d["evals"] / dt,
            # Rows per call of the net: the evaluator's batches, or the workers' calls.
            "mean_batch": self.mode.mean_batch(a, b),
            "worker_rss_mb": statistics.median(per_worker_rss) if per_worker_rss else None,
            "evaluator_rss_mb": max(server_rss) if server_rss else None,
            "main_rss_mb": max(main_rss) if main_rss else None,
            "games": d["games"],
            "games_received": self.games_total,
            "games_received_in_window": self.games_total - games_before,
            "moves": d["moves"], "evals": d["evals"], "evaluate_calls": d["calls"],
            "leaves_per_search_step": leaves_per_call,
            "window_s": dt, "startup_s": self.startup_s, "pinned": self.pinned,
            "evaluator_tf_threads": self.mode.tf_threads(),
            "tensorflow_in_workers": sum(bool(i.get("tensorflow")) for i in self.infos.values()),
            # As the workers reported it: one policy, or "mixed".
            "worker_sched": _one({i.get("sched") for i in self.infos.values()}),
            "precision": self.mode.precision(),
            # The one cache the mode ran with: {"kind", "entries"}.
            "cache_setting": self.cache.to_json(),
            "probe": self.infos.get(0, {}).get("probe"),
            "cpu": {
                "workers_cores": d["cpu_workers"] / dt,
                "evaluator_cores": d["cpu_evaluator"] / dt if self.mode.evaluator_pid else None,
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
        r.update(self.mode.result(d, dt))
        if self.device is not None:
            dev = device_result({k[len("device_"):]: v for k, v in d.items()
                                 if k.startswith("device_")}, dt)
            dev["spec"] = str(self.device.spec)
            # What the mode's calls would reach with the host keeping up.
            dev["device_bound_rows_per_s"] = device_bound_rate(self.device.spec,
                                                               dev["rows_per_call"])
            r["device"] = dev
        if self.cache.per_worker:
            r["local_cache"] = {"entries_per_worker": self.cache.per_worker,
                                "hits": d["local_hits"],
                                "misses": d["local_lookups"] - d["local_hits"],
                                "hit_rate": (d["local_hits"] / d["local_lookups"]
                                             if d["local_lookups"] else 0.0)}
        if self.series is not None:
            r["series"] = self.series.to_json()
        if s.eval_every:
            r["win_rate"] = self.win_rate
        if train is not None:
            r["train"] = train
            r["pushes"] = train["pushes"]
            r["loss"] = train["loss_last"]
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
        np.frombuffer(self.flags, dtype=np.int64)[STOP] = 1
        self.go.set()
        deadline = t0 + (1.5 if abort else 20.0)
        children = self.procs + ([self.arena] if self.arena is not None else [])
        try:
            while any(p.is_alive() for p in children) and time.monotonic() < deadline:
                if interrupted:
                    deadline = min(deadline, time.monotonic() + 1.5)
                try:
                    self._drain(0.05)
                except WorkerError:
                    if not abort:
                        raise
        finally:
            for p in children:
                if p.is_alive():
                    killed.append(p.name)
                    p.terminate()
            for p in children:
                p.join(1.0)
                if p.is_alive():
                    p.kill()
                    p.join(1.0)
            with contextlib.suppress(Exception):
                self._drain()
            try:
                killed += self.mode.stop(abort)
            finally:
                if self.device is not None:
                    self.device.close()
            self.out_q.cancel_join_thread()
            self.out_q.close()
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
