"""The C core on its own: builds src/shmeval/_core/ring_test.c plain, under
ThreadSanitizer and under AddressSanitizer+UBSan, and runs each build
(tests/c/run_c_tests.sh).  Needs gcc and its sanitizer runtimes: without
them the test is skipped, or fails in CI (tests/external.py)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from external import require_sanitizers

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "c" / "run_c_tests.sh"
TIMEOUT_S = 300


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_c_core_plain_tsan_asan() -> None:
    require_sanitizers("thread", "address,undefined")
    bash = shutil.which("bash")
    if bash is None:
        pytest.fail("bash not found: tests/c/run_c_tests.sh needs it")
    proc = subprocess.Popen(
        [bash, str(SCRIPT)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so a timeout can kill the whole group
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"run_c_tests.sh did not finish in {TIMEOUT_S} s:\n{out}")
    assert proc.returncode == 0, (
        f"run_c_tests.sh failed (exit {proc.returncode}):\n{out}"
    )
