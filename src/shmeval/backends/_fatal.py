"""Which model errors leave the model's device unusable for the rest of the
process: the one judgement the serving loop makes for every backend
(PyTorch, TensorFlow, JAX, a plain callable), without importing a framework.

A CUDA error of the kind NVIDIA's runtime documents as leaving "the process
in an inconsistent state" (a device-side assert, an illegal memory access,
a kernel that faulted, an uncorrectable ECC error, ...) is sticky: every
later CUDA call of the process fails with it, so the batch that met it and
every batch after it would fail.  The serving loop ends the serving
process instead (``DeviceLost``): its batches are put back for the other
replicas or the restarted process (docs/guide.md, *Errors*).  The same
goes for XLA's and TensorFlow's reports of an internal runtime failure.
An out-of-memory error is not among them: what the batch allocated is free
again, and the next batch may fit.
"""
from __future__ import annotations

from typing import Optional

from ..errors import DeviceLost

#: Texts of the CUDA errors that stay with the process once raised (the
#: runtime API's list of errors after which "any further CUDA work will
#: return the same error.  To continue using CUDA, the process must be
#: terminated and relaunched"), as the frameworks put them in a message:
#: the runtime's description (PyTorch: "CUDA error: <description>"), the
#: runtime's name (PyTorch adds "Search for `cudaErrorAssert' ...") and
#: the driver's name (XLA and TensorFlow: "CUDA_ERROR_ILLEGAL_ADDRESS").
#: Compared in lower case.
STICKY_CUDA_TEXTS = tuple(t.lower() for t in (
    # 710: an assert in device code (PyTorch's index checks, for one).
    "device-side assert triggered", "cudaErrorAssert", "CUDA_ERROR_ASSERT",
    # 700
    "an illegal memory access was encountered", "cudaErrorIllegalAddress",
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    # 702: a kernel ran past the watchdog's limit.
    "the launch timed out and was terminated", "cudaErrorLaunchTimeout",
    "CUDA_ERROR_LAUNCH_TIMEOUT",
    # 714
    "hardware stack error", "cudaErrorHardwareStackError", "CUDA_ERROR_HARDWARE_STACK_ERROR",
    # 715
    "an illegal instruction was encountered", "cudaErrorIllegalInstruction",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    # 716
    "misaligned address", "cudaErrorMisalignedAddress", "CUDA_ERROR_MISALIGNED_ADDRESS",
    # 717
    "operation not supported on global/shared address space",
    "cudaErrorInvalidAddressSpace", "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    # 718
    "invalid program counter", "cudaErrorInvalidPc", "CUDA_ERROR_INVALID_PC",
    # 719: a kernel faulted (a bad pointer, shared memory out of bounds).
    "unspecified launch failure", "cudaErrorLaunchFailure", "CUDA_ERROR_LAUNCH_FAILED",
    # 214, 220: the hardware's memory or link failed.
    "uncorrectable ECC error", "cudaErrorECCUncorrectable", "CUDA_ERROR_ECC_UNCORRECTABLE",
    "uncorrectable NVLink error", "cudaErrorNvlinkUncorrectable",
    "CUDA_ERROR_NVLINK_UNCORRECTABLE",
    # An error contained by the GPU (bad peer access over NVLink, some
    # hardware faults), and an MPS client the server terminated.
    "cudaErrorContained", "CUDA_ERROR_CONTAINED",
    "cudaErrorMpsClientTerminated", "CUDA_ERROR_MPS_CLIENT_TERMINATED",
    # cuBLAS and cuDNN say so when their kernel failed on the device, which
    # is how an earlier kernel's sticky error usually shows in a matmul or
    # a convolution.
    "CUBLAS_STATUS_EXECUTION_FAILED", "CUDNN_STATUS_EXECUTION_FAILED",
))

#: XLA's status for a runtime failure, at the start of a JAX runtime error.
XLA_INTERNAL = "INTERNAL:"
#: ... except where it reports a Python callback of the model
#: (``jax.pure_callback``) that raised: the device is fine.
XLA_CALLBACK = "callback error"

#: How many exceptions of a chain (__cause__, __context__) are looked at.
CHAIN_MAX = 8


def _is_a(e: BaseException, roots: tuple[str, ...], names: tuple[str, ...]) -> bool:
    """Whether e is an instance of a class named one of ``names`` defined in
    a package whose top-level name is one of ``roots`` (so that no framework
    is imported to ask)."""
    return any(c.__name__ in names and c.__module__.split(".", 1)[0] in roots
               for c in type(e).__mro__)


def _lost(e: BaseException) -> bool:
    """The test of one exception, not of its chain."""
    if isinstance(e, DeviceLost):  # a model may say so itself
        return True
    text = str(e).lower()
    if any(t in text for t in STICKY_CUDA_TEXTS):
        return True
    if _is_a(e, ("jax", "jaxlib"), ("XlaRuntimeError", "JaxRuntimeError")):
        return str(e).lstrip().startswith(XLA_INTERNAL) and XLA_CALLBACK not in text
    return _is_a(e, ("tensorflow",), ("InternalError",))


def device_lost(e: BaseException) -> bool:
    """Whether the model's exception ``e`` says that its device is lost for
    the rest of the process: ``shmeval.DeviceLost`` (a model may raise it
    to say so), a sticky CUDA error (STICKY_CUDA_TEXTS in its
    message, whatever its type: PyTorch raises RuntimeError or
    torch.AcceleratorError), a JAX runtime error of XLA's status INTERNAL
    (but not a Python callback that raised), or TensorFlow's
    ``tf.errors.InternalError``.  Also when one of these caused ``e``
    (``raise ... from``, or raised while handling one): the device is lost
    all the same."""
    seen: set[int] = set()
    cur: Optional[BaseException] = e
    while cur is not None and id(cur) not in seen and len(seen) < CHAIN_MAX:
        if _lost(cur):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ if cur.__cause__ is not None else cur.__context__
    return False
