"""A model error that leaves the device unusable (a sticky CUDA error, an
XLA INTERNAL error, TensorFlow's InternalError: backends._fatal) ends the
serving process instead of failing the batch: the batches it holds are put
back and answered by the restarted process or by the other replicas, and
with nobody left clients raise EvaluatorDied naming the device's error.
The classifier is tested here on messages and look-alike types; the
framework folders test it on the frameworks' own exception types."""
from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any, Optional

import numpy as np
import pytest

import shmeval
from helpers import INPUT_SHAPE, OUTPUTS, check_answer, fake_model, make_ev, make_state
from shmeval.backends._fatal import device_lost

#: What PyTorch raises once a kernel's assert failed on the GPU.
STICKY = ("CUDA error: device-side assert triggered\nSearch for `cudaErrorAssert' in "
          "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more "
          "information.\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.")
KW: dict[str, Any] = dict(input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=16,
                          slots_per_client=8, serving_threads=1)
THREADS = 6
REQUESTS = 40  # per thread


# ================================================================ the classifier

@pytest.mark.parametrize("text", [
    STICKY,
    "CUDA error: an illegal memory access was encountered",
    "CUDA error: unspecified launch failure",
    "CUDA error: misaligned address",
    "CUDA error: an illegal instruction was encountered",
    "CUDA error: uncorrectable ECC error encountered",
    "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, ...)`",
    "cuDNN error: CUDNN_STATUS_EXECUTION_FAILED",
    "Failed to launch kernel: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access",
])
def test_sticky_cuda_errors_are_fatal(text: str) -> None:
    assert device_lost(RuntimeError(text))
    assert device_lost(ValueError(text.upper()))  # any type, any case


@pytest.mark.parametrize("text", [
    "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.2 GiB total capacity)",
    "CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation' in https://docs.nvidia."
    "com/... Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    "CUDA error: invalid argument",
    "index 9 is out of bounds for dimension 0 with size 7",
    "INTERNAL: this is not an XLA error",   # INTERNAL counts only from JAX
])
def test_other_errors_are_not(text: str) -> None:
    assert not device_lost(RuntimeError(text))


def _look_alike(module: str, name: str, base: type = RuntimeError) -> type:
    """A class named as a framework's exception, defined in its package."""
    return type(name, (base,), {"__module__": module})


def test_xla_internal_and_tensorflow_internal_errors_are_fatal() -> None:
    for module, name in [("jax.errors", "JaxRuntimeError"),
                         ("jaxlib.xla_extension", "XlaRuntimeError")]:
        xla = _look_alike(module, name)
        assert device_lost(xla("INTERNAL: Failed to execute XLA Runtime executable"))
        assert not device_lost(xla("RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes."))
        assert not device_lost(xla("INVALID_ARGUMENT: Executable expected shape f32[8]"))
        # A Python callback of the model that raised: the device is fine.
        assert not device_lost(xla("INTERNAL: CpuCallback error calling callback: Traceback"))
    internal = _look_alike("tensorflow.python.framework.errors_impl", "InternalError", Exception)
    assert device_lost(internal("Failed to launch the kernel"))
    other = _look_alike("tensorflow.python.framework.errors_impl", "InvalidArgumentError",
                        Exception)
    assert not device_lost(other("Incompatible shapes: [8,7] vs. [8,6]"))
    assert not device_lost(_look_alike("mylib", "InternalError", Exception)("x"))


def test_a_chain_holding_a_fatal_error_is_fatal() -> None:
    try:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as e:
            raise ValueError("the fallback failed too") from e
    except ValueError as e:
        assert device_lost(e)
    try:
        try:
            raise RuntimeError(STICKY)
        except RuntimeError:
            raise KeyError("while handling it")  # noqa: B904 (implicit chaining tested)
    except KeyError as e:
        assert device_lost(e)
    assert device_lost(shmeval.DeviceLost("the model says so"))
    assert isinstance(shmeval.DeviceLost("x"), shmeval.ModelError)
    # A cycle in the chain ends the walk.
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert not device_lost(a)


# ================================================================ serving

class FailingDevice:
    """fake_model on a device that fails for good at call ``fail_at``: that
    call and every later one raise the sticky error, as a real device's do.
    With ``flag`` (a path), only the first process to get there fails: the
    process restarted after it serves.  ``only_on``: fails only when built
    for that device (factory(device))."""

    def __init__(self, fail_at: int, flag: Optional[str] = None) -> None:
        self.calls = 0
        self.fail_at = fail_at
        self.flag = flag
        # A restarted process has a device of its own, which works.
        self.failing = flag is None or not os.path.exists(flag)
        self.lost = False

    def __call__(self, x: np.ndarray) -> dict[str, np.ndarray]:
        self.calls += 1
        if self.failing and (self.lost or self.calls >= self.fail_at):
            if not self.lost and self.flag is not None:
                open(self.flag, "w").close()
            self.lost = True
            raise RuntimeError(STICKY)
        time.sleep(0.001)  # a batch gathers while one is computed
        return fake_model(x)


def failing_factory(fail_at: int, flag: Optional[str] = None, only_on: str = "",
                    device: str = "") -> Any:
    if only_on and device != only_on:
        return FailingDevice(fail_at=10**9)
    return FailingDevice(fail_at, flag)


def load(ev: Any, threads: int = THREADS, requests: int = REQUESTS) -> list[str]:
    """``threads`` threads of this process evaluate ``requests`` states each;
    returns the problems seen (a wrong answer, an error), empty when every
    request was answered right."""
    problems: list[str] = []

    def run(t: int) -> None:
        for j in range(requests):
            tag = t * 1000 + j
            try:
                check_answer(ev.evaluate(make_state(tag)), tag)
            except Exception as e:  # noqa: BLE001 (any failure is a problem)
                problems.append(f"tag {tag}: {type(e).__name__}: {e}")

    ts = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "a request hung"
    return problems


@pytest.mark.timeout(60)
def test_a_restarted_process_answers_the_batches_of_the_lost_one(tmp_path: Any) -> None:
    """One replica, restarts=1: its device fails under load; the process
    ends, the requests it held are answered by the restarted process, none
    fails or is lost, and no call was spent isolating rows."""
    factory = functools.partial(failing_factory, 20, str(tmp_path / "failed"))
    with shmeval.Evaluator.spawn(factory, restarts=1, **KW) as ev:
        old = ev.pid
        assert load(ev) == []
        deadline = time.monotonic() + 30
        while not ev.stats()["restarts"]:  # the answers may come before the record
            assert time.monotonic() < deadline, "the process was not restarted"
            time.sleep(0.01)
        rec, = ev.stats()["restarts"]
        assert rec["pid"] == old and rec["new_pid"] == ev.pid != old
        assert rec["why"].startswith("its device failed: RuntimeError: CUDA error: "
                                     "device-side assert triggered"), rec
        st = ev.stats()
        assert st["requests"] == THREADS * REQUESTS
        assert st["failed_requests"] == 0 and st["isolation_calls"] == 0
        assert st["state"] == "serving"
        assert "device_lost" not in st["replicas"][0]   # the new process's entry


@pytest.mark.timeout(60)
def test_the_other_replica_answers_the_batches_of_the_lost_one() -> None:
    """Two replicas, no restarts: replica 0's device fails; its process
    ends and replica 1 answers everything, the lost batch included."""
    factory = functools.partial(failing_factory, 5, None, "cpu:0")
    with shmeval.Evaluator.spawn(factory, devices=["cpu:0", "cpu:1"], restarts=0,
                                 **KW) as ev:
        assert load(ev) == []
        deadline = time.monotonic() + 30
        while ev.stats()["replicas"][0]["state"] == "serving":  # found gone
            assert time.monotonic() < deadline, "replica 0 kept serving"
            time.sleep(0.01)
        st = ev.stats()
        assert st["state"] == "serving" and st["failed_requests"] == 0
        assert st["requests"] == THREADS * REQUESTS
        r0, r1 = st["replicas"]
        assert r0["state"] in ("stopped", "dead") and r1["state"] == "serving"
        assert "device-side assert triggered" in r0["device_lost"]
        assert r1["requests"] > r0["requests"]
        assert ev.stats()["restarts"] == []


@pytest.mark.timeout(60)
def test_with_no_restart_left_clients_raise_evaluator_died_naming_the_error() -> None:
    """One replica, no restarts: every waiting request (those of the batch
    in hand too) raises EvaluatorDied with the device's error, none hangs."""
    factory = functools.partial(failing_factory, 1)
    with shmeval.Evaluator.spawn(factory, restarts=0, **KW) as ev:
        problems = load(ev, threads=4, requests=3)
        assert len(problems) == 4 * 3, problems
        for p in problems:
            assert "EvaluatorDied" in p and "device failed" in p, p
            assert "RuntimeError: CUDA error: device-side assert triggered" in p, p
        st = ev.stats()
        assert st["state"] == "died" and st["failed_requests"] == 0
        assert st["stopped_because"].startswith("its model's device failed: RuntimeError")


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_evaluator_stops_and_says_why() -> None:
    """A thread evaluator has no process to end: it stops serving, and its
    clients raise EvaluatorDied naming the device's error."""
    model = FailingDevice(fail_at=4)
    with make_ev(model, serving_threads=1) as ev:
        for t in range(3):
            check_answer(ev.evaluate(make_state(t)), t)
        with pytest.raises(shmeval.EvaluatorDied, match="device-side assert triggered"):
            ev.evaluate(make_state(3))
        with pytest.raises(shmeval.EvaluatorDied, match="DeviceLost"):
            ev.evaluate(make_state(4))
        assert model.calls == 4   # nothing more was tried on the lost device
        st = ev.stats()
        assert st["state"] == "died" and st["failed_requests"] == 0
        assert "device-side assert" in st["replicas"][0]["device_lost"]
        assert "tuner" not in st


def refusing_update(x: Any) -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_lost_device_in_a_weight_update_ends_the_replica() -> None:
    """set_weights meets the lost device: it raises ModelError saying so,
    and the replica ends rather than serve on without the update."""
    model = FailingDevice(fail_at=10**9)
    model.set_weights = refusing_update  # type: ignore[attr-defined]
    with make_ev(model) as ev:
        check_answer(ev.evaluate(make_state(1)), 1)
        with pytest.raises(shmeval.ModelError, match="device is lost.*illegal memory access"):
            ev.set_weights([np.float32(1)])
        with pytest.raises(shmeval.EvaluatorDied, match="illegal memory access"):
            ev.evaluate(make_state(2))
