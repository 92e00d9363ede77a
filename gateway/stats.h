/*
 * stats: the gateway's figures for operators: what GET /metrics exposes (prometheus.h
 * writes them in the Prometheus text format) and what the stats socket publishes
 * (statpub.h).
 *
 * The gateway sees every request from admission to its end, so request-level figures are
 * measured here: counters (requests, tokens, HTTP statuses), histograms (TTFT, ITL, time
 * per output token, e2e, queue, prefill, decode, first decode step, KV transfer time and
 * size) and percentiles over a sliding window (TTFT, TPOT, ITL; per worker and for the
 * cluster). Worker-level figures (load, KV blocks, token counters, KV-transfer and
 * speculative-decoding counters) are the workers' heartbeats, read from the cluster
 * (cluster_foreach_worker) when asked; token rates are counter deltas between samples
 * (stats_sample).
 *
 * Durations that span hosts are never computed from two clocks: the queue, prefill,
 * transfer and first-step phases are each measured on one host (the gateway, or the
 * worker that reports it: cluster_req_timing).
 *
 * Events (workers up/down, role and state changes, request retries and errors) are kept in
 * a short ring and passed to a sink (the stats socket) as they happen.
 * Loop thread only.
 */
#ifndef TP_GW_STATS_H
#define TP_GW_STATS_H

#include <stdint.h>

#include "cluster.h"
#include "metrics.h"
#include "protocol.h"

#define STATS_MAX_EVENTS 32 /* events kept for late subscribers */

typedef struct stats stats_t;

typedef struct {
    const char *model_name; /* value of the model_name label (copied) */
    int window_s;           /* percentile window, seconds (>= 1) */
} stats_params;

/* Defaults: model "tidepool", window 60 s. */
stats_params stats_default_params(void);

/* New, empty figures; the gateway's start time is now. NULL on bad params or out of
 * memory. */
stats_t *stats_new(const stats_params *p);

/* Free; takes NULL and NULLs *s. */
void stats_destroy(stats_t **s);

// --- HTTP and requests

/* An HTTP response with this status went out (any path). */
void stats_http_response(stats_t *s, int status);

/* What the HTTP layer did to a connection (httpconn.h, http_completion.c). */
typedef enum {
    STATS_HTTP_REFUSED = 0,    /* a connection over --max-connections: 503, closed */
    STATS_HTTP_HEADER_TIMEOUT, /* 408: a request's headers did not arrive in time */
    STATS_HTTP_BODY_TIMEOUT,   /* 408: its body did not arrive in time */
    STATS_HTTP_SLOW_CLIENT,    /* a stream's client fell too far behind: dropped */
    STATS_HTTP_N
} stats_http_event_t;

/* Count one of those (e outside the enum: ignored). */
void stats_http_event(stats_t *s, stats_http_event_t e);

/* The HTTP connections open now (a gauge; the HTTP layer sets it as they come and go). */
void stats_http_connections(stats_t *s, int n_open);

/* A completion request arrived (POST /v1/completions or /v1/chat/completions). Every
 * received request later ends in exactly one of: stats_request_rejected(), or, once
 * admitted, stats_request_end(). */
void stats_request_received(stats_t *s);

/* A completion request was answered with an error before it was admitted (validation,
 * 429, not ready). */
void stats_request_rejected(stats_t *s);

/* The first token of an admitted request reached the gateway at now_us (proto_now_us):
 * time to first token = now_us - t->admit_us, counted for t->prefill_worker. */
void stats_first_token(stats_t *s, const cluster_req_timing *t, int64_t now_us);

/* Later tokens arrived itl_s seconds after the previous ones (one inter-token latency per
 * message from the decode worker), counted for t->decode_worker. */
void stats_tokens(stats_t *s, const cluster_req_timing *t, double itl_s, int64_t now_us);

typedef enum {
    STATS_END_FINISHED = 1, /* answered with a finish reason */
    STATS_END_FAILED,       /* answered with an error after admission */
    STATS_END_CANCELLED,    /* the client went away ("abort") */
} stats_end_t;

/* How an admitted request ended. Times are the gateway's monotonic clock (0 = never). */
typedef struct {
    uint64_t rid;
    stats_end_t how;
    const char *finish_reason;        /* FINISHED: "stop" or "length" */
    int status;                       /* FAILED: HTTP status of the error */
    const char *error;                /* FAILED: its message */
    int n_prompt, n_output;           /* tokens, as in the usage object */
    int64_t t_first_us, t_last_us;    /* first and last token at the gateway */
    int64_t t_end_us;                 /* the end */
    const cluster_req_timing *timing; /* the cluster's record */
    int offline;                      /* offline tier (flex, batch): counted, and its tokens
                                       * in the offline counter too, but kept out of the
                                       * latency histograms and windows (online SLOs) */
} stats_request;

/* A request's phases in milliseconds (-1 = unknown / not applicable): queue = gateway
 * admission -> PREFILL sent, plus the prefill worker's own queue; prefill, transfer and
 * first decode step as the workers measured them; ttft and e2e on the gateway's clock. */
typedef struct {
    double queue_ms, prefill_ms, transfer_ms, first_decode_ms, ttft_ms, e2e_ms;
} stats_breakdown;

/* Compute r's phases into *out (pure; see stats_breakdown). */
void stats_breakdown_of(const stats_request *r, stats_breakdown *out);

/* An admitted request ended: counts it (finished by reason, failed, or cancelled as
 * "abort"), adds its tokens (those of the usage object; for a failed or cancelled request
 * the prompt counts only once its first token came) and observes its histograms (finished
 * requests). A FAILED request also makes a "request_error" event. out (may be NULL)
 * receives its phases. */
void stats_request_end(stats_t *s, const stats_request *r, stats_breakdown *out);

// --- events

/* One event (see the stats socket's schema in docs/stats.md). */
typedef struct {
    uint64_t seq;     /* 1, 2, ... in the order they happened */
    int64_t ts_ms;    /* wall clock, ms since the epoch */
    const char *type; /* "worker_up", "worker_down", "worker_role", "worker_state",
                       * "request_retry", "request_preempt", "request_error" (static) */
    char worker[PROTO_ID_LEN];
    int role, old_role, state; /* proto_role_t / proto_state_t, 0 = none */
    uint64_t rid;
    int status; /* request_error: the HTTP status */
    char reason[192];
} stats_event;

/* Pass every new event to fn (NULL: none), on the loop thread, after it was recorded. */
void stats_set_event_sink(stats_t *s, void (*fn)(const stats_event *ev, void *ud), void *ud);

/* The cluster's observer (cluster_set_observer(c, stats_on_cluster_event, stats)). */
void stats_on_cluster_event(const cluster_event *ev, void *ud);

/* Events kept (at most STATS_MAX_EVENTS) and the i-th of them, oldest first (borrowed,
 * valid until the next event). */
int stats_n_events(const stats_t *s);
const stats_event *stats_event_at(const stats_t *s, int i);

// --- figures

/* Take a sample of every worker's token counters (for the rates) and forget the figures
 * of workers gone for longer than the window. Call regularly (the stats interval). */
void stats_sample(stats_t *s, const cluster_t *c, int64_t now_us);

typedef struct {
    uint64_t received, rejected, finished, finished_stop, finished_length, failed, cancelled;
    uint64_t failed_total; /* rejected + failed after admission */
    uint64_t http_2xx, http_4xx, http_5xx;
    int http_connections;                         /* open now */
    uint64_t http_events[STATS_HTTP_N];           /* by stats_http_event_t, since start */
    uint64_t prompt_tokens, generation_tokens;
    uint64_t offline_generation_tokens; /* of offline requests answered */
    uint64_t offline_preemptions;       /* offline requests preempted (cluster events) */
    int queued, running; /* the cluster's queue and assigned requests */
    int offline_queued, offline_running;
    double uptime_s;
    int64_t started_wall_ms; /* start, wall clock */
} stats_gateway_figures;

/* The gateway's own figures (c may be NULL: queued and running are then 0). */
void stats_get_gateway(const stats_t *s, const cluster_t *c, stats_gateway_figures *out);

/* Percentiles in seconds over the window (NaN when n is 0). */
typedef struct {
    double p50, p90, p99;
    uint64_t n;
} stats_percentiles;

typedef struct {
    double tokens_in_per_s, tokens_out_per_s; /* from counter deltas (0 before 2 samples) */
    stats_percentiles ttft;                   /* requests this worker prefilled */
    stats_percentiles tpot, itl;              /* requests this worker decoded */
} stats_worker_figures;

/* Figures of worker id at now_us (zeros and NaN for one never seen). */
void stats_get_worker(const stats_t *s, const char *id, int64_t now_us, stats_worker_figures *out);

/* The same over every request (rates: the sum over the workers sampled last). */
void stats_get_cluster(const stats_t *s, int64_t now_us, stats_worker_figures *out);

// --- for the exposition (prometheus.h)

/* The value of the model_name label (borrowed, valid while s lives). */
const char *stats_model_name(const stats_t *s);

/* HTTP responses sent with this status code (0 outside 100..599). */
uint64_t stats_http_responses(const stats_t *s, int status);

/* The i-th request-level histogram (i = 0, 1, ... until NULL), borrowed from s, with its
 * metric name (without the prefix) and help text in *name and *help (static strings).
 * NULL, *name and *help untouched, once i is past the last. */
const metrics_histogram *stats_histogram(const stats_t *s, int i, const char **name,
                                         const char **help);

/* The name of a worker state ("ready", "draining", "changing"; "?" otherwise). Role names
 * are proto_role_str's (protocol.h). Static storage. */
const char *stats_state_str(int state);

#endif
