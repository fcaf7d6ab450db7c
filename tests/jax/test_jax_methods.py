"""JaxModel with named inputs and several methods, called as the evaluator
calls it (``prepare(spec, buckets)``, then ``model(batch)`` or
``model.<method>(inputs)``), on the CPU.

- a MuZero-style net (``initial(observation)`` -> hidden, policy, value;
  ``recurrent(hidden, action)`` -> hidden, reward, policy, value) served
  as two methods of one params pytree: every method compiled for every
  bucket at prepare, each answering as the function run eagerly; the
  same with the methods given as a Flax-style apply's method names;
- one weight update changes both methods, nothing is traced again;
- a two-input net (planes and a legal-move mask) as one method with
  named inputs; a batch missing an input, with an extra one or of the
  wrong dtype is refused naming the input;
- a declared output that does not fit, a function that fails to trace and
  a declared method the model lacks fail at prepare, naming the method
  and the output; bad ``methods=`` fail at JaxModel().

JAX is imported by fixtures, not at module import (see test_jax_backend).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import shmeval
from backend_contract import F32, INPUT_SHAPE, module_fixture, random_states
from shmeval.spec import Method, Spec

jax = module_fixture("jax")
backend = module_fixture("shmeval.backends.jax")

HIDDEN = 8
ACTIONS = 7
MAX_BATCH = 8
SIZES = (1, 2, 4, 8)  # the powers of two up to MAX_BATCH: compiled by default

INITIAL = Method(inputs={"observation": (INPUT_SHAPE, F32)},
                 outputs={"hidden": ((HIDDEN,), F32), "policy": ((ACTIONS,), F32),
                          "value": ((), F32)})
RECURRENT = Method(inputs={"hidden": ((HIDDEN,), F32), "action": ((), "int32")},
                   outputs={"hidden": ((HIDDEN,), F32), "reward": ((), F32),
                            "policy": ((ACTIONS,), F32), "value": ((), F32)})


def muzero_spec(**changes: Method) -> Spec:
    methods = {"initial": INITIAL, "recurrent": RECURRENT, **changes}
    return Spec.build(None, None, None, MAX_BATCH, 1, 1, methods=methods)


def muzero_params(seed: int) -> dict[str, dict[str, np.ndarray]]:
    """Representation, dynamics (hidden and one-hot action), reward and
    prediction (policy, value) layers, a fixed function of seed."""
    rng = np.random.default_rng(seed)

    def layer(n_in: int, n_out: int) -> dict[str, np.ndarray]:
        return {"w": rng.uniform(-0.4, 0.4, (n_in, n_out)).astype(np.float32),
                "b": rng.uniform(-0.4, 0.4, (n_out,)).astype(np.float32)}

    return {"represent": layer(84, HIDDEN), "dynamics": layer(HIDDEN + ACTIONS, HIDDEN),
            "reward": layer(HIDDEN, 1), "policy": layer(HIDDEN, ACTIONS),
            "value": layer(HIDDEN, 1)}


def _predict(params: Any, h: Any) -> tuple[Any, Any]:
    import jax.numpy as jnp

    p = h @ params["policy"]["w"] + params["policy"]["b"]
    v = jnp.tanh(h @ params["value"]["w"] + params["value"]["b"])
    return p, v


def initial(params: Any, inputs: Any) -> Any:
    """observation -> a dict {hidden, policy, value (rows, 1)}."""
    import jax.numpy as jnp

    obs = inputs["observation"]
    h = jnp.tanh(obs.reshape(obs.shape[0], -1) @ params["represent"]["w"]
                 + params["represent"]["b"])
    p, v = _predict(params, h)
    return {"hidden": h, "policy": p, "value": v}


def recurrent(params: Any, inputs: Any) -> Any:
    """(hidden, action) -> a tuple (hidden, reward, policy, value), unnamed."""
    import jax
    import jax.numpy as jnp

    a = jax.nn.one_hot(inputs["action"], ACTIONS, dtype=jnp.float32)
    x = jnp.concatenate([inputs["hidden"], a], axis=1)
    h = jnp.tanh(x @ params["dynamics"]["w"] + params["dynamics"]["b"])
    r = (h @ params["reward"]["w"] + params["reward"]["b"])[:, 0]
    p, v = _predict(params, h)
    return h, r, p, v


def eager(fn: Any, params: Any, inputs: dict[str, np.ndarray],
          names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """fn run op by op (not compiled), its outputs by declared name, value
    heads as scalars."""
    import jax

    with jax.disable_jit():
        out = fn(params, inputs)
    given = [out[k] for k in names] if isinstance(out, dict) else list(out)
    arrays = [np.asarray(t) for t in given]
    return {k: (a[:, 0] if k == "value" else a) for k, a in zip(names, arrays)}


def initial_inputs(rows: int, seed: int) -> dict[str, np.ndarray]:
    return {"observation": random_states(rows, seed)}


def recurrent_inputs(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"hidden": rng.uniform(-1, 1, (rows, HIDDEN)).astype(np.float32),
            "action": rng.integers(0, ACTIONS, rows).astype(np.int32)}


CALLS = {"initial": (initial, initial_inputs, tuple(INITIAL.outputs)),
         "recurrent": (recurrent, recurrent_inputs, tuple(RECURRENT.outputs))}


def check_methods(jm: Any, params: Any, seed: int = 0) -> None:
    """Both methods, at every compiled size, answer as their functions run
    eagerly with ``params``, in exactly the declared dtypes and shapes."""
    spec = muzero_spec()
    for name, (fn, make, names) in CALLS.items():
        m = spec.method(name)
        for rows in SIZES:
            inputs = make(rows, seed + rows)
            out = getattr(jm, name)(inputs)
            expect = eager(fn, params, inputs, names)
            assert list(out) == list(names)
            for o in m.outputs:
                assert out[o.name].dtype == o.dtype and out[o.name].shape == (rows, *o.shape)
                np.testing.assert_allclose(out[o.name], expect[o.name], rtol=1e-5, atol=1e-5)


def flax_style_apply(params: Any, inputs: Any, method: Any = None) -> Any:
    """What a Flax module's apply does with method="name": calls the
    module's method of that name."""
    return {"initial_inference": initial, "recurrent_inference": recurrent}[method](params,
                                                                                    inputs)


@pytest.mark.parametrize("style", ["functions", "flax_method_names"])
def test_every_method_compiled_and_served_as_eager(style: str, jax: Any, backend: Any) -> None:
    params = muzero_params(1)
    if style == "functions":
        jm = backend.JaxModel(params=params, methods={"initial": initial, "recurrent": recurrent})
    else:
        jm = backend.JaxModel(flax_style_apply, params, methods={
            "initial": "initial_inference", "recurrent": "recurrent_inference"})
    assert jm.prepare(muzero_spec(), None) == SIZES
    assert jm.trace_count == 2 * len(SIZES)   # every method, every bucket
    assert jm.warmup_s > 0
    check_methods(jm, params)
    check_methods(jm, params, seed=50)
    assert jm.trace_count == 2 * len(SIZES), "serving traced again"
    with pytest.raises(TypeError, match=r"serves the methods \['initial', 'recurrent'\]"):
        jm(initial_inputs(1, 0))
    with pytest.raises(ValueError, match=r"method 'recurrent': JaxModel was compiled for "
                                         r"batches of \[1, 2, 4, 8\] rows, got 3"):
        jm.recurrent(recurrent_inputs(3, 0))


def test_evaluator_buckets_are_compiled_for_every_method(jax: Any, backend: Any) -> None:
    params = muzero_params(2)
    jm = backend.JaxModel(params=params, methods={"initial": initial, "recurrent": recurrent})
    assert jm.prepare(muzero_spec(), [3, 8]) is None
    assert jm.trace_count == 2 * 2
    for name, (fn, make, names) in CALLS.items():
        inputs = make(3, 7)
        out = getattr(jm, name)(inputs)
        for k, v in eager(fn, params, inputs, names).items():
            np.testing.assert_allclose(out[k], v, rtol=1e-5, atol=1e-5)


def test_one_weight_update_changes_every_method(jax: Any, backend: Any, tmp_path: Any) -> None:
    jm = backend.JaxModel(params=muzero_params(1), methods={"initial": initial,
                                                            "recurrent": recurrent})
    jm.prepare(muzero_spec(), None)
    traces = jm.trace_count
    before = jm.recurrent(recurrent_inputs(4, 3))["reward"].copy()
    jm.set_weights(muzero_params(2))                                # a pytree
    check_methods(jm, muzero_params(2))
    assert not np.allclose(jm.recurrent(recurrent_inputs(4, 3))["reward"], before)
    jm.set_weights(jax.tree_util.tree_leaves(muzero_params(3)))    # a list
    check_methods(jm, muzero_params(3))
    np.savez(tmp_path / "four.npz", *jax.tree_util.tree_leaves(muzero_params(4)))
    jm.load_weights(tmp_path / "four.npz")
    check_methods(jm, muzero_params(4))
    for a, b in zip(jm.get_weights(), jax.tree_util.tree_leaves(muzero_params(4))):
        np.testing.assert_array_equal(a, b)
    assert jm.trace_count == traces, "a weight update traced again"


def test_a_method_called_before_prepare_gives_its_own_structure(jax: Any,
                                                                backend: Any) -> None:
    params = muzero_params(5)
    jm = backend.JaxModel(params=params, methods={"initial": initial, "recurrent": recurrent})
    inputs = recurrent_inputs(3, 1)
    out = jm.recurrent(inputs)
    assert isinstance(out, tuple) and [a.shape for a in out] == [(3, HIDDEN), (3,),
                                                                 (3, ACTIONS), (3, 1)]
    np.testing.assert_allclose(out[1], eager(recurrent, params, inputs, ("h", "reward"))["reward"],
                               rtol=1e-5, atol=1e-5)


def test_an_output_that_does_not_fit_names_method_and_output(jax: Any, backend: Any) -> None:
    jm = backend.JaxModel(params=muzero_params(0), methods={"initial": initial,
                                                            "recurrent": recurrent})
    outputs = dict(RECURRENT.outputs)
    outputs["reward"] = ((2,), F32)
    with pytest.raises(shmeval.ModelError, match=r"^method 'recurrent': model output 'reward' "
                                                 r"has shape \(\) per row"):
        jm.prepare(muzero_spec(recurrent=Method(RECURRENT.inputs, outputs)), None)
    outputs = dict(INITIAL.outputs)
    outputs["value"] = ((), "int32")
    with pytest.raises(shmeval.ModelError, match=r"^method 'initial': model output 'value' has "
                                                 r"dtype float32, which cannot be cast"):
        jm.prepare(muzero_spec(initial=Method(INITIAL.inputs, outputs)), None)
    with pytest.raises(shmeval.ModelError, match=r"^method 'initial': the model's outputs are "
                                                 r"named \['hidden', 'policy', 'value'\], the "
                                                 r"spec declares \['hidden', 'policy'\]"):
        jm.prepare(muzero_spec(initial=Method(INITIAL.inputs, {
            "hidden": ((HIDDEN,), F32), "policy": ((ACTIONS,), F32)})), None)
    with pytest.raises(shmeval.ModelError, match=r"^method 'recurrent': the model gives 4 "
                                                 r"output\(s\), the spec declares 3"):
        jm.prepare(muzero_spec(recurrent=Method(RECURRENT.inputs, {
            "hidden": ((HIDDEN,), F32), "policy": ((ACTIONS,), F32), "value": ((), F32)})),
            None)


def test_a_method_that_fails_to_trace_is_named(jax: Any, backend: Any) -> None:
    """An input the function wants that the spec does not give it."""
    jm = backend.JaxModel(params=muzero_params(0), methods={"initial": initial,
                                                            "recurrent": recurrent})
    renamed = Method({"state": ((HIDDEN,), F32), "action": ((), "int32")}, RECURRENT.outputs)
    with pytest.raises(shmeval.ModelError, match=r"^method 'recurrent': tracing it for a batch "
                                                 r"of 1 failed: KeyError: 'hidden'"):
        jm.prepare(muzero_spec(recurrent=renamed), None)


def test_a_missing_method_fails_clearly(jax: Any, backend: Any) -> None:
    jm = backend.JaxModel(params=muzero_params(0), methods={"initial": initial})
    with pytest.raises(shmeval.ModelError, match=r"method 'recurrent' is declared by the "
                                                 r"evaluator, but JaxModel has no function for "
                                                 r"it \(its methods=: 'initial'\)"):
        jm.prepare(muzero_spec(), None)
    assert not hasattr(jm, "recurrent")
    # An evaluator of one unnamed method calls the model itself: apply_fn.
    with pytest.raises(shmeval.ModelError, match="was given only methods= \\('initial'\\)"):
        jm.prepare(Spec.build(INPUT_SHAPE, F32, {"value": ((), F32)}, 4, 1, 1), None)
    # One declared method, by name: model(batch) and model.initial(batch) serve it.
    jm.prepare(Spec.build(None, None, None, 4, 1, 1, methods={"initial": INITIAL}), None)
    inputs = initial_inputs(4, 2)
    for out in (jm(inputs), jm.initial(inputs)):
        np.testing.assert_allclose(out["policy"], eager(initial, muzero_params(0), inputs,
                                                        tuple(INITIAL.outputs))["policy"],
                                   rtol=1e-5, atol=1e-5)


def test_bad_methods_arguments(jax: Any, backend: Any) -> None:
    params = muzero_params(0)
    with pytest.raises(TypeError, match="callable apply_fn"):
        backend.JaxModel(None, params)
    with pytest.raises(TypeError, match="non-empty dict"):
        backend.JaxModel(params=params, methods={})
    with pytest.raises(TypeError, match="identifiers"):
        backend.JaxModel(params=params, methods={"not a name": initial})
    with pytest.raises(TypeError, match="'initial' must be a function"):
        backend.JaxModel(params=params, methods={"initial": 3})
    with pytest.raises(TypeError, match="needs apply_fn"):
        backend.JaxModel(params=params, methods={"initial": "initial_inference"})
    with pytest.raises(ValueError, match="'prepare' is an attribute of JaxModel itself"):
        backend.JaxModel(params=params, methods={"prepare": initial})
    with pytest.raises(ValueError, match="'params' is an attribute of JaxModel itself"):
        backend.JaxModel(params=params, methods={"params": initial})


# -- two named inputs, one method ------------------------------------------------------------

MASKED_INPUTS = {"planes": (INPUT_SHAPE, F32), "mask": ((ACTIONS,), "bool")}
MASKED_OUTPUTS = {"policy": ((ACTIONS,), F32), "value": ((), F32)}


def masked_apply(params: Any, inputs: Any) -> Any:
    """A policy-value net whose illegal moves (mask False) get -1e9."""
    import jax.numpy as jnp

    x = inputs["planes"]
    h = jnp.tanh(x.reshape(x.shape[0], -1) @ params["represent"]["w"]
                 + params["represent"]["b"])
    p, v = _predict(params, h)
    return {"policy": jnp.where(inputs["mask"], p, -1e9), "value": v}


def masked_inputs(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"planes": random_states(rows, seed), "mask": rng.random((rows, ACTIONS)) < 0.6}


def test_two_named_inputs(jax: Any, backend: Any) -> None:
    params = muzero_params(6)
    jm = backend.JaxModel(masked_apply, params)
    spec = Spec.build(None, None, MASKED_OUTPUTS, MAX_BATCH, 1, 1, inputs=MASKED_INPUTS)
    assert jm.prepare(spec, None) == SIZES and jm.trace_count == len(SIZES)
    for rows in SIZES:
        inputs = masked_inputs(rows, rows)
        out = jm(inputs)
        expect = eager(masked_apply, params, inputs, ("policy", "value"))
        assert (out["policy"][~inputs["mask"]] == -1e9).all()
        for k in MASKED_OUTPUTS:
            np.testing.assert_allclose(out[k], expect[k], rtol=1e-5, atol=1e-5)
    jm.set_weights(muzero_params(7))
    inputs = masked_inputs(4, 9)
    np.testing.assert_allclose(jm(inputs)["value"],
                               eager(masked_apply, muzero_params(7), inputs,
                                     ("policy", "value"))["value"], rtol=1e-5, atol=1e-5)
    assert jm.trace_count == len(SIZES)

    good = masked_inputs(2, 0)
    with pytest.raises(ValueError, match=r"takes the inputs \['planes', 'mask'\]; "
                                         r"missing \['mask'\]"):
        jm({"planes": good["planes"]})
    with pytest.raises(ValueError, match=r"not declared \['extra'\]"):
        jm({**good, "extra": good["mask"]})
    with pytest.raises(ValueError, match=r"input 'mask' must be an ndarray \[rows, \*\(7,\)\] "
                                         r"bool, got an array of shape \(2, 7\), dtype float32"):
        jm({**good, "mask": good["mask"].astype(np.float32)})
    with pytest.raises(ValueError, match=r"input 'mask' has 1 rows, the inputs before it 2"):
        jm({**good, "mask": good["mask"][:1]})
    with pytest.raises(TypeError, match="takes a dict"):
        jm(good["planes"])


def test_named_input_a_function_lacks_fails_at_prepare(jax: Any, backend: Any) -> None:
    """The evaluator's only method: the error as the function raised it
    (the evaluator reports it as the model failing to prepare)."""
    jm = backend.JaxModel(masked_apply, muzero_params(0))
    spec = Spec.build(None, None, MASKED_OUTPUTS, 4, 1, 1,
                      inputs={"board": (INPUT_SHAPE, F32), "mask": ((ACTIONS,), "bool")})
    with pytest.raises(KeyError, match="planes"):
        jm.prepare(spec, None)
