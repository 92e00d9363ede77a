/*
 * kvcache: see kvcache.h.
 *
 * The pool is one zeroed float array of shape (n_layer, n_blocks, 2, block_size, kv_dim).
 * Free blocks sit on a LIFO stack (initially ordered so the lowest ids come out first);
 * each sequence slot owns a fixed-size block table of ceil(max_seq_len / block_size)
 * entries, allocated at start-up, so reserve/truncate/free never allocate. Accounting is
 * exact: n_free + sum over active sequences of their blocks == n_blocks at all times.
 */
#include "kvcache.h"

#include <stdlib.h>
#include <string.h>

#include "log.h"

typedef struct {
    int active;
    int len;      /* tokens whose KV is valid */
    int n_blocks; /* entries used in blocks */
    int *blocks;  /* (max_blocks_per_seq,) block ids */
} kv_seq;

struct kvcache {
    kvcache_params p;
    int kv_dim;
    int max_blocks_per_seq;
    float *pool;         /* (n_layer, n_blocks, 2, block_size, kv_dim) */
    size_t block_floats; /* 2 * block_size * kv_dim */
    int *free_stack;     /* (n_blocks,) free block ids; top is free_stack[n_free - 1] */
    int n_free;
    kv_seq *seqs;    /* (max_seqs,) */
    int *seq_tables; /* (max_seqs, max_blocks_per_seq) backing store of the tables */
};

kvcache_t *kvcache_new(const kvcache_params *p)
{
    if (!p || p->n_layer <= 0 || p->n_kv_head <= 0 || p->head_dim <= 0 || p->block_size <= 0 ||
        p->n_blocks <= 0 || p->max_seqs <= 0 || p->max_seq_len <= 0)
        return NULL;
    kvcache_t *kv = calloc(1, sizeof(*kv));
    if (!kv)
        return NULL;
    kv->p = *p;
    kv->kv_dim = p->n_kv_head * p->head_dim;
    kv->max_blocks_per_seq = (p->max_seq_len + p->block_size - 1) / p->block_size;
    kv->block_floats = 2 * (size_t)p->block_size * (size_t)kv->kv_dim;
    size_t total = (size_t)p->n_layer * (size_t)p->n_blocks * kv->block_floats;
    if (total / kv->block_floats / (size_t)p->n_layer != (size_t)p->n_blocks)
        goto fail;
    kv->pool = calloc(total, sizeof(float));
    kv->free_stack = malloc((size_t)p->n_blocks * sizeof(int));
    kv->seqs = calloc((size_t)p->max_seqs, sizeof(kv_seq));
    kv->seq_tables = malloc((size_t)p->max_seqs * (size_t)kv->max_blocks_per_seq * sizeof(int));
    if (!kv->pool || !kv->free_stack || !kv->seqs || !kv->seq_tables)
        goto fail;
    /* Stack top is the lowest id, so fresh allocations come out 0, 1, 2, ... */
    for (int i = 0; i < p->n_blocks; i++)
        kv->free_stack[i] = p->n_blocks - 1 - i;
    kv->n_free = p->n_blocks;
    for (int s = 0; s < p->max_seqs; s++)
        kv->seqs[s].blocks = kv->seq_tables + (size_t)s * (size_t)kv->max_blocks_per_seq;
    return kv;
fail:
    kvcache_destroy(&kv);
    return NULL;
}

void kvcache_destroy(kvcache_t **kvp)
{
    if (!kvp || !*kvp)
        return;
    kvcache_t *kv = *kvp;
    free(kv->pool);
    free(kv->free_stack);
    free(kv->seqs);
    free(kv->seq_tables);
    free(kv);
    *kvp = NULL;
}

const kvcache_params *kvcache_get_params(const kvcache_t *kv)
{
    return &kv->p;
}

const char *kvcache_status_str(kvcache_status_t s)
{
    switch (s) {
    case KVCACHE_OK:
        return "ok";
    case KVCACHE_NOSPACE:
        return "no free KV blocks";
    case KVCACHE_ERR:
        return "invalid KV cache request";
    }
    return "unknown";
}

static kv_seq *seq_get(const kvcache_t *kv, int seq)
{
    ASSERT(seq >= 0 && seq < kv->p.max_seqs);
    return &kv->seqs[seq];
}

int kvcache_seq_new(kvcache_t *kv)
{
    for (int s = 0; s < kv->p.max_seqs; s++) {
        if (!kv->seqs[s].active) {
            kv->seqs[s].active = 1;
            kv->seqs[s].len = 0;
            kv->seqs[s].n_blocks = 0;
            return s;
        }
    }
    return -1;
}

kvcache_status_t kvcache_seq_reserve(kvcache_t *kv, int seq, int n_tokens)
{
    if (seq < 0 || seq >= kv->p.max_seqs || !kv->seqs[seq].active)
        return KVCACHE_ERR;
    if (n_tokens < 0 || n_tokens > kv->p.max_seq_len)
        return KVCACHE_ERR;
    kv_seq *s = &kv->seqs[seq];
    int need = kvcache_blocks_for(kv, n_tokens) - s->n_blocks;
    if (need <= 0)
        return KVCACHE_OK;
    if (need > kv->n_free)
        return KVCACHE_NOSPACE;
    for (int i = 0; i < need; i++)
        s->blocks[s->n_blocks++] = kv->free_stack[--kv->n_free];
    return KVCACHE_OK;
}

/* Return the sequence's blocks past the first `keep` to the free stack, last first, so
 * that a later reserve hands them back in the same order. */
static void release_blocks(kvcache_t *kv, kv_seq *s, int keep)
{
    while (s->n_blocks > keep)
        kv->free_stack[kv->n_free++] = s->blocks[--s->n_blocks];
}

void kvcache_seq_truncate(kvcache_t *kv, int seq, int n_tokens)
{
    kv_seq *s = seq_get(kv, seq);
    ASSERT(s->active);
    ASSERT(n_tokens >= 0 && n_tokens <= s->n_blocks * kv->p.block_size);
    s->len = n_tokens;
    release_blocks(kv, s, kvcache_blocks_for(kv, n_tokens));
}

void kvcache_seq_set_len(kvcache_t *kv, int seq, int n_tokens)
{
    kv_seq *s = seq_get(kv, seq);
    ASSERT(s->active);
    ASSERT(n_tokens >= 0 && n_tokens <= s->n_blocks * kv->p.block_size);
    s->len = n_tokens;
}

int kvcache_seq_len(const kvcache_t *kv, int seq)
{
    return seq_get(kv, seq)->len;
}

int kvcache_seq_capacity(const kvcache_t *kv, int seq)
{
    return seq_get(kv, seq)->n_blocks * kv->p.block_size;
}

void kvcache_seq_free(kvcache_t *kv, int seq)
{
    kv_seq *s = seq_get(kv, seq);
    if (!s->active)
        return;
    release_blocks(kv, s, 0);
    s->len = 0;
    s->active = 0;
}

int kvcache_seq_active(const kvcache_t *kv, int seq)
{
    if (seq < 0 || seq >= kv->p.max_seqs)
        return 0;
    return kv->seqs[seq].active;
}

const int *kvcache_seq_blocks(const kvcache_t *kv, int seq, int *n_blocks)
{
    const kv_seq *s = seq_get(kv, seq);
    if (n_blocks)
        *n_blocks = s->n_blocks;
    return s->blocks;
}

float *kvcache_block_data(kvcache_t *kv, int layer, int block)
{
    ASSERT(layer >= 0 && layer < kv->p.n_layer);
    ASSERT(block >= 0 && block < kv->p.n_blocks);
    return kv->pool + ((size_t)layer * (size_t)kv->p.n_blocks + (size_t)block) * kv->block_floats;
}

size_t kvcache_block_bytes(const kvcache_t *kv)
{
    return kv->block_floats * sizeof(float);
}

float *kvcache_k(kvcache_t *kv, int layer, int seq, int pos)
{
    const kv_seq *s = seq_get(kv, seq);
    ASSERT(pos >= 0 && pos < s->n_blocks * kv->p.block_size);
    int bs = kv->p.block_size;
    return kvcache_block_data(kv, layer, s->blocks[pos / bs]) + (size_t)(pos % bs) * kv->kv_dim;
}

float *kvcache_v(kvcache_t *kv, int layer, int seq, int pos)
{
    return kvcache_k(kv, layer, seq, pos) + (size_t)kv->p.block_size * (size_t)kv->kv_dim;
}

int kvcache_n_free_blocks(const kvcache_t *kv)
{
    return kv->n_free;
}

int kvcache_n_blocks(const kvcache_t *kv)
{
    return kv->p.n_blocks;
}

int kvcache_blocks_for(const kvcache_t *kv, int n_tokens)
{
    if (n_tokens <= 0)
        return 0;
    return (n_tokens + kv->p.block_size - 1) / kv->p.block_size;
}
