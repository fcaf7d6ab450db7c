"""What the signatures say and how options are refused: every "auto"
knob shows "auto" as its default in help(); an option that is not a
number raises ValueError / TypeError naming the argument, before anything
is created."""
from __future__ import annotations

import inspect
import pydoc
import re
from typing import Any

import pytest

import shmeval
from helpers import INPUT_SHAPE, OUTPUTS, check_answer, fake_factory, make_ev, make_state, \
    own_segments

AUTO_KNOBS = ("max_wait_us", "spin_us", "evaluator_spin_us", "serving_threads")


@pytest.mark.parametrize("fn", [shmeval.Evaluator.__init__, shmeval.Evaluator.spawn,
                                shmeval.connect, shmeval.Client.__init__],
                         ids=["Evaluator", "spawn", "connect", "Client"])
def test_auto_knobs_show_auto_as_their_default(fn: Any) -> None:
    params = inspect.signature(fn).parameters
    knobs = [k for k in AUTO_KNOBS if k in params]
    assert knobs
    assert {k: params[k].default for k in knobs} == dict.fromkeys(knobs, "auto")


def test_help_shows_the_real_defaults() -> None:
    text = pydoc.render_doc(shmeval.Evaluator, renderer=pydoc.plaintext)
    assert "spin_us: 'Union[float, str, None]' = 'auto'" in text
    assert "= None, evaluator_spin_us" not in text


def test_none_is_still_an_alias_of_auto_for_spin_us() -> None:
    with make_ev(spin_us=None) as ev:
        check_answer(ev.evaluate(make_state(3)), 3)


@pytest.mark.parametrize("name, value, error", [
    ("evaluator_spin_us", None, TypeError),
    ("evaluator_spin_us", [5], TypeError),
    ("evaluator_spin_us", "fast", ValueError),
    ("spin_us", [5], TypeError),
    ("spin_us", True, TypeError),
    ("max_wait_us", None, TypeError),
    ("max_wait_us", (1, 2), TypeError),
    ("max_wait_us", -1, ValueError),
])
def test_a_non_number_option_is_refused_naming_it(name: str, value: Any,
                                                   error: type) -> None:
    before = own_segments()
    with pytest.raises(error, match=rf"^{name} must be .*got " + re.escape(repr(value))):
        make_ev(**{name: value})
    assert own_segments() == before


@pytest.mark.parametrize("value, error", [(None, TypeError), ([3], TypeError),
                                          (0, ValueError)])
def test_start_timeout_is_checked_before_anything_starts(value: Any, error: type) -> None:
    before = own_segments()
    with pytest.raises(error, match="start_timeout must be"):
        shmeval.Evaluator.spawn(fake_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                start_timeout=value)
    assert own_segments() == before


def test_every_public_exception_derives_from_shmeval_error() -> None:
    """The errors table's promise: catching ShmevalError catches every error
    shmeval raises but a bad argument's; the timeouts stay TimeoutErrors."""
    from shmeval.pipeline import NoFreeSlots

    for cls in (shmeval.SegmentError, shmeval.ClientTableFull, shmeval.EvaluatorClosed,
                shmeval.EvaluatorDied, shmeval.ModelError, shmeval.ShmevalTimeout,
                shmeval.NotTheMainProcess, NoFreeSlots):
        assert issubclass(cls, shmeval.ShmevalError), cls
    assert issubclass(shmeval.ShmevalTimeout, TimeoutError)


@pytest.mark.timeout(60)
def test_timeouts_are_shmeval_errors() -> None:
    """Pending.result, wait_any and set_weights raise ShmevalTimeout."""
    import threading

    gate = threading.Event()

    class Stuck:
        def __call__(self, x: Any) -> Any:
            gate.wait(30)
            from helpers import fake_model
            return fake_model(x)

        def set_weights(self, weights: Any) -> None:
            pass

    with make_ev(Stuck(), serving_threads=1) as ev:
        try:
            p = ev.submit(make_state(1)[None])
            with pytest.raises(shmeval.ShmevalError, match="no answer within"):
                p.result(timeout=0.05)
            with pytest.raises(shmeval.ShmevalTimeout, match="none of 1"):
                ev.wait_any([p], timeout=0.05)
            with pytest.raises(shmeval.ShmevalTimeout, match="did not apply set_weights"):
                ev.set_weights([], timeout=0.1)
        finally:
            gate.set()
        p.result(timeout=30)
