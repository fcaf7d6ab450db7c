"""Shared fixtures: the /dev/shm leak guard."""
from __future__ import annotations

import os
from typing import Iterator

import pytest

SHM_DIR = "/dev/shm"


def shmeval_entries() -> set[str]:
    return {e for e in os.listdir(SHM_DIR) if e.startswith("shmeval-")}


@pytest.fixture(autouse=True)
def no_shm_leak() -> Iterator[None]:
    """Every test leaves /dev/shm as it found it."""
    before = shmeval_entries()
    yield
    left = shmeval_entries() - before
    for e in left:  # clean up so one leak does not cascade into other tests
        os.unlink(os.path.join(SHM_DIR, e))
    assert not left, f"test left shared-memory segments behind: {sorted(left)}"
