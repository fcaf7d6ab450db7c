#!/usr/bin/env python
"""Soak test: 16 workers at full load for minutes, with periodic kills.

One evaluator (a thread of this process, or its own process with --spawn)
serves a small NumPy model to --workers processes that call evaluate() (and
every --many-every-th time evaluate_many() with 1-8 rows) in a loop and check
every answer.  Every --kill-every seconds a random worker is SIGKILLed at
whatever point it has reached and a replacement is started.  Every
--report-every seconds one line:

    elapsed, RSS of the evaluator process, median / max RSS of the workers
    (VmRSS from /proc), open fds of the evaluator process, shmeval entries
    in /dev/shm (this run's, and all), requests served, kills so far,
    reclaimed client entries, lost requests.

Lost requests are requests sent by surviving workers that were not answered
correctly: each worker counts what it sent, what came back correct, wrong or
as an error in a shared array.  During the run "lost" counts wrong answers
and errors of workers alive at that moment; at the end the workers are
stopped gracefully, so every request a survivor sent must have come back
correct.  A killed worker's in-flight requests are not lost (they are
reported as killed_in_flight); wrong answers it saw before it died are.

Verdict at the end: evaluator RSS flat within 5% after the warm-up (the
first report at or after --warmup seconds against the last one), evaluator
fds and this run's /dev/shm entries constant after the warm-up, zero lost
requests, zero wrong answers, and nothing left in /dev/shm after close().

    .venv/bin/python bench/soak.py --minutes 2 --json /tmp/soak.json
    .venv/bin/python bench/soak.py --spawn --kill-every 2
    .venv/bin/python bench/soak.py --minutes 1 --inject leak   # the verdict must FAIL

Workers are started from a forkserver that has imported NumPy and shmeval
(a replacement is one fork(), not an interpreter start-up).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import signal
import statistics
import sys
import time
from typing import Any, Optional

import numpy as np

import shmeval
from shmeval._util.procstat import rss_mb

INPUT_SHAPE = (6, 7, 2)
OUTPUTS = {"policy": ((7,), "float32"), "value": ((), "float32")}
TAGS = 4_000_000             # 2 * tag stays exact in float32
SENT, OK, WRONG, ERRORS, ALIVE, PID = range(6)
NCOUNT = 8                   # int64 counters per worker row (padded)
ARANGE7 = np.arange(7, dtype=np.float32)


# ---------------------------------------------------------------- model

def model(x: np.ndarray) -> dict[str, np.ndarray]:
    """policy[k] = 2 * x[0, k, 0] + k, value = x[5, 6, 1]: each answer
    identifies the state it was computed from."""
    return {"policy": x[:, 0, :, 0] * 2 + ARANGE7, "value": x[:, 5, 6, 1].copy()}


_hoard: list[Any] = []


def faulty_model(x: np.ndarray) -> dict[str, np.ndarray]:
    """model with the fault named by $SOAK_INJECT, to check that the verdict
    catches it: 'leak' keeps 4 KB per batch, 'fds' opens /dev/null every 100
    batches, 'wrong' corrupts one answer in 100,000 batches."""
    out = model(x)
    what = os.environ.get("SOAK_INJECT", "")
    if what == "leak":
        _hoard.append(bytearray(4096))
    elif what == "fds" and random.random() < 0.01:
        _hoard.append(open(os.devnull))
    elif what == "wrong" and random.random() < 1e-5:
        out["value"][0] += 1
    return out


def factory() -> Any:
    return faulty_model if os.environ.get("SOAK_INJECT") else model


def states_for(tags: np.ndarray) -> np.ndarray:
    s = np.zeros((len(tags),) + INPUT_SHAPE, np.float32)
    s[:, 0, :, 0] = tags[:, None]
    s[:, 5, 6, 1] = -tags
    return s


def correct(out: dict[str, np.ndarray], tags: np.ndarray) -> np.ndarray:
    t = tags.astype(np.float32)
    pol = np.asarray(out["policy"]).reshape(len(tags), 7)
    val = np.asarray(out["value"]).reshape(len(tags))
    return (val == -t) & (pol == 2 * t[:, None] + ARANGE7).all(axis=1)


# ---------------------------------------------------------------- worker

def worker(ev: Any, row: int, counters: Any, stop: Any, seed: int, many_every: int) -> None:
    c = np.frombuffer(counters, np.int64).reshape(-1, NCOUNT)[row]
    c[PID] = os.getpid()
    c[ALIVE] = 1
    rng = np.random.default_rng(seed)
    i = 0
    try:
        while not stop.value:
            i += 1
            n = int(rng.integers(1, 9)) if many_every and i % many_every == 0 else 1
            tags = rng.integers(0, TAGS, n).astype(np.float32)
            c[SENT] += n
            try:
                if n == 1:
                    out = ev.evaluate(states_for(tags)[0])
                else:
                    out = ev.evaluate_many(states_for(tags))
            except shmeval.ShmevalError:
                c[ERRORS] += n
                continue
            good = int(correct(out, tags).sum())
            c[OK] += good
            c[WRONG] += n - good
    finally:
        c[ALIVE] = 0


# ---------------------------------------------------------------- /proc

def n_fds(pid: int) -> Optional[int]:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def shm_entries(owner_pid: int) -> tuple[int, int]:
    """(this run's shmeval segments, every shmeval segment) in /dev/shm."""
    names = [e for e in os.listdir("/dev/shm") if e.startswith("shmeval-")]
    return sum(e.startswith(f"shmeval-{owner_pid}-") for e in names), len(names)


def git_revision() -> str:
    """HEAD of the checkout this runs from, and the files of src/ that differ
    from it (another session's work in progress, say)."""
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "../src"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    changed = [line[3:] for line in dirty if line.strip()]
    return (head or "unknown") + (f" (changed: {', '.join(changed)})" if changed else "")


# ---------------------------------------------------------------- the run

class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ctx: Any = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["numpy", "shmeval"])
        duration = args.minutes * 60
        max_rows = args.workers + int(duration / args.kill_every if args.kill_every else 0) + 64
        self.counters = self.ctx.RawArray("q", max_rows * NCOUNT)
        self.c = np.frombuffer(self.counters, np.int64).reshape(max_rows, NCOUNT)
        self.stop = self.ctx.RawValue("i", 0)
        self.procs: dict[int, Any] = {}      # row -> Process, the live workers
        self.killed_rows: list[int] = []
        self.next_row = 0
        self.rng = random.Random(args.seed)
        self.kills = 0
        self.reports: list[dict[str, Any]] = []

    def start_worker(self, ev: Any) -> None:
        row = self.next_row
        if row >= len(self.c):
            raise RuntimeError("out of counter rows")
        self.next_row += 1
        p = self.ctx.Process(target=worker, daemon=True,
                             args=(ev, row, self.counters, self.stop,
                                   self.args.seed * 100_003 + row, self.args.many_every))
        p.start()
        self.procs[row] = p

    def kill_one(self, ev: Any) -> None:
        row = self.rng.choice(sorted(self.procs))
        p = self.procs.pop(row)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        p.close()                       # its sentinel fd
        self.killed_rows.append(row)
        self.kills += 1
        self.start_worker(ev)

    def totals(self, final: bool = False) -> dict[str, int]:
        c = self.c[:self.next_row].copy()
        alive = sorted(self.procs)
        killed = self.killed_rows
        surv = c[alive] if alive else np.zeros((0, NCOUNT), np.int64)
        dead = c[killed] if killed else np.zeros((0, NCOUNT), np.int64)
        in_flight = surv[:, SENT] - surv[:, OK] - surv[:, WRONG] - surv[:, ERRORS]
        lost = int(surv[:, WRONG].sum() + surv[:, ERRORS].sum())
        if final:
            lost += int(in_flight.sum())
        return {
            "sent": int(c[:, SENT].sum()), "answered_ok": int(c[:, OK].sum()),
            "lost": lost, "wrong": int(c[:, WRONG].sum()),
            "errors_survivors": int(surv[:, ERRORS].sum()),
            "errors_killed": int(dead[:, ERRORS].sum()),
            "wrong_killed": int(dead[:, WRONG].sum()),
            "killed_in_flight": int((dead[:, SENT] - dead[:, OK] - dead[:, WRONG]
                                     - dead[:, ERRORS]).sum()),
            "survivors_in_flight": int(in_flight.sum()),
        }

    def report(self, ev: Any, ev_pid: int, t0: float) -> dict[str, Any]:
        s = ev.stats()
        wr = [r for r in (rss_mb(p.pid) for p in self.procs.values() if p.pid) if r is not None]
        ours, all_shm = shm_entries(os.getpid())
        tot = self.totals()
        r = {
            "elapsed_s": round(time.monotonic() - t0, 1),
            "evaluator_rss_mb": rss_mb(ev_pid),
            "worker_rss_median_mb": statistics.median(wr) if wr else None,
            "worker_rss_max_mb": max(wr) if wr else None,
            "evaluator_fds": n_fds(ev_pid),
            "shm_ours": ours, "shm_all": all_shm,
            "served": s["requests"], "kills": self.kills,
            "reclaimed_clients": s["reclaimed_clients"], "clients": s["clients"],
            "lost": tot["lost"], "wrong": tot["wrong"],
            "failed_requests": s["failed_requests"], "state": s["state"],
        }
        print(f"t={r['elapsed_s']:6.0f}s  evRSS {r['evaluator_rss_mb']:6.1f} MB  "
              f"workers RSS med {r['worker_rss_median_mb'] or 0:5.1f} "
              f"max {r['worker_rss_max_mb'] or 0:5.1f} MB  fds {r['evaluator_fds']}  "
              f"shm {ours} (all {all_shm})  served {r['served']:,}  kills {self.kills}  "
              f"reclaimed {r['reclaimed_clients']}  lost {r['lost']}  wrong {r['wrong']}",
              flush=True)
        return r

    def run(self) -> dict[str, Any]:
        a = self.args
        kw = dict(input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=a.max_batch,
                  max_clients=a.max_clients, slots_per_client=8)
        if a.inject:
            os.environ["SOAK_INJECT"] = a.inject
        ev = shmeval.Evaluator.spawn(factory, **kw) if a.spawn else shmeval.Evaluator(factory(), **kw)
        ev_pid = ev.pid
        address = ev.address
        self.revision = git_revision()
        duration = a.minutes * 60
        warmup = a.warmup if a.warmup is not None else min(60.0, duration * 0.2)
        print(f"soak: {a.workers} workers, {'spawned' if a.spawn else 'thread'} evaluator "
              f"(pid {ev_pid}) {address}, {a.minutes:g} min, kill every {a.kill_every:g} s, "
              f"report every {a.report_every:g} s, warm-up {warmup:g} s; "
              f"shmeval {self.revision}", flush=True)
        t_start = time.monotonic()
        try:
            for _ in range(a.workers):
                self.start_worker(ev)
            t0 = time.monotonic()
            next_kill = t0 + a.kill_every if a.kill_every else float("inf")
            next_report = t0 + a.report_every
            end = t0 + duration
            while True:
                now = time.monotonic()
                if now >= end:
                    break
                if now >= next_kill:
                    self.kill_one(ev)
                    next_kill += a.kill_every
                if now >= next_report:
                    self.reports.append(self.report(ev, ev_pid, t0))
                    next_report += a.report_every
                time.sleep(max(0.0, min(next_kill, next_report, end) - time.monotonic()))
            self.reports.append(self.report(ev, ev_pid, t0))
            # Graceful stop: every survivor finishes its request and exits.
            self.stop.value = 1
            hung = []
            deadline = time.monotonic() + 60
            for row, p in self.procs.items():
                p.join(max(0.1, deadline - time.monotonic()))
                if p.is_alive():
                    hung.append(p.pid)
                    p.kill()
                    p.join()
            final = self.totals(final=True)
            final_stats = ev.stats()
        finally:
            ev.close()
        time.sleep(0.2)
        left_after_close = shm_entries(os.getpid())[0]
        verdict = self.verdict(warmup, final, hung, left_after_close)
        return {
            "config": {**vars(a), "warmup_s": warmup, "evaluator_pid": ev_pid,
                       "address": address, "python": platform.python_version(),
                       "numpy": np.__version__, "cpus": os.cpu_count(),
                       "git": self.revision,
                       "machine": platform.platform()},
            "wall_s": round(time.monotonic() - t_start, 1),
            "reports": self.reports, "final": final, "final_stats": final_stats,
            "hung_workers": hung, "shm_left_after_close": left_after_close,
            "verdict": verdict,
        }

    def verdict(self, warmup: float, final: dict[str, int], hung: list[int],
                left: int) -> dict[str, Any]:
        after = [r for r in self.reports if r["elapsed_s"] >= warmup] or self.reports[-1:]
        first, last = after[0], after[-1]
        rss0, rss1 = first["evaluator_rss_mb"], last["evaluator_rss_mb"]
        growth = (rss1 - rss0) / rss0
        fds = sorted({r["evaluator_fds"] for r in after})
        shm = sorted({r["shm_ours"] for r in after})
        checks = {
            "rss_flat": {"ok": abs(growth) <= 0.05,
                         "detail": f"evaluator RSS {rss0:.1f} MB at {first['elapsed_s']:.0f} s -> "
                                   f"{rss1:.1f} MB at {last['elapsed_s']:.0f} s "
                                   f"({growth:+.1%}, limit 5%)"},
            "fds_constant": {"ok": len(fds) == 1,
                             "detail": f"evaluator fds after warm-up: {fds}"},
            "shm_constant": {"ok": shm == [1] and left == 0,
                             "detail": f"this run's /dev/shm segments after warm-up: {shm}; "
                                       f"after close(): {left}"},
            "no_lost_requests": {"ok": final["lost"] == 0 and not hung,
                                 "detail": f"lost {final['lost']} of {final['sent']:,} sent "
                                           f"(survivors' wrong/errors/unanswered), hung "
                                           f"workers {len(hung)}"},
            "no_wrong_answers": {"ok": final["wrong"] == 0,
                                 "detail": f"wrong answers {final['wrong']} (killed workers "
                                           f"{final['wrong_killed']})"},
        }
        return {"pass": all(c["ok"] for c in checks.values()), "checks": checks}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--kill-every", type=float, default=5.0,
                   help="seconds between worker kills (0: none)")
    p.add_argument("--report-every", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds before the RSS/fd baseline (default: 20%% of the run, <= 60)")
    p.add_argument("--spawn", action="store_true", help="evaluator in its own process")
    p.add_argument("--many-every", type=int, default=10,
                   help="every Nth call is evaluate_many with 1-8 rows (0: never)")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--max-clients", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--inject", choices=["leak", "fds", "wrong"],
                   help="make the model leak memory or fds, or answer wrongly, to see the "
                        "verdict fail")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    result = Soak(args).run()
    v = result["verdict"]
    print("verdict:", "PASS" if v["pass"] else "FAIL")
    for name, c in v["checks"].items():
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {name}: {c['detail']}")
    f = result["final"]
    print(f"  sent {f['sent']:,}, answered correctly {f['answered_ok']:,}; killed workers' "
          f"in-flight requests {f['killed_in_flight']} (not lost), their errors "
          f"{f['errors_killed']}; evaluator failed_requests "
          f"{result['final_stats']['failed_requests']}, reclaimed clients "
          f"{result['final_stats']['reclaimed_clients']}, reclaimed WRITING slots "
          f"{result['final_stats']['reclaimed_writing_slots']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    return 0 if v["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
