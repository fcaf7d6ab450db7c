"""Pipelined evaluation (shmeval.pipeline): submit now, collect later.

- a Pending's result() is what evaluate_many returns for the same states
  (versions included), collected in any order, and raises what
  evaluate_many raises (bad input, ModelError, closed evaluator);
- more submissions than slots: block=True waits for the evaluator only
  (answers already there are copied into their Pendings to free slots),
  block=False raises NoFreeSlots;
- done(), result(timeout), wait_any and as_completed;
- a Pending dropped uncollected gives its slots back, also from a
  reference cycle, and Client.close() collects what is in flight;
- several threads submitting and collecting share the slots, each row
  fetched once;
- evaluate_async: many awaited at once on one waiter thread, cancellation
  gives the slots back.
The killed and dead-process cases are in tests/stress/test_pipeline_faults.py.
"""
from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import random
import threading
import time
from typing import Any, Callable, Optional

import numpy as np
import pytest

import shmeval
from shmeval.pipeline import NoFreeSlots, Pending
from helpers import fake_model, make_ev, make_state, run_threads

SLOTS = 8
NO_HANG = 10.0

pytestmark = pytest.mark.timeout(120)


def states(tags: list[int]) -> np.ndarray:
    return np.stack([make_state(t) for t in tags]) if tags else np.zeros((0, 6, 7, 2), np.float32)


def check(out: dict[str, np.ndarray], tags: list[int]) -> None:
    t = np.array(tags, np.float32)
    assert out["policy"].shape == (len(tags), 7) and out["value"].shape == (len(tags),)
    np.testing.assert_array_equal(out["policy"], 2 * t[:, None] + np.arange(7, dtype=np.float32))
    np.testing.assert_array_equal(out["value"], -t)


def gated(gate: threading.Event, held: Optional[set[int]] = None,
          fail: Optional[set[int]] = None,
          holding: Optional[threading.Event] = None) -> Callable[[np.ndarray],
                                                                 dict[str, np.ndarray]]:
    """The fake model, holding every batch (or those with a tag in held)
    until gate is set (setting holding, if given, once it holds one), and
    raising for batches with a tag in fail."""
    def model(x: np.ndarray) -> dict[str, np.ndarray]:
        tags = set((-x[:, 5, 6, 1]).astype(int).tolist())
        if held is None or tags & held:
            if holding is not None:
                holding.set()
            assert gate.wait(NO_HANG * 3), "gate never opened"
        if fail and tags & fail:
            raise RuntimeError(f"no answer for {sorted(tags & fail)}")
        return fake_model(x)
    # Calls may overlap: with two serving threads a held batch does not
    # hold the other thread's (tuning.model_concurrency).
    model.max_concurrency = 2  # type: ignore[attr-defined]
    return model


def free_slots(ev: Any) -> int:
    port = ev._port
    return len(port.free) if port is not None else -1


def slots_back(ev: Any, timeout: float = NO_HANG) -> None:
    """Every slot of this process is free again (abandoned ones recovered)."""
    deadline = time.monotonic() + timeout
    while True:
        port = ev._port
        with ev._entry.lock:
            ev._entry.recover_abandoned()
        if len(port.free) == SLOTS:
            return
        assert time.monotonic() < deadline, (len(port.free), port.abandoned)
        time.sleep(0.005)


# ---------------------------------------------------------------- results

def test_result_is_evaluate_many() -> None:
    with make_ev(slots_per_client=SLOTS) as ev:
        for tags in ([1], list(range(10, 10 + SLOTS)), []):
            p = ev.submit(states(tags))
            assert len(p) == len(tags)
            out = p.result()
            check(out, tags)
            assert out.keys() == ev.evaluate_many(states(tags)).keys()
            assert p.done() and p.result() is out  # collected once, kept
        out, versions = ev.submit(states([5, 6]), return_version=True).result()
        check(out, [5, 6])
        assert versions.dtype == np.int64 and versions.tolist() == [0, 0]
        assert free_slots(ev) == SLOTS


def test_bad_input_raises_like_evaluate_many() -> None:
    with make_ev(slots_per_client=SLOTS) as ev:
        with pytest.raises(ValueError, match="shape"):
            ev.submit(np.zeros((2, 6, 7), np.float32))
        with pytest.raises(TypeError, match="cannot be cast"):
            ev.submit(np.array([["x"]]))
        with pytest.raises(ValueError, match="at most slots_per_client"):
            ev.submit(states(list(range(SLOTS + 1))))
        assert free_slots(ev) == SLOTS


def test_out_of_order_collection() -> None:
    rng = random.Random(3)
    with make_ev(slots_per_client=SLOTS) as ev:
        for round_ in range(30):
            sizes = [rng.randint(1, 3) for _ in range(rng.randint(1, 6))]
            tags: list[list[int]] = []
            ps: list[Pending] = []
            for i, n in enumerate(sizes):
                tags.append([1000 * round_ + 10 * i + j for j in range(n)])
                ps.append(ev.submit(states(tags[-1])))
            order = list(range(len(ps)))
            rng.shuffle(order)
            for i in order:
                check(ps[i].result(), tags[i])
        assert free_slots(ev) == SLOTS
        assert ev.stats()["requests"] >= 30


def test_submit_uses_the_evaluation_cache() -> None:
    """As evaluate_many: the rows the cache holds are answered at the
    submit, only the others are posted (and their answers cached)."""
    rows: list[int] = []

    def counting(x: np.ndarray) -> dict[str, np.ndarray]:
        rows.append(len(x))
        return fake_model(x)

    with make_ev(counting, slots_per_client=SLOTS, cache_entries=1024) as ev:
        check(ev.submit(states([1, 3, 5])).result(), [1, 3, 5])
        before = sum(rows)
        p = ev.submit(states(list(range(SLOTS))), return_version=True)
        out, versions = p.result()
        check(out, list(range(SLOTS)))
        assert sum(rows) - before == SLOTS - 3 and versions.tolist() == [0] * SLOTS
        before = sum(rows)
        hit = ev.submit(states([5, 3, 1]))  # every row from the cache: nothing posted
        assert hit.done() and free_slots(ev) == SLOTS
        check(hit.result(), [5, 3, 1])
        # the caller's keys, trusted as evaluate_many trusts them
        check(ev.submit(states([7, 8]), keys=[100, 101]).result(), [7, 8])
        check(ev.submit(states([0, 0]), keys=[101, 100]).result(), [8, 7])
        assert sum(rows) - before == 2
        with pytest.raises(ValueError, match="1 keys for 2 states"):
            ev.submit(states([1, 2]), keys=[1])


def test_model_error_fails_only_its_pending() -> None:
    gate = threading.Event()
    gate.set()
    with make_ev(gated(gate, fail={7}), slots_per_client=SLOTS) as ev:
        bad = ev.submit(states([7]))
        with pytest.raises(shmeval.ModelError, match="no answer for"):
            bad.result()
        with pytest.raises(shmeval.ModelError):  # again: the same
            bad.result()
        assert bad.done()
        check(ev.submit(states([8])).result(), [8])
        assert free_slots(ev) == SLOTS


# ---------------------------------------------------------------- waiting

def test_done_and_timeout_while_held() -> None:
    gate = threading.Event()
    with make_ev(gated(gate), slots_per_client=SLOTS) as ev:
        p = ev.submit(states([1, 2]))
        assert not p.done()
        with pytest.raises(TimeoutError):
            p.result(timeout=0.05)
        assert not p.done()  # still in flight: the timeout gave nothing up
        gate.set()
        check(p.result(timeout=NO_HANG), [1, 2])
        assert p.done()


def test_more_submissions_than_slots() -> None:
    """block=True waits for the evaluator only: the answers of this
    process's uncollected submissions are copied out to free slots."""
    gate = threading.Event()
    with make_ev(gated(gate), slots_per_client=SLOTS) as ev:
        first = ev.submit(states(list(range(SLOTS))))
        with pytest.raises(NoFreeSlots, match="collect a submission first"):
            ev.submit(states([99]), block=False)
        gate.set()
        ps = [ev.submit(states([100 + i, 200 + i, 300 + i])) for i in range(10)]
        for i, p in enumerate(ps):
            check(p.result(), [100 + i, 200 + i, 300 + i])
        check(first.result(), list(range(SLOTS)))
        assert free_slots(ev) == SLOTS


def test_wait_any_takes_the_first_answered() -> None:
    gate, holding = threading.Event(), threading.Event()
    # Two serving threads: the held batch does not stop the other one.
    with make_ev(gated(gate, held={1}, holding=holding), slots_per_client=SLOTS,
                 serving_threads=2) as ev:
        held = ev.submit(states([1]))
        assert holding.wait(NO_HANG)  # the held batch is in the model (else both are held)
        free = ev.submit(states([2, 3]))
        assert ev.wait_any([held, free], timeout=NO_HANG) is free
        check(free.result(), [2, 3])
        with pytest.raises(TimeoutError):
            ev.wait_any([held], timeout=0.05)
        gate.set()
        assert ev.wait_any([held], timeout=NO_HANG) is held
        check(held.result(), [1])
        with pytest.raises(ValueError):
            ev.wait_any([])


def test_as_completed_yields_each_once() -> None:
    with make_ev(slots_per_client=SLOTS) as ev:
        tags = [[10 * i, 10 * i + 1] for i in range(12)]  # 24 states, 8 slots
        ps = [ev.submit(states(t)) for t in tags]
        seen = list(ev.as_completed(ps, timeout=NO_HANG))
        assert sorted(map(id, seen)) == sorted(map(id, ps))
        for p, t in zip(ps, tags):
            check(p.result(), t)


def test_pendings_of_another_client_refused() -> None:
    with make_ev(slots_per_client=SLOTS) as ev, make_ev(slots_per_client=SLOTS) as other:
        p = other.submit(states([1]))
        with pytest.raises(ValueError, match="this client"):
            ev.wait_any([p])
        p.result()


# ---------------------------------------------------------------- slots back

def test_dropped_pending_gives_its_slots_back() -> None:
    gate = threading.Event()
    with make_ev(gated(gate), slots_per_client=SLOTS) as ev:
        p = ev.submit(states(list(range(SLOTS))))
        del p  # uncollected, unanswered
        gate.set()
        check(ev.evaluate_many(states(list(range(50, 50 + SLOTS)))), list(range(50, 50 + SLOTS)))
        slots_back(ev)


def test_dropped_pending_in_a_cycle() -> None:
    """A Pending freed by the garbage collector (a reference cycle), the
    finalizer running wherever the collection happens."""
    gate = threading.Event()
    with make_ev(gated(gate), slots_per_client=SLOTS) as ev:
        gc.disable()
        try:
            for i in range(3):
                box: list[Any] = [ev.submit(states([i, i + 10]))]
                box.append(box)  # a cycle only the collector frees
                del box
        finally:
            gc.enable()
        gate.set()
        gc.collect()
        check(ev.evaluate_many(states(list(range(SLOTS)))), list(range(SLOTS)))
        slots_back(ev)


def test_close_collects_what_is_in_flight() -> None:
    """Client.close() copies the answers of uncollected submissions into
    their Pendings (so it need not wait for them), which stay collectable."""
    with make_ev(slots_per_client=SLOTS) as ev:
        client = shmeval.connect(ev.address)
        p = client.submit(states([4, 5]))
        t0 = time.monotonic()
        client.close(timeout=NO_HANG)
        assert time.monotonic() - t0 < NO_HANG / 2
        check(p.result(), [4, 5])
        check(client.submit(states([6])).result(), [6])  # on a new entry
        client.close()


def test_closed_evaluator_raises_at_result() -> None:
    gate = threading.Event()
    ev = make_ev(gated(gate, held={1}), slots_per_client=SLOTS, serving_threads=2)
    try:
        held = ev.submit(states([1]))
        waiting = ev.submit(states([2]))
        threading.Timer(0.1, gate.set).start()
        ev.close()
    finally:
        gate.set()
        ev.close()
    for p in (held, waiting):
        assert p.done()
        try:
            check(p.result(), [1] if p is held else [2])  # answered before the close
        except shmeval.EvaluatorClosed:
            pass
    with pytest.raises(shmeval.EvaluatorClosed):
        ev.submit(states([3]))


def test_forked_child_cannot_collect() -> None:
    with make_ev(slots_per_client=SLOTS) as ev:
        p = ev.submit(states([1]))
        ctx = mp.get_context("fork")
        q = ctx.Queue()

        def child() -> None:
            try:
                p.result()
                q.put("collected")
            except shmeval.ShmevalError as e:
                q.put(str(e))

        proc = ctx.Process(target=child)
        proc.start()
        msg = q.get(timeout=NO_HANG * 3)
        proc.join(NO_HANG)
        assert "process that submitted it" in msg
        check(p.result(), [1])


def test_submit_with_outputs_of_another_byte_order() -> None:
    """Outputs declared big-endian come back with their values (the
    general path makes the arrays when the C one cannot)."""
    def model(x: np.ndarray) -> Any:
        return {"v": (x[:, 0] * 3).astype(">f8")}

    with make_ev(model, input_shape=(2,), outputs={"v": ((), ">f8")},
                 slots_per_client=SLOTS) as ev:
        p = ev.submit(np.array([[1, 0], [2, 0]], np.float32))
        out = p.result()
        assert out["v"].dtype == np.dtype(">f8")
        assert out["v"].tolist() == [3.0, 6.0]


def test_results_held_keep_their_values() -> None:
    """A freed Pending's arrays serve later submits only once nothing holds
    them: results kept whole, by one array, or by a view keep their
    values while hundreds of submissions follow."""
    with make_ev(slots_per_client=SLOTS) as ev:
        held: list[tuple[int, Any]] = []
        for t in range(300):
            out = ev.submit(states([t, t + 1000])).result()
            if t % 4 == 0:
                held.append((t, out))
            elif t % 4 == 1:
                held.append((t, {"value": out["value"]}))
            elif t % 4 == 2:
                held.append((t, {"value": out["value"][:]}))
            del out
        for t, out in held:
            assert out["value"].tolist() == [-t, -(t + 1000)], t


def test_pending_does_not_pickle() -> None:
    """A Pending names slots of its own process: another cannot use it."""
    import pickle

    with make_ev(slots_per_client=SLOTS) as ev:
        p = ev.submit(states([1]))
        with pytest.raises(TypeError):
            pickle.dumps(p)
        check(p.result(), [1])


# ---------------------------------------------------------------- threads

def test_threads_share_the_slots() -> None:
    """Threads submitting, collecting in any order and dropping: each row is
    fetched once, with its own answer, and every slot comes back."""
    errors: list[str] = []
    sent = [0] * 6
    with make_ev(slots_per_client=SLOTS) as ev:
        def run(t: int) -> None:
            rng = random.Random(t)
            pend: list[tuple[Pending, list[int]]] = []
            for j in range(300):
                tags = [100_000 * t + 10 * j + i for i in range(rng.randint(1, 3))]
                pend.append((ev.submit(states(tags)), tags))
                sent[t] += len(tags)
                while len(pend) > rng.randint(0, 3):
                    p, want = pend.pop(rng.randrange(len(pend)))
                    out = p.result()
                    if not (out["value"] == -np.array(want, np.float32)).all():
                        errors.append(f"{want}: {out['value']}")
            for p, want in pend:
                if not (p.result()["value"] == -np.array(want, np.float32)).all():
                    errors.append(f"{want}")

        run_threads(run, 6, 90)
        assert not errors, errors[:3]
        slots_back(ev)
        assert ev.stats()["requests"] == sum(sent)


# ---------------------------------------------------------------- asyncio

def test_evaluate_async_many_at_once() -> None:
    gate = threading.Event()
    with make_ev(gated(gate), slots_per_client=SLOTS) as ev:
        async def main() -> list[Any]:
            asyncio.get_running_loop().call_later(0.05, gate.set)
            return await asyncio.gather(*[ev.evaluate_async(states([i, i + 1000]))
                                          for i in range(40)])  # 80 states, 8 slots

        outs = asyncio.run(main())
        for i, out in enumerate(outs):
            check(out, [i, i + 1000])
        waiters = [t for t in threading.enumerate() if t.name.startswith("shmeval-async")]
        assert len(waiters) == 1
        slots_back(ev)


def test_evaluate_async_errors_and_cancel() -> None:
    gate = threading.Event()
    with make_ev(gated(gate, fail={9}), slots_per_client=SLOTS) as ev:
        async def main() -> None:
            task = asyncio.ensure_future(ev.evaluate_async(states(list(range(SLOTS)))))
            await asyncio.sleep(0.05)
            task.cancel()  # its slots come back once answered
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            with pytest.raises(shmeval.ModelError):
                await ev.evaluate_async(states([9]))
            out, versions = await ev.evaluate_async(states([3]), return_version=True)
            check(out, [3])
            assert versions.tolist() == [0]

        asyncio.run(main())
        gc.collect()
        slots_back(ev)


def test_evaluate_async_closed_evaluator() -> None:
    gate = threading.Event()
    ev = make_ev(gated(gate), slots_per_client=SLOTS)
    try:
        async def main() -> None:
            task = asyncio.ensure_future(ev.evaluate_async(states([1])))
            await asyncio.sleep(0.05)
            await asyncio.get_running_loop().run_in_executor(None, close)
            with pytest.raises(shmeval.EvaluatorClosed):
                await asyncio.wait_for(task, NO_HANG)

        def close() -> None:
            threading.Timer(0.2, gate.set).start()
            ev.close()

        asyncio.run(main())
    finally:
        gate.set()
        ev.close()


def test_evaluate_async_handle_closed() -> None:
    """Client.close() while a request is awaited: the await ends (with
    EvaluatorClosed), and so does one waiting for slots."""
    gate = threading.Event()
    with make_ev(gated(gate), slots_per_client=SLOTS) as ev:
        client = shmeval.connect(ev.address)

        async def main() -> None:
            loop = asyncio.get_running_loop()
            held = asyncio.ensure_future(client.evaluate_async(states(list(range(SLOTS)))))
            await asyncio.sleep(0.05)
            short = asyncio.ensure_future(client.evaluate_async(states([1])))  # no free slot
            await asyncio.sleep(0.05)
            await loop.run_in_executor(None, lambda: client.close(timeout=0.1))
            for task in (held, short):
                with pytest.raises(shmeval.EvaluatorClosed):
                    await asyncio.wait_for(task, NO_HANG)

        try:
            asyncio.run(main())
        finally:
            gate.set()


def test_entry_per_registration() -> None:
    """A new registration of the handle (after close) gets a new entry, and
    a Pending of the old one cannot be waited for through the new one."""
    with make_ev(slots_per_client=SLOTS) as ev:
        client = shmeval.connect(ev.address)
        p = client.submit(states([1]))
        check(p.result(), [1])
        entry = client._entry
        client.close()
        check(client.submit(states([2])).result(), [2])
        assert client._entry is not entry and client._entry is not None
        with pytest.raises(ValueError, match="this client's submit in this process"):
            client.wait_any([p])
        client.close()
