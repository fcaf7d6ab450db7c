"""Pipelined search: several searches in one process, each searched while
the leaves of the others are being evaluated.

:func:`run_pipelined` takes searches written as steps (generators that
yield batches of leaves and are sent their ``(policy, value)``:
:meth:`~shmeval.mcts.MCTS.search_steps`, :meth:`~shmeval.mcts.MCTS.play_steps`
or your own) and a ``submit_batch`` (:func:`shmeval.mcts.submitter_fn` over
an shmeval client's ``submit``).  It submits every search's first batch,
then, oldest first, collects a batch, resumes its search up to its next
batch and submits that: with K searches, K - 1 batches are in flight while
the process works on one.  The order is fixed (first in, first out), so a
run is reproducible from its seeds.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, List, Sequence, Tuple

from .steps import Steps, SubmitBatch


def run_pipelined(searches: Sequence[Steps[Any]], submit_batch: SubmitBatch) -> List[Any]:
    """Runs ``searches`` to their ends, interleaved as the module says;
    returns what each returned, in order.  An exception from a search or
    an evaluation ends the run; the batches still in flight are dropped
    (an shmeval client gets their slots back once they are answered)."""
    results: List[Any] = [None] * len(searches)
    in_flight: Deque[Tuple[int, Callable[[], Tuple[Any, Any]]]] = deque()

    def resume(i: int, answer: Any) -> None:
        try:
            x = searches[i].send(answer)
        except StopIteration as e:
            results[i] = e.value
            return
        in_flight.append((i, submit_batch(x)))

    for i in range(len(searches)):
        resume(i, None)
    while in_flight:
        i, collect = in_flight.popleft()
        resume(i, collect())
    return results
