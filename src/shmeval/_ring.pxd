# The classes of the Cython wrapper shmeval._ring: their C fields and their
# cdef methods.  The bodies are in _ring.pyx; the C core it wraps is declared
# in _core/ring.pxd.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

cimport cython
cimport numpy as cnp
from cpython.pythread cimport PyThread_type_lock
from cpython.ref cimport PyObject

from shmeval._core.ring cimport shm_seg, shm_taken, shm_ticker, SHM_MAX_SLOTS_PER_CLIENT


@cython.final
cdef class Layout:
    """One method's rows (spec.MethodSpec), in C."""
    cdef readonly uint32_t index  # the method's index (its requests' header)
    cdef readonly object method   # spec.MethodSpec
    cdef uint32_t n_out
    cdef uint64_t *out_off
    cdef uint64_t *out_nbytes
    cdef tuple out_names          # declared outputs, in order
    cdef int *out_nd              # their ranks,
    cdef int *out_type            # NumPy type numbers,
    cdef cnp.npy_intp *out_shape  # and shapes, back to back (_out_dims)
    cdef Py_ssize_t *out_at       # where output j's shape starts in out_shape
    cdef list out_float           # float or complex kind
    cdef bint out_native          # every output a native built-in dtype
    cdef uint32_t n_in            # its inputs: names, dtypes,
    cdef tuple in_names
    cdef tuple in_dtypes
    cdef uint64_t *in_off         # places in a request row and sizes,
    cdef uint64_t *in_nbytes
    cdef int *in_nd               # ranks and shapes (back to back)
    cdef cnp.npy_intp *in_shape
    cdef Py_ssize_t *in_at
    cdef int *in_type             # NumPy type numbers
    cdef tuple in_scalars         # NumPy scalar types (a 0-d input of one state)
    cdef bint in_native           # every input a native built-in dtype
    cdef object pack_one          # one request row, packed and reused (ClientPort._pack_fast)

    cdef cnp.npy_intp *_out_dims(self, Py_ssize_t j) noexcept
    cdef void _zero_gaps(self, char *row, uint64_t row_bytes) noexcept
    cdef dict _unpack(self, const char *rows, uint64_t row_bytes, Py_ssize_t n)


@cython.final  # its cdef methods are called as C functions
cdef class Segment:
    """One mapping of a shared segment in this process."""
    cdef shm_seg seg
    cdef char *addr
    cdef uint64_t size
    cdef readonly tuple layouts   # one per method of the spec (set_spec)
    cdef shm_ticker *ticker       # this process's ticker (start_ticker), or NULL
    cdef int ticker_pid           # the process that started it
    cdef list old_tickers         # stopped ones (addresses), freed with the segment
    cdef readonly object name
    # The evaluation cache, in this process (used with the GIL held):
    cdef uint64_t *cbuf           # one entry's data words, scratch
    cdef readonly uint64_t seen_version  # newest model version of an answer here
    cdef uint64_t ck1[SHM_MAX_SLOTS_PER_CLIENT]  # each slot's request's keys
    cdef uint64_t ck2[SHM_MAX_SLOTS_PER_CLIENT]  # (ck1 0: not to be cached)
    cdef uint64_t key_tag         # the caller's keys' scheme (set_key_scheme)
    cdef object error_text        # a FAILED answer's text, from _fetch to _take_error

    cdef uint32_t _begin(self, uint32_t c, uint32_t k) except? 0xffffffff
    cdef int _begin_all(self, uint32_t c, const uint32_t *ks, Py_ssize_t m,
                        uint32_t *gens) noexcept
    cdef void _cache_as(self, uint32_t c, uint32_t k, uint64_t k1, uint64_t k2,
                        bint hashed) noexcept
    cdef int _map(self, int fd, uint64_t size) except -1
    cdef int _alloc_cache_buffer(self) except -1
    cdef void _retire_ticker(self)
    cdef shm_ticker *_ticker_for(self, uint32_t c, uint64_t timeout_ns) noexcept nogil
    cdef int _client(self, uint32_t c) except -1
    cdef int _slot(self, uint32_t c, uint32_t k) except -1
    cdef int _replica(self, uint32_t r) except -1
    cdef uint64_t _spin(self, uint64_t spin_ns, uint32_t ncpu) noexcept nogil
    cdef int _wait(self, uint32_t c, uint32_t k, uint32_t gen, uint64_t spin_ns,
                   uint64_t timeout_ns, uint32_t ncpu) noexcept
    cdef int _fetch(self, Layout lay, uint32_t c, uint32_t k, uint32_t gen, list dst,
                    Py_ssize_t row, bint trusted, uint64_t *version) except -1000
    cdef object _fetched(self, int rc, uint64_t version)
    cdef inline object _take_error(self)
    cdef void _deliver(self, Layout lay, const char *src, list dst, Py_ssize_t row) noexcept
    cdef int _check_dst(self, Layout lay, list dst, Py_ssize_t row) except -1
    cdef int _cache_get(self, Layout lay, uint32_t c, const char *state, object key, list dst,
                        Py_ssize_t row, uint64_t *k1, uint64_t *k2,
                        uint64_t *version) except -1
    cdef void _cache_put(self, Layout lay, uint32_t c, uint64_t k1, uint64_t k2,
                         uint64_t version, list dst, Py_ssize_t row)


# SpinArms: judged waits per block (SPIN_BLOCK), the longest of them
# (SPIN_TRIM) left out of its mean, blocks of the better arm per block of the
# other (SPIN_EXPLORE times the ratio of their means, at most
# SPIN_EXPLORE_MAX).  The long arm stretches to cover the answers the short
# arm waits for (their SPIN_COVER_Q-th of SPIN_BLOCK, plus a quarter) when
# that is at most SPIN_COVER_MAX times the long arm as given, and moves when
# the new budget differs from it by a quarter or more.
cdef enum:
    SPIN_BLOCK = 64
    SPIN_TRIM = 8
    SPIN_EXPLORE = 32
    SPIN_EXPLORE_MAX = 512
    SPIN_COVER_Q = 48
    SPIN_COVER_MAX = 4


@cython.final
cdef class SpinArms:
    """A client's spin budget with spin_us "auto": a short and a long arm."""
    cdef readonly uint64_t short_ns
    cdef readonly uint64_t long_ns     # 0: one fixed budget (short_ns)
    cdef readonly uint64_t long_floor_ns  # the long arm as given (16 wake-ups)
    cdef uint64_t short_waits[SPIN_BLOCK]  # this short block's waits
    cdef double mean_ns[2]             # a wait's ns under each arm, by blocks
    cdef double block_ns               # the judged waits of this block, summed
    cdef uint32_t waits                # ... and counted
    cdef uint64_t top[SPIN_TRIM]       # ... the longest of them
    cdef uint32_t top_min              # index of the shortest in top
    cdef uint32_t explore_in           # blocks of the better arm before the other's
    cdef int arm                       # the arm of this block
    cdef int best                      # the arm with the shorter mean (-1: not known)
    cdef bint checking                 # this block checks a changed verdict
    cdef uint64_t blocks[2]            # blocks served under each arm
    cdef uint64_t pick(self) noexcept
    cdef void saw(self, uint64_t ns) noexcept
    cdef void _cover(self) noexcept


@cython.final  # not subclassed: its cpdef methods are called as C functions
cdef class ClientPort:
    """One process's client entry, as the request path uses it."""
    cdef Segment seg
    cdef SpinArms arms
    cdef readonly uint32_t c
    cdef readonly object entry     # shmeval.entry.ProcessEntry
    cdef readonly list free
    cdef readonly uint32_t slots   # slots_per_client
    cdef public int waiters
    cdef object spec               # spec.Spec
    cdef Layout lay0               # the only method's, or None with several
    cdef bint plain                # one method of one unnamed input: arrays as given
    cdef bint fast                 # one method, outputs made in C, results reused
    cdef object in_dtype
    cdef tuple in_shape
    cdef int in_nd
    cdef cnp.npy_intp in_dims[32]
    cdef readonly uint64_t timeout_ns
    cdef uint32_t ncpu
    cdef dict last             # the previous result, reused once nobody holds it
    cdef list last_outs
    cdef dict prev             # the one before: a caller's `out = evaluate(s)`
    cdef list prev_outs        # holds the previous result during the next call
    cdef readonly int pid      # the process this port's client entry belongs to
    cdef public bint retired   # closed: takes no new request (see Client.close)
    cdef public bint detached  # its client entry is detached: waiters give up
    cdef readonly list abandoned  # (slot, generation) of requests whose waiter gave up
    cdef list spares           # output arrays of freed Pendings (_spare_outs)
    cdef Pending sync          # the blocking calls' Pending (_sync_pending)
    cdef bint sync_busy        # ... in use by a call now
    # Each slot's submit Pending while its request is in flight (borrowed: a
    # Pending clears its entries when a request is fetched or given up, and
    # when it is freed).
    cdef PyObject *owner[SHM_MAX_SLOTS_PER_CLIENT]

    cpdef object evaluate(self, object state, bint versioned=*, object key=*, object method=*)
    cpdef object evaluate_many(self, object states, bint versioned=*, object keys=*,
                               object method=*)
    cpdef Pending submit(self, object states, bint block=*, bint versioned=*, object keys=*,
                         object method=*)
    cdef inline int _give_back(self, uint32_t k) except -1
    cdef Pending _post(self, Pending p, Layout lay, cnp.ndarray a, Py_ssize_t start,
                       Py_ssize_t n, object keys, list outs, object versions, bint block,
                       bint own)
    cdef inline Pending _sync_pending(self)
    cdef inline void _release(self, Pending p) noexcept
    cdef inline Py_ssize_t _lookup(self, cnp.ndarray a, Py_ssize_t start, Py_ssize_t n, object keys,
                            Pending p, Py_ssize_t *rows, uint64_t *k1s,
                            uint64_t *k2s) except -1
    cdef inline int _take(self, Py_ssize_t m, bint block, uint32_t *ks) except -1
    cdef int _put_back(self, const uint32_t *ks, Py_ssize_t m) except -1
    cdef inline int _wait_one(self, uint32_t k, uint32_t gen, uint64_t timeout_ns) noexcept
    cdef inline Layout _layout(self, object method)
    cdef inline cnp.ndarray _rows(self, object x, Layout lay, bint single)
    cdef object _pack_fast(self, object x, Layout lay, bint single)
    cdef Py_ssize_t _named(self, object x, Layout lay, bint single, PyObject **src,
                           char *scalar) except -2
    cdef inline cnp.ndarray _input(self, object x, bint single)
    cdef inline object _keys(self, object keys, Py_ssize_t n)
    cdef list _new_outs(self, Py_ssize_t n, Layout lay)
    cdef list _spare_outs(self, Py_ssize_t n, Layout lay)
    cdef void _keep_spare(self, list outs) noexcept
    cdef inline bint _is_output(self, PyObject *arr, Py_ssize_t j, Py_ssize_t rows) noexcept
    cdef bint _unreferenced(self, int older) noexcept


@cython.final
cdef class Pending:
    """The answers to one post (ClientPort._post): a submit's, or a
    blocking call's."""
    cdef void _abandon(self) noexcept
    cdef ClientPort port
    cdef Segment seg
    cdef Layout lay                # its method's
    cdef readonly Py_ssize_t _n    # states submitted
    cdef readonly Py_ssize_t _m    # requests posted (the others the cache answered)
    cdef readonly list _outs
    cdef readonly object _versions  # int64 array, with return_version
    cdef int64_t version           # the model version of the last answer
    cdef bint own                  # a submit's: the port's owner of its slots
    cdef Py_ssize_t fetched        # requests fetched
    cdef Py_ssize_t unclaimed      # requests in flight that nobody is waiting for
    cdef object error              # the last failed row's batch's error text (None: none),
    cdef Py_ssize_t error_row      # ... and that row
    cdef object exc                # what result() raises
    cdef object result_
    cdef object __weakref__
    cdef uint32_t ks[SHM_MAX_SLOTS_PER_CLIENT]
    cdef uint32_t gens[SHM_MAX_SLOTS_PER_CLIENT]
    cdef int32_t rows[SHM_MAX_SLOTS_PER_CLIENT]
    cdef uint8_t state[SHM_MAX_SLOTS_PER_CLIENT]

    cdef inline void _armed(self, Py_ssize_t m, bint own) noexcept
    cdef int _collect(self, double deadline, object timeout) except -1
    cdef inline Py_ssize_t _claim(self) noexcept
    cdef inline void _claim_at(self, Py_ssize_t i) noexcept
    cdef inline void _unclaim(self, Py_ssize_t i) noexcept
    cdef int _give_up(self, Py_ssize_t i) except -1
    cdef inline int _record(self, Py_ssize_t i, int rc, uint64_t version) except -1
    cdef inline void _disown(self, Py_ssize_t i) noexcept
    cdef object _finish(self)


cdef class ClientBase:
    """The base of shmeval.Client: its process's port in a C field."""
    cdef public object _port


cdef class ServeGroup:
    """The Servers of one segment serving from several threads."""
    cdef PyThread_type_lock lock
    cdef readonly int in_flight
    cdef public uint64_t version
    cdef public bint stop
    cdef uint32_t cursor

    cdef void _acquire(self) noexcept


cdef class Server:
    """The evaluator's side: collect a batch, then complete or fail it."""
    cdef Segment seg
    cdef Layout lay               # the method of the group outstanding
    cdef readonly ServeGroup group
    cdef shm_taken *taken_all     # its batch table, in this process's memory
    cdef shm_taken *taken         # ... from the group outstanding on
    cdef uint32_t left            # requests of the batch not finished yet
    cdef bint packed              # named inputs: made from the request rows
    cdef bint multi               # several methods: a group per method
    cdef object _rows             # request rows: grouped by method, or the batch's
    cdef uint32_t gstart[16]      # each method's first row in _rows
    cdef uint32_t gmethod[16]     # the batch's groups: method,
    cdef uint32_t gcount[16]      # ... requests
    cdef int ng, gi               # groups, and the one outstanding
    cdef object _returned         # what serve() returns after _serve_group
    cdef char *batch
    cdef object _keep
    cdef uint32_t n
    cdef uint32_t cap
    cdef const char **fields
    cdef int64_t *strides
    cdef uint64_t busy_since
    cdef list views
    cdef bint locked              # holds its group's lock
    cdef uint32_t ncpu
    cdef public bint extra_outputs_ok  # a dict of outputs may hold undeclared ones
    cdef uint32_t v               # its index among the segment's servers
    cdef uint32_t replica         # the replica it serves for
    cdef bint shared              # several replicas: collect under the segment's lock
    cdef bint seg_locked          # holds the segment's collect lock
    cdef int64_t *calls           # serve()'s model calls: start, duration, rows, requests
    cdef Py_ssize_t n_calls, calls_cap
    # What serve() reads, set by configure() (and tune(), for the first three).
    cdef uint32_t max_batch       # most requests per batch (0: not configured)
    cdef uint64_t spin_ns         # the idle evaluator's spin budget
    cdef uint64_t max_wait_ns     # wait for a fuller batch after the first request
    cdef uint64_t idle_ns         # return IDLE after this long without a request
    cdef bint reject_nonfinite    # non-finite float outputs fail their rows
    cdef uint32_t *buckets        # padded batch sizes, ascending
    cdef uint32_t n_buckets

    cdef void _collected(self, uint32_t n) noexcept
    cdef void _finished(self, uint32_t k) noexcept
    cdef uint32_t _group(self, uint32_t n) except? 0xffffffff
    cdef uint32_t _next_group(self) noexcept
    cdef object _model_input(self, uint32_t rows)
    cdef int _serve_group(self, object model, uint32_t n) except -1
    cdef void _seg_unlock(self) noexcept
    cpdef int collect(self, uint32_t max_batch, uint64_t spin_ns, uint64_t max_wait_ns,
                      uint64_t timeout_ns) except? -1000
    cpdef end_busy(self)
    cpdef bint finish_fast(self, object out, uint32_t rows, uint64_t model_ns,
                           uint64_t version) except -1
    cpdef uint32_t complete(self, list arrays, uint64_t model_version) except? 0xffffffff
