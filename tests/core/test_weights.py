"""shmeval.weights.plain_weights: what Evaluator.set_weights and
ClusterEvaluator.set_weights send to the evaluator process, whatever the
framework handed out (the backends' tests push each through an evaluator)."""
from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest

from shmeval.weights import plain_weights


def test_the_structure_is_kept_with_arrays_at_the_leaves() -> None:
    Pair = collections.namedtuple("Pair", "a b")
    given: Any = {"conv": {"w": np.ones((1, 2), np.float32), "b": np.zeros(2)},
                  "pairs": (Pair(np.ones(1), 2.0), [np.float32(3)])}
    got = plain_weights(given)
    assert list(got) == ["conv", "pairs"] and isinstance(got["pairs"], tuple)
    assert isinstance(got["pairs"][0], Pair) and isinstance(got["pairs"][1], list)
    assert got["conv"]["w"].shape == (1, 2) and got["pairs"][0].b.shape == ()
    assert got["conv"]["b"] is given["conv"]["b"]  # no copy of an array
    keras = [np.ones((3, 3)), np.zeros(3)]
    assert all(a is b for a, b in zip(plain_weights(keras), keras))


@pytest.mark.parametrize("given, named", [
    (np.zeros(3), r"got a numpy.ndarray of shape \(3,\)"),
    (None, "got a NoneType"),
    ("weights.h5", "got a str"),
    ([object()], "a weight must be an array, got a object"),
])
def test_a_wrong_type_names_what_was_passed_and_what_is_expected(given: Any,
                                                                 named: str) -> None:
    with pytest.raises(TypeError, match=named) as ei:
        plain_weights(given)
    assert "state dict" in str(ei.value) and "get_weights()" in str(ei.value)
