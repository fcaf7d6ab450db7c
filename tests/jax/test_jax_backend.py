"""The JAX backend, ``shmeval.backends.jax``, on the CPU.

- outputs served through an Evaluator equal apply_fn called directly, for
  dict, tuple, named tuple and single outputs and bfloat16 params, at many
  batch sizes, also from two serving threads; one trace per batch size,
  none while serving;
- mismatches between the outputs and the spec fail at Evaluator
  construction with a ModelError; bad arguments fail at JaxModel();
- buckets: padding never leaks into results;
- set_weights / get_weights / load_weights (list, pytree, .npz): bad
  updates leave the params alone, nothing is traced again; the same
  through the evaluator, and under load from spawn workers that never
  import JAX;
- a batch whose host callback raises, or that gives NaN, fails alone; a
  runtime error of XLA's status INTERNAL is told apart as a lost device.

JAX is imported by fixtures, not at module import, so collecting the suite
does not load it into the pytest process (other tests fork).
"""
from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import jax_models
import shmeval
from backend_contract import (F32, INPUT_SHAPE, OUTPUTS, TIMEOUT, hot_swap_under_load,
                              mismatch_cases, mismatch_fails_at_construction, module_fixture,
                              random_states, serve_and_compare, serves_after_bad_batches,
                              updates_through_evaluator)
from helpers import own_segments
from jax_models import apply_fn, params_of, reference
from shmeval.spec import Spec

#: Powers of two up to max_batch 64: the batch sizes compiled by default.
POW2 = 7


jax = module_fixture("jax")
backend = module_fixture("shmeval.backends.jax")


CASES = {
    # kind: (outputs of apply_fn, declared outputs, params dtype)
    "dict": ("dict", OUTPUTS, np.float32),
    "named_tuple_by_name": ("named", OUTPUTS, np.float32),
    "one_output": ("policy", {"policy": ((7,), F32)}, np.float32),
    "bfloat16_params": ("dict", OUTPUTS, "bfloat16"),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_served_outputs_equal_direct_call(kind: str, jax: Any, backend: Any) -> None:
    what, outputs, dtype = CASES[kind]
    if dtype == "bfloat16":
        dtype = jax.numpy.bfloat16
    params = params_of(1, dtype)
    jm = backend.JaxModel(apply_fn(what), params)
    atol = 3e-2 if kind == "bfloat16_params" else 1e-5
    with shmeval.Evaluator(jm, input_shape=INPUT_SHAPE, outputs=outputs, max_batch=64,
                           max_clients=4, slots_per_client=32) as ev:
        assert jm.trace_count == POW2 and jm.warmup_s > 0
        serve_and_compare(ev, reference(what, params), tuple(outputs), atol=atol)
        serve_and_compare(ev, reference(what, params), tuple(outputs), seed=100, atol=atol)
        assert jm.trace_count == POW2, "serving traced the model again"
        assert ev.stats()["failed_requests"] == 0


def test_two_serving_threads(jax: Any, backend: Any) -> None:
    """Two serving threads call one JaxModel at once (its max_concurrency
    says they may): every answer is still its own state's."""
    params = params_of(2)
    jm = backend.JaxModel(apply_fn("dict"), params)
    assert jm.max_concurrency == 2
    with shmeval.Evaluator(jm, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=64,
                           max_clients=4, slots_per_client=32, serving_threads=2) as ev:
        serve_and_compare(ev, reference("dict", params), tuple(OUTPUTS))
        assert ev.stats()["failed_requests"] == 0
        assert jm.trace_count == POW2, "serving traced the model again"


def test_tuple_outputs_by_order(jax: Any, backend: Any) -> None:
    """(value, policy) without names: matched by order to declared (v, p)."""
    params = params_of(2)
    ref = reference("tuple", params)
    with shmeval.Evaluator(backend.JaxModel(apply_fn("tuple"), params),
                           input_shape=INPUT_SHAPE, outputs={"v": ((), F32), "p": ((7,), F32)},
                           max_batch=64, max_clients=4, slots_per_client=32) as ev:
        serve_and_compare(ev, lambda x: {"v": ref(x)["value"], "p": ref(x)["policy"]},
                          ("v", "p"), sizes=(1, 5, 64))


def test_cast_to_declared_dtype(jax: Any, backend: Any) -> None:
    jm = backend.JaxModel(apply_fn("dict"), params_of(3))
    spec = Spec.build(INPUT_SHAPE, F32, {"policy": ((7,), "float16"), "value": ((), F32)},
                      8, 1, 1)
    assert jm.prepare(spec, None) == (1, 2, 4, 8)
    x = random_states(4, 1)
    out = jm(x)
    assert out["policy"].dtype == np.float16
    np.testing.assert_allclose(out["policy"], reference("dict", params_of(3))(x)["policy"],
                               rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("case, what", mismatch_cases({"ordered": ["tuple"], "named": ["dict"]}))
def test_mismatch_fails_at_construction(case: str, what: str, jax: Any, backend: Any) -> None:
    mismatch_fails_at_construction(case, backend.JaxModel(apply_fn(what), params_of(0)))


def test_bad_arguments(jax: Any, backend: Any) -> None:
    with pytest.raises(TypeError, match="callable apply_fn"):
        backend.JaxModel(3, params_of(0))
    with pytest.raises(ValueError, match="no 'tpu' device"):
        backend.JaxModel(apply_fn(), params_of(0), device="tpu")
    with pytest.raises(ValueError, match="buckets must be positive"):
        backend.JaxModel(apply_fn(), params_of(0), buckets=[0])
    jm = backend.JaxModel(apply_fn(), params_of(0), buckets=[4])
    with pytest.raises(shmeval.ModelError, match="largest must be >= max_batch"):
        shmeval.Evaluator(jm, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=8)
    jm.prepare(Spec.build(INPUT_SHAPE, F32, OUTPUTS, 4, 1, 1), None)
    with pytest.raises(ValueError, match=r"compiled for batches of \[4\] rows, got 3"):
        jm(random_states(3, 0))
    assert not own_segments()


@pytest.mark.parametrize("where", ["evaluator", "jaxmodel"])
def test_bucket_padding_never_leaks(where: str, jax: Any, backend: Any) -> None:
    params = params_of(4)
    buckets = [4, 16, 64]
    jm = backend.JaxModel(apply_fn(), params, buckets=buckets if where == "jaxmodel" else None)
    with shmeval.Evaluator(jm, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=64,
                           buckets=buckets if where == "evaluator" else None,
                           max_clients=4, slots_per_client=64) as ev:
        assert jm.trace_count == len(buckets)
        serve_and_compare(ev, reference("dict", params), tuple(OUTPUTS),
                          sizes=(64, 3, 1, 17, 5, 64, 2))
        assert ev.stats()["padded_rows"] > 0
        assert jm.trace_count == len(buckets)


def test_bad_batches_fail_alone(jax: Any, backend: Any) -> None:
    jm = backend.JaxModel(jax_models.misbehaving_apply(), params_of(0))
    with shmeval.Evaluator(jm, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=8,
                           max_clients=2, slots_per_client=4) as ev:
        serves_after_bad_batches(ev, {1: ["state out of range"], 5: ["'value' holds NaN"]})
        assert ev.stats()["failed_requests"] == 2


def test_device_errors_are_told_apart(jax: Any) -> None:
    """JAX's own runtime error: of XLA's status INTERNAL it ends the serving
    process (the device failed), of another status it fails the batch, and
    so does a host callback that raised, which XLA also reports as
    INTERNAL (test_bad_batches_fail_alone serves one)."""
    from shmeval.backends._fatal import device_lost

    error = jax.errors.JaxRuntimeError
    assert device_lost(error("INTERNAL: Failed to launch CUDA kernel: CUDA_ERROR_ILLEGAL_ADDRESS"))
    assert device_lost(error("INTERNAL: stream did not block host until done"))
    assert not device_lost(error("RESOURCE_EXHAUSTED: Out of memory allocating 8589934592 bytes"))

    def refuse(x: Any) -> Any:
        raise ValueError("the callback refuses")

    f = jax.jit(lambda x: jax.pure_callback(refuse, jax.ShapeDtypeStruct(x.shape, x.dtype), x))
    with pytest.raises(error) as ei:
        f(jax.numpy.ones(3)).block_until_ready()
    assert str(ei.value).startswith("INTERNAL:")   # as XLA reports it
    assert not device_lost(ei.value)


def test_weights(jax: Any, backend: Any, tmp_path: Any) -> None:
    jm = backend.JaxModel(apply_fn(), params_of(1))
    jm.prepare(Spec.build(INPUT_SHAPE, F32, OUTPUTS, 8, 1, 1), None)
    traces = jm.trace_count
    x = random_states(8, 5)
    w1 = jm.get_weights()
    assert len(w1) == 6

    def check(seed: int) -> None:
        out, expect = jm(x), reference("dict", params_of(seed))(x)
        for k in OUTPUTS:
            np.testing.assert_allclose(out[k], expect[k], rtol=1e-5, atol=1e-5)

    jm.set_weights(params_of(2))  # a pytree
    check(2)
    jm.set_weights(jax.tree_util.tree_leaves(params_of(3)))  # a list
    check(3)
    w3 = jm.get_weights()
    bad = [w.copy() for w in w1]
    bad[0] = np.zeros(bad[0].shape + (2,), np.float32)
    with pytest.raises(ValueError, match="shape"):
        jm.set_weights(bad)
    with pytest.raises(ValueError, match=f"got {len(w1) - 1} arrays"):
        jm.set_weights(w1[:-1])
    with pytest.raises(ValueError, match="cannot be cast"):
        jm.set_weights([w.astype(np.complex64) for w in w1])
    other = params_of(2)
    other["extra"] = {"w": np.zeros(1, np.float32)}
    with pytest.raises(ValueError, match="structure"):
        jm.set_weights(other)
    for a, b in zip(jm.get_weights(), w3):
        np.testing.assert_array_equal(a, b)
    check(3)
    np.savez(tmp_path / "one.npz", *w1)
    jm.load_weights(tmp_path / "one.npz")
    check(1)
    np.savez(tmp_path / "bad.npz", *bad)
    with pytest.raises(ValueError, match="shape"):
        jm.load_weights(tmp_path / "bad.npz")
    check(1)
    assert jm.trace_count == traces, "a weight update traced the model again"


def test_hot_swap_through_evaluator(jax: Any, backend: Any, tmp_path: Any) -> None:
    jm = backend.JaxModel(apply_fn(), params_of(1))
    with shmeval.Evaluator(jm, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=64,
                           max_clients=4, slots_per_client=32) as ev:
        traces = jm.trace_count
        np.savez(tmp_path / "three.npz", *jax.tree_util.tree_leaves(params_of(3)))
        updates_through_evaluator(ev, [reference("dict", params_of(v)) for v in (1, 2, 3)],
                                  jax.tree_util.tree_leaves(params_of(2)),
                                  tmp_path / "three.npz")
        assert jm.trace_count == traces


def test_a_params_pytree_pushed_through_the_evaluator(jax: Any, backend: Any) -> None:
    """ev.set_weights(params) with the params pytree itself (JAX arrays at
    the leaves) reaches the model: the answers follow it."""
    jm = backend.JaxModel(apply_fn(), params_of(1))
    with shmeval.Evaluator(jm, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=64,
                           max_clients=4, slots_per_client=32) as ev:
        assert ev.set_weights(jax.tree_util.tree_map(jax.numpy.asarray, params_of(2))) == 1
        serve_and_compare(ev, reference("dict", params_of(2)), tuple(OUTPUTS), sizes=(3, 40))


@pytest.mark.timeout(240)
def test_jax_hot_swap_under_load(jax: Any) -> None:
    """A spawned evaluator (pv_factory) under load from spawn workers that
    never import JAX; 8 weight updates; every answer matches its version."""
    hot_swap_under_load(jax_models.pv_factory,
                        [jax.tree_util.tree_leaves(params_of(v)) for v in range(9)],
                        lambda v, states: reference("dict", params_of(v))(states))


def test_backends_package_does_not_import_jax() -> None:
    code = ("import sys, shmeval, shmeval.backends, shmeval.backends._contract; "
            "assert not {'jax', 'jaxlib', 'torch', 'tensorflow'} & set(sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr


def test_cuda_names_map_to_jax_gpus(jax: Any, backend: Any,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """"cuda:N" (what Evaluator.spawn(devices=...) hands a replica's factory)
    is the N-th of jax.devices("gpu"); shown with two made-up GPUs."""
    gpus = ["gpu0", "gpu1"]
    real = jax.devices

    def devices(platform: Any = None) -> Any:
        return list(gpus) if platform == "gpu" else real(platform)

    monkeypatch.setattr(jax, "devices", devices)
    assert backend._device("cuda:1") == "gpu1"
    assert backend._device("cuda") == "gpu0"
    assert backend._device("gpu") == "gpu0"
    assert backend._device("cpu") == real("cpu")[0]
    with pytest.raises(ValueError, match=r"no 'cuda:2' device here \(2 GPU\(s\)\)"):
        backend._device("cuda:2")
    monkeypatch.setattr(jax, "devices", real)
    if not any(d.platform == "gpu" for d in real()):
        with pytest.raises(ValueError, match="no 'cuda:0' device here"):
            backend._device("cuda:0")
