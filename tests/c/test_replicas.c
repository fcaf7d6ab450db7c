/*
 * test_replicas.c -- several replicas: the collect lock, batch tables, put-backs, the weights floor, the fair share (ring/replicas.h).
 */
#include "harness.h"

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

/* A replica that waits for a fuller batch (max_wait_ns > 0) takes up to
 * its cap, the tuner's even split of the whole population, and not the
 * fair share of what is ready when it looks: in a closed loop the rest of
 * its part is on its way (the clients it has just answered), and a call
 * started with the first few of them wastes a call of a model whose cost
 * is per call. */
static void test_waiting_cap(void) {
    start_test("waiting_cap", 60);
    test_seg t;
    shm_seg *s = two_replicas(&t, 8);
    scanner_arg x = {.s = s, .v = 0};
    uint32_t cursor = 0;
    x.n = shm_collect(s, 0, x.own, x.batch, 6, &cursor, 0, 1 * MS, 1 * MS);
    CHECK_MSG(x.n == 6, "a waiting replica with a cap of 6 took %d of 8 requests",
              x.n);
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

const test_case replicas_tests[] = {
    {"replicas", test_replicas},
    {"take_race", test_take_race},
    {"listed_first", test_listed_first},
    {"requeue_once", test_requeue_once},
    {"restart", test_restart},
    {"requeue_words", test_requeue_words},
    {"version_floor", test_version_floor},
    {"fair_share", test_fair_share},
    {"waiting_cap", test_waiting_cap},
    {"lock_wake", test_lock_wake},
    {"scribbled_tables", test_scribbled_tables},
    {"requeue_rings", test_requeue_rings},
    {NULL, NULL},
};
