"""TFModel's "auto" defaults: freeze, thread pools, calls in flight.

- freeze="auto" serves frozen graphs after prepare (for a net where
  folding saves time); a weight update is assigned at once and served
  unfrozen, with the new weights; the weights are folded again once the
  calls since the update have lost what a fold costs, and not before;
- a model that cannot be frozen is served unfrozen, without an error;
- max_concurrency says two calls may overlap; bad values are refused.
The fold's cost and the saving per call are set by the tests where a
decision depends on them, so nothing here depends on timing.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import shmeval
from backend_contract import INPUT_SHAPE, OUTPUTS, module_fixture, random_states
from shmeval.spec import Spec
from tf_models import counting_module, pv_net

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
pytestmark = [pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")]


backend = module_fixture("shmeval.backends.tensorflow")


def prepared(backend: Any, model: Any, **kw: Any) -> Any:
    tm = backend.TFModel(model, **kw)
    tm.prepare(Spec.build(INPUT_SHAPE, "float32", OUTPUTS, 16, 1, 1), None)
    return tm


def serving_frozen(tm: Any, backend: Any) -> bool:
    return isinstance(tm._general, backend.FrozenGraph)


def direct(m: Any, x: np.ndarray) -> np.ndarray:
    return np.asarray(m(x, training=False)["policy"])


def test_updates_are_served_at_once_and_folded_when_it_pays(backend: Any) -> None:
    m = pv_net(1)
    tm = prepared(backend, m)
    assert tm.auto_freeze and serving_frozen(tm, backend)
    x = random_states(4, 0)
    new = [w * 1.5 for w in m.get_weights()]
    tm.set_weights(new)
    assert not serving_frozen(tm, backend)     # no fold in set_weights
    # Each call loses a stated 1 ms against a frozen one; a fold costs 3 ms
    # (stated: the measured figures depend on the machine's load).
    tm._fold.saving, tm._fold.cost_ns = (1_000_000.0, 0.0), 3_000_000
    np.testing.assert_allclose(tm(x)["policy"], direct(m, x), rtol=1e-5, atol=1e-6)
    tm(x)
    assert not serving_frozen(tm, backend)     # 2 ms lost: not yet
    tm(x)                                      # 3 ms: this call folds
    assert serving_frozen(tm, backend)
    np.testing.assert_allclose(tm(x)["policy"], direct(m, x), rtol=1e-5, atol=1e-6)


def test_frequent_updates_are_never_folded(backend: Any) -> None:
    m = pv_net(2)
    tm = prepared(backend, m)
    tm._fold.saving = (1_000.0, 0.0)
    weights = m.get_weights()
    x = random_states(2, 1)
    for k in range(5):
        tm._fold.cost_ns = 10**12   # whatever a fold costs, 10 calls between updates lose less
        tm.set_weights([w * (1 + 0.1 * k) for w in weights])
        for _ in range(10):
            out = tm(x)
        assert not serving_frozen(tm, backend)
        np.testing.assert_allclose(out["policy"], direct(m, x), rtol=1e-5, atol=1e-6)


def test_a_model_that_cannot_be_frozen_is_served_as_it_is(backend: Any) -> None:
    with shmeval.Evaluator(backend.TFModel(counting_module()), input_shape=INPUT_SHAPE,
                           outputs=OUTPUTS, max_batch=8) as ev:
        assert ev.evaluate(np.zeros(INPUT_SHAPE, np.float32))["policy"].shape == (7,)


def test_two_calls_may_overlap_and_bad_values_are_refused(backend: Any) -> None:
    assert backend.TFModel.max_concurrency == 2
    with pytest.raises(ValueError, match="freeze"):
        backend.TFModel(pv_net(1), freeze="sometimes")
    with pytest.raises(ValueError, match="intra_op_threads"):
        backend.TFModel(pv_net(1), intra_op_threads="many")
