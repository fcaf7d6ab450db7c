"""The summary of a self-play run: the caches compared (like for like or
refused), one mode's runs combined into medians, shmeval's ratios to the
other modes, and the table printed at the end."""
from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional

from .._util.display import fmt_rate
from .settings import CacheSetting


#: The modes the summary compares shmeval with, in this order.
COMPARED = ("queue", "local-batched", "local")
#: The modes whose workers each hold a net: their RSS is compared with shmeval's.
NET_IN_WORKERS = ("local-batched", "local")


def mixed_caches(caches: Dict[str, CacheSetting]) -> Optional[str]:
    """Why a comparison of the modes ``caches`` names is not like for like,
    or None when it is: every mode with a cache (of whichever kind) or none
    with one.  A ratio of a mode answering from a cache over one without
    would credit the transport with the cache's answers."""
    cached = [m for m, c in caches.items() if c.kind != "none"]
    bare = [m for m, c in caches.items() if c.kind == "none"]
    if not cached or not bare:
        return None
    return (f"not like for like: {', '.join(f'{m} ({caches[m].label()})' for m in cached)} "
            f"would answer from a cache and {', '.join(bare)} from none; give every mode a "
            "cache (--local-cache N: one in each worker of the modes without the shared one) "
            "or none (--cache 0)")


def caches_line(caches: Dict[str, CacheSetting]) -> str:
    """The summary's line on the caches the modes ran with."""
    if all(c.kind == "none" for c in caches.values()):
        return "caches: none in any mode"
    return "caches: " + "; ".join(f"{m} {c.label()}" for m, c in caches.items()) + (
        " (entries per table; the queue and local modes have no shared table)")


def like_for_like_phrase(caches: Dict[str, CacheSetting]) -> str:
    """What the ratios compare, in a few words."""
    if all(c.kind == "none" for c in caches.values()):
        return "like for like: no mode with a cache"
    return "like for like: every mode with a cache"


def ratios(results: Dict[str, Dict[str, Any]]) -> Dict[str, float]:
    """shmeval's moves/s and evals/s over each other mode's, and the RSS of
    the workers holding a net over shmeval's workers'.  Raises ValueError
    when the modes' caches are mixed (:func:`mixed_caches`)."""
    out: Dict[str, float] = {}
    shm = results.get("shmeval")
    if shm is None:
        return out
    problem = mixed_caches({m: CacheSetting(**r["cache_setting"]) for m, r in results.items()})
    if problem:
        raise ValueError(problem)
    for other in COMPARED:
        o = results.get(other)
        if o is None:
            continue
        for k in ("moves_per_s", "evals_per_s"):
            if o[k]:
                out[f"shmeval/{other} {k}"] = shm[k] / o[k]
        if other in NET_IN_WORKERS and shm["worker_rss_mb"] and o["worker_rss_mb"]:
            out[f"worker RSS {other}/shmeval"] = o["worker_rss_mb"] / shm["worker_rss_mb"]
    return out


def round_ratios(runs: Dict[str, List[Dict[str, Any]]]) -> Dict[str, List[Optional[float]]]:
    """With --repeats: shmeval's moves/s over each other mode's, round by
    round (a round runs the modes one after the other, within a minute or
    two): the paired figures, which show how much of a ratio is the
    machine's window.  None where the other mode made no move; empty with
    fewer than two rounds."""
    out: Dict[str, List[Optional[float]]] = {}
    shm = runs.get("shmeval", [])
    for other in COMPARED:
        o = runs.get(other, [])
        if len(shm) < 2 or len(o) != len(shm):
            continue
        out[f"shmeval/{other} moves_per_s"] = [
            a["moves_per_s"] / b["moves_per_s"] if b["moves_per_s"] else None
            for a, b in zip(shm, o)]
    return out


#: Figures a mode's summary takes as the median over its runs (--repeats).
MEDIAN_FIELDS = ("moves_per_s", "evals_per_s", "mean_batch", "worker_rss_mb", "evaluator_rss_mb",
                 "games", "startup_s")


def combine_runs(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One mode's summary over its runs: the run with the median moves/s,
    the figures of MEDIAN_FIELDS (and the other load) replaced by their
    medians over all runs, ``range`` holding their [min, max] and ``runs``
    every run."""
    if len(runs) == 1:
        return runs[0]
    order = sorted(runs, key=lambda r: r["moves_per_s"])
    out = dict(order[len(order) // 2])
    out["cpu"] = dict(out["cpu"])
    out["range"] = {}
    for k in MEDIAN_FIELDS + ("other_cores",):
        vals = [r["cpu"][k] if k == "other_cores" else r[k] for r in runs]
        vals = [v for v in vals if v is not None]
        if not vals:
            continue
        med = statistics.median(vals)
        if k == "other_cores":
            out["cpu"][k] = med
        else:
            out[k] = med
        out["range"][k] = [min(vals), max(vals)]
    out["runs"] = runs
    return out


def device_lines(results: Dict[str, Dict[str, Any]]) -> List[str]:
    """Under ``--device sim``: per mode, how busy the simulated GPU was and
    whether the device or the host set the pace."""
    lines = []
    for mode, r in results.items():
        dev = r.get("device")
        if not dev or not dev["calls"]:
            continue
        bound = dev["device_bound_rows_per_s"]
        lines.append(
            f"sim GPU, {mode}: busy {dev['busy_share']:.0%} of the window, "
            f"{dev['rows_per_call']:.1f} rows per call, "
            f"{dev['queue_ms_per_call']:.2f} ms queued per call; answers ready after the "
            f"device's end (the host the limit) in {dev['late_share']:.0%} of the calls, "
            f"by {dev['late_ms_per_call']:.2f} ms per call on average; always busy with such "
            f"calls it would serve {fmt_rate(bound)} rows/s")
    return lines


def format_table(results: Dict[str, Dict[str, Any]], workers: int) -> str:
    """The summary table, one row per mode (each ran ``workers`` workers)."""
    headers = ["mode", "cache", "moves/s", "evals/s", "mean batch", "games", "worker RSS MB",
               "evaluator RSS MB", "TF in workers", "start-up s", "other load"]
    rows = []

    def rate(r: Dict[str, Any], k: str) -> str:
        text = fmt_rate(r[k])
        if "range" in r:
            lo, hi = r["range"][k]
            text += f" [{fmt_rate(lo)}-{fmt_rate(hi)}]"
        return text

    for mode, r in results.items():
        rows.append([mode, CacheSetting(**r["cache_setting"]).label(),
                     rate(r, "moves_per_s"), rate(r, "evals_per_s"),
                     f"{r['mean_batch']:.1f}" if r["mean_batch"] else "-", f"{round(r['games']):,}",
                     f"{r['worker_rss_mb']:.0f}" if r["worker_rss_mb"] else "-",
                     f"{r['evaluator_rss_mb']:.0f}" if r["evaluator_rss_mb"] else "-",
                     f"{r['tensorflow_in_workers']}/{workers}", f"{r['startup_s']:.1f}",
                     f"{r['cpu']['other_cores']:.2f}"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                       for i, (h, w) in enumerate(zip(headers, widths)))]
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)
