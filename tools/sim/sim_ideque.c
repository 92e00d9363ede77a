/*
 * sim_ideque: an int deque in a ring buffer (sim_ideque.h).
 */
#include <stdlib.h>

#include "log.h"
#include "sim_ideque.h"
#include "sim_mem.h"

/* Double the capacity, copying the elements to the start of the new buffer. */
static void grow(sim_ideque *d)
{
    size_t ncap = d->cap ? 2 * d->cap : 256;
    int *nv = sim_mem_realloc(NULL, ncap * sizeof(int));
    for (size_t i = 0; i < d->n; i++)
        nv[i] = d->v[(d->head + i) % d->cap];
    free(d->v);
    d->v = nv;
    d->head = 0;
    d->cap = ncap;
}

void sim_ideque_push_back(sim_ideque *d, int x)
{
    if (d->n == d->cap)
        grow(d);
    d->v[(d->head + d->n) % d->cap] = x;
    d->n++;
}

void sim_ideque_push_front(sim_ideque *d, int x)
{
    if (d->n == d->cap)
        grow(d);
    d->head = (d->head + d->cap - 1) % d->cap;
    d->v[d->head] = x;
    d->n++;
}

int sim_ideque_front(const sim_ideque *d)
{
    ASSERT(d->n > 0);
    return d->v[d->head];
}

int sim_ideque_pop_front(sim_ideque *d)
{
    ASSERT(d->n > 0);
    int x = d->v[d->head];
    d->head = (d->head + 1) % d->cap;
    d->n--;
    return x;
}

void sim_ideque_free(sim_ideque *d)
{
    free(d->v);
    d->v = NULL;
    d->head = d->n = d->cap = 0;
}
