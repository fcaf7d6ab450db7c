/*
 * ring_python.h -- the C helpers of the Cython wrapper (_ring.pyx) that are
 * not part of the protocol and need Python.h.  ring.h stays free of Python
 * (the C tests, tests/c, build it alone).
 */
#ifndef SHMEVAL_RING_PYTHON_H
#define SHMEVAL_RING_PYTHON_H

#include <Python.h>
#include <stdint.h>

/* True when the calling thread (which holds the GIL) is the only Python
 * thread of the only interpreter: then no other thread can be waiting
 * for the GIL, and a client may keep it while it waits for its answer
 * (keeping it saves a release and a re-take of the GIL per round trip;
 * docs/performance.md).  A thread that a C library attaches meanwhile
 * (PyGILState_Ensure) waits until the answer comes; a free-threaded build
 * has no GIL to keep. */
static int shm_only_python_thread(void) {
#ifdef Py_GIL_DISABLED
    return 0;
#else
    PyThreadState *h = PyInterpreterState_ThreadHead(PyInterpreterState_Get());
    return h != NULL && PyThreadState_Next(h) == NULL &&
           PyInterpreterState_Next(PyInterpreterState_Head()) == NULL;
#endif
}

/* No NaN or inf among n floats: an IEEE value is not finite exactly when
 * its exponent bits are all ones, i.e. when its bits without the sign,
 * read as a signed integer, exceed those of the largest finite value.
 * OR-ing those comparisons has no branch in the loop, so the compiler
 * vectorises it into a compare and an OR per vector (a scalar
 * isfinite() test per element was the cost of checking large outputs). */
__attribute__((optimize("O3")))
static int shm_finite_f32(const uint32_t *u, Py_ssize_t n) {
    const int32_t *s = (const int32_t *)u;
    int32_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        bad |= (s[i] & 0x7fffffff) > 0x7f7fffff;
    return !bad;
}
/* A double's exponent is in its high 32 bits: the same test on them
 * (32-bit compares vectorise on every x86-64; 64-bit ones need SSE4.2). */
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "shm_finite_f64 assumes little-endian doubles"
#endif
__attribute__((optimize("O3")))
static int shm_finite_f64(const uint64_t *u, Py_ssize_t n) {
    const int32_t *s = (const int32_t *)u;
    int32_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        bad |= (s[2 * i + 1] & 0x7fffffff) > 0x7fefffff;
    return !bad;
}

#endif /* SHMEVAL_RING_PYTHON_H */
