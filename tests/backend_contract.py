"""The contract tests every framework backend passes (tests/tensorflow,
tests/torch, tests/jax), framework-free so that spawn workers can import it
without loading a framework.

- ``serve_and_compare``: clients in several threads get, through an
  evaluator, what the model called directly computes, at many batch sizes;
- ``mismatch_fails_at_construction``: declared outputs that do not fit the
  model's (``MISMATCHES``) fail at Evaluator construction with a
  ``ModelError`` that says why, and leave no segment behind;
- ``updates_through_evaluator``: ev.set_weights and ev.load_weights reach
  the model between batches, answers follow the new weights, and a refused
  update changes nothing;
- ``hot_swap_under_load``: a spawned evaluator serves while spawn workers
  evaluate and the test pushes new weights: every answer is the one of
  the version stamped on it, versions never go backwards, and the workers
  never import a framework;
- ``serves_after_bad_batches``: a model that fails on some batches (an
  exception, a wrong output shape, NaN) fails those requests with a
  ``ModelError`` that says why, and answers the next ones;
- ``module_fixture``: a fixture that imports a framework when a test first
  asks for it, so that collecting a test file does not load it;
- ``pv_outputs``: a policy-value net's two heads in the output structure a
  test asks for (dict, tuple, named tuple, policy alone).
"""
from __future__ import annotations

import collections
import importlib
import multiprocessing as mp
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np
import pytest

import shmeval
from helpers import INPUT_SHAPE, OUTPUTS, own_segments, run_threads, running, wait_for_requests

#: Batch sizes clients send with evaluate_many (max_batch is 64).
SIZES = (1, 2, 3, 7, 31, 64, 100)
TIMEOUT = 120.0
#: Frameworks a worker must never import.
FRAMEWORKS = ("torch", "jax", "tensorflow", "keras")
F32 = "float32"

Reference = Callable[[np.ndarray], dict[str, np.ndarray]]

__all__ = ["F32", "INPUT_SHAPE", "MISMATCHES", "OUTPUTS", "Reference", "SIZES", "TIMEOUT",
           "hot_swap_under_load", "mismatch_cases", "mismatch_fails_at_construction",
           "module_fixture", "pv_outputs", "random_states", "serve_and_compare",
           "serves_after_bad_batches", "updates_through_evaluator"]


def module_fixture(name: str) -> Any:
    """A module-scoped fixture that imports the module ``name`` and returns
    it; assigned to a name in a test file, it is the fixture of that name
    (``tf = module_fixture("tensorflow")``)."""
    def fixture() -> Any:
        return importlib.import_module(name)

    return pytest.fixture(scope="module")(fixture)


#: The named tuple of pv_outputs("named").
PV = collections.namedtuple("PV", ["value", "policy"])


def pv_outputs(kind: str, policy: Any, value: Any) -> Any:
    """A policy-value net's output as ``kind`` says: "dict" ({"policy",
    "value"}), "tuple" ((value, policy), unnamed), "named" (a named tuple
    (value, policy)) or "policy" (the policy alone)."""
    if kind == "dict":
        return {"policy": policy, "value": value}
    if kind == "tuple":
        return value, policy
    if kind == "named":
        return PV(value, policy)
    return policy


def random_states(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *INPUT_SHAPE)).astype(np.float32)


def serve_and_compare(ev: Any, ref: Reference, names: Sequence[str], seed: int = 0,
                      sizes: Sequence[int] = SIZES, atol: float = 1e-5) -> None:
    """Clients in several threads: one evaluate_many per size, two more send
    single evaluate() calls; every result equals the direct call."""
    results: dict[int, tuple[np.ndarray, dict[str, np.ndarray]]] = {}

    def client(i: int) -> None:
        if i < len(sizes):
            states = random_states(sizes[i], seed + i)
            results[i] = states, ev.evaluate_many(states)
        else:
            states = random_states(12, seed + i)
            singles = [ev.evaluate(s) for s in states]
            results[i] = states, {k: np.stack([o[k] for o in singles]) for k in names}

    run_threads(client, len(sizes) + 2, TIMEOUT)
    assert len(results) == len(sizes) + 2, "a client raised"
    for states, out in results.values():
        expect = ref(states)
        assert sorted(out) == sorted(names)
        for k in names:
            assert out[k].shape == expect[k].shape
            np.testing.assert_allclose(out[k], expect[k], rtol=1e-5, atol=atol)


# -- outputs that do not fit the spec ------------------------------------------------

#: Declared outputs that do not fit a model with a (7,) policy and a value
#: head: id -> (which outputs the model gives: "ordered" (two, unnamed) or
#: "named" ({"policy", "value"}), declared outputs, words the ModelError
#: must hold).  "{float32}" stands for the backend's name of float32.
MISMATCHES = {
    "too_few_declared": ("ordered", {"policy": ((7,), F32)}, ["2 output(s)", "declares 1"]),
    "too_many_declared": ("ordered", {"a": ((1,), F32), "b": ((7,), F32), "c": ((), F32)},
                          ["2 output(s)", "declares 3"]),
    "dict_names": ("named", {"pi": ((7,), F32), "v": ((), F32)},
                   ["['policy', 'value']", "['pi', 'v']"]),
    "per_row_shape": ("named", {"policy": ((8,), F32), "value": ((), F32)},
                      ["'policy'", "(7,)", "(8,)"]),
    "uncastable_dtype": ("named", {"policy": ((7,), F32), "value": ((), "int32")},
                         ["'value'", "{float32}", "int32"]),
}


def mismatch_cases(models: dict[str, Sequence[str]]) -> list[tuple[str, str]]:
    """(case, model) pairs for pytest.mark.parametrize: every case of
    MISMATCHES with each of the backend's models whose outputs are as the
    case needs (``models``: "ordered" / "named" -> the backend's kinds)."""
    return [(case, what) for case in sorted(MISMATCHES) for what in models[MISMATCHES[case][0]]]


def mismatch_fails_at_construction(case: str, model: Any, float32: str = "float32") -> None:
    """An Evaluator of ``model`` (a backend's wrapper of a model whose
    outputs are as MISMATCHES[case] needs), with the case's declared
    outputs, raises a ModelError holding the case's words (``float32``:
    how the backend names float32) and leaves no segment behind."""
    _, outputs, words = MISMATCHES[case]
    with pytest.raises(shmeval.ModelError) as info:
        shmeval.Evaluator(model, input_shape=INPUT_SHAPE, outputs=outputs, max_batch=8)
    for w in words:
        w = w.format(float32=float32)
        assert w in str(info.value), (w, str(info.value))
    assert not own_segments()


# -- weight updates --------------------------------------------------------------------

def updates_through_evaluator(ev: Any, refs: Sequence[Reference], weights: Any,
                              weights_file: Any) -> None:
    """ev serves the model refs[0] calls directly; ev.set_weights(weights)
    makes it refs[1]'s (version 1, also the version a single evaluate
    returns), ev.load_weights(weights_file) refs[2]'s (version 2); an
    update of the wrong number of arrays is refused and changes nothing.
    Each version is checked with serve_and_compare (sizes 3 and 40)."""
    names = tuple(OUTPUTS)
    serve_and_compare(ev, refs[0], names, sizes=(3, 40))
    assert ev.set_weights(weights) == 1
    state = random_states(1, 9)
    out, version = ev.evaluate(state[0], return_version=True)
    assert version == 1
    np.testing.assert_allclose(out["policy"], refs[1](state)["policy"][0], rtol=1e-5, atol=1e-5)
    serve_and_compare(ev, refs[1], names, sizes=(3, 40))
    assert ev.load_weights(weights_file) == 2
    serve_and_compare(ev, refs[2], names, sizes=(3, 40))
    with pytest.raises(shmeval.ModelError, match="set_weights: got 1 arrays"):
        ev.set_weights([np.zeros(3, np.float32)])
    assert ev.model_version == 2
    serve_and_compare(ev, refs[2], names, sizes=(3, 40))


# -- versions under load -------------------------------------------------------------

UPDATES = 8
STATES = 24


def load_worker(ev: Any, seed: int, stop: Any, conn: Any) -> None:
    """Evaluates the fixed states (singly and in batches) until stop is
    set; sends back every (state index, version, policy, value) and which
    frameworks this process imported."""
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
                   "imported": [f for f in FRAMEWORKS if f in sys.modules]})
    except BaseException as e:
        conn.send({"error": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


def hot_swap_under_load(factory: Callable[[], Any], weights: Sequence[Any],
                        reference: Callable[[int, np.ndarray], dict[str, np.ndarray]],
                        atol: float = 1e-5) -> None:
    """``factory`` builds the model with ``weights[0]``; the test pushes
    ``weights[1:]`` through ``ev.set_weights`` while three spawn workers
    evaluate.  ``reference(version, states)`` is the model called directly
    with that version's weights."""
    states = random_states(STATES, 0)
    refs = [reference(v, states) for v in range(len(weights))]
    ref_policy = np.stack([r["policy"] for r in refs])
    ref_value = np.stack([r["value"] for r in refs])
    ctx = mp.get_context("spawn")
    with shmeval.Evaluator.spawn(factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                 max_batch=64, max_clients=8) as ev:
        stop = ctx.Event()
        pipes = [ctx.Pipe(duplex=False) for _ in range(3)]
        ps = [ctx.Process(target=load_worker, args=(ev, w, stop, send))
              for w, (_, send) in enumerate(pipes)]
        with running(ps, stop, TIMEOUT):
            for _, send in pipes:
                send.close()
            wait_for_requests(ev, 300, time.monotonic() + 60)
            before = ev.stats()["requests"]
            for v in range(1, len(weights)):
                assert ev.set_weights(weights[v]) == v
                time.sleep(0.05)
            during = ev.stats()["requests"] - before
            stop.set()
            reports = []
            for recv, _ in pipes:
                assert recv.poll(TIMEOUT), "a worker hung"
                reports.append(recv.recv())
        s = ev.stats()
    assert all(p.exitcode == 0 for p in ps)
    assert s["failed_requests"] == 0 and s["model_version"] == len(weights) - 1
    assert during > 0, "requests stopped flowing during the updates"
    seen: set[int] = set()
    for rep in reports:
        assert "error" not in rep, rep.get("error")
        assert rep["imported"] == [], f"a worker imported {rep['imported']}"
        idx, ver = rep["idx"], rep["ver"]
        np.testing.assert_allclose(rep["policy"], ref_policy[ver, idx], atol=atol, rtol=0)
        np.testing.assert_allclose(rep["value"], ref_value[ver, idx], atol=atol, rtol=0)
        # Versions never go backwards from one call to the next.
        ends = np.cumsum(rep["calls"])
        starts = ends - np.array(rep["calls"])
        lo = np.array([ver[a:b].min() for a, b in zip(starts, ends)])
        hi = np.array([ver[a:b].max() for a, b in zip(starts, ends)])
        assert (lo[1:] >= np.maximum.accumulate(hi)[:-1]).all()
        seen.update(np.unique(ver).tolist())
    assert len(seen) > (len(weights) - 1) // 2, sorted(seen)


# -- bad batches -----------------------------------------------------------------------

#: A state whose first value is this makes the misbehaving models of
#: tests/torch and tests/jax fail in the way the test names.
TRIGGER = 100.0


def trigger_state(kind: int) -> np.ndarray:
    """A state that triggers failure ``kind`` (1, 2, ...) of a misbehaving
    model: its first value is TRIGGER * kind."""
    s = np.zeros(INPUT_SHAPE, np.float32)
    s[0, 0, 0] = TRIGGER * kind
    return s


def serves_after_bad_batches(ev: Any, failures: dict[int, Sequence[str]]) -> None:
    """For each failure kind, a request with its trigger state raises a
    ModelError whose text holds the given words; a good state is answered
    before and after each."""
    good = np.zeros(INPUT_SHAPE, np.float32)
    assert set(ev.evaluate(good)) == set(OUTPUTS)
    for kind, words in failures.items():
        with pytest.raises(shmeval.ModelError) as info:
            ev.evaluate(trigger_state(kind))
        for w in words:
            assert w in str(info.value), (kind, w, str(info.value))
        assert set(ev.evaluate(good)) == set(OUTPUTS)
