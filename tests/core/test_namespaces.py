"""Pid and time namespaces: liveness is judged by pid and /proc start time,
which mean something only inside one pid namespace and one time namespace.
The segment records its creator's; attaching from another is refused,
cleanup never judges a segment of another, and the evaluator never judges a
client entry recorded from another.  (Processes really started in other
namespaces: tests/stress/test_unshare.py.)"""
from __future__ import annotations

import mmap
import os
import struct
import time

import pytest

import shmeval
from shmeval import segment
from helpers import check_answer, make_ev, make_state

OFF_OWNER_PID, OFF_PID_NS, OFF_TIME_NS = 72, 80, 88  # ring.h shm_header


def dead_pid() -> int:
    """A pid that no process has now (one of our children, reaped)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def rewrite_header(address: str, **fields: int) -> None:
    offsets = {"owner_pid": (OFF_OWNER_PID, "<i"), "pid_ns": (OFF_PID_NS, "<Q"),
               "time_ns": (OFF_TIME_NS, "<Q")}
    fd = os.open("/dev/shm" + address, os.O_RDWR)
    try:
        with mmap.mmap(fd, 4096) as m:
            for name, value in fields.items():
                off, fmt = offsets[name]
                struct.pack_into(fmt, m, off, value)
    finally:
        os.close(fd)


def test_namespaces_are_this_process() -> None:
    ns = segment.namespaces()
    assert ns.pid == os.stat("/proc/self/ns/pid").st_ino
    assert ns.time == (os.stat("/proc/self/ns/time").st_ino
                       if os.path.exists("/proc/self/ns/time") else 0)


@pytest.mark.parametrize("kind", ["pid_ns", "time_ns"])
def test_cleanup_never_judges_another_namespace(kind: str) -> None:
    """A segment whose creator is dead here is stale, unless it was created
    in another namespace, where that pid may be a live process."""
    with make_ev() as ev:
        rewrite_header(ev.address, owner_pid=dead_pid())
        [info] = [s for s in segment.list_segments() if s["address"] == ev.address]
        assert not info["owner_alive"] and not info["foreign_namespace"]
        assert ev.address in segment.cleanup_stale(dry_run=True)

        rewrite_header(ev.address, **{kind: 12345})
        [info] = [s for s in segment.list_segments() if s["address"] == ev.address]
        assert info["owner_alive"] and info["foreign_namespace"]
        assert ev.address not in segment.cleanup_stale(dry_run=True)
        assert ev.address not in segment.cleanup_own_stale()
        assert os.path.exists("/dev/shm" + ev.address)


@pytest.mark.timeout(60)
def test_evaluator_never_judges_a_client_of_another_namespace() -> None:
    """Housekeeping reclaims the entry of a dead process, but not one
    recorded from another pid namespace (its pid means another process
    here); that one goes when it detaches."""
    with make_ev(max_clients=4) as ev:
        seg = ev._attach()
        pid = dead_pid()
        mine = seg.register(pid, 0, segment.namespaces().pid)
        foreign = seg.register(pid, 0, 12345)
        deadline = time.monotonic() + 10
        while any(e[0] == mine for e in seg.clients()) and time.monotonic() < deadline:
            time.sleep(0.02)
        entries = [e[0] for e in seg.clients()]
        assert mine not in entries, "the dead process's entry was never reclaimed"
        time.sleep(0.5)  # more housekeeping rounds (every 100-200 ms)
        assert foreign in [e[0] for e in seg.clients()]
        seg.detach(foreign)
        while any(e[0] == foreign for e in seg.clients()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert foreign not in [e[0] for e in seg.clients()]
        check_answer(ev.evaluate(make_state(3)), 3)


def test_attach_refuses_another_namespace_and_says_what_to_share() -> None:
    with make_ev() as ev:
        rewrite_header(ev.address, pid_ns=12345)
        with pytest.raises(shmeval.SegmentError, match="another pid namespace") as ei:
            shmeval.connect(ev.address)
        assert "shareProcessNamespace" in str(ei.value)
        assert "--pid=container:" in str(ei.value)
