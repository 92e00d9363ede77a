/* Tests of gateway/metrics (histograms, windows, Prometheus text) and of the exposition
 * of gateway/stats. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "metrics.h"
#include "prometheus.h"
#include "stats.h"

/* Run fn(f, ud) into a string (caller frees). */
static char *capture(void (*fn)(FILE *f, void *ud), void *ud)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    assert_non_null(f);
    fn(f, ud);
    fclose(f);
    return text;
}

/* A value equal to a bound goes into that bound's bucket (le is inclusive); below the
 * first bound into the first; above the last into +Inf; NaN is not counted. */
static void test_bucket_placement(void **state)
{
    (void)state;
    static const double b[] = {0.1, 0.5, 1.0};
    metrics_histogram h;
    assert_int_equal(metrics_histogram_init(&h, b, 3), 0);
    assert_int_equal(metrics_histogram_bucket(&h, -5), 0);
    assert_int_equal(metrics_histogram_bucket(&h, 0.0), 0);
    assert_int_equal(metrics_histogram_bucket(&h, 0.1), 0);
    assert_int_equal(metrics_histogram_bucket(&h, 0.10000001), 1);
    assert_int_equal(metrics_histogram_bucket(&h, 0.5), 1);
    assert_int_equal(metrics_histogram_bucket(&h, 0.7), 2);
    assert_int_equal(metrics_histogram_bucket(&h, 1.0), 2);
    assert_int_equal(metrics_histogram_bucket(&h, 1.5), 3);
    assert_int_equal(metrics_histogram_bucket(&h, INFINITY), 3);
    assert_int_equal(metrics_histogram_bucket(&h, NAN), 3);
    double vals[] = {0.05, 0.1, 0.3, 0.5, 2.0, 2.0};
    for (int i = 0; i < 6; i++)
        metrics_histogram_observe(&h, vals[i]);
    metrics_histogram_observe(&h, NAN);
    assert_int_equal(h.count, 6);
    assert_true(fabs(h.sum - 4.95) < 1e-12);
    assert_int_equal(h.counts[0], 2);
    assert_int_equal(h.counts[1], 2);
    assert_int_equal(h.counts[2], 0);
    assert_int_equal(h.counts[3], 2);
}

static void test_bucket_sets_and_bad_bounds(void **state)
{
    (void)state;
    int n;
    const double *b = metrics_buckets(METRICS_BUCKETS_TTFT, &n);
    assert_int_equal(n, 22); /* vLLM's time_to_first_token_seconds */
    assert_true(b[0] == 0.001 && b[n - 1] == 2560.0);
    b = metrics_buckets(METRICS_BUCKETS_ITL, &n);
    assert_int_equal(n, 19);
    assert_true(b[0] == 0.01 && b[n - 1] == 80.0);
    b = metrics_buckets(METRICS_BUCKETS_REQUEST, &n);
    assert_int_equal(n, 21);
    assert_true(b[0] == 0.3 && b[n - 1] == 7680.0);
    for (int set = 0; set < METRICS_BUCKETS_END; set++) {
        metrics_histogram h;
        assert_int_equal(metrics_histogram_init_set(&h, (metrics_bucket_set_t)set), 0);
    }
    assert_null(metrics_buckets(METRICS_BUCKETS_END, &n));
    metrics_histogram h;
    static const double unsorted[] = {1.0, 0.5}, dup[] = {1.0, 1.0}, inf[] = {1.0, INFINITY};
    assert_int_equal(metrics_histogram_init(&h, unsorted, 2), -1);
    assert_int_equal(metrics_histogram_init(&h, dup, 2), -1);
    assert_int_equal(metrics_histogram_init(&h, inf, 2), -1);
    assert_int_equal(metrics_histogram_init(&h, NULL, 0), -1);
    assert_int_equal(h.n_bounds, 0);
}

static void write_hist(FILE *f, void *ud)
{
    metrics_label l[2] = {{"model_name", "m"}, {"worker", "a\"b\\c\nd"}};
    metrics_write_header(f, "tidepool_x_seconds", "histogram", "Help with \\ and\nnewline.");
    metrics_write_histogram(f, "tidepool_x_seconds", l, 2, ud);
}

/* The text format: cumulative buckets with le, +Inf, _sum, _count; escapes. */
static void test_exposition_text(void **state)
{
    (void)state;
    static const double b[] = {0.1, 1.0};
    metrics_histogram h;
    metrics_histogram_init(&h, b, 2);
    metrics_histogram_observe(&h, 0.05);
    metrics_histogram_observe(&h, 0.1);
    metrics_histogram_observe(&h, 0.5);
    metrics_histogram_observe(&h, 3.0);
    char *text = capture(write_hist, &h);
    const char *want =
        "# HELP tidepool_x_seconds Help with \\\\ and\\nnewline.\n"
        "# TYPE tidepool_x_seconds histogram\n"
        "tidepool_x_seconds_bucket{model_name=\"m\",worker=\"a\\\"b\\\\c\\nd\",le=\"0.1\"} 2\n"
        "tidepool_x_seconds_bucket{model_name=\"m\",worker=\"a\\\"b\\\\c\\nd\",le=\"1\"} 3\n"
        "tidepool_x_seconds_bucket{model_name=\"m\",worker=\"a\\\"b\\\\c\\nd\",le=\"+Inf\"} 4\n"
        "tidepool_x_seconds_sum{model_name=\"m\",worker=\"a\\\"b\\\\c\\nd\"} 3.65\n"
        "tidepool_x_seconds_count{model_name=\"m\",worker=\"a\\\"b\\\\c\\nd\"} 4\n";
    assert_string_equal(text, want);
    free(text);
}

static void test_format_value(void **state)
{
    (void)state;
    char buf[64];
    struct {
        double v;
        const char *want;
    } cases[] = {
        {0, "0"},           {42, "42"},          {-3, "-3"},      {0.1, "0.1"},
        {0.001, "0.001"},   {2560, "2560"},      {1e-7, "1e-07"}, {1.0 / 3, "0.3333333333333333"},
        {INFINITY, "+Inf"}, {-INFINITY, "-Inf"}, {NAN, "NaN"},    {4294967296.0, "4294967296"}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        metrics_format_value(buf, sizeof(buf), cases[i].v);
        assert_string_equal(buf, cases[i].want);
    }
}

static void write_plain(FILE *f, void *ud)
{
    (void)ud;
    metrics_write_header(f, "a_total", "counter", "A.");
    metrics_write_sample(f, "a_total", NULL, NULL, 0, 7);
    metrics_label l = {"k", "v"};
    metrics_write_sample(f, "a", "_total", &l, 1, 0.25);
}

static void test_sample_without_labels(void **state)
{
    (void)state;
    char *text = capture(write_plain, NULL);
    assert_string_equal(text, "# HELP a_total A.\n# TYPE a_total counter\na_total 7\n"
                              "a_total{k=\"v\"} 0.25\n");
    free(text);
}

/* Window quantiles: within the bins' 2% of the exact value; slots expire. */
static void test_window_quantiles(void **state)
{
    (void)state;
    metrics_window *w = metrics_window_new(60, 12);
    assert_non_null(w);
    int64_t t0 = 1000000000; /* 1000 s */
    assert_true(isnan(metrics_window_quantile(w, 0.5, t0)));
    for (int i = 1; i <= 100; i++)
        metrics_window_observe(w, i / 1000.0, t0 + i * 1000); /* 1 .. 100 ms */
    int64_t now = t0 + 200000;
    assert_int_equal(metrics_window_count(w, now), 100);
    double p50 = metrics_window_quantile(w, 0.5, now);
    double p90 = metrics_window_quantile(w, 0.9, now);
    double p99 = metrics_window_quantile(w, 0.99, now);
    double p0 = metrics_window_quantile(w, 0.0, now);
    assert_true(fabs(p50 - 0.050) / 0.050 < 0.021);
    assert_true(fabs(p90 - 0.090) / 0.090 < 0.021);
    assert_true(fabs(p99 - 0.099) / 0.099 < 0.021);
    assert_true(fabs(p0 - 0.001) / 0.001 < 0.021);
    /* 30 s later a new sample; 61 s later only that one is left */
    metrics_window_observe(w, 5.0, t0 + 30000000);
    assert_int_equal(metrics_window_count(w, t0 + 30000000), 101);
    assert_int_equal(metrics_window_count(w, t0 + 61000000), 1);
    assert_true(fabs(metrics_window_quantile(w, 0.5, t0 + 61000000) - 5.0) / 5.0 < 0.021);
    assert_int_equal(metrics_window_count(w, t0 + 200000000), 0);
    /* a slot reused after a full turn starts empty */
    metrics_window_observe(w, 0.002, t0 + 200000000);
    assert_int_equal(metrics_window_count(w, t0 + 200000000), 1);
    metrics_window_destroy(&w);
    assert_null(w);
    assert_null(metrics_window_new(5, 12));
    assert_null(metrics_window_new(5, 0));
}

// --- stats exposition

static void write_stats(FILE *f, void *ud)
{
    prometheus_write(ud, NULL, f);
}

/* The value of the sample line that starts with prefix (name and labels), or NaN. */
static double sample_value(const char *text, const char *prefix)
{
    const char *p = text;
    size_t n = strlen(prefix);
    while (p && *p) {
        if (strncmp(p, prefix, n) == 0 && p[n] == ' ')
            return strtod(p + n + 1, NULL);
        p = strchr(p, '\n');
        if (p)
            p++;
    }
    return NAN;
}

/* Counters follow requests exactly; every family has HELP and TYPE; histograms count the
 * finished requests. */
static void test_stats_exposition(void **state)
{
    (void)state;
    stats_params sp = stats_default_params();
    sp.model_name = "tiny";
    stats_t *s = stats_new(&sp);
    assert_non_null(s);
    int64_t t0 = 5000000000;
    for (int i = 0; i < 3; i++) {
        cluster_req_timing t = {.admit_us = t0,
                                .dispatch_us = t0 + 1000,
                                .worker_queue_us = 500,
                                .prefill_us = 20000,
                                .xfer_us = 3000,
                                .xfer_bytes = 65536,
                                .step_us = 700,
                                .attempts = 1};
        snprintf(t.prefill_worker, sizeof(t.prefill_worker), "p0");
        snprintf(t.decode_worker, sizeof(t.decode_worker), "d0");
        stats_request_received(s);
        stats_first_token(s, &t, t0 + 25000);
        stats_tokens(s, &t, 0.02, t0 + 45000);
        stats_tokens(s, &t, 0.02, t0 + 65000);
        stats_request r = {.rid = (uint64_t)i + 1,
                           .how = STATS_END_FINISHED,
                           .finish_reason = i == 0 ? "stop" : "length",
                           .n_prompt = 5 + i,
                           .n_output = 3,
                           .t_first_us = t0 + 25000,
                           .t_last_us = t0 + 65000,
                           .t_end_us = t0 + 66000,
                           .timing = &t};
        stats_breakdown b;
        stats_request_end(s, &r, &b);
        assert_true(fabs(b.queue_ms - 1.5) < 1e-9);
        assert_true(fabs(b.prefill_ms - 20.0) < 1e-9);
        assert_true(fabs(b.transfer_ms - 3.0) < 1e-9);
        assert_true(fabs(b.first_decode_ms - 0.7) < 1e-9);
        assert_true(fabs(b.ttft_ms - 25.0) < 1e-9);
        assert_true(fabs(b.e2e_ms - 66.0) < 1e-9);
    }
    stats_request_received(s);
    stats_request_rejected(s);
    stats_http_response(s, 200);
    stats_http_response(s, 400);
    char *text = capture(write_stats, s);
    assert_true(sample_value(text, "tidepool_prompt_tokens_total{model_name=\"tiny\"}") == 18);
    assert_true(sample_value(text, "tidepool_generation_tokens_total{model_name=\"tiny\"}") == 9);
    assert_true(sample_value(text, "tidepool_request_success_total{model_name=\"tiny\","
                                   "finished_reason=\"stop\"}") == 1);
    assert_true(sample_value(text, "tidepool_request_success_total{model_name=\"tiny\","
                                   "finished_reason=\"length\"}") == 2);
    assert_true(sample_value(text, "tidepool_requests_received_total{model_name=\"tiny\"}") == 4);
    assert_true(sample_value(text, "tidepool_request_failure_total{model_name=\"tiny\"}") == 1);
    assert_true(sample_value(text, "tidepool_http_responses_total{model_name=\"tiny\","
                                   "code=\"400\"}") == 1);
    assert_true(sample_value(text, "tidepool_time_to_first_token_seconds_count{model_name="
                                   "\"tiny\"}") == 3);
    assert_true(sample_value(text, "tidepool_time_to_first_token_seconds_bucket{model_name="
                                   "\"tiny\",le=\"0.02\"}") == 0);
    assert_true(sample_value(text, "tidepool_time_to_first_token_seconds_bucket{model_name="
                                   "\"tiny\",le=\"0.04\"}") == 3);
    assert_true(sample_value(text, "tidepool_inter_token_latency_seconds_count{model_name="
                                   "\"tiny\"}") == 6);
    assert_true(sample_value(text, "tidepool_kv_transfer_bytes_bucket{model_name=\"tiny\","
                                   "le=\"65536\"}") == 3);
    assert_true(fabs(sample_value(text, "tidepool_request_queue_time_seconds_sum{model_name="
                                        "\"tiny\"}") -
                     0.0045) < 1e-12);
    assert_true(fabs(sample_value(text, "tidepool_request_time_per_output_token_seconds_sum{"
                                        "model_name=\"tiny\"}") -
                     0.06) < 1e-12);
    /* every sample's family has HELP and TYPE before it */
    for (const char *p = text; *p;) {
        const char *eol = strchr(p, '\n');
        assert_non_null(eol);
        if (*p != '#') {
            char name[160];
            size_t n = strcspn(p, "{ ");
            assert_true(n < sizeof(name));
            memcpy(name, p, n);
            name[n] = 0;
            char *base = name;
            const char *suffixes[] = {"_bucket", "_sum", "_count"};
            char help[200], type[200];
            snprintf(help, sizeof(help), "# HELP %s ", base);
            snprintf(type, sizeof(type), "# TYPE %s ", base);
            if (!strstr(text, type)) {
                for (int k = 0; k < 3; k++) {
                    size_t ls = strlen(suffixes[k]);
                    if (n > ls && strcmp(name + n - ls, suffixes[k]) == 0) {
                        name[n - ls] = 0;
                        break;
                    }
                }
                snprintf(help, sizeof(help), "# HELP %s ", base);
                snprintf(type, sizeof(type), "# TYPE %s histogram", base);
            }
            if (!strstr(text, help) || !strstr(text, type))
                fail_msg("no HELP/TYPE for %s", name);
        }
        p = eol + 1;
    }
    /* figures and events */
    stats_gateway_figures g;
    stats_get_gateway(s, NULL, &g);
    assert_int_equal(g.received, 4);
    assert_int_equal(g.finished, 3);
    assert_int_equal(g.failed_total, 1);
    assert_int_equal(g.http_4xx, 1);
    stats_worker_figures wf;
    stats_get_worker(s, "d0", t0 + 70000, &wf);
    assert_int_equal(wf.itl.n, 6);
    assert_int_equal(wf.tpot.n, 3);
    assert_int_equal(wf.ttft.n, 0);
    stats_get_worker(s, "p0", t0 + 70000, &wf);
    assert_int_equal(wf.ttft.n, 3);
    assert_true(fabs(wf.ttft.p50 - 0.025) / 0.025 < 0.021);
    cluster_event ce = {
        .type = CLUSTER_EV_WORKER_DOWN, .worker = "d0", .role = 2, .reason = "gone"};
    stats_on_cluster_event(&ce, s);
    assert_int_equal(stats_n_events(s), 1);
    assert_string_equal(stats_event_at(s, 0)->type, "worker_down");
    assert_string_equal(stats_event_at(s, 0)->reason, "gone");
    free(text);
    stats_destroy(&s);
    assert_null(s);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bucket_placement),
        cmocka_unit_test(test_bucket_sets_and_bad_bounds),
        cmocka_unit_test(test_exposition_text),
        cmocka_unit_test(test_format_value),
        cmocka_unit_test(test_sample_without_labels),
        cmocka_unit_test(test_window_quantiles),
        cmocka_unit_test(test_stats_exposition),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("metrics", tests, NULL, NULL);
}
