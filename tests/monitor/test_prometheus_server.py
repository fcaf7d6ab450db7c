"""A real Prometheus server (Debian's ``prometheus``, which .ci/run
installs) scrapes the exporter of an evaluator under load, on loopback
ports: through its HTTP query API the counters rise during the load, and
once it stops every histogram's buckets add up to the request or batch
count, and it runs every query of docs/grafana-dashboard.json; for an
evaluator of two methods it holds each method's series, and the
dashboard's per-method queries give one series per method.  Nothing is
left running: Prometheus is stopped and waited for, the exporter and the
evaluator closed.  Without the binary the test is
skipped, or fails in CI (tests/external.py)."""
from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List

import numpy as np
import pytest

from shmeval.monitor.prometheus import start_exporter
from external import require_binary
from helpers import make_ev, make_state

TIMEOUT_S = 120
#: How long Prometheus may take to start, or to show a scrape.
WAIT_S = 60.0
SCRAPE_INTERVAL = "200ms"
WORKERS = 2
#: evaluate_many calls per worker in each of its two rounds, of 1 to 8 rows each.
CALLS = 300


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """A Prometheus server on a loopback port, its data in ``tmp``."""

    def __init__(self, binary: str, tmp: Path, target_port: int) -> None:
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {SCRAPE_INTERVAL}\n"
            "scrape_configs:\n"
            "  - job_name: shmeval\n"
            f"    scrape_interval: {SCRAPE_INTERVAL}\n"
            f"    scrape_timeout: {SCRAPE_INTERVAL}\n"
            "    static_configs:\n"
            f"      - targets: ['127.0.0.1:{target_port}']\n")
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            return r.read()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + WAIT_S
        while True:
            assert self.proc.poll() is None, f"prometheus exited: {self.proc.returncode}"
            try:
                self.get("/-/ready")
                return
            except OSError:
                assert time.monotonic() < deadline, "prometheus did not become ready"
                time.sleep(0.1)

    def query(self, expr: str) -> Dict[str, float]:
        """An instant query: {the series' labels as JSON: value}."""
        body = json.loads(self.get("/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        assert body["status"] == "success", body
        return {json.dumps(r["metric"], sort_keys=True): float(r["value"][1])
                for r in body["data"]["result"]}

    def one(self, expr: str) -> float:
        [v] = self.query(expr).values()
        return v

    def wait_for(self, expr: str, check: Any) -> float:
        """The value of a one-series query once ``check(value)`` holds."""
        deadline = time.monotonic() + WAIT_S
        while True:
            got = self.query(expr)
            if len(got) == 1 and check(v := next(iter(got.values()))):
                return v
            assert time.monotonic() < deadline, f"{expr}: {got}"
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def dashboard_queries() -> List[str]:
    path = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
    panels = json.loads(path.read_text())["panels"]
    return [t["expr"] for p in panels for t in p["targets"]]


@pytest.fixture
def prometheus_binary() -> str:
    return require_binary("prometheus", "apt-get install -y prometheus")


def load(ev: Any, seed: int, second_round: Any) -> None:
    """Two rounds of requests, the second once ``second_round`` is set."""
    rng = np.random.default_rng(seed)
    for round_ in range(2):
        if round_:
            assert second_round.wait(TIMEOUT_S)
        for _ in range(CALLS):
            ev.evaluate_many(np.stack([make_state(1)] * int(rng.integers(1, 9))))


@pytest.fixture
def evaluator_and_exporter() -> Iterator[tuple[Any, int]]:
    with make_ev() as ev:
        with start_exporter(ev.address, 0) as exporter:
            yield ev, exporter.port


@pytest.mark.timeout(TIMEOUT_S)
def test_prometheus_scrapes_an_evaluator_under_load(prometheus_binary: str, tmp_path: Path,
                                                    evaluator_and_exporter: tuple[Any, int]
                                                    ) -> None:
    ev, port = evaluator_and_exporter
    prom = Prometheus(prometheus_binary, tmp_path, port)
    workers: List[Any] = []
    try:
        prom.wait_ready()
        assert prom.wait_for("shmeval_up", lambda v: v == 1) == 1
        ctx = mp.get_context("fork")
        second_round = ctx.Event()
        workers = [ctx.Process(target=load, args=(ev, i, second_round)) for i in range(WORKERS)]
        for w in workers:
            w.start()
        # The counter rises during the load: a scrape of the first round,
        # then one after the second.
        first = prom.wait_for("shmeval_requests_total", lambda v: v > 0)
        second_round.set()
        for w in workers:
            w.join(TIMEOUT_S)
            assert w.exitcode == 0
        total = ev.stats()["requests"]
        assert prom.wait_for("shmeval_requests_total", lambda v: v == total) > first
        # Quiet now: the latest scrape holds the final figures.
        batches = ev.stats()["batches"]
        assert prom.one('shmeval_queue_wait_seconds_bucket{le="+Inf"}') == total
        assert prom.one("shmeval_queue_wait_seconds_count") == total
        assert prom.one("shmeval_batch_size_sum") == total
        assert prom.one("shmeval_batch_size_count") == batches
        assert prom.one("shmeval_model_seconds_count") == batches
        for name, count in (("shmeval_queue_wait_seconds", total),
                            ("shmeval_batch_size", batches),
                            ("shmeval_model_seconds", batches)):
            series = prom.query(name + "_bucket")
            les = sorted((float(json.loads(k)["le"]), v) for k, v in series.items())
            assert [v for _, v in les] == sorted(v for _, v in les), name   # cumulative
            assert les[-1] == (float("inf"), count), name
        # A batch holds at most what the workers have in flight: 8 rows each.
        p50 = prom.one("histogram_quantile(0.5, shmeval_batch_size_bucket)")
        assert 1 <= p50 <= 8 * WORKERS
        assert prom.one("rate(shmeval_requests_total[5s])") >= 0
        # Every query of the Grafana dashboard in docs/ is one Prometheus runs.
        for expr in dashboard_queries():
            prom.query(expr.replace("$job", "shmeval").replace("$__rate_interval", "5s"))
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
                w.join()
        prom.stop()
    assert prom.proc.returncode is not None


@pytest.mark.timeout(TIMEOUT_S)
def test_prometheus_has_each_methods_series(prometheus_binary: str, tmp_path: Path) -> None:
    import shmeval

    methods = {"initial": shmeval.Method(inputs={"obs": ((3,), "float32")},
                                         outputs={"value": ((), "float32")}),
               "recurrent": shmeval.Method(inputs={"hidden": ((2,), "float32")},
                                           outputs={"value": ((), "float32")})}
    model = {"initial": lambda x: {"value": x["obs"].sum(axis=1)},
             "recurrent": lambda x: {"value": x["hidden"].sum(axis=1)}}
    with shmeval.Evaluator(model, methods=methods, max_batch=16) as ev, \
            start_exporter(ev.address, 0) as exporter:
        prom = Prometheus(prometheus_binary, tmp_path, exporter.port)
        try:
            prom.wait_ready()
            for n in (1, 2, 3):
                ev.evaluate_many({"obs": np.ones((n, 3), np.float32)}, method="initial")
            for _ in range(4):
                ev.evaluate_many({"hidden": np.ones((5, 2), np.float32)}, method="recurrent")
            figures = ev.stats()["methods"]
            for name, requests in (("initial", 6), ("recurrent", 20)):
                labels = f'{{method="{name}"}}'
                assert prom.wait_for("shmeval_method_requests_total" + labels,
                                     lambda v, n=requests: v == n) == requests
                assert prom.one("shmeval_method_batches_total" + labels) == \
                    figures[name]["batches"]
                assert prom.one("shmeval_method_model_seconds_total" + labels) > 0
            # The dashboard's per-method queries: one series per method, once
            # the window holds two scrapes (a rate needs two samples).
            for expr in dashboard_queries():
                if "shmeval_method_" not in expr:
                    continue
                expr = expr.replace("$job", "shmeval").replace("$__rate_interval", "5s")
                deadline = time.monotonic() + WAIT_S
                while (got := sorted(json.loads(k)["method"] for k in prom.query(expr))) != \
                        ["initial", "recurrent"] and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert got == ["initial", "recurrent"], expr
        finally:
            prom.stop()
