"""An evaluator of several methods, watched: the interval between two
snapshots has each method's requests, model calls and model time, the
live view a line per method, the Prometheus metrics a series per method
with the segment's counts, and ``shmeval stats`` each method's figures;
an evaluator of one method shows none of it."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from typing import Any, Dict, List

import numpy as np
import pytest
from rich.console import Console

import shmeval
from shmeval.monitor.prometheus import SegmentCollector, start_exporter
from shmeval.monitor.reader import EvaluatorReader, Interval, Snapshot
from shmeval.monitor.watch import render
from helpers import make_ev, make_state

TIMEOUT_S = 60

METHODS = {
    "initial": shmeval.Method(inputs={"obs": ((3,), "float32")},
                              outputs={"hidden": ((2,), "float32")}),
    "recurrent": shmeval.Method(inputs={"hidden": ((2,), "float32"), "action": ((), "int64")},
                                outputs={"hidden": ((2,), "float32"), "reward": ((), "float32")}),
}


class TwoMethods:
    """initial(obs) and recurrent(hidden, action), counting the model calls
    of each."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.lock = threading.Lock()

    def _count(self, name: str) -> None:
        with self.lock:
            self.calls[name] += 1

    def initial(self, x: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        self._count("initial")
        return {"hidden": x["obs"][:, :2].copy()}

    def recurrent(self, x: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        self._count("recurrent")
        return {"hidden": x["hidden"] + x["action"][:, None].astype(np.float32),
                "reward": np.zeros(len(x["hidden"]), np.float32)}


def two_method_ev(model: TwoMethods) -> shmeval.Evaluator:
    return shmeval.Evaluator(model, methods=METHODS, max_batch=16)


def send(ev: Any, initial: List[int], recurrent: List[int]) -> None:
    """One evaluate_many of each size in ``initial`` and in ``recurrent``."""
    for n in initial:
        ev.evaluate_many({"obs": np.ones((n, 3), np.float32)}, method="initial")
    for n in recurrent:
        ev.evaluate_many({"hidden": np.zeros((n, 2), np.float32),
                          "action": np.arange(n, dtype=np.int64)}, method="recurrent")


def text_of(snap: Snapshot, iv: Any) -> str:
    console = Console(width=140, record=True, file=open("/dev/null", "w"))
    console.print(render("/shmeval-test", snap, iv, 1.0))
    return console.export_text()


def line_of(text: str, method: str) -> List[str]:
    """The words of the view's line for ``method``."""
    [line] = [ln for ln in text.splitlines() if ln.split()[:1] == [method]]
    return line.split()


@pytest.mark.timeout(TIMEOUT_S)
def test_the_interval_and_the_view_have_each_methods_figures() -> None:
    model = TwoMethods()
    with two_method_ev(model) as ev:
        reader = EvaluatorReader(ev.address)
        send(ev, [2], [1])                                  # before the interval
        a = reader.snapshot()
        calls_before = Counter(model.calls)
        send(ev, [3] * 4, [5] * 6)                          # 12 initial, 30 recurrent
        b = reader.snapshot()
        calls = model.calls - calls_before
    iv = Interval.between(a, b)
    assert list(iv.methods) == ["initial", "recurrent"]
    init, rec = iv.methods["initial"], iv.methods["recurrent"]
    assert (init.requests, rec.requests) == (12, 30)
    assert (init.batches, rec.batches) == (calls["initial"], calls["recurrent"])
    # Every model call is one method's: the methods' figures add up to the total.
    assert init.requests + rec.requests == iv.requests
    assert init.batches + rec.batches == iv.batches
    assert init.model_ns + rec.model_ns == int(b.raw["model_ns"] - a.raw["model_ns"])
    assert rec.requests_per_s == pytest.approx(30 / iv.seconds)
    assert rec.mean_batch == pytest.approx(30 / rec.batches)
    assert rec.model_ms_per_batch == pytest.approx(rec.model_ns / rec.batches / 1e6)
    assert b.stats["methods"]["recurrent"]["requests"] == 31

    text = text_of(b, iv)
    assert "methods, last interval" in text
    words = line_of(text, "recurrent")
    # method, requests/s, mean batch, model per batch (a number and its
    # unit), model busy, requests since start
    assert words[2] == f"{30 / rec.batches:.1f}" and words[4] in ("ns", "µs", "ms", "s")
    assert words[-1] == "31"
    assert line_of(text, "initial")[-1] == "14"
    # The first frame has no interval yet: the totals only.
    first = line_of(text_of(a, None), "initial")
    assert first == ["initial", "-", "-", "-", "-", "2"]


@pytest.mark.timeout(TIMEOUT_S)
def test_the_metrics_have_a_series_per_method() -> None:
    model = TwoMethods()
    with two_method_ev(model) as ev:
        send(ev, [1, 2, 3], [4, 4])
        samples = {(s.name, s.labels.get("method")): s.value
                   for m in SegmentCollector(EvaluatorReader(ev.address)).collect()
                   for s in m.samples}
        stats = ev.stats()
    for name, requests in (("initial", 6), ("recurrent", 8)):
        assert samples[("shmeval_method_requests_total", name)] == requests
        assert samples[("shmeval_method_batches_total", name)] == model.calls[name]
        figures = stats["methods"][name]
        assert samples[("shmeval_method_model_seconds_total", name)] == pytest.approx(
            figures["model_ms_per_batch"] * figures["batches"] / 1e3)
    assert (samples[("shmeval_method_requests_total", "initial")]
            + samples[("shmeval_method_requests_total", "recurrent")]
            == samples[("shmeval_requests_total", None)] == 14)
    assert (samples[("shmeval_method_model_seconds_total", "initial")]
            + samples[("shmeval_method_model_seconds_total", "recurrent")]
            == pytest.approx(samples[("shmeval_model_seconds_sum", None)]))


@pytest.mark.timeout(TIMEOUT_S)
def test_the_exporter_serves_the_method_series() -> None:
    from prometheus_client.parser import text_string_to_metric_families
    import urllib.request

    with two_method_ev(TwoMethods()) as ev:
        with start_exporter(ev.address, 0) as exporter:
            send(ev, [2], [3])
            with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics",
                                        timeout=10) as r:
                text = r.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for family in ("shmeval_method_requests", "shmeval_method_batches",
                   "shmeval_method_model_seconds"):
        assert families[family].type == "counter"
        assert {s.labels["method"] for s in families[family].samples
                if s.name == family + "_total"} == {"initial", "recurrent"}


@pytest.mark.timeout(TIMEOUT_S)
def test_the_stats_command_prints_each_methods_figures() -> None:
    with two_method_ev(TwoMethods()) as ev:
        send(ev, [2, 2], [3])
        r = subprocess.run([sys.executable, "-m", "shmeval", "stats", ev.address],
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    methods = json.loads(r.stdout)["methods"]
    assert {k: v["requests"] for k, v in methods.items()} == {"initial": 4, "recurrent": 3}


@pytest.mark.timeout(TIMEOUT_S)
def test_one_method_shows_none_of_it() -> None:
    with make_ev() as ev:
        reader = EvaluatorReader(ev.address)
        a = reader.snapshot()
        ev.evaluate_many(np.stack([make_state(1)] * 3))
        b = reader.snapshot()
        names = {m.name for m in SegmentCollector(reader).collect()}
    iv = Interval.between(a, b)
    assert iv.methods == {} and "methods" not in b.raw and b.stats["methods"] is None
    assert "methods" not in text_of(b, iv)
    assert not any(n.startswith("shmeval_method") for n in names)
