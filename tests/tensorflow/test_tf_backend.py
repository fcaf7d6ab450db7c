"""The TensorFlow backend, ``shmeval.backends.tensorflow``.

- outputs served through an Evaluator equal the model called directly, for
  every kind of model TFModel accepts, at many batch sizes, one output and
  several; no retracing while serving;
- outputs are matched by name when the model names them, by order
  otherwise; mismatches fail at Evaluator construction;
- buckets: padding never leaks into results; jit_compile with buckets;
- Evaluator.spawn with a TFModel factory: worker processes never import
  TensorFlow or Keras;
- set_weights / get_weights / load_weights (Keras weights file, .npz), bad
  updates leave the weights alone; the same through ev.set_weights /
  ev.load_weights (thread and spawned evaluators);
- configure() sets the thread pools (in a fresh process).

TensorFlow is imported by fixtures, not at module import, so collecting the
suite does not load it into the pytest process (other tests fork).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest

import shmeval
import tf_models
from backend_contract import (F32, INPUT_SHAPE, OUTPUTS, TIMEOUT, Reference, mismatch_cases,
                              mismatch_fails_at_construction, module_fixture, random_states,
                              serve_and_compare, updates_through_evaluator)
from helpers import own_segments
from shmeval.spec import Spec
from tf_models import counting_module, pv_net

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Keras' own noise (saving a model under NumPy 2; loading a weights file).
pytestmark = [pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:Skipping nested container:UserWarning")]

tf = module_fixture("tensorflow")
keras = module_fixture("keras")
backend = module_fixture("shmeval.backends.tensorflow")


def make_module(tf: Any, seed: int) -> Any:
    """A tf.Module whose tf.function returns (policy, value), unnamed."""

    class Linear(tf.Module):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            rng = np.random.default_rng(seed)
            self.w = tf.Variable(rng.uniform(-0.2, 0.2, (84, 8)).astype(np.float32))
            self.b = tf.Variable(rng.uniform(-0.2, 0.2, (8,)).astype(np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, *INPUT_SHAPE], tf.float32)])
        def __call__(self, x: Any) -> Any:
            y = tf.reshape(x, [-1, 84]) @ self.w + self.b
            return y[:, :7], tf.tanh(y[:, 7])

    return Linear()


def module_reference(m: Any) -> Reference:
    def ref(x: np.ndarray) -> dict[str, np.ndarray]:
        y = x.reshape(len(x), 84) @ m.w.numpy() + m.b.numpy()
        return {"policy": y[:, :7], "value": np.tanh(y[:, 7])}
    return ref


def keras_reference(m: Any) -> Reference:
    """pv_net's outputs as declared, from a direct call."""
    def ref(x: np.ndarray) -> dict[str, np.ndarray]:
        out = m(x, training=False)
        if isinstance(out, dict):
            policy, value = out["policy"], out["value"]
        else:
            value, policy = out
        return {"policy": policy.numpy(), "value": value.numpy()[:, 0]}
    return ref


def make_case(kind: str, tf: Any, keras: Any, tmp: Any) -> tuple[Any, dict[str, Any], Reference]:
    """(what to give TFModel, declared outputs, reference function)."""
    if kind == "functional_dict":
        m = pv_net(1, "dict")
        return m, OUTPUTS, keras_reference(m)
    if kind == "functional_list_by_name":  # [value, policy]: reordered by layer name
        m = pv_net(2, "list")
        return m, OUTPUTS, keras_reference(m)
    if kind == "sequential_one_output":
        m = keras.Sequential([keras.Input(INPUT_SHAPE), keras.layers.Flatten(),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(7)])
        tf_models.seeded_weights(m, 3)
        return m, {"policy": ((7,), F32)}, lambda x: {"policy": m(x).numpy()}

    if kind == "subclassed":
        class PV(keras.Model):  # type: ignore[misc, name-defined]
            def __init__(self) -> None:
                super().__init__()
                self.body = keras.layers.Dense(16, activation="relu")
                self.p = keras.layers.Dense(7)
                self.v = keras.layers.Dense(1)

            def call(self, x: Any) -> Any:
                h = self.body(keras.ops.reshape(x, (-1, 84)))
                return self.p(h), keras.ops.squeeze(self.v(h), -1)

        m = PV()
        m(np.zeros((1, *INPUT_SHAPE), np.float32))
        tf_models.seeded_weights(m, 4)
        return m, OUTPUTS, lambda x: dict(zip(("policy", "value"),
                                              (t.numpy() for t in m(x))))
    if kind == "tf_module":
        mod = make_module(tf, 5)
        return mod, OUTPUTS, module_reference(mod)
    if kind == "keras_file":
        m = pv_net(6, "dict")
        path = tmp / "pv.keras"
        m.save(path)
        return str(path), OUTPUTS, keras_reference(m)
    if kind == "savedmodel_keras":  # signature outputs named policy / value
        m = pv_net(7, "dict")
        m.export(str(tmp / "sm_keras"), verbose=False)
        return tmp / "sm_keras", OUTPUTS, keras_reference(m)
    if kind == "savedmodel_module":  # signature outputs output_0 / output_1: by order
        mod = make_module(tf, 8)
        tf.saved_model.save(mod, str(tmp / "sm_module"))
        return str(tmp / "sm_module"), OUTPUTS, module_reference(mod)
    raise AssertionError(kind)


KINDS = ["functional_dict", "functional_list_by_name", "sequential_one_output", "subclassed",
         "tf_module", "keras_file", "savedmodel_keras", "savedmodel_module"]


@pytest.mark.parametrize("kind", KINDS)
def test_served_outputs_equal_direct_call(kind: str, tf: Any, keras: Any, backend: Any,
                                          tmp_path: Any) -> None:
    source, outputs, ref = make_case(kind, tf, keras, tmp_path)
    tm = backend.TFModel(source)
    with shmeval.Evaluator(tm, input_shape=INPUT_SHAPE, outputs=outputs, max_batch=64,
                           max_clients=4, slots_per_client=32) as ev:
        traces = tm.trace_count
        assert traces >= 1 and tm.warmup_s > 0
        serve_and_compare(ev, ref, tuple(outputs))
        serve_and_compare(ev, ref, tuple(outputs), seed=100)
        assert tm.trace_count == traces, "serving retraced the model"
        assert ev.stats()["failed_requests"] == 0


def test_order_matching_when_names_differ(keras: Any, backend: Any) -> None:
    """A list model whose layer names are not the declared ones: by order,
    and the (n, 1) value head fits a declared scalar."""
    m = pv_net(9, "list")  # [value, policy]
    ref = keras_reference(m)
    with shmeval.Evaluator(backend.TFModel(m), input_shape=INPUT_SHAPE,
                           outputs={"v": ((), F32), "p": ((7,), F32)}, max_batch=64,
                           max_clients=4, slots_per_client=32) as ev:
        serve_and_compare(ev, lambda x: {"v": ref(x)["value"], "p": ref(x)["policy"]},
                          ("v", "p"), sizes=(1, 5, 64))


def test_cast_to_declared_dtype(backend: Any) -> None:
    """Outputs are cast inside the traced function: the evaluator gets the
    declared dtype as is (float32 model, float64 / float16 declared)."""
    m = pv_net(10, "dict")
    tm = backend.TFModel(m)
    spec = Spec.build(INPUT_SHAPE, F32, {"policy": ((7,), "float16"), "value": ((), "float64")},
                      8, 1, 1)
    assert tm.prepare(spec, None) is None
    x = random_states(5, 1)
    out = tm(x)
    assert out["policy"].dtype == np.float16 and out["value"].dtype == np.float64
    expect = keras_reference(m)(x)
    np.testing.assert_allclose(out["value"], expect["value"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["policy"], expect["policy"], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("case, what", mismatch_cases({"ordered": ["module", "list"],
                                                         "named": ["dict"]}))
def test_mismatch_fails_at_construction(case: str, what: str, tf: Any, backend: Any) -> None:
    """what: the model, a tf.Module ("module") or pv_net with those outputs."""
    model = make_module(tf, 0) if what == "module" else pv_net(0, what)
    mismatch_fails_at_construction(case, backend.TFModel(model))


@pytest.mark.parametrize("where", ["evaluator", "tfmodel"])
def test_bucket_padding_never_leaks(where: str, backend: Any) -> None:
    """Batches padded to buckets (the evaluator's, or the ones TFModel's
    prepare returns): stale rows from an earlier, larger batch fill the
    padding; every real row is still its own state's answer, and no
    bucket size is retraced."""
    m = pv_net(11, "dict")
    ref = keras_reference(m)
    buckets = [4, 16, 64]
    tm = backend.TFModel(m, buckets=buckets if where == "tfmodel" else None)
    with shmeval.Evaluator(tm, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=64,
                           buckets=buckets if where == "evaluator" else None,
                           max_clients=4, slots_per_client=64) as ev:
        traces = tm.trace_count
        assert traces == len(buckets)
        ev.evaluate_many(random_states(64, 0) * 1000)  # fills the batch buffer
        for n in (3, 5, 17, 33, 1, 63):
            states = random_states(n, n)
            out = ev.evaluate_many(states)
            expect = ref(states)
            for k in OUTPUTS:
                np.testing.assert_allclose(out[k], expect[k], rtol=1e-5, atol=1e-5)
        serve_and_compare(ev, ref, tuple(OUTPUTS))
        assert ev.stats()["padded_rows"] > 0
        assert tm.trace_count == traces


def test_jit_compile_with_buckets(backend: Any) -> None:
    m = pv_net(12, "dict")
    tm = backend.TFModel(m, jit_compile=True)
    with shmeval.Evaluator(tm, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=16,
                           buckets=[4, 16], max_clients=4, slots_per_client=16) as ev:
        traces = tm.trace_count
        serve_and_compare(ev, keras_reference(m), tuple(OUTPUTS), sizes=(1, 3, 9, 16, 20))
        assert tm.trace_count == traces == 2


def test_jit_compile_defaults_to_pow2_buckets(backend: Any) -> None:
    """XLA compiles per shape: with neither evaluator nor TFModel buckets,
    prepare warms up and returns powers of two up to max_batch."""
    m = pv_net(13, "dict")
    tm = backend.TFModel(m, jit_compile=True)
    spec = Spec.build(INPUT_SHAPE, F32, OUTPUTS, 6, 1, 1)
    assert tm.prepare(spec, None) == (1, 2, 4, 6)
    x = random_states(4, 2)
    np.testing.assert_allclose(tm(x)["policy"], keras_reference(m)(x)["policy"],
                               rtol=1e-5, atol=1e-5)
    # With the evaluator's buckets it warms those and asks for nothing.
    tm2 = backend.TFModel(m)
    assert tm2.prepare(spec, (3, 6)) is None and tm2.trace_count == 2


def test_tfmodel_buckets_must_cover_max_batch(backend: Any) -> None:
    with pytest.raises(shmeval.ModelError, match="max_batch"):
        shmeval.Evaluator(backend.TFModel(pv_net(0), buckets=[2, 4]),
                          input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=8)
    assert not own_segments()


def test_standalone_call_before_prepare(tf: Any, backend: Any) -> None:
    """Without a spec, the model's own output structure as numpy arrays."""
    x = random_states(3, 3)
    m = pv_net(14, "list")
    out = backend.TFModel(m)(x)
    assert isinstance(out, tuple) and [o.shape for o in out] == [(3, 1), (3, 7)]
    np.testing.assert_allclose(out[1], m(x)[1].numpy(), rtol=1e-6, atol=1e-6)
    m2 = pv_net(14, "dict")
    out2 = backend.TFModel(m2)(x)
    assert isinstance(out2, dict) and sorted(out2) == ["policy", "value"]
    assert isinstance(out2["value"], np.ndarray) and out2["value"].shape == (3, 1)
    # After prepare, a batch of another input shape is refused.
    tm = backend.TFModel(m2)
    tm.prepare(Spec.build(INPUT_SHAPE, F32, OUTPUTS, 4, 1, 1), None)
    with pytest.raises(ValueError, match="prepared for"):
        tm(np.zeros((2, 3), np.float32))


def test_spawned_evaluator_keeps_tensorflow_out_of_workers(keras: Any, tmp_path: Any) -> None:
    """The evaluator process builds the TFModel and loads a weights file
    (ev.load_weights); spawn workers get the evaluator pickled as a Process
    argument, and are answered by those weights without loading TF."""
    ctx = mp.get_context("spawn")
    path = str(tmp_path / "five.weights.h5")
    pv_net(5).save_weights(path)
    with shmeval.Evaluator.spawn(tf_models.pv_factory, input_shape=INPUT_SHAPE,
                                 outputs=OUTPUTS, max_batch=32, max_clients=4,
                                 start_timeout=TIMEOUT) as ev:
        assert ev.load_weights(path) == 1
        pipes, procs = [], []
        for seed in range(2):
            receiver, sender = ctx.Pipe(duplex=False)
            p = ctx.Process(target=tf_models.worker_report, args=(ev, seed, sender),
                            daemon=True)
            p.start()
            sender.close()
            pipes.append(receiver)
            procs.append(p)
        reports = []
        for receiver in pipes:
            assert receiver.poll(TIMEOUT), "a worker hung"
            reports.append(receiver.recv())
        for p in procs:
            p.join(TIMEOUT)
            assert p.exitcode == 0
    ref = keras_reference(pv_net(5))
    for seed, r in enumerate(reports):
        assert "error" not in r, r.get("error")
        assert r["tensorflow"] is False and r["keras"] is False
        expect = ref(random_states(9, seed))
        for k in OUTPUTS:
            np.testing.assert_allclose(r[k], expect[k], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(r["single_" + k], expect[k], rtol=1e-5, atol=1e-5)


def reads_variables(fn: Any) -> bool:
    """Whether a concrete function's graph reads a variable (a frozen one
    holds its weights as constants and reads none)."""
    return any(op.type == "ReadVariableOp" for op in fn.graph.get_operations()) or any(
        n.op == "ReadVariableOp" for f in fn.graph.as_graph_def().library.function
        for n in f.node_def)


@pytest.mark.parametrize("kind", ["functional_dict", "subclassed", "tf_module",
                                  "savedmodel_keras", "savedmodel_module"])
def test_frozen_serves_like_direct_call(kind: str, tf: Any, keras: Any, backend: Any,
                                        tmp_path: Any) -> None:
    """TFModel(freeze=True): the functions that serve read no variable, and
    answer as the model does."""
    source, outputs, ref = make_case(kind, tf, keras, tmp_path)
    plain = backend.TFModel(source, freeze=False)
    tm = backend.TFModel(source, freeze=True)
    with shmeval.Evaluator(tm, input_shape=INPUT_SHAPE, outputs=outputs, max_batch=64,
                           max_clients=4, slots_per_client=32) as ev:
        serve_and_compare(ev, ref, tuple(outputs))
        assert ev.stats()["failed_requests"] == 0
    assert not reads_variables(tm._general)
    plain.prepare(Spec.build(INPUT_SHAPE, F32, outputs, 64, 1, 1), None)
    assert reads_variables(plain._general)


def test_frozen_standalone_and_jit(tf: Any, backend: Any) -> None:
    """Frozen functions keep the model's output structure before prepare,
    and compile with XLA per bucket."""
    x = random_states(3, 3)
    m = pv_net(14, "list")
    out = backend.TFModel(m, freeze=True)(x)
    assert isinstance(out, tuple) and [o.shape for o in out] == [(3, 1), (3, 7)]
    np.testing.assert_allclose(out[1], m(x)[1].numpy(), rtol=1e-5, atol=1e-5)
    m2 = pv_net(12, "dict")
    tm = backend.TFModel(m2, jit_compile=True, freeze=True)
    with shmeval.Evaluator(tm, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=16,
                           buckets=[4, 16], max_clients=4, slots_per_client=16) as ev:
        serve_and_compare(ev, keras_reference(m2), tuple(OUTPUTS), sizes=(1, 3, 9, 16, 20))
    assert sorted(tm._by_rows) == [4, 16]
    assert not any(reads_variables(f) for f in tm._by_rows.values())
    # buckets without XLA: one FrozenGraph per bucket
    tm = backend.TFModel(m2, freeze=True, buckets=[4, 16])
    with shmeval.Evaluator(tm, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=16,
                           max_clients=4, slots_per_client=16) as ev:
        serve_and_compare(ev, keras_reference(m2), tuple(OUTPUTS), sizes=(1, 3, 9, 16, 20))
    assert sorted(tm._by_rows) == [4, 16]
    assert all(isinstance(f, backend.FrozenGraph) for f in tm._by_rows.values())


def test_freeze_refuses_a_model_that_assigns_while_it_runs(backend: Any) -> None:
    """A model whose call assigns a variable cannot be frozen: a ModelError
    that says so at start-up, not an error of TensorFlow's graph import."""
    with pytest.raises(shmeval.ModelError, match="freeze=False"):
        shmeval.Evaluator(backend.TFModel(counting_module(), freeze=True), input_shape=INPUT_SHAPE,
                          outputs=OUTPUTS, max_batch=8)
    assert not own_segments()
    out = backend.TFModel(counting_module())(random_states(2, 0))  # unfrozen it serves
    assert out[0].shape == (2, 7)


def test_frozen_function_wants_one_tensor(tf: Any, backend: Any) -> None:
    fn = tf.function(lambda a, b: a + b).get_concrete_function(
        tf.TensorSpec([None], tf.float32), tf.TensorSpec([None], tf.float32))
    with pytest.raises(ValueError, match="one tensor"):
        backend.frozen_function(fn)
    with pytest.raises(ValueError, match="one tensor"):
        backend.FrozenGraph(fn)


def test_frozen_graph(tf: Any, backend: Any) -> None:
    """FrozenGraph answers as the model does at any batch size, in the
    model's structure, from several threads at once; it keeps the weights
    it was built with and reads no variable."""
    m = pv_net(15, "dict")
    concrete = tf.function(lambda x: m(x, training=False)).get_concrete_function(
        tf.TensorSpec((None, *INPUT_SHAPE), tf.float32))
    fg = backend.FrozenGraph(concrete)
    assert not reads_variables(fg)
    ref = keras_reference(m)
    for n in (1, 5, 64):
        x = random_states(n, n)
        out = fg(x)
        assert sorted(out) == sorted(OUTPUTS)
        for k in OUTPUTS:
            assert isinstance(out[k], np.ndarray)
            np.testing.assert_allclose(out[k].reshape(n, -1), ref(x)[k].reshape(n, -1),
                                       rtol=1e-5, atol=1e-5)
        flat = fg.run_flat(x)
        for a, b in zip(flat, tf.nest.flatten(out)):
            np.testing.assert_array_equal(a, b)

    errors: list[BaseException] = []

    def hammer(seed: int) -> None:
        try:
            for i in range(30):
                x = random_states(1 + (seed + i) % 9, seed * 100 + i)
                got, want = fg(x), ref(x)
                for k in OUTPUTS:
                    np.testing.assert_allclose(got[k].reshape(len(x), -1),
                                               want[k].reshape(len(x), -1),
                                               rtol=1e-5, atol=1e-5)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    assert not errors, errors[0]

    x = random_states(4, 1)
    before = fg(x)
    m.set_weights([w * 0.5 for w in m.get_weights()])
    after = fg(x)
    for k in OUTPUTS:
        np.testing.assert_array_equal(before[k], after[k])
    fg.close()


def test_bfloat16(tf: Any, backend: Any) -> None:
    """TFModel(freeze=True, bfloat16=True) serves answers within bfloat16's
    precision of the model's; on a CPU with native bfloat16 the rewrite is
    on (the answers are not float32's).  Without freeze, or with XLA, it is
    refused."""
    from shmeval.backends._device import cpu_bfloat16

    m = pv_net(16, "dict")
    ref = keras_reference(m)
    spec = Spec.build(INPUT_SHAPE, F32, OUTPUTS, 64, 1, 1)
    f32 = backend.TFModel(m, freeze=True)
    b16 = backend.TFModel(m, freeze=True, bfloat16=True)
    assert b16._general is None
    f32.prepare(spec, None)
    b16.prepare(spec, None)
    assert b16._general.bfloat16 and not f32._general.bfloat16
    rewrite = [fm._general.config.graph_options.rewrite_options.auto_mixed_precision_onednn_bfloat16
               for fm in (f32, b16)]
    assert rewrite == [0, 1]  # RewriterConfig DEFAULT (off for this rewrite), ON
    x = random_states(64, 4)
    got, exact, want = b16(x), f32(x), ref(x)
    moved = 0.0
    for k in OUTPUTS:
        np.testing.assert_allclose(exact[k], want[k], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=3e-2)
        moved = max(moved, float(np.abs(got[k] - exact[k]).max()))
    if cpu_bfloat16():
        assert moved > 0, "bfloat16=True computed exactly float32's answers"
    with pytest.raises(ValueError, match="bfloat16"):
        backend.TFModel(m, freeze=False, bfloat16=True)
    with pytest.raises(ValueError, match="bfloat16"):
        backend.TFModel(m, freeze=True, jit_compile=True, bfloat16=True)
    with pytest.raises(ValueError, match="GPU"):
        backend.TFModel(m, freeze=True, bfloat16=True, device="/GPU:0")


def test_frozen_graph_output_owns_its_memory(tf: Any, backend: Any) -> None:
    """An output that is the input reshaped does not alias the caller's
    array: refilling the batch buffer (as the evaluator does) leaves an
    earlier answer alone."""
    concrete = tf.function(lambda x: {"flat": tf.reshape(x, [-1, 84]), "same": x}
                           ).get_concrete_function(tf.TensorSpec((None, *INPUT_SHAPE),
                                                                 tf.float32))
    fg = backend.FrozenGraph(concrete)
    x = random_states(3, 2)
    keep = x.copy()
    out = fg(x)
    x[...] = -7.0
    np.testing.assert_array_equal(out["same"], keep)
    np.testing.assert_array_equal(out["flat"], keep.reshape(3, 84))


def assert_weights_equal(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("freeze", [False, True])
def test_keras_weights(freeze: bool, keras: Any, backend: Any, tmp_path: Any) -> None:
    tm = backend.TFModel(pv_net(1), freeze=freeze)
    tm.prepare(Spec.build(INPUT_SHAPE, F32, OUTPUTS, 8, 1, 1), None)
    traces = tm.trace_count
    x = random_states(8, 5)
    w1 = tm.get_weights()
    first = tm(x)

    def outputs_of(seed: int) -> dict[str, np.ndarray]:
        return keras_reference(pv_net(seed))(x)

    def check(expect: dict[str, np.ndarray]) -> None:
        out = tm(x)
        for k in OUTPUTS:
            np.testing.assert_allclose(out[k], expect[k], rtol=1e-5, atol=1e-5)

    w2 = pv_net(2).get_weights()
    tm.set_weights(w2)
    assert_weights_equal(tm.get_weights(), w2)
    check(outputs_of(2))
    # Bad updates raise before anything changes.
    bad = [w.copy() for w in w1]
    bad[-1] = np.zeros(bad[-1].shape + (2,), np.float32)
    with pytest.raises(ValueError, match="shape"):
        tm.set_weights(bad)
    with pytest.raises(ValueError, match=f"got {len(w1) - 1} arrays"):
        tm.set_weights(w1[:-1])
    with pytest.raises(TypeError, match=r"takes a list of arrays .*, got a dict"):
        tm.set_weights(dict(enumerate(w1)))
    assert_weights_equal(tm.get_weights(), w2)
    # A Keras weights file.
    path = str(tmp_path / "three.weights.h5")
    pv_net(3).save_weights(path)
    tm.load_weights(path)
    check(outputs_of(3))
    # A weights file of another architecture fails and leaves them alone.
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    other_path = str(tmp_path / "other.weights.h5")
    other.save_weights(other_path)
    w3 = tm.get_weights()
    with pytest.raises(Exception):
        tm.load_weights(other_path)
    assert_weights_equal(tm.get_weights(), w3)
    # .npz in get_weights() order; a bad one is refused.
    np.savez(tmp_path / "one.npz", *w1)
    tm.load_weights(tmp_path / "one.npz")
    check(first)
    np.savez(tmp_path / "bad.npz", *bad)
    with pytest.raises(ValueError, match="shape"):
        tm.load_weights(tmp_path / "bad.npz")
    check(first)
    assert tm.trace_count == traces, "a weight update retraced"


@pytest.mark.parametrize("freeze", [False, True])
def test_hot_swap_through_evaluator(freeze: bool, backend: Any, tmp_path: Any) -> None:
    """ev.set_weights / ev.load_weights reach TFModel between batches:
    answers follow the new weights (with freeze, folded again), a refused
    update changes nothing, and nothing is retraced."""
    tm = backend.TFModel(pv_net(1), freeze=freeze)
    with shmeval.Evaluator(tm, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=64,
                           max_clients=4, slots_per_client=32) as ev:
        traces = tm.trace_count
        np.savez(tmp_path / "three.npz", *pv_net(3).get_weights())
        updates_through_evaluator(ev, [keras_reference(pv_net(v)) for v in (1, 2, 3)],
                                  pv_net(2).get_weights(), tmp_path / "three.npz")
        assert tm.trace_count == traces


@pytest.mark.parametrize("freeze", [False, True])
@pytest.mark.parametrize("saved", [False, True])
def test_module_weights(saved: bool, freeze: bool, tf: Any, backend: Any,
                        tmp_path: Any) -> None:
    """A tf.Module's variables, or a SavedModel's (through its signature)."""
    mod = make_module(tf, 1)
    source: Any = mod
    if saved:
        tf.saved_model.save(mod, str(tmp_path / "sm"))
        source = str(tmp_path / "sm")
    tm = backend.TFModel(source, freeze=freeze)
    tm.prepare(Spec.build(INPUT_SHAPE, F32, OUTPUTS, 8, 1, 1), None)
    traces = tm.trace_count
    old = tm.get_weights()
    assert sorted(w.shape for w in old) == [(8,), (84, 8)]
    x = random_states(5, 6)
    other = make_module(tf, 2)
    new = [other.w.numpy(), other.b.numpy()]
    if old[0].shape != (84, 8):
        new.reverse()
    with pytest.raises(ValueError, match="shape"):
        tm.set_weights(new[::-1])
    assert_weights_equal(tm.get_weights(), old)
    np.savez(tmp_path / "w.npz", *new)
    tm.load_weights(tmp_path / "w.npz")
    assert_weights_equal(tm.get_weights(), new)
    out, expect = tm(x), module_reference(other)(x)
    for k in OUTPUTS:
        np.testing.assert_allclose(out[k], expect[k], rtol=1e-5, atol=1e-5)
    tm.set_weights(old)
    assert_weights_equal(tm.get_weights(), old)
    assert tm.trace_count == traces


CONFIGURE_CHILD = r"""
import collections, os, warnings
import tensorflow as tf
from shmeval.backends.tensorflow import configure
configure(intra_op_threads=1, inter_op_threads=3)
(tf.random.normal([64, 64]) @ tf.random.normal([64, 64])).numpy()   # initialises TF
assert tf.config.threading.get_intra_op_parallelism_threads() == 1
assert tf.config.threading.get_inter_op_parallelism_threads() == 3
names = collections.Counter(open(f"/proc/self/task/{t}/comm").read().strip()
                            for t in os.listdir("/proc/self/task"))
# TensorFlow names its inter-op pool threads tf_Compute (if that changes, skip this).
assert names.get("tf_Compute", 3) == 3, names
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    configure(intra_op_threads=1, inter_op_threads=3)   # already in force: no warning
    assert not caught, [str(w.message) for w in caught]
    configure(intra_op_threads=2)                       # too late: a warning, no error
    assert len(caught) == 1 and "intra-op" in str(caught[0].message), caught
assert tf.config.threading.get_intra_op_parallelism_threads() == 1
print("configured")
"""


def test_configure_threads_in_fresh_process() -> None:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    r = subprocess.run([sys.executable, "-c", CONFIGURE_CHILD], capture_output=True,
                       text=True, timeout=TIMEOUT, env=env)
    assert r.returncode == 0 and "configured" in r.stdout, r.stdout + r.stderr


def test_backends_package_does_not_import_tensorflow() -> None:
    code = ("import sys, shmeval, shmeval.backends; "
            "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr


def test_bad_sources_raise(backend: Any, tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="neither a SavedModel"):
        backend.TFModel(str(tmp_path / "missing.onnx"))
    with pytest.raises(TypeError, match="got int"):
        backend.TFModel(3)


def test_cuda_names_map_to_tf_gpus(backend: Any) -> None:
    """"cuda:N" (what Evaluator.spawn(devices=...) hands a replica's factory)
    is TensorFlow's "/GPU:N"; its own names pass through."""
    assert backend.tf_device("cuda:1") == "/GPU:1"
    assert backend.tf_device("cuda") == "/GPU:0"
    assert backend.tf_device("/GPU:2") == "/GPU:2"
    assert backend.tf_device("/CPU:0") == "/CPU:0"
    assert backend.tf_device(None) is None
