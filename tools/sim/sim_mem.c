/*
 * sim_mem: realloc or exit (sim_mem.h).
 */
#include <stdio.h>
#include <stdlib.h>

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
