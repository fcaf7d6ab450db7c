"""bench/autotune.py's table from made-up windows: the best hand setting is
chosen on the first half of a cell's rounds and measured on the other
half, so a setting that won its selection rounds by chance is not credited
with them.  (The grid itself runs for minutes: it is a benchmark, not a
test.)"""
from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "autotune.py"


@pytest.fixture(scope="module")
def autotune() -> Any:
    spec = importlib.util.spec_from_file_location("autotune_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _rows(windows: dict[str, list[float]]) -> list[dict[str, Any]]:
    return [{"model": "null", "cpus": 2, "workers": 4, "setting": s, "rates": w,
             "rate": statistics.median(w)} for s, w in windows.items()]


def test_the_best_is_chosen_and_measured_on_different_rounds(autotune: Any) -> None:
    # "lucky" leads in the first two rounds only; "steady" is what the
    # other rounds find best.  Over all four rounds lucky has the best
    # median (its two high windows lift it), the figure the plain
    # comparison divides by.
    windows = {"auto": [100.0, 100.0, 100.0, 100.0],
               "today": [95.0, 95.0, 96.0, 96.0],
               "lucky": [150.0, 150.0, 90.0, 92.0],
               "steady": [98.0, 99.0, 104.0, 105.0]}
    chosen, best_rate, auto_rate = autotune.held_out(windows, ["today", "lucky", "steady"])
    assert chosen == "lucky"
    assert best_rate == statistics.median([90.0, 92.0])
    assert auto_rate == 100.0
    text, summary = autotune.table(_rows(windows), ["auto", "today", "lucky", "steady"])
    assert summary["min_auto_over_best"] == pytest.approx(100.0 / 121.0)
    assert summary["cells_auto_at_least_0.9_best"] == 0
    assert summary["min_auto_over_best_held_out"] == pytest.approx(100.0 / 91.0)
    assert summary["cells_auto_at_least_0.9_best_held_out"] == 1
    assert "lucky, 1.10" in text


def test_a_partly_automatic_setting_is_a_column_not_the_best_hand(autotune: Any) -> None:
    windows = {"auto": [100.0, 100.0], "today": [90.0, 90.0], "auto-clients": [200.0, 200.0]}
    text, summary = autotune.table(_rows(windows), ["auto", "today", "auto-clients"])
    assert summary["min_auto_over_best"] == pytest.approx(100.0 / 90.0)
    assert "| **100** | 90 | 200 | today |" in text


def test_a_single_round_has_no_held_out_comparison(autotune: Any) -> None:
    windows = {"auto": [100.0], "today": [120.0]}
    assert autotune.held_out(windows, ["today"]) is None
    _, summary = autotune.table(_rows(windows), ["auto", "today"])
    assert summary["held_out_cells"] == 0
    assert summary["min_auto_over_best_held_out"] is None
    assert summary["min_auto_over_best"] == pytest.approx(100.0 / 120.0)


def test_the_noise_is_read_where_today_and_nospin_are_one_setting(autotune: Any) -> None:
    # More workers than CPUs: the spin rule lets no one spin, so today and
    # nospin are the same setting there (except for the TensorFlow net,
    # which today runs unfrozen).
    assert autotune.same_setting("null", 2, 4) and autotune.same_setting("device", 1, 2)
    assert not autotune.same_setting("null", 2, 2) and not autotune.same_setting("tfnet", 1, 64)
    cells = {("null", 2, 4): {"today": 120.0, "nospin": 100.0},
             ("device", 1, 16): {"today": 100.0, "nospin": 105.0},
             ("null", 2, 2): {"today": 300.0, "nospin": 100.0},    # they differ here
             ("tfnet", 1, 16): {"today": 50.0, "nospin": 100.0}}   # and here
    got = autotune.noise(cells)
    assert got["cells"] == 2
    assert got["max"] == pytest.approx(1.2)
    assert got["median"] == pytest.approx((1.2 + 1.05) / 2)
    assert got["cells_apart_by_more_than_0.9"] == 1
