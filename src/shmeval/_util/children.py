"""Set-up of the processes an application starts."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from typing import Any, Callable, Tuple


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
