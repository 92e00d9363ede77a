/*
 * batch_internal: declarations shared by the files of the batch module (batch.h):
 * batch.c (the module's life and the job runner: loading, validating, submitting and
 * finalizing batches), batch_lines.c (the input lines: parsing and checking, running them
 * as completions (completion.h), recording their results) and batch_http.c (the /v1/files and
 * /v1/batches handlers). Not a public interface.
 */
#ifndef TP_GW_BATCH_INTERNAL_H
#define TP_GW_BATCH_INTERNAL_H

#include <event2/event.h>
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "api.h"
#include "batch.h"
#include "cluster.h"
#include "completion.h"
#include "httpconn.h"
#include "stats.h"
#include "store.h"

struct evhttp_request;

#define INVALID "invalid_request_error"

typedef enum {
    ST_VALIDATING = 0,
    ST_FAILED,
    ST_IN_PROGRESS,
    ST_FINALIZING,
    ST_COMPLETED,
    ST_EXPIRED,
    ST_CANCELLING,
    ST_CANCELLED,
} status_t;

/* The OpenAI names of the statuses, indexed by status_t. */
extern const char *const batch_status_names[];

enum { LINE_PENDING = 0, LINE_RUNNING = 1, LINE_DONE = 2 };

struct job;

/* A line running on the cluster: the sink of its completion (completion.h), which owns it
 * and frees it through its release (batch_lines.c). */
typedef struct line {
    struct job *job;
    batch_t *b;
    int index;
    char *custom_id;
    completion_t *c;
} line_t;

typedef struct job {
    json_t *obj; /* the batch object (owned) */
    char id[64];
    char owner[32]; /* the creator's API key id (auth.h); "" = none */
    api_kind_t kind;
    status_t status;
    int dirty;
    /* run state (while not final) */
    int active;
    char *content;
    size_t content_len;
    int n_lines;
    size_t *off, *len;    /* (n_lines,) each line in content */
    int *line_no;         /* (n_lines,) each line's number in the file, from 1 (blank lines
                           * are skipped but counted) */
    unsigned char *state; /* (n_lines,) LINE_* */
    int next_line;        /* first line that may be pending */
    int validated;        /* lines checked so far (validating) */
    json_t *seen_ids;     /* validating: custom_ids seen (a set) */
    int n_done, completed, failed;
    completion_list running; /* the lines running now (ud: line_t) */
} job_t;

struct batch {
    struct event_base *base;
    batch_params p;
    char *model;       /* cx.model is this */
    completion_env cx; /* what the lines' completions share: tokenizer, limits, cluster
                        * (NULL: nothing is submitted), stats (NULL: no figures) */
    store_t *store;
    job_t **jobs; /* creation order */
    int n_jobs, cap_jobs;
    int inflight;
    size_t loaded_bytes; /* input file bytes held by the loaded batches (<= max_file_bytes,
                          * or one file) */
    struct event *kick_ev, *tick_ev;
    httpconn_t *conns;          /* the HTTP server's connections (NULL: libevent's own) */
    struct download *downloads; /* file contents being sent (batch_http.c) */
};

// --- small helpers

static inline int64_t now_s(void)
{
    return (int64_t)time(NULL);
}

/* Run the module's work (batch.c) from a deferred event, after the current callback. */
static inline void kick(batch_t *b)
{
    event_active(b->kick_ev, EV_TIMEOUT, 0);
}

static inline int is_final(status_t s)
{
    return s == ST_COMPLETED || s == ST_FAILED || s == ST_EXPIRED || s == ST_CANCELLED;
}

// --- batch.c: jobs

/* Write prefix followed by 24 random hex digits into out (cap bytes, NUL-terminated). */
void batch_make_id(char *out, size_t cap, const char *prefix);
/* Add j to b's jobs (b owns it from then on). 0, or -1 (out of memory: j is not added). */
int batch_job_add(batch_t *b, job_t *j);
/* Count line `line` (0-based) of j as done, ok (completed) or not (failed); a line out of
 * range or already done is ignored, so a result is counted once. */
void batch_job_line_done(job_t *j, int line, int ok);
/* Split j->content (content_len bytes) into its non-blank lines: j->off, j->len,
 * j->line_no and j->state (all LINE_PENDING) for j->n_lines lines, each without its line
 * end and the spaces and tabs around it (and the first without a UTF-8 byte order mark).
 * 0, or -1 (out of memory; what was allocated is j's, freed with its run state). */
int batch_job_split_lines(job_t *j);
/* Load j's run state: its input file and the results stored so far. 0, or -1 (the input
 * file is gone: j is failed; or it cannot be read, or out of memory). */
int batch_job_load(batch_t *b, job_t *j);
/* Load the run state of the batches that are not final and not loaded, oldest first, while
 * their input files fit in max_file_bytes with those of the loaded ones (one always does
 * when none is loaded); the others wait, unloaded, in their status. */
void batch_load_waiting(batch_t *b);
/* Move j to status st, setting the timestamp ts_key (NULL: none) to now; logs, kicks. */
void batch_job_status(batch_t *b, job_t *j, status_t st, const char *ts_key);

// --- batch_lines.c: input lines

/* Parse line i of j and check custom_id, method, url and body. Returns the parsed root
 * (the caller's; NULL when the line is not a JSON object) with *custom_id borrowed from it
 * (NULL when absent or invalid) and *body the request body, or *body NULL with code and msg
 * (cap bytes) saying what is wrong. */
json_t *batch_line_parse(const job_t *j, int i, const char **custom_id, json_t **body,
                         const char **code, char *msg, size_t cap);
/* Record line `line` of j (0-based) as not a valid request line (error file, response
 * null); custom_id may be NULL. */
void batch_line_error(batch_t *b, job_t *j, int line, const char *custom_id, const char *code,
                      const char *msg);
/* The result record of a line that is not a valid request line, `line` its number in
 * the file (from 1, blank lines counted):
 * {"id", "custom_id" (custom_id, NULL: null), "response": null, "error": {"code", "message"
 * (msg, cut to an error message's size at a character boundary), "line"}}. The caller's;
 * NULL on out of memory. */
json_t *batch_line_error_record(int line, const char *custom_id, const char *code,
                                const char *msg);
/* The result record of a line whose request got an HTTP error e: {"id", "custom_id",
 * "response": {"status_code", "request_id" (NULL: null), "body": the error object},
 * "error": null}. The caller's; NULL on out of memory. */
json_t *batch_line_error_response_record(const char *custom_id, const char *request_id,
                                         const api_error *e);
/* Start line i of j: validate its request and submit it, or record its error. Returns 0
 * when the line was handled, 1 when the cluster is full (try again later). */
int batch_line_start(batch_t *b, job_t *j, int i);
/* Stop every running line of j (cancel on the cluster): they go back to pending. */
void batch_job_stop_lines(batch_t *b, job_t *j);

// --- batch_download.c: GET /v1/files/{id}/content

/* A download is read and queued a piece at a time: the file's size / 16, at least 256 KiB
 * and at most 4 MiB. Each piece opens the file's BLOB afresh, and SQLite walks its overflow
 * pages from the start to reach the piece's offset, so a fixed piece made a download's CPU
 * grow with the square of the file's size (8 downloads of a 30 MB file: 4.2 s of the loop
 * with 256 KiB pieces, against 0.7 s sending it whole); 16 pieces keep it linear. */
#define BATCH_DOWNLOAD_PIECES 16
#define BATCH_DOWNLOAD_MIN (256 << 10)
#define BATCH_DOWNLOAD_MAX (4 << 20)

/* Answer req (GET or HEAD) with file f's content (f was looked up and is visible to the
 * caller), streamed a piece at a time. 0, or -1 out of memory (nothing was sent: the
 * caller answers 500). */
int batch_download_start(batch_t *b, struct evhttp_request *req, const store_file *f);
/* Cut every download still being sent (their connections are closed). batch_destroy. */
void batch_download_cut_all(batch_t *b);

#endif
