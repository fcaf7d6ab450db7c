"""The tuner (shmeval.tuning): its decisions from made-up measurements, and
its place in a running evaluator.

The decisions are fed :class:`Reading` objects built here (a fake clock,
calls of a stated cost, a stated number of requests served per window), so
every expectation is exact and nothing is timed:
- the cost fit recovers a fixed and a per-row cost, and says when it cannot;
- waiting is tried only where the module's rule says it can pay, and kept
  only when it wins enough window pairs of its trial (a sequential sign
  test of three looks);
- a second call in flight is tried only for a model that allows it;
- once settled, the choice holds under the same load whatever its figures
  do (no oscillation), and the trials run again when the clients, the
  model's cost or the CPUs change by CHANGE_RATIO;
- the spin mode follows the runnable tasks with its half-task margin;
- fixed settings are left alone; "auto" and numbers are validated.
The last tests run an evaluator: stats()["tuner"] says what was chosen, and
a caller's settings switch the tuner off.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Callable, List, Sequence

import numpy as np
import pytest

import shmeval
from shmeval import _ring, checks, stats, tuning
from shmeval.tuning import (CHANGE_RATIO, TRIAL_PAIRS, Board, Cost, Decision, Overrides, Reading,
                            Tuner)
from shmeval.waiting import SLEEP, SPIN, SPIN_LONG_WAKES, YIELD
from helpers import INPUT_SHAPE, OUTPUTS, fake_factory, fake_model, make_state, run_python

PERIOD = 200_000_000   # ns between readings (the evaluator's housekeeping period)
#: Readings before the first trials: the load served for a horizon first.
FIRST = tuning.HORIZON_NS // PERIOD
YIELD_FLAG = 1 << 63
WAKE = 20_000


def calls_of(rows: Sequence[int], fixed_ns: float, per_row_ns: float,
             start: int = 0) -> List[tuple[int, int, int]]:
    """Calls spread evenly over one period from ``start`` (the model idle
    between them most of the time)."""
    step = PERIOD // max(1, len(rows))
    return [(start + i * step, int(fixed_ns + per_row_ns * n), n) for i, n in enumerate(rows)]


class Feed:
    """Drives a Tuner with readings one period apart.  ``rate(decision)``:
    requests per second served under a decision; ``rows``: the batch sizes
    of each period's calls."""

    def __init__(self, tuner: Tuner, clients: int = 16, cpus: int = 2,
                 runnable: float = 1.0) -> None:
        self.tuner = tuner
        self.now = 0
        self.requests = 0
        self.clients, self.cpus, self.runnable = clients, cpus, runnable

    def tick(self, rate: Callable[[Decision], float], rows: Sequence[int], fixed_ns: float,
             per_row_ns: float, paused: bool = False) -> Decision:
        self.now += PERIOD
        self.requests += int(rate(self.tuner.decision) * PERIOD / 1e9)
        r = Reading(self.now, self.requests, self.clients, self.cpus, self.runnable,
                    calls_of(rows, fixed_ns, per_row_ns, self.now), paused)
        return self.tuner.tick(r)

    def run(self, n: int, rate: Callable[[Decision], float], rows: Sequence[int],
            fixed_ns: float, per_row_ns: float) -> List[Decision]:
        return [self.tick(rate, rows, fixed_ns, per_row_ns) for _ in range(n)]


def waiting_pays(d: Decision) -> float:
    """A convoy: greedy serves 10,000/s, waiting 13,000/s."""
    return 13_000.0 if d.max_wait_ns else 10_000.0


def waiting_costs(d: Decision) -> float:
    return 9_000.0 if d.max_wait_ns else 10_000.0


CONVOY = [1, 3] * 20          # greedy's alternating small and large batches of 4 clients
FIXED, PER_ROW = 200_000, 5_000


# --- the cost fit -----------------------------------------------------------------------


def test_cost_fit_recovers_fixed_and_per_row_costs() -> None:
    rows = [1, 2, 4, 8, 16, 32] * 10
    calls = calls_of(rows, 150_000, 3_000)
    # Outliers (a preempted call) do not move medians.
    calls += [(0, 10_000_000, 4), (0, 9_000_000, 16)]
    c = Cost.fit(calls)
    assert c is not None and c.per_row is not None
    assert c.per_call == pytest.approx(150_000, rel=1e-6)
    assert c.per_row == pytest.approx(3_000, rel=1e-6)


def test_cost_split_unknown_while_calls_have_one_size() -> None:
    c = Cost.fit(calls_of([16] * 50, 150_000, 3_000))
    assert c is not None and c.per_row is None
    assert c.at_mean == 150_000 + 16 * 3_000
    assert c.known_fixed == 0.0   # nothing then argues for waiting
    # A split learnt earlier is kept, scaled to what calls cost now.
    prior = Cost.fit(calls_of([1, 4, 16] * 10, 100_000, 10_000))
    assert prior is not None
    c2 = Cost.fit(calls_of([16] * 50, 200_000, 20_000), prior)
    assert c2 is not None and c2.per_row is not None
    assert c2.per_call == pytest.approx(200_000) and c2.per_row == pytest.approx(20_000)


def test_cost_fit_without_calls() -> None:
    assert Cost.fit([]) is None


# --- waiting ------------------------------------------------------------------------------


def settle(feed: Feed, rate: Callable[[Decision], float], rows: Sequence[int],
           fixed: float = FIXED, per_row: float = PER_ROW, ticks: int = 40) -> List[Decision]:
    return feed.run(ticks, rate, rows, fixed, per_row)


def test_waiting_is_tried_and_kept_when_it_wins() -> None:
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=4)
    seen = settle(feed, waiting_pays, CONVOY)
    assert t.phase == "settled"
    assert t.decision.max_wait_ns == pytest.approx(FIXED, rel=0.01)  # one fixed cost
    assert t.decision.batch_cap == 4                                # the population
    assert t.why_wait.startswith("waiting")
    # The trial alternated candidate and base, then the choice held.
    waits = [d.max_wait_ns > 0 for d in seen]
    first = waits.index(True)
    assert waits[first:first + 2 * TRIAL_PAIRS] == [True, False] * TRIAL_PAIRS
    assert all(waits[first + 2 * TRIAL_PAIRS:])


def test_waiting_is_dropped_when_it_loses() -> None:
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=4)
    seen = settle(feed, waiting_costs, CONVOY)
    assert t.phase == "settled" and t.decision.max_wait_ns == 0
    assert t.decision.batch_cap == 256
    assert t.why_wait.startswith("greedy: waiting served")
    assert not any(d.max_wait_ns for d in seen[-20:])


T, F = True, False


@pytest.mark.parametrize("wins, adopted, pairs", [
    ([T, T, T], True, 3),                          # all of the first three
    ([F, F, F], False, 3),                         # none: dropped at once
    ([T, F, F], False, 3),                         # one of three: dropped at once
    ([T, T, F, T, T, T], True, 6),                 # five of six
    ([T, F, T, F, F, T], False, 6),                # three of six: dropped
    ([F, T, T, T, T, T], True, 6),                 # two of three, then five of six
    ([T, F, T, T, F, T, T, T, T], True, 9),        # four of six, then seven of nine
    ([T, F, T, T, F, T, T, F, T], False, 9),       # four of six, then six of nine
])
def test_the_sequential_sign_test(wins: List[bool], adopted: bool, pairs: int) -> None:
    """Waiting ahead by a lot in the windows it wins: what counts is in how
    many pairs it is ahead, and the trial takes three pairs unless it is
    ahead in two of them, six then, nine when six leave it open."""
    outcome = iter(wins + [True] * 100)
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=4)
    waits: List[bool] = []

    def rate(d: Decision) -> float:
        waits.append(bool(d.max_wait_ns))
        if d.max_wait_ns:
            return 20_000.0 if next(outcome) else 9_000.0
        return 10_000.0

    settle(feed, rate, CONVOY)
    assert bool(t.decision.max_wait_ns) == adopted
    first = waits.index(True)
    trial = waits[first:first + 2 * pairs]
    assert trial == [True, False] * pairs
    assert all(w == adopted for w in waits[first + 2 * pairs:])
    assert t.why_wait.endswith("against greedy") and f"of {pairs} window pairs" in t.why_wait


def trial_odds(p: float, looks: int = 3) -> tuple[float, float]:
    """(chance of adoption, mean pairs) of a trial whose candidate is ahead
    in each pair with chance p, from Trial.verdict on every sequence of
    pairs it can see; with looks=2, a trial still open after the second
    look is dropped."""
    d = Decision(0, 256, 0, 1)

    def walk(rates: List[float], chance: float) -> tuple[float, float]:
        t = tuning.Trial("wait", d, d, 4, rates)
        decided = t.verdict()
        if decided is None and t.pairs() == looks * TRIAL_PAIRS:
            decided = False
        if decided is not None:
            return chance * decided, chance * t.pairs()
        ahead = walk(rates + [2.0, 1.0], chance * p)
        behind = walk(rates + [1.0, 2.0], chance * (1 - p))
        return ahead[0] + behind[0], ahead[1] + behind[1]

    return walk([], 1.0)


def test_the_sign_tests_odds_are_as_documented() -> None:
    """The figures in the comment on TRIAL_PAIRS."""
    alike, alike_pairs = trial_odds(0.5)
    assert alike == pytest.approx(0.19, abs=0.005)    # about one time in five
    assert alike_pairs == pytest.approx(4.55, abs=0.01)
    adopt, pairs = trial_odds(0.85)
    adopt_two, pairs_two = trial_odds(0.85, looks=2)
    assert adopt == pytest.approx(0.88, abs=0.005)
    assert adopt_two == pytest.approx(0.81, abs=0.005)
    assert pairs - pairs_two == pytest.approx(0.3, abs=0.05)


def test_no_waiting_where_the_batches_hold_what_a_fixed_cost_gathers() -> None:
    """The null model: a few µs of fixed cost gather less than one row."""
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=16)
    seen = settle(feed, lambda d: 200_000.0, [8, 12, 16, 16] * 100, fixed=3_000, per_row=300)
    assert not any(d.max_wait_ns for d in seen)
    assert t.why_wait.startswith("greedy: one fixed cost")


def test_waiting_counts_the_requests_not_the_padded_rows() -> None:
    """A model with buckets: batches of 3 and 5 requests run as 4 and 8
    rows.  One fixed cost gathers 3.6 requests, more than the smaller
    batches hold (3), so waiting is tried (and kept: it wins); judged by the
    padded rows (4) it would not be."""
    t = Tuner(256, 1, WAKE)
    now = requests = 0
    for _ in range(40):
        now += PERIOD
        rate = 22_000.0 if t.decision.max_wait_ns else 18_000.0
        requests += int(rate * PERIOD / 1e9)
        calls = [(now + i, FIXED + PER_ROW * rows, rows, n)
                 for i, (n, rows) in enumerate([(3, 4), (5, 8)] * 20)]
        t.tick(Reading(now, requests, 8, 2, 1.0, calls))
    assert t.phase == "settled"
    assert t.decision.max_wait_ns > 0, t.why_wait
    assert t.why_wait.startswith("waiting")


@pytest.mark.parametrize("back_to_back", [True, False])
def test_waiting_is_tried_where_the_model_holds_up_a_closed_loop(back_to_back: bool) -> None:
    """Two clients, mostly batches of 1.  Where the calls run nearly back
    to back (the model computes 84% of the time) the rate measured times
    one fixed cost (200 µs) is 0.93 requests, fewer than the smaller
    batches hold; but the clients are held up by the model (each request
    waits for the call before it), so waiting is tried, and kept since it
    wins.  Where the model is idle most of the time it is not tried."""
    t = Tuner(256, 1, WAKE)
    now = requests = 0
    for _ in range(40):
        calls, start = [], now
        while start < now + PERIOD:
            n = 2 if len(calls) % 8 == 7 else 1
            cost = FIXED + PER_ROW * n
            calls.append((start, cost, n))
            start += cost + (40_000 if back_to_back else 5 * cost)
        served = sum(n for _, _, n in calls)
        requests += int(served * (1.4 if t.decision.max_wait_ns else 1.0))
        now += PERIOD
        t.tick(Reading(now, requests, 2, 2, 1.0, calls))
    assert t.phase == "settled"
    if back_to_back:
        assert t.busy == pytest.approx(0.84, abs=0.01)
        assert t.decision.max_wait_ns > 0, t.why_wait
        assert t.decision.batch_cap == 2
    else:
        assert t.busy == pytest.approx(1 / 6, abs=0.01)
        assert t.decision.max_wait_ns == 0
        assert "the model computes 17% of the time" in t.why_wait, t.why_wait


def test_no_waiting_when_every_request_is_in_each_batch() -> None:
    """16 clients, every batch holds all 16: nothing to wait for."""
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=16)
    seen = settle(feed, lambda d: 60_000.0, [16] * 20 + [15] * 3 + [8], fixed=FIXED)
    assert not any(d.max_wait_ns for d in seen)


def test_no_waiting_without_a_fixed_cost() -> None:
    """Calls of 1 to 8 rows that cost only per row: nothing to wait for."""
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=16)
    seen = settle(feed, lambda d: 60_000.0, [1, 2, 4, 8] * 10, fixed=0.0)
    assert not any(d.max_wait_ns for d in seen)
    assert "no fixed cost" in t.why_wait


def test_calls_of_one_size_are_tried_with_their_whole_cost_as_the_wait() -> None:
    """Every call of one size (a closed loop's greedy batches of a model
    whose cost is per call stay within a factor of two): the split is
    unknown, the whole call bounds its fixed part, and the trial decides."""
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=16)
    settle(feed, lambda d: 4 * waiting_pays(d), [8] * 40)
    assert t.cost is not None and t.cost.per_row is None
    assert t.decision.max_wait_ns == pytest.approx(FIXED + 8 * PER_ROW, rel=0.01), t.why_wait
    assert t.why_wait.startswith("waiting"), t.why_wait


def test_the_cap_grows_when_batches_stop_at_it() -> None:
    """Clients sending several rows at once: the population is more than
    the clients, and a waiting tuner that caps too low raises the cap."""
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=4)
    settle(feed, waiting_pays, CONVOY)
    assert t.decision.batch_cap == 4
    feed.run(3, waiting_pays, [4] * 40, FIXED, PER_ROW)
    assert t.population >= 8


# --- calls in flight ------------------------------------------------------------------------


def test_a_second_call_in_flight_is_kept_when_it_wins() -> None:
    t = Tuner(256, 2, WAKE)
    feed = Feed(t, clients=16)
    seen = settle(feed, lambda d: 10_000.0 * d.threads, [16] * 40)
    assert t.decision.threads == 2
    threads = [d.threads for d in seen]
    first = threads.index(2)
    assert threads[first:first + 2 * TRIAL_PAIRS] == [2, 1] * TRIAL_PAIRS
    assert all(x == 2 for x in threads[first + 2 * TRIAL_PAIRS:])
    assert t.why_threads.startswith("2:")


def test_a_second_call_is_dropped_when_it_does_not_pay() -> None:
    t = Tuner(256, 2, WAKE)
    feed = Feed(t, clients=16)
    settle(feed, lambda d: 10_000.0 / d.threads, [16] * 40)
    assert t.decision.threads == 1


def one_call_waiting_pays(d: Decision) -> float:
    """Four closed-loop clients: a second call in flight beats one greedy
    call, and one call that waits for the others beats both."""
    if d.max_wait_ns:
        return 14_000.0 if d.threads == 1 else 9_000.0
    return 11_000.0 if d.threads == 2 else 10_000.0


@pytest.mark.parametrize("wins", [True, False])
def test_one_call_and_a_wait_is_tried_against_calls_in_flight(wins: bool) -> None:
    """Two calls in flight won their trial; per call, one fixed cost gathers
    1.1 requests against batches of 2, but for one call 2.2: so one call
    and a wait is tried against two calls, greedy, and kept only if it
    wins."""
    t = Tuner(256, 2, WAKE)
    feed = Feed(t, clients=4)
    rate = one_call_waiting_pays if wins else (
        lambda d: 8_000.0 if d.max_wait_ns else one_call_waiting_pays(d))
    seen = settle(feed, rate, [2, 4] * 20)
    assert t.phase == "settled"
    assert any(d.threads == 1 and d.max_wait_ns for d in seen), t.why_wait
    if wins:
        assert (t.decision.threads, t.decision.batch_cap) == (1, 4)
        assert t.decision.max_wait_ns == pytest.approx(FIXED, rel=0.01)
        assert t.why_threads.startswith("1: one call in flight and a wait")
        assert t.why_wait.startswith("waiting: one call in flight")
    else:
        assert (t.decision.threads, t.decision.max_wait_ns) == (2, 0)
        assert t.why_threads.startswith("2:")
        assert t.why_wait.startswith("greedy: one call in flight")


def test_one_call_when_the_model_may_not_overlap() -> None:
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=16)
    seen = settle(feed, lambda d: 10_000.0 * d.threads, [16] * 40)
    assert all(d.threads == 1 for d in seen)
    assert "max_concurrency" in t.why_threads


def test_model_concurrency() -> None:
    class Overlapping:
        max_concurrency = 2

    class Odd:
        max_concurrency = "many"

    assert tuning.model_concurrency(Overlapping()) == 2
    assert tuning.model_concurrency(fake_model) == 1
    assert tuning.model_concurrency(Odd()) == 1


# --- holding, and changing with the load -----------------------------------------------------


def test_settled_choice_holds_while_the_load_does() -> None:
    """Once waiting is kept, its batches hold the whole population: the rule
    that proposed waiting would no longer, yet nothing changes."""
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=4)
    settle(feed, waiting_pays, CONVOY)
    chosen = t.decision
    # The batches are now full, the rate a little noisy: no trial, no change.
    noise = iter([1.0, 1.1, 0.95, 1.05, 0.9] * 40)
    seen = feed.run(100, lambda d: 13_000.0 * next(noise), [4] * 40, FIXED, PER_ROW)
    assert all(d.max_wait_ns == chosen.max_wait_ns and d.batch_cap == chosen.batch_cap
               for d in seen)
    assert t.phase == "settled"


@pytest.mark.parametrize("change", ["clients", "model cost", "cpus"])
def test_trials_rerun_when_the_load_changes(change: str) -> None:
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=4)
    settle(feed, waiting_pays, CONVOY)
    assert t.decision.max_wait_ns
    fixed = FIXED
    if change == "clients":
        feed.clients = 16
    elif change == "model cost":
        fixed = 2 * FIXED
    else:
        feed.cpus = 1
    # Waiting no longer pays under the new load: dropped.
    feed.run(30, waiting_costs, CONVOY, fixed, PER_ROW)
    assert t.decision.max_wait_ns == 0 and t.phase == "settled"


def test_small_changes_do_not_rerun_trials() -> None:
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=16)
    settle(feed, lambda d: 10_000.0, [16] * 40)
    assert t.phase == "settled"
    load = t.load
    feed.clients = int(16 * CHANGE_RATIO) - 1          # 19: within the ratio
    seen = feed.run(20, lambda d: 10_000.0, [16] * 40, FIXED * 1.1, PER_ROW)
    assert t.load is load and t.trial is None
    assert len({(d.max_wait_ns, d.threads) for d in seen}) == 1


def test_a_cheap_models_cost_moves_by_less_than_a_wake_up() -> None:
    """A call of a few µs that takes twice as long (a cache miss, the host's
    steal) changes nothing the trials weigh against a wake-up: no trials,
    however long it lasts.  A change by a wake-up or more does rerun them."""
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=16)
    fixed, per_row = WAKE / 8, WAKE / 400
    settle(feed, lambda d: 10_000.0, [16] * 40, fixed, per_row)
    load = t.load
    assert load is not None and t.trial is None
    feed.run(4 * tuning.HORIZON_NS // PERIOD, lambda d: 10_000.0, [16] * 40, 2 * fixed,
             2 * per_row)
    assert t.load is load and t.trial is None and t.phase == "settled"
    feed.run(4 * tuning.HORIZON_NS // PERIOD, lambda d: 10_000.0, [16] * 40, fixed + WAKE,
             per_row)
    assert t.load is not load


def test_a_passing_disturbance_runs_no_trials() -> None:
    """Calls twice as slow for less than HORIZON_NS (another program's
    burst): nothing; for longer: the trials run again.  The rate served
    alone, however much it moves, starts none."""
    t = Tuner(256, 2, WAKE)
    feed = Feed(t, clients=16)
    settle(feed, lambda d: 10_000.0, [16] * 40)
    load = t.load
    feed.run(20, lambda d: 5_000.0 if feed.now % 3 else 15_000.0, [16] * 40, FIXED, PER_ROW)
    assert t.load is load and t.trial is None
    short = (tuning.HORIZON_NS // PERIOD) - 1
    feed.run(short, lambda d: 5_000.0, [16] * 40, 2 * FIXED, 2 * PER_ROW)
    feed.run(10, lambda d: 10_000.0, [16] * 40, FIXED, PER_ROW)
    assert t.load is load and t.trial is None
    # Lasting: seen once the median call of the last HORIZON_NS is slower,
    # and acted on HORIZON_NS later.
    feed.run(2 * (short + 1) + 1, lambda d: 5_000.0, [16] * 40, 2 * FIXED, 2 * PER_ROW)
    assert t.trial is not None


def test_a_lasting_change_during_a_trial_starts_it_over() -> None:
    t = Tuner(256, 2, WAKE)
    feed = Feed(t, clients=16)
    feed.run(3 + FIRST, lambda d: 10_000.0 * d.threads, [16] * 40, FIXED, PER_ROW)
    assert t.trial is not None and t.trial.knob == "threads"
    counted = len(t.trial.rates)
    feed.clients = 64
    # Windows of another load do not count; the trial goes on until the
    # change has lasted HORIZON_NS, then starts over for the new load.
    feed.run(tuning.HORIZON_NS // PERIOD, lambda d: 10_000.0, [16] * 40, FIXED, PER_ROW)
    assert t.trial is not None and t.trial.clients == 16 and len(t.trial.rates) == counted
    feed.tick(lambda d: 10_000.0, [16] * 40, FIXED, PER_ROW)
    assert t.trial is not None and t.trial.clients == 64 and len(t.trial.rates) == 0


def test_clients_coming_back_do_not_start_a_trial_over() -> None:
    """The clients attach one by one after a pause (or a worker restarts):
    the windows served to fewer of them do not count, and the trial goes on
    where it was.  Restarting it at each such dip kept the trials from ever
    finishing in a benchmark whose workers reattach every few seconds."""
    t = Tuner(256, 2, WAKE)
    feed = Feed(t, clients=16)
    feed.run(3 + FIRST, lambda d: 10_000.0 * d.threads, [16] * 40, FIXED, PER_ROW)
    assert t.trial is not None and t.trial.knob == "threads"
    trial, counted = t.trial, len(t.trial.rates)
    for attached in (0, 1, 4, 9):
        feed.clients = attached
        feed.tick(lambda d: 0.0 if not feed.clients else 3_000.0, [1] * 4 if attached else [],
                  FIXED, PER_ROW)
    assert t.trial is trial and len(trial.rates) == counted
    feed.clients = 16
    settle(feed, lambda d: 10_000.0 * d.threads, [16] * 40)
    assert t.decision.threads == 2 and t.why_threads.startswith("2:")


def test_a_trial_waits_out_a_pause_of_the_clients() -> None:
    # The clients stop during the trial of a second call in flight (which
    # pays) and come back: the empty windows neither decide the trial nor
    # start it over, and it is decided on the windows with requests.
    t = Tuner(256, 2, WAKE)
    feed = Feed(t, clients=16)
    feed.run(3 + FIRST, lambda d: 10_000.0 * d.threads, [16] * 40, FIXED, PER_ROW)
    assert t.trial is not None and t.trial.knob == "threads"
    counted = len(t.trial.rates)
    feed.clients = 0
    feed.run(4 * TRIAL_PAIRS, lambda d: 0.0, [], FIXED, PER_ROW)
    assert t.trial is not None and t.trial.knob == "threads"
    assert len(t.trial.rates) == counted
    feed.clients = 16
    settle(feed, lambda d: 10_000.0 * d.threads, [16] * 40)
    assert t.decision.threads == 2 and t.why_threads.startswith("2:")


def test_a_trial_leaves_out_the_windows_around_a_pause() -> None:
    """Workers that stop now and then (between games, or taking turns with
    other work): each pause leaves a window served for part of its time,
    and the one after it began while they were away.  Those windows say
    nothing about the setting in force; counted, they decided the trial
    of a second call in flight (which pays) against it."""
    t = Tuner(256, 2, WAKE)
    feed = Feed(t, clients=16)
    feed.run(3 + FIRST, lambda d: 10_000.0 * d.threads, [16] * 40, FIXED, PER_ROW)
    assert t.trial is not None and t.trial.knob == "threads"
    for i in range(40 * TRIAL_PAIRS):
        phase = i % 3
        feed.tick(lambda d: (10_000.0 * d.threads, 2_000.0, 6_000.0)[phase], [16] * 40,
                  FIXED, PER_ROW, paused=phase == 1)
        if t.trial is None:
            break
    assert t.decision.threads == 2 and t.why_threads.startswith("2:")


def test_a_pause_reaches_the_tuner(monkeypatch: pytest.MonkeyPatch) -> None:
    """A serving loop that waits a whole idle timeout for a request tells
    its tuner: the next reading says the clients paused, and readings
    while requests keep coming say they did not."""
    from shmeval.serving import IDLE_TIMEOUT_NS

    seen: List[bool] = []
    tick = Tuner.tick

    def spy(self: Tuner, r: Reading) -> Decision:
        seen.append(r.paused)
        return tick(self, r)

    monkeypatch.setattr(Tuner, "tick", spy)
    with shmeval.Evaluator(fake_model, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                           max_batch=8) as ev:
        ev.evaluate(make_state(1))
        time.sleep(3 * max(IDLE_TIMEOUT_NS, PERIOD) / 1e9)
        assert True in seen
        busy_from = len(seen) + 1   # the reading after the pause's own
        deadline = time.monotonic() + 6 * PERIOD / 1e9
        while time.monotonic() < deadline:
            ev.evaluate(make_state(1))
        assert len(seen) > busy_from + 1
        assert not any(seen[busy_from + 1:])


def test_idle_evaluator_runs_no_trials() -> None:
    t = Tuner(256, 2, WAKE)
    feed = Feed(t, clients=0)
    seen = feed.run(20, lambda d: 0.0, [], FIXED, PER_ROW)
    assert t.trial is None and t.phase == "measuring"
    assert all(d.threads == 1 and d.max_wait_ns == 0 for d in seen)


# --- spinning -----------------------------------------------------------------------------


@pytest.mark.parametrize("runnable, mode", [(1.0, SPIN), (2.0, SPIN), (3.0, YIELD), (4.0, SLEEP),
                                            (40.0, SLEEP)])
def test_spin_mode_from_runnable_tasks(runnable: float, mode: str) -> None:
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=1, cpus=2, runnable=runnable)
    d = feed.run(3, lambda d: 1000.0, [1], FIXED, PER_ROW)[-1]
    assert t.spin_mode == mode
    assert d.spin_ns == {SPIN: WAKE, YIELD: WAKE | YIELD_FLAG, SLEEP: 0}[mode]
    assert t.crowding() == {SPIN: _ring.CROWD_NONE, YIELD: _ring.CROWD_YIELD,
                            SLEEP: _ring.CROWD_SLEEP}[mode]


def test_crowding_is_published_with_the_evaluator_spin_fixed() -> None:
    """The clients' bound comes from the runnable tasks even when the caller
    fixed the evaluator's own spin (which the tuner then leaves alone), and
    says nothing before the first reading."""
    t = Tuner(256, 1, WAKE, Overrides(spin_ns=7_000))
    assert t.crowding() == _ring.CROWD_NONE
    feed = Feed(t, cpus=2, runnable=5.0)
    d = feed.run(3, lambda d: 1000.0, [1], FIXED, PER_ROW)[-1]
    assert d.spin_ns == 7_000
    assert t.crowding() == _ring.CROWD_SLEEP
    assert t.report()["crowding"] == "sleep" and t.report()["spin"] == "set by the caller"


def test_spin_mode_has_a_margin() -> None:
    """Runnable tasks wandering within half a task of a boundary do not flip
    the mode; a move past the margin does."""
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=1, cpus=2, runnable=1.0)
    feed.run(4, lambda d: 1000.0, [1], FIXED, PER_ROW)
    assert t.spin_mode == SPIN
    modes = []
    for x in [2.3, 2.4, 2.2, 2.4, 2.3] * 4:
        feed.runnable = x
        feed.tick(lambda d: 1000.0, [1], FIXED, PER_ROW)
        modes.append(t.spin_mode)
    assert set(modes) == {SPIN}
    feed.runnable = 4.0
    feed.run(6, lambda d: 1000.0, [1], FIXED, PER_ROW)
    assert t.spin_mode == SLEEP


def test_spin_mode_follows_the_cpus() -> None:
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=1, cpus=8, runnable=6.0)
    feed.run(3, lambda d: 1000.0, [1], FIXED, PER_ROW)
    assert t.spin_mode == SPIN
    feed.cpus = 2     # another program's affinity, or the evaluator's, narrowed
    feed.run(3, lambda d: 1000.0, [1], FIXED, PER_ROW)
    assert t.spin_mode == SLEEP


LONG = WAKE * SPIN_LONG_WAKES


def long_spin_pays(d: Decision) -> float:
    return 20_000.0 if d.spin_ns & ~YIELD_FLAG == LONG else 10_000.0


def long_spin_costs(d: Decision) -> float:
    return 8_000.0 if d.spin_ns & ~YIELD_FLAG == LONG else 10_000.0


def spin_trial_seen(feed: Feed, rate: Callable[[Decision], float], ticks: int = 40) -> bool:
    seen = False
    for _ in range(ticks):
        feed.tick(rate, [1] * 40, FIXED, PER_ROW)
        t = feed.tuner
        seen = seen or (t.trial is not None and t.trial.knob == "spin")
    return seen


@pytest.mark.parametrize("runnable, flag", [(1.0, 0), (3.0, YIELD_FLAG), (4.0, YIELD_FLAG)])
def test_long_spin_is_tried_and_kept_when_it_wins(runnable: float, flag: int) -> None:
    """After the other trials, the evaluator's long spin is tried against
    the rule's budget and kept if it serves more; where the rule would
    yield or sleep, the long spin yields between looks."""
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=1, cpus=2, runnable=runnable)
    assert spin_trial_seen(feed, long_spin_pays)
    assert t.phase == "settled" and t.spin_long is True
    assert t.decision.spin_ns == LONG | flag
    assert t.report()["why_spin"].startswith("long:")
    # Held while the load holds, whatever the runnable tasks do.
    feed.runnable = 1.0
    seen = feed.run(10, long_spin_pays, [1] * 40, FIXED, PER_ROW)
    assert all(d.spin_ns & ~YIELD_FLAG == LONG for d in seen)


def test_long_spin_is_dropped_when_it_loses() -> None:
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=1, cpus=2, runnable=1.0)
    assert spin_trial_seen(feed, long_spin_costs)
    assert t.spin_long is False and t.decision.spin_ns == WAKE
    assert t.report()["why_spin"].startswith("short:")


def test_no_spin_trial_when_clients_outnumber_the_cpus() -> None:
    """``_ring``'s rule keeps such an evaluator from spinning at all: a trial
    would compare two equal settings."""
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=16, cpus=2, runnable=1.0)
    assert not spin_trial_seen(feed, long_spin_pays)
    # The segment's own 17 processes on 2 CPUs: sleep, whatever the count.
    assert t.spin_long is False and t.decision.spin_ns == 0 and t.spin_mode == SLEEP
    assert "16 clients on 2 CPUs" in t.report()["why_spin"]


def test_many_clients_hold_the_mode_still() -> None:
    """With more clients than CPUs the ``_ring`` rule lets no one spin, so
    the runnable tasks, however they swing from one reading to the next,
    move neither the mode nor the crowding the clients read."""
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=16, cpus=2, runnable=1.0)
    modes = []
    for x in [1.0, 5.0, 2.0, 3.0, 1.0, 6.0] * 4:
        feed.runnable = x
        feed.tick(lambda d: 1000.0, [1], FIXED, PER_ROW)
        modes.append((t.spin_mode, t.crowding()))
    assert set(modes) == {(SLEEP, _ring.CROWD_SLEEP)}


def test_one_reading_does_not_flip_the_mode() -> None:
    """One reading is one instant's count: a single high one among low
    ones leaves the mode as it was (the smoothed level stays within the
    margin); a lasting change moves it within a few readings."""
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=1, cpus=2, runnable=1.0)
    feed.run(4, lambda d: 1000.0, [1], FIXED, PER_ROW)
    modes = []
    for x in [6.0, 1.0, 1.0, 1.0, 1.0]:
        feed.runnable = x
        feed.tick(lambda d: 1000.0, [1], FIXED, PER_ROW)
        modes.append(t.spin_mode)
    assert modes == [SPIN] * 5
    feed.runnable = 6.0
    modes = [t.spin_mode for _ in range(6) if feed.tick(lambda d: 1000.0, [1], FIXED, PER_ROW)]
    assert modes[-1] == SLEEP and modes.index(SLEEP) <= 4


def test_a_load_change_tries_the_spin_again() -> None:
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=2, cpus=2, runnable=1.0)
    assert spin_trial_seen(feed, long_spin_pays)
    assert t.spin_long is True
    feed.clients = 1
    # The trials start again from the rule's budget, and the long spin,
    # now costing, is dropped.
    feed.tick(long_spin_costs, [1] * 40, FIXED, PER_ROW)
    for _ in range(tuning.HORIZON_NS // PERIOD + 1):
        feed.tick(long_spin_costs, [1] * 40, FIXED, PER_ROW)
    assert t.trial is not None and t.spin_long is None
    assert spin_trial_seen(feed, long_spin_costs)
    assert t.spin_long is False and t.decision.spin_ns == WAKE


# --- the clients' spin arms ---------------------------------------------------------------


def drive_arms(arms: "shmeval._ring.SpinArms", short_wait: int, long_wait: int,
               n: int = 4096) -> List[int]:
    picks = []
    for _ in range(n):
        b = arms.next_budget()
        picks.append(b)
        arms.record(long_wait if b == arms.long_ns else short_wait)
    return picks[n // 4:]


@pytest.mark.parametrize("short_wait, long_wait, serving", [(60_000, 20_000, "long"),
                                                            (60_000, 90_000, "short"),
                                                            (200_000, 20_000, "long")])
def test_spin_arms_serve_with_the_shorter_waits(short_wait: int, long_wait: int,
                                                serving: str) -> None:
    from shmeval._ring import SpinArms

    arms = SpinArms(5_000, 150_000)
    picks = drive_arms(arms, short_wait, long_wait, n=64 * 2000)
    # (Short waits of 200 µs stretch the long arm to cover them: 250 µs.)
    short = [p == 5_000 for p in picks]
    wait = [short_wait if s else long_wait for s in short]
    worse = [s == (serving == "long") for s in short]
    # The worse arm is still tried, for about 1/33 of the time (SPIN_EXPLORE
    # 32 blocks of the better one, times the ratio of their waits, per block
    # of it) whether it is 1.5 or 10 times as slow.
    time_worse = sum(w for w, x in zip(wait, worse) if x) / sum(wait)
    assert 1 / 45 <= time_worse <= 1 / 25
    rep = arms.report()
    assert rep["arm"] == serving
    # Each short wait outlasted its budget: it slept, and counts a wake-up more.
    assert rep["short_wait_us"] == pytest.approx((short_wait + 5_000) / 1e3)


def test_spin_arms_judge_a_spin_by_what_it_does_while_it_lasts() -> None:
    """What a spin saves shows only while it lasts: here each wait is
    shorter the more of the last 32 waits spun long (the CPU stays awake),
    while a long spin's own wait costs 5 µs more.  One long wait among
    short ones looks worse; a block of them is clearly better.  Arms that
    tried the long spin one wait at a time kept the short one."""
    from shmeval._ring import SpinArms

    arms = SpinArms(5_000, 80_000)
    recent: List[bool] = []
    picks = []
    for _ in range(8192):
        b = arms.next_budget()
        spun = b == arms.long_ns
        picks.append(spun)
        recent = (recent + [spun])[-32:]
        awake = sum(recent) / len(recent)
        arms.record(int(20_000 + 40_000 * (1 - awake) + (5_000 if spun else 0)))
    assert arms.report()["arm"] == "long"
    assert sum(picks[4096:]) / 4096 >= 0.85


def test_spin_arms_follow_a_change_and_bound_outliers() -> None:
    from shmeval._ring import SpinArms

    arms = SpinArms(5_000, 80_000)
    drive_arms(arms, 60_000, 20_000)
    assert arms.report()["arm"] == "long"
    # The long spin starts to cost (it takes a CPU another process needs).
    drive_arms(arms, 60_000, 150_000, n=2400)
    assert arms.report()["arm"] == "short"
    # A preempted wait of a second counts as twice the long arm, no more.
    arms = SpinArms(5_000, 80_000)
    for _ in range(64):  # one block
        arms.next_budget()
        arms.record(10**9)
    assert arms.report()["short_wait_us"] == pytest.approx(160.0)


def drive_blocks(arms: "shmeval._ring.SpinArms", waits: Callable[[bool, int], int],
                 blocks: int) -> List[bool]:
    """``blocks`` blocks of 64 waits, each taking ``waits(long, i)`` (i:
    the wait's index in its block); which arm served each block."""
    served = []
    for _ in range(blocks):
        long = arms.next_budget() == arms.long_ns
        served.append(long)
        for i in range(64):
            assert (arms.next_budget() == arms.long_ns) == long
            arms.record(waits(long, i))
    return served


def test_spin_arms_leave_a_blocks_preempted_waits_out() -> None:
    """Six waits of a block of 64 preempted for a millisecond (under either
    arm) outweighed the 10 µs per wait the arms differ by, in a mean of
    every wait: the long arm's blocks met them and the short arm served."""
    from shmeval._ring import SpinArms

    arms = SpinArms(5_000, 150_000)

    def waits(long: bool, i: int) -> int:
        return 1_000_000 if long and i % 10 == 3 else 20_000 if long else 30_000

    served = drive_blocks(arms, waits, 400)
    assert arms.report()["arm"] == "long"
    assert sum(served[100:]) / 300 >= 0.9


def test_spin_arms_break_a_tie_for_the_spin() -> None:
    """Where the waits are alike under either arm, the short arm's slept
    and the evaluator paid for each wake-up: the long arm serves."""
    from shmeval._ring import SpinArms

    arms = SpinArms(5_000, 80_000)
    served = drive_blocks(arms, lambda long, i: 30_000, 400)
    assert arms.report()["arm"] == "long"
    assert sum(served[100:]) / 300 >= 0.9


def test_spin_arms_check_a_verdict_one_slow_block_changed() -> None:
    """One block of the serving arm that the host slowed throughout (more
    waits than the trim leaves out) turns the verdict; the arm that lost
    it serves one block more, which restores it.  Without that check the
    worse arm served until its next turn to be tried, 32 blocks or more."""
    from shmeval._ring import SpinArms

    arms = SpinArms(5_000, 80_000)
    drive_blocks(arms, lambda long, i: 20_000 if long else 30_000, 200)
    assert arms.report()["arm"] == "long"
    slowed = drive_blocks(arms, lambda long, i: 160_000 if long else 30_000, 1)
    assert slowed == [True]
    after = drive_blocks(arms, lambda long, i: 20_000 if long else 30_000, 40)
    assert after.count(False) <= 2
    assert arms.report()["arm"] == "long"


def answers_after(answer_ns: int) -> Callable[["shmeval._ring.SpinArms", int], int]:
    """A wait for an answer that comes ``answer_ns`` after the post: a
    spin of that budget or more sees it 5 µs sooner than a sleep does."""
    return lambda arms, budget: answer_ns - 5_000 if budget >= answer_ns else answer_ns


def drive_budgets(arms: "shmeval._ring.SpinArms",
                  wait: Callable[["shmeval._ring.SpinArms", int], int], n: int) -> None:
    for _ in range(n):
        arms.record(wait(arms, arms.next_budget()))


def test_the_long_arm_stretches_to_cover_the_answers() -> None:
    """Answers after 200 µs outlast a long arm of 80 µs (16 wake-ups of
    5 µs): both arms would sleep.  The long arm stretches to the short
    arm's upper quartile of waits plus a quarter (250 µs), spins through
    the call and serves; when the answers come sooner again it returns to
    the arm given."""
    from shmeval._ring import SpinArms

    arms = SpinArms(5_000, 80_000)
    drive_budgets(arms, answers_after(200_000), 64 * 400)
    rep = arms.report()
    assert rep["long_us"] == pytest.approx(250.0) and rep["long_given_us"] == 80.0
    assert rep["arm"] == "long" and rep["long_wait_us"] == pytest.approx(195.0)
    drive_budgets(arms, answers_after(30_000), 64 * 400)
    assert arms.report()["long_us"] == 80.0


def test_the_long_arm_does_not_stretch_past_its_bound_or_for_its_own_waits() -> None:
    """Answers of 1 ms would need a spin of 1.25 ms, over four times the
    arm given: it stays as given.  And where the long spin itself slows
    the answers it waits for (it takes the CPU of the process it waits
    for), only the short arm's waits measure the answers, so the slower
    waits do not lengthen it."""
    from shmeval._ring import SpinArms

    arms = SpinArms(5_000, 80_000)
    drive_budgets(arms, answers_after(1_000_000), 64 * 200)
    assert arms.report()["long_us"] == 80.0
    arms = SpinArms(5_000, 80_000)
    drive_budgets(arms, lambda a, budget: 30_000 if budget == 5_000 else 200_000, 64 * 200)
    rep = arms.report()
    assert rep["long_us"] == 80.0 and rep["arm"] == "short"


def test_a_fixed_spin_has_one_arm() -> None:
    from shmeval._ring import SpinArms

    for arms in (SpinArms(7_000), SpinArms(7_000, 0), SpinArms(7_000, 3_000)):
        assert {arms.next_budget() for _ in range(40)} == {7_000}
        assert arms.report()["arm"] == "fixed"


def test_clients_report_their_spin() -> None:
    with shmeval.Evaluator(fake_model, input_shape=INPUT_SHAPE, outputs=OUTPUTS) as ev:
        auto = shmeval.connect(ev.address)
        fixed = shmeval.connect(ev.address, spin_us=5)
        try:
            assert "client_spin" not in auto.stats()   # nothing evaluated yet
            for c in (auto, fixed):
                for _ in range(50):
                    c.evaluate(make_state(1))
            spin = auto.stats()["client_spin"]
            assert spin["long_us"] == pytest.approx(SPIN_LONG_WAKES * spin["short_us"])
            assert spin["arm"] in ("short", "long", "measuring")
            assert fixed.stats()["client_spin"]["arm"] == "fixed"
            assert fixed.stats()["client_spin"]["short_us"] == 5.0
        finally:
            auto.close()
            fixed.close()


# --- fixed settings -----------------------------------------------------------------------


def test_fixed_settings_are_left_alone() -> None:
    t = Tuner(256, 2, WAKE, Overrides(max_wait_ns=50_000, spin_ns=7_000, threads=1))
    feed = Feed(t, clients=4, runnable=30.0)
    seen = settle(feed, lambda d: 10_000.0 * d.threads + (5_000.0 if d.max_wait_ns == 0 else 0),
                  CONVOY)
    assert all(d == Decision(50_000, 256, 7_000, 1) for d in seen)
    assert t.why_wait == "max_wait_us set by the caller"
    assert t.report()["spin"] == "set by the caller"


def test_fixed_wait_still_tunes_threads() -> None:
    t = Tuner(256, 2, WAKE, Overrides(max_wait_ns=0))
    feed = Feed(t, clients=4)
    seen = settle(feed, lambda d: 10_000.0 * d.threads, CONVOY)
    assert t.decision.threads == 2
    assert all(d.max_wait_ns == 0 for d in seen)


def test_report_says_what_and_why() -> None:
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=4)
    settle(feed, waiting_pays, CONVOY)
    r = t.report()
    assert r["model_us_per_call"] == pytest.approx(FIXED / 1e3, rel=0.01)
    assert r["model_us_per_row"] == pytest.approx(PER_ROW / 1e3, rel=0.01)
    assert r["max_wait_us"] == pytest.approx(FIXED / 1e3, rel=0.01)
    assert r["arrivals_per_s"] > 0 and r["clients"] == 4 and r["cpus"] == 2
    assert r["phase"] == "settled" and r["why_wait"].startswith("waiting")


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["max_wait_us", "evaluator_spin_us", "spin_us",
                                  "serving_threads"])
def test_auto_or_a_number(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name}.*'auto'"):
        shmeval.Evaluator(fake_model, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                          **{name: "fast"})


def test_check_auto() -> None:
    def positive(name: str, v: float) -> float:
        if v <= 0:
            raise ValueError(f"{name} must be > 0")
        return float(v)

    assert checks.check_auto("x", "auto", positive) == "auto"
    assert checks.check_auto("x", 3, positive) == 3.0
    with pytest.raises(ValueError, match="x must be 'auto' or a number, got 'Auto'"):
        checks.check_auto("x", "Auto", positive)
    with pytest.raises(ValueError, match="x must be > 0"):
        checks.check_auto("x", -1, positive)


# --- the pieces around it ---------------------------------------------------------------------


def test_board_round_trip_through_the_segment() -> None:
    """The report goes to the replica's entry in the segment, where every
    reader finds it; a report too long for it loses its long texts first,
    then its reasons, and always stays valid JSON."""
    with shmeval.Evaluator(fake_model, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                           max_wait_us=0, evaluator_spin_us=0, serving_threads=1) as ev:
        seg = ev._attach()
        assert stats.read_report(seg, 0) is None        # no tuner: nothing published
        b = Board(seg, 0)
        b.write({"max_wait_us": 12.5, "why_wait": "greedy: ..."})
        assert stats.read_report(seg, 0) == {"max_wait_us": 12.5, "why_wait": "greedy: ..."}
        b.write({"max_wait_us": 3.0, "why_wait": "w" * 5000, "why_threads": "t" * 5000})
        got = stats.read_report(seg, 0)
        assert got is not None and got["max_wait_us"] == 3.0
        assert got["why_wait"].startswith("w" * 160) and got["why_wait"].endswith("...")
        many = {f"why_{i}": "x" * 150 for i in range(40)}
        b.write({"max_wait_us": 4.0, **many})
        assert stats.read_report(seg, 0) == {"max_wait_us": 4.0}


@pytest.mark.timeout(60)
def test_stats_show_the_tuner() -> None:
    with shmeval.Evaluator(fake_model, input_shape=INPUT_SHAPE, outputs=OUTPUTS) as ev:
        assert float(ev.evaluate(make_state(3))["value"]) == -3
        deadline = time.monotonic() + 30
        st = ev.stats()
        while "tuner" not in st and time.monotonic() < deadline:
            ev.evaluate(make_state(3))
            st = ev.stats()
        t = st["tuner"]
        assert {"model_us_per_call", "model_us_per_row", "arrivals_per_s", "max_wait_us",
                "spin", "serving_threads", "why_wait", "why_threads"} <= set(t)
        assert t["serving_threads"] == 1   # a plain function: its calls may not overlap
        assert ev._config.policy.threads == 1


@pytest.mark.timeout(60)
def test_the_tuner_shows_from_the_start() -> None:
    """Before any request: the report is there, measuring."""
    ev = shmeval.Evaluator.spawn(fake_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS)
    try:
        t = ev.stats()["tuner"]
        assert t["phase"] == "measuring" and t["why_wait"].startswith("measuring"), t
        assert t["cpus"] == len(os.sched_getaffinity(0)), t
    finally:
        ev.close()
    with shmeval.Evaluator(fake_model, input_shape=INPUT_SHAPE, outputs=OUTPUTS) as ev:
        assert ev.stats()["tuner"]["phase"] == "measuring"


@pytest.mark.timeout(60)
def test_every_reader_of_the_segment_sees_the_tuner() -> None:
    """The report is in the segment: a worker's handle and ``shmeval stats
    ADDRESS``, in other processes, have it as the owner does."""
    ev = shmeval.Evaluator.spawn(fake_factory, input_shape=INPUT_SHAPE, outputs=OUTPUTS)
    try:
        deadline = time.monotonic() + 30
        while "tuner" not in ev.stats() and time.monotonic() < deadline:
            ev.evaluate(make_state(1))
        assert "tuner" in ev.stats()
        r = run_python(f"import shmeval; t = shmeval.connect({ev.address!r}).stats()['tuner']; "
                       "print(sorted(t))")
        assert r.returncode == 0, r.stderr
        assert "'max_wait_us'" in r.stdout and "'why_wait'" in r.stdout
        r = run_python(f"from shmeval import cli; cli.main(['stats', {ev.address!r}])")
        assert r.returncode == 0, r.stderr
        assert '"tuner": {' in r.stdout and '"why_threads"' in r.stdout
    finally:
        ev.close()


@pytest.mark.timeout(60)
def test_callers_settings_switch_the_tuner_off() -> None:
    with shmeval.Evaluator(fake_model, input_shape=INPUT_SHAPE, outputs=OUTPUTS,
                           max_wait_us=0, evaluator_spin_us=50, serving_threads=1) as ev:
        assert float(ev.evaluate(make_state(2))["value"]) == -2
        assert "tuner" not in ev.stats()


class Overlapping:
    """fake_model, declaring that two calls may overlap."""

    max_concurrency = 2

    def __call__(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return fake_model(x)


@pytest.mark.timeout(60)
def test_parked_threads_stop_with_the_evaluator() -> None:
    """A model that may overlap gets two serving threads; whichever the
    tuner parks, closing stops them all."""
    ev = shmeval.Evaluator(Overlapping(), input_shape=INPUT_SHAPE, outputs=OUTPUTS)
    try:
        assert ev._config.policy.threads == 2
        for i in range(50):
            assert float(ev.evaluate(make_state(i))["value"]) == -i
    finally:
        ev.close()
    assert ev._thread is not None and not ev._thread.is_alive()


def test_wait_turn_parks_the_threads_beyond_the_decision() -> None:
    class Seg:
        def stat(self, name: str) -> int:
            return 0

        def n_attached(self) -> int:
            return 0

        def replicas_serving(self) -> int:
            return 1

        def set_crowding(self, c: int) -> None:
            pass

    st = tuning.ServingTuner(Seg(), Overlapping(), [], 256, 2, Overrides(), None, PERIOD,
                             YIELD_FLAG)
    assert st.wait_turn(0, 0.0)
    assert not st.wait_turn(1, 0.0)        # one call in flight to start with
    st.tuner.decision = Decision(0, 256, 0, 2)
    assert st.wait_turn(1, 0.0)
    st.tuner.decision = Decision(0, 256, 0, 1)
    st.release()
    assert not st.wait_turn(1, 3600.0)     # stopping: no wait


class Recorded:
    """Stands in for a ``_ring.Server``: the calls it recorded."""

    def __init__(self) -> None:
        self.cap = 0
        self.calls: list[tuple[int, int, int]] = []

    def record_calls(self, cap: int) -> None:
        self.cap = cap

    def take_calls(self) -> np.ndarray:
        out = np.array(self.calls, np.int64).reshape(-1, 3)
        self.calls = []
        return out


def test_serving_tuner_reads_the_servers_calls() -> None:
    class Seg:
        def stat(self, name: str) -> int:
            return 0

        def n_attached(self) -> int:
            return 3

        def replicas_serving(self) -> int:
            return 1

        def set_crowding(self, c: int) -> None:
            self.crowding = c

    seg, servers = Seg(), [Recorded(), Recorded()]
    st = tuning.ServingTuner(seg, fake_model, servers, 256, 2, Overrides(), None, PERIOD,
                             YIELD_FLAG)
    assert [s.cap for s in servers] == [tuning.CALLS_PER_PERIOD] * 2
    servers[0].calls = [(PERIOD, 1000, 5)]
    servers[1].calls = [(PERIOD + 10, 1000, 7), (PERIOD + 2000, 1000, 2)]
    st.tick(10 * PERIOD)
    assert st.tuner.clients == 3
    assert seg.crowding == st.tuner.crowding()   # published with each reading
    assert sorted(st.tuner._recent[-1][2][:, 2].tolist()) == [2, 5, 7]
    assert all(s.calls == [] for s in servers)   # taken
    servers[0].calls = [(11 * PERIOD, 1000, 3)]
    st.tick(10 * PERIOD + 1)            # within the period: no second reading
    assert st.tuner._prev is not None and st.tuner._prev.now_ns == 10 * PERIOD
    assert servers[0].calls                      # left for the next reading


def test_a_reading_imports_nothing() -> None:
    """A reading runs on a serving thread, between batches: it must not
    import a module there (``np.median`` imports ``numpy.ma`` on its first
    call, about 40 ms on the development machine, which every waiting
    client paid).  In a fresh interpreter, as a spawned evaluator is."""
    code = """
import sys
import numpy as np
from shmeval import _ring, tuning

class Seg:
    def stat(self, name): return 0
    def n_attached(self): return 2
    def replicas_serving(self): return 1
    def set_crowding(self, c): pass

class Server:
    def record_calls(self, cap): pass
    def take_calls(self):
        return np.array([(0, 100_000 + 10_000 * n, n) for n in (1, 1, 1, 2, 2, 2, 4, 4, 4)],
                        np.int64)

st = tuning.ServingTuner(Seg(), lambda b: {"value": np.zeros(len(b))}, [Server()], 64, 1,
                         tuning.Overrides(), None, 1, 1 << 63)
before = set(sys.modules)
for t in range(1, 8):
    st.tick(t * 200_000_000)
assert st.tuner.cost is not None and st.tuner.cost.per_row is not None, st.tuner.cost
print(sorted(set(sys.modules) - before))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"a reading imported {out.stdout.strip()}"


# --- several replicas: one tuner decides, the others follow -------------------------------


class ReplicaFeed(Feed):
    """A Feed whose readings say how many replicas serve."""

    def __init__(self, tuner: Tuner, replicas: int, **kw: int) -> None:
        super().__init__(tuner, **kw)
        self.replicas = replicas

    def tick(self, rate: Callable[[Decision], float], rows: Sequence[int], fixed_ns: float,
             per_row_ns: float, paused: bool = False) -> Decision:
        self.now += PERIOD
        self.requests += int(rate(self.tuner.decision) * PERIOD / 1e9)
        r = Reading(self.now, self.requests, self.clients, self.cpus, self.runnable,
                    calls_of(rows, fixed_ns, per_row_ns, self.now), paused, self.replicas)
        return self.tuner.tick(r)


def test_a_waiting_replica_waits_for_its_share_of_the_population() -> None:
    """16 clients, 2 replicas, convoys of 2 and 6 per replica: the cap is
    the even split of the population (8), not all of it, and the report
    says when the settings changed, why, and how long the trials took."""
    t = Tuner(256, 1, WAKE)
    feed = ReplicaFeed(t, 2, clients=16)
    # Both replicas' arrivals: one fixed cost gathers 3 requests per replica.
    settle(feed, lambda d: 3 * waiting_pays(d), [2, 6] * 20)
    assert t.phase == "settled" and t.decision.max_wait_ns > 0, t.why_wait
    assert t.decision.batch_cap == 8
    report = t.report()
    assert report["replicas"] == 2
    assert report["decision"] == [t.decision.max_wait_ns, 8, t.decision.spin_ns, 1]
    assert report["why_changed"].startswith("wait: +30%"), report["why_changed"]
    assert report["settle_s"] == pytest.approx(2 * TRIAL_PAIRS * PERIOD / 1e9)
    assert 0 <= report["changed_s_ago"] == report["settled_s_ago"]


def test_the_replicas_count_is_part_of_the_load() -> None:
    """A replica more or less is a new load: the trials run again, and the
    report names the change."""
    t = Tuner(256, 1, WAKE)
    feed = ReplicaFeed(t, 2, clients=16)
    settle(feed, lambda d: 3 * waiting_pays(d), [2, 6] * 20)
    assert t.phase == "settled"
    feed.replicas = 1
    settle(feed, lambda d: 3 * waiting_pays(d), [4, 12] * 20, ticks=8)
    assert t.why_changed.startswith("trials from the simplest settings: the load changed: "
                                    "replicas 2 -> 1"), t.why_changed


def test_a_trial_within_noise_keeps_the_simpler_setting_and_says_so() -> None:
    """Waiting ahead in one pair of three: dropped, and called a tie."""
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=4)

    def alike(d: Decision) -> float:
        if not d.max_wait_ns:
            return 10_000.0
        first = t.trial is not None and not t.trial.rates
        return 10_500.0 if first else 9_500.0

    settle(feed, alike, CONVOY)
    assert t.decision.max_wait_ns == 0
    assert "within noise: the simpler setting stays" in t.why_wait, t.why_wait


def test_a_follower_applies_the_leaders_decision_and_runs_no_trials() -> None:
    t = Tuner(256, 2, WAKE, Overrides(spin_ns=0))
    leader = Decision(150_000, 8, 999, 2)
    r = Reading(PERIOD, 100, 16, 2, 1.0, calls_of([4, 8] * 5, FIXED, PER_ROW, 0), False, 2)
    t.follow(r, leader, 0)
    assert t.decision == Decision(150_000, 8, 0, 2)   # its own override stays
    assert t.trial is None and t.phase == "following replica 0"
    assert t.why_changed == "following replica 0" and t.cost is not None


class TwoReplicaSeg:
    """A segment seen by two replicas' ServingTuners: both serving, and
    each one's published report readable by the other."""

    def __init__(self) -> None:
        self.reports: dict[int, bytes] = {}

    def stat(self, name: str) -> int:
        return 0

    def n_attached(self) -> int:
        return 16

    def replicas_serving(self) -> int:
        return 2

    def replicas(self) -> list:
        return [{"replica": 0, "state": "serving"}, {"replica": 1, "state": "serving"}]

    def set_crowding(self, c: int) -> None:
        self.crowding = c

    def set_report(self, r: int, text: bytes) -> None:
        self.reports[r] = text

    def report(self, r: int) -> bytes | None:
        return self.reports.get(r)


def test_serving_tuners_of_two_replicas_lead_and_follow() -> None:
    """Replica 0 decides; replica 1 applies what 0 published, reading a
    small part of a period after it on the same grid."""
    seg = TwoReplicaSeg()
    tuners = [tuning.ServingTuner(seg, fake_model, [], 64, 1, Overrides(), Board(seg, r),
                                  PERIOD, YIELD_FLAG, r) for r in (0, 1)]
    lead, follow = tuners
    lead.tuner.decision = Decision(300_000, 8, 0, 1)
    lead.tick(5 * PERIOD)
    follow.tick(5 * PERIOD + 1)
    assert follow.tuner.decision == Decision(300_000, 8, 0, 1)
    assert follow.tuner.phase == "following replica 0"
    # Readings on one grid: the leader's at its points, the follower's a
    # FOLLOW_LAG of a period later.
    lag = int(PERIOD * tuning.FOLLOW_LAG)
    assert lead.next_at(5 * PERIOD + 7) == 6 * PERIOD
    assert follow.next_at(5 * PERIOD + 7) == 5 * PERIOD + lag
    assert follow.next_at(5 * PERIOD + lag) == 6 * PERIOD + lag


def test_the_first_trials_read_a_horizon_of_load_not_the_start_burst() -> None:
    """Clients that start together send their first requests at once: the
    first batches hold all 16.  Read alone they say "greedy: the batches
    hold every request"; the first trials wait for a horizon of load, by
    when the convoys of the steady state (4 and 12) show, and waiting,
    which pays, is tried and kept."""
    t = Tuner(256, 1, WAKE)
    feed = Feed(t, clients=16)
    feed.run(2, lambda d: 3 * waiting_pays(d), [16] * 40, FIXED, PER_ROW)
    assert t.trial is None and t.phase == "measuring"
    settle(feed, lambda d: 3 * waiting_pays(d), [4, 12] * 20)
    assert t.phase == "settled" and t.decision.max_wait_ns > 0, t.why_wait
