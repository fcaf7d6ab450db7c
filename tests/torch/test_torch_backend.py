"""The PyTorch backend, ``shmeval.backends.torch``, on the CPU.

- outputs served through an Evaluator equal the model called directly, for
  every kind of model TorchModel accepts (nn.Module with dict, tuple,
  named tuple and single outputs; TorchScript file; exported program and
  its file; torch.compile; bfloat16 autocast; two serving threads), at
  many batch sizes; nothing compiles again while serving;
- mismatches between the outputs and the spec fail at Evaluator
  construction with a ModelError; bad arguments fail at TorchModel();
- buckets: padding never leaks into results, one compiled graph per size;
- set_weights / get_weights / load_weights (state dict file, .npz), bad
  updates leave the weights alone; the same through the evaluator, and
  under load from spawn workers that never import torch;
- a batch that raises, returns an output on another device, the wrong
  shape or dtype, NaN, or runs out of memory fails alone; an error after
  which the device is lost (a device-side assert) ends the serving
  process instead, and the restarted one answers;
- on the CPU a module serves frozen where its frozen trace answers as it
  does (else unfrozen, saying why), and is frozen again after updates;
  small batches take its form on PyTorch's own convolution where that is
  cheaper, rewritten only where that kernel computes the same.

PyTorch is imported by fixtures, not at module import, so collecting the
suite does not load it into the pytest process (other tests fork).
"""
from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
import sys
import time
from typing import Any

import numpy as np
import pytest

import shmeval
import torch_models
from backend_contract import (F32, INPUT_SHAPE, OUTPUTS, TIMEOUT, hot_swap_under_load,
                              mismatch_cases, mismatch_fails_at_construction, random_states,
                              serve_and_compare, serves_after_bad_batches,
                              updates_through_evaluator)
from helpers import own_segments
from shmeval.spec import Spec
from torch_models import pv_net, reference

# TorchScript is deprecated, and still what many saved models are.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")


@pytest.fixture(scope="module")
def torch() -> Any:
    import torch

    torch.set_num_threads(1)  # the machine is shared; batches are small
    return torch


@pytest.fixture(scope="module")
def backend(torch: Any) -> Any:
    from shmeval.backends import torch as backend

    return backend


def traced(torch: Any, net: Any) -> Any:
    """The net as a TorchScript module (dict outputs need strict=False)."""
    return torch.jit.trace(net, torch.zeros(2, *INPUT_SHAPE), strict=False)


def make_case(kind: str, torch: Any, tmp: Any) -> tuple[Any, dict[str, Any], Any, dict[str, Any]]:
    """(what to give TorchModel, declared outputs, reference, TorchModel keywords)."""
    if kind == "module_dict":
        m = pv_net(1, "dict")
        return m, OUTPUTS, reference(m), {}
    if kind == "tuple_by_order":  # (value, policy), unnamed: by order
        m = pv_net(2, "tuple")
        ref = reference(m)
        return m, {"v": ((), F32), "p": ((7,), F32)}, \
            lambda x: {"v": ref(x)["value"], "p": ref(x)["policy"]}, {}
    if kind == "named_tuple_by_name":  # (value, policy) named: by name
        m = pv_net(3, "named")
        return m, OUTPUTS, reference(m), {}
    if kind == "one_output":
        m = pv_net(4, "policy")
        return m, {"policy": ((7,), F32)}, reference(m), {}
    if kind == "torchscript_file":
        m = pv_net(5, "dict")
        path = tmp / "pv.ts"
        traced(torch, m).save(str(path))
        return str(path), OUTPUTS, reference(m), {}
    if kind in ("exported_program", "exported_file"):
        m = pv_net(6, "dict")
        batch = torch.export.Dim("batch", min=1, max=4096)
        ep = torch.export.export(m, (torch.zeros(2, *INPUT_SHAPE),),
                                 dynamic_shapes=({0: batch},))
        if kind == "exported_program":
            return ep, OUTPUTS, reference(m), {}
        torch.export.save(ep, str(tmp / "pv.pt2"))
        return tmp / "pv.pt2", OUTPUTS, reference(m), {}
    if kind == "compiled":
        m = pv_net(7, "dict")
        return m, OUTPUTS, reference(m), {"compile": "aot_eager"}
    if kind == "bfloat16":
        m = pv_net(8, "dict")
        return m, OUTPUTS, reference(m), {"dtype": "bfloat16"}
    raise AssertionError(kind)


KINDS = ["module_dict", "tuple_by_order", "named_tuple_by_name", "one_output",
         "torchscript_file", "exported_program", "exported_file", "compiled", "bfloat16"]


@pytest.mark.parametrize("kind", KINDS)
def test_served_outputs_equal_direct_call(kind: str, torch: Any, backend: Any,
                                          tmp_path: Any) -> None:
    source, outputs, ref, kwargs = make_case(kind, torch, tmp_path)
    tm = backend.TorchModel(source, **kwargs)
    assert tm.device == torch.device("cpu")
    atol = 3e-2 if kind == "bfloat16" else 1e-5
    with shmeval.Evaluator(tm, input_shape=INPUT_SHAPE, outputs=outputs, max_batch=64,
                           max_clients=4, slots_per_client=32) as ev:
        compiled = tm.compile_count
        assert tm.warmup_s > 0
        if kind == "compiled":
            # One graph per batch size: powers of two up to max_batch.
            assert compiled == 7
        serve_and_compare(ev, ref, tuple(outputs), atol=atol)
        serve_and_compare(ev, ref, tuple(outputs), seed=100, atol=atol)
        assert tm.compile_count == compiled, "serving compiled the model again"
        assert ev.stats()["failed_requests"] == 0
    if kind == "bfloat16":
        x = random_states(16, 3)
        moved = max(float(np.abs(tm(x)[k] - ref(x)[k]).max()) for k in outputs)
        assert moved > 0, "dtype='bfloat16' computed exactly float32's answers"


def test_two_serving_threads(torch: Any, backend: Any) -> None:
    m = pv_net(9, "dict")
    with shmeval.Evaluator(backend.TorchModel(m), input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                           max_batch=64, max_clients=4, slots_per_client=32,
                           serving_threads=2) as ev:
        serve_and_compare(ev, reference(m), tuple(OUTPUTS))
        assert ev.stats()["failed_requests"] == 0


def test_cast_to_declared_dtype(torch: Any, backend: Any) -> None:
    """float32 outputs served as declared float16 / float64: with a reshape
    (the value head's (n, 1) declared a scalar), and alone (outputs of the
    declared shapes)."""
    m = pv_net(10, "dict")
    tm = backend.TorchModel(m)
    spec = Spec.build(INPUT_SHAPE, F32, {"policy": ((7,), "float16"), "value": ((), "float64")},
                      8, 1, 1)
    assert tm.prepare(spec, None) is None
    x = random_states(5, 1)
    out, expect = tm(x), reference(m)(x)
    assert out["policy"].dtype == np.float16 and out["value"].dtype == np.float64
    np.testing.assert_allclose(out["value"], expect["value"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["policy"], expect["policy"], rtol=1e-3, atol=1e-3)
    one = backend.TorchModel(pv_net(10, "policy"))
    one.prepare(Spec.build(INPUT_SHAPE, F32, {"policy": ((7,), "float16")}, 8, 1, 1), None)
    policy = one(x)["policy"]
    assert policy.dtype == np.float16
    np.testing.assert_allclose(policy, expect["policy"], rtol=1e-3, atol=1e-3)


def test_standalone_call_keeps_the_models_structure(torch: Any, backend: Any) -> None:
    x = random_states(3, 2)
    out = backend.TorchModel(pv_net(11, "tuple"))(x)
    assert isinstance(out, tuple) and [o.shape for o in out] == [(3, 1), (3, 7)]
    out = backend.TorchModel(pv_net(11, "dict"))(x)
    np.testing.assert_allclose(out["policy"], reference(pv_net(11))(x)["policy"], atol=1e-6)


@pytest.mark.parametrize("case, what", mismatch_cases({"ordered": ["tuple"], "named": ["dict"]}))
def test_mismatch_fails_at_construction(case: str, what: str, torch: Any, backend: Any) -> None:
    mismatch_fails_at_construction(case, backend.TorchModel(pv_net(0, what)),
                                   float32="torch.float32")


def test_a_model_that_fails_at_start_up(torch: Any, backend: Any) -> None:
    """The warm-up batch of zeros already fails: ModelError from the
    constructor, naming the batch and the model's error."""
    class Broken(torch.nn.Module):  # type: ignore[misc, name-defined]
        def forward(self, x: Any) -> Any:
            raise RuntimeError("weights missing")

    with pytest.raises(shmeval.ModelError, match="batch of 1 zero states: RuntimeError: "
                                                 "weights missing"):
        shmeval.Evaluator(backend.TorchModel(Broken()), input_shape=INPUT_SHAPE,
                          outputs=OUTPUTS, max_batch=8)
    assert not own_segments()


def test_an_exported_program_of_one_batch_size(torch: Any, backend: Any) -> None:
    """Exported without a dynamic batch dimension, a program runs one batch
    size only: the start-up error says how to export it."""
    ep = torch.export.export(pv_net(6, "dict"), (torch.zeros(2, *INPUT_SHAPE),))
    with pytest.raises(shmeval.ModelError, match=r"batch of 1 zero states: .*export it with a "
                                                 r"dynamic batch dimension: .*dynamic_shapes"):
        shmeval.Evaluator(backend.TorchModel(ep), input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                          max_batch=8)
    assert not own_segments()


def test_bad_arguments(torch: Any, backend: Any, tmp_path: Any) -> None:
    m = pv_net(0)
    with pytest.raises(ValueError, match="is not available here"):
        backend.TorchModel(m, device="cuda")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        backend.TorchModel(m, cuda_graphs=True)
    with pytest.raises(ValueError, match="CPU or a CUDA device"):
        backend.TorchModel(m, device="meta")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        backend.TorchModel(m, dtype="int8")
    with pytest.raises(ValueError, match="lanes"):
        backend.TorchModel(m, lanes=0)
    with pytest.raises(ValueError, match="buckets must be positive"):
        backend.TorchModel(m, buckets=[0, 4])
    with pytest.raises(ValueError, match="neither an exported program"):
        backend.TorchModel(str(tmp_path / "missing.pt"))
    with pytest.raises(TypeError, match="got int"):
        backend.TorchModel(3)
    tm = backend.TorchModel(m, buckets=[4])
    with pytest.raises(shmeval.ModelError, match="largest must be >= max_batch"):
        shmeval.Evaluator(tm, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=8)
    assert not own_segments()


@pytest.mark.parametrize("where", ["evaluator", "torchmodel"])
def test_bucket_padding_never_leaks(where: str, torch: Any, backend: Any) -> None:
    """Batches padded to buckets (the evaluator's, or the ones TorchModel's
    prepare returns): stale rows of an earlier, larger batch fill the
    padding; every real row is still its own state's answer, and one graph
    was compiled per bucket, none while serving."""
    m = pv_net(12, "dict")
    buckets = [4, 16, 64]
    tm = backend.TorchModel(m, compile="aot_eager",
                            buckets=buckets if where == "torchmodel" else None)
    with shmeval.Evaluator(tm, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=64,
                           buckets=buckets if where == "evaluator" else None,
                           max_clients=4, slots_per_client=64) as ev:
        assert tm.compile_count == len(buckets)
        serve_and_compare(ev, reference(m), tuple(OUTPUTS), sizes=(64, 3, 1, 17, 5, 64, 2))
        assert ev.stats()["padded_rows"] > 0
        # Any other batch size would have compiled a graph of its own.
        assert tm.compile_count == len(buckets)


def test_bad_batches_fail_alone(torch: Any, backend: Any) -> None:
    """Each failure fails its batch with a ModelError saying why; the
    evaluator answers the next request."""
    tm = backend.TorchModel(torch_models.misbehaving_net())
    with shmeval.Evaluator(tm, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=8,
                           max_clients=2, slots_per_client=4) as ev:
        serves_after_bad_batches(ev, {
            1: ["RuntimeError: state out of range"],
            2: ["'policy' is on meta", "serves on cpu"],
            3: ["RuntimeError", "meta"],
            4: ["'policy'", "(5,) per row", "declares (7,)"],
            5: ["'value' holds NaN"],
            6: ["out of memory on cpu for a batch of 1 rows", "Tried to allocate 2 GiB"],
            7: ["'policy'", "torch.complex64", "cannot be cast"],
        })
        assert ev.stats()["failed_requests"] == 7


def test_a_lost_device_ends_the_process_and_the_restart_answers(tmp_path: Any) -> None:
    """The module raises PyTorch's error after a device-side assert (and
    would on every call after it): the serving process ends instead of
    failing the batch, and the restarted one answers every request, the
    lost batch's too, as the module does."""
    factory = functools.partial(torch_models.failing_device_factory, str(tmp_path / "failed"))
    with shmeval.Evaluator.spawn(factory, restarts=1, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                 max_batch=8, slots_per_client=8, serving_threads=1) as ev:
        old = ev.pid
        serve_and_compare(ev, reference(pv_net(0, "dict")), tuple(OUTPUTS), sizes=(5, 9, 3))
        assert (tmp_path / "failed").exists()  # the device did fail
        st = ev.stats()
        assert st["failed_requests"] == 0 and st["isolation_calls"] == 0
        assert st["requests"] == 5 + 9 + 3 + 2 * 12
        deadline = time.monotonic() + TIMEOUT
        while not ev.stats()["restarts"]:  # the answers may come before the record
            assert time.monotonic() < deadline, "the process was not restarted"
            time.sleep(0.01)
        rec, = ev.stats()["restarts"]
        assert rec["pid"] == old != ev.pid
        assert rec["why"].startswith("its device failed: RuntimeError: "
                                     + torch_models.DEVICE_ASSERT), rec


def test_device_errors_are_told_apart(torch: Any) -> None:
    """PyTorch's own exception types: a sticky CUDA error ends the serving
    process, running out of memory does not (that batch fails alone:
    test_bad_batches_fail_alone)."""
    from shmeval.backends._fatal import device_lost

    suffix = ("\nCUDA kernel errors might be asynchronously reported at some other API call"
              "\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.")
    assert device_lost(torch.AcceleratorError(
        "CUDA error: device-side assert triggered\nSearch for `cudaErrorAssert' in "
        "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html" + suffix))
    assert device_lost(torch.AcceleratorError(
        "CUDA error: an illegal memory access was encountered" + suffix))
    assert not device_lost(torch.AcceleratorError(
        "CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation' in "
        "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html" + suffix))
    assert not device_lost(torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB"))
    try:
        torch.zeros(3)[torch.tensor([5])]
    except IndexError as e:  # the CPU's index check, before any device is involved
        assert not device_lost(e)


def version_weights(version: int) -> list[np.ndarray]:
    """The weights of version v: pv_net(seed=v)'s, in state_dict order."""
    return [t.numpy() for t in pv_net(version).state_dict().values()]


def assert_weights_equal(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("source", ["module", "torchscript"])
def test_weights(source: str, torch: Any, backend: Any, tmp_path: Any) -> None:
    net = pv_net(1)
    given: Any = net
    if source == "torchscript":
        traced(torch, net).save(str(tmp_path / "pv.ts"))
        given = str(tmp_path / "pv.ts")
    tm = backend.TorchModel(given, compile="aot_eager" if source == "module" else False)
    tm.prepare(Spec.build(INPUT_SHAPE, F32, OUTPUTS, 8, 1, 1), None)
    compiled = tm.compile_count
    x = random_states(8, 5)
    w1 = tm.get_weights()
    assert [w.dtype for w in w1].count(np.int64) == 1  # the batch norm's counter
    first = {k: v.copy() for k, v in tm(x).items()}

    def check(seed: int) -> None:
        out, expect = tm(x), reference(pv_net(seed))(x)
        for k in OUTPUTS:
            np.testing.assert_allclose(out[k], expect[k], rtol=1e-5, atol=1e-5)

    w2 = pv_net(2).state_dict()
    tm.set_weights(w2)  # a state dict
    check(2)
    tm.set_weights(version_weights(3))  # a list
    check(3)
    w3 = tm.get_weights()
    # Bad updates raise before anything changes.
    bad = [w.copy() for w in w1]
    bad[0] = np.zeros(bad[0].shape + (2,), np.float32)
    with pytest.raises(ValueError, match="shape"):
        tm.set_weights(bad)
    with pytest.raises(ValueError, match=f"got {len(w1) - 1} arrays"):
        tm.set_weights(w1[:-1])
    complex_w = [w.astype(np.complex64) if w.dtype == np.float32 else w for w in w1]
    with pytest.raises(ValueError, match="cannot be cast"):
        tm.set_weights(complex_w)
    partial = dict(w2)
    partial.pop("conv.weight")
    partial["extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"lacks \['conv.weight'\].*unexpected \['extra'\]"):
        tm.set_weights(partial)
    assert_weights_equal(tm.get_weights(), w3)
    # A state dict file; a bad one (another architecture) leaves them alone.
    torch.save(pv_net(4).state_dict(), tmp_path / "four.pt")
    tm.load_weights(tmp_path / "four.pt")
    check(4)
    w4 = tm.get_weights()
    torch.save(torch.nn.Linear(3, 2).state_dict(), tmp_path / "other.pt")
    with pytest.raises(ValueError, match="lacks"):
        tm.load_weights(tmp_path / "other.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="not a state dict"):
        tm.load_weights(tmp_path / "list.pt")
    assert_weights_equal(tm.get_weights(), w4)
    # .npz in state_dict order; a bad one is refused.
    np.savez(tmp_path / "one.npz", *w1)
    tm.load_weights(tmp_path / "one.npz")
    for k in OUTPUTS:
        # Not bit for bit: the first answers may come from the frozen
        # module (the batch norm folded into the conv) and these, after
        # updates too frequent to freeze again, from the module.
        np.testing.assert_allclose(tm(x)[k], first[k], rtol=1e-5, atol=1e-6)
    np.savez(tmp_path / "bad.npz", *bad)
    with pytest.raises(ValueError, match="shape"):
        tm.load_weights(tmp_path / "bad.npz")
    assert_weights_equal(tm.get_weights(), w1)
    assert tm.compile_count == compiled, "a weight update compiled the model again"


def _branching_net(torch: Any) -> Any:
    """A net whose answer depends on a Python branch on its input: a trace
    records one branch (and warns)."""
    class Branching(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            h = x.flatten(1)
            if h.sum() > 0:
                h = -h
            return {"policy": h[:, :7], "value": h[:, 7:8]}

    return Branching()


def _answers_match(tm: Any, net: Any, x: np.ndarray) -> None:
    expect = reference(net)(x)
    for k in OUTPUTS:
        np.testing.assert_allclose(tm(x)[k], expect[k], rtol=1e-5, atol=1e-6)


def test_intra_op_threads(torch: Any, backend: Any) -> None:
    """"auto" splits this process's CPUs between the calls that may be in
    flight, at prepare (frozen: two; unfrozen: one, also where freezing
    was tried and failed); an int sets them at construction; None leaves
    PyTorch's setting; anything else is refused."""
    cpus = len(os.sched_getaffinity(0))
    spec = Spec.build(INPUT_SHAPE, F32, OUTPUTS, 8, 1, 1)
    before = torch.get_num_threads()
    try:
        # The named tuple's frozen trace answers as a plain tuple: unfrozen.
        for outputs, freeze, calls in (("dict", "auto", 2), ("named", "auto", 1),
                                       ("dict", False, 1)):
            want = max(1, cpus // calls)
            torch.set_num_threads(want + 3)
            tm = backend.TorchModel(pv_net(1, outputs), freeze=freeze)
            assert torch.get_num_threads() == want + 3
            tm.prepare(spec, None)
            assert tm.max_concurrency == calls, tm.freeze_reason
            assert torch.get_num_threads() == want
        torch.set_num_threads(5)
        backend.TorchModel(pv_net(1), intra_op_threads=None).prepare(spec, None)
        assert torch.get_num_threads() == 5
        backend.TorchModel(pv_net(1), intra_op_threads=3)
        assert torch.get_num_threads() == 3
        for bad in (0, "many", 1.5):
            with pytest.raises(ValueError, match="intra_op_threads"):
                backend.TorchModel(pv_net(1), intra_op_threads=bad)
    finally:
        torch.set_num_threads(before)


def test_frozen_on_the_cpu(torch: Any, backend: Any) -> None:
    """On the CPU an nn.Module serves traced and frozen where the frozen
    module answers as it does, and may then overlap two serving threads'
    calls; freeze=False, a branch on the input (the trace warns) and
    named-tuple outputs (a trace returns a plain tuple) serve the module
    unfrozen, saying why; freeze=True raises where it cannot freeze."""
    spec = Spec.build(INPUT_SHAPE, F32, OUTPUTS, 8, 1, 1)
    x = random_states(8, 5)
    tm = backend.TorchModel(pv_net(1))
    tm.prepare(spec, None)
    assert tm.frozen and tm.max_concurrency == 2, tm.freeze_reason
    assert tm.freeze_s > 0
    _answers_match(tm, pv_net(1), x)
    off = backend.TorchModel(pv_net(1), freeze=False)
    off.prepare(spec, None)
    assert not off.frozen and off.max_concurrency == 1
    assert off.freeze_reason == "served unfrozen: freeze=False"
    named = backend.TorchModel(pv_net(1, outputs="named"))
    named.prepare(spec, None)
    assert not named.frozen and "differs" in named.freeze_reason, named.freeze_reason
    _answers_match(named, pv_net(1, outputs="named"), x)
    branching = backend.TorchModel(_branching_net(torch))
    branching.prepare(spec, None)
    assert not branching.frozen and "tracing warned" in branching.freeze_reason
    with pytest.raises(shmeval.ModelError, match="cannot freeze this module: tracing warned"):
        backend.TorchModel(_branching_net(torch), freeze=True).prepare(spec, None)
    with pytest.raises(ValueError, match="freeze"):
        backend.TorchModel(pv_net(1), freeze="yes")
    with pytest.raises(ValueError, match="freeze=True.*compile"):
        backend.TorchModel(pv_net(1), freeze=True, compile="aot_eager")
    with pytest.raises(ValueError, match="freeze=True.*dtype"):
        backend.TorchModel(pv_net(1), freeze=True, dtype="bfloat16")


def test_the_guide_says_what_freeze_true_raises() -> None:
    """The options table and the code agree: ValueError from TorchModel()
    for arguments that rule freezing out, ModelError for a module that
    cannot be frozen."""
    guide = (Path(__file__).parents[2] / "docs" / "guide.md").read_text()
    row = next(line for line in guide.splitlines()
               if line.startswith('| `freeze` | `"auto"` | on the CPU'))
    assert "`ValueError` from `TorchModel(...)`" in row and "`ModelError` at start-up" in row


def test_weight_updates_freeze_again(torch: Any, backend: Any) -> None:
    """A weight update unfreezes the module (the frozen graph holds the old
    weights); it serves the new weights unfrozen, and is frozen again once
    its calls have lost what freezing costs.  freeze=True freezes again at
    once."""
    spec = Spec.build(INPUT_SHAPE, F32, OUTPUTS, 8, 1, 1)
    x = random_states(8, 5)
    tm = backend.TorchModel(pv_net(1))
    tm.prepare(spec, None)
    assert tm.frozen
    tm.set_weights(pv_net(2).state_dict())
    assert not tm.frozen and "since a weight update" in tm.freeze_reason
    assert tm.max_concurrency == 2  # it will be frozen again
    _answers_match(tm, pv_net(2), x)
    for _ in range(100_000):  # each call counts at least 1 us lost
        tm(x[:1])
        if tm.frozen:
            break
    assert tm.frozen and "frozen again" in tm.freeze_reason, tm.freeze_reason
    _answers_match(tm, pv_net(2), x)
    tm.set_weights(pv_net(3).state_dict())
    tm.methods[""].fold.saving = (1e12, 0.0)  # as if an unfrozen call lost 1000 s: it freezes
    tm(x[:1])
    assert tm.frozen
    _answers_match(tm, pv_net(3), x)
    forced = backend.TorchModel(pv_net(1), freeze=True)
    forced.prepare(spec, None)
    forced.set_weights(pv_net(4).state_dict())
    assert forced.frozen
    _answers_match(forced, pv_net(4), x)


def _conv_zoo(torch: Any) -> Any:
    """Convolutions of every kind: three PyTorch's own kernel can run
    (plain, strided, without bias) and three it cannot (dilated, grouped,
    transposed)."""
    nn = torch.nn

    class Zoo(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(7)
            self.plain = nn.Conv2d(2, 4, 3, padding=1)
            self.strided = nn.Conv2d(4, 4, 2, stride=(1, 2), padding=(1, 0))
            self.no_bias = nn.Conv2d(4, 4, (1, 3), bias=False)
            self.dilated = nn.Conv2d(4, 4, 3, dilation=2, padding=2)
            self.grouped = nn.Conv2d(4, 4, 3, groups=2, padding=1)
            self.transposed = nn.ConvTranspose2d(4, 2, 2)

        def forward(self, x: Any) -> Any:
            h = self.no_bias(self.strided(self.plain(x.permute(0, 3, 1, 2))))
            h = self.transposed(self.grouped(self.dilated(h)))
            return {"policy": h.flatten(1)[:, :7], "value": h.flatten(1)[:, 7]}

    return Zoo().eval()


def test_own_convolution_rewrite(torch: Any, backend: Any) -> None:
    """The frozen graph's convolutions that PyTorch's own kernel can run are
    rewritten to it, the others left to aten::_convolution, and the
    rewritten module answers as the module does at every batch size."""
    zoo = _conv_zoo(torch)
    small = torch.jit.freeze(torch.jit.trace(zoo, torch.zeros(2, *INPUT_SHAPE), strict=False))
    assert backend._own_convolutions(small) == 3
    kinds = [n.kind() for n in small.graph.nodes()]
    assert kinds.count("aten::thnn_conv2d") == 3 and kinds.count("aten::_convolution") == 3
    for rows in (1, 3, 16):
        x = torch.from_numpy(random_states(rows, rows))
        with torch.inference_mode():
            want, got = zoo(x), small(x)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_own_convolution_rows(backend: Any, monkeypatch: Any) -> None:
    """own_conv_rows: the sizes are timed from 2 rows up until the first
    where oneDNN's form is cheaper, and split where the costs cross."""
    spec = Spec.build(INPUT_SHAPE, F32, OUTPUTS, 64, 1, 1)
    last: list[Any] = []

    def form(name: str) -> Any:
        def call(x: Any) -> None:
            last[:] = [name, len(x)]
        return call

    def run(frozen_ns: Any, small_ns: Any, sizes: Any = None) -> tuple[int, list[int]]:
        timed: list[int] = []

        def best_ns(call: Any) -> float:
            call()
            name, rows = last
            if name == "frozen":
                timed.append(rows)
            return 5 * (frozen_ns if name == "frozen" else small_ns)(rows)

        from shmeval.backends import _torch_method

        monkeypatch.setattr(_torch_method, "best_ns", best_ns)
        served = backend.TorchModel(pv_net(1)).methods[""]
        served.bind(spec.methods[0], spec.max_batch)
        return served.own_conv_split(form("frozen"), form("small"), sizes), timed

    # Cheaper by 30 ns at 2 rows, dearer by 30 at 4: they cross at 3.
    assert run(lambda r: 100 + 10 * r, lambda r: 10 + 40 * r) == (3, [2, 4])
    # Buckets: timed at each size served; the costs cross at 9.
    assert run(lambda r: 100 + 10 * r, lambda r: 10 + 20 * r, (1, 3, 12, 64)) == (9, [3, 12])
    assert run(lambda r: 100, lambda r: 100) == (0, [2])
    assert run(lambda r: 100 + 10 * r, lambda r: 10 * r) == (64, [2, 4, 8, 16, 32, 64])


def test_own_convolution_serves_small_batches(torch: Any, backend: Any,
                                              monkeypatch: Any) -> None:
    """Where the form on PyTorch's own convolution is cheaper it serves the
    batches up to own_conv_rows, the frozen module the larger ones; a weight
    update drops it with the frozen module, and freezing again rebuilds it
    with the new weights."""
    monkeypatch.setattr(backend.ServedMethod, "own_conv_split", lambda self, *a: 4)
    spec = Spec.build(INPUT_SHAPE, F32, OUTPUTS, 8, 1, 1)
    x = random_states(8, 5)
    tm = backend.TorchModel(pv_net(1))
    tm.prepare(spec, None)
    served = tm.methods[""]
    assert tm.frozen and tm.own_conv_rows == 4
    assert "aten::thnn_conv2d" in str(served.small.graph)
    seen: list[int] = []
    small = served.small

    def counted(batch: Any) -> Any:
        seen.append(len(batch))
        return small(batch)

    served.small = counted
    for rows in range(1, 9):
        _answers_match(tm, pv_net(1), x[:rows])
    assert sorted(set(seen)) == [1, 2, 3, 4]
    tm.set_weights(pv_net(2).state_dict())
    assert served.small is None
    _answers_match(tm, pv_net(2), x[:2])
    served.fold.saving = (1e12, 0.0)  # the next call freezes again
    tm(x[:1])
    assert tm.frozen and "aten::thnn_conv2d" in str(served.small.graph)
    for rows in (2, 8):
        _answers_match(tm, pv_net(2), x[:rows])


def test_hot_swap_through_evaluator(torch: Any, backend: Any, tmp_path: Any) -> None:
    """ev.set_weights / ev.load_weights reach TorchModel between batches: the
    answers follow the new weights, a refused update changes nothing."""
    tm = backend.TorchModel(pv_net(1), compile="aot_eager")
    with shmeval.Evaluator(tm, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=64,
                           max_clients=4, slots_per_client=32) as ev:
        compiled = tm.compile_count
        torch.save(pv_net(3).state_dict(), tmp_path / "three.pt")
        updates_through_evaluator(ev, [reference(pv_net(v)) for v in (1, 2, 3)],
                                  version_weights(2), tmp_path / "three.pt")
        assert tm.compile_count == compiled


def test_a_state_dict_pushed_through_the_evaluator(torch: Any, backend: Any) -> None:
    """ev.set_weights(net.state_dict()) reaches the model, tensors or arrays
    matched by name: the answers follow; names missing or extra are listed
    in the refusal, and a wrong type is named."""
    tm = backend.TorchModel(pv_net(1))
    with shmeval.Evaluator(tm, input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=64,
                           max_clients=4, slots_per_client=32) as ev:
        names = tuple(OUTPUTS)
        assert ev.set_weights(pv_net(2).state_dict()) == 1
        serve_and_compare(ev, reference(pv_net(2)), names, sizes=(3, 40))
        # Arrays, in another order: matched by name.
        arrays = {k: v.numpy() for k, v in reversed(pv_net(3).state_dict().items())}
        assert ev.set_weights(arrays) == 2
        serve_and_compare(ev, reference(pv_net(3)), names, sizes=(3, 40))
        bad = dict(pv_net(4).state_dict())
        first = next(iter(bad))
        del bad[first]
        bad["head.extra"] = torch.zeros(2)
        with pytest.raises(shmeval.ModelError, match=rf"lacks \['{first}'\].*"
                                                     r"unexpected \['head.extra'\]"):
            ev.set_weights(bad)
        with pytest.raises(TypeError, match=r"state dict.*; got a .*PVNet"):
            ev.set_weights(pv_net(4))
        with pytest.raises(TypeError, match=r"got a numpy.ndarray of shape \(3,\)"):
            ev.set_weights(np.zeros(3, np.float32))
        assert ev.model_version == 2
        serve_and_compare(ev, reference(pv_net(3)), names, sizes=(3, 40))


@pytest.mark.timeout(240)
def test_torch_hot_swap_under_load(torch: Any) -> None:
    """A spawned evaluator (pv_factory) under load from spawn workers that
    never import torch; 8 weight updates; every answer matches its version."""
    hot_swap_under_load(torch_models.pv_factory,
                        [version_weights(v) for v in range(9)],
                        lambda v, states: reference(pv_net(v))(states))


def test_backends_package_does_not_import_torch() -> None:
    code = ("import sys, shmeval, shmeval.backends, shmeval.backends._contract; "
            "assert not {'torch', 'jax', 'tensorflow'} & set(sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr


def test_the_replicas_gpu_is_made_current(torch: Any, backend: Any,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A TorchModel on cuda:N makes GPU N the current device of the thread
    that prepares it while it prepares (before any CUDA work:
    torch.cuda.graph synchronises the current device; torch.cuda.device
    gives the caller its device back afterwards, without making a context
    there) and of each serving thread as it takes its lane; on the CPU it
    sets nothing.  Run without a GPU: torch.cuda.set_device and
    torch.cuda.device are recorded, and the CUDA work after them fails."""
    import threading

    made_current: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: made_current.append((threading.current_thread().name, d)))

    class Device:  # torch.cuda.device: a class (torch's own code asks isinstance)
        def __init__(self, d: Any) -> None:
            self.d = d

        def __enter__(self) -> None:
            made_current.append((threading.current_thread().name, self.d))

        def __exit__(self, *exc: Any) -> None:
            made_current.append((threading.current_thread().name, "the caller's again"))

    monkeypatch.setattr(torch.cuda, "device", Device)
    spec = Spec.build(INPUT_SHAPE, F32, OUTPUTS, 8, 1, 1)
    on_cpu = backend.TorchModel(pv_net(), device="cpu")
    on_cpu.prepare(spec, None)
    assert made_current == []
    on_gpu1 = backend.TorchModel(pv_net(), device="cpu", cuda_graphs=False)
    on_gpu1.device = torch.device("cuda", 1)  # as if there were two GPUs
    try:
        on_gpu1.prepare(spec, None)
    except Exception:  # without a GPU 1: at its first CUDA work (a lane's stream here)
        pass
    # GPU 1 while preparing, the caller's again afterwards.
    assert made_current == [("MainThread", torch.device("cuda", 1)),
                            ("MainThread", "the caller's again")]
    made_current.clear()
    import queue

    lane = object()
    on_gpu1._free_lanes = queue.SimpleQueue()
    on_gpu1._free_lanes.put(lane)
    taken: list[Any] = []
    server = threading.Thread(target=lambda: taken.append(on_gpu1._take_lane()),
                              name="serving-thread")
    server.start()
    server.join(30)
    assert taken == [lane]
    assert made_current == [("serving-thread", torch.device("cuda", 1))]
