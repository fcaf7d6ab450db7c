"""Prometheus metrics of a running evaluator: :class:`SegmentCollector`
reads the segment at each scrape (one process, no files per process),
:func:`start_exporter` serves it over HTTP from a daemon thread, and
``shmeval metrics ADDRESS --port PORT`` runs that until Ctrl-C or the
evaluator stops.  docs/guide.md (*Watching a running evaluator*) lists
the metrics."""
from __future__ import annotations

import argparse
import errno
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
from prometheus_client import start_http_server
from prometheus_client.core import (CollectorRegistry, CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)

from ..stats import _bin_lo
from .reader import EvaluatorReader

#: The segment's latency histograms have four bins per power of two of
#: nanoseconds, bin 4k - 4 starting at 2**k ns; Prometheus gets one bucket
#: per power of two from 2**8 ns (256 ns) to 2**36 ns (68.7 s), at bin
#: edges so that every bucket count is exact, plus +Inf.
LATENCY_BUCKET_BINS = tuple(range(28, 141, 4))
#: States of ``stats()["state"]``, each a label of shmeval_state.
STATES = ("starting", "serving", "restarting", "closing", "closed", "died")
#: Cumulative counters of the segment: (metric name without _total, raw
#: key, help text); a name ending in _seconds holds nanoseconds in the
#: segment.
COUNTERS = (
    ("shmeval_requests", "requests", "Requests answered, failed ones included."),
    ("shmeval_batches", "batches", "Model calls."),
    ("shmeval_failed_requests", "failed_requests",
     "Requests answered with a ModelError (the model raised, returned bad outputs or NaN)."),
    ("shmeval_failed_batches", "failed_batches", "Model calls that failed as a whole."),
    ("shmeval_isolated_rows", "isolated_rows",
     "Rows of batches that raised, found raising on their own."),
    ("shmeval_isolation_calls", "isolation_calls",
     "Extra model calls made to find the rows that raise."),
    ("shmeval_padded_rows", "padded_rows", "Rows added to reach a bucket size."),
    ("shmeval_weight_updates", "weight_updates", "Weight updates applied."),
    ("shmeval_reclaimed_clients", "reclaimed_clients",
     "Client entries of dead processes taken back."),
    ("shmeval_reclaimed_writing_slots", "reclaimed_writing",
     "Slots that dead processes were writing when they died."),
    ("shmeval_stale_completions", "stale_completions",
     "Answers dropped because their slot had been reclaimed."),
    ("shmeval_busy_seconds", "busy_ns",
     "Time the serving loop spent on batches, the model call included."),
)


def latency_buckets(hist: np.ndarray) -> List[Tuple[str, float]]:
    """A log histogram of ns as Prometheus' cumulative buckets in seconds:
    ``[(le, count of values <= le), ..., ("+Inf", total)]``.  A bin's values
    are below its upper edge, so each bucket counts exactly the bins under it."""
    cum = np.concatenate(([0], np.cumsum(hist)))
    out = [(repr(_bin_lo(b) / 1e9), float(cum[b]))
           for b in LATENCY_BUCKET_BINS if b < len(hist)]
    out.append(("+Inf", float(cum[-1])))
    return out


def latency_sum_s(hist: np.ndarray) -> float:
    """The _sum of a log histogram, in seconds, from its bins' midpoints (the
    segment keeps no exact sum of queue waits; within about 12%)."""
    mids = np.array([(_bin_lo(b) + _bin_lo(b + 1)) / 2 for b in range(len(hist))])
    return float(np.dot(hist.astype(np.float64), mids)) / 1e9


def batch_size_buckets(batch_hist: np.ndarray) -> List[Tuple[str, float]]:
    """``batch_hist`` (batches per size 0..max_batch) as cumulative buckets
    at 1, 2, 4, ... up to max_batch, and +Inf."""
    max_batch = len(batch_hist) - 1
    cum = np.cumsum(batch_hist)
    edges = [1 << k for k in range(max(1, max_batch).bit_length()) if 1 << k < max_batch]
    edges.append(max_batch)
    out = [(repr(float(e)), float(cum[e])) for e in edges]
    out.append(("+Inf", float(cum[-1])))
    return out


#: Each method's counters (an evaluator of several methods), labelled by
#: method: (metric name without _total, help text), in the order of a
#: method's raw counts (requests, model calls, model ns).
METHOD_COUNTERS = (
    ("shmeval_method_requests", "Requests of each method answered, failed ones included."),
    ("shmeval_method_batches", "Model calls of each method."),
    ("shmeval_method_model_seconds", "Time in each method's model calls."),
)


#: Keys of a replica's dict that identify it (labels, not values).
REPLICA_IDENTITY = ("replica", "pid", "starttime")
#: A replica's figures that count up (the others are gauges).
REPLICA_COUNTERS = ("requests", "batches")


def _number(v: Any) -> Optional[float]:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float, np.integer, np.floating)):
        return float(v)
    return None


class SegmentCollector:
    """A prometheus_client collector that reads the evaluator's segment at
    each scrape: counters, histograms of batch size, queue wait and model
    time, gauges of state, clients and model version; each method's
    counters for an evaluator of several methods; the replicas, cache and
    tuner figures when ``stats()`` has them."""

    def __init__(self, reader: EvaluatorReader) -> None:
        self.reader = reader

    def describe(self) -> List[Metric]:
        # Nothing to describe ahead of a scrape: registering must not read
        # the segment.
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self.reader.snapshot()
        raw, st = snap.raw, snap.stats
        for name, key, doc in COUNTERS:
            scale = 1e-9 if name.endswith("_seconds") else 1.0
            yield CounterMetricFamily(name, doc, value=int(raw[key]) * scale)
        per_client = CounterMetricFamily("shmeval_client_requests",
                                         "Requests published by each attached client process.",
                                         labels=["client", "pid"])
        for (c, pid, _), n in sorted(snap.client_requests.items()):
            per_client.add_metric([str(c), str(pid)], n)
        yield per_client
        bh = raw["batch_hist"]
        yield HistogramMetricFamily(
            "shmeval_batch_size", "Requests per model call.", buckets=batch_size_buckets(bh),
            sum_value=float(np.dot(bh.astype(np.float64), np.arange(len(bh)))))
        yield HistogramMetricFamily(
            "shmeval_queue_wait_seconds",
            "Time from a request's publication until the evaluator took it (_sum estimated "
            "from the histogram's bins).",
            buckets=latency_buckets(raw["hist_wait"]), sum_value=latency_sum_s(raw["hist_wait"]))
        yield HistogramMetricFamily(
            "shmeval_model_seconds", "Time of each model call.",
            buckets=latency_buckets(raw["hist_model"]), sum_value=int(raw["model_ns"]) / 1e9)
        yield from self._methods(raw)
        yield from self._gauges(st)
        yield from self._extras(st)

    def _methods(self, raw: Dict[str, Any]) -> Iterator[Metric]:
        """``shmeval_method_requests_total``, ``shmeval_method_batches_total``
        and ``shmeval_method_model_seconds_total`` labelled by method, for an
        evaluator of several methods (none for one)."""
        methods = raw.get("methods")
        if not methods:
            return
        for i, (name, doc) in enumerate(METHOD_COUNTERS):
            scale = 1e-9 if name.endswith("_seconds") else 1.0
            family = CounterMetricFamily(name, doc, labels=["method"])
            for method, counts in methods:
                family.add_metric([method], int(counts[i]) * scale)
            yield family

    def _gauges(self, st: Dict[str, Any]) -> Iterator[Metric]:
        yield GaugeMetricFamily("shmeval_up", "1 while the evaluator serves, else 0.",
                                value=float(st["state"] == "serving"))
        state = GaugeMetricFamily("shmeval_state", "The evaluator's state: 1 for the current one.",
                                  labels=["state"])
        for s in STATES:
            state.add_metric([s], float(st["state"] == s))
        yield state
        yield GaugeMetricFamily("shmeval_clients", "Processes attached now.",
                                value=st["clients"])
        yield GaugeMetricFamily("shmeval_model_version", "Version of the weights serving.",
                                value=st["model_version"])
        yield GaugeMetricFamily("shmeval_uptime_seconds", "Time since serving started.",
                                value=st["uptime_s"])
        if st["heartbeat_age_s"] is not None:
            yield GaugeMetricFamily("shmeval_heartbeat_age_seconds",
                                    "Time since the serving loop last showed it is alive.",
                                    value=st["heartbeat_age_s"])

    def _extras(self, st: Dict[str, Any]) -> Iterator[Metric]:
        """The replicas, cache and tuner figures, once ``stats()`` has them:
        each number of the cache and the tuner becomes a gauge
        ``shmeval_cache_<key>`` / ``shmeval_tuner_<key>`` (the cache's hits
        and misses counters); each replica's numbers become
        ``shmeval_replica_<key>`` labelled by replica, pid and device
        (requests and batches counters)."""
        for section in ("cache", "tuner"):
            for key, v in (st.get(section) or {}).items():
                x = _number(v)
                if x is None:
                    continue
                name = f"shmeval_{section}_{key}"
                if section == "cache" and key in ("hits", "misses"):
                    yield CounterMetricFamily(name, f"Cache {key}.", value=x)
                else:
                    yield GaugeMetricFamily(name, f"The {section}'s {key}.", value=x)
        replicas: Sequence[Dict[str, Any]] = st.get("replicas") or ()
        families: Dict[str, Union[CounterMetricFamily, GaugeMetricFamily]] = {}
        labels = ["replica", "pid", "device"]
        for i, r in enumerate(replicas):
            values = [str(r.get("replica", i)), str(r.get("pid", "")), str(r.get("device", ""))]
            up = families.setdefault("up", GaugeMetricFamily(
                "shmeval_replica_up", "1 while the replica serves.", labels=labels))
            up.add_metric(values, float(r.get("state") == "serving"))
            for key, v in r.items():
                x = _number(v)
                if x is None or key in REPLICA_IDENTITY:
                    continue
                kind = CounterMetricFamily if key in REPLICA_COUNTERS else GaugeMetricFamily
                family = families.setdefault(key, kind(f"shmeval_replica_{key}",
                                                       f"The replica's {key}.", labels=labels))
                family.add_metric(values, x)
        yield from families.values()


class Exporter:
    """An HTTP server of one evaluator's metrics, serving from a daemon
    thread; ``close()`` stops it and frees the port."""

    def __init__(self, address: str, port: int, host: str = "127.0.0.1") -> None:
        self.reader = EvaluatorReader(address)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SegmentCollector(self.reader))
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.host = host
        #: The port it listens on (the one chosen by the system for port 0).
        self.port: int = self._server.server_address[1]
        self._closed = threading.Lock()

    def close(self) -> None:
        """Stops serving and frees the port (idempotent)."""
        if self._closed.acquire(blocking=False):
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()

    def __enter__(self) -> "Exporter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def start_exporter(address: str, port: int, host: str = "127.0.0.1") -> Exporter:
    """Serves the metrics of the evaluator at ``address`` on ``host:port``
    (port 0: one the system picks, see ``Exporter.port``) from a daemon
    thread, reading its segment at each scrape; returns the handle whose
    ``close()`` stops it.  Raises SegmentError for an address that is not a
    running evaluator of this user, OSError when the port cannot be bound."""
    return Exporter(address, port, host)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help="the evaluator's address, e.g. /shmeval-4242-9f0c1e2d3b4a5968 "
                   "(see shmeval ls)")
    p.add_argument("--port", type=int, required=True, help="the port to serve the metrics on")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default 127.0.0.1; 0.0.0.0 for a Prometheus "
                   "on another machine)")
    p.add_argument("--check-every", type=float, default=1.0, metavar="SECONDS",
                   help="seconds between two checks that the evaluator still serves (default 1)")


def main(args: argparse.Namespace) -> int:
    """``shmeval metrics``: serves until Ctrl-C or the evaluator stops;
    returns the exit code."""
    if not 0 <= args.port <= 65535 or not args.check_every > 0:
        print(f"shmeval metrics: need a --port from 0 to 65535 and --check-every > 0, got "
              f"{args.port} and {args.check_every:g}", file=sys.stderr)
        return 1
    try:
        exporter = start_exporter(args.address, args.port, args.host)
    except OSError as e:
        cause = "it is in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        print(f"shmeval metrics: cannot listen on {args.host}:{args.port}: {cause}",
              file=sys.stderr)
        return 1
    reader = exporter.reader
    print(f"serving the metrics of {args.address} on http://{exporter.host}:{exporter.port}"
          f"/metrics (Ctrl-C stops)", flush=True)
    try:
        with exporter:
            while (why := reader.gone()) is None:
                time.sleep(args.check_every)
    except KeyboardInterrupt:
        print("stopped serving the metrics (Ctrl-C)")
        return 0
    print(why)
    return 0
