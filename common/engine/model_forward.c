/*
 * model_forward: the forward pass of a batch of sequences (model_forward) and of one MTP
 * module (model_forward_nextn); see model.h, and model.c's top comment for the numerics
 * (run.c's order with the EXACT kernels, batch invariance) and the threading.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache.h"
#include "matvec.h"
#include "model_internal.h"

/* ------------------------------------------------------------------------------------- */
/* element-wise steps (each token's row independently, in a fixed order) */

/* RoPE on rows [a, b) (a even) of one token's q or k row v, as run.c. */
static void rope_rows(float *v, const float *rp, int hs, int a, int b)
{
    for (int i = a; i < b; i += 2) {
        float fcr = rp[i % hs], fci = rp[i % hs + 1];
        float v0 = v[i], v1 = v[i + 1];
        v[i] = v0 * fcr - v1 * fci;
        v[i + 1] = v0 * fci + v1 * fcr;
    }
}

/* ------------------------------------------------------------------------------------- */
/* parallel jobs */

/* Below this many multiply-adds a step runs on the calling thread. */
#define PAR_MIN_WORK (1 << 20)
/* Below this many, a step runs on the pool only when a worker is awake (spinning after
 * the previous step): waking a sleeping one costs more than such a step saves. On a
 * machine whose other CPU is busy the woken worker preempts the caller on its own CPU:
 * stories260K at batch 32 (only the classifier reaches PAR_MIN_WORK, once per forward
 * pass, ~2 ms apart, so the worker is always asleep by then) had every step preempted
 * against half of them on one thread, and ran at x0.55-0.65 of its 1-thread rate
 * (bench_engine --batched, docs/bench.md). The 1B-class models' products are above it:
 * their first step wakes the workers and the next ones find them spinning. */
#define PAR_WAKE_WORK (1L << 22)

/* 1: run a step of `work` multiply-adds on the calling thread. */
static int run_inline(const model_ctx_t *ctx, long work)
{
    if (ctx->n_threads == 1 || work < PAR_MIN_WORK)
        return 1;
    return work < PAR_WAKE_WORK && threadpool_awake(ctx->pool) == 0;
}
/* A matrix product is cut into chunks of whole CHUNK_ROW_ALIGN-row units, claimed by the
 * threads from one counter (guided self-scheduling): each claim takes 1 / (GUIDE *
 * n_threads) of the units left, at least one, never across a segment's end. So the first
 * chunks are long (few claims) and the last ones short: a thread that runs out of work
 * waits at most one unit's time for the other, where chunks of a fixed 1 / 8 of each
 * thread's share left it idle 6-37 us per product on the 1B model, 1.1-1.8 ms of a 32 ms
 * batch-1 step (docs/bench.md, "Session 12"). Which thread computes a row never changes
 * its bits. */
#define GUIDE 2
#define CHUNK_ROW_ALIGN 16 /* rows; even (RoPE pairs) and a multiple of kernel tiles */

typedef enum { POST_NONE, POST_ROPE, POST_RESID, POST_SWIGLU } post_op;

/* One matrix product split into chunks of rows (or two, for gate/up + SwiGLU). */
typedef struct {
    const wmat *w, *w_up; /* w_up: POST_SWIGLU's second matrix (same shape) */
    const float *wp, *wp_up; /* their matvec packing (model_internal.h), or NULL */
    float *const *out;    /* (T,) output row pointers */
    float *const *out_up; /* POST_SWIGLU: up-projection rows; the result goes to out */
    post_op post;
    float *resid; /* POST_RESID: x (T, rows) += out */
    int rows, first_unit, units;
} seg_t;

typedef struct {
    model_ctx_t *ctx;
    const kern_act *act;
    seg_t seg[3];
    int n_seg, n_units;
    atomic_int next; /* first unit not claimed */
} mm_job;

static void mm_add(mm_job *j, const wmat *w, const float *wp, float *const *out, post_op post)
{
    seg_t *s = &j->seg[j->n_seg++];
    memset(s, 0, sizeof(*s));
    s->w = w;
    s->wp = wp;
    s->out = out;
    s->post = post;
    s->rows = w->rows;
    s->first_unit = j->n_units;
    s->units = (w->rows + CHUNK_ROW_ALIGN - 1) / CHUNK_ROW_ALIGN;
    j->n_units += s->units;
}

/* Rows [r0, r1) of w applied to a: the packed row-vectorised kernel when w has a packing
 * (faster at every T on stories260K's shapes), else kern_matmul (the same bits). */
static inline void product(const model_ctx_t *ctx, const wmat *w, const float *wp,
                           const kern_act *a, int r0, int r1, float *const *out, float *scratch)
{
    if (wp)
        matvec_exact_f32(ctx->isa, wp, w->rows, a->n, a->x, a->T, r0, r1, out);
    else
        kern_matmul(ctx->isa, ctx->order, w, a, r0, r1, out, scratch);
}

/* Rows [r0, r1) of segment s (r0 even), on thread ti. */
static void mm_rows(mm_job *j, const seg_t *s, int r0, int r1, int ti)
{
    model_ctx_t *ctx = j->ctx;
    const kern_act *a = j->act;
    float *scratch = ctx->scratch + (size_t)ti * ctx->scratch_len;
    product(ctx, s->w, s->wp, a, r0, r1, s->out, scratch);
    switch (s->post) {
    case POST_NONE:
        break;
    case POST_ROPE: {
        int hs = ctx->m->cfg.head_dim;
        for (int t = 0; t < a->T; t++)
            rope_rows(s->out[t], ctx->rope + (size_t)t * hs, hs, r0, r1);
        break;
    }
    case POST_RESID:
        for (int t = 0; t < a->T; t++) {
            float *x = s->resid + (size_t)t * s->rows;
            const float *o = s->out[t];
            for (int i = r0; i < r1; i++)
                x[i] += o[i];
        }
        break;
    case POST_SWIGLU:
        product(ctx, s->w_up, s->wp_up, a, r0, r1, s->out_up, scratch);
        for (int t = 0; t < a->T; t++) /* libm's expf, bit for bit */
            matvec_swiglu(ctx->isa, s->out[t] + r0, s->out_up[t] + r0, r1 - r0);
        break;
    }
}

/* Claim the next chunk (guided, see above): its segment and rows [*r0, *r1); 0 when none
 * is left. */
static int mm_claim(mm_job *j, int nth, int *si, int *r0, int *r1)
{
    int u = atomic_load_explicit(&j->next, memory_order_relaxed), s, n;
    do {
        if (u >= j->n_units)
            return 0;
        s = 0;
        while (s + 1 < j->n_seg && u >= j->seg[s + 1].first_unit)
            s++;
        const int end = j->seg[s].first_unit + j->seg[s].units;
        n = (j->n_units - u) / (GUIDE * nth);
        n = n < 1 ? 1 : u + n > end ? end - u : n;
    } while (!atomic_compare_exchange_weak_explicit(&j->next, &u, u + n, memory_order_relaxed,
                                                    memory_order_relaxed));
    const seg_t *sg = &j->seg[s];
    *si = s;
    *r0 = (u - sg->first_unit) * CHUNK_ROW_ALIGN;
    *r1 = (u + n - sg->first_unit) * CHUNK_ROW_ALIGN;
    if (*r1 > sg->rows)
        *r1 = sg->rows;
    return 1;
}

static void mm_worker(void *arg, int ti, int nth)
{
    mm_job *j = arg;
    int si, r0, r1;
    while (mm_claim(j, nth, &si, &r0, &r1))
        mm_rows(j, &j->seg[si], r0, r1, ti);
}

/* Run the job; returns 1 when it ran on the pool (its workers are then spinning). */
static int mm_run(mm_job *j)
{
    long work = 0;
    for (int i = 0; i < j->n_seg; i++)
        work += (long)j->seg[i].rows * j->act->n * j->act->T * (j->seg[i].w_up ? 2 : 1);
    atomic_init(&j->next, 0);
    int inl = run_inline(j->ctx, work);
    if (inl) {
        /* one thread: each matrix whole, in one kernel call (the token-lane kernel
         * transposes its activation tile once per call: chunks would repeat that) */
        for (int i = 0; i < j->n_seg; i++)
            mm_rows(j, &j->seg[i], 0, j->seg[i].rows, 0);
    } else
        threadpool_run(j->ctx->pool, mm_worker, j);
    return !inl;
}

/* Tokens per item of prep's parallel loop: even (kern_pack_act's token pairs), and 8 for
 * matvec_rmsnorm's lanes. */
#define PREP_TOKENS 8

/* Preparation of a matmul input, parallel over items of PREP_TOKENS tokens: optional
 * rmsnorm (src -> dst), the Q8 form of dst when a consuming matrix is Q8_0, and the
 * AVX-512 pair packing (done once here rather than by every thread in the kernels). */
typedef struct {
    model_ctx_t *ctx;
    const kern_act *act;
    const float *src; /* (T, n), or NULL: dst is ready */
    const float *norm_w;
    float *dst; /* (T, n) */
    int quant;
    atomic_int next;
} prep_job;

static void prep_worker(void *arg, int ti, int nth)
{
    prep_job *j = arg;
    const model_config *c = &j->ctx->m->cfg;
    const kern_act *a = j->act;
    const int n = a->n, nb = n / KERN_Q8_BLOCK;
    for (;;) {
        int p = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        int t0 = PREP_TOKENS * p, t1 = t0 + PREP_TOKENS < a->T ? t0 + PREP_TOKENS : a->T;
        if (t0 >= a->T)
            break;
        if (j->src) /* the item's rows together: their sums in the lanes */
            matvec_rmsnorm(j->ctx->isa, j->dst + (size_t)t0 * n, j->src + (size_t)t0 * n, t1 - t0,
                           n, j->norm_w, c->rms_eps);
        for (int t = t0; t < t1; t++) {
            float *d = j->dst + (size_t)t * n;
            if (j->quant)
                kern_quantize_act(j->ctx->isa, d, 1, n, j->ctx->q_d + (size_t)t * nb,
                                  j->ctx->q_s + (size_t)t * n);
        }
        kern_pack_act(j->ctx->isa, a, t0, t1);
    }
}

/* Prepare and describe the input of the matrices ws[0..nw) that read n columns. */
static void prep(model_ctx_t *ctx, kern_act *a, const float *src, const float *norm_w, float *dst,
                 int T, int n, const wmat *const *ws, int nw)
{
    int quant = 0, f32 = 0;
    for (int i = 0; i < nw; i++) {
        if (ws[i]->type == GGUF_TENSOR_Q8_0)
            quant = 1;
        else if (ctx->order == KERN_ORDER_FAST)
            f32 = 1;
    }
    *a = (kern_act){.x = dst, .T = T, .n = n};
    a->q_d = quant ? ctx->q_d : NULL;
    a->q_s = quant ? ctx->q_s : NULL;
    kern_pack_bind(ctx->isa, a, f32, quant, ctx->pack);
    if (!src && !quant && !a->xp)
        return;
    prep_job j = {.ctx = ctx, .act = a, .src = src, .norm_w = norm_w, .dst = dst, .quant = quant};
    atomic_init(&j.next, 0);
    if (run_inline(ctx, (long)T * n * 8) /* its work: 1/8 of a product's per element */)
        prep_worker(&j, 0, 1);
    else
        threadpool_run(ctx->pool, prep_worker, &j);
}

/* Attention of every (token, KV head) pair over the token's own sequence: the kv_mul
 * query heads that share a KV head, and up to ATT_TOKENS consecutive tokens of one
 * sequence (an MTP verify pass, a prompt), are done together, block by block, so each K
 * and V row is read (and K transposed) once for all of them. Per query head the
 * arithmetic is run.c's: scores q . k_s (in the kernel order), / sqrt(head_dim), softmax,
 * then the values summed in position order (kernels.h): a token's value chain runs over
 * the rows the tokens share, then its own later rows, block by block, so the order per
 * element is unchanged (the extra scores computed for the earlier tokens of a run, at
 * positions after their own, are never read). */
#define ATT_TOKENS 4
#define ATT_CHUNKS_PER_THREAD 8 /* chunks of (token, KV head) pairs per thread */
#define ATT_QBUF 2048 /* floats: a run's query heads (nt * kv_mul * head_dim), on the stack */
typedef struct {
    model_ctx_t *ctx;
    kvcache_t *kv;
    const model_seq_batch *batch;
    int layer, T, nt_max, per_chunk, n_chunks;
    int one_pass; /* a lone token's heads in one matvec_attend_exact call (att_token) */
    atomic_int next;
} att_job;

/* Tokens [t0, t0 + nt) (one item, consecutive positions) with KV head g; att holds
 * nt * kv_mul score rows of n_ctx floats. */
static void att_group(att_job *j, int t0, int nt, int g, float *att)
{
    model_ctx_t *ctx = j->ctx;
    const model_config *c = &ctx->m->cfg;
    const int dim = c->dim, hs = c->head_dim, kv_dim = c->n_kv_head * hs;
    const int kv_mul = c->n_head / c->n_kv_head, nq = nt * kv_mul;
    const int bs = kvcache_get_params(j->kv)->block_size;
    const int seq = j->batch[ctx->tok_item[t0]].seq;
    const int n_lo = ctx->tok_pos[t0] + 1, n_hi = ctx->tok_pos[t0 + nt - 1] + 1;
    const int *blocks = kvcache_seq_blocks(j->kv, seq, NULL);
    const size_t koff = (size_t)g * hs, att_len = (size_t)c->n_ctx;
    /* the run's query heads side by side (nq, hs), and its outputs likewise */
    float qbuf[ATT_QBUF], ybuf[ATT_QBUF]; /* nq * hs <= ATT_QBUF (attention: nt_max) */
    const float *q = ctx->q + (size_t)t0 * dim + (size_t)g * kv_mul * hs;
    if (nt > 1) {
        for (int u = 0; u < nt; u++)
            memcpy(qbuf + (size_t)u * kv_mul * hs, q + (size_t)u * dim,
                   (size_t)kv_mul * hs * sizeof(float));
        q = qbuf;
    }
    float *y = nt > 1 ? ybuf : ctx->xb + (size_t)t0 * dim + (size_t)g * kv_mul * hs;
    const float scale = sqrtf(hs); /* run.c divides each score by sqrtf(head_size) */
    if (ctx->order == KERN_ORDER_EXACT && matvec_attend_rows_vector(ctx->isa, nq, hs)) {
        /* the run's nq rows in the lanes: softmax and values 8 rows per instruction
         * (the per-head helpers below run each row's serial sums alone) */
        matvec_attend_rows_exact(ctx->isa, q, nq, kv_mul, hs, kvcache_block_data(j->kv, j->layer, 0),
                                 blocks, kvcache_block_bytes(j->kv) / sizeof(float), bs,
                                 (size_t)kv_dim, koff, n_lo, scale, att, y);
        goto out;
    }
    for (int s0 = 0; s0 < n_hi; s0 += bs) {
        int rows = n_hi - s0 < bs ? n_hi - s0 : bs;
        const float *kb = kvcache_block_data(j->kv, j->layer, blocks[s0 / bs]) + koff;
        if (ctx->order == KERN_ORDER_EXACT) /* the nq heads together, rows in lanes */
            matvec_scores_exact(ctx->isa, q, nq, kb, (size_t)kv_dim, rows, hs, att + s0,
                                att_len);
        else /* tiles of query heads x K rows */
            kern_dot_heads(ctx->isa, ctx->order, q, nq, (size_t)hs, kb, (size_t)kv_dim, rows, hs,
                           att + s0, att_len);
    }
    matvec_softmax_rows(ctx->isa, att, att_len, nq, n_lo, kv_mul, scale);
    memset(y, 0, (size_t)nq * hs * sizeof(float));
    for (int s0 = 0; s0 < n_hi; s0 += bs) {
        int rows = n_hi - s0 < bs ? n_hi - s0 : bs;
        const float *vb =
            kvcache_block_data(j->kv, j->layer, blocks[s0 / bs]) + (size_t)bs * kv_dim + koff;
        /* rows [s0, s0 + shared) are every token's; then token u's own up to n_lo + u */
        int shared = n_lo - s0 < rows ? n_lo - s0 : rows;
        if (shared > 0)
            matvec_values(ctx->isa, y, nq, att + s0, att_len, vb, (size_t)kv_dim, shared, hs);
        for (int u = 1; u < nt; u++) {
            int r0 = shared > 0 ? shared : 0, r1 = n_lo + u - s0 < rows ? n_lo + u - s0 : rows;
            if (r1 > r0)
                matvec_values(ctx->isa, y + (size_t)u * kv_mul * hs, kv_mul,
                              att + (size_t)u * kv_mul * att_len + s0 + r0, att_len,
                              vb + (size_t)r0 * kv_dim, (size_t)kv_dim, r1 - r0, hs);
        }
    }
out:
    if (nt > 1)
        for (int u = 0; u < nt; u++)
            memcpy(ctx->xb + (size_t)(t0 + u) * dim + (size_t)g * kv_mul * hs,
                   y + (size_t)u * kv_mul * hs, (size_t)kv_mul * hs * sizeof(float));
}

/* Token t alone (a decode step's token), every KV head at once: matvec_attend_exact reads
 * each K and V row once for all heads (att_group's per-head passes read them once per KV
 * head) and runs the heads' softmax sums side by side; the same arithmetic per element. */
static void att_token(att_job *j, int t, float *att)
{
    model_ctx_t *ctx = j->ctx;
    const model_config *c = &ctx->m->cfg;
    const int dim = c->dim, hs = c->head_dim;
    const kvcache_params *kp = kvcache_get_params(j->kv);
    const int *blocks = kvcache_seq_blocks(j->kv, j->batch[ctx->tok_item[t]].seq, NULL);
    matvec_attend_exact(ctx->isa, ctx->q + (size_t)t * dim, c->n_head, c->n_head / c->n_kv_head, hs,
                        kvcache_block_data(j->kv, j->layer, 0), blocks,
                        kvcache_block_bytes(j->kv) / sizeof(float), kp->block_size,
                        (size_t)c->n_kv_head * hs, ctx->tok_pos[t] + 1, sqrtf(hs), att,
                        ctx->xb + (size_t)t * dim);
}

/* Prefetch the K and V rows [0, pos] of token t's sequence in the job's layer: the next
 * run's, while this one computes. A block of the paged cache is a page of its own (4 KB on
 * stories260K), which the hardware prefetchers do not cross, and at batch 32 the cache
 * of the batch no longer fits L2 (docs/bench.md, "Aggregate decode"). */
static void att_prefetch(const att_job *j, int t)
{
    const model_ctx_t *ctx = j->ctx;
    const model_config *c = &ctx->m->cfg;
    const int bs = kvcache_get_params(j->kv)->block_size;
    const size_t kv_dim = (size_t)c->n_kv_head * c->head_dim;
    const int n = ctx->tok_pos[t] + 1;
    const int *blocks = kvcache_seq_blocks(j->kv, j->batch[ctx->tok_item[t]].seq, NULL);
    for (int s0 = 0; s0 < n; s0 += bs) {
        int rows = n - s0 < bs ? n - s0 : bs;
        const char *kb = (const char *)kvcache_block_data(j->kv, j->layer, blocks[s0 / bs]);
        const size_t bytes = (size_t)rows * kv_dim * sizeof(float),
                     voff = (size_t)bs * kv_dim * sizeof(float);
        for (size_t o = 0; o < bytes; o += 64) {
            __builtin_prefetch(kb + o, 0, 3);
            __builtin_prefetch(kb + voff + o, 0, 3);
        }
    }
}

static void att_worker(void *arg, int ti, int nth)
{
    att_job *j = arg;
    const model_ctx_t *ctx = j->ctx;
    const int n_kv = ctx->m->cfg.n_kv_head;
    float *att = ctx->att + (size_t)ti * ctx->att_len;
    for (;;) {
        int ch = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (ch >= j->n_chunks)
            break;
        /* the last chunks first: in a prompt they hold the latest tokens, whose runs cost
         * the most (causal: n_lo positions each), so the cheap ones come last and the
         * threads finish together */
        ch = j->n_chunks - 1 - ch;
        /* (token, KV head) pairs [p0, p1); a pair whose token starts a run (its index in
         * its item a multiple of nt_max) does the whole run, the others nothing */
        int p0 = ch * j->per_chunk, p1 = p0 + j->per_chunk;
        if (p1 > j->T * n_kv)
            p1 = j->T * n_kv;
        for (int p = p0; p < p1; p++) {
            int t = p / n_kv, g = p % n_kv;
            const model_seq_batch *b = &j->batch[ctx->tok_item[t]];
            int k = ctx->tok_pos[t] - b->pos;
            if (k % j->nt_max)
                continue;
            int nt = b->n_tokens - k < j->nt_max ? b->n_tokens - k : j->nt_max;
            if (g == 0 && t + nt < j->T)
                att_prefetch(j, t + nt);
            if (nt == 1 && j->one_pass) {
                if (g == 0)
                    att_token(j, t, att);
            } else
                att_group(j, t, nt, g, att);
        }
    }
}

/* Below this many multiply-adds the attention runs on the calling thread even when the
 * workers are spinning. */
#define ATT_PAR_MIN (1L << 15)

/* The attention of layer `layer` for the batch's T tokens. hot: the Q/K/V product just
 * ran on the pool, so its workers are spinning: then the attention runs on the pool from
 * ATT_PAR_MIN (a worker that is awake costs no wake-up), not only from PAR_MIN_WORK. On
 * the 1B models at batch 1 (4 KV heads, context 64: ~270 K multiply-adds, ~50 us on one
 * thread) the other thread sat idle through it and had often gone to sleep by the next
 * product, which then waited ~20 us for its wake-up (docs/bench.md, "Session 12").
 * Stories260K's products are below PAR_MIN_WORK, so hot is 0 there. */
static void attention(model_ctx_t *ctx, kvcache_t *kv, const model_seq_batch *batch, int layer,
                      int T, int hot)
{
    const model_config *c = &ctx->m->cfg;
    att_job j = {.ctx = ctx, .kv = kv, .batch = batch, .layer = layer, .T = T};
    long work = 0;
    for (int t = 0; t < T; t++)
        work += (long)(ctx->tok_pos[t] + 1) * c->dim * 2;
    /* tokens per run: a thread's score rows (model.c: n_head rows of n_ctx) hold n_kv_head
     * tokens' kv_mul heads; its query heads fit qbuf */
    const int kv_mul = c->n_head / c->n_kv_head;
    j.nt_max = c->n_kv_head < ATT_TOKENS ? c->n_kv_head : ATT_TOKENS;
    while (j.nt_max > 1 && j.nt_max * kv_mul * c->head_dim > ATT_QBUF)
        j.nt_max--;
    /* the one-pass kernel pads each head's scores to a multiple of 8 positions: the
     * thread's n_head rows of n_ctx floats hold that when n_ctx is a multiple of 8 */
    j.one_pass = ctx->order == KERN_ORDER_EXACT && c->n_ctx % 8 == 0 &&
                 matvec_attend_vector(ctx->isa, c->n_head, kv_mul, c->head_dim,
                                      kvcache_get_params(kv)->block_size);
    int groups = T * c->n_kv_head;
    int want = ctx->n_threads * ATT_CHUNKS_PER_THREAD;
    j.per_chunk = (groups + want - 1) / want;
    j.n_chunks = (groups + j.per_chunk - 1) / j.per_chunk;
    atomic_init(&j.next, 0);
    int inl = run_inline(ctx, work);
    if (inl && hot && work >= ATT_PAR_MIN && threadpool_awake(ctx->pool) > 0)
        inl = 0;
    if (inl)
        att_worker(&j, 0, 1);
    else
        threadpool_run(ctx->pool, att_worker, &j);
}

/* ------------------------------------------------------------------------------------- */
/* forward */

/* nextn: 1 for model_forward_nextn (logits optional, hidden_in required, layer checked by
 * the caller). */
static int check_batch(const model_ctx_t *ctx, const kvcache_t *kv, const model_seq_batch *b, int n,
                       int nextn, int *total)
{
    const model_config *c = &ctx->m->cfg;
    const kvcache_params *kp = kvcache_get_params(kv);
    if (!b || n < 1)
        return -1;
    if (kp->n_layer < c->n_layer || kp->n_kv_head != c->n_kv_head || kp->head_dim != c->head_dim)
        return -1;
    long sum = 0;
    for (int i = 0; i < n; i++) {
        const model_seq_batch *s = &b[i];
        if (!s->tokens || (!nextn && !s->logits) || (nextn && !s->hidden_in) ||
            s->n_tokens < 1 || s->pos < 0)
            return -1;
        if (!kvcache_seq_active(kv, s->seq))
            return -1;
        if (s->pos > kvcache_seq_len(kv, s->seq))
            return -1;
        if ((long)s->pos + s->n_tokens > c->n_ctx ||
            (long)s->pos + s->n_tokens > kvcache_seq_capacity(kv, s->seq))
            return -1;
        for (int j = 0; j < s->n_tokens; j++)
            if (s->tokens[j] < 0 || s->tokens[j] >= c->vocab_size)
                return -1;
        for (int j = 0; j < i; j++)
            if (b[j].seq == s->seq)
                return -1;
        sum += s->n_tokens;
        if (sum > ctx->max_tokens)
            return -1;
    }
    *total = (int)sum;
    return 0;
}

/* Token table and RoPE factors of the batch (as run.c computes them per position); with
 * embd, each token's embedding row into embd (T, dim). */
static void setup_tokens(model_ctx_t *ctx, const model_seq_batch *batch, int n, float *embd)
{
    const model_t *m = ctx->m;
    const model_config *c = &m->cfg;
    const int dim = c->dim, hs = c->head_dim;
    int t = 0;
    for (int b = 0; b < n; b++) {
        for (int j = 0; j < batch[b].n_tokens; j++, t++) {
            int pos = batch[b].pos + j;
            ctx->tok_item[t] = b;
            ctx->tok_pos[t] = pos;
            if (embd)
                kern_dequant_row(&m->tok_embd, batch[b].tokens[j], embd + (size_t)t * dim);
            float *rp = ctx->rope + (size_t)t * hs;
            for (int i = 0; i < hs; i += 2) {
                float freq = 1.0f / powf(c->rope_theta, i / (float)hs);
                float val = pos * freq;
                rp[i] = cosf(val);
                rp[i + 1] = sinf(val);
            }
        }
    }
}

/* One transformer block over the T tokens of the batch: x (T, dim) is updated in place;
 * K/V go to cache layer kv_layer. */
static void run_block(model_ctx_t *ctx, kvcache_t *kv, const model_seq_batch *batch,
                      const layer_weights *lw, const float *const *mv, int kv_layer, int T)
{
    static const float *const none[MODEL_MV_PER_LAYER];
    if (!mv)
        mv = none;
    const model_config *c = &ctx->m->cfg;
    const int dim = c->dim, hid = c->hidden_dim;
    kern_act act;

    /* Q, K, V with RoPE; K and V rows are written straight into the paged cache */
    for (int t = 0; t < T; t++) {
        int seq = batch[ctx->tok_item[t]].seq;
        ctx->p_k[t] = kvcache_k(kv, kv_layer, seq, ctx->tok_pos[t]);
        ctx->p_v[t] = kvcache_v(kv, kv_layer, seq, ctx->tok_pos[t]);
    }
    const wmat *qkv[3] = {&lw->wq, &lw->wk, &lw->wv};
    prep(ctx, &act, ctx->x, lw->attn_norm, ctx->xb, T, dim, qkv, 3);
    mm_job j = {.ctx = ctx, .act = &act};
    mm_add(&j, &lw->wq, mv[0], ctx->p_q, POST_ROPE);
    mm_add(&j, &lw->wk, mv[1], ctx->p_k, POST_ROPE);
    mm_add(&j, &lw->wv, mv[2], ctx->p_v, POST_NONE);
    int hot = mm_run(&j);

    attention(ctx, kv, batch, kv_layer, T, hot);

    /* x += Wo @ attention */
    const wmat *wo = &lw->wo;
    prep(ctx, &act, NULL, NULL, ctx->xb, T, dim, &wo, 1);
    j = (mm_job){.ctx = ctx, .act = &act};
    mm_add(&j, &lw->wo, mv[3], ctx->p_xb2, POST_RESID);
    j.seg[0].resid = ctx->x;
    mm_run(&j);

    /* hb = silu(W1 @ xb) * (W3 @ xb) */
    const wmat *w13[2] = {&lw->w1, &lw->w3};
    prep(ctx, &act, ctx->x, lw->ffn_norm, ctx->xb, T, dim, w13, 2);
    j = (mm_job){.ctx = ctx, .act = &act};
    mm_add(&j, &lw->w1, mv[4], ctx->p_hb, POST_SWIGLU);
    j.seg[0].w_up = &lw->w3;
    j.seg[0].wp_up = mv[5];
    j.seg[0].out_up = ctx->p_hb2;
    mm_run(&j);

    /* x += W2 @ hb */
    const wmat *w2 = &lw->w2;
    prep(ctx, &act, NULL, NULL, ctx->hb, T, hid, &w2, 1);
    j = (mm_job){.ctx = ctx, .act = &act};
    mm_add(&j, &lw->w2, mv[6], ctx->p_xb, POST_RESID);
    j.seg[0].resid = ctx->x;
    mm_run(&j);
}

/* The outputs of the final residual x (T, dim): each item's hidden rows, then the final
 * norm and classifier for the tokens whose logits are wanted (items with logits). head:
 * the classifier, NULL for the model's output matrix (logit rows of head->rows floats). */
static void run_head(model_ctx_t *ctx, const model_seq_batch *batch, int n, const wmat *head,
                     const float *head_mv)
{
    const model_t *m = ctx->m;
    const model_config *c = &m->cfg;
    const int dim = c->dim;
    const wmat *wout = head ? head : &m->output;
    int t = 0;
    for (int b = 0; b < n; b++) {
        const model_seq_batch *s = &batch[b];
        if (s->hidden) {
            int all = s->hidden_all || s->logits_all;
            int j0 = all ? 0 : s->n_tokens - 1;
            memcpy(s->hidden, ctx->x + (size_t)(t + j0) * dim,
                   (size_t)(s->n_tokens - j0) * dim * sizeof(float));
        }
        t += s->n_tokens;
    }
    /* final norm and classifier, only for the tokens whose logits are wanted */
    int R = 0;
    t = 0;
    for (int b = 0; b < n; b++) {
        for (int j = 0; j < batch[b].n_tokens; j++, t++) {
            int want = batch[b].logits && (batch[b].logits_all || j == batch[b].n_tokens - 1);
            if (!want)
                continue;
            if (R != t)
                memcpy(ctx->x + (size_t)R * dim, ctx->x + (size_t)t * dim,
                       (size_t)dim * sizeof(float));
            ctx->out_dst[R] =
                batch[b].logits + (batch[b].logits_all ? (size_t)j * wout->rows : 0);
            R++;
        }
    }
    if (R == 0)
        return;
    kern_act act;
    prep(ctx, &act, ctx->x, m->out_norm, ctx->xb, R, dim, &wout, 1);
    mm_job j = {.ctx = ctx, .act = &act};
    /* the packed copy is the model's own classifier's; a draft head has none */
    const float *wp = !head                     ? ctx->mv[c->n_layer * MODEL_MV_PER_LAYER]
                      : model_ctx_uses_mv(ctx) ? head_mv
                                               : NULL;
    mm_add(&j, wout, wp, ctx->out_dst, POST_NONE);
    mm_run(&j);
}

int model_forward(model_ctx_t *ctx, kvcache_t *kv, const model_seq_batch *batch, int n,
                  model_layer_cb cb, void *ud)
{
    const model_t *m = ctx->m;
    const model_config *c = &m->cfg;
    int T;
    if (check_batch(ctx, kv, batch, n, 0, &T) != 0)
        return -1;
    setup_tokens(ctx, batch, n, ctx->x);
    for (int l = 0; l < c->n_layer; l++) {
        run_block(ctx, kv, batch, &m->layers[l], ctx->mv + l * MODEL_MV_PER_LAYER, l, T);
        if (cb)
            cb(l, ud);
    }
    run_head(ctx, batch, n, NULL, NULL);
    for (int b = 0; b < n; b++)
        kvcache_seq_set_len(kv, batch[b].seq, batch[b].pos + batch[b].n_tokens);
    return 0;
}

// --- MTP modules ("nextn")

int model_forward_nextn(model_ctx_t *ctx, kvcache_t *kv, const model_nextn_t *mod, int kv_layer,
                        const model_seq_batch *batch, int n)
{
    return model_forward_nextn_head(ctx, kv, mod, kv_layer, NULL, NULL, batch, n);
}

int model_forward_nextn_head(model_ctx_t *ctx, kvcache_t *kv, const model_nextn_t *mod,
                             int kv_layer, const kern_mat *head, const float *head_mv,
                             const model_seq_batch *batch, int n)
{
    const model_t *m = ctx->m;
    const model_config *c = &m->cfg;
    int T;
    if (!mod || kv_layer < c->n_layer || kv_layer >= kvcache_get_params(kv)->n_layer ||
        check_batch(ctx, kv, batch, n, 1, &T) != 0)
        return -1;
    const int dim = c->dim;
    /* embeddings into xb, then cat = [rmsnorm(h, hnorm) ; rmsnorm(e, enorm)] per token */
    setup_tokens(ctx, batch, n, ctx->xb);
    int t = 0;
    for (int b = 0; b < n; b++) {
        for (int j = 0; j < batch[b].n_tokens; j++, t++) {
            float *row = ctx->cat + (size_t)t * 2 * dim;
            matvec_rmsnorm(ctx->isa, row, batch[b].hidden_in + (size_t)j * dim, 1, dim, mod->hnorm,
                           c->rms_eps);
            matvec_rmsnorm(ctx->isa, row + dim, ctx->xb + (size_t)t * dim, 1, dim, mod->enorm,
                           c->rms_eps);
        }
    }
    /* x = eh_proj @ cat */
    kern_act act;
    const wmat *eh = &mod->eh_proj;
    prep(ctx, &act, NULL, NULL, ctx->cat, T, 2 * dim, &eh, 1);
    mm_job j = {.ctx = ctx, .act = &act};
    const int mv = model_ctx_uses_mv(ctx) && mod->mv[0];
    mm_add(&j, &mod->eh_proj, mv ? mod->mv[MODEL_MV_PER_LAYER] : NULL, ctx->p_x, POST_NONE);
    mm_run(&j);

    run_block(ctx, kv, batch, &mod->blk, mv ? mod->mv : NULL, kv_layer, T);
    run_head(ctx, batch, n, head, head_mv);
    return 0;
}
