/* http: see http.h.
 *
 * Each admitted completion request has one gw_req, the sink of its completion
 * (completion.h), which owns it and frees it in exactly one place (req_free, the sink's
 * release) when the request ends: finished, failed, or abandoned by its client. A client
 * that goes away is noticed through the connection's close callback; libevent then has
 * detached (or is about to free) the evhttp_request, so from that moment the gw_req no
 * longer touches it, and the request is cancelled (completion_cancel). */
#include "http.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/listener.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>

#include "api.h"
#include "batch.h"
#include "completion.h"
#include "log.h"
#include "metrics.h"
#include "prometheus.h"
#include "protocol.h"

#define SLOW_CLIENT_BYTES (8u << 20) /* unsent SSE bytes before a client is dropped */

typedef struct gw_req {
    http_server_t *srv;
    struct evhttp_request *req; /* NULL once answered or the client is gone */
    struct evhttp_connection *conn;
    struct event *close_ev; /* non-streaming: watches the socket for EOF */
    completion_t *c;        /* the request; it owns this gw_req (completion_sink.release) */
} gw_req;

struct http_server {
    struct event_base *base;
    struct evhttp *http;
    struct evhttp_bound_socket *bound;
    char *host;
    char *model; /* cx.model is this */
    int port;
    completion_env cx;      /* tokenizer, limits, cluster (NULL: 503), stats (NULL: no figures) */
    batch_t *batch;         /* NULL: the Files and Batch API answer 503 */
    completion_list active; /* the completion requests in flight (ud: gw_req) */
    int64_t started;
};

// --- replies

static void reply_json(struct evhttp_request *req, int status, const char *body)
{
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Content-Type", "application/json");
    struct evbuffer *b = evbuffer_new();
    if (b && body)
        evbuffer_add(b, body, strlen(body));
    evhttp_send_reply(req, status, NULL, b);
    if (b)
        evbuffer_free(b);
}

static void reply_error(struct evhttp_request *req, const api_error *e)
{
    char *body = api_error_json(e);
    reply_json(req, e->status, body ? body : "{\"error\":{\"message\":\"out of memory\"}}");
    free(body);
}

static void reply_error_msg(struct evhttp_request *req, int status, const char *type,
                            const char *param, const char *code, const char *msg)
{
    api_error e;
    api_error_set(&e, status, type, param, code, "%s", msg);
    reply_error(req, &e);
}

static int64_t now_s(void)
{
    return (int64_t)time(NULL);
}

// --- per-request state: the completion's sink

/* The completion is gone (completion_sink.release): the one place a gw_req is freed. */
static void req_free(void *ud)
{
    gw_req *g = ud;
    if (g->conn && g->req)
        evhttp_connection_set_closecb(g->conn, NULL, NULL);
    if (g->close_ev)
        event_free(g->close_ev);
    free(g);
}

static void sse_send(gw_req *g, const char *payload)
{
    struct evbuffer *b = evbuffer_new();
    if (!b)
        return;
    evbuffer_add_printf(b, "data: %s\n\n", payload);
    evhttp_send_reply_chunk(g->req, b);
    evbuffer_free(b);
}

/* Streaming: one chunk of text. */
static void sink_text(void *ud, const completion_t *c, const char *text, size_t len)
{
    api_response_info info = completion_info(c);
    char *chunk = api_format_chunk(&info, text, len, NULL, 0);
    if (chunk)
        sse_send(ud, chunk);
    free(chunk);
}

/* Streaming: a client that reads slower than we generate has its answer ended here rather
 * than buffered without bound. */
static int sink_check(void *ud, const completion_t *c, api_error *e)
{
    gw_req *g = ud;
    if (!completion_streaming(c))
        return 0;
    struct bufferevent *bev = evhttp_connection_get_bufferevent(g->conn);
    if (!bev || evbuffer_get_length(bufferevent_get_output(bev)) <= SLOW_CLIENT_BYTES)
        return 0;
    log_rwarn(completion_rid(c), "client too slow (%u bytes unsent): request ended",
              SLOW_CLIENT_BYTES);
    api_error_set(e, 503, "server_error", NULL, "slow_client", "the client reads too slowly");
    return -1;
}

/* The end of the answer: the last chunks and [DONE], or the whole JSON body. Always 0: a
 * body that cannot be formatted is answered 500 but counted as finished, as it was. */
static int sink_done(void *ud, const completion_t *c, const char *finish_reason, api_error *e)
{
    gw_req *g = ud;
    (void)e;
    api_response_info info = completion_info(c);
    if (completion_streaming(c)) {
        char *chunk =
            api_format_chunk(&info, info.kind == API_CHAT ? NULL : "", 0, finish_reason, 0);
        if (chunk)
            sse_send(g, chunk);
        free(chunk);
        if (info.include_usage) {
            int n_prompt, n_completion;
            completion_usage(c, &n_prompt, &n_completion);
            chunk = api_format_usage_chunk(&info, n_prompt, n_completion);
            if (chunk)
                sse_send(g, chunk);
            free(chunk);
        }
        sse_send(g, "[DONE]");
        evhttp_connection_set_closecb(g->conn, NULL, NULL);
        evhttp_send_reply_end(g->req);
    } else {
        char *body = completion_format_response(c, finish_reason);
        evhttp_connection_set_closecb(g->conn, NULL, NULL);
        if (body)
            reply_json(g->req, 200, body);
        else
            reply_error_msg(g->req, 500, "server_error", NULL, NULL,
                            "could not format the response");
        free(body);
    }
    g->req = NULL;
    return 0;
}

static stats_end_t sink_fail(void *ud, const completion_t *c, const api_error *e)
{
    gw_req *g = ud;
    evhttp_connection_set_closecb(g->conn, NULL, NULL);
    if (completion_streaming(c)) {
        /* headers are out: report in the stream, then end it as usual */
        char *body = api_error_json(e);
        if (body)
            sse_send(g, body);
        free(body);
        sse_send(g, "[DONE]");
        evhttp_send_reply_end(g->req);
    } else {
        reply_error(g->req, e);
    }
    g->req = NULL;
    return STATS_END_FAILED;
}

static const completion_sink sink = {sink_text, sink_check, sink_done, sink_fail, req_free};

/* The client went away: cancel wherever the request is and forget it. */
static void on_close(struct evhttp_connection *conn, void *arg)
{
    gw_req *g = arg;
    (void)conn;
    log_rinfo(completion_rid(g->c), "client disconnected: cancelling");
    /* libevent detached the request (evcon == NULL) and leaves it to us, or it is still
     * attached and libevent frees it right after this callback. */
    if (g->req && evhttp_request_get_connection(g->req) == NULL)
        evhttp_request_free(g->req);
    g->req = NULL;
    completion_cancel(&g->c, 499, "client disconnected");
}

/* Non-streaming requests: libevent 2.1 does not read from a connection while its request
 * awaits the reply, so it would not notice the client leaving. We watch the socket
 * ourselves: readable with nothing to read (EOF) or an error means the client is gone;
 * data (a pipelined request) means it is not, and we stop watching. */
static void on_readable(evutil_socket_t fd, short what, void *arg)
{
    gw_req *g = arg;
    (void)what;
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0 || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))) {
        if (n < 0)
            event_add(g->close_ev, NULL);
        return;
    }
    /* Closing the connection runs on_close, which cancels and frees g. */
    evhttp_connection_free(g->conn);
}

static void watch_close(gw_req *g)
{
    struct bufferevent *bev = evhttp_connection_get_bufferevent(g->conn);
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    if (fd < 0)
        return;
    g->close_ev = event_new(g->srv->base, fd, EV_READ, on_readable, g);
    if (g->close_ev)
        event_add(g->close_ev, NULL);
}

// --- handlers

static void handle_completion(http_server_t *s, struct evhttp_request *req, api_kind_t kind)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    api_error e;
    gw_req *g = calloc(1, sizeof(*g));
    if (!g) {
        reply_error_msg(req, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    g->srv = s;
    g->req = req;
    g->conn = evhttp_request_get_connection(req);
    /* completion_start does not read a body over the limit */
    const char *body =
        len && len <= s->cx.max_body ? (const char *)evbuffer_pullup(in, (ev_ssize_t)len) : "";
    completion_status_t st =
        completion_start(&s->cx, kind, body, len, &sink, g, &s->active, &g->c, &e);
    if (st != COMPLETION_OK) {
        if (st == COMPLETION_FULL) {
            char ra[16];
            snprintf(ra, sizeof(ra), "%d", cluster_retry_after_s(s->cx.cluster));
            evhttp_add_header(evhttp_request_get_output_headers(req), "Retry-After", ra);
            log_warn("429: queue full");
        }
        free(g);
        reply_error(req, &e);
        return;
    }
    evhttp_connection_set_closecb(g->conn, on_close, g);
    if (!completion_streaming(g->c)) {
        watch_close(g);
        return;
    }
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Content-Type", "text/event-stream");
    evhttp_add_header(h, "Cache-Control", "no-cache");
    evhttp_send_reply_start(req, 200, "OK");
    if (kind == API_CHAT) {
        api_response_info info = completion_info(g->c);
        char *chunk = api_format_chunk(&info, NULL, 0, NULL, 1);
        if (chunk)
            sse_send(g, chunk);
        free(chunk);
    }
}

static void handle_health(http_server_t *s, struct evhttp_request *req)
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
    reply_json(req, ok ? 200 : 503, body ? body : "{\"status\":\"unavailable\"}");
    free(body);
}

static void add_worker_json(const cluster_worker_info *w, void *ud)
{
    json_t *o = json_pack("{s:s, s:s, s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:I}", "id",
                          w->id, "role", proto_role_str(w->role),
                          "state", w->state == PROTO_STATE_READY ? "ready" : "draining",
                          "kv_endpoint", w->kv_endpoint, "pid", w->pid, "kv_blocks_total",
                          w->kv_blocks_total, "kv_blocks_free", w->kv_blocks_free, "running",
                          w->running, "queued", w->queued, "queued_prompt_tokens",
                          w->queued_prompt_tokens, "assigned", w->n_assigned,
                          "last_seen_ms_ago", (json_int_t)(w->last_seen_ms_ago + 0.5));
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
        json_object_set_new(o, "migration_ms_mean",
                            json_real(w->mig.n_out ? (double)w->mig.out_us / 1000.0 /
                                                         (double)w->mig.n_out
                                                   : 0.0));
    }
    if (o)
        json_array_append_new((json_t *)ud, o);
}

/* POST /workers/{id}/role {"role": "prefill" | "decode"}: order a live role change
 * (operators; docs/scheduler.md "Live role changes"). 202 when ordered; 404 unknown
 * worker; 409 refused (the last worker of its role, mixed, already changing); 400 bad body. */
static void handle_worker_role(http_server_t *s, struct evhttp_request *req, const char *id)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    if (len > s->cx.max_body) {
        reply_error_msg(req, 413, "invalid_request_error", NULL, "request_too_large",
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
        reply_error_msg(req, 400, "invalid_request_error", NULL, "invalid_json", msg);
        return;
    }
    json_t *jr = json_is_object(root) ? json_object_get(root, "role") : NULL;
    const char *rs = json_is_string(jr) ? json_string_value(jr) : NULL;
    proto_role_t role;
    int bad = proto_role_parse(rs, &role) < 0 || role == PROTO_ROLE_MIXED; /* takes NULL */
    json_decref(root); /* rs is gone with it */
    if (bad) {
        reply_error_msg(req, 400, "invalid_request_error", "role", "invalid_role",
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
        reply_error_msg(req, 404, "invalid_request_error", NULL, "worker_not_found", err);
    } else if (rc == -2) {
        reply_error_msg(req, 409, "invalid_request_error", "role", "role_change_refused", err);
    } else if (rc < 0) {
        reply_error_msg(req, 400, "invalid_request_error", "role", "invalid_role", err);
    } else {
        json_t *o = json_pack("{s:s, s:s, s:s}", "id", id, "role", proto_role_str(role),
                              "status", "changing");
        char *out = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
        reply_json(req, 202, out ? out : "{\"status\":\"changing\"}");
        free(out);
    }
}

/* GET /workers: every alive worker with its last reported load figures (operators). */
static void handle_workers(http_server_t *s, struct evhttp_request *req)
{
    json_t *arr = json_array();
    if (arr && s->cx.cluster)
        cluster_foreach_worker(s->cx.cluster, add_worker_json, arr);
    json_t *root = arr ? json_pack("{s:o}", "workers", arr) : NULL;
    char *body = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    reply_json(req, body ? 200 : 500, body ? body : "{\"workers\":[]}");
    free(body);
}

/* GET /metrics: the stats in the Prometheus text format. */
static void handle_metrics(http_server_t *s, struct evhttp_request *req)
{
    if (!s->cx.stats) {
        reply_error_msg(req, 503, "server_error", NULL, "not_ready", "metrics are not enabled");
        return;
    }
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) {
        reply_error_msg(req, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    prometheus_write(s->cx.stats, s->cx.cluster, f);
    int bad = ferror(f);
    fclose(f);
    struct evbuffer *b = evbuffer_new();
    if (bad || !b || evbuffer_add(b, text, len) < 0) {
        reply_error_msg(req, 500, "server_error", NULL, NULL, "out of memory");
    } else {
        evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
                          METRICS_CONTENT_TYPE);
        evhttp_send_reply(req, 200, "OK", b);
    }
    if (b)
        evbuffer_free(b);
    free(text);
}

static void handle_models(http_server_t *s, struct evhttp_request *req, const char *which)
{
    if (which) { /* GET /v1/models/{id} */
        if (strcmp(which, s->model) != 0) {
            api_error e;
            api_error_set(&e, 404, "invalid_request_error", "model", "model_not_found",
                          "The model '%.200s' does not exist.", which);
            reply_error(req, &e);
            return;
        }
        json_t *m =
            json_pack("{s:s, s:s, s:I, s:s, s:i}", "id", s->model, "object", "model", "created",
                      (json_int_t)s->started, "owned_by", "tidepool", "max_model_len", s->cx.n_ctx);
        char *body = m ? json_dumps(m, JSON_COMPACT) : NULL;
        json_decref(m);
        reply_json(req, 200, body);
        free(body);
        return;
    }
    char *body = api_format_models(s->model, s->started, s->cx.n_ctx);
    reply_json(req, 200, body);
    free(body);
}

static const char *method_str(enum evhttp_cmd_type m)
{
    switch (m) {
    case EVHTTP_REQ_GET:
        return "GET";
    case EVHTTP_REQ_POST:
        return "POST";
    case EVHTTP_REQ_HEAD:
        return "HEAD";
    case EVHTTP_REQ_PUT:
        return "PUT";
    case EVHTTP_REQ_DELETE:
        return "DELETE";
    case EVHTTP_REQ_OPTIONS:
        return "OPTIONS";
    case EVHTTP_REQ_TRACE:
        return "TRACE";
    case EVHTTP_REQ_CONNECT:
        return "CONNECT";
    case EVHTTP_REQ_PATCH:
        return "PATCH";
    }
    return "?";
}

/* Every response that went out completely: count its status. */
static void on_reply_done(struct evhttp_request *req, void *arg)
{
    http_server_t *s = arg;
    if (s->cx.stats)
        stats_http_response(s->cx.stats, evhttp_request_get_response_code(req));
}

static int batch_route(const char *path, char *id, size_t cap, const char **allow);

/* Running out of file descriptors makes accept() fail at once, every time the listener
 * is readable: pause accepting for 100 ms instead of spinning (and logging) at full speed.
 * (The error callback's argument is evhttp's, not ours: only the listener is used.) */
static void on_accept_resume(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    evconnlistener_enable(arg);
}

static void on_accept_error(struct evconnlistener *l, void *arg)
{
    (void)arg;
    static int64_t warned_us; /* one line a second at most, whatever the listener */
    int e = EVUTIL_SOCKET_ERROR();
    if (e != EMFILE && e != ENFILE && e != ENOBUFS && e != ENOMEM)
        return; /* transient (ECONNABORTED, EINTR): libevent retries */
    int64_t now = proto_now_us();
    if (now - warned_us > 1000000) {
        log_warn("cannot accept connections: %s; pausing accepts for 100 ms", strerror(e));
        warned_us = now;
    }
    struct timeval tv = {0, 100000};
    if (event_base_once(evconnlistener_get_base(l), -1, EV_TIMEOUT, on_accept_resume, l, &tv) == 0)
        evconnlistener_disable(l);
}

/* Requests whose framing is ambiguous (RFC 9112 6.3: several Content-Length headers) are
 * refused and their connection closed, so that nothing after them is read as a request
 * (request smuggling). Returns 1 when req was answered. */
static int reject_ambiguous_framing(struct evhttp_request *req)
{
    int n = 0;
    struct evkeyvalq *h = evhttp_request_get_input_headers(req);
    for (struct evkeyval *kv = h->tqh_first; kv; kv = kv->next.tqe_next)
        if (evutil_ascii_strcasecmp(kv->key, "Content-Length") == 0)
            n++;
    if (n <= 1)
        return 0;
    evhttp_add_header(evhttp_request_get_output_headers(req), "Connection", "close");
    reply_error_msg(req, 400, "invalid_request_error", NULL, "bad_framing",
                    "The request has more than one Content-Length header.");
    return 1;
}

static void on_request(struct evhttp_request *req, void *arg)
{
    http_server_t *s = arg;
    evhttp_request_set_on_complete_cb(req, on_reply_done, s);
    if (reject_ambiguous_framing(req))
        return;
    enum evhttp_cmd_type method = evhttp_request_get_command(req);
    const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri(req);
    const char *path = uri ? evhttp_uri_get_path(uri) : NULL;
    if (!path || !*path)
        path = "/";
    char msg[300];

    const char *allow = NULL;
    int kind = -1;
    int broute = -1;
    char bid[128] = "";
    char wid[PROTO_ID_LEN] = ""; /* POST /workers/{id}/role */
    size_t plen = strlen(path);
    if (strncmp(path, "/workers/", 9) == 0 && plen > 14 && plen - 14 < sizeof(wid) &&
        strcmp(path + plen - 5, "/role") == 0 && !memchr(path + 9, '/', plen - 14)) {
        memcpy(wid, path + 9, plen - 14);
        wid[plen - 14] = 0;
    }
    if (wid[0]) {
        allow = "POST";
    } else if ((broute = batch_route(path, bid, sizeof(bid), &allow)) >= 0) {
        /* the Files and Batch API (batch.h) */
    } else if (strcmp(path, "/v1/completions") == 0) {
        allow = "POST";
        kind = API_COMPLETIONS;
    } else if (strcmp(path, "/v1/chat/completions") == 0) {
        allow = "POST";
        kind = API_CHAT;
    } else if (strcmp(path, "/v1/models") == 0 || strncmp(path, "/v1/models/", 11) == 0 ||
               strcmp(path, "/health") == 0 || strcmp(path, "/workers") == 0 ||
               strcmp(path, "/metrics") == 0) {
        allow = "GET";
    }
    if (!allow) {
        snprintf(msg, sizeof(msg), "Invalid URL (%s %.200s)", method_str(method), path);
        reply_error_msg(req, 404, "invalid_request_error", NULL, "unknown_url", msg);
        return;
    }
    int is_get = method == EVHTTP_REQ_GET || method == EVHTTP_REQ_HEAD;
    if (!((strstr(allow, "POST") && method == EVHTTP_REQ_POST) ||
          (strstr(allow, "GET") && is_get))) {
        evhttp_add_header(evhttp_request_get_output_headers(req), "Allow", allow);
        snprintf(msg, sizeof(msg), "Method %s is not allowed for %.200s (use %s).",
                 method_str(method), path, allow);
        reply_error_msg(req, 405, "invalid_request_error", NULL, "method_not_allowed", msg);
        return;
    }
    if (wid[0]) {
        handle_worker_role(s, req, wid);
    } else if (broute >= 0) {
        if (s->batch)
            batch_handle(s->batch, req, (batch_route_t)broute, bid[0] ? bid : NULL);
        else
            reply_error_msg(req, 503, "server_error", NULL, "not_ready",
                            "the Batch API is not enabled");
    } else if (kind >= 0)
        handle_completion(s, req, (api_kind_t)kind);
    else if (strcmp(path, "/health") == 0)
        handle_health(s, req);
    else if (strcmp(path, "/workers") == 0)
        handle_workers(s, req);
    else if (strcmp(path, "/metrics") == 0)
        handle_metrics(s, req);
    else
        handle_models(s, req, path[10] == '/' ? path + 11 : NULL);
}

// --- server

http_server_t *http_server_new(struct event_base *base, const http_params *p, char *err,
                               size_t errlen)
{
    http_server_t *s = calloc(1, sizeof(*s));
    if (!s) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    s->base = base;
    s->host = strdup(p->host);
    s->model = strdup(p->model_name);
    s->started = now_s();
    s->cx = (completion_env){
        .tok = p->tok,
        .n_ctx = p->n_ctx,
        .max_piece = completion_max_piece(p->tok),
        .max_body = p->max_body_bytes,
        .model = s->model,
    };
    if (getrandom(&s->cx.id_nonce, sizeof(s->cx.id_nonce), 0) != (ssize_t)sizeof(s->cx.id_nonce))
        s->cx.id_nonce = (uint64_t)proto_wall_us();
    s->http = evhttp_new(base);
    if (!s->host || !s->model || !s->http) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    /* Bodies up to twice the limit are read and answered with a JSON 413; beyond that
     * libevent answers 413 itself before reading the body. */
    size_t max_read = 2 * p->max_body_bytes + 65536;
    if (p->max_upload_bytes + 65536 > max_read) /* uploads: the file plus multipart headers */
        max_read = p->max_upload_bytes + 65536;
    evhttp_set_max_body_size(s->http, (ev_ssize_t)max_read);
    evhttp_set_max_headers_size(s->http, 64 * 1024);
    evhttp_set_allowed_methods(s->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD |
                                            EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE |
                                            EVHTTP_REQ_OPTIONS | EVHTTP_REQ_PATCH);
    evhttp_set_timeout(s->http, p->timeout_s > 0 ? p->timeout_s : 60);
    evhttp_set_gencb(s->http, on_request, s);
    s->bound = evhttp_bind_socket_with_handle(s->http, p->host, (ev_uint16_t)p->port);
    if (!s->bound) {
        snprintf(err, errlen, "cannot listen on %s:%d: %s", p->host, p->port, strerror(errno));
        goto fail;
    }
    evconnlistener_set_error_cb(evhttp_bound_socket_get_listener(s->bound), on_accept_error);
    s->port = p->port;
    evutil_socket_t fd = evhttp_bound_socket_get_fd(s->bound);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0) {
        if (ss.ss_family == AF_INET)
            s->port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
        else if (ss.ss_family == AF_INET6)
            s->port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    }
    return s;
fail:
    http_server_destroy(&s);
    return NULL;
}

void http_server_set_cluster(http_server_t *s, cluster_t *c)
{
    s->cx.cluster = c;
}

void http_server_set_stats(http_server_t *s, stats_t *stats)
{
    s->cx.stats = stats;
}

void http_server_set_batch(http_server_t *s, batch_t *b)
{
    s->batch = b;
}

/* The batch route of path (its {id} into id), with the methods it allows; -1 when path is
 * not one. An unknown path under /v1/files or /v1/batches is -1 (404). */
static int batch_route(const char *path, char *id, size_t cap, const char **allow)
{
    static const struct {
        const char *prefix, *suffix, *allow;
        batch_route_t route;
    } routes[] = {
        {"/v1/files/", "/content", "GET", BATCH_ROUTE_FILE_CONTENT},
        {"/v1/files/", "", "GET", BATCH_ROUTE_FILE},
        {"/v1/batches/", "/cancel", "POST", BATCH_ROUTE_CANCEL},
        {"/v1/batches/", "", "GET", BATCH_ROUTE_BATCH},
    };
    if (strcmp(path, "/v1/files") == 0) {
        *allow = "POST";
        return BATCH_ROUTE_FILES;
    }
    if (strcmp(path, "/v1/batches") == 0) {
        *allow = "GET, POST";
        return BATCH_ROUTE_BATCHES;
    }
    for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++) {
        size_t pl = strlen(routes[i].prefix), sl = strlen(routes[i].suffix), n = strlen(path);
        if (n <= pl + sl || strncmp(path, routes[i].prefix, pl) != 0 ||
            strcmp(path + n - sl, routes[i].suffix) != 0)
            continue;
        size_t idl = n - pl - sl;
        if (idl >= cap || memchr(path + pl, '/', idl))
            continue;
        memcpy(id, path + pl, idl);
        id[idl] = 0;
        *allow = routes[i].allow;
        return routes[i].route;
    }
    return -1;
}

int http_server_port(const http_server_t *s)
{
    return s->port;
}

void http_server_stop_accepting(http_server_t *s)
{
    if (s->bound) {
        evhttp_del_accept_socket(s->http, s->bound);
        s->bound = NULL;
    }
}

int http_server_n_active(const http_server_t *s)
{
    return s->active.n;
}

void http_server_destroy(http_server_t **ps)
{
    if (!ps || !*ps)
        return;
    http_server_t *s = *ps;
    while (s->active.head) { /* only if the cluster was not destroyed first */
        gw_req *g = completion_ud(s->active.head);
        evhttp_connection_set_closecb(g->conn, NULL, NULL);
        g->req = NULL; /* evhttp_free below frees the requests */
        completion_destroy(&g->c); /* cancels it in the cluster; frees g */
    }
    if (s->http)
        evhttp_free(s->http);
    free(s->host);
    free(s->model);
    free(s);
    *ps = NULL;
}
