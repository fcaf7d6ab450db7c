"""The evaluation cache in the live view and the Prometheus metrics, from
a real evaluator with a cache (not a made-up stats dict)."""
from __future__ import annotations

import pytest
from rich.console import Console

from shmeval.monitor.prometheus import SegmentCollector
from shmeval.monitor.reader import EvaluatorReader
from shmeval.monitor.watch import render
from helpers import make_ev, make_state

TIMEOUT_S = 60


@pytest.mark.timeout(TIMEOUT_S)
def test_the_cache_shows_in_the_view_and_the_metrics() -> None:
    with make_ev(cache_entries=64) as ev:
        for _ in range(3):
            ev.evaluate(make_state(4))
        reader = EvaluatorReader(ev.address)
        snap = reader.snapshot()
        console = Console(width=200, record=True, file=open("/dev/null", "w"))
        console.print(render(ev.address, snap, None, 1.0))
        text = console.export_text()
        metrics = {s.name: s.value for m in SegmentCollector(reader).collect()
                   for s in m.samples}
    line = next(ln for ln in text.splitlines() if ln.startswith("cache"))
    assert "hits 2" in line and "misses 1" in line and "entries 64" in line
    assert "hit_rate 0.667" in line and "clients" not in line
    assert metrics["shmeval_cache_hits_total"] == 2
    assert metrics["shmeval_cache_misses_total"] == 1
    assert metrics["shmeval_cache_entries"] == 64
