"""Unit tests of the slot state machine through the Cython layer (shmeval._ring).

One process plays both sides: it registers a client, posts slots, and drives
a Server by hand (collect / complete / fail), checking the state word
(state, waiter bit, generation) after every transition:

    FREE -> (WRITING) -> READY -> TAKEN -> DONE | FAILED -> FREE (generation + 1)
"""
from __future__ import annotations

import mmap
import os
import threading
import time
from typing import Any, Iterator

import numpy as np
import posix_ipc
import pytest

import shmeval
from shmeval import _ring, segment
from shmeval.spec import Spec
from helpers import (INPUT_SHAPE, OUTPUTS, expected, fake_model, gen, is_final, make_state,
                     serve_config)

FREE, WRITING, READY, TAKEN = 0, 1, 2, 3
DONE, FAILED = _ring.DONE, _ring.FAILED
E_STATE = _ring.E_STATE
MS = 1_000_000   # ns
NO_HANG = 5.0


class Rig:
    """A formatted segment, its spec, a batch buffer and a Server (server 0
    of the segment's three: tests add the others)."""

    def __init__(self, max_batch: int = 8, max_clients: int = 4, slots: int = 4) -> None:
        self.spec = Spec.build(INPUT_SHAPE, "float32", OUTPUTS, max_batch, max_clients, slots)
        self.seg, self.name = segment.create(self.spec, servers=3)
        self.batch = np.zeros((max_batch,) + INPUT_SHAPE, np.float32)
        self.server = _ring.Server(self.seg, self.batch)

    def serve(self) -> None:
        self.seg.set_serving(0, os.getpid(), 0)

    def collect(self, max_batch: int = 64, wait_ns: int = 0, timeout_ns: int = 10 * MS) -> int:
        return self.server.collect(max_batch, 0, wait_ns, timeout_ns)

    def outs(self, n: int = 1) -> list[np.ndarray]:
        return [np.zeros((n,) + o.shape, o.dtype) for o in self.spec.outputs]

    def results(self, n: int) -> list[np.ndarray]:
        out = fake_model(self.batch[:n])
        return [np.ascontiguousarray(out[k]) for k in self.spec.output_names]

    def post(self, c: int, slots: list[int], tags: list[int]) -> None:
        rows = np.stack([make_state(t) for t in tags])
        self.seg.post(c, slots, rows, 0)


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    try:
        yield r
    finally:
        segment.unlink(r.name)


def state(rig: Rig, c: int, k: int) -> tuple[int, bool, int]:
    return rig.seg.slot_state(c, k)


# ================================================================ happy path

@pytest.mark.timeout(30)
def test_request_round_trip(rig: Rig) -> None:
    seg = rig.seg
    assert seg.ev_state() == _ring.STARTING
    rig.serve()
    assert seg.ev_state() == _ring.SERVING
    assert seg.replicas()[0]["pid"] == os.getpid()
    c = seg.register(os.getpid(), 0, 0)
    assert c == 0 and seg.n_attached() == 1
    assert seg.clients() == [(0, os.getpid(), 0, 0, False)]
    assert state(rig, c, 0) == (FREE, False, 0)

    rig.post(c, [0], [17])
    assert state(rig, c, 0) == (READY, False, 0)
    assert state(rig, c, 1) == (FREE, False, 0)          # neighbours untouched

    n = rig.collect()
    assert n == 1 and rig.server.pending == 1
    np.testing.assert_array_equal(rig.batch[0], make_state(17))
    assert state(rig, c, 0) == (TAKEN, False, 0)
    assert not is_final(seg, c, 0)

    assert rig.server.complete(rig.results(1), 42) == 1
    assert rig.server.pending == 0
    assert state(rig, c, 0) == (DONE, False, 0)
    assert is_final(seg, c, 0)
    assert seg.wait(c, 0, gen(seg, c, 0), 0, 100 * MS, 1) == DONE

    outs = rig.outs()
    assert seg.fetch(c, 0, gen(seg, c, 0), outs, 0) == 42                # the model version
    policy, value = expected(17)
    np.testing.assert_array_equal(outs[0][0], policy)
    assert outs[1][0] == value
    assert state(rig, c, 0) == (FREE, False, 1)          # generation bumped

    # Second round on the same slot: generation 1 -> 2.
    rig.post(c, [0], [18])
    assert state(rig, c, 0) == (READY, False, 1)
    assert rig.collect() == 1
    rig.server.complete(rig.results(1), 43)
    assert seg.fetch(c, 0, gen(seg, c, 0), outs, 0) == 43
    assert outs[1][0] == -18
    assert state(rig, c, 0) == (FREE, False, 2)


@pytest.mark.timeout(30)
def test_fail_path(rig: Rig) -> None:
    seg = rig.seg
    rig.serve()
    c = seg.register(os.getpid(), 0, 0)
    rig.post(c, [1, 2], [5, 6])
    assert rig.collect() == 2
    assert state(rig, c, 1)[0] == TAKEN and state(rig, c, 2)[0] == TAKEN
    assert rig.server.fail("ValueError: model on fire — ünïcode") == 2
    assert rig.server.pending == 0
    for k in (1, 2):
        assert state(rig, c, k) == (FAILED, False, 0)
        assert seg.wait(c, k, gen(seg, c, k), 0, 100 * MS, 1) == FAILED
        r = seg.fetch(c, k, gen(seg, c, k), rig.outs(), 0)
        assert r == "ValueError: model on fire — ünïcode"
        assert state(rig, c, k) == (FREE, False, 1)
    # A message longer than the output area is cut, never overflows.
    rig.post(c, [1], [5])
    assert rig.collect() == 1
    rig.server.fail("x" * 100_000)
    r = seg.fetch(c, 1, gen(seg, c, 1), rig.outs(), 0)
    assert isinstance(r, str) and 0 < len(r) < 100_000 and set(r) == {"x"}
    # The neighbouring slot data was not overwritten: a full round trip on
    # slot 2 still gives the right answer.
    rig.post(c, [2], [9])
    assert rig.collect() == 1
    rig.server.complete(rig.results(1), 1)
    outs = rig.outs()
    seg.fetch(c, 2, gen(seg, c, 2), outs, 0)
    assert outs[1][0] == -9


@pytest.mark.timeout(30)
def test_batch_of_several_clients_and_slots(rig: Rig) -> None:
    seg = rig.seg
    rig.serve()
    c0 = seg.register(os.getpid(), 0, 0)
    c1 = seg.register(os.getpid(), 0, 0)
    assert (c0, c1) == (0, 1) and seg.n_attached() == 2
    rig.post(c0, [0, 1, 2], [100, 101, 102])
    rig.post(c1, [3, 0], [200, 201])
    n = rig.collect()
    assert n == 5
    gathered = sorted(float(v) for v in rig.batch[:n, 5, 6, 1])
    assert gathered == sorted(-float(t) for t in (100, 101, 102, 200, 201))
    rig.server.complete(rig.results(n), 7)
    for c, k, t in ((c0, 0, 100), (c0, 1, 101), (c0, 2, 102), (c1, 3, 200), (c1, 0, 201)):
        outs = rig.outs()
        assert seg.wait(c, k, gen(seg, c, k), 0, 100 * MS, 1) == DONE
        assert seg.fetch(c, k, gen(seg, c, k), outs, 0) == 7
        assert outs[1][0] == -t, (c, k, t)           # each slot got its own row
        np.testing.assert_array_equal(outs[0][0], expected(t)[0])


@pytest.mark.timeout(30)
def test_collect_respects_max_batch() -> None:
    r = Rig(max_batch=3, slots=8)
    try:
        r.serve()
        c = r.seg.register(os.getpid(), 0, 0)
        r.post(c, list(range(7)), list(range(10, 17)))
        sizes: list[int] = []
        served: list[int] = []
        while len(served) < 7:
            n = r.collect(max_batch=64)          # capped by the server's max_batch (3)
            assert 0 < n <= 3
            sizes.append(n)
            served += [int(-v) for v in r.batch[:n, 5, 6, 1]]
            r.server.complete(r.results(n), 0)
        assert sorted(served) == list(range(10, 17))
        assert r.collect(max_batch=2) == 0       # nothing left: timeout
        for k in range(7):
            assert r.seg.fetch(c, k, gen(r.seg, c, k), r.outs(), 0) == 0
        # An explicit smaller cap.
        r.post(c, [0, 1, 2], [1, 2, 3])
        assert r.collect(max_batch=2) == 2
        r.server.complete(r.results(2), 0)
        assert r.collect(max_batch=2) == 1
        r.server.complete(r.results(1), 0)
    finally:
        segment.unlink(r.name)


@pytest.mark.timeout(30)
def test_collect_max_wait_gathers_late_requests(rig: Rig) -> None:
    """With max_wait, a request posted after the first one is taken into the
    same batch; greedy collect returns with what is ready."""
    seg = rig.seg
    rig.serve()
    c = seg.register(os.getpid(), 0, 0)
    rig.post(c, [0], [1])
    assert rig.collect() == 1                    # greedy
    rig.server.complete(rig.results(1), 0)
    seg.fetch(c, 0, gen(seg, c, 0), rig.outs(), 0)

    rig.post(c, [0], [1])
    t = threading.Timer(0.05, lambda: rig.post(c, [1], [2]))
    t.start()
    try:
        n = rig.server.collect(8, 0, 300 * MS, 10 * MS)   # wait up to 0.3 s for more
    finally:
        t.join()
    assert n == 2
    rig.server.complete(rig.results(2), 0)


@pytest.mark.timeout(30)
def test_replicas_take_their_share_of_the_work() -> None:
    """With several replicas serving, a collect takes at most its share of
    the work outstanding: the requests ready plus the rows the other
    replicas hold, split evenly among the replicas serving.  A replica
    alone serving, or one whose share is all that is ready, takes it all."""
    spec = Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 16, 4, 16)
    seg, name = segment.create(spec, replicas=2, servers=2)
    try:
        buf = [np.zeros((16,) + INPUT_SHAPE, np.float32) for _ in range(2)]
        a = _ring.Server(seg, buf[0], _ring.ServeGroup(), 0, 0)
        b = _ring.Server(seg, buf[1], _ring.ServeGroup(), 1, 1)
        seg.set_serving(0, os.getpid(), 0)
        c = seg.register(os.getpid(), 0, 0)
        rows = np.stack([make_state(t) for t in range(16)])
        seg.post(c, list(range(4)), rows[:4], 0)
        assert a.collect(16, 0, 0, 10 * MS) == 4       # one replica serving: all of it
        seg.set_serving(1, os.getpid(), 0)
        seg.post(c, list(range(4, 12)), rows[4:12], 0)
        # 8 ready + a's 4 held, over 2 replicas: 6, and 2 stay ready.
        assert b.collect(16, 0, 0, 10 * MS) == 6
        def answer(server: Any, batch: np.ndarray, n: int) -> None:
            out = fake_model(batch[:n])
            server.complete([np.ascontiguousarray(out[k]) for k in spec.output_names], 0)

        answer(b, buf[1], 6)
        answer(a, buf[0], 4)
        # Nothing held now: 2 ready -> a share of 1 each.
        assert a.collect(16, 0, 0, 10 * MS) == 1
        assert b.collect(16, 0, 0, 10 * MS) == 1
        a.fail("test")
        b.fail("test")
    finally:
        segment.unlink(name)


@pytest.mark.timeout(30)
def test_collect_timeout_and_outstanding_batch(rig: Rig) -> None:
    seg = rig.seg
    rig.serve()
    t0 = time.monotonic()
    assert rig.collect(timeout_ns=20 * MS) == 0
    assert time.monotonic() - t0 < NO_HANG
    c = seg.register(os.getpid(), 0, 0)
    rig.post(c, [0], [1])
    assert rig.collect() == 1
    with pytest.raises(shmeval.ShmevalError, match="outstanding"):
        rig.collect()
    rig.server.complete(rig.results(1), 0)


@pytest.mark.timeout(30)
def test_serve_records_its_model_calls(rig: Rig) -> None:
    """Server.serve records each model call that returns (start, duration,
    rows as the model saw them, padded to a bucket, and requests) for the
    tuner, up to the cap between two takes; the calls past the cap, and one
    that raised, are not recorded, and all of them ran."""
    seg, server = rig.seg, rig.server
    rig.serve()
    c = seg.register(os.getpid(), 0, 0)
    ran: list[int] = []

    def model(batch: np.ndarray) -> dict[str, np.ndarray]:
        ran.append(len(batch))
        if len(batch) == 2:
            raise RuntimeError("no pairs")
        time.sleep(0.002)
        return fake_model(batch)

    def serve_posted(slots: list[int], buckets: Any = None) -> tuple[int, int, int]:
        for k in slots:
            if is_final(seg, c, k):
                seg.fetch(c, k, gen(seg, c, k), rig.outs(), 0)   # frees the slot
        rig.post(c, slots, list(slots))
        before = _ring.now_ns()
        server.configure(serve_config(8, buckets=buckets, reject_nonfinite=False), MS)
        kind = server.serve(model, 0)[0]
        if kind == _ring.SERVE_RAISED:
            server.fail("no pairs")
        else:
            assert kind == _ring.SERVE_IDLE
            server.unlock()
        return kind, before, _ring.now_ns()

    assert server.take_calls().shape == (0, 4)    # nothing recorded before record_calls
    serve_posted([0])
    assert server.take_calls().shape == (0, 4)
    server.record_calls(2)
    _, before, after = serve_posted([0, 1, 2], [4, 8])
    assert serve_posted([0, 1])[0] == _ring.SERVE_RAISED
    serve_posted([3])
    serve_posted([0])                              # past the cap: runs, unrecorded
    assert ran == [1, 4, 2, 1, 1]
    calls = server.take_calls()
    assert calls[:, 2].tolist() == [4, 1]          # rows; the raised call is not there
    assert calls[:, 3].tolist() == [3, 1]          # requests
    assert before <= calls[0, 0] <= after and calls[0, 1] >= 2 * MS
    assert calls[0, 0] + calls[0, 1] <= calls[1, 0]
    serve_posted([1])                              # the take made room again
    assert server.take_calls()[:, 2].tolist() == [1]
    server.record_calls(0)
    serve_posted([2])
    assert server.take_calls().shape == (0, 4)
    with pytest.raises(ValueError):
        server.record_calls(-1)


# ================================================================ refused transitions

@pytest.mark.timeout(30)
def test_refused_transitions(rig: Rig) -> None:
    seg = rig.seg
    rig.serve()
    c = seg.register(os.getpid(), 0, 0)
    outs = rig.outs()
    # fetch / release of a FREE slot.
    with pytest.raises(shmeval.SegmentError, match="expected state"):
        seg.fetch(c, 0, gen(seg, c, 0), outs, 0)
    assert seg.release(c, 0, 0) == E_STATE
    assert state(rig, c, 0) == (FREE, False, 0)
    rig.post(c, [0], [3])
    # post to a READY slot, fetch of a READY slot.
    with pytest.raises(shmeval.SegmentError, match="expected state"):
        rig.post(c, [0], [4])
    with pytest.raises(shmeval.SegmentError):
        seg.fetch(c, 0, gen(seg, c, 0), outs, 0)
    assert seg.release(c, 0, 0) == E_STATE
    assert state(rig, c, 0) == (READY, False, 0)
    assert rig.collect() == 1
    # TAKEN is not final either.
    assert seg.release(c, 0, 0) == E_STATE
    with pytest.raises(shmeval.SegmentError):
        seg.fetch(c, 0, gen(seg, c, 0), outs, 0)
    rig.server.complete(rig.results(1), 0)
    # Another generation's fetch or release is refused and changes nothing.
    assert seg.fetch(c, 0, 7, outs, 0) == _ring.STALE
    assert seg.release(c, 0, 7) == _ring.STALE
    assert state(rig, c, 0) == (DONE, False, 0)
    # release without reading (an abandoned request), once.
    assert seg.release(c, 0, 0) == 0
    assert state(rig, c, 0) == (FREE, False, 1)
    assert seg.release(c, 0, 0) == _ring.STALE
    # The input was not overwritten by the refused post.
    rig.post(c, [0], [8])
    assert rig.collect() == 1
    assert rig.batch[0, 5, 6, 1] == -8
    rig.server.complete(rig.results(1), 0)


@pytest.mark.timeout(30)
def test_index_and_buffer_checks(rig: Rig) -> None:
    seg = rig.seg
    c = seg.register(os.getpid(), 0, 0)
    K, C = rig.spec.slots_per_client, rig.spec.max_clients
    for call in (lambda: seg.slot_state(c, K), lambda: seg.slot_state(C, 0),
                 lambda: seg.wait(c, K, gen(seg, c, K), 0, 1, 1), lambda: seg.fetch(C, 0, gen(seg, C, 0), rig.outs(), 0),
                 lambda: seg.release(c, K, 0),
                 lambda: seg.reclaim(C), lambda: seg.detach(C),
                 lambda: rig.post(c, [K], [1])):
        with pytest.raises(IndexError):
            call()
    # A rows buffer too small for the slots posted.
    with pytest.raises(ValueError):
        seg.post(c, [0, 1], np.stack([make_state(1)]), 0)
    with pytest.raises(ValueError):
        seg.post(c, [0], np.stack([make_state(1)]), 1)
    # Non-contiguous rows.
    with pytest.raises(ValueError):
        seg.post(c, [0, 1], np.asfortranarray(np.stack([make_state(1)] * 2)), 0)
    # Nothing was published by the refused posts.
    assert all(state(rig, c, k)[0] == FREE for k in range(K))
    # Batch buffer checks of Server.
    with pytest.raises(ValueError):
        _ring.Server(seg, np.zeros((2,) + INPUT_SHAPE, np.float32))
    with pytest.raises(ValueError):
        _ring.Server(seg, np.zeros((16,) + INPUT_SHAPE, np.float32)[::2])
    # complete() checks the output arrays.
    rig.serve()
    rig.post(c, [0], [1])
    assert rig.collect() == 1
    with pytest.raises(ValueError):
        rig.server.complete(rig.results(1)[:1], 0)
    with pytest.raises(ValueError):
        rig.server.complete([np.zeros((0, 7), np.float32), np.zeros(0, np.float32)], 0)
    assert state(rig, c, 0)[0] == TAKEN          # refused completes changed nothing
    rig.server.complete(rig.results(1), 0)
    # fetch checks the destination buffers.
    with pytest.raises(ValueError):
        seg.fetch(c, 0, gen(seg, c, 0), rig.outs()[:1], 0)
    with pytest.raises(ValueError):
        seg.fetch(c, 0, gen(seg, c, 0), rig.outs(1), 1)          # row 1 of a 1-row buffer
    assert state(rig, c, 0)[0] == DONE           # still fetchable
    assert seg.fetch(c, 0, gen(seg, c, 0), rig.outs(), 0) == 0


# ================================================================ client table

@pytest.mark.timeout(30)
def test_detach_then_reclaim_frees_the_entry(rig: Rig) -> None:
    seg = rig.seg
    rig.serve()
    pid = os.getpid()
    c = seg.register(pid, 777, 0)
    assert seg.clients() == [(c, pid, 777, 0, False)]
    # Leave slots in several states: READY (never taken), DONE (never fetched),
    # WRITING cannot be produced from Python; FREE with generation 1.
    rig.post(c, [0], [1])
    assert rig.collect() == 1
    rig.server.complete(rig.results(1), 0)        # slot 0 DONE
    rig.post(c, [1], [2])                         # slot 1 READY
    rig.post(c, [2], [3])
    assert rig.collect() == 2                     # takes slots 1 and 2 (TAKEN)
    rig.server.fail("x")                          # FAILED
    rig.post(c, [3], [4])                         # slot 3 READY
    seg.detach(c)
    assert seg.clients() == [(c, pid, 777, 0, True)]
    assert seg.n_attached() == 1                  # until the evaluator reclaims
    assert seg.reclaim(c) == 0                    # none stranded mid-write
    assert seg.clients() == []
    assert seg.n_attached() == 0
    for k in range(4):
        st, waiter, gen = state(rig, c, k)
        assert st == FREE and not waiter and gen == 1, (k, st, gen)
    assert seg.stat("reclaimed_clients") == 1
    # The entry is handed out again, starting clean.
    c2 = seg.register(pid, 0, 0)
    assert c2 == c
    assert seg.clients() == [(c2, pid, 0, 0, False)]
    rig.post(c2, [3], [9])
    assert rig.collect() == 1                     # the old READY slot 3 is gone
    assert rig.batch[0, 5, 6, 1] == -9
    rig.server.complete(rig.results(1), 0)


@pytest.mark.timeout(30)
def test_register_until_full() -> None:
    r = Rig(max_clients=3)
    try:
        got = [r.seg.register(1000 + i, 0, 0) for i in range(3)]
        assert got == [0, 1, 2]
        assert r.seg.n_attached() == 3
        with pytest.raises(shmeval.ClientTableFull, match="max_clients"):
            r.seg.register(2000, 0, 0)
        assert isinstance(shmeval.ClientTableFull("x"), shmeval.ShmevalError)
        # Free the middle one: the next registration gets exactly that entry.
        r.seg.detach(1)
        with pytest.raises(shmeval.ClientTableFull):
            r.seg.register(2000, 0, 0)                # detached is not yet free
        r.seg.reclaim(1)
        assert r.seg.register(3000, 5, 0) == 1
        assert [e[:3] for e in r.seg.clients()] == [(0, 1000, 0), (1, 3000, 5), (2, 1002, 0)]
    finally:
        segment.unlink(r.name)


@pytest.mark.timeout(30)
def test_no_reclaim_while_a_batch_holds_a_slot(rig: Rig) -> None:
    """Reclaiming waits for the batch: an entry with a slot in a batch in
    flight is refused (the batch's completion writes into its slots), and
    reclaimed once the batch is finished; the next owner then begins each
    slot at a new generation."""
    seg = rig.seg
    rig.serve()
    c = seg.register(os.getpid(), 0, 0)
    rig.post(c, [0, 1], [1, 2])
    assert rig.collect() == 2
    seg.detach(c)
    assert seg.reclaim(c) is None                  # refused: both slots are TAKEN
    assert state(rig, c, 0) == (TAKEN, False, 0)
    assert [e[0] for e in seg.clients()] == [c]
    assert rig.server.complete(rig.results(2), 9) == 2
    assert seg.stat("stale_completions") == 0
    assert seg.reclaim(c) == 0
    c2 = seg.register(os.getpid(), 0, 0)
    assert c2 == c
    assert state(rig, c, 0) == (FREE, False, 1)
    rig.post(c2, [0], [50])                        # new request, generation 1
    assert rig.collect() == 1
    assert rig.batch[0, 5, 6, 1] == -50
    rig.server.complete(rig.results(1), 10)
    outs = rig.outs()
    assert seg.fetch(c2, 0, 0, outs, 0) == _ring.STALE   # generation 0's answer: not ours
    assert seg.fetch(c2, 0, 1, outs, 0) == 10
    assert outs[1][0] == -50


# ================================================================ waiting

@pytest.mark.timeout(30)
def test_wait_times_out_without_answer(rig: Rig) -> None:
    seg = rig.seg
    rig.serve()
    c = seg.register(os.getpid(), 0, 0)
    rig.post(c, [0], [1])
    t0 = time.monotonic()
    assert seg.wait(c, 0, gen(seg, c, 0), 0, 30 * MS, 1) == _ring.TIMEOUT
    assert seg.wait(c, 0, gen(seg, c, 0), 1 * MS, 30 * MS, 64) == _ring.TIMEOUT   # with spinning
    assert time.monotonic() - t0 < NO_HANG
    assert state(rig, c, 0)[0] == READY
    assert rig.collect() == 1
    rig.server.complete(rig.results(1), 0)
    assert seg.wait(c, 0, gen(seg, c, 0), 0, 30 * MS, 1) == DONE


@pytest.mark.timeout(30)
def test_waiter_bit_and_wake(rig: Rig) -> None:
    seg = rig.seg
    rig.serve()
    c = seg.register(os.getpid(), 0, 0)
    rig.post(c, [0], [1])
    assert rig.collect() == 1                      # TAKEN: nobody will complete it yet
    rc: list[Any] = []
    th = threading.Thread(target=lambda: rc.append((seg.wait(c, 0, gen(seg, c, 0), 0, 10_000 * MS, 1),
                                                    time.monotonic())))
    th.start()
    deadline = time.monotonic() + NO_HANG
    while not state(rig, c, 0)[1]:
        assert time.monotonic() < deadline, "the waiter bit never appeared"
        time.sleep(0.001)
    assert state(rig, c, 0) == (TAKEN, True, 0)
    assert th.is_alive()
    t0 = time.monotonic()
    rig.server.complete(rig.results(1), 3)         # clears WAITER, rings the doorbell
    th.join(NO_HANG)
    assert not th.is_alive(), "the waiter was not woken"
    assert rc[0][0] == DONE
    assert rc[0][1] - t0 < NO_HANG                 # not its 10 s timeout
    assert state(rig, c, 0) == (DONE, False, 0)
    assert seg.fetch(c, 0, gen(seg, c, 0), rig.outs(), 0) == 3
    assert state(rig, c, 0) == (FREE, False, 1)


@pytest.mark.timeout(30)
def test_waiter_bit_survives_take(rig: Rig) -> None:
    """A client asleep on a READY slot: taking it keeps the WAITER bit, and
    failing it wakes the client."""
    seg = rig.seg
    rig.serve()
    c = seg.register(os.getpid(), 0, 0)
    rig.post(c, [2], [1])
    rc: list[int] = []
    th = threading.Thread(target=lambda: rc.append(seg.wait(c, 2, gen(seg, c, 2), 0, 10_000 * MS, 1)))
    th.start()
    deadline = time.monotonic() + NO_HANG
    while not state(rig, c, 2)[1]:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert state(rig, c, 2) == (READY, True, 0)
    assert rig.collect() == 1
    assert state(rig, c, 2) == (TAKEN, True, 0)
    rig.server.fail("boom")
    th.join(NO_HANG)
    assert not th.is_alive() and rc == [FAILED]
    assert seg.fetch(c, 2, gen(seg, c, 2), rig.outs(), 0) == "boom"


@pytest.mark.timeout(30)
def test_request_close_stops_collect(rig: Rig) -> None:
    seg = rig.seg
    rig.serve()
    c = seg.register(os.getpid(), 0, 0)
    seg.request_close()
    assert seg.ev_state() == _ring.CLOSING
    t0 = time.monotonic()
    assert rig.server.collect(8, 0, 0, 10_000 * MS) == _ring.CLOSED
    assert time.monotonic() - t0 < NO_HANG
    # Close is honoured before the next scan (docs/protocol.md, "Closing"):
    # a request posted now is not taken; its client learns of the close.
    rig.post(c, [0], [1])
    assert rig.collect() == _ring.CLOSED
    assert state(rig, c, 0) == (READY, False, 0)
    # request_close never moves a final state back.
    seg.close_and_wake(_ring.STOP_CLOSED)
    seg.request_close()
    assert seg.ev_state() == _ring.CLOSED_STATE


@pytest.mark.timeout(30)
def test_request_close_returns_what_was_taken(rig: Rig) -> None:
    """A collect waiting (max_wait) for a fuller batch returns what it has
    taken as soon as close is requested, not after max_wait."""
    seg = rig.seg
    rig.serve()
    c = seg.register(os.getpid(), 0, 0)
    rig.post(c, [0], [5])
    rc: list[Any] = []
    th = threading.Thread(target=lambda: rc.append(rig.server.collect(8, 0, 60_000 * MS,
                                                                      10 * MS)))
    th.start()
    deadline = time.monotonic() + NO_HANG
    while state(rig, c, 0)[0] != TAKEN:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    t0 = time.monotonic()
    seg.request_close()
    th.join(NO_HANG)
    assert not th.is_alive(), "collect kept waiting for a fuller batch after close"
    assert time.monotonic() - t0 < NO_HANG
    assert rc == [1]
    assert rig.batch[0, 5, 6, 1] == -5
    rig.server.complete(rig.results(1), 0)
    assert seg.fetch(c, 0, gen(seg, c, 0), rig.outs(), 0) == 0


@pytest.mark.timeout(30)
def test_request_close_wakes_a_sleeping_collect(rig: Rig) -> None:
    rig.serve()
    rc: list[Any] = []
    th = threading.Thread(target=lambda: rc.append(rig.server.collect(8, 0, 0, 10_000 * MS)))
    th.start()
    time.sleep(0.05)                               # let it go to sleep on the doorbell
    t0 = time.monotonic()
    rig.seg.request_close()
    th.join(NO_HANG)
    assert not th.is_alive() and rc == [_ring.CLOSED]
    assert time.monotonic() - t0 < NO_HANG


@pytest.mark.timeout(30)
def test_post_wakes_a_sleeping_collect(rig: Rig) -> None:
    seg = rig.seg
    rig.serve()
    c = seg.register(os.getpid(), 0, 0)
    rc: list[Any] = []
    th = threading.Thread(target=lambda: rc.append(rig.server.collect(8, 0, 0, 10_000 * MS)))
    th.start()
    time.sleep(0.05)
    rig.post(c, [0], [1])
    th.join(NO_HANG)
    assert not th.is_alive(), "posting did not ring the evaluator's doorbell"
    assert rc == [1]
    rig.server.complete(rig.results(1), 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("reason,final", [(_ring.STOP_CLOSED, _ring.CLOSED_STATE),
                                          (_ring.STOP_CRASHED, _ring.DIED)])
def test_close_and_wake_releases_waiters(rig: Rig, reason: int, final: int) -> None:
    seg = rig.seg
    rig.serve()
    c = seg.register(os.getpid(), 0, 0)
    rig.post(c, [0, 1], [1, 2])
    assert rig.collect(max_batch=1) == 1           # slot 0 TAKEN, slot 1 READY
    rcs: dict[int, Any] = {}
    threads = [threading.Thread(target=lambda k=k: rcs.__setitem__(
        k, seg.wait(c, k, gen(seg, c, k), 0, 10_000 * MS, 1))) for k in (0, 1)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + NO_HANG
    while not (state(rig, c, 0)[1] and state(rig, c, 1)[1]):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    t0 = time.monotonic()
    seg.close_and_wake(reason)
    for th in threads:
        th.join(NO_HANG)
    assert not any(th.is_alive() for th in threads), "a waiter slept through close_and_wake"
    assert time.monotonic() - t0 < NO_HANG
    assert rcs == {0: _ring.CLOSED, 1: _ring.CLOSED}
    assert seg.ev_state() == final and seg.stop_reason() == (reason, 0)
    # Waiting again returns CLOSED at once.
    assert seg.wait(c, 0, gen(seg, c, 0), 0, 10_000 * MS, 1) == _ring.CLOSED
    # A DONE slot is still reported DONE after the close.
    rig.server.complete(rig.results(1), 0)
    assert seg.wait(c, 0, gen(seg, c, 0), 0, 10_000 * MS, 1) == DONE


# ================================================================ header, stats, helpers

@pytest.mark.timeout(30)
def test_header_and_params(rig: Rig) -> None:
    seg = rig.seg
    assert seg.spec == rig.spec.to_json()
    assert seg.params == dict(in_bytes=rig.spec.in_bytes, out_bytes=rig.spec.out_bytes,
                              max_clients=4, slots_per_client=4, max_batch=8,
                              replicas=1, servers=3, cache_entries=0)
    assert seg.owner_pid == os.getpid()
    assert (seg.pid_ns, seg.time_ns) == tuple(segment.namespaces())
    assert seg.pid_ns == os.stat("/proc/self/ns/pid").st_ino != 0
    assert [(r["pid"], r["state"]) for r in seg.replicas()] == [(0, "empty")]
    assert seg.nbytes == _ring.segment_size(rig.spec.in_bytes, rig.spec.out_bytes, 4, 4, 8)
    assert seg.nbytes == os.stat("/dev/shm" + rig.name).st_size
    assert seg.name == rig.name
    assert _ring.LAYOUT_VERSION == 10
    # A second mapping of the same segment sees the same state words.
    seg2, spec2 = segment.attach(rig.name)
    assert spec2 == rig.spec
    c = seg.register(os.getpid(), 0, 0)
    rig.post(c, [1], [1])
    assert seg2.slot_state(c, 1) == (READY, False, 0)
    assert seg2.n_attached() == 1


@pytest.mark.timeout(30)
def test_segment_size_checks() -> None:
    ok = _ring.segment_size(336, 36, 4, 4, 8)
    assert ok > 0 and ok % 64 == 0
    assert _ring.segment_size(336, 36, 8, 4, 8) > ok
    for args in ((0, 36, 4, 4, 8), (336, 0, 4, 4, 8), (336, 36, 0, 4, 8), (336, 36, 4, 0, 8),
                 (336, 36, 4, 4, 0), (336, 36, 4, 65, 8), (336, 36, 4097, 4, 8),
                 (336, 36, 4, 4, 65537), (2**31, 36, 4, 4, 8), (-1, 36, 4, 4, 8)):
        with pytest.raises((ValueError, OverflowError)):
            _ring.segment_size(*args)


@pytest.mark.timeout(30)
def test_attach_validates_through_fd() -> None:
    """Segment.attach straight on a posix_ipc descriptor."""
    name = f"/shmeval-{os.getpid()}-unit{os.urandom(4).hex()}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=1 << 16)
    try:
        with pytest.raises(shmeval.SegmentError, match="bad magic"):
            _ring.Segment.attach(shm.fd, shm.size, name)
        with pytest.raises(shmeval.SegmentError, match="smaller"):
            _ring.Segment.attach(shm.fd, 100, name)
        with pytest.raises(shmeval.SegmentError, match="smaller"):
            _ring.Segment.attach(shm.fd, 0, name)
        # Format it by hand, then attach succeeds and agrees.
        spec = Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 8, 2, 2)
        size = _ring.segment_size(spec.in_bytes, spec.out_bytes, 2, 2, 8)
        assert size <= shm.size
        _ring.Segment.create(shm.fd, size, spec.in_bytes, spec.out_bytes, 2, 2, 8, 1, 1,
                             spec.to_json(), os.getpid(), 0, 0, name)
        seg = _ring.Segment.attach(shm.fd, shm.size, name)
        assert seg.spec == spec.to_json() and seg.params["max_clients"] == 2
        with pytest.raises(shmeval.SegmentError, match="smaller"):
            _ring.Segment.attach(shm.fd, size - 4096, name)
        # create refuses a mapping smaller than the layout.
        with pytest.raises(shmeval.SegmentError, match="smaller"):
            _ring.Segment.create(shm.fd, size - 4096, spec.in_bytes, spec.out_bytes, 2, 2, 8, 1, 1,
                                 spec.to_json(), os.getpid(), 0, 0, name)
        with pytest.raises(ValueError):
            _ring.Segment.create(shm.fd, size, spec.in_bytes, spec.out_bytes, 2, 2, 8, 1, 1,
                                 b"x" * (_ring.SPEC_MAX + 1), os.getpid(), 0, 0, name)
    finally:
        shm.close_fd()
        posix_ipc.unlink_shared_memory(name)


@pytest.mark.timeout(30)
def test_record_and_raw_stats(rig: Rig) -> None:
    seg = rig.seg
    rig.serve()
    c = seg.register(os.getpid(), 0, 0)
    rig.post(c, [0, 1, 2], [1, 2, 3])
    assert rig.collect() == 3
    rig.server.complete(rig.results(3), 0)
    rig.server.record(3, 4, 2_000_000, False)
    rig.server.record(1, 1, 1_000, True)
    raw = seg.raw_stats()
    assert raw["requests"] == 4 and raw["batches"] == 2
    assert raw["padded_rows"] == 1
    assert raw["failed_requests"] == 1 and raw["failed_batches"] == 1
    assert raw["model_ns"] == 2_001_000
    assert raw["batch_hist"][3] == 1 and raw["batch_hist"][1] == 1
    assert raw["batch_hist"].sum() == 2 and len(raw["batch_hist"]) == 9
    assert raw["hist_wait"].sum() == 3                 # one per request taken
    assert raw["hist_model"].sum() == 2
    assert raw["clients"] == 1
    assert raw["ev_state"] == _ring.SERVING
    assert raw["heartbeat_ns"] > 0
    from shmeval.stats import summarize
    s = summarize(raw)
    assert s["requests"] == 4 and s["mean_batch"] == 2.0
    assert s["batch_hist"] == {1: 1, 3: 1}
    assert 1.5 <= s["model_ms"]["p99"] <= 2.5          # 2 ms, within a histogram bin
    seg.stat_put("model_version", 5)
    seg.stat_inc("model_version", 2)
    assert seg.stat("model_version") == 7
    for k in range(3):
        seg.fetch(c, k, gen(seg, c, k), rig.outs(), 0)


@pytest.mark.timeout(30)
def test_all_finite() -> None:
    a = np.ones((4, 3), np.float32)
    assert _ring.all_finite(a, 4) is True
    a[3, 1] = np.nan
    assert _ring.all_finite(a, 3) is True              # only the first rows count
    assert _ring.all_finite(a, 4) is False
    b = np.ones((5,), np.float64)
    b[0] = -np.inf
    assert _ring.all_finite(b, 1) is False
    assert _ring.all_finite(b[1:], 4) is True
    assert _ring.all_finite(np.ones(3, np.float16), 3) is None    # NumPy's job
    assert _ring.all_finite(np.ones((4, 3), np.float32)[:, ::2], 4) is None
    with pytest.raises(ValueError):
        _ring.all_finite(np.ones((2, 2), np.float32), 3)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_finite_against_numpy(dtype: Any) -> None:
    """The bit test agrees with np.isfinite at the edges (largest finite,
    subnormals, -0.0, infinities, NaNs with any payload and sign), at any
    position of long rows, back to back or strided."""
    info = np.finfo(dtype)
    itype = np.uint32 if dtype == np.float32 else np.uint64
    nbits = 32 if dtype == np.float32 else 64
    exp_all_ones = np.array(info.max, dtype).view(itype) + itype(1)  # +inf's bits
    specials = [info.max, -info.max, info.tiny, info.smallest_subnormal, -0.0, 0.0,
                np.inf, -np.inf, np.nan, -np.nan,
                (exp_all_ones | itype(1)).view(dtype),                      # NaN, low payload
                (exp_all_ones | itype(1) << itype(nbits - 1) | itype(5)).view(dtype)]
    rng = np.random.default_rng(0)
    for value in specials:
        for pos in (0, 1, 37, 361):
            a = rng.standard_normal((6, 362)).astype(dtype)
            a[4, pos] = value
            want = bool(np.isfinite(a).all())
            assert _ring.all_finite(a, 6) is want, (value, pos)
            assert _ring.all_finite(a, 4) is True                 # row 4 not counted
            assert _ring.all_finite(a[::2], 3) is want            # strided rows
            assert _ring.all_finite(a[1::2], 3) is True


@pytest.mark.timeout(30)
def test_foreign_fd_is_never_trusted() -> None:
    """A header that claims more than its mapping is refused before any slot
    is touched (never reads out of bounds)."""
    spec = Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 8, 64, 16)
    seg, name = segment.create(spec)
    try:
        shm = posix_ipc.SharedMemory(name)
        with pytest.raises(shmeval.SegmentError, match="smaller"):
            _ring.Segment.attach(shm.fd, seg.nbytes - 1, name)
        with mmap.mmap(shm.fd, shm.size) as m:
            m[48:52] = (4096).to_bytes(4, "little")     # max_clients
        with pytest.raises(shmeval.SegmentError):
            _ring.Segment.attach(shm.fd, shm.size, name)
        shm.close_fd()
    finally:
        segment.unlink(name)


@pytest.mark.timeout(60)
def test_large_states_cross_intact() -> None:
    """Go-sized states (24,548 bytes: rows of a batch are 4-byte aligned, slots
    line-aligned, so the copies take shm_copy's line-load path) arrive at the
    model byte for byte and come back so: an identity model returns each
    state as its output.  Sent alone, as packed rows of evaluate_many, and
    from a buffer at an odd 4-byte offset."""
    shape = (19, 19, 17)
    ev = shmeval.Evaluator(lambda x: {"echo": x.copy(), "first": x[:, 0, 0, 0].copy()},
                           input_shape=shape, outputs={"echo": (shape, "float32"),
                                                       "first": ((), "float32")},
                           max_batch=16, max_clients=4, slots_per_client=8)
    rng = np.random.default_rng(7)
    with ev:
        for _ in range(3):
            one = rng.standard_normal(shape).astype(np.float32)
            out = ev.evaluate(one)
            np.testing.assert_array_equal(out["echo"], one)
            assert float(out["first"]) == float(one[0, 0, 0])
            rows = rng.standard_normal((11,) + shape).astype(np.float32)
            many = ev.evaluate_many(rows)
            np.testing.assert_array_equal(many["echo"], rows)
            np.testing.assert_array_equal(many["first"], rows[:, 0, 0, 0])
            raw = np.zeros(rows.nbytes + 64, np.uint8)
            odd = np.frombuffer(raw, np.float32, count=rows.size, offset=4).reshape(rows.shape)
            odd[...] = rows[::-1]
            np.testing.assert_array_equal(ev.evaluate_many(odd)["echo"], rows[::-1])
            np.testing.assert_array_equal(ev.evaluate(odd[3])["echo"], rows[-4])


@pytest.mark.timeout(30)
def test_client_requests_are_counted_per_entry(rig: Rig) -> None:
    seg = rig.seg
    rig.serve()
    c0 = seg.register(os.getpid(), 0, 0)
    c1 = seg.register(os.getpid(), 0, 0)
    rig.post(c0, [0, 1], [1, 2])
    rig.post(c1, [0], [3])
    assert seg.client_requests() == {c0: 2, c1: 1}
    assert rig.collect() == 3
    rig.server.complete(rig.results(3), 0)
    seg.detach(c1)
    assert seg.reclaim(c1) == 0
    assert seg.client_requests() == {c0: 2}


def test_the_collect_lock_is_taken_over_only_from_a_dead_replica() -> None:
    """A replica that waited past its timeout for the collect lock takes it
    over only once the holder's replica is marked dead: a live holder may be
    slow or waiting for requests, and two scans at once would take one
    request twice."""
    spec = Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 8, 4, 4)
    seg, name = segment.create(spec, replicas=2, servers=2)
    try:
        a = _ring.Server(seg, np.zeros((8,) + INPUT_SHAPE, np.float32), _ring.ServeGroup(), 0, 0)
        b = _ring.Server(seg, np.zeros((8,) + INPUT_SHAPE, np.float32), _ring.ServeGroup(), 1, 1)
        seg.set_serving(0, os.getpid(), 0)
        seg.set_serving(1, os.getpid(), 0)
        a.configure(serve_config(8), 5 * MS)
        b.configure(serve_config(8), 5 * MS)
        assert a.serve(fake_model, 0)[0] == _ring.SERVE_IDLE   # returns holding the collect lock
        kind, _, _, holder, _ = b.serve(fake_model, 0)
        assert (kind, holder) == (_ring.SERVE_LOCKED_OUT, 0)
        assert not b.take_over_lock(holder)            # replica 0 is alive: no
        b.unlock()
        assert seg.replica_stop(0, "dead") >= 0
        kind, _, _, holder, _ = b.serve(fake_model, 0)
        assert (kind, holder) == (_ring.SERVE_LOCKED_OUT, 0)
        assert b.take_over_lock(holder)                # found dead: taken over
        b.unlock()
        a.unlock()
    finally:
        segment.unlink(name)


@pytest.mark.timeout(30)
def test_a_put_back_after_failed_rows_finds_every_request_kept() -> None:
    """A replica that failed some rows of its batch (fail_rows) and died
    before it completed the others: the replica that puts its batch back
    finds every request it kept, not only the first ones of the batch (the
    segment's table lists the whole batch until none of it is left)."""
    spec = Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 8, 4, 8)
    seg, name = segment.create(spec, replicas=2, servers=2)
    try:
        a = _ring.Server(seg, np.zeros((8,) + INPUT_SHAPE, np.float32), _ring.ServeGroup(), 0, 0)
        b = _ring.Server(seg, np.zeros((8,) + INPUT_SHAPE, np.float32), _ring.ServeGroup(), 1, 1)
        seg.set_serving(0, os.getpid(), 0)
        c = seg.register(os.getpid(), 0, 0)
        gens = seg.post(c, [0, 1, 2, 3], np.stack([make_state(t) for t in range(4)]), 0)
        assert a.collect(8, 0, 0, 10 * MS) == 4
        assert a.fail_rows([0, 1], "refused") == 2   # rows 2 and 3 are kept
        assert [seg.slot_state(c, k)[0] for k in range(4)] == [FAILED, FAILED, TAKEN, TAKEN]
        seg.set_serving(1, os.getpid(), 0)
        assert seg.replica_stop(0, "dead") >= 0
        # b holds the collect lock (serve() returns IDLE holding it), then
        # puts a's batch back: both requests it kept are READY again.
        b.configure(serve_config(8), 5 * MS)
        assert b.serve(fake_model, 0)[0] == _ring.SERVE_IDLE
        assert b.requeue_replica(0) == 2
        b.unlock()
        assert [seg.slot_state(c, k)[0] for k in (2, 3)] == [READY, READY]
        assert b.collect(8, 0, 0, 10 * MS) == 2
        out = fake_model(b.request_rows().copy())
        b.complete([np.ascontiguousarray(out[k]) for k in spec.output_names], 0)
        for k, tag in ((2, 2), (3, 3)):
            outs = [np.zeros((1,) + o.shape, o.dtype) for o in spec.outputs]
            assert seg.fetch(c, k, gens[k], outs, 0) == 0
            assert outs[1][0] == expected(tag)[1]
    finally:
        segment.unlink(name)


@pytest.mark.timeout(30)
def test_a_batch_of_two_methods_is_served_a_method_at_a_time() -> None:
    """Requests of two methods taken in one collect: each method's function
    is called once, with its own requests' inputs only (by name), and each
    answer has its method's outputs; a request whose header names no
    method fails alone."""
    methods = {
        "initial": shmeval.Method(inputs={"obs": ((3,), "float32")},
                                  outputs={"hidden": ((2,), "float32"), "value": ((), "float32")}),
        "recurrent": shmeval.Method(inputs={"hidden": ((2,), "float32"), "action": ((), "int64")},
                                    outputs={"hidden": ((2,), "float32"),
                                             "reward": ((), "float64")}),
    }
    spec = Spec.build(None, None, None, 8, 4, 8, methods=methods)
    seg, name = segment.create(spec)
    try:
        ini, rec = spec.methods
        server = _ring.Server(seg, np.zeros((8, spec.in_bytes), np.uint8))
        seg.set_serving(0, os.getpid(), 0)
        c = seg.register(os.getpid(), 0, 0)
        calls: list[tuple[str, int]] = []

        def initial(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            calls.append(("initial", len(x["obs"])))
            return {"hidden": x["obs"][:, :2] * 2, "value": x["obs"].sum(axis=1)}

        def recurrent(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            calls.append(("recurrent", len(x["hidden"])))
            return {"hidden": (x["hidden"] + x["action"][:, None]).astype(np.float32),
                    "reward": x["action"].astype(np.float64) / 2}

        rows = np.zeros((5, spec.in_bytes), np.uint8)
        for i, m in enumerate([ini, rec, ini, rec, ini]):
            x = ({"obs": np.array([i, i + 1, i + 2], np.float32)} if m is ini else
                 {"hidden": np.array([i, -i], np.float32), "action": np.array(i, np.int64)})
            rows[i, :4].view(np.uint32)[0] = m.index
            for f in m.inputs:
                rows[i, f.offset:f.offset + f.nbytes] = np.ascontiguousarray(
                    x[f.name], f.dtype).reshape(-1).view(np.uint8)
        bad = rows[0].copy()
        bad[:4].view(np.uint32)[0] = 7  # names no method
        gens = seg.post(c, list(range(6)), np.concatenate([rows, bad[None]]), 0)
        server.configure(serve_config(8, input_shape=None, outputs=None, methods=methods), 5 * MS)
        kind = server.serve([initial, recurrent], 0)[0]
        assert kind == _ring.SERVE_IDLE
        server.unlock()
        assert calls == [("initial", 3), ("recurrent", 2)]
        for i, m in enumerate([ini, rec, ini, rec, ini]):
            outs = [np.zeros((1,) + o.shape, o.dtype) for o in m.outputs]
            assert seg.fetch(c, i, gens[i], outs, 0, m.index) == 0
            if m is ini:
                np.testing.assert_array_equal(outs[0][0], [2 * i, 2 * i + 2])
                assert outs[1][0] == 3 * i + 3
            else:
                np.testing.assert_array_equal(outs[0][0], [2 * i, 0])
                assert outs[1][0] == i / 2
        assert "no method" in seg.fetch(c, 5, gens[5], [np.zeros((1, 2), np.float32),
                                                        np.zeros(1, np.float32)], 0)
    finally:
        segment.unlink(name)
