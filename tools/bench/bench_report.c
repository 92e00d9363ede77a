/*
 * bench_report: the summary, result JSON, plot and trace of a tidepool-bench run
 * (bench_report.h). Figures are computed from the records once, after the run; the
 * summary keeps vLLM's layout (50-column rules, 40-column keys) so outputs can be
 * compared line by line.
 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench_report.h"
#include "bench_workload.h"

/* TPOT of a successful record in ms; 0 when it has at most one output token. */
static double rec_tpot_ms(const bench_rec *r)
{
    if (r->output_tokens <= 1)
        return 0;
    return (r->e2el_ms - r->ttft_ms) / (double)(r->output_tokens - 1);
}

/* Does a successful record meet every SLO that is set? */
static int rec_good(const bench *b, const bench_rec *r)
{
    const double *slo = b->a.slo_ms;
    return !(slo[BENCH_ARGS_SLO_TTFT] > 0 && r->ttft_ms > slo[BENCH_ARGS_SLO_TTFT]) &&
           !(slo[BENCH_ARGS_SLO_TPOT] > 0 && rec_tpot_ms(r) > slo[BENCH_ARGS_SLO_TPOT]) &&
           !(slo[BENCH_ARGS_SLO_E2EL] > 0 && r->e2el_ms > slo[BENCH_ARGS_SLO_E2EL]);
}

static int has_slo(const bench *b)
{
    return b->a.slo_ms[0] > 0 || b->a.slo_ms[1] > 0 || b->a.slo_ms[2] > 0;
}

void bench_report_trace_figures(const bench *b, bench_report_trace_metrics *t)
{
    memset(t, 0, sizeof(*t));
    const double *slo = b->a.slo_ms;
    for (size_t i = 0; i < b->n; i++) {
        const bench_rec *r = &b->recs[i];
        int ok = r->state == BENCH_REC_OK;
        if (r->offline) {
            t->n_offline++;
            t->offline_completed += ok;
            t->offline_output_tokens += ok ? r->output_tokens : 0;
            continue;
        }
        t->n_online++;
        if (!ok)
            continue;
        /* as tidepool-sim counts: TTFT from the arrival, not from the send */
        double wait_ms = (r->start_s - r->arrival_s) * 1e3;
        double ttft = r->ttft_ms + (wait_ms > 0 ? wait_ms : 0);
        double e2el = r->e2el_ms + (wait_ms > 0 ? wait_ms : 0);
        t->online_good += !(slo[BENCH_ARGS_SLO_TTFT] > 0 && ttft > slo[BENCH_ARGS_SLO_TTFT]) &&
                          !(slo[BENCH_ARGS_SLO_TPOT] > 0 &&
                            rec_tpot_ms(r) > slo[BENCH_ARGS_SLO_TPOT]) &&
                          !(slo[BENCH_ARGS_SLO_E2EL] > 0 && e2el > slo[BENCH_ARGS_SLO_E2EL]);
    }
    t->span_s = b->trace ? bench_trace_span_s(b->trace) : 1;
    t->attainment_pct = t->n_online ? 100.0 * (double)t->online_good / (double)t->n_online
                                    : 100;
    t->goodput = (double)t->online_good / t->span_s;
}

int bench_report_compute(const bench *b, int phase, bench_report_metrics *m)
{
    memset(m, 0, sizeof(*m));
    size_t n_ok = 0, n_itl = 0;
    for (size_t i = 0; i < b->n; i++) {
        const bench_rec *r = &b->recs[i];
        if (phase != BENCH_REPORT_ALL_PHASES && r->phase != phase)
            continue;
        if (r->state == BENCH_REC_FAILED)
            m->failed++;
        if (r->state != BENCH_REC_OK)
            continue;
        n_ok++;
        n_itl += r->n_itl;
    }
    double *ttft = malloc((n_ok + 1) * sizeof(double));
    double *tpot = malloc((n_ok + 1) * sizeof(double));
    double *e2el = malloc((n_ok + 1) * sizeof(double));
    double *itl = malloc((n_itl + 1) * sizeof(double));
    if (!ttft || !tpot || !e2el || !itl) {
        free(ttft), free(tpot), free(e2el), free(itl);
        return -1;
    }
    size_t n_tpot = 0, k_itl = 0;
    for (size_t i = 0; i < b->n; i++) {
        const bench_rec *r = &b->recs[i];
        if (r->state != BENCH_REC_OK || (phase != BENCH_REPORT_ALL_PHASES && r->phase != phase))
            continue;
        ttft[m->completed] = r->ttft_ms;
        e2el[m->completed] = r->e2el_ms;
        m->completed++;
        if (r->output_tokens > 1)
            tpot[n_tpot++] = rec_tpot_ms(r);
        for (uint32_t k = 0; k < r->n_itl; k++)
            itl[k_itl++] = b->itl_pool[r->itl_off + k];
        m->total_input += r->prompt_tokens;
        m->total_output += r->output_tokens;
        m->n_prompt_estimated += !r->prompt_from_usage;
        m->n_output_estimated += !r->output_from_usage;
        m->good += rec_good(b, r);
    }
    bench_stats_compute(ttft, m->completed, &m->ttft);
    bench_stats_compute(tpot, n_tpot, &m->tpot);
    bench_stats_compute(e2el, m->completed, &m->e2el);
    bench_stats_compute(itl, k_itl, &m->itl);
    free(ttft), free(tpot), free(e2el), free(itl);
    return 0;
}

static double run_duration_s(const bench *b)
{
    int64_t end = b->t_end_ns > b->t0_ns ? b->t_end_ns : bench_now_ns();
    double d = (double)(end - b->t0_ns) / 1e9;
    return d > 1e-9 ? d : 1e-9;
}

// --- summary block

/* Python's "{:c^w}".format(title): title centred in 50 columns of c, the odd pad on the
 * right (vLLM's section rules). */
static void print_title(FILE *f, const char *title, char c)
{
    char line[64];
    int w = 50, n = (int)strlen(title);
    int left = n < w ? (w - n) / 2 : 0, right = n < w ? w - n - left : 0;
    memset(line, c, (size_t)left);
    memcpy(line + left, title, (size_t)n);
    memset(line + left + n, c, (size_t)right);
    line[left + n + right] = 0;
    fprintf(f, "%s\n", line);
}

static void print_int(FILE *f, const char *k, long long v)
{
    fprintf(f, "%-40s %-10lld\n", k, v);
}

static void print_f(FILE *f, const char *k, double v)
{
    fprintf(f, "%-40s %-10.2f\n", k, v);
}

static void print_dist(FILE *f, const char *title, const char *name, const bench_stats *d)
{
    char k[64];
    print_title(f, title, '-');
    snprintf(k, sizeof(k), "Mean %s (ms):", name);
    print_f(f, k, d->mean);
    snprintf(k, sizeof(k), "Median %s (ms):", name);
    print_f(f, k, d->median);
    snprintf(k, sizeof(k), "P99 %s (ms):", name);
    print_f(f, k, d->p99);
}

void bench_report_print(const bench *b, const bench_report_metrics *m,
                        const bench_report_metrics *phases, FILE *f)
{
    double dur = run_duration_s(b);
    print_title(f, " Serving Benchmark Result ", '=');
    print_int(f, "Successful requests:", (long long)m->completed);
    print_int(f, "Failed requests:", (long long)m->failed);
    if (b->a.concurrency > 0)
        print_int(f, "Maximum request concurrency:", b->a.concurrency);
    print_f(f, "Benchmark duration (s):", dur);
    print_int(f, "Total input tokens:", m->total_input);
    print_int(f, "Total generated tokens:", m->total_output);
    print_f(f, "Request throughput (req/s):", (double)m->completed / dur);
    if (has_slo(b))
        print_f(f, "Request goodput (req/s):", (double)m->good / dur);
    print_f(f, "Output token throughput (tok/s):", (double)m->total_output / dur);
    print_f(f, "Total Token throughput (tok/s):",
            (double)(m->total_input + m->total_output) / dur);
    print_dist(f, "Time to First Token", "TTFT", &m->ttft);
    print_dist(f, "Time per Output Token (excl. 1st token)", "TPOT", &m->tpot);
    print_dist(f, "Inter-token Latency", "ITL", &m->itl);
    print_dist(f, "End-to-end Latency", "E2EL", &m->e2el);
    if (b->trace) {
        bench_report_trace_metrics t;
        bench_report_trace_figures(b, &t);
        print_title(f, "Trace replay (tidepool-sim's figures)", '-');
        print_int(f, "Online requests:", (long long)t.n_online);
        if (has_slo(b)) {
            print_int(f, "Online requests meeting the SLOs:", (long long)t.online_good);
            print_f(f, "Online SLO attainment (%):", t.attainment_pct);
            print_f(f, "Online goodput (req/s of arrival span):", t.goodput);
        }
        print_f(f, "Arrival span (s):", t.span_s);
        print_int(f, "Offline requests:", (long long)t.n_offline);
        print_int(f, "Offline requests completed:", (long long)t.offline_completed);
        print_int(f, "Offline generated tokens:", t.offline_output_tokens);
        print_f(f, "Offline token throughput (tok/s):",
                (double)t.offline_output_tokens / dur);
    }
    if (phases) {
        static const char *const names[2] = {"Prefill-heavy", "Decode-heavy"};
        print_title(f, "Phases (phase-shift)", '-');
        for (int p = 0; p < 2; p++) {
            char k[64];
            snprintf(k, sizeof(k), "%s successful requests:", names[p]);
            print_int(f, k, (long long)phases[p].completed);
            snprintf(k, sizeof(k), "%s mean TTFT (ms):", names[p]);
            print_f(f, k, phases[p].ttft.mean);
            snprintf(k, sizeof(k), "%s mean TPOT (ms):", names[p]);
            print_f(f, k, phases[p].tpot.mean);
            snprintf(k, sizeof(k), "%s mean E2EL (ms):", names[p]);
            print_f(f, k, phases[p].e2el.mean);
        }
    }
    print_title(f, "", '=');
    if (b->n_groups > 0) {
        fprintf(f, "Errors (count, first message of each kind):\n");
        for (size_t i = 0; i < b->n_groups; i++)
            fprintf(f, "  %6zu  %s\n", b->groups[i].count, b->groups[i].msg);
        if (b->n_ungrouped)
            fprintf(f, "  %6zu  (other errors)\n", b->n_ungrouped);
    }
    size_t not_sent = b->n - b->n_sent;
    if (not_sent)
        fprintf(f, "Note: %zu requests were not sent (interrupted).\n", not_sent);
    if (m->n_prompt_estimated)
        fprintf(f, "Note: %zu requests had no usage.prompt_tokens; their input tokens are "
                   "prompt word counts.\n", m->n_prompt_estimated);
    if (m->n_output_estimated)
        fprintf(f, "Note: %zu requests had no usage.completion_tokens; their output tokens "
                   "are content chunk counts.\n", m->n_output_estimated);
    if (b->n_itl_dropped)
        fprintf(f, "Note: %zu ITL samples beyond the memory cap were not kept.\n",
                b->n_itl_dropped);
    fflush(f);
}

// --- result JSON

static int json_put(json_t *o, const char *k, json_t *v)
{
    return json_object_set_new(o, k, v);
}

static void json_put_dist(json_t *o, const char *name, const bench_stats *d)
{
    static const char *const stat[] = {"mean", "median", "std", "p90", "p95", "p99"};
    double v[] = {d->mean, d->median, d->std, d->p90, d->p95, d->p99};
    for (int i = 0; i < 6; i++) {
        char k[64];
        snprintf(k, sizeof(k), "%s_%s_ms", stat[i], name);
        json_put(o, k, json_real(v[i]));
    }
}

static json_t *json_metrics(const bench *b, const bench_report_metrics *m)
{
    double dur = run_duration_s(b);
    json_t *o = json_object();
    if (!o)
        return NULL;
    json_put(o, "completed", json_integer((json_int_t)m->completed));
    json_put(o, "failed", json_integer((json_int_t)m->failed));
    json_put(o, "total_input_tokens", json_integer(m->total_input));
    json_put(o, "total_output_tokens", json_integer(m->total_output));
    json_put(o, "request_throughput", json_real((double)m->completed / dur));
    json_put(o, "request_goodput",
             has_slo(b) ? json_real((double)m->good / dur) : json_null());
    json_put(o, "output_throughput", json_real((double)m->total_output / dur));
    json_put(o, "total_token_throughput",
             json_real((double)(m->total_input + m->total_output) / dur));
    json_put_dist(o, "ttft", &m->ttft);
    json_put_dist(o, "tpot", &m->tpot);
    json_put_dist(o, "itl", &m->itl);
    json_put_dist(o, "e2el", &m->e2el);
    return o;
}

/* Round to 1e-3 (µs when in ms): beyond the clock's meaning, and no float noise. */
static double round3(double x)
{
    return round(x * 1e3) / 1e3;
}

static json_t *json_record(const bench *b, size_t i)
{
    static const char *const states[] = {"not_sent", "running", "ok", "failed"};
    static const char *const phases[] = {"prefill-heavy", "decode-heavy"};
    const bench_rec *r = &b->recs[i];
    int sent = r->state != BENCH_REC_NOT_SENT, ok = r->state == BENCH_REC_OK;
    json_t *itl = json_array();
    for (uint32_t k = 0; itl && k < r->n_itl; k++)
        json_array_append_new(itl, json_real(round3(b->itl_pool[r->itl_off + k])));
    return json_pack(
        "{s:I, s:s, s:o, s:f, s:o, s:o, s:I, s:I, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:s, "
        "s:s, s:o, s:o, s:o}",
        "index", (json_int_t)i, "state", states[r->state],
        "success", json_boolean(ok), "arrival_s", round(r->arrival_s * 1e6) / 1e6,
        "start_s", sent ? json_real(round(r->start_s * 1e6) / 1e6) : json_null(),
        "phase", r->phase >= 0 ? json_string(phases[r->phase]) : json_null(),
        "prompt_words", (json_int_t)r->prompt_words,
        "max_tokens", (json_int_t)r->max_tokens,
        "http_status", r->http_status ? json_integer(r->http_status) : json_null(),
        "ttft_ms", sent && r->ttft_ms >= 0 ? json_real(round3(r->ttft_ms)) : json_null(),
        "tpot_ms", ok && r->output_tokens > 1 ? json_real(round3(rec_tpot_ms(r))) : json_null(),
        "e2el_ms", sent ? json_real(round3(r->e2el_ms)) : json_null(),
        "itl_ms", itl ? itl : json_null(),
        "prompt_tokens", sent ? json_integer(r->prompt_tokens) : json_null(),
        "output_tokens", sent ? json_integer(r->output_tokens) : json_null(),
        "prompt_tokens_source", r->prompt_from_usage ? "usage" : "words",
        "output_tokens_source", r->output_from_usage ? "usage" : "chunks",
        "error_kind", r->state == BENCH_REC_FAILED ? json_string(bench_fail_str(r->fail_kind))
                                             : json_null(),
        "error", r->state == BENCH_REC_FAILED ? json_string(r->error ? r->error : "?")
                                        : json_null(),
        "class", b->trace ? json_string(r->offline ? "offline" : "online") : json_null());
}

int bench_report_json(const bench *b, const bench_report_metrics *m,
                      const bench_report_metrics *phases, int argc, char **argv)
{
    const bench_args *a = &b->a;
    json_t *root = json_metrics(b, m);
    json_t *args = json_array(), *slo = json_object(), *errs = json_array();
    json_t *reqs = json_array();
    if (!root || !args || !slo || !errs || !reqs)
        goto oom;
    for (int i = 1; i < argc; i++) { /* the command line, its API key hidden */
        int key_next = i > 1 && strcmp(argv[i - 1], "--api-key") == 0;
        int key_here = strncmp(argv[i], "--api-key=", 10) == 0;
        json_array_append_new(args, json_string(key_next   ? "(hidden)"
                                                : key_here ? "--api-key=(hidden)"
                                                           : argv[i]));
    }
    for (int k = 0; k < 3; k++)
        if (a->slo_ms[k] > 0) {
            char key[16];
            snprintf(key, sizeof(key), "%s_ms", bench_args_slo_name(k));
            json_put(slo, key, json_real(a->slo_ms[k]));
        }
    for (size_t i = 0; i < b->n_groups; i++)
        json_array_append_new(errs, json_pack("{s:s, s:I, s:s}", "kind",
                                              bench_fail_str(b->groups[i].kind), "count",
                                              (json_int_t)b->groups[i].count,
                                              "first_message", b->groups[i].msg));
    for (size_t i = 0; i < b->n; i++) {
        json_t *rec = json_record(b, i);
        if (!rec || json_array_append_new(reqs, rec) < 0)
            goto oom;
    }
    char date[32];
    time_t now = time(NULL);
    struct tm tm;
    strftime(date, sizeof(date), "%Y%m%d-%H%M%S", localtime_r(&now, &tm));
    json_put(root, "date", json_string(date));
    json_put(root, "tool", json_string("tidepool-bench"));
    json_put(root, "argv", args);
    json_put(root, "backend", json_string(b->chat ? "openai-chat" : "openai"));
    json_put(root, "base_url", json_string(a->url));
    json_put(root, "endpoint", json_string(a->endpoint));
    json_put(root, "model_id", json_string(b->model));
    json_put(root, "num_prompts", json_integer((json_int_t)b->n));
    json_put(root, "not_sent", json_integer((json_int_t)(b->n - b->n_sent)));
    json_put(root, "request_rate",
             isfinite(a->request_rate) ? json_real(a->request_rate) : json_string("inf"));
    json_put(root, "max_concurrency",
             a->concurrency > 0 ? json_integer(a->concurrency) : json_null());
    json_put(root, "peak_concurrency", json_integer((json_int_t)b->peak_in_flight));
    json_put(root, "seed", json_integer(a->seed));
    json_put(root, "workload",
             json_string(a->trace ? "trace" : a->dataset ? "dataset" : a->workload));
    json_put(root, "dataset", a->dataset ? json_string(a->dataset) : json_null());
    json_put(root, "temperature", json_real(a->temperature));
    json_put(root, "ignore_eos", json_boolean(a->ignore_eos));
    json_put(root, "duration", json_real(run_duration_s(b)));
    json_put(root, "goodput_slo_ms", slo);
    json_put(root, "itl_samples_dropped", json_integer((json_int_t)b->n_itl_dropped));
    json_put(root, "errors", errs);
    if (phases) {
        json_t *ph = json_object();
        json_t *p0 = json_metrics(b, &phases[0]), *p1 = json_metrics(b, &phases[1]);
        if (ph && p0 && p1) {
            json_put(ph, "prefill-heavy", p0);
            json_put(ph, "decode-heavy", p1);
        } else {
            json_decref(p0), json_decref(p1);
        }
        json_put(root, "phases", ph ? ph : json_null());
        json_put(root, "phase_seconds", json_real(a->phase_s));
        json_put(root, "decode_rate",
                 json_real(a->decode_rate > 0 ? a->decode_rate : a->request_rate));
    }
    json_put(root, "duration_s", a->duration_s > 0 ? json_real(a->duration_s) : json_null());
    if (b->trace) {
        bench_report_trace_metrics t;
        bench_report_trace_figures(b, &t);
        double dur = run_duration_s(b);
        json_put(root, "trace", json_pack(
            "{s:s, s:f, s:I, s:o, s:o, s:o, s:f, s:I, s:I, s:I, s:f}", "file", a->trace,
            "time_scale", a->time_scale, "online", (json_int_t)t.n_online,
            "online_good", has_slo(b) ? json_integer((json_int_t)t.online_good) : json_null(),
            "slo_attainment_pct", has_slo(b) ? json_real(t.attainment_pct) : json_null(),
            "goodput", has_slo(b) ? json_real(t.goodput) : json_null(), "span_s", t.span_s,
            "offline", (json_int_t)t.n_offline, "offline_completed",
            (json_int_t)t.offline_completed, "offline_output_tokens",
            (json_int_t)t.offline_output_tokens, "offline_token_throughput",
            (double)t.offline_output_tokens / dur));
    }
    json_put(root, "requests", reqs);
    reqs = NULL;

    char tmp[4096];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp.%d", a->result_json, (int)getpid()) >=
        (int)sizeof(tmp)) {
        fprintf(stderr, "tidepool-bench: %s: path too long\n", a->result_json);
        json_decref(root);
        return -1;
    }
    int rc = json_dump_file(root, tmp, JSON_COMPACT | JSON_REAL_PRECISION(10));
    json_decref(root);
    if (rc != 0 || rename(tmp, a->result_json) != 0) {
        fprintf(stderr, "tidepool-bench: %s: cannot write the result file: %s\n",
                a->result_json, strerror(errno));
        unlink(tmp);
        return -1;
    }
    return 0;
oom:
    json_decref(root), json_decref(args), json_decref(slo), json_decref(errs);
    json_decref(reqs);
    fprintf(stderr, "tidepool-bench: out of memory building %s\n", a->result_json);
    return -1;
}

// --- plot

static int find_in_path(const char *prog)
{
    const char *path = getenv("PATH");
    if (!path)
        return 0;
    char dir[4096];
    while (*path) {
        size_t n = strcspn(path, ":");
        if (n > 0 && n + strlen(prog) + 2 < sizeof(dir)) {
            memcpy(dir, path, n);
            snprintf(dir + n, sizeof(dir) - n, "/%s", prog);
            if (access(dir, X_OK) == 0)
                return 1;
        }
        path += n;
        if (*path == ':')
            path++;
    }
    return 0;
}

// --- trace

int bench_report_trace(const bench *b)
{
    const char *path = b->a.trace_out;
    double words = 0, tokens = 0;
    size_t n_est = 0;
    for (size_t i = 0; i < b->n; i++) {
        const bench_rec *r = &b->recs[i];
        if (r->state == BENCH_REC_OK && r->prompt_from_usage && r->prompt_words > 0) {
            words += (double)r->prompt_words;
            tokens += (double)r->prompt_tokens;
        }
    }
    double per_word = words > 0 ? tokens / words : 1;
    char tmp[4096];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid()) >= (int)sizeof(tmp)) {
        fprintf(stderr, "tidepool-bench: %s: path too long\n", path);
        return -1;
    }
    FILE *f = fopen(tmp, "w");
    if (!f) {
        fprintf(stderr, "tidepool-bench: %s: cannot write the trace: %s\n", path,
                strerror(errno));
        return -1;
    }
    for (size_t i = 0; i < b->n; i++) {
        const bench_rec *r = &b->recs[i];
        n_est += !(r->state == BENCH_REC_OK && r->prompt_from_usage);
    }
    fprintf(f, "# tidepool-bench trace (tidepool-sim --trace): %zu requests, seed %lld, "
               "workload %s; %zu prompt lengths estimated at %.3f tokens per word\n",
            b->n, b->a.seed, b->a.trace ? "trace" : b->a.dataset ? "dataset" : b->a.workload,
            n_est, per_word);
    fprintf(f, "arrival_s,prompt_tokens,output_tokens,class\n");
    for (size_t i = 0; i < b->n; i++) {
        const bench_rec *r = &b->recs[i];
        bench_workload_shape shape = {r->prompt_words, r->max_tokens};
        if (r->state == BENCH_REC_NOT_SENT && !b->trace) { /* its shape, as it would have
                                                            * been sent */
            int phase = bench_workload_phase_shift(&b->a)
                            ? bench_workload_phase_at(&b->a, r->arrival_s)
                            : BENCH_WORKLOAD_PHASE_NONE;
            free(bench_workload_body(&b->a, b->ds, b->model, b->chat, i, phase, &shape));
        }
        long long prompt = r->state == BENCH_REC_OK && r->prompt_from_usage
                               ? r->prompt_tokens
                               : (long long)llround((double)shape.prompt_words * per_word);
        long long out = shape.max_tokens > 0 ? shape.max_tokens : r->output_tokens;
        fprintf(f, "%.6f,%lld,%lld,%s\n", r->arrival_s, prompt > 1 ? prompt : 1,
                out > 1 ? out : 1, r->offline ? "offline" : "online");
    }
    int bad = ferror(f);
    if (fclose(f) != 0 || bad || rename(tmp, path) != 0) {
        fprintf(stderr, "tidepool-bench: %s: cannot write the trace: %s\n", path,
                strerror(errno));
        unlink(tmp);
        return -1;
    }
    return 0;
}

/* Latency over time: TTFT and E2EL (top), TPOT (bottom) of each successful request
 * against its start time, failed requests as red crosses at 0, decode-heavy phases
 * shaded in phase-shift mode. */
int bench_report_plot(const bench *b)
{
    const char *out = b->a.plot;
    if (!find_in_path("gnuplot")) {
        fprintf(stderr, "tidepool-bench: gnuplot not found in PATH; skipping --plot %s "
                        "(Debian: apt-get install gnuplot-nox)\n", out);
        return 0;
    }
    char data[] = "/tmp/tidepool-bench-XXXXXX";
    char script[] = "/tmp/tidepool-bench-gp-XXXXXX";
    int fd_data = mkstemp(data), fd_script = fd_data >= 0 ? mkstemp(script) : -1;
    FILE *fd = fd_data >= 0 ? fdopen(fd_data, "w") : NULL;
    FILE *fs = fd_script >= 0 ? fdopen(fd_script, "w") : NULL;
    int rc = -1;
    if (!fd || !fs) {
        fprintf(stderr, "tidepool-bench: --plot: cannot create temporary files: %s\n",
                strerror(errno));
        goto out;
    }
    size_t n_rows = 0;
    fprintf(fd, "# start_s ttft_ms tpot_ms e2el_ms phase ok\n");
    for (size_t i = 0; i < b->n; i++) {
        const bench_rec *r = &b->recs[i];
        if (r->state != BENCH_REC_OK && r->state != BENCH_REC_FAILED)
            continue;
        int ok = r->state == BENCH_REC_OK;
        n_rows++;
        fprintf(fd, "%.6f %.3f %.3f %.3f %d %d\n", r->start_s, ok ? r->ttft_ms : 0,
                ok ? rec_tpot_ms(r) : 0, r->e2el_ms, r->phase, ok);
    }
    if (n_rows == 0) {
        fprintf(stderr, "tidepool-bench: --plot: no request to plot\n");
        goto out;
    }
    fprintf(fs,
            "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
            "  set terminal pngcairo size 1200,900\n"
            "} else {\n"
            "  set terminal png size 1200,900\n"
            "}\n"
            "set output '%s'\n"
            "set multiplot layout 2,1 title 'tidepool-bench: %zu ok / %zu failed, %s'\n"
            "set grid\nset key top left\nset xlabel 'request start (s)'\n",
            out, b->n_ok, b->n_failed, b->chat ? "chat" : "completions");
    if (bench_workload_phase_shift(&b->a)) {
        double dur = run_duration_s(b);
        int k = 1;
        for (double t = b->a.phase_s; t < dur; t += 2 * b->a.phase_s, k++)
            fprintf(fs, "set object %d rect from %.6f, graph 0 to %.6f, graph 1 behind "
                        "fc rgb '#eeeeee' fs solid noborder\n",
                    k, t, t + b->a.phase_s);
        fprintf(fs, "set label 1 'shaded: decode-heavy phases' at graph 0.75, graph 0.95\n");
    }
    fprintf(fs,
            "set ylabel 'latency (ms)'\nset yrange [0:*]\n"
            "plot '%s' using 1:($6 == 1 ? $4 : 1/0) with points pt 7 ps 0.5 title 'E2EL', "
            "'' using 1:($6 == 1 ? $2 : 1/0) with points pt 7 ps 0.5 title 'TTFT', "
            "'' using 1:($6 == 0 ? 0 : 1/0) with points pt 2 ps 1 lc rgb 'red' "
            "title 'failed'\n"
            "unset label 1\n"
            "set ylabel 'TPOT (ms)'\n"
            "plot '%s' using 1:($6 == 1 ? $3 : 1/0) with points pt 7 ps 0.5 title 'TPOT'\n"
            "unset multiplot\n",
            data, data);
    if (fflush(fd) != 0 || fflush(fs) != 0) {
        fprintf(stderr, "tidepool-bench: --plot: cannot write temporary files\n");
        goto out;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "tidepool-bench: --plot: fork: %s\n", strerror(errno));
        goto out;
    }
    if (pid == 0) {
        execlp("gnuplot", "gnuplot", script, (char *)NULL);
        _exit(127);
    }
    int st;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0 && access(out, F_OK) == 0) {
        rc = 0;
    } else {
        fprintf(stderr, "tidepool-bench: --plot: gnuplot failed (status %d)\n",
                WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    }
out:
    if (fd)
        fclose(fd);
    else if (fd_data >= 0)
        close(fd_data);
    if (fs)
        fclose(fs);
    else if (fd_script >= 0)
        close(fd_script);
    if (fd_data >= 0)
        unlink(data);
    if (fd_script >= 0)
        unlink(script);
    return rc;
}
