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

struct mtp {
    const model_t *m;
    gguf_t *own;     /* the side file, or NULL when the modules are in the model file */
    const gguf_t *g; /* where the tensors are */
    int n_modules;
    model_nextn_t *mod[MTP_MAX_MODULES];
    uint64_t fingerprint;
    float rate[2];
    int has_rate;
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
