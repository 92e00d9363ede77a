/* store: see store.h.
 *
 * Pending writes are a growable array of ops, written in order by store_flush() with
 * prepared statements inside BEGIN IMMEDIATE ... COMMIT. A failed flush rolls back and
 * keeps the ops for the next try. */
#include "store.h"

#include <errno.h>
#include <fcntl.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"

#define SCHEMA_VERSION 2

typedef enum { OP_BATCH = 0, OP_RESULT, OP_RESPONSE } op_kind;

typedef struct {
    op_kind kind;
    char *batch_id; /* a response's id for OP_RESPONSE */
    char *owner;    /* batch objects and responses: the owner's key id, NULL = none */
    int line, ok;
    int64_t created_at; /* responses */
    char *json;
} store_op;

struct store {
    sqlite3 *db;
    char *path;
    int lock_fd; /* <path>.lock, flock'ed for as long as the store is open (-1 = none) */
    sqlite3_stmt *put_batch, *put_result, *put_response;
    store_op *ops;
    int n_ops, cap_ops;
};

static const char *schema =
    "CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);"
    "CREATE TABLE IF NOT EXISTS files(id TEXT PRIMARY KEY, purpose TEXT NOT NULL,"
    " filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL,"
    " content BLOB NOT NULL, owner TEXT);"
    "CREATE TABLE IF NOT EXISTS batches(id TEXT PRIMARY KEY, object TEXT NOT NULL, owner TEXT);"
    "CREATE TABLE IF NOT EXISTS results(batch_id TEXT NOT NULL, line INTEGER NOT NULL,"
    " ok INTEGER NOT NULL, body TEXT NOT NULL, PRIMARY KEY(batch_id, line));"
    /* deleted files: no content, only where they stood in the list (seq: their files rowid),
     * so that a list cursor naming one still works; also keeps rowids from being reused */
    "CREATE TABLE IF NOT EXISTS responses(id TEXT PRIMARY KEY, owner TEXT,"
    " created_at INTEGER NOT NULL, object TEXT NOT NULL);"
    "CREATE TABLE IF NOT EXISTS deleted_files(seq INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE,"
    " created_at INTEGER NOT NULL, owner TEXT);"
    "INSERT OR IGNORE INTO meta(key, value) VALUES('schema_version', '2');";

/* Made after a migration (it needs the owner column). The file list reads only this index:
 * owner is stored after the content, so reading it from the table walks every overflow page
 * of the file. */
static const char *indexes = "CREATE INDEX IF NOT EXISTS files_list ON files(created_at, purpose,"
                             " owner, id, filename, bytes);";

/* Version 1 -> 2: the owner columns (API keys); rows from before have none. */
static const char *migrate_1_2 = "BEGIN IMMEDIATE;"
                                 "ALTER TABLE files ADD COLUMN owner TEXT;"
                                 "ALTER TABLE batches ADD COLUMN owner TEXT;"
                                 "UPDATE meta SET value = '2' WHERE key = 'schema_version';"
                                 "COMMIT;";

/* mkdir -p of path's directory. */
static int make_parent(const char *path, char *err, size_t errlen)
{
    char *dir = strdup(path);
    if (!dir) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir) {
        free(dir);
        return 0;
    }
    *slash = 0;
    for (char *p = dir + 1;; p++) {
        if (*p == '/' || *p == 0) {
            char c = *p;
            *p = 0;
            if (mkdir(dir, 0755) < 0 && errno != EEXIST) {
                snprintf(err, errlen, "cannot create directory %s: %s", dir, strerror(errno));
                free(dir);
                return -1;
            }
            *p = c;
            if (!c)
                break;
        }
    }
    free(dir);
    return 0;
}

/* One database, one owner: take an exclusive lock on <path>.lock (released when the
 * process exits, however it exits) and write our pid into it. Two gateways started from
 * one checkout share the default --state-db; the second would resume the first one's
 * running batches and compute every line again. Returns 0, or -1 with err set. */
static int lock_owner(store_t *s, char *err, size_t errlen)
{
    char lpath[4096];
    if (snprintf(lpath, sizeof(lpath), "%s.lock", s->path) >= (int)sizeof(lpath)) {
        snprintf(err, errlen, "%.200s: path too long", s->path);
        return -1;
    }
    s->lock_fd = open(lpath, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (s->lock_fd < 0) {
        snprintf(err, errlen, "%.200s: cannot open the lock file: %s", lpath, strerror(errno));
        return -1;
    }
    if (flock(s->lock_fd, LOCK_EX | LOCK_NB) < 0) {
        int e = errno;
        char pid[32] = "";
        ssize_t n = pread(s->lock_fd, pid, sizeof(pid) - 1, 0);
        pid[n > 0 ? n : 0] = 0;
        pid[strcspn(pid, "\n")] = 0;
        if (e == EWOULDBLOCK)
            snprintf(err, errlen,
                     "%.200s: the state database is in use by another gateway (pid %s): give "
                     "each gateway its own --state-db",
                     s->path, pid[0] ? pid : "unknown");
        else
            snprintf(err, errlen, "%.200s: cannot lock it: %s", lpath, strerror(e));
        return -1;
    }
    char pid[32];
    int n = snprintf(pid, sizeof(pid), "%ld\n", (long)getpid());
    if (ftruncate(s->lock_fd, 0) < 0 || pwrite(s->lock_fd, pid, (size_t)n, 0) != n)
        log_warn("%s: cannot write the owner's pid: %s", lpath, strerror(errno));
    return 0;
}

store_t *store_open(const char *path, char *err, size_t errlen)
{
    if (make_parent(path, err, errlen) < 0)
        return NULL;
    store_t *s = calloc(1, sizeof(*s));
    if (!s || !(s->path = strdup(path))) {
        free(s);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    s->lock_fd = -1;
    char *msg = NULL;
    sqlite3_stmt *st = NULL;
    if (lock_owner(s, err, errlen) < 0)
        goto fail;
    if (sqlite3_open_v2(path, &s->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, NULL) !=
        SQLITE_OK) {
        snprintf(err, errlen, "%s: cannot open the state database: %s", path,
                 s->db ? sqlite3_errmsg(s->db) : "out of memory");
        goto fail;
    }
    sqlite3_busy_timeout(s->db, 2000);
    /* secure_delete: whatever a delete or an update frees (a deleted file's overflow pages,
     * a replaced row's old bytes) is overwritten with zeros, so that deleted content leaves
     * the database file and not only its tables (DELETE /v1/files/{id}) */
    if (sqlite3_exec(s->db,
                     "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA secure_delete=ON;",
                     NULL, NULL, &msg) != SQLITE_OK ||
        sqlite3_exec(s->db, schema, NULL, NULL, &msg) != SQLITE_OK) {
        snprintf(err, errlen, "%s: not a usable state database: %s", path,
                 msg ? msg : sqlite3_errmsg(s->db));
        goto fail;
    }
    if (sqlite3_prepare_v2(s->db, "SELECT value FROM meta WHERE key = 'schema_version'", -1, &st,
                           NULL) != SQLITE_OK ||
        sqlite3_step(st) != SQLITE_ROW) {
        snprintf(err, errlen, "%s: cannot read the schema version", path);
        goto fail;
    }
    int version = atoi((const char *)sqlite3_column_text(st, 0));
    sqlite3_finalize(st);
    st = NULL;
    if (version == 1) {
        if (sqlite3_exec(s->db, migrate_1_2, NULL, NULL, &msg) != SQLITE_OK) {
            snprintf(err, errlen, "%s: cannot migrate the schema from version 1 to 2: %s", path,
                     msg ? msg : sqlite3_errmsg(s->db));
            sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
            goto fail;
        }
        log_info("%s: schema migrated from version 1 to 2 (owner columns; the objects stored "
                 "so far have no owner: visible to admin keys only when keys are configured)",
                 path);
        version = 2;
    }
    if (version != SCHEMA_VERSION) {
        snprintf(err, errlen, "%s: schema version %d, this gateway knows %d", path, version,
                 SCHEMA_VERSION);
        goto fail;
    }
    if (sqlite3_exec(s->db, indexes, NULL, NULL, &msg) != SQLITE_OK) {
        snprintf(err, errlen, "%s: cannot create the indexes: %s", path,
                 msg ? msg : sqlite3_errmsg(s->db));
        goto fail;
    }
    if (sqlite3_prepare_v2(s->db,
                           "INSERT INTO batches(id, object, owner) VALUES(?1, ?2, ?3) ON "
                           "CONFLICT(id) DO UPDATE SET object = excluded.object",
                           -1, &s->put_batch, NULL) != SQLITE_OK ||
        sqlite3_prepare_v2(s->db,
                           "INSERT OR REPLACE INTO results(batch_id, line, ok, body) "
                           "VALUES(?1, ?2, ?3, ?4)",
                           -1, &s->put_result, NULL) != SQLITE_OK ||
        sqlite3_prepare_v2(s->db,
                           "INSERT OR REPLACE INTO responses(id, owner, created_at, object) "
                           "VALUES(?1, ?2, ?3, ?4)",
                           -1, &s->put_response, NULL) != SQLITE_OK) {
        snprintf(err, errlen, "%s: %s", path, sqlite3_errmsg(s->db));
        goto fail;
    }
    return s;
fail:
    sqlite3_free(msg);
    sqlite3_finalize(st);
    store_close(&s);
    return NULL;
}

static void op_free(store_op *op)
{
    free(op->batch_id);
    free(op->owner);
    free(op->json);
}

void store_close(store_t **ps)
{
    if (!ps || !*ps)
        return;
    store_t *s = *ps;
    if (s->db && s->n_ops && store_flush(s) < 0)
        log_error("%s: %d writes could not be saved", s->path, s->n_ops);
    for (int i = 0; i < s->n_ops; i++)
        op_free(&s->ops[i]);
    free(s->ops);
    sqlite3_finalize(s->put_batch);
    sqlite3_finalize(s->put_result);
    sqlite3_finalize(s->put_response);
    if (s->db)
        sqlite3_close(s->db);
    if (s->lock_fd >= 0)
        close(s->lock_fd); /* releases the lock: after the database is closed */
    free(s->path);
    free(s);
    *ps = NULL;
}

// --- files

/* Columns (id, purpose, filename, bytes, created_at, owner) of st into *out. */
static void file_row(sqlite3_stmt *st, store_file *out)
{
    memset(out, 0, sizeof(*out));
    const char *owner = (const char *)sqlite3_column_text(st, 5);
    snprintf(out->id, sizeof(out->id), "%s", (const char *)sqlite3_column_text(st, 0));
    snprintf(out->purpose, sizeof(out->purpose), "%s", (const char *)sqlite3_column_text(st, 1));
    snprintf(out->filename, sizeof(out->filename), "%s", (const char *)sqlite3_column_text(st, 2));
    out->bytes = sqlite3_column_int64(st, 3);
    out->created_at = sqlite3_column_int64(st, 4);
    snprintf(out->owner, sizeof(out->owner), "%s", owner ? owner : "");
}

int store_file_put(store_t *s, const store_file *f, const void *content, size_t len)
{
    sqlite3_stmt *st = NULL;
    int rc = -1;
    if (sqlite3_prepare_v2(s->db,
                           /* rowids only grow, past deleted files too: the list's order
                            * (created_at, rowid) and its cursors stay stable */
                           "INSERT INTO files(rowid, id, purpose, filename, bytes, created_at, "
                           "content, owner) VALUES((SELECT coalesce(max(m), 0) + 1 FROM (SELECT "
                           "max(rowid) AS m FROM files UNION ALL SELECT max(seq) FROM "
                           "deleted_files)), ?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                           -1, &st, NULL) != SQLITE_OK)
        goto out;
    sqlite3_bind_text(st, 1, f->id, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, f->purpose, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 3, f->filename, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 4, (sqlite3_int64)len);
    sqlite3_bind_int64(st, 5, f->created_at);
    sqlite3_bind_blob64(st, 6, content ? content : "", (sqlite3_uint64)len, SQLITE_STATIC);
    if (f->owner[0])
        sqlite3_bind_text(st, 7, f->owner, -1, SQLITE_STATIC);
    else
        sqlite3_bind_null(st, 7);
    if (sqlite3_step(st) == SQLITE_DONE)
        rc = 0;
out:
    if (rc < 0)
        log_error("%s: cannot save file %s: %s", s->path, f->id, sqlite3_errmsg(s->db));
    sqlite3_finalize(st);
    return rc;
}

int store_file_get(store_t *s, const char *id, store_file *out)
{
    sqlite3_stmt *st = NULL;
    int rc = -1;
    if (sqlite3_prepare_v2(s->db,
                           "SELECT id, purpose, filename, bytes, created_at, owner FROM files "
                           "WHERE id = ?1",
                           -1, &st, NULL) != SQLITE_OK)
        goto out;
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    int step = sqlite3_step(st);
    if (step == SQLITE_DONE) {
        rc = 1;
    } else if (step == SQLITE_ROW) {
        file_row(st, out);
        rc = 0;
    }
out:
    if (rc < 0)
        log_error("%s: cannot read file %s: %s", s->path, id, sqlite3_errmsg(s->db));
    sqlite3_finalize(st);
    return rc;
}

int store_file_read(store_t *s, const char *id, int64_t offset, void *buf, size_t n)
{
    sqlite3_stmt *st = NULL;
    sqlite3_blob *blob = NULL;
    int rc = -1;
    /* length() of a BLOB reads its record header only, not its pages */
    if (sqlite3_prepare_v2(s->db, "SELECT rowid, length(content) FROM files WHERE id = ?1", -1,
                           &st, NULL) != SQLITE_OK)
        goto out;
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    int step = sqlite3_step(st);
    if (step == SQLITE_DONE) {
        rc = 1;
        goto out;
    }
    if (step != SQLITE_ROW)
        goto out;
    sqlite3_int64 rowid = sqlite3_column_int64(st, 0), len = sqlite3_column_int64(st, 1);
    if (offset < 0 || (uint64_t)offset + n > (uint64_t)len || len > INT32_MAX) {
        rc = 1;
        goto out;
    }
    if (sqlite3_blob_open(s->db, "main", "files", "content", rowid, 0, &blob) != SQLITE_OK ||
        sqlite3_blob_read(blob, buf, (int)n, (int)offset) != SQLITE_OK)
        goto out;
    rc = 0;
out:
    if (rc < 0)
        log_error("%s: cannot read file %s: %s", s->path, id, sqlite3_errmsg(s->db));
    sqlite3_blob_close(blob);
    sqlite3_finalize(st);
    return rc;
}

int store_file_content(store_t *s, const char *id, char **data, size_t *len)
{
    sqlite3_stmt *st = NULL;
    int rc = -1;
    *data = NULL;
    *len = 0;
    if (sqlite3_prepare_v2(s->db, "SELECT content FROM files WHERE id = ?1", -1, &st, NULL) !=
        SQLITE_OK)
        goto out;
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    int step = sqlite3_step(st);
    if (step == SQLITE_DONE) {
        rc = 1;
    } else if (step == SQLITE_ROW) {
        const void *blob = sqlite3_column_blob(st, 0);
        size_t n = (size_t)sqlite3_column_bytes(st, 0);
        char *d = malloc(n + 1);
        if (d) {
            if (n)
                memcpy(d, blob, n);
            d[n] = 0;
            *data = d;
            *len = n;
            rc = 0;
        }
    }
out:
    if (rc < 0)
        log_error("%s: cannot read file %s: %s", s->path, id, sqlite3_errmsg(s->db));
    sqlite3_finalize(st);
    return rc;
}

/* Run sql (one statement) with text parameters ?1 = a, ?2 = b and integer ?3 = c (those it
 * has); SQLITE_DONE or the error. */
static int exec_bound(store_t *s, const char *sql, const char *a, const char *b, int64_t c)
{
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(s->db, sql, -1, &st, NULL);
    if (rc == SQLITE_OK) {
        int n = sqlite3_bind_parameter_count(st);
        if (n >= 1)
            sqlite3_bind_text(st, 1, a, -1, SQLITE_STATIC);
        if (n >= 2)
            sqlite3_bind_text(st, 2, b, -1, SQLITE_STATIC);
        if (n >= 3)
            sqlite3_bind_int64(st, 3, c);
        rc = sqlite3_step(st);
    }
    sqlite3_finalize(st);
    return rc;
}

/* After a delete: the WAL still holds the frames that wrote the deleted content (and now
 * the zeroed pages): copy the zeros into the database file and empty the WAL. Only another
 * reader of the database (an operator's sqlite3) can hold it up, for the busy timeout; then
 * it is logged, the content is gone from the tables, and its old WAL frames go as the WAL
 * is reused. */
static void purge_wal(store_t *s, const char *what)
{
    int log_frames = 0, ckpt = 0;
    if (sqlite3_wal_checkpoint_v2(s->db, NULL, SQLITE_CHECKPOINT_TRUNCATE, &log_frames, &ckpt) !=
        SQLITE_OK)
        log_warn("%s: checkpoint after deleting %s failed: %s", s->path, what,
                 sqlite3_errmsg(s->db));
}

int store_file_delete(store_t *s, const char *id, const char *results_of, int ok)
{
    if (store_flush(s) < 0) /* nothing queued may write after the delete */
        return -1;
    if (sqlite3_exec(s->db, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK) {
        log_error("%s: cannot delete file %s: %s", s->path, id, sqlite3_errmsg(s->db));
        return -1;
    }
    int rc = exec_bound(s,
                        "INSERT INTO deleted_files(seq, id, created_at, owner) SELECT rowid, id, "
                        "created_at, owner FROM files WHERE id = ?1",
                        id, NULL, 0);
    int found = sqlite3_changes(s->db) > 0;
    if (rc == SQLITE_DONE && found)
        rc = exec_bound(s, "DELETE FROM files WHERE id = ?1", id, NULL, 0);
    if (rc == SQLITE_DONE && found && results_of)
        rc = exec_bound(s, "DELETE FROM results WHERE batch_id = ?1 AND ok = ?3",
                        results_of, NULL, ok);
    if (rc != SQLITE_DONE || sqlite3_exec(s->db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) {
        log_error("%s: cannot delete file %s: %s", s->path, id, sqlite3_errmsg(s->db));
        sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
        return -1;
    }
    if (!found)
        return 1;
    purge_wal(s, id);
    return 0;
}

int store_file_list(store_t *s, const store_file_query *q,
                    int (*fn)(const store_file *f, void *ud), void *ud, int *has_more)
{
    *has_more = 0;
    sqlite3_stmt *st = NULL;
    int rc = -1;
    int64_t at = 0, seq = 0;
    if (q->after) { /* the cursor's place: a file, or a deleted one */
        if (sqlite3_prepare_v2(s->db,
                               "SELECT created_at, rowid, owner FROM files WHERE id = ?1 UNION "
                               "ALL SELECT created_at, seq, owner FROM deleted_files WHERE id = ?1",
                               -1, &st, NULL) != SQLITE_OK)
            goto out;
        sqlite3_bind_text(st, 1, q->after, -1, SQLITE_STATIC);
        int step = sqlite3_step(st);
        if (step == SQLITE_ROW) {
            const char *owner = (const char *)sqlite3_column_text(st, 2);
            at = sqlite3_column_int64(st, 0);
            seq = sqlite3_column_int64(st, 1);
            if (q->owner && (!owner || strcmp(owner, q->owner) != 0))
                step = SQLITE_DONE; /* another key's: as if there were none */
        }
        if (step != SQLITE_ROW) {
            rc = step == SQLITE_DONE ? 1 : -1;
            goto out;
        }
        sqlite3_finalize(st);
        st = NULL;
    }
    const char *sql_desc =
        "SELECT id, purpose, filename, bytes, created_at, owner FROM files INDEXED BY files_list "
        "WHERE (?1 IS NULL OR purpose = ?1) AND (?2 IS NULL OR owner = ?2) AND (?3 = 0 OR "
        "(created_at, rowid) < (?4, ?5)) ORDER BY created_at DESC, rowid DESC LIMIT ?6";
    const char *sql_asc =
        "SELECT id, purpose, filename, bytes, created_at, owner FROM files INDEXED BY files_list "
        "WHERE (?1 IS NULL OR purpose = ?1) AND (?2 IS NULL OR owner = ?2) AND (?3 = 0 OR "
        "(created_at, rowid) > (?4, ?5)) ORDER BY created_at, rowid LIMIT ?6";
    if (sqlite3_prepare_v2(s->db, q->desc ? sql_desc : sql_asc, -1, &st, NULL) != SQLITE_OK)
        goto out;
    if (q->purpose)
        sqlite3_bind_text(st, 1, q->purpose, -1, SQLITE_STATIC);
    if (q->owner)
        sqlite3_bind_text(st, 2, q->owner, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 3, q->after != NULL);
    sqlite3_bind_int64(st, 4, at);
    sqlite3_bind_int64(st, 5, seq);
    sqlite3_bind_int64(st, 6, (int64_t)q->limit + 1); /* one more: has_more */
    int step, n = 0;
    while ((step = sqlite3_step(st)) == SQLITE_ROW) {
        if (n++ == q->limit) {
            *has_more = 1;
            break;
        }
        store_file f;
        file_row(st, &f);
        if (fn(&f, ud))
            break;
    }
    if (step == SQLITE_ROW || step == SQLITE_DONE)
        rc = 0;
out:
    if (rc < 0)
        log_error("%s: cannot list files: %s", s->path, sqlite3_errmsg(s->db));
    sqlite3_finalize(st);
    return rc;
}

// --- queued writes

static int push_op(store_t *s, op_kind kind, const char *batch_id, const char *owner, int line,
                   int ok, int64_t created_at, const char *json)
{
    if (s->n_ops >= STORE_MAX_PENDING && store_flush(s) < 0 && s->n_ops >= 4 * STORE_MAX_PENDING)
        return -1; /* the disk keeps failing: refuse rather than grow without bound */
    if (s->n_ops == s->cap_ops) {
        int cap = s->cap_ops ? s->cap_ops * 2 : 64;
        store_op *v = realloc(s->ops, (size_t)cap * sizeof(*v));
        if (!v)
            return -1;
        s->ops = v;
        s->cap_ops = cap;
    }
    store_op op = {.kind = kind, .line = line, .ok = ok, .created_at = created_at};
    op.batch_id = strdup(batch_id);
    op.json = strdup(json);
    op.owner = owner && owner[0] ? strdup(owner) : NULL;
    if (!op.batch_id || !op.json || (owner && owner[0] && !op.owner)) {
        op_free(&op);
        return -1;
    }
    s->ops[s->n_ops++] = op;
    return 0;
}

int store_batch_put(store_t *s, const char *id, const char *owner, const char *json)
{
    return push_op(s, OP_BATCH, id, owner, 0, 0, 0, json);
}

int store_result_put(store_t *s, const char *batch_id, int line, int ok, const char *json)
{
    return push_op(s, OP_RESULT, batch_id, NULL, line, ok, 0, json);
}

// --- responses

int store_response_put(store_t *s, const char *id, const char *owner, int64_t created_at,
                       const char *json)
{
    return push_op(s, OP_RESPONSE, id, owner, 0, 0, created_at, json);
}

int store_response_get(store_t *s, const char *id, char **json, char *owner, size_t owner_cap)
{
    *json = NULL;
    if (store_flush(s) < 0)
        return -1;
    sqlite3_stmt *st = NULL;
    int rc = -1;
    if (sqlite3_prepare_v2(s->db, "SELECT object, owner FROM responses WHERE id = ?1", -1, &st,
                           NULL) != SQLITE_OK)
        goto out;
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    int step = sqlite3_step(st);
    if (step == SQLITE_DONE) {
        rc = 1;
    } else if (step == SQLITE_ROW) {
        const char *o = (const char *)sqlite3_column_text(st, 1);
        snprintf(owner, owner_cap, "%s", o ? o : "");
        *json = strdup((const char *)sqlite3_column_text(st, 0));
        rc = *json ? 0 : -1;
    }
out:
    if (rc < 0)
        log_error("%s: cannot read response %s: %s", s->path, id, sqlite3_errmsg(s->db));
    sqlite3_finalize(st);
    return rc;
}

int store_response_delete(store_t *s, const char *id)
{
    if (store_flush(s) < 0)
        return -1;
    int rc = exec_bound(s, "DELETE FROM responses WHERE id = ?1", id, NULL, 0);
    if (rc != SQLITE_DONE) {
        log_error("%s: cannot delete response %s: %s", s->path, id, sqlite3_errmsg(s->db));
        return -1;
    }
    if (sqlite3_changes(s->db) == 0)
        return 1;
    purge_wal(s, id);
    return 0;
}

int store_n_pending(const store_t *s)
{
    return s->n_ops;
}

int store_flush(store_t *s)
{
    if (s->n_ops == 0)
        return 0;
    if (sqlite3_exec(s->db, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK) {
        log_error("%s: cannot begin a transaction: %s", s->path, sqlite3_errmsg(s->db));
        return -1;
    }
    for (int i = 0; i < s->n_ops; i++) {
        const store_op *op = &s->ops[i];
        sqlite3_stmt *st = op->kind == OP_RESULT     ? s->put_result
                           : op->kind == OP_RESPONSE ? s->put_response
                                                     : s->put_batch;
        sqlite3_reset(st);
        sqlite3_clear_bindings(st);
        sqlite3_bind_text(st, 1, op->batch_id, -1, SQLITE_STATIC);
        if (op->kind == OP_RESULT) {
            sqlite3_bind_int(st, 2, op->line);
            sqlite3_bind_int(st, 3, op->ok);
            sqlite3_bind_text(st, 4, op->json, -1, SQLITE_STATIC);
        } else if (op->kind == OP_RESPONSE) {
            if (op->owner)
                sqlite3_bind_text(st, 2, op->owner, -1, SQLITE_STATIC);
            sqlite3_bind_int64(st, 3, op->created_at);
            sqlite3_bind_text(st, 4, op->json, -1, SQLITE_STATIC);
        } else {
            sqlite3_bind_text(st, 2, op->json, -1, SQLITE_STATIC);
            if (op->owner)
                sqlite3_bind_text(st, 3, op->owner, -1, SQLITE_STATIC);
            else
                sqlite3_bind_null(st, 3);
        }
        int rc = sqlite3_step(st);
        sqlite3_reset(st);
        if (rc != SQLITE_DONE) {
            log_error("%s: write failed: %s", s->path, sqlite3_errmsg(s->db));
            sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
            return -1;
        }
    }
    if (sqlite3_exec(s->db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) {
        log_error("%s: commit failed: %s", s->path, sqlite3_errmsg(s->db));
        sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
        return -1;
    }
    for (int i = 0; i < s->n_ops; i++)
        op_free(&s->ops[i]);
    s->n_ops = 0;
    return 0;
}

// --- reads

int store_batch_foreach(store_t *s,
                        int (*fn)(const char *id, const char *json, const char *owner, void *ud),
                        void *ud)
{
    if (store_flush(s) < 0)
        return -1;
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(s->db, "SELECT id, object, owner FROM batches ORDER BY rowid", -1, &st,
                           NULL) != SQLITE_OK) {
        log_error("%s: %s", s->path, sqlite3_errmsg(s->db));
        return -1;
    }
    int step, rc = 0;
    while ((step = sqlite3_step(st)) == SQLITE_ROW) {
        const char *owner = (const char *)sqlite3_column_text(st, 2);
        if (fn((const char *)sqlite3_column_text(st, 0), (const char *)sqlite3_column_text(st, 1),
               owner ? owner : "", ud))
            break;
    }
    if (step != SQLITE_ROW && step != SQLITE_DONE) {
        log_error("%s: reading batches: %s", s->path, sqlite3_errmsg(s->db));
        rc = -1;
    }
    sqlite3_finalize(st);
    return rc;
}

int store_results_foreach(store_t *s, const char *batch_id, int ok,
                          int (*fn)(int line, int ok, const char *json, size_t len, void *ud),
                          void *ud)
{
    if (store_flush(s) < 0)
        return -1;
    sqlite3_stmt *st = NULL;
    const char *sql = ok < 0 ? "SELECT line, ok, body FROM results WHERE batch_id = ?1 ORDER BY "
                               "line"
                             : "SELECT line, ok, body FROM results WHERE batch_id = ?1 AND ok = "
                               "?2 ORDER BY line";
    if (sqlite3_prepare_v2(s->db, sql, -1, &st, NULL) != SQLITE_OK) {
        log_error("%s: %s", s->path, sqlite3_errmsg(s->db));
        return -1;
    }
    sqlite3_bind_text(st, 1, batch_id, -1, SQLITE_STATIC);
    if (ok >= 0)
        sqlite3_bind_int(st, 2, ok);
    int step, rc = 0;
    while ((step = sqlite3_step(st)) == SQLITE_ROW) {
        const char *body = (const char *)sqlite3_column_text(st, 2);
        size_t n = (size_t)sqlite3_column_bytes(st, 2);
        if (fn(sqlite3_column_int(st, 0), sqlite3_column_int(st, 1), body ? body : "", n, ud))
            break;
    }
    if (step != SQLITE_ROW && step != SQLITE_DONE) {
        log_error("%s: reading results: %s", s->path, sqlite3_errmsg(s->db));
        rc = -1;
    }
    sqlite3_finalize(st);
    return rc;
}
