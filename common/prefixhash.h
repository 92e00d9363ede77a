/*
 * prefixhash: the chained block hashes of automatic prefix caching (docs/prefix-cache.md),
 * defined once for the two sides that compute them: the KV cache of a worker
 * (common/engine/kvcache.c keys its cached blocks on them) and the gateway's cache-aware
 * routing (gateway/cluster_route.c computes them from a prompt's token ids to match the
 * summaries workers report in HEARTBEAT "pfx").
 *
 * Block k of a prompt (block_size bs, lookahead la) is keyed on its token ids
 * tokens[k*bs, (k+1)*bs + la) (the la tokens after it: the MTP modules' K/V at position t
 * read the token t + k), as 32-bit ints in host byte order, and hashed as
 * h_k = XXH3-64(key_k, seed = h_{k-1}), h_{-1} = the chain seed
 * prefixhash_seed(model fingerprint, salt). The seed thus tells apart models and, through
 * the salt, caches whose blocks hold different layers (MTP modules written, and to which
 * depth). A hash names a block, it does not prove its content: the KV cache confirms a
 * match on the token ids; the gateway only uses it to guess where a prefix is cached.
 */
#ifndef TP_PREFIXHASH_H
#define TP_PREFIXHASH_H

#include <stdint.h>

/* The first parent hash of a chain: XXH3-64 of (model_fingerprint, salt); salt 0 for a
 * cache without MTP layers, mtp_fingerprint + depth with them (prefill_worker). */
uint64_t prefixhash_seed(uint64_t model_fingerprint, uint64_t salt);

/* One block's hash: XXH3-64 of key[0, n_key) (token ids) seeded with parent_hash (the
 * previous block's hash, or the chain seed for the first block). */
uint64_t prefixhash_block(uint64_t parent_hash, const int *key, int n_key);

/* The hashes of the full blocks of tokens[0, n_tokens) a cache could share: block k
 * counts while (k+1)*block_size <= max_cached and (k+1)*block_size + lookahead <= n_tokens
 * (max_cached caps the shared tokens: a worker always computes the last prompt token, and
 * with MTP the one before). Writes at most cap hashes into out and returns how many
 * (0 on a bad argument: block_size <= 0, lookahead < 0, NULL tokens). */
int prefixhash_chain(uint64_t seed, int block_size, int lookahead, const int *tokens,
                     int n_tokens, int max_cached, uint64_t *out, int cap);

#endif
