/*
 * test_collect.c -- the evaluator side: collect, max_wait, the evaluator's doorbell, and the whole ring under load (ring/collect.h).
 */
#include "load.h"

/* The sum of a histogram's nb bins (times the bin's index: weighted). */
static uint64_t sum_hist(shm_seg *s, uint64_t (*bin)(shm_seg *, uint32_t),
                         uint32_t nb, int weighted) {
    uint64_t tot = 0;
    for (uint32_t b = 0; b < nb; b++) tot += bin(s, b) * (weighted ? b : 1);
    return tot;
}

/* Client threads against one evaluator thread, with injected batch
 * failures and clients that die mid-write (load.c): every request is
 * answered exactly once, with its own answer, and the statistics add up. */
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

static void *late_closer(void *arg) {
    closer_arg *a = arg;
    sleep_ns(a->delay_ns);
    shm_request_close(a->s);
    return NULL;
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

/* max_wait_ns: a greedy collect returns what is there at once; one that
 * waits for a fuller batch returns when it is full or its wait is over,
 * or at a close. */
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

const test_case collect_tests[] = {
    {"concurrency", test_concurrency},
    {"max_wait", test_max_wait},
    {"lost_wakeup", test_lost_wakeup},
    {NULL, NULL},
};
