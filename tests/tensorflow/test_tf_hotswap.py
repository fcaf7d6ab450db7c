"""Weight hot-swap with a real TensorFlow model under load.

The contract's hot_swap_under_load: a spawned evaluator serves
tf_models.pv_net through TFModel; spawn workers (which never import
TensorFlow or Keras) evaluate a fixed set of states in a loop while the
test pushes 12 sets of weights.  Every answer must equal the Keras model
called directly with the weights of the version stamped on it, and no
worker may see versions go backwards.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from backend_contract import hot_swap_under_load
from tf_models import pv_factory, pv_net, seeded_weights

UPDATES = 12


@pytest.mark.timeout(240)
def test_tf_hot_swap_under_load() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Version v's weights are seeded_weights(v); version 0 is what pv_factory
    # builds: pv_net(seed=0).
    model = pv_net(seed=0)
    weights = []
    for v in range(UPDATES + 1):
        seeded_weights(model, v)
        weights.append(model.get_weights())

    def reference(v: int, states: np.ndarray) -> dict[str, np.ndarray]:
        """The Keras model called directly with version v's weights."""
        model.set_weights(weights[v])
        out = model(states, training=False)
        return {"policy": np.asarray(out["policy"]),
                "value": np.asarray(out["value"]).reshape(len(states))}

    hot_swap_under_load(pv_factory, weights, reference)
