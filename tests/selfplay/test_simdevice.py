"""``--device sim``: the simulated GPU (shmeval._util.simdevice).  The
option parses and refuses bad values; the device serves one call at a
time across processes (checked on the calls' recorded times, never on how
long anything took); a wrapped model answers as the model does; the
device's file is gone from /dev/shm afterwards; and a comparison sends
every mode's net calls through it."""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest

from shmeval._util.simdevice import (DEFAULT_CALL_US, DEFAULT_ROW_US, SimDevice, SimLink,
                                     SimModel, SimSpec, Trace, device_bound_rate, parse_device)
from shmeval.selfplay import Settings, cli
from test_selfplay import RUN_TIMEOUT, TINY, _cli

CTX = mp.get_context("spawn")
JOIN_S = 60.0


def _sim_files() -> set[str]:
    return {e for e in os.listdir("/dev/shm") if "simgpu" in e}


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_the_device_option_parses_and_refuses_bad_values(capsys: Any) -> None:
    assert parse_device("cpu") is None
    assert parse_device("sim") == SimSpec(DEFAULT_CALL_US, DEFAULT_ROW_US)
    assert parse_device("sim:120,0.5") == SimSpec(120.0, 0.5)
    assert parse_device("sim:0,2") == SimSpec(0.0, 2.0)
    assert str(SimSpec(120.0, 0.5)) == "sim:120,0.5"
    assert SimSpec(100.0, 0.5).cost_ns(10) == 105_000
    assert device_bound_rate(SimSpec(100.0, 0.5), 10) == pytest.approx(10 / 105e-6)
    for bad, why in (("gpu", "cpu, sim or sim:CALL_US,ROW_US"),
                     ("sim:", "two numbers"), ("sim:80", "two numbers"),
                     ("sim:1,2,3", "two numbers"), ("sim:a,b", "two numbers"),
                     ("sim:-1,0.5", "finite and >= 0"), ("sim:80,-0.1", "finite and >= 0"),
                     ("sim:nan,1", "finite and >= 0"), ("sim:inf,1", "finite and >= 0"),
                     ("sim:0,0", "costs nothing")):
        with pytest.raises(ValueError, match=why):
            parse_device(bad)
        # the command line names the option and the reason, and starts nothing
        with pytest.raises(SystemExit):
            _parse("--device", bad)
        err = capsys.readouterr().err
        assert "argument --device" in err and why.split()[0] in err, err
        with pytest.raises(ValueError, match=why):
            Settings(device=bad).check()
    # the settings (and so the JSON) record the costs a run used
    assert cli.settings_from_args(_parse("--device", "sim")).device == (
        f"sim:{DEFAULT_CALL_US:g},{DEFAULT_ROW_US:g}")
    assert cli.settings_from_args(_parse("--device", "sim:50,1")).sim() == SimSpec(50.0, 1.0)
    assert cli.settings_from_args(_parse()).sim() is None
    # one device on this machine: refused on a Ray cluster, before Ray starts
    assert cli.main(_parse("--ray", "--device", "sim")) == 1
    assert "--device sim is one device on this machine" in capsys.readouterr().err


def _double(batch: np.ndarray) -> np.ndarray:
    return batch * 2.0


def _call_once(link: SimLink, barrier: Any, out: Any) -> None:
    trace: List[Trace] = []
    model = SimModel(_double, link, trace)
    barrier.wait()
    y = model(np.ones((4, 3), np.float32))
    out.put((trace[0], y.tolist()))


def test_two_processes_calling_at_once_are_served_one_after_the_other() -> None:
    cost_us = 200_000.0   # long beside any scheduling delay between the two
    with SimDevice(SimSpec(cost_us, 0.0)) as dev:
        barrier, out = CTX.Barrier(2), CTX.Queue()
        procs = [CTX.Process(target=_call_once, args=(dev.link, barrier, out))
                 for _ in range(2)]
        for p in procs:
            p.start()
        got = [out.get(timeout=JOIN_S) for _ in procs]
        for p in procs:
            p.join(JOIN_S)
            assert p.exitcode == 0
        counters = dev.counters()
    traces = sorted((t for t, _ in got), key=lambda t: t[1])
    cost = round(cost_us * 1000)
    for booked, start, end, ready, returned in traces:
        assert end - start == cost
        assert start >= booked and ready >= booked
        assert returned >= max(end, ready)    # never back before the device is done
    (_, s1, e1, _, r1), (_, s2, e2, _, r2) = traces
    assert s2 >= e1, f"the device ran two calls at once: {traces}"
    # the later of two calls made together takes both calls' device time
    assert max(r1, r2) - min(t[0] for t in traces) >= 2 * cost
    assert counters["calls"] == 2 and counters["rows"] == 8
    assert counters["busy_ns"] == 2 * cost
    for _, y in got:
        assert y == (np.ones((4, 3)) * 2).tolist()
    assert not _sim_files()


def _book_many(link: SimLink, n: int, barrier: Any, out: Any) -> None:
    barrier.wait()
    out.put([link.book(1)[1:] for _ in range(n)])


def test_concurrent_bookings_never_overlap() -> None:
    """Three processes book 3,000 calls each as fast as they can, on a
    device always busy (each call 1 ms of device time, booked in a few us):
    a booking that read the device's end while another was writing it
    would start two calls at the same time."""
    n, procs_n = 3000, 3
    with SimDevice(SimSpec(1000.0, 0.0)) as dev:
        barrier, out = CTX.Barrier(procs_n), CTX.Queue()
        procs = [CTX.Process(target=_book_many, args=(dev.link, n, barrier, out))
                 for _ in range(procs_n)]
        for p in procs:
            p.start()
        intervals: List[Tuple[int, int]] = []
        for _ in procs:
            intervals += out.get(timeout=JOIN_S)
        for p in procs:
            p.join(JOIN_S)
            assert p.exitcode == 0
        counters = dev.counters()
    intervals.sort()
    overlaps = sum(b[0] < a[1] for a, b in zip(intervals, intervals[1:]))
    assert overlaps == 0, f"{overlaps} of {len(intervals)} bookings overlapped another"
    assert counters["calls"] == n * procs_n
    assert counters["busy_ns"] == n * procs_n * 1_000_000
    assert intervals[-1][1] - intervals[0][0] >= n * procs_n * 1_000_000


class _Net:
    """A model with the optional methods the evaluator looks for."""

    max_concurrency = 2

    def __init__(self) -> None:
        self.w = np.arange(12, dtype=np.float32).reshape(6, 2)
        self.prepared: Any = None

    def __call__(self, batch: np.ndarray) -> Dict[str, np.ndarray]:
        flat = batch.reshape(len(batch), -1)
        return {"policy": flat @ self.w, "value": np.tanh(flat.sum(axis=1))}

    def prepare(self, spec: Any, buckets: Any) -> None:
        self.prepared = (spec, buckets)

    def set_weights(self, weights: List[np.ndarray]) -> None:
        self.w = weights[0]


def test_a_wrapped_model_answers_as_the_model_does() -> None:
    net = _Net()
    x = np.random.default_rng(0).random((5, 2, 3)).astype(np.float32)
    with SimDevice(SimSpec(10.0, 1.0)) as dev:
        trace: List[Trace] = []
        sim = SimModel(net, dev.link, trace)
        for rows in (5, 1, 3):
            got, want = sim(x[:rows]), net(x[:rows])
            assert set(got) == {"policy", "value"}
            for k in want:
                np.testing.assert_array_equal(got[k], want[k])
        # the rest is the model's own: the evaluator serves it as the model
        assert sim.max_concurrency == 2
        sim.prepare("spec", (1, 8))
        assert net.prepared == ("spec", (1, 8))
        sim.set_weights([np.ones((6, 2), np.float32)])
        np.testing.assert_array_equal(sim(x[:2])["policy"], net(x[:2])["policy"])
        assert not hasattr(sim, "load_weights")     # as the model: it has none
        spec = dev.spec
        assert [end - start for _, start, end, _, _ in trace] == [
            spec.cost_ns(rows) for rows in (5, 1, 3, 2)]
        assert dev.counters()["rows"] == 11
    assert not _sim_files()


def test_the_device_file_is_removed_after_the_run() -> None:
    dev = SimDevice(SimSpec())
    name = dev.name.lstrip("/")
    assert name in _sim_files()
    other = SimDevice(SimSpec())
    assert other.name != dev.name                  # a name of its own per run
    dev.close()
    dev.close()                                    # twice is harmless
    assert name not in _sim_files()
    with pytest.raises(RuntimeError), other:
        raise RuntimeError("a run that fails")
    assert not _sim_files()


@pytest.mark.timeout(RUN_TIMEOUT * 3)
def test_every_mode_calls_its_net_through_the_device(tmp_path: Any) -> None:
    js = str(tmp_path / "compare-sim.json")
    r = _cli(["--compare", *TINY, "--device", "sim:300,2", "--json", js],
             timeout=RUN_TIMEOUT * 3)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(js) as f:
        out = json.load(f)
    assert out["settings"]["device"] == "sim:300,2"
    assert "device: a simulated GPU (sim:300,2" in r.stdout
    assert "ratios (simulated GPU, like for like" in r.stdout
    probes = {}
    for m, res in out["modes"].items():
        dev = res["device"]
        assert dev["spec"] == "sim:300,2"
        assert dev["calls"] > 0 and 0 < dev["busy_share"] <= 1.01, (m, dev)
        # one device call per net call: the central evaluator's batches, or
        # each local worker's calls of its own net
        net_calls = (res["evaluator"]["batches"] if "evaluator" in res
                     else res["evaluate_calls"])
        assert abs(dev["calls"] - net_calls) <= 8 + 0.02 * net_calls, (m, dev, net_calls)
        assert dev["rows"] == pytest.approx(res["evals"], rel=0.02, abs=64), (m, dev)
        assert dev["busy_share"] == pytest.approx(
            (dev["calls"] * 300e-6 + dev["rows"] * 2e-6) / res["window_s"], rel=1e-6)
        assert f"sim GPU, {m}: busy" in r.stdout
        probes[m] = res["probe"]
    # the answers are the real net's, as without the device (bfloat16 in
    # the batched modes on CPUs that have it: within its rounding)
    ref = probes["queue"]
    for m, p in probes.items():
        np.testing.assert_allclose(p["policy"], ref["policy"], atol=2e-3, err_msg=m)
        np.testing.assert_allclose(p["value"], ref["value"], atol=2e-3, err_msg=m)
