/*
 * The accelerator cost model (common/costmodel.h) against figures worked out by hand from
 * the preset's public numbers (relative tolerance 1e-9 unless stated), plus its shape:
 * monotone in batch, context and tokens, memory-bound at small batches and compute-bound
 * at large ones, and the parameter checks.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "costmodel.h"

static void assert_close(double got, double want, double rel)
{
    if (!(fabs(got - want) <= rel * fabs(want)))
        fail_msg("got %.12g, want %.12g (rel %.1e)", got, want, rel);
}

static costmodel a100(void)
{
    costmodel cm;
    assert_int_equal(costmodel_preset("a100-llama3-8b", &cm), 0);
    return cm;
}

/* Llama 3 8B on an A100 80GB: the derived sizes. */
static void test_sizes(void **state)
{
    (void)state;
    costmodel cm = a100();
    /* 2 (K, V) * 32 layers * 8 KV heads * 128 dims * 2 bytes */
    assert_close(costmodel_kv_bytes_per_token(&cm), 131072, 1e-12);
    assert_close(costmodel_weight_bytes(&cm), 16.06e9, 1e-12);
    /* (0.9 * 80 GB - 16.06 GB weights - 2 GB activations) / 128 KiB */
    assert_close(costmodel_kv_capacity_tokens(&cm), floor(53.94e9 / 131072), 1e-12);
    assert_close(costmodel_attn_pairs(4, 0), 10, 1e-12); /* 1 + 2 + 3 + 4 */
    assert_close(costmodel_attn_pairs(4, 100), 410, 1e-12);
    assert_close(costmodel_attn_pairs(0, 100), 0, 1e-12);
    char err[128];
    assert_int_equal(costmodel_check(&cm, err, sizeof(err)), 0);
}

/* Decode steps: weights (+ KV) over 75% of 2,039 GB/s, or FLOPs over 40% of 312 TFLOPS,
 * whichever is longer, plus 2 ms. */
static void test_decode_step(void **state)
{
    (void)state;
    costmodel cm = a100();
    double bw = 2.039e12 * 0.75, fl = 312e12 * 0.4;
    /* batch 1, empty context: reading the weights */
    assert_close(costmodel_decode_step_ms(&cm, 1, 0), 1e3 * 16.06e9 / bw + 2, 1e-9);
    /* batch 64 of 1000-token contexts: still memory-bound */
    double ctx = 64000;
    double mem = 1e3 * (16.06e9 + 131072 * ctx) / bw;
    double cmp = 1e3 * (2 * 8.03e9 * 64 + 4.0 * 32 * 4096 * ctx) / fl;
    assert_true(mem > cmp);
    assert_close(costmodel_decode_step_ms(&cm, 64, ctx), mem + 2, 1e-9);
    /* batch 256 of 640-token contexts: compute-bound with these efficiencies */
    ctx = 256 * 640.0;
    mem = 1e3 * (16.06e9 + 131072 * ctx) / bw;
    cmp = 1e3 * (2 * 8.03e9 * 256 + 4.0 * 32 * 4096 * ctx) / fl;
    assert_true(cmp > mem);
    assert_close(costmodel_decode_step_ms(&cm, 256, ctx), cmp + 2, 1e-9);
    assert_close(costmodel_decode_step_ms(&cm, 0, 1000), 0, 1e-12);
    /* monotone in batch and in context */
    double prev = 0;
    for (int b = 1; b <= 256; b++) {
        double t = costmodel_decode_step_ms(&cm, b, b * 500.0);
        assert_true(t >= prev);
        prev = t;
    }
    assert_true(costmodel_decode_step_ms(&cm, 32, 1e6) > costmodel_decode_step_ms(&cm, 32, 1e4));
}

/* Prefill: 2 * params * tokens + attention FLOPs over 50% of 312 TFLOPS, at least one read
 * of the weights, plus 5 ms. */
static void test_prefill(void **state)
{
    (void)state;
    costmodel cm = a100();
    double n = 4096, pairs = costmodel_attn_pairs(n, 0);
    double flops = 2 * 8.03e9 * n + 4.0 * 32 * 4096 * pairs;
    assert_close(costmodel_prefill_ms(&cm, n, pairs), 1e3 * flops / (312e12 * 0.5) + 5, 1e-9);
    /* one token is memory-bound: the weight read */
    assert_close(costmodel_prefill_ms(&cm, 1, 1), 1e3 * 16.06e9 / (2.039e12 * 0.75) + 5, 1e-9);
    assert_close(costmodel_prefill_ms(&cm, 0, 0), 0, 1e-12);
    /* throughput in the public ballpark for an A100 (about 9-10 k prompt tokens/s) */
    double tps = costmodel_prefill_tokens_per_s(&cm, 1024);
    assert_true(tps > 8000 && tps < 12000);
    /* a longer prompt costs more per token (attention grows with length) */
    assert_true(costmodel_prefill_tokens_per_s(&cm, 4096) < tps);
    double prev = 0;
    for (int t = 1; t <= 16384; t *= 2) {
        double ms = costmodel_prefill_ms(&cm, t, costmodel_attn_pairs(t, 0));
        assert_true(ms >= prev);
        prev = ms;
    }
}

static void test_transfer_and_batch_limit(void **state)
{
    (void)state;
    costmodel cm = a100();
    /* 1000 tokens * 128 KiB over 25 GB/s, plus 0.05 ms */
    assert_close(costmodel_transfer_ms(&cm, 1000), 0.05 + 1e3 * 131072e3 / 25e9, 1e-9);
    assert_close(costmodel_transfer_ms(&cm, 0), 0, 1e-12);
    /* the batch limit: largest b with step <= limit (and KV fitting), b + 1 over it */
    int b = costmodel_decode_batch_within(&cm, 20, 2000);
    assert_true(b >= 1 && b < cm.max_seqs);
    assert_true(costmodel_decode_step_ms(&cm, b, b * 2000.0) <= 20);
    assert_true(costmodel_decode_step_ms(&cm, b + 1, (b + 1) * 2000.0) > 20);
    /* plenty of time: capped by max_seqs; long contexts: capped by KV capacity */
    assert_int_equal(costmodel_decode_batch_within(&cm, 1e6, 100), cm.max_seqs);
    int kv_b = costmodel_decode_batch_within(&cm, 1e6, 100000);
    assert_int_equal(kv_b, 4); /* 411,529 tokens / 100,000 */
    /* an impossible limit still answers 1 */
    assert_int_equal(costmodel_decode_batch_within(&cm, 0.001, 100), 1);
}

static void test_presets_and_checks(void **state)
{
    (void)state;
    const char *const *names = costmodel_preset_names();
    int n = 0;
    char err[128];
    for (; names[n]; n++) {
        costmodel cm;
        assert_int_equal(costmodel_preset(names[n], &cm), 0);
        assert_string_equal(cm.name, names[n]);
        assert_int_equal(costmodel_check(&cm, err, sizeof(err)), 0);
    }
    assert_true(n >= 2);
    costmodel cm;
    assert_int_equal(costmodel_preset("tpu-v9", &cm), -1);
    assert_int_equal(costmodel_preset(NULL, &cm), -1);
    /* H100 is faster than A100 at both phases */
    costmodel h;
    assert_int_equal(costmodel_preset("h100-llama3-8b", &h), 0);
    cm = a100();
    assert_true(costmodel_decode_step_ms(&h, 64, 64000) < costmodel_decode_step_ms(&cm, 64, 64000));
    assert_true(costmodel_prefill_tokens_per_s(&h, 1024) >
                costmodel_prefill_tokens_per_s(&cm, 1024));
    /* bad fields are named */
    cm.mbu = 0;
    assert_int_equal(costmodel_check(&cm, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "mbu"));
    cm = a100();
    cm.hbm_bytes = 10e9; /* weights alone do not fit */
    assert_int_equal(costmodel_check(&cm, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "KV"));
}

/* "PRESET:dilate=K": the same accelerator K times slower. Every time (prefill, decode step,
 * transfer) is K times the preset's, the throughputs 1/K, the sizes unchanged. */
static void test_dilation(void **state)
{
    (void)state;
    costmodel a = a100(), d;
    assert_int_equal(costmodel_preset("a100-llama3-8b:dilate=10", &d), 0);
    assert_string_equal(d.name, "a100-llama3-8b:dilate=10");
    assert_close(d.time_scale, 10, 1e-12);
    assert_close(a.time_scale, 1, 1e-12);
    char err[128];
    assert_int_equal(costmodel_check(&d, err, sizeof(err)), 0);
    assert_close(costmodel_prefill_ms(&d, 1000, costmodel_attn_pairs(1000, 0)),
                 10 * costmodel_prefill_ms(&a, 1000, costmodel_attn_pairs(1000, 0)), 1e-12);
    assert_close(costmodel_decode_step_ms(&d, 48, 48 * 300.0),
                 10 * costmodel_decode_step_ms(&a, 48, 48 * 300.0), 1e-12);
    assert_close(costmodel_transfer_ms(&d, 512), 10 * costmodel_transfer_ms(&a, 512), 1e-12);
    assert_close(costmodel_prefill_tokens_per_s(&d, 300),
                 costmodel_prefill_tokens_per_s(&a, 300) / 10, 1e-12);
    assert_close(costmodel_kv_capacity_tokens(&d), costmodel_kv_capacity_tokens(&a), 1e-12);
    /* the largest batch within a step budget: the same at 10x the budget */
    assert_int_equal(costmodel_decode_batch_within(&d, 10 * 20.0, 500),
                     costmodel_decode_batch_within(&a, 20.0, 500));
    assert_int_equal(costmodel_preset("h100-llama3-8b:dilate=2.5", &d), 0);
    assert_close(d.time_scale, 2.5, 1e-12);
    assert_string_equal(d.name, "h100-llama3-8b:dilate=2.5");
    /* bad factors and names are refused */
    const char *bad[] = {"a100-llama3-8b:dilate=",
                         "a100-llama3-8b:dilate=0.5",
                         "a100-llama3-8b:dilate=1001",
                         "a100-llama3-8b:dilate=3x",
                         "a100-llama3-8b:dilate=nan",
                         "a100:dilate=2",
                         ":dilate=2",
                         "a100-llama3-8b:dilate=2:dilate=3",
                         "a100-llama3-8b-x"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_int_equal(costmodel_preset(bad[i], &d), -1);
    d = a;
    d.time_scale = 0;
    assert_int_equal(costmodel_check(&d, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "time_scale"));
}

/* "PRESET:token-scale=S": the KV capacity counted in tokens of requests scaled by S (traces
 * scaled 0.1 for the small real model), exactly floor(free bytes / bytes per token * S);
 * every time unchanged; the suffix combines with ":dilate=K" in either order. */
static void test_token_scale(void **state)
{
    (void)state;
    costmodel a = a100(), t;
    assert_close(a.token_scale, 1, 1e-12);
    assert_int_equal(costmodel_preset("a100-llama3-8b:token-scale=0.1", &t), 0);
    assert_string_equal(t.name, "a100-llama3-8b:token-scale=0.1");
    assert_close(t.token_scale, 0.1, 1e-12);
    assert_close(t.time_scale, 1, 1e-12);
    /* 53.94e9 / 131072 = 411529.5 tokens; x 0.1 = 41152.95 */
    assert_close(costmodel_kv_capacity_tokens(&a), 411529, 1e-12);
    assert_close(costmodel_kv_capacity_tokens(&t), 41152, 1e-12);
    assert_close(costmodel_prefill_ms(&t, 1000, costmodel_attn_pairs(1000, 0)),
                 costmodel_prefill_ms(&a, 1000, costmodel_attn_pairs(1000, 0)), 1e-12);
    assert_close(costmodel_decode_step_ms(&t, 48, 48 * 300.0),
                 costmodel_decode_step_ms(&a, 48, 48 * 300.0), 1e-12);
    assert_close(costmodel_kv_bytes_per_token(&t), 131072, 1e-12);
    char err[128];
    assert_int_equal(costmodel_check(&t, err, sizeof(err)), 0);
    /* the KV limit of the largest decode batch follows: max_seqs (256) sequences of 500
     * tokens fit in 411529 tokens, 82 in 41152 */
    assert_int_equal(costmodel_decode_batch_within(&a, 1e6, 500), 256);
    assert_int_equal(costmodel_decode_batch_within(&t, 1e6, 500), 82);
    costmodel both, rev;
    assert_int_equal(costmodel_preset("a100-llama3-8b:dilate=10:token-scale=0.1", &both), 0);
    assert_int_equal(costmodel_preset("a100-llama3-8b:token-scale=0.1:dilate=10", &rev), 0);
    assert_string_equal(both.name, "a100-llama3-8b:dilate=10:token-scale=0.1");
    assert_string_equal(rev.name, "a100-llama3-8b:token-scale=0.1:dilate=10");
    assert_close(both.time_scale, 10, 1e-12);
    assert_close(rev.time_scale, 10, 1e-12);
    assert_close(costmodel_kv_capacity_tokens(&both), 41152, 1e-12);
    assert_close(costmodel_kv_capacity_tokens(&rev), 41152, 1e-12);
    assert_int_equal(costmodel_preset("h100-llama3-8b:token-scale=1", &t), 0);
    assert_close(costmodel_kv_capacity_tokens(&t), floor(53.94e9 / 131072), 1e-12);
    const char *bad[] = {"a100-llama3-8b:token-scale=0",
                         "a100-llama3-8b:token-scale=-0.1",
                         "a100-llama3-8b:token-scale=1.5",
                         "a100-llama3-8b:token-scale=",
                         "a100-llama3-8b:token-scale=0.1x",
                         "a100-llama3-8b:token-scale=0.1:token-scale=0.2",
                         "a100-llama3-8b:token-scale",
                         "a100-llama3-8b:tokens=0.1",
                         "a100-llama3-8b:",
                         "a100-llama3-8b:dilate=10:",
                         "a100-llama3-8b:token-scale=0.1:dilate=10:dilate=2",
                         "a100-llama3-8b:dilate=10:token-scale=0.00000000000000000000000000000001"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_int_equal(costmodel_preset(bad[i], &t), -1);
    /* a struct filled by hand without the field (0) is unscaled; out of range is refused */
    t = a;
    t.token_scale = 0;
    assert_close(costmodel_kv_capacity_tokens(&t), 411529, 1e-12);
    assert_int_equal(costmodel_check(&t, err, sizeof(err)), 0);
    t.token_scale = 1.5;
    assert_int_equal(costmodel_check(&t, err, sizeof(err)), -1);
    assert_string_equal(err, "costmodel: token_scale must be in (0, 1] (0: 1)");
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sizes),
        cmocka_unit_test(test_decode_step),
        cmocka_unit_test(test_prefill),
        cmocka_unit_test(test_transfer_and_batch_limit),
        cmocka_unit_test(test_presets_and_checks),
        cmocka_unit_test(test_dilation),
        cmocka_unit_test(test_token_scale),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("costmodel", tests, NULL, NULL);
}
