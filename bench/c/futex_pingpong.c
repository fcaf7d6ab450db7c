/* The machine's wake-up cost: two processes bounce a futex word in shared
 * memory.  Usage: futex_pingpong [pin] [timer]  ("pin": both on CPU 0;
 * "timer": every sleep with a 100 ms timeout, as a waiter that checks on
 * its partner from time to time without a ticker would sleep).
 * Prints µs per round trip (two wake-ups, two context switches). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <linux/futex.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int timer;

static void futex_wait(_Atomic uint32_t *w, uint32_t v) {
    struct timespec ts = {0, 100000000};
    syscall(SYS_futex, w, FUTEX_WAIT, v, timer ? &ts : NULL, NULL, 0);
}
static void futex_wake(_Atomic uint32_t *w) {
    syscall(SYS_futex, w, FUTEX_WAKE, 1, NULL, NULL, 0);
}
static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const int rounds = 100000;
    _Atomic uint32_t *w = mmap(NULL, 4096, PROT_READ | PROT_WRITE,
                               MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    int pin = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "pin") == 0) pin = 1;
        else if (strcmp(argv[i], "timer") == 0) timer = 1;
        else {
            fprintf(stderr, "usage: %s [pin] [timer]\n", argv[0]);
            return 2;
        }
    }
    if (pin) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(0, &set);
        sched_setaffinity(0, sizeof set, &set);
    }
    pid_t child = fork();
    if (child == 0) {
        for (int i = 0; i < rounds; i++) {
            while (atomic_load(w) != 1) futex_wait(w, 0);
            atomic_store(w, 0);
            futex_wake(w);
        }
        _exit(0);
    }
    double t = now_s();
    for (int i = 0; i < rounds; i++) {
        atomic_store(w, 1);
        futex_wake(w);
        while (atomic_load(w) != 0) futex_wait(w, 1);
    }
    double dt = now_s() - t;
    waitpid(child, NULL, 0);
    printf("%.2f\n", dt / rounds * 1e6);
    return 0;
}
