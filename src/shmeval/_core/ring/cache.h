/*
 * ring/cache.h -- the evaluation cache: a lock-free table of answers in the
 * segment, read by every client before it sends a request and written
 * after it gets an answer (the comment on shm_cache_entry says how).
 */
#ifndef SHMEVAL_RING_CACHE_H
#define SHMEVAL_RING_CACHE_H

#include "layout.h"

/* A table of answers in the segment that every client reads before it
 * sends a request and writes after it gets an answer: a state one process
 * had evaluated is answered in any other without a round trip.
 *
 * 2^cache_log2 entries in buckets of SHM_CACHE_WAYS; a state's bucket is
 * chosen by its 64-bit key (a hash of its bytes, or the caller's own key,
 * e.g. a Zobrist hash).  No locks: every word of an entry is a relaxed
 * 8-byte atomic, and `check` is a hash over the key, a second independent
 * key (key2: a second hash of the bytes; for a caller's key, the word of
 * its scheme, which each process names: 0 by default), the model version
 * and the data.  A reader copies the entry out and accepts it only
 * if the hash of what it copied equals the check it copied: an entry torn
 * by two writers, half written by a writer that was killed, of another
 * state with the same key, or scribbled on, fails the check (but with
 * probability 2^-64) and is a miss.  Writers never wait for each other: two
 * writing one entry at once leave a torn entry, which reads as a miss until
 * it is written again.  The order of a writer's stores does not matter to
 * a reader (the check decides); the key goes last all the same.
 *
 * Versions: an entry carries the model version of its answer, and a
 * reader refuses entries older than cache_version, which the owner raises
 * when new weights serve (shm_cache_set_version): no sweep of the table.
 *
 * Replacement, within a bucket: the entry of the same key, else an empty
 * one, else one of an older version than cache_version, else the smallest
 * `stamp`: entries never hit since they were stored before those that
 * were, and among each the least recently used.  (`stamp` is the time of
 * the last hit or store in units of 2^20 ns, written at most once per unit,
 * with SHM_CACHE_HIT_BIT once hit.  On the demo's positions keeping hit
 * entries holds most of what keeping the openings would, which plain LRU
 * and FIFO lose in small tables: bench/cache.py.) */
typedef struct {
    _Atomic uint64_t key;      /* 0: empty */
    _Atomic uint64_t version;  /* model version of the answer */
    _Atomic uint64_t stamp;    /* last use (replacement only; not checked) */
    _Atomic uint64_t check;    /* shm_cache_check over the rest */
    /* _Atomic uint64_t data[cache_words]: the output area's first
     * out_bytes, as a slot holds them */
} shm_cache_entry;

enum { SHM_CACHE_MISS = 0, SHM_CACHE_HIT = 1, SHM_CACHE_OLD = 2 };
#define SHM_CACHE_HIT_BIT (1ull << 63)

/* 64 x 64 -> 128-bit multiply, folded: the mixing step of the hashes. */
static inline uint64_t shm_mum(uint64_t a, uint64_t b) {
    __uint128_t r = (__uint128_t)a * b;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
}

static inline uint64_t shm_load64(const char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* Two independent 64-bit hashes of n bytes (two lanes that read the same
 * words with different constants and roles), for the cache's key and key2.
 * Neither is 0: 0 marks an empty entry (key) and a caller's key of the
 * default scheme (key2). */
static inline void shm_hash_state(const char *p, uint64_t n, uint64_t *k1,
                                  uint64_t *k2) {
    uint64_t a = 0x9E3779B97F4A7C15ull ^ n, b = 0xC2B2AE3D27D4EB4Full ^ (n << 1);
    uint64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        uint64_t w0 = shm_load64(p + i), w1 = shm_load64(p + i + 8);
        a = shm_mum(w0 ^ a ^ 0xA0761D6478BD642Full, w1 ^ 0xE7037ED1A0B428DBull);
        b = shm_mum(w1 ^ b ^ 0x8EBC6AF09C88C6E3ull, w0 ^ 0x589965CC75374CC3ull);
    }
    if (i < n) {
        char tail[16] = {0};
        memcpy(tail, p + i, n - i);
        uint64_t w0 = shm_load64(tail), w1 = shm_load64(tail + 8);
        a = shm_mum(w0 ^ a ^ 0xA0761D6478BD642Full, w1 ^ 0xE7037ED1A0B428DBull);
        b = shm_mum(w1 ^ b ^ 0x8EBC6AF09C88C6E3ull, w0 ^ 0x589965CC75374CC3ull);
    }
    a = shm_mum(a ^ 0x1D8E4E27C47D124Full, n ^ 0xD6E8FEB86659FD93ull);
    b = shm_mum(b ^ 0x94D049BB133111EBull, n ^ 0xBF58476D1CE4E5B9ull);
    *k1 = a ? a : 1;
    *k2 = b ? b : 1;
}

/* One step of the check word: h mixed with the words x and y.  h goes
 * into both factors and back into the result, so that no input word can
 * zero a factor by itself (a word equal to a constant of the step) and so
 * erase what came before: a factor is 0 only for x (or y) equal to a
 * function of everything hashed so far, and then the step keeps h. */
static inline uint64_t shm_check_step(uint64_t h, uint64_t x, uint64_t y) {
    return shm_mum(h ^ x ^ 0xA0761D6478BD642Full, h ^ y ^ 0xE7037ED1A0B428DBull) ^ h;
}

/* The check word of an entry holding `data` (nw words). */
static inline uint64_t shm_cache_check(uint64_t key, uint64_t key2,
                                       uint64_t version, const uint64_t *data,
                                       uint64_t nw) {
    uint64_t h = shm_check_step(0x2D358DCCAA6C78A5ull, key, key2);
    h = shm_check_step(h, version, nw);
    uint64_t i = 0;
    for (; i + 2 <= nw; i += 2) h = shm_check_step(h, data[i], data[i + 1]);
    if (i < nw) h = shm_check_step(h, data[i], 0x8EBC6AF09C88C6E3ull);
    return h;
}

static inline uint64_t shm_cache_entries(const shm_seg *s) {
    return s->p.cache_log2 ? 1ull << s->p.cache_log2 : 0;
}
static inline shm_cache_entry *shm_cache_entry_at(const shm_seg *s, uint64_t i) {
    return (shm_cache_entry *)(s->base + s->l.cache_off + i * s->l.cache_stride);
}
static inline _Atomic uint64_t *shm_cache_data(shm_cache_entry *e) {
    return (_Atomic uint64_t *)((char *)e + sizeof(shm_cache_entry));
}
/* The first entry of key's bucket (Fibonacci hashing: every key bit counts,
 * so weak low bits of a caller's key do not crowd buckets). */
static inline uint64_t shm_cache_bucket(const shm_seg *s, uint64_t key) {
    uint32_t bits = s->p.cache_log2 - 2; /* log2 of the bucket count */
    return bits ? (key * 0x9E3779B97F4A7C15ull) >> (64 - bits) : 0;
}
/* The current stamp (coarse CLOCK_MONOTONIC). */
static inline uint64_t shm_cache_now(void) { return shm_now_ns() >> 20; }

/* The oldest model version a lookup accepts now.  MO: acquire; pairs with
 * the release store in shm_cache_set_version, so a client that learns that
 * set_weights returned (through any synchronising channel) sees it. */
static inline uint64_t shm_cache_version(shm_seg *s) {
    return atomic_load_explicit(&shm_hdr(s)->cache_version,
                                memory_order_acquire);
}
/* Raises the oldest acceptable version (never lowers it); the owner calls
 * it once every replica serves `version`, before set_weights returns. */
static inline void shm_cache_set_version(shm_seg *s, uint64_t version) {
    /* MO: release CAS; pairs with the acquire load in shm_cache_version. */
    shm_raise_word(&shm_hdr(s)->cache_version, version, memory_order_release);
}

/* Looks up (key, key2) for client c: on a hit copies the entry's data
 * (cache_words words) to out, its version to *version and returns
 * SHM_CACHE_HIT; SHM_CACHE_OLD when the only match is older than
 * min_version (the caller passes the larger of shm_cache_version and the
 * newest version it has seen, so its versions never go backwards);
 * SHM_CACHE_MISS otherwise.  Counts the outcome in c's entry.  out is
 * scratch on a miss.  Reads only inside the table, whatever it holds. */
static inline int shm_cache_get(shm_seg *s, uint32_t c, uint64_t key,
                                uint64_t key2, uint64_t min_version,
                                uint64_t *out, uint64_t *version) {
    shm_client *ce = shm_client_at(s, c);
    uint64_t nw = s->l.cache_words, b = shm_cache_bucket(s, key) * SHM_CACHE_WAYS;
    int old = 0;
    for (uint32_t w = 0; w < SHM_CACHE_WAYS; w++) {
        shm_cache_entry *e = shm_cache_entry_at(s, b + w);
        /* MO (every load and store of the table): relaxed; the check word
         * decides what is accepted, not the order of the words. */
        if (atomic_load_explicit(&e->key, memory_order_relaxed) != key) continue;
        uint64_t v = atomic_load_explicit(&e->version, memory_order_relaxed);
        uint64_t chk = atomic_load_explicit(&e->check, memory_order_relaxed);
        _Atomic uint64_t *d = shm_cache_data(e);
        for (uint64_t i = 0; i < nw; i++)
            out[i] = atomic_load_explicit(&d[i], memory_order_relaxed);
        SHM_HOOK("cache_get_copied");
        if (atomic_load_explicit(&e->key, memory_order_relaxed) != key ||
            shm_cache_check(key, key2, v, out, nw) != chk)
            continue;
        if (v < min_version) {
            old = 1;
            continue;
        }
        uint64_t stamp = SHM_CACHE_HIT_BIT | shm_cache_now();
        if (atomic_load_explicit(&e->stamp, memory_order_relaxed) != stamp)
            atomic_store_explicit(&e->stamp, stamp, memory_order_relaxed);
        *version = v;
        atomic_fetch_add_explicit(&ce->cache_hits, 1, memory_order_relaxed);
        return SHM_CACHE_HIT;
    }
    atomic_fetch_add_explicit(&ce->cache_misses, 1, memory_order_relaxed);
    if (old) {
        atomic_fetch_add_explicit(&ce->cache_stale, 1, memory_order_relaxed);
        return SHM_CACHE_OLD;
    }
    return SHM_CACHE_MISS;
}

/* Stores client c's answer `data` (cache_words words) of model version
 * `version` for (key, key2).  Returns 1 if it replaced a live entry of
 * another state (counted in c's entry), else 0; stores nothing when
 * version is older than cache_version.  An answer may replace a newer one
 * of the same state (a request in flight across a weight update): a reader
 * that has seen the newer version refuses it (shm_cache_get's
 * min_version), and the next miss puts the newer one back.  (Trusting the
 * version word of an entry before checking it would let a scribbled entry
 * block its key for ever.) */
static inline int shm_cache_put(shm_seg *s, uint32_t c, uint64_t key,
                                uint64_t key2, uint64_t version,
                                const uint64_t *data) {
    uint64_t nw = s->l.cache_words, b = shm_cache_bucket(s, key) * SHM_CACHE_WAYS;
    uint64_t floor = shm_cache_version(s);
    if (version < floor) return 0; /* no reader would accept it */
    shm_cache_entry *victim = shm_cache_entry_at(s, b);
    int rank = 4; /* 0 same key, 1 empty, 2 old version, 3 smallest stamp */
    uint64_t oldest = UINT64_MAX;
    for (uint32_t w = 0; w < SHM_CACHE_WAYS && rank > 0; w++) {
        shm_cache_entry *e = shm_cache_entry_at(s, b + w);
        uint64_t k = atomic_load_explicit(&e->key, memory_order_relaxed);
        if (k == key) {
            victim = e, rank = 0;
        } else if (k == 0) {
            if (rank > 1) victim = e, rank = 1;
        } else if (atomic_load_explicit(&e->version, memory_order_relaxed) < floor) {
            if (rank > 2) victim = e, rank = 2;
        } else if (rank == 4 || rank == 3) {
            uint64_t st = atomic_load_explicit(&e->stamp, memory_order_relaxed);
            if (st < oldest) oldest = st, victim = e, rank = 3;
        }
    }
    _Atomic uint64_t *d = shm_cache_data(victim);
    atomic_store_explicit(&victim->version, version, memory_order_relaxed);
    for (uint64_t i = 0; i < nw; i++) {
        if (i == nw / 2) SHM_HOOK("cache_put_half");
        atomic_store_explicit(&d[i], data[i], memory_order_relaxed);
    }
    atomic_store_explicit(&victim->stamp, shm_cache_now(), memory_order_relaxed);
    atomic_store_explicit(&victim->check,
                          shm_cache_check(key, key2, version, data, nw),
                          memory_order_relaxed);
    atomic_store_explicit(&victim->key, key, memory_order_relaxed);
    if (rank == 3) {
        atomic_fetch_add_explicit(&shm_client_at(s, c)->cache_replaced, 1,
                                  memory_order_relaxed);
        return 1;
    }
    return 0;
}

/* Client c's cache counters: hits, misses, stale, replaced. */
static inline void shm_client_cache_stats(shm_seg *s, uint32_t c,
                                          uint64_t *out) {
    shm_client *e = shm_client_at(s, c);
    /* MO: relaxed; statistics. */
    out[0] = atomic_load_explicit(&e->cache_hits, memory_order_relaxed);
    out[1] = atomic_load_explicit(&e->cache_misses, memory_order_relaxed);
    out[2] = atomic_load_explicit(&e->cache_stale, memory_order_relaxed);
    out[3] = atomic_load_explicit(&e->cache_replaced, memory_order_relaxed);
}

/* Counts the table's entries that hold a key among `sample` entries spread
 * over the table (all of them when sample is 0 or at least the table's
 * size): *scanned, *held, and among those held the ones older than
 * cache_version, *old; for statistics (checks are not verified). */
static inline void shm_cache_census(shm_seg *s, uint64_t sample,
                                    uint64_t *scanned, uint64_t *held,
                                    uint64_t *old) {
    uint64_t n = shm_cache_entries(s), floor = shm_cache_version(s);
    uint64_t step = sample && sample < n ? n / sample : 1;
    *scanned = *held = *old = 0;
    for (uint64_t i = 0; i < n; i += step) {
        shm_cache_entry *e = shm_cache_entry_at(s, i);
        uint64_t k = atomic_load_explicit(&e->key, memory_order_relaxed);
        (*scanned)++;
        if (k == 0) continue;
        (*held)++; /* (key2 is unknown here: the check is not verified) */
        if (atomic_load_explicit(&e->version, memory_order_relaxed) < floor)
            (*old)++;
    }
}

#endif /* SHMEVAL_RING_CACHE_H */
