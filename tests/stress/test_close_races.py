"""Client.close() while other threads of the same process are inside
requests.

close() retires the process's client entry at once (no new request is
posted on it) but detaches it only once the requests in flight on it are
answered: the evaluator may hand a detached entry to another process, and
two producers on one entry would get each other's answers.  Each client
also remembers the generation of every slot it posted and never reads a
slot whose generation changed (it was reclaimed and perhaps reused).
"""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Any

import numpy as np
import pytest

import shmeval

SHAPE = (3,)


def v_model(x: np.ndarray) -> dict[str, np.ndarray]:
    return {"v": x[:, 0] * 2 + x[:, 1]}


def tagged(tag: int, j0: int, n: int) -> np.ndarray:
    s = np.zeros((n, 3), np.float32)
    s[:, 0] = tag
    s[:, 1] = np.arange(j0, j0 + n) % 1_000_000
    return s


def want(tag: int, j0: int, n: int) -> np.ndarray:
    return (2 * tag + np.arange(j0, j0 + n) % 1_000_000).astype(np.float32)


def other_process(address: str, seconds: float, q: Any) -> None:
    """Waits for the (only) client entry, then checks its own answers."""
    h = shmeval.connect(address)
    bad = sent = 0
    err = ""
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        try:
            out = h.evaluate_many(tagged(7, sent, 4))
        except shmeval.ClientTableFull:
            time.sleep(0.001)
            continue
        except Exception as e:  # noqa: BLE001 - reported to the test
            err = f"{type(e).__name__}: {e}"
            break
        bad += int((out["v"] != want(7, sent, 4)).sum())
        sent += 4
    q.put((sent, bad, err))


@pytest.mark.timeout(120)
def test_closed_handle_never_shares_its_entry() -> None:
    """A long evaluate_many is running when its handle is closed; another
    process is waiting for the only client entry.  The long call stops
    (EvaluatorClosed) or finishes with its own answers; the other process
    gets the entry afterwards and only ever its own answers."""
    with shmeval.Evaluator(v_model, input_shape=SHAPE, outputs={"v": ((), "float32")},
                           slots_per_client=2, max_clients=1, max_batch=8) as ev:
        h = shmeval.connect(ev.address)
        h.evaluate(tagged(3, 0, 1)[0])  # this process holds the only entry
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=other_process, args=(ev.address, 6.0, q))
        p.start()
        try:
            time.sleep(1.0)  # the other process is up, waiting for an entry
            res: list[Any] = []
            n = 200_000  # 100,000 rounds of 2 slots

            def long_call() -> None:
                try:
                    out = h.evaluate_many(tagged(3, 0, n))
                    res.append(int((out["v"] != want(3, 0, n)).sum()))
                except shmeval.EvaluatorClosed:
                    res.append("closed")
                except Exception as e:  # noqa: BLE001
                    res.append(f"{type(e).__name__}: {e}")

            t = threading.Thread(target=long_call)
            t.start()
            time.sleep(0.05)
            h.close()
            t.join(60)
            assert not t.is_alive(), "the long call hung after close()"
            assert res == ["closed"] or res == [0], res
            sent, bad, err = q.get(timeout=60)
        finally:
            p.join(30)
            if p.is_alive():
                p.kill()
        assert err == "" and bad == 0, (sent, bad, err)
        assert sent > 0, "the other process never got the entry"
        s = ev.stats()
        assert s["stale_completions"] == 0 and s["failed_requests"] == 0, s


@pytest.mark.timeout(60)
def test_close_waits_for_answers_in_flight() -> None:
    """Threads waiting on a slow model when their handle is closed get their
    answers (close() waits for them); later calls on the handle claim a new
    entry and work."""
    def slow(x: np.ndarray) -> dict[str, np.ndarray]:
        time.sleep(0.3)
        return v_model(x)

    with shmeval.Evaluator(slow, input_shape=SHAPE, outputs={"v": ((), "float32")},
                           slots_per_client=4, max_clients=4, max_batch=8) as ev:
        h = shmeval.connect(ev.address)
        got: list[Any] = []

        def one(i: int) -> None:
            try:
                got.append(float(h.evaluate(tagged(i, 0, 1)[0])["v"]) == 2 * i)
            except shmeval.ShmevalError as e:
                got.append(e)

        ts = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in ts:
            t.start()
        time.sleep(0.1)  # all three are in flight
        h.close()
        for t in ts:
            t.join(30)
        assert got == [True, True, True], got
        assert float(h.evaluate(tagged(5, 0, 1)[0])["v"]) == 10.0
        h.close()
