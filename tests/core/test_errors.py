"""Argument errors (client side and constructor) and model errors.

Client side: wrong shapes raise ValueError and impossible dtypes TypeError,
both naming what was expected and what was given; the evaluator never sees
a refused request.  'same_kind' casts, non-contiguous and read-only inputs
are accepted and answered correctly.

Constructor: every bad argument raises ValueError/TypeError naming the
argument, and never leaves a segment behind.

Model errors: a model that raises fails only the requests whose rows raise
(test_row_isolation.py), one that returns outputs that do not fit the spec
the requests of that batch, with shmeval.ModelError carrying the original
text; the evaluator keeps serving.
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import Any, Callable, Iterator

import numpy as np
import pytest

import shmeval
from helpers import (INPUT_SHAPE, OUTPUTS, check_answer, expected, fake_model, make_ev,
                     make_state, own_segments, run_threads, settled_stats)

SHM_DIR = "/dev/shm"


# ---------------------------------------------------------------- helpers

class Recorder:
    """A model wrapper that counts calls and records batch sizes."""

    def __init__(self, model: Callable[[np.ndarray], Any] = fake_model) -> None:
        self.model = model
        self.sizes: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, x: np.ndarray) -> Any:
        with self.lock:
            self.sizes.append(int(x.shape[0]))
        return self.model(x)


def check_many(out: dict[str, np.ndarray], tags: list[int]) -> None:
    n = len(tags)
    assert out["policy"].shape == (n, 7) and out["value"].shape == (n,)
    t = np.array(tags, np.float32)
    np.testing.assert_array_equal(out["policy"], 2 * t[:, None] + np.arange(7, dtype=np.float32))
    np.testing.assert_array_equal(out["value"], -t)


def leaked_by(fn: Callable[[], Any]) -> tuple[BaseException | None, list[str]]:
    """Runs fn, returns (the exception it raised, segments it left behind);
    removes those segments so the conftest guard does not cascade."""
    before = own_segments()
    err: BaseException | None = None
    try:
        obj = fn()
    except BaseException as e:  # noqa: BLE001 - we report whatever it was
        err = e
    else:
        obj.close()
    left = sorted(own_segments() - before)
    for entry in left:
        os.unlink(os.path.join(SHM_DIR, entry))
    return err, left


@pytest.fixture
def ev() -> Iterator[shmeval.Evaluator]:
    model = Recorder()
    with make_ev(model) as e:
        e.recorder = model  # type: ignore[attr-defined]
        yield e


# ================================================================ client side

@pytest.mark.timeout(30)
@pytest.mark.parametrize("shape", [(6, 7), (6, 7, 3), (2, 7, 6), (1, 6, 7, 2), (), (84,)])
def test_evaluate_wrong_shape(ev: shmeval.Evaluator, shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError) as ei:
        ev.evaluate(np.zeros(shape, np.float32))
    msg = str(ei.value)
    assert str(shape) in msg, msg                # the given shape
    assert str(INPUT_SHAPE) in msg, msg          # the expected shape
    assert ev.recorder.sizes == []               # type: ignore[attr-defined]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("shape", [(3, 6, 7), (3, 6, 7, 3), (6, 7, 2), (3, 2, 7, 6), (0,), (3, 84)])
def test_evaluate_many_wrong_shape(ev: shmeval.Evaluator, shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError) as ei:
        ev.evaluate_many(np.zeros(shape, np.float32))
    msg = str(ei.value)
    assert str(shape) in msg, msg
    assert "6, 7, 2" in msg, msg                 # expected (n, 6, 7, 2)
    assert ev.recorder.sizes == []               # type: ignore[attr-defined]


def _impossible_inputs() -> list[Any]:
    cases = [
        pytest.param(np.full(INPUT_SHAPE, 1 + 2j), "complex128", id="complex128"),
        pytest.param(np.full(INPUT_SHAPE, 1 + 2j, np.complex64), "complex64", id="complex64"),
        pytest.param(np.full(INPUT_SHAPE, "x"), "<U1", id="str"),
        pytest.param(np.full(INPUT_SHAPE, b"x"), "|S1", id="bytes"),
        pytest.param(np.full(INPUT_SHAPE, 1.0, object), "object", id="object-array"),
        pytest.param([[[object()] * 2] * 7] * 6, "object", id="list-of-objects"),
        pytest.param([[[None] * 2] * 7] * 6, "object", id="list-of-None"),
        pytest.param(np.zeros(INPUT_SHAPE, "datetime64[ns]"), "datetime64", id="datetime"),
        pytest.param(np.zeros(INPUT_SHAPE, [("a", "f4")]), "('a', '<f4')", id="structured"),
    ]
    return cases


@pytest.mark.timeout(30)
@pytest.mark.parametrize("x, given", _impossible_inputs())
def test_impossible_dtype_refused_at_client(ev: shmeval.Evaluator, x: Any, given: str) -> None:
    with pytest.raises(TypeError) as ei:
        ev.evaluate(x)
    msg = str(ei.value)
    assert given in msg and "float32" in msg, msg
    batch = np.asarray(x)[None].repeat(3, axis=0)
    with pytest.raises(TypeError) as ei:
        ev.evaluate_many(batch)
    msg = str(ei.value)
    assert given in msg and "float32" in msg, msg
    # The evaluator never saw any of it, and still serves.
    check_answer(ev.evaluate(make_state(5)), 5)
    assert ev.recorder.sizes == [1]              # type: ignore[attr-defined]
    settled_stats(ev, "requests", 1)


@pytest.mark.timeout(30)
def test_float_refused_by_int_input() -> None:
    """same_kind refuses float -> int: the message names both dtypes."""
    def model(x: np.ndarray) -> dict[str, np.ndarray]:
        return {"s": x.sum(axis=1)}

    with make_ev(model, input_shape=(3,), input_dtype="int32", outputs={"s": ((), "int64")}) as e:
        with pytest.raises(TypeError) as ei:
            e.evaluate(np.array([1.0, 2.0, 3.0]))
        assert "float64" in str(ei.value) and "int32" in str(ei.value)
        with pytest.raises(TypeError):
            e.evaluate_many(np.ones((2, 3), np.float32))
        # int64 -> int32 is same_kind; bool -> int32 is safe.
        assert int(e.evaluate(np.array([1, 2, 3], np.int64))["s"]) == 6
        assert int(e.evaluate(np.array([True, True, False]))["s"]) == 2
        np.testing.assert_array_equal(e.evaluate_many(np.arange(6, dtype=np.int64)
                                                      .reshape(2, 3))["s"], [3, 12])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", ["float64", "float16", "int32", "int64", "uint8", "int8",
                                   ">f4", ">f8", ">i4"])
def test_same_kind_casts_accepted(ev: shmeval.Evaluator, dtype: str) -> None:
    tag = 7
    s = make_state(tag)
    if np.dtype(dtype).kind == "u":
        s = np.abs(s)
        out = ev.evaluate(s.astype(dtype))
        np.testing.assert_array_equal(out["policy"], expected(tag)[0])
        assert float(out["value"]) == tag
        return
    check_answer(ev.evaluate(s.astype(dtype)), tag)
    tags = [1, -2, 3, 100]
    check_many(ev.evaluate_many(np.stack([make_state(t) for t in tags]).astype(dtype)), tags)


@pytest.mark.timeout(30)
def test_python_lists_accepted(ev: shmeval.Evaluator) -> None:
    check_answer(ev.evaluate(make_state(9).tolist()), 9)          # floats
    check_answer(ev.evaluate(make_state(9).astype(int).tolist()), 9)  # ints
    check_many(ev.evaluate_many([make_state(t).tolist() for t in (1, 2)]), [1, 2])


@pytest.mark.timeout(30)
def test_non_contiguous_and_read_only(ev: shmeval.Evaluator) -> None:
    # Every second element of the last axis.
    wide = np.zeros((6, 7, 4), np.float32)
    wide[..., ::2] = make_state(11)
    assert not wide[..., ::2].flags.c_contiguous
    check_answer(ev.evaluate(wide[..., ::2]), 11)
    # Fortran order.
    f = np.asfortranarray(make_state(12))
    assert not f.flags.c_contiguous
    check_answer(ev.evaluate(f), 12)
    # A transposed view of the right shape.
    t = np.ascontiguousarray(make_state(13).transpose(2, 1, 0)).transpose(2, 1, 0)
    assert not t.flags.c_contiguous
    check_answer(ev.evaluate(t), 13)
    # Read-only.
    ro = make_state(14)
    ro.setflags(write=False)
    check_answer(ev.evaluate(ro), 14)
    # Every second row of a batch, read-only and float64 (cast + copy).
    tags = list(range(20, 40))
    batch = np.stack([make_state(t) for t in tags]).astype(np.float64)
    batch.setflags(write=False)
    check_many(ev.evaluate_many(batch[::2]), tags[::2])
    # A broadcast (zero-stride) array.
    b = np.broadcast_to(make_state(15), (5,) + INPUT_SHAPE)
    check_many(ev.evaluate_many(b), [15] * 5)
    # The caller's arrays are not modified.
    np.testing.assert_array_equal(ro, make_state(14))


@pytest.mark.timeout(30)
def test_evaluate_many_zero_rows(ev: shmeval.Evaluator) -> None:
    out = ev.evaluate_many(np.zeros((0,) + INPUT_SHAPE, np.float32))
    assert set(out) == {"policy", "value"}
    assert out["policy"].shape == (0, 7) and out["policy"].dtype == np.float32
    assert out["value"].shape == (0,) and out["value"].dtype == np.float32
    out = ev.evaluate_many(np.zeros((0,) + INPUT_SHAPE, np.float64))
    assert out["policy"].shape == (0, 7)
    assert ev.recorder.sizes == []               # type: ignore[attr-defined]


@pytest.mark.timeout(30)
def test_evaluate_many_more_rows_than_slots() -> None:
    model = Recorder()
    with make_ev(model, slots_per_client=4, max_batch=8) as e:
        tags = list(range(1000, 1100))
        check_many(e.evaluate_many(np.stack([make_state(t) for t in tags])), tags)
        settled_stats(e, "requests", 100)
        assert max(model.sizes) <= 4              # never more than K in flight
        assert sum(model.sizes) == 100
        # The slots all came back: single requests still work.
        for t in range(5):
            check_answer(e.evaluate(make_state(t)), t)


# ================================================================ constructor

def _ctor_error(exc: Any, words: tuple[str, ...], **kw: Any) -> None:
    err, left = leaked_by(lambda: make_ev(fake_model, **kw))
    assert not left, f"leaked {left}"
    assert isinstance(err, exc), repr(err)
    msg = str(err)
    for w in words:
        assert w in msg, (w, msg)




@pytest.mark.timeout(30)
@pytest.mark.parametrize("shape, exc", [
    ((-1, 3), ValueError),
    ((6, -7, 2), ValueError),
    ((0,), ValueError),
    ((6, 0, 2), ValueError),
    (None, TypeError),
    (object(), TypeError),
    pytest.param(("a", 2), (TypeError, ValueError)),
    pytest.param((10**30,), (TypeError, ValueError)),
    pytest.param((2.5, 3), (TypeError, ValueError)),
])
def test_bad_input_shape(shape: Any, exc: Any) -> None:
    _ctor_error(exc, ("input_shape",), input_shape=shape)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [object, "O", str, "U5", "S3", "V8", [("a", "f4")],
                                   "floaty", "M8[ns]x"])
def test_bad_input_dtype(dtype: Any) -> None:
    _ctor_error(TypeError, ("input_dtype",), input_dtype=dtype)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("outputs, exc, word", [
    ({}, (TypeError, ValueError), "outputs"),
    (None, (TypeError, ValueError), "outputs"),
    ([("p", ((7,), "float32"))], (TypeError, ValueError), "outputs"),
    ({"p": (7,)}, TypeError, "outputs['p']"),
    ({"p": ((7,), "float32", 1)}, TypeError, "outputs['p']"),
    ({"p": ((7,), object)}, TypeError, "outputs['p']"),
    ({"p": ((7,), "U3")}, TypeError, "outputs['p']"),
    ({"p": ((-7,), "float32")}, ValueError, "outputs['p']"),
    ({"": ((7,), "float32")}, TypeError, "output names"),
    ({3: ((7,), "float32")}, TypeError, "output names"),
])
def test_bad_outputs(outputs: Any, exc: Any, word: str) -> None:
    err, left = leaked_by(lambda: make_ev(fake_model, outputs=outputs))
    assert not left
    assert isinstance(err, exc), repr(err)
    assert word in str(err), str(err)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name, value, exc", [
    ("max_batch", 0, ValueError), ("max_batch", -1, ValueError),
    ("max_batch", 10**6, ValueError), ("max_batch", 2**40, ValueError),
    ("max_batch", 2.0, TypeError), ("max_batch", "8", TypeError), ("max_batch", None, TypeError),
    ("max_batch", True, TypeError),
    ("max_clients", 0, ValueError), ("max_clients", 10**5, ValueError),
    ("slots_per_client", 0, ValueError), ("slots_per_client", 65, ValueError),
    ("slots_per_client", 1.5, TypeError),
])
def test_bad_capacities(name: str, value: Any, exc: type) -> None:
    _ctor_error(exc, (name,), **{name: value})


@pytest.mark.timeout(30)
@pytest.mark.parametrize("buckets, exc, word", [
    ("pow3", ValueError, "buckets"),
    ("", ValueError, "buckets"),
    ([], ValueError, "buckets"),
    ([0, 4, 32], ValueError, "buckets"),
    ([-4, 32], ValueError, "buckets"),
    ([4, 8], ValueError, "max_batch"),   # largest bucket < max_batch (32)
    (["a", 32], TypeError, "buckets"),
    (5, TypeError, "buckets"),
    ([None], TypeError, "buckets"),
])
def test_bad_buckets(buckets: Any, exc: type, word: str) -> None:
    _ctor_error(exc, (word,), buckets=buckets)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["max_wait_us", "evaluator_spin_us"])
def test_negative_times(name: str) -> None:
    _ctor_error(ValueError, (name, "-1"), **{name: -1})


@pytest.mark.timeout(30)
def test_negative_client_spin_does_not_leak() -> None:
    _ctor_error(ValueError, ("spin_us",), spin_us=-1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["spin_us", "evaluator_spin_us"])
def test_spin_budgets_have_a_ceiling(name: str) -> None:
    """A second at most: a budget in ns beyond 2**63 would set ring.h's
    yielding-spin flag and spin for whatever bits are left."""
    _ctor_error(ValueError, (name, "1e+06"), **{name: 1e13})
    _ctor_error(ValueError, (name,), **{name: float("nan")})


@pytest.mark.timeout(30)
def test_negative_client_spin_does_not_leak_spawn() -> None:
    from helpers import fake_factory
    err, left = leaked_by(lambda: shmeval.Evaluator.spawn(
        fake_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS, spin_us=-1))
    assert isinstance(err, ValueError), repr(err)
    assert not left, f"leaked {left}"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("model", [None, 3, "model", np.zeros(3)])
def test_model_not_callable(model: Any) -> None:
    err, left = leaked_by(lambda: shmeval.Evaluator(model, input_shape=INPUT_SHAPE,
                                                    outputs=OUTPUTS))
    assert not left
    assert isinstance(err, TypeError) and "callable" in str(err), repr(err)
    err, left = leaked_by(lambda: shmeval.Evaluator.spawn(model, input_shape=INPUT_SHAPE,
                                                          outputs=OUTPUTS))
    assert not left
    assert isinstance(err, TypeError) and "callable" in str(err), repr(err)


@pytest.mark.timeout(30)
def test_spec_too_large_for_header() -> None:
    outputs = {f"output_with_a_long_name_{i:04d}": ((1,), "float32") for i in range(300)}
    err, left = leaked_by(lambda: make_ev(fake_model, outputs=outputs))
    assert not left
    assert isinstance(err, ValueError) and "spec" in str(err), repr(err)


@pytest.mark.timeout(30)
def test_same_name_twice() -> None:
    name = f"/shmeval-{os.getpid()}-named{os.urandom(4).hex()}"
    with make_ev(name=name) as a:
        assert a.address == name
        err, left = leaked_by(lambda: make_ev(name=name))
        assert isinstance(err, shmeval.SegmentError) and "exists" in str(err), repr(err)
        assert not left
        check_answer(a.evaluate(make_state(1)), 1)   # the first is untouched
    assert not os.path.exists(SHM_DIR + name)


# ================================================================ model errors

class Boom(Exception):
    pass


def poisoned_model(x: np.ndarray) -> dict[str, np.ndarray]:
    """fake_model, except that a batch holding a state with tag 666 raises."""
    if (x[:, 0, 0, 0] == 666).any():
        raise Boom("poisoned state 666 in the batch")
    return fake_model(x)


@pytest.mark.timeout(30)
def test_model_exception_fails_only_that_batch() -> None:
    with make_ev(poisoned_model) as e:
        check_answer(e.evaluate(make_state(1)), 1)
        with pytest.raises(shmeval.ModelError) as ei:
            e.evaluate(make_state(666))
        err = ei.value
        assert isinstance(err, shmeval.ShmevalError)
        assert "Boom" in str(err) and "poisoned state 666 in the batch" in str(err)
        assert "Boom" in err.message and "poisoned state 666" in err.message
        # The evaluator keeps serving, with correct answers.
        for t in range(2, 12):
            check_answer(e.evaluate(make_state(t)), t)
        with pytest.raises(shmeval.ModelError):
            e.evaluate_many(np.stack([make_state(t) for t in (3, 666, 4)]))
        check_many(e.evaluate_many(np.stack([make_state(t) for t in range(20)])), list(range(20)))
        s = settled_stats(e, "requests", 1 + 1 + 10 + 3 + 20)
        # Only the two poisoned rows failed; 3 and 4 were answered.
        assert s["failed_requests"] == 2 and s["failed_batches"] >= 1
        assert s["state"] == "serving"


@pytest.mark.timeout(30)
def test_model_exception_from_many_threads() -> None:
    """Concurrent requests: the poisoned ones fail, every other one is answered
    with its own result (a batch that raises is split to find them)."""
    errors: list[str] = []
    outcome = {"ok": 0, "model_error": 0, "poisoned_ok": 0}
    lock = threading.Lock()
    with make_ev(poisoned_model) as e:
        def run(th: int) -> None:
            for j in range(60):
                tag = 666 if j % 10 == 3 else th * 1000 + j
                try:
                    out = e.evaluate(make_state(tag))
                except shmeval.ModelError as err:
                    with lock:
                        outcome["model_error"] += 1
                    if "poisoned" not in str(err):
                        errors.append(str(err))
                    continue
                with lock:
                    if tag == 666:
                        outcome["poisoned_ok"] += 1
                    outcome["ok"] += 1
                if float(out["value"]) != -tag:
                    errors.append(f"tag {tag}: {out}")

        run_threads(run, 4, 20)
        assert not errors, errors[:3]
        assert outcome["poisoned_ok"] == 0
        assert outcome["model_error"] == 24   # every poisoned request, and only those
        assert outcome["ok"] + outcome["model_error"] == 240
        check_answer(e.evaluate(make_state(5)), 5)


def _bad_outputs() -> list[Any]:
    def f(v: Callable[[np.ndarray], Any], *words: str, id: str) -> Any:
        return pytest.param(v, words, id=id)
    good = fake_model
    return [
        f(lambda x: {"policy": np.zeros((len(x), 6), np.float32), "value": good(x)["value"]},
          "policy", "(1, 6)", "(1, 7)", id="wrong-shape"),
        f(lambda x: {"policy": np.zeros((len(x), 7, 2), np.float32), "value": good(x)["value"]},
          "policy", "7 values per row", id="extra-dim"),
        f(lambda x: {k: v[:-1] for k, v in good(x).items()}, "(0, 7)", id="too-few-rows"),
        f(lambda x: {k: np.concatenate([v, v]) for k, v in good(x).items()}, "(2, 7)",
          id="too-many-rows"),
        f(lambda x: {"policy": good(x)["policy"]}, "value", id="missing-key"),
        f(lambda x: {"Policy": good(x)["policy"], "value": good(x)["value"]}, "policy",
          id="misspelt-key"),
        f(lambda x: (good(x)["policy"],), "1 outputs", "expected 2", id="tuple-too-short"),
        f(lambda x: (good(x)["policy"], good(x)["value"], good(x)["value"]), "3 outputs",
          id="tuple-too-long"),
        f(lambda x: good(x)["policy"], "expected a dict or tuple", id="one-array-for-two"),
        f(lambda x: None, "NoneType", id="none"),
        f(lambda x: {"policy": good(x)["policy"] + 1j, "value": good(x)["value"]},
          "complex64", "float32", id="complex"),
        f(lambda x: {"policy": good(x)["policy"].astype(object), "value": good(x)["value"]},
          "object", id="object-dtype"),
        f(lambda x: {"policy": np.array([["a"] * 7] * len(x)), "value": good(x)["value"]},
          "policy", id="str-dtype"),
        f(lambda x: {"policy": good(x)["policy"] * np.nan, "value": good(x)["value"]},
          "NaN", "policy", id="nan"),
        f(lambda x: {"policy": good(x)["policy"], "value": good(x)["value"] + np.inf},
          "NaN or infinite", "value", id="inf"),
        f(lambda x: {"policy": good(x)["policy"].astype(np.float64) - np.inf,
                     "value": good(x)["value"]}, "infinite", id="minus-inf-float64"),
    ]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad, words", _bad_outputs())
def test_bad_model_outputs(bad: Callable[[np.ndarray], Any], words: tuple[str, ...]) -> None:
    """A model whose output does not fit the spec fails the batch (ModelError
    saying what is wrong), and the next request is served."""
    mode = {"bad": True}

    def model(x: np.ndarray) -> Any:
        return bad(x) if mode["bad"] else fake_model(x)

    with make_ev(model) as e:
        with pytest.raises(shmeval.ModelError) as ei:
            e.evaluate(make_state(3))
        for w in words:
            assert w in str(ei.value), (w, str(ei.value))
        with pytest.raises(shmeval.ModelError):
            e.evaluate_many(np.stack([make_state(t) for t in (1, 2)]))
        mode["bad"] = False
        check_answer(e.evaluate(make_state(4)), 4)
        check_many(e.evaluate_many(np.stack([make_state(t) for t in (5, 6, 7)])), [5, 6, 7])


@pytest.mark.timeout(30)
def test_nonfinite_float16_output_rejected() -> None:
    """float16 outputs take the NumPy path of the finiteness check."""
    def model(x: np.ndarray) -> Any:
        v = x[:, 5, 6, 1].astype(np.float16)
        v[x[:, 0, 0, 0] == 13] = np.nan
        return v

    with make_ev(model, outputs={"value": ((), "float16")}) as e:
        assert float(e.evaluate(make_state(12))["value"]) == -12
        with pytest.raises(shmeval.ModelError, match="NaN"):
            e.evaluate(make_state(13))
        assert float(e.evaluate(make_state(14))["value"]) == -14


@pytest.mark.timeout(30)
def test_reject_nonfinite_false_passes_nan_through() -> None:
    def model(x: np.ndarray) -> Any:
        out = fake_model(x)
        out["value"][x[:, 0, 0, 0] == 13] = np.nan
        out["policy"][x[:, 0, 0, 0] == 14] = np.inf
        return out

    with make_ev(model, reject_nonfinite=False) as e:
        assert np.isnan(e.evaluate(make_state(13))["value"])
        assert np.isinf(e.evaluate(make_state(14))["policy"]).all()
        many = e.evaluate_many(np.stack([make_state(t) for t in (12, 13, 15)]))
        assert many["value"][0] == -12 and np.isnan(many["value"][1]) and many["value"][2] == -15
        assert settled_stats(e, "requests", 5)["failed_requests"] == 0


@pytest.mark.timeout(30)
def test_nan_in_padding_rows_is_not_rejected() -> None:
    """Only the real rows of a padded batch are checked: a model that returns
    NaN for the (all-zero) padding rows is fine."""
    sizes: list[int] = []

    def model(x: np.ndarray) -> Any:
        sizes.append(len(x))
        out = fake_model(x)
        pad = ~x.reshape(len(x), -1).any(axis=1)
        out["policy"][pad] = np.nan
        out["value"][pad] = np.nan
        return out

    with make_ev(model, buckets=[4, 32]) as e:
        for t in range(1, 6):
            check_answer(e.evaluate(make_state(t)), t)
        assert sizes and all(s == 4 for s in sizes)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["tuple", "list", "dict-with-extra-keys", "float64", "int64-to-float"])
def test_model_output_forms(kind: str) -> None:
    def model(x: np.ndarray) -> Any:
        out = fake_model(x)
        if kind == "tuple":
            return out["policy"], out["value"]
        if kind == "list":
            return [out["policy"], out["value"]]
        if kind == "dict-with-extra-keys":
            return {"junk": None, **out, "more": np.zeros(3)}
        if kind == "float64":
            return {k: v.astype(np.float64) for k, v in out.items()}
        return {k: v.astype(np.int64) for k, v in out.items()}   # same_kind int -> float

    with make_ev(model) as e, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        check_answer(e.evaluate(make_state(8)), 8)
        check_many(e.evaluate_many(np.stack([make_state(t) for t in (1, 2, 3)])), [1, 2, 3])
    dropped = [str(w.message) for w in warned if "not declared" in str(w.message)]
    assert len(dropped) == (kind == "dict-with-extra-keys"), dropped


@pytest.mark.timeout(30)
def test_single_array_output() -> None:
    with make_ev(lambda x: x[:, 5, 6, 1], outputs={"value": ((), "float64")}) as e:
        out = e.evaluate(make_state(4))
        assert set(out) == {"value"} and out["value"].dtype == np.float64
        assert float(out["value"]) == -4
    with make_ev(lambda x: x[:, 0, :, 0].astype(np.int64), input_dtype="int32",
                 outputs={"row": ((7,), "int32")}) as e:
        s = np.zeros(INPUT_SHAPE, np.int32)
        s[0, :, 0] = np.arange(7) * 3
        out = e.evaluate(s)
        assert out["row"].dtype == np.int32
        np.testing.assert_array_equal(out["row"], np.arange(7) * 3)




@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [">f4", ">f8"])
def test_nonfinite_big_endian_output_rejected(dtype: str) -> None:
    def model(x: np.ndarray) -> Any:
        v = x[:, 0].astype(np.float64)
        v[x[:, 1] == 1] = np.nan
        return v

    with make_ev(model, input_shape=(2,), outputs={"v": ((), dtype)}) as e:
        assert float(e.evaluate([5, 0])["v"]) == 5.0
        with pytest.raises(shmeval.ModelError, match="NaN"):
            e.evaluate([5, 1])


@pytest.mark.timeout(30)
def test_finite_big_endian_output_accepted() -> None:
    # Finite as big-endian float32, but its bytes read little-endian are inf/NaN.
    finite = np.frombuffer(bytes([0x12, 0x34, 0x80, 0x7F]), ">f4")[0]
    assert np.isfinite(finite)

    def model(x: np.ndarray) -> Any:
        return np.full(len(x), finite, ">f4")

    with make_ev(model, input_shape=(2,), outputs={"v": ((), ">f4")}) as e:
        assert e.evaluate([0, 0])["v"] == finite


@pytest.mark.timeout(30)
def test_scalar_input_and_empty_output() -> None:
    """input_shape () and an output with no elements."""
    def model(x: np.ndarray) -> Any:
        return {"e": np.zeros((len(x), 0), np.float32), "v": x * 2}

    with make_ev(model, input_shape=(), outputs={"e": ((0,), "float32"), "v": ((), "float32")}) as e:
        out = e.evaluate(3.0)
        assert out["e"].shape == (0,) and float(out["v"]) == 6.0
        assert float(e.evaluate(np.float32(2))["v"]) == 4.0
        many = e.evaluate_many([1, 2, 3])
        assert many["e"].shape == (3, 0)
        np.testing.assert_array_equal(many["v"], [2, 4, 6])
        with pytest.raises(ValueError):
            e.evaluate([1, 2])
        with pytest.raises(ValueError):
            e.evaluate_many(np.zeros((2, 2)))


@pytest.mark.timeout(30)
def test_bool_output() -> None:
    with make_ev(lambda x: x[:, 0] > 0, input_shape=(2,), outputs={"b": ((), "bool")}) as e:
        assert bool(e.evaluate([1, 0])["b"]) is True
        np.testing.assert_array_equal(e.evaluate_many([[1, 0], [-1, 0]])["b"], [True, False])
    # int -> bool is not same_kind.
    with make_ev(lambda x: x[:, 0].astype(np.int64), input_shape=(2,),
                 outputs={"b": ((), "bool")}) as e:
        with pytest.raises(shmeval.ModelError, match="bool"):
            e.evaluate([1, 0])


@pytest.mark.timeout(30)
def test_float_output_refused_for_int_output() -> None:
    with make_ev(lambda x: x[:, 0, :, 0] + 0.5, outputs={"row": ((7,), "int32")}) as e:
        with pytest.raises(shmeval.ModelError) as ei:
            e.evaluate(make_state(1))
        assert "float32" in str(ei.value) and "int32" in str(ei.value)


@pytest.mark.timeout(30)
def test_model_error_subclass_passes_through() -> None:
    def model(x: np.ndarray) -> Any:
        raise shmeval.ModelError("my own words")

    with make_ev(model) as e:
        with pytest.raises(shmeval.ModelError) as ei:
            e.evaluate(make_state(1))
        assert ei.value.message == "my own words"


@pytest.mark.timeout(30)
def test_long_and_non_ascii_model_error_message() -> None:
    """The error text travels in the slot's output area: a long message is cut
    (never overflows), a non-ASCII one survives, a cut in the middle of a
    UTF-8 sequence does not break decoding."""
    msgs = {1: "é" * 5000, 2: "日本語のエラー", 3: "x" * 100_000, 4: "a" + "é" * 2000}

    def model(x: np.ndarray) -> Any:
        raise RuntimeError(msgs[int(x[0, 0, 0, 0])])

    with make_ev(model) as e:
        for k, m in msgs.items():
            with pytest.raises(shmeval.ModelError) as ei:
                e.evaluate(make_state(k))
            got = str(ei.value)
            assert got.startswith("RuntimeError: " + m[:50]), got[:80]
    # A short message is preserved exactly.
    def key_error(x: np.ndarray) -> Any:
        raise KeyError("clé manquante")

    with make_ev(key_error) as e:
        with pytest.raises(shmeval.ModelError) as ei:
            e.evaluate(make_state(1))
        assert ei.value.message.startswith("KeyError: 'clé manquante'\n\nWhere it was raised")
        assert "in key_error" in ei.value.message


# ================================================================ hierarchy

def test_exception_hierarchy() -> None:
    names = ["SegmentError", "ClientTableFull", "EvaluatorClosed", "EvaluatorDied", "ModelError"]
    for n in names:
        cls = getattr(shmeval, n)
        assert issubclass(cls, shmeval.ShmevalError), n
        assert n in shmeval.__all__
    assert issubclass(shmeval.ShmevalError, Exception)
    # Argument errors are *not* ShmevalErrors.
    assert not issubclass(shmeval.ShmevalError, (ValueError, TypeError))
    assert "ShmevalError" in shmeval.__all__
