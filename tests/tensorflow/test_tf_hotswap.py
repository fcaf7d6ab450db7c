"""Weight hot-swap with a real TensorFlow model under load.

A spawned evaluator serves tf_models.pv_net through TFModel; spawn workers
(which never import TensorFlow) evaluate a fixed set of states in a loop
while the test pushes 12 sets of weights.  Every answer must equal the
Keras model called directly with the weights of the version stamped on it,
and no worker may see versions go backwards.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from typing import Any

import numpy as np
import pytest

import shmeval
from tf_models import INPUT_SHAPE, OUTPUTS, pv_factory, pv_net, random_states, seeded_weights

UPDATES = 12
STATES = 24
JOIN_TIMEOUT = 120


def load_worker(ev: Any, seed: int, stop: Any, conn: Any) -> None:
    """Evaluates the fixed states (singly and in batches) until stop is
    set; sends back every (state index, version, policy, value)."""
    try:
        states = random_states(STATES, 0)
        rng = np.random.default_rng(seed)
        idx: list[np.ndarray] = []
        ver: list[np.ndarray] = []
        pol: list[np.ndarray] = []
        val: list[np.ndarray] = []
        n = 0
        while not stop.is_set() or n < 50:
            if rng.random() < 0.5:
                i = np.array([rng.integers(STATES)])
                out, v = ev.evaluate(states[i[0]], return_version=True)
                vs = np.array([v])
                p, x = out["policy"][None].copy(), out["value"][None].copy()
            else:
                i = rng.integers(0, STATES, rng.integers(1, 12))
                out, vs = ev.evaluate_many(states[i], return_version=True)
                p, x = out["policy"], out["value"]
            idx.append(i)
            ver.append(vs)
            pol.append(p)
            val.append(x)
            n += 1
        conn.send({"idx": np.concatenate(idx), "ver": np.concatenate(ver),
                   "policy": np.concatenate(pol), "value": np.concatenate(val),
                   "calls": [len(v) for v in ver],
                   "tensorflow": "tensorflow" in sys.modules})
    except BaseException as e:
        conn.send({"error": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


@pytest.mark.timeout(240)
def test_tf_hot_swap_under_load() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Reference: the Keras model called directly with each version's weights
    # (version 0 is what pv_factory builds: pv_net(seed=0)).
    model = pv_net(seed=0)
    states = random_states(STATES, 0)
    weights, ref_policy, ref_value = [], [], []
    for v in range(UPDATES + 1):
        seeded_weights(model, v)
        weights.append(model.get_weights())
        out = model(states, training=False)
        ref_policy.append(np.asarray(out["policy"]))
        ref_value.append(np.asarray(out["value"]).reshape(STATES))
    ref_policy_a, ref_value_a = np.stack(ref_policy), np.stack(ref_value)

    ctx = mp.get_context("spawn")
    with shmeval.Evaluator.spawn(pv_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                 max_batch=64, max_clients=8) as ev:
        stop = ctx.Event()
        pipes, ps = [], []
        for w in range(3):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=load_worker, args=(ev, w, stop, send))
            p.start()
            send.close()
            pipes.append(recv)
            ps.append(p)
        try:
            deadline = time.monotonic() + 60
            while ev.stats()["requests"] < 300 and time.monotonic() < deadline:
                time.sleep(0.01)
            before = ev.stats()["requests"]
            for v in range(1, UPDATES + 1):
                assert ev.set_weights(weights[v]) == v
                time.sleep(0.05)
            during = ev.stats()["requests"] - before
            stop.set()
            reports = []
            for r in pipes:
                assert r.poll(JOIN_TIMEOUT), "a worker hung"
                reports.append(r.recv())
        finally:
            stop.set()
            for p in ps:
                p.join(JOIN_TIMEOUT)
                if p.is_alive():
                    p.kill()
        s = ev.stats()
    assert all(p.exitcode == 0 for p in ps)
    assert s["failed_requests"] == 0 and s["model_version"] == UPDATES
    assert during > 0, "requests stopped flowing during the updates"
    seen: set[int] = set()
    for rep in reports:
        assert "error" not in rep, rep.get("error")
        assert rep["tensorflow"] is False
        idx, ver = rep["idx"], rep["ver"]
        np.testing.assert_allclose(rep["policy"], ref_policy_a[ver, idx], atol=1e-5, rtol=0)
        np.testing.assert_allclose(rep["value"], ref_value_a[ver, idx], atol=1e-5, rtol=0)
        # Versions never go backwards from one call to the next.
        ends = np.cumsum(rep["calls"])
        starts = ends - np.array(rep["calls"])
        lo = np.array([ver[a:b].min() for a, b in zip(starts, ends)])
        hi = np.array([ver[a:b].max() for a, b in zip(starts, ends)])
        assert (lo[1:] >= np.maximum.accumulate(hi)[:-1]).all()
        seen.update(np.unique(ver).tolist())
    assert len(seen) > UPDATES // 2, sorted(seen)
