# Declarations of the C core: ring.h (the protocol) and ring_python.h (the
# wrapper's helpers that need Python.h).  Only the Cython wrappers cimport
# this: shmeval._ring, and the benchmark extension for what it shares.
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t


cdef extern from "ring.h" nogil:
    uint64_t SHM_SPIN_YIELD
    enum: SHM_REPORT_WORDS
    enum: SHM_MAX_METHODS

    ctypedef struct shm_params:
        uint64_t in_bytes
        uint64_t out_bytes
        uint32_t max_clients
        uint32_t slots_per_client
        uint32_t max_batch
        uint32_t replicas
        uint32_t servers
        uint32_t cache_log2

    ctypedef struct shm_layout:
        uint64_t header_bytes
        uint64_t clients_off
        uint64_t client_stride
        uint64_t slots_off
        uint64_t slot_stride
        uint64_t in_off
        uint64_t out_off
        uint64_t out_area
        uint64_t cache_off
        uint64_t cache_stride
        uint64_t cache_words
        uint64_t total

    ctypedef struct shm_seg:
        char *base
        shm_layout l
        shm_params p

    ctypedef struct shm_taken:
        uint32_t client
        uint32_t slot
        uint32_t gen

    ctypedef struct shm_slot_meta:
        uint64_t publish_ns
        uint64_t model_version
        uint32_t err_len

    enum:
        SHM_LAYOUT_VERSION
        SHM_SPEC_MAX
        SHM_HIST_BINS
        SHM_MAX_SLOTS_PER_CLIENT
        SHM_N_STATS
        SHM_OK
        SHM_E_TOO_SMALL
        SHM_E_MAGIC
        SHM_E_VERSION
        SHM_E_PARAMS
        SHM_E_SPEC
        SHM_E_FULL
        SHM_TIMEOUT
        SHM_CLOSED
        SHM_E_STATE
        SHM_CONTROL
        SHM_STALE
        SHM_BEHIND
        SHM_MAX_REPLICAS
        SHM_DEVICE_MAX
        REPLICA_EMPTY
        REPLICA_SERVING
        REPLICA_STOPPED
        REPLICA_DEAD
        SLOT_FREE
        SLOT_WRITING
        SLOT_READY
        SLOT_TAKEN
        SLOT_DONE
        SLOT_FAILED
        SLOT_STATE_MASK
        SLOT_WAITER
        SLOT_GEN_SHIFT
        EV_STARTING
        EV_SERVING
        EV_CLOSING
        EV_CLOSED
        EV_DIED
        SHM_STOP_NONE
        SHM_STOP_CLOSED
        SHM_STOP_OWNER_DIED
        SHM_STOP_CRASHED
        SHM_STOP_EXITED
        ST_BUSY_NS
        SHM_CACHE_MAX_LOG2
        SHM_CACHE_MISS
        SHM_CACHE_HIT
        SHM_CACHE_OLD

    const uint64_t SHM_CACHE_MAX_BYTES
    void shm_hash_state(const char *p, uint64_t n, uint64_t *k1, uint64_t *k2)
    uint64_t shm_cache_entries(const shm_seg *s)
    uint64_t shm_cache_version(shm_seg *s)
    void shm_cache_set_version(shm_seg *s, uint64_t version)
    int shm_cache_get(shm_seg *s, uint32_t c, uint64_t key, uint64_t key2,
                      uint64_t min_version, uint64_t *out, uint64_t *version)
    int shm_cache_put(shm_seg *s, uint32_t c, uint64_t key, uint64_t key2, uint64_t version,
                      const uint64_t *data)
    void shm_cache_census(shm_seg *s, uint64_t sample, uint64_t *scanned, uint64_t *held,
                          uint64_t *old)
    void shm_client_cache_stats(shm_seg *s, uint32_t c, uint64_t *out)

    int shm_layout_compute(const shm_params *p, shm_layout *l)
    int shm_init(shm_seg *s, char *base, uint64_t size, const shm_params *p,
                 const char *spec, uint32_t spec_len, int32_t owner_pid,
                 uint64_t owner_starttime, uint64_t pid_ns, uint64_t time_ns)
    int shm_attach(shm_seg *s, char *base, uint64_t size)
    uint64_t shm_now_ns()

    int shm_client_register(shm_seg *s, int32_t pid, uint64_t starttime, uint64_t pid_ns)
    void shm_client_detach(shm_seg *s, uint32_t c)
    int32_t shm_client_info(shm_seg *s, uint32_t c, uint64_t *starttime, uint64_t *pid_ns,
                            uint32_t *detached)
    int shm_client_reclaim(shm_seg *s, uint32_t c)
    uint64_t shm_client_requests(shm_seg *s, uint32_t c)

    int shm_slot_begin(shm_seg *s, uint32_t c, uint32_t k, int32_t pid, uint32_t *gen)
    int shm_slot_publish(shm_seg *s, uint32_t c, uint32_t k, uint32_t gen)
    int shm_slot_abort(shm_seg *s, uint32_t c, uint32_t k, uint32_t gen)
    void shm_notify_evaluator(shm_seg *s, uint32_t count)
    int shm_slot_wait(shm_seg *s, uint32_t c, uint32_t k, uint32_t gen, uint64_t spin_ns,
                      uint64_t timeout_ns)
    ctypedef struct shm_ticker:
        uint32_t c
        uint64_t period_ns
        int running
    int shm_slot_wait_ticked(shm_seg *s, uint32_t c, uint32_t k, uint32_t gen,
                             uint64_t spin_ns, uint64_t timeout_ns, shm_ticker *t)
    int shm_slots_wait_any(shm_seg *s, uint32_t c, const uint32_t *ks, const uint32_t *gens,
                           uint32_t n, uint64_t spin_ns, uint64_t timeout_ns, shm_ticker *t,
                           uint32_t *which)
    int shm_ticker_start(shm_ticker *t, const shm_seg *s, uint32_t c, uint64_t period_ns)
    void shm_ticker_stop(shm_ticker *t)
    int shm_slot_release(shm_seg *s, uint32_t c, uint32_t k, uint32_t gen)
    uint32_t shm_slot_peek(shm_seg *s, uint32_t c, uint32_t k)
    char *shm_slot_in(const shm_seg *s, uint32_t c, uint32_t k)
    char *shm_slot_out(const shm_seg *s, uint32_t c, uint32_t k)
    void shm_copy(char *dst, const char *src, size_t n)
    shm_slot_meta *shm_slot_meta_at(const shm_seg *s, uint32_t c, uint32_t k)

    int shm_collect(shm_seg *s, uint32_t v, shm_taken *own, char *batch,
                    uint32_t max_batch, uint32_t *cursor, uint64_t spin_ns,
                    uint64_t max_wait_ns, uint64_t timeout_ns)
    shm_taken *shm_server_taken(const shm_seg *s, uint32_t v)
    void shm_server_init(shm_seg *s, uint32_t v, uint32_t r)
    uint32_t shm_server_replica(const shm_seg *s, uint32_t v)
    void shm_server_set_n(shm_seg *s, uint32_t v, uint32_t n)
    uint32_t shm_requeue(shm_seg *s, uint32_t v)
    uint32_t shm_requeue_replica(shm_seg *s, uint32_t v, uint32_t r)
    int shm_collect_lock(shm_seg *s, uint32_t v, uint64_t timeout_ns)
    void shm_collect_unlock(shm_seg *s)
    int shm_collect_holder(shm_seg *s)
    int shm_collect_steal(shm_seg *s, uint32_t v, uint32_t dead)
    int shm_version_ok(shm_seg *s, uint64_t version)
    void shm_raise_floor(shm_seg *s, uint64_t version)
    uint32_t shm_complete_fields(shm_seg *s, shm_taken *taken, uint32_t n,
                                 uint32_t nfields, const char *const *fields,
                                 const uint64_t *field_bytes, const int64_t *field_stride,
                                 const uint64_t *field_off, uint64_t model_version)
    uint32_t shm_fail(shm_seg *s, shm_taken *taken, uint32_t n,
                      const char *msg, uint32_t len)
    void shm_record_method(shm_seg *s, uint32_t m, uint32_t n, uint64_t model_ns)
    uint64_t shm_method_stat(shm_seg *s, uint32_t m, uint32_t which)
    void shm_record_batch(shm_seg *s, uint32_t r, uint32_t n, uint32_t rows,
                          uint64_t model_ns, int failed)

    uint64_t shm_stat_get(shm_seg *s, uint32_t i)
    void shm_stat_put(shm_seg *s, uint32_t i, uint64_t v)
    void shm_stat_inc(shm_seg *s, uint32_t i, uint64_t v)
    uint64_t shm_hist_wait(shm_seg *s, uint32_t b)
    uint64_t shm_hist_model(shm_seg *s, uint32_t b)
    uint64_t shm_hist_batch(shm_seg *s, uint32_t n)
    uint32_t shm_ev_state(shm_seg *s)
    int32_t shm_replica_info(shm_seg *s, uint32_t r, uint64_t *starttime, uint32_t *state,
                             uint64_t *version)
    void shm_replica_stats(shm_seg *s, uint32_t r, uint64_t *out)
    const char *shm_replica_device(shm_seg *s, uint32_t r)
    void shm_replica_version(shm_seg *s, uint32_t r, uint64_t version)
    void shm_report_write(shm_seg *s, uint32_t r, const char *text, uint64_t length)
    int64_t shm_report_read(shm_seg *s, uint32_t r, char *buf, uint64_t cap)
    int shm_replica_stop(shm_seg *s, uint32_t r, uint32_t state, int32_t pid)
    int shm_replica_restart(shm_seg *s, uint32_t r, int32_t pid, uint64_t starttime)
    int shm_replica_settled(shm_seg *s, uint32_t r)
    uint32_t shm_requeue_restarted(shm_seg *s, uint32_t r)
    uint32_t shm_restarts_left(shm_seg *s)
    void shm_set_restarts_left(shm_seg *s, uint32_t n)
    uint32_t shm_set_serving(shm_seg *s, uint32_t r, int32_t pid, uint64_t starttime,
                             const char *device)
    uint64_t shm_heartbeat(shm_seg *s)
    uint32_t shm_n_attached(shm_seg *s)
    uint32_t shm_replicas_serving(shm_seg *s)
    enum: SHM_CROWD_NONE
    enum: SHM_CROWD_YIELD
    enum: SHM_CROWD_SLEEP
    uint32_t shm_crowding(shm_seg *s)
    void shm_set_crowding(shm_seg *s, uint32_t c)
    uint64_t shm_spin_policy(uint64_t spin_ns, uint32_t processes, uint32_t ncpu)
    uint64_t shm_evaluator_spin(uint64_t spin_ns, uint32_t n_attached, uint32_t ncpu)
    uint64_t shm_client_spin(uint64_t spin_ns, uint32_t n_attached, uint32_t crowding,
                             uint32_t ncpu)
    uint32_t shm_clients_hwm(shm_seg *s)
    const char *shm_spec(shm_seg *s, uint32_t *len)
    int32_t shm_owner_pid(shm_seg *s)
    uint64_t shm_pid_ns(shm_seg *s)
    uint64_t shm_owner_starttime(shm_seg *s)
    uint64_t shm_time_ns(shm_seg *s)
    void shm_request_close(shm_seg *s)
    uint32_t shm_request_control(shm_seg *s)
    void shm_control_done(shm_seg *s, uint32_t r, uint32_t ticket)
    uint32_t shm_control_pending(shm_seg *s, uint32_t r, uint32_t *done)
    void shm_close_and_wake(shm_seg *s, uint32_t reason, int32_t detail)
    uint32_t shm_stop_reason(shm_seg *s, int32_t *detail)


cdef extern from "ring_python.h" nogil:
    int shm_only_python_thread()
    int shm_finite_f32(const uint32_t *u, Py_ssize_t n)
    int shm_finite_f64(const uint64_t *u, Py_ssize_t n)
