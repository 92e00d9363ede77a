/*
 * test_route: the gateway's belief of the workers' prefix caches (gateway/cluster_route.c,
 * cache-aware routing): a prompt's expected hit is its chain of block hashes
 * (prefixhash_chain, from the token ids) counted from the first block while the last
 * HEARTBEAT summary or a recent routing holds it, hashed with the worker's seed for the
 * lookahead (MTP depth) the prompt runs at there, capped as the worker caps sharing; a
 * new summary replaces the last; routed blocks expire; forgetting drops everything.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cluster_internal.h"
#include "prefixhash.h"

#define S0 0x5eed0ULL
#define S2 0x5eed2ULL

static int T[13] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};

static proto_prefix_summary *summary(int la, uint64_t seed, const int *tok, int n, int n_blocks)
{
    proto_prefix_summary *px = calloc(1, sizeof(*px));
    assert_non_null(px);
    px->n_groups = 1;
    px->group[0].seed = seed;
    px->group[0].lookahead = la;
    px->n_hashes = prefixhash_chain(seed, 4, la, tok, n, n, px->hashes, n_blocks);
    px->group[0].n = px->n_hashes;
    return px;
}

static void test_expected_hit(void **state)
{
    (void)state;
    cluster_t *c = calloc(1, sizeof(*c));
    worker_t *w = calloc(1, sizeof(*w));
    assert_non_null(c);
    assert_non_null(w);
    c->p.heartbeat_ms = 500;
    snprintf(w->id, sizeof(w->id), "p0");
    w->block_size = 4;
    w->mtp_depth = 1; /* serves depth 0 */
    req_t r = {.tokens = T, .n_prompt = 13};
    assert_int_equal(cluster_route_expected_hit(c, w, &r), 0); /* no belief */

    proto_prefix_summary *px = summary(0, S0, T, 13, 3);
    assert_int_equal(px->n_hashes, 3);
    cluster_route_summary(w, px);
    assert_int_equal(cluster_route_expected_hit(c, w, &r), 12);
    assert_int_equal(cluster_route_n_believed(w), 3);
    r.n_prompt = 12; /* the last token is always computed: 11 shareable, 2 blocks */
    assert_int_equal(cluster_route_expected_hit(c, w, &r), 8);
    r.n_prompt = 13;
    r.echo = 1; /* never shared */
    assert_int_equal(cluster_route_expected_hit(c, w, &r), 0);
    r.echo = 0;
    int other[13];
    memcpy(other, T, sizeof(other));
    other[5] = 99; /* block 1 differs: only block 0 is found */
    r.tokens = other;
    assert_int_equal(cluster_route_expected_hit(c, w, &r), 4);
    other[0] = 99;
    assert_int_equal(cluster_route_expected_hit(c, w, &r), 0);
    r.tokens = T;

    /* a summary replaces the last one: without block 0 nothing of the chain counts */
    px->hashes[0] ^= 1;
    cluster_route_summary(w, px);
    assert_int_equal(cluster_route_expected_hit(c, w, &r), 0);
    free(px);

    /* depth 2 served: the lookahead-2 group's seed; the prompt runs at depth 2, so its
     * chain needs 2 tokens after each block and the last two tokens are computed */
    w->mtp_depth = 3;
    px = summary(2, S2, T, 13, 4);
    assert_int_equal(px->n_hashes, 2); /* block 2 ends at 12: 12 + 2 > 13 */
    cluster_route_summary(w, px);
    assert_int_equal(cluster_route_expected_hit(c, w, &r), 8);
    r.mtp_depth = 1; /* the request asks for depth 0: the worker has no such group now */
    assert_int_equal(cluster_route_expected_hit(c, w, &r), 0);
    r.mtp_depth = 0;
    proto_sampling samp = {0};
    r.samp = &samp; /* sampling controls run at depth 0 */
    assert_int_equal(cluster_route_expected_hit(c, w, &r), 0);
    r.samp = NULL;
    free(px);

    /* routed: believed at once (before any summary lists it), until it expires */
    w->mtp_depth = 1;
    px = summary(0, S0, T, 13, 0); /* the seed, no block */
    cluster_route_summary(w, px);
    free(px);
    assert_int_equal(cluster_route_expected_hit(c, w, &r), 0);
    c->p.heartbeat_ms = 2; /* believed for 10 intervals: 20 ms */
    cluster_route_routed(c, w, &r);
    assert_int_equal(cluster_route_expected_hit(c, w, &r), 12);
    struct timespec ts = {0, 40 * 1000 * 1000};
    nanosleep(&ts, NULL);
    assert_int_equal(cluster_route_expected_hit(c, w, &r), 0);

    /* many prompts routed: the table stays bounded, the newest are believed */
    c->p.heartbeat_ms = 100000;
    int tok[13];
    for (int i = 0; i < 30000; i++) {
        memcpy(tok, T, sizeof(tok));
        tok[0] = 1000 + i;
        req_t q = {.tokens = tok, .n_prompt = 13};
        cluster_route_routed(c, w, &q);
    }
    assert_true(cluster_route_n_believed(w) <= 16384);
    req_t q = {.tokens = tok, .n_prompt = 13};
    assert_int_equal(cluster_route_expected_hit(c, w, &q), 12);

    /* no summary (cache off), or forgotten (a restart): no belief */
    cluster_route_summary(w, NULL);
    assert_null(w->belief);
    assert_int_equal(cluster_route_expected_hit(c, w, &q), 0);
    cluster_route_routed(c, w, &q); /* without a seed nothing is believed */
    assert_int_equal(cluster_route_n_believed(w), 0);
    cluster_route_forget(w);
    free(c->route_chain);
    free(w);
    free(c);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_expected_hit),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
