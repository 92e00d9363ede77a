/*
 * sim_ivec: a growable array of ints (tidepool-sim's batches, arrival lists and stacks).
 * A plain struct: zero-initialized is empty; v[0..n) are the elements, which callers read,
 * write and truncate (n = 0 empties it, v[--n] pops the last). Growth doubles; allocation
 * failure ends the simulator (sim_mem.h). v may start as a buffer the caller lends (cap its
 * size, ext = 1): it is copied to an allocation of its own when it outgrows it, and never
 * freed. Not thread-safe.
 */
#ifndef TP_SIM_IVEC_H
#define TP_SIM_IVEC_H

typedef struct {
    int *v;
    int n, cap;
    int ext; /* v is the caller's buffer (not freed here) */
} sim_ivec;

/* Append x. */
void sim_ivec_push(sim_ivec *a, int x);

/* Free the array; a is empty (and reusable) afterwards. */
void sim_ivec_free(sim_ivec *a);

#endif
