"""A factory the evaluator process cannot find: Evaluator.spawn says why
before it starts one.

With the spawn start method the evaluator process imports the main script
again, without its ``if __name__ == "__main__":`` block, and looks the
factory up by name; a factory defined in that block, or in a ``python -c``
string or an interactive session, is not there, and the process used to die
unpickling it with only multiprocessing's AttributeError on stderr."""
from __future__ import annotations

import functools
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shmeval._main_script import defined_only_under_main_guard, unreachable_reason

GUARDED = '''
import os
if __name__ == "__main__":
    def factory():
        pass
    class Model:
        pass
    import json as codec
'''


@pytest.mark.parametrize("name", ["factory", "Model", "codec"])
def test_names_bound_only_under_the_guard(name: str) -> None:
    assert defined_only_under_main_guard(GUARDED, name)


@pytest.mark.parametrize("source", [
    GUARDED.replace("import os", "def factory():\n    pass"),          # also at the top level
    'if "__main__" == __name__:\n    pass\nelse:\n    def factory():\n        pass\n',
    "def main():\n    def factory():\n        pass\n",                  # not a top-level name
    'if __name__ != "__main__":\n    def factory():\n        pass\n',
    GUARDED.replace("import os", "from os.path import *"),             # may bind it
    "def factory(:\n",                                                  # does not parse
    "",
])
def test_names_the_child_does_find(source: str) -> None:
    assert not defined_only_under_main_guard(source, "factory")


def test_only_the_main_scripts_objects_are_looked_at() -> None:
    assert unreachable_reason(functools.partial(textwrap.dedent, "x"), "spawn") is None
    assert unreachable_reason(test_only_the_main_scripts_objects_are_looked_at, "spawn") is None


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs Python with ``args``; asserts it left no segment of its own."""
    with subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=tmp_path) as p:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(f"shmeval-{p.pid}-")]
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


SCRIPT = '''
import functools
import numpy as np
import shmeval

def model(batch):
    n = len(batch)
    return {{"policy": np.full((n, 7), 1 / 7, np.float32),
            "value": batch.reshape(n, -1).mean(axis=1)}}

{top}

if __name__ == "__main__":
{guarded}
    try:
        ev = shmeval.Evaluator.spawn({factory}, input_shape=(6, 7, 2),
                                     outputs={{"policy": ((7,), "float32"),
                                              "value": ((), "float32")}}{context})
    except TypeError as e:
        print("TypeError:", e)
    else:
        print("value", float(ev.evaluate(np.ones((6, 7, 2), np.float32))["value"]))
        ev.close()
'''


@pytest.mark.timeout(150)
@pytest.mark.parametrize("where, factory, context, says", [
    ("guarded", "factory", "", 'defined inside the `if __name__ == "__main__":` block'),
    ("guarded", "functools.partial(factory)", "", "defined inside the `if __name__"),
    ("top", "factory", "", "value 1.0"),
    ("guarded", "factory", ", mp_context='fork'", "value 1.0"),
    # None: the platform's default start method, fork on Linux before 3.14
    ("guarded", "factory", ", mp_context=None",
     "value 1.0" if mp.get_context(None).get_start_method() == "fork" else "defined inside"),
])
def test_a_factory_under_the_main_guard(tmp_path: Path, where: str, factory: str, context: str,
                                        says: str) -> None:
    define = "def factory():\n    return model\n"
    script = SCRIPT.format(top=define if where == "top" else "",
                           guarded=textwrap.indent(define if where == "guarded" else "pass\n",
                                                   "    "),
                           factory=factory, context=context)
    (tmp_path / "selfplay.py").write_text(script)
    r = _run(tmp_path, "selfplay.py")
    assert r.returncode == 0 and says in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    if says.startswith("defined"):
        assert "selfplay.py" in r.stdout and "top level" in r.stdout


@pytest.mark.timeout(150)
def test_a_factory_of_a_command_line_string(tmp_path: Path) -> None:
    code = SCRIPT.format(top="def factory():\n    return model\n", guarded="    pass",
                         factory="factory", context="")
    r = _run(tmp_path, "-c", code)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TypeError:" in r.stdout and "the __main__ module has no file" in r.stdout, r.stdout
