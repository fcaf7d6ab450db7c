"""Lifecycle: close, death, attach, pickling, stats, batching policy.

- close() is idempotent, wakes waiters (they complete or raise
  EvaluatorClosed, never hang) and removes the segment;
- a killed evaluator process makes waiting clients raise EvaluatorDied;
- Evaluator.spawn reports factory failures without leaking;
- an Evaluator pickles into spawn and fork children, and
  shmeval.connect(address) works from an unrelated process;
- attaching to anything that is not a healthy shmeval segment raises
  SegmentError, never crashes;
- stats() and the batching policy (max_wait_us, max_batch, buckets).
"""
from __future__ import annotations

import json
import mmap
import multiprocessing as mp
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

import numpy as np
import posix_ipc
import pytest

import shmeval
from shmeval import segment
from shmeval.spec import Spec
from helpers import (INPUT_SHAPE, OUTPUTS, check_answer, expected, fake_factory, fake_model,
                     make_ev, make_state, own_segments, run_threads, settled_stats)

SHM_DIR = "/dev/shm"
NO_HANG = 5.0          # generous bound for "raises instead of hanging"
CHILD_TIMEOUT = 60.0   # a spawn child needs ~1 s to start on a loaded 2-core box

# Byte offsets in the segment header (ring.h: shm_header).
OFF_MAGIC, OFF_VERSION, OFF_SPEC_LEN, OFF_SPEC_HASH, OFF_TOTAL = 0, 8, 12, 16, 24
OFF_IN_BYTES, OFF_OUT_BYTES, OFF_MAX_CLIENTS, OFF_SLOTS, OFF_MAX_BATCH = 32, 40, 48, 52, 56
OFF_OWNER_PID, OFF_PID_NS, OFF_TIME_NS, OFF_OWNER_START, OFF_SPEC = 72, 80, 88, 96, 104


# ---------------------------------------------------------------- helpers

def check_many(out: dict[str, np.ndarray], tags: list[int]) -> None:
    t = np.array(tags, np.float32)
    np.testing.assert_array_equal(out["policy"], 2 * t[:, None] + np.arange(7, dtype=np.float32))
    np.testing.assert_array_equal(out["value"], -t)


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def seg_path(address: str) -> str:
    return SHM_DIR + address


def unique_name(tag: str) -> str:
    return f"/shmeval-{os.getpid()}-{tag}{os.urandom(6).hex()}"


class SlowModel:
    """fake_model after a sleep; `entered` is set when a batch is in the model."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.entered = threading.Event()
        self.calls = 0

    def __call__(self, x: np.ndarray) -> Any:
        self.calls += 1
        self.entered.set()
        time.sleep(self.seconds)
        return fake_model(x)


class Recorder:
    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, x: np.ndarray) -> Any:
        with self.lock:
            self.sizes.append(int(x.shape[0]))
        return fake_model(x)


def run_child(target: Callable[..., None], args: tuple[Any, ...], ctx_name: str = "spawn",
              timeout: float = CHILD_TIMEOUT) -> list[Any]:
    """Runs target(*args, conn) in a child process; returns every message it
    sent.  The child is killed if it does not finish in time."""
    ctx: Any = mp.get_context(ctx_name)
    receiver, sender = ctx.Pipe(duplex=False)
    p = ctx.Process(target=target, args=args + (sender,))
    p.start()
    sender.close()
    msgs: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"child {target.__name__} hung; messages so far: {msgs}")
            if receiver.poll(min(left, 0.1)):
                try:
                    msgs.append(receiver.recv())
                except EOFError:
                    break
            elif not p.is_alive() and not receiver.poll(0):
                break
    finally:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
        receiver.close()
    assert p.exitcode == 0, (p.exitcode, msgs)
    return msgs


# ---------------------------------------------------------------- child bodies
# (module level, so that spawn children can import them)

def child_use_handle(ev: Any, base: int, conn: Any) -> None:
    ok = True
    for t in range(base, base + 10):
        out = ev.evaluate(make_state(t))
        ok &= bool(float(out["value"]) == -t)
    tags = list(range(base + 100, base + 130))
    many = ev.evaluate_many(np.stack([make_state(t) for t in tags]))
    ok &= bool((many["value"] == -np.array(tags, np.float32)).all())
    s = ev.stats()
    conn.send((ok, s["requests"], s["clients"], type(ev).__name__, os.getpid()))
    conn.close()


def child_wait_through_close(ev: Any, tag: int, conn: Any) -> None:
    def attempt() -> tuple[str, Any]:
        try:
            return "ok", float(ev.evaluate(make_state(tag))["value"])
        except shmeval.ShmevalError as e:
            return type(e).__name__, str(e)
    conn.send(attempt())
    conn.send(attempt())
    conn.close()


def slow_model_3s(x: np.ndarray) -> Any:
    time.sleep(3.0)
    return fake_model(x)


def slow_factory() -> Callable[[np.ndarray], Any]:
    return slow_model_3s


def raising_factory() -> Any:
    raise RuntimeError("no accelerator here (code 42)")


def non_callable_factory() -> Any:
    return 12345


def hanging_factory() -> Any:
    time.sleep(60)


def child_owner_of_spawned_evaluator(conn: Any) -> None:
    """Creates an Evaluator.spawn, reports its address and pid, then waits
    to be killed (it never closes it)."""
    ev = shmeval.Evaluator.spawn(fake_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                 max_clients=4, slots_per_client=4, max_batch=8)
    conn.send((ev.address, ev.pid))
    time.sleep(120)


def child_corrupt_headers(seed: int, conn: Any) -> None:
    """XORs each header byte in turn with a random non-zero value and attaches:
    only SegmentError may come out (or success, for the bytes the header
    does not validate).  Runs in a child so that a crash is a failed test,
    not a dead test session."""
    spec = Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 32, 4, 4)
    seg, name = segment.create(spec)
    rng = random.Random(seed)
    accepted: list[int] = []
    wrong: list[str] = []
    try:
        shm = posix_ipc.SharedMemory(name)
        m = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        end = OFF_SPEC + len(spec.to_json())
        for off in list(range(end)) + [end + 10, 5000, 6000]:
            old = m[off]
            m[off] = old ^ rng.randrange(1, 256)
            try:
                shmeval.connect(name)
                accepted.append(off)
            except shmeval.SegmentError:
                pass
            except BaseException as e:  # noqa: BLE001
                wrong.append(f"offset {off}: {type(e).__name__}: {e}")
            m[off] = old
        shmeval.connect(name)    # intact again
        m.close()
    finally:
        segment.unlink(name)
    conn.send((accepted, wrong))
    conn.close()


# ================================================================ close

@pytest.mark.timeout(30)
def test_close_idempotent_and_removes_segment() -> None:
    ev = make_ev()
    check_answer(ev.evaluate(make_state(1)), 1)
    assert os.path.exists(seg_path(ev.address))
    ev.close()
    assert not os.path.exists(seg_path(ev.address))
    ev.close()
    ev.close(timeout=0.1)
    calls: list[Callable[[], Any]] = [lambda: ev.evaluate(make_state(2)),
                                      lambda: ev.evaluate_many(np.stack([make_state(2)] * 3))]
    for call in calls:
        t0 = time.monotonic()
        with pytest.raises(shmeval.EvaluatorClosed):
            call()
        assert time.monotonic() - t0 < NO_HANG
    assert ev.stats()["state"] == "closed"
    assert issubclass(shmeval.EvaluatorClosed, shmeval.ShmevalError)


@pytest.mark.timeout(30)
def test_close_before_any_request() -> None:
    ev = make_ev()
    ev.close()
    assert not os.path.exists(seg_path(ev.address))
    with pytest.raises(shmeval.EvaluatorClosed):
        ev.evaluate(make_state(1))


@pytest.mark.timeout(30)
def test_context_manager_closes() -> None:
    with make_ev() as ev:
        check_answer(ev.evaluate(make_state(3)), 3)
        path = seg_path(ev.address)
        assert os.path.exists(path)
    assert not os.path.exists(path)
    with pytest.raises(shmeval.EvaluatorClosed):
        ev.evaluate(make_state(3))
    # Also when the body raises.
    with pytest.raises(KeyError):
        with make_ev() as ev2:
            path2 = seg_path(ev2.address)
            raise KeyError("body failed")
    assert not os.path.exists(path2)


@pytest.mark.timeout(30)
def test_close_while_threads_wait_on_slow_model() -> None:
    model = SlowModel(0.5)
    ev = make_ev(model)
    outcomes: list[Any] = []
    lock = threading.Lock()

    def run(tag: int) -> None:
        try:
            out = ev.evaluate(make_state(tag))
            r: Any = ("ok", tag, float(out["value"]))
        except shmeval.EvaluatorClosed:
            r = ("closed", tag, None)
        except BaseException as e:  # noqa: BLE001
            r = (f"{type(e).__name__}: {e}", tag, None)
        with lock:
            outcomes.append(r)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(1, 5)]
    for th in threads:
        th.start()
    assert model.entered.wait(10)
    # Every request posted (READY or TAKEN) before closing: a thread still on
    # its way to a slot meets the bug of test_close_while_a_thread_waits_for_a_free_slot.
    seg = ev._attach()
    wait_for(lambda: sum(seg.slot_state(ev._c, k)[0] in (2, 3) for k in range(8)) == 4,
             NO_HANG, "all four requests to be posted")
    t0 = time.monotonic()
    ev.close()
    for th in threads:
        th.join(max(0.1, t0 + NO_HANG - time.monotonic()))
    assert not any(th.is_alive() for th in threads), "a waiter hung through close()"
    assert time.monotonic() - t0 < NO_HANG
    assert len(outcomes) == 4
    for kind, tag, value in outcomes:
        assert kind in ("ok", "closed"), kind
        if kind == "ok":
            assert value == -tag
    assert not os.path.exists(seg_path(ev.address))


@pytest.mark.timeout(90)
def test_close_while_another_process_waits() -> None:
    model = SlowModel(0.5)
    ev = make_ev(model)
    ctx: Any = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    p = ctx.Process(target=child_wait_through_close, args=(ev, 21, sender))
    p.start()
    sender.close()
    try:
        assert model.entered.wait(CHILD_TIMEOUT), "the child's request never reached the model"
        ev.close()
        t_closed = time.monotonic()
        assert receiver.poll(NO_HANG), "the waiting client hung through close()"
        first = receiver.recv()
        assert first in (("ok", -21.0),) or first[0] == "EvaluatorClosed", first
        # Its next request is refused at once.
        assert receiver.poll(NO_HANG)
        second = receiver.recv()
        assert second[0] == "EvaluatorClosed", second
        assert time.monotonic() - t_closed < 2 * NO_HANG
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
        receiver.close()
    assert p.exitcode == 0


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_serving_thread_death_is_reported() -> None:
    """A model that raises SystemExit kills the serving thread: the request in
    flight raises a ShmevalError, later ones raise EvaluatorDied; close()
    still removes the segment."""
    def model(x: np.ndarray) -> Any:
        if (x[:, 0, 0, 0] == 99).any():
            raise SystemExit("model pulled the plug")
        return fake_model(x)

    ev = make_ev(model)
    try:
        check_answer(ev.evaluate(make_state(1)), 1)
        t0 = time.monotonic()
        with pytest.raises(shmeval.ShmevalError):
            ev.evaluate(make_state(99))
        with pytest.raises(shmeval.EvaluatorDied):
            ev.evaluate(make_state(2))
        assert time.monotonic() - t0 < NO_HANG
        assert ev.stats()["state"] == "died"
    finally:
        ev.close()
    assert not os.path.exists(seg_path(ev.address))


@pytest.mark.timeout(30)
def test_close_with_short_timeout_while_model_is_stuck() -> None:
    """close(timeout) does not wait for a model call that outlasts it: the
    waiting client is released with EvaluatorClosed and the segment removed."""
    model = SlowModel(3.0)
    ev = make_ev(model)
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(ev.evaluate(make_state(1)))
        except BaseException as e:  # noqa: BLE001
            result.append(e)

    th = threading.Thread(target=run)
    th.start()
    assert model.entered.wait(10)
    t0 = time.monotonic()
    ev.close(timeout=0.2)
    assert time.monotonic() - t0 < 2.0, "close(timeout=0.2) waited for the model (3 s)"
    th.join(NO_HANG)
    assert not th.is_alive()
    assert isinstance(result[0], shmeval.EvaluatorClosed), result
    assert not os.path.exists(seg_path(ev.address))


@pytest.mark.timeout(30)
def test_close_while_a_thread_waits_for_a_free_slot() -> None:
    """One slot: thread A's request is in the (slow) model, thread B waits for
    the slot.  close() must release both with EvaluatorClosed (or an answer)."""
    model = SlowModel(1.0)
    ev = make_ev(model, slots_per_client=1)
    results: dict[str, Any] = {}

    def run(name: str, tag: int) -> None:
        try:
            results[name] = float(ev.evaluate(make_state(tag))["value"])
        except BaseException as e:  # noqa: BLE001
            results[name] = e

    a = threading.Thread(target=run, args=("A", 1))
    a.start()
    assert model.entered.wait(10)
    b = threading.Thread(target=run, args=("B", 2))
    b.start()
    time.sleep(0.05)                 # B is registered and waits for the only slot
    ev.close(timeout=0.1)
    a.join(NO_HANG)
    b.join(NO_HANG)
    assert not a.is_alive() and not b.is_alive()
    for name, tag in (("A", 1), ("B", 2)):
        r = results[name]
        assert r == -tag or isinstance(r, shmeval.EvaluatorClosed), (name, repr(r))


def child_close_forked_copy(ev: Any, conn: Any) -> None:
    out = ev.evaluate(make_state(31))
    ev.close()                       # a forked copy: only detaches this process
    conn.send(float(out["value"]))
    conn.close()


@pytest.mark.timeout(60)
def test_close_in_forked_child_only_detaches() -> None:
    with make_ev() as ev:
        msgs = run_child(child_close_forked_copy, (ev,), "fork")
        assert msgs == [-31.0]
        assert os.path.exists(seg_path(ev.address))
        check_answer(ev.evaluate(make_state(32)), 32)
        assert ev.stats()["state"] == "serving"


@pytest.mark.timeout(30)
def test_garbage_collected_evaluator_removes_segment() -> None:
    import gc
    ev = make_ev()
    check_answer(ev.evaluate(make_state(1)), 1)
    path = seg_path(ev.address)
    thread = ev._thread
    del ev
    gc.collect()
    assert not os.path.exists(path)
    assert thread is not None
    thread.join(NO_HANG)
    assert not thread.is_alive()


EXIT_CODE = r"""
import sys
import numpy as np
import shmeval

def model(x):
    return {"v": x.sum(axis=1)}

def factory():
    return model

if __name__ == "__main__":
    kw = dict(input_shape=(3,), outputs={"v": ((), "float32")}, max_clients=4,
              slots_per_client=4, max_batch=8)
    if sys.argv[1] == "thread":
        ev = shmeval.Evaluator(model, **kw)
    else:
        sys.path.insert(0, ".")
        ev = shmeval.Evaluator.spawn(factory, **kw)
    assert float(ev.evaluate(np.ones(3))["v"]) == 3.0
    print(ev.address, ev.pid, flush=True)
    if sys.argv[2] == "kill":
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
    # "exit": leave without close()
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["thread", "spawn"])
def test_owner_exit_without_close_removes_segment(kind: str, tmp_path: Any) -> None:
    script = tmp_path / "owner.py"
    script.write_text(EXIT_CODE)
    r = subprocess.run([sys.executable, str(script), kind, "exit"], capture_output=True,
                       text=True, timeout=CHILD_TIMEOUT, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    address, pid = r.stdout.split()
    assert not os.path.exists(seg_path(address)), "segment left behind at interpreter exit"
    wait_for(lambda: not segment.is_alive(int(pid)), 10, "the evaluator process to exit")


@pytest.mark.timeout(60)
def test_killed_owner_leaves_a_stale_segment_that_cleanup_finds(tmp_path: Any) -> None:
    """SIGKILL of a process serving from a thread cannot unlink: the segment is
    stale, attributed to a dead pid, and cleanup_stale removes it."""
    script = tmp_path / "owner.py"
    script.write_text(EXIT_CODE)
    r = subprocess.run([sys.executable, str(script), "thread", "kill"], capture_output=True,
                       text=True, timeout=CHILD_TIMEOUT, cwd=str(tmp_path))
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr)
    address = r.stdout.split()[0]
    try:
        assert os.path.exists(seg_path(address))
        listed = {str(x["address"]): x for x in segment.list_segments()}
        assert address in listed and listed[address]["owner_alive"] is False
        assert address in segment.cleanup_stale(dry_run=True)
        assert os.path.exists(seg_path(address))           # dry run
        # A client of the dead owner's evaluator is told it is dead.
        c = shmeval.connect(address)
        t0 = time.monotonic()
        with pytest.raises(shmeval.EvaluatorDied, match="evaluator process .* is gone"):
            c.evaluate(np.ones(3, np.float32))
        assert time.monotonic() - t0 < NO_HANG
    finally:
        segment.unlink(address)        # only ours: other stale ones are not this test's


# ================================================================ death

@pytest.mark.timeout(90)
def test_killed_evaluator_process() -> None:
    """Without restarts (restarts=0: tests/stress/test_restarts.py has them)."""
    ev = shmeval.Evaluator.spawn(slow_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                 max_clients=4, slots_per_client=4, max_batch=8, restarts=0)
    address = ev.address
    result: list[Any] = []

    def client() -> None:
        try:
            result.append(ev.evaluate(make_state(1)))
        except BaseException as e:  # noqa: BLE001
            result.append(e)
        result.append(time.monotonic())

    other = shmeval.connect(address)
    check_answer(other.evaluate(make_state(6)), 6)
    try:
        assert ev.pid != os.getpid()
        th = threading.Thread(target=client)
        th.start()
        # Wait until the evaluator has taken the request (it is in the model).
        seg = ev._attach()
        wait_for(lambda: seg.raw_stats()["hist_wait"].sum() >= 1, 30, "the request to be taken")
        os.kill(ev.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        th.join(NO_HANG)
        assert not th.is_alive(), "the waiting client hung after the evaluator was killed"
        assert isinstance(result[0], shmeval.EvaluatorDied), result
        assert result[1] - t_kill < NO_HANG
        t0 = time.monotonic()
        with pytest.raises(shmeval.EvaluatorDied, match=rf"evaluator process {ev.pid} .* is gone"):
            ev.evaluate(make_state(2))
        assert time.monotonic() - t0 < NO_HANG
    finally:
        t0 = time.monotonic()
        ev.close()
        assert time.monotonic() - t0 < NO_HANG
    assert not os.path.exists(seg_path(address))
    # The close recorded how the process ended: a handle still mapped says so.
    with pytest.raises(shmeval.EvaluatorDied, match="its process was killed by signal 9"):
        other.evaluate(make_state(3))
    # A new evaluator can start at once, even under the same name.
    with make_ev(name=address) as ev2:
        check_answer(ev2.evaluate(make_state(5)), 5)


@pytest.mark.timeout(90)
def test_spawned_evaluator_outlives_no_owner() -> None:
    """The owner of an Evaluator.spawn is SIGKILLed: the evaluator process sees
    its creator gone, removes the segment itself and exits."""
    ctx: Any = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    owner = ctx.Process(target=child_owner_of_spawned_evaluator, args=(sender,))
    owner.start()
    sender.close()
    ev_pid = 0
    address = ""
    try:
        assert receiver.poll(CHILD_TIMEOUT), "the owner did not start its evaluator"
        address, ev_pid = receiver.recv()
        client = shmeval.connect(address)
        check_answer(client.evaluate(make_state(4)), 4)
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(10)
        wait_for(lambda: not os.path.exists(seg_path(address)), 10,
                 "the orphaned evaluator to remove its segment")
        wait_for(lambda: not segment.is_alive(ev_pid), 10, "the orphaned evaluator to exit")
        # A crash, not a shutdown: the workers are told their evaluator's
        # creator died.
        with pytest.raises(shmeval.EvaluatorDied,
                           match=rf"the process that created it \(pid {owner.pid}\) died"):
            client.evaluate(make_state(4))
    finally:
        if owner.is_alive():
            owner.kill()
            owner.join()
        if ev_pid and segment.is_alive(ev_pid):
            os.kill(ev_pid, signal.SIGKILL)
        if address:
            segment.unlink(address)
        receiver.close()


# ================================================================ spawn start-up

@pytest.mark.timeout(90)
@pytest.mark.parametrize("factory, words", [
    (raising_factory, ("RuntimeError", "no accelerator here (code 42)")),
    (non_callable_factory, ("int", "callable")),
])
def test_spawn_factory_failure(factory: Callable[[], Any], words: tuple[str, ...]) -> None:
    before = own_segments()
    t0 = time.monotonic()
    with pytest.raises(shmeval.ModelError) as ei:
        shmeval.Evaluator.spawn(factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                max_clients=4, slots_per_client=4, max_batch=8)
    assert time.monotonic() - t0 < CHILD_TIMEOUT
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))
    assert own_segments() == before


@pytest.mark.timeout(60)
def test_spawn_start_timeout_is_honoured() -> None:
    before = own_segments()
    t0 = time.monotonic()
    with pytest.raises(shmeval.EvaluatorDied, match="did not start"):
        shmeval.Evaluator.spawn(hanging_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                max_clients=4, slots_per_client=4, max_batch=8,
                                start_timeout=1.0)
    elapsed = time.monotonic() - t0
    assert own_segments() == before
    assert elapsed < 1.0 + 5.0, f"spawn(start_timeout=1) took {elapsed:.1f} s to give up"


@pytest.mark.timeout(60)
def test_spawn_unpicklable_factory() -> None:
    before = own_segments()
    err: Optional[BaseException] = None
    t0 = time.monotonic()
    try:
        ev = shmeval.Evaluator.spawn(lambda: fake_model, input_shape=INPUT_SHAPE,
                                     outputs=OUTPUTS, max_clients=4, slots_per_client=4,
                                     max_batch=8)
        ev.close()
    except BaseException as e:  # noqa: BLE001
        err = e
    left = sorted(own_segments() - before)
    for entry in left:
        os.unlink(os.path.join(SHM_DIR, entry))
    assert time.monotonic() - t0 < CHILD_TIMEOUT
    assert not left, f"leaked {left} ({err!r})"
    assert err is not None and not isinstance(err, AssertionError), repr(err)
    assert "pickle" in str(err).lower(), repr(err)


@pytest.mark.timeout(60)
def test_spawn_with_fork_context_takes_a_closure() -> None:
    offset = 0.0     # captured: the factory is a closure, not picklable

    def factory() -> Callable[[np.ndarray], Any]:
        return lambda x: {k: v + offset for k, v in fake_model(x).items()}

    with shmeval.Evaluator.spawn(factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                 max_clients=4, slots_per_client=4, max_batch=8,
                                 mp_context="fork") as ev:
        assert ev.pid != os.getpid()
        check_answer(ev.evaluate(make_state(2)), 2)
        assert ev.stats()["warmup_s"] >= 0
        # Its handle works in a (fork) child too, and the child sees the stats.
        msgs = run_child(child_use_handle, (ev, 2000), "fork")
        ok, requests, clients, kind, _ = msgs[0]
        assert ok and requests >= 11 and clients == 2
        pid = ev.pid
    wait_for(lambda: not segment.is_alive(pid), 10, "the evaluator process to exit")


# ================================================================ pickling / attach

@pytest.mark.timeout(90)
@pytest.mark.parametrize("ctx_name", ["spawn", "fork"])
def test_evaluator_pickles_into_child(ctx_name: str) -> None:
    with make_ev() as ev:
        check_answer(ev.evaluate(make_state(1)), 1)   # the owner holds entry 0
        msgs = run_child(child_use_handle, (ev, 1000), ctx_name)
        assert len(msgs) == 1
        ok, requests, clients, kind, pid = msgs[0]
        assert ok
        assert pid != os.getpid()
        assert 1 + 10 <= requests <= 1 + 10 + 30            # read in the child
        settled_stats(ev, "requests", 1 + 10 + 30)
        assert clients == 2                           # the owner and the child
        if ctx_name == "spawn":
            assert kind == "Client"                   # a light handle
        # The child is gone: it is not counted, and its entry is reclaimed
        # (detached or dead).
        assert ev.stats()["clients"] == 1
        wait_for(lambda: ev.stats()["reclaimed_clients"] >= 1, 5,
                 "the child's entry to be reclaimed")
        check_answer(ev.evaluate(make_state(2)), 2)


@pytest.mark.timeout(30)
def test_pickled_handle_is_light() -> None:
    with make_ev() as ev:
        data = pickle.dumps(ev)
        assert len(data) < 2000
        h = pickle.loads(data)
        assert isinstance(h, shmeval.Client) and not isinstance(h, shmeval.Evaluator)
        assert h.address == ev.address
        check_answer(h.evaluate(make_state(6)), 6)
        h.close()                                     # closes the handle only
        check_answer(ev.evaluate(make_state(7)), 7)
        check_answer(h.evaluate(make_state(8)), 8)   # usable again


@pytest.mark.timeout(30)
def test_address_is_short_str() -> None:
    with make_ev() as ev:
        a = ev.address
        assert isinstance(a, str)
        assert len(a) < 64
        assert a.startswith("/shmeval-") and f"-{os.getpid()}-" in a
        assert os.path.exists(seg_path(a))
        assert a in repr(ev)
        assert ev.pid == os.getpid()                  # a thread evaluator


CONNECT_CODE = r"""
import json, sys
import numpy as np
import shmeval
c = shmeval.connect(sys.argv[1])
out = []
for tag in (3, 4, 5):
    s = np.zeros((6, 7, 2), np.float32)
    s[0, :, 0] = tag
    s[5, 6, 1] = -tag
    r = c.evaluate(s)
    out.append([r["policy"].tolist(), float(r["value"])])
many = c.evaluate_many(np.zeros((20, 6, 7, 2)))
out.append([many["policy"].shape[0], float(many["value"].sum())])
out.append(sorted(c.spec.output_names))
print(json.dumps(out))
"""


@pytest.mark.timeout(90)
def test_connect_from_unrelated_process() -> None:
    with make_ev() as ev:
        # cwd="/": nothing of the test suite is importable there.
        r = subprocess.run([sys.executable, "-c", CONNECT_CODE, ev.address],
                           capture_output=True, text=True, timeout=CHILD_TIMEOUT, cwd="/")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout.strip().splitlines()[-1])
        for tag, (policy, value) in zip((3, 4, 5), out[:3]):
            assert policy == expected(tag)[0].tolist() and value == -tag
        assert out[3] == [20, 0.0]
        assert out[4] == ["policy", "value"]
        settled_stats(ev, "requests", 23)
        # Same process: connect() also takes the name without its slash.
        c = shmeval.connect(ev.address.lstrip("/"))
        check_answer(c.evaluate(make_state(9)), 9)


@pytest.mark.timeout(30)
def test_connect_to_missing_segment() -> None:
    name = unique_name("missing")
    with pytest.raises(shmeval.SegmentError) as ei:
        shmeval.connect(name)
    assert "not running" in str(ei.value) and name in str(ei.value)
    with make_ev() as ev:
        address = ev.address
    with pytest.raises(shmeval.SegmentError, match="not running"):
        shmeval.connect(address)                      # closed = gone
    with pytest.raises(shmeval.SegmentError):
        shmeval.connect("/shmeval-a/b")
    with pytest.raises(TypeError):
        shmeval.connect(1234)                         # type: ignore[arg-type]


def _foreign(kind: str) -> tuple[int, bytes]:
    rng = np.random.default_rng(7)
    if kind == "zeros":
        return 65536, b""
    if kind == "random":
        return 65536, rng.integers(0, 256, 65536, dtype=np.uint8).tobytes()
    if kind == "small-random":
        return 100, rng.integers(0, 256, 100, dtype=np.uint8).tobytes()
    if kind == "empty":
        return 0, b""
    if kind == "magic-only":
        return 65536, (0x314C4156454D4853).to_bytes(8, "little")
    if kind == "text":
        return 65536, b"Hello, this is not a header. " * 100
    if kind == "text-with-magic":
        return 65536, b"SHMEVAL1 happens to be the magic, in ASCII. " * 100
    raise AssertionError(kind)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind, words", [
    ("zeros", ("bad magic",)),
    ("random", ("bad magic",)),
    ("small-random", ("smaller",)),
    ("empty", ("smaller",)),
    ("magic-only", ("layout version",)),
    ("text", ("bad magic",)),
    ("text-with-magic", ("layout version",)),
])
def test_connect_to_foreign_segment(kind: str, words: tuple[str, ...]) -> None:
    size, content = _foreign(kind)
    name = unique_name("foreign")
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    try:
        if content:
            m = mmap.mmap(shm.fd, size)
            m[:len(content)] = content
            m.close()
        shm.close_fd()
        with pytest.raises(shmeval.SegmentError) as ei:
            shmeval.connect(name)
        for w in words:
            assert w in str(ei.value), (w, str(ei.value))
    finally:
        posix_ipc.unlink_shared_memory(name)


@pytest.mark.timeout(30)
def test_truncated_copy_of_a_valid_segment() -> None:
    spec = Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 32, 8, 8)
    seg, name = segment.create(spec)
    copy = unique_name("truncated")
    try:
        shm = posix_ipc.SharedMemory(name)
        with mmap.mmap(shm.fd, shm.size) as m:
            head = m[:seg.nbytes // 2]
        shm.close_fd()
        shm2 = posix_ipc.SharedMemory(copy, posix_ipc.O_CREX, mode=0o600, size=len(head))
        with mmap.mmap(shm2.fd, len(head)) as m2:
            m2[:] = head
        shm2.close_fd()
        with pytest.raises(shmeval.SegmentError, match="smaller"):
            shmeval.connect(copy)
    finally:
        segment.unlink(name)
        segment.unlink(copy)


@pytest.mark.timeout(30)
def test_layout_version_mismatch() -> None:
    with make_ev() as ev:
        shm = posix_ipc.SharedMemory(ev.address)
        m = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        try:
            old = int.from_bytes(m[OFF_VERSION:OFF_VERSION + 4], "little")
            assert old == shmeval._ring.LAYOUT_VERSION
            m[OFF_VERSION:OFF_VERSION + 4] = (old + 1).to_bytes(4, "little")
            with pytest.raises(shmeval.SegmentError) as ei:
                shmeval.connect(ev.address)
            assert "layout version" in str(ei.value)
            # A pickled handle attaching now fails the same way.
            h = pickle.loads(pickle.dumps(ev))
            with pytest.raises(shmeval.SegmentError, match="layout version"):
                h.evaluate(make_state(1))
            m[OFF_VERSION:OFF_VERSION + 4] = old.to_bytes(4, "little")
            check_answer(shmeval.connect(ev.address).evaluate(make_state(1)), 1)
        finally:
            m.close()


def _fnv1a(b: bytes) -> int:
    h = 1469598103934665603
    for c in b:
        h = ((h ^ c) * 1099511628211) & (2**64 - 1)
    return h


def _put(m: mmap.mmap, off: int, value: int, size: int) -> None:
    m[off:off + size] = value.to_bytes(size, "little")


def _set_spec(m: mmap.mmap, raw: bytes) -> None:
    """Writes a spec text with a matching length and checksum."""
    _put(m, OFF_SPEC_LEN, len(raw), 4)
    _put(m, OFF_SPEC_HASH, _fnv1a(raw), 8)
    m[OFF_SPEC:OFF_SPEC + len(raw)] = raw


def _spec_dict() -> dict[str, Any]:
    d: dict[str, Any] = json.loads(Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 32, 8, 8).to_json())
    return d


def _spec_with(**changes: Any) -> bytes:
    """The spec's JSON with changes: of the capacities, or of the one
    method's input_shape, input_dtype (its one input's) or outputs."""
    d = _spec_dict()
    (method,) = d["methods"]  # [name, named, [[input, shape, dtype]], [[output, shape, dtype]...]]
    (inp,) = method[2]
    for key, value in changes.items():
        if key == "input_shape":
            inp[1] = value
        elif key == "input_dtype":
            inp[2] = value
        elif key == "outputs":
            method[3] = value
        else:
            d[key] = value
    return json.dumps(d).encode()



def _grow_max_clients(m: mmap.mmap, n: int) -> None:
    """A consistent header for a larger segment than the one mapped."""
    from shmeval import _ring
    spec = Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 32, 8, 8)
    total = _ring.segment_size(spec.in_bytes, spec.out_bytes, n, 8, 32)
    _put(m, OFF_MAX_CLIENTS, n, 4)
    _put(m, OFF_TOTAL, total, 8)


CORRUPTIONS: list[Any] = [
    pytest.param(lambda m: m.__setitem__(OFF_MAGIC, m[OFF_MAGIC] ^ 0x40), "bad magic", id="magic"),
    pytest.param(lambda m: m.__setitem__(OFF_SPEC + 3, m[OFF_SPEC + 3] ^ 1), "corrupt",
                 id="spec-byte"),
    pytest.param(lambda m: _put(m, OFF_SPEC_HASH, 12345, 8), "corrupt", id="spec-hash"),
    pytest.param(lambda m: _put(m, OFF_SPEC_LEN, 5000, 4), "corrupt", id="spec-len-huge"),
    pytest.param(lambda m: _put(m, OFF_SPEC_LEN, 0xFFFFFFFF, 4), "corrupt", id="spec-len-max"),
    pytest.param(lambda m: _put(m, OFF_MAX_CLIENTS, 0, 4), "parameters", id="max-clients-0"),
    pytest.param(lambda m: _put(m, OFF_SLOTS, 1000, 4), "parameters", id="slots-huge"),
    pytest.param(lambda m: _put(m, OFF_IN_BYTES, 2**62, 8), "parameters", id="in-bytes-huge"),
    pytest.param(lambda m: _put(m, OFF_TOTAL, 1 << 20, 8), "parameters", id="total-bytes"),
    pytest.param(lambda m: _put(m, OFF_PID_NS, 12345, 8), "another pid namespace",
                 id="pid-namespace"),
    pytest.param(lambda m: _put(m, OFF_TIME_NS, 12345, 8), "another time namespace",
                 id="time-namespace"),
    pytest.param(lambda m: _grow_max_clients(m, 4096), "smaller", id="max-clients-grown"),
    pytest.param(lambda m: _set_spec(m, b"not json at all"), "unreadable spec", id="not-json"),
    pytest.param(lambda m: _set_spec(m, b"\xff\xfe\x00"), "unreadable spec", id="not-utf8"),
    pytest.param(lambda m: _set_spec(m, b"null"), "unreadable spec", id="json-null"),
    pytest.param(lambda m: _set_spec(m, b"{}"), "unreadable spec", id="json-empty"),
    pytest.param(lambda m: _set_spec(m, b""), "unreadable spec", id="spec-empty"),
    pytest.param(lambda m: _set_spec(m, _spec_with(outputs=5)), "unreadable spec",
                 id="outputs-int"),
    pytest.param(lambda m: _set_spec(m, _spec_with(input_dtype="object")), "unreadable spec",
                 id="dtype-object"),
    pytest.param(lambda m: _set_spec(m, _spec_with(max_batch=-3)), "unreadable spec",
                 id="max-batch-negative"),
    pytest.param(lambda m: _set_spec(m, _spec_with(max_batch=16)), "disagree",
                 id="spec-disagrees-with-header"),
    pytest.param(lambda m: _set_spec(m, _spec_with(input_shape=[6, 7, 3])), "disagree",
                 id="input-shape-disagrees"),
    pytest.param(lambda m: _set_spec(m, b"[" * 2000 + b"]" * 2000), "unreadable spec",
                 id="deeply-nested"),
    pytest.param(lambda m: _set_spec(m, _spec_with(input_shape=[10**30])), "unreadable spec",
                 id="huge-dimension"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("corrupt, words", CORRUPTIONS)
def test_corrupt_header(corrupt: Callable[[mmap.mmap], None], words: str) -> None:
    spec = Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 32, 8, 8)
    seg, name = segment.create(spec)
    try:
        shm = posix_ipc.SharedMemory(name)
        with mmap.mmap(shm.fd, shm.size) as m:
            shm.close_fd()
            shmeval.connect(name)             # healthy first
            corrupt(m)
            with pytest.raises(shmeval.SegmentError) as ei:
                shmeval.connect(name)
            assert words in str(ei.value), str(ei.value)
    finally:
        segment.unlink(name)


@pytest.mark.timeout(60)
def test_random_header_corruption_never_crashes() -> None:
    msgs = run_child(child_corrupt_headers, (2024,))
    accepted, wrong = msgs[0]
    assert not wrong, wrong[:5]
    # Only bytes the header does not validate may be changed undetected:
    # the parameters' padding, the owner pid and its padding, the owner's
    # start time, and what lies past the spec text.
    spec_end = OFF_SPEC + len(Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 32, 4, 4).to_json())
    harmless = (set(range(68, 80)) | set(range(OFF_OWNER_START, OFF_SPEC))
                | {spec_end + 10, 5000, 6000})
    assert set(accepted) <= harmless, sorted(set(accepted) - harmless)


@pytest.mark.timeout(30)
def test_handle_of_replaced_evaluator_refuses_other_spec() -> None:
    name = unique_name("replaced")
    with make_ev(name=name) as ev1:
        handle = pickle.loads(pickle.dumps(ev1))   # knows ev1's spec, not attached yet
    with make_ev(name=name, input_shape=(4, 4), outputs={"v": ((), "float32")},
                 model=lambda x: x[:, 0, 0]) as ev2:
        assert ev2.address == name
        with pytest.raises(shmeval.SegmentError, match="another spec"):
            handle.evaluate(make_state(1))


@pytest.mark.timeout(30)
def test_segment_mode_0600() -> None:
    with make_ev() as ev:
        st = os.stat(seg_path(ev.address))
        assert st.st_mode & 0o777 == 0o600
        assert st.st_uid == os.getuid()


@pytest.mark.timeout(30)
def test_client_table_full_and_reclaim() -> None:
    with make_ev(max_clients=2) as ev:
        check_answer(ev.evaluate(make_state(1)), 1)          # entry 0
        h1 = pickle.loads(pickle.dumps(ev))
        check_answer(h1.evaluate(make_state(2)), 2)          # entry 1
        h2 = pickle.loads(pickle.dumps(ev))
        with pytest.raises(shmeval.ClientTableFull, match="max_clients"):
            h2.evaluate(make_state(3))
        assert ev.stats()["clients"] == 2
        h1.close()                                           # detaches entry 1
        assert ev.stats()["clients"] == 1
        wait_for(lambda: ev.stats()["reclaimed_clients"] == 1, NO_HANG,
                 "the detached entry's reclaim")
        check_answer(h2.evaluate(make_state(3)), 3)          # gets it
        check_answer(ev.evaluate(make_state(4)), 4)


# ================================================================ stats

@pytest.mark.timeout(30)
def test_stats() -> None:
    def model(x: np.ndarray) -> Any:
        if (x[:, 0, 0, 0] == 666).any():
            raise ValueError("poison")
        time.sleep(0.001)
        return fake_model(x)

    with make_ev(model) as ev:
        s0: dict[str, Any] = ev.stats()
        assert s0["requests"] == 0 and s0["batches"] == 0
        assert s0["state"] in ("starting", "serving")   # a thread evaluator starts async
        for t in range(10):
            check_answer(ev.evaluate(make_state(t)), t)
        check_many(ev.evaluate_many(np.stack([make_state(t) for t in range(40)])), list(range(40)))
        for _ in range(3):
            with pytest.raises(shmeval.ModelError):
                ev.evaluate(make_state(666))
        n = 10 + 40 + 3
        s = settled_stats(ev, "failed_requests", 3)
        assert s["requests"] == n
        assert 1 <= s["batches"] <= n
        assert s["mean_batch"] == pytest.approx(n / s["batches"])
        assert sum(s["batch_hist"].values()) == s["batches"]
        assert sum(k * v for k, v in s["batch_hist"].items()) == n
        assert max(s["batch_hist"]) <= 8                    # slots_per_client
        assert s["failed_requests"] == 3 and s["failed_batches"] == 3
        for key in ("queue_wait_us", "model_ms"):
            q = s[key]
            assert set(q) == {"p50", "p90", "p99"}, q
            assert all(np.isfinite(v) and v >= 0 for v in q.values()), q
            assert q["p50"] <= q["p90"] <= q["p99"], q
        assert s["model_ms"]["p50"] >= 0.5                 # the model sleeps 1 ms
        assert 0.0 <= s["model_time_share"] <= 1.0
        assert s["model_time_share"] > 0
        assert s["clients"] == 1
        assert s["padded_rows"] == 0
        assert s["stale_completions"] == 0
        assert s["uptime_s"] > 0
        assert s["state"] == "serving"
    assert ev.stats()["state"] == "closed"


# ================================================================ batching policy

@pytest.mark.timeout(60)
def test_max_wait_gathers_fuller_batches() -> None:
    """Requests arriving a few ms apart: with max_wait_us = 0.5 s each round of
    8 requests is gathered into far fewer batches than requests."""
    rec = Recorder()
    rounds, nthreads = 3, 8
    with make_ev(rec, max_wait_us=500_000, max_batch=64, slots_per_client=16) as ev:
        barrier = threading.Barrier(nthreads)
        errors: list[str] = []

        def run(i: int) -> None:
            for r in range(rounds):
                barrier.wait(30)
                time.sleep(0.002 * i)
                tag = 1000 * r + i
                out = ev.evaluate(make_state(tag))
                if float(out["value"]) != -tag:
                    errors.append(f"{tag}: {out}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(nthreads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert not any(th.is_alive() for th in threads)
        assert not errors, errors
        s = settled_stats(ev, "requests", rounds * nthreads)
        assert s["mean_batch"] > 2, (s["batch_hist"], rec.sizes)
        assert max(rec.sizes) >= 4, rec.sizes


@pytest.mark.timeout(30)
def test_max_batch_is_respected() -> None:
    rec = Recorder()
    with make_ev(rec, max_batch=4, slots_per_client=16) as ev:
        tags = list(range(50))
        check_many(ev.evaluate_many(np.stack([make_state(t) for t in tags])), tags)
        assert max(rec.sizes) <= 4 and sum(rec.sizes) == 50
        assert max(settled_stats(ev, "requests", 50)["batch_hist"]) <= 4


@pytest.mark.timeout(30)
@pytest.mark.parametrize("buckets, max_batch, allowed", [
    ([4, 8, 16], 16, {4, 8, 16}),
    ("pow2", 12, {1, 2, 4, 8, 12}),
    ([3, 40], 16, {3, 40}),                 # largest bucket above max_batch
])
def test_buckets_pad_batches(buckets: Any, max_batch: int, allowed: set[int]) -> None:
    rec = Recorder()
    with make_ev(rec, max_batch=max_batch, buckets=buckets, slots_per_client=16) as ev:
        sent = 0
        for n in (1, 3, 5, 9, 16, 30, 2, 1):
            tags = [10_000 * n + j for j in range(n)]
            check_many(ev.evaluate_many(np.stack([make_state(t) for t in tags])), tags)
            sent += n
        # Threads too, so that batches of odd sizes meet stale padding rows.
        errors: list[str] = []

        def run(i: int) -> None:
            for j in range(20):
                tag = 500_000 + 100 * i + j
                if float(ev.evaluate(make_state(tag))["value"]) != -tag:
                    errors.append(str(tag))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(20)
        assert not errors, errors[:5]
        sent += 80
        assert set(rec.sizes) <= allowed, sorted(set(rec.sizes))
        s = settled_stats(ev, "requests", sent)
        assert s["padded_rows"] == sum(rec.sizes) - sent
        assert max(s["batch_hist"]) <= max_batch


@pytest.mark.timeout(30)
def test_no_buckets_means_exact_sizes() -> None:
    rec = Recorder()
    with make_ev(rec, max_batch=16, slots_per_client=16) as ev:
        for n in (1, 3, 7):
            ev.evaluate_many(np.stack([make_state(t) for t in range(n)]))
        assert settled_stats(ev, "requests", 11)["padded_rows"] == 0
        assert sum(rec.sizes) == 11


# ================================================================ several evaluators

@pytest.mark.timeout(30)
def test_several_evaluators_in_one_process() -> None:
    def scaled(k: float) -> Callable[[np.ndarray], Any]:
        return lambda x: {"y": x.reshape(len(x), -1).sum(axis=1) * k}

    shapes = [(3,), (2, 5), (4, 4, 4)]
    evs = [shmeval.Evaluator(scaled(k + 1), input_shape=shape, outputs={"y": ((), "float64")},
                             max_clients=4, slots_per_client=4, max_batch=8)
           for k, shape in enumerate(shapes)]
    try:
        assert len({e.address for e in evs}) == 3
        errors: list[str] = []

        def run(i: int) -> None:
            rng = np.random.default_rng(i)
            for _ in range(50):
                k = int(rng.integers(3))
                x = rng.integers(0, 10, shapes[k]).astype(np.float32)
                got = float(evs[k].evaluate(x)["y"])
                if got != x.sum() * (k + 1):
                    errors.append(f"evaluator {k}: {got} != {x.sum() * (k + 1)}")

        run_threads(run, 4, 20)
        assert not errors, errors[:3]
        wait_for(lambda: sum(e.stats()["requests"] for e in evs) == 200, NO_HANG,
                 "the stats to count every request")
        # Closing one leaves the others serving.
        evs[1].close()
        with pytest.raises(shmeval.EvaluatorClosed):
            evs[1].evaluate(np.ones((2, 5), np.float32))
        assert float(evs[0].evaluate(np.ones(3, np.float32))["y"]) == 3.0
        assert float(evs[2].evaluate(np.ones((4, 4, 4), np.float32))["y"]) == 192.0
    finally:
        for e in evs:
            e.close()
    assert not any(os.path.exists(seg_path(e.address)) for e in evs)


@pytest.mark.timeout(60)
def test_housekeeping_runs_while_every_batch_takes_the_slow_path() -> None:
    """Outputs that need converting (float64 here) send every batch back to
    Python; dead or detached clients must still be reclaimed under load."""
    def model(x: np.ndarray) -> dict[str, np.ndarray]:
        out = fake_model(x)
        return {k: v.astype(np.float64) for k, v in out.items()}

    with make_ev(model) as ev:
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                check_answer(ev.evaluate(make_state(7)), 7)

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        try:
            other = shmeval.connect(ev.address)
            check_answer(other.evaluate(make_state(3)), 3)
            other.close()  # detached: the evaluator should reclaim its entry
            wait_for(lambda: ev.stats()["reclaimed_clients"] >= 1, NO_HANG,
                     "the detached client to be reclaimed under load")
        finally:
            stop.set()
            loader.join(10)
        assert ev.stats()["failed_requests"] == 0
