/*
 * sim_heap: the event heap and the finish-step heaps of tidepool-sim (sim_heap.h). Both
 * sift a hole down (or up) and drop the moved element in once, instead of swapping at
 * every level.
 */
#include <stdlib.h>

#include "log.h"
#include "sim_heap.h"
#include "sim_mem.h"

// --- events

static int ev_less(const sim_heap_event *a, const sim_heap_event *b)
{
    return a->t_ms < b->t_ms || (a->t_ms == b->t_ms && a->seq < b->seq);
}

void sim_heap_push(sim_heap *h, double t_ms, int type, int id, uint32_t epoch)
{
    if (h->n == h->cap) {
        h->cap = h->cap ? 2 * h->cap : 1024;
        h->v = sim_mem_realloc(h->v, h->cap * sizeof(*h->v));
    }
    sim_heap_event e = {.t_ms = t_ms, .seq = h->next_seq++, .type = type, .id = id, .epoch = epoch};
    size_t i = h->n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!ev_less(&e, &h->v[parent]))
            break;
        h->v[i] = h->v[parent];
        i = parent;
    }
    h->v[i] = e;
}

int sim_heap_pop(sim_heap *h, sim_heap_event *out)
{
    if (h->n == 0)
        return -1;
    *out = h->v[0];
    sim_heap_event last = h->v[--h->n];
    size_t i = 0, n = h->n;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const sim_heap_event *mv = &last;
        if (l < n && ev_less(&h->v[l], mv)) {
            m = l;
            mv = &h->v[l];
        }
        if (r < n && ev_less(&h->v[r], mv))
            m = r;
        if (m == i)
            break;
        h->v[i] = h->v[m];
        i = m;
    }
    if (n > 0)
        h->v[i] = last;
    return 0;
}

void sim_heap_free(sim_heap *h)
{
    free(h->v);
    h->v = NULL;
    h->n = h->cap = 0;
}

// --- finish steps

static int fin_less(const sim_heap_fin_entry *a, const sim_heap_fin_entry *b)
{
    return a->step < b->step || (a->step == b->step && a->req < b->req);
}

void sim_heap_fin_push(sim_heap_fin *h, sim_heap_fin_entry e)
{
    if (h->n == h->cap) {
        h->cap = h->cap ? 2 * h->cap : 64;
        h->v = sim_mem_realloc(h->v, (size_t)h->cap * sizeof(*h->v));
    }
    int i = h->n++;
    while (i > 0) {
        int parent = (i - 1) / 2;
        if (!fin_less(&e, &h->v[parent]))
            break;
        h->v[i] = h->v[parent];
        i = parent;
    }
    h->v[i] = e;
}

sim_heap_fin_entry sim_heap_fin_pop(sim_heap_fin *h)
{
    ASSERT(h->n > 0);
    sim_heap_fin_entry top = h->v[0];
    sim_heap_fin_entry last = h->v[--h->n];
    int i = 0, n = h->n;
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        const sim_heap_fin_entry *mv = &last;
        if (l < n && fin_less(&h->v[l], mv)) {
            m = l;
            mv = &h->v[l];
        }
        if (r < n && fin_less(&h->v[r], mv))
            m = r;
        if (m == i)
            break;
        h->v[i] = h->v[m];
        i = m;
    }
    if (n > 0)
        h->v[i] = last;
    return top;
}

void sim_heap_fin_free(sim_heap_fin *h)
{
    free(h->v);
    h->v = NULL;
    h->n = h->cap = 0;
}
