"""The tuner's own cost: one worker process (or more) evaluating one state
at a time against a spawned evaluator with the null model, under settings
that differ in one thing at a time: every knob "auto"; the fixed settings
before the tuner ("today": greedy, spin 100/50 µs, one serving thread);
the auto evaluator with the clients' spin fixed at 100 µs; the fixed
evaluator with the clients' spin "auto"; auto with one serving thread.
Each runs 3 s after 5 s of settling, two rounds.  Prints round trips/s,
the evaluator's spin and the first client's spin arms.

    python bench/tuner_overhead.py 1            # one worker, every variant
    python bench/tuner_overhead.py 1 auto,today # two of them
"""
from __future__ import annotations

import functools
import multiprocessing as mp
import sys
import time
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np

import shmeval
from shmeval.bench.roundtrip import NullModel
from shmeval.bench._timing import timed_calls


def worker(ev: Any, q: Any, secs: float, go: Any, spin_us: Union[float, str, None]) -> None:
    c = shmeval.connect(ev.address, spin_us=spin_us) if spin_us is not None else ev
    s = np.zeros((6, 7, 2), np.float32)
    lat = np.zeros(1, np.int64)
    for _ in range(3000):
        c.evaluate(s)
    go.wait()
    n, _ = timed_calls(c.evaluate, s, time.perf_counter_ns() + int(secs * 1e9), lat)
    st = c.stats()
    q.put((n, st.get("client_spin")))


TODAY = dict(max_wait_us=0, spin_us=100, evaluator_spin_us=50, serving_threads=1)
VARIANTS: Dict[str, Tuple[Dict[str, Any], Optional[Union[float, str]]]] = {
    "auto": ({}, None),
    "today": (TODAY, None),
    "auto-ev+client100": ({}, 100),
    "today-ev+client-auto": (TODAY, "auto"),
    "auto-threads1": (dict(serving_threads=1), None),
}


def main() -> None:
    ctx = mp.get_context("spawn")
    nw, secs = int(sys.argv[1]), 3
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(VARIANTS)
    for _ in range(2):
        for name in names:
            kw, client_spin = VARIANTS[name]
            ev = shmeval.Evaluator.spawn(
                functools.partial(NullModel, 7), input_shape=(6, 7, 2), input_dtype="float32",
                outputs={"policy": ((7,), "float32"), "value": ((), "float32")},
                max_batch=256, **kw)
            try:
                q, go = ctx.Queue(), ctx.Event()
                ps = [ctx.Process(target=worker, args=(ev, q, secs, go, client_spin))
                      for _ in range(nw)]
                for p in ps:
                    p.start()
                time.sleep(5)   # the tuner settles
                go.set()
                rs = [q.get(timeout=90) for _ in ps]
                for p in ps:
                    p.join()
                t = ev.stats().get("tuner") or {}
                print(f"{name:22s} {sum(r[0] for r in rs) / secs:>9,.0f}/s  "
                      f"ev spin {t.get('spin')} {t.get('spin_us')}  client {rs[0][1]}", flush=True)
            finally:
                ev.close()


if __name__ == "__main__":
    main()
