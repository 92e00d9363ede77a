/* batch: see batch.h.
 *
 * Every batch is a job_t holding its OpenAI batch object (json_t, the persisted form) and,
 * while it is not in a final state, its run state: the input file in memory, each line's
 * offset, length and state (pending, running, done) and the lines running now (line_t,
 * one per cluster request, freed in exactly one place: line_free). A done line has its
 * result queued in the store; the batch object (status, counts) is re-queued whenever it
 * changed, and one store_flush per tick writes both in a transaction.
 *
 * Work happens on one deferred event ("kick", after callbacks) and a 100 ms timer: validate
 * a slice of lines, submit pending lines up to max_inflight, finalize batches whose lines
 * are all done (output and error files from the stored results), then flush. Cluster
 * callbacks never call back into the cluster; they only record and kick. */
#include "batch.h"

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <time.h>

#include "api.h"
#include "log.h"
#include "multipart.h"
#include "sampler.h"
#include "store.h"
#include "stream.h"

#define TICK_MS 100
#define VALIDATE_SLICE 2000 /* lines checked per tick */
#define ID_HEX 24
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

static const char *status_names[] = {"validating", "failed",  "in_progress", "finalizing",
                                     "completed",  "expired", "cancelling",  "cancelled"};

enum { LINE_PENDING = 0, LINE_RUNNING = 1, LINE_DONE = 2 };

struct job;

typedef struct line {
    struct line *prev, *next; /* the job's running lines */
    struct job *job;
    batch_t *b;
    int index;
    char *custom_id;
    uint64_t rid;
    api_kind_t kind;
    int offline_tier; /* the body asked for service_tier "flex" */
    stream_t *stream;
    int n_prompt, max_tokens;
    char id[48];
    int64_t created;
    int64_t t_first_us, t_last_us;
    cluster_req_timing timing;
} line_t;

typedef struct job {
    json_t *obj; /* the batch object (owned) */
    char id[64];
    api_kind_t kind;
    status_t status;
    int dirty;
    /* run state (while not final) */
    int active;
    char *content;
    size_t content_len;
    int n_lines;
    size_t *off, *len;    /* (n_lines,) each line in content */
    unsigned char *state; /* (n_lines,) LINE_* */
    int next_line;        /* first line that may be pending */
    int validated;        /* lines checked so far (validating) */
    json_t *seen_ids;     /* validating: custom_ids seen (a set) */
    int n_done, completed, failed;
    int n_running;
    line_t *running;
} job_t;

struct batch {
    struct event_base *base;
    batch_params p;
    char *model;
    int max_piece;
    size_t max_body;
    store_t *store;
    cluster_t *cluster;
    stats_t *stats;
    job_t **jobs; /* creation order */
    int n_jobs, cap_jobs;
    int inflight;
    struct event *kick_ev, *tick_ev;
};

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

static int64_t now_s(void)
{
    return (int64_t)time(NULL);
}

static void new_id(char *out, size_t cap, const char *prefix)
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

static void kick(batch_t *b)
{
    event_active(b->kick_ev, EV_TIMEOUT, 0);
}

static status_t status_parse(const char *s)
{
    for (int i = 0; i < (int)(sizeof(status_names) / sizeof(status_names[0])); i++)
        if (s && strcmp(s, status_names[i]) == 0)
            return (status_t)i;
    return ST_FAILED;
}

static int is_final(status_t s)
{
    return s == ST_COMPLETED || s == ST_FAILED || s == ST_EXPIRED || s == ST_CANCELLED;
}

// --- replies

static void reply_body(struct evhttp_request *req, int status, const char *type, const char *body,
                       size_t len)
{
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", type);
    struct evbuffer *buf = evbuffer_new();
    if (buf && body)
        evbuffer_add(buf, body, len);
    evhttp_send_reply(req, status, NULL, buf);
    if (buf)
        evbuffer_free(buf);
}

static void reply_obj(struct evhttp_request *req, int status, json_t *obj)
{
    char *s = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    if (s)
        reply_body(req, status, "application/json", s, strlen(s));
    else
        reply_body(req, 500, "application/json", "{\"error\":{\"message\":\"out of memory\"}}", 38);
    free(s);
}

static void reply_err(struct evhttp_request *req, int status, const char *param, const char *code,
                      const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static void reply_err(struct evhttp_request *req, int status, const char *param, const char *code,
                      const char *fmt, ...)
{
    api_error e;
    api_error_set(&e, status, status >= 500 ? "server_error" : INVALID, param, code, "%s", "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.message, sizeof(e.message), fmt, ap);
    va_end(ap);
    char *s = api_error_json(&e);
    reply_body(req, status, "application/json", s ? s : "{}", s ? strlen(s) : 2);
    free(s);
}

// --- jobs

static job_t *job_find(batch_t *b, const char *id)
{
    for (int i = 0; i < b->n_jobs; i++)
        if (strcmp(b->jobs[i]->id, id) == 0)
            return b->jobs[i];
    return NULL;
}

static void job_free_run(job_t *j)
{
    free(j->content);
    free(j->off);
    free(j->len);
    free(j->state);
    json_decref(j->seen_ids);
    j->content = NULL;
    j->off = j->len = NULL;
    j->state = NULL;
    j->seen_ids = NULL;
    j->active = 0;
}

static void job_set(job_t *j, const char *key, json_t *v)
{
    json_object_set_new(j->obj, key, v);
    j->dirty = 1;
}

static void job_status(batch_t *b, job_t *j, status_t st, const char *ts_key)
{
    j->status = st;
    job_set(j, "status", json_string(status_names[st]));
    if (ts_key)
        job_set(j, ts_key, json_integer(now_s()));
    log_info("batch %s: %s (%d of %d lines done: %d completed, %d failed)", j->id, status_names[st],
             j->n_done, j->n_lines, j->completed, j->failed);
    kick(b);
}

static void job_counts(job_t *j)
{
    job_set(j, "request_counts",
            json_pack("{s:i, s:i, s:i}", "total", j->n_lines, "completed", j->completed, "failed",
                      j->failed));
}

static int job_add(batch_t *b, job_t *j)
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

/* Split the input into non-blank lines. 0, or -1 (out of memory). */
static int split_lines(job_t *j)
{
    int n = 0, cap = 0;
    size_t pos = 0;
    while (pos < j->content_len) {
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
            }
            j->off[n] = pos + lead;
            j->len[n] = l - lead;
            n++;
        }
        pos = next;
    }
    j->n_lines = n;
    j->state = calloc((size_t)(n > 0 ? n : 1), 1);
    return j->state ? 0 : -1;
}

static int mark_done(int line, int ok, const char *json, size_t len, void *ud)
{
    job_t *j = ud;
    (void)json;
    (void)len;
    if (line < 0 || line >= j->n_lines || j->state[line] == LINE_DONE)
        return 0;
    j->state[line] = LINE_DONE;
    j->n_done++;
    if (ok)
        j->completed++;
    else
        j->failed++;
    return 0;
}

/* Load the input file and the results stored so far. 0, or -1 (the batch is failed). */
static int job_load(batch_t *b, job_t *j)
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
            job_status(b, j, ST_FAILED, "failed_at");
        }
        return -1;
    }
    j->content = data;
    j->content_len = len;
    j->next_line = 0;
    j->n_done = j->completed = j->failed = 0;
    if (split_lines(j) < 0 || store_results_foreach(b->store, j->id, -1, mark_done, j) < 0) {
        job_free_run(j);
        return -1;
    }
    j->active = 1;
    return 0;
}

// --- line results

static void result_put(batch_t *b, job_t *j, int line, int ok, json_t *res)
{
    char *s = res ? json_dumps(res, JSON_COMPACT) : NULL;
    json_decref(res);
    if (!s || store_result_put(b->store, j->id, line, ok, s) < 0)
        log_error("batch %s: line %d: cannot record its result", j->id, line + 1);
    free(s);
    if (j->state[line] != LINE_DONE) {
        j->state[line] = LINE_DONE;
        j->n_done++;
        if (ok)
            j->completed++;
        else
            j->failed++;
    }
    j->dirty = 1;
    kick(b);
}

static json_t *req_id_json(void)
{
    char id[64];
    new_id(id, sizeof(id), "batch_req_");
    return json_string(id);
}

/* A line that is not a valid request line: error file, response null. */
static void line_error(batch_t *b, job_t *j, int line, const char *custom_id, const char *code,
                       const char *msg)
{
    json_t *res = json_pack("{s:o, s:o, s:n, s:{s:s, s:s, s:i}}", "id", req_id_json(), "custom_id",
                            custom_id ? json_string(custom_id) : json_null(), "response", "error",
                            "code", code, "message", msg, "line", line + 1);
    result_put(b, j, line, 0, res);
}

/* A request that got an HTTP error: error file, response with status and error body. */
static void line_error_response(batch_t *b, job_t *j, int line, const char *custom_id,
                                const char *request_id, const api_error *e)
{
    char *body = api_error_json(e);
    json_t *jb = body ? json_loads(body, 0, NULL) : NULL;
    free(body);
    json_t *res =
        json_pack("{s:o, s:o, s:{s:i, s:o, s:o}, s:n}", "id", req_id_json(), "custom_id",
                  custom_id ? json_string(custom_id) : json_null(), "response", "status_code",
                  e->status, "request_id", request_id ? json_string(request_id) : json_null(),
                  "body", jb ? jb : json_object(), "error");
    result_put(b, j, line, 0, res);
}

// --- running lines

static void line_free(line_t *l)
{
    job_t *j = l->job;
    if (l->prev)
        l->prev->next = l->next;
    else
        j->running = l->next;
    if (l->next)
        l->next->prev = l->prev;
    j->n_running--;
    l->b->inflight--;
    stream_destroy(&l->stream);
    free(l->custom_id);
    free(l);
}

static void line_stats(line_t *l, stats_end_t how, const char *finish, int status,
                       const char *error)
{
    if (!l->b->stats)
        return;
    stats_request sr = {.rid = l->rid,
                        .how = how,
                        .finish_reason = finish,
                        .status = status,
                        .error = error,
                        .n_prompt = l->n_prompt,
                        .n_output = l->stream ? stream_n_tokens(l->stream) : 0,
                        .t_first_us = l->t_first_us,
                        .t_last_us = l->t_last_us,
                        .t_end_us = proto_now_us(),
                        .timing = &l->timing,
                        .offline = 1};
    stats_request_end(l->b->stats, &sr, NULL);
}

static void line_complete(line_t *l, const char *finish_reason)
{
    batch_t *b = l->b;
    job_t *j = l->job;
    size_t len;
    const char *text = stream_out(l->stream, &len);
    api_response_info info = {.kind = l->kind,
                              .id = l->id,
                              .created = l->created,
                              .model = b->model,
                              .service_tier = l->offline_tier ? "flex" : "default"};
    char *body = api_format_response(&info, text, len, finish_reason, l->n_prompt,
                                     stream_n_tokens(l->stream));
    json_t *jb = body ? json_loads(body, 0, NULL) : NULL;
    free(body);
    if (!jb) {
        api_error e;
        api_error_set(&e, 500, "server_error", NULL, NULL, "could not format the response");
        line_error_response(b, j, l->index, l->custom_id, l->id, &e);
        line_stats(l, STATS_END_FAILED, NULL, 500, e.message);
    } else {
        json_t *res = json_pack("{s:o, s:s, s:{s:i, s:s, s:o}, s:n}", "id", req_id_json(),
                                "custom_id", l->custom_id, "response", "status_code", 200,
                                "request_id", l->id, "body", jb, "error");
        result_put(b, j, l->index, 1, res);
        line_stats(l, STATS_END_FINISHED, finish_reason, 200, NULL);
    }
    line_free(l);
}

static int on_line_tokens(void *ud, const int *tokens, int n)
{
    line_t *l = ud;
    int64_t now = proto_now_us();
    if (!l->t_first_us)
        l->t_first_us = now;
    l->t_last_us = now;
    for (int i = 0; i < n; i++) {
        stream_status_t st = stream_push(l->stream, tokens[i]);
        if (st == STREAM_STOP) {
            line_complete(l, API_FINISH_STOP);
            return 1;
        }
        if (st == STREAM_ERR) {
            api_error e;
            api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
            line_error_response(l->b, l->job, l->index, l->custom_id, l->id, &e);
            line_stats(l, STATS_END_FAILED, NULL, 500, e.message);
            line_free(l);
            return 1;
        }
    }
    if (stream_n_tokens(l->stream) >= l->max_tokens) {
        stream_status_t st = stream_finish(l->stream);
        line_complete(l, st == STREAM_STOP ? API_FINISH_STOP : API_FINISH_LENGTH);
        return 1;
    }
    return 0;
}

static void on_line_finish(void *ud, int reason)
{
    line_t *l = ud;
    stream_status_t st = stream_finish(l->stream);
    line_complete(l, st == STREAM_STOP || reason == PROTO_FINISH_STOP ? API_FINISH_STOP
                                                                      : API_FINISH_LENGTH);
}

static void on_line_error(void *ud, int status, const char *type, const char *code, const char *msg)
{
    line_t *l = ud;
    job_t *j = l->job;
    if (code && strcmp(code, "shutting_down") == 0) {
        /* not the line's fault: it stays unfinished and runs again after a restart */
        j->state[l->index] = LINE_PENDING;
        if (l->index < j->next_line)
            j->next_line = l->index;
        line_stats(l, STATS_END_CANCELLED, NULL, 0, NULL);
        line_free(l);
        return;
    }
    api_error e;
    api_error_set(&e, status, type, NULL, code, "%s", msg);
    line_error_response(l->b, j, l->index, l->custom_id, l->id, &e);
    line_stats(l, STATS_END_FAILED, NULL, status, msg);
    line_free(l);
}

static const cluster_callbacks line_callbacks = {on_line_tokens, on_line_finish, on_line_error};

/* Parse line i and check custom_id, method, url and body. Returns the parsed root (the
 * caller's; NULL when the line is not a JSON object) with *custom_id borrowed from it
 * (NULL when absent or not a valid string) and *body the request body, or *body NULL with
 * code and msg saying what is wrong with the line. */
static json_t *line_parse(const job_t *j, int i, const char **custom_id, json_t **body,
                          const char **code, char *msg, size_t cap)
{
    *custom_id = NULL;
    *body = NULL;
    const char *s = j->content + j->off[i];
    size_t n = j->len[i];
    if (!api_utf8_valid(s, n)) {
        *code = "invalid_encoding";
        snprintf(msg, cap, "line %d is not valid UTF-8", i + 1);
        return NULL;
    }
    json_error_t jerr;
    json_t *root = json_loadb(s, n, JSON_REJECT_DUPLICATES, &jerr);
    if (!root || !json_is_object(root)) {
        *code = "invalid_json_line";
        snprintf(msg, cap, "line %d is not a JSON object%s%s", i + 1, root ? "" : ": ",
                 root ? "" : jerr.text);
        json_decref(root);
        return NULL;
    }
    json_t *cid = json_object_get(root, "custom_id");
    if (json_is_string(cid) && json_string_length(cid) > 0 &&
        strlen(json_string_value(cid)) == json_string_length(cid) && json_string_length(cid) <= 512)
        *custom_id = json_string_value(cid);
    json_t *method = json_object_get(root, "method");
    json_t *url = json_object_get(root, "url");
    json_t *b = json_object_get(root, "body");
    const char *endpoint = j->kind == API_CHAT ? "/v1/chat/completions" : "/v1/completions";
    if (!*custom_id) {
        *code = "missing_custom_id";
        snprintf(msg, cap, "line %d: 'custom_id' must be a non-empty string of at most 512 bytes",
                 i + 1);
    } else if (!json_is_string(method) || strcmp(json_string_value(method), "POST") != 0) {
        *code = "invalid_method";
        snprintf(msg, cap, "line %d: 'method' must be \"POST\"", i + 1);
    } else if (!json_is_string(url) || strcmp(json_string_value(url), endpoint) != 0) {
        *code = "mismatched_url";
        snprintf(msg, cap, "line %d: 'url' must be the batch's endpoint %s", i + 1, endpoint);
    } else if (!json_is_object(b)) {
        *code = "invalid_body";
        snprintf(msg, cap, "line %d: 'body' must be a JSON object", i + 1);
    } else {
        *body = b;
    }
    return root;
}

/* Tokenize the prompt (BOS + text). malloc'd ids and their count, or NULL (out of memory,
 * tokenizer failure) with e set. */
static int *tokenize(batch_t *b, const api_request *r, int *n_out, api_error *e)
{
    int cap = (int)r->prompt_len + 8, needed = 0;
    int *tokens = malloc((size_t)cap * sizeof(int));
    if (!tokens) {
        api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return NULL;
    }
    int n = tokenizer_encode(b->p.tok, r->prompt, r->prompt_len, 1, tokens, cap, &needed);
    if (n < 0 && needed > cap) {
        int *t = realloc(tokens, (size_t)needed * sizeof(int));
        if (!t) {
            free(tokens);
            api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
            return NULL;
        }
        tokens = t;
        n = tokenizer_encode(b->p.tok, r->prompt, r->prompt_len, 1, tokens, needed, &needed);
    }
    if (n < 0) {
        free(tokens);
        api_error_set(e, 500, "server_error", NULL, NULL, "tokenization failed");
        return NULL;
    }
    *n_out = n;
    return tokens;
}

/* Start line i of j: validate its request and submit it, or record its error. Returns 0
 * when the line was handled, 1 when the cluster is full (try again later). */
static int line_start(batch_t *b, job_t *j, int i)
{
    const char *cid, *code = NULL;
    json_t *body;
    char msg[300];
    json_t *root = line_parse(j, i, &cid, &body, &code, msg, sizeof(msg));
    if (!body) {
        line_error(b, j, i, cid, code, msg);
        json_decref(root);
        return 0;
    }
    api_error e;
    api_request r;
    memset(&r, 0, sizeof(r));
    int *tokens = NULL, n = 0;
    line_t *l = NULL;
    char *text = json_dumps(body, JSON_COMPACT);
    if (!text) {
        api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
        goto bad;
    }
    if (strlen(text) > b->max_body) {
        api_error_set(&e, 413, INVALID, NULL, "request_too_large",
                      "The request body is %zu bytes; the limit is %zu bytes.", strlen(text),
                      b->max_body);
        goto bad;
    }
    if (api_parse(j->kind, text, strlen(text), &r, &e) < 0 || api_check_model(&r, b->model, &e) < 0)
        goto bad;
    if (r.stream) {
        api_error_set(&e, 400, INVALID, "stream", "invalid_value",
                      "'stream' is not supported in a batch.");
        goto bad;
    }
    if (r.prompt_len / (size_t)b->max_piece >= (size_t)b->p.n_ctx) {
        api_error_set(&e, 400, INVALID, j->kind == API_CHAT ? "messages" : "prompt",
                      "context_length_exceeded",
                      "This model's maximum context length is %d tokens, but the prompt is at "
                      "least %zu tokens.",
                      b->p.n_ctx, r.prompt_len / (size_t)b->max_piece + 1);
        goto bad;
    }
    tokens = tokenize(b, &r, &n, &e);
    if (!tokens || api_check_length(&r, n, b->p.n_ctx, &e) < 0)
        goto bad;
    l = calloc(1, sizeof(*l));
    if (!l || !(l->custom_id = strdup(cid))) {
        api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
        goto bad;
    }
    l->b = b;
    l->job = j;
    l->index = i;
    l->kind = j->kind;
    l->offline_tier = r.offline;
    l->n_prompt = n;
    l->max_tokens = r.max_tokens;
    l->created = now_s();
    l->stream = stream_new(b->p.tok, tokens[n - 1], tokenizer_eos(b->p.tok),
                           (const char *const *)r.stop, r.n_stop);
    if (!l->stream) {
        api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
        goto bad;
    }
    uint64_t seed = r.seed;
    if (!r.has_seed && getrandom(&seed, sizeof(seed), 0) != (ssize_t)sizeof(seed))
        seed = (uint64_t)proto_now_us() ^ ((uint64_t)(uintptr_t)l << 17);
    cluster_job job = {
        .tokens = tokens,
        .n_tokens = n,
        .max_tokens = r.max_tokens,
        .temperature = (float)r.temperature,
        .top_p = (float)r.top_p,
        .top_k = r.top_k,
        .rng = sampler_seed_state(seed),
        .mtp_depth = r.mtp_depth >= 0 ? r.mtp_depth + 1 : 0, /* as http.c */
        .timing = &l->timing,
        .offline = 1,
        .cb = &line_callbacks,
    };
    cluster_status_t st = cluster_submit(b->cluster, &job, l, &l->rid);
    if (st == CLUSTER_FULL) {
        stream_destroy(&l->stream);
        free(l->custom_id);
        free(l);
        free(tokens);
        free(text);
        api_request_free(&r);
        json_decref(root);
        return 1;
    }
    if (st != CLUSTER_OK) {
        api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
        goto bad;
    }
    snprintf(l->id, sizeof(l->id), "%s-%016llx", j->kind == API_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)l->rid);
    l->next = j->running;
    if (j->running)
        j->running->prev = l;
    j->running = l;
    j->n_running++;
    b->inflight++;
    j->state[i] = LINE_RUNNING;
    if (b->stats)
        stats_request_received(b->stats);
    free(tokens);
    free(text);
    api_request_free(&r);
    json_decref(root);
    return 0;
bad:
    line_error_response(b, j, i, cid, NULL, &e);
    if (l) {
        stream_destroy(&l->stream);
        free(l->custom_id);
        free(l);
    }
    free(tokens);
    free(text);
    api_request_free(&r);
    json_decref(root);
    return 0;
}

/* Stop every running line of j (cancel): they go back to pending. */
static void job_stop_lines(batch_t *b, job_t *j)
{
    while (j->running) {
        line_t *l = j->running;
        if (b->cluster)
            cluster_cancel(b->cluster, l->rid);
        j->state[l->index] = LINE_PENDING;
        line_free(l);
    }
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
        json_t *root = line_parse(j, i, &cid, &body, &code, msg, sizeof(msg));
        int dup = body && json_object_get(j->seen_ids, cid);
        if (body && !dup)
            json_object_set_new(j->seen_ids, cid, json_true());
        if (j->state[i] != LINE_DONE) {
            if (dup)
                line_error(b, j, i, cid, "duplicate_custom_id",
                           "this custom_id is used by an earlier line of the file");
            else if (!body)
                line_error(b, j, i, cid, code, msg);
        }
        json_decref(root);
    }
    j->validated = end;
    if (j->validated >= j->n_lines) {
        json_decref(j->seen_ids);
        j->seen_ids = NULL;
        job_counts(j);
        job_status(b, j, ST_IN_PROGRESS, "in_progress_at");
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
    new_id(f.id, sizeof(f.id), "file-");
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
    job_counts(j);
    job_status(b, j, final, final == ST_CANCELLED ? "cancelled_at" : "completed_at");
    job_free_run(j);
    /* the files exist: make the batch's new state durable at once */
    char *s = json_dumps(j->obj, JSON_COMPACT);
    if (s && store_batch_put(b->store, j->id, s) == 0) {
        j->dirty = 0;
        store_flush(b->store);
    }
    free(s);
}

static void work(batch_t *b)
{
    for (int k = 0; k < b->n_jobs; k++) {
        job_t *j = b->jobs[k];
        if (!j->active)
            continue;
        if (j->status == ST_VALIDATING)
            validate_slice(b, j);
        else if (j->status == ST_CANCELLING && j->n_running == 0)
            finalize(b, j, ST_CANCELLED);
    }
    /* submit: oldest batch first, up to max_inflight lines in the cluster */
    int full = !b->cluster;
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
            if (line_start(b, j, i) == 1) {
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
            j->n_running == 0) {
            job_counts(j);
            job_status(b, j, ST_FINALIZING, "finalizing_at");
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
        if (s && store_batch_put(b->store, j->id, s) == 0)
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

// --- HTTP: files

static int query_get(struct evhttp_request *req, const char *key, char *out, size_t cap)
{
    const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri(req);
    const char *q = uri ? evhttp_uri_get_query(uri) : NULL;
    if (!q)
        return 0;
    struct evkeyvalq kv; /* evhttp_parse_query_str initializes it */
    if (evhttp_parse_query_str(q, &kv) < 0)
        return 0;
    const char *v = evhttp_find_header(&kv, key);
    int found = v != NULL;
    if (v)
        snprintf(out, cap, "%s", v);
    evhttp_clear_headers(&kv);
    return found;
}

static json_t *file_json(const store_file *f)
{
    return json_pack("{s:s, s:s, s:I, s:I, s:n, s:s, s:s, s:s, s:n}", "id", f->id, "object", "file",
                     "bytes", (json_int_t)f->bytes, "created_at", (json_int_t)f->created_at,
                     "expires_at", "filename", f->filename, "purpose", f->purpose, "status",
                     "processed", "status_details");
}

static void handle_upload(batch_t *b, struct evhttp_request *req)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    const char *body = len ? (const char *)evbuffer_pullup(in, (ev_ssize_t)len) : "";
    const char *ct = evhttp_find_header(evhttp_request_get_input_headers(req), "Content-Type");
    const char *data = NULL, *purpose = NULL;
    size_t dlen = 0, plen = 0;
    char filename[256] = "upload.jsonl", qpurpose[64] = "";
    if (ct && strncasecmp(ct, "multipart/form-data", 19) == 0) {
        multipart_part parts[MULTIPART_MAX_PARTS];
        char err[200];
        int n = multipart_parse(ct, body, len, parts, MULTIPART_MAX_PARTS, err, sizeof(err));
        if (n < 0) {
            reply_err(req, 400, NULL, "invalid_multipart", "Invalid multipart/form-data body: %s.",
                      err);
            return;
        }
        for (int i = 0; i < n; i++) {
            if (strcmp(parts[i].name, "purpose") == 0) {
                purpose = parts[i].data;
                plen = parts[i].len;
            } else if (strcmp(parts[i].name, "file") == 0) {
                data = parts[i].data;
                dlen = parts[i].len;
                if (parts[i].filename[0])
                    snprintf(filename, sizeof(filename), "%s", parts[i].filename);
            }
        }
        if (!data) {
            reply_err(req, 400, "file", "missing_required_parameter",
                      "Missing required parameter: 'file' (a form part named \"file\").");
            return;
        }
    } else {
        /* raw body: ?purpose=batch[&filename=NAME] (curl --data-binary @file) */
        data = body;
        dlen = len;
        if (query_get(req, "purpose", qpurpose, sizeof(qpurpose))) {
            purpose = qpurpose;
            plen = strlen(qpurpose);
        }
        char fn[256];
        if (query_get(req, "filename", fn, sizeof(fn)) && fn[0])
            snprintf(filename, sizeof(filename), "%s", fn);
    }
    if (!purpose) {
        reply_err(req, 400, "purpose", "missing_required_parameter",
                  "Missing required parameter: 'purpose'.");
        return;
    }
    if (plen != 5 || memcmp(purpose, "batch", 5) != 0) {
        reply_err(req, 400, "purpose", "invalid_value",
                  "'purpose' must be 'batch' (the only purpose this server accepts).");
        return;
    }
    if (dlen > b->p.max_file_bytes) {
        reply_err(req, 413, "file", "file_too_large",
                  "The file is %zu bytes; the limit is %zu bytes.", dlen, b->p.max_file_bytes);
        return;
    }
    if (!api_utf8_valid(data, dlen) || memchr(data, 0, dlen)) {
        reply_err(req, 400, "file", "invalid_encoding", "The file is not valid UTF-8 text.");
        return;
    }
    /* count the non-blank lines */
    long n_lines = 0;
    for (size_t pos = 0; pos < dlen;) {
        const char *nl = memchr(data + pos, '\n', dlen - pos);
        size_t end = nl ? (size_t)(nl - data) : dlen;
        for (size_t k = pos; k < end; k++) {
            if (data[k] != ' ' && data[k] != '\t' && data[k] != '\r') {
                n_lines++;
                break;
            }
        }
        pos = end + 1;
    }
    if (n_lines == 0) {
        reply_err(req, 400, "file", "invalid_file", "The file is empty (no JSONL lines).");
        return;
    }
    if (n_lines > b->p.max_lines) {
        reply_err(req, 400, "file", "too_many_lines", "The file has %ld lines; the limit is %d.",
                  n_lines, b->p.max_lines);
        return;
    }
    store_file f = {.created_at = now_s(), .bytes = (int64_t)dlen};
    new_id(f.id, sizeof(f.id), "file-");
    snprintf(f.purpose, sizeof(f.purpose), "batch");
    snprintf(f.filename, sizeof(f.filename), "%s", filename);
    if (store_file_put(b->store, &f, data, dlen) < 0) {
        reply_err(req, 500, NULL, "storage_error", "The file could not be saved.");
        return;
    }
    log_info("file %s uploaded: %s, %zu bytes, %ld lines", f.id, f.filename, dlen, n_lines);
    json_t *o = file_json(&f);
    reply_obj(req, 200, o);
    json_decref(o);
}

static void handle_file(batch_t *b, struct evhttp_request *req, const char *id, int content)
{
    store_file f;
    int rc = store_file_get(b->store, id, &f);
    if (rc > 0) {
        reply_err(req, 404, "file_id", "file_not_found", "No such File object: %.100s", id);
        return;
    }
    if (rc < 0) {
        reply_err(req, 500, NULL, "storage_error", "The file could not be read.");
        return;
    }
    if (!content) {
        json_t *o = file_json(&f);
        reply_obj(req, 200, o);
        json_decref(o);
        return;
    }
    char *data;
    size_t len;
    if (store_file_content(b->store, id, &data, &len) != 0) {
        reply_err(req, 500, NULL, "storage_error", "The file could not be read.");
        return;
    }
    reply_body(req, 200, "application/octet-stream", data, len);
    free(data);
}

// --- HTTP: batches

static void handle_create(batch_t *b, struct evhttp_request *req)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    if (len > b->max_body) {
        reply_err(req, 413, NULL, "request_too_large",
                  "The request body is %zu bytes; the limit is %zu bytes.", len, b->max_body);
        return;
    }
    const char *body = len ? (const char *)evbuffer_pullup(in, (ev_ssize_t)len) : "";
    if (!api_utf8_valid(body, len)) {
        reply_err(req, 400, NULL, "invalid_encoding", "The request body is not valid UTF-8.");
        return;
    }
    json_error_t jerr;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
    if (!root) {
        reply_err(req, 400, NULL, "invalid_json",
                  "We could not parse the JSON body of your request (%s).", jerr.text);
        return;
    }
    json_t *fid = json_object_get(root, "input_file_id");
    json_t *ep = json_object_get(root, "endpoint");
    json_t *win = json_object_get(root, "completion_window");
    json_t *meta = json_object_get(root, "metadata");
    store_file f;
    int rc;
    if (!json_is_object(root)) {
        reply_err(req, 400, NULL, "invalid_type", "The request body must be a JSON object.");
        goto out;
    }
    const char *missing = !fid || json_is_null(fid)   ? "input_file_id"
                          : !ep || json_is_null(ep)   ? "endpoint"
                          : !win || json_is_null(win) ? "completion_window"
                                                      : NULL;
    if (missing) {
        reply_err(req, 400, missing, "missing_required_parameter",
                  "Missing required parameter: '%s'.", missing);
        goto out;
    }
    if (!json_is_string(fid) || !json_is_string(ep) || !json_is_string(win)) {
        const char *p = !json_is_string(fid)  ? "input_file_id"
                        : !json_is_string(ep) ? "endpoint"
                                              : "completion_window";
        reply_err(req, 400, p, "invalid_type", "'%s' must be a string.", p);
        goto out;
    }
    api_kind_t kind;
    if (strcmp(json_string_value(ep), "/v1/completions") == 0) {
        kind = API_COMPLETIONS;
    } else if (strcmp(json_string_value(ep), "/v1/chat/completions") == 0) {
        kind = API_CHAT;
    } else {
        reply_err(req, 400, "endpoint", "invalid_value",
                  "'endpoint' must be '/v1/completions' or '/v1/chat/completions', got "
                  "'%.100s'.",
                  json_string_value(ep));
        goto out;
    }
    if (strcmp(json_string_value(win), "24h") != 0) {
        reply_err(req, 400, "completion_window", "invalid_value",
                  "'completion_window' must be '24h', got '%.100s'.", json_string_value(win));
        goto out;
    }
    if (meta && !json_is_null(meta)) {
        const char *k;
        json_t *v;
        int ok = json_is_object(meta) && json_object_size(meta) <= 16;
        json_object_foreach(meta, k, v)
        {
            if (!json_is_string(v) || strlen(k) > 64 || json_string_length(v) > 512)
                ok = 0;
        }
        if (!ok) {
            reply_err(req, 400, "metadata", "invalid_value",
                      "'metadata' must be an object of at most 16 string values (keys up to 64 "
                      "bytes, values up to 512).");
            goto out;
        }
    }
    rc = store_file_get(b->store, json_string_value(fid), &f);
    if (rc != 0) {
        if (rc > 0)
            reply_err(req, 404, "input_file_id", "file_not_found", "No such File object: %.100s",
                      json_string_value(fid));
        else
            reply_err(req, 500, NULL, "storage_error", "The file could not be read.");
        goto out;
    }
    if (strcmp(f.purpose, "batch") != 0) {
        reply_err(req, 400, "input_file_id", "invalid_value",
                  "The file %.100s has purpose '%s'; a batch needs a file with purpose 'batch'.",
                  f.id, f.purpose);
        goto out;
    }
    job_t *j = calloc(1, sizeof(*j));
    if (!j) {
        reply_err(req, 500, NULL, NULL, "out of memory");
        goto out;
    }
    new_id(j->id, sizeof(j->id), "batch_");
    j->kind = kind;
    int64_t now = now_s();
    j->obj = json_pack("{s:s, s:s, s:s, s:n, s:s, s:s, s:s, s:n, s:n, s:I, s:n, s:I, s:n, s:n, "
                       "s:n, s:n, s:n, s:n, s:{s:i, s:i, s:i}, s:O?}",
                       "id", j->id, "object", "batch", "endpoint", json_string_value(ep), "errors",
                       "input_file_id", f.id, "completion_window", "24h", "status", "validating",
                       "output_file_id", "error_file_id", "created_at", (json_int_t)now,
                       "in_progress_at", "expires_at", (json_int_t)(now + 86400), "finalizing_at",
                       "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at",
                       "request_counts", "total", 0, "completed", 0, "failed", 0, "metadata",
                       meta && !json_is_null(meta) ? meta : NULL);
    if (!j->obj || job_add(b, j) < 0) {
        json_decref(j->obj);
        free(j);
        reply_err(req, 500, NULL, NULL, "out of memory");
        goto out;
    }
    if (!json_object_get(j->obj, "metadata"))
        json_object_set_new(j->obj, "metadata", json_null());
    j->status = ST_VALIDATING;
    j->dirty = 1;
    if (job_load(b, j) < 0 && j->status != ST_FAILED) {
        job_status(b, j, ST_FAILED, "failed_at");
    } else if (j->active) {
        json_object_set_new(
            j->obj, "request_counts",
            json_pack("{s:i, s:i, s:i}", "total", j->n_lines, "completed", 0, "failed", 0));
    }
    log_info("batch %s created: %s, file %s, %d lines", j->id, json_string_value(ep), f.id,
             j->n_lines);
    kick(b);
    reply_obj(req, 200, j->obj);
out:
    json_decref(root);
}

static void handle_list(batch_t *b, struct evhttp_request *req)
{
    char v[128] = "", after[128] = "";
    long limit = 20;
    if (query_get(req, "limit", v, sizeof(v))) {
        char *end;
        limit = strtol(v, &end, 10);
        if (!v[0] || *end || limit < 1 || limit > 100) {
            reply_err(req, 400, "limit", "invalid_value",
                      "'limit' must be an integer from 1 to 100.");
            return;
        }
    }
    int start = b->n_jobs - 1; /* newest first */
    if (query_get(req, "after", after, sizeof(after))) {
        start = -2;
        for (int i = 0; i < b->n_jobs; i++)
            if (strcmp(b->jobs[i]->id, after) == 0)
                start = i - 1;
        if (start == -2) {
            reply_err(req, 404, "after", "batch_not_found", "No such batch: %.100s", after);
            return;
        }
    }
    json_t *data = json_array();
    int i;
    for (i = start; i >= 0 && (long)json_array_size(data) < limit; i--)
        json_array_append(data, b->jobs[i]->obj);
    size_t n = json_array_size(data);
    json_t *o = json_pack(
        "{s:s, s:o, s:o, s:o, s:b}", "object", "list", "data", data, "first_id",
        n ? json_incref(json_object_get(json_array_get(data, 0), "id")) : json_null(), "last_id",
        n ? json_incref(json_object_get(json_array_get(data, n - 1), "id")) : json_null(),
        "has_more", i >= 0);
    reply_obj(req, 200, o);
    json_decref(o);
}

static void handle_cancel(batch_t *b, struct evhttp_request *req, job_t *j)
{
    if (is_final(j->status) || j->status == ST_FINALIZING) {
        reply_err(req, 400, NULL, "invalid_state", "Cannot cancel a batch with status '%s'.",
                  status_names[j->status]);
        return;
    }
    if (j->status != ST_CANCELLING) {
        job_stop_lines(b, j);
        job_status(b, j, ST_CANCELLING, "cancelling_at");
    }
    reply_obj(req, 200, j->obj);
}

void batch_handle(batch_t *b, struct evhttp_request *req, batch_route_t route, const char *id)
{
    enum evhttp_cmd_type m = evhttp_request_get_command(req);
    switch (route) {
    case BATCH_ROUTE_FILES:
        handle_upload(b, req);
        return;
    case BATCH_ROUTE_FILE:
    case BATCH_ROUTE_FILE_CONTENT:
        handle_file(b, req, id ? id : "", route == BATCH_ROUTE_FILE_CONTENT);
        return;
    case BATCH_ROUTE_BATCHES:
        if (m == EVHTTP_REQ_POST)
            handle_create(b, req);
        else
            handle_list(b, req);
        return;
    case BATCH_ROUTE_BATCH:
    case BATCH_ROUTE_CANCEL: {
        job_t *j = id ? job_find(b, id) : NULL;
        if (!j) {
            reply_err(req, 404, "batch_id", "batch_not_found", "No such batch: %.100s",
                      id ? id : "");
            return;
        }
        if (route == BATCH_ROUTE_CANCEL)
            handle_cancel(b, req, j);
        else
            reply_obj(req, 200, j->obj);
        return;
    }
    }
    reply_err(req, 404, NULL, "unknown_url", "Invalid URL");
}

// --- life

static int load_one(const char *id, const char *json, void *ud)
{
    batch_t *b = ud;
    json_t *obj = json_loads(json, 0, NULL);
    if (!obj || !json_is_object(obj)) {
        log_error("batch %s: unreadable stored object: skipped", id);
        json_decref(obj);
        return 0;
    }
    job_t *j = calloc(1, sizeof(*j));
    if (!j || job_add(b, j) < 0) {
        free(j);
        json_decref(obj);
        return 1;
    }
    j->obj = obj;
    snprintf(j->id, sizeof(j->id), "%s", id);
    const char *ep = json_string_value(json_object_get(obj, "endpoint"));
    j->kind = ep && strcmp(ep, "/v1/chat/completions") == 0 ? API_CHAT : API_COMPLETIONS;
    j->status = status_parse(json_string_value(json_object_get(obj, "status")));
    return 0;
}

/* Load the run state of every batch that was not final (after the scan of the stored
 * batches: loading writes). A batch that was validating is checked again from its first
 * line (for the set of custom_ids); lines with a stored result stay done. */
static void resume_all(batch_t *b)
{
    for (int k = 0; k < b->n_jobs; k++) {
        job_t *j = b->jobs[k];
        if (is_final(j->status) || job_load(b, j) < 0)
            continue;
        log_info("batch %s resumed (%s): %d of %d lines already done", j->id,
                 status_names[j->status], j->n_done, j->n_lines);
    }
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
    b->max_body = p->max_body_bytes;
    b->model = strdup(p->model_name);
    b->max_piece = 1;
    for (int id = 0; id < tokenizer_vocab_size(p->tok); id++) {
        size_t len = 0;
        tokenizer_piece(p->tok, -1, id, &len);
        if ((int)len > b->max_piece)
            b->max_piece = (int)len;
    }
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
    b->cluster = c;
    kick(b);
}

void batch_set_stats(batch_t *b, stats_t *stats)
{
    b->stats = stats;
}

void batch_destroy(batch_t **pb)
{
    if (!pb || !*pb)
        return;
    batch_t *b = *pb;
    for (int i = 0; i < b->n_jobs; i++) {
        job_t *j = b->jobs[i];
        while (j->running) { /* only if the cluster was not destroyed first */
            line_t *l = j->running;
            if (b->cluster)
                cluster_cancel(b->cluster, l->rid);
            line_free(l);
        }
        if (j->dirty && b->store) {
            char *s = json_dumps(j->obj, JSON_COMPACT);
            if (s)
                store_batch_put(b->store, j->id, s);
            free(s);
        }
        job_free_run(j);
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
