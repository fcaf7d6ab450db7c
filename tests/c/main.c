/*
 * main.c -- the C tests of the core (ring.h and its ring/ headers) without
 * Python: the runner.
 *
 * Built and run by tests/c/run_c_tests.sh in three ways: plain (-O2
 * -Werror -DSHM_DEBUG), ThreadSanitizer, and AddressSanitizer +
 * UndefinedBehaviorSanitizer; and, on request, plain for aarch64, run
 * under QEMU's user-mode emulation (the arm64 build).  One program from
 * every .c file here: harness.c and load.c (what the tests share), one
 * test_<header>.c for each header of the core (ring/<header>.h), and this
 * runner, which lists their tests.
 *
 *   gcc -std=c11 -D_GNU_SOURCE -pthread -I src/shmeval/_core \
 *       tests/c/[a-z]*.c -o ring_test
 *   ring_test            run every test
 *   ring_test NAME...    run only the named tests (layout attach reclaim
 *                        state ... concurrency close ... report)
 *
 * The core is included as <ring.h> and found through -I, so the same tests
 * can be built against another copy of it (-I /tmp/broken, a directory
 * holding ring.h and ring/).
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
 *                             sleepers (lost_wakeup, reread, wait_any;
 *                             10000): a lost wake-up costs a test this long.
 *                             Keep it above 2000 (the answer's deadline)
 *
 * Every failed check prints "FAIL [test] file:line: ..." and exits with 1; a
 * test that overruns its watchdog prints "TIMEOUT [test]" and exits with 2.
 */

#include "harness.h"

#include <inttypes.h>
#include <stdio.h>

/* Each test file's tests (test_<header>.c), in the order they run. */
extern const test_case layout_tests[];
extern const test_case clients_tests[];
extern const test_case slot_tests[];
extern const test_case doorbell_tests[];
extern const test_case wait_tests[];
extern const test_case cache_tests[];
extern const test_case replicas_tests[];
extern const test_case collect_tests[];
extern const test_case lifecycle_tests[];
static const test_case *const k_suites[] = {
    layout_tests,
    clients_tests,
    slot_tests,
    doorbell_tests,
    wait_tests,
    cache_tests,
    replicas_tests,
    collect_tests,
    lifecycle_tests,
};

static const size_t k_nsuites = sizeof k_suites / sizeof k_suites[0];

/* The test called name, or NULL. */
static const test_case *find_test(const char *name) {
    for (size_t s = 0; s < k_nsuites; s++)
        for (const test_case *t = k_suites[s]; t->name; t++)
            if (strcmp(t->name, name) == 0) return t;
    return NULL;
}

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
    /* every name once among all the files' tests */
    for (size_t s = 0; s < k_nsuites; s++)
        for (const test_case *t = k_suites[s]; t->name; t++)
            if (find_test(t->name) != t) {
                fprintf(stderr, "two tests are called %s\n", t->name);
                return 2;
            }
    for (int i = 1; i < argc; i++) {
        if (!find_test(argv[i])) {
            fprintf(stderr, "unknown test %s\n", argv[i]);
            return 2;
        }
    }
    uint64_t all0 = shm_now_ns();
    int ran = 0;
    for (size_t s = 0; s < k_nsuites; s++) {
        for (const test_case *t = k_suites[s]; t->name; t++) {
            int want = argc == 1;
            for (int i = 1; i < argc; i++)
                if (strcmp(argv[i], t->name) == 0) want = 1;
            if (!want) continue;
            uint64_t t0 = shm_now_ns();
            t->fn();
            alarm(0);
            printf("ok   %-12s %.2f s\n", t->name, secs(shm_now_ns() - t0));
            ran++;
        }
    }
    g_test = "done";
    printf("ring_test (%s build): %d tests passed in %.2f s\n", BUILD_KIND,
           ran, secs(shm_now_ns() - all0));
    return 0;
}
