"""The C core on its own: builds the C tests (tests/c/*.c, one program
against src/shmeval/_core/ring.h and its ring/ headers) plain, under
ThreadSanitizer and under AddressSanitizer+UBSan, and runs each build
(tests/c/run_c_tests.sh); and once more for aarch64 (cross-compiled and run
under QEMU, or built and run natively on an aarch64 host).  Each needs
programs pip does not install (gcc's sanitizer runtimes; a cross toolchain
and an emulator): without them the test is skipped, or fails in CI
(tests/external.py)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from external import require_arm64_tools, require_sanitizers

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "c" / "run_c_tests.sh"
TIMEOUT_S = 300
ARM64_TIMEOUT_S = 180


def run_script(builds: str | None, timeout_s: int) -> None:
    """Runs run_c_tests.sh (RING_TEST_BUILDS=builds, or its default set)
    and fails the test, with the script's output, unless it passes."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.fail("bash not found: tests/c/run_c_tests.sh needs it")
    env = dict(os.environ)
    if builds is not None:
        env["RING_TEST_BUILDS"] = builds
    proc = subprocess.Popen(
        [bash, str(SCRIPT)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so a timeout can kill the whole group
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"run_c_tests.sh did not finish in {timeout_s} s:\n{out}")
    assert proc.returncode == 0, (
        f"run_c_tests.sh failed (exit {proc.returncode}):\n{out}"
    )


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_c_core_plain_tsan_asan() -> None:
    require_sanitizers("thread", "address,undefined")
    run_script(None, TIMEOUT_S)


@pytest.mark.timeout(ARM64_TIMEOUT_S + 60)
def test_c_core_arm64() -> None:
    """ring_test built for aarch64 (every x86-only path of the core has a
    portable twin) passes every test there."""
    require_arm64_tools()
    run_script("arm64", ARM64_TIMEOUT_S)
