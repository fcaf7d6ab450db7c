/* A shmeval client written in C against ring.h directly: the ceiling of the
 * core with no Python on the client side.  Usage: ring_client ADDRESS
 * SECONDS [timer]  Prints the number of round trips it completed.  Like the
 * Python client it runs a ticker (100 ms), so that its sleeps need no
 * timer; with "timer" it has none, and every sleep has a 100 ms timeout. */
#include "ring.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>

int main(int argc, char **argv) {
    int timer = argc == 4 && strcmp(argv[3], "timer") == 0;
    if (argc != 3 && !timer) {
        fprintf(stderr, "usage: %s ADDRESS SECONDS [timer]\n", argv[0]);
        return 2;
    }
    int fd = shm_open(argv[1], O_RDWR, 0);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        perror("shm_open");
        return 1;
    }
    char *base = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE,
                      MAP_SHARED, fd, 0);
    shm_seg s;
    if (base == MAP_FAILED || shm_attach(&s, base, (uint64_t)st.st_size) != SHM_OK) {
        fprintf(stderr, "cannot attach %s\n", argv[1]);
        return 1;
    }
    int32_t pid = (int32_t)getpid();
    int c = shm_client_register(&s, pid, 0, 0);
    if (c < 0) {
        fprintf(stderr, "client table full\n");
        return 1;
    }
    shm_ticker tk;
    shm_ticker *t =
        !timer && shm_ticker_start(&tk, &s, (uint32_t)c, 100000000) == 0 ? &tk : NULL;
    char *in = calloc(1, s.p.in_bytes);
    uint64_t end = shm_now_ns() + (uint64_t)(atof(argv[2]) * 1e9), n = 0;
    while (shm_now_ns() < end) {
        uint32_t gen;
        if (shm_slot_begin(&s, (uint32_t)c, 0, pid, &gen) != SHM_OK) return 1;
        memcpy(shm_slot_in(&s, (uint32_t)c, 0), in, s.p.in_bytes);
        if (shm_slot_publish(&s, (uint32_t)c, 0, gen) != SHM_OK) return 1;
        shm_notify_evaluator(&s, 1);
        int rc;
        while ((rc = shm_slot_wait_ticked(&s, (uint32_t)c, 0, gen, 0, 100000000, t)) < 0)
            if (rc == SHM_CLOSED || rc == SHM_STALE) return 1;
        shm_slot_release(&s, (uint32_t)c, 0, gen);
        n++;
    }
    if (t) shm_ticker_stop(t);
    shm_client_detach(&s, (uint32_t)c);
    printf("%llu\n", (unsigned long long)n);
    return 0;
}
