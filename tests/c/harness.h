/*
 * harness.h -- what the C tests of the core share (the .c files of
 * tests/c, one program: main.c runs the tests).  Every test file includes this header
 * first: it puts the test hooks in place (the clock that can park a
 * thread, the counted sched_yield, the named schedule points SHM_HOOK)
 * and then includes the core, <ring.h>, so that the core is compiled with
 * them; then the checks, the watchdog and the helpers the tests have in
 * common.
 *
 * The "segment" is a zero-filled heap buffer (aligned_alloc 4096); threads
 * share it exactly as processes share a mapping, and the futex words work
 * the same way within one process.
 */
#ifndef SHMEVAL_TEST_HARNESS_H
#define SHMEVAL_TEST_HARNESS_H

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
extern _Thread_local int tl_park_at;    /* 0: off; else park at this call */
extern _Thread_local int tl_clock_calls;
extern _Atomic int g_park;               /* 0 idle, 1 parked, 2 released */
int test_clock_gettime(clockid_t clk, struct timespec *ts);
#define clock_gettime(clk, ts) test_clock_gettime((clk), (ts))

/* Every sched_yield() of ring.h's yielding spins, counted (test_yield). */
#include <sched.h>
extern _Atomic unsigned long g_yields;
int test_sched_yield(void);
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
extern _Thread_local hook_t *tl_hook;
void test_hook(const char *point);
#define SHM_HOOK(point) test_hook(point)

/* Angle brackets on purpose: ring.h is found through -I (the build passes
 * -I src/shmeval/_core), so a build can point at another copy of the
 * header, e.g. a deliberately broken one: -I /tmp/broken. */
#include <ring.h>

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

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
extern int g_slow;

#define MS 1000000ull
#define US 1000ull

/* ------------------------------------------------------------------ */
/* Failure reporting, watchdog                                        */
/* ------------------------------------------------------------------ */

/* The test running now (for FAIL and the watchdog). */
extern const char *volatile g_test;

/* Prints "FAIL [test] file:line: message" and exits with 1 (the checks
 * below call it). */
void fail_at(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4), noreturn));

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

/* The watchdog: SIGALRM's handler, and a test's start, which names it
 * and arms the alarm (longer in a slow run). */
void on_alarm(int sig);
void start_test(const char *name, unsigned watchdog_s);

/* ------------------------------------------------------------------ */
/* Small helpers                                                      */
/* ------------------------------------------------------------------ */

extern uint64_t g_seed;
/* SHM_TEST_SLEEP_MS, in ns: see main.c. */
extern uint64_t g_sleep_ns;
/* The spec every test segment carries. */
extern const char k_spec[];

typedef struct {
    char *mem;
    uint64_t size;
    shm_seg s;
} test_seg;

/* How soon a woken waiter must return: generous, far below its timeout. */
#define PROMPT_NS ((g_slow ? 2000u : 1000u) * MS)

/* Randomness (xorshift64*, the splitmix64 finaliser), sleeps and time. */
uint64_t rng_next(uint64_t *s);
uint64_t mix64(uint64_t x);
void sleep_ns(uint64_t ns);
void maybe_delay(uint64_t *rng); /* random tiny delays in random places */
double secs(uint64_t ns);
/* An environment variable's number, or dflt when it is unset. */
uint64_t env_u64(const char *name, uint64_t dflt);

/* Segments: a zero-filled, 4096-aligned heap buffer (seg_alloc); one
 * formatted with k_spec (seg_make); one whose replica 0 serves, as pid 1
 * (serving_seg, t_set_serving); freed by seg_free.  The parameters:
 * mkparams (one replica, one server, no cache), then with_replicas and
 * with_cache. */
char *seg_alloc(uint64_t size);
void seg_make(test_seg *t, const shm_params *p);
uint32_t t_set_serving(shm_seg *s, int32_t pid, uint64_t starttime);
shm_seg *serving_seg(test_seg *t, const shm_params *p);
void seg_free(test_seg *t);
shm_params mkparams(uint64_t in, uint64_t out, uint32_t clients, uint32_t k,
                    uint32_t batch);
shm_params with_replicas(shm_params p, uint32_t replicas, uint32_t servers);
shm_params with_cache(shm_params p, uint32_t log2);

/* A slot's state word, read (acquire) and written (release) directly. */
uint32_t word_of(shm_seg *s, uint32_t c, uint32_t k);
void store_word(shm_seg *s, uint32_t c, uint32_t k, uint32_t v);

/* The slot state machine as most tests drive it: each client-side step
 * names the generation the slot has at that moment (gen_now; the owner's
 * pid, for begin), so these tests exercise the transitions; the tests of
 * stale generations and owners call the core directly.  t_collect serves
 * as server 0 of replica 0, the one evaluator most tests have. */
int t_begin(shm_seg *s, uint32_t c, uint32_t k);
uint32_t gen_now(shm_seg *s, uint32_t c, uint32_t k);
void t_publish(shm_seg *s, uint32_t c, uint32_t k);
int t_wait(shm_seg *s, uint32_t c, uint32_t k, uint64_t spin_ns,
           uint64_t timeout_ns);
int t_wait_ticked(shm_seg *s, uint32_t c, uint32_t k, uint64_t spin_ns,
                  uint64_t timeout_ns, shm_ticker *t);
int t_release(shm_seg *s, uint32_t c, uint32_t k);
int t_collect(shm_seg *s, char *batch, shm_taken *taken, uint32_t max_batch,
              uint32_t *cursor, uint64_t spin_ns, uint64_t max_wait_ns,
              uint64_t timeout_ns);
int t_register(shm_seg *s, int32_t pid, uint64_t starttime);
int32_t t_info(shm_seg *s, uint32_t c, uint64_t *starttime,
               uint32_t *detached);

/* ------------------------------------------------------------------ */
/* Helpers of several test files                                      */
/* ------------------------------------------------------------------ */

/* Rows of bytes that depend on (tag, index) only. */
void fill_row(char *dst, uint64_t bytes, uint64_t tag);
/* Completes the batch `taken` (n requests) and checks each client gets
 * DONE and releases its slot. */
void drain(shm_seg *s, shm_taken *taken, int n);

/* A thread that requests a close (or a control request) after delay_ns. */
typedef struct {
    shm_seg *s;
    uint64_t delay_ns;
} closer_arg;

/* A client thread asleep on slot 0 of client c (bell_sleeper): how it
 * waited, and when and with what it returned. */
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
void *bell_sleeper(void *arg);
uint64_t thread_cpu_ns(void); /* the calling thread's CPU time */
/* Claims entries 0..n-1 for pids pid0, pid0 + 1, ... */
void register_clients(shm_seg *s, uint32_t n, int32_t pid0);

/* A chosen interleaving (SHM_HOOK): hook_arm arms a point for the calling
 * thread, to park at its nth pass there; the main thread waits until it
 * is parked (hook_wait_parked, at most 10 s), acts, and lets it go
 * (hook_release, which waits until it has resumed). */
void hook_arm(hook_t *h, const char *point, int nth);
void hook_wait_parked(hook_t *h);
void hook_release(hook_t *h);
/* The scheduler's state of thread tid of this process ('S' asleep, 'R'
 * running, ...); wait_asleep waits (at most 10 s) until *tid is asleep in
 * the kernel. */
char thread_state(pid_t tid);
void wait_asleep(_Atomic pid_t *tid);

/* Publishes one request on slot (c, k) for process pid; returns its
 * generation. */
uint32_t submit_one(shm_seg *s, uint32_t c, uint32_t k, int32_t pid,
                    unsigned char fill);
/* Takes every ready request (at least one) and answers it with bytes
 * `fill`. */
uint32_t answer_ready(shm_seg *s, unsigned char fill);

/* A waiter on slot 0 of client 0 begun with generation gen
 * (slot_waiter): its result and how long it waited. */
typedef struct {
    shm_seg *s;
    uint32_t gen;
    int rc;
    uint64_t ns;
} slot_waiter_arg;
void *slot_waiter(void *arg);

/* ------------------------------------------------------------------ */
/* The runner                                                         */
/* ------------------------------------------------------------------ */

/* A test: its name on the command line, and its function. */
typedef struct {
    const char *name;
    void (*fn)(void);
} test_case;

#endif /* SHMEVAL_TEST_HARNESS_H */
