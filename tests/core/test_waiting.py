"""Waiting (shmeval.waiting): the probes of the machine, the spin mode
asked of the one rule (``_ring.spin_policy``) rather than restated, the
checks of the spin settings and a client's budgets from its ``spin_us``."""
from __future__ import annotations

import math
import os
from typing import List, Tuple

import pytest

from shmeval import _ring, waiting
from shmeval.waiting import (MAX_SPIN_US, SLEEP, SPIN, SPIN_LONG_WAKES, YIELD, SpinBudget,
                             check_spin_auto, check_spin_us, spin_budget, spin_mode)


@pytest.mark.parametrize("runnable, cpus, mode", [
    (0.0, 1, SPIN), (1.0, 1, SPIN), (1.5, 1, YIELD), (2.0, 1, YIELD), (2.01, 1, SLEEP),
    (2.0, 2, SPIN), (2.3, 2, YIELD), (3.0, 2, YIELD), (3.2, 2, SLEEP), (40.0, 2, SLEEP),
    (8.0, 8, SPIN), (9.0, 8, YIELD), (9.5, 8, SLEEP), (1e12, 2, SLEEP),
])
def test_spin_mode(runnable: float, cpus: int, mode: str) -> None:
    """A plain spin while every runnable task (the waiter included) has a
    CPU, a yielding one when they are one more, sleep beyond; a fraction of
    a task counts as a whole one."""
    assert spin_mode(runnable, cpus) == mode


def test_spin_mode_is_the_policy_at_whole_tasks() -> None:
    """spin_mode(runnable, cpus) is _ring.spin_policy's verdict for
    ceil(runnable) processes on cpus CPUs, whatever the budget asked for."""
    for cpus in range(1, 10):
        for quarter in range(0, 4 * (cpus + 4)):
            runnable = quarter / 4
            got = _ring.spin_policy(50_000, math.ceil(runnable), cpus)
            expect = SLEEP if got == 0 else YIELD if got & _ring.SPIN_YIELD else SPIN
            assert spin_mode(runnable, cpus) == expect, (runnable, cpus)


def test_spin_mode_asks_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mode is whatever _ring.spin_policy says: a rule restated in
    Python would not follow a changed one."""
    asked: List[Tuple[int, int, int]] = []

    def policy(spin_ns: int, processes: int, ncpu: int) -> int:
        asked.append((spin_ns, processes, ncpu))
        return {3: 0, 4: spin_ns | _ring.SPIN_YIELD}.get(processes, spin_ns)

    monkeypatch.setattr(_ring, "spin_policy", policy)
    assert spin_mode(2.5, 8) == SLEEP       # the real rule: spin (3 tasks on 8 CPUs)
    assert spin_mode(4.0, 8) == YIELD
    assert spin_mode(1.0, 8) == SPIN
    assert [(p, n) for _, p, n in asked] == [(3, 8), (4, 8), (1, 8)]
    assert all(s > 0 for s, _, _ in asked)


def test_check_spin_us() -> None:
    assert check_spin_us("spin_us", 0.0) == 0.0
    assert check_spin_us("spin_us", MAX_SPIN_US) == MAX_SPIN_US
    for bad in (-1.0, MAX_SPIN_US + 1, math.nan):
        with pytest.raises(ValueError, match="evaluator_spin_us must be from 0 to"):
            check_spin_us("evaluator_spin_us", bad)


def test_check_spin_auto() -> None:
    assert check_spin_auto(None) == "auto"
    assert check_spin_auto("auto") == "auto"
    assert check_spin_auto(5) == 5.0
    with pytest.raises(ValueError, match="spin_us must be 'auto' or a number"):
        check_spin_auto("fast")
    with pytest.raises(ValueError, match="spin_us must be from 0"):
        check_spin_auto(-3)
    with pytest.raises(TypeError, match="spin_us must be 'auto' or a number"):
        check_spin_auto([1])  # type: ignore[arg-type]


def test_spin_budget() -> None:
    """"auto": one wake-up's cost and SPIN_LONG_WAKES of them (SpinArms'
    two arms); a number of µs: that budget alone."""
    wake = waiting.wake_cost_ns()
    assert spin_budget("auto") == SpinBudget(wake, SPIN_LONG_WAKES * wake)
    assert spin_budget(5.0) == SpinBudget(5_000, 0)
    assert spin_budget(2.5) == (2_500, 0)
    assert spin_budget(0.0).ns == 0


def test_wake_cost_is_measured_once() -> None:
    a = waiting.wake_cost_ns()
    assert a > 0 and waiting.wake_cost_ns() == a


def test_runnable_tasks_reads_the_machine() -> None:
    assert waiting.runnable_tasks(1) > 0   # the reader itself is running


def test_usable_cpus() -> None:
    assert waiting.usable_cpus() == len(os.sched_getaffinity(0)) >= 1
