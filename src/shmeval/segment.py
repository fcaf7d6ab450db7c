"""Create, attach and unlink the shared segment; process liveness; cleanup.

A segment is one POSIX shared-memory object named
``/shmeval-<owner pid>-<random>``, mode 0600, so that stale ones are easy to
find (``/dev/shm/shmeval-*``) and to attribute to a process.
"""
from __future__ import annotations

import os
import secrets
from typing import Optional

import posix_ipc

from . import _ring
from .errors import SegmentError
from .spec import Spec

PREFIX = "shmeval-"
SHM_DIR = "/dev/shm"


def new_name() -> str:
    return f"/{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"


def _check_name(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"address must be a str like '/shmeval-123-ab12...', got {name!r}")
    if not name.startswith("/"):
        name = "/" + name
    if "/" in name[1:] or len(name) > 255:
        raise SegmentError(f"{name!r} is not a valid shmeval address")
    return name


def create(spec: Spec, name: Optional[str] = None) -> tuple["_ring.Segment", str]:
    """Creates and formats a new segment for spec; returns (segment, name)."""
    name = _check_name(name) if name else new_name()
    size = _ring.segment_size(spec.in_bytes, spec.out_bytes, spec.max_clients,
                              spec.slots_per_client, spec.max_batch)
    try:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    except posix_ipc.ExistentialError:
        raise SegmentError(f"segment {name} already exists") from None
    try:
        seg = _ring.Segment.create(shm.fd, size, spec.in_bytes, spec.out_bytes,
                                   spec.max_clients, spec.slots_per_client, spec.max_batch,
                                   spec.to_json(), os.getpid(), name)
    except BaseException:
        shm.close_fd()
        unlink(name)
        raise
    shm.close_fd()
    seg.set_outputs(spec.outputs)
    return seg, name


def attach(name: str, expect: Optional[Spec] = None) -> tuple["_ring.Segment", Spec]:
    """Maps an existing segment and validates it (magic, layout version, spec).

    Raises SegmentError saying what is wrong: missing, not accessible, not a
    shmeval segment, another layout version, corrupt, or another spec.
    """
    name = _check_name(name)
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError:
        raise SegmentError(
            f"no shmeval segment named {name}: the evaluator is not running "
            "(or was closed)") from None
    except posix_ipc.PermissionsError:
        raise SegmentError(
            f"permission denied on segment {name}: it belongs to another user "
            "(segments are created mode 0600)") from None
    try:
        seg = _ring.Segment.attach(shm.fd, shm.size, name)
    finally:
        shm.close_fd()
    try:
        spec = Spec.from_json(seg.spec)
    except Exception as e:  # anything a hostile spec text can provoke
        raise SegmentError(f"segment {name} holds an unreadable spec: "
                           f"{type(e).__name__}: {e}") from None
    params = seg.params
    if (params["in_bytes"], params["out_bytes"], params["max_clients"],
            params["slots_per_client"], params["max_batch"]) != (
            spec.in_bytes, spec.out_bytes, spec.max_clients, spec.slots_per_client,
            spec.max_batch):
        raise SegmentError(f"segment {name}: header parameters disagree with its spec")
    if expect is not None and expect.to_json() != spec.to_json():
        raise SegmentError(
            f"segment {name} serves another spec: expected {expect.to_json().decode()}, "
            f"found {spec.to_json().decode()}")
    seg.set_outputs(spec.outputs)
    return seg, spec


def unlink(name: str) -> bool:
    """Removes the segment's name; returns False when it was already gone."""
    try:
        posix_ipc.unlink_shared_memory(_check_name(name))
        return True
    except posix_ipc.ExistentialError:
        return False


# ---------------------------------------------------------------- liveness

def process_starttime(pid: int) -> Optional[int]:
    """Start time (clock ticks since boot) of a live process, None if the
    process does not exist or is a zombie.  Paired with the pid it identifies a
    process even after its pid is reused."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except PermissionError:  # hidepid: assume alive, cannot tell
        return 0
    # The command name (field 2) may contain spaces and ')': split after the
    # last ')'.  Then field 3 is the state and field 22 the start time.
    fields = data[data.rfind(b")") + 2:].split()
    if not fields or fields[0] in (b"Z", b"X", b"x"):
        return None
    return int(fields[19])


def is_alive(pid: int, starttime: int = 0) -> bool:
    st = process_starttime(pid)
    if st is None:
        return False
    return starttime == 0 or st == 0 or st == starttime


# ---------------------------------------------------------------- cleanup

def list_segments() -> list[dict[str, object]]:
    """Every shmeval segment in /dev/shm with its owner pid and liveness."""
    out: list[dict[str, object]] = []
    try:
        names = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return out
    for entry in names:
        if not entry.startswith(PREFIX):
            continue
        try:
            pid = int(entry[len(PREFIX):].split("-", 1)[0])
        except ValueError:
            pid = 0
        try:
            size = os.stat(os.path.join(SHM_DIR, entry)).st_size
        except FileNotFoundError:
            continue
        out.append({"address": "/" + entry, "owner_pid": pid,
                    "owner_alive": is_alive(pid), "bytes": size})
    return out


def cleanup_stale(dry_run: bool = False) -> list[str]:
    """Unlinks segments whose owner process is dead; returns their addresses."""
    removed = []
    for s in list_segments():
        if not s["owner_alive"]:
            address = str(s["address"])
            if dry_run or unlink(address):
                removed.append(address)
    return removed
