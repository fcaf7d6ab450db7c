"""The benchmark suite behind ``shmeval bench``.

roundtrip
    The harness: N worker processes, one server, one timed window per trial.
baselines
    multiprocessing.Queue, multiprocessing.Pipe, faster-fifo, and shared-memory
    slots with Lock/Semaphore wake-ups.
report
    Summary, tables, plot and the progress line.
cli
    The arguments and the run of ``shmeval bench``.
reference, batchpath
    What the machine allows (wake-up and copy costs) and the evaluator's
    per-batch cost, printed after the round trips.
_timing
    The timing in C (an extension of its own, with pingpong.h): the
    workers' timed loop and the futex ping-pong reference.
pipelined
    The pipelined client (``Client.submit``) as methods ``shm_pipe1``,
    ``shm_pipe2``, ``shm_pipe4``: 1, 2 or 4 submissions in flight per worker.
demo
    ``shmeval demo``: round trips through a small NumPy net from N
    processes, the shortest look at the core at work.

:data:`METHODS` maps each method's name to a factory of a fresh method object;
a factory takes an optional ``model`` (a picklable ``policy_size -> model``,
default :class:`~shmeval.bench.roundtrip.NullModel`).
"""
from __future__ import annotations

import functools
from typing import Callable

from .baselines import FasterFifoMethod, LocksemMethod, PipeMethod, QueueMethod
from .pipelined import PipelinedMethod
from .roundtrip import STATES, Method, ModelFactory, NullModel, ShmevalMethod, StateSpec

MethodFactory = Callable[..., Method]

METHODS: dict[str, MethodFactory] = {
    "queue": QueueMethod,
    "pipe": PipeMethod,
    "faster_fifo": FasterFifoMethod,
    "locksem": LocksemMethod,
    "shmeval": functools.partial(ShmevalMethod, threaded=False),
    "shm_thread": functools.partial(ShmevalMethod, threaded=True),
    # The pipelined client (Client.submit): K submissions in flight per worker.
    "shm_pipe1": functools.partial(PipelinedMethod, 1),
    "shm_pipe2": functools.partial(PipelinedMethod, 2),
    "shm_pipe4": functools.partial(PipelinedMethod, 4),
}
# What a run measures unless --methods says otherwise (shm_thread serves from
# the benchmark's own process, which also runs the harness: opt-in).
DEFAULT_METHODS = ("queue", "pipe", "faster_fifo", "locksem", "shmeval")
# The methods that need a package shmeval does not depend on.
OPTIONAL_PACKAGES = {"faster_fifo": "faster_fifo"}

__all__ = ["DEFAULT_METHODS", "METHODS", "OPTIONAL_PACKAGES", "STATES", "Method", "MethodFactory", "ModelFactory",
           "NullModel", "StateSpec"]
