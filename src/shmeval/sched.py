"""Scheduling policy for worker processes."""
from __future__ import annotations

import os


def use_batch_scheduling(enable: bool = True) -> None:
    """Puts the calling thread, and the threads it starts afterwards, under
    Linux's ``SCHED_BATCH`` policy (``enable=False``: back to the default
    ``SCHED_OTHER``).  Call it at the start of each search worker when the
    workers outnumber the cores many times over, and measure.

    A ``SCHED_BATCH`` thread is scheduled like any other, with the same
    share of the CPU, but waking up does not let it preempt the thread that
    is running.  A worker woken by its answer then does not interrupt the
    evaluator halfway through waking the rest of its batch.  Whether that
    pays depends on the machine and the load, so measure: on the 2-core
    reference VM the null-model benchmark at 16 workers ran as fast with it
    as without, with a much longer tail (p99 832 µs against 136 µs), while
    the self-play demo's workers, which search between evaluations, gain
    from it (docs/guide.md, "Many workers on few cores").  It needs no
    privileges.
    """
    policy = os.SCHED_BATCH if enable else os.SCHED_OTHER
    os.sched_setscheduler(0, policy, os.sched_param(0))
