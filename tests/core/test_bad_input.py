"""Property-based bad-input tests (hypothesis) against module-scoped evaluators.

Every input a worker may hand to ``evaluate`` / ``evaluate_many`` -- random
shapes, every NumPy dtype family, object arrays, non-contiguous, transposed,
negatively strided and read-only views, 0 and many more rows than the
client has slots, NaN/inf, Python lists, scalars and None -- gets one of:

* a ``ValueError`` (shape) or ``TypeError`` (dtype) whose message names the
  expected and the given shape or dtype, raised at the client; or
* the correct answer: the fake model computed directly on the input cast to
  the declared dtype (the cast NumPy's ``same_kind`` rule allows).

The oracle is written from the documented contract (numeric kinds b/i/u/f
are accepted into a float input, b/i/u into an int input, everything else is
refused), not from the client's code.  After every example the evaluator is
unaffected: a known state still gets its answer, ``stats()`` counts exactly
the rows that were accepted (a refused request never reaches the evaluator)
and no failed request, and every slot of the client is free again.

Examples are derandomized, so CI runs the same ones every time.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import shmeval
from helpers import INPUT_SHAPE, OUTPUTS, check_answer, fake_model, make_ev, make_state

# The fake model doubles inputs: float32 values near the largest overflow to
# inf there (and in the expected values), which is the correct answer.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

K = 4                          # slots_per_client of the module's evaluators
FLOAT_OK = "biuf"              # kinds a float32 input accepts (same_kind)
INT_OK = "biu"                 # kinds an int32 input accepts


def hyp(n: int) -> settings:
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


# ---------------------------------------------------------------- evaluators

class Served:
    """A module-scoped evaluator and the bookkeeping that proves it is
    unaffected: `sent` counts every row the evaluator should have seen."""

    def __init__(self, ev: shmeval.Evaluator, known: Callable[["Served"], None]) -> None:
        self.ev = ev
        self.sent = 0
        self.tag = 0
        self._known = known

    def check_unaffected(self) -> None:
        self._known(self)
        self.sent += 1
        s = self.ev.stats()
        assert s["requests"] == self.sent, (s["requests"], self.sent)  # nothing refused got in
        assert s["failed_requests"] == 0 and s["failed_batches"] == 0, s
        assert s["state"] == "serving", s
        port = self.ev._port
        assert sorted(port.free) == list(range(K)), port.free  # every slot came back
        assert not port.abandoned


def _known_float(sv: Served) -> None:
    sv.tag += 1
    check_answer(sv.ev.evaluate(make_state(sv.tag)), sv.tag)


def int_model(x: np.ndarray) -> dict[str, np.ndarray]:
    return {"s": x.astype(np.int64).sum(axis=1), "x": x.copy()}


def _known_int(sv: Served) -> None:
    sv.tag += 1
    out = sv.ev.evaluate(np.array([sv.tag, 1, -2], np.int32))
    assert int(out["s"]) == sv.tag - 1 and out["x"].tolist() == [sv.tag, 1, -2]


@pytest.fixture(scope="module")
def fsv() -> Iterator[Served]:
    """float32 (6, 7, 2) input, the fake model; NaN/inf outputs are passed
    through (reject_nonfinite=False) so that NaN/inf inputs have a correct
    answer to compare with (the default is tested in test_nan_input_*)."""
    with make_ev(fake_model, slots_per_client=K, max_batch=16, max_clients=4,
                 reject_nonfinite=False) as ev:
        yield Served(ev, _known_float)


@pytest.fixture(scope="module")
def isv() -> Iterator[Served]:
    """int32 (3,) input: float must be refused, ints cast (same_kind)."""
    with make_ev(int_model, input_shape=(3,), input_dtype="int32",
                 outputs={"s": ((), "int64"), "x": ((3,), "int32")},
                 slots_per_client=K, max_batch=16, max_clients=4) as ev:
        yield Served(ev, _known_int)


# ---------------------------------------------------------------- oracle

def cast(x: np.ndarray, dtype: Any) -> np.ndarray:
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.array(x, dtype=dtype)        # a C-contiguous copy


def call(sv: Served, many: bool, x: Any) -> tuple[str, Any]:
    """('ok', outputs) or ('refused', exception); any other exception (a
    ShmevalError, MemoryError, SystemError...) propagates and fails the test."""
    fn = sv.ev.evaluate_many if many else sv.ev.evaluate
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # overflow in an allowed cast
            return "ok", fn(x)
    except (ValueError, TypeError) as e:
        return "refused", e


def shape_text(shape: tuple[int, ...], many: bool) -> str:
    """How the client writes the expected shape: (6, 7, 2) or (n, 6, 7, 2)."""
    if not many:
        return str(shape)
    inner = ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "")
    return f"(n, {inner})"


def check_outcome(sv: Served, many: bool, x: Any, input_shape: tuple[int, ...],
                  input_dtype: str, ok_kinds: str,
                  model: Callable[[np.ndarray], dict[str, np.ndarray]]) -> str:
    """Runs one bad-or-good input and checks it against the contract; returns
    'ok' or 'refused'."""
    a = np.asarray(x)
    want_shape = a.ndim == len(input_shape) + 1 and a.shape[1:] == input_shape \
        if many else a.shape == input_shape
    want_dtype = a.dtype.kind in ok_kinds and not a.dtype.hasobject and a.dtype.fields is None
    before = a.copy() if isinstance(x, np.ndarray) else None
    kind, r = call(sv, many, x)
    if before is not None:     # the caller's array is never written (NaT != NaT: bytes)
        assert np.asarray(x).tobytes() == before.tobytes()
    if want_shape and want_dtype:
        assert kind == "ok", f"{a.dtype} {a.shape} refused: {r!r}"
        expected = model(cast(a if many else a[None], input_dtype))
        assert set(r) == set(expected)
        for name, e in expected.items():
            got = r[name]
            if not many:
                e = e[0]
            assert got.shape == e.shape and got.dtype == e.dtype, (name, got.shape, got.dtype)
            np.testing.assert_array_equal(got, e)
        sv.sent += a.shape[0] if many else 1
        return "ok"
    assert kind == "refused", f"{a.dtype} {a.shape} was answered: {r}"
    msg = str(r)
    if isinstance(r, TypeError):
        assert not want_dtype, f"a good dtype {a.dtype} refused: {msg}"
        assert str(a.dtype) in msg and input_dtype in msg, msg
    else:
        assert not want_shape, f"a good shape {a.shape} refused: {msg}"
        assert str(a.shape) in msg and shape_text(input_shape, many) in msg, msg
    return "refused"


# ---------------------------------------------------------------- strategies

@st.composite
def near_miss(draw: st.DrawFn, base: tuple[int, ...]) -> tuple[int, ...]:
    """base with one or two small mistakes: a dim dropped, added, resized,
    or the dims permuted."""
    shape = list(base)
    for _ in range(draw(st.integers(1, 2))):
        op = draw(st.sampled_from(["drop", "add", "resize", "permute"]))
        if op == "drop" and shape:
            del shape[draw(st.integers(0, len(shape) - 1))]
        elif op == "add":
            shape.insert(draw(st.integers(0, len(shape))), draw(st.integers(0, 3)))
        elif op == "resize" and shape:
            i = draw(st.integers(0, len(shape) - 1))
            shape[i] = max(0, shape[i] + draw(st.sampled_from([-1, 1, 2])))
        else:
            shape = draw(st.permutations(shape))
    return tuple(shape)


def shapes(many: bool) -> st.SearchStrategy[tuple[int, ...]]:
    good = (3,) + INPUT_SHAPE if many else INPUT_SHAPE
    return st.one_of(hnp.array_shapes(min_dims=0, max_dims=6, min_side=0, max_side=8),
                     near_miss(good), st.just(good))


def tagged(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Small distinct integers, exact in every numeric dtype used here."""
    return (np.arange(int(np.prod(shape)), dtype=np.int64) % 97 - 40).reshape(shape).astype(dtype)


ALL_DTYPES = st.one_of(
    hnp.scalar_dtypes(),                                    # bool, ints, floats, complex, M8, m8
    hnp.integer_dtypes(endianness="?"), hnp.unsigned_integer_dtypes(endianness="?"),
    hnp.floating_dtypes(endianness="?", sizes=(16, 32, 64)),
    hnp.complex_number_dtypes(endianness="?"),
    hnp.byte_string_dtypes(), hnp.unicode_string_dtypes(),
    hnp.array_dtypes(allow_subarrays=False, max_size=2),    # structured
    st.just(np.dtype(np.longdouble)),
)

OBJECTS = st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=3),
                    st.complex_numbers(), st.just(np.float32(1)))


@st.composite
def any_array(draw: st.DrawFn, shape: tuple[int, ...]) -> np.ndarray:
    if draw(st.integers(0, 9)) == 0:                         # object arrays
        return draw(hnp.arrays(object, shape, elements=OBJECTS))
    dtype = draw(ALL_DTYPES)
    return draw(hnp.arrays(dtype, shape))


# ================================================================ shapes

@pytest.mark.timeout(120)
@hyp(300)
@given(data=st.data(), many=st.booleans(),
       dtype=st.sampled_from(["float32", "float64", "int16", ">f4"]))
def test_random_shapes(fsv: Served, data: st.DataObject, many: bool, dtype: str) -> None:
    shape = data.draw(shapes(many), label="shape")
    check_outcome(fsv, many, tagged(shape, dtype), INPUT_SHAPE, "float32", FLOAT_OK, fake_model)
    fsv.check_unaffected()


# ================================================================ dtypes and values

@pytest.mark.slow
@pytest.mark.timeout(120)
@hyp(500)
@given(data=st.data(), many=st.booleans(), n=st.integers(0, 3))
def test_random_dtypes_and_values(fsv: Served, data: st.DataObject, many: bool, n: int) -> None:
    """Every dtype family, with hypothesis' values: NaN, +-inf, -0.0,
    subnormals, float64 values beyond float32's range (inf after the cast),
    extreme ints, non-ASCII strings, arbitrary Python objects."""
    shape = (n,) + INPUT_SHAPE if many else INPUT_SHAPE
    x = data.draw(any_array(shape), label="x")
    check_outcome(fsv, many, x, INPUT_SHAPE, "float32", FLOAT_OK, fake_model)
    fsv.check_unaffected()


@pytest.mark.timeout(120)
@hyp(300)
@given(data=st.data(), many=st.booleans())
def test_int_input_dtypes(isv: Served, data: st.DataObject, many: bool) -> None:
    """An int32 input: floats (and complex, strings, objects...) are refused
    naming both dtypes; bool and every int width are cast (same_kind, so
    int64 values wrap exactly as astype(int32) does)."""
    shape = (data.draw(st.integers(0, 6)), 3) if many else (3,)
    x = data.draw(any_array(shape), label="x")
    check_outcome(isv, many, x, (3,), "int32", INT_OK, int_model)
    isv.check_unaffected()


# ================================================================ memory layouts

@st.composite
def layouts(draw: st.DrawFn, many: bool) -> tuple[str, np.ndarray]:
    n = draw(st.integers(1, 3 * K))
    shape = (n,) + INPUT_SHAPE if many else INPUT_SHAPE
    dtype = draw(st.sampled_from(["float32", "float64", "int32", ">f4", "float16", "uint8"]))
    base = tagged(shape, "float64")
    if np.dtype(dtype).kind == "u":
        base = np.abs(base)
    how = draw(st.sampled_from(["strided", "transposed", "negative", "fortran", "broadcast",
                                "contiguous"]))
    if how == "strided":          # every step-th element of a larger array along one axis
        axis = draw(st.integers(0, len(shape) - 1))
        step = draw(st.integers(2, 3))
        big_shape = list(shape)
        big_shape[axis] *= step
        big = np.full(big_shape, 12345.0)
        idx = [slice(None)] * len(shape)
        idx[axis] = slice(None, None, step)
        big[tuple(idx)] = base
        x = big.astype(dtype)[tuple(idx)]
    elif how == "transposed":     # a transposed view of the right shape
        perm = draw(st.permutations(range(len(shape))))
        inv = np.argsort(perm)
        x = np.ascontiguousarray(base.astype(dtype).transpose(perm)).transpose(inv)
    elif how == "negative":       # reversed along some axes (negative strides)
        axes = draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, unique=True))
        idx = [slice(None, None, -1) if i in axes else slice(None) for i in range(len(shape))]
        x = base.astype(dtype)[tuple(idx)]
    elif how == "fortran":
        x = np.asfortranarray(base.astype(dtype))
    elif how == "broadcast":      # zero strides: one row repeated, or one value everywhere
        x = np.broadcast_to(base.astype(dtype)[(0,) * (len(shape) - 3)], shape) \
            if draw(st.booleans()) else np.broadcast_to(np.array(7, dtype), shape)
    else:
        x = base.astype(dtype)
    if draw(st.booleans()) and x.flags.writeable:
        x.setflags(write=False)
    return how, x


@pytest.mark.timeout(120)
@hyp(300)
@given(data=st.data(), many=st.booleans())
def test_non_contiguous_and_read_only(fsv: Served, data: st.DataObject, many: bool) -> None:
    how, x = data.draw(layouts(many), label="layout")
    assert check_outcome(fsv, many, x, INPUT_SHAPE, "float32", FLOAT_OK, fake_model) == "ok", how
    fsv.check_unaffected()


# ================================================================ row counts

@pytest.mark.timeout(120)
@hyp(100)
@given(n=st.one_of(st.integers(0, 3 * K), st.integers(3 * K, 40 * K)), as_list=st.booleans())
def test_evaluate_many_row_counts(fsv: Served, n: int, as_list: bool) -> None:
    """0 rows, fewer, as many as and far more rows than slots_per_client
    (sent in rounds): every row gets its own answer."""
    base = fsv.tag * 1000 + 1_000_000
    x = np.stack([make_state(base + i) for i in range(n)]) if n else \
        np.zeros((0,) + INPUT_SHAPE, np.float32)
    check_outcome(fsv, True, x.tolist() if as_list and n else x, INPUT_SHAPE, "float32",
                  FLOAT_OK, fake_model)
    fsv.check_unaffected()


# ================================================================ Python objects

@st.composite
def python_objects(draw: st.DrawFn, many: bool) -> Any:
    shape = ((draw(st.integers(1, 3)),) if many else ()) + INPUT_SHAPE
    kind = draw(st.sampled_from(["list", "ragged", "big-int", "mixed", "scalar", "none",
                                 "text", "tuple", "dict", "short"]))
    if kind in ("list", "tuple", "ragged", "big-int", "mixed", "short"):
        vals = draw(st.sampled_from(["int", "float", "bool"]))
        a = tagged(shape, {"int": np.int64, "float": np.float64, "bool": np.bool_}[vals])
        lst: Any = a.tolist()
        if kind == "ragged":        # one innermost row one element short
            row = lst
            while isinstance(row[0], list):
                row = row[draw(st.integers(0, len(row) - 1))]
            row.pop()
        elif kind == "big-int":     # does not fit any NumPy int: an object array
            lst[0][0][0] = 2 ** 70 if not many else [2 ** 70] * len(lst[0][0][0])
        elif kind == "mixed":       # a str among numbers: a str array
            flat = lst[0][0] if not many else lst[0][0][0]
            flat[0] = "x"
        elif kind == "short":
            lst = lst[:-1]
        elif kind == "tuple":
            lst = tuple(lst)
        return lst
    if kind == "scalar":
        return draw(st.one_of(st.integers(-10**6, 10**6), st.floats(), st.booleans(),
                              st.complex_numbers()))
    if kind == "none":
        return None
    if kind == "text":
        return draw(st.one_of(st.text(max_size=5), st.binary(max_size=5)))
    return {"state": make_state(1)}


@pytest.mark.timeout(120)
@hyp(300)
@given(data=st.data(), many=st.booleans())
def test_python_objects(fsv: Served, data: st.DataObject, many: bool) -> None:
    x = data.draw(python_objects(many), label="x")
    try:
        np.asarray(x)
    except ValueError:
        # A ragged list: NumPy itself refuses it.  The client must still say
        # ValueError (not crash, not a ShmevalError).
        kind, r = call(fsv, many, x)
        assert kind == "refused" and isinstance(r, ValueError), r
    else:
        check_outcome(fsv, many, x, INPUT_SHAPE, "float32", FLOAT_OK, fake_model)
    fsv.check_unaffected()


# ================================================================ NaN / inf

@pytest.mark.timeout(60)
@hyp(60)
@given(data=st.data())
def test_nonfinite_inputs_travel_bit_exact(fsv: Served, data: st.DataObject) -> None:
    """NaN (with payloads), +-inf, -0.0, subnormals and float32 extremes are
    carried unchanged: the fake model's value output is a copy of input
    element [5, 6, 1], compared bit for bit."""
    special = st.sampled_from([0x7FC00000, 0x7FC00001, 0xFFC12345, 0x7F800000, 0xFF800000,
                               0x80000000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF])
    bits = data.draw(st.lists(special, min_size=4, max_size=4), label="bits")
    states = np.stack([make_state(i) for i in range(4)])
    states[:, 5, 6, 1] = np.array(bits, np.uint32).view(np.float32)
    states[:, 0, 3, 0] = np.array(bits[::-1], np.uint32).view(np.float32)
    out = fsv.ev.evaluate_many(states)
    assert out["value"].view(np.uint32).tolist() == bits
    np.testing.assert_array_equal(out["policy"], fake_model(states)["policy"])
    one = fsv.ev.evaluate(states[2])
    assert int(one["value"].view(np.uint32)) == bits[2]
    fsv.sent += 5
    fsv.check_unaffected()


@pytest.mark.timeout(30)
def test_nan_input_with_reject_nonfinite_default() -> None:
    """With the default reject_nonfinite=True, a NaN state whose output is NaN
    fails that request with ModelError (saying NaN and how to allow it), and
    the evaluator keeps serving."""
    with make_ev() as ev:
        bad = make_state(3)
        bad[0, 2, 0] = np.nan
        with pytest.raises(shmeval.ModelError, match="NaN") as ei:
            ev.evaluate(bad)
        assert "reject_nonfinite" in str(ei.value)
        check_answer(ev.evaluate(make_state(4)), 4)
        s = ev.stats()
        assert s["failed_requests"] == 1 and s["requests"] == 2, s


@pytest.mark.timeout(60)
def test_nan_input_does_not_fail_innocent_requests_in_the_same_batch() -> None:
    """Two threads submit at once into one batch (max_wait_us gathers them):
    one state holds NaN, the other is fine.  The fine one should be answered."""
    with make_ev(max_batch=2, max_wait_us=500_000) as ev:
        bad = make_state(3)
        bad[0, 2, 0] = np.nan
        results: dict[str, Any] = {}
        go = threading.Barrier(2)

        def run(name: str, state: np.ndarray) -> None:
            go.wait(10)
            try:
                results[name] = ev.evaluate(state)
            except shmeval.ShmevalError as e:
                results[name] = e

        threads = [threading.Thread(target=run, args=("bad", bad)),
                   threading.Thread(target=run, args=("good", make_state(5)))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(20)
        assert ev.stats()["batches"] == 1            # they did share a batch
        assert isinstance(results["bad"], shmeval.ModelError)
        assert not isinstance(results["good"], Exception), results["good"]
        check_answer(results["good"], 5)


# ================================================================ huge inputs

@pytest.mark.timeout(60)
def test_huge_wrong_inputs_are_refused_without_copying(fsv: Served) -> None:
    """Inputs of TiB (zero-stride views: no memory) with a wrong shape or an
    impossible dtype are refused at once; a right-shaped one too large to
    copy raises MemoryError (it cannot work), and nothing reaches the
    evaluator."""
    row = np.zeros(INPUT_SHAPE, np.float32)
    huge_bad_shape = np.broadcast_to(np.zeros((6, 7, 3), np.float32), (10**12, 6, 7, 3))
    with pytest.raises(ValueError, match=r"\(1000000000000, 6, 7, 3\)"):
        fsv.ev.evaluate_many(huge_bad_shape)
    with pytest.raises(ValueError, match=r"\(1000000000000, 6, 7, 3\)"):
        fsv.ev.evaluate(huge_bad_shape)
    huge_complex = np.broadcast_to(np.zeros(INPUT_SHAPE, np.complex64), (10**12,) + INPUT_SHAPE)
    with pytest.raises(TypeError, match="complex64"):
        fsv.ev.evaluate_many(huge_complex)
    with pytest.raises(ValueError, match=r"\(1000000000000, 6, 7, 2\)"):
        fsv.ev.evaluate(np.broadcast_to(row, (10**12,) + INPUT_SHAPE))
    with pytest.raises(MemoryError):
        fsv.ev.evaluate_many(np.broadcast_to(row, (10**12,) + INPUT_SHAPE))
    fsv.check_unaffected()


@pytest.mark.timeout(60)
def test_huge_wrong_shape_of_another_dtype_is_refused_without_copying(fsv: Served) -> None:
    huge = np.broadcast_to(np.zeros((6, 7, 3), np.float64), (10**12, 6, 7, 3))
    with pytest.raises(ValueError, match=r"\(1000000000000, 6, 7, 3\)"):
        fsv.ev.evaluate_many(huge)


@pytest.mark.timeout(120)
def test_huge_batch_of_large_states_is_answered() -> None:
    """200 MB in one evaluate_many (200 states of 1 MB, far more than the 8
    slots): every row answered correctly; memory stays at the input plus the
    segment (the contiguous float32 input is not copied)."""
    rows, shape = 200, (256, 1024)

    def model(x: np.ndarray) -> dict[str, np.ndarray]:
        return {"sum": x.reshape(len(x), -1).sum(axis=1, dtype=np.float64),
                "head": x[:, 0, :4].copy()}

    with make_ev(model, input_shape=shape, outputs={"sum": ((), "float64"),
                                                     "head": ((4,), "float32")},
                 max_clients=2, slots_per_client=8, max_batch=8) as ev:
        x = np.empty((rows,) + shape, np.float32)
        for i in range(rows):
            x[i] = i
        x[:, 0, :4] = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
        out = ev.evaluate_many(x)
        expected = x.reshape(rows, -1).sum(axis=1, dtype=np.float64)
        np.testing.assert_array_equal(out["sum"], expected)
        np.testing.assert_array_equal(out["head"], x[:, 0, :4])
        del x
        s = ev.stats()
        assert s["requests"] == rows and s["failed_requests"] == 0, s
        assert float(ev.evaluate(np.ones(shape, np.float32))["sum"]) == 256 * 1024
