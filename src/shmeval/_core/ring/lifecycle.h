/*
 * ring/lifecycle.h -- the lives of the evaluator and its replicas: the
 * evaluator's state and why it stopped, each replica's entry (serving,
 * stopped, dead, restarted; its weights version, statistics and published
 * report), the owner's restarts left, and the requests to close and to
 * handle a control request between batches.
 */
#ifndef SHMEVAL_RING_LIFECYCLE_H
#define SHMEVAL_RING_LIFECYCLE_H

#include "doorbell.h"

/* ------------------------------------------------------------------ */
/* The evaluator                                                      */
/* ------------------------------------------------------------------ */

static inline uint32_t shm_ev_state(shm_seg *s) {
    /* MO: acquire; pairs with the release stores of ev_state. */
    return atomic_load_explicit(&shm_hdr(s)->ev_state, memory_order_acquire);
}
/* Why it stopped (SHM_STOP_*), and the detail; after shm_ev_state saw a
 * final state. */
static inline uint32_t shm_stop_reason(shm_seg *s, int32_t *detail) {
    /* MO: relaxed; ordered by the caller's acquire load of ev_state. */
    uint64_t w = atomic_load_explicit(&shm_hdr(s)->stop, memory_order_relaxed);
    *detail = (int32_t)(uint32_t)w;
    return (uint32_t)(w >> 32);
}

static inline uint64_t shm_heartbeat(shm_seg *s) {
    /* MO: relaxed; a hint. */
    return atomic_load_explicit(&shm_hdr(s)->heartbeat_ns,
                                memory_order_relaxed);
}

/* ------------------------------------------------------------------ */
/* Replicas                                                           */
/* ------------------------------------------------------------------ */

/* Replica r (process pid, its start time, on `device`) serves: its entry,
 * then the evaluator's STARTING -> SERVING (unless a close was requested
 * meanwhile).  Returns the evaluator's resulting state. */
static inline uint32_t shm_set_serving(shm_seg *s, uint32_t r, int32_t pid,
                                       uint64_t starttime,
                                       const char *device) {
    shm_header *h = shm_hdr(s);
    shm_replica *rep = shm_replica_at(s, r);
    size_t len = strnlen(device, SHM_DEVICE_MAX - 1);
    memcpy(rep->device, device, len);
    rep->device[len] = 0;
    atomic_store_explicit(&rep->starttime, starttime, memory_order_relaxed);
    atomic_store_explicit(&rep->pid, pid, memory_order_relaxed);
    /* MO: relaxed; the release store of its state below publishes it. */
    atomic_fetch_add_explicit(&h->replicas_serving, 1, memory_order_relaxed);
    /* MO: release; pairs with the acquire load in shm_replica_info. */
    atomic_store_explicit(&rep->state, REPLICA_SERVING, memory_order_release);
    atomic_store_explicit(&h->heartbeat_ns, shm_now_ns(),
                          memory_order_relaxed);
    uint64_t t0 = 0;
    /* MO: relaxed; the first replica's start time wins (statistics). */
    atomic_compare_exchange_strong_explicit(&h->st[ST_SERVE_START_NS], &t0,
                                            shm_now_ns(), memory_order_relaxed,
                                            memory_order_relaxed);
    uint32_t expected = EV_STARTING;
    /* MO: acq_rel; pairs with the CAS in shm_request_close. */
    atomic_compare_exchange_strong_explicit(&h->ev_state, &expected,
                                            EV_SERVING, memory_order_acq_rel,
                                            memory_order_acquire);
    return atomic_load_explicit(&h->ev_state, memory_order_acquire);
}

static inline uint32_t shm_replicas_serving(shm_seg *s) {
    /* MO: relaxed; a count. */
    return atomic_load_explicit(&shm_hdr(s)->replicas_serving,
                                memory_order_relaxed);
}

/* Replica r's process, state and weights version (for liveness checks and
 * statistics). */
static inline int32_t shm_replica_info(shm_seg *s, uint32_t r,
                                       uint64_t *starttime, uint32_t *state,
                                       uint64_t *version) {
    shm_replica *rep = shm_replica_at(s, r);
    /* MO: acquire; pairs with the release store of the state in
     * shm_set_serving (pid and start time are written before it). */
    *state = atomic_load_explicit(&rep->state, memory_order_acquire);
    *starttime = atomic_load_explicit(&rep->starttime, memory_order_relaxed);
    *version = atomic_load_explicit(&rep->version, memory_order_relaxed);
    return atomic_load_explicit(&rep->pid, memory_order_relaxed);
}
/* Replica r's statistics: requests, batches, model time. */
static inline void shm_replica_stats(shm_seg *s, uint32_t r, uint64_t out[3]) {
    shm_replica *rep = shm_replica_at(s, r);
    /* MO: relaxed; statistics. */
    out[0] = atomic_load_explicit(&rep->requests, memory_order_relaxed);
    out[1] = atomic_load_explicit(&rep->batches, memory_order_relaxed);
    out[2] = atomic_load_explicit(&rep->model_ns, memory_order_relaxed);
}
static inline const char *shm_replica_device(shm_seg *s, uint32_t r) {
    return shm_replica_at(s, r)->device;
}

/* Replica r serves the given weights version from now on. */
static inline void shm_replica_version(shm_seg *s, uint32_t r,
                                       uint64_t version) {
    /* MO: relaxed; information for statistics (the floor orders). */
    atomic_store_explicit(&shm_replica_at(s, r)->version, version,
                          memory_order_relaxed);
}

/* Replica r leaves REPLICA_SERVING for `state` (STOPPED: by itself;
 * DEAD: found dead by another, or by its restarted self).  Returns the
 * replicas still serving after it, or -1 when r was not serving (another
 * got there first: the CAS lets one caller only do what follows, such as
 * putting r's batches back) or is no longer process `pid`. */
static inline int shm_replica_stop(shm_seg *s, uint32_t r, uint32_t state,
                                   int32_t pid) {
    uint32_t cur = REPLICA_SERVING;
    /* A replica found dead is named by the process found gone (pid, else
     * 0): a restarted replica writes its new pid before it serves again
     * (shm_replica_restart), so a finder that judged the old process does
     * not stop the new one.  MO: relaxed; a hint that narrows that race to
     * the instructions between this load and the CAS (docs/protocol.md,
     * *Restarts*). */
    if (pid && atomic_load_explicit(&shm_replica_at(s, r)->pid,
                                    memory_order_relaxed) != pid)
        return -1;
    /* MO: acq_rel; one caller wins, and sees what r did before. */
    if (!atomic_compare_exchange_strong_explicit(
            &shm_replica_at(s, r)->state, &cur, state, memory_order_acq_rel,
            memory_order_relaxed))
        return -1;
    /* MO: acq_rel; the last one out sees every other's leaving. */
    return (int)atomic_fetch_sub_explicit(&shm_hdr(s)->replicas_serving, 1,
                                          memory_order_acq_rel) - 1;
}

/* Replica r's new process (pid, its start time), restarted by the owner
 * after the old one died: the entry leaves SERVING if nobody found the old
 * process dead yet (keeping replicas_serving right: shm_set_serving counts
 * it again), then names the new process, before its tables are put back
 * and it serves (shm_replica_settled, shm_requeue_restarted).  Returns
 * what shm_replica_stop returned. */
static inline int shm_replica_restart(shm_seg *s, uint32_t r, int32_t pid,
                                      uint64_t starttime) {
    shm_replica *rep = shm_replica_at(s, r);
    int left = shm_replica_stop(s, r, REPLICA_DEAD, 0);
    /* MO: relaxed; information for finders (shm_replica_stop's pid). */
    atomic_store_explicit(&rep->starttime, starttime, memory_order_relaxed);
    atomic_store_explicit(&rep->pid, pid, memory_order_relaxed);
    return left;
}
/* How many restarts the owner may still make (shm_header.restarts_left).
 * MO: acquire; pairs with the release store in shm_set_restarts_left: a
 * client that reads the lowered count after a restart also sees the
 * restarted replica serving (it served before the owner lowered it). */
static inline uint32_t shm_restarts_left(shm_seg *s) {
    return atomic_load_explicit(&shm_hdr(s)->restarts_left,
                                memory_order_acquire);
}
static inline void shm_set_restarts_left(shm_seg *s, uint32_t n) {
    /* MO: release; pairs with the acquire load in shm_restarts_left. */
    atomic_store_explicit(&shm_hdr(s)->restarts_left, n, memory_order_release);
}

/* Replica r publishes `len` bytes of text (its tuner's report; at most
 * 8 * SHM_REPORT_WORDS, longer is cut).  Only replica r writes its report.
 * A sequence lock: the sequence number is odd while the words change, and a
 * reader keeps a copy only if it read the same even number before and
 * after (shm_report_read).  The words are atomics, so a reader that
 * overlaps a write reads a mix of old and new words, never a torn word, and
 * then throws the copy away.  No fences (ThreadSanitizer does not model
 * them): the words are stored with release and loaded with acquire. */
static inline void shm_report_write(shm_seg *s, uint32_t r, const char *text,
                                    uint64_t len) {
    shm_replica *rep = shm_replica_at(s, r);
    if (len > 8ull * SHM_REPORT_WORDS) len = 8ull * SHM_REPORT_WORDS;
    /* MO: relaxed; its only writer is this thread. */
    uint64_t seq = atomic_load_explicit(&rep->report_seq, memory_order_relaxed);
    /* MO: relaxed; ordered before each word below by that word's release
     * store: a reader that loads (acquire) any new word then reads the odd
     * number, or a later one, when it checks the sequence again. */
    atomic_store_explicit(&rep->report_seq, seq + 1, memory_order_relaxed);
    for (uint64_t i = 0; i * 8 < len; i++) {
        uint64_t w = 0;
        memcpy(&w, text + i * 8, len - i * 8 < 8 ? len - i * 8 : 8);
        /* MO: release; see the odd number above. */
        atomic_store_explicit(&rep->report[i], w, memory_order_release);
        if (i == (len / 8) / 2) SHM_HOOK("report_write_half");
    }
    /* MO: release; as the words. */
    atomic_store_explicit(&rep->report_len, len, memory_order_release);
    /* MO: release; pairs with the reader's acquire load of the sequence
     * number before its copy. */
    atomic_store_explicit(&rep->report_seq, seq + 2, memory_order_release);
}

/* Copies replica r's report into buf (cap bytes, at least 8 *
 * SHM_REPORT_WORDS); returns its length, 0 when it has none, or
 * -1 when every try overlapped a write. */
static inline int64_t shm_report_read(shm_seg *s, uint32_t r, char *buf,
                                      uint64_t cap) {
    shm_replica *rep = shm_replica_at(s, r);
    for (int tries = 0; tries < 64; tries++) {
        /* MO: acquire; pairs with the writer's release store of an even
         * number: the words and length of that write are visible. */
        uint64_t s0 = atomic_load_explicit(&rep->report_seq, memory_order_acquire);
        if (s0 & 1) {
            sched_yield();
            continue;
        }
        /* MO: acquire, as each word below: if it comes from a later write,
         * that write's odd number (or a later one) is visible to the
         * re-read of the sequence, and the copy is thrown away. */
        uint64_t len = atomic_load_explicit(&rep->report_len, memory_order_acquire);
        if (len > cap) len = cap;
        if (len > 8ull * SHM_REPORT_WORDS) len = 8ull * SHM_REPORT_WORDS;
        for (uint64_t i = 0; i * 8 < len; i++) {
            uint64_t w = atomic_load_explicit(&rep->report[i], memory_order_acquire);
            memcpy(buf + i * 8, &w, len - i * 8 < 8 ? len - i * 8 : 8);
        }
        /* MO: relaxed; ordered after the acquire loads above. */
        if (atomic_load_explicit(&rep->report_seq, memory_order_relaxed) == s0)
            return (int64_t)len;
    }
    return -1;
}

/* ------------------------------------------------------------------ */
/* Close and control                                                  */
/* ------------------------------------------------------------------ */

/* Requests the serving loop to stop; wakes it if asleep. */
static inline void shm_request_close(shm_seg *s) {
    shm_header *h = shm_hdr(s);
    uint32_t cur = atomic_load_explicit(&h->ev_state, memory_order_relaxed);
    /* MO: release CAS loop; pairs with the acquire loads in shm_collect. Only
     * STARTING/SERVING move to CLOSING: CLOSED and DIED stay as they are. */
    while (cur < EV_CLOSING &&
           !atomic_compare_exchange_weak_explicit(&h->ev_state, &cur,
                                                  EV_CLOSING,
                                                  memory_order_release,
                                                  memory_order_relaxed)) {
    }
    /* MO: seq_cst; a change of submit_seq makes a concurrent futex_wait in
     * shm_collect return at once. */
    atomic_fetch_add_explicit(&h->submit_seq, 1, memory_order_seq_cst);
    shm_futex_wake(&h->submit_seq, INT_MAX);
}

/* Asks the serving loop to handle a control request between batches and
 * wakes it if asleep.  Returns the request's ticket (1, 2, ...): the loop
 * reports it handled through shm_control_done.  Serialise callers. */
static inline uint32_t shm_request_control(shm_seg *s) {
    shm_header *h = shm_hdr(s);
    /* MO: release; pairs with the acquire load in shm_collect. */
    uint32_t ticket =
        atomic_fetch_add_explicit(&h->ctl_req, 1, memory_order_release) + 1;
    /* MO: seq_cst; as in shm_request_close: a changed submit_seq makes a
     * sleeping or about-to-sleep evaluator return to its loop, where it sees
     * ctl_req. */
    atomic_fetch_add_explicit(&h->submit_seq, 1, memory_order_seq_cst);
    shm_futex_wake(&h->submit_seq, INT_MAX);
    return ticket;
}
/* Replica r has handled the control requests up to `ticket`. */
static inline void shm_control_done(shm_seg *s, uint32_t r, uint32_t ticket) {
    /* MO: release; the controller may read ctl_done to see progress. */
    atomic_store_explicit(&shm_replica_at(s, r)->ctl_done, ticket,
                          memory_order_release);
}
/* Replica r's pending control requests: the requested and the handled
 * tickets. */
static inline uint32_t shm_control_pending(shm_seg *s, uint32_t r,
                                           uint32_t *done) {
    shm_header *h = shm_hdr(s);
    /* MO: acquire; pairs with the release stores above. */
    *done = atomic_load_explicit(&shm_replica_at(s, r)->ctl_done,
                                 memory_order_acquire);
    return atomic_load_explicit(&h->ctl_req, memory_order_acquire);
}

/* Records why the evaluator stopped (the first caller's reason wins, so
 * that an owner closing an evaluator that just crashed does not report a
 * clean close), stores the final state that reason implies (EV_CLOSED for
 * SHM_STOP_CLOSED, else EV_DIED), then wakes every sleeping client so it
 * sees it within one futex round instead of its timeout. */
static inline void shm_close_and_wake(shm_seg *s, uint32_t reason,
                                      int32_t detail) {
    shm_header *h = shm_hdr(s);
    uint64_t want = (uint64_t)reason << 32 | (uint32_t)detail, stop = 0;
    /* MO: relaxed; published by the release store of ev_state below.  On
     * failure `stop` holds the winner's word, and every caller derives the
     * same final state from it. */
    if (!atomic_compare_exchange_strong_explicit(
            &h->stop, &stop, want, memory_order_relaxed, memory_order_relaxed))
        want = stop;
    uint32_t final_state =
        (uint32_t)(want >> 32) == SHM_STOP_CLOSED ? EV_CLOSED : EV_DIED;
    /* MO: release; a waiter that reads a doorbell rung below sees it, and
     * one that reads this final state sees the stop word. */
    atomic_store_explicit(&h->ev_state, final_state, memory_order_release);
    /* Every doorbell, not only those below the clients' high-water mark: a
     * client claimed meanwhile must not sleep through the close either. */
    for (uint32_t g = 0; g < (s->p.max_clients + 31u) / 32u; g++)
        shm_ring_doorbell(s, g, FUTEX_BITSET_MATCH_ANY);
}

#endif /* SHMEVAL_RING_LIFECYCLE_H */
