/*
 * model: see model.h. This file loads the model (GGUF, mmapped) and makes the forward
 * context; the forward pass itself is model_forward.c.
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
 * a thread costs more than they do; then each matrix is one kernel call, not chunks.
 * Medium ones (model_forward.c's PAR_WAKE_WORK) do too when no worker is awake: on a
 * busy machine a woken worker preempts the caller.
 *
 * EXACT-order F32 models (stories260K) have their matrices packed per context for matvec
 * (ctx_pack_mv; models up to MODEL_MV_MAX_BYTES): their products run with 8 output rows
 * in the SIMD lanes instead of 8 tokens (kern_matmul's token-lane kernel leaves 7 of 8
 * lanes idle at T = 1, and on stories260K's shapes it is 1.2-2x slower at every T up to
 * 256), and the attention scores (EXACT order, any model) with 8 positions in the lanes;
 * each lane is run.c's chain, so the bits do not change.
 *
 * Weights are F32, F16 or Q8_0 (any mix); the token embedding row is converted to float
 * on lookup. Weight layout is the GGUF/ggml one: a matrix W (out, in) is row-major,
 * ne = {in, out}, mmapped; except that Q8_0 matrices with out % 8 == 0 are copied at load
 * into the interleaved KERN_LAYOUT_Q8X8 (kernels.h: 8 rows' blocks side by side, one
 * linear stream, the 8 scales in one load), which the Q8_0 kernels read faster (batch-1
 * decode of the 1B Q8_0 model: see docs/bench.md); the numbers, and so every result, are
 * the same. The copy is anonymous memory the size of those matrices; the token embedding
 * stays mapped (its rows are looked up one by one).
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
#include "matvec.h"
#include "model_internal.h"
#include "threadpool.h"

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
    out->layout = KERN_LAYOUT_GGUF;
    out->type = t->type;
    out->rows = (int)rows;
    out->cols = (int)cols;
    return 0;
}

/* Replace the Q8_0 matrices among ws[0..n) that have a Q8X8 form by Q8X8 copies in one new
 * 64-byte aligned allocation, returned in *owned (NULL when none). Returns 0, -1 when
 * out of memory. */
static int pack_q8(wmat *const *ws, int n, void **owned)
{
    size_t total = 0;
    *owned = NULL;
    for (int i = 0; i < n; i++)
        if (ws[i]->type == GGUF_TENSOR_Q8_0 && ws[i]->layout == KERN_LAYOUT_GGUF)
            total += kern_q8x8_bytes(ws[i]->rows, ws[i]->cols);
    if (total == 0)
        return 0;
    /* (MADV_HUGEPAGE on it was tried: with the kernel's defrag=madvise, the direct
     * compaction at first touch made a 1B Q8_0 load take 26-33 s instead of 7 on a busy
     * machine; not kept) */
    uint8_t *buf = aligned_alloc(64, total); /* every group is a multiple of 64 bytes */
    if (!buf)
        return -1;
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        size_t b = ws[i]->type == GGUF_TENSOR_Q8_0 && ws[i]->layout == KERN_LAYOUT_GGUF
                       ? kern_q8x8_bytes(ws[i]->rows, ws[i]->cols)
                       : 0;
        if (b == 0)
            continue;
        wmat packed;
        if (kern_q8x8_pack(ws[i], buf + off, 0, ws[i]->rows / 8, &packed) == 0)
            *ws[i] = packed;
        off += b;
    }
    *owned = buf;
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
    gguf_t *g = gguf_open(path, err, errlen);
    if (!g)
        return NULL;
    return model_load_gguf(&g, err, errlen);
}

model_t *model_load_gguf(gguf_t **gp, char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    gguf_t *g = *gp;
    *gp = NULL;
    const char *path = gguf_path(g);
    model_t *m = calloc(1, sizeof(*m));
    if (!m) {
        set_err(err, errlen, path, "out of memory");
        gguf_close(&g);
        return NULL;
    }
    m->g = g;
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
    if (c->n_ctx < 2 || c->n_ctx > MODEL_MAX_CTX) {
        /* it sizes the attention scratch of every thread: a file's word must not */
        set_err(err, errlen, path, "llama.context_length %d is outside [2, %d]", c->n_ctx,
                MODEL_MAX_CTX);
        goto fail;
    }
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
    /* every block has 9 tensors, and the file the embedding and the final norm too: a
     * block count beyond them is refused before the per-block table is allocated from it */
    if ((uint64_t)c->n_layer * 9 + 2 > (uint64_t)gguf_n_tensors(g)) {
        set_err(err, errlen, path, "llama.block_count %d needs %llu tensors, the file has %d",
                c->n_layer, (unsigned long long)c->n_layer * 9 + 2, gguf_n_tensors(g));
        goto fail;
    }
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
    {
        int nw = 1 + 7 * c->n_layer;
        wmat **ws = malloc((size_t)nw * sizeof(*ws));
        if (!ws) {
            set_err(err, errlen, path, "out of memory");
            goto fail;
        }
        ws[0] = &m->output;
        for (int l = 0; l < c->n_layer; l++) {
            layer_weights *lw = &m->layers[l];
            wmat *lws[7] = {&lw->wq, &lw->wk, &lw->wv, &lw->wo, &lw->w1, &lw->w2, &lw->w3};
            memcpy(ws + 1 + 7 * l, lws, sizeof(lws));
        }
        int prc = pack_q8(ws, nw, &m->packed);
        free(ws);
        if (prc != 0) {
            set_err(err, errlen, path, "out of memory (repacking the Q8_0 weights)");
            goto fail;
        }
    }
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
    free(m->packed);
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

/* The matrices of layer l in mv order (wq, wk, wv, wo, w1, w3, w2); l == n_layer: the
 * classifier alone. Returns how many. */
static int mv_mats(const model_t *m, int l, const wmat **out)
{
    if (l == m->cfg.n_layer) {
        out[0] = &m->output;
        return 1;
    }
    const layer_weights *lw = &m->layers[l];
    const wmat *w[MODEL_MV_PER_LAYER] = {&lw->wq, &lw->wk, &lw->wv, &lw->wo,
                                         &lw->w1, &lw->w3, &lw->w2};
    memcpy(out, w, sizeof(w));
    return MODEL_MV_PER_LAYER;
}

/* Pack the F32 matrices for matvec when the context computes in the EXACT order with
 * AVX2 and they are small enough (MODEL_MV_MAX_BYTES); 0, or -1 out of memory. */
static int ctx_pack_mv(model_ctx_t *ctx)
{
    const model_t *m = ctx->m;
    const int L = m->cfg.n_layer, n_slots = (L + 1) * MODEL_MV_PER_LAYER;
    ctx->mv = calloc((size_t)n_slots, sizeof(*ctx->mv));
    if (!ctx->mv)
        return -1;
    if (ctx->order != KERN_ORDER_EXACT || ctx->isa < KERN_ISA_AVX2)
        return 0;
    size_t floats = 0;
    const wmat *w[MODEL_MV_PER_LAYER];
    for (int l = 0; l <= L; l++)
        for (int k = 0, nk = mv_mats(m, l, w); k < nk; k++)
            if (w[k]->type == GGUF_TENSOR_F32)
                floats += matvec_packed_floats(w[k]->rows, w[k]->cols);
    if (floats == 0 || floats * sizeof(float) > MODEL_MV_MAX_BYTES)
        return 0;
    ctx->mv_buf = aligned_alloc(32, (floats * sizeof(float) + 31) & ~(size_t)31);
    if (!ctx->mv_buf)
        return -1;
    float *d = ctx->mv_buf;
    for (int l = 0; l <= L; l++)
        for (int k = 0, nk = mv_mats(m, l, w); k < nk; k++) {
            if (w[k]->type != GGUF_TENSOR_F32)
                continue;
            matvec_pack_f32(w[k]->data, w[k]->rows, w[k]->cols, d);
            ctx->mv[l * MODEL_MV_PER_LAYER + k] = d;
            d += matvec_packed_floats(w[k]->rows, w[k]->cols);
        }
    return 0;
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
    /* model_forward.c: runs of tokens, n_head score rows of n_ctx (at least 8: the lanes of
     * matvec_attend_rows_exact) */
    ctx->att_len = (size_t)(c->n_head > 8 ? c->n_head : 8) * (size_t)c->n_ctx;
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
        !ctx->tok_pos || !ctx->out_dst || ctx_pack_mv(ctx) != 0) {
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
    free(ctx->mv);
    free(ctx->mv_buf);
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

// --- MTP modules ("nextn")

const gguf_t *model_gguf(const model_t *m)
{
    return m->g;
}

static int nextn_pack_mv(model_nextn_t *mod);

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
    wmat *pw[8] = {&mod->eh_proj, &lw->wq, &lw->wk, &lw->wv, &lw->wo, &lw->w1, &lw->w2, &lw->w3};
    if (pack_q8(pw, 8, &mod->packed) != 0 || nextn_pack_mv(mod) != 0) {
        set_err(err, errlen, gguf_path(g), "out of memory (repacking the module's weights)");
        free(mod->packed);
        free(mod);
        return NULL;
    }
    return mod;
}

/* Pack a module's F32 matrices for matvec, in mv_mats' order then eh_proj, when all of
 * them are F32 and take at most MODEL_MV_MAX_BYTES (else none: mod->mv stays NULL). A
 * module pass is a decode step's size, so at T = 1 it wants the row-lane kernel as much as
 * the model's own layers. 0, or -1 out of memory. */
static int nextn_pack_mv(model_nextn_t *mod)
{
    const layer_weights *lw = &mod->blk;
    const wmat *w[MODEL_MV_PER_LAYER + 1] = {&lw->wq, &lw->wk, &lw->wv, &lw->wo,
                                             &lw->w1, &lw->w3, &lw->w2, &mod->eh_proj};
    size_t floats = 0;
    for (int k = 0; k <= MODEL_MV_PER_LAYER; k++) {
        if (w[k]->type != GGUF_TENSOR_F32)
            return 0;
        floats += matvec_packed_floats(w[k]->rows, w[k]->cols);
    }
    if (floats * sizeof(float) > MODEL_MV_MAX_BYTES)
        return 0;
    mod->mv_buf = aligned_alloc(32, (floats * sizeof(float) + 31) & ~(size_t)31);
    if (!mod->mv_buf)
        return -1;
    float *d = mod->mv_buf;
    for (int k = 0; k <= MODEL_MV_PER_LAYER; k++) {
        matvec_pack_f32(w[k]->data, w[k]->rows, w[k]->cols, d);
        mod->mv[k] = d;
        d += matvec_packed_floats(w[k]->rows, w[k]->cols);
    }
    return 0;
}

void model_nextn_destroy(model_nextn_t **mp)
{
    if (!mp || !*mp)
        return;
    free((*mp)->mv_buf);
    free((*mp)->packed);
    free(*mp);
    *mp = NULL;
}

uint64_t model_nextn_matmul_bytes(const model_nextn_t *mod)
{
    return mod->matmul_bytes;
}
