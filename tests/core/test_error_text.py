"""The text of a model's exception as the client receives it: type and
message first, whole when they fit in the slot, and the cause kept when
they do not (errors.exception_text)."""
from __future__ import annotations

import pytest

import shmeval
from shmeval.errors import exception_text
from helpers import make_ev, make_state


def raised(e: BaseException) -> BaseException:
    try:
        raise e
    except BaseException as caught:
        return caught


def test_short_errors_are_whole_with_where_they_were_raised() -> None:
    text = exception_text(raised(ValueError("bad row 3")), 1024)
    assert text.startswith("ValueError: bad row 3\n")
    assert "Where it was raised in the evaluator" in text and "test_error_text.py" in text


def test_a_long_message_keeps_its_start_and_its_cause() -> None:
    stack = "".join(f'  File "/x/layer{i}.py", line {i}, in call\n\n' for i in range(40))
    message = ("Graph execution error:\n\nDetected at node check defined at (most recent "
               f"call last):\n{stack}assertion failed: [state out of range] [x = ] [5]")
    e = raised(RuntimeError(message))
    text = exception_text(e, 512)
    assert len(text.encode()) <= 512
    assert text.startswith("RuntimeError: Graph execution error:")
    assert "[40 stack frames cut]" in text
    message = text.split("\n\nWhere it was raised")[0]
    assert message.endswith("assertion failed: [state out of range] [x = ] [5]")
    # Without frames to drop, the middle goes, and the cut is said.
    e = raised(RuntimeError("start " + "x" * 5000 + " the cause"))
    text = exception_text(e, 512)
    assert len(text.encode()) <= 512
    assert text.startswith("RuntimeError: start xxx") and text.endswith("the cause")
    assert "characters cut" in text


@pytest.mark.parametrize("limit", [40, 100, 511, 1024])
def test_the_limit_is_bytes_of_utf8(limit: int) -> None:
    e = raised(RuntimeError("é" * 3000 + " cause"))
    text = exception_text(e, limit)
    assert len(text.encode()) <= limit
    assert text.startswith("RuntimeError: é")


def test_a_model_error_reaches_the_client_whole() -> None:
    def model(x):  # type: ignore[no-untyped-def]
        frames = "".join(f'  File "/lib/op{i}.py", line {i}, in op\n\n' for i in range(60))
        raise RuntimeError(f"execution failed at node n:\n{frames}cause: state {x[0, 0, 0, 0]} "
                           "out of range")

    with make_ev(model) as ev:
        with pytest.raises(shmeval.ModelError) as ei:
            ev.evaluate(make_state(7))
        text = str(ei.value)
        assert text.startswith("RuntimeError: execution failed at node n:")
        assert "cause: state 7.0 out of range\n\nWhere it was raised" in text, text
        assert "[60 stack frames cut]" in text
