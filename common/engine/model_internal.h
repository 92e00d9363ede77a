/*
 * model_internal: the model's and the context's structures, shared by model.c (loading,
 * configuration, the context and its buffers) and model_forward.c (the forward pass). Not
 * a public interface (model.h is).
 */
#ifndef TP_MODEL_INTERNAL_H
#define TP_MODEL_INTERNAL_H

#include <stdint.h>

#include "gguf.h"
#include "kernels.h"
#include "model.h"
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

#define MODEL_MV_PER_LAYER 7
/* Models whose F32 matrices take more bytes than this are not packed (the copy would
 * double their memory; batch-1 decode of a big model is bound by memory, not lanes). */
#define MODEL_MV_MAX_BYTES ((size_t)64 << 20)

struct model_nextn {
    const float *hnorm, *enorm; /* (dim,) */
    wmat eh_proj;               /* (dim, 2 * dim): [hidden half | embedding half] */
    layer_weights blk;
    uint64_t matmul_bytes;
    void *packed; /* owned: the Q8X8 copies of the Q8_0 matrices, or NULL */
    /* matvec packing of the F32 matrices (as model_ctx's mv): mv[k] for the block's k-th
     * matrix in mv_mats' order, mv[MODEL_MV_PER_LAYER] for eh_proj; all NULL when not F32
     * or bigger than MODEL_MV_MAX_BYTES. Used by contexts that use their own (EXACT, AVX2+). */
    const float *mv[MODEL_MV_PER_LAYER + 1];
    float *mv_buf;
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
    void *packed;          /* owned: the Q8X8 copies of the Q8_0 matrices, or NULL */
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
    size_t att_len;          /* n_head * n_ctx: scores of the kv_mul query heads of one KV head for up to n_kv_head tokens */
    float *scratch;          /* (n_threads, scratch_len) kernel scratch */
    size_t scratch_len;
    float *rope;     /* (max_tokens, head_dim): cos, sin per pair */
    void *pack;      /* kern_pack_bytes(max_tokens, max(dim, hidden_dim)), AVX-512 */
    int *tok_item;   /* (max_tokens,) batch item of each token */
    int *tok_pos;    /* (max_tokens,) position of each token */
    float **out_dst; /* (max_tokens,) logits destination of each output row */
    float **p_q, **p_k, **p_v, **p_xb, **p_xb2, **p_hb, **p_hb2; /* (max_tokens,) row ptrs */
    float **p_x;                                                 /* (max_tokens,) rows of x */
    /* EXACT-order F32 matrices packed for matvec (row-vectorised, used for every T):
     * mv[l * MODEL_MV_PER_LAYER + k] for layer l's k-th matrix (wq, wk,
     * wv, wo, w1, w3, w2), mv[n_layer * MODEL_MV_PER_LAYER] for the classifier; NULL where
     * not packed (another type, FAST order, scalar isa, or a model too big to copy). */
    const float **mv;
    float *mv_buf; /* the packed matrices, one allocation */
};

/* model_forward_nextn with another classifier: head (rows, dim), in the output matrix's
 * type, NULL for the model's output matrix; each wanted logit row is head->rows floats
 * (row r = dot(head row r, final-normed h)). Used for MTP drafts over a subset of the
 * vocabulary (mtp.h, mtp_set_draft_vocab): the rows are the output matrix's own, so each
 * logit is bit-identical to the full head's at that token. */
/* head_mv: head's matvec packing (matvec_pack_f32) or NULL; used only when ctx uses packed
 * matrices (model_ctx_uses_mv). */
int model_forward_nextn_head(model_ctx_t *ctx, kvcache_t *kv, const model_nextn_t *mod,
                             int kv_layer, const kern_mat *head, const float *head_mv,
                             const model_seq_batch *batch, int n);

/* 1 when ctx computes its F32 products from matvec-packed copies (EXACT order, AVX2 or
 * wider): packed copies made elsewhere (MTP modules, draft heads) are then used too. */
static inline int model_ctx_uses_mv(const model_ctx_t *ctx)
{
    return ctx->order == KERN_ORDER_EXACT && ctx->isa >= KERN_ISA_AVX2;
}

#endif
