"""Set-up of the processes an application starts."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from typing import Any, Callable, List, Tuple

#: A busy loop's command line after the interpreter: what the benchmarks
#: run as another program taking a CPU.
BUSY_LOOP = ("-c", "while True: pass")


def child_setup() -> None:
    """First thing in every child process: Ctrl-C is the parent's to handle
    (it stops everything in order), and the child dies with the parent
    instead of running on unattended."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before prctl
        os._exit(1)


def start_process(ctx: Any, target: Callable[..., None], name: str,
                  args: Tuple[Any, ...]) -> Any:
    """Starts ``target(*args)`` in a daemon process of ``ctx`` with SIGINT
    ignored: a spawned child (a fresh interpreter) keeps ignoring it from the
    start, before it can run :func:`child_setup`, so Ctrl-C reaches only
    the parent, which stops the children in order."""
    p = ctx.Process(target=target, name=name, args=args, daemon=True)
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        p.start()
    finally:
        signal.signal(signal.SIGINT, old)
    return p


def start_busy_loops(n: int) -> "List[subprocess.Popen[bytes]]":
    """``n`` busy loops (:data:`BUSY_LOOP`), each a process of its own."""
    return [subprocess.Popen([sys.executable, *BUSY_LOOP]) for _ in range(n)]


def stop_busy_loops(loops: "List[subprocess.Popen[bytes]]") -> None:
    """Kills and reaps the loops, and empties the list."""
    for p in loops:
        p.kill()
        p.wait()
    loops.clear()
