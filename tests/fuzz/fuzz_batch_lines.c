/*
 * fuzz_batch_lines: Batch API input files (gateway/batch.c, batch_lines.c): the file is
 * split into lines (batch_job_split_lines), each line is parsed and checked
 * (batch_line_parse), custom_ids are checked for duplicates as validation does, a line's
 * body goes through api_parse as its completion would, and every failure gets its result
 * record (batch_line_error_record, batch_line_error_response_record) as the error file
 * would. Input: byte 0 bit 0 picks the batch's endpoint (chat or completions), the rest is
 * the file. Properties: lines lie inside the file, are non-empty and trimmed; every failed
 * line has a record that serialises, with the message and code it was given (an error
 * response record carries the error object, never an empty body).
 */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "batch_internal.h"
#include "fuzz_common.h"

static void check_record(json_t *rec, const char *code)
{
    FUZZ_CHECK(rec != NULL);
    char *s = json_dumps(rec, JSON_COMPACT);
    FUZZ_CHECK(s != NULL);
    free(s);
    json_t *err = json_object_get(rec, "error");
    if (code) {
        FUZZ_CHECK(strcmp(json_string_value(json_object_get(err, "code")), code) == 0);
        FUZZ_CHECK(json_is_string(json_object_get(err, "message")));
    } else {
        json_t *body = json_object_get(json_object_get(rec, "response"), "body");
        json_t *msg = json_object_get(json_object_get(body, "error"), "message");
        FUZZ_CHECK(json_is_string(msg));
    }
    json_decref(rec);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    job_t j;
    memset(&j, 0, sizeof(j));
    j.kind = (data[0] & 1) ? API_CHAT : API_COMPLETIONS;
    j.content_len = size - 1;
    j.content = malloc(j.content_len ? j.content_len : 1);
    FUZZ_CHECK(j.content != NULL);
    memcpy(j.content, data + 1, j.content_len);
    FUZZ_CHECK(batch_job_split_lines(&j) == 0);
    json_t *seen = json_object();
    FUZZ_CHECK(seen != NULL);
    for (int i = 0; i < j.n_lines; i++) {
        FUZZ_CHECK(j.len[i] > 0 && j.off[i] <= j.content_len &&
                   j.len[i] <= j.content_len - j.off[i]);
        const char *s = j.content + j.off[i];
        FUZZ_CHECK(s[0] != ' ' && s[0] != '\t' && s[j.len[i] - 1] != '\r');
        FUZZ_CHECK(memchr(s, '\n', j.len[i]) == NULL);
        FUZZ_CHECK(j.line_no[i] >= i + 1 && (i == 0 || j.line_no[i] > j.line_no[i - 1]));
        const char *cid, *code = NULL;
        json_t *body;
        char msg[300];
        json_t *root = batch_line_parse(&j, i, &cid, &body, &code, msg, sizeof(msg));
        int dup = body && json_object_get(seen, cid);
        if (body && !dup)
            json_object_set_new(seen, cid, json_true());
        if (dup) {
            check_record(
                batch_line_error_record(j.line_no[i], cid, "duplicate_custom_id", "a duplicate"),
                "duplicate_custom_id");
        } else if (!body) {
            FUZZ_CHECK(code != NULL && memchr(msg, 0, sizeof(msg)) != NULL);
            check_record(batch_line_error_record(j.line_no[i], cid, code, msg), code);
        } else {
            char *text = json_dumps(body, JSON_COMPACT);
            FUZZ_CHECK(text != NULL);
            api_request r;
            api_error e;
            if (api_parse(j.kind, text, strlen(text), &r, &e) < 0)
                check_record(batch_line_error_response_record(cid, NULL, &e), NULL);
            else
                api_request_free(&r);
            free(text);
        }
        json_decref(root);
    }
    json_decref(seen);
    free(j.off);
    free(j.len);
    free(j.line_no);
    free(j.state);
    free(j.content);
    return 0;
}
