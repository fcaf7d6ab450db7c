"""Pipelined evaluation under the faults evaluate_many survives.

- test_pipelined_conservation: 16 processes submit batches of 1-3 states and
  collect them in random order (result, wait_any, as_completed), more in
  flight at times than their slots: every answer is the worker's own, none
  lost, none twice (the harness of test_conservation.py, spawn and fork).
- test_killed_workers_with_submissions_in_flight: workers that keep
  several submissions in flight, drop some uncollected and collect the rest
  in random order, SIGKILLed at random moments and replaced: the survivors
  get only their own answers and every slot back, every dead entry is
  reclaimed, no stale completion, every slot of the table ends FREE.
- test_dead_evaluator_with_submissions_in_flight /
  test_closed_evaluator_with_submissions_in_flight: submissions waited for
  by result(), wait_any() and evaluate_async() in other processes and in
  this one raise EvaluatorDied (SIGKILL of a spawned evaluator) or
  EvaluatorClosed (close()), as evaluate_many does; nobody hangs.

Out-of-order collection, dropped Pendings and threads in one process are
in tests/core/test_pipeline.py.
"""
from __future__ import annotations

import functools
import multiprocessing as mp
import os
import random
import signal
import threading
import time
from typing import Any, Callable

import pytest

import shmeval
from conservation import KW, pipelined_worker, run_workers
from helpers import fake_model, slow_fake_factory
from pipeline_children import pipelined_load_worker, stranded_waiter
from reliability_children import slow_forever_factory, tagged_states

WORKERS = 8
MAX_CLIENTS = WORKERS + 8
KILLS = 24
START_TIMEOUT = 90.0
NO_HANG = 10.0
FREE = 0


# ---------------------------------------------------------------- helpers

class Child:
    """A child process with a duplex pipe; its messages, by kind."""

    def __init__(self, ctx: Any, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.conn, theirs = ctx.Pipe()
        self.p = ctx.Process(target=target, args=args + (theirs,), daemon=True)
        self.p.start()
        theirs.close()
        self.msgs: dict[str, tuple[Any, ...]] = {}

    def wait_for(self, kind: str, timeout: float) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout
        while kind not in self.msgs:
            left = deadline - time.monotonic()
            assert left > 0, f"child {self.p.pid}: no {kind!r} within {timeout} s (exit code " \
                             f"{self.p.exitcode}, got {sorted(self.msgs)})"
            if self.conn.poll(min(left, 0.1)):
                try:
                    m = self.conn.recv()
                except EOFError:
                    time.sleep(0.05)
                    continue
                self.msgs[m[0]] = m
        return self.msgs[kind]

    def kill(self) -> None:
        if self.p.is_alive():
            self.p.kill()
        self.p.join(30)


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)


# ---------------------------------------------------------------- conservation

@pytest.mark.timeout(300)
@pytest.mark.parametrize("ctx_name", ["spawn", "fork"])
def test_pipelined_conservation(ctx_name: str) -> None:
    with shmeval.Evaluator(fake_model, **KW) as ev:
        run_workers(ev, ctx_name, worker=pipelined_worker)


# ---------------------------------------------------------------- killed workers

@pytest.mark.timeout(240)
def test_killed_workers_with_submissions_in_flight() -> None:
    ctx: Any = mp.get_context("spawn")
    rng = random.Random(28)
    ev = shmeval.Evaluator.spawn(functools.partial(slow_fake_factory, 0.002), **dict(
        KW, max_clients=MAX_CLIENTS))
    workers: dict[int, Child] = {}
    killed = 0
    try:
        seg = ev._attach()
        for wid in range(WORKERS):
            workers[wid] = Child(ctx, pipelined_load_worker, (ev, wid, wid))
        for ch in workers.values():
            ch.wait_for("ready", START_TIMEOUT)
        next_wid = WORKERS
        while killed < KILLS:
            time.sleep(rng.random() * 0.05)
            wid = rng.choice(sorted(workers))
            victim = workers.pop(wid)
            victim.kill()  # with submissions in flight: it never stops submitting
            killed += 1
            workers[next_wid] = Child(ctx, pipelined_load_worker, (ev, next_wid, next_wid))
            workers[next_wid].wait_for("ready", START_TIMEOUT)
            next_wid += 1
        for ch in workers.values():
            ch.conn.send("stop")
        reports = [ch.wait_for("done", START_TIMEOUT) for ch in workers.values()]
        for ch in workers.values():
            ch.p.join(NO_HANG)
        errors = [r for r in reports if r[7] or r[3] or not r[6]]
        assert not errors, f"(done, wid, verified, bad, first bad, dropped, slots back, " \
                           f"error): {errors[:3]}"
        assert sum(r[2] for r in reports) > 0 and sum(r[5] for r in reports) > 0
        registered = WORKERS + KILLS
        wait_until(lambda: ev.stats()["reclaimed_clients"] == registered, NO_HANG,
                   "every dead or departed entry to be reclaimed")
        s = ev.stats()
        assert s["stale_completions"] == 0 and s["failed_requests"] == 0, s
        K = seg.params["slots_per_client"]
        stuck = [(c, k, seg.slot_state(c, k)) for c in range(MAX_CLIENTS) for k in range(K)
                 if seg.slot_state(c, k)[0] != FREE]
        assert not stuck, f"slots not FREE after every client left: {stuck}"
        print(f"\n{KILLS} workers killed with submissions in flight; survivors verified "
              f"{sum(r[2] for r in reports)} answers, dropped {sum(r[5] for r in reports)} "
              f"submissions; requests served {s['requests']}, "
              f"reclaimed_clients {s['reclaimed_clients']}")
    finally:
        for ch in workers.values():
            ch.kill()
        ev.close()


# ---------------------------------------------------------------- dead / closed evaluator

def _stranded(ev: Any, stop: Callable[[], None], expected: set[str], after: str) -> None:
    """Two processes and this one wait (result, wait_any, evaluate_async) on
    submissions in flight; stop() ends the evaluator; every wait ends in
    one of `expected`, and a new submission raises `after`."""
    ctx: Any = mp.get_context("spawn")
    children = [Child(ctx, stranded_waiter, (ev, wid)) for wid in range(2)]
    local: list[str] = []
    here = threading.Thread(target=lambda: local.extend(_local_waits(ev)), daemon=True)
    try:
        for ch in children:
            ch.wait_for("ready", START_TIMEOUT)
        here.start()
        time.sleep(0.3)
        stop()
        here.join(NO_HANG * 3)
        assert not here.is_alive(), "a wait of this process hung"
        for ch in children:
            _, outcomes, hung, then = ch.wait_for("done", NO_HANG * 3)
            assert not any(hung), f"a thread of child {ch.p.pid} hung"
            assert len(outcomes) == 3 and set(outcomes) <= expected, outcomes
            assert then == after, then
        assert len(local) == 2 and set(local) <= expected, local
        try:
            ev.submit(tagged_states(9, 5, 1)).result()
            then = "answered"
        except shmeval.ShmevalError as e:
            then = type(e).__name__
        assert then == after, then
    finally:
        for ch in children:
            ch.kill()


def _local_waits(ev: Any) -> list[str]:
    out = []
    for wait in (lambda p: p.result(), lambda p: ev.wait_any([p]).result()):
        try:
            wait(ev.submit(tagged_states(9, 0, 1)))
            out.append("answered")
        except shmeval.ShmevalError as e:
            out.append(type(e).__name__)
    return out


@pytest.mark.timeout(180)
def test_dead_evaluator_with_submissions_in_flight() -> None:
    ev = shmeval.Evaluator.spawn(slow_forever_factory, **dict(KW, max_clients=8), restarts=0)
    try:
        _stranded(ev, lambda: os.kill(ev.pid, signal.SIGKILL), {"EvaluatorDied"},
                  "EvaluatorDied")
    finally:
        ev.close()


@pytest.mark.timeout(180)
def test_closed_evaluator_with_submissions_in_flight() -> None:
    """The batch in the model when close() comes is answered; the rest raise
    EvaluatorClosed."""
    ev = shmeval.Evaluator.spawn(functools.partial(slow_fake_factory, 0.5),
                                 **dict(KW, max_clients=8))
    try:
        _stranded(ev, ev.close, {"answered", "EvaluatorClosed"}, "EvaluatorClosed")
    finally:
        ev.close()
