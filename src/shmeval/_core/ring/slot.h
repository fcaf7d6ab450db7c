/*
 * ring/slot.h -- the client side of a slot's state machine: FREE ->
 * WRITING (shm_slot_begin), the input copied in, WRITING -> READY
 * (shm_slot_publish) and the evaluator's doorbell rung; after the answer
 * (ring/wait.h), DONE/FAILED -> FREE (shm_slot_release).  Every step names
 * the generation the slot was begun with.  Also the copy of a row between a
 * slot and a batch.
 */
#ifndef SHMEVAL_RING_SLOT_H
#define SHMEVAL_RING_SLOT_H

#include "layout.h"

/* Copy of one state between a slot and a batch row (no overlap).
 *
 * A slot's input area starts on a cache line; a batch row starts wherever
 * n * in_bytes falls (a Go state, 24,548 bytes, is 4-byte aligned).  glibc's
 * memcpy aligns the stores, so when the two differ in their offset within a
 * line every load of the gather spans two lines.  Loading line by line and
 * storing unaligned instead was about a third faster for Go rows on the
 * development machine (bench/c/row_copy.c; docs/performance.md).  Small
 * copies, copies whose ends share their offset in the line, x86 CPUs
 * without AVX2 and every other architecture (AArch64: the line-load path
 * was measured on x86 only) use memcpy. */
#define SHM_COPY_MIN 2048u

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SHM_HAVE_LINE_COPY 1
__attribute__((target("avx2"))) static void
shm_copy_line_loads(char *dst, const char *src, size_t n) {
    size_t head = (SHM_LINE - ((uintptr_t)src & (SHM_LINE - 1))) & (SHM_LINE - 1);
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 2 * SHM_LINE; n -= 2 * SHM_LINE) {
        __m256i a = _mm256_load_si256((const __m256i *)src);
        __m256i b = _mm256_load_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_load_si256((const __m256i *)(src + 64));
        __m256i d = _mm256_load_si256((const __m256i *)(src + 96));
        _mm256_storeu_si256((__m256i *)dst, a);
        _mm256_storeu_si256((__m256i *)(dst + 32), b);
        _mm256_storeu_si256((__m256i *)(dst + 64), c);
        _mm256_storeu_si256((__m256i *)(dst + 96), d);
        src += 2 * SHM_LINE;
        dst += 2 * SHM_LINE;
    }
    memcpy(dst, src, n);
}
#endif

static inline void shm_copy(char *dst, const char *src, size_t n) {
#ifdef SHM_HAVE_LINE_COPY
    if (n >= SHM_COPY_MIN &&
        (((uintptr_t)dst ^ (uintptr_t)src) & (SHM_LINE - 1)) != 0 &&
        __builtin_cpu_supports("avx2")) {
        shm_copy_line_loads(dst, src, n);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* ------------------------------------------------------------------ */
/* Client side of a slot                                              */
/* ------------------------------------------------------------------ */

/* FREE -> WRITING for process pid, which must own entry c.  Stores the
 * slot's generation in *gen: every later client-side step on this request
 * (wait, release) names it, and refuses a slot whose generation moved on.
 * Returns SHM_OK; SHM_STALE when the entry is no longer pid's (it was
 * detached and reclaimed, perhaps claimed by another process); SHM_E_STATE
 * when the slot is not FREE.
 *
 * The process-local free list hands a slot to one thread at a time (rule 4
 * above); the CAS makes that hold across processes too: should two
 * processes ever act on one entry (a handle closed with requests still in
 * flight, its entry reclaimed and claimed again), only one of them begins
 * a given FREE slot, and the other gets an error instead of the first
 * one's answer. */
static inline int shm_slot_begin(shm_seg *s, uint32_t c, uint32_t k,
                                 int32_t pid, uint32_t *gen) {
    _Atomic uint32_t *w = shm_slot_word_at(s, c, k);
    /* MO: relaxed; a check that the entry is still ours, narrowing the
     * window that the CAS below closes. */
    if (atomic_load_explicit(&shm_client_at(s, c)->owner_pid,
                             memory_order_relaxed) != pid)
        return SHM_STALE;
    SHM_HOOK("begin_checked");
    /* MO: relaxed; the CAS below decides. */
    uint32_t old = atomic_load_explicit(w, memory_order_relaxed);
    SHM_HOOK("begin_loaded");
    if (shm_word_state(old) != SLOT_FREE) return SHM_E_STATE;
    /* MO: relaxed; nothing is published by WRITING (the reclaimer only
     * counts it, the evaluator ignores it); the input is published by the
     * release store of READY. */
    uint32_t writing = shm_slot_word(SLOT_WRITING, shm_word_gen(old));
    if (!atomic_compare_exchange_strong_explicit(
            w, &old, writing, memory_order_relaxed, memory_order_relaxed))
        return SHM_E_STATE;
    SHM_HOOK("begin_claimed");
    /* The entry may have been reclaimed, and claimed by another process,
     * between the owner check above and the CAS: the FREE word we moved
     * would then be the new owner's.  A Dekker pair with the reclaim, which
     * stores SHM_OWNER_RECLAIMING, then (seq_cst fence) moves every word of
     * the entry on: either this load sees that store (or a later owner) and
     * the word goes back exactly as it was, or the reclaim's CAS of the word
     * comes after ours and moves our WRITING on, so that our publish is
     * refused.  MO: seq_cst fence, relaxed load; pairs with the fence in
     * shm_client_reclaim. */
    shm_fence_seq_cst();
    if (atomic_load_explicit(&shm_client_at(s, c)->owner_pid,
                             memory_order_relaxed) != pid) {
        uint32_t cur = writing;
        /* MO: relaxed; we published nothing.  Fails, harmlessly, when the
         * reclaim moved the word on already. */
        atomic_compare_exchange_strong_explicit(
            w, &cur, old, memory_order_relaxed, memory_order_relaxed);
        return SHM_STALE;
    }
    *gen = shm_word_gen(old);
    return SHM_OK;
}

/* WRITING -> FREE (next generation) for a slot begun (generation gen) but
 * never published: a post of several slots whose later begin failed gives
 * back the slots it had begun this way, so that they can be begun again.
 * Returns SHM_OK, or SHM_STALE when the slot is no longer WRITING of gen
 * (it was reclaimed meanwhile, and is left alone). */
static inline int shm_slot_abort(shm_seg *s, uint32_t c, uint32_t k,
                                 uint32_t gen) {
    uint32_t cur = shm_slot_word(SLOT_WRITING, gen);
    /* MO: relaxed; nothing was published, nothing is read. */
    return atomic_compare_exchange_strong_explicit(
               shm_slot_word_at(s, c, k), &cur,
               shm_slot_word(SLOT_FREE, gen + 1), memory_order_relaxed,
               memory_order_relaxed)
               ? SHM_OK
               : SHM_STALE;
}

/* WRITING -> READY of generation gen, after the input has been copied in.
 * Returns SHM_OK, or SHM_STALE when the slot was reclaimed since its begin
 * (the word moved on): then nothing is published, and the slot, perhaps
 * another process's by now, is left alone. */
static inline int shm_slot_publish(shm_seg *s, uint32_t c, uint32_t k,
                                   uint32_t gen) {
    _Atomic uint32_t *w = shm_slot_word_at(s, c, k);
    shm_slot_meta_at(s, c, k)->publish_ns = shm_now_ns();
    uint32_t cur = shm_slot_word(SLOT_WRITING, gen);
    /* MO: release CAS; pairs with the acquire fence after the take in
     * shm_scan: the evaluator that takes READY sees the input bytes.  A
     * CAS, not a store, so that a slot reclaimed during the copy is not
     * published into its next owner's hands.  Nobody else moves a WRITING
     * word but the reclaim, so one try decides. */
    if (!atomic_compare_exchange_strong_explicit(
            w, &cur, shm_slot_word(SLOT_READY, gen), memory_order_release,
            memory_order_relaxed))
        return SHM_STALE;
    /* MO: relaxed; a statistic, on the client's own line (the threads of a
     * process share the entry, hence an atomic add). */
    atomic_fetch_add_explicit(&shm_client_at(s, c)->requests, 1,
                              memory_order_relaxed);
    return SHM_OK;
}

/* Rings the evaluator's doorbell after publishing `count` slots.
 *
 * Only the sleeper clears its flag (io_uring's IORING_SQ_NEED_WAKEUP
 * pattern): a client that sees ev_sleeping wakes the evaluator and leaves
 * the flag alone.  A client that cleared the flag itself could clear the
 * announcement of a later sleep than the one it saw (it read the flag
 * during one sleep, was preempted, and its clear and its wake landed
 * after the evaluator had announced the next sleep but before it was in
 * the kernel), and every client after it would then find the flag clear
 * while the evaluator slept to its timeout.  The price: clients that
 * publish while the flag is set each make a FUTEX_WAKE call, a few of
 * them at most in the microseconds between the first wake and the
 * evaluator's clearing of the flag.  Why no wake-up is lost: shm_collect. */
static inline void shm_notify_evaluator(shm_seg *s, uint32_t count) {
    shm_header *h = shm_hdr(s);
    /* MO: seq_cst; with the seq_cst load of ev_sleeping below, one half of
     * the Dekker pair with shm_collect's seq_cst store of ev_sleeping = 1
     * and re-read of submit_seq. */
    atomic_fetch_add_explicit(&h->submit_seq, count, memory_order_seq_cst);
    /* MO: seq_cst; see above. */
    uint32_t sleeping =
        atomic_load_explicit(&h->ev_sleeping, memory_order_seq_cst);
    SHM_HOOK("notify_loaded");
    if (sleeping) shm_futex_wake(&h->submit_seq, 1);
}

/* DONE/FAILED -> FREE with generation gen + 1, after the caller copied the
 * outputs (or the error text) out of a slot it began with generation gen.
 * Returns SHM_OK: the copy is the answer to the caller's request.
 * SHM_STALE: the slot was reclaimed (its generation moved on) at some point
 * before this call returned, perhaps during the copy: the copy must be
 * thrown away, and the slot, now someone else's, is left alone.
 * SHM_E_STATE: the slot is still in flight (a caller's error).
 *
 * Validation as in a seqlock: the acquire fence orders the copy's reads
 * before the CAS's read of the word, and the CAS succeeds only if the word
 * is still exactly the final state of generation gen, so no reclaim (which
 * moves the generation on before anyone can reuse the slot) happened
 * before or during the copy. */
static inline int shm_slot_release(shm_seg *s, uint32_t c, uint32_t k,
                                   uint32_t gen) {
    _Atomic uint32_t *w = shm_slot_word_at(s, c, k);
    SHM_HOOK("release_begin");
    /* MO: acquire fence; see above. */
    atomic_thread_fence(memory_order_acquire);
    /* MO: relaxed; the CAS below decides. */
    uint32_t cur = atomic_load_explicit(w, memory_order_relaxed);
    for (;;) {
        if (shm_word_gen(cur) != gen) return SHM_STALE;
        if (!shm_state_is_final(shm_word_state(cur))) return SHM_E_STATE;
        /* MO: release; our reads of the output area happen before the slot
         * can be reused (by us, or, after a reclaim, by another process). */
        if (atomic_compare_exchange_strong_explicit(
                w, &cur, shm_slot_word(SLOT_FREE, gen + 1),
                memory_order_release, memory_order_relaxed))
            return SHM_OK;
    }
}

/* Current state word, for tests and for abandoned-slot bookkeeping. */
static inline uint32_t shm_slot_peek(shm_seg *s, uint32_t c, uint32_t k) {
    /* MO: acquire; same pairing as shm_slot_wait. */
    return atomic_load_explicit(shm_slot_word_at(s, c, k),
                                memory_order_acquire);
}

#endif /* SHMEVAL_RING_SLOT_H */
