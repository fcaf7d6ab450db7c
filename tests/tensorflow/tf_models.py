"""Small TensorFlow models for the backend tests, and the functions spawn
children run.  Importable without TensorFlow: it is imported only inside
the functions that build models, so a worker process that unpickles
``worker_report`` never loads it."""
from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from backend_contract import INPUT_SHAPE, random_states


def seeded_weights(model: Any, seed: int) -> None:
    """Replaces the model's weights by a fixed function of seed (the same in
    every process, whatever Keras' own initialisers do)."""
    rng = np.random.default_rng(seed)
    model.set_weights([rng.uniform(-0.3, 0.3, w.shape).astype(w.dtype)
                       for w in model.get_weights()])


def pv_net(seed: int = 0, outputs: str = "dict") -> Any:
    """A functional policy-value net: conv, flatten, a 7-way policy head and
    a Dense(1) tanh value head (shape (n, 1), served as a scalar).
    outputs: "dict" ({"policy", "value"}) or "list" ([value, policy], heads
    named by their layers)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    inp = keras.Input(INPUT_SHAPE)
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inp)
    h = keras.layers.Flatten()(h)
    policy = keras.layers.Dense(7, name="policy")(h)
    value = keras.layers.Dense(1, activation="tanh", name="value")(h)
    out = {"policy": policy, "value": value} if outputs == "dict" else [value, policy]
    model = keras.Model(inp, out)
    seeded_weights(model, seed)
    return model


def counting_module() -> Any:
    """A tf.Module whose call counts its calls in a variable (so it cannot
    be frozen) and returns (policy, value), unnamed."""
    import tensorflow as tf

    class Counting(tf.Module):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.calls = tf.Variable(0.0)
            self.w = tf.Variable(np.ones((84, 8), np.float32))

        @tf.function
        def __call__(self, x: Any) -> Any:
            self.calls.assign_add(1.0)
            y = tf.reshape(x, [-1, 84]) @ self.w
            return y[:, :7], y[:, 7] + self.calls

    return Counting()


def pv_factory() -> Any:
    """Evaluator.spawn factory: runs in the evaluator process only."""
    from shmeval.backends.tensorflow import TFModel

    return TFModel(pv_net(seed=0))


def worker_report(ev: Any, seed: int, conn: Any) -> None:
    """A spawn worker: evaluates random states one by one and as a batch,
    then reports the results and whether TensorFlow / Keras got loaded."""
    try:
        states = random_states(9, seed)
        singles = [ev.evaluate(s) for s in states]
        many = ev.evaluate_many(states)
        conn.send({
            "single_policy": np.stack([o["policy"] for o in singles]),
            "single_value": np.stack([o["value"] for o in singles]),
            "policy": many["policy"], "value": many["value"],
            "tensorflow": "tensorflow" in sys.modules, "keras": "keras" in sys.modules,
        })
    except BaseException as e:
        conn.send({"error": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


def checked_net() -> Any:
    """pv_net with a TensorFlow assertion inside: every state value must be
    at most 1 ("state out of range" otherwise)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    class RangeCheck(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            tf.debugging.assert_less_equal(x, 1.0, message="state out of range")
            return x

    inp = keras.Input(INPUT_SHAPE)
    h = keras.layers.Flatten()(RangeCheck()(inp))
    model = keras.Model(inp, {"policy": keras.layers.Dense(7)(h),
                              "value": keras.layers.Dense(1, activation="tanh")(h)})
    seeded_weights(model, 0)
    return model


def checked_factory() -> Any:
    from shmeval.backends.tensorflow import TFModel

    # Unfrozen: a function call's error carries the failing op's definition
    # stack, which the message must cut (a frozen graph's session error has none).
    return TFModel(checked_net(), freeze=False)
