"""The Prometheus collector and exporter, read back with prometheus_client's
own parser: the counters are the segment's, every histogram's buckets are
cumulative and end in its count (the requests for the queue wait, the
batches for batch size and model time), the sums are right, the replicas,
cache and tuner figures appear when ``stats()`` has them, ``close()``
frees the port, and ``shmeval metrics`` serves until the evaluator closes."""
from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from typing import Any, Dict, List

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from shmeval.monitor.prometheus import (SegmentCollector, batch_size_buckets, latency_buckets,
                                        latency_sum_s, start_exporter)
from shmeval.monitor.reader import EvaluatorReader, Snapshot
from shmeval.stats import _bin_lo
from helpers import make_ev, make_state

TIMEOUT_S = 60


def scrape(port: int) -> Dict[str, List[Sample]]:
    """{metric family name: its samples} from the exporter's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples: List[Sample], name: str, **labels: str) -> float:
    [v] = [s.value for s in samples if s.name == name and s.labels == labels]
    return float(v)


def buckets(samples: List[Sample], name: str) -> List[tuple[float, float]]:
    return [(float(s.labels["le"]), s.value) for s in samples if s.name == name + "_bucket"]


def test_latency_buckets_count_every_bin_below_their_edge() -> None:
    hist = np.zeros(256, np.uint64)
    for ns in (300, 511, 512, 513, 10_000, 10**12):   # 10**12 ns: past the last bucket
        b = next(b for b in range(256) if _bin_lo(b) <= ns < _bin_lo(b + 1))
        hist[b] += 1
    got = dict(latency_buckets(hist))
    assert got[repr(256e-9)] == 0 and got[repr(512e-9)] == 2   # 300 and 511 are < 512
    assert got[repr(1024e-9)] == 4 and got[repr(16384e-9)] == 5
    assert got["+Inf"] == 6 and list(got)[-2] == repr(_bin_lo(140) / 1e9)
    counts = list(got.values())
    assert counts == sorted(counts)
    # The sum from the bins' midpoints is within a bin's width of the truth.
    assert latency_sum_s(hist) == pytest.approx((300 + 511 + 512 + 513 + 10_000 + 10**12) / 1e9,
                                                rel=0.13)


def test_batch_size_buckets_are_powers_of_two_up_to_max_batch() -> None:
    hist = np.zeros(25, np.uint64)          # max_batch 24
    hist[[1, 3, 4, 17, 24]] = [5, 1, 2, 3, 4]
    assert batch_size_buckets(hist) == [("1.0", 5), ("2.0", 5), ("4.0", 8), ("8.0", 8),
                                        ("16.0", 8), ("24.0", 15), ("+Inf", 15)]


@pytest.mark.timeout(TIMEOUT_S)
def test_a_scrape_holds_the_segments_figures() -> None:
    with make_ev(max_batch=32) as ev:
        with start_exporter(ev.address, 0) as exporter:
            for n in (1, 2, 3, 5, 8, 13, 21):
                ev.evaluate_many(np.stack([make_state(1)] * n))
            stats = ev.stats()
            m = scrape(exporter.port)
    assert value(m["shmeval_requests"], "shmeval_requests_total") == stats["requests"] == 53
    assert value(m["shmeval_batches"], "shmeval_batches_total") == stats["batches"]
    assert value(m["shmeval_failed_requests"], "shmeval_failed_requests_total") == 0
    assert value(m["shmeval_up"], "shmeval_up") == 1
    assert value(m["shmeval_state"], "shmeval_state", state="serving") == 1
    assert value(m["shmeval_state"], "shmeval_state", state="closed") == 0
    assert value(m["shmeval_model_version"], "shmeval_model_version") == 0
    [(labels, sent)] = [(s.labels, s.value) for s in m["shmeval_client_requests"]
                        if s.name == "shmeval_client_requests_total"]
    assert sent == 53 and set(labels) == {"client", "pid"}
    for name, count in (("shmeval_batch_size", stats["batches"]),
                        ("shmeval_queue_wait_seconds", stats["requests"]),
                        ("shmeval_model_seconds", stats["batches"])):
        b = buckets(m[name], name)
        assert [c for _, c in b] == sorted(c for _, c in b), name      # cumulative
        assert b[-1] == (float("inf"), count), name
        assert value(m[name], name + "_count") == count, name
    for le, count in buckets(m["shmeval_batch_size"], "shmeval_batch_size"):
        assert count == sum(n for size, n in stats["batch_hist"].items() if size <= le), le
    assert value(m["shmeval_batch_size"], "shmeval_batch_size_sum") == 53
    assert value(m["shmeval_model_seconds"], "shmeval_model_seconds_sum") > 0


SECTIONS = ("replicas", "cache", "tuner")


class FakeReader(EvaluatorReader):
    """A reader whose stats() has exactly the sections in ``extra``."""

    extra: Dict[str, Any] = {}

    def snapshot(self) -> Snapshot:
        snap = super().snapshot()
        stats = {k: v for k, v in snap.stats.items() if k not in SECTIONS}
        return Snapshot(snap.raw, {**stats, **self.extra}, snap.client_requests)


@pytest.mark.timeout(TIMEOUT_S)
def test_replicas_cache_and_tuner_appear_when_stats_has_them() -> None:
    with make_ev() as ev:
        reader = FakeReader(ev.address)
        names = {m.name for m in SegmentCollector(reader).collect()}
        assert not any(n.startswith(("shmeval_replica", "shmeval_cache", "shmeval_tuner"))
                       for n in names)
        reader.extra = {
            "replicas": [{"replica": 0, "pid": 11, "starttime": 5, "state": "serving",
                          "device": "cuda:0", "model_version": 3, "requests": 100,
                          "batches": 10, "model_time_share": 0.5},
                         {"replica": 1, "pid": 12, "starttime": 6, "state": "dead",
                          "device": "cuda:1", "model_version": 2, "requests": 50, "batches": 5,
                          "model_time_share": 0.0}],
            "cache": {"hits": 90, "misses": 10, "hit_rate": 0.9, "entries": 77, "policy": "lru"},
            "tuner": {"max_wait_us": 120.0}}
        got = {s.name: s for m in SegmentCollector(reader).collect() for s in m.samples
               if s.labels.get("replica", "0") == "0"}
    assert got["shmeval_replica_up"].value == 1
    assert got["shmeval_replica_up"].labels == {"replica": "0", "pid": "11", "device": "cuda:0"}
    assert got["shmeval_replica_requests_total"].value == 100
    assert got["shmeval_replica_batches_total"].value == 10
    assert got["shmeval_replica_model_time_share"].value == 0.5
    assert got["shmeval_replica_model_version"].value == 3
    assert "shmeval_replica_starttime" not in got
    assert got["shmeval_cache_hits_total"].value == 90
    assert got["shmeval_cache_hit_rate"].value == 0.9
    assert got["shmeval_cache_entries"].value == 77
    assert not any(n.startswith("shmeval_cache_policy") for n in got)
    assert got["shmeval_tuner_max_wait_us"].value == 120


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        # As a server binds (prometheus_client's too): the port's closed
        # connections in TIME_WAIT do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.timeout(TIMEOUT_S)
def test_close_stops_serving_and_frees_the_port() -> None:
    with make_ev() as ev:
        exporter = start_exporter(ev.address, 0)
        port = exporter.port
        assert "shmeval_requests" in scrape(port)
        assert not port_is_free(port)
        exporter.close()
        exporter.close()                                  # idempotent
        assert port_is_free(port)
        with pytest.raises(OSError):
            scrape(port)


@pytest.mark.timeout(TIMEOUT_S)
def test_the_metrics_command_serves_until_the_evaluator_closes() -> None:
    with make_ev() as ev:
        p = subprocess.Popen([sys.executable, "-m", "shmeval", "metrics", ev.address, "--port",
                              "0", "--check-every", "0.1"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        try:
            assert p.stdout is not None
            first = p.stdout.readline()
            # serving the metrics of ADDRESS on http://127.0.0.1:PORT/metrics (Ctrl-C stops)
            port = int(first.split("http://127.0.0.1:")[1].split("/")[0])
            ev.evaluate(make_state(1))
            assert value(scrape(port)["shmeval_requests"], "shmeval_requests_total") == 1
        except BaseException:
            p.kill()
            raise
    out, err = p.communicate(timeout=TIMEOUT_S)
    assert p.returncode == 0 and err == "", err
    assert out.strip() == f"the evaluator serving {ev.address} is closed"
    assert port_is_free(port)


@pytest.mark.timeout(120)
def test_a_killed_evaluator_is_not_up() -> None:
    """shmeval_up follows the serving process's liveness, judged when
    scraped: an Evaluator.spawn process killed with SIGKILL reads 0."""
    import os
    import signal
    import time

    import shmeval
    from helpers import INPUT_SHAPE, OUTPUTS, fake_factory
    from shmeval import segment

    with shmeval.Evaluator.spawn(fake_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                 max_batch=8, max_clients=4, start_timeout=60,
                                 restarts=0) as ev:
        with start_exporter(ev.address, 0) as exporter:
            assert value(scrape(exporter.port)["shmeval_up"], "shmeval_up") == 1
            os.kill(ev.pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while segment.is_alive(ev.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            m = scrape(exporter.port)
    assert value(m["shmeval_up"], "shmeval_up") == 0
    assert value(m["shmeval_state"], "shmeval_state", state="died") == 1
