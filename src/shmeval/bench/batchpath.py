"""The evaluator's own time per batch, outside the model call.

One process drives the real core by hand (the pattern of
``tests/core/test_ring_unit.py``): a segment with n requests in flight on
``min(n, 64)`` clients x ``ceil(n / clients)`` slots, a ``_ring.Server``
over a preallocated batch buffer, and for each round

1. post the n requests (untimed: the clients' work),
2. **collect**: ``Server.collect`` scans the slot words and gathers the n
   READY inputs into the batch buffer (timed),
3. run the model on the batch (untimed: a NumPy function of each row that
   writes into preallocated outputs of the declared dtype and shape),
4. **finish**: ``Server.finish_fast``, what the serving loop calls after the
   model: checks the outputs (finite, by default), records the statistics,
   scatters each output row into its slot, publishes DONE and runs the wake
   pass (timed),
5. fetch every answer as a client does and check it is the model's row for
   that request (untimed; a wrong or missing answer raises).

Nobody sleeps on these slots, so in the main measurement the wake pass finds
no WAITER bit and makes no system call.  A second measurement
(``finish_waiter_us``) first gives every slot the WAITER bit, through the
public API: a helper thread calls ``Segment.wait`` on each taken slot with a
timeout of a few µs, which sets WAITER, sleeps, times out and leaves the bit
set.  The wake pass then rings the doorbell word of the batch's clients
(one ``FUTEX_WAKE_BITSET`` system call per word of 32 clients;
docs/protocol.md, *Doorbells*) with nobody to wake: the system call's cost,
not the cost of waking a process, which depends on the scheduler.

A third measurement (``serve_us``) runs one whole batch through
``Server.serve``, the loop the evaluator really runs (collect -> model ->
finish_fast in Cython, then its next scan, empty here), with a model that
times itself; its own time is subtracted, so ``serve_us - total_us`` is
what the loop adds around the model call (the Python call of the model,
the empty scan).

``memcpy_us`` is one ``np.copyto`` of n states (the bytes collect gathers)
between two preallocated arrays, repeated back to back in blocks: both stay
in the cache when they fit.  ``memcpy_inloop_us`` copies the same n rows
inside the serving rounds, right after post (the source as warm, the
destination as cold, as collect finds its slots and its batch buffer):
with large states the difference between the two is the cache, not the
code.  It is one cold NumPy call per round, so below a few µs (small
batches) it measures the call more than the copy.  The serving variants are
interleaved, the others measured in phases around them (see
:func:`measure_batch`).

Figures are medians (and 90th percentiles) over the rounds, in µs.
"""
from __future__ import annotations

import gc
import math
import os
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from shmeval import _ring, segment
from shmeval.config import ServeConfig

from .reference import _table

__all__ = ["run_batch_path", "format_batch_path", "BatchRig", "MAX_CLIENTS"]

#: Requests are spread over at most this many clients.
MAX_CLIENTS = 64
_COLLECT_TIMEOUT_NS = 1_000_000_000
_MAX_ROUNDS = 100_000  # repetitions of one step


class BatchRig:
    """n requests on a fresh segment, served by hand by one ``_ring.Server``.

    Request r (0..n-1) carries the state whose first element is r + 1 and
    goes to client r % clients.  The model answers policy[j] = tag + j and
    value = -tag, so each answer identifies its request.  Close it (or use it
    as a context manager) to unlink the segment."""

    def __init__(self, state_shape: tuple[int, ...], policy_size: int, n: int,
                 reject_nonfinite: bool = True) -> None:
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        self.n = n
        self.nclients = min(n, MAX_CLIENTS)
        self.slots_per_client = math.ceil(n / self.nclients)
        # Served as the serving loop would, with fixed settings (no tuner):
        # greedy, no spin, and serve() returning at once when idle.
        self.config = ServeConfig(input_shape=state_shape,
                                  outputs={"policy": ((policy_size,), "float32"),
                                           "value": ((), "float32")},
                                  max_batch=n, max_clients=self.nclients,
                                  slots_per_client=self.slots_per_client, max_wait_us=0,
                                  evaluator_spin_us=0, serving_threads=1,
                                  reject_nonfinite=reject_nonfinite)
        self.spec = self.config.spec
        self.seg, self.name = segment.create(self.spec)
        try:
            shape = (n,) + self.spec.input_shape
            self.batch = np.zeros(shape, np.float32)
            self.server = _ring.Server(self.seg, self.batch)
            self.server.configure(self.config, 0)
            self.seg.set_serving(0, os.getpid(), 0)
            me = os.getpid()
            self.clients = [self.seg.register(me, 0, 0) for _ in range(self.nclients)]
            self.gens: dict[tuple[int, int], int] = {}  # (client, slot) -> generation posted
            # Client i's requests are i, i + clients, ...; its inputs are
            # consecutive rows of self.inputs (post takes a row range).
            self.plan: list[tuple[int, list[int], int, np.ndarray]] = []
            self.inputs = np.zeros(shape, np.float32)
            row = 0
            for i, c in enumerate(self.clients):
                reqs = np.arange(i, n, self.nclients)
                self.inputs.reshape(n, -1)[row:row + reqs.size, 0] = reqs + 1
                self.plan.append((c, list(range(reqs.size)), row, reqs))
                row += reqs.size
            self.ramp = np.arange(policy_size, dtype=np.float32)
            self.policy = np.zeros((n, policy_size), np.float32)
            self.value = np.zeros((n,), np.float32)
            self.outputs = (self.policy, self.value)
            self.got = [np.zeros((n, policy_size), np.float32), np.zeros((n,), np.float32)]
            self.answered = 0
            # Server.serve stamps batches with its ServeGroup's version.
            self.server.group.version = 1
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "BatchRig":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        segment.unlink(self.name)

    # ---------------------------------------------------------------- steps
    def post(self) -> None:
        """The clients' side: every request published (READY)."""
        for c, slots, row0, _ in self.plan:
            gens = self.seg.post(c, slots, self.inputs, row0)
            self.gens.update(((c, k), g) for k, g in zip(slots, gens))

    def collect(self) -> int:
        """The evaluator's scan + gather; returns how many it took."""
        return int(self.server.collect(self.n, 0, 0, _COLLECT_TIMEOUT_NS))

    def model(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The answers for the batch rows x (into preallocated outputs)."""
        tags = x.reshape(x.shape[0], -1)[:, 0]
        np.add(tags[:, None], self.ramp, out=self.policy)
        np.negative(tags, out=self.value)
        return self.outputs

    def finish(self, outputs: Any) -> None:
        """What the serving loop does after the model call."""
        if not self.server.finish_fast(outputs, self.n, 0, 1):
            raise RuntimeError("finish_fast refused the outputs (they are not as declared)")

    def serve_one(self, model: Any) -> int:
        """One batch through ``Server.serve`` (collect -> model -> finish_fast,
        in Cython), then the loop's next scan, which finds nothing and, with
        a timeout of 0, returns IDLE at once.  Returns the kind."""
        return int(self.server.serve(model, 0)[0])

    def after_serve(self) -> None:
        """Releases what serve_one's return left held (the group's lock)."""
        self.server.unlock()

    def mark_waiters(self) -> int:
        """Gives every slot of the taken batch the WAITER bit, as a client
        asleep on it would (from a helper thread whose timer slack is 1 µs, so
        that each short sleep is short).  Returns how many slots carry it."""
        marked = [0]
        errors: list[BaseException] = []

        def run() -> None:
            try:
                _ring.set_timer_slack_ns(1000)
                for c, slots, _, _ in self.plan:
                    for k in slots:
                        timeout = 2_000
                        while not self.seg.slot_state(c, k)[1] and timeout < 100_000_000:
                            self.seg.wait(c, k, self.gens[c, k], 0, timeout, 1)
                            timeout *= 4
                        marked[0] += bool(self.seg.slot_state(c, k)[1])
            except BaseException as e:  # reported by the caller
                errors.append(e)

        t = threading.Thread(target=run, name="shmeval-bench-waiters", daemon=True)
        t.start()
        t.join(30.0)
        if t.is_alive():
            raise TimeoutError("setting the WAITER bits did not finish in 30 s")
        if errors:
            raise errors[0]
        return marked[0]

    def fetch_and_check(self) -> None:
        """The clients' side: every answer fetched (slots back to FREE) and
        compared with the model's row for that request.  Raises if any
        request is unanswered or answered wrongly."""
        got_p, got_v = self.got
        got_p.fill(np.nan)
        got_v.fill(np.nan)
        for c, slots, _, reqs in self.plan:
            for k, r in zip(slots, reqs.tolist()):
                version = self.seg.fetch(c, k, self.gens[c, k], self.got, r)
                if version != 1:
                    raise RuntimeError(f"request {r} (client {c}, slot {k}) was answered "
                                       f"{version!r}, not by model version 1")
        tags = np.arange(1, self.n + 1, dtype=np.float32)
        if not (np.array_equal(got_p, tags[:, None] + self.ramp)
                and np.array_equal(got_v, -tags)):
            bad = np.flatnonzero((got_p != tags[:, None] + self.ramp).any(axis=1)
                                 | (got_v != -tags))
            raise RuntimeError(f"{bad.size} of {self.n} requests got a wrong answer "
                               f"(first: request {int(bad[0])})")
        self.answered += self.n


def _percentiles(ns: Sequence[int]) -> tuple[float, float]:
    p50, p90 = np.percentile(np.asarray(ns, np.float64), [50, 90]) / 1e3
    return float(p50), float(p90)


def _repeat(step: Callable[[], None], seconds: float, minimum: int) -> None:
    """step() for about `seconds`, at least `minimum` times."""
    end = time.perf_counter_ns() + int(seconds * 1e9)
    done = 0
    while done < minimum or (time.perf_counter_ns() < end and done < _MAX_ROUNDS):
        step()
        done += 1


def measure_batch(state_shape: tuple[int, ...], policy_size: int, n: int, seconds: float,
                  *, waiter: bool = True, serve: bool = True,
                  reject_nonfinite: bool = True) -> dict[str, Any]:
    """One row of :func:`run_batch_path` (see there).

    Phases: back-to-back copies (memcpy_us, 1/16 of the time); five
    uncounted rounds; cycles of four counted plain rounds, a Server.serve
    round and a round whose copy is memcpy_inloop_us (70%); copies again
    (1/16); WAITER rounds (1/8).  The serving variants are interleaved so
    that they see the same load; the copies and the WAITER rounds are not,
    because they slow down the next few rounds (caches refilled; the helper
    thread's sleeps let the vCPU go idle)."""
    clock = time.perf_counter_ns
    with BatchRig(state_shape, policy_size, n, reject_nonfinite) as rig:
        collect_ns: list[int] = []
        finish_ns: list[int] = []
        total_ns: list[int] = []

        def check_collect() -> None:
            got = rig.collect()
            if got != n:
                raise RuntimeError(f"collect took {got} of {n} posted requests")

        def plain(count: bool = True) -> None:
            rig.post()
            t0 = clock()
            got = rig.collect()
            t1 = clock()
            if got != n:
                raise RuntimeError(f"collect took {got} of {n} posted requests")
            out = rig.model(rig.batch)
            t2 = clock()
            rig.finish(out)
            t3 = clock()
            rig.fetch_and_check()
            if count:
                collect_ns.append(t1 - t0)
                finish_ns.append(t3 - t2)
                total_ns.append(t1 - t0 + t3 - t2)

        waiter_ns: list[int] = []

        def with_waiters() -> None:
            rig.post()
            check_collect()
            marked = rig.mark_waiters()
            if marked != n:
                raise RuntimeError(f"only {marked} of {n} slots took the WAITER bit")
            out = rig.model(rig.batch)
            t0 = clock()
            rig.finish(out)
            waiter_ns.append(clock() - t0)
            rig.fetch_and_check()

        serve_ns: list[int] = []
        model_ns = [0]

        def timed_model(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            t0 = clock()
            out = rig.model(x)
            model_ns[0] = clock() - t0
            return out

        def served() -> None:
            rig.post()
            model_ns[0] = -1
            t0 = clock()
            kind = rig.serve_one(timed_model)
            dt = clock() - t0 - model_ns[0]
            rig.after_serve()
            if kind != _ring.SERVE_IDLE or model_ns[0] < 0:
                raise RuntimeError(f"Server.serve returned kind {kind} (not IDLE after one "
                                   "batch)")
            rig.fetch_and_check()
            serve_ns.append(dt)

        inloop_ns: list[int] = []

        def copied() -> None:
            # The same bytes as collect, in the same cache conditions: the
            # rows just touched by post, copied into the batch buffer itself
            # (last written by the previous round's collect).  The collect
            # that follows overwrites it (untimed).
            rig.post()
            t0 = clock()
            np.copyto(rig.batch, rig.inputs)
            inloop_ns.append(clock() - t0)
            check_collect()
            rig.finish(rig.model(rig.batch))
            rig.fetch_and_check()

        ref_src = rig.inputs.copy()
        ref_dst = np.zeros_like(ref_src)
        ref_reps = max(1, min(1000, 4096 // n))
        memcpy_ns: list[float] = []

        def back_to_back() -> None:
            np.copyto(ref_dst, ref_src)  # warm
            t0 = clock()
            for _ in range(ref_reps):
                np.copyto(ref_dst, ref_src)
            memcpy_ns.append((clock() - t0) / ref_reps)

        was = gc.isenabled()
        gc.disable()
        try:
            # The back-to-back copies and the WAITER rounds disturb the
            # rounds after them for several rounds (caches refilled, the
            # helper thread's sleeps let the vCPU go idle): they run in
            # phases of their own, the copies before and after the serving
            # cycles, so that their median sees the same load.
            _repeat(back_to_back, seconds / 16, 3)
            _repeat(lambda: plain(False), 0, 5)  # warm-up: back to steady state

            def cycle() -> None:
                for _ in range(4):
                    plain()
                if serve:
                    served()
                copied()

            _repeat(cycle, seconds * 0.7, 2)
            _repeat(back_to_back, seconds / 16, 3)
            if waiter:
                _repeat(with_waiters, seconds / 8, 3)
        finally:
            if was:
                gc.enable()
        if not np.array_equal(ref_dst, ref_src):
            raise RuntimeError("memcpy reference: the destination differs from the source")
        answered = rig.answered
        served_stat = rig.seg.stat("requests")
    c50, c90 = _percentiles(collect_ns)
    f50, f90 = _percentiles(finish_ns)
    t50, t90 = _percentiles(total_ns)
    memcpy_us = float(np.median(memcpy_ns)) / 1e3
    inloop_us = _percentiles(inloop_ns)[0]
    row: dict[str, Any] = {
        "batch": n, "collect_us": c50, "finish_us": f50, "total_us": t50,
        "per_state_ns": t50 * 1e3 / n, "memcpy_us": memcpy_us, "vs_memcpy": t50 / memcpy_us,
        "memcpy_inloop_us": inloop_us, "vs_memcpy_inloop": t50 / inloop_us,
        "collect_p90_us": c90, "finish_p90_us": f90, "total_p90_us": t90,
        "rounds": len(total_ns), "clients": rig.nclients,
        "slots_per_client": rig.slots_per_client, "state_nbytes": rig.spec.in_bytes,
        "reject_nonfinite": reject_nonfinite, "answered": answered, "served": served_stat,
    }
    if waiter:
        row["finish_waiter_us"], row["finish_waiter_p90_us"] = _percentiles(waiter_ns)
    if serve:
        row["serve_us"], row["serve_p90_us"] = _percentiles(serve_ns)
        row["loop_overhead_us"] = row["serve_us"] - t50
    return row


def run_batch_path(state_shape: tuple[int, ...], policy_size: int,
                   batches: Sequence[int] = (1, 4, 16, 64, 256, 1024),
                   seconds: float = 0.5, *, waiter: bool = True, serve: bool = True,
                   reject_nonfinite: bool = True) -> list[dict[str, Any]]:
    """The evaluator's work per batch outside the model, for each batch size
    (float32 states of state_shape; outputs policy (policy_size,) and value
    (), float32): about `seconds` per size (more where one round takes
    long: every phase runs a few times at least).  See the module docstring
    for what is timed.

    Each row: batch, collect_us, finish_us, total_us (median of collect +
    finish per round), per_state_ns, memcpy_us (one np.copyto of the batch's
    states), vs_memcpy (total_us / memcpy_us); their p90s (collect_p90_us,
    ...); memcpy_inloop_us and vs_memcpy_inloop (the same copy in the
    rounds' cache conditions); finish_waiter_us (the finish step with WAITER on every slot: one
    FUTEX_WAKE_BITSET per doorbell word); serve_us (one batch through Server.serve, the
    model's own time subtracted) and loop_overhead_us (serve_us - total_us);
    rounds, clients, slots_per_client, state_nbytes, reject_nonfinite,
    answered (requests fetched and checked correct) and served (the
    segment's request counter)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    return [measure_batch(tuple(state_shape), policy_size, int(n), seconds, waiter=waiter,
                          serve=serve, reject_nonfinite=reject_nonfinite) for n in batches]


def _fmt(v: Optional[float], spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def format_batch_path(rows: list[dict[str, Any]], state_name: str) -> str:
    """An aligned table of run_batch_path's rows (µs, medians; p90 of the
    total in brackets)."""
    nbytes = rows[0]["state_nbytes"] if rows else 0
    lines = [f"Evaluator time per batch outside the model: {state_name} "
             f"({nbytes:,} B per state), medians in µs",
             "  collect = scan + gather; finish = check + scatter + DONE + wake pass "
             "(no sleeper)",
             "  memcpy = np.copyto of the batch's states back to back; in-loop = the same "
             "copy in the rounds' cache conditions",
             "  finish+WAITER = finish with WAITER on every slot (a doorbell rung); serve = one batch "
             "through Server.serve minus the model"]
    body = [[str(r["batch"]), _fmt(r["collect_us"]), _fmt(r["finish_us"]),
             f"{r['total_us']:.1f} ({r['total_p90_us']:.1f})", f"{r['per_state_ns']:,.0f}",
             _fmt(r["memcpy_us"]), f"{r['vs_memcpy']:.2f}x", _fmt(r["memcpy_inloop_us"]),
             f"{r['vs_memcpy_inloop']:.2f}x", _fmt(r.get("finish_waiter_us")),
             _fmt(r.get("serve_us"))] for r in rows]
    lines += ["  " + s for s in _table(
        ["batch", "collect", "finish", "total (p90)", "ns/state", "memcpy", "vs memcpy",
         "in-loop memcpy", "vs it", "finish+WAITER", "serve"], body, 0)]
    return "\n".join(lines)
