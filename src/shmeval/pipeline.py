"""Submit now, collect later: pipelined evaluation for one process.

``Client.submit(states)`` posts a batch into the process's slots and returns
a :class:`Pending` at once; ``pending.result()`` waits for the answers and
returns what ``evaluate_many`` returns.  A search can so keep several groups
of leaves in flight and work on one while the evaluator computes the
others, and a process that always has an answer waiting rarely sleeps.

A submit is posted by the same code as ``evaluate_many`` (the process's
``_ring.ClientPort``; docs/protocol.md): a submission holds one slot per
state from the post until its answer is copied out, and errors, closes
and evaluator deaths are judged by the same checks
(``shmeval.entry.ProcessEntry``).

How the slots come back
    A row's answer is copied into the Pending's own arrays by whichever
    comes first: ``result()``, ``done()``, ``wait_any``, the asyncio waiter
    thread, or a ``submit`` (or ``Client.close``) that needs slots and finds
    the answers of other submissions of this process waiting.  So a process
    that submits more than its slots hold waits only for the evaluator,
    never for its own uncollected submissions.
Rows are claimed, not locked
    A Pending marks each row in flight as claimed before it copies the row
    out, in C with the GIL held and no Python code between the look and
    the mark, so a row is fetched exactly once however many threads
    collect, and nothing here takes a lock that a finalizer could meet
    held by its own thread.
The common case in C
    ``Client.submit`` of a batch the process has free slots for, and
    ``Pending.result()`` / ``done()`` of answers that come, run in Cython
    (``_ring.ClientPort.submit``, ``_ring.Pending``); the process's entry
    decides the rest (too few free slots, timeouts, closes, deaths).  What a pipelined request costs a worker against a
    blocking ``evaluate``: docs/performance.md, Pipelined requests.
Dropped Pendings
    A Pending garbage-collected with rows in flight puts their slots on the
    process's abandoned list (``ProcessEntry.recover_abandoned`` frees each
    once answered), as ``evaluate_many`` does with a wait interrupted by an
    exception.
asyncio
    ``await client.evaluate_async(states)`` submits without blocking and
    awaits a future that one waiter thread per process resolves
    (``loop.call_soon_threadsafe``): the thread sleeps in one
    ``Segment.wait_any`` over every row of every awaited submission, so
    there is no thread per call.  It takes the rows it sleeps on when it
    goes to sleep; a submission made meanwhile joins at its next wake-up
    (an answer of the earlier ones, or the ticker within 100 ms).
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _ring
from .entry import WAIT_TIMEOUT_NS, ProcessEntry
# Pending, the answers to one submit collected later, is written in Cython
# (_ring.Pending); NoFreeSlots is what submit(block=False) raises.  Both are
# public here.
from ._ring import Pending as Pending
from .errors import NoFreeSlots as NoFreeSlots
from .errors import ShmevalError, ShmevalTimeout

Outputs = Dict[str, np.ndarray]
Result = Union[Outputs, Tuple[Outputs, np.ndarray]]

#: How long the asyncio waiter thread sleeps when the slots it waits for are
#: held by other threads' blocking calls (it cannot sleep on those).
_POLL_S = 0.001


def _check_all(entry: ProcessEntry, pendings: Sequence[Pending]) -> None:
    if not pendings:
        raise ValueError("no Pending to wait for")
    if any(p._entry is not entry for p in pendings):
        raise ValueError("every Pending must come from this client's submit in this process")


def wait_any(entry: ProcessEntry, pendings: Iterable[Pending],
             timeout: Optional[float] = None) -> Pending:
    """``Client.wait_any``: the first of ``pendings`` that is done (its
    ``result()`` returns or raises without waiting), waiting up to
    ``timeout`` seconds; ShmevalTimeout (a TimeoutError) after that."""
    ps = list(pendings)
    _check_all(entry, ps)
    ps[0]._check_process()
    deadline = None if timeout is None else time.monotonic() + timeout
    seg, c = entry.seg, entry.c
    while True:
        for p in ps:
            if p.done():
                return p
        ks: List[int] = []
        gens: List[int] = []
        for p in ps:
            for k, g in p._rows_in_flight():
                ks.append(k)
                gens.append(g)
        if not ks:  # another thread is fetching the last rows
            time.sleep(_POLL_S)
            continue
        wait_ns = WAIT_TIMEOUT_NS
        if deadline is not None:
            wait_ns = max(0, min(wait_ns, int((deadline - time.monotonic()) * 1e9)))
        i, rc = seg.wait_any(c, ks, gens, entry.spin_ns, wait_ns, entry.ncpu)
        if i < len(ks):
            continue  # answered (or reclaimed): done() fetches it
        try:
            entry.judge(rc)
        except ShmevalError as e:
            for p in ps:
                if p._in_flight:
                    p._fail(e)
            continue
        if deadline is not None and time.monotonic() >= deadline:
            raise ShmevalTimeout(f"none of {len(ps)} Pending(s) done within {timeout} s")


def as_completed(entry: ProcessEntry, pendings: Iterable[Pending],
                 timeout: Optional[float] = None) -> Iterator[Pending]:
    """``Client.as_completed``: yields each of ``pendings`` once it is done,
    the first done first; ShmevalTimeout (a TimeoutError) if ``timeout`` seconds (from the
    call) pass before all are."""
    left = list(pendings)
    if not left:
        return
    _check_all(entry, left)
    deadline = None if timeout is None else time.monotonic() + timeout
    while left:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        p = wait_any(entry, left, remaining)
        left = [q for q in left if q is not p]
        yield p


async def evaluate_async(entry: ProcessEntry, states: Any, return_version: bool = False,
                         keys: Any = None, method: Optional[str] = None) -> Result:
    """``Client.evaluate_async``: ``evaluate_many`` for asyncio.  Submits
    without blocking the event loop (awaiting free slots if need be), then
    awaits the answers, which the process's waiter thread announces.  The
    entry is kept: a close meanwhile raises, as evaluate_many does."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            p = entry.port.submit(states, False, return_version, keys, method)
            break
        except NoFreeSlots:
            await async_waiter(entry).slots_freed(loop)
    if not p.done():
        await async_waiter(entry).watch(p, loop)
    result: Result = p.result()
    return result


def async_waiter(entry: ProcessEntry) -> "AsyncWaiter":
    """The entry's asyncio waiter thread, started on first use."""
    with entry.waiter_lock:
        if entry.waiter is None:
            entry.waiter = AsyncWaiter(entry)
            entry.waiter.start()
        return entry.waiter


class AsyncWaiter(threading.Thread):
    """The thread that waits for the answers of a process's awaited
    submissions: one ``Segment.wait_any`` over all their rows, then each
    finished one's future is resolved on its own event loop."""

    def __init__(self, entry: ProcessEntry) -> None:
        super().__init__(name=f"shmeval-async {entry.address}", daemon=True)
        self.entry = entry
        self.cond = threading.Condition()
        # (pending, loop, future) of every awaited submission
        self.watched: List[Tuple[Pending, asyncio.AbstractEventLoop, "asyncio.Future[None]"]] = []
        # futures of submits waiting for free slots
        self.slot_waiters: List[Tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]] = []
        # Set when the thread ends (its entry was detached): futures asked
        # for after that are resolved at once, and their callers find the
        # handle closed.
        self.stopped = False

    def watch(self, p: Pending, loop: asyncio.AbstractEventLoop) -> "asyncio.Future[None]":
        """A future resolved once p is done."""
        fut: "asyncio.Future[None]" = loop.create_future()
        with self.cond:
            if self.stopped:
                fut.set_result(None)
                return fut
            self.watched.append((p, loop, fut))
            self.cond.notify()
        return fut

    def slots_freed(self, loop: asyncio.AbstractEventLoop) -> "asyncio.Future[None]":
        """A future resolved when slots may have come back."""
        fut: "asyncio.Future[None]" = loop.create_future()
        with self.cond:
            if self.stopped:
                fut.set_result(None)
                return fut
            self.slot_waiters.append((loop, fut))
            self.cond.notify()
        return fut

    def run(self) -> None:
        try:
            self._serve()
        finally:
            with self.cond:
                self.stopped = True
                watched, self.watched = self.watched, []
                waiters, self.slot_waiters = self.slot_waiters, []
            for _p, loop, fut in watched:
                _resolve(loop, fut)
            for loop, fut in waiters:
                _resolve(loop, fut)

    def _serve(self) -> None:
        entry = self.entry
        seg, c, port = entry.seg, entry.c, entry.port
        while not port.detached:
            with self.cond:
                while not self.watched and not self.slot_waiters:
                    self.cond.wait(1.0)
                    if port.detached:
                        return
                watched = [w for w in self.watched if not w[2].cancelled()]
                self.watched = watched
                slot_waiters = bool(self.slot_waiters)
            rows = [r for p, _, _ in watched for r in p._rows_in_flight()]
            if slot_waiters:  # anything whose answer frees a slot
                rows += [r for p in entry.pendings() for r in p._rows_in_flight()]
                rows += list(port.abandoned)
            rows = list(dict.fromkeys(rows))
            if rows:
                ks, gens = [k for k, _ in rows], [g for _, g in rows]
                i, rc = seg.wait_any(c, ks, gens, 0, WAIT_TIMEOUT_NS, entry.ncpu)
                if i == len(ks):
                    try:
                        entry.judge(rc)
                    except ShmevalError as e:
                        for p, _, _ in watched:
                            p._fail(e)
                        if port.detached:
                            return
            else:
                # Other threads' blocking calls hold the slots, or are
                # fetching the last rows: neither rings this thread.
                time.sleep(_POLL_S)
            entry.harvest()
            done = [w for w in watched if w[0].done()]
            del watched, rows
            with self.cond:
                ids = {id(w[2]) for w in done}
                self.watched = [w for w in self.watched if id(w[2]) not in ids]
                # Submits waiting for slots try again after every round.
                wake, self.slot_waiters = self.slot_waiters, []
            for _p, loop, fut in done:
                _resolve(loop, fut)
            for loop, fut in wake:
                _resolve(loop, fut)
            del done, wake


def _resolve(loop: asyncio.AbstractEventLoop, fut: "asyncio.Future[None]") -> None:
    def set_done() -> None:
        if not fut.done():
            fut.set_result(None)

    try:
        loop.call_soon_threadsafe(set_done)
    except RuntimeError:  # the loop is closed: nobody awaits it
        pass
