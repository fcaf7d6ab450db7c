"""Submit now, collect later: pipelined evaluation for one process.

``Client.submit(states)`` posts a batch into the process's slots and returns
a :class:`Pending` at once; ``pending.result()`` waits for the answers and
returns what ``evaluate_many`` returns.  A search can so keep several groups
of leaves in flight and work on one while the evaluator computes the
others, and a process that always has an answer waiting rarely sleeps.

Everything here runs over the same client entry, free list and Segment
calls as ``evaluate_many`` (docs/protocol.md): a submission holds one slot
per state from the post until its answer is copied out, and errors,
closes and evaluator deaths are judged by the same ``Client`` checks.

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
    (``_ring.ClientPort._submit``, ``_ring.Pending``) without a Python
    frame; the lane here decides the rest (too few free slots, timeouts,
    closes, deaths).  What a pipelined request costs a worker against a
    blocking ``evaluate``: docs/performance.md, Pipelined requests.
Dropped Pendings
    A Pending garbage-collected with rows in flight puts their slots on the
    process's abandoned list (``Client._recover_abandoned`` frees each once
    answered), as ``evaluate_many`` does with a wait interrupted by an
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
import os
import threading
import time
from typing import (TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Sequence,
                    Tuple, Union)

import numpy as np

from . import _ring
from . import client as _client
# Pending, the answers to one submit collected later, is written in Cython,
# so that a submit and a collect in the common case run no Python frame; it
# calls the lane below for what is unusual.  Public here.
from ._ring import Pending as Pending
from .errors import EvaluatorClosed, ShmevalError, ShmevalTimeout

if TYPE_CHECKING:
    from .client import Client

Outputs = Dict[str, np.ndarray]
Result = Union[Outputs, Tuple[Outputs, np.ndarray]]

#: How long the asyncio waiter thread sleeps when the slots it waits for are
#: held by other threads' blocking calls (it cannot sleep on those).
_POLL_S = 0.001

#: This process's pid, kept up to date across forks: os.getpid() is a system
#: call, and every collect checks that the submitter is the caller.
_pid = os.getpid()


def _after_fork() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


class NoFreeSlots(ShmevalError):
    """``submit(..., block=False)`` found fewer free slots than states: the
    process's other requests hold them (``slots_per_client`` in all)."""


class _Lane:
    """The pipelined state of one client entry in one process: the
    asyncio waiter thread once there is one, and what the Pendings of
    this entry ask when something is unusual.  A new registration (after
    ``close()``, or in a forked child) gets a new lane."""

    def __init__(self, client: "Client", port: "_ring.ClientPort") -> None:
        seg = client._seg
        assert seg is not None
        self.client = client
        self.port = port
        self.seg = seg
        self.c = port.c
        self.pid = _pid
        self.spin_ns = client._spin_ns()
        spec = client.spec
        self.slots = spec.slots_per_client
        self.outputs = spec.outputs
        self.waiter: Optional[_AsyncWaiter] = None
        self.waiter_lock = threading.Lock()

    # -------------------------------------------------------- waiting
    def check(self, rc: int, k: int, gen: int, outs: List[np.ndarray], row: int) -> None:
        """After a wait that ended without an answer (rc TIMEOUT, CLOSED or
        STALE): raises what evaluate_many raises then; returns on a timeout
        of a healthy evaluator."""
        client = self.client
        if rc == _ring.TIMEOUT:
            client._check_port(self.port, detached=True)
            client._check_alive(self.seg)
            return
        client._wait_slow(self.seg, self.port, k, gen, outs, row, rc)  # raises for these rcs
        raise AssertionError(f"_wait_slow returned after rc {rc}")  # pragma: no cover

    def pendings(self) -> List["Pending"]:
        """The submissions with rows in flight (a snapshot): the port
        knows each slot's Pending without holding it."""
        return self.port.owners()

    def harvest(self) -> int:
        """Copies out every answer already there, of any submission of this
        lane; returns how many slots that freed."""
        return sum(p._harvest() for p in self.pendings())

    # -------------------------------------------------------- slots
    def take(self, n: int, block: bool) -> List[int]:
        """n free slots of this entry.  When there are too few, fetches the
        answers waiting for this process's other submissions first; then
        waits (block) or raises NoFreeSlots."""
        client, port = self.client, self.port
        while True:
            slots = self._pop(n)
            if slots is not None:
                return slots
            if self.harvest():
                continue
            if not block:
                raise NoFreeSlots(
                    f"{client}: submit needs {n} free slot(s) and this process has "
                    f"{len(port.free)} of {self.slots} free; collect a submission first "
                    f"(or submit with block=True, which waits for one)")
            rows = [r for p in self.pendings() for r in p._rows_in_flight()]
            rows += list(port.abandoned)
            if not rows:
                # Other threads' calls hold the slots: wait as they do.
                return client._acquire(n, port)
            ks, gens = [k for k, _ in rows], [g for _, g in rows]
            i, rc = self.seg.wait_any(self.c, ks, gens, self.spin_ns,
                                      _client.WAIT_TIMEOUT_NS, client._ncpu)
            if i == len(ks):
                client._check_port(port)
                if rc == _ring.CLOSED:
                    client._check_state(self.seg)
                client._check_alive(self.seg)

    def _pop(self, n: int) -> Optional[List[int]]:
        """n slots from the free list, or None (nothing taken)."""
        client, port = self.client, self.port
        client._check_port(port)
        if port.abandoned:
            with client._lock:
                client._recover_abandoned(port)
        free = port.free
        slots: List[int] = []
        try:
            while len(slots) < n:
                slots.append(free.pop())
        except IndexError:
            free.extend(slots)
            if port.waiters:
                client._notify_waiters()
            return None
        if port.retired:  # closed meanwhile: close() waits for what we hold
            client._give_back(port, slots, [])
            client._check_port(port)
        return slots

    def abandon(self, rows: List[Tuple[int, int]]) -> None:
        """Requests in flight that nobody will collect: their slots come
        back once answered (Client._recover_abandoned).  Called from
        finalizers, so it takes no lock that its own thread may hold: a
        list's extend is atomic, and _recover_abandoned keeps what is
        appended while it runs."""
        port = self.port
        port.abandoned.extend(rows)
        lock = self.client._lock
        if port.waiters and lock.acquire(blocking=False):
            try:
                self.client._slot_freed.notify_all()
            finally:
                lock.release()

    # -------------------------------------------------------- asyncio
    def async_waiter(self) -> "_AsyncWaiter":
        with self.waiter_lock:
            if self.waiter is None:
                self.waiter = _AsyncWaiter(self)
                self.waiter.start()
            return self.waiter


def lane_of(client: "Client") -> _Lane:
    """The calling process's lane of client (registering it on first use)."""
    if client._pid != _pid:
        client._register()
    port = client._port
    if port is None:  # closed by another thread just now
        raise EvaluatorClosed(f"{client} was closed in this process")
    lane: Optional[_Lane] = client.__dict__.get("_pipeline_lane")
    if lane is None or lane.port is not port or lane.pid != _pid:
        lane = _Lane(client, port)
        client.__dict__["_pipeline_lane"] = lane
        port.lane = lane  # from now on ClientPort submits in C
    return lane


def harvest_port(client: "Client", port: "_ring.ClientPort") -> int:
    """For ``Client.close``: copies out the answers waiting for this
    process's submissions on ``port``, so that their slots come back and
    the Pendings stay collectable; returns how many slots that freed."""
    lane: Optional[_Lane] = client.__dict__.get("_pipeline_lane")
    if lane is None or lane.port is not port or lane.pid != _pid:
        return 0
    return lane.harvest()


# ------------------------------------------------------------ the API


def submit(client: "Client", states: Any, block: bool = True,
           return_version: bool = False, keys: Any = None) -> Pending:
    """``Client.submit``: posts states ``[n, *input_shape]`` (n at most
    ``slots_per_client``) and returns their :class:`Pending`."""
    return _submit(lane_of(client), states, block, return_version, keys)


def _submit(lane: _Lane, states: Any, block: bool, return_version: bool,
            keys: Any = None) -> Pending:
    """submit on a given lane (a closed one raises EvaluatorClosed).  As
    evaluate_many, the rows the evaluation cache holds (by keys, or by the
    hashes of the states) are answered here, and only the others posted,
    their answers to be cached."""
    client = lane.client
    a = client._as_input(states, None, "states")
    n = a.shape[0]
    if n > lane.slots:
        raise ValueError(f"submit takes at most slots_per_client ({lane.slots}) states at "
                         f"once, got {n} (evaluate_many sends more in rounds)")
    if keys is not None:
        keys = _client._cache_keys(keys, n)
    p = Pending(lane, n, return_version)
    seg = lane.seg
    if n and seg.cache_entries and seg.ev_state() < _ring.CLOSING:
        rows, k1, k2 = seg.cache_lookup(lane.c, a, keys, p._outs, p._versions)
    else:
        rows, k1, k2 = list(range(n)), None, None
    if not rows:
        return p  # nothing to post: answered already
    slots = lane.take(len(rows), block)
    try:
        if seg.ev_state() >= _ring.CLOSING:
            client._check_state(seg)
        gens = seg.post(lane.c, slots, a, rows, k1, k2, keys is None)
    except BaseException:
        client._give_back(lane.port, slots, [])
        raise
    p._arm(rows, slots, gens)
    return p


def _lane_of_all(client: "Client", pendings: Sequence[Pending]) -> _Lane:
    if not pendings:
        raise ValueError("no Pending to wait for")
    lane: _Lane = pendings[0]._lane
    if any(p._lane is not lane for p in pendings) or lane.client is not client:
        raise ValueError("every Pending must come from this client's submit in this process")
    return lane


def wait_any(client: "Client", pendings: Iterable[Pending],
             timeout: Optional[float] = None) -> Pending:
    """``Client.wait_any``: the first of ``pendings`` that is done (its
    ``result()`` returns or raises without waiting), waiting up to
    ``timeout`` seconds; ShmevalTimeout (a TimeoutError) after that."""
    ps = list(pendings)
    lane = _lane_of_all(client, ps)
    ps[0]._check_process()
    deadline = None if timeout is None else time.monotonic() + timeout
    seg, c = lane.seg, lane.c
    spin_ns = lane.spin_ns
    while True:
        for p in ps:
            if p.done():
                return p
        ks: List[int] = []
        gens: List[int] = []
        owner: List[Pending] = []
        for p in ps:
            for k, g in p._rows_in_flight():
                ks.append(k)
                gens.append(g)
                owner.append(p)
        if not ks:  # another thread is fetching the last rows
            time.sleep(_POLL_S)
            continue
        wait_ns = _client.WAIT_TIMEOUT_NS
        if deadline is not None:
            wait_ns = max(0, min(wait_ns, int((deadline - time.monotonic()) * 1e9)))
        i, rc = seg.wait_any(c, ks, gens, spin_ns, wait_ns, client._ncpu)
        if i < len(ks):
            continue  # answered (or reclaimed): done() fetches it
        try:
            p = owner[0]
            lane.check(rc, ks[0], gens[0], p._outs, 0)
        except ShmevalError as e:
            for p in ps:
                if p._in_flight:
                    p._fail(e)
            continue
        if deadline is not None and time.monotonic() >= deadline:
            raise ShmevalTimeout(f"none of {len(ps)} Pending(s) done within {timeout} s")


def as_completed(client: "Client", pendings: Iterable[Pending],
                 timeout: Optional[float] = None) -> Iterator[Pending]:
    """``Client.as_completed``: yields each of ``pendings`` once it is done,
    the first done first; ShmevalTimeout (a TimeoutError) if ``timeout`` seconds (from the
    call) pass before all are."""
    left = list(pendings)
    if not left:
        return
    _lane_of_all(client, left)
    deadline = None if timeout is None else time.monotonic() + timeout
    while left:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        p = wait_any(client, left, remaining)
        left = [q for q in left if q is not p]
        yield p


async def evaluate_async(client: "Client", states: Any, return_version: bool = False,
                         keys: Any = None) -> Result:
    """``Client.evaluate_async``: ``evaluate_many`` for asyncio.  Submits
    without blocking the event loop (awaiting free slots if need be), then
    awaits the answers, which the process's waiter thread announces."""
    loop = asyncio.get_running_loop()
    lane = lane_of(client)  # kept: a close meanwhile raises, as evaluate_many does
    while True:
        try:
            p = _submit(lane, states, False, return_version, keys)
            break
        except NoFreeSlots:
            await lane.async_waiter().slots_freed(loop)
    if not p.done():
        await lane.async_waiter().watch(p, loop)
    result: Result = p.result()
    return result


class _AsyncWaiter(threading.Thread):
    """The thread that waits for the answers of a process's awaited
    submissions: one ``Segment.wait_any`` over all their rows, then each
    finished one's future is resolved on its own event loop."""

    def __init__(self, lane: _Lane) -> None:
        super().__init__(name=f"shmeval-async {lane.client.address}", daemon=True)
        self.lane = lane
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
        lane = self.lane
        seg, c, port = lane.seg, lane.c, lane.port
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
                rows += [r for p in lane.pendings() for r in p._rows_in_flight()]
                rows += list(port.abandoned)
            rows = list(dict.fromkeys(rows))
            if rows:
                ks, gens = [k for k, _ in rows], [g for _, g in rows]
                i, rc = seg.wait_any(c, ks, gens, 0, _client.WAIT_TIMEOUT_NS, lane.client._ncpu)
                if i == len(ks):
                    try:
                        lane.check(rc, ks[0], gens[0], [], 0)
                    except ShmevalError as e:
                        for p, _, _ in watched:
                            p._fail(e)
                        if port.detached:
                            return
            else:
                # Other threads' blocking calls hold the slots, or are
                # fetching the last rows: neither rings this thread.
                time.sleep(_POLL_S)
            lane.harvest()
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
