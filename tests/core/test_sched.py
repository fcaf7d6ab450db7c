"""shmeval.use_batch_scheduling, and the spin rule of the evaluator and
the clients (docs/performance.md, *Which knob when*)."""
from __future__ import annotations

import os

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


@pytest.mark.parametrize("n_attached, ncpu, kind", [
    (0, 2, "spin"), (1, 2, "spin"), (2, 2, "yield"), (3, 2, None), (16, 2, None), (64, 2, None),
    (7, 8, "spin"), (8, 8, "yield"), (9, 8, None),
])
def test_spin_rule(n_attached: int, ncpu: int, kind: str | None) -> None:
    """A plain spin while every process (the clients and the evaluator) has
    a CPU, a yielding one when they are one more than the CPUs, none beyond
    (docs/performance.md, *Which knob when*); the evaluator and each
    client follow the same rule, and a budget of 0 stays 0."""
    expect = {"spin": 50_000, "yield": 50_000 | _ring.SPIN_YIELD, None: 0}[kind]
    assert _ring.evaluator_spin(50_000, n_attached, ncpu) == expect
    assert _ring.spin_policy(50_000, n_attached + 1, ncpu) == expect
    assert _ring.evaluator_spin(0, n_attached, ncpu) == 0
    assert _ring.spin_policy(0, n_attached + 1, ncpu) == 0


@pytest.mark.timeout(30)
def test_client_waits_use_the_rule() -> None:
    """The budget a client's wait uses (Segment._spin) follows the rule
    with the clients registered on the segment right now, plus the
    evaluator."""
    import os

    from helpers import INPUT_SHAPE, OUTPUTS

    from shmeval import segment
    from shmeval.spec import Spec

    spec = Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 8, 4, 1)
    seg, name = segment.create(spec)
    try:
        seen = []
        for _ in range(4):
            seen.append(seg.client_spin(50_000, 2))
            seg.register(os.getpid(), 0, 0)
        # 0 and 1 clients: every process has a CPU; 2: one too many; 3: more
        assert seen == [50_000, 50_000, 50_000 | _ring.SPIN_YIELD, 0]
        assert seg.client_spin(0, 2) == 0
    finally:
        segment.unlink(name)


@pytest.mark.timeout(30)
def test_client_waits_follow_the_published_crowding() -> None:
    """Other programs' runnable tasks, as the evaluator's tuner publishes
    them (Segment.set_crowding), count like processes of the segment: with
    one client on 8 CPUs, a crowded machine makes the wait yield or sleep,
    and a crowding no worse than the segment's own changes nothing."""
    import os

    from helpers import INPUT_SHAPE, OUTPUTS

    from shmeval import segment
    from shmeval.spec import Spec

    spec = Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 8, 4, 1)
    seg, name = segment.create(spec)
    try:
        seg.register(os.getpid(), 0, 0)
        assert seg.crowding() == _ring.CROWD_NONE   # nothing published yet
        seen = {}
        for crowd in (_ring.CROWD_NONE, _ring.CROWD_YIELD, _ring.CROWD_SLEEP):
            seg.set_crowding(crowd)
            seen[crowd] = (seg.client_spin(50_000, 8), seg.client_spin(50_000, 1))
        assert seen == {
            _ring.CROWD_NONE: (50_000, 50_000 | _ring.SPIN_YIELD),   # 2 processes
            _ring.CROWD_YIELD: (50_000 | _ring.SPIN_YIELD, 50_000 | _ring.SPIN_YIELD),
            _ring.CROWD_SLEEP: (0, 0),
        }
        with pytest.raises(ValueError, match="crowding"):
            seg.set_crowding(3)
    finally:
        segment.unlink(name)


@pytest.mark.timeout(60)
def test_a_serving_evaluator_publishes_the_crowding(monkeypatch: pytest.MonkeyPatch) -> None:
    """A serving evaluator's tuner reads the runnable tasks at its
    housekeeping and publishes what they mean for the clients' spins: a
    machine with many more runnable tasks than CPUs makes them sleep."""
    import time

    from helpers import make_ev, make_state

    from shmeval import tuning

    monkeypatch.setattr(tuning, "runnable_tasks", lambda cpus: 3.0 * cpus + 2)
    with make_ev() as ev:
        state = make_state(1)
        deadline = time.monotonic() + 30
        while ev._seg.crowding() != _ring.CROWD_SLEEP and time.monotonic() < deadline:
            ev.evaluate(state)
            time.sleep(0.01)
        assert ev._seg.crowding() == _ring.CROWD_SLEEP
        assert ev._seg.client_spin(50_000, os.cpu_count() or 1) == 0
        assert ev.stats()["tuner"]["crowding"] == "sleep"
