/*
 * The computing parts of tidepool-bench (tools/bench/): the statistics against numpy's
 * definitions worked out by hand (relative tolerance 1e-12), the SSE parser on a stream
 * with every feature, split at every pair of positions, the flag parser, the seeded
 * workload (golden values from an independent Python model of the generator, exact counts,
 * bounds, the phase-shift rate switching at phase boundaries), the dataset loader and the
 * per-record figures of the report (TPOT, goodput, phase filter); and requests in flight
 * against a scripted HTTP server in the same event loop (the record each kind of response
 * leaves: token counts from usage or chunks, ITL samples, every failure's kind and message,
 * the error groups, interrupt and timeout, every flight freed once).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "bench.h"
#include "bench_args.h"
#include "bench_dataset.h"
#include "bench_flight.h"
#include "bench_report.h"
#include "bench_sse.h"
#include "bench_stats.h"
#include "bench_trace.h"
#include "bench_workload.h"

static void assert_close(double got, double want, double rel)
{
    if (!(fabs(got - want) <= rel * fmax(fabs(want), 1e-300)))
        fail_msg("got %.17g, want %.17g (rel %.1e)", got, want, rel);
}

// --- statistics

/* 1..100 (given in reverse): numpy gives mean 50.5, std sqrt((100^2 - 1) / 12), median
 * 50.5, and percentile p at rank p/100 * 99: p90 = 90.1, p95 = 95.05, p99 = 99.01 (a
 * nearest-rank definition would give 90, 95, 99). */
static void test_stats_1_to_100(void **state)
{
    (void)state;
    double v[100];
    for (int i = 0; i < 100; i++)
        v[i] = 100 - i;
    bench_stats d;
    bench_stats_compute(v, 100, &d);
    assert_int_equal(d.n, 100);
    assert_close(d.mean, 50.5, 1e-12);
    assert_close(d.std, sqrt(9999.0 / 12.0), 1e-12);
    assert_close(d.median, 50.5, 1e-12);
    assert_close(d.p90, 90.1, 1e-12);
    assert_close(d.p95, 95.05, 1e-12);
    assert_close(d.p99, 99.01, 1e-12);
    for (int i = 0; i < 100; i++) /* sorted in place */
        assert_true(v[i] == i + 1);
    assert_close(bench_stats_percentile(v, 100, 0), 1, 1e-12);
    assert_close(bench_stats_percentile(v, 100, 100), 100, 1e-12);
    assert_close(bench_stats_percentile(v, 100, 25), 25.75, 1e-12);
}

/* Small samples: empty (zeros), one value, numpy's np.percentile([1,2,3,4], 90) = 3.7 and
 * 25 -> 1.75, duplicates, negative values. */
static void test_stats_small_samples(void **state)
{
    (void)state;
    bench_stats d;
    memset(&d, 0x5a, sizeof(d));
    bench_stats_compute(NULL, 0, &d);
    assert_int_equal(d.n, 0);
    assert_true(d.mean == 0 && d.std == 0 && d.median == 0 && d.p90 == 0 && d.p95 == 0 &&
                d.p99 == 0);

    double one[] = {7.25};
    bench_stats_compute(one, 1, &d);
    assert_int_equal(d.n, 1);
    assert_true(d.mean == 7.25 && d.std == 0 && d.median == 7.25 && d.p99 == 7.25);

    double four[] = {4, 1, 3, 2};
    bench_stats_compute(four, 4, &d);
    assert_close(d.mean, 2.5, 1e-12);
    assert_close(d.std, sqrt(1.25), 1e-12);
    assert_close(d.median, 2.5, 1e-12);
    assert_close(d.p90, 3.7, 1e-12);
    assert_close(d.p95, 3.85, 1e-12);
    assert_close(d.p99, 3.97, 1e-12);
    assert_close(bench_stats_percentile(four, 4, 25), 1.75, 1e-12);

    double dup[] = {5, 5, 1, 5};
    bench_stats_compute(dup, 4, &d);
    assert_close(d.median, 5, 1e-12);
    assert_close(d.p90, 5, 1e-12);
    assert_close(d.mean, 4, 1e-12);
    assert_close(d.std, sqrt(3.0), 1e-12); /* deviations -3, 1, 1, 1 */

    double neg[] = {-10, 10};
    bench_stats_compute(neg, 2, &d);
    assert_true(fabs(d.median) < 1e-12);
    assert_close(d.p90, 8, 1e-12);
    assert_close(d.p99, 9.8, 1e-12);
    assert_close(d.std, 10, 1e-12);
}

// --- SSE

#define MAX_EV 64

typedef struct {
    char event[MAX_EV][40];
    char data[MAX_EV][256];
    size_t n_data[MAX_EV];
    int n;
    int stop_at;  /* return 7 from the event with this index (-1: never) */
} sse_rec;

static int sse_collect(void *ctx, const char *event, const char *data, size_t n)
{
    sse_rec *r = ctx;
    assert_true(r->n < MAX_EV);
    assert_true(strlen(data) == n); /* NUL-terminated, no embedded NUL here */
    snprintf(r->event[r->n], sizeof(r->event[0]), "%s", event);
    snprintf(r->data[r->n], sizeof(r->data[0]), "%s", data);
    r->n_data[r->n] = n;
    return r->n++ == r->stop_at ? 7 : 0;
}

/* Every feature: comments, event names, multi-line data, CRLF, a field without a colon,
 * "data:" without the space, two spaces (one kept), id/retry ignored, an event without
 * data (not dispatched), an over-long event name (truncated to 31), and a last event
 * without its blank line (dispatched by finish). */
static const char SSE_STREAM[] =
    ": keep-alive\n"
    "data: {\"a\": 1}\n"
    "\n"
    "event: message\r\n"
    "data: first\r\n"
    "data: second\r\n"
    "\r\n"
    "id: 17\n"
    "retry: 100\n"
    "data:nospace\n"
    "data:  two spaces\n"
    "\n"
    "event: lonely\n"
    "\n"
    "data\n"
    "\n"
    "event: abcdefghijklmnopqrstuvwxyz0123456789\n"
    "data: [DONE]\n"
    "\n"
    "data: tail";

static const struct {
    const char *event, *data;
} SSE_WANT[] = {
    {"", "{\"a\": 1}"},
    {"message", "first\nsecond"},
    {"", "nospace\n two spaces"},
    {"", ""},
    {"abcdefghijklmnopqrstuvwxyz01234", "[DONE]"},
    {"", "tail"},
};
#define N_SSE_WANT ((int)(sizeof(SSE_WANT) / sizeof(SSE_WANT[0])))

static void sse_check(const sse_rec *r)
{
    assert_int_equal(r->n, N_SSE_WANT);
    for (int i = 0; i < N_SSE_WANT; i++) {
        assert_string_equal(r->event[i], SSE_WANT[i].event);
        assert_string_equal(r->data[i], SSE_WANT[i].data);
        assert_int_equal(r->n_data[i], strlen(SSE_WANT[i].data));
    }
}

/* Feed the stream in pieces cut at a and b (0 <= a <= b <= n), then finish. */
static void sse_run_split(size_t a, size_t b, sse_rec *r)
{
    size_t n = sizeof(SSE_STREAM) - 1;
    memset(r, 0, sizeof(*r));
    r->stop_at = -1;
    bench_sse_t *p = bench_sse_new(1 << 16);
    assert_non_null(p);
    assert_int_equal(bench_sse_feed(p, SSE_STREAM, a, sse_collect, r), 0);
    assert_int_equal(bench_sse_feed(p, SSE_STREAM + a, b - a, sse_collect, r), 0);
    assert_int_equal(bench_sse_feed(p, SSE_STREAM + b, n - b, sse_collect, r), 0);
    assert_int_equal(bench_sse_finish(p, sse_collect, r), 0);
    bench_sse_destroy(&p);
    assert_null(p);
}

static void test_sse_events(void **state)
{
    (void)state;
    sse_rec r;
    size_t n = sizeof(SSE_STREAM) - 1;
    sse_run_split(n, n, &r); /* one piece */
    sse_check(&r);
    /* the tail event is dispatched by finish, not before */
    memset(&r, 0, sizeof(r));
    r.stop_at = -1;
    bench_sse_t *p = bench_sse_new(1 << 16);
    assert_int_equal(bench_sse_feed(p, SSE_STREAM, n, sse_collect, &r), 0);
    assert_int_equal(r.n, N_SSE_WANT - 1);
    assert_int_equal(bench_sse_finish(p, sse_collect, &r), 0);
    assert_int_equal(r.n, N_SSE_WANT);
    bench_sse_destroy(&p);
    bench_sse_destroy(&p); /* takes NULL */
    bench_sse_destroy(NULL);
}

/* Cut anywhere, twice: the same events. Then one byte at a time. */
static void test_sse_any_split(void **state)
{
    (void)state;
    size_t n = sizeof(SSE_STREAM) - 1;
    sse_rec r;
    for (size_t a = 0; a <= n; a++)
        for (size_t b = a; b <= n; b++) {
            sse_run_split(a, b, &r);
            sse_check(&r);
        }
    memset(&r, 0, sizeof(r));
    r.stop_at = -1;
    bench_sse_t *p = bench_sse_new(1 << 16);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(bench_sse_feed(p, SSE_STREAM + i, 1, sse_collect, &r), 0);
    assert_int_equal(bench_sse_finish(p, sse_collect, &r), 0);
    sse_check(&r);
    bench_sse_destroy(&p);
}

/* The callback's stop value comes back and nothing after it is dispatched; the byte bound
 * holds for complete lines, for a line split across pieces and for a line that never
 * ends; a line end splits only at '\n' (a lone '\r' is data). */
static void test_sse_stop_and_limits(void **state)
{
    (void)state;
    sse_rec r;
    memset(&r, 0, sizeof(r));
    r.stop_at = 1;
    bench_sse_t *p = bench_sse_new(1 << 16);
    assert_int_equal(bench_sse_feed(p, SSE_STREAM, sizeof(SSE_STREAM) - 1, sse_collect, &r), 7);
    assert_int_equal(r.n, 2);
    assert_string_equal(r.data[1], "first\nsecond");
    bench_sse_destroy(&p);

    /* bound 16: "data: " + 15 bytes + NUL is 16: fits; 16 bytes does not */
    memset(&r, 0, sizeof(r));
    r.stop_at = -1;
    p = bench_sse_new(16);
    assert_int_equal(bench_sse_feed(p, "data: 123456789012345\n\n", 23, sse_collect, &r), 0);
    assert_int_equal(r.n, 1);
    assert_int_equal(r.n_data[0], 15);
    assert_int_equal(bench_sse_feed(p, "data: 1234567890123456\n\n", 24, sse_collect, &r),
                     BENCH_SSE_ERR_TOO_LARGE);
    bench_sse_destroy(&p);

    /* data lines accumulate against the bound */
    p = bench_sse_new(16);
    assert_int_equal(bench_sse_feed(p, "data: 12345678\n", 15, sse_collect, &r), 0);
    assert_int_equal(bench_sse_feed(p, "data: 12345678\n", 15, sse_collect, &r),
                     BENCH_SSE_ERR_TOO_LARGE);
    bench_sse_destroy(&p);

    /* a line that never ends */
    p = bench_sse_new(64);
    char junk[40];
    memset(junk, 'x', sizeof(junk));
    assert_int_equal(bench_sse_feed(p, junk, sizeof(junk), sse_collect, &r), 0);
    assert_int_equal(bench_sse_feed(p, junk, sizeof(junk), sse_collect, &r),
                     BENCH_SSE_ERR_TOO_LARGE);
    bench_sse_destroy(&p);

    /* "\r" alone is not a line end: the event's data keeps it */
    memset(&r, 0, sizeof(r));
    r.stop_at = -1;
    p = bench_sse_new(64);
    assert_int_equal(bench_sse_feed(p, "data: a\rb\n\n", 11, sse_collect, &r), 0);
    assert_int_equal(r.n, 1);
    assert_string_equal(r.data[0], "a\rb");
    /* finish on an empty parser dispatches nothing */
    assert_int_equal(bench_sse_finish(p, sse_collect, &r), 0);
    assert_int_equal(r.n, 1);
    bench_sse_destroy(&p);
}

// --- flags

static int parse(bench_args *a, const char **argv)
{
    int argc = 0;
    while (argv[argc])
        argc++;
    return bench_args_parse(a, argc, (char **)argv);
}

static void test_args_parse(void **state)
{
    (void)state;
    bench_args a;
    const char *none[] = {"tidepool-bench", NULL};
    assert_int_equal(parse(&a, none), 0);
    assert_string_equal(a.url, "http://127.0.0.1:8000");
    assert_string_equal(a.endpoint, "/v1/completions");
    assert_null(a.model);
    assert_int_equal(a.num_prompts, 100);
    assert_int_equal(a.concurrency, 0);
    assert_true(isinf(a.request_rate));
    assert_int_equal(a.input_len, 128);
    assert_int_equal(a.output_len, 128);
    assert_true(a.input_range[0] < 0 && a.output_range[0] < 0);
    assert_string_equal(a.workload, "synthetic");
    assert_close(a.phase_s, 10, 1e-12);
    assert_close(a.timeout_s, 600, 1e-12);
    for (int k = 0; k < BENCH_ARGS_N_SLO; k++)
        assert_true(a.slo_ms[k] < 0);
    assert_int_equal(a.ignore_eos, 0);
    assert_int_equal(a.set_input_len, 0);

    const char *some[] = {"tidepool-bench", "--num-prompts=7", "--max-concurrency", "3",
                          "--request-rate", "2.5", "--input-len-range", "4:9",
                          "--output-len=12", "--ignore-eos", "--goodput", "ttft:500",
                          "tpot:50", "--goodput=e2el:2000", "--model", "m", NULL};
    assert_int_equal(parse(&a, some), 0);
    assert_int_equal(a.num_prompts, 7);
    assert_int_equal(a.concurrency, 3);
    assert_close(a.request_rate, 2.5, 1e-12);
    assert_true(a.input_range[0] == 4 && a.input_range[1] == 9);
    assert_int_equal(a.output_len, 12);
    assert_int_equal(a.set_output_len, 1);
    assert_int_equal(a.ignore_eos, 1);
    assert_close(a.slo_ms[BENCH_ARGS_SLO_TTFT], 500, 1e-12);
    assert_close(a.slo_ms[BENCH_ARGS_SLO_TPOT], 50, 1e-12);
    assert_close(a.slo_ms[BENCH_ARGS_SLO_E2EL], 2000, 1e-12);
    assert_string_equal(a.model, "m");
    const char *joined[] = {"tidepool-bench", "--goodput", "ttft:1,tpot:2", NULL};
    assert_int_equal(parse(&a, joined), 0);
    assert_close(a.slo_ms[BENCH_ARGS_SLO_TTFT], 1, 1e-12);
    assert_close(a.slo_ms[BENCH_ARGS_SLO_TPOT], 2, 1e-12);
    assert_true(a.slo_ms[BENCH_ARGS_SLO_E2EL] < 0);

    assert_string_equal(bench_args_slo_name(BENCH_ARGS_SLO_TTFT), "ttft");
    assert_string_equal(bench_args_slo_name(BENCH_ARGS_SLO_TPOT), "tpot");
    assert_string_equal(bench_args_slo_name(BENCH_ARGS_SLO_E2EL), "e2el");
    assert_string_equal(bench_args_slo_name(3), "?");

    const char *bad[][4] = {
        {"--num-prompts", "0", NULL},       {"--num-prompts", "1x", NULL},
        {"--request-rate", "0", NULL},      {"--input-len-range", "9:4", NULL},
        {"--input-len-range", "4", NULL},   {"--goodput", "ttft:0", NULL},
        {"--goodput", "foo:5", NULL},       {"--ignore-eos=1", NULL},
        {"--no-such-flag", NULL},           {"--model", NULL},
        {"positional", NULL},               {"--temperature", "2.5", NULL},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        const char *argv[5] = {"tidepool-bench", bad[i][0], bad[i][1], bad[i][2], NULL};
        if (parse(&a, argv) != -1)
            fail_msg("accepted: %s %s", bad[i][0], bad[i][1] ? bad[i][1] : "");
    }
}

// --- workload

static bench_args default_args(void)
{
    bench_args a;
    const char *none[] = {"tidepool-bench", NULL};
    assert_int_equal(parse(&a, none), 0);
    return a;
}

/* A stand-in tokenizer: BOS (1), then one id per byte (its value + 3). */
static int byte_tokenize(void *ctx, const char *text, size_t len, int **ids, size_t *n)
{
    int *calls = ctx;
    (*calls)++;
    int *out = malloc((len + 1) * sizeof(int));
    if (!out)
        return -1;
    out[0] = 1;
    for (size_t i = 0; i < len; i++)
        out[i + 1] = (unsigned char)text[i] + 3;
    *ids = out;
    *n = len + 1;
    return 0;
}

/* --prompt-tokenizer: the synthetic prompt of request 0 (seed 7, as the golden test) is
 * sent as its ids, everything else as before. */
static void test_workload_token_prompts(void **state)
{
    (void)state;
    bench_args a = default_args();
    a.seed = 7;
    a.input_range[0] = 3, a.input_range[1] = 9;
    a.output_range[0] = 1, a.output_range[1] = 100;
    int calls = 0;
    a.tokenize = byte_tokenize;
    a.tokenize_ctx = &calls;
    bench_workload_shape shape = {0, 0};
    char *text = bench_workload_body(&a, NULL, "m", 0, 0, BENCH_WORKLOAD_PHASE_NONE, &shape);
    assert_non_null(text);
    assert_int_equal(calls, 1);
    json_t *j = json_loads(text, 0, NULL);
    assert_non_null(j);
    const char *want = "found night looked hat box";
    json_t *p = json_object_get(j, "prompt");
    assert_true(json_is_array(p));
    assert_int_equal(json_array_size(p), strlen(want) + 1);
    assert_int_equal(json_integer_value(json_array_get(p, 0)), 1);
    for (size_t k = 0; k < strlen(want); k++)
        assert_int_equal(json_integer_value(json_array_get(p, k + 1)),
                         (unsigned char)want[k] + 3);
    assert_int_equal(json_integer_value(json_object_get(j, "max_tokens")), 77);
    assert_int_equal(shape.prompt_words, 5);
    json_decref(j);
    free(text);
}

/* Golden values from an independent Python model of the generator (splitmix64 streams):
 * seed 7, prompts of 3..9 words, max_tokens 1..100; arrivals at 10 req/s. A change here
 * changes every seeded run's requests (docs/bench.md promises same seed, same requests). */
static void test_workload_golden(void **state)
{
    (void)state;
    bench_args a = default_args();
    a.seed = 7;
    a.input_range[0] = 3, a.input_range[1] = 9;
    a.output_range[0] = 1, a.output_range[1] = 100;
    static const struct {
        const char *prompt;
        long long words, max_tokens;
    } want[] = {
        {"found night looked hat box", 5, 77},
        {"red day house bird garden he looked boy", 8, 15},
        {"sad red he", 3, 45},
    };
    for (size_t i = 0; i < 3; i++) {
        bench_workload_shape shape = {0, 0};
        char *text = bench_workload_body(&a, NULL, "m", 0, i, BENCH_WORKLOAD_PHASE_NONE, &shape);
        assert_non_null(text);
        json_t *j = json_loads(text, 0, NULL);
        assert_non_null(j);
        assert_string_equal(json_string_value(json_object_get(j, "prompt")), want[i].prompt);
        assert_int_equal(json_integer_value(json_object_get(j, "max_tokens")), want[i].max_tokens);
        assert_int_equal(shape.prompt_words, want[i].words);
        assert_int_equal(shape.max_tokens, want[i].max_tokens);
        json_decref(j);
        free(text);
    }
    a.request_rate = 10;
    double t[5];
    assert_int_equal(bench_workload_arrivals(&a, t, 5), 5);
    const double want_t[5] = {0.0, 0.25717046324228526, 0.3875732159737546, 0.6337043734955936,
                              0.6415603189919249};
    assert_true(t[0] == 0);
    for (int i = 1; i < 5; i++)
        assert_close(t[i], want_t[i], 1e-12);
}

/* Infinite rate: everyone at 0. Finite: starts at 0, strictly increasing, the same for the
 * same seed and not for another, mean gap 1/rate (within 5%); --duration-s cuts exactly a
 * prefix of the same schedule, every arrival before the limit. */
static void test_workload_arrivals(void **state)
{
    (void)state;
    enum { N = 4000 };
    static double t[N], u[N], w[N];
    bench_args a = default_args();
    a.seed = 11;
    assert_int_equal(bench_workload_arrivals(&a, t, N), N);
    for (int i = 0; i < N; i++)
        assert_true(t[i] == 0);

    a.request_rate = 50;
    assert_int_equal(bench_workload_arrivals(&a, t, N), N);
    assert_int_equal(bench_workload_arrivals(&a, u, N), N);
    assert_memory_equal(t, u, sizeof(t));
    assert_true(t[0] == 0);
    for (int i = 1; i < N; i++)
        assert_true(t[i] > t[i - 1]);
    assert_close(t[N - 1] / (N - 1), 1.0 / 50, 0.05);
    a.seed = 12;
    assert_int_equal(bench_workload_arrivals(&a, w, N), N);
    assert_true(memcmp(t, w, sizeof(t)) != 0);

    a.seed = 11;
    a.duration_s = 20;
    size_t k = 0;
    while (k < N && t[k] < 20)
        k++;
    assert_true(k > 900 && k < 1100); /* about 50 * 20 */
    memset(w, 0, sizeof(w));
    assert_int_equal(bench_workload_arrivals(&a, w, N), k);
    assert_memory_equal(w, t, k * sizeof(double));
    assert_true(w[k] == 0); /* nothing written past the cut */
    /* fewer requests than the window holds: all of them */
    assert_int_equal(bench_workload_arrivals(&a, w, 10), 10);
    /* one request always arrives, at 0 */
    a.duration_s = 1e-9;
    assert_int_equal(bench_workload_arrivals(&a, w, N), 1);
    assert_true(w[0] == 0);
}

/* The phase of a time, and next_arrival worked by hand: rate 10 in prefill-heavy phases,
 * 2 in decode-heavy ones, phases of 1 s. From t = 0.5 with e = 10: 0.5 s of phase 0 spends
 * 5, phase 1 spends 2, the remaining 3 at rate 10 lands at 2.3. */
static void test_workload_next_arrival(void **state)
{
    (void)state;
    bench_args a = default_args();
    a.workload = "phase-shift";
    a.phase_s = 1;
    a.request_rate = 10;
    a.decode_rate = 2;
    assert_int_equal(bench_workload_phase_shift(&a), 1);
    assert_int_equal(bench_workload_phase_at(&a, 0), BENCH_WORKLOAD_PHASE_PREFILL);
    assert_int_equal(bench_workload_phase_at(&a, 0.999), BENCH_WORKLOAD_PHASE_PREFILL);
    assert_int_equal(bench_workload_phase_at(&a, 1), BENCH_WORKLOAD_PHASE_DECODE);
    assert_int_equal(bench_workload_phase_at(&a, 1.5), BENCH_WORKLOAD_PHASE_DECODE);
    assert_int_equal(bench_workload_phase_at(&a, 2), BENCH_WORKLOAD_PHASE_PREFILL);
    assert_int_equal(bench_workload_phase_at(&a, 7.25), BENCH_WORKLOAD_PHASE_DECODE);

    assert_close(bench_workload_next_arrival(&a, 0.5, 10), 2.3, 1e-12);
    assert_close(bench_workload_next_arrival(&a, 0.2, 1), 0.3, 1e-12);
    assert_close(bench_workload_next_arrival(&a, 1.2, 0.5), 1.45, 1e-12);
    assert_close(bench_workload_next_arrival(&a, 1.2, 1.6), 2, 1e-12); /* to the boundary */
    assert_close(bench_workload_next_arrival(&a, 0.9, 1.0 + 2 + 10 * 0.5), 2.5, 1e-12);
    /* no decode rate, or not phase-shift: one rate */
    a.decode_rate = 0;
    assert_close(bench_workload_next_arrival(&a, 0.5, 10), 1.5, 1e-12);
    a.decode_rate = 2;
    a.workload = "synthetic";
    assert_int_equal(bench_workload_phase_shift(&a), 0);
    assert_close(bench_workload_next_arrival(&a, 0.5, 10), 1.5, 1e-12);
}

/* The integrated rate of the phased schedule, L(t) = sum over phases of rate * time, at
 * each arrival equals the unphased schedule at the prefill rate times that rate: the same
 * exponential draws, spent at each phase's rate. And the counts per phase follow the
 * rates (100 vs 10 req/s). */
static void test_workload_phase_rates(void **state)
{
    (void)state;
    enum { N = 3000 };
    static double t[N], u[N];
    bench_args a = default_args();
    a.seed = 5;
    a.workload = "phase-shift";
    a.phase_s = 0.5;
    a.request_rate = 100;
    a.decode_rate = 10;
    assert_int_equal(bench_workload_arrivals(&a, t, N), N);
    a.decode_rate = 0;
    assert_int_equal(bench_workload_arrivals(&a, u, N), N);
    double n_phase[2] = {0, 0};
    for (int i = 0; i < N; i++) {
        double k = floor(t[i] / 0.5), r = t[i] - k * 0.5;
        double full = floor(k / 2) * 0.5 * (100 + 10) + (fmod(k, 2) ? 0.5 * 100 : 0);
        double L = full + r * (fmod(k, 2) ? 10 : 100);
        assert_close(L, 100 * u[i], 1e-9);
        if (i > 0)
            assert_true(t[i] > t[i - 1]);
        n_phase[bench_workload_phase_at(&a, t[i])]++;
    }
    /* N arrivals span about N / 55 s, half in each kind of phase */
    double span = t[N - 1];
    assert_close(n_phase[0] / (span / 2), 100, 0.1);
    assert_close(n_phase[1] / (span / 2), 10, 0.25);
}

static int is_word(const char *w, size_t n)
{
    static const char *const list = " the a little girl boy cat dog sun tree ball red big "
                                    "happy sad day park ran saw played jumped and with to in "
                                    "was she he they friend mom home bird fish water sky blue "
                                    "green small went said looked found toy box car house "
                                    "garden flower apple cake rain night star moon bear "
                                    "rabbit duck hat shoe book door window road hill ";
    char key[16];
    if (n == 0 || n > 7)
        return 0;
    snprintf(key, sizeof(key), " %.*s ", (int)n, w);
    return strstr(list, key) != NULL;
}

/* Count the words of s, checking each is from the list; -1 on a stray word. */
static long long count_list_words(const char *s)
{
    long long n = 0;
    while (*s) {
        const char *e = strchr(s, ' ');
        size_t k = e ? (size_t)(e - s) : strlen(s);
        if (!is_word(s, k))
            return -1;
        n++;
        s += k;
        if (*s == ' ')
            s++;
    }
    return n;
}

static json_t *body_of(const bench_args *a, const bench_dataset_t *ds, int chat, size_t idx,
                       int phase, bench_workload_shape *shape)
{
    char *text = bench_workload_body(a, ds, "the-model", chat, idx, phase, shape);
    assert_non_null(text);
    json_error_t je;
    json_t *j = json_loads(text, 0, &je);
    if (!j)
        fail_msg("body is not JSON: %s", text);
    free(text);
    return j;
}

static const char *fake_reply(void *ctx, size_t idx)
{
    (void)ctx;
    static const char *r[] = {" R0", " R1", " R2", " R3", " R4", " R5"};
    return idx < 6 ? r[idx] : NULL;
}

static const char *msg_text(const json_t *msgs, size_t i, const char *role)
{
    const json_t *m = json_array_get(msgs, i);
    assert_string_equal(json_string_value(json_object_get(m, "role")), role);
    return json_string_value(json_object_get(m, "content"));
}

/* Multi-turn: request idx is turn idx / C of conversation idx % C; it waits for the turn
 * before; its messages are the shared system prompt, the earlier user messages (the same
 * text in every later turn) and replies (reply_of, else synthetic), then its own. */
static void test_workload_multi_turn(void **state)
{
    (void)state;
    bench_args a = default_args();
    a.workload = "multi-turn";
    a.conversations = 2;
    a.turns = 3;
    a.system_len = 4;
    a.input_len = 3;
    a.output_len = 5;
    assert_int_equal(bench_workload_n_requests(&a), 6);
    assert_int_equal(bench_workload_after(&a, 0), -1);
    assert_int_equal(bench_workload_after(&a, 1), -1);
    assert_int_equal(bench_workload_after(&a, 2), 0);
    assert_int_equal(bench_workload_after(&a, 5), 3);
    a.reply_of = fake_reply;
    bench_workload_shape shape;
    json_t *t0 = body_of(&a, NULL, 1, 1, BENCH_WORKLOAD_PHASE_NONE, &shape); /* conv 1 turn 0 */
    json_t *t2 = body_of(&a, NULL, 1, 5, BENCH_WORKLOAD_PHASE_NONE, &shape); /* conv 1 turn 2 */
    json_t *o0 = body_of(&a, NULL, 1, 0, BENCH_WORKLOAD_PHASE_NONE, &shape); /* conv 0 turn 0 */
    const json_t *m0 = json_object_get(t0, "messages"), *m2 = json_object_get(t2, "messages");
    assert_int_equal(json_array_size(m0), 2);
    assert_int_equal(json_array_size(m2), 6);
    assert_int_equal(count_list_words(msg_text(m0, 0, "system")), 4);
    assert_string_equal(msg_text(m2, 0, "system"), msg_text(m0, 0, "system"));
    assert_string_equal(msg_text(json_object_get(o0, "messages"), 0, "system"),
                        msg_text(m0, 0, "system"));
    assert_string_equal(msg_text(m2, 1, "user"), msg_text(m0, 1, "user"));
    assert_int_equal(count_list_words(msg_text(m0, 1, "user")), 3);
    assert_string_equal(msg_text(m2, 2, "assistant"), " R1"); /* turn 0 of conv 1 = idx 1 */
    assert_string_equal(msg_text(m2, 4, "assistant"), " R3");
    assert_int_equal(count_list_words(msg_text(m2, 5, "user")), 3);
    assert_int_equal(shape.prompt_words, 4 + 3);
    assert_true(strcmp(msg_text(json_object_get(o0, "messages"), 1, "user"),
                       msg_text(m0, 1, "user")) != 0);
    /* completions: one text that the next turn's text extends */
    json_t *c1 = body_of(&a, NULL, 0, 3, BENCH_WORKLOAD_PHASE_NONE, &shape); /* conv 1 turn 1 */
    json_t *c2 = body_of(&a, NULL, 0, 5, BENCH_WORKLOAD_PHASE_NONE, &shape);
    const char *p1 = json_string_value(json_object_get(c1, "prompt"));
    const char *p2 = json_string_value(json_object_get(c2, "prompt"));
    assert_non_null(p1);
    assert_true(strncmp(p2, p1, strlen(p1)) == 0);
    assert_true(strncmp(p2 + strlen(p1), " R3\n\nUser: ", 11) == 0);
    assert_true(strlen(p2) > 12 && strcmp(p2 + strlen(p2) - 11, "\nAssistant:") == 0);
    /* no reply recorded: a synthetic one of output_len words */
    a.reply_of = NULL;
    json_t *s2 = body_of(&a, NULL, 1, 5, BENCH_WORKLOAD_PHASE_NONE, &shape);
    assert_int_equal(count_list_words(msg_text(json_object_get(s2, "messages"), 2, "assistant")),
                     5);
    json_decref(t0), json_decref(t2), json_decref(o0), json_decref(c1), json_decref(c2);
    json_decref(s2);
}

/* Shared-prefix: every prompt starts with the same prefix words, then its own. */
static void test_workload_shared_prefix(void **state)
{
    (void)state;
    bench_args a = default_args();
    a.workload = "shared-prefix";
    a.prefix_len = 6;
    a.input_len = 2;
    bench_workload_shape shape;
    json_t *b0 = body_of(&a, NULL, 0, 0, BENCH_WORKLOAD_PHASE_NONE, &shape);
    assert_int_equal(shape.prompt_words, 8);
    json_t *b1 = body_of(&a, NULL, 0, 1, BENCH_WORKLOAD_PHASE_NONE, &shape);
    const char *p0 = json_string_value(json_object_get(b0, "prompt"));
    const char *p1 = json_string_value(json_object_get(b1, "prompt"));
    assert_int_equal(count_list_words(p0), 8);
    const char *e0 = p0, *e1 = p1;
    for (int k = 0; k < 6; k++)
        e0 = strchr(e0, ' ') + 1, e1 = strchr(e1, ' ') + 1;
    assert_int_equal(e0 - p0, e1 - p1);
    assert_true(strncmp(p0, p1, (size_t)(e0 - p0)) == 0);
    assert_true(strcmp(p0, p1) != 0);
    json_t *c0 = body_of(&a, NULL, 1, 0, BENCH_WORKLOAD_PHASE_NONE, &shape);
    const json_t *m = json_object_get(c0, "messages");
    assert_int_equal(json_array_size(m), 2);
    assert_true(strncmp(msg_text(m, 0, "system"), p0, (size_t)(e0 - p0 - 1)) == 0);
    assert_int_equal(count_list_words(msg_text(m, 1, "user")), 2);
    json_decref(b0), json_decref(b1), json_decref(c0);
}

/* Shared-prefix groups: each prompt starts with one of --prefix-groups prefixes, drawn per
 * prompt: over 40 prompts exactly 3 distinct ones, the same for the same index. */
static void test_workload_prefix_groups(void **state)
{
    (void)state;
    bench_args a = default_args();
    assert_int_equal(a.prefix_groups, 1);
    a.workload = "shared-prefix";
    a.prefix_len = 6;
    a.input_len = 2;
    a.prefix_groups = 3;
    char seen[3][256];
    int n_seen = 0;
    bench_workload_shape shape;
    for (int i = 0; i < 40; i++) {
        json_t *b = body_of(&a, NULL, 0, (size_t)i, BENCH_WORKLOAD_PHASE_NONE, &shape);
        const char *p = json_string_value(json_object_get(b, "prompt"));
        const char *e = p;
        for (int k = 0; k < 6; k++)
            e = strchr(e, ' ') + 1;
        char pre[256];
        snprintf(pre, sizeof(pre), "%.*s", (int)(e - p), p);
        int j = 0;
        while (j < n_seen && strcmp(seen[j], pre) != 0)
            j++;
        if (j == n_seen) {
            assert_true(n_seen < 3);
            snprintf(seen[n_seen++], sizeof(seen[0]), "%s", pre);
        }
        json_t *again = body_of(&a, NULL, 0, (size_t)i, BENCH_WORKLOAD_PHASE_NONE, &shape);
        assert_string_equal(json_string_value(json_object_get(again, "prompt")), p);
        json_decref(b), json_decref(again);
    }
    assert_int_equal(n_seen, 3);
}

/* Synthetic bodies: lengths in their ranges, every value of both ranges reached (the range
 * is inclusive), words from the list, the shape matching the body, the request fields,
 * the same body for the same (seed, index), phases overriding one side only, chat. */
static void test_workload_bodies(void **state)
{
    (void)state;
    bench_args a = default_args();
    a.seed = 3;
    a.input_range[0] = 5, a.input_range[1] = 9;
    a.output_range[0] = 2, a.output_range[1] = 4;
    a.temperature = 0.5;
    a.phase_short_len = 1;
    int seen_in[10] = {0}, seen_out[5] = {0};
    int differs = 0;
    for (size_t i = 0; i < 300; i++) {
        bench_workload_shape sh = {0, 0}, sh2 = {0, 0};
        json_t *j = body_of(&a, NULL, 0, i, BENCH_WORKLOAD_PHASE_NONE, &sh);
        const char *prompt = json_string_value(json_object_get(j, "prompt"));
        assert_non_null(prompt);
        long long words = count_list_words(prompt);
        assert_true(words >= 5 && words <= 9);
        assert_int_equal(sh.prompt_words, words);
        long long mt = json_integer_value(json_object_get(j, "max_tokens"));
        assert_true(mt >= 2 && mt <= 4);
        assert_int_equal(sh.max_tokens, mt);
        seen_in[words]++, seen_out[mt]++;
        assert_string_equal(json_string_value(json_object_get(j, "model")), "the-model");
        assert_true(json_is_true(json_object_get(j, "stream")));
        assert_true(json_is_true(json_object_get(json_object_get(j, "stream_options"),
                                                 "include_usage")));
        assert_close(json_real_value(json_object_get(j, "temperature")), 0.5, 1e-12);
        assert_null(json_object_get(j, "ignore_eos"));
        assert_null(json_object_get(j, "messages"));
        /* same (seed, index): same body */
        json_t *again = body_of(&a, NULL, 0, i, BENCH_WORKLOAD_PHASE_NONE, &sh2);
        assert_true(json_equal(j, again));
        json_decref(again);
        /* prefill-heavy: the same prompt, max_tokens the short side */
        json_t *pre = body_of(&a, NULL, 0, i, BENCH_WORKLOAD_PHASE_PREFILL, &sh2);
        assert_string_equal(json_string_value(json_object_get(pre, "prompt")), prompt);
        assert_int_equal(json_integer_value(json_object_get(pre, "max_tokens")), 1);
        json_decref(pre);
        /* decode-heavy: a one-word prompt, the same max_tokens */
        json_t *dec = body_of(&a, NULL, 0, i, BENCH_WORKLOAD_PHASE_DECODE, &sh2);
        assert_int_equal(count_list_words(json_string_value(json_object_get(dec, "prompt"))),
                         1);
        assert_int_equal(sh2.prompt_words, 1);
        assert_int_equal(json_integer_value(json_object_get(dec, "max_tokens")), mt);
        json_decref(dec);
        /* chat: the same text as the one user message */
        json_t *chat = body_of(&a, NULL, 1, i, BENCH_WORKLOAD_PHASE_NONE, &sh2);
        json_t *m0 = json_array_get(json_object_get(chat, "messages"), 0);
        assert_int_equal(json_array_size(json_object_get(chat, "messages")), 1);
        assert_string_equal(json_string_value(json_object_get(m0, "role")), "user");
        assert_string_equal(json_string_value(json_object_get(m0, "content")), prompt);
        assert_null(json_object_get(chat, "prompt"));
        json_decref(chat);
        /* another seed: other requests */
        bench_args b = a;
        b.seed = 4;
        json_t *other = body_of(&b, NULL, 0, i, BENCH_WORKLOAD_PHASE_NONE, &sh2);
        differs += !json_equal(j, other);
        json_decref(other);
        json_decref(j);
    }
    for (int k = 5; k <= 9; k++)
        assert_true(seen_in[k] > 0);
    for (int k = 2; k <= 4; k++)
        assert_true(seen_out[k] > 0);
    assert_true(differs > 290);

    /* fixed lengths and --ignore-eos */
    a.input_range[0] = a.output_range[0] = -1;
    a.input_len = 6;
    a.output_len = 17;
    a.ignore_eos = 1;
    bench_workload_shape sh;
    json_t *j = body_of(&a, NULL, 0, 0, BENCH_WORKLOAD_PHASE_NONE, &sh);
    assert_int_equal(count_list_words(json_string_value(json_object_get(j, "prompt"))), 6);
    assert_int_equal(json_integer_value(json_object_get(j, "max_tokens")), 17);
    assert_true(json_is_true(json_object_get(j, "ignore_eos")));
    json_decref(j);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* A JSONL dataset: blank lines skipped, lines cycled, the line's max_tokens /
 * max_completion_tokens / temperature kept, words counted in prompts and content parts,
 * prompts turned into messages for chat, max_items honoured; every rule refused with the
 * file and line named. */
static void test_dataset(void **state)
{
    (void)state;
    char dir[] = "/tmp/test_bench_XXXXXX", path[64], err[512];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/ds.jsonl", dir);
    write_file(path, "{\"prompt\": \"once upon a  time\", \"max_tokens\": 3}\n"
                     "\n"
                     "   \n"
                     "{\"prompt\": \"the cat\"}\n"
                     "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", "
                     "\"text\": \"hi there you\"}]}], \"max_completion_tokens\": 2, "
                     "\"temperature\": 1.5}\n");
    bench_dataset_t *ds = bench_dataset_load(path, 100, 1, err, sizeof(err));
    if (!ds)
        fail_msg("%s", err);
    assert_int_equal(bench_dataset_size(ds), 3);
    assert_non_null(json_object_get(bench_dataset_item(ds, 2), "messages"));
    bench_args a = default_args();
    a.output_len = 9;
    static const long long words[3] = {4, 2, 3}, max_tokens[3] = {3, 9, 2};
    for (size_t i = 0; i < 6; i++) {
        bench_workload_shape sh;
        json_t *j = body_of(&a, ds, 1, i, BENCH_WORKLOAD_PHASE_NONE, &sh);
        assert_int_equal(sh.prompt_words, words[i % 3]);
        assert_int_equal(sh.max_tokens, max_tokens[i % 3]);
        assert_null(json_object_get(j, "prompt"));
        assert_non_null(json_array_get(json_object_get(j, "messages"), 0));
        assert_close(json_number_value(json_object_get(j, "temperature")), i % 3 == 2 ? 1.5 : 0,
                     1e-12);
        if (i % 3 == 0)
            assert_string_equal(json_string_value(json_object_get(
                                    json_array_get(json_object_get(j, "messages"), 0), "content")),
                                "once upon a  time");
        json_decref(j);
    }
    bench_dataset_destroy(&ds);
    assert_null(ds);
    bench_dataset_destroy(&ds); /* takes NULL */
    /* completions endpoint: the prompt stays a prompt */
    ds = bench_dataset_load(path, 2, 0, err, sizeof(err));
    if (!ds)
        fail_msg("%s", err);
    assert_int_equal(bench_dataset_size(ds), 2);
    bench_workload_shape sh;
    json_t *j = body_of(&a, ds, 0, 1, BENCH_WORKLOAD_PHASE_NONE, &sh);
    assert_string_equal(json_string_value(json_object_get(j, "prompt")), "the cat");
    json_decref(j);
    bench_dataset_destroy(&ds);
    /* one line: every request is that line */
    write_file(path, "{\"prompt\": \"just this\"}\n");
    ds = bench_dataset_load(path, 100, 0, err, sizeof(err));
    if (!ds)
        fail_msg("%s", err);
    assert_int_equal(bench_dataset_size(ds), 1);
    j = body_of(&a, ds, 0, 5, BENCH_WORKLOAD_PHASE_NONE, &sh);
    assert_string_equal(json_string_value(json_object_get(j, "prompt")), "just this");
    assert_int_equal(sh.prompt_words, 2);
    json_decref(j);
    bench_dataset_destroy(&ds);

    static const struct {
        const char *text, *want;
        int chat;
    } bad[] = {
        {"{\"prompt\": \"a\"}\nnot json\n", "ds.jsonl:2: not a JSON object", 1},
        {"[1, 2]\n", "ds.jsonl:1: not a JSON object", 1},
        {"{\"prompt\": 5}\n", "ds.jsonl:1: needs a string \"prompt\"", 1},
        {"{\"messages\": []}\n", "ds.jsonl:1: needs a string \"prompt\"", 1},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}\n",
         "ds.jsonl:1: \"messages\" needs a chat endpoint", 0},
        {"\n{\"prompt\": \"a\", \"max_tokens\": 0}\n", "ds.jsonl:2: \"max_tokens\" must be", 1},
        {"{\"prompt\": \"a\", \"max_tokens\": \"5\"}\n", "ds.jsonl:1: \"max_tokens\" must be", 1},
        {"\n\n", "ds.jsonl: no prompts in the file", 1},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        write_file(path, bad[i].text);
        err[0] = 0;
        ds = bench_dataset_load(path, 100, bad[i].chat, err, sizeof(err));
        assert_null(ds);
        if (!strstr(err, bad[i].want))
            fail_msg("case %zu: got '%s', want '%s'", i, err, bad[i].want);
        assert_non_null(strstr(err, dir)); /* the path is named */
    }
    unlink(path);
    ds = bench_dataset_load(path, 100, 1, err, sizeof(err));
    assert_null(ds);
    assert_non_null(strstr(err, "cannot open"));
    rmdir(dir);
}

// --- report figures

/* Records by hand: TPOT = (E2EL - TTFT) / (output_tokens - 1), only with more than one
 * token; goodput counts the successful records within every SLO set; ITL samples pooled;
 * failed and unsent records counted apart; a phase selects its records only. */
static void test_report_compute(void **state)
{
    (void)state;
    static bench b;
    memset(&b, 0, sizeof(b));
    b.a = default_args();
    bench_rec recs[5];
    memset(recs, 0, sizeof(recs));
    float pool[] = {10, 30, 20, 5};
    /* ok, phase 0: ttft 100, e2el 400, 4 tokens -> tpot 100; ITL 10, 30, 20 */
    recs[0] = (bench_rec){.ttft_ms = 100, .e2el_ms = 400, .prompt_tokens = 50,
                          .output_tokens = 4, .itl_off = 0, .n_itl = 3,
                          .state = BENCH_REC_OK, .phase = 0, .prompt_from_usage = 1,
                          .output_from_usage = 1};
    /* ok, phase 1: ttft 300, e2el 350, 2 tokens -> tpot 50; ITL 5; no usage */
    recs[1] = (bench_rec){.ttft_ms = 300, .e2el_ms = 350, .prompt_tokens = 7,
                          .output_tokens = 2, .itl_off = 3, .n_itl = 1,
                          .state = BENCH_REC_OK, .phase = 1};
    /* ok, phase 1, one token: no TPOT */
    recs[2] = (bench_rec){.ttft_ms = 50, .e2el_ms = 50, .prompt_tokens = 3,
                          .output_tokens = 1, .state = BENCH_REC_OK, .phase = 1,
                          .prompt_from_usage = 1, .output_from_usage = 1};
    recs[3] = (bench_rec){.ttft_ms = -1, .e2el_ms = 10, .state = BENCH_REC_FAILED, .phase = 0,
                          .output_tokens = 99, .prompt_tokens = 99};
    recs[4] = (bench_rec){.state = BENCH_REC_NOT_SENT, .phase = 1};
    b.recs = recs;
    b.n = 5;
    b.itl_pool = pool;

    bench_report_metrics m;
    assert_int_equal(bench_report_compute(&b, BENCH_REPORT_ALL_PHASES, &m), 0);
    assert_int_equal(m.completed, 3);
    assert_int_equal(m.failed, 1);
    assert_int_equal(m.good, 3); /* no SLO: every success is good */
    assert_int_equal(m.total_input, 60);
    assert_int_equal(m.total_output, 7);
    assert_int_equal(m.n_prompt_estimated, 1);
    assert_int_equal(m.n_output_estimated, 1);
    assert_int_equal(m.ttft.n, 3);
    assert_close(m.ttft.mean, 150, 1e-12);
    assert_close(m.ttft.median, 100, 1e-12);
    assert_int_equal(m.tpot.n, 2);
    assert_close(m.tpot.mean, 75, 1e-12);
    assert_close(m.tpot.p99, 99.5, 1e-12);
    assert_int_equal(m.itl.n, 4);
    assert_close(m.itl.mean, 16.25, 1e-12);
    assert_close(m.itl.median, 15, 1e-12);
    assert_close(m.e2el.mean, 800.0 / 3, 1e-12);

    /* SLOs: ttft <= 200 drops record 1; tpot <= 60 drops record 0; e2el <= 360 drops 0 */
    b.a.slo_ms[BENCH_ARGS_SLO_TTFT] = 200;
    assert_int_equal(bench_report_compute(&b, BENCH_REPORT_ALL_PHASES, &m), 0);
    assert_int_equal(m.good, 2);
    b.a.slo_ms[BENCH_ARGS_SLO_TPOT] = 60;
    assert_int_equal(bench_report_compute(&b, BENCH_REPORT_ALL_PHASES, &m), 0);
    assert_int_equal(m.good, 1); /* only the one-token record (TPOT 0) */
    b.a.slo_ms[BENCH_ARGS_SLO_TTFT] = -1;
    assert_int_equal(bench_report_compute(&b, BENCH_REPORT_ALL_PHASES, &m), 0);
    assert_int_equal(m.good, 2); /* TPOT alone: 100 > 60 drops record 0 only */
    b.a.slo_ms[BENCH_ARGS_SLO_TPOT] = -1;
    b.a.slo_ms[BENCH_ARGS_SLO_E2EL] = 360;
    assert_int_equal(bench_report_compute(&b, BENCH_REPORT_ALL_PHASES, &m), 0);
    assert_int_equal(m.good, 2);

    assert_int_equal(bench_report_compute(&b, BENCH_WORKLOAD_PHASE_PREFILL, &m), 0);
    assert_int_equal(m.completed, 1);
    assert_int_equal(m.failed, 1);
    assert_int_equal(m.itl.n, 3);
    assert_close(m.tpot.mean, 100, 1e-12);
    assert_int_equal(bench_report_compute(&b, BENCH_WORKLOAD_PHASE_DECODE, &m), 0);
    assert_int_equal(m.completed, 2);
    assert_int_equal(m.failed, 0);
    assert_int_equal(m.total_output, 3);
    assert_int_equal(m.tpot.n, 1);
    assert_close(m.tpot.mean, 50, 1e-12);

    assert_string_equal(bench_fail_str(BENCH_FAIL_HTTP), "http");
    assert_string_equal(bench_fail_str(BENCH_FAIL_LOCAL), "client");
    assert_string_equal(bench_fail_str(BENCH_FAIL_INTERRUPTED), "interrupted");
    assert_string_equal(bench_fail_str(99), "?");
    int64_t t0 = bench_now_ns();
    assert_true(t0 > 0 && bench_now_ns() >= t0);
}

// --- requests in flight

/* A scripted OpenAI-style server on the test's own event loop: the k-th request gets the
 * response of modes[k] (SSE bodies are sent in one chunked piece). */
typedef struct {
    const char *const *modes;
    int n_modes;
    int n_req;    /* requests received */
    int break_at; /* leave the loop when this many have been received (0: never) */
    struct event_base *base;
} flight_server;

static const char *const FLIGHT_SSE_USAGE =
    "data: {\"choices\": [{\"text\": \" a\"}]}\n\n"
    "data: {\"choices\": [{\"text\": \" b\"}]}\n\n"
    "data: {\"choices\": [{\"text\": \" c\", \"finish_reason\": \"length\"}]}\n\n"
    "data: {\"choices\": [], \"usage\": {\"prompt_tokens\": 11, \"completion_tokens\": 7}}\n\n"
    "data: [DONE]\n\n";

static void flight_serve_cb(struct evhttp_request *req, void *arg)
{
    flight_server *fs = arg;
    const char *mode = fs->n_req < fs->n_modes ? fs->modes[fs->n_req] : "hang";
    fs->n_req++;
    if (fs->break_at && fs->n_req == fs->break_at)
        event_base_loopbreak(fs->base);
    if (strcmp(mode, "hang") == 0)
        return; /* never answered; freed with its connection */
    struct evbuffer *out = evbuffer_new();
    assert_non_null(out);
    int status = 200, sse = 1;
    if (strcmp(mode, "usage") == 0) {
        evbuffer_add_printf(out, "%s", FLIGHT_SSE_USAGE);
    } else if (strcmp(mode, "chunks") == 0) {
        for (int i = 0; i < 3; i++)
            evbuffer_add_printf(out, "data: {\"choices\": [{\"text\": \" w%d\"}]}\n\n", i);
        evbuffer_add_printf(out, "data: [DONE]\n\n");
    } else if (strncmp(mode, "http500:", 8) == 0) {
        status = 500, sse = 0;
        evbuffer_add_printf(out, "{\"error\": {\"message\": \"%s\", \"type\": \"x\"}}", mode + 8);
    } else if (strcmp(mode, "errevent") == 0) {
        evbuffer_add_printf(out, "data: {\"choices\": [{\"text\": \" a\"}]}\n\n"
                                 "event: error\ndata: worker died\n\n");
    } else if (strcmp(mode, "nodone") == 0) {
        evbuffer_add_printf(out, "data: {\"choices\": [{\"text\": \" a\"}]}\n\n");
    } else if (strcmp(mode, "empty") == 0) {
        evbuffer_add_printf(out, "data: [DONE]\n\n");
    } else {
        assert_string_equal(mode, "notsse");
        sse = 0;
        evbuffer_add_printf(out, "{\"x\": 1}");
    }
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Content-Type", sse ? "text/event-stream" : "application/json");
    if (sse) {
        evhttp_send_reply_start(req, status, "OK");
        evhttp_send_reply_chunk(req, out);
        evhttp_send_reply_end(req);
    } else {
        evhttp_send_reply(req, status, status == 200 ? "OK" : "Error", out);
    }
    evbuffer_free(out);
}

static int flight_freed;       /* flights freed (on_freed calls) */
static size_t flight_next_idx; /* sequential dispatch: the next record to send ... */
static size_t flight_end_idx;  /* ... up to this one (excluded) */

/* The dispatcher's part: send the next record, one at a time; leave when all are freed. */
static void flight_on_freed(bench *b)
{
    flight_freed++;
    if (flight_next_idx < flight_end_idx)
        bench_flight_start(b, flight_next_idx++, flight_on_freed);
    else if (b->n_live == 0)
        event_base_loopbreak(b->base);
}

static void flight_guard_cb(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    *(int *)arg = 1;
}

/* Run b's loop until it breaks; fails if that takes more than 10 s. */
static void flight_loop(bench *b)
{
    int expired = 0;
    struct event *guard = evtimer_new(b->base, flight_guard_cb, &expired);
    struct timeval tv = {10, 0};
    assert_non_null(guard);
    assert_int_equal(evtimer_add(guard, &tv), 0);
    while (!expired && event_base_loop(b->base, EVLOOP_ONCE) == 0 && !event_base_got_break(b->base))
        ;
    event_free(guard);
    assert_false(expired);
}

static void assert_failed(const bench_rec *r, int kind, const char *msg)
{
    assert_int_equal(r->state, BENCH_REC_FAILED);
    assert_int_equal(r->fail_kind, kind);
    assert_non_null(r->error);
    assert_string_equal(r->error, msg);
}

static void test_flight_records(void **state)
{
    (void)state;
    static const char *const modes[] = {
        "usage",
        "chunks",
        "http500:boom after 12 tries",
        "http500:boom after 7 tries",
        "errevent",
        "nodone",
        "empty",
        "notsse",
        "hang",
        "hang",
        "hang",
    };
    enum { N_SEQ = 8, N = 11 }; /* 8 sequential, 2 interrupted, 1 timed out */
    static bench b;
    memset(&b, 0, sizeof(b));
    b.a = default_args();
    b.a.input_len = 4;
    b.a.output_len = 3;
    b.a.model = "m";
    b.base = event_base_new();
    assert_non_null(b.base);
    flight_server fs = {.modes = modes, .n_modes = N, .base = b.base};
    struct evhttp *http = evhttp_new(b.base);
    assert_non_null(http);
    evhttp_set_gencb(http, flight_serve_cb, &fs);
    struct evhttp_bound_socket *sock = evhttp_bind_socket_with_handle(http, "127.0.0.1", 0);
    assert_non_null(sock);
    struct sockaddr_in sa;
    socklen_t sl = sizeof(sa);
    assert_int_equal(getsockname(evhttp_bound_socket_get_fd(sock), (struct sockaddr *)&sa, &sl), 0);
    snprintf(b.host_addr, sizeof(b.host_addr), "127.0.0.1");
    b.port = ntohs(sa.sin_port);
    snprintf(b.host_header, sizeof(b.host_header), "127.0.0.1:%u", b.port);
    snprintf(b.path, sizeof(b.path), "/v1/completions");
    b.model = strdup("m");
    b.n = N;
    b.recs = calloc(N, sizeof(bench_rec));
    assert_non_null(b.recs);
    for (size_t i = 0; i < N; i++) {
        b.recs[i].phase = BENCH_WORKLOAD_PHASE_NONE;
        b.recs[i].max_tokens = -1;
    }
    b.t0_ns = bench_now_ns();

    /* one after another, each response once */
    flight_freed = 0;
    flight_next_idx = 1, flight_end_idx = N_SEQ;
    bench_flight_start(&b, 0, flight_on_freed);
    assert_int_equal(b.n_sent, 1);
    assert_int_equal(b.in_flight, 1);
    assert_int_equal(b.n_live, 1);
    assert_non_null(b.active);
    flight_loop(&b);
    assert_int_equal(fs.n_req, N_SEQ);
    assert_int_equal(flight_freed, N_SEQ);
    assert_true(b.n_sent == N_SEQ && b.n_done == N_SEQ && b.in_flight == 0 && b.n_live == 0);
    assert_true(b.n_ok == 2 && b.n_failed == N_SEQ - 2 && b.peak_in_flight == 1);
    assert_null(b.active);

    const bench_rec *r = &b.recs[0]; /* usage: counts from usage, 3 chunks -> 2 ITL */
    assert_int_equal(r->state, BENCH_REC_OK);
    assert_int_equal(r->http_status, 200);
    assert_true(r->output_from_usage && r->output_tokens == 7);
    assert_true(r->prompt_from_usage && r->prompt_tokens == 11);
    assert_int_equal(r->prompt_words, 4);
    assert_int_equal(r->max_tokens, 3);
    assert_true(r->ttft_ms >= 0 && r->e2el_ms >= r->ttft_ms);
    assert_true(r->itl_off == 0 && r->n_itl == 2);
    assert_null(r->error);
    r = &b.recs[1]; /* no usage: chunks and prompt words */
    assert_int_equal(r->state, BENCH_REC_OK);
    assert_true(!r->output_from_usage && r->output_tokens == 3);
    assert_true(!r->prompt_from_usage && r->prompt_tokens == 4);
    assert_true(r->itl_off == 2 && r->n_itl == 2);
    assert_int_equal(b.n_itl_pool, 4);
    assert_int_equal(b.n_itl_dropped, 0);
    for (size_t i = 0; i < b.n_itl_pool; i++)
        assert_true(b.itl_pool[i] >= 0);
    assert_failed(&b.recs[2], BENCH_FAIL_HTTP, "HTTP 500: boom after 12 tries");
    assert_int_equal(b.recs[2].http_status, 500);
    assert_true(b.recs[2].ttft_ms < 0);
    assert_failed(&b.recs[3], BENCH_FAIL_HTTP, "HTTP 500: boom after 7 tries");
    assert_failed(&b.recs[4], BENCH_FAIL_STREAM_ERROR, "error event in the stream: worker died");
    assert_true(b.recs[4].ttft_ms >= 0 && b.recs[4].output_tokens == 1);
    assert_failed(&b.recs[5], BENCH_FAIL_CLOSED,
                  "stream ended without [DONE] or a finish_reason (after 1 events)");
    assert_failed(&b.recs[6], BENCH_FAIL_NO_CONTENT, "no content in the stream (empty completion)");
    assert_failed(&b.recs[7], BENCH_FAIL_PROTOCOL,
                  "no SSE event in the 200 response (does the server stream? body starts "
                  "'{\"x\": 1}')");
    /* the two HTTP 500s differ only in digits: one group, with the first message */
    assert_int_equal(b.n_groups, 5);
    assert_int_equal(b.n_ungrouped, 0);
    assert_true(b.groups[0].kind == BENCH_FAIL_HTTP && b.groups[0].status == 500 &&
                b.groups[0].count == 2);
    assert_string_equal(b.groups[0].msg, "HTTP 500: boom after 12 tries");
    const int kinds[] = {BENCH_FAIL_STREAM_ERROR, BENCH_FAIL_CLOSED, BENCH_FAIL_NO_CONTENT,
                         BENCH_FAIL_PROTOCOL};
    for (int i = 0; i < 4; i++)
        assert_true(b.groups[1 + i].kind == kinds[i] && b.groups[1 + i].status == 0 &&
                    b.groups[1 + i].count == 1);
    assert_int_equal(b.first_error_logged, 1);

    /* two in flight at once, interrupted once the server has both */
    flight_freed = 0;
    flight_next_idx = flight_end_idx = 0;
    fs.break_at = N_SEQ + 2;
    bench_flight_start(&b, N_SEQ, flight_on_freed);
    bench_flight_start(&b, N_SEQ + 1, flight_on_freed);
    assert_int_equal(b.in_flight, 2);
    assert_int_equal(b.peak_in_flight, 2);
    flight_loop(&b);
    assert_int_equal(fs.n_req, N_SEQ + 2);
    assert_int_equal(flight_freed, 0);
    bench_flight_interrupt_all(&b, "test");
    assert_null(b.active);
    assert_int_equal(b.in_flight, 0);
    assert_int_equal(b.n_live, 2); /* freed from the loop, later */
    flight_loop(&b);
    assert_int_equal(flight_freed, 2);
    assert_int_equal(b.n_live, 0);
    for (int i = 0; i < 2; i++)
        assert_failed(&b.recs[N_SEQ + i], BENCH_FAIL_INTERRUPTED, "interrupted (test)");

    /* the deadline */
    fs.break_at = 0;
    b.a.timeout_s = 0.2;
    bench_flight_start(&b, N_SEQ + 2, flight_on_freed);
    flight_loop(&b);
    assert_int_equal(flight_freed, 3);
    assert_failed(&b.recs[N_SEQ + 2], BENCH_FAIL_TIMEOUT,
                  "no complete response within 0.2 s (--timeout-s)");
    assert_true(b.recs[N_SEQ + 2].e2el_ms > 150); /* libevent's cached clock: a bit early */
    assert_true(b.n_done == N && b.n_ok == 2 && b.n_failed == N - 2 && b.n_live == 0);
    assert_int_equal(b.n_groups, 7);

    for (size_t i = 0; i < N; i++)
        free(b.recs[i].error);
    free(b.recs);
    free(b.itl_pool);
    free(b.model);
    evhttp_free(http);
    event_base_free(b.base);
}

// --- trace replay

/* Load text as a trace (scale, max_reqs); NULL with the message in err. */
static bench_trace_t *trace_of(const char *dir, const char *text, double scale, size_t max,
                               char *err, size_t err_len)
{
    char path[96];
    snprintf(path, sizeof(path), "%s/t.csv", dir);
    write_file(path, text);
    return bench_trace_load(path, scale, max, err, err_len);
}

/* The simulator's rules: header, comments, classes, JSONL, a stable sort by arrival, the
 * time scale, the first max_reqs; every bad line named. */
static void test_trace_load(void **state)
{
    (void)state;
    char dir[] = "/tmp/test_bench_XXXXXX", err[512];
    assert_non_null(mkdtemp(dir));
    bench_trace_t *t = trace_of(dir, "arrival_s,prompt_tokens,output_tokens,class\n"
                                     "# comment\n"
                                     "2.5,10,3,Batch\n"
                                     "  \n"
                                     "1,7,2\r\n"
                                     "{\"arrival_s\": 1, \"prompt_tokens\": 4, \"output_tokens\": 9, "
                                     "\"service_tier\": \"flex\"}\n"
                                     "0.5,1,1, interactive \n",
                                0.5, 0, err, sizeof(err));
    if (!t)
        fail_msg("%s", err);
    assert_int_equal(bench_trace_size(t), 4);
    static const double at[4] = {0.25, 0.5, 0.5, 1.25};
    static const long long pt[4] = {1, 7, 4, 10}, ot[4] = {1, 2, 9, 3};
    static const int off[4] = {0, 0, 1, 1};
    static const size_t line[4] = {7, 5, 6, 3};
    for (size_t i = 0; i < 4; i++) {
        const bench_trace_req *q = bench_trace_at(t, i);
        assert_close(q->arrival_s, at[i], 1e-12);
        assert_int_equal(q->prompt_tokens, pt[i]);
        assert_int_equal(q->output_tokens, ot[i]);
        assert_int_equal(q->offline, off[i]);
        assert_int_equal(q->line, line[i]);
    }
    assert_int_equal(bench_trace_max_prompt(t), 10);
    assert_close(bench_trace_span_s(t), 1.25, 1e-12);
    assert_int_equal(bench_trace_check_context(t, 13, err, sizeof(err)), 0);
    assert_int_equal(bench_trace_check_context(t, 12, err, sizeof(err)), -1);
    assert_string_equal(err, "6: prompt + output = 13 tokens exceeds the server's context "
                             "window (max_model_len 12); scale the trace's token counts down "
                             "(docs/workloads.md)");
    bench_trace_destroy(&t);
    assert_null(t);
    bench_trace_destroy(&t); /* takes NULL */
    t = trace_of(dir, "0,1,1\n0.2,2,2\n0.1,3,3\n", 1, 2, err, sizeof(err));
    assert_int_equal(bench_trace_size(t), 2);
    assert_int_equal(bench_trace_at(t, 1)->prompt_tokens, 3); /* sorted, then cut */
    assert_close(bench_trace_span_s(t), 1, 1e-12);             /* at least 1 s */
    bench_trace_destroy(&t);
    static const char *const bad[][2] = {
        {"0,1\n", "t.csv:1: want arrival_s,prompt_tokens,output_tokens[,class]"},
        {"0,1,1,1,1\n", "t.csv:1: want arrival_s,prompt_tokens,output_tokens[,class]"},
        {"0,1,1\nx,1,1\n", "t.csv:2: arrival_s is not a number"},
        {"0,1,0\n", "t.csv:1: prompt_tokens and output_tokens must be whole numbers in [1, 1e9]"},
        {"0,1e10,1\n", "t.csv:1: prompt_tokens and output_tokens must be whole numbers in [1, 1e9]"},
        {"0,a,1\n", "t.csv:1: prompt_tokens / output_tokens are not numbers"},
        {"nan,1,1\n", "t.csv:1: arrival_s must be a finite number >= 0"},
        {"0,1,1,later\n", "t.csv:1: class must be online or offline"},
        {"{\"arrival_s\": 0}\n", "t.csv:1: want numbers arrival_s, prompt_tokens, output_tokens"},
        {"{\"arrival_s\": 0, \"prompt_tokens\": 1, \"output_tokens\": 1, \"offline\": \"y\"}\n",
         "t.csv:1: offline must be a boolean"},
        {"{oops\n", "t.csv:1: not a JSON object"},
        {"# only a comment\n", "t.csv: no requests"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        t = trace_of(dir, bad[i][0], 1, 0, err, sizeof(err));
        assert_null(t);
        const char *tail = strstr(err, "t.csv");
        if (!tail || strcmp(tail, bad[i][1]) != 0)
            fail_msg("%s: got '%s', want '%s'", bad[i][0], err, bad[i][1]);
    }
    char path[96];
    snprintf(path, sizeof(path), "%s/t.csv", dir);
    unlink(path);
    assert_null(bench_trace_load(path, 1, 0, err, sizeof(err)));
    assert_non_null(strstr(err, "No such file or directory"));
    rmdir(dir);
}

/* Bodies: BOS, then exactly prompt_tokens - 1 pool ids in a row (wrapping), the lengths,
 * ignore_eos, the offline tier; the same seed gives the same offsets, another seed others. */
static void test_trace_bodies(void **state)
{
    (void)state;
    char dir[] = "/tmp/test_bench_XXXXXX", err[512];
    assert_non_null(mkdtemp(dir));
    bench_trace_t *t = trace_of(dir, "0,1,4\n0,5,2,offline\n0,40,3\n", 1, 0, err,
                                sizeof(err));
    if (!t)
        fail_msg("%s", err);
    int *pool = malloc(16 * sizeof(int));
    for (int i = 0; i < 16; i++)
        pool[i] = 100 + i;
    bench_trace_set_pool(t, pool, 16, 1);
    bench_args a = default_args();
    long long first[3];
    for (size_t i = 0; i < 3; i++) {
        char *text = bench_trace_body(t, &a, "m", i);
        json_t *j = json_loads(text, 0, NULL);
        free(text);
        const json_t *p = json_object_get(j, "prompt");
        const bench_trace_req *q = bench_trace_at(t, i);
        assert_int_equal(json_array_size(p), q->prompt_tokens);
        assert_int_equal(json_integer_value(json_array_get(p, 0)), 1);
        first[i] = json_array_size(p) > 1 ? json_integer_value(json_array_get(p, 1)) : -1;
        for (size_t k = 2; k < json_array_size(p); k++)
            assert_int_equal(json_integer_value(json_array_get(p, k)),
                             100 + (json_integer_value(json_array_get(p, k - 1)) - 100 + 1) % 16);
        assert_int_equal(json_integer_value(json_object_get(j, "max_tokens")), q->output_tokens);
        assert_int_equal(json_integer_value(json_object_get(j, "min_tokens")), q->output_tokens);
        assert_true(json_is_true(json_object_get(j, "ignore_eos")));
        assert_true(json_is_true(json_object_get(j, "stream")));
        assert_string_equal(json_string_value(json_object_get(j, "model")), "m");
        if (q->offline)
            assert_string_equal(json_string_value(json_object_get(j, "service_tier")), "flex");
        else
            assert_null(json_object_get(j, "service_tier"));
        json_decref(j);
    }
    assert_int_equal(first[0], -1); /* a 1-token prompt is BOS alone */
    assert_true(first[1] != first[2]);
    /* no BOS: prompt_tokens pool ids */
    pool = malloc(3 * sizeof(int));
    pool[0] = 7, pool[1] = 8, pool[2] = 9;
    bench_trace_set_pool(t, pool, 3, -1);
    char *text = bench_trace_body(t, &a, "m", 1);
    json_t *j = json_loads(text, 0, NULL);
    free(text);
    assert_int_equal(json_array_size(json_object_get(j, "prompt")), 5);
    json_decref(j);
    bench_trace_destroy(&t);
    char path[96];
    snprintf(path, sizeof(path), "%s/t.csv", dir);
    unlink(path);
    rmdir(dir);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stats_1_to_100),
        cmocka_unit_test(test_stats_small_samples),
        cmocka_unit_test(test_workload_token_prompts),
        cmocka_unit_test(test_sse_events),
        cmocka_unit_test(test_sse_any_split),
        cmocka_unit_test(test_sse_stop_and_limits),
        cmocka_unit_test(test_args_parse),
        cmocka_unit_test(test_workload_golden),
        cmocka_unit_test(test_workload_arrivals),
        cmocka_unit_test(test_workload_next_arrival),
        cmocka_unit_test(test_workload_phase_rates),
        cmocka_unit_test(test_workload_bodies),
        cmocka_unit_test(test_workload_multi_turn),
        cmocka_unit_test(test_workload_shared_prefix),
        cmocka_unit_test(test_workload_prefix_groups),
        cmocka_unit_test(test_dataset),
        cmocka_unit_test(test_report_compute),
        cmocka_unit_test(test_flight_records),
        cmocka_unit_test(test_trace_load),
        cmocka_unit_test(test_trace_bodies),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("bench", tests, NULL, NULL);
}
