# cython: language_level=3
"""Thin Cython wrappers over the C core (_core/ring.h).

The classes' C fields and cdef methods are declared in _ring.pxd, the C
they call in _core/ring.pxd; this file holds the bodies.  Arguments are
checked and converted to C values first, then ``with nogil`` wraps only the
C call (a client's wait keeps the GIL when the caller is its process's only
Python thread: ``shm_only_python_thread``, _core/ring_python.h).  Status
codes become exceptions in one place, ``_check``.  No protocol logic lives
here: it is all in ring.h.
"""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, UINT64_MAX
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset
from posix.mman cimport MAP_FAILED, MAP_SHARED, PROT_READ, PROT_WRITE, mmap, munmap

cimport numpy as cnp
from cpython.dict cimport PyDict_GetItem, PyDict_Size
from cpython.list cimport PyList_GET_ITEM
from cpython.ref cimport PyObject
from cpython.pythread cimport (PyThread_type_lock, PyThread_allocate_lock, PyThread_free_lock,
                                PyThread_acquire_lock, PyThread_release_lock, WAIT_LOCK)
from posix.unistd cimport usleep


cdef extern from "Python.h":
    Py_ssize_t Py_REFCNT(PyObject *o)
    unsigned long long PyLong_AsUnsignedLongLongMask(object o) except? <unsigned long long>-1

cdef extern from "<pthread.h>" nogil:
    int pthread_atfork(void (*prepare)() noexcept nogil, void (*parent)() noexcept nogil,
                       void (*child)() noexcept nogil)

from posix.unistd cimport getpid
cimport cython

# This process's pid, kept current across fork() by an atfork handler, so the
# hot path can tell "still the process that registered" without a getpid()
# system call per request (glibc no longer caches the pid).
cdef int _current_pid = getpid()

cdef void _after_fork_in_child() noexcept nogil:
    global _current_pid
    _current_pid = getpid()

pthread_atfork(NULL, NULL, _after_fork_in_child)

from shmeval._core.ring cimport *

import operator
from time import monotonic as _monotonic, sleep as _sleep

import numpy as np

from shmeval.errors import (ClientTableFull, EvaluatorClosed, ModelError, SegmentError,
                            ShmevalError, ShmevalTimeout)

cnp.import_array()

LAYOUT_VERSION = SHM_LAYOUT_VERSION
#: Bytes of text a replica can publish (Segment.set_report).
REPORT_BYTES = 8 * SHM_REPORT_WORDS
SPEC_MAX = SHM_SPEC_MAX

# Return values of Segment.wait(); final slot states are positive.
DONE = SLOT_DONE
FAILED = SLOT_FAILED
TIMEOUT = SHM_TIMEOUT
CLOSED = SHM_CLOSED
CONTROL = SHM_CONTROL
STALE = SHM_STALE  # the slot was reclaimed: what it holds is not the caller's
E_STATE = SHM_E_STATE  # release(): the slot is not final (still in flight)

# What Server.serve() returns to the Python serving loop for.
SERVE_IDLE = 0
SERVE_CLOSED = 1
SERVE_SLOW = 2
SERVE_RAISED = 3
SERVE_CONTROL = 4
SERVE_LOCKED_OUT = 5
SERVE_BEHIND = 6

# Evaluator lifecycle (ev_state()).
STARTING = EV_STARTING
SERVING = EV_SERVING
CLOSING = EV_CLOSING
CLOSED_STATE = EV_CLOSED
DIED = EV_DIED

# Why an evaluator stopped (stop_reason(), close_and_wake()).
STOP_NONE = SHM_STOP_NONE
STOP_CLOSED = SHM_STOP_CLOSED
STOP_OWNER_DIED = SHM_STOP_OWNER_DIED
STOP_CRASHED = SHM_STOP_CRASHED
STOP_EXITED = SHM_STOP_EXITED

_REPLICA_STATES = {REPLICA_EMPTY: "empty", REPLICA_SERVING: "serving",
                   REPLICA_STOPPED: "stopped", REPLICA_DEAD: "dead"}

STAT_NAMES = (
    "requests", "batches", "padded_rows", "failed_requests", "failed_batches",
    "model_ns", "busy_ns", "serve_start_ns", "model_version",
    "reclaimed_clients", "reclaimed_writing", "stale_completions", "warmup_ns",
    "weight_updates", "cache_hits", "cache_misses", "cache_stale", "cache_replaced",
    "isolated_rows", "isolation_calls",
)
STAT_INDEX = {name: i for i, name in enumerate(STAT_NAMES)}

_MESSAGES = {
    SHM_E_TOO_SMALL: "segment is smaller than its layout requires (truncated?)",
    SHM_E_MAGIC: "not a shmeval segment (bad magic number)",
    SHM_E_VERSION: "segment has another layout version (this shmeval speaks version %d)"
    % SHM_LAYOUT_VERSION,
    SHM_E_PARAMS: "segment header holds inconsistent or out-of-range parameters",
    SHM_E_SPEC: "segment spec is corrupt (checksum mismatch)",
    SHM_E_STATE: "slot is not in the expected state (protocol violation)",
    SHM_STALE: "this process's client entry was reclaimed (the handle was closed here, "
               "or the evaluator judged this process gone)",
}


cdef int _check(int rc, str what) except -1:
    """The single mapping from core status codes to exceptions."""
    if rc >= 0:
        return rc
    if rc == SHM_E_FULL:
        raise ClientTableFull(f"{what}: the client table is full; raise max_clients")
    raise SegmentError(f"{what}: {_MESSAGES.get(rc, 'error %d' % rc)}")


cdef int _params(shm_params *p, object in_bytes, object out_bytes, object max_clients,
                 object slots_per_client, object max_batch, object replicas,
                 object servers, object cache_entries) except -1:
    if min(in_bytes, out_bytes, max_clients, slots_per_client, max_batch, replicas,
           servers) <= 0:
        raise ValueError("segment parameters must be positive")
    cache_log2 = cache_log2_of(cache_entries)
    memset(p, 0, sizeof(shm_params))
    p.in_bytes = in_bytes
    p.out_bytes = out_bytes
    p.max_clients = max_clients
    p.slots_per_client = slots_per_client
    p.max_batch = max_batch
    p.replicas = replicas
    p.servers = servers
    p.cache_log2 = cache_log2
    return 0


CACHE_MAX_LOG2 = <object>SHM_CACHE_MAX_LOG2
CACHE_MAX_ENTRIES = 1 << CACHE_MAX_LOG2
CACHE_MAX_BYTES = <object>SHM_CACHE_MAX_BYTES


def cache_log2_of(cache_entries):
    """log2 of an evaluation cache size: 0 for no cache (0 or None), else a
    power of two from 4 to CACHE_MAX_ENTRIES; anything else is a ValueError
    that names the limit."""
    if cache_entries is None or cache_entries is False:
        return 0
    try:
        n = operator.index(cache_entries)
    except TypeError:
        raise TypeError(f"cache_entries must be an int, got {type(cache_entries).__name__}") \
            from None
    if n == 0:
        return 0
    if n < 4 or n > CACHE_MAX_ENTRIES or n & (n - 1):
        raise ValueError(f"cache_entries must be 0 (no cache) or a power of two from 4 to "
                         f"2**{CACHE_MAX_LOG2}, got {n}")
    return n.bit_length() - 1


def cache_entry_bytes(out_bytes):
    """Bytes one cache entry takes for outputs of out_bytes."""
    return 32 + 8 * ((out_bytes + 7) // 8)


def segment_size(in_bytes, out_bytes, max_clients, slots_per_client, max_batch, replicas=1,
                 servers=1, cache_entries=0):
    """Bytes a segment with these parameters needs (the core decides):
    `replicas` model replicas serve it from `servers` serving threads in
    all; an evaluation cache of cache_entries entries follows the slots."""
    cdef shm_params p
    cdef shm_layout l
    _params(&p, in_bytes, out_bytes, max_clients, slots_per_client, max_batch, replicas,
            servers, cache_entries)
    if shm_layout_compute(&p, &l) != SHM_OK:
        if p.cache_log2 and cache_entry_bytes(out_bytes) << p.cache_log2 > CACHE_MAX_BYTES:
            raise ValueError(
                f"a cache of {cache_entries} entries of {cache_entry_bytes(out_bytes)} bytes "
                f"is more than the {CACHE_MAX_BYTES >> 40} TiB a segment's cache may take")
        raise ValueError(
            "segment parameters out of range: in_bytes=%d out_bytes=%d max_clients=%d "
            "slots_per_client=%d max_batch=%d replicas=%d servers=%d"
            % (in_bytes, out_bytes, max_clients, slots_per_client, max_batch, replicas,
               servers))
    return l.total


cdef extern from "sys/prctl.h" nogil:
    int prctl(int option, unsigned long arg2, unsigned long arg3, unsigned long arg4,
              unsigned long arg5)
    enum: PR_SET_TIMERSLACK


def set_timer_slack_ns(unsigned long ns):
    """Sets the calling thread's timer slack.  Linux rounds sleeps with a
    timeout up by this much (50 µs by default), which would stretch a
    max_wait_us of a few tens of µs."""
    return prctl(PR_SET_TIMERSLACK, ns, 0, 0, 0) == 0


def now_ns():
    """CLOCK_MONOTONIC in ns, the clock the segment's timestamps use."""
    return shm_now_ns()


cdef inline uint64_t _spin_policy(uint64_t spin_ns, uint32_t processes,
                                 uint32_t ncpu) noexcept nogil:
    """How a waiter (a client, or the evaluator) spins before it sleeps,
    given the processes on the segment (the attached clients and the
    evaluator) and the CPUs they may use:

    * as many CPUs as processes: spin (``spin_ns``), since each has a core;
      the spin still gives its CPU away every ``SHM_SPIN_LOOKS`` looks, for
      a wake-up may have put the process it waits for on the same CPU;
    * one process more than CPUs (as many clients as CPUs): spin, but give
      the CPU away between looks (``SHM_SPIN_YIELD``: ``sched_yield()``
      instead of ``pause``), so a waiter takes a CPU only while no other
      process wants it.  With 2 clients on 2 CPUs this took 2 workers from
      ~100 k to 340-420 k round trips/s on the reference VM; sleeping
      instead, a CPU went idle and every answer paid the wake-up of a halted
      CPU;
    * more: no spin.  Even a yielding spin then loses: its waiters crowd the
      run queues (there the slowest worker fell to 0.14-0.66 of the mean and
      p99.9 to 0.5-4 ms at 3-16 workers), and a plain spin holds a CPU that
      the process it waits for needs (docs/performance.md, "Which knob when")."""
    if spin_ns == 0 or processes > ncpu + 1:
        return 0
    if processes <= ncpu:
        return spin_ns
    return spin_ns | SHM_SPIN_YIELD


cdef class Segment:
    """One mapping of a shared segment in this process.

    The mapping is released only when this object is garbage-collected, never
    by an explicit close: a thread may still be asleep on a futex word in it.
    """

    def __dealloc__(self):
        self._retire_ticker()
        if self.old_tickers is not None:
            for addr in self.old_tickers:
                free(<void *><size_t>addr)
        if self.addr != NULL:
            munmap(self.addr, self.size)
        self._free_outputs()
        free(self.cbuf)

    cdef uint32_t _begin(self, uint32_t c, uint32_t k) except? 0xffffffff:
        """FREE -> WRITING for this process; returns the slot's generation,
        which every later step of the request names (wait, fetch, release):
        a slot reclaimed meanwhile, and perhaps reused by another process,
        is then never read or released as this request's."""
        cdef uint32_t gen = 0
        cdef int rc = shm_slot_begin(&self.seg, c, k, _current_pid, &gen)
        if rc == SHM_STALE:
            raise EvaluatorClosed(_MESSAGES[SHM_STALE])
        _check(rc, "begin")
        self.ck1[k] = 0  # not cached unless the caller sets its keys
        return gen

    cdef int _begin_all(self, uint32_t c, const uint32_t *ks, Py_ssize_t m,
                        uint32_t *gens) except -1:
        """Begins slots ks[0:m] (their generations into gens), all or none:
        when one begin fails, the slots begun before it go back to FREE
        (shm_slot_abort) before the error is raised, so the caller can put
        every slot back on its free list and each can be begun again."""
        cdef Py_ssize_t i, j
        for i in range(m):
            try:
                gens[i] = self._begin(c, ks[i])
            except BaseException:
                for j in range(i):
                    shm_slot_abort(&self.seg, c, ks[j], gens[j])
                raise
        return 0

    cdef inline void _cache_as(self, uint32_t c, uint32_t k, uint64_t k1, uint64_t k2,
                               bint hashed) noexcept:
        """After the input was copied into slot k (still WRITING, so private
        to this process): its answer is to be cached under (k1, k2), the
        keys of its lookup; k1 == 0, not cached.  Keys that are hashes of
        the state's bytes (hashed) are computed again from the slot, so that
        an answer is cached under the bytes it was computed from, even if
        the caller's array changed between the lookup and the copy (another
        thread, or NumPy releasing the GIL during a large copy).  A caller's
        key is the caller's claim and is kept as it is."""
        if k1 and hashed:
            shm_hash_state(shm_slot_in(&self.seg, c, k), self.seg.p.in_bytes, &k1, &k2)
        self.ck1[k] = k1
        self.ck2[k] = k2

    cdef int _map(self, int fd, uint64_t size) except -1:
        cdef void *a
        if size == 0:
            _check(SHM_E_TOO_SMALL, "attach %s" % self.name)
        with nogil:
            a = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if a == MAP_FAILED:
            raise SegmentError("mmap of %s (%d bytes) failed" % (self.name, size))
        self.addr = <char *>a
        self.size = size
        return 0

    @staticmethod
    def create(int fd, uint64_t size, in_bytes, out_bytes, max_clients, slots_per_client,
               max_batch, replicas, servers, bytes spec, int owner_pid, uint64_t pid_ns,
               uint64_t time_ns, name, cache_entries=0, uint64_t owner_starttime=0):
        """Maps a new zero-filled segment (fd) and formats it for the owner
        process (its /proc start time: owner_starttime, 0 unknown) in the
        given pid and time namespaces."""
        cdef Segment self = Segment.__new__(Segment)
        cdef shm_params p
        self.name = name
        _params(&p, in_bytes, out_bytes, max_clients, slots_per_client, max_batch, replicas,
                servers, cache_entries)
        if len(spec) > SHM_SPEC_MAX:
            raise ValueError("spec is %d bytes, the header holds %d" % (len(spec), SHM_SPEC_MAX))
        self._map(fd, size)
        _check(shm_init(&self.seg, self.addr, size, &p, spec, len(spec), owner_pid,
                        owner_starttime, pid_ns, time_ns), "create %s" % name)
        self._alloc_cache_buffer()
        return self

    @staticmethod
    def attach(int fd, uint64_t size, name):
        """Maps an existing segment and validates its header."""
        cdef Segment self = Segment.__new__(Segment)
        self.name = name
        if size < 4096:
            _check(SHM_E_TOO_SMALL, "attach %s" % name)
        self._map(fd, size)
        _check(shm_attach(&self.seg, self.addr, size), "attach %s" % name)
        self._alloc_cache_buffer()
        return self

    cdef int _alloc_cache_buffer(self) except -1:
        if self.seg.p.cache_log2:
            self.cbuf = <uint64_t *>calloc(self.seg.l.cache_words, 8)
            if self.cbuf == NULL:
                raise MemoryError()
        return 0

    def set_outputs(self, tuple outputs):
        """The declared outputs (spec.OutputSpec: name, offset, nbytes, shape,
        dtype), in order.  Client and server fast paths read them from here."""
        cdef Py_ssize_t j, i, n = len(outputs), at = 0
        cdef Py_ssize_t total = sum(len(o.shape) for o in outputs)
        self._free_outputs()
        self.n_out = 0
        self.out_off = <uint64_t *>malloc(sizeof(uint64_t) * max(1, n))
        self.out_nbytes = <uint64_t *>malloc(sizeof(uint64_t) * max(1, n))
        self.out_nd = <int *>malloc(sizeof(int) * max(1, n))
        self.out_type = <int *>malloc(sizeof(int) * max(1, n))
        self.out_at = <Py_ssize_t *>malloc(sizeof(Py_ssize_t) * max(1, n))
        self.out_shape = <cnp.npy_intp *>malloc(sizeof(cnp.npy_intp) * max(1, total))
        if not (self.out_off and self.out_nbytes and self.out_nd and self.out_type and
                self.out_at and self.out_shape):
            raise MemoryError()
        for j, o in enumerate(outputs):
            if o.offset + o.nbytes > self.seg.p.out_bytes:
                raise ValueError("output field exceeds the result row")
            self.out_off[j] = o.offset
            self.out_nbytes[j] = o.nbytes
            self.out_nd[j] = len(o.shape)
            self.out_type[j] = o.dtype.num
            self.out_at[j] = at
            for i in range(len(o.shape)):
                self.out_shape[at + i] = o.shape[i]
            at += len(o.shape)
        self.out_names = tuple(o.name for o in outputs)
        self.out_float = [o.dtype.kind in "fc" for o in outputs]
        self.out_native = all(o.dtype.isnative and o.dtype.num < cnp.NPY_NTYPES_LEGACY and
                              len(o.shape) <= 32 for o in outputs)
        self.n_out = len(outputs)

    cdef void _free_outputs(self):
        free(self.out_off)
        free(self.out_nbytes)
        free(self.out_nd)
        free(self.out_type)
        free(self.out_at)
        free(self.out_shape)
        self.out_off = self.out_nbytes = NULL
        self.out_nd = self.out_type = NULL
        self.out_at = NULL
        self.out_shape = NULL

    cdef inline cnp.npy_intp *_out_dims(self, Py_ssize_t j) noexcept:
        """Output j's shape (out_nd[j] dimensions), in C."""
        return &self.out_shape[self.out_at[j]]

    # ---------------------------------------------------------------- header
    @property
    def spec(self):
        cdef uint32_t n
        cdef const char *p = shm_spec(&self.seg, &n)
        return p[:n]

    @property
    def params(self):
        return dict(in_bytes=self.seg.p.in_bytes, out_bytes=self.seg.p.out_bytes,
                    max_clients=self.seg.p.max_clients,
                    slots_per_client=self.seg.p.slots_per_client,
                    max_batch=self.seg.p.max_batch, replicas=self.seg.p.replicas,
                    servers=self.seg.p.servers, cache_entries=shm_cache_entries(&self.seg))

    @property
    def nbytes(self):
        return self.size

    @property
    def error_bytes(self):
        """Bytes of error text a failed request can carry (its output area)."""
        return self.seg.l.out_area

    @property
    def owner_pid(self):
        return shm_owner_pid(&self.seg)

    @property
    def owner_starttime(self):
        """The creator's /proc start time (clock ticks since boot; 0 unknown)."""
        return shm_owner_starttime(&self.seg)

    @property
    def pid_ns(self):
        """The creator's pid namespace (inode of /proc/<pid>/ns/pid; 0 unknown)."""
        return shm_pid_ns(&self.seg)

    @property
    def time_ns(self):
        """The creator's time namespace (inode of /proc/<pid>/ns/time; 0 unknown)."""
        return shm_time_ns(&self.seg)

    def ev_state(self):
        return shm_ev_state(&self.seg)

    def replicas_serving(self):
        """How many replicas are serving now."""
        return shm_replicas_serving(&self.seg)

    def replicas(self):
        """One dict per replica: index, pid (0 before it serves), start
        time, state ("empty", "serving", "stopped", "dead"), device, weights
        version and its requests, batches and model time (ns)."""
        cdef uint32_t r, state
        cdef uint64_t st, version
        cdef uint64_t counts[3]
        cdef int32_t pid
        out = []
        for r in range(self.seg.p.replicas):
            pid = shm_replica_info(&self.seg, r, &st, &state, &version)
            shm_replica_stats(&self.seg, r, counts)
            out.append(dict(replica=r, pid=pid, starttime=st,
                            state=_REPLICA_STATES.get(state, "unknown"),
                            device=shm_replica_device(&self.seg, r).decode("utf-8", "replace"),
                            version=version, requests=counts[0], batches=counts[1],
                            model_ns=counts[2]))
        return out

    def set_report(self, uint32_t r, bytes text):
        """Replica r publishes text (its tuner's report) for every reader
        of the segment; longer than :data:`REPORT_BYTES` is cut.  Only
        replica r's process calls this."""
        self._replica(r)
        shm_report_write(&self.seg, r, text, len(text))

    def report(self, uint32_t r):
        """Replica r's last published text (bytes), or None before the
        first (or when every try overlapped a write)."""
        cdef char buf[8 * SHM_REPORT_WORDS]
        cdef int64_t n
        self._replica(r)
        n = shm_report_read(&self.seg, r, buf, sizeof(buf))
        return buf[:n] if n > 0 else None

    def replica_stop(self, uint32_t r, str state, int32_t pid=0):
        """Replica r leaves "serving" for "stopped" (by itself) or "dead"
        (found dead by another: ``pid``, the process found gone, so that
        one restarted meanwhile is not stopped).  Returns the replicas
        still serving, or -1 when r was not serving (someone else got there
        first) or is another process than ``pid`` now."""
        self._replica(r)
        return shm_replica_stop(&self.seg, r, REPLICA_STOPPED if state == "stopped"
                                else REPLICA_DEAD, pid)

    def replica_restart(self, uint32_t r, int32_t pid, uint64_t starttime):
        """Replica r's restarted process (pid, start time) takes its entry
        over: out of "serving" if the old process still held it, then named
        by the new process (shm_replica_restart).  Before its servers are
        set up: see replica_settled and requeue_restarted."""
        self._replica(r)
        return shm_replica_restart(&self.seg, r, pid, starttime)

    def replica_settled(self, uint32_t r):
        """True once replica r's batch tables are empty and the collect lock
        names none of its servers (the other replicas put back what its
        dead process held)."""
        self._replica(r)
        return bool(shm_replica_settled(&self.seg, r))

    def requeue_restarted(self, uint32_t r):
        """Restarted replica r puts back what its dead process held, itself:
        only when no other replica serves (shm_requeue_restarted).  Returns
        how many requests went back."""
        self._replica(r)
        return shm_requeue_restarted(&self.seg, r)

    def restarts_left(self):
        """How many restarts of a dead serving process the owner may still
        make (0: it does not heal)."""
        return shm_restarts_left(&self.seg)

    def set_restarts_left(self, uint32_t n):
        """Owner side: announces how many restarts it may still make."""
        shm_set_restarts_left(&self.seg, n)

    def raise_version_floor(self, uint64_t version):
        """No replica collects with weights older than `version` from now
        on, while one serves it (shm_version_ok)."""
        shm_raise_floor(&self.seg, version)

    def collect_holder(self):
        """The serving thread (server index) holding the collect lock, or
        -1 (server_replica() says whose it is)."""
        return shm_collect_holder(&self.seg)

    def server_replica(self, uint32_t v):
        """The replica serving thread (server) v belongs to."""
        if v >= self.seg.p.servers:
            raise IndexError("server index out of range")
        return shm_server_replica(&self.seg, v)

    def replica_version(self, uint32_t r, uint64_t version):
        """Replica r serves weights `version` now (statistics)."""
        self._replica(r)
        shm_replica_version(&self.seg, r, version)

    cdef inline int _replica(self, uint32_t r) except -1:
        if r >= self.seg.p.replicas:
            raise IndexError("replica index out of range")
        return 0

    def n_attached(self):
        return shm_n_attached(&self.seg)

    def crowding(self):
        """How crowded the evaluator's CPUs are (CROWD_NONE, CROWD_YIELD or
        CROWD_SLEEP), as its tuner last published."""
        return shm_crowding(&self.seg)

    def set_crowding(self, uint32_t c):
        """Publishes the crowding every client's spin rule reads (_spin)."""
        if c > SHM_CROWD_SLEEP:
            raise ValueError(f"crowding must be CROWD_NONE, CROWD_YIELD or CROWD_SLEEP, got {c}")
        shm_set_crowding(&self.seg, c)

    def request_close(self):
        with nogil:
            shm_request_close(&self.seg)

    def stat(self, name):
        return shm_stat_get(&self.seg, STAT_INDEX[name])

    def raw_stats(self):
        """Counters and histograms, read with relaxed loads (a snapshot)."""
        cdef uint32_t i
        cdef cnp.ndarray[cnp.uint64_t, ndim=1] wait = cnp.PyArray_ZEROS(
            1, [SHM_HIST_BINS], cnp.NPY_UINT64, 0)
        cdef cnp.ndarray[cnp.uint64_t, ndim=1] model = cnp.PyArray_ZEROS(
            1, [SHM_HIST_BINS], cnp.NPY_UINT64, 0)
        cdef cnp.npy_intp nb = self.seg.p.max_batch + 1
        cdef cnp.ndarray[cnp.uint64_t, ndim=1] batch = cnp.PyArray_ZEROS(
            1, &nb, cnp.NPY_UINT64, 0)
        for i in range(SHM_HIST_BINS):
            wait[i] = shm_hist_get(&self.seg, 0, i)
            model[i] = shm_hist_get(&self.seg, 1, i)
        for i in range(self.seg.p.max_batch + 1):
            batch[i] = shm_hist_get(&self.seg, 2, i)
        d = {name: shm_stat_get(&self.seg, i) for i, name in enumerate(STAT_NAMES)}
        d.update(hist_wait=wait, hist_model=model, batch_hist=batch,
                 clients=shm_n_attached(&self.seg), heartbeat_ns=shm_heartbeat(&self.seg),
                 now_ns=shm_now_ns(), ev_state=shm_ev_state(&self.seg))
        return d

    # ---------------------------------------------------------------- client
    def register(self, int32_t pid, uint64_t starttime, uint64_t pid_ns):
        """Claims a client-table entry for a process (its /proc start time
        and pid namespace, 0 when unknown); returns its index."""
        return _check(shm_client_register(&self.seg, pid, starttime, pid_ns),
                      "register client")

    def detach(self, uint32_t c):
        self._client(c)
        if self.ticker != NULL and self.ticker.c == c:
            # Before the entry can become another process's: a ticker rings
            # its client's doorbell bit.
            self._retire_ticker()
        shm_client_detach(&self.seg, c)

    # A ticker lets this process's waiters sleep without a timer (ring.h,
    # shm_ticker; docs/protocol.md, Waiting).
    def start_ticker(self, uint32_t c, uint64_t period_ns):
        """Starts a ticker thread for client c of this process, ticking every
        period_ns (any previous one is stopped first).  Waits of c with a
        timeout of at least period_ns then sleep without a timer and return
        TIMEOUT at the next tick.  Returns False when no thread could be
        started (waits then use timers)."""
        cdef shm_ticker *t
        cdef int rc
        self._client(c)
        self._retire_ticker()
        t = <shm_ticker *>calloc(1, sizeof(shm_ticker))
        if t == NULL:
            raise MemoryError()
        rc = shm_ticker_start(t, &self.seg, c, period_ns)
        if rc != 0:
            free(t)
            return False
        self.ticker = t
        self.ticker_pid = _current_pid
        return True

    def stop_ticker(self):
        """Stops this process's ticker, if any (waits then use timers)."""
        self._retire_ticker()

    def ticker_running(self, uint32_t c):
        """True when waits of client c with a timeout of at least the
        ticker's period go without a timer in this process."""
        return self._ticker_for(c, UINT64_MAX) != NULL

    cdef void _retire_ticker(self):
        # A stopped ticker is kept (not reused, not freed) until the segment
        # goes: a waiter that chose it may still read it.  A forked child
        # inherits the pointer but not the thread: it only forgets it.
        if self.ticker == NULL:
            return
        if self.ticker_pid == _current_pid:
            with nogil:
                shm_ticker_stop(self.ticker)
        if self.old_tickers is None:
            self.old_tickers = []
        self.old_tickers.append(<size_t>self.ticker)
        self.ticker = NULL

    cdef inline shm_ticker *_ticker_for(self, uint32_t c, uint64_t timeout_ns) noexcept nogil:
        cdef shm_ticker *t = self.ticker
        if t != NULL and self.ticker_pid == _current_pid and t.c == c and t.running and \
                timeout_ns >= t.period_ns:
            return t
        return NULL

    cdef inline int _client(self, uint32_t c) except -1:
        if c >= self.seg.p.max_clients:
            raise IndexError("client index out of range")
        return 0

    cdef inline int _slot(self, uint32_t c, uint32_t k) except -1:
        if c >= self.seg.p.max_clients or k >= self.seg.p.slots_per_client:
            raise IndexError("slot index out of range")
        return 0

    def post(self, uint32_t c, list slots, cnp.ndarray rows, object at, object k1=None,
             object k2=None, bint hashed=True):
        """Copies rows into slots[i] -- rows[at + i] when at is an int, rows[at[i]]
        when a list -- publishes them all, then rings the evaluator's
        doorbell once; returns the slots' generations.  rows must be
        C-contiguous with rows of in_bytes each (the client layer guarantees
        it).  k1, k2: uint64 arrays of every row's cache keys (cache_lookup),
        to cache the answers; None: not cached; hashed: they are hashes of
        the rows' bytes (not the caller's keys), hashed again from the
        slots (_cache_as)."""
        cdef uint64_t inb = self.seg.p.in_bytes
        cdef Py_ssize_t i, n = len(slots), r
        cdef Py_ssize_t nrows = cnp.PyArray_NBYTES(rows) // inb
        cdef Py_ssize_t idx[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint32_t ks[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint32_t gs[SHM_MAX_SLOTS_PER_CLIENT]
        cdef char *src = <char *>cnp.PyArray_DATA(rows)
        cdef list gens = []
        cdef bint cached = k1 is not None and self.seg.p.cache_log2 != 0
        if not cnp.PyArray_IS_C_CONTIGUOUS(rows):
            raise ValueError("rows buffer not C-contiguous")
        if n > SHM_MAX_SLOTS_PER_CLIENT:
            raise ValueError("more rows than a client has slots")
        for i in range(n):
            self._slot(c, slots[i])
            idx[i] = at + i if type(at) is int else at[i]
            if idx[i] < 0 or idx[i] >= nrows:
                raise ValueError("rows buffer too small")
        if cached and (len(k1) < nrows or len(k2) < nrows):
            raise ValueError("fewer cache keys than rows")
        for i in range(n):
            ks[i] = slots[i]
        self._begin_all(c, ks, n, gs)
        for i in range(n):
            gens.append(gs[i])
            shm_copy(shm_slot_in(&self.seg, c, ks[i]), src + idx[i] * inb, inb)
            if cached:
                self._cache_as(c, ks[i], k1[idx[i]], k2[idx[i]], hashed)
        # Copy everything first, then publish in a tight loop: an evaluator
        # scanning meanwhile then rarely splits the rows over two batches.
        # (A slot reclaimed meanwhile is not published; its wait says so.)
        for i in range(n):
            shm_slot_publish(&self.seg, c, ks[i], gs[i])
        with nogil:
            shm_notify_evaluator(&self.seg, <uint32_t>n)
        return gens

    def begin(self, uint32_t c, uint32_t k):
        """FREE -> WRITING for this process (post() begins, copies and
        publishes); returns the slot's generation.  For tests and tools."""
        self._slot(c, k)
        return self._begin(c, k)

    def abort(self, uint32_t c, uint32_t k, uint32_t gen):
        """WRITING -> FREE of a slot begun (generation gen) and never
        published; False when it was not (shm_slot_abort).  For tests and
        tools."""
        self._slot(c, k)
        return shm_slot_abort(&self.seg, c, k, gen) == SHM_OK

    def wait(self, uint32_t c, uint32_t k, uint32_t gen, uint64_t spin_ns, uint64_t timeout_ns,
             uint32_t ncpu):
        """Waits for slot (c, k), begun with generation gen, to finish,
        spinning first as _spin_policy says (plain while the attached clients
        plus the evaluator fit on the cores, yielding when they are one
        more).  Returns DONE, FAILED, TIMEOUT, CLOSED or STALE."""
        self._slot(c, k)
        return self._wait(c, k, gen, spin_ns, timeout_ns, ncpu)

    def client_spin(self, uint64_t spin_ns, uint32_t ncpu):
        """_spin, the budget a client's wait uses now, for tests."""
        return self._spin(spin_ns, ncpu)

    cdef inline uint64_t _spin(self, uint64_t spin_ns, uint32_t ncpu) noexcept nogil:
        """The client spin budget (_spin_policy): none when the attached
        clients outnumber the CPUs (spinning would steal the CPU of the
        process we wait for), a yielding spin when the evaluator is the one
        process more than CPUs.  The processes counted are at least as many
        as the crowding the evaluator's tuner published says: other
        programs' runnable tasks take CPUs too, and a spin that yields to one
        of them gets its CPU back only when that task's time slice ends
        (milliseconds), where a sleeper is woken at once (docs/protocol.md,
        Waiting)."""
        cdef uint32_t processes = shm_n_attached(&self.seg) + 1
        cdef uint32_t crowd = shm_crowding(&self.seg)
        if crowd != SHM_CROWD_NONE and processes < ncpu + crowd:
            processes = ncpu + crowd
        return _spin_policy(spin_ns, processes, ncpu)

    cdef int _wait(self, uint32_t c, uint32_t k, uint32_t gen, uint64_t spin_ns,
                   uint64_t timeout_ns, uint32_t ncpu):
        cdef int rc
        cdef shm_ticker *t = self._ticker_for(c, timeout_ns)
        spin_ns = self._spin(spin_ns, ncpu)
        if shm_only_python_thread():  # nobody else wants the GIL: keep it
            return shm_slot_wait_ticked(&self.seg, c, k, gen, spin_ns, timeout_ns, t)
        with nogil:
            rc = shm_slot_wait_ticked(&self.seg, c, k, gen, spin_ns, timeout_ns, t)
        return rc

    def wait_any(self, uint32_t c, object ks, object gens, uint64_t spin_ns,
                 uint64_t timeout_ns, uint32_t ncpu):
        """Waits until any of slots ks of client c (begun with generations
        gens) is answered or reclaimed: returns (i, DONE / FAILED / STALE)
        for the first such ks[i], or (len(ks), TIMEOUT / CLOSED).  Spins
        as wait() does; one sleep covers every slot."""
        cdef uint32_t kk[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint32_t gg[SHM_MAX_SLOTS_PER_CLIENT]
        cdef Py_ssize_t i, n = len(ks)
        cdef uint32_t which = 0
        cdef int rc
        cdef shm_ticker *t
        if n == 0 or n > SHM_MAX_SLOTS_PER_CLIENT or len(gens) != n:
            raise ValueError(f"wait_any: 1 to {SHM_MAX_SLOTS_PER_CLIENT} slots, "
                             "with one generation each")
        for i in range(n):
            kk[i] = ks[i]
            gg[i] = gens[i]
            self._slot(c, kk[i])
        t = self._ticker_for(c, timeout_ns)
        spin_ns = self._spin(spin_ns, ncpu)
        if shm_only_python_thread():
            rc = shm_slots_wait_any(&self.seg, c, kk, gg, <uint32_t>n, spin_ns, timeout_ns, t,
                                    &which)
        else:
            with nogil:
                rc = shm_slots_wait_any(&self.seg, c, kk, gg, <uint32_t>n, spin_ns, timeout_ns,
                                        t, &which)
        return which, rc

    def fetch(self, uint32_t c, uint32_t k, uint32_t gen, list dst, Py_ssize_t row):
        """Copies a finished slot's outputs into dst[j][row] and frees the slot.
        Returns the model version (DONE), the error text as str (FAILED), or
        STALE when the slot was reclaimed (nothing is delivered)."""
        self._slot(c, k)
        return self._fetch(c, k, gen, dst, row)

    def answer(self, uint32_t c, uint32_t k, uint32_t gen, list dst, Py_ssize_t row,
               uint64_t spin_ns, uint64_t timeout_ns, uint32_t ncpu):
        """wait() then fetch() in one call (the hot path).  Returns the model
        version (>= 0), the error text (str), or TIMEOUT / CLOSED / STALE
        (< 0); after TIMEOUT and CLOSED the slot is still in flight."""
        cdef int rc
        self._slot(c, k)
        rc = self._wait(c, k, gen, spin_ns, timeout_ns, ncpu)
        if rc < 0:
            return rc
        return self._fetch(c, k, gen, dst, row)

    cdef object _fetch(self, uint32_t c, uint32_t k, uint32_t gen, list dst, Py_ssize_t row,
                       bint trusted=False):
        """Copies out the answer of the request begun with generation gen and
        releases the slot; STALE (and nothing delivered) when the slot was
        reclaimed before or during the copy: the release validates the copy
        (shm_slot_release).  trusted: dst are arrays of the declared outputs
        (ClientPort made or checked them), so their size needs no check."""
        cdef uint32_t st, w
        cdef int rc
        cdef shm_slot_meta *m
        cdef char *out
        cdef uint64_t version = 0
        w = shm_slot_peek(&self.seg, c, k)
        if w >> SLOT_GEN_SHIFT != gen:
            return SHM_STALE  # not worth a copy
        st = w & SLOT_STATE_MASK
        m = shm_meta(&self.seg, c, k)
        out = shm_slot_out(&self.seg, c, k)
        if st == SLOT_DONE:
            if not trusted:
                self._check_dst(dst, row)
            self._deliver(out, dst, row)
            version = m.model_version
            result = version
        elif st == SLOT_FAILED:
            result = out[:min(m.err_len, self.seg.l.out_area)].decode("utf-8", "replace")
        else:
            _check(SHM_E_STATE, "fetch")
        rc = shm_slot_release(&self.seg, c, k, gen)
        if rc == SHM_STALE:
            return SHM_STALE  # reclaimed during the copy: the copy is not ours
        _check(rc, "fetch")
        if st == SLOT_DONE:
            # The copy is validated: ours, whole, and of this version.
            if version > self.seen_version:
                self.seen_version = version
            if self.ck1[k]:
                self._cache_put(c, self.ck1[k], self.ck2[k], version, dst, row)
        return result

    def release(self, uint32_t c, uint32_t k, uint32_t gen):
        """Frees a finished slot begun with generation gen without reading
        it (abandoned requests).  Returns 0; STALE, the slot was reclaimed
        and is not ours any more; or E_STATE, still in flight."""
        self._slot(c, k)
        return shm_slot_release(&self.seg, c, k, gen)

    def slot_state(self, uint32_t c, uint32_t k):
        """(state, waiter bit, generation) of a slot, for tests and debugging."""
        self._slot(c, k)
        cdef uint32_t w = shm_slot_peek(&self.seg, c, k)
        return w & SLOT_STATE_MASK, bool(w & SLOT_WAITER), w >> 8

    # ------------------------------------------------------------- evaluator
    def set_serving(self, uint32_t r, int32_t pid, uint64_t starttime, str device=""):
        """Replica r (process pid, its start time, on `device`) serves;
        returns the evaluator's state."""
        self._replica(r)
        cdef bytes dev = device.encode("utf-8")[:SHM_DEVICE_MAX - 1]
        return shm_set_serving(&self.seg, r, pid, starttime, dev)

    def close_and_wake(self, uint32_t reason, int32_t detail=0):
        """Records why serving stopped (STOP_*; the first reason recorded
        wins), stores the final state it implies (CLOSED_STATE for
        STOP_CLOSED, else DIED) and wakes every waiting client."""
        with nogil:
            shm_close_and_wake(&self.seg, reason, detail)

    def stop_reason(self):
        """(STOP_*, detail): why the evaluator stopped, once ev_state() is
        final; detail is an exit code (or minus a signal) for STOP_EXITED."""
        cdef int32_t detail
        cdef uint32_t reason = shm_stop_reason(&self.seg, &detail)
        return reason, detail

    def clients(self):
        """[(index, pid, starttime, pid_ns, detached)] of every claimed entry."""
        cdef uint32_t c, det
        cdef uint64_t st, pid_ns
        cdef int32_t pid
        out = []
        for c in range(shm_clients_hwm(&self.seg)):
            pid = shm_client_info(&self.seg, c, &st, &pid_ns, &det)
            if pid != 0:
                out.append((c, pid, st, pid_ns, bool(det)))
        return out

    def client_requests(self):
        """{index: requests published so far} of every claimed entry
        (statistics: per-client request rates)."""
        cdef uint32_t c, det
        cdef uint64_t st, pid_ns
        out = {}
        for c in range(shm_clients_hwm(&self.seg)):
            if shm_client_info(&self.seg, c, &st, &pid_ns, &det) != 0:
                out[c] = shm_client_requests(&self.seg, c)
        return out

    # ------------------------------------------------------------ the cache
    @property
    def cache_entries(self):
        """Entries of the evaluation cache (0: none)."""
        return shm_cache_entries(&self.seg)

    def cache_keys(self, cnp.ndarray rows):
        """(key, key2): the cache keys of each row of rows (uint64 arrays),
        the two hashes of its bytes a client looks it up by."""
        cdef uint64_t inb = self.seg.p.in_bytes
        cdef Py_ssize_t i, n
        cdef const char *src
        if not cnp.PyArray_IS_C_CONTIGUOUS(rows) or cnp.PyArray_NBYTES(rows) % inb:
            raise ValueError("rows must be C-contiguous rows of in_bytes each")
        n = cnp.PyArray_NBYTES(rows) // inb
        k1 = np.empty(n, np.uint64)
        k2 = np.empty(n, np.uint64)
        cdef uint64_t[::1] a = k1
        cdef uint64_t[::1] b = k2
        src = <const char *>cnp.PyArray_DATA(rows)
        for i in range(n):
            shm_hash_state(src + i * inb, inb, &a[i], &b[i])
        return k1, k2

    def set_key_scheme(self, bytes scheme):
        """The caller's cache keys of this process (key=, keys=) are of the
        scheme these bytes name: a hit needs the same scheme as the store
        (it is hashed into the entry's second key word).  b"": the default
        scheme, shared by every process that names none."""
        cdef uint64_t k1 = 0, k2 = 0
        if scheme:
            shm_hash_state(scheme, len(scheme), &k1, &k2)
        self.key_tag = k1

    def cache_lookup(self, uint32_t c, cnp.ndarray rows, object keys, list dst,
                     object versions):
        """Looks every row of rows up in the cache for client c (by keys[i],
        the caller's key, or by the hashes of its bytes when keys is None).
        A hit's outputs go to row i of the arrays dst (and its model version
        to versions[i] when versions is not None).  Returns (misses, k1, k2):
        the rows not answered, and every row's cache keys (uint64 arrays),
        for post() to cache their answers."""
        cdef uint64_t inb = self.seg.p.in_bytes
        cdef Py_ssize_t i, n
        cdef uint64_t v = 0
        cdef const char *src
        self._client(c)
        self._check_dst(dst, 0)
        if not cnp.PyArray_IS_C_CONTIGUOUS(rows) or cnp.PyArray_NBYTES(rows) % inb:
            raise ValueError("rows must be C-contiguous rows of in_bytes each")
        n = cnp.PyArray_NBYTES(rows) // inb
        if n:
            self._check_dst(dst, n - 1)
        if keys is not None and len(keys) != n:
            raise ValueError(f"{len(keys)} keys for {n} states")
        k1 = np.zeros(n, np.uint64)
        k2 = np.zeros(n, np.uint64)
        cdef uint64_t[::1] a = k1
        cdef uint64_t[::1] b = k2
        misses = []
        if not self.seg.p.cache_log2:
            return list(range(n)), k1, k2
        src = <const char *>cnp.PyArray_DATA(rows)
        for i in range(n):
            if self._cache_get(c, src + i * inb, None if keys is None else keys[i], dst, i,
                               &a[i], &b[i], &v):
                if versions is not None:
                    versions[i] = v
            else:
                misses.append(i)
        return misses, k1, k2

    def cache_version(self):
        """The oldest model version a cache lookup accepts now."""
        return shm_cache_version(&self.seg)

    def cache_set_version(self, uint64_t version):
        """From now on no lookup accepts an answer older than version (the
        owner calls it once new weights serve)."""
        shm_cache_set_version(&self.seg, version)

    def cache_stats(self):
        """The cache's counters: {"hits", "misses", "stale", "replaced"} in
        total (reclaimed clients' included), and per live client
        {index: (hits, misses, stale, replaced)}."""
        cdef uint32_t c, det
        cdef uint64_t st, pid_ns
        cdef uint64_t x[4]
        names = ("hits", "misses", "stale", "replaced")
        total = {n: shm_stat_get(&self.seg, STAT_INDEX["cache_" + n]) for n in names}
        per = {}
        for c in range(shm_clients_hwm(&self.seg)):
            if shm_client_info(&self.seg, c, &st, &pid_ns, &det) != 0:
                shm_client_cache_stats(&self.seg, c, x)
                per[c] = (x[0], x[1], x[2], x[3])
                for i in range(4):
                    total[names[i]] += x[i]
        return total, per

    def cache_census(self, uint64_t sample=0):
        """(scanned, held, old): of `sample` entries spread over the table
        (0: all), how many hold an answer, and how many of those are older
        than cache_version()."""
        cdef uint64_t scanned = 0, held = 0, old = 0
        if self.seg.p.cache_log2:
            with nogil:
                shm_cache_census(&self.seg, sample, &scanned, &held, &old)
        return scanned, held, old

    cdef int _check_dst(self, list dst, Py_ssize_t row) except -1:
        """dst can take an answer in row `row`: one C-contiguous array per
        output, big enough."""
        cdef uint32_t j
        cdef cnp.ndarray a
        if len(dst) != self.n_out:
            raise ValueError("wrong number of output buffers")
        for j in range(self.n_out):
            a = dst[j]
            if not cnp.PyArray_IS_C_CONTIGUOUS(a) or \
                    <uint64_t>cnp.PyArray_NBYTES(a) < (row + 1) * self.out_nbytes[j]:
                raise ValueError("output buffer too small or not C-contiguous")
        return 0

    cdef void _deliver(self, const char *src, list dst, Py_ssize_t row):
        """Copies one answer (output-area bytes at src) into row `row` of
        the arrays dst (checked by the caller)."""
        cdef uint32_t j
        for j in range(self.n_out):
            memcpy(<char *>cnp.PyArray_DATA(<cnp.ndarray>dst[j]) + row * self.out_nbytes[j],
                   src + self.out_off[j], self.out_nbytes[j])

    cdef int _cache_get(self, uint32_t c, const char *state, object key, list dst,
                        Py_ssize_t row, uint64_t *k1, uint64_t *k2,
                        uint64_t *version) except -1:
        """Looks one state up (by key, the caller's, or by the hashes of its
        bytes when key is None) and on a hit delivers its answer into row
        `row` of dst and returns 1; else 0.  Either way k1, k2 are set to
        the state's keys.  The GIL is held (self.cbuf is shared)."""
        cdef uint64_t v = 0, floor
        if key is None:
            shm_hash_state(state, self.seg.p.in_bytes, k1, k2)
        else:
            k1[0] = PyLong_AsUnsignedLongLongMask(key)
            if k1[0] == 0:
                k1[0] = 0x9E3779B97F4A7C15  # 0 marks an empty entry
            # The key scheme's word (0 by default), never a hash's key2 but by
            # chance (hashes' are never 0): the key spaces stay apart.
            k2[0] = self.key_tag
        floor = shm_cache_version(&self.seg)
        if floor < self.seen_version:
            floor = self.seen_version
        if shm_cache_get(&self.seg, c, k1[0], k2[0], floor, self.cbuf, &v) != SHM_CACHE_HIT:
            return 0
        self._deliver(<const char *>self.cbuf, dst, row)
        version[0] = v
        if v > self.seen_version:
            self.seen_version = v
        return 1

    cdef void _cache_put(self, uint32_t c, uint64_t k1, uint64_t k2, uint64_t version,
                         list dst, Py_ssize_t row):
        """Caches the answer in row `row` of dst (an answer this process
        copied out and validated) under (k1, k2).  The GIL is held."""
        cdef uint32_t j
        cdef char *buf = <char *>self.cbuf
        memset(buf, 0, self.seg.l.cache_words * 8)
        for j in range(self.n_out):
            memcpy(buf + self.out_off[j],
                   <char *>cnp.PyArray_DATA(<cnp.ndarray>dst[j]) + row * self.out_nbytes[j],
                   self.out_nbytes[j])
        shm_cache_put(&self.seg, c, k1, k2, version, self.cbuf)

    def reclaim(self, uint32_t c):
        """Evaluator only, with no batch in flight: frees a dead or detached
        client's entry and slots; returns how many slots were stranded
        mid-write, or None (nothing changed) when a slot of the entry is in
        a batch: the core refuses, since completing that batch relies on no
        reclaim happening meanwhile."""
        cdef int rc
        self._client(c)
        rc = shm_client_reclaim(&self.seg, c)
        return None if rc == SHM_E_STATE else rc

    def request_control(self):
        """Controller side: asks the serving loop to handle one control
        request between batches; returns its ticket (1, 2, ...)."""
        return shm_request_control(&self.seg)

    def control_pending(self, uint32_t r=0):
        """(requested, handled by replica r) ticket counters."""
        cdef uint32_t done
        self._replica(r)
        cdef uint32_t req = shm_control_pending(&self.seg, r, &done)
        return req, done

    def control_done(self, uint32_t r, uint32_t ticket):
        """Replica r has handled the control requests up to ticket."""
        self._replica(r)
        shm_control_done(&self.seg, r, ticket)

    def stat_put(self, name, uint64_t v):
        shm_stat_put(&self.seg, STAT_INDEX[name], v)

    def stat_inc(self, name, uint64_t v):
        shm_stat_inc(&self.seg, STAT_INDEX[name], v)


cdef inline int _publish_and_wait(shm_seg *s, uint32_t c, uint32_t k, uint32_t gen,
                                  uint64_t spin_ns, uint64_t timeout_ns,
                                  shm_ticker *t) noexcept nogil:
    """Hands slot (c, k) to the evaluator and waits for its answer."""
    if shm_slot_publish(s, c, k, gen) != SHM_OK:
        return SHM_STALE
    shm_notify_evaluator(s, 1)
    return shm_slot_wait_ticked(s, c, k, gen, spin_ns, timeout_ns, t)


# SpinArms: judged waits per block, the longest of them left out of its
# mean, blocks of the better arm per block of the other (times the ratio of
# their means, at most SPIN_EXPLORE_MAX), and the share of the way an arm's
# mean moves to each of its blocks' means.
DEF SPIN_BLOCK = 64
DEF SPIN_TRIM = 8  # the size of SpinArms.top
DEF SPIN_EXPLORE = 32
DEF SPIN_EXPLORE_MAX = 512
DEF SPIN_SMOOTH = 2.0
# The long arm stretches to cover the answers the short arm waits for (their
# SPIN_COVER_Q-th of SPIN_BLOCK, plus a quarter) when that is at most
# SPIN_COVER_MAX times the long arm as given, and moves when the new budget
# differs from it by a quarter or more.
DEF SPIN_COVER_Q = 48
DEF SPIN_COVER_MAX = 4


cdef class SpinArms:
    """How long a client spins before it sleeps, chosen by what its own
    waits measure (``spin_us="auto"``).

    Two budgets (arms): ``short_ns``, the measured cost of a sleep and a
    wake-up, which spinning can never make more than twice as costly as
    the better choice made in hindsight; and ``long_ns``, several of them,
    which catches an answer that comes a little later than that (a fast
    model, a short batch) without the sleep, the evaluator's wake-up call
    and the wake-up's latency.  Which pays depends on the model, the load
    and the machine, so the client measures it: each wait's ns (from the
    post to the answer) counts towards its arm's mean, the arm with the
    shorter mean serves, and the other one is tried again from time to
    time, so that a change of load is followed.  A spin that costs another
    process its CPU shows as longer waits and loses.

    The arms take turns by blocks of SPIN_BLOCK waits, not wait by wait:
    what a spin saves shows only while it lasts (a CPU that stays awake, an
    evaluator that finds its clients spinning), so one long wait among
    short ones measures the short arm's regime, not the long arm's; and a
    block's mean of 64 waits is steady where a mean smoothed over a few
    waits follows their tail.  The block's SPIN_TRIM longest waits are left
    out of its mean: a wait that the scheduler or the host preempted takes
    milliseconds under either arm, and a few of them in one block outweigh
    the microseconds per wait that the arms differ by.  A block of the
    worse arm comes after as many
    blocks of the better one as SPIN_EXPLORE times the ratio of their
    means, so that trying an arm five times as slow costs no more time
    than trying one a little slower.  ``long_ns`` 0: one fixed budget
    (``spin_us`` set by the caller).

    The long arm as given (``long_floor_ns``, SPIN_LONG_WAKES wake-ups)
    can be shorter than the answers: a model call of 200 µs outlasts 16
    wake-ups of 7 µs, and then both arms sleep, though the CPU the client
    would spin on is free (the spin policy lets it spin only then, or
    yielding) and a spin through the call served 9-11% more than a sleep
    (docs/performance.md, *The tuner*).  So the long arm stretches to
    cover most answers: the upper quartile of a short block's waits, plus
    a quarter.  The short arm's waits are the measure because they do not
    depend on the long arm (a long spin that slows the answers it waits
    for would otherwise lengthen itself); the stretch stops at
    SPIN_COVER_MAX times the long arm as given, beyond which a sleep costs
    too small a share of the wait to be worth a CPU spinning through it,
    and then the long arm is the one given.  A changed long arm is
    measured afresh."""

    def __cinit__(self, uint64_t short_ns, uint64_t long_ns=0):
        self.short_ns = short_ns
        self.long_ns = long_ns if long_ns > short_ns else 0
        self.long_floor_ns = self.long_ns
        self.explore_in = SPIN_EXPLORE
        self.best = -1

    cdef uint64_t pick(self) noexcept:
        """The budget of the next wait (before the spin policy)."""
        if self.long_ns == 0:
            return self.short_ns
        return self.long_ns if self.arm else self.short_ns

    cdef void saw(self, uint64_t ns) noexcept:
        """The wait that pick() budgeted took ns.  A wait longer than its
        budget slept, and the evaluator paid a system call to wake it: it
        counts one wake-up (``short_ns``) more, so that where the arms wait
        alike, the arm that leaves the evaluator's time to the other
        clients serves.  Counted up to twice the long arm (a longer wait
        slept under either arm), and kept in ``top`` while it is one of the
        block's SPIN_TRIM longest, which the block's mean leaves out.  The
        last wait of a block updates its arm's mean and chooses the next
        block's."""
        cdef double *m
        cdef double block
        cdef int best
        cdef uint32_t i
        if self.long_ns == 0:
            return
        if self.arm == 0:
            self.short_waits[self.waits] = ns
        if ns > (self.long_ns if self.arm else self.short_ns):
            ns += self.short_ns  # it slept, and its waker paid a wake-up
        ns = min(ns, 2 * self.long_ns)
        self.block_ns += <double>ns
        self.waits += 1
        if ns > self.top[self.top_min]:  # one of the block's longest so far
            self.top[self.top_min] = ns
            for i in range(SPIN_TRIM):
                if self.top[i] < self.top[self.top_min]:
                    self.top_min = i
        if self.waits < SPIN_BLOCK:
            return
        for i in range(SPIN_TRIM):
            self.block_ns -= <double>self.top[i]
            self.top[i] = 0
        block = self.block_ns / (self.waits - SPIN_TRIM)
        self.blocks[self.arm] += 1
        self.block_ns = 0
        self.waits = 0
        m = &self.mean_ns[self.arm]
        if m[0] == 0 or self.checking:
            m[0] = block  # a check measures the arm afresh
        else:
            m[0] += (block - m[0]) / SPIN_SMOOTH
        if self.arm == 0:
            self._cover()
        if self.mean_ns[0] == 0 or self.mean_ns[1] == 0:  # an arm not measured yet
            self.arm = 1 if self.mean_ns[1] == 0 else 0
            return
        best = 1 if self.mean_ns[1] < self.mean_ns[0] else 0
        if self.best != best and not self.checking and self.best >= 0:
            # The verdict changed: the arm that lost it serves one block
            # more, whose mean replaces its own, and that decides.  A block
            # that the host slowed (more than SPIN_TRIM preempted waits)
            # then costs one block of the worse arm, not the SPIN_EXPLORE
            # blocks until it would be tried again.
            self.best = best
            self.checking = True
            self.arm = 1 - best
            return
        self.best = best
        if self.checking:
            self.checking = False
            self.explore_in = SPIN_EXPLORE
        if self.explore_in > 0:
            self.explore_in -= 1
            self.arm = best
            return
        self.arm = 1 - best
        self.explore_in = <uint32_t>min(<double>SPIN_EXPLORE_MAX,
                                        SPIN_EXPLORE * self.mean_ns[1 - best] / self.mean_ns[best])

    cdef void _cover(self) noexcept:
        """After a short block: the long arm that covers its answers
        (the class's docstring)."""
        cdef uint64_t *w = self.short_waits
        cdef uint64_t x, want
        cdef int i, j
        for i in range(1, SPIN_BLOCK):  # insertion sort: 64 waits per block
            x = w[i]
            j = i - 1
            while j >= 0 and w[j] > x:
                w[j + 1] = w[j]
                j -= 1
            w[j + 1] = x
        want = w[SPIN_COVER_Q] + w[SPIN_COVER_Q] // 4
        if want <= self.long_floor_ns or want > SPIN_COVER_MAX * self.long_floor_ns:
            want = self.long_floor_ns
        if 4 * want >= 5 * self.long_ns or 5 * want <= 4 * self.long_ns:
            self.long_ns = want
            self.mean_ns[1] = 0  # not measured at this budget yet

    def next_budget(self):
        """pick(), for tests."""
        return self.pick()

    def record(self, uint64_t ns):
        """saw(ns), for tests."""
        self.saw(ns)

    def report(self):
        """The arms and each one's mean wait in µs (None: not measured yet)."""
        return {"short_us": self.short_ns / 1e3, "long_us": self.long_ns / 1e3,
                "long_given_us": self.long_floor_ns / 1e3,
                "short_wait_us": self.mean_ns[0] / 1e3 if self.mean_ns[0] else None,
                "long_wait_us": self.mean_ns[1] / 1e3 if self.mean_ns[1] else None,
                "arm": ("fixed" if self.long_ns == 0 else
                        "measuring" if not (self.mean_ns[0] and self.mean_ns[1]) else
                        "long" if self.mean_ns[1] < self.mean_ns[0] else "short"),
                "short_blocks": self.blocks[0], "long_blocks": self.blocks[1]}


cdef class ClientPort:
    """The hot path of ``Client.evaluate`` for one process: checks, slot
    allocation, copy in, publish, wait, copy out and the result dict in one
    call, so that a round trip runs a few hundred bytecodes fewer (which
    matters most when processes outnumber cores and every wake-up starts
    with cold caches).  Anything unusual returns to the Python slow path.

    ``free`` is the process's list of free slot indices, shared with the
    Python ``Client`` (single list operations are atomic under the GIL);
    ``waiters`` counts threads waiting for a slot, which ``notify`` wakes.
    """

    def __cinit__(self, Segment seg, uint32_t c, list free, object in_dtype, tuple in_shape,
                  uint64_t spin_ns, uint64_t timeout_ns, uint32_t ncpu, object notify,
                  uint64_t spin_long_ns=0):
        cdef int i
        self.seg = seg
        self.arms = SpinArms(spin_ns, spin_long_ns)
        self.c = c
        self.pid = _current_pid
        self.free = free
        self.in_dtype = in_dtype
        self.in_nd = len(in_shape)
        # Outputs of a native built-in dtype are created with PyArray_EMPTY;
        # any other declared output keeps this port on the slow path.
        self.fast = seg.out_native and seg.n_out > 0 and self.in_nd <= 32
        for i in range(min(self.in_nd, 32)):
            self.in_dims[i] = in_shape[i]
        self.spin_ns = spin_ns
        self.timeout_ns = timeout_ns
        self.ncpu = ncpu
        self.notify = notify
        self.abandoned = []
        self.spares = []

    def owners(self):
        """The Pendings with requests in flight on this entry (each once)."""
        cdef uint32_t k
        cdef list out = []
        cdef set seen = set()
        for k in range(SHM_MAX_SLOTS_PER_CLIENT):
            if self.owner[k] != NULL and <object>self.owner[k] not in seen:
                seen.add(<object>self.owner[k])
                out.append(<object>self.owner[k])
        return out

    cpdef give_back(self, uint32_t k):
        self.free.append(k)
        if self.waiters:
            self.notify()

    def evaluate(self, object state, object key=None):
        """Returns the result dict; the error text (str) when the batch
        failed; a tuple (status, slot, generation, outputs) when the wait
        timed out, the evaluator closed (the slot is still in flight) or the
        slot was reclaimed (status STALE); or None when the fast path does
        not apply (the caller takes the general path), which includes a call
        from a forked child of the registering process.  key: the state's
        cache key (the caller's), or None to hash its bytes."""
        return self._evaluate(state, False, key)

    def evaluate_versioned(self, object state, object key=None):
        """As evaluate, but a result comes as (dict, model version)."""
        return self._evaluate(state, True, key)

    cdef object _evaluate(self, object state, bint versioned, object key):
        cdef cnp.ndarray a
        cdef uint32_t k, j, gen
        cdef int rc, i
        cdef uint64_t spin, t0, k1 = 0, k2 = 0, cached_version = 0
        cdef shm_ticker *t
        cdef list outs
        cdef dict result
        cdef bint reuse
        cdef object r
        if type(state) is not cnp.ndarray or not self.fast or self.pid != _current_pid:
            return None
        a = <cnp.ndarray>state
        if not cnp.PyArray_IS_C_CONTIGUOUS(a) or cnp.PyArray_NDIM(a) != self.in_nd:
            return None
        for i in range(self.in_nd):
            if cnp.PyArray_DIM(a, i) != self.in_dims[i]:
                return None
        if <PyObject *>cnp.PyArray_DESCR(a) != <PyObject *>self.in_dtype and \
                a.dtype != self.in_dtype:
            return None
        if shm_ev_state(&self.seg.seg) >= EV_CLOSING or self.retired:
            return None
        # A cached result is taken out of the port while in use, so that
        # another thread of this process cannot take it too.
        reuse = True
        if self._unreferenced(0):
            result, outs = self.last, self.last_outs
            self.last = self.last_outs = None
        elif self._unreferenced(1):
            result, outs = self.prev, self.prev_outs
            self.prev = self.prev_outs = None
        else:
            reuse = False
            outs = []
            for j in range(self.seg.n_out):
                outs.append(cnp.PyArray_EMPTY(self.seg.out_nd[j], self.seg._out_dims(j),
                                              self.seg.out_type[j], 0))
        if self.seg.seg.p.cache_log2 and self.seg._cache_get(
                self.c, <const char *>cnp.PyArray_DATA(a), key, outs, 0, &k1, &k2,
                &cached_version):
            r = cached_version  # answered here, without a round trip
        else:
            if not self.free:
                return None
            k = self.free.pop()
            if self.retired:  # closed meanwhile (Client.close waits for popped slots)
                self.free.append(k)
                return None
            try:
                gen = self.seg._begin(self.c, k)
            except BaseException:
                self.free.append(k)
                raise
            shm_copy(shm_slot_in(&self.seg.seg, self.c, k),
                     <const char *>cnp.PyArray_DATA(a), self.seg.seg.p.in_bytes)
            self.seg._cache_as(self.c, k, k1, k2, key is None)
            spin = self.seg._spin(self.arms.pick(), self.ncpu)
            t = self.seg._ticker_for(self.c, self.timeout_ns)
            # The clock only where the arms judge the wait: "auto", spinning allowed.
            t0 = shm_now_ns() if spin and self.arms.long_ns else 0
            if shm_only_python_thread():
                # The process's only Python thread: no one else wants the GIL,
                # and releasing and taking it back was about 5% of a worker's
                # CPU time with 16 workers on 2 cores (docs/performance.md).
                rc = _publish_and_wait(&self.seg.seg, self.c, k, gen, spin, self.timeout_ns,
                                       t)
            else:
                with nogil:
                    rc = _publish_and_wait(&self.seg.seg, self.c, k, gen, spin,
                                           self.timeout_ns, t)
            if rc < 0:
                return (rc, k, gen, outs)
            if t0:  # spinning was allowed: the wait is the arm's to judge
                self.arms.saw(shm_now_ns() - t0)
            r = self.seg._fetch(self.c, k, gen, outs, 0, True)
            if type(r) is int and r < 0:  # the slot was reclaimed: not ours any more
                return (r, k, gen, outs)
            self.give_back(k)
            if type(r) is str:
                return r
        if not reuse:
            result = {}
            for j in range(self.seg.n_out):
                result[self.seg.out_names[j]] = outs[j]
        if self.last is not None:  # not reused: it becomes the older one
            self.prev, self.prev_outs = self.last, self.last_outs
        self.last = result
        self.last_outs = outs
        if versioned:
            return (result, r)
        return result

    cdef object _evaluate_many(self, object states, bint versioned, object keys):
        """The common case of ``Client.evaluate_many``: a C-contiguous batch
        of the declared dtype and shape with as many rows as this process has
        free slots.  Rows the evaluation cache holds are answered here (by
        keys[i], the caller's keys, or by the hashes of their bytes), the
        others sent in one round.  Returns the result dict (with
        ``versioned``, the pair (dict, versions)); the error text (str) when
        a row's batch failed; a tuple (status, rows, slots, outs, versions,
        exception, error) when a wait timed out, the evaluator closed, a
        slot was reclaimed or something raised after the rows were posted
        (``rows`` and ``slots``, its (slot, generation) pairs, are the
        requests still in flight; ``error`` the text of an earlier row's
        failed batch, or None); or None before anything was posted when the
        fast path does not apply.  One call instead of the Python of
        ``Client._roundtrip`` around a post and a wait per row: that Python
        was about 20 us of CPU per call with 8 workers on 2 cores
        (docs/performance.md)."""
        cdef cnp.ndarray a
        cdef Py_ssize_t n, m, i, j, d
        cdef uint32_t ks[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint32_t gens[SHM_MAX_SLOTS_PER_CLIENT]
        cdef Py_ssize_t rows[SHM_MAX_SLOTS_PER_CLIENT]  # the rows sent
        cdef uint64_t k1s[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint64_t k2s[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint32_t k
        cdef int rc
        cdef cnp.npy_intp dims[1]
        cdef list outs
        cdef object versions = None
        cdef object r
        cdef object error = None
        cdef dict result
        n = self._batch_rows(states, keys)
        if n < 1:
            return None
        a = <cnp.ndarray>states
        outs = self._new_outs(n)
        if versioned:
            dims[0] = n
            versions = cnp.PyArray_ZEROS(1, dims, cnp.NPY_INT64, 0)
        m = self._lookup(a, n, keys, outs, versions, rows, k1s, k2s)
        if m < 0 or (m and not self._post(a, m, rows, k1s, k2s, keys is None, ks, gens)):
            return None
        i = 0
        try:
            while i < m:
                k = ks[i]
                rc = self._wait_one(k, gens[i], self.timeout_ns)
                if rc < 0:
                    return (rc, [rows[d] for d in range(i, m)],
                            [(ks[d], gens[d]) for d in range(i, m)], outs, versions, None,
                            error)
                r = self.seg._fetch(self.c, k, gens[i], outs, rows[i], True)
                if type(r) is int and <int>r < 0:  # reclaimed: not ours any more
                    return (r, [rows[d] for d in range(i, m)],
                            [(ks[d], gens[d]) for d in range(i, m)], outs, versions, None,
                            error)
                self.give_back(k)
                if type(r) is str:
                    error = r  # the last failed row's, as in Client._answer_posted
                elif versioned:
                    (<int64_t *>cnp.PyArray_DATA(versions))[rows[i]] = <int64_t>r
                i += 1
        except BaseException as e:
            return (SHM_E_STATE, [rows[d] for d in range(i, m)],
                    [(ks[d], gens[d]) for d in range(i, m)], outs, versions, e, error)
        if error is not None:
            return error
        result = {}
        for j in range(self.seg.n_out):
            result[self.seg.out_names[j]] = outs[j]
        if versioned:
            return (result, versions)
        return result

    cdef Py_ssize_t _batch_rows(self, object states, object keys):
        """The rows of states when the batch fast paths apply: a C-contiguous
        array of the declared dtype and input shape with 1 to len(free)
        rows, keys None or one per row, this process's open entry; else 0."""
        cdef cnp.ndarray a
        cdef Py_ssize_t n, i
        if type(states) is not cnp.ndarray or not self.fast or self.pid != _current_pid:
            return 0
        a = <cnp.ndarray>states
        if not cnp.PyArray_IS_C_CONTIGUOUS(a) or cnp.PyArray_NDIM(a) != self.in_nd + 1:
            return 0
        n = cnp.PyArray_DIM(a, 0)
        if n < 1 or n > len(self.free):
            return 0
        for i in range(self.in_nd):
            if cnp.PyArray_DIM(a, i + 1) != self.in_dims[i]:
                return 0
        if <PyObject *>cnp.PyArray_DESCR(a) != <PyObject *>self.in_dtype and \
                a.dtype != self.in_dtype:
            return 0
        if keys is not None and len(keys) != n:
            return 0  # the general path says what is wrong
        if shm_ev_state(&self.seg.seg) >= EV_CLOSING or self.retired:
            return 0
        return n

    cdef list _spare_outs(self, Py_ssize_t n):
        """Output arrays of n rows that a freed Pending left (spares) and
        nothing references any more, unchanged; else new ones.  Allocating
        them is a good part of what a submit costs the worker."""
        cdef Py_ssize_t i, j
        cdef list outs
        cdef PyObject *x
        for i in range(len(self.spares) - 1, -1, -1):
            outs = <list>PyList_GET_ITEM(self.spares, i)
            # References: the spares list, and `outs` here.
            if Py_REFCNT(<PyObject *>outs) != 2 or len(outs) != self.seg.n_out:
                continue
            for j in range(self.seg.n_out):
                x = PyList_GET_ITEM(outs, j)
                # One reference from the list: nobody else.
                if Py_REFCNT(x) != 1 or not self._is_output(<cnp.ndarray>x, j, n):
                    break
            else:
                del self.spares[i]
                return outs
        return self._new_outs(n)

    cdef bint _is_output(self, cnp.ndarray arr, Py_ssize_t j, Py_ssize_t rows):
        """arr is still what output j was made as: C-contiguous, writeable,
        of its type and shape, with a first axis of rows (rows < 0: none)."""
        cdef Py_ssize_t d, lead = 0 if rows < 0 else 1
        cdef cnp.npy_intp *dims = cnp.PyArray_DIMS(arr)
        cdef cnp.npy_intp *want = self.seg._out_dims(j)
        if not cnp.PyArray_IS_C_CONTIGUOUS(arr) or not cnp.PyArray_ISWRITEABLE(arr) or \
                cnp.PyArray_TYPE(arr) != self.seg.out_type[j] or \
                cnp.PyArray_NDIM(arr) != self.seg.out_nd[j] + lead or \
                (lead and dims[0] != rows):
            return False
        for d in range(self.seg.out_nd[j]):
            if dims[d + lead] != want[d]:
                return False
        return True

    cdef void _keep_spare(self, list outs) noexcept:
        """A freed Pending's output arrays, for a later submit: the newest
        few are kept (the caller may still hold the last results)."""
        try:
            if len(self.spares) >= 4:
                del self.spares[0]
            self.spares.append(outs)
        except BaseException:  # pragma: no cover - out of memory
            pass

    cdef list _new_outs(self, Py_ssize_t n):
        """Empty output arrays of n rows (self.fast: native dtypes)."""
        cdef cnp.npy_intp dims[33]  # rows, then up to 32
        cdef cnp.npy_intp *od
        cdef Py_ssize_t j, d
        cdef list outs = []
        dims[0] = n
        for j in range(self.seg.n_out):
            od = self.seg._out_dims(j)
            for d in range(self.seg.out_nd[j]):
                dims[d + 1] = od[d]
            outs.append(cnp.PyArray_EMPTY(self.seg.out_nd[j] + 1, dims,
                                          self.seg.out_type[j], 0))
        return outs

    cdef Py_ssize_t _lookup(self, cnp.ndarray a, Py_ssize_t n, object keys, list outs,
                            object versions, Py_ssize_t *rows, uint64_t *k1s,
                            uint64_t *k2s) except -2:
        """Answers the rows of a that the evaluation cache holds (by keys[i],
        or by the hashes of their bytes) into outs (and versions); the others
        go to rows, their cache keys to k1s, k2s.  Returns how many are left
        to send, or -1 when a key is not an int (the general path says so)."""
        cdef Py_ssize_t i, m = 0
        cdef uint64_t v = 0
        cdef uint64_t inb = self.seg.seg.p.in_bytes
        cdef const char *src = <const char *>cnp.PyArray_DATA(a)
        if not self.seg.seg.p.cache_log2:
            for i in range(n):
                rows[i] = i
            return n
        try:
            for i in range(n):
                if self.seg._cache_get(self.c, src + i * inb, None if keys is None else keys[i],
                                       outs, i, &k1s[m], &k2s[m], &v):
                    if versions is not None:
                        (<int64_t *>cnp.PyArray_DATA(versions))[i] = <int64_t>v
                else:
                    rows[m] = i
                    m += 1
        except TypeError:
            return -1
        return m

    cdef bint _post(self, cnp.ndarray a, Py_ssize_t m, Py_ssize_t *rows, uint64_t *k1s,
                    uint64_t *k2s, bint hashed, uint32_t *ks, uint32_t *gens) except -1:
        """Sends rows[0:m] of a: takes m free slots (ks), begins them (gens),
        copies the states in, publishes them and rings the evaluator once.
        False, with nothing taken, when the free slots are too few now or the
        entry was closed meanwhile."""
        cdef Py_ssize_t i
        cdef bint cache = self.seg.seg.p.cache_log2 != 0
        cdef uint64_t inb = self.seg.seg.p.in_bytes
        cdef const char *src = <const char *>cnp.PyArray_DATA(a)
        if m > len(self.free):  # another thread took slots meanwhile
            return False
        for i in range(m):
            ks[i] = self.free.pop()
        if self.retired:  # closed meanwhile (Client.close waits for popped slots)
            for i in range(m):
                self.free.append(ks[i])
            return False
        try:
            self.seg._begin_all(self.c, ks, m, gens)
        except BaseException:
            for i in range(m):
                self.free.append(ks[i])
            raise
        for i in range(m):
            shm_copy(shm_slot_in(&self.seg.seg, self.c, ks[i]), src + rows[i] * inb, inb)
            if cache:
                self.seg._cache_as(self.c, ks[i], k1s[i], k2s[i], hashed)
        # Publish in a tight loop after all the copies, then one doorbell.
        # (A slot reclaimed meanwhile is not published; its wait says so.)
        for i in range(m):
            shm_slot_publish(&self.seg.seg, self.c, ks[i], gens[i])
        shm_notify_evaluator(&self.seg.seg, <uint32_t>m)
        return True

    cdef int _wait_one(self, uint32_t k, uint32_t gen, uint64_t timeout_ns):
        """Segment._wait for slot k of this entry with the spin budget of
        the arms (SpinArms), which get the wait's ns when it ends answered
        and spinning was allowed."""
        cdef uint64_t budget = self.arms.pick()
        cdef uint64_t t0 = (shm_now_ns() if self.arms.long_ns and self.seg._spin(budget, self.ncpu)
                            else 0)
        cdef int rc = self.seg._wait(self.c, k, gen, budget, timeout_ns, self.ncpu)
        if t0 and rc >= 0:
            self.arms.saw(shm_now_ns() - t0)
        return rc

    @property
    def spin(self):
        """The spin arms' report (SpinArms.report)."""
        return self.arms.report()

    cdef object _submit(self, object states, bint versioned, object keys):
        """The common case of ``Client.submit`` (the batch as for
        ``_evaluate_many``, and this entry's pipeline lane made): posts the
        rows the cache does not answer and returns their Pending; None,
        with nothing posted, when the fast path does not apply."""
        cdef Py_ssize_t n, m, i
        cdef Pending p
        cdef Py_ssize_t rows[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint64_t k1s[SHM_MAX_SLOTS_PER_CLIENT]
        cdef uint64_t k2s[SHM_MAX_SLOTS_PER_CLIENT]
        if self.lane is None:
            return None
        n = self._batch_rows(states, keys)
        if n < 1:
            return None
        p = Pending.__new__(Pending)
        p._setup(self.lane, self, n, versioned)
        m = self._lookup(<cnp.ndarray>states, n, keys, p._outs, p._versions, rows, k1s, k2s)
        if m < 0 or (m and not self._post(<cnp.ndarray>states, m, rows, k1s, k2s, keys is None,
                                          p.ks, p.gens)):
            return None
        for i in range(m):
            p.rows[i] = <int32_t>rows[i]
        p._armed(m)
        return p

    cdef bint _unreferenced(self, int older):
        """True when a cached result (the last, or with older the one before;
        its dict and arrays) is referenced by
        nothing but this port, unchanged: then it can hold the next result.
        Allocating the arrays and the dict was a third of a round trip's
        cost with 16 workers on 2 cores (docs/performance.md).  Any reference
        the caller keeps -- to the dict, an array, a view or a buffer of it --
        shows in the reference counts and makes this allocate afresh.  Two
        results are cached, the last and the one before, because a loop
        `out = ev.evaluate(s)` still holds the last one during the call."""
        cdef Py_ssize_t j
        cdef PyObject *x
        # Borrowed pointers: a Python-level reference here would itself
        # show in the counts.
        cdef PyObject *cached = <PyObject *>(self.prev if older else self.last)
        cdef PyObject *cached_outs = <PyObject *>(self.prev_outs if older else self.last_outs)
        if cached == <PyObject *>None or Py_REFCNT(cached) != 1 or \
                PyDict_Size(<object>cached) != self.seg.n_out:
            return False
        for j in range(self.seg.n_out):
            x = PyList_GET_ITEM(<object>cached_outs, j)
            # One reference from the cached list, one from the dict: nobody else.
            if Py_REFCNT(x) != 2 or PyDict_GetItem(<object>cached, self.seg.out_names[j]) != x:
                return False
            # Unchanged in place too (a caller may set .shape or resize).
            if not self._is_output(<cnp.ndarray>x, j, -1):
                return False
        return True


# A Pending's requests: each is in flight and claimed by nobody, claimed by
# the thread fetching it (or given up by a failure or a finalizer), or
# fetched.  Claims are plain stores made with the GIL held and no Python
# code between the look and the store, so each request is fetched once
# however many threads collect.
cdef enum:
    REQ_LEFT = 0
    REQ_CLAIMED = 1
    REQ_FETCHED = 2


@cython.no_gc_clear  # __dealloc__ needs its port, also after a cycle's collection
@cython.auto_pickle(False)  # belongs to the process that submitted it
@cython.freelist(16)  # one per submission: a pipelined worker makes and frees them all the time
cdef class Pending:
    """The answers to one ``Client.submit``, collected later.

    ``result(timeout=None)`` returns what ``evaluate_many`` would have
    returned for the same states (and raises what it would have raised);
    ``done()`` says whether ``result()`` would return or raise without
    waiting.  Collect it in the process that submitted it.  Dropping it
    uncollected is allowed: its slots come back once the evaluator has
    answered them.

    A request is a state posted (one the evaluation cache did not answer at
    the submit): request i is output row ``rows[i]``, in slot ``ks[i]``
    begun with generation ``gens[i]``.  The common case runs here in C;
    what is unusual (a timeout, a closed or dead evaluator, a reclaimed
    entry) is judged by the Python of ``shmeval.pipeline`` (the lane) and
    ``shmeval.Client``, as for ``evaluate_many``.
    """

    def __init__(self, lane, Py_ssize_t n, bint versioned):
        self._setup(lane, <ClientPort?>lane.port, n, versioned)

    cdef int _setup(self, object lane, ClientPort port, Py_ssize_t n,
                    bint versioned) except -1:
        cdef cnp.npy_intp dims[1]
        if n < 0 or n > SHM_MAX_SLOTS_PER_CLIENT:
            raise ValueError(f"a Pending holds 0 to {SHM_MAX_SLOTS_PER_CLIENT} states, not {n}")
        self._lane = lane
        self.port = port
        self.seg = port.seg
        self._n = n
        # port.fast: every output a native built-in dtype, made in C;
        # otherwise (another byte order, a newer dtype) by NumPy.
        self._outs = (port._spare_outs(n) if port.fast else
                      [np.empty((n,) + o.shape, o.dtype) for o in lane.outputs])
        if versioned:
            dims[0] = n
            self._versions = cnp.PyArray_ZEROS(1, dims, cnp.NPY_INT64, 0)
        self.error_row = -1
        return 0

    cdef void _armed(self, Py_ssize_t m):
        """Requests 0..m-1 (ks, gens, rows set) are in flight: each slot's
        owner on the port, which the lane's harvests and slot waits ask."""
        cdef Py_ssize_t i
        self._m = self.unclaimed = m
        for i in range(m):
            self.state[i] = REQ_LEFT
            self.port.owner[self.ks[i]] = <PyObject *>self

    def _arm(self, list rows, list slots, list gens):
        """The requests posted by the general path of submit."""
        cdef Py_ssize_t i, m = len(rows)
        for i in range(m):
            self.rows[i] = rows[i]
            self.ks[i] = slots[i]
            self.gens[i] = gens[i]
        self._armed(m)

    def __len__(self):
        return self._n

    def __repr__(self):
        left = self._m - self.fetched
        what = ("failed" if self.exc is not None else
                f"{left} in flight" if left else "done")
        return f"<Pending {self._n} state(s), {what}>"

    @property
    def _in_flight(self):
        """How many requests are in flight and claimed by nobody."""
        return self.unclaimed

    # -------------------------------------------------------- public
    def done(self):
        """True when :meth:`result` would return or raise without waiting.
        Copies out the answers already there (freeing their slots)."""
        if self.result_ is not None or self.exc is not None:
            return True
        self._check_process()
        self._harvest()
        if self.exc is not None or self.fetched == self._m:
            return True
        return self.port.detached or shm_ev_state(&self.seg.seg) >= EV_CLOSED

    def result(self, timeout=None):
        """The outputs, as ``evaluate_many`` returns them (with
        ``submit(..., return_version=True)``, the pair ``(outputs,
        versions)``).  Waits up to ``timeout`` seconds (None: as long as
        the evaluator lives), then raises ShmevalTimeout (a TimeoutError) with the request
        still in flight (call again to go on waiting).  Raises ModelError,
        EvaluatorClosed and EvaluatorDied as evaluate_many does; a second
        call returns (or raises) the same."""
        cdef Py_ssize_t i
        cdef uint32_t k, gen
        cdef int rc
        cdef uint64_t wait_ns
        cdef object r
        cdef double deadline = 0
        cdef ClientPort port = self.port
        if self.result_ is not None:
            return self.result_
        self._check_process()
        if timeout is not None:
            deadline = _monotonic() + timeout
        while True:
            if self.exc is not None:
                raise self.exc.with_traceback(None)
            if self.fetched == self._m:
                return self._finish()
            i = self._claim()
            if i < 0:  # another thread is fetching the last requests
                _sleep(0.001)
                continue
            k, gen = self.ks[i], self.gens[i]
            wait_ns = port.timeout_ns
            if timeout is not None:
                wait_ns = <uint64_t>max(0.0, min(<double>wait_ns,
                                                 (deadline - _monotonic()) * 1e9))
            try:
                rc = port._wait_one(k, gen, wait_ns)
                r = rc if rc < 0 else self.seg._fetch(port.c, k, gen, self._outs,
                                                      self.rows[i], True)
            except BaseException:
                self._unclaim(i)
                raise
            if type(r) is int and <int>r < 0:
                if r != SHM_STALE:
                    self._unclaim(i)  # still in flight
                else:  # not ours any more
                    self._give_up(i)
                try:
                    self._lane.check(r, k, gen, self._outs, self.rows[i])
                except ShmevalError as e:
                    self._fail(e)
                    raise
                if timeout is not None and _monotonic() >= deadline:
                    raise ShmevalTimeout(f"{self!r}: no answer within {timeout} s")
                continue
            port.give_back(k)
            self._record(i, r)

    # -------------------------------------------------------- internals
    def _check_process(self):
        if self.port.pid != _current_pid:
            raise ShmevalError("a Pending is collected in the process that submitted it")

    cdef Py_ssize_t _claim(self) noexcept:
        """Claims the oldest request nobody is fetching; -1 if none."""
        cdef Py_ssize_t i
        if self.unclaimed:
            for i in range(self._m):
                if self.state[i] == REQ_LEFT:
                    self._claim_at(i)
                    return i
        return -1

    cdef void _claim_at(self, Py_ssize_t i) noexcept:
        self.state[i] = REQ_CLAIMED
        self.unclaimed -= 1

    cdef void _unclaim(self, Py_ssize_t i) noexcept:
        self.state[i] = REQ_LEFT
        self.unclaimed += 1

    cdef int _record(self, Py_ssize_t i, object r) except -1:
        """Request i fetched: r is its model version, or its batch's error
        text."""
        cdef Py_ssize_t row = self.rows[i]
        if type(r) is str:
            if row > self.error_row:  # the last failed row's, as evaluate_many
                self.error_row, self.error = row, r
        elif self._versions is not None:
            (<int64_t *>cnp.PyArray_DATA(self._versions))[row] = <int64_t>r
        self.state[i] = REQ_FETCHED
        self.fetched += 1
        self._disown(i)
        return 0

    cdef int _give_up(self, Py_ssize_t i) except -1:
        """Request i, claimed, was reclaimed: not ours to fetch; its slot
        goes to the abandoned list (Client._give_back)."""
        self._disown(i)
        self._lane.client._give_back(self.port, [], [(self.ks[i], self.gens[i])])
        return 0

    cdef void _disown(self, Py_ssize_t i) noexcept:
        """Request i is no longer this Pending's to fetch (fetched, or given
        up): its slot's owner is cleared."""
        if self.port.owner[self.ks[i]] == <PyObject *>self:
            self.port.owner[self.ks[i]] = NULL

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.port is not None:
            if self.unclaimed and self._lane is not None and self.port.pid == _current_pid:
                self._abandon()
            for i in range(self._m):
                self._disown(i)
            # Its arrays may serve a later submit once nobody holds them
            # (ClientPort._spare_outs checks); a failed Pending's are left
            # to the allocator.
            if self.port.fast and self._n and self._outs is not None and \
                    self.fetched == self._m and self.port.pid == _current_pid:
                self.port._keep_spare(self._outs)

    cdef object _finish(self):
        cdef dict result
        cdef uint32_t j
        if self.error is not None:
            self.exc = ModelError(self.error)
            raise self.exc.with_traceback(None)
        result = {}
        for j in range(self.seg.n_out):
            result[self.seg.out_names[j]] = self._outs[j]
        self.result_ = result if self._versions is None else (result, self._versions)
        return self.result_

    def _rows_in_flight(self):
        """(slot, generation) of the requests nobody is fetching now."""
        cdef Py_ssize_t i
        return [(self.ks[i], self.gens[i]) for i in range(self._m)
                if self.state[i] == REQ_LEFT]

    def _harvest(self):
        """Fetches every request whose answer is there, without waiting;
        returns how many.  One found reclaimed fails the Pending as
        evaluate_many fails then."""
        cdef Py_ssize_t i, got = 0
        cdef uint32_t w, st, k, gen
        cdef object r
        cdef ClientPort port = self.port
        if not self.unclaimed or port.pid != _current_pid:
            return 0
        for i in range(self._m):
            if self.state[i] != REQ_LEFT:
                continue
            k, gen = self.ks[i], self.gens[i]
            w = shm_slot_peek(&self.seg.seg, port.c, k)
            st = w & SLOT_STATE_MASK
            if w >> SLOT_GEN_SHIFT == gen and st != SLOT_DONE and st != SLOT_FAILED:
                continue  # not answered yet
            self._claim_at(i)
            try:
                r = (self.seg._fetch(port.c, k, gen, self._outs, self.rows[i], True)
                     if w >> SLOT_GEN_SHIFT == gen else SHM_STALE)
            except BaseException:
                self._unclaim(i)
                raise
            if type(r) is int and <int>r < 0:  # reclaimed: the slot is not ours any more
                self._give_up(i)
                try:
                    self._lane.check(SHM_STALE, k, gen, self._outs, self.rows[i])
                except ShmevalError as e:
                    self._fail(e)
                return got
            port.give_back(k)
            self._record(i, r)
            got += 1
        return got

    def _claim_all(self):
        """Claims every request nobody is fetching: (slot, generation) each."""
        cdef Py_ssize_t i
        cdef list out = []
        for i in range(self._m):
            if self.state[i] == REQ_LEFT:
                self.state[i] = REQ_CLAIMED
                self._disown(i)
                out.append((self.ks[i], self.gens[i]))
        self.unclaimed = 0
        return out

    def _fail(self, exc):
        """The request cannot be answered (closed, dead, reclaimed): result()
        raises exc; the requests still in flight are abandoned.  A
        submission whose every answer is already in is not failed."""
        if self.fetched == self._m:
            return
        if self.exc is None:
            self.exc = exc
        rows = self._claim_all()
        if rows:
            self._lane.client._give_back(self.port, [], rows)

    cdef void _abandon(self) noexcept:
        """Requests nobody will collect (the Pending is being freed): their
        slots come back once answered (the lane's abandoned list).  Run
        from __dealloc__ rather than a finalizer, which every Pending would
        pay for."""
        try:
            rows = self._claim_all()
            if rows:
                self._lane.abandon(rows)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


@cython.binding(True)
def client_submit(self, object states, *, bint block=True, bint return_version=False,
                  object keys=None):
    """``Client.submit``: the common case in ClientPort._submit (no Python
    frame); anything else goes to ``Client._submit_slow``."""
    port = (<ClientBase?>self)._port
    cdef object p
    if port is not None:
        p = (<ClientPort?>port)._submit(states, return_version, keys)
        if p is not None:
            return p
    return self._submit_slow(states, block, return_version, keys)


cdef inline bint _answered(object r, bint versioned):
    """r, from a ClientPort fast path, is the caller's result: the dict, or
    with versioned the pair (dict, version(s)); not None, an error text or a
    hand-over tuple for the Python path."""
    if versioned:
        return type(r) is tuple and len(<tuple>r) == 2
    return type(r) is dict


cdef class ClientBase:
    """The base of ``shmeval.Client``: its process's port in a C field, which
    ``client_evaluate`` reads without an attribute lookup.  As an attribute
    of a Python instance it was a dict lookup on every call, about 2% of the
    machine's CPU with 16 workers on 2 cores (docs/performance.md)."""


@cython.binding(True)
def client_evaluate(self, object state, bint return_version=False, object key=None):
    """Evaluates one state; returns ``{name: array of the output's shape}``,
    or ``(outputs, model_version)`` with ``return_version=True``: the
    version of the weights that computed it (0 for the model the
    evaluator started with, then as set by ``Evaluator.set_weights``).
    With an evaluation cache (``cache_entries``), ``key`` is the state's
    cache key (any int, e.g. a Zobrist hash; taken modulo 2**64) instead of
    a hash of its bytes; without one it is ignored.

    (``Client.evaluate``: written here so that the common case -- the
    process's port exists and ``ClientPort`` answers -- runs no Python
    frame; anything else goes to ``Client._evaluate_slow``.)"""
    port = (<ClientBase?>self)._port
    cdef object r = None
    if port is not None:
        r = (<ClientPort?>port)._evaluate(state, return_version, key)
        if _answered(r, return_version):
            return r
    return self._evaluate_slow(state, r, port, return_version, key)


@cython.binding(True)
def client_evaluate_many(self, object states, bint return_version=False, object keys=None):
    """``Client.evaluate_many``: the common case in ClientPort (no Python
    frame); anything else goes to ``Client._evaluate_many_slow``."""
    port = (<ClientBase?>self)._port
    cdef object r = None
    if port is not None:
        r = (<ClientPort?>port)._evaluate_many(states, return_version, keys)
        if _answered(r, return_version):
            return r
    return self._evaluate_many_slow(states, r, port, return_version, keys)


def only_python_thread():
    """True when the caller is the only Python thread of the only
    interpreter: then a client keeps the GIL while it waits (for tests)."""
    return bool(shm_only_python_thread())


cdef inline uint64_t _evaluator_spin(uint64_t spin_ns, uint32_t n_attached,
                                    uint32_t ncpu) noexcept nogil:
    """The evaluator's spin budget (_spin_policy): none once the client
    processes outnumber its CPUs, when a spinning evaluator holds a CPU that
    the clients it waits for need; a yielding spin with as many clients as
    CPUs (docs/performance.md, "Which knob when").  Spinning at all with 2
    clients on 2 CPUs doubled round trips/s on the reference VM."""
    return _spin_policy(spin_ns, n_attached + 1, ncpu)


def evaluator_spin(uint64_t spin_ns, uint32_t n_attached, uint32_t ncpu):
    """_evaluator_spin, for tests."""
    return _evaluator_spin(spin_ns, n_attached, ncpu)


#: The flag of a yielding spin in a spin budget (ring.h's SHM_SPIN_YIELD).
SPIN_YIELD = SHM_SPIN_YIELD
#: The crowding a tuner publishes (ring.h's enum shm_crowding).
CROWD_NONE = SHM_CROWD_NONE
CROWD_YIELD = SHM_CROWD_YIELD
CROWD_SLEEP = SHM_CROWD_SLEEP


def spin_policy(uint64_t spin_ns, uint32_t processes, uint32_t ncpu):
    """_spin_policy (a client's spin: processes = attached clients + 1),
    for tests."""
    return _spin_policy(spin_ns, processes, ncpu)


cdef bint _rows_ok(object x, Py_ssize_t rows, uint64_t row_bytes):
    """x is an ndarray with at least `rows` rows (axis 0) of exactly
    row_bytes each, every row contiguous in memory (axis 0 may be strided)."""
    cdef cnp.ndarray a
    cdef int i, nd
    cdef Py_ssize_t expect
    if type(x) is not cnp.ndarray:
        return False
    a = <cnp.ndarray>x
    nd = cnp.PyArray_NDIM(a)
    if nd < 1 or cnp.PyArray_DIM(a, 0) < rows:
        return False
    expect = cnp.PyArray_ITEMSIZE(a)
    if cnp.PyArray_SIZE(a) == 0:  # rows of no elements: nothing to copy
        return row_bytes == 0
    for i in range(nd - 1, 0, -1):
        if cnp.PyArray_DIM(a, i) != 1 and cnp.PyArray_STRIDE(a, i) != expect:
            return False
        expect *= cnp.PyArray_DIM(a, i)
    return <uint64_t>expect == row_bytes


cdef int _finite(cnp.ndarray a, Py_ssize_t rows) except -2:
    """1 when the first `rows` rows of native float32/float64 array a (rows
    contiguous, axis 0 may be strided) hold no NaN or inf, 0 when they do,
    -1 for other arrays."""
    cdef Py_ssize_t r, per_row, stride
    cdef const char *base
    cdef int ok = 1, typ = cnp.PyArray_TYPE(a)
    cdef int item
    if cnp.PyArray_NDIM(a) and cnp.PyArray_DIM(a, 0) < rows:
        raise ValueError("rows exceeds the array")
    if cnp.PyArray_NDIM(a) == 0 or not cnp.PyArray_ISNOTSWAPPED(a) or \
            (typ != cnp.NPY_FLOAT32 and typ != cnp.NPY_FLOAT64) or \
            not _rows_ok(a, rows, (cnp.PyArray_SIZE(a) // cnp.PyArray_DIM(a, 0) if
                                   cnp.PyArray_DIM(a, 0) else 0) * cnp.PyArray_ITEMSIZE(a)):
        return -1
    per_row = cnp.PyArray_SIZE(a) // cnp.PyArray_DIM(a, 0) if cnp.PyArray_DIM(a, 0) else 0
    stride = cnp.PyArray_STRIDE(a, 0)
    item = cnp.PyArray_ITEMSIZE(a)
    base = <const char *>cnp.PyArray_DATA(a)
    with nogil:
        if stride == per_row * item:  # rows back to back: one run
            per_row = per_row * rows
            rows = 1 if rows else 0
        for r in range(rows):
            if typ == cnp.NPY_FLOAT32:
                ok = shm_finite_f32(<const uint32_t *>(base + r * stride), per_row)
            else:
                ok = shm_finite_f64(<const uint64_t *>(base + r * stride), per_row)
            if not ok:
                break
    return ok


def all_finite(cnp.ndarray a, Py_ssize_t rows):
    """True when the first `rows` rows of C-contiguous float32/float64 array a
    hold no NaN or inf; None for other arrays (the caller uses NumPy)."""
    cdef int r = _finite(a, rows)
    return None if r < 0 else bool(r)


cdef class ServeGroup:
    """The Servers of one segment that serve from several threads of the
    evaluator (pipelined serving): one at a time collects (the scan, the
    gather and the doorbell sleep are single-consumer: the lock), while the
    others' model calls and finishing overlap with it.  in_flight counts the
    members holding a batch; the thread that holds the lock and sees it at 0
    may do work that needs no batch outstanding (reclaiming clients, weight
    updates, closing).  version stamps every batch served from now on; stop
    makes every member's serve() return SERVE_CLOSED.  All fields are read
    and written with the GIL held."""

    def __cinit__(self):
        self.lock = PyThread_allocate_lock()
        if self.lock == NULL:
            raise MemoryError()

    def __dealloc__(self):
        if self.lock != NULL:
            PyThread_free_lock(self.lock)

    cdef inline void _acquire(self) noexcept:
        with nogil:
            PyThread_acquire_lock(self.lock, WAIT_LOCK)

    def quiesce(self):
        """Waits (GIL released between checks) until no member holds a
        batch, and returns True.  Returns False instead once stop is set
        while batches are still in flight (a member that failed stops the
        group; its batch may never finish): the caller must then only stop,
        doing nothing that needs quiet, such as reclaiming a client entry
        (whose slots a batch in flight may still complete) or a weight
        update.  Call holding the lock, with no batch of your own."""
        while self.in_flight:
            if self.stop:
                return False
            with nogil:
                usleep(20)
        return True


cdef class Server:
    """The evaluator's side: collect a batch, then complete or fail it.

    batch is a preallocated C-contiguous array of at least max_batch rows of
    in_bytes; collect gathers the inputs of the requests it takes into rows
    0..n-1.  complete copies row i of each output array into the slot that
    request i came from.  Servers sharing a ServeGroup serve one segment
    from several threads (see serve()).
    """

    def __cinit__(self, Segment seg, cnp.ndarray batch, ServeGroup group=None,
                  uint32_t server=0, uint32_t replica=0):
        import os
        if server >= seg.seg.p.servers or replica >= seg.seg.p.replicas:
            raise IndexError(f"server {server} of replica {replica}: the segment has "
                             f"{seg.seg.p.servers} servers, {seg.seg.p.replicas} replicas")
        self.seg = seg
        self.v = server
        self.replica = replica
        # Several replicas take turns collecting under the segment's lock.
        self.shared = seg.seg.p.replicas > 1
        # CPUs this evaluator may run on, when its serving loop starts (after
        # the model factory, which may have pinned it).
        self.ncpu = len(os.sched_getaffinity(0))
        self.group = ServeGroup() if group is None else group
        self.cap = seg.seg.p.max_batch
        if not cnp.PyArray_IS_C_CONTIGUOUS(batch):
            raise ValueError("batch must be C-contiguous")
        if <uint64_t>cnp.PyArray_NBYTES(batch) < self.cap * seg.seg.p.in_bytes:
            raise ValueError("batch buffer smaller than max_batch rows")
        if seg.n_out == 0:
            raise ValueError("segment outputs not set")
        # The batch table the completion reads is this process's; the
        # segment has a copy, so that if this replica dies another can put
        # its requests back (shm_requeue).
        if shm_server_replica(&seg.seg, server) != replica:
            raise IndexError(f"server {server} belongs to replica "
                             f"{shm_server_replica(&seg.seg, server)}, not {replica}")
        shm_server_init(&seg.seg, server, replica)
        self.taken = <shm_taken *>malloc(sizeof(shm_taken) * self.cap)
        self.fields = <const char **>malloc(sizeof(char *) * seg.n_out)
        self.strides = <int64_t *>malloc(sizeof(int64_t) * seg.n_out)
        if self.taken == NULL or self.fields == NULL or self.strides == NULL:
            raise MemoryError()
        self.batch = <char *>cnp.PyArray_DATA(batch)
        self._keep = batch
        self.views = [None] * (cnp.PyArray_DIM(batch, 0) + 1)  # batch[:rows], made once

    def __dealloc__(self):
        if self.seg_locked:
            shm_collect_unlock(&self.seg.seg)
        if self.locked:
            PyThread_release_lock(self.group.lock)
        free(self.taken)
        free(self.fields)
        free(self.strides)
        free(self.calls)

    cdef inline void _set_n(self, uint32_t n) noexcept:
        """The outstanding batch's size; keeps the group's in_flight count
        and the segment's batch table."""
        self.group.in_flight += (n > 0) - (self.n > 0)
        self.n = n
        shm_server_set_n(&self.seg.seg, self.v, n)

    cdef inline void _seg_unlock(self) noexcept:
        if self.seg_locked:
            self.seg_locked = False
            shm_collect_unlock(&self.seg.seg)

    def record_calls(self, Py_ssize_t cap):
        """Makes serve() record the start (CLOCK_MONOTONIC ns), duration (ns),
        rows (padded to a bucket) and requests of each model call that
        returns, up to ``cap`` calls between two take_calls() (the calls
        past that run unrecorded); 0 stops recording.  serve() times every
        call anyway, so the record costs a few stores, and no Python frame
        around the model."""
        cdef int64_t *buf = NULL
        if cap < 0:
            raise ValueError("cap must be >= 0")
        if cap:
            buf = <int64_t *>malloc(sizeof(int64_t) * 4 * cap)
            if buf == NULL:
                raise MemoryError()
        free(self.calls)
        self.calls, self.calls_cap, self.n_calls = buf, cap, 0

    def take_calls(self):
        """The calls recorded since the last take, as an int64 array of
        shape (n, 4) (start, duration, rows, requests); empties the record."""
        out = np.empty((self.n_calls, 4), dtype=np.int64)
        if self.n_calls:
            memcpy(cnp.PyArray_DATA(out), self.calls, sizeof(int64_t) * 4 * self.n_calls)
        self.n_calls = 0
        return out

    def unlock(self):
        """Releases the collect locks (the segment's, then the group's) if
        serve() returned holding them."""
        self._seg_unlock()
        if self.locked:
            self.locked = False
            PyThread_release_lock(self.group.lock)

    def take_over_lock(self, int holder):
        """Takes the segment's collect lock over from server `holder` (after
        serve() returned LOCKED_OUT), only if `holder`'s replica was marked
        dead (Segment.replica_stop(r, "dead")), or if `holder` names no
        server (the lock word was scribbled on): a live holder may simply
        be slow or waiting for requests, and taking the lock from it would
        let two scans run at once.  Having taken it from a dead replica,
        puts that replica's batches back before anything is scanned
        (shm_requeue_replica: a slot the dead one listed but had not taken
        is still READY then, and stays so).  Returns True
        when this server holds the lock now (unlock() releases it)."""
        cdef uint32_t state, r = 0
        cdef uint64_t starttime, version
        if not self.shared or self.seg_locked or holder < 0:
            return False
        if <uint32_t>holder < self.seg.seg.p.servers:
            r = shm_server_replica(&self.seg.seg, <uint32_t>holder)
            shm_replica_info(&self.seg.seg, r, &starttime, &state, &version)
            if state != REPLICA_DEAD:
                return False
        if shm_collect_steal(&self.seg.seg, self.v, <uint32_t>holder) != SHM_OK:
            return False
        self.seg_locked = True
        if <uint32_t>holder < self.seg.seg.p.servers:
            shm_requeue_replica(&self.seg.seg, self.v, r)
        return True

    def requeue_replica(self, uint32_t r):
        """Puts back the batches of replica r, whose process is gone, for
        the replicas left to serve (their requests return to READY, and the
        evaluator's doorbell rings).  Only while this server holds the
        segment's collect lock (between batches, after serve() returned
        IDLE holding it, or after take_over_lock): see shm_requeue_replica.
        Returns how many requests went back (0 without the lock)."""
        if r >= self.seg.seg.p.replicas:
            raise IndexError(f"replica {r} of {self.seg.seg.p.replicas}")
        return shm_requeue_replica(&self.seg.seg, self.v, r)

    @property
    def server(self):
        return self.v

    cpdef int collect(self, uint32_t max_batch, uint64_t spin_ns, uint64_t max_wait_ns,
                      uint64_t timeout_ns) except? -1000:
        """Returns n > 0 requests gathered, 0 on timeout, CLOSED, CONTROL
        (a control request is pending; nothing was taken), or BEHIND
        (several replicas: the weights floor is past this replica's
        version; nothing was taken).  (cpdef,
        as finish_fast and complete: serve() calls them without a Python
        call each, on the evaluator's path between batches.)"""
        cdef int rc
        if self.n:
            raise ShmevalError("collect() while a batch is outstanding")
        max_batch = min(max_batch, self.cap)
        self.end_busy()
        spin_ns = _evaluator_spin(spin_ns, shm_n_attached(&self.seg.seg), self.ncpu)
        with nogil:
            rc = shm_collect(&self.seg.seg, self.v, self.taken, self.batch, max_batch,
                             &self.group.cursor, spin_ns, max_wait_ns, timeout_ns)
        if rc > 0:
            self._set_n(rc)
            self.busy_since = shm_now_ns()
        return rc

    cpdef end_busy(self):
        """Ends the busy period of the last batch (its time counts in
        busy_ns); call before work between batches that is not serving."""
        if self.busy_since:
            shm_stat_inc(&self.seg.seg, ST_BUSY_NS, shm_now_ns() - self.busy_since)
            self.busy_since = 0

    def serve(self, object model, uint32_t max_batch, uint64_t spin_ns, uint64_t max_wait_ns,
              uint64_t timeout_ns, bint reject_nonfinite, object buckets, uint64_t until_ns):
        """The serving loop's common path without Python bytecode between
        batches: collect -> model(batch[:rows]) -> finish_fast, repeated until
        something needs the Python layer.  Returns (kind, n, rows, detail,
        model_ns) with kind:
          IDLE    nothing arrived within timeout_ns (detail True: the clients
                  paused), or until_ns (CLOCK_MONOTONIC) passed (detail None):
                  time for housekeeping
          CLOSED  close requested, or the group's stop flag is set
          SLOW    the outputs (detail) need conversion or an explanation
          RAISED  the model raised (detail is the exception)
          CONTROL a control request is pending (no batch outstanding)
          LOCKED_OUT (several replicas) the segment's collect lock stayed
                  taken for timeout_ns: detail is the holding server, whose
                  replica may have died (take_over_lock)
          BEHIND  (several replicas) another replica collects with newer
                  weights: this one must apply them first
        Buckets: None, or a sorted list of padded batch sizes.  Batches are
        stamped with the group's version.

        Each collect happens under the group's lock and, with several
        replicas, the segment's collect lock, both released before the model
        call, so that another thread or replica can collect the next batch
        meanwhile.  IDLE (with both locks, so housekeeping may reclaim),
        CLOSED, CONTROL, LOCKED_OUT and BEHIND return holding the group's
        lock (so nobody in this replica starts a batch; group.quiesce() then
        waits out the batches in flight): call unlock() after the work they
        call for.  SLOW and RAISED return without it, the batch outstanding."""
        cdef int rc
        cdef uint32_t n, rows
        cdef uint64_t t0, model_ns
        cdef list views = self.views
        cdef Py_ssize_t bi
        cdef ServeGroup g = self.group
        if self.locked:
            raise ShmevalError("serve() while holding the collect lock: call unlock() first")
        while True:
            g._acquire()
            self.locked = True
            if g.stop:
                return (SERVE_CLOSED, 0, 0, None, 0)
            if self.shared:
                with nogil:
                    rc = shm_collect_lock(&self.seg.seg, self.v, timeout_ns)
                if rc == SHM_TIMEOUT:
                    return (SERVE_LOCKED_OUT, 0, 0, shm_collect_holder(&self.seg.seg), 0)
                self.seg_locked = True
                if not shm_version_ok(&self.seg.seg, g.version):
                    self._seg_unlock()
                    return (SERVE_BEHIND, 0, 0, None, 0)
            if until_ns and shm_now_ns() >= until_ns:
                return (SERVE_IDLE, 0, 0, None, 0)
            rc = self.collect(max_batch, spin_ns, max_wait_ns, timeout_ns)
            if rc == 0:
                return (SERVE_IDLE, 0, 0, True, 0)
            self._seg_unlock()
            if rc == SHM_CLOSED:
                return (SERVE_CLOSED, 0, 0, None, 0)
            if rc == SHM_CONTROL:
                return (SERVE_CONTROL, 0, 0, None, 0)
            if rc == SHM_BEHIND:
                return (SERVE_BEHIND, 0, 0, None, 0)
            self.locked = False
            PyThread_release_lock(g.lock)
            n = rc
            rows = n
            if buckets is not None:
                for bi in range(len(buckets)):
                    if <uint32_t>buckets[bi] >= n:
                        rows = buckets[bi]
                        break
            view = views[rows]
            if view is None:
                view = views[rows] = self._keep[:rows]
            t0 = shm_now_ns()
            try:
                out = model(view)
            except Exception as e:
                return (SERVE_RAISED, n, rows, e, shm_now_ns() - t0)
            model_ns = shm_now_ns() - t0
            if self.n_calls < self.calls_cap:
                self.calls[4 * self.n_calls] = <int64_t>t0
                self.calls[4 * self.n_calls + 1] = <int64_t>model_ns
                self.calls[4 * self.n_calls + 2] = rows
                self.calls[4 * self.n_calls + 3] = n
                self.n_calls += 1
            if not self.finish_fast(out, rows, model_ns, g.version, reject_nonfinite):
                return (SERVE_SLOW, n, rows, out, model_ns)

    cpdef bint finish_fast(self, object out, uint32_t rows, uint64_t model_ns, uint64_t version,
                           bint reject_nonfinite) except -1:
        """Records and completes the outstanding batch if the model's outputs
        are already exactly as declared: arrays of the declared dtype (native
        order, C-contiguous) and shape (rows, *shape), finite where required.
        Returns False, having done nothing, otherwise: the caller then
        converts the outputs or explains what is wrong."""
        cdef list arrays
        cdef cnp.ndarray a
        cdef cnp.npy_intp *want
        cdef Py_ssize_t j, i, nout = self.seg.n_out
        cdef Segment seg = self.seg
        if not seg.out_native or self.n == 0:
            return False
        if type(out) is dict:
            if not self.extra_outputs_ok and PyDict_Size(out) != nout:
                return False  # the slow path warns about the undeclared ones, once
            arrays = []
            for name in seg.out_names:
                x = (<dict>out).get(name)
                if x is None:
                    return False
                arrays.append(x)
        elif type(out) is tuple or type(out) is list:
            if len(out) != nout:
                return False
            arrays = list(out)
        elif nout == 1:
            arrays = [out]
        else:
            return False
        for j in range(nout):
            x = arrays[j]
            if type(x) is not cnp.ndarray:
                return False
            a = <cnp.ndarray>x
            want = seg._out_dims(j)
            if not cnp.PyArray_ISNOTSWAPPED(a) or cnp.PyArray_TYPE(a) != seg.out_type[j] or \
                    cnp.PyArray_NDIM(a) != seg.out_nd[j] + 1 or cnp.PyArray_DIM(a, 0) != rows:
                return False
            for i in range(seg.out_nd[j]):
                if cnp.PyArray_DIM(a, i + 1) != want[i]:
                    return False
            if not _rows_ok(a, self.n, self.seg.out_nbytes[j]):
                return False
            if reject_nonfinite and seg.out_float[j] and _finite(a, self.n) != 1:
                return False
        shm_record_batch(&self.seg.seg, self.replica, self.n, rows, model_ns, 0)
        self.complete(arrays, version)
        return True

    @property
    def pending(self):
        return self.n

    cpdef uint32_t complete(self, list arrays, uint64_t model_version) except? 0xffffffff:
        """Scatters row i of each output array into request i's slot; marks
        DONE and wakes.  Each array needs at least n rows of exactly the
        declared row size, each row contiguous (axis 0 may be strided)."""
        cdef uint32_t j, done, nf = self.seg.n_out
        if len(arrays) != nf:
            raise ValueError("expected %d output arrays" % nf)
        for j in range(nf):
            if not _rows_ok(arrays[j], self.n, self.seg.out_nbytes[j]):
                raise ValueError("output array %d: too few rows, wrong row size, or rows "
                                 "not contiguous" % j)
            self.fields[j] = <const char *>cnp.PyArray_DATA(<cnp.ndarray>arrays[j])
            self.strides[j] = cnp.PyArray_STRIDE(<cnp.ndarray>arrays[j], 0)
        with nogil:
            done = shm_complete_fields(&self.seg.seg, self.taken, self.n, nf, self.fields,
                                       self.seg.out_nbytes, self.strides, self.seg.out_off,
                                       model_version)
        self._set_n(0)
        return done

    def fail_rows(self, object rows, str message):
        """Fails the requests at the given batch rows (sorted, distinct,
        < pending) with message, and removes them from the outstanding
        batch: the others keep their order, so complete() then takes arrays
        holding just their rows.  Returns how many were failed."""
        cdef Py_ssize_t i, j = 0, kept = 0, nb = len(rows)
        cdef uint32_t done
        cdef bytes b = message.encode("utf-8", "replace")
        cdef const char *p = b
        cdef uint32_t ln = len(b)
        cdef shm_taken *bad
        if nb == 0:
            return 0
        for i in range(nb):
            if not 0 <= rows[i] < self.n or (i and rows[i] <= rows[i - 1]):
                raise ValueError("rows must be sorted, distinct and < pending")
        bad = <shm_taken *>malloc(sizeof(shm_taken) * nb)
        if bad == NULL:
            raise MemoryError()
        try:
            for i in range(self.n):
                if j < nb and <Py_ssize_t>rows[j] == i:
                    bad[j] = self.taken[i]
                    j += 1
                else:
                    self.taken[kept] = self.taken[i]
                    kept += 1
            with nogil:
                done = shm_fail(&self.seg.seg, bad, <uint32_t>nb, p, ln)
            self._set_n(<uint32_t>kept)
        finally:
            free(bad)
        return done

    def fail(self, str message):
        """Fails every request of the outstanding batch with message."""
        cdef bytes b = message.encode("utf-8", "replace")
        cdef const char *p = b
        cdef uint32_t ln = len(b)
        cdef uint32_t done
        with nogil:
            done = shm_fail(&self.seg.seg, self.taken, self.n, p, ln)
        self._set_n(0)
        return done

    def record(self, uint32_t n, uint32_t rows, uint64_t model_ns, bint failed):
        shm_record_batch(&self.seg.seg, self.replica, n, rows, model_ns, failed)
