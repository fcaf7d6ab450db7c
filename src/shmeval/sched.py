"""Scheduling policy for worker processes (docs/performance.md, finding 21)."""
from __future__ import annotations

import os


def use_batch_scheduling(enable: bool = True) -> None:
    """Puts the calling thread, and the threads it starts afterwards, under
    Linux's ``SCHED_BATCH`` policy (``enable=False``: back to the default
    ``SCHED_OTHER``).  Call it at the start of each search worker when the
    workers outnumber the cores many times over, and measure.

    A ``SCHED_BATCH`` thread is scheduled like any other, with the same
    share of the CPU, but waking up does not let it preempt the thread that
    is running.  A worker woken by its answer then no longer interrupts the
    evaluator halfway through waking the rest of its batch.  When it was
    introduced it raised shmeval's round trips/s with 16 workers on 2
    cores by 20-35% (docs/performance.md, finding 21).  Since the evaluator
    wakes a batch in one system call and clients sleep without timers
    (findings 22, 23) the runs differ: the latest full pair on 2 cores
    gained at every worker count from 2 to 64, with a longer tail at 32-64;
    the pair before it lost at 8 and 16: measure (README, "Many workers on
    few cores").  It needs no privileges.
    """
    policy = os.SCHED_BATCH if enable else os.SCHED_OTHER
    os.sched_setscheduler(0, policy, os.sched_param(0))
