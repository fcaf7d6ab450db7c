"""The benchmark suite's references (shmeval.bench.reference) and the
evaluator's batch path (shmeval.bench.batchpath): they measure what they
claim, answer every request correctly, fail fast on a dead partner and leave
nothing behind.  No timing is asserted, only relations that hold on any
machine."""
from __future__ import annotations

import os
import threading
import time
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Iterator

import numpy as np
import pytest

from shmeval import _ring
from shmeval.bench import batchpath, reference
from shmeval.bench.batchpath import BatchRig, format_batch_path, run_batch_path
from shmeval.bench.reference import Partner, format_reference, pingpong, run_reference

C4 = (6, 7, 2)
NO_HANG_S = 5.0


def _ours() -> set[str]:
    """/dev/shm entries of the kinds these modules create: the ping-pong
    word (multiprocessing's psm_*), the semaphores, shmeval segments."""
    return {e for e in os.listdir("/dev/shm")
            if e.startswith(("psm_", "sem.shmeval-bench-", f"shmeval-{os.getpid()}-"))}


@pytest.fixture(autouse=True)
def nothing_left() -> Iterator[None]:
    before = _ours()
    affinity = os.sched_getaffinity(0)
    yield
    assert _ours() - before == set()
    assert os.sched_getaffinity(0) == affinity


def _check_latency_row(row: dict[str, Any]) -> None:
    assert row["rounds"] >= 100
    assert 0 < row["p50_us"] <= row["p99_us"] <= row["p99.9_us"]
    assert row["mean_us"] > 0 and row["elapsed_s"] > 0
    # round trips/s is rounds / elapsed; every round trip lies inside the
    # elapsed time, so rate x mean latency <= 1, and the gaps between round
    # trips are a few instructions, so it is not far below 1 either.
    assert row["round_trips_per_s"] == pytest.approx(row["rounds"] / row["elapsed_s"])
    covered = row["round_trips_per_s"] * row["mean_us"] / 1e6
    assert 0.5 < covered <= 1.0 + 1e-9, row


# ------------------------------------------------------------------ ping-pong

@pytest.mark.timeout(60)
def test_run_reference_rows() -> None:
    ref = run_reference(seconds=0.05, state_nbytes=(336, 1000))
    rows = ref["pingpong"]
    assert [(r["kind"], r["pinned"], r["spin_us"] > 0) for r in rows] == [
        ("futex", False, False), ("futex", False, True), ("semaphore", False, False),
        ("futex", True, False), ("semaphore", True, False)]
    assert (rows[1]["spin_us"], rows[1]["partner_spin_us"]) == (100, 50)
    usable = sorted(os.sched_getaffinity(0))
    for r in rows:
        _check_latency_row(r)
        # The child's own report of where it ran.
        if r["pinned"]:
            assert r["child_cpus"] == [ref["pinned_cpu"]]
        else:
            assert r["child_cpus"] == usable
    assert ref["pinned_cpu"] in usable
    copies = ref["copy"]
    assert [c["state_nbytes"] for c in copies] == [336, 1000]
    for c in copies:
        assert c["one_state_ns"] > 0 and c["batch_us"] > 0 and c["batch_gb_s"] > 0
        assert c["batch"] == reference.COPY_BATCH
    import json
    json.dumps(ref)  # JSON-able

    text = format_reference(ref)
    for r in rows:
        assert f"{r['round_trips_per_s']:,.0f}" in text
        assert f"{r['p50_us']:.1f}" in text
    assert "semaphore" in text and "pinned" in text
    for c in copies:
        assert f"{c['batch_us']:,.1f}" in text and f"{c['state_nbytes']:,}" in text


@pytest.mark.timeout(60)
def test_partner_pingpongs_both_sides() -> None:
    with Partner(timeout_s=NO_HANG_S) as p:
        for spin_ns, other_ns in ((0, 0), (20_000, 10_000), (20_000, None)):
            lat, elapsed = p.futex(300, spin_ns, other_ns)
            assert lat.shape == (300,) and (lat > 0).all()
            assert lat.sum() <= elapsed
            _check_latency_row(reference.latency_row("futex", False, spin_ns / 1e3, lat,
                                                     elapsed))
        lat, elapsed = p.semaphore(300)
        assert (lat > 0).all() and lat.sum() <= elapsed
        # The same word is reused: the next ping-pong starts afresh.
        lat, _ = p.futex(150)
        assert (lat > 0).all()
        # Pinning: the child moves where it is told and says so.
        cpu = min(os.sched_getaffinity(0))
        assert p.set_affinity({cpu}) == [cpu]
        assert p.set_affinity(None) == sorted(p.child_cpus)


@pytest.mark.timeout(30)
def test_pingpong_without_partner_times_out() -> None:
    shm = SharedMemory(create=True, size=64)
    try:
        for side in (0, 1):
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                pingpong(shm.buf, side, np.zeros(10, np.int64), 0, 100_000_000)
            assert time.monotonic() - t0 < NO_HANG_S
        with pytest.raises(TimeoutError):  # spinning first changes nothing
            pingpong(shm.buf, 0, np.zeros(10, np.int64), 50_000, 100_000_000)
        with pytest.raises(ValueError):
            pingpong(shm.buf, 2, np.zeros(10, np.int64))
        with pytest.raises(ValueError):
            pingpong(shm.buf, 0, np.zeros(10, np.int32))
    finally:
        shm.close()
        shm.unlink()


@pytest.mark.timeout(30)
def test_partner_killed_mid_pingpong_times_out() -> None:
    with Partner(timeout_s=0.3) as p:
        assert p.proc is not None
        proc = p.proc
        killer = threading.Timer(0.2, proc.kill)
        killer.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(TimeoutError):
                p.futex(2_000_000)  # far longer than 0.2 s
        finally:
            killer.cancel()
        assert time.monotonic() - t0 < NO_HANG_S
        proc.join(NO_HANG_S)
        assert not proc.is_alive()
        # The partner is gone: asking it for more fails at once.
        with pytest.raises((RuntimeError, TimeoutError)):
            p.semaphore(10)


# ----------------------------------------------------------------- batch path

@pytest.mark.timeout(60)
def test_batch_rig_drives_the_real_protocol() -> None:
    n = 70  # 64 clients x 2 slots, unevenly filled
    with BatchRig(C4, 7, n) as rig:
        assert (rig.nclients, rig.slots_per_client) == (64, 2)
        rig.post()
        for c, slots, _, _ in rig.plan:
            for k in slots:
                assert rig.seg.slot_state(c, k)[0] == 2  # READY
        assert rig.collect() == n
        # The batch holds every posted state exactly once.
        tags = rig.batch.reshape(n, -1)[:, 0]
        assert sorted(tags.tolist()) == list(range(1, n + 1))
        assert rig.mark_waiters() == n
        for c, slots, _, _ in rig.plan:
            for k in slots:
                assert rig.seg.slot_state(c, k)[:2] == (3, True)  # TAKEN, WAITER
        rig.finish(rig.model(rig.batch))
        for c, slots, _, reqs in rig.plan:
            for k, r in zip(slots, reqs.tolist()):
                assert rig.seg.slot_state(c, k)[:2] == (_ring.DONE, False)
                # Read one answer straight from the slot, as a client does.
                got = [np.zeros((1, 7), np.float32), np.zeros((1,), np.float32)]
                assert rig.seg.fetch(c, k, rig.gens[c, k], got, 0) == 1
                np.testing.assert_array_equal(got[0][0], r + 1 + np.arange(7))
                assert got[1][0] == -(r + 1)
        # A second round through the checking fetch.
        rig.post()
        assert rig.collect() == n
        rig.finish(rig.model(rig.batch))
        rig.fetch_and_check()
        assert rig.answered == n
        assert rig.seg.stat("requests") == 2 * n


@pytest.mark.timeout(30)
def test_fetch_and_check_notices_a_wrong_answer() -> None:
    with BatchRig(C4, 7, 5) as rig:
        rig.post()
        assert rig.collect() == 5
        policy, value = rig.model(rig.batch)
        value[2] += 1
        rig.finish((policy, value))
        with pytest.raises(RuntimeError, match="1 of 5 requests got a wrong answer"):
            rig.fetch_and_check()


@pytest.mark.timeout(60)
def test_run_batch_path_small() -> None:
    batches = (1, 3, 16, 70)
    rows = run_batch_path(C4, 7, batches=batches, seconds=0.02)
    assert [r["batch"] for r in rows] == list(batches)
    for r in rows:
        n = r["batch"]
        for key in ("collect_us", "finish_us", "total_us", "per_state_ns", "memcpy_us",
                    "vs_memcpy", "memcpy_inloop_us", "finish_waiter_us", "serve_us",
                    "collect_p90_us", "finish_p90_us", "total_p90_us"):
            assert r[key] > 0, (key, r)
        assert r["total_us"] <= r["total_p90_us"]
        assert r["vs_memcpy"] == pytest.approx(r["total_us"] / r["memcpy_us"])
        assert r["per_state_ns"] == pytest.approx(r["total_us"] * 1e3 / n)
        assert r["state_nbytes"] == 336
        # Every request of every round (timed or not) was answered correctly
        # (fetch_and_check raises otherwise) and counted by the core.
        assert r["rounds"] >= 5
        assert r["answered"] == r["served"] and r["answered"] % n == 0
        assert r["answered"] >= n * (r["rounds"] + 3)
    text = format_batch_path(rows, "Connect Four")
    assert "Connect Four" in text
    for r in rows:
        assert f"{r['total_us']:.1f}" in text and f"{r['vs_memcpy']:.2f}x" in text
        assert f"{r['finish_waiter_us']:.1f}" in text


@pytest.mark.timeout(30)
def test_batch_path_options_and_limits() -> None:
    rows = run_batch_path((4,), 3, batches=(2,), seconds=0.01, waiter=False, serve=False,
                          reject_nonfinite=False)
    assert "finish_waiter_us" not in rows[0] and "serve_us" not in rows[0]
    assert "finish+WAITER" in format_batch_path(rows, "tiny")
    with pytest.raises(ValueError):
        run_batch_path(C4, 7, batches=(1,), seconds=0)
    with pytest.raises(ValueError):  # 64 clients x 64 slots at most
        BatchRig(C4, 7, batchpath.MAX_CLIENTS * 64 + 1)
