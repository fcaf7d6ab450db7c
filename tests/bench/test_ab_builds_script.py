"""bench/ab_builds.py end to end on this checkout against itself (a
revision would be built first, minutes): both sides serve in alternating
turns, with each request method (--call), the JSON holds the load, a rate
per turn of each side and one ratio per pair, and no process is left
running.  No timed assertions."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BUSY_LOOP, command_lines

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "ab_builds.py"
RUN_TIMEOUT = 150


def _left_running() -> list[int]:
    """Processes still running a side of the script (``--serve``) or one of
    its busy loops."""
    return [pid for pid, cmd in command_lines()
            if (str(SCRIPT).encode() in cmd and b"--serve" in cmd) or cmd[1:3] == BUSY_LOOP]


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_two_sides_take_turns(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--a", ".", "--b", ".", "--workers", "2",
                        "--turns", "3", "--turn-s", "0.1", "--warmup", "0.2", "--busy", "1",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["workers"] == 2 and result["pairs"] == 3
    # The default call: evaluate, one state a call.
    assert (result["call"], result["rows"], result["depth"]) == ("evaluate", 1, None)
    assert "2 workers, evaluate of 1 state; rates in states answered per second" in r.stdout
    assert len(result["rates"]["A"]) == len(result["rates"]["B"]) == 3
    assert all(x > 0 for side in "AB" for x in result["rates"][side])
    assert result["busy"] == 1
    assert all(len(result["fairness"][side]) == 3 and all(0 < f <= 1 for f in result["fairness"][side])
               for side in "AB")
    # Both sides ran the tuner (every knob "auto") and reported it.
    assert {"A", "B"} <= set(result["tuners"])
    assert all(t is not None and "why_spin" in t for t in result["tuners"].values())
    assert 0 <= result["b_ahead"] <= 3
    q1, q3 = result["ratio_quartiles"]
    assert q1 <= result["ratio_median"] <= q3
    assert "B ahead in" in r.stdout and "steal" in r.stdout
    assert _left_running() == []


@pytest.mark.timeout(RUN_TIMEOUT + 30)
@pytest.mark.parametrize("call, rows, depth, says", [
    ("evaluate_many", 3, None, "evaluate_many of 3 states"),
    ("submit", 3, 2, "submit of 3 states, 2 in flight per worker"),
    # More rows than the evaluator's default slots per client (16): the
    # script gives each client enough for its submissions in flight.
    ("submit", 20, 1, "submit of 20 states, 1 in flight per worker"),
])
def test_each_call_takes_turns(tmp_path: Path, call: str, rows: int, depth: int | None,
                               says: str) -> None:
    out = tmp_path / "ab.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--a", ".", "--b", ".", "--workers", "2",
                        "--call", call, "--rows", str(rows), "--depth", str(depth or 5),
                        "--turns", "2", "--turn-s", "0.1", "--warmup", "0.2",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["call"], result["rows"], result["depth"]) == (call, rows, depth)
    assert f"2 workers, {says}; rates in states answered per second" in r.stdout
    assert result["pairs"] == 2
    assert all(len(result["rates"][side]) == 2 and all(x > 0 for x in result["rates"][side])
               for side in "AB")
    assert all(0 < f <= 1 for side in "AB" for f in result["fairness"][side])
    assert "B ahead in" in r.stdout
    assert _left_running() == []


def test_rows_and_depth_take_at_least_one() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--a", ".", "--call", "submit",
                        "--depth", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--rows and --depth take at least 1" in r.stderr


def test_an_unknown_revision_is_named(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--a", "no-such-rev-0000"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "no revision 'no-such-rev-0000'" in r.stderr
