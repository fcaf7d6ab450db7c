"""What the suite needs from outside Python, and the one rule for when it is
missing.

A few tests run programs that pip does not install: a real Prometheus
server (tests/monitor), gcc's sanitizer runtimes (tests/c), util-linux's
``unshare`` and root (tests/stress, tests/core), a cross gcc and QEMU for
the C core's aarch64 build (tests/c).  Each asks here first.
Where one is missing, the test is skipped, with the command that installs
it as the reason (``pytest -ra`` lists the reasons at the end), so that the
README's test command passes on a fresh machine and says what it did not
run.  In CI (the ``CI`` environment variable set, as ``.ci/run`` and most
CI services do) a missing one fails the test instead: CI installs them
all, and there no test may quietly not run.
"""
from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

#: Debian's packages for each sanitizer build of tests/c/run_c_tests.sh (gcc 12).
SANITIZER_PACKAGES = {
    "thread": "libtsan2",
    "address,undefined": "libasan8 libubsan1",
}


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def require(present: bool, what: str, install: str) -> None:
    """Skip the calling test (fail it in CI) unless ``present``: ``what`` is
    missing, ``install`` says how to get it."""
    if present:
        return
    reason = f"{what} is missing: {install}"
    if in_ci():
        pytest.fail(f"{reason} (CI is set, where every test must run)", pytrace=False)
    pytest.skip(reason)


def require_binary(name: str, install: str) -> str:
    """The path of the program ``name`` on PATH (see :func:`require`)."""
    path = shutil.which(name)
    require(path is not None, f"the {name} program", install)
    assert path is not None
    return path


@functools.lru_cache(maxsize=None)
def _links(cc: str, flags: str) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text("int main(void) { return 0; }\n")
        try:
            r = subprocess.run([cc, *flags.split(), str(src), "-o", str(Path(tmp) / "probe")],
                               capture_output=True, timeout=60)
        except OSError:
            return False
        return r.returncode == 0


def require_sanitizers(*sanitizers: str) -> None:
    """The C compiler (``CC``, default gcc) and the runtimes of each of
    ``sanitizers`` (``"thread"``, ``"address,undefined"``): a program
    built with ``-fsanitize=...`` links (see :func:`require`)."""
    cc = os.environ.get("CC", "gcc")
    require_binary(cc, "apt-get install -y gcc libc6-dev")
    for s in sanitizers:
        require(_links(cc, f"-fsanitize={s}"), f"gcc's {s} sanitizer runtime",
                f"apt-get install -y {SANITIZER_PACKAGES[s]}")


ARM64_INSTALL = ("apt-get install -y --no-install-recommends gcc-aarch64-linux-gnu "
                 "libc6-dev-arm64-cross qemu-user-static")


def require_arm64_tools() -> None:
    """The arm64 build of tests/c/run_c_tests.sh can run here: its compiler
    (``ARM64_CC``; ``aarch64-linux-gnu-gcc``, or ``CC`` on an aarch64 host)
    links a static program and, on a host that is not aarch64, an aarch64
    emulator (``QEMU_AARCH64``, ``qemu-aarch64-static`` or ``qemu-aarch64``)
    is on PATH (see :func:`require`)."""
    native = platform.machine() == "aarch64"
    cc = os.environ.get("ARM64_CC") or (
        os.environ.get("CC", "gcc") if native else "aarch64-linux-gnu-gcc")
    require_binary(cc, ARM64_INSTALL)
    require(_links(cc, "-static"), f"the aarch64 C library ({cc} cannot link a static "
            f"program)", ARM64_INSTALL)
    if not native:
        emulators = ([os.environ["QEMU_AARCH64"]] if os.environ.get("QEMU_AARCH64")
                     else ["qemu-aarch64-static", "qemu-aarch64"])
        require(any(shutil.which(e) for e in emulators),
                f"the aarch64 emulator ({' or '.join(emulators)})", ARM64_INSTALL)


def require_root(why: str) -> None:
    """This process runs as root (see :func:`require`)."""
    require(os.geteuid() == 0, f"root ({why}; running as uid {os.geteuid()})",
            "run the suite as root, as CI does")
