/*
 * model: a decoder-only transformer of the Llama family loaded from GGUF (mmap), and its
 * forward pass (RMSNorm, RoPE as in the Llama reference, grouped-query attention, SwiGLU,
 * output head tied to the embedding when the file has no output.weight).
 *
 * With F32 weights it follows llama2.c's run.c numerically by default (same op order) so
 * greedy output reproduces it; F16 and Q8_0 weights use faster SIMD orders (kernels.h).
 * The forward pass works on a batch of sequences, each contributing a run of consecutive
 * tokens at its own position: one token (decode), several (verify), or a whole prompt
 * chunk (prefill). It writes each token's K/V into the paged cache and reads attention
 * over the sequence's own blocks. The forward pass never allocates: scratch buffers are
 * sized at model_ctx_new() for a maximum number of tokens per call. The matrix products
 * and attention are split over the context's threads by output rows (by token and KV
 * head for attention); every output element is computed by one thread in a fixed order,
 * so the logits depend neither on the thread count nor on the batch.
 */
#ifndef TP_MODEL_H
#define TP_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"
#include "kvcache.h"

typedef struct model model_t;
typedef struct model_ctx model_ctx_t;

/* Longest llama.context_length a model may declare (tokens; the gateway's bound too): it
 * sizes per-thread attention scratch, so a file cannot ask for more. */
#define MODEL_MAX_CTX (1 << 24)

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
/* model_load on a GGUF already open (gguf_open or gguf_open_mem): *g is consumed (the
 * model owns it from then on, or it is closed on failure; *g is set to NULL either way).
 * The same checks and messages as model_load. */
model_t *model_load_gguf(gguf_t **g, char *err, size_t errlen);
void model_destroy(model_t **m);
const model_config *model_get_config(const model_t *m);

/* Bytes of weights one forward pass reads: every layer's matrices and the classifier
 * (the embedding rows looked up are not counted). A batch-1 decode step streams this
 * much from memory; bench tools divide the read bandwidth by it for the roofline. */
uint64_t model_matmul_bytes(const model_t *m);

/* Kernel order of the matrix products (see kernels.h). AUTO: EXACT when every matrix of
 * the model is F32 (llama2.c run.c's order: greedy output matches run.c), FAST otherwise.
 * Q8_0 matrices always use the Q8 activation scheme. All threads and instruction sets
 * give bit-identical logits for a given choice; two processes that must agree (prefill
 * and decode workers) must make the same choice. */
typedef enum {
    MODEL_KERNEL_AUTO = 0,
    MODEL_KERNEL_EXACT,
    MODEL_KERNEL_FAST,
} model_kernel;

/* Instruction set of the kernels: AUTO is the best the CPU has; the others cap it (for
 * tests and benchmarks: every choice gives bit-identical results). */
typedef enum {
    MODEL_ISA_AUTO = 0,
    MODEL_ISA_SCALAR, /* portable C */
    MODEL_ISA_AVX2,   /* AVX2 + FMA + F16C */
    MODEL_ISA_AVX512, /* + AVX-512 F/BW/DQ/VL/VNNI */
} model_isa;

typedef struct {
    int max_tokens;      /* tokens per forward call (sum over the batch), >= 1 */
    int n_threads;       /* compute threads, counting the caller; 0 = CPUs available */
    model_kernel kernel; /* default AUTO */
    model_isa max_isa;   /* default AUTO */
} model_ctx_params;

/* max_tokens 512, n_threads 0 (CPUs available), kernel AUTO, max_isa AUTO. */
model_ctx_params model_ctx_default_params(void);

/* Scratch state and compute threads for forward passes of at most p->max_tokens tokens
 * per call. The threads (p->n_threads - 1 of them) sleep when no forward pass runs. One
 * context per calling thread: model_forward on one context must not run concurrently.
 * NULL on bad params, out of memory or failure to start the threads. */
model_ctx_t *model_ctx_new_params(const model_t *m, const model_ctx_params *p);

/* model_ctx_new_params with the default params and max_tokens. */
model_ctx_t *model_ctx_new(const model_t *m, int max_tokens);
/* Stop the threads and free; takes NULL; sets *ctx to NULL. */
void model_ctx_destroy(model_ctx_t **ctx);

/* Threads the context computes with (counting the caller). */
int model_ctx_n_threads(const model_ctx_t *ctx);
/* Tokens one forward call may carry (model_ctx_params.max_tokens). */
int model_ctx_max_tokens(const model_ctx_t *ctx);
/* Kernels in use, e.g. "avx2/fast" or "scalar/exact" (valid while ctx lives). */
const char *model_ctx_kernel_name(const model_ctx_t *ctx);

typedef struct {
    int seq;            /* kvcache sequence id */
    int pos;            /* position of tokens[0]; KV for [0, pos) must be in the cache */
    int n_tokens;       /* >= 1 */
    const int *tokens;  /* (n_tokens,) token ids */
    int logits_all;     /* 1: logits for every token; 0: for the last token only */
    float *logits;      /* out, caller-owned: (logits_all ? n_tokens : 1, vocab_size); may be
                         * NULL for model_forward_nextn (no head computed for the item) */
    /* Optional (zero = off). hidden: out, caller-owned, the residual stream after the last
     * block and BEFORE the final norm (MTP's h_0), (rows, dim) with rows = n_tokens when
     * hidden_all or logits_all, else 1 (the last token). hidden_in: model_forward_nextn
     * only, the hidden-state input of each token, (n_tokens, dim). */
    float *hidden;
    int hidden_all;
    const float *hidden_in;
} model_seq_batch;

/* Called after layer `layer` has written its K/V for every sequence of the batch. */
typedef void (*model_layer_cb)(int layer, void *ud);

/* Run the forward pass over n batch items. The cache must already have capacity for
 * [0, pos + n_tokens) of each sequence (kvcache_seq_reserve); on return each sequence's
 * length is pos + n_tokens. The cache may have more layers than the model (MTP modules'
 * KV lives in layers n_layer and up); the model uses layers [0, n_layer). cb may be NULL.
 * Returns 0, or -1 on invalid arguments (token id out of range, too many tokens, position
 * beyond n_ctx or capacity). */
int model_forward(model_ctx_t *ctx, kvcache_t *kv, const model_seq_batch *batch, int n,
                  model_layer_cb cb, void *ud);

/* ------------------------------------------------------------------------------------- */
/* Extra blocks outside the main stack: DeepSeek-V3 multi-token-prediction ("nextn")
 * modules (docs/mtp.md). A module k turns the hidden state h (dim) of a position and the
 * embedding of a token into x = eh_proj . [rmsnorm(h, hnorm) ; rmsnorm(E[tok], enorm)],
 * runs one ordinary llama block on x at the position (K/V in its own cache layer), and
 * reads logits through the model's final norm and output head. */
typedef struct model_nextn model_nextn_t;

/* The model's own GGUF file (borrowed, lives as long as the model): MTP modules may be
 * stored in it. */
const gguf_t *model_gguf(const model_t *m);

/* Load module tensors `blk.<block>.nextn.{hnorm,enorm,eh_proj}.weight` and the block's
 * `blk.<block>.{attn_norm,attn_q,...,ffn_up}.weight` from g (borrowed: must outlive the
 * module), with every shape checked against m's dimensions (F32, F16 or Q8_0 matrices;
 * F32 vectors). NULL with a message naming the file and tensor in err on failure. */
model_nextn_t *model_nextn_load(const model_t *m, const gguf_t *g, int block, char *err,
                                size_t errlen);
void model_nextn_destroy(model_nextn_t **mod);
/* Bytes of the module's matrices (eh_proj and the block; the shared head not counted). */
uint64_t model_nextn_matmul_bytes(const model_nextn_t *mod);

/* Run module mod over n batch items: item i's tokens at positions [pos, pos + n_tokens)
 * with hidden-state inputs hidden_in (n_tokens, dim); K/V go to cache layer kv_layer
 * (>= the model's n_layer, < the cache's) and attention reads that layer over [0, p] of
 * the item's sequence, so the layer must hold the module's K/V for [0, pos). Outputs per
 * item, each optional: logits (logits_all as in model_forward; NULL: no head) and hidden
 * (the module's output h_k, hidden_all / logits_all rows as in model_forward). Sequence
 * lengths are not changed (the main model owns them); positions need capacity and
 * pos <= the sequence's length. Same arithmetic and batch invariance as model_forward.
 * Returns 0, or -1 on invalid arguments. */
int model_forward_nextn(model_ctx_t *ctx, kvcache_t *kv, const model_nextn_t *mod, int kv_layer,
                        const model_seq_batch *batch, int n);

#endif
