/* http_completion: POST /v1/completions, /v1/chat/completions and /v1/responses (http.h;
 * a response's bodies and events are responses.h's).
 *
 * Each admitted request has one gw_req, the sink of its completion (completion.h), which
 * owns it and frees it in exactly one place (req_free, the sink's release) when the
 * request ends: finished, failed, or abandoned by its client. Streaming requests get
 * Server-Sent Events (a chunk per message of tokens, then the finish chunk, the usage
 * chunk when asked, and [DONE]); others one JSON body. A client that goes away is noticed
 * through the connection's close callback (and, while a non-streaming request waits, a
 * watch on its socket); libevent then has detached (or is about to free) the
 * evhttp_request, so from that moment the gw_req no longer touches it, and the request is
 * cancelled (completion_cancel).
 *
 * A stream's client sends nothing while it waits, so the connection's read timeout
 * (--http-timeout-s) is off for the stream (its write timeout still drops a client that
 * stops reading, as --stream-max-unsent-bytes does one that reads too slowly), and an SSE comment
 * (": keep-alive") goes out after --sse-keepalive-s without an event, so that a request
 * waiting long for a worker or its first token is not cut by a proxy's idle timeout
 * either (SSE clients ignore comment lines: WHATWG HTML, "Server-sent events").
 *
 * A caller's API key with a tokens/s limit (auth.h) is charged the request's prompt plus
 * its max_tokens at admission (sink.admit: over the limit, 429 with Retry-After), and
 * given back what it did not generate when the request ends, however it ends. */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/http_struct.h>
#include <event2/keyvalq_struct.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include "http_internal.h"
#include "log.h"
#include "protocol.h"
#include "responses.h"
#include "store.h"


typedef struct gw_req {
    http_server_t *srv;
    struct evhttp_request *req; /* NULL once answered or the client is gone */
    struct evhttp_connection *conn;
    struct event *close_ev; /* watches the socket for EOF (watch_close) */
    struct event *probe_ev; /* after a FIN: watches for the reset a closed socket answers
                             * the probe with (on_readable) */
    completion_t *c;        /* the request; it owns this gw_req (completion_sink.release) */
    auth_key *key;          /* the caller's API key (NULL: none) */
    int charged;            /* tokens taken from key's tokens/s bucket, not yet settled */
    int max_tokens;         /* of the request, as charged */
    int retry_after_s;      /* admit refused the request: its Retry-After */
    int slow;               /* streaming: its client fell too far behind (sink_check) */
    struct evbuffer *sse;   /* streaming: the buffer each event goes out through (or NULL) */
    struct event *ping_ev;  /* streaming: the keep-alive timer (--sse-keepalive-s) */
    int64_t last_sent_us;   /* streaming: when the last event or comment went out */
    /* POST /v1/responses, streaming (responses.h): the next event's sequence_number and
     * the text sent so far (the .done events repeat it) */
    int seq;
    char *text;
    size_t text_len, text_cap;
    char item_id[56]; /* "msg_" + the response id's hex */
} gw_req;

// --- the key's tokens/s limit

/* sink.admit: charge key the request's prompt and max_tokens, or refuse it with a 429. */
static int sink_admit(void *ud, int n_prompt, int max_tokens, api_error *e)
{
    gw_req *g = ud;
    if (!g->key || auth_key_get_params(g->key).tokens_per_s <= 0)
        return 0;
    int cost = n_prompt + max_tokens, ra;
    if (auth_take_tokens(g->key, proto_now_us(), cost, &ra) < 0) {
        double rate = auth_key_get_params(g->key).tokens_per_s;
        log_info("429: key %s is over its limit of %g tokens/s (%d requested)",
                 auth_key_id(g->key), rate, cost);
        g->retry_after_s = ra;
        return api_error_set(e, 429, "tokens", NULL, "rate_limit_exceeded",
                             "Rate limit reached for tokens per second (TPS) of API key %s: "
                             "limit %g, requested %d (prompt + max_tokens). Please try again in "
                             "%ds.",
                             auth_key_id(g->key), rate, cost, ra);
    }
    g->charged = cost;
    g->max_tokens = max_tokens;
    return 0;
}

/* The request ends (c NULL: it was never admitted): give back what it did not generate. */
static void settle(gw_req *g, const completion_t *c)
{
    if (!g->charged)
        return;
    int n_prompt = 0, n_completion = 0;
    if (c)
        completion_usage(c, &n_prompt, &n_completion);
    int unused = c ? g->max_tokens - n_completion : g->charged;
    if (unused > 0)
        auth_return_tokens(g->key, proto_now_us(), unused);
    g->charged = 0;
}

// --- the completion's sink

/* Streams: libevent reads from a connection while it writes to it (evhttp_write_buffer
 * turns reading on, to learn of a close) and frees it at a FIN, which a client that only
 * shut its sending side after its request (shutdown(SHUT_WR)) sends too: its stream was
 * cut. Reading is turned off after each write of a stream; watch_close watches the socket
 * for the FIN instead, as for a non-streaming request, and on_readable probes it. */
static void stream_no_read(gw_req *g)
{
    struct bufferevent *bev = evhttp_connection_get_bufferevent(g->conn);
    if (bev)
        bufferevent_disable(bev, EV_READ);
}

/* The end of a stream: the connection's own timeouts back (it may serve another request,
 * or idle), then the last chunk. */
static void stream_end(gw_req *g)
{
    struct bufferevent *bev = evhttp_connection_get_bufferevent(g->conn);
    struct timeval t = {g->srv->timeout_s, 0};
    if (bev)
        bufferevent_set_timeouts(bev, &t, &t);
    /* chunked (HTTP/1.1): the last chunk is queued and libevent turns reading on until it
     * is written, then reads the next request; not chunked (HTTP/1.0), the end may free the
     * connection at once */
    int chunked = g->req->chunked;
    evhttp_send_reply_end(g->req);
    if (chunked && bev)
        bufferevent_disable(bev, EV_READ);
}

/* The completion is gone (completion_sink.release): the one place a gw_req is freed. */
static void req_free(void *ud)
{
    gw_req *g = ud;
    if (g->conn && g->req)
        httpconn_set_close_cb(g->srv->conns, g->conn, NULL, NULL);
    if (g->close_ev)
        event_free(g->close_ev);
    if (g->probe_ev)
        event_free(g->probe_ev);
    if (g->ping_ev)
        event_free(g->ping_ev);
    if (g->sse)
        evbuffer_free(g->sse);
    free(g->text);
    free(g);
}

/* One SSE event "data: <payload>\n\n" of n bytes, already formatted, as one HTTP chunk:
 * one evbuffer add into the request's own buffer (made once per request), which
 * evhttp_send_reply_chunk empties by moving its contents to the connection. */
static void sse_send_event(gw_req *g, const char *event, size_t n)
{
    if (!g->sse && !(g->sse = evbuffer_new()))
        return;
    if (evbuffer_add(g->sse, event, n) == 0) {
        evhttp_send_reply_chunk(g->req, g->sse);
        stream_no_read(g);
    }
    evbuffer_drain(g->sse, evbuffer_get_length(g->sse)); /* (left over only on failure) */
    g->last_sent_us = proto_now_us();
}

/* The keep-alive timer: a comment when nothing went out for --sse-keepalive-s. */
static void on_ping(evutil_socket_t fd, short what, void *arg)
{
    gw_req *g = arg;
    (void)fd, (void)what;
    int64_t idle_us = g->srv->keepalive_s * 1000000LL - 100000; /* the timer's jitter */
    if (g->req && proto_now_us() - g->last_sent_us >= idle_us) {
        static const char ka[] = ": keep-alive\n\n";
        sse_send_event(g, ka, sizeof(ka) - 1);
    }
}

/* A stream's connection: no read timeout (the client sends nothing while it waits), the
 * write timeout of --http-timeout-s, and the keep-alive timer. */
static void stream_timers(gw_req *g)
{
    struct bufferevent *bev = evhttp_connection_get_bufferevent(g->conn);
    struct timeval wt = {g->srv->timeout_s, 0}, ka = {g->srv->keepalive_s, 0};
    if (bev)
        bufferevent_set_timeouts(bev, NULL, &wt);
    g->last_sent_us = proto_now_us();
    g->ping_ev = event_new(g->srv->base, -1, EV_PERSIST, on_ping, g);
    if (g->ping_ev)
        event_add(g->ping_ev, &ka);
}

static void sse_send(gw_req *g, const char *payload)
{
    size_t n = strlen(payload);
    char stack[2048], *ev = n + 9 <= sizeof(stack) ? stack : malloc(n + 9);
    if (!ev)
        return;
    memcpy(ev, "data: ", 6);
    memcpy(ev + 6, payload, n);
    memcpy(ev + 6 + n, "\n\n", 2);
    sse_send_event(g, ev, n + 8);
    if (ev != stack)
        free(ev);
}

/* One named SSE event "event: <name>\ndata: <payload>\n\n" (the Responses API); takes
 * payload (malloc'd, may be NULL: nothing sent). */
static void sse_send_named(gw_req *g, const char *name, char *payload)
{
    if (!payload)
        return;
    if (!g->sse && !(g->sse = evbuffer_new())) {
        free(payload);
        return;
    }
    if (evbuffer_add_printf(g->sse, "event: %s\ndata: %s\n\n", name, payload) > 0) {
        evhttp_send_reply_chunk(g->req, g->sse);
        stream_no_read(g);
    }
    evbuffer_drain(g->sse, evbuffer_get_length(g->sse));
    free(payload);
}

/* The Responses API's view of c (strings borrowed from c and g). */
static responses_info resp_info(gw_req *g, const completion_t *c)
{
    api_response_info ai = completion_info(c);
    completion_params p = completion_request_params(c);
    if (!g->item_id[0])
        snprintf(g->item_id, sizeof(g->item_id), "msg_%s", ai.id + 5 /* after "resp_" */);
    responses_info ri = {.id = ai.id,
                         .item_id = g->item_id,
                         .created_at = ai.created,
                         .model = ai.model,
                         .instructions = p.instructions,
                         .max_output_tokens = p.max_tokens,
                         .temperature = p.temperature,
                         .top_p = p.top_p,
                         .store = p.store,
                         .service_tier = ai.service_tier};
    return ri;
}

/* A finished response whose request has "store" (default true), when the server keeps
 * them: its object (body) is queued into the store, written at the batch module's next
 * flush (a GET flushes first), owned by the caller's key. */
static void resp_store(gw_req *g, const completion_t *c, const char *body)
{
    http_server_t *s = g->srv;
    if (!s->responses_store || !s->batch || !body || !completion_request_params(c).store)
        return;
    api_response_info ai = completion_info(c);
    if (store_response_put(batch_store(s->batch), ai.id, g->key ? auth_key_id(g->key) : NULL,
                           ai.created, body) < 0)
        log_rwarn(completion_rid(c), "response %s could not be stored", ai.id);
}

void http_responses_stored(http_server_t *s, struct evhttp_request *req, const char *id,
                           auth_key *key)
{
    char *json = NULL, owner[32] = "";
    int rc = s->batch ? store_response_get(batch_store(s->batch), id, &json, owner,
                                           sizeof(owner))
                      : 1; /* nothing is stored without the store */
    if (rc == 0 && key && !auth_key_get_params(key).admin && strcmp(owner, auth_key_id(key)))
        rc = 1; /* another key's: as if there were none */
    if (rc == 0 && evhttp_request_get_command(req) == EVHTTP_REQ_DELETE)
        rc = store_response_delete(batch_store(s->batch), id);
    if (rc > 0) {
        api_error e;
        api_error_set(&e, 404, "invalid_request_error", "response_id", "response_not_found",
                      "Response with id '%.100s' not found.", id);
        api_utf8_trim(e.message);
        http_reply_error(req, &e);
    } else if (rc < 0) {
        http_reply_error_msg(req, 500, "server_error", NULL, "storage_error",
                             "The response store failed.");
    } else if (evhttp_request_get_command(req) == EVHTTP_REQ_DELETE) {
        char body[200]; /* a stored id is "resp_" and hex digits: nothing to escape */
        snprintf(body, sizeof(body), "{\"id\":\"%s\",\"object\":\"response\",\"deleted\":true}",
                 id);
        log_info("response %s deleted", id);
        http_reply_json(req, 200, body);
    } else {
        http_reply_json(req, 200, json);
    }
    free(json);
}

/* Streaming a response: the events before any text. */
static void resp_stream_start(gw_req *g, const completion_t *c)
{
    responses_info ri = resp_info(g, c);
    sse_send_named(g, "response.created",
                   responses_event_response(&ri, "response.created", g->seq++,
                                            RESPONSES_IN_PROGRESS, NULL, 0, 0, 0, NULL));
    sse_send_named(g, "response.in_progress",
                   responses_event_response(&ri, "response.in_progress", g->seq++,
                                            RESPONSES_IN_PROGRESS, NULL, 0, 0, 0, NULL));
    sse_send_named(g, "response.output_item.added",
                   responses_event_item(&ri, RESPONSES_IN_PROGRESS, g->seq++, NULL, 0));
    sse_send_named(g, "response.content_part.added",
                   responses_event_part(&ri, 0, g->seq++, NULL, 0));
}

/* Streaming a response: one piece of text, kept for the .done events. */
static void resp_stream_text(gw_req *g, const completion_t *c, const char *text, size_t len)
{
    if (g->text_len + len > g->text_cap) {
        size_t cap = g->text_cap ? g->text_cap * 2 : 1024;
        while (cap < g->text_len + len)
            cap *= 2;
        char *t = realloc(g->text, cap);
        if (!t)
            return;
        g->text = t;
        g->text_cap = cap;
    }
    memcpy(g->text + g->text_len, text, len);
    g->text_len += len;
    responses_info ri = resp_info(g, c);
    sse_send_named(g, "response.output_text.delta",
                   responses_event_text(&ri, 0, g->seq++, text, len));
}

/* Streaming a response: the events after the text, the last one with the usage. */
static void resp_stream_end(gw_req *g, const completion_t *c)
{
    responses_info ri = resp_info(g, c);
    const char *finish;
    size_t rest;
    completion_choice_text(c, 0, &rest, &finish);
    const char *status = responses_status(finish);
    int n_in, n_out;
    completion_usage(c, &n_in, &n_out);
    sse_send_named(g, "response.output_text.done",
                   responses_event_text(&ri, 1, g->seq++, g->text, g->text_len));
    sse_send_named(g, "response.content_part.done",
                   responses_event_part(&ri, 1, g->seq++, g->text, g->text_len));
    sse_send_named(g, "response.output_item.done",
                   responses_event_item(&ri, status, g->seq++, g->text, g->text_len));
    const char *type = strcmp(status, RESPONSES_INCOMPLETE) == 0 ? "response.incomplete"
                                                                  : "response.completed";
    sse_send_named(g, type,
                   responses_event_response(&ri, type, g->seq++, status, g->text, g->text_len,
                                            n_in, n_out, NULL));
    if (g->srv->responses_store && completion_request_params(c).store) {
        char *obj = responses_format_object(&ri, status, g->text, g->text_len, n_in, n_out, NULL);
        resp_store(g, c, obj);
        free(obj);
    }
}

/* Streaming: one chunk of text, the per-token path: formatted straight into one buffer
 * (api_format_text_chunk: the bytes api_format_chunk gives, without jansson), on the
 * stack unless the text is long. */
static void sink_text(void *ud, const completion_t *c, int index, const char *text, size_t len)
{
    if (completion_info(c).kind == API_RESPONSES) {
        resp_stream_text(ud, c, text, len);
        return;
    }
    api_response_info info = completion_info(c);
    info.index = index;
    const api_logprobs *lp = completion_chunk_logprobs(c, index);
    if (lp) { /* the slower path: jansson formats the entries */
        char *chunk = api_format_chunk_logprobs(&info, len ? text : NULL, len, NULL, lp);
        if (chunk) {
            sse_send(ud, chunk);
            free(chunk);
        }
        return;
    }
    size_t cap = api_text_chunk_bound(&info, len) + 8;
    char stack[4096], *ev = cap <= sizeof(stack) ? stack : malloc(cap);
    if (!ev)
        return;
    memcpy(ev, "data: ", 6);
    size_t n = api_format_text_chunk(&info, text, len, ev + 6);
    if (n) { /* 0: not valid UTF-8, nothing to send (as api_format_chunk's NULL) */
        memcpy(ev + 6 + n, "\n\n", 2);
        sse_send_event(ud, ev, n + 8);
    }
    if (ev != stack)
        free(ev);
}

/* Streaming: a client that reads slower than we generate (or not at all) is dropped once
 * --stream-max-unsent-bytes of its answer wait in the connection's output, rather than
 * buffered without bound; its request fails (sink_fail closes the connection) and is
 * cancelled on its workers. */
static int sink_check(void *ud, const completion_t *c, api_error *e)
{
    gw_req *g = ud;
    if (!completion_streaming(c))
        return 0;
    struct bufferevent *bev = evhttp_connection_get_bufferevent(g->conn);
    size_t unsent = bev ? evbuffer_get_length(bufferevent_get_output(bev)) : 0;
    if (unsent <= g->srv->max_unsent)
        return 0;
    log_rwarn(completion_rid(c), "client too slow (%zu bytes unsent): connection closed, "
              "request cancelled", unsent);
    g->slow = 1;
    api_error_set(e, 503, "server_error", NULL, "slow_client", "the client reads too slowly");
    return -1;
}

/* Streaming: a choice's end is its finish chunk (the others may still stream). */
static void sink_choice_end(void *ud, const completion_t *c, int index, const char *finish_reason)
{
    gw_req *g = ud;
    if (!completion_streaming(c) || completion_info(c).kind == API_RESPONSES)
        return; /* (a response ends in sink_done: it has one choice) */
    api_response_info info = completion_info(c);
    info.index = index;
    char *chunk = api_format_chunk(&info, info.kind == API_CHAT ? NULL : "", 0, finish_reason, 0);
    if (chunk)
        sse_send(g, chunk);
    free(chunk);
}

/* The end of the answer: the usage chunk when asked and [DONE], or the whole JSON body.
 * Always 0: a body that cannot be formatted is answered 500 but counted as finished, as it
 * was. */
static int sink_done(void *ud, const completion_t *c, api_error *e)
{
    gw_req *g = ud;
    (void)e;
    settle(g, c);
    api_response_info info = completion_info(c);
    if (info.kind == API_RESPONSES && completion_streaming(c)) {
        resp_stream_end(g, c);
        httpconn_set_close_cb(g->srv->conns, g->conn, NULL, NULL);
        stream_end(g);
    } else if (completion_streaming(c)) {
        if (info.include_usage) {
            int n_prompt, n_completion;
            completion_usage(c, &n_prompt, &n_completion);
            char *chunk = api_format_usage_chunk(&info, n_prompt, n_completion);
            if (chunk)
                sse_send(g, chunk);
            free(chunk);
        }
        sse_send(g, "[DONE]");
        httpconn_set_close_cb(g->srv->conns, g->conn, NULL, NULL);
        stream_end(g);
    } else {
        char *body;
        if (info.kind == API_RESPONSES) {
            responses_info ri = resp_info(g, c);
            size_t len;
            const char *finish, *text = completion_choice_text(c, 0, &len, &finish);
            int n_in, n_out;
            completion_usage(c, &n_in, &n_out);
            body = responses_format_object(&ri, responses_status(finish), text, len, n_in, n_out,
                                           NULL);
            resp_store(g, c, body);
        } else {
            body = completion_format_response(c);
        }
        httpconn_set_close_cb(g->srv->conns, g->conn, NULL, NULL);
        if (body)
            http_reply_json(g->req, 200, body);
        else
            http_reply_error_msg(g->req, 500, "server_error", NULL, NULL,
                                 "could not format the response");
        free(body);
    }
    g->req = NULL;
    return 0;
}

static stats_end_t sink_fail(void *ud, const completion_t *c, const api_error *e)
{
    gw_req *g = ud;
    settle(g, c);
    httpconn_set_close_cb(g->srv->conns, g->conn, NULL, NULL);
    if (g->slow) {
        /* Nothing more can reach it: what waits is dropped with the connection now, not
         * after --http-timeout-s of it taking nothing (the buffer is already at the cap).
         * The evhttp request goes with the connection. */
        if (g->srv->cx.stats)
            stats_http_event(g->srv->cx.stats, STATS_HTTP_SLOW_CLIENT);
        struct evhttp_connection *conn = g->conn;
        g->req = NULL;
        g->conn = NULL;
        evhttp_connection_free(conn);
        return STATS_END_FAILED;
    }
    if (completion_streaming(c) && completion_info(c).kind == API_RESPONSES) {
        responses_info ri = resp_info(g, c);
        sse_send_named(g, "error", responses_event_error(g->seq++, e));
        sse_send_named(g, "response.failed",
                       responses_event_response(&ri, "response.failed", g->seq++,
                                                RESPONSES_FAILED, NULL, 0, 0, 0, e));
        stream_end(g);
    } else if (completion_streaming(c)) {
        /* headers are out: report in the stream, then end it as usual */
        char *body = api_error_json(e);
        if (body)
            sse_send(g, body);
        free(body);
        sse_send(g, "[DONE]");
        stream_end(g);
    } else {
        http_reply_error(g->req, e);
    }
    g->req = NULL;
    return STATS_END_FAILED;
}

static const completion_sink sink = {.text = sink_text,
                                     .check = sink_check,
                                     .choice_end = sink_choice_end,
                                     .done = sink_done,
                                     .fail = sink_fail,
                                     .release = req_free,
                                     .admit = sink_admit};

/* The client went away: cancel wherever the request is and forget it. */
static void on_close(struct evhttp_connection *conn, void *arg)
{
    gw_req *g = arg;
    (void)conn;
    log_rinfo(completion_rid(g->c), "client disconnected: cancelling");
    settle(g, g->c);
    /* libevent detached the request (evcon == NULL) and leaves it to us, or it is still
     * attached and libevent frees it right after this callback. */
    if (g->req && evhttp_request_get_connection(g->req) == NULL)
        evhttp_request_free(g->req);
    g->req = NULL;
    completion_cancel(&g->c, 499, "client disconnected");
}

/* After a FIN: whether the socket got a reset (the peer's answer to the interim 100 when
 * it closed its socket, or a close with our 100 unread) or an error: the client is gone.
 * Checked every HTTP_PROBE_MS while the request runs. */
#define HTTP_PROBE_MS 200

static void on_probe(evutil_socket_t fd, short what, void *arg)
{
    gw_req *g = arg;
    (void)what;
    int err = 0;
    socklen_t len = sizeof(err);
    struct tcp_info ti;
    socklen_t tlen = sizeof(ti);
    int gone = getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0 || err != 0 ||
               (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &tlen) == 0 &&
                ti.tcpi_state == TCP_CLOSE);
    if (gone)
        evhttp_connection_free(g->conn); /* runs on_close, which cancels and frees g */
}

/* Non-streaming requests: libevent 2.1 does not read from a connection while its request
 * awaits the reply, so it would not notice the client leaving; nor, with stream_no_read,
 * during a stream. We watch the socket ourselves: an error means the client is gone; data (a pipelined request) means it is
 * not, and we stop watching. A FIN (EOF) means the client closed its socket, or only its
 * sending side (shutdown(SHUT_WR) after the request, as some clients and proxies do) and
 * still waits for the reply: only a write tells which. An HTTP/1.1 client gets an interim
 * "100 Continue" (RFC 9110 15.2: a client MUST parse a 1xx response it did not expect),
 * which a closed socket answers with a reset (on_probe); a stream's client a keep-alive
 * comment, the same probe; a non-streaming HTTP/1.0 one, which must not get a 1xx, is taken
 * as gone, as before. */
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
    static const char probe[] = "HTTP/1.1 100 Continue\r\n\r\n";
    struct timeval tv = {0, HTTP_PROBE_MS * 1000};
    int streaming = completion_streaming(g->c);
    if (n == 0 && g->req && (streaming || (g->req->major == 1 && g->req->minor >= 1)) &&
        (g->probe_ev = event_new(g->srv->base, fd, EV_PERSIST, on_probe, g)) != NULL &&
        event_add(g->probe_ev, &tv) == 0) {
        if (streaming) { /* the stream's own comment is the probe */
            static const char ka[] = ": keep-alive\n\n";
            sse_send_event(g, ka, sizeof(ka) - 1);
        } else if (send(fd, probe, sizeof(probe) - 1, MSG_NOSIGNAL | MSG_DONTWAIT) !=
                   (ssize_t)(sizeof(probe) - 1)) {
            evhttp_connection_free(g->conn); /* runs on_close, which cancels and frees g */
            return;
        }
        log_rdebug(completion_rid(g->c), "the client half-closed: waiting for its reply");
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

// --- the handler

void http_completion_handle(http_server_t *s, struct evhttp_request *req, api_kind_t kind,
                            auth_key *key)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    api_error e;
    gw_req *g = calloc(1, sizeof(*g));
    if (!g) {
        http_reply_error_msg(req, 500, "server_error", NULL, NULL, "out of memory");
        return;
    }
    g->srv = s;
    g->req = req;
    g->conn = evhttp_request_get_connection(req);
    g->key = key;
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
        } else if (g->retry_after_s > 0) { /* the key's tokens/s limit (sink_admit) */
            char ra[16];
            snprintf(ra, sizeof(ra), "%d", g->retry_after_s);
            evhttp_add_header(evhttp_request_get_output_headers(req), "Retry-After", ra);
        }
        settle(g, NULL); /* admitted by sink_admit, then refused by the cluster */
        free(g);
        http_reply_error(req, &e);
        return;
    }
    httpconn_set_close_cb(g->srv->conns, g->conn, on_close, g);
    if (!completion_streaming(g->c)) {
        watch_close(g);
        return;
    }
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Content-Type", "text/event-stream");
    evhttp_add_header(h, "Cache-Control", "no-cache");
    if (req->major == 1 && req->minor == 0) {
        /* HTTP/1.0 has no chunked encoding: the stream ends with the connection (RFC 9112
         * 6.3). libevent 2.1 answered a 1.0 client that asked for keep-alive with
         * "Connection: keep-alive" and "Content-Length: 0" before the events and then kept
         * the connection open: the client read an empty body, or waited for the end. */
        evhttp_remove_header(evhttp_request_get_input_headers(req), "Connection");
        evhttp_add_header(h, "Connection", "close");
    }
    evhttp_send_reply_start(req, 200, "OK");
    stream_no_read(g);
    watch_close(g);
    stream_timers(g);
    if (kind == API_RESPONSES)
        resp_stream_start(g, g->c);
    if (kind == API_CHAT) { /* each choice's first delta: its role */
        api_response_info info = completion_info(g->c);
        for (info.index = 0; info.index < completion_n_choices(g->c); info.index++) {
            char *chunk = api_format_chunk(&info, NULL, 0, NULL, 1);
            if (chunk)
                sse_send(g, chunk);
            free(chunk);
        }
    }
}

void http_completion_abandon_all(http_server_t *s)
{
    while (s->active.head) {
        gw_req *g = completion_ud(s->active.head);
        httpconn_set_close_cb(g->srv->conns, g->conn, NULL, NULL);
        g->req = NULL;             /* evhttp_free frees the requests */
        completion_destroy(&g->c); /* cancels it in the cluster; frees g */
    }
}
