/*
 * httpconn: the gateway's watch over its HTTP connections, for what libevent's evhttp 2.1
 * does not bound by itself: how many connections are open, and how long a request may
 * take to arrive.
 *
 * evhttp's own timeout (--http-timeout-s) restarts with every byte, so a client that
 * trickles its request (a byte every few seconds) held its connection and its buffers for
 * ever (slowloris). Here each request must arrive within deadlines counted from its first
 * byte: its request line and headers within header_timeout_s (nginx
 * client_header_timeout), its body within body_timeout_s of the end of the headers, plus one
 * second per body_min_rate bytes of it received (Apache mod_reqtimeout's MinRate, so that a
 * large upload at a modest rate is not cut). A request that misses one gets 408
 * request_timeout (an OpenAI-style JSON body) and its connection is closed (a body past its
 * route's cap gets 413 request_too_large the same way, as it arrives); a connection
 * that sent nothing of its next request is left to evhttp's idle timeout, which closes it
 * without a reply. Over max_connections a new connection takes the place of the one idle
 * longest (between requests: closed, as a keep-alive connection may be; one that never
 * had a request only once HTTPCONN_FRESH_MS old), or when none is
 * idle gets 503 too_many_connections (Retry-After: 1) at once and is closed.
 *
 * How it sees connections without patching libevent: evhttp_set_bevcb makes every accepted
 * connection's bufferevent here, so each one is counted, and a callback on that
 * bufferevent's input evbuffer sees every byte the client sends as it is read, before
 * evhttp parses it. The first byte of a request starts its clock; the empty line that ends
 * its header block (found by a scanner that splits lines as evhttp does, "\n" or "\r\n")
 * starts the body's. The server says when evhttp has handed it a whole request
 * (httpconn_request_read: the clocks stop) and when its reply has gone out
 * (httpconn_reply_done: bytes already received of a pipelined next request count from
 * then). A connection's end is evhttp's close callback, which this module owns: the
 * server's own close handlers are registered here (httpconn_set_close_cb).
 *
 * The 408 and 503 replies are written to the socket directly (it holds nothing else at
 * that moment: the request is still being read, or the connection was just accepted), the
 * connection is freed in evhttp, and a duplicate of the socket lingers for up to
 * HTTPCONN_LINGER_MS, its input read and discarded, so that bytes the client is still
 * sending do not make the kernel reset the connection before the client has read the reply
 * (RFC 9112 9.6, "lingering close"). Loop thread only.
 */
#ifndef TP_GW_HTTPCONN_H
#define TP_GW_HTTPCONN_H

#include "stats.h"

#define HTTPCONN_LINGER_MS 2000           /* a refused connection's socket, at most */
#define HTTPCONN_LINGER_BYTES (256 << 10) /* ... or until this much was discarded */
#define HTTPCONN_MAX_LINGER 1024          /* sockets lingering at once; more: closed at once */
#define HTTPCONN_FRESH_MS 1000            /* a new connection's grace before it counts as idle */
#define HTTPCONN_BODY_SLACK (64 << 10)    /* framing, multipart headers: past a body's limit */

struct event_base;
struct evhttp;
struct evhttp_connection;

typedef struct httpconn httpconn_t;

typedef struct {
    int max_connections;  /* open at once (>= 1); more get 503 too_many_connections */
    int header_timeout_s; /* a request's line and headers within this of its first byte */
    int body_timeout_s;   /* its body within this of the end of its headers, plus ... */
    int body_min_rate;    /* ... 1 s per this many bytes of it received (bytes/s; 0: none) */
    /* A request whose body grows past its route's limit plus HTTPCONN_BODY_SLACK gets 413
     * request_too_large and is closed while it arrives, so one connection cannot make the
     * gateway buffer more than its route may take (the HTTP layer's own cut-off is the
     * largest of all routes'): upload_max_bytes for POST /v1/files, body_max_bytes for
     * every other route. Bytes after the header block count (chunked framing too); a body
     * within the slack reaches the route, which answers 413 itself. 0: no cap. */
    size_t body_max_bytes;
    size_t upload_max_bytes;
} httpconn_params;

/* 4096 connections, 20 s for the headers, 30 s plus 1 s per 1024 bytes for a body; no
 * body cap. */
httpconn_params httpconn_default_params(void);

/* Watch every connection http accepts from now on (it installs its bufferevent callback
 * in http, evhttp_set_bevcb). http is borrowed: free it (evhttp_free) before
 * httpconn_destroy. NULL on bad params or out of memory. */
httpconn_t *httpconn_new(struct event_base *base, struct evhttp *http, const httpconn_params *p);

/* Count refusals, timeouts and open connections in stats (borrowed; NULL: not counted). */
void httpconn_set_stats(httpconn_t *h, stats_t *stats);

#define HTTPCONN_REQ_NUL 1 /* its header block held a NUL byte (libevent cut the field there) */
#define HTTPCONN_REQ_VERSION 2     /* its HTTP-version is well-formed but not 1.0 or 1.1 */
#define HTTPCONN_REQ_BAD_VERSION 4 /* its HTTP-version is not "HTTP/" DIGIT "." DIGIT */

/* evhttp handed the server a whole request of conn (its request callback): its clocks stop
 * until httpconn_reply_done. Bytes after it in conn's input (pipelining) are the next
 * request's. Returns what the scanner saw in the request's bytes that evhttp does not
 * tell, or tells wrongly: 0, or an OR of HTTPCONN_REQ_NUL (RFC 9110 5.5: a field value must
 * not hold NUL; the server answers 400 and closes), HTTPCONN_REQ_VERSION ("HTTP/1.2",
 * which libevent takes as 1.2 and echoes back: RFC 9110 15.6.6, 505) and
 * HTTPCONN_REQ_BAD_VERSION ("HTTP/01.1", which libevent takes as 1.1: 400). Untracked
 * connections are ignored (0; so are all the calls below). */
int httpconn_request_read(httpconn_t *h, struct evhttp_connection *conn);

/* The HTTP-version of conn's request that evhttp is reading (not yet handed to the server),
 * as far as it arrived: 0, HTTPCONN_REQ_VERSION or HTTPCONN_REQ_BAD_VERSION (see above).
 * For the refusal of a request line libevent could not parse ("HTTP/2.0": 505, not 400). */
int httpconn_request_version(httpconn_t *h, struct evhttp_connection *conn);

/* conn's reply went out (the request's on-complete callback): its next request's clock
 * starts now if some of it has arrived, else at its first byte. */
void httpconn_reply_done(httpconn_t *h, struct evhttp_connection *conn);

/* Call cb(conn, arg) when conn closes (as evhttp_connection_set_closecb, which this module
 * owns for the connections it tracks); cb NULL: no longer. One handler per connection. */
void httpconn_set_close_cb(httpconn_t *h, struct evhttp_connection *conn,
                           void (*cb)(struct evhttp_connection *, void *), void *arg);

/* Log a refused request or connection of conn (INFO): what happened, then the client's
 * address. At most one line a second for all refusals of the process, each saying how many
 * were left out since the one before, so that a client looping on bad requests or keys
 * cannot flood the log. what must never hold a secret (name a key by its id only). conn
 * may be NULL (address shown as "?"). Loop thread only. */
void httpconn_log_refusal(struct evhttp_connection *conn, const char *what);

/* Connections open (tracked; lingering sockets not counted). */
int httpconn_n_open(const httpconn_t *h);

/* Free h: the sockets still lingering are closed. Call after evhttp_free, which closes
 * every connection. Takes NULL; NULLs *h. */
void httpconn_destroy(httpconn_t **h);

#endif
