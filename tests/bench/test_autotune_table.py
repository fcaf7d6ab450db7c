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
from helpers import BUSY_LOOP, command_lines

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


def test_paired_ratios_cancel_what_each_round_did_to_both(autotune: Any) -> None:
    # The host ran at full speed in the first two rounds and at half in the
    # last two; auto served 0.95x today's in every round.  The medians over
    # all rounds see the rounds' speeds as well; the paired ratio does not.
    speed = [1.0, 1.0, 0.5, 0.5]
    windows = {"auto": [95.0 * s for s in speed],
               "today": [100.0 * s for s in speed],
               "nospin": [130.0, 40.0, 30.0, 60.0]}
    assert autotune.paired(windows["auto"], windows["today"]) == pytest.approx(0.95)
    # Round by round auto led nospin in two rounds and trailed in two.
    assert autotune.paired(windows["auto"], windows["nospin"]) == pytest.approx(
        statistics.median([95 / 130, 95 / 40, 47.5 / 30, 47.5 / 60]))
    text, summary = autotune.table(_rows(windows), ["auto", "today", "nospin"])
    assert summary["min_auto_over_today_paired"] == pytest.approx(0.95)
    assert summary["cells_auto_at_least_today_paired"] == 0
    # The least of auto's paired ratios names the hand setting it fares
    # worst against.
    assert summary["min_auto_over_best_paired"] == pytest.approx(0.95)
    assert "| today, 0.95 | 0.95 |" in text
    assert autotune.paired([], []) is None and autotune.paired([1.0], [0.0]) is None


def test_the_noise_is_also_read_round_by_round(autotune: Any) -> None:
    cells = {("null", 2, 4): {"today": 100.0, "nospin": 100.0}}
    windows = {("null", 2, 4): {"today": [100.0, 50.0, 100.0], "nospin": [80.0, 60.0, 100.0]}}
    got = autotune.noise(cells, windows)
    assert got["max"] == pytest.approx(1.0)
    # Per round 1.25, 0.83, 1.0: the median 1.0.
    assert got["paired_max"] == pytest.approx(1.0)
    windows[("null", 2, 4)]["nospin"] = [80.0, 40.0, 80.0]
    assert autotune.noise(cells, windows)["paired_max"] == pytest.approx(1.25)


def test_a_sign_test_counts_rounds_not_distances(autotune: Any) -> None:
    # 7 of 8 rounds below: the chance of 7 or 8 heads in 8 tosses.
    a, b = [99.0] * 7 + [101.0], [100.0] * 8
    assert autotune.sign_test(a, b) == (7, 8, pytest.approx(9 / 256))
    # Below 0.9 x b in none of them.
    assert autotune.sign_test(a, b, 0.9) == (0, 8, pytest.approx(1.0))
    # Four rounds cannot reach ALPHA, all four below or not.
    assert autotune.sign_test([1.0] * 4, [2.0] * 4) == (4, 4, pytest.approx(1 / 16))
    assert 1 / 16 > autotune.ALPHA
    assert autotune.sign_test([], []) is None
    assert autotune.apart(a, b) == pytest.approx(2 * 9 / 256)
    assert autotune.apart(b, a) == pytest.approx(2 * 9 / 256)


def test_the_summary_names_the_cells_below_by_more_than_chance(autotune: Any) -> None:
    # Cell 4 workers: auto 1% behind today in every round, a consistent
    # loss.  Cell 16: auto far behind in four rounds of eight and ahead in
    # the others, a large but even spread.  Only the first is flagged,
    # though the second's median ratio is lower.
    eight = [100.0] * 8
    rows = _rows({"auto": [99.0] * 8, "today": eight})
    rows += [dict(r, workers=16) for r in _rows({"auto": [70.0] * 4 + [101.0] * 4,
                                                  "today": eight})]
    _, summary = autotune.table(rows, ["auto", "today"])
    tests = summary["sign_tests"]
    assert tests["cells_tested"] == {"0.9_best": 2, "today": 2}
    assert tests["cells_significantly_below"] == {"0.9_best": 0, "today": 1}
    assert tests["significantly_below"]["today"] == [
        "null, 2 CPUs, 4 workers: 8 of 8 rounds below today, p 0.004"]
    assert summary["cells_auto_at_least_today"] == 0
    # The same-setting check: today and nospin apart in every round.
    cells = {("null", 2, 4): {"today": 100.0, "nospin": 90.0}}
    windows = {("null", 2, 4): {"today": eight, "nospin": [90.0] * 8}}
    assert autotune.noise(cells, windows)["cells_apart_by_sign_test"] == 1
    windows[("null", 2, 4)]["nospin"] = [90.0, 110.0] * 4
    assert autotune.noise(cells, windows)["cells_apart_by_sign_test"] == 0


def test_summarize_reads_a_committed_grid(autotune: Any, tmp_path: Path,
                                          capsys: Any) -> None:
    import json

    windows = {"auto": [99.0] * 8, "today": [100.0] * 8}
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"experiment": "grid", "args": {"settings": ["auto", "today"]},
                                "rows": _rows(windows)}))
    assert autotune.main(["--summarize", str(grid)]) == 0
    out = capsys.readouterr().out
    assert "| null | 2 | 4 | **99** | 100 |" in out
    assert json.loads(out[out.index("{"):])["sign_tests"]["cells_significantly_below"] == {
        "0.9_best": 0, "today": 1}
    timeline = tmp_path / "timeline.json"
    timeline.write_text(json.dumps({"experiment": "timeline"}))
    assert autotune.main(["--summarize", str(timeline)]) == 2


def _busy_loops() -> list[int]:
    """Busy loops of the timeline still running."""
    return [pid for pid, cmd in command_lines() if cmd[1:3] == BUSY_LOOP]


@pytest.mark.timeout(240)
def test_the_timeline_runs_every_phase(tmp_path: Path) -> None:
    """--timeline end to end with 1 and 2 workers and 1 s phases: every
    phase is sampled and served, its settling is reported with the
    tuner's choice (the clients' crowding included), the plot is written,
    and the busy loops of the last phase are gone afterwards.  No timed
    assertions: what the tuner chose within 1 s is not checked."""
    import json
    import subprocess

    out, plot = tmp_path / "timeline.json", tmp_path / "timeline.png"
    r = subprocess.run([sys.executable, str(SCRIPT), "--timeline", "--timeline-workers", "1,2",
                        "--phase", "1.0", "--json", str(out), "--plot", str(plot)],
                       capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["phases"] == ["1 workers", "2 workers", "1 workers", "1 workers, model cost x2",
                             "1 workers, cost x2, a busy loop per CPU"]
    assert [s["phase"] for s in res["settle"]] == res["phases"]
    assert all(s["final_rate"] > 0 for s in res["settle"])
    assert all(len(s["final_choice"]) == 3 for s in res["settle"])
    assert {x["phase"] for x in res["samples"]} >= {0, 1, 2, 3, 4}
    assert all("crowding" in x for x in res["samples"])
    assert plot.stat().st_size > 0
    assert "| phase |" in r.stdout and "crowding" in r.stdout
    assert _busy_loops() == []


def test_each_row_reports_its_setting_as_its_own_windows_ended(autotune: Any,
                                                               monkeypatch: Any) -> None:
    """The grid's rows carry each evaluator's stats (auto's tuner report)
    as read when that setting's last window ended: read after the cell,
    auto's tuner would report the load of the settings served after it
    (their workers, spinning, in its count of runnable tasks).  Made-up
    evaluators whose stats name the setting served last anywhere."""
    import argparse

    served: list[str] = []

    class Ev:
        def __init__(self, setting: str) -> None:
            self.setting = setting

        def stats(self) -> dict[str, Any]:
            return {"mean_batch": 1.0, "tuner": {"served_last": served[-1] if served else None}}

        def close(self) -> None:
            pass

    class Pool:
        def __init__(self, n: int) -> None:
            pass

        def run(self, ev: Ev, plan: Any) -> list[int]:
            served.append(ev.setting)
            return [100 for _ in plan]

        def close(self) -> None:
            pass

    monkeypatch.setattr(autotune, "Pool", Pool)
    monkeypatch.setattr(autotune, "spawn", lambda kind, setting, net: Ev(setting))
    monkeypatch.setattr(autotune, "START_DELAY_S", 0.0)
    settings = ["auto", "today", "threads2"]
    args = argparse.Namespace(workers=[1, 2], models=["null"], settings=settings, repeats=3,
                              warmup=0.0, hand_warmup=0.0, seconds=1.0, reports=False, ncpu=2,
                              net="")
    rows = autotune.run_grid(args)
    assert len(rows) == 6
    # Every order of a round ends with some other setting than auto at
    # least once, so a read after the cell would name it.
    assert all(r["tuner"]["served_last"] == r["setting"] for r in rows), rows
    assert all(r["rates"] == [100.0] * 3 for r in rows if r["workers"] == 1)
