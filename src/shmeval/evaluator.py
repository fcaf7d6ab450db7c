"""The public ``Evaluator``: serves a model to any number of processes.

``Evaluator(model, ...)`` serves from a thread of its creator,
``Evaluator.spawn(factory, ...)`` from processes of its own
(:mod:`shmeval.launch`), each running the serving loop
(:mod:`shmeval.serving`).  Both take their settings as keyword arguments,
the fields of :class:`~shmeval.config.ServeConfig` and
:class:`~shmeval.config.SpawnConfig`.  The owner keeps the control pipes
to the serving loops (weight updates), the watcher that restarts dead
serving processes (:mod:`shmeval.restarts`), and the shutdown.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import operator
import os
import threading
import time
import typing
import weakref
from dataclasses import asdict
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from . import _ring, segment
from .client import Client
from .config import ServeConfig, SpawnConfig, takes_settings
from .errors import EvaluatorDied, ModelError, ShmevalError, ShmevalTimeout
from .launch import Launcher, check_factory, check_not_bootstrapping
from .restarts import Healer, Restart, WeightsUpdate
from .serving import Model, ServingLoop, fit_threads, prepare
from .weights import plain_weights

#: How often set_weights looks whether a restarted replica serves, when
#: every one died before it applied an update.
RESTART_POLL_S = 0.05


def _shutdown(seg: "_ring.Segment", address: str, owner_pid: int,
              thread: Optional[threading.Thread], processes: Sequence[Any],
              timeout: float = 10.0, healer: Optional[Healer] = None) -> None:
    """Stops serving, wakes every waiter, removes the segment's name.
    The watcher that restarts dead serving processes stops first: nothing
    is restarted during a close."""
    if os.getpid() != owner_pid:
        return
    if healer is not None:
        healer.close()
    seg.request_close()
    reason, detail = _ring.STOP_CLOSED, 0
    if thread is not None:
        thread.join(timeout)
    deadline = time.monotonic() + timeout
    for process in processes:
        if process.pid is None:  # never started
            continue
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.terminate()
            process.join(1.0)
            if process.is_alive():
                process.kill()
                process.join(1.0)
        if process.exitcode not in (0, None) and reason == _ring.STOP_CLOSED:
            reason, detail = _ring.STOP_EXITED, process.exitcode
    if seg.ev_state() < _ring.CLOSED_STATE:
        # No replica got to it (their processes were killed, or one is stuck
        # in a model call past the timeout): wake the clients ourselves.
        seg.close_and_wake(reason, detail)
    segment.unlink(address)



class Evaluator(Client):
    """Serves ``model`` to any number of processes through shared memory.

    ``Evaluator(model, ...)`` serves from a thread of this process;
    ``Evaluator.spawn(factory, ...)`` serves from a process of its own.
    The object pickles into child processes (spawn or fork) as a light
    :class:`~shmeval.client.Client` handle that attaches on first use.

    ``model`` is a callable taking an ``ndarray [n, *input_shape]`` and
    returning a dict of arrays (by name), a tuple or list (in the order of
    ``outputs``) or one array (when one output is declared), each with a
    leading dimension of n.  When it raises for a batch, the evaluator
    calls it again on halves of the batch to find the rows that raise,
    which alone get ModelError (at most ``serving.ISOLATE_CALLS`` extra
    calls per batch, paused for a model that raises on everything;
    docs/guide.md, *Errors*).  An error after which the model's device is
    unusable (a sticky CUDA error: ``shmeval.DeviceLost``) fails nothing:
    it ends the serving process, whose requests go to its restart or to the
    other replicas (a thread evaluator stops; its clients raise
    EvaluatorDied naming the error).

    The settings are keyword arguments: the fields of
    :class:`~shmeval.config.ServeConfig` (``spawn``:
    :class:`~shmeval.config.SpawnConfig`), each described there.
    """

    @takes_settings(ServeConfig)
    def __init__(self, model: Model, config: ServeConfig) -> None:
        if not callable(model) and len(config.spec.methods) == 1:
            raise TypeError(f"model must be callable, got {type(model).__name__}")
        check_not_bootstrapping("Evaluator()")
        t0 = time.perf_counter_ns()
        config = fit_threads(model, prepare(model, config))  # before any segment exists
        warmup_ns = time.perf_counter_ns() - t0
        seg, address = segment.create(config.spec, config.name, replicas=1,
                                      servers=config.policy.threads,
                                      cache_entries=config.cache_entries)
        super().__init__(address, config.spec, config.spin_us, _segment=seg)
        self._owner_pid = os.getpid()
        self._config = config
        seg.stat_put("warmup_ns", warmup_ns)
        control, loop_end = mp.Pipe()
        self._controls = [control]
        self._init_control()
        loop = ServingLoop(seg, model, config, loop_end)
        started = threading.Event()
        thread = threading.Thread(target=loop.run, args=(started.set,),
                                  name=f"shmeval-evaluator {address}", daemon=True)
        thread.start()
        started.wait(10.0)
        self._thread: Optional[threading.Thread] = thread
        self._processes: list[Any] = []
        self._healer = None  # a thread evaluator is not restarted
        self._shutdown = weakref.finalize(self, _shutdown, seg, address, self._owner_pid,
                                          thread, [])
        self._start_metrics(config.metrics_port)

    @classmethod
    @takes_settings(SpawnConfig)
    def spawn(cls, factory: Callable[..., Model], config: SpawnConfig) -> "Evaluator":
        """Serves from new processes, each of which calls the picklable
        ``factory`` to build its model (so e.g. TensorFlow is imported only
        there).  Returns once every model is built and serving.

        ``replicas=N`` serves N model replicas behind the one address, each in
        a process of its own calling ``factory()``; ``devices=["cuda:0",
        "cuda:1"]`` serves one replica per device, calling
        ``factory(device)``.  The replicas take turns collecting batches, a
        replica whenever its model is free and at most its share of the
        work outstanding, so that their batches stay even; workers do not
        know how many there are.  Weight updates reach every replica, and a
        worker never sees versions go backwards.  A replica that dies has
        its requests served by the others; the evaluator dies with its last
        replica.

        ``restarts=N`` (default 3): a serving process that dies is started
        again, and workers see nothing.  At most N restarts in the
        evaluator's life; after that a death is final as before
        (``EvaluatorDied`` once no replica is left).  0: none.
        ``stats()["restarts"]`` lists each one and why it happened."""
        check_factory(factory, config.mp_context)
        check_not_bootstrapping("Evaluator.spawn()")
        replicas = len(config.replica_devices)
        seg, address = segment.create(config.spec, config.name, replicas=replicas,
                                      servers=replicas * config.policy.threads,
                                      cache_entries=config.cache_entries)
        self = cls.__new__(cls)
        Client.__init__(self, address, config.spec, config.spin_us, _segment=seg)
        self._owner_pid = os.getpid()
        self._config = config
        self._thread = None
        self._launcher = Launcher(address, factory, config)
        self._start_processes(seg, config)
        if config.restarts:
            # A weak reference: the watcher must not keep the evaluator alive.
            restart = weakref.WeakMethod(self._restart)
            assert self._healer is not None
            self._healer.run_in_thread(
                lambda r: _call_weak(restart, r), f"shmeval-restarts {address}")
        self._start_metrics(config.metrics_port)
        return self

    def _start_processes(self, seg: "_ring.Segment", config: SpawnConfig) -> None:
        """Starts every replica's process and waits until each serves; on
        any failure, stops them all and removes the segment."""
        # One pipe per replica, for its start-up report and then for control
        # requests.
        self._controls, senders, self._processes = [], [], []
        for r in range(len(config.replica_devices)):
            proc, receiver, sender = self._launcher.process(r, None)
            self._controls.append(receiver)
            senders.append(sender)
            self._processes.append(proc)
        self._init_control()
        self._healer = Healer(seg, config.restarts, self._processes)
        self._shutdown = weakref.finalize(self, _shutdown, seg, self._address, self._owner_pid,
                                          None, self._processes, 10.0, self._healer)
        try:
            for proc, sender in zip(self._processes, senders):
                proc.start()
                sender.close()
            deadline = time.monotonic() + config.start_timeout
            for r, (proc, receiver) in enumerate(zip(self._processes, self._controls)):
                self._launcher.await_ready(r, proc, receiver, deadline)
        except BaseException:
            # Start-up failed: nothing was served, so there is nothing to wait
            # for before terminating the processes (start_timeout is honoured).
            self._shutdown.detach()
            _shutdown(seg, self._address, self._owner_pid, None, self._processes, timeout=0.5)
            for receiver in self._controls:
                receiver.close()
            raise

    def _restart(self, r: int) -> tuple[int, str]:
        """Starts replica r again after its process died, with the weights
        serving now (the last update applied), and swaps it in once it
        serves.  Under the control lock, so that no update is sent meanwhile
        (the new process would miss it).  Returns (its pid, "") or (0, why
        it failed to start)."""
        assert self._healer is not None
        with self._control_lock:
            if self._healer.stop.is_set():
                return 0, "the evaluator is closing"
            proc, receiver, sender = self._launcher.process(r, Restart(self._last_update))
            proc.start()
            sender.close()
            try:
                self._launcher.await_ready(r, proc, receiver,
                                           time.monotonic() + self._launcher.config.start_timeout,
                                           self._healer.stop)
            except Exception as e:
                receiver.close()
                if proc.is_alive():
                    proc.kill()
                proc.join(1.0)
                return 0, f"{type(e).__name__}: {e}"
            self._controls[r].close()
            self._controls[r] = receiver
            self._processes[r] = proc
            return proc.pid, ""

    def stats(self) -> dict[str, Any]:
        """As :meth:`Client.stats`; for ``Evaluator.spawn``, in the
        process that created it, also ``restarts``: one entry per restart
        of a dead serving process (when, which replica, the dead process and
        how it ended, the new one, or why it failed to start)."""
        st = super().stats()
        if self._healer is not None and os.getpid() == self._owner_pid:
            st["restarts"] = [asdict(rec) for rec in self._healer.records]
        return st

    _controls: list[Any]  # our ends of the control pipes, one per replica
    _config: ServeConfig  # the settings (a thread evaluator's: fitted to its model)
    _launcher: Launcher  # starts the serving processes (spawn)
    _healer: Optional[Healer]  # restarts dead ones (spawn; watching if restarts > 0)
    _exporter: Any = None  # the Prometheus exporter (metrics_port)

    def _start_metrics(self, port: Optional[int]) -> None:
        """Serves Prometheus metrics of this evaluator on ``port`` from a
        thread of this process (shmeval.monitor, the [monitor] extra); the
        evaluator is closed again if that fails."""
        if port is None:
            return
        try:
            try:
                from .monitor.prometheus import start_exporter
            except ImportError as e:
                raise ImportError(f"metrics_port needs: pip install 'shmeval[monitor]' "
                                  f"({e.name} missing)") from None
            self._exporter = start_exporter(self._address, port)
        except BaseException:
            self.close()
            raise

    @property
    def metrics_port(self) -> Optional[int]:
        """The port the Prometheus metrics are served on (the one the system
        chose for ``metrics_port=0``), or None."""
        return self._exporter.port if self._exporter is not None else None

    def _init_control(self) -> None:
        self._control_lock = threading.Lock()
        self._version = 0
        # What a restarted replica applies before it serves.
        self._last_update: Optional[WeightsUpdate] = None

    @property
    def model_version(self) -> int:
        """The version of the weights serving now (0: as started)."""
        return self._version

    def set_weights(self, weights: Union[Sequence[Any], Mapping[str, Any]], *,
                    version: Optional[int] = None, timeout: float = 60.0) -> int:
        """Replaces the model's weights between two batches, with what the
        model's framework hands out: a Keras ``get_weights()`` list, a
        PyTorch ``state_dict()`` (tensors or arrays, matched by name), a
        JAX params pytree.  Requests in flight are not failed or dropped.
        Tensors are copied to NumPy arrays here (shmeval.weights); the
        model's ``set_weights`` gets the same structure (TFModel,
        TorchModel and JaxModel match it, and say what is missing or
        extra).  TypeError here for anything but a mapping, a list or a
        tuple.

        Returns the new model version: ``version`` if given (it must be
        larger than the current one), else the current one plus 1.  Every
        result computed with these weights carries it (``evaluate(...,
        return_version=True)``).  Returns once the evaluator applied them;
        raises :class:`ModelError` (weights unchanged) if the model refused
        them.  Only the process that created the evaluator can call this."""
        return self._request("set_weights", plain_weights(weights), version, timeout)

    def load_weights(self, path: Union[str, "os.PathLike[str]"], *,
                     version: Optional[int] = None, timeout: float = 60.0) -> int:
        """As :meth:`set_weights`, but the evaluator process loads them from
        ``path`` with the model's ``load_weights(path)`` (for TFModel: a
        Keras weights file or an ``.npz`` of arrays in ``get_weights()``
        order)."""
        return self._request("load_weights", os.fspath(path), version, timeout)

    def _request(self, method: str, arg: Any, version: Optional[int], timeout: float) -> int:
        """Sends the update to every replica.  When every replica died
        before applying it and the owner restarts them (restarts=), it is
        sent again once one serves, within the timeout."""
        if os.getpid() != self._owner_pid:
            raise ShmevalError(f"only the process that created the evaluator "
                               f"({self._owner_pid}) can change its model")
        seg = self._seg
        assert seg is not None
        deadline = time.monotonic() + timeout
        while True:
            new = self._request_once(seg, method, arg, version, deadline, timeout)
            if new is not None:
                return new
            while seg.restarts_left() and not any(p.is_alive() for p in self._processes):
                self._check_alive(seg)  # EvaluatorDied once no restart is left
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the evaluator did not apply {method} within "
                                       f"{timeout} s: its serving processes are restarting")
                time.sleep(RESTART_POLL_S)

    def _request_once(self, seg: "_ring.Segment", method: str, arg: Any,
                      version: Optional[int], deadline: float,
                      timeout: float) -> Optional[int]:
        """One round of _request: the new version, or None when no replica
        applied the update because every one died, and a restart is
        coming."""
        with self._control_lock:
            new = self._version + 1 if version is None else operator.index(version)
            if new <= self._version:
                raise ValueError(f"version must be larger than the current model version "
                                 f"{self._version}, got {new}")
            self._check_state(seg)
            ticket = seg.request_control()
            # Every replica gets the update; one whose pipe is gone has died
            # (the others serve its requests).
            pending: dict[mp_connection.Connection, int] = {}
            for r, conn in enumerate(self._controls):
                try:
                    conn.send((ticket, method, arg, new))
                    pending[conn] = r
                except OSError:
                    continue
            if not pending:
                self._raise_unless_restarting(seg)
                return None
            applied, refused = self._replies(seg, pending, ticket, method, deadline, timeout)
            if applied:
                # Before returning: no cache lookup accepts older answers now,
                # and no replica that refused the update collects any more
                # while one that applied it serves.
                seg.cache_set_version(new)
                seg.raise_version_floor(new)
                self._last_update = WeightsUpdate(method, arg, new)
            if refused:
                if len(self._controls) == 1:
                    raise ModelError(next(iter(refused.values())))
                raise ModelError("; ".join(f"replica {r}: {why}" for r, why in sorted(
                    refused.items())) + (f" (applied by {applied} other replicas, which "
                                         f"serve alone until these accept a newer version)"
                                         if applied else ""))
            if not applied:
                self._raise_unless_restarting(seg)
                return None
            # Counted once per update, however many replicas applied it.
            seg.stat_put("model_version", new)
            seg.stat_inc("weight_updates", 1)
            return new

    def _replies(self, seg: "_ring.Segment", pending: dict[mp_connection.Connection, int],
                 ticket: int, method: str, deadline: float,
                 timeout: float) -> tuple[int, dict[int, str]]:
        """Waits for the replies to control request ``ticket`` from the
        replicas in ``pending`` ({their pipe: replica}; emptied): how many
        applied it, and {replica: why} of those that refused it.  A replica
        whose pipe closes has died (the others serve its requests)."""
        applied, refused = 0, dict[int, str]()
        while pending:
            for ready in mp_connection.wait(list(pending), timeout=0.05):
                conn = typing.cast(mp_connection.Connection, ready)
                r = pending[conn]
                try:
                    t, ok, detail = conn.recv()
                except (EOFError, OSError):  # this replica died meanwhile
                    del pending[conn]
                    continue
                if ok:  # also the late reply of a request that timed out
                    self._version = max(self._version, detail)
                if t == ticket:
                    del pending[conn]
                    if ok:
                        applied += 1
                    else:
                        refused[r] = detail
            if not pending:
                break
            self._check_alive(seg)
            if time.monotonic() > deadline:
                raise ShmevalTimeout(f"the evaluator did not apply {method} within "
                                     f"{timeout} s (it may still do so)")
        return applied, refused

    def _raise_unless_restarting(self, seg: "_ring.Segment") -> None:
        """No replica got an update: EvaluatorDied, unless a restart is
        coming."""
        self._check_alive(seg)
        if not seg.restarts_left():
            raise EvaluatorDied(f"the evaluator serving {self._address} is gone")

    @property
    def pid(self) -> int:
        """The serving process's pid (the first replica's; this process for
        a thread evaluator)."""
        return self._processes[0].pid if self._processes else self._owner_pid

    @property
    def pids(self) -> list[int]:
        """The pid of every replica's process (this process for a thread
        evaluator)."""
        return [p.pid for p in self._processes] if self._processes else [self._owner_pid]

    def close(self, timeout: float = 10.0) -> None:
        """Stops serving: requests in flight complete or raise EvaluatorClosed;
        the shared segment is removed.  Idempotent.  In a child process that
        inherited this object by fork it only detaches that process."""
        if os.getpid() == self._owner_pid and self._shutdown.alive:
            if self._exporter is not None:
                self._exporter.close()
            # Stop serving first: this process's threads still waiting then
            # raise EvaluatorClosed, and its client entry can go at once.
            self._shutdown.detach()
            assert self._seg is not None
            _shutdown(self._seg, self._address, self._owner_pid, self._thread,
                      self._processes, timeout, self._healer)
            with self._control_lock:
                for conn in self._controls:
                    conn.close()
        super().close(timeout)

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



def _call_weak(method: "weakref.WeakMethod[Any]", r: int) -> tuple[int, str]:
    """Evaluator._restart through a weak reference (the healer's thread
    must not keep the evaluator alive)."""
    fn = method()
    return typing.cast("tuple[int, str]", fn(r)) if fn is not None else (
        0, "the evaluator is gone")



__all__ = ["Evaluator", "ShmevalError"]
