/*
 * test_slot.c -- the client side of a slot: begin, publish, abort, release, and the row copy (ring/slot.h), through the whole state machine.
 */
#include "harness.h"

/* The slot state machine in one thread: every transition, every
 * refusal, the outputs and the error text, and the statistics. */
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
    CHECK(shm_slot_meta_at(s, 0, 0)->publish_ns >= before_pub);
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
    CHECK_EQU(shm_slot_meta_at(s, 0, 0)->model_version, 7);
    CHECK_EQ(shm_slot_meta_at(s, 0, 0)->err_len, 0);
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
    CHECK_EQ(shm_slot_meta_at(s, 0, 1)->err_len, strlen(msg));
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
        CHECK_EQU(shm_slot_meta_at(s, 0, 1)->err_len, s->l.out_area);
        CHECK(memcmp(shm_slot_out(s, 0, 1), longmsg, s->l.out_area) == 0);
        /* DONE after a FAILED: err_len is reset */
        CHECK_EQ(t_release(s, 0, 1), SHM_OK);
        CHECK_EQ(t_begin(s, 0, 1), SHM_OK);
        t_publish(s, 0, 1);
        CHECK_EQ(t_collect(s, batch, taken, 8, &cursor, 0, 0, 10 * MS), 1);
        CHECK_EQU(shm_complete(s, taken, 1, res[0], 9), 1);
        CHECK_EQ(t_wait(s, 0, 1, 0, 5 * MS), SLOT_DONE);
        CHECK_EQ(shm_slot_meta_at(s, 0, 1)->err_len, 0);
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
            CHECK_EQU(shm_slot_meta_at(s, 0, k)->model_version, 21);
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

const test_case slot_tests[] = {
    {"state", test_state},
    {"copy", test_copy},
    {"release_race", test_release_race},
    {"begin_race", test_begin_race},
    {"generations", test_generations},
    {"begin_owner", test_begin_owner},
    {"abort", test_abort},
    {NULL, NULL},
};
