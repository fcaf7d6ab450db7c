"""The evaluation cache (``Evaluator(cache_entries=N)``): a table in the
segment that every client consults before it sends a state and fills with
the answers it gets.

The model counts the rows it computes, so a test sees which states were
answered from the cache; its value output carries the weight w of the
model version (value = -tag + w, w = WEIGHT_STEP * version), so every
answer can be checked against the version it says computed it.  The C test
(ring_test cache, cache_torn, cache_threads) covers torn and killed writers
and races; these cover the client paths, versions and processes.
"""
from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np
import pytest

import shmeval
from shmeval import _ring, segment
from shmeval.spec import Spec
from helpers import INPUT_SHAPE, OUTPUTS, check_answer, fake_model, make_ev, make_state

WEIGHT_STEP = 1000.0
JOIN_TIMEOUT = 120
MS = 1_000_000


class CountingModel:
    """helpers.fake_model plus a weight w on the value (set_weights([w])),
    counting the rows of each call."""

    def __init__(self) -> None:
        self.w = np.float32(0)
        self.calls: list[int] = []

    def __call__(self, x: np.ndarray) -> dict[str, np.ndarray]:
        self.calls.append(len(x))
        return {"policy": x[:, 0, :, 0] * 2 + np.arange(7, dtype=np.float32),
                "value": x[:, 5, 6, 1] + self.w}

    def set_weights(self, weights: list[np.ndarray]) -> None:
        self.w = np.float32(weights[0])


def counting_factory() -> CountingModel:
    return CountingModel()


def states(tags: Any) -> np.ndarray:
    return np.stack([make_state(t) for t in tags])


def check_value(out: dict[str, np.ndarray], tags: Any, version: Any) -> None:
    want = -np.asarray(tags, np.float32) + np.float32(WEIGHT_STEP) * np.asarray(version,
                                                                               np.float32)
    np.testing.assert_array_equal(out["value"], want)


def test_a_hit_is_answered_without_a_round_trip() -> None:
    m = CountingModel()
    with make_ev(m, cache_entries=1024) as ev:
        check_answer(ev.evaluate(make_state(3)), 3)
        assert sum(m.calls) == 1
        out, version = ev.evaluate(make_state(3), return_version=True)
        check_answer(out, 3)
        assert version == 0 and sum(m.calls) == 1
        st = ev.stats()["cache"]
        assert (st["entries"], st["held"], st["hits"], st["misses"]) == (1024, 1, 1, 1)
        assert st["hit_rate"] == 0.5 and st["stale"] == 0 and st["replaced"] == 0
        mine = [c for c in st["clients"] if c["pid"] == os.getpid()]
        assert len(mine) == 1 and (mine[0]["hits"], mine[0]["misses"]) == (1, 1)
        # the next state differs in one byte: a miss
        s = make_state(3)
        s.view(np.uint8)[-1] ^= 1
        ev.evaluate(s)
        assert sum(m.calls) == 2


def test_evaluate_many_sends_only_its_misses_in_one_round() -> None:
    m = CountingModel()
    with make_ev(m, cache_entries=1024, slots_per_client=8) as ev:
        ev.evaluate_many(states([1, 3, 5]))
        calls = len(m.calls)
        out, versions = ev.evaluate_many(states(range(8)), return_version=True)
        for i in range(8):
            check_answer({k: v[i] for k, v in out.items()}, i)
        assert sum(m.calls[calls:]) == 5 and list(versions) == [0] * 8
        # all hits: no request at all
        calls = len(m.calls)
        out = ev.evaluate_many(states([7, 5, 3, 1]))
        assert len(m.calls) == calls
        check_value(out, [7, 5, 3, 1], 0)
        # more states than slots (the general path): still only the misses
        out = ev.evaluate_many(states(range(20)))
        check_value(out, range(20), 0)
        assert sum(m.calls[calls:]) == 12


def test_callers_keys() -> None:
    m = CountingModel()
    with make_ev(m, cache_entries=64) as ev:
        check_answer(ev.evaluate(make_state(1), key=42), 1)
        # the key is trusted: another state under key 42 gets state 1's answer
        check_answer(ev.evaluate(make_state(2), key=42), 1)
        # keys and hashes are apart: state 1 by its bytes is a miss
        n = sum(m.calls)
        check_answer(ev.evaluate(make_state(1)), 1)
        assert sum(m.calls) == n + 1
        # any int, taken modulo 2**64; numpy arrays of either signedness
        keys = np.array([-1, 0, 2**62, 7], np.int64)
        ev.evaluate_many(states([4, 5, 6, 7]), keys=keys)
        n = sum(m.calls)
        out = ev.evaluate_many(states([0, 0, 0, 0]), keys=keys.astype(np.uint64))
        check_value(out, [4, 5, 6, 7], 0)
        out = ev.evaluate_many(states([0, 0]), keys=[2**64 - 1, 2**64 + 7])
        check_value(out, [4, 7], 0)
        check_answer(ev.evaluate(make_state(0), key=np.int64(0)), 5)
        assert sum(m.calls) == n
        with pytest.raises(ValueError, match="3 keys for 4 states"):
            ev.evaluate_many(states(range(4)), keys=[1, 2, 3])
        with pytest.raises(TypeError, match="keys must be integers"):
            ev.evaluate_many(states(range(2)), keys=np.array([1.0, 2.0]))
        with pytest.raises(TypeError, match="keys must be integers"):
            ev.evaluate_many(states(range(2)), keys=["a", "b"])
        with pytest.raises(TypeError):
            ev.evaluate(make_state(1), key="a")
        with pytest.raises(TypeError):
            ev.evaluate(make_state(1), key=1.5)


def test_keys_without_a_cache_are_ignored() -> None:
    m = CountingModel()
    with make_ev(m) as ev:
        check_answer(ev.evaluate(make_state(1), key=9), 1)
        check_answer(ev.evaluate(make_state(2), key=9), 2)
        check_value(ev.evaluate_many(states([3, 4]), keys=[9, 9]), [3, 4], 0)
        assert ev.stats()["cache"] is None


def test_no_answer_of_old_weights_after_set_weights() -> None:
    m = CountingModel()
    with make_ev(m, cache_entries=256) as ev:
        ev.evaluate_many(states(range(6)))
        for version in (1, 2):
            assert ev.set_weights([np.float32(WEIGHT_STEP * version)]) == version
            out, versions = ev.evaluate_many(states(range(6)), return_version=True)
            check_value(out, range(6), version)
            assert list(versions) == [version] * 6
            out, v = ev.evaluate(make_state(2), return_version=True)
            assert v == version and float(out["value"]) == -2 + WEIGHT_STEP * version
        st = ev.stats()["cache"]
        assert st["version"] == 2 and st["stale"] == 12
        # every cached state was answered again, by the newest weights: the
        # old entries were replaced in place (same key), none is left old
        assert st["held"] == 6 and st["old_entries"] == 0
        # and the new answers are hits now
        n = sum(m.calls)
        check_value(ev.evaluate_many(states(range(6))), range(6), 2)
        assert sum(m.calls) == n


@pytest.mark.parametrize("n, what", [
    (3, "power of two from 4 to 2**32"), (2, "power of two"), (6, "power of two"),
    (-4, "power of two"), (2**33, "power of two from 4 to 2**32"),
    (2**32, "more than"), (2**30, "more than"),
])
def test_bad_sizes(n: int, what: str) -> None:
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(ValueError, match=what.replace("*", r"\*")):
        make_ev(cache_entries=n)
    with pytest.raises(ValueError, match=what.replace("*", r"\*")):
        shmeval.Evaluator.spawn(counting_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                cache_entries=n)
    assert set(os.listdir("/dev/shm")) <= before


def test_a_size_that_is_not_an_int() -> None:
    with pytest.raises(TypeError, match="cache_entries must be an int"):
        make_ev(cache_entries=1024.0)


def test_a_scribbled_cache_never_answers_wrongly() -> None:
    m = CountingModel()
    with make_ev(m, cache_entries=64) as ev:
        ev.evaluate_many(states(range(8)))
        seg = ev._attach()
        stride = _ring.cache_entry_bytes(ev.spec.out_bytes)
        with open("/dev/shm" + ev.address, "r+b") as f:
            mm = mmap.mmap(f.fileno(), 0)
            start = len(mm) - 64 * stride
            rng = np.random.default_rng(7)
            junk = rng.integers(0, 256, 64 * stride, dtype=np.uint8).tobytes()
            # keep the keys (so lookups find their entries), scribble the rest
            table = bytearray(mm[start:])
            for e in range(64):
                at = e * stride
                table[at + 8:at + stride] = junk[at + 8:at + stride]
            mm[start:] = bytes(table)
            mm.close()
        assert seg.cache_entries == 64
        n = sum(m.calls)
        check_value(ev.evaluate_many(states(range(8))), range(8), 0)
        assert sum(m.calls) == n + 8  # every entry refused: all sent again
        check_value(ev.evaluate_many(states(range(8))), range(8), 0)
        assert sum(m.calls) == n + 8  # and cached again


def test_a_process_never_goes_back_to_an_older_version() -> None:
    """Once a process got an answer of version v, it refuses older cache
    entries, even before set_weights(v) returned and raised the floor for
    all: its versions never go backwards.  Driven by hand through the
    segment (this process is client and evaluator), so that the answer of
    the newer version comes while the floor is still 0."""
    spec = Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 8, 2, 4)
    seg, name = segment.create(spec, cache_entries=64)
    try:
        batch = np.zeros((8,) + INPUT_SHAPE, np.float32)
        server = _ring.Server(seg, batch)
        seg.set_serving(0, os.getpid(), 0)
        c = seg.register(os.getpid(), 0, 0)

        def evaluate(tags: list[int], version: int) -> list[int]:
            """Answers tags, the misses by a model of `version`; returns the
            rows that missed."""
            rows = states(tags)
            outs = [np.zeros((len(tags),) + o.shape, o.dtype) for o in spec.outputs]
            misses, k1, k2 = seg.cache_lookup(c, rows, None, outs, None)
            if misses:
                slots = list(range(len(misses)))
                gens = seg.post(c, slots, rows, misses, k1, k2)
                n = server.collect(8, 0, 0, 100 * MS)
                out = fake_model(batch[:n])
                server.complete([np.ascontiguousarray(out[k]) for k in spec.output_names],
                                version)
                for k, g, row in zip(slots, gens, misses):
                    assert seg.fetch(c, k, g, outs, row) == version
            for i, t in enumerate(tags):
                check_answer({k: o[i] for k, o in zip(spec.output_names, outs)}, t)
            return list(misses)

        assert evaluate([1, 2], 0) == [0, 1]
        assert evaluate([1, 2], 0) == []         # hits
        assert evaluate([3], 5) == [0]           # an answer of version 5 ...
        assert seg.seen_version == 5 and seg.cache_version() == 0
        assert evaluate([1, 2], 5) == [0, 1]     # ... so version 0 is refused here
        assert evaluate([1, 2], 5) == []         # and version 5 is not
    finally:
        segment.unlink(name)


# ------------------------------------------------------------ processes
def _worker(address: str, tags: list[int], barrier: Any, result: Any) -> None:
    client = shmeval.connect(address)
    barrier.wait(JOIN_TIMEOUT)
    out = client.evaluate_many(states(tags))
    check_value(out, tags, 0)
    for t in tags:
        check_answer(client.evaluate(make_state(t)), t)
    result.put(os.getpid())
    client.close()


def test_one_process_fills_the_cache_for_the_others() -> None:
    ctx = mp.get_context("spawn")
    m = CountingModel()
    with make_ev(m, cache_entries=1024, slots_per_client=16) as ev:
        tags = list(range(16))
        results, one = ctx.Queue(), ctx.Barrier(1)
        first = ctx.Process(target=_worker, args=(ev.address, tags, one, results))
        first.start()
        first.join(JOIN_TIMEOUT)
        assert first.exitcode == 0 and sum(m.calls) == 16
        barrier = ctx.Barrier(3)
        others = [ctx.Process(target=_worker, args=(ev.address, tags, barrier, results))
                  for _ in range(3)]
        for p in others:
            p.start()
        for p in others:
            p.join(JOIN_TIMEOUT)
            assert p.exitcode == 0
        assert sum(m.calls) == 16  # the other three were answered from the cache
        st = ev.stats()["cache"]
        assert st["hits"] == 3 * 32 + 16 and st["misses"] == 16


def _versions_worker(address: str, published: Any, stop: Any, errors: Any,
                     barrier: Any) -> None:
    client = shmeval.connect(address)
    rng = np.random.default_rng(os.getpid())
    try:
        client.evaluate(make_state(0))
        barrier.wait(JOIN_TIMEOUT)
        seen = 0
        while not stop.is_set():
            floor = published.value  # set_weights(floor) has returned
            tags = rng.integers(0, 12, 4)
            out, versions = client.evaluate_many(states(tags), return_version=True)
            check_value(out, tags, versions)
            if versions.min() < max(floor, seen):
                errors.put(f"version {versions.min()} after set_weights({floor}) returned "
                           f"and after this process got version {seen}")
                return
            seen = max(seen, int(versions.max()))
    except BaseException as e:  # reported, not swallowed: the parent asserts
        errors.put(repr(e))
    finally:
        client.close()


@pytest.mark.timeout(180)
def test_versions_never_go_back_under_load() -> None:
    """Workers hammer 12 states (so nearly every lookup is a hit) while
    the weights change: once set_weights(v) has returned, no worker gets an
    answer of an older version; no worker's versions go backwards (a cache
    hit older than an answer it already had); and every answer matches its
    version."""
    ctx = mp.get_context("spawn")
    m = CountingModel()
    with make_ev(m, cache_entries=64) as ev:
        published, stop, errors = ctx.Value("q", 0), ctx.Event(), ctx.Queue()
        barrier = ctx.Barrier(4)
        procs = [ctx.Process(target=_versions_worker,
                             args=(ev.address, published, stop, errors, barrier))
                 for _ in range(3)]
        for p in procs:
            p.start()
        barrier.wait(JOIN_TIMEOUT)  # every worker is attached and evaluating
        for version in range(1, 9):
            time.sleep(0.15)
            assert ev.set_weights([np.float32(WEIGHT_STEP * version)]) == version
            published.value = version
        time.sleep(0.15)
        stop.set()
        for p in procs:
            p.join(JOIN_TIMEOUT)
        assert errors.empty(), errors.get()
        assert all(p.exitcode == 0 for p in procs)
        st = ev.stats()["cache"]
        assert st["hits"] > st["misses"] > 0 and st["stale"] > 0, st


def test_key_schemes_keep_processes_keys_apart() -> None:
    """Caller keys are trusted within a scheme: a handle whose keys are of
    another scheme (say, its own Zobrist table) never takes an answer stored
    under the same key in another scheme."""
    m = CountingModel()
    with make_ev(m, cache_entries=64) as ev:
        ev.set_key_scheme(np.arange(4, dtype=np.uint64))  # a "Zobrist table"
        check_answer(ev.evaluate(make_state(1), key=42), 1)
        same = shmeval.connect(ev.address)
        same.set_key_scheme(np.arange(4, dtype=np.uint64))
        check_answer(same.evaluate(make_state(2), key=42), 1)  # same scheme: trusted
        other = shmeval.connect(ev.address)
        other.set_key_scheme(np.arange(1, 5, dtype=np.uint64))
        check_answer(other.evaluate(make_state(2), key=42), 2)
        plain = shmeval.connect(ev.address)  # the default scheme is apart too
        check_answer(plain.evaluate(make_state(3), key=42), 3)
        with pytest.raises(TypeError, match="key scheme"):
            plain.set_key_scheme(1.5)
        for h in (other, same, plain):
            h.close()


def test_an_answer_is_cached_under_the_bytes_it_was_computed_from() -> None:
    """A state changed between its lookup and its copy into the slot (another
    thread; NumPy releases the GIL in large copies): the answer, computed
    from the bytes sent, is cached under those bytes' keys, not under the
    keys looked up."""
    m = CountingModel()
    with make_ev(m, cache_entries=64) as ev:
        check_answer(ev.evaluate(make_state(0)), 0)  # registers this process
        port, seg = ev._port, ev._seg
        c, k = port.c, port.free.pop()
        outs = [np.empty((1, 7), np.float32), np.empty((1,), np.float32)]
        looked_up = states([1])
        rows, k1, k2 = seg.cache_lookup(c, looked_up, None, outs, None)
        assert rows == [0]
        (gen,) = seg.post(c, [k], states([2]), 0, k1, k2, True)  # the bytes changed
        assert seg.wait(c, k, gen, 0, 10**10, 1) == _ring.DONE
        assert seg.fetch(c, k, gen, outs, 0) == 0
        port.free.append(k)
        n = sum(m.calls)
        check_answer(ev.evaluate(make_state(1)), 1)
        assert sum(m.calls) == n + 1  # a miss: nothing was cached under state 1
        check_answer(ev.evaluate(make_state(2)), 2)
        assert sum(m.calls) == n + 1  # a hit: cached under the bytes sent


def test_the_guide_quotes_the_entry_size_of_the_demo_net() -> None:
    """docs/guide.md, *The evaluation cache*: the demo net's entry size
    is what the core lays out."""
    import re
    from pathlib import Path

    from shmeval.bench.demo import INPUT_SHAPE, OUTPUTS

    guide = (Path(__file__).parents[2] / "docs" / "guide.md").read_text()
    quoted = re.search(r"One entry takes 32 bytes plus one result row.*?(\d+)\s+bytes for "
                       r"the demo's net", guide, re.S)
    assert quoted, "the guide no longer quotes the demo net's entry size"
    spec = Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 8, 1, 1)
    assert int(quoted.group(1)) == _ring.cache_entry_bytes(spec.out_bytes) == 72
