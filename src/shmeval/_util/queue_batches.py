"""How an evaluator behind a ``multiprocessing.Queue`` forms its batches:
the loop of the Queue baselines that shmeval is compared with."""
from __future__ import annotations

import queue
from typing import Any, Callable, Iterator, List, Optional


def queued_batches(requests: Any, max_rows: int,
                   rows: Optional[Callable[[Any], int]] = None) -> Iterator[List[Any]]:
    """The batches of requests read from ``requests`` (a
    ``multiprocessing.Queue``): waits for one request, then takes whatever
    else is already queued (``get_nowait``, never waiting) while the batch
    holds fewer than ``max_rows`` rows, counting ``rows(request)`` rows per
    request (one when ``rows`` is None).  A None on the queue is the stop
    sentinel: the requests taken before it are still yielded as a batch,
    then the iteration ends."""
    get, get_nowait = requests.get, requests.get_nowait
    while True:
        first = get()
        if first is None:
            return
        batch = [first]
        n = 1 if rows is None else rows(first)
        stopping = False
        while n < max_rows:
            try:
                item = get_nowait()
            except queue.Empty:
                break
            if item is None:
                stopping = True
                break
            batch.append(item)
            n += 1 if rows is None else rows(item)
        yield batch
        if stopping:
            return
