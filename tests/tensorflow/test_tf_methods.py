"""TFModel with named inputs and several methods, called as the evaluator
calls it (``prepare(spec, buckets)``, then ``model(batch)`` or
``model.<method>(inputs)``).

- a MuZero-style net (``initial(observation)`` -> hidden, policy, value;
  ``recurrent(hidden, action)`` -> hidden, reward, policy, value) served
  as two methods of one set of weights, for each kind of model that has
  such functions: a ``tf.Module`` with two ``tf.function``s, a subclassed
  Keras model with two methods, a SavedModel of the module (its restored
  functions, and its signatures), frozen, unfrozen and "auto", with XLA
  per bucket: every method traced for every bucket at prepare, each
  answering as the model's own function called directly;
- one weight update changes both methods (folded again with freeze);
- a two-input Keras net (planes and a legal-move mask), as built and as
  exported, as one method with named inputs; bad batches are refused
  naming the input;
- a declared output that does not fit, an input the model lacks and a
  declared method the model lacks fail at prepare, naming the method and
  the output; bad ``methods=`` fail at TFModel().

TensorFlow is imported by fixtures, not at module import (see
test_tf_backend).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import shmeval
from backend_contract import F32, INPUT_SHAPE, module_fixture, random_states
from shmeval.spec import Method, Spec

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
pytestmark = [pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")]

tf = module_fixture("tensorflow")
keras = module_fixture("keras")
backend = module_fixture("shmeval.backends.tensorflow")

HIDDEN = 8
ACTIONS = 7
MAX_BATCH = 8
BUCKETS = (1, 3, 8)

INITIAL = Method(inputs={"observation": (INPUT_SHAPE, F32)},
                 outputs={"hidden": ((HIDDEN,), F32), "policy": ((ACTIONS,), F32),
                          "value": ((), F32)})
RECURRENT = Method(inputs={"hidden": ((HIDDEN,), F32), "action": ((), "int32")},
                   outputs={"hidden": ((HIDDEN,), F32), "reward": ((), F32),
                            "policy": ((ACTIONS,), F32), "value": ((), F32)})
METHOD_NAMES = {"initial": "initial_inference", "recurrent": "recurrent_inference"}


def muzero_spec(**changes: Method) -> Spec:
    methods = {"initial": INITIAL, "recurrent": RECURRENT, **changes}
    return Spec.build(None, None, None, MAX_BATCH, 1, 1, methods=methods)


def initial_inputs(rows: int, seed: int) -> dict[str, np.ndarray]:
    return {"observation": random_states(rows, seed)}


def recurrent_inputs(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"hidden": rng.uniform(-1, 1, (rows, HIDDEN)).astype(np.float32),
            "action": rng.integers(0, ACTIONS, rows).astype(np.int32)}


INPUTS = {"initial": initial_inputs, "recurrent": recurrent_inputs}


def muzero_module(tf: Any, seed: int) -> Any:
    """A tf.Module: initial_inference returns a dict (value (n, 1)),
    recurrent_inference a tuple (hidden, reward, policy, value), unnamed."""
    spec = {"initial": [{"observation": tf.TensorSpec([None, *INPUT_SHAPE], tf.float32)}],
            "recurrent": [{"hidden": tf.TensorSpec([None, HIDDEN], tf.float32),
                           "action": tf.TensorSpec([None], tf.int32)}]}

    class MuZero(tf.Module):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            rng = np.random.default_rng(seed)
            for name, (n_in, n_out) in {"represent": (84, HIDDEN),
                                        "dynamics": (HIDDEN + ACTIONS, HIDDEN),
                                        "reward": (HIDDEN, 1), "policy": (HIDDEN, ACTIONS),
                                        "value": (HIDDEN, 1)}.items():
                setattr(self, name + "_w", tf.Variable(
                    rng.uniform(-0.4, 0.4, (n_in, n_out)).astype(np.float32)))
                setattr(self, name + "_b", tf.Variable(
                    rng.uniform(-0.4, 0.4, (n_out,)).astype(np.float32)))

        def predict(self, h: Any) -> tuple[Any, Any]:
            return (h @ self.policy_w + self.policy_b,
                    tf.tanh(h @ self.value_w + self.value_b))

        @tf.function(input_signature=spec["initial"])
        def initial_inference(self, inputs: Any) -> Any:
            obs = tf.reshape(inputs["observation"], [-1, 84])
            h = tf.tanh(obs @ self.represent_w + self.represent_b)
            p, v = self.predict(h)
            return {"hidden": h, "policy": p, "value": v}

        @tf.function(input_signature=spec["recurrent"])
        def recurrent_inference(self, inputs: Any) -> Any:
            a = tf.one_hot(inputs["action"], ACTIONS)
            h = tf.tanh(tf.concat([inputs["hidden"], a], 1) @ self.dynamics_w
                        + self.dynamics_b)
            p, v = self.predict(h)
            return h, (h @ self.reward_w + self.reward_b)[:, 0], p, v

    return MuZero()


def muzero_keras(keras: Any, seed: int) -> Any:
    """A subclassed Keras model with the same two methods (of layers)."""

    class MuZero(keras.Model):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.represent = keras.layers.Dense(HIDDEN, activation="tanh")
            self.dynamics = keras.layers.Dense(HIDDEN, activation="tanh")
            self.reward = keras.layers.Dense(1)
            self.policy = keras.layers.Dense(ACTIONS)
            self.value = keras.layers.Dense(1, activation="tanh")

        def initial_inference(self, inputs: Any) -> Any:
            h = self.represent(keras.ops.reshape(inputs["observation"], (-1, 84)))
            return {"hidden": h, "policy": self.policy(h), "value": self.value(h)}

        def recurrent_inference(self, inputs: Any) -> Any:
            a = keras.ops.one_hot(inputs["action"], ACTIONS)
            h = self.dynamics(keras.ops.concatenate([inputs["hidden"], a], axis=1))
            return h, self.reward(h)[:, 0], self.policy(h), self.value(h)

    net = MuZero()
    net.initial_inference(initial_inputs(1, 0))   # builds the layers
    net.recurrent_inference(recurrent_inputs(1, 0))
    rng = np.random.default_rng(seed)
    net.set_weights([rng.uniform(-0.4, 0.4, w.shape).astype(w.dtype)
                     for w in net.get_weights()])
    return net


def direct(net: Any, method: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The net's own function of ``method`` called directly, its outputs by
    declared name (value heads as scalars)."""
    out = getattr(net, METHOD_NAMES[method])(inputs)
    names = tuple((INITIAL if method == "initial" else RECURRENT).outputs)
    given = [out[k] for k in names] if isinstance(out, dict) else list(out)
    arrays = [np.asarray(t) for t in given]
    return {k: (a[:, 0] if k == "value" else a) for k, a in zip(names, arrays)}


def check_methods(tm: Any, net: Any, sizes: tuple[int, ...] = BUCKETS, seed: int = 0) -> None:
    """Both methods answer as the net's functions called directly, in
    exactly the declared dtypes and shapes."""
    spec = muzero_spec()
    for name, make in INPUTS.items():
        m = spec.method(name)
        for rows in sizes:
            inputs = make(rows, seed + rows)
            out, expect = getattr(tm, name)(inputs), direct(net, name, inputs)
            assert list(out) == list(m.output_names)
            for o in m.outputs:
                assert out[o.name].dtype == o.dtype and out[o.name].shape == (rows, *o.shape)
                np.testing.assert_allclose(out[o.name], expect[o.name], rtol=1e-5, atol=1e-5)


def muzero_case(kind: str, tf: Any, keras: Any, tmp: Any) -> tuple[Any, Any, dict[str, Any]]:
    """(what TFModel is given, the net to compare with, its methods=)."""
    if kind == "module":
        net = muzero_module(tf, 1)
        return net, net, METHOD_NAMES
    if kind == "keras_subclassed":
        net = muzero_keras(keras, 2)
        return net, net, METHOD_NAMES
    if kind == "saved_functions":  # the module's restored tf.functions
        net = muzero_module(tf, 3)
        tf.saved_model.save(net, str(tmp / "muzero"))
        return str(tmp / "muzero"), net, METHOD_NAMES
    if kind == "saved_signatures":  # signatures: keyword arguments in, a dict out
        net = muzero_module(tf, 4)
        recurrent_names = tuple(RECURRENT.outputs)

        @tf.function(input_signature=[tf.TensorSpec([None, *INPUT_SHAPE], tf.float32,
                                                    name="observation")])
        def initial(observation: Any) -> Any:
            return net.initial_inference({"observation": observation})

        @tf.function(input_signature=[tf.TensorSpec([None, HIDDEN], tf.float32, name="hidden"),
                                      tf.TensorSpec([None], tf.int32, name="action")])
        def recurrent(hidden: Any, action: Any) -> Any:
            out = net.recurrent_inference({"hidden": hidden, "action": action})
            return dict(zip(recurrent_names, out))

        tf.saved_model.save(net, str(tmp / "muzero_sig"),
                            signatures={"initial": initial, "recurrent": recurrent})
        return str(tmp / "muzero_sig"), net, {"initial": "initial", "recurrent": "recurrent"}
    raise AssertionError(kind)


KINDS = ["module", "keras_subclassed", "saved_functions", "saved_signatures"]


@pytest.mark.parametrize("freeze", [True, False, "auto"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_method_traced_and_served_as_called_directly(kind: str, freeze: Any, tf: Any,
                                                          keras: Any, backend: Any,
                                                          tmp_path: Any) -> None:
    source, net, methods = muzero_case(kind, tf, keras, tmp_path)
    tm = backend.TFModel(source, methods=methods, freeze=freeze)
    assert tm.prepare(muzero_spec(), BUCKETS) is None
    assert tm.trace_count == 2 * len(BUCKETS)  # every method, every bucket
    assert tm.warmup_s > 0
    if freeze is True:
        assert all(isinstance(f, backend.FrozenGraph) for name in ("initial", "recurrent")
                   for f in getattr(tm, name).by_rows.values())
    check_methods(tm, net)
    check_methods(tm, net, seed=40)
    assert tm.trace_count == 2 * len(BUCKETS), "serving traced again"
    with pytest.raises(TypeError, match=r"serves the methods \['initial', 'recurrent'\]"):
        tm(initial_inputs(1, 0))


def test_without_buckets_and_with_xla(tf: Any, backend: Any) -> None:
    """Without buckets: one function per method for any size, run at 1 and
    max_batch; with jit_compile: one per bucket (powers of two)."""
    net = muzero_module(tf, 5)
    tm = backend.TFModel(net, methods=METHOD_NAMES, freeze=False)
    assert tm.prepare(muzero_spec(), None) is None
    assert tm.trace_count == 2
    check_methods(tm, net, sizes=(1, 5, 8))
    xla = backend.TFModel(net, methods=METHOD_NAMES, jit_compile=True, freeze=True)
    assert xla.prepare(muzero_spec(), None) == (1, 2, 4, 8)
    assert xla.trace_count == 2 * 4
    check_methods(xla, net, sizes=(1, 2, 4, 8))


@pytest.mark.parametrize("freeze", [True, False, "auto"])
def test_one_weight_update_changes_every_method(freeze: Any, tf: Any, keras: Any, backend: Any,
                                                tmp_path: Any) -> None:
    net = muzero_keras(keras, 6)
    tm = backend.TFModel(net, methods=METHOD_NAMES, freeze=freeze)
    tm.prepare(muzero_spec(), BUCKETS)
    traces = tm.trace_count
    weights = tm.get_weights()
    assert len(weights) == 10
    probe = {name: make(3, 11) for name, make in INPUTS.items()}
    before = {name: getattr(tm, name)(x)["policy"].copy() for name, x in probe.items()}
    tm.set_weights([w * 1.5 for w in weights])
    for name, x in probe.items():       # both methods serve the new weights at once
        assert not np.allclose(getattr(tm, name)(x)["policy"], before[name])
    check_methods(tm, net)              # net holds the new weights too (assigned in place)
    np.savez(tmp_path / "w.npz", *weights)
    tm.load_weights(tmp_path / "w.npz")
    for name, x in probe.items():
        np.testing.assert_allclose(getattr(tm, name)(x)["policy"], before[name],
                                   rtol=1e-5, atol=1e-5)
    assert tm.trace_count == traces, "a weight update traced again"


def test_a_restored_module_weights_are_its_functions_variables(tf: Any, backend: Any,
                                                               tmp_path: Any) -> None:
    """A restored tf.Module has no variables list: its weights are what the
    two methods' functions read, each once."""
    net = muzero_module(tf, 7)
    tf.saved_model.save(net, str(tmp_path / "m"))
    tm = backend.TFModel(str(tmp_path / "m"), methods=METHOD_NAMES)
    tm.prepare(muzero_spec(), BUCKETS)
    weights = tm.get_weights()
    assert sorted(w.shape for w in weights) == sorted(tuple(v.shape) for v in net.variables)
    tm.set_weights([w * 0.5 for w in weights])
    for v, w in zip(tm._variables(), weights):
        np.testing.assert_allclose(v.numpy(), w * 0.5)
    for name, make in INPUTS.items():     # now a different net's answers
        x = make(3, 1)
        assert not np.allclose(getattr(tm, name)(x)["policy"], direct(net, name, x)["policy"])


def test_a_method_called_before_prepare_gives_its_own_structure(tf: Any,
                                                                backend: Any) -> None:
    net = muzero_module(tf, 8)
    tm = backend.TFModel(net, methods=METHOD_NAMES)
    x = recurrent_inputs(3, 2)
    out = tm.recurrent(x)
    assert isinstance(out, tuple) and [a.shape for a in out] == [(3, HIDDEN), (3,),
                                                                 (3, ACTIONS), (3, 1)]
    np.testing.assert_allclose(out[1], direct(net, "recurrent", x)["reward"], rtol=1e-5,
                               atol=1e-6)


def test_an_output_that_does_not_fit_names_method_and_output(tf: Any, backend: Any) -> None:
    net = muzero_module(tf, 0)
    tm = backend.TFModel(net, methods=METHOD_NAMES)
    outputs = dict(RECURRENT.outputs)
    outputs["reward"] = ((2,), F32)
    with pytest.raises(shmeval.ModelError, match=r"^method 'recurrent': model output 'reward' "
                                                 r"has shape \(\) per row"):
        tm.prepare(muzero_spec(recurrent=Method(RECURRENT.inputs, outputs)), BUCKETS)
    outputs = dict(INITIAL.outputs)
    outputs["value"] = ((), "int32")
    with pytest.raises(shmeval.ModelError, match=r"^method 'initial': model output 'value' has "
                                                 r"dtype float32, which cannot be cast"):
        tm.prepare(muzero_spec(initial=Method(INITIAL.inputs, outputs)), BUCKETS)
    with pytest.raises(shmeval.ModelError, match=r"^method 'recurrent': the model gives 4 "
                                                 r"output\(s\), the spec declares 3"):
        tm.prepare(muzero_spec(recurrent=Method(RECURRENT.inputs, {
            "hidden": ((HIDDEN,), F32), "policy": ((ACTIONS,), F32), "value": ((), F32)})),
            BUCKETS)


def test_inputs_a_method_does_not_take_fail_at_prepare(tf: Any, backend: Any) -> None:
    net = muzero_module(tf, 0)
    tm = backend.TFModel(net, methods=METHOD_NAMES)
    renamed = Method({"state": ((HIDDEN,), F32), "action": ((), "int32")}, RECURRENT.outputs)
    with pytest.raises(shmeval.ModelError, match=r"^method 'recurrent': tracing it for batches "
                                                 r"of 1 failed: "):
        tm.prepare(muzero_spec(recurrent=renamed), BUCKETS)


def test_a_missing_method_fails_clearly(tf: Any, keras: Any, backend: Any) -> None:
    net = muzero_module(tf, 0)
    tm = backend.TFModel(net, methods={"initial": "initial_inference"})
    with pytest.raises(shmeval.ModelError, match=r"method 'recurrent' is declared by the "
                                                 r"evaluator, but TFModel has no function for "
                                                 r"it \(its methods=: 'initial'\)"):
        tm.prepare(muzero_spec(), BUCKETS)
    assert not hasattr(tm, "recurrent")
    # A tf.Module that is not callable: its methods serve, model(batch) has no function.
    with pytest.raises(shmeval.ModelError, match=r"was given only methods= \('initial'\)"):
        tm.prepare(Spec.build(INPUT_SHAPE, F32, {"value": ((), F32)}, 4, 1, 1), None)
    # One declared method, by name: model(batch) and model.initial(batch) serve it.
    tm.prepare(Spec.build(None, None, None, 4, 1, 1, methods={"initial": INITIAL}), None)
    x = initial_inputs(4, 2)
    for out in (tm(x), tm.initial(x)):
        np.testing.assert_allclose(out["policy"], direct(net, "initial", x)["policy"],
                                   rtol=1e-5, atol=1e-5)


def test_bad_methods_arguments(tf: Any, keras: Any, backend: Any) -> None:
    net = muzero_module(tf, 0)
    with pytest.raises(TypeError, match="non-empty dict"):
        backend.TFModel(net, methods={})
    with pytest.raises(TypeError, match="identifiers"):
        backend.TFModel(net, methods={"not a name": "initial_inference"})
    with pytest.raises(TypeError, match="'initial' must be the name of a function"):
        backend.TFModel(net, methods={"initial": 3})
    with pytest.raises(ValueError, match=r"has no attribute 'initial_infrence' \(for method "
                                         r"'initial'\)"):
        backend.TFModel(net, methods={"initial": "initial_infrence"})
    with pytest.raises(ValueError, match="the MuZero's 'value_w' is a ResourceVariable, not a function"):
        backend.TFModel(net, methods={"initial": "value_w"})
    with pytest.raises(ValueError, match="'prepare' is an attribute of TFModel itself"):
        backend.TFModel(net, methods={"prepare": "initial_inference"})
    with pytest.raises(TypeError, match="got MuZero, which is not callable .* methods="):
        backend.TFModel(net)   # no methods=, and the module is not callable


# -- two named inputs, one method ------------------------------------------------------------

MASKED_INPUTS = {"planes": (INPUT_SHAPE, F32), "mask": ((ACTIONS,), "bool")}
MASKED_OUTPUTS = {"policy": ((ACTIONS,), F32), "value": ((), F32)}


def masked_net(keras: Any, seed: int) -> Any:
    """A functional net of two named inputs: illegal moves (mask False)
    get a policy logit of -1e9."""
    planes = keras.Input(INPUT_SHAPE, name="planes")
    mask = keras.Input((ACTIONS,), name="mask", dtype="bool")
    h = keras.layers.Dense(16, activation="relu")(keras.layers.Flatten()(planes))
    policy = keras.ops.where(mask, keras.layers.Dense(ACTIONS)(h), -1e9)
    value = keras.layers.Dense(1, activation="tanh")(h)
    net = keras.Model({"planes": planes, "mask": mask}, {"policy": policy, "value": value})
    rng = np.random.default_rng(seed)
    net.set_weights([rng.uniform(-0.4, 0.4, w.shape).astype(w.dtype) for w in net.get_weights()])
    return net


def masked_inputs(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"planes": random_states(rows, seed), "mask": rng.random((rows, ACTIONS)) < 0.6}


def masked_direct(net: Any, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = net(x, training=False)
    return {"policy": np.asarray(out["policy"]), "value": np.asarray(out["value"])[:, 0]}


@pytest.mark.parametrize("freeze", [True, False])
@pytest.mark.parametrize("kind", ["functional", "exported"])
def test_two_named_inputs(kind: str, freeze: bool, keras: Any, backend: Any,
                          tmp_path: Any) -> None:
    net = masked_net(keras, 1)
    source = net
    if kind == "exported":   # a serving_default signature of two keyword arguments
        net.export(str(tmp_path / "masked"), verbose=False)
        source = tmp_path / "masked"
    tm = backend.TFModel(source, freeze=freeze)
    spec = Spec.build(None, None, MASKED_OUTPUTS, MAX_BATCH, 1, 1, inputs=MASKED_INPUTS)
    tm.prepare(spec, None)
    assert tm.trace_count == 1
    if freeze:
        assert isinstance(tm._general, backend.FrozenGraph)
    for rows in (1, 2, 5, 8):
        x = masked_inputs(rows, rows)
        out, expect = tm(x), masked_direct(net, x)
        assert (out["policy"][~x["mask"]] == -1e9).all()
        for k in MASKED_OUTPUTS:
            assert out[k].shape == expect[k].shape and out[k].dtype == np.float32
            np.testing.assert_allclose(out[k], expect[k], rtol=1e-5, atol=1e-5)
    if kind == "functional":
        tm.set_weights([w * 0.5 for w in net.get_weights()])
        x = masked_inputs(4, 9)
        np.testing.assert_allclose(tm(x)["value"], masked_direct(net, x)["value"], rtol=1e-5,
                                   atol=1e-5)
    assert tm.trace_count == 1

    good = masked_inputs(2, 0)
    with pytest.raises(ValueError, match=r"takes the inputs \['planes', 'mask'\]; "
                                         r"missing \['mask'\]"):
        tm({"planes": good["planes"]})
    with pytest.raises(ValueError, match=r"input 'mask' must be an ndarray \[rows, \*\(7,\)\] "
                                         r"bool, got an array of shape \(2, 7\), dtype float32"):
        tm({**good, "mask": good["mask"].astype(np.float32)})
    with pytest.raises(TypeError, match="takes a dict"):
        tm(good["planes"])


def test_a_named_input_the_model_lacks_fails_at_prepare(keras: Any, backend: Any,
                                                        tmp_path: Any) -> None:
    net = masked_net(keras, 0)
    spec = Spec.build(None, None, MASKED_OUTPUTS, 4, 1, 1,
                      inputs={"board": (INPUT_SHAPE, F32), "mask": ((ACTIONS,), "bool")})
    with pytest.raises(shmeval.ModelError, match=r"the model's inputs are named \['mask', "
                                                 r"'planes'\], the evaluator declares "
                                                 r"\['board', 'mask'\]"):
        backend.TFModel(net).prepare(spec, None)
    net.export(str(tmp_path / "masked"), verbose=False)
    with pytest.raises(shmeval.ModelError, match=r"serving_default signature takes the inputs "
                                                 r"\['mask', 'planes'\], the evaluator declares "
                                                 r"\['board', 'mask'\]"):
        backend.TFModel(tmp_path / "masked").prepare(spec, None)
    # One unnamed input for a signature of two: declare them by name.
    with pytest.raises(shmeval.ModelError, match=r"takes 2 inputs \(\['mask', 'planes'\]\); "
                                                 r"declare them by name"):
        backend.TFModel(tmp_path / "masked").prepare(
            Spec.build(INPUT_SHAPE, F32, MASKED_OUTPUTS, 4, 1, 1), None)


def test_named_inputs_called_before_prepare(keras: Any, backend: Any) -> None:
    """Without a spec, a dict of inputs is traced for its shapes and the
    model's own output structure comes back; an array after it is traced
    again for itself."""
    net = masked_net(keras, 2)
    tm = backend.TFModel(net, freeze=False)
    x = masked_inputs(3, 1)
    out = tm(x)
    assert isinstance(out, dict) and out["value"].shape == (3, 1)
    np.testing.assert_allclose(out["policy"], masked_direct(net, x)["policy"], rtol=1e-5,
                               atol=1e-5)
    assert tm(masked_inputs(3, 2))["policy"].shape == (3, ACTIONS)
    assert tm.trace_count == 1
    with pytest.raises(ValueError, match="no input"):
        tm({})
