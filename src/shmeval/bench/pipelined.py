"""The pipelined shmeval client as a method of ``shmeval bench``: each
worker keeps ``depth`` submissions of its state in flight
(``Client.submit``), so that when it collects one, the next answers are
already being computed or waiting, and it rarely sleeps.

The harness times one call per answer, so a "round trip" here is the time
between two answers of one worker (a request's own latency is about
``depth`` of them); the throughput is answers per second, as for every
other method.  The timed loop is C (``timed_pipelined``), as the blocking
methods' is (``timed_calls``): each answer costs the ``result()`` of the
oldest submission and one ``submit``, and no interpreter around them.
``depth`` 1 is the blocking round trip split into a submit and a collect:
the cost of a Pending per call against ``evaluate``'s fast path.
"""
from __future__ import annotations

from collections import deque
from multiprocessing.context import SpawnContext
from typing import Any, Deque, Dict, Optional, Tuple

import numpy as np

from ._timing import timed_pipelined
from .roundtrip import Client, ModelFactory, NullModel, ShmevalMethod, StateSpec


class PipelinedClient:
    """``evaluate(state)`` collects the oldest of ``depth`` submissions of
    ``state`` in flight and submits it once more; it returns the batch of
    one's outputs (``{name: array [1, ...]}``), which a pipelined search
    indexes as it needs.  The harness times the submit and the collect,
    not an adapter around them: the one-row batch is made once per state
    object and the outputs are not unpacked per state.  Picklable: the
    queue is made in the worker on first use."""

    def __init__(self, evaluator: Any, depth: int) -> None:
        self.evaluator = evaluator
        self.depth = depth
        self.queue: Optional[Deque[Any]] = None
        self.state: Any = None
        self.states: Any = None

    def __getstate__(self) -> Dict[str, Any]:
        return {"evaluator": self.evaluator, "depth": self.depth, "queue": None,
                "state": None, "states": None}

    def evaluate(self, state: np.ndarray) -> Dict[str, np.ndarray]:
        if state is not self.state:
            self.state, self.states = state, state[None]
        q = self.queue
        if q is None:
            q = self.queue = deque(self.evaluator.submit(self.states) for _ in range(self.depth))
        out: Dict[str, np.ndarray] = q.popleft().result()
        q.append(self.evaluator.submit(self.states))
        return out

    def timed_loop(self, state: np.ndarray, t_end: int, lat: np.ndarray) -> Tuple[int, Any]:
        """The harness's timed loop (``--loop c``): ``evaluate(state)``
        until t_end, in C (``timed_pipelined``), as the blocking methods'
        ``evaluate`` is called from C (``timed_calls``)."""
        self.evaluate(state)  # the queue and the one-row batch, off the clock
        assert self.queue is not None
        return timed_pipelined(self.evaluator.submit, self.states, self.queue, t_end, lat)


class PipelinedMethod(ShmevalMethod):
    """shmeval.Evaluator.spawn, every worker through a PipelinedClient of
    ``depth`` submissions in flight."""

    def __init__(self, depth: int, model: ModelFactory = NullModel) -> None:
        super().__init__(threaded=False, model=model)
        self.depth = depth

    def start(self, ctx: SpawnContext, n_workers: int, spec: StateSpec,
              max_batch: int) -> list[Client]:
        clients = super().start(ctx, n_workers, spec, max_batch)
        return [PipelinedClient(c, self.depth) for c in clients]
