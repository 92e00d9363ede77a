/*
 * sim_rng: the random numbers of tidepool-sim, xoshiro256** seeded by splitmix64 (Vigna's
 * reference algorithms), so a seed gives the same sequence on every platform and every
 * run of the simulator is reproducible. A generator is a plain value (copy it to fork the
 * sequence); not thread-safe.
 */
#ifndef TP_SIM_RNG_H
#define TP_SIM_RNG_H

#include <stdint.h>

typedef struct {
    uint64_t s[4]; /* state; set by sim_rng_seed */
} sim_rng;

/* Seed r: its four state words are four successive splitmix64 outputs from seed. */
void sim_rng_seed(sim_rng *r, uint64_t seed);

/* The next 64 random bits. */
uint64_t sim_rng_next(sim_rng *r);

/* Uniform in [0, 1), with 53 random bits. */
double sim_rng_uniform(sim_rng *r);

/* Uniform integer in [lo, hi] (lo <= hi; by modulo, whose bias is negligible for the
 * small ranges the simulator draws). */
int sim_rng_range(sim_rng *r, int lo, int hi);

#endif
