/*
 * bench_flight: one request in flight (bench_flight.h): its connection and request
 * (flight_send), the response's callbacks (chunks, errors, the end), the SSE events of a 200
 * (flight_on_event), and the one place a flight ends (flight_end) and is freed
 * (flight_reap_cb).
 */
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/util.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

#include "bench.h"
#include "bench_flight.h"
#include "bench_sse.h"
#include "bench_workload.h"

typedef struct bench_flight {
    bench *b;
    size_t idx;                       /* record index */
    struct bench_flight *prev, *next; /* b->active list, while not finished */
    struct evhttp_connection *conn;
    struct event *timer;            /* --timeout-s deadline */
    struct event *reap;             /* deferred teardown */
    bench_flight_freed_fn on_freed; /* after the teardown */
    int64_t t_send_ns;
    int64_t t_first_ns, t_last_ns; /* first / latest content chunk */
    int64_t t_chunk_ns;            /* arrival of the bytes being parsed */
    int finished;
    int status;       /* HTTP status, 0 until known */
    int has_http_err; /* the error callback ran */
    enum evhttp_request_error http_err;
    int http_errno;
    int got_body; /* any body byte received */
    bench_sse_t *sse;
    size_t n_events;
    uint32_t n_chunks; /* non-empty content chunks */
    float *itl;        /* ms, n_itl of cap_itl */
    uint32_t n_itl, cap_itl;
    long long usage_prompt, usage_completion; /* -1 until seen */
    int done_seen, finish_seen;
    char errbody[BENCH_FLIGHT_ERRBODY_MAX + 1];
    size_t n_errbody;
    char *text; /* multi-turn: the content streamed so far (n_text of cap_text bytes) */
    size_t n_text, cap_text;
} flight;

/* Equal when digits are skipped: "closed after 2 events" and "... 7 events" are one
 * cause, "Too many open files" and "Connection reset by peer" are two. */
static int same_but_digits(const char *x, const char *y)
{
    for (;;) {
        while (*x >= '0' && *x <= '9')
            x++;
        while (*y >= '0' && *y <= '9')
            y++;
        if (*x != *y)
            return 0;
        if (!*x)
            return 1;
        x++, y++;
    }
}

/* Count a failure in its group (kind, HTTP status, message up to digits) and log the
 * first failure of the run at once. */
static void bench_note_error(bench *b, size_t idx, int kind, int status, const char *msg)
{
    if (!b->first_error_logged) {
        b->first_error_logged = 1;
        if (b->progress_drawn)
            fputc('\n', stderr);
        log_warn("request %zu failed: %s", idx, msg);
    }
    for (size_t i = 0; i < b->n_groups; i++) {
        if (b->groups[i].kind == kind && b->groups[i].status == status &&
            same_but_digits(b->groups[i].msg, msg)) {
            b->groups[i].count++;
            return;
        }
    }
    if (b->n_groups == BENCH_ERR_GROUPS_MAX) {
        b->n_ungrouped++;
        return;
    }
    bench_err_group *g = &b->groups[b->n_groups++];
    g->kind = kind;
    g->status = status;
    g->count = 1;
    snprintf(g->msg, sizeof(g->msg), "%s", msg);
}

/* Append n bytes of streamed content to fl->text (NUL-terminated). 0, or -1 on OOM. */
static int flight_add_text(flight *fl, const char *s, size_t n)
{
    if (fl->n_text + n + 1 > fl->cap_text) {
        size_t c = fl->cap_text ? fl->cap_text : 256;
        while (c < fl->n_text + n + 1)
            c *= 2;
        char *nt = realloc(fl->text, c);
        if (!nt)
            return -1;
        fl->text = nt;
        fl->cap_text = c;
    }
    memcpy(fl->text + fl->n_text, s, n);
    fl->n_text += n;
    fl->text[fl->n_text] = 0;
    return 0;
}

/* End a flight, once: fill its record, count it, schedule the teardown. ok = 1 for a
 * success (kind and fmt ignored). */
static void flight_end(flight *fl, int ok, bench_fail_t kind, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void flight_end(flight *fl, int ok, bench_fail_t kind, const char *fmt, ...)
{
    if (fl->finished)
        return;
    fl->finished = 1;
    bench *b = fl->b;
    bench_rec *r = &b->recs[fl->idx];
    int64_t t = bench_now_ns();
    r->e2el_ms = (double)(t - fl->t_send_ns) / 1e6;
    r->ttft_ms = fl->n_chunks ? (double)(fl->t_first_ns - fl->t_send_ns) / 1e6 : -1;
    r->http_status = fl->status;
    r->output_from_usage = fl->usage_completion >= 0;
    r->output_tokens = r->output_from_usage ? fl->usage_completion : fl->n_chunks;
    r->prompt_from_usage = fl->usage_prompt >= 0;
    r->prompt_tokens = r->prompt_from_usage ? fl->usage_prompt : r->prompt_words;
    if (ok && fl->text) { /* the reply goes into the conversation's next turn */
        r->reply = fl->text;
        fl->text = NULL;
    }
    /* Move the ITL samples to the pool (bounded). */
    r->itl_off = b->n_itl_pool;
    if (fl->n_itl > 0 && b->n_itl_pool + fl->n_itl <= BENCH_ITL_POOL_MAX) {
        if (b->n_itl_pool + fl->n_itl > b->cap_itl_pool) {
            size_t c = b->cap_itl_pool ? b->cap_itl_pool : 4096;
            while (c < b->n_itl_pool + fl->n_itl)
                c *= 2;
            float *np = realloc(b->itl_pool, c * sizeof(float));
            if (np) {
                b->itl_pool = np;
                b->cap_itl_pool = c;
            }
        }
        if (b->n_itl_pool + fl->n_itl <= b->cap_itl_pool) {
            memcpy(b->itl_pool + b->n_itl_pool, fl->itl, fl->n_itl * sizeof(float));
            b->n_itl_pool += fl->n_itl;
            r->n_itl = fl->n_itl;
        }
    }
    if (r->n_itl != fl->n_itl)
        b->n_itl_dropped += fl->n_itl;
    if (ok) {
        r->state = BENCH_REC_OK;
        b->n_ok++;
    } else {
        char msg[BENCH_ERROR_MSG_MAX];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof(msg), fmt, ap);
        va_end(ap);
        r->state = BENCH_REC_FAILED;
        r->fail_kind = (uint8_t)kind;
        r->error = strdup(msg);
        b->n_failed++;
        bench_note_error(b, fl->idx, kind, kind == BENCH_FAIL_HTTP ? fl->status : 0, msg);
    }
    b->n_done++;
    b->in_flight--;
    b->t_end_ns = t;
    if (fl->prev)
        fl->prev->next = fl->next;
    else
        b->active = fl->next;
    if (fl->next)
        fl->next->prev = fl->prev;
    fl->prev = fl->next = NULL;
    event_active(fl->reap, 0, 0);
}

/* Deferred teardown: runs from the loop, outside every callback of this connection.
 * evhttp_connection_free() frees a still-pending request without calling its callbacks. */
static void flight_reap_cb(evutil_socket_t fd, short what, void *arg)
{
    flight *fl = arg;
    bench *b = fl->b;
    bench_flight_freed_fn on_freed = fl->on_freed;
    (void)fd, (void)what;
    if (fl->conn)
        evhttp_connection_free(fl->conn);
    event_free(fl->timer);
    event_free(fl->reap);
    bench_sse_destroy(&fl->sse);
    free(fl->itl);
    free(fl->text);
    free(fl);
    b->n_live--;
    on_freed(b);
}

/* The deadline of request idx in s: --offline-timeout-s for an offline one (--trace) when
 * set, else --timeout-s. */
static double flight_timeout_s(const bench *b, size_t idx)
{
    return b->recs[idx].offline && b->a.offline_timeout_s > 0 ? b->a.offline_timeout_s
                                                              : b->a.timeout_s;
}

static void flight_timeout_cb(evutil_socket_t fd, short what, void *arg)
{
    flight *fl = arg;
    (void)fd, (void)what;
    int off = fl->b->recs[fl->idx].offline && fl->b->a.offline_timeout_s > 0;
    flight_end(fl, 0, BENCH_FAIL_TIMEOUT, "no complete response within %g s (%s)%s",
               flight_timeout_s(fl->b, fl->idx), off ? "--offline-timeout-s" : "--timeout-s",
               fl->n_chunks ? " (stream started)" : "");
}

/* The message of an OpenAI error value: {"message": ...} or a string. */
static const char *error_value_message(const json_t *e)
{
    if (json_is_string(e))
        return json_string_value(e);
    const json_t *m = json_object_get(e, "message");
    if (json_is_string(m))
        return json_string_value(m);
    m = json_object_get(e, "detail"); /* FastAPI style */
    return json_is_string(m) ? json_string_value(m) : NULL;
}

/* Printable copy of at most n bytes of s (control bytes become spaces). */
static void printable(char *dst, size_t cap, const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n && k + 1 < cap; i++)
        dst[k++] = (unsigned char)s[i] < 0x20 ? ' ' : s[i];
    dst[k] = 0;
}

/* One SSE event of a 200 response. Returns 0 to go on, 1 when the flight has ended. */
static int flight_on_event(void *ctx, const char *event, const char *data, size_t n)
{
    flight *fl = ctx;
    char shown[160];
    fl->n_events++;
    if (strcmp(event, "error") == 0) {
        printable(shown, sizeof(shown), data, n);
        flight_end(fl, 0, BENCH_FAIL_STREAM_ERROR, "error event in the stream: %s", shown);
        return 1;
    }
    if (n == 6 && memcmp(data, "[DONE]", 6) == 0) {
        fl->done_seen = 1;
        return 0;
    }
    json_error_t je;
    json_t *j = json_loadb(data, n, 0, &je);
    if (!j || !json_is_object(j)) {
        printable(shown, sizeof(shown), data, n < 80 ? n : 80);
        flight_end(fl, 0, BENCH_FAIL_PROTOCOL, "invalid JSON in the stream: '%s'", shown);
        json_decref(j);
        return 1;
    }
    const json_t *err = json_object_get(j, "error");
    if (err && !json_is_null(err)) {
        const char *m = error_value_message(err);
        flight_end(fl, 0, BENCH_FAIL_STREAM_ERROR, "error in the stream: %s",
                   m ? m : "(no message)");
        json_decref(j);
        return 1;
    }
    const json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
    if (c0) {
        const json_t *text = json_object_get(c0, "text");
        if (!json_is_string(text)) {
            const json_t *delta = json_object_get(c0, "delta");
            text = json_object_get(delta, "content");
            if (!json_is_string(text) || json_string_length(text) == 0)
                text = json_object_get(delta, "reasoning_content");
        }
        if (json_is_string(text) && json_string_length(text) > 0) {
            if (fl->n_chunks == 0) {
                fl->t_first_ns = fl->t_chunk_ns;
            } else if (fl->n_itl < BENCH_FLIGHT_ITL_MAX) {
                if (fl->n_itl == fl->cap_itl) {
                    uint32_t c = fl->cap_itl ? fl->cap_itl * 2 : 64;
                    float *ni = realloc(fl->itl, c * sizeof(float));
                    if (!ni) {
                        flight_end(fl, 0, BENCH_FAIL_LOCAL, "out of memory");
                        json_decref(j);
                        return 1;
                    }
                    fl->itl = ni;
                    fl->cap_itl = c;
                }
                fl->itl[fl->n_itl++] = (float)((double)(fl->t_chunk_ns - fl->t_last_ns) / 1e6);
            } else {
                fl->b->n_itl_dropped++;
            }
            fl->t_last_ns = fl->t_chunk_ns;
            fl->n_chunks++;
            if (bench_workload_multi_turn(&fl->b->a) &&
                flight_add_text(fl, json_string_value(text), json_string_length(text)) < 0) {
                flight_end(fl, 0, BENCH_FAIL_LOCAL, "out of memory");
                json_decref(j);
                return 1;
            }
        }
        if (json_is_string(json_object_get(c0, "finish_reason")))
            fl->finish_seen = 1;
    }
    const json_t *usage = json_object_get(j, "usage");
    if (json_is_object(usage)) {
        const json_t *ct = json_object_get(usage, "completion_tokens");
        const json_t *pt = json_object_get(usage, "prompt_tokens");
        if (json_is_integer(ct) && json_integer_value(ct) >= 0)
            fl->usage_completion = json_integer_value(ct);
        if (json_is_integer(pt) && json_integer_value(pt) >= 0)
            fl->usage_prompt = json_integer_value(pt);
    }
    json_decref(j);
    return 0;
}

/* Take everything in the response's input buffer: SSE for a 200, kept (bounded) as the
 * error text otherwise. */
static void flight_consume(flight *fl, struct evbuffer *in)
{
    char tmp[16384];
    while (!fl->finished && evbuffer_get_length(in) > 0) {
        int n = evbuffer_remove(in, tmp, sizeof(tmp));
        if (n <= 0)
            break;
        fl->got_body = 1;
        /* the first bytes of the body: the error text of a non-200, a clue for a 200
         * that is not an event stream */
        size_t k = (size_t)n;
        if (k > BENCH_FLIGHT_ERRBODY_MAX - fl->n_errbody)
            k = BENCH_FLIGHT_ERRBODY_MAX - fl->n_errbody;
        memcpy(fl->errbody + fl->n_errbody, tmp, k);
        fl->n_errbody += k;
        fl->errbody[fl->n_errbody] = 0;
        if (fl->status != 200)
            continue;
        int rc = bench_sse_feed(fl->sse, tmp, (size_t)n, flight_on_event, fl);
        if (rc == BENCH_SSE_ERR_TOO_LARGE)
            flight_end(fl, 0, BENCH_FAIL_PROTOCOL, "SSE event larger than %u bytes",
                       BENCH_FLIGHT_SSE_MAX_BYTES);
        else if (rc == BENCH_SSE_ERR_NOMEM)
            flight_end(fl, 0, BENCH_FAIL_LOCAL, "out of memory");
    }
}

static void flight_chunk_cb(struct evhttp_request *req, void *arg)
{
    flight *fl = arg;
    if (fl->finished)
        return;
    fl->t_chunk_ns = bench_now_ns();
    if (!fl->status)
        fl->status = evhttp_request_get_response_code(req);
    flight_consume(fl, evhttp_request_get_input_buffer(req));
}

static void flight_error_cb(enum evhttp_request_error err, void *arg)
{
    flight *fl = arg;
    fl->has_http_err = 1;
    fl->http_err = err;
    fl->http_errno = EVUTIL_SOCKET_ERROR();
}

/* The request is over for libevent: req is NULL after a connection-level failure (and
 * already freed); otherwise it is freed when this returns. */
static void flight_done_cb(struct evhttp_request *req, void *arg)
{
    flight *fl = arg;
    if (fl->finished)
        return;
    fl->t_chunk_ns = bench_now_ns();
    if (!req || evhttp_request_get_response_code(req) == 0) {
        const char *why = "connection failed";
        if (fl->has_http_err) {
            switch (fl->http_err) {
            case EVREQ_HTTP_TIMEOUT:
                flight_end(fl, 0, BENCH_FAIL_TIMEOUT, "no data from the server for %g s",
                           flight_timeout_s(fl->b, fl->idx));
                return;
            case EVREQ_HTTP_EOF:
                why = "connection closed";
                break;
            case EVREQ_HTTP_INVALID_HEADER:
                flight_end(fl, 0, BENCH_FAIL_PROTOCOL, "invalid HTTP response");
                return;
            case EVREQ_HTTP_DATA_TOO_LONG:
                flight_end(fl, 0, BENCH_FAIL_PROTOCOL, "HTTP response too large");
                return;
            default:
                break;
            }
        }
        if (fl->status == 200 || fl->got_body)
            flight_end(fl, 0, BENCH_FAIL_CLOSED,
                       "server closed the connection mid-stream (after %zu events)", fl->n_events);
        else if (!fl->has_http_err) /* libevent 2.1's connect-failure path: no error cb */
            flight_end(fl, 0, BENCH_FAIL_CONNECT,
                       "cannot connect to %s port %u (refused, "
                       "unreachable or timed out)",
                       fl->b->host_addr, fl->b->port);
        else if (fl->http_errno)
            flight_end(fl, 0, BENCH_FAIL_CONNECT, "connection error before a response: %s",
                       evutil_socket_error_to_string(fl->http_errno));
        else
            flight_end(fl, 0, BENCH_FAIL_CONNECT, "%s before a response", why);
        return;
    }
    fl->status = evhttp_request_get_response_code(req);
    flight_consume(fl, evhttp_request_get_input_buffer(req));
    if (fl->finished)
        return;
    if (fl->status != 200) {
        char shown[200];
        json_error_t je;
        json_t *j = json_loadb(fl->errbody, fl->n_errbody, 0, &je);
        const char *m = j ? error_value_message(json_object_get(j, "error")) : NULL;
        if (!m && j)
            m = error_value_message(j);
        printable(shown, sizeof(shown), m ? m : fl->errbody, m ? strlen(m) : fl->n_errbody);
        flight_end(fl, 0, BENCH_FAIL_HTTP, "HTTP %d: %s", fl->status,
                   shown[0] ? shown : "(empty body)");
        json_decref(j);
        return;
    }
    int rc = bench_sse_finish(fl->sse, flight_on_event, fl);
    if (fl->finished)
        return;
    if (rc == BENCH_SSE_ERR_NOMEM)
        flight_end(fl, 0, BENCH_FAIL_LOCAL, "out of memory");
    else if (fl->n_events == 0)
        flight_end(fl, 0, BENCH_FAIL_PROTOCOL,
                   "no SSE event in the 200 response (does the server "
                   "stream? body starts '%.60s')",
                   fl->errbody);
    else if (!fl->done_seen && !fl->finish_seen)
        flight_end(fl, 0, BENCH_FAIL_CLOSED,
                   "stream ended without [DONE] or a finish_reason "
                   "(after %zu events)",
                   fl->n_events);
    else if (fl->n_chunks == 0)
        flight_end(fl, 0, BENCH_FAIL_NO_CONTENT, "no content in the stream (empty completion)");
    else
        flight_end(fl, 1, 0, "ok");
}

/* Create the connection and request of flight fl and send it. 0, or -1 (fl not ended;
 * the caller ends it with the message in why). */
static int flight_send(flight *fl, const char *body, const char **why)
{
    bench *b = fl->b;
    *why = "cannot create the connection";
    fl->conn = evhttp_connection_base_new(b->base, NULL, b->host_addr, b->port);
    if (!fl->conn)
        return -1;
    /* libevent's inactivity timeout only backs up the request deadline, which fires
     * first and names the cause. */
    struct timeval tv = bench_timeval(flight_timeout_s(b, fl->idx) + 1);
    evhttp_connection_set_timeout_tv(fl->conn, &tv);
    evhttp_connection_set_max_headers_size(fl->conn, 65536);
    evhttp_connection_set_retries(fl->conn, 0);
    *why = "cannot create the request";
    struct evhttp_request *req = evhttp_request_new(flight_done_cb, fl);
    if (!req)
        return -1;
    evhttp_request_set_chunked_cb(req, flight_chunk_cb);
    evhttp_request_set_error_cb(req, flight_error_cb);
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    if (evhttp_add_header(h, "Host", b->host_header) < 0 ||
        evhttp_add_header(h, "Content-Type", "application/json") < 0 ||
        evhttp_add_header(h, "Accept", "text/event-stream") < 0 ||
        evhttp_add_header(h, "User-Agent", "tidepool-bench") < 0 ||
        (b->authorization && evhttp_add_header(h, "Authorization", b->authorization) < 0) ||
        evbuffer_add(evhttp_request_get_output_buffer(req), body, strlen(body)) < 0) {
        evhttp_request_free(req);
        return -1;
    }
    *why = "cannot send the request";
    if (evhttp_make_request(fl->conn, req, EVHTTP_REQ_POST, b->path) != 0)
        return -1; /* libevent freed req */
    return 0;
}

void bench_flight_start(bench *b, size_t idx, bench_flight_freed_fn on_freed)
{
    bench_rec *r = &b->recs[idx];
    int64_t t = bench_now_ns();
    r->start_s = (double)(t - b->t0_ns) / 1e9;
    r->phase = BENCH_WORKLOAD_PHASE_NONE;
    if (bench_workload_phase_shift(&b->a)) {
        /* Scheduled arrivals keep the phase of each request reproducible; without a
         * schedule the send time decides. */
        double at = isfinite(b->a.request_rate) ? r->arrival_s : r->start_s;
        r->phase = (int8_t)bench_workload_phase_at(&b->a, at);
    }
    b->n_sent++;
    b->in_flight++;
    if (b->in_flight > b->peak_in_flight)
        b->peak_in_flight = b->in_flight;
    r->state = BENCH_REC_RUNNING;
    flight *fl = calloc(1, sizeof(*fl));
    struct event *reap = fl ? event_new(b->base, -1, 0, flight_reap_cb, fl) : NULL;
    struct event *timer = reap ? evtimer_new(b->base, flight_timeout_cb, fl) : NULL;
    bench_sse_t *sse = timer ? bench_sse_new(BENCH_FLIGHT_SSE_MAX_BYTES) : NULL;
    if (!sse) { /* nothing of libevent's holds fl: record the failure here */
        if (timer)
            event_free(timer);
        if (reap)
            event_free(reap);
        free(fl);
        r->state = BENCH_REC_FAILED;
        r->fail_kind = BENCH_FAIL_LOCAL;
        r->error = strdup("out of memory (flight)");
        b->n_failed++;
        b->n_done++;
        b->in_flight--;
        b->t_end_ns = bench_now_ns();
        bench_note_error(b, idx, BENCH_FAIL_LOCAL, 0, "out of memory (flight)");
        return;
    }
    b->n_live++;
    fl->b = b;
    fl->idx = idx;
    fl->reap = reap;
    fl->on_freed = on_freed;
    fl->timer = timer;
    fl->t_send_ns = t;
    fl->usage_prompt = fl->usage_completion = -1;
    fl->sse = sse;
    fl->next = b->active;
    if (b->active)
        b->active->prev = fl;
    b->active = fl;

    bench_workload_shape shape = {0, -1};
    char *body;
    if (b->trace) { /* token ids: prompt_words is the prompt's length in tokens */
        const bench_trace_req *q = bench_trace_at(b->trace, idx);
        body = bench_trace_body(b->trace, &b->a, b->model, idx);
        shape.prompt_words = q->prompt_tokens;
        shape.max_tokens = q->output_tokens;
    } else {
        body = bench_workload_body(&b->a, b->ds, b->model, b->chat, idx, r->phase, &shape);
    }
    r->prompt_words = shape.prompt_words;
    r->max_tokens = shape.max_tokens;
    if (!body) {
        flight_end(fl, 0, BENCH_FAIL_LOCAL, "out of memory building the request body");
        return;
    }
    const char *why;
    int rc = flight_send(fl, body, &why);
    free(body);
    if (fl->finished)
        return;
    if (rc < 0) {
        flight_end(fl, 0, BENCH_FAIL_LOCAL, "%s", why);
        return;
    }
    struct timeval tv = bench_timeval(flight_timeout_s(b, idx));
    if (evtimer_add(fl->timer, &tv) < 0)
        flight_end(fl, 0, BENCH_FAIL_LOCAL, "cannot arm the request timer");
}

void bench_flight_interrupt_all(bench *b, const char *why)
{
    while (b->active)
        flight_end(b->active, 0, BENCH_FAIL_INTERRUPTED, "interrupted (%s)", why);
}
