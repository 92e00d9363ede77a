/*
 * sampler: next-token choice from logits: greedy (temperature 0), or temperature, top-k and
 * top-p (nucleus) sampling driven by a per-sequence 64-bit random state, so that the same
 * seed gives the same tokens and the state can travel with a sequence between processes
 * (it is sent with the KV hand-off). Order as in llama2.c/vLLM: temperature, top-k,
 * softmax, top-p, draw.
 */
#ifndef TP_SAMPLER_H
#define TP_SAMPLER_H

#include <stdint.h>

typedef struct sampler sampler_t;

/* A temperature below this is greedy (as vLLM's _SAMPLING_EPS): dividing logits by a
 * denormal temperature would overflow them to inf and sample garbage. */
#define SAMPLER_GREEDY_EPS 1e-5f

typedef struct {
    float temperature; /* 0 = greedy; > 0 scales logits */
    float top_p;       /* [0, 1]; 1 = off; 0 (or a value that underflowed to 0) keeps
                        * only the most likely token */
    int top_k;         /* 0 = off */
} sampler_params;

/* Scratch for one thread, for a vocabulary of vocab_size. NULL on out of memory. */
sampler_t *sampler_new(int vocab_size);
void sampler_destroy(sampler_t **s);

/* Initial random state for a seed (splitmix64 of the seed; never 0). */
uint64_t sampler_seed_state(uint64_t seed);

/* Pick a token from logits (vocab_size floats; modified in place). *rng is the
 * sequence's random state, advanced by one draw when temperature > 0 and left unchanged
 * for greedy. Greedy ties go to the lowest id. Never allocates. */
int sampler_sample(sampler_t *s, const sampler_params *p, uint64_t *rng, float *logits);

/* The distribution sampler_sample draws from, for p->temperature > 0: probs (vocab_size
 * floats) gets the probability of every token after temperature, top-k, softmax and top-p
 * (0 outside the kept set; the kept ones sum to 1). logits is modified in place. For
 * greedy params it is one-hot at the argmax. Never allocates; does not draw. */
void sampler_probs(sampler_t *s, const sampler_params *p, float *logits, float *probs);

/* One uniform draw in [0, 1) from the sequence's random state (the generator
 * sampler_sample uses; 24-bit resolution), advancing *rng. */
float sampler_uniform(uint64_t *rng);

#endif
