"""Restarts of dead serving processes (``Evaluator.spawn(restarts=N)``).

The owner watches its serving processes from a daemon thread (the
``Healer``).  When one dies, it starts the replica again (the factory called
again, the weights serving now applied before it serves), after a backoff,
at most N times in the evaluator's life.  The segment announces how many
restarts are left (``Segment.restarts_left``), so that a client waits through
a moment with no replica alive rather than raise ``EvaluatorDied``; once none
are left, the last death closes the evaluator as before
(docs/protocol.md, *Restarts*).
"""
from __future__ import annotations

import multiprocessing.connection as mp_connection
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from . import _ring
from .stats import device_lost

#: The wait before the first restart, doubled for each one after it.
BACKOFF_S = 0.2
BACKOFF_MAX_S = 5.0
#: How often the watcher looks at the stop flag while every process lives.
POLL_S = 0.1
#: How long a process whose sentinel fired may take to be reaped.
REAP_S = 5.0
#: The exit code of a serving process that ended itself because its
#: model's device failed (errors.DeviceLost; launch.serve_in_process).
EXIT_DEVICE_LOST = 71


@dataclass(frozen=True)
class WeightsUpdate:
    """The last weights update the replicas applied, as the owner sent it
    (the control message's method, argument and version)."""

    method: str
    arg: Any
    version: int


@dataclass(frozen=True)
class Restart:
    """What a restarted serving process is given: the weights serving now
    (None: those the factory builds)."""

    update: Optional[WeightsUpdate]


@dataclass(frozen=True)
class RestartRecord:
    """One restart, for ``stats()["restarts"]``."""

    time: float      # time.time() when the new process was started
    replica: int
    pid: int         # the process that died
    why: str         # how it ended: "killed by signal 9", "exited with code 1",
                     # "its device failed: RuntimeError: CUDA error: ..."
    new_pid: int     # the new process (0 when it failed to start)
    error: str       # why the new process failed to start ("" when it serves)


def describe_exit(exitcode: Optional[int]) -> str:
    """How a process ended, in words (Process.exitcode: minus a signal)."""
    if exitcode is None:
        return "gone"
    if exitcode < 0:
        return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class Healer:
    """The owner's watcher of its serving processes.  ``processes`` is the
    Evaluator's list (one process per replica), which ``start`` replaces an
    entry of when it restarts a replica; ``start(r)`` returns "" once the
    new process serves, else why it could not start.  It never restarts
    once the evaluator is closing, and close() stops it before the owner
    closes the evaluator."""

    def __init__(self, seg: "_ring.Segment", restarts: int, processes: Sequence[Any]) -> None:
        self.seg = seg
        self.left = restarts
        self.processes = processes
        self.records: list[RestartRecord] = []
        self.stop = threading.Event()
        self.start: Optional[Callable[[int], tuple[int, str]]] = None
        self.thread: Optional[threading.Thread] = None
        seg.set_restarts_left(restarts)

    def run_in_thread(self, start: Callable[[int], tuple[int, str]], name: str) -> None:
        self.start = start
        self.thread = threading.Thread(target=self.run, name=name, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stops watching; waits for a restart under way to give up."""
        self.stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()

    def run(self) -> None:
        try:
            self.watch()
        finally:
            # However the watching ends (closed, every process gone, or an
            # error here), no restart comes any more: clients must not wait
            # for one.
            self.left = 0
            self.seg.set_restarts_left(0)

    def watch(self) -> None:
        given_up: set[int] = set()  # replicas left dead: no restart was left
        while not self.stop.is_set() and self.seg.ev_state() < _ring.CLOSING:
            # Every dead one, not only those whose sentinel fired in this
            # wait: processes killed together fire one by one.  One look at
            # each process per round: a second could find it exited.
            codes = [p.exitcode for p in self.processes]
            dead = [r for r, code in enumerate(codes) if code is not None and r not in given_up]
            if dead:
                if not self.heal(dead[0]):
                    given_up.add(dead[0])
                continue
            alive = [p.sentinel for p, code in zip(self.processes, codes) if code is None]
            if not alive:
                return
            mp_connection.wait(alive, timeout=POLL_S)

    def heal(self, r: int) -> bool:
        """Replica r's process died: start it again, after the backoff,
        until one serves or no restart is left (then, if no replica's
        process is left either, the evaluator dies as it did without
        restarts).  False when it stays dead."""
        dead = self.processes[r]
        # Its sentinel closes as it exits, a moment before it can be reaped.
        dead.join(REAP_S)
        pid, exitcode = dead.pid, dead.exitcode
        why = describe_exit(exitcode)
        lost = device_lost(self.seg, r) if exitcode == EXIT_DEVICE_LOST else None
        if lost is not None:
            why = f"its device failed: {lost}"
        while self.left > 0:
            delay = min(BACKOFF_S * 2 ** len(self.records), BACKOFF_MAX_S)
            if self.stop.wait(delay):
                return True  # closing
            assert self.start is not None
            started = time.time()
            new_pid, error = self.start(r)
            if self.stop.is_set() and error:
                return True  # closing: not a restart that failed
            self.left -= 1
            self.records.append(RestartRecord(started, r, pid, why, new_pid, error))
            # After the attempt ended: until then a client waits for it.
            self.seg.set_restarts_left(self.left)
            if not error:
                return True
            why = f"its restart failed ({error})"
        if not any(p.exitcode is None for p in self.processes):
            self.seg.close_and_wake(_ring.STOP_EXITED, exitcode if exitcode is not None else 0)
        return False
