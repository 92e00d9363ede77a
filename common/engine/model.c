/*
 * model: see model.h.
 *
 * Numerics follow llama2.c's run.c (karpathy/llama2.c 350e04fe) operation for operation:
 * rmsnorm with float accumulation, matmul as one float dot product per output row with j
 * ascending, RoPE on adjacent pairs (i, i+1) of each head with freq = 1 / theta^(i/hs)
 * computed by powf/cosf/sinf as run.c does, softmax with max subtraction, SwiGLU, tied or
 * separate classifier. Batching never changes the arithmetic of a token: every kernel
 * computes each token's row independently, in the same order, so logits are bit-identical
 * whatever the batch composition or chunking (batch invariance). Weights are walked once
 * per layer for all tokens of the call (row i of W is applied to every token before row
 * i + 1), which is what makes prefill and multi-token verify cheap.
 *
 * Weights are F32 or F16 (converted to float one row at a time into a scratch row, which
 * gives exactly the products run.c would compute on the F32 values of those halves).
 * Weight layout is the GGUF/ggml one: a matrix W (out, in) is row-major, ne = {in, out}.
 */
#include "model.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "gguf.h"
#include "log.h"

typedef struct {
    const void *data; /* (rows, cols) row-major */
    gguf_tensor_type type;
} wmat;

typedef struct {
    const float *attn_norm; /* (dim,) */
    const float *ffn_norm;  /* (dim,) */
    wmat wq;                /* (dim, dim) */
    wmat wk, wv;            /* (kv_dim, dim) */
    wmat wo;                /* (dim, dim) */
    wmat w1, w3;            /* (hidden_dim, dim): ffn_gate, ffn_up */
    wmat w2;                /* (dim, hidden_dim): ffn_down */
} layer_weights;

struct model {
    model_config cfg;
    gguf_t *g;
    wmat tok_embd; /* (vocab, dim) */
    layer_weights *layers;
    const float *out_norm; /* (dim,) */
    wmat output;           /* (vocab, dim); the embedding when tied */
};

struct model_ctx {
    const model_t *m;
    int max_tokens;
    float *x, *xb, *xb2, *q; /* (max_tokens, dim) */
    float *k, *v;            /* (max_tokens, kv_dim) */
    float *hb, *hb2;         /* (max_tokens, hidden_dim) */
    float *att;              /* (n_ctx,) attention scores of one head */
    float *rope;             /* (max_tokens, head_dim): cos, sin per pair */
    float *row;              /* (max(dim, hidden_dim),) converted F16 weight row */
    int *tok_item;           /* (max_tokens,) batch item of each token */
    int *tok_pos;            /* (max_tokens,) position of each token */
    float **out_dst;         /* (max_tokens,) logits destination of each output row */
};

/* ------------------------------------------------------------------------------------- */
/* load */

__attribute__((format(printf, 4, 5))) static void set_err(char *err, size_t errlen,
                                                          const char *path, const char *fmt, ...)
{
    if (!err || !errlen)
        return;
    int n = snprintf(err, errlen, "%s: ", path);
    if (n < 0 || (size_t)n >= errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err + n, errlen - (size_t)n, fmt, ap);
    va_end(ap);
}

/* Find a tensor and check its shape {ne0, ne1} (ne1 = 0 for a vector) and type. */
static const gguf_tensor_info *get_tensor(const gguf_t *g, const char *name, uint64_t ne0,
                                          uint64_t ne1, int allow_f16, char *err, size_t errlen)
{
    const gguf_tensor_info *t = gguf_find_tensor(g, name);
    const char *path = gguf_path(g);
    if (!t) {
        set_err(err, errlen, path, "missing tensor %s", name);
        return NULL;
    }
    int want_dims = ne1 ? 2 : 1;
    if (t->n_dims != want_dims || t->ne[0] != ne0 || (ne1 && t->ne[1] != ne1)) {
        set_err(err, errlen, path,
                "tensor %s has shape [%llu, %llu] (%d dims), expected [%llu, %llu]", name,
                (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], t->n_dims,
                (unsigned long long)ne0, (unsigned long long)(ne1 ? ne1 : 1));
        return NULL;
    }
    if (!(t->type == GGUF_TENSOR_F32 || (allow_f16 && t->type == GGUF_TENSOR_F16))) {
        set_err(err, errlen, path, "tensor %s has unsupported type %s", name,
                gguf_tensor_type_name(t->type));
        return NULL;
    }
    if ((uintptr_t)t->data % 4 != 0) {
        set_err(err, errlen, path, "tensor %s data is not 4-byte aligned", name);
        return NULL;
    }
    return t;
}

static int get_mat(const gguf_t *g, const char *name, uint64_t cols, uint64_t rows, wmat *out,
                   char *err, size_t errlen)
{
    const gguf_tensor_info *t = get_tensor(g, name, cols, rows, 1, err, errlen);
    if (!t)
        return -1;
    out->data = t->data;
    out->type = t->type;
    return 0;
}

static int get_vec(const gguf_t *g, const char *name, uint64_t n, const float **out, char *err,
                   size_t errlen)
{
    const gguf_tensor_info *t = get_tensor(g, name, n, 0, 0, err, errlen);
    if (!t)
        return -1;
    *out = t->data;
    return 0;
}

static int get_u32_key(const gguf_t *g, const char *key, int *out, char *err, size_t errlen)
{
    uint32_t v;
    if (gguf_get_u32(g, key, &v) != 0 || v == 0 || v > (1u << 30)) {
        set_err(err, errlen, gguf_path(g), "missing or invalid %s", key);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static uint64_t fingerprint(const model_t *m)
{
    XXH64_state_t *st = XXH64_createState();
    if (!st)
        return 0;
    XXH64_reset(st, 0x74696465706f6f6cULL); /* "tidepool" */
    const model_config *c = &m->cfg;
    int32_t arch[7] = {c->dim,       c->hidden_dim, c->n_layer, c->n_head,
                       c->n_kv_head, c->vocab_size, c->n_ctx};
    XXH64_update(st, arch, sizeof(arch));
    XXH64_update(st, &c->rms_eps, sizeof(float));
    XXH64_update(st, &c->rope_theta, sizeof(float));
    for (int i = 0; i < gguf_n_tensors(m->g); i++) {
        const gguf_tensor_info *t = gguf_tensor(m->g, i);
        uint32_t meta[2] = {(uint32_t)t->type, (uint32_t)t->n_dims};
        XXH64_update(st, t->name, strlen(t->name) + 1);
        XXH64_update(st, meta, sizeof(meta));
        XXH64_update(st, t->ne, sizeof(t->ne));
        XXH64_update(st, t->data, (size_t)t->n_bytes);
    }
    uint64_t h = XXH64_digest(st);
    XXH64_freeState(st);
    return h;
}

model_t *model_load(const char *path, char *err, size_t errlen)
{
    model_t *m = calloc(1, sizeof(*m));
    if (err && errlen)
        err[0] = '\0';
    if (!m) {
        set_err(err, errlen, path, "out of memory");
        return NULL;
    }
    m->g = gguf_open(path, err, errlen);
    if (!m->g)
        goto fail;
    gguf_t *g = m->g;
    model_config *c = &m->cfg;

    char arch[64];
    if (gguf_get_str_copy(g, "general.architecture", arch, sizeof(arch)) != 0 ||
        strcmp(arch, "llama") != 0) {
        set_err(err, errlen, path, "general.architecture is missing or not \"llama\"");
        goto fail;
    }
    char pairing[32];
    if (gguf_get_str_copy(g, "tidepool.rope.pairing", pairing, sizeof(pairing)) == 0 &&
        strcmp(pairing, "adjacent") != 0) {
        set_err(err, errlen, path, "unsupported tidepool.rope.pairing \"%s\"", pairing);
        goto fail;
    }
    if (gguf_get_str_copy(g, "general.name", c->name, sizeof(c->name)) != 0)
        c->name[0] = '\0';
    if (get_u32_key(g, "llama.embedding_length", &c->dim, err, errlen) != 0 ||
        get_u32_key(g, "llama.feed_forward_length", &c->hidden_dim, err, errlen) != 0 ||
        get_u32_key(g, "llama.block_count", &c->n_layer, err, errlen) != 0 ||
        get_u32_key(g, "llama.attention.head_count", &c->n_head, err, errlen) != 0 ||
        get_u32_key(g, "llama.context_length", &c->n_ctx, err, errlen) != 0)
        goto fail;
    if (gguf_find_key(g, "llama.attention.head_count_kv") >= 0) {
        if (get_u32_key(g, "llama.attention.head_count_kv", &c->n_kv_head, err, errlen) != 0)
            goto fail;
    } else {
        c->n_kv_head = c->n_head;
    }
    if (c->dim % c->n_head != 0 || c->n_head % c->n_kv_head != 0 || (c->dim / c->n_head) % 2 != 0) {
        set_err(err, errlen, path, "inconsistent head counts (dim %d, heads %d, kv heads %d)",
                c->dim, c->n_head, c->n_kv_head);
        goto fail;
    }
    c->head_dim = c->dim / c->n_head;
    uint32_t rope_dim;
    if (gguf_get_u32(g, "llama.rope.dimension_count", &rope_dim) == 0 &&
        rope_dim != (uint32_t)c->head_dim) {
        set_err(err, errlen, path,
                "llama.rope.dimension_count %u != head size %d (partial "
                "rotary is not supported)",
                rope_dim, c->head_dim);
        goto fail;
    }
    if (gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &c->rms_eps) != 0)
        c->rms_eps = 1e-5f;
    if (gguf_get_f32(g, "llama.rope.freq_base", &c->rope_theta) != 0)
        c->rope_theta = 10000.0f;
    if (!(c->rms_eps > 0.0f && c->rms_eps < 1.0f) || !(c->rope_theta > 1.0f)) {
        set_err(err, errlen, path, "invalid rms epsilon or rope frequency base");
        goto fail;
    }
    int32_t id;
    c->bos_id = gguf_get_i32(g, "tokenizer.ggml.bos_token_id", &id) == 0 ? id : 1;
    c->eos_id = gguf_get_i32(g, "tokenizer.ggml.eos_token_id", &id) == 0 ? id : 2;

    const gguf_tensor_info *te = gguf_find_tensor(g, "token_embd.weight");
    if (!te || te->n_dims != 2 || te->ne[1] > (1u << 24)) {
        set_err(err, errlen, path, "missing or malformed tensor token_embd.weight");
        goto fail;
    }
    c->vocab_size = (int)te->ne[1];
    gguf_type et;
    uint64_t n_tok;
    if (gguf_get_arr_info(g, "tokenizer.ggml.tokens", &et, &n_tok) == 0 &&
        n_tok != (uint64_t)c->vocab_size) {
        set_err(err, errlen, path, "tokenizer has %llu tokens but the embedding has %d rows",
                (unsigned long long)n_tok, c->vocab_size);
        goto fail;
    }
    if (c->bos_id < 0 || c->bos_id >= c->vocab_size || c->eos_id < 0 ||
        c->eos_id >= c->vocab_size) {
        set_err(err, errlen, path, "BOS/EOS id out of the vocabulary");
        goto fail;
    }

    int dim = c->dim, hid = c->hidden_dim, kv_dim = c->n_kv_head * c->head_dim;
    if (get_mat(g, "token_embd.weight", dim, c->vocab_size, &m->tok_embd, err, errlen) != 0)
        goto fail;
    m->layers = calloc((size_t)c->n_layer, sizeof(layer_weights));
    if (!m->layers) {
        set_err(err, errlen, path, "out of memory");
        goto fail;
    }
    for (int l = 0; l < c->n_layer; l++) {
        layer_weights *lw = &m->layers[l];
        char nm[96];
#define NAME(s) (snprintf(nm, sizeof(nm), "blk.%d." s ".weight", l), nm)
        if (get_vec(g, NAME("attn_norm"), dim, &lw->attn_norm, err, errlen) != 0 ||
            get_mat(g, NAME("attn_q"), dim, dim, &lw->wq, err, errlen) != 0 ||
            get_mat(g, NAME("attn_k"), dim, kv_dim, &lw->wk, err, errlen) != 0 ||
            get_mat(g, NAME("attn_v"), dim, kv_dim, &lw->wv, err, errlen) != 0 ||
            get_mat(g, NAME("attn_output"), dim, dim, &lw->wo, err, errlen) != 0 ||
            get_vec(g, NAME("ffn_norm"), dim, &lw->ffn_norm, err, errlen) != 0 ||
            get_mat(g, NAME("ffn_gate"), dim, hid, &lw->w1, err, errlen) != 0 ||
            get_mat(g, NAME("ffn_down"), hid, dim, &lw->w2, err, errlen) != 0 ||
            get_mat(g, NAME("ffn_up"), dim, hid, &lw->w3, err, errlen) != 0)
            goto fail;
#undef NAME
    }
    if (get_vec(g, "output_norm.weight", dim, &m->out_norm, err, errlen) != 0)
        goto fail;
    if (gguf_find_tensor(g, "output.weight")) {
        if (get_mat(g, "output.weight", dim, c->vocab_size, &m->output, err, errlen) != 0)
            goto fail;
    } else {
        m->output = m->tok_embd;
    }
    c->fingerprint = fingerprint(m);
    return m;
fail:
    model_destroy(&m);
    return NULL;
}

void model_destroy(model_t **mp)
{
    if (!mp || !*mp)
        return;
    model_t *m = *mp;
    gguf_close(&m->g);
    free(m->layers);
    free(m);
    *mp = NULL;
}

const model_config *model_get_config(const model_t *m)
{
    return &m->cfg;
}

/* ------------------------------------------------------------------------------------- */
/* context */

model_ctx_t *model_ctx_new(const model_t *m, int max_tokens)
{
    if (!m || max_tokens < 1)
        return NULL;
    const model_config *c = &m->cfg;
    model_ctx_t *ctx = calloc(1, sizeof(*ctx));
    if (!ctx)
        return NULL;
    size_t T = (size_t)max_tokens;
    size_t kv_dim = (size_t)c->n_kv_head * (size_t)c->head_dim;
    int rowlen = c->dim > c->hidden_dim ? c->dim : c->hidden_dim;
    ctx->m = m;
    ctx->max_tokens = max_tokens;
    ctx->x = calloc(T * (size_t)c->dim, sizeof(float));
    ctx->xb = calloc(T * (size_t)c->dim, sizeof(float));
    ctx->xb2 = calloc(T * (size_t)c->dim, sizeof(float));
    ctx->q = calloc(T * (size_t)c->dim, sizeof(float));
    ctx->k = calloc(T * kv_dim, sizeof(float));
    ctx->v = calloc(T * kv_dim, sizeof(float));
    ctx->hb = calloc(T * (size_t)c->hidden_dim, sizeof(float));
    ctx->hb2 = calloc(T * (size_t)c->hidden_dim, sizeof(float));
    ctx->att = calloc((size_t)c->n_ctx, sizeof(float));
    ctx->rope = calloc(T * (size_t)c->head_dim, sizeof(float));
    ctx->row = calloc((size_t)rowlen, sizeof(float));
    ctx->tok_item = calloc(T, sizeof(int));
    ctx->tok_pos = calloc(T, sizeof(int));
    ctx->out_dst = calloc(T, sizeof(float *));
    if (!ctx->x || !ctx->xb || !ctx->xb2 || !ctx->q || !ctx->k || !ctx->v || !ctx->hb ||
        !ctx->hb2 || !ctx->att || !ctx->rope || !ctx->row || !ctx->tok_item || !ctx->tok_pos ||
        !ctx->out_dst) {
        model_ctx_destroy(&ctx);
        return NULL;
    }
    return ctx;
}

void model_ctx_destroy(model_ctx_t **cp)
{
    if (!cp || !*cp)
        return;
    model_ctx_t *ctx = *cp;
    free(ctx->x);
    free(ctx->xb);
    free(ctx->xb2);
    free(ctx->q);
    free(ctx->k);
    free(ctx->v);
    free(ctx->hb);
    free(ctx->hb2);
    free(ctx->att);
    free(ctx->rope);
    free(ctx->row);
    free(ctx->tok_item);
    free(ctx->tok_pos);
    free(ctx->out_dst);
    free(ctx);
    *cp = NULL;
}

/* ------------------------------------------------------------------------------------- */
/* kernels (each token's row is computed independently and in a fixed order) */

static void rmsnorm(float *o, const float *x, const float *weight, int size, float eps)
{
    float ss = 0.0f;
    for (int j = 0; j < size; j++)
        ss += x[j] * x[j];
    ss /= size;
    ss += eps;
    ss = 1.0f / sqrtf(ss);
    for (int j = 0; j < size; j++)
        o[j] = weight[j] * (ss * x[j]);
}

static void softmax(float *x, int size)
{
    float max_val = x[0];
    for (int i = 1; i < size; i++)
        if (x[i] > max_val)
            max_val = x[i];
    float sum = 0.0f;
    for (int i = 0; i < size; i++) {
        x[i] = expf(x[i] - max_val);
        sum += x[i];
    }
    for (int i = 0; i < size; i++)
        x[i] /= sum;
}

/* Row i of W (rows, n) as floats: the mapped row for F32, else converted into buf. */
static const float *weight_row(const wmat *w, int i, int n, float *buf)
{
    if (w->type == GGUF_TENSOR_F32)
        return (const float *)w->data + (size_t)i * (size_t)n;
    const uint16_t *h = (const uint16_t *)w->data + (size_t)i * (size_t)n;
    for (int j = 0; j < n; j++)
        buf[j] = gguf_fp16_to_fp32(h[j]);
    return buf;
}

/* W (d, n) @ x (T, n) -> xout (T, d): out[t][i] = sum_j W[i][j] * x[t][j], j ascending. */
static void matmul(float *xout, const float *x, const wmat *w, int n, int d, int T, float *buf)
{
    for (int i = 0; i < d; i++) {
        const float *wr = weight_row(w, i, n, buf);
        for (int t = 0; t < T; t++) {
            const float *xt = x + (size_t)t * (size_t)n;
            float val = 0.0f;
            for (int j = 0; j < n; j++)
                val += wr[j] * xt[j];
            xout[(size_t)t * (size_t)d + (size_t)i] = val;
        }
    }
}

/* Same, writing row t to outs[t] (caller's logits buffers). */
static void matmul_to(float **outs, const float *x, const wmat *w, int n, int d, int T, float *buf)
{
    for (int i = 0; i < d; i++) {
        const float *wr = weight_row(w, i, n, buf);
        for (int t = 0; t < T; t++) {
            const float *xt = x + (size_t)t * (size_t)n;
            float val = 0.0f;
            for (int j = 0; j < n; j++)
                val += wr[j] * xt[j];
            outs[t][i] = val;
        }
    }
}

/* ------------------------------------------------------------------------------------- */
/* forward */

static int check_batch(const model_ctx_t *ctx, const kvcache_t *kv, const model_seq_batch *b, int n,
                       int *total)
{
    const model_config *c = &ctx->m->cfg;
    const kvcache_params *kp = kvcache_get_params(kv);
    if (!b || n < 1)
        return -1;
    if (kp->n_layer != c->n_layer || kp->n_kv_head != c->n_kv_head || kp->head_dim != c->head_dim)
        return -1;
    long sum = 0;
    for (int i = 0; i < n; i++) {
        const model_seq_batch *s = &b[i];
        if (!s->tokens || !s->logits || s->n_tokens < 1 || s->pos < 0)
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

int model_forward(model_ctx_t *ctx, kvcache_t *kv, const model_seq_batch *batch, int n,
                  model_layer_cb cb, void *ud)
{
    const model_t *m = ctx->m;
    const model_config *c = &m->cfg;
    int T;
    if (check_batch(ctx, kv, batch, n, &T) != 0)
        return -1;
    const int dim = c->dim, hid = c->hidden_dim, hs = c->head_dim;
    const int kv_dim = c->n_kv_head * hs, kv_mul = c->n_head / c->n_kv_head;
    const int bs = kvcache_get_params(kv)->block_size;

    /* token table, embeddings and RoPE factors (as run.c computes them per position) */
    int t = 0;
    for (int b = 0; b < n; b++) {
        for (int j = 0; j < batch[b].n_tokens; j++, t++) {
            int pos = batch[b].pos + j;
            ctx->tok_item[t] = b;
            ctx->tok_pos[t] = pos;
            const float *e = weight_row(&m->tok_embd, batch[b].tokens[j], dim, ctx->row);
            memcpy(ctx->x + (size_t)t * dim, e, (size_t)dim * sizeof(float));
            float *rp = ctx->rope + (size_t)t * hs;
            for (int i = 0; i < hs; i += 2) {
                float freq = 1.0f / powf(c->rope_theta, i / (float)hs);
                float val = pos * freq;
                rp[i] = cosf(val);
                rp[i + 1] = sinf(val);
            }
        }
    }

    for (int l = 0; l < c->n_layer; l++) {
        const layer_weights *lw = &m->layers[l];
        for (t = 0; t < T; t++)
            rmsnorm(ctx->xb + (size_t)t * dim, ctx->x + (size_t)t * dim, lw->attn_norm, dim,
                    c->rms_eps);
        matmul(ctx->q, ctx->xb, &lw->wq, dim, dim, T, ctx->row);
        matmul(ctx->k, ctx->xb, &lw->wk, dim, kv_dim, T, ctx->row);
        matmul(ctx->v, ctx->xb, &lw->wv, dim, kv_dim, T, ctx->row);

        /* RoPE on adjacent pairs, then store K/V into the paged cache */
        for (t = 0; t < T; t++) {
            float *q = ctx->q + (size_t)t * dim;
            float *k = ctx->k + (size_t)t * kv_dim;
            const float *rp = ctx->rope + (size_t)t * hs;
            for (int i = 0; i < dim; i += 2) {
                float fcr = rp[i % hs], fci = rp[i % hs + 1];
                float v0 = q[i], v1 = q[i + 1];
                q[i] = v0 * fcr - v1 * fci;
                q[i + 1] = v0 * fci + v1 * fcr;
                if (i < kv_dim) {
                    v0 = k[i];
                    v1 = k[i + 1];
                    k[i] = v0 * fcr - v1 * fci;
                    k[i + 1] = v0 * fci + v1 * fcr;
                }
            }
            int seq = batch[ctx->tok_item[t]].seq;
            memcpy(kvcache_k(kv, l, seq, ctx->tok_pos[t]), k, (size_t)kv_dim * sizeof(float));
            memcpy(kvcache_v(kv, l, seq, ctx->tok_pos[t]), ctx->v + (size_t)t * kv_dim,
                   (size_t)kv_dim * sizeof(float));
        }

        /* attention: each token over positions [0, pos] of its own sequence */
        for (t = 0; t < T; t++) {
            int seq = batch[ctx->tok_item[t]].seq;
            int pos = ctx->tok_pos[t];
            const int *blocks = kvcache_seq_blocks(kv, seq, NULL);
            for (int h = 0; h < c->n_head; h++) {
                const float *q = ctx->q + (size_t)t * dim + (size_t)h * hs;
                size_t koff = (size_t)(h / kv_mul) * hs;
                float *att = ctx->att;
                for (int s = 0; s <= pos; s++) {
                    const float *kr = kvcache_block_data(kv, l, blocks[s / bs]) +
                                      (size_t)(s % bs) * kv_dim + koff;
                    float score = 0.0f;
                    for (int i = 0; i < hs; i++)
                        score += q[i] * kr[i];
                    score /= sqrtf(hs);
                    att[s] = score;
                }
                softmax(att, pos + 1);
                float *xb = ctx->xb + (size_t)t * dim + (size_t)h * hs;
                memset(xb, 0, (size_t)hs * sizeof(float));
                for (int s = 0; s <= pos; s++) {
                    const float *vr = kvcache_block_data(kv, l, blocks[s / bs]) +
                                      (size_t)bs * kv_dim + (size_t)(s % bs) * kv_dim + koff;
                    float a = att[s];
                    for (int i = 0; i < hs; i++)
                        xb[i] += a * vr[i];
                }
            }
        }

        matmul(ctx->xb2, ctx->xb, &lw->wo, dim, dim, T, ctx->row);
        for (size_t i = 0; i < (size_t)T * dim; i++)
            ctx->x[i] += ctx->xb2[i];

        for (t = 0; t < T; t++)
            rmsnorm(ctx->xb + (size_t)t * dim, ctx->x + (size_t)t * dim, lw->ffn_norm, dim,
                    c->rms_eps);
        matmul(ctx->hb, ctx->xb, &lw->w1, dim, hid, T, ctx->row);
        matmul(ctx->hb2, ctx->xb, &lw->w3, dim, hid, T, ctx->row);
        for (size_t i = 0; i < (size_t)T * hid; i++) {
            float val = ctx->hb[i];
            val *= (1.0f / (1.0f + expf(-val)));
            val *= ctx->hb2[i];
            ctx->hb[i] = val;
        }
        matmul(ctx->xb, ctx->hb, &lw->w2, hid, dim, T, ctx->row);
        for (size_t i = 0; i < (size_t)T * dim; i++)
            ctx->x[i] += ctx->xb[i];

        if (cb)
            cb(l, ud);
    }

    /* final norm and classifier, only for the tokens whose logits are wanted */
    int R = 0;
    t = 0;
    for (int b = 0; b < n; b++) {
        for (int j = 0; j < batch[b].n_tokens; j++, t++) {
            int want = batch[b].logits_all || j == batch[b].n_tokens - 1;
            if (!want)
                continue;
            rmsnorm(ctx->xb + (size_t)R * dim, ctx->x + (size_t)t * dim, m->out_norm, dim,
                    c->rms_eps);
            ctx->out_dst[R] =
                batch[b].logits + (batch[b].logits_all ? (size_t)j * c->vocab_size : 0);
            R++;
        }
    }
    matmul_to(ctx->out_dst, ctx->xb, &m->output, dim, c->vocab_size, R, ctx->row);

    for (int b = 0; b < n; b++)
        kvcache_seq_set_len(kv, batch[b].seq, batch[b].pos + batch[b].n_tokens);
    return 0;
}
