"""Processes in other pid and time namespaces, as in containers that share
/dev/shm but not their pid namespace (Kubernetes pods without
shareProcessNamespace, Docker --ipc=container: without --pid=container:).

Needs util-linux's unshare and root (CI runs as root): a machine without
them fails these tests rather than skipping them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shmeval import segment
from external import require_binary, require_root
from helpers import check_answer, make_ev, make_state

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CLIENT = """
import sys, numpy as np, shmeval
try:
    c = shmeval.connect(sys.argv[1])
    out = c.evaluate(np.zeros((6, 7, 2), np.float32))
    print("answered")
except shmeval.ShmevalError as e:
    print(type(e).__name__ + ": " + str(e))
"""


def unshare(*flags: str) -> list[str]:
    exe = require_binary("unshare", "apt-get install -y util-linux")
    require_root("unshare makes namespaces")
    return [exe, *flags, "--fork"]


def child_env() -> dict[str, str]:
    """The environment of a child Python: the tests' helpers, and the same
    shmeval as this process (a checkout built in place on PYTHONPATH)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [TESTS] + ([os.environ["PYTHONPATH"]] if "PYTHONPATH" in os.environ else [])))


def run(cmd: list[str], timeout: float = 60) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env())
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,flags", [("pid", ["--pid", "--mount-proc"]), ("time", ["--time"])])
def test_client_in_another_namespace_is_refused(kind: str, flags: list[str]) -> None:
    """Refused at attach, saying what to share; the evaluator and its other
    clients are unaffected, and the refused process claimed no entry."""
    with make_ev() as ev:
        check_answer(ev.evaluate(make_state(1)), 1)
        out = run(unshare(*flags) + [sys.executable, "-c", CLIENT, ev.address])
        assert out.startswith("SegmentError: ") and f"another {kind} namespace" in out, out
        assert f"share its {kind} namespace" in out, out
        assert [e[1] for e in ev._attach().clients()] == [os.getpid()]
        check_answer(ev.evaluate(make_state(2)), 2)
        # Without the other namespace the same client is answered.
        assert run([sys.executable, "-c", CLIENT, ev.address]).strip() == "answered"


CREATOR = """
import sys, shmeval
from helpers import INPUT_SHAPE, OUTPUTS, fake_model
ev = shmeval.Evaluator(fake_model, input_shape=INPUT_SHAPE, outputs=OUTPUTS)
print(ev.address, flush=True)
sys.stdin.read()          # until the test closes our stdin
ev.close()
"""


def free_pid() -> int:
    """A pid no process has here (the evaluator's pid in its own namespace)."""
    for pid in range(3_000_000, 3_000_000 + 1000, 7):
        if not os.path.exists(f"/proc/{pid}"):
            return pid
    raise AssertionError("no free pid found")


@pytest.mark.timeout(120)
def test_cleanup_keeps_a_segment_of_another_pid_namespace() -> None:
    """An evaluator in another pid namespace whose pid is nobody's here: its
    segment looks stale by pid, but cleanup must not remove it."""
    pid = free_pid()
    # sh is pid 1 in the new namespace; the python it forks gets `pid`.
    script = (f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid && "
              f"{sys.executable} -c '{CREATOR}'")
    p = subprocess.Popen(unshare("--pid", "--mount-proc") + ["sh", "-c", script], env=child_env(),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdin is not None
        address = p.stdout.readline().strip()
        assert address.startswith(f"/shmeval-{pid}-"), address
        assert not os.path.exists(f"/proc/{pid}")
        [info] = [s for s in segment.list_segments() if s["address"] == address]
        assert info["foreign_namespace"] and info["owner_alive"], info
        assert address not in segment.cleanup_stale(dry_run=True)
        assert address not in segment.cleanup_own_stale()
        assert os.path.exists("/dev/shm" + address)
        p.stdin.close()
        assert p.wait(60) == 0
        assert not os.path.exists("/dev/shm" + address)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
