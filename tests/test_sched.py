"""shmeval.use_batch_scheduling, and the evaluator's spin rule
(docs/performance.md, finding 21)."""
from __future__ import annotations

import pytest
from helpers import run_python

from shmeval import _ring


@pytest.mark.timeout(60)
def test_batch_scheduling_in_a_fresh_process() -> None:
    """SCHED_BATCH for the caller and the threads it starts afterwards, and
    back to the default policy with enable=False."""
    code = (
        "import os, threading, shmeval\n"
        "a = os.sched_getscheduler(0)\n"
        "shmeval.use_batch_scheduling()\n"
        "b = os.sched_getscheduler(0)\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))\n"
        "t.start(); t.join()\n"
        "shmeval.use_batch_scheduling(False)\n"
        "print(a == os.SCHED_OTHER, b == os.SCHED_BATCH, seen == [os.SCHED_BATCH],\n"
        "      os.sched_getscheduler(0) == os.SCHED_OTHER)\n"
    )
    out = run_python(code)
    assert out.stdout.split() == ["True"] * 4, out.stderr


@pytest.mark.parametrize("n_attached, ncpu, spins", [
    (1, 2, True), (2, 2, True), (3, 2, False), (16, 2, False), (64, 2, False), (8, 16, True),
])
def test_evaluator_spins_only_while_clients_fit_on_its_cpus(n_attached: int, ncpu: int,
                                                          spins: bool) -> None:
    assert _ring.evaluator_spin(50_000, n_attached, ncpu) == (50_000 if spins else 0)
