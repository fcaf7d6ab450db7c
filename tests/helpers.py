"""Fake model and states shared by the tests (importable by spawn children)."""
from __future__ import annotations

from typing import Callable

import numpy as np

INPUT_SHAPE = (6, 7, 2)
OUTPUTS = {"policy": ((7,), "float32"), "value": ((), "float32")}


def fake_model(x: np.ndarray) -> dict[str, np.ndarray]:
    """Deterministic function of each row: policy[k] = 2*x[0,k,0] + k,
    value = x[5,6,1].  Exact in float32 for the integers the tests use."""
    return {"policy": x[:, 0, :, 0] * 2 + np.arange(7, dtype=np.float32),
            "value": x[:, 5, 6, 1].copy()}


def fake_factory() -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    return fake_model


def make_state(tag: int) -> np.ndarray:
    """A state whose fake-model result identifies tag."""
    s = np.zeros(INPUT_SHAPE, np.float32)
    s[0, :, 0] = tag
    s[5, 6, 1] = -tag
    return s


def expected(tag: int) -> tuple[np.ndarray, float]:
    return np.full(7, 2.0 * tag, np.float32) + np.arange(7, dtype=np.float32), float(-tag)
