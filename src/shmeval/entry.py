"""One process's client entry: its registration, its slots, and the
judgements the request path leaves to Python.

A :class:`~shmeval.Client` claims one client-table entry per process (on
first use, and again in a forked child or after ``close``); the threads of
the process share that entry's slots.  A :class:`ProcessEntry` is that
claim: it makes the entry's ``_ring.ClientPort`` (the request path in
Cython: post, wait, collect) and answers what the port cannot decide
itself:

* too few free slots (``take``): copies out the answers waiting for this
  process's submissions first, then waits for a slot, or raises
  ``NoFreeSlots``;
* a wait that ended without an answer (``judge``): a timeout of a healthy
  evaluator goes on waiting; a closed or dead evaluator, a closed handle
  or a reclaimed entry raises;
* requests whose waiter gave up (``abandon``, ``recover_abandoned``): their
  slots come back once answered.

``Client`` and the pipelined calls (``shmeval.pipeline``) both hold the
entry, so that imports run one way: client -> pipeline -> entry.
"""
from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from . import _ring, segment
from .errors import EvaluatorClosed, EvaluatorDied, NoFreeSlots
from .spec import Spec
from .stats import device_lost
from .waiting import spin_budget, usable_cpus

if TYPE_CHECKING:
    from .pipeline import AsyncWaiter

#: How long one blocking wait lasts before the evaluator's liveness is checked.
WAIT_TIMEOUT_NS = 100_000_000


class ProcessEntry:
    """The client entry of one process on one segment, claimed in
    ``__init__`` (registration), released by ``close``."""

    def __init__(self, address: str, seg: "_ring.Segment", spec: Spec,
                 spin_us: Any) -> None:
        pid = os.getpid()
        check_state(seg, address)
        self.address = address
        self.seg = seg
        self.spec = spec
        self.pid = pid
        self.ncpu = usable_cpus()
        self.spin_ns, self.spin_long_ns = spin_budget(spin_us)
        self.timeout_ns = WAIT_TIMEOUT_NS
        self.lock = threading.Lock()
        self.slot_freed = threading.Condition(self.lock)
        self.c = seg.register(pid, segment.process_starttime(pid) or 0,
                              segment.namespaces().pid)
        self.port = _ring.ClientPort(seg, self.c, self)
        # Waits then sleep without a timer; the ticker wakes them every
        # WAIT_TIMEOUT_NS to check on the evaluator (docs/protocol.md,
        # Waiting).  Without it (no thread to be had) they use timers.
        seg.start_ticker(self.c, WAIT_TIMEOUT_NS)
        # The asyncio waiter thread (shmeval.pipeline), once there is one.
        self.waiter: Optional["AsyncWaiter"] = None
        self.waiter_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<ProcessEntry {self.address} #{self.c} of pid {self.pid}>"

    # ------------------------------------------------------------ judgements
    def judge(self, rc: int) -> None:
        """After a wait that ended without an answer (rc TIMEOUT, CLOSED or
        STALE): raises what the caller must raise; returns on a timeout of
        a healthy evaluator (the caller waits again)."""
        self.check_port(detached=True)
        if rc == _ring.STALE:
            raise EvaluatorClosed(
                f"{self.address}: this process's client entry was reclaimed while a request "
                "waited (the handle was closed here, or the evaluator judged this "
                "process gone)")
        if rc == _ring.CLOSED:
            check_state(self.seg, self.address)
            raise EvaluatorClosed(f"the evaluator serving {self.address} "
                                  "closed before answering")
        check_alive(self.seg, self.address)

    def check_port(self, detached: bool = False) -> None:
        """Raises EvaluatorClosed once the handle was closed in this process:
        for new work as soon as the port is retired, for a waiter only once
        the entry is detached (close() waits for answers in flight first)."""
        port = self.port
        if port.detached or (port.retired and not detached):
            raise EvaluatorClosed(
                f"the handle of {self.address} was closed in this process while a request "
                "waited")

    def check_state(self) -> None:
        """Raises EvaluatorClosed or EvaluatorDied once the evaluator is
        closing, closed or dead."""
        check_state(self.seg, self.address)

    # ------------------------------------------------------------ slots
    # Single list operations are atomic under the GIL, so the common case
    # (free slots are there) takes no lock and runs in the port; only a
    # thread that finds too few comes here.  Slots are taken all at once or
    # not at all, so threads never hold part of what they need while they
    # wait.
    def take(self, n: int, block: bool) -> List[int]:
        """n free slots.  When there are too few: the answers waiting for
        this process's submissions are copied out first (their slots come
        back); then waits for slots (block) or raises NoFreeSlots."""
        port = self.port
        while True:
            self.check_port()
            if port.abandoned:
                with self.lock:
                    self.recover_abandoned()
            slots = self._pop(n)
            if slots is not None:
                return slots
            if self.harvest():
                continue
            if not block:
                raise NoFreeSlots(
                    f"{self.address}: submit needs {n} free slot(s) and this process has "
                    f"{len(port.free)} of {port.slots} free; collect a submission first "
                    f"(or submit with block=True, which waits for one)")
            rows = [r for p in self.pendings() for r in p._rows_in_flight()]
            rows += list(port.abandoned)
            if rows:  # sleep until one of them is answered
                ks, gens = [k for k, _ in rows], [g for _, g in rows]
                i, rc = self.seg.wait_any(self.c, ks, gens, self.spin_ns, WAIT_TIMEOUT_NS,
                                          self.ncpu)
                if i == len(ks):
                    self.check_port()
                    if rc == _ring.CLOSED:
                        self.check_state()
                    check_alive(self.seg, self.address)
                continue
            # Other threads' blocking calls hold the slots: they give them
            # back through give_back, which notifies.
            with self.lock:
                port.waiters += 1
                try:
                    if len(port.free) < n and not self.slot_freed.wait(WAIT_TIMEOUT_NS / 1e9):
                        self.check_port()
                        self.recover_abandoned()
                        check_alive(self.seg, self.address)
                finally:
                    port.waiters -= 1

    def _pop(self, n: int) -> Optional[List[int]]:
        """n slots from the free list, or None (nothing taken)."""
        free = self.port.free
        slots: List[int] = []
        try:
            while len(slots) < n:
                slots.append(free.pop())
        except IndexError:
            free.extend(slots)
            if self.port.waiters:
                self.notify_waiters()
            return None
        return slots

    def recover_abandoned(self) -> None:
        """Frees the slots of abandoned requests that were answered (or
        reclaimed: the entry is then unusable, and its next begin says so).
        Lock held.  One pop or append at a time: ``abandon``, run from
        finalizers, appends without the lock."""
        port = self.port
        if port.detached:
            return
        abandoned = port.abandoned
        for _ in range(len(abandoned)):
            k, gen = abandoned.pop(0)
            if self.seg.release(self.c, k, gen) in (0, _ring.STALE):
                port.free.append(k)
            else:
                abandoned.append((k, gen))

    def give_back(self, slots: List[int], abandoned: List[Tuple[int, int]]) -> None:
        """Returns slots to the free list, and requests in flight (slot,
        generation) to the abandoned list, whose slots come back once
        answered."""
        port = self.port
        port.free.extend(slots)
        if abandoned:
            with self.lock:
                port.abandoned.extend(abandoned)
        if port.waiters:
            self.notify_waiters()

    def abandon(self, rows: List[Tuple[int, int]]) -> None:
        """Requests in flight that nobody will collect: their slots come
        back once answered (recover_abandoned).  Called from finalizers, so
        it takes no lock that its own thread may hold: a list's extend is
        atomic, and recover_abandoned keeps what is appended while it
        runs."""
        port = self.port
        port.abandoned.extend(rows)
        if port.waiters and self.lock.acquire(blocking=False):
            try:
                self.slot_freed.notify_all()
            finally:
                self.lock.release()

    def notify_waiters(self) -> None:
        with self.lock:
            self.slot_freed.notify_all()

    # ------------------------------------------------------------ submissions
    def pendings(self) -> List["_ring.Pending"]:
        """The submissions with rows in flight (a snapshot): the port
        knows each slot's Pending without holding it."""
        return self.port.owners()

    def harvest(self) -> int:
        """Copies out every answer already there, of any submission of this
        entry; returns how many slots that freed."""
        return sum(p._harvest() for p in self.pendings())

    # ------------------------------------------------------------ close
    def drain(self, timeout: float) -> None:
        """Waits up to timeout seconds for every slot to come back (other
        threads' requests answered; answers of submissions not collected
        yet go into their Pendings, which stay collectable), then marks
        the entry detached: waiters left give up."""
        port = self.port
        deadline = time.monotonic() + timeout
        while (len(port.free) + len(port.abandoned) < port.slots
               and self.seg.ev_state() < _ring.CLOSING and time.monotonic() < deadline):
            if not self.harvest():
                time.sleep(0.001)
        port.detached = True


# ---------------------------------------------------------------- the evaluator
def check_state(seg: "_ring.Segment", address: str) -> None:
    """Raises EvaluatorClosed or EvaluatorDied once the evaluator serving
    address is closing, closed or dead."""
    st = seg.ev_state()
    if st == _ring.DIED:
        raise EvaluatorDied(why_died(seg, address))
    if st >= _ring.CLOSING:
        raise EvaluatorClosed(f"the evaluator serving {address} is closed")


def why_died(seg: "_ring.Segment", address: str) -> str:
    """EvaluatorDied's message: what the segment says stopped it; first, the
    error of a model's device that failed (errors.DeviceLost), which ended
    the replica that published it."""
    reason, detail = seg.stop_reason()
    who = f"the evaluator serving {address}"
    if reason == _ring.STOP_OWNER_DIED:
        return (f"{who} stopped because the process that created it (pid "
                f"{seg.owner_pid}) died")
    if reason in (_ring.STOP_CRASHED, _ring.STOP_EXITED):
        replicas = seg.replicas()
        for rep in replicas:
            lost = device_lost(seg, rep["replica"])
            if lost is not None:
                where = f" (replica {rep['replica']})" if len(replicas) > 1 else ""
                return (f"{who} died: its model's device failed{where}, which no later call "
                        f"in that process recovers from (DeviceLost): {lost}")
    if reason == _ring.STOP_CRASHED:
        return f"{who} died: its serving loop raised (the traceback is on its stderr)"
    if reason == _ring.STOP_EXITED:
        how = f"was killed by signal {-detail}" if detail < 0 else f"exited with code {detail}"
        return f"{who} died: its process {how}"
    return f"{who} died"


def check_alive(seg: "_ring.Segment", address: str) -> None:
    """Called after every wait timeout: raises instead of waiting forever
    on an evaluator that is closed or gone (every replica of it)."""
    check_state(seg, address)
    replicas = seg.replicas()
    serving = [r for r in replicas if r["state"] == "serving"]
    if any(segment.is_alive(r["pid"], r["starttime"]) for r in serving):
        return
    if seg.restarts_left() and segment.is_alive(seg.owner_pid):
        # Its owner restarts a dead serving process: this request is
        # served by the new one (Evaluator.spawn(restarts=)).
        return
    if not serving and all(r["state"] == "empty" for r in replicas):
        # Not serving yet: its creator must at least be alive.
        if segment.is_alive(seg.owner_pid, seg.owner_starttime):
            return
        pids = [seg.owner_pid]
    else:
        pids = [r["pid"] for r in replicas if r["pid"]]
    if len(replicas) == 1:
        raise EvaluatorDied(f"the evaluator process {pids[0]} serving {address} is gone")
    raise EvaluatorDied(f"every replica of the evaluator serving {address} is gone "
                        f"(processes {', '.join(map(str, pids))})")
