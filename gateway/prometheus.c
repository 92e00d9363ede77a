/* prometheus: see prometheus.h.
 *
 * The cluster's workers are walked once into a scratch array (their figures copied, so
 * the families that follow see one consistent view), then the text is written family by
 * family: the gateway's own, then the workers'. */
#include "prometheus.h"

#include <stdlib.h>

#include "metrics.h"
#include "protocol.h"

typedef struct {
    char id[PROTO_ID_LEN];
    int role, state;
    cluster_worker_info info; /* strings not valid: use id */
} winfo;

typedef struct {
    winfo *v;
    int n, cap;
} winfo_list;

static void collect(const cluster_worker_info *wi, void *ud)
{
    winfo_list *l = ud;
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 16;
        winfo *v = realloc(l->v, (size_t)cap * sizeof(*v));
        if (!v)
            return;
        l->v = v;
        l->cap = cap;
    }
    winfo *w = &l->v[l->n++];
    snprintf(w->id, sizeof(w->id), "%s", wi->id);
    w->role = wi->role;
    w->state = wi->state;
    w->info = *wi;
    w->info.id = NULL;
    w->info.kv_endpoint = NULL;
}

#define NAME(buf, suffix) snprintf(buf, sizeof(buf), PROMETHEUS_PREFIX "%s", suffix)

/* A family of one gateway-level sample (label model_name). */
static void write_one(FILE *f, const stats_t *s, const char *name, const char *type,
                      const char *help, double v)
{
    char full[128];
    NAME(full, name);
    metrics_label l = {"model_name", stats_model_name(s)};
    metrics_write_header(f, full, type, help);
    metrics_write_sample(f, full, NULL, &l, 1, v);
}

typedef enum {
    W_RUNNING,
    W_QUEUED,
    W_QTOK,
    W_KV_USAGE,
    W_TOK_IN,
    W_TOK_OUT,
    W_SPEC_DRAFTS,
    W_SPEC_DRAFT_TOKENS,
    W_SPEC_ACCEPTED,
    W_PC_QUERIES,
    W_PC_HITS,
    W_PREEMPTIONS,
} wfield_t;

static double wvalue(const cluster_worker_info *w, wfield_t f)
{
    switch (f) {
    case W_RUNNING:
        return w->running;
    case W_QUEUED:
        return w->queued;
    case W_QTOK:
        return w->queued_prompt_tokens;
    case W_KV_USAGE:
        return w->kv_blocks_total > 0
                   ? (double)(w->kv_blocks_total - w->kv_blocks_free) / w->kv_blocks_total
                   : 0.0;
    case W_TOK_IN:
        return (double)w->tokens_in;
    case W_TOK_OUT:
        return (double)w->tokens_out;
    case W_SPEC_DRAFTS:
        return (double)w->spec.n_drafts;
    case W_SPEC_DRAFT_TOKENS:
        return (double)w->spec.n_draft_tokens;
    case W_SPEC_ACCEPTED:
        return (double)w->spec.n_accepted_tokens;
    case W_PC_QUERIES:
        return (double)w->prefix_cache_queries;
    case W_PC_HITS:
        return (double)w->prefix_cache_hits;
    case W_PREEMPTIONS:
        return (double)w->n_preemptions;
    }
    return 0;
}

static int decodes(int role)
{
    return role == PROTO_ROLE_DECODE || role == PROTO_ROLE_MIXED;
}

/* A per-worker family (labels model_name, worker, role); spec families only for workers
 * that decode. */
static void write_per_worker(FILE *f, const stats_t *s, const winfo_list *l, const char *name,
                             const char *type, const char *help, wfield_t field, int spec)
{
    char full[128];
    NAME(full, name);
    metrics_write_header(f, full, type, help);
    for (int i = 0; i < l->n; i++) {
        const winfo *w = &l->v[i];
        if (spec && !decodes(w->role))
            continue;
        metrics_label lb[3] = {{"model_name", stats_model_name(s)},
                               {"worker", w->id},
                               {"role", proto_role_str(w->role)}};
        metrics_write_sample(f, full, NULL, lb, 3, wvalue(&w->info, field));
    }
}

static void write_kvx(FILE *f, const stats_t *s, const winfo_list *l)
{
    static const char *results[] = {"ok", "rejected", "timeout", "aborted", "cancelled"};
    char transfers[128], bytes[128], secs[128];
    NAME(transfers, "kv_transfers_total");
    NAME(bytes, "worker_kv_transfer_bytes_total");
    NAME(secs, "worker_kv_transfer_seconds_total");
    for (int fam = 0; fam < 3; fam++) {
        const char *name = fam == 0 ? transfers : fam == 1 ? bytes : secs;
        metrics_write_header(
            f, name, "counter",
            fam == 0 ? "KV transfers that ended, by side (send: prefill, recv: decode) and result."
            : fam == 1 ? "KV payload bytes of completed transfers, by side."
                       : "Time spent in completed KV transfers, by side (each side's clock).");
        for (int i = 0; i < l->n; i++) {
            const winfo *w = &l->v[i];
            for (int side = 0; side < 2; side++) {
                if (side == 0 && w->role == PROTO_ROLE_DECODE && !w->info.kvx_tx.n_ok &&
                    !w->info.kvx_tx.n_rejected && !w->info.kvx_tx.n_timeouts &&
                    !w->info.kvx_tx.n_aborted && !w->info.kvx_tx.n_cancelled)
                    continue; /* a decode worker only receives, unless it migrated */
                if (side == 1 && w->role == PROTO_ROLE_PREFILL)
                    continue; /* a prefill worker only sends */
                const proto_kvx_counters *k = side == 0 ? &w->info.kvx_tx : &w->info.kvx_rx;
                metrics_label lb[5] = {{"model_name", stats_model_name(s)},
                                       {"worker", w->id},
                                       {"role", proto_role_str(w->role)},
                                       {"side", side == 0 ? "send" : "recv"},
                                       {"result", NULL}};
                if (fam == 1) {
                    metrics_write_sample(f, name, NULL, lb, 4, (double)k->n_bytes);
                } else if (fam == 2) {
                    metrics_write_sample(f, name, NULL, lb, 4, (double)k->total_us / 1e6);
                } else {
                    const uint64_t v[5] = {k->n_ok, k->n_rejected, k->n_timeouts, k->n_aborted,
                                           k->n_cancelled};
                    for (int r = 0; r < 5; r++) {
                        lb[4].value = results[r];
                        metrics_write_sample(f, name, NULL, lb, 5, (double)v[r]);
                    }
                }
            }
        }
    }
}

/* Role changes (the gateway's count and latest latency) and live migrations per worker
 * (docs/scheduler.md "Live role changes"). */
static void write_roles(FILE *f, const stats_t *s, const cluster_t *c, const winfo_list *l)
{
    cluster_stats cs = {0};
    if (c)
        cluster_get_stats(c, &cs);
    write_one(f, s, "role_changes_total", "counter",
              "Worker role changes completed (ordered -> registered in the new role).",
              (double)cs.n_role_changes);
    write_one(f, s, "role_change_last_seconds", "gauge",
              "Duration of the latest role change, ordered -> registered in the new role.",
              cs.last_role_change_ms / 1000.0);
    char full[128];
    NAME(full, "worker_migrations_total");
    metrics_write_header(f, full, "counter",
                         "Running sequences moved between decode workers (live migration), by "
                         "direction and result, as of the worker's last heartbeat.");
    for (int i = 0; i < l->n; i++) {
        const proto_mig_counters *m = &l->v[i].info.mig;
        if (!decodes(l->v[i].role) && !m->n_out && !m->n_out_failed && !m->n_in)
            continue;
        const struct {
            const char *dir, *result;
            uint64_t n;
        } v[3] = {
            {"out", "ok", m->n_out}, {"out", "failed", m->n_out_failed}, {"in", "ok", m->n_in}};
        for (int k = 0; k < 3; k++) {
            metrics_label lb[5] = {{"model_name", stats_model_name(s)},
                                   {"worker", l->v[i].id},
                                   {"role", proto_role_str(l->v[i].role)},
                                   {"direction", v[k].dir},
                                   {"result", v[k].result}};
            metrics_write_sample(f, full, NULL, lb, 5, (double)v[k].n);
        }
    }
}

void prometheus_write(const stats_t *s, const cluster_t *c, FILE *f)
{
    winfo_list l = {0};
    if (c)
        cluster_foreach_worker(c, collect, &l);
    stats_gateway_figures g;
    stats_get_gateway(s, c, &g);
    char full[128];
    metrics_label ml = {"model_name", stats_model_name(s)};

    // gateway
    write_one(f, s, "num_requests_running", "gauge",
              "Number of requests assigned to workers (prefilling, transferring or decoding).",
              g.running);
    write_one(f, s, "num_requests_waiting", "gauge",
              "Number of requests waiting in the gateway's queue for workers.", g.queued);
    write_one(f, s, "prompt_tokens_total", "counter",
              "Number of prompt tokens of the requests answered (usage.prompt_tokens).",
              (double)g.prompt_tokens);
    write_one(f, s, "generation_tokens_total", "counter",
              "Number of generated tokens of the requests answered (usage.completion_tokens).",
              (double)g.generation_tokens);
    NAME(full, "request_success_total");
    metrics_write_header(f, full, "counter",
                         "Count of successfully processed requests, by finish reason (abort: "
                         "the client went away).");
    const struct {
        const char *reason;
        uint64_t n;
    } fin[] = {{"stop", g.finished_stop}, {"length", g.finished_length}, {"abort", g.cancelled}};
    for (int i = 0; i < 3; i++) {
        metrics_label lb[2] = {ml, {"finished_reason", fin[i].reason}};
        metrics_write_sample(f, full, NULL, lb, 2, (double)fin[i].n);
    }
    write_one(f, s, "num_offline_requests_waiting", "gauge",
              "Offline requests (service_tier flex, batch lines) waiting in the gateway's "
              "offline queue.",
              g.offline_queued);
    write_one(f, s, "num_offline_requests_running", "gauge",
              "Offline requests assigned to workers (within the tidal policy's admission).",
              g.offline_running);
    write_one(f, s, "offline_generation_tokens_total", "counter",
              "Generated tokens of the offline requests answered (flex requests, batch lines).",
              (double)g.offline_generation_tokens);
    write_one(f, s, "offline_preemptions_total", "counter",
              "Offline requests preempted (cancelled on their workers and re-queued) because "
              "online load rose.",
              (double)g.offline_preemptions);
    write_one(f, s, "requests_received_total", "counter",
              "Completion requests received (POST /v1/completions, /v1/chat/completions).",
              (double)g.received);
    write_one(f, s, "request_failure_total", "counter",
              "Completion requests answered with an error, before or after admission.",
              (double)g.failed_total);
    NAME(full, "http_responses_total");
    metrics_write_header(f, full, "counter", "HTTP responses sent, by status code.");
    for (int st = 100; st < 600; st++) {
        uint64_t n = stats_http_responses(s, st);
        if (!n)
            continue;
        char code[8];
        snprintf(code, sizeof(code), "%d", st);
        metrics_label lb[2] = {ml, {"code", code}};
        metrics_write_sample(f, full, NULL, lb, 2, (double)n);
    }
    write_one(f, s, "http_connections", "gauge", "HTTP client connections open.",
              g.http_connections);
    write_one(f, s, "http_connections_refused_total", "counter",
              "HTTP connections refused because --max-connections were open (503).",
              (double)g.http_events[STATS_HTTP_REFUSED]);
    NAME(full, "http_request_timeouts_total");
    metrics_write_header(f, full, "counter",
                         "Requests that did not arrive in time (408), by the part that was late: "
                         "header (--http-header-timeout-s) or body (--http-body-timeout-s, "
                         "--http-body-min-rate).");
    const struct {
        const char *phase;
        uint64_t n;
    } late[] = {{"header", g.http_events[STATS_HTTP_HEADER_TIMEOUT]},
                {"body", g.http_events[STATS_HTTP_BODY_TIMEOUT]}};
    for (int i = 0; i < 2; i++) {
        metrics_label lb[2] = {ml, {"phase", late[i].phase}};
        metrics_write_sample(f, full, NULL, lb, 2, (double)late[i].n);
    }
    write_one(f, s, "http_slow_clients_total", "counter",
              "Streaming clients dropped because they fell more than --stream-max-unsent-bytes "
              "behind (their requests cancelled).",
              (double)g.http_events[STATS_HTTP_SLOW_CLIENT]);
    write_one(f, s, "gateway_start_time_seconds", "gauge",
              "Start time of the gateway, seconds since the epoch.",
              (double)g.started_wall_ms / 1000.0);
    const char *hname, *hhelp;
    const metrics_histogram *h;
    for (int i = 0; (h = stats_histogram(s, i, &hname, &hhelp)) != NULL; i++) {
        NAME(full, hname);
        metrics_write_header(f, full, "histogram", hhelp);
        metrics_write_histogram(f, full, &ml, 1, h);
    }

    // workers
    NAME(full, "workers");
    metrics_write_header(f, full, "gauge", "Alive workers by role and state.");
    for (int role = PROTO_ROLE_PREFILL; role <= PROTO_ROLE_MIXED; role++) {
        for (int st = PROTO_STATE_READY; st <= PROTO_STATE_CHANGING; st++) {
            int n = 0;
            for (int i = 0; i < l.n; i++)
                n += l.v[i].role == role && l.v[i].state == st;
            metrics_label lb[3] = {
                ml, {"role", proto_role_str(role)}, {"state", stats_state_str(st)}};
            metrics_write_sample(f, full, NULL, lb, 3, n);
        }
    }
    write_per_worker(f, s, &l, "kv_cache_usage_ratio", "gauge",
                     "KV-cache usage of the worker. 1 means 100 percent usage.", W_KV_USAGE, 0);
    write_per_worker(f, s, &l, "worker_num_requests_running", "gauge",
                     "Sequences the worker holds (prefilling, transferring or decoding), as "
                     "of its last heartbeat.",
                     W_RUNNING, 0);
    write_per_worker(f, s, &l, "worker_num_requests_waiting", "gauge",
                     "Requests queued at the worker for prefill, as of its last heartbeat.",
                     W_QUEUED, 0);
    write_per_worker(f, s, &l, "worker_queued_prompt_tokens", "gauge",
                     "Prompt tokens queued at the worker, as of its last heartbeat.", W_QTOK, 0);
    write_per_worker(f, s, &l, "worker_prompt_tokens_total", "counter",
                     "Prompt tokens the worker prefilled since it started.", W_TOK_IN, 0);
    write_per_worker(f, s, &l, "worker_generation_tokens_total", "counter",
                     "Tokens the worker generated since it started.", W_TOK_OUT, 0);
    write_per_worker(f, s, &l, "prefix_cache_queries_total", "counter",
                     "Prefix cache queries, in terms of number of queried tokens.", W_PC_QUERIES,
                     0);
    write_per_worker(f, s, &l, "prefix_cache_hits_total", "counter",
                     "Prefix cache hits, in terms of number of cached tokens.", W_PC_HITS, 0);
    write_per_worker(f, s, &l, "spec_decode_num_drafts_total", "counter",
                     "Number of spec decoding drafts.", W_SPEC_DRAFTS, 1);
    write_per_worker(f, s, &l, "spec_decode_num_draft_tokens_total", "counter",
                     "Number of draft tokens.", W_SPEC_DRAFT_TOKENS, 1);
    write_per_worker(f, s, &l, "spec_decode_num_accepted_tokens_total", "counter",
                     "Number of accepted tokens.", W_SPEC_ACCEPTED, 1);
    write_per_worker(f, s, &l, "num_preemptions_total", "counter",
                     "Cumulative number of preemptions: sequences a decode worker freed for KV "
                     "blocks, re-run by recomputation.",
                     W_PREEMPTIONS, 1);
    NAME(full, "spec_decode_num_accepted_tokens_per_pos_total");
    metrics_write_header(f, full, "counter", "Accepted tokens per draft position.");
    for (int i = 0; i < l.n; i++) {
        if (!decodes(l.v[i].role))
            continue;
        for (int pos = 0; pos < PROTO_SPEC_MAX_POS; pos++) {
            char p[8];
            snprintf(p, sizeof(p), "%d", pos);
            metrics_label lb[4] = {
                ml, {"worker", l.v[i].id}, {"role", proto_role_str(l.v[i].role)}, {"position", p}};
            metrics_write_sample(f, full, NULL, lb, 4,
                                 (double)l.v[i].info.spec.accepted_per_pos[pos]);
        }
    }
    cluster_stats cst = {0};
    if (c)
        cluster_get_stats(c, &cst);
    write_one(f, s, "workers_refused_total", "counter",
              "Worker processes refused at registration (another model or KV block size than "
              "the cluster's); GET /workers lists the latest.",
              (double)cst.n_refused);
    write_kvx(f, s, &l);
    write_roles(f, s, c, &l);
    free(l.v);
}
