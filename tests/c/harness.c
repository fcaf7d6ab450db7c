/*
 * harness.c -- the shared part of the C tests of the core (harness.h says
 * what each piece is for).
 */
#include "harness.h"

#include <errno.h>
#include <stdarg.h>

/* ------------------------------------------------------------------ */
/* Schedule control                                                   */
/* ------------------------------------------------------------------ */

/* The clock that can park a thread (harness.h). */
_Thread_local int tl_park_at;    /* 0: off; else park at this call */
_Thread_local int tl_clock_calls;
_Atomic int g_park;               /* 0 idle, 1 parked, 2 released */
int test_clock_gettime(clockid_t clk, struct timespec *ts) {
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

/* Every sched_yield() of ring.h's yielding spins, counted (test_yield). */
_Atomic unsigned long g_yields;
int test_sched_yield(void) {
    atomic_fetch_add(&g_yields, 1);
    return sched_yield();
}

/* Named schedule points (harness.h): the calling thread parks at the
 * point it armed. */
_Thread_local hook_t *tl_hook;
void test_hook(const char *point) {
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

/* ------------------------------------------------------------------ */
/* Failure reporting, watchdog                                        */
/* ------------------------------------------------------------------ */

/* A slow run (harness.h); main() sets it. */
int g_slow = BUILD_SLOW;

const char *volatile g_test = "startup";

void fail_at(const char *file, int line, const char *fmt, ...) {
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

void on_alarm(int sig) {
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

void start_test(const char *name, unsigned watchdog_s) {
    g_test = name;
    alarm(watchdog_s * watchdog_scale());
}

/* ------------------------------------------------------------------ */
/* Small helpers                                                      */
/* ------------------------------------------------------------------ */

uint64_t g_seed;
/* SHM_TEST_SLEEP_MS, in ns: see main.c. */
uint64_t g_sleep_ns = 10000 * 1000000ull;

uint64_t rng_next(uint64_t *s) { /* xorshift64* */
    uint64_t x = *s ? *s : 0x9E3779B97F4A7C15ull;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1Dull;
}
uint64_t mix64(uint64_t x) { /* splitmix64 finaliser */
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

void sleep_ns(uint64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000ull),
                          (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Random tiny delays in random places. */
void maybe_delay(uint64_t *rng) {
    uint64_t r = rng_next(rng);
    if ((r & 31) == 0)
        sched_yield();
    else if ((r & 511) == 1)
        sleep_ns((r >> 32) % (50 * US));
}

double secs(uint64_t ns) { return (double)ns / 1e9; }

uint64_t env_u64(const char *name, uint64_t dflt) {
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
char *seg_alloc(uint64_t size) {
    uint64_t sz = shm_round_up(size ? size : 1, 4096);
    char *p = aligned_alloc(4096, sz);
    CHECK_MSG(p != NULL, "aligned_alloc(%" PRIu64 ") failed", sz);
    memset(p, 0, sz);
    return p;
}

const char k_spec[] =
    "{\"model\":\"ring_test\",\"inputs\":[{\"name\":\"x\",\"dtype\":\"float32\","
    "\"shape\":[84]}],\"outputs\":[{\"name\":\"y\",\"dtype\":\"float32\","
    "\"shape\":[8]}]}";

void seg_make(test_seg *t, const shm_params *p) {
    shm_layout l;
    CHECK_EQ(shm_layout_compute(p, &l), SHM_OK);
    t->size = l.total;
    t->mem = seg_alloc(l.total);
    CHECK_EQ(shm_init(&t->s, t->mem, t->size, p, k_spec,
                      (uint32_t)strlen(k_spec), (int32_t)getpid(), 0, 0, 0),
             SHM_OK);
}

/* Replica 0 serves (the one evaluator most tests have). */
uint32_t t_set_serving(shm_seg *s, int32_t pid, uint64_t starttime) {
    return shm_set_serving(s, 0, pid, starttime, "test");
}

/* A fresh segment whose evaluator is serving (pid 1): where most tests
 * start. */
shm_seg *serving_seg(test_seg *t, const shm_params *p) {
    seg_make(t, p);
    CHECK_EQ(t_set_serving(&t->s, 1, 1), EV_SERVING);
    return &t->s;
}

void seg_free(test_seg *t) {
    free(t->mem);
    t->mem = NULL;
}

shm_params mkparams(uint64_t in, uint64_t out, uint32_t clients,
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

shm_params with_replicas(shm_params p, uint32_t replicas,
                         uint32_t servers) {
    p.replicas = replicas;
    p.servers = servers;
    return p;
}

shm_params with_cache(shm_params p, uint32_t log2) {
    p.cache_log2 = log2;
    return p;
}

uint32_t word_of(shm_seg *s, uint32_t c, uint32_t k) {
    return shm_slot_peek(s, c, k);
}
void store_word(shm_seg *s, uint32_t c, uint32_t k, uint32_t v) {
    atomic_store_explicit(shm_slot_word_at(s, c, k), v, memory_order_release);
}

/* The slot state machine as most tests drive it: each client-side step
 * names the generation the slot has at that moment (the owner's pid, for
 * begin), so these tests exercise the transitions; the tests of stale
 * generations and owners (test_generations) call ring.h directly. */
int t_begin(shm_seg *s, uint32_t c, uint32_t k) {
    uint32_t gen;
    return shm_slot_begin(
        s, c, k,
        atomic_load_explicit(&shm_client_at(s, c)->owner_pid,
                             memory_order_relaxed),
        &gen);
}
uint32_t gen_now(shm_seg *s, uint32_t c, uint32_t k) {
    return shm_word_gen(shm_slot_peek(s, c, k));
}
/* WRITING -> READY of the generation the slot has now. */
void t_publish(shm_seg *s, uint32_t c, uint32_t k) {
    CHECK_EQ(shm_slot_publish(s, c, k, gen_now(s, c, k)), SHM_OK);
}
int t_wait(shm_seg *s, uint32_t c, uint32_t k, uint64_t spin_ns,
           uint64_t timeout_ns) {
    return shm_slot_wait(s, c, k, gen_now(s, c, k), spin_ns, timeout_ns);
}
int t_wait_ticked(shm_seg *s, uint32_t c, uint32_t k, uint64_t spin_ns,
                  uint64_t timeout_ns, shm_ticker *t) {
    return shm_slot_wait_ticked(s, c, k, gen_now(s, c, k), spin_ns,
                                timeout_ns, t);
}
int t_release(shm_seg *s, uint32_t c, uint32_t k) {
    return shm_slot_release(s, c, k, gen_now(s, c, k));
}
/* Serving by server 0 of replica 0, the one evaluator most tests have:
 * its batch table is `taken` (shm_scan's `own`). */
int t_collect(shm_seg *s, char *batch, shm_taken *taken,
              uint32_t max_batch, uint32_t *cursor, uint64_t spin_ns,
              uint64_t max_wait_ns, uint64_t timeout_ns) {
    return shm_collect(s, 0, taken, batch, max_batch, cursor, spin_ns,
                       max_wait_ns, timeout_ns);
}
int t_register(shm_seg *s, int32_t pid, uint64_t starttime) {
    return shm_client_register(s, pid, starttime, 0);
}
int32_t t_info(shm_seg *s, uint32_t c, uint64_t *starttime,
               uint32_t *detached) {
    uint64_t pid_ns;
    return shm_client_info(s, c, starttime, &pid_ns, detached);
}

/* ------------------------------------------------------------------ */
/* Helpers of several test files                                      */
/* ------------------------------------------------------------------ */

void fill_row(char *dst, uint64_t bytes, uint64_t tag) {
    for (uint64_t i = 0; i < bytes; i++)
        dst[i] = (char)(mix64(tag * 1000003u + i) & 0xFF);
}

void drain(shm_seg *s, shm_taken *taken, int n) {
    char res[8 * 32];
    memset(res, 3, sizeof res);
    CHECK_EQU(shm_complete(s, taken, (uint32_t)n, res, 1), (uint32_t)n);
    for (int i = 0; i < n; i++) {
        CHECK_EQ(t_wait(s, taken[i].client, taken[i].slot, 0, 10 * MS),
                 SLOT_DONE);
        CHECK_EQ(t_release(s, taken[i].client, taken[i].slot), SHM_OK);
    }
}

uint64_t thread_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Waits for slot 0 of client c (after a spin of spin_ns, if set). */
void *bell_sleeper(void *arg) {
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
void register_clients(shm_seg *s, uint32_t n, int32_t pid0) {
    for (uint32_t c = 0; c < n; c++)
        CHECK_EQ(t_register(s, pid0 + (int32_t)c, 1), (int)c);
}

/* Arms hook h for the calling thread: it parks at its `nth` pass through
 * `point`. */
void hook_arm(hook_t *h, const char *point, int nth) {
    h->point = point;
    h->left = nth;
    atomic_store(&h->state, 0);
    tl_hook = h;
}
/* Waits (at most 10 s) until h's thread is parked at its point. */
void hook_wait_parked(hook_t *h) {
    uint64_t t0 = shm_now_ns();
    while (atomic_load(&h->state) != 1) {
        CHECK_MSG(shm_now_ns() - t0 < 10000 * MS, "no thread parked at %s",
                  h->point);
        sleep_ns(20 * US);
    }
}
/* Lets h's thread go and waits until it has resumed. */
void hook_release(hook_t *h) {
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
char thread_state(pid_t tid) {
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
void wait_asleep(_Atomic pid_t *tid) {
    uint64_t t0 = shm_now_ns();
    while (atomic_load(tid) == 0 || thread_state(atomic_load(tid)) != 'S') {
        CHECK_MSG(shm_now_ns() - t0 < 10000 * MS, "thread never went to sleep");
        sleep_ns(50 * US);
    }
    sleep_ns(1 * MS); /* asleep in the futex, not on its way through */
}

/* Publishes one request on slot (c, k) for process pid; returns its
 * generation. */
uint32_t submit_one(shm_seg *s, uint32_t c, uint32_t k, int32_t pid,
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
uint32_t answer_ready(shm_seg *s, unsigned char fill) {
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

void *slot_waiter(void *arg) {
    slot_waiter_arg *a = arg;
    uint64_t t0 = shm_now_ns();
    a->rc = shm_slot_wait(a->s, 0, 0, a->gen, 0, 10000 * MS);
    a->ns = shm_now_ns() - t0;
    return NULL;
}
