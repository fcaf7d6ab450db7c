/*
 * ring/doorbell.h -- the clients' doorbells: futex words in the header, one
 * per 32 clients, each client with its bit (FUTEX_WAIT_BITSET); how a ring
 * publishes what the ringer changed; and the ticker, a thread that rings
 * one client's doorbell every period so that its waiters sleep without a
 * timer.  The evaluator's own doorbell (submit_seq) is rung by
 * shm_notify_evaluator (slot.h) and slept on by shm_collect (collect.h).
 */
#ifndef SHMEVAL_RING_DOORBELL_H
#define SHMEVAL_RING_DOORBELL_H

#include "layout.h"

/* Client c's doorbell: a futex word shared by 32 clients, and c's bit. */
static inline _Atomic uint32_t *shm_done_word(shm_seg *s, uint32_t c) {
    return &shm_hdr(s)->done_seq[c / 32u];
}
static inline uint32_t shm_done_bit(uint32_t c) { return 1u << (c % 32u); }

/* A doorbell ring: a new value, then the wake.  MO: release; what the
 * ringer changed before it is visible to a waiter whose acquire load of the
 * word sees the new value (see shm_slots_wait_core). */
static inline void shm_ring_word(_Atomic uint32_t *bell, uint32_t bits) {
    atomic_fetch_add_explicit(bell, 1, memory_order_release);
    shm_futex_wake_bits(bell, bits);
}

/* Rings doorbell word `group` for the waiters with `bits`.  MO: release;
 * the slot words changed before it (DONE, FAILED) or ev_state (closed) are
 * visible to a waiter that reads the new value (see shm_slots_wait_core). */
static inline void shm_ring_doorbell(shm_seg *s, uint32_t group,
                                     uint32_t bits) {
    shm_ring_word(&shm_hdr(s)->done_seq[group], bits);
}

/* ------------------------------------------------------------------ */
/* Ticker                                                             */
/* ------------------------------------------------------------------ */

/* A ticker: a thread of the client's process that, every period_ns,
 * advances `tick` and rings client c's doorbell (its bit only).  Its
 * process's waiters then sleep without a timer (shm_slot_wait_ticked) and
 * still come back every period to check on the evaluator: one timer wake-up
 * per period for the whole process instead of a timer armed and cancelled
 * by every sleep.  shm_ticker_start / shm_ticker_stop, below. */
typedef struct {
    _Atomic uint32_t *word;   /* the futex word it rings; its mapping must
                                 outlive the ticker */
    uint32_t bits;            /* the waiters it wakes (FUTEX_WAKE_BITSET) */
    int bump;                 /* 1: a doorbell, its value goes up each ring */
    uint32_t c;               /* the client whose doorbell it rings */
    uint64_t period_ns;
    _Atomic uint32_t tick;    /* ticks so far */
    _Atomic uint32_t stop;    /* 1: stop (a private futex word) */
    int running;              /* started and not yet joined */
    pthread_t thread;
} shm_ticker;

/* One tick: a waiter of client c that sees the new tick returns
 * SHM_TIMEOUT.  MO: relaxed increment, published by the release increment
 * of the doorbell that follows (shm_ring_word), which a waiter loads
 * (acquire) before it looks at the tick and sleeps. */
static inline void shm_ticker_tick(shm_ticker *t) {
    atomic_fetch_add_explicit(&t->tick, 1, memory_order_relaxed);
    if (t->bump)
        shm_ring_word(t->word, t->bits);
    else
        shm_futex_wake_bits(t->word, t->bits);
}

static void *shm_ticker_main(void *arg) {
    shm_ticker *t = (shm_ticker *)arg;
    struct timespec ts;
    ts.tv_sec = (time_t)(t->period_ns / 1000000000ull);
    ts.tv_nsec = (long)(t->period_ns % 1000000000ull);
    /* MO (both loads of stop): acquire; pairs with the release store in
     * shm_ticker_stop. */
    while (!atomic_load_explicit(&t->stop, memory_order_acquire)) {
        /* Sleeps one period, or until shm_ticker_stop wakes it (a relative
         * timeout: the timer is this thread's, once per period). */
        syscall(SYS_futex, (uint32_t *)&t->stop, FUTEX_WAIT_PRIVATE, 0, &ts,
                NULL, 0);
        if (atomic_load_explicit(&t->stop, memory_order_acquire)) break;
        shm_ticker_tick(t);
    }
    /* The last ring comes after stop was seen: a waiter whose load of the
     * doorbell sees this ring sees stop too (and one that loaded it before
     * is woken by the ring, or finds the doorbell changed). */
    shm_ticker_tick(t);
    return NULL;
}

/* Starts t: every period_ns it rings `word` for the waiters with `bits`
 * (bump: as a doorbell, shm_ring_word; else a bare wake).  The thread
 * blocks every signal, so that signals reach the process's own threads.
 * Returns 0, or an errno value (the caller then waits with timers). */
static inline int shm_ticker_start_word(shm_ticker *t, _Atomic uint32_t *word,
                                        uint32_t bits, int bump,
                                        uint64_t period_ns) {
    sigset_t all, old;
    pthread_attr_t attr;
    int rc;
    t->word = word;
    t->bits = bits;
    t->bump = bump;
    t->c = UINT32_MAX;
    t->period_ns = period_ns ? period_ns : 1;
    atomic_init(&t->tick, 0);
    atomic_init(&t->stop, 0);
    t->running = 0;
    if ((rc = pthread_attr_init(&attr)) != 0) return rc;
    /* The thread's needs are a few hundred bytes of stack. */
    pthread_attr_setstacksize(&attr, 64 * 1024);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    rc = pthread_create(&t->thread, &attr, shm_ticker_main, t);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc == 0) t->running = 1;
    return rc;
}

/* Starts t for client c of segment s (whose mapping must stay until
 * shm_ticker_stop): it rings c's doorbell, c's bit only. */
static inline int shm_ticker_start(shm_ticker *t, shm_seg *s, uint32_t c,
                                   uint64_t period_ns) {
    int rc = shm_ticker_start_word(t, shm_done_word(s, c), shm_done_bit(c), 1,
                                   period_ns);
    t->c = c;
    return rc;
}

/* Stops and joins t's thread; it ticks once more on its way out, and a
 * waiter that finds `stop` set returns SHM_TIMEOUT, so a waiter that chose
 * this ticker returns and then waits with timers or another ticker.  A
 * stopped ticker is not started again while such a waiter may still look
 * at it (the Python layer starts a new one).  Only from the process that
 * started it (a forked child has no such thread: it just forgets t). */
static inline void shm_ticker_stop(shm_ticker *t) {
    if (!t->running) return;
    /* MO: release; pairs with the acquire load in shm_ticker_main. */
    atomic_store_explicit(&t->stop, 1, memory_order_release);
    syscall(SYS_futex, (uint32_t *)&t->stop, FUTEX_WAKE_PRIVATE, 1, NULL,
            NULL, 0);
    pthread_join(t->thread, NULL);
    t->running = 0;
}

#endif /* SHMEVAL_RING_DOORBELL_H */
