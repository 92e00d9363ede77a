/*
 * model: a decoder-only transformer of the Llama family loaded from GGUF (mmap), and its
 * forward pass (RMSNorm, RoPE as in the Llama reference, grouped-query attention, SwiGLU,
 * output head tied to the embedding when the file has no output.weight).
 *
 * Follows llama2.c's run.c numerically (same op order) so greedy output reproduces it.
 * The forward pass works on a batch of sequences, each contributing a run of consecutive
 * tokens at its own position: one token (decode), several (verify), or a whole prompt
 * chunk (prefill). It writes each token's K/V into the paged cache and reads attention
 * over the sequence's own blocks. The forward pass never allocates: scratch buffers are
 * sized at model_ctx_new() for a maximum number of tokens per call.
 */
#ifndef TP_MODEL_H
#define TP_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "kvcache.h"

typedef struct model model_t;
typedef struct model_ctx model_ctx_t;

typedef struct {
    char name[64];     /* general.name */
    int dim;           /* embedding width */
    int hidden_dim;    /* FFN width */
    int n_layer;
    int n_head;
    int n_kv_head;
    int head_dim;      /* dim / n_head */
    int vocab_size;
    int n_ctx;         /* context length in tokens */
    float rms_eps;
    float rope_theta;
    int bos_id, eos_id;
    uint64_t fingerprint; /* XXH64 over the architecture keys, tensor table and weights */
} model_config;

/* mmap and validate a GGUF model file. On failure returns NULL and writes a message that
 * names the file and the problem into err (errlen bytes). The returned model is
 * read-only and may be shared by threads. */
model_t *model_load(const char *path, char *err, size_t errlen);
void model_destroy(model_t **m);
const model_config *model_get_config(const model_t *m);

/* Scratch state for forward passes of at most max_tokens tokens per call (sum over the
 * batch). One context per thread. NULL on out of memory. */
model_ctx_t *model_ctx_new(const model_t *m, int max_tokens);
void model_ctx_destroy(model_ctx_t **ctx);

typedef struct {
    int seq;            /* kvcache sequence id */
    int pos;            /* position of tokens[0]; KV for [0, pos) must be in the cache */
    int n_tokens;       /* >= 1 */
    const int *tokens;  /* (n_tokens,) token ids */
    int logits_all;     /* 1: logits for every token; 0: for the last token only */
    float *logits;      /* out, caller-owned: (logits_all ? n_tokens : 1, vocab_size) */
} model_seq_batch;

/* Called after layer `layer` has written its K/V for every sequence of the batch. */
typedef void (*model_layer_cb)(int layer, void *ud);

/* Run the forward pass over n batch items. The cache must already have capacity for
 * [0, pos + n_tokens) of each sequence (kvcache_seq_reserve); on return each sequence's
 * length is pos + n_tokens. cb may be NULL. Returns 0, or -1 on invalid arguments
 * (token id out of range, too many tokens, position beyond n_ctx or capacity). */
int model_forward(model_ctx_t *ctx, kvcache_t *kv, const model_seq_batch *batch, int n,
                  model_layer_cb cb, void *ud);

#endif
