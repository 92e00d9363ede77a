/*
 * sim_heap: the two priority queues of tidepool-sim, binary min-heaps in growable arrays
 * (push and pop O(log n), growth doubles, allocation failure ends the simulator:
 * sim_mem.h).
 *
 *   sim_heap      the events of the simulation, ordered by (time, sequence number): equal
 *                 times pop in insertion order, so runs are deterministic.
 *   sim_heap_slot the events that belong to one worker (at most one pending each: its
 *                 prefill batch, its run of decode steps, its role switch), one slot per
 *                 worker, ordered like sim_heap: setting a worker's slot again replaces
 *                 its event in place (O(log n)), so a replaced event never sits in a heap
 *                 waiting to be skipped, and the heap never holds more than the workers.
 *   sim_heap_fin  per decode worker, its sequences ordered by (finish step, request).
 *
 * sim_heap and sim_heap_fin are plain structs: zero-initialized is empty; v[0..n) is the
 * heap (v[0] the minimum, the rest in heap order, which callers may scan but not reorder);
 * n = 0 empties it. sim_heap_slot is set up with sim_heap_slot_init. Not thread-safe.
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
    int aux;        /* the caller's (sim_heap_push_aux), else -1; in the padding */
} sim_heap_event;

typedef struct {
    sim_heap_event *v;
    size_t n, cap;
    uint64_t next_seq; /* seq of the next push */
} sim_heap;

/* Add an event at t_ms with the next sequence number (aux -1). */
void sim_heap_push(sim_heap *h, double t_ms, int type, int id, uint32_t epoch);

/* sim_heap_push with the event's aux set (a hint for the caller: what it will touch). */
void sim_heap_push_aux(sim_heap *h, double t_ms, int type, int id, uint32_t epoch, int aux);

/* Remove the earliest event (smallest t_ms, then smallest seq) into *out. Returns 0, or -1
 * when the heap is empty (*out untouched). */
int sim_heap_pop(sim_heap *h, sim_heap_event *out);

/* Free the array; h is empty (and reusable) afterwards. */
void sim_heap_free(sim_heap *h);

/* Whether event a comes before b: by time, then sequence number. */
static inline int sim_heap_event_before(double a_t_ms, uint64_t a_seq, double b_t_ms,
                                        uint64_t b_seq)
{
    return a_t_ms < b_t_ms || (a_t_ms == b_t_ms && a_seq < b_seq);
}

// --- one event slot per worker

/* A set slot in the heap: 16 bytes, so a node's four children share one cache line. key
 * is seq << SIM_HEAP_SLOT_ID_BITS | id (seqs are unique, so it orders as seq does). */
typedef struct {
    double t_ms;
    uint64_t key;
} sim_heap_slot_node;
#define SIM_HEAP_SLOT_ID_BITS 20 /* ids < 2^20; seqs < 2^44 (ASSERT) */

/* What the heap keeps per id apart from its node. */
typedef struct {
    int pos;        /* where id's node is in the heap, -1 none */
    int type;
    uint32_t epoch;
} sim_heap_slot_info;

typedef struct {
    sim_heap_slot_node *v;    /* (n_ids + 3): the heap of the set slots in v[3 .. 3 + n) */
    sim_heap_slot_info *info; /* (n_ids) */
    sim_heap_event top;       /* the earliest set slot's event, when n > 0 */
    int n, n_ids;
} sim_heap_slot;

/* The earliest set slot's event (borrowed until the next change), or NULL when none. */
static inline const sim_heap_event *sim_heap_slot_top(const sim_heap_slot *h)
{
    return h->n ? &h->top : NULL;
}

/* An empty heap for ids 0..n_ids-1 (0 <= n_ids < 2^SIM_HEAP_SLOT_ID_BITS). */
void sim_heap_slot_init(sim_heap_slot *h, int n_ids);

/* Set id's event to (t_ms, seq, type, epoch), replacing the one it had if any. seq comes
 * from the caller (sim_heap.next_seq, so that both heaps order by one count; < 2^44,
 * ASSERT). Returns the
 * type of the event replaced, or 0 when id had none. */
int sim_heap_slot_set(sim_heap_slot *h, int id, double t_ms, uint64_t seq, int type,
                      uint32_t epoch);

/* Remove the earliest event (by time, then seq) into *out (out->id: its slot). Returns 0,
 * or -1 when no slot is set (*out untouched). */
int sim_heap_slot_pop(sim_heap_slot *h, sim_heap_event *out);

/* Free the arrays; h must be set up again (sim_heap_slot_init) before reuse. */
void sim_heap_slot_free(sim_heap_slot *h);

// --- finish steps (per decode worker)

typedef struct {
    int64_t step;   /* worker step after which the sequence has all its tokens */
    int req;
    uint32_t epoch; /* the request's epoch when it joined; a mismatch = it left */
} sim_heap_fin_entry;

typedef struct {
    sim_heap_fin_entry *v;
    int n, cap;
    int ext; /* v is a buffer the caller lent (cap entries): copied out when outgrown, never
              * freed here */
} sim_heap_fin;

/* Add e. */
void sim_heap_fin_push(sim_heap_fin *h, sim_heap_fin_entry e);

/* Remove and return the entry with the smallest step, then the smallest req. h must not
 * be empty (ASSERT). */
sim_heap_fin_entry sim_heap_fin_pop(sim_heap_fin *h);

/* Free the array; h is empty (and reusable) afterwards. */
void sim_heap_fin_free(sim_heap_fin *h);

#endif
