"""The tuner: the evaluator's waiting and batching settings chosen while it
serves, from what it measures (the ``"auto"`` default of ``max_wait_us``,
``evaluator_spin_us`` and ``serving_threads``), and the crowding that
holds the clients' spins (``spin_us="auto"``) to the runnable tasks.  The
machine's probes and the spin rule it applies are :mod:`shmeval.waiting`'s.

What it decides, and from what:

* **How long to wait for a fuller batch.**  A model call costs a fixed part
  ``a`` plus ``b`` per row (fitted on the calls of the last second).  With
  ``n`` rows in hand and rows arriving at ``λ`` per second, waiting ``w``
  for more changes the rows served per second from ``n / (a + b n)`` to
  ``(n + λw) / (w + a + b(n + λw))``, whose derivative in ``w`` has the sign
  of ``λa - n`` whatever ``w``: waiting pays exactly when the rows that
  arrive during one fixed cost outnumber those in hand, and then it pays
  until no more rows come.  So the tuner considers waiting only while the
  smaller batches (their lower quartile) hold fewer requests than ``λa``
  (per call in flight; requests, not the rows a model with buckets pads
  them to; where that fails with the calls in flight kept but passes for
  one, one call and a wait is the candidate), or while the model computes
  at least half the time (``BUSY_SHARE``): the clients are then a closed
  loop held up by the model, most requests arrive while a call runs, and
  ``λ`` is what the model lets through, not what the clients would send,
  so ``λa`` understates what a wait gathers.  While the calls have not
  spanned sizes a factor of two apart the split of their cost is unknown,
  and a whole call's cost stands in for ``a`` (it bounds it): a closed
  loop of a model whose cost is all per call keeps its greedy batches
  that close together, and that is where waiting pays most.  When it waits it waits at
  most one fixed cost (longer, and running the rows in hand with a second
  call for the latecomers costs no more: the ski-rental bound) and stops
  as soon as the whole population of requests, the attached clients or
  the largest batch seen, is in.  Whether that beats greedy batching is
  then measured, not assumed (*trials*, below): greedy is kept unless
  waiting wins.
* **How many model calls to keep in flight.**  A second call in flight
  overlaps one batch's gathering and answering with another's computation,
  which pays when the model releases the GIL and the machine has a free
  core or device; it is only tried for a model that says its calls may
  overlap (``max_concurrency``, which ``TFModel`` sets: whether concurrent
  calls are safe cannot be measured), and kept only if it wins its trial.
* **Whether the evaluator spins, yields or sleeps** while it waits for
  requests: from the CPUs it may use (``os.sched_getaffinity``) and the tasks
  runnable on them (``/proc/loadavg``, scaled to those CPUs), with the rule
  of ``_ring.spin_policy`` (:func:`shmeval.waiting.spin_mode`): a plain spin
  while every runnable task has a CPU, a spin that yields between looks
  when they are one more, sleep beyond that.  Its budget is the measured
  cost of putting a thread to sleep and waking it
  (:func:`shmeval.waiting.wake_cost_ns`): spinning for as long as blocking
  would cost is never worse than twice the better choice made in hindsight.  A
  longer budget, ``SPIN_LONG_WAKES`` wake-ups (yielding where the rule
  would sleep), is then tried against that one (*trials*, below): the
  runnable tasks count processes that spin as well as those that work, and
  the true cost of a sleep includes the waker's system call and the
  wake-up's latency, which the measured cost leaves out; it is kept only if
  it serves more.  The ``_ring`` layer applies its own rule (attached
  clients against CPUs) on top, so the tuner can only make the evaluator
  spin less, and it tries the long budget only where that rule lets the
  evaluator spin at all.  Each client chooses its own budget the same way,
  from its own waits (``_ring.SpinArms``); the mode is published in the
  segment as the *crowding* (:meth:`Tuner.crowding`), and each client's
  rule counts at least that many tasks, so that a client does not spin on
  a CPU that another program's task wants (docs/protocol.md, Waiting).

**Trials.**  A candidate setting (a second call in flight; waiting; the
long spin) is
compared with the simpler one in force in adjacent pairs of windows (one
housekeeping period each), alternating, and adopted only if it served more
requests in every pair of three, or in five of six when it was ahead in
two of the first three, or in seven of nine when it was ahead in four of
six (``TRIAL_PAIRS``).  A window in which the clients paused or left (the
evaluator waited a whole idle timeout for a request) does not count, nor
the one after it, which began while they were away: a trial waits for
steady requests rather than deciding on windows served for part of
their time (workers that stop between games or for a weight update).
Nor does a window served to
another number of clients (by ``CHANGE_RATIO`` or more) than the trial
began with: clients attaching one by one, or a worker restarting, are not
the load being measured; the trial starts over only once the change has
lasted ``HORIZON_NS``.  After that the settings hold until the
load changes: the attached clients, the model's cost per call or the CPUs
by ``CHANGE_RATIO`` or more for ``HORIZON_NS`` (a weight update that makes
the net slower, workers joining or leaving, another program taking the
CPUs the model computes on), when the trials run again.  The requests served
are no such sign: they move with every disturbance of a shared machine,
and trials started by them cost more than they found.  Nothing else moves
the wait, the calls in flight or the spin budget, so they do not
oscillate; the spin mode moves with the runnable tasks, smoothed and with a
margin of half a task on each side of a boundary.

The report (:meth:`Tuner.report`) is published in the segment, in the
replica's entry (:class:`Board`): any process that reads the segment sees
it (``stats()["tuner"]``, ``shmeval stats``, the monitor).

The tuner itself is plain arithmetic on :class:`Reading` objects, so that
its decisions can be tested with made-up measurements
(``tests/core/test_tuning.py``); :class:`ServingTuner` feeds it from a
running evaluator.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _ring
# The names written "X as X" are imported from here by client.py and
# evaluator.py (mypy's strict mode lets a module import only what another
# exports explicitly).
from .stats import fit_report, read_report
from .waiting import (CROWDING, SLEEP, SPIN, SPIN_LONG_WAKES, YIELD, runnable_tasks, spin_mode,
                      usable_cpus, wake_cost_ns)

#: A trial compares a candidate with the setting in force in adjacent pairs
#: of windows, a sequential sign test with three looks: after TRIAL_PAIRS
#: pairs it is adopted if it served more in all of them and dropped if in
#: fewer than all but one; after 2 * TRIAL_PAIRS, adopted if it served more
#: in all but one and dropped if in fewer than all but two; after
#: 3 * TRIAL_PAIRS, adopted if it served more in all but two (so the third
#: look needs every pair after the second).  A candidate behind in two of
#: the first three pairs could only be adopted by winning all six after
#: them, so the first look drops it rather than spend 2.4 s on that chance:
#: when both serve alike, which is when the trial's length is all it
#: costs, it ends after 4.5 pairs on average.  Then it passes by chance
#: about one time in five, which costs nothing.  A candidate ahead in 85%
#: of pairs (a clear gain read through noisy 0.2 s windows) is adopted 88%
#: of the time (81% with the first two looks alone), for 0.3 pairs more on
#: average (``trial_odds`` in tests/core/test_tuning.py).
TRIAL_PAIRS = 3
#: The trials run again when the attached clients, the model's cost per call
#: or the CPUs differ from what they measured by this ratio or more (a
#: quarter up or down): their verdict was made for that load.
CHANGE_RATIO = 1.25
#: The cost fit and the population estimate look back this far, and a
#: change of the load must last this long before the trials run again:
#: long enough for thousands of calls of a fast model or dozens of a slow
#: one, and for a passing disturbance to pass; short enough that a change
#: is acted on within the few seconds the issue allows.
HORIZON_NS = 1_000_000_000
#: The share of the time the model computes (per call in flight) from which
#: the clients are taken to be a closed loop held up by it: its calls then
#: run more than they pause, so most requests arrive while one runs and
#: wait for the next, and the arrival rate measured is what the model
#: lets through, not what the clients would send (the waiting gate, below).
BUSY_SHARE = 0.5
#: Spin modes (waiting.py), least strict first.
_STRICTNESS = (SPIN, YIELD, SLEEP)
#: Each reading moves the smoothed runnable tasks this share of the way
#: to its count: a time constant of about four readings (0.8 s at the
#: evaluator's 200 ms).  One reading is one instant's count
#: (/proc/loadavg), which moves by several tasks from one reading to the
#: next with 16 workers on 2 CPUs.
RUNNABLE_SMOOTHING = 0.25

#: One model call: (start, duration) in CLOCK_MONOTONIC ns, its rows (what
#: the model computed: the requests padded to a bucket) and its requests.
#: The cost is fitted on the rows; whether waiting can gather more counts
#: the requests (a batch of 3 padded to 4 holds 3).  Three fields: the
#: requests are the rows.
Call = Union[Tuple[int, int, int], Tuple[int, int, int, int]]


def _as_calls(calls: Union[Sequence[Call], np.ndarray]) -> np.ndarray:
    """Calls as an (n, 4) int64 array (a view when they already are)."""
    a = np.asarray(calls, dtype=np.int64)
    if a.size == 0:
        return np.empty((0, 4), np.int64)
    if a.shape[-1] == 3:
        a = np.column_stack([a, a[:, 2]])
    return a.reshape(-1, 4)


#: Cost.fit packs a call's rows and duration into one sort key: durations
#: take the low _NS_BITS bits (capped at about 18 minutes).
_NS_BITS = 40
_NS_MAX = (1 << _NS_BITS) - 1


def _upper_median(x: np.ndarray) -> float:
    """The middle value (the upper one of an even count), by partition:
    ``np.median`` imports ``numpy.ma`` on its first call, tens of ms that
    would land on a serving thread's housekeeping."""
    k = len(x) // 2
    return float(np.partition(x, k)[k])


def _lower_quartile(x: np.ndarray) -> float:
    """The value a quarter of the way up ``x`` (nearest rank, by partition)."""
    k = (len(x) - 1) // 4
    return float(np.partition(x, k)[k])


def model_concurrency(model: Any) -> int:
    """How many calls of ``model`` may run at once: its ``max_concurrency``
    attribute (an int >= 1), else 1.  Whether calls may overlap safely is
    the model's to say; whether overlapping them pays, the tuner's to
    measure."""
    n = getattr(model, "max_concurrency", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


@dataclass(frozen=True)
class Reading:
    """What the evaluator measured since the previous reading."""

    now_ns: int
    #: Requests answered so far (the segment's counter).
    requests: int
    #: Client processes attached now.
    clients: int
    #: CPUs the evaluator may use.
    cpus: int
    #: Tasks runnable on them now, the reader included (:func:`runnable_tasks`).
    runnable: float
    #: The model calls since the previous reading: Call tuples, or an
    #: (n, 4) array of them (what :class:`ServingTuner` passes).
    calls: Union[Sequence[Call], np.ndarray] = ()
    #: The evaluator waited a whole idle timeout for a request since the
    #: previous reading: the clients paused.
    paused: bool = False
    #: Replicas serving the segment now, this one included: the requests,
    #: the population and the arrivals are theirs together, and each
    #: replica's batches hold its share.
    replicas: int = 1


@dataclass(frozen=True)
class Decision:
    """The settings the serving loop uses until the next reading."""

    #: After the first request, wait up to this long for more (0: greedy).
    max_wait_ns: int
    #: Most rows per batch (the population's share while waiting).
    batch_cap: int
    #: The evaluator's spin budget, with ``_ring.SPIN_YIELD`` for a yielding
    #: spin; 0 sleeps at once.
    spin_ns: int
    #: Model calls in flight (serving threads at work).
    threads: int


@dataclass
class Cost:
    """A model call's cost: ``per_call + per_row * rows`` (ns), fitted on
    the medians of the calls of each size.  ``per_row`` is None while the
    calls have not spanned sizes a factor of two apart (the split is then
    unknown: ``per_call`` is the median call)."""

    per_call: float = 0.0
    per_row: Optional[float] = None
    #: Mean rows per call, and the median call's cost at them.
    mean_rows: float = 0.0
    at_mean: float = 0.0

    @classmethod
    def fit(cls, calls: Union[Sequence[Call], np.ndarray],
            prior: Optional["Cost"] = None) -> Optional["Cost"]:
        a = _as_calls(calls)
        if not len(a):
            return None
        # Sorted by rows, then duration, as one int64 key (a sort of one
        # key costs a fraction of a lexsort of two).
        key = np.sort(a[:, 2] << _NS_BITS | np.minimum(a[:, 1], _NS_MAX))
        rows = (key >> _NS_BITS).astype(np.float64)
        ns = (key & _NS_MAX).astype(np.float64)
        sizes, first, counts = np.unique(rows, return_index=True, return_counts=True)
        medians = ns[first + counts // 2]
        mean_rows = float(rows.mean())
        at_mean = _upper_median(ns)
        solid = counts >= 3
        if solid.sum() >= 2 and np.max(sizes[solid]) >= 2 * np.min(sizes[solid]):
            w = counts.astype(np.float64)
            xm = float(np.average(sizes, weights=w))
            ym = float(np.average(medians, weights=w))
            sxx = float(np.average((sizes - xm) ** 2, weights=w))
            b = float(np.average((sizes - xm) * (medians - ym), weights=w)) / sxx
            b = max(0.0, b)
            per_call = ym - b * xm
            if per_call < 0:  # all per row
                per_call, b = 0.0, ym / xm
            return cls(per_call, b, mean_rows, at_mean)
        if prior is not None and prior.per_row is not None:
            # Same split as before, scaled to what calls cost now.
            before = prior.per_call + prior.per_row * mean_rows
            scale = at_mean / before if before > 0 else 1.0
            return cls(prior.per_call * scale, prior.per_row * scale, mean_rows, at_mean)
        return cls(at_mean, None, mean_rows, at_mean)

    @property
    def known_fixed(self) -> float:
        """The fixed part, when the calls showed it (0 otherwise: nothing
        then argues for waiting)."""
        return self.per_call if self.per_row is not None else 0.0


@dataclass
class Trial:
    """A candidate against the setting in force, in alternating windows
    (candidate first)."""

    knob: str          # "threads" or "wait"
    base: Decision
    candidate: Decision
    clients: int       # when it began
    #: Requests per second of each window so far, in order.
    rates: List[float] = field(default_factory=list)

    def next_is_candidate(self) -> bool:
        return len(self.rates) % 2 == 0

    def wins(self) -> int:
        """Pairs in which the candidate served more."""
        r = self.rates
        return sum(r[i] > r[i + 1] for i in range(0, len(r) - 1, 2))

    def pairs(self) -> int:
        return len(self.rates) // 2

    def verdict(self) -> Optional[bool]:
        """True: adopt; False: drop; None: more pairs (TRIAL_PAIRS)."""
        n, w = self.pairs(), self.wins()
        if n == TRIAL_PAIRS and w != n - 1:
            return w == n
        if n == 2 * TRIAL_PAIRS and w != n - 2:
            return w >= n - 1
        if n == 3 * TRIAL_PAIRS:
            return w >= n - 2
        return None

    def mean(self, candidate: bool) -> float:
        mine = self.rates[0 if candidate else 1::2]
        return sum(mine) / len(mine) if mine else 0.0

    def gain(self) -> float:
        base = self.mean(False)
        return self.mean(True) / base - 1 if base else 0.0


@dataclass(frozen=True)
class Overrides:
    """The settings the caller fixed (None: the tuner's)."""

    max_wait_ns: Optional[int] = None
    spin_ns: Optional[int] = None
    threads: Optional[int] = None


@dataclass(frozen=True)
class Load:
    """What the trials measured, to tell when the load has changed: the
    attached clients, the model's predicted cost of a call of ``rows`` rows,
    the CPUs and the requests per second served."""

    clients: int
    rows: float
    cost: float
    cpus: int
    rate: float
    replicas: int = 1


def _moved(a: float, b: float) -> bool:
    """a and b differ by CHANGE_RATIO or more."""
    lo, hi = sorted((max(a, 1e-9), max(b, 1e-9)))
    return hi / lo >= CHANGE_RATIO


class Tuner:
    """The decisions, from a :class:`Reading` per housekeeping period.

    ``max_batch``: the evaluator's cap.  ``max_threads``: most model calls
    that may be in flight (serving threads there are, and 1 when the
    model's calls may not overlap).  ``wake_ns``: the spin budget
    (:func:`wake_cost_ns`).  ``overrides``: settings the caller fixed,
    which the tuner leaves alone.  ``spin_yield``: the ``_ring`` flag of a
    yielding spin."""

    def __init__(self, max_batch: int, max_threads: int, wake_ns: int,
                 overrides: Overrides = Overrides(), spin_yield: int = 1 << 63) -> None:
        self.max_batch = max_batch
        self.max_threads = max(1, max_threads)
        self.wake_ns = wake_ns
        self.overrides = overrides
        self.spin_yield = spin_yield
        self.decision = Decision(overrides.max_wait_ns or 0, max_batch,
                                 overrides.spin_ns if overrides.spin_ns is not None else 0,
                                 overrides.threads or 1)
        self.spin_mode = SLEEP
        #: The mode the runnable tasks alone give (the segment's own
        #: processes aside), with its margin.
        self.load_mode = SLEEP
        #: The spin trial's verdict: None (none yet: the rule's budget),
        #: True (the long budget won), False (it lost).
        self.spin_long: Optional[bool] = None
        self.why_spin = "measuring"
        self.runnable: Optional[float] = None
        self.cost: Optional[Cost] = None
        self.rate = 0.0           # requests/s, smoothed
        self.population = 1       # requests that can be outstanding at once
        self.small_batch = 0.0    # lower quartile of requests per call
        self.busy = 0.0           # share of the time in model calls (summed over calls in flight)
        self.clients = 0
        self.cpus = 0
        self.replicas = 1
        self.trial: Optional[Trial] = None
        self.phase = "measuring"
        self.why_wait = "measuring the model and the arrivals"
        self.why_threads = "measuring"
        #: What the trials measured (None: they have not run).
        self.load: Optional[Load] = None
        self._prev: Optional[Reading] = None
        #: (window's start, its end, its calls as _as_calls)
        self._recent: List[Tuple[int, int, np.ndarray]] = []
        self._changed_at: Optional[int] = None   # when the load was first seen changed
        self._paused = False                      # the clients paused in the last window
        self._now = 0                             # the last reading's time
        #: When the settings in force last changed (a trial's verdict that
        #: adopted its candidate, or trials started afresh), and why.
        self.changed_ns: Optional[int] = None
        self.why_changed = "measuring"
        #: When the current (or last) trials began, and how long they took.
        self._trials_ns = 0
        self.settle_s: Optional[float] = None
        self.settled_ns: Optional[int] = None

    # -- the reading of one window ---------------------------------------------

    def tick(self, r: Reading) -> Decision:
        prev, self._prev = self._prev, r
        window = _as_calls(r.calls)
        # A window counts for a trial only if requests came all through it:
        # one in which the clients paused served for part of its time,
        # and so does the one after it (it began while they were away).
        served = len(window) > 0 and not (r.paused or self._paused)
        self._paused = r.paused
        # A window starts at the reading before it; the first one (no
        # reading before it) at its first call.
        start = prev.now_ns if prev is not None else \
            int(window[:, 0].min()) if len(window) else r.now_ns
        self._recent.append((min(start, r.now_ns), r.now_ns, window))
        self._recent = [w for w in self._recent if r.now_ns - w[1] < HORIZON_NS]
        self.clients, self.cpus, self.replicas = r.clients, r.cpus, max(1, r.replicas)
        self._now = r.now_ns
        self._spin(r)
        if prev is None or r.now_ns <= prev.now_ns:
            return self.decision
        rate = (r.requests - prev.requests) * 1e9 / (r.now_ns - prev.now_ns)
        self.rate = rate if self.rate == 0 else 0.5 * (self.rate + rate)
        calls = np.concatenate([c for _, _, c in self._recent])
        if len(calls):
            self.cost = Cost.fit(calls, self.cost)
            self._batches(calls[:, 3])
            span = r.now_ns - self._recent[0][0]
            self.busy = float(calls[:, 1].sum()) / span if span > 0 else 0.0
        if self.trial is not None:
            if not served:
                # Nothing was served, or not all through the window (the
                # clients paused or left): the window tells the trial
                # nothing, and the setting in force stays for the next one.
                pass
            elif _moved(self.trial.clients, r.clients):
                # Not the load the trial is measuring: the window does not
                # count, and the trial starts over once the change has
                # lasted HORIZON_NS.  Clients attaching one by one, or a
                # worker restarting, pass; a new load stays.
                if self._changed_at is None:
                    self._changed_at = r.now_ns
                elif r.now_ns - self._changed_at >= HORIZON_NS:
                    self._start_trials()
            else:
                self._changed_at = None
                self._trial_window(rate)
        elif served and self.cost is not None and self._lasting_change(r.now_ns):
            self._start_trials()
        return self.decision

    def follow(self, r: Reading, d: Decision, leader: int) -> None:
        """A reading of a replica that applies another's decision ``d``
        (ServingTuner): it measures the cost of its calls for its report
        and runs no trials; the overrides the caller fixed stay its own.
        Should it lead later, its trials start afresh."""
        self.clients, self.cpus, self.replicas = r.clients, r.cpus, max(1, r.replicas)
        self._now = r.now_ns
        window = _as_calls(r.calls)
        if len(window):
            self.cost = Cost.fit(window, self.cost)
        o = self.overrides
        d = Decision(o.max_wait_ns if o.max_wait_ns is not None else d.max_wait_ns,
                     d.batch_cap, o.spin_ns if o.spin_ns is not None else d.spin_ns,
                     o.threads or d.threads)
        if d != self.decision:
            self._mark(f"following replica {leader}")
        self.decision = d
        self.trial = None
        self.load = None  # leading later starts with trials
        self._prev = None
        self.phase = f"following replica {leader}"

    def _lasting_change(self, now_ns: int) -> bool:
        """The load has differed from the trials' for HORIZON_NS; before
        the first trials, it has been served for HORIZON_NS.  Clients that
        start together send their first requests at once, and the batches
        of that burst hold every one of them: a decision read from them
        alone is greedy for any model."""
        if not self._changed():
            self._changed_at = None
            return False
        if self._changed_at is None:
            self._changed_at = now_ns
        return now_ns - self._changed_at >= HORIZON_NS

    def _batches(self, requests: np.ndarray) -> None:
        """The smaller batches and the population, from the requests per
        call (not the rows padded to a bucket: those overstate what a
        batch gathered)."""
        self.small_batch = _lower_quartile(requests)
        largest = int(requests.max())
        d = self.decision
        if d.max_wait_ns and d.batch_cap < self.max_batch and \
                np.mean(requests >= d.batch_cap) > 0.5:
            # Waiting, and most calls stop at the cap: the population
            # outgrew the estimate.
            largest = 2 * d.batch_cap * d.threads * self.replicas
        self.population = min(self.max_batch, max(self.clients, largest, 1))

    def _spin(self, r: Reading) -> None:
        """The spin mode from the runnable tasks, smoothed (RUNNABLE_SMOOTHING);
        the mode they give changes once the level is half a task past its
        region.  The segment's own processes (the clients and the
        evaluator) count at least as the ``_ring`` rule counts them, so
        that many clients, who make no spin pay, hold the mode still
        however the level moves.  The mode sets the evaluator's budget
        (unless the caller fixed it) and, published as the crowding
        (:meth:`crowding`), bounds the clients' spins."""
        first = self.runnable is None
        x = r.runnable
        self.runnable = x if self.runnable is None else \
            self.runnable + RUNNABLE_SMOOTHING * (x - self.runnable)
        level, cpus = self.runnable, max(1, r.cpus)
        lo, hi = {SPIN: (-math.inf, cpus), YIELD: (cpus, cpus + 1),
                  SLEEP: (cpus + 1, math.inf)}[self.load_mode]
        if first or not lo - 0.5 < level <= hi + 0.5:
            self.load_mode = spin_mode(level, cpus)
        own = spin_mode(r.clients + 1, cpus)
        self.spin_mode = max(self.load_mode, own, key=_STRICTNESS.index)
        if self.overrides.spin_ns is not None:
            return
        if self.trial is not None and self.trial.knob == "spin":
            return  # the trial sets the budget
        self.decision = replace(self.decision, spin_ns=self._spin_budget(bool(self.spin_long)))

    def crowding(self) -> int:
        """The spin mode as the ``_ring`` crowding every client's spin rule
        reads: CROWD_SLEEP when the runnable tasks outnumber the CPUs by
        more than one, CROWD_YIELD by one, CROWD_NONE otherwise (and before
        the first reading)."""
        if self.runnable is None:
            return _ring.CROWD_NONE
        return CROWDING[self.spin_mode]

    def _spin_budget(self, long: bool) -> int:
        """The evaluator's spin budget in the rule's mode: one wake-up's
        cost, or with ``long`` SPIN_LONG_WAKES of them (then yielding
        where the rule would sleep: a yielding spin gives the CPU to any
        task that wants it, and the trial measured that it pays)."""
        if long:
            flag = 0 if self.spin_mode == SPIN else self.spin_yield
            return self.wake_ns * SPIN_LONG_WAKES | flag
        return {SLEEP: 0, YIELD: self.wake_ns | self.spin_yield, SPIN: self.wake_ns}[self.spin_mode]

    # -- trials -----------------------------------------------------------------

    def _predicted(self, rows: float) -> float:
        """The cost of a call of ``rows`` rows by the current fit (its cost
        at the mean rows, scaled per row, while the split is unknown)."""
        c = self.cost
        assert c is not None
        if c.per_row is not None:
            return c.per_call + c.per_row * rows
        return c.at_mean * rows / c.mean_rows if c.mean_rows else c.at_mean

    def _changed(self) -> bool:
        """The load differs from the one the trials measured (_moves)."""
        return self.load is None or bool(self._moves())

    def _moves(self) -> List[str]:
        """What differs from the load the trials measured, by CHANGE_RATIO
        for the clients and the model's cost at the same rows (and by a
        wake-up's cost at least: the trials weigh the model's cost against
        wake-ups, and a call of a few µs moves by more than the ratio with
        the host's cache misses and steal), at all for the CPUs and the
        replicas; each as "what before -> now"."""
        m = self.load
        assert m is not None
        cost = self._predicted(m.rows)
        moved = [f"{name} {a:g} -> {b:g}" for name, a, b, far in (
            ("clients", m.clients, self.clients, _moved(m.clients, self.clients)),
            ("replicas", m.replicas, self.replicas, m.replicas != self.replicas),
            ("cpus", m.cpus, self.cpus, m.cpus != self.cpus)) if far]
        if _moved(m.cost, cost) and abs(cost - m.cost) >= self.wake_ns:
            moved.append(f"model µs per call {m.cost / 1e3:.0f} -> {cost / 1e3:.0f}")
        return moved

    def _what_changed(self) -> str:
        """Why the trials run again."""
        if self.load is None:
            return "the first trials"
        moved = self._moves()
        return "the load changed: " + ", ".join(moved) if moved else "the load changed"

    def _start_trials(self) -> None:
        """From the simplest settings: one call in flight, greedy."""
        self._changed_at = None
        self._trials_ns = self._now
        self._mark(f"trials from the simplest settings: {self._what_changed()}")
        if self.overrides.spin_ns is None:
            self.spin_long = None
        base = replace(self.decision, threads=self.overrides.threads or 1,
                       max_wait_ns=self.overrides.max_wait_ns or 0, batch_cap=self.max_batch,
                       spin_ns=self._spin_budget(False) if self.overrides.spin_ns is None
                       else self.decision.spin_ns)
        self.decision = base
        self.phase = "trials"
        if self.overrides.threads is None and self.max_threads > 1:
            self._begin("threads", base, replace(base, threads=2))
        else:
            self.why_threads = ("serving_threads set by the caller" if self.overrides.threads
                                else "one: the model's calls may not overlap (max_concurrency)")
            self._try_waiting()

    def _mark(self, why: str) -> None:
        """The settings in force change now (not a trial's alternation)."""
        self.changed_ns = self._now
        self.why_changed = why

    def _begin(self, knob: str, base: Decision, candidate: Decision) -> None:
        self.trial = Trial(knob, base, candidate, self.clients)
        self._use(candidate, knob)

    def _use(self, d: Decision, knob: str) -> None:
        """A trial's setting in force: whole for the spin trial; for the
        others, with the spin budget the rule keeps setting (_spin)."""
        self.decision = d if knob == "spin" else replace(d, spin_ns=self.decision.spin_ns)

    def _trial_window(self, rate: float) -> None:
        t = self.trial
        assert t is not None
        t.rates.append(rate)
        decided = t.verdict() if len(t.rates) % 2 == 0 else None
        if decided is None:
            self._use(t.candidate if t.next_is_candidate() else t.base, t.knob)
            return
        self.trial = None
        won = decided
        keep = t.candidate if won else t.base
        self._use(keep, t.knob)
        self.rate = t.mean(won)   # what the setting kept serves
        verdict = f"{t.gain():+.0%}, ahead in {t.wins()} of {t.pairs()} window pairs"
        if not won and t.wins() * 3 >= t.pairs():
            # Ahead in a third of the pairs or more: the two serve alike
            # as far as these windows can tell, and the simpler stays.
            verdict += " (within noise: the simpler setting stays)"
        if won:
            self._mark(f"{t.knob}: {verdict}")
        if t.knob == "spin":
            self.spin_long = won
            self.why_spin = (f"{'long' if won else 'short'}: a spin of {SPIN_LONG_WAKES} "
                             f"wake-ups served {verdict} against one wake-up's")
            self._settle()
            return
        if t.knob == "threads":
            self.why_threads = (f"{keep.threads}: {t.candidate.threads} calls in flight served "
                                f"{verdict} against {t.base.threads}")
            if won and keep.threads < self.max_threads:
                self._begin("threads", keep, replace(keep, threads=keep.threads + 1))
                return
            self._try_waiting()
            return
        if t.candidate.threads == t.base.threads:
            self.why_wait = (f"waiting: it served {verdict} against greedy" if won else
                             f"greedy: waiting served {verdict} against greedy")
        else:
            trial = (f"one call in flight and a wait served {verdict} against "
                     f"{t.base.threads} calls, greedy")
            self.why_wait = f"waiting: {trial}" if won else f"greedy: {trial}"
            if won:
                self.why_threads = f"1: {trial}"
        self._try_spinning()

    def _try_spinning(self) -> None:
        """The long spin budget against the rule's (one wake-up's cost, or
        none): tried where ``_ring``'s own rule lets the evaluator spin at
        all (the attached clients at most one more than the CPUs)."""
        if self.overrides.spin_ns is not None:
            self.why_spin = "evaluator_spin_us set by the caller"
            self._settle()
            return
        if self.clients > max(1, self.cpus):
            self.why_spin = (f"{self.spin_mode}: {self.clients} clients on {self.cpus} CPUs "
                             "(the evaluator does not spin)")
            self.spin_long = False
            self._settle()
            return
        d = self.decision
        self._begin("spin", replace(d, spin_ns=self._spin_budget(False)),
                    replace(d, spin_ns=self._spin_budget(True)))

    def _try_waiting(self) -> None:
        """Waiting is tried where it can pay (the module's docstring): the
        requests one fixed cost gathers outnumber those of the smaller
        batches, and the population is larger than those batches.  With
        more than one call in flight the gate reads per call; where it fails
        there but passes for one call, one call and a wait is tried against
        the calls in flight, greedy: both use a fixed cost's time, one by
        overlapping calls, the other by gathering for one, and the trial of
        calls in flight ran greedy."""
        if self.overrides.max_wait_ns is not None:
            self.why_wait = "max_wait_us set by the caller"
            self._try_spinning()
            return
        assert self.cost is not None
        d = self.decision
        fixed = self.cost.known_fixed
        if self.cost.per_row is None:
            # The calls have not spanned sizes far enough apart to split
            # their cost: the whole of one bounds its fixed part.  A closed
            # loop of a model whose cost is all per call (a GPU's) keeps
            # its greedy batches within a factor of two of each other,
            # which is where waiting pays most; the trial decides.
            fixed = self.cost.at_mean
        # This replica's part: the arrivals and the population are every
        # replica's together, and the replicas take turns collecting.
        gathered = self.rate * fixed / 1e9 / self.replicas
        share = math.ceil(self.population / self.replicas)
        alone = d.threads > 1 and self.overrides.threads is None \
            and gathered / d.threads <= self.small_batch < gathered
        if not alone:
            gathered /= d.threads
        busy = self.busy / d.threads
        if fixed <= 0 or share <= self.small_batch or \
                gathered <= self.small_batch and busy < BUSY_SHARE:
            self.why_wait = (
                "greedy: the calls show no fixed cost" if fixed <= 0 else
                f"greedy: the batches hold every request ({share})"
                if share <= self.small_batch else
                f"greedy: one fixed cost ({fixed / 1e3:.0f} µs) gathers {gathered:.1f} requests, "
                f"the smaller batches hold {self.small_batch:.0f}, and the model computes "
                f"{busy:.0%} of the time")
            self._try_spinning()
            return
        threads = 1 if alone else d.threads
        # The even split of the population over every call in flight of
        # every replica: a replica waits for its part, not for all of it.
        cap = max(1, math.ceil(self.population / (threads * self.replicas)))
        self._begin("wait", d, replace(d, threads=threads, max_wait_ns=max(1, int(fixed)),
                                       batch_cap=cap))

    def _settle(self) -> None:
        self.phase = "settled"
        assert self.cost is not None
        rows = self.cost.mean_rows
        self.load = Load(self.clients, rows, self._predicted(rows), self.cpus, self.rate,
                         self.replicas)
        self.settle_s = (self._now - self._trials_ns) / 1e9
        self.settled_ns = self._now

    # -- what stats() shows ---------------------------------------------------------

    def report(self) -> Dict[str, Any]:
        c = self.cost
        d = self.decision
        return {
            "phase": self.phase if self.trial is None else f"trial: {self.trial.knob}",
            "model_us_per_call": round(c.known_fixed / 1e3, 2) if c else None,
            "model_us_per_row": (round(c.per_row / 1e3, 3)
                                 if c is not None and c.per_row is not None else None),
            "model_us_at_mean_batch": round(c.at_mean / 1e3, 2) if c else None,
            "mean_batch": round(c.mean_rows, 2) if c else None,
            "arrivals_per_s": round(self.rate, 1),
            "model_busy": round(self.busy, 2),
            "population": self.population,
            "max_wait_us": d.max_wait_ns / 1e3,
            "batch_cap": d.batch_cap,
            "serving_threads": d.threads,
            "spin": self.spin_mode if self.overrides.spin_ns is None else "set by the caller",
            "spin_us": (d.spin_ns & ~self.spin_yield) / 1e3,
            "runnable": round(self.runnable, 2) if self.runnable is not None else None,
            # What the clients' spins are held to (published in the segment).
            "crowding": "none" if self.crowding() == _ring.CROWD_NONE else self.spin_mode,
            "cpus": self.cpus,
            "clients": self.clients,
            "why_wait": self.why_wait,
            "why_threads": self.why_threads,
            "why_spin": self.why_spin,
            "replicas": self.replicas,
            # When the settings last changed (s before this report) and why.
            "changed_s_ago": (round((self._now - self.changed_ns) / 1e9, 2)
                              if self.changed_ns is not None else None),
            "why_changed": self.why_changed,
            # How long the last trials took, from their start to settled,
            # and when they settled (s before this report).
            "settle_s": round(self.settle_s, 2) if self.settle_s is not None else None,
            "settled_s_ago": (round((self._now - self.settled_ns) / 1e9, 2)
                              if self.settled_ns is not None else None),
            # The decision as the serving loop applies it: other replicas
            # follow the leader's (ServingTuner).
            "decision": [d.max_wait_ns, d.batch_cap, d.spin_ns, d.threads],
        }


class Board:
    """Where a serving loop's tuner publishes its report: replica
    ``replica``'s text in the segment (``Segment.set_report``), as JSON, so
    that every process reading the segment sees what the tuner chose and
    why: the owner's and a worker's ``stats()``, ``shmeval stats`` and the
    monitor."""

    def __init__(self, seg: Any, replica: int) -> None:
        self.seg = seg
        self.replica = replica

    def write(self, report: Dict[str, Any]) -> None:
        self.seg.set_report(self.replica, fit_report(report, _ring.REPORT_BYTES))


#: Most calls each serving thread records per housekeeping period
#: (``Server.record_calls``): the cost fit needs a median per batch size,
#: which a thousand calls give; a fast model makes hundreds of thousands a
#: second, and fitting them all held the serving thread for about half of
#: each period.
CALLS_PER_PERIOD = 1024


#: A follower replica's readings come this share of a period after the
#: leader's, so that it reads the decision the leader has just published
#: (the replicas' readings are on one grid of CLOCK_MONOTONIC, which every
#: process of the machine shares).
FOLLOW_LAG = 0.05


class ServingTuner:
    """Feeds a :class:`Tuner` from a serving loop.

    With several replicas one tuner decides for them all: the leader, the
    serving replica of the lowest index.  The others follow: each reading
    they apply the decision the leader published with its report (the
    report's ``decision``).  Independent tuners would each run trials
    while the others run theirs, and each trial's windows, which count the
    requests of every replica, would measure the others' settings as much
    as its own: verdicts that differ from run to run, and trials that
    start over.  Readings fall on one grid of the monotonic clock, the
    followers' ``FOLLOW_LAG`` of a period after the leader's, so that the
    replicas switch settings within a small part of a window of each
    other.

    Each of ``servers`` (the loop's ``_ring.Server`` objects, or anything
    with their ``record_calls`` and ``take_calls``) records the start,
    duration, rows and requests of its model calls in C, where
    ``Server.serve`` times them anyway.  The loop calls :meth:`tick` at
    its housekeeping (a reading of those calls, the segment's counters,
    the CPUs and the runnable tasks once per ``period_ns``; the report goes
    to the board), and :meth:`wait_turn` before each round of serving,
    which parks the serving threads the decision does not use."""

    def __init__(self, seg: Any, model: Any, servers: Sequence[Any], max_batch: int,
                 threads: int, overrides: Overrides, board: Optional[Board], period_ns: int,
                 spin_yield: int, replica: int = 0) -> None:
        self.seg = seg
        self.replica = replica
        #: The replica whose decision this one applies (itself: it decides).
        self.leader = replica
        self.servers = list(servers)
        for s in self.servers:
            s.record_calls(CALLS_PER_PERIOD)
        self.tuner = Tuner(max_batch, min(threads, model_concurrency(model)), wake_cost_ns(),
                           overrides, spin_yield)
        self.board = board
        self.period_ns = period_ns
        self.next_tick = 0
        #: Set by the serving loop when a whole idle timeout passed without
        #: a request (the next reading's ``paused``).
        self.paused = False
        self.turns = threading.Condition()
        self.stopped = False
        if board is not None:  # stats() shows the tuner from the start, measuring
            self.tuner.cpus = usable_cpus()
            board.write(self.tuner.report())

    @property
    def decision(self) -> Decision:
        return self.tuner.decision

    def next_at(self, now_ns: int) -> int:
        """When the next reading is due: the next point of the period's
        grid (a follower's: FOLLOW_LAG of a period later)."""
        lag = 0 if self.leader == self.replica else int(self.period_ns * FOLLOW_LAG)
        return (now_ns - lag) // self.period_ns * self.period_ns + self.period_ns + lag

    def _serving(self) -> List[int]:
        """The replicas serving now (this one among them)."""
        if self.seg.replicas_serving() <= 1:
            return [self.replica]
        return [r["replica"] for r in self.seg.replicas() if r["state"] == "serving"] \
            or [self.replica]

    def _leader_decision(self, leader: int) -> Optional[Decision]:
        """The decision replica ``leader`` last published, or None."""
        report = read_report(self.seg, leader)
        try:
            w, cap, spin, threads = report["decision"]  # type: ignore[index]
        except (TypeError, ValueError, KeyError):
            return None
        return Decision(int(w), min(int(cap), self.tuner.max_batch), int(spin),
                        max(1, min(int(threads), self.tuner.max_threads)))

    def tick(self, now_ns: int) -> None:
        """A reading, if a period passed since the last (several serving
        threads each reach housekeeping)."""
        if now_ns < self.next_tick:
            return
        serving = self._serving()
        self.leader = min(serving)
        self.next_tick = self.next_at(now_ns)
        calls = np.concatenate([s.take_calls() for s in self.servers]) if self.servers \
            else np.empty((0, 4), np.int64)
        cpus = usable_cpus()
        before = self.tuner.decision.threads
        paused, self.paused = self.paused, False
        reading = Reading(now_ns, int(self.seg.stat("requests")), int(self.seg.n_attached()),
                          cpus, runnable_tasks(cpus), calls, paused, len(serving))
        followed = self._leader_decision(self.leader) if self.leader != self.replica else None
        if followed is None:
            self.tuner.tick(reading)
            self.seg.set_crowding(self.tuner.crowding())
        else:
            self.tuner.follow(reading, followed, self.leader)
        if self.tuner.decision.threads != before:
            with self.turns:
                self.turns.notify_all()
        if self.board is not None:
            self.board.write(self.tuner.report())

    def wait_turn(self, index: int, timeout_s: float) -> bool:
        """Parks serving thread ``index`` while the decision uses fewer
        threads; True once it may serve, False when it should look at the
        stop flag (after ``timeout_s``, or :meth:`release`)."""
        if index < self.tuner.decision.threads:
            return True
        with self.turns:
            if not self.stopped:
                self.turns.wait(timeout_s)
        return index < self.tuner.decision.threads and not self.stopped

    def release(self) -> None:
        """Wakes every parked thread (the loop is stopping)."""
        with self.turns:
            self.stopped = True
            self.turns.notify_all()
