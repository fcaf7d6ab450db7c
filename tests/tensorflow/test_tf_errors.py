"""A TensorFlow error inside the net reaches the worker with its cause: the
error's type and message first, the stack of the failing op's definition
(which TensorFlow writes before the cause) cut, not the cause.  An
InternalError is told apart as a lost device, which ends the serving
process instead."""
from __future__ import annotations

import numpy as np
import pytest

import shmeval
from backend_contract import INPUT_SHAPE, OUTPUTS
from tf_models import checked_factory


@pytest.mark.timeout(240)
def test_an_assertion_in_the_net_reaches_the_worker_whole() -> None:
    with shmeval.Evaluator.spawn(checked_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                 max_batch=8, max_clients=4, slots_per_client=4) as ev:
        good = np.zeros(INPUT_SHAPE, np.float32)
        assert set(ev.evaluate(good)) == {"policy", "value"}
        with pytest.raises(shmeval.ModelError) as ei:
            ev.evaluate(np.full(INPUT_SHAPE, 5.0, np.float32))
        text = str(ei.value)
        assert text.startswith("InvalidArgumentError: "), text
        assert "assertion failed: [state out of range]" in text, text
        assert "stack frames cut" in text, text
        # The evaluator keeps serving.
        assert set(ev.evaluate(good)) == {"policy", "value"}


def test_device_errors_are_told_apart() -> None:
    """TensorFlow's own error types: InternalError (and a CUDA error of the
    sticky kind in any type's message) ends the serving process; an op's
    InvalidArgumentError or ResourceExhaustedError fails its batch."""
    import tensorflow as tf

    from shmeval.backends._fatal import device_lost

    assert device_lost(tf.errors.InternalError(None, None, "Failed to launch the kernel"))
    assert device_lost(tf.errors.UnknownError(
        None, None, "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered"))
    assert not device_lost(tf.errors.ResourceExhaustedError(
        None, None, "OOM when allocating tensor with shape[8,64,6,7]"))
    with pytest.raises(tf.errors.InvalidArgumentError) as ei:
        tf.debugging.assert_less(tf.constant(5.0), 1.0, message="state out of range")
    assert not device_lost(ei.value)
