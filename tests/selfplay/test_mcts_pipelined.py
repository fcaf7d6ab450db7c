"""The pipelined search (shmeval.mcts.pipelined): searches written as steps,
interleaved so that the leaves of all but one are in flight; play_games in
K groups, on a fake submitter and through a real evaluator."""
from __future__ import annotations

from typing import Any, Callable, List, Tuple

import numpy as np
import pytest

from shmeval import mcts
from shmeval.games import connect4 as c4


def uniform(x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    n = len(x)
    return np.full((n, 7), 1 / 7), np.zeros(n)


class LoggingSubmitter:
    """A submit_batch that answers with the uniform model and logs every
    submit and collect with the number of batches in flight then."""

    def __init__(self) -> None:
        self.log: List[Tuple[str, int]] = []
        self.in_flight = 0
        self.sizes: List[int] = []

    def __call__(self, states: np.ndarray) -> Callable[[], Tuple[Any, Any]]:
        out = uniform(states.copy())
        self.in_flight += 1
        self.sizes.append(len(states))
        self.log.append(("submit", self.in_flight))

        def collect() -> Tuple[Any, Any]:
            self.log.append(("collect", self.in_flight))
            self.in_flight -= 1
            return out

        return collect


def check_records(records: List[mcts.GameRecord[Any]]) -> None:
    for rec in records:
        assert rec.final_state is not None and c4.is_terminal(rec.final_state)
        assert rec.final_state == c4.from_moves(rec.moves)
        assert len(rec.samples) == len(rec.moves)


def test_search_steps_is_search() -> None:
    """search() drives search_steps: the same counts from the same seed."""
    roots = [c4.initial(), c4.from_moves([3, 3]), c4.from_moves([0, 6, 1])]
    a = mcts.MCTS(c4, uniform)
    b = mcts.MCTS(c4, uniform)
    ca = a.search([a.new_tree(r) for r in roots], 40, np.random.default_rng(1), noise=True)
    steps = b.search_steps([b.new_tree(r) for r in roots], 40, np.random.default_rng(1),
                           noise=True)
    cb = mcts.drive(steps, uniform)
    np.testing.assert_array_equal(ca, cb)
    assert (a.calls, a.evaluated) == (b.calls, b.evaluated)


@pytest.mark.parametrize("k", [2, 3])
def test_all_but_one_in_flight(k: int) -> None:
    """Every collect happens with the other searches' batches in flight."""
    sub = LoggingSubmitter()
    ms = [mcts.MCTS(c4, uniform) for _ in range(k)]
    searches = [x.search_steps([x.new_tree(c4.from_moves([g]))], 20)
                for g, x in enumerate(ms)]
    counts = mcts.run_pipelined(searches, sub)
    assert [c.sum() for c in counts] == [20] * k
    collects = [n for what, n in sub.log if what == "collect"]
    # k in flight at each collect until the searches start to finish
    assert collects[: len(collects) - k] == [k] * (len(collects) - k)
    assert sub.in_flight == 0


@pytest.mark.parametrize("k", [1, 2, 4])
def test_play_games_in_groups(k: int) -> None:
    sub = LoggingSubmitter()
    m = mcts.MCTS(c4, uniform)
    records = m.play_games(10, 12, np.random.default_rng(k), temperature_moves=4, pipeline=k,
                           submit_batch=sub, concurrent=8)
    assert len(records) == 10
    check_records(records)
    if k > 1:
        assert max(sub.sizes) <= -(-8 // k)  # a group's share of the games in play
        assert m.evaluated == sum(sub.sizes) and m.calls == len(sub.sizes)


def test_pipeline_arguments() -> None:
    m = mcts.MCTS(c4, uniform)
    with pytest.raises(ValueError, match="submit_batch"):
        m.play_games(2, 4, np.random.default_rng(0), pipeline=2)
    with pytest.raises(ValueError, match="pipeline"):
        m.play_games(2, 4, np.random.default_rng(0), pipeline=0)
    records = m.play_games(3, 4, np.random.default_rng(0), pipeline=2,
                           submit_batch=mcts.as_submit(uniform))
    check_records(records)


def test_evaluation_error_ends_the_run() -> None:
    calls = []

    def submit(states: np.ndarray) -> Callable[[], Tuple[Any, Any]]:
        calls.append(len(states))

        def collect() -> Tuple[Any, Any]:
            if len(calls) > 5:
                raise RuntimeError("evaluator gone")
            return uniform(states)

        return collect

    ms = [mcts.MCTS(c4, uniform) for _ in range(3)]
    with pytest.raises(RuntimeError, match="evaluator gone"):
        mcts.run_pipelined([x.search_steps([x.new_tree(c4.initial())], 50) for x in ms],
                           submit)


@pytest.mark.timeout(120)
def test_play_games_through_an_shmeval_evaluator() -> None:
    """Two groups through Client.submit on a real evaluator (thread mode)."""
    import shmeval
    from shmeval.bench.demo import OUTPUTS, TinyNet

    with shmeval.Evaluator(TinyNet(), input_shape=c4.INPUT_SHAPE, outputs=OUTPUTS,
                           max_batch=64, slots_per_client=16) as ev:
        m = mcts.MCTS(c4, mcts.evaluator_fn(ev))
        records = m.play_games(8, 16, np.random.default_rng(7), pipeline=2,
                               submit_batch=mcts.submitter_fn(ev))
        check_records(records)
        assert ev.stats()["requests"] == m.evaluated
        port = ev._port
        assert port is not None and len(port.free) == 16


@pytest.mark.parametrize("logits", [False, True])
def test_submitter_fn_adapter(logits: bool) -> None:
    class FakePending:
        def __init__(self, n: int) -> None:
            self.n = n

        def result(self) -> dict[str, np.ndarray]:
            return {"pi": np.tile(np.arange(7, dtype=np.float32), (self.n, 1)),
                    "v": np.full((self.n, 1), 0.25, np.float32)}

    class FakeClient:
        def submit(self, states: np.ndarray) -> FakePending:
            return FakePending(len(states))

    collect = mcts.submitter_fn(FakeClient(), "pi", "v", logits=logits)(
        np.zeros((3, 6, 7, 2), np.float32))
    p, v = collect()
    assert p.shape == (3, 7) and v.shape == (3,) and (v == 0.25).all()
    expected = np.exp(np.arange(7)) / np.exp(np.arange(7)).sum() if logits else np.arange(7)
    np.testing.assert_allclose(p[0], expected, rtol=1e-6)
