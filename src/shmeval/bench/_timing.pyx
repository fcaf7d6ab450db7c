# cython: language_level=3
"""The benchmark suite's timing in C: the futex ping-pong reference
(pingpong.h) and the workers' timed loop.

Both time themselves in C, so that what they measure is the wake-up or the
call, not the interpreter around it.  Benchmarks only: the core (shmeval._ring)
carries none of this.
"""
from libc.stdint cimport int64_t, uint64_t

cimport numpy as cnp
from cpython.buffer cimport PyBUF_WRITABLE, PyObject_GetBuffer, PyBuffer_Release
from cpython.exc cimport PyErr_CheckSignals

cnp.import_array()


cdef _check_lat(cnp.ndarray lat):
    """The latency record of pingpong and timed_calls: a writable
    C-contiguous int64 array."""
    if cnp.PyArray_TYPE(lat) != cnp.NPY_INT64 or not cnp.PyArray_IS_C_CONTIGUOUS(lat) or \
            not cnp.PyArray_ISWRITEABLE(lat):
        raise ValueError("lat must be a writable C-contiguous int64 array")


def pingpong(object buf, int side, cnp.ndarray lat not None, uint64_t spin_ns=0,
             uint64_t timeout_ns=10_000_000_000):
    """One side of a futex ping-pong between two processes (pingpong_run in
    pingpong.h).  buf: a writable buffer shared by both processes (a
    shared-memory mapping), its first 4 bytes 0 at the start and 4-byte
    aligned.  lat: a C-contiguous int64 array, one entry per round trip;
    side 0 fills it with each round trip's ns, side 1 only uses its length.
    Returns the ns from the first round trip's start to the last one's end
    (the ticker thread's start and stop outside it); raises TimeoutError
    when the other side stops answering for timeout_ns."""
    cdef Py_buffer view
    cdef int rc
    cdef uint64_t elapsed = 0, rounds
    cdef uint64_t *out = NULL
    if side not in (0, 1):
        raise ValueError("side must be 0 or 1")
    if spin_ns & SHM_SPIN_YIELD:
        raise ValueError("spin_ns is too large")
    _check_lat(lat)
    rounds = <uint64_t>cnp.PyArray_SIZE(lat)
    if side == 0:
        out = <uint64_t *>cnp.PyArray_DATA(lat)
    PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE)
    try:
        if view.len < 4 or (<size_t>view.buf) % 4:
            raise ValueError("buf must be at least 4 bytes and 4-byte aligned")
        with nogil:
            rc = pingpong_run(view.buf, side, rounds, out, spin_ns, timeout_ns, &elapsed)
    finally:
        PyBuffer_Release(&view)
    if rc != SHM_OK:
        raise TimeoutError("the other side of the ping-pong stopped answering")
    return elapsed


def timed_calls(object fn, object arg, int64_t t_end, cnp.ndarray lat not None):
    """The benchmark's timed loop, in C: calls ``fn(arg)`` until the
    monotonic clock (``time.perf_counter_ns``'s, CLOCK_MONOTONIC) passes
    t_end, storing each call's ns in lat while it has room.  Returns
    ``(calls, last result)``: the calls that ended inside the window, and
    what the last call returned.  As in ``out = fn(arg)`` in a Python loop,
    each result is held until the next call returns.  The reference it is
    compared with (``pingpong``) times itself in C too; the same loop
    written in Python costs about 1 us of CPU per call with 16 workers on 2
    cores (``shmeval bench --loop python`` runs it).  Checks for signals on
    every call, as the interpreter would between bytecodes."""
    cdef int64_t before, after
    cdef int64_t *out
    cdef Py_ssize_t count = 0, cap
    cdef object result = None
    _check_lat(lat)
    out = <int64_t *>cnp.PyArray_DATA(lat)
    cap = cnp.PyArray_SIZE(lat)
    before = <int64_t>shm_now_ns()
    while True:
        result = fn(arg)
        after = <int64_t>shm_now_ns()
        if after > t_end:  # count only calls that ended inside the window
            break
        if count < cap:
            out[count] = after - before
        count += 1
        before = after
        PyErr_CheckSignals()  # raises what a signal handler raised
    return count, result


def timed_pipelined(object submit, object states, object pendings, int64_t t_end,
                    cnp.ndarray lat not None):
    """``timed_calls`` for a client that keeps submissions in flight:
    ``pendings`` holds them, oldest first (a deque or a list, at least
    one).  Each call collects the oldest (its ``result()``) and submits
    ``states`` once more (``submit(states)``), so as many stay in flight;
    lat gets the ns between two answers.  Returns ``(calls, last
    result)``; ``pendings`` holds the submissions still in flight, oldest
    first, when it returns or raises.  The loop is C for the reason
    ``timed_calls`` is: the window measures the submit and the collect, as
    it measures the blocking call, not the interpreter around them."""
    cdef int64_t before, after
    cdef int64_t *out
    cdef Py_ssize_t count = 0, cap, i = 0, depth
    cdef object result = None
    cdef list ring = list(pendings)
    depth = len(ring)
    if depth < 1:
        raise ValueError("pendings must hold at least one submission")
    _check_lat(lat)
    out = <int64_t *>cnp.PyArray_DATA(lat)
    cap = cnp.PyArray_SIZE(lat)
    pendings.clear()
    try:
        before = <int64_t>shm_now_ns()
        while True:
            result = ring[i].result()
            ring[i] = submit(states)
            i += 1
            if i == depth:
                i = 0
            after = <int64_t>shm_now_ns()
            if after > t_end:
                break
            if count < cap:
                out[count] = after - before
            count += 1
            before = after
            PyErr_CheckSignals()
    finally:
        pendings.extend(ring[i:] + ring[:i])
    return count, result
