"""bench/muzero_throughput.py end to end with --quick (2 workers, one short
window per mode): the three ways of serving the MuZero-style net start,
answer the check searches as the module does and are measured; the two
null-model evaluators (named inputs, one packed array) are measured; the
tables, ratios and targets are printed and the JSON holds them.  Figures
are not checked: this is the script working, not a measurement."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import NUMBER, number, run_bench

pytest.importorskip("torch")

SEARCH_MODES = ["shmeval", "queue", "local"]
NULL_MODES = ["named", "packed"]


def table_rows(out: str, title: str) -> dict[str, list[str]]:
    """The rows (cells split on runs of spaces) of the table printed under
    the line starting with ``title`` (then its header), by their first
    cell: the lines up to the first that is blank or starts with
    "ratios" or "named/packed"."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = {}
    for line in lines[start + 2:]:
        if not line.strip() or line.startswith(("ratios", "named/packed")):
            break
        cells = line.split()
        rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.timeout(300)
def test_muzero_throughput_quick(tmp_path: Path) -> None:
    path = tmp_path / "muzero.json"
    out = run_bench("muzero_throughput.py", "--quick", "--json", str(path), timeout=280)
    assert out.startswith("machine: "), out
    search = table_rows(out, "MuZero-style search, 2 workers, one state per request")
    assert sorted(search) == sorted(SEARCH_MODES), out
    for mode, cells in search.items():
        # recurrent/s, requests/s, p50, p90, p99, worker RSS and PSS: positive
        assert all(number(c) > 0 for c in cells[:7]), (mode, out)
    for name in ("shmeval/queue recurrent evals/s", "shmeval/local recurrent evals/s",
                 "worker RSS local/shmeval", "CPU per request queue/shmeval",
                 "CPU per request local/shmeval"):
        assert re.search(rf"^  {re.escape(name)} {NUMBER}x \(rounds: median {NUMBER}x, "
                         rf"{NUMBER}-{NUMBER}\)$", out, re.M), (name, out)
    null = table_rows(out, "Named inputs against one packed array, null model, 2 workers, "
                           "5,384 B per request")
    assert sorted(null) == sorted(NULL_MODES), out
    for mode, cells in null.items():
        assert all(number(c) > 0 for c in cells[:5]), (mode, out)
    for name in ("named/packed CPU per round trip", "named/packed round trips/s"):
        assert re.search(rf"^  {re.escape(name)} {NUMBER}x \(rounds: median {NUMBER}x, "
                         rf"{NUMBER}-{NUMBER}\)$", out, re.M), (name, out)
    for name in ("shmeval/queue recurrent evals/s", "shmeval/local recurrent evals/s",
                 "worker RSS local/shmeval", "named/packed CPU per round trip"):
        assert re.search(rf"^  {re.escape(name)}: {NUMBER}x \(target [<>]= {NUMBER}x: "
                         rf"(met|NOT met); the rounds' median {NUMBER}x\)$", out, re.M), \
            (name, out)

    result = json.loads(path.read_text())
    runs = {run["mode"]: run for run in result["search"]["runs"]}
    assert sorted(runs) == sorted(SEARCH_MODES)
    assert all(run["check"]["ok"] for run in runs.values()), runs
    # Only the net-per-worker workers import torch.
    assert {m: r["workers_that_imported_torch"] for m, r in runs.items()} == {
        "shmeval": 0, "queue": 0, "local": 2}
    assert runs["shmeval"]["evaluator_stats"]["methods"]["recurrent"]["requests"] > 0
    assert sorted(result["search"]["summary"]) == sorted(SEARCH_MODES)
    assert sorted(result["named"]["summary"]) == sorted(NULL_MODES)
    for part in ("search", "named"):
        for t in result[part]["trials"]:
            assert t["recurrent"] > 0 and t["latency_us"]["p50"] > 0, t
    assert set(result["targets"]) == {"shmeval/queue recurrent evals/s",
                                      "shmeval/local recurrent evals/s",
                                      "worker RSS local/shmeval",
                                      "named/packed CPU per round trip"}
