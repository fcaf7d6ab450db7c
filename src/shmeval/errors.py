"""Exceptions.  Everything shmeval raises derives from ShmevalError, except bad
arguments, which raise ValueError / TypeError."""
from __future__ import annotations

import os
import re
import traceback


class ShmevalError(Exception):
    """Base class of every shmeval error."""


class SegmentError(ShmevalError):
    """A shared segment is missing, foreign, corrupt or of another version."""


class ClientTableFull(ShmevalError):
    """Every client-table entry is taken; raise ``max_clients``."""


class EvaluatorClosed(ShmevalError):
    """The evaluator was closed; the request was not (or will not be) answered."""


class EvaluatorDied(ShmevalError):
    """The evaluator's process or serving thread is gone."""


class ShmevalTimeout(ShmevalError, TimeoutError):
    """A wait given a ``timeout`` ran out (``set_weights``, ``load_weights``,
    ``Pending.result``, ``wait_any``, ``as_completed``, a cluster's calls);
    what was waited for may still happen.  Also a builtin TimeoutError."""


class NotTheMainProcess(ShmevalError, RuntimeError):
    """An evaluator was created while the process was starting as a child
    of multiprocessing's spawn or forkserver start method: the script's
    entry point lacks its ``if __name__ == "__main__":`` guard.  Also a
    RuntimeError, as it was before it had a class of its own."""


class NoFreeSlots(ShmevalError):
    """``submit(..., block=False)`` found fewer free slots than states: the
    process's other requests hold them (``slots_per_client`` in all)."""


class ModelError(ShmevalError):
    """The model failed on the batch that held this request.

    ``message`` is the original error text (type and message) as the evaluator
    saw it; the evaluator itself keeps serving.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class DeviceLost(ModelError):
    """The model's device failed in a way that no later call in the process
    recovers from: a sticky CUDA error (a device-side assert, an illegal
    memory access, a kernel that faulted, an uncorrectable ECC error), an
    XLA runtime error of status INTERNAL, TensorFlow's InternalError
    (``shmeval.backends._fatal.device_lost`` tells them apart).

    Raised in the serving process, never to a client: the serving loop ends
    there, its batches are put back rather than failed, and they are served
    by the other replicas or by the restarted process
    (``Evaluator.spawn(restarts=)``).  Once no replica is left, waiting
    clients raise EvaluatorDied with ``message``, the device's error (its
    type and message), in its text.
    """


# A line of a Python stack inside an error message ('  File "x.py", line 3,
# in f'), and the blank or source lines that follow it.
_FRAME = re.compile(r'^\s*File "[^"]*", line \d+')
_CUT = "\n[... {} characters cut ...]\n"
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _fits(text: str, limit: int) -> bool:
    return len(text.encode("utf-8", "replace")) <= limit


def _drop_frames(message: str) -> str:
    """The message with each run of stack-frame lines in it replaced by one
    line saying how many were cut (TensorFlow, for one, puts the stack where
    a failed op was defined before the cause)."""
    out: list[str] = []
    frames = 0
    for line in message.split("\n"):
        if _FRAME.match(line) or (frames and (not line.strip() or line.startswith("    "))):
            frames += _FRAME.match(line) is not None
            continue
        if frames:
            out.append(f"  [{frames} stack frames cut]")
            frames = 0
        out.append(line)
    if frames:
        out.append(f"  [{frames} stack frames cut]")
    return "\n".join(out)


def _middle_cut(text: str, limit: int) -> str:
    """text in at most `limit` bytes: its start and its end, the middle cut
    and the cut said (the cause of an error is usually at one end).  A limit
    too small for that keeps the start."""
    def cut(keep: int) -> str:
        head = keep // 3
        tail = keep - head
        return text[:head] + _CUT.format(len(text) - keep) + text[len(text) - tail:]

    lo, hi = 0, min(len(text), limit)  # characters kept: the most that fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(cut(mid), limit):
            lo = mid
        else:
            hi = mid - 1
    if lo < 2 * len(_CUT):
        return text.encode("utf-8", "replace")[:limit].decode("utf-8", "ignore")
    return cut(lo)


#: The serving loop's Cython files (_ring.pyx and what it includes).
_CYTHON_FILES = ("_ring.pyx", ".pxi")


def exception_text(e: BaseException, limit: int, frames: bool = True) -> str:
    """The text a client gets for an exception raised in the evaluator, in at
    most `limit` bytes of UTF-8: the exception's type and message first,
    whole when they fit, then, as room allows (and unless not `frames`),
    the last frames of where it was raised.  A message that does not fit
    loses the stack frames written inside it first, then its middle (its
    start and its end stay, so a cause written after a stack, as
    TensorFlow writes it, survives), and says what was cut."""
    text = f"{type(e).__name__}: {e}"
    if not _fits(text, limit):
        text = f"{type(e).__name__}: {_drop_frames(str(e))}"
    if not _fits(text, limit):
        return _middle_cut(text, limit)
    if not frames:
        return text
    # The model's frames: not the serving loop's own.
    model_frames = [f for f in traceback.extract_tb(e.__traceback__)
                    if not f.filename.startswith(_PACKAGE)
                    and not f.filename.endswith(_CYTHON_FILES)][-3:]
    if model_frames:
        where = "".join(traceback.format_list(model_frames)).rstrip("\n")
        more = f"\n\nWhere it was raised in the evaluator (last frames):\n{where}"
        if _fits(text + more, limit):
            text += more
    return text
