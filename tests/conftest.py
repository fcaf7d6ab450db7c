"""Shared fixtures: the /dev/shm leak guard."""
from __future__ import annotations

import os
from typing import Iterator

import pytest

SHM_DIR = "/dev/shm"


def _owner(entry: str) -> int:
    try:
        return int(entry.split("-")[1])
    except (IndexError, ValueError):
        return 0


def shmeval_entries() -> set[str]:
    """shmeval segments of this process or of dead processes (the test's
    children); segments of other live processes (a concurrent run) are not
    ours to judge."""
    me = os.getpid()
    out = set()
    for e in os.listdir(SHM_DIR):
        if e.startswith("shmeval-"):
            pid = _owner(e)
            if pid == me or not os.path.exists(f"/proc/{pid}"):
                out.add(e)
    return out


@pytest.fixture(autouse=True)
def no_shm_leak() -> Iterator[None]:
    """Every test leaves /dev/shm as it found it."""
    before = shmeval_entries()
    yield
    left = shmeval_entries() - before
    for e in left:  # clean up so one leak does not cascade into other tests
        os.unlink(os.path.join(SHM_DIR, e))
    assert not left, f"test left shared-memory segments behind: {sorted(left)}"
