"""Searches written as *steps*, and the evaluators they are driven with.

A search written as steps is a generator that yields each batch of
encoded leaves and is sent back its ``(policy, value)``
(:meth:`shmeval.mcts.MCTS.search_steps`); :func:`drive` runs one against
``evaluate_batch``, a call at a time, and
:func:`shmeval.mcts.pipelined.run_pipelined` runs several against
``submit_batch``.  Here so that the search and the pipelined driver both
import it, and not each other."""
from __future__ import annotations

from typing import Any, Callable, Generator, Tuple, TypeVar

import numpy as np

R = TypeVar("R")

#: ``evaluate_batch(states [n, *input_shape]) -> (policy [n, n_actions] probabilities, value [n])``
EvaluateBatch = Callable[[np.ndarray], Tuple[Any, Any]]

#: ``submit_batch(states) -> collect``: starts the evaluation of a batch (it
#: must have copied or sent ``states`` before it returns) and returns a
#: function that returns its ``(policy, value)``, waiting if need be.
SubmitBatch = Callable[[np.ndarray], Callable[[], Tuple[Any, Any]]]

#: A search written as steps: yields batches of encoded leaves (views of a
#: buffer the search reuses), is sent each one's ``(policy, value)``,
#: returns its result.
Steps = Generator[np.ndarray, Tuple[Any, Any], R]


def drive(steps: Steps[R], evaluate_batch: EvaluateBatch) -> R:
    """Runs ``steps`` to the end, one ``evaluate_batch`` call per batch it
    yields; returns what it returns."""
    try:
        x = next(steps)
        while True:
            x = steps.send(evaluate_batch(x))
    except StopIteration as e:
        result: R = e.value
        return result
