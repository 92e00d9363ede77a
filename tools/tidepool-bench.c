/*
 * tidepool-bench: load-test client for any OpenAI-compatible server (tidepool, vLLM,
 * llama-server), modelled on vLLM's `bench serve`. docs/bench.md is the manual.
 *
 *   tidepool-bench --url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 \
 *       --input-len 128 --output-len 64 --result-json out.json
 *
 * Design: one thread, one libevent loop. Requests arrive on a schedule (all at once, or
 * Poisson at --request-rate with the gaps drawn from --seed) and are sent while fewer than
 * --concurrency are in flight. Each request is a flight (bench_flight.h: its own evhttp
 * connection, streamed SSE timed on arrival, a record filled in exactly one place, freed
 * from a deferred event); this file dispatches them (arrivals, the concurrency limit,
 * progress, SIGINT / SIGTERM), sets the run up (flags, target, model, descriptors) and
 * reports. Every request has a deadline (--timeout-s), so the run always ends.
 *
 * Modules (tools/bench/, built into libbench.a): bench_args flags, bench_workload prompts,
 * arrivals and randomness, bench_dataset --dataset files, bench_flight one request in
 * flight, bench_sse the event-stream parser, bench_stats percentiles, bench the state of a
 * run shared with bench_report, the summary, JSON, plot and trace.
 */
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/util.h>
#include <jansson.h>
#include <math.h>
#include <netdb.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "log.h"
#include "tokenizer.h"

#include "bench.h"
#include "bench_args.h"
#include "bench_dataset.h"
#include "bench_flight.h"
#include "bench_report.h"
#include "bench_workload.h"

// --- dispatch

/* Send what has arrived while the concurrency limit allows; leave the loop when every
 * request has ended and every flight is torn down. */
static void bench_pump(bench *b)
{
    if (bench_workload_multi_turn(&b->a)) {
        /* a turn goes once it arrived and the previous turn of its conversation ended;
         * later conversations may overtake a waiting one */
        while (b->next_unsent < b->n_arrived && b->recs[b->next_unsent].state != 0)
            b->next_unsent++;
        for (size_t i = b->next_unsent; !b->stopping && i < b->n_arrived &&
                                        (b->a.concurrency == 0 ||
                                         b->in_flight < (size_t)b->a.concurrency);
             i++) {
            long long dep = bench_workload_after(&b->a, i);
            if (b->recs[i].state != BENCH_REC_NOT_SENT ||
                (dep >= 0 && (b->recs[dep].state == BENCH_REC_NOT_SENT ||
                              b->recs[dep].state == BENCH_REC_RUNNING)))
                continue;
            bench_flight_start(b, i, bench_pump);
        }
    }
    while (!bench_workload_multi_turn(&b->a) && !b->stopping && b->n_sent < b->n_arrived &&
           (b->a.concurrency == 0 || b->in_flight < (size_t)b->a.concurrency))
        bench_flight_start(b, b->n_sent, bench_pump);
    if (b->n_done == b->n_sent && b->n_live == 0 && (b->n_sent == b->n || b->stopping))
        event_base_loopbreak(b->base);
}

static void arrival_cb(evutil_socket_t fd, short what, void *arg)
{
    bench *b = arg;
    (void)fd, (void)what;
    if (b->stopping)
        return;
    double t = (double)(bench_now_ns() - b->t0_ns) / 1e9;
    while (b->n_arrived < b->n && b->recs[b->n_arrived].arrival_s <= t)
        b->n_arrived++;
    if (b->n_arrived < b->n) {
        struct timeval tv = bench_timeval(b->recs[b->n_arrived].arrival_s - t);
        if (evtimer_add(b->arrival_ev, &tv) < 0) {
            log_error("cannot arm the arrival timer; sending the rest at once");
            b->n_arrived = b->n;
        }
    }
    bench_pump(b);
}

static void progress_draw(bench *b, int final)
{
    int w = 30, fill = (int)((double)b->n_done / (double)b->n * w);
    char bar[32];
    memset(bar, '=', (size_t)fill);
    memset(bar + fill, ' ', (size_t)(w - fill));
    bar[w] = 0;
    fprintf(stderr, "\r[%s] %zu/%zu  ok %zu  failed %zu  running %zu  %.1f s%s", bar,
            b->n_done, b->n, b->n_ok, b->n_failed, b->in_flight,
            (double)(bench_now_ns() - b->t0_ns) / 1e9, final ? "\n" : "\033[K");
    b->progress_drawn = !final;
}

static void progress_cb(evutil_socket_t fd, short what, void *arg)
{
    (void)fd, (void)what;
    progress_draw(arg, 0);
}

static void signal_cb(evutil_socket_t sig, short what, void *arg)
{
    bench *b = arg;
    (void)what;
    if (b->stopping)
        return;
    b->stopping = 1;
    if (b->progress_drawn)
        fputc('\n', stderr);
    log_warn("%s: stopping; requests in flight count as failed, the rest are not sent",
             strsignal((int)sig));
    if (b->arrival_ev)
        evtimer_del(b->arrival_ev);
    bench_flight_interrupt_all(b, strsignal((int)sig));
    bench_pump(b);
}

// --- set-up

/* Split --url into address, port, Host header and path prefix. 0, or -1 with a message. */
static int bench_target(bench *b)
{
    struct evhttp_uri *u = evhttp_uri_parse(b->a.url);
    const char *scheme = u ? evhttp_uri_get_scheme(u) : NULL;
    const char *host = u ? evhttp_uri_get_host(u) : NULL;
    if (!u || !scheme || strcmp(scheme, "http") != 0 || !host || !*host) {
        fprintf(stderr, "tidepool-bench: --url '%s': want http://HOST[:PORT][/PATH]%s\n",
                b->a.url, scheme && strcmp(scheme, "https") == 0 ? " (https is not supported)"
                                                                 : "");
        if (u)
            evhttp_uri_free(u);
        return -1;
    }
    int port = evhttp_uri_get_port(u);
    b->port = (uint16_t)(port > 0 ? port : 80);
    char name[256];
    snprintf(name, sizeof(name), "%s", host);
    if (name[0] == '[') { /* IPv6 literal */
        memmove(name, name + 1, strlen(name));
        char *e = strchr(name, ']');
        if (e)
            *e = 0;
    }
    if (port > 0)
        snprintf(b->host_header, sizeof(b->host_header), "%s:%d", host, port);
    else
        snprintf(b->host_header, sizeof(b->host_header), "%s", host);
    const char *path = evhttp_uri_get_path(u);
    snprintf(b->prefix, sizeof(b->prefix), "%s", path ? path : "");
    size_t n = strlen(b->prefix);
    while (n > 0 && b->prefix[n - 1] == '/')
        b->prefix[--n] = 0;
    evhttp_uri_free(u);
    if (snprintf(b->path, sizeof(b->path), "%s%s", b->prefix, b->a.endpoint) >=
        (int)sizeof(b->path)) {
        fprintf(stderr, "tidepool-bench: --url path + --endpoint too long\n");
        return -1;
    }
    /* Resolve once, here, so the loop never blocks on DNS. */
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(name, NULL, &hints, &res);
    if (rc != 0 || !res) {
        fprintf(stderr, "tidepool-bench: --url: cannot resolve '%s': %s\n", name,
                gai_strerror(rc));
        return -1;
    }
    rc = getnameinfo(res->ai_addr, res->ai_addrlen, b->host_addr, sizeof(b->host_addr), NULL,
                     0, NI_NUMERICHOST);
    freeaddrinfo(res);
    if (rc != 0) {
        fprintf(stderr, "tidepool-bench: --url: cannot resolve '%s': %s\n", name,
                gai_strerror(rc));
        return -1;
    }
    return 0;
}

/* One request made before the run (GET /v1/models, POST /tokenize), waited for on the
 * loop. */
typedef struct {
    int done, status;
    char *body; /* malloc'd reply body, NUL-terminated */
    size_t n;
    int err;
} sync_fetch;

static void sync_done_cb(struct evhttp_request *req, void *arg)
{
    sync_fetch *m = arg;
    m->done = 1;
    if (req) {
        m->status = evhttp_request_get_response_code(req);
        struct evbuffer *in = evhttp_request_get_input_buffer(req);
        size_t n = evbuffer_get_length(in);
        m->body = malloc(n + 1);
        if (m->body) {
            evbuffer_remove(in, m->body, n);
            m->body[n] = 0;
            m->n = n;
        }
    }
}

static void sync_error_cb(enum evhttp_request_error err, void *arg)
{
    sync_fetch *m = arg;
    m->err = EVUTIL_SOCKET_ERROR();
    (void)err;
}

/* GET (body NULL) or POST (a JSON body) {prefix}path and wait for the answer. Returns the
 * reply parsed as JSON when the status is 200 and it parses (the caller's), else NULL; the
 * status (0: no response) in *status, and a description of a failure in what. */
static json_t *bench_http_sync(bench *b, const char *path, const char *body, int *status,
                               char *what, size_t what_len)
{
    sync_fetch m = {0};
    char full[600];
    json_t *j = NULL;
    snprintf(full, sizeof(full), "%s%s", b->prefix, path);
    struct evhttp_connection *c = evhttp_connection_base_new(b->base, NULL, b->host_addr,
                                                             b->port);
    struct evhttp_request *req = c ? evhttp_request_new(sync_done_cb, &m) : NULL;
    snprintf(what, what_len, "out of memory");
    if (!req)
        goto out;
    evhttp_connection_set_timeout(c, (int)fmin(30, ceil(b->a.timeout_s)));
    evhttp_request_set_error_cb(req, sync_error_cb);
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    if (evhttp_add_header(h, "Host", b->host_header) < 0 ||
        (b->authorization && evhttp_add_header(h, "Authorization", b->authorization) < 0) ||
        (body && (evhttp_add_header(h, "Content-Type", "application/json") < 0 ||
                  evbuffer_add(evhttp_request_get_output_buffer(req), body, strlen(body)) <
                      0))) {
        evhttp_request_free(req);
        goto out;
    }
    if (evhttp_make_request(c, req, body ? EVHTTP_REQ_POST : EVHTTP_REQ_GET, full) != 0)
        goto out;
    while (!m.done && event_base_loop(b->base, EVLOOP_ONCE) == 0)
        ;
    if (m.status == 200) {
        json_error_t je;
        j = m.body ? json_loadb(m.body, m.n, 0, &je) : NULL;
        snprintf(what, what_len, "the reply is not JSON");
    } else if (m.status) {
        snprintf(what, what_len, "HTTP %d", m.status);
    } else {
        snprintf(what, what_len, "%s", m.err ? evutil_socket_error_to_string(m.err)
                                             : "no response");
    }
out:
    *status = m.status;
    if (c)
        evhttp_connection_free(c);
    free(m.body);
    return j;
}

/* The first model id of GET {prefix}/v1/models (malloc'd), or NULL with a message. */
static char *bench_fetch_model(bench *b)
{
    char what[128];
    int status = 0;
    json_t *j = bench_http_sync(b, "/v1/models", NULL, &status, what, sizeof(what));
    const json_t *id = json_object_get(json_array_get(json_object_get(j, "data"), 0), "id");
    char *model = json_is_string(id) ? strdup(json_string_value(id)) : NULL;
    json_decref(j);
    if (!model) {
        if (status == 200)
            snprintf(what, sizeof(what), "no data[0].id in the reply");
        if (status == 401) /* --model would not help: every request gets 401 */
            fprintf(stderr, "tidepool-bench: http://%s%s/v1/models: HTTP 401: %s: pass "
                            "--api-key KEY (or set TIDEPOOL_API_KEY)\n", b->host_header,
                    b->prefix, b->authorization ? "the server refused the API key given"
                                                : "the server wants an API key");
        else
            fprintf(stderr, "tidepool-bench: cannot get the model from http://%s%s/v1/models: "
                            "%s; pass --model NAME\n", b->host_header, b->prefix, what);
    }
    return model;
}

// --- the token pool of --trace

/* The ids of json array arr (malloc'd, *n of them), or NULL when it is not a non-empty
 * array of integers in [0, INT_MAX]. */
static int *json_ids(const json_t *arr, size_t *n)
{
    size_t k = json_array_size(arr);
    int *ids = k ? malloc(k * sizeof(int)) : NULL;
    for (size_t i = 0; ids && i < k; i++) {
        const json_t *v = json_array_get(arr, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 ||
            json_integer_value(v) > 0x7fffffff) {
            free(ids);
            return NULL;
        }
        ids[i] = (int)json_integer_value(v);
    }
    *n = k;
    return ids;
}

/* Tokenize text with the server: vLLM's and tidepool's POST /tokenize {"prompt",
 * "add_special_tokens"}, else llama-server's {"content", "add_special"}. The ids
 * (malloc'd, *n), and the server's max_model_len when it reports one (else *max_len is
 * left alone); NULL with a message on stderr. */
static int *server_tokenize(bench *b, const char *text, int special, size_t *n,
                            long long *max_len)
{
    char what[2][128];
    int status[2] = {0, 0};
    for (int form = 0; form < 2; form++) {
        json_t *req = form == 0 ? json_pack("{s:s, s:b, s:s}", "prompt", text,
                                            "add_special_tokens", special, "model", b->model)
                                : json_pack("{s:s, s:b}", "content", text, "add_special",
                                            special);
        char *body = req ? json_dumps(req, JSON_COMPACT) : NULL;
        json_decref(req);
        if (!body)
            return NULL;
        json_t *j = bench_http_sync(b, "/tokenize", body, &status[form], what[form],
                                    sizeof(what[form]));
        free(body);
        int *ids = json_ids(json_object_get(j, "tokens"), n);
        const json_t *ml = json_object_get(j, "max_model_len");
        if (ids && json_is_integer(ml) && json_integer_value(ml) > 0)
            *max_len = json_integer_value(ml);
        if (j && !ids)
            snprintf(what[form], sizeof(what[form]), "no \"tokens\" array of ids in the reply");
        json_decref(j);
        if (ids)
            return ids;
        if (status[form] == 401)
            break;
    }
    fprintf(stderr, "tidepool-bench: --trace: cannot tokenize the prompts' text with "
                    "http://%s%s/tokenize (vLLM form: %s; llama-server form: %s): pass "
                    "--prompt-tokenizer GGUF (the server's model file)\n", b->host_header,
            b->prefix, what[0], status[0] == 401 ? "not tried" : what[1]);
    return NULL;
}

static tokenizer_t *prompt_tok; /* --prompt-tokenizer's, NULL without it */

/* The ids of text with the local tokenizer, BOS first when bos (malloc'd, *n); NULL on
 * failure. */
static int *local_tokenize(const char *text, size_t len, int bos, size_t *n)
{
    int cap = (int)len + 8, needed = 0; /* a token spells at least one byte */
    int *out = malloc((size_t)cap * sizeof(int));
    int k = out ? tokenizer_encode(prompt_tok, text, len, bos, out, cap, &needed) : -1;
    if (k < 0) {
        free(out);
        return NULL;
    }
    *n = (size_t)k;
    return out;
}

/* Give --trace its token pool: synthetic text (at least the longest prompt in words, a
 * word being at least a token) tokenized without special tokens by the server's tokenizer
 * (or --prompt-tokenizer's), and the BOS id: the first id of "the" tokenized with special
 * tokens when that is one id longer than without. Checks the trace against the server's
 * context window when /tokenize reports it. 0, or -1 with a message. */
static int bench_trace_prepare(bench *b)
{
    long long n_words = bench_trace_max_prompt(b->trace) + 64;
    if (n_words < 2048)
        n_words = 2048;
    size_t len, n_pool = 0, n_with = 0, n_without = 0;
    char *text = bench_workload_filler(b->a.seed, n_words, &len);
    long long max_len = 0;
    int *pool = NULL, *with = NULL, *without = NULL, rc = -1;
    if (!text) {
        fprintf(stderr, "tidepool-bench: out of memory (the trace's token pool)\n");
        return -1;
    }
    if (prompt_tok) {
        pool = local_tokenize(text, len, 0, &n_pool);
        with = pool ? local_tokenize("the", 3, 1, &n_with) : NULL;
        without = with ? local_tokenize("the", 3, 0, &n_without) : NULL;
        if (!without)
            fprintf(stderr, "tidepool-bench: --prompt-tokenizer %s: cannot tokenize the "
                            "prompts' text\n", b->a.prompt_tokenizer);
    } else {
        pool = server_tokenize(b, text, 0, &n_pool, &max_len);
        with = pool ? server_tokenize(b, "the", 1, &n_with, &max_len) : NULL;
        without = with ? server_tokenize(b, "the", 0, &n_without, &max_len) : NULL;
    }
    if (!without)
        goto out;
    int bos = n_with == n_without + 1 ? with[0] : -1;
    bench_trace_set_pool(b->trace, pool, n_pool, bos);
    pool = NULL;
    char err[256];
    if (max_len > 0 && bench_trace_check_context(b->trace, max_len, err, sizeof(err)) < 0) {
        fprintf(stderr, "tidepool-bench: --trace %s:%s\n", b->a.trace, err);
        goto out;
    }
    log_info("trace %s: %zu requests over %.1f s (time scale %g); prompts cut from %zu "
             "token ids of the %s tokenizer, %s; context window %s", b->a.trace,
             bench_trace_size(b->trace), bench_trace_span_s(b->trace), b->a.time_scale,
             n_pool, prompt_tok ? "local" : "server's", bos >= 0 ? "BOS first" : "no BOS",
             max_len > 0 ? "checked" : "unknown (not checked)");
    rc = 0;
out:
    free(text), free(pool), free(with), free(without);
    return rc;
}

static int bench_check_args(bench *b)
{
    const bench_args *a = &b->a;
    const char *e = NULL;
    if (strcmp(a->workload, "synthetic") != 0 && strcmp(a->workload, "phase-shift") != 0 &&
        !bench_workload_multi_turn(a) && !bench_workload_shared_prefix(a))
        e = "--workload: want synthetic, phase-shift, multi-turn or shared-prefix";
    else if (a->trace && (strcmp(a->workload, "synthetic") != 0 || a->dataset ||
                          a->set_input_len || a->set_output_len || a->input_range[0] >= 0 ||
                          a->output_range[0] >= 0))
        e = "--trace gives every request's arrival and lengths: drop --workload, --dataset, "
            "--input-len* and --output-len*";
    else if (a->trace && (isfinite(a->request_rate) || a->duration_s > 0))
        e = "--trace gives the arrival times: drop --request-rate and --duration-s (use "
            "--time-scale, --num-prompts)";
    else if (a->set_time_scale && !a->trace)
        e = "--time-scale goes with --trace";
    else if (a->dataset && strcmp(a->workload, "synthetic") != 0)
        e = "--dataset gives the prompts: it goes with --workload synthetic only";
    else if (a->prompt_tokenizer && bench_workload_multi_turn(a))
        e = "--prompt-tokenizer and --workload multi-turn exclude each other (replies are "
            "text)";
    else if (a->dataset && (a->set_input_len || a->input_range[0] >= 0))
        e = "--dataset gives the prompts: drop --input-len / --input-len-range";
    else if (a->set_input_len && a->input_range[0] >= 0)
        e = "give --input-len or --input-len-range, not both";
    else if (a->set_output_len && a->output_range[0] >= 0)
        e = "give --output-len or --output-len-range, not both";
    else if (a->endpoint[0] != '/')
        e = "--endpoint must start with '/'";
    else if (a->plot && strchr(a->plot, '\''))
        e = "--plot: the file name must not contain a single quote";
    else if (a->model && !*a->model)
        e = "--model: empty name";
    else if (a->decode_rate > 0 &&
             (strcmp(a->workload, "phase-shift") != 0 || !isfinite(a->request_rate)))
        e = "--decode-rate needs --workload phase-shift and a finite --request-rate";
    else if (a->duration_s > 0 && !isfinite(a->request_rate))
        e = "--duration-s needs a finite --request-rate";
    if (e) {
        fprintf(stderr, "tidepool-bench: %s\n", e);
        return -1;
    }
    size_t n = strlen(a->endpoint);
    b->chat = n >= 16 && strcmp(a->endpoint + n - 16, "chat/completions") == 0;
    if (a->trace && b->chat) {
        fprintf(stderr, "tidepool-bench: --trace needs the completions endpoint (its prompts "
                        "are token ids)\n");
        return -1;
    }
    if (a->prompt_tokenizer && b->chat) {
        fprintf(stderr, "tidepool-bench: --prompt-tokenizer needs the completions endpoint "
                        "(chat messages are text)\n");
        return -1;
    }
    return 0;
}

/* bench_args.reply_of: the reply request idx received (multi-turn history). */
static const char *bench_reply_of(void *ctx, size_t idx)
{
    const bench *b = ctx;
    return idx < b->n && b->recs[idx].state == BENCH_REC_OK ? b->recs[idx].reply : NULL;
}

/* bench_args.tokenize for --prompt-tokenizer: BOS + the text's ids, as the gateway
 * tokenizes a text prompt. */
static int bench_tokenize(void *ctx, const char *text, size_t len, int **ids, size_t *n)
{
    const tokenizer_t *tok = ctx;
    int cap = (int)len + 8, needed = 0; /* a token spells at least one byte */
    int *out = malloc((size_t)cap * sizeof(int));
    int k = out ? tokenizer_encode(tok, text, len, 1, out, cap, &needed) : -1;
    if (k < 0) {
        free(out);
        return -1;
    }
    *ids = out;
    *n = (size_t)k;
    return 0;
}

static void raise_fd_limit(bench *b)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return;
    if (rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
        getrlimit(RLIMIT_NOFILE, &rl);
    }
    size_t want = b->a.concurrency > 0 ? (size_t)b->a.concurrency : b->n;
    if (rl.rlim_cur != RLIM_INFINITY && want + 32 > rl.rlim_cur)
        log_warn("up to %zu connections at once but the descriptor limit is %llu: expect "
                 "connection errors (lower --concurrency or raise ulimit -n)",
                 want, (unsigned long long)rl.rlim_cur);
}

static void bench_free(bench *b)
{
    if (b->recs)
        for (size_t i = 0; i < b->n; i++)
            free(b->recs[i].error), free(b->recs[i].reply);
    free(b->recs);
    free(b->itl_pool);
    free(b->model);
    free(b->authorization);
    bench_dataset_destroy(&b->ds);
    bench_trace_destroy(&b->trace);
    if (b->arrival_ev)
        event_free(b->arrival_ev);
    if (b->progress_ev)
        event_free(b->progress_ev);
    if (b->sigint_ev)
        event_free(b->sigint_ev);
    if (b->sigterm_ev)
        event_free(b->sigterm_ev);
    if (b->base)
        event_base_free(b->base);
}

int main(int argc, char **argv)
{
    static bench bs;
    bench *b = &bs;
    int rc = bench_args_parse(&b->a, argc, argv);
    if (rc != 0)
        return rc > 0 ? 0 : 2;
    log_init("tidepool-bench", LOG_LEVEL_INFO);
    if (bench_check_args(b) < 0)
        return 2;
    if (bench_target(b) < 0)
        return 2;
    /* the API key: the flag, else the environment (never in the result JSON) */
    const char *key = b->a.api_key;
    if (!key || !*key)
        key = getenv("TIDEPOOL_API_KEY");
    if (!key || !*key)
        key = getenv("OPENAI_API_KEY");
    if (key && *key && asprintf(&b->authorization, "Bearer %s", key) < 0) {
        fprintf(stderr, "tidepool-bench: out of memory\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    if (b->a.trace) {
        char err[4096 + 256];
        b->trace = bench_trace_load(b->a.trace, b->a.time_scale,
                                    b->a.set_num_prompts ? (size_t)b->a.num_prompts : 0, err,
                                    sizeof(err));
        if (!b->trace) {
            fprintf(stderr, "tidepool-bench: --trace %s\n", err);
            return 2;
        }
    }
    b->n = b->trace ? bench_trace_size(b->trace) : bench_workload_n_requests(&b->a);
    b->a.reply_of = bench_reply_of;
    b->a.reply_ctx = b;
    int exit_code = 1;
    b->base = event_base_new();
    b->recs = calloc(b->n, sizeof(bench_rec));
    if (!b->base || !b->recs) {
        fprintf(stderr, "tidepool-bench: out of memory (%zu records)\n", b->n);
        goto out;
    }
    if (b->a.dataset) {
        char err[4096 + 256]; /* a path and a reason */
        b->ds = bench_dataset_load(b->a.dataset, b->n, b->chat, err, sizeof(err));
        if (!b->ds) {
            fprintf(stderr, "tidepool-bench: %s\n", err);
            goto out;
        }
    }
    if (b->a.prompt_tokenizer) {
        char err[512];
        prompt_tok = tokenizer_load(b->a.prompt_tokenizer, err, sizeof(err));
        if (!prompt_tok) {
            fprintf(stderr, "tidepool-bench: --prompt-tokenizer %s: %s\n", b->a.prompt_tokenizer,
                    err);
            goto out;
        }
        b->a.tokenize = bench_tokenize;
        b->a.tokenize_ctx = prompt_tok;
    }
    b->model = b->a.model ? strdup(b->a.model) : bench_fetch_model(b);
    if (!b->model)
        goto out;
    if (b->trace && bench_trace_prepare(b) < 0)
        goto out;
    raise_fd_limit(b);

    /* The arrival schedule, from its own random stream; --duration-s cuts it. */
    double *arrivals = calloc(b->n ? b->n : 1, sizeof(double));
    if (!arrivals) {
        fprintf(stderr, "tidepool-bench: out of memory (%zu records)\n", b->n);
        goto out;
    }
    if (!b->trace)
        b->n = bench_workload_arrivals(&b->a, arrivals, b->n);
    for (size_t i = 0; i < b->n; i++) {
        b->recs[i].phase = BENCH_WORKLOAD_PHASE_NONE;
        b->recs[i].max_tokens = -1;
        b->recs[i].arrival_s = arrivals[i];
        if (b->trace) { /* the trace's shape, also for requests never sent (--trace-out) */
            const bench_trace_req *q = bench_trace_at(b->trace, i);
            b->recs[i].arrival_s = q->arrival_s;
            b->recs[i].prompt_words = q->prompt_tokens;
            b->recs[i].max_tokens = q->output_tokens;
            b->recs[i].offline = (uint8_t)q->offline;
        }
    }
    free(arrivals);
    b->arrival_ev = evtimer_new(b->base, arrival_cb, b);
    b->sigint_ev = evsignal_new(b->base, SIGINT, signal_cb, b);
    b->sigterm_ev = evsignal_new(b->base, SIGTERM, signal_cb, b);
    b->progress = !b->a.no_progress && isatty(STDERR_FILENO);
    if (b->progress)
        b->progress_ev = event_new(b->base, -1, EV_PERSIST, progress_cb, b);
    struct timeval zero = {0, 0}, tick = {0, 250000};
    if (!b->arrival_ev || !b->sigint_ev || !b->sigterm_ev || (b->progress && !b->progress_ev) ||
        evsignal_add(b->sigint_ev, NULL) < 0 || evsignal_add(b->sigterm_ev, NULL) < 0 ||
        evtimer_add(b->arrival_ev, &zero) < 0 ||
        (b->progress && event_add(b->progress_ev, &tick) < 0)) {
        fprintf(stderr, "tidepool-bench: cannot set up the event loop\n");
        goto out;
    }
    char rate[32], conc[32];
    snprintf(rate, sizeof(rate), isfinite(b->a.request_rate) ? "%g req/s" : "inf",
             b->a.request_rate);
    snprintf(conc, sizeof(conc), b->a.concurrency ? "%lld" : "unlimited", b->a.concurrency);
    if (b->trace)
        snprintf(rate, sizeof(rate), "trace");
    log_info("%zu requests to http://%s%s, model %s, request rate %s, concurrency %s, "
             "workload %s, seed %lld", b->n, b->host_header, b->path, b->model, rate, conc,
             b->a.trace ? b->a.trace : b->a.dataset ? b->a.dataset : b->a.workload, b->a.seed);
    b->t0_ns = bench_now_ns();
    if (event_base_dispatch(b->base) < 0) {
        fprintf(stderr, "tidepool-bench: event loop failed\n");
        goto out;
    }
    /* From here on the loop no longer runs: give SIGINT / SIGTERM back their defaults. */
    evsignal_del(b->sigint_ev);
    evsignal_del(b->sigterm_ev);
    if (b->progress)
        progress_draw(b, 1);

    bench_report_metrics m, ph[2];
    int phased = bench_workload_phase_shift(&b->a);
    if (bench_report_compute(b, BENCH_REPORT_ALL_PHASES, &m) < 0 ||
        (phased && (bench_report_compute(b, BENCH_WORKLOAD_PHASE_PREFILL, &ph[0]) < 0 ||
                    bench_report_compute(b, BENCH_WORKLOAD_PHASE_DECODE, &ph[1]) < 0))) {
        fprintf(stderr, "tidepool-bench: out of memory computing the figures\n");
        goto out;
    }
    bench_report_print(b, &m, phased ? ph : NULL, stdout);
    exit_code = m.completed > 0 ? 0 : 1;
    if (b->a.result_json && bench_report_json(b, &m, phased ? ph : NULL, argc, argv) < 0)
        exit_code = 1;
    if (b->a.plot && bench_report_plot(b) < 0)
        exit_code = 1;
    if (b->a.trace_out && bench_report_trace(b) < 0)
        exit_code = 1;
out:
    bench_free(b);
    tokenizer_destroy(&prompt_tok);
    libevent_global_shutdown();
    return exit_code;
}
