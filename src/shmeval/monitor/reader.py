"""Reading a running evaluator from any process of its user: snapshots of
the segment's cumulative counters, histograms and client table, and the
figures of the interval between two snapshots."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import numpy as np

from ..client import connect
from ..errors import EvaluatorClosed, EvaluatorDied
from ..stats import hist_percentiles

#: The percentiles the interval figures report.
PERCENTILES = (50, 90, 99)

#: A client entry's identity: (index, pid, start time).  An index is reused
#: once the evaluator reclaims a dead process's entry, so rates are taken
#: between snapshots of the same identity only.
ClientKey = Tuple[int, int, int]


@dataclass(frozen=True)
class Snapshot:
    """What the segment held at one moment."""

    #: ``Segment.raw_stats()``: the cumulative counters, ``hist_wait``,
    #: ``hist_model``, ``batch_hist``, ``now_ns`` (CLOCK_MONOTONIC); for an
    #: evaluator of several methods also ``methods``, ``[(name, (requests,
    #: model calls, model ns))]`` in the order they were declared.
    raw: Dict[str, Any]
    #: ``stats()``: the summary, with ``replicas``, ``cache`` and ``tuner``
    #: when the evaluator has them.
    stats: Dict[str, Any]
    #: Requests published so far by each attached client entry.
    client_requests: Dict[ClientKey, int]

    @property
    def now_ns(self) -> int:
        return int(self.raw["now_ns"])


class EvaluatorReader:
    """A read-only view of the evaluator at ``address``: maps its segment
    (SegmentError when there is none, it is not a shmeval segment or it is
    another user's) without claiming a client entry."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.client = connect(address)
        self.seg = self.client._attach()

    def snapshot(self) -> Snapshot:
        counts = self.seg.client_requests()
        attached = {(c, pid, starttime): counts.get(c, 0)
                    for c, pid, starttime, _pid_ns, detached in self.seg.clients()
                    if not detached}
        raw = self.seg.raw_stats()
        if len(self.seg.layouts) > 1:
            raw["methods"] = [(lay.name, tuple(int(x) for x in counts))
                              for lay, counts in zip(self.seg.layouts, self.seg.method_stats())]
        return Snapshot(raw, self.client.stats(), attached)

    def gone(self) -> Optional[str]:
        """Why the evaluator no longer serves, None while it does: it was
        closed or died (the segment says how), or its process is gone
        without a word; the same checks a waiting client makes."""
        try:
            self.client._check_alive(self.seg)
        except (EvaluatorClosed, EvaluatorDied) as e:
            return str(e)
        return None


@dataclass(frozen=True)
class MethodInterval:
    """One method's figures between two snapshots (an evaluator of several
    methods)."""

    seconds: float
    requests: int
    #: Its model calls.
    batches: int
    #: Time in its model calls, ns.
    model_ns: int

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def mean_batch(self) -> Optional[float]:
        return self.requests / self.batches if self.batches else None

    @property
    def model_ms_per_batch(self) -> Optional[float]:
        return self.model_ns / self.batches / 1e6 if self.batches else None

    @property
    def model_share(self) -> float:
        """Its model calls' share of the interval."""
        return self.model_ns / 1e9 / self.seconds


def _method_intervals(a: Snapshot, b: Snapshot, dt: float) -> Dict[str, MethodInterval]:
    """Each method's figures between ``a`` and ``b``, in declaration order;
    empty for an evaluator of one method."""
    before = dict(a.raw.get("methods") or ())
    out: Dict[str, MethodInterval] = {}
    for name, counts in b.raw.get("methods") or ():
        requests, batches, model_ns = (int(x) - int(y)
                                       for x, y in zip(counts, before.get(name, (0, 0, 0))))
        out[name] = MethodInterval(dt, requests, batches, model_ns)
    return out


@dataclass(frozen=True)
class Interval:
    """The figures between two snapshots ``a`` and ``b`` (b taken later)."""

    seconds: float
    requests: int
    batches: int
    failed_requests: int
    #: {batch size: batches of that size} in the interval.
    batch_hist: Dict[int, int]
    #: p50/p90/p99 of the time requests waited to be taken, ns (NaN without one).
    queue_wait_ns: Dict[str, float]
    #: p50/p90/p99 of the model call, ns (NaN without one).
    model_call_ns: Dict[str, float]
    #: The model's share of the interval (above 1 with several serving threads).
    model_share: float
    #: Requests/s of each client entry attached at both ends.
    client_rates: Dict[ClientKey, float]
    #: Each method's figures, by name in declaration order (empty for an
    #: evaluator of one method).
    methods: Dict[str, MethodInterval] = field(default_factory=dict)

    @classmethod
    def between(cls, a: Snapshot, b: Snapshot) -> "Interval":
        dt = max(1, b.now_ns - a.now_ns) / 1e9

        def grew(key: str) -> Any:
            return b.raw[key] - a.raw[key]

        bh = grew("batch_hist")
        return cls(
            seconds=dt, requests=int(grew("requests")), batches=int(grew("batches")),
            failed_requests=int(grew("failed_requests")),
            batch_hist={int(n): int(bh[n]) for n in np.nonzero(bh)[0]},
            queue_wait_ns=hist_percentiles(grew("hist_wait"), PERCENTILES),
            model_call_ns=hist_percentiles(grew("hist_model"), PERCENTILES),
            model_share=int(grew("model_ns")) / 1e9 / dt,
            client_rates={key: (n - a.client_requests[key]) / dt
                          for key, n in b.client_requests.items() if key in a.client_requests},
            methods=_method_intervals(a, b, dt))

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.seconds

    @property
    def mean_batch(self) -> Optional[float]:
        return self.requests / self.batches if self.batches else None

    @property
    def slowest_client(self) -> Optional[ClientKey]:
        """The attached client that sent the fewest requests/s, None with
        fewer than two (one client is nobody's laggard)."""
        if len(self.client_rates) < 2:
            return None
        return min(self.client_rates, key=lambda k: self.client_rates[k])
