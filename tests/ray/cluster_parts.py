"""What the Ray tests place on the nodes: a model and factories for the
evaluators, and the worker actor.  Ray and each evaluator process import
them by name, so they live in a module of their own on the nodes'
PYTHONPATH."""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import ray
import ray.actor
import ray.remote_function

INPUT_SHAPE = (3,)
#: ``pid``: the evaluator process that answered; ``weight``: the weights serving.
OUTPUTS = {"pid": ((), "int64"), "weight": ((), "float32")}
SPEC = {"input_shape": INPUT_SHAPE, "outputs": OUTPUTS, "max_batch": 32}


class PidNet:
    """Answers with its process id and its one weight."""

    def __init__(self) -> None:
        self.weight = np.float32(0.0)

    def __call__(self, x: np.ndarray) -> Dict[str, np.ndarray]:
        n = len(x)
        return {"pid": np.full(n, os.getpid(), np.int64),
                "weight": np.full(n, self.weight, np.float32)}

    def set_weights(self, weights: Any) -> None:
        """A list of one array, or a state dict {"weight": array}."""
        (w,) = weights.values() if isinstance(weights, dict) else weights
        self.weight = np.float32(w)


def pid_net() -> PidNet:
    return PidNet()


def failing_factory() -> PidNet:
    raise RuntimeError("this node has no model")


#: The Ray API a worker could reach a remote evaluator through: the calls
#: :class:`RayCalls` counts.
RAY_API = ((ray, "get"), (ray, "put"), (ray, "wait"), (ray, "get_actor"),
           (ray.actor.ActorMethod, "_remote"), (ray.actor.ActorClass, "_remote"),
           (ray.remote_function.RemoteFunction, "_remote"))


@contextlib.contextmanager
def count_ray_calls() -> Iterator[List[int]]:
    """Counts the calls into :data:`RAY_API` in this process while open;
    yields a one-item list holding the count."""
    count = [0]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in RAY_API]

    def counting(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return fn(*args, **kwargs)
        return call

    for owner, attr, fn in saved:
        setattr(owner, attr, counting(fn))
    try:
        yield count
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


@ray.remote(num_cpus=0, max_concurrency=2)
class Player:
    """A worker: finds its node's evaluator through the handle it is given
    and evaluates one state at a time."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.evaluations = 0
        self.weights_seen: List[float] = []
        self.versions_backwards = 0
        self._stop = threading.Event()
        self.error: Optional[str] = None

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())

    def evaluate_counting(self, n: int) -> Dict[str, Any]:
        """Connects, then evaluates ``n`` states: the Ray calls of each
        part, the address used and the evaluator processes that answered."""
        with count_ray_calls() as at_connect:
            client = self.handle.connect()
        state = np.zeros(INPUT_SHAPE, np.float32)
        pids = set()
        with count_ray_calls() as while_evaluating:
            for _ in range(n):
                pids.add(int(client.evaluate(state)["pid"]))
        return {"ray_calls_connect": at_connect[0], "ray_calls_evaluating": while_evaluating[0],
                "address": client.address, "pids": sorted(pids), "node_id": self.node_id()}

    def play(self) -> None:
        """Evaluates until :meth:`halt`, recording the weights it sees and
        any version that went backwards."""
        client = self.handle.connect()
        state = np.zeros(INPUT_SHAPE, np.float32)
        last = -1
        try:
            while not self._stop.is_set():
                out, version = client.evaluate(state, return_version=True)
                if version < last:
                    self.versions_backwards += 1
                if version != last:
                    self.weights_seen.append(float(out["weight"]))
                last = version
                self.evaluations += 1
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"

    def progress(self) -> int:
        return self.evaluations

    def halt(self) -> Dict[str, Any]:
        self._stop.set()
        return {"evaluations": self.evaluations, "weights_seen": self.weights_seen,
                "versions_backwards": self.versions_backwards, "error": self.error}
