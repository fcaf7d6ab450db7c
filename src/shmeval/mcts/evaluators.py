"""``evaluate_batch`` functions for the search: one that sends each batch
through an shmeval client, and the null model; and the ``submit_batch``
functions of the pipelined search (:mod:`shmeval.mcts.pipelined`)."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Tuple

import numpy as np

from .steps import EvaluateBatch, SubmitBatch


class SupportsEvaluateMany(Protocol):
    """An shmeval ``Client``/``Evaluator`` handle, or anything with
    ``evaluate_many(states [n, ...]) -> {name: array [n, ...]}``."""

    def evaluate_many(self, states: Any, /) -> Mapping[str, np.ndarray]: ...


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return np.asarray(e / e.sum(axis=-1, keepdims=True))


def evaluator_fn(client: SupportsEvaluateMany, policy_key: str = "policy",
                 value_key: str = "value", *, logits: bool = False) -> EvaluateBatch:
    """An ``evaluate_batch`` that sends each batch through
    ``client.evaluate_many`` (one shmeval round trip per search step) and
    returns its ``policy_key`` and ``value_key`` outputs; ``logits=True``
    applies a softmax to the policy output first."""

    def evaluate_batch(states: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        out = client.evaluate_many(states)
        p = np.asarray(out[policy_key], dtype=np.float64)
        v = np.asarray(out[value_key]).reshape(len(states))
        return (_softmax(p) if logits else p), v

    return evaluate_batch


class SupportsSubmit(Protocol):
    """An shmeval ``Client``/``Evaluator`` handle, or anything with
    ``submit(states [n, ...])`` returning an object whose ``result()`` is
    ``{name: array [n, ...]}``."""

    def submit(self, states: Any, /) -> Any: ...


def submitter_fn(client: SupportsSubmit, policy_key: str = "policy", value_key: str = "value",
                 *, logits: bool = False) -> SubmitBatch:
    """A ``submit_batch`` over ``client.submit``: posts the batch at once
    (its states are copied into the client's slots) and returns the
    function that collects its ``policy_key`` and ``value_key`` outputs,
    as :func:`evaluator_fn` returns them.  A batch may hold at most the
    client's ``slots_per_client`` states."""

    def submit_batch(states: np.ndarray) -> Callable[[], Tuple[np.ndarray, np.ndarray]]:
        pending = client.submit(states)
        n = len(states)

        def collect() -> Tuple[np.ndarray, np.ndarray]:
            out = pending.result()
            p = np.asarray(out[policy_key], dtype=np.float64)
            v = np.asarray(out[value_key]).reshape(n)
            return (_softmax(p) if logits else p), v

        return collect

    return submit_batch


def as_submit(evaluate_batch: EvaluateBatch) -> SubmitBatch:
    """A ``submit_batch`` that evaluates at once with ``evaluate_batch``
    (no overlap: for evaluators that cannot pipeline, and tests)."""

    def submit_batch(states: np.ndarray) -> Callable[[], Tuple[Any, Any]]:
        out = evaluate_batch(states)
        return lambda: out

    return submit_batch


def uniform_model(n_actions: int) -> EvaluateBatch:
    """The null model: uniform policy, value 0."""

    def evaluate_batch(states: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        n = len(states)
        return np.full((n, n_actions), 1.0 / n_actions), np.zeros(n)

    return evaluate_batch
