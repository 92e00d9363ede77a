/*
 * gateway: tidepool's front door. Serves the OpenAI-compatible HTTP API (libevent evhttp),
 * tokenizes and validates requests, routes them to prefill and decode workers over the
 * ctl ZeroMQ socket, and streams the answers back. Reads the tokenizer, the context length
 * and the model fingerprint from the model file (the weights are hashed once at start, as
 * the workers do, so that a worker with another model is refused at registration; they
 * are never computed with).
 *
 * One thread, one event loop: HTTP connections, the ctl socket (through evzmq), timers
 * and signals. Operators' figures: GET /metrics (Prometheus) and the stats PUB socket
 * (--stats-bind), both from stats.h; see docs/stats.md. SIGTERM/SIGINT: stop accepting,
 * let requests in flight finish (up to --drain-timeout-ms), then exit. Offline requests
 * (service_tier flex) and the Batch API (batch.h, state in --state-db) run in the cluster's
 * offline tier. API keys (auth.h: --api-key, --admin-api-key, --api-key-file) close the
 * /v1/ routes and the operators' endpoints to callers without one. See docs/api.md and
 * docs/protocol.md.
 */
#include <event2/event.h>
#include <signal.h>
#include <sys/resource.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "auth.h"
#include "batch.h"
#include "cluster.h"
#include "completion.h"
#include "config.h"
#include "gguf.h"
#include "http.h"
#include "log.h"
#include "model.h"
#include "statpub.h"
#include "stats.h"
#include "tokenizer.h"

static char *opt_host, *opt_ctl_bind, *opt_model, *opt_served_name, *opt_log_level,
    *opt_stats_bind;
/* CURVE on the ctl socket (docs/security.md) */
static char *opt_curve_secret_key, *opt_curve_authorized_keys, *opt_stats_authorized_keys;
static long long opt_http_timeout_s;
static long long opt_sse_keepalive_s;
static long long opt_max_connections, opt_header_timeout_s, opt_body_timeout_s;
static long long opt_body_min_rate, opt_max_unsent;
static long long opt_port, opt_max_body, opt_max_queue, opt_hb_ms, opt_dead_ms, opt_timeout_ms,
    opt_retries, opt_drain_ms, opt_stats_interval_ms, opt_stats_stall_ms, opt_stats_window_s,
    opt_kv_block_size;
/* offline tier and Batch API */
static char *opt_state_db;
static char *opt_routing;
static double opt_routing_load_weight;
static long long opt_batch_max_file_bytes, opt_batch_max_lines, opt_batch_max_inflight;
static double opt_offline_max_wait_s, opt_offline_target, opt_preempt_pressure, opt_smooth_s,
    opt_ttft_slo_ms, opt_tpot_slo_ms, opt_prefill_tok_s, opt_decode_tok_s;
/* API keys */
static config_strings opt_api_keys, opt_admin_api_keys;
static char *opt_api_key_file;
/* tidal role changes */
static int opt_tidal;
static int opt_responses_store;
static double opt_tidal_min_role_s;
static long long opt_tidal_max_changes, opt_tidal_min_per_role;

static const config_entry_t settings[] = {
    {"host", CONFIG_STRING, &opt_host, "127.0.0.1", 0, 0, "address the HTTP server listens on"},
    {"port", CONFIG_INT, &opt_port, "8000", 0, 65535, "HTTP port (0 = any free port)"},
    {"ctl-bind", CONFIG_STRING, &opt_ctl_bind, "tcp://127.0.0.1:5557", 0, 0,
     "ZeroMQ endpoint of the ctl ROUTER socket that workers connect to"},
    {"model", CONFIG_STRING, &opt_model, "build/models/stories260K.gguf", 0, 0,
     "GGUF model file (its tokenizer, context length and fingerprint are read; workers with "
     "another model are refused)"},
    {"served-model-name", CONFIG_STRING, &opt_served_name, NULL, 0, 0,
     "model name in the API (default: the file's general.name)"},
    {"kv-block-size", CONFIG_INT, &opt_kv_block_size, "0", 0, 4096,
     "tokens per KV block every worker must have (their --block-size); 0 = the first worker "
     "accepted sets it until no worker is left. Other workers are refused"},
    {"max-body-bytes", CONFIG_INT, &opt_max_body, "1048576", 1024, 1073741824,
     "largest request body accepted; larger ones get 413"},
    {"http-timeout-s", CONFIG_INT, &opt_http_timeout_s, "60", 1, 86400,
     "close a client connection idle this long while sending its request or while a reply "
     "waits for it to read (a stream waiting for tokens is not idle)"},
    {"http-header-timeout-s", CONFIG_INT, &opt_header_timeout_s, "20", 1, 86400,
     "a request's line and headers must arrive within this many seconds of its first byte, "
     "else 408 request_timeout and the connection is closed (slowloris)"},
    {"http-body-timeout-s", CONFIG_INT, &opt_body_timeout_s, "30", 1, 86400,
     "a request's body must arrive within this many seconds of its headers, plus 1 s per "
     "--http-body-min-rate bytes received, else 408 request_timeout"},
    {"http-body-min-rate", CONFIG_INT, &opt_body_min_rate, "1024", 0, 1000000000,
     "bytes of a body that buy it one more second (0 = the whole body within "
     "--http-body-timeout-s)"},
    {"max-connections", CONFIG_INT, &opt_max_connections, "4096", 1, 10000000,
     "HTTP connections open at once; a connection past it closes the one idle longest, or "
     "when none is idle gets 503 too_many_connections"},
    {"stream-max-unsent-bytes", CONFIG_INT, &opt_max_unsent, "8388608", 4096, 1073741824,
     "a stream whose client leaves this many bytes unread is dropped (its connection closed, "
     "its request cancelled)"},
    {"sse-keepalive-s", CONFIG_INT, &opt_sse_keepalive_s, "15", 1, 86400,
     "a stream with no event for this long gets an SSE comment \": keep-alive\" (so that "
     "proxies' idle timeouts do not cut a request waiting for a worker or its first token)"},
    {"max-queue", CONFIG_INT, &opt_max_queue, "1024", 0, 10000000,
     "requests waiting for a worker before new ones get 429"},
    {"heartbeat-ms", CONFIG_INT, &opt_hb_ms, "500", 10, 3600000,
     "heartbeat interval told to workers"},
    {"dead-after-ms", CONFIG_INT, &opt_dead_ms, "1500", 20, 36000000,
     "a worker silent this long is declared dead and its requests re-run"},
    {"request-timeout-ms", CONFIG_INT, &opt_timeout_ms, "60000", 100, 86400000,
     "no progress this long: an assigned request is re-run, a queued one fails with 503"},
    {"routing", CONFIG_STRING, &opt_routing, "cache-aware", 0, 0,
     "how a request's prefill worker is chosen: cache-aware (the least cost: the prompt "
     "tokens it would compute there, those its prefix cache is not believed to hold, plus "
     "--routing-load-weight times what it has queued) or least-loaded (the fewest queued "
     "prompt tokens); docs/prefix-cache.md"},
    {"routing-load-weight", CONFIG_DOUBLE, &opt_routing_load_weight, "0.25", 0, 1000,
     "cache-aware routing: weight of a prefill worker's queued prompt tokens (those it is "
     "expected to compute) against the tokens a request would compute there; larger "
     "balances load more, smaller follows the cache more"},
    {"max-retries", CONFIG_INT, &opt_retries, "3", 0, 100,
     "times a failed request is re-run on other workers before an error"},
    {"drain-timeout-ms", CONFIG_INT, &opt_drain_ms, "30000", 0, 3600000,
     "on SIGTERM, how long requests in flight may take to finish"},
    {"stats-bind", CONFIG_STRING, &opt_stats_bind, "tcp://127.0.0.1:5558", 0, 0,
     "ZeroMQ endpoint of the stats PUB socket (\"\" = off); see docs/stats.md"},
    {"stats-interval-ms", CONFIG_INT, &opt_stats_interval_ms, "1000", 10, 3600000,
     "period of the snapshots published on the stats socket"},
    {"stats-stall-ms", CONFIG_INT, &opt_stats_stall_ms, "2000", 0, 3600000,
     "a stats subscriber that has taken nothing this long is sent past (it loses those "
     "messages and sees the seq gaps; 0 = never: the slowest subscriber paces all)"},
    {"stats-window-s", CONFIG_INT, &opt_stats_window_s, "60", 1, 3600,
     "window of the latency percentiles on the stats socket"},
    {"state-db", CONFIG_STRING, &opt_state_db, "build/state/gateway.db", 0, 0,
     "SQLite file of the Batch API's files, batches and results (\"\" = Batch API off)"},
    {"responses-store", CONFIG_BOOL, &opt_responses_store, "false", 0, 0,
     "keep /v1/responses answers (requests with store, default true) in --state-db for GET "
     "and DELETE /v1/responses/{id} (as vLLM's VLLM_ENABLE_RESPONSES_API_STORE; off: none "
     "kept)"},
    {"batch-max-file-bytes", CONFIG_INT, &opt_batch_max_file_bytes, "104857600", 1, 1073741824,
     "largest file accepted by POST /v1/files"},
    {"batch-max-lines", CONFIG_INT, &opt_batch_max_lines, "50000", 1, 10000000,
     "lines (requests) per batch input file"},
    {"batch-max-inflight", CONFIG_INT, &opt_batch_max_inflight, "256", 1, 1000000,
     "batch lines submitted to the cluster at a time (all batches)"},
    {"offline-max-wait-s", CONFIG_DOUBLE, &opt_offline_max_wait_s, "60", 0, 1e7,
     "aging: an offline (flex, batch) request waiting this long is promoted"},
    {"offline-target", CONFIG_DOUBLE, &opt_offline_target, "0.6", 0, 100,
     "offline work fills decode capacity up to this online pressure"},
    {"preempt-pressure", CONFIG_DOUBLE, &opt_preempt_pressure, "0.95", 0.01, 100,
     "online pressure at which running offline work is preempted"},
    {"smooth-s", CONFIG_DOUBLE, &opt_smooth_s, "5", 0, 1e6,
     "tidal policy: time constant of its smoothed load signals"},
    {"ttft-slo-ms", CONFIG_DOUBLE, &opt_ttft_slo_ms, "2000", 1, 1e7,
     "tidal policy: time-to-first-token target"},
    {"tpot-slo-ms", CONFIG_DOUBLE, &opt_tpot_slo_ms, "50", 1, 1e7,
     "tidal policy: time-per-output-token target"},
    {"prefill-tokens-per-s", CONFIG_DOUBLE, &opt_prefill_tok_s, "10000", 1, 1e9,
     "tidal policy: prompt tokens one prefill worker computes per second, its prefill "
     "capacity estimate (emulated workers: tidepool-sim prints the cost model's)"},
    {"decode-tokens-per-s", CONFIG_DOUBLE, &opt_decode_tok_s, "0", 0, 1e9,
     "tidal policy: output tokens one decode worker emits per second at full batch within "
     "the TPOT SLO, its decode token capacity (0 = unknown: decode load from the sequence "
     "count alone; emulated workers: tidepool-sim prints the cost model's)"},
    {"tidal", CONFIG_BOOL, &opt_tidal, "false", 0, 0,
     "apply the tidal policy's role changes (live: a prefill worker finishes its batch, a "
     "decode worker migrates its running sequences to other decode workers; "
     "docs/scheduler.md); off: roles change only by POST /workers/{id}/role"},
    {"tidal-min-role-s", CONFIG_DOUBLE, &opt_tidal_min_role_s, "30", 0, 1e6,
     "tidal policy: a worker stays at least this long in a role"},
    {"tidal-max-changes", CONFIG_INT, &opt_tidal_max_changes, "2", 0, 1000000,
     "tidal policy: role changes allowed per 10 s window"},
    {"tidal-min-per-role", CONFIG_INT, &opt_tidal_min_per_role, "1", 1, 1000000,
     "tidal policy: workers that always stay prefill-capable and decode-capable"},
    {"curve-secret-key", CONFIG_STRING, &opt_curve_secret_key, "", 0, 0,
     "CURVE: the gateway's key pair file (tidepool-keygen; mode 0600): the ctl socket is "
     "encrypted and admits only --curve-authorized-keys (docs/security.md); \"\" = plain"},
    {"curve-authorized-keys", CONFIG_STRING, &opt_curve_authorized_keys, "", 0, 0,
     "CURVE: the worker public keys admitted: a file of keys or a directory of .pub files"},
    {"stats-authorized-keys", CONFIG_STRING, &opt_stats_authorized_keys, "", 0, 0,
     "CURVE: the subscribers (tidepool-top, dashboards) admitted to the stats socket, which "
     "is then encrypted with the gateway's key too: a file of keys or a directory of .pub "
     "files; \"\" = the --curve-authorized-keys list. Needs --curve-secret-key"},
    {"api-key", CONFIG_SECRET_LIST, &opt_api_keys, NULL, 0, 0,
     "an API key clients must send (Authorization: Bearer KEY) on /v1/; repeatable (the "
     "environment: several, separated by commas); no key at all = open"},
    {"admin-api-key", CONFIG_SECRET_LIST, &opt_admin_api_keys, NULL, 0, 0,
     "an API key that also opens /metrics, /workers, role changes and every key's Batch API "
     "objects; repeatable"},
    {"api-key-file", CONFIG_STRING, &opt_api_key_file, NULL, 0, 0,
     "file of API keys, one a line with optional attributes admin, requests-per-s=N, "
     "tokens-per-s=N; mode 0600 or stricter (docs/api.md)"},
    {"log-level", CONFIG_STRING, &opt_log_level, "info", 0, 0, "debug, info, warn or error"},
    {NULL, 0, NULL, NULL, 0, 0, NULL},
};

/* The tidal policy's latency signals (--tidal): the cluster's online TTFT and TPOT p90 over
 * the stats window, in ms (0 = no sample yet). */
static void online_p90(void *ud, int64_t now_us, double *ttft_ms, double *tpot_ms)
{
    stats_worker_figures f;
    stats_get_cluster(ud, now_us, &f);
    *ttft_ms = f.ttft.n > 0 && f.ttft.p90 == f.ttft.p90 ? f.ttft.p90 * 1000.0 : 0.0;
    *tpot_ms = f.tpot.n > 0 && f.tpot.p90 == f.tpot.p90 ? f.tpot.p90 * 1000.0 : 0.0;
}

typedef struct {
    struct event_base *base;
    http_server_t *http;
    struct event *drain_ev;
    int64_t drain_deadline_ms;
    int stopping;
} app_t;

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void on_drain_tick(evutil_socket_t fd, short what, void *arg)
{
    app_t *a = arg;
    (void)fd;
    (void)what;
    int n = http_server_n_active(a->http);
    if (n == 0 || now_ms() >= a->drain_deadline_ms) {
        if (n)
            log_warn("drain timeout: %d requests still in flight are failed", n);
        event_base_loopbreak(a->base);
    }
}

static void on_signal(evutil_socket_t sig, short what, void *arg)
{
    app_t *a = arg;
    (void)what;
    if (a->stopping) {
        log_warn("signal %d again: stopping now", (int)sig);
        event_base_loopbreak(a->base);
        return;
    }
    a->stopping = 1;
    log_info("signal %d: no new connections; draining %d requests", (int)sig,
             http_server_n_active(a->http));
    http_server_stop_accepting(a->http);
    a->drain_deadline_ms = now_ms() + opt_drain_ms;
    struct timeval tv = {0, 50 * 1000};
    a->drain_ev = event_new(a->base, -1, EV_PERSIST, on_drain_tick, a);
    if (a->drain_ev)
        event_add(a->drain_ev, &tv);
    else
        event_base_loopbreak(a->base);
}

/* The model's fingerprint as the workers compute it (model_config.fingerprint), or 0 when
 * the file does not load as a model (logged). */
static uint64_t read_model_fingerprint(const char *path)
{
    char err[512];
    model_t *m = model_load(path, err, sizeof(err));
    if (!m) {
        log_error("cannot load the model to compute its fingerprint: %s", err);
        return 0;
    }
    uint64_t fp = model_get_config(m)->fingerprint;
    model_destroy(&m);
    return fp;
}

/* The API keys of the flags and the file (none: NULL, the gateway is open). 0, or -1 with a
 * message logged (the gateway refuses to start). */
static int load_keys(auth_t **out)
{
    *out = NULL;
    if (opt_api_key_file && !opt_api_key_file[strspn(opt_api_key_file, " \t\r\n")]) {
        log_error("api-key-file is empty (--api-key-file, TIDEPOOL_API_KEY_FILE or the config "
                  "file): give the key file's path, or leave the setting out");
        return -1;
    }
    if (!opt_api_keys.n && !opt_admin_api_keys.n && !opt_api_key_file)
        return 0;
    auth_t *a = auth_new();
    char err[1200];
    if (!a) {
        log_error("cannot initialise libsodium (API keys)");
        return -1;
    }
    for (int admin = 0; admin < 2; admin++) {
        const config_strings *l = admin ? &opt_admin_api_keys : &opt_api_keys;
        for (int i = 0; i < l->n; i++) {
            auth_key_params p = {.admin = admin};
            char source[200];
            if (l->n > 1)
                snprintf(source, sizeof(source), "%s (value %d)", l->origin, i + 1);
            else
                snprintf(source, sizeof(source), "%s", l->origin);
            if (auth_add_key(a, l->v[i], &p, source, err, sizeof(err)) < 0) {
                log_error("%s: %s", source, err);
                auth_destroy(&a);
                return -1;
            }
        }
    }
    if (opt_api_key_file && auth_load_file(a, opt_api_key_file, err, sizeof(err)) < 0) {
        log_error("%s", err);
        auth_destroy(&a);
        return -1;
    }
    for (int i = 0; i < auth_n_keys(a); i++) {
        const auth_key *k = auth_key_at(a, i);
        auth_key_params p = auth_key_get_params(k);
        log_info("API key %s: %s, %g requests/s, %g tokens/s (0 = no limit)", auth_key_id(k),
                 p.admin ? "admin" : "user", p.requests_per_s, p.tokens_per_s);
        if (auth_key_bytes(k) < AUTH_MIN_GOOD_KEY_BYTES)
            log_warn("API key %s is only %zu characters long: use long random keys (e.g. "
                     "openssl rand -hex 32)",
                     auth_key_id(k), auth_key_bytes(k));
    }
    if (auth_n_admin(a) == 0)
        log_warn("API keys but no admin key: /metrics, /workers and role changes answer 401 "
                 "or 403 to everyone (add one with --admin-api-key or the key file's admin)");
    *out = a;
    return 0;
}

/* Context length and name from the model file. */
static int read_model_info(const char *path, int *n_ctx, char *name, size_t cap)
{
    char err[512];
    gguf_t *g = gguf_open(path, err, sizeof(err));
    if (!g) {
        log_error("cannot read the model: %s", err);
        return -1;
    }
    char arch[64] = "llama", key[96];
    gguf_get_str_copy(g, "general.architecture", arch, sizeof(arch));
    snprintf(key, sizeof(key), "%s.context_length", arch);
    uint32_t ctx = 0;
    int rc = 0;
    if (gguf_get_u32(g, key, &ctx) != 0 || ctx < 2 || ctx > (uint32_t)MODEL_MAX_CTX) {
        log_error("%s: %s is missing or out of range", path, key);
        rc = -1;
    }
    *n_ctx = (int)ctx;
    if (gguf_get_str_copy(g, "general.name", name, cap) != 0 || !name[0])
        snprintf(name, cap, "tidepool");
    gguf_close(&g);
    return rc;
}

/* Read --curve-secret-key and --curve-authorized-keys (both or none) into *kp and *auth
 * (NULL: plain). Returns 0, or -1 (logged, naming the file and the problem). */
static int load_curve(curve_keypair *kp, curve_authlist_t **auth)
{
    memset(kp, 0, sizeof(*kp));
    *auth = NULL;
    int has_key = opt_curve_secret_key[0] != 0, has_auth = opt_curve_authorized_keys[0] != 0;
    if (!has_key && !has_auth)
        return 0;
    if (!has_key || !has_auth) {
        log_error("CURVE needs both --curve-secret-key and --curve-authorized-keys");
        return -1;
    }
    char err[512];
    if (curve_key_load(opt_curve_secret_key, 1, kp, err, sizeof(err)) < 0 ||
        !(*auth = curve_authlist_load(opt_curve_authorized_keys, err, sizeof(err)))) {
        log_error("CURVE: %s", err);
        memset(kp, 0, sizeof(*kp));
        return -1;
    }
    log_info("CURVE on the ctl socket: public key %s, %zu worker keys admitted",
             kp->public_z85, curve_authlist_count(*auth));
    return 0;
}

int main(int argc, char **argv)
{
    int rc = config_load(settings, "gateway", argc, argv);
    if (rc != 0)
        return rc > 0 ? 0 : 2;
    log_level_t level;
    if (log_level_parse(opt_log_level, &level) < 0) {
        fprintf(stderr, "invalid value '%s' for log-level: want debug, info, warn or error\n",
                opt_log_level);
        config_free(settings);
        return 2;
    }
    cluster_routing_t routing;
    if (cluster_routing_parse(opt_routing, &routing) < 0) {
        fprintf(stderr, "invalid value '%s' for routing: want cache-aware or least-loaded\n",
                opt_routing);
        config_free(settings);
        return 2;
    }
    if (opt_responses_store && !opt_state_db[0]) {
        fprintf(stderr, "--responses-store needs a --state-db (it is \"\")\n");
        config_free(settings);
        return 2;
    }
    log_init("gateway", level);
    config_log(settings);
    signal(SIGPIPE, SIG_IGN);
    curve_keypair curve;
    curve_authlist_t *curve_auth = NULL;
    if (load_curve(&curve, &curve_auth) < 0) {
        config_free(settings);
        return 2;
    }
    if (opt_stats_authorized_keys[0] && !curve_auth) {
        log_error("--stats-authorized-keys needs CURVE (--curve-secret-key and "
                  "--curve-authorized-keys)");
        config_free(settings);
        return 2;
    }

    int exit_code = 1;
    app_t app = {0};
    tokenizer_t *tok = NULL;
    cluster_t *cluster = NULL;
    stats_t *stats = NULL;
    statpub_t *pub = NULL;
    batch_t *batch = NULL;
    auth_t *auth = NULL;
    struct event *sigterm = NULL, *sigint = NULL;
    char err[512], name[128];
    int n_ctx;

    if (load_keys(&auth) < 0)
        goto out;
    if (read_model_info(opt_model, &n_ctx, name, sizeof(name)) < 0)
        goto out;
    tok = tokenizer_load(opt_model, err, sizeof(err));
    if (!tok) {
        log_error("cannot load the tokenizer: %s", err);
        goto out;
    }
    uint64_t fingerprint = read_model_fingerprint(opt_model);
    if (!fingerprint)
        goto out;
    const char *served = opt_served_name && opt_served_name[0] ? opt_served_name : name;
    log_info("model %s: '%s', context %d tokens, vocabulary %d, fingerprint %016llx", opt_model,
             served, n_ctx, tokenizer_vocab_size(tok), (unsigned long long)fingerprint);

    /* One descriptor per client connection: take the hard limit rather than the usual
     * soft 1024, so that load is refused by --max-queue, not by accept() failing. */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        (long long)rl.rlim_cur < opt_max_connections + 256)
        log_warn("the descriptor limit (%llu) is below --max-connections (%lld) + 256: "
                 "accept() will fail first (the gateway then pauses accepting)",
                 (unsigned long long)rl.rlim_cur, opt_max_connections);

    app.base = event_base_new();
    if (!app.base) {
        log_error("cannot create the event loop");
        goto out;
    }
    http_params hp = {
        .host = opt_host,
        .port = (int)opt_port,
        .max_body_bytes = (size_t)opt_max_body,
        .timeout_s = (int)opt_http_timeout_s,
        .sse_keepalive_s = (int)opt_sse_keepalive_s,
        .max_connections = (int)opt_max_connections,
        .header_timeout_s = (int)opt_header_timeout_s,
        .body_timeout_s = (int)opt_body_timeout_s,
        .body_min_rate = opt_body_min_rate > 0 ? (int)opt_body_min_rate : -1,
        .max_unsent_bytes = (size_t)opt_max_unsent,
        .max_upload_bytes = opt_state_db[0] ? (size_t)opt_batch_max_file_bytes : 0,
        .model_name = served,
        .n_ctx = n_ctx,
        .tok = tok,
        .responses_store = opt_responses_store,
    };
    app.http = http_server_new(app.base, &hp, err, sizeof(err));
    if (!app.http) {
        log_error("%s", err);
        goto out;
    }
    stats_params sp = stats_default_params();
    sp.model_name = served;
    sp.window_s = (int)opt_stats_window_s;
    stats = stats_new(&sp);
    if (!stats) {
        log_error("out of memory");
        goto out;
    }
    http_server_set_stats(app.http, stats);
    http_server_set_auth(app.http, auth);
    log_info("API keys: %s", auth ? "required on /v1/ (admin keys: /metrics, /workers, roles)"
                                  : "none (open to every caller)");
    cluster_params cp = cluster_default_params();
    cp.ctl_bind = opt_ctl_bind;
    cp.heartbeat_ms = (int)opt_hb_ms;
    cp.dead_after_ms = (int)opt_dead_ms;
    cp.request_timeout_ms = (int)opt_timeout_ms;
    cp.max_retries = (int)opt_retries;
    cp.routing = routing;
    cp.routing_load_weight = opt_routing_load_weight;
    cp.max_queue = (int)opt_max_queue;
    cp.policy.offline_max_wait_ms = (int64_t)(opt_offline_max_wait_s * 1000);
    cp.policy.offline_target = opt_offline_target;
    cp.policy.preempt_pressure = opt_preempt_pressure;
    cp.policy.smooth_ms = (int64_t)(opt_smooth_s * 1000);
    cp.policy.ttft_slo_ms = opt_ttft_slo_ms;
    cp.policy.tpot_slo_ms = opt_tpot_slo_ms;
    cp.policy.prefill_tokens_per_s = opt_prefill_tok_s;
    cp.policy.decode_tokens_per_s = opt_decode_tok_s;
    cp.policy.min_role_ms = (int64_t)(opt_tidal_min_role_s * 1000);
    cp.policy.max_changes = (int)opt_tidal_max_changes;
    cp.policy.min_per_role = (int)opt_tidal_min_per_role;
    cp.tidal = opt_tidal;
    cp.model_fingerprint = fingerprint;
    cp.n_vocab = tokenizer_vocab_size(tok);
    cp.kv_block_size = (int)opt_kv_block_size;
    if (policy_params_check(&cp.policy, err, sizeof(err)) < 0) {
        log_error("%s", err);
        goto out;
    }
    cp.curve = curve_auth ? &curve : NULL;
    cp.curve_auth = curve_auth;
    curve_auth = NULL; /* the cluster's now */
    cluster = cluster_new(app.base, &cp, completion_callbacks(), err, sizeof(err));
    if (!cluster) {
        log_error("%s", err);
        goto out;
    }
    http_server_set_cluster(app.http, cluster);
    if (opt_state_db[0]) {
        batch_params bp = batch_default_params();
        bp.state_db = opt_state_db;
        bp.max_file_bytes = (size_t)opt_batch_max_file_bytes;
        bp.max_lines = (int)opt_batch_max_lines;
        bp.max_inflight = (int)opt_batch_max_inflight;
        bp.max_body_bytes = (size_t)opt_max_body;
        bp.model_name = served;
        bp.n_ctx = n_ctx;
        bp.tok = tok;
        batch = batch_new(app.base, &bp, err, sizeof(err));
        if (!batch) {
            log_error("%s", err);
            goto out;
        }
        batch_set_stats(batch, stats);
        batch_set_cluster(batch, cluster);
        http_server_set_batch(app.http, batch);
        log_info("Batch API state in %s", opt_state_db);
    }
    cluster_set_observer(cluster, stats_on_cluster_event, stats);
    cluster_set_latency_source(cluster, online_p90, stats);
    if (opt_stats_bind && opt_stats_bind[0]) {
        statpub_params pp = statpub_default_params();
        pp.bind = opt_stats_bind;
        pp.interval_ms = (int)opt_stats_interval_ms;
        pp.stall_ms = (int)opt_stats_stall_ms;
        pp.model_name = served;
        if (curve.secret_z85[0]) { /* encrypted like the ctl socket, never plain beside it */
            const char *path =
                opt_stats_authorized_keys[0] ? opt_stats_authorized_keys : opt_curve_authorized_keys;
            pp.curve = &curve;
            pp.curve_auth = curve_authlist_load(path, err, sizeof(err));
            if (!pp.curve_auth) {
                log_error("CURVE (--stats-authorized-keys): %s", err);
                goto out;
            }
            log_info("CURVE on the stats socket: %zu subscriber keys admitted (%s)",
                     curve_authlist_count(pp.curve_auth), path);
        }
        pub = statpub_new(app.base, &pp, stats, cluster, err, sizeof(err));
        /* dashboards are not worth refusing to serve for: go on without the socket */
        if (!pub)
            log_error("%s: the stats socket is off (GET /metrics still works)", err);
        else
            log_info("stats socket bound at %s (every %lld ms)", statpub_endpoint(pub),
                     opt_stats_interval_ms);
    }

    sigterm = evsignal_new(app.base, SIGTERM, on_signal, &app);
    sigint = evsignal_new(app.base, SIGINT, on_signal, &app);
    if (!sigterm || !sigint || event_add(sigterm, NULL) < 0 || event_add(sigint, NULL) < 0) {
        log_error("cannot install signal handlers");
        goto out;
    }
    log_info("ctl socket bound at %s", opt_ctl_bind);
    log_info("listening on http://%s:%d", opt_host, http_server_port(app.http));
    event_base_dispatch(app.base);
    log_info("stopping");
    exit_code = 0;

out:
    /* The publisher first (it reads the cluster), then the cluster: it fails what is left,
     * which answers those clients. */
    statpub_destroy(&pub);
    if (cluster)
        cluster_set_observer(cluster, NULL, NULL);
    if (batch) /* its lines in flight stay unfinished (resumed at the next start) */
        batch_set_cluster(batch, NULL);
    if (app.http) /* requests during the flush below get 503, not the freed cluster */
        http_server_set_cluster(app.http, NULL);
    cluster_destroy(&cluster);
    if (app.base && app.http) {
        struct timeval flush = {0, 200 * 1000}; /* let those answers go out */
        event_base_loopexit(app.base, &flush);
        event_base_dispatch(app.base);
    }
    if (app.http)
        http_server_set_batch(app.http, NULL);
    batch_destroy(&batch);
    http_server_destroy(&app.http);
    stats_destroy(&stats);
    if (app.drain_ev)
        event_free(app.drain_ev);
    if (sigterm)
        event_free(sigterm);
    if (sigint)
        event_free(sigint);
    if (app.base)
        event_base_free(app.base);
    tokenizer_destroy(&tok);
    auth_destroy(&auth);
    curve_authlist_destroy(&curve_auth);
    memset(&curve, 0, sizeof(curve)); /* the secret key */
    config_free(settings);
    return exit_code;
}
