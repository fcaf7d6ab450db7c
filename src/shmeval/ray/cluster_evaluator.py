"""One evaluator per Ray node behind one handle.

:class:`ClusterEvaluator` lives in the driver (the process that trains):
it places a :class:`~shmeval.ray.node_evaluator.NodeEvaluator` actor on
every node, a new one on each node that joins, forgets those of nodes that
left, and sends each weight update to every node through Ray's object
store.  It pickles into Ray workers as a :class:`ClusterHandle`, whose
:meth:`~ClusterHandle.connect` returns a plain :class:`shmeval.Client` on
the worker's own node's evaluator: after that one look-up, evaluations go
through shared memory and never through Ray.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import multiprocessing as mp
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .._main_script import from_main
from ..checks import as_number
from ..client import Client, connect
from ..errors import EvaluatorClosed, EvaluatorDied, ShmevalError, ShmevalTimeout
from ..evaluator import Evaluator
from ..weights import plain_weights
from .node_evaluator import MP_CONTEXT, NodeEvaluator, actor_name

log = logging.getLogger(__name__)

#: The Ray namespace of the evaluators' actors: workers of any job find them.
NAMESPACE = "shmeval"

_remote_node_evaluator = ray.remote(NodeEvaluator)

#: This process's clients, one per (namespace, cluster evaluator, node):
#: a worker looks its node's evaluator up once.
_clients: Dict[Tuple[str, str, str], Client] = {}
_clients_lock = threading.Lock()


def _node_ids() -> List[str]:
    """The ids of the nodes alive now."""
    return [n["NodeID"] for n in ray.nodes() if n["Alive"]]


def _start_error(node_id: str, e: BaseException) -> BaseException:
    """The evaluator's own start-up exception, saying which node: the
    error of ``NodeEvaluator.__init__``, carried by Ray as the cause."""
    cause = getattr(e, "cause", None)
    where = f"the evaluator on Ray node {node_id}"
    if isinstance(cause, (ShmevalError, ValueError, TypeError)):
        return type(cause)(f"{where} failed to start: {cause}")
    return EvaluatorDied(f"{where} failed to start: {type(e).__name__}: {e}")


class ClusterHandle:
    """What a Ray worker (actor or task) holds: finds the evaluator of the
    node it runs on by Ray's node id.  Picklable; made by
    :class:`ClusterEvaluator`, or from its ``name`` in another job."""

    def __init__(self, name: str, namespace: str = NAMESPACE,
                 spin_us: Optional[float] = None) -> None:
        self.name = name
        self.namespace = namespace
        self.spin_us = spin_us

    def __repr__(self) -> str:
        return f"ClusterHandle({self.name!r}, namespace={self.namespace!r})"

    def connect(self, timeout: float = 60.0) -> Client:
        """A :class:`shmeval.Client` on this node's evaluator.  The first
        call in a process looks the evaluator up through Ray (waiting up to
        ``timeout`` seconds while a node that just joined gets one) and
        attaches; later calls return the same client.  Raises
        ``EvaluatorDied`` when none serves this node within ``timeout``."""
        node_id = ray.get_runtime_context().get_node_id()
        key = (self.namespace, self.name, node_id)
        with _clients_lock:
            client = _clients.get(key)
            if client is None:
                client = connect(self._address(node_id, timeout), spin_us=self.spin_us)
                _clients[key] = client
            return client

    def _address(self, node_id: str, timeout: float) -> str:
        name = actor_name(self.name, node_id)
        deadline = time.monotonic() + timeout
        while True:
            try:
                actor = ray.get_actor(name, namespace=self.namespace)
                break
            except ValueError:  # not placed yet
                if time.monotonic() > deadline:
                    raise EvaluatorDied(f"no evaluator of {self.name!r} serves Ray node "
                                        f"{node_id} (waited {timeout:g} s)") from None
                time.sleep(0.1)
        try:
            address: str = ray.get(actor.ready.remote(),
                                   timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.RayError as e:
            raise EvaluatorDied(f"the evaluator of {self.name!r} on Ray node {node_id} is not "
                                f"serving: {e}") from None
        return address

    def forget(self) -> None:
        """Closes this process's clients of this cluster evaluator."""
        with _clients_lock:
            for key in [k for k in _clients if k[:2] == (self.namespace, self.name)]:
                _clients.pop(key).close()


def _check_not_in_driver_script(factory: Callable[..., Any], mp_context: Optional[str]) -> None:
    """A factory defined in the driver's script reaches each node's actor
    (Ray pickles it by value), but the evaluator process the actor starts
    (forkserver by default, unless it forks) finds it by name in an importable module, and
    no process of a node imports the driver's script."""
    if mp.get_context(mp_context).get_start_method() == "fork":
        return
    func = from_main(factory)
    if func is not None:
        name = getattr(func, "__qualname__", repr(func))
        raise TypeError(
            f"the factory {name!r} is defined in the driver's script (__main__), which the "
            f"nodes' evaluator processes cannot import: define it in a module they can import "
            f"(a .py file beside the script, imported here; on a cluster, shipped with "
            f"ray.init(runtime_env={{'py_modules': [...]}}) or working_dir)")


class ClusterEvaluator:
    """One shmeval evaluator per Ray node, each serving that node's workers
    through shared memory.  Create it in the driver after ``ray.init()``;
    it returns once every node's evaluator serves.

    ``factory`` and ``evaluator_kwargs`` are those of
    :meth:`shmeval.Evaluator.spawn` (``input_shape``, ``outputs``,
    ``max_batch``, ...): each node's actor calls
    ``Evaluator.spawn(factory, **evaluator_kwargs)``, so the factory must be
    importable on every node.  ``name`` (default: a new unique one) names
    the actors in Ray's namespace ``namespace`` and each node's segment
    (``/shmeval-<actor pid>-<name>``, see ``shmeval ls``); ``start_timeout``
    bounds each node's start-up, its ``Evaluator.spawn`` included.
    ``mp_context`` defaults to ``"forkserver"``, not spawn's ``"spawn"``:
    Ray kills a worker's direct children with it, and an evaluator started
    through a fork server outlives its actor long enough to remove its
    segment (:mod:`shmeval.ray.node_evaluator`); ``actor_options`` are Ray
    options of each node's actor (such as ``{"num_gpus": 1}``, whose
    devices the evaluator process inherits).  Every ``watch_s`` seconds a
    thread places an evaluator on each node that joined, with the latest
    weights; a node that left takes its evaluator with it.

    Pass it to Ray workers: it pickles as a :class:`ClusterHandle`, and
    ``connect()`` there returns this node's client.
    """

    def __init__(self, factory: Callable[[], Any], *, name: Optional[str] = None,
                 namespace: str = NAMESPACE, start_timeout: float = 600.0,
                 watch_s: float = 1.0, actor_options: Optional[Dict[str, Any]] = None,
                 **evaluator_kwargs: Any) -> None:
        # Unknown or missing arguments fail here, before anything is placed
        # (name and start_timeout are the cluster's and, per node, spawn's).
        inspect.signature(Evaluator.spawn).bind(factory, **evaluator_kwargs)
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            raise ValueError(f"name must be a non-empty str without '/', got {name!r}")
        if not as_number("start_timeout", start_timeout) > 0:
            raise ValueError(f"start_timeout must be > 0 seconds, got {start_timeout!r}")
        _check_not_in_driver_script(factory, evaluator_kwargs.get("mp_context", MP_CONTEXT))
        if not ray.is_initialized():
            raise ShmevalError("ClusterEvaluator needs a Ray cluster: call ray.init() first")
        self.handle = ClusterHandle(name or f"ev-{uuid.uuid4().hex[:12]}", namespace,
                                    evaluator_kwargs.get("spin_us"))
        self._factory = factory
        self._kwargs = evaluator_kwargs
        self._actor_options = dict(actor_options or {})
        self._start_timeout = start_timeout
        # Guards the actors, the latest weights and the version; re-entered
        # when a call finds an actor dead.
        self._lock = threading.RLock()
        self._actors: Dict[str, Any] = {}
        self._starting: Dict[str, Tuple[Any, Any]] = {}  # node -> (actor, ready ref)
        self._weights_ref: Any = None
        self._version = 0
        self._closed = threading.Event()
        try:
            with self._lock:
                for node_id in _node_ids():
                    self._place(node_id)
            self._await_ready(dict(self._starting), start_timeout)
        except BaseException:
            self._close_actors(timeout=1.0)
            raise
        self._watcher = threading.Thread(target=self._watch, args=(watch_s,), daemon=True,
                                         name=f"shmeval-ray-watch {self.name}")
        self._watcher.start()

    @property
    def name(self) -> str:
        return self.handle.name

    def __reduce__(self) -> Any:
        return (ClusterHandle, (self.handle.name, self.handle.namespace, self.handle.spin_us))

    def connect(self, timeout: float = 60.0) -> Client:
        """This node's client, as :meth:`ClusterHandle.connect`."""
        return self.handle.connect(timeout)

    # -- placing ------------------------------------------------------------------------

    def _place(self, node_id: str) -> None:
        """Starts the actor of ``node_id`` (with the lock held): it serves
        the latest weights from the start."""
        options = {"num_cpus": 0, **self._actor_options,
                   "name": actor_name(self.name, node_id), "namespace": self.handle.namespace,
                   "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
                   "max_concurrency": 4}
        kwargs = {**self._kwargs, "name": self.name, "start_timeout": self._start_timeout}
        actor = _remote_node_evaluator.options(**options).remote(
            self._factory, kwargs, self._weights_ref, self._version)
        self._starting[node_id] = (actor, actor.ready.remote())

    def _await_ready(self, starting: Dict[str, Tuple[Any, Any]], timeout: float) -> None:
        """Waits for the actors of ``starting`` to serve and moves each from
        starting to serving; raises the first start-up error, or
        EvaluatorDied after ``timeout``."""
        by_ref = {ref: node_id for node_id, (_, ref) in starting.items()}
        pending = list(by_ref)
        deadline = time.monotonic() + timeout
        while pending:
            done, pending = ray.wait(pending, num_returns=1,
                                     timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                late = ", ".join(by_ref[r] for r in pending)
                raise EvaluatorDied(f"the evaluators on Ray nodes {late} did not start "
                                    f"within {timeout:g} s")
            node_id = by_ref[done[0]]
            try:
                ray.get(done[0])
            except ray.exceptions.RayError as e:
                raise _start_error(node_id, e) from None
            with self._lock:
                self._actors[node_id] = self._starting.pop(node_id)[0]

    def _watch(self, interval: float) -> None:
        """Places an evaluator on each node that joins, forgets the nodes
        that left; a failed start-up on a joining node is logged."""
        known = set(self._actors)
        while not self._closed.wait(interval):
            try:
                alive = set(_node_ids())
                with self._lock:
                    if self._closed.is_set():
                        return
                    for node_id in set(self._actors) - alive:
                        log.info("Ray node %s left: its evaluator is gone", node_id)
                        del self._actors[node_id]
                    for node_id in alive - known:
                        self._place(node_id)
                    known |= alive
                    starting = dict(self._starting)
                for node_id, entry in starting.items():
                    self._adopt(node_id, entry)
            except Exception:
                if self._closed.is_set() or not ray.is_initialized():
                    return
                log.exception("shmeval.ray: watching the nodes failed")

    def _adopt(self, node_id: str, entry: Tuple[Any, Any]) -> None:
        try:
            self._await_ready({node_id: entry}, self._start_timeout)
        except Exception as e:
            log.error("%s", e)
            with self._lock:
                self._starting.pop(node_id, None)
            self._close_actor(entry[0], timeout=1.0)
            return
        log.info("Ray node %s joined: its evaluator serves", node_id)

    # -- serving --------------------------------------------------------------------------

    def addresses(self) -> Dict[str, str]:
        """``{node id: evaluator address}`` of the nodes served now."""
        with self._lock:
            actors = dict(self._actors)
        return self._call_each(actors, "ready", (), 30.0)

    def stats(self, timeout: float = 30.0) -> Dict[str, Dict[str, Any]]:
        """``{node id: that evaluator's stats()}`` (with its ``address``
        and ``pid``), for the nodes served now."""
        with self._lock:
            actors = dict(self._actors)
        return self._call_each(actors, "stats", (), timeout)

    @property
    def model_version(self) -> int:
        """The version of the latest weights sent (0: as started)."""
        return self._version

    def set_weights(self, weights: Union[Sequence[Any], Mapping[str, Any]], *,
                    version: Optional[int] = None, timeout: float = 60.0) -> int:
        """Sends ``weights`` to every node's evaluator: one copy into Ray's
        object store, read by each node's actor, applied between two
        batches as in :meth:`shmeval.Evaluator.set_weights`.  Returns the
        new version (``version`` if given, larger than the current one; else
        the current one plus 1) once every node serving applied it.  Updates
        are sent one at a time and in order, so no worker sees versions go
        backwards; a node joining later starts with the latest weights.  A
        node that left during the update is skipped.  ``weights`` as for
        :meth:`shmeval.Evaluator.set_weights` (a list, a state dict, a
        pytree)."""
        arrays = plain_weights(weights)
        with self._lock:
            if self._closed.is_set():
                raise EvaluatorClosed(f"the cluster evaluator {self.name!r} is closed")
            new = self._version + 1 if version is None else int(version)
            if new <= self._version:
                raise ValueError(f"version must be larger than the current model version "
                                 f"{self._version}, got {new}")
            ref = ray.put(arrays)
            # Ray resolves a top-level reference argument on each node: the
            # weights travel once per node, not once per call site.  A node
            # still starting gets them too (after its start-up, in order); its
            # start-up error, if any, is the watcher's to report.
            starting = {n: a for n, (a, _) in self._starting.items()}
            self._call_each({**self._actors, **starting}, "set_weights", (ref, new, timeout),
                            timeout + self._start_timeout, tolerate=set(starting))
            self._weights_ref, self._version = ref, new
        return new

    def _call_each(self, actors: Dict[str, Any], method: str, args: Tuple[Any, ...],
                   timeout: float, tolerate: Optional[set[str]] = None) -> Dict[str, Any]:
        """Calls ``method`` on each actor; returns the answers by node.  An
        actor that died (its node left) is dropped, and so is any error of
        the nodes in ``tolerate``; any other error is raised."""
        refs = {n: getattr(a, method).remote(*args) for n, a in actors.items()}
        out: Dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        for node_id, ref in refs.items():
            try:
                out[node_id] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.RayActorError:
                with self._lock:
                    self._actors.pop(node_id, None)
                log.info("Ray node %s left: its evaluator is gone", node_id)
            except ray.exceptions.RayError as e:
                if tolerate and node_id in tolerate:
                    continue
                if isinstance(e, ray.exceptions.GetTimeoutError):
                    raise ShmevalTimeout(f"the evaluator on Ray node {node_id} did not answer "
                                       f"{method} within {timeout:g} s") from None
                cause = getattr(e, "cause", None)
                raise (cause if isinstance(cause, Exception) else e) from None
        return out

    # -- closing --------------------------------------------------------------------------

    def _close_actor(self, actor: Any, timeout: float) -> None:
        """Closes the actor's evaluator (its segment goes at once), then the actor."""
        with contextlib.suppress(ray.exceptions.RayError):
            # Dead already, or stuck: killing it makes its evaluator exit.
            ray.get(actor.close.remote(timeout), timeout=timeout + 5.0)
        ray.kill(actor)

    def _close_actors(self, timeout: float) -> None:
        """Closes every actor, serving or starting, all at once."""
        with self._lock:
            actors = list(self._actors.values()) + [a for a, _ in self._starting.values()]
            self._actors.clear()
            self._starting.clear()
        refs = [a.close.remote(timeout) for a in actors]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout + 5.0)
        for actor in actors:
            ray.kill(actor)

    def close(self, timeout: float = 10.0) -> None:
        """Stops every node's evaluator and its actor (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._watcher.join(timeout)
        self.handle.forget()
        self._close_actors(timeout)

    def __enter__(self) -> "ClusterEvaluator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
