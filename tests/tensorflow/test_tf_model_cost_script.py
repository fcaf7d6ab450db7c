"""bench/tf_model_cost.py end to end, one run per mode that
docs/performance.md quotes, on a tiny net (4 filters, one layer) and one or
two batch sizes: the per-call table with the weight updates (plain, and
frozen in bfloat16 with the distance from float32), the calling styles,
the trivial graph's floor and two threads calling at once.  Each run prints
its table's header and a row per batch or style with positive figures.
Figures are not checked: this is the script working, not a measurement."""
from __future__ import annotations

import re

import pytest

from helpers import NUMBER, number, run_bench

TINY = ["--filters", "4", "--layers", "1"]
#: The calling styles the script always times (a private flat call of the
#: converted function is added where TensorFlow has one).
STYLES = ["TFModel (concrete fn, tf.constant)", "tf.function(input_signature)(ndarray)",
          "concrete function(tf.constant)", "model.predict_on_batch", "eager model(x)",
          "TFModel(freeze=True)", "frozen_function(tf.constant)", "FrozenGraph(ndarray)",
          "converted function(tf.constant)"]
FLOOR = ["concrete function(tf.constant)", "session, inter-op pool of 1",
         "session, caller's thread (-1)"]


def run_script(*args: str) -> str:
    """bench/tf_model_cost.py's stdout for args (it exited 0)."""
    return run_bench("tf_model_cost.py", *args, timeout=100, TF_CPP_MIN_LOG_LEVEL="2")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bfloat16", [False, True], ids=["plain", "freeze-bfloat16"])
def test_per_call_table(bfloat16: bool) -> None:
    """The net's line, a row per batch with wall and CPU µs per call and µs
    per state (frozen in bfloat16: also the largest distance of each output
    from the float32 graph's), and three weight updates' times."""
    extra = ["--freeze", "--bfloat16"] if bfloat16 else []
    out = run_script(*TINY, *extra, "--batches", "1,4")
    net = "net bench: 4 filters x 1, TF threads 1, inter-op 1"
    assert (net + (", frozen, bfloat16" if bfloat16 else "")) in out.splitlines(), out
    head = re.search(r"^ +batch +wall us +cpu us +us/state(.*)$", out, re.M)
    assert head, out
    assert ("max |bfloat16 - float32| policy, value" in head.group(1)) == bfloat16, out
    moved = rf" +({NUMBER}e[-+]\d+) +({NUMBER}e[-+]\d+)" if bfloat16 else ""
    rows = re.findall(rf"^ +(\d+) +({NUMBER}) +({NUMBER}) +({NUMBER}) *{moved}$", out, re.M)
    assert [int(row[0]) for row in rows] == [1, 4], out
    assert all(number(wall) > 0 and number(state) > 0 for _, wall, _, state, *_ in rows), out
    m = re.search(rf"^set_weights: ({NUMBER}), ({NUMBER}), ({NUMBER}) ms$", out, re.M)
    assert m, out


def style_rows(out: str, title: str, names: list[str]) -> None:
    """The table under title has one batch column and a row per name, each
    with a positive wall and CPU µs per call."""
    assert re.search(rf"^{re.escape(title)} +batch 1 +\(wall / CPU us per call\)$", out, re.M), out
    for name in names:
        m = re.search(rf"^{re.escape(name)} +({NUMBER}) /\s*({NUMBER})$", out, re.M)
        assert m, f"no row for {name}:\n{out}"
        assert number(m.group(1)) > 0, out


@pytest.mark.timeout(120)
def test_styles() -> None:
    """--styles: a row per calling style of the same net."""
    style_rows(run_script(*TINY, "--styles", "--batches", "1"), "calling style", STYLES)


@pytest.mark.timeout(120)
def test_floor() -> None:
    """--floor: a row per way of calling a graph of one multiplication."""
    style_rows(run_script("--floor", "--batches", "1"), "x * 2, called as", FLOOR)


@pytest.mark.timeout(120)
def test_concurrent() -> None:
    """--concurrent 2: calls/s of one thread and of two at once, and their
    ratio, for the batch asked for."""
    out = run_script(*TINY, "--concurrent", "2", "--batches", "1")
    assert re.search(r"^ +batch +1 thread calls/s +2 threads calls/s +ratio$", out, re.M), out
    m = re.search(rf"^ +1 +({NUMBER}) +({NUMBER}) +{NUMBER}x$", out, re.M)
    assert m, out
    assert all(number(v) > 0 for v in m.groups()), out
