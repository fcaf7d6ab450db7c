"""The machine's CPU counters that result files record (steal, busy time)
are /proc/stat's own fields, in seconds."""
import os

from shmeval._util.procstat import machine_busy_s, machine_steal_s

TICK = os.sysconf("SC_CLK_TCK")


def _fields() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def test_steal_is_the_eighth_field_in_seconds() -> None:
    before = _fields()[7]
    steal = machine_steal_s()
    after = _fields()[7]
    assert before / TICK <= steal <= after / TICK


def test_busy_leaves_out_idle_and_iowait() -> None:
    before = _fields()
    busy = machine_busy_s()
    after = _fields()
    lo = sum(before) - before[3] - before[4]
    hi = sum(after) - after[3] - after[4]
    assert lo / TICK <= busy <= hi / TICK
