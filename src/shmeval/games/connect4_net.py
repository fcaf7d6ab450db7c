"""The self-play demo's default Connect Four policy-value network: a small
residual convolutional net built in code with Keras (nothing downloaded).

Input ``(6, 7, 2)`` float32 (:func:`shmeval.games.connect4.encode`), outputs
``{"policy": (n, 7) softmax probabilities, "value": (n, 1) tanh}``.  Compiled
for AlphaZero-style training: categorical cross-entropy of the policy against
the search's visit-count distribution, mean squared error of the value
against the game's outcome, a little L2 on the kernels, Adam.

This module imports TensorFlow and Keras only inside its functions, so a
process may import it (for :class:`NetConfig`) without loading either.  The
weights are set from NumPy with a seed (:func:`seeded_weights`), so every
process that builds the net with the same config and seed holds exactly the
same weights, whatever Keras' own initialisers would draw.
"""
from __future__ import annotations

import math
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .connect4 import INPUT_SHAPE, N_ACTIONS

#: Lines TensorFlow writes to stderr at import whatever TF_CPP_MIN_LOG_LEVEL says.
_TF_BANNER = ("All log messages before absl::InitializeLog()", "oneDNN custom operations are on",
              "cpu_feature_guard", "To enable the following instructions",
              "This TensorFlow binary is optimized")


@dataclass(frozen=True)
class NetConfig:
    """Shape of the residual net and its optimiser settings."""

    blocks: int = 2
    filters: int = 32
    value_hidden: int = 32
    l2: float = 1e-4
    learning_rate: float = 1e-3
    bn_momentum: float = 0.9


def import_tensorflow(threads: Optional[int] = None) -> Any:
    """Imports TensorFlow and Keras without their start-up banner and, when
    ``threads`` is given (> 0), sizes TensorFlow's intra- and inter-op CPU
    thread pools (only possible before TensorFlow initialises).  Returns the
    ``tensorflow`` module."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "tensorflow" not in sys.modules:
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile("w+b") as log:
            os.dup2(log.fileno(), 2)
            try:
                import tensorflow  # noqa: F401
                import keras  # noqa: F401
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                log.seek(0)
                for line in log.read().decode(errors="replace").splitlines(keepends=True):
                    if line.strip() and not any(b in line for b in _TF_BANNER):
                        sys.stderr.write(line)
    import tensorflow as tf
    if threads:
        for setter in (tf.config.threading.set_intra_op_parallelism_threads,
                       tf.config.threading.set_inter_op_parallelism_threads):
            try:
                setter(int(threads))
            except RuntimeError:  # already initialised; keep what is in force
                pass
    return tf


def seeded_weights(model: Any, seed: int) -> None:
    """Sets every weight of ``model`` from a NumPy generator seeded with
    ``seed`` and the weight's position: conv and dense kernels He-normal
    (the two output layers scaled down so that the first policy is not far
    from uniform and the first values stay near 0), biases and batch-norm
    shifts and means 0, batch-norm scales and variances 1."""
    arrays = []
    for i, v in enumerate(model.weights):
        shape = tuple(int(d) for d in v.shape)
        dtype = np.dtype(getattr(v.dtype, "as_numpy_dtype", v.dtype))
        name = str(getattr(v, "path", v.name))
        leaf = name.rsplit("/", 1)[-1]
        if leaf == "kernel":
            rng = np.random.default_rng([seed, i])
            fan_in = math.prod(shape[:-1])
            scale = math.sqrt(2.0 / fan_in)
            if name.startswith(("policy/", "value/")):
                scale *= 0.1
            a = rng.standard_normal(shape) * scale
        elif leaf in ("gamma", "moving_variance"):
            a = np.ones(shape)
        else:  # bias, beta, moving_mean
            a = np.zeros(shape)
        arrays.append(a.astype(dtype))
    model.set_weights(arrays)


def build_resnet(config: NetConfig = NetConfig(), seed: int = 0, compile: bool = True) -> Any:
    """The policy-value net as a Keras functional model (see the module
    docstring), its weights set by :func:`seeded_weights` with ``seed``;
    compiled for training when ``compile``."""
    import_tensorflow()
    import keras

    L = keras.layers
    reg = keras.regularizers.L2(config.l2) if config.l2 > 0 else None

    def conv_bn(h: Any, filters: int, size: int, name: str) -> Any:
        h = L.Conv2D(filters, size, padding="same", use_bias=False, kernel_regularizer=reg,
                     name=f"{name}_conv")(h)
        return L.BatchNormalization(momentum=config.bn_momentum, name=f"{name}_bn")(h)

    x = keras.Input(INPUT_SHAPE, dtype="float32", name="state")
    h = L.ReLU(name="stem_relu")(conv_bn(x, config.filters, 3, "stem"))
    for b in range(config.blocks):
        y = L.ReLU(name=f"block{b}_relu1")(conv_bn(h, config.filters, 3, f"block{b}_a"))
        y = conv_bn(y, config.filters, 3, f"block{b}_b")
        h = L.ReLU(name=f"block{b}_relu2")(L.Add(name=f"block{b}_add")([h, y]))
    p = L.ReLU(name="policy_head_relu")(conv_bn(h, 2, 1, "policy_head"))
    p = L.Dense(N_ACTIONS, activation="softmax", kernel_regularizer=reg,
                name="policy")(L.Flatten(name="policy_flatten")(p))
    v = L.ReLU(name="value_head_relu")(conv_bn(h, 1, 1, "value_head"))
    v = L.Dense(config.value_hidden, activation="relu", kernel_regularizer=reg,
                name="value_hidden")(L.Flatten(name="value_flatten")(v))
    v = L.Dense(1, activation="tanh", kernel_regularizer=reg, name="value")(v)
    model = keras.Model(x, {"policy": p, "value": v}, name="connect4_resnet")
    seeded_weights(model, seed)
    if compile:
        model.compile(optimizer=keras.optimizers.Adam(config.learning_rate),
                      loss={"policy": keras.losses.CategoricalCrossentropy(),
                            "value": keras.losses.MeanSquaredError()})
    return model


__all__ = ["NetConfig", "build_resnet", "seeded_weights", "import_tensorflow"]
