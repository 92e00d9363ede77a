/* http: see http.h.
 *
 * Each admitted completion request has one gw_req, owned here and freed in exactly one
 * place (req_free) when the request ends: finished, failed, or abandoned by its client.
 * A client that goes away is noticed through the connection's close callback; libevent
 * then has detached (or is about to free) the evhttp_request, so from that moment the
 * gw_req no longer touches it, and the request is cancelled in the cluster. */
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
#include "log.h"
#include "metrics.h"
#include "prometheus.h"
#include "protocol.h"
#include "sampler.h"
#include "stream.h"

#define SLOW_CLIENT_BYTES (8u << 20) /* unsent SSE bytes before a client is dropped */

typedef struct gw_req {
    struct gw_req *prev, *next;
    http_server_t *srv;
    struct evhttp_request *req; /* NULL once the client is gone */
    struct evhttp_connection *conn;
    struct event *close_ev; /* non-streaming: watches the socket for EOF */
    uint64_t rid;
    api_kind_t kind;
    int streaming, include_usage;
    stream_t *stream;
    char *text; /* non-streaming: the answer so far */
    size_t text_len, text_cap;
    int n_prompt, max_tokens;
    int offline; /* service_tier "flex" */
    char id[48];
    int64_t created;
    int64_t t_start_us, t_first_us;
    int64_t t_last_us;          /* latest tokens at the gateway */
    cluster_req_timing timing; /* filled by the cluster */
} gw_req;

struct http_server {
    struct event_base *base;
    struct evhttp *http;
    struct evhttp_bound_socket *bound;
    char *host;
    char *model;
    int port;
    int n_ctx;
    size_t max_body;
    const tokenizer_t *tok;
    int max_piece; /* bytes of the longest token piece */
    cluster_t *cluster;
    stats_t *stats; /* NULL: no figures */
    batch_t *batch; /* NULL: the Files and Batch API answer 503 */
    uint64_t id_nonce;
    gw_req *active;
    int n_active;
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

// --- per-request state

static void req_free(gw_req *g)
{
    http_server_t *s = g->srv;
    if (g->conn && g->req)
        evhttp_connection_set_closecb(g->conn, NULL, NULL);
    if (g->prev)
        g->prev->next = g->next;
    else
        s->active = g->next;
    if (g->next)
        g->next->prev = g->prev;
    s->n_active--;
    if (g->close_ev)
        event_free(g->close_ev);
    stream_destroy(&g->stream);
    free(g->text);
    free(g);
}

static const char *ms_str(char *buf, size_t cap, double ms)
{
    if (ms < 0)
        snprintf(buf, cap, "-");
    else
        snprintf(buf, cap, "%.2f", ms);
    return buf;
}

/* The request ends: count it in the stats and log its one summary line (INFO) with the
 * phases of its time to first token (docs/stats.md). how: the finish reason (FINISHED) or
 * the error message. */
static void log_end(const gw_req *g, int status, stats_end_t end, const char *how)
{
    int64_t now = proto_now_us();
    int n_out = g->stream ? stream_n_tokens(g->stream) : 0;
    stats_request sr = {.rid = g->rid,
                        .how = end,
                        .finish_reason = end == STATS_END_FINISHED ? how : NULL,
                        .status = status,
                        .error = end == STATS_END_FAILED ? how : NULL,
                        .n_prompt = g->n_prompt,
                        .n_output = n_out,
                        .t_first_us = g->t_first_us,
                        .t_last_us = g->t_last_us,
                        .t_end_us = now,
                        .timing = &g->timing,
                        .offline = g->offline};
    stats_breakdown b;
    if (g->srv->stats)
        stats_request_end(g->srv->stats, &sr, &b);
    else
        stats_breakdown_of(&sr, &b);
    char q[24], p[24], x[24], d[24], t[24], e[24];
    log_rinfo(g->rid,
              "request end: %s %s status=%d finish=%s prompt_tokens=%d output_tokens=%d "
              "queue_ms=%s prefill_ms=%s transfer_ms=%s first_decode_ms=%s ttft_ms=%s "
              "e2e_ms=%s prefill=%s decode=%s attempts=%d%s%s%s",
              g->kind == API_CHAT ? "/v1/chat/completions" : "/v1/completions",
              g->streaming ? "stream" : "json", status,
              end == STATS_END_FINISHED ? how : end == STATS_END_CANCELLED ? "abort" : "error",
              g->n_prompt, n_out, ms_str(q, sizeof(q), b.queue_ms),
              ms_str(p, sizeof(p), b.prefill_ms), ms_str(x, sizeof(x), b.transfer_ms),
              ms_str(d, sizeof(d), b.first_decode_ms), ms_str(t, sizeof(t), b.ttft_ms),
              ms_str(e, sizeof(e), b.e2e_ms),
              g->timing.prefill_worker[0] ? g->timing.prefill_worker : "-",
              g->timing.decode_worker[0] ? g->timing.decode_worker : "-", g->timing.attempts,
              end == STATS_END_FINISHED ? "" : " reason=\"", end == STATS_END_FINISHED ? "" : how,
              end == STATS_END_FINISHED ? "" : "\"");
}

static api_response_info info_of(const gw_req *g)
{
    api_response_info info = {
        .kind = g->kind,
        .id = g->id,
        .created = g->created,
        .model = g->srv->model,
        .include_usage = g->include_usage,
        .service_tier = g->offline ? "flex" : "default",
    };
    return info;
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

static int text_add(gw_req *g, const char *p, size_t n)
{
    if (g->text_len + n + 1 > g->text_cap) {
        size_t cap = g->text_cap ? g->text_cap * 2 : 256;
        while (cap < g->text_len + n + 1)
            cap *= 2;
        char *t = realloc(g->text, cap);
        if (!t)
            return -1;
        g->text = t;
        g->text_cap = cap;
    }
    memcpy(g->text + g->text_len, p, n);
    g->text_len += n;
    g->text[g->text_len] = 0;
    return 0;
}

/* Move the text the stream released to the client (SSE) or to the answer (JSON). */
static void flush_text(gw_req *g)
{
    size_t len;
    const char *out = stream_out(g->stream, &len);
    if (len == 0)
        return;
    if (g->streaming) {
        api_response_info info = info_of(g);
        char *chunk = api_format_chunk(&info, out, len, NULL, 0);
        if (chunk)
            sse_send(g, chunk);
        free(chunk);
    } else if (text_add(g, out, len) < 0) {
        log_rerror(g->rid, "out of memory buffering the answer");
    }
    stream_out_clear(g->stream);
}

/* The request is complete: send what is left and the end of the answer, then free. */
static void complete(gw_req *g, const char *finish_reason)
{
    flush_text(g);
    int n_completion = stream_n_tokens(g->stream);
    api_response_info info = info_of(g);
    if (g->streaming) {
        char *chunk = api_format_chunk(&info, g->kind == API_CHAT ? NULL : "", 0, finish_reason, 0);
        if (chunk)
            sse_send(g, chunk);
        free(chunk);
        if (g->include_usage) {
            chunk = api_format_usage_chunk(&info, g->n_prompt, n_completion);
            if (chunk)
                sse_send(g, chunk);
            free(chunk);
        }
        sse_send(g, "[DONE]");
        evhttp_connection_set_closecb(g->conn, NULL, NULL);
        evhttp_send_reply_end(g->req);
    } else {
        char *body = api_format_response(&info, g->text ? g->text : "", g->text_len, finish_reason,
                                         g->n_prompt, n_completion);
        evhttp_connection_set_closecb(g->conn, NULL, NULL);
        if (body)
            reply_json(g->req, 200, body);
        else
            reply_error_msg(g->req, 500, "server_error", NULL, NULL,
                            "could not format the response");
        free(body);
    }
    log_end(g, 200, STATS_END_FINISHED, finish_reason);
    g->req = NULL;
    req_free(g);
}

static void fail(gw_req *g, int status, const char *type, const char *code, const char *msg)
{
    api_error e;
    api_error_set(&e, status, type, NULL, code, "%s", msg);
    evhttp_connection_set_closecb(g->conn, NULL, NULL);
    if (g->streaming) {
        /* headers are out: report in the stream, then end it as usual */
        char *body = api_error_json(&e);
        if (body)
            sse_send(g, body);
        free(body);
        sse_send(g, "[DONE]");
        evhttp_send_reply_end(g->req);
    } else {
        reply_error(g->req, &e);
    }
    log_end(g, status, STATS_END_FAILED, msg);
    g->req = NULL;
    req_free(g);
}

// --- cluster callbacks

static int on_tokens(void *ud, const int *tokens, int n)
{
    gw_req *g = ud;
    int64_t now = proto_now_us();
    if (!g->t_first_us) {
        g->t_first_us = now;
        if (g->srv->stats && !g->offline) /* offline waits stay out of the online figures */
            stats_first_token(g->srv->stats, &g->timing, now);
    } else if (g->srv->stats && !g->offline) {
        stats_tokens(g->srv->stats, &g->timing, (double)(now - g->t_last_us) / 1e6, now);
    }
    g->t_last_us = now;
    for (int i = 0; i < n; i++) {
        stream_status_t st = stream_push(g->stream, tokens[i]);
        if (st == STREAM_STOP) {
            complete(g, API_FINISH_STOP);
            return 1;
        }
        if (st == STREAM_ERR) {
            fail(g, 500, "server_error", NULL, "out of memory");
            return 1;
        }
    }
    if (stream_n_tokens(g->stream) >= g->max_tokens) {
        stream_status_t st = stream_finish(g->stream);
        complete(g, st == STREAM_STOP ? API_FINISH_STOP : API_FINISH_LENGTH);
        return 1;
    }
    flush_text(g);
    if (g->streaming) {
        struct bufferevent *bev = evhttp_connection_get_bufferevent(g->conn);
        if (bev && evbuffer_get_length(bufferevent_get_output(bev)) > SLOW_CLIENT_BYTES) {
            /* The client reads slower than we generate: end its answer here rather than
             * buffer without bound. */
            log_rwarn(g->rid, "client too slow (%u bytes unsent): request ended",
                      SLOW_CLIENT_BYTES);
            fail(g, 503, "server_error", "slow_client", "the client reads too slowly");
            return 1;
        }
    }
    return 0;
}

static void on_finish(void *ud, int reason)
{
    gw_req *g = ud;
    stream_status_t st = stream_finish(g->stream);
    complete(g, st == STREAM_STOP || reason == PROTO_FINISH_STOP ? API_FINISH_STOP
                                                                 : API_FINISH_LENGTH);
}

static void on_error(void *ud, int status, const char *type, const char *code, const char *msg)
{
    fail(ud, status, type, code, msg);
}

static const cluster_callbacks callbacks = {on_tokens, on_finish, on_error};

const cluster_callbacks *http_server_callbacks(void)
{
    return &callbacks;
}

/* The client went away: cancel wherever the request is and forget it. */
static void on_close(struct evhttp_connection *conn, void *arg)
{
    gw_req *g = arg;
    (void)conn;
    log_rinfo(g->rid, "client disconnected: cancelling");
    cluster_cancel(g->srv->cluster, g->rid);
    /* libevent detached the request (evcon == NULL) and leaves it to us, or it is still
     * attached and libevent frees it right after this callback. */
    if (g->req && evhttp_request_get_connection(g->req) == NULL)
        evhttp_request_free(g->req);
    log_end(g, 499, STATS_END_CANCELLED, "client disconnected");
    g->req = NULL;
    req_free(g);
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

static void count_rejected(http_server_t *s)
{
    if (s->stats)
        stats_request_rejected(s->stats);
}

static void handle_completion(http_server_t *s, struct evhttp_request *req, api_kind_t kind)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    api_error e;
    if (s->stats)
        stats_request_received(s->stats);
    if (len > s->max_body) {
        api_error_set(&e, 413, "invalid_request_error", NULL, "request_too_large",
                      "The request body is %zu bytes; the limit is %zu bytes.", len, s->max_body);
        count_rejected(s);
        reply_error(req, &e);
        return;
    }
    const char *body = len ? (const char *)evbuffer_pullup(in, (ev_ssize_t)len) : "";
    api_request r;
    if (api_parse(kind, body, len, &r, &e) < 0 || api_check_model(&r, s->model, &e) < 0) {
        log_debug("400: %s", e.message);
        api_request_free(&r);
        count_rejected(s);
        reply_error(req, &e);
        return;
    }
    int *tokens = NULL;
    gw_req *g = NULL;
    /* A token spells at least one byte and at most max_piece bytes, so a prompt this long
     * cannot fit; refuse it before spending time on tokenizing it. */
    if (r.prompt_len / (size_t)s->max_piece >= (size_t)s->n_ctx) {
        api_error_set(&e, 400, "invalid_request_error", kind == API_CHAT ? "messages" : "prompt",
                      "context_length_exceeded",
                      "This model's maximum context length is %d tokens, but the prompt is at "
                      "least %zu tokens.",
                      s->n_ctx, r.prompt_len / (size_t)s->max_piece + 1);
        goto bad;
    }
    int cap = (int)r.prompt_len + 8, needed = 0;
    tokens = malloc((size_t)cap * sizeof(int));
    if (!tokens)
        goto oom;
    int n = tokenizer_encode(s->tok, r.prompt, r.prompt_len, 1, tokens, cap, &needed);
    if (n < 0 && needed > cap) {
        int *t = realloc(tokens, (size_t)needed * sizeof(int));
        if (!t)
            goto oom;
        tokens = t;
        cap = needed;
        n = tokenizer_encode(s->tok, r.prompt, r.prompt_len, 1, tokens, cap, &needed);
    }
    if (n < 0) {
        api_error_set(&e, 500, "server_error", NULL, NULL, "tokenization failed");
        goto bad;
    }
    if (api_check_length(&r, n, s->n_ctx, &e) < 0)
        goto bad;
    if (!s->cluster) {
        api_error_set(&e, 503, "server_error", NULL, "not_ready", "the server is starting");
        goto bad;
    }

    g = calloc(1, sizeof(*g));
    if (!g)
        goto oom;
    g->srv = s;
    g->req = req;
    g->conn = evhttp_request_get_connection(req);
    g->kind = kind;
    g->streaming = r.stream;
    g->include_usage = r.stream && r.include_usage;
    g->n_prompt = n;
    g->max_tokens = r.max_tokens;
    g->offline = r.offline;
    g->created = now_s();
    g->t_start_us = proto_now_us();
    g->stream = stream_new(s->tok, tokens[n - 1], tokenizer_eos(s->tok),
                           (const char *const *)r.stop, r.n_stop);
    g->next = s->active;
    if (s->active)
        s->active->prev = g;
    s->active = g;
    s->n_active++;
    if (!g->stream)
        goto oom;

    uint64_t seed = r.seed;
    if (!r.has_seed && getrandom(&seed, sizeof(seed), 0) != (ssize_t)sizeof(seed))
        seed = (uint64_t)proto_now_us() ^ ((uint64_t)(uintptr_t)g << 17);
    cluster_job job = {
        .tokens = tokens,
        .n_tokens = n,
        .max_tokens = r.max_tokens,
        .temperature = (float)r.temperature,
        .top_p = (float)r.top_p,
        .top_k = r.top_k,
        .rng = sampler_seed_state(seed),
        .mtp_depth = r.mtp_depth >= 0 ? r.mtp_depth + 1 : 0,
        .timing = &g->timing,
        .offline = r.offline,
    };
    cluster_status_t st = cluster_submit(s->cluster, &job, g, &g->rid);
    if (st == CLUSTER_FULL) {
        char ra[16];
        snprintf(ra, sizeof(ra), "%d", cluster_retry_after_s(s->cluster));
        evhttp_add_header(evhttp_request_get_output_headers(req), "Retry-After", ra);
        api_error_set(&e, 429, "rate_limit_error", NULL, "rate_limit_exceeded",
                      "The server is at capacity (the queue is full); retry later.");
        log_warn("429: queue full");
        goto bad;
    }
    if (st != CLUSTER_OK)
        goto oom;
    snprintf(g->id, sizeof(g->id), "%s-%016llx%llx", kind == API_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)s->id_nonce, (unsigned long long)g->rid);
    log_rdebug(g->rid, "admitted: %d prompt tokens, max_tokens %d, temperature %.3g, %s%s", n,
               r.max_tokens, r.temperature, r.stream ? "stream" : "json",
               r.offline ? ", offline (flex)" : "");
    evhttp_connection_set_closecb(g->conn, on_close, g);
    if (!g->streaming)
        watch_close(g);
    if (g->streaming) {
        struct evkeyvalq *h = evhttp_request_get_output_headers(req);
        evhttp_add_header(h, "Content-Type", "text/event-stream");
        evhttp_add_header(h, "Cache-Control", "no-cache");
        evhttp_send_reply_start(req, 200, "OK");
        if (kind == API_CHAT) {
            api_response_info info = info_of(g);
            char *chunk = api_format_chunk(&info, NULL, 0, NULL, 1);
            if (chunk)
                sse_send(g, chunk);
            free(chunk);
        }
    }
    free(tokens);
    api_request_free(&r);
    return;

oom:
    api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
bad:
    if (g) {
        g->req = NULL;
        req_free(g);
    }
    free(tokens);
    api_request_free(&r);
    count_rejected(s);
    reply_error(req, &e);
}

static void handle_health(http_server_t *s, struct evhttp_request *req)
{
    char reason[160] = "";
    int ok = s->cluster && cluster_ready(s->cluster, reason, sizeof(reason));
    cluster_stats st = {0};
    if (s->cluster)
        cluster_get_stats(s->cluster, &st);
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
    if (len > s->max_body) {
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
    int rc = s->cluster ? cluster_set_role(s->cluster, id, role, "the operator", err, sizeof(err))
                        : -1;
    if (!s->cluster)
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
    if (arr && s->cluster)
        cluster_foreach_worker(s->cluster, add_worker_json, arr);
    json_t *root = arr ? json_pack("{s:o}", "workers", arr) : NULL;
    char *body = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    reply_json(req, body ? 200 : 500, body ? body : "{\"workers\":[]}");
    free(body);
}

/* GET /metrics: the stats in the Prometheus text format. */
static void handle_metrics(http_server_t *s, struct evhttp_request *req)
{
    if (!s->stats) {
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
    prometheus_write(s->stats, s->cluster, f);
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
                      (json_int_t)s->started, "owned_by", "tidepool", "max_model_len", s->n_ctx);
        char *body = m ? json_dumps(m, JSON_COMPACT) : NULL;
        json_decref(m);
        reply_json(req, 200, body);
        free(body);
        return;
    }
    char *body = api_format_models(s->model, s->started, s->n_ctx);
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
    if (s->stats)
        stats_http_response(s->stats, evhttp_request_get_response_code(req));
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
    s->n_ctx = p->n_ctx;
    s->max_body = p->max_body_bytes;
    s->tok = p->tok;
    s->started = now_s();
    if (getrandom(&s->id_nonce, sizeof(s->id_nonce), 0) != (ssize_t)sizeof(s->id_nonce))
        s->id_nonce = (uint64_t)proto_wall_us();
    s->max_piece = 1;
    for (int id = 0; id < tokenizer_vocab_size(p->tok); id++) {
        size_t len = 0;
        tokenizer_piece(p->tok, -1, id, &len);
        if ((int)len > s->max_piece)
            s->max_piece = (int)len;
    }
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
    s->cluster = c;
}

void http_server_set_stats(http_server_t *s, stats_t *stats)
{
    s->stats = stats;
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
    return s->n_active;
}

void http_server_destroy(http_server_t **ps)
{
    if (!ps || !*ps)
        return;
    http_server_t *s = *ps;
    while (s->active) { /* only if the cluster was not destroyed first */
        gw_req *g = s->active;
        if (s->cluster)
            cluster_cancel(s->cluster, g->rid);
        evhttp_connection_set_closecb(g->conn, NULL, NULL);
        g->req = NULL; /* evhttp_free below frees the requests */
        req_free(g);
    }
    if (s->http)
        evhttp_free(s->http);
    free(s->host);
    free(s->model);
    free(s);
    *ps = NULL;
}
