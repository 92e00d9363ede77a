/*
 * bench: the state of one tidepool-bench run, shared by the request engine (the dispatch
 * in tools/tidepool-bench.c and the requests in flight, bench_flight.h, which fill it) and
 * the report (bench_report.h, which reads it once the run is over). Loop thread only.
 *
 * One record per request is allocated up front (bench_rec, ~100 bytes); everything a
 * request needs only while it runs (connection, SSE parser, ITL list being built) lives in
 * its flight (bench_flight.h) and is freed in one place when it ends. Inter-token
 * latencies of finished requests go to one shared pool of floats, capped at
 * BENCH_ITL_POOL_MAX samples.
 */
#ifndef TP_BENCH_H
#define TP_BENCH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/time.h>

#include "bench_args.h"
#include "bench_dataset.h"
#include "bench_trace.h"

#define BENCH_ITL_POOL_MAX ((size_t)1 << 26) /* ITL samples kept in all (256 MiB) */
#define BENCH_ERROR_MSG_MAX 240              /* bytes of an error message */
#define BENCH_ERR_GROUPS_MAX 16              /* error kinds the summary lists */

typedef enum {
    BENCH_REC_NOT_SENT = 0, /* never sent (interrupted run) */
    BENCH_REC_RUNNING,
    BENCH_REC_OK,
    BENCH_REC_FAILED,
} bench_rec_state_t;

/* Why a request failed; the summary groups errors by (kind, HTTP status). */
typedef enum {
    BENCH_FAIL_HTTP = 0,     /* non-200 status */
    BENCH_FAIL_CONNECT,      /* connection refused / reset / other socket error */
    BENCH_FAIL_CLOSED,       /* the server closed the connection before the stream ended */
    BENCH_FAIL_STREAM_ERROR, /* an error event or {"error": ...} chunk in the stream */
    BENCH_FAIL_PROTOCOL,     /* malformed HTTP, SSE or JSON */
    BENCH_FAIL_TIMEOUT,      /* --timeout-s elapsed */
    BENCH_FAIL_NO_CONTENT,   /* the stream ended without any content */
    BENCH_FAIL_LOCAL,        /* out of memory or a libevent failure in the client */
    BENCH_FAIL_INTERRUPTED,  /* SIGINT / SIGTERM while in flight */
} bench_fail_t;

/* One request. */
typedef struct {
    double arrival_s;          /* scheduled arrival, s after the start (0: all at once) */
    double start_s;            /* sent, s after the start */
    double ttft_ms;            /* < 0: no content received */
    double e2el_ms;            /* sent -> response complete (or failure) */
    long long prompt_words;    /* words in the prompt */
    long long max_tokens;      /* as sent; -1: not set */
    long long prompt_tokens;   /* usage.prompt_tokens, else prompt_words */
    long long output_tokens;   /* usage.completion_tokens, else content chunks */
    size_t itl_off;            /* first ITL sample in the pool */
    uint32_t n_itl;            /* ITL samples in the pool */
    int http_status;           /* 0: no response */
    int8_t state;              /* bench_rec_state_t */
    int8_t phase;              /* BENCH_WORKLOAD_PHASE_* */
    uint8_t prompt_from_usage; /* prompt_tokens came from usage */
    uint8_t output_from_usage; /* output_tokens came from usage */
    uint8_t fail_kind;         /* bench_fail_t, when FAILED */
    uint8_t offline;           /* --trace: an offline-class request (service_tier flex) */
    char *error;               /* when FAILED: message (malloc'd), NULL on OOM */
    char *reply;               /* multi-turn, when OK: the streamed text (malloc'd) */
} bench_rec;

/* Failures of one cause. */
typedef struct {
    int kind;     /* bench_fail_t */
    int status;   /* HTTP status for BENCH_FAIL_HTTP, else 0 */
    size_t count;
    char msg[BENCH_ERROR_MSG_MAX]; /* first message of this group */
} bench_err_group;

struct event_base;
struct event;
struct bench_flight;

typedef struct bench {
    bench_args a;
    struct event_base *base;
    /* target */
    char host_addr[64];       /* numeric address to connect to */
    uint16_t port;
    char host_header[300];    /* Host: as written in --url */
    char *authorization;      /* owned; "Bearer KEY" (--api-key or the environment), NULL:
                               * no Authorization header */
    char prefix[512];         /* path of --url without a trailing '/' */
    char path[1024];          /* prefix + endpoint */
    int chat;                 /* endpoint is chat/completions */
    char *model;              /* owned */
    bench_dataset_t *ds;      /* owned; NULL: synthetic prompts */
    bench_trace_t *trace;     /* owned; --trace, NULL without it */
    /* records */
    bench_rec *recs;
    size_t n;                 /* requests in the run (num_prompts, or fewer with duration_s) */
    float *itl_pool;          /* ms */
    size_t n_itl_pool, cap_itl_pool;
    size_t n_itl_dropped;
    /* dispatch */
    size_t n_arrived, n_sent, n_done, n_ok, n_failed, in_flight, peak_in_flight;
    size_t n_live;            /* flights allocated and not yet torn down */
    size_t next_unsent;       /* multi-turn: every request before it was sent */
    struct event *arrival_ev, *progress_ev, *sigint_ev, *sigterm_ev;
    int stopping;             /* interrupted: send nothing more */
    int64_t t0_ns, t_end_ns;  /* start; last request end (bench_now_ns) */
    struct bench_flight *active; /* doubly linked list of running flights */
    bench_err_group groups[BENCH_ERR_GROUPS_MAX];
    size_t n_groups, n_ungrouped;
    int progress;             /* draw the progress bar */
    int progress_drawn;
    int first_error_logged;
} bench;

/* The monotonic clock in ns (CLOCK_MONOTONIC). */
int64_t bench_now_ns(void);

/* s seconds as a timeval for libevent timers (negative: 0; microseconds truncated). */
struct timeval bench_timeval(double s);

/* The name of a bench_fail_t in result files ("http", "connect", ..., "interrupted");
 * "?" for any other value. A static string. */
const char *bench_fail_str(int kind);

#endif
