# Declarations of pingpong.h and of what _timing.pyx takes from the core's
# ring.h through it.  Only _timing.pyx cimports this.
from libc.stdint cimport uint64_t


cdef extern from "pingpong.h" nogil:
    uint64_t SHM_SPIN_YIELD

    enum:
        SHM_OK

    uint64_t shm_now_ns()
    int pingpong_run(void *word, int side, uint64_t rounds, uint64_t *lat,
                     uint64_t spin_ns, uint64_t timeout_ns, uint64_t *elapsed)
