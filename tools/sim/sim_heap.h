/*
 * sim_heap: the two priority queues of tidepool-sim, binary min-heaps in growable arrays
 * (push and pop O(log n), growth doubles, allocation failure ends the simulator:
 * sim_mem.h).
 *
 *   sim_heap      the events of the simulation, ordered by (time, sequence number): equal
 *                 times pop in insertion order, so runs are deterministic.
 *   sim_heap_fin  per decode worker, its sequences ordered by (finish step, request).
 *
 * Both are plain structs: zero-initialized is empty; v[0..n) is the heap (v[0] the
 * minimum, the rest in heap order, which callers may scan but not reorder); n = 0 empties
 * it. Not thread-safe.
 */
#ifndef TP_SIM_HEAP_H
#define TP_SIM_HEAP_H

#include <stddef.h>
#include <stdint.h>

// --- events

typedef struct {
    double t_ms;    /* simulated time */
    uint64_t seq;   /* tie-break: insertion order */
    int type;       /* EV_* of the simulator */
    int id;         /* worker or request, by type */
    uint32_t epoch; /* request epoch when the event was made (stale events are skipped) */
} sim_heap_event;

typedef struct {
    sim_heap_event *v;
    size_t n, cap;
    uint64_t next_seq; /* seq of the next push */
} sim_heap;

/* Add an event at t_ms with the next sequence number. */
void sim_heap_push(sim_heap *h, double t_ms, int type, int id, uint32_t epoch);

/* Remove the earliest event (smallest t_ms, then smallest seq) into *out. Returns 0, or -1
 * when the heap is empty (*out untouched). */
int sim_heap_pop(sim_heap *h, sim_heap_event *out);

/* Free the array; h is empty (and reusable) afterwards. */
void sim_heap_free(sim_heap *h);

// --- finish steps (per decode worker)

typedef struct {
    int64_t step;   /* worker step after which the sequence has all its tokens */
    int req;
    uint32_t epoch; /* the request's epoch when it joined; a mismatch = it left */
} sim_heap_fin_entry;

typedef struct {
    sim_heap_fin_entry *v;
    int n, cap;
} sim_heap_fin;

/* Add e. */
void sim_heap_fin_push(sim_heap_fin *h, sim_heap_fin_entry e);

/* Remove and return the entry with the smallest step, then the smallest req. h must not
 * be empty (ASSERT). */
sim_heap_fin_entry sim_heap_fin_pop(sim_heap_fin *h);

/* Free the array; h is empty (and reusable) afterwards. */
void sim_heap_fin_free(sim_heap_fin *h);

#endif
