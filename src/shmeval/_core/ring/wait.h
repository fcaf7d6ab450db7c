/*
 * ring/wait.h -- how a thread waits: the spin (pause or yield between
 * looks, the clock read every SHM_SPIN_LOOKS looks), the spin policy (how
 * long a client or the evaluator spins, given the processes and the CPUs
 * and the crowding the evaluator publishes), and a client's wait for the
 * answers of its slots (spin, then sleep on its doorbell).
 */
#ifndef SHMEVAL_RING_WAIT_H
#define SHMEVAL_RING_WAIT_H

#include "doorbell.h"

/* ------------------------------------------------------------------ */
/* Spinning                                                           */
/* ------------------------------------------------------------------ */

/* The pause between two looks of a spin.  A spin reads the clock once
 * every SHM_SPIN_LOOKS looks, so the pause also sets how often that is.
 * x86: `pause`, a hint that also stalls the core for a while.  AArch64:
 * `isb`, not `yield`: `yield` is a NOP on cores without SMT (the Neoverse
 * cores of Graviton and Grace among them), so a spin would read the clock
 * and call sched_yield() every fraction of a µs instead of every few µs;
 * `isb` waits for the pipeline to drain, a stall of some tens of ns like
 * `pause` (Rust's spin_loop hint made the same switch).
 * Elsewhere nothing: the looks are atomic loads, which the compiler
 * cannot merge, so the spin stays correct, only busier. */
static inline void shm_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("isb");
#endif
}

/* A spin budget with this bit set gives the CPU away between all looks
 * (sched_yield() instead of pause), not only every SHM_SPIN_LOOKS of them:
 * the waiter spins only while no other task wants its CPU.  shm_spin_policy
 * sets it when the clients and the evaluator are one process more than the
 * CPUs (docs/protocol.md, Waiting).  The bit is not part of the budget. */
#define SHM_SPIN_YIELD (1ull << 63)
/* A plain spin reads the clock once every SHM_SPIN_LOOKS looks, and gives
 * the CPU away there as well (sched_yield(), which returns at once when no
 * other task on this CPU is runnable).  The processes fitting the CPUs does
 * not mean each has a CPU of its own: a futex wake-up may move the woken
 * process onto its waker's CPU, and a spin that held that CPU for its whole
 * budget then kept the process it waits for from running at all.  The
 * yield hands it over within SHM_SPIN_LOOKS looks (a few µs), at the price
 * of a system call per clock read (docs/protocol.md, Waiting). */
#define SHM_SPIN_LOOKS 64u
#ifndef shm_sched_yield /* the C tests count the calls (tests/c) */
#define shm_sched_yield() sched_yield()
#endif

/* The pause after look i of a spin that must end at `end` (CLOCK_MONOTONIC
 * ns): a yielding spin reads the clock and yields after every look, a
 * plain one pauses and does both after every SHM_SPIN_LOOKS looks.
 * Returns 1 once `end` has passed (the spin is over). */
static inline int shm_spin_pause(uint32_t i, uint64_t end, int yield) {
    if (yield || i % SHM_SPIN_LOOKS == SHM_SPIN_LOOKS - 1) {
        if (shm_now_ns() >= end) return 1;
        shm_sched_yield();
    } else {
        shm_cpu_relax();
    }
    return 0;
}

/* shm_header.crowding: the runnable tasks on the evaluator's CPUs against
 * those CPUs, as the spin rule reads them (shm_client_spin). */
enum shm_crowding {
    SHM_CROWD_NONE = 0,  /* no reading, or no more tasks than CPUs */
    SHM_CROWD_YIELD = 1, /* one more task than CPUs */
    SHM_CROWD_SLEEP = 2, /* more than that */
};
static inline uint32_t shm_crowding(shm_seg *s) {
    /* MO: relaxed; a hint for spin decisions, like n_attached. */
    return atomic_load_explicit(&shm_hdr(s)->crowding, memory_order_relaxed);
}
static inline void shm_set_crowding(shm_seg *s, uint32_t c) {
    /* MO: relaxed; see shm_crowding.  Stored only on a change: every
     * client's wait reads this line. */
    if (atomic_load_explicit(&shm_hdr(s)->crowding, memory_order_relaxed) != c)
        atomic_store_explicit(&shm_hdr(s)->crowding, c, memory_order_relaxed);
}

/* ------------------------------------------------------------------ */
/* The spin policy                                                    */
/* ------------------------------------------------------------------ */

/* The spin budget of a wait (a client's for its answer, or the
 * evaluator's for requests) before it sleeps, from the budget asked for
 * (spin_ns; 0 turns spinning off), the processes on the segment (the
 * attached clients and the evaluator) and the CPUs they may use (ncpu):
 *
 *   - processes <= ncpu: spin_ns, a plain spin, since each process has a
 *     CPU.  It still gives its CPU away every SHM_SPIN_LOOKS looks, for a
 *     wake-up may have put the process it waits for on the same CPU;
 *   - processes == ncpu + 1 (as many clients as CPUs): spin_ns |
 *     SHM_SPIN_YIELD, a spin that gives its CPU away between all looks
 *     (sched_yield() instead of pause), so that a waiter holds a CPU only
 *     while no other process wants it.  With 2 clients on 2 CPUs this took
 *     2 workers from ~100 k to 340-420 k round trips/s on the reference
 *     VM; sleeping instead, a CPU went idle and every answer paid the
 *     wake-up of a halted CPU;
 *   - more: 0, no spin.  Even a yielding spin then loses: its waiters crowd
 *     the run queues (the slowest worker fell to 0.14-0.66 of the mean and
 *     p99.9 to 0.5-4 ms at 3-16 workers), and a plain spin holds a CPU
 *     that the process it waits for needs.
 *
 * docs/performance.md, "Which knob when"; docs/protocol.md, Waiting. */
static inline uint64_t shm_spin_policy(uint64_t spin_ns, uint32_t processes,
                                       uint32_t ncpu) {
    if (spin_ns == 0 || processes > ncpu + 1) return 0;
    if (processes <= ncpu) return spin_ns;
    return spin_ns | SHM_SPIN_YIELD;
}

/* The evaluator's spin budget: the policy for its n_attached clients and
 * itself.  None once the client processes outnumber its CPUs, when a
 * spinning evaluator holds a CPU that the clients it waits for need; a
 * yielding spin with as many clients as CPUs.  Spinning at all with 2
 * clients on 2 CPUs doubled round trips/s on the reference VM. */
static inline uint64_t shm_evaluator_spin(uint64_t spin_ns,
                                          uint32_t n_attached, uint32_t ncpu) {
    return shm_spin_policy(spin_ns, n_attached + 1, ncpu);
}

/* A client's spin budget: the policy for the n_attached clients and the
 * evaluator, counted as at least as many processes as the crowding the
 * evaluator's tuner published (shm_crowding) says there are: other
 * programs' runnable tasks take CPUs too, and a spin that yields to one of
 * them gets its CPU back only when that task's time slice ends
 * (milliseconds), where a sleeper is woken at once. */
static inline uint64_t shm_client_spin(uint64_t spin_ns, uint32_t n_attached,
                                       uint32_t crowding, uint32_t ncpu) {
    uint32_t processes = n_attached + 1;
    if (crowding != SHM_CROWD_NONE && processes < ncpu + crowding)
        processes = ncpu + crowding;
    return shm_spin_policy(spin_ns, processes, ncpu);
}

/* ------------------------------------------------------------------ */
/* A client's wait for its answers                                    */
/* ------------------------------------------------------------------ */

/* One look at slots ks[i] of client c, begun with generations gens[i]:
 * the index of the first one that is final or reclaimed, with its state
 * (DONE, FAILED) or SHM_STALE in *rc; n if none is.  MO: acquire loads;
 * pair with the release CAS in shm_finish (shm_complete, shm_fail): seeing
 * DONE means seeing the outputs. */
static inline uint32_t shm_slots_first(shm_seg *s, uint32_t c,
                                       const uint32_t *ks,
                                       const uint32_t *gens, uint32_t n,
                                       int *rc) {
    for (uint32_t i = 0; i < n; i++) {
        uint32_t cur = atomic_load_explicit(shm_slot_word_at(s, c, ks[i]),
                                            memory_order_acquire);
        if (shm_word_gen(cur) != gens[i]) {
            *rc = SHM_STALE;
            return i;
        }
        if (shm_state_is_final(shm_word_state(cur))) {
            *rc = (int)shm_word_state(cur);
            return i;
        }
    }
    return n;
}

/* The wait core: waits until any of slots ks[0..n) of client c (begun
 * with generations gens[i]) is DONE or FAILED, or was reclaimed (its
 * generation moved on: the answer, if any, is not ours).  Puts that slot's
 * index in *which and returns its state, or SHM_STALE; the lowest index
 * wins when several are.  Otherwise returns SHM_TIMEOUT (the caller checks
 * the evaluator's liveness and calls again) or SHM_CLOSED, with *which = n.
 *
 * Spins for at most spin_ns (the budget of shm_spin_policy: 0 when the
 * processes outnumber the CPUs by more than one, with SHM_SPIN_YIELD when
 * by exactly one), then sleeps on its client's doorbell (shm_done_word,
 * its own bit).  Without a ticker (t == NULL) it waits for at most
 * timeout_ns in all, with a timer on each sleep; with one (t running for
 * client c of this process) it sleeps without a timer and returns
 * SHM_TIMEOUT at the ticker's first tick after the wait began, so within
 * one period (timeout_ns is then not used).
 *
 * Every slot still in flight gets the WAITER bit before the client sleeps,
 * and all of them ring the same doorbell, so one futex wait covers them
 * all.  Why no answer is slept through: see the doorbell's load below.
 * The Python wrappers call it without the GIL, unless the caller is its
 * process's only Python thread (nobody else can want it).  Always inlined:
 * the wait of one slot (shm_slot_wait_ticked) is this with n = 1, and
 * compiles to a loop over that one word. */
static inline __attribute__((always_inline)) int
shm_slots_wait_core(shm_seg *s, uint32_t c, const uint32_t *ks,
                    const uint32_t *gens, uint32_t n, uint64_t spin_ns,
                    uint64_t timeout_ns, shm_ticker *t, uint32_t *which) {
    shm_header *h = shm_hdr(s);
    _Atomic uint32_t *bell = shm_done_word(s, c);
    /* MO: relaxed; compared below after an acquire load of the doorbell,
     * which the ticker rings (release) after each increment. */
    uint32_t tick0 = t ? atomic_load_explicit(&t->tick, memory_order_relaxed)
                       : 0;
    /* The clock is read only where needed: for a spin, and for the
     * deadline of a timed sleep (one clock read fewer per wait). */
    int yield = (spin_ns & SHM_SPIN_YIELD) != 0;
    spin_ns &= ~SHM_SPIN_YIELD;
    uint64_t start = spin_ns ? shm_now_ns() : 0;
    int started = spin_ns != 0;
    int rc = 0;
    *which = n;
    if (n == 0) return SHM_E_STATE;
    if (spin_ns) {
        for (uint32_t i = 0;; i++) {
            if ((*which = shm_slots_first(s, c, ks, gens, n, &rc)) < n)
                return rc;
            if (shm_spin_pause(i, start + spin_ns, yield)) break;
        }
    }
    for (;;) {
        if ((*which = shm_slots_first(s, c, ks, gens, n, &rc)) < n) return rc;
        uint64_t deadline = SHM_NO_DEADLINE;
        if (!t) {
            uint64_t now = shm_now_ns();
            if (!started) {
                start = now;
                started = 1;
            }
            if (now - start >= timeout_ns) return SHM_TIMEOUT;
            /* An absolute deadline; saturated, not wrapped, for huge
             * timeouts. */
            deadline = timeout_ns > (uint64_t)INT64_MAX - start
                           ? (uint64_t)INT64_MAX
                           : start + timeout_ns;
        }
        /* WAITER on every slot still in flight.  MO: relaxed CAS; on each
         * word, the evaluator's completing CAS either comes after ours (and
         * sees WAITER, so it rings the doorbell) or makes ours fail (and
         * the slot, final now, ends the wait at the re-read below). */
        for (uint32_t i = 0; i < n; i++) {
            _Atomic uint32_t *w = shm_slot_word_at(s, c, ks[i]);
            uint32_t cur = atomic_load_explicit(w, memory_order_relaxed);
            /* A slot of its generation was published: READY or later. */
            SHM_ASSERT(shm_word_gen(cur) != gens[i] ||
                       shm_word_state(cur) >= SLOT_READY);
            while (shm_word_gen(cur) == gens[i] &&
                   !shm_state_is_final(shm_word_state(cur)) &&
                   !(cur & SLOT_WAITER) &&
                   !atomic_compare_exchange_weak_explicit(
                       w, &cur, cur | SLOT_WAITER, memory_order_relaxed,
                       memory_order_relaxed)) {
            }
        }
        /* The doorbell, then every word, the state and the tick once more,
         * right before sleeping (other clients' answers ring the same word,
         * and a ring between this load and the futex wait costs a retry).
         * MO: acquire; pairs with the release increment in shm_ring_word,
         * which comes after the ringer's change of a slot word
         * (shm_finish), of ev_state (shm_close_and_wake) or of the tick
         * (shm_ticker_tick).  So if none of those is seen below, `seq`
         * predates that ring, and the futex wait returns at once (EAGAIN)
         * or is woken by it.  The re-read of the words after this load is
         * what makes that hold for an answer: an answer whose ring came
         * before this load is seen by the re-read, not slept through. */
        SHM_HOOK("wait_before_bell");
        uint32_t seq = atomic_load_explicit(bell, memory_order_acquire);
        if ((*which = shm_slots_first(s, c, ks, gens, n, &rc)) < n) return rc;
        /* MO: acquire; pairs with the release store of EV_CLOSED in
         * shm_close_and_wake. */
        if (atomic_load_explicit(&h->ev_state, memory_order_acquire) >=
            EV_CLOSED)
            return SHM_CLOSED;
        /* A tick since the wait began, or a stopped ticker (which ticks no
         * more; it set `stop` before its last ring).  MO: relaxed loads,
         * ordered by the acquire load of the doorbell above. */
        if (t && (atomic_load_explicit(&t->tick, memory_order_relaxed) != tick0 ||
                  atomic_load_explicit(&t->stop, memory_order_relaxed)))
            return SHM_TIMEOUT;
        shm_futex_wait_bits(bell, seq, deadline, shm_done_bit(c));
    }
}

/* Waits until slot (c, k), begun with generation gen, is DONE or FAILED:
 * the wait core for one slot.  Returns the final state, SHM_STALE,
 * SHM_TIMEOUT or SHM_CLOSED. */
static inline int shm_slot_wait_ticked(shm_seg *s, uint32_t c, uint32_t k,
                                       uint32_t gen, uint64_t spin_ns,
                                       uint64_t timeout_ns, shm_ticker *t) {
    uint32_t which;
    return shm_slots_wait_core(s, c, &k, &gen, 1, spin_ns, timeout_ns, t,
                               &which);
}

/* The same without a ticker: every sleep has a timer. */
static inline int shm_slot_wait(shm_seg *s, uint32_t c, uint32_t k,
                                uint32_t gen, uint64_t spin_ns,
                                uint64_t timeout_ns) {
    return shm_slot_wait_ticked(s, c, k, gen, spin_ns, timeout_ns, NULL);
}

/* Waits for any of several slots of one client (pipelined requests): the
 * wait core.  Puts the index of the slot that ended the wait in *which (n
 * when none did) and returns its state (DONE, FAILED) or SHM_STALE, or
 * SHM_TIMEOUT / SHM_CLOSED; SHM_E_STATE for n == 0. */
static inline int shm_slots_wait_any(shm_seg *s, uint32_t c,
                                     const uint32_t *ks, const uint32_t *gens,
                                     uint32_t n, uint64_t spin_ns,
                                     uint64_t timeout_ns, shm_ticker *t,
                                     uint32_t *which) {
    return shm_slots_wait_core(s, c, ks, gens, n, spin_ns, timeout_ns, t,
                               which);
}

#endif /* SHMEVAL_RING_WAIT_H */
