/*
 * store: the gateway's durable state in one SQLite file: uploaded and generated files,
 * batch objects, and the result of every finished batch line.
 *
 * The database runs in WAL mode with synchronous=NORMAL and secure_delete (freed space is
 * overwritten with zeros: deleted content does not linger in free pages): a commit costs no fsync (the WAL
 * is synced at checkpoints), and a committed transaction survives a crash of the process
 * (not necessarily of the machine). Batch objects and line results are not written when
 * they are put: they are queued in memory and written by store_flush() in one transaction,
 * which the caller runs once per loop tick, so the loop pays one short commit however many
 * lines finished; the queue is bounded (STORE_MAX_PENDING: a put beyond it flushes first).
 * Files are written at once (an upload is answered only once its file is durable).
 *
 * Tables (schema version 2): files(id, purpose, filename, bytes, created_at, content, owner),
 * deleted_files(seq, id, created_at, owner: where a deleted file stood, no content),
 * responses(id, owner, created_at, object: a stored Responses API object's JSON),
 * batches(id, object: the batch's JSON, owner), results(batch_id, line, ok, body: one JSONL
 * line). responses, deleted_files and the files_list index are created when missing (no version
 * change: a gateway that does not know them ignores them). owner is the id of the API key that created the object (auth.h; never the key),
 * NULL when there is none (no keys configured, or a row from before version 2). A version 1
 * database is migrated when opened (the owner columns added, NULL in every old row).
 * One thread at a time (the gateway's loop thread).
 */
#ifndef TP_GW_STORE_H
#define TP_GW_STORE_H

#include <stddef.h>
#include <stdint.h>

#define STORE_MAX_PENDING 4096 /* queued writes before a put flushes by itself */

typedef struct store store_t;

/* Open or create the database at path (its directory is created when missing), switch to
 * WAL and create the tables. The opener owns the database until store_close: an exclusive
 * lock on <path>.lock (holding the owner's pid) refuses a second owner, in this process or
 * another. NULL with a message naming the file in err (for a second owner: "in use by
 * another gateway (pid N)"). */
store_t *store_open(const char *path, char *err, size_t errlen);

/* Flush pending writes, close and free. Takes NULL; NULLs *s. */
void store_close(store_t **s);

// --- files

typedef struct {
    char id[64];
    char purpose[32]; /* "batch", "batch_output" */
    char filename[256];
    int64_t bytes;
    int64_t created_at; /* unix seconds */
    char owner[32];     /* the creator's API key id; "" = none */
} store_file;

/* Insert file f (its owner "" stored as NULL) with its content (len bytes), committed before
 * returning. 0 or -1 (the id exists, disk error). */
int store_file_put(store_t *s, const store_file *f, const void *content, size_t len);

/* The metadata of file id into *out: 0, 1 when there is no such file, -1 on error. */
int store_file_get(store_t *s, const char *id, store_file *out);

/* The content of file id: *data is malloc'd (NUL-terminated, len bytes before the NUL),
 * the caller's. 0, 1 when there is no such file, -1 on error. */
int store_file_content(store_t *s, const char *id, char **data, size_t *len);

/* Read n bytes of file id's content from byte offset into buf (incremental BLOB I/O: only
 * the pages of that range are read; no transaction stays open after the call, so a
 * download read piece by piece holds no lock between pieces). 0, 1 when there is no such
 * file or it is shorter than offset + n, -1 on error. */
int store_file_read(store_t *s, const char *id, int64_t offset, void *buf, size_t n);

/* Delete file id and its content in one transaction, committed before returning, and when
 * results_of is not NULL also the stored results of batch results_of with that ok (1: its
 * output file's lines, 0: its error file's). The freed pages are overwritten with zeros
 * (PRAGMA secure_delete) and the WAL checkpointed and truncated, so the bytes leave the
 * database's files, not only its tables. A row in deleted_files keeps the file's place for
 * list cursors. 0, 1 when there is no such file (nothing changed), -1 on error (nothing
 * changed). Pending writes are flushed first. Costs a write of the file's size (the zeros)
 * and a checkpoint, on the caller's thread. */
int store_file_delete(store_t *s, const char *id, const char *results_of, int ok);

typedef struct {
    const char *purpose; /* only files of this purpose; NULL = any */
    const char *owner;   /* only this owner's files (and cursor); NULL = every owner's */
    const char *after;   /* cursor: start after this file (which may be deleted); NULL = none */
    int desc;            /* 1: newest first (created_at, then creation order), 0: oldest */
    int limit;           /* at most this many (>= 1) */
} store_file_query;

/* Call fn for the files q selects, in q's order (fn returns 0 to go on); *has_more is 1
 * when more files follow the last one given. 0, 1 when q->after names no file (nor deleted
 * file) of q->owner, -1 on error. Reads only the files_list index, never the content. */
int store_file_list(store_t *s, const store_file_query *q,
                    int (*fn)(const store_file *f, void *ud), void *ud, int *has_more);

// --- batches and results (queued until store_flush)

/* Queue the insert-or-replace of batch id's object (JSON text, copied). owner (copied; NULL
 * or "" = none) is stored when the batch is inserted; a replace keeps the stored one. 0 or
 * -1 (OOM). */
int store_batch_put(store_t *s, const char *id, const char *owner, const char *json);

/* Call fn for every stored batch in creation order (pending writes are flushed first) with
 * its owner ("" = none); fn returns 0 to go on. 0, or -1 on a database error. */
int store_batch_foreach(store_t *s,
                        int (*fn)(const char *id, const char *json, const char *owner, void *ud),
                        void *ud);

/* Queue line's result of batch batch_id (ok: 1 = output file, 0 = error file; json: the
 * JSONL line without newline, copied). 0 or -1 (OOM). */
int store_result_put(store_t *s, const char *batch_id, int line, int ok, const char *json);

/* Call fn for every stored result of batch_id, by line (pending writes flushed first).
 * ok < 0: every result, else only those with that ok. fn returns 0 to go on. 0 or -1. */
int store_results_foreach(store_t *s, const char *batch_id, int ok,
                          int (*fn)(int line, int ok, const char *json, size_t len, void *ud),
                          void *ud);

// --- responses (POST /v1/responses with store, GET / DELETE /v1/responses/{id})

/* Queue the insert-or-replace of response id (json: the response object, copied; owner:
 * the creator's API key id, NULL or "" = none; created_at unix seconds). 0 or -1 (OOM). */
int store_response_put(store_t *s, const char *id, const char *owner, int64_t created_at,
                       const char *json);

/* Response id (pending writes flushed first): *json malloc'd, the caller's; its owner into
 * owner (owner_cap bytes; "" = none). 0, 1 when there is none (*json NULL), -1 on error. */
int store_response_get(store_t *s, const char *id, char **json, char *owner, size_t owner_cap);

/* Delete response id, committed, its bytes overwritten and the WAL truncated as
 * store_file_delete. 0, 1 when there is none, -1 on error. */
int store_response_delete(store_t *s, const char *id);

/* Write every queued put in one transaction. 0, or -1 (the writes stay queued and the
 * next flush tries again). */
int store_flush(store_t *s);

/* Puts queued and not yet written. */
int store_n_pending(const store_t *s);

#endif
