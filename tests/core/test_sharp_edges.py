"""What a new user runs into, and what shmeval says then: weights pushed
from a worker, outputs that differ from the spec in harmless ways, factories
that cannot reach the evaluator process, a script without an entry-point
guard, and the client count after the workers are gone."""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest

import shmeval
from shmeval.spec import Spec
from helpers import INPUT_SHAPE, OUTPUTS, check_answer, fake_model, make_ev, make_state, own_segments


def test_weights_from_a_handle_say_where_to_push_them() -> None:
    with make_ev() as ev:
        for handle in (shmeval.connect(ev.address), pickle.loads(pickle.dumps(ev))):
            with pytest.raises(shmeval.ShmevalError,
                               match=rf"pushed from the process that created the evaluator "
                                     rf"\(pid {os.getpid()}\)"):
                handle.set_weights([np.zeros(3)])
            with pytest.raises(shmeval.ShmevalError, match="load_weights: weights are pushed"):
                handle.load_weights("w.npz")


def test_an_int_output_shape_is_a_one_dimensional_shape() -> None:
    spec = Spec.build(INPUT_SHAPE, "float32", {"policy": (9, "float32")}, 8, 2, 2)
    assert spec.outputs[0].shape == (9,)


def extra_outputs_model(x: np.ndarray) -> dict[str, np.ndarray]:
    out = fake_model(x)
    out["aux"] = np.zeros((len(x), 3), np.float32)
    return out


def test_undeclared_outputs_are_dropped_with_one_warning() -> None:
    with make_ev(extra_outputs_model) as ev:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for tag in range(5):
                check_answer(ev.evaluate(make_state(tag)), tag)
        msgs = [str(x.message) for x in w if "not declared" in str(x.message)]
        assert msgs == ["the model returns outputs ['aux'] that are not declared in outputs=; "
                        "they are dropped (declare them to receive them)"], msgs


def column_value_model(x: np.ndarray) -> dict[str, np.ndarray]:
    out = fake_model(x)
    out["value"] = out["value"][:, None]  # (n, 1), as a Dense(1) head gives it
    return out


def two_values_model(x: np.ndarray) -> dict[str, np.ndarray]:
    out = fake_model(x)
    out["value"] = np.stack([out["value"]] * 2, axis=1)
    return out


def test_rows_with_the_declared_number_of_values_are_reshaped() -> None:
    with make_ev(column_value_model) as ev:
        check_answer(ev.evaluate(make_state(4)), 4)
        out = ev.evaluate_many(np.stack([make_state(t) for t in (1, 2)]))
        assert out["value"].shape == (2,) and list(out["value"]) == [-1, -2]
    with make_ev(two_values_model) as ev:
        with pytest.raises(shmeval.ModelError, match=r"1 values per row"):
            ev.evaluate(make_state(4))


def test_an_unpicklable_factory_says_what_a_factory_must_be() -> None:
    before = own_segments()
    with pytest.raises(TypeError, match="must be picklable.*module-level function"):
        shmeval.Evaluator.spawn(lambda: fake_model, input_shape=INPUT_SHAPE, outputs=OUTPUTS)
    assert own_segments() == before


UNGUARDED = """
import sys
sys.path.insert(0, {tests!r})
import shmeval
from helpers import INPUT_SHAPE, OUTPUTS, fake_factory
ev = shmeval.Evaluator.spawn(fake_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS)
ev.close()
"""


@pytest.mark.timeout(120)
def test_a_script_without_an_entry_point_guard_is_told_to_add_one(tmp_path: Any) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED.format(tests=os.path.dirname(os.path.dirname(__file__))))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=100, cwd=tmp_path)
    assert r.returncode != 0
    # The child says what went wrong, the parent what to do.
    assert "was called while this process was starting as a child process" in r.stderr
    assert "EvaluatorDied" in r.stderr and 'if __name__ == "__main__":' in r.stderr, r.stderr


def exit_after_one(ev: Any, tag: int) -> None:
    check_answer(ev.evaluate(make_state(tag)), tag)


@pytest.mark.timeout(120)
def test_clients_counts_processes_attached_now() -> None:
    """Workers that have exited are not counted, even before the evaluator
    reclaims their entries."""
    with make_ev() as ev:
        ctx = mp.get_context("spawn")
        ps = [ctx.Process(target=exit_after_one, args=(ev, i)) for i in range(4)]
        for p in ps:
            p.start()
        for p in ps:
            p.join(60)
        assert [p.exitcode for p in ps] == [0] * 4
        assert ev.stats()["clients"] == 0
        check_answer(ev.evaluate(make_state(9)), 9)      # this process
        assert ev.stats()["clients"] == 1
        assert ev.stats()["stopped_because"] is None
    assert ev.stats()["stopped_because"] == "closed by its owner"
