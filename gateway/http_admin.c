/* http_admin: the operators' and the models' endpoints of the HTTP server (http.h):
 * GET /health, GET /workers, POST /workers/{id}/role, GET /metrics (prometheus.h) and
 * GET /v1/models[/{id}], POST /tokenize and POST /detokenize (vLLM's, with the served
 * tokenizer). Each reads the cluster and the stats when asked and answers at once with one
 * JSON (or Prometheus text) body; none keeps state of its own. */
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
#include "stream.h"

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
        json_object_set_new(o, "prefix_blocks_believed", json_integer(w->prefix_blocks_believed));
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
        http_send_reply(req, 200, b);
    }
    if (b)
        evbuffer_free(b);
    free(text);
}

static void max_mtp_depth(const cluster_worker_info *w, void *ud)
{
    int *d = ud;
    if ((w->role == PROTO_ROLE_DECODE || w->role == PROTO_ROLE_MIXED) && w->mtp_depth > *d)
        *d = w->mtp_depth;
}

/* The MTP depth the cluster serves: the largest of its decoding workers' (REGISTER "mtp"),
 * -1 when none reported one. */
static int served_mtp_depth(http_server_t *s)
{
    int d = -1;
    if (s->cx.cluster)
        cluster_foreach_worker(s->cx.cluster, max_mtp_depth, &d);
    return d;
}

void http_admin_models(http_server_t *s, struct evhttp_request *req, const char *which)
{
    if (which) { /* GET /v1/models/{id} (decoded by on_request) */
        if (strcmp(which, s->model) != 0) {
            api_error e;
            api_error_set(&e, 404, "invalid_request_error", "model", "model_not_found",
                          "The model '%.200s' does not exist.", which);
            http_reply_error(req, &e);
            return;
        }
        json_t *m = api_model_card(s->model, s->started, s->cx.n_ctx, served_mtp_depth(s));
        char *body = m ? json_dumps(m, JSON_COMPACT) : NULL;
        json_decref(m);
        http_reply_json(req, 200, body);
        free(body);
        return;
    }
    char *body = api_format_models(s->model, s->started, s->cx.n_ctx, served_mtp_depth(s));
    http_reply_json(req, 200, body);
    free(body);
}

// --- POST /tokenize, POST /detokenize (vLLM's shapes)

/* The body of req as a JSON object, or NULL after answering the error (413 over the
 * limit, 400 not JSON / not an object). */
static json_t *read_json_object(http_server_t *s, struct evhttp_request *req)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    api_error e;
    if (len > s->cx.max_body) {
        api_error_set(&e, 413, "invalid_request_error", NULL, "request_too_large",
                      "The request body is %zu bytes; the limit is %zu bytes.", len,
                      s->cx.max_body);
        http_reply_error(req, &e);
        return NULL;
    }
    const char *body = len ? (const char *)evbuffer_pullup(in, (ev_ssize_t)len) : "";
    if (!api_utf8_valid(body, len)) { /* the completion routes' check (api_parse) */
        api_error_set(&e, 400, "invalid_request_error", NULL, "invalid_encoding",
                      "The request body is not valid UTF-8.");
        http_reply_error(req, &e);
        return NULL;
    }
    json_error_t jerr;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
    if (!root) {
        api_error_set(&e, 400, "invalid_request_error", NULL, "invalid_json",
                      "We could not parse the JSON body of your request (%s at line %d, "
                      "column %d).",
                      jerr.text, jerr.line, jerr.column);
        http_reply_error(req, &e);
        return NULL;
    }
    if (!json_is_object(root)) {
        api_error_set(&e, 400, "invalid_request_error", NULL, "invalid_type",
                      "The request body must be a JSON object, got %s.", api_json_type_name(root));
        json_decref(root);
        http_reply_error(req, &e);
        return NULL;
    }
    return root;
}

/* A boolean field of root into *out (absent or null: unchanged). 0, or -1 with *e. */
static int bool_field(json_t *root, const char *key, int *out, api_error *e)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v))
        return 0;
    if (!json_is_boolean(v))
        return api_error_set(e, 400, "invalid_request_error", key, "invalid_type",
                             "Invalid type for '%s': expected a boolean, but got %s instead.",
                             key, api_json_type_name(v));
    *out = json_is_true(v);
    return 0;
}

/* The rendered prompt of a tokenize body: "prompt" (a string, as given) or "messages"
 * (the chat template of api_parse, its trailing generation prompt "assistant:" dropped
 * when add_generation_prompt is false). malloc'd text and its length, or NULL with *e. */
static char *tokenize_text(json_t *root, size_t *len, api_error *e)
{
    json_t *prompt = json_object_get(root, "prompt");
    json_t *msgs = json_object_get(root, "messages");
    if (prompt && json_is_null(prompt))
        prompt = NULL;
    if (msgs && json_is_null(msgs))
        msgs = NULL;
    if (!!prompt == !!msgs) {
        api_error_set(e, 400, "invalid_request_error", prompt ? "messages" : "prompt",
                      prompt ? "invalid_value" : "missing_required_parameter",
                      "Give exactly one of 'prompt' (a string) and 'messages'.");
        return NULL;
    }
    if (prompt) {
        if (!json_is_string(prompt)) {
            api_error_set(e, 400, "invalid_request_error", "prompt", "invalid_type",
                          "Invalid type for 'prompt': expected a string, but got %s instead.",
                          api_json_type_name(prompt));
            return NULL;
        }
        *len = json_string_length(prompt);
        if (memchr(json_string_value(prompt), 0, *len)) {
            api_error_set(e, 400, "invalid_request_error", "prompt", "invalid_value",
                          "'prompt' must not contain NUL characters.");
            return NULL;
        }
        char *t = malloc(*len + 1);
        if (!t) {
            api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
            return NULL;
        }
        memcpy(t, json_string_value(prompt), *len + 1);
        return t;
    }
    int gen_prompt = 1;
    if (bool_field(root, "add_generation_prompt", &gen_prompt, e))
        return NULL;
    /* the chat completion's own parser and template, so the ids are the ones it computes */
    json_t *only = json_pack("{s:O}", "messages", msgs);
    char *body = only ? json_dumps(only, JSON_COMPACT) : NULL;
    json_decref(only);
    if (!body) {
        api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return NULL;
    }
    api_request r;
    int rc = api_parse(API_CHAT, body, strlen(body), &r, e);
    free(body);
    if (rc)
        return NULL;
    char *t = r.prompt;
    *len = r.prompt_len;
    r.prompt = NULL;
    api_request_free(&r);
    static const char gen[] = "assistant:";
    if (!gen_prompt && *len >= sizeof(gen) - 1 &&
        memcmp(t + *len - (sizeof(gen) - 1), gen, sizeof(gen) - 1) == 0) {
        *len -= sizeof(gen) - 1;
        t[*len] = 0;
    }
    return t;
}

void http_admin_tokenize(http_server_t *s, struct evhttp_request *req)
{
    json_t *root = read_json_object(s, req);
    if (!root)
        return;
    api_error e;
    api_request mr = {0};
    json_t *model = json_object_get(root, "model");
    char *text = NULL;
    int *ids = NULL;
    int add_special = 1;
    if (model && !json_is_null(model) && !json_is_string(model)) {
        api_error_set(&e, 400, "invalid_request_error", "model", "invalid_type",
                      "Invalid type for 'model': expected a string, but got %s instead.",
                      api_json_type_name(model));
        goto fail;
    }
    mr.model = model && json_is_string(model) ? (char *)json_string_value(model) : NULL;
    if (api_check_model(&mr, s->model, &e) || bool_field(root, "add_special_tokens", &add_special, &e))
        goto fail;
    size_t len = 0;
    if (!(text = tokenize_text(root, &len, &e)))
        goto fail;
    int needed = 0, cap = (int)(len < 64 ? 64 : len + 2);
    ids = malloc((size_t)cap * sizeof(*ids));
    int n = ids ? tokenizer_encode(s->cx.tok, text, len, add_special, ids, cap, &needed) : -1;
    if (n < 0) {
        api_error_set(&e, 500, "server_error", NULL, NULL, "tokenizer failure (out of memory)");
        goto fail;
    }
    json_t *arr = json_array();
    for (int i = 0; arr && i < n; i++)
        if (json_array_append_new(arr, json_integer(ids[i])) < 0) {
            json_decref(arr);
            arr = NULL;
        }
    json_t *out = arr ? json_pack("{s:i, s:i, s:o, s:n}", "count", n, "max_model_len",
                                  s->cx.n_ctx, "tokens", arr, "token_strs")
                      : NULL;
    char *body = out ? json_dumps(out, JSON_COMPACT) : NULL;
    json_decref(out);
    if (!body) {
        api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
        goto fail;
    }
    http_reply_json(req, 200, body);
    free(body);
    free(ids);
    free(text);
    json_decref(root);
    return;
fail:
    http_reply_error(req, &e);
    free(ids);
    free(text);
    json_decref(root);
}

void http_admin_detokenize(http_server_t *s, struct evhttp_request *req)
{
    json_t *root = read_json_object(s, req);
    if (!root)
        return;
    api_error e;
    api_request mr = {0};
    char *text = NULL;
    size_t len = 0;
    json_t *model = json_object_get(root, "model");
    if (model && !json_is_null(model) && !json_is_string(model)) {
        api_error_set(&e, 400, "invalid_request_error", "model", "invalid_type",
                      "Invalid type for 'model': expected a string, but got %s instead.",
                      api_json_type_name(model));
        goto fail;
    }
    mr.model = model && json_is_string(model) ? (char *)json_string_value(model) : NULL;
    if (api_check_model(&mr, s->model, &e))
        goto fail;
    json_t *toks = json_object_get(root, "tokens");
    if (!toks || json_is_null(toks)) {
        api_error_set(&e, 400, "invalid_request_error", "tokens", "missing_required_parameter",
                      "Missing required parameter: 'tokens'.");
        goto fail;
    }
    if (!json_is_array(toks)) {
        api_error_set(&e, 400, "invalid_request_error", "tokens", "invalid_type",
                      "Invalid type for 'tokens': expected an array of token ids, but got %s "
                      "instead.",
                      api_json_type_name(toks));
        goto fail;
    }
    int vocab = tokenizer_vocab_size(s->cx.tok);
    size_t n_ids = json_array_size(toks), i;
    int *ids = malloc((n_ids ? n_ids : 1) * sizeof(*ids));
    if (!ids) {
        api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
        goto fail;
    }
    json_t *v;
    json_array_foreach(toks, i, v)
    {
        if (!json_is_integer(v) || json_integer_value(v) < 0 ||
            json_integer_value(v) >= vocab) {
            char got[32];
            if (json_is_integer(v))
                snprintf(got, sizeof(got), "%lld", (long long)json_integer_value(v));
            else
                snprintf(got, sizeof(got), "%s", api_json_type_name(v));
            api_error_set(&e, 400, "invalid_request_error", "tokens", "invalid_value",
                          "'tokens[%zu]' must be a token id in [0, %d), got %s.", i, vocab, got);
            free(ids);
            goto fail;
        }
        ids[i] = (int)json_integer_value(v);
    }
    /* the text a completion of these tokens streams (a character may span byte tokens) */
    text = stream_text_of(s->cx.tok, -1, ids, (int)n_ids, &len);
    free(ids);
    if (!text) {
        api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
        goto fail;
    }
    json_t *out = json_pack("{s:s%}", "prompt", text, len);
    char *body = out ? json_dumps(out, JSON_COMPACT) : NULL;
    json_decref(out);
    if (!body) {
        api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
        goto fail;
    }
    http_reply_json(req, 200, body);
    free(body);
    free(text);
    json_decref(root);
    return;
fail:
    http_reply_error(req, &e);
    free(text);
    json_decref(root);
}
