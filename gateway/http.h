/*
 * http: the gateway's HTTP server (libevent evhttp): routes, request admission and the
 * replies, plain JSON or Server-Sent Events.
 *
 * POST /v1/completions and /v1/chat/completions go down the completion path
 * (completion.h: validated, tokenized, admitted into the cluster, text through a stream_t
 * so that only whole UTF-8 characters are sent and stop strings are honoured); the server
 * is its sink, answering with Server-Sent Events or one JSON body. A client that
 * disconnects cancels its request. GET /v1/models and GET /health report the model and the
 * cluster; GET /metrics exposes the stats (stats.h) in the Prometheus text format
 * (prometheus.h). /v1/files and /v1/batches are routed to the Batch API (batch.h).
 * Anything else gets an OpenAI-style JSON error (404 unknown path, 405 wrong method).
 *
 * With API keys (http_server_set_auth, auth.h), every /v1/ route needs a configured key as
 * Authorization: Bearer KEY (else 401 invalid_api_key with WWW-Authenticate: Bearer), and
 * /metrics, /workers and POST /workers/{id}/role an admin key (a user key: 403
 * insufficient_permissions); /health stays open. A key over its requests/s limit gets 429
 * (type "requests"), over its tokens/s limit 429 (type "tokens"), both with Retry-After.
 * The Batch API's objects belong to the key that created them. Loop thread only.
 */
#ifndef TP_GW_HTTP_H
#define TP_GW_HTTP_H

#include <stddef.h>

#include "auth.h"
#include "batch.h"
#include "cluster.h"
#include "stats.h"
#include "tokenizer.h"

struct event_base;
struct evbuffer;
struct evhttp_request;

typedef struct http_server http_server_t;

typedef struct {
    const char *host;       /* address to listen on (copied) */
    int port;               /* 0 = any free port (see http_server_port) */
    size_t max_body_bytes;  /* larger bodies get 413 */
    size_t max_upload_bytes; /* POST /v1/files: largest file (0 = no uploads beyond
                              * max_body_bytes); the HTTP layer reads bodies this large */
    int timeout_s;          /* a connection that sends no bytes of its request, or takes
                             * none of our reply, for this long is closed (idle connections,
                             * stalled readers; a request trickled byte by byte is cut by
                             * header_timeout_s / body_timeout_s); 0 = 60. A stream's read
                             * side has none: its client sends nothing while it waits */
    int sse_keepalive_s;    /* a stream idle this long gets ": keep-alive"; 0 = 15 */
    /* connection limits and request deadlines (httpconn.h; 0 = httpconn's default) */
    int max_connections;    /* open at once; more get 503 too_many_connections */
    int header_timeout_s;   /* a request's headers within this of its first byte, else 408 */
    int body_timeout_s;     /* its body within this of its headers, plus ... */
    int body_min_rate;      /* ... 1 s per this many bytes received (-1 = none) */
    size_t max_unsent_bytes; /* a stream whose client leaves this much unread is dropped and
                              * its request cancelled; 0 = 8 MiB */
    const char *model_name; /* served model name (copied) */
    int n_ctx;              /* context length in tokens */
    const tokenizer_t *tok; /* borrowed; must outlive the server */
    int responses_store;    /* 1: keep each /v1/responses object whose request has "store"
                             * (default true) in the Batch API's store (http_server_set_batch)
                             * for GET and DELETE /v1/responses/{id}; 0: nothing is kept */
} http_params;

/* Bind and start serving on base. The server answers 503 to completion requests until
 * http_server_set_cluster() is called. NULL with a message in err on failure (address in
 * use, bad host, out of memory). */
http_server_t *http_server_new(struct event_base *base, const http_params *p, char *err,
                               size_t errlen);

/* Attach the cluster requests are admitted into (borrowed; must outlive the server's use
 * of it, i.e. destroy the cluster before the server). */
void http_server_set_cluster(http_server_t *s, cluster_t *c);

/* Record requests, responses and timings in stats (borrowed; must outlive the server) and
 * serve them at GET /metrics. Without it /metrics answers 503. */
void http_server_set_stats(http_server_t *s, stats_t *stats);

/* Serve the Files and Batch API from b (borrowed; must outlive the server), and keep stored
 * responses in its store (http_params.responses_store). Without it those routes answer 503
 * and no response is stored. */
void http_server_set_batch(http_server_t *s, batch_t *b);

/* Require the API keys of a (borrowed; must outlive the server). Without it, or with no key
 * in it, every route is open (and every Batch API object visible to every caller). */
void http_server_set_auth(http_server_t *s, auth_t *a);

/* The port actually bound (useful with port 0). */
int http_server_port(const http_server_t *s);

/* Stop accepting new connections (shutdown); requests in flight continue. */
void http_server_stop_accepting(http_server_t *s);

/* Completion requests in flight (admitted and not yet answered). */
int http_server_n_active(const http_server_t *s);

/* Answer req with status and body (NULL: empty; borrowed, drained), as evhttp_send_reply,
 * except that a HEAD request gets the headers alone with the Content-Length of the body a
 * GET would get (RFC 9110 9.3.2). libevent 2.1 would write the body after a HEAD reply's
 * headers, without a Content-Length, and a kept-alive client would read those bytes as the
 * start of the next response. Every complete reply of the gateway goes through this. */
void http_send_reply(struct evhttp_request *req, int status, struct evbuffer *body);

/* Free the server. Destroy the cluster first (it fails the requests still in flight,
 * which answers them). Takes NULL; sets *s to NULL. */
void http_server_destroy(http_server_t **s);

#endif
