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
 * length (tokens whose KV is valid). Not thread-safe: one owner thread.
 *
 * Automatic prefix caching (vLLM's design, docs/prefix-cache.md): a full block that
 * kvcache_seq_commit_prefix() registers gets a hash, H(parent block's hash, its token ids),
 * XXH3-64 chained from a caller's seed (the model fingerprint, so that different models
 * never share), and keeps its token ids, its parent and the seed, so a hash match is
 * confirmed on the token ids and the whole chain (a collision never leaks another
 * request's KV). Blocks carry reference counts: kvcache_seq_attach_prefix() shares the
 * longest cached run of a new prompt's full blocks with a new sequence. A block is either
 * plain free, cached-but-free (refcount 0, hashed: on an LRU list, still reusable), or in
 * use by one or more sequences; a shared block is never written (only full prefix blocks
 * are shared, and the caller computes at least the last prompt token). Allocation takes
 * plain free blocks first, then evicts the least recently used cached-but-free block.
 * kvcache_n_free_blocks() counts both kinds of free blocks. Without commits nothing is
 * hashed and the cache behaves exactly as a plain paged pool.
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

/* Tokens past a block's end that its KV may depend on, at most (kvcache_seq_*_prefix
 * lookahead: the MTP modules' K/V at position t read the token t + k). */
#define KVCACHE_MAX_LOOKAHEAD 4

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
/* Release the sequence's blocks and slot: each block's refcount drops; a block no longer
 * used goes back to the free blocks (a hashed one to the most recent end of the LRU, the
 * sequence's last block first, so a chain's tail is evicted before its head). Idempotent
 * for a free slot. */
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

/* Blocks an allocation can take now: plain free plus cached-but-free (evictable). */
int kvcache_n_free_blocks(const kvcache_t *kv);
int kvcache_n_blocks(const kvcache_t *kv);
/* Blocks needed for n_tokens tokens: ceil(n_tokens / block_size). */
int kvcache_blocks_for(const kvcache_t *kv, int n_tokens);

// --- automatic prefix caching

/* The first parent hash of a chain (prefixhash_seed, common/prefixhash.h, the one
 * definition the gateway shares): XXH3-64 of (model fingerprint, salt), where salt tells
 * apart caches of one model whose blocks hold different layers (the MTP modules' layers
 * written or not, and to which depth). */
uint64_t kvcache_prefix_seed(uint64_t model_fingerprint, uint64_t salt);

/* The seed every worker uses for a request's blocks (prefill, decode and mixed alike, so
 * a prefill worker's hashes name the decode worker's blocks): kvcache_prefix_seed(model
 * fingerprint, 0) when the blocks hold no MTP module K/V (depth 0), else salted with the
 * modules' fingerprint + depth, the block keys then having `depth` tokens of lookahead. */
uint64_t kvcache_prefix_seed_mtp(uint64_t model_fingerprint, uint64_t mtp_fingerprint,
                                 int depth);

/* The chained hashes of tokens' full blocks as kvcache_seq_commit_prefix() registers them
 * (block k's key: tokens[k*bs, (k+1)*bs + lookahead), its parent the hash of block k - 1,
 * block 0's the seed), for block k with (k+1)*bs + lookahead <= n_tokens, at most max_blocks
 * of them, into out (room for max_blocks). Returns how many were written (0 for bad
 * arguments). A hash names a block only together with its token ids: lookups confirm both
 * (the KV hand-off lists them in KV_BEGIN "bh": docs/prefix-cache.md). */
int kvcache_prefix_hashes(const kvcache_t *kv, uint64_t seed, int lookahead, const int *tokens,
                          int n_tokens, int max_blocks, uint64_t *out);

/* The longest run of cached full blocks that holds tokens[0, n) for n <= max_cached
 * (n a multiple of block_size), block k matching only if tokens has `lookahead` tokens past
 * its end (block k's key is tokens[k*bs, (k+1)*bs + lookahead)). Writes the block ids to
 * blocks (room for n / block_size ids; may be NULL) and returns n (0 = nothing cached).
 * Touches nothing. lookahead in [0, KVCACHE_MAX_LOOKAHEAD]. */
int kvcache_prefix_lookup(const kvcache_t *kv, uint64_t seed, int lookahead, const int *tokens,
                          int n_tokens, int max_cached, int *blocks);

/* Give the new sequence `seq` (active, no blocks) the cached prefix kvcache_prefix_lookup()
 * finds: its blocks are shared (refcount + 1; a cached-but-free one leaves the LRU), and
 * the sequence's length is set to the tokens they hold. Returns those tokens (a multiple of
 * block_size, <= max_cached), 0 when nothing is cached, -1 for a bad argument. The caller
 * computes tokens from there on; blocks past them come from kvcache_seq_reserve(). */
int kvcache_seq_attach_prefix(kvcache_t *kv, int seq, uint64_t seed, int lookahead,
                              const int *tokens, int n_tokens, int max_cached);

/* Register the full blocks of `seq` whose KV is now final, so later prompts can share
 * them: block k when (k+1)*bs + lookahead <= n_tokens and (k+1)*bs <= the sequence's
 * length, tokens[0, n_tokens) being the tokens the sequence holds. A block already
 * registered (attached) is skipped; one whose content another block already caches stays
 * private. Call it only once the blocks are written for good. Returns the blocks newly
 * registered, or -1 for a bad argument. */
int kvcache_seq_commit_prefix(kvcache_t *kv, int seq, uint64_t seed, int lookahead,
                              const int *tokens, int n_tokens);

/* Forget every cached block: cached-but-free ones become plain free, hashed ones in use
 * become private (plain free once released). Returns the blocks that lost their hash. */
int kvcache_prefix_flush(kvcache_t *kv);

/* The cached blocks, for a summary of what this cache holds (HEARTBEAT "pfx", cache-aware
 * routing: docs/prefix-cache.md): for each hashed block its hash (prefixhash.h: a function
 * of its chain seed and the token ids of it and its ancestors), seed and lookahead (key
 * tokens past its end). Blocks in use come first (lowest id first), then the
 * cached-but-free ones, most recently used first, so a summary cut at cap keeps what is
 * least likely to be evicted. Writes at most cap entries to each array; returns how many. */
int kvcache_prefix_blocks(const kvcache_t *kv, uint64_t *hashes, uint64_t *seeds,
                          int *lookaheads, int cap);

/* Testing: keep only `bits` bits (0..64; 0 = every hash is 0) of every block hash from now
 * on, which forces collisions that the token-id confirmation must catch. Flushes the cache
 * first. */
void kvcache_set_hash_bits(kvcache_t *kv, int bits);

/* Blocks that carry a hash (cached-but-free plus in use). */
int kvcache_n_cached_blocks(const kvcache_t *kv);
/* Blocks cached-but-free (on the LRU), a subset of kvcache_n_free_blocks(). */
int kvcache_n_lru_blocks(const kvcache_t *kv);
/* References to `block` (sequences whose table holds it); 0 when free. */
int kvcache_block_refcount(const kvcache_t *kv, int block);
/* The LRU of cached-but-free blocks, least recently used first, into out (room for n);
 * returns how many were written. For tests and debugging. */
int kvcache_lru_blocks(const kvcache_t *kv, int *out, int n);

#endif
