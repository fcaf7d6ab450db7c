"""What ``import shmeval`` and the ``shmeval`` command load, each in a fresh
interpreter: the core never pulls in an application (self-play, the search,
the games, the bench suite), the applications' shared helpers or a
framework, so ``shmeval stats`` and ``shmeval cleanup`` start fast and work
without any extra; an application's missing extra is a one-line hint."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Iterable

import numpy as np
import pytest

import shmeval

# Packages the core must not load, with their submodules.
FORBIDDEN = ("shmeval.selfplay", "shmeval.bench", "shmeval.mcts", "shmeval.games", "shmeval._util",
             "tensorflow", "torch", "jax", "matplotlib")
SUBCOMMANDS = ("selfplay", "bench", "demo", "stats", "cleanup")
TIMEOUT_S = 120

# Imports shmeval, runs the command line given after the output path (if
# any) through the CLI's main, and writes sys.modules as it stands at exit
# to that path.
RECORDER = """
import atexit, json, sys
out, argv = sys.argv[1], sys.argv[2:]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
import shmeval
if argv:
    from shmeval.cli import main
    sys.exit(main(argv))
"""


def run_recorded(argv: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The command's result and the modules its interpreter had loaded at exit."""
    out = tmp_path / "modules.json"
    r = subprocess.run([sys.executable, "-c", RECORDER, str(out), *argv], cwd=tmp_path,
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    modules: list[str] = json.loads(out.read_text())
    return r, modules


def forbidden(modules: Iterable[str]) -> list[str]:
    return [m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]


def test_import_shmeval(tmp_path: Path) -> None:
    r, modules = run_recorded([], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "shmeval.client" in modules  # the recorder saw the import
    assert forbidden(modules) == []


def test_stats(tmp_path: Path) -> None:
    with shmeval.Evaluator(lambda x: x.sum(axis=1), input_shape=(2,), input_dtype="float32",
                           outputs={"total": ((), "float32")}) as ev:
        assert ev.evaluate(np.ones(2, np.float32))["total"] == 2
        r, modules = run_recorded(["stats", ev.address], tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["requests"] == 1
    assert forbidden(modules) == []


def test_cleanup_dry_run(tmp_path: Path) -> None:
    r, modules = run_recorded(["cleanup", "--dry-run"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "would remove" in r.stdout
    assert forbidden(modules) == []


def test_help_lists_every_subcommand(tmp_path: Path) -> None:
    r, modules = run_recorded(["--help"], tmp_path)
    assert r.returncode == 0, r.stderr
    for name in SUBCOMMANDS:
        assert name in r.stdout, name
    assert forbidden(modules) == []


@pytest.mark.parametrize("name, option", [("selfplay", "--compare"), ("bench", "--quick")])
def test_application_help(name: str, option: str, tmp_path: Path) -> None:
    r, modules = run_recorded([name, "--help"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"usage: shmeval {name}" in r.stdout and option in r.stdout
    assert not any(m == "tensorflow" or m.startswith("tensorflow.") for m in modules)


def test_missing_extra_is_a_one_line_hint(tmp_path: Path) -> None:
    # None in sys.modules: importing tensorflow fails, and find_spec finds nothing.
    code = ("import sys; sys.modules['tensorflow'] = None; from shmeval.cli import main; "
            "sys.exit(main(['selfplay', '--seconds', '1']))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert r.returncode == 1
    assert r.stderr == "needs: pip install 'shmeval[selfplay]' (tensorflow missing)\n"
