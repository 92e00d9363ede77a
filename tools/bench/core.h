/*
 * bench/core: the state of one tidepool-bench run, shared by the request engine
 * (tools/tidepool-bench.c) and the report (bench/report.h). Part of tidepool-bench
 * (included once; everything is static).
 *
 * One record per request is allocated up front (rec_t, ~100 bytes); everything a request
 * needs only while it runs (connection, SSE parser, ITL list being built) lives in its
 * flight and is freed in one place when it ends. Inter-token latencies of finished
 * requests go to one shared pool of floats, capped at BENCH_ITL_POOL_MAX samples.
 */
#ifndef TP_BENCH_CORE_H
#define TP_BENCH_CORE_H

#include <event2/event.h>
#include <math.h>
#include <stdint.h>
#include <time.h>

#define BENCH_SSE_MAX_BYTES (1u << 20)          /* one SSE event, bytes */
#define BENCH_ERRBODY_MAX 2048                  /* kept of a non-200 body, bytes */
#define BENCH_ITL_PER_REQUEST_MAX (1u << 20)    /* ITL samples kept per request */
#define BENCH_ITL_POOL_MAX ((size_t)1 << 26)    /* ITL samples kept in all (256 MiB) */
#define BENCH_ERROR_MSG_MAX 240                 /* bytes of an error message */
#define BENCH_ERR_GROUPS_MAX 16

typedef enum {
    REC_NOT_SENT = 0, /* never sent (interrupted run) */
    REC_RUNNING,
    REC_OK,
    REC_FAILED,
} rec_state_t;

/* Why a request failed; the summary groups errors by (kind, HTTP status). */
typedef enum {
    FAIL_HTTP = 0,     /* non-200 status */
    FAIL_CONNECT,      /* connection refused / reset / other socket error */
    FAIL_CLOSED,       /* the server closed the connection before the stream ended */
    FAIL_STREAM_ERROR, /* an error event or {"error": ...} chunk in the stream */
    FAIL_PROTOCOL,     /* malformed HTTP, SSE or JSON */
    FAIL_TIMEOUT,      /* --timeout-s elapsed */
    FAIL_NO_CONTENT,   /* the stream ended without any content */
    FAIL_LOCAL,        /* out of memory or a libevent failure in the client */
    FAIL_INTERRUPTED,  /* SIGINT / SIGTERM while in flight */
} fail_kind_t;

static const char *const fail_kind_names[] = {
    "http", "connect", "closed", "stream_error", "protocol", "timeout", "no_content",
    "client", "interrupted",
};

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
    int8_t state;              /* rec_state_t */
    int8_t phase;              /* PHASE_* */
    uint8_t prompt_from_usage; /* prompt_tokens came from usage */
    uint8_t output_from_usage; /* output_tokens came from usage */
    uint8_t fail_kind;         /* fail_kind_t, when FAILED */
    char *error;               /* when FAILED: message (malloc'd), NULL on OOM */
} rec_t;

typedef struct {
    int kind;     /* fail_kind_t */
    int status;   /* HTTP status for FAIL_HTTP, else 0 */
    size_t count;
    char msg[BENCH_ERROR_MSG_MAX]; /* first message of this group */
} err_group_t;

struct flight;

typedef struct bench {
    bench_args a;
    struct event_base *base;
    /* target */
    char host_addr[64];       /* numeric address to connect to */
    uint16_t port;
    char host_header[300];    /* Host: as written in --url */
    char prefix[512];         /* path of --url without a trailing '/' */
    char path[1024];          /* prefix + endpoint */
    int chat;                 /* endpoint is chat/completions */
    char *model;              /* owned */
    dataset_t ds;
    /* records */
    rec_t *recs;
    size_t n;                 /* = num_prompts */
    float *itl_pool;          /* ms */
    size_t n_itl_pool, cap_itl_pool;
    size_t n_itl_dropped;
    /* dispatch */
    size_t n_arrived, n_sent, n_done, n_ok, n_failed, in_flight, peak_in_flight;
    size_t n_live;            /* flights allocated and not yet torn down */
    struct event *arrival_ev, *progress_ev, *sigint_ev, *sigterm_ev;
    int stopping;             /* interrupted: send nothing more */
    int64_t t0_ns, t_end_ns;  /* start; last request end */
    struct flight *active;    /* doubly linked list of running flights */
    err_group_t groups[BENCH_ERR_GROUPS_MAX];
    size_t n_groups, n_ungrouped;
    int progress;             /* draw the progress bar */
    int progress_drawn;
    int first_error_logged;
} bench;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int bench_phase_shift(const bench *b)
{
    return strcmp(b->a.workload, "phase-shift") == 0;
}

/* Phase-shift: the phase (PHASE_PREFILL = 0, PHASE_DECODE = 1) of time t_s. */
static int bench_phase_at(const bench *b, double t_s)
{
    return (int)((long long)floor(t_s / b->a.phase_s) % 2);
}

#endif
