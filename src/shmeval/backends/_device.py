"""What this machine offers a framework, read without importing one: the
CPU's model and features from /proc/cpuinfo and whether an NVIDIA GPU is
visible.  Importing it loads no framework, so a process that only decides
how a model will run (the self-play settings) can ask."""
from __future__ import annotations

import os
from typing import Optional

from ..waiting import usable_cpus


def _cpuinfo(key: str) -> Optional[str]:
    """The value of the first ``key`` line of /proc/cpuinfo (None if none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> Optional[str]:
    """The CPU's model name from /proc/cpuinfo (None if it does not say)."""
    return _cpuinfo("model name")


def cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags from /proc/cpuinfo (empty if unread)."""
    return frozenset((_cpuinfo("flags") or "").split())


def cpu_bfloat16() -> bool:
    """Whether the CPU computes in bfloat16 natively (AVX512_BF16 or AMX),
    which is when oneDNN's bfloat16 convolutions beat float32 ones."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def threads_per_call(calls: int) -> int:
    """The CPUs this process may use split between ``calls`` model calls in
    flight (at least one each): the backends' intra-op threads "auto"."""
    return max(1, usable_cpus() // calls)


def gpu_visible(driver_gpus: str = "/proc/driver/nvidia/gpus") -> bool:
    """Whether TensorFlow would find an NVIDIA GPU here: the driver lists
    one (in ``driver_gpus``) and ``CUDA_VISIBLE_DEVICES`` does not hide them
    all."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return False
    try:
        return bool(os.listdir(driver_gpus))
    except OSError:
        return False


#: Set in every evaluator process before its factory runs, unless the user
#: set them: JAX preallocates 75% of every visible GPU in each process that
#: initialises it (even for a model on the CPU), and TensorFlow without
#: memory growth takes nearly all of every GPU; either way a second replica
#: on the same GPUs, or the learner beside them, could not start.
GPU_SHARING_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                   "TF_FORCE_GPU_ALLOW_GROWTH": "true"}


def share_gpus() -> None:
    """Applies :data:`GPU_SHARING_ENV` to this process's environment where
    a variable is unset (a value the user gave stays).  It acts only on a
    framework not yet initialised here: call it before importing one."""
    for name, value in GPU_SHARING_ENV.items():
        os.environ.setdefault(name, value)


def cuda_index(device: str) -> Optional[int]:
    """The GPU a PyTorch-style name means ("cuda": 0, "cuda:N": N); None
    for any other name, which each framework reads as its own."""
    name = device.strip().lower()
    if name == "cuda":
        return 0
    if name.startswith("cuda:") and name[5:].isdigit():
        return int(name[5:])
    return None
