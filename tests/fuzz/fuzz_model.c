/*
 * fuzz_model: model loading (common/engine/model.c) from arbitrary GGUF bytes: everything
 * a file controls (keys, shapes, types, offsets) goes through model_load_gguf, and a model
 * that loads runs a forward pass over three tokens (every weight is read through the
 * shapes and types the file gave). Properties: no crash, leak or undefined behaviour; a
 * loaded model's configuration is consistent (head sizes, vocabulary, BOS/EOS ids); a
 * refused one says why, and never "out of memory" (sizes are checked against the file
 * before anything is allocated from them).
 * Models past small limits (context, widths) skip the forward pass: their scratch memory
 * is a start-up cost, not a decoding problem.
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "kvcache.h"
#include "model.h"

static void run_forward(const model_t *m)
{
    const model_config *c = model_get_config(m);
    if (c->n_ctx > 512 || c->dim > 512 || c->hidden_dim > 2048 || c->n_layer > 16 ||
        c->vocab_size > 65536 || c->n_head > 64)
        return;
    model_ctx_params p = model_ctx_default_params();
    p.max_tokens = 3;
    p.n_threads = 1;
    model_ctx_t *ctx = model_ctx_new_params(m, &p);
    FUZZ_CHECK(ctx != NULL);
    kvcache_params kp = {c->n_layer, c->n_kv_head, c->head_dim, 4, 2, 1, c->n_ctx};
    kvcache_t *kv = kvcache_new(&kp);
    FUZZ_CHECK(kv != NULL);
    int seq = kvcache_seq_new(kv);
    int n = c->n_ctx < 3 ? c->n_ctx : 3;
    FUZZ_CHECK(seq >= 0 && kvcache_seq_reserve(kv, seq, n) == KVCACHE_OK);
    int toks[3] = {c->bos_id, c->eos_id, c->vocab_size - 1};
    float *logits = malloc((size_t)n * (size_t)c->vocab_size * sizeof(float));
    float *hidden = malloc((size_t)n * (size_t)c->dim * sizeof(float));
    FUZZ_CHECK(logits && hidden);
    model_seq_batch b = {.seq = seq, .pos = 0, .n_tokens = n, .tokens = toks, .logits_all = 1,
                         .logits = logits, .hidden = hidden, .hidden_all = 1};
    FUZZ_CHECK(model_forward(ctx, kv, &b, 1, NULL, NULL) == 0);
    FUZZ_CHECK(kvcache_seq_len(kv, seq) == n);
    free(logits);
    free(hidden);
    kvcache_destroy(&kv);
    model_ctx_destroy(&ctx);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int ready;
    if (!ready) {
        fuzz_quiet();
        ready = 1;
    }
    uint8_t *copy = fuzz_aligned_copy(data, size);
    char err[512];
    gguf_t *g = gguf_open_mem(copy, size, "fuzz.gguf", err, sizeof(err));
    model_t *m = g ? model_load_gguf(&g, err, sizeof(err)) : NULL;
    FUZZ_CHECK(g == NULL);
    if (!m) {
        FUZZ_CHECK(strncmp(err, "fuzz.gguf: ", 11) == 0);
        /* a small file never makes the loader allocate beyond what it holds (the message
         * may quote the file, which may say anything: compare it whole) */
        FUZZ_CHECK(strcmp(err, "fuzz.gguf: out of memory") != 0);
        free(copy);
        return 0;
    }
    const model_config *c = model_get_config(m);
    FUZZ_CHECK(c->dim > 0 && c->n_head > 0 && c->n_kv_head > 0 && c->n_layer > 0);
    FUZZ_CHECK(c->head_dim * c->n_head == c->dim && c->n_head % c->n_kv_head == 0);
    FUZZ_CHECK(c->bos_id >= 0 && c->bos_id < c->vocab_size);
    FUZZ_CHECK(c->eos_id >= 0 && c->eos_id < c->vocab_size);
    FUZZ_CHECK(c->n_ctx >= 1);
    run_forward(m);
    model_destroy(&m);
    free(copy);
    return 0;
}
