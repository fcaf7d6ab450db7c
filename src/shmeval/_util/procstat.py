"""What /proc says about a process and the machine: memory, CPU time and
how busy all cores were (Linux only)."""
from __future__ import annotations

import os
from typing import Optional

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _kb_field_mb(path: str, key: str) -> Optional[float]:
    """The first ``key`` line of a /proc file that counts kB, in MB (None
    if the process is gone)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


def rss_mb(pid: int) -> Optional[float]:
    """VmRSS of ``pid`` in MB (None if it is gone)."""
    return _kb_field_mb(f"/proc/{pid}/status", "VmRSS:")


def pss_mb(pid: int) -> Optional[float]:
    """Proportional set size of ``pid`` in MB: its shared pages split among
    the processes that map them (None if it is gone)."""
    return _kb_field_mb(f"/proc/{pid}/smaps_rollup", "Pss:")


def cpu_split_s(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of ``pid`` (all its threads); NaNs if
    gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return float("nan"), float("nan")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (all its threads); NaN if gone."""
    return sum(cpu_split_s(pid))


def _machine_ticks() -> Optional[list[int]]:
    """/proc/stat's CPU line: user, nice, system, idle, iowait, irq,
    softirq, steal, in clock ticks (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy so far (not idle, not iowait)."""
    ticks = _machine_ticks()
    if ticks is None:
        return float("nan")
    return (sum(ticks) - ticks[3] - ticks[4]) / _CLK_TCK


def machine_steal_s() -> float:
    """CPU seconds a virtual machine's host has taken from all its cores so
    far (steal: a vCPU ready to run while the host ran something else)."""
    ticks = _machine_ticks()
    if ticks is None or len(ticks) < 8:
        return float("nan")
    return ticks[7] / _CLK_TCK
