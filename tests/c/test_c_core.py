"""The C core on its own: builds src/shmeval/_core/ring_test.c plain, under
ThreadSanitizer and under AddressSanitizer+UBSan, and runs each build
(tests/c/run_c_tests.sh).  Needs gcc and its sanitizer runtimes; a machine
without them fails this test instead of skipping it.

The arm64 build (cross-compiled for aarch64 and run under QEMU, or built
and run natively on an aarch64 host) needs a cross toolchain and an
emulator that a developer's machine may lack: without them it is skipped,
with the command that installs them as the reason, except in CI (the
``CI`` environment variable set), where it fails."""
from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "c" / "run_c_tests.sh"
TIMEOUT_S = 300
ARM64_TIMEOUT_S = 180
ARM64_INSTALL = ("apt-get install -y --no-install-recommends gcc-aarch64-linux-gnu "
                 "libc6-dev-arm64-cross qemu-user-static")


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
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        pytest.fail(
            f"C compiler {cc!r} not found: the C core test needs gcc and its "
            "sanitizer runtimes (Debian: apt-get install -y gcc libc6-dev "
            "libgcc-12-dev libtsan2 libasan8 libubsan1)"
        )
    run_script(None, TIMEOUT_S)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def links_static(cc: str) -> bool:
    """Whether ``cc`` links a static program (the arm64 build is static)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text("int main(void) { return 0; }\n")
        try:
            r = subprocess.run([cc, "-static", str(src), "-o", str(Path(tmp) / "probe")],
                               capture_output=True, timeout=60)
        except OSError:
            return False
        return r.returncode == 0


def require_arm64_tools() -> None:
    """Skips the calling test (fails it in CI) unless the arm64 build's
    compiler links a static aarch64 program and, on a host that is not
    aarch64, an aarch64 emulator is on PATH: the names run_c_tests.sh uses.
    After the merge of branch h51docs this belongs in tests/external.py,
    as a use of its require()."""
    native = platform.machine() == "aarch64"
    cc = os.environ.get("ARM64_CC") or (
        os.environ.get("CC", "gcc") if native else "aarch64-linux-gnu-gcc")
    missing = []
    if shutil.which(cc) is None:
        missing.append(f"the aarch64 C compiler {cc}")
    elif not links_static(cc):
        missing.append(f"the aarch64 C library ({cc} cannot link a static program)")
    if not native:
        emulators = ([os.environ["QEMU_AARCH64"]] if os.environ.get("QEMU_AARCH64")
                     else ["qemu-aarch64-static", "qemu-aarch64"])
        if not any(shutil.which(e) for e in emulators):
            missing.append(f"the aarch64 emulator ({' or '.join(emulators)})")
    if not missing:
        return
    reason = f"{'; '.join(missing)} missing: {ARM64_INSTALL}"
    if in_ci():
        pytest.fail(f"{reason} (CI is set, where every test must run)", pytrace=False)
    pytest.skip(reason)


@pytest.mark.timeout(ARM64_TIMEOUT_S + 60)
def test_c_core_arm64() -> None:
    """ring_test built for aarch64 (every x86-only path of ring.h has a
    portable twin) passes every test there."""
    require_arm64_tools()
    run_script("arm64", ARM64_TIMEOUT_S)
