"""``evaluate_batch`` functions for the search: one that sends each batch
through an shmeval client, and the null model."""
from __future__ import annotations

from typing import Any, Mapping, Protocol, Tuple

import numpy as np

from .search import EvaluateBatch


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


def uniform_model(n_actions: int) -> EvaluateBatch:
    """The null model: uniform policy, value 0."""

    def evaluate_batch(states: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        n = len(states)
        return np.full((n, n_actions), 1.0 / n_actions), np.zeros(n)

    return evaluate_batch
