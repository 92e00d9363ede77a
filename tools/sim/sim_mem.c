/*
 * sim_mem: realloc or exit (sim_mem.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim_mem.h"

void *sim_mem_realloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q) {
        fprintf(stderr, "tidepool-sim: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return q;
}

void *sim_mem_realloc_aligned(void *p, size_t old_n, size_t n, size_t align)
{
    void *q = NULL;
    if (posix_memalign(&q, align, n ? n : 1) != 0) {
        fprintf(stderr, "tidepool-sim: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    if (p)
        memcpy(q, p, old_n < n ? old_n : n);
    free(p);
    return q;
}
