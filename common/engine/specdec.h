/*
 * specdec: speculative decoding with MTP drafts (docs/mtp.md): the accept/reject rule, the
 * per-sequence module state, the batched draft-and-verify step, the prefill-side module
 * pass, and the depth controller.
 *
 * One step for a batch of sequences, each at main-cache length n with last token t_n:
 * module 1 catches up on the positions the main model added since its last run and drafts
 * d1 at n-1; module 2 catches up (rewriting its provisional entry unless the d1 it was
 * drafted from was accepted) and drafts d2 at n-1 from (h_1[n-1], d1), both drafts over
 * the modules' draft vocabulary (mtp.h: a frequency-ranked subset, FR-Spec); one model_forward verifies [t_n, d1, d2] at n..n+2 for every sequence
 * with logits_all; the accepted prefix plus one token from the main model is emitted and
 * the main cache length is rolled back to n + 1 + accepted (blocks kept: the worst-case
 * reservation stays). Each of the three passes is one batched call over all sequences.
 *
 * Greedy (temperature 0): drafts are the modules' argmax; a draft is accepted when it equals
 * the main model's argmax, so the output is exactly plain greedy decoding (the forward pass
 * is batch invariant). Sampling: drafts are drawn from the modules' distributions q under
 * the request's sampler params, accepted with probability min(1, p(d)/q(d)) where p is the
 * main model's distribution (sampler_probs); on rejection the token is drawn from
 * norm(max(0, p - q)); when every draft is accepted a bonus token is drawn from p
 * (Leviathan et al. 2023; Chen et al. 2023), so the output distribution is the main
 * model's. All draws use the sequence's rng. A step at depth 0 is exactly the plain decode
 * step (one sampler_sample draw).
 *
 * Module catch-up can wait: a sequence that drafts nothing this step keeps the new
 * positions' hidden states (up to SPECDEC_HIST of them) and the modules run over them
 * later in one batched pass, so a depth-0 step costs what a plain step costs.
 *
 * Memory: every buffer is allocated by specdec_new(); steps never allocate. Not
 * thread-safe: one owner thread (the one running the model context).
 */
#ifndef TP_SPECDEC_H
#define TP_SPECDEC_H

#include <stdint.h>

#include "kvcache.h"
#include "model.h"
#include "mtp.h"
#include "sampler.h"

#define SPECDEC_MAX_DEPTH MTP_MAX_MODULES /* drafts per step at most */
#define SPECDEC_HIST 16                   /* positions whose module catch-up may be deferred */

// --- the accept/reject rule (pure; scratch from the caller)

/* Draft one token from a module's logits (vocab floats, modified): greedy params give the
 * argmax (q untouched, may be NULL); otherwise q (vocab floats, out) is the distribution
 * under sp (sampler_probs) and the draft is drawn from it with one draw of *rng. */
int specdec_draft(sampler_t *s, int vocab, const sampler_params *sp, uint64_t *rng, float *logits,
                  float *q);

/* Verify depth drafts (0..SPECDEC_MAX_DEPTH) against the main model's logits at the
 * positions n..n+depth, target (depth + 1, vocab), modified. q (depth, vocab): the
 * drafts' distributions from specdec_draft (unused for greedy params). scratch: vocab
 * floats. Writes the emitted tokens to out (1 + accepted of them) and the accepted draft
 * count to *n_accepted; returns the number of tokens written. */
int specdec_accept(sampler_t *s, int vocab, const sampler_params *sp, uint64_t *rng,
                   const int *drafts, const float *q, int depth, float *target, float *scratch,
                   int *out, int *n_accepted);

/* The same rule for drafts that are the modules' argmax (q one-hot at d): the token at
 * each position is drawn from p exactly as sampler_sample draws it (one draw of *rng per
 * emitted token, in order) and a draft is accepted when it equals that token, i.e. with
 * probability p(d) = min(1, p(d)/q(d)); a rejection emits the drawn token, distributed as
 * norm(max(0, p - q)). So the emitted tokens are those plain decoding draws with the same
 * rng, whatever the depth. Same arguments as specdec_accept (no q, no scratch). */
int specdec_accept_onehot(sampler_t *s, int vocab, const sampler_params *sp, uint64_t *rng,
                          const int *drafts, int depth, float *target, int *out, int *n_accepted);

// --- the step

typedef struct specdec specdec_t;

/* How sampled (temperature > 0) sequences draft and verify; greedy ones are exact either
 * way. */
typedef enum {
    SPECDEC_SAMPLE_REJECTION = 0, /* drafts drawn from the modules' q, specdec_accept */
    SPECDEC_SAMPLE_ONEHOT,        /* argmax drafts, specdec_accept_onehot: seeded output
                                   * identical to plain decoding at any depth */
} specdec_sampling;

/* State and scratch for model m with modules mt (borrowed; NULL: plain decoding only) for
 * sequences with kvcache ids < max_seqs, at most max_items sequences per step and
 * prefill passes of at most max_prefill_tokens tokens. NULL on bad params or out of
 * memory. */
specdec_t *specdec_new(const model_t *m, const mtp_t *mt, int max_seqs, int max_items,
                       int max_prefill_tokens);
void specdec_destroy(specdec_t **sd);
/* Default SPECDEC_SAMPLE_REJECTION. */
void specdec_set_sampling(specdec_t *sd, specdec_sampling mode);

/* Where specdec_step's wall time goes, summed over the steps since profiling was turned on
 * (for benchmarks; off by default, when the step reads no clock): milliseconds from the
 * step's start through the module 1 pass (the checks and the batch set-up included), then
 * d1's draft and the module 2 pass, then d2's draft and the verify pass, then the rest
 * (accept rule, KV rollback, state copies); steps counted (calls, not sequences). */
typedef struct {
    double mod1_ms, mod2_ms, verify_ms, rest_ms;
    long steps;
} specdec_profile;
/* on != 0: start profiling from zero; 0: stop (the figures are kept). */
void specdec_set_profiling(specdec_t *sd, int on);
/* The figures so far into *out. */
void specdec_get_profile(const specdec_t *sd, specdec_profile *out);

/* Floats of the hand-off state a prefill leaves for the first decode step: h_0 at the
 * prompt's last position and h_1 (module 1's output) one position before, 2 * dim. */
int specdec_hand_floats(const specdec_t *sd);

/* Prefill side: after model_forward ran prompt positions [pos, pos + n_tokens) of a
 * sequence with hidden_all (h0 = those rows, (n_tokens, dim)), run module 1 at the
 * positions < n_prompt - 1 and module 2 at those < n_prompt - 2 (all their inputs are
 * prompt tokens), batched over the items, so the modules' caches hold the prompt; and
 * fill the rows of hand ((2, dim), zeros for a row before position 0) that this chunk
 * holds. depth: modules to run, 1 or 2 (items with 0 are skipped). The chunks of one
 * prompt must come in order. Returns 0, or -1 on invalid arguments. */
typedef struct {
    int seq;
    int pos, n_tokens;
    const int *prompt; /* (n_prompt,) the whole prompt */
    int n_prompt;
    const float *h0;
    int depth;
    float *hand;
} specdec_prefill_item;
int specdec_prefill(specdec_t *sd, model_ctx_t *ctx, kvcache_t *kv, const specdec_prefill_item *it,
                    int n);

/* Start decoding sequence seq whose main cache holds n_prompt tokens and whose next token is
 * first: hand is the hand-off state of specdec_prefill (or of the transfer); max_depth is
 * the most drafts its steps may ask for (0: no module work at all, plain decoding; capped
 * at the modules loaded). With hand NULL the sequence decodes plainly. */
void specdec_seq_start(specdec_t *sd, int seq, int n_prompt, int first, const float *hand,
                       int max_depth);
/* Live migration (docs/mtp.md "Migration"): the whole per-sequence module state as
 * specdec_state_floats() floats, so that another worker with the same modules continues
 * drafting where this one stopped. Layout: c1, n_rows (exact small integers), the tokens
 * t_{c1+1} .. t_n (n_rows used of SPECDEC_HIST + MAX_DEPTH + 1 slots), h_1[c1 - 1] (dim),
 * then h_0[c1 .. n-1] (n_rows of the same number of rows, dim each); unused slots are 0.
 * The modules' KV (cache layers n_layer ..) must travel with it, for every position < n. */
int specdec_state_floats(const specdec_t *sd);
/* Write seq's state (main cache length pos) into out (specdec_state_floats() floats).
 * Returns 0, or -1 when seq has no module state (it decodes plainly) or is out of step
 * with pos. */
int specdec_seq_export(const specdec_t *sd, int seq, int pos, float *out);
/* Start seq (main cache length pos, module KV already in the cache) from a state written by
 * specdec_seq_export on another worker, drafting at most max_depth. Returns 0, or -1 when
 * the state is not consistent with pos (then seq decodes plainly: never trusted). */
int specdec_seq_import(specdec_t *sd, int seq, int pos, const float *state, int max_depth);
/* The most drafts seq can make (0 when it decodes plainly). */
int specdec_seq_max_depth(const specdec_t *sd, int seq);

/* One sequence of a step. */
typedef struct {
    int seq;
    int pos;   /* tokens in the main cache (n); capacity needed for pos + depth + 1 */
    int last;  /* t_n, the token to feed */
    int depth; /* drafts wanted (capped at the sequence's max depth); 0 = plain step */
    const sampler_params *sp;
    uint64_t *rng;
    /* optional (NULL = none): the sequence's logit processors (penalties, logit_bias,
     * min_tokens), called on the verifier's logits (vocab floats, in place) with the step's
     * sampler before the token is sampled; such an item must have depth 0 (the drafts'
     * acceptance would not see them) and is stepped at depth 0 */
    void (*penalize)(void *ud, sampler_t *s, float *logits);
    void *penalize_ud;
    /* log-probabilities: 0 = none; k + 1 = lps[j] gets emitted token j's (sampler_logprobs
     * with k alternatives, k <= SAMPLER_MAX_TOP_LOGPROBS) from the raw verify logits of its
     * position, before penalties and sampling: per position at any depth */
    int n_logprobs;
    sampler_logprob lps[SPECDEC_MAX_DEPTH + 1]; /* out */
    /* out */
    int tokens[SPECDEC_MAX_DEPTH + 1]; /* emitted: accepted drafts, then the main model's */
    int n_tokens;                      /* 1 + n_accepted */
    int n_drafted;                     /* drafts verified */
    int n_accepted;
} specdec_item;

/* Run one draft-and-verify step over n sequences (three batched passes at most: module 1,
 * module 2, verify). On return each sequence's main-cache length is pos + n_tokens. The
 * caller may end a sequence after any of its emitted tokens (EOS, max_tokens). Returns 0,
 * or -1 on invalid arguments or a failed forward pass (then no state is updated and the
 * sequences should be ended). */
int specdec_step(specdec_t *sd, model_ctx_t *ctx, kvcache_t *kv, specdec_item *items, int n);

// --- depth control

#define SPECDEC_COST_POINTS 8

/* Cost of a step at each depth relative to a plain decode step, at a few batch sizes and
 * two context lengths (measured by specdec_measure_costs). The ratio grows with the
 * context: a depth-2 step computes the attention of 3 verify tokens and of the modules'
 * catch-up positions where a plain step computes one token's (stories260K at batch 1:
 * x1.9 at context 16, x2.4 at 100, x2.8 at 250). */
typedef struct {
    int n;
    int batch[SPECDEC_COST_POINTS];                           /* ascending */
    double ratio[SPECDEC_COST_POINTS][SPECDEC_MAX_DEPTH + 1]; /* at ctx_short; [.][0] = 1 */
    double plain_ms[SPECDEC_COST_POINTS];                     /* plain step, milliseconds */
    int ctx_short;                                            /* tokens in the cache */
    int ctx_long;                                             /* 0: not measured */
    int has_long[SPECDEC_COST_POINTS];
    double ratio_long[SPECDEC_COST_POINTS][SPECDEC_MAX_DEPTH + 1]; /* at ctx_long */
    double plain_ms_long[SPECDEC_COST_POINTS];
} specdec_costs;

/* Time plain steps and steps at depths 1..max on b sequences of a random 16-token prompt,
 * for b = 1, 2, 4, ... up to max_batch (within the cache's free blocks; a batch size whose
 * plain step takes more than max_step_ms is not measured: larger batches use the last
 * measured ratios): 5 rounds of one step at each depth (after an untimed round), the
 * fastest step of each depth. Then, for b <= SPECDEC_COST_LONG_MAX_BATCH (where drafting
 * pays at all; it keeps the worker's start-up short), the same with the sequences' length
 * set to a long context, SPECDEC_COST_CTX_LONG tokens or less to fit n_ctx (the KV content
 * does not change the time; skipped when the cache space is short). Uses and frees its
 * own sequences. Returns 0, or -1 when nothing could be measured (no modules, no space). */
#define SPECDEC_COST_CTX_LONG 384
#define SPECDEC_COST_LONG_MAX_BATCH 4
int specdec_measure_costs(specdec_t *sd, model_ctx_t *ctx, kvcache_t *kv, int max_batch,
                          double max_step_ms, specdec_costs *out);
/* The ratio at batch size b (interpolated; the nearest point outside the range), at the
 * short context. */
double specdec_cost(const specdec_costs *c, int b, int depth);
/* The ratio at batch size b for sequences of ctx tokens: linear in ctx between the short
 * and the long context's ratio (clamped to them outside; the short one when the long one
 * was not measured). ctx < 0: the short context's. */
double specdec_cost_at(const specdec_costs *c, int b, int ctx, int depth);

/* The controller, one per sequence: EWMAs of its per-position acceptance a1 = P(d1
 * accepted) and a2 = P(d2 accepted | d1 accepted), starting from a prior (the trainer's
 * figures); expected tokens per step E_0 = 1, E_1 = 1 + a1, E_2 = 1 + a1 + a1 * a2; in a
 * step of b sequences it picks the depth with the largest E_d / cost(b, d), changing only
 * for a gain of more than SPECDEC_HYSTERESIS; below max_depth it probes at max_depth one
 * step in SPECDEC_PROBE_STEPS so the EWMAs stay current. Per sequence, so that a
 * sequence's depths depend only on its own tokens and the batch sizes it ran in (a seeded
 * request decoded alone is reproducible), and a hard request (high temperature) does not
 * lower the depth of easy ones. */
#define SPECDEC_EWMA_ALPHA 0.1  /* weight of one step's observation */
#define SPECDEC_HYSTERESIS 0.05 /* relative gain needed to change depth */
#define SPECDEC_PROBE_STEPS 16
typedef struct {
    int max_depth;
    double acc[2];
    int depth;
    int probe_in;
} specdec_ctl;

void specdec_ctl_init(specdec_ctl *c, int max_depth, const float prior[2]);
/* Depth for this sequence in a step of b sequences with step costs costs (NULL or n = 0:
 * no measurement, cost(d) = 1 + 0.1 d is assumed); advances the probe countdown. Costs at
 * the short context (specdec_ctl_depth_at with ctx -1). */
int specdec_ctl_depth(specdec_ctl *c, const specdec_costs *costs, int b);
/* The same for a sequence of ctx tokens (specdec_cost_at). */
int specdec_ctl_depth_at(specdec_ctl *c, const specdec_costs *costs, int b, int ctx);
/* One step's outcome for the sequence: drafts verified and accepted. */
void specdec_ctl_observe(specdec_ctl *c, int n_drafted, int n_accepted);
/* E_d with the current EWMAs. */
double specdec_ctl_expected(const specdec_ctl *c, int depth);

#endif
