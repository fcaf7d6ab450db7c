"""The worked examples in examples/ run end to end at their small default
settings: each is started as a user would start it (a fresh interpreter,
``python examples/NAME.py``), exits 0 and prints the figures it measured,
each a positive number.  The figures themselves are not checked: this is
the program working, not a measurement."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from external import require

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples")
#: A figure as the examples print it (thousands separated by commas).
NUMBER = r"([\d,]+(?:\.\d+)?)"


def run_example(name: str, *args: str, timeout: float = 240) -> str:
    """Runs ``examples/<name> args`` in this interpreter; asserts that it
    exited 0 (showing the ends of its output when not) and returns its
    stdout."""
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args],
                       capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def figures(pattern: str, text: str) -> list[float]:
    """The numbers of every line that matches ``pattern`` (NUMBER marks
    where each stands); at least one line must match."""
    found = re.findall(pattern.replace("NUMBER", NUMBER), text, flags=re.M)
    assert found, f"no line matching {pattern!r} in:\n{text}"
    return [float(x.replace(",", "")) for row in found
            for x in (row if isinstance(row, tuple) else (row,))]


def assert_positive(values: list[float], text: str) -> None:
    assert all(v > 0 for v in values), text


@pytest.mark.timeout(300)
def test_alphazero_mask_example() -> None:
    out = run_example("alphazero_mask_torch.py")
    for name in ("moves/s", "games/s", "evaluations/s"):
        assert_positive(figures(rf"^{re.escape(name)}: NUMBER$", out), out)
    assert_positive(figures(r"^mean batch: NUMBER states per model call$", out), out)


@pytest.mark.timeout(300)
def test_muzero_example() -> None:
    out = run_example("muzero_torch.py")
    for setup in ("shmeval", "net per worker"):
        rows = figures(rf"^{setup} +simulations/s: +NUMBER +moves/s: +NUMBER +"
                       r"worker RSS: +NUMBER MiB$", out)
        assert len(rows) == 3, out
        assert_positive(rows, out)
    for method in ("initial", "recurrent"):
        assert_positive(figures(rf"^  {method}: NUMBER requests, mean batch NUMBER$", out), out)
    assert_positive(figures(r"^shmeval / net per worker: simulations/s NUMBERx, "
                            r"worker RSS NUMBERx$", out), out)


@pytest.mark.timeout(300)
def test_openspiel_mcts_example() -> None:
    require(importlib.util.find_spec("pyspiel") is not None, "OpenSpiel (pyspiel)",
            "pip install '.[test]' (or pip install open_spiel)")
    out = run_example("openspiel_mcts.py")
    for setup in ("shmeval", "net per process"):
        rows = figures(rf"^{setup} +games/s: +NUMBER +moves/s: +NUMBER +"
                       r"evaluations/s: +NUMBER$", out)
        assert len(rows) == 3, out
        assert_positive(rows, out)
    assert_positive(figures(r"^shmeval / net per process: games/s NUMBERx, moves/s NUMBERx$",
                            out), out)
