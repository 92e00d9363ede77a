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

/* The logit processors of one sequence, applied by sampler_penalize before sampling
 * (greedy too), in vLLM's order: logit_bias, the min_tokens mask, then the penalties.
 * Arrays are borrowed for the call. Every member zero (repetition 0 or 1) = nothing. */
typedef struct {
    float presence;    /* OpenAI's: logit[j] -= presence * (c[j] > 0), c = counts of j among
                        * the generated tokens; [-2, 2] */
    float frequency;   /* OpenAI's: logit[j] -= frequency * c[j]; [-2, 2] */
    float repetition;  /* vLLM's (CTRL's): every j in the prompt or the generated tokens:
                        * logit / repetition when > 0, else logit * repetition; > 0, 1 (or
                        * 0) = off */
    int min_tokens;    /* while fewer tokens were generated, eos_id and stop_ids get -inf */
    int ignore_eos;    /* 1: eos_id gets -inf always (vLLM's ignore_eos; stop_ids still stop) */
    int eos_id;        /* the model's EOS (-1: none) */
    const int *bias_ids; /* (n_bias,) token ids, each in [0, vocab) */
    const float *bias;   /* (n_bias,) added to their logits (OpenAI's logit_bias) */
    int n_bias;
    const int *stop_ids; /* (n_stop,) stop_token_ids: masked like EOS below min_tokens */
    int n_stop;
} sampler_penalties;

/* Scratch for one thread, for a vocabulary of vocab_size. NULL on out of memory. */
sampler_t *sampler_new(int vocab_size);
void sampler_destroy(sampler_t **s);

/* Apply pen to logits (vocab_size floats, in place) for a sequence whose tokens so far are
 * hist (n_hist ids: the prompt, then its n_gen generated tokens, the last n_gen of hist;
 * ids outside [0, vocab) are ignored). Uses the sampler's scratch counts (one thread);
 * O(n_hist + n_bias + n_stop), never allocates. Deterministic: the same hist gives the
 * same logits, so a retry or a migration that carries the tokens reproduces it. */
void sampler_penalize(sampler_t *s, const sampler_penalties *pen, const int *hist, int n_hist,
                      int n_gen, float *logits);

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

#define SAMPLER_MAX_TOP_LOGPROBS 20 /* alternatives sampler_logprobs reports at most */

/* Log-probabilities of one position (OpenAI's logprobs): log-softmax of the raw logits. */
typedef struct {
    float logprob;                                /* of the emitted token */
    int n_top;                                    /* alternatives below */
    int top_ids[SAMPLER_MAX_TOP_LOGPROBS];        /* most likely first; ties: lower id */
    float top_logprobs[SAMPLER_MAX_TOP_LOGPROBS];
} sampler_logprob;

/* Log-softmax of logits (vocab_size floats, read only: call it before any sampling
 * transform or penalty) at token, and the n_top (clamped to [0, SAMPLER_MAX_TOP_LOGPROBS])
 * most likely tokens, into *out. The normaliser is summed in double, so the values match a
 * reference log-softmax to about 1e-6. O(vocab x n_top) at worst; never allocates. */
void sampler_logprobs(const float *logits, int vocab_size, int token, int n_top,
                      sampler_logprob *out);

/* One uniform draw in [0, 1) from the sequence's random state (the generator
 * sampler_sample uses; 24-bit resolution), advancing *rng. */
float sampler_uniform(uint64_t *rng);

#endif
