"""Waiting: how a process that waits for the other side (a client for its
answer, the evaluator for requests) spends that time, and what the choice
is made from.  It serves the client and the evaluator's tuner alike and
imports neither.

A waiter spins (looks again and again, holding its CPU), spins yielding
its CPU between looks, or sleeps until it is woken.  Which of the three
pays depends on the machine: a spin saves the cost of a sleep and a
wake-up only while the waiter has a CPU no other task wants.  So no
figure of one machine is written in here: budgets are counted in
wake-ups, and the probes measure the machine the process runs on, when it
runs:

* :func:`wake_cost_ns`, what a sleep and a wake-up cost here (the spin
  budget: spinning that long is never worse than twice the better choice
  made in hindsight);
* :func:`usable_cpus`, the CPUs this process may run on;
* :func:`runnable_tasks`, the tasks that want them now.

The rule that turns tasks and CPUs into a mode is the C core's, the one its
waits apply (``_ring.spin_policy``): :func:`spin_mode` asks it, so the
tuner's mode and the waits' own cannot disagree.  The rest are the checks
of the spin settings (``spin_us``, ``evaluator_spin_us``) and the client's
budgets from its ``spin_us`` (:func:`spin_budget`)."""
from __future__ import annotations

import functools
import math
import os
import statistics
import threading
import time
from typing import Dict, NamedTuple, Union

from . import _ring
from .checks import AUTO, check_auto

#: Spin modes: sleep at once; spin yielding the CPU between looks (the
#: ``_ring`` flag of a yielding spin budget is ``SPIN_YIELD``); spin.
SLEEP, YIELD, SPIN = "sleep", "yield", "spin"
#: A spin mode as the crowding a tuner publishes in the segment, which
#: every client's spin rule reads (ring.h's enum shm_crowding).
CROWDING: Dict[str, int] = {SPIN: _ring.CROWD_NONE, YIELD: _ring.CROWD_YIELD,
                            SLEEP: _ring.CROWD_SLEEP}
#: The largest spin budget (µs) either side accepts: a second.  (A budget
#: in ns must also leave ring.h's SHM_SPIN_YIELD bit clear.)
MAX_SPIN_US = 1_000_000.0
#: The long spin tried against the short one (one wake-up's cost), in
#: wake-ups, by the clients (``_ring.SpinArms``) and the evaluator (a
#: trial of the tuner): by the measured cost of a wake-up, a wait of this
#: many would lose about a sixteenth to a sleep.  The true cost of a sleep
#: is more (the waker's system call, the latency of waking a halted CPU),
#: so a client's long arm stretches beyond this to cover the answers it
#: waits for, up to four times as long (``SpinArms``).
SPIN_LONG_WAKES = 16
#: The largest process count ``_ring.spin_policy`` takes (a uint32).
_MAX_PROCESSES = (1 << 32) - 1


def check_spin_us(name: str, us: float) -> float:
    """A spin budget in µs (``spin_us``, ``evaluator_spin_us``; check_auto
    made it a float) from 0 to MAX_SPIN_US; ValueError otherwise (NaN
    included)."""
    if not 0 <= us <= MAX_SPIN_US:
        raise ValueError(f"{name} must be from 0 to {MAX_SPIN_US:g}, got {us}")
    return us


def check_spin_auto(spin_us: Union[float, str, None]) -> Union[float, str]:
    """A client's ``spin_us``: "auto" or a budget; None means "auto"."""
    return AUTO if spin_us is None else check_auto("spin_us", spin_us, check_spin_us)


class SpinBudget(NamedTuple):
    """A client's spin budgets in ns (what ``_ring.ClientPort`` and the
    waits of the general path take)."""

    #: What a wait spins before it sleeps: ``SpinArms``' short arm.
    ns: int
    #: ``SpinArms``' long arm, tried against the short one; 0: one fixed
    #: budget, nothing to try.
    long_ns: int


def spin_budget(spin_us: Union[float, str]) -> SpinBudget:
    """The budgets of a client's ``spin_us`` (as :func:`check_spin_auto`
    returns it): with "auto", one wake-up's cost (:func:`wake_cost_ns`)
    and SPIN_LONG_WAKES of them; with a number of µs, that budget alone."""
    if spin_us == AUTO:
        wake = wake_cost_ns()
        return SpinBudget(wake, SPIN_LONG_WAKES * wake)
    return SpinBudget(int(float(spin_us) * 1000), 0)


@functools.lru_cache(maxsize=1)
def wake_cost_ns(rounds: int = 31) -> int:
    """What it costs here for a thread to go to sleep and be woken: half the
    median round trip of two threads handing two locks back and forth
    (each hand-over is a futex wake-up of a sleeping thread, and the GIL).
    Measured once per process (about a millisecond)."""
    ping, pong = threading.Lock(), threading.Lock()
    ping.acquire()
    pong.acquire()

    def echo() -> None:
        for _ in range(rounds):
            ping.acquire()
            pong.release()

    t = threading.Thread(target=echo, name="shmeval-wake-cost", daemon=True)
    t.start()
    trips = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        ping.release()
        pong.acquire()
        trips.append(time.perf_counter_ns() - t0)
    t.join()
    return max(1, int(statistics.median(trips)) // 2)


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def runnable_tasks(cpus: int) -> float:
    """Tasks runnable now on ``cpus`` CPUs (the caller included): the
    machine's count from /proc/loadavg, scaled to the share of the online
    CPUs that ``cpus`` is (tasks taken as spread evenly)."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        return float(cpus)
    online = os.cpu_count() or cpus
    return running * min(1.0, cpus / online)


def spin_mode(runnable: float, cpus: int) -> str:
    """The mode ``_ring.spin_policy`` gives a waiter among ``runnable``
    tasks (the waiter included) on ``cpus`` CPUs: SPIN while each has a
    CPU, YIELD when they are one more, SLEEP beyond.  ``runnable`` may be
    a fraction (a smoothed or scaled count): it counts as the whole tasks
    it reaches, ``ceil(runnable)``."""
    processes = _MAX_PROCESSES if runnable > _MAX_PROCESSES else max(0, math.ceil(runnable))
    budget = _ring.spin_policy(1, processes, max(0, cpus))
    if budget == 0:
        return SLEEP
    return YIELD if budget & _ring.SPIN_YIELD else SPIN
