# cython: language_level=3
"""The Cython layer over the C core (_core/ring.h): one extension module.

The classes' C fields and cdef methods are declared in _ring.pxd, the C
they call in _core/ring.pxd.  This file holds the module's constants and
small helpers; each class's body is in its own file, included at the end
(_core/pyx/): Segment (one process's view of a segment, the C calls
wrapped), SpinArms (a client's measured spin budget), ClientPort (a
process's request path: post, wait, collect), Pending (a submission's
answers collected later), ServeGroup and Server (the evaluator's side: the
collect lock, the gather and the scatter around the model call).  Included
rather than separate extensions, so that the hot path's calls between them
stay direct C calls.  Arguments are
checked and converted to C values first, then ``with nogil`` wraps only the
C call (a client's wait keeps the GIL when the caller is its process's only
Python thread: ``shm_only_python_thread``, _core/ring_python.h).  Status
codes become exceptions in one place, ``_check``.  The protocol's steps
(the slot state machine, the collect lock, reclaiming) are in ring.h; this
layer sequences them for Python callers.
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

# The request path reads arrays, lists and dicts through borrowed pointers:
# a reference taken there would cost its increment and decrement, and would
# itself show in the reference counts that ClientPort._unreferenced reads.
cdef extern from *:
    """
    /* The data of a NumPy array (an ndarray's borrowed pointer). */
    static inline char *shmeval_array_bytes(PyObject *a) {
        return PyArray_BYTES((PyArrayObject *)a);
    }

    /* The ndarray a is C-contiguous, writeable, of type number `type` and
     * of shape dims[0:nd], after a first axis of `rows` (rows < 0: none). */
    static inline int shmeval_is_array_of(PyObject *a, int type, int nd,
                                          const npy_intp *dims, Py_ssize_t rows) {
        PyArrayObject *x = (PyArrayObject *)a;
        const int want = NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_WRITEABLE;
        const npy_intp *have = PyArray_DIMS(x);
        int d;
        if ((PyArray_FLAGS(x) & want) != want || PyArray_TYPE(x) != type)
            return 0;
        if (rows >= 0) {
            if (PyArray_NDIM(x) != nd + 1 || have[0] != rows)
                return 0;
            have++;
        } else if (PyArray_NDIM(x) != nd) {
            return 0;
        }
        for (d = 0; d < nd; d++)
            if (have[d] != dims[d])
                return 0;
        return 1;
    }
    """
    char *_array_bytes "shmeval_array_bytes"(PyObject *a) noexcept nogil
    bint _is_array_of "shmeval_is_array_of"(PyObject *a, int type, int nd,
                                              const cnp.npy_intp *dims,
                                              Py_ssize_t rows) noexcept nogil
    PyObject *_list_item "PyList_GET_ITEM"(PyObject *l, Py_ssize_t i) noexcept nogil
    PyObject *_tuple_item "PyTuple_GET_ITEM"(PyObject *t, Py_ssize_t i) noexcept nogil
    Py_ssize_t _dict_size "PyDict_GET_SIZE"(PyObject *d) noexcept nogil
    bint _dict_next "PyDict_Next"(PyObject *d, Py_ssize_t *pos, PyObject **key,
                                  PyObject **value) noexcept

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
#: The most methods one evaluator serves (spec.MAX_METHODS).
MAX_METHODS = SHM_MAX_METHODS

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


cdef inline int _check(int rc, str what) except -1:
    """The single mapping from core status codes to exceptions: rc itself
    when it is no error."""
    if rc >= 0:
        return rc
    return _raise_status(rc, what)


cdef int _raise_status(int rc, str what) except -1:
    """Raises the exception of the error status rc (_check)."""
    if rc == SHM_E_FULL:
        raise ClientTableFull(f"{what}: the client table is full; raise max_clients")
    raise SegmentError(f"{what}: {_MESSAGES.get(rc, 'error %d' % rc)}")


cdef int _begin_failed(int rc) except -1:
    """Raises what the failed begin of a slot (shm_slot_begin's status rc)
    means: the entry was reclaimed (EvaluatorClosed), or _check's error."""
    if rc == SHM_STALE:
        raise EvaluatorClosed(_MESSAGES[SHM_STALE])
    return _raise_status(rc, "begin")


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


def only_python_thread():
    """True when the caller is the only Python thread of the only
    interpreter: then a client keeps the GIL while it waits (for tests)."""
    return bool(shm_only_python_thread())


def evaluator_spin(uint64_t spin_ns, uint32_t n_attached, uint32_t ncpu):
    """The evaluator's spin budget with n_attached clients on ncpu CPUs
    (ring/wait.h, shm_evaluator_spin), for tests."""
    return shm_evaluator_spin(spin_ns, n_attached, ncpu)


#: The flag of a yielding spin in a spin budget (ring.h's SHM_SPIN_YIELD).
SPIN_YIELD = SHM_SPIN_YIELD
#: The crowding a tuner publishes (ring.h's enum shm_crowding).
CROWD_NONE = SHM_CROWD_NONE
CROWD_YIELD = SHM_CROWD_YIELD
CROWD_SLEEP = SHM_CROWD_SLEEP


def spin_policy(uint64_t spin_ns, uint32_t processes, uint32_t ncpu):
    """The spin rule (ring/wait.h, shm_spin_policy): the budget of a wait
    among `processes` processes (the attached clients and the evaluator) on
    ncpu CPUs -- spin_ns while each has a CPU, spin_ns | SPIN_YIELD with one
    process more, 0 beyond."""
    return shm_spin_policy(spin_ns, processes, ncpu)


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


include "_core/pyx/layout.pxi"
include "_core/pyx/segment.pxi"
include "_core/pyx/spin_arms.pxi"
include "_core/pyx/port.pxi"
include "_core/pyx/pending.pxi"
include "_core/pyx/server.pxi"
