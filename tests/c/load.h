/*
 * load.h -- a ring under load, for the tests that need one (concurrency,
 * close): an evaluator thread that serves a deterministic model, fails
 * some batches on purpose and reclaims detached clients, and client
 * threads that check every answer, retry failed requests and sometimes
 * "die" mid-write.  conc_ctx says what to run; the threads fill in what
 * happened.
 */
#ifndef SHMEVAL_TEST_LOAD_H
#define SHMEVAL_TEST_LOAD_H

#include "harness.h"

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

/* Reclaims the detached clients' entries (the evaluator's housekeeping
 * between batches); the evaluator thread (arg: the conc_ctx) and a client
 * thread (arg: its client_arg). */
void conc_housekeeping(conc_ctx *x);
void *conc_evaluator(void *arg);
void *conc_client(void *arg);

#endif /* SHMEVAL_TEST_LOAD_H */
