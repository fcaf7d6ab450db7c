"""Reliability: killed and stopped clients, a killed evaluator, closing under load.

- test_killed_workers: 16 worker processes under full load; a killer thread
  SIGKILLs a random one at random moments and starts a replacement, 200
  times, and a few "victim" processes are killed while they hold slots in
  WRITING.  Every surviving worker's answers are its own and correct, the
  evaluator never stalls for a second, every dead entry is reclaimed (the
  client table, a little larger than 16, never fills and returns to its
  starting count) and the WRITING slots come back.  Thread and spawned
  evaluators.
- test_stopped_worker: a SIGSTOPped worker (with requests in flight) slows
  nobody else down and finishes normally after SIGCONT.
- test_killed_evaluator_wakes_every_waiter: SIGKILL of a spawned evaluator
  makes every waiting client (processes and threads, slots in flight or
  waiting for a slot) raise EvaluatorDied within 1 s; close() removes the
  segment, and a new evaluator starts at once under the same name.
- test_close_under_load: close() while 16 processes and 4 threads have
  requests in flight: each completes correctly or raises EvaluatorClosed,
  nobody hangs.

test_lifecycle.py covers the single-client versions of these (one waiting
thread on a killed evaluator, close with a few waiters, the table filling
when max_clients is reached).

Replacement workers are started from a ``forkserver`` whose server process
has already imported NumPy, shmeval and the child bodies
(reliability_children.py): a replacement is then
one fork() of a small single-threaded process (a few ms), not an interpreter
start-up (~0.3 s of CPU each, 200 of them would be a minute of CPU on two
cores).  Forking the test process itself would be as cheap, but it runs the
evaluator thread, the sampler and the killer, and fork() copies whatever
locks those threads hold at that moment.  The first 16 workers of
test_killed_workers are spawned; the other tests take their client processes
from the fork server too (same pickled handle, a fresh client entry each).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import threading
import time
from typing import Any, Callable, Optional

import numpy as np
import pytest

import shmeval
from helpers import INPUT_SHAPE, OUTPUTS, check_answer, fake_factory, make_state
from reliability_children import (close_worker, count_bad, death_waiter, load_worker, noop,
                                  slow_forever_factory, tagged_states, until_closed,
                                  wait_for_answer, writing_victim)

SHM_DIR = "/dev/shm"
WORKERS = 16
KILLS = 200
VICTIMS = 5              # killed while holding slots in WRITING
VICTIM_SLOTS = 2         # slots each victim leaves in WRITING
SLOTS = 8                # per client; evaluate_many of up to 20 needs rounds
MAX_CLIENTS = WORKERS + 8  # a leak of a few of the 200+ dead entries would fill it
STALL_LIMIT = 1.0        # seconds without a served request
START_TIMEOUT = 90.0     # 16 spawn children need a few s on a loaded 2-core box
NO_HANG = 10.0
KILL_JOIN = 30.0         # a SIGKILLed child is reaped within this (generous: a loaded box)

FREE, WRITING, READY, TAKEN = 0, 1, 2, 3


# ---------------------------------------------------------------- test-side helpers

def forkserver_ctx() -> Any:
    """The forkserver context, its server started with NumPy, shmeval and the
    child bodies imported, so that a child only forks (~6 ms of CPU here,
    against ~140 ms when it has to import them itself).

    Python 3.11's fork server ignores the parent's sys.path, so this
    directory goes on its PYTHONPATH while it starts.  If an earlier test
    already started the fork server without these modules, children still
    work, each importing them (slower, not wrong)."""
    from multiprocessing import forkserver

    ctx: Any = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "shmeval", "helpers", "reliability_children"])
    here = os.path.dirname(os.path.abspath(__file__))
    old = os.environ.get("PYTHONPATH")
    # reliability_children lives here, helpers one folder up.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [here, os.path.dirname(here)] + ([old] if old else []))
    try:
        forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return ctx


class Child:
    """A child process with a duplex pipe; messages it sent are kept."""

    def __init__(self, ctx: Any, target: Callable[..., None], args: tuple[Any, ...],
                 wid: int) -> None:
        self.conn, theirs = ctx.Pipe()
        self.p = ctx.Process(target=target, args=args + (theirs,), daemon=True)
        self.p.start()
        theirs.close()
        self.wid = wid
        self.t_start = time.monotonic()
        self.ready = False
        self.done: Optional[tuple[Any, ...]] = None
        self.client_index = -1

    def pump(self, timeout: float = 0.0) -> None:
        """Reads the messages that arrived (waits up to timeout for one)."""
        try:
            while self.conn.poll(timeout):
                timeout = 0.0
                m = self.conn.recv()
                if m[0] == "ready":
                    self.ready = True
                    self.client_index = m[3]
                elif m[0] == "done":
                    self.done = m
        except (EOFError, OSError):
            pass

    def kill(self) -> None:
        if self.p.is_alive():
            os.kill(self.p.pid, signal.SIGKILL)
        self.p.join(NO_HANG)
        self.conn.close()


def wait_ready(children: list[Child], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for ch in children:
        while not ch.ready and ch.done is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"worker {ch.wid} did not start within {timeout} s")
            ch.pump(min(left, 0.1))
        assert ch.done is None, f"worker {ch.wid} stopped at once: {ch.done}"


def stop_and_collect(children: list[Child], timeout: float) -> dict[int, tuple[Any, ...]]:
    """Tells every child to stop; returns their "done" reports by worker id."""
    for ch in children:
        try:
            ch.conn.send("stop")
        except OSError:
            pass
    deadline = time.monotonic() + timeout
    for ch in children:
        while ch.done is None and time.monotonic() < deadline:
            ch.pump(0.1)
            if ch.done is None and not ch.p.is_alive():
                ch.pump(0.1)
                break
    for ch in children:
        ch.p.join(max(0.1, deadline - time.monotonic()))
    hung = [ch.wid for ch in children if ch.done is None or ch.p.is_alive()]
    assert not hung, f"workers {hung} did not stop and report within {timeout} s"
    assert all(ch.p.exitcode == 0 for ch in children), [ch.p.exitcode for ch in children]
    return {ch.wid: ch.done for ch in children if ch.done is not None}


def kill_all(children: list[Child]) -> None:
    for ch in children:
        if ch.p.pid is not None and ch.p.is_alive():
            ch.p.kill()
    for ch in children:
        if ch.p.pid is not None:
            ch.p.join(NO_HANG)


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return data[data.rfind(b")") + 2:].split()[0].decode()


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> float:
    """Waits until cond(); returns how long it took."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)
    return time.monotonic() - t0


def slots_in(seg: Any, states: tuple[int, ...]) -> int:
    """Slots of every claimed client entry that are in one of states."""
    K = seg.params["slots_per_client"]
    return sum(seg.slot_state(c, k)[0] in states
               for c, _pid, _st, _ns, _det in seg.clients() for k in range(K))


class StallSampler(threading.Thread):
    """Reads ev.stats() every ~20 ms; max_stall is the longest time a sample
    saw "requests" unchanged since the last sample that saw it move (time
    confirmed without progress: when the sampler itself is held up and then
    sees progress, the gap is not counted, it may have been its own delay).
    max_gap is the sampler's longest gap between two samples."""

    def __init__(self, ev: Any, period: float = 0.02) -> None:
        super().__init__(name="stall-sampler", daemon=True)
        self.ev = ev
        self.period = period
        self.halt = threading.Event()
        self.max_stall = 0.0
        self.max_gap = 0.0
        self.max_clients = 0
        self.samples = 0
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            last = self.ev.stats()["requests"]
            t_last = t_prev = time.monotonic()
            while not self.halt.wait(self.period):
                s = self.ev.stats()
                now = time.monotonic()
                self.samples += 1
                self.max_gap = max(self.max_gap, now - t_prev)
                t_prev = now
                self.max_clients = max(self.max_clients, s["clients"])
                if s["requests"] != last:
                    last, t_last = s["requests"], now
                elif now - t_last > self.max_stall:
                    self.max_stall = now - t_last
        except BaseException as e:  # noqa: BLE001
            self.error = e

    def stop(self) -> None:
        self.halt.set()
        self.join(NO_HANG)
        assert not self.is_alive() and self.error is None, self.error


def make_evaluator(kind: str, factory: Callable[[], Any] = fake_factory, **kw: Any) -> Any:
    args: dict[str, Any] = dict(input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=64,
                                slots_per_client=SLOTS)
    args.update(kw)
    if kind == "thread":
        return shmeval.Evaluator(factory(), **args)
    if kind == "serving_threads":
        return shmeval.Evaluator.spawn(factory, serving_threads=3, **args)
    return shmeval.Evaluator.spawn(factory, **args)


def check_reports(reports: dict[int, tuple[Any, ...]]) -> int:
    """Every load_worker report: no error, no wrong answer.  Returns rows sent."""
    errors = {w: r[6] for w, r in reports.items() if r[6]}
    assert not errors, f"workers raised: {errors}"
    bad = {w: (r[4], r[5]) for w, r in reports.items() if r[4]}
    assert not bad, f"wrong answers (cross-talk or corruption): {bad}"
    for w, (_, _, sent, verified, _, _, _) in reports.items():
        assert sent == verified > 0, (w, sent, verified)
    return sum(r[2] for r in reports.values())


# ================================================================ 1. killed workers

class Killer(threading.Thread):
    """Kills a random ready worker every 5-60 ms and starts a replacement from
    the fork server, KILLS times; every KILLS // VICTIMS kills it also starts a
    writing_victim and kills it while its slots are in WRITING, then checks
    that its entry and slots are reclaimed.

    Before each kill it waits until at most one replacement is still
    starting: the load stays at 15-16 busy workers, so a stall of the
    served requests is the evaluator's, not a lack of clients (on two busy
    cores a fork-server child takes a few tens of ms to its first answer).
    And when the table is nearly full of entries not reclaimed yet, it
    gives housekeeping up to 2 s before the next kill (see loop)."""

    def __init__(self, ev: Any, workers: dict[int, Child], ctx: Any, seed: int) -> None:
        super().__init__(name="killer", daemon=True)
        self.ev, self.workers, self.ctx = ev, workers, ctx
        self.rng = random.Random(seed)
        self.kills = 0
        self.paused = 0
        self.victims: list[dict[str, Any]] = []
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self.loop()
        except BaseException as e:  # noqa: BLE001
            self.error = e

    def loop(self) -> None:
        next_wid = max(self.workers) + 1
        while self.kills < KILLS:
            time.sleep(self.rng.uniform(0.005, 0.06))
            for w in list(self.workers.values()):
                w.pump()
                if w.done is not None:      # it stopped by itself: an error
                    raise AssertionError(f"worker {w.wid} stopped during the run: {w.done}")
            ready = [w for w in self.workers.values() if w.ready]
            if len(ready) < WORKERS - 1:
                starting = [w for w in self.workers.values() if not w.ready]
                assert time.monotonic() - min(w.t_start for w in starting) < START_TIMEOUT, (
                    f"replacements {[w.wid for w in starting]} never answered")
                continue
            if self.ev.stats()["clients"] > MAX_CLIENTS - 3:
                # Entries of the latest kills not reclaimed yet (housekeeping
                # runs every 200 ms): give it up to 2 s rather than fill the
                # table with entries about to be freed.  Leaked entries are
                # never freed: then the kills go on and the table fills.
                self.paused += 1
                deadline = time.monotonic() + 2.0
                while (self.ev.stats()["clients"] > MAX_CLIENTS - 3
                       and time.monotonic() < deadline):
                    time.sleep(0.005)
            w = self.rng.choice(ready)
            os.kill(w.p.pid, signal.SIGKILL)
            w.p.join(KILL_JOIN)
            if w.p.exitcode != -signal.SIGKILL:
                state = proc_state(w.p.pid) if os.path.exists(f"/proc/{w.p.pid}") else "gone"
                raise AssertionError(f"worker {w.wid} (pid {w.p.pid}) SIGKILLed {KILL_JOIN} s "
                                     f"ago: exit code {w.p.exitcode}, /proc state {state}")
            w.conn.close()
            del self.workers[w.wid]
            self.kills += 1
            self.workers[next_wid] = Child(self.ctx, load_worker,
                                           (self.ev, next_wid, next_wid, None), next_wid)
            next_wid += 1
            if self.kills % (KILLS // VICTIMS) == 0:
                self.victim()

    def victim(self) -> None:
        seg = self.ev._attach()
        v = Child(self.ctx, writing_victim, (self.ev.address, VICTIM_SLOTS), -1)
        try:
            assert v.conn.poll(START_TIMEOUT), "the writing victim did not start"
            msg = v.conn.recv()
            assert msg[0] == "writing", msg
            _, c, states = msg
            assert [s[0] for s in states] == [WRITING] * VICTIM_SLOTS, states
            assert (c, v.p.pid) in [(e[0], e[1]) for e in seg.clients()]
        finally:
            v.kill()
        t = wait_for(lambda: (c, v.p.pid) not in [(e[0], e[1]) for e in seg.clients()],
                     5.0, "the killed victim's entry to be reclaimed")
        # Its slots were reset to FREE with a new generation (a new owner may
        # have taken the entry since, so only the generation is checked).
        gens = [seg.slot_state(c, k)[2] for k in range(VICTIM_SLOTS)]
        assert all(g > s[2] for g, s in zip(gens, states)), (states, gens)
        self.victims.append({"entry": c, "reclaimed_after_s": t})


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["thread", "spawn"])
def test_killed_workers(kind: str) -> None:
    """16 workers under full load (evaluate and evaluate_many of 1-20 rows,
    every answer checked against its own tagged state); 200 SIGKILLs of random
    workers, each replaced, and 5 victims killed with 2 slots in WRITING.
    Asserts: the 16 survivors saw only their own correct answers and no error
    (ClientTableFull included: max_clients is 24); the served-request count
    never stood still for 1 s; reclaimed_clients equals every process that
    held an entry (16 + 200 + 5) and reclaimed_writing_slots counts at least
    the victims' 10; each victim's entry is reclaimed and its slots get a new
    generation; afterwards the client count is back to its start and every
    slot of the table is FREE; no stale completion, no failed request."""
    t_start = time.monotonic()
    ev = make_evaluator(kind, max_clients=MAX_CLIENTS)
    spawn: Any = mp.get_context("spawn")
    fs = forkserver_ctx()
    workers: dict[int, Child] = {}
    sampler = StallSampler(ev)
    killer: Optional[Killer] = None
    try:
        seg = ev._attach()
        baseline = ev.stats()["clients"]
        for wid in range(WORKERS):
            workers[wid] = Child(spawn, load_worker, (ev, wid, wid, None), wid)
        warm = fs.Process(target=noop)   # starts the fork server before the clock runs
        warm.start()
        warm.join(START_TIMEOUT)
        wait_ready(list(workers.values()), START_TIMEOUT)
        t_load = time.monotonic()
        t_setup = t_load - t_start
        sampler.start()
        killer = Killer(ev, workers, fs, seed=2024)
        killer.start()
        killer.join(100)
        assert not killer.is_alive(), f"the killer hung after {killer.kills} kills"
        assert killer.error is None, killer.error
        sampler.stop()
        t_kills = time.monotonic() - t_load
        t0 = time.monotonic()
        reports = stop_and_collect(list(workers.values()), 30)
        t_stop = time.monotonic() - t0
        assert len(reports) == WORKERS
        sent = check_reports(reports)

        # Every dead or departed entry is reclaimed: back to the starting count.
        registered = WORKERS + killer.kills + VICTIMS
        wait_for(lambda: ev.stats()["reclaimed_clients"] == registered, 5.0,
                 "every dead or departed entry to be reclaimed")
        s = ev.stats()
        assert s["clients"] == baseline, s
        assert s["reclaimed_clients"] == registered, (s["reclaimed_clients"], registered)
        assert s["reclaimed_writing_slots"] >= VICTIMS * VICTIM_SLOTS, s
        assert s["stale_completions"] == 0, s
        assert s["failed_requests"] == 0, s
        assert s["requests"] >= sent
        K = seg.params["slots_per_client"]
        stuck = [(c, k, seg.slot_state(c, k)) for c in range(MAX_CLIENTS) for k in range(K)
                 if seg.slot_state(c, k)[0] != FREE]
        assert not stuck, f"slots not FREE after every client left: {stuck}"
        assert sampler.max_clients < MAX_CLIENTS
        print(f"\n[{kind}] kills={killer.kills} victims={len(killer.victims)} "
              f"in {t_kills:.1f} s; max stall {sampler.max_stall * 1e3:.0f} ms "
              f"({sampler.samples} samples, longest gap {sampler.max_gap * 1e3:.0f} ms); "
              f"requests={s['requests']} (survivors sent {sent}); "
              f"reclaimed_clients={s['reclaimed_clients']} (registered {registered}); "
              f"reclaimed_writing_slots={s['reclaimed_writing_slots']} "
              f"(victims {VICTIMS * VICTIM_SLOTS}); max clients {sampler.max_clients}/"
              f"{MAX_CLIENTS}; victim entries reclaimed after "
              f"{max(v['reclaimed_after_s'] for v in killer.victims) * 1e3:.0f} ms max; "
              f"killer paused for reclaims {killer.paused}x; "
              f"set-up {t_setup:.1f} s, stop {t_stop:.1f} s, "
              f"total {time.monotonic() - t_start:.1f} s")
        assert sampler.max_stall < STALL_LIMIT, f"the evaluator stalled {sampler.max_stall:.2f} s"
    finally:
        if killer is not None and killer.is_alive():
            killer.kills = KILLS   # let it finish
            killer.join(NO_HANG)
        sampler.halt.set()
        kill_all(list(workers.values()))
        ev.close()


# ================================================================ 2. stopped worker

STOP_WORKERS = 6
WINDOW = 5.0


@pytest.mark.timeout(120)
def test_stopped_worker() -> None:
    """One of 6 workers is SIGSTOPped for 5 s while it has requests in flight.
    Each other worker's rate in those 5 s is compared with its rate in the 5 s
    before: it must stay above 30% of it.  Nothing in the protocol waits for
    another client (the evaluator takes what is READY and skips the rest; a
    stopped process's slots are just not READY, or answered and not read),
    and a stopped process uses no CPU, so the others should run as fast or
    faster; the 70% margin absorbs what other load on a shared 2-core machine
    can do to one 5 s window.  A stalled evaluator would take them to ~0."""
    fs = forkserver_ctx()
    ev = make_evaluator("thread", max_clients=STOP_WORKERS + 2)
    counters = fs.RawArray("q", STOP_WORKERS)
    workers = [Child(fs, load_worker, (ev, wid, wid, counters), wid)
               for wid in range(STOP_WORKERS)]
    sampler = StallSampler(ev)
    v = workers[-1]
    stopped = False
    try:
        seg = ev._attach()
        wait_ready(workers, START_TIMEOUT)
        sampler.start()
        time.sleep(1.0)                                     # steady state
        t0, c0 = time.monotonic(), list(counters)
        time.sleep(WINDOW)
        t1, c1 = time.monotonic(), list(counters)
        # Stop it with requests in flight (a slot not FREE); retry otherwise.
        K = seg.params["slots_per_client"]
        rng = random.Random(7)
        for attempt in range(200):
            os.kill(v.p.pid, signal.SIGSTOP)
            stopped = True
            wait_for(lambda: proc_state(v.p.pid) == "T", NO_HANG, "the worker to stop")
            in_flight = [seg.slot_state(v.client_index, k)[0] for k in range(K)]
            if any(st != FREE for st in in_flight):
                break
            os.kill(v.p.pid, signal.SIGCONT)
            stopped = False
            time.sleep(rng.uniform(0.001, 0.005))
        assert stopped, "never caught the worker with a request in flight"
        t2, c2 = time.monotonic(), list(counters)
        time.sleep(WINDOW)
        t3, c3 = time.monotonic(), list(counters)
        s = ev.stats()
        os.kill(v.p.pid, signal.SIGCONT)
        stopped = False
        # The stopped process was neither reclaimed nor counted as gone.
        assert s["clients"] == STOP_WORKERS and s["reclaimed_clients"] == 0, s
        assert c3[v.wid] == c2[v.wid], "the stopped worker made progress while stopped"
        wait_for(lambda: counters[v.wid] > c3[v.wid], NO_HANG,
                 "the continued worker to complete a request")
        sampler.stop()
        reports = stop_and_collect(workers, 30)
        check_reports(reports)
        before = [(c1[i] - c0[i]) / (t1 - t0) for i in range(STOP_WORKERS)]
        during = [(c3[i] - c2[i]) / (t3 - t2) for i in range(STOP_WORKERS)]
        states = "".join("FWRTDX"[min(st, 5)] for st in in_flight)
        print(f"\nstopped worker {v.wid} after {attempt + 1} tries, slots {states} "
              f"(F free, W writing, R ready, T taken, D done); rows/s before -> during "
              f"the stop: " + ", ".join(f"{b:.0f}->{d:.0f}" for b, d in
                                        zip(before[:-1], during[:-1]))
              + f"; stopped one {before[-1]:.0f}->{during[-1]:.0f}; "
              f"max stall {sampler.max_stall * 1e3:.0f} ms (longest sampling gap "
              f"{sampler.max_gap * 1e3:.0f} ms)")
        for i in range(STOP_WORKERS - 1):
            assert during[i] > 0.3 * before[i], (i, before, during)
        assert sampler.max_stall < STALL_LIMIT, f"the evaluator stalled {sampler.max_stall:.2f} s"
    finally:
        if stopped:
            os.kill(v.p.pid, signal.SIGCONT)
        sampler.halt.set()
        kill_all(workers)
        ev.close()


# ================================================================ 3. killed evaluator

DEATH_PROCS = 4


@pytest.mark.timeout(120)
def test_killed_evaluator_wakes_every_waiter() -> None:
    """4 processes (2 waiting threads each) and 5 threads of this process
    (4 with requests in flight, 1 waiting for a free slot) wait on a model
    that sleeps 30 s; SIGKILL of the evaluator process makes each raise
    EvaluatorDied within 1 s (clients check liveness at each tick of their
    process's ticker, every 100 ms: their sleeps have no timer of their
    own, so a ticker that fails to wake them makes this test hang)."""
    fs = forkserver_ctx()
    ev = make_evaluator("spawn", slow_forever_factory, restarts=0, max_batch=8, max_clients=8,
                        slots_per_client=8)
    address = ev.address
    procs = [Child(fs, death_waiter, (ev, wid), wid) for wid in range(DEATH_PROCS)]
    local: list[tuple[str, float]] = []
    threads = [threading.Thread(target=lambda i=i: local.append(
        wait_for_answer(ev, 100 + i, 0, i % 2 == 1)), daemon=True) for i in range(4)]
    try:
        seg = ev._attach()
        for th in threads:
            th.start()
        # Every request is posted: one batch is in the model, the rest READY.
        expected = DEATH_PROCS * (1 + 3) + 2 * 1 + 2 * 3
        wait_for(lambda: slots_in(seg, (READY, TAKEN)) == expected and slots_in(seg, (TAKEN,)) > 0,
                 START_TIMEOUT, f"{expected} requests in flight")
        # This process's 8 slots are all in flight: one more thread waits for one.
        extra = threading.Thread(target=lambda: local.append(
            wait_for_answer(ev, 200, 0, False)), daemon=True)
        extra.start()
        threads.append(extra)
        wait_for(lambda: ev._port is not None and ev._port.waiters == 1, NO_HANG,
                 "the fifth thread to wait for a slot")
        os.kill(ev.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        for th in threads:
            th.join(max(0.1, t_kill + NO_HANG - time.monotonic()))
        assert not any(th.is_alive() for th in threads), "a thread hung on the dead evaluator"
        remote: list[tuple[str, float]] = []
        for ch in procs:
            assert ch.conn.poll(max(0.1, t_kill + NO_HANG - time.monotonic())), \
                f"client process {ch.wid} hung on the dead evaluator"
            kind, results, hung = ch.conn.recv()
            assert not any(hung), f"a thread of client process {ch.wid} hung"
            remote += results
        outcomes = local + remote
        assert len(outcomes) == 5 + 2 * DEATH_PROCS
        assert all(what == "EvaluatorDied" for what, _ in outcomes), outcomes
        delays = [t - t_kill for _, t in outcomes]
        print(f"\nEvaluatorDied in {len(outcomes)} waiters ({DEATH_PROCS} processes x 2 "
              f"threads, 5 threads here): max {max(delays) * 1e3:.0f} ms, "
              f"mean {np.mean(delays) * 1e3:.0f} ms after the SIGKILL")
        assert max(delays) < 1.0, delays
    finally:
        t0 = time.monotonic()
        ev.close()
        close_s = time.monotonic() - t0
        kill_all(procs)
    assert close_s < NO_HANG
    assert not os.path.exists(SHM_DIR + address), "close() left the segment of a dead evaluator"
    assert not [e for e in os.listdir(SHM_DIR) if address.lstrip("/") in e]
    # A new evaluator starts at once under the same name and serves.
    t0 = time.monotonic()
    with make_evaluator("spawn", name=address, max_clients=4) as ev2:
        start_s = time.monotonic() - t0
        assert ev2.address == address
        check_answer(ev2.evaluate(make_state(5)), 5)
        out = ev2.evaluate_many(tagged_states(9, 0, 20))
        assert count_bad(9, 0, out["policy"], out["value"])[0] == 0
    print(f"close() of the dead evaluator {close_s * 1e3:.0f} ms; a new one served "
          f"{start_s:.1f} s after starting")


# ================================================================ 4. closing under load

CLOSE_THREADS = 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["thread", "spawn", "serving_threads"])
def test_close_under_load(kind: str) -> None:
    """close() while 16 processes and 4 threads of the owner have requests
    in flight: every request completes correctly or raises EvaluatorClosed,
    and a request after that raises EvaluatorClosed; nobody hangs."""
    fs = forkserver_ctx()
    ev = make_evaluator(kind, max_clients=WORKERS + 2)
    address = ev.address
    workers = [Child(fs, close_worker, (ev, wid, wid), wid) for wid in range(WORKERS)]
    local: list[tuple[Any, ...]] = []
    ready = threading.Semaphore(0)
    threads = [threading.Thread(target=until_closed, daemon=True,
                                args=(ev, 100 + i, 100 + i, local.append, ready.release))
               for i in range(CLOSE_THREADS)]
    try:
        wait_ready(workers, START_TIMEOUT)
        for th in threads:
            th.start()
        for _ in threads:
            assert ready.acquire(timeout=NO_HANG)
        time.sleep(0.5)
        in_flight = slots_in(ev._attach(), (WRITING, READY, TAKEN))
        t_close = time.monotonic()
        ev.close()
        close_s = time.monotonic() - t_close
        deadline = t_close + NO_HANG
        for th in threads:
            th.join(max(0.1, deadline - time.monotonic()))
        assert not any(th.is_alive() for th in threads), "an owner thread hung through close()"
        for ch in workers:
            while ch.done is None and time.monotonic() < deadline:
                ch.pump(0.1)
            ch.p.join(max(0.1, deadline - time.monotonic()))
        hung = [ch.wid for ch in workers if ch.done is None or ch.p.is_alive()]
        assert not hung, f"workers {hung} did not finish within {NO_HANG} s of close()"
        assert all(ch.p.exitcode == 0 for ch in workers)
        reports = [ch.done for ch in workers if ch.done is not None] + local
        assert len(reports) == WORKERS + CLOSE_THREADS
        for (_, wid, completed, bad, first_bad, recent, t_raise, second, error) in reports:
            assert not error, (wid, error)
            assert bad == 0, (wid, first_bad)
            assert completed > 0 and t_raise is not None, (wid, completed)
            assert second == "EvaluatorClosed", (wid, second)
        after = sum(sum(t > t_close for t in r[5]) for r in reports)
        raise_s = max(r[6] for r in reports) - t_close
        print(f"\n[{kind}] close() took {close_s * 1e3:.0f} ms with {in_flight} slots in flight "
              f"just before; {sum(r[2] for r in reports)} rows answered in all, {after} "
              f"requests completed after close() was called, {len(reports)} raised "
              f"EvaluatorClosed (the last {raise_s * 1e3:.0f} ms after close())")
    finally:
        ev.close()
        kill_all(workers)
    assert not os.path.exists(SHM_DIR + address)
