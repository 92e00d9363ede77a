/* responses: see responses.h. Shapes follow OpenAI's Responses API reference (the
 * response object, the message output item with one output_text part, the streaming
 * events); fields this server has no use for (tools, reasoning, truncation, ...) carry
 * their defaults so that SDKs parse the object as they parse OpenAI's. */
#include "responses.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

static char *dump(json_t *root)
{
    if (!root)
        return NULL;
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}

const char *responses_status(const char *finish_reason)
{
    return finish_reason && strcmp(finish_reason, API_FINISH_LENGTH) == 0 ? RESPONSES_INCOMPLETE
                                                                          : RESPONSES_COMPLETED;
}

/* {"type": "output_text", "text", "annotations": [], "logprobs": []} */
static json_t *text_part(const char *text, size_t len)
{
    json_t *t = json_stringn(text ? text : "", text ? len : 0);
    if (!t)
        return NULL;
    return json_pack("{s:s, s:o, s:[], s:[]}", "type", "output_text", "text", t, "annotations",
                     "logprobs");
}

/* The assistant message; content NULL: none yet ([]). status "in_progress" / "completed" /
 * "incomplete". */
static json_t *message_item(const responses_info *info, const char *status, json_t *content)
{
    json_t *arr = json_array();
    if (!arr)
        return NULL;
    if (content && json_array_append_new(arr, content) < 0) {
        json_decref(arr);
        return NULL;
    }
    return json_pack("{s:s, s:s, s:s, s:s, s:o}", "id", info->item_id, "type", "message", "status",
                     status, "role", "assistant", "content", arr);
}

static json_t *response_obj(const responses_info *info, const char *status, const char *text,
                            size_t len, int n_input, int n_output, const api_error *err)
{
    int running = strcmp(status, RESPONSES_IN_PROGRESS) == 0;
    int failed = strcmp(status, RESPONSES_FAILED) == 0;
    json_t *output = json_array();
    if (!output)
        return NULL;
    if (!running && !failed) {
        json_t *item = message_item(info, status, text_part(text, len));
        if (!item || json_array_append_new(output, item) < 0) {
            json_decref(output);
            return NULL;
        }
    }
    json_t *usage = running || failed
                        ? json_null()
                        : json_pack("{s:i, s:{s:i}, s:i, s:{s:i}, s:i}", "input_tokens", n_input,
                                    "input_tokens_details", "cached_tokens", 0, "output_tokens",
                                    n_output, "output_tokens_details", "reasoning_tokens", 0,
                                    "total_tokens", n_input + n_output);
    json_t *error = failed && err
                        ? json_pack("{s:s, s:s}", "code", err->code ? err->code : "server_error",
                                    "message", err->message)
                        : json_null();
    json_t *incomplete = strcmp(status, RESPONSES_INCOMPLETE) == 0
                             ? json_pack("{s:s}", "reason", "max_output_tokens")
                             : json_null();
    json_t *root = json_pack(
        "{s:s, s:s, s:I, s:s, s:o, s:o, s:s?, s:o, s:s, s:o, s:b, s:n, s:{s:n, s:n}, s:b, "
        "s:f, s:{s:{s:s}}, s:s, s:[], s:f, s:s, s:o, s:n, s:{}}",
        "id", info->id, "object", "response", "created_at", (json_int_t)info->created_at, "status",
        status, "error", error, "incomplete_details", incomplete, "instructions",
        info->instructions, "max_output_tokens",
        info->max_output_tokens >= 0 ? json_integer(info->max_output_tokens) : json_null(), "model",
        info->model, "output", output, "parallel_tool_calls", 1, "previous_response_id",
        "reasoning", "effort", "summary", "store", info->store, "temperature", info->temperature,
        "text", "format", "type", "text", "tool_choice", "auto", "tools", "top_p", info->top_p,
        "truncation", "disabled", "usage", usage, "user", "metadata");
    if (root && info->service_tier)
        json_object_set_new(root, "service_tier", json_string(info->service_tier));
    return root;
}

char *responses_format_object(const responses_info *info, const char *status, const char *text,
                              size_t len, int n_input, int n_output, const api_error *err)
{
    return dump(response_obj(info, status, text, len, n_input, n_output, err));
}

char *responses_event_response(const responses_info *info, const char *type, int seq,
                               const char *status, const char *text, size_t len, int n_input,
                               int n_output, const api_error *err)
{
    json_t *r = response_obj(info, status, text, len, n_input, n_output, err);
    if (!r)
        return NULL;
    return dump(json_pack("{s:s, s:i, s:o}", "type", type, "sequence_number", seq, "response", r));
}

char *responses_event_item(const responses_info *info, const char *status, int seq,
                           const char *text, size_t len)
{
    int done = strcmp(status, RESPONSES_IN_PROGRESS) != 0;
    json_t *item = done ? message_item(info, status, text_part(text, len))
                        : message_item(info, RESPONSES_IN_PROGRESS, NULL);
    if (!item)
        return NULL;
    return dump(json_pack("{s:s, s:i, s:i, s:o}", "type",
                          done ? "response.output_item.done" : "response.output_item.added",
                          "sequence_number", seq, "output_index", 0, "item", item));
}

char *responses_event_part(const responses_info *info, int done, int seq, const char *text,
                           size_t len)
{
    json_t *part = text_part(done ? text : "", done ? len : 0);
    if (!part)
        return NULL;
    return dump(json_pack("{s:s, s:i, s:s, s:i, s:i, s:o}", "type",
                          done ? "response.content_part.done" : "response.content_part.added",
                          "sequence_number", seq, "item_id", info->item_id, "output_index", 0,
                          "content_index", 0, "part", part));
}

char *responses_event_text(const responses_info *info, int done, int seq, const char *text,
                           size_t len)
{
    json_t *t = json_stringn(text ? text : "", text ? len : 0);
    if (!t)
        return NULL;
    return dump(json_pack("{s:s, s:i, s:s, s:i, s:i, s:o, s:[]}", "type",
                          done ? "response.output_text.done" : "response.output_text.delta",
                          "sequence_number", seq, "item_id", info->item_id, "output_index", 0,
                          "content_index", 0, done ? "text" : "delta", t, "logprobs"));
}

char *responses_event_error(int seq, const api_error *err)
{
    return dump(json_pack("{s:s, s:i, s:s, s:s, s:s?}", "type", "error", "sequence_number", seq,
                          "code", err->code ? err->code : "server_error", "message", err->message,
                          "param", err->param));
}
