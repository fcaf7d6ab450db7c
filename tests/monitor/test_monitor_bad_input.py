"""Bad input to the monitoring commands: a port in use, an address that is
not a segment, another user's segment.  Each is one line on stderr and
exit code 1, and leaves nothing behind: no segment, no listening port, no
thread (the other user's case runs in a forked child that drops to uid
65534, nobody, which needs root)."""
from __future__ import annotations

import contextlib
import io
import os
import pwd  # noqa: F401  (imported before the fork: nobody may not read the stdlib)
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, List

import pytest

import shmeval.monitor.plot  # noqa: F401  (as above)
import shmeval.monitor.prometheus  # noqa: F401
import shmeval.monitor.watch  # noqa: F401
from shmeval import cli
from shmeval.monitor.prometheus import start_exporter
from shmeval.errors import SegmentError
from core.test_stale_segments import drop_to_nobody, needs_root, raw_segment, run_forked
from helpers import make_ev

TIMEOUT_S = 60


def shmeval_cmd(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmeval", *argv], capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def one_line_error(r: subprocess.CompletedProcess[str], start: str) -> None:
    assert r.returncode == 1, r
    assert "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(start), r.stderr


@pytest.fixture
def busy_port() -> Any:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.timeout(TIMEOUT_S)
def test_a_port_in_use(busy_port: int) -> None:
    with make_ev() as ev:
        r = shmeval_cmd("metrics", ev.address, "--port", str(busy_port))
        threads = threading.active_count()
        with pytest.raises(OSError):
            start_exporter(ev.address, busy_port)
        assert threading.active_count() == threads             # no serving thread left
    one_line_error(r, f"shmeval metrics: cannot listen on 127.0.0.1:{busy_port}: it is in use")


NOT_SEGMENTS = ["/shmeval-1-00",          # no such segment
                "not/an/address"]         # not a name at all


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("address", NOT_SEGMENTS)
@pytest.mark.parametrize("command", [["stats", "--watch"], ["metrics", "--port", "0"]])
def test_an_address_that_is_not_a_segment(address: str, command: List[str]) -> None:
    r = shmeval_cmd(command[0], address, *command[1:])
    one_line_error(r, f"shmeval {command[0]}: SegmentError: ")


@pytest.mark.timeout(TIMEOUT_S)
def test_a_shared_memory_object_that_is_not_a_segment() -> None:
    name = f"/shmeval-{os.getpid()}-notasegment"
    raw_segment(name, content=b"not a shmeval header" * 10)
    try:
        for command in (["stats", name, "--watch"], ["metrics", name, "--port", "0"]):
            r = shmeval_cmd(*command)
            one_line_error(r, f"shmeval {command[0]}: SegmentError: ")
        with pytest.raises(SegmentError):
            start_exporter(name, 0)
    finally:
        os.unlink("/dev/shm" + name)


def run_as_nobody(argv: List[str]) -> tuple[int, str]:
    """cli.main(argv) as uid 65534 in this (forked) process: exit code, stderr."""
    drop_to_nobody()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:
            rc = int(e.code or 0)
    return rc, err.getvalue()


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("command", [["stats", "--watch"], ["metrics", "--port", "0"]])
def test_another_users_segment(command: List[str]) -> None:
    needs_root()
    with make_ev() as ev:
        rc, err = run_forked(run_as_nobody, [command[0], ev.address, *command[1:]])
        assert ev.stats()["clients"] == 0                     # it attached nothing
    assert rc == 1
    assert err.count("\n") == 1 and err.startswith(f"shmeval {command[0]}: SegmentError: "
                                                   f"permission denied on segment {ev.address}")
    assert "uid 0 (root)" in err and "uid 65534" in err, err


def test_plot_of_a_file_that_is_not_a_run(tmp_path: Path) -> None:
    for content in ("not json", '{"modes": {"shmeval": {"moves_per_s": 1}}}'):
        (tmp_path / "bad.json").write_text(content)
        r = shmeval_cmd("plot", str(tmp_path / "bad.json"))
        one_line_error(r, f"shmeval plot: {tmp_path / 'bad.json'} ")
        assert not (tmp_path / "bad.png").exists()
    one_line_error(shmeval_cmd("plot", str(tmp_path / "missing.json")),
                   f"shmeval plot: cannot read {tmp_path / 'missing.json'}")
