"""Shared fixtures (the /dev/shm leak guard) and the markers by subject.

Every test gets the marker of its folder (core, stress, c, tensorflow,
torch, jax, selfplay, bench, monitor, ray, examples).  Folders whose tests take
seconds each are also marked
``slow`` as a whole; in core, single tests that take seconds carry
``@pytest.mark.slow`` themselves.  ``pytest -m "not slow" -n 0`` checks a
core change in a minute or two; plain ``pytest`` runs everything.

The run has two lanes (pytest-xdist, ``-n 2`` in pyproject.toml).  Tests
that make shared-memory segments run one at a time in one lane: /dev/shm
is machine-wide, so a test's leak check and the stale-segment cleanup that
every new segment does would see another running test's segments.  The
tests that make none (the C core builds, the mutation tests, mypy: a fifth
of the run's time, most of it the compiler) run beside them in the other.
``-n 0`` runs everything in one process.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest

# PyTorch's CUDA wheels bring Triton (for torch.compile and torch.export).
# Its library loaded after TensorFlow's kills the process (TensorFlow 2.21,
# Triton 3.7: import tensorflow, then triton, segfaults; the other order
# works), and the suite loads both frameworks in one process: Triton first.
with contextlib.suppress(ImportError):
    import triton._C.libtriton  # noqa: F401

HERE = Path(__file__).resolve().parent
SUBJECTS = ("core", "stress", "c", "tensorflow", "torch", "jax", "selfplay", "bench", "monitor",
            "ray", "examples")
SLOW_SUBJECTS = {"stress", "c", "tensorflow", "torch", "jax", "selfplay", "bench", "monitor", "ray",
                 "examples"}
#: Test files that make no shmeval segment, in any process: they may run
#: beside the tests that do.
SEGMENT_FREE = {"c/test_c_core.py", "c/test_mutations.py", "core/test_typing.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            subject = Path(str(item.fspath)).resolve().relative_to(HERE).parts[0]
        except ValueError:
            continue
        if subject in SUBJECTS:
            item.add_marker(getattr(pytest.mark, subject))
        if subject in SLOW_SUBJECTS:
            item.add_marker(pytest.mark.slow)


def _segment_free(nodeid: str) -> bool:
    path = nodeid.split("::", 1)[0]
    return path.startswith("tests/") and path[len("tests/"):] in SEGMENT_FREE


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The two lanes (see the top): pytest-xdist's scheduling by scope, with
    every test that makes segments in one scope, so that one worker runs
    them all in order, and each segment-free test a scope of its own, for
    whichever worker is free.  Only for the default ``--dist load``."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid if _segment_free(nodeid) else "segments"

    return Lanes(config, log)


def _in_a_lane() -> bool:
    """This process is a pytest-xdist worker: another lane may be running
    tests beside it."""
    return "PYTEST_XDIST_WORKER" in os.environ


#: Whether this process has run a test that makes segments (in a lane, only
#: such a process judges the session's segments).
_ran_segment_tests = False

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


@pytest.fixture(scope="session", autouse=True)
def no_shm_leak_at_session_end() -> Iterator[None]:
    """The whole session leaves /dev/shm as it found it: also what the
    per-test guard cannot see (segments made by session or module fixtures,
    at collection, or by a child process after its test ended).  A leak is
    an error at the teardown of the session's last test, so the run exits
    non-zero.  A dead owner's segment cannot be attributed to this run for
    certain: one that appeared while it ran is counted as ours.  In a lane
    that ran only segment-free tests, the segments seen are the other
    lane's, so there is nothing to judge."""
    before = shmeval_entries()
    yield
    if _in_a_lane() and not _ran_segment_tests:
        return
    left = shmeval_entries() - before
    deadline = time.monotonic() + 2.0  # an exiting evaluator process may still unlink its own
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = shmeval_entries() - before
    for e in left:
        try:
            os.unlink(os.path.join(SHM_DIR, e))
        except FileNotFoundError:
            pass
    if left:
        pytest.fail(f"the test session left shared-memory segments behind: {sorted(left)}",
                    pytrace=False)


@pytest.fixture(autouse=True)
def no_shm_leak(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test leaves /dev/shm as it found it (a segment-free test in a
    lane is not judged: what it would see is the other lane's)."""
    global _ran_segment_tests
    if _in_a_lane() and _segment_free(request.node.nodeid):
        yield
        return
    _ran_segment_tests = True
    before = shmeval_entries()
    yield
    left = shmeval_entries() - before
    for e in left:  # clean up so one leak does not cascade into other tests
        os.unlink(os.path.join(SHM_DIR, e))
    assert not left, f"test left shared-memory segments behind: {sorted(left)}"


@pytest.fixture(autouse=True)
def sigint_handler_kept(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that leaves SIGINT ignored in this process would make every
    later child process inherit SIG_IGN (Python keeps an ignored SIGINT
    ignored), so that Ctrl-C tests of child processes hang: put the handler
    back, and name the test in a warning."""
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after != before:
        signal.signal(signal.SIGINT, before)
        warnings.warn(f"{request.node.nodeid} left the SIGINT handler set to {after!r}; "
                      f"put back")
