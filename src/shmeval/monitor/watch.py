"""``shmeval stats ADDRESS --watch``: a live terminal view of a running
evaluator, redrawn every interval from two snapshots of its segment
(rates, batch sizes and percentiles of the last interval, per-client
rates, per-method rates when it serves several methods, and the replicas,
cache and tuner when the evaluator has them).
Without a terminal it prints the last view only, when it stops."""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .._util.display import fmt_rate, format_duration
from .reader import ClientKey, EvaluatorReader, Interval, Snapshot

#: Client rows the view shows at most (the slowest first).
CLIENT_ROWS = 12
#: Width of the batch-size histogram's longest bar, in characters.
BAR_WIDTH = 30


def _rate(x: Optional[float]) -> str:
    return "-" if x is None or math.isnan(x) else fmt_rate(x)


def _durations(ns: List[float]) -> str:
    """Durations given in ns, " / " between them, in the unit that keeps
    the largest under 1000."""
    top = max(ns)
    unit, scale = next(((u, s) for u, s in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)) if top >= s),
                       ("ns", 1.0))
    return " / ".join(f"{v / scale:.3g}" for v in ns) + f" {unit}"


def _percentiles(p_ns: Dict[str, float]) -> str:
    """p50 / p90 / p99 in the unit that keeps the largest under 1000."""
    if any(math.isnan(v) for v in p_ns.values()):
        return "-"
    return _durations(list(p_ns.values()))


def _size_range(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


def batch_size_rows(hist: Dict[int, int]) -> List[tuple[str, int]]:
    """The batch-size histogram in power-of-two ranges (1, 2-3, 4-7, ...),
    from the smallest size seen to the largest: ``[(range, batches)]``."""
    if not hist:
        return []
    top = max(hist).bit_length()
    first = min(hist).bit_length()
    return [(_size_range(1 << (b - 1), (1 << b) - 1),
             sum(n for size, n in hist.items() if size.bit_length() == b))
            for b in range(first, top + 1)]


def _header(address: str, snap: Snapshot, every: float) -> Text:
    st = snap.stats
    t = Text()
    t.append("shmeval ", style="bold")
    t.append(address, style="bold cyan")
    state = st["state"]
    t.append(f"  {state}", style="green" if state == "serving" else "yellow")
    t.append(f"  up {format_duration(st['uptime_s'])}  model v{st['model_version']} "
             f"({st['weight_updates']} updates)  {st['clients']} clients  "
             f"every {every:g} s")
    return t


def _figures(snap: Snapshot, iv: Optional[Interval]) -> Table:
    st = snap.stats
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column()
    t.add_row("", Text("last interval", style="dim"), Text("since start", style="dim"))
    up = max(st["uptime_s"], 1e-9)
    t.add_row("requests/s", _rate(iv.requests_per_s if iv else None),
              _rate(st["requests"] / up))
    t.add_row("batches/s", _rate(iv.batches_per_s if iv else None), _rate(st["batches"] / up))
    t.add_row("mean batch", f"{iv.mean_batch:.1f}" if iv and iv.mean_batch else "-",
              f"{st['mean_batch']:.1f}")
    t.add_row("model busy", f"{iv.model_share:.0%}" if iv else "-",
              f"{st['model_time_share']:.0%}")
    failed = iv.failed_requests if iv else 0
    t.add_row("failed requests", Text(f"{failed:,}" if iv else "-", style="red" if failed else ""),
              f"{st['failed_requests']:,}")
    t.add_row("queue wait p50/90/99", _percentiles(iv.queue_wait_ns) if iv else "-",
              _percentiles({k: v * 1e3 for k, v in st["queue_wait_us"].items()}))
    t.add_row("model call p50/90/99", _percentiles(iv.model_call_ns) if iv else "-",
              _percentiles({k: v * 1e6 for k, v in st["model_ms"].items()}))
    return t


def _batch_sizes(iv: Interval) -> Table:
    t = Table.grid(padding=(0, 1))
    t.add_column(justify="right", style="bold")
    t.add_column()
    t.add_column(justify="right")
    rows = batch_size_rows(iv.batch_hist)
    most = max((n for _, n in rows), default=0)
    for label, n in rows:
        bar = "█" * (round(BAR_WIDTH * n / most) if most else 0)
        t.add_row(label, Text(bar.ljust(BAR_WIDTH), style="cyan"), f"{n:,}")
    return t


def _clients(iv: Interval) -> RenderableType:
    rates = iv.client_rates
    slowest = iv.slowest_client
    mean = sum(rates.values()) / len(rates) if rates else 0.0
    t = Table(box=None, padding=(0, 2), show_edge=False, header_style="dim")
    t.add_column("client", justify="right")
    t.add_column("pid", justify="right")
    t.add_column("requests/s", justify="right")
    t.add_column("x mean", justify="right")
    t.add_column("")
    order: List[ClientKey] = sorted(rates, key=lambda k: rates[k])
    for key in order[:CLIENT_ROWS]:
        c, pid, _ = key
        mark = Text("◀ slowest", style="bold red") if key == slowest else Text("")
        t.add_row(str(c), str(pid), _rate(rates[key]),
                  f"{rates[key] / mean:.2f}" if mean else "-", mark)
    if len(order) > CLIENT_ROWS:
        t.add_row("", "", "", "", Text(f"{len(order) - CLIENT_ROWS} more, up to "
                                       f"{_rate(rates[order[-1]])}/s", style="dim"))
    return t


def _methods(snap: Snapshot, iv: Optional[Interval]) -> Table:
    """One row per method: its requests/s, mean batch, mean model time per
    call and model busy share over the last interval, and its requests
    since the start."""
    t = Table(box=None, padding=(0, 2), show_edge=False, header_style="dim")
    t.add_column("method", justify="left")
    for col in ("requests/s", "mean batch", "model per batch", "model busy",
                "requests since start"):
        t.add_column(col, justify="right")
    for name, total in snap.stats["methods"].items():
        m = iv.methods.get(name) if iv is not None else None
        if m is None:
            t.add_row(name, "-", "-", "-", "-", f"{total['requests']:,}")
            continue
        t.add_row(name, _rate(m.requests_per_s),
                  f"{m.mean_batch:.1f}" if m.mean_batch else "-",
                  _durations([m.model_ms_per_batch * 1e6])
                  if m.model_ms_per_batch is not None else "-",
                  f"{m.model_share:.0%}", f"{total['requests']:,}")
    return t


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def _key_values(title: str, d: Dict[str, Any]) -> Text:
    t = Text(f"{title}  ", style="bold")
    t.append("  ".join(f"{k} {_value(v)}" for k, v in d.items()))
    return t


def _replicas(replicas: List[Dict[str, Any]]) -> Table:
    # A start time in clock ticks identifies a process; nobody reads it.
    columns = list(dict.fromkeys(k for r in replicas for k in r if k != "starttime"))
    t = Table(box=None, padding=(0, 2), show_edge=False, header_style="dim")
    for col in columns:
        t.add_column(col, justify="left" if col in ("device", "state") else "right")
    for r in replicas:
        t.add_row(*(_value(r.get(col, "-")) for col in columns))
    return t


def render(address: str, snap: Snapshot, iv: Optional[Interval], every: float) -> Group:
    """One frame of the view: ``snap`` the latest snapshot, ``iv`` the
    interval that ended with it (None for the first frame)."""
    parts: List[RenderableType] = [_header(address, snap, every), Text(), _figures(snap, iv)]
    if iv is not None and iv.batch_hist:
        parts += [Text(), Text("batch sizes, last interval", style="bold"), _batch_sizes(iv)]
    if iv is not None and iv.client_rates:
        parts += [Text(), Text("clients, last interval (slowest first)", style="bold"),
                  _clients(iv)]
    st = snap.stats
    if st.get("methods"):
        parts += [Text(), Text("methods, last interval", style="bold"), _methods(snap, iv)]
    if st.get("replicas"):
        parts += [Text(), Text("replicas", style="bold"), _replicas(st["replicas"])]
    for name in ("cache", "tuner"):
        if st.get(name):
            # (the cache's per-client counters are in shmeval stats ADDRESS)
            shown = {k: v for k, v in st[name].items() if k != "clients"}
            parts += [Text(), _key_values(name, shown)]
    return Group(*parts)


def watch(address: str, every: float = 1.0, console: Optional[Console] = None) -> int:
    """Redraws the view every ``every`` seconds until Ctrl-C or until the
    evaluator stops, then prints one line saying which; returns the exit
    code (0).  Without a terminal it prints the last view before that
    line.  Raises SegmentError when ``address`` is not a running evaluator
    of this user."""
    console = console or Console()
    frame: Optional[Group] = None
    # On a terminal the view is redrawn in place and stays; elsewhere (a
    # pipe, a file) Live draws nothing and the last view is printed at the end.
    # Ctrl-C ends it cleanly from the moment it attaches.
    try:
        reader = EvaluatorReader(address)
        prev = reader.snapshot()
        frame = render(address, prev, None, every)
        why = reader.gone()
        with Live(frame, console=console, auto_refresh=False,
                  transient=not console.is_terminal) as live:
            while why is None:
                time.sleep(every)
                snap = reader.snapshot()
                frame = render(address, snap, Interval.between(prev, snap), every)
                live.update(frame, refresh=True)
                why = reader.gone()
                prev = snap
    except KeyboardInterrupt:
        why = "stopped watching (Ctrl-C)"
    if not console.is_terminal and frame is not None:
        console.print(frame)
    console.print(why)
    return 0
