/*
 * batch: OpenAI's Files and Batch API on the gateway, run as offline requests.
 *
 * POST /v1/files takes a JSONL file (multipart/form-data with purpose=batch and a file
 * part, or a raw body with ?purpose=batch); POST /v1/batches starts a job over such a file.
 * Each input line {"custom_id", "method": "POST", "url", "body"} is validated like a
 * normal request (a bad line becomes a line of the error file, never a failed batch),
 * then runs as an offline request (cluster.h, tier "offline") through the same cluster,
 * with at most max_inflight lines of all batches submitted at a time. Each finished line
 * gives one output line {"id", "custom_id", "response": {"status_code", "request_id",
 * "body"}, "error"} whose body is exactly what a non-streaming request returns.
 *
 * Everything persists in SQLite (store.h): files, batch objects, and every finished line's
 * result, written once per loop tick in one transaction (WAL), so a restart loses no
 * finished line; batch_new() resumes the batches that were validating, in progress,
 * finalizing or cancelling. Validation and finalization run in slices on deferred events,
 * so a large file never holds the loop for long.
 *
 * Files and batches belong to the API key that created them (its id, auth.h, is stored with
 * them; the output and error files of a batch are its owner's): a caller sees only its own
 * objects, another key's are answered exactly as a nonexistent object (404), and a batch
 * may only read its owner's input file. A caller that sees everything (no keys configured,
 * or an admin key) sees objects of every owner and objects without one.
 *
 * GET /v1/files lists a caller's files (purpose, limit, order, after); DELETE /v1/files/{id}
 * deletes a file and its bytes (store.h), refused with 409 file_in_use while a batch that is
 * not final names it (its input is read again at every resume), and deleting a final
 * batch's output or error file deletes the batch's stored results of that kind too.
 *
 * Uploads are parsed by multipart.h. Loop thread only.
 */
#ifndef TP_GW_BATCH_H
#define TP_GW_BATCH_H

#include <stddef.h>
#include <stdint.h>

#include "cluster.h"
#include "stats.h"
#include "tokenizer.h"

struct event_base;
struct evhttp_request;

typedef struct batch batch_t;

typedef struct {
    const char *state_db;   /* SQLite file (its directory is created) */
    size_t max_file_bytes;  /* largest upload */
    int max_lines;          /* lines per input file */
    int max_inflight;       /* batch lines submitted to the cluster at a time */
    size_t max_body_bytes;  /* a line's body, and POST /v1/batches bodies */
    const char *model_name; /* served model (copied) */
    int n_ctx;              /* context length in tokens */
    const tokenizer_t *tok; /* borrowed; must outlive the module */
} batch_params;

/* Defaults: build/state/gateway.db, 100 MiB, 50000 lines, 256 in flight, 1 MiB bodies. */
batch_params batch_default_params(void);

/* Open (or create) the state database and resume unfinished batches once the cluster is
 * given. NULL with a message in err (cannot create the directory, open the database, bad
 * schema, out of memory). */
batch_t *batch_new(struct event_base *base, const batch_params *p, char *err, size_t errlen);

/* Run lines on c (borrowed; destroy the cluster before the batch module: the cluster then
 * fails the lines in flight with "shutting_down", which leaves them unfinished, to be
 * resumed at the next start). Starts resuming. */
void batch_set_cluster(batch_t *b, cluster_t *c);

/* Count lines in stats (borrowed; may be NULL). */
void batch_set_stats(batch_t *b, stats_t *stats);

/* The module's store (store.h), for the gateway's other durable state (stored responses);
 * borrowed, valid until batch_destroy. */
struct store *batch_store(batch_t *b);

/* Flush what is pending to the database, close it and free. Takes NULL; NULLs *b. */
void batch_destroy(batch_t **b);

typedef enum {
    BATCH_ROUTE_FILES = 0,    /* POST (upload) / GET (list) /v1/files */
    BATCH_ROUTE_FILE,         /* GET / DELETE /v1/files/{id} */
    BATCH_ROUTE_FILE_CONTENT, /* GET /v1/files/{id}/content */
    BATCH_ROUTE_BATCHES,      /* GET (list) / POST (create) /v1/batches */
    BATCH_ROUTE_BATCH,        /* GET /v1/batches/{id} */
    BATCH_ROUTE_CANCEL,       /* POST /v1/batches/{id}/cancel */
} batch_route_t;

/* Who is asking (borrowed for the call). */
typedef struct {
    const char *owner; /* the caller's API key id: recorded on what it creates (NULL: none) */
    int see_all;       /* 1: every object is visible (no keys configured, an admin key) */
} batch_caller;

struct httpconn;

/* The HTTP server's connection watcher (httpconn.h; borrowed, NULL: none), whose close
 * callbacks a download that is being sent uses to learn that its client left. */
void batch_set_httpconn(batch_t *b, struct httpconn *conns);

/* Answer req for route (id: the path's {id}, NUL-terminated, may be NULL) on behalf of who.
 * The method was checked by the caller. Always replies (2xx JSON, or an OpenAI error
 * body). GET /v1/files/{id}/content is streamed from the store a piece (at most 4 MiB) at
 * a time, the next piece read once the last one was written to the socket, so a
 * download holds one piece whatever the file's size; a file deleted while it is sent cuts
 * its download (the connection is closed before Content-Length bytes). */
void batch_handle(batch_t *b, struct evhttp_request *req, batch_route_t route, const char *id,
                  const batch_caller *who);

#endif
