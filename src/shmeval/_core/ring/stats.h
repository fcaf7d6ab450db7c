/*
 * ring/stats.h -- the statistics in the segment: the counters (header.st[],
 * enum shm_stat), the latency and batch-size histograms and each replica's
 * own counts.  Written by the serving threads with relaxed atomic adds,
 * read by anyone; no data is published through them.
 */
#ifndef SHMEVAL_RING_STATS_H
#define SHMEVAL_RING_STATS_H

#include "layout.h"

static inline uint32_t shm_hist_bin(uint64_t ns) {
    if (ns < 4) return (uint32_t)ns;
    uint32_t msb = 63u - (uint32_t)__builtin_clzll(ns);
    uint32_t b = 4u * (msb - 1u) + (uint32_t)((ns >> (msb - 2u)) & 3u);
    return b < SHM_HIST_BINS ? b : SHM_HIST_BINS - 1;
}

/* Counter bump.  Several serving threads of one evaluator may record
 * batches at once (pipelined serving), so this is an atomic add; relaxed,
 * readers only want an eventually consistent figure, and on x86 it costs
 * one locked instruction on a line the evaluator already owns. */
static inline void shm_stat_add(_Atomic uint64_t *x, uint64_t v) {
    /* MO: relaxed; statistics only, no data is published through them. */
    atomic_fetch_add_explicit(x, v, memory_order_relaxed);
}

/* Per-batch statistics (evaluator only). */
static inline void shm_record_batch(shm_seg *s, uint32_t r, uint32_t n,
                                    uint32_t rows, uint64_t model_ns,
                                    int failed) {
    shm_header *h = shm_hdr(s);
    shm_replica *rep = shm_replica_at(s, r);
    shm_stat_add(&rep->requests, n);
    shm_stat_add(&rep->batches, 1);
    shm_stat_add(&rep->model_ns, model_ns);
    shm_stat_add(&h->st[ST_REQUESTS], n);
    shm_stat_add(&h->st[ST_BATCHES], 1);
    shm_stat_add(&h->st[ST_PADDED_ROWS], rows - n);
    shm_stat_add(&h->st[ST_MODEL_NS], model_ns);
    shm_stat_add(&h->hist_model[shm_hist_bin(model_ns)], 1);
    if (n <= s->p.max_batch) shm_stat_add(&shm_batch_hist_at(s)[n], 1);
    if (failed) {
        shm_stat_add(&h->st[ST_FAILED_REQUESTS], n);
        shm_stat_add(&h->st[ST_FAILED_BATCHES], 1);
    }
}

/* A model call of method m (an evaluator of several methods) served n
 * requests in model_ns.  Evaluator only, beside shm_record_batch. */
static inline void shm_record_method(shm_seg *s, uint32_t m, uint32_t n,
                                     uint64_t model_ns) {
    if (m >= SHM_MAX_METHODS) return;
    _Atomic uint64_t *st = shm_hdr(s)->method_st[m];
    shm_stat_add(&st[0], n);
    shm_stat_add(&st[1], 1);
    shm_stat_add(&st[2], model_ns);
}

/* Method m's statistics: requests, model calls, model ns (which < 3). */
static inline uint64_t shm_method_stat(shm_seg *s, uint32_t m, uint32_t which) {
    /* MO: relaxed; statistics are eventually consistent figures. */
    return m < SHM_MAX_METHODS && which < 3
               ? atomic_load_explicit(&shm_hdr(s)->method_st[m][which],
                                      memory_order_relaxed)
               : 0;
}

/* Statistics access by index (enum shm_stat). */
static inline uint64_t shm_stat_get(shm_seg *s, uint32_t i) {
    /* MO: relaxed; statistics are eventually consistent figures. */
    return i < SHM_N_STATS ? atomic_load_explicit(&shm_hdr(s)->st[i],
                                                  memory_order_relaxed)
                           : 0;
}
static inline void shm_stat_put(shm_seg *s, uint32_t i, uint64_t v) {
    /* MO: relaxed; puts come from the serving loop while no batch is in flight. */
    if (i < SHM_N_STATS)
        atomic_store_explicit(&shm_hdr(s)->st[i], v, memory_order_relaxed);
}
static inline void shm_stat_inc(shm_seg *s, uint32_t i, uint64_t v) {
    if (i < SHM_N_STATS) shm_stat_add(&shm_hdr(s)->st[i], v);
}
/* The histograms, one bin at a time (0 for a bin past the end).  MO:
 * relaxed loads; statistics, as above. */
/* Requests whose wait from publish to take fell in bin b (shm_hist_bin). */
static inline uint64_t shm_hist_wait(shm_seg *s, uint32_t b) {
    return b < SHM_HIST_BINS ? atomic_load_explicit(&shm_hdr(s)->hist_wait[b],
                                                    memory_order_relaxed)
                             : 0;
}
/* Batches whose model call took a time in bin b (shm_hist_bin). */
static inline uint64_t shm_hist_model(shm_seg *s, uint32_t b) {
    return b < SHM_HIST_BINS ? atomic_load_explicit(&shm_hdr(s)->hist_model[b],
                                                    memory_order_relaxed)
                             : 0;
}
/* Batches of n requests (n from 0 to max_batch). */
static inline uint64_t shm_hist_batch(shm_seg *s, uint32_t n) {
    return n <= s->p.max_batch ? atomic_load_explicit(&shm_batch_hist_at(s)[n],
                                                      memory_order_relaxed)
                               : 0;
}

#endif /* SHMEVAL_RING_STATS_H */
