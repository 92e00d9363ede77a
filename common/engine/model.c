/*
 * model: see model.h.
 *
 * Numerics: with the EXACT kernels (the default for all-F32 models) every step follows
 * llama2.c's run.c (karpathy/llama2.c 350e04fe) operation for operation: rmsnorm with
 * float accumulation, matmul as one float dot product per output row with j ascending,
 * RoPE on adjacent pairs (i, i+1) of each head with freq = 1 / theta^(i/hs) computed by
 * powf/cosf/sinf as run.c does, softmax with max subtraction, SwiGLU, tied or separate
 * classifier. The FAST kernels change only the order inside a dot product (matrix rows
 * and attention scores; kernels.h); the Q8_0 kernels also quantize the activations per
 * block of 32. The attention values are summed in run.c's order with either.
 *
 * Batching never changes the arithmetic of a token: every kernel computes each token's
 * row independently, in the same order, so logits are bit-identical whatever the batch
 * composition or chunking (batch invariance). Weights are walked once per layer for all
 * tokens of the call (a block of rows of W is applied to every token before the next
 * block), which is what makes prefill and multi-token verify cheap.
 *
 * Threads: each matrix product is cut into chunks of output rows taken from an atomic
 * counter by the context's threads (a row is computed whole by one thread), so the
 * result does not depend on the thread count. The steps of a layer are fused to save
 * passes and thread hand-offs: Q, K and V in one job whose chunks apply RoPE to their own
 * rows and write K/V straight into the paged cache; gate and up projections in one job
 * whose chunks apply SwiGLU to their rows; the output and down projections add into the
 * residual stream in the chunk; the input of each product is prepared in one pass per
 * token (rmsnorm, Q8 quantization, AVX-512 pair packing). Attention runs over (token, KV
 * head) pairs in parallel, the query heads of a KV head together so each K/V row is read
 * once for all of them. Small steps (stories260K-sized) run on the calling thread: waking
 * a thread costs more than they do.
 *
 * Weights are F32, F16 or Q8_0 (any mix); the token embedding row is converted to float
 * on lookup. Weight layout is the GGUF/ggml one: a matrix W (out, in) is row-major,
 * ne = {in, out}.
 */
#include "model.h"

#include <math.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "gguf.h"
#include "kernels.h"
#include "log.h"
#include "threadpool.h"

typedef kern_mat wmat;

typedef struct {
    const float *attn_norm; /* (dim,) */
    const float *ffn_norm;  /* (dim,) */
    wmat wq;                /* (dim, dim) */
    wmat wk, wv;            /* (kv_dim, dim) */
    wmat wo;                /* (dim, dim) */
    wmat w1, w3;            /* (hidden_dim, dim): ffn_gate, ffn_up */
    wmat w2;                /* (dim, hidden_dim): ffn_down */
} layer_weights;

struct model_nextn {
    const float *hnorm, *enorm; /* (dim,) */
    wmat eh_proj;               /* (dim, 2 * dim): [hidden half | embedding half] */
    layer_weights blk;
    uint64_t matmul_bytes;
};

struct model {
    model_config cfg;
    gguf_t *g;
    wmat tok_embd; /* (vocab, dim) */
    layer_weights *layers;
    const float *out_norm; /* (dim,) */
    wmat output;           /* (vocab, dim); the embedding when tied */
    int all_f32;           /* every matrix is F32 (AUTO picks the EXACT kernels) */
    uint64_t matmul_bytes; /* see model_matmul_bytes() */
};

struct model_ctx {
    const model_t *m;
    int max_tokens;
    int n_threads;
    threadpool_t *pool;
    kern_isa isa;
    kern_order order;
    char kernel_name[32];
    float *x, *xb, *xb2, *q; /* (max_tokens, dim) */
    float *cat;              /* (max_tokens, 2 * dim): MTP module input [hnorm(h) ; enorm(e)] */
    float *hb, *hb2;         /* (max_tokens, hidden_dim) */
    float *q_d;              /* (max_tokens, max(dim, hidden_dim) / 32) Q8 activation scales */
    int8_t *q_s;             /* (max_tokens, max(dim, hidden_dim)) Q8 activation values */
    float *att;              /* (n_threads, att_len) attention scores of one thread */
    size_t att_len;          /* kv_mul * n_ctx: scores of the query heads of one KV head */
    float *scratch;          /* (n_threads, scratch_len) kernel scratch */
    size_t scratch_len;
    float *rope;     /* (max_tokens, head_dim): cos, sin per pair */
    void *pack;      /* kern_pack_bytes(max_tokens, max(dim, hidden_dim)), AVX-512 */
    int *tok_item;   /* (max_tokens,) batch item of each token */
    int *tok_pos;    /* (max_tokens,) position of each token */
    float **out_dst; /* (max_tokens,) logits destination of each output row */
    float **p_q, **p_k, **p_v, **p_xb, **p_xb2, **p_hb, **p_hb2; /* (max_tokens,) row ptrs */
    float **p_x;                                                 /* (max_tokens,) rows of x */
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
                                          uint64_t ne1, int allow_quant, char *err, size_t errlen)
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
    if (!(t->type == GGUF_TENSOR_F32 ||
          (allow_quant && (t->type == GGUF_TENSOR_F16 || t->type == GGUF_TENSOR_Q8_0)))) {
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
    out->rows = (int)rows;
    out->cols = (int)cols;
    return 0;
}

static uint64_t mat_bytes(const wmat *w)
{
    return gguf_tensor_nbytes(w->type, (uint64_t)w->rows * (uint64_t)w->cols);
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
    uint32_t nextn;
    if (gguf_get_u32(g, "llama.nextn_predict_layers", &nextn) == 0 && nextn > 0) {
        /* MTP modules in the file (llama.cpp's DeepSeek-V3 layout): block_count counts
         * them; the main stack is the first block_count - nextn blocks (see mtp.h) */
        if (nextn >= (uint32_t)c->n_layer) {
            set_err(err, errlen, path, "llama.nextn_predict_layers %u >= llama.block_count %d",
                    nextn, c->n_layer);
            goto fail;
        }
        c->n_layer -= (int)nextn;
    }
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
    m->all_f32 = m->output.type == GGUF_TENSOR_F32;
    m->matmul_bytes = mat_bytes(&m->output);
    for (int l = 0; l < c->n_layer; l++) {
        const layer_weights *lw = &m->layers[l];
        const wmat *ws[7] = {&lw->wq, &lw->wk, &lw->wv, &lw->wo, &lw->w1, &lw->w2, &lw->w3};
        for (int i = 0; i < 7; i++) {
            m->all_f32 &= ws[i]->type == GGUF_TENSOR_F32;
            m->matmul_bytes += mat_bytes(ws[i]);
        }
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

uint64_t model_matmul_bytes(const model_t *m)
{
    return m->matmul_bytes;
}

/* ------------------------------------------------------------------------------------- */
/* context */

_Static_assert((int)MODEL_ISA_SCALAR == (int)KERN_ISA_SCALAR + 1 &&
                   (int)MODEL_ISA_AVX2 == (int)KERN_ISA_AVX2 + 1 &&
                   (int)MODEL_ISA_AVX512 == (int)KERN_ISA_AVX512 + 1,
               "model_isa mirrors kern_isa");

model_ctx_params model_ctx_default_params(void)
{
    model_ctx_params p = {.max_tokens = 512, .n_threads = 0, .kernel = MODEL_KERNEL_AUTO};
    return p;
}

model_ctx_t *model_ctx_new(const model_t *m, int max_tokens)
{
    model_ctx_params p = model_ctx_default_params();
    p.max_tokens = max_tokens;
    return model_ctx_new_params(m, &p);
}

model_ctx_t *model_ctx_new_params(const model_t *m, const model_ctx_params *p)
{
    if (!m || !p || p->max_tokens < 1 || p->n_threads < 0 || p->n_threads > 1024 ||
        p->kernel < MODEL_KERNEL_AUTO || p->kernel > MODEL_KERNEL_FAST ||
        p->max_isa < MODEL_ISA_AUTO || p->max_isa > MODEL_ISA_AVX512)
        return NULL;
    const model_config *c = &m->cfg;
    model_ctx_t *ctx = calloc(1, sizeof(*ctx));
    if (!ctx)
        return NULL;
    size_t T = (size_t)p->max_tokens;
    /* widest matmul input: dim, hidden_dim, or 2 * dim (an MTP module's eh_proj) */
    int wide = 2 * c->dim > c->hidden_dim ? 2 * c->dim : c->hidden_dim;
    ctx->m = m;
    ctx->max_tokens = p->max_tokens;
    ctx->pool = threadpool_new(p->n_threads);
    if (!ctx->pool) {
        free(ctx);
        return NULL;
    }
    ctx->n_threads = threadpool_size(ctx->pool);
    ctx->isa = kern_isa_detect();
    if (p->max_isa != MODEL_ISA_AUTO && (int)ctx->isa > (int)p->max_isa - 1)
        ctx->isa = (kern_isa)((int)p->max_isa - 1); /* MODEL_ISA_x = KERN_ISA_x + 1 */
    ctx->order = p->kernel == MODEL_KERNEL_EXACT  ? KERN_ORDER_EXACT
                 : p->kernel == MODEL_KERNEL_FAST ? KERN_ORDER_FAST
                 : m->all_f32                     ? KERN_ORDER_EXACT
                                                  : KERN_ORDER_FAST;
    snprintf(ctx->kernel_name, sizeof(ctx->kernel_name), "%s/%s", kern_isa_name(ctx->isa),
             kern_order_name(ctx->order));
    ctx->scratch_len = kern_scratch_floats(wide);
    int ok = 1;
    ctx->x = calloc(T * (size_t)c->dim, sizeof(float));
    ctx->xb = calloc(T * (size_t)c->dim, sizeof(float));
    ctx->xb2 = calloc(T * (size_t)c->dim, sizeof(float));
    ctx->q = calloc(T * (size_t)c->dim, sizeof(float));
    ctx->cat = calloc(T * 2 * (size_t)c->dim, sizeof(float));
    ctx->hb = calloc(T * (size_t)c->hidden_dim, sizeof(float));
    ctx->hb2 = calloc(T * (size_t)c->hidden_dim, sizeof(float));
    ctx->q_d = calloc(T * (size_t)(wide / KERN_Q8_BLOCK + 1), sizeof(float));
    ctx->q_s = calloc(T * (size_t)wide, 1);
    ctx->att_len = (size_t)(c->n_head / c->n_kv_head) * (size_t)c->n_ctx;
    ctx->att = calloc((size_t)ctx->n_threads * ctx->att_len, sizeof(float));
    ctx->scratch = calloc((size_t)ctx->n_threads * ctx->scratch_len, sizeof(float));
    ctx->rope = calloc(T * (size_t)c->head_dim, sizeof(float));
    if (ctx->isa == KERN_ISA_AVX512 && p->max_tokens >= 2) {
        ctx->pack = malloc(kern_pack_bytes(p->max_tokens, wide));
        ok &= ctx->pack != NULL;
    }
    ctx->tok_item = calloc(T, sizeof(int));
    ctx->tok_pos = calloc(T, sizeof(int));
    ctx->out_dst = calloc(T, sizeof(float *));
    float ***ptrs[] = {&ctx->p_q,   &ctx->p_k,  &ctx->p_v,  &ctx->p_xb,
                       &ctx->p_xb2, &ctx->p_hb, &ctx->p_hb2, &ctx->p_x};
    for (size_t i = 0; i < sizeof(ptrs) / sizeof(ptrs[0]); i++)
        ok &= (*ptrs[i] = calloc(T, sizeof(float *))) != NULL;
    if (!ok || !ctx->x || !ctx->xb || !ctx->xb2 || !ctx->q || !ctx->cat || !ctx->hb || !ctx->hb2 ||
        !ctx->q_d || !ctx->q_s || !ctx->att || !ctx->scratch || !ctx->rope || !ctx->tok_item ||
        !ctx->tok_pos || !ctx->out_dst) {
        model_ctx_destroy(&ctx);
        return NULL;
    }
    /* fixed row pointers of the activation buffers */
    for (size_t t = 0; t < T; t++) {
        ctx->p_q[t] = ctx->q + t * (size_t)c->dim;
        ctx->p_x[t] = ctx->x + t * (size_t)c->dim;
        ctx->p_xb[t] = ctx->xb + t * (size_t)c->dim;
        ctx->p_xb2[t] = ctx->xb2 + t * (size_t)c->dim;
        ctx->p_hb[t] = ctx->hb + t * (size_t)c->hidden_dim;
        ctx->p_hb2[t] = ctx->hb2 + t * (size_t)c->hidden_dim;
    }
    return ctx;
}

void model_ctx_destroy(model_ctx_t **cp)
{
    if (!cp || !*cp)
        return;
    model_ctx_t *ctx = *cp;
    threadpool_destroy(&ctx->pool);
    free(ctx->x);
    free(ctx->xb);
    free(ctx->xb2);
    free(ctx->q);
    free(ctx->cat);
    free(ctx->hb);
    free(ctx->hb2);
    free(ctx->q_d);
    free(ctx->q_s);
    free(ctx->att);
    free(ctx->scratch);
    free(ctx->rope);
    free(ctx->pack);
    free(ctx->tok_item);
    free(ctx->tok_pos);
    free(ctx->out_dst);
    free(ctx->p_q);
    free(ctx->p_k);
    free(ctx->p_v);
    free(ctx->p_xb);
    free(ctx->p_xb2);
    free(ctx->p_hb);
    free(ctx->p_hb2);
    free(ctx->p_x);
    free(ctx);
    *cp = NULL;
}

int model_ctx_n_threads(const model_ctx_t *ctx)
{
    return ctx->n_threads;
}

int model_ctx_max_tokens(const model_ctx_t *ctx)
{
    return ctx->max_tokens;
}

const char *model_ctx_kernel_name(const model_ctx_t *ctx)
{
    return ctx->kernel_name;
}

/* ------------------------------------------------------------------------------------- */
/* element-wise steps (each token's row independently, in a fixed order) */

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
/* Chunks per thread a step is cut into (load balance on a shared machine). */
#define CHUNKS_PER_THREAD 8
#define CHUNK_ROW_ALIGN 16 /* rows; even (RoPE pairs) and a multiple of kernel tiles */

typedef enum { POST_NONE, POST_ROPE, POST_RESID, POST_SWIGLU } post_op;

/* One matrix product split into chunks of rows (or two, for gate/up + SwiGLU). */
typedef struct {
    const wmat *w, *w_up; /* w_up: POST_SWIGLU's second matrix (same shape) */
    float *const *out;    /* (T,) output row pointers */
    float *const *out_up; /* POST_SWIGLU: up-projection rows; the result goes to out */
    post_op post;
    float *resid; /* POST_RESID: x (T, rows) += out */
    int rows, chunk, first_chunk;
} seg_t;

typedef struct {
    model_ctx_t *ctx;
    const kern_act *act;
    seg_t seg[3];
    int n_seg, n_chunks;
    atomic_int next;
} mm_job;

static int chunk_rows(const model_ctx_t *ctx, int rows)
{
    int want = ctx->n_threads * CHUNKS_PER_THREAD;
    int c = (rows + want - 1) / want;
    c = (c + CHUNK_ROW_ALIGN - 1) / CHUNK_ROW_ALIGN * CHUNK_ROW_ALIGN;
    return c;
}

static void mm_add(mm_job *j, const wmat *w, float *const *out, post_op post)
{
    seg_t *s = &j->seg[j->n_seg++];
    memset(s, 0, sizeof(*s));
    s->w = w;
    s->out = out;
    s->post = post;
    s->rows = w->rows;
    s->chunk = chunk_rows(j->ctx, w->rows);
    s->first_chunk = j->n_chunks;
    j->n_chunks += (s->rows + s->chunk - 1) / s->chunk;
}

static void mm_chunk(mm_job *j, int c, int ti)
{
    model_ctx_t *ctx = j->ctx;
    const kern_act *a = j->act;
    int si = 0;
    while (si + 1 < j->n_seg && c >= j->seg[si + 1].first_chunk)
        si++;
    const seg_t *s = &j->seg[si];
    int r0 = (c - s->first_chunk) * s->chunk;
    int r1 = r0 + s->chunk < s->rows ? r0 + s->chunk : s->rows;
    float *scratch = ctx->scratch + (size_t)ti * ctx->scratch_len;
    kern_matmul(ctx->isa, ctx->order, s->w, a, r0, r1, s->out, scratch);
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
        kern_matmul(ctx->isa, ctx->order, s->w_up, a, r0, r1, s->out_up, scratch);
        for (int t = 0; t < a->T; t++) {
            float *h = s->out[t];
            const float *h2 = s->out_up[t];
            for (int i = r0; i < r1; i++) {
                float val = h[i];
                val *= (1.0f / (1.0f + expf(-val)));
                val *= h2[i];
                h[i] = val;
            }
        }
        break;
    }
}

static void mm_worker(void *arg, int ti, int nth)
{
    mm_job *j = arg;
    for (;;) {
        int c = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (c >= j->n_chunks)
            break;
        mm_chunk(j, c, ti);
    }
}

static void mm_run(mm_job *j)
{
    long work = 0;
    for (int i = 0; i < j->n_seg; i++)
        work += (long)j->seg[i].rows * j->act->n * j->act->T * (j->seg[i].w_up ? 2 : 1);
    atomic_init(&j->next, 0);
    if (j->ctx->n_threads == 1 || work < PAR_MIN_WORK)
        mm_worker(j, 0, 1);
    else
        threadpool_run(j->ctx->pool, mm_worker, j);
}

/* Preparation of a matmul input, parallel over token pairs: optional rmsnorm (src ->
 * dst), the Q8 form of dst when a consuming matrix is Q8_0, and the AVX-512 pair packing
 * (done once here rather than by every thread in the kernels). */
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
        int t0 = 2 * p, t1 = t0 + 2 < a->T ? t0 + 2 : a->T;
        if (t0 >= a->T)
            break;
        for (int t = t0; t < t1; t++) {
            float *d = j->dst + (size_t)t * n;
            if (j->src)
                rmsnorm(d, j->src + (size_t)t * n, j->norm_w, n, c->rms_eps);
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
    if (ctx->n_threads == 1 || (long)T * n < PAR_MIN_WORK / 8)
        prep_worker(&j, 0, 1);
    else
        threadpool_run(ctx->pool, prep_worker, &j);
}

/* Attention of every (token, KV head) pair over the token's own sequence: the kv_mul
 * query heads that share a KV head are done together, block by block, so each K and V
 * row is read once for all of them. Per query head the arithmetic is run.c's: scores
 * q . k_s (in the kernel order), / sqrt(head_dim), softmax, then the values summed in
 * position order (kernels.h). */
typedef struct {
    model_ctx_t *ctx;
    kvcache_t *kv;
    const model_seq_batch *batch;
    int layer, T, per_chunk, n_chunks;
    atomic_int next;
} att_job;

static void att_group(att_job *j, int t, int g, float *att)
{
    model_ctx_t *ctx = j->ctx;
    const model_config *c = &ctx->m->cfg;
    const int dim = c->dim, hs = c->head_dim, kv_dim = c->n_kv_head * hs;
    const int kv_mul = c->n_head / c->n_kv_head;
    const int bs = kvcache_get_params(j->kv)->block_size;
    const int seq = j->batch[ctx->tok_item[t]].seq;
    const int n_pos = ctx->tok_pos[t] + 1;
    const int *blocks = kvcache_seq_blocks(j->kv, seq, NULL);
    const size_t koff = (size_t)g * hs, att_len = (size_t)c->n_ctx;
    const float *q = ctx->q + (size_t)t * dim + (size_t)g * kv_mul * hs;
    float *xb = ctx->xb + (size_t)t * dim + (size_t)g * kv_mul * hs;
    for (int s0 = 0; s0 < n_pos; s0 += bs) {
        int rows = n_pos - s0 < bs ? n_pos - s0 : bs;
        const float *kb = kvcache_block_data(j->kv, j->layer, blocks[s0 / bs]) + koff;
        for (int h = 0; h < kv_mul; h++)
            kern_dot_rows(ctx->isa, ctx->order, q + (size_t)h * hs, kb, (size_t)kv_dim, rows, hs,
                          att + h * att_len + s0);
    }
    for (int h = 0; h < kv_mul; h++) {
        float *a = att + h * att_len;
        for (int s = 0; s < n_pos; s++)
            a[s] /= sqrtf(hs);
        softmax(a, n_pos);
    }
    memset(xb, 0, (size_t)kv_mul * hs * sizeof(float));
    for (int s0 = 0; s0 < n_pos; s0 += bs) {
        int rows = n_pos - s0 < bs ? n_pos - s0 : bs;
        const float *vb =
            kvcache_block_data(j->kv, j->layer, blocks[s0 / bs]) + (size_t)bs * kv_dim + koff;
        for (int h = 0; h < kv_mul; h++)
            kern_axpy_rows(ctx->isa, xb + (size_t)h * hs, att + h * att_len + s0, vb,
                           (size_t)kv_dim, rows, hs);
    }
}

static void att_worker(void *arg, int ti, int nth)
{
    att_job *j = arg;
    const model_config *c = &j->ctx->m->cfg;
    const int n_kv = c->n_kv_head;
    float *att = j->ctx->att + (size_t)ti * j->ctx->att_len;
    for (;;) {
        int ch = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (ch >= j->n_chunks)
            break;
        int p0 = ch * j->per_chunk, p1 = p0 + j->per_chunk;
        if (p1 > j->T * n_kv)
            p1 = j->T * n_kv;
        for (int p = p0; p < p1; p++)
            att_group(j, p / n_kv, p % n_kv, att);
    }
}

static void attention(model_ctx_t *ctx, kvcache_t *kv, const model_seq_batch *batch, int layer,
                      int T)
{
    const model_config *c = &ctx->m->cfg;
    att_job j = {.ctx = ctx, .kv = kv, .batch = batch, .layer = layer, .T = T};
    long work = 0;
    for (int t = 0; t < T; t++)
        work += (long)(ctx->tok_pos[t] + 1) * c->dim * 2;
    int groups = T * c->n_kv_head;
    int want = ctx->n_threads * CHUNKS_PER_THREAD;
    j.per_chunk = (groups + want - 1) / want;
    j.n_chunks = (groups + j.per_chunk - 1) / j.per_chunk;
    atomic_init(&j.next, 0);
    if (ctx->n_threads == 1 || work < PAR_MIN_WORK)
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
                      const layer_weights *lw, int kv_layer, int T)
{
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
    mm_add(&j, &lw->wq, ctx->p_q, POST_ROPE);
    mm_add(&j, &lw->wk, ctx->p_k, POST_ROPE);
    mm_add(&j, &lw->wv, ctx->p_v, POST_NONE);
    mm_run(&j);

    attention(ctx, kv, batch, kv_layer, T);

    /* x += Wo @ attention */
    const wmat *wo = &lw->wo;
    prep(ctx, &act, NULL, NULL, ctx->xb, T, dim, &wo, 1);
    j = (mm_job){.ctx = ctx, .act = &act};
    mm_add(&j, &lw->wo, ctx->p_xb2, POST_RESID);
    j.seg[0].resid = ctx->x;
    mm_run(&j);

    /* hb = silu(W1 @ xb) * (W3 @ xb) */
    const wmat *w13[2] = {&lw->w1, &lw->w3};
    prep(ctx, &act, ctx->x, lw->ffn_norm, ctx->xb, T, dim, w13, 2);
    j = (mm_job){.ctx = ctx, .act = &act};
    mm_add(&j, &lw->w1, ctx->p_hb, POST_SWIGLU);
    j.seg[0].w_up = &lw->w3;
    j.seg[0].out_up = ctx->p_hb2;
    mm_run(&j);

    /* x += W2 @ hb */
    const wmat *w2 = &lw->w2;
    prep(ctx, &act, NULL, NULL, ctx->hb, T, hid, &w2, 1);
    j = (mm_job){.ctx = ctx, .act = &act};
    mm_add(&j, &lw->w2, ctx->p_xb, POST_RESID);
    j.seg[0].resid = ctx->x;
    mm_run(&j);
}

/* The outputs of the final residual x (T, dim): each item's hidden rows, then the final
 * norm and classifier for the tokens whose logits are wanted (items with logits). */
static void run_head(model_ctx_t *ctx, const model_seq_batch *batch, int n)
{
    const model_t *m = ctx->m;
    const model_config *c = &m->cfg;
    const int dim = c->dim;
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
                batch[b].logits + (batch[b].logits_all ? (size_t)j * c->vocab_size : 0);
            R++;
        }
    }
    if (R == 0)
        return;
    kern_act act;
    const wmat *wout = &m->output;
    prep(ctx, &act, ctx->x, m->out_norm, ctx->xb, R, dim, &wout, 1);
    mm_job j = {.ctx = ctx, .act = &act};
    mm_add(&j, &m->output, ctx->out_dst, POST_NONE);
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
        run_block(ctx, kv, batch, &m->layers[l], l, T);
        if (cb)
            cb(l, ud);
    }
    run_head(ctx, batch, n);
    for (int b = 0; b < n; b++)
        kvcache_seq_set_len(kv, batch[b].seq, batch[b].pos + batch[b].n_tokens);
    return 0;
}

// --- MTP modules ("nextn")

const gguf_t *model_gguf(const model_t *m)
{
    return m->g;
}

model_nextn_t *model_nextn_load(const model_t *m, const gguf_t *g, int block, char *err,
                                size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    const model_config *c = &m->cfg;
    model_nextn_t *mod = calloc(1, sizeof(*mod));
    if (!mod) {
        set_err(err, errlen, gguf_path(g), "out of memory");
        return NULL;
    }
    int dim = c->dim, hid = c->hidden_dim, kv_dim = c->n_kv_head * c->head_dim;
    layer_weights *lw = &mod->blk;
    char nm[96];
#define NAME(s) (snprintf(nm, sizeof(nm), "blk.%d." s ".weight", block), nm)
    if (get_vec(g, NAME("nextn.hnorm"), dim, &mod->hnorm, err, errlen) != 0 ||
        get_vec(g, NAME("nextn.enorm"), dim, &mod->enorm, err, errlen) != 0 ||
        get_mat(g, NAME("nextn.eh_proj"), 2 * (uint64_t)dim, dim, &mod->eh_proj, err,
                errlen) != 0 ||
        get_vec(g, NAME("attn_norm"), dim, &lw->attn_norm, err, errlen) != 0 ||
        get_mat(g, NAME("attn_q"), dim, dim, &lw->wq, err, errlen) != 0 ||
        get_mat(g, NAME("attn_k"), dim, kv_dim, &lw->wk, err, errlen) != 0 ||
        get_mat(g, NAME("attn_v"), dim, kv_dim, &lw->wv, err, errlen) != 0 ||
        get_mat(g, NAME("attn_output"), dim, dim, &lw->wo, err, errlen) != 0 ||
        get_vec(g, NAME("ffn_norm"), dim, &lw->ffn_norm, err, errlen) != 0 ||
        get_mat(g, NAME("ffn_gate"), dim, hid, &lw->w1, err, errlen) != 0 ||
        get_mat(g, NAME("ffn_down"), hid, dim, &lw->w2, err, errlen) != 0 ||
        get_mat(g, NAME("ffn_up"), dim, hid, &lw->w3, err, errlen) != 0) {
        free(mod);
        return NULL;
    }
#undef NAME
    const wmat *ws[8] = {&mod->eh_proj, &lw->wq, &lw->wk, &lw->wv,
                         &lw->wo,       &lw->w1, &lw->w2, &lw->w3};
    for (int i = 0; i < 8; i++)
        mod->matmul_bytes += mat_bytes(ws[i]);
    return mod;
}

void model_nextn_destroy(model_nextn_t **mp)
{
    if (!mp || !*mp)
        return;
    free(*mp);
    *mp = NULL;
}

uint64_t model_nextn_matmul_bytes(const model_nextn_t *mod)
{
    return mod->matmul_bytes;
}

int model_forward_nextn(model_ctx_t *ctx, kvcache_t *kv, const model_nextn_t *mod, int kv_layer,
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
            rmsnorm(row, batch[b].hidden_in + (size_t)j * dim, mod->hnorm, dim, c->rms_eps);
            rmsnorm(row + dim, ctx->xb + (size_t)t * dim, mod->enorm, dim, c->rms_eps);
        }
    }
    /* x = eh_proj @ cat */
    kern_act act;
    const wmat *eh = &mod->eh_proj;
    prep(ctx, &act, NULL, NULL, ctx->cat, T, 2 * dim, &eh, 1);
    mm_job j = {.ctx = ctx, .act = &act};
    mm_add(&j, &mod->eh_proj, ctx->p_x, POST_NONE);
    mm_run(&j);

    run_block(ctx, kv, batch, &mod->blk, kv_layer, T);
    run_head(ctx, batch, n);
    return 0;
}
