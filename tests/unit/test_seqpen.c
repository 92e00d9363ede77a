/* test_seqpen: a sequence's sampling controls (worker/seqpen.c): the ids it counts as it
 * grows, the export a retry or a migration sends (KV_BEGIN "samp" + "tokens") and that
 * continuing from the export gives the same logits as staying. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "seqpen.h"

enum { V = 8, EOS = 2 };

static void test_push_apply_stop(void **state)
{
    (void)state;
    proto_sampling ps = {.frequency = 1.0f, .repetition = 1.0f, .min_tokens = 3, .n_stop = 1,
                         .stop_ids = {5}};
    const int prompt[] = {1, 4, 4};
    seqpen_t *p = seqpen_new(&ps, prompt, 3, 0, 6, EOS);
    sampler_t *s = sampler_new(V);
    assert_non_null(p);
    assert_non_null(s);
    float l[V] = {0, 1, 9, 3, 2, 8, 0, 0};
    seqpen_apply(p, s, l); /* nothing generated: no counts, EOS and 5 masked (0 < 3) */
    assert_true(l[4] == 2.0f && isinf(l[EOS]) && isinf(l[5]) && l[3] == 3.0f);
    assert_int_equal(seqpen_push(p, 3), 0);
    assert_int_equal(seqpen_push(p, 3), 0);
    assert_int_equal(seqpen_push(p, 4), 0);
    float m[V] = {0, 1, 9, 3, 2, 8, 0, 0};
    seqpen_apply(p, s, m); /* 3 generated: nothing masked; c3 = 2, c4 = 1 (the prompt's not) */
    const float want[V] = {0, 1, 9, 1, 1, 8, 0, 0};
    assert_memory_equal(m, want, sizeof(m));
    assert_int_equal(seqpen_push(p, 6), -1); /* past cap: 3 + 3 */
    assert_int_equal(seqpen_is_stop(p, 5), 1);
    assert_int_equal(seqpen_is_stop(p, EOS), 0);
    seqpen_destroy(&p);
    assert_null(p);
    seqpen_destroy(&p);
    /* bad counts */
    assert_null(seqpen_new(&ps, prompt, 3, 4, 8, EOS));
    assert_null(seqpen_new(&ps, prompt, 3, 0, 2, EOS));
    sampler_destroy(&s);
}

/* A migration exports all but the last id (KV_END carries it); the receiver rebuilt from
 * the export plus that id penalises exactly as the sender would have. */
static void test_export_continues_exactly(void **state)
{
    (void)state;
    proto_sampling ps = {.presence = 0.5f, .frequency = 0.25f, .repetition = 1.5f,
                         .min_tokens = 5, .n_bias = 1, .bias_ids = {7}, .bias = {-1.0f}};
    const int ids[] = {1, 6, 6, 3, 6}; /* prompt [1 6 6], then a retry's 2 generated */
    seqpen_t *a = seqpen_new(&ps, ids, 5, 2, 16, EOS);
    assert_non_null(a);
    seqpen_push(a, 3);
    seqpen_push(a, 4);
    proto_sampling out;
    const int *eids;
    int n;
    seqpen_export(a, 1, &out, &eids, &n);
    assert_int_equal(n, 6);
    assert_int_equal(out.n_gen, 3);
    assert_memory_equal(eids, ((int[]){1, 6, 6, 3, 6, 3}), 6 * sizeof(int));
    assert_true(out.presence == 0.5f && out.n_bias == 1 && out.min_tokens == 5);
    seqpen_t *b = seqpen_new(&out, eids, n, out.n_gen, 16, EOS);
    assert_non_null(b);
    seqpen_push(b, 4);
    sampler_t *s = sampler_new(V);
    float la[V], lb[V];
    for (int i = 0; i < V; i++)
        la[i] = lb[i] = (float)(i % 3) - 0.5f;
    seqpen_apply(a, s, la);
    seqpen_apply(b, s, lb);
    assert_memory_equal(la, lb, sizeof(la));
    /* 4 generated < 5: EOS still masked; 6 is once among the generated ones */
    assert_true(isinf(la[EOS]));
    assert_true(la[6] == -0.5f * 1.5f - 0.25f - 0.5f);
    /* a prefill hand-off exports everything */
    seqpen_export(a, 0, &out, &eids, &n);
    assert_int_equal(n, 7);
    assert_int_equal(out.n_gen, 4);
    seqpen_destroy(&a);
    seqpen_destroy(&b);
    sampler_destroy(&s);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_push_apply_stop),
        cmocka_unit_test(test_export_continues_exactly),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("seqpen", tests, NULL, NULL);
}
