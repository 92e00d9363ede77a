/*
 * test_kvcache: the KV cache's automatic prefix caching (kvcache.h): chained block hashes
 * confirmed on token ids, reference counts, the LRU of cached-but-free blocks, eviction,
 * lookahead keys, flush, and exact accounting (no block leaks). The paged pool itself is
 * tested in test_engine.c (test_kvcache_*).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "kvcache.h"
#include "prefixhash.h"

#define SEED 0x1234ULL

static kvcache_t *cache(int block_size, int n_blocks, int max_seqs)
{
    kvcache_params p = {.n_layer = 2,
                        .n_kv_head = 1,
                        .head_dim = 4,
                        .block_size = block_size,
                        .n_blocks = n_blocks,
                        .max_seqs = max_seqs,
                        .max_seq_len = 64};
    kvcache_t *kv = kvcache_new(&p);
    assert_non_null(kv);
    return kv;
}

/* A sequence computed from scratch: n tokens' blocks reserved, length n, committed. Returns
 * the sequence and the blocks it registered through *n_reg. */
static int computed(kvcache_t *kv, uint64_t seed, int la, const int *tok, int n, int *n_reg)
{
    int s = kvcache_seq_new(kv);
    assert_true(s >= 0);
    assert_int_equal(kvcache_seq_reserve(kv, s, n), KVCACHE_OK);
    kvcache_seq_set_len(kv, s, n);
    int r = kvcache_seq_commit_prefix(kv, s, seed, la, tok, n);
    assert_true(r >= 0);
    if (n_reg)
        *n_reg = r;
    return s;
}

static void assert_blocks(kvcache_t *kv, int seq, const int *want, int n)
{
    int nb = 0;
    const int *b = kvcache_seq_blocks(kv, seq, &nb);
    assert_int_equal(nb, n);
    for (int i = 0; i < n; i++)
        assert_int_equal(b[i], want[i]);
}

static void assert_lru(kvcache_t *kv, const int *want, int n)
{
    int got[64];
    assert_int_equal(kvcache_lru_blocks(kv, got, 64), n);
    assert_int_equal(kvcache_n_lru_blocks(kv), n);
    for (int i = 0; i < n; i++)
        assert_int_equal(got[i], want[i]);
}

/* Nothing leaks: every block is free again, and all of them can be taken at once. */
static void assert_all_free(kvcache_t *kv)
{
    kvcache_prefix_flush(kv);
    assert_int_equal(kvcache_n_cached_blocks(kv), 0);
    assert_int_equal(kvcache_n_lru_blocks(kv), 0);
    int n = kvcache_n_blocks(kv);
    assert_int_equal(kvcache_n_free_blocks(kv), n);
    for (int b = 0; b < n; b++)
        assert_int_equal(kvcache_block_refcount(kv, b), 0);
    const kvcache_params *p = kvcache_get_params(kv);
    int seqs[8], n_seqs = 0, left = n;
    while (left > 0) { /* sequences of at most max_seq_len tokens take every block */
        int take = left * p->block_size < p->max_seq_len ? left * p->block_size : p->max_seq_len;
        assert_true(n_seqs < 8);
        seqs[n_seqs] = kvcache_seq_new(kv);
        assert_true(seqs[n_seqs] >= 0);
        assert_int_equal(kvcache_seq_reserve(kv, seqs[n_seqs], take), KVCACHE_OK);
        left -= kvcache_blocks_for(kv, take);
        n_seqs++;
    }
    assert_int_equal(kvcache_n_free_blocks(kv), 0);
    for (int i = 0; i < n_seqs; i++)
        kvcache_seq_free(kv, seqs[i]);
    assert_int_equal(kvcache_n_free_blocks(kv), n);
}

static void test_prefix_share_refcounts(void **state)
{
    (void)state;
    kvcache_t *kv = cache(4, 8, 4);
    int tok[10] = {10, 11, 12, 13, 14, 15, 16, 17, 18, 19};
    int reg = -1;
    int a = computed(kv, SEED, 0, tok, 10, &reg);
    assert_int_equal(reg, 2); /* the two full blocks; the third holds 2 tokens */
    assert_int_equal(kvcache_n_cached_blocks(kv), 2);
    assert_blocks(kv, a, (int[]){0, 1, 2}, 3);
    /* a second commit registers nothing new */
    assert_int_equal(kvcache_seq_commit_prefix(kv, a, SEED, 0, tok, 10), 0);

    /* shared while a runs */
    assert_int_equal(kvcache_prefix_lookup(kv, SEED, 0, tok, 10, 9, NULL), 8);
    int b = kvcache_seq_new(kv);
    assert_int_equal(kvcache_seq_attach_prefix(kv, b, SEED, 0, tok, 10, 9), 8);
    assert_int_equal(kvcache_seq_len(kv, b), 8);
    assert_blocks(kv, b, (int[]){0, 1}, 2);
    assert_int_equal(kvcache_block_refcount(kv, 0), 2);
    assert_int_equal(kvcache_block_refcount(kv, 1), 2);
    assert_int_equal(kvcache_block_refcount(kv, 2), 1);
    assert_int_equal(kvcache_n_free_blocks(kv), 5);
    /* b's own last block is private */
    assert_int_equal(kvcache_seq_reserve(kv, b, 10), KVCACHE_OK);
    assert_blocks(kv, b, (int[]){0, 1, 3}, 3);
    assert_int_equal(kvcache_block_refcount(kv, 3), 1);

    /* a leaves: its private block is plain free, the shared ones stay with b */
    kvcache_seq_free(kv, a);
    assert_int_equal(kvcache_block_refcount(kv, 0), 1);
    assert_int_equal(kvcache_block_refcount(kv, 1), 1);
    assert_int_equal(kvcache_block_refcount(kv, 2), 0);
    assert_lru(kv, NULL, 0);
    assert_int_equal(kvcache_n_free_blocks(kv), 5);
    /* b leaves: block 3 plain, then 1, then 0 to the LRU (tail first) */
    kvcache_seq_free(kv, b);
    assert_lru(kv, (int[]){1, 0}, 2);
    assert_int_equal(kvcache_n_free_blocks(kv), 8);
    assert_int_equal(kvcache_n_cached_blocks(kv), 2);

    /* a cached-but-free block comes back with refcount 1 and leaves the LRU */
    int c = kvcache_seq_new(kv);
    assert_int_equal(kvcache_seq_attach_prefix(kv, c, SEED, 0, tok, 10, 9), 8);
    assert_int_equal(kvcache_block_refcount(kv, 0), 1);
    assert_lru(kv, NULL, 0);
    assert_int_equal(kvcache_n_free_blocks(kv), 6);
    /* max_cached caps the hit at whole blocks */
    int d = kvcache_seq_new(kv);
    assert_int_equal(kvcache_seq_attach_prefix(kv, d, SEED, 0, tok, 10, 7), 4);
    assert_blocks(kv, d, (int[]){0}, 1);
    assert_int_equal(kvcache_block_refcount(kv, 0), 2);
    /* bad arguments */
    assert_int_equal(kvcache_seq_attach_prefix(kv, d, SEED, 0, tok, 10, 9), -1); /* has blocks */
    int e = kvcache_seq_new(kv);
    assert_int_equal(kvcache_seq_attach_prefix(kv, e, SEED, KVCACHE_MAX_LOOKAHEAD + 1, tok, 10, 9),
                     -1);
    assert_int_equal(kvcache_seq_attach_prefix(kv, 99, SEED, 0, tok, 10, 9), -1);
    kvcache_seq_free(kv, e);
    kvcache_seq_free(kv, c);
    kvcache_seq_free(kv, d);
    assert_lru(kv, (int[]){1, 0}, 2);
    assert_all_free(kv);
    kvcache_destroy(&kv);
}

static void test_prefix_lru_eviction(void **state)
{
    (void)state;
    kvcache_t *kv = cache(4, 4, 4);
    int A[8] = {1, 2, 3, 4, 5, 6, 7, 8}, B[8] = {9, 10, 11, 12, 13, 14, 15, 16};
    kvcache_seq_free(kv, computed(kv, SEED, 0, A, 8, NULL)); /* blocks 0, 1 */
    kvcache_seq_free(kv, computed(kv, SEED, 0, B, 8, NULL)); /* plain free first: 2, 3 */
    assert_lru(kv, (int[]){1, 0, 3, 2}, 4);
    assert_int_equal(kvcache_n_free_blocks(kv), 4);
    /* using A again makes it the most recent */
    int s = kvcache_seq_new(kv);
    assert_int_equal(kvcache_seq_attach_prefix(kv, s, SEED, 0, A, 8, 8), 8);
    assert_lru(kv, (int[]){3, 2}, 2);
    kvcache_seq_free(kv, s);
    assert_lru(kv, (int[]){3, 2, 1, 0}, 4);
    /* no plain free block left: the least recently used is evicted (B's tail first) */
    s = kvcache_seq_new(kv);
    assert_int_equal(kvcache_seq_reserve(kv, s, 4), KVCACHE_OK);
    assert_blocks(kv, s, (int[]){3}, 1);
    assert_int_equal(kvcache_n_cached_blocks(kv), 3);
    assert_int_equal(kvcache_prefix_lookup(kv, SEED, 0, B, 8, 8, NULL), 4);
    assert_int_equal(kvcache_prefix_lookup(kv, SEED, 0, A, 8, 8, NULL), 8);
    /* the block is private now: freed, it is plain free, not cached */
    kvcache_seq_free(kv, s);
    assert_lru(kv, (int[]){2, 1, 0}, 3);
    assert_int_equal(kvcache_n_free_blocks(kv), 4);
    /* taking everything evicts all; more is NOSPACE and changes nothing */
    s = kvcache_seq_new(kv);
    assert_int_equal(kvcache_seq_reserve(kv, s, 17), KVCACHE_NOSPACE);
    assert_int_equal(kvcache_n_cached_blocks(kv), 3);
    assert_int_equal(kvcache_seq_reserve(kv, s, 16), KVCACHE_OK);
    assert_blocks(kv, s, (int[]){3, 2, 1, 0}, 4);
    assert_int_equal(kvcache_n_cached_blocks(kv), 0);
    assert_int_equal(kvcache_prefix_lookup(kv, SEED, 0, A, 8, 8, NULL), 0);
    assert_int_equal(kvcache_n_free_blocks(kv), 0);
    kvcache_seq_free(kv, s);
    assert_all_free(kv);
    kvcache_destroy(&kv);
}

/* Every hash is 0: only the token ids and the chain tell the blocks apart. */
static void test_prefix_collision_confirmed(void **state)
{
    (void)state;
    kvcache_t *kv = cache(4, 8, 4);
    kvcache_set_hash_bits(kv, 0);
    int A[8] = {1, 2, 3, 4, 5, 6, 7, 8}, B[8] = {9, 10, 11, 12, 13, 14, 15, 16};
    int reg = 0;
    int a = computed(kv, SEED, 0, A, 8, &reg);
    assert_int_equal(reg, 2);
    int b = computed(kv, SEED, 0, B, 8, &reg);
    assert_int_equal(reg, 2); /* same hashes, other tokens: registered beside A's */
    assert_int_equal(kvcache_n_cached_blocks(kv), 4);
    int got[2];
    assert_int_equal(kvcache_prefix_lookup(kv, SEED, 0, A, 8, 8, got), 8);
    assert_int_equal(got[0], 0);
    assert_int_equal(got[1], 1);
    assert_int_equal(kvcache_prefix_lookup(kv, SEED, 0, B, 8, 8, got), 8);
    assert_int_equal(got[0], 2);
    assert_int_equal(got[1], 3);
    /* A's first block, then B's second block's tokens: B's block has another parent */
    int C[8] = {1, 2, 3, 4, 13, 14, 15, 16};
    assert_int_equal(kvcache_prefix_lookup(kv, SEED, 0, C, 8, 8, got), 4);
    assert_int_equal(got[0], 0);
    /* one token off: no match at all */
    int D[8] = {1, 2, 3, 5, 5, 6, 7, 8};
    assert_int_equal(kvcache_prefix_lookup(kv, SEED, 0, D, 8, 8, NULL), 0);
    /* another seed (model): no match even with the same tokens and hash */
    assert_int_equal(kvcache_prefix_lookup(kv, SEED + 1, 0, A, 8, 8, NULL), 0);
    /* C computed: its second block is registered as a child of A's first */
    kvcache_seq_free(kv, a);
    int c = kvcache_seq_new(kv);
    assert_int_equal(kvcache_seq_attach_prefix(kv, c, SEED, 0, C, 8, 8), 4);
    assert_int_equal(kvcache_seq_reserve(kv, c, 8), KVCACHE_OK);
    kvcache_seq_set_len(kv, c, 8);
    assert_int_equal(kvcache_seq_commit_prefix(kv, c, SEED, 0, C, 8), 1);
    assert_int_equal(kvcache_prefix_lookup(kv, SEED, 0, C, 8, 8, got), 8);
    assert_int_equal(got[0], 0);
    assert_int_equal(got[1], 4);
    kvcache_seq_free(kv, b);
    kvcache_seq_free(kv, c);
    assert_all_free(kv);
    kvcache_destroy(&kv);
}

/* Keys with lookahead: a block matches only if the tokens after it match too. */
static void test_prefix_lookahead_and_seed(void **state)
{
    (void)state;
    kvcache_t *kv = cache(4, 8, 4);
    int tok[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    int reg = 0;
    int a = computed(kv, SEED, 2, tok, 9, &reg);
    assert_int_equal(reg, 1); /* block 1 ends at 8: 8 + 2 > 9 */
    assert_int_equal(kvcache_seq_commit_prefix(kv, a, SEED, 2, tok, 10), 1); /* now it fits */
    assert_int_equal(kvcache_n_cached_blocks(kv), 2);
    assert_int_equal(kvcache_prefix_lookup(kv, SEED, 2, tok, 10, 10, NULL), 8);
    assert_int_equal(kvcache_prefix_lookup(kv, SEED, 2, tok, 9, 10, NULL), 4);
    int other[10] = {1, 2, 3, 4, 5, 6, 7, 8, 99, 10};
    assert_int_equal(kvcache_prefix_lookup(kv, SEED, 2, other, 10, 10, NULL), 4);
    int first[10] = {1, 2, 3, 4, 99, 6, 7, 8, 9, 10};
    assert_int_equal(kvcache_prefix_lookup(kv, SEED, 2, first, 10, 10, NULL), 0);
    /* another lookahead is another key */
    assert_int_equal(kvcache_prefix_lookup(kv, SEED, 0, tok, 10, 10, NULL), 0);
    assert_true(kvcache_prefix_seed(1, 0) != kvcache_prefix_seed(2, 0));
    assert_true(kvcache_prefix_seed(1, 0) != kvcache_prefix_seed(1, 1));
    assert_true(kvcache_prefix_seed(7, 3) == kvcache_prefix_seed(7, 3));
    /* a block written only in part is never registered */
    int s = kvcache_seq_new(kv);
    assert_int_equal(kvcache_seq_reserve(kv, s, 8), KVCACHE_OK);
    kvcache_seq_set_len(kv, s, 7);
    assert_int_equal(kvcache_seq_commit_prefix(kv, s, SEED + 5, 0, tok, 8), 1);
    kvcache_seq_free(kv, s);
    kvcache_seq_free(kv, a);
    assert_all_free(kv);
    kvcache_destroy(&kv);
}

/* The summary of what the cache holds (kvcache_prefix_blocks, HEARTBEAT "pfx") names every
 * hashed block by the hash prefixhash_chain computes from the token ids alone (what the
 * gateway does), with its seed and lookahead: blocks in use first, then the LRU's most
 * recent first; cut at cap. */
static void test_prefix_blocks_summary(void **state)
{
    (void)state;
    kvcache_t *kv = cache(4, 16, 4);
    int a_tok[13] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
    int b_tok[10] = {21, 22, 23, 24, 25, 26, 27, 28, 29, 30};
    uint64_t seed2 = kvcache_prefix_seed(99, 7); /* an MTP cache: lookahead 2 */
    int reg = 0;
    int a = computed(kv, SEED, 0, a_tok, 13, &reg);
    assert_int_equal(reg, 3);
    int b = computed(kv, seed2, 2, b_tok, 10, &reg);
    assert_int_equal(reg, 2);
    kvcache_seq_free(kv, a); /* a's blocks go to the LRU, b's stay in use */
    uint64_t h[16], sd[16], want_a[4], want_b[4];
    int la[16];
    assert_int_equal(prefixhash_chain(SEED, 4, 0, a_tok, 13, 13, want_a, 4), 3);
    assert_int_equal(prefixhash_chain(seed2, 4, 2, b_tok, 10, 10, want_b, 4), 2);
    /* the gateway's cap: max_cached 12 keeps 3 blocks, 11 only 2 */
    assert_int_equal(prefixhash_chain(SEED, 4, 0, a_tok, 13, 11, h, 4), 2);
    assert_int_equal(prefixhash_chain(SEED, 4, 0, a_tok, 13, 13, h, 1), 1);
    assert_int_equal(kvcache_prefix_blocks(kv, h, sd, la, 16), 5);
    /* in use: b's blocks 3, 4 (lowest id first) */
    assert_true(h[0] == want_b[0] && h[1] == want_b[1]);
    assert_true(sd[0] == seed2 && sd[1] == seed2);
    assert_int_equal(la[0], 2);
    assert_int_equal(la[1], 2);
    /* then the LRU, most recent first: a's head was released last */
    assert_true(h[2] == want_a[0] && h[3] == want_a[1] && h[4] == want_a[2]);
    assert_true(sd[2] == SEED && sd[4] == SEED);
    assert_int_equal(la[2], 0);
    assert_int_equal(kvcache_prefix_blocks(kv, h, sd, la, 3), 3); /* cut at cap */
    assert_true(h[2] == want_a[0]);
    /* the gateway's chain matches what the cache finds */
    int blocks[4];
    assert_int_equal(kvcache_prefix_lookup(kv, SEED, 0, a_tok, 13, 13, blocks), 12);
    kvcache_seq_free(kv, b);
    assert_all_free(kv);
    assert_int_equal(kvcache_prefix_blocks(kv, h, sd, la, 16), 0);
    kvcache_destroy(&kv);
}

/* The same prompt computed twice at once: the second copy stays private. */
static void test_prefix_duplicate_private(void **state)
{
    (void)state;
    kvcache_t *kv = cache(4, 8, 4);
    int tok[8] = {5, 6, 7, 8, 9, 10, 11, 12};
    int reg = 0;
    int a = computed(kv, SEED, 0, tok, 8, &reg);
    assert_int_equal(reg, 2);
    int b = computed(kv, SEED, 0, tok, 8, &reg);
    assert_int_equal(reg, 0);
    assert_int_equal(kvcache_n_cached_blocks(kv), 2);
    kvcache_seq_free(kv, b); /* plain free */
    assert_lru(kv, NULL, 0);
    assert_int_equal(kvcache_n_free_blocks(kv), 6);
    kvcache_seq_free(kv, a);
    assert_lru(kv, (int[]){1, 0}, 2);
    /* flush with a block in use: it becomes private */
    int c = kvcache_seq_new(kv);
    assert_int_equal(kvcache_seq_attach_prefix(kv, c, SEED, 0, tok, 8, 8), 8);
    assert_int_equal(kvcache_prefix_flush(kv), 2);
    assert_int_equal(kvcache_n_cached_blocks(kv), 0);
    assert_int_equal(kvcache_prefix_lookup(kv, SEED, 0, tok, 8, 8, NULL), 0);
    kvcache_seq_free(kv, c);
    assert_lru(kv, NULL, 0);
    assert_all_free(kv);
    kvcache_destroy(&kv);
}

/* Random sequences of attach / reserve / write / commit / truncate / free over prompts that
 * share prefixes, with 64-bit, 2-bit and 0-bit hashes: after every operation the refcounts
 * equal the block tables' entries, the free count is exact, and every attached block holds
 * the KV written for exactly the tokens it is shared for (each slot's first K float is
 * its token id, the second its position: a collision that slipped through would show). */
static uint64_t rnd_state;
static unsigned rnd(unsigned n)
{
    rnd_state = rnd_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (unsigned)(rnd_state >> 33) % n;
}

static void check_invariants(kvcache_t *kv, int max_seqs)
{
    int nb = kvcache_n_blocks(kv), used = 0;
    int refs[64] = {0};
    for (int s = 0; s < max_seqs; s++) {
        if (!kvcache_seq_active(kv, s))
            continue;
        int n = 0;
        const int *b = kvcache_seq_blocks(kv, s, &n);
        for (int i = 0; i < n; i++)
            refs[b[i]]++;
    }
    for (int b = 0; b < nb; b++) {
        assert_int_equal(kvcache_block_refcount(kv, b), refs[b]);
        used += refs[b] > 0;
    }
    assert_int_equal(kvcache_n_free_blocks(kv) + used, nb);
    assert_true(kvcache_n_lru_blocks(kv) <= kvcache_n_cached_blocks(kv));
    assert_true(kvcache_n_lru_blocks(kv) <= kvcache_n_free_blocks(kv));
}

static void test_prefix_random_ops(void **state)
{
    (void)state;
    enum { BSZ = 4, NB = 24, NS = 5, LEN = 20 };
    static const int bits[] = {64, 2, 0};
    for (int round = 0; round < 3; round++) {
        kvcache_t *kv = cache(BSZ, NB, NS);
        kvcache_set_hash_bits(kv, bits[round]);
        rnd_state = 42 + (uint64_t)round;
        int tok[NS][LEN], len[NS] = {0};
        long hits = 0;
        for (int op = 0; op < 4000; op++) {
            int s = (int)rnd(NS);
            if (!kvcache_seq_active(kv, s)) {
                /* a new prompt: one of 3 stems, then random tokens from a tiny vocabulary */
                int stem = (int)rnd(3), n = 6 + (int)rnd(LEN - 6);
                for (int i = 0; i < n; i++)
                    tok[s][i] = i < 8 ? stem * 10 + i : (int)rnd(3);
                int got = kvcache_seq_new(kv);
                if (got < 0)
                    continue;
                s = got;
                for (int i = 0; i < n; i++) /* seq_new may give another slot: copy again */
                    tok[s][i] = i < 8 ? stem * 10 + i : (int)rnd(3);
                len[s] = n;
                int la = (int)rnd(2);
                int hit = kvcache_seq_attach_prefix(kv, s, SEED, la, tok[s], n, n - 1);
                assert_true(hit >= 0 && hit % BSZ == 0 && hit <= n - 1);
                hits += hit;
                for (int p = 0; p < hit; p++) { /* the shared KV is this prompt's */
                    assert_true(kvcache_k(kv, 1, s, p)[0] == (float)tok[s][p]);
                    assert_true(kvcache_k(kv, 1, s, p)[1] == (float)p);
                }
                if (kvcache_seq_reserve(kv, s, n) != KVCACHE_OK) {
                    kvcache_seq_free(kv, s);
                    check_invariants(kv, NS);
                    continue;
                }
                for (int p = hit; p < n; p++) { /* "compute" the rest */
                    kvcache_k(kv, 1, s, p)[0] = (float)tok[s][p];
                    kvcache_k(kv, 1, s, p)[1] = (float)p;
                }
                kvcache_seq_set_len(kv, s, n);
                if (rnd(4))
                    assert_true(kvcache_seq_commit_prefix(kv, s, SEED, la, tok[s], n) >= 0);
            } else if (rnd(3) == 0) {
                kvcache_seq_free(kv, s);
            } else if (rnd(2) == 0) { /* grow past the prompt, then roll back to it */
                if (kvcache_seq_reserve(kv, s, len[s] + BSZ) == KVCACHE_OK)
                    kvcache_seq_truncate(kv, s, len[s]);
            }
            check_invariants(kv, NS);
        }
        assert_true(hits > 1000); /* the test shares blocks (and fills the cache) */
        for (int s = 0; s < NS; s++)
            kvcache_seq_free(kv, s);
        check_invariants(kv, NS);
        assert_all_free(kv);
        kvcache_destroy(&kv);
    }
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefix_share_refcounts),
        cmocka_unit_test(test_prefix_lru_eviction),
        cmocka_unit_test(test_prefix_collision_confirmed),
        cmocka_unit_test(test_prefix_lookahead_and_seed),
        cmocka_unit_test(test_prefix_duplicate_private),
        cmocka_unit_test(test_prefix_blocks_summary),
        cmocka_unit_test(test_prefix_random_ops),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("kvcache", tests, NULL, NULL);
}
