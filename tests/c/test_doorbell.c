/*
 * test_doorbell.c -- the clients' doorbells and the ticker (ring/doorbell.h).
 */
#include "harness.h"

/* Doorbells: one batch answers sleepers of three doorbell words (clients
 * 0..31, 32..63, 64..), taken in an order that moves between the words
 * and back; every sleeper must wake promptly, not at its 10 s timeout.
 * The batch rings each word once per run of its clients (one
 * FUTEX_WAKE_BITSET with their bits): a ring of the wrong word, or of
 * the wrong bits, leaves a sleeper asleep. */
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

const test_case doorbell_tests[] = {
    {"doorbell", test_doorbell},
    {"ticker", test_ticker},
    {NULL, NULL},
};
