"""The small benchmark scripts of bench/ that the docs quote, each run end to
end with the smallest arguments it takes: it exits 0 and prints the lines
(or Markdown tables) that docs/performance.md and docs/protocol.md quote,
one per round, repeat or variant asked for, with positive figures.  The
figures themselves are not checked: this is the script working, not a
measurement.  bench/tuner_overhead.py has no test here: its windows are
fixed (5 s of settling and 3 s of measuring per variant, two rounds), so
even one variant takes over 16 s."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import NUMBER, number, run_bench

BENCH = Path(__file__).resolve().parents[2] / "bench"
RESULTS = BENCH / "results"


@pytest.mark.timeout(90)
def test_evaluate_many_cpu() -> None:
    """One worker, two rounds: a row per way (many, submit, single) with a
    CPU time per round, and each other way's ratio over many."""
    out = run_bench("evaluate_many_cpu.py", "--workers", "1", "--rows", "2", "--search-us", "0",
                    "--model-ms", "0", "--calls", "20", "--rounds", "2", timeout=60)
    assert "1 workers, 2 rows per call, search 0 µs, model 0.0 ms per batch" in out, out
    for way in ("many", "submit", "single"):
        m = re.search(rf"^  {way} +({NUMBER}) +({NUMBER})$", out, re.M)
        assert m, f"no row of two rounds for {way}:\n{out}"
        assert all(number(v) > 0 for v in m.groups()), out
    assert re.search(rf"^over many, medians of the rounds: submit ({NUMBER})x  single ({NUMBER})x$",
                     out, re.M), out


@pytest.mark.timeout(60)
def test_search_cost() -> None:
    """One game, two simulations a move, two repeats: a line per repeat with
    its evaluations and CPU per evaluation with and without the stand-in
    net, and the median without it."""
    out = run_bench("search_cost.py", "--games", "1", "--simulations", "2", "--moves", "8",
                    "--repeats", "2", timeout=60)
    assert "1 games, 2 simulations per move, 8 moves per round" in out, out
    rows = re.findall(rf"^ +({NUMBER}) evaluations: +({NUMBER}) us CPU per evaluation, +"
                      rf"({NUMBER}) without the stand-in net$", out, re.M)
    assert len(rows) == 2, out
    assert all(number(evals) > 0 and number(cpu) > 0 for evals, cpu, _ in rows), out
    assert re.search(rf"^median without the stand-in net: {NUMBER} us per evaluation$", out,
                     re.M), out


@pytest.mark.timeout(60)
def test_threads_roundtrip() -> None:
    """Two threads, two short windows: the median round trips/s and each
    window's figure, every one positive."""
    out = run_bench("threads_roundtrip.py", "--threads", "2", "--seconds", "0.2",
                    "--warmup", "0.05", "--repeats", "2", timeout=60)
    m = re.search(rf"^2 threads of one process: ({NUMBER}) round trips/s "
                  rf"\(median of 2; ({NUMBER}), ({NUMBER})\)$", out, re.M)
    assert m, out
    assert all(number(v) > 0 for v in m.groups()), out


@pytest.mark.timeout(90)
def test_pipelined_cpu() -> None:
    """One worker, one round: a line for the blocking client and one for
    K = 2, each with answers/s and the per-answer CPU of the workers and of
    the evaluator."""
    out = run_bench("pipelined_cpu.py", "--workers", "1", "--depth", "2", "--seconds", "0.2",
                    "--rounds", "1", timeout=60)
    lines = re.findall(rf"^1 workers, (blocking|K = 2) *: +({NUMBER}) answers/s; per answer: "
                       rf"worker user {NUMBER} µs, system {NUMBER} µs, {NUMBER} sleeps; "
                       rf"evaluator user -?{NUMBER} µs, system -?{NUMBER} µs$", out, re.M)
    assert [name for name, _ in lines] == ["blocking", "K = 2"], out
    assert all(number(rate) > 0 for _, rate in lines), out


TABLE_HEAD = re.compile(r"^\| workers \|(?: (?:Queue|Pipe|faster-fifo|Lock\+Sem) /s \|)+ "
                        r"\*\*shmeval\*\* /s \| shmeval p50 / p99 µs \| fairness \|"
                        r"(?: x (?:Queue|Pipe|faster-fifo|Lock\+Sem) \|)+$")
SIDE_BY_SIDE_HEAD = ("| workers | normal: shmeval /s | p99 µs | x Queue | x Pipe | x Lock+Sem "
                     "| batch: shmeval /s | p99 µs | x Queue | x Pipe | x Lock+Sem |")


def tables(out: str) -> dict[str, list[list[str]]]:
    """The Markdown tables printed, by the title line before each (without
    its colon), as rows of cells (the header row first, the rule left out)."""
    found: dict[str, list[list[str]]] = {}
    title = None
    for line in out.splitlines():
        if line.endswith(":") and not line.startswith("|"):
            title = line[:-1]
            found[title] = []
        elif line.startswith("|") and not line.startswith("|---"):
            assert title is not None, out
            found[title].append([c.strip() for c in line.strip("|").split("|")])
    return found


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batch", [False, True], ids=["one-run", "with-batch-run"])
def test_readme_table(batch: bool) -> None:
    """The committed `shmeval bench --json` run(s): a table per state of the
    run, with the header docs/performance.md quotes and a row per worker
    count that shmeval was measured at, every row as wide as its header;
    given the batch-workers run too, the side-by-side Connect Four table
    after them."""
    files = [RESULTS / "bench.json"] + ([RESULTS / "bench-batch.json"] if batch else [])
    out = run_bench("readme_table.py", *map(str, files), timeout=60)
    summary = json.loads(files[0].read_text())["summary"]
    states = list(dict.fromkeys(r["state"] for r in summary))
    found = tables(out)
    side = "c4, normal and batch workers"
    assert list(found) == states + ([side] if batch else []), out
    for state in states:
        head, *rows = found[state]
        line = "| " + " | ".join(head) + " |"
        assert TABLE_HEAD.match(line), line
        measured = {r["workers"] for r in summary
                    if r["state"] == state and r["method"] == "shmeval" and r["repeats"]}
        assert [int(row[0]) for row in rows] == sorted(measured), out
        assert rows and all(len(row) == len(head) for row in rows), out
    if batch:
        head, *rows = found[side]
        line = "| " + " | ".join(head) + " |"
        assert line == SIDE_BY_SIDE_HEAD, line
        assert rows and all(len(row) == len(head) for row in rows), out
