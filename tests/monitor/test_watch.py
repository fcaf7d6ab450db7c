"""``shmeval stats ADDRESS --watch`` and what it reads: the figures of an
interval between two snapshots are the requests that were made in it (per
client too, the slowest marked), a frame shows them and the replicas,
cache and tuner sections once ``stats()`` has them, and the command ends
with one line when the evaluator closes or on Ctrl-C."""
from __future__ import annotations

import multiprocessing as mp
import re
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from shmeval.monitor.reader import EvaluatorReader, Interval, Snapshot
from shmeval.monitor.watch import batch_size_rows, render
from helpers import make_ev, make_state

TIMEOUT_S = 60


def text_of(snap: Snapshot, iv: Any) -> str:
    console = Console(width=120, record=True, file=open("/dev/null", "w"))
    console.print(render("/shmeval-test", snap, iv, 1.0))
    return console.export_text()


def send(ev: Any, rows: list[int]) -> None:
    """One evaluate_many of each size in ``rows``, in a child process."""
    for n in rows:
        ev.evaluate_many(np.stack([make_state(1)] * n))


def run_child(ev: Any, rows: list[int]) -> None:
    p = mp.get_context("fork").Process(target=send, args=(ev, rows))
    p.start()
    p.join(TIMEOUT_S)
    assert p.exitcode == 0, p.exitcode


@pytest.mark.timeout(TIMEOUT_S)
def test_interval_counts_what_happened_in_it_per_client() -> None:
    with make_ev() as ev:
        reader = EvaluatorReader(ev.address)
        ev.evaluate(make_state(1))                       # before the interval: not counted
        # Two client processes kept attached across both snapshots: the
        # evaluator's own process (this one) and a forked child.
        a = reader.snapshot()
        run_child(ev, [4] * 30)                          # 120 requests, exited
        send(ev, [1] * 10)                               # 10 requests from this process
        b = reader.snapshot()
        iv = Interval.between(a, b)
    assert iv.requests == 130 and iv.failed_requests == 0
    assert sum(iv.batch_hist.values()) == iv.batches
    assert sum(size * n for size, n in iv.batch_hist.items()) == 130
    assert iv.mean_batch == pytest.approx(130 / iv.batches)
    assert iv.requests_per_s == pytest.approx(130 / iv.seconds)
    # The child detached when it exited: only clients attached at both ends
    # have a rate, and this process sent exactly 10 in the interval.
    [(key, rate)] = iv.client_rates.items()
    assert rate * iv.seconds == pytest.approx(10)
    assert iv.slowest_client is None                      # one client is nobody's laggard
    assert set(iv.queue_wait_ns) == {"p50", "p90", "p99"}


def hold_and_send(ev: Any, n: int, go: Any, done: Any) -> None:
    """Attaches, waits for ``go``, sends n requests, reports, stays
    attached until ``done`` (so that both snapshots see it)."""
    ev.evaluate(make_state(1))
    go.wait(TIMEOUT_S)
    send(ev, [1] * n)
    done.wait(TIMEOUT_S)


@pytest.mark.timeout(TIMEOUT_S)
def test_the_slowest_client_is_marked() -> None:
    ctx = mp.get_context("fork")
    with make_ev() as ev:
        reader = EvaluatorReader(ev.address)
        go, done = ctx.Event(), ctx.Event()
        procs = [ctx.Process(target=hold_and_send, args=(ev, n, go, done)) for n in (40, 5)]
        for p in procs:
            p.start()
        try:
            while ev.stats()["clients"] < 2:
                time.sleep(0.01)
            a = reader.snapshot()
            go.set()
            while ev.stats()["requests"] < 2 + 45:
                time.sleep(0.01)
            b = reader.snapshot()
        finally:
            done.set()
            for p in procs:
                p.join(TIMEOUT_S)
        iv = Interval.between(a, b)
    counts = {key[1]: round(rate * iv.seconds) for key, rate in iv.client_rates.items()}
    assert sorted(counts.values()) == [5, 40]
    assert iv.slowest_client is not None and iv.slowest_client[1] == procs[1].pid
    text = text_of(b, iv)
    [marked] = [line for line in text.splitlines() if "slowest" in line and "◀" in line]
    assert str(procs[1].pid) in marked


def test_batch_sizes_in_power_of_two_ranges() -> None:
    assert batch_size_rows({}) == []
    assert batch_size_rows({1: 2, 3: 1, 9: 4}) == [("1", 2), ("2-3", 1), ("4-7", 0),
                                                    ("8-15", 4)]
    assert batch_size_rows({5: 1, 6: 2}) == [("4-7", 3)]


@pytest.mark.timeout(TIMEOUT_S)
def test_a_frame_shows_the_figures_and_the_sections_that_exist() -> None:
    with make_ev() as ev:
        reader = EvaluatorReader(ev.address)
        a = reader.snapshot()
        send(ev, [3] * 5)
        b = reader.snapshot()
    first = text_of(a, None)
    assert "requests/s" in first and "batch sizes" not in first   # no interval yet
    sections = ("replicas", "cache", "tuner")
    plain = {k: v for k, v in b.stats.items() if k not in sections}
    text = text_of(Snapshot(b.raw, plain, b.client_requests), Interval.between(a, b))
    assert "batch sizes" in text and "2-3" in text and "queue wait" in text
    for absent in sections:
        assert absent not in text
    extra = {"replicas": [{"replica": 0, "pid": 4242, "starttime": 99, "device": "cuda:1",
                           "state": "serving", "version": 7, "requests": 1234}],
             "cache": {"hits": 900, "misses": 100, "hit_rate": 0.9},
             "tuner": {"max_wait_us": 250, "reason": "fuller batches"}}
    text = text_of(Snapshot(b.raw, {**plain, **extra}, b.client_requests), None)
    assert "cuda:1" in text and "1,234" in text and "99" not in text.split("replicas")[1]
    assert "hit_rate 0.9" in text and "reason fuller batches" in text


def mapped(pid: int, address: str) -> bool:
    """Whether process ``pid`` has mapped the segment (the command attached)."""
    with open(f"/proc/{pid}/maps") as f:
        return f"/dev/shm{address}" in f.read()


def start_watching(address: str) -> subprocess.Popen[str]:
    """``shmeval stats ADDRESS --watch`` in a subprocess, returned once it
    has attached (it claims no client entry: its mapping tells)."""
    # Ctrl-C as a terminal delivers it: to a process that handles SIGINT,
    # whatever this process's handler is (an ignored SIGINT is inherited).
    p = subprocess.Popen([sys.executable, "-m", "shmeval", "stats", address, "--watch",
                          "--interval", "0.2"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    while p.poll() is None and not mapped(p.pid, address):
        time.sleep(0.02)
    assert p.poll() is None, p.communicate()
    return p


@pytest.mark.timeout(TIMEOUT_S)
def test_watch_ends_with_one_line_when_the_evaluator_closes() -> None:
    with make_ev() as ev:
        p = start_watching(ev.address)
        send(ev, [2] * 3)
    out, err = p.communicate(timeout=TIMEOUT_S)
    assert p.returncode == 0, err
    assert err == ""
    assert out.strip().splitlines()[-1] == f"the evaluator serving {ev.address} is closed", out


@pytest.mark.timeout(TIMEOUT_S)
def test_watch_ends_cleanly_on_ctrl_c() -> None:
    with make_ev() as ev:
        p = start_watching(ev.address)
        try:
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=TIMEOUT_S)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert p.returncode == 0, err
    assert "Traceback" not in err
    assert out.strip().splitlines()[-1] == "stopped watching (Ctrl-C)", out


def test_ctrl_c_before_the_first_view_ends_cleanly_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C arriving between the attach and the first view (a slow
    machine widens that window) ends the view as cleanly as later."""
    import io

    from shmeval.monitor import watch as watch_module

    def interrupted(self: Any) -> Snapshot:
        raise KeyboardInterrupt

    monkeypatch.setattr(EvaluatorReader, "snapshot", interrupted)
    out = io.StringIO()
    with make_ev() as ev:
        try:
            rc = watch_module.watch(ev.address, 0.2, Console(file=out, width=100))
        except KeyboardInterrupt:
            pytest.fail("a Ctrl-C before the first view escaped watch()")
    assert rc == 0
    assert out.getvalue().strip().splitlines()[-1] == "stopped watching (Ctrl-C)"


def test_watch_without_rich_is_a_one_line_hint() -> None:
    code = ("import sys; sys.modules['rich'] = None; from shmeval.cli import main; "
            "sys.exit(main(['stats', '/shmeval-1-00', '--watch']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert r.returncode == 1
    # (None in sys.modules names the submodule that failed: rich.console.)
    assert re.fullmatch(r"needs: pip install 'shmeval\[monitor\]' \(rich[.\w]* missing\)\n",
                        r.stderr), r.stderr
