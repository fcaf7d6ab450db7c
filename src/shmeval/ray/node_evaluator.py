"""The Ray actor that owns one node's evaluator.

:class:`~shmeval.ray.ClusterEvaluator` places one :class:`NodeEvaluator`
on each node, pinned there, under the name :func:`actor_name`; it calls
``Evaluator.spawn(factory, **evaluator_kwargs)``, so the model and its
framework live in the spawned evaluator process and nowhere else.  The
actor only starts, updates, reports and closes it: no evaluation passes
through Ray.  When the actor dies (its node left, or its owner, the
driver, exited), the spawned evaluator sees its creator gone, removes its
segment and exits.

Ray kills more than the actor when it ends one: a worker that exits kills
its direct children (``SIGKILL``, Ray's
``kill_child_processes_on_worker_exit``), and a node that is removed takes
its workers' process groups with it.  Killed so, the evaluator could not
remove its segment.  So it is started through a fork server
(``mp_context="forkserver"``: not a child of the actor's process) and
leaves the actor's session before it builds the model (:func:`detached`);
it then outlives the actor by one housekeeping period, sees its creator
gone, removes its segment and exits.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Dict, Optional

from ..errors import ShmevalError
from ..evaluator import Evaluator


#: The start method of each node's evaluator process (the module's docstring).
MP_CONTEXT = "forkserver"


def detached(factory: Callable[..., Any], *args: Any) -> Any:
    """Runs in each evaluator process: leaves the Ray worker's session and
    process group (``setsid``), then builds the model with ``factory``."""
    try:
        os.setsid()
    except OSError:  # already a session leader
        pass
    return factory(*args)


def actor_name(name: str, node_id: str) -> str:
    """The Ray name of cluster evaluator ``name``'s actor on node ``node_id``:
    a worker finds its own node's evaluator by its node id, since nodes may
    share an address (several nodes of one machine)."""
    return f"{name}:{node_id}"


def segment_name(name: str) -> str:
    """The address of cluster evaluator ``name``'s segment made by this
    actor (``Evaluator.spawn(name=...)``): ``shmeval ls`` shows whose it is;
    the actor's pid, where a segment's name keeps its creator's, makes it
    differ per node (nodes of one machine share ``/dev/shm``)."""
    return f"/shmeval-{os.getpid()}-{name}"


class NodeEvaluator:
    """One node's evaluator, as a Ray actor (the class is wrapped with
    ``ray.remote`` where it is placed).  A failed start-up is kept and
    raised by :meth:`ready`, so that the driver gets the evaluator's own
    exception (``ModelError``, ``EvaluatorDied``, ``ValueError``, ...)."""

    def __init__(self, factory: Callable[[], Any], evaluator_kwargs: Dict[str, Any],
                 weights: Any, version: int) -> None:
        self._ev: Optional[Evaluator] = None
        self._error: Optional[BaseException] = None
        try:
            kwargs = {**evaluator_kwargs, "name": segment_name(evaluator_kwargs["name"])}
            self._ev = Evaluator.spawn(functools.partial(detached, factory), **kwargs)
            if weights is not None:
                # Before the address is handed out: this node's workers never
                # see the weights it started with once others are serving.
                self._ev.set_weights(weights, version=version)
        except Exception as e:
            self._error = e
            if self._ev is not None:
                self._ev.close()
                self._ev = None

    def _serving(self) -> Evaluator:
        if self._error is not None:
            raise self._error
        if self._ev is None:
            raise ShmevalError("this node's evaluator is closed")
        return self._ev

    def ready(self) -> str:
        """The evaluator's address, once it serves; its start-up error otherwise."""
        return self._serving().address

    def set_weights(self, weights: Any, version: int, timeout: float) -> int:
        """Applies ``weights`` (the driver's one object-store copy, resolved
        by Ray on this node) as ``version``; returns it."""
        return self._serving().set_weights(weights, version=version, timeout=timeout)

    def stats(self) -> Dict[str, Any]:
        ev = self._serving()
        return {"address": ev.address, "pid": ev.pid, **ev.stats()}

    def close(self, timeout: float) -> None:
        """Stops serving and removes the segment (idempotent)."""
        if self._ev is not None:
            self._ev.close(timeout)
            self._ev = None
