/* batch_lines: the input lines of a batch (batch.h). Each line is parsed and checked
 * ({"custom_id", "method": "POST", "url", "body"}), then its body goes down the same
 * completion path as a normal request (completion.h: validated, tokenized, run as an
 * offline cluster request); line_t is that completion's sink. The result of every line, a
 * response or an error, goes to the store. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "batch_internal.h"
#include "log.h"
#include "store.h"

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

json_t *batch_line_error_record(int line, const char *custom_id, const char *code,
                                const char *msg)
{
    char text[sizeof(((api_error *)0)->message)];
    snprintf(text, sizeof(text), "%s", msg);
    api_utf8_trim(text); /* it may quote the line, cut at a byte count */
    return json_pack("{s:o, s:o, s:n, s:{s:s, s:s, s:i}}", "id", req_id_json(), "custom_id",
                     custom_id ? json_string(custom_id) : json_null(), "response", "error",
                     "code", code, "message", text, "line", line);
}

/* A line that is not a valid request line: error file, response null. */
void batch_line_error(batch_t *b, job_t *j, int line, const char *custom_id, const char *code,
                      const char *msg)
{
    result_put(b, j, line, 0, batch_line_error_record(j->line_no[line], custom_id, code, msg));
}

json_t *batch_line_error_response_record(const char *custom_id, const char *request_id,
                                         const api_error *e)
{
    char *body = api_error_json(e);
    json_t *jb = body ? json_loads(body, 0, NULL) : NULL;
    free(body);
    return json_pack("{s:o, s:o, s:{s:i, s:o, s:o}, s:n}", "id", req_id_json(), "custom_id",
                     custom_id ? json_string(custom_id) : json_null(), "response", "status_code",
                     e->status, "request_id", request_id ? json_string(request_id) : json_null(),
                     "body", jb ? jb : json_object(), "error");
}

/* A request that got an HTTP error: error file, response with status and error body. */
static void line_error_response(batch_t *b, job_t *j, int line, const char *custom_id,
                                const char *request_id, const api_error *e)
{
    result_put(b, j, line, 0, batch_line_error_response_record(custom_id, request_id, e));
}

// --- running lines: the completions' sink

/* The line's completion is gone (completion_sink.release; it has left the job's running
 * list): the one place a running line is freed. */
static void line_release(void *ud)
{
    line_t *l = ud;
    l->b->inflight--;
    free(l->custom_id);
    free(l);
}

/* Finished: the output line, whose body is exactly the non-streaming response. */
static int line_done(void *ud, const completion_t *c, api_error *e)
{
    line_t *l = ud;
    char *body = completion_format_response(c);
    /* the text may hold U+0000 (the byte token <0x00>): "\u0000" in the JSON */
    json_t *jb = body ? json_loads(body, JSON_ALLOW_NUL, NULL) : NULL;
    free(body);
    if (!jb) {
        api_error_set(e, 500, "server_error", NULL, NULL, "could not format the response");
        line_error_response(l->b, l->job, l->index, l->custom_id, completion_id(c), e);
        return -1;
    }
    json_t *res = json_pack("{s:o, s:s, s:{s:i, s:s, s:o}, s:n}", "id", req_id_json(), "custom_id",
                            l->custom_id, "response", "status_code", 200, "request_id",
                            completion_id(c), "body", jb, "error");
    result_put(l->b, l->job, l->index, 1, res);
    return 0;
}

/* Failed: an error line, unless the gateway is shutting down, which is not the line's
 * fault: it stays unfinished and runs again after a restart. */
static stats_end_t line_fail(void *ud, const completion_t *c, const api_error *e)
{
    line_t *l = ud;
    job_t *j = l->job;
    if (e->code && strcmp(e->code, "shutting_down") == 0) {
        j->state[l->index] = LINE_PENDING;
        if (l->index < j->next_line)
            j->next_line = l->index;
        return STATS_END_CANCELLED;
    }
    line_error_response(l->b, j, l->index, l->custom_id, completion_id(c), e);
    return STATS_END_FAILED;
}

/* Lines never stream (completion_env.batch_line): no text callback is ever made. */
static const completion_sink line_sink = {
    .done = line_done, .fail = line_fail, .release = line_release};

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
    int no = j->line_no[i]; /* its number in the file */
    if (!api_utf8_valid(s, n)) {
        *code = "invalid_encoding";
        snprintf(msg, cap, "line %d is not valid UTF-8", no);
        return NULL;
    }
    json_error_t jerr;
    json_t *root = json_loadb(s, n, JSON_REJECT_DUPLICATES, &jerr);
    if (!root || !json_is_object(root)) {
        *code = "invalid_json_line";
        snprintf(msg, cap, "line %d is not a JSON object%s%s", no, root ? "" : ": ",
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
                 no);
    } else if (!json_is_string(method) || strcmp(json_string_value(method), "POST") != 0) {
        *code = "invalid_method";
        snprintf(msg, cap, "line %d: 'method' must be \"POST\"", no);
    } else if (!json_is_string(url) || strcmp(json_string_value(url), endpoint) != 0) {
        *code = "mismatched_url";
        snprintf(msg, cap, "line %d: 'url' must be the batch's endpoint %s", no, endpoint);
    } else if (!json_is_object(b)) {
        *code = "invalid_body";
        snprintf(msg, cap, "line %d: 'body' must be a JSON object", no);
    } else {
        *body = b;
    }
    return root;
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
    int rc = 0; /* 0: handled (started or failed), 1: the cluster is full, try later */
    char *text = json_dumps(body, JSON_COMPACT);
    line_t *l = calloc(1, sizeof(*l));
    completion_status_t st = COMPLETION_ERR;
    if (!text || !l || !(l->custom_id = strdup(cid))) {
        api_error_set(&e, 500, "server_error", NULL, NULL, "out of memory");
    } else {
        l->b = b;
        l->job = j;
        l->index = i;
        st = completion_start(&b->cx, j->kind, text, strlen(text), &line_sink, l, &j->running,
                              &l->c, &e);
    }
    if (st == COMPLETION_OK) {
        b->inflight++;
        j->state[i] = LINE_RUNNING;
        l = NULL; /* the completion's now */
    } else if (st == COMPLETION_FULL) {
        rc = 1;
    } else {
        /* refused before it became a completion: it still gets a request id of its own (as
         * OpenAI's error lines have), with the prefix of the endpoint's response ids */
        char rid[64];
        batch_make_id(rid, sizeof(rid), j->kind == API_CHAT ? "chatcmpl-" : "cmpl-");
        line_error_response(b, j, i, cid, rid, &e);
    }
    if (l) {
        free(l->custom_id);
        free(l);
    }
    free(text);
    json_decref(root);
    return rc;
}

/* Stop every running line of j (cancel): they go back to pending. Each is counted as
 * cancelled (docs/stats.md: every request received ends in one bucket). */
void batch_job_stop_lines(batch_t *b, job_t *j)
{
    while (j->running.head) {
        line_t *l = completion_ud(j->running.head);
        j->state[l->index] = LINE_PENDING;
        completion_cancel(&l->c, 499, "the batch was cancelled"); /* in the cluster; frees l */
    }
}
