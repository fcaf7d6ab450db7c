/*
 * test_clients.c -- the client table: register, detach, reclaim (ring/clients.h).
 */
#include "harness.h"

/* The reclaim of dead and detached clients' entries, between batches:
 * their slots back to FREE with a new generation, refused while a batch
 * holds one of them. */
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

const test_case clients_tests[] = {
    {"reclaim", test_reclaim},
    {"scribbled", test_scribbled},
    {"hwm_first", test_hwm_first},
    {"handover", test_handover},
    {"reclaim_wakes", test_reclaim_wakes},
    {NULL, NULL},
};
