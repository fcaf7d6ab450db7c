/*
 * ring/platform.h -- what the protocol takes from the compiler, the CPU and
 * Linux: the system headers, the debug assertions and test hooks, the
 * barriers, a monotonic raise of a word, the clock and the futex calls.
 * Nothing here knows the segment.
 */
#ifndef SHMEVAL_RING_PLATFORM_H
#define SHMEVAL_RING_PLATFORM_H

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

/* Test hooks: the C tests (tests/c/harness.h) define SHM_HOOK(point) to
 * park a thread at a named point and so replay a chosen interleaving
 * deterministically.  They compile to nothing otherwise. */
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

/* Raises *w to at least v, never lowering it: a CAS loop whose successful
 * CAS has order `mo` (the caller's MO comment says what it pairs with). */
static inline void shm_raise_word(_Atomic uint64_t *w, uint64_t v,
                                  memory_order mo) {
    uint64_t cur = atomic_load_explicit(w, memory_order_relaxed);
    while (cur < v && !atomic_compare_exchange_weak_explicit(
                          w, &cur, v, mo, memory_order_relaxed)) {
    }
}

static inline uint64_t shm_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
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

#endif /* SHMEVAL_RING_PLATFORM_H */
