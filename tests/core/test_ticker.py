"""The ticker: a thread per registered process that lets its waits sleep
without a timer (ring.h shm_ticker; docs/protocol.md).

- a process's first request starts it, close() stops and joins it (no
  thread is left behind), and a forked child starts its own;
- a wait longer than the ticker's period comes back at each tick to check
  on the evaluator and still returns the right answer;
- without a ticker (none could be started) waits use timers and work the
  same.

That a waiter on a killed evaluator wakes through the ticker (it has no
timer) is tests/stress/test_reliability.py::test_killed_evaluator_wakes_every_waiter.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from typing import Any

import pytest

import shmeval
from shmeval import entry as entry_mod
from helpers import check_answer, make_ev, make_state, slow_fake_model


def task_count() -> int:
    return len(os.listdir("/proc/self/task"))


def task_count_becomes(n: int, timeout_s: float = 5.0) -> int:
    """The task count once it is n, or after timeout_s.  A joined thread
    can still be listed for a moment: the kernel wakes the joiner before it
    removes the exiting thread from /proc."""
    deadline = time.monotonic() + timeout_s
    while (count := task_count()) != n and time.monotonic() < deadline:
        time.sleep(0.01)
    return count


@pytest.mark.timeout(60)
def test_first_request_starts_it_and_close_joins_it() -> None:
    with make_ev() as ev:
        cl = shmeval.connect(ev.address)
        seg = cl._attach()
        before = task_count()
        check_answer(cl.evaluate(make_state(3)), 3)
        c = cl._c
        assert seg.ticker_running(c)
        assert task_count() == before + 1  # the ticker, and nothing else
        cl.close()  # detaches this process's entry
        assert not seg.ticker_running(c)
        assert task_count_becomes(before) == before
        # A new entry, a new ticker.
        check_answer(cl.evaluate(make_state(4)), 4)
        assert seg.ticker_running(cl._c)
        assert task_count() == before + 1
        cl.close()
        assert task_count_becomes(before) == before


def child_uses_its_own_ticker(ev: Any, conn: Any) -> None:
    try:
        out = ev.evaluate(make_state(11))
        seg = ev._attach()
        conn.send((float(out["value"]), seg.ticker_running(ev._c), task_count()))
    except BaseException as e:  # noqa: BLE001
        conn.send(repr(e))


@pytest.mark.timeout(60)
def test_forked_child_starts_its_own() -> None:
    with make_ev() as ev:
        check_answer(ev.evaluate(make_state(1)), 1)  # the parent's ticker runs
        parent_c = ev._c
        ctx = mp.get_context("fork")
        a, b = ctx.Pipe()
        p = ctx.Process(target=child_uses_its_own_ticker, args=(ev, b))
        p.start()
        assert a.poll(30), "the forked child did not answer"
        got = a.recv()
        p.join(30)
        assert not isinstance(got, str), got
        value, running, tasks = got
        assert value == -11.0
        assert running, "the child's waits went without a ticker"
        assert tasks == 2  # the child's main thread and its own ticker
        assert ev._attach().ticker_running(parent_c)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ticker", [True, False])
def test_waits_longer_than_a_tick(ticker: bool, monkeypatch: Any) -> None:
    """A 0.35 s model with ticks (or timers) every 50 ms: each wait comes
    back to the Python layer, which checks the evaluator and waits again,
    and every thread still gets its own answer.  (That the ticks do wake a
    waiter is the C test ticker (tests/c/test_doorbell.c) and, end to end,
    test_killed_evaluator_wakes_every_waiter: here a waiter the ticks
    missed would only sleep until its answer.)"""
    monkeypatch.setattr(entry_mod, "WAIT_TIMEOUT_NS", 50_000_000)
    with make_ev(lambda x: slow_fake_model(x, 0.35), max_batch=4) as ev:
        seg = ev._attach()
        check_answer(ev.evaluate(make_state(19)), 19)  # registers: starts the ticker
        if not ticker:  # as when no thread could be started
            seg.stop_ticker()
        got: dict[int, Any] = {}

        def one(i: int) -> None:
            got[i] = ev.evaluate(make_state(20 + i))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        t0 = time.monotonic()
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert not any(th.is_alive() for th in threads)
        assert time.monotonic() - t0 >= 0.35
        for i in range(3):
            check_answer(got[i], 20 + i)
        assert seg.ticker_running(ev._c) == ticker
