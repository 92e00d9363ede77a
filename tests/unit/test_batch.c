/*
 * test_batch: the Batch API's multipart/form-data parser (gateway/multipart.c) and its SQLite
 * store (gateway/store.c).
 *
 * The parser is driven by a table of bodies (well-formed, and every malformed shape it must
 * refuse without reading past the end); each malformed body is also parsed from an exact-size
 * heap copy so that AddressSanitizer catches any over-read. The store tests use a database
 * in a temporary directory: files round-trip, queued writes are invisible until flushed and
 * survive a close and reopen, results come back by line and filtered by ok; files list in
 * order, by owner and purpose, with cursors, and a deleted file's bytes leave the database.
 *
 *   build/tests/test_batch [case-name-filter]
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "multipart.h"
#include "store.h"

#define CT "multipart/form-data; boundary=XyZ"

/* Parse from an exact-size heap copy (ASan sees any read past the end). */
static int parse(const char *ct, const char *body, size_t len, multipart_part *parts, int max,
                 char *err, size_t errlen)
{
    char *copy = malloc(len ? len : 1);
    assert_non_null(copy);
    memcpy(copy, body, len);
    int n = multipart_parse(ct, copy, len, parts, max, err, errlen);
    /* parts point into copy: turn them into offsets into body for the caller */
    for (int i = 0; i < n; i++)
        parts[i].data = body + (parts[i].data - copy);
    free(copy);
    return n;
}

static void test_multipart_ok(void **state)
{
    (void)state;
    const char *body =
        "--XyZ\r\n"
        "Content-Disposition: form-data; name=\"purpose\"\r\n"
        "\r\n"
        "batch\r\n"
        "--XyZ\r\n"
        "content-disposition: form-data; name=\"file\"; filename=\"in \\\"1\\\".jsonl\"\r\n"
        "Content-Type: application/jsonl\r\n"
        "\r\n"
        "{\"a\":1}\r\n{\"b\":2}\n\r\n"
        "--XyZ--\r\n";
    multipart_part parts[4];
    char err[128];
    int n = parse(CT, body, strlen(body), parts, 4, err, sizeof(err));
    assert_int_equal(n, 2);
    assert_string_equal(parts[0].name, "purpose");
    assert_string_equal(parts[0].filename, "");
    assert_int_equal(parts[0].len, 5);
    assert_memory_equal(parts[0].data, "batch", 5);
    assert_string_equal(parts[1].name, "file");
    assert_string_equal(parts[1].filename, "in \"1\".jsonl");
    assert_int_equal(parts[1].len, strlen("{\"a\":1}\r\n{\"b\":2}\n"));
    assert_memory_equal(parts[1].data, "{\"a\":1}\r\n{\"b\":2}\n", parts[1].len);
}

static void test_multipart_variants(void **state)
{
    (void)state;
    multipart_part parts[4];
    char err[128];
    /* quoted boundary, other parameters, preamble, padding after a delimiter, unquoted
     * name, empty part, boundary text inside the data (not after CRLF), epilogue */
    const char *ct = "Multipart/Form-Data; charset=utf-8; boundary=\"a b\"";
    const char *body = "preamble text\r\n"
                       "--a b  \r\n"
                       "Content-Disposition: form-data; name=empty\r\n"
                       "\r\n"
                       "\r\n"
                       "--a b\r\n"
                       "Content-Disposition: form-data; name=\"file\"; filename=x\r\n"
                       "\r\n"
                       "line --a b not a delimiter\r\n"
                       "--a b--\r\nepilogue";
    int n = parse(ct, body, strlen(body), parts, 4, err, sizeof(err));
    assert_int_equal(n, 2);
    assert_string_equal(parts[0].name, "empty");
    assert_int_equal(parts[0].len, 0);
    assert_string_equal(parts[1].filename, "x");
    assert_int_equal(parts[1].len, strlen("line --a b not a delimiter"));
}

typedef struct {
    const char *name;
    const char *ct;
    const char *body;
} bad_case;

static const bad_case bad_cases[] = {
    {"not multipart", "application/json", "--XyZ\r\n"},
    {"no content type", NULL, "--XyZ\r\n"},
    {"no boundary", "multipart/form-data", "--XyZ\r\n"},
    {"empty boundary", "multipart/form-data; boundary=", "--\r\n"},
    {"boundary too long",
     "multipart/form-data; boundary="
     "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
     "--a\r\n"},
    {"unterminated quoted boundary", "multipart/form-data; boundary=\"XyZ", "--XyZ\r\n"},
    {"empty body", CT, ""},
    {"no opening boundary", CT, "hello world"},
    {"truncated after boundary", CT, "--XyZ"},
    {"truncated in headers", CT, "--XyZ\r\nContent-Disposition: form-data; name=\"a\""},
    {"no blank line", CT, "--XyZ\r\nContent-Disposition: form-data; name=\"a\"\r\n"},
    {"no closing boundary", CT,
     "--XyZ\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\ndata without end"},
    {"closing boundary without CRLF", CT,
     "--XyZ\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\ndata--XyZ--"},
    {"no disposition", CT, "--XyZ\r\nContent-Type: text/plain\r\n\r\nx\r\n--XyZ--\r\n"},
    {"no name", CT, "--XyZ\r\nContent-Disposition: form-data; filename=\"f\"\r\n\r\nx\r\n--XyZ--"},
    {"not form-data", CT,
     "--XyZ\r\nContent-Disposition: attachment; name=\"a\"\r\n\r\nx\r\n--XyZ--"},
    {"unterminated name", CT,
     "--XyZ\r\nContent-Disposition: form-data; name=\"a\r\n\r\nx\r\n--XyZ--"},
    {"header without colon", CT, "--XyZ\r\nbogus header\r\n\r\nx\r\n--XyZ--"},
    {"garbage after boundary", CT,
     "--XyZjunk\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nx\r\n--XyZ--"},
    {"name too long", CT,
     "--XyZ\r\nContent-Disposition: form-data; name=\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
     "aaaaaaaaaaaaaaaaaaaaaaaaa\"\r\n\r\nx\r\n--XyZ--"},
};

static void test_multipart_bad(void **state)
{
    (void)state;
    multipart_part parts[4];
    char err[128];
    for (size_t i = 0; i < sizeof(bad_cases) / sizeof(bad_cases[0]); i++) {
        const bad_case *c = &bad_cases[i];
        err[0] = 0;
        int n = parse(c->ct, c->body, strlen(c->body), parts, 4, err, sizeof(err));
        if (n != -1)
            fail_msg("case '%s': parsed %d parts, want an error", c->name, n);
        if (!err[0])
            fail_msg("case '%s': no reason given", c->name);
    }
    /* every prefix of a good body is refused (or parses fewer parts), never over-read */
    const char *good = "--XyZ\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch"
                       "\r\n--XyZ--\r\n";
    size_t len = strlen(good);
    for (size_t k = 0; k < len; k++) {
        int n = parse(CT, good, k, parts, 4, err, sizeof(err));
        if (k < len - 2)
            assert_int_equal(n, -1);
    }
}

static void test_multipart_too_many_parts(void **state)
{
    (void)state;
    char body[4096];
    size_t n = 0;
    for (int i = 0; i < 5; i++)
        n += (size_t)snprintf(body + n, sizeof(body) - n,
                              "--XyZ\r\nContent-Disposition: form-data; name=\"p%d\"\r\n\r\nv\r\n",
                              i);
    n += (size_t)snprintf(body + n, sizeof(body) - n, "--XyZ--\r\n");
    multipart_part parts[4];
    char err[128];
    assert_int_equal(parse(CT, body, n, parts, 4, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "parts"));
    multipart_part more[8];
    assert_int_equal(parse(CT, body, n, more, 8, err, sizeof(err)), 5);
    assert_string_equal(more[4].name, "p4");
}

// --- store

static char tmpdir[256];
static char dbpath[320];

static int setup_db(void **state)
{
    (void)state;
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/tidepool-test-batch-XXXXXX");
    if (!mkdtemp(tmpdir))
        return -1;
    snprintf(dbpath, sizeof(dbpath), "%s/sub/dir/state.db", tmpdir);
    return 0;
}

static int teardown_db(void **state)
{
    (void)state;
    char cmd[400];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

static int count_batches(const char *id, const char *json, const char *owner, void *ud)
{
    (void)id;
    (void)json;
    (void)owner;
    (*(int *)ud)++;
    return 0;
}

typedef struct {
    int lines[8];
    int oks[8];
    char text[8][64];
    int n;
} results;

static int collect(int line, int ok, const char *json, size_t len, void *ud)
{
    results *r = ud;
    if (r->n < 8) {
        r->lines[r->n] = line;
        r->oks[r->n] = ok;
        snprintf(r->text[r->n], sizeof(r->text[0]), "%.*s", (int)len, json);
        r->n++;
    }
    return 0;
}

static void test_store_files(void **state)
{
    (void)state;
    char err[256];
    store_t *s = store_open(dbpath, err, sizeof(err));
    assert_non_null(s);
    store_file f = {.id = "file-1", .purpose = "batch", .filename = "a.jsonl", .created_at = 5};
    const char data[] = "{\"x\":1}\n\0binary";
    assert_int_equal(store_file_put(s, &f, data, sizeof(data)), 0);
    assert_int_equal(store_file_put(s, &f, data, 3), -1); /* the id exists */
    store_file g;
    assert_int_equal(store_file_get(s, "file-1", &g), 0);
    assert_string_equal(g.purpose, "batch");
    assert_string_equal(g.filename, "a.jsonl");
    assert_int_equal(g.bytes, sizeof(data));
    assert_int_equal(g.created_at, 5);
    assert_string_equal(g.owner, ""); /* none */
    store_file o = {.id = "file-o", .purpose = "batch", .filename = "o.jsonl", .owner = "0a1b2c"};
    assert_int_equal(store_file_put(s, &o, "x", 1), 0);
    assert_int_equal(store_file_get(s, "file-o", &g), 0);
    assert_string_equal(g.owner, "0a1b2c");
    assert_int_equal(store_file_get(s, "file-2", &g), 1);
    char *content;
    size_t len;
    assert_int_equal(store_file_content(s, "file-1", &content, &len), 0);
    assert_int_equal(len, sizeof(data));
    assert_memory_equal(content, data, len);
    assert_int_equal(content[len], 0);
    free(content);
    assert_int_equal(store_file_content(s, "nope", &content, &len), 1);
    assert_null(content);
    store_close(&s);
    assert_null(s);
    store_close(&s); /* NULL is fine */
}

/* Rows of batch_id in results, read with a connection of our own. */
static int count_rows(const char *path, const char *batch_id)
{
    sqlite3 *db = NULL;
    sqlite3_stmt *st = NULL;
    int n = -1;
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL) == SQLITE_OK &&
        sqlite3_prepare_v2(db, "SELECT count(*) FROM results WHERE batch_id = ?1", -1, &st,
                           NULL) == SQLITE_OK &&
        sqlite3_bind_text(st, 1, batch_id, -1, SQLITE_STATIC) == SQLITE_OK &&
        sqlite3_step(st) == SQLITE_ROW)
        n = sqlite3_column_int(st, 0);
    sqlite3_finalize(st);
    sqlite3_close(db);
    return n;
}

static void test_store_queue_and_reopen(void **state)
{
    (void)state;
    char err[256];
    store_t *s = store_open(dbpath, err, sizeof(err));
    assert_non_null(s);
    assert_int_equal(store_batch_put(s, "batch_a", "0a1b2c", "{\"status\":\"in_progress\"}"), 0);
    assert_int_equal(store_result_put(s, "batch_a", 2, 1, "{\"line\":3}"), 0);
    assert_int_equal(store_result_put(s, "batch_a", 0, 0, "{\"line\":1}"), 0);
    assert_int_equal(store_result_put(s, "batch_b", 0, 1, "{\"other\":1}"), 0);
    assert_int_equal(store_n_pending(s), 4);
    /* one owner: a second store on the database is refused, naming this process */
    char want[64];
    snprintf(want, sizeof(want), "in use by another gateway (pid %ld)", (long)getpid());
    assert_null(store_open(dbpath, err, sizeof(err)));
    assert_non_null(strstr(err, want));
    /* a reader (plain SQLite) sees nothing before the flush (nothing is written yet) */
    assert_int_equal(count_rows(dbpath, "batch_a"), 0);
    assert_int_equal(store_flush(s), 0);
    assert_int_equal(store_n_pending(s), 0);
    assert_int_equal(count_rows(dbpath, "batch_a"), 2);
    results r = {0};
    /* a later put of the same batch replaces the object, keeps its place */
    assert_int_equal(store_batch_put(s, "batch_z", NULL, "{}"), 0);
    /* the owner is the one of the insert: a replace keeps it */
    assert_int_equal(store_batch_put(s, "batch_a", NULL, "{\"status\":\"completed\"}"), 0);
    store_close(&s); /* flushes */

    s = store_open(dbpath, err, sizeof(err));
    assert_non_null(s);
    int n = 0;
    assert_int_equal(store_batch_foreach(s, count_batches, &n), 0);
    assert_int_equal(n, 2);
    memset(&r, 0, sizeof(r));
    assert_int_equal(store_results_foreach(s, "batch_a", -1, collect, &r), 0);
    assert_int_equal(r.n, 2);
    assert_int_equal(r.lines[0], 0); /* by line */
    assert_int_equal(r.oks[0], 0);
    assert_string_equal(r.text[1], "{\"line\":3}");
    memset(&r, 0, sizeof(r));
    assert_int_equal(store_results_foreach(s, "batch_a", 1, collect, &r), 0);
    assert_int_equal(r.n, 1);
    assert_int_equal(r.lines[0], 2);
    store_close(&s);
}

static int first_batch(const char *id, const char *json, const char *owner, void *ud)
{
    snprintf(ud, 64, "%s=%s owner=%s", id, json, owner);
    return 1; /* stop */
}

static void test_store_order_and_errors(void **state)
{
    (void)state;
    char err[256];
    store_t *s = store_open(dbpath, err, sizeof(err));
    assert_non_null(s);
    char first[64] = "";
    assert_int_equal(store_batch_foreach(s, first_batch, first), 0);
    assert_string_equal(first, "batch_a={\"status\":\"completed\"} owner=0a1b2c");
    store_close(&s);
    /* not a database, and a path that cannot be created: errors that name the file */
    char bad[400];
    snprintf(bad, sizeof(bad), "%s/notadb", tmpdir);
    FILE *f = fopen(bad, "w");
    assert_non_null(f);
    fputs("this is not an SQLite database, but it is long enough to be read as one....", f);
    fclose(f);
    assert_null(store_open(bad, err, sizeof(err)));
    assert_non_null(strstr(err, "notadb"));
    assert_null(store_open("/proc/no/such/dir/x.db", err, sizeof(err)));
    assert_non_null(strstr(err, "/proc/no"));
}

/* A schema version 1 database (before API keys) is migrated when opened: its rows are
 * kept, without an owner, and the owner columns work from then on. */
static void test_store_migrate_v1(void **state)
{
    (void)state;
    char path[400], err[256];
    snprintf(path, sizeof(path), "%s/v1.db", tmpdir);
    sqlite3 *db = NULL;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    assert_int_equal(
        sqlite3_exec(db,
                     "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);"
                     "CREATE TABLE files(id TEXT PRIMARY KEY, purpose TEXT NOT NULL,"
                     " filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT "
                     "NULL, content BLOB NOT NULL);"
                     "CREATE TABLE batches(id TEXT PRIMARY KEY, object TEXT NOT NULL);"
                     "CREATE TABLE results(batch_id TEXT NOT NULL, line INTEGER NOT NULL,"
                     " ok INTEGER NOT NULL, body TEXT NOT NULL, PRIMARY KEY(batch_id, line));"
                     "INSERT INTO meta VALUES('schema_version', '1');"
                     "INSERT INTO files VALUES('file-old', 'batch', 'old.jsonl', 2, 7, 'ab');"
                     "INSERT INTO batches VALUES('batch_old', '{}');",
                     NULL, NULL, NULL),
        SQLITE_OK);
    sqlite3_close(db);
    store_t *s = store_open(path, err, sizeof(err));
    assert_non_null(s);
    store_file g;
    assert_int_equal(store_file_get(s, "file-old", &g), 0);
    assert_string_equal(g.filename, "old.jsonl");
    assert_string_equal(g.owner, "");
    char first[64] = "";
    assert_int_equal(store_batch_foreach(s, first_batch, first), 0);
    assert_string_equal(first, "batch_old={} owner=");
    store_file o = {.id = "file-new", .purpose = "batch", .filename = "n.jsonl", .owner = "ffee"};
    assert_int_equal(store_file_put(s, &o, "x", 1), 0);
    store_close(&s);
    s = store_open(path, err, sizeof(err)); /* version 2 now: opened as it is */
    assert_non_null(s);
    assert_int_equal(store_file_get(s, "file-new", &g), 0);
    assert_string_equal(g.owner, "ffee");
    store_close(&s);
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    sqlite3_stmt *st = NULL;
    assert_int_equal(sqlite3_prepare_v2(db, "SELECT value FROM meta WHERE key = 'schema_version'",
                                        -1, &st, NULL),
                     SQLITE_OK);
    assert_int_equal(sqlite3_step(st), SQLITE_ROW);
    assert_string_equal((const char *)sqlite3_column_text(st, 0), "2");
    sqlite3_finalize(st);
    sqlite3_close(db);
}

// --- list and delete

typedef struct {
    char ids[8][64];
    int n;
} id_list;

static int add_id(const store_file *f, void *ud)
{
    id_list *l = ud;
    if (l->n < 8)
        snprintf(l->ids[l->n++], sizeof(l->ids[0]), "%s", f->id);
    return 0;
}

/* The ids q lists, joined by spaces, then "+" when has_more; "#1" / "#-1" for 1 / -1. */
static const char *list_str(store_t *s, store_file_query q, char *out, size_t cap)
{
    id_list l = {0};
    int more = -1;
    int rc = store_file_list(s, &q, add_id, &l, &more);
    if (rc != 0) {
        snprintf(out, cap, "#%d", rc);
        return out;
    }
    size_t n = 0;
    out[0] = 0;
    for (int i = 0; i < l.n; i++)
        n += (size_t)snprintf(out + n, cap - n, "%s%s", i ? " " : "", l.ids[i]);
    snprintf(out + n, cap - n, "%s", more ? "+" : "");
    return out;
}

/* Does the file at path hold needle (a missing file holds nothing)? */
static int file_holds(const char *path, const char *needle)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return 0;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    size_t got = fread(buf, 1, (size_t)n, f);
    fclose(f);
    int found = got > 0 && memmem(buf, got, needle, strlen(needle)) != NULL;
    free(buf);
    return found;
}

/* Files listed newest (or oldest) first by created_at then creation order, filtered by
 * purpose and owner, paged by a cursor that may be a deleted file; a delete removes the row,
 * its results of one kind, and its bytes from the database file and the WAL; after a
 * reopen the file stays deleted and its cursor still works. */
static void test_store_list_delete(void **state)
{
    (void)state;
    char path[400], wal[420], err[256], got[200];
    snprintf(path, sizeof(path), "%s/list.db", tmpdir);
    snprintf(wal, sizeof(wal), "%s-wal", path);
    store_t *s = store_open(path, err, sizeof(err));
    assert_non_null(s);
    store_file a = {.id = "a", .purpose = "batch", .filename = "a", .created_at = 10};
    store_file b = {.id = "b", .purpose = "batch", .filename = "b", .created_at = 10};
    store_file c = {.id = "c", .purpose = "batch", .filename = "c", .created_at = 11,
                    .owner = "o1"};
    store_file d = {.id = "d", .purpose = "batch_output", .filename = "d", .created_at = 9};
    /* b's content: 64 KiB (overflow pages) holding a marker */
    size_t big_n = 64 * 1024;
    char *big = malloc(big_n);
    assert_non_null(big);
    for (size_t i = 0; i < big_n; i++)
        big[i] = (char)('a' + i % 23);
    memcpy(big + 30000, "SECRET-MARKER-7f3e", 18);
    assert_int_equal(store_file_put(s, &a, "x", 1), 0);
    assert_int_equal(store_file_put(s, &b, big, big_n), 0);
    assert_int_equal(store_file_put(s, &c, "x", 1), 0);
    assert_int_equal(store_file_put(s, &d, "x", 1), 0);
    free(big);
    store_file_query q = {.desc = 1, .limit = 100};
    assert_string_equal(list_str(s, q, got, sizeof(got)), "c b a d");
    q.desc = 0;
    assert_string_equal(list_str(s, q, got, sizeof(got)), "d a b c");
    q = (store_file_query){.desc = 1, .limit = 2};
    assert_string_equal(list_str(s, q, got, sizeof(got)), "c b+");
    q.after = "b";
    assert_string_equal(list_str(s, q, got, sizeof(got)), "a d");
    q.limit = 1;
    assert_string_equal(list_str(s, q, got, sizeof(got)), "a+");
    q = (store_file_query){.desc = 1, .limit = 100, .owner = "o1"};
    assert_string_equal(list_str(s, q, got, sizeof(got)), "c");
    q.after = "a"; /* no owner: not o1's cursor */
    assert_string_equal(list_str(s, q, got, sizeof(got)), "#1");
    q = (store_file_query){.desc = 1, .limit = 100, .purpose = "batch_output"};
    assert_string_equal(list_str(s, q, got, sizeof(got)), "d");
    q = (store_file_query){.desc = 1, .limit = 100, .after = "nope"};
    assert_string_equal(list_str(s, q, got, sizeof(got)), "#1");

    /* b was batch_x's output file: its ok results go with it, the error ones stay */
    assert_int_equal(store_result_put(s, "batch_x", 0, 1, "{\"SECRET-MARKER-7f3e\":1}"), 0);
    assert_int_equal(store_result_put(s, "batch_x", 1, 0, "{\"e\":1}"), 0);
    assert_int_equal(store_flush(s), 0);
    assert_true(file_holds(path, "SECRET-MARKER-7f3e") || file_holds(wal, "SECRET-MARKER-7f3e"));
    assert_int_equal(store_file_delete(s, "b", "batch_x", 1), 0);
    assert_int_equal(store_file_delete(s, "b", "batch_x", 1), 1); /* gone */
    assert_int_equal(store_file_delete(s, "nope", NULL, 0), 1);
    store_file g;
    assert_int_equal(store_file_get(s, "b", &g), 1);
    char *content;
    size_t len;
    assert_int_equal(store_file_content(s, "b", &content, &len), 1);
    assert_int_equal(count_rows(path, "batch_x"), 1);
    assert_false(file_holds(path, "SECRET-MARKER-7f3e"));
    assert_false(file_holds(wal, "SECRET-MARKER-7f3e"));
    /* the deleted file's place: a cursor still; a new file at the same second comes after */
    store_file e = {.id = "e", .purpose = "batch", .filename = "e", .created_at = 10};
    assert_int_equal(store_file_put(s, &e, "x", 1), 0);
    q = (store_file_query){.desc = 1, .limit = 100, .after = "b"};
    assert_string_equal(list_str(s, q, got, sizeof(got)), "a d");
    q.desc = 0;
    assert_string_equal(list_str(s, q, got, sizeof(got)), "e c");
    store_close(&s);

    s = store_open(path, err, sizeof(err)); /* deleted for good */
    assert_non_null(s);
    assert_int_equal(store_file_get(s, "b", &g), 1);
    q = (store_file_query){.desc = 1, .limit = 100};
    assert_string_equal(list_str(s, q, got, sizeof(got)), "c e a d");
    q.after = "b";
    assert_string_equal(list_str(s, q, got, sizeof(got)), "a d");
    store_close(&s);
}

/* Stored responses: a put is queued and a get sees it (it flushes first), with its owner;
 * a delete removes it (1 after); it survives a reopen. */
static void test_store_responses(void **state)
{
    (void)state;
    char path[400], err[256], owner[32];
    snprintf(path, sizeof(path), "%s/resp.db", tmpdir);
    store_t *s = store_open(path, err, sizeof(err));
    assert_non_null(s);
    assert_int_equal(store_response_put(s, "resp_a", "k1", 7, "{\"id\":\"resp_a\"}"), 0);
    assert_int_equal(store_response_put(s, "resp_b", NULL, 8, "{\"id\":\"resp_b\"}"), 0);
    assert_int_equal(store_n_pending(s), 2);
    char *json;
    assert_int_equal(store_response_get(s, "resp_a", &json, owner, sizeof(owner)), 0);
    assert_int_equal(store_n_pending(s), 0);
    assert_string_equal(json, "{\"id\":\"resp_a\"}");
    assert_string_equal(owner, "k1");
    free(json);
    assert_int_equal(store_response_get(s, "resp_b", &json, owner, sizeof(owner)), 0);
    assert_string_equal(owner, "");
    free(json);
    assert_int_equal(store_response_get(s, "resp_x", &json, owner, sizeof(owner)), 1);
    assert_null(json);
    assert_int_equal(store_response_delete(s, "resp_a"), 0);
    assert_int_equal(store_response_delete(s, "resp_a"), 1);
    assert_int_equal(store_response_get(s, "resp_a", &json, owner, sizeof(owner)), 1);
    store_close(&s);
    s = store_open(path, err, sizeof(err));
    assert_non_null(s);
    assert_int_equal(store_response_get(s, "resp_b", &json, owner, sizeof(owner)), 0);
    assert_string_equal(json, "{\"id\":\"resp_b\"}");
    free(json);
    assert_int_equal(store_response_get(s, "resp_a", &json, owner, sizeof(owner)), 1);
    store_close(&s);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_multipart_ok),
        cmocka_unit_test(test_multipart_variants),
        cmocka_unit_test(test_multipart_bad),
        cmocka_unit_test(test_multipart_too_many_parts),
        cmocka_unit_test(test_store_files),
        cmocka_unit_test(test_store_queue_and_reopen),
        cmocka_unit_test(test_store_order_and_errors),
        cmocka_unit_test(test_store_migrate_v1),
        cmocka_unit_test(test_store_list_delete),
        cmocka_unit_test(test_store_responses),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("batch", tests, setup_db, teardown_db);
}
