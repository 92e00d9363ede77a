/*
 * sim_ivec: a growable int array (sim_ivec.h).
 */
#include <stdlib.h>
#include <string.h>

#include "sim_ivec.h"
#include "sim_mem.h"

void sim_ivec_push(sim_ivec *a, int x)
{
    if (a->n == a->cap) {
        int ncap = a->cap ? 2 * a->cap : 16;
        if (a->ext) {
            int *v = sim_mem_realloc(NULL, (size_t)ncap * sizeof(int));
            memcpy(v, a->v, (size_t)a->n * sizeof(int));
            a->v = v;
            a->ext = 0;
        } else {
            a->v = sim_mem_realloc(a->v, (size_t)ncap * sizeof(int));
        }
        a->cap = ncap;
    }
    a->v[a->n++] = x;
}

void sim_ivec_free(sim_ivec *a)
{
    if (!a->ext)
        free(a->v);
    a->v = NULL;
    a->n = a->cap = a->ext = 0;
}
