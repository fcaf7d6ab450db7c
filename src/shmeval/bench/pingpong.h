/*
 * pingpong.h -- the benchmark's wake-up reference: a futex ping-pong between
 * two processes, the cheapest blocking request/response the machine allows.
 *
 * It is built from the core's own primitives (ring.h: the futex calls, the
 * spin, the ticker), so that it sleeps and wakes as a shmeval client does
 * and `shmeval bench` can set shmeval's round trip against it.  Benchmarks
 * only: nothing here is part of the protocol, and only the bench extension
 * (_timing.pyx) includes this header.
 */
#ifndef SHMEVAL_BENCH_PINGPONG_H
#define SHMEVAL_BENCH_PINGPONG_H

#include "ring.h"

/* Waits until *w == want: spins up to spin_ns, then sleeps on the word.
 * Returns SHM_OK, or SHM_TIMEOUT after about timeout_ns without it.
 * ticked: a ticker wakes this side now and then (pingpong_run), so a sleep
 * needs no timer, and without a spin the clock is first read after a wake
 * that was not the answer -- the cheapest wait there is, as a shmeval
 * client's is. */
static inline int pingpong_wait(_Atomic uint32_t *w, uint32_t want,
                                uint64_t spin_ns, uint64_t timeout_ns,
                                int ticked) {
    uint64_t start = 0;
    int started = 0;
    for (uint32_t i = 0;; i++) {
        /* MO: acquire; pairs with the release store of the other side. */
        uint32_t cur = atomic_load_explicit(w, memory_order_acquire);
        if (cur == want) return SHM_OK;
        if (spin_ns && (i & 63) != 63) {
            shm_cpu_relax();
            continue;
        }
        if (ticked && !spin_ns && i == 0) {
            shm_futex_wait(w, cur, SHM_NO_DEADLINE);
            continue;
        }
        uint64_t now = shm_now_ns();
        if (!started) {
            start = now;
            started = 1;
        }
        if (now - start >= timeout_ns) return SHM_TIMEOUT;
        if (now - start >= spin_ns)
            shm_futex_wait(w, cur,
                           ticked ? SHM_NO_DEADLINE : timeout_ns - (now - start));
        else
            shm_cpu_relax();
    }
}

/* One side of a two-process futex ping-pong on *w (a word in a shared
 * mapping, 0 at the start): the physical limit a blocking request/response
 * can approach.  word must be 4-byte aligned.  Side 0 stores 2i+1 and waits
 * for 2i+2; side 1 answers.  Each wake is a FUTEX_WAKE system call, each
 * wait spins up to spin_ns before a FUTEX_WAIT without a timer: a ticker
 * thread (100 ms, or timeout_ns if shorter) wakes it to check the time, as
 * shmeval's clients sleep (a timer on every sleep costs a round trip more;
 * `python bench/ceiling.py --timers` measures how much).  Side 0 stores
 * each round trip's ns in lat[i] when lat is not NULL, and in *elapsed
 * (when not NULL) the ns from the first round trip's start to the last
 * one's end: starting and stopping the ticker thread stay outside it, since
 * on a busy machine they can take longer than hundreds of round trips.
 * Returns SHM_OK, or SHM_TIMEOUT when the other side fell silent. */
static inline int pingpong_run(void *word, int side, uint64_t rounds,
                               uint64_t *lat, uint64_t spin_ns,
                               uint64_t timeout_ns, uint64_t *elapsed) {
    _Atomic uint32_t *w = (_Atomic uint32_t *)word;
    shm_ticker tk;
    const uint64_t period = 100000000ull;
    int ticked = shm_ticker_start_word(&tk, w, FUTEX_BITSET_MATCH_ANY, 0,
                                       timeout_ns < period ? timeout_ns
                                                           : period) == 0;
    int rc = SHM_OK;
    uint64_t first = shm_now_ns();
    for (uint64_t i = 0; i < rounds && rc == SHM_OK; i++) {
        uint32_t ping = (uint32_t)(2 * i + 1), pong = ping + 1;
        if (side == 0) {
            uint64_t t0 = shm_now_ns();
            /* MO: release; the other side's acquire load sees it. */
            atomic_store_explicit(w, ping, memory_order_release);
            shm_futex_wake(w, 1);
            rc = pingpong_wait(w, pong, spin_ns, timeout_ns, ticked);
            if (lat && rc == SHM_OK) lat[i] = shm_now_ns() - t0;
        } else {
            rc = pingpong_wait(w, ping, spin_ns, timeout_ns, ticked);
            if (rc != SHM_OK) break;
            /* MO: release; as above. */
            atomic_store_explicit(w, pong, memory_order_release);
            shm_futex_wake(w, 1);
        }
    }
    if (elapsed) *elapsed = shm_now_ns() - first;
    if (ticked) shm_ticker_stop(&tk);
    return rc;
}

#endif /* SHMEVAL_BENCH_PINGPONG_H */
