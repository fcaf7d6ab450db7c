/*
 * ring/layout.h -- the segment as bytes: the constants, the status codes,
 * the slot state word, the structs of the header, the replicas, the
 * servers' batch tables and the client table, the layout computed from the
 * parameters, the addresses of its parts, and shm_init / shm_attach, which
 * format and check a segment.  Also what the header records of its creator.
 */
#ifndef SHMEVAL_RING_LAYOUT_H
#define SHMEVAL_RING_LAYOUT_H

#include "platform.h"

/* ------------------------------------------------------------------ */
/* Constants                                                          */
/* ------------------------------------------------------------------ */

#define SHM_MAGIC 0x314C4156454D4853ULL /* "SHMEVAL1" little-endian */
#define SHM_LAYOUT_VERSION 10u
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
#define SHM_MAX_METHODS 16u      /* methods of one evaluator (spec.MAX_METHODS) */
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

static inline int shm_state_is_final(uint32_t st) {
    return st == SLOT_DONE || st == SLOT_FAILED;
}

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
/* Layout                                                             */
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
    /* Each method's requests, model calls and model ns (an evaluator of
     * several methods; shm_record_method). */
    _Atomic uint64_t method_st[SHM_MAX_METHODS][3];
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
/* The batch-size histogram, max_batch + 1 counters after the header. */
static inline _Atomic uint64_t *shm_batch_hist_at(const shm_seg *s) {
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
/* The creator, as the header records it                              */
/* ------------------------------------------------------------------ */

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

#endif /* SHMEVAL_RING_LAYOUT_H */
