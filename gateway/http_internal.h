/*
 * http_internal: what the files of the HTTP server (http.h) share: http.c (the listener,
 * routing, limits, error replies and the server's life), http_completion.c (the completion
 * endpoints: the completion's sink, SSE, client disconnects) and http_admin.c (/health,
 * /workers, POST /workers/{id}/role, /metrics, /v1/models, /tokenize, /detokenize). Not a public interface.
 */
#ifndef TP_GW_HTTP_INTERNAL_H
#define TP_GW_HTTP_INTERNAL_H

#include <stdint.h>

#include "api.h"
#include "auth.h"
#include "batch.h"
#include "completion.h"
#include "http.h"
#include "httpconn.h"

struct evhttp;
struct evhttp_bound_socket;
struct evhttp_request;

struct http_server {
    struct event_base *base;
    struct evhttp *http;
    struct evhttp_bound_socket *bound;
    char *host;
    char *model; /* cx.model is this */
    int port;
    int timeout_s;          /* --http-timeout-s */
    int keepalive_s;        /* --sse-keepalive-s */
    size_t max_unsent;      /* --stream-max-unsent-bytes */
    httpconn_t *conns;      /* the connections: limits, request deadlines, close handlers */
    int responses_store;    /* http_params.responses_store */
    completion_env cx;      /* tokenizer, limits, cluster (NULL: 503), stats (NULL: no figures) */
    batch_t *batch;         /* NULL: the Files and Batch API answer 503 */
    auth_t *auth;           /* NULL or no keys: open */
    completion_list active; /* the completion requests in flight (http_completion.c) */
    int64_t started;
};

// --- http.c: replies

/* Answer req with status and a JSON body (NULL: empty), Content-Type application/json. */
void http_reply_json(struct evhttp_request *req, int status, const char *body);
/* Answer req with e's status and its OpenAI error body. */
void http_reply_error(struct evhttp_request *req, const api_error *e);
/* The same from the fields (param, code may be NULL; msg is copied, truncated to fit). */
void http_reply_error_msg(struct evhttp_request *req, int status, const char *type,
                          const char *param, const char *code, const char *msg);

// --- http_wire.c: request bytes libevent's parser lets through or refuses wrongly

#define HTTP_CHUNK_LINE_MAX 4096 /* a chunk-size line with its extensions, in bytes */

typedef enum {
    HTTP_CHUNK_OK = 0,    /* no chunk-size line was refused */
    HTTP_CHUNK_MALFORMED, /* not 1*HEXDIG [chunk-ext] (RFC 9112 7.1): 400 */
    HTTP_CHUNK_LONG,      /* over HTTP_CHUNK_LINE_MAX bytes: 413 */
} http_chunk_refusal_t;

/* Why libevent's last chunk-size parse (evutil_strtoll, overridden in http_wire.c) failed,
 * and forget it: HTTP_CHUNK_OK when it did not. libevent answers such a failure at once
 * through evhttp_send_error (413), which asks this. Loop thread only. */
http_chunk_refusal_t http_wire_chunk_refusal(void);

/* -1 when target (a request line's request-target as libevent keeps it, NUL-terminated) is
 * made only of the bytes a URI may hold (RFC 3986: unreserved, sub-delims, ":@/?", "%"
 * with two hex digits; "[]" in an absolute form's authority), else the offset of the first
 * byte that is not (a space, a control or non-ASCII byte, "\"", "<", "#", a "%" without
 * two hex digits, ...): RFC 9112 3 says such a request line is invalid (400). */
long http_wire_target_bad(const char *target);

typedef enum {
    HTTP_ID_OK = 0,
    HTTP_ID_BAD_ESCAPE, /* a "%" not followed by two hex digits */
    HTTP_ID_BAD_BYTE,   /* it decodes to a NUL, or a "/" where none may be */
    HTTP_ID_TOO_LONG,   /* it does not fit in cap bytes with its NUL */
} http_id_status_t;

/* Percent-decode a path's {id}, the n bytes at seg (no "/" among them unless allow_slash;
 * "+" stays "+"), into out (cap bytes, NUL-terminated). HTTP_ID_OK, or what was wrong
 * (out is then undefined). */
http_id_status_t http_wire_id_decode(const char *seg, size_t n, int allow_slash, char *out,
                                     size_t cap);

// --- http_completion.c: POST /v1/completions, /v1/chat/completions

/* Answer a completion request of kind (the method was checked): admit it and answer from
 * its completion (SSE or JSON), or answer its error (429 with Retry-After when full, or
 * when key, the caller's API key (NULL: none), is over its tokens/s limit). */
void http_completion_handle(http_server_t *s, struct evhttp_request *req, api_kind_t kind,
                            auth_key *key);
/* GET or DELETE /v1/responses/{id} (the method was checked) on behalf of key (NULL: none):
 * the stored response object, or {"id", "object": "response", "deleted": true}; 404
 * response_not_found for an id that is not stored or is another key's (an admin key sees
 * every key's). */
void http_responses_stored(http_server_t *s, struct evhttp_request *req, const char *id,
                           auth_key *key);
/* Forget every request still in flight without an answer (the server is freed before the
 * cluster: each is cancelled there); evhttp_free frees their evhttp requests. */
void http_completion_abandon_all(http_server_t *s);

// --- http_admin.c: operators' and models' endpoints (GET unless said; always answer)

/* GET /health: 200 when the cluster can serve, else 503 with the reason. */
void http_admin_health(http_server_t *s, struct evhttp_request *req);
/* GET /workers: every alive worker with its last reported load figures. */
void http_admin_workers(http_server_t *s, struct evhttp_request *req);
/* POST /workers/{id}/role: order a live role change of worker id. */
void http_admin_worker_role(http_server_t *s, struct evhttp_request *req, const char *id);
/* GET /metrics: the stats in the Prometheus text format (503 without stats). */
void http_admin_metrics(http_server_t *s, struct evhttp_request *req);
/* GET /v1/models (which NULL) or GET /v1/models/{which} (which percent-decoded). */
void http_admin_models(http_server_t *s, struct evhttp_request *req, const char *which);
/* POST /tokenize (vLLM's): {"prompt": text} or {"messages": [...]} (the chat template;
 * "add_generation_prompt", default true), "add_special_tokens" (BOS; default true, as the
 * completion endpoints compute) -> {"count", "max_model_len", "tokens", "token_strs": null};
 * 400 on a bad body, 404 for another model, 413 over the body limit. */
void http_admin_tokenize(http_server_t *s, struct evhttp_request *req);
/* POST /detokenize (vLLM's): {"tokens": [ids]} -> {"prompt": text} (BOS/EOS give no text,
 * bytes that form no UTF-8 character give U+FFFD); 400 for an id outside the vocabulary. */
void http_admin_detokenize(http_server_t *s, struct evhttp_request *req);

#endif
