/*
 * ring.h -- the whole shared-memory protocol of shmeval, in one header.
 *
 * Everything that touches the shared segment through a pointer lives here:
 * the segment layout, the slot state machine, the doorbells (futex words
 * inside the segment) and the evaluator's gather/scatter loops.  The Cython
 * layer (_ring.pyx) only calls these functions; Python never does pointer
 * arithmetic.  The core never allocates: the caller asks shm_layout_compute()
 * how many bytes a segment needs, maps them, and shm_init() formats them.
 *
 * Linux only: doorbells are futex(2) words in the shared mapping (no named
 * kernel objects to leak), liveness is read from /proc by the Python layer.
 *
 * Memory orders: every atomic operation below carries a comment "MO:" naming
 * its order and the operation it pairs with.  docs/protocol.md explains the
 * protocol as a whole.
 *
 * Define SHM_DEBUG to turn on state-machine assertions.
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

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifdef SHM_DEBUG
#include <assert.h>
#define SHM_ASSERT(x) assert(x)
#else
#define SHM_ASSERT(x) ((void)0)
#endif

/* Test hooks: ring_test.c defines SHM_HOOK(point) to park a thread at a
 * named point and so replay a chosen interleaving deterministically.  They
 * compile to nothing otherwise. */
#ifndef SHM_HOOK
#define SHM_HOOK(point) ((void)0)
#endif

/* A compiler barrier: values copied out of the segment before it are not
 * re-read from the segment after it (another process may be rewriting
 * them; see shm_attach). */
#define SHM_COMPILER_BARRIER() __asm__ __volatile__("" ::: "memory")

/* A full fence (the Dekker pairs of shm_slot_begin and
 * shm_client_reclaim): the builtin that atomic_thread_fence(
 * memory_order_seq_cst) expands to, called by name so that ring_test's
 * ThreadSanitizer build, which redefines atomic_thread_fence to model the
 * acquire fences, leaves it alone. */
#define shm_fence_seq_cst() __atomic_thread_fence(__ATOMIC_SEQ_CST)

/* ------------------------------------------------------------------ */
/* Constants                                                           */
/* ------------------------------------------------------------------ */

#define SHM_MAGIC 0x314C4156454D4853ULL /* "SHMEVAL1" little-endian */
#define SHM_LAYOUT_VERSION 9u
#define SHM_LINE 64u
#define SHM_SPEC_MAX 4096u       /* bytes of JSON spec kept in the header */
#define SHM_HIST_BINS 256u       /* log-scale latency histogram bins */
#define SHM_MAX_CLIENTS 4096u
#define SHM_MAX_SLOTS_PER_CLIENT 64u
#define SHM_MAX_BATCH 65536u
#define SHM_MAX_REPLICAS 64u     /* model replicas serving one segment */
#define SHM_MAX_SERVERS 512u     /* serving threads of all replicas */
#define SHM_DEVICE_MAX 48u       /* bytes of a replica's device name */
#define SHM_REPORT_WORDS 510u    /* 8-byte words of a replica's report */
#define SHM_MAX_ROW_BYTES (1ull << 30)
#define SHM_OWNER_RECLAIMING (-1) /* owner_pid while its entry is reclaimed */
#define SHM_CAS_TRIES 4096u       /* CAS retries on a word a client keeps
                                     changing, before another way is taken */
#define SHM_CACHE_MAX_LOG2 32u   /* at most 2^32 cache entries */
#define SHM_CACHE_MAX_BYTES (1ull << 46) /* and 64 TiB of them */
#define SHM_CACHE_WAYS 4u        /* entries per bucket */
#define SHM_ERRMSG_MIN 1024u     /* output area is at least this big: a
                                    FAILED slot carries the error text there
                                    (errors.exception_text fits it in) */

/* Status codes returned by the core.  _ring.pyx maps them to exceptions in
 * one place (_check). */
enum shm_status {
    SHM_OK = 0,
    SHM_E_TOO_SMALL = -1,   /* segment shorter than its header claims */
    SHM_E_MAGIC = -2,       /* not a shmeval segment */
    SHM_E_VERSION = -3,     /* another layout version */
    SHM_E_PARAMS = -4,      /* parameters out of range / inconsistent */
    SHM_E_SPEC = -5,        /* spec text corrupt (hash mismatch) */
    SHM_E_FULL = -6,        /* client table full */
    SHM_TIMEOUT = -7,       /* wait timed out: caller checks liveness */
    SHM_CLOSED = -8,        /* evaluator closed or closing */
    SHM_E_STATE = -9,       /* slot not in the expected state */
    SHM_CONTROL = -10,      /* shm_collect: a control request is pending */
    SHM_STALE = -11,        /* the slot's generation (or its entry's owner)
                               changed: it was reclaimed, and whatever it
                               holds now is not the caller's */
    SHM_BEHIND = -12,       /* shm_collect: the weights floor moved past
                               the replica's weights (shm_version_ok) */
};

/* Slot state word (32 bits):
 *   bits 0..6   state (enum shm_slot_state)
 *   bit  7      WAITER: the client is (about to be) asleep on its doorbell
 *               (shm_done_word); the evaluator rings it when it sees this
 *   bits 8..31  generation, bumped every time the slot returns to FREE   */
enum shm_slot_state {
    SLOT_FREE = 0,     /* owned by the client, not in use            */
    SLOT_WRITING = 1,  /* client is copying its input in             */
    SLOT_READY = 2,    /* published: evaluator may take it           */
    SLOT_TAKEN = 3,    /* in the evaluator's current batch           */
    SLOT_DONE = 4,     /* outputs written: client may read them      */
    SLOT_FAILED = 5,   /* batch failed: error text in the output area */
};
#define SLOT_STATE_MASK 0x7Fu
#define SLOT_WAITER 0x80u
#define SLOT_GEN_SHIFT 8
#define SLOT_GEN_MASK 0xFFFFFFu

static inline uint32_t shm_slot_word(uint32_t state, uint32_t gen) {
    return ((gen & SLOT_GEN_MASK) << SLOT_GEN_SHIFT) | state;
}
static inline uint32_t shm_word_state(uint32_t w) { return w & SLOT_STATE_MASK; }
static inline uint32_t shm_word_gen(uint32_t w) { return w >> SLOT_GEN_SHIFT; }

/* Statistics counters (header.st[]). */
enum shm_stat {
    ST_REQUESTS = 0,
    ST_BATCHES,
    ST_PADDED_ROWS,
    ST_FAILED_REQUESTS,
    ST_FAILED_BATCHES,
    ST_MODEL_NS,          /* total time inside the model call */
    ST_BUSY_NS,           /* serving-loop time from a batch's collect to the
                             next collect (model call included) */
    ST_SERVE_START_NS,    /* CLOCK_MONOTONIC when serving began */
    ST_MODEL_VERSION,
    ST_RECLAIMED_CLIENTS,
    ST_RECLAIMED_WRITING, /* slots found mid-write in a reclaimed client */
    ST_STALE_COMPLETIONS, /* completions refused by the generation check */
    ST_WARMUP_NS,
    ST_WEIGHT_UPDATES,    /* control requests that changed the model */
    /* The evaluation cache's counters of clients whose entries were
     * reclaimed (live clients keep theirs in shm_client). */
    ST_CACHE_HITS,
    ST_CACHE_MISSES,
    ST_CACHE_STALE,
    ST_CACHE_REPLACED,
    ST_ISOLATED_ROWS,     /* rows of failed batches found raising on their own */
    ST_ISOLATION_CALLS,   /* the extra model calls that found them */
    SHM_N_STATS = 24,
};

/* Evaluator lifecycle (header.ev_state). */
enum shm_ev_state {
    EV_STARTING = 0,
    EV_SERVING = 1,
    EV_CLOSING = 2,   /* close requested: serving loop exits */
    EV_CLOSED = 3,    /* closed by its owner; every waiter has been woken */
    EV_DIED = 4,      /* stopped for another reason (header.stop says why) */
};

/* Why the evaluator stopped (header.stop, with a detail). */
enum shm_stop_reason {
    SHM_STOP_NONE = 0,
    SHM_STOP_CLOSED = 1,       /* its owner closed it */
    SHM_STOP_OWNER_DIED = 2,   /* the process that created it died */
    SHM_STOP_CRASHED = 3,      /* its serving loop raised */
    SHM_STOP_EXITED = 4,       /* its process exited; detail: exit code, or
                                  minus the signal that killed it */
};

/* ------------------------------------------------------------------ */
/* Layout                                                              */
/* ------------------------------------------------------------------ */

typedef struct {
    uint64_t in_bytes;          /* bytes of one input row  */
    uint64_t out_bytes;         /* bytes of one output row (all outputs) */
    uint32_t max_clients;
    uint32_t slots_per_client;  /* K */
    uint32_t max_batch;
    uint32_t replicas;          /* model replicas serving the segment */
    uint32_t servers;           /* serving threads of all the replicas, the
                                   same number each (server v belongs to
                                   replica v / (servers / replicas)); each
                                   keeps its batch in a table of its own */
    uint32_t cache_log2;        /* 0: no evaluation cache; else it holds
                                   2^cache_log2 entries (2 or more) */
} shm_params;

typedef struct {
    uint64_t header_bytes;      /* fixed header + batch-size histogram */
    uint64_t replicas_off;      /* replica table */
    uint64_t servers_off;       /* the servers' batch tables */
    uint64_t server_stride;
    uint64_t clients_off;       /* client table */
    uint64_t client_stride;
    uint64_t slots_off;         /* slot data */
    uint64_t slot_stride;
    uint64_t in_off;            /* within a slot */
    uint64_t out_off;           /* within a slot */
    uint64_t out_area;          /* bytes of the output area */
    uint64_t cache_off;         /* evaluation cache (0 bytes without one) */
    uint64_t cache_stride;      /* bytes of one cache entry */
    uint64_t cache_words;       /* data words of one entry */
    uint64_t total;             /* bytes of the whole segment */
} shm_layout;

typedef struct {
    /* --- identity: written once by shm_init, read-only after --- */
    uint64_t magic;
    uint32_t layout_version;
    uint32_t spec_len;
    uint64_t spec_hash;         /* FNV-1a of spec[0..spec_len) */
    uint64_t total_bytes;
    shm_params params;
    int32_t owner_pid;
    int32_t _pad0;
    /* The creator's pid and time namespaces (inode numbers of
     * /proc/self/ns/pid and /proc/self/ns/time; 0 = unknown).  Pids and
     * /proc start times mean something only within one pid namespace and
     * one time namespace: segment.py refuses to attach from others and
     * cleanup never judges a segment of another. */
    uint64_t pid_ns;
    uint64_t time_ns;
    /* The creator's /proc start time (clock ticks since boot; 0 =
     * unknown): with its pid, who it is, even after the pid is reused or
     * a namespace's inode number is (cleanup, the serving loop). */
    uint64_t owner_starttime;
    char spec[SHM_SPEC_MAX];

    /* --- evaluator lifecycle (the replicas' own words: shm_replica) --- */
    _Alignas(SHM_LINE) _Atomic uint32_t ev_state; /* enum shm_ev_state */
    _Atomic uint32_t replicas_serving; /* replicas in REPLICA_SERVING */
    _Atomic uint64_t heartbeat_ns;    /* CLOCK_MONOTONIC of the last loop */
    /* Control requests (e.g. weight updates) for the serving loops: the
     * controller bumps ctl_req, each replica sets its ctl_done once handled.
     * The payload travels outside the segment; these words only make the
     * loops return between batches and say how many requests are pending. */
    _Atomic uint32_t ctl_req;
    /* Restarts of a dead serving process its owner may still make
     * (Evaluator.spawn(restarts=)); lowered by the owner once each restart
     * ended, 0 for an evaluator that does not heal.  While it is not 0 and
     * the owner lives, a client waits through a moment with no replica
     * alive instead of raising EvaluatorDied (shm_restarts_left). */
    _Atomic uint32_t restarts_left;
    /* Why it stopped: reason << 32 | (uint32_t)detail, written once by
     * shm_close_and_wake (the first caller's reason wins). */
    _Atomic uint64_t stop;
    /* The newest weights version any replica has collected a batch with
     * (or the owner has seen applied): no replica collects with older ones
     * while one serves it (shm_version_ok), so a worker does not see
     * versions go backwards across replicas. */
    _Atomic uint64_t version_floor;

    /* --- the collect lock of several replicas: 0 free, else the holding
     * server's id (index + 1) | SHM_LOCK_WAITERS when someone may sleep on
     * it (shm_collect_lock) --- */
    _Alignas(SHM_LINE) _Atomic uint32_t collect_lock;

    /* --- the evaluation cache's oldest acceptable model version: the
     * owner raises it when new weights serve (shm_cache_set_version);
     * every lookup reads it, so it has a line of its own --- */
    _Alignas(SHM_LINE) _Atomic uint64_t cache_version;

    /* --- evaluator doorbell: written by every client on every submit --- */
    _Alignas(SHM_LINE) _Atomic uint32_t submit_seq; /* futex word */
    _Atomic uint32_t ev_sleeping;     /* 1 while the evaluator may sleep */

    /* --- client doorbells: word c / 32 is the futex of clients 32g..32g+31,
     * bit c % 32 theirs in FUTEX_WAIT_BITSET; the evaluator bumps a word
     * and wakes the bits of a batch's waiters in one FUTEX_WAKE_BITSET --- */
    _Alignas(SHM_LINE) _Atomic uint32_t done_seq[SHM_MAX_CLIENTS / 32];

    /* --- client table bookkeeping --- */
    _Alignas(SHM_LINE) _Atomic uint32_t clients_hwm; /* 1 + highest index
                                                        ever claimed */
    _Atomic uint32_t n_attached;
    /* How crowded the evaluator's CPUs are with runnable tasks, its own
     * processes and any other program's (enum shm_crowding; written by the
     * evaluator's tuner, SHM_CROWD_NONE without one).  Clients read it with
     * n_attached, on this line, before every wait (_ring.pyx, _spin). */
    _Atomic uint32_t crowding;

    /* --- statistics: written by the evaluator's serving threads, relaxed --- */
    _Alignas(SHM_LINE) _Atomic uint64_t st[SHM_N_STATS];            /* enum shm_stat */
    _Atomic uint64_t hist_wait[SHM_HIST_BINS];   /* publish -> taken */
    _Atomic uint64_t hist_model[SHM_HIST_BINS];  /* model call per batch */
    /* followed by _Atomic uint64_t batch_hist[max_batch + 1] */
} shm_header;

/* segment.py reads these with pread, without mapping the segment (cleanup
 * of segments it cannot attach to). */
_Static_assert(offsetof(shm_header, owner_pid) == 72, "owner_pid offset");
_Static_assert(offsetof(shm_header, pid_ns) == 80, "pid_ns offset");
_Static_assert(offsetof(shm_header, time_ns) == 88, "time_ns offset");
_Static_assert(offsetof(shm_header, owner_starttime) == 96,
               "owner_starttime offset");

/* A replica's state (shm_replica.state). */
enum shm_replica_state {
    REPLICA_EMPTY = 0,     /* not started */
    REPLICA_SERVING = 1,   /* its serving loop runs (shm_set_serving) */
    REPLICA_STOPPED = 2,   /* it left its serving loop */
    REPLICA_DEAD = 3,      /* another found its process gone: its batches
                              were put back for the others to serve */
};

/* One model replica: a serving process (or the owner's serving thread) with
 * its own model.  Written by the replica itself, but `state`, which others
 * move to DEAD when they find it gone. */
typedef struct {
    _Atomic int32_t pid;
    _Atomic uint32_t state;           /* enum shm_replica_state */
    _Atomic uint64_t starttime;       /* /proc/<pid>/stat field 22 */
    _Atomic uint64_t version;         /* the weights it serves */
    _Atomic uint32_t ctl_done;        /* control tickets it has handled */
    uint32_t _pad;
    _Atomic uint64_t requests;        /* its statistics */
    _Atomic uint64_t batches;
    _Atomic uint64_t model_ns;
    char device[SHM_DEVICE_MAX];      /* "cuda:1", "cpu", ... (set once) */
    /* A text the replica publishes for any reader (its tuner's report, as
     * JSON): report_len bytes in report[], behind report_seq, which is odd
     * while the replica rewrites it (shm_report_write; one writer). */
    _Atomic uint64_t report_seq;
    _Atomic uint64_t report_len;
    _Atomic uint64_t report[SHM_REPORT_WORDS];
} shm_replica;

/* One slot of a serving thread's current batch. */
typedef struct {
    uint32_t client;
    uint32_t slot;
    uint32_t gen;
    uint32_t wake; /* shm_finish: the client was asleep */
} shm_taken;

/* A serving thread's current batch, in the segment so that when its
 * replica dies another can put the batch's requests back (shm_requeue):
 * `n` entries of shm_taken follow it, up to max_batch. */
typedef struct {
    _Atomic uint32_t n;
    uint32_t replica;
    char _pad[SHM_LINE - 8];
} shm_server_head;

/* One client table entry; followed in the same stride by K state words. */
typedef struct {
    _Atomic int32_t owner_pid;        /* 0 = free; else the owner's pid */
    _Atomic uint32_t detached;        /* 1 = owner left; evaluator reclaims */
    _Atomic uint64_t starttime;       /* owner's start time (pid reuse) */
    _Atomic uint64_t pid_ns;          /* owner's pid namespace, 0 = unknown */
    _Atomic uint64_t requests;        /* published by this entry's owner(s) */
    /* Its owner's lookups in the evaluation cache (shm_cache_get) and the
     * live entries of other states its answers replaced (shm_cache_put). */
    _Atomic uint64_t cache_hits;
    _Atomic uint64_t cache_misses;
    _Atomic uint64_t cache_stale;     /* misses that found an older version */
    _Atomic uint64_t cache_replaced;
    /* _Atomic uint32_t state[K], on the next cache line(s) */
} shm_client;
_Static_assert(sizeof(shm_client) == SHM_LINE, "shm_client is one line");

/* Per-slot metadata at the start of each slot's data area. */
typedef struct {
    uint64_t publish_ns;        /* written by the client before READY */
    uint64_t model_version;     /* written by the evaluator before DONE */
    uint32_t err_len;           /* FAILED: bytes of text in the out area */
    uint32_t _pad;
} shm_slot_meta;

static inline uint64_t shm_round_up(uint64_t x, uint64_t a) {
    return (x + a - 1) / a * a;
}

/* Computes the layout for params; SHM_E_PARAMS when out of range. */
static inline int shm_layout_compute(const shm_params *p, shm_layout *l) {
    if (p->in_bytes == 0 || p->in_bytes > SHM_MAX_ROW_BYTES ||
        p->out_bytes == 0 || p->out_bytes > SHM_MAX_ROW_BYTES ||
        p->max_clients == 0 || p->max_clients > SHM_MAX_CLIENTS ||
        p->slots_per_client == 0 ||
        p->slots_per_client > SHM_MAX_SLOTS_PER_CLIENT ||
        p->max_batch == 0 || p->max_batch > SHM_MAX_BATCH)
        return SHM_E_PARAMS;
    if (p->replicas == 0 || p->replicas > SHM_MAX_REPLICAS ||
        p->servers < p->replicas || p->servers > SHM_MAX_SERVERS ||
        p->servers % p->replicas != 0)
        return SHM_E_PARAMS;
    l->header_bytes = shm_round_up(
        sizeof(shm_header) + sizeof(uint64_t) * ((uint64_t)p->max_batch + 1),
        SHM_LINE);
    l->replicas_off = l->header_bytes;
    l->servers_off = l->replicas_off +
        shm_round_up(sizeof(shm_replica) * p->replicas, SHM_LINE);
    l->server_stride = sizeof(shm_server_head) +
        shm_round_up(sizeof(shm_taken) * p->max_batch, SHM_LINE);
    l->clients_off = l->servers_off + l->server_stride * p->servers;
    l->client_stride =
        sizeof(shm_client) +
        shm_round_up(sizeof(uint32_t) * p->slots_per_client, SHM_LINE);
    l->slots_off = shm_round_up(
        l->clients_off + l->client_stride * p->max_clients, 4096);
    l->in_off = shm_round_up(sizeof(shm_slot_meta), SHM_LINE);
    l->out_off = l->in_off + shm_round_up(p->in_bytes, SHM_LINE);
    l->out_area = shm_round_up(
        p->out_bytes > SHM_ERRMSG_MIN ? p->out_bytes : SHM_ERRMSG_MIN,
        SHM_LINE);
    l->slot_stride = l->out_off + l->out_area;
    uint64_t end = l->slots_off + l->slot_stride * (uint64_t)p->max_clients *
                                      p->slots_per_client;
    l->cache_off = shm_round_up(end, 4096);
    l->cache_words = (p->out_bytes + 7) / 8;
    l->cache_stride = 32 + 8 * l->cache_words; /* shm_cache_entry + data */
    if (p->cache_log2 == 0) {
        l->total = end;
        return SHM_OK;
    }
    if (p->cache_log2 < 2 || p->cache_log2 > SHM_CACHE_MAX_LOG2 ||
        l->cache_stride > (SHM_CACHE_MAX_BYTES >> p->cache_log2))
        return SHM_E_PARAMS;
    l->total = l->cache_off + (l->cache_stride << p->cache_log2);
    return SHM_OK;
}

static inline uint64_t shm_fnv1a(const char *s, uint32_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (uint32_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ULL;
    }
    return h;
}

/* A segment as seen by one process: its base address and its layout. */
typedef struct {
    char *base;
    shm_layout l;
    shm_params p;
    /* The spec text, copied once at attach (and hash-checked as copied):
     * a peer rewriting the header cannot change what this process read. */
    uint32_t spec_len;
    char spec[SHM_SPEC_MAX];
} shm_seg;

static inline shm_header *shm_hdr(const shm_seg *s) {
    return (shm_header *)s->base;
}
static inline _Atomic uint64_t *shm_batch_hist(const shm_seg *s) {
    return (_Atomic uint64_t *)(s->base + sizeof(shm_header));
}
static inline shm_client *shm_client_at(const shm_seg *s, uint32_t c) {
    return (shm_client *)(s->base + s->l.clients_off + s->l.client_stride * c);
}
static inline shm_replica *shm_replica_at(const shm_seg *s, uint32_t r) {
    return (shm_replica *)(s->base + s->l.replicas_off) + r;
}
static inline shm_server_head *shm_server_at(const shm_seg *s, uint32_t v) {
    return (shm_server_head *)(s->base + s->l.servers_off +
                               s->l.server_stride * v);
}
/* The replica server v belongs to, from the parameters (the copy in the
 * server's head, written by shm_server_init, is for readers of the segment
 * only: it could have been scribbled on). */
static inline uint32_t shm_server_replica(const shm_seg *s, uint32_t v) {
    return v / (s->p.servers / s->p.replicas);
}
/* The segment's copy of server v's batch table (max_batch entries). */
static inline shm_taken *shm_server_taken(const shm_seg *s, uint32_t v) {
    return (shm_taken *)(shm_server_at(s, v) + 1);
}
static inline _Atomic uint32_t *shm_slot_word_at(const shm_seg *s, uint32_t c,
                                                 uint32_t k) {
    return (_Atomic uint32_t *)((char *)shm_client_at(s, c) +
                                sizeof(shm_client)) + k;
}
static inline char *shm_slot_data(const shm_seg *s, uint32_t c, uint32_t k) {
    return s->base + s->l.slots_off +
           s->l.slot_stride * ((uint64_t)c * s->p.slots_per_client + k);
}
static inline shm_slot_meta *shm_slot_meta_at(const shm_seg *s, uint32_t c,
                                              uint32_t k) {
    return (shm_slot_meta *)shm_slot_data(s, c, k);
}
static inline char *shm_slot_in(const shm_seg *s, uint32_t c, uint32_t k) {
    return shm_slot_data(s, c, k) + s->l.in_off;
}
static inline char *shm_slot_out(const shm_seg *s, uint32_t c, uint32_t k) {
    return shm_slot_data(s, c, k) + s->l.out_off;
}

/* Formats a freshly created, zero-filled segment of `size` bytes for the
 * process owner_pid (started at owner_starttime) living in the given pid
 * and time namespaces. */
static inline int shm_init(shm_seg *s, char *base, uint64_t size,
                           const shm_params *p, const char *spec,
                           uint32_t spec_len, int32_t owner_pid,
                           uint64_t owner_starttime, uint64_t pid_ns,
                           uint64_t time_ns) {
    int rc = shm_layout_compute(p, &s->l);
    if (rc != SHM_OK) return rc;
    if (spec_len > SHM_SPEC_MAX) return SHM_E_SPEC;
    if (size < s->l.total) return SHM_E_TOO_SMALL;
    s->base = base;
    s->p = *p;
    s->spec_len = spec_len;
    if (spec_len) memcpy(s->spec, spec, spec_len);
    shm_header *h = shm_hdr(s);
    memset(base, 0, s->l.slots_off); /* header + client table */
    h->layout_version = SHM_LAYOUT_VERSION;
    h->spec_len = spec_len;
    if (spec_len) memcpy(h->spec, spec, spec_len);
    h->spec_hash = shm_fnv1a(spec, spec_len);
    h->total_bytes = s->l.total;
    h->params = *p;
    h->owner_pid = owner_pid;
    h->owner_starttime = owner_starttime;
    h->pid_ns = pid_ns;
    h->time_ns = time_ns;
    /* MO: release; pairs with the acquire load of magic in shm_attach, so
     * an attacher that sees the magic sees a fully formatted header. */
    atomic_store_explicit((_Atomic uint64_t *)&h->magic, SHM_MAGIC,
                          memory_order_release);
    return SHM_OK;
}

/* Validates an existing segment of `size` bytes.  Never reads out of
 * bounds, whatever the segment holds and however another process of the
 * user rewrites it meanwhile: every field it relies on is read once into
 * this process's memory (s), checked there, and used only from there. */
static inline int shm_attach(shm_seg *s, char *base, uint64_t size) {
    if (size < sizeof(shm_header)) return SHM_E_TOO_SMALL;
    shm_header *h = (shm_header *)base;
    /* MO: acquire; pairs with the release store of magic in shm_init. */
    uint64_t magic = atomic_load_explicit((_Atomic uint64_t *)&h->magic,
                                          memory_order_acquire);
    if (magic != SHM_MAGIC) return SHM_E_MAGIC;
    if (h->layout_version != SHM_LAYOUT_VERSION) return SHM_E_VERSION;
    shm_params p;
    uint64_t total, hash;
    memcpy(&p, &h->params, sizeof p);
    total = h->total_bytes;
    hash = h->spec_hash;
    /* MO: relaxed; read once, then only the local copy is used. */
    uint32_t spec_len = atomic_load_explicit(
        (_Atomic uint32_t *)&h->spec_len, memory_order_relaxed);
    SHM_COMPILER_BARRIER(); /* the checks below see the copies only */
    shm_layout l;
    if (shm_layout_compute(&p, &l) != SHM_OK) return SHM_E_PARAMS;
    if (total != l.total) return SHM_E_PARAMS;
    if (size < l.total) return SHM_E_TOO_SMALL;
    if (spec_len > SHM_SPEC_MAX) return SHM_E_SPEC;
    memcpy(s->spec, h->spec, spec_len);
    SHM_COMPILER_BARRIER();
    if (shm_fnv1a(s->spec, spec_len) != hash) return SHM_E_SPEC;
    s->base = base;
    s->p = p;
    s->l = l;
    s->spec_len = spec_len;
    return SHM_OK;
}

/* ------------------------------------------------------------------ */
/* Time, spinning and futexes                                          */
/* ------------------------------------------------------------------ */

static inline uint64_t shm_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The pause between two looks of a spin.  A spin reads the clock once
 * every SHM_SPIN_LOOKS looks, so the pause also sets how often that is.
 * x86: `pause`, a hint that also stalls the core for a while.  AArch64:
 * `isb`, not `yield`: `yield` is a NOP on cores without SMT (the Neoverse
 * cores of Graviton and Grace among them), so a spin would read the clock
 * and call sched_yield() every fraction of a µs instead of every few µs;
 * `isb` waits for the pipeline to drain, a stall of some tens of ns like
 * `pause` (Rust's spin_loop hint made the same switch).
 * Elsewhere nothing: the looks are atomic loads, which the compiler
 * cannot merge, so the spin stays correct, only busier. */
static inline void shm_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("isb");
#endif
}

/* Copy of one state between a slot and a batch row (no overlap).
 *
 * A slot's input area starts on a cache line; a batch row starts wherever
 * n * in_bytes falls (a Go state, 24,548 bytes, is 4-byte aligned).  glibc's
 * memcpy aligns the stores, so when the two differ in their offset within a
 * line every load of the gather spans two lines.  Loading line by line and
 * storing unaligned instead was about a third faster for Go rows on the
 * development machine (bench/c/row_copy.c; docs/performance.md).  Small
 * copies, copies whose ends share their offset in the line, x86 CPUs
 * without AVX2 and every other architecture (AArch64: the line-load path
 * was measured on x86 only) use memcpy. */
#define SHM_COPY_MIN 2048u

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SHM_HAVE_LINE_COPY 1
__attribute__((target("avx2"))) static void
shm_copy_line_loads(char *dst, const char *src, size_t n) {
    size_t head = (SHM_LINE - ((uintptr_t)src & (SHM_LINE - 1))) & (SHM_LINE - 1);
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 2 * SHM_LINE; n -= 2 * SHM_LINE) {
        __m256i a = _mm256_load_si256((const __m256i *)src);
        __m256i b = _mm256_load_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_load_si256((const __m256i *)(src + 64));
        __m256i d = _mm256_load_si256((const __m256i *)(src + 96));
        _mm256_storeu_si256((__m256i *)dst, a);
        _mm256_storeu_si256((__m256i *)(dst + 32), b);
        _mm256_storeu_si256((__m256i *)(dst + 64), c);
        _mm256_storeu_si256((__m256i *)(dst + 96), d);
        src += 2 * SHM_LINE;
        dst += 2 * SHM_LINE;
    }
    memcpy(dst, src, n);
}
#endif

static inline void shm_copy(char *dst, const char *src, size_t n) {
#ifdef SHM_HAVE_LINE_COPY
    if (n >= SHM_COPY_MIN &&
        (((uintptr_t)dst ^ (uintptr_t)src) & (SHM_LINE - 1)) != 0 &&
        __builtin_cpu_supports("avx2")) {
        shm_copy_line_loads(dst, src, n);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* A spin budget with this bit set gives the CPU away between all looks
 * (sched_yield() instead of pause), not only every SHM_SPIN_LOOKS of them:
 * the waiter spins only while no other task wants its CPU.  _ring.pyx's _spin_policy sets it when the clients
 * and the evaluator are one process more than the CPUs (docs/protocol.md,
 * Waiting).  The bit is not part of the budget. */
#define SHM_SPIN_YIELD (1ull << 63)
/* A plain spin reads the clock once every SHM_SPIN_LOOKS looks, and gives
 * the CPU away there as well (sched_yield(), which returns at once when no
 * other task on this CPU is runnable).  The processes fitting the CPUs does
 * not mean each has a CPU of its own: a futex wake-up may move the woken
 * process onto its waker's CPU, and a spin that held that CPU for its whole
 * budget then kept the process it waits for from running at all.  The
 * yield hands it over within SHM_SPIN_LOOKS looks (a few µs), at the price
 * of a system call per clock read (docs/protocol.md, Waiting). */
#define SHM_SPIN_LOOKS 64u
#ifndef shm_sched_yield /* ring_test.c counts the calls */
#define shm_sched_yield() sched_yield()
#endif

/* The pause after look i of a spin that must end at `end` (CLOCK_MONOTONIC
 * ns): a yielding spin reads the clock and yields after every look, a
 * plain one pauses and does both after every SHM_SPIN_LOOKS looks.
 * Returns 1 once `end` has passed (the spin is over). */
static inline int shm_spin_pause(uint32_t i, uint64_t end, int yield) {
    if (yield || i % SHM_SPIN_LOOKS == SHM_SPIN_LOOKS - 1) {
        if (shm_now_ns() >= end) return 1;
        shm_sched_yield();
    } else {
        shm_cpu_relax();
    }
    return 0;
}

/* No timeout or deadline: a futex wait without a timer. */
#define SHM_NO_DEADLINE UINT64_MAX

/* Not FUTEX_PRIVATE: the words live in a mapping shared between processes.
 * A relative timeout, or SHM_NO_DEADLINE. */
static inline int shm_futex_wait(_Atomic uint32_t *w, uint32_t expected,
                                 uint64_t timeout_ns) {
    struct timespec ts;
    ts.tv_sec = (time_t)(timeout_ns / 1000000000ull);
    ts.tv_nsec = (long)(timeout_ns % 1000000000ull);
    return (int)syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, expected,
                        timeout_ns == SHM_NO_DEADLINE ? NULL : &ts, NULL, 0);
}

static inline void shm_futex_wake(_Atomic uint32_t *w, int n) {
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, n, NULL, NULL, 0);
}

/* FUTEX_WAIT_BITSET: sleeps while *w == expected until a wake whose bits
 * meet `bits`, or until the CLOCK_MONOTONIC time deadline_ns.  With
 * SHM_NO_DEADLINE the kernel arms no timer at all: on the development
 * machine arming and cancelling the hrtimer of every sleep cost ~10% of the
 * round trips of 16 clients on 2 cores (docs/protocol.md, Waiting). */
static inline int shm_futex_wait_bits(_Atomic uint32_t *w, uint32_t expected,
                                      uint64_t deadline_ns, uint32_t bits) {
    struct timespec ts;
    ts.tv_sec = (time_t)(deadline_ns / 1000000000ull);
    ts.tv_nsec = (long)(deadline_ns % 1000000000ull);
    return (int)syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT_BITSET, expected,
                        deadline_ns == SHM_NO_DEADLINE ? NULL : &ts, NULL,
                        bits);
}

/* Wakes every waiter on w whose bits meet `bits`. */
static inline void shm_futex_wake_bits(_Atomic uint32_t *w, uint32_t bits) {
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE_BITSET, INT_MAX, NULL, NULL,
            bits);
}

/* A doorbell ring: a new value, then the wake.  MO: release; what the
 * ringer changed before it is visible to a waiter whose acquire load of the
 * word sees the new value (see shm_slot_wait_ticked). */
static inline void shm_ring_word(_Atomic uint32_t *bell, uint32_t bits) {
    atomic_fetch_add_explicit(bell, 1, memory_order_release);
    shm_futex_wake_bits(bell, bits);
}

static inline uint32_t shm_hist_bin(uint64_t ns) {
    if (ns < 4) return (uint32_t)ns;
    uint32_t msb = 63u - (uint32_t)__builtin_clzll(ns);
    uint32_t b = 4u * (msb - 1u) + (uint32_t)((ns >> (msb - 2u)) & 3u);
    return b < SHM_HIST_BINS ? b : SHM_HIST_BINS - 1;
}

/* Counter bump.  Several serving threads of one evaluator may record
 * batches at once (pipelined serving), so this is an atomic add; relaxed,
 * readers only want an eventually consistent figure, and on x86 it costs
 * one locked instruction on a line the evaluator already owns. */
/* Raises *w to at least v, never lowering it: a CAS loop whose successful
 * CAS has order `mo` (the caller's MO comment says what it pairs with). */
static inline void shm_raise_word(_Atomic uint64_t *w, uint64_t v,
                                  memory_order mo) {
    uint64_t cur = atomic_load_explicit(w, memory_order_relaxed);
    while (cur < v && !atomic_compare_exchange_weak_explicit(
                          w, &cur, v, mo, memory_order_relaxed)) {
    }
}

static inline void shm_stat_add(_Atomic uint64_t *x, uint64_t v) {
    /* MO: relaxed; statistics only, no data is published through them. */
    atomic_fetch_add_explicit(x, v, memory_order_relaxed);
}

/* ------------------------------------------------------------------ */
/* Client table                                                        */
/* ------------------------------------------------------------------ */

/* 1 + the highest client index ever claimed, clamped to max_clients (from
 * the process-local params checked at attach): a segment scribbled on by
 * another process of the same user must not make anyone index past the
 * client table. */
static inline uint32_t shm_clients_hwm(shm_seg *s) {
    /* MO: acquire; pairs with the release CAS in shm_client_register. */
    uint32_t hwm = atomic_load_explicit(&shm_hdr(s)->clients_hwm,
                                        memory_order_acquire);
    return hwm < s->p.max_clients ? hwm : s->p.max_clients;
}

/* Claims a free client entry for process pid (its /proc start time and pid
 * namespace, 0 when unknown); returns its index or SHM_E_FULL.
 *
 * Everything that must cover the entry happens before the claim, so that a
 * claimer killed at any point leaves nothing unaccounted for: the
 * high-water mark (which bounds the evaluator's scans and its liveness
 * checks) is raised first, and n_attached is counted first (and taken back
 * if the claim fails), so a process killed between the two over-counts
 * this hint by one rather than wrapping it below zero at the reclaim. */
static inline int shm_client_register(shm_seg *s, int32_t pid,
                                      uint64_t starttime, uint64_t pid_ns) {
    shm_header *h = shm_hdr(s);
    if (pid <= 0) return SHM_E_PARAMS; /* 0 marks a free entry */
    for (uint32_t c = 0; c < s->p.max_clients; c++) {
        shm_client *e = shm_client_at(s, c);
        /* MO: relaxed; a pre-check only, the CAS below decides. */
        if (atomic_load_explicit(&e->owner_pid, memory_order_relaxed) != 0)
            continue;
        uint32_t hwm =
            atomic_load_explicit(&h->clients_hwm, memory_order_relaxed);
        /* MO: release CAS; pairs with the acquire load of clients_hwm in
         * shm_clients_hwm (the evaluator's scans and housekeeping). */
        while (hwm < c + 1 &&
               !atomic_compare_exchange_weak_explicit(
                   &h->clients_hwm, &hwm, c + 1, memory_order_release,
                   memory_order_relaxed)) {
        }
        /* MO: relaxed; a hint for spin decisions and stats. */
        atomic_fetch_add_explicit(&h->n_attached, 1, memory_order_relaxed);
        int32_t expected = 0;
        /* MO: acq_rel CAS; the acquire half pairs with the release store of
         * owner_pid = 0 in shm_client_reclaim, so the slot words the
         * evaluator reset (FREE, new generation) are visible to us. */
        if (atomic_compare_exchange_strong_explicit(
                &e->owner_pid, &expected, pid, memory_order_acq_rel,
                memory_order_relaxed)) {
            SHM_HOOK("register_claimed");
            /* MO: relaxed (both); only read by the evaluator's liveness
             * check, which treats 0 as "not yet known". */
            atomic_store_explicit(&e->starttime, starttime,
                                  memory_order_relaxed);
            atomic_store_explicit(&e->pid_ns, pid_ns, memory_order_relaxed);
            /* MO: relaxed; an entry handed out has detached == 0 already
             * (reset before owner_pid was released). */
            SHM_ASSERT(atomic_load_explicit(&e->detached,
                                            memory_order_relaxed) == 0);
            return (int)c;
        }
        /* MO: relaxed; taking back our count, as above. */
        atomic_fetch_sub_explicit(&h->n_attached, 1, memory_order_relaxed);
    }
    return SHM_E_FULL;
}

/* The owner leaves; the evaluator reclaims the entry between batches. */
static inline void shm_client_detach(shm_seg *s, uint32_t c) {
    /* MO: release; pairs with the acquire load in shm_client_info, so the
     * owner's last slot writes happen before the reclaim. */
    atomic_store_explicit(&shm_client_at(s, c)->detached, 1,
                          memory_order_release);
}

/* Requests published through entry c so far (statistics). */
static inline uint64_t shm_client_requests(shm_seg *s, uint32_t c) {
    /* MO: relaxed; a statistic. */
    return atomic_load_explicit(&shm_client_at(s, c)->requests,
                                memory_order_relaxed);
}

/* Reads an entry for the evaluator's housekeeping. */
static inline int32_t shm_client_info(shm_seg *s, uint32_t c,
                                      uint64_t *starttime, uint64_t *pid_ns,
                                      uint32_t *detached) {
    shm_client *e = shm_client_at(s, c);
    /* MO: acquire (owner_pid, detached); pairs with the CAS in register and
     * the release store in detach.  The identity words are relaxed: 0 reads
     * as "not yet known". */
    int32_t pid = atomic_load_explicit(&e->owner_pid, memory_order_acquire);
    *starttime = atomic_load_explicit(&e->starttime, memory_order_relaxed);
    *pid_ns = atomic_load_explicit(&e->pid_ns, memory_order_relaxed);
    *detached = atomic_load_explicit(&e->detached, memory_order_acquire);
    return pid;
}

/* Evaluator only, between batches: resets the slots of a dead or detached
 * client and frees its entry.  Returns how many slots were stranded
 * mid-write (the client died between claiming and publishing), or
 * SHM_E_STATE, changing nothing, if a slot of the entry is TAKEN: a batch
 * is in flight, and its completion (shm_still_taken, then the output copy)
 * relies on no reclaim happening until it is finished (rule 2 above).
 *
 * The slot words are reset by CAS, not plain stores: a thread of a
 * detached but live owner may still release one of them (by CAS from the
 * generation it began), and each of those transitions must be one
 * indivisible step so that every slot ends FREE with a newer generation. */
static inline int shm_client_reclaim(shm_seg *s, uint32_t c) {
    shm_header *h = shm_hdr(s);
    shm_client *e = shm_client_at(s, c);
    int writing = 0;
    uint32_t K = s->p.slots_per_client;
    for (uint32_t k = 0; k < K; k++) {
        /* MO: relaxed; only the evaluator (the caller) moves a slot into
         * TAKEN, so this check cannot be overtaken. */
        uint32_t cur = atomic_load_explicit(shm_slot_word_at(s, c, k),
                                            memory_order_relaxed);
        if (shm_word_state(cur) == SLOT_TAKEN) return SHM_E_STATE;
    }
    /* Fence out a begin of the former owner that is still running: see
     * shm_slot_begin.  MO: relaxed store, then a seq_cst fence before the
     * words are moved on; pairs with the fence in shm_slot_begin. */
    atomic_store_explicit(&e->owner_pid, SHM_OWNER_RECLAIMING,
                          memory_order_relaxed);
    shm_fence_seq_cst();
    for (uint32_t k = 0; k < K; k++) {
        _Atomic uint32_t *w = shm_slot_word_at(s, c, k);
        /* MO: relaxed; the handover to the next owner is published by the
         * release store of owner_pid below. */
        uint32_t old = atomic_load_explicit(w, memory_order_relaxed);
        while (!atomic_compare_exchange_weak_explicit(
            w, &old, shm_slot_word(SLOT_FREE, shm_word_gen(old) + 1),
            memory_order_relaxed, memory_order_relaxed)) {
        }
        if (shm_word_state(old) == SLOT_WRITING) writing++;
    }
    atomic_store_explicit(&e->detached, 0, memory_order_relaxed);
    atomic_store_explicit(&e->starttime, 0, memory_order_relaxed);
    atomic_store_explicit(&e->pid_ns, 0, memory_order_relaxed);
    atomic_store_explicit(&e->requests, 0, memory_order_relaxed);
    /* The cache counters go to the totals (st[]), so that they outlive the
     * client; they are the stats the entry's next owner starts from. */
    shm_stat_add(&h->st[ST_CACHE_HITS],
                 atomic_exchange_explicit(&e->cache_hits, 0, memory_order_relaxed));
    shm_stat_add(&h->st[ST_CACHE_MISSES],
                 atomic_exchange_explicit(&e->cache_misses, 0, memory_order_relaxed));
    shm_stat_add(&h->st[ST_CACHE_STALE],
                 atomic_exchange_explicit(&e->cache_stale, 0, memory_order_relaxed));
    shm_stat_add(&h->st[ST_CACHE_REPLACED],
                 atomic_exchange_explicit(&e->cache_replaced, 0,
                                          memory_order_relaxed));
    /* A thread of a detached owner may still wait on a slot reclaimed
     * here: its doorbell rings, so that it sees the new generation now,
     * not at its next tick. */
    shm_ring_word(&h->done_seq[c / 32u], 1u << (c % 32u));
    /* MO: relaxed; a hint (clients fetch_add it too, hence atomic RMW). */
    atomic_fetch_sub_explicit(&h->n_attached, 1, memory_order_relaxed);
    shm_stat_add(&h->st[ST_RECLAIMED_CLIENTS], 1);
    shm_stat_add(&h->st[ST_RECLAIMED_WRITING], (uint64_t)writing);
    /* MO: release; pairs with the acquire half of the CAS in
     * shm_client_register: the resets above are visible to the next owner. */
    atomic_store_explicit(&e->owner_pid, 0, memory_order_release);
    return writing;
}

/* ------------------------------------------------------------------ */
/* Client side of a slot                                               */
/* ------------------------------------------------------------------ */

/* FREE -> WRITING for process pid, which must own entry c.  Stores the
 * slot's generation in *gen: every later client-side step on this request
 * (wait, release) names it, and refuses a slot whose generation moved on.
 * Returns SHM_OK; SHM_STALE when the entry is no longer pid's (it was
 * detached and reclaimed, perhaps claimed by another process); SHM_E_STATE
 * when the slot is not FREE.
 *
 * The process-local free list hands a slot to one thread at a time (rule 4
 * above); the CAS makes that hold across processes too: should two
 * processes ever act on one entry (a handle closed with requests still in
 * flight, its entry reclaimed and claimed again), only one of them begins
 * a given FREE slot, and the other gets an error instead of the first
 * one's answer. */
static inline int shm_slot_begin(shm_seg *s, uint32_t c, uint32_t k,
                                 int32_t pid, uint32_t *gen) {
    _Atomic uint32_t *w = shm_slot_word_at(s, c, k);
    /* MO: relaxed; a check that the entry is still ours, narrowing the
     * window that the CAS below closes. */
    if (atomic_load_explicit(&shm_client_at(s, c)->owner_pid,
                             memory_order_relaxed) != pid)
        return SHM_STALE;
    SHM_HOOK("begin_checked");
    /* MO: relaxed; the CAS below decides. */
    uint32_t old = atomic_load_explicit(w, memory_order_relaxed);
    SHM_HOOK("begin_loaded");
    if (shm_word_state(old) != SLOT_FREE) return SHM_E_STATE;
    /* MO: relaxed; nothing is published by WRITING (the reclaimer only
     * counts it, the evaluator ignores it); the input is published by the
     * release store of READY. */
    uint32_t writing = shm_slot_word(SLOT_WRITING, shm_word_gen(old));
    if (!atomic_compare_exchange_strong_explicit(
            w, &old, writing, memory_order_relaxed, memory_order_relaxed))
        return SHM_E_STATE;
    SHM_HOOK("begin_claimed");
    /* The entry may have been reclaimed, and claimed by another process,
     * between the owner check above and the CAS: the FREE word we moved
     * would then be the new owner's.  A Dekker pair with the reclaim, which
     * stores SHM_OWNER_RECLAIMING, then (seq_cst fence) moves every word of
     * the entry on: either this load sees that store (or a later owner) and
     * the word goes back exactly as it was, or the reclaim's CAS of the word
     * comes after ours and moves our WRITING on, so that our publish is
     * refused.  MO: seq_cst fence, relaxed load; pairs with the fence in
     * shm_client_reclaim. */
    shm_fence_seq_cst();
    if (atomic_load_explicit(&shm_client_at(s, c)->owner_pid,
                             memory_order_relaxed) != pid) {
        uint32_t cur = writing;
        /* MO: relaxed; we published nothing.  Fails, harmlessly, when the
         * reclaim moved the word on already. */
        atomic_compare_exchange_strong_explicit(
            w, &cur, old, memory_order_relaxed, memory_order_relaxed);
        return SHM_STALE;
    }
    *gen = shm_word_gen(old);
    return SHM_OK;
}

/* WRITING -> FREE (next generation) for a slot begun (generation gen) but
 * never published: a post of several slots whose later begin failed gives
 * back the slots it had begun this way, so that they can be begun again.
 * Returns SHM_OK, or SHM_STALE when the slot is no longer WRITING of gen
 * (it was reclaimed meanwhile, and is left alone). */
static inline int shm_slot_abort(shm_seg *s, uint32_t c, uint32_t k,
                                 uint32_t gen) {
    uint32_t cur = shm_slot_word(SLOT_WRITING, gen);
    /* MO: relaxed; nothing was published, nothing is read. */
    return atomic_compare_exchange_strong_explicit(
               shm_slot_word_at(s, c, k), &cur,
               shm_slot_word(SLOT_FREE, gen + 1), memory_order_relaxed,
               memory_order_relaxed)
               ? SHM_OK
               : SHM_STALE;
}

/* WRITING -> READY of generation gen, after the input has been copied in.
 * Returns SHM_OK, or SHM_STALE when the slot was reclaimed since its begin
 * (the word moved on): then nothing is published, and the slot, perhaps
 * another process's by now, is left alone. */
static inline int shm_slot_publish(shm_seg *s, uint32_t c, uint32_t k,
                                   uint32_t gen) {
    _Atomic uint32_t *w = shm_slot_word_at(s, c, k);
    shm_slot_meta_at(s, c, k)->publish_ns = shm_now_ns();
    uint32_t cur = shm_slot_word(SLOT_WRITING, gen);
    /* MO: release CAS; pairs with the acquire fence after the take in
     * shm_scan: the evaluator that takes READY sees the input bytes.  A
     * CAS, not a store, so that a slot reclaimed during the copy is not
     * published into its next owner's hands.  Nobody else moves a WRITING
     * word but the reclaim, so one try decides. */
    if (!atomic_compare_exchange_strong_explicit(
            w, &cur, shm_slot_word(SLOT_READY, gen), memory_order_release,
            memory_order_relaxed))
        return SHM_STALE;
    /* MO: relaxed; a statistic, on the client's own line (the threads of a
     * process share the entry, hence an atomic add). */
    atomic_fetch_add_explicit(&shm_client_at(s, c)->requests, 1,
                              memory_order_relaxed);
    return SHM_OK;
}

/* Rings the evaluator's doorbell after publishing `count` slots.
 *
 * Only the sleeper clears its flag (io_uring's IORING_SQ_NEED_WAKEUP
 * pattern): a client that sees ev_sleeping wakes the evaluator and leaves
 * the flag alone.  A client that cleared the flag itself could clear the
 * announcement of a later sleep than the one it saw (it read the flag
 * during one sleep, was preempted, and its clear and its wake landed
 * after the evaluator had announced the next sleep but before it was in
 * the kernel), and every client after it would then find the flag clear
 * while the evaluator slept to its timeout.  The price: clients that
 * publish while the flag is set each make a FUTEX_WAKE call, a few of
 * them at most in the microseconds between the first wake and the
 * evaluator's clearing of the flag.  Why no wake-up is lost: shm_collect. */
static inline void shm_notify_evaluator(shm_seg *s, uint32_t count) {
    shm_header *h = shm_hdr(s);
    /* MO: seq_cst; with the seq_cst load of ev_sleeping below, one half of
     * the Dekker pair with shm_collect's seq_cst store of ev_sleeping = 1
     * and re-read of submit_seq. */
    atomic_fetch_add_explicit(&h->submit_seq, count, memory_order_seq_cst);
    /* MO: seq_cst; see above. */
    uint32_t sleeping =
        atomic_load_explicit(&h->ev_sleeping, memory_order_seq_cst);
    SHM_HOOK("notify_loaded");
    if (sleeping) shm_futex_wake(&h->submit_seq, 1);
}

static inline int shm_state_is_final(uint32_t st) {
    return st == SLOT_DONE || st == SLOT_FAILED;
}

/* Client c's doorbell: a futex word shared by 32 clients, and c's bit. */
static inline _Atomic uint32_t *shm_done_word(shm_seg *s, uint32_t c) {
    return &shm_hdr(s)->done_seq[c / 32u];
}
static inline uint32_t shm_done_bit(uint32_t c) { return 1u << (c % 32u); }

/* A ticker: a thread of the client's process that, every period_ns,
 * advances `tick` and rings client c's doorbell (its bit only).  Its
 * process's waiters then sleep without a timer (shm_slot_wait_ticked) and
 * still come back every period to check on the evaluator: one timer wake-up
 * per period for the whole process instead of a timer armed and cancelled
 * by every sleep.  shm_ticker_start / shm_ticker_stop, below. */
typedef struct {
    _Atomic uint32_t *word;   /* the futex word it rings; its mapping must
                                 outlive the ticker */
    uint32_t bits;            /* the waiters it wakes (FUTEX_WAKE_BITSET) */
    int bump;                 /* 1: a doorbell, its value goes up each ring */
    uint32_t c;               /* the client whose doorbell it rings */
    uint64_t period_ns;
    _Atomic uint32_t tick;    /* ticks so far */
    _Atomic uint32_t stop;    /* 1: stop (a private futex word) */
    int running;              /* started and not yet joined */
    pthread_t thread;
} shm_ticker;

/* ------------------------------------------------------------------ */
/* Ticker (see shm_ticker above)                                      */
/* ------------------------------------------------------------------ */

/* One tick: a waiter of client c that sees the new tick returns
 * SHM_TIMEOUT.  MO: relaxed increment, published by the release increment
 * of the doorbell that follows (shm_ring_word), which a waiter loads
 * (acquire) before it looks at the tick and sleeps. */
static inline void shm_ticker_tick(shm_ticker *t) {
    atomic_fetch_add_explicit(&t->tick, 1, memory_order_relaxed);
    if (t->bump)
        shm_ring_word(t->word, t->bits);
    else
        shm_futex_wake_bits(t->word, t->bits);
}

static void *shm_ticker_main(void *arg) {
    shm_ticker *t = (shm_ticker *)arg;
    struct timespec ts;
    ts.tv_sec = (time_t)(t->period_ns / 1000000000ull);
    ts.tv_nsec = (long)(t->period_ns % 1000000000ull);
    /* MO (both loads of stop): acquire; pairs with the release store in
     * shm_ticker_stop. */
    while (!atomic_load_explicit(&t->stop, memory_order_acquire)) {
        /* Sleeps one period, or until shm_ticker_stop wakes it (a relative
         * timeout: the timer is this thread's, once per period). */
        syscall(SYS_futex, (uint32_t *)&t->stop, FUTEX_WAIT_PRIVATE, 0, &ts,
                NULL, 0);
        if (atomic_load_explicit(&t->stop, memory_order_acquire)) break;
        shm_ticker_tick(t);
    }
    /* The last ring comes after stop was seen: a waiter whose load of the
     * doorbell sees this ring sees stop too (and one that loaded it before
     * is woken by the ring, or finds the doorbell changed). */
    shm_ticker_tick(t);
    return NULL;
}

/* Starts t: every period_ns it rings `word` for the waiters with `bits`
 * (bump: as a doorbell, shm_ring_word; else a bare wake).  The thread
 * blocks every signal, so that signals reach the process's own threads.
 * Returns 0, or an errno value (the caller then waits with timers). */
static inline int shm_ticker_start_word(shm_ticker *t, _Atomic uint32_t *word,
                                        uint32_t bits, int bump,
                                        uint64_t period_ns) {
    sigset_t all, old;
    pthread_attr_t attr;
    int rc;
    t->word = word;
    t->bits = bits;
    t->bump = bump;
    t->c = UINT32_MAX;
    t->period_ns = period_ns ? period_ns : 1;
    atomic_init(&t->tick, 0);
    atomic_init(&t->stop, 0);
    t->running = 0;
    if ((rc = pthread_attr_init(&attr)) != 0) return rc;
    /* The thread's needs are a few hundred bytes of stack. */
    pthread_attr_setstacksize(&attr, 64 * 1024);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    rc = pthread_create(&t->thread, &attr, shm_ticker_main, t);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc == 0) t->running = 1;
    return rc;
}

/* Starts t for client c of segment s (whose mapping must stay until
 * shm_ticker_stop): it rings c's doorbell, c's bit only. */
static inline int shm_ticker_start(shm_ticker *t, shm_seg *s, uint32_t c,
                                   uint64_t period_ns) {
    int rc = shm_ticker_start_word(t, shm_done_word(s, c), shm_done_bit(c), 1,
                                   period_ns);
    t->c = c;
    return rc;
}

/* Stops and joins t's thread; it ticks once more on its way out, and a
 * waiter that finds `stop` set returns SHM_TIMEOUT, so a waiter that chose
 * this ticker returns and then waits with timers or another ticker.  A
 * stopped ticker is not started again while such a waiter may still look
 * at it (the Python layer starts a new one).  Only from the process that
 * started it (a forked child has no such thread: it just forgets t). */
static inline void shm_ticker_stop(shm_ticker *t) {
    if (!t->running) return;
    /* MO: release; pairs with the acquire load in shm_ticker_main. */
    atomic_store_explicit(&t->stop, 1, memory_order_release);
    syscall(SYS_futex, (uint32_t *)&t->stop, FUTEX_WAKE_PRIVATE, 1, NULL,
            NULL, 0);
    pthread_join(t->thread, NULL);
    t->running = 0;
}

/* Waits until slot (c, k), begun with generation gen, is DONE or FAILED.
 * Returns SHM_STALE at once if the slot's generation moved on (it was
 * reclaimed: the answer, if any, is not ours).  Spins for at most spin_ns
 * (callers pass 0 when processes outnumber cores by more than one, and set
 * SHM_SPIN_YIELD when by exactly one), then sleeps on its
 * client's doorbell (shm_done_word, its own bit).  Without a ticker (t ==
 * NULL) it waits for at most timeout_ns in all, with a timer on each sleep;
 * with one (t running for client c of this process) it sleeps without a
 * timer and returns SHM_TIMEOUT at the ticker's first tick after the wait
 * began, so within one period (timeout_ns is then not used).  Returns the
 * final state, or SHM_TIMEOUT (the caller checks the evaluator's liveness
 * and calls again), or SHM_CLOSED.  The Python wrappers call it without the
 * GIL, unless the caller is its process's only Python thread (nobody else
 * can want it). */
static inline int shm_slot_wait_ticked(shm_seg *s, uint32_t c, uint32_t k,
                                       uint32_t gen, uint64_t spin_ns,
                                       uint64_t timeout_ns, shm_ticker *t) {
    shm_header *h = shm_hdr(s);
    _Atomic uint32_t *w = shm_slot_word_at(s, c, k);
    _Atomic uint32_t *bell = shm_done_word(s, c);
    /* MO: relaxed; compared below after an acquire load of the doorbell,
     * which the ticker rings (release) after each increment. */
    uint32_t tick0 = t ? atomic_load_explicit(&t->tick, memory_order_relaxed)
                       : 0;
    /* The clock is read only where needed: for a spin, and for the
     * deadline of a timed sleep (one clock read fewer per wait). */
    int yield = (spin_ns & SHM_SPIN_YIELD) != 0;
    spin_ns &= ~SHM_SPIN_YIELD;
    uint64_t start = spin_ns ? shm_now_ns() : 0;
    int started = spin_ns != 0;
    uint32_t cur;
    /* MO (all loads of w here): acquire; pairs with the release exchange in
     * shm_complete / shm_fail: seeing DONE means seeing the outputs. */
    if (spin_ns) {
        for (uint32_t i = 0;; i++) {
            cur = atomic_load_explicit(w, memory_order_acquire);
            if (shm_word_gen(cur) != gen) return SHM_STALE;
            if (shm_state_is_final(shm_word_state(cur)))
                return (int)shm_word_state(cur);
            if (shm_spin_pause(i, start + spin_ns, yield)) break;
        }
    }
    for (;;) {
        cur = atomic_load_explicit(w, memory_order_acquire);
        uint32_t st = shm_word_state(cur);
        if (shm_word_gen(cur) != gen) return SHM_STALE;
        if (shm_state_is_final(st)) return (int)st;
        SHM_ASSERT(st == SLOT_READY || st == SLOT_TAKEN);
        uint64_t deadline = SHM_NO_DEADLINE;
        if (!t) {
            uint64_t now = shm_now_ns();
            if (!started) {
                start = now;
                started = 1;
            }
            if (now - start >= timeout_ns) return SHM_TIMEOUT;
            /* An absolute deadline; saturated, not wrapped, for huge
             * timeouts. */
            deadline = timeout_ns > (uint64_t)INT64_MAX - start
                           ? (uint64_t)INT64_MAX
                           : start + timeout_ns;
        }
        if (!(cur & SLOT_WAITER)) {
            /* MO: relaxed; on the one word, the evaluator's completing CAS
             * either comes after this one (and sees WAITER, so it rings the
             * doorbell) or makes it fail (and we look again). */
            if (!atomic_compare_exchange_strong_explicit(
                    w, &cur, cur | SLOT_WAITER, memory_order_relaxed,
                    memory_order_relaxed))
                continue;
        }
        /* The doorbell, then the word, the state and the tick once more,
         * right before sleeping (other clients' answers ring the same word,
         * and a ring between this load and the futex wait costs a retry).
         * MO: acquire; pairs with the release increment in
         * shm_ring_doorbell, which comes after the ringer's change of w
         * (shm_finish), of ev_state (shm_close_and_wake) or of the tick
         * (shm_ticker_tick).  So if none of those is seen below, `seq`
         * predates that ring, and the futex wait returns at once (EAGAIN)
         * or is woken by it.  The re-read of w after this load is what
         * makes that hold for an answer: an answer whose ring came before
         * this load is seen by the re-read, not slept through. */
        SHM_HOOK("wait_before_bell");
        uint32_t seq = atomic_load_explicit(bell, memory_order_acquire);
        cur = atomic_load_explicit(w, memory_order_acquire);
        if (shm_word_gen(cur) != gen) return SHM_STALE;
        if (shm_state_is_final(shm_word_state(cur)))
            return (int)shm_word_state(cur);
        /* MO: acquire; pairs with the release store of EV_CLOSED in
         * shm_close_and_wake. */
        if (atomic_load_explicit(&h->ev_state, memory_order_acquire) >=
            EV_CLOSED)
            return SHM_CLOSED;
        /* A tick since the wait began, or a stopped ticker (which ticks no
         * more; it set `stop` before its last ring).  MO: relaxed loads,
         * ordered by the acquire load of the doorbell above. */
        if (t && (atomic_load_explicit(&t->tick, memory_order_relaxed) != tick0 ||
                  atomic_load_explicit(&t->stop, memory_order_relaxed)))
            return SHM_TIMEOUT;
        shm_futex_wait_bits(bell, seq, deadline, shm_done_bit(c));
    }
}

static inline int shm_slot_wait(shm_seg *s, uint32_t c, uint32_t k,
                                uint32_t gen, uint64_t spin_ns,
                                uint64_t timeout_ns) {
    return shm_slot_wait_ticked(s, c, k, gen, spin_ns, timeout_ns, NULL);
}

/* One look at slots ks[i] of client c, begun with generations gens[i]:
 * the index of the first one that is final or reclaimed, with its state
 * (DONE, FAILED) or SHM_STALE in *rc; n if none is.  MO: acquire loads, as
 * in shm_slot_wait_ticked. */
static inline uint32_t shm_slots_first(shm_seg *s, uint32_t c,
                                       const uint32_t *ks,
                                       const uint32_t *gens, uint32_t n,
                                       int *rc) {
    for (uint32_t i = 0; i < n; i++) {
        uint32_t cur = atomic_load_explicit(shm_slot_word_at(s, c, ks[i]),
                                            memory_order_acquire);
        if (shm_word_gen(cur) != gens[i]) {
            *rc = SHM_STALE;
            return i;
        }
        if (shm_state_is_final(shm_word_state(cur))) {
            *rc = (int)shm_word_state(cur);
            return i;
        }
    }
    return n;
}

/* shm_slot_wait_ticked for several slots of one client (pipelined
 * requests): waits until any of slots ks[0..n) (begun with generations
 * gens[i]) is final or reclaimed, puts its index in *which and returns its
 * state (DONE, FAILED) or SHM_STALE; or returns SHM_TIMEOUT / SHM_CLOSED
 * (*which = n).  The lowest index wins when several are ready.  Every
 * pending slot gets the WAITER bit before the client sleeps, and all of
 * them ring the same doorbell (the client's bit of shm_done_word), so one
 * futex wait covers them all: the same argument as the single wait, with
 * "the word" read as "each of the words". */
static inline int shm_slots_wait_any(shm_seg *s, uint32_t c,
                                     const uint32_t *ks, const uint32_t *gens,
                                     uint32_t n, uint64_t spin_ns,
                                     uint64_t timeout_ns, shm_ticker *t,
                                     uint32_t *which) {
    shm_header *h = shm_hdr(s);
    _Atomic uint32_t *bell = shm_done_word(s, c);
    uint32_t tick0 = t ? atomic_load_explicit(&t->tick, memory_order_relaxed)
                       : 0;
    int yield = (spin_ns & SHM_SPIN_YIELD) != 0;
    spin_ns &= ~SHM_SPIN_YIELD;
    uint64_t start = spin_ns ? shm_now_ns() : 0;
    int started = spin_ns != 0;
    int rc = 0;
    *which = n;
    if (n == 0) return SHM_E_STATE;
    if (spin_ns) {
        for (uint32_t i = 0;; i++) {
            if ((*which = shm_slots_first(s, c, ks, gens, n, &rc)) < n)
                return rc;
            if (shm_spin_pause(i, start + spin_ns, yield)) break;
        }
    }
    for (;;) {
        if ((*which = shm_slots_first(s, c, ks, gens, n, &rc)) < n) return rc;
        uint64_t deadline = SHM_NO_DEADLINE;
        if (!t) {
            uint64_t now = shm_now_ns();
            if (!started) {
                start = now;
                started = 1;
            }
            if (now - start >= timeout_ns) return SHM_TIMEOUT;
            deadline = timeout_ns > (uint64_t)INT64_MAX - start
                           ? (uint64_t)INT64_MAX
                           : start + timeout_ns;
        }
        /* WAITER on every slot still in flight (MO: relaxed CAS, as in
         * shm_slot_wait_ticked); one that finished meanwhile ends the
         * wait at the re-read below. */
        for (uint32_t i = 0; i < n; i++) {
            _Atomic uint32_t *w = shm_slot_word_at(s, c, ks[i]);
            uint32_t cur = atomic_load_explicit(w, memory_order_relaxed);
            while (shm_word_gen(cur) == gens[i] &&
                   !shm_state_is_final(shm_word_state(cur)) &&
                   !(cur & SLOT_WAITER) &&
                   !atomic_compare_exchange_weak_explicit(
                       w, &cur, cur | SLOT_WAITER, memory_order_relaxed,
                       memory_order_relaxed)) {
            }
        }
        SHM_HOOK("wait_any_before_bell");
        /* MO: acquire; as in shm_slot_wait_ticked: the doorbell, then every
         * word once more, so no answer whose ring came before this load is
         * slept through. */
        uint32_t seq = atomic_load_explicit(bell, memory_order_acquire);
        if ((*which = shm_slots_first(s, c, ks, gens, n, &rc)) < n) return rc;
        if (atomic_load_explicit(&h->ev_state, memory_order_acquire) >=
            EV_CLOSED)
            return SHM_CLOSED;
        if (t && (atomic_load_explicit(&t->tick, memory_order_relaxed) != tick0 ||
                  atomic_load_explicit(&t->stop, memory_order_relaxed)))
            return SHM_TIMEOUT;
        shm_futex_wait_bits(bell, seq, deadline, shm_done_bit(c));
    }
}

/* DONE/FAILED -> FREE with generation gen + 1, after the caller copied the
 * outputs (or the error text) out of a slot it began with generation gen.
 * Returns SHM_OK: the copy is the answer to the caller's request.
 * SHM_STALE: the slot was reclaimed (its generation moved on) at some point
 * before this call returned, perhaps during the copy: the copy must be
 * thrown away, and the slot, now someone else's, is left alone.
 * SHM_E_STATE: the slot is still in flight (a caller's error).
 *
 * Validation as in a seqlock: the acquire fence orders the copy's reads
 * before the CAS's read of the word, and the CAS succeeds only if the word
 * is still exactly the final state of generation gen, so no reclaim (which
 * moves the generation on before anyone can reuse the slot) happened
 * before or during the copy. */
static inline int shm_slot_release(shm_seg *s, uint32_t c, uint32_t k,
                                   uint32_t gen) {
    _Atomic uint32_t *w = shm_slot_word_at(s, c, k);
    SHM_HOOK("release_begin");
    /* MO: acquire fence; see above. */
    atomic_thread_fence(memory_order_acquire);
    /* MO: relaxed; the CAS below decides. */
    uint32_t cur = atomic_load_explicit(w, memory_order_relaxed);
    for (;;) {
        if (shm_word_gen(cur) != gen) return SHM_STALE;
        if (!shm_state_is_final(shm_word_state(cur))) return SHM_E_STATE;
        /* MO: release; our reads of the output area happen before the slot
         * can be reused (by us, or, after a reclaim, by another process). */
        if (atomic_compare_exchange_strong_explicit(
                w, &cur, shm_slot_word(SLOT_FREE, gen + 1),
                memory_order_release, memory_order_relaxed))
            return SHM_OK;
    }
}

/* Current state word, for tests and for abandoned-slot bookkeeping. */
static inline uint32_t shm_slot_peek(shm_seg *s, uint32_t c, uint32_t k) {
    /* MO: acquire; same pairing as shm_slot_wait. */
    return atomic_load_explicit(shm_slot_word_at(s, c, k),
                                memory_order_acquire);
}

/* ------------------------------------------------------------------ */
/* Evaluation cache                                                    */
/* ------------------------------------------------------------------ */

/* A table of answers in the segment that every client reads before it
 * sends a request and writes after it gets an answer: a state one process
 * had evaluated is answered in any other without a round trip.
 *
 * 2^cache_log2 entries in buckets of SHM_CACHE_WAYS; a state's bucket is
 * chosen by its 64-bit key (a hash of its bytes, or the caller's own key,
 * e.g. a Zobrist hash).  No locks: every word of an entry is a relaxed
 * 8-byte atomic, and `check` is a hash over the key, a second independent
 * key (key2: a second hash of the bytes; for a caller's key, the word of
 * its scheme, which each process names: 0 by default), the model version
 * and the data.  A reader copies the entry out and accepts it only
 * if the hash of what it copied equals the check it copied: an entry torn
 * by two writers, half written by a writer that was killed, of another
 * state with the same key, or scribbled on, fails the check (but with
 * probability 2^-64) and is a miss.  Writers never wait for each other: two
 * writing one entry at once leave a torn entry, which reads as a miss until
 * it is written again.  The order of a writer's stores does not matter to
 * a reader (the check decides); the key goes last all the same.
 *
 * Versions: an entry carries the model version of its answer, and a
 * reader refuses entries older than cache_version, which the owner raises
 * when new weights serve (shm_cache_set_version): no sweep of the table.
 *
 * Replacement, within a bucket: the entry of the same key, else an empty
 * one, else one of an older version than cache_version, else the smallest
 * `stamp`: entries never hit since they were stored before those that
 * were, and among each the least recently used.  (`stamp` is the time of
 * the last hit or store in units of 2^20 ns, written at most once per unit,
 * with SHM_CACHE_HIT_BIT once hit.  On the demo's positions keeping hit
 * entries holds most of what keeping the openings would, which plain LRU
 * and FIFO lose in small tables: bench/cache.py.) */
typedef struct {
    _Atomic uint64_t key;      /* 0: empty */
    _Atomic uint64_t version;  /* model version of the answer */
    _Atomic uint64_t stamp;    /* last use (replacement only; not checked) */
    _Atomic uint64_t check;    /* shm_cache_check over the rest */
    /* _Atomic uint64_t data[cache_words]: the output area's first
     * out_bytes, as a slot holds them */
} shm_cache_entry;

enum { SHM_CACHE_MISS = 0, SHM_CACHE_HIT = 1, SHM_CACHE_OLD = 2 };
#define SHM_CACHE_HIT_BIT (1ull << 63)

/* 64 x 64 -> 128-bit multiply, folded: the mixing step of the hashes. */
static inline uint64_t shm_mum(uint64_t a, uint64_t b) {
    __uint128_t r = (__uint128_t)a * b;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
}

static inline uint64_t shm_load64(const char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* Two independent 64-bit hashes of n bytes (two lanes that read the same
 * words with different constants and roles), for the cache's key and key2.
 * Neither is 0: 0 marks an empty entry (key) and a caller's key of the
 * default scheme (key2). */
static inline void shm_hash_state(const char *p, uint64_t n, uint64_t *k1,
                                  uint64_t *k2) {
    uint64_t a = 0x9E3779B97F4A7C15ull ^ n, b = 0xC2B2AE3D27D4EB4Full ^ (n << 1);
    uint64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        uint64_t w0 = shm_load64(p + i), w1 = shm_load64(p + i + 8);
        a = shm_mum(w0 ^ a ^ 0xA0761D6478BD642Full, w1 ^ 0xE7037ED1A0B428DBull);
        b = shm_mum(w1 ^ b ^ 0x8EBC6AF09C88C6E3ull, w0 ^ 0x589965CC75374CC3ull);
    }
    if (i < n) {
        char tail[16] = {0};
        memcpy(tail, p + i, n - i);
        uint64_t w0 = shm_load64(tail), w1 = shm_load64(tail + 8);
        a = shm_mum(w0 ^ a ^ 0xA0761D6478BD642Full, w1 ^ 0xE7037ED1A0B428DBull);
        b = shm_mum(w1 ^ b ^ 0x8EBC6AF09C88C6E3ull, w0 ^ 0x589965CC75374CC3ull);
    }
    a = shm_mum(a ^ 0x1D8E4E27C47D124Full, n ^ 0xD6E8FEB86659FD93ull);
    b = shm_mum(b ^ 0x94D049BB133111EBull, n ^ 0xBF58476D1CE4E5B9ull);
    *k1 = a ? a : 1;
    *k2 = b ? b : 1;
}

/* One step of the check word: h mixed with the words x and y.  h goes
 * into both factors and back into the result, so that no input word can
 * zero a factor by itself (a word equal to a constant of the step) and so
 * erase what came before: a factor is 0 only for x (or y) equal to a
 * function of everything hashed so far, and then the step keeps h. */
static inline uint64_t shm_check_step(uint64_t h, uint64_t x, uint64_t y) {
    return shm_mum(h ^ x ^ 0xA0761D6478BD642Full, h ^ y ^ 0xE7037ED1A0B428DBull) ^ h;
}

/* The check word of an entry holding `data` (nw words). */
static inline uint64_t shm_cache_check(uint64_t key, uint64_t key2,
                                       uint64_t version, const uint64_t *data,
                                       uint64_t nw) {
    uint64_t h = shm_check_step(0x2D358DCCAA6C78A5ull, key, key2);
    h = shm_check_step(h, version, nw);
    uint64_t i = 0;
    for (; i + 2 <= nw; i += 2) h = shm_check_step(h, data[i], data[i + 1]);
    if (i < nw) h = shm_check_step(h, data[i], 0x8EBC6AF09C88C6E3ull);
    return h;
}

static inline uint64_t shm_cache_entries(const shm_seg *s) {
    return s->p.cache_log2 ? 1ull << s->p.cache_log2 : 0;
}
static inline shm_cache_entry *shm_cache_entry_at(const shm_seg *s, uint64_t i) {
    return (shm_cache_entry *)(s->base + s->l.cache_off + i * s->l.cache_stride);
}
static inline _Atomic uint64_t *shm_cache_data(shm_cache_entry *e) {
    return (_Atomic uint64_t *)((char *)e + sizeof(shm_cache_entry));
}
/* The first entry of key's bucket (Fibonacci hashing: every key bit counts,
 * so weak low bits of a caller's key do not crowd buckets). */
static inline uint64_t shm_cache_bucket(const shm_seg *s, uint64_t key) {
    uint32_t bits = s->p.cache_log2 - 2; /* log2 of the bucket count */
    return bits ? (key * 0x9E3779B97F4A7C15ull) >> (64 - bits) : 0;
}
/* The current stamp (coarse CLOCK_MONOTONIC). */
static inline uint64_t shm_cache_now(void) { return shm_now_ns() >> 20; }

/* The oldest model version a lookup accepts now.  MO: acquire; pairs with
 * the release store in shm_cache_set_version, so a client that learns that
 * set_weights returned (through any synchronising channel) sees it. */
static inline uint64_t shm_cache_version(shm_seg *s) {
    return atomic_load_explicit(&shm_hdr(s)->cache_version,
                                memory_order_acquire);
}
/* Raises the oldest acceptable version (never lowers it); the owner calls
 * it once every replica serves `version`, before set_weights returns. */
static inline void shm_cache_set_version(shm_seg *s, uint64_t version) {
    /* MO: release CAS; pairs with the acquire load in shm_cache_version. */
    shm_raise_word(&shm_hdr(s)->cache_version, version, memory_order_release);
}

/* Looks up (key, key2) for client c: on a hit copies the entry's data
 * (cache_words words) to out, its version to *version and returns
 * SHM_CACHE_HIT; SHM_CACHE_OLD when the only match is older than
 * min_version (the caller passes the larger of shm_cache_version and the
 * newest version it has seen, so its versions never go backwards);
 * SHM_CACHE_MISS otherwise.  Counts the outcome in c's entry.  out is
 * scratch on a miss.  Reads only inside the table, whatever it holds. */
static inline int shm_cache_get(shm_seg *s, uint32_t c, uint64_t key,
                                uint64_t key2, uint64_t min_version,
                                uint64_t *out, uint64_t *version) {
    shm_client *ce = shm_client_at(s, c);
    uint64_t nw = s->l.cache_words, b = shm_cache_bucket(s, key) * SHM_CACHE_WAYS;
    int old = 0;
    for (uint32_t w = 0; w < SHM_CACHE_WAYS; w++) {
        shm_cache_entry *e = shm_cache_entry_at(s, b + w);
        /* MO (every load and store of the table): relaxed; the check word
         * decides what is accepted, not the order of the words. */
        if (atomic_load_explicit(&e->key, memory_order_relaxed) != key) continue;
        uint64_t v = atomic_load_explicit(&e->version, memory_order_relaxed);
        uint64_t chk = atomic_load_explicit(&e->check, memory_order_relaxed);
        _Atomic uint64_t *d = shm_cache_data(e);
        for (uint64_t i = 0; i < nw; i++)
            out[i] = atomic_load_explicit(&d[i], memory_order_relaxed);
        SHM_HOOK("cache_get_copied");
        if (atomic_load_explicit(&e->key, memory_order_relaxed) != key ||
            shm_cache_check(key, key2, v, out, nw) != chk)
            continue;
        if (v < min_version) {
            old = 1;
            continue;
        }
        uint64_t stamp = SHM_CACHE_HIT_BIT | shm_cache_now();
        if (atomic_load_explicit(&e->stamp, memory_order_relaxed) != stamp)
            atomic_store_explicit(&e->stamp, stamp, memory_order_relaxed);
        *version = v;
        atomic_fetch_add_explicit(&ce->cache_hits, 1, memory_order_relaxed);
        return SHM_CACHE_HIT;
    }
    atomic_fetch_add_explicit(&ce->cache_misses, 1, memory_order_relaxed);
    if (old) {
        atomic_fetch_add_explicit(&ce->cache_stale, 1, memory_order_relaxed);
        return SHM_CACHE_OLD;
    }
    return SHM_CACHE_MISS;
}

/* Stores client c's answer `data` (cache_words words) of model version
 * `version` for (key, key2).  Returns 1 if it replaced a live entry of
 * another state (counted in c's entry), else 0; stores nothing when
 * version is older than cache_version.  An answer may replace a newer one
 * of the same state (a request in flight across a weight update): a reader
 * that has seen the newer version refuses it (shm_cache_get's
 * min_version), and the next miss puts the newer one back.  (Trusting the
 * version word of an entry before checking it would let a scribbled entry
 * block its key for ever.) */
static inline int shm_cache_put(shm_seg *s, uint32_t c, uint64_t key,
                                uint64_t key2, uint64_t version,
                                const uint64_t *data) {
    uint64_t nw = s->l.cache_words, b = shm_cache_bucket(s, key) * SHM_CACHE_WAYS;
    uint64_t floor = shm_cache_version(s);
    if (version < floor) return 0; /* no reader would accept it */
    shm_cache_entry *victim = shm_cache_entry_at(s, b);
    int rank = 4; /* 0 same key, 1 empty, 2 old version, 3 smallest stamp */
    uint64_t oldest = UINT64_MAX;
    for (uint32_t w = 0; w < SHM_CACHE_WAYS && rank > 0; w++) {
        shm_cache_entry *e = shm_cache_entry_at(s, b + w);
        uint64_t k = atomic_load_explicit(&e->key, memory_order_relaxed);
        if (k == key) {
            victim = e, rank = 0;
        } else if (k == 0) {
            if (rank > 1) victim = e, rank = 1;
        } else if (atomic_load_explicit(&e->version, memory_order_relaxed) < floor) {
            if (rank > 2) victim = e, rank = 2;
        } else if (rank == 4 || rank == 3) {
            uint64_t st = atomic_load_explicit(&e->stamp, memory_order_relaxed);
            if (st < oldest) oldest = st, victim = e, rank = 3;
        }
    }
    _Atomic uint64_t *d = shm_cache_data(victim);
    atomic_store_explicit(&victim->version, version, memory_order_relaxed);
    for (uint64_t i = 0; i < nw; i++) {
        if (i == nw / 2) SHM_HOOK("cache_put_half");
        atomic_store_explicit(&d[i], data[i], memory_order_relaxed);
    }
    atomic_store_explicit(&victim->stamp, shm_cache_now(), memory_order_relaxed);
    atomic_store_explicit(&victim->check,
                          shm_cache_check(key, key2, version, data, nw),
                          memory_order_relaxed);
    atomic_store_explicit(&victim->key, key, memory_order_relaxed);
    if (rank == 3) {
        atomic_fetch_add_explicit(&shm_client_at(s, c)->cache_replaced, 1,
                                  memory_order_relaxed);
        return 1;
    }
    return 0;
}

/* Client c's cache counters: hits, misses, stale, replaced. */
static inline void shm_client_cache_stats(shm_seg *s, uint32_t c,
                                          uint64_t *out) {
    shm_client *e = shm_client_at(s, c);
    /* MO: relaxed; statistics. */
    out[0] = atomic_load_explicit(&e->cache_hits, memory_order_relaxed);
    out[1] = atomic_load_explicit(&e->cache_misses, memory_order_relaxed);
    out[2] = atomic_load_explicit(&e->cache_stale, memory_order_relaxed);
    out[3] = atomic_load_explicit(&e->cache_replaced, memory_order_relaxed);
}

/* Counts the table's entries that hold a key among `sample` entries spread
 * over the table (all of them when sample is 0 or at least the table's
 * size): *scanned, *held, and among those held the ones older than
 * cache_version, *old; for statistics (checks are not verified). */
static inline void shm_cache_census(shm_seg *s, uint64_t sample,
                                    uint64_t *scanned, uint64_t *held,
                                    uint64_t *old) {
    uint64_t n = shm_cache_entries(s), floor = shm_cache_version(s);
    uint64_t step = sample && sample < n ? n / sample : 1;
    *scanned = *held = *old = 0;
    for (uint64_t i = 0; i < n; i += step) {
        shm_cache_entry *e = shm_cache_entry_at(s, i);
        uint64_t k = atomic_load_explicit(&e->key, memory_order_relaxed);
        (*scanned)++;
        if (k == 0) continue;
        (*held)++; /* (key2 is unknown here: the check is not verified) */
        if (atomic_load_explicit(&e->version, memory_order_relaxed) < floor)
            (*old)++;
    }
}

/* ------------------------------------------------------------------ */
/* Evaluator side                                                      */
/* ------------------------------------------------------------------ */

/* Scans client entries starting at *cursor and takes READY slots (up to
 * *cap in total; with `share`, *cap comes down to server v's fair share,
 * shm_fair_share, counted when the first READY slot is found) into `own`,
 * server v's batch table in the caller's memory, gathering their inputs
 * into batch rows [n, ...).  Returns the new n.
 *
 * `own` is the authoritative table: completion (shm_finish and the
 * functions that call it) reads only it, never indexes read back from the
 * segment, which any client may scribble on.  The segment's copy of the
 * table (shm_server_taken) exists only so that, should this replica die,
 * another can put its requests back (shm_requeue, which bounds-checks what
 * it reads). */
static inline uint32_t shm_fair_share(shm_seg *s, uint32_t v, uint32_t n,
                                      uint32_t max_batch);

static inline uint32_t shm_scan(shm_seg *s, uint32_t v, shm_taken *own,
                                char *batch, uint32_t n, uint32_t *cap,
                                int share, uint32_t *cursor, uint64_t now) {
    shm_header *h = shm_hdr(s);
    shm_server_head *head = shm_server_at(s, v);
    shm_taken *copy = shm_server_taken(s, v);
    uint32_t hwm = shm_clients_hwm(s);
    uint32_t K = s->p.slots_per_client;
    if (hwm == 0) return n;
    uint32_t start = *cursor % hwm;
    for (uint32_t i = 0; i < hwm && n < *cap; i++) {
        uint32_t c = (start + i) % hwm;
        for (uint32_t k = 0; k < K && n < *cap; k++) {
            _Atomic uint32_t *w = shm_slot_word_at(s, c, k);
            /* MO: relaxed; the take below decides. */
            uint32_t cur = atomic_load_explicit(w, memory_order_relaxed);
            if (shm_word_state(cur) != SLOT_READY) continue;
            if (share) {
                /* The share is counted at the first request found, not
                 * on every round of an idle collect. */
                share = 0;
                *cap = shm_fair_share(s, v, n, *cap);
                if (n >= *cap) break;
            }
            uint32_t gen = shm_word_gen(cur);
            /* The segment's table lists the slot before it is TAKEN, so
             * that a replica that finds this one dead finds every slot it
             * took (shm_requeue).  MO: release; pairs with the acquire load
             * of n there. */
            shm_taken t = {c, k, gen, 0};
            copy[n] = t;
            atomic_store_explicit(&head->n, n + 1, memory_order_release);
            SHM_HOOK("scan_listed");
            /* READY -> TAKEN by CAS from exactly READY of this generation
             * (retried only while the client toggles its WAITER bit): two
             * collectors at once (a lock taken over from a holder that was
             * not dead after all, a scribbled replica state) then make
             * double work at worst, never a slot moved past TAKEN with no
             * answer written.  MO: relaxed CAS, then an acquire fence once
             * taken: every write of the word since the client's release
             * CAS of READY is a read-modify-write, so the fence pairs with
             * that publish and the input bytes below are the client's. */
            int took = 0;
            while ((cur & ~SLOT_WAITER) == shm_slot_word(SLOT_READY, gen)) {
                if (atomic_compare_exchange_weak_explicit(
                        w, &cur, cur + (SLOT_TAKEN - SLOT_READY),
                        memory_order_relaxed, memory_order_relaxed)) {
                    took = 1;
                    break;
                }
            }
            if (!took) {
                /* Un-list it: the table holds only slots we took. */
                atomic_store_explicit(&head->n, n, memory_order_relaxed);
                continue;
            }
            SHM_HOOK("scan_taken");
            atomic_thread_fence(memory_order_acquire);
            own[n] = t;
            shm_slot_meta *m = shm_slot_meta_at(s, c, k);
            uint64_t pub = m->publish_ns;
            shm_stat_add(&h->hist_wait[shm_hist_bin(now > pub ? now - pub : 0)],
                         1);
            shm_copy(batch + (uint64_t)n * s->p.in_bytes, shm_slot_in(s, c, k),
                     s->p.in_bytes);
            n++;
        }
    }
    /* Start the next scan after the last client we looked at, so that a
     * full batch does not always favour low client indices. */
    *cursor = start + 1;
    return n;
}

/* The replicas that may collect now: serving, with weights at least as
 * new as the floor (shm_version_ok).  A replica waiting for an update it
 * was sent takes no share of the work.  MO: relaxed; a count. */
static inline uint32_t shm_replicas_current(shm_seg *s) {
    uint64_t floor = atomic_load_explicit(&shm_hdr(s)->version_floor,
                                          memory_order_relaxed);
    uint32_t live = 0;
    for (uint32_t r = 0; r < s->p.replicas; r++) {
        shm_replica *rep = shm_replica_at(s, r);
        live += atomic_load_explicit(&rep->state, memory_order_relaxed) ==
                    REPLICA_SERVING &&
                atomic_load_explicit(&rep->version, memory_order_relaxed) >=
                    floor;
    }
    return live;
}

/* Several replicas: how many rows server v may take now, its share of the
 * work outstanding.  The work is the requests READY plus the rows the other
 * servers hold in their batches (n: what v took already in this collect),
 * split evenly among the replicas that may collect now (serving, with
 * weights at least the floor: shm_replicas_current); at least 1 and at most
 * max_batch.  Without the cap the replica whose batch just finished, being
 * the one free when its own clients resubmit, takes the first one or two of
 * them and starts a call, and the rest wait for the next replica to free up
 * and go to it as one large batch: the batches spread apart (1 row beside
 * 30) and, with a cost per call, fewer rows are answered per second than
 * with the even split.  The counts are relaxed loads, a snapshot that may
 * be off by the requests arriving meanwhile. */
static inline uint32_t shm_fair_share(shm_seg *s, uint32_t v, uint32_t n,
                                      uint32_t max_batch) {
    uint32_t live = shm_replicas_current(s);
    if (live < 1) live = 1;
    /* Counting stops where the share reaches max_batch anyway. */
    uint64_t enough = (uint64_t)live * max_batch;
    uint64_t work = n;
    for (uint32_t u = 0; u < s->p.servers; u++) {
        if (u == v) continue;
        /* MO: relaxed; a count, not a claim. */
        uint32_t held = atomic_load_explicit(&shm_server_at(s, u)->n,
                                             memory_order_relaxed);
        work += held < max_batch ? held : max_batch;
    }
    uint32_t hwm = shm_clients_hwm(s), K = s->p.slots_per_client;
    for (uint32_t c = 0; c < hwm && work < enough; c++)
        for (uint32_t k = 0; k < K; k++)
            /* MO: relaxed; the scan that takes the slot does the acquire. */
            work += shm_word_state(atomic_load_explicit(
                        shm_slot_word_at(s, c, k), memory_order_relaxed)) ==
                    SLOT_READY;
    uint64_t share = (work + live - 1) / live;
    if (share < 1) share = 1;
    return share < max_batch ? (uint32_t)share : max_batch;
}

/* Server v waits for requests and gathers up to max_batch of them into
 * `batch` (their slots listed in `own`, its batch table in the caller's
 * memory, and in the segment's copy: shm_scan).
 * Greedy: returns as soon as at least one request is taken, unless
 * max_wait_ns asks to wait (counted from the first taken request) for a
 * fuller batch; with several replicas it takes at most its share of the
 * work outstanding (shm_fair_share).  Spins up to spin_ns for new
 * submissions before it sleeps
 * on the doorbell.  Returns n > 0, or 0 when timeout_ns passed with nothing
 * (housekeeping time), SHM_CLOSED when close was requested, SHM_CONTROL
 * when a control request is pending for its replica, or SHM_BEHIND when
 * the weights floor is past its replica's version.  One collector at a
 * time (rule 1: the caller holds its process's lock and, with several
 * replicas, the collect lock).  Call without the GIL. */
static inline int shm_collect(shm_seg *s, uint32_t v, shm_taken *own,
                              char *batch, uint32_t max_batch,
                              uint32_t *cursor, uint64_t spin_ns,
                              uint64_t max_wait_ns, uint64_t timeout_ns) {
    shm_header *h = shm_hdr(s);
    shm_replica *rep = shm_replica_at(s, shm_server_replica(s, v));
    _Atomic uint32_t *ctl_done = &rep->ctl_done;
    uint64_t start = shm_now_ns(), first = 0;
    uint32_t n = 0;
    int yield = (spin_ns & SHM_SPIN_YIELD) != 0;
    spin_ns &= ~SHM_SPIN_YIELD;
    for (;;) {
        /* MO: acquire; pairs with the seq_cst (hence release) fetch_add in
         * shm_notify_evaluator. */
        uint32_t seq = atomic_load_explicit(&h->submit_seq,
                                            memory_order_acquire);
        uint64_t now = shm_now_ns();
        /* MO: relaxed; liveness hint for stats, read by anyone. */
        atomic_store_explicit(&h->heartbeat_ns, now, memory_order_relaxed);
        /* MO: acquire; pairs with the release CAS in shm_request_close.
         * Checked before every scan so that a close is honoured under
         * constant load too; what was already taken is returned. */
        if (atomic_load_explicit(&h->ev_state, memory_order_acquire) !=
            EV_SERVING)
            return n > 0 ? (int)n : SHM_CLOSED;
        /* Control requests are handled between batches: a batch already
         * begun is returned first.  MO: acquire; pairs with the release
         * fetch_add in shm_request_control. */
        if (atomic_load_explicit(&h->ctl_req, memory_order_acquire) !=
            atomic_load_explicit(ctl_done, memory_order_relaxed))
            return n > 0 ? (int)n : SHM_CONTROL;
        /* With several replicas, the floor may rise while this one waits
         * here (the owner raises it once an update it refused was applied
         * by another): it then stops collecting with its older weights.
         * MO: relaxed; the floor only orders which weights answer. */
        if (s->p.replicas > 1 &&
            atomic_load_explicit(&rep->version, memory_order_relaxed) <
                atomic_load_explicit(&h->version_floor, memory_order_relaxed))
            return n > 0 ? (int)n : SHM_BEHIND;
        uint32_t before = n;
        uint32_t cap = max_batch;
        n = shm_scan(s, v, own, batch, n, &cap, s->p.replicas > 1, cursor, now);
        if (n > before && before == 0) first = now;
        if (n >= cap) return (int)n;
        if (n > 0 && (max_wait_ns == 0 || now - first >= max_wait_ns))
            return (int)n;
        uint64_t deadline = n > 0 ? first + max_wait_ns : start + timeout_ns;
        if (now >= deadline) return (int)n;
        /* Spin on the doorbell word while the budget lasts (and not past
         * the deadline). */
        uint64_t spin_end = now + spin_ns < deadline ? now + spin_ns : deadline;
        int changed = 0;
        for (uint32_t i = 0; spin_ns; i++) {
            /* MO: relaxed; a hint only, the rescan does the acquire. */
            if (atomic_load_explicit(&h->submit_seq, memory_order_relaxed) !=
                seq) {
                changed = 1;
                break;
            }
            if (shm_spin_pause(i, spin_end, yield)) break;
        }
        if (changed) continue;
        now = shm_now_ns();
        if (now >= deadline) return (int)n;
        /* Announce the sleep, re-read the doorbell, sleep on it.  Why a
         * client's request is never slept through: take a client X whose
         * fetch_add of submit_seq the re-read below misses.  All four
         * operations are seq_cst, so in their single total order: our
         * store of 1 < our re-read < X's fetch_add < X's load of
         * ev_sleeping, and X's load sees our 1 (only we write the flag,
         * and we clear it only after the sleep).  So X calls FUTEX_WAKE
         * after its fetch_add.  If we are already queued in the kernel, it
         * wakes us; if not yet, the kernel's check in FUTEX_WAIT (the word
         * is read under the futex bucket lock, with a full barrier against
         * the waker's) sees submit_seq != seq and returns at once.  The
         * user-space re-read alone would not be enough: it is the kernel's
         * check that covers a wake which lands before we are queued.
         * MO: seq_cst store and load. */
        atomic_store_explicit(&h->ev_sleeping, 1, memory_order_seq_cst);
        if (atomic_load_explicit(&h->submit_seq, memory_order_seq_cst) == seq &&
            atomic_load_explicit(&h->ev_state, memory_order_acquire) ==
                EV_SERVING) {
            SHM_HOOK("collect_before_sleep");
            shm_futex_wait(&h->submit_seq, seq, deadline - now);
        }
        /* MO: seq_cst; a client whose load sees this 0 comes after it in
         * the total order, hence before our next announcement and re-read,
         * which therefore sees its fetch_add. */
        atomic_store_explicit(&h->ev_sleeping, 0, memory_order_seq_cst);
    }
}

/* ------------------------------------------------------------------ */
/* Several replicas: the collect lock, batch tables, weights versions  */
/* ------------------------------------------------------------------ */

/* The collect lock's waiters bit: someone may be asleep on the word. */
#define SHM_LOCK_WAITERS 0x80000000u

/* Takes the collect lock for server v (several replicas take turns
 * collecting: rule 1), waiting at most timeout_ns.  Returns SHM_OK, or
 * SHM_TIMEOUT: the caller then checks that the holder (shm_collect_holder)
 * is alive and takes the lock over from a dead one (shm_collect_steal).
 * A futex mutex in one word (the holder's id, and a bit for sleepers), so
 * that who holds it is never unknown, even if the holder dies right after
 * taking it. */
static inline int shm_collect_lock(shm_seg *s, uint32_t v,
                                   uint64_t timeout_ns) {
    _Atomic uint32_t *lock = &shm_hdr(s)->collect_lock;
    uint32_t me = v + 1, cur = 0;
    /* MO: acquire (every successful CAS here); pairs with the release
     * exchange in shm_collect_unlock: the previous holder's scans and
     * table writes happen before ours. */
    if (atomic_compare_exchange_strong_explicit(
            lock, &cur, me, memory_order_acquire, memory_order_relaxed))
        return SHM_OK;
    uint64_t start = shm_now_ns();
    for (;;) {
        /* Checked on every round, not only before a sleep: a word that
         * keeps changing (scribbled on) must not hold us past the
         * timeout. */
        uint64_t now = shm_now_ns();
        if (now - start >= timeout_ns) return SHM_TIMEOUT;
        if (cur == 0) {
            /* Free after a wait: take it with the waiters bit, since
             * others may still sleep on it (an extra wake at worst). */
            if (atomic_compare_exchange_weak_explicit(
                    lock, &cur, me | SHM_LOCK_WAITERS, memory_order_acquire,
                    memory_order_relaxed))
                return SHM_OK;
            continue;
        }
        if (!(cur & SHM_LOCK_WAITERS)) {
            /* MO: relaxed; the bit only asks the holder for a wake. */
            if (!atomic_compare_exchange_weak_explicit(
                    lock, &cur, cur | SHM_LOCK_WAITERS, memory_order_relaxed,
                    memory_order_relaxed))
                continue;
            cur |= SHM_LOCK_WAITERS;
        }
        shm_futex_wait(lock, cur, timeout_ns - (now - start));
        /* MO: relaxed; the CAS that takes the lock acquires. */
        cur = atomic_load_explicit(lock, memory_order_relaxed);
    }
}

static inline void shm_collect_unlock(shm_seg *s) {
    _Atomic uint32_t *lock = &shm_hdr(s)->collect_lock;
    /* MO: release; pairs with the acquiring CASes in shm_collect_lock. */
    if (atomic_exchange_explicit(lock, 0, memory_order_release) &
        SHM_LOCK_WAITERS)
        shm_futex_wake(lock, 1);
}

/* The server holding the collect lock (index), or -1 when it is free. */
static inline int shm_collect_holder(shm_seg *s) {
    /* MO: relaxed; a hint for the liveness check that may follow. */
    uint32_t cur = atomic_load_explicit(&shm_hdr(s)->collect_lock,
                                        memory_order_relaxed) &
                   ~SHM_LOCK_WAITERS;
    return cur ? (int)cur - 1 : -1;
}

/* Server v takes the collect lock over from server `dead`, whose replica
 * was found dead, or from a holder id that names no server (>= servers:
 * the word was scribbled on): SHM_OK if the lock was still dead's (v holds
 * it now), SHM_E_STATE if it had moved on.  The CAS names the dead holder,
 * so two replicas that both find it dead cannot both take the lock over. */
static inline int shm_collect_steal(shm_seg *s, uint32_t v, uint32_t dead) {
    _Atomic uint32_t *lock = &shm_hdr(s)->collect_lock;
    /* MO: relaxed; the CAS below decides. */
    uint32_t cur = atomic_load_explicit(lock, memory_order_relaxed);
    while ((cur & ~SHM_LOCK_WAITERS) == dead + 1) {
        /* MO: acquire, as taking the lock. */
        if (atomic_compare_exchange_weak_explicit(
                lock, &cur, (v + 1) | (cur & SHM_LOCK_WAITERS),
                memory_order_acquire, memory_order_relaxed))
            return SHM_OK;
    }
    return SHM_E_STATE;
}

/* Server v belongs to replica r (set up before it serves). */
static inline void shm_server_init(shm_seg *s, uint32_t v, uint32_t r) {
    shm_server_head *head = shm_server_at(s, v);
    head->replica = r;
    /* MO: relaxed; nothing is in the table yet. */
    atomic_store_explicit(&head->n, 0, memory_order_relaxed);
}

/* The size of server v's current batch (its table is cut to n entries
 * when rows are failed, or to 0 once the batch is finished).  MO: relaxed:
 * it only shrinks the part a recovery looks at, and a recovery skips the
 * slots no longer TAKEN anyway. */
static inline void shm_server_set_n(shm_seg *s, uint32_t v, uint32_t n) {
    atomic_store_explicit(&shm_server_at(s, v)->n, n, memory_order_relaxed);
}

/* Puts server v's batch back: every slot of its table still TAKEN with the
 * generation it was taken with returns to READY (its WAITER bit kept), for
 * another replica to take.  For a server whose replica died (or is failing
 * on its way out).  A scan may run meanwhile: it only takes READY slots,
 * and a slot put back is taken like any other.  Returns how many requests
 * went back; the caller rings the evaluator's doorbell
 * (shm_notify_evaluator) when there were any. */
static inline uint32_t shm_requeue(shm_seg *s, uint32_t v) {
    shm_server_head *head = shm_server_at(s, v);
    shm_taken *taken = shm_server_taken(s, v);
    /* MO: acquire; pairs with the release store in shm_scan. */
    uint32_t n = atomic_load_explicit(&head->n, memory_order_acquire);
    uint32_t back = 0;
    if (n > s->p.max_batch) n = s->p.max_batch; /* a scribbled table */
    for (uint32_t i = 0; i < n; i++) {
        if (taken[i].client >= s->p.max_clients ||
            taken[i].slot >= s->p.slots_per_client)
            continue;
        _Atomic uint32_t *w = shm_slot_word_at(s, taken[i].client,
                                               taken[i].slot);
        uint32_t want = shm_slot_word(SLOT_TAKEN, taken[i].gen);
        /* MO: relaxed; the CAS below decides (a bounded number of times:
         * only the client's WAITER bit can change a TAKEN word, and one
         * toggling it in a loop must not hold us here; its request then
         * stays in the batch table, for the next put-back). */
        uint32_t cur = atomic_load_explicit(w, memory_order_relaxed);
        for (uint32_t tries = 0;
             (cur & ~SLOT_WAITER) == want && tries < SHM_CAS_TRIES; tries++) {
            /* MO: relaxed.  The input stays published: every write of the
             * word since the client's release CAS of READY is a
             * read-modify-write (the take's CAS, the client's WAITER CAS,
             * this CAS), so they all belong to that CAS's release
             * sequence, and the next taker's acquire fence, which reads
             * this CAS's value, synchronises with the client. */
            if (atomic_compare_exchange_weak_explicit(
                    w, &cur,
                    shm_slot_word(SLOT_READY, taken[i].gen) |
                        (cur & SLOT_WAITER),
                    memory_order_relaxed, memory_order_relaxed)) {
                back++;
                break;
            }
        }
        /* A slot the dead server had completed: it may have died between
         * its completion, which clears the WAITER bit, and the ring of the
         * doorbell (shm_finish), and then nobody else would wake the
         * client before its tick.  A spare ring costs one look. */
        if (shm_state_is_final(shm_word_state(cur)) &&
            shm_word_gen(cur) == taken[i].gen)
            shm_ring_word(&shm_hdr(s)->done_seq[taken[i].client / 32u],
                          1u << (taken[i].client % 32u));
    }
    atomic_store_explicit(&head->n, 0, memory_order_relaxed);
    return back;
}

/* Server v, holding the collect lock, puts back the batches of replica r
 * (every server of r: shm_requeue), a replica that died or stopped and
 * whose process is gone, and rings the evaluator's doorbell for them.
 * Returns how many requests went back, or 0, doing nothing, when v does
 * not hold the collect lock.
 *
 * Why only under the lock: a slot that r listed and had not yet taken when
 * it died is READY, and once another replica takes it a put-back could not
 * tell that take from r's (both are TAKEN of one generation).  r lists
 * and takes under the collect lock, and un-lists what it failed to take,
 * so r's tables hold only its real takes whenever nobody scans, and a
 * put-back leaves its tables empty; a second one (of a caller that took
 * the lock over from a first one killed midway) finds READY what the
 * first put back and leaves it.  Whoever takes the lock over from a dead
 * holder puts that holder's replica back before its first scan. */
static inline uint32_t shm_requeue_replica(shm_seg *s, uint32_t v,
                                           uint32_t r) {
    /* MO: relaxed; only v itself can have made v the holder. */
    uint32_t cur = atomic_load_explicit(&shm_hdr(s)->collect_lock,
                                        memory_order_relaxed) &
                   ~SHM_LOCK_WAITERS;
    if (r >= s->p.replicas || cur != v + 1) return 0;
    /* A replica serving again (restarted) is never put back: its tables
     * are its new process's batches.  MO: relaxed; it stored SERVING
     * before it took the collect lock for its first scan, and our holding
     * the lock came after that scan's unlock (release) if its tables hold
     * anything, so then we read SERVING here. */
    if (atomic_load_explicit(&shm_replica_at(s, r)->state,
                             memory_order_relaxed) == REPLICA_SERVING)
        return 0;
    uint32_t per = s->p.servers / s->p.replicas, back = 0;
    for (uint32_t u = r * per; u < (r + 1) * per; u++)
        back += shm_requeue(s, u);
    if (back) shm_notify_evaluator(s, back);
    return back;
}

/* Whether replica r's batch tables in the segment are empty and the
 * collect lock names none of its servers: what a restarted replica waits
 * for, before it sets its servers up again (shm_server_init empties the
 * tables), while other replicas serve; their housekeeping puts its dead
 * process's batches back and takes the lock over from it.  MO: relaxed;
 * the put-backs are made under the collect lock, and a restarted replica
 * collects only under it too. */
static inline int shm_replica_settled(shm_seg *s, uint32_t r) {
    uint32_t per = s->p.servers / s->p.replicas;
    if (r >= s->p.replicas) return 0;
    for (uint32_t u = r * per; u < (r + 1) * per; u++)
        if (atomic_load_explicit(&shm_server_at(s, u)->n,
                                 memory_order_relaxed))
            return 0;
    /* MO: relaxed; as the table lengths above. */
    uint32_t cur = atomic_load_explicit(&shm_hdr(s)->collect_lock,
                                        memory_order_relaxed) &
                   ~SHM_LOCK_WAITERS;
    return !(cur > r * per && cur <= (r + 1) * per);
}

/* A restarted replica r puts back what its dead process left in its batch
 * tables, itself, when no other replica serves (one replica, or none other
 * with a live process: the caller checks, and the owner restarts one
 * replica at a time, so none starts meanwhile).  Safe without the collect
 * lock because nobody scans: the old process is gone (the owner restarts
 * only once it has exited), so each listed slot still TAKEN with its
 * generation is its take, and a slot it listed but had not taken is READY
 * and stays so.  Frees the collect lock if the old process died holding
 * it: it names a server of r, which no one would take over once r serves
 * again.  Call before r's servers are set up again (shm_server_init
 * empties the tables).  Returns how many requests went back. */
static inline uint32_t shm_requeue_restarted(shm_seg *s, uint32_t r) {
    if (r >= s->p.replicas) return 0;
    uint32_t per = s->p.servers / s->p.replicas, back = 0;
    for (uint32_t u = r * per; u < (r + 1) * per; u++)
        back += shm_requeue(s, u);
    _Atomic uint32_t *lock = &shm_hdr(s)->collect_lock;
    /* MO: relaxed; the CAS below decides. */
    uint32_t cur = atomic_load_explicit(lock, memory_order_relaxed);
    uint32_t id = cur & ~SHM_LOCK_WAITERS;
    /* MO: release, as an unlock (shm_collect_unlock); a sleeper on the
     * word is woken as there. */
    if (id > r * per && id <= (r + 1) * per &&
        atomic_compare_exchange_strong_explicit(lock, &cur, 0,
                                                memory_order_release,
                                                memory_order_relaxed) &&
        (cur & SHM_LOCK_WAITERS))
        shm_futex_wake(lock, 1);
    if (back) shm_notify_evaluator(s, back);
    return back;
}

/* Raises the weights floor to at least `version` (a CAS loop, never
 * lowering it): collectors raise it as they collect, and the owner raises
 * it once an update it sent was applied, before set_weights returns, so
 * that a replica that refused the update serves no more answers of the
 * older weights from then on.  MO: relaxed; a replica's collect reads the
 * floor under the collect lock, and the owner's update is announced
 * through the control words. */
static inline void shm_raise_floor(shm_seg *s, uint64_t version) {
    shm_raise_word(&shm_hdr(s)->version_floor, version, memory_order_relaxed);
}

/* With several replicas, each collects only with weights at least as new
 * as the newest any replica has collected with (the floor): then a request
 * sent after another request's answer came back is computed by the same or
 * newer weights, whichever replica takes it.  Under the collect lock:
 * returns 1 (and raises the floor to `version`) when a replica serving
 * `version` may collect; 0 when it must first apply the newer weights it
 * was sent.
 *
 * The floor holds only while a replica serves it: when every replica with
 * weights at least the floor has stopped or died (an update that this one
 * refused, then the replicas that took it died), nobody could ever answer
 * again, so the floor comes down to this replica's version and it
 * collects (answers then go back to older weights; the alternative is a
 * hang).  So does a floor that any process scribbled on. */
static inline int shm_version_ok(shm_seg *s, uint64_t version) {
    _Atomic uint64_t *floor = &shm_hdr(s)->version_floor;
    /* MO: relaxed (all); the collect lock orders the collectors, and the
     * replicas' versions are read as hints: one that applies the floor's
     * weights meanwhile collects on its next turn. */
    uint64_t cur = atomic_load_explicit(floor, memory_order_relaxed);
    if (version >= cur) {
        shm_raise_floor(s, version);
        return 1;
    }
    /* Behind: wait while a serving replica has the floor's weights (this
     * one, below the floor, is not counted). */
    if (shm_replicas_current(s) > 0) return 0;
    /* Nobody serves the floor: bring it down to us (unless it moved). */
    return atomic_compare_exchange_strong_explicit(
        floor, &cur, version, memory_order_relaxed, memory_order_relaxed);
}

/* True while slot `t` is still the one this batch took: outputs are written
 * only into such slots.  The check and the copy that follows are two steps;
 * what keeps the slot from being reclaimed between them is rule 2 (no
 * reclaim while a batch is in flight), which shm_client_reclaim enforces. */
static inline int shm_still_taken(shm_seg *s, const shm_taken *t) {
    /* MO: relaxed; only the evaluator moves a slot out of TAKEN. */
    uint32_t cur = atomic_load_explicit(
        shm_slot_word_at(s, t->client, t->slot), memory_order_relaxed);
    return (cur & ~SLOT_WAITER) == shm_slot_word(SLOT_TAKEN, t->gen);
}

/* Rings doorbell word `group` for the waiters with `bits`.  MO: release;
 * the slot words changed before it (DONE, FAILED) or ev_state (closed) are
 * visible to a waiter that reads the new value (see shm_slot_wait). */
static inline void shm_ring_doorbell(shm_seg *s, uint32_t group,
                                     uint32_t bits) {
    shm_ring_word(&shm_hdr(s)->done_seq[group], bits);
}

/* Marks every slot of the batch TAKEN -> DONE (or FAILED), then wakes the
 * clients asleep on them.  Two passes: a woken client may preempt us (the
 * scheduler favours the wakee), and by then every answer of the batch is
 * already published, so no other client of the batch waits behind it.
 * The generation check refuses to complete a slot that is no longer the one
 * we took (counted in ST_STALE_COMPLETIONS).  Returns how many slots were
 * completed. */
static inline uint32_t shm_finish(shm_seg *s, shm_taken *taken, uint32_t n,
                                  uint32_t final_state) {
    shm_header *h = shm_hdr(s);
    uint32_t done = 0;
    for (uint32_t i = 0; i < n; i++) {
        _Atomic uint32_t *w = shm_slot_word_at(s, taken[i].client,
                                               taken[i].slot);
        uint32_t want = shm_slot_word(SLOT_TAKEN, taken[i].gen);
        taken[i].wake = 0;
        /* MO: relaxed; the CAS below re-checks. */
        uint32_t cur = atomic_load_explicit(w, memory_order_relaxed);
        for (uint32_t tries = 0;; tries++) {
            if ((cur & ~SLOT_WAITER) != want) {
                shm_stat_add(&h->st[ST_STALE_COMPLETIONS], 1);
                break;
            }
            if (tries == SHM_CAS_TRIES) {
                /* The word keeps changing, and only its client's WAITER bit
                 * can (a TAKEN slot is ours alone to move): a client
                 * toggling it in a loop must not hold the evaluator here.
                 * The state moves by an add that leaves that bit as it is.
                 * MO: release, as the CAS. */
                cur = atomic_fetch_add_explicit(w, final_state - SLOT_TAKEN,
                                                memory_order_release);
                taken[i].wake = 1;
                done++;
                break;
            }
            /* MO: release; pairs with the acquire loads in shm_slot_wait:
             * the outputs written before this are visible to the client.
             * Clearing WAITER here is fine: we wake the waiter below. */
            if (atomic_compare_exchange_weak_explicit(
                    w, &cur, shm_slot_word(final_state, taken[i].gen),
                    memory_order_release, memory_order_relaxed)) {
                taken[i].wake = (cur & SLOT_WAITER) != 0;
                done++;
                break;
            }
        }
    }
    /* One FUTEX_WAKE_BITSET per doorbell word for the whole batch: the
     * kernel wakes every waiter of the batch before this thread returns to
     * user space, where a wakee may preempt it (one wake system call per
     * slot let the first wakee preempt us before we had woken the rest).
     * A spurious wake (the client already took its answer) only makes a
     * waiter look again. */
    uint32_t bits = 0, group = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!taken[i].wake) continue;
        uint32_t g = taken[i].client / 32u;
        if (bits && g != group) {
            shm_ring_doorbell(s, group, bits);
            bits = 0;
        }
        group = g;
        bits |= shm_done_bit(taken[i].client);
    }
    if (bits) shm_ring_doorbell(s, group, bits);
    return done;
}

/* Scatters the outputs of a batch into its slots, stamps the model version
 * and publishes DONE.  Output field j of request i is the field_bytes[j]
 * contiguous bytes at fields[j] + i * field_stride[j] (a stride, so that a
 * model output that is a strided view needs no copy); it goes to offset
 * field_off[j] of the slot's output area (the caller checked that the fields
 * fit in out_bytes and that the source rows exist). */
static inline uint32_t shm_complete_fields(shm_seg *s, shm_taken *taken,
                                           uint32_t n, uint32_t nfields,
                                           const char *const *fields,
                                           const uint64_t *field_bytes,
                                           const int64_t *field_stride,
                                           const uint64_t *field_off,
                                           uint64_t model_version) {
    for (uint32_t i = 0; i < n; i++) {
        if (!shm_still_taken(s, &taken[i])) continue; /* counted in finish */
        shm_slot_meta *m = shm_slot_meta_at(s, taken[i].client, taken[i].slot);
        char *out = shm_slot_out(s, taken[i].client, taken[i].slot);
        m->model_version = model_version;
        m->err_len = 0;
        for (uint32_t j = 0; j < nfields; j++)
            memcpy(out + field_off[j], fields[j] + (int64_t)i * field_stride[j],
                   field_bytes[j]);
    }
    return shm_finish(s, taken, n, SLOT_DONE);
}

/* The same with one packed result row of out_bytes per request. */
static inline uint32_t shm_complete(shm_seg *s, shm_taken *taken,
                                    uint32_t n, const char *results,
                                    uint64_t model_version) {
    uint64_t off = 0;
    int64_t stride = (int64_t)s->p.out_bytes;
    return shm_complete_fields(s, taken, n, 1, &results, &s->p.out_bytes,
                               &stride, &off, model_version);
}

/* Fails every slot of the batch with the same error text. */
static inline uint32_t shm_fail(shm_seg *s, shm_taken *taken,
                                uint32_t n, const char *msg, uint32_t len) {
    if (len > s->l.out_area) len = (uint32_t)s->l.out_area;
    for (uint32_t i = 0; i < n; i++) {
        if (!shm_still_taken(s, &taken[i])) continue; /* counted in finish */
        shm_slot_meta *m = shm_slot_meta_at(s, taken[i].client, taken[i].slot);
        m->err_len = len;
        memcpy(shm_slot_out(s, taken[i].client, taken[i].slot), msg, len);
    }
    return shm_finish(s, taken, n, SLOT_FAILED);
}

/* Per-batch statistics (evaluator only). */
static inline void shm_record_batch(shm_seg *s, uint32_t r, uint32_t n,
                                    uint32_t rows, uint64_t model_ns,
                                    int failed) {
    shm_header *h = shm_hdr(s);
    shm_replica *rep = shm_replica_at(s, r);
    shm_stat_add(&rep->requests, n);
    shm_stat_add(&rep->batches, 1);
    shm_stat_add(&rep->model_ns, model_ns);
    shm_stat_add(&h->st[ST_REQUESTS], n);
    shm_stat_add(&h->st[ST_BATCHES], 1);
    shm_stat_add(&h->st[ST_PADDED_ROWS], rows - n);
    shm_stat_add(&h->st[ST_MODEL_NS], model_ns);
    shm_stat_add(&h->hist_model[shm_hist_bin(model_ns)], 1);
    if (n <= s->p.max_batch) shm_stat_add(&shm_batch_hist(s)[n], 1);
    if (failed) {
        shm_stat_add(&h->st[ST_FAILED_REQUESTS], n);
        shm_stat_add(&h->st[ST_FAILED_BATCHES], 1);
    }
}

/* Statistics access by index (enum shm_stat). */
static inline uint64_t shm_stat_get(shm_seg *s, uint32_t i) {
    /* MO: relaxed; statistics are eventually consistent figures. */
    return i < SHM_N_STATS ? atomic_load_explicit(&shm_hdr(s)->st[i],
                                                  memory_order_relaxed)
                           : 0;
}
static inline void shm_stat_put(shm_seg *s, uint32_t i, uint64_t v) {
    /* MO: relaxed; puts come from the serving loop while no batch is in flight. */
    if (i < SHM_N_STATS)
        atomic_store_explicit(&shm_hdr(s)->st[i], v, memory_order_relaxed);
}
static inline void shm_stat_inc(shm_seg *s, uint32_t i, uint64_t v) {
    if (i < SHM_N_STATS) shm_stat_add(&shm_hdr(s)->st[i], v);
}
static inline uint64_t shm_hist_get(shm_seg *s, uint32_t which, uint32_t b) {
    shm_header *h = shm_hdr(s);
    /* MO: relaxed; as above. */
    if (which == 0)
        return b < SHM_HIST_BINS ? atomic_load_explicit(&h->hist_wait[b],
                                                        memory_order_relaxed)
                                 : 0;
    if (which == 1)
        return b < SHM_HIST_BINS ? atomic_load_explicit(&h->hist_model[b],
                                                        memory_order_relaxed)
                                 : 0;
    return b <= s->p.max_batch ? atomic_load_explicit(&shm_batch_hist(s)[b],
                                                      memory_order_relaxed)
                               : 0;
}

/* ------------------------------------------------------------------ */
/* Header accessors                                                    */
/* ------------------------------------------------------------------ */

static inline uint32_t shm_ev_state(shm_seg *s) {
    /* MO: acquire; pairs with the release stores of ev_state. */
    return atomic_load_explicit(&shm_hdr(s)->ev_state, memory_order_acquire);
}
/* Why it stopped (SHM_STOP_*), and the detail; after shm_ev_state saw a
 * final state. */
static inline uint32_t shm_stop_reason(shm_seg *s, int32_t *detail) {
    /* MO: relaxed; ordered by the caller's acquire load of ev_state. */
    uint64_t w = atomic_load_explicit(&shm_hdr(s)->stop, memory_order_relaxed);
    *detail = (int32_t)(uint32_t)w;
    return (uint32_t)(w >> 32);
}
/* Replica r's process, state and weights version (for liveness checks and
 * statistics). */
static inline int32_t shm_replica_info(shm_seg *s, uint32_t r,
                                       uint64_t *starttime, uint32_t *state,
                                       uint64_t *version) {
    shm_replica *rep = shm_replica_at(s, r);
    /* MO: acquire; pairs with the release store of the state in
     * shm_set_serving (pid and start time are written before it). */
    *state = atomic_load_explicit(&rep->state, memory_order_acquire);
    *starttime = atomic_load_explicit(&rep->starttime, memory_order_relaxed);
    *version = atomic_load_explicit(&rep->version, memory_order_relaxed);
    return atomic_load_explicit(&rep->pid, memory_order_relaxed);
}
/* Replica r's statistics: requests, batches, model time. */
static inline void shm_replica_stats(shm_seg *s, uint32_t r, uint64_t out[3]) {
    shm_replica *rep = shm_replica_at(s, r);
    /* MO: relaxed; statistics. */
    out[0] = atomic_load_explicit(&rep->requests, memory_order_relaxed);
    out[1] = atomic_load_explicit(&rep->batches, memory_order_relaxed);
    out[2] = atomic_load_explicit(&rep->model_ns, memory_order_relaxed);
}
static inline const char *shm_replica_device(shm_seg *s, uint32_t r) {
    return shm_replica_at(s, r)->device;
}
/* Replica r publishes `len` bytes of text (its tuner's report; at most
 * 8 * SHM_REPORT_WORDS, longer is cut).  Only replica r writes its report.
 * A sequence lock: the sequence number is odd while the words change, and a
 * reader keeps a copy only if it read the same even number before and
 * after (shm_report_read).  The words are atomics, so a reader that
 * overlaps a write reads a mix of old and new words, never a torn word, and
 * then throws the copy away.  No fences (ThreadSanitizer does not model
 * them): the words are stored with release and loaded with acquire. */
static inline void shm_report_write(shm_seg *s, uint32_t r, const char *text,
                                    uint64_t len) {
    shm_replica *rep = shm_replica_at(s, r);
    if (len > 8ull * SHM_REPORT_WORDS) len = 8ull * SHM_REPORT_WORDS;
    /* MO: relaxed; its only writer is this thread. */
    uint64_t seq = atomic_load_explicit(&rep->report_seq, memory_order_relaxed);
    /* MO: relaxed; ordered before each word below by that word's release
     * store: a reader that loads (acquire) any new word then reads the odd
     * number, or a later one, when it checks the sequence again. */
    atomic_store_explicit(&rep->report_seq, seq + 1, memory_order_relaxed);
    for (uint64_t i = 0; i * 8 < len; i++) {
        uint64_t w = 0;
        memcpy(&w, text + i * 8, len - i * 8 < 8 ? len - i * 8 : 8);
        /* MO: release; see the odd number above. */
        atomic_store_explicit(&rep->report[i], w, memory_order_release);
        if (i == (len / 8) / 2) SHM_HOOK("report_write_half");
    }
    /* MO: release; as the words. */
    atomic_store_explicit(&rep->report_len, len, memory_order_release);
    /* MO: release; pairs with the reader's acquire load of the sequence
     * number before its copy. */
    atomic_store_explicit(&rep->report_seq, seq + 2, memory_order_release);
}

/* Copies replica r's report into buf (cap bytes, at least 8 *
 * SHM_REPORT_WORDS); returns its length, 0 when it has none, or
 * -1 when every try overlapped a write. */
static inline int64_t shm_report_read(shm_seg *s, uint32_t r, char *buf,
                                      uint64_t cap) {
    shm_replica *rep = shm_replica_at(s, r);
    for (int tries = 0; tries < 64; tries++) {
        /* MO: acquire; pairs with the writer's release store of an even
         * number: the words and length of that write are visible. */
        uint64_t s0 = atomic_load_explicit(&rep->report_seq, memory_order_acquire);
        if (s0 & 1) {
            sched_yield();
            continue;
        }
        /* MO: acquire, as each word below: if it comes from a later write,
         * that write's odd number (or a later one) is visible to the
         * re-read of the sequence, and the copy is thrown away. */
        uint64_t len = atomic_load_explicit(&rep->report_len, memory_order_acquire);
        if (len > cap) len = cap;
        if (len > 8ull * SHM_REPORT_WORDS) len = 8ull * SHM_REPORT_WORDS;
        for (uint64_t i = 0; i * 8 < len; i++) {
            uint64_t w = atomic_load_explicit(&rep->report[i], memory_order_acquire);
            memcpy(buf + i * 8, &w, len - i * 8 < 8 ? len - i * 8 : 8);
        }
        /* MO: relaxed; ordered after the acquire loads above. */
        if (atomic_load_explicit(&rep->report_seq, memory_order_relaxed) == s0)
            return (int64_t)len;
    }
    return -1;
}

/* Replica r serves the given weights version from now on. */
static inline void shm_replica_version(shm_seg *s, uint32_t r,
                                       uint64_t version) {
    /* MO: relaxed; information for statistics (the floor orders). */
    atomic_store_explicit(&shm_replica_at(s, r)->version, version,
                          memory_order_relaxed);
}

/* Replica r leaves REPLICA_SERVING for `state` (STOPPED: by itself;
 * DEAD: found dead by another, or by its restarted self).  Returns the
 * replicas still serving after it, or -1 when r was not serving (another
 * got there first: the CAS lets one caller only do what follows, such as
 * putting r's batches back) or is no longer process `pid`. */
static inline int shm_replica_stop(shm_seg *s, uint32_t r, uint32_t state,
                                   int32_t pid) {
    uint32_t cur = REPLICA_SERVING;
    /* A replica found dead is named by the process found gone (pid, else
     * 0): a restarted replica writes its new pid before it serves again
     * (shm_replica_restart), so a finder that judged the old process does
     * not stop the new one.  MO: relaxed; a hint that narrows that race to
     * the instructions between this load and the CAS (docs/protocol.md,
     * *Restarts*). */
    if (pid && atomic_load_explicit(&shm_replica_at(s, r)->pid,
                                    memory_order_relaxed) != pid)
        return -1;
    /* MO: acq_rel; one caller wins, and sees what r did before. */
    if (!atomic_compare_exchange_strong_explicit(
            &shm_replica_at(s, r)->state, &cur, state, memory_order_acq_rel,
            memory_order_relaxed))
        return -1;
    /* MO: acq_rel; the last one out sees every other's leaving. */
    return (int)atomic_fetch_sub_explicit(&shm_hdr(s)->replicas_serving, 1,
                                          memory_order_acq_rel) - 1;
}

/* Replica r's new process (pid, its start time), restarted by the owner
 * after the old one died: the entry leaves SERVING if nobody found the old
 * process dead yet (keeping replicas_serving right: shm_set_serving counts
 * it again), then names the new process, before its tables are put back
 * and it serves (shm_replica_settled, shm_requeue_restarted).  Returns
 * what shm_replica_stop returned. */
static inline int shm_replica_restart(shm_seg *s, uint32_t r, int32_t pid,
                                      uint64_t starttime) {
    shm_replica *rep = shm_replica_at(s, r);
    int left = shm_replica_stop(s, r, REPLICA_DEAD, 0);
    /* MO: relaxed; information for finders (shm_replica_stop's pid). */
    atomic_store_explicit(&rep->starttime, starttime, memory_order_relaxed);
    atomic_store_explicit(&rep->pid, pid, memory_order_relaxed);
    return left;
}
/* How many restarts the owner may still make (shm_header.restarts_left).
 * MO: acquire; pairs with the release store in shm_set_restarts_left: a
 * client that reads the lowered count after a restart also sees the
 * restarted replica serving (it served before the owner lowered it). */
static inline uint32_t shm_restarts_left(shm_seg *s) {
    return atomic_load_explicit(&shm_hdr(s)->restarts_left,
                                memory_order_acquire);
}
static inline void shm_set_restarts_left(shm_seg *s, uint32_t n) {
    /* MO: release; pairs with the acquire load in shm_restarts_left. */
    atomic_store_explicit(&shm_hdr(s)->restarts_left, n, memory_order_release);
}

/* Replica r (process pid, its start time, on `device`) serves: its entry,
 * then the evaluator's STARTING -> SERVING (unless a close was requested
 * meanwhile).  Returns the evaluator's resulting state. */
static inline uint32_t shm_set_serving(shm_seg *s, uint32_t r, int32_t pid,
                                       uint64_t starttime,
                                       const char *device) {
    shm_header *h = shm_hdr(s);
    shm_replica *rep = shm_replica_at(s, r);
    size_t len = strnlen(device, SHM_DEVICE_MAX - 1);
    memcpy(rep->device, device, len);
    rep->device[len] = 0;
    atomic_store_explicit(&rep->starttime, starttime, memory_order_relaxed);
    atomic_store_explicit(&rep->pid, pid, memory_order_relaxed);
    /* MO: relaxed; the release store of its state below publishes it. */
    atomic_fetch_add_explicit(&h->replicas_serving, 1, memory_order_relaxed);
    /* MO: release; pairs with the acquire load in shm_replica_info. */
    atomic_store_explicit(&rep->state, REPLICA_SERVING, memory_order_release);
    atomic_store_explicit(&h->heartbeat_ns, shm_now_ns(),
                          memory_order_relaxed);
    uint64_t t0 = 0;
    /* MO: relaxed; the first replica's start time wins (statistics). */
    atomic_compare_exchange_strong_explicit(&h->st[ST_SERVE_START_NS], &t0,
                                            shm_now_ns(), memory_order_relaxed,
                                            memory_order_relaxed);
    uint32_t expected = EV_STARTING;
    /* MO: acq_rel; pairs with the CAS in shm_request_close. */
    atomic_compare_exchange_strong_explicit(&h->ev_state, &expected,
                                            EV_SERVING, memory_order_acq_rel,
                                            memory_order_acquire);
    return atomic_load_explicit(&h->ev_state, memory_order_acquire);
}
static inline uint64_t shm_heartbeat(shm_seg *s) {
    /* MO: relaxed; a hint. */
    return atomic_load_explicit(&shm_hdr(s)->heartbeat_ns,
                                memory_order_relaxed);
}
static inline uint32_t shm_replicas_serving(shm_seg *s) {
    /* MO: relaxed; a count. */
    return atomic_load_explicit(&shm_hdr(s)->replicas_serving,
                                memory_order_relaxed);
}
static inline uint32_t shm_n_attached(shm_seg *s) {
    /* MO: relaxed; a hint for spin decisions. */
    return atomic_load_explicit(&shm_hdr(s)->n_attached, memory_order_relaxed);
}
/* shm_header.crowding: the runnable tasks on the evaluator's CPUs against
 * those CPUs, as the spin rule reads them (_ring.pyx, _spin_policy). */
enum shm_crowding {
    SHM_CROWD_NONE = 0,  /* no reading, or no more tasks than CPUs */
    SHM_CROWD_YIELD = 1, /* one more task than CPUs */
    SHM_CROWD_SLEEP = 2, /* more than that */
};
static inline uint32_t shm_crowding(shm_seg *s) {
    /* MO: relaxed; a hint for spin decisions, like n_attached. */
    return atomic_load_explicit(&shm_hdr(s)->crowding, memory_order_relaxed);
}
static inline void shm_set_crowding(shm_seg *s, uint32_t c) {
    /* MO: relaxed; see shm_crowding.  Stored only on a change: every
     * client's wait reads this line. */
    if (atomic_load_explicit(&shm_hdr(s)->crowding, memory_order_relaxed) != c)
        atomic_store_explicit(&shm_hdr(s)->crowding, c, memory_order_relaxed);
}
/* The spec as this process read and checked it (shm_attach's copy). */
static inline const char *shm_spec(shm_seg *s, uint32_t *len) {
    *len = s->spec_len;
    return s->spec;
}
static inline int32_t shm_owner_pid(shm_seg *s) {
    return shm_hdr(s)->owner_pid;
}
/* The creator's pid and time namespaces (0 = unknown). */
static inline uint64_t shm_pid_ns(shm_seg *s) { return shm_hdr(s)->pid_ns; }
static inline uint64_t shm_owner_starttime(shm_seg *s) {
    return shm_hdr(s)->owner_starttime;
}
static inline uint64_t shm_time_ns(shm_seg *s) { return shm_hdr(s)->time_ns; }
static inline shm_slot_meta *shm_meta(shm_seg *s, uint32_t c, uint32_t k) {
    return shm_slot_meta_at(s, c, k);
}

/* Requests the serving loop to stop; wakes it if asleep. */
static inline void shm_request_close(shm_seg *s) {
    shm_header *h = shm_hdr(s);
    uint32_t cur = atomic_load_explicit(&h->ev_state, memory_order_relaxed);
    /* MO: release CAS loop; pairs with the acquire loads in shm_collect. Only
     * STARTING/SERVING move to CLOSING: CLOSED and DIED stay as they are. */
    while (cur < EV_CLOSING &&
           !atomic_compare_exchange_weak_explicit(&h->ev_state, &cur,
                                                  EV_CLOSING,
                                                  memory_order_release,
                                                  memory_order_relaxed)) {
    }
    /* MO: seq_cst; a change of submit_seq makes a concurrent futex_wait in
     * shm_collect return at once. */
    atomic_fetch_add_explicit(&h->submit_seq, 1, memory_order_seq_cst);
    shm_futex_wake(&h->submit_seq, INT_MAX);
}

/* Asks the serving loop to handle a control request between batches and
 * wakes it if asleep.  Returns the request's ticket (1, 2, ...): the loop
 * reports it handled through shm_control_done.  Serialise callers. */
static inline uint32_t shm_request_control(shm_seg *s) {
    shm_header *h = shm_hdr(s);
    /* MO: release; pairs with the acquire load in shm_collect. */
    uint32_t ticket =
        atomic_fetch_add_explicit(&h->ctl_req, 1, memory_order_release) + 1;
    /* MO: seq_cst; as in shm_request_close: a changed submit_seq makes a
     * sleeping or about-to-sleep evaluator return to its loop, where it sees
     * ctl_req. */
    atomic_fetch_add_explicit(&h->submit_seq, 1, memory_order_seq_cst);
    shm_futex_wake(&h->submit_seq, INT_MAX);
    return ticket;
}
/* Replica r has handled the control requests up to `ticket`. */
static inline void shm_control_done(shm_seg *s, uint32_t r, uint32_t ticket) {
    /* MO: release; the controller may read ctl_done to see progress. */
    atomic_store_explicit(&shm_replica_at(s, r)->ctl_done, ticket,
                          memory_order_release);
}
/* Replica r's pending control requests: the requested and the handled
 * tickets. */
static inline uint32_t shm_control_pending(shm_seg *s, uint32_t r,
                                           uint32_t *done) {
    shm_header *h = shm_hdr(s);
    /* MO: acquire; pairs with the release stores above. */
    *done = atomic_load_explicit(&shm_replica_at(s, r)->ctl_done,
                                 memory_order_acquire);
    return atomic_load_explicit(&h->ctl_req, memory_order_acquire);
}

/* Records why the evaluator stopped (the first caller's reason wins, so
 * that an owner closing an evaluator that just crashed does not report a
 * clean close), stores the final state that reason implies (EV_CLOSED for
 * SHM_STOP_CLOSED, else EV_DIED), then wakes every sleeping client so it
 * sees it within one futex round instead of its timeout. */
static inline void shm_close_and_wake(shm_seg *s, uint32_t reason,
                                      int32_t detail) {
    shm_header *h = shm_hdr(s);
    uint64_t want = (uint64_t)reason << 32 | (uint32_t)detail, stop = 0;
    /* MO: relaxed; published by the release store of ev_state below.  On
     * failure `stop` holds the winner's word, and every caller derives the
     * same final state from it. */
    if (!atomic_compare_exchange_strong_explicit(
            &h->stop, &stop, want, memory_order_relaxed, memory_order_relaxed))
        want = stop;
    uint32_t final_state =
        (uint32_t)(want >> 32) == SHM_STOP_CLOSED ? EV_CLOSED : EV_DIED;
    /* MO: release; a waiter that reads a doorbell rung below sees it, and
     * one that reads this final state sees the stop word. */
    atomic_store_explicit(&h->ev_state, final_state, memory_order_release);
    /* Every doorbell, not only those below the clients' high-water mark: a
     * client claimed meanwhile must not sleep through the close either. */
    for (uint32_t g = 0; g < (s->p.max_clients + 31u) / 32u; g++)
        shm_ring_doorbell(s, g, FUTEX_BITSET_MATCH_ANY);
}

#endif /* SHMEVAL_RING_H */
