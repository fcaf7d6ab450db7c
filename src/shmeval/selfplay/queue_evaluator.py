"""The queue mode's evaluator process and the workers' end of its queues.

A worker puts ``(worker id, leaf batch as raw float32 bytes)`` on the
shared request ``multiprocessing.Queue``; the evaluator takes one request
and whatever else is queued, calls the net once on the concatenation and
puts each worker's rows back on the worker's own ``SimpleQueue``, packed as
float32 ``[rows, 7 policy + 1 value]``."""
from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np

from .._util.children import child_setup
from .._util.queue_batches import queued_batches
from .._util.simdevice import SimLink, wrap_if
from ..games import connect4
from .net import EvaluateBatch, net_function
from .pinning import pin
from .settings import Settings

STATE_BYTES = int(np.prod(connect4.INPUT_SHAPE)) * 4
#: float32 per answered row: the policy, then the value.
ROW_WIDTH = connect4.N_ACTIONS + 1
# The queue evaluator's shared counters.
Q_REQUESTS, Q_ROWS, Q_BATCHES, Q_MODEL_NS, Q_BUSY_NS = range(5)
N_COUNTERS = 8


def _request_rows(request: Tuple[int, bytes]) -> int:
    return len(request[1]) // STATE_BYTES


def queue_evaluator_main(s: Settings, tf_threads: int, requests: Any, responses: List[Any],
                         counters_raw: Any, conn: Any, cpus: Optional[set[int]] = None,
                         sim: Optional[SimLink] = None) -> None:
    """The queue mode's evaluator: batches as :func:`queued_batches` forms
    them (up to ``s.max_batch`` rows), one call of the traced net on the
    concatenated rows, each worker's rows back on its own queue.  The net
    runs with ``tf_threads`` TensorFlow threads (0: TensorFlow's default),
    behind the simulated GPU ``sim`` when given (after its warm-ups).
    Reports ("ready", pid) or ("error", traceback) on ``conn``; stops at a
    None request."""
    child_setup()
    pin(cpus)
    try:
        from ..games.connect4_net import build_resnet, import_tensorflow

        tf = import_tensorflow(tf_threads or None)
        model = build_resnet(s.net, seed=s.seed, compile=False)
        fn = net_function(tf, model, None, s)
        for n in (1, s.workers * s.games_per_worker):
            fn(np.zeros((n,) + connect4.INPUT_SHAPE, np.float32))
        fn = wrap_if(sim, fn)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        os._exit(1)
    conn.send(("ready", os.getpid()))
    counters = np.frombuffer(counters_raw, dtype=np.int64)
    shape = (-1,) + connect4.INPUT_SHAPE
    for items in queued_batches(requests, s.max_batch, _request_rows):
        t0 = time.perf_counter_ns()
        batch = np.frombuffer(b"".join(b for _, b in items), dtype=np.float32).reshape(shape)
        t1 = time.perf_counter_ns()
        out = fn(batch)
        packed = np.empty((len(batch), ROW_WIDTH), np.float32)
        packed[:, :-1] = out["policy"]
        packed[:, -1] = out["value"].reshape(-1)
        t2 = time.perf_counter_ns()
        off = 0
        for wid, b in items:
            k = len(b) // STATE_BYTES
            responses[wid].put(packed[off:off + k].tobytes())
            off += k
        t3 = time.perf_counter_ns()
        counters[Q_REQUESTS] += len(items)
        counters[Q_ROWS] += len(batch)
        counters[Q_BATCHES] += 1
        counters[Q_MODEL_NS] += t2 - t1
        counters[Q_BUSY_NS] += t3 - t0
    sys.stdout.flush()
    os._exit(0)


@dataclass
class QueueLink:
    """A worker's end: the shared request queue and its own response queue."""

    wid: int
    requests: Any
    response: Any

    def open(self, s: Settings) -> EvaluateBatch:
        put, get = self.requests.put, self.response.get
        frombuffer = np.frombuffer
        wid = self.wid

        def evaluate_batch(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
            put((wid, x.tobytes()))
            r = frombuffer(get(), dtype=np.float32).reshape(len(x), ROW_WIDTH)
            return r[:, :-1], r[:, -1]

        return evaluate_batch
