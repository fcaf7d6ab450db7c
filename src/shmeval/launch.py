"""Starting an evaluator's serving processes (``Evaluator.spawn``).

The owner checks that a process can be started at all (not from a child
that is still starting, with a factory the new process can find), then
:class:`Launcher` starts each replica's process, at start-up and again for a
restart, by the one path: the process attaches to the segment, calls the
factory, fits the config to the model and serves (:func:`serve_in_process`);
it reports on its pipe, which then carries the owner's control requests.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

from . import _ring, segment
from ._main_script import unreachable_reason
from .backends._device import share_gpus
from .config import SpawnConfig
from .errors import EvaluatorDied, ModelError, NotTheMainProcess
from .restarts import EXIT_DEVICE_LOST, Restart
from .serving import Model, ServingLoop, prepare

#: How often a restarted replica looks whether the others put back what its
#: dead process held.
TAKE_BACK_POLL_S = 0.01


class Launcher:
    """Starts the serving processes of an Evaluator.spawn: each replica's
    at start-up, and again for a restart, by the one path."""

    def __init__(self, address: str, factory: Callable[..., Model], config: SpawnConfig) -> None:
        self.ctx: Any = mp.get_context(config.mp_context)
        self.address = address
        self.factory = factory
        self.config = config

    def process(self, r: int, restart: Optional[Restart]) -> tuple[Any, Any, Any]:
        """Replica r's process (not started yet) and the two ends of its
        pipe: ours, and the one it takes (close it once it started)."""
        receiver, sender = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=serve_in_process, name=f"shmeval-evaluator {self.address} #{r}",
            args=(self.address, self.factory, self.config, sender, r, restart), daemon=True)
        return proc, receiver, sender

    def await_ready(self, r: int, proc: Any, receiver: Any, deadline: float,
                    stop: Optional[threading.Event] = None) -> None:
        d = self.config.replica_devices
        _await_ready(proc, receiver, deadline, self.config.start_timeout,
                     f" (replica {r}{', ' + d[r] if d[r] else ''})" if len(d) > 1 else "", stop)


def _await_ready(proc: Any, receiver: Any, deadline: float, start_timeout: float,
                 which: str, stop: Optional[threading.Event] = None) -> None:
    """Waits for one evaluator process's start-up report; raises what went
    wrong ('which' names the replica in the message).  A restart also gives
    up when ``stop`` is set (the evaluator is closing)."""
    while not receiver.poll(0.05):
        if not proc.is_alive():
            raise EvaluatorDied(_died_starting(proc) + which)
        if time.monotonic() > deadline:
            raise EvaluatorDied(f"the evaluator{which} did not start within {start_timeout} s")
        if stop is not None and stop.is_set():
            raise EvaluatorDied("the evaluator is closing")
    try:
        kind, detail = receiver.recv()
    except EOFError:
        proc.join(1.0)
        raise EvaluatorDied(_died_starting(proc) + which) from None
    if kind != "ready":
        raise ModelError(f"the model factory failed in the evaluator process{which}: {detail}")


def _died_starting(proc: Any) -> str:
    """Why Evaluator.spawn failed when its process died before it reported."""
    return (f"the evaluator process exited (code {proc.exitcode}) during start-up, before "
            f"it could build the model; its error is on stderr.  If it says the script ran "
            f"again in the new process, guard the script's entry point with "
            f"`if __name__ == \"__main__\":`")


def check_not_bootstrapping(what: str) -> None:
    """Refuses to create an evaluator in a process that multiprocessing's
    spawn or forkserver start method is still starting: that is the user's
    script running again in the child, because its entry point is not
    guarded, and the child would create an evaluator of its own."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise NotTheMainProcess(
            f"{what} was called while this process was starting as a child process "
            f"(multiprocessing's spawn start method runs the main script again in each "
            f"child): guard the script's entry point with `if __name__ == \"__main__\":` "
            f"so that the evaluator is created in the main process only")


def check_factory(factory: Callable[..., Model], mp_context: str) -> None:
    """Refuses a factory that the serving processes could not call: not
    callable, or, unless they fork, one that cannot travel there by pickle
    or that they would not find by name (_main_script.unreachable_reason)."""
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    method = mp.get_context(mp_context).get_start_method()
    if method != "fork":
        _check_picklable(factory)
        why = unreachable_reason(factory, method)
        if why:
            raise TypeError(f"the evaluator process cannot find its factory: {why}")


def _check_picklable(factory: Callable[..., Model]) -> None:
    """The factory travels to the evaluator process by pickle."""
    try:
        pickle.dumps(factory)
    except Exception as e:
        raise TypeError(
            f"the factory must be picklable to reach the evaluator process: a module-level "
            f"function, or a functools.partial of one, not a lambda or a nested function "
            f"({factory!r} cannot be pickled: {type(e).__name__}: {e})") from None


def serve_in_process(address: str, factory: Callable[..., Model], config: SpawnConfig,
                     conn: Any, replica: int = 0, restart: Optional[Restart] = None) -> None:
    """A serving process's body: builds replica ``replica``'s model with
    ``factory`` and serves it; reports ("ready", pid) or ("error", why) on
    ``conn``, the owner's control pipe from then on."""
    # Ctrl-C reaches the whole process group: the parent decides when to
    # close, so the evaluator ignores SIGINT rather than dying mid-batch.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Before the factory imports a framework: JAX and TensorFlow would
    # otherwise take every GPU for this one replica (_device.GPU_SHARING_ENV).
    share_gpus()
    seg, _ = segment.attach(address, config.spec)
    if restart is not None:
        take_back(seg, replica)  # before its servers are set up
    device = config.replica_devices[replica]
    t0 = time.perf_counter_ns()
    try:
        model = factory(device) if device else factory()
        if not callable(model):
            raise TypeError(f"factory returned a {type(model).__name__}, not a callable")
        loop = ServingLoop(seg, model, prepare(model, config), conn, replica, device)
        if restart is not None:
            loop.resume(restart)
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        conn.close()
        raise SystemExit(1)
    if restart is None:
        seg.stat_put("warmup_ns", time.perf_counter_ns() - t0)
    try:
        loop.run(lambda: conn.send(("ready", os.getpid())))
    except BaseException:
        if loop.lost is None:
            raise
        # The model's device is lost (errors.DeviceLost): the process ends
        # at once, with its own exit code, so that its batches are put back
        # and the owner restarts it.  Not through the interpreter's
        # shutdown, whose clean-up calls into the failed device (the
        # framework frees its memory there) and may hang or abort.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(EXIT_DEVICE_LOST)


def take_back(seg: "_ring.Segment", replica: int) -> None:
    """A restarted replica's first step: the requests its dead process had
    taken go back to READY, exactly once, before its servers are set up
    again (which empties its batch tables in the segment).  With other
    replicas serving, their housekeeping does it (it holds the collect lock,
    which a put-back needs: docs/protocol.md, *Replicas*), and takes the
    lock over if the dead process held it; this process waits for that.
    With none (one replica, or every other dead too) nobody scans, and it
    puts them back itself."""
    me = os.getpid()
    seg.replica_restart(replica, me, segment.process_starttime(me) or 0)
    while not seg.replica_settled(replica):
        if not any(rep["replica"] != replica and rep["state"] == "serving"
                   and segment.is_alive(rep["pid"], rep["starttime"])
                   for rep in seg.replicas()):
            seg.requeue_restarted(replica)
            return
        if seg.ev_state() >= _ring.CLOSING:
            return
        time.sleep(TAKE_BACK_POLL_S)


