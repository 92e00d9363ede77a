/*
 * kvcache: paged KV cache with exact block accounting (vLLM's PagedAttention layout).
 *
 * Memory is one pool allocated at start-up: n_blocks blocks of block_size token slots.
 * Storage of one block of one layer is contiguous, shape (2, block_size, kv_dim) float32
 * (K rows then V rows, kv_dim = n_kv_head * head_dim), so that a layer's KV can be exported
 * and imported block by block (kvtransfer sends exactly these bytes). Pool layout:
 * (n_layer, n_blocks, 2, block_size, kv_dim).
 *
 * A sequence is a slot id in [0, max_seqs) with a block table (list of block ids) and a
 * length (tokens whose KV is valid). Every block is either free or owned by exactly one
 * sequence. Not thread-safe: one owner thread.
 */
#ifndef TP_KVCACHE_H
#define TP_KVCACHE_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvcache kvcache_t;

typedef enum {
    KVCACHE_OK = 0,
    KVCACHE_NOSPACE, /* not enough free blocks now (may succeed later) */
    KVCACHE_ERR,     /* bad argument (unknown sequence, beyond max_seq_len) */
} kvcache_status_t;

typedef struct {
    int n_layer;
    int n_kv_head;
    int head_dim;
    int block_size;  /* tokens per block, default 16 */
    int n_blocks;    /* blocks in the pool */
    int max_seqs;    /* sequence slots */
    int max_seq_len; /* tokens per sequence at most (the model context) */
} kvcache_params;

/* Allocate the pool (zeroed). Returns NULL on bad params or out of memory. */
kvcache_t *kvcache_new(const kvcache_params *p);
/* Free the cache; takes NULL; sets *kv to NULL. */
void kvcache_destroy(kvcache_t **kv);
const kvcache_params *kvcache_get_params(const kvcache_t *kv);
const char *kvcache_status_str(kvcache_status_t s);

/* Take a free sequence slot (length 0, no blocks). Returns the id, or -1 if none is free. */
int kvcache_seq_new(kvcache_t *kv);
/* Make sure `seq` has blocks for n_tokens token slots in total (allocating what is
 * missing). NOSPACE leaves the sequence unchanged. */
kvcache_status_t kvcache_seq_reserve(kvcache_t *kv, int seq, int n_tokens);
/* Set the valid length to n_tokens (<= capacity) and release blocks past what n_tokens
 * needs (rollback of rejected draft tokens, or shrink). */
void kvcache_seq_truncate(kvcache_t *kv, int seq, int n_tokens);
/* Set the valid length (after a forward pass or an import wrote the slots). */
void kvcache_seq_set_len(kvcache_t *kv, int seq, int n_tokens);
int kvcache_seq_len(const kvcache_t *kv, int seq);
/* Token slots the sequence's blocks hold (n_blocks * block_size). */
int kvcache_seq_capacity(const kvcache_t *kv, int seq);
/* Release the sequence's blocks and slot. Idempotent for a free slot. */
void kvcache_seq_free(kvcache_t *kv, int seq);
/* Whether the slot is in use. */
int kvcache_seq_active(const kvcache_t *kv, int seq);

/* Block table of a sequence (borrowed, valid until the next reserve/truncate/free). */
const int *kvcache_seq_blocks(const kvcache_t *kv, int seq, int *n_blocks);

/* Storage of one block of one layer: (2, block_size, kv_dim) float32. */
float *kvcache_block_data(kvcache_t *kv, int layer, int block);
/* Bytes of kvcache_block_data(): 2 * block_size * kv_dim * sizeof(float). */
size_t kvcache_block_bytes(const kvcache_t *kv);

/* K and V rows (kv_dim floats) of token `pos` of `seq` in `layer`; pos < capacity. */
float *kvcache_k(kvcache_t *kv, int layer, int seq, int pos);
float *kvcache_v(kvcache_t *kv, int layer, int seq, int pos);

int kvcache_n_free_blocks(const kvcache_t *kv);
int kvcache_n_blocks(const kvcache_t *kv);
/* Blocks needed for n_tokens tokens: ceil(n_tokens / block_size). */
int kvcache_blocks_for(const kvcache_t *kv, int n_tokens);

#endif
