"""A TensorFlow error inside the net reaches the worker with its cause: the
error's type and message first, the stack of the failing op's definition
(which TensorFlow writes before the cause) cut, not the cause."""
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
