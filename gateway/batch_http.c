/* batch_http: the HTTP routes of the batch module (batch.h): POST /v1/files (multipart or
 * raw upload of a JSONL file), GET /v1/files (list), GET and DELETE /v1/files/{id},
 * GET /v1/files/{id}/content, POST and GET /v1/batches,
 * GET /v1/batches/{id} and POST /v1/batches/{id}/cancel. Replies are JSON (an OpenAI error
 * body on failure). An object the caller may not see (visible()) is answered exactly as
 * one that does not exist. */
#include <event2/buffer.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "api.h"
#include "batch_internal.h"
#include "http.h"
#include "log.h"
#include "multipart.h"
#include "store.h"

// --- replies

static void reply_body(struct evhttp_request *req, int status, const char *type, const char *body,
                       size_t len)
{
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", type);
    struct evbuffer *buf = evbuffer_new();
    if (buf && body)
        evbuffer_add(buf, body, len);
    http_send_reply(req, status, buf);
    if (buf)
        evbuffer_free(buf);
}

static void reply_obj(struct evhttp_request *req, int status, json_t *obj)
{
    char *s = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    if (s) {
        reply_body(req, status, "application/json", s, strlen(s));
    } else { /* obj NULL (out of memory) or not JSON text */
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":"
                                  "\"server_error\",\"param\":null,\"code\":null}}";
        reply_body(req, 500, "application/json", oom, sizeof(oom) - 1);
    }
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
    api_utf8_trim(e.message); /* it quotes client input, cut at a byte count */
    char *s = api_error_json(&e);
    reply_body(req, status, "application/json", s ? s : "{}", s ? strlen(s) : 2);
    free(s);
}

// --- ownership

/* May who see an object of owner ("" = none)? */
static int visible(const batch_caller *who, const char *owner)
{
    return who->see_all || (who->owner && owner[0] && strcmp(owner, who->owner) == 0);
}

/* For logs: the caller's key id, or "-". */
static const char *who_str(const batch_caller *who)
{
    return who->owner ? who->owner : "-";
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
    /* valid UTF-8 whatever the database holds (jansson refuses to build a string of
     * anything else: the object was NULL, the reply a 500) */
    char name[sizeof(f->filename)];
    snprintf(name, sizeof(name), "%s", f->filename);
    api_utf8_trim(name);
    return json_pack("{s:s, s:s, s:I, s:I, s:n, s:s, s:s, s:s, s:n}", "id", f->id, "object", "file",
                     "bytes", (json_int_t)f->bytes, "created_at", (json_int_t)f->created_at,
                     "expires_at", "filename", name, "purpose", f->purpose, "status",
                     "processed", "status_details");
}

static void handle_upload(batch_t *b, struct evhttp_request *req, const batch_caller *who)
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
    /* count the non-blank lines (a byte order mark is none: batch_job_split_lines) */
    long n_lines = 0;
    size_t start = dlen >= 3 && memcmp(data, "\xEF\xBB\xBF", 3) == 0 ? 3 : 0;
    for (size_t pos = start; pos < dlen;) {
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
    snprintf(f.owner, sizeof(f.owner), "%s", who->owner ? who->owner : "");
    batch_make_id(f.id, sizeof(f.id), "file-");
    snprintf(f.purpose, sizeof(f.purpose), "batch");
    snprintf(f.filename, sizeof(f.filename), "%s", filename);
    /* the client's name for it, cut at a byte count: valid UTF-8 (a byte that starts no
     * character becomes '?', a character cut at the end is dropped), as the file object
     * must be JSON text */
    api_utf8_trim(f.filename);
    if (store_file_put(b->store, &f, data, dlen) < 0) {
        reply_err(req, 500, NULL, "storage_error", "The file could not be saved.");
        return;
    }
    log_info("file %s uploaded: %s, %zu bytes, %ld lines, key %s", f.id, f.filename, dlen,
             n_lines, who_str(who));
    json_t *o = file_json(&f);
    reply_obj(req, 200, o);
    json_decref(o);
}

static void handle_file(batch_t *b, struct evhttp_request *req, const char *id, int content,
                        const batch_caller *who)
{
    store_file f;
    int rc = store_file_get(b->store, id, &f);
    if (rc > 0 || (rc == 0 && !visible(who, f.owner))) {
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
    if (batch_download_start(b, req, &f) < 0)
        reply_err(req, 500, NULL, "server_error", "out of memory");
}

/* OpenAI's file purposes: a list may ask for any of them (this server stores only "batch"
 * and "batch_output": the others list nothing); another value is 400. */
static const char *const purposes[] = {"assistants", "assistants_output", "batch",
                                       "batch_output", "fine-tune", "fine-tune-results",
                                       "vision", "user_data", "evals"};

static int add_file(const store_file *f, void *ud)
{
    return json_array_append_new(ud, file_json(f)) < 0;
}

/* GET /v1/files[?purpose=P&limit=N&order=asc|desc&after=ID]: the caller's files, newest
 * first unless order=asc, OpenAI's list object. */
static void handle_file_list(batch_t *b, struct evhttp_request *req, const batch_caller *who)
{
    const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri(req);
    const char *qs = uri ? evhttp_uri_get_query(uri) : NULL;
    struct evkeyvalq kv; /* initialized by evhttp_parse_query_str, also when it fails */
    if (evhttp_parse_query_str(qs ? qs : "", &kv) < 0) {
        reply_err(req, 400, NULL, "invalid_value",
                  "The query string could not be parsed (each parameter must be name=value).");
        return;
    }
    store_file_query q = {.desc = 1, .limit = 10000,
                          .owner = who->see_all ? NULL : who->owner ? who->owner : ""};
    const char *v;
    if ((v = evhttp_find_header(&kv, "limit"))) {
        char *end;
        long l = strtol(v, &end, 10);
        if (!v[0] || *end || l < 1 || l > 10000) {
            reply_err(req, 400, "limit", "invalid_value",
                      "'limit' must be an integer from 1 to 10000, got '%.40s'.", v);
            goto out;
        }
        q.limit = (int)l;
    }
    if ((v = evhttp_find_header(&kv, "order"))) {
        if (strcmp(v, "asc") && strcmp(v, "desc")) {
            reply_err(req, 400, "order", "invalid_value",
                      "'order' must be 'asc' or 'desc', got '%.40s'.", v);
            goto out;
        }
        q.desc = strcmp(v, "desc") == 0;
    }
    if ((v = evhttp_find_header(&kv, "purpose"))) {
        size_t i = 0;
        while (i < sizeof(purposes) / sizeof(purposes[0]) && strcmp(v, purposes[i]))
            i++;
        if (i == sizeof(purposes) / sizeof(purposes[0])) {
            reply_err(req, 400, "purpose", "invalid_value",
                      "'purpose' must be one of assistants, assistants_output, batch, "
                      "batch_output, fine-tune, fine-tune-results, vision, user_data, evals; got "
                      "'%.40s'.",
                      v);
            goto out;
        }
        q.purpose = v;
    }
    if ((v = evhttp_find_header(&kv, "after"))) {
        if (!v[0] || strlen(v) >= sizeof(((store_file *)0)->id)) {
            reply_err(req, 400, "after", "invalid_value", "'after' must be a file id.");
            goto out;
        }
        q.after = v;
    }
    json_t *data = json_array();
    int has_more = 0;
    int rc = data ? store_file_list(b->store, &q, add_file, data, &has_more) : -1;
    if (rc != 0) {
        if (rc > 0)
            reply_err(req, 404, "after", "file_not_found", "No such File object: %.100s",
                      q.after);
        else
            reply_err(req, 500, NULL, "storage_error", "The files could not be listed.");
        json_decref(data);
        goto out;
    }
    size_t n = json_array_size(data);
    json_t *o = json_pack(
        "{s:s, s:o, s:o, s:o, s:b}", "object", "list", "data", data, "first_id",
        n ? json_incref(json_object_get(json_array_get(data, 0), "id")) : json_null(), "last_id",
        n ? json_incref(json_object_get(json_array_get(data, n - 1), "id")) : json_null(),
        "has_more", has_more);
    reply_obj(req, 200, o);
    json_decref(o);
out:
    evhttp_clear_headers(&kv);
}

/* DELETE /v1/files/{id}. A file that a batch which is not final names (its input file, or
 * a result file written while it finalizes) is refused with 409 file_in_use: the batch
 * reads its input file again whenever the gateway restarts (resume), and the answer
 * "deleted" must mean the bytes are gone. Deleting a final batch's output or error file
 * also deletes the batch's stored results of that kind (they hold the same lines). */
static void handle_file_delete(batch_t *b, struct evhttp_request *req, const char *id,
                               const batch_caller *who)
{
    store_file f;
    int rc = store_file_get(b->store, id, &f);
    if (rc > 0 || (rc == 0 && !visible(who, f.owner))) {
        reply_err(req, 404, "file_id", "file_not_found", "No such File object: %.100s", id);
        return;
    }
    if (rc < 0) {
        reply_err(req, 500, NULL, "storage_error", "The file could not be read.");
        return;
    }
    static const char *const keys[] = {"input_file_id", "output_file_id", "error_file_id"};
    const char *results_of = NULL;
    int ok = 0;
    for (int i = 0; i < b->n_jobs; i++) {
        job_t *j = b->jobs[i];
        for (int k = 0; k < 3; k++) {
            const char *v = json_string_value(json_object_get(j->obj, keys[k]));
            if (!v || strcmp(v, id) != 0)
                continue;
            if (!is_final(j->status)) {
                reply_err(req, 409, "file_id", "file_in_use",
                          "The file %.100s is the %s file of batch %s, which is %s: cancel the "
                          "batch or wait until it ends, then delete the file.",
                          id, k == 0 ? "input" : k == 1 ? "output" : "error", j->id,
                          batch_status_names[j->status]);
                return;
            }
            if (k > 0) {
                results_of = j->id;
                ok = k == 1;
            }
        }
    }
    rc = store_file_delete(b->store, id, results_of, ok);
    if (rc != 0) {
        if (rc > 0)
            reply_err(req, 404, "file_id", "file_not_found", "No such File object: %.100s", id);
        else
            reply_err(req, 500, NULL, "storage_error", "The file could not be deleted.");
        return;
    }
    log_info("file %s deleted (%s, %lld bytes%s%s), key %s", id, f.purpose, (long long)f.bytes,
             results_of ? ", and the stored results of batch " : "",
             results_of ? results_of : "", who_str(who));
    json_t *o = json_pack("{s:s, s:s, s:b}", "id", id, "object", "file", "deleted", 1);
    reply_obj(req, 200, o);
    json_decref(o);
}

// --- HTTP: batches

/* Batch id if who may see it, else NULL. */
static job_t *job_find(batch_t *b, const char *id, const batch_caller *who)
{
    for (int i = 0; i < b->n_jobs; i++)
        if (strcmp(b->jobs[i]->id, id) == 0)
            return visible(who, b->jobs[i]->owner) ? b->jobs[i] : NULL;
    return NULL;
}

static void handle_create(batch_t *b, struct evhttp_request *req, const batch_caller *who)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    if (len > b->cx.max_body) {
        reply_err(req, 413, NULL, "request_too_large",
                  "The request body is %zu bytes; the limit is %zu bytes.", len, b->cx.max_body);
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
    if (rc == 0 && !visible(who, f.owner))
        rc = 1; /* another key's file: as if there were none */
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
    batch_make_id(j->id, sizeof(j->id), "batch_");
    snprintf(j->owner, sizeof(j->owner), "%s", who->owner ? who->owner : "");
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
    if (!j->obj || batch_job_add(b, j) < 0) {
        json_decref(j->obj);
        free(j);
        reply_err(req, 500, NULL, NULL, "out of memory");
        goto out;
    }
    if (!json_object_get(j->obj, "metadata"))
        json_object_set_new(j->obj, "metadata", json_null());
    j->status = ST_VALIDATING;
    j->dirty = 1;
    batch_load_waiting(b); /* j too, unless the batches before it hold too much */
    if (j->active) {
        json_object_set_new(
            j->obj, "request_counts",
            json_pack("{s:i, s:i, s:i}", "total", j->n_lines, "completed", 0, "failed", 0));
    }
    if (j->active || is_final(j->status))
        log_info("batch %s created: %s, file %s, %d lines, key %s", j->id, json_string_value(ep),
                 f.id, j->n_lines, who_str(who));
    else
        log_info("batch %s created: %s, file %s (%lld bytes; waiting: the batches before it "
                 "hold %zu bytes of input files), key %s",
                 j->id, json_string_value(ep), f.id, (long long)f.bytes, b->loaded_bytes,
                 who_str(who));
    kick(b);
    reply_obj(req, 200, j->obj);
out:
    json_decref(root);
}

static void handle_list(batch_t *b, struct evhttp_request *req, const batch_caller *who)
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
            if (strcmp(b->jobs[i]->id, after) == 0 && visible(who, b->jobs[i]->owner))
                start = i - 1;
        if (start == -2) {
            reply_err(req, 404, "after", "batch_not_found", "No such batch: %.100s", after);
            return;
        }
    }
    json_t *data = json_array();
    int i;
    for (i = start; i >= 0 && (long)json_array_size(data) < limit; i--)
        if (visible(who, b->jobs[i]->owner))
            json_array_append(data, b->jobs[i]->obj);
    while (i >= 0 && !visible(who, b->jobs[i]->owner)) /* has_more: a visible one is left */
        i--;
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
                  batch_status_names[j->status]);
        return;
    }
    if (j->status != ST_CANCELLING) {
        batch_job_stop_lines(b, j);
        batch_job_status(b, j, ST_CANCELLING, "cancelling_at");
    }
    reply_obj(req, 200, j->obj);
}

void batch_handle(batch_t *b, struct evhttp_request *req, batch_route_t route, const char *id,
                  const batch_caller *caller)
{
    static const batch_caller anyone = {NULL, 1};
    const batch_caller *who = caller ? caller : &anyone;
    enum evhttp_cmd_type m = evhttp_request_get_command(req);
    switch (route) {
    case BATCH_ROUTE_FILES:
        if (m == EVHTTP_REQ_POST)
            handle_upload(b, req, who);
        else
            handle_file_list(b, req, who);
        return;
    case BATCH_ROUTE_FILE:
        if (m == EVHTTP_REQ_DELETE) {
            handle_file_delete(b, req, id ? id : "", who);
            return;
        }
        /* fall through */
    case BATCH_ROUTE_FILE_CONTENT:
        handle_file(b, req, id ? id : "", route == BATCH_ROUTE_FILE_CONTENT, who);
        return;
    case BATCH_ROUTE_BATCHES:
        if (m == EVHTTP_REQ_POST)
            handle_create(b, req, who);
        else
            handle_list(b, req, who);
        return;
    case BATCH_ROUTE_BATCH:
    case BATCH_ROUTE_CANCEL: {
        job_t *j = id ? job_find(b, id, who) : NULL;
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
