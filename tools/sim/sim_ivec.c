/*
 * sim_ivec: a growable int array (sim_ivec.h).
 */
#include <stdlib.h>

#include "sim_ivec.h"
#include "sim_mem.h"

void sim_ivec_push(sim_ivec *a, int x)
{
    if (a->n == a->cap) {
        a->cap = a->cap ? 2 * a->cap : 16;
        a->v = sim_mem_realloc(a->v, (size_t)a->cap * sizeof(int));
    }
    a->v[a->n++] = x;
}

void sim_ivec_free(sim_ivec *a)
{
    free(a->v);
    a->v = NULL;
    a->n = a->cap = 0;
}
