/*
 * load.c -- a ring under load (load.h).
 */
#include "load.h"

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

void conc_housekeeping(conc_ctx *x) {
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

void *conc_evaluator(void *arg) {
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

void *conc_client(void *arg) {
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
                        CHECK(shm_slot_meta_at(s, c, k)->model_version >= 1);
                        CHECK_EQ(shm_slot_meta_at(s, c, k)->err_len, 0);
                        CHECK_EQ(t_release(s, c, k), SHM_OK);
                        CHECK_EQU(word_of(s, c, k),
                                  shm_slot_word(SLOT_FREE, shm_word_gen(w) + 1));
                        a->releases++;
                        a->done++;
                        break;
                    }
                    CHECK_MSG(rc == SLOT_FAILED, "client %u: wait returned %d",
                              a->th, rc);
                    CHECK_EQ(shm_slot_meta_at(s, c, k)->err_len, strlen(k_injected));
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
