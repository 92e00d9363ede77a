/* batch_lines: the input lines of a batch (batch.h). Each line is parsed and checked
 * ({"custom_id", "method": "POST", "url", "body"}), its body validated like a normal
 * request, then run as an offline cluster request (line_t, one per request in flight); the
 * result of every line, a response or an error, goes to the store. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "api.h"
#include "batch_internal.h"
#include "log.h"
#include "sampler.h"
#include "store.h"
#include "stream.h"

// --- line results

static void result_put(batch_t *b, job_t *j, int line, int ok, json_t *res)
{
    char *s = res ? json_dumps(res, JSON_COMPACT) : NULL;
    json_decref(res);
    if (!s || store_result_put(b->store, j->id, line, ok, s) < 0)
        log_error("batch %s: line %d: cannot record its result", j->id, line + 1);
    free(s);
    batch_job_line_done(j, line, ok);
    j->dirty = 1;
    kick(b);
}

static json_t *req_id_json(void)
{
    char id[64];
    batch_make_id(id, sizeof(id), "batch_req_");
    return json_string(id);
}

/* A line that is not a valid request line: error file, response null. */
void batch_line_error(batch_t *b, job_t *j, int line, const char *custom_id, const char *code,
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

void batch_line_free(line_t *l)
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
    batch_line_free(l);
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
            batch_line_free(l);
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
        batch_line_free(l);
        return;
    }
    api_error e;
    api_error_set(&e, status, type, NULL, code, "%s", msg);
    line_error_response(l->b, j, l->index, l->custom_id, l->id, &e);
    line_stats(l, STATS_END_FAILED, NULL, status, msg);
    batch_line_free(l);
}

static const cluster_callbacks line_callbacks = {on_line_tokens, on_line_finish, on_line_error};

/* Parse line i and check custom_id, method, url and body. Returns the parsed root (the
 * caller's; NULL when the line is not a JSON object) with *custom_id borrowed from it
 * (NULL when absent or not a valid string) and *body the request body, or *body NULL with
 * code and msg saying what is wrong with the line. */
json_t *batch_line_parse(const job_t *j, int i, const char **custom_id, json_t **body,
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
int batch_line_start(batch_t *b, job_t *j, int i)
{
    const char *cid, *code = NULL;
    json_t *body;
    char msg[300];
    json_t *root = batch_line_parse(j, i, &cid, &body, &code, msg, sizeof(msg));
    if (!body) {
        batch_line_error(b, j, i, cid, code, msg);
        json_decref(root);
        return 0;
    }
    api_error e;
    api_request r;
    memset(&r, 0, sizeof(r));
    int *tokens = NULL, n = 0;
    int rc = 0; /* 0: handled (started or failed), 1: the cluster is full, try later */
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
        rc = 1;
        goto out;
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
    l = NULL; /* the job's now */
    goto out;
bad:
    line_error_response(b, j, i, cid, NULL, &e);
out:
    if (l) {
        stream_destroy(&l->stream);
        free(l->custom_id);
        free(l);
    }
    free(tokens);
    free(text);
    api_request_free(&r);
    json_decref(root);
    return rc;
}

/* Stop every running line of j (cancel): they go back to pending. */
void batch_job_stop_lines(batch_t *b, job_t *j)
{
    while (j->running) {
        line_t *l = j->running;
        if (b->cluster)
            cluster_cancel(b->cluster, l->rid);
        j->state[l->index] = LINE_PENDING;
        batch_line_free(l);
    }
}
