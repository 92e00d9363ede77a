/* batch: see batch.h. This file holds the module's life and the job runner; batch_lines.c
 * parses, runs and records the input lines, batch_http.c answers /v1/files and
 * /v1/batches (batch_internal.h: what they share).
 *
 * Every batch is a job_t holding its OpenAI batch object (json_t, the persisted form) and,
 * while it is not in a final state, its run state: the input file in memory, each line's
 * offset, length and state (pending, running, done) and the lines running now (line_t,
 * the sink of one completion, freed in exactly one place: its release in batch_lines.c). A
 * done line has its result queued in the store; the batch object (status, counts) is
 * re-queued whenever it changed, and one store_flush per tick writes both in a transaction.
 *
 * Work happens on one deferred event ("kick", after callbacks) and a 100 ms timer: validate
 * a slice of lines, submit pending lines up to max_inflight, finalize batches whose lines
 * are all done (output and error files from the stored results), then flush. Cluster
 * callbacks never call back into the cluster; they only record and kick. */
#include "batch.h"

#include <event2/event.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "batch_internal.h"
#include "log.h"
#include "store.h"

#define TICK_MS 100
#define VALIDATE_SLICE 2000 /* lines checked per tick */
#define ID_HEX 24

const char *const batch_status_names[] = {"validating", "failed",  "in_progress", "finalizing",
                                          "completed",  "expired", "cancelling",  "cancelled"};

batch_params batch_default_params(void)
{
    batch_params p = {
        .state_db = "build/state/gateway.db",
        .max_file_bytes = 100u << 20,
        .max_lines = 50000,
        .max_inflight = 256,
        .max_body_bytes = 1u << 20,
        .model_name = "tidepool",
        .n_ctx = 0,
        .tok = NULL,
    };
    return p;
}

// --- small helpers

void batch_make_id(char *out, size_t cap, const char *prefix)
{
    unsigned char r[ID_HEX / 2];
    if (getrandom(r, sizeof(r), 0) != (ssize_t)sizeof(r)) {
        uint64_t t = (uint64_t)proto_wall_us() ^ (uint64_t)(uintptr_t)out;
        for (size_t i = 0; i < sizeof(r); i++)
            r[i] = (unsigned char)(t >> (8 * (i % 8))) ^ (unsigned char)(i * 37);
    }
    size_t n = (size_t)snprintf(out, cap, "%s", prefix);
    for (size_t i = 0; i < sizeof(r) && n + 2 < cap; i++, n += 2)
        snprintf(out + n, cap - n, "%02x", r[i]);
}

static status_t status_parse(const char *s)
{
    for (int i = 0; i < (int)(sizeof(batch_status_names) / sizeof(batch_status_names[0])); i++)
        if (s && strcmp(s, batch_status_names[i]) == 0)
            return (status_t)i;
    return ST_FAILED;
}

// --- jobs

static void job_free_run(batch_t *b, job_t *j)
{
    if (j->content)
        b->loaded_bytes -= j->content_len;
    free(j->content);
    free(j->off);
    free(j->len);
    free(j->line_no);
    free(j->state);
    json_decref(j->seen_ids);
    j->content = NULL;
    j->off = j->len = NULL;
    j->line_no = NULL;
    j->state = NULL;
    j->seen_ids = NULL;
    j->active = 0;
}

static void job_set(job_t *j, const char *key, json_t *v)
{
    json_object_set_new(j->obj, key, v);
    j->dirty = 1;
}

void batch_job_status(batch_t *b, job_t *j, status_t st, const char *ts_key)
{
    j->status = st;
    job_set(j, "status", json_string(batch_status_names[st]));
    if (ts_key)
        job_set(j, ts_key, json_integer(now_s()));
    log_info("batch %s: %s (%d of %d lines done: %d completed, %d failed)", j->id,
             batch_status_names[st], j->n_done, j->n_lines, j->completed, j->failed);
    kick(b);
}

static void job_counts(job_t *j)
{
    job_set(j, "request_counts",
            json_pack("{s:i, s:i, s:i}", "total", j->n_lines, "completed", j->completed, "failed",
                      j->failed));
}

int batch_job_add(batch_t *b, job_t *j)
{
    if (b->n_jobs == b->cap_jobs) {
        int cap = b->cap_jobs ? b->cap_jobs * 2 : 16;
        job_t **v = realloc(b->jobs, (size_t)cap * sizeof(*v));
        if (!v)
            return -1;
        b->jobs = v;
        b->cap_jobs = cap;
    }
    b->jobs[b->n_jobs++] = j;
    return 0;
}

int batch_job_split_lines(job_t *j)
{
    int n = 0, cap = 0, no = 0;
    size_t pos = 0;
    /* a UTF-8 byte order mark (PowerShell 5 writes one) is no part of the first line (RFC
     * 8259 8.1: a parser may ignore it) */
    if (j->content_len >= 3 && memcmp(j->content, "\xEF\xBB\xBF", 3) == 0)
        pos = 3;
    while (pos < j->content_len) {
        no++;
        const char *s = j->content + pos;
        const char *nl = memchr(s, '\n', j->content_len - pos);
        size_t l = nl ? (size_t)(nl - s) : j->content_len - pos;
        size_t next = pos + l + (nl ? 1 : 0);
        while (l > 0 && (s[l - 1] == '\r' || s[l - 1] == ' ' || s[l - 1] == '\t'))
            l--;
        size_t lead = 0;
        while (lead < l && (s[lead] == ' ' || s[lead] == '\t'))
            lead++;
        if (l > lead) {
            if (n == cap) {
                cap = cap ? cap * 2 : 64;
                size_t *o = realloc(j->off, (size_t)cap * sizeof(size_t));
                if (!o)
                    return -1;
                j->off = o;
                size_t *ln = realloc(j->len, (size_t)cap * sizeof(size_t));
                if (!ln)
                    return -1;
                j->len = ln;
                int *lno = realloc(j->line_no, (size_t)cap * sizeof(int));
                if (!lno)
                    return -1;
                j->line_no = lno;
            }
            j->off[n] = pos + lead;
            j->len[n] = l - lead;
            j->line_no[n] = no;
            n++;
        }
        pos = next;
    }
    j->n_lines = n;
    j->state = calloc((size_t)(n > 0 ? n : 1), 1);
    return j->state ? 0 : -1;
}

void batch_job_line_done(job_t *j, int line, int ok)
{
    if (line < 0 || line >= j->n_lines || j->state[line] == LINE_DONE)
        return;
    j->state[line] = LINE_DONE;
    j->n_done++;
    if (ok)
        j->completed++;
    else
        j->failed++;
}

/* store_results_foreach callback: a result stored before (a restart) marks its line done. */
static int mark_done(int line, int ok, const char *json, size_t len, void *ud)
{
    (void)json;
    (void)len;
    batch_job_line_done(ud, line, ok);
    return 0;
}

/* Load the input file and the results stored so far. 0, or -1 (the batch is failed). */
int batch_job_load(batch_t *b, job_t *j)
{
    const char *fid = json_string_value(json_object_get(j->obj, "input_file_id"));
    char *data = NULL;
    size_t len = 0;
    int rc = fid ? store_file_content(b->store, fid, &data, &len) : 1;
    if (rc != 0) {
        log_error("batch %s: input file %s %s", j->id, fid ? fid : "?",
                  rc > 0 ? "is gone" : "cannot be read");
        if (rc > 0) {
            job_set(j, "errors",
                    json_pack("{s:s, s:[{s:s, s:s, s:n, s:n}]}", "object", "list", "data", "code",
                              "file_not_found", "message", "the input file is gone", "param",
                              "line"));
            batch_job_status(b, j, ST_FAILED, "failed_at");
        }
        return -1;
    }
    j->content = data;
    j->content_len = len;
    b->loaded_bytes += len;
    j->next_line = 0;
    j->n_done = j->completed = j->failed = 0;
    if (batch_job_split_lines(j) < 0 || store_results_foreach(b->store, j->id, -1, mark_done, j) < 0) {
        job_free_run(b, j);
        return -1;
    }
    j->active = 1;
    return 0;
}

// --- phases

/* Check a slice of lines: structure and unique custom_ids; bad lines get their error. */
static void validate_slice(batch_t *b, job_t *j)
{
    if (!j->seen_ids && !(j->seen_ids = json_object()))
        return;
    int end = j->validated + VALIDATE_SLICE;
    if (end > j->n_lines)
        end = j->n_lines;
    for (int i = j->validated; i < end; i++) {
        const char *cid, *code = NULL;
        json_t *body;
        char msg[300];
        json_t *root = batch_line_parse(j, i, &cid, &body, &code, msg, sizeof(msg));
        int dup = body && json_object_get(j->seen_ids, cid);
        if (body && !dup)
            json_object_set_new(j->seen_ids, cid, json_true());
        if (j->state[i] != LINE_DONE) {
            if (dup)
                batch_line_error(b, j, i, cid, "duplicate_custom_id",
                                 "this custom_id is used by an earlier line of the file");
            else if (!body)
                batch_line_error(b, j, i, cid, code, msg);
        }
        json_decref(root);
    }
    j->validated = end;
    if (j->validated >= j->n_lines) {
        json_decref(j->seen_ids);
        j->seen_ids = NULL;
        job_counts(j);
        batch_job_status(b, j, ST_IN_PROGRESS, "in_progress_at");
    }
}

typedef struct {
    char *p;
    size_t len, cap;
    int err;
} sbuf;

static int collect_line(int line, int ok, const char *json, size_t len, void *ud)
{
    sbuf *s = ud;
    (void)line;
    (void)ok;
    if (s->len + len + 2 > s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 4096;
        while (cap < s->len + len + 2)
            cap *= 2;
        char *p = realloc(s->p, cap);
        if (!p) {
            s->err = 1;
            return 1;
        }
        s->p = p;
        s->cap = cap;
    }
    memcpy(s->p + s->len, json, len);
    s->len += len;
    s->p[s->len++] = '\n';
    return 0;
}

/* Write the output (ok = 1) or error (ok = 0) file of j; sets *key. 0 or -1. */
static int write_result_file(batch_t *b, job_t *j, int ok, const char *key)
{
    if (json_is_string(json_object_get(j->obj, key)))
        return 0; /* written before a restart */
    sbuf s = {0};
    if (store_results_foreach(b->store, j->id, ok, collect_line, &s) < 0 || s.err) {
        free(s.p);
        return -1;
    }
    if (s.len == 0)
        return 0;
    store_file f = {.created_at = now_s(), .bytes = (int64_t)s.len};
    snprintf(f.owner, sizeof(f.owner), "%s", j->owner); /* the batch's owner's */
    batch_make_id(f.id, sizeof(f.id), "file-");
    snprintf(f.purpose, sizeof(f.purpose), "batch_output");
    snprintf(f.filename, sizeof(f.filename), "%s_%s.jsonl", j->id, ok ? "output" : "error");
    int rc = store_file_put(b->store, &f, s.p, s.len);
    free(s.p);
    if (rc < 0)
        return -1;
    job_set(j, key, json_string(f.id));
    return 0;
}

/* All lines are done (or the batch was cancelled): write the files, end the batch. */
static void finalize(batch_t *b, job_t *j, status_t final)
{
    if (write_result_file(b, j, 1, "output_file_id") < 0 ||
        write_result_file(b, j, 0, "error_file_id") < 0) {
        log_error("batch %s: cannot write its result files; trying again", j->id);
        return;
    }
    if (j->active) /* else the counts stored before a restart stand */
        job_counts(j);
    batch_job_status(b, j, final, final == ST_CANCELLED ? "cancelled_at" : "completed_at");
    job_free_run(b, j);
    /* the files exist: make the batch's new state durable at once */
    char *s = json_dumps(j->obj, JSON_COMPACT);
    if (s && store_batch_put(b->store, j->id, j->owner, s) == 0) {
        j->dirty = 0;
        store_flush(b->store);
    }
    free(s);
}

void batch_load_waiting(batch_t *b)
{
    int blocked = 0;
    for (int k = 0; k < b->n_jobs; k++) {
        job_t *j = b->jobs[k];
        if (j->active || is_final(j->status))
            continue;
        if (j->status == ST_CANCELLING || j->status == ST_FINALIZING) {
            /* its lines are over: the result files come from the store alone */
            finalize(b, j, j->status == ST_CANCELLING ? ST_CANCELLED : ST_COMPLETED);
            continue;
        }
        const char *fid = json_string_value(json_object_get(j->obj, "input_file_id"));
        store_file f;
        if (!blocked && b->loaded_bytes > 0 && fid && store_file_get(b->store, fid, &f) == 0 &&
            b->loaded_bytes + (uint64_t)f.bytes > b->p.max_file_bytes)
            blocked = 1; /* it waits for the batches before it, and those after it too */
        if (blocked)
            continue;
        if (batch_job_load(b, j) == 0)
            log_info("batch %s %s (%s): %d of %d lines already done", j->id,
                     j->status == ST_VALIDATING && !j->n_done ? "loaded" : "resumed",
                     batch_status_names[j->status], j->n_done, j->n_lines);
        else if (j->status != ST_FAILED)
            batch_job_status(b, j, ST_FAILED, "failed_at");
    }
}

static void work(batch_t *b)
{
    batch_load_waiting(b);
    for (int k = 0; k < b->n_jobs; k++) {
        job_t *j = b->jobs[k];
        if (!j->active)
            continue;
        if (j->status == ST_VALIDATING)
            validate_slice(b, j);
        else if (j->status == ST_CANCELLING && j->running.n == 0)
            finalize(b, j, ST_CANCELLED);
    }
    /* submit: oldest batch first, up to max_inflight lines in the cluster */
    int full = !b->cx.cluster;
    for (int k = 0; k < b->n_jobs && !full; k++) {
        job_t *j = b->jobs[k];
        if (!j->active || j->status != ST_IN_PROGRESS)
            continue;
        while (j->next_line < j->n_lines && b->inflight < b->p.max_inflight) {
            int i = j->next_line;
            if (j->state[i] != LINE_PENDING) {
                j->next_line++;
                continue;
            }
            if (batch_line_start(b, j, i) == 1) {
                full = 1;
                break;
            }
            j->next_line++;
        }
        if (b->inflight >= b->p.max_inflight)
            break;
    }
    for (int k = 0; k < b->n_jobs; k++) {
        job_t *j = b->jobs[k];
        if (j->active && j->status == ST_IN_PROGRESS && j->n_done == j->n_lines &&
            j->running.n == 0) {
            job_counts(j);
            batch_job_status(b, j, ST_FINALIZING, "finalizing_at");
        }
        if (j->active && j->status == ST_FINALIZING)
            finalize(b, j, ST_COMPLETED);
    }
    for (int k = 0; k < b->n_jobs; k++) {
        job_t *j = b->jobs[k];
        if (!j->dirty)
            continue;
        if (j->active)
            job_counts(j);
        char *s = json_dumps(j->obj, JSON_COMPACT);
        if (s && store_batch_put(b->store, j->id, j->owner, s) == 0)
            j->dirty = 0;
        free(s);
    }
    store_flush(b->store);
}

static void on_kick(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    work(arg);
}

// --- life

static int load_one(const char *id, const char *json, const char *owner, void *ud)
{
    batch_t *b = ud;
    json_t *obj = json_loads(json, 0, NULL);
    if (!obj || !json_is_object(obj)) {
        log_error("batch %s: unreadable stored object: skipped", id);
        json_decref(obj);
        return 0;
    }
    job_t *j = calloc(1, sizeof(*j));
    if (!j || batch_job_add(b, j) < 0) {
        free(j);
        json_decref(obj);
        return 1;
    }
    j->obj = obj;
    snprintf(j->id, sizeof(j->id), "%s", id);
    snprintf(j->owner, sizeof(j->owner), "%s", owner);
    const char *ep = json_string_value(json_object_get(obj, "endpoint"));
    j->kind = ep && strcmp(ep, "/v1/chat/completions") == 0 ? API_CHAT : API_COMPLETIONS;
    j->status = status_parse(json_string_value(json_object_get(obj, "status")));
    return 0;
}

/* Load the run state of the batches that were not final, as many as fit (after the scan of
 * the stored batches: loading writes; batch_load_waiting). A batch that was validating is
 * checked again from its first line (for the set of custom_ids); lines with a stored result
 * stay done. */
static void resume_all(batch_t *b)
{
    batch_load_waiting(b);
}

batch_t *batch_new(struct event_base *base, const batch_params *p, char *err, size_t errlen)
{
    if (!p->tok || p->n_ctx < 2 || p->max_inflight < 1 || p->max_lines < 1) {
        snprintf(err, errlen, "batch: bad parameters");
        return NULL;
    }
    batch_t *b = calloc(1, sizeof(*b));
    if (!b) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    b->base = base;
    b->p = *p;
    b->model = strdup(p->model_name);
    b->cx = (completion_env){
        .tok = p->tok,
        .n_ctx = p->n_ctx,
        .max_piece = completion_max_piece(p->tok),
        .max_body = p->max_body_bytes,
        .model = b->model,
        .batch_line = 1,
    };
    b->kick_ev = event_new(base, -1, 0, on_kick, b);
    b->tick_ev = event_new(base, -1, EV_PERSIST, on_kick, b);
    struct timeval tv = {0, TICK_MS * 1000};
    if (!b->model || !b->kick_ev || !b->tick_ev || event_add(b->tick_ev, &tv) < 0) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    b->store = store_open(p->state_db, err, errlen);
    if (!b->store)
        goto fail;
    b->p.state_db = NULL; /* not kept */
    b->p.model_name = NULL;
    if (store_batch_foreach(b->store, load_one, b) < 0) {
        snprintf(err, errlen, "%s: cannot read the stored batches", p->state_db);
        goto fail;
    }
    resume_all(b);
    return b;
fail:
    batch_destroy(&b);
    return NULL;
}

void batch_set_cluster(batch_t *b, cluster_t *c)
{
    b->cx.cluster = c;
    kick(b);
}

void batch_set_httpconn(batch_t *b, struct httpconn *conns)
{
    b->conns = conns;
}

struct store *batch_store(batch_t *b)
{
    return b->store;
}

void batch_set_stats(batch_t *b, stats_t *stats)
{
    b->cx.stats = stats;
}

void batch_destroy(batch_t **pb)
{
    if (!pb || !*pb)
        return;
    batch_t *b = *pb;
    batch_download_cut_all(b); /* they read from the store */
    for (int i = 0; i < b->n_jobs; i++) {
        job_t *j = b->jobs[i];
        while (j->running.head) { /* only if the cluster was not destroyed first */
            line_t *l = completion_ud(j->running.head);
            completion_destroy(&l->c); /* cancels it in the cluster; frees l */
        }
        if (j->dirty && b->store) {
            char *s = json_dumps(j->obj, JSON_COMPACT);
            if (s)
                store_batch_put(b->store, j->id, j->owner, s);
            free(s);
        }
        job_free_run(b, j);
        json_decref(j->obj);
        free(j);
    }
    free(b->jobs);
    store_close(&b->store);
    if (b->kick_ev)
        event_free(b->kick_ev);
    if (b->tick_ev)
        event_free(b->tick_ev);
    free(b->model);
    free(b);
    *pb = NULL;
}
