"""A client keeps the GIL while it waits for its answer only when it is the
process's only Python thread (docs/performance.md, *A null-model round trip*); with any
other Python thread it releases it, so that thread runs meanwhile."""
from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable

import pytest

import shmeval
from helpers import INPUT_SHAPE, OUTPUTS, check_answer, make_state, run_python, slow_fake_factory

WAIT_S = 0.3  # how long the evaluator's model takes per batch below


@pytest.mark.timeout(60)
def test_only_python_thread_in_a_fresh_interpreter() -> None:
    """The predicate: true alone, false while another thread lives (also one
    that is blocked), true again once it has been joined."""
    code = (
        "import threading\n"
        "from shmeval import _ring\n"
        "a = _ring.only_python_thread()\n"
        "go = threading.Event()\n"
        "t = threading.Thread(target=go.wait)\n"
        "t.start()\n"
        "b = _ring.only_python_thread()\n"
        "go.set(); t.join()\n"
        "print(a, b, _ring.only_python_thread())\n"
    )
    out = run_python(code)
    assert out.stdout.split() == ["True", "False", "True"], out.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("versioned", [False, True])
def test_other_threads_run_while_a_client_waits(versioned: bool) -> None:
    """A pure-Python thread keeps counting while the main thread waits in
    evaluate() for a batch that takes WAIT_S, about as fast as while the
    main thread sleeps: the client released the GIL.  (Keeping it
    regardless of other threads fails this: the counter then runs only
    when a wait returns to Python to check the evaluator's liveness, every
    100 ms, for one switch interval, a few percent of the time.)"""
    with shmeval.Evaluator.spawn(functools.partial(slow_fake_factory, WAIT_S),
                                 input_shape=INPUT_SHAPE, outputs=OUTPUTS, max_batch=8) as ev:
        ev.evaluate(make_state(0))  # registers: the next call takes the fast path
        ticks = [0]
        stop = threading.Event()

        def count() -> None:
            while not stop.is_set():
                ticks[0] += 1

        def rate(wait: Callable[[], object]) -> tuple[float, object]:
            before, t0 = ticks[0], time.perf_counter()
            r = wait()
            return (ticks[0] - before) / (time.perf_counter() - t0), r

        t = threading.Thread(target=count)
        t.start()
        try:
            time.sleep(0.05)
            free, _ = rate(lambda: time.sleep(WAIT_S))
            waiting, r = rate(lambda: ev.evaluate(make_state(1), return_version=versioned))
        finally:
            stop.set()
            t.join()
        out: Any = r[0] if versioned else r  # type: ignore[index]
        check_answer(out, 1)
        assert waiting > 0.3 * free, f"{waiting:,.0f} ticks/s while waiting, {free:,.0f} while sleeping"


@pytest.mark.timeout(60)
def test_single_threaded_client_answers_across_waits() -> None:
    """The path that keeps the GIL (a child with one Python thread) answers
    every request, including waits long enough to sleep in the kernel."""
    code = (
        "import functools\n"
        "import shmeval\n"
        "from shmeval import _ring\n"
        "from helpers import INPUT_SHAPE, OUTPUTS, make_state, check_answer, slow_fake_factory\n"
        "if __name__ == '__main__':\n"
        # restarts=0: no watcher thread in this process either.
        "    with shmeval.Evaluator.spawn(functools.partial(slow_fake_factory, 0.05),\n"
        "                                 input_shape=INPUT_SHAPE, outputs=OUTPUTS,\n"
        "                                 restarts=0) as ev:\n"
        "        ev.evaluate(make_state(0))\n"
        "        assert _ring.only_python_thread()\n"
        "        for tag in range(1, 6):\n"
        "            check_answer(ev.evaluate(make_state(tag)), tag)\n"
        "            out, v = ev.evaluate(make_state(tag), return_version=True)\n"
        "            check_answer(out, tag)\n"
        "    print('ok')\n"
    )
    out = run_python(code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
