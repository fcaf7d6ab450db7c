"""Named inputs and several methods on one evaluator (docs/guide.md, *Named
inputs and methods*): requests checked by input name at the caller, each
method's requests batched with each other and answered with its own
outputs, one set of weights whose version every answer carries."""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import shmeval
from helpers import run_threads

PLANES = ((2, 3), "float32")
MASK = ((4,), "bool")
AZ_OUTPUTS = {"policy": ((4,), "float32"), "value": ((), "float32")}


def masked_az(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A policy over 4 moves, zero where the mask forbids; the planes' sum
    as value."""
    logits = np.broadcast_to(x["planes"].reshape(len(x["planes"]), -1)[:, :1], (len(x["mask"]), 4))
    return {"policy": np.where(x["mask"], logits, 0).astype(np.float32),
            "value": x["planes"].reshape(len(x["planes"]), -1).sum(axis=1)}


def az_input(i: int) -> dict[str, np.ndarray]:
    return {"planes": np.full((2, 3), i, np.float32),
            "mask": np.array([True, i % 2 == 0, False, True])}


def check_az(out: dict[str, np.ndarray], i: int) -> None:
    want = masked_az({k: v[None] for k, v in az_input(i).items()})
    np.testing.assert_array_equal(out["policy"], want["policy"][0])
    assert out["value"] == want["value"][0]


@pytest.mark.timeout(60)
def test_named_inputs_round_trip() -> None:
    with shmeval.Evaluator(masked_az, inputs={"planes": PLANES, "mask": MASK},
                           outputs=AZ_OUTPUTS, max_batch=8) as ev:
        for i in range(3):
            check_az(ev.evaluate(az_input(i)), i)
        many = {k: np.stack([az_input(i)[k] for i in range(5)]) for k in ("planes", "mask")}
        out = ev.evaluate_many(many)
        for i in range(5):
            check_az({k: v[i] for k, v in out.items()}, i)
        p = ev.submit({k: v[:3] for k, v in many.items()})
        assert p.result(timeout=10)["value"].tolist() == [0.0, 6.0, 12.0]
        # Lists and other dtypes are converted, input by input.
        check_az(ev.evaluate({"planes": az_input(4)["planes"].astype(np.float64).tolist(),
                              "mask": az_input(4)["mask"].astype(np.int8) != 0}), 4)


@pytest.mark.timeout(60)
def test_threads_packing_named_inputs_at_once_get_their_own_answers() -> None:
    """One state's request row is packed into a row the method keeps and
    reuses; threads of one process packing at once each get their own
    answers (a thread that finds the row in use packs into a new one), and
    so does a scalar input given as a NumPy scalar."""
    def model(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"s": x["a"].sum(axis=1) * 10 + x["k"]}

    wrong: list[tuple[int, int, float]] = []
    # Two slots for four threads: a thread waits for a slot between its
    # packing and its copy into the slot, and another packs meanwhile.
    with shmeval.Evaluator(model, inputs={"a": ((3,), "float64"), "k": ((), "int64")},
                           outputs={"s": ((), "float64")}, max_batch=8,
                           slots_per_client=2) as ev:
        def worker(t: int) -> None:
            for i in range(300):
                v = float(t * 1000 + i)
                out = ev.evaluate({"a": np.full(3, v), "k": np.int64(i % 7)})
                if out["s"] != 30 * v + i % 7:
                    wrong.append((t, i, float(out["s"])))

        run_threads(worker, 4, timeout=50)
    assert not wrong, f"{len(wrong)} answers of another thread's state, e.g. {wrong[:3]}"


@pytest.mark.timeout(60)
def test_the_model_gets_plain_c_arrays_of_any_rows() -> None:
    """Each named input reaches the model as a C-contiguous array with the
    strides of a fresh one (what torch.from_numpy and the frameworks take),
    one row included, whatever its place in the request row."""
    def model(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for a in x.values():
            assert a.flags.c_contiguous and a.strides == np.empty(a.shape, a.dtype).strides
        return {"s": x["a"].sum(axis=1) + x["b"].sum(axis=1)}

    with shmeval.Evaluator(model, inputs={"a": ((3,), "int8"), "b": ((5,), "float64")},
                           outputs={"s": ((), "float64")}, reject_nonfinite=False) as ev:
        assert ev.evaluate({"a": np.arange(3, dtype=np.int8), "b": np.ones(5)})["s"] == 8
        out = ev.evaluate_many({"a": np.ones((3, 3), np.int8), "b": np.ones((3, 5))})
        assert out["s"].tolist() == [8, 8, 8]
        assert ev.stats()["failed_requests"] == 0


@pytest.mark.timeout(60)
def test_bad_named_inputs_raise_at_the_caller_naming_the_input() -> None:
    """A missing or extra input, a wrong shape or dtype for one input, or
    not a dict: raised at the caller with the input named, and nothing
    reaches the evaluator."""
    with shmeval.Evaluator(masked_az, inputs={"planes": PLANES, "mask": MASK},
                           outputs=AZ_OUTPUTS, max_batch=8) as ev:
        ok = az_input(1)
        cases: list[tuple[Any, type, str]] = [
            ({"planes": ok["planes"]}, ValueError, "missing \\['mask'\\]"),
            ({**ok, "extra": ok["mask"]}, ValueError, "not declared \\['extra'\\]"),
            ({**ok, "mask": np.ones(5, bool)}, ValueError, "input 'mask' has shape"),
            ({**ok, "planes": np.ones((2, 3), "U1")}, TypeError, "input 'planes' has dtype"),
            (ok["planes"], TypeError, "pass a dict"),
        ]
        for x, exc, words in cases:
            with pytest.raises(exc, match=words):
                ev.evaluate(x)
        with pytest.raises(ValueError, match="different numbers of states"):
            ev.evaluate_many({"planes": np.zeros((3, 2, 3), np.float32),
                              "mask": np.zeros((2, 4), bool)})
        with pytest.raises(ValueError, match="method 'initial' is not declared"):
            ev.evaluate(ok, method="initial")
        check_az(ev.evaluate(ok), 1)
        assert ev.stats()["requests"] == 1


class MuZeroLike:
    """Two functions of one weight: initial(obs) and recurrent(hidden,
    action), each recording the methods of the rows it is called with.
    Every output carries the weight that computed it."""

    def __init__(self) -> None:
        self.w = 0.0
        self.calls: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def initial(self, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self.lock:
            self.calls.append(("initial", len(x["obs"])))
        n = len(x["obs"])
        return {"hidden": np.repeat(x["obs"][:, :1], 2, axis=1) + self.w,
                "value": np.full(n, self.w, np.float32)}

    def recurrent(self, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self.lock:
            self.calls.append(("recurrent", len(x["hidden"])))
        n = len(x["hidden"])
        return {"hidden": (x["hidden"] + x["action"][:, None]).astype(np.float32),
                "reward": np.full(n, self.w, np.float64),
                "value": np.full(n, self.w, np.float32)}

    def set_weights(self, weights: list[np.ndarray]) -> None:
        self.w = float(weights[0])

    def get_weights(self) -> list[np.ndarray]:
        return [np.array(self.w, np.float32)]


METHODS = {
    "initial": shmeval.Method(inputs={"obs": ((3,), "float32")},
                              outputs={"hidden": ((2,), "float32"), "value": ((), "float32")}),
    "recurrent": shmeval.Method(inputs={"hidden": ((2,), "float32"), "action": ((), "int64")},
                                outputs={"hidden": ((2,), "float32"), "reward": ((), "float64"),
                                         "value": ((), "float32")}),
}


@pytest.mark.timeout(60)
def test_two_methods_answer_with_their_own_outputs() -> None:
    model = MuZeroLike()
    with shmeval.Evaluator(model, methods=METHODS, max_batch=16) as ev:
        out = ev.evaluate({"obs": np.array([2, 0, 0], np.float32)}, method="initial")
        assert set(out) == {"hidden", "value"}
        np.testing.assert_array_equal(out["hidden"], [2, 2])
        out = ev.evaluate({"hidden": out["hidden"], "action": np.int64(3)}, method="recurrent")
        assert set(out) == {"hidden", "reward", "value"}
        np.testing.assert_array_equal(out["hidden"], [5, 5])
        outs = ev.evaluate_many({"hidden": np.zeros((4, 2), np.float32),
                                 "action": np.arange(4)}, method="recurrent")
        np.testing.assert_array_equal(outs["hidden"][:, 0], [0, 1, 2, 3])
        p = ev.submit({"obs": np.ones((2, 3), np.float32)}, method="initial")
        assert p.result(timeout=10)["hidden"].tolist() == [[1, 1], [1, 1]]
        with pytest.raises(ValueError, match="say which"):
            ev.evaluate({"obs": np.zeros(3, np.float32)})
        with pytest.raises(ValueError, match="method 'dynamics' is not declared"):
            ev.evaluate({"obs": np.zeros(3, np.float32)}, method="dynamics")
        with pytest.raises(ValueError, match="method 'recurrent'.*missing \\['action'\\]"):
            ev.evaluate({"hidden": np.zeros(2, np.float32)}, method="recurrent")


@pytest.mark.timeout(60)
def test_each_call_holds_one_methods_requests_and_neither_starves() -> None:
    """Threads sending both methods at once: every model call is of one
    method, and both keep being served."""
    model = MuZeroLike()
    with shmeval.Evaluator(model, methods=METHODS, max_batch=16, max_wait_us=2000,
                           slots_per_client=16) as ev:
        def worker(i: int) -> None:
            for j in range(30):
                if (i + j) % 2:
                    ev.evaluate({"obs": np.full(3, j, np.float32)}, method="initial")
                else:
                    out = ev.evaluate({"hidden": np.zeros(2, np.float32),
                                       "action": np.int64(j)}, method="recurrent")
                    assert out["hidden"][0] == j

        run_threads(worker, 6, timeout=30)
        rows = {"initial": 0, "recurrent": 0}
        for name, n in model.calls:
            rows[name] += n
        assert rows == {"initial": 90, "recurrent": 90}
        per_method = ev.stats()["methods"]
        for name in rows:
            assert per_method[name]["requests"] == 90
            assert per_method[name]["batches"] == sum(1 for m, _ in model.calls if m == name)


def test_the_methods_limit_is_the_cores() -> None:
    from shmeval import _ring, spec
    assert spec.MAX_METHODS == _ring.MAX_METHODS


@pytest.mark.timeout(60)
def test_a_model_lacking_a_method_fails_at_start_naming_it() -> None:
    with pytest.raises(shmeval.ModelError, match="method 'recurrent'"):
        shmeval.Evaluator({"initial": MuZeroLike().initial}, methods=METHODS)


@pytest.mark.timeout(60)
def test_a_dict_of_callables_serves_the_methods() -> None:
    m = MuZeroLike()
    with shmeval.Evaluator({"initial": m.initial, "recurrent": m.recurrent},
                           methods=METHODS) as ev:
        out = ev.evaluate({"obs": np.array([1, 0, 0], np.float32)}, method="initial")
        assert out["hidden"].tolist() == [1, 1]


@pytest.mark.timeout(120)
def test_weight_pushes_never_split_the_methods() -> None:
    """Weights pushed under load from both methods: every answer's version
    is the version of the weights that computed it, whichever method (the
    weight travels in the outputs: version v is weight v)."""
    model = MuZeroLike()
    stop = threading.Event()
    seen: list[tuple[str, int, float]] = []
    errors: list[BaseException] = []
    with shmeval.Evaluator(model, methods=METHODS, max_batch=16) as ev:
        def worker(i: int) -> None:
            try:
                while not stop.is_set():
                    if i % 2:
                        out, v = ev.evaluate({"obs": np.zeros(3, np.float32)}, True,
                                             method="initial")
                        seen.append(("initial", v, float(out["value"])))
                    else:
                        out, v = ev.evaluate({"hidden": np.zeros(2, np.float32),
                                              "action": np.int64(1)}, True, method="recurrent")
                        seen.append(("recurrent", v, float(out["reward"])))
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for v in range(1, 8):
            time.sleep(0.05)
            assert ev.set_weights([np.array(v, np.float32)]) == v
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    assert {name for name, _, _ in seen} == {"initial", "recurrent"}
    assert len({v for _, v, _ in seen}) > 2  # the load spanned several versions
    assert all(v == w for _, v, w in seen), [s for s in seen if s[1] != s[2]][:5]


@pytest.mark.timeout(60)
def test_the_cache_keeps_each_methods_answers_apart() -> None:
    """The same key (or the same bytes) for two methods never answers one
    with the other's entry."""
    m = MuZeroLike()
    both = {
        "a": shmeval.Method(inputs={"x": ((2,), "float32")}, outputs={"y": ((), "float32")}),
        "b": shmeval.Method(inputs={"x": ((2,), "float32")}, outputs={"y": ((), "float32")}),
    }
    with shmeval.Evaluator({"a": lambda d: {"y": d["x"].sum(axis=1)},
                            "b": lambda d: {"y": -d["x"].sum(axis=1)}},
                           methods=both, cache_entries=64) as ev:
        x = {"x": np.array([1, 2], np.float32)}
        assert ev.evaluate(x, method="a")["y"] == 3
        assert ev.evaluate(x, method="b")["y"] == -3
        assert ev.evaluate(x, key=7, method="a")["y"] == 3
        assert ev.evaluate(x, key=7, method="b")["y"] == -3
        assert ev.evaluate(x, key=7, method="a")["y"] == 3
    del m
