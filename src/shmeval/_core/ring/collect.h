/*
 * ring/collect.h -- the evaluator side of a slot: the scan that takes READY
 * slots and gathers their inputs into a batch, shm_collect (the serving
 * loop's wait for a batch), and the completion that scatters the outputs
 * (or an error) into the slots, publishes DONE (or FAILED) and rings the
 * clients' doorbells.
 */
#ifndef SHMEVAL_RING_COLLECT_H
#define SHMEVAL_RING_COLLECT_H

#include "replicas.h"
#include "slot.h"
#include "stats.h"
#include "wait.h"

/* ------------------------------------------------------------------ */
/* Gathering a batch                                                  */
/* ------------------------------------------------------------------ */

/* Scans client entries starting at *cursor and takes READY slots (up to
 * *cap in total; with `share`, *cap comes down to server v's fair share,
 * shm_fair_share, counted when the first READY slot is found) into `own`,
 * server v's batch table in the caller's memory, gathering their inputs
 * into batch rows [n, ...).  Returns the new n.
 *
 * `own` is the authoritative table: completion (shm_finish and the
 * functions that call it) reads only it, never indexes read back from the
 * segment, which any client may scribble on.  The segment's copy of the
 * table (shm_server_taken) exists only so that, should this replica die,
 * another can put its requests back (shm_requeue, which bounds-checks what
 * it reads). */
static inline uint32_t shm_scan(shm_seg *s, uint32_t v, shm_taken *own,
                                char *batch, uint32_t n, uint32_t *cap,
                                int share, uint32_t *cursor, uint64_t now) {
    shm_header *h = shm_hdr(s);
    shm_server_head *head = shm_server_at(s, v);
    shm_taken *copy = shm_server_taken(s, v);
    uint32_t hwm = shm_clients_hwm(s);
    uint32_t K = s->p.slots_per_client;
    if (hwm == 0) return n;
    uint32_t start = *cursor % hwm;
    for (uint32_t i = 0; i < hwm && n < *cap; i++) {
        uint32_t c = (start + i) % hwm;
        for (uint32_t k = 0; k < K && n < *cap; k++) {
            _Atomic uint32_t *w = shm_slot_word_at(s, c, k);
            /* MO: relaxed; the take below decides. */
            uint32_t cur = atomic_load_explicit(w, memory_order_relaxed);
            if (shm_word_state(cur) != SLOT_READY) continue;
            if (share) {
                /* The share is counted at the first request found, not
                 * on every round of an idle collect. */
                share = 0;
                *cap = shm_fair_share(s, v, n, *cap);
                if (n >= *cap) break;
            }
            uint32_t gen = shm_word_gen(cur);
            /* The segment's table lists the slot before it is TAKEN, so
             * that a replica that finds this one dead finds every slot it
             * took (shm_requeue).  MO: release; pairs with the acquire load
             * of n there. */
            shm_taken t = {c, k, gen, 0};
            copy[n] = t;
            atomic_store_explicit(&head->n, n + 1, memory_order_release);
            SHM_HOOK("scan_listed");
            /* READY -> TAKEN by CAS from exactly READY of this generation
             * (retried only while the client toggles its WAITER bit): two
             * collectors at once (a lock taken over from a holder that was
             * not dead after all, a scribbled replica state) then make
             * double work at worst, never a slot moved past TAKEN with no
             * answer written.  MO: relaxed CAS, then an acquire fence once
             * taken: every write of the word since the client's release
             * CAS of READY is a read-modify-write, so the fence pairs with
             * that publish and the input bytes below are the client's. */
            int took = 0;
            while ((cur & ~SLOT_WAITER) == shm_slot_word(SLOT_READY, gen)) {
                if (atomic_compare_exchange_weak_explicit(
                        w, &cur, cur + (SLOT_TAKEN - SLOT_READY),
                        memory_order_relaxed, memory_order_relaxed)) {
                    took = 1;
                    break;
                }
            }
            if (!took) {
                /* Un-list it: the table holds only slots we took. */
                atomic_store_explicit(&head->n, n, memory_order_relaxed);
                continue;
            }
            SHM_HOOK("scan_taken");
            atomic_thread_fence(memory_order_acquire);
            own[n] = t;
            shm_slot_meta *m = shm_slot_meta_at(s, c, k);
            uint64_t pub = m->publish_ns;
            shm_stat_add(&h->hist_wait[shm_hist_bin(now > pub ? now - pub : 0)],
                         1);
            shm_copy(batch + (uint64_t)n * s->p.in_bytes, shm_slot_in(s, c, k),
                     s->p.in_bytes);
            n++;
        }
    }
    /* Start the next scan after the last client we looked at, so that a
     * full batch does not always favour low client indices. */
    *cursor = start + 1;
    return n;
}

/* Server v waits for requests and gathers up to max_batch of them into
 * `batch` (their slots listed in `own`, its batch table in the caller's
 * memory, and in the segment's copy: shm_scan).
 * Greedy: returns as soon as at least one request is taken, unless
 * max_wait_ns asks to wait (counted from the first taken request) for a
 * fuller batch; with several replicas it takes at most its share of the
 * work outstanding (shm_fair_share).  Spins up to spin_ns for new
 * submissions before it sleeps
 * on the doorbell.  Returns n > 0, or 0 when timeout_ns passed with nothing
 * (housekeeping time), SHM_CLOSED when close was requested, SHM_CONTROL
 * when a control request is pending for its replica, or SHM_BEHIND when
 * the weights floor is past its replica's version.  One collector at a
 * time (rule 1: the caller holds its process's lock and, with several
 * replicas, the collect lock).  Call without the GIL. */
static inline int shm_collect(shm_seg *s, uint32_t v, shm_taken *own,
                              char *batch, uint32_t max_batch,
                              uint32_t *cursor, uint64_t spin_ns,
                              uint64_t max_wait_ns, uint64_t timeout_ns) {
    shm_header *h = shm_hdr(s);
    shm_replica *rep = shm_replica_at(s, shm_server_replica(s, v));
    _Atomic uint32_t *ctl_done = &rep->ctl_done;
    uint64_t start = shm_now_ns(), first = 0;
    uint32_t n = 0;
    int yield = (spin_ns & SHM_SPIN_YIELD) != 0;
    spin_ns &= ~SHM_SPIN_YIELD;
    for (;;) {
        /* MO: acquire; pairs with the seq_cst (hence release) fetch_add in
         * shm_notify_evaluator. */
        uint32_t seq = atomic_load_explicit(&h->submit_seq,
                                            memory_order_acquire);
        uint64_t now = shm_now_ns();
        /* MO: relaxed; liveness hint for stats, read by anyone. */
        atomic_store_explicit(&h->heartbeat_ns, now, memory_order_relaxed);
        /* MO: acquire; pairs with the release CAS in shm_request_close.
         * Checked before every scan so that a close is honoured under
         * constant load too; what was already taken is returned. */
        if (atomic_load_explicit(&h->ev_state, memory_order_acquire) !=
            EV_SERVING)
            return n > 0 ? (int)n : SHM_CLOSED;
        /* Control requests are handled between batches: a batch already
         * begun is returned first.  MO: acquire; pairs with the release
         * fetch_add in shm_request_control. */
        if (atomic_load_explicit(&h->ctl_req, memory_order_acquire) !=
            atomic_load_explicit(ctl_done, memory_order_relaxed))
            return n > 0 ? (int)n : SHM_CONTROL;
        /* With several replicas, the floor may rise while this one waits
         * here (the owner raises it once an update it refused was applied
         * by another): it then stops collecting with its older weights.
         * MO: relaxed; the floor only orders which weights answer. */
        if (s->p.replicas > 1 &&
            atomic_load_explicit(&rep->version, memory_order_relaxed) <
                atomic_load_explicit(&h->version_floor, memory_order_relaxed))
            return n > 0 ? (int)n : SHM_BEHIND;
        uint32_t before = n;
        uint32_t cap = max_batch;
        n = shm_scan(s, v, own, batch, n, &cap, s->p.replicas > 1 && max_wait_ns == 0,
                   cursor, now);
        if (n > before && before == 0) first = now;
        if (n >= cap) return (int)n;
        if (n > 0 && (max_wait_ns == 0 || now - first >= max_wait_ns))
            return (int)n;
        uint64_t deadline = n > 0 ? first + max_wait_ns : start + timeout_ns;
        if (now >= deadline) return (int)n;
        /* Spin on the doorbell word while the budget lasts (and not past
         * the deadline). */
        uint64_t spin_end = now + spin_ns < deadline ? now + spin_ns : deadline;
        int changed = 0;
        for (uint32_t i = 0; spin_ns; i++) {
            /* MO: relaxed; a hint only, the rescan does the acquire. */
            if (atomic_load_explicit(&h->submit_seq, memory_order_relaxed) !=
                seq) {
                changed = 1;
                break;
            }
            if (shm_spin_pause(i, spin_end, yield)) break;
        }
        if (changed) continue;
        now = shm_now_ns();
        if (now >= deadline) return (int)n;
        /* Announce the sleep, re-read the doorbell, sleep on it.  Why a
         * client's request is never slept through: take a client X whose
         * fetch_add of submit_seq the re-read below misses.  All four
         * operations are seq_cst, so in their single total order: our
         * store of 1 < our re-read < X's fetch_add < X's load of
         * ev_sleeping, and X's load sees our 1 (only we write the flag,
         * and we clear it only after the sleep).  So X calls FUTEX_WAKE
         * after its fetch_add.  If we are already queued in the kernel, it
         * wakes us; if not yet, the kernel's check in FUTEX_WAIT (the word
         * is read under the futex bucket lock, with a full barrier against
         * the waker's) sees submit_seq != seq and returns at once.  The
         * user-space re-read alone would not be enough: it is the kernel's
         * check that covers a wake which lands before we are queued.
         * MO: seq_cst store and load. */
        atomic_store_explicit(&h->ev_sleeping, 1, memory_order_seq_cst);
        if (atomic_load_explicit(&h->submit_seq, memory_order_seq_cst) == seq &&
            atomic_load_explicit(&h->ev_state, memory_order_acquire) ==
                EV_SERVING) {
            SHM_HOOK("collect_before_sleep");
            shm_futex_wait(&h->submit_seq, seq, deadline - now);
        }
        /* MO: seq_cst; a client whose load sees this 0 comes after it in
         * the total order, hence before our next announcement and re-read,
         * which therefore sees its fetch_add. */
        atomic_store_explicit(&h->ev_sleeping, 0, memory_order_seq_cst);
    }
}

/* ------------------------------------------------------------------ */
/* Completion                                                         */
/* ------------------------------------------------------------------ */

/* True while slot `t` is still the one this batch took: outputs are written
 * only into such slots.  The check and the copy that follows are two steps;
 * what keeps the slot from being reclaimed between them is rule 2 (no
 * reclaim while a batch is in flight), which shm_client_reclaim enforces. */
static inline int shm_still_taken(shm_seg *s, const shm_taken *t) {
    /* MO: relaxed; only the evaluator moves a slot out of TAKEN. */
    uint32_t cur = atomic_load_explicit(
        shm_slot_word_at(s, t->client, t->slot), memory_order_relaxed);
    return (cur & ~SLOT_WAITER) == shm_slot_word(SLOT_TAKEN, t->gen);
}

/* Marks every slot of the batch TAKEN -> DONE (or FAILED), then wakes the
 * clients asleep on them.  Two passes: a woken client may preempt us (the
 * scheduler favours the wakee), and by then every answer of the batch is
 * already published, so no other client of the batch waits behind it.
 * The generation check refuses to complete a slot that is no longer the one
 * we took (counted in ST_STALE_COMPLETIONS).  Returns how many slots were
 * completed. */
static inline uint32_t shm_finish(shm_seg *s, shm_taken *taken, uint32_t n,
                                  uint32_t final_state) {
    shm_header *h = shm_hdr(s);
    uint32_t done = 0;
    for (uint32_t i = 0; i < n; i++) {
        _Atomic uint32_t *w = shm_slot_word_at(s, taken[i].client,
                                               taken[i].slot);
        uint32_t want = shm_slot_word(SLOT_TAKEN, taken[i].gen);
        taken[i].wake = 0;
        /* MO: relaxed; the CAS below re-checks. */
        uint32_t cur = atomic_load_explicit(w, memory_order_relaxed);
        for (uint32_t tries = 0;; tries++) {
            if ((cur & ~SLOT_WAITER) != want) {
                shm_stat_add(&h->st[ST_STALE_COMPLETIONS], 1);
                break;
            }
            if (tries == SHM_CAS_TRIES) {
                /* The word keeps changing, and only its client's WAITER bit
                 * can (a TAKEN slot is ours alone to move): a client
                 * toggling it in a loop must not hold the evaluator here.
                 * The state moves by an add that leaves that bit as it is.
                 * MO: release, as the CAS. */
                cur = atomic_fetch_add_explicit(w, final_state - SLOT_TAKEN,
                                                memory_order_release);
                taken[i].wake = 1;
                done++;
                break;
            }
            /* MO: release; pairs with the acquire loads in shm_slot_wait:
             * the outputs written before this are visible to the client.
             * Clearing WAITER here is fine: we wake the waiter below. */
            if (atomic_compare_exchange_weak_explicit(
                    w, &cur, shm_slot_word(final_state, taken[i].gen),
                    memory_order_release, memory_order_relaxed)) {
                taken[i].wake = (cur & SLOT_WAITER) != 0;
                done++;
                break;
            }
        }
    }
    /* One FUTEX_WAKE_BITSET per doorbell word for the whole batch: the
     * kernel wakes every waiter of the batch before this thread returns to
     * user space, where a wakee may preempt it (one wake system call per
     * slot let the first wakee preempt us before we had woken the rest).
     * A spurious wake (the client already took its answer) only makes a
     * waiter look again. */
    uint32_t bits = 0, group = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!taken[i].wake) continue;
        uint32_t g = taken[i].client / 32u;
        if (bits && g != group) {
            shm_ring_doorbell(s, group, bits);
            bits = 0;
        }
        group = g;
        bits |= shm_done_bit(taken[i].client);
    }
    if (bits) shm_ring_doorbell(s, group, bits);
    return done;
}

/* Scatters the outputs of a batch into its slots, stamps the model version
 * and publishes DONE.  Output field j of request i is the field_bytes[j]
 * contiguous bytes at fields[j] + i * field_stride[j] (a stride, so that a
 * model output that is a strided view needs no copy); it goes to offset
 * field_off[j] of the slot's output area (the caller checked that the fields
 * fit in out_bytes and that the source rows exist). */
static inline uint32_t shm_complete_fields(shm_seg *s, shm_taken *taken,
                                           uint32_t n, uint32_t nfields,
                                           const char *const *fields,
                                           const uint64_t *field_bytes,
                                           const int64_t *field_stride,
                                           const uint64_t *field_off,
                                           uint64_t model_version) {
    for (uint32_t i = 0; i < n; i++) {
        if (!shm_still_taken(s, &taken[i])) continue; /* counted in finish */
        shm_slot_meta *m = shm_slot_meta_at(s, taken[i].client, taken[i].slot);
        char *out = shm_slot_out(s, taken[i].client, taken[i].slot);
        m->model_version = model_version;
        m->err_len = 0;
        for (uint32_t j = 0; j < nfields; j++)
            memcpy(out + field_off[j], fields[j] + (int64_t)i * field_stride[j],
                   field_bytes[j]);
    }
    return shm_finish(s, taken, n, SLOT_DONE);
}

/* The same with one packed result row of out_bytes per request. */
static inline uint32_t shm_complete(shm_seg *s, shm_taken *taken,
                                    uint32_t n, const char *results,
                                    uint64_t model_version) {
    uint64_t off = 0;
    int64_t stride = (int64_t)s->p.out_bytes;
    return shm_complete_fields(s, taken, n, 1, &results, &s->p.out_bytes,
                               &stride, &off, model_version);
}

/* Fails every slot of the batch with the same error text. */
static inline uint32_t shm_fail(shm_seg *s, shm_taken *taken,
                                uint32_t n, const char *msg, uint32_t len) {
    if (len > s->l.out_area) len = (uint32_t)s->l.out_area;
    for (uint32_t i = 0; i < n; i++) {
        if (!shm_still_taken(s, &taken[i])) continue; /* counted in finish */
        shm_slot_meta *m = shm_slot_meta_at(s, taken[i].client, taken[i].slot);
        m->err_len = len;
        memcpy(shm_slot_out(s, taken[i].client, taken[i].slot), msg, len);
    }
    return shm_finish(s, taken, n, SLOT_FAILED);
}

#endif /* SHMEVAL_RING_COLLECT_H */
