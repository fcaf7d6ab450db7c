/*
 * test_cache.c -- the evaluation cache (ring/cache.h).
 */
#include "harness.h"

#define CW 8 /* data words of the cache tests' entries (out_bytes 64) */

/* The answer the cache tests store for (key, version, tag): every word
 * says whose it is, so a torn copy is recognised. */
static void cache_answer(uint64_t *d, uint64_t key, uint64_t version,
                         uint64_t tag) {
    for (uint64_t i = 0; i < CW; i++)
        d[i] = mix64(key * 31 + version * 7 + tag * 131 + i);
}
static int is_answer(const uint64_t *d, uint64_t key, uint64_t version,
                     uint64_t tag) {
    uint64_t want[CW];
    cache_answer(want, key, version, tag);
    return memcmp(d, want, sizeof want) == 0;
}
static int t_get(shm_seg *s, uint64_t key, uint64_t key2, uint64_t *d,
                 uint64_t *v) {
    return shm_cache_get(s, 0, key, key2, shm_cache_version(s), d, v);
}
static int t_put(shm_seg *s, uint64_t key, uint64_t key2, uint64_t version,
                 uint64_t tag) {
    uint64_t d[CW];
    cache_answer(d, key, version, tag);
    return shm_cache_put(s, 0, key, key2, version, d);
}
static uint64_t client_cache(shm_seg *s, int which) {
    uint64_t x[4];
    shm_client_cache_stats(s, 0, x);
    return x[which];
}
/* What a lookup accepts: its own key pair's answer, of an acceptable
 * version; the counters; replacement within a bucket. */
static void test_cache(void) {
    start_test("cache", 60);
    shm_params P = with_cache(mkparams(64, 8 * CW, 2, 1, 8), 2); /* 1 bucket */
    test_seg t;
    seg_make(&t, &P);
    shm_seg *s = &t.s;
    CHECK_EQ(shm_client_register(s, 401, 1, 0), 0);
    uint64_t d[CW], v = 99;

    /* hashes: deterministic, both nonzero, and sensitive to every byte */
    char row[336];
    memset(row, 0, sizeof row);
    uint64_t a1, a2, b1, b2;
    shm_hash_state(row, sizeof row, &a1, &a2);
    shm_hash_state(row, sizeof row, &b1, &b2);
    CHECK(a1 == b1 && a2 == b2 && a1 && a2 && a1 != a2);
    for (size_t i = 0; i < sizeof row; i += 37) {
        row[i] ^= 1;
        shm_hash_state(row, sizeof row, &b1, &b2);
        CHECK_MSG(b1 != a1 && b2 != a2, "a flipped bit in byte %zu left a hash alone", i);
        row[i] ^= 1;
    }
    shm_hash_state(row, sizeof row - 1, &b1, &b2);
    CHECK(b1 != a1 && b2 != a2);

    CHECK_EQ(t_get(s, 5, 55, d, &v), SHM_CACHE_MISS);
    CHECK_EQ(t_put(s, 5, 55, 1, 0), 0);
    CHECK_EQ(t_get(s, 5, 55, d, &v), SHM_CACHE_HIT);
    CHECK(is_answer(d, 5, 1, 0) && v == 1);
    /* another state with the same key (the second hash differs), and the
     * caller's key space (key2 0): misses */
    CHECK_EQ(t_get(s, 5, 56, d, &v), SHM_CACHE_MISS);
    CHECK_EQ(t_get(s, 5, 0, d, &v), SHM_CACHE_MISS);
    CHECK_EQU(client_cache(s, 0), 1u);
    CHECK_EQU(client_cache(s, 1), 3u);

    /* versions: the newest version seen so far is the floor too */
    CHECK_EQ(shm_cache_get(s, 0, 5, 55, 2, d, &v), SHM_CACHE_OLD);
    CHECK_EQU(client_cache(s, 2), 1u);
    shm_cache_set_version(s, 2);
    CHECK_EQU(shm_cache_version(s), 2u);
    shm_cache_set_version(s, 1); /* never lowered */
    CHECK_EQU(shm_cache_version(s), 2u);
    CHECK_EQ(t_get(s, 5, 55, d, &v), SHM_CACHE_OLD);
    CHECK_EQ(t_put(s, 5, 55, 1, 0), 0); /* refused: no reader takes it */
    CHECK_EQ(t_get(s, 5, 55, d, &v), SHM_CACHE_OLD);
    CHECK_EQ(t_put(s, 5, 55, 2, 0), 0);
    CHECK_EQ(t_get(s, 5, 55, d, &v), SHM_CACHE_HIT);
    CHECK(is_answer(d, 5, 2, 0) && v == 2);
    /* an older answer than a client has seen is refused by that client */
    CHECK_EQ(t_put(s, 5, 55, 3, 0), 0);
    CHECK_EQ(t_put(s, 5, 55, 2, 0), 0); /* an answer in flight across an update */
    CHECK_EQ(shm_cache_get(s, 0, 5, 55, 3, d, &v), SHM_CACHE_OLD);
    CHECK_EQ(t_get(s, 5, 55, d, &v), SHM_CACHE_HIT);
    CHECK(is_answer(d, 5, 2, 0) && v == 2);

    /* replacement in the one bucket: empty ways first, then the least
     * recently used (stamps are about 1 ms apart, hence the sleeps) */
    for (uint64_t k = 6; k <= 8; k++) CHECK_EQ(t_put(s, k, k, 2, 0), 0);
    CHECK_EQU(client_cache(s, 3), 0u);
    sleep_ns(3 * MS);
    CHECK_EQ(t_get(s, 5, 55, d, &v), SHM_CACHE_HIT);
    CHECK_EQ(t_get(s, 6, 6, d, &v), SHM_CACHE_HIT);
    CHECK_EQ(t_get(s, 8, 8, d, &v), SHM_CACHE_HIT);
    sleep_ns(3 * MS);
    CHECK_EQ(t_put(s, 9, 9, 2, 0), 1); /* replaces 7, the least recent */
    CHECK_EQU(client_cache(s, 3), 1u);
    CHECK_EQ(t_get(s, 7, 7, d, &v), SHM_CACHE_MISS);
    for (uint64_t k = 5; k <= 9; k++)
        if (k != 7) CHECK_EQ(t_get(s, k, k == 5 ? 55 : k, d, &v), SHM_CACHE_HIT);
    /* an entry that has been hit outlives more recent ones that have not:
     * 9 and 6 are stored again (no hit since), 5 and 8 were hit before */
    sleep_ns(3 * MS);
    CHECK_EQ(t_put(s, 9, 9, 2, 0), 0);
    sleep_ns(3 * MS);
    CHECK_EQ(t_put(s, 6, 6, 2, 0), 0);
    sleep_ns(3 * MS);
    CHECK_EQ(t_put(s, 11, 11, 2, 0), 1); /* replaces 9: never hit, oldest */
    CHECK_EQ(t_get(s, 9, 9, d, &v), SHM_CACHE_MISS);
    CHECK_EQ(t_get(s, 5, 55, d, &v), SHM_CACHE_HIT);
    CHECK_EQ(t_get(s, 8, 8, d, &v), SHM_CACHE_HIT);
    sleep_ns(3 * MS);
    CHECK_EQ(t_put(s, 9, 9, 2, 0), 1);   /* replaces 6 (11 is more recent) */
    CHECK_EQ(t_get(s, 6, 6, d, &v), SHM_CACHE_MISS);
    CHECK_EQ(t_put(s, 6, 6, 2, 0), 1);   /* replaces 11, not the hit 5 or 8 */
    CHECK_EQ(t_get(s, 11, 11, d, &v), SHM_CACHE_MISS);
    CHECK_EQ(t_get(s, 6, 6, d, &v), SHM_CACHE_HIT);
    CHECK_EQ(t_get(s, 9, 9, d, &v), SHM_CACHE_HIT);
    /* an entry of an old version goes before any live one, however recent */
    CHECK_EQ(t_put(s, 6, 6, 3, 0), 0); /* same key: refreshed, not replaced */
    shm_cache_set_version(s, 3);        /* 5, 8, 9 are old now */
    CHECK_EQ(t_put(s, 10, 10, 3, 0), 0);
    CHECK_EQ(t_get(s, 6, 6, d, &v), SHM_CACHE_HIT);
    CHECK_EQ(t_get(s, 10, 10, d, &v), SHM_CACHE_HIT);

    /* a census: 4 entries held, 2 of them old */
    uint64_t sc, held, old;
    shm_cache_census(s, 0, &sc, &held, &old);
    CHECK_EQU(sc, 4u);
    CHECK_EQU(held, 4u);
    CHECK_EQU(old, 2u);

    /* a reclaimed client's counters go to the totals */
    uint64_t hits = client_cache(s, 0);
    shm_client_detach(s, 0);
    CHECK_EQ(shm_client_reclaim(s, 0), 0);
    CHECK_EQU(shm_stat_get(s, ST_CACHE_HITS), hits);
    CHECK_EQU(client_cache(s, 0), 0u);

    /* buckets: keys spread over all of a larger table's */
    seg_free(&t);
    P = with_cache(mkparams(64, 8 * CW, 1, 1, 8), 12);
    seg_make(&t, &P);
    s = &t.s;
    uint32_t seen[1024] = {0};
    for (uint64_t k = 1; k <= 1024 * 8; k++) seen[shm_cache_bucket(s, k)]++;
    for (uint32_t b = 0; b < 1024; b++)
        CHECK_MSG(seen[b] > 0, "no key of 1..8192 falls in bucket %u", b);
    seg_free(&t);
}

/* A writer stopped in the middle of an entry (killed, or just slow) leaves
 * nothing a reader accepts: neither the old answer under the new version,
 * nor half of each. */
typedef struct {
    shm_seg *s;
    hook_t hook;
    uint64_t key, key2, version, tag;
} put_arg;

static void *held_writer(void *arg) {
    put_arg *a = arg;
    hook_arm(&a->hook, "cache_put_half", 1);
    t_put(a->s, a->key, a->key2, a->version, a->tag);
    return NULL;
}

static void test_cache_torn(void) {
    start_test("cache_torn", 60);
    shm_params P = with_cache(mkparams(64, 8 * CW, 1, 1, 8), 2);
    test_seg t;
    seg_make(&t, &P);
    shm_seg *s = &t.s;
    CHECK_EQ(shm_client_register(s, 402, 1, 0), 0);
    uint64_t d[CW], v;
    struct {
        const char *what;
        uint64_t key, version, tag;
    } cases[] = {
        {"the same answer of the same version, rewritten", 21, 1, 0},
        {"another answer, same version", 21, 1, 1},
        {"a newer version's answer", 21, 2, 0},
    };
    CHECK_EQ(t_put(s, 21, 7, 1, 0), 0);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        put_arg a = {.s = s, .key = cases[i].key, .key2 = 7,
                     .version = cases[i].version, .tag = cases[i].tag};
        uint64_t before[CW], bv;
        CHECK_EQ(t_get(s, 21, 7, before, &bv), SHM_CACHE_HIT);
        pthread_t tw;
        CHECK_EQ(pthread_create(&tw, NULL, held_writer, &a), 0);
        hook_wait_parked(&a.hook); /* half the words written */
        int rc = t_get(s, 21, 7, d, &v);
        int torn = rc == SHM_CACHE_HIT && !is_answer(d, 21, v, 0) &&
                   !is_answer(d, 21, v, 1);
        CHECK_MSG(!torn, "%s: a reader accepted a half-written entry",
                  cases[i].what);
        /* a whole answer is fine only if it is exactly what was there */
        if (rc == SHM_CACHE_HIT)
            CHECK_MSG(v == bv && memcmp(d, before, sizeof d) == 0 &&
                          cases[i].tag == 0 && cases[i].version == bv,
                      "%s: a reader accepted version %" PRIu64
                      " with the data of another", cases[i].what, v);
        hook_release(&a.hook);
        CHECK_EQ(pthread_join(tw, NULL), 0);
        CHECK_EQ(t_get(s, 21, 7, d, &v), SHM_CACHE_HIT);
        CHECK(is_answer(d, 21, cases[i].version, cases[i].tag));
        CHECK_EQU(v, cases[i].version);
    }
    /* scribbled over: lookups of any key find nothing and read nothing
     * outside the table (ASan), and the table works again once written */
    uint64_t rng = g_seed ^ 0xCAC4E;
    for (uint64_t i = 0; i < 4 * s->l.cache_stride / 8; i++)
        ((uint64_t *)(t.mem + s->l.cache_off))[i] = rng_next(&rng);
    for (uint64_t k = 0; k < 1000; k++) {
        uint64_t key = rng_next(&rng) | 1;
        CHECK_EQ(t_get(s, key, rng_next(&rng), d, &v) == SHM_CACHE_HIT, 0);
    }
    for (uint64_t w = 0; w < 4; w++) { /* every way holding a scribbled key */
        uint64_t key = ((uint64_t *)(t.mem + s->l.cache_off))[w * s->l.cache_stride / 8];
        CHECK_EQ(t_get(s, key, 7, d, &v) == SHM_CACHE_HIT, 0);
    }
    CHECK(t_put(s, 33, 7, 1, 0) >= 0);
    CHECK_EQ(t_get(s, 33, 7, d, &v), SHM_CACHE_HIT);
    CHECK(is_answer(d, 33, 1, 0));
    seg_free(&t);
}

/* Many threads reading and writing a small table at once, versions going
 * up meanwhile: every hit is a whole answer for its key, of a version no
 * older than the floor when the lookup began.  Its point is the
 * ThreadSanitizer build: no data race in the table's words. */
typedef struct {
    shm_seg *s;
    uint32_t c;
    uint64_t seed, hits, puts;
    _Atomic int *stop;
} cache_thread_arg;

static void *cache_hammer(void *arg) {
    cache_thread_arg *a = arg;
    uint64_t rng = a->seed, d[CW], v;
    while (!atomic_load(a->stop)) {
        uint64_t key = 1 + rng_next(&rng) % 48;
        uint64_t floor = shm_cache_version(a->s);
        int rc = shm_cache_get(a->s, a->c, key, key, floor, d, &v);
        if (rc == SHM_CACHE_HIT) {
            CHECK_MSG(is_answer(d, key, v, 0), "a hit on key %" PRIu64
                      " returned another answer", key);
            CHECK_MSG(v >= floor, "version %" PRIu64 " under the floor %" PRIu64,
                      v, floor);
            a->hits++;
        } else {
            uint64_t version = shm_cache_version(a->s) + rng_next(&rng) % 2;
            cache_answer(d, key, version, 0);
            shm_cache_put(a->s, a->c, key, key, version, d);
            a->puts++;
        }
    }
    return NULL;
}

static void test_cache_threads(void) {
    start_test("cache_threads", 120);
    enum { T = 4 };
    shm_params P = with_cache(mkparams(64, 8 * CW, T, 1, 8), 4); /* 16 entries */
    test_seg t;
    seg_make(&t, &P);
    shm_seg *s = &t.s;
    _Atomic int stop = 0;
    cache_thread_arg a[T];
    pthread_t th[T];
    for (uint32_t i = 0; i < T; i++) {
        CHECK_EQ(shm_client_register(s, 500 + (int32_t)i, 1, 0), (int)i);
        a[i] = (cache_thread_arg){.s = s, .c = i, .seed = g_seed + i, .stop = &stop};
        CHECK_EQ(pthread_create(&th[i], NULL, cache_hammer, &a[i]), 0);
    }
    uint64_t ms = env_u64("SHM_TEST_CACHE_MS", g_slow ? 1500 : 500);
    for (uint64_t v = 1; v <= 10; v++) {
        sleep_ns(ms * MS / 10);
        shm_cache_set_version(s, v);
    }
    atomic_store(&stop, 1);
    uint64_t hits = 0, puts = 0;
    for (uint32_t i = 0; i < T; i++) {
        CHECK_EQ(pthread_join(th[i], NULL), 0);
        hits += a[i].hits;
        puts += a[i].puts;
    }
    CHECK_MSG(hits > 0 && puts > 0, "hits %" PRIu64 ", puts %" PRIu64, hits, puts);
    printf("  cache_threads: %" PRIu64 " hits, %" PRIu64 " puts by %d threads\n",
           hits, puts, T);
    seg_free(&t);
}

/* The check word depends on every word it covers whatever their values:
 * a word equal to a constant of the mixing step (say one that makes a
 * factor 0) must not erase the words before it, or two entries that
 * differ only there would both pass. */
static void test_cache_check(void) {
    start_test("cache_check", 60);
    static const uint64_t consts[] = {
        0, 0x2D358DCCAA6C78A5ull, 0xA0761D6478BD642Full, 0xE7037ED1A0B428DBull,
        0x8EBC6AF09C88C6E3ull, 0x4B33A62ED433D4A3ull, 0x589965CC75374CC3ull};
    const size_t nc = sizeof consts / sizeof consts[0];
    for (size_t i = 0; i < nc; i++)
        for (size_t j = 0; j < nc; j++) {
            uint64_t d[4] = {11, consts[i], consts[j], 13};
            uint64_t e[4] = {12, consts[i], consts[j], 13};
            uint64_t base = shm_cache_check(consts[i], consts[j], 1, d, 4);
            CHECK(base != shm_cache_check(consts[i], consts[j], 1, e, 4));
            CHECK(base != shm_cache_check(consts[i] + 1, consts[j], 1, d, 4));
            CHECK(base != shm_cache_check(consts[i], consts[j] + 1, 1, d, 4));
            CHECK(base != shm_cache_check(consts[i], consts[j], 2, d, 4));
            uint64_t f[2] = {consts[i], consts[j]};
            CHECK(shm_cache_check(1, 2, 1, f, 2) != shm_cache_check(3, 2, 1, f, 2));
            CHECK(shm_cache_check(1, 2, 1, f, 2) != shm_cache_check(1, 4, 1, f, 2));
        }
}

const test_case cache_tests[] = {
    {"cache", test_cache},
    {"cache_torn", test_cache_torn},
    {"cache_threads", test_cache_threads},
    {"cache_check", test_cache_check},
    {NULL, NULL},
};
