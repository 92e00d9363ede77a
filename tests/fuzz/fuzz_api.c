/*
 * fuzz_api: HTTP request bodies (gateway/api.c): api_parse for /v1/completions and
 * /v1/chat/completions, then what the gateway does next (api_check_model, api_check_length,
 * the response and chunk bodies) and, on every error, the OpenAI error object.
 *
 * Input: byte 0 picks the endpoint (bit 0: chat, else bit 4: responses) and the figures
 * given to api_check_length; the rest is the body. Properties: every error has a 4xx status, a type, and an error body
 * that is valid JSON whose message is the error's (never the "out of memory" fallback);
 * a parsed request's prompt is valid UTF-8 of prompt_len bytes (or token ids, none
 * negative) and formats into a response and a chunk, and api_format_text_chunk gives that
 * chunk's bytes exactly.
 */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "fuzz_common.h"

static void check_error(const api_error *e)
{
    FUZZ_CHECK(e->status >= 400 && e->status < 500);
    FUZZ_CHECK(e->type != NULL);
    FUZZ_CHECK(memchr(e->message, 0, sizeof(e->message)) != NULL);
    FUZZ_CHECK(api_utf8_valid(e->message, strlen(e->message)));
    char *body = api_error_json(e);
    FUZZ_CHECK(body != NULL);
    json_t *root = json_loads(body, 0, NULL);
    FUZZ_CHECK(root != NULL);
    json_t *inner = json_object_get(root, "error");
    FUZZ_CHECK(json_is_string(json_object_get(inner, "message")));
    FUZZ_CHECK(strcmp(json_string_value(json_object_get(inner, "message")), e->message) == 0);
    FUZZ_CHECK(json_is_string(json_object_get(inner, "type")));
    json_decref(root);
    free(body);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    api_kind_t kind = (data[0] & 1)    ? API_CHAT
                      : (data[0] & 16) ? API_RESPONSES
                                       : API_COMPLETIONS;
    int n_ctx = 1 + ((data[0] >> 1) & 7) * 73;
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    api_request r;
    api_error e;
    memset(&e, 0, sizeof(e));
    if (api_parse(kind, body, len, &r, &e) < 0) {
        FUZZ_CHECK(r.prompt == NULL && r.model == NULL && r.n_stop == 0);
        check_error(&e);
        return 0;
    }
    /* every prompt of a batch: text (valid UTF-8, non-empty) or ids (>= 1, none negative) */
    FUZZ_CHECK(r.n_prompts >= 1 && r.n_prompts <= API_MAX_PROMPTS && r.n >= 1 &&
               r.n * r.n_prompts <= API_MAX_CHOICES);
    for (int i = 1; i < r.n_prompts; i++) {
        api_prompt p = api_request_prompt(&r, i);
        FUZZ_CHECK(p.text ? p.len >= 1 && api_utf8_valid(p.text, p.len) && !p.ids
                          : p.ids && p.n_ids >= 1);
        for (int k = 0; p.ids && k < p.n_ids; k++)
            FUZZ_CHECK(p.ids[k] >= 0);
    }
    if (r.prompt_ids) { /* a token-id prompt: ids only, at least one, none negative */
        FUZZ_CHECK(r.prompt == NULL && r.prompt_len == 0 && r.n_prompt_ids >= 1);
        for (int i = 0; i < r.n_prompt_ids; i++)
            FUZZ_CHECK(r.prompt_ids[i] >= 0);
        r.prompt = strdup("ids"); /* the text the rest formats (freed by api_request_free) */
        FUZZ_CHECK(r.prompt != NULL);
        r.prompt_len = 3;
    }
    FUZZ_CHECK(r.prompt != NULL && strlen(r.prompt) == r.prompt_len);
    FUZZ_CHECK(api_utf8_valid(r.prompt, r.prompt_len));
    FUZZ_CHECK(r.n_stop >= 0 && r.n_stop <= API_MAX_STOP);
    for (int i = 0; i < r.n_stop; i++)
        FUZZ_CHECK(r.stop[i] && r.stop[i][0] && api_utf8_valid(r.stop[i], strlen(r.stop[i])));
    if (api_check_model(&r, "stories260K", &e) < 0) {
        FUZZ_CHECK(e.status == 404);
        check_error(&e);
    }
    int n_prompt = (int)(r.prompt_len / 3) + 1; /* a stand-in for the token count */
    if (api_check_length(&r, n_prompt, n_ctx, &e) < 0)
        check_error(&e);
    else
        FUZZ_CHECK(r.max_tokens >= 1 && n_prompt + r.max_tokens <= n_ctx);
    api_response_info info = {.kind = kind, .id = "cmpl-fuzz", .created = 1, .model = "m",
                              .include_usage = r.include_usage,
                              .service_tier = r.offline ? "flex" : NULL};
    char *s = api_format_response(&info, r.prompt, r.prompt_len, API_FINISH_STOP, n_prompt, 1);
    FUZZ_CHECK(s != NULL);
    free(s);
    s = api_format_chunk(&info, r.prompt, r.prompt_len, NULL, kind == API_CHAT);
    FUZZ_CHECK(s != NULL);
    free(s);
    /* the per-token formatter gives api_format_chunk's bytes exactly */
    s = api_format_chunk(&info, r.prompt, r.prompt_len, NULL, 0);
    char *fast = malloc(api_text_chunk_bound(&info, r.prompt_len));
    FUZZ_CHECK(s != NULL && fast != NULL);
    size_t n = api_format_text_chunk(&info, r.prompt, r.prompt_len, fast);
    FUZZ_CHECK(n == strlen(s) && memcmp(fast, s, n + 1) == 0);
    free(fast);
    free(s);
    api_request_free(&r);
    return 0;
}
