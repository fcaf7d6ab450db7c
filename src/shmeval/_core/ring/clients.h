/*
 * ring/clients.h -- the client table: a process claims an entry
 * (shm_client_register), leaves it (shm_client_detach), and the evaluator
 * reads it for its housekeeping and frees it between batches
 * (shm_client_reclaim), with its slots moved on to a new generation.
 */
#ifndef SHMEVAL_RING_CLIENTS_H
#define SHMEVAL_RING_CLIENTS_H

#include "doorbell.h"
#include "stats.h"

/* 1 + the highest client index ever claimed, clamped to max_clients (from
 * the process-local params checked at attach): a segment scribbled on by
 * another process of the same user must not make anyone index past the
 * client table. */
static inline uint32_t shm_clients_hwm(shm_seg *s) {
    /* MO: acquire; pairs with the release CAS in shm_client_register. */
    uint32_t hwm = atomic_load_explicit(&shm_hdr(s)->clients_hwm,
                                        memory_order_acquire);
    return hwm < s->p.max_clients ? hwm : s->p.max_clients;
}

/* Claims a free client entry for process pid (its /proc start time and pid
 * namespace, 0 when unknown); returns its index or SHM_E_FULL.
 *
 * Everything that must cover the entry happens before the claim, so that a
 * claimer killed at any point leaves nothing unaccounted for: the
 * high-water mark (which bounds the evaluator's scans and its liveness
 * checks) is raised first, and n_attached is counted first (and taken back
 * if the claim fails), so a process killed between the two over-counts
 * this hint by one rather than wrapping it below zero at the reclaim. */
static inline int shm_client_register(shm_seg *s, int32_t pid,
                                      uint64_t starttime, uint64_t pid_ns) {
    shm_header *h = shm_hdr(s);
    if (pid <= 0) return SHM_E_PARAMS; /* 0 marks a free entry */
    for (uint32_t c = 0; c < s->p.max_clients; c++) {
        shm_client *e = shm_client_at(s, c);
        /* MO: relaxed; a pre-check only, the CAS below decides. */
        if (atomic_load_explicit(&e->owner_pid, memory_order_relaxed) != 0)
            continue;
        uint32_t hwm =
            atomic_load_explicit(&h->clients_hwm, memory_order_relaxed);
        /* MO: release CAS; pairs with the acquire load of clients_hwm in
         * shm_clients_hwm (the evaluator's scans and housekeeping). */
        while (hwm < c + 1 &&
               !atomic_compare_exchange_weak_explicit(
                   &h->clients_hwm, &hwm, c + 1, memory_order_release,
                   memory_order_relaxed)) {
        }
        /* MO: relaxed; a hint for spin decisions and stats. */
        atomic_fetch_add_explicit(&h->n_attached, 1, memory_order_relaxed);
        int32_t expected = 0;
        /* MO: acq_rel CAS; the acquire half pairs with the release store of
         * owner_pid = 0 in shm_client_reclaim, so the slot words the
         * evaluator reset (FREE, new generation) are visible to us. */
        if (atomic_compare_exchange_strong_explicit(
                &e->owner_pid, &expected, pid, memory_order_acq_rel,
                memory_order_relaxed)) {
            SHM_HOOK("register_claimed");
            /* MO: relaxed (both); only read by the evaluator's liveness
             * check, which treats 0 as "not yet known". */
            atomic_store_explicit(&e->starttime, starttime,
                                  memory_order_relaxed);
            atomic_store_explicit(&e->pid_ns, pid_ns, memory_order_relaxed);
            /* MO: relaxed; an entry handed out has detached == 0 already
             * (reset before owner_pid was released). */
            SHM_ASSERT(atomic_load_explicit(&e->detached,
                                            memory_order_relaxed) == 0);
            return (int)c;
        }
        /* MO: relaxed; taking back our count, as above. */
        atomic_fetch_sub_explicit(&h->n_attached, 1, memory_order_relaxed);
    }
    return SHM_E_FULL;
}

/* The owner leaves; the evaluator reclaims the entry between batches. */
static inline void shm_client_detach(shm_seg *s, uint32_t c) {
    /* MO: release; pairs with the acquire load in shm_client_info, so the
     * owner's last slot writes happen before the reclaim. */
    atomic_store_explicit(&shm_client_at(s, c)->detached, 1,
                          memory_order_release);
}

/* Requests published through entry c so far (statistics). */
static inline uint64_t shm_client_requests(shm_seg *s, uint32_t c) {
    /* MO: relaxed; a statistic. */
    return atomic_load_explicit(&shm_client_at(s, c)->requests,
                                memory_order_relaxed);
}

/* Reads an entry for the evaluator's housekeeping. */
static inline int32_t shm_client_info(shm_seg *s, uint32_t c,
                                      uint64_t *starttime, uint64_t *pid_ns,
                                      uint32_t *detached) {
    shm_client *e = shm_client_at(s, c);
    /* MO: acquire (owner_pid, detached); pairs with the CAS in register and
     * the release store in detach.  The identity words are relaxed: 0 reads
     * as "not yet known". */
    int32_t pid = atomic_load_explicit(&e->owner_pid, memory_order_acquire);
    *starttime = atomic_load_explicit(&e->starttime, memory_order_relaxed);
    *pid_ns = atomic_load_explicit(&e->pid_ns, memory_order_relaxed);
    *detached = atomic_load_explicit(&e->detached, memory_order_acquire);
    return pid;
}

/* Evaluator only, between batches: resets the slots of a dead or detached
 * client and frees its entry.  Returns how many slots were stranded
 * mid-write (the client died between claiming and publishing), or
 * SHM_E_STATE, changing nothing, if a slot of the entry is TAKEN: a batch
 * is in flight, and its completion (shm_still_taken, then the output copy)
 * relies on no reclaim happening until it is finished (rule 2 above).
 *
 * The slot words are reset by CAS, not plain stores: a thread of a
 * detached but live owner may still release one of them (by CAS from the
 * generation it began), and each of those transitions must be one
 * indivisible step so that every slot ends FREE with a newer generation. */
static inline int shm_client_reclaim(shm_seg *s, uint32_t c) {
    shm_header *h = shm_hdr(s);
    shm_client *e = shm_client_at(s, c);
    int writing = 0;
    uint32_t K = s->p.slots_per_client;
    for (uint32_t k = 0; k < K; k++) {
        /* MO: relaxed; only the evaluator (the caller) moves a slot into
         * TAKEN, so this check cannot be overtaken. */
        uint32_t cur = atomic_load_explicit(shm_slot_word_at(s, c, k),
                                            memory_order_relaxed);
        if (shm_word_state(cur) == SLOT_TAKEN) return SHM_E_STATE;
    }
    /* Fence out a begin of the former owner that is still running: see
     * shm_slot_begin.  MO: relaxed store, then a seq_cst fence before the
     * words are moved on; pairs with the fence in shm_slot_begin. */
    atomic_store_explicit(&e->owner_pid, SHM_OWNER_RECLAIMING,
                          memory_order_relaxed);
    shm_fence_seq_cst();
    for (uint32_t k = 0; k < K; k++) {
        _Atomic uint32_t *w = shm_slot_word_at(s, c, k);
        /* MO: relaxed; the handover to the next owner is published by the
         * release store of owner_pid below. */
        uint32_t old = atomic_load_explicit(w, memory_order_relaxed);
        while (!atomic_compare_exchange_weak_explicit(
            w, &old, shm_slot_word(SLOT_FREE, shm_word_gen(old) + 1),
            memory_order_relaxed, memory_order_relaxed)) {
        }
        if (shm_word_state(old) == SLOT_WRITING) writing++;
    }
    atomic_store_explicit(&e->detached, 0, memory_order_relaxed);
    atomic_store_explicit(&e->starttime, 0, memory_order_relaxed);
    atomic_store_explicit(&e->pid_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&e->requests, 0, memory_order_relaxed);
    /* The cache counters go to the totals (st[]), so that they outlive the
     * client; they are the stats the entry's next owner starts from. */
    shm_stat_add(&h->st[ST_CACHE_HITS],
                 atomic_exchange_explicit(&e->cache_hits, 0, memory_order_relaxed));
    shm_stat_add(&h->st[ST_CACHE_MISSES],
                 atomic_exchange_explicit(&e->cache_misses, 0, memory_order_relaxed));
    shm_stat_add(&h->st[ST_CACHE_STALE],
                 atomic_exchange_explicit(&e->cache_stale, 0, memory_order_relaxed));
    shm_stat_add(&h->st[ST_CACHE_REPLACED],
                 atomic_exchange_explicit(&e->cache_replaced, 0,
                                          memory_order_relaxed));
    /* A thread of a detached owner may still wait on a slot reclaimed
     * here: its doorbell rings, so that it sees the new generation now,
     * not at its next tick. */
    shm_ring_word(&h->done_seq[c / 32u], 1u << (c % 32u));
    /* MO: relaxed; a hint (clients fetch_add it too, hence atomic RMW). */
    atomic_fetch_sub_explicit(&h->n_attached, 1, memory_order_relaxed);
    shm_stat_add(&h->st[ST_RECLAIMED_CLIENTS], 1);
    shm_stat_add(&h->st[ST_RECLAIMED_WRITING], (uint64_t)writing);
    /* MO: release; pairs with the acquire half of the CAS in
     * shm_client_register: the resets above are visible to the next owner. */
    atomic_store_explicit(&e->owner_pid, 0, memory_order_release);
    return writing;
}

static inline uint32_t shm_n_attached(shm_seg *s) {
    /* MO: relaxed; a hint for spin decisions. */
    return atomic_load_explicit(&shm_hdr(s)->n_attached, memory_order_relaxed);
}

#endif /* SHMEVAL_RING_CLIENTS_H */
