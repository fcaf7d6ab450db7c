/*
 * ring.h -- the shared-memory protocol of shmeval: this header includes
 * its parts, one concept each, from ring/ beside it (all static inline).
 *
 * Everything that touches the shared segment through a pointer lives in
 * them: the segment layout, the slot state machine, the doorbells (futex
 * words inside the segment) and the evaluator's gather/scatter loops.  The
 * Cython layer (_ring.pyx) only calls their functions; Python never does
 * pointer arithmetic.  The core never allocates: the caller asks
 * shm_layout_compute() how many bytes a segment needs, maps them, and
 * shm_init() formats them.
 *
 *   ring/platform.h   system headers, assertions, test hooks, fences,
 *                     the clock, futexes
 *   ring/layout.h     constants, status codes, the segment's structs and
 *                     layout, shm_init / shm_attach
 *   ring/stats.h      counters and histograms
 *   ring/doorbell.h   the clients' doorbells, the ticker
 *   ring/wait.h       spinning, a client's wait for its answers
 *   ring/clients.h    the client table
 *   ring/slot.h       the client side of a slot: begin, publish, release
 *   ring/cache.h      the evaluation cache
 *   ring/replicas.h   several replicas: the collect lock, batch tables,
 *                     put-backs, the weights floor, the fair share
 *   ring/collect.h    the evaluator side: scan, collect, completion
 *   ring/lifecycle.h  the evaluator's and replicas' lives: serving, stop,
 *                     restart, reports, close, control
 *
 * Linux only: doorbells are futex(2) words in the shared mapping (no named
 * kernel objects to leak), liveness is read from /proc by the Python layer.
 * Every atomic operation carries a comment "MO:" naming its memory order
 * and the operation it pairs with; docs/protocol.md explains the protocol
 * as a whole.  Define SHM_DEBUG to turn on state-machine assertions.
 *
 * The rules the safety rests on (each is restated next to the code that
 * relies on it):
 *   1. One consumer: one evaluator thread at a time scans, takes and sleeps
 *      on the evaluator's doorbell (several serving threads take turns
 *      under a lock, _ring.pyx ServeGroup).
 *   2. One reclaimer, and only between batches: client entries are
 *      reclaimed by the evaluator while it holds no batch, so no slot of
 *      the entry is TAKEN (shm_client_reclaim refuses one that is).
 *   3. One pid namespace: liveness is judged by pid and /proc start time,
 *      so every process on a segment shares the creator's pid and time
 *      namespaces (recorded in the header; segment.py refuses others).
 *   4. A slot has one producer at a time: the client's process-local free
 *      list hands it to one thread, and every client-side operation names
 *      the generation it began, so a slot reclaimed meanwhile is never read,
 *      answered or released by its former owner.
 */
#ifndef SHMEVAL_RING_H
#define SHMEVAL_RING_H

#include "ring/platform.h"
#include "ring/layout.h"
#include "ring/stats.h"
#include "ring/doorbell.h"
#include "ring/wait.h"
#include "ring/clients.h"
#include "ring/slot.h"
#include "ring/cache.h"
#include "ring/replicas.h"
#include "ring/collect.h"
#include "ring/lifecycle.h"

#endif /* SHMEVAL_RING_H */
