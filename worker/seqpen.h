/*
 * seqpen: one sequence's sampling controls (docs/protocol.md "Sampling controls"): the
 * request's logit processors (proto_sampling: presence, frequency and repetition penalties,
 * logit_bias, min_tokens, stop_token_ids) and the sequence's token ids so far (prompt, then
 * generated), which the penalties count. Applied to the logits before every sample
 * (sampler_penalize), so a greedy request is penalised too; everything is derived from the
 * ids, so a retry (PREFILL carries prompt + generated) or a migration (KV_BEGIN carries
 * them) continues exactly where the last attempt stopped.
 *
 * Allocated once per request (the ids at capacity: no allocation per step); owned by the
 * request (preq, dreq), moved with it on a local hand-off. Loop thread only.
 */
#ifndef TP_WORKER_SEQPEN_H
#define TP_WORKER_SEQPEN_H

#include "protocol.h"
#include "sampler.h"

typedef struct seqpen seqpen_t;

/* The state of a sequence whose ids so far are ids (n_ids: prompt, then n_gen generated,
 * the last n_gen), with room for cap ids in all (cap >= n_ids; the prompt plus max_tokens).
 * ps and ids are copied. eos_id: the model's EOS. NULL on out of memory or bad counts. */
seqpen_t *seqpen_new(const proto_sampling *ps, const int *ids, int n_ids, int n_gen, int cap,
                     int eos_id);
void seqpen_destroy(seqpen_t **p);

/* Append a generated token (past cap: dropped and -1; else 0). */
int seqpen_push(seqpen_t *p, int token);

/* Apply the controls to logits (vocab floats, in place) before the next token is sampled,
 * with s's scratch (sampler_penalize). Never allocates. */
void seqpen_apply(const seqpen_t *p, sampler_t *s, float *logits);

/* 1 if token ends the request as one of its stop_token_ids (EOS is the caller's), else 0. */
int seqpen_is_stop(const seqpen_t *p, int token);

/* The controls, for KV_BEGIN: a copy in *out with n_gen set to the generated ids among the
 * first n_ids - drop ids, and those ids in *ids / *n_ids (borrowed, valid until the next
 * push): drop = 1 leaves out the last id, the one KV_END carries (a migration). */
void seqpen_export(const seqpen_t *p, int drop, proto_sampling *out, const int **ids,
                   int *n_ids);

#endif
