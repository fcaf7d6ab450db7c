"""Turns the segment's raw counters and histograms into ``ev.stats()``, and
reads and writes the report a serving loop publishes in its replica's entry
of the segment as JSON: its tuner's (``stats()["tuner"]``), or, once the
replica ended itself because its model's device failed, that error
(``DEVICE_LOST``), which says why in ``EvaluatorDied`` and in
``stats()``."""
from __future__ import annotations

import json
from typing import Any, Dict, Optional, Sequence

import numpy as np

from . import _ring

_STATES = {_ring.STARTING: "starting", _ring.SERVING: "serving", _ring.CLOSING: "closing",
           _ring.CLOSED_STATE: "closed", _ring.DIED: "died"}
_STOPS = {_ring.STOP_CLOSED: "closed by its owner",
          _ring.STOP_OWNER_DIED: "the process that created it died",
          _ring.STOP_CRASHED: "its serving loop raised",
          _ring.STOP_EXITED: "its process ended"}
#: The key of a replica's report that holds the error of its lost device
#: (errors.DeviceLost), the whole report once the replica ended itself.
DEVICE_LOST = "device_lost"
#: At most this many bytes of that error are published.
DEVICE_LOST_BYTES = 1024


def _stopped_because(stop: Any) -> Any:
    """Why a stopped evaluator stopped (None while it serves)."""
    reason, detail = stop if stop is not None else (_ring.STOP_NONE, 0)
    if reason == _ring.STOP_EXITED:
        return (f"its process was killed by signal {-detail}" if detail < 0
                else f"its process exited with code {detail}")
    return _STOPS.get(reason)


def _bin_lo(b: int) -> float:
    """Lower bound (ns) of log-histogram bin b (ring.h: shm_hist_bin): four
    bins per power of two, so a reported value is within ~12% of the truth."""
    if b < 4:
        return float(b)
    msb = b // 4 + 1
    return float((4 + b % 4) << (msb - 2))


def hist_percentiles(hist: np.ndarray, qs: Sequence[float]) -> Dict[str, float]:
    """Percentiles (in ns, bin midpoints) of a log histogram."""
    total = int(hist.sum())
    out: Dict[str, float] = {}
    if total == 0:
        return {f"p{q:g}": float("nan") for q in qs}
    cum = np.cumsum(hist)
    for q in qs:
        b = int(np.searchsorted(cum, q / 100.0 * total, side="left"))
        b = min(b, len(hist) - 1)
        out[f"p{q:g}"] = (_bin_lo(b) + _bin_lo(b + 1)) / 2
    return out


def _replica(r: Dict[str, Any], uptime_ns: int) -> Dict[str, Any]:
    """One replica's figures: who it is and what it served."""
    return {
        "replica": int(r["replica"]),
        "pid": int(r["pid"]) or None,
        "device": r["device"],
        "state": r["state"],
        "model_version": int(r["version"]),
        "requests": int(r["requests"]),
        "batches": int(r["batches"]),
        "mean_batch": r["requests"] / r["batches"] if r["batches"] else 0.0,
        "model_time_share": r["model_ns"] / uptime_ns if uptime_ns else 0.0,
    }


def _method(counts: Sequence[int], uptime_ns: int) -> Dict[str, Any]:
    """One method's figures: its requests, model calls, their mean size and
    its share of the time in its model calls."""
    requests, batches, model_ns = (int(x) for x in counts)
    return {
        "requests": requests,
        "batches": batches,
        "mean_batch": requests / batches if batches else 0.0,
        "model_ms_per_batch": model_ns / batches / 1e6 if batches else 0.0,
        "model_time_share": model_ns / uptime_ns if uptime_ns else 0.0,
    }


def summarize(raw: Dict[str, Any]) -> Dict[str, Any]:
    requests = int(raw["requests"])
    batches = int(raw["batches"])
    start = int(raw["serve_start_ns"])
    now = int(raw["now_ns"])
    uptime_ns = max(1, now - start) if start else 0
    bh = raw["batch_hist"]
    sizes = np.nonzero(bh)[0]
    wait = hist_percentiles(raw["hist_wait"], (50, 90, 99))
    model = hist_percentiles(raw["hist_model"], (50, 90, 99))
    state = _STATES.get(int(raw["ev_state"]), "unknown")
    stopped = _stopped_because(raw.get("stop"))
    vanished = raw.get("vanished")
    if vanished and int(raw["ev_state"]) < _ring.CLOSED_STATE and \
            not any(r["state"] == "serving" for r in raw["replicas"]):
        # Its serving processes are gone without a word (killed outright):
        # nobody recorded the stop in the segment.
        pids = ", ".join(map(str, vanished))
        if raw.get("restarting"):
            state = "restarting"
        else:
            state = "died"
            stopped = (f"its process vanished (pid {pids}: killed, e.g. by SIGKILL or the "
                       f"OOM killer, before it could record why)")
    return {
        "state": state,
        "stopped_because": stopped,
        "requests": requests,
        "batches": batches,
        "mean_batch": requests / batches if batches else 0.0,
        "batch_hist": {int(s): int(bh[s]) for s in sizes},
        "padded_rows": int(raw["padded_rows"]),
        "failed_requests": int(raw["failed_requests"]),
        "failed_batches": int(raw["failed_batches"]),
        "isolated_rows": int(raw["isolated_rows"]),
        "isolation_calls": int(raw["isolation_calls"]),
        "queue_wait_us": {k: v / 1e3 for k, v in wait.items()},
        "model_ms": {k: v / 1e6 for k, v in model.items()},
        "model_time_share": raw["model_ns"] / uptime_ns if uptime_ns else 0.0,
        # Serving-loop time per batch outside the model call (checks, gather,
        # scatter, wake-ups; not the waits for requests).
        "overhead_us_per_batch": (max(0, raw["busy_ns"] - raw["model_ns"]) / batches / 1e3
                                  if batches else 0.0),
        "model_version": int(raw["model_version"]),
        "weight_updates": int(raw["weight_updates"]),
        "warmup_s": raw["warmup_ns"] / 1e9,
        "clients": int(raw["clients"]),
        "reclaimed_clients": int(raw["reclaimed_clients"]),
        "reclaimed_writing_slots": int(raw["reclaimed_writing"]),
        "stale_completions": int(raw["stale_completions"]),
        "uptime_s": uptime_ns / 1e9,
        "heartbeat_age_s": (now - int(raw["heartbeat_ns"])) / 1e9 if raw["heartbeat_ns"] else None,
        "replicas": [_replica(r, uptime_ns) for r in raw.get("replicas", ())],
        "cache": _cache(raw["cache"]) if raw.get("cache") else None,
        # An evaluator of several methods: each one's figures, by name.
        "methods": ({name: _method(counts, uptime_ns) for name, counts in raw["methods"]}
                    if raw.get("methods") else None),
    }


def _hit_rate(hits: int, misses: int) -> float:
    return hits / (hits + misses) if hits + misses else 0.0


def _cache(c: Dict[str, Any]) -> Dict[str, Any]:
    """The evaluation cache: its counters in total and per live client, and
    how full it is (estimated from a sample of its entries when large)."""
    scale = c["entries"] / c["scanned"] if c["scanned"] else 0.0
    return {
        "entries": int(c["entries"]),
        "held": round(c["held"] * scale),
        "old_entries": round(c["old"] * scale),
        "hits": int(c["hits"]),
        "misses": int(c["misses"]),
        "hit_rate": _hit_rate(c["hits"], c["misses"]),
        "stale": int(c["stale"]),
        "replaced": int(c["replaced"]),
        "version": int(c["version"]),
        "clients": [{"client": int(i), "pid": int(pid), "hits": int(h), "misses": int(m),
                     "hit_rate": _hit_rate(h, m), "stale": int(s), "replaced": int(r)}
                    for i, pid, h, m, s, r in c["clients"]],
    }


def fit_report(report: Dict[str, Any], limit: int) -> bytes:
    """``report`` as JSON of at most ``limit`` bytes: long texts are cut,
    and the reasons (``why_*``) dropped if that is not enough."""
    data = json.dumps(report).encode()
    if len(data) <= limit:
        return data
    short = {k: (v[:160] + "...") if isinstance(v, str) and len(v) > 163 else v
             for k, v in report.items()}
    data = json.dumps(short).encode()
    if len(data) <= limit:
        return data
    return json.dumps({k: v for k, v in short.items()
                       if not k.startswith("why")}).encode()[:limit]


def read_report(seg: Any, replica: int) -> Optional[Dict[str, Any]]:
    """Replica ``replica``'s last report (None before the first, or while it
    cannot be read)."""
    text = seg.report(replica)
    if text is None:
        return None
    try:
        report = json.loads(text)
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def publish_device_lost(seg: Any, replica: int, text: str) -> None:
    """Replica ``replica`` ended itself because its model's device failed
    (errors.DeviceLost, whose message is ``text``): its report says so from
    now on, in place of its tuner's, until a restarted process of the
    replica publishes its own."""
    seg.set_report(replica, fit_report({DEVICE_LOST: text}, _ring.REPORT_BYTES))


def device_lost(seg: Any, replica: int) -> Optional[str]:
    """The error of replica ``replica``'s lost device, as it published it
    when it ended itself (None when it did not)."""
    report = read_report(seg, replica)
    text = report.get(DEVICE_LOST) if report is not None else None
    return text if isinstance(text, str) else None
