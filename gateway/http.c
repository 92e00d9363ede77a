/* http: see http.h. This file is the server: the listener (accept errors, limits, time-outs),
 * request routing by path and method with the 404 / 405 / 400 replies, the response
 * counter, and the server's life; the completion endpoints are http_completion.c, the
 * admin and model endpoints http_admin.c (http_internal.h: what they share). */
#include "http.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/http_struct.h>
#include <event2/keyvalq_struct.h>
#include <event2/listener.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>

#include "http_internal.h"
#include "log.h"
#include "protocol.h"

// --- replies

/* The reason phrase of status where libevent 2.1's differs from RFC 9110's (NULL: libevent's
 * own; clients ignore the phrase, people read it). */
static const char *reason_phrase(int status)
{
    switch (status) {
    case 413: /* httpconn.c's refusals say the same */
        return "Content Too Large"; /* libevent: "Request Entity Too Large" (RFC 2616's) */
    case 429:
        return "Too Many Requests"; /* libevent 2.1 has none: "Client Error" (RFC 6585 4) */
    case 505:
        return "HTTP Version Not Supported"; /* libevent: "HTTP Version not supported" */
    default:
        return NULL;
    }
}

void http_send_reply(struct evhttp_request *req, int status, struct evbuffer *body)
{
    if (evhttp_request_get_command(req) == EVHTTP_REQ_HEAD) {
        char len[32];
        snprintf(len, sizeof len, "%zu", body ? evbuffer_get_length(body) : (size_t)0);
        struct evkeyvalq *h = evhttp_request_get_output_headers(req);
        evhttp_remove_header(h, "Content-Length");
        evhttp_add_header(h, "Content-Length", len);
        if (body)
            evbuffer_drain(body, evbuffer_get_length(body));
    }
    evhttp_send_reply(req, status, reason_phrase(status), body);
}

void http_reply_json(struct evhttp_request *req, int status, const char *body)
{
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Content-Type", "application/json");
    struct evbuffer *b = evbuffer_new();
    if (b && body)
        evbuffer_add(b, body, strlen(body));
    http_send_reply(req, status, b);
    if (b)
        evbuffer_free(b);
}

void http_reply_error(struct evhttp_request *req, const api_error *e)
{
    char *body = api_error_json(e);
    http_reply_json(req, e->status, body ? body : "{\"error\":{\"message\":\"out of memory\"}}");
    free(body);
}

void http_reply_error_msg(struct evhttp_request *req, int status, const char *type,
                          const char *param, const char *code, const char *msg)
{
    api_error e;
    api_error_set(&e, status, type, param, code, "%s", msg);
    http_reply_error(req, &e);
}

/* libevent's own error replies, in the OpenAI JSON error shape instead of its HTML page.
 *
 * libevent answers by itself a request it could not parse or will not take: a malformed
 * request line or header (400), a request line or header block over
 * evhttp_set_max_headers_size or a body over evhttp_set_max_body_size (413), a method
 * outside evhttp_set_allowed_methods (501), a failed "Expect" (417). All of these go
 * through evhttp_send_error(), which in 2.1 writes an HTML page; 2.2 has evhttp_set_errorcb
 * for exactly this, 2.1.12 (Debian 12) has no hook. So the gateway executable defines
 * evhttp_send_error itself: libevent-2.1.so.7 calls it through its PLT
 * (evhttp_send_error@plt, from evhttp_handle_request and evhttp_get_body), and the dynamic
 * linker binds that call to the executable's definition, which comes first in the lookup
 * order (ld exports it in the executable's dynamic symbol table because the library defines
 * it: `nm -D build/bin/gateway` lists it as T). The gateway's own handlers never call it.
 * It uses only the public API. tests/integration/test_http_errors.py (RawErrors) sends
 * those requests over raw sockets and checks the JSON, so a libevent built otherwise (a
 * static or -Bsymbolic build, where the override would be silently bypassed) fails the
 * test. The connection is closed after the reply, as libevent's own page does: after a
 * parse error the rest of the stream cannot be trusted. A chunk-size line that
 * http_wire.c's evutil_strtoll refused is answered 400 bad_framing (malformed) or 413 (too
 * long) with its own message, where libevent says 413 for both. */
static void on_reply_done(struct evhttp_request *req, void *arg);
#define HTTP_VERSION_MSG                                                                 \
    "The request's HTTP version is not supported (RFC 9110 15.6.6): this server speaks " \
    "HTTP/1.0 and HTTP/1.1."
#define HTTP_STR_(x) #x
#define HTTP_STR(x) HTTP_STR_(x)
/* The server whose stats count libevent's error replies (one server per process; NULL: not
 * counted). */
static http_server_t *error_server;

void evhttp_send_error(struct evhttp_request *req, int error, const char *reason)
{
    const char *code, *msg;
    /* a chunk-size line our evutil_strtoll refused (http_wire.c): libevent says 413 for
     * every body it cannot read */
    http_chunk_refusal_t chunk = error == 413 ? http_wire_chunk_refusal() : HTTP_CHUNK_OK;
    if (chunk == HTTP_CHUNK_MALFORMED)
        error = 400;
    else if (error == 400 && error_server &&
             httpconn_request_version(error_server->conns, evhttp_request_get_connection(req)) ==
                 HTTPCONN_REQ_VERSION)
        error = 505; /* "HTTP/2.0", "HTTP/9.9": a version libevent refuses (major > 1) */
    switch (error) {
    case 400:
        code = chunk ? "bad_framing" : "bad_request";
        msg = chunk ? "A chunk-size line of the body is malformed: it must be the size in hex "
                      "digits, then optional extensions ;name or ;name=value (RFC 9112 7.1)."
                    : "The request could not be parsed: a malformed request line or header, or "
                      "a request line or header block over the server's limit (64 KiB).";
        break;
    case 413:
        code = "request_too_large";
        msg = chunk ? "A chunk-size line of the body, with its extensions, is over "
                      HTTP_STR(HTTP_CHUNK_LINE_MAX) " bytes."
                    : "The request line, its headers or its body exceed this server's limits.";
        break;
    case 417:
        code = "expectation_failed";
        msg = "The Expect header is not supported (only 100-continue is).";
        break;
    case 501:
        code = "method_not_implemented";
        msg = "This HTTP method is not supported.";
        break;
    case 505:
        code = "http_version_not_supported";
        msg = HTTP_VERSION_MSG;
        break;
    default:
        code = "http_error";
        msg = "The request was refused by the HTTP layer.";
        break;
    }
    if ((req->major == 0 && req->minor == 0) || error == 505) {
        /* no valid request line, or a version we do not speak: answer HTTP/1.1 */
        req->major = 1;
        req->minor = 1;
    }
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_clear_headers(h);
    evhttp_add_header(h, "Connection", "close");
    if (error_server) /* counted in tidepool_http_responses_total like every reply */
        evhttp_request_set_on_complete_cb(req, on_reply_done, error_server);
    api_error e;
    api_error_set(&e, error, "invalid_request_error", NULL, code, "%s", msg);
    char *body = api_error_json(&e);
    http_reply_json(req, error, body ? body : "{\"error\":{\"message\":\"out of memory\"}}");
    free(body);
    (void)reason; /* the status line's phrase is libevent's standard one */
}

static int64_t now_s(void)
{
    return (int64_t)time(NULL);
}

// --- routing

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
    httpconn_reply_done(s->conns, evhttp_request_get_connection(req));
}

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

/* Whether v is a Content-Length value: 1*DIGIT between optional whitespace (RFC 9110
 * 8.6). libevent reads it with strtoll, which also takes "+48" and "-0". */
static int content_length_ok(const char *v)
{
    while (*v == ' ' || *v == '\t')
        v++;
    const char *d = v;
    while (*v >= '0' && *v <= '9')
        v++;
    if (v == d)
        return 0;
    while (*v == ' ' || *v == '\t')
        v++;
    return *v == 0;
}

/* Whether the NUL-terminated k is a field name: 1*tchar (RFC 9110 5.6.2). */
static int field_name_ok(const char *k)
{
    static const char extra[] = "!#$%&'*+-.^_`|~";
    if (!*k)
        return 0;
    for (; *k; k++) {
        unsigned char ch = (unsigned char)*k;
        if (!((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
              (ch && strchr(extra, ch))))
            return 0;
    }
    return 1;
}

/* Requests whose framing is ambiguous are refused and their connection closed, so that
 * nothing after them is read as a request (request smuggling): several Content-Length
 * headers (RFC 9112 6.3: 400), one that is not a plain decimal number ("+48", which
 * libevent takes and a proxy in front may not: 400), or a Transfer-Encoding other than one
 * "chunked", which libevent would ignore and read the body as the next request (RFC 9112
 * 6.1: a coding the server does not understand gets 501), or a header field name
 * that is not a token ("Content-Length : 5": 400 bad_header). Returns 1 when req was
 * answered. */
static int reject_ambiguous_framing(struct evhttp_request *req)
{
    int n_cl = 0, n_te = 0, n_host = 0, te_ok = 1, cl_ok = 1;
    struct evkeyvalq *h = evhttp_request_get_input_headers(req);
    for (struct evkeyval *kv = h->tqh_first; kv; kv = kv->next.tqe_next) {
        if (!field_name_ok(kv->key)) {
            /* "Content-Length : 5" is no Content-Length to libevent, which then read the
             * body as the next request, while a proxy that trims the name forwarded it as
             * a body: a smuggled request (RFC 9112 5.1: such a request MUST get 400) */
            char msg[200];
            int n = (int)strlen(kv->key);
            snprintf(msg, sizeof(msg),
                     "The request has a header field name that is not a token (whitespace "
                     "before the colon?): \"%.*s\".",
                     n < 64 ? n : 64, kv->key);
            api_error e;
            api_error_set(&e, 400, "invalid_request_error", NULL, "bad_header", "%s", msg);
            evhttp_add_header(evhttp_request_get_output_headers(req), "Connection", "close");
            http_reply_error(req, &e);
            return 1;
        }
        n_host += evutil_ascii_strcasecmp(kv->key, "Host") == 0;
        if (evutil_ascii_strcasecmp(kv->key, "Content-Length") == 0) {
            n_cl++;
            cl_ok &= content_length_ok(kv->value);
        } else if (evutil_ascii_strcasecmp(kv->key, "Transfer-Encoding") == 0) {
            n_te++;
            const char *v = kv->value;
            size_t len = strlen(v);
            while (len > 0 && (v[len - 1] == ' ' || v[len - 1] == '\t'))
                len--;
            while (len > 0 && (*v == ' ' || *v == '\t')) {
                v++;
                len--;
            }
            te_ok &= len == 7 && evutil_ascii_strncasecmp(v, "chunked", 7) == 0;
        }
    }
    /* RFC 9112 3.2: exactly one Host in HTTP/1.1, at most one before (a proxy that routes
     * on the first and a server that reads the last disagree on where a request goes) */
    if (n_host > 1 || (n_host == 0 && (req->major > 1 || (req->major == 1 && req->minor >= 1)))) {
        evhttp_add_header(evhttp_request_get_output_headers(req), "Connection", "close");
        http_reply_error_msg(req, 400, "invalid_request_error", NULL, "bad_header",
                             n_host ? "The request has more than one Host header (RFC 9112 3.2)."
                                    : "An HTTP/1.1 request must have a Host header (RFC 9112 "
                                      "3.2).");
        return 1;
    }
    if (n_cl <= 1 && n_te == 0 && cl_ok)
        return 0;
    if (n_te > 0 && (n_te > 1 || !te_ok)) {
        evhttp_add_header(evhttp_request_get_output_headers(req), "Connection", "close");
        http_reply_error_msg(req, 501, "invalid_request_error", NULL,
                             "unsupported_transfer_encoding",
                             "Only \"Transfer-Encoding: chunked\" is supported.");
        return 1;
    }
    if (n_cl <= 1 && cl_ok)
        return 0;
    evhttp_add_header(evhttp_request_get_output_headers(req), "Connection", "close");
    http_reply_error_msg(req, 400, "invalid_request_error", NULL, "bad_framing",
                         n_cl > 1 ? "The request has more than one Content-Length header."
                                  : "The Content-Length header is not a decimal number.");
    return 1;
}

/* The batch route of path (its {id}, as in the path, at *seg, *seg_len bytes), with the
 * methods it allows; -1 when path is not one. An unknown path under /v1/files or
 * /v1/batches is -1 (404). */
static int batch_route(const char *path, const char **seg, size_t *seg_len, const char **allow)
{
    static const struct {
        const char *prefix, *suffix, *allow;
        batch_route_t route;
    } routes[] = {
        {"/v1/files/", "/content", "GET", BATCH_ROUTE_FILE_CONTENT},
        {"/v1/files/", "", "GET, DELETE", BATCH_ROUTE_FILE},
        {"/v1/batches/", "/cancel", "POST", BATCH_ROUTE_CANCEL},
        {"/v1/batches/", "", "GET", BATCH_ROUTE_BATCH},
    };
    if (strcmp(path, "/v1/files") == 0) {
        *allow = "GET, POST";
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
        if (memchr(path + pl, '/', idl))
            continue;
        *seg = path + pl;
        *seg_len = idl;
        *allow = routes[i].allow;
        return routes[i].route;
    }
    return -1;
}

// --- API keys

typedef enum { NEED_NONE = 0, NEED_KEY, NEED_ADMIN } need_t;

#define NO_KEY_MSG                                                                         \
    "You didn't provide an API key. You need to provide your API key in an Authorization " \
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."

/* A refused request's log line (httpconn_log_refusal: rate-limited, names no key). */
static void log_refused(struct evhttp_request *req, const char *what)
{
    httpconn_log_refusal(evhttp_request_get_connection(req), what);
}

static void reply_401(struct evhttp_request *req, const char *msg)
{
    evhttp_add_header(evhttp_request_get_output_headers(req), "WWW-Authenticate", "Bearer");
    http_reply_error_msg(req, 401, "invalid_request_error", NULL, "invalid_api_key", msg);
}

/* Check the caller's key for a route that needs one: 0 with *key set, or -1 when req was
 * answered (401, 403, or 429 with Retry-After for a key over its requests/s limit). */
static int authorize(http_server_t *s, struct evhttp_request *req, need_t need, auth_key **key)
{
    /* One Authorization field (RFC 9110 11.6.2 has no list form): with two, the first one
     * decided, so "Bearer GOOD" then "Bearer nope" passed and the other order did not */
    struct evkeyvalq *in = evhttp_request_get_input_headers(req);
    int n_auth = 0;
    for (struct evkeyval *kv = in->tqh_first; kv; kv = kv->next.tqe_next)
        n_auth += evutil_ascii_strcasecmp(kv->key, "Authorization") == 0;
    if (n_auth > 1) {
        log_refused(req, "401: more than one Authorization header");
        reply_401(req, "More than one Authorization header was sent; send one, with your API "
                       "key as a Bearer token.");
        return -1;
    }
    const char *h = evhttp_find_header(in, "Authorization");
    auth_status_t st = auth_check(s->auth, h, key);
    if (st != AUTH_OK) {
        log_refused(req, st == AUTH_MISSING ? "401: no API key" : "401: an unknown API key");
        reply_401(req, st == AUTH_MISSING ? NO_KEY_MSG : "Incorrect API key provided.");
        return -1;
    }
    auth_key_params p = auth_key_get_params(*key);
    char msg[300];
    if (need == NEED_ADMIN && !p.admin) {
        snprintf(msg, sizeof(msg), "403: key %s is not an admin key", auth_key_id(*key));
        log_refused(req, msg);
        http_reply_error_msg(req, 403, "permission_error", NULL, "insufficient_permissions",
                             "You have insufficient permissions for this operation: it needs an "
                             "admin API key.");
        return -1;
    }
    int ra;
    if (auth_take_request(*key, proto_now_us(), &ra) < 0) {
        snprintf(msg, sizeof(msg), "429: key %s is over its limit of %g requests/s",
                 auth_key_id(*key), p.requests_per_s);
        log_refused(req, msg);
        char v[16];
        snprintf(v, sizeof(v), "%d", ra);
        evhttp_add_header(evhttp_request_get_output_headers(req), "Retry-After", v);
        snprintf(msg, sizeof(msg),
                 "Rate limit reached for requests per second (RPS) of API key %s: limit %g. "
                 "Please try again in %ds.",
                 auth_key_id(*key), p.requests_per_s, ra);
        http_reply_error_msg(req, 429, "requests", NULL, "rate_limit_exceeded", msg);
        return -1;
    }
    return 0;
}

static void on_request(struct evhttp_request *req, void *arg)
{
    http_server_t *s = arg;
    int seen = httpconn_request_read(s->conns, evhttp_request_get_connection(req));
    evhttp_request_set_on_complete_cb(req, on_reply_done, s);
    if (seen & HTTPCONN_REQ_NUL) {
        /* libevent keeps a field value up to its first NUL: "Bearer KEY\0junk" would pass
         * as "Bearer KEY", a Content-Length "5\0..." as 5 */
        evhttp_add_header(evhttp_request_get_output_headers(req), "Connection", "close");
        http_reply_error_msg(req, 400, "invalid_request_error", NULL, "bad_header",
                             "The request's header block holds a NUL byte (RFC 9110 5.5).");
        return;
    }
    if (seen & (HTTPCONN_REQ_VERSION | HTTPCONN_REQ_BAD_VERSION)) {
        /* libevent reads the version with sscanf("HTTP/%d.%d") and keeps any major 0 or 1:
         * "HTTP/1.2" was served and its version echoed in the reply's status line. Answer
         * in HTTP/1.1 (RFC 9110 6.2) and close: the rest of the stream is not ours to read */
        int other = seen & HTTPCONN_REQ_VERSION;
        req->major = 1;
        req->minor = 1;
        log_refused(req, other ? "505: an HTTP version other than 1.0 and 1.1"
                               : "400: a malformed HTTP version");
        evhttp_add_header(evhttp_request_get_output_headers(req), "Connection", "close");
        http_reply_error_msg(req, other ? 505 : 400, "invalid_request_error", NULL,
                             other ? "http_version_not_supported" : "bad_request",
                             other ? HTTP_VERSION_MSG
                                   : "The request line's HTTP version is malformed (RFC 9112 "
                                     "2.3): it must be HTTP/1.0 or HTTP/1.1.");
        return;
    }
    if (reject_ambiguous_framing(req))
        return;
    /* libevent flags a request in absolute form ("GET http://host/v1/models") whose host
     * is no vhost of it as a proxy request, and then keeps the connection only with
     * "Proxy-Connection: keep-alive": it closed it after the reply, without saying so, and
     * a request pipelined behind it was lost. This server is no proxy: the absolute form
     * is one more way to name its own paths (RFC 9112 3.2.2). */
    req->flags &= ~EVHTTP_PROXY_REQUEST;
    enum evhttp_cmd_type method = evhttp_request_get_command(req);
    char msg[300];
    /* A request target in origin form is an absolute path (RFC 9112 3.2.1), but libevent
     * parses one that starts with "//" as a network-path reference: "//x/metrics" came out
     * as host "x", path "/metrics", and was served as /metrics, past any proxy rule on the
     * path. Such a target is its own path, which no route has: 404. */
    const char *target = evhttp_request_get_uri(req);
    long bad = target ? http_wire_target_bad(target) : -1;
    if (bad >= 0) {
        /* libevent splits the request line at its first and last space and takes any byte
         * between: "GET /v1/mo dels HTTP/1.1" was routed as "/v1/mo dels" (404). RFC 9112
         * 3: an invalid request line gets 400, never an autocorrected route (it may be
         * crafted to pass a filter in front that reads it otherwise); closed, as after any
         * request line libevent cannot parse. */
        unsigned char ch = (unsigned char)target[bad];
        if (ch == '%')
            snprintf(msg, sizeof(msg),
                     "The request target has a \"%%\" not followed by two hex digits, at byte "
                     "%ld (RFC 3986 2.1).",
                     bad);
        else
            snprintf(msg, sizeof(msg),
                     "The request target holds a byte a URI may not hold, 0x%02x at byte %ld: "
                     "a space, a control character, ... must be percent-encoded (RFC 9112 "
                     "3.2).",
                     ch, bad);
        log_refused(req, "400: an invalid request target");
        evhttp_add_header(evhttp_request_get_output_headers(req), "Connection", "close");
        http_reply_error_msg(req, 400, "invalid_request_error", NULL, "bad_request", msg);
        return;
    }
    if (target && target[0] == '/' && target[1] == '/') {
        int n = (int)strcspn(target, "?#");
        snprintf(msg, sizeof(msg), "Invalid URL (%s %.*s)", method_str(method), n < 200 ? n : 200,
                 target);
        http_reply_error_msg(req, 404, "invalid_request_error", NULL, "unknown_url", msg);
        return;
    }
    const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri(req);
    const char *path = uri ? evhttp_uri_get_path(uri) : NULL;
    if (!path || !*path)
        path = "/";

    const char *allow = NULL;
    int kind = -1;
    int broute = -1;
    /* a route's {id}: as in the path (percent-encoded), then decoded into id */
    const char *seg = NULL, *what = NULL;
    size_t seg_len = 0, id_cap = 128;
    int is_worker = 0, is_response = 0;
    char id[1024] = "";
    size_t plen = strlen(path);
    if (strncmp(path, "/workers/", 9) == 0 && plen > 14 && strcmp(path + plen - 5, "/role") == 0 &&
        !memchr(path + 9, '/', plen - 14)) {
        allow = "POST";
        is_worker = 1;
        seg = path + 9;
        seg_len = plen - 14;
        id_cap = PROTO_ID_LEN;
        what = "worker";
    } else if ((broute = batch_route(path, &seg, &seg_len, &allow)) >= 0) {
        /* the Files and Batch API (batch.h) */
        what = broute == BATCH_ROUTE_FILE || broute == BATCH_ROUTE_FILE_CONTENT ? "file"
                                                                                 : "batch";
    } else if (strcmp(path, "/v1/completions") == 0) {
        allow = "POST";
        kind = API_COMPLETIONS;
    } else if (strcmp(path, "/v1/chat/completions") == 0) {
        allow = "POST";
        kind = API_CHAT;
    } else if (strcmp(path, "/v1/responses") == 0) { /* responses.h */
        allow = "POST";
        kind = API_RESPONSES;
    } else if (strncmp(path, "/v1/responses/", 14) == 0 && plen > 14 && !strchr(path + 14, '/')) {
        allow = "GET, DELETE";
        is_response = 1;
        seg = path + 14;
        seg_len = plen - 14;
        what = "response";
    } else if (strcmp(path, "/tokenize") == 0 || strcmp(path, "/detokenize") == 0) {
        allow = "POST"; /* vLLM's paths, outside /v1 */
    } else if (strcmp(path, "/v1/models") == 0 || strncmp(path, "/v1/models/", 11) == 0 ||
               strcmp(path, "/health") == 0 || strcmp(path, "/workers") == 0 ||
               strcmp(path, "/metrics") == 0) {
        allow = "GET";
        if (strncmp(path, "/v1/models/", 11) == 0) { /* a model id may hold "/" (org/name) */
            seg = path + 11;
            seg_len = plen - 11;
            id_cap = sizeof(id);
            what = "model";
        }
    }
    /* Every {id} is percent-decoded, as clients send it (openai-node encodes "org/name" as
     * "org%2Fname", others "decode-0" as "decode%2D0"). One too long for its kind of id is
     * no route (404). */
    http_id_status_t id_st = HTTP_ID_OK;
    if (seg) {
        id_st = http_wire_id_decode(seg, seg_len, what[0] == 'm', id, id_cap);
        if (id_st == HTTP_ID_TOO_LONG)
            allow = NULL;
    }
    if (!allow) {
        snprintf(msg, sizeof(msg), "Invalid URL (%s %.200s)", method_str(method), path);
        http_reply_error_msg(req, 404, "invalid_request_error", NULL, "unknown_url", msg);
        return;
    }
    int is_get = method == EVHTTP_REQ_GET || method == EVHTTP_REQ_HEAD;
    if (!((strstr(allow, "POST") && method == EVHTTP_REQ_POST) ||
          (strstr(allow, "DELETE") && method == EVHTTP_REQ_DELETE) ||
          (strstr(allow, "GET") && is_get))) {
        /* HEAD is served wherever GET is (RFC 9110 9.3.2), so Allow names it too */
        char allow_hdr[64];
        if (strncmp(allow, "GET", 3) == 0)
            snprintf(allow_hdr, sizeof(allow_hdr), "GET, HEAD%s", allow + 3);
        else
            snprintf(allow_hdr, sizeof(allow_hdr), "%s", allow);
        evhttp_add_header(evhttp_request_get_output_headers(req), "Allow", allow_hdr);
        snprintf(msg, sizeof(msg), "Method %s is not allowed for %.200s (use %s).",
                 method_str(method), path, allow_hdr);
        http_reply_error_msg(req, 405, "invalid_request_error", NULL, "method_not_allowed", msg);
        return;
    }
    if (id_st != HTTP_ID_OK) {
        /* an id with a "%" not followed by two hex digits (the target check lets none
         * through), or one that decodes to a NUL or "/" ("%00", "%2F"), which no such id
         * holds, would otherwise be looked up cut short or split */
        if (id_st == HTTP_ID_BAD_ESCAPE)
            snprintf(msg, sizeof(msg),
                     "The %s id in the path has a \"%%\" not followed by two hex digits.", what);
        else
            snprintf(msg, sizeof(msg),
                     "The %s id in the path decodes to a %s (%s), which no %s id holds.", what,
                     what[0] == 'm' ? "NUL byte" : "\"/\" or a NUL byte",
                     what[0] == 'm' ? "%00" : "%2F, %00", what);
        http_reply_error_msg(req, 400, "invalid_request_error", NULL,
                             id_st == HTTP_ID_BAD_ESCAPE ? "bad_request" : "invalid_value", msg);
        return;
    }
    need_t need = is_worker || strcmp(path, "/workers") == 0 || strcmp(path, "/metrics") == 0
                      ? NEED_ADMIN
                  : strncmp(path, "/v1/", 4) == 0 || strcmp(path, "/tokenize") == 0 ||
                          strcmp(path, "/detokenize") == 0
                      ? NEED_KEY
                                                  : NEED_NONE; /* /health */
    auth_key *key = NULL;
    if (need != NEED_NONE && auth_n_keys(s->auth) > 0 && authorize(s, req, need, &key) < 0)
        return;
    if (is_worker) {
        http_admin_worker_role(s, req, id);
    } else if (broute >= 0) {
        /* without keys everyone sees everything; an admin key sees every key's objects */
        batch_caller who = {key ? auth_key_id(key) : NULL,
                            !key || auth_key_get_params(key).admin};
        if (s->batch)
            batch_handle(s->batch, req, (batch_route_t)broute, seg ? id : NULL, &who);
        else
            http_reply_error_msg(req, 503, "server_error", NULL, "not_ready",
                                 "the Batch API is not enabled");
    } else if (kind >= 0)
        http_completion_handle(s, req, (api_kind_t)kind, key);
    else if (is_response)
        http_responses_stored(s, req, id, key);
    else if (strcmp(path, "/health") == 0)
        http_admin_health(s, req);
    else if (strcmp(path, "/workers") == 0)
        http_admin_workers(s, req);
    else if (strcmp(path, "/metrics") == 0)
        http_admin_metrics(s, req);
    else if (strcmp(path, "/tokenize") == 0)
        http_admin_tokenize(s, req);
    else if (strcmp(path, "/detokenize") == 0)
        http_admin_detokenize(s, req);
    else
        http_admin_models(s, req, seg ? id : NULL);
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
    s->timeout_s = p->timeout_s > 0 ? p->timeout_s : 60;
    s->keepalive_s = p->sse_keepalive_s > 0 ? p->sse_keepalive_s : 15;
    s->responses_store = p->responses_store;
    s->max_unsent = p->max_unsent_bytes > 0 ? p->max_unsent_bytes : (size_t)8 << 20;
    httpconn_params cp = httpconn_default_params();
    if (p->max_connections > 0)
        cp.max_connections = p->max_connections;
    if (p->header_timeout_s > 0)
        cp.header_timeout_s = p->header_timeout_s;
    if (p->body_timeout_s > 0)
        cp.body_timeout_s = p->body_timeout_s;
    cp.body_max_bytes = p->max_body_bytes;
    cp.upload_max_bytes = p->max_upload_bytes;
    if (p->body_min_rate > 0)
        cp.body_min_rate = p->body_min_rate;
    else if (p->body_min_rate < 0)
        cp.body_min_rate = 0;
    s->conns = httpconn_new(base, s->http, &cp);
    if (!s->conns) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    evhttp_set_timeout(s->http, s->timeout_s);
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
    error_server = s;
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
    httpconn_set_stats(s->conns, stats);
}

void http_server_set_batch(http_server_t *s, batch_t *b)
{
    if (b)
        batch_set_httpconn(b, s->conns);
    s->batch = b;
}

void http_server_set_auth(http_server_t *s, auth_t *a)
{
    s->auth = a;
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
    http_completion_abandon_all(s); /* only if the cluster was not destroyed first */
    if (error_server == s)
        error_server = NULL;
    if (s->http)
        evhttp_free(s->http); /* closes every connection (httpconn sees them go) */
    httpconn_destroy(&s->conns);
    free(s->host);
    free(s->model);
    free(s);
    *ps = NULL;
}
