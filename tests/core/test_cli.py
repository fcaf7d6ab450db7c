"""The ``shmeval`` command as a user meets it: an ordinary error is one line
and exit code 1, the help texts are plain and name every argument, and
``shmeval ls`` finds the running evaluators."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

import shmeval
from shmeval import cli, segment
from helpers import (INPUT_SHAPE, OUTPUTS, check_answer, fake_factory, make_ev, make_state,
                     run_python)

TIMEOUT_S = 60


def shmeval_cmd(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmeval", *argv], capture_output=True,
                          text=True, timeout=TIMEOUT_S)


@pytest.mark.parametrize("argv", [["stats", "/shmeval-1-00"], ["stats", "not/an/address"]])
def test_an_error_is_one_line_and_exit_1(argv: list[str]) -> None:
    r = shmeval_cmd(*argv)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("shmeval stats: SegmentError: "), \
        r.stderr


def subparsers() -> dict[str, argparse.ArgumentParser]:
    p = cli.parser()
    [sub] = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_help_texts_are_plain_and_name_every_argument() -> None:
    parsers = {"shmeval": cli.parser(), **subparsers()}
    for name, app in cli.APPLICATIONS.items():
        p = argparse.ArgumentParser(prog=f"shmeval {name}", description=app.description)
        cli._import_application(app).add_arguments(p)
        parsers[name] = p
    for name, p in parsers.items():
        text = p.format_help()
        for markup in ("``", ":class:", ":func:", ":meth:"):
            assert markup not in text, (name, markup)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help, f"shmeval {name}: {action.dest} has no help line"


@pytest.mark.timeout(60)
def test_ls_and_stats_without_an_address_list_running_evaluators() -> None:
    with make_ev() as ev:
        ev.evaluate(make_state(1))
        rows = {r["address"]: r for r in json.loads(shmeval_cmd("ls", "--json").stdout)}
        assert rows[ev.address]["requests"] == 1
        assert rows[ev.address]["state"] == "serving"
        assert rows[ev.address]["clients"] == 1
        for argv in (["ls"], ["stats"]):
            out = shmeval_cmd(*argv).stdout
            assert ev.address in out and "clients" in out, out
    assert ev.address not in shmeval_cmd("ls").stdout


def test_stats_prints_strict_json() -> None:
    """A percentile of nothing measured yet is null, not a bare NaN that
    strict JSON parsers reject."""
    with make_ev() as ev:
        text = shmeval_cmd("stats", ev.address).stdout

        def refuse(word: str) -> None:
            raise ValueError(f"not strict JSON: {word}")

        st = json.loads(text, parse_constant=refuse)
        assert st["queue_wait_us"]["p50"] is None and st["state"] == "serving"


@pytest.mark.timeout(120)
def test_a_killed_evaluator_reads_died_from_any_process() -> None:
    """An Evaluator.spawn process killed with SIGKILL cannot say so in the
    segment: readers judge its liveness and report it died."""
    with shmeval.Evaluator.spawn(fake_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                                 max_batch=8, max_clients=4, start_timeout=60,
                                 restarts=0) as ev:
        check_answer(ev.evaluate(make_state(2)), 2)
        pid = ev.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while segment.is_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        st = ev.stats()
        assert st["state"] == "died", st["state"]
        assert st["stopped_because"].startswith(f"its process vanished (pid {pid}")
        assert st["replicas"][0]["state"] == "dead"
        other = json.loads(shmeval_cmd("stats", ev.address).stdout)
        assert (other["state"], other["stopped_because"]) == (st["state"], st["stopped_because"])
        rows = {r["address"]: r for r in json.loads(shmeval_cmd("ls", "--json").stdout)}
        assert rows[ev.address]["state"] == "died"
    assert ev.stats()["stopped_because"] == "its process was killed by signal 9"


def test_a_custom_name_is_listed_and_cleaned_up() -> None:
    """A segment given its own name (no shmeval- prefix, no pid in it) is
    found by its header: ls lists it; once its owner is gone, cleanup
    removes it."""
    name = f"/custom-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with make_ev(name=name) as ev:
        rows = {r["address"]: r for r in json.loads(shmeval_cmd("ls", "--json").stdout)}
        assert rows[name]["owner_pid"] == os.getpid() and rows[name]["state"] == "serving"
    # An owner that dies without closing leaves its segment behind.
    r = run_python(f"import os, helpers; ev = helpers.make_ev(name={name!r}); os._exit(0)")
    try:
        assert r.returncode == 0, r.stderr
        assert os.path.exists("/dev/shm" + name)
        out = shmeval_cmd("cleanup").stdout
        assert f"{name}  owner" in out and "DEAD" in out, out
        assert not os.path.exists("/dev/shm" + name)
    finally:
        if os.path.exists("/dev/shm" + name):
            os.unlink("/dev/shm" + name)
