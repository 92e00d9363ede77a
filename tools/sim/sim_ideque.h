/*
 * sim_ideque: a double-ended queue of ints in a ring buffer (tidepool-sim's request
 * queues): push at either end, read and pop at the front, all O(1) amortized. A plain
 * struct: zero-initialized is empty; n is the number of elements (read-only for callers).
 * Growth doubles and unrolls the ring; allocation failure ends the simulator (sim_mem.h).
 * Not thread-safe.
 */
#ifndef TP_SIM_IDEQUE_H
#define TP_SIM_IDEQUE_H

#include <stddef.h>

typedef struct {
    int *v;
    size_t head, n, cap; /* the front is v[head]; elements wrap around cap */
} sim_ideque;

/* Add x at the back. */
void sim_ideque_push_back(sim_ideque *d, int x);

/* Add x at the front (it becomes sim_ideque_front). */
void sim_ideque_push_front(sim_ideque *d, int x);

/* The front element; d must not be empty (ASSERT). */
int sim_ideque_front(const sim_ideque *d);

/* Remove and return the front element; d must not be empty (ASSERT). */
int sim_ideque_pop_front(sim_ideque *d);

/* Free the buffer; d is empty (and reusable) afterwards. */
void sim_ideque_free(sim_ideque *d);

#endif
