"""A batch whose model call raises fails only the rows that raise: the
evaluator splits it and calls the model again on the parts (only after a
failure), answers every other row, and bounds the extra calls."""
from __future__ import annotations

import multiprocessing as mp
from typing import Any

import numpy as np
import pytest

import shmeval
from shmeval import serving
from helpers import INPUT_SHAPE, OUTPUTS, check_answer, expected, fake_model, make_ev, make_state

REQUESTS = 300
BAD = -1.0  # the first input value of a state the model rejects


class Rejected(Exception):
    pass


def picky_model(x: np.ndarray) -> dict[str, np.ndarray]:
    """fake_model, except that it raises for a batch holding a rejected state."""
    if (x[:, 0, 0, 1] == BAD).any():
        raise Rejected("picky_model rejects states marked bad")
    return fake_model(x)


def picky_factory() -> Any:
    return picky_model


def worker(ev: Any, w: int, bad: bool, results: Any) -> None:
    """REQUESTS evaluations, every other one of a rejected state when bad;
    reports (worker, right answers, wrong answers, ModelError texts of
    good states, ModelErrors of bad states)."""
    right = wrong = bad_failed = 0
    good_failed: list[str] = []
    for j in range(REQUESTS):
        tag = w * 1000 + j
        state = make_state(tag)
        rejected = bad and j % 2 == 0
        if rejected:
            state[0, 0, 1] = BAD
        try:
            out = ev.evaluate(state)
        except shmeval.ModelError as e:
            if rejected and "picky_model rejects" in e.message:
                bad_failed += 1
            else:
                good_failed.append(e.message)
            continue
        policy, value = expected(tag)
        ok = np.array_equal(out["policy"], policy) and float(out["value"]) == value
        right += ok and not rejected
        wrong += not ok or rejected
    results.put((w, right, wrong, good_failed[:3], len(good_failed), bad_failed))


def run_workers(ev: Any) -> dict[int, tuple[Any, ...]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(ev, w, w == 0, results)) for w in range(4)]
    for p in ps:
        p.start()
    try:
        got = {}
        for _ in ps:
            r = results.get(timeout=240)
            got[r[0]] = r[1:]
    finally:
        for p in ps:
            p.join(30)
            if p.is_alive():
                p.kill()
    return got


def check_outcome(got: dict[int, tuple[Any, ...]], ev: Any) -> None:
    for w in (1, 2, 3):
        right, wrong, texts, n_failed, _ = got[w]
        assert (right, wrong, n_failed) == (REQUESTS, 0, 0), (w, got[w])
    right, wrong, texts, n_failed, bad_failed = got[0]
    assert (right, wrong, n_failed, bad_failed) == (REQUESTS // 2, 0, 0, REQUESTS // 2), got[0]
    s = ev.stats()
    assert s["failed_requests"] == REQUESTS // 2
    assert s["isolated_rows"] <= REQUESTS // 2
    assert s["state"] == "serving"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kw", [dict(serving_threads=2, buckets="pow2"), dict()],
                         ids=["two-threads-buckets", "default"])
def test_a_rejected_state_fails_only_its_own_requests(kw: dict[str, Any]) -> None:
    """Four workers, one of which sends states the model rejects: the other
    three get every answer, right; the bad one gets ModelError with the
    model's message for each rejected state, and answers for the others."""
    with make_ev(picky_model, **kw) as ev:
        check_outcome(run_workers(ev), ev)


@pytest.mark.timeout(300)
def test_rows_are_isolated_in_replicas() -> None:
    """The same with two evaluator processes serving one address."""
    with shmeval.Evaluator.spawn(picky_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                 max_batch=32, max_clients=8, slots_per_client=8,
                                 replicas=2, start_timeout=120) as ev:
        check_outcome(run_workers(ev), ev)


@pytest.mark.timeout(60)
def test_extra_calls_are_padded_to_a_bucket() -> None:
    """Two rejected rows among 13 of one batch: the extra calls have bucket
    sizes (padded with the part's own rows), and only those two fail."""
    sizes: list[int] = []

    def model(x: np.ndarray) -> dict[str, np.ndarray]:
        sizes.append(len(x))
        return picky_model(x)

    # max_wait_us: the 13 rows of the call make one batch.
    with make_ev(model, buckets=[4, 8, 16], max_batch=16, slots_per_client=16,
                 max_wait_us=200_000) as ev:
        states = np.stack([make_state(t) for t in range(13)])
        states[[2, 9], 0, 0, 1] = BAD
        with pytest.raises(shmeval.ModelError, match="picky_model rejects"):
            ev.evaluate_many(states)
        s = ev.stats()
        assert (s["requests"], s["batches"], s["failed_requests"]) == (13, 1, 2), s
        assert s["isolated_rows"] == 2 and s["failed_batches"] == 0
        assert s["isolation_calls"] == len(sizes) - 1
        assert set(sizes) <= {4, 8, 16}, sizes
        check_answer(ev.evaluate(make_state(5)), 5)


def always_raises(x: np.ndarray) -> Any:
    raise Rejected("every batch")


@pytest.mark.timeout(60)
def test_a_model_that_always_raises_stops_being_isolated(monkeypatch: Any) -> None:
    """After ISOLATE_GIVE_UP batches where no row could be answered, failed
    batches fail whole, without extra calls, until the pause ends."""
    monkeypatch.setattr(serving, "ISOLATE_PAUSE_NS", 10**15)
    with make_ev(always_raises, max_batch=16, slots_per_client=16, max_wait_us=2_000_000) as ev:
        for _ in range(8):
            with pytest.raises(shmeval.ModelError, match="every batch"):
                ev.evaluate_many(np.stack([make_state(t) for t in range(16)]))
        s = ev.stats()
        # 16 rows that all raise: 2 + 4 + 8 + 16 calls to isolate each row.
        assert s["isolation_calls"] == serving.ISOLATE_GIVE_UP * 30, s
        assert s["isolated_rows"] == serving.ISOLATE_GIVE_UP * 16
        assert s["failed_requests"] == 8 * 16 and s["failed_batches"] == 8


def nan_for_bad(x: np.ndarray) -> dict[str, np.ndarray]:
    """fake_model, with a NaN value for the rows of rejected states."""
    out = fake_model(x)
    out["value"][x[:, 0, 0, 1] == BAD] = np.nan
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model", [picky_model, nan_for_bad], ids=["raises", "nan"])
def test_evaluate_many_with_one_failed_row(model: Any) -> None:
    """What the guide says (*Errors*): evaluate_many with one failed row
    raises that row's ModelError and returns nothing, while the evaluator
    answered the call's other rows (counted, and only one failed)."""
    with make_ev(model, max_batch=16, slots_per_client=16, max_wait_us=200_000) as ev:
        states = np.stack([make_state(t) for t in range(6)])
        states[4, 0, 0, 1] = BAD
        with pytest.raises(shmeval.ModelError, match="picky_model rejects|NaN"):
            ev.evaluate_many(states)
        s = ev.stats()
        assert (s["requests"], s["failed_requests"]) == (6, 1), s
        check_answer(ev.evaluate(states[3]), 3)
