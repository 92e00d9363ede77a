/*
 * sim_heap: the event heap and the finish-step heaps of tidepool-sim (sim_heap.h). Both
 * sift a hole down (or up) and drop the moved element in once, instead of swapping at
 * every level.
 */
#include <stdlib.h>
#include <string.h>

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
    sim_heap_push_aux(h, t_ms, type, id, epoch, -1);
}

void sim_heap_push_aux(sim_heap *h, double t_ms, int type, int id, uint32_t epoch, int aux)
{
    if (h->n == h->cap) {
        h->cap = h->cap ? 2 * h->cap : 1024;
        h->v = sim_mem_realloc(h->v, h->cap * sizeof(*h->v));
    }
    sim_heap_event e = {
        .t_ms = t_ms, .seq = h->next_seq++, .type = type, .id = id, .epoch = epoch, .aux = aux};
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

// --- one event slot per worker

void sim_heap_slot_init(sim_heap_slot *h, int n_ids)
{
    ASSERT(n_ids >= 0 && n_ids < (1 << SIM_HEAP_SLOT_ID_BITS));
    h->v = sim_mem_realloc_aligned(NULL, 0, ((size_t)n_ids + 3) * sizeof(*h->v), 64);
    h->info = sim_mem_realloc(NULL, (size_t)n_ids * sizeof(*h->info));
    for (int i = 0; i < n_ids; i++)
        h->info[i] = (sim_heap_slot_info){.pos = -1};
    h->n = 0;
    h->n_ids = n_ids;
}

/* The slot heap is 4-ary: half the levels of a binary one, and a node's four children
 * sit in one cache line (16-byte nodes, the array offset by 3 so that a block of children
 * starts at a multiple of 4 entries). Index i's children are 4i+1 .. 4i+4, its parent
 * (i-1)/4. */
#define SLOT_AT(h, i) ((h)->v[(i) + 3])
#define SLOT_ID(k) ((int)((k) & ((1u << SIM_HEAP_SLOT_ID_BITS) - 1)))

static inline int node_less(const sim_heap_slot_node *a, const sim_heap_slot_node *b)
{
    return a->t_ms < b->t_ms || (a->t_ms == b->t_ms && a->key < b->key);
}

/* Put e at hole i, moving it up past the events after it. */
static void slot_up(sim_heap_slot *h, int i, sim_heap_slot_node e)
{
    while (i > 0) {
        int parent = (i - 1) / 4;
        if (!node_less(&e, &SLOT_AT(h, parent)))
            break;
        SLOT_AT(h, i) = SLOT_AT(h, parent);
        h->info[SLOT_ID(SLOT_AT(h, i).key)].pos = i;
        i = parent;
    }
    SLOT_AT(h, i) = e;
    h->info[SLOT_ID(e.key)].pos = i;
}

/* Put e at hole i, moving it down past the events before it. */
static void slot_down(sim_heap_slot *h, int i, sim_heap_slot_node e)
{
    int n = h->n;
    for (;;) {
        int c = 4 * i + 1;
        if (c >= n)
            break;
        int end = c + 4 < n ? c + 4 : n, m = c;
        for (int k = c + 1; k < end; k++)
            if (node_less(&SLOT_AT(h, k), &SLOT_AT(h, m)))
                m = k;
        if (!node_less(&SLOT_AT(h, m), &e))
            break;
        SLOT_AT(h, i) = SLOT_AT(h, m);
        h->info[SLOT_ID(SLOT_AT(h, i).key)].pos = i;
        i = m;
    }
    SLOT_AT(h, i) = e;
    h->info[SLOT_ID(e.key)].pos = i;
}

/* h->top from the root (n > 0). */
static void slot_top_update(sim_heap_slot *h)
{
    const sim_heap_slot_node *r = &SLOT_AT(h, 0);
    int id = SLOT_ID(r->key);
    h->top = (sim_heap_event){.aux = -1,
                              .t_ms = r->t_ms,
                              .seq = r->key >> SIM_HEAP_SLOT_ID_BITS,
                              .type = h->info[id].type,
                              .id = id,
                              .epoch = h->info[id].epoch};
}

int sim_heap_slot_set(sim_heap_slot *h, int id, double t_ms, uint64_t seq, int type,
                      uint32_t epoch)
{
    ASSERT(id >= 0 && id < h->n_ids);
    ASSERT(seq < ((uint64_t)1 << (64 - SIM_HEAP_SLOT_ID_BITS)));
    sim_heap_slot_node e = {.t_ms = t_ms, .key = seq << SIM_HEAP_SLOT_ID_BITS | (uint64_t)id};
    sim_heap_slot_info *x = &h->info[id];
    int i = x->pos, old = i < 0 ? 0 : x->type;
    x->type = type;
    x->epoch = epoch;
    if (i < 0)
        slot_up(h, h->n++, e);
    else if (node_less(&e, &SLOT_AT(h, i)))
        slot_up(h, i, e);
    else
        slot_down(h, i, e);
    slot_top_update(h);
    return old;
}

int sim_heap_slot_pop(sim_heap_slot *h, sim_heap_event *out)
{
    if (h->n == 0)
        return -1;
    *out = h->top;
    h->info[out->id].pos = -1;
    sim_heap_slot_node last = SLOT_AT(h, --h->n);
    if (h->n > 0) {
        slot_down(h, 0, last);
        slot_top_update(h);
    }
    return 0;
}

void sim_heap_slot_free(sim_heap_slot *h)
{
    free(h->v);
    free(h->info);
    h->v = NULL;
    h->info = NULL;
    h->n = h->n_ids = 0;
}

// --- finish steps

static int fin_less(const sim_heap_fin_entry *a, const sim_heap_fin_entry *b)
{
    return a->step < b->step || (a->step == b->step && a->req < b->req);
}

void sim_heap_fin_push(sim_heap_fin *h, sim_heap_fin_entry e)
{
    if (h->n == h->cap) {
        int ncap = h->cap ? 2 * h->cap : 64;
        if (h->ext) {
            sim_heap_fin_entry *v = sim_mem_realloc(NULL, (size_t)ncap * sizeof(*h->v));
            memcpy(v, h->v, (size_t)h->n * sizeof(*h->v));
            h->v = v;
            h->ext = 0;
        } else {
            h->v = sim_mem_realloc(h->v, (size_t)ncap * sizeof(*h->v));
        }
        h->cap = ncap;
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
        __builtin_prefetch(&h->v[4 * i + 3]); /* the grandchildren, a level ahead */
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
    if (!h->ext)
        free(h->v);
    h->v = NULL;
    h->n = h->cap = h->ext = 0;
}
