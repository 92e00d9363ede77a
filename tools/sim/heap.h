/*
 * sim/heap: the containers of tidepool-sim. A binary min-heap of events ordered by (time,
 * sequence number) so that equal times pop in insertion order and runs are deterministic;
 * a binary min-heap of (finish step, request) per decode worker; a growable int vector and
 * an int deque. Push and pop are O(log n); growth doubles. Allocation failure aborts the
 * simulator (a tool, not a server). Part of tidepool-sim (included once; all static).
 */
#ifndef TP_SIM_HEAP_H
#define TP_SIM_HEAP_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *sim_xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q) {
        fprintf(stderr, "tidepool-sim: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return q;
}

// --- events ------------------------------------------------------------------------------

typedef struct {
    double t_ms;    /* simulated time */
    uint64_t seq;   /* tie-break: insertion order */
    int type;       /* EV_* of the simulator */
    int id;         /* worker or request, by type */
    uint32_t epoch; /* request epoch when the event was made (stale events are skipped) */
} sim_event;

typedef struct {
    sim_event *v;
    size_t n, cap;
    uint64_t next_seq;
} event_heap;

static int ev_less(const sim_event *a, const sim_event *b)
{
    return a->t_ms < b->t_ms || (a->t_ms == b->t_ms && a->seq < b->seq);
}

static void evheap_push(event_heap *h, double t_ms, int type, int id, uint32_t epoch)
{
    if (h->n == h->cap) {
        h->cap = h->cap ? 2 * h->cap : 1024;
        h->v = sim_xrealloc(h->v, h->cap * sizeof(*h->v));
    }
    sim_event e = {.t_ms = t_ms, .seq = h->next_seq++, .type = type, .id = id, .epoch = epoch};
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

/* Pops the earliest event into *out; returns 0, or -1 when empty. */
static int evheap_pop(event_heap *h, sim_event *out)
{
    if (h->n == 0)
        return -1;
    *out = h->v[0];
    sim_event last = h->v[--h->n];
    size_t i = 0, n = h->n;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const sim_event *mv = &last;
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

// --- finish heap (per decode worker) -----------------------------------------------------

typedef struct {
    int64_t step; /* worker step after which the sequence has all its tokens */
    int req;
    uint32_t epoch; /* the request's epoch when it joined; a mismatch = it left */
} fin_entry;

typedef struct {
    fin_entry *v;
    int n, cap;
} fin_heap;

static int fin_less(const fin_entry *a, const fin_entry *b)
{
    return a->step < b->step || (a->step == b->step && a->req < b->req);
}

static void finheap_push(fin_heap *h, fin_entry e)
{
    if (h->n == h->cap) {
        h->cap = h->cap ? 2 * h->cap : 64;
        h->v = sim_xrealloc(h->v, (size_t)h->cap * sizeof(*h->v));
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

static fin_entry finheap_pop(fin_heap *h)
{
    fin_entry top = h->v[0];
    fin_entry last = h->v[--h->n];
    int i = 0, n = h->n;
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        const fin_entry *mv = &last;
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

// --- int vector and deque ------------------------------------------------------------------

typedef struct {
    int *v;
    int n, cap;
} ivec;

static void ivec_push(ivec *a, int x)
{
    if (a->n == a->cap) {
        a->cap = a->cap ? 2 * a->cap : 16;
        a->v = sim_xrealloc(a->v, (size_t)a->cap * sizeof(int));
    }
    a->v[a->n++] = x;
}

/* Ring buffer of ints: push at either end, pop at the front. */
typedef struct {
    int *v;
    size_t head, n, cap;
} ideque;

static void ideque_grow(ideque *d)
{
    size_t ncap = d->cap ? 2 * d->cap : 256;
    int *nv = sim_xrealloc(NULL, ncap * sizeof(int));
    for (size_t i = 0; i < d->n; i++)
        nv[i] = d->v[(d->head + i) % d->cap];
    free(d->v);
    d->v = nv;
    d->head = 0;
    d->cap = ncap;
}

static void ideque_push_back(ideque *d, int x)
{
    if (d->n == d->cap)
        ideque_grow(d);
    d->v[(d->head + d->n) % d->cap] = x;
    d->n++;
}

static void ideque_push_front(ideque *d, int x)
{
    if (d->n == d->cap)
        ideque_grow(d);
    d->head = (d->head + d->cap - 1) % d->cap;
    d->v[d->head] = x;
    d->n++;
}

static int ideque_front(const ideque *d)
{
    return d->v[d->head];
}

static int ideque_pop_front(ideque *d)
{
    int x = d->v[d->head];
    d->head = (d->head + 1) % d->cap;
    d->n--;
    return x;
}

#endif
