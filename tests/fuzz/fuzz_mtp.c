/*
 * fuzz_mtp: MTP side files (common/engine/mtp.c) from arbitrary GGUF bytes, loaded for a
 * small synthetic base model (fuzz_tiny_default: dim 8, one layer) through mtp_load_gguf.
 * A side file that loads runs every module once over the base model's hidden states.
 * Properties: no crash, leak or undefined behaviour; a loaded file has 1..MTP_MAX_MODULES
 * modules, cache layers after the base's, and an acceptance rate in [0, 1] when it has one.
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "kvcache.h"
#include "model.h"
#include "mtp.h"

static model_t *g_base;
static model_ctx_t *g_ctx;
static uint8_t *g_base_bytes;

static void setup(void)
{
    fuzz_quiet();
    fuzz_tiny_spec s = fuzz_tiny_default();
    size_t n = 0;
    unsigned char *b = fuzz_tiny_bytes(&s, &n);
    FUZZ_CHECK(b != NULL);
    g_base_bytes = fuzz_aligned_copy(b, n);
    free(b);
    char err[512];
    gguf_t *g = gguf_open_mem(g_base_bytes, n, "base.gguf", err, sizeof(err));
    FUZZ_CHECK(g != NULL);
    g_base = model_load_gguf(&g, err, sizeof(err));
    FUZZ_CHECK(g_base != NULL);
    model_ctx_params p = model_ctx_default_params();
    p.max_tokens = 2;
    p.n_threads = 1;
    g_ctx = model_ctx_new_params(g_base, &p);
    FUZZ_CHECK(g_ctx != NULL);
}

static void run_modules(const mtp_t *mt)
{
    const model_config *c = model_get_config(g_base);
    int nm = mtp_n_modules(mt);
    kvcache_params kp = {c->n_layer + nm, c->n_kv_head, c->head_dim, 4, 2, 1, c->n_ctx};
    kvcache_t *kv = kvcache_new(&kp);
    FUZZ_CHECK(kv != NULL);
    int seq = kvcache_seq_new(kv);
    FUZZ_CHECK(seq >= 0 && kvcache_seq_reserve(kv, seq, 2) == KVCACHE_OK);
    enum { T = 2, D = 8, V = 16 };
    FUZZ_CHECK(c->dim == D && c->vocab_size == V);
    int toks[T] = {c->bos_id, 3};
    float logits[T * V], h0[T * D], h1[T * D];
    model_seq_batch b = {.seq = seq, .n_tokens = T, .tokens = toks, .logits_all = 1,
                         .logits = logits, .hidden = h0};
    FUZZ_CHECK(model_forward(g_ctx, kv, &b, 1, NULL, NULL) == 0);
    const float *hin = h0;
    for (int k = 1; k <= nm; k++) {
        model_seq_batch bk = {.seq = seq, .n_tokens = 1, .tokens = toks + 1, .logits = logits,
                              .hidden = h1, .hidden_in = hin};
        FUZZ_CHECK(mtp_forward(g_ctx, kv, mt, k, &bk, 1) == 0);
        hin = h1;
    }
    kvcache_destroy(&kv);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int ready;
    if (!ready) {
        setup();
        ready = 1;
    }
    uint8_t *copy = fuzz_aligned_copy(data, size);
    char err[512];
    gguf_t *g = gguf_open_mem(copy, size, "side.gguf", err, sizeof(err));
    mtp_t *mt = g ? mtp_load_gguf(g_base, &g, err, sizeof(err)) : NULL;
    FUZZ_CHECK(g == NULL);
    if (!mt) {
        FUZZ_CHECK(strncmp(err, "side.gguf: ", 11) == 0);
        free(copy);
        return 0;
    }
    int nm = mtp_n_modules(mt);
    FUZZ_CHECK(nm >= 1 && nm <= MTP_MAX_MODULES);
    for (int k = 1; k <= nm; k++)
        FUZZ_CHECK(mtp_kv_layer(mt, k) == model_get_config(g_base)->n_layer + k - 1);
    float rate[2];
    if (mtp_acceptance_rate(mt, rate) == 0)
        FUZZ_CHECK(rate[0] >= 0 && rate[0] <= 1 && rate[1] >= 0 && rate[1] <= 1);
    run_modules(mt);
    mtp_destroy(&mt);
    free(copy);
    return 0;
}
