/*
 * kvcache: see kvcache.h.
 *
 * The pool is one zeroed float array of shape (n_layer, n_blocks, 2, block_size, kv_dim).
 * Plain free blocks sit on a LIFO stack (initially ordered so the lowest ids come out
 * first); each sequence slot owns a fixed-size block table of ceil(max_seq_len /
 * block_size) entries, allocated at start-up, so reserve/truncate/free never allocate.
 *
 * Prefix caching: every block has a reference count (table entries naming it) and, once
 * registered, a hash, its key (the token ids it was computed from: its own block_size plus
 * up to KVCACHE_MAX_LOOKAHEAD following ones, in a (n_blocks, block_size + 4) array made at
 * start-up), its seed and its parent (block id and that block's generation when the child
 * was registered). Hashed blocks sit in a chained hash table (n_buckets a power of two >=
 * 2 n_blocks; the chains run through the blocks, so no allocation). A match needs hash,
 * seed, key and parent (same block, same generation) equal: a block that loses its hash
 * bumps its generation, which orphans its cached children instead of letting them match
 * under a new parent. Hashed blocks with refcount 0 are on a doubly linked LRU (head =
 * least recently used, evicted first). Accounting is exact: plain free + LRU + blocks with
 * refcount > 0 == n_blocks at all times.
 */
#include "kvcache.h"

#include <stdlib.h>
#include <string.h>
#include "log.h"
#include "prefixhash.h"

typedef struct {
    int ref;             /* sequences holding it */
    int hashed;          /* registered in the hash table */
    int n_key;           /* tokens of its key: block_size + lookahead */
    int parent;          /* block id of the previous block of its chain, -1 = first */
    uint32_t parent_gen; /* parent's generation when this one was registered */
    uint32_t gen;        /* bumped whenever the block loses its hash */
    uint64_t seed;       /* chain seed (model) */
    uint64_t hash;       /* H(parent's hash or the seed, key) */
    int hnext;           /* next block of its hash bucket, -1 */
    int lprev, lnext;    /* LRU links while cached-but-free, -1 */
} kv_block;

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
    int *free_stack;     /* (n_blocks,) plain free block ids; top is free_stack[n_free - 1] */
    int n_free;          /* plain free blocks */
    kv_seq *seqs;        /* (max_seqs,) */
    int *seq_tables;     /* (max_seqs, max_blocks_per_seq) backing store of the tables */
    kv_block *blk;       /* (n_blocks,) */
    int *keys;           /* (n_blocks, key_stride) token ids of each hashed block's key */
    int key_stride;      /* block_size + KVCACHE_MAX_LOOKAHEAD */
    int *buckets;        /* (n_buckets,) first block of each hash chain, -1 */
    uint64_t n_buckets;
    uint64_t hash_mask; /* kept bits of block hashes */
    int lru_head, lru_tail, n_lru;
    int n_hashed;
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
    kv->hash_mask = UINT64_MAX;
    kv->key_stride = p->block_size + KVCACHE_MAX_LOOKAHEAD;
    kv->n_buckets = 1;
    while (kv->n_buckets < 2 * (uint64_t)p->n_blocks)
        kv->n_buckets <<= 1;
    kv->blk = calloc((size_t)p->n_blocks, sizeof(kv_block));
    kv->keys = malloc((size_t)p->n_blocks * (size_t)kv->key_stride * sizeof(int));
    kv->buckets = malloc(kv->n_buckets * sizeof(int));
    if (!kv->pool || !kv->free_stack || !kv->seqs || !kv->seq_tables || !kv->blk || !kv->keys ||
        !kv->buckets)
        goto fail;
    for (uint64_t i = 0; i < kv->n_buckets; i++)
        kv->buckets[i] = -1;
    for (int i = 0; i < p->n_blocks; i++)
        kv->blk[i] = (kv_block){.parent = -1, .hnext = -1, .lprev = -1, .lnext = -1};
    kv->lru_head = kv->lru_tail = -1;
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
    free(kv->blk);
    free(kv->keys);
    free(kv->buckets);
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

// --- blocks: LRU, hash table, allocation

static void lru_remove(kvcache_t *kv, int b)
{
    kv_block *x = &kv->blk[b];
    if (x->lprev >= 0)
        kv->blk[x->lprev].lnext = x->lnext;
    else
        kv->lru_head = x->lnext;
    if (x->lnext >= 0)
        kv->blk[x->lnext].lprev = x->lprev;
    else
        kv->lru_tail = x->lprev;
    x->lprev = x->lnext = -1;
    kv->n_lru--;
}

/* Append b at the most recently used end. */
static void lru_push(kvcache_t *kv, int b)
{
    kv_block *x = &kv->blk[b];
    x->lnext = -1;
    x->lprev = kv->lru_tail;
    if (kv->lru_tail >= 0)
        kv->blk[kv->lru_tail].lnext = b;
    else
        kv->lru_head = b;
    kv->lru_tail = b;
    kv->n_lru++;
}

static int *bucket_of(const kvcache_t *kv, uint64_t h)
{
    return &kv->buckets[h & (kv->n_buckets - 1)];
}

/* Take b out of the hash table; its generation changes, so its children never match. */
static void unhash(kvcache_t *kv, int b)
{
    kv_block *x = &kv->blk[b];
    ASSERT(x->hashed);
    int *link = bucket_of(kv, x->hash);
    while (*link != b) {
        ASSERT(*link >= 0);
        link = &kv->blk[*link].hnext;
    }
    *link = x->hnext;
    x->hnext = -1;
    x->hashed = 0;
    x->gen++;
    kv->n_hashed--;
}

/* A block for a new owner (refcount 1): a plain free one, else the least recently used
 * cached-but-free one, evicted. The caller checked that one exists. */
static int block_take(kvcache_t *kv)
{
    int b;
    if (kv->n_free > 0) {
        b = kv->free_stack[--kv->n_free];
    } else {
        b = kv->lru_head;
        ASSERT(b >= 0);
        lru_remove(kv, b);
        unhash(kv, b);
    }
    ASSERT(kv->blk[b].ref == 0);
    kv->blk[b].ref = 1;
    return b;
}

static uint64_t key_hash(const kvcache_t *kv, uint64_t parent_hash, const int *key, int n_key)
{
    return prefixhash_block(parent_hash, key, n_key) & kv->hash_mask;
}

/* The hashed block with this hash whose seed, parent (id and generation) and key are
 * these, or -1. Collisions of the hash alone never match. */
static int find(const kvcache_t *kv, uint64_t seed, uint64_t h, int parent, const int *key,
                int n_key)
{
    for (int b = *bucket_of(kv, h); b >= 0; b = kv->blk[b].hnext) {
        const kv_block *x = &kv->blk[b];
        if (x->hash != h || x->seed != seed || x->n_key != n_key || x->parent != parent)
            continue;
        if (parent >= 0 && x->parent_gen != kv->blk[parent].gen)
            continue;
        if (memcmp(kv->keys + (size_t)b * (size_t)kv->key_stride, key,
                   (size_t)n_key * sizeof(int)) == 0)
            return b;
    }
    return -1;
}

// --- sequences

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
    if (need > kv->n_free + kv->n_lru)
        return KVCACHE_NOSPACE;
    for (int i = 0; i < need; i++)
        s->blocks[s->n_blocks++] = block_take(kv);
    return KVCACHE_OK;
}

/* Drop one reference to block b; unused, it goes to the LRU (hashed) or the free stack. */
static void block_release(kvcache_t *kv, int b)
{
    kv_block *x = &kv->blk[b];
    ASSERT(x->ref > 0);
    if (--x->ref > 0)
        return;
    if (x->hashed)
        lru_push(kv, b);
    else
        kv->free_stack[kv->n_free++] = b;
}

/* Return the sequence's blocks past the first `keep`, last first, so that a later reserve
 * hands plain ones back in the same order and a chain's tail is evicted before its head. */
static void release_blocks(kvcache_t *kv, kv_seq *s, int keep)
{
    while (s->n_blocks > keep)
        block_release(kv, s->blocks[--s->n_blocks]);
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
    return kv->n_free + kv->n_lru;
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

// --- automatic prefix caching

uint64_t kvcache_prefix_seed(uint64_t model_fingerprint, uint64_t salt)
{
    return prefixhash_seed(model_fingerprint, salt);
}

uint64_t kvcache_prefix_seed_mtp(uint64_t model_fingerprint, uint64_t mtp_fingerprint,
                                 int depth)
{
    return kvcache_prefix_seed(model_fingerprint,
                               depth > 0 ? mtp_fingerprint + (uint64_t)depth : 0);
}

int kvcache_prefix_hashes(const kvcache_t *kv, uint64_t seed, int lookahead, const int *tokens,
                          int n_tokens, int max_blocks, uint64_t *out)
{
    if (!tokens || !out || n_tokens <= 0 || lookahead < 0 || lookahead > KVCACHE_MAX_LOOKAHEAD)
        return 0;
    const int bs = kv->p.block_size;
    uint64_t ph = seed & kv->hash_mask;
    int k = 0;
    for (; k < max_blocks && (k + 1) * bs + lookahead <= n_tokens; k++) {
        ph = key_hash(kv, ph, tokens + (size_t)k * bs, bs + lookahead);
        out[k] = ph;
    }
    return k;
}

int kvcache_prefix_lookup(const kvcache_t *kv, uint64_t seed, int lookahead, const int *tokens,
                          int n_tokens, int max_cached, int *blocks)
{
    if (!tokens || n_tokens <= 0 || lookahead < 0 || lookahead > KVCACHE_MAX_LOOKAHEAD)
        return 0;
    const int bs = kv->p.block_size;
    if (max_cached > kv->p.max_seq_len)
        max_cached = kv->p.max_seq_len;
    uint64_t ph = seed & kv->hash_mask;
    int prev = -1, n = 0;
    for (int k = 0;; k++) {
        int end = (k + 1) * bs;
        if (end > max_cached || end + lookahead > n_tokens)
            break;
        const int *key = tokens + (size_t)k * bs;
        uint64_t h = key_hash(kv, ph, key, bs + lookahead);
        int b = find(kv, seed, h, prev, key, bs + lookahead);
        if (b < 0)
            break;
        if (blocks)
            blocks[k] = b;
        ph = h;
        prev = b;
        n = end;
    }
    return n;
}

int kvcache_seq_attach_prefix(kvcache_t *kv, int seq, uint64_t seed, int lookahead,
                              const int *tokens, int n_tokens, int max_cached)
{
    if (seq < 0 || seq >= kv->p.max_seqs || !kv->seqs[seq].active || kv->seqs[seq].n_blocks)
        return -1;
    if (lookahead < 0 || lookahead > KVCACHE_MAX_LOOKAHEAD)
        return -1;
    kv_seq *s = &kv->seqs[seq];
    int n = kvcache_prefix_lookup(kv, seed, lookahead, tokens, n_tokens, max_cached, s->blocks);
    int nb = n / kv->p.block_size;
    for (int k = 0; k < nb; k++) {
        kv_block *x = &kv->blk[s->blocks[k]];
        if (x->ref == 0)
            lru_remove(kv, s->blocks[k]);
        x->ref++;
    }
    s->n_blocks = nb;
    s->len = n;
    return n;
}

int kvcache_seq_commit_prefix(kvcache_t *kv, int seq, uint64_t seed, int lookahead,
                              const int *tokens, int n_tokens)
{
    if (seq < 0 || seq >= kv->p.max_seqs || !kv->seqs[seq].active || !tokens)
        return -1;
    if (lookahead < 0 || lookahead > KVCACHE_MAX_LOOKAHEAD)
        return -1;
    const kv_seq *s = &kv->seqs[seq];
    const int bs = kv->p.block_size, n_key = bs + lookahead;
    uint64_t ph = seed & kv->hash_mask;
    int prev = -1, added = 0;
    for (int k = 0; k < s->n_blocks; k++) {
        int end = (k + 1) * bs;
        if (end > s->len || end + lookahead > n_tokens)
            break;
        const int *key = tokens + (size_t)k * bs;
        uint64_t h = key_hash(kv, ph, key, n_key);
        int b = s->blocks[k];
        kv_block *x = &kv->blk[b];
        if (x->hashed) { /* attached, or committed before */
            if (x->hash != h || x->seed != seed)
                break; /* another chain's block: the rest cannot be registered */
            ph = h;
            prev = b;
            continue;
        }
        int dup = find(kv, seed, h, prev, key, n_key);
        if (dup >= 0) { /* computed twice: this copy stays private */
            ph = h;
            prev = dup;
            continue;
        }
        x->hashed = 1;
        x->hash = h;
        x->seed = seed;
        x->n_key = n_key;
        x->parent = prev;
        x->parent_gen = prev >= 0 ? kv->blk[prev].gen : 0;
        memcpy(kv->keys + (size_t)b * (size_t)kv->key_stride, key, (size_t)n_key * sizeof(int));
        int *head = bucket_of(kv, h);
        x->hnext = *head;
        *head = b;
        kv->n_hashed++;
        added++;
        ph = h;
        prev = b;
    }
    return added;
}

int kvcache_prefix_flush(kvcache_t *kv)
{
    int n = 0;
    for (int b = 0; b < kv->p.n_blocks; b++) {
        if (!kv->blk[b].hashed)
            continue;
        unhash(kv, b);
        n++;
        if (kv->blk[b].ref == 0) {
            lru_remove(kv, b);
            kv->free_stack[kv->n_free++] = b;
        }
    }
    return n;
}

void kvcache_set_hash_bits(kvcache_t *kv, int bits)
{
    ASSERT(bits >= 0 && bits <= 64);
    kvcache_prefix_flush(kv);
    kv->hash_mask = bits == 64 ? UINT64_MAX : (1ULL << bits) - 1;
}

int kvcache_n_cached_blocks(const kvcache_t *kv)
{
    return kv->n_hashed;
}

int kvcache_n_lru_blocks(const kvcache_t *kv)
{
    return kv->n_lru;
}

int kvcache_block_refcount(const kvcache_t *kv, int block)
{
    ASSERT(block >= 0 && block < kv->p.n_blocks);
    return kv->blk[block].ref;
}

int kvcache_lru_blocks(const kvcache_t *kv, int *out, int n)
{
    int i = 0;
    for (int b = kv->lru_head; b >= 0 && i < n; b = kv->blk[b].lnext)
        out[i++] = b;
    return i;
}

int kvcache_prefix_blocks(const kvcache_t *kv, uint64_t *hashes, uint64_t *seeds,
                          int *lookaheads, int cap)
{
    int n = 0;
    for (int b = 0; b < kv->p.n_blocks && n < cap; b++) {
        const kv_block *x = &kv->blk[b];
        if (!x->hashed || x->ref == 0)
            continue;
        hashes[n] = x->hash;
        seeds[n] = x->seed;
        lookaheads[n++] = x->n_key - kv->p.block_size;
    }
    for (int b = kv->lru_tail; b >= 0 && n < cap; b = kv->blk[b].lprev) {
        const kv_block *x = &kv->blk[b];
        hashes[n] = x->hash;
        seeds[n] = x->seed;
        lookaheads[n++] = x->n_key - kv->p.block_size;
    }
    return n;
}
