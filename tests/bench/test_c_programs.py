"""The benchmarks' C programs (bench/c: the ring's own client, the futex
ping-pong, the row copy) build against the ring.h of this tree, warnings
as errors: a change of ring.h's functions cannot leave them behind."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = sorted((ROOT / "bench" / "c").glob("*.c"))


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.stem for p in PROGRAMS])
def test_builds(program: Path, tmp_path: Path) -> None:
    r = subprocess.run(["gcc", "-O2", "-std=gnu11", "-D_GNU_SOURCE", "-Wall", "-Werror",
                        f"-I{ROOT / 'src' / 'shmeval' / '_core'}", "-o",
                        str(tmp_path / program.stem), str(program), "-lrt", "-pthread"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
