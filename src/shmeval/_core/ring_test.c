/*
 * ring_test.c -- standalone C11 test of ring.h (the shared-memory protocol).
 *
 * The "segment" is a zero-filled heap buffer (aligned_alloc 4096); threads
 * share it exactly as processes share a mapping, and the futex words work the
 * same way within one process.  Built and run by tests/c/run_c_tests.sh in
 * three ways: plain (-O2 -Werror -DSHM_DEBUG), ThreadSanitizer, and
 * AddressSanitizer + UndefinedBehaviorSanitizer; and, on request, plain for
 * aarch64, run under QEMU's user-mode emulation (the arm64 build).
 *
 *   gcc -std=c11 -D_GNU_SOURCE -pthread -I src/shmeval/_core \
 *       src/shmeval/_core/ring_test.c -o ring_test
 *   ring_test            run every test
 *   ring_test NAME...    run only the named tests (layout attach state
 *                        reclaim concurrency close max_wait ... yield)
 *
 * ring.h is included as <ring.h> and found through -I, so the same test can
 * be built against another copy of the header (-I /tmp/broken).
 *
 * Environment knobs (all optional):
 *   SHM_TEST_CLIENTS=N        client threads in the concurrency test (8)
 *   SHM_TEST_REQUESTS=N       requests per client thread (50000, or
 *                             30000 in a slow run: see SHM_TEST_SLOW)
 *   SHM_TEST_SEED=N           base seed of the pseudo-random choices
 *                             (default: a new one every run, printed)
 *   SHM_TEST_RACE_TRIALS=N    trials of the random close/wait race probe
 *                             (300, or 100 in a slow run)
 *   SHM_TEST_STRICT_CLOSE_RACE=0  warn (instead of fail) when a waiter
 *                             sleeps through shm_close_and_wake
 *   SHM_TEST_SLOW=1           a slow run although the build has no
 *                             sanitizer (an emulated CPU: the arm64 build
 *                             under QEMU): the sanitizer builds' longer
 *                             watchdogs and wake-up deadlines and their
 *                             smaller default counts
 *   SHM_TEST_SLEEP_MS=N       the sleep timeout of the lost wake-up tests'
 *                             sleepers (lost_wakeup, reread, wait_any_reread;
 *                             10000): a lost wake-up costs a test this long.
 *                             Keep it above 2000 (the answer's deadline)
 *
 * Every failed check prints "FAIL [test] file:line: ..." and exits with 1; a
 * test that overruns its watchdog prints "TIMEOUT [test]" and exits with 2.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <stdatomic.h>

#if defined(__SANITIZE_THREAD__)
/*
 * ThreadSanitizer does not model atomic_thread_fence: ring.h's shm_scan pairs
 * a relaxed take (CAS) of the slot word plus an acquire fence with the
 * client's release CAS of READY, which is correct C11 but which TSan would
 * report as a race on the input bytes.  For the TSan build only, the acquire
 * fences in ring.h are replaced by the real fence plus an explicit TSan
 * acquire on the slot word `w` in scope -- the same happens-before edge the
 * fence provides.  If ring.h's publish stops being a release (or the fence
 * is removed), TSan still reports the race.  A fence of another order, or
 * one in a scope without a slot word `w`, makes this build fail loudly
 * (ring.h's seq_cst fences are shm_fence_seq_cst(), which this leaves
 * alone).
 */
#include <sanitizer/tsan_interface.h>
#include <stdio.h>
#include <stdlib.h>
/* GCC warns that TSan does not model the fence: that is the point here. */
#pragma GCC diagnostic ignored "-Wtsan"
static inline void shm_test_real_acquire_fence(void) {
    atomic_thread_fence(memory_order_acquire);
}
static inline void shm_test_tsan_fence(memory_order mo, const void *addr) {
    if (mo != memory_order_acquire) {
        fprintf(stderr, "ring_test: unexpected fence order %d in ring.h; "
                        "update the TSan fence shim\n", (int)mo);
        abort();
    }
    shm_test_real_acquire_fence();
    __tsan_acquire((void *)addr);
}
#undef atomic_thread_fence
#define atomic_thread_fence(mo) shm_test_tsan_fence((mo), (const void *)(w))
#endif

/*
 * Schedule control: every clock read inside ring.h (shm_now_ns) goes through
 * test_clock_gettime, which can park the calling thread at its N-th clock
 * read until the main thread lets it go.  Parking a thread anywhere is a
 * legal schedule, so a lost wake-up observed this way is a real one.  The
 * hook is off (one thread-local test) unless a test arms it.
 */
#include <time.h>
static _Thread_local int tl_park_at;    /* 0: off; else park at this call */
static _Thread_local int tl_clock_calls;
static _Atomic int g_park;               /* 0 idle, 1 parked, 2 released */
static int test_clock_gettime(clockid_t clk, struct timespec *ts) {
    if (tl_park_at && ++tl_clock_calls == tl_park_at) {
        struct timespec a, b;
        (clock_gettime)(CLOCK_MONOTONIC, &a);
        int idle = 0;
        /* park only if the main thread has not acted yet */
        if (!atomic_compare_exchange_strong(&g_park, &idle, 1))
            return (clock_gettime)(clk, ts);
        for (;;) { /* at most 5 s, whatever the main thread does */
            if (atomic_load(&g_park) == 2) break;
            (clock_gettime)(CLOCK_MONOTONIC, &b);
            if (b.tv_sec - a.tv_sec > 5) break;
            struct timespec d = {0, 50000};
            nanosleep(&d, NULL);
        }
    }
    return (clock_gettime)(clk, ts);
}
#define clock_gettime(clk, ts) test_clock_gettime((clk), (ts))

/* Every sched_yield() of ring.h's yielding spins, counted (test_yield). */
#include <sched.h>
static _Atomic unsigned long g_yields;
static int test_sched_yield(void) {
    atomic_fetch_add(&g_yields, 1);
    return sched_yield();
}
#define shm_sched_yield() test_sched_yield()

/*
 * Named schedule points: ring.h calls SHM_HOOK("name") at the points of its
 * protocol where an interleaving matters.  A test thread that armed a point
 * (hook_arm, for its own thread only, at the N-th time it passes there)
 * parks there until the main thread lets it go (hook_wait_parked, then
 * hook_release): a chosen interleaving, replayed every run.  Other threads,
 * and threads that armed nothing, pass straight through.
 */
#include <string.h>
typedef struct {
    const char *point;
    int left;          /* passes (by its thread) until it parks */
    _Atomic int state; /* 0 armed, 1 parked, 2 released, 3 resumed */
} hook_t;
static _Thread_local hook_t *tl_hook;
static void test_hook(const char *point) {
    hook_t *h = tl_hook;
    if (!h || strcmp(point, h->point) != 0 || --h->left > 0) return;
    tl_hook = NULL;
    atomic_store(&h->state, 1);
    struct timespec a, b, d = {0, 50000};
    (clock_gettime)(CLOCK_MONOTONIC, &a);
    for (;;) { /* at most 10 s, whatever the main thread does */
        if (atomic_load(&h->state) == 2) break;
        (clock_gettime)(CLOCK_MONOTONIC, &b);
        if (b.tv_sec - a.tv_sec > 10) break;
        nanosleep(&d, NULL);
    }
    atomic_store(&h->state, 3);
}
#define SHM_HOOK(point) test_hook(point)

/* Angle brackets on purpose: ring.h is found through -I (the build passes
 * -I src/shmeval/_core), so a build can point at another copy of the
 * header, e.g. a deliberately broken one: -I /tmp/broken. */
#include <ring.h>

#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#if defined(__SANITIZE_THREAD__)
#define BUILD_KIND "tsan"
#define BUILD_SLOW 1
#elif defined(__SANITIZE_ADDRESS__)
#define BUILD_KIND "asan+ubsan"
#define BUILD_SLOW 1
#else
#define BUILD_KIND "plain"
#define BUILD_SLOW 0
#endif

#if defined(__x86_64__)
#define BUILD_ARCH "x86_64"
#elif defined(__aarch64__)
#define BUILD_ARCH "aarch64"
#else
#define BUILD_ARCH "another architecture"
#endif

/* A slow run: a sanitizer build, or SHM_TEST_SLOW=1 (an emulated CPU,
 * tests/c/run_c_tests.sh's arm64 build under QEMU).  It gets longer
 * watchdogs and wake-up deadlines and fewer default trials and requests;
 * no check is dropped. */
static int g_slow = BUILD_SLOW;

#define MS 1000000ull
#define US 1000ull

/* ------------------------------------------------------------------ */
/* Failure reporting, watchdog                                         */
/* ------------------------------------------------------------------ */

static const char *volatile g_test = "startup";

static void fail_at(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4), noreturn));
static void fail_at(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    fflush(stdout);
    fprintf(stderr, "FAIL [%s] %s:%d: ", g_test, file, line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(stderr);
    _exit(1);
}

#define FAIL(...) fail_at(__FILE__, __LINE__, __VA_ARGS__)
#define CHECK(cond)                                                        \
    do {                                                                   \
        if (!(cond)) FAIL("CHECK(%s)", #cond);                             \
    } while (0)
#define CHECK_MSG(cond, ...)                                               \
    do {                                                                   \
        if (!(cond)) FAIL(__VA_ARGS__);                                    \
    } while (0)
#define CHECK_EQ(a, b)                                                     \
    do {                                                                   \
        long long a_ = (long long)(a), b_ = (long long)(b);                \
        if (a_ != b_) FAIL("%s == %s: %lld != %lld", #a, #b, a_, b_);      \
    } while (0)
#define CHECK_EQU(a, b)                                                    \
    do {                                                                   \
        unsigned long long a_ = (unsigned long long)(a),                   \
                           b_ = (unsigned long long)(b);                   \
        if (a_ != b_)                                                      \
            FAIL("%s == %s: %llu (0x%llx) != %llu (0x%llx)", #a, #b, a_,   \
                 a_, b_, b_);                                              \
    } while (0)

static void on_alarm(int sig) {
    (void)sig;
    static const char pre[] = "TIMEOUT [";
    static const char post[] = "]: watchdog expired (hang?)\n";
    const char *t = g_test;
    ssize_t r = write(2, pre, sizeof pre - 1);
    r = write(2, t, strlen(t));
    r = write(2, post, sizeof post - 1);
    (void)r;
    _exit(2);
}

static unsigned watchdog_scale(void) { return g_slow ? 3u : 1u; }

static void start_test(const char *name, unsigned watchdog_s) {
    g_test = name;
    alarm(watchdog_s * watchdog_scale());
}

/* ------------------------------------------------------------------ */
/* Small helpers                                                       */
/* ------------------------------------------------------------------ */

static uint64_t g_seed;
/* SHM_TEST_SLEEP_MS, in ns: see the top of the file. */
static uint64_t g_sleep_ns = 10000 * 1000000ull;

static uint64_t rng_next(uint64_t *s) { /* xorshift64* */
    uint64_t x = *s ? *s : 0x9E3779B97F4A7C15ull;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1Dull;
}
static uint64_t mix64(uint64_t x) { /* splitmix64 finaliser */
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static void sleep_ns(uint64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000ull),
                          (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Random tiny delays in random places. */
static void maybe_delay(uint64_t *rng) {
    uint64_t r = rng_next(rng);
    if ((r & 31) == 0)
        sched_yield();
    else if ((r & 511) == 1)
        sleep_ns((r >> 32) % (50 * US));
}

static double secs(uint64_t ns) { return (double)ns / 1e9; }

static uint64_t env_u64(const char *name, uint64_t dflt) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    unsigned long long x = strtoull(v, &end, 0);
    if (*end) {
        fprintf(stderr, "bad value for %s: %s\n", name, v);
        exit(2);
    }
    return x;
}

/* A zero-filled, 4096-aligned heap "segment". */
static char *seg_alloc(uint64_t size) {
    uint64_t sz = shm_round_up(size ? size : 1, 4096);
    char *p = aligned_alloc(4096, sz);
    CHECK_MSG(p != NULL, "aligned_alloc(%" PRIu64 ") failed", sz);
    memset(p, 0, sz);
    return p;
}

typedef struct {
    char *mem;
    uint64_t size;
    shm_seg s;
} test_seg;

static const char k_spec[] =
    "{\"model\":\"ring_test\",\"inputs\":[{\"name\":\"x\",\"dtype\":\"float32\","
    "\"shape\":[84]}],\"outputs\":[{\"name\":\"y\",\"dtype\":\"float32\","
    "\"shape\":[8]}]}";

static void seg_make(test_seg *t, const shm_params *p) {
    shm_layout l;
    CHECK_EQ(shm_layout_compute(p, &l), SHM_OK);
    t->size = l.total;
    t->mem = seg_alloc(l.total);
    CHECK_EQ(shm_init(&t->s, t->mem, t->size, p, k_spec,
                      (uint32_t)strlen(k_spec), (int32_t)getpid(), 0, 0, 0),
             SHM_OK);
}

/* Replica 0 serves (the one evaluator most tests have). */
static uint32_t t_set_serving(shm_seg *s, int32_t pid, uint64_t starttime) {
    return shm_set_serving(s, 0, pid, starttime, "test");
}

/* A fresh segment whose evaluator is serving (pid 1): where most tests
 * start. */
static shm_seg *serving_seg(test_seg *t, const shm_params *p) {
    seg_make(t, p);
    CHECK_EQ(t_set_serving(&t->s, 1, 1), EV_SERVING);
    return &t->s;
}

/* How soon a woken waiter must return: generous, far below its timeout. */
#define PROMPT_NS ((g_slow ? 2000u : 1000u) * MS)

static void seg_free(test_seg *t) {
    free(t->mem);
    t->mem = NULL;
}

static shm_params mkparams(uint64_t in, uint64_t out, uint32_t clients,
                           uint32_t k, uint32_t batch) {
    shm_params p;
    memset(&p, 0, sizeof p);
    p.in_bytes = in;
    p.out_bytes = out;
    p.max_clients = clients;
    p.slots_per_client = k;
    p.max_batch = batch;
    p.replicas = 1;
    p.servers = 1;
    return p;
}

static shm_params with_replicas(shm_params p, uint32_t replicas,
                                uint32_t servers) {
    p.replicas = replicas;
    p.servers = servers;
    return p;
}

static shm_params with_cache(shm_params p, uint32_t log2) {
    p.cache_log2 = log2;
    return p;
}

static uint32_t word_of(shm_seg *s, uint32_t c, uint32_t k) {
    return shm_slot_peek(s, c, k);
}
static void store_word(shm_seg *s, uint32_t c, uint32_t k, uint32_t v) {
    atomic_store_explicit(shm_slot_word_at(s, c, k), v, memory_order_release);
}

/* The slot state machine as most tests drive it: each client-side step
 * names the generation the slot has at that moment (the owner's pid, for
 * begin), so these tests exercise the transitions; the tests of stale
 * generations and owners (test_generations) call ring.h directly. */
static int t_begin(shm_seg *s, uint32_t c, uint32_t k) {
    uint32_t gen;
    return shm_slot_begin(
        s, c, k,
        atomic_load_explicit(&shm_client_at(s, c)->owner_pid,
                             memory_order_relaxed),
        &gen);
}
static uint32_t gen_now(shm_seg *s, uint32_t c, uint32_t k) {
    return shm_word_gen(shm_slot_peek(s, c, k));
}
/* WRITING -> READY of the generation the slot has now. */
static void t_publish(shm_seg *s, uint32_t c, uint32_t k) {
    CHECK_EQ(shm_slot_publish(s, c, k, gen_now(s, c, k)), SHM_OK);
}
static int t_wait(shm_seg *s, uint32_t c, uint32_t k, uint64_t spin_ns,
                  uint64_t timeout_ns) {
    return shm_slot_wait(s, c, k, gen_now(s, c, k), spin_ns, timeout_ns);
}
static int t_wait_ticked(shm_seg *s, uint32_t c, uint32_t k, uint64_t spin_ns,
                         uint64_t timeout_ns, shm_ticker *t) {
    return shm_slot_wait_ticked(s, c, k, gen_now(s, c, k), spin_ns,
                                timeout_ns, t);
}
static int t_release(shm_seg *s, uint32_t c, uint32_t k) {
    return shm_slot_release(s, c, k, gen_now(s, c, k));
}
/* Serving by server 0 of replica 0, the one evaluator most tests have:
 * its batch table is `taken` (shm_scan's `own`). */
static int t_collect(shm_seg *s, char *batch, shm_taken *taken,
                     uint32_t max_batch, uint32_t *cursor, uint64_t spin_ns,
                     uint64_t max_wait_ns, uint64_t timeout_ns) {
    return shm_collect(s, 0, taken, batch, max_batch, cursor, spin_ns,
                       max_wait_ns, timeout_ns);
}
static int t_register(shm_seg *s, int32_t pid, uint64_t starttime) {
    return shm_client_register(s, pid, starttime, 0);
}
static int32_t t_info(shm_seg *s, uint32_t c, uint64_t *starttime,
                      uint32_t *detached) {
    uint64_t pid_ns;
    return shm_client_info(s, c, starttime, &pid_ns, detached);
}

/* ------------------------------------------------------------------ */
/* a. layout                                                           */
/* ------------------------------------------------------------------ */

static void check_layout_numbers(const shm_params *p, const shm_layout *l) {
    uint64_t K = p->slots_per_client;
    CHECK(l->header_bytes >=
          sizeof(shm_header) + sizeof(uint64_t) * ((uint64_t)p->max_batch + 1));
    CHECK_EQU(l->header_bytes % SHM_LINE, 0);
    CHECK_EQU(l->replicas_off, l->header_bytes);
    CHECK(l->servers_off >= l->replicas_off + sizeof(shm_replica) * p->replicas);
    CHECK_EQU(l->servers_off % SHM_LINE, 0);
    CHECK(l->server_stride >=
          sizeof(shm_server_head) + sizeof(shm_taken) * p->max_batch);
    CHECK_EQU(l->server_stride % SHM_LINE, 0);
    CHECK_EQU(l->clients_off, l->servers_off + l->server_stride * p->servers);
    CHECK_EQU(l->client_stride % SHM_LINE, 0);
    CHECK(l->client_stride >= sizeof(shm_client) + 4 * K);
    CHECK_EQU(l->slots_off % 4096, 0);
    CHECK(l->slots_off >= l->clients_off + l->client_stride * p->max_clients);
    CHECK(l->in_off >= sizeof(shm_slot_meta));
    CHECK_EQU(l->in_off % SHM_LINE, 0);
    CHECK(l->out_off >= l->in_off + p->in_bytes);
    CHECK_EQU(l->out_off % SHM_LINE, 0);
    CHECK(l->out_area >= p->out_bytes);
    CHECK(l->out_area >= SHM_ERRMSG_MIN);
    CHECK_EQU(l->out_area % SHM_LINE, 0);
    CHECK(l->slot_stride >= l->out_off + l->out_area);
    CHECK_EQU(l->slot_stride % SHM_LINE, 0);
    uint64_t slots_end = l->slots_off + l->slot_stride * p->max_clients * K;
    CHECK_EQU(l->cache_words * 8, shm_round_up(p->out_bytes, 8));
    CHECK_EQU(l->cache_stride, sizeof(shm_cache_entry) + 8 * l->cache_words);
    if (p->cache_log2) {
        CHECK(l->cache_off >= slots_end);
        CHECK_EQU(l->cache_off % 4096, 0);
        CHECK_EQU(l->total, l->cache_off + (l->cache_stride << p->cache_log2));
    } else {
        CHECK_EQU(l->total, slots_end);
    }
}

/* Address-level facts on a formatted segment. */
static void check_layout_addresses(const shm_params *p) {
    test_seg t;
    seg_make(&t, p);
    shm_seg *s = &t.s;
    uintptr_t base = (uintptr_t)t.mem, end = base + t.size;
    uint32_t K = p->slots_per_client;
    CHECK((uintptr_t)(shm_batch_hist_at(s) + p->max_batch + 1) <=
          base + s->l.replicas_off);
    CHECK((uintptr_t)(shm_replica_at(s, p->replicas - 1) + 1) <=
          base + s->l.servers_off);
    CHECK((uintptr_t)(shm_server_taken(s, p->servers - 1) + p->max_batch) <=
          base + s->l.clients_off);
    CHECK_EQU((uintptr_t)shm_batch_hist_at(s) % 8, 0);
    for (uint32_t c = 0; c < p->max_clients; c++) {
        uintptr_t e = (uintptr_t)shm_client_at(s, c);
        uintptr_t w0 = (uintptr_t)shm_slot_word_at(s, c, 0);
        uintptr_t wend = (uintptr_t)(shm_slot_word_at(s, c, K - 1) + 1);
        uintptr_t next = c + 1 < p->max_clients
                             ? (uintptr_t)shm_client_at(s, c + 1)
                             : base + s->l.slots_off;
        CHECK_EQU(e % SHM_LINE, 0);
        /* the state words start on their own cache line (not the entry's)
         * and end before the next entry's line: no false sharing with the
         * entry fields or with another client's words */
        CHECK_EQU(w0 % SHM_LINE, 0);
        CHECK(w0 >= e + sizeof(shm_client));
        CHECK(wend <= next);
        CHECK_EQU(next % SHM_LINE, 0);
        for (uint32_t k = 0; k < K; k++) {
            CHECK_EQU((uintptr_t)shm_slot_word_at(s, c, k), w0 + 4ull * k);
            uintptr_t d = (uintptr_t)shm_slot_data(s, c, k);
            CHECK_EQU(d % SHM_LINE, 0);
            CHECK_EQU((uintptr_t)shm_slot_in(s, c, k) % SHM_LINE, 0);
            CHECK_EQU((uintptr_t)shm_slot_out(s, c, k) % SHM_LINE, 0);
            CHECK(d >= base + s->l.slots_off);
            CHECK(d + s->l.slot_stride <= end);
            CHECK_EQU((uintptr_t)shm_slot_meta_at(s, c, k), d);
            CHECK((uintptr_t)shm_slot_out(s, c, k) + s->l.out_area <=
                  d + s->l.slot_stride);
            /* slot data areas are consecutive and disjoint */
            if (k + 1 < K)
                CHECK_EQU((uintptr_t)shm_slot_data(s, c, k + 1),
                          d + s->l.slot_stride);
        }
        /* every state word is FREE, generation 0 after init */
        for (uint32_t k = 0; k < K; k++) CHECK_EQU(word_of(s, c, k), 0);
    }
    CHECK_EQU((uintptr_t)shm_slot_data(s, p->max_clients - 1, K - 1) +
                  s->l.slot_stride,
              p->cache_log2 ? base + s->l.slots_off + s->l.slot_stride *
                                  p->max_clients * K
                            : end);
    if (p->cache_log2) {
        uint64_t n = shm_cache_entries(s);
        CHECK((uintptr_t)shm_cache_entry_at(s, 0) >=
              (uintptr_t)shm_slot_data(s, p->max_clients - 1, K - 1) +
                  s->l.slot_stride);
        CHECK_EQU((uintptr_t)shm_cache_entry_at(s, n - 1) + s->l.cache_stride, end);
        CHECK_EQU((uintptr_t)shm_cache_entry_at(s, 0) % 8, 0);
        CHECK_EQU(s->l.cache_stride % 8, 0);
    }
    seg_free(&t);
}

static void test_layout(void) {
    start_test("layout", 60);
    shm_layout l;

    /* struct facts the layout relies on */
    CHECK_EQU(sizeof(shm_header) % SHM_LINE, 0);
    CHECK_EQU(offsetof(shm_header, ev_state) % SHM_LINE, 0);
    CHECK_EQU(offsetof(shm_header, submit_seq) % SHM_LINE, 0);
    CHECK_EQU(offsetof(shm_header, clients_hwm) % SHM_LINE, 0);
    CHECK_EQU(offsetof(shm_header, st) % SHM_LINE, 0);
    CHECK(offsetof(shm_header, submit_seq) / SHM_LINE !=
          offsetof(shm_header, ev_state) / SHM_LINE);
    CHECK(offsetof(shm_header, clients_hwm) / SHM_LINE !=
          offsetof(shm_header, submit_seq) / SHM_LINE);
    CHECK(offsetof(shm_header, st) / SHM_LINE !=
          offsetof(shm_header, submit_seq) / SHM_LINE);
    CHECK_EQU(offsetof(shm_header, magic), 0);
    CHECK_EQU(sizeof(shm_client), SHM_LINE);
    CHECK(sizeof(shm_slot_meta) <= SHM_LINE);
    CHECK_EQU(sizeof(shm_params), 40);
    CHECK(ST_CACHE_REPLACED < SHM_N_STATS);
    CHECK_EQU(offsetof(shm_header, cache_version) % SHM_LINE, 0);

    /* slot word encoding */
    CHECK_EQU(shm_word_state(shm_slot_word(SLOT_DONE, 77)), SLOT_DONE);
    CHECK_EQU(shm_word_gen(shm_slot_word(SLOT_DONE, 77)), 77);
    CHECK_EQU(shm_word_gen(shm_slot_word(SLOT_READY, SLOT_GEN_MASK)),
              SLOT_GEN_MASK);
    CHECK_EQU(shm_word_gen(shm_slot_word(SLOT_READY, SLOT_GEN_MASK + 1)), 0);
    CHECK_EQU(shm_word_state(shm_slot_word(SLOT_TAKEN, 5) | SLOT_WAITER),
              SLOT_TAKEN);
    CHECK_EQU(shm_word_gen(shm_slot_word(SLOT_TAKEN, 5) | SLOT_WAITER), 5);

    /* bad parameters */
    const uint64_t R = SHM_MAX_ROW_BYTES;
    struct {
        const char *what;
        shm_params p;
    } bad[] = {
        {"in_bytes=0", mkparams(0, 32, 16, 4, 16)},
        {"in_bytes>max", mkparams(R + 1, 32, 16, 4, 16)},
        {"in_bytes=UINT64_MAX", mkparams(UINT64_MAX, 32, 16, 4, 16)},
        {"out_bytes=0", mkparams(336, 0, 16, 4, 16)},
        {"out_bytes>max", mkparams(336, R + 1, 16, 4, 16)},
        {"out_bytes=UINT64_MAX", mkparams(336, UINT64_MAX, 16, 4, 16)},
        {"max_clients=0", mkparams(336, 32, 0, 4, 16)},
        {"max_clients>max", mkparams(336, 32, SHM_MAX_CLIENTS + 1, 4, 16)},
        {"max_clients=UINT32_MAX", mkparams(336, 32, UINT32_MAX, 4, 16)},
        {"slots=0", mkparams(336, 32, 16, 0, 16)},
        {"slots>max", mkparams(336, 32, 16, SHM_MAX_SLOTS_PER_CLIENT + 1, 16)},
        {"slots=UINT32_MAX", mkparams(336, 32, 16, UINT32_MAX, 16)},
        {"max_batch=0", mkparams(336, 32, 16, 4, 0)},
        {"max_batch>max", mkparams(336, 32, 16, 4, SHM_MAX_BATCH + 1)},
        {"max_batch=UINT32_MAX", mkparams(336, 32, 16, 4, UINT32_MAX)},
        {"all zero", mkparams(0, 0, 0, 0, 0)},
        {"replicas=0", with_replicas(mkparams(336, 32, 16, 4, 16), 0, 1)},
        {"replicas>max", with_replicas(mkparams(336, 32, 16, 4, 16),
                                       SHM_MAX_REPLICAS + 1, SHM_MAX_REPLICAS + 1)},
        {"servers<replicas", with_replicas(mkparams(336, 32, 16, 4, 16), 2, 1)},
        {"servers>max", with_replicas(mkparams(336, 32, 16, 4, 16), 1,
                                      SHM_MAX_SERVERS + 1)},
        {"cache_log2=1", with_cache(mkparams(336, 32, 16, 4, 16), 1)},
        {"cache_log2>max", with_cache(mkparams(336, 32, 16, 4, 16),
                                      SHM_CACHE_MAX_LOG2 + 1)},
        {"cache_log2=UINT32_MAX", with_cache(mkparams(336, 32, 16, 4, 16),
                                             UINT32_MAX)},
        {"cache bytes>max", with_cache(mkparams(336, R, 16, 4, 16), 20)},
    };
    const uint64_t scratch_n = 64 * 1024;
    char *scratch = seg_alloc(scratch_n);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = shm_layout_compute(&bad[i].p, &l);
        CHECK_MSG(rc == SHM_E_PARAMS, "layout(%s) returned %d, want %d",
                  bad[i].what, rc, SHM_E_PARAMS);
        /* shm_init refuses them too, before touching the buffer */
        shm_seg s;
        memset(scratch, 0xA5, scratch_n);
        rc = shm_init(&s, scratch, scratch_n, &bad[i].p, "", 0, 1, 0, 0, 0);
        CHECK_MSG(rc == SHM_E_PARAMS, "init(%s) returned %d", bad[i].what, rc);
        for (uint64_t j = 0; j < scratch_n; j++)
            CHECK_MSG((unsigned char)scratch[j] == 0xA5,
                      "init(%s) wrote the buffer", bad[i].what);
    }
    free(scratch);

    /* the limits themselves are accepted and the sizes do not overflow */
    shm_params mx = mkparams(R, R, SHM_MAX_CLIENTS, SHM_MAX_SLOTS_PER_CLIENT,
                             SHM_MAX_BATCH);
    CHECK_EQ(shm_layout_compute(&mx, &l), SHM_OK);
    check_layout_numbers(&mx, &l);
    CHECK(l.total / ((uint64_t)SHM_MAX_CLIENTS * SHM_MAX_SLOTS_PER_CLIENT) >=
          l.slot_stride);
    shm_params mn = mkparams(1, 1, 1, 1, 1);
    CHECK_EQ(shm_layout_compute(&mn, &l), SHM_OK);
    check_layout_numbers(&mn, &l);
    shm_params mc = with_cache(mkparams(8, 8, 1, 1, 1), SHM_CACHE_MAX_LOG2);
    CHECK_EQ(shm_layout_compute(&mc, &l), SHM_OK); /* 2^32 entries of 40 B */
    check_layout_numbers(&mc, &l);

    /* a matrix of shapes: numeric facts always, addresses when small */
    const uint64_t ins[] = {1, 63, 64, 65, 336, 4097};
    const uint64_t outs[] = {1, 32, 511, 512, 513, 5000};
    const uint32_t cls[] = {1, 3, 16};
    const uint32_t ks[] = {1, 3, 4, 16, 17, 64};
    const uint32_t bs[] = {1, 16, 1000};
    unsigned n_addr = 0, n_num = 0;
    for (size_t a = 0; a < sizeof ins / sizeof ins[0]; a++)
        for (size_t b = 0; b < sizeof outs / sizeof outs[0]; b++)
            for (size_t c = 0; c < sizeof cls / sizeof cls[0]; c++)
                for (size_t d = 0; d < sizeof ks / sizeof ks[0]; d++)
                    for (size_t e = 0; e < sizeof bs / sizeof bs[0]; e++) {
                        shm_params p =
                            mkparams(ins[a], outs[b], cls[c], ks[d], bs[e]);
                        /* a cache on a third of them, of 4 to 64 entries */
                        if ((a + 2 * b + c + d + e) % 3 == 1)
                            p.cache_log2 = 2 + (uint32_t)((a + b + d) % 5);
                        CHECK_EQ(shm_layout_compute(&p, &l), SHM_OK);
                        check_layout_numbers(&p, &l);
                        n_num++;
                        /* a subset with real addresses (kept cheap) */
                        if (l.total <= (2u << 20) && (a + b + c + d + e) % 3 == 0) {
                            check_layout_addresses(&p);
                            n_addr++;
                        }
                    }

    /* latency histogram bins: in range and monotone */
    uint32_t prev = 0;
    for (uint64_t ns = 0; ns < 64; ns++) {
        uint32_t b = shm_hist_bin(ns);
        CHECK(b < SHM_HIST_BINS && b >= prev);
        prev = b;
    }
    for (int sh = 6; sh < 64; sh++)
        for (uint64_t q = 0; q < 8; q++) {
            uint64_t ns = (1ull << sh) + q * ((1ull << sh) / 8);
            uint32_t b = shm_hist_bin(ns);
            CHECK(b < SHM_HIST_BINS && b >= prev);
            prev = b;
        }
    CHECK(shm_hist_bin(UINT64_MAX) < SHM_HIST_BINS);

    printf("  layout: %zu bad parameter sets refused, %u shapes checked "
           "(%u at address level)\n",
           sizeof bad / sizeof bad[0], n_num, n_addr);
}

/* ------------------------------------------------------------------ */
/* b. attach validation                                                */
/* ------------------------------------------------------------------ */

/* Attaches to a private exact-size copy of `img` (first min(size, img_size)
 * bytes; the rest zero), so that ASan catches any read past `size`. */
static int attach_copy(const char *img, uint64_t img_size, uint64_t size,
                       shm_seg *out) {
    void *buf = NULL;
    CHECK_EQ(posix_memalign(&buf, 4096, size ? size : 1), 0);
    uint64_t n = size < img_size ? size : img_size;
    memcpy(buf, img, n);
    if (size > n) memset((char *)buf + n, 0, size - n);
    shm_seg s;
    memset(&s, 0, sizeof s);
    int rc = shm_attach(&s, (char *)buf, size);
    if (rc == SHM_OK) {
        /* what it accepted must be self-consistent and in bounds */
        shm_layout l;
        CHECK_EQ(shm_layout_compute(&s.p, &l), SHM_OK);
        CHECK(memcmp(&l, &s.l, sizeof l) == 0);
        CHECK(s.l.total <= size);
        CHECK(s.base == (char *)buf);
        if (out) *out = s;
    }
    free(buf);
    return rc;
}

/* The documented decision order of shm_attach, written independently. */
static int attach_oracle(const char *img, uint64_t img_size, uint64_t size) {
    if (size < sizeof(shm_header)) return SHM_E_TOO_SMALL;
    shm_header h;
    memset(&h, 0, sizeof h);
    memcpy(&h, img, img_size < sizeof h ? img_size : sizeof h);
    if (h.magic != SHM_MAGIC) return SHM_E_MAGIC;
    if (h.layout_version != SHM_LAYOUT_VERSION) return SHM_E_VERSION;
    shm_layout l;
    if (shm_layout_compute(&h.params, &l) != SHM_OK) return SHM_E_PARAMS;
    if (h.total_bytes != l.total) return SHM_E_PARAMS;
    if (size < l.total) return SHM_E_TOO_SMALL;
    if (h.spec_len > SHM_SPEC_MAX) return SHM_E_SPEC;
    if (shm_fnv1a(h.spec, h.spec_len) != h.spec_hash) return SHM_E_SPEC;
    return SHM_OK;
}

static int is_status(int rc) { return rc <= SHM_OK && rc >= SHM_E_STATE; }

static void test_attach(void) {
    start_test("attach", 120);
    const shm_params P = mkparams(336, 32, 16, 4, 16);
    test_seg t;
    seg_make(&t, &P);
    const uint64_t T = t.size;
    char *img = malloc(T);
    CHECK(img != NULL);
    shm_seg s;
    int rc;

    /* shm_init's own refusals */
    {
        shm_seg s2;
        char *b2 = seg_alloc(T);
        CHECK_EQ(shm_init(&s2, b2, T - 1, &P, k_spec, 10, 1, 0, 0, 0), SHM_E_TOO_SMALL);
        CHECK_EQ(shm_init(&s2, b2, 0, &P, k_spec, 10, 1, 0, 0, 0), SHM_E_TOO_SMALL);
        char *big = malloc(SHM_SPEC_MAX + 1);
        CHECK(big != NULL);
        memset(big, 'x', SHM_SPEC_MAX + 1);
        CHECK_EQ(shm_init(&s2, b2, T, &P, big, SHM_SPEC_MAX + 1, 1, 0, 0, 0), SHM_E_SPEC);
        /* exactly SHM_SPEC_MAX bytes of spec is fine, and attaches */
        CHECK_EQ(shm_init(&s2, b2, T, &P, big, SHM_SPEC_MAX, 1, 0, 0, 0), SHM_OK);
        CHECK_EQ(attach_copy(b2, T, T, NULL), SHM_OK);
        uint32_t len = 0;
        const char *sp = shm_spec(&s2, &len);
        CHECK_EQ(len, SHM_SPEC_MAX);
        CHECK(memcmp(sp, big, SHM_SPEC_MAX) == 0);
        free(big);
        free(b2);
    }

    /* the good case, and what it reports */
    memcpy(img, t.mem, T);
    memset(&s, 0, sizeof s);
    CHECK_EQ(attach_copy(img, T, T, &s), SHM_OK);
    CHECK(memcmp(&s.p, &P, sizeof P) == 0);
    CHECK(memcmp(&s.l, &t.s.l, sizeof s.l) == 0);
    CHECK_EQ(attach_copy(img, T, T + 4096, NULL), SHM_OK); /* bigger map */
    {
        shm_seg s3;
        CHECK_EQ(shm_attach(&s3, t.mem, T), SHM_OK);
        uint32_t len = 0;
        const char *sp = shm_spec(&s3, &len);
        CHECK_EQ(len, strlen(k_spec));
        CHECK(memcmp(sp, k_spec, len) == 0);
        CHECK_EQ(shm_owner_pid(&s3), getpid());
        CHECK_EQ(shm_ev_state(&s3), EV_STARTING);
    }

    /* sizes */
    struct {
        const char *what;
        uint64_t size;
    } sizes[] = {
        {"size 0", 0},
        {"size 1", 1},
        {"size header-1", sizeof(shm_header) - 1},
        {"size header", sizeof(shm_header)},
        {"size slots_off", t.s.l.slots_off},
        {"size total-1 (truncated)", T - 1},
        {"size total-slot (truncated)", T - t.s.l.slot_stride},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        rc = attach_copy(img, T, sizes[i].size, NULL);
        CHECK_MSG(rc == SHM_E_TOO_SMALL, "%s: attach returned %d, want %d",
                  sizes[i].what, rc, SHM_E_TOO_SMALL);
    }

    /* targeted corruptions of a copy */
#define CORRUPT(what, want, stmt)                                           \
    do {                                                                    \
        memcpy(img, t.mem, T);                                              \
        shm_header *h = (shm_header *)img;                                  \
        (void)h;                                                            \
        stmt;                                                               \
        rc = attach_copy(img, T, T, NULL);                                  \
        CHECK_MSG(rc == (want), "%s: attach returned %d, want %d (%s)",     \
                  what, rc, (int)(want), #want);                            \
        CHECK_EQ(attach_oracle(img, T, T), (want));                         \
    } while (0)

    CORRUPT("magic byte flipped", SHM_E_MAGIC, img[0] ^= 0x01);
    CORRUPT("magic zero (never formatted)", SHM_E_MAGIC, h->magic = 0);
    CORRUPT("magic byte-swapped", SHM_E_MAGIC,
            h->magic = __builtin_bswap64(SHM_MAGIC));
    CORRUPT("version 0", SHM_E_VERSION, h->layout_version = 0);
    CORRUPT("version 2", SHM_E_VERSION,
            h->layout_version = SHM_LAYOUT_VERSION + 1);
    CORRUPT("version ~0", SHM_E_VERSION, h->layout_version = UINT32_MAX);
    CORRUPT("max_clients 16->8", SHM_E_PARAMS, h->params.max_clients = 8);
    CORRUPT("max_clients 16->17", SHM_E_PARAMS, h->params.max_clients = 17);
    CORRUPT("slots 4->5", SHM_E_PARAMS, h->params.slots_per_client = 5);
    CORRUPT("out_bytes 32->1100", SHM_E_PARAMS, h->params.out_bytes = 1100);
    CORRUPT("replicas 1->2", SHM_E_PARAMS, h->params.replicas = 2);
    CORRUPT("replicas 0", SHM_E_PARAMS, h->params.replicas = 0);
    CORRUPT("servers 1->3", SHM_E_PARAMS, h->params.servers = 3);
    CORRUPT("in_bytes 336->400", SHM_E_PARAMS, h->params.in_bytes = 400);
    CORRUPT("max_batch 0", SHM_E_PARAMS, h->params.max_batch = 0);
    CORRUPT("in_bytes 0", SHM_E_PARAMS, h->params.in_bytes = 0);
    CORRUPT("max_clients 100000", SHM_E_PARAMS,
            h->params.max_clients = 100000);
    CORRUPT("in_bytes 2^40", SHM_E_PARAMS, h->params.in_bytes = 1ull << 40);
    CORRUPT("total_bytes+1", SHM_E_PARAMS, h->total_bytes += 1);
    CORRUPT("total_bytes 0", SHM_E_PARAMS, h->total_bytes = 0);
    CORRUPT("total_bytes ~0", SHM_E_PARAMS, h->total_bytes = UINT64_MAX);
    /* a self-consistent header that claims more than is mapped */
    CORRUPT("consistent params, bigger than the mapping", SHM_E_TOO_SMALL, {
        h->params.max_clients = 32;
        shm_layout l2;
        CHECK_EQ(shm_layout_compute(&h->params, &l2), SHM_OK);
        h->total_bytes = l2.total;
    });
    CORRUPT("spec byte flipped", SHM_E_SPEC, h->spec[3] ^= 0x20);
    CORRUPT("spec byte past spec_len set", SHM_OK,
            h->spec[h->spec_len + 1] = 'z'); /* not covered: fine */
    CORRUPT("spec_len+1", SHM_E_SPEC, h->spec_len += 1);
    CORRUPT("spec_len-1", SHM_E_SPEC, h->spec_len -= 1);
    CORRUPT("spec_len 0", SHM_E_SPEC, h->spec_len = 0);
    CORRUPT("spec_len SPEC_MAX+1", SHM_E_SPEC, h->spec_len = SHM_SPEC_MAX + 1);
    CORRUPT("spec_len ~0", SHM_E_SPEC, h->spec_len = UINT32_MAX);
    CORRUPT("spec_hash flipped", SHM_E_SPEC, h->spec_hash ^= 1);
    CORRUPT("order: bad version wins over bad params", SHM_E_VERSION, {
        h->layout_version = SHM_LAYOUT_VERSION + 1;
        h->params.max_batch = 0;
    });
    CORRUPT("order: bad params win over bad spec", SHM_E_PARAMS, {
        h->params.max_batch = 0;
        h->spec_hash ^= 1;
    });
#undef CORRUPT
    /* wrong magic in a header-sized buffer: the magic check, not size */
    memcpy(img, t.mem, T);
    ((shm_header *)img)->magic = 1;
    CHECK_EQ(attach_copy(img, T, sizeof(shm_header), NULL), SHM_E_MAGIC);

    /* A parameter change that keeps total_bytes is NOT detected (no checksum
     * over the identity block); document what attach says. */
    memcpy(img, t.mem, T);
    ((shm_header *)img)->params.in_bytes = 330; /* same 64-byte rounding */
    int same_total_in = attach_copy(img, T, T, NULL);
    memcpy(img, t.mem, T);
    ((shm_header *)img)->params.max_batch = 17; /* header rounds to 4096 */
    int same_total_batch = attach_copy(img, T, T, NULL);
    if (same_total_in == SHM_OK || same_total_batch == SHM_OK)
        printf("  note: attach does not notice params changed without "
               "changing the total (in_bytes 336->330: %s, max_batch "
               "16->17: %s)\n",
               same_total_in == SHM_OK ? "accepted" : "refused",
               same_total_batch == SHM_OK ? "accepted" : "refused");

    /* ---- random trials: never crash, never read out of bounds, always a
     * status code (checked against the oracle) ---- */
    uint64_t rng = g_seed ^ 0xA77AC4ull;
    const unsigned trials = g_slow ? 1500 : 4000;
    const uint64_t MAXBUF = 2 * T + 2 * sizeof(shm_header) + 8192;
    char *fz = malloc(MAXBUF);
    CHECK(fz != NULL);
    unsigned n_ok = 0, hist[16] = {0};

    for (unsigned i = 0; i < trials; i++) {
        /* R1: all garbage, random size (mostly around the header size) */
        uint64_t r0 = rng_next(&rng);
        uint64_t size = (r0 & 15) == 0 ? (r0 >> 8) % (2 * T + 1)
                                        : (r0 >> 8) % (2 * sizeof(shm_header) + 1);
        for (uint64_t j = 0; j < size; j += 8) {
            uint64_t r = rng_next(&rng);
            memcpy(fz + j, &r, size - j < 8 ? size - j : 8);
        }
        rc = attach_copy(fz, size, size, NULL);
        CHECK(is_status(rc) && rc != SHM_OK);
        CHECK_EQ(rc, attach_oracle(fz, size, size));
        hist[-rc]++;
    }
    for (unsigned i = 0; i < trials; i++) {
        /* R2: garbage with the right magic (and sometimes version) */
        uint64_t size = sizeof(shm_header) + rng_next(&rng) % (2 * T);
        for (uint64_t j = 0; j < sizeof(shm_header); j += 8) {
            uint64_t r = rng_next(&rng);
            memcpy(fz + j, &r, sizeof(shm_header) - j < 8 ? sizeof(shm_header) - j : 8);
        }
        memset(fz + sizeof(shm_header), 0, size - sizeof(shm_header));
        shm_header *h = (shm_header *)fz;
        h->magic = SHM_MAGIC;
        if (i & 1) h->layout_version = SHM_LAYOUT_VERSION;
        rc = attach_copy(fz, size, size, NULL);
        CHECK(is_status(rc));
        CHECK_EQ(rc, attach_oracle(fz, size, size));
        if (rc == SHM_OK) n_ok++;
        hist[-rc]++;
    }
    for (unsigned i = 0; i < 2 * trials; i++) {
        /* R3: magic + version right, parameters drawn from interesting
         * values, total_bytes often consistent, spec often valid, size
         * around the claimed total */
        static const uint64_t rows[] = {0, 1, 64, 336, 4096, SHM_MAX_ROW_BYTES,
                                        SHM_MAX_ROW_BYTES + 1, UINT64_MAX};
        static const uint32_t counts[] = {0, 1, 2, 7, 16, 64, 65, 4096, 4097,
                                          65536, 65537, UINT32_MAX};
        shm_header hh;
        memset(&hh, 0, sizeof hh);
        for (size_t j = 0; j < sizeof hh; j += 8) {
            uint64_t r = rng_next(&rng);
            memcpy((char *)&hh + j, &r, sizeof hh - j < 8 ? sizeof hh - j : 8);
        }
        hh.magic = SHM_MAGIC;
        hh.layout_version = SHM_LAYOUT_VERSION;
        uint64_t r = rng_next(&rng);
        hh.params.in_bytes = (r & 1) ? rows[(r >> 1) % 8] : 1 + (r >> 8) % 3000;
        r = rng_next(&rng);
        hh.params.out_bytes = (r & 1) ? rows[(r >> 1) % 8] : 1 + (r >> 8) % 3000;
        r = rng_next(&rng);
        hh.params.max_clients = (r & 1) ? counts[(r >> 1) % 12] : 1 + (r >> 8) % 20;
        r = rng_next(&rng);
        hh.params.slots_per_client =
            (r & 1) ? counts[(r >> 1) % 12] : 1 + (r >> 8) % 8;
        r = rng_next(&rng);
        hh.params.max_batch = (r & 1) ? counts[(r >> 1) % 12] : 1 + (r >> 8) % 300;
        shm_layout l;
        int lrc = shm_layout_compute(&hh.params, &l);
        r = rng_next(&rng);
        if (lrc == SHM_OK && (r & 3) != 0) hh.total_bytes = l.total;
        r = rng_next(&rng);
        switch (r % 6) {
        case 0: hh.spec_len = 0; break;
        case 1: hh.spec_len = (uint32_t)((r >> 8) % 100); break;
        case 2: hh.spec_len = SHM_SPEC_MAX; break;
        case 3: hh.spec_len = SHM_SPEC_MAX + 1; break;
        case 4: hh.spec_len = (uint32_t)(r >> 32); break;
        default: hh.spec_len = (uint32_t)((r >> 8) % SHM_SPEC_MAX); break;
        }
        r = rng_next(&rng);
        if ((r & 3) != 0 && hh.spec_len <= SHM_SPEC_MAX)
            hh.spec_hash = shm_fnv1a(hh.spec, hh.spec_len);
        uint64_t size;
        r = rng_next(&rng);
        uint64_t claim = hh.total_bytes;
        if (claim > MAXBUF - 4096 || claim < sizeof(shm_header))
            size = sizeof(shm_header) + (r >> 8) % (64 * 1024);
        else
            switch (r % 4) {
            case 0: size = claim; break;
            case 1: size = claim - 1; break;
            case 2: size = claim + (r >> 8) % 4096; break;
            default: size = sizeof(shm_header) + (r >> 8) % (claim - sizeof(shm_header) + 1); break;
            }
        if (r % 97 == 0) size = (r >> 20) % sizeof(shm_header); /* tiny */
        memset(fz, 0, size < sizeof hh ? sizeof hh : size);
        memcpy(fz, &hh, sizeof hh);
        rc = attach_copy(fz, size, size, NULL);
        CHECK(is_status(rc));
        CHECK_EQ(rc, attach_oracle(fz, size, size));
        if (rc == SHM_OK) n_ok++;
        hist[-rc]++;
    }
    for (unsigned i = 0; i < trials; i++) {
        /* R4: a valid segment with a few random bytes of the header (and
         * sometimes of the batch histogram / client table) overwritten */
        memcpy(fz, t.mem, T);
        uint64_t r = rng_next(&rng);
        unsigned nflip = 1 + (unsigned)(r % 4);
        for (unsigned j = 0; j < nflip; j++) {
            uint64_t q = rng_next(&rng);
            uint64_t lim = (q & 1) ? sizeof(shm_header) : 256;
            fz[(q >> 8) % lim] = (char)(q >> 56);
        }
        uint64_t size = (r >> 8) % 4 == 0 ? T - 1 - (r >> 16) % T : T;
        rc = attach_copy(fz, T, size, NULL);
        CHECK(is_status(rc));
        CHECK_EQ(rc, attach_oracle(fz, T, size));
        if (rc == SHM_OK) n_ok++;
        hist[-rc]++;
    }
    free(fz);
    free(img);
    seg_free(&t);
    printf("  attach: %u random trials: ok=%u too_small=%u magic=%u "
           "version=%u params=%u spec=%u\n",
           5 * trials, hist[0], hist[1], hist[2], hist[3], hist[4], hist[5]);
    (void)n_ok;
}

/* ------------------------------------------------------------------ */
/* c. single-thread state machine                                      */
/* ------------------------------------------------------------------ */

static void fill_row(char *dst, uint64_t bytes, uint64_t tag) {
    for (uint64_t i = 0; i < bytes; i++)
        dst[i] = (char)(mix64(tag * 1000003u + i) & 0xFF);
}

static void test_state(void) {
    start_test("state", 60);
    const shm_params P = mkparams(336, 32, 4, 4, 8);
    test_seg t;
    seg_make(&t, &P);
    shm_seg *s = &t.s;
    shm_header *h = shm_hdr(s);
    const uint64_t IN = P.in_bytes, OUT = P.out_bytes;
    char in[8][336], res[8][32], batch[8 * 336];
    shm_taken taken[8];
    uint32_t cursor = 0;
    int n;

    /* before serving: collect with nothing to do reports CLOSED */
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 1 * MS),
             SHM_CLOSED);
    CHECK_EQ(t_set_serving(s, 4242, 99), EV_SERVING);
    uint64_t st99 = 0, version;
    uint32_t rstate;
    CHECK_EQ(shm_replica_info(s, 0, &st99, &rstate, &version), 4242);
    CHECK_EQU(st99, 99);
    CHECK_EQ(rstate, REPLICA_SERVING);
    CHECK_EQ(strcmp(shm_replica_device(s, 0), "test"), 0);
    CHECK(shm_heartbeat(s) != 0);
    CHECK(shm_stat_get(s, ST_SERVE_START_NS) != 0);

    int c = t_register(s, 5001, 77);
    CHECK_EQ(c, 0);
    CHECK_EQ(shm_n_attached(s), 1);
    CHECK_EQ(shm_clients_hwm(s), 1);
    {
        uint64_t stt;
        uint32_t det;
        CHECK_EQ(t_info(s, 0, &stt, &det), 5001);
        CHECK_EQU(stt, 77);
        CHECK_EQ(det, 0);
    }

    /* empty collect times out with 0 after about its timeout */
    uint64_t t0 = shm_now_ns();
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 20 * MS), 0);
    CHECK(shm_now_ns() - t0 >= 20 * MS);
    t0 = shm_now_ns();
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 200 * US, 0, 5 * MS), 0);
    CHECK(shm_now_ns() - t0 >= 5 * MS);

    /* FREE -> WRITING -> READY -> TAKEN -> DONE -> FREE(gen+1) */
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_FREE, 0));
    CHECK_EQ(t_release(s, 0, 0), SHM_E_STATE); /* FREE is not final */
    CHECK_EQ(t_begin(s, 0, 0), SHM_OK);
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_WRITING, 0));
    CHECK_EQ(t_begin(s, 0, 0), SHM_E_STATE);
    CHECK_EQ(t_release(s, 0, 0), SHM_E_STATE);
    fill_row(in[0], IN, 1);
    memcpy(shm_slot_in(s, 0, 0), in[0], IN);
    uint64_t before_pub = shm_now_ns();
    t_publish(s, 0, 0);
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_READY, 0));
    CHECK(shm_meta(s, 0, 0)->publish_ns >= before_pub);
    CHECK_EQ(t_begin(s, 0, 0), SHM_E_STATE);
    CHECK_EQ(t_release(s, 0, 0), SHM_E_STATE);
    uint32_t seq0 = atomic_load(&h->submit_seq);
    shm_notify_evaluator(s, 1);
    CHECK_EQU(atomic_load(&h->submit_seq), seq0 + 1);

    n = t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS);
    CHECK_EQ(n, 1);
    CHECK_EQ(taken[0].client, 0);
    CHECK_EQ(taken[0].slot, 0);
    CHECK_EQ(taken[0].gen, 0);
    CHECK(memcmp(batch, in[0], IN) == 0);
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_TAKEN, 0));
    CHECK_EQ(t_begin(s, 0, 0), SHM_E_STATE);
    CHECK_EQ(t_release(s, 0, 0), SHM_E_STATE);
    {
        /* the publish -> taken histogram counted it */
        uint64_t tot = 0;
        for (uint32_t b = 0; b < SHM_HIST_BINS; b++) tot += shm_hist_wait(s, b);
        CHECK_EQU(tot, 1);
    }

    /* a wait that times out leaves WAITER set; TAKEN keeps it */
    t0 = shm_now_ns();
    CHECK_EQ(t_wait(s, 0, 0, 0, 5 * MS), SHM_TIMEOUT);
    CHECK(shm_now_ns() - t0 >= 5 * MS);
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_TAKEN, 0) | SLOT_WAITER);
    t0 = shm_now_ns();
    CHECK_EQ(t_wait(s, 0, 0, 1 * MS, 3 * MS), SHM_TIMEOUT); /* spin */
    CHECK(shm_now_ns() - t0 >= 3 * MS);

    fill_row(res[0], OUT, 101);
    CHECK_EQU(shm_complete(s, taken, 1, res[0], 7), 1);
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_DONE, 0)); /* WAITER gone */
    CHECK_EQ(t_wait(s, 0, 0, 0, 5 * MS), SLOT_DONE);
    CHECK_EQ(t_wait(s, 0, 0, 1 * MS, 5 * MS), SLOT_DONE);
    CHECK(memcmp(shm_slot_out(s, 0, 0), res[0], OUT) == 0);
    CHECK_EQU(shm_meta(s, 0, 0)->model_version, 7);
    CHECK_EQ(shm_meta(s, 0, 0)->err_len, 0);
    CHECK_EQ(t_begin(s, 0, 0), SHM_E_STATE); /* DONE is not FREE */
    CHECK_EQ(t_release(s, 0, 0), SHM_OK);
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_FREE, 1));
    CHECK_EQ(t_release(s, 0, 0), SHM_E_STATE);

    /* several slots in one batch, rows in the order of `taken` */
    for (uint32_t k = 0; k < 4; k++) {
        CHECK_EQ(t_begin(s, 0, k), SHM_OK);
        fill_row(in[k], IN, 10 + k);
        memcpy(shm_slot_in(s, 0, k), in[k], IN);
    }
    /* publish out of order */
    t_publish(s, 0, 2);
    t_publish(s, 0, 0);
    t_publish(s, 0, 3);
    t_publish(s, 0, 1);
    shm_notify_evaluator(s, 4);
    n = t_collect(s, batch, taken, 3, &cursor, 0, 0, 10 * MS); /* max 3 */
    CHECK_EQ(n, 3);
    int n2 = t_collect(s, batch + 3 * IN, taken + 3, 8, &cursor, 0, 0,
                         10 * MS);
    CHECK_EQ(n2, 1);
    n = 4;
    uint32_t seen = 0;
    for (int i = 0; i < n; i++) {
        uint32_t k = taken[i].slot;
        CHECK(k < 4 && !(seen & (1u << k)));
        seen |= 1u << k;
        CHECK_EQ(taken[i].client, 0);
        CHECK_EQ(taken[i].gen, k == 0 ? 1 : 0);
        CHECK(memcmp(batch + (uint64_t)i * IN, in[k], IN) == 0);
        fill_row(res[i], OUT, 200 + k);
    }
    CHECK_EQU(shm_complete(s, taken, (uint32_t)n, (const char *)res, 8), 4);
    for (int i = 0; i < n; i++) {
        uint32_t k = taken[i].slot;
        CHECK_EQ(t_wait(s, 0, k, 0, 5 * MS), SLOT_DONE);
        CHECK(memcmp(shm_slot_out(s, 0, k), res[i], OUT) == 0);
        CHECK_EQ(t_release(s, 0, k), SHM_OK);
        CHECK_EQU(word_of(s, 0, k), shm_slot_word(SLOT_FREE, k == 0 ? 2 : 1));
    }

    /* failure path: FAILED with the message in the output area */
    const char *msg = "ValueError: model exploded (batch of 1)";
    CHECK_EQ(t_begin(s, 0, 1), SHM_OK);
    memcpy(shm_slot_in(s, 0, 1), in[1], IN);
    t_publish(s, 0, 1);
    shm_notify_evaluator(s, 1);
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS), 1);
    CHECK_EQU(shm_fail(s, taken, 1, msg, (uint32_t)strlen(msg)), 1);
    CHECK_EQU(word_of(s, 0, 1), shm_slot_word(SLOT_FAILED, 1));
    CHECK_EQ(t_wait(s, 0, 1, 0, 5 * MS), SLOT_FAILED);
    CHECK_EQ(shm_meta(s, 0, 1)->err_len, strlen(msg));
    CHECK(memcmp(shm_slot_out(s, 0, 1), msg, strlen(msg)) == 0);
    CHECK_EQ(t_begin(s, 0, 1), SHM_E_STATE);
    CHECK_EQ(t_release(s, 0, 1), SHM_OK);
    CHECK_EQU(word_of(s, 0, 1), shm_slot_word(SLOT_FREE, 2));

    /* an error text longer than the output area is cut to the area */
    {
        char longmsg[3000];
        for (size_t i = 0; i < sizeof longmsg; i++) longmsg[i] = (char)('a' + i % 26);
        CHECK_EQ(t_begin(s, 0, 1), SHM_OK);
        t_publish(s, 0, 1);
        CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS), 1);
        CHECK_EQU(shm_fail(s, taken, 1, longmsg, sizeof longmsg), 1);
        CHECK_EQ(t_wait(s, 0, 1, 0, 5 * MS), SLOT_FAILED);
        CHECK_EQU(shm_meta(s, 0, 1)->err_len, s->l.out_area);
        CHECK(memcmp(shm_slot_out(s, 0, 1), longmsg, s->l.out_area) == 0);
        /* DONE after a FAILED: err_len is reset */
        CHECK_EQ(t_release(s, 0, 1), SHM_OK);
        CHECK_EQ(t_begin(s, 0, 1), SHM_OK);
        t_publish(s, 0, 1);
        CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS), 1);
        CHECK_EQU(shm_complete(s, taken, 1, res[0], 9), 1);
        CHECK_EQ(t_wait(s, 0, 1, 0, 5 * MS), SLOT_DONE);
        CHECK_EQ(shm_meta(s, 0, 1)->err_len, 0);
        CHECK_EQ(t_release(s, 0, 1), SHM_OK);
    }

    /* generation check in shm_finish: the word changed between collect
     * and complete -> not completed, counted as stale */
    uint64_t stale0 = shm_stat_get(s, ST_STALE_COMPLETIONS);
    CHECK_EQ(stale0, 0);
    uint32_t g = shm_word_gen(word_of(s, 0, 2));
    CHECK_EQ(t_begin(s, 0, 2), SHM_OK);
    memcpy(shm_slot_in(s, 0, 2), in[2], IN);
    t_publish(s, 0, 2);
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS), 1);
    CHECK_EQ(taken[0].gen, g);
    /* (1) reclaimed behind the batch's back: FREE, generation + 1 */
    char sentinel[32];
    memset(sentinel, 0x5A, sizeof sentinel);
    memcpy(shm_slot_out(s, 0, 2), sentinel, OUT);
    store_word(s, 0, 2, shm_slot_word(SLOT_FREE, g + 1));
    CHECK_EQU(shm_complete(s, taken, 1, res[0], 10), 0);
    CHECK_EQU(word_of(s, 0, 2), shm_slot_word(SLOT_FREE, g + 1));
    CHECK_EQU(shm_stat_get(s, ST_STALE_COMPLETIONS), 1);
    int wrote_stale = memcmp(shm_slot_out(s, 0, 2), sentinel, OUT) != 0;
    /* (2) reused and re-taken: TAKEN again but with generation + 1 */
    store_word(s, 0, 2, shm_slot_word(SLOT_TAKEN, g + 1));
    CHECK_EQU(shm_fail(s, taken, 1, "x", 1), 0);
    CHECK_EQU(word_of(s, 0, 2), shm_slot_word(SLOT_TAKEN, g + 1));
    CHECK_EQU(shm_stat_get(s, ST_STALE_COMPLETIONS), 2);
    /* (3) same generation, another state (e.g. already completed) */
    store_word(s, 0, 2, shm_slot_word(SLOT_DONE, g));
    CHECK_EQU(shm_complete(s, taken, 1, res[0], 11), 0);
    CHECK_EQU(shm_stat_get(s, ST_STALE_COMPLETIONS), 3);
    /* (4) only WAITER differs: that is not stale, it completes */
    store_word(s, 0, 2, shm_slot_word(SLOT_TAKEN, g) | SLOT_WAITER);
    CHECK_EQU(shm_complete(s, taken, 1, res[0], 12), 1);
    CHECK_EQU(word_of(s, 0, 2), shm_slot_word(SLOT_DONE, g));
    CHECK_EQU(shm_stat_get(s, ST_STALE_COMPLETIONS), 3);
    CHECK_EQ(t_release(s, 0, 2), SHM_OK);
    if (wrote_stale)
        printf("  note: a stale completion is refused, but shm_complete has "
               "already written the slot's output area and meta\n");

    /* generation wraps within 24 bits */
    store_word(s, 0, 3, shm_slot_word(SLOT_DONE, SLOT_GEN_MASK));
    CHECK_EQ(t_release(s, 0, 3), SHM_OK);
    CHECK_EQU(word_of(s, 0, 3), shm_slot_word(SLOT_FREE, 0));

    /* statistics helpers */
    shm_record_batch(s, 0, 3, 4, 1000, 0);
    shm_record_batch(s, 0, 2, 2, 2000, 1);
    CHECK_EQU(shm_stat_get(s, ST_REQUESTS), 5);
    CHECK_EQU(shm_stat_get(s, ST_BATCHES), 2);
    CHECK_EQU(shm_stat_get(s, ST_PADDED_ROWS), 1);
    CHECK_EQU(shm_stat_get(s, ST_FAILED_REQUESTS), 2);
    CHECK_EQU(shm_stat_get(s, ST_FAILED_BATCHES), 1);
    CHECK_EQU(shm_stat_get(s, ST_MODEL_NS), 3000);
    CHECK_EQU(shm_hist_batch(s, 3), 1);
    CHECK_EQU(shm_hist_batch(s, 2), 1);
    CHECK_EQU(shm_hist_batch(s, P.max_batch + 1), 0); /* out of range */
    CHECK_EQU(shm_hist_model(s, shm_hist_bin(1000)), 1);
    CHECK_EQU(shm_stat_get(s, SHM_N_STATS), 0);
    shm_stat_inc(s, ST_WARMUP_NS, 5);
    shm_stat_inc(s, SHM_N_STATS, 5); /* ignored */
    CHECK_EQU(shm_stat_get(s, ST_WARMUP_NS), 5);

    /* several output fields scattered at their offsets */
    {
        char fa[2][8], fb[2][24];
        for (int i = 0; i < 2; i++) {
            fill_row(fa[i], 8, 300 + (uint64_t)i);
            fill_row(fb[i], 24, 400 + (uint64_t)i);
        }
        const char *fields[2] = {(const char *)fb, (const char *)fa};
        const uint64_t fbytes[2] = {24, 8}, foff[2] = {8, 0};
        const int64_t fstride[2] = {24, 8};
        for (uint32_t k = 0; k < 2; k++) {
            CHECK_EQ(t_begin(s, 0, k), SHM_OK);
            t_publish(s, 0, k);
        }
        CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS), 2);
        CHECK_EQU(shm_complete_fields(s, taken, 2, 2, fields, fbytes, fstride, foff, 21),
                  2);
        for (int i = 0; i < 2; i++) {
            uint32_t k = taken[i].slot;
            CHECK_EQ(t_wait(s, 0, k, 0, 5 * MS), SLOT_DONE);
            CHECK(memcmp(shm_slot_out(s, 0, k), fa[i], 8) == 0);
            CHECK(memcmp(shm_slot_out(s, 0, k) + 8, fb[i], 24) == 0);
            CHECK_EQU(shm_meta(s, 0, k)->model_version, 21);
            CHECK_EQ(t_release(s, 0, k), SHM_OK);
        }
    }

    /* closing: CLOSING is honoured before every scan, so a READY slot is
     * not handed out any more (it stays READY) and collect says CLOSED */
    uint32_t g0 = shm_word_gen(word_of(s, 0, 0));
    CHECK_EQ(t_begin(s, 0, 0), SHM_OK);
    t_publish(s, 0, 0);
    shm_request_close(s);
    CHECK_EQ(shm_ev_state(s), EV_CLOSING);
    t0 = shm_now_ns();
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 1000 * MS),
             SHM_CLOSED);
    CHECK(shm_now_ns() - t0 < 500 * MS);
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_READY, g0));
    /* client side: CLOSING is not yet CLOSED, so a wait just times out */
    CHECK_EQ(t_wait(s, 0, 0, 0, 2 * MS), SHM_TIMEOUT);
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_READY, g0) | SLOT_WAITER);
    uint32_t bell0 = atomic_load(shm_done_word(s, 0));
    shm_close_and_wake(s, SHM_STOP_CLOSED, 0);
    CHECK_EQ(shm_ev_state(s), EV_CLOSED);
    /* close_and_wake rang the client's doorbell (a sleeper's futex wait
     * returns); the WAITER bit the timed-out wait left stays, harmless */
    CHECK_EQU(atomic_load(shm_done_word(s, 0)), bell0 + 1);
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_READY, g0) | SLOT_WAITER);
    t0 = shm_now_ns();
    CHECK_EQ(t_wait(s, 0, 0, 0, 1000 * MS), SHM_CLOSED);
    CHECK(shm_now_ns() - t0 < 500 * MS);
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS),
             SHM_CLOSED);
    /* a final state still wins over CLOSED (a batch taken before the close
     * and completed after it) */
    store_word(s, 0, 0, shm_slot_word(SLOT_TAKEN, g0));
    taken[0].client = 0;
    taken[0].slot = 0;
    taken[0].gen = g0;
    CHECK_EQU(shm_complete(s, taken, 1, res[0], 13), 1);
    CHECK_EQ(t_wait(s, 0, 0, 0, 1000 * MS), SLOT_DONE);
    /* close is sticky: CLOSED/DIED never go back to CLOSING */
    shm_request_close(s);
    CHECK_EQ(shm_ev_state(s), EV_CLOSED);
    CHECK_EQ(t_set_serving(s, 1, 1), EV_CLOSED);

    seg_free(&t);
    printf("  state: all transitions and refusals as specified\n");
}

/* ------------------------------------------------------------------ */
/* d. reclaim                                                          */
/* ------------------------------------------------------------------ */

static void test_reclaim(void) {
    start_test("reclaim", 60);
    const shm_params P = mkparams(64, 16, 5, 4, 8);
    test_seg t;
    seg_make(&t, &P);
    shm_seg *s = &t.s;
    char batch[8 * 64];
    char res[8 * 16];
    shm_taken taken[8];
    uint32_t cursor = 0;
    memset(res, 7, sizeof res);
    CHECK_EQ(t_set_serving(s, 1, 1), EV_SERVING);

    int c0 = t_register(s, 7001, 11);
    int c1 = t_register(s, 7002, 12);
    CHECK_EQ(c0, 0);
    CHECK_EQ(c1, 1);
    CHECK_EQ(shm_n_attached(s), 2);

    /* c0: slot 0 WRITING, slot 1 READY, slot 2 DONE (unreleased), slot 3
     * FREE after one round trip (generation 1) */
    CHECK_EQ(t_begin(s, 0, 3), SHM_OK);
    t_publish(s, 0, 3);
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS), 1);
    CHECK_EQU(shm_complete(s, taken, 1, res, 1), 1);
    CHECK_EQ(t_release(s, 0, 3), SHM_OK);
    CHECK_EQ(t_begin(s, 0, 2), SHM_OK);
    t_publish(s, 0, 2);
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS), 1);
    CHECK_EQU(shm_complete(s, taken, 1, res, 1), 1);
    CHECK_EQ(t_begin(s, 0, 1), SHM_OK);
    t_publish(s, 0, 1);
    CHECK_EQ(t_begin(s, 0, 0), SHM_OK);
    /* c1: one slot left READY too; it must survive c0's reclaim */
    CHECK_EQ(t_begin(s, 1, 0), SHM_OK);
    t_publish(s, 1, 0);

    uint32_t before[4];
    for (uint32_t k = 0; k < 4; k++) before[k] = word_of(s, 0, k);
    CHECK_EQU(before[0], shm_slot_word(SLOT_WRITING, 0));
    CHECK_EQU(before[1], shm_slot_word(SLOT_READY, 0));
    CHECK_EQU(before[2], shm_slot_word(SLOT_DONE, 0));
    CHECK_EQU(before[3], shm_slot_word(SLOT_FREE, 1));

    shm_client_detach(s, 0);
    {
        uint64_t stt;
        uint32_t det;
        CHECK_EQ(t_info(s, 0, &stt, &det), 7001);
        CHECK_EQ(det, 1);
        CHECK_EQU(stt, 11);
    }
    uint64_t rc0 = shm_stat_get(s, ST_RECLAIMED_CLIENTS);
    uint64_t rw0 = shm_stat_get(s, ST_RECLAIMED_WRITING);
    CHECK_EQ(shm_client_reclaim(s, 0), 1); /* one slot was mid-write */
    for (uint32_t k = 0; k < 4; k++)
        CHECK_EQU(word_of(s, 0, k),
                  shm_slot_word(SLOT_FREE, shm_word_gen(before[k]) + 1));
    CHECK_EQU(word_of(s, 1, 0), shm_slot_word(SLOT_READY, 0));
    {
        uint64_t stt;
        uint32_t det;
        CHECK_EQ(t_info(s, 0, &stt, &det), 0);
        CHECK_EQ(det, 0);
        CHECK_EQU(stt, 0);
    }
    CHECK_EQ(shm_n_attached(s), 1);
    CHECK_EQU(shm_stat_get(s, ST_RECLAIMED_CLIENTS), rc0 + 1);
    CHECK_EQU(shm_stat_get(s, ST_RECLAIMED_WRITING), rw0 + 1);
    CHECK_EQ(shm_clients_hwm(s), 2); /* high-water mark never shrinks */

    /* the reclaimed READY slot is gone from the evaluator's view; c1's is
     * still there */
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS), 1);
    CHECK_EQ(taken[0].client, 1);
    CHECK_EQU(shm_complete(s, taken, 1, res, 1), 1);

    /* the entry can be registered again (lowest free index first) and its
     * slots work */
    int c0b = t_register(s, 7003, 13);
    CHECK_EQ(c0b, 0);
    CHECK_EQ(shm_n_attached(s), 2);
    CHECK_EQ(t_begin(s, 0, 0), SHM_OK);
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_WRITING, 1));
    t_publish(s, 0, 0);
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS), 1);
    CHECK_EQ(taken[0].gen, 1);
    CHECK_EQU(shm_complete(s, taken, 1, res, 1), 1);
    CHECK_EQ(t_wait(s, 0, 0, 0, 10 * MS), SLOT_DONE);
    CHECK_EQ(t_release(s, 0, 0), SHM_OK);

    /* reclaim of a clean client counts no WRITING slot */
    shm_client_detach(s, 0);
    CHECK_EQ(shm_client_reclaim(s, 0), 0);
    CHECK_EQU(shm_stat_get(s, ST_RECLAIMED_WRITING), rw0 + 1);
    CHECK_EQU(shm_stat_get(s, ST_RECLAIMED_CLIENTS), rc0 + 2);

    /* register until full */
    int got = 0;
    for (;;) {
        int c = t_register(s, 8000 + got, 1);
        if (c == SHM_E_FULL) break;
        CHECK(c >= 0 && c < (int)P.max_clients);
        CHECK(c != 1);
        got++;
        CHECK(got <= (int)P.max_clients);
    }
    CHECK_EQ(got, (int)P.max_clients - 1); /* entry 1 still belongs to c1 */
    CHECK_EQ(shm_n_attached(s), P.max_clients);
    CHECK_EQ(shm_clients_hwm(s), P.max_clients);
    CHECK_EQ(t_register(s, 9999, 1), SHM_E_FULL);
    /* free one in the middle: the next register gets exactly that one */
    shm_client_detach(s, 3);
    CHECK_EQ(shm_client_reclaim(s, 3), 0);
    CHECK_EQ(t_register(s, 9999, 1), 3);
    CHECK_EQ(t_register(s, 9998, 1), SHM_E_FULL);

    seg_free(&t);
    printf("  reclaim: slots reset with new generations, entry reusable, "
           "%u entries until SHM_E_FULL\n", P.max_clients);
}

/* ------------------------------------------------------------------ */
/* e/f. concurrent clients and one evaluator                            */
/* ------------------------------------------------------------------ */

enum { NIN = 84, NOUT = 8 }; /* floats per row: in_bytes 336, out_bytes 32 */
#define ORPHAN_REQ 0xFFFFFu
static const char k_injected[] = "RuntimeError: injected batch failure";

/* Input row of (client thread, request): a few header fields, then values
 * that depend on (thread, request, column) only.  All values are integers
 * below 2^24, so float arithmetic on them is exact. */
static float in_value(uint32_t th, uint32_t req, uint32_t j) {
    return (float)(mix64(((uint64_t)th << 40) ^ ((uint64_t)req << 8) ^ j) &
                   0xFFFF);
}
static void make_input(float *in, uint32_t th, uint32_t req, uint32_t gen,
                       uint32_t c, uint32_t k, uint32_t attempt) {
    in[0] = (float)th;
    in[1] = req == ORPHAN_REQ ? -1.0f : (float)req;
    in[2] = (float)gen;
    in[3] = (float)c;
    in[4] = (float)k;
    in[5] = (float)attempt;
    for (uint32_t j = 6; j < NIN; j++) in[j] = in_value(th, req, j);
}
/* The "model": a deterministic function of the input row. */
static void model(const float *in, float *out) {
    out[0] = in[0] * 2.0f + 1.0f;
    out[1] = in[1];
    out[2] = in[2];
    out[3] = in[5];
    for (uint32_t q = 4; q < NOUT; q++) out[q] = 0.0f;
    for (uint32_t j = 6; j < NIN; j++) out[4 + (j & 3)] += in[j];
}

typedef struct conc_ctx conc_ctx;

typedef struct {
    conc_ctx *x;
    uint32_t th;
    pthread_t tid;
    /* results, read by the main thread after join */
    uint64_t done, failed, releases, timeouts, deaths, orphans;
    uint64_t closed_ns; /* when it saw SHM_CLOSED (stop_on_close mode) */
    int saw_closed;
} client_arg;

struct conc_ctx {
    shm_seg *s;
    uint32_t nclients, nreq;
    uint64_t wait_timeout_ns;
    int stop_on_close;  /* f: run until SHM_CLOSED instead of nreq */
    int allow_deaths;   /* clients sometimes "die" mid-write */
    int inject_fail;    /* evaluator fails some batches */
    _Atomic int stop_clients;
    /* evaluator-only bookkeeping (read by main after join) */
    uint8_t *counts; /* [nclients * nreq], NULL: not counted */
    uint64_t ok_rows, failed_rows, orphan_ok, orphan_failed, batches,
        failed_batches, reclaims, reclaimed_writing, max_n;
    client_arg *clients;
};

static void conc_housekeeping(conc_ctx *x) {
    shm_seg *s = x->s;
    uint32_t hwm = shm_clients_hwm(s);
    for (uint32_t c = 0; c < hwm; c++) {
        uint64_t stt;
        uint32_t det;
        int32_t pid = t_info(s, c, &stt, &det);
        if (pid != 0 && det) {
            int w = shm_client_reclaim(s, c);
            CHECK(w >= 0 && w <= (int)s->p.slots_per_client);
            x->reclaimed_writing += (uint64_t)w;
            x->reclaims++;
        }
    }
}

static void *conc_evaluator(void *arg) {
    conc_ctx *x = arg;
    shm_seg *s = x->s;
    const uint32_t B = s->p.max_batch;
    uint64_t rng = g_seed ^ 0xE7A1ull;
    uint32_t cursor = 0;
    char *batch = malloc((uint64_t)B * s->p.in_bytes);
    float *res = malloc((uint64_t)B * s->p.out_bytes);
    shm_taken *taken = malloc(B * sizeof *taken);
    CHECK(batch && res && taken);
    for (;;) {
        uint64_t r = rng_next(&rng);
        uint64_t max_wait = (r & 7) == 0 ? 20 * US : 0;
        uint64_t spin = (r & 8) ? 2 * US : 0;
        int n = t_collect(s, batch, taken, B, &cursor, spin, max_wait,
                            100 * MS);
        if (n == SHM_CLOSED) break;
        CHECK_MSG(n >= 0 && (uint32_t)n <= B, "collect returned %d", n);
        if (n > 0) {
            int fail_batch = 0;
            uint64_t t0 = shm_now_ns();
            if ((uint64_t)n > x->max_n) x->max_n = (uint64_t)n;
            for (int i = 0; i < n; i++) {
                float in[NIN];
                memcpy(in, batch + (uint64_t)i * s->p.in_bytes, sizeof in);
                uint32_t th = (uint32_t)in[0];
                CHECK_MSG(in[0] >= 0 && th < x->nclients, "row %d: thread %f",
                          i, (double)in[0]);
                uint32_t req = in[1] < 0 ? ORPHAN_REQ : (uint32_t)in[1];
                CHECK_MSG(req == ORPHAN_REQ || req < x->nreq || x->stop_on_close,
                          "row %d: request %f", i, (double)in[1]);
                /* the row came from the slot the client wrote it into */
                CHECK_EQ(taken[i].client, (uint32_t)in[3]);
                CHECK_EQ(taken[i].slot, (uint32_t)in[4]);
                CHECK_EQ(taken[i].gen, (uint32_t)in[2]);
                uint64_t stt;
                uint32_t det;
                CHECK_EQ(t_info(s, taken[i].client, &stt, &det),
                         10000 + (int32_t)th);
                for (uint32_t j = 6; j < NIN; j++)
                    CHECK_MSG(in[j] == in_value(th, req, j),
                              "torn/foreign input: thread %u req %u col %u",
                              th, req, j);
                model(in, res + (uint64_t)i * NOUT);
                if (x->inject_fail && in[5] == 0.0f && req != ORPHAN_REQ &&
                    req % 251 == 7)
                    fail_batch = 1;
            }
            maybe_delay(&rng);
            uint32_t done;
            if (fail_batch) {
                done = shm_fail(s, taken, (uint32_t)n, k_injected,
                                (uint32_t)strlen(k_injected));
            } else {
                done = shm_complete(s, taken, (uint32_t)n, (const char *)res,
                                    x->batches + 1);
            }
            CHECK_EQU(done, (uint32_t)n);
            for (int i = 0; i < n; i++) {
                float in[NIN];
                memcpy(in, batch + (uint64_t)i * s->p.in_bytes, sizeof in);
                uint32_t th = (uint32_t)in[0];
                int orphan = in[1] < 0;
                if (fail_batch) {
                    x->failed_rows++;
                    if (orphan) x->orphan_failed++;
                } else {
                    x->ok_rows++;
                    if (orphan) {
                        x->orphan_ok++;
                    } else if (x->counts) {
                        uint8_t *cnt = &x->counts[(uint64_t)th * x->nreq +
                                                  (uint32_t)in[1]];
                        CHECK_MSG(*cnt == 0, "request (%u, %u) answered twice",
                                  th, (uint32_t)in[1]);
                        *cnt = 1;
                    }
                }
            }
            x->batches++;
            if (fail_batch) x->failed_batches++;
            shm_record_batch(s, 0, (uint32_t)n, (uint32_t)n, shm_now_ns() - t0,
                             fail_batch);
        }
        /* housekeeping between batches: no slot is TAKEN now */
        conc_housekeeping(x);
    }
    shm_close_and_wake(s, SHM_STOP_CLOSED, 0);
    free(batch);
    free(res);
    free(taken);
    return NULL;
}

static int register_retry(shm_seg *s, int32_t pid) {
    for (int tries = 0; tries < 20000; tries++) {
        int c = t_register(s, pid, (uint64_t)pid * 3);
        if (c >= 0) return c;
        CHECK_EQ(c, SHM_E_FULL);
        sleep_ns(100 * US); /* entries come back after the next batch */
    }
    FAIL("could not register pid %d: table stays full", pid);
}

/* Waits until slot (c, k) is final; loops on SHM_TIMEOUT (bounded). */
static int wait_final(client_arg *a, uint32_t c, uint32_t k, uint64_t *rng) {
    conc_ctx *x = a->x;
    uint64_t spin = (rng_next(rng) & 3) == 0 ? 1 * US : 0;
    for (unsigned i = 0;; i++) {
        int rc = t_wait(x->s, c, k, spin, x->wait_timeout_ns);
        if (rc != SHM_TIMEOUT) return rc;
        a->timeouts++;
        CHECK_MSG((uint64_t)i * x->wait_timeout_ns < 20000 * MS,
                  "client %u: slot (%u,%u) word 0x%x not answered for 20 s",
                  a->th, c, k, word_of(x->s, c, k));
    }
}

static void submit(shm_seg *s, uint32_t th, uint32_t c, uint32_t k,
                   uint32_t req, uint32_t attempt, float *in_copy,
                   uint64_t *rng) {
    CHECK_EQ(t_begin(s, c, k), SHM_OK);
    uint32_t gen = shm_word_gen(word_of(s, c, k));
    make_input(in_copy, th, req, gen, c, k, attempt);
    char *dst = shm_slot_in(s, c, k);
    /* copy in two halves with a possible delay in between */
    memcpy(dst, in_copy, sizeof(float) * NIN / 2);
    maybe_delay(rng);
    memcpy(dst + sizeof(float) * NIN / 2, in_copy + NIN / 2,
           sizeof(float) * (NIN - NIN / 2));
    t_publish(s, c, k);
}

static void *conc_client(void *arg) {
    client_arg *a = arg;
    conc_ctx *x = a->x;
    shm_seg *s = x->s;
    const uint32_t K = s->p.slots_per_client;
    uint64_t rng = g_seed ^ mix64(a->th + 1);
    const int32_t pid = 10000 + (int32_t)a->th;
    const uint32_t sessions = x->stop_on_close ? 1 : 1 + a->th % 3;
    float in[64][NIN];
    uint32_t attempt[64], reqs[64], ks[64], order[64];
    uint32_t req = 0;

    for (uint32_t sess = 0; sess < sessions; sess++) {
        uint32_t end = x->stop_on_close
                           ? UINT32_MAX
                           : (uint32_t)((uint64_t)x->nreq * (sess + 1) / sessions);
        uint32_t c = (uint32_t)register_retry(s, pid);
        for (uint32_t k = 0; k < K; k++)
            CHECK_EQ(shm_word_state(word_of(s, c, k)), SLOT_FREE);
        while (req < end && !a->saw_closed) {
            if (x->stop_on_close &&
                atomic_load_explicit(&x->stop_clients, memory_order_relaxed))
                break;
            uint32_t m = 1 + (uint32_t)(rng_next(&rng) % K);
            if (m > end - req) m = end - req;
            /* a random subset of the slots, in random order */
            for (uint32_t k = 0; k < K; k++) ks[k] = k;
            for (uint32_t k = K - 1; k > 0; k--) {
                uint32_t j = (uint32_t)(rng_next(&rng) % (k + 1));
                uint32_t tmp = ks[k];
                ks[k] = ks[j];
                ks[j] = tmp;
            }
            int notify_each = (rng_next(&rng) & 3) == 0;
            for (uint32_t j = 0; j < m; j++) {
                reqs[j] = req + j;
                attempt[j] = 0;
                submit(s, a->th, c, ks[j], reqs[j], 0, in[j], &rng);
                if (notify_each) shm_notify_evaluator(s, 1);
                maybe_delay(&rng);
            }
            if (!notify_each) shm_notify_evaluator(s, m);
            /* wait in a random order */
            for (uint32_t j = 0; j < m; j++) order[j] = j;
            for (uint32_t j = m - 1; j > 0; j--) {
                uint32_t q = (uint32_t)(rng_next(&rng) % (j + 1));
                uint32_t tmp = order[j];
                order[j] = order[q];
                order[q] = tmp;
            }
            for (uint32_t oi = 0; oi < m; oi++) {
                uint32_t j = order[oi], k = ks[j];
                for (;;) {
                    int rc = wait_final(a, c, k, &rng);
                    if (rc == SHM_CLOSED) {
                        CHECK_MSG(x->stop_on_close,
                                  "client %u: unexpected SHM_CLOSED", a->th);
                        if (!a->saw_closed) {
                            a->saw_closed = 1;
                            a->closed_ns = shm_now_ns();
                        }
                        /* the slot stays READY/TAKEN: abandoned; the
                         * other slots of this round are still collected
                         * (DONE ones count as answered) */
                        break;
                    }
                    maybe_delay(&rng);
                    uint32_t w = word_of(s, c, k);
                    if (rc == SLOT_DONE) {
                        CHECK_EQU(w, shm_slot_word(SLOT_DONE, (uint32_t)in[j][2]));
                        float want[NOUT], got[NOUT];
                        model(in[j], want);
                        memcpy(got, shm_slot_out(s, c, k), sizeof got);
                        CHECK_MSG(memcmp(got, want, sizeof got) == 0,
                                  "client %u req %u: wrong output (got "
                                  "[%g %g %g %g] want [%g %g %g %g])",
                                  a->th, reqs[j], (double)got[0],
                                  (double)got[1], (double)got[2],
                                  (double)got[3], (double)want[0],
                                  (double)want[1], (double)want[2],
                                  (double)want[3]);
                        CHECK(shm_meta(s, c, k)->model_version >= 1);
                        CHECK_EQ(shm_meta(s, c, k)->err_len, 0);
                        CHECK_EQ(t_release(s, c, k), SHM_OK);
                        CHECK_EQU(word_of(s, c, k),
                                  shm_slot_word(SLOT_FREE, shm_word_gen(w) + 1));
                        a->releases++;
                        a->done++;
                        break;
                    }
                    CHECK_MSG(rc == SLOT_FAILED, "client %u: wait returned %d",
                              a->th, rc);
                    CHECK_EQ(shm_meta(s, c, k)->err_len, strlen(k_injected));
                    CHECK(memcmp(shm_slot_out(s, c, k), k_injected,
                                 strlen(k_injected)) == 0);
                    CHECK_EQ(t_release(s, c, k), SHM_OK);
                    a->releases++;
                    a->failed++;
                    /* retry the same request */
                    attempt[j]++;
                    submit(s, a->th, c, k, reqs[j], attempt[j], in[j], &rng);
                    shm_notify_evaluator(s, 1);
                }
            }
            req += m;
        }
        if (a->saw_closed) break; /* the evaluator is gone: just leave */
        if (x->allow_deaths && sess + 1 < sessions && (a->th & 1)) {
            /* "die": leave one slot mid-write and one published orphan */
            CHECK_EQ(t_begin(s, c, 0), SHM_OK);
            memset(shm_slot_in(s, c, 0), 0xEE, 40);
            if (K > 1) {
                float tmp[NIN];
                submit(s, a->th, c, 1, ORPHAN_REQ, 0, tmp, &rng);
                shm_notify_evaluator(s, 1);
                a->orphans++;
            }
            a->deaths++;
        }
        shm_client_detach(s, c);
    }
    return NULL;
}

/* The sum of a histogram's nb bins (times the bin's index: weighted). */
static uint64_t sum_hist(shm_seg *s, uint64_t (*bin)(shm_seg *, uint32_t),
                         uint32_t nb, int weighted) {
    uint64_t tot = 0;
    for (uint32_t b = 0; b < nb; b++) tot += bin(s, b) * (weighted ? b : 1);
    return tot;
}

static void test_concurrency(void) {
    start_test("concurrency", 90);
    const shm_params P = mkparams(336, 32, 16, 4, 16);
    test_seg t;
    seg_make(&t, &P);
    shm_seg *s = &t.s;
    conc_ctx x;
    memset(&x, 0, sizeof x);
    x.s = s;
    x.nclients = (uint32_t)env_u64("SHM_TEST_CLIENTS", 8);
    x.nreq = (uint32_t)env_u64("SHM_TEST_REQUESTS", g_slow ? 30000 : 50000);
    CHECK(x.nclients >= 1 && x.nclients <= 1000 && x.nreq >= 1 &&
          x.nreq < (1u << 20));
    x.wait_timeout_ns = 100 * MS;
    x.allow_deaths = 1;
    x.inject_fail = 1;
    x.counts = calloc((uint64_t)x.nclients * x.nreq, 1);
    x.clients = calloc(x.nclients, sizeof *x.clients);
    CHECK(x.counts && x.clients);

    uint64_t t0 = shm_now_ns();
    CHECK_EQ(t_set_serving(s, (int32_t)getpid(), 1), EV_SERVING);
    pthread_t ev;
    CHECK_EQ(pthread_create(&ev, NULL, conc_evaluator, &x), 0);
    for (uint32_t i = 0; i < x.nclients; i++) {
        x.clients[i].x = &x;
        x.clients[i].th = i;
        CHECK_EQ(pthread_create(&x.clients[i].tid, NULL, conc_client,
                                &x.clients[i]),
                 0);
    }
    uint64_t done = 0, failed = 0, releases = 0, timeouts = 0, deaths = 0,
             orphans = 0, sessions = 0;
    for (uint32_t i = 0; i < x.nclients; i++) {
        CHECK_EQ(pthread_join(x.clients[i].tid, NULL), 0);
        client_arg *a = &x.clients[i];
        CHECK_EQU(a->done, x.nreq);
        done += a->done;
        failed += a->failed;
        releases += a->releases;
        timeouts += a->timeouts;
        deaths += a->deaths;
        orphans += a->orphans;
        sessions += 1 + i % 3;
    }
    uint64_t t_clients = shm_now_ns() - t0;
    shm_request_close(s);
    CHECK_EQ(pthread_join(ev, NULL), 0);
    CHECK_EQ(shm_ev_state(s), EV_CLOSED);
    conc_housekeeping(&x); /* detaches the evaluator had not seen yet */

    /* every request answered exactly once, with its own result */
    const uint64_t total = (uint64_t)x.nclients * x.nreq;
    CHECK_EQU(done, total);
    for (uint64_t i = 0; i < total; i++)
        CHECK_MSG(x.counts[i] == 1, "request (%" PRIu64 ", %" PRIu64
                                    ") answered %u times",
                  i / x.nreq, i % x.nreq, x.counts[i]);
    CHECK_EQU(x.ok_rows - x.orphan_ok, total);
    CHECK_EQU(x.failed_rows - x.orphan_failed, failed);
    CHECK(x.orphan_ok + x.orphan_failed <= orphans);
    /* the evaluator's statistics agree */
    CHECK_EQU(shm_stat_get(s, ST_REQUESTS), x.ok_rows + x.failed_rows);
    CHECK_EQU(shm_stat_get(s, ST_BATCHES), x.batches);
    CHECK_EQU(shm_stat_get(s, ST_FAILED_REQUESTS), x.failed_rows);
    CHECK_EQU(shm_stat_get(s, ST_FAILED_BATCHES), x.failed_batches);
    CHECK_EQU(shm_stat_get(s, ST_PADDED_ROWS), 0);
    CHECK_EQU(shm_stat_get(s, ST_STALE_COMPLETIONS), 0);
    CHECK_EQU(sum_hist(s, shm_hist_batch, P.max_batch + 1, 1),
              x.ok_rows + x.failed_rows);
    CHECK_EQU(sum_hist(s, shm_hist_batch, P.max_batch + 1, 0), x.batches);
    CHECK_EQU(sum_hist(s, shm_hist_wait, SHM_HIST_BINS, 0),
              x.ok_rows + x.failed_rows);
    CHECK_EQU(sum_hist(s, shm_hist_model, SHM_HIST_BINS, 0), x.batches);
    /* every session was reclaimed; every "death" left one WRITING slot */
    CHECK_EQU(x.reclaims, sessions);
    CHECK_EQU(shm_stat_get(s, ST_RECLAIMED_CLIENTS), sessions);
    CHECK_EQU(x.reclaimed_writing, deaths);
    CHECK_EQU(shm_stat_get(s, ST_RECLAIMED_WRITING), deaths);
    CHECK_EQ(shm_n_attached(s), 0);
    /* generation conservation: one bump per release, K per reclaim */
    uint64_t gens = 0;
    uint32_t hwm = shm_clients_hwm(s);
    CHECK(hwm <= P.max_clients);
    for (uint32_t c = 0; c < P.max_clients; c++)
        for (uint32_t k = 0; k < P.slots_per_client; k++) {
            uint32_t w = word_of(s, c, k);
            CHECK_EQU(w & ~(SLOT_GEN_MASK << SLOT_GEN_SHIFT), SLOT_FREE);
            gens += shm_word_gen(w);
            if (c >= hwm) CHECK_EQU(w, 0);
        }
    CHECK_EQU(gens, releases + P.slots_per_client * x.reclaims);

    free(x.counts);
    free(x.clients);
    seg_free(&t);
    printf("  concurrency: %u clients x %u requests in %.2f s "
           "(%.0f req/s): %" PRIu64 " batches (max %" PRIu64 ", mean %.2f), "
           "%" PRIu64 " injected failures retried, %" PRIu64
           " sessions reclaimed (%" PRIu64 " mid-write, %" PRIu64
           " orphans), %" PRIu64 " wait timeouts\n",
           x.nclients, x.nreq, secs(t_clients),
           (double)total / secs(t_clients), x.batches, x.max_n,
           (double)(x.ok_rows + x.failed_rows) / (double)(x.batches ? x.batches : 1),
           failed, sessions, deaths, orphans, timeouts);
}

/* ------------------------------------------------------------------ */
/* f. close while in flight                                            */
/* ------------------------------------------------------------------ */

typedef struct {
    shm_seg *s;
    uint32_t th;
    int c;
    _Atomic int stage;        /* 1 published, 2 go wait */
    _Atomic int waiting_on;   /* index into ks, -1 before */
    int rc[2];
    uint64_t ret_ns[2];
} sleeper_arg;

static void *sleeper(void *arg) {
    sleeper_arg *a = arg;
    shm_seg *s = a->s;
    for (uint32_t j = 0; j < 2; j++) {
        CHECK_EQ(t_begin(s, (uint32_t)a->c, j), SHM_OK);
        fill_row(shm_slot_in(s, (uint32_t)a->c, j), s->p.in_bytes, a->th * 2 + j);
        t_publish(s, (uint32_t)a->c, j);
    }
    shm_notify_evaluator(s, 2);
    atomic_store(&a->stage, 1);
    while (atomic_load(&a->stage) != 2) sleep_ns(100 * US);
    for (int j = 0; j < 2; j++) {
        atomic_store(&a->waiting_on, j);
        uint64_t t0 = shm_now_ns();
        int rc;
        do {
            rc = t_wait(s, (uint32_t)a->c, (uint32_t)j, 0, 10000 * MS);
            CHECK_MSG(shm_now_ns() - t0 < 20000 * MS, "sleeper %u hangs",
                      a->th);
        } while (rc == SHM_TIMEOUT);
        a->rc[j] = rc;
        a->ret_ns[j] = shm_now_ns();
        if (rc == SLOT_DONE) {
            CHECK_EQ(t_release(s, (uint32_t)a->c, (uint32_t)j), SHM_OK);
        }
    }
    atomic_store(&a->waiting_on, 2);
    return NULL;
}

/* A thread that calls shm_slot_wait or shm_collect and is parked at its
 * park_at-th clock read; the main thread acts while it is parked (or, when
 * the call never gets that far, once it has gone to sleep). */
enum { PARK_WAIT = 1, PARK_COLLECT = 2 };
enum {
    PARK_ACT_CLOSE_AND_WAKE = 1, /* request_close + close_and_wake(CLOSED) */
    PARK_ACT_SUBMIT = 2,         /* publish + notify */
    PARK_ACT_REQUEST_CLOSE = 3,  /* request_close only */
};
typedef struct {
    shm_seg *s;
    int park_at, mode, rc, parked;
    uint64_t timeout_ns, ret_ns;
    _Atomic int finished;
} park_arg;

static void *park_thread(void *arg) {
    park_arg *a = arg;
    tl_clock_calls = 0;
    tl_park_at = a->park_at;
    if (a->mode == PARK_WAIT) {
        a->rc = t_wait(a->s, 0, 0, 0, a->timeout_ns);
    } else {
        char batch[64];
        shm_taken taken[1];
        uint32_t cursor = 0;
        a->rc = t_collect(a->s, batch, taken, 1, &cursor, 0, 0, a->timeout_ns);
        if (a->rc == 1) {
            char res[16] = {0};
            CHECK_EQU(shm_complete(a->s, taken, 1, res, 1), 1);
        }
    }
    tl_park_at = 0;
    a->ret_ns = shm_now_ns();
    atomic_store(&a->finished, 1);
    return NULL;
}

/* Returns the latency from the action to the call's return. */
static uint64_t run_parked(park_arg *a, int act) {
    atomic_store(&g_park, 0);
    pthread_t tid;
    CHECK_EQ(pthread_create(&tid, NULL, park_thread, a), 0);
    /* wait for the park, or (the call never reaches that clock read) give
     * it time to go to sleep */
    uint64_t t0 = shm_now_ns();
    while (atomic_load(&g_park) != 1 && !atomic_load(&a->finished) &&
           shm_now_ns() - t0 < 100 * MS)
        sleep_ns(100 * US);
    a->parked = atomic_load(&g_park) == 1;
    uint64_t t_act = shm_now_ns();
    switch (act) {
    case PARK_ACT_CLOSE_AND_WAKE:
        shm_request_close(a->s);
        shm_close_and_wake(a->s, SHM_STOP_CLOSED, 0);
        break;
    case PARK_ACT_SUBMIT:
        CHECK_EQ(t_begin(a->s, 0, 0), SHM_OK);
        t_publish(a->s, 0, 0);
        shm_notify_evaluator(a->s, 1);
        break;
    default:
        shm_request_close(a->s);
        break;
    }
    atomic_store(&g_park, 2);
    CHECK_EQ(pthread_join(tid, NULL), 0);
    return a->ret_ns > t_act ? a->ret_ns - t_act : 0;
}

/* Race probe: one waiter entering shm_slot_wait while the evaluator closes. */
typedef struct {
    shm_seg *s;
    _Atomic int go;
    uint64_t ret_ns;
    int rc;
} racer_arg;

/* The race probe's waiters wait this long: one that slept through the
 * close returns at its deadline, long after any scheduling delay of a
 * loaded machine (so the probe tells the two apart). */
#define RACE_WAIT_NS (5000 * MS)

static void *racer(void *arg) {
    racer_arg *a = arg;
    atomic_store(&a->go, 1);
    while (atomic_load(&a->go) != 2) shm_cpu_relax();
    a->rc = t_wait(a->s, 0, 0, 0, RACE_WAIT_NS);
    a->ret_ns = shm_now_ns();
    return NULL;
}

/* Formats mem as a serving segment with one client whose slot 0 holds a
 * published request: the starting point of the close-race schedules. */
static void one_ready_request(shm_seg *seg, char *mem, const shm_layout *l,
                              const shm_params *P) {
    memset(mem, 0, l->total);
    CHECK_EQ(shm_init(seg, mem, l->total, P, "", 0, 1, 0, 0, 0), SHM_OK);
    CHECK_EQ(t_set_serving(seg, 1, 1), EV_SERVING);
    CHECK_EQ(t_register(seg, 1, 1), 0);
    CHECK_EQ(t_begin(seg, 0, 0), SHM_OK);
    t_publish(seg, 0, 0);
}

static void test_close(void) {
    start_test("close", 90);
    const uint64_t prompt = PROMPT_NS;

    /* f1: clients asleep on READY and TAKEN slots (one already DONE) */
    {
        const shm_params P = mkparams(336, 32, 8, 2, 4);
        test_seg t;
        shm_seg *s = serving_seg(&t, &P);
        enum { NS = 4 };
        sleeper_arg sa[NS];
        pthread_t tid[NS];
        for (uint32_t i = 0; i < NS; i++) {
            memset(&sa[i], 0, sizeof sa[i]);
            sa[i].s = s;
            sa[i].th = i;
            sa[i].c = t_register(s, 20000 + (int32_t)i, 1);
            CHECK_EQ(sa[i].c, (int)i);
            atomic_store(&sa[i].waiting_on, -1);
            CHECK_EQ(pthread_create(&tid[i], NULL, sleeper, &sa[i]), 0);
        }
        for (uint32_t i = 0; i < NS; i++)
            while (atomic_load(&sa[i].stage) != 1) sleep_ns(100 * US);
        /* take 4 of the 8 published slots; complete one of them */
        char batch[4 * 336], res[4 * 32];
        shm_taken taken[4];
        uint32_t cursor = 0;
        memset(res, 1, sizeof res);
        CHECK_EQ(t_collect(s, batch, taken, 4, &cursor, 0, 0, 100 * MS), 4);
        CHECK_EQU(shm_complete(s, taken, 1, res, 1), 1);
        uint32_t done_c = taken[0].client, done_k = taken[0].slot;
        for (uint32_t i = 0; i < NS; i++) atomic_store(&sa[i].stage, 2);
        /* wait until every sleeper is (about to be) asleep in futex_wait */
        uint64_t t0 = shm_now_ns();
        for (uint32_t i = 0; i < NS; i++)
            for (;;) {
                int j = atomic_load(&sa[i].waiting_on);
                if (j >= 0 && j < 2 &&
                    (word_of(s, (uint32_t)sa[i].c, (uint32_t)j) & SLOT_WAITER))
                    break;
                CHECK_MSG(shm_now_ns() - t0 < 10000 * MS,
                          "sleeper %u never went to sleep", i);
                sleep_ns(200 * US);
            }
        sleep_ns(30 * MS);
        uint64_t t_close = shm_now_ns();
        shm_request_close(s);
        shm_close_and_wake(s, SHM_STOP_CLOSED, 0);
        uint64_t worst = 0;
        for (uint32_t i = 0; i < NS; i++) {
            CHECK_EQ(pthread_join(tid[i], NULL), 0);
            for (uint32_t j = 0; j < 2; j++) {
                int want = (uint32_t)sa[i].c == done_c && j == done_k
                               ? SLOT_DONE
                               : SHM_CLOSED;
                CHECK_MSG(sa[i].rc[j] == want,
                          "sleeper %u slot %u: rc %d, want %d", i, j,
                          sa[i].rc[j], want);
                if (want == SHM_CLOSED) {
                    uint64_t lat = sa[i].ret_ns[j] > t_close
                                       ? sa[i].ret_ns[j] - t_close
                                       : 0;
                    if (lat > worst) worst = lat;
                }
            }
        }
        CHECK_MSG(worst < prompt, "a sleeper took %.3f s to see the close",
                  secs(worst));
        printf("  close: %d sleepers woke %.2f ms after close (timeout 10 s)\n",
               NS, (double)worst / 1e6);
        seg_free(&t);
    }

    /* f2: close under load: every wait ends DONE (checked output) or
     * CLOSED, promptly */
    {
        const shm_params P = mkparams(336, 32, 16, 4, 16);
        test_seg t;
        seg_make(&t, &P);
        shm_seg *s = &t.s;
        conc_ctx x;
        memset(&x, 0, sizeof x);
        x.s = s;
        x.nclients = 8;
        x.nreq = 0;
        x.wait_timeout_ns = 100 * MS;
        x.stop_on_close = 1;
        x.clients = calloc(x.nclients, sizeof *x.clients);
        CHECK(x.clients != NULL);
        CHECK_EQ(t_set_serving(s, 1, 1), EV_SERVING);
        pthread_t ev;
        CHECK_EQ(pthread_create(&ev, NULL, conc_evaluator, &x), 0);
        for (uint32_t i = 0; i < x.nclients; i++) {
            x.clients[i].x = &x;
            x.clients[i].th = i;
            CHECK_EQ(pthread_create(&x.clients[i].tid, NULL, conc_client,
                                    &x.clients[i]),
                     0);
        }
        sleep_ns(300 * MS);
        uint64_t t_close = shm_now_ns();
        shm_request_close(s);
        CHECK_EQ(pthread_join(ev, NULL), 0); /* it calls close_and_wake */
        uint64_t t_ev = shm_now_ns();
        uint64_t worst = 0, done = 0, closed = 0;
        for (uint32_t i = 0; i < x.nclients; i++) {
            CHECK_EQ(pthread_join(x.clients[i].tid, NULL), 0);
            client_arg *a = &x.clients[i];
            done += a->done;
            closed += (uint64_t)a->saw_closed;
            CHECK_MSG(a->saw_closed, "client %u never saw SHM_CLOSED", i);
            uint64_t lat = a->closed_ns > t_close ? a->closed_ns - t_close : 0;
            if (lat > worst) worst = lat;
        }
        CHECK(done > 0);
        CHECK_MSG(worst < prompt + x.wait_timeout_ns,
                  "a client took %.3f s to see the close", secs(worst));
        CHECK_EQU(shm_stat_get(s, ST_REQUESTS), x.ok_rows + x.failed_rows);
        CHECK_EQU(x.ok_rows, done);
        printf("  close: under load, %" PRIu64 " requests answered, evaluator "
               "out %.2f ms and all %" PRIu64 " clients out %.2f ms after "
               "close\n",
               done, (double)(t_ev - t_close) / 1e6, closed,
               (double)worst / 1e6);
        free(x.clients);
        seg_free(&t);
    }

    /* f3: deterministic schedules.  A thread is parked at its N-th clock
     * read inside ring.h while the main thread acts, for every N that the
     * call reaches. */
    {
        const shm_params P = mkparams(64, 16, 1, 1, 1);
        shm_layout l;
        CHECK_EQ(shm_layout_compute(&P, &l), SHM_OK);
        char *mem = seg_alloc(l.total);
        const uint64_t slow = 300 * MS;
        char line[256];
        size_t used = 0;
        unsigned missed = 0;
        /* (1) waiter vs shm_close_and_wake */
        for (int at = 1; at <= 4; at++) {
            shm_seg seg;
            one_ready_request(&seg, mem, &l, &P);
            park_arg pa;
            memset(&pa, 0, sizeof pa);
            pa.s = &seg;
            pa.park_at = at;
            pa.timeout_ns = 2 * slow;
            pa.mode = PARK_WAIT;
            uint64_t lat = run_parked(&pa, PARK_ACT_CLOSE_AND_WAKE);
            CHECK_MSG(pa.rc == SHM_CLOSED, "park %d: wait returned %d", at,
                      pa.rc);
            if (lat >= slow) missed++;
            used += (size_t)snprintf(line + used, sizeof line - used,
                                     " %s%d:%.1fms", pa.parked ? "" : "~", at,
                                     (double)lat / 1e6);
        }
        printf("  close: waiter parked at clock read N, then close_and_wake "
               "(N:latency):%s\n", line);
        if (missed) {
            printf("  WARNING: %u schedule(s) where a waiter slept through "
                   "shm_close_and_wake until its timeout (missed wake-up in "
                   "ring.h, see ring_test.c test_close)\n", missed);
            CHECK_MSG(!env_u64("SHM_TEST_STRICT_CLOSE_RACE", 1),
                      "%u schedule(s) lose the close wake-up", missed);
        }
        /* (2) evaluator in shm_collect vs a submission, and vs a close:
         * these must never be lost */
        for (int act = PARK_ACT_SUBMIT; act <= PARK_ACT_REQUEST_CLOSE; act++) {
            used = 0;
            for (int at = 1; at <= 5; at++) {
                shm_seg seg;
                memset(mem, 0, l.total);
                CHECK_EQ(shm_init(&seg, mem, l.total, &P, "", 0, 1, 0, 0, 0), SHM_OK);
                CHECK_EQ(t_set_serving(&seg, 1, 1), EV_SERVING);
                CHECK_EQ(t_register(&seg, 1, 1), 0);
                park_arg pa;
                memset(&pa, 0, sizeof pa);
                pa.s = &seg;
                pa.park_at = at;
                pa.timeout_ns = 2 * slow;
                pa.mode = PARK_COLLECT;
                uint64_t lat = run_parked(&pa, act);
                int want = act == PARK_ACT_SUBMIT ? 1 : SHM_CLOSED;
                CHECK_MSG(pa.rc == want, "collect parked at %d: rc %d, want %d",
                          at, pa.rc, want);
                CHECK_MSG(lat < slow,
                          "collect parked at clock read %d missed the %s "
                          "(%.1f ms)", at,
                          act == PARK_ACT_SUBMIT ? "doorbell" : "close",
                          (double)lat / 1e6);
                used += (size_t)snprintf(line + used, sizeof line - used,
                                         " %s%d:%.1fms", pa.parked ? "" : "~",
                                         at, (double)lat / 1e6);
            }
            printf("  close: collect parked at N, then %s:%s\n",
                   act == PARK_ACT_SUBMIT ? "publish+notify" : "request_close",
                   line);
        }
        free(mem);
    }

    /* f4: race probe -- a waiter entering shm_slot_wait at the moment of
     * the close.  A waiter that reads ev_state == SERVING, then has the
     * whole close_and_wake run before its CAS sets WAITER, sleeps its full
     * timeout: close_and_wake saw no WAITER bit to clear or wake, and
     * shm_slot_wait does not re-read ev_state after setting WAITER. */
    {
        const unsigned trials = (unsigned)env_u64(
            "SHM_TEST_RACE_TRIALS", g_slow ? 100 : 300);
        const shm_params P = mkparams(64, 16, 1, 1, 1);
        shm_layout l;
        CHECK_EQ(shm_layout_compute(&P, &l), SHM_OK);
        char *mem = seg_alloc(l.total);
        uint64_t rng = g_seed ^ 0x2ACEull;
        unsigned late = 0;
        uint64_t worst = 0;
        for (unsigned i = 0; i < trials; i++) {
            shm_seg seg;
            one_ready_request(&seg, mem, &l, &P);
            racer_arg ra;
            memset(&ra, 0, sizeof ra);
            ra.s = &seg;
            pthread_t tid;
            CHECK_EQ(pthread_create(&tid, NULL, racer, &ra), 0);
            while (atomic_load(&ra.go) != 1) shm_cpu_relax();
            /* CLOSING does not stop a waiter; only EV_CLOSED does, so
             * request the close first and race close_and_wake alone */
            shm_request_close(&seg);
            uint32_t spins = (uint32_t)(rng_next(&rng) % 48);
            atomic_store(&ra.go, 2);
            for (uint32_t q = 0; q < spins; q++) shm_cpu_relax();
            uint64_t tc = shm_now_ns();
            shm_close_and_wake(&seg, SHM_STOP_CLOSED, 0);
            CHECK_EQ(pthread_join(tid, NULL), 0);
            CHECK_MSG(ra.rc == SHM_CLOSED, "race probe: rc %d", ra.rc);
            uint64_t lat = ra.ret_ns > tc ? ra.ret_ns - tc : 0;
            if (lat > worst) worst = lat;
            if (lat >= RACE_WAIT_NS / 2) late++;
        }
        free(mem);
        printf("  close: race probe %u trials, %u waiters slept through the "
               "close (worst %.1f ms)\n",
               trials, late, (double)worst / 1e6);
        if (late) {
            printf("  WARNING: missed wake-up in shm_slot_wait vs "
                   "shm_close_and_wake (bounded by the wait timeout)\n");
            CHECK_MSG(!env_u64("SHM_TEST_STRICT_CLOSE_RACE", 1),
                      "%u of %u waiters slept through the close", late,
                      trials);
        }
    }
}

/* ------------------------------------------------------------------ */
/* g. max_wait_ns                                                      */
/* ------------------------------------------------------------------ */

typedef struct {
    shm_seg *s;
    uint32_t c;
    uint32_t count;
    uint64_t delay_ns;
    _Atomic int started;
} late_arg;

static void *late_publisher(void *arg) {
    late_arg *a = arg;
    atomic_store(&a->started, 1);
    sleep_ns(a->delay_ns);
    for (uint32_t k = 0; k < a->count; k++) {
        CHECK_EQ(t_begin(a->s, a->c, k), SHM_OK);
        t_publish(a->s, a->c, k);
        shm_notify_evaluator(a->s, 1);
    }
    return NULL;
}

typedef struct {
    shm_seg *s;
    uint64_t delay_ns;
} closer_arg;

static void *late_closer(void *arg) {
    closer_arg *a = arg;
    sleep_ns(a->delay_ns);
    shm_request_close(a->s);
    return NULL;
}

static void drain(shm_seg *s, shm_taken *taken, int n) {
    char res[8 * 32];
    memset(res, 3, sizeof res);
    CHECK_EQU(shm_complete(s, taken, (uint32_t)n, res, 1), (uint32_t)n);
    for (int i = 0; i < n; i++) {
        CHECK_EQ(t_wait(s, taken[i].client, taken[i].slot, 0, 10 * MS),
                 SLOT_DONE);
        CHECK_EQ(t_release(s, taken[i].client, taken[i].slot), SHM_OK);
    }
}

/* Publishes slot (0, 0) now when now_one, starts a thread that publishes
 * `late` slots of client 1 after 30 ms, then collects with the given limits.
 * Returns what collect returned; *el is how long collect took. */
static int collect_with_late(shm_seg *s, char *batch, shm_taken *taken,
                             uint32_t *cursor, int now_one, uint32_t late,
                             uint32_t max_batch, uint64_t max_wait,
                             uint64_t timeout, uint64_t *el) {
    if (now_one) {
        CHECK_EQ(t_begin(s, 0, 0), SHM_OK);
        t_publish(s, 0, 0);
        shm_notify_evaluator(s, 1);
    }
    late_arg la = {s, 1, late, 30 * MS, 0};
    pthread_t tid;
    CHECK_EQ(pthread_create(&tid, NULL, late_publisher, &la), 0);
    uint64_t t0 = shm_now_ns();
    int n = t_collect(s, batch, taken, max_batch, cursor, 0, max_wait,
                        timeout);
    *el = shm_now_ns() - t0;
    CHECK_EQ(pthread_join(tid, NULL), 0);
    return n;
}

static void test_max_wait(void) {
    start_test("max_wait", 60);
    const shm_params P = mkparams(336, 32, 4, 4, 8);
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    CHECK_EQ(t_register(s, 1, 1), 0);
    CHECK_EQ(t_register(s, 2, 1), 1);
    char batch[8 * 336];
    shm_taken taken[8];
    uint32_t cursor = 0;
    uint64_t t0, el;
    int n;

    /* greedy: one request there -> returns at once with 1 */
    CHECK_EQ(t_begin(s, 0, 0), SHM_OK);
    t_publish(s, 0, 0);
    shm_notify_evaluator(s, 1);
    t0 = shm_now_ns();
    n = t_collect(s, batch, taken, 8, &cursor, 0, 0, 1000 * MS);
    el = shm_now_ns() - t0;
    CHECK_EQ(n, 1);
    CHECK_MSG(el < 500 * MS, "greedy collect took %.1f ms", (double)el / 1e6);
    uint64_t greedy_el = el;
    drain(s, taken, n);

    /* greedy with a sleeper: the evaluator asleep on the doorbell wakes
     * for one request and returns it alone */
    {
        n = collect_with_late(s, batch, taken, &cursor, 0, 1, 8, 0, 5000 * MS,
                              &el);
        CHECK_EQ(n, 1);
        CHECK_MSG(el < 2000 * MS, "doorbell wake took %.1f ms",
                  (double)el / 1e6);
        drain(s, taken, n);
    }

    /* max_wait: one now, three more 30 ms later -> a batch of 4 after
     * about max_wait (not before the late ones, not at the timeout) */
    uint64_t fuller_el;
    {
        n = collect_with_late(s, batch, taken, &cursor, 1, 3, 8, 300 * MS,
                              5000 * MS, &el);
        CHECK_EQ(n, 4);
        CHECK_MSG(el >= 290 * MS && el < 3000 * MS,
                  "max_wait collect took %.1f ms", (double)el / 1e6);
        fuller_el = el;
        drain(s, taken, n);
    }

    /* max_wait, but the batch fills up first -> returns when full */
    {
        n = collect_with_late(s, batch, taken, &cursor, 1, 3, 4, 3000 * MS,
                              5000 * MS, &el);
        CHECK_EQ(n, 4);
        CHECK_MSG(el < 2000 * MS, "full batch took %.1f ms", (double)el / 1e6);
        drain(s, taken, n);
    }

    /* max_wait with only one request: returns it after max_wait */
    {
        CHECK_EQ(t_begin(s, 0, 0), SHM_OK);
        t_publish(s, 0, 0);
        shm_notify_evaluator(s, 1);
        t0 = shm_now_ns();
        n = t_collect(s, batch, taken, 8, &cursor, 50 * US, 100 * MS,
                        5000 * MS);
        el = shm_now_ns() - t0;
        CHECK_EQ(n, 1);
        CHECK_MSG(el >= 95 * MS && el < 2000 * MS,
                  "lonely max_wait took %.1f ms", (double)el / 1e6);
        drain(s, taken, n);
    }

    /* a close during max_wait returns the partial batch at once */
    {
        CHECK_EQ(t_begin(s, 0, 0), SHM_OK);
        t_publish(s, 0, 0);
        shm_notify_evaluator(s, 1);
        closer_arg ca = {s, 30 * MS};
        pthread_t tid;
        CHECK_EQ(pthread_create(&tid, NULL, late_closer, &ca), 0);
        t0 = shm_now_ns();
        n = t_collect(s, batch, taken, 8, &cursor, 0, 5000 * MS, 10000 * MS);
        el = shm_now_ns() - t0;
        CHECK_EQ(pthread_join(tid, NULL), 0);
        CHECK_EQ(n, 1);
        CHECK_MSG(el < 2000 * MS, "close during max_wait took %.1f ms",
                  (double)el / 1e6);
        drain(s, taken, n);
        CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS),
                 SHM_CLOSED);
    }
    seg_free(&t);
    seg_make(&t, &P);
    s = &t.s;
    CHECK_EQ(t_set_serving(s, 1, 1), EV_SERVING);

    /* max_wait does not start before the first request: with nothing
     * there, collect waits for the timeout and returns 0 */
    t0 = shm_now_ns();
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 10 * MS, 40 * MS), 0);
    el = shm_now_ns() - t0;
    CHECK(el >= 40 * MS);

    seg_free(&t);
    printf("  max_wait: greedy returned 1 in %.3f ms; max_wait 300 ms "
           "returned 4 in %.1f ms\n",
           (double)greedy_el / 1e6, (double)fuller_el / 1e6);
}

/* Control requests: a sleeping evaluator returns SHM_CONTROL promptly, a
 * batch already begun comes first, close wins, and nothing is pending once
 * the loop reports the ticket done. */
static void *late_controller(void *arg) {
    closer_arg *a = arg;
    sleep_ns(a->delay_ns);
    CHECK_EQU(shm_request_control(a->s), 1);
    return NULL;
}

static void test_control(void) {
    start_test("control", 60);
    const shm_params P = mkparams(336, 32, 4, 4, 8);
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    CHECK_EQ(t_register(s, 1, 1), 0);
    char batch[8 * 336];
    shm_taken taken[8];
    uint32_t cursor = 0, done = 99;
    uint64_t t0, el;

    CHECK_EQU(shm_control_pending(s, 0, &done), 0);
    CHECK_EQU(done, 0);
    /* asleep on the doorbell (spin 0, timeout 5 s): woken by the request */
    closer_arg ca = {s, 30 * MS};
    pthread_t tid;
    CHECK_EQ(pthread_create(&tid, NULL, late_controller, &ca), 0);
    t0 = shm_now_ns();
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 5000 * MS),
             SHM_CONTROL);
    el = shm_now_ns() - t0;
    CHECK_EQ(pthread_join(tid, NULL), 0);
    CHECK_MSG(el < 2000 * MS, "control wake took %.1f ms", (double)el / 1e6);
    CHECK_EQU(shm_control_pending(s, 0, &done), 1);
    CHECK_EQU(done, 0);
    /* still pending until reported done: collect keeps returning it */
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS),
             SHM_CONTROL);
    shm_control_done(s, 0, 1);
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS), 0);

    /* a request and a control request both waiting, nothing taken yet:
     * the control request comes first and the request stays READY for
     * the next collect */
    CHECK_EQ(t_begin(s, 0, 0), SHM_OK);
    t_publish(s, 0, 0);
    shm_notify_evaluator(s, 1);
    CHECK_EQU(shm_request_control(s), 2);
    int n = t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS);
    CHECK_EQ(n, SHM_CONTROL);  /* checked before scanning: nothing taken */
    CHECK_EQ(shm_word_state(word_of(s, 0, 0)), SLOT_READY);
    shm_control_done(s, 0, 2);
    n = t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS);
    CHECK_EQ(n, 1);
    drain(s, taken, n);

    /* max_wait: a control request during the wait returns the partial
     * batch first, then SHM_CONTROL */
    CHECK_EQ(t_begin(s, 0, 1), SHM_OK);
    t_publish(s, 0, 1);
    shm_notify_evaluator(s, 1);
    ca.delay_ns = 30 * MS;
    CHECK_EQ(pthread_create(&tid, NULL, late_controller, &ca), 0);
    /* late_controller expects ticket 1: reset the counters first */
    atomic_store(&shm_hdr(s)->ctl_req, 0);
    shm_control_done(s, 0, 0);
    t0 = shm_now_ns();
    n = t_collect(s, batch, taken, 8, &cursor, 0, 5000 * MS, 10000 * MS);
    el = shm_now_ns() - t0;
    CHECK_EQ(pthread_join(tid, NULL), 0);
    CHECK_EQ(n, 1);
    CHECK_MSG(el < 2000 * MS, "control during max_wait took %.1f ms",
              (double)el / 1e6);
    drain(s, taken, n);
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS),
             SHM_CONTROL);

    /* close wins over a pending control request */
    shm_request_close(s);
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS),
             SHM_CLOSED);
    seg_free(&t);
}

/* A process of the same user scribbling on the header must not make the
 * evaluator or a client index past the client table (ASan checks). */
static void test_scribbled(void) {
    start_test("scribbled", 30);
    const shm_params P = mkparams(336, 32, 4, 4, 8);
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    CHECK_EQ(t_register(s, 1, 1), 0);
    char batch[8 * 336];
    shm_taken taken[8];
    uint32_t cursor = 0;
    atomic_store(&shm_hdr(s)->clients_hwm, UINT32_MAX);
    CHECK_EQU(shm_clients_hwm(s), P.max_clients);
    CHECK_EQ(t_begin(s, 0, 0), SHM_OK);
    t_publish(s, 0, 0);
    shm_notify_evaluator(s, 1);
    int n = t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS);
    CHECK_EQ(n, 1);
    drain(s, taken, n);
    shm_close_and_wake(s, SHM_STOP_CLOSED, 0);
    seg_free(&t);
}

/* Doorbells: one batch answers sleepers of three doorbell words (clients
 * 0..31, 32..63, 64..), taken in an order that moves between the words
 * and back; every sleeper must wake promptly, not at its 10 s timeout.
 * The batch rings each word once per run of its clients (one
 * FUTEX_WAKE_BITSET with their bits): a ring of the wrong word, or of
 * the wrong bits, leaves a sleeper asleep. */
typedef struct {
    shm_seg *s;
    uint32_t c;
    uint64_t timeout_ns;
    int rc;
    uint64_t ret_ns, cpu_ns; /* when it returned; its CPU time in the wait */
    shm_ticker *ticker;      /* NULL: a timed wait */
    _Atomic int returned;
    uint64_t spin_ns;        /* the wait's spin budget (0 unless set) */
} bell_arg;

static uint64_t thread_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Waits for slot 0 of client c (after a spin of spin_ns, if set). */
static void *bell_sleeper(void *arg) {
    bell_arg *a = arg;
    uint64_t c0 = thread_cpu_ns();
    a->rc = t_wait_ticked(a->s, a->c, 0, a->spin_ns, a->timeout_ns,
                                 a->ticker);
    a->ret_ns = shm_now_ns();
    a->cpu_ns = thread_cpu_ns() - c0;
    atomic_store(&a->returned, 1);
    return NULL;
}

/* Claims entries 0..n-1 for pids pid0, pid0 + 1, ... */
static void register_clients(shm_seg *s, uint32_t n, int32_t pid0) {
    for (uint32_t c = 0; c < n; c++)
        CHECK_EQ(t_register(s, pid0 + (int32_t)c, 1), (int)c);
}

static void test_doorbell(void) {
    start_test("doorbell", 60);
    const shm_params P = mkparams(336, 32, 70, 1, 8);
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    register_clients(s, P.max_clients, 30000);
    CHECK(shm_done_word(s, 31) == shm_done_word(s, 0));
    CHECK(shm_done_word(s, 32) != shm_done_word(s, 31));
    CHECK_EQU(shm_done_bit(33), 2u);
    enum { NB = 7 };
    /* taken order: word 2, 0, 1, 0, 2, 0, 1 */
    const uint32_t order[NB] = {64, 0, 32, 5, 69, 31, 63};
    for (int round = 0; round < 2; round++) {
        bell_arg ba[NB];
        pthread_t tid[NB];
        for (int i = 0; i < NB; i++) {
            ba[i] = (bell_arg){s, order[i], 10000 * MS, 0, 0, 0, NULL, 0, 0};
            CHECK_EQ(t_begin(s, order[i], 0), SHM_OK);
            t_publish(s, order[i], 0);
            CHECK_EQ(pthread_create(&tid[i], NULL, bell_sleeper, &ba[i]), 0);
        }
        /* every sleeper has announced WAITER; give them time to sleep */
        uint64_t t0 = shm_now_ns();
        for (int i = 0; i < NB; i++)
            while (!(word_of(s, order[i], 0) & SLOT_WAITER)) {
                CHECK_MSG(shm_now_ns() - t0 < 10000 * MS,
                          "client %u never went to sleep", order[i]);
                sleep_ns(200 * US);
            }
        sleep_ns(30 * MS);
        char batch[NB * 336], res[NB * 32];
        shm_taken taken[8];
        uint32_t cursor = 0;
        memset(res, 7, sizeof res);
        CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 100 * MS),
                 NB);
        /* the scan takes clients in index order; put them in `order` */
        shm_taken by_order[NB];
        for (int i = 0; i < NB; i++)
            for (int j = 0; j < NB; j++)
                if (taken[j].client == order[i]) by_order[i] = taken[j];
        uint32_t bell0[3];
        for (uint32_t g = 0; g < 3; g++) bell0[g] = atomic_load(shm_done_word(s, 32 * g));
        uint64_t t_done = shm_now_ns();
        CHECK_EQU(shm_complete(s, by_order, NB, res, 1 + (uint64_t)round), NB);
        /* runs in `order`: word 2, 0, 1, 0, 2, 0, 1 -> 2, 3 and 2 rings */
        CHECK_EQU(atomic_load(shm_done_word(s, 0)) - bell0[0], 3u);
        CHECK_EQU(atomic_load(shm_done_word(s, 32)) - bell0[1], 2u);
        CHECK_EQU(atomic_load(shm_done_word(s, 64)) - bell0[2], 2u);
        uint64_t worst = 0;
        for (int i = 0; i < NB; i++) {
            CHECK_EQ(pthread_join(tid[i], NULL), 0);
            CHECK_MSG(ba[i].rc == SLOT_DONE, "client %u: rc %d", order[i],
                      ba[i].rc);
            uint64_t lat = ba[i].ret_ns > t_done ? ba[i].ret_ns - t_done : 0;
            CHECK_MSG(lat < PROMPT_NS, "client %u woke %.3f s after its answer",
                      order[i], secs(lat));
            if (lat > worst) worst = lat;
            CHECK_EQ(t_release(s, order[i], 0), SHM_OK);
        }
        if (round == 1)
            printf("  doorbell: %d sleepers on 3 words woke %.2f ms after "
                   "their batch (timeout 10 s)\n", NB, (double)worst / 1e6);
    }

    /* An endless timeout: the absolute futex deadline saturates instead of
     * wrapping (a wrapped one lies in the past: the wait would spin). */
    {
        CHECK_EQ(t_begin(s, 3, 0), SHM_OK);
        t_publish(s, 3, 0);
        bell_arg ea = {s, 3, UINT64_MAX, 0, 0, 0, NULL, 0, 0};
        pthread_t tid;
        CHECK_EQ(pthread_create(&tid, NULL, bell_sleeper, &ea), 0);
        while (!(word_of(s, 3, 0) & SLOT_WAITER)) sleep_ns(200 * US);
        sleep_ns(50 * MS);
        char batch[336], res[32] = {0};
        shm_taken taken[1];
        uint32_t cursor = 0;
        CHECK_EQ(t_collect(s, batch, taken, 1, &cursor, 0, 0, 100 * MS), 1);
        CHECK_EQU(shm_complete(s, taken, 1, res, 3), 1);
        CHECK_EQ(pthread_join(tid, NULL), 0);
        CHECK_EQ(ea.rc, SLOT_DONE);
        CHECK_MSG(ea.cpu_ns < 20 * MS,
                  "an endless wait used %.1f ms of CPU in 50 ms: it spun",
                  (double)ea.cpu_ns / 1e6);
        CHECK_EQ(t_release(s, 3, 0), SHM_OK);
    }
    seg_free(&t);
}

/* The ticker (shm_ticker): a waiter that chose it sleeps without a timer
 * and returns SHM_TIMEOUT at its next tick, however long the timeout it
 * was given; it still gets its answer as soon as it comes; once the ticker
 * is stopped, such a waiter returns at once.  A ticker that rings the wrong
 * bit, or rings without ticking, leaves the waiter asleep for good: the
 * bounded joins below fail (there is no timer to fall back on). */
static void join_within(pthread_t tid, bell_arg *a, uint64_t limit_ns,
                        const char *what) {
    uint64_t t0 = shm_now_ns();
    while (!atomic_load(&a->returned)) {
        CHECK_MSG(shm_now_ns() - t0 < limit_ns,
                  "%s: client %u still asleep after %.1f s", what, a->c,
                  secs(limit_ns));
        sleep_ns(1 * MS);
    }
    CHECK_EQ(pthread_join(tid, NULL), 0);
}

/* Publishes slot 0 of a->c and starts a sleeper on it; returns once it
 * has announced WAITER and had 30 ms to fall asleep. */
static void publish_and_sleep(bell_arg *a, pthread_t *tid) {
    CHECK_EQ(t_begin(a->s, a->c, 0), SHM_OK);
    t_publish(a->s, a->c, 0);
    CHECK_EQ(pthread_create(tid, NULL, bell_sleeper, a), 0);
    while (!(word_of(a->s, a->c, 0) & SLOT_WAITER)) sleep_ns(200 * US);
    sleep_ns(30 * MS);
}

static void test_ticker(void) {
    start_test("ticker", 60);
    const shm_params P = mkparams(336, 32, 40, 1, 8);
    test_seg ts;
    shm_seg *s = serving_seg(&ts, &P);
    register_clients(s, P.max_clients, 31000);
    const uint64_t period = 20 * MS;
    /* clients 1 and 33 each with a ticker: on two doorbell words */
    const uint32_t cs[2] = {1, 33};
    shm_ticker tk[2];
    for (int i = 0; i < 2; i++)
        CHECK_EQ(shm_ticker_start(&tk[i], s, cs[i], period), 0);
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(t_begin(s, cs[i], 0), SHM_OK);
        t_publish(s, cs[i], 0);
    }
    /* Nobody answers: each wait returns at a tick, within a period (plus
     * scheduling slack), though its timeout is 10 s; it slept meanwhile. */
    for (int round = 0; round < 3; round++)
        for (int i = 0; i < 2; i++) {
            bell_arg a = {s, cs[i], 10000 * MS, 0, 0, 0, &tk[i], 0, 0};
            pthread_t tid;
            uint32_t tick0 = atomic_load(&tk[i].tick);
            uint64_t t0 = shm_now_ns();
            CHECK_EQ(pthread_create(&tid, NULL, bell_sleeper, &a), 0);
            join_within(tid, &a, PROMPT_NS, "ticked wait, no answer");
            CHECK_EQ(a.rc, SHM_TIMEOUT);
            CHECK(atomic_load(&tk[i].tick) != tick0);
            CHECK_MSG(a.cpu_ns < period / 2,
                      "a ticked wait used %.1f ms of CPU in %.1f ms",
                      (double)a.cpu_ns / 1e6, (double)(a.ret_ns - t0) / 1e6);
        }
    /* An answer wakes a ticked waiter as it wakes a timed one: client 1
     * asleep on a ticker of a long period (no tick during the test). */
    shm_ticker slow;
    CHECK_EQ(shm_ticker_start(&slow, s, 2, 3600000 * MS), 0);
    {
        bell_arg a = {s, 2, UINT64_MAX, 0, 0, 0, &slow, 0, 0};
        pthread_t tid;
        publish_and_sleep(&a, &tid);
        char batch[3 * 336], res[3 * 32] = {0};
        shm_taken taken[3];
        uint32_t cursor = 0;
        /* the other two slots are still READY: all three are taken */
        CHECK_EQ(t_collect(s, batch, taken, 3, &cursor, 0, 0, 100 * MS), 3);
        uint64_t t_done = shm_now_ns();
        CHECK_EQU(shm_complete(s, taken, 3, res, 5), 3);
        join_within(tid, &a, PROMPT_NS, "ticked wait, answered");
        CHECK_EQ(a.rc, SLOT_DONE);
        CHECK_MSG(a.ret_ns - t_done < PROMPT_NS, "woke %.3f s after its answer",
                  secs(a.ret_ns - t_done));
        for (int i = 0; i < 2; i++)
            CHECK_EQ(t_release(s, cs[i], 0), SHM_OK);
        CHECK_EQ(t_release(s, 2, 0), SHM_OK);
    }
    /* Stopping: a waiter asleep on the slow ticker returns when it stops,
     * and one that chose it afterwards returns at once. */
    {
        bell_arg a = {s, 2, UINT64_MAX, 0, 0, 0, &slow, 0, 0};
        pthread_t tid;
        publish_and_sleep(&a, &tid);
        CHECK(!atomic_load(&a.returned));
        shm_ticker_stop(&slow);
        join_within(tid, &a, PROMPT_NS, "ticked wait, ticker stopped");
        CHECK_EQ(a.rc, SHM_TIMEOUT);
        bell_arg b = {s, 2, UINT64_MAX, 0, 0, 0, &slow, 0, 0};
        bell_sleeper(&b);
        CHECK_EQ(b.rc, SHM_TIMEOUT);
    }
    for (int i = 0; i < 2; i++) shm_ticker_stop(&tk[i]);
    printf("  ticker: waits on two doorbell words returned at ticks of "
           "20 ms (timeout 10 s)\n");
    seg_free(&ts);
}

/* Yielding spins (SHM_SPIN_YIELD): a client's wait and the evaluator's
 * collect look between sched_yield() calls while the budget lasts, then
 * sleep as before; the bit is a flag, not part of the budget (taken as a
 * budget it would spin for centuries: the waiter below never sleeps and
 * collect overruns its CPU bound).  A plain spin yields too, once every
 * SHM_SPIN_LOOKS looks: here the waiter and the thread that answers it
 * share one CPU (as a futex wake-up can leave a client and its evaluator),
 * and the answer comes only once the spin has given the CPU away. */
static void answer_all(shm_seg *s, uint32_t n) {
    char batch[4 * 336], res[4 * 32] = {0};
    shm_taken taken[4];
    uint32_t cursor = 0;
    CHECK_EQ(t_collect(s, batch, taken, 4, &cursor, 0, 0, 100 * MS), (int)n);
    CHECK_EQU(shm_complete(s, taken, n, res, 1), n);
}

static void test_yield(void) {
    start_test("yield", 60);
    const shm_params P = mkparams(336, 32, 4, 1, 4);
    test_seg ts;
    shm_seg *s = serving_seg(&ts, &P);
    register_clients(s, P.max_clients, 32000);
    /* answered within the budget by a thread on the waiter's CPU: both
     * spins give the CPU away (the answering thread sees a yield), and
     * both return the answer without sleeping */
    cpu_set_t all, one;
    CHECK_EQ(pthread_getaffinity_np(pthread_self(), sizeof all, &all), 0);
    CPU_ZERO(&one);
    CPU_SET(sched_getcpu(), &one);
    for (int yield = 0; yield < 2; yield++) {
        bell_arg a = {s, 0, 10000 * MS, 0, 0, 0, NULL, 0,
                      (500 * MS) | (yield ? SHM_SPIN_YIELD : 0)};
        pthread_t tid;
        CHECK_EQ(t_begin(s, 0, 0), SHM_OK);
        t_publish(s, 0, 0);
        unsigned long y0 = atomic_load(&g_yields);
        /* the waiter inherits this thread's one CPU */
        CHECK_EQ(pthread_setaffinity_np(pthread_self(), sizeof one, &one), 0);
        CHECK_EQ(pthread_create(&tid, NULL, bell_sleeper, &a), 0);
        uint64_t t0 = shm_now_ns();
        /* this thread runs while the waiter spins only if the spin yields */
        while (atomic_load(&g_yields) == y0) {
            CHECK_MSG(shm_now_ns() - t0 < PROMPT_NS,
                      "a %s spin of 500 ms never gave its CPU away",
                      yield ? "yielding" : "plain");
            sched_yield();
        }
        answer_all(s, 1);
        CHECK_EQ(pthread_join(tid, NULL), 0);
        CHECK_EQ(pthread_setaffinity_np(pthread_self(), sizeof all, &all), 0);
        CHECK_EQ(a.rc, SLOT_DONE);
        CHECK_MSG(!(word_of(s, 0, 0) & SLOT_WAITER),
                  "a %s spin of 500 ms slept before its answer",
                  yield ? "yielding" : "plain");
        CHECK_EQ(t_release(s, 0, 0), SHM_OK);
    }
    /* not answered within a 10 ms budget: the waiter goes to sleep (it
     * announces WAITER) and its answer still wakes it */
    {
        bell_arg a = {s, 1, 10000 * MS, 0, 0, 0, NULL, 0,
                      (10 * MS) | SHM_SPIN_YIELD};
        pthread_t tid;
        CHECK_EQ(t_begin(s, 1, 0), SHM_OK);
        t_publish(s, 1, 0);
        CHECK_EQ(pthread_create(&tid, NULL, bell_sleeper, &a), 0);
        uint64_t t0 = shm_now_ns();
        while (!(word_of(s, 1, 0) & SLOT_WAITER)) {
            CHECK_MSG(shm_now_ns() - t0 < PROMPT_NS,
                      "a yielding spin of 10 ms was still spinning after %.1f s",
                      secs(PROMPT_NS));
            sleep_ns(1 * MS);
        }
        CHECK(!atomic_load(&a.returned));
        answer_all(s, 1);
        t0 = shm_now_ns();
        while (!atomic_load(&a.returned))
            CHECK_MSG(shm_now_ns() - t0 < PROMPT_NS, "the answer did not wake it");
        CHECK_EQ(pthread_join(tid, NULL), 0);
        CHECK_EQ(a.rc, SLOT_DONE);
        CHECK_EQ(t_release(s, 1, 0), SHM_OK);
    }
    /* the evaluator: a spin of 10 ms (yielding, or plain), then a sleep
     * until its 300 ms timeout; it yields, and uses far less CPU than
     * 300 ms */
    for (int yield = 0; yield < 2; yield++) {
        char batch[4 * 336];
        shm_taken taken[4];
        uint32_t cursor = 0;
        unsigned long y0 = atomic_load(&g_yields);
        uint64_t c0 = thread_cpu_ns();
        CHECK_EQ(t_collect(s, batch, taken, 4, &cursor,
                             (10 * MS) | (yield ? SHM_SPIN_YIELD : 0), 0,
                             300 * MS), 0);
        uint64_t cpu = thread_cpu_ns() - c0;
        CHECK_MSG(atomic_load(&g_yields) > y0, "a %s collect never yielded",
                  yield ? "yielding" : "plain");
        CHECK_MSG(cpu < 150 * MS, "collect used %.1f ms of CPU in 300 ms",
                  (double)cpu / 1e6);
    }
    printf("  yield: yielding spins yield, answer, and sleep after their "
           "budget\n");
    seg_free(&ts);
}

/* The spin policy, case by case: a plain spin while every process has a
 * CPU, a yielding one with one process more, none beyond; the evaluator
 * counts itself with its clients, a client counts at least the crowding
 * the evaluator published. */
static void test_spin_policy(void) {
    start_test("spin_policy", 10);
    const uint64_t S = 50 * US, Y = SHM_SPIN_YIELD;
    struct {
        uint32_t processes, ncpu;
        uint64_t want;
    } cases[] = {
        {1, 1, S},     {1, 2, S},     {2, 2, S},     {3, 2, S | Y},
        {4, 2, 0},     {16, 2, 0},    {2, 1, S | Y}, {3, 1, 0},
        {8, 8, S},     {9, 8, S | Y}, {10, 8, 0},    {0, 4, S},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        CHECK_EQU(shm_spin_policy(S, cases[i].processes, cases[i].ncpu),
                  cases[i].want);
        /* no budget, no spin, whatever the machine */
        CHECK_EQU(shm_spin_policy(0, cases[i].processes, cases[i].ncpu), 0);
    }
    /* the evaluator: its clients and itself */
    CHECK_EQU(shm_evaluator_spin(S, 1, 2), S);
    CHECK_EQU(shm_evaluator_spin(S, 2, 2), S | Y);
    CHECK_EQU(shm_evaluator_spin(S, 3, 2), 0);
    CHECK_EQU(shm_evaluator_spin(S, 0, 1), S);
    /* a client: the attached clients and the evaluator, raised to the
     * processes the crowding stands for (never lowered by it) */
    CHECK_EQU(shm_client_spin(S, 1, SHM_CROWD_NONE, 2), S);
    CHECK_EQU(shm_client_spin(S, 2, SHM_CROWD_NONE, 2), S | Y);
    CHECK_EQU(shm_client_spin(S, 1, SHM_CROWD_YIELD, 2), S | Y);
    CHECK_EQU(shm_client_spin(S, 1, SHM_CROWD_SLEEP, 2), 0);
    CHECK_EQU(shm_client_spin(S, 7, SHM_CROWD_YIELD, 4), 0);
    CHECK_EQU(shm_client_spin(S, 3, SHM_CROWD_YIELD, 4), S | Y);
    CHECK_EQU(shm_client_spin(0, 1, SHM_CROWD_NONE, 8), 0);
}

/* shm_copy: every byte of [dst, dst + n) copied, nothing outside it
 * touched, for sources and destinations at every kind of offset within a
 * cache line (the line-load path handles a head, whole 128-byte blocks and
 * a tail) and lengths around the threshold and the block size. */
static void test_copy(void) {
    start_test("copy", 60);
    enum { PAD = 256, MAXN = 24576 }; /* multiples of the line */
    static const size_t offs[] = {0, 1, 4, 8, 16, 31, 32, 33, 60, 63};
    static const size_t lens[] = {0,    1,    63,   64,   2047, 2048,
                                  2049, 2111, 2175, 2176, 4133, 24548};
    const size_t nofs = sizeof offs / sizeof offs[0];
    unsigned char *src = aligned_alloc(SHM_LINE, MAXN + PAD);
    unsigned char *dst = aligned_alloc(SHM_LINE, MAXN + 2 * PAD);
    CHECK(src && dst);
    uint64_t rng = g_seed;
    for (size_t i = 0; i < MAXN + PAD; i++) src[i] = (unsigned char)rng_next(&rng);
    unsigned cases = 0;
    for (size_t a = 0; a < nofs; a++)
        for (size_t b = 0; b < nofs; b++)
            for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++) {
                size_t n = lens[l];
                const unsigned char *from = src + offs[a];
                unsigned char *to = dst + PAD + offs[b];
                memset(dst, 0xA5, MAXN + 2 * PAD);
                shm_copy((char *)to, (const char *)from, n);
                CHECK_MSG(memcmp(to, from, n) == 0,
                          "shm_copy of %zu bytes, source at line offset %zu, "
                          "destination at %zu: the copy differs", n, offs[a],
                          offs[b]);
                for (unsigned char *p = dst; p < dst + MAXN + 2 * PAD; p++)
                    if (p < to || p >= to + n)
                        CHECK_MSG(*p == 0xA5,
                                  "shm_copy of %zu bytes (offsets %zu, %zu) "
                                  "wrote byte %td outside its destination",
                                  n, offs[a], offs[b], p - to);
                cases++;
            }
    free(src);
    free(dst);
#ifdef SHM_HAVE_LINE_COPY
    const char *path = __builtin_cpu_supports("avx2")
                           ? "AVX2 line loads from 2048 bytes, memcpy below"
                           : "memcpy (no AVX2 on this CPU)";
#else
    const char *path = "memcpy (no line-load path on this architecture)";
#endif
    printf("  copy: %u cases of offsets and lengths, by %s\n", cases, path);
}

/* ------------------------------------------------------------------ */
/* Chosen interleavings (SHM_HOOK) and generations                     */
/* ------------------------------------------------------------------ */

/* Arms hook h for the calling thread: it parks at its `nth` pass through
 * `point`. */
static void hook_arm(hook_t *h, const char *point, int nth) {
    h->point = point;
    h->left = nth;
    atomic_store(&h->state, 0);
    tl_hook = h;
}
/* Waits (at most 10 s) until h's thread is parked at its point. */
static void hook_wait_parked(hook_t *h) {
    uint64_t t0 = shm_now_ns();
    while (atomic_load(&h->state) != 1) {
        CHECK_MSG(shm_now_ns() - t0 < 10000 * MS, "no thread parked at %s",
                  h->point);
        sleep_ns(20 * US);
    }
}
/* Lets h's thread go and waits until it has resumed. */
static void hook_release(hook_t *h) {
    atomic_store(&h->state, 2);
    uint64_t t0 = shm_now_ns();
    while (atomic_load(&h->state) != 3) {
        CHECK_MSG(shm_now_ns() - t0 < 10000 * MS, "thread at %s did not resume",
                  h->point);
        sleep_ns(20 * US);
    }
}

/* The scheduler's state of thread tid of this process ('S' asleep, 'R'
 * running, ...). */
static char thread_state(pid_t tid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/self/task/%d/stat", (int)tid);
    FILE *f = fopen(path, "r");
    if (!f) return '?';
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    return p && p[1] && p[2] ? p[2] : '?';
}
/* Waits (at most 10 s) until thread *tid is asleep in the kernel. */
static void wait_asleep(_Atomic pid_t *tid) {
    uint64_t t0 = shm_now_ns();
    while (atomic_load(tid) == 0 || thread_state(atomic_load(tid)) != 'S') {
        CHECK_MSG(shm_now_ns() - t0 < 10000 * MS, "thread never went to sleep");
        sleep_ns(50 * US);
    }
    sleep_ns(1 * MS); /* asleep in the futex, not on its way through */
}

/* Publishes one request on slot (c, k) for process pid; returns its
 * generation. */
static uint32_t submit_one(shm_seg *s, uint32_t c, uint32_t k, int32_t pid,
                           unsigned char fill) {
    uint32_t gen = UINT32_MAX;
    CHECK_EQ(shm_slot_begin(s, c, k, pid, &gen), SHM_OK);
    memset(shm_slot_in(s, c, k), fill, s->p.in_bytes);
    t_publish(s, c, k);
    shm_notify_evaluator(s, 1);
    return gen;
}

/* Takes every ready request (at least one) and answers it with bytes
 * `fill`. */
static uint32_t answer_ready(shm_seg *s, unsigned char fill) {
    char batch[8 * 64], results[8 * 32];
    shm_taken taken[8];
    uint32_t cursor = 0;
    CHECK(s->p.in_bytes <= 64 && s->p.out_bytes <= 32 && s->p.max_batch <= 8);
    int n = t_collect(s, batch, taken, s->p.max_batch, &cursor, 0, 0,
                        1000 * MS);
    CHECK_MSG(n > 0, "nothing to answer (collect returned %d)", n);
    memset(results, fill, sizeof results);
    return shm_complete(s, taken, (uint32_t)n, results, 0);
}

/* An evaluator thread that answers until closed; with park_nth it parks at
 * that pass between announcing a sleep and FUTEX_WAIT. */
typedef struct {
    shm_seg *s;
    int park_nth;
    hook_t hook;
    _Atomic pid_t tid;
    _Atomic uint32_t served;
} ev_arg;

static void *ev_loop(void *arg) {
    ev_arg *a = arg;
    char batch[8 * 64], results[8 * 32];
    shm_taken taken[8];
    uint32_t cursor = 0;
    memset(results, 0x5A, sizeof results);
    if (a->park_nth) hook_arm(&a->hook, "collect_before_sleep", a->park_nth);
    atomic_store(&a->tid, (pid_t)syscall(SYS_gettid));
    for (;;) {
        int n = t_collect(a->s, batch, taken, a->s->p.max_batch, &cursor, 0,
                            0, g_sleep_ns);
        if (n == SHM_CLOSED) break;
        if (n <= 0) continue;
        shm_complete(a->s, taken, (uint32_t)n, results, 0);
        atomic_fetch_add(&a->served, (uint32_t)n);
    }
    return NULL;
}

typedef struct {
    shm_seg *s;
    hook_t hook;
    uint32_t c;
    int32_t pid;
    int rc;
} client_thread_arg;

/* Client A of test_lost_wakeup: parks in shm_notify_evaluator right after
 * reading ev_sleeping, then collects its answer. */
static void *late_notifier(void *arg) {
    client_thread_arg *a = arg;
    hook_arm(&a->hook, "notify_loaded", 1);
    uint32_t gen = submit_one(a->s, a->c, 0, a->pid, 0xA1);
    a->rc = shm_slot_wait(a->s, a->c, 0, gen, 0, 10000 * MS);
    if (a->rc == SLOT_DONE) CHECK_EQ(shm_slot_release(a->s, a->c, 0, gen), SHM_OK);
    return NULL;
}

/* The lost evaluator wake-up: a client reads ev_sleeping during one sleep
 * and acts on it during the next.  Client A reads the flag while the
 * evaluator sleeps (sleep 1) and is held there; client B wakes the
 * evaluator, which serves both, announces sleep 2 and is held between its
 * re-check and FUTEX_WAIT; A goes on (a wake that finds nobody), the
 * evaluator goes to sleep; then client C publishes.  C must be answered at
 * once: a client that cleared the flag it had read (the old protocol)
 * cleared sleep 2's announcement, and C then waited out the evaluator's
 * 10 s timeout. */
static void test_lost_wakeup(void) {
    start_test("lost_wakeup", 60);
    const shm_params P = mkparams(64, 32, 3, 1, 8);
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    for (int i = 0; i < 3; i++)
        CHECK_EQ(shm_client_register(s, 101 + i, 1, 0), i);
    ev_arg ev;
    memset(&ev, 0, sizeof ev);
    ev.s = s;
    ev.park_nth = 2;
    pthread_t te, ta;
    CHECK_EQ(pthread_create(&te, NULL, ev_loop, &ev), 0);
    wait_asleep(&ev.tid); /* sleep 1 */
    CHECK_EQ(atomic_load(&shm_hdr(s)->ev_sleeping), 1);

    client_thread_arg a = {.s = s, .c = 0, .pid = 101};
    CHECK_EQ(pthread_create(&ta, NULL, late_notifier, &a), 0);
    hook_wait_parked(&a.hook); /* A read ev_sleeping == 1 */

    uint32_t gb = submit_one(s, 1, 0, 102, 0xB2); /* B wakes it */
    CHECK_EQ(shm_slot_wait(s, 1, 0, gb, 0, 5000 * MS), SLOT_DONE);
    CHECK_EQ(shm_slot_release(s, 1, 0, gb), SHM_OK);
    hook_wait_parked(&ev.hook); /* sleep 2 announced, not yet in the kernel */

    hook_release(&a.hook); /* A's wake lands now, before sleep 2 */
    CHECK_EQ(pthread_join(ta, NULL), 0);
    CHECK_EQ(a.rc, SLOT_DONE);
    hook_release(&ev.hook);
    wait_asleep(&ev.tid); /* sleep 2, in the kernel */

    uint64_t t0 = shm_now_ns();
    uint32_t gc = submit_one(s, 2, 0, 103, 0xC3);
    CHECK_EQ(shm_slot_wait(s, 2, 0, gc, 0, 20000 * MS), SLOT_DONE);
    uint64_t lat = shm_now_ns() - t0;
    CHECK_EQ(shm_slot_release(s, 2, 0, gc), SHM_OK);
    CHECK_MSG(lat < PROMPT_NS,
              "client C waited %.3f s: the evaluator slept through its "
              "request (a lost wake-up)", secs(lat));
    printf("  lost_wakeup: C answered %.3f ms after publishing, the "
           "evaluator's sleep timeout is %.0f s\n", (double)lat / 1e6,
           secs(g_sleep_ns));
    shm_request_close(s);
    CHECK_EQ(pthread_join(te, NULL), 0);
    CHECK_EQ(atomic_load(&ev.served), 3);
    seg_free(&t);
}

/* A waiter held after setting WAITER and before reading its doorbell. */
typedef struct {
    shm_seg *s;
    hook_t hook;
    uint32_t gen;
    int rc;
    uint64_t ret_ns;
} reread_arg;

static void *held_waiter(void *arg) {
    reread_arg *a = arg;
    hook_arm(&a->hook, "wait_before_bell", 1);
    a->rc = shm_slot_wait(a->s, 0, 0, a->gen, 0, g_sleep_ns);
    a->ret_ns = shm_now_ns();
    return NULL;
}

/* The client's re-read of its state word after reading its doorbell: the
 * answer and its ring come between the waiter's WAITER CAS and its read of
 * the doorbell, so the value it reads already includes the ring.  It must
 * see the answer then, not sleep on that value until its timeout. */
static void test_reread(void) {
    start_test("reread", 60);
    const shm_params P = mkparams(64, 32, 1, 1, 8);
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    CHECK_EQ(shm_client_register(s, 201, 1, 0), 0);
    reread_arg a;
    memset(&a, 0, sizeof a);
    a.s = s;
    a.gen = submit_one(s, 0, 0, 201, 0x11);
    pthread_t tw;
    CHECK_EQ(pthread_create(&tw, NULL, held_waiter, &a), 0);
    hook_wait_parked(&a.hook);
    CHECK(shm_slot_peek(s, 0, 0) & SLOT_WAITER);
    CHECK_EQ(answer_ready(s, 0x22), 1); /* DONE, and the doorbell rung */
    uint64_t t0 = shm_now_ns();
    hook_release(&a.hook);
    CHECK_EQ(pthread_join(tw, NULL), 0);
    CHECK_EQ(a.rc, SLOT_DONE);
    CHECK_MSG(a.ret_ns - t0 < PROMPT_NS,
              "the waiter slept %.3f s on a doorbell already rung for it",
              secs(a.ret_ns - t0));
    CHECK_EQ(shm_slot_release(s, 0, 0, a.gen), SHM_OK);
    seg_free(&t);
}

/* A pipelined waiter: shm_slots_wait_any over n slots of client 0. */
typedef struct {
    shm_seg *s;
    hook_t hook;
    const char *park;            /* hook point, or NULL */
    uint32_t ks[4], gens[4], n, which;
    int rc;
    _Atomic pid_t tid;
    uint64_t ret_ns;
} any_arg;

static void *any_waiter(void *arg) {
    any_arg *a = arg;
    if (a->park) hook_arm(&a->hook, a->park, 1);
    atomic_store(&a->tid, (pid_t)syscall(SYS_gettid));
    a->rc = shm_slots_wait_any(a->s, 0, a->ks, a->gens, a->n, 0, g_sleep_ns,
                               NULL, &a->which);
    a->ret_ns = shm_now_ns();
    return NULL;
}

/* Completes the one request of `taken` (n of them) that sits in slot k. */
static void complete_slot(shm_seg *s, shm_taken *taken, int n, uint32_t k) {
    char res[32];
    memset(res, 0x5A, sizeof res);
    for (int i = 0; i < n; i++)
        if (taken[i].slot == k) {
            CHECK_EQU(shm_complete(s, &taken[i], 1, res, 1), 1u);
            return;
        }
    FAIL("slot %u is not in the batch", k);
}

/* Waiting for any of several slots (pipelined requests): every pending
 * slot carries WAITER, so an answer to any of them, not just the first,
 * wakes the one sleep; an answer that lands between the WAITER CAS and the
 * doorbell read is seen by the re-read; a reclaimed slot and a timeout end
 * the wait with their own codes. */
static void test_wait_any(void) {
    start_test("wait_any", 60);
    const shm_params P = mkparams(64, 32, 1, 4, 8);
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    CHECK_EQ(shm_client_register(s, 301, 1, 0), 0);
    uint32_t gens[3];
    for (uint32_t k = 0; k < 3; k++) gens[k] = submit_one(s, 0, k, 301, 0x30 + k);
    char batch[8 * 64];
    shm_taken taken[8];
    uint32_t cursor = 0;
    CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 1000 * MS), 3);

    /* 1. answered between the WAITER CAS and the doorbell read */
    any_arg a;
    memset(&a, 0, sizeof a);
    a.s = s;
    a.park = "wait_before_bell";
    a.n = 3;
    for (uint32_t i = 0; i < 3; i++) {
        a.ks[i] = i;
        a.gens[i] = gens[i];
    }
    pthread_t tw;
    CHECK_EQ(pthread_create(&tw, NULL, any_waiter, &a), 0);
    hook_wait_parked(&a.hook);
    for (uint32_t k = 0; k < 3; k++)
        CHECK_MSG(shm_slot_peek(s, 0, k) & SLOT_WAITER,
                  "slot %u has no WAITER bit while its client sleeps", k);
    complete_slot(s, taken, 3, 2);
    uint64_t t0 = shm_now_ns();
    hook_release(&a.hook);
    CHECK_EQ(pthread_join(tw, NULL), 0);
    CHECK_EQ(a.rc, SLOT_DONE);
    CHECK_EQU(a.which, 2u);
    CHECK_MSG(a.ret_ns - t0 < PROMPT_NS,
              "wait_any slept %.3f s on a doorbell already rung for it",
              secs(a.ret_ns - t0));
    CHECK_EQ(shm_slot_release(s, 0, 2, gens[2]), SHM_OK);

    /* 2. asleep over slots 0 and 1: the answer to slot 1 wakes it */
    memset(&a, 0, sizeof a);
    a.s = s;
    a.n = 2;
    a.ks[0] = 0, a.ks[1] = 1;
    a.gens[0] = gens[0], a.gens[1] = gens[1];
    CHECK_EQ(pthread_create(&tw, NULL, any_waiter, &a), 0);
    wait_asleep(&a.tid);
    t0 = shm_now_ns();
    complete_slot(s, taken, 3, 1);
    CHECK_EQ(pthread_join(tw, NULL), 0);
    CHECK_EQ(a.rc, SLOT_DONE);
    CHECK_EQU(a.which, 1u);
    CHECK_MSG(a.ret_ns - t0 < PROMPT_NS,
              "the answer to the second slot left its waiter asleep %.3f s",
              secs(a.ret_ns - t0));
    CHECK_EQ(shm_slot_release(s, 0, 1, gens[1]), SHM_OK);

    /* 3. a slot of another generation (reclaimed): SHM_STALE, its index */
    uint32_t ks[2] = {0, 1}, gg[2] = {gens[0], gens[1]}, which = 9;
    CHECK_EQ(shm_slots_wait_any(s, 0, ks, gg, 2, 0, 10 * MS, NULL, &which),
             SHM_STALE);
    CHECK_EQU(which, 1u);
    /* 4. nothing answered: a timeout, and which = n */
    CHECK_EQ(shm_slots_wait_any(s, 0, ks, gg, 1, 0, 20 * MS, NULL, &which),
             SHM_TIMEOUT);
    CHECK_EQU(which, 1u);
    complete_slot(s, taken, 3, 0);
    CHECK_EQ(shm_slots_wait_any(s, 0, ks, gg, 1, 0, 20 * MS, NULL, &which),
             SLOT_DONE);
    CHECK_EQU(which, 0u);
    CHECK_EQ(shm_slot_release(s, 0, 0, gens[0]), SHM_OK);
    seg_free(&t);
}

/* ------------------------------------------------------------------ */
/* The evaluation cache                                                */
/* ------------------------------------------------------------------ */

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

/* A replica's published report (shm_report_write/read): a reader gets the
 * whole of one write or nothing, never a mix of two, whether the writer is
 * stopped half-way or writes all the time. */
typedef struct {
    shm_seg *s;
    hook_t hook;
    const char *text;
    uint64_t len;
    int rounds;
    _Atomic int stop;
} report_arg;

static void *held_report_writer(void *arg) {
    report_arg *a = arg;
    hook_arm(&a->hook, "report_write_half", 1);
    shm_report_write(a->s, 0, a->text, a->len);
    return NULL;
}

static void *busy_report_writer(void *arg) {
    report_arg *a = arg;
    for (int i = 0; !atomic_load(&a->stop); i++) {
        shm_report_write(a->s, 0, i & 1 ? a->text : a->text + 1, a->len);
        if (i % 4 == 0) sched_yield(); /* let some reads through whole */
    }
    return NULL;
}

static void test_report(void) {
    start_test("report", 60);
    shm_params P = mkparams(64, 32, 1, 1, 8);
    P.replicas = 2;
    P.servers = 2;
    test_seg t;
    seg_make(&t, &P);
    shm_seg *s = &t.s;
    static char a[3001], b[3001], buf[8 * SHM_REPORT_WORDS];
    for (int i = 0; i < 3000; i++) {
        a[i] = (char)('a' + i % 7);
        b[i] = (char)('A' + i % 11);
    }
    CHECK_EQ(shm_report_read(s, 0, buf, sizeof buf), 0); /* none yet */
    shm_report_write(s, 0, a, 3000);
    CHECK_EQ(shm_report_read(s, 0, buf, sizeof buf), 3000);
    CHECK(memcmp(buf, a, 3000) == 0);
    CHECK_EQ(shm_report_read(s, 1, buf, sizeof buf), 0); /* its own entry */

    report_arg w = {.s = s, .text = b, .len = 2000};
    pthread_t tw;
    CHECK_EQ(pthread_create(&tw, NULL, held_report_writer, &w), 0);
    hook_wait_parked(&w.hook); /* half of b written over a */
    int64_t n = shm_report_read(s, 0, buf, sizeof buf);
    CHECK_MSG(n == -1, "a reader took a half-written report (%" PRId64 " bytes)", n);
    hook_release(&w.hook);
    CHECK_EQ(pthread_join(tw, NULL), 0);
    CHECK_EQ(shm_report_read(s, 0, buf, sizeof buf), 2000);
    CHECK(memcmp(buf, b, 2000) == 0);

    /* A writer that never stops: each copy a reader keeps is one write. */
    static char ab[3002];
    for (int i = 0; i < 3001; i++) ab[i] = (char)('0' + i % 10);
    report_arg busy = {.s = s, .text = ab, .len = 3000};
    shm_report_write(s, 0, ab, 3000);
    CHECK_EQ(pthread_create(&tw, NULL, busy_report_writer, &busy), 0);
    uint32_t kept = 0;
    for (int i = 0; i < 20000; i++) {
        n = shm_report_read(s, 0, buf, sizeof buf);
        if (n < 0) continue;
        CHECK_EQ(n, 3000);
        CHECK_MSG(memcmp(buf, ab, 3000) == 0 || memcmp(buf, ab + 1, 3000) == 0,
                  "a reader kept a mix of two writes");
        kept++;
    }
    atomic_store(&busy.stop, 1);
    CHECK_EQ(pthread_join(tw, NULL), 0);
    printf("  report: %u of 20000 reads kept under a busy writer\n", kept);
    /* longer than the entry holds: cut */
    static char big[8 * SHM_REPORT_WORDS + 100];
    memset(big, 'x', sizeof big);
    shm_report_write(s, 1, big, sizeof big);
    CHECK_EQ(shm_report_read(s, 1, buf, sizeof buf), (int64_t)(8 * SHM_REPORT_WORDS));
    seg_free(&t);
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

/* A client that got its answer and copied it, held before its release. */
typedef struct {
    shm_seg *s;
    hook_t hook;
    uint32_t gen;
    int wait_rc, release_rc;
    unsigned char copy[32];
} release_arg;

static void *held_releaser(void *arg) {
    release_arg *a = arg;
    hook_arm(&a->hook, "release_begin", 1);
    a->wait_rc = shm_slot_wait(a->s, 0, 0, a->gen, 0, 5000 * MS);
    memcpy(a->copy, shm_slot_out(a->s, 0, 0), sizeof a->copy);
    a->release_rc = shm_slot_release(a->s, 0, 0, a->gen);
    return NULL;
}

/* A release racing a reclaim: process X copied its answer and is held
 * before its release while its entry is detached, reclaimed, claimed by
 * process Y and Y's request answered in the same slot.  X's release must
 * report SHM_STALE (its copy may be torn or Y's) and leave Y's answer
 * alone; a release that did not name its generation freed Y's DONE slot,
 * and Y then waited for ever. */
static void test_release_race(void) {
    start_test("release_race", 60);
    const shm_params P = mkparams(64, 32, 1, 1, 8);
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    CHECK_EQ(shm_client_register(s, 301, 1, 0), 0);
    release_arg x;
    memset(&x, 0, sizeof x);
    x.s = s;
    x.gen = submit_one(s, 0, 0, 301, 0x31);
    CHECK_EQ(answer_ready(s, 'X'), 1);
    pthread_t tx;
    CHECK_EQ(pthread_create(&tx, NULL, held_releaser, &x), 0);
    hook_wait_parked(&x.hook);
    CHECK_EQ(x.wait_rc, SLOT_DONE);
    CHECK_EQ(x.copy[0], 'X');

    shm_client_detach(s, 0);
    CHECK_EQ(shm_client_reclaim(s, 0), 0);
    CHECK_EQ(shm_client_register(s, 302, 1, 0), 0);
    uint32_t gy = submit_one(s, 0, 0, 302, 0x32);
    CHECK(gy != x.gen);
    CHECK_EQ(answer_ready(s, 'Y'), 1);

    hook_release(&x.hook);
    CHECK_EQ(pthread_join(tx, NULL), 0);
    CHECK_EQ(x.release_rc, SHM_STALE);
    CHECK_EQU(shm_slot_peek(s, 0, 0), shm_slot_word(SLOT_DONE, gy));
    CHECK_EQ(shm_slot_wait(s, 0, 0, gy, 0, 1000 * MS), SLOT_DONE);
    CHECK_EQ(((unsigned char *)shm_slot_out(s, 0, 0))[0], 'Y');
    CHECK_EQ(shm_slot_release(s, 0, 0, gy), SHM_OK);
    seg_free(&t);
}

typedef struct {
    shm_seg *s;
    hook_t hook;
    int rc;
} begin_arg;

static void *held_beginner(void *arg) {
    begin_arg *a = arg;
    uint32_t gen;
    hook_arm(&a->hook, "begin_loaded", 1);
    a->rc = shm_slot_begin(a->s, 0, 0, 401, &gen);
    return NULL;
}

/* Two beginners of one FREE slot (two processes on one entry, which a
 * reclaim of a closed handle's entry can produce): one is held after
 * reading FREE, the other begins the slot.  Only one may have it. */
static void test_begin_race(void) {
    start_test("begin_race", 60);
    const shm_params P = mkparams(64, 32, 1, 1, 8);
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    CHECK_EQ(shm_client_register(s, 401, 1, 0), 0);
    begin_arg b = {.s = s};
    pthread_t tb;
    CHECK_EQ(pthread_create(&tb, NULL, held_beginner, &b), 0);
    hook_wait_parked(&b.hook);
    uint32_t gen;
    CHECK_EQ(shm_slot_begin(s, 0, 0, 401, &gen), SHM_OK);
    hook_release(&b.hook);
    CHECK_EQ(pthread_join(tb, NULL), 0);
    CHECK_MSG(b.rc == SHM_E_STATE,
              "both beginners got the slot (the held one returned %d)", b.rc);
    seg_free(&t);
}

typedef struct {
    shm_seg *s;
    hook_t hook;
    int rc;
} register_arg;

static void *held_registrant(void *arg) {
    register_arg *a = arg;
    hook_arm(&a->hook, "register_claimed", 1);
    a->rc = shm_client_register(a->s, 601, 1, 0);
    return NULL;
}

/* A claimer killed right after its claim leaves an entry that the
 * evaluator's housekeeping still covers: the high-water mark and the
 * attached count already include it when the claim happens. */
static void test_hwm_first(void) {
    start_test("hwm_first", 60);
    const shm_params P = mkparams(64, 32, 4, 1, 8);
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    register_arg r = {.s = s};
    pthread_t tr;
    CHECK_EQ(pthread_create(&tr, NULL, held_registrant, &r), 0);
    hook_wait_parked(&r.hook);
    CHECK_EQ(atomic_load(&shm_client_at(s, 0)->owner_pid), 601);
    CHECK_MSG(shm_clients_hwm(s) >= 1,
              "entry 0 is claimed but above the high-water mark: a claimer "
              "killed now would leave it where housekeeping never looks");
    CHECK_EQ(shm_n_attached(s), 1);
    hook_release(&r.hook);
    CHECK_EQ(pthread_join(tr, NULL), 0);
    CHECK_EQ(r.rc, 0);
    seg_free(&t);
}

/* Generations and owners: every client-side step names the generation its
 * request began with, and an entry that was reclaimed is no longer its
 * former owner's. */
static void test_generations(void) {
    start_test("generations", 60);
    const shm_params P = mkparams(64, 32, 1, 1, 8);
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    uint32_t gen;
    CHECK_EQ(shm_client_register(s, 501, 1, 0), 0);
    CHECK_EQ(shm_slot_begin(s, 0, 0, 999, &gen), SHM_STALE); /* not the owner */
    uint32_t g = submit_one(s, 0, 0, 501, 0x51);
    /* The entry is detached and, between batches, reclaimed: the request is
     * dropped, and its waiter learns it at once rather than at a timeout. */
    shm_client_detach(s, 0);
    CHECK_EQ(shm_client_reclaim(s, 0), 0);
    uint64_t t0 = shm_now_ns();
    CHECK_EQ(shm_slot_wait(s, 0, 0, g, 0, 10000 * MS), SHM_STALE);
    CHECK(shm_now_ns() - t0 < PROMPT_NS);
    CHECK_EQ(shm_slot_wait(s, 0, 0, g, 1 * MS, 10000 * MS), SHM_STALE);
    CHECK_EQ(shm_slot_release(s, 0, 0, g), SHM_STALE);
    /* Claimed by another process, the entry refuses its former owner. */
    CHECK_EQ(shm_client_register(s, 502, 1, 0), 0);
    CHECK_EQ(shm_slot_begin(s, 0, 0, 501, &gen), SHM_STALE);
    uint32_t g2 = submit_one(s, 0, 0, 502, 0x52);
    CHECK_EQ(g2, (g + 1) & SLOT_GEN_MASK);
    CHECK_EQ(shm_slot_release(s, 0, 0, g2), SHM_E_STATE); /* in flight */
    CHECK_EQ(answer_ready(s, 0x62), 1);
    CHECK_EQ(shm_slot_release(s, 0, 0, g), SHM_STALE);
    CHECK_EQ(shm_slot_wait(s, 0, 0, g2, 0, 1000 * MS), SLOT_DONE);
    CHECK_EQ(shm_slot_release(s, 0, 0, g2), SHM_OK);
    CHECK_EQ(shm_slot_release(s, 0, 0, g2), SHM_STALE); /* only once */
    /* Reclaiming refuses an entry whose slot is in a batch in flight. */
    uint32_t g3 = submit_one(s, 0, 0, 502, 0x53);
    char batch[64];
    shm_taken taken[1];
    uint32_t cursor = 0;
    CHECK_EQ(t_collect(s, batch, taken, 1, &cursor, 0, 0, 100 * MS), 1);
    shm_client_detach(s, 0);
    uint32_t before = shm_slot_peek(s, 0, 0);
    CHECK_EQ(shm_client_reclaim(s, 0), SHM_E_STATE);
    CHECK_EQU(shm_slot_peek(s, 0, 0), before);
    CHECK_EQ(atomic_load(&shm_client_at(s, 0)->owner_pid), 502);
    char out[32];
    memset(out, 0x63, sizeof out);
    CHECK_EQ(shm_complete(s, taken, 1, out, 0), 1);
    CHECK_EQ(shm_client_reclaim(s, 0), 0);
    CHECK_EQU(shm_slot_peek(s, 0, 0), shm_slot_word(SLOT_FREE, g3 + 1));
    seg_free(&t);
}

/* The spec is read once at attach: a peer rewriting the header afterwards
 * (spec_len included) changes nothing this process reads. */
static void test_spec_once(void) {
    start_test("spec_once", 10);
    const shm_params P = mkparams(64, 32, 1, 1, 8);
    test_seg t;
    seg_make(&t, &P);
    shm_seg s2;
    CHECK_EQ(shm_attach(&s2, t.mem, t.size), SHM_OK);
    shm_header *h = shm_hdr(&s2);
    h->spec_len = UINT32_MAX;
    memset(h->spec, 'z', 16);
    uint32_t len;
    const char *sp = shm_spec(&s2, &len);
    CHECK_EQ(len, strlen(k_spec));
    CHECK(memcmp(sp, k_spec, len) == 0);
    seg_free(&t);
}

/* The hand-over of a client entry under ThreadSanitizer: process A writes
 * its slot's input and detaches; the evaluator reclaims the entry; process
 * B claims it and writes the same input area.  The only order between A's
 * writes and B's is the protocol's (A's release store of detached, the
 * evaluator's acquire load of it, its release store of owner_pid = 0, B's
 * acquiring claim): weaken any of them and TSan reports a race on the
 * input bytes.  The threads are all started first and wait for each other
 * with relaxed loads only, so that thread creation and joining order
 * nothing. */
typedef struct {
    shm_seg *s;
    _Atomic int a_claimed;
} handover_arg;

static void *handover_a(void *arg) {
    handover_arg *x = arg;
    shm_seg *s = x->s;
    uint32_t gen;
    CHECK_EQ(shm_client_register(s, 701, 1, 0), 0);
    /* MO: relaxed; see handover_b. */
    atomic_store_explicit(&x->a_claimed, 1, memory_order_relaxed);
    CHECK_EQ(shm_slot_begin(s, 0, 0, 701, &gen), SHM_OK);
    memset(shm_slot_in(s, 0, 0), 0xA1, s->p.in_bytes);
    shm_client_detach(s, 0);
    return NULL;
}

static void *handover_b(void *arg) {
    handover_arg *x = arg;
    shm_seg *s = x->s;
    uint32_t gen;
    uint64_t t0 = shm_now_ns();
    /* MO: relaxed: no order may come from the test itself (B waits only so
     * that A claims the entry first). */
    while (!atomic_load_explicit(&x->a_claimed, memory_order_relaxed)) {
        CHECK(shm_now_ns() - t0 < 10000 * MS);
        sched_yield();
    }
    int c;
    while ((c = shm_client_register(s, 702, 1, 0)) == SHM_E_FULL) {
        CHECK(shm_now_ns() - t0 < 10000 * MS);
        sched_yield();
    }
    CHECK_EQ(c, 0);
    CHECK_EQ(shm_slot_begin(s, 0, 0, 702, &gen), SHM_OK);
    memset(shm_slot_in(s, 0, 0), 0xB2, s->p.in_bytes);
    return NULL;
}

static void test_handover(void) {
    start_test("handover", 60);
    const shm_params P = mkparams(64, 32, 1, 1, 8);
    for (int round = 0; round < 20; round++) {
        test_seg t;
        shm_seg *s = serving_seg(&t, &P);
        handover_arg a = {.s = s};
        pthread_t ta, tb;
        CHECK_EQ(pthread_create(&ta, NULL, handover_a, &a), 0);
        CHECK_EQ(pthread_create(&tb, NULL, handover_b, &a), 0);
        uint64_t st, pid_ns, t0 = shm_now_ns();
        uint32_t det = 0;
        while (shm_client_info(s, 0, &st, &pid_ns, &det) != 701 || !det) {
            CHECK(shm_now_ns() - t0 < 10000 * MS);
            sched_yield();
        }
        CHECK_EQ(shm_client_reclaim(s, 0), 1); /* the slot was WRITING */
        CHECK_EQ(pthread_join(ta, NULL), 0);
        CHECK_EQ(pthread_join(tb, NULL), 0);
        CHECK_EQ(((unsigned char *)shm_slot_in(s, 0, 0))[0], 0xB2);
        seg_free(&t);
    }
}

/* Why it stopped: the first reason recorded wins, and the final state
 * follows from it, whoever stores it. */
static void test_stop_reason(void) {
    start_test("stop_reason", 10);
    const shm_params P = mkparams(64, 32, 1, 1, 8);
    int32_t detail;
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    CHECK_EQ(shm_stop_reason(s, &detail), SHM_STOP_NONE);
    shm_close_and_wake(s, SHM_STOP_CRASHED, 0);
    CHECK_EQ(shm_ev_state(s), EV_DIED);
    shm_close_and_wake(s, SHM_STOP_CLOSED, 0); /* the owner's close, later */
    CHECK_EQ(shm_ev_state(s), EV_DIED);
    CHECK_EQ(shm_stop_reason(s, &detail), SHM_STOP_CRASHED);
    seg_free(&t);
    s = serving_seg(&t, &P);
    shm_close_and_wake(s, SHM_STOP_EXITED, -9);
    CHECK_EQ(shm_ev_state(s), EV_DIED);
    CHECK_EQ(shm_stop_reason(s, &detail), SHM_STOP_EXITED);
    CHECK_EQ(detail, -9);
    seg_free(&t);
    s = serving_seg(&t, &P);
    shm_close_and_wake(s, SHM_STOP_CLOSED, 0);
    CHECK_EQ(shm_ev_state(s), EV_CLOSED);
    CHECK_EQ(shm_stop_reason(s, &detail), SHM_STOP_CLOSED);
    seg_free(&t);
}

/* ------------------------------------------------------------------ */
/* Several replicas on one segment                                     */
/* ------------------------------------------------------------------ */

#define REP_IN 64   /* bytes of a request: (client thread, request number) */
#define REP_OUT 32

typedef struct rep_ctx rep_ctx;

typedef struct {
    rep_ctx *x;
    uint32_t v;            /* server index (replica r == v here) */
    int die_after;         /* batches before it dies: 0 = never */
    int die_locked;        /* it dies holding the collect lock */
    _Atomic int dead;      /* set when it has "died" */
    uint64_t answered;
    pthread_t tid;
} rep_server;

struct rep_ctx {
    shm_seg *s;
    uint32_t nclients, nreq;
    _Atomic uint32_t *counts;     /* answers per request */
    rep_server servers[2];
};

static void rep_answer(const char *in, char *out) {
    uint32_t th, req;
    memcpy(&th, in, 4);
    memcpy(&req, in + 4, 4);
    uint64_t v = (uint64_t)th * 1000003u + req;
    memset(out, 0, REP_OUT);
    memcpy(out, &v, 8);
}

/* A replica's serving thread: take turns collecting under the collect
 * lock, answer outside it; it may "die" (stop without finishing its batch,
 * or while holding the lock) as a killed replica process would. */
static void *rep_serve(void *arg) {
    rep_server *me = arg;
    shm_seg *s = me->x->s;
    char batch[8 * REP_IN], out[8 * REP_OUT];
    shm_taken taken[8];
    uint32_t cursor = 0;
    int batches = 0;
    /* The survivor starts once the other replica has died: the dying one
     * must serve its die_after batches first, which a loaded machine could
     * otherwise give all to the survivor (the housekeeping then waits for
     * a death that never comes). */
    rep_server *other = &me->x->servers[1 - me->v];
    if (other->die_after)
        while (!atomic_load(&other->dead)) sleep_ns(100 * US);
    for (;;) {
        int rc = shm_collect_lock(s, me->v, 100 * MS);
        if (rc == SHM_TIMEOUT) {
            int holder = shm_collect_holder(s);
            if (holder >= 0 && atomic_load(&me->x->servers[holder].dead)) {
                CHECK_EQ(shm_collect_steal(s, me->v, (uint32_t)holder), SHM_OK);
            } else {
                continue;
            }
        }
        if (me->die_locked && batches == me->die_after) {
            atomic_store(&me->dead, 1); /* dies holding the lock */
            return NULL;
        }
        int n = shm_collect(s, me->v, taken, batch, 8, &cursor, 0, 0, 20 * MS);
        shm_collect_unlock(s);
        if (n == SHM_CLOSED) break;
        CHECK(n >= 0);
        if (n == 0) continue;
        if (me->die_after && !me->die_locked && ++batches == me->die_after) {
            atomic_store(&me->dead, 1); /* dies with its batch TAKEN */
            return NULL;
        }
        batches += me->die_locked != 0;
        for (int i = 0; i < n; i++) {
            uint32_t th, req;
            memcpy(&th, batch + i * REP_IN, 4);
            memcpy(&req, batch + i * REP_IN + 4, 4);
            atomic_fetch_add(&me->x->counts[th * me->x->nreq + req], 1);
            rep_answer(batch + i * REP_IN, out + i * REP_OUT);
        }
        CHECK_EQU(shm_complete(s, taken, (uint32_t)n, out, me->v + 1), (uint32_t)n);
        shm_server_set_n(s, me->v, 0);
        me->answered += (uint64_t)n;
    }
    return NULL;
}

typedef struct {
    rep_ctx *x;
    uint32_t th;
    pthread_t tid;
} rep_client;

static void *rep_client_main(void *arg) {
    rep_client *a = arg;
    shm_seg *s = a->x->s;
    int32_t pid = 30000 + (int32_t)a->th;
    uint32_t c = (uint32_t)shm_client_register(s, pid, 1, 0);
    for (uint32_t req = 0; req < a->x->nreq; req++) {
        uint32_t gen;
        CHECK_EQ(shm_slot_begin(s, c, 0, pid, &gen), SHM_OK);
        char *in = shm_slot_in(s, c, 0);
        memcpy(in, &a->th, 4);
        memcpy(in + 4, &req, 4);
        t_publish(s, c, 0);
        shm_notify_evaluator(s, 1);
        int rc;
        uint64_t t0 = shm_now_ns();
        while ((rc = shm_slot_wait(s, c, 0, gen, 0, 200 * MS)) == SHM_TIMEOUT)
            CHECK_MSG(shm_now_ns() - t0 < 10000 * MS,
                      "client %u request %u: no answer in 10 s", a->th, req);
        CHECK_EQ(rc, SLOT_DONE);
        uint64_t want = (uint64_t)a->th * 1000003u + req, got;
        memcpy(&got, shm_slot_out(s, c, 0), 8);
        CHECK_MSG(got == want, "client %u request %u: answer %" PRIu64
                  ", not its own %" PRIu64, a->th, req, got, want);
        CHECK_EQ(shm_slot_release(s, c, 0, gen), SHM_OK);
    }
    return NULL;
}

/* Two replicas (one server each) serve four clients through one segment:
 * every request is answered exactly once, with its own answer; then the
 * same while replica 1 dies with a batch in flight, and while it dies
 * holding the collect lock: its requests are put back (shm_requeue) or
 * its lock taken over (shm_collect_steal), and replica 0 answers all. */
static void rep_run(int die_after, int die_locked) {
    shm_params P = with_replicas(mkparams(REP_IN, REP_OUT, 4, 1, 8), 2, 2);
    test_seg t;
    seg_make(&t, &P);
    shm_seg *s = &t.s;
    rep_ctx x;
    memset(&x, 0, sizeof x);
    x.s = s;
    x.nclients = 4;
    x.nreq = g_slow ? 300 : 2000;
    x.counts = calloc((size_t)x.nclients * x.nreq, sizeof *x.counts);
    CHECK(x.counts != NULL);
    for (uint32_t r = 0; r < 2; r++) {
        shm_server_init(s, r, r);
        CHECK_EQ(shm_set_serving(s, r, 40000 + (int32_t)r, 1,
                                 r ? "cpu:1" : "cpu:0"),
                 EV_SERVING);
        x.servers[r].x = &x;
        x.servers[r].v = r;
    }
    x.servers[1].die_after = die_after;
    x.servers[1].die_locked = die_locked;
    for (uint32_t r = 0; r < 2; r++)
        CHECK_EQ(pthread_create(&x.servers[r].tid, NULL, rep_serve,
                                &x.servers[r]), 0);
    rep_client cl[4];
    for (uint32_t i = 0; i < 4; i++) {
        cl[i].x = &x;
        cl[i].th = i;
        CHECK_EQ(pthread_create(&cl[i].tid, NULL, rep_client_main, &cl[i]), 0);
    }
    if (die_after) {
        /* Housekeeping, as another replica does it: finds replica 1 dead,
         * marks it so (once), puts its batch back and rings the doorbell. */
        uint64_t t0 = shm_now_ns();
        while (!atomic_load(&x.servers[1].dead)) {
            CHECK(shm_now_ns() - t0 < 10000 * MS);
            sleep_ns(100 * US);
        }
        CHECK_EQ(shm_replica_stop(s, 1, REPLICA_DEAD, 0), 1);
        CHECK_EQ(shm_replica_stop(s, 1, REPLICA_DEAD, 0), -1); /* only once */
        uint32_t back = shm_requeue(s, 1);
        if (die_locked) CHECK_EQU(back, 0);
        else CHECK(back >= 1);
        if (back) shm_notify_evaluator(s, back);
    }
    for (uint32_t i = 0; i < 4; i++) CHECK_EQ(pthread_join(cl[i].tid, NULL), 0);
    shm_request_close(s);
    for (uint32_t r = 0; r < 2; r++)
        CHECK_EQ(pthread_join(x.servers[r].tid, NULL), 0);
    uint64_t total = 0;
    for (uint64_t i = 0; i < (uint64_t)x.nclients * x.nreq; i++) {
        CHECK_MSG(x.counts[i] >= 1, "request %" PRIu64 " never answered", i);
        total += x.counts[i];
    }
    /* A dying replica's batch was computed by it but never delivered: those
     * requests are computed twice, answered once. */
    CHECK(total >= (uint64_t)x.nclients * x.nreq);
    /* (How the work splits between the replicas is the scheduler's: on a
     * loaded machine one may take every batch; the counts are printed.) */
    if (!die_after) CHECK_EQU(total, (uint64_t)x.nclients * x.nreq);
    printf("  replicas: die_after %d%s: replica answers %" PRIu64 " + %" PRIu64
           "\n", die_after, die_locked ? " (holding the lock)" : "",
           x.servers[0].answered, x.servers[1].answered);
    free(x.counts);
    seg_free(&t);
}

static void test_replicas(void) {
    start_test("replicas", 120);
    /* the lock, its holder and taking it over */
    shm_params P = with_replicas(mkparams(REP_IN, REP_OUT, 4, 1, 8), 2, 2);
    test_seg t;
    seg_make(&t, &P);
    shm_seg *s = &t.s;
    CHECK_EQ(shm_collect_holder(s), -1);
    CHECK_EQ(shm_collect_lock(s, 0, 10 * MS), SHM_OK);
    CHECK_EQ(shm_collect_holder(s), 0);
    CHECK_EQ(shm_collect_lock(s, 1, 5 * MS), SHM_TIMEOUT);
    CHECK_EQ(shm_collect_steal(s, 1, 1), SHM_E_STATE); /* 1 does not hold it */
    CHECK_EQ(shm_collect_steal(s, 1, 0), SHM_OK);
    CHECK_EQ(shm_collect_holder(s), 1);
    shm_collect_unlock(s);
    CHECK_EQ(shm_collect_holder(s), -1);
    CHECK_EQ(shm_collect_lock(s, 1, 10 * MS), SHM_OK);
    shm_collect_unlock(s);
    /* the weights floor */
    CHECK_EQ(shm_version_ok(s, 2), 1);
    CHECK_EQ(shm_version_ok(s, 1), 1); /* nobody serves the floor */
    CHECK_EQ(shm_version_ok(s, 2), 1);
    CHECK_EQ(shm_version_ok(s, 3), 1);
    CHECK_EQ(shm_version_ok(s, 2), 1);
    seg_free(&t);

    rep_run(0, 0);
    rep_run(5, 0);
    rep_run(3, 1);
}

typedef struct {
    shm_seg *s;
    uint32_t gen;
    int rc;
    uint64_t ns;
} slot_waiter_arg;

static void *slot_waiter(void *arg) {
    slot_waiter_arg *a = arg;
    uint64_t t0 = shm_now_ns();
    a->rc = shm_slot_wait(a->s, 0, 0, a->gen, 0, 10000 * MS);
    a->ns = shm_now_ns() - t0;
    return NULL;
}

/* A thread of a detached owner that still waits on a slot when the entry
 * is reclaimed learns it at once (its doorbell rings), not at its next
 * timeout or tick. */
static void test_reclaim_wakes(void) {
    start_test("reclaim_wakes", 60);
    const shm_params P = mkparams(64, 32, 1, 1, 8);
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    CHECK_EQ(shm_client_register(s, 501, 1, 0), 0);
    slot_waiter_arg a = {.s = s};
    CHECK_EQ(shm_slot_begin(s, 0, 0, 501, &a.gen), SHM_OK);
    CHECK_EQ(shm_slot_publish(s, 0, 0, a.gen), SHM_OK);
    pthread_t tw;
    CHECK_EQ(pthread_create(&tw, NULL, slot_waiter, &a), 0);
    uint64_t t0 = shm_now_ns();
    while (!(word_of(s, 0, 0) & SLOT_WAITER)) { /* until it sleeps */
        CHECK(shm_now_ns() - t0 < 5000 * MS);
        sleep_ns(100 * US);
    }
    sleep_ns(20 * MS);
    shm_client_detach(s, 0);
    CHECK_EQ(shm_client_reclaim(s, 0), 0);
    CHECK_EQ(pthread_join(tw, NULL), 0);
    CHECK_EQ(a.rc, SHM_STALE);
    CHECK_MSG(a.ns < PROMPT_NS, "the waiter learnt of the reclaim after %.3f s",
              secs(a.ns));
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

/* ------------------------------------------------------------------ */
/* Takes, put-backs and floors of several replicas, under chosen       */
/* schedules                                                           */
/* ------------------------------------------------------------------ */

/* A two-replica segment (one server each) with one client (entry 0, pid
 * 700) whose `nslots` slots are all published with input byte i = slot. */
static shm_seg *two_replicas(test_seg *t, uint32_t nslots) {
    shm_params P = with_replicas(mkparams(REP_IN, REP_OUT, 2, nslots, 8), 2, 2);
    seg_make(t, &P);
    shm_seg *s = &t->s;
    for (uint32_t r = 0; r < 2; r++) {
        shm_server_init(s, r, r);
        CHECK_EQ(shm_set_serving(s, r, 40000 + (int32_t)r, 1, "cpu"),
                 EV_SERVING);
    }
    CHECK_EQ(t_register(s, 700, 1), 0);
    for (uint32_t k = 0; k < nslots; k++) {
        CHECK_EQ(t_begin(s, 0, k), SHM_OK);
        memset(shm_slot_in(s, 0, k), (int)k, REP_IN);
        t_publish(s, 0, k);
    }
    return s;
}

typedef struct {
    shm_seg *s;
    uint32_t v;
    const char *park; /* a hook point, or NULL */
    hook_t hook;
    shm_taken own[8];
    char batch[8 * REP_IN];
    int n;
} scanner_arg;

static void *scanner(void *arg) {
    scanner_arg *a = arg;
    uint32_t cursor = 0;
    if (a->park) hook_arm(&a->hook, a->park, 1);
    a->n = shm_collect(a->s, a->v, a->own, a->batch, 8, &cursor, 0, 0, 1 * MS);
    return NULL;
}

/* Two collectors at once (the lock taken over from a holder that was not
 * dead after all, or a scribbled replica state): one lists a READY slot,
 * the other takes it meanwhile; the first must not take it too.  A blind
 * fetch_add would move TAKEN on to DONE with no answer written, and the
 * client would read the previous request's outputs as its own. */
static void test_take_race(void) {
    start_test("take_race", 60);
    test_seg t;
    shm_seg *s = two_replicas(&t, 1);
    scanner_arg x = {.s = s, .v = 0, .park = "scan_listed"};
    pthread_t tx;
    CHECK_EQ(pthread_create(&tx, NULL, scanner, &x), 0);
    hook_wait_parked(&x.hook);
    scanner_arg y = {.s = s, .v = 1};
    scanner(&y);
    CHECK_EQ(y.n, 1);
    hook_release(&x.hook);
    CHECK_EQ(pthread_join(tx, NULL), 0);
    CHECK_MSG(x.n == 0, "both collectors took the slot (the second got %d)", x.n);
    CHECK_EQU(atomic_load(&shm_server_at(s, 0)->n), 0); /* un-listed */
    CHECK_EQU(word_of(s, 0, 0) & ~SLOT_WAITER,
              shm_slot_word(SLOT_TAKEN, 0));
    seg_free(&t);
}

/* Every slot a replica has taken is listed in its table in the segment at
 * that moment: a replica killed right after a take leaves nothing that
 * another cannot put back. */
static void test_listed_first(void) {
    start_test("listed_first", 60);
    test_seg t;
    shm_seg *s = two_replicas(&t, 1);
    scanner_arg x = {.s = s, .v = 0, .park = "scan_taken"};
    pthread_t tx;
    CHECK_EQ(pthread_create(&tx, NULL, scanner, &x), 0);
    hook_wait_parked(&x.hook);
    /* replica 0 "dies" here: replica 1 puts its batch back */
    CHECK_EQ(shm_replica_stop(s, 0, REPLICA_DEAD, 0), 1);
    CHECK_EQ(shm_collect_lock(s, 1, 10 * MS), SHM_OK);
    CHECK_MSG(shm_requeue_replica(s, 1, 0) == 1,
              "a slot taken by the dead replica was not in its table");
    shm_collect_unlock(s);
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_READY, 0));
    hook_release(&x.hook);
    CHECK_EQ(pthread_join(tx, NULL), 0);
    seg_free(&t);
}

/* Replica 0 listed slot 0 in its table, holding the collect lock, and died
 * before its take.  Replica 1 finds it dead, but without the lock puts
 * nothing back; replica 2 takes the lock over, puts the dead one's batch
 * back before its first scan (nothing: slot 0 is still READY), then takes
 * slot 0.  A later put-back by replica 1 must not move slot 0, now in
 * replica 2's batch, back to READY: another replica would compute it a
 * second time, and the two completions would write its outputs at once. */
static void test_requeue_once(void) {
    start_test("requeue_once", 60);
    shm_params P = with_replicas(mkparams(REP_IN, REP_OUT, 2, 2, 8), 3, 3);
    test_seg t;
    seg_make(&t, &P);
    shm_seg *s = &t.s;
    for (uint32_t r = 0; r < 3; r++) {
        shm_server_init(s, r, r);
        CHECK_EQ(shm_set_serving(s, r, 40000 + (int32_t)r, 1, "cpu"),
                 EV_SERVING);
    }
    CHECK_EQ(t_register(s, 700, 1), 0);
    CHECK_EQ(t_begin(s, 0, 0), SHM_OK);
    t_publish(s, 0, 0);
    /* replica 0's state when it died: the lock, slot 0 listed, not taken */
    CHECK_EQ(shm_collect_lock(s, 0, 10 * MS), SHM_OK);
    shm_taken listed = {0, 0, 0, 0};
    shm_server_taken(s, 0)[0] = listed;
    atomic_store(&shm_server_at(s, 0)->n, 1);
    /* replica 1 marks it dead; without the lock it cannot put anything
     * back */
    CHECK_EQ(shm_replica_stop(s, 0, REPLICA_DEAD, 0), 2);
    CHECK_EQU(shm_requeue_replica(s, 1, 0), 0);
    CHECK_EQU(atomic_load(&shm_server_at(s, 0)->n), 1);
    /* replica 2 takes the lock over and puts the dead one's batch back */
    CHECK_EQ(shm_collect_steal(s, 2, 0), SHM_OK);
    CHECK_EQU(shm_requeue_replica(s, 2, 0), 0);
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_READY, 0));
    scanner_arg c = {.s = s, .v = 2};
    scanner(&c);
    CHECK_EQ(c.n, 1);
    shm_collect_unlock(s);
    /* replica 1, late, now holding the lock */
    CHECK_EQ(shm_collect_lock(s, 1, 10 * MS), SHM_OK);
    CHECK_EQU(shm_requeue_replica(s, 1, 0), 0);
    shm_collect_unlock(s);
    CHECK_MSG((word_of(s, 0, 0) & ~SLOT_WAITER) == shm_slot_word(SLOT_TAKEN, 0),
              "a slot in a live replica's batch was put back (word 0x%x)",
              word_of(s, 0, 0));
    seg_free(&t);
}

/* A replica restarted in a new process (Evaluator.spawn(restarts=)).  With
 * another serving: the dead one took slot 0 and died holding the collect
 * lock; its restart leaves SERVING (counted once), is not settled until
 * the other takes the lock over and puts the slot back, then serves again;
 * a late finder that judged the old process stops nothing, and a put-back
 * of a replica serving again moves nothing out of its new batch.  Alone
 * (one replica): the restart puts its dead process's batch back itself and
 * frees the lock word. */
static void test_restart(void) {
    start_test("restart", 60);
    test_seg t;
    shm_seg *s = two_replicas(&t, 1);
    CHECK_EQ(shm_collect_lock(s, 0, 10 * MS), SHM_OK);
    scanner_arg x = {.s = s, .v = 0};
    scanner(&x);
    CHECK_EQ(x.n, 1); /* replica 0 (pid 40000) dies here, holding it */
    CHECK_EQ(shm_replica_restart(s, 0, 50000, 2), 1);
    CHECK_EQU(shm_replicas_serving(s), 1);
    CHECK_EQ(shm_replica_settled(s, 0), 0);
    /* replica 1 takes the lock over and puts the batch back */
    CHECK_EQ(shm_collect_steal(s, 1, 0), SHM_OK);
    CHECK_EQ(shm_replica_settled(s, 0), 0);
    CHECK_EQU(shm_requeue_replica(s, 1, 0), 1);
    CHECK_EQ(shm_replica_settled(s, 0), 1);
    shm_collect_unlock(s);
    /* the new process serves and takes the slot again */
    shm_server_init(s, 0, 0);
    CHECK_EQ(shm_set_serving(s, 0, 50000, 2, "cpu"), EV_SERVING);
    CHECK_EQU(shm_replicas_serving(s), 2);
    CHECK_EQ(shm_collect_lock(s, 0, 10 * MS), SHM_OK);
    scanner_arg y = {.s = s, .v = 0};
    scanner(&y);
    CHECK_EQ(y.n, 1);
    shm_collect_unlock(s);
    CHECK_MSG(shm_replica_stop(s, 0, REPLICA_DEAD, 40000) == -1,
              "a finder of the old process stopped the restarted one");
    CHECK_EQ(shm_collect_lock(s, 1, 10 * MS), SHM_OK);
    CHECK_EQU(shm_requeue_replica(s, 1, 0), 0);
    shm_collect_unlock(s);
    CHECK_MSG((word_of(s, 0, 0) & ~SLOT_WAITER) == shm_slot_word(SLOT_TAKEN, 0),
              "a slot in a restarted replica's batch was put back (0x%x)",
              word_of(s, 0, 0));
    seg_free(&t);

    /* alone */
    shm_params P = mkparams(REP_IN, REP_OUT, 2, 2, 8);
    seg_make(&t, &P);
    s = &t.s;
    shm_server_init(s, 0, 0);
    CHECK_EQ(shm_set_serving(s, 0, 40000, 1, "cpu"), EV_SERVING);
    CHECK_EQ(t_register(s, 700, 1), 0);
    CHECK_EQ(t_begin(s, 0, 0), SHM_OK);
    t_publish(s, 0, 0);
    scanner_arg z = {.s = s, .v = 0};
    scanner(&z);
    CHECK_EQ(z.n, 1); /* and dies */
    CHECK_EQ(shm_replica_restart(s, 0, 50000, 2), 0);
    CHECK_EQU(shm_replicas_serving(s), 0);
    CHECK_EQ(shm_replica_settled(s, 0), 0);
    /* it died holding the lock word (a replica of several would) */
    atomic_store(&shm_hdr(s)->collect_lock, 1u | SHM_LOCK_WAITERS);
    CHECK_EQU(shm_requeue_restarted(s, 0), 1);
    CHECK_MSG(atomic_load(&shm_hdr(s)->collect_lock) == 0,
              "the dead process's collect lock was left to its restart");
    CHECK_EQU(shm_requeue_restarted(s, 0), 0); /* once */
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_READY, 0));
    CHECK_EQ(shm_replica_settled(s, 0), 1);
    shm_server_init(s, 0, 0);
    CHECK_EQ(shm_set_serving(s, 0, 50000, 2, "cpu"), EV_SERVING);
    CHECK_EQU(shm_replicas_serving(s), 1);
    seg_free(&t);
}

/* What a put-back moves: only slots still TAKEN with the generation the
 * table names, keeping the client's WAITER bit; a table scribbled with
 * indexes past the segment changes nothing. */
static void test_requeue_words(void) {
    start_test("requeue_words", 60);
    test_seg t;
    shm_seg *s = two_replicas(&t, 3);
    CHECK_EQ(shm_replica_stop(s, 1, REPLICA_STOPPED, 0), 1); /* 0 takes all */
    scanner_arg x = {.s = s, .v = 0};
    scanner(&x);
    CHECK_EQ(x.n, 3);
    /* slot 0: the client sleeps on it (WAITER) */
    atomic_fetch_or(shm_slot_word_at(s, 0, 0), SLOT_WAITER);
    /* slot 1: answered and released since; a later request of the same
     * slot is TAKEN now (by another replica), one generation on */
    store_word(s, 0, 1, shm_slot_word(SLOT_TAKEN, 1));
    /* and garbage past the table's real entries */
    shm_taken *copy = shm_server_taken(s, 0);
    shm_taken bad1 = {UINT32_MAX, 0, 0, 0}, bad2 = {0, UINT32_MAX, 0, 0};
    copy[3] = bad1;
    copy[4] = bad2;
    atomic_store(&shm_server_at(s, 0)->n, 5);
    CHECK_EQ(shm_replica_stop(s, 0, REPLICA_DEAD, 0), 0);
    CHECK_EQ(shm_collect_lock(s, 1, 10 * MS), SHM_OK);
    CHECK_EQU(shm_requeue_replica(s, 1, 0), 2);
    shm_collect_unlock(s);
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_READY, 0) | SLOT_WAITER);
    CHECK_EQU(word_of(s, 0, 1), shm_slot_word(SLOT_TAKEN, 1));
    CHECK_EQU(word_of(s, 0, 2), shm_slot_word(SLOT_READY, 0));
    /* a table length past max_batch is cut to it */
    atomic_store(&shm_server_at(s, 1)->n, UINT32_MAX);
    CHECK_EQ(shm_collect_lock(s, 0, 10 * MS), SHM_OK);
    shm_requeue_replica(s, 0, 1);
    shm_collect_unlock(s);
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_READY, 0) | SLOT_WAITER);
    seg_free(&t);
}

/* The weights floor holds while a replica serves it: a replica behind it
 * waits, and takes no share of the work; when every replica at the floor
 * is gone, the floor comes down to the ones left, which serve (a scribbled
 * floor too).  Never a state where requests wait for ever. */
static void test_version_floor(void) {
    start_test("version_floor", 60);
    test_seg t;
    shm_seg *s = two_replicas(&t, 4);
    shm_replica_version(s, 0, 2);
    shm_replica_version(s, 1, 1);
    CHECK_EQ(shm_version_ok(s, 2), 1);
    CHECK_EQ(shm_version_ok(s, 1), 0); /* replica 0 serves version 2 */
    CHECK_EQU(shm_replicas_current(s), 1);
    CHECK_EQU(shm_fair_share(s, 0, 0, 8), 4); /* all 4 READY are replica 0's */
    /* the owner saw version 3 applied (by replica 0) */
    shm_replica_version(s, 0, 3);
    shm_raise_floor(s, 3);
    shm_raise_floor(s, 2); /* never lowers it */
    CHECK_EQU(atomic_load(&shm_hdr(s)->version_floor), 3);
    CHECK_EQ(shm_version_ok(s, 1), 0);
    /* replica 0 dies */
    CHECK_EQ(shm_replica_stop(s, 0, REPLICA_DEAD, 0), 1);
    CHECK_MSG(shm_version_ok(s, 1) == 1,
              "the replica left waits for weights nobody serves any more");
    CHECK_EQU(atomic_load(&shm_hdr(s)->version_floor), 1);
    CHECK_EQU(shm_replicas_current(s), 1);
    /* a floor scribbled on */
    atomic_store(&shm_hdr(s)->version_floor, UINT64_MAX);
    CHECK_EQ(shm_version_ok(s, 1), 1);
    seg_free(&t);
}

/* Several replicas each take at most their share of the work ready. */
static void test_fair_share(void) {
    start_test("fair_share", 60);
    test_seg t;
    shm_seg *s = two_replicas(&t, 8);
    scanner_arg x = {.s = s, .v = 0};
    scanner(&x);
    CHECK_MSG(x.n == 4, "one of two replicas took %d of 8 requests", x.n);
    scanner_arg y = {.s = s, .v = 1};
    scanner(&y);
    CHECK_EQ(y.n, 4);
    seg_free(&t);
}

typedef struct {
    shm_seg *s;
    int rc;
    uint64_t ns;
} locker_arg;

static void *locker(void *arg) {
    locker_arg *a = arg;
    uint64_t t0 = shm_now_ns();
    a->rc = shm_collect_lock(a->s, 1, 10000 * MS);
    a->ns = shm_now_ns() - t0;
    if (a->rc == SHM_OK) shm_collect_unlock(a->s);
    return NULL;
}

/* A server asleep on the collect lock is woken when it is released, and
 * a lock word naming no server (scribbled) can be taken over. */
static void test_lock_wake(void) {
    start_test("lock_wake", 60);
    test_seg t;
    shm_seg *s = two_replicas(&t, 1);
    CHECK_EQ(shm_collect_lock(s, 0, 10 * MS), SHM_OK);
    locker_arg a = {.s = s};
    pthread_t tl;
    CHECK_EQ(pthread_create(&tl, NULL, locker, &a), 0);
    /* until it sleeps on the word (its waiters bit set) */
    uint64_t t0 = shm_now_ns();
    while (!(atomic_load(&shm_hdr(s)->collect_lock) & SHM_LOCK_WAITERS)) {
        CHECK(shm_now_ns() - t0 < 5000 * MS);
        sleep_ns(100 * US);
    }
    sleep_ns(20 * MS);
    shm_collect_unlock(s);
    CHECK_EQ(pthread_join(tl, NULL), 0);
    CHECK_EQ(a.rc, SHM_OK);
    CHECK_MSG(a.ns < PROMPT_NS, "the waiter got the lock after %.3f s",
              secs(a.ns));
    atomic_store(&shm_hdr(s)->collect_lock, 999u);
    CHECK_EQ(shm_collect_holder(s), 998);
    CHECK_EQ(shm_collect_steal(s, 1, 998), SHM_OK);
    CHECK_EQ(shm_collect_holder(s), 1);
    shm_collect_unlock(s);
    seg_free(&t);
}

typedef struct {
    shm_seg *s;
    hook_t hook;
    int rc;
    uint32_t gen;
} stale_begin_arg;

static void *stale_beginner(void *arg) {
    stale_begin_arg *a = arg;
    hook_arm(&a->hook, "begin_checked", 1);
    a->rc = shm_slot_begin(a->s, 0, 0, 801, &a->gen);
    return NULL;
}

/* A begin by a process whose entry is reclaimed and claimed by another
 * after its owner check: it must not take the new owner's slot (whose own
 * begin of it would fail, for as long as the slot stays WRITING). */
static void test_begin_owner(void) {
    start_test("begin_owner", 60);
    const shm_params P = mkparams(64, 32, 1, 1, 8);
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    CHECK_EQ(shm_client_register(s, 801, 1, 0), 0);
    stale_begin_arg b = {.s = s};
    pthread_t tb;
    CHECK_EQ(pthread_create(&tb, NULL, stale_beginner, &b), 0);
    hook_wait_parked(&b.hook);
    shm_client_detach(s, 0);
    CHECK_EQ(shm_client_reclaim(s, 0), 0);
    CHECK_EQ(shm_client_register(s, 802, 1, 0), 0);
    hook_release(&b.hook);
    CHECK_EQ(pthread_join(tb, NULL), 0);
    CHECK_MSG(b.rc == SHM_STALE,
              "a begin of the former owner took the new owner's slot (%d)",
              b.rc);
    uint32_t gen;
    CHECK_EQ(shm_slot_begin(s, 0, 0, 802, &gen), SHM_OK);
    CHECK_EQ(shm_slot_publish(s, 0, 0, gen), SHM_OK);
    seg_free(&t);
}

/* A slot begun and given up (a post of several slots whose later begin
 * failed) can be begun again; a publish or abort of a slot reclaimed
 * since its begin changes nothing. */
static void test_abort(void) {
    start_test("abort", 60);
    const shm_params P = mkparams(64, 32, 1, 2, 8);
    test_seg t;
    shm_seg *s = serving_seg(&t, &P);
    CHECK_EQ(shm_client_register(s, 901, 1, 0), 0);
    uint32_t g0, g1;
    CHECK_EQ(shm_slot_begin(s, 0, 0, 901, &g0), SHM_OK);
    CHECK_EQ(shm_slot_abort(s, 0, 0, g0), SHM_OK);
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_FREE, g0 + 1));
    CHECK_EQ(shm_slot_abort(s, 0, 0, g0), SHM_STALE);
    CHECK_EQ(shm_slot_begin(s, 0, 0, 901, &g0), SHM_OK);
    CHECK_EQ(shm_slot_begin(s, 0, 1, 901, &g1), SHM_OK);
    shm_client_detach(s, 0);
    CHECK_EQ(shm_client_reclaim(s, 0), 2);
    CHECK_EQ(shm_client_register(s, 902, 1, 0), 0);
    CHECK_EQ(shm_slot_publish(s, 0, 0, g0), SHM_STALE);
    CHECK_EQ(shm_slot_abort(s, 0, 1, g1), SHM_STALE);
    CHECK_EQU(word_of(s, 0, 0), shm_slot_word(SLOT_FREE, g0 + 1));
    CHECK_EQU(word_of(s, 0, 1), shm_slot_word(SLOT_FREE, g1 + 1));
    seg_free(&t);
}

/* Completion reads only the caller's own table: the segment's copy of a
 * batch table, scribbled with indexes past the segment while a batch is
 * in flight, changes nothing (ASan watches the accesses). */
static void test_scribbled_tables(void) {
    start_test("scribbled_tables", 60);
    test_seg t;
    shm_seg *s = two_replicas(&t, 2);
    CHECK_EQ(shm_replica_stop(s, 1, REPLICA_STOPPED, 0), 1); /* 0 takes all */
    scanner_arg x = {.s = s, .v = 0};
    scanner(&x);
    CHECK_EQ(x.n, 2);
    shm_taken *copy = shm_server_taken(s, 0);
    memset(copy, 0xff, sizeof *copy * 8);
    shm_server_at(s, 0)->replica = UINT32_MAX;
    char out[2 * REP_OUT];
    memset(out, 7, sizeof out);
    CHECK_EQU(shm_complete(s, x.own, 2, out, 1), 2);
    CHECK_EQ(t_wait(s, 0, 0, 0, 10 * MS), SLOT_DONE);
    CHECK_EQ(t_wait(s, 0, 1, 0, 10 * MS), SLOT_DONE);
    /* and a collect of that server goes on */
    CHECK_EQ(t_release(s, 0, 0), SHM_OK);
    CHECK_EQ(t_begin(s, 0, 0), SHM_OK);
    t_publish(s, 0, 0);
    scanner(&x);
    CHECK_EQ(x.n, 1);
    seg_free(&t);
}

/* A replica killed between its completion of a slot (which clears the
 * client's WAITER bit) and the ring of the client's doorbell: the put-back
 * of its tables rings it, so the client sees its answer now, not at its
 * next timeout. */
static void test_requeue_rings(void) {
    start_test("requeue_rings", 60);
    test_seg t;
    shm_seg *s = two_replicas(&t, 1);
    CHECK_EQ(shm_replica_stop(s, 1, REPLICA_STOPPED, 0), 1); /* 0 takes it */
    scanner_arg x = {.s = s, .v = 0};
    scanner(&x);
    CHECK_EQ(x.n, 1);
    slot_waiter_arg a = {.s = s, .gen = 0};
    pthread_t tw;
    CHECK_EQ(pthread_create(&tw, NULL, slot_waiter, &a), 0);
    uint64_t t0 = shm_now_ns();
    while (!(word_of(s, 0, 0) & SLOT_WAITER)) { /* until it sleeps */
        CHECK(shm_now_ns() - t0 < 5000 * MS);
        sleep_ns(100 * US);
    }
    sleep_ns(20 * MS);
    /* replica 0 completes (WAITER cleared) and dies before its ring */
    store_word(s, 0, 0, shm_slot_word(SLOT_DONE, 0));
    CHECK_EQ(shm_replica_stop(s, 0, REPLICA_DEAD, 0), 0);
    CHECK_EQ(shm_collect_lock(s, 1, 10 * MS), SHM_OK);
    CHECK_EQU(shm_requeue_replica(s, 1, 0), 0);
    shm_collect_unlock(s);
    CHECK_EQ(pthread_join(tw, NULL), 0);
    CHECK_EQ(a.rc, SLOT_DONE);
    CHECK_MSG(a.ns < PROMPT_NS, "the client saw its answer after %.3f s",
              secs(a.ns));
    seg_free(&t);
}

/* ------------------------------------------------------------------ */

typedef struct {
    const char *name;
    void (*fn)(void);
} test_case;

static const test_case k_tests[] = {
    {"layout", test_layout},   {"attach", test_attach},
    {"state", test_state},     {"reclaim", test_reclaim},
    {"concurrency", test_concurrency}, {"close", test_close},
    {"max_wait", test_max_wait}, {"control", test_control},
    {"scribbled", test_scribbled}, {"doorbell", test_doorbell},
    {"ticker", test_ticker},   {"copy", test_copy},
    {"yield", test_yield},     {"spin_policy", test_spin_policy},
    {"lost_wakeup", test_lost_wakeup}, {"reread", test_reread},
    {"release_race", test_release_race}, {"begin_race", test_begin_race},
    {"hwm_first", test_hwm_first}, {"generations", test_generations},
    {"spec_once", test_spec_once}, {"handover", test_handover},
    {"stop_reason", test_stop_reason}, {"replicas", test_replicas},
    {"wait_any", test_wait_any}, {"cache", test_cache},
    {"report", test_report}, {"cache_torn", test_cache_torn}, {"cache_threads", test_cache_threads},
    {"take_race", test_take_race}, {"listed_first", test_listed_first},
    {"requeue_once", test_requeue_once}, {"requeue_words", test_requeue_words},
    {"restart", test_restart},
    {"version_floor", test_version_floor}, {"fair_share", test_fair_share},
    {"lock_wake", test_lock_wake}, {"begin_owner", test_begin_owner},
    {"abort", test_abort}, {"scribbled_tables", test_scribbled_tables},
    {"cache_check", test_cache_check}, {"reclaim_wakes", test_reclaim_wakes},
    {"requeue_rings", test_requeue_rings},
};

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    signal(SIGALRM, on_alarm);
    /* a new seed every run (printed, so a failure can be replayed with
     * SHM_TEST_SEED; thread interleavings differ from run to run anyway) */
    g_seed = env_u64("SHM_TEST_SEED", mix64(shm_now_ns() ^ (uint64_t)getpid()));
    g_sleep_ns = env_u64("SHM_TEST_SLEEP_MS", 10000) * MS;
    g_slow = BUILD_SLOW || env_u64("SHM_TEST_SLOW", 0) != 0;
    printf("ring_test (%s build, %s%s), seed %" PRIu64 "\n", BUILD_KIND,
           BUILD_ARCH, g_slow ? ", slow" : "", g_seed);
    const size_t nt = sizeof k_tests / sizeof k_tests[0];
    for (int i = 1; i < argc; i++) {
        size_t j = 0;
        while (j < nt && strcmp(argv[i], k_tests[j].name) != 0) j++;
        if (j == nt) {
            fprintf(stderr, "unknown test %s\n", argv[i]);
            return 2;
        }
    }
    uint64_t all0 = shm_now_ns();
    int ran = 0;
    for (size_t j = 0; j < nt; j++) {
        int want = argc == 1;
        for (int i = 1; i < argc; i++)
            if (strcmp(argv[i], k_tests[j].name) == 0) want = 1;
        if (!want) continue;
        uint64_t t0 = shm_now_ns();
        k_tests[j].fn();
        alarm(0);
        printf("ok   %-12s %.2f s\n", k_tests[j].name, secs(shm_now_ns() - t0));
        ran++;
    }
    g_test = "done";
    printf("ring_test (%s build): %d tests passed in %.2f s\n", BUILD_KIND,
           ran, secs(shm_now_ns() - all0));
    return 0;
}
