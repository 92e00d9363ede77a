/*
 * mtp: see mtp.h. Loading validates the file against the base model and the semantics
 * this engine implements, then hands each module's tensors to model_nextn_load (which
 * checks every shape); the forward pass is model_forward_nextn on the module's cache
 * layer.
 */
#include "mtp.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "gguf.h"
#include "matvec.h"
#include "model_internal.h"

struct mtp {
    const model_t *m;
    gguf_t *own;     /* the side file, or NULL when the modules are in the model file */
    const gguf_t *g; /* where the tensors are */
    int n_modules;
    model_nextn_t *mod[MTP_MAX_MODULES];
    uint64_t fingerprint;
    float rate[2];
    int has_rate;
    int *rank;      /* (vocab,) token ids, most likely drafts first (mtp_draft_rank) */
    int n_draft;    /* draft vocabulary: rank[0 .. n_draft), or vocab (the full head) */
    kern_mat dhead; /* (n_draft, dim) the output matrix's rows rank[0 .. n_draft) */
    void *dhead_mem;
    float *dhead_mv; /* the matvec packing of dhead (F32, up to MODEL_MV_MAX_BYTES) or NULL */
};

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

int mtp_model_has_modules(const model_t *m)
{
    uint32_t n;
    return gguf_get_u32(model_gguf(m), "llama.nextn_predict_layers", &n) == 0 && n > 0;
}

/* An integer key that must equal want when present (required: must be present). */
static int check_u32(const gguf_t *g, const char *key, int want, int required, char *err,
                     size_t errlen)
{
    uint32_t v;
    if (gguf_find_key(g, key) < 0) {
        if (!required)
            return 0;
        set_err(err, errlen, gguf_path(g), "missing %s", key);
        return -1;
    }
    if (gguf_get_u32(g, key, &v) != 0 || (long long)v != want) {
        set_err(err, errlen, gguf_path(g), "%s does not match the base model (%d)", key, want);
        return -1;
    }
    return 0;
}

static int check_f32(const gguf_t *g, const char *key, float want, char *err, size_t errlen)
{
    float v;
    if (gguf_find_key(g, key) < 0)
        return 0;
    if (gguf_get_f32(g, key, &v) != 0 || v != want) {
        set_err(err, errlen, gguf_path(g), "%s does not match the base model (%g)", key,
                (double)want);
        return -1;
    }
    return 0;
}

/* A string key that must equal want when present. */
static int check_str(const gguf_t *g, const char *key, const char *want, char *err, size_t errlen)
{
    char v[64];
    if (gguf_find_key(g, key) < 0)
        return 0;
    if (gguf_get_str_copy(g, key, v, sizeof(v)) != 0) {
        set_err(err, errlen, gguf_path(g), "%s is not a string; this engine implements \"%s\"",
                key, want);
        return -1;
    }
    if (strcmp(v, want) != 0) {
        set_err(err, errlen, gguf_path(g), "%s is \"%s\"; this engine implements \"%s\"", key, v,
                want);
        return -1;
    }
    return 0;
}

static uint64_t fingerprint(const gguf_t *g, int L, int n_modules)
{
    XXH64_state_t *st = XXH64_createState();
    if (!st)
        return 0;
    XXH64_reset(st, 0x6d7470ULL); /* "mtp" */
    char prefix[32];
    for (int k = 0; k < n_modules; k++) {
        int n = snprintf(prefix, sizeof(prefix), "blk.%d.", L + k);
        for (int i = 0; i < gguf_n_tensors(g); i++) {
            const gguf_tensor_info *t = gguf_tensor(g, i);
            if (strncmp(t->name, prefix, (size_t)n) != 0)
                continue;
            uint32_t meta[2] = {(uint32_t)t->type, (uint32_t)t->n_dims};
            XXH64_update(st, t->name, strlen(t->name) + 1);
            XXH64_update(st, meta, sizeof(meta));
            XXH64_update(st, t->ne, sizeof(t->ne));
            XXH64_update(st, t->data, (size_t)t->n_bytes);
        }
    }
    uint64_t h = XXH64_digest(st);
    XXH64_freeState(st);
    return h;
}

// --- the draft vocabulary (FR-Spec, arXiv 2502.14856)

static int cmp_score(const void *a, const void *b, void *ud)
{
    const float *score = ud;
    int x = *(const int *)a, y = *(const int *)b;
    float sx = score[x], sy = score[y];
    if (sx != sy)
        return sx > sy ? -1 : 1;
    return x - y;
}

/* mt->rank: a permutation of the vocabulary, most likely draft first: the measured list in
 * the modules' file (`tidepool.mtp.draft_vocab`, token ids most frequent first) when there
 * is one; then EOS and BOS; then the normal tokens by the tokenizer's score, highest first
 * (BPE merge order: sentencepiece gives earlier merges, the more frequent pairs, higher
 * scores); then every other token (bytes, control, unused) by id. */
static int draft_rank(mtp_t *mt, const model_config *c)
{
    const int V = c->vocab_size;
    const gguf_t *mg = model_gguf(mt->m);
    char *used = calloc((size_t)V, 1);
    float *score = calloc((size_t)V, sizeof(float));
    int32_t *type = calloc((size_t)V, sizeof(int32_t));
    int32_t *list = NULL;
    int *rest = malloc((size_t)V * sizeof(int));
    int rc = -1, n = 0, nr = 0;
    if (!used || !score || !type || !rest)
        goto done;
    gguf_type et;
    uint64_t nl = 0;
    if (gguf_get_arr_info(mt->g, "tidepool.mtp.draft_vocab", &et, &nl) == 0 &&
        et == GGUF_TYPE_INT32 && nl > 0 && nl <= (uint64_t)V &&
        (list = malloc((size_t)nl * sizeof(int32_t))) &&
        gguf_get_arr_i32(mt->g, "tidepool.mtp.draft_vocab", list, nl) == 0) {
        for (uint64_t i = 0; i < nl; i++)
            if (list[i] >= 0 && list[i] < V && !used[list[i]]) {
                used[list[i]] = 1;
                mt->rank[n++] = list[i];
            }
    }
    const int special[2] = {c->eos_id, c->bos_id};
    for (int i = 0; i < 2; i++)
        if (special[i] >= 0 && special[i] < V && !used[special[i]]) {
            used[special[i]] = 1;
            mt->rank[n++] = special[i];
        }
    uint64_t ns = 0, nt = 0;
    int have_score = gguf_get_arr_info(mg, "tokenizer.ggml.scores", &et, &ns) == 0 &&
                     et == GGUF_TYPE_FLOAT32 && ns == (uint64_t)V &&
                     gguf_get_arr_f32(mg, "tokenizer.ggml.scores", score, ns) == 0;
    int have_type = gguf_get_arr_info(mg, "tokenizer.ggml.token_type", &et, &nt) == 0 &&
                    et == GGUF_TYPE_INT32 && nt == (uint64_t)V &&
                    gguf_get_arr_i32(mg, "tokenizer.ggml.token_type", type, nt) == 0;
    if (!have_score)
        memset(score, 0, (size_t)V * sizeof(float));
    for (int i = 0; i < V; i++) {
        if (used[i])
            continue;
        if (!have_type || type[i] == 1) /* GGUF token type 1: normal */
            rest[nr++] = i;
    }
    qsort_r(rest, (size_t)nr, sizeof(int), cmp_score, score);
    for (int i = 0; i < nr; i++) {
        used[rest[i]] = 1;
        mt->rank[n++] = rest[i];
    }
    for (int i = 0; i < V; i++)
        if (!used[i])
            mt->rank[n++] = i;
    rc = n == V ? 0 : -1;
done:
    free(used);
    free(score);
    free(type);
    free(list);
    free(rest);
    return rc;
}

/* Bytes of one row of matrix w. */
static size_t row_bytes(const kern_mat *w)
{
    switch (w->type) {
    case GGUF_TENSOR_Q8_0:
        return (size_t)w->cols / KERN_Q8_BLOCK * KERN_Q8_BLOCK_BYTES;
    case GGUF_TENSOR_F16:
        return (size_t)w->cols * 2;
    default:
        return (size_t)w->cols * 4;
    }
}

int mtp_set_draft_vocab(mtp_t *mt, int n)
{
    const model_config *c = model_get_config(mt->m);
    const kern_mat *out = &mt->m->output;
    if (n <= 0 || n >= c->vocab_size) {
        free(mt->dhead_mem);
        free(mt->dhead_mv);
        mt->dhead_mem = NULL;
        mt->dhead_mv = NULL;
        mt->n_draft = c->vocab_size;
        return 0;
    }
    size_t rb = row_bytes(out);
    char *mem = aligned_alloc(64, (rb * (size_t)n + 63) / 64 * 64);
    if (!mem)
        return -1;
    /* the rows in the file layout (the loaded output matrix may be repacked), then the
     * draft head gets the same packing the model's matrices get */
    for (int i = 0; i < n; i++)
        kern_row_gguf(out, mt->rank[i], mem + rb * (size_t)i);
    kern_mat head = {.data = mem, .type = out->type, .rows = n, .cols = out->cols};
    size_t qb = out->layout == KERN_LAYOUT_Q8X8 ? kern_q8x8_bytes(n, out->cols) : 0;
    if (qb) {
        char *q = aligned_alloc(64, (qb + 63) / 64 * 64);
        if (!q) {
            free(mem);
            return -1;
        }
        kern_mat packed;
        if (kern_q8x8_pack(&head, q, 0, n / 8, &packed) == 0) {
            head = packed;
            free(mem);
            mem = q;
        } else {
            free(q); /* a quant of -128: the rows keep the file layout */
        }
    }
    float *mv = NULL;
    size_t mvf = matvec_packed_floats(n, out->cols);
    if (out->type == GGUF_TENSOR_F32 && mvf * sizeof(float) <= MODEL_MV_MAX_BYTES) {
        mv = aligned_alloc(32, (mvf * sizeof(float) + 31) & ~(size_t)31);
        if (!mv) {
            free(mem);
            return -1;
        }
        matvec_pack_f32((const float *)mem, n, out->cols, mv);
    }
    free(mt->dhead_mem);
    free(mt->dhead_mv);
    mt->dhead_mem = mem;
    mt->dhead_mv = mv;
    mt->dhead = head;
    mt->n_draft = n;
    return 0;
}

int mtp_default_draft_vocab(const mtp_t *mt)
{
    const int V = model_get_config(mt->m)->vocab_size;
    int n = V / MTP_DRAFT_VOCAB_DIV;
    return n < MTP_DRAFT_VOCAB_MIN ? (V < MTP_DRAFT_VOCAB_MIN ? V : MTP_DRAFT_VOCAB_MIN) : n;
}

int mtp_draft_vocab(const mtp_t *mt)
{
    return mt->n_draft;
}

const int *mtp_draft_ids(const mtp_t *mt)
{
    return mt->rank;
}

const int *mtp_draft_map(const mtp_t *mt)
{
    return mt->n_draft < model_get_config(mt->m)->vocab_size ? mt->rank : NULL;
}

int mtp_forward_draft(model_ctx_t *ctx, kvcache_t *kv, const mtp_t *mt, int k,
                      const model_seq_batch *batch, int n)
{
    if (k < 1 || k > mt->n_modules)
        return -1;
    const kern_mat *head = mt->n_draft < model_get_config(mt->m)->vocab_size ? &mt->dhead : NULL;
    return model_forward_nextn_head(ctx, kv, mt->mod[k - 1], mtp_kv_layer(mt, k), head,
                                    head ? mt->dhead_mv : NULL, batch, n);
}

/* Load the modules from side (a side file, consumed) or, when side is NULL, from the
 * model file itself. */
static mtp_t *load(const model_t *m, gguf_t *side, char *err, size_t errlen)
{
    const model_config *c = model_get_config(m);
    const int is_side = side != NULL;
    mtp_t *mt = calloc(1, sizeof(*mt));
    if (!mt) {
        set_err(err, errlen, side ? gguf_path(side) : "mtp", "out of memory");
        gguf_close(&side);
        return NULL;
    }
    mt->m = m;
    mt->own = side;
    mt->g = side ? side : model_gguf(m);
    const gguf_t *g = mt->g;
    const char *gp = gguf_path(g);
    uint32_t nextn;
    if (gguf_get_u32(g, "llama.nextn_predict_layers", &nextn) != 0 || nextn == 0 || nextn > 64) {
        set_err(err, errlen, gp, "no MTP modules (llama.nextn_predict_layers missing or 0)");
        goto fail;
    }
    char arch[32];
    if (gguf_get_str_copy(g, "general.architecture", arch, sizeof(arch)) == 0 &&
        strcmp(arch, "llama") != 0) {
        set_err(err, errlen, gp, "general.architecture is \"%s\", want \"llama\"", arch);
        goto fail;
    }
    /* the side file names the BASE block count; the model file counts the modules too */
    int want_blocks = c->n_layer + (is_side ? 0 : (int)nextn);
    int kv_heads = c->n_kv_head;
    if (check_u32(g, "llama.block_count", want_blocks, 1, err, errlen) != 0 ||
        check_u32(g, "llama.embedding_length", c->dim, 1, err, errlen) != 0 ||
        check_u32(g, "llama.feed_forward_length", c->hidden_dim, 1, err, errlen) != 0 ||
        check_u32(g, "llama.attention.head_count", c->n_head, 1, err, errlen) != 0 ||
        check_u32(g, "llama.attention.head_count_kv", kv_heads, 0, err, errlen) != 0 ||
        check_u32(g, "llama.vocab_size", c->vocab_size, 0, err, errlen) != 0 ||
        check_u32(g, "llama.context_length", c->n_ctx, 0, err, errlen) != 0 ||
        check_u32(g, "llama.rope.dimension_count", c->head_dim, 0, err, errlen) != 0 ||
        check_f32(g, "llama.rope.freq_base", c->rope_theta, err, errlen) != 0 ||
        check_f32(g, "llama.attention.layer_norm_rms_epsilon", c->rms_eps, err, errlen) != 0 ||
        check_str(g, "tidepool.rope.pairing", "adjacent", err, errlen) != 0 ||
        check_str(g, "tidepool.mtp.rope_position", "hidden", err, errlen) != 0 ||
        check_str(g, "tidepool.mtp.hidden_input", "pre_final_norm", err, errlen) != 0 ||
        check_str(g, "tidepool.mtp.head", "shared", err, errlen) != 0)
        goto fail;
    if (gguf_find_key(g, "llama.attention.head_count_kv") < 0 && c->n_kv_head != c->n_head) {
        set_err(err, errlen, gp, "missing llama.attention.head_count_kv (the base has %d)",
                c->n_kv_head);
        goto fail;
    }
    mt->n_modules = nextn < MTP_MAX_MODULES ? (int)nextn : MTP_MAX_MODULES;
    for (int k = 0; k < mt->n_modules; k++) {
        char nm[96];
        int blk = c->n_layer + k;
        /* DeepSeek-V3 files may give each module its own head: not this engine's math */
        snprintf(nm, sizeof(nm), "blk.%d.nextn.shared_head_head.weight", blk);
        if (gguf_find_tensor(g, nm)) {
            set_err(err, errlen, gp, "%s: per-module output heads are not supported", nm);
            goto fail;
        }
        snprintf(nm, sizeof(nm), "blk.%d.nextn.shared_head_norm.weight", blk);
        if (gguf_find_tensor(g, nm)) {
            set_err(err, errlen, gp, "%s: per-module head norms are not supported", nm);
            goto fail;
        }
        mt->mod[k] = model_nextn_load(m, g, blk, err, errlen);
        if (!mt->mod[k])
            goto fail;
    }
    gguf_type et;
    uint64_t n_rate;
    if (gguf_get_arr_info(g, "tidepool.mtp.acceptance_rate", &et, &n_rate) == 0 &&
        et == GGUF_TYPE_FLOAT32 && n_rate == 2 &&
        gguf_get_arr_f32(g, "tidepool.mtp.acceptance_rate", mt->rate, 2) == 0 &&
        mt->rate[0] >= 0.0f && mt->rate[0] <= 1.0f && mt->rate[1] >= 0.0f && mt->rate[1] <= 1.0f)
        mt->has_rate = 1;
    mt->fingerprint = fingerprint(g, c->n_layer, mt->n_modules);
    mt->rank = malloc((size_t)c->vocab_size * sizeof(int));
    if (!mt->rank || draft_rank(mt, c) != 0) {
        set_err(err, errlen, gp, "out of memory");
        goto fail;
    }
    mt->n_draft = c->vocab_size;
    if (mtp_set_draft_vocab(mt, mtp_default_draft_vocab(mt)) != 0) {
        set_err(err, errlen, gp, "out of memory");
        goto fail;
    }
    return mt;
fail:
    mtp_destroy(&mt);
    return NULL;
}

mtp_t *mtp_load(const model_t *m, const char *path, char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    gguf_t *side = NULL;
    if (path && !(side = gguf_open(path, err, errlen)))
        return NULL;
    return load(m, side, err, errlen);
}

mtp_t *mtp_load_gguf(const model_t *m, gguf_t **side, char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    gguf_t *g = *side;
    *side = NULL;
    return load(m, g, err, errlen);
}

void mtp_destroy(mtp_t **mp)
{
    if (!mp || !*mp)
        return;
    mtp_t *mt = *mp;
    for (int k = 0; k < MTP_MAX_MODULES; k++)
        model_nextn_destroy(&mt->mod[k]);
    gguf_close(&mt->own);
    free(mt->rank);
    free(mt->dhead_mem);
    free(mt->dhead_mv);
    free(mt);
    *mp = NULL;
}

static int file_exists(const char *p)
{
    return access(p, R_OK) == 0;
}

int mtp_default_path(const model_t *m, const char *model_path, char *out, size_t cap)
{
    char name[128], dir[PATH_MAX];
    if (!model_path || !*model_path)
        return -1;
    const char *slash = strrchr(model_path, '/');
    if (slash)
        snprintf(dir, sizeof(dir), "%.*s", (int)(slash - model_path), model_path);
    else
        snprintf(dir, sizeof(dir), ".");
    const char *nm = model_get_config(m)->name;
    if (nm[0] && !strchr(nm, '/')) {
        snprintf(name, sizeof(name), "%s", nm);
    } else {
        const char *base = slash ? slash + 1 : model_path;
        size_t n = strlen(base);
        if (n > 5 && strcmp(base + n - 5, ".gguf") == 0)
            n -= 5;
        snprintf(name, sizeof(name), "%.*s", (int)(n < 100 ? n : 100), base);
    }
    char cand[4][PATH_MAX + 160];
    int nc = 0;
    snprintf(cand[nc++], sizeof(cand[0]), "%s/%s-mtp.gguf", dir, name);
    snprintf(cand[nc++], sizeof(cand[0]), "%s/mtp/%s-mtp.gguf", dir, name);
    snprintf(cand[nc++], sizeof(cand[0]), "models/mtp/%s-mtp.gguf", name);
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n > 0) {
        exe[n] = '\0';
        for (int up = 0; up < 3; up++) { /* <repo>/<build>/bin/<program> */
            char *s = strrchr(exe, '/');
            if (!s)
                break;
            *s = '\0';
        }
        snprintf(cand[nc++], sizeof(cand[0]), "%s/models/mtp/%s-mtp.gguf", exe, name);
    }
    for (int i = 0; i < nc; i++) {
        if (file_exists(cand[i]) && strlen(cand[i]) < cap) {
            snprintf(out, cap, "%s", cand[i]);
            return 0;
        }
    }
    return -1;
}

int mtp_n_modules(const mtp_t *mt)
{
    return mt->n_modules;
}

const char *mtp_path(const mtp_t *mt)
{
    return gguf_path(mt->g);
}

uint64_t mtp_fingerprint(const mtp_t *mt)
{
    return mt->fingerprint;
}

int mtp_kv_layer(const mtp_t *mt, int k)
{
    return model_get_config(mt->m)->n_layer + k - 1;
}

uint64_t mtp_matmul_bytes(const mtp_t *mt, int k)
{
    return k >= 1 && k <= mt->n_modules ? model_nextn_matmul_bytes(mt->mod[k - 1]) : 0;
}

int mtp_acceptance_rate(const mtp_t *mt, float rate[2])
{
    if (!mt->has_rate)
        return -1;
    rate[0] = mt->rate[0];
    rate[1] = mt->rate[1];
    return 0;
}

int mtp_forward(model_ctx_t *ctx, kvcache_t *kv, const mtp_t *mt, int k,
                const model_seq_batch *batch, int n)
{
    if (k < 1 || k > mt->n_modules)
        return -1;
    return model_forward_nextn(ctx, kv, mt->mod[k - 1], mtp_kv_layer(mt, k), batch, n);
}
