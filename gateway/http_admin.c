/* http_admin: the operators' and the models' endpoints of the HTTP server (http.h):
 * GET /health, GET /workers, POST /workers/{id}/role, GET /metrics (prometheus.h) and
 * GET /v1/models[/{id}]. Each reads the cluster and the stats when asked and answers at
 * once with one JSON (or Prometheus text) body; none keeps state of its own. */
#include <event2/buffer.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_internal.h"
#include "metrics.h"
#include "prometheus.h"
#include "protocol.h"

void http_admin_health(http_server_t *s, struct evhttp_request *req)
{
    char reason[160] = "";
    int ok = s->cx.cluster && cluster_ready(s->cx.cluster, reason, sizeof(reason));
    cluster_stats st = {0};
    if (s->cx.cluster)
        cluster_get_stats(s->cx.cluster, &st);
    else
        snprintf(reason, sizeof(reason), "starting");
    json_t *root = json_pack("{s:s, s:s, s:{s:i, s:i, s:i, s:i}, s:i, s:i}", "status",
                             ok ? "ok" : "unavailable", "model", s->model, "workers", "prefill",
                             st.n_prefill, "decode", st.n_decode, "mixed", st.n_mixed, "draining",
                             st.n_draining, "queued", st.n_queued, "running", st.n_running);
    if (root && !ok)
        json_object_set_new(root, "reason", json_string(reason));
    char *body = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    http_reply_json(req, ok ? 200 : 503, body ? body : "{\"status\":\"unavailable\"}");
    free(body);
}

static void add_worker_json(const cluster_worker_info *w, void *ud)
{
    json_t *o = json_pack(
        "{s:s, s:s, s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:I}", "id", w->id, "role",
        proto_role_str(w->role), "state", w->state == PROTO_STATE_READY ? "ready" : "draining",
        "kv_endpoint", w->kv_endpoint, "pid", w->pid, "kv_blocks_total", w->kv_blocks_total,
        "kv_blocks_free", w->kv_blocks_free, "running", w->running, "queued", w->queued,
        "queued_prompt_tokens", w->queued_prompt_tokens, "assigned", w->n_assigned,
        "last_seen_ms_ago", (json_int_t)(w->last_seen_ms_ago + 0.5));
    if (o) { /* prompt tokens looked up in the worker's prefix cache, and found there */
        json_object_set_new(o, "prefix_cache_queries",
                            json_integer((json_int_t)w->prefix_cache_queries));
        json_object_set_new(o, "prefix_cache_hits", json_integer((json_int_t)w->prefix_cache_hits));
    }
    if (o && w->state == PROTO_STATE_CHANGING)
        json_object_set_new(o, "state", json_string("changing"));
    if (o && w->changing)
        json_object_set_new(o, "target_role", json_string(proto_role_str(w->target_role)));
    if (o && w->emulated)
        json_object_set_new(o, "emulated", json_true());
    if (o && w->n_role_changes) {
        json_object_set_new(o, "role_changes", json_integer((json_int_t)w->n_role_changes));
        json_object_set_new(o, "last_role_change_ms", json_real(w->role_change_ms));
    }
    if (o && (w->mig.n_out || w->mig.n_out_failed || w->mig.n_in)) {
        json_object_set_new(o, "migrated_out", json_integer((json_int_t)w->mig.n_out));
        json_object_set_new(o, "migrations_failed", json_integer((json_int_t)w->mig.n_out_failed));
        json_object_set_new(o, "migrated_in", json_integer((json_int_t)w->mig.n_in));
        json_object_set_new(
            o, "migration_ms_mean",
            json_real(w->mig.n_out ? (double)w->mig.out_us / 1000.0 / (double)w->mig.n_out : 0.0));
    }
    if (o && (w->role != PROTO_ROLE_PREFILL || w->n_preemptions))
        json_object_set_new(o, "num_preemptions", json_integer((json_int_t)w->n_preemptions));
    /* KV transfers sent and failed (rejected, timed out, aborted): a sender that cannot
     * reach its decode workers (one that does not list its CURVE key, say) shows here */
    const proto_kvx_counters *k = &w->kvx_tx;
    uint64_t kv_failed = k->n_rejected + k->n_timeouts + k->n_aborted;
    if (o && (k->n_ok || kv_failed)) {
        json_object_set_new(o, "kv_sent", json_integer((json_int_t)k->n_ok));
        json_object_set_new(o, "kv_send_failed", json_integer((json_int_t)kv_failed));
    }
    if (o)
        json_array_append_new((json_t *)ud, o);
}

/* POST /workers/{id}/role {"role": "prefill" | "decode"}: order a live role change
 * (operators; docs/scheduler.md "Live role changes"). 202 when ordered; 404 unknown
 * worker; 409 refused (the last worker of its role, mixed, already changing); 400 bad body. */
void http_admin_worker_role(http_server_t *s, struct evhttp_request *req, const char *id)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    if (len > s->cx.max_body) {
        http_reply_error_msg(req, 413, "invalid_request_error", NULL, "request_too_large",
                             "request body too large");
        return;
    }
    const char *body = len ? (const char *)evbuffer_pullup(in, (ev_ssize_t)len) : "";
    json_error_t jerr;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
    if (!root) { /* as api_parse: not JSON, bad UTF-8 or a key given twice */
        char msg[300];
        snprintf(msg, sizeof(msg),
                 "We could not parse the JSON body of your request (%s at line %d, column %d).",
                 jerr.text, jerr.line, jerr.column);
        http_reply_error_msg(req, 400, "invalid_request_error", NULL, "invalid_json", msg);
        return;
    }
    json_t *jr = json_is_object(root) ? json_object_get(root, "role") : NULL;
    const char *rs = json_is_string(jr) ? json_string_value(jr) : NULL;
    proto_role_t role; /* proto_role_parse takes NULL (no "role" string): -1 */
    int bad = proto_role_parse(rs, &role) < 0 || role == PROTO_ROLE_MIXED;
    json_decref(root); /* rs is gone with it */
    if (bad) {
        http_reply_error_msg(req, 400, "invalid_request_error", "role", "invalid_role",
                             "The body must be {\"role\": \"prefill\"} or {\"role\": \"decode\"}.");
        return;
    }
    char err[256];
    int rc = s->cx.cluster
                 ? cluster_set_role(s->cx.cluster, id, role, "the operator", err, sizeof(err))
                 : -1;
    if (!s->cx.cluster)
        snprintf(err, sizeof(err), "no worker '%.100s'", id);
    if (rc == -1) {
        http_reply_error_msg(req, 404, "invalid_request_error", NULL, "worker_not_found", err);
    } else if (rc == -2) {
        http_reply_error_msg(req, 409, "invalid_request_error", "role", "role_change_refused", err);
    } else if (rc < 0) {
        http_reply_error_msg(req, 400, "invalid_request_error", "role", "invalid_role", err);
    } else {
        json_t *o = json_pack("{s:s, s:s, s:s}", "id", id, "role", proto_role_str(role), "status",
                              "changing");
        char *out = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
        http_reply_json(req, 202, out ? out : "{\"status\":\"changing\"}");
        free(out);
    }
}

static void add_refused_json(const cluster_refused_info *w, void *ud)
{
    json_t *o = json_pack("{s:s, s:s, s:s, s:i, s:s, s:I, s:I}", "id", w->id, "role",
                          proto_role_str(w->role), "state", "refused", "pid", w->pid, "reason",
                          w->reason, "refused", (json_int_t)w->n_refused, "last_seen_ms_ago",
                          (json_int_t)(w->last_ms_ago + 0.5));
    if (o)
        json_array_append_new((json_t *)ud, o);
}

/* GET /workers: every alive worker with its last reported load figures, and the workers
 * refused at registration (operators). */
void http_admin_workers(http_server_t *s, struct evhttp_request *req)
{
    json_t *arr = json_array(), *refused = json_array();
    if (arr && refused && s->cx.cluster) {
        cluster_foreach_worker(s->cx.cluster, add_worker_json, arr);
        cluster_foreach_refused(s->cx.cluster, add_refused_json, refused);
    }
    json_t *root = NULL;
    if (arr && refused) { /* "o" steals both, on failure too (jansson >= 2.11) */
        root = json_pack("{s:o, s:o}", "workers", arr, "refused", refused);
    } else {
        json_decref(arr);
        json_decref(refused);
    }
    char *body = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    http_reply_json(req, body ? 200 : 500, body ? body : "{\"workers\":[]}");
    free(body);
}

/* GET /metrics: the stats in the Prometheus text format. */
void http_admin_metrics(http_server_t *s, struct evhttp_request *req)
{
    if (!s->cx.stats) {
        http_reply_error_msg(req, 503, "server_error", NULL, "not_ready",
                             "metrics are not enabled");
        return;
    }
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) {
        http_reply_error_msg(req, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    prometheus_write(s->cx.stats, s->cx.cluster, f);
    int bad = ferror(f);
    fclose(f);
    struct evbuffer *b = evbuffer_new();
    if (bad || !b || evbuffer_add(b, text, len) < 0) {
        http_reply_error_msg(req, 500, "server_error", NULL, NULL, "out of memory");
    } else {
        evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
                          METRICS_CONTENT_TYPE);
        evhttp_send_reply(req, 200, "OK", b);
    }
    if (b)
        evbuffer_free(b);
    free(text);
}

void http_admin_models(http_server_t *s, struct evhttp_request *req, const char *which)
{
    if (which) { /* GET /v1/models/{id} */
        if (strcmp(which, s->model) != 0) {
            api_error e;
            api_error_set(&e, 404, "invalid_request_error", "model", "model_not_found",
                          "The model '%.200s' does not exist.", which);
            http_reply_error(req, &e);
            return;
        }
        json_t *m =
            json_pack("{s:s, s:s, s:I, s:s, s:i}", "id", s->model, "object", "model", "created",
                      (json_int_t)s->started, "owned_by", "tidepool", "max_model_len", s->cx.n_ctx);
        char *body = m ? json_dumps(m, JSON_COMPACT) : NULL;
        json_decref(m);
        http_reply_json(req, 200, body);
        free(body);
        return;
    }
    char *body = api_format_models(s->model, s->started, s->cx.n_ctx);
    http_reply_json(req, 200, body);
    free(body);
}
