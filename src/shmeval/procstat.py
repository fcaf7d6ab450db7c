"""What /proc says about a process and the machine: memory, CPU time, CPU model.

Shared by ``shmeval selfplay`` and the scripts in bench/ (Linux only)."""
from __future__ import annotations

import os
from typing import Optional

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> Optional[float]:
    """VmRSS of ``pid`` in MB (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (all its threads); NaN if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return float("nan")


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


def gpu_visible(driver_gpus: str = "/proc/driver/nvidia/gpus") -> bool:
    """Whether TensorFlow would find an NVIDIA GPU here: the driver lists
    one (in ``driver_gpus``) and ``CUDA_VISIBLE_DEVICES`` does not hide them
    all.  Read without importing TensorFlow."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return False
    try:
        return bool(os.listdir(driver_gpus))
    except OSError:
        return False


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy so far (not idle, not iowait)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return float("nan")
    return (sum(ticks) - ticks[3] - ticks[4]) / _CLK_TCK
