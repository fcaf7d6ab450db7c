"""bench/build_ext.py: a machine without a C compiler or Python.h is told so,
by name, before anything is built."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

BUILD = Path(__file__).resolve().parents[2] / "bench" / "build_ext.py"


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BUILD), *args], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, **env))


def test_a_missing_compiler_is_named_and_nothing_is_built(tmp_path: Path) -> None:
    r = run(CC="/nonexistent/shmeval-cc -O2")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no C compiler: '/nonexistent/shmeval-cc' is not on PATH" in r.stderr
    assert "build_ext" not in r.stdout + r.stderr


def test_a_missing_python_h_is_named(tmp_path: Path) -> None:
    sys.path.insert(0, str(BUILD.parent))
    try:
        import build_ext
    finally:
        sys.path.remove(str(BUILD.parent))
    found = build_ext.problems(cc=sys.executable, include=str(tmp_path))
    assert found == [f"no Python.h in {tmp_path} (install this Python's headers, e.g. "
                     f"apt-get install python{sysconfig.get_python_version()}-dev)"]
    assert build_ext.problems(cc=sys.executable, include=sysconfig.get_paths()["include"]) == []


def test_check_passes_here() -> None:
    r = run("--check")
    assert r.returncode == 0 and "ready to build" in r.stdout, r.stdout + r.stderr
