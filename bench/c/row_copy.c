/* The gather's copy on its own: why ring.h copies rows with shm_copy.
 *
 * 256 Go states (19x19x17 float32, 24,548 bytes) sit in line-aligned slots
 * of a shared mapping, as the segment lays them out; the gather copies them
 * into consecutive rows of a batch buffer, where row i starts at
 * i * 24,548 bytes, 4-byte aligned.  Before every timed copy the slots are
 * written afresh (as clients' posts leave them).  Variants, interleaved
 * round by round, median of the rounds in µs:
 *
 *   batch memcpy    one memcpy of the whole batch between two buffers,
 *                   right after the same copy (the benchmark's "hot"
 *                   np.copyto; the other variants follow fresh posts)
 *   rows, glibc     memcpy per row, slot -> packed row
 *   rows, shm_copy  ring.h's shm_copy per row (what the gather does)
 *   rows, same off  memcpy per row into rows spaced like the slots, so that
 *                   source and destination share their offset in the line
 *   posts, glibc    the client's direction: memcpy per row, packed rows ->
 *                   slots
 *   posts, shm_copy the same with shm_copy (what evaluate_many does)
 *
 * Build and run (from the repository root):
 *   gcc -O2 -std=gnu11 -I src/shmeval/_core -o /tmp/row_copy bench/c/row_copy.c && /tmp/row_copy
 * Arguments: [rounds (default 301)] [rows (default 256)] [row bytes]. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "ring.h"

enum { VARIANTS = 6 };
static const char *const k_names[VARIANTS] = {
    "batch memcpy", "rows, glibc",  "rows, shm_copy",
    "rows, same off", "posts, glibc", "posts, shm_copy"};

/* A buffer as NumPy allocates a large array: huge pages where the kernel
 * gives them on request (transparent huge pages in "madvise" mode). */
static char *buffer(size_t n) {
    size_t huge = 2u << 20, size = (n + huge - 1) / huge * huge;
    char *p = aligned_alloc(huge, size);
    if (p) {
        madvise(p, size, MADV_HUGEPAGE);
        memset(p, 0, size);
    }
    return p;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    size_t rounds = argc > 1 ? strtoul(argv[1], NULL, 10) : 301;
    size_t n = argc > 2 ? strtoul(argv[2], NULL, 10) : 256;
    size_t row = argc > 3 ? strtoul(argv[3], NULL, 10) : 19 * 19 * 17 * 4;
    if (rounds < 1 || n < 1 || row < 1) {
        fprintf(stderr, "usage: row_copy [rounds] [rows] [row bytes]\n");
        return 2;
    }
    size_t stride = (row + SHM_LINE - 1) / SHM_LINE * SHM_LINE; /* a slot */
    size_t packed = n * row, spaced = n * stride;
    char *slots = mmap(NULL, spaced, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    char *in = buffer(packed), *batch = buffer(spaced + SHM_LINE);
    char *hot = buffer(packed), *hot_dst = buffer(packed);
    if (slots == MAP_FAILED || !in || !batch || !hot || !hot_dst) {
        perror("row_copy: allocation");
        return 1;
    }
    /* The packed rows start 16 bytes into the batch buffer: any offset that
     * is not a multiple of the line will do (row i then moves through them
     * all, as rows of a NumPy batch do). */
    char *rows = batch + 16;
    for (size_t i = 0; i < packed; i++) in[i] = (char)(i * 131 + 7);
    memcpy(hot, in, packed);
    double *t[VARIANTS];
    for (int v = 0; v < VARIANTS; v++) t[v] = calloc(rounds, sizeof(double));
    for (size_t r = 0; r < rounds; r++) {
        for (int v = 0; v < VARIANTS; v++) {
            if (v == 0) /* back to back: the second copy finds both in cache */
                memcpy(hot_dst, hot, packed);
            else if (v <= 3) /* the clients' posts */
                for (size_t i = 0; i < n; i++)
                    memcpy(slots + i * stride, in + i * row, row);
            uint64_t t0 = shm_now_ns();
            switch (v) {
            case 0:
                memcpy(hot_dst, hot, packed);
                break;
            case 1:
                for (size_t i = 0; i < n; i++)
                    memcpy(rows + i * row, slots + i * stride, row);
                break;
            case 2:
                for (size_t i = 0; i < n; i++)
                    shm_copy(rows + i * row, slots + i * stride, row);
                break;
            case 3:
                for (size_t i = 0; i < n; i++)
                    memcpy(batch + i * stride, slots + i * stride, row);
                break;
            case 4:
                for (size_t i = 0; i < n; i++)
                    memcpy(slots + i * stride, in + i * row, row);
                break;
            default:
                for (size_t i = 0; i < n; i++)
                    shm_copy(slots + i * stride, in + i * row, row);
                break;
            }
            t[v][r] = (double)(shm_now_ns() - t0) / 1e3;
            int bad = 0;
            if (r == 0 && (v == 1 || v == 2))
                bad = memcmp(rows, in, packed) != 0;
            for (size_t i = 0; r == 0 && v >= 4 && i < n; i++)
                bad |= memcmp(slots + i * stride, in + i * row, row) != 0;
            if (bad) {
                fprintf(stderr, "row_copy: %s copied wrong bytes\n", k_names[v]);
                return 1;
            }
        }
    }
    printf("%zu rows of %zu bytes (slots every %zu), %zu rounds; median µs\n", n,
           row, stride, rounds);
    double base = 0;
    for (int v = 0; v < VARIANTS; v++) {
        qsort(t[v], rounds, sizeof(double), cmp_double);
        double med = t[v][rounds / 2];
        if (v == 0) base = med;
        printf("  %-15s %8.1f  %.2fx\n", k_names[v], med, med / base);
    }
    return 0;
}
