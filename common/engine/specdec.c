/*
 * specdec: see specdec.h.
 *
 * Per-sequence state (slot = kvcache sequence id), for a sequence at main-cache length n:
 * c1 = the first position missing from module 1's cache (module 2's cache holds real-token
 * entries for [0, c1 - 1)); the hidden states h_0[c1 .. n-1] (n_rows = n - c1 rows, from
 * the verify passes); the tokens t_{c1+1} .. t_n; and h_1[c1 - 1], module 1's output at the
 * position before c1. A step that runs the modules feeds module 1 positions c1 .. n-1
 * (tokens t_{c1+1} .. t_n: all real) and module 2 positions c2 .. n-1 (tokens
 * t_{c2+2} .. t_n, then the draft d1 at n-1; the entry at n-1 is provisional: the next run
 * rewrites it (c2 = c1 - 1) unless d1 was accepted, when it already equals the real one
 * (c2 = c1; c2 is not part of the migrated state: an imported sequence rewrites, which is
 * always exact). Both are contiguous runs, so each is one batch item. After the step,
 * c1 = n and the rows are the verify pass's h_0 at the accepted positions n .. n + accepted.
 * Drafts come from the modules' draft vocabulary (mtp_forward_draft, mtp.h).
 */
#include "specdec.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ROWS (SPECDEC_HIST + SPECDEC_MAX_DEPTH + 1) /* h_0 rows a sequence can hold */
#define VT (SPECDEC_MAX_DEPTH + 1)                  /* tokens verified per sequence */

typedef struct {
    int active;
    int max_depth; /* 0: plain decoding, no module state */
    int c1;
    int c2; /* first position of module 2's cache not computed from real tokens: c1 - 1,
             * or c1 when the provisional entry at c1 - 1 was drafted from a d1 that was
             * then accepted (it equals the real one: no rewrite); 0 when c1 = 0 */
    int n_rows;
    int toks[ROWS]; /* t_{c1+1} .. t_n */
    float *h0;      /* (ROWS, dim) h_0[c1 .. n-1] */
    float *h1prev;  /* (dim,) h_1[c1 - 1] */
} sd_seq;

struct specdec {
    const model_t *m;
    const mtp_t *mt;
    int dim, vocab, n_mod, max_seqs, max_items, max_prefill;
    specdec_sampling sampling;
    sampler_t *sampler;
    sd_seq *seqs;
    float *seq_mem; /* (max_seqs, ROWS + 1, dim) */
    /* step scratch, per item */
    model_seq_batch *b1, *b2, *bv;
    float *h2in;    /* (max_items, ROWS + 1, dim): [h_1[c1-1]] h_1[c1 .. n-1] */
    int *tok2;      /* (max_items, ROWS + 1) */
    float *dl;      /* (max_items, MAX_DEPTH, vocab) draft logits */
    float *q;       /* (max_items, MAX_DEPTH, vocab) draft distributions */
    float *vl;      /* (max_items, VT, vocab) verify logits */
    float *vh;      /* (max_items, VT, dim) verify hidden states */
    int *vt;        /* (max_items, VT) verify tokens */
    int *depth;     /* (max_items,) depth used */
    int *run;       /* (max_items,) modules run this step */
    float *scratch; /* (vocab,) */
    float *lpraw;   /* (VT, vocab): one item's raw verify logits, for its log-probabilities */
    /* prefill scratch */
    float *ph0, *ph1;    /* (max_prefill, dim) */
    model_seq_batch *pb; /* (max_items,) */
    int *pidx;           /* (max_items,) */
    int profiling;
    specdec_profile prof;
};

// --- the rule

static int argmax_f(const float *x, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

/* Draw from non-negative weights w (n) summing to total, with one draw of *rng. */
static int draw(const float *w, int n, float total, uint64_t *rng)
{
    float r = sampler_uniform(rng) * total, cdf = 0.0f;
    int last = -1;
    for (int i = 0; i < n; i++) {
        if (w[i] <= 0.0f)
            continue;
        cdf += w[i];
        last = i;
        if (r < cdf)
            return i;
    }
    return last >= 0 ? last : argmax_f(w, n); /* rounding */
}

static int is_greedy(const sampler_params *sp)
{
    return !(sp->temperature > 0.0f);
}

int specdec_draft(sampler_t *s, int vocab, const sampler_params *sp, uint64_t *rng, float *logits,
                  float *q)
{
    if (is_greedy(sp))
        return argmax_f(logits, vocab);
    sampler_probs(s, sp, logits, q);
    float total = 0.0f;
    for (int i = 0; i < vocab; i++)
        total += q[i];
    return draw(q, vocab, total, rng);
}

int specdec_accept(sampler_t *s, int vocab, const sampler_params *sp, uint64_t *rng,
                   const int *drafts, const float *q, int depth, float *target, float *scratch,
                   int *out, int *n_accepted)
{
    if (is_greedy(sp)) {
        for (int j = 0; j < depth; j++) {
            int g = argmax_f(target + (size_t)j * vocab, vocab);
            out[j] = g;
            if (g != drafts[j]) {
                *n_accepted = j;
                return j + 1;
            }
        }
        out[depth] = argmax_f(target + (size_t)depth * vocab, vocab);
        *n_accepted = depth;
        return depth + 1;
    }
    float *p = scratch;
    for (int j = 0; j < depth; j++) {
        const float *qj = q + (size_t)j * vocab;
        int d = drafts[j];
        sampler_probs(s, sp, target + (size_t)j * vocab, p);
        /* accept with probability min(1, p(d) / q(d)) */
        if (sampler_uniform(rng) * qj[d] < p[d]) {
            out[j] = d;
            continue;
        }
        /* rejected: draw from norm(max(0, p - q)) */
        float total = 0.0f;
        for (int i = 0; i < vocab; i++) {
            float r = p[i] - qj[i];
            total += r > 0.0f ? r : 0.0f;
        }
        if (total > 0.0f) {
            for (int i = 0; i < vocab; i++) {
                float r = p[i] - qj[i];
                p[i] = r > 0.0f ? r : 0.0f;
            }
            out[j] = draw(p, vocab, total, rng);
        } else { /* p == q up to rounding: the residual is empty, p itself is right */
            float sum = 0.0f;
            for (int i = 0; i < vocab; i++)
                sum += p[i];
            out[j] = draw(p, vocab, sum, rng);
        }
        *n_accepted = j;
        return j + 1;
    }
    out[depth] = sampler_sample(s, sp, rng, target + (size_t)depth * vocab);
    *n_accepted = depth;
    return depth + 1;
}

int specdec_accept_onehot(sampler_t *s, int vocab, const sampler_params *sp, uint64_t *rng,
                          const int *drafts, int depth, float *target, int *out, int *n_accepted)
{
    for (int j = 0; j <= depth; j++) {
        out[j] = sampler_sample(s, sp, rng, target + (size_t)j * vocab);
        if (j == depth || out[j] != drafts[j]) {
            *n_accepted = j;
            return j + 1;
        }
    }
    return 0; /* not reached */
}

// --- state

specdec_t *specdec_new(const model_t *m, const mtp_t *mt, int max_seqs, int max_items,
                       int max_prefill_tokens)
{
    if (!m || max_seqs < 1 || max_items < 1 || max_prefill_tokens < 1)
        return NULL;
    const model_config *c = model_get_config(m);
    specdec_t *sd = calloc(1, sizeof(*sd));
    if (!sd)
        return NULL;
    sd->m = m;
    sd->mt = mt;
    sd->dim = c->dim;
    sd->vocab = c->vocab_size;
    sd->n_mod = mt ? mtp_n_modules(mt) : 0;
    sd->max_seqs = max_seqs;
    sd->max_items = max_items;
    sd->max_prefill = max_prefill_tokens;
    size_t D = (size_t)c->dim, V = (size_t)c->vocab_size, I = (size_t)max_items;
    sd->sampler = sampler_new(c->vocab_size);
    sd->seqs = calloc((size_t)max_seqs, sizeof(sd_seq));
    sd->b1 = calloc(I, sizeof(model_seq_batch));
    sd->b2 = calloc(I, sizeof(model_seq_batch));
    sd->bv = calloc(I, sizeof(model_seq_batch));
    sd->vl = malloc(I * VT * V * sizeof(float));
    sd->vt = calloc(I * VT, sizeof(int));
    sd->depth = calloc(I, sizeof(int));
    sd->run = calloc(I, sizeof(int));
    sd->scratch = malloc(V * sizeof(float));
    sd->lpraw = malloc(VT * V * sizeof(float));
    sd->pb = calloc(I, sizeof(model_seq_batch));
    sd->pidx = calloc(I, sizeof(int));
    int ok = sd->sampler && sd->seqs && sd->b1 && sd->b2 && sd->bv && sd->vl && sd->vt &&
             sd->depth && sd->run && sd->scratch && sd->lpraw && sd->pb && sd->pidx;
    if (ok && mt) { /* module state and scratch only with modules */
        sd->seq_mem = calloc((size_t)max_seqs * (ROWS + 1) * D, sizeof(float));
        sd->h2in = malloc(I * (ROWS + 1) * D * sizeof(float));
        sd->tok2 = calloc(I * (ROWS + 1), sizeof(int));
        sd->dl = malloc(I * SPECDEC_MAX_DEPTH * V * sizeof(float));
        sd->q = malloc(I * SPECDEC_MAX_DEPTH * V * sizeof(float));
        sd->vh = malloc(I * VT * D * sizeof(float));
        sd->ph0 = malloc((size_t)max_prefill_tokens * D * sizeof(float));
        sd->ph1 = malloc((size_t)max_prefill_tokens * D * sizeof(float));
        ok = sd->seq_mem && sd->h2in && sd->tok2 && sd->dl && sd->q && sd->vh && sd->ph0 && sd->ph1;
        for (int s = 0; ok && s < max_seqs; s++) {
            sd->seqs[s].h0 = sd->seq_mem + (size_t)s * (ROWS + 1) * D;
            sd->seqs[s].h1prev = sd->seqs[s].h0 + (size_t)ROWS * D;
        }
    }
    if (!ok)
        specdec_destroy(&sd);
    return sd;
}

void specdec_destroy(specdec_t **sp)
{
    if (!sp || !*sp)
        return;
    specdec_t *sd = *sp;
    sampler_destroy(&sd->sampler);
    free(sd->seqs);
    free(sd->seq_mem);
    free(sd->b1);
    free(sd->b2);
    free(sd->bv);
    free(sd->h2in);
    free(sd->tok2);
    free(sd->dl);
    free(sd->q);
    free(sd->vl);
    free(sd->vh);
    free(sd->vt);
    free(sd->depth);
    free(sd->run);
    free(sd->scratch);
    free(sd->lpraw);
    free(sd->ph0);
    free(sd->ph1);
    free(sd->pb);
    free(sd->pidx);
    free(sd);
    *sp = NULL;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

void specdec_set_profiling(specdec_t *sd, int on)
{
    sd->profiling = on != 0;
    if (on)
        memset(&sd->prof, 0, sizeof(sd->prof));
}

void specdec_get_profile(const specdec_t *sd, specdec_profile *out)
{
    *out = sd->prof;
}

void specdec_set_sampling(specdec_t *sd, specdec_sampling mode)
{
    sd->sampling = mode;
}

int specdec_hand_floats(const specdec_t *sd)
{
    return 2 * sd->dim;
}

void specdec_seq_start(specdec_t *sd, int seq, int n_prompt, int first, const float *hand,
                       int max_depth)
{
    if (seq < 0 || seq >= sd->max_seqs)
        return;
    sd_seq *st = &sd->seqs[seq];
    st->active = 1;
    st->max_depth = max_depth < sd->n_mod ? max_depth : sd->n_mod;
    if (!hand || n_prompt < 1 || st->max_depth < 0)
        st->max_depth = 0;
    if (st->max_depth == 0)
        return;
    st->c1 = n_prompt - 1;
    st->c2 = st->c1 >= 1 ? st->c1 - 1 : 0; /* the prefill wrote module 2 up to P - 3 */
    st->n_rows = 1;
    st->toks[0] = first;
    memcpy(st->h0, hand, (size_t)sd->dim * sizeof(float));
    memcpy(st->h1prev, hand + sd->dim, (size_t)sd->dim * sizeof(float));
}

int specdec_state_floats(const specdec_t *sd)
{
    return 2 + ROWS + (ROWS + 1) * sd->dim;
}

int specdec_seq_export(const specdec_t *sd, int seq, int pos, float *out)
{
    if (seq < 0 || seq >= sd->max_seqs)
        return -1;
    const sd_seq *st = &sd->seqs[seq];
    if (!st->active || st->max_depth == 0 || st->n_rows < 1 || st->n_rows > ROWS ||
        st->c1 + st->n_rows != pos)
        return -1;
    const size_t D = (size_t)sd->dim;
    memset(out, 0, (size_t)specdec_state_floats(sd) * sizeof(float));
    out[0] = (float)st->c1;
    out[1] = (float)st->n_rows;
    for (int i = 0; i < st->n_rows; i++)
        out[2 + i] = (float)st->toks[i];
    memcpy(out + 2 + ROWS, st->h1prev, D * sizeof(float));
    memcpy(out + 2 + ROWS + D, st->h0, (size_t)st->n_rows * D * sizeof(float));
    return 0;
}

int specdec_seq_import(specdec_t *sd, int seq, int pos, const float *state, int max_depth)
{
    if (seq < 0 || seq >= sd->max_seqs)
        return -1;
    sd_seq *st = &sd->seqs[seq];
    st->active = 1;
    st->max_depth = 0; /* plain until the state checks out */
    int md = max_depth < sd->n_mod ? max_depth : sd->n_mod;
    if (md <= 0)
        return 0; /* asked to decode plainly */
    if (!state)
        return -1;
    float c1f = state[0], nf = state[1];
    if (!(c1f >= 0 && c1f < (float)(1 << 24) && nf >= 1 && nf <= ROWS) || c1f != (float)(int)c1f ||
        nf != (float)(int)nf)
        return -1;
    int c1 = (int)c1f, n_rows = (int)nf;
    if (c1 + n_rows != pos)
        return -1;
    for (int i = 0; i < n_rows; i++) {
        float t = state[2 + i];
        if (!(t >= 0 && t < (float)sd->vocab) || t != (float)(int)t)
            return -1;
        st->toks[i] = (int)t;
    }
    const size_t D = (size_t)sd->dim;
    memcpy(st->h1prev, state + 2 + ROWS, D * sizeof(float));
    memcpy(st->h0, state + 2 + ROWS + D, (size_t)n_rows * D * sizeof(float));
    st->c1 = c1;
    st->c2 = c1 >= 1 ? c1 - 1 : 0; /* not carried: a rewrite is always exact */
    st->n_rows = n_rows;
    st->max_depth = md;
    return 0;
}

int specdec_seq_max_depth(const specdec_t *sd, int seq)
{
    if (seq < 0 || seq >= sd->max_seqs || !sd->seqs[seq].active)
        return 0;
    return sd->seqs[seq].max_depth;
}

/* Forward b[0..n) in calls of at most the context's max_tokens tokens each: module k, or
 * the main model for k = 0. Items are independent (batch invariance), so the split
 * changes no result. */
static int fwd_chunks(specdec_t *sd, model_ctx_t *ctx, kvcache_t *kv, int k, model_seq_batch *b,
                      int n)
{
    int cap = model_ctx_max_tokens(ctx);
    for (int s = 0; s < n;) {
        int e = s, tok = 0;
        while (e < n && (e == s || tok + b[e].n_tokens <= cap))
            tok += b[e++].n_tokens;
        int rc = k ? mtp_forward_draft(ctx, kv, sd->mt, k, b + s, e - s)
                   : model_forward(ctx, kv, b + s, e - s, NULL, NULL);
        if (rc != 0)
            return -1;
        s = e;
    }
    return 0;
}

// --- prefill

int specdec_prefill(specdec_t *sd, model_ctx_t *ctx, kvcache_t *kv, const specdec_prefill_item *it,
                    int n)
{
    if (!sd->mt || n < 0 || n > sd->max_items)
        return -1;
    const size_t D = (size_t)sd->dim;
    /* groups of items whose module-1 rows fit the scratch */
    for (int g0 = 0; g0 < n;) {
        int n1 = 0, n2 = 0, rows = 0, g1 = g0;
        for (; g1 < n; g1++) {
            const specdec_prefill_item *x = &it[g1];
            int P = x->n_prompt, a = x->pos, e = x->pos + x->n_tokens;
            if (x->n_tokens < 1 || a < 0 || e > P || !x->prompt || !x->h0 || !x->hand)
                return -1;
            int e1 = e < P - 1 ? e : P - 1;
            int r1 = x->depth > 0 && e1 > a ? e1 - a : 0;
            if (g1 > g0 && rows + r1 > sd->max_prefill)
                break;
            if (r1 > sd->max_prefill)
                return -1;
            if (r1) {
                sd->pb[n1] = (model_seq_batch){.seq = x->seq,
                                               .pos = a,
                                               .n_tokens = r1,
                                               .tokens = x->prompt + a + 1,
                                               .hidden = sd->ph1 + (size_t)rows * D,
                                               .hidden_all = 1,
                                               .hidden_in = x->h0};
                sd->pidx[n1++] = g1;
            }
            rows += r1;
            /* hand-off rows this chunk holds */
            if (P - 1 >= a && P - 1 < e)
                memcpy(x->hand, x->h0 + (size_t)(P - 1 - a) * D, D * sizeof(float));
            if (P == 1 && a == 0)
                memset(x->hand + D, 0, D * sizeof(float));
        }
        if (n1 && fwd_chunks(sd, ctx, kv, 1, sd->pb, n1) != 0)
            return -1;
        for (int i = 0; i < n1; i++) {
            const specdec_prefill_item *x = &it[sd->pidx[i]];
            const model_seq_batch *b = &sd->pb[i];
            int P = x->n_prompt, a = x->pos;
            if (P - 2 >= a && P - 2 < a + b->n_tokens)
                memcpy(x->hand + D, b->hidden + (size_t)(P - 2 - a) * D, D * sizeof(float));
            int e2 = x->pos + x->n_tokens < P - 2 ? x->pos + x->n_tokens : P - 2;
            if (x->depth < 2 || sd->n_mod < 2 || e2 <= a)
                continue;
            sd->b2[n2++] = (model_seq_batch){.seq = x->seq,
                                             .pos = a,
                                             .n_tokens = e2 - a,
                                             .tokens = x->prompt + a + 2,
                                             .hidden_in = b->hidden};
        }
        if (n2 && fwd_chunks(sd, ctx, kv, 2, sd->b2, n2) != 0)
            return -1;
        g0 = g1;
    }
    return 0;
}

// --- the step

/* The params drafts are drawn with: the request's, or greedy (argmax drafts, one-hot q). */
static const sampler_params *draft_params(const specdec_t *sd, const sampler_params *sp)
{
    static const sampler_params greedy = {.temperature = 0.0f, .top_p = 1.0f};
    return sd->sampling == SPECDEC_SAMPLE_ONEHOT ? &greedy : sp;
}

/* A draft from a module's logits over the draft vocabulary (mtp_forward_draft): dl holds
 * mtp_draft_vocab floats (the slot has vocab). Greedy: the argmax over the subset, mapped
 * to its token. Sampled: the subset logits are spread over the vocabulary (-inf for the
 * tokens outside it, which q then gives probability 0: the accept rule is exact for any
 * q) and drawn by specdec_draft. */
static int draft_token(specdec_t *sd, const sampler_params *sp, uint64_t *rng, float *dl, float *q)
{
    const int *map = mtp_draft_map(sd->mt);
    if (!map)
        return specdec_draft(sd->sampler, sd->vocab, sp, rng, dl, q);
    const int K = mtp_draft_vocab(sd->mt);
    if (is_greedy(sp))
        return map[argmax_f(dl, K)];
    float *tmp = sd->scratch; /* free until specdec_accept */
    memcpy(tmp, dl, (size_t)K * sizeof(float));
    for (int i = 0; i < sd->vocab; i++)
        dl[i] = -INFINITY;
    for (int j = 0; j < K; j++)
        dl[map[j]] = tmp[j];
    return specdec_draft(sd->sampler, sd->vocab, sp, rng, dl, q);
}

int specdec_step(specdec_t *sd, model_ctx_t *ctx, kvcache_t *kv, specdec_item *items, int n)
{
    if (n < 0 || n > sd->max_items)
        return -1;
    const model_config *c = model_get_config(sd->m);
    const size_t D = (size_t)sd->dim, V = (size_t)sd->vocab;
    int n1 = 0, n2 = 0;
    double pt[5] = {0};
    if (sd->profiling)
        pt[0] = now_ms();

    /* module 1: catch up over c1 .. n-1, draft at n-1 */
    for (int i = 0; i < n; i++) {
        specdec_item *x = &items[i];
        if (x->seq < 0 || x->seq >= sd->max_seqs || !kvcache_seq_active(kv, x->seq))
            return -1;
        sd_seq *st = &sd->seqs[x->seq];
        int md = st->active ? st->max_depth : 0;
        int d = x->depth < md ? x->depth : md;
        int room = kvcache_seq_capacity(kv, x->seq) - x->pos - 1;
        if (c->n_ctx - x->pos - 1 < room)
            room = c->n_ctx - x->pos - 1;
        if (d > room)
            d = room;
        if (d < 0 || x->penalize)
            d = 0; /* penalised sequences: the plain step (specdec.h) */
        if (md > 0 && st->c1 + st->n_rows != x->pos)
            return -1; /* the caller moved the sequence behind our back */
        sd->depth[i] = d;
        sd->run[i] = md > 0 && (d > 0 || st->n_rows + 1 > SPECDEC_HIST);
        x->n_drafted = d;
        if (!sd->run[i])
            continue;
        float *h2 = sd->h2in + (size_t)i * (ROWS + 1) * D;
        int off = st->c1 >= 1;
        if (off)
            memcpy(h2, st->h1prev, D * sizeof(float));
        sd->b1[n1++] = (model_seq_batch){.seq = x->seq,
                                         .pos = st->c1,
                                         .n_tokens = st->n_rows,
                                         .tokens = st->toks,
                                         .logits = d >= 1 ? sd->dl + (size_t)i * 2 * V : NULL,
                                         .hidden = h2 + (size_t)off * D,
                                         .hidden_all = 1,
                                         .hidden_in = st->h0};
    }
    if (n1 && fwd_chunks(sd, ctx, kv, 1, sd->b1, n1) != 0)
        return -1;
    if (sd->profiling)
        pt[1] = now_ms();

    /* module 2: catch up over c1-1 .. n-2 with real tokens, draft at n-1 from d1 */
    for (int i = 0; i < n; i++) {
        specdec_item *x = &items[i];
        sd_seq *st = &sd->seqs[x->seq];
        int d = sd->depth[i];
        int *vt = sd->vt + (size_t)i * VT;
        vt[0] = x->last;
        if (d >= 1)
            vt[1] = draft_token(sd, draft_params(sd, x->sp), x->rng, sd->dl + (size_t)i * 2 * V,
                                sd->q + (size_t)i * 2 * V);
        if (!sd->run[i] || st->max_depth < 2)
            continue;
        int p2 = st->c2; /* c1 - 1, or c1 when that entry is already real */
        int real = x->pos - 1 - p2, cnt = real + (d >= 2);
        if (cnt < 1)
            continue;
        int *t2 = sd->tok2 + (size_t)i * (ROWS + 1);
        for (int r = 0; r < real; r++)
            t2[r] = st->toks[p2 + r + 1 - st->c1];
        if (d >= 2)
            t2[real] = vt[1];
        /* h2in holds [h_1[c1 - 1]] h_1[c1 .. n-1] */
        int h_off = p2 - (st->c1 >= 1 ? st->c1 - 1 : 0);
        sd->b2[n2++] = (model_seq_batch){
            .seq = x->seq,
            .pos = p2,
            .n_tokens = cnt,
            .tokens = t2,
            .logits = d >= 2 ? sd->dl + ((size_t)i * 2 + 1) * V : NULL,
            .hidden_in = sd->h2in + ((size_t)i * (ROWS + 1) + (size_t)h_off) * D};
    }
    if (n2 && fwd_chunks(sd, ctx, kv, 2, sd->b2, n2) != 0)
        return -1;
    if (sd->profiling)
        pt[2] = now_ms();

    /* verify [t_n, d1, d2] in one pass for every sequence */
    for (int i = 0; i < n; i++) {
        specdec_item *x = &items[i];
        int d = sd->depth[i];
        int *vt = sd->vt + (size_t)i * VT;
        if (d >= 2)
            vt[2] = draft_token(sd, draft_params(sd, x->sp), x->rng,
                                sd->dl + ((size_t)i * 2 + 1) * V, sd->q + ((size_t)i * 2 + 1) * V);
        int md = sd->seqs[x->seq].active ? sd->seqs[x->seq].max_depth : 0;
        sd->bv[i] = (model_seq_batch){.seq = x->seq,
                                      .pos = x->pos,
                                      .n_tokens = d + 1,
                                      .tokens = vt,
                                      .logits_all = 1,
                                      .logits = sd->vl + (size_t)i * VT * V,
                                      .hidden = md > 0 ? sd->vh + (size_t)i * VT * D : NULL};
    }
    if (n && fwd_chunks(sd, ctx, kv, 0, sd->bv, n) != 0)
        return -1;
    if (sd->profiling)
        pt[3] = now_ms();

    /* accept, roll back, update the module state */
    for (int i = 0; i < n; i++) {
        specdec_item *x = &items[i];
        sd_seq *st = &sd->seqs[x->seq];
        int d = sd->depth[i], a = 0;
        float *vl = sd->vl + (size_t)i * VT * V;
        const int *vt = sd->vt + (size_t)i * VT;
        if (x->n_logprobs > 0) /* the raw distribution, before penalties and sampling */
            memcpy(sd->lpraw, vl, (size_t)(d + 1) * V * sizeof(float));
        if (d == 0) {
            if (x->penalize)
                x->penalize(x->penalize_ud, sd->sampler, vl);
            x->tokens[0] = sampler_sample(sd->sampler, x->sp, x->rng, vl);
        } else if (sd->sampling == SPECDEC_SAMPLE_ONEHOT && !is_greedy(x->sp)) {
            specdec_accept_onehot(sd->sampler, sd->vocab, x->sp, x->rng, vt + 1, d, vl, x->tokens,
                                  &a);
        } else {
            specdec_accept(sd->sampler, sd->vocab, x->sp, x->rng, vt + 1, sd->q + (size_t)i * 2 * V,
                           d, vl, sd->scratch, x->tokens, &a);
        }
        x->n_accepted = a;
        x->n_tokens = a + 1;
        /* each emitted token's log-probabilities from the verify logits of its own position
         * (the verifier's distribution, never the drafts') */
        for (int j = 0; x->n_logprobs > 0 && j <= a; j++)
            sampler_logprobs(sd->lpraw + (size_t)j * V, V, x->tokens[j], x->n_logprobs - 1,
                             &x->lps[j]);
        kvcache_seq_set_len(kv, x->seq, x->pos + 1 + a);
        if (!st->active || st->max_depth == 0)
            continue;
        const float *vh = sd->vh + (size_t)i * VT * D;
        if (sd->run[i]) {
            const float *h2 = sd->h2in + (size_t)i * (ROWS + 1) * D;
            int off = st->c1 >= 1;
            memcpy(st->h1prev, h2 + (size_t)(off + st->n_rows - 1) * D, D * sizeof(float));
            /* module 2's entry at n-1 was drafted from d1 (d >= 2): real when d1 was
             * accepted, else rewritten at the next run */
            st->c2 = st->max_depth >= 2 && d >= 2 && a >= 1 ? x->pos : x->pos - 1;
            st->c1 = x->pos;
            st->n_rows = a + 1;
            memcpy(st->h0, vh, (size_t)(a + 1) * D * sizeof(float));
            memcpy(st->toks, x->tokens, (size_t)(a + 1) * sizeof(int));
        } else {
            memcpy(st->h0 + (size_t)st->n_rows * D, vh, D * sizeof(float));
            st->toks[st->n_rows] = x->tokens[0];
            st->n_rows++;
        }
    }
    if (sd->profiling) {
        pt[4] = now_ms();
        sd->prof.mod1_ms += pt[1] - pt[0];
        sd->prof.mod2_ms += pt[2] - pt[1];
        sd->prof.verify_ms += pt[3] - pt[2];
        sd->prof.rest_ms += pt[4] - pt[3];
        sd->prof.steps++;
    }
    return 0;
}

// --- costs and the controller

#define COST_PROMPT 16
#define COST_REPS 5

/* Time (ms) of one step at depth d of b sequences, advancing them; -1 on failure. */
static double time_step(specdec_t *sd, model_ctx_t *ctx, kvcache_t *kv, specdec_item *items, int b,
                        int d)
{
    for (int i = 0; i < b; i++)
        items[i].depth = d;
    double t0 = now_ms();
    if (specdec_step(sd, ctx, kv, items, b) != 0)
        return -1;
    double dt = now_ms() - t0;
    for (int i = 0; i < b; i++) {
        items[i].pos += items[i].n_tokens;
        items[i].last = items[i].tokens[items[i].n_tokens - 1];
    }
    return dt;
}

/* Rounds of one step at each depth 0 .. n_mod over items[0..b) (interleaved, so that a
 * load change on a shared machine hits every depth alike), the first untimed; the
 * fastest of each depth into t (noise only adds time). Returns 0, or -1 when a step
 * failed or a plain step took more than max_step_ms. */
static int cost_rounds(specdec_t *sd, model_ctx_t *ctx, kvcache_t *kv, specdec_item *items, int b,
                       double max_step_ms, double *t)
{
    for (int d = 0; d <= SPECDEC_MAX_DEPTH; d++)
        t[d] = 1e30;
    for (int rep = 0; rep <= COST_REPS; rep++) {
        for (int d = 0; d <= sd->n_mod; d++) {
            double dt = time_step(sd, ctx, kv, items, b, d);
            if (dt < 0 || (d == 0 && dt > max_step_ms))
                return -1; /* failed, or too slow to measure: stop here */
            if (rep > 0 && dt < t[d])
                t[d] = dt;
        }
    }
    return 0;
}

int specdec_measure_costs(specdec_t *sd, model_ctx_t *ctx, kvcache_t *kv, int max_batch,
                          double max_step_ms, specdec_costs *out)
{
    memset(out, 0, sizeof(*out));
    if (!sd->mt || max_batch < 1)
        return -1;
    if (max_batch > sd->max_items)
        max_batch = sd->max_items;
    const model_config *c = model_get_config(sd->m);
    /* prompt + (1 + depths) * (1 + reps) steps of up to VT tokens */
    int steps_len = (SPECDEC_MAX_DEPTH + 1) * (COST_REPS + 1) * VT + VT;
    int need = COST_PROMPT + steps_len;
    if (need > c->n_ctx)
        return -1;
    /* the long context: as long as SPECDEC_COST_CTX_LONG, within n_ctx */
    int ctx_long = c->n_ctx - steps_len < SPECDEC_COST_CTX_LONG ? c->n_ctx - steps_len
                                                                 : SPECDEC_COST_CTX_LONG;
    if (ctx_long < 4 * COST_PROMPT)
        ctx_long = 0;
    int need_long = ctx_long + steps_len;
    out->ctx_short = COST_PROMPT;
    int *seqs = calloc((size_t)max_batch, sizeof(int));
    int *toks = calloc((size_t)max_batch * COST_PROMPT, sizeof(int));
    specdec_item *items = calloc((size_t)max_batch, sizeof(specdec_item));
    float *hands = calloc((size_t)max_batch * 2 * (size_t)sd->dim, sizeof(float));
    specdec_prefill_item *pit = calloc((size_t)max_batch, sizeof(specdec_prefill_item));
    uint64_t *rngs = calloc((size_t)max_batch, sizeof(uint64_t));
    int rc = -1;
    if (!seqs || !toks || !items || !hands || !pit || !rngs)
        goto done;
    sampler_params sp = {.temperature = 0.0f, .top_p = 1.0f};
    uint64_t lcg = 0x9e3779b97f4a7c15ULL;
    for (int b = 1; out->n < SPECDEC_COST_POINTS; b = b * 2 < max_batch ? b * 2 : max_batch) {
        if ((long)b * COST_PROMPT > sd->max_prefill || b > model_ctx_max_tokens(ctx) ||
            (long)b * kvcache_blocks_for(kv, need) > kvcache_n_free_blocks(kv))
            break;
        int ns = 0, ok = 1;
        int want_long = ctx_long > 0 && b <= SPECDEC_COST_LONG_MAX_BATCH &&
                        (long)b * kvcache_blocks_for(kv, need_long) <= kvcache_n_free_blocks(kv);
        for (; ns < b; ns++) {
            seqs[ns] = kvcache_seq_new(kv);
            if (seqs[ns] < 0 || seqs[ns] >= sd->max_seqs ||
                kvcache_seq_reserve(kv, seqs[ns], want_long ? need_long : need) != KVCACHE_OK) {
                if (seqs[ns] >= 0)
                    kvcache_seq_free(kv, seqs[ns]);
                ok = 0;
                break;
            }
        }
        model_seq_batch *pb = sd->bv; /* scratch: b <= max_items */
        for (int i = 0; ok && i < b; i++) {
            for (int j = 0; j < COST_PROMPT; j++) {
                lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
                toks[i * COST_PROMPT + j] = (int)((lcg >> 33) % (uint64_t)c->vocab_size);
            }
            pb[i] = (model_seq_batch){.seq = seqs[i],
                                      .n_tokens = COST_PROMPT,
                                      .tokens = toks + i * COST_PROMPT,
                                      .logits = sd->vl + (size_t)i * c->vocab_size,
                                      .hidden = sd->ph0 + (size_t)i * COST_PROMPT * sd->dim,
                                      .hidden_all = 1};
        }
        if (ok && fwd_chunks(sd, ctx, kv, 0, pb, b) != 0)
            ok = 0;
        for (int i = 0; ok && i < b; i++)
            pit[i] = (specdec_prefill_item){.seq = seqs[i],
                                            .n_tokens = COST_PROMPT,
                                            .prompt = toks + i * COST_PROMPT,
                                            .n_prompt = COST_PROMPT,
                                            .h0 = sd->ph0 + (size_t)i * COST_PROMPT * sd->dim,
                                            .depth = sd->n_mod,
                                            .hand = hands + (size_t)i * 2 * sd->dim};
        if (ok && specdec_prefill(sd, ctx, kv, pit, b) != 0)
            ok = 0;
        for (int i = 0; ok && i < b; i++) {
            int first = toks[i * COST_PROMPT + 3];
            specdec_seq_start(sd, seqs[i], COST_PROMPT, first, hands + (size_t)i * 2 * sd->dim,
                              sd->n_mod);
            rngs[i] = 1;
            items[i] = (specdec_item){
                .seq = seqs[i], .pos = COST_PROMPT, .last = first, .sp = &sp, .rng = &rngs[i]};
        }
        double t[SPECDEC_MAX_DEPTH + 1];
        if (ok && cost_rounds(sd, ctx, kv, items, b, max_step_ms, t) != 0)
            ok = 0;
        if (ok) {
            int k = out->n++;
            out->batch[k] = b;
            out->plain_ms[k] = t[0];
            for (int d = 0; d <= SPECDEC_MAX_DEPTH; d++)
                out->ratio[k][d] = d <= sd->n_mod ? t[d] / t[0] : 0.0;
            /* the same sequences at the long context: their length set, the KV content
             * whatever the cache holds (it does not change the time), the module state
             * restarted there */
            for (int i = 0; want_long && i < b; i++) {
                kvcache_seq_set_len(kv, seqs[i], ctx_long);
                specdec_seq_start(sd, seqs[i], ctx_long, items[i].last,
                                  hands + (size_t)i * 2 * sd->dim, sd->n_mod);
                items[i].pos = ctx_long;
            }
            double tl[SPECDEC_MAX_DEPTH + 1];
            if (want_long && cost_rounds(sd, ctx, kv, items, b, 1e30, tl) == 0) {
                out->ctx_long = ctx_long;
                out->has_long[k] = 1;
                out->plain_ms_long[k] = tl[0];
                for (int d = 0; d <= SPECDEC_MAX_DEPTH; d++)
                    out->ratio_long[k][d] = d <= sd->n_mod ? tl[d] / tl[0] : 0.0;
            }
        }
        for (int i = 0; i < ns; i++) {
            sd->seqs[seqs[i]].active = 0;
            kvcache_seq_free(kv, seqs[i]);
        }
        if (!ok)
            break;
        if (b == max_batch)
            break;
    }
    rc = out->n > 0 ? 0 : -1;
done:
    free(seqs);
    free(toks);
    free(items);
    free(hands);
    free(pit);
    free(rngs);
    return rc;
}

/* The ratio at batch b from table r (points without has[k], when has is given, take the
 * short table's value). */
static double cost_in(const specdec_costs *c, double (*r)[SPECDEC_MAX_DEPTH + 1], const int *has,
                      int b, int depth)
{
#define R(k) (has && !has[k] ? c->ratio[k][depth] : r[k][depth])
    if (b <= c->batch[0])
        return R(0);
    for (int k = 1; k < c->n; k++) {
        if (b <= c->batch[k]) {
            double f = (double)(b - c->batch[k - 1]) / (double)(c->batch[k] - c->batch[k - 1]);
            return R(k - 1) + f * (R(k) - R(k - 1));
        }
    }
    return R(c->n - 1);
#undef R
}

double specdec_cost(const specdec_costs *c, int b, int depth)
{
    if (depth <= 0)
        return 1.0;
    if (!c || c->n == 0)
        return 1.0 + 0.1 * depth;
    return cost_in(c, (double (*)[SPECDEC_MAX_DEPTH + 1])c->ratio, NULL, b, depth);
}

double specdec_cost_at(const specdec_costs *c, int b, int ctx, int depth)
{
    double s = specdec_cost(c, b, depth);
    if (depth <= 0 || !c || c->n == 0 || ctx < 0 || c->ctx_long <= c->ctx_short)
        return s;
    double l =
        cost_in(c, (double (*)[SPECDEC_MAX_DEPTH + 1])c->ratio_long, c->has_long, b, depth);
    double f = (double)(ctx - c->ctx_short) / (double)(c->ctx_long - c->ctx_short);
    f = f < 0.0 ? 0.0 : f > 1.0 ? 1.0 : f;
    return s + f * (l - s);
}

void specdec_ctl_init(specdec_ctl *c, int max_depth, const float prior[2])
{
    memset(c, 0, sizeof(*c));
    c->max_depth = max_depth < 0                   ? 0
                   : max_depth > SPECDEC_MAX_DEPTH ? SPECDEC_MAX_DEPTH
                                                   : max_depth;
    c->acc[0] = prior ? prior[0] : 0.6;
    c->acc[1] = prior ? prior[1] : 0.6;
    c->depth = c->max_depth;
    c->probe_in = SPECDEC_PROBE_STEPS;
}

double specdec_ctl_expected(const specdec_ctl *c, int depth)
{
    double e = 1.0, run = 1.0;
    for (int d = 0; d < depth && d < SPECDEC_MAX_DEPTH; d++) {
        run *= c->acc[d];
        e += run;
    }
    return e;
}

int specdec_ctl_depth(specdec_ctl *c, const specdec_costs *costs, int b)
{
    return specdec_ctl_depth_at(c, costs, b, -1);
}

int specdec_ctl_depth_at(specdec_ctl *c, const specdec_costs *costs, int b, int ctx)
{
    if (c->max_depth == 0)
        return 0;
    double score[SPECDEC_MAX_DEPTH + 1];
    int best = 0;
    for (int d = 0; d <= c->max_depth; d++) {
        score[d] = specdec_ctl_expected(c, d) / specdec_cost_at(costs, b, ctx, d);
        if (score[d] > score[best])
            best = d;
    }
    if (c->depth > c->max_depth)
        c->depth = c->max_depth;
    if (best != c->depth && score[best] > score[c->depth] * (1.0 + SPECDEC_HYSTERESIS))
        c->depth = best;
    if (c->depth < c->max_depth && --c->probe_in <= 0) {
        c->probe_in = SPECDEC_PROBE_STEPS;
        return c->max_depth;
    }
    return c->depth;
}

void specdec_ctl_observe(specdec_ctl *c, int n_drafted, int n_accepted)
{
    const double al = SPECDEC_EWMA_ALPHA;
    if (n_drafted >= 1)
        c->acc[0] += al * ((n_accepted >= 1 ? 1.0 : 0.0) - c->acc[0]);
    if (n_drafted >= 2 && n_accepted >= 1)
        c->acc[1] += al * ((n_accepted >= 2 ? 1.0 : 0.0) - c->acc[1]);
}
