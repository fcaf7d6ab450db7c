"""The ``shmeval`` command as a user meets it: an ordinary error is one line
and exit code 1, the help texts are plain and name every argument, and
``shmeval ls`` finds the running evaluators."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from shmeval import cli
from helpers import make_ev, make_state

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
