"""evaluate() reuses the previous result's dict and arrays only when the
caller kept no reference to them (docs/performance.md, *A null-model round trip*)."""
from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import pytest

from helpers import check_answer, make_ev, make_state, run_threads


@pytest.mark.timeout(30)
def test_dropped_result_is_reused() -> None:
    """The optimisation is in effect: a dropped result's dict comes back."""
    with make_ev() as ev:
        ev.evaluate(make_state(0))  # the first call registers this process
        first_id = id(ev.evaluate(make_state(1)))
        out = ev.evaluate(make_state(2))
        assert id(out) == first_id
        check_answer(out, 2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("keep", ["dict", "array", "view", "memoryview", "scalar"])
def test_kept_results_are_never_overwritten(keep: str) -> None:
    with make_ev() as ev:
        ev.evaluate(make_state(0))  # registers; later results take the fast path
        ev.evaluate(make_state(0))
        out = ev.evaluate(make_state(1))
        held: Any = {"dict": out, "array": out["policy"], "view": out["policy"][2:5],
                     "memoryview": memoryview(out["policy"]), "scalar": out["value"]}[keep]
        snapshot = np.array(held, copy=True)
        del out
        for tag in range(2, 6):
            check_answer(ev.evaluate(make_state(tag)), tag)
        if keep == "dict":
            check_answer(held, 1)
        else:
            np.testing.assert_array_equal(np.asarray(held), snapshot)


@pytest.mark.timeout(30)
def test_changed_results_are_not_reused() -> None:
    """A dropped result that the caller changed is not handed back changed."""
    with make_ev() as ev:
        ev.evaluate(make_state(0))  # registers; later results take the fast path
        ev.evaluate(make_state(0))
        out = ev.evaluate(make_state(1))
        out["extra"] = 1
        del out
        out = ev.evaluate(make_state(2))
        assert set(out) == {"policy", "value"}
        out["policy"].shape = (7, 1)
        del out
        check_answer(ev.evaluate(make_state(3)), 3)
        out = ev.evaluate(make_state(4))
        out["value"] = np.float32(0)
        del out
        check_answer(ev.evaluate(make_state(5)), 5)


@pytest.mark.timeout(60)
def test_threads_never_share_a_result() -> None:
    """Threads of one process each get their own result objects: a thread
    holds its answer across a GIL release while the others keep evaluating,
    and the answer must not change under it."""
    errors: list[str] = []
    with make_ev(slots_per_client=8) as ev:
        ev.evaluate(make_state(0))

        def run(t: int) -> None:
            rng = random.Random(t)
            for j in range(400):
                tag = t * 1000 + j
                out = ev.evaluate(make_state(tag))
                time.sleep(rng.random() * 1e-4)  # others run meanwhile
                if float(out["value"]) != -tag:
                    errors.append(f"{tag}: {out}")
                del out

        run_threads(run, 6, 30)
    assert not errors, errors[:3]


@pytest.mark.timeout(30)
def test_loop_holding_the_last_result_reuses_the_one_before() -> None:
    """`out = ev.evaluate(s)` in a loop holds the last result during the
    next call: the port then reuses the one before, so two objects
    alternate; every answer is right when it is returned."""
    with make_ev() as ev:
        ev.evaluate(make_state(0))  # registers; later results take the fast path
        out = ev.evaluate(make_state(1))
        ids = set()
        for tag in range(2, 12):
            out = ev.evaluate(make_state(tag))
            check_answer(out, tag)
            ids.add(id(out))
        assert len(ids) == 2


@pytest.mark.timeout(30)
def test_results_kept_in_a_list_are_never_overwritten() -> None:
    """Keeping every result (as a search tree keeps its priors): neither
    cached result is ever free, so every call allocates, and each kept
    result still holds its own answer at the end."""
    with make_ev() as ev:
        ev.evaluate(make_state(0))
        kept = [ev.evaluate(make_state(tag)) for tag in range(1, 20)]
        assert len({id(r) for r in kept}) == len(kept)
        for tag, r in zip(range(1, 20), kept):
            check_answer(r, tag)


def twin_model(x: np.ndarray) -> dict[str, np.ndarray]:
    """Two outputs of one dtype and shape: a = the state's tag, b = -tag."""
    return {"a": x[:, 0, :3, 0].copy(), "b": -x[:, 0, :3, 0]}


def swap(out: dict[str, np.ndarray]) -> None:
    out["a"], out["b"] = out["b"], out["a"]


def reinsert(out: dict[str, np.ndarray]) -> None:
    out["a"] = out.pop("a")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("change", [swap, reinsert])
def test_rearranged_results_come_back_under_their_names(change: Any) -> None:
    """A dropped result whose arrays the caller moved between names (each
    still referenced once by the dict, of the same dtype and shape) is
    never handed back with an answer under another output's name."""
    twins = {"a": ((3,), "float32"), "b": ((3,), "float32")}
    with make_ev(twin_model, outputs=twins) as ev:
        ev.evaluate(make_state(0))  # registers; later results take the fast path
        ev.evaluate(make_state(0))
        for tag in range(1, 6):
            out = ev.evaluate(make_state(tag))
            change(out)
            del out
            out = ev.evaluate(make_state(tag + 10))
            np.testing.assert_array_equal(out["a"], np.full(3, tag + 10, np.float32))
            np.testing.assert_array_equal(out["b"], np.full(3, -(tag + 10), np.float32))
            del out
