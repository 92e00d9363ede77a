/* prefixhash: see prefixhash.h. XXH3-64 (libxxhash) over the token ids' bytes. */
#include "prefixhash.h"

#include <stddef.h>
#include <xxhash.h>

uint64_t prefixhash_seed(uint64_t model_fingerprint, uint64_t salt)
{
    uint64_t v[2] = {model_fingerprint, salt};
    return XXH3_64bits_withSeed(v, sizeof(v), 0x707265666978ULL); /* "prefix" */
}

uint64_t prefixhash_block(uint64_t parent_hash, const int *key, int n_key)
{
    return XXH3_64bits_withSeed(key, (size_t)n_key * sizeof(int), parent_hash);
}

int prefixhash_chain(uint64_t seed, int block_size, int lookahead, const int *tokens,
                     int n_tokens, int max_cached, uint64_t *out, int cap)
{
    if (block_size <= 0 || lookahead < 0 || !tokens || !out)
        return 0;
    uint64_t h = seed;
    int k = 0;
    for (; k < cap; k++) {
        long long end = (long long)(k + 1) * block_size;
        if (end > max_cached || end + lookahead > n_tokens)
            break;
        h = prefixhash_block(h, tokens + (size_t)k * (size_t)block_size, block_size + lookahead);
        out[k] = h;
    }
    return k;
}
