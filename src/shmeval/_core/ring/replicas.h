/*
 * ring/replicas.h -- several replicas on one segment: the collect lock they
 * take turns under, the servers' batch tables in the segment, the put-back
 * of a dead replica's batches, the weights floor, and the fair share of
 * the work that each replica takes.
 */
#ifndef SHMEVAL_RING_REPLICAS_H
#define SHMEVAL_RING_REPLICAS_H

#include "clients.h"
#include "doorbell.h"
#include "slot.h"

/* ------------------------------------------------------------------ */
/* The collect lock                                                   */
/* ------------------------------------------------------------------ */

/* The collect lock's waiters bit: someone may be asleep on the word. */
#define SHM_LOCK_WAITERS 0x80000000u

/* Takes the collect lock for server v (several replicas take turns
 * collecting: rule 1), waiting at most timeout_ns.  Returns SHM_OK, or
 * SHM_TIMEOUT: the caller then checks that the holder (shm_collect_holder)
 * is alive and takes the lock over from a dead one (shm_collect_steal).
 * A futex mutex in one word (the holder's id, and a bit for sleepers), so
 * that who holds it is never unknown, even if the holder dies right after
 * taking it. */
static inline int shm_collect_lock(shm_seg *s, uint32_t v,
                                   uint64_t timeout_ns) {
    _Atomic uint32_t *lock = &shm_hdr(s)->collect_lock;
    uint32_t me = v + 1, cur = 0;
    /* MO: acquire (every successful CAS here); pairs with the release
     * exchange in shm_collect_unlock: the previous holder's scans and
     * table writes happen before ours. */
    if (atomic_compare_exchange_strong_explicit(
            lock, &cur, me, memory_order_acquire, memory_order_relaxed))
        return SHM_OK;
    uint64_t start = shm_now_ns();
    for (;;) {
        /* Checked on every round, not only before a sleep: a word that
         * keeps changing (scribbled on) must not hold us past the
         * timeout. */
        uint64_t now = shm_now_ns();
        if (now - start >= timeout_ns) return SHM_TIMEOUT;
        if (cur == 0) {
            /* Free after a wait: take it with the waiters bit, since
             * others may still sleep on it (an extra wake at worst). */
            if (atomic_compare_exchange_weak_explicit(
                    lock, &cur, me | SHM_LOCK_WAITERS, memory_order_acquire,
                    memory_order_relaxed))
                return SHM_OK;
            continue;
        }
        if (!(cur & SHM_LOCK_WAITERS)) {
            /* MO: relaxed; the bit only asks the holder for a wake. */
            if (!atomic_compare_exchange_weak_explicit(
                    lock, &cur, cur | SHM_LOCK_WAITERS, memory_order_relaxed,
                    memory_order_relaxed))
                continue;
            cur |= SHM_LOCK_WAITERS;
        }
        shm_futex_wait(lock, cur, timeout_ns - (now - start));
        /* MO: relaxed; the CAS that takes the lock acquires. */
        cur = atomic_load_explicit(lock, memory_order_relaxed);
    }
}

static inline void shm_collect_unlock(shm_seg *s) {
    _Atomic uint32_t *lock = &shm_hdr(s)->collect_lock;
    /* MO: release; pairs with the acquiring CASes in shm_collect_lock. */
    if (atomic_exchange_explicit(lock, 0, memory_order_release) &
        SHM_LOCK_WAITERS)
        shm_futex_wake(lock, 1);
}

/* The server holding the collect lock (index), or -1 when it is free. */
static inline int shm_collect_holder(shm_seg *s) {
    /* MO: relaxed; a hint for the liveness check that may follow. */
    uint32_t cur = atomic_load_explicit(&shm_hdr(s)->collect_lock,
                                        memory_order_relaxed) &
                   ~SHM_LOCK_WAITERS;
    return cur ? (int)cur - 1 : -1;
}

/* Server v takes the collect lock over from server `dead`, whose replica
 * was found dead, or from a holder id that names no server (>= servers:
 * the word was scribbled on): SHM_OK if the lock was still dead's (v holds
 * it now), SHM_E_STATE if it had moved on.  The CAS names the dead holder,
 * so two replicas that both find it dead cannot both take the lock over. */
static inline int shm_collect_steal(shm_seg *s, uint32_t v, uint32_t dead) {
    _Atomic uint32_t *lock = &shm_hdr(s)->collect_lock;
    /* MO: relaxed; the CAS below decides. */
    uint32_t cur = atomic_load_explicit(lock, memory_order_relaxed);
    while ((cur & ~SHM_LOCK_WAITERS) == dead + 1) {
        /* MO: acquire, as taking the lock. */
        if (atomic_compare_exchange_weak_explicit(
                lock, &cur, (v + 1) | (cur & SHM_LOCK_WAITERS),
                memory_order_acquire, memory_order_relaxed))
            return SHM_OK;
    }
    return SHM_E_STATE;
}

/* ------------------------------------------------------------------ */
/* Batch tables and put-backs                                         */
/* ------------------------------------------------------------------ */

/* Server v belongs to replica r (set up before it serves). */
static inline void shm_server_init(shm_seg *s, uint32_t v, uint32_t r) {
    shm_server_head *head = shm_server_at(s, v);
    head->replica = r;
    /* MO: relaxed; nothing is in the table yet. */
    atomic_store_explicit(&head->n, 0, memory_order_relaxed);
}

/* The size of server v's current batch (its table is cut to n entries
 * when rows are failed, or to 0 once the batch is finished).  MO: relaxed:
 * it only shrinks the part a recovery looks at, and a recovery skips the
 * slots no longer TAKEN anyway. */
static inline void shm_server_set_n(shm_seg *s, uint32_t v, uint32_t n) {
    atomic_store_explicit(&shm_server_at(s, v)->n, n, memory_order_relaxed);
}

/* Puts server v's batch back: every slot of its table still TAKEN with the
 * generation it was taken with returns to READY (its WAITER bit kept), for
 * another replica to take.  For a server whose replica died (or is failing
 * on its way out).  A scan may run meanwhile: it only takes READY slots,
 * and a slot put back is taken like any other.  Returns how many requests
 * went back; the caller rings the evaluator's doorbell
 * (shm_notify_evaluator) when there were any. */
static inline uint32_t shm_requeue(shm_seg *s, uint32_t v) {
    shm_server_head *head = shm_server_at(s, v);
    shm_taken *taken = shm_server_taken(s, v);
    /* MO: acquire; pairs with the release store in shm_scan. */
    uint32_t n = atomic_load_explicit(&head->n, memory_order_acquire);
    uint32_t back = 0;
    if (n > s->p.max_batch) n = s->p.max_batch; /* a scribbled table */
    for (uint32_t i = 0; i < n; i++) {
        if (taken[i].client >= s->p.max_clients ||
            taken[i].slot >= s->p.slots_per_client)
            continue;
        _Atomic uint32_t *w = shm_slot_word_at(s, taken[i].client,
                                               taken[i].slot);
        uint32_t want = shm_slot_word(SLOT_TAKEN, taken[i].gen);
        /* MO: relaxed; the CAS below decides (a bounded number of times:
         * only the client's WAITER bit can change a TAKEN word, and one
         * toggling it in a loop must not hold us here; its request then
         * stays in the batch table, for the next put-back). */
        uint32_t cur = atomic_load_explicit(w, memory_order_relaxed);
        for (uint32_t tries = 0;
             (cur & ~SLOT_WAITER) == want && tries < SHM_CAS_TRIES; tries++) {
            /* MO: relaxed.  The input stays published: every write of the
             * word since the client's release CAS of READY is a
             * read-modify-write (the take's CAS, the client's WAITER CAS,
             * this CAS), so they all belong to that CAS's release
             * sequence, and the next taker's acquire fence, which reads
             * this CAS's value, synchronises with the client. */
            if (atomic_compare_exchange_weak_explicit(
                    w, &cur,
                    shm_slot_word(SLOT_READY, taken[i].gen) |
                        (cur & SLOT_WAITER),
                    memory_order_relaxed, memory_order_relaxed)) {
                back++;
                break;
            }
        }
        /* A slot the dead server had completed: it may have died between
         * its completion, which clears the WAITER bit, and the ring of the
         * doorbell (shm_finish), and then nobody else would wake the
         * client before its tick.  A spare ring costs one look. */
        if (shm_state_is_final(shm_word_state(cur)) &&
            shm_word_gen(cur) == taken[i].gen)
            shm_ring_word(&shm_hdr(s)->done_seq[taken[i].client / 32u],
                          1u << (taken[i].client % 32u));
    }
    atomic_store_explicit(&head->n, 0, memory_order_relaxed);
    return back;
}

/* Server v, holding the collect lock, puts back the batches of replica r
 * (every server of r: shm_requeue), a replica that died or stopped and
 * whose process is gone, and rings the evaluator's doorbell for them.
 * Returns how many requests went back, or 0, doing nothing, when v does
 * not hold the collect lock.
 *
 * Why only under the lock: a slot that r listed and had not yet taken when
 * it died is READY, and once another replica takes it a put-back could not
 * tell that take from r's (both are TAKEN of one generation).  r lists
 * and takes under the collect lock, and un-lists what it failed to take,
 * so r's tables hold only its real takes whenever nobody scans, and a
 * put-back leaves its tables empty; a second one (of a caller that took
 * the lock over from a first one killed midway) finds READY what the
 * first put back and leaves it.  Whoever takes the lock over from a dead
 * holder puts that holder's replica back before its first scan. */
static inline uint32_t shm_requeue_replica(shm_seg *s, uint32_t v,
                                           uint32_t r) {
    /* MO: relaxed; only v itself can have made v the holder. */
    uint32_t cur = atomic_load_explicit(&shm_hdr(s)->collect_lock,
                                        memory_order_relaxed) &
                   ~SHM_LOCK_WAITERS;
    if (r >= s->p.replicas || cur != v + 1) return 0;
    /* A replica serving again (restarted) is never put back: its tables
     * are its new process's batches.  MO: relaxed; it stored SERVING
     * before it took the collect lock for its first scan, and our holding
     * the lock came after that scan's unlock (release) if its tables hold
     * anything, so then we read SERVING here. */
    if (atomic_load_explicit(&shm_replica_at(s, r)->state,
                             memory_order_relaxed) == REPLICA_SERVING)
        return 0;
    uint32_t per = s->p.servers / s->p.replicas, back = 0;
    for (uint32_t u = r * per; u < (r + 1) * per; u++)
        back += shm_requeue(s, u);
    if (back) shm_notify_evaluator(s, back);
    return back;
}

/* Whether replica r's batch tables in the segment are empty and the
 * collect lock names none of its servers: what a restarted replica waits
 * for, before it sets its servers up again (shm_server_init empties the
 * tables), while other replicas serve; their housekeeping puts its dead
 * process's batches back and takes the lock over from it.  MO: relaxed;
 * the put-backs are made under the collect lock, and a restarted replica
 * collects only under it too. */
static inline int shm_replica_settled(shm_seg *s, uint32_t r) {
    uint32_t per = s->p.servers / s->p.replicas;
    if (r >= s->p.replicas) return 0;
    for (uint32_t u = r * per; u < (r + 1) * per; u++)
        if (atomic_load_explicit(&shm_server_at(s, u)->n,
                                 memory_order_relaxed))
            return 0;
    /* MO: relaxed; as the table lengths above. */
    uint32_t cur = atomic_load_explicit(&shm_hdr(s)->collect_lock,
                                        memory_order_relaxed) &
                   ~SHM_LOCK_WAITERS;
    return !(cur > r * per && cur <= (r + 1) * per);
}

/* A restarted replica r puts back what its dead process left in its batch
 * tables, itself, when no other replica serves (one replica, or none other
 * with a live process: the caller checks, and the owner restarts one
 * replica at a time, so none starts meanwhile).  Safe without the collect
 * lock because nobody scans: the old process is gone (the owner restarts
 * only once it has exited), so each listed slot still TAKEN with its
 * generation is its take, and a slot it listed but had not taken is READY
 * and stays so.  Frees the collect lock if the old process died holding
 * it: it names a server of r, which no one would take over once r serves
 * again.  Call before r's servers are set up again (shm_server_init
 * empties the tables).  Returns how many requests went back. */
static inline uint32_t shm_requeue_restarted(shm_seg *s, uint32_t r) {
    if (r >= s->p.replicas) return 0;
    uint32_t per = s->p.servers / s->p.replicas, back = 0;
    for (uint32_t u = r * per; u < (r + 1) * per; u++)
        back += shm_requeue(s, u);
    _Atomic uint32_t *lock = &shm_hdr(s)->collect_lock;
    /* MO: relaxed; the CAS below decides. */
    uint32_t cur = atomic_load_explicit(lock, memory_order_relaxed);
    uint32_t id = cur & ~SHM_LOCK_WAITERS;
    /* MO: release, as an unlock (shm_collect_unlock); a sleeper on the
     * word is woken as there. */
    if (id > r * per && id <= (r + 1) * per &&
        atomic_compare_exchange_strong_explicit(lock, &cur, 0,
                                                memory_order_release,
                                                memory_order_relaxed) &&
        (cur & SHM_LOCK_WAITERS))
        shm_futex_wake(lock, 1);
    if (back) shm_notify_evaluator(s, back);
    return back;
}

/* ------------------------------------------------------------------ */
/* Weights versions                                                   */
/* ------------------------------------------------------------------ */

/* The replicas that may collect now: serving, with weights at least as
 * new as the floor (shm_version_ok).  A replica waiting for an update it
 * was sent takes no share of the work.  MO: relaxed; a count. */
static inline uint32_t shm_replicas_current(shm_seg *s) {
    uint64_t floor = atomic_load_explicit(&shm_hdr(s)->version_floor,
                                          memory_order_relaxed);
    uint32_t live = 0;
    for (uint32_t r = 0; r < s->p.replicas; r++) {
        shm_replica *rep = shm_replica_at(s, r);
        live += atomic_load_explicit(&rep->state, memory_order_relaxed) ==
                    REPLICA_SERVING &&
                atomic_load_explicit(&rep->version, memory_order_relaxed) >=
                    floor;
    }
    return live;
}

/* Raises the weights floor to at least `version` (a CAS loop, never
 * lowering it): collectors raise it as they collect, and the owner raises
 * it once an update it sent was applied, before set_weights returns, so
 * that a replica that refused the update serves no more answers of the
 * older weights from then on.  MO: relaxed; a replica's collect reads the
 * floor under the collect lock, and the owner's update is announced
 * through the control words. */
static inline void shm_raise_floor(shm_seg *s, uint64_t version) {
    shm_raise_word(&shm_hdr(s)->version_floor, version, memory_order_relaxed);
}

/* With several replicas, each collects only with weights at least as new
 * as the newest any replica has collected with (the floor): then a request
 * sent after another request's answer came back is computed by the same or
 * newer weights, whichever replica takes it.  Under the collect lock:
 * returns 1 (and raises the floor to `version`) when a replica serving
 * `version` may collect; 0 when it must first apply the newer weights it
 * was sent.
 *
 * The floor holds only while a replica serves it: when every replica with
 * weights at least the floor has stopped or died (an update that this one
 * refused, then the replicas that took it died), nobody could ever answer
 * again, so the floor comes down to this replica's version and it
 * collects (answers then go back to older weights; the alternative is a
 * hang).  So does a floor that any process scribbled on. */
static inline int shm_version_ok(shm_seg *s, uint64_t version) {
    _Atomic uint64_t *floor = &shm_hdr(s)->version_floor;
    /* MO: relaxed (all); the collect lock orders the collectors, and the
     * replicas' versions are read as hints: one that applies the floor's
     * weights meanwhile collects on its next turn. */
    uint64_t cur = atomic_load_explicit(floor, memory_order_relaxed);
    if (version >= cur) {
        shm_raise_floor(s, version);
        return 1;
    }
    /* Behind: wait while a serving replica has the floor's weights (this
     * one, below the floor, is not counted). */
    if (shm_replicas_current(s) > 0) return 0;
    /* Nobody serves the floor: bring it down to us (unless it moved). */
    return atomic_compare_exchange_strong_explicit(
        floor, &cur, version, memory_order_relaxed, memory_order_relaxed);
}

/* ------------------------------------------------------------------ */
/* The fair share                                                     */
/* ------------------------------------------------------------------ */

/* Several replicas: how many rows server v may take now, its share of the
 * work outstanding.  The work is the requests READY plus the rows the other
 * servers hold in their batches (n: what v took already in this collect),
 * split evenly among the replicas that may collect now (serving, with
 * weights at least the floor: shm_replicas_current); at least 1 and at most
 * max_batch.  Without the cap the replica whose batch just finished, being
 * the one free when its own clients resubmit, takes the first one or two of
 * them and starts a call, and the rest wait for the next replica to free up
 * and go to it as one large batch: the batches spread apart (1 row beside
 * 30) and, with a cost per call, fewer rows are answered per second than
 * with the even split.  The counts are relaxed loads, a snapshot that may
 * be off by the requests arriving meanwhile. */
static inline uint32_t shm_fair_share(shm_seg *s, uint32_t v, uint32_t n,
                                      uint32_t max_batch) {
    uint32_t live = shm_replicas_current(s);
    if (live < 1) live = 1;
    /* Counting stops where the share reaches max_batch anyway. */
    uint64_t enough = (uint64_t)live * max_batch;
    uint64_t work = n;
    for (uint32_t u = 0; u < s->p.servers; u++) {
        if (u == v) continue;
        /* MO: relaxed; a count, not a claim. */
        uint32_t held = atomic_load_explicit(&shm_server_at(s, u)->n,
                                             memory_order_relaxed);
        work += held < max_batch ? held : max_batch;
    }
    uint32_t hwm = shm_clients_hwm(s), K = s->p.slots_per_client;
    for (uint32_t c = 0; c < hwm && work < enough; c++)
        for (uint32_t k = 0; k < K; k++)
            /* MO: relaxed; the scan that takes the slot does the acquire. */
            work += shm_word_state(atomic_load_explicit(
                        shm_slot_word_at(s, c, k), memory_order_relaxed)) ==
                    SLOT_READY;
    uint64_t share = (work + live - 1) / live;
    if (share < 1) share = 1;
    return share < max_batch ? (uint32_t)share : max_batch;
}

#endif /* SHMEVAL_RING_REPLICAS_H */
