"""evaluate_many through the process's port (ClientPort.evaluate_many,
docs/performance.md, *`evaluate_many` in a worker*): a batch is posted,
waited for and fetched in one Cython call, in rounds of the free slots; a
wait that outlasts a tick of the liveness check is judged
(ProcessEntry.judge) and goes on, the rows still in flight."""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

import shmeval
from helpers import INPUT_SHAPE, fake_model, make_ev, make_state

FAIL_TAG = 666
SLOW_S = 0.3  # longer than the clients' 100 ms tick: their waits hand over


def check_rows(out: dict[str, np.ndarray], tags: list[int]) -> None:
    t = np.array(tags, np.float32)
    assert out["policy"].shape == (len(tags), 7) and out["policy"].dtype == np.float32
    assert out["value"].shape == (len(tags),) and out["value"].dtype == np.float32
    np.testing.assert_array_equal(out["policy"], 2 * t[:, None] + np.arange(7, dtype=np.float32))
    np.testing.assert_array_equal(out["value"], -t)


def batch(tags: list[int]) -> np.ndarray:
    return np.stack([make_state(t) for t in tags])


def rows_in_slot_order(ev: Any) -> Any:
    """Makes the next rows take the lowest free slots in row order.  The
    evaluator scans a client's slots from the lowest index, so with
    max_batch=1 it then serves the rows in row order."""
    port = ev._port
    port.free[:] = sorted(port.free, reverse=True)
    return port


def fail_first_slow_rest(x: np.ndarray) -> dict[str, np.ndarray]:
    if (x[:, 0, 0, 0] == FAIL_TAG).any():
        raise RuntimeError("row 666 is refused")
    time.sleep(SLOW_S)
    return fake_model(x)


@pytest.mark.timeout(30)
def test_rows_answered_and_slots_returned() -> None:
    with make_ev(slots_per_client=8) as ev:
        ev.evaluate(make_state(0))  # registers this process: the port exists
        port = ev._port
        for tags in ([1], [2, 3, 4], list(range(10, 18))):
            check_rows(ev.evaluate_many(batch(tags)), tags)
            assert sorted(port.free) == list(range(8))
        out, versions = ev.evaluate_many(batch([5, 6]), return_version=True)
        check_rows(out, [5, 6])
        assert versions.dtype == np.int64 and versions.tolist() == [0, 0]
        # More rows than slots: the general path, in rounds.
        check_rows(ev.evaluate_many(batch(list(range(20)))), list(range(20)))
        assert sorted(port.free) == list(range(8))


@pytest.mark.timeout(30)
def test_failed_row_raises_and_frees_every_slot() -> None:
    def nan_for_fail_tag(x: np.ndarray) -> dict[str, np.ndarray]:
        out = fake_model(x)
        out["value"][x[:, 0, 0, 0] == FAIL_TAG] = np.nan
        return out

    with make_ev(nan_for_fail_tag, slots_per_client=8) as ev:
        ev.evaluate(make_state(0))
        port = ev._port
        with pytest.raises(shmeval.ModelError, match="non-finite|NaN|nan"):
            ev.evaluate_many(batch([1, FAIL_TAG, 2]))
        assert sorted(port.free) == list(range(8))
        check_rows(ev.evaluate_many(batch([3, 4])), [3, 4])


@pytest.mark.timeout(30)
def test_waits_longer_than_a_tick_hand_over() -> None:
    """Every row's batch takes longer than a tick: each wait is judged after
    a tick and goes on, and every row is answered."""
    with make_ev(lambda x: (time.sleep(SLOW_S), fake_model(x))[1], max_batch=1,
                 slots_per_client=8) as ev:
        ev.evaluate(make_state(0))
        port = rows_in_slot_order(ev)
        out, versions = ev.evaluate_many(batch([7, 8, 9]), return_version=True)
        check_rows(out, [7, 8, 9])
        assert versions.tolist() == [0, 0, 0]
        assert sorted(port.free) == list(range(8))


@pytest.mark.timeout(30)
def test_failed_row_before_a_hand_over_still_raises() -> None:
    """Row 0's batch fails at once; row 1's takes longer than a tick, so its
    wait is judged and goes on with row 0's error in hand: the call must
    raise it, not return row 0's unwritten outputs."""
    with make_ev(fail_first_slow_rest, max_batch=1, slots_per_client=8) as ev:
        check_rows(ev.evaluate_many(batch([1])), [1])  # registers this process
        port = rows_in_slot_order(ev)
        with pytest.raises(shmeval.ModelError, match="row 666 is refused"):
            ev.evaluate_many(batch([FAIL_TAG, 2]))
        assert sorted(port.free) == list(range(8))
        check_rows(ev.evaluate_many(batch([3])), [3])


@pytest.mark.timeout(30)
def test_other_inputs_take_the_general_path() -> None:
    """Inputs that need converting (another dtype, not contiguous, a list)
    are converted and answered the same."""
    with make_ev(slots_per_client=8) as ev:
        ev.evaluate(make_state(0))
        b = batch([1, 2, 3, 4])
        check_rows(ev.evaluate_many(b.astype(np.float64)), [1, 2, 3, 4])
        check_rows(ev.evaluate_many(b[::2]), [1, 3])
        check_rows(ev.evaluate_many([make_state(5).tolist()]), [5])
        with pytest.raises(ValueError):
            ev.evaluate_many(np.zeros((2,) + INPUT_SHAPE[1:], np.float32))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["evaluate_many", "submit"])
def test_a_failed_begin_leaves_every_slot_usable(call: str) -> None:
    """A post of several slots whose second begin fails raises, and gives
    back the slot it had begun as FREE: every later call of the process is
    served (a slot given back still WRITING failed every call that drew it,
    for ever)."""
    with make_ev(slots_per_client=4) as ev:
        ev.evaluate(make_state(0))
        port, seg = ev._port, ev._seg
        first, second = port.free[-1], port.free[-2]  # the next two pops
        gen = seg.begin(port.c, second)  # taken behind the client's back
        with pytest.raises(shmeval.SegmentError, match="not in the expected state"):
            if call == "submit":
                ev.submit(batch([1, 2])).result(timeout=10)
            else:
                ev.evaluate_many(batch([1, 2]))
        assert seg.abort(port.c, second, gen)
        assert sorted(port.free) == [0, 1, 2, 3]
        assert seg.slot_state(port.c, first)[0] == 0  # FREE
        for i in range(8):
            tags = [10 * i + j for j in range(4)]
            check_rows(ev.evaluate_many(batch(tags)), tags)
