/*
 * test_gateway_api: the gateway's request validation (gateway/api.c), response formats,
 * and incremental detokenization with stop strings (gateway/stream.c).
 *
 * Validation is one table: every bad input of docs/api.md → HTTP status, error param and
 * code. The stream tests use a tiny tokenizer written to a temporary GGUF file, with byte
 * tokens so that a UTF-8 character can be split across tokens.
 *
 *   build/tests/test_gateway_api [case-name-filter]
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "api.h"
#include "gguf.h"
#include "stream.h"
#include "tokenizer.h"

// --- validation table

typedef struct {
    const char *name;
    api_kind_t kind;
    const char *body;  /* NULL: use raw/raw_len */
    int status;        /* 0 = valid */
    const char *param; /* expected error param (NULL = null) */
    const char *code;  /* expected error code */
} vcase;

#define C API_COMPLETIONS
#define CH API_CHAT
#define R API_RESPONSES
/* a chat body's start: one user message, then the fields of the case */
#define MSG_X "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
static const vcase cases[] = {
    /* body shape */
    {"not json", C, "{\"prompt\": \"hi\"", 400, NULL, "invalid_json"},
    {"empty body", C, "", 400, NULL, "invalid_json"},
    {"array body", C, "[{\"prompt\": \"hi\"}]", 400, NULL, "invalid_type"},
    {"string body", C, "\"hi\"", 400, NULL, "invalid_type"},
    {"duplicate key", C, "{\"prompt\": \"a\", \"prompt\": \"b\"}", 400, NULL, "invalid_json"},
    {"nul escape", C, "{\"prompt\": \"a\\u0000b\"}", 400, NULL, "invalid_json"},
    /* prompt / messages */
    {"prompt missing", C, "{\"max_tokens\": 5}", 400, "prompt", "missing_required_parameter"},
    {"prompt null", C, "{\"prompt\": null}", 400, "prompt", "missing_required_parameter"},
    {"prompt int", C, "{\"prompt\": 5}", 400, "prompt", "invalid_type"},
    {"prompt empty", C, "{\"prompt\": \"\"}", 400, "prompt", "invalid_value"},
    {"prompt object", C, "{\"prompt\": {}}", 400, "prompt", "invalid_type"},
    {"prompt two strings", C, "{\"prompt\": [\"a\", \"b\"]}", 0, NULL, NULL},
    /* llama-server's mix of text and token-id prompts in one batch (OpenAI's schema has not) */
    {"prompt batch string and ids", C, "{\"prompt\": [\"a\", [5, 6]]}", 0, NULL, NULL},
    {"prompt batch int element", C, "{\"prompt\": [\"a\", 5]}", 400, "prompt", "invalid_type"},
    {"prompt batch empty string", C, "{\"prompt\": [\"a\", \"\"]}", 400, "prompt",
     "invalid_value"},
    {"prompt batch empty ids", C, "{\"prompt\": [[5], []]}", 400, "prompt", "invalid_value"},
    {"prompt batch bad id", C, "{\"prompt\": [[5], [6, -1]]}", 400, "prompt", "invalid_value"},
    {"prompt batch nested too deep", C, "{\"prompt\": [[5], [[6]]]}", 400, "prompt",
     "invalid_value"},
    {"prompt empty array", C, "{\"prompt\": []}", 400, "prompt", "invalid_value"},
    {"prompt token ids", C, "{\"prompt\": [5, 7, 1]}", 0, NULL, NULL},
    {"prompt nested token ids", C, "{\"prompt\": [[5, 7]]}", 0, NULL, NULL},
    {"prompt token id negative", C, "{\"prompt\": [5, -1]}", 400, "prompt", "invalid_value"},
    {"prompt token id float", C, "{\"prompt\": [5, 1.5]}", 400, "prompt", "invalid_value"},
    {"prompt token id huge", C, "{\"prompt\": [4294967296]}", 400, "prompt", "invalid_value"},
    {"prompt token ids and string", C, "{\"prompt\": [5, \"a\"]}", 400, "prompt",
     "invalid_value"},
    {"prompt two id arrays", C, "{\"prompt\": [[5], [6]]}", 0, NULL, NULL},
    {"prompt empty id array", C, "{\"prompt\": [[]]}", 400, "prompt", "invalid_value"},
    {"prompt array empty string", C, "{\"prompt\": [\"\"]}", 400, "prompt", "invalid_value"},
    {"messages missing", CH, "{\"prompt\": \"hi\"}", 400, "messages", "missing_required_parameter"},
    {"messages string", CH, "{\"messages\": \"hi\"}", 400, "messages", "invalid_type"},
    {"messages empty", CH, "{\"messages\": []}", 400, "messages", "invalid_value"},
    {"message not object", CH, "{\"messages\": [\"hi\"]}", 400, "messages", "invalid_type"},
    {"message bad role", CH, "{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}", 400,
     "messages", "invalid_value"},
    {"message no role", CH, "{\"messages\": [{\"content\": \"x\"}]}", 400, "messages",
     "invalid_value"},
    {"message content int", CH, "{\"messages\": [{\"role\": \"user\", \"content\": 5}]}", 400,
     "messages", "invalid_type"},
    {"message content empty array", CH, "{\"messages\": [{\"role\": \"user\", \"content\": []}]}",
     400, "messages", "empty_array"},
    {"message image part", CH,
     "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}", 400,
     "messages", "unsupported_value"},
    {"message audio part", CH,
     "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"a\"}, "
     "{\"type\": \"input_audio\", \"input_audio\": {}}]}]}",
     400, "messages", "unsupported_value"},
    {"message unknown part", CH,
     "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"video\"}]}]}", 400,
     "messages", "invalid_value"},
    {"message text part without text", CH,
     "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\"}]}]}", 400,
     "messages", "invalid_value"},
    /* the Responses API */
    {"responses string", R, "{\"input\": \"hi\", \"store\": false}", 0, NULL, NULL},
    {"responses parts", R,
     "{\"input\": [{\"type\": \"message\", \"role\": \"user\", \"content\": [{\"type\": "
     "\"input_text\", \"text\": \"a\"}]}]}",
     0, NULL, NULL},
    {"responses chat part", R,
     "{\"input\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"a\"}]}]}",
     400, "input", "invalid_value"},
    {"responses image part", R,
     "{\"input\": [{\"role\": \"user\", \"content\": [{\"type\": \"input_image\", "
     "\"image_url\": \"https://x/y.png\"}]}]}",
     400, "input", "unsupported_value"},
    {"responses file part", R,
     "{\"input\": [{\"role\": \"user\", \"content\": [{\"type\": \"input_file\"}]}]}", 400,
     "input", "unsupported_value"},
    {"responses no input", R, "{\"instructions\": \"x\"}", 400, "input",
     "missing_required_parameter"},
    {"responses empty list", R, "{\"input\": []}", 400, "input", "invalid_value"},
    {"responses tool item", R, "{\"input\": [{\"type\": \"function_call\"}]}", 400, "input",
     "unsupported_value"},
    {"responses previous id", R, "{\"input\": \"x\", \"previous_response_id\": \"r\"}", 400,
     "previous_response_id", "unsupported_parameter"},
    {"responses tools", R, "{\"input\": \"x\", \"tools\": [{}]}", 400, "tools",
     "unsupported_parameter"},
    {"responses empty tools", R, "{\"input\": \"x\", \"tools\": []}", 0, NULL, NULL},
    {"responses max_output_tokens 0", R, "{\"input\": \"x\", \"max_output_tokens\": 0}", 400,
     "max_output_tokens", "invalid_value"},
    {"responses text format", R, "{\"input\": \"x\", \"text\": {\"format\": {\"type\": "
     "\"json_object\"}}}", 400, "text", "unsupported_parameter"},
    {"responses store string", R, "{\"input\": \"x\", \"store\": 1}", 400, "store",
     "invalid_type"},
    /* max_tokens */
    {"max_tokens -1", C, "{\"prompt\": \"hi\", \"max_tokens\": -1}", 400, "max_tokens",
     "invalid_value"},
    {"max_tokens 0", C, "{\"prompt\": \"hi\", \"max_tokens\": 0}", 400, "max_tokens",
     "invalid_value"},
    {"max_tokens 1.5", C, "{\"prompt\": \"hi\", \"max_tokens\": 1.5}", 400, "max_tokens",
     "invalid_type"},
    {"max_tokens string", C, "{\"prompt\": \"hi\", \"max_tokens\": \"10\"}", 400, "max_tokens",
     "invalid_type"},
    {"max_tokens huge", C, "{\"prompt\": \"hi\", \"max_tokens\": 99999999999}", 400, "max_tokens",
     "invalid_value"},
    {"max_completion_tokens 0", CH,
     MSG_X "\"max_completion_tokens\": 0}",
     400, "max_completion_tokens", "invalid_value"},
    /* sampling */
    {"temperature string", C, "{\"prompt\": \"hi\", \"temperature\": \"hot\"}", 400, "temperature",
     "invalid_type"},
    {"temperature high", C, "{\"prompt\": \"hi\", \"temperature\": 2.5}", 400, "temperature",
     "invalid_value"},
    {"temperature negative", C, "{\"prompt\": \"hi\", \"temperature\": -0.1}", 400, "temperature",
     "invalid_value"},
    {"top_p zero", C, "{\"prompt\": \"hi\", \"top_p\": 0}", 400, "top_p", "invalid_value"},
    {"top_p high", C, "{\"prompt\": \"hi\", \"top_p\": 1.5}", 400, "top_p", "invalid_value"},
    {"top_k float", C, "{\"prompt\": \"hi\", \"top_k\": 1.5}", 400, "top_k", "invalid_type"},
    {"top_k -2", C, "{\"prompt\": \"hi\", \"top_k\": -2}", 400, "top_k", "invalid_value"},
    {"seed string", C, "{\"prompt\": \"hi\", \"seed\": \"x\"}", 400, "seed", "invalid_type"},
    /* stop */
    {"stop int", C, "{\"prompt\": \"hi\", \"stop\": 5}", 400, "stop", "invalid_type"},
    {"stop list int", C, "{\"prompt\": \"hi\", \"stop\": [\"a\", 1]}", 400, "stop", "invalid_type"},
    {"stop five", C, "{\"prompt\": \"hi\", \"stop\": [\"a\",\"b\",\"c\",\"d\",\"e\"]}", 400, "stop",
     "invalid_value"},
    {"stop empty string", C, "{\"prompt\": \"hi\", \"stop\": [\"\"]}", 400, "stop",
     "invalid_value"},
    /* stream, n, others */
    {"stream string", C, "{\"prompt\": \"hi\", \"stream\": \"yes\"}", 400, "stream",
     "invalid_type"},
    {"stream int", C, "{\"prompt\": \"hi\", \"stream\": 1}", 400, "stream", "invalid_type"},
    {"stream_options string", C, "{\"prompt\": \"hi\", \"stream_options\": \"x\"}", 400,
     "stream_options", "invalid_type"},
    /* only with stream, as OpenAI and vLLM (null is absent) */
    {"stream_options without stream", C,
     "{\"prompt\": \"hi\", \"stream_options\": {\"include_usage\": true}}", 400,
     "stream_options", "invalid_value"},
    {"stream_options stream false", CH,
     "{\"messages\": [{\"role\": \"user\", \"content\": \"U\"}], \"stream\": false, "
     "\"stream_options\": {}}",
     400, "stream_options", "invalid_value"},
    {"stream_options null without stream", C, "{\"prompt\": \"hi\", \"stream_options\": null}",
     0, NULL, NULL},
    {"n 2", C, "{\"prompt\": \"hi\", \"n\": 2}", 0, NULL, NULL},
    {"n 128", CH, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"n\": 128}", 0,
     NULL, NULL},
    {"n 129", C, "{\"prompt\": \"hi\", \"n\": 129}", 400, "n", "invalid_value"},
    {"n 1.5", C, "{\"prompt\": \"hi\", \"n\": 1.5}", 400, "n", "invalid_type"},
    {"n x prompts over 256", C, "{\"prompt\": [\"a\", \"b\", \"c\"], \"n\": 100}", 400, "n",
     "invalid_value"},
    {"best_of n", C, "{\"prompt\": \"hi\", \"n\": 3, \"best_of\": 3}", 0, NULL, NULL},
    {"best_of below n", C, "{\"prompt\": \"hi\", \"n\": 3, \"best_of\": 2}", 400, "best_of",
     "invalid_value"},
    {"n 0", C, "{\"prompt\": \"hi\", \"n\": 0}", 400, "n", "invalid_value"},
    {"model int", C, "{\"prompt\": \"hi\", \"model\": 5}", 400, "model", "invalid_type"},
    {"user int", C, "{\"prompt\": \"hi\", \"user\": 5}", 400, "user", "invalid_type"},
    {"logprobs 2", C, "{\"prompt\": \"hi\", \"logprobs\": 2}", 0, NULL, NULL},
    {"logprobs 0", C, "{\"prompt\": \"hi\", \"logprobs\": 0}", 0, NULL, NULL},
    {"logprobs 5", C, "{\"prompt\": \"hi\", \"logprobs\": 5}", 0, NULL, NULL},
    {"logprobs 6", C, "{\"prompt\": \"hi\", \"logprobs\": 6}", 400, "logprobs",
     "invalid_value"},
    {"logprobs -1", C, "{\"prompt\": \"hi\", \"logprobs\": -1}", 400, "logprobs",
     "invalid_value"},
    {"logprobs true (completions)", C, "{\"prompt\": \"hi\", \"logprobs\": true}", 400,
     "logprobs", "invalid_type"},
    {"top_logprobs (completions)", C, "{\"prompt\": \"hi\", \"top_logprobs\": 2}", 400,
     "top_logprobs", "unsupported_parameter"},
    {"chat logprobs", CH, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
     "\"logprobs\": true, \"top_logprobs\": 20}", 0, NULL, NULL},
    {"chat logprobs false", CH, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
     "\"logprobs\": false}", 0, NULL, NULL},
    {"chat top_logprobs 21", CH, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
     "\"logprobs\": true, \"top_logprobs\": 21}", 400, "top_logprobs", "invalid_value"},
    {"chat top_logprobs -1", CH, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
     "\"logprobs\": true, \"top_logprobs\": -1}", 400, "top_logprobs", "invalid_value"},
    {"chat top_logprobs without logprobs", CH, "{\"messages\": [{\"role\": \"user\", "
     "\"content\": \"x\"}], \"top_logprobs\": 2}", 400, "top_logprobs", "invalid_value"},
    {"chat top_logprobs with logprobs false", CH, "{\"messages\": [{\"role\": \"user\", "
     "\"content\": \"x\"}], \"logprobs\": false, \"top_logprobs\": 2}", 400, "top_logprobs",
     "invalid_value"},
    {"chat logprobs 3", CH, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
     "\"logprobs\": 3}", 400, "logprobs", "invalid_type"},
    {"chat top_logprobs string", CH, "{\"messages\": [{\"role\": \"user\", \"content\": "
     "\"x\"}], \"logprobs\": true, \"top_logprobs\": \"2\"}", 400, "top_logprobs",
     "invalid_type"},
    {"responses logprobs", R, "{\"input\": \"x\", \"logprobs\": true}", 400, "logprobs",
     "unsupported_parameter"},
    {"echo", C, "{\"prompt\": \"hi\", \"echo\": true}", 0, NULL, NULL},
    {"echo with logprobs", C, "{\"prompt\": \"hi\", \"echo\": true, \"logprobs\": 1}", 0, NULL,
     NULL},
    {"echo streamed", C, "{\"prompt\": \"hi\", \"echo\": true, \"stream\": true}", 0, NULL,
     NULL},
    {"echo 1", C, "{\"prompt\": \"hi\", \"echo\": 1}", 400, "echo", "invalid_type"},
    {"chat echo", CH, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
     "\"echo\": true}", 400, "echo", "unsupported_parameter"},
    {"best_of 2", C, "{\"prompt\": \"hi\", \"best_of\": 2}", 0, NULL, NULL},
    {"best_of 128", C, "{\"prompt\": \"hi\", \"best_of\": 128, \"n\": 2}", 0, NULL, NULL},
    {"best_of 129", C, "{\"prompt\": \"hi\", \"best_of\": 129}", 400, "best_of",
     "invalid_value"},
    {"best_of x prompts > 256", C, "{\"prompt\": [\"a\", \"b\", \"c\"], \"best_of\": 100}",
     400, "best_of", "invalid_value"},
    {"best_of 2 streamed", C, "{\"prompt\": \"hi\", \"best_of\": 2, \"stream\": true}", 400,
     "best_of", "invalid_value"},
    {"best_of = n streamed", C, "{\"prompt\": \"hi\", \"n\": 2, \"best_of\": 2, "
     "\"stream\": true}", 0, NULL, NULL},
    {"best_of string", C, "{\"prompt\": \"hi\", \"best_of\": \"2\"}", 400, "best_of",
     "invalid_type"},
    {"service_tier bad", C, "{\"prompt\": \"hi\", \"service_tier\": \"scale\"}", 400,
     "service_tier", "invalid_value"},
    {"service_tier type", C, "{\"prompt\": \"hi\", \"service_tier\": 1}", 400,
     "service_tier", "invalid_type"},
    {"service_tier flex", C, "{\"prompt\": \"hi\", \"service_tier\": \"flex\"}", 0, NULL,
     NULL},
    {"service_tier auto", CH,
     MSG_X "\"service_tier\": \"auto\"}",
     0, NULL, NULL},
    {"mtp_depth 3", C, "{\"prompt\": \"hi\", \"mtp_depth\": 3}", 400, "mtp_depth",
     "invalid_value"},
    {"mtp_depth -1", C, "{\"prompt\": \"hi\", \"mtp_depth\": -1}", 400, "mtp_depth",
     "invalid_value"},
    {"mtp_depth type", C, "{\"prompt\": \"hi\", \"mtp_depth\": \"2\"}", 400, "mtp_depth",
     "invalid_type"},
    {"mtp_depth 0", C, "{\"prompt\": \"hi\", \"mtp_depth\": 0}", 0, NULL, NULL},
    {"presence_penalty high", C, "{\"prompt\": \"hi\", \"presence_penalty\": 3}", 400,
     "presence_penalty", "invalid_value"},
    /* chat output fields the server cannot honour (docs/api.md "Request parameters") */
    {"chat response_format json_object", CH,
     MSG_X "\"response_format\": {\"type\": \"json_object\"}}",
     400, "response_format", "unsupported_parameter"},
    {"chat response_format json_schema", CH,
     MSG_X "\"response_format\": {\"type\": \"json_schema\", "
     "\"json_schema\": {\"name\": \"a\", \"schema\": {}}}}",
     400, "response_format", "unsupported_parameter"},
    {"chat response_format no type", CH,
     MSG_X "\"response_format\": {}}",
     400, "response_format", "unsupported_parameter"},
    {"chat response_format string", CH,
     MSG_X "\"response_format\": \"text\"}",
     400, "response_format", "invalid_type"},
    {"chat response_format text", CH,
     MSG_X "\"response_format\": {\"type\": \"text\"}}",
     0, NULL, NULL},
    {"chat response_format null", CH,
     MSG_X "\"response_format\": null}",
     0, NULL, NULL},
    {"chat tool_choice required", CH,
     MSG_X "\"tool_choice\": \"required\"}",
     400, "tool_choice", "unsupported_parameter"},
    {"chat tool_choice named", CH,
     MSG_X "\"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"f\"}}}",
     400, "tool_choice", "unsupported_parameter"},
    {"chat tool_choice bad string", CH,
     MSG_X "\"tool_choice\": \"always\"}",
     400, "tool_choice", "invalid_value"},
    {"chat tool_choice int", CH,
     MSG_X "\"tool_choice\": 1}",
     400, "tool_choice", "invalid_type"},
    {"chat tool_choice none", CH,
     MSG_X "\"tool_choice\": \"none\"}",
     0, NULL, NULL},
    {"chat tool_choice auto, empty tools", CH,
     MSG_X "\"tool_choice\": \"auto\", \"tools\": []}",
     0, NULL, NULL},
    {"chat function_call named", CH,
     MSG_X "\"function_call\": {\"name\": \"f\"}}",
     400, "function_call", "unsupported_parameter"},
    {"chat function_call auto", CH,
     MSG_X "\"function_call\": \"auto\"}",
     0, NULL, NULL},
    {"chat tools", CH,
     MSG_X "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]}",
     400, "tools", "unsupported_parameter"},
    {"chat modalities audio", CH,
     MSG_X "\"modalities\": [\"text\", \"audio\"]}",
     400, "modalities", "unsupported_parameter"},
    {"chat modalities string", CH,
     MSG_X "\"modalities\": \"text\"}",
     400, "modalities", "invalid_type"},
    {"chat modalities text", CH,
     MSG_X "\"modalities\": [\"text\"]}",
     0, NULL, NULL},
    {"chat audio", CH,
     MSG_X "\"audio\": {\"voice\": \"alloy\", \"format\": \"wav\"}}",
     400, "audio", "unsupported_parameter"},
    {"chat audio null", CH,
     MSG_X "\"audio\": null}",
     0, NULL, NULL},
    {"logit_bias key 01", C,
     "{\"prompt\": \"hi\", \"logit_bias\": {\"01\": 1}}",
     400, "logit_bias", "invalid_value"},
    {"logit_bias key +1", C,
     "{\"prompt\": \"hi\", \"logit_bias\": {\"+1\": 1}}",
     400, "logit_bias", "invalid_value"},
    {"logit_bias key  1", C,
     "{\"prompt\": \"hi\", \"logit_bias\": {\" 1\": 1}}",
     400, "logit_bias", "invalid_value"},
    {"logit_bias key tab 1", C,
     "{\"prompt\": \"hi\", \"logit_bias\": {\"\\t1\": 1}}",
     400, "logit_bias", "invalid_value"},
    {"logit_bias key 1 trailing space", C,
     "{\"prompt\": \"hi\", \"logit_bias\": {\"1 \": 1}}",
     400, "logit_bias", "invalid_value"},
    {"logit_bias key 1e2", C,
     "{\"prompt\": \"hi\", \"logit_bias\": {\"1e2\": 1}}",
     400, "logit_bias", "invalid_value"},
    {"logit_bias key 00", C,
     "{\"prompt\": \"hi\", \"logit_bias\": {\"00\": 1}}",
     400, "logit_bias", "invalid_value"},
    {"logit_bias key 0", C, "{\"prompt\": \"hi\", \"logit_bias\": {\"0\": 1}}", 0, NULL, NULL},
    {"logit_bias key 17", C, "{\"prompt\": \"hi\", \"logit_bias\": {\"17\": 1}}", 0, NULL, NULL},
    /* valid ones */
    {"ok minimal", C, "{\"prompt\": \"hi\"}", 0, NULL, NULL},
    {"ok everything", C,
     "{\"model\": \"m\", \"prompt\": [\"hi\"], \"max_tokens\": 3, \"temperature\": 0, "
     "\"top_p\": 0.5, \"top_k\": -1, \"seed\": -7, \"stop\": \"x\", \"stream\": true, "
     "\"stream_options\": {\"include_usage\": true}, \"n\": 1, \"user\": \"u\", "
     "\"logprobs\": null, \"echo\": false, \"best_of\": 1, \"frequency_penalty\": 0, "
     "\"unknown_field\": {\"x\": [1]}}",
     0, NULL, NULL},
    {"ok chat", CH,
     "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", "
     "\"content\": [{\"type\": \"text\", \"text\": \"U\"}]}], \"max_completion_tokens\": 2, "
     "\"max_tokens\": 9}",
     0, NULL, NULL},
    {"ok nulls", C,
     "{\"prompt\": \"hi\", \"max_tokens\": null, \"stop\": null, "
     "\"temperature\": null, \"stream\": null}",
     0, NULL, NULL},
};

static void check_case(const vcase *vc, const char *body, size_t len)
{
    api_request r;
    api_error e;
    memset(&e, 0, sizeof(e));
    int rc = api_parse(vc->kind, body, len, &r, &e);
    if (vc->status == 0) {
        if (rc != 0)
            fail_msg("case '%s': unexpected error %d %s", vc->name, e.status, e.message);
        api_request_free(&r);
        return;
    }
    if (rc != -1)
        fail_msg("case '%s': accepted, want %d", vc->name, vc->status);
    if (e.status != vc->status || !e.code || strcmp(e.code, vc->code) != 0 ||
        (vc->param ? !e.param || strcmp(e.param, vc->param) != 0 : e.param != NULL))
        fail_msg("case '%s': got %d param=%s code=%s (%s), want %d param=%s code=%s", vc->name,
                 e.status, e.param ? e.param : "null", e.code ? e.code : "null", e.message,
                 vc->status, vc->param ? vc->param : "null", vc->code);
    assert_int_equal(e.status, vc->status);
    assert_string_equal(e.type, "invalid_request_error");
    if (vc->param)
        assert_string_equal(e.param ? e.param : "(null)", vc->param);
    else
        assert_null(e.param);
    assert_string_equal(e.code ? e.code : "(null)", vc->code);
    assert_true(strlen(e.message) > 0);
    /* the error body is valid JSON with the same fields */
    char *json = api_error_json(&e);
    assert_non_null(json);
    json_t *root = json_loads(json, 0, NULL);
    assert_non_null(root);
    json_t *err = json_object_get(root, "error");
    assert_true(json_is_object(err));
    assert_string_equal(json_string_value(json_object_get(err, "message")), e.message);
    assert_string_equal(json_string_value(json_object_get(err, "type")), "invalid_request_error");
    if (vc->param)
        assert_string_equal(json_string_value(json_object_get(err, "param")), vc->param);
    else
        assert_true(json_is_null(json_object_get(err, "param")));
    assert_string_equal(json_string_value(json_object_get(err, "code")), vc->code);
    json_decref(root);
    free(json);
    /* a failed parse leaves nothing to free */
    assert_null(r.prompt);
    assert_null(r.model);
    assert_int_equal(r.n_stop, 0);
}

static void test_validation_table(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        check_case(&cases[i], cases[i].body, strlen(cases[i].body));
}

static void test_invalid_utf8(void **state)
{
    (void)state;
    static const char body[] = "{\"prompt\": \"caf\xC3\"}";
    vcase vc = {"invalid utf-8", C, NULL, 400, NULL, "invalid_encoding"};
    check_case(&vc, body, sizeof(body) - 1);
    static const char overlong[] = "{\"prompt\": \"\xC0\xAF\"}";
    check_case(&vc, overlong, sizeof(overlong) - 1);
    static const char surrogate[] = "{\"prompt\": \"\xED\xA0\x80\"}";
    check_case(&vc, surrogate, sizeof(surrogate) - 1);
    assert_true(api_utf8_valid("caf\xC3\xA9 \xF0\x9F\x98\x80", 10));
    assert_false(api_utf8_valid("\xF4\x90\x80\x80", 4)); /* > U+10FFFF */
}

/* A token-id prompt is kept as given (no BOS), and one id is not "empty". */
static void test_prompt_ids(void **state)
{
    (void)state;
    api_request r;
    api_error e;
    const char *b = "{\"prompt\": [[1, 300, 0, 2147483647]], \"max_tokens\": 4}";
    assert_int_equal(api_parse(API_COMPLETIONS, b, strlen(b), &r, &e), 0);
    assert_null(r.prompt);
    assert_int_equal(r.n_prompt_ids, 4);
    assert_int_equal(r.prompt_ids[0], 1);
    assert_int_equal(r.prompt_ids[1], 300);
    assert_int_equal(r.prompt_ids[2], 0);
    assert_int_equal(r.prompt_ids[3], 2147483647);
    api_request_free(&r);
    assert_null(r.prompt_ids);
    b = "{\"prompt\": [7]}";
    assert_int_equal(api_parse(API_COMPLETIONS, b, strlen(b), &r, &e), 0);
    assert_int_equal(api_check_length(&r, 1, 512, &e), 0);
    assert_int_equal(r.max_tokens, 511);
    api_request_free(&r);
    /* an id array whose first element is not an integer is named as such, not as a batch */
    static const char *bad[] = {"{\"prompt\": [1.5, 2]}", "{\"prompt\": [true, 2]}",
                                "{\"prompt\": [null, 2]}", "{\"prompt\": [[1.0, 2]]}",
                                "{\"prompt\": [-3]}"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        assert_int_equal(api_parse(API_COMPLETIONS, bad[i], strlen(bad[i]), &r, &e), -1);
        assert_int_equal(e.status, 400);
        assert_string_equal(e.code, "invalid_value");
        assert_non_null(strstr(e.message, "token ids must hold integers in [0, 2147483647]; "
                                          "element 0 is not one"));
    }
    /* one prompt nested too deep is named as that, not as an empty prompt */
    static const char *deep[] = {"{\"prompt\": [[\"a\"]]}", "{\"prompt\": [[[1]]]}"};
    for (size_t i = 0; i < sizeof(deep) / sizeof(deep[0]); i++) {
        assert_int_equal(api_parse(API_COMPLETIONS, deep[i], strlen(deep[i]), &r, &e), -1);
        assert_int_equal(e.status, 400);
        assert_string_equal(e.code, "invalid_value");
        assert_string_equal(e.message, "'prompt[0]' must be a non-empty string or a non-empty "
                                       "array of token ids.");
    }
}

/* A batch of prompts: every prompt in order (text or ids), n and best_of; the answer with
 * several choices, and chunks naming their choice. */
/* The Responses API's input and instructions render with the chat template. */
static void test_responses_input(void **state)
{
    (void)state;
    api_request r;
    api_error e;
    static const char body[] = "{\"input\": [{\"role\": \"user\", \"content\": \"U\"}, "
                               "{\"role\": \"assistant\", \"content\": [{\"type\": "
                               "\"output_text\", \"text\": \"A\"}]}], \"instructions\": \"S\", "
                               "\"max_output_tokens\": 9, \"n\": 3}";
    assert_int_equal(api_parse(API_RESPONSES, body, strlen(body), &r, &e), 0);
    assert_string_equal(r.prompt, "system: S\nuser: U\nassistant: A\nassistant:");
    assert_string_equal(r.instructions, "S");
    assert_int_equal(r.max_tokens, 9);
    assert_int_equal(r.n, 1); /* not a Responses field: ignored */
    assert_int_equal(r.store, 1);
    api_request_free(&r);
    assert_int_equal(api_parse(API_RESPONSES, "{\"input\": \"hi\"}", 15, &r, &e), 0);
    assert_string_equal(r.prompt, "user: hi\nassistant:");
    assert_null(r.instructions);
    api_request_free(&r);
}

static void test_batched_prompts_and_n(void **state)
{
    (void)state;
    api_request r;
    api_error e;
    static const char body[] = "{\"prompt\": [\"ab\", [7, 8, 9], \"c\"], \"n\": 2, \"best_of\": 2}";
    assert_int_equal(api_parse(API_COMPLETIONS, body, strlen(body), &r, &e), 0);
    assert_int_equal(r.n_prompts, 3);
    assert_int_equal(r.n, 2);
    api_prompt p0 = api_request_prompt(&r, 0), p1 = api_request_prompt(&r, 1),
               p2 = api_request_prompt(&r, 2);
    assert_string_equal(p0.text, "ab");
    assert_int_equal(p0.len, 2);
    assert_null(p0.ids);
    assert_null(p1.text);
    assert_int_equal(p1.n_ids, 3);
    assert_int_equal(p1.ids[0], 7);
    assert_int_equal(p1.ids[2], 9);
    assert_string_equal(p2.text, "c");
    api_request_free(&r);
    /* one prompt: n defaults to 1 */
    assert_int_equal(api_parse(API_COMPLETIONS, "{\"prompt\": \"x\"}", 15, &r, &e), 0);
    assert_int_equal(r.n_prompts, 1);
    assert_int_equal(r.n, 1);
    assert_null(r.prompts_rest);
    api_request_free(&r);
    /* 257 prompts */
    char big[4096] = "{\"prompt\": [";
    for (int i = 0; i < 257; i++)
        strcat(big, i ? ",\"a\"" : "\"a\"");
    strcat(big, "]}");
    assert_int_equal(api_parse(API_COMPLETIONS, big, strlen(big), &r, &e), -1);
    assert_string_equal(e.message, "'prompt' holds 257 prompts; at most 256 are accepted in one "
                                   "request.");
    /* a bad element is named */
    static const char bad[] = "{\"prompt\": [\"a\", [1, 2.5]]}";
    assert_int_equal(api_parse(API_COMPLETIONS, bad, strlen(bad), &r, &e), -1);
    assert_string_equal(e.message, "'prompt' as token ids must hold integers in [0, 2147483647]; "
                                   "element 1 (prompt 1) is not one.");

    api_response_info info = {API_COMPLETIONS, "cmpl-1", 7, "m", 0, NULL, 0};
    api_choice ch[2] = {{"x", 1, API_FINISH_STOP, NULL}, {"yz", 2, API_FINISH_LENGTH, NULL}};
    char *s = api_format_response_n(&info, ch, 2, 5, 3);
    assert_string_equal(s, "{\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":7,"
                           "\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"x\",\"logprobs\":"
                           "null,\"finish_reason\":\"stop\"},{\"index\":1,\"text\":\"yz\","
                           "\"logprobs\":null,\"finish_reason\":\"length\"}],\"usage\":{"
                           "\"prompt_tokens\":5,\"completion_tokens\":3,\"total_tokens\":8}}");
    free(s);
    info.index = 3;
    info.kind = API_CHAT;
    s = api_format_chunk(&info, "q", 1, NULL, 0);
    assert_non_null(strstr(s, "\"choices\":[{\"index\":3,\"delta\":{\"content\":\"q\"}"));
    char fast[512];
    assert_int_equal(api_format_text_chunk(&info, "q", 1, fast), strlen(s));
    assert_string_equal(fast, s);
    free(s);
}

/* api_format_text_chunk (the per-token path) gives api_format_chunk's bytes exactly:
 * every byte value alone and inside text, escapes, multi-byte characters, long text, both
 * endpoints, with and without service_tier and usage; invalid UTF-8 gives 0 (NULL). */
static void check_text_chunk(const api_response_info *info, const char *text, size_t len)
{
    char *ref = api_format_chunk(info, text, len, NULL, 0);
    size_t cap = api_text_chunk_bound(info, len);
    char *fast = malloc(cap);
    assert_non_null(fast);
    memset(fast, 'x', cap);
    size_t n = api_format_text_chunk(info, text, len, fast);
    if (!ref) {
        assert_int_equal(n, 0);
    } else {
        assert_int_equal(n, strlen(ref));
        assert_memory_equal(fast, ref, n + 1);
        assert_true(n + 1 <= cap);
    }
    free(fast);
    free(ref);
}

static void test_text_chunk_matches_jansson(void **state)
{
    (void)state;
    static const char *texts[] = {"", " a", "caf\xC3\xA9", "\xF0\x9F\x98\x80!", "say \"hi\"\\",
                                  "a\tb\nc\rd\be\ff/g", "\x7F\x01\x1F", "\xE2\x80\xA8",
                                  "\xC3", "\xC0\xAF", "\xED\xA0\x80", "ok\xFF"};
    const char *ids[] = {"cmpl-1", "chatcmpl-\"q\"\\"};
    const char *models[] = {"stories260K", "m\xC3\xA9/\x01x"};
    for (int kind = 0; kind < 2; kind++)
        for (int v = 0; v < 8; v++) {
            api_response_info info = {.kind = kind ? API_CHAT : API_COMPLETIONS,
                                      .id = ids[v & 1],
                                      .created = v & 2 ? 1796135047 : 0,
                                      .model = models[(v >> 1) & 1],
                                      .include_usage = v & 1,
                                      .service_tier = v & 4 ? (v & 2 ? "flex" : "default")
                                                            : NULL};
            for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++)
                check_text_chunk(&info, texts[i], strlen(texts[i]));
            for (int b = 0; b < 256; b++) {
                char t[3] = {'a', (char)b, 'z'};
                check_text_chunk(&info, t, 3);
            }
        }
    char big[5000];
    for (size_t i = 0; i < sizeof(big); i++)
        big[i] = (char)(i % 7 == 0 ? '"' : i % 11 == 0 ? '\n' : 'a' + (char)(i % 26));
    api_response_info info = {API_COMPLETIONS, "cmpl-big", 5, "m", 1, "default", 0};
    check_text_chunk(&info, big, sizeof(big));
}

static void test_parsed_values(void **state)
{
    (void)state;
    api_request r;
    api_error e;
    const char *b = cases[sizeof(cases) / sizeof(cases[0]) - 3].body; /* ok everything */
    assert_int_equal(api_parse(API_COMPLETIONS, b, strlen(b), &r, &e), 0);
    assert_string_equal(r.model, "m");
    assert_string_equal(r.prompt, "hi");
    assert_int_equal(r.max_tokens, 3);
    assert_true(r.temperature == 0.0);
    assert_true(r.top_p == 0.5);
    assert_int_equal(r.top_k, 0);
    assert_int_equal(r.has_seed, 1);
    assert_true(r.seed == (uint64_t)-7);
    assert_int_equal(r.n_stop, 1);
    assert_string_equal(r.stop[0], "x");
    assert_int_equal(r.stream, 1);
    assert_int_equal(r.include_usage, 1);
    api_request_free(&r);

    b = "{\"prompt\": \"hi\"}";
    assert_int_equal(api_parse(API_COMPLETIONS, b, strlen(b), &r, &e), 0);
    assert_int_equal(r.max_tokens, -1);
    assert_true(r.temperature == 1.0);
    assert_true(r.top_p == 1.0);
    assert_int_equal(r.has_seed, 0);
    assert_int_equal(r.stream, 0);
    assert_null(r.model);
    assert_int_equal(r.offline, 0);
    api_request_free(&r);

    b = "{\"prompt\": \"hi\", \"service_tier\": \"flex\"}";
    assert_int_equal(api_parse(API_COMPLETIONS, b, strlen(b), &r, &e), 0);
    assert_int_equal(r.offline, 1);
    api_request_free(&r);
    b = "{\"prompt\": \"hi\", \"service_tier\": \"default\"}";
    assert_int_equal(api_parse(API_COMPLETIONS, b, strlen(b), &r, &e), 0);
    assert_int_equal(r.offline, 0);
    assert_int_equal(r.mtp_depth, -1); /* absent: the workers' default */
    api_request_free(&r);
    b = "{\"prompt\": \"hi\", \"mtp_depth\": 1}";
    assert_int_equal(api_parse(API_COMPLETIONS, b, strlen(b), &r, &e), 0);
    assert_int_equal(r.mtp_depth, 1);
    api_request_free(&r);
    b = "{\"prompt\": \"hi\", \"mtp_depth\": null}";
    assert_int_equal(api_parse(API_COMPLETIONS, b, strlen(b), &r, &e), 0);
    assert_int_equal(r.mtp_depth, -1);
    api_request_free(&r);
}

/* The sampling controls parse into one proto_sampling, exactly; defaults leave none. */
static void test_sampling_controls(void **state)
{
    (void)state;
    api_request r;
    api_error e;
    const char *body = "{\"prompt\": \"hi\", \"max_tokens\": 8, \"presence_penalty\": 0.5, "
                       "\"frequency_penalty\": -1.25, \"repetition_penalty\": 1.5, "
                       "\"logit_bias\": {\"432\": -100, \"7\": 2.5}, \"min_tokens\": 8, "
                       "\"stop_token_ids\": [13, 0]}";
    assert_int_equal(api_parse(API_COMPLETIONS, body, strlen(body), &r, &e), 0);
    assert_non_null(r.samp);
    assert_true(r.samp->presence == 0.5f && r.samp->frequency == -1.25f &&
                r.samp->repetition == 1.5f);
    assert_int_equal(r.samp->min_tokens, 8);
    assert_int_equal(r.samp->n_gen, 0);
    assert_int_equal(r.samp->n_bias, 2);
    assert_int_equal(r.samp->bias_ids[0], 432); /* jansson keeps insertion order */
    assert_true(r.samp->bias[0] == -100.0f);
    assert_int_equal(r.samp->bias_ids[1], 7);
    assert_true(r.samp->bias[1] == 2.5f);
    assert_int_equal(r.samp->n_stop, 2);
    assert_int_equal(r.samp->stop_ids[0], 13);
    assert_int_equal(r.samp->stop_ids[1], 0);
    assert_int_equal(api_check_sampling(&r, 512, &e), 0);
    assert_int_equal(api_check_sampling(&r, 432, &e), -1);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "logit_bias");
    assert_string_equal(e.message, "'logit_bias' names token 432; the vocabulary has 432 tokens.");
    api_request_free(&r);
    /* every default (and an empty logit_bias / stop_token_ids): no controls */
    body = "{\"prompt\": \"hi\", \"presence_penalty\": 0, \"frequency_penalty\": 0, "
           "\"repetition_penalty\": 1, \"logit_bias\": {}, \"min_tokens\": 0, "
           "\"stop_token_ids\": []}";
    assert_int_equal(api_parse(API_COMPLETIONS, body, strlen(body), &r, &e), 0);
    assert_null(r.samp);
    api_request_free(&r);
}

static void test_chat_template(void **state)
{
    (void)state;
    api_request r;
    api_error e;
    const char *b = cases[sizeof(cases) / sizeof(cases[0]) - 2].body; /* ok chat */
    assert_int_equal(api_parse(API_CHAT, b, strlen(b), &r, &e), 0);
    assert_string_equal(r.prompt, "system: S\nuser: U\nassistant:");
    assert_int_equal(r.prompt_len, strlen("system: S\nuser: U\nassistant:"));
    assert_int_equal(r.max_tokens, 2); /* max_completion_tokens wins */
    api_request_free(&r);
}

/* Messages that quote client input cut at a byte count must stay valid UTF-8, or the
 * error object cannot be built (the client got {"error":{"message":"out of memory"}}). */
static void test_utf8_trim(void **state)
{
    (void)state;
    static const struct {
        const char *in, *out;
    } trims[] = {
        {"", ""},
        {"plain", "plain"},
        {"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"},
        {"abc\xc3", "abc"},             /* a 2-byte character cut after its first byte */
        {"a\xe2\x82", "a"},             /* a 3-byte one after two */
        {"\xf0\x9f\x98", ""},          /* a 4-byte one after three */
        {"a\xff" "b", "a?b"},              /* never valid */
        {"a\xc0\xaf" "b", "a??b"},         /* overlong '/' */
        {"a\xed\xa0\x80" "b", "a???b"},    /* a surrogate */
        {"a\x80" "b\xc3", "a?b"},          /* a stray continuation byte, then a cut */
    };
    for (size_t i = 0; i < sizeof(trims) / sizeof(trims[0]); i++) {
        char buf[64];
        snprintf(buf, sizeof(buf), "%s", trims[i].in);
        api_utf8_trim(buf);
        assert_string_equal(buf, trims[i].out);
        assert_true(api_utf8_valid(buf, strlen(buf)));
    }
}

/* The model name and service_tier are quoted in their errors with %.200s / %.64s: a
 * multi-byte character across the cut must not break the error body. */
static void test_error_quotes_cut_at_a_character(void **state)
{
    (void)state;
    char model[300], body[600];
    memset(model, 'a', 199);
    snprintf(model + 199, sizeof(model) - 199, "\xc3\xa9" "xyz"); /* the cut at 200 splits the \xc3\xa9 */
    snprintf(body, sizeof(body), "{\"prompt\": \"hi\", \"model\": \"%s\"}", model);
    api_request r;
    api_error e;
    assert_int_equal(api_parse(API_COMPLETIONS, body, strlen(body), &r, &e), 0);
    assert_int_equal(api_check_model(&r, "stories260K", &e), -1);
    api_request_free(&r);
    char *js = api_error_json(&e);
    assert_non_null(js);
    assert_non_null(strstr(js, "model_not_found"));
    assert_true(api_utf8_valid(e.message, strlen(e.message)));
    free(js);

    char tier[100];
    memset(tier, 'b', 63);
    snprintf(tier + 63, sizeof(tier) - 63, "\xe2\x82\xac"); /* %.64s keeps one byte of the euro */
    snprintf(body, sizeof(body), "{\"prompt\": \"hi\", \"service_tier\": \"%s\"}", tier);
    assert_int_equal(api_parse(API_COMPLETIONS, body, strlen(body), &r, &e), -1);
    assert_string_equal(e.code, "invalid_value");
    assert_string_equal(e.param, "service_tier");
    js = api_error_json(&e);
    assert_non_null(js);
    assert_non_null(strstr(js, "invalid_value"));
    free(js);
}

/* An out-of-range number is quoted as it was sent, not rounded to 6 digits: 2.0000001 was
 * reported "must be >= 0 and <= 2, got 2.", which reads as a value in range. */
static void test_number_range_message(void **state)
{
    (void)state;
    api_request r;
    api_error e;
    static const char t[] = "{\"prompt\": \"x\", \"temperature\": 2.0000001}";
    assert_int_equal(api_parse(API_COMPLETIONS, t, strlen(t), &r, &e), -1);
    assert_string_equal(e.message, "'temperature' must be >= 0 and <= 2, got 2.0000001.");
    static const char p[] = "{\"prompt\": \"x\", \"top_p\": 1.0000000000000002}";
    assert_int_equal(api_parse(API_COMPLETIONS, p, strlen(p), &r, &e), -1);
    assert_string_equal(e.message, "'top_p' must be > 0 and <= 1, got 1.0000000000000002.");
    static const char f[] = "{\"prompt\": \"x\", \"presence_penalty\": -2.5}";
    assert_int_equal(api_parse(API_COMPLETIONS, f, strlen(f), &r, &e), -1);
    assert_string_equal(e.message, "'presence_penalty' must be >= -2 and <= 2, got -2.5.");
}

static void test_model_check(void **state)
{
    (void)state;
    api_request r;
    api_error e;
    const char *b = "{\"prompt\": \"hi\", \"model\": \"gpt-4\"}";
    assert_int_equal(api_parse(API_COMPLETIONS, b, strlen(b), &r, &e), 0);
    assert_int_equal(api_check_model(&r, "stories260K", &e), -1);
    assert_int_equal(e.status, 404);
    assert_string_equal(e.code, "model_not_found");
    assert_string_equal(e.param, "model");
    assert_int_equal(api_check_model(&r, "gpt-4", &e), 0);
    api_request_free(&r);
    b = "{\"prompt\": \"hi\"}";
    assert_int_equal(api_parse(API_COMPLETIONS, b, strlen(b), &r, &e), 0);
    assert_int_equal(api_check_model(&r, "stories260K", &e), 0);
    api_request_free(&r);
}

static void test_length_checks(void **state)
{
    (void)state;
    api_request r;
    api_error e;
    const char *b = "{\"prompt\": \"hi\"}";
    assert_int_equal(api_parse(API_COMPLETIONS, b, strlen(b), &r, &e), 0);
    /* prompt longer than the context: 400 naming both numbers */
    assert_int_equal(api_check_length(&r, 600, 512, &e), -1);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.code, "context_length_exceeded");
    assert_string_equal(e.param, "prompt");
    assert_non_null(strstr(e.message, "512"));
    assert_non_null(strstr(e.message, "600"));
    /* a prompt that fills the context leaves no room */
    assert_int_equal(api_check_length(&r, 512, 512, &e), -1);
    /* only BOS: empty */
    assert_int_equal(api_check_length(&r, 1, 512, &e), -1);
    assert_string_equal(e.code, "invalid_value");
    /* default max_tokens: the rest of the context */
    assert_int_equal(api_check_length(&r, 5, 512, &e), 0);
    assert_int_equal(r.max_tokens, 507);
    api_request_free(&r);

    b = "{\"prompt\": \"hi\", \"max_tokens\": 100}";
    assert_int_equal(api_parse(API_COMPLETIONS, b, strlen(b), &r, &e), 0);
    assert_int_equal(api_check_length(&r, 412, 512, &e), 0);
    assert_int_equal(api_check_length(&r, 413, 512, &e), -1);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "max_tokens");
    assert_non_null(strstr(e.message, "512"));
    assert_non_null(strstr(e.message, "513"));
    assert_non_null(strstr(e.message, "413"));
    assert_non_null(strstr(e.message, "100"));
    api_request_free(&r);
}

static void test_formats(void **state)
{
    (void)state;
    api_response_info info = {API_COMPLETIONS, "cmpl-1", 1700000000, "m", 0, NULL, 0};
    char *s = api_format_response(&info, "caf\xC3\xA9", 5, API_FINISH_LENGTH, 3, 4);
    json_t *j = json_loads(s, 0, NULL);
    assert_non_null(j);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "text_completion");
    json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c0, "text")), "caf\xC3\xA9");
    assert_string_equal(json_string_value(json_object_get(c0, "finish_reason")), "length");
    assert_true(json_is_null(json_object_get(c0, "logprobs")));
    json_t *u = json_object_get(j, "usage");
    assert_int_equal(json_integer_value(json_object_get(u, "total_tokens")), 7);
    json_decref(j);
    free(s);
    /* invalid UTF-8 never reaches the wire */
    assert_null(api_format_response(&info, "\xC3", 1, API_FINISH_STOP, 1, 1));

    info.kind = API_CHAT;
    info.include_usage = 1;
    s = api_format_chunk(&info, NULL, 0, NULL, 1);
    j = json_loads(s, 0, NULL);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "chat.completion.chunk");
    c0 = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(json_object_get(c0, "delta"), "role")),
                        "assistant");
    assert_true(json_is_null(json_object_get(c0, "finish_reason")));
    assert_true(json_is_null(json_object_get(j, "usage")));
    json_decref(j);
    free(s);
    s = api_format_chunk(&info, NULL, 0, API_FINISH_STOP, 0);
    j = json_loads(s, 0, NULL);
    c0 = json_array_get(json_object_get(j, "choices"), 0);
    assert_int_equal(json_object_size(json_object_get(c0, "delta")), 0);
    assert_string_equal(json_string_value(json_object_get(c0, "finish_reason")), "stop");
    json_decref(j);
    free(s);
    s = api_format_usage_chunk(&info, 2, 3);
    j = json_loads(s, 0, NULL);
    assert_int_equal(json_array_size(json_object_get(j, "choices")), 0);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 3);
    json_decref(j);
    free(s);
    s = api_format_models("m", 1, 512, 2);
    assert_string_equal(s, "{\"object\":\"list\",\"data\":[{\"id\":\"m\",\"object\":\"model\","
                           "\"created\":1,\"owned_by\":\"tidepool\",\"root\":\"m\","
                           "\"max_model_len\":512,\"mtp_depth\":2}]}");
    free(s);
    s = api_format_models("m", 1, 512, -1);
    j = json_loads(s, 0, NULL);
    assert_true(json_is_null(json_object_get(json_array_get(json_object_get(j, "data"), 0),
                                             "mtp_depth")));
    json_decref(j);
    free(s);
}

// --- stream: a tiny vocabulary with byte tokens

enum {
    T_UNK,
    T_BOS,
    T_EOS,
    T_BYTE0 = 3,
    T_A = 3 + 256,
    T_B,
    T_SP,
    T_AB,
    T_STOP,
    T_ST,
    T_OP,
    T_EACUTE,
    T_X,
    T_HELLO,
    N_VOCAB
};

static char tok_path[64];
static tokenizer_t *tok;

static int setup_tokenizer(void **state)
{
    (void)state;
    static char byte_names[256][8];
    const char *names[N_VOCAB];
    size_t lens[N_VOCAB];
    float scores[N_VOCAB];
    int32_t types[N_VOCAB];
    names[T_UNK] = "<unk>", types[T_UNK] = 2;
    names[T_BOS] = "<s>", types[T_BOS] = 3;
    names[T_EOS] = "</s>", types[T_EOS] = 3;
    for (int b = 0; b < 256; b++) {
        snprintf(byte_names[b], sizeof(byte_names[b]), "<0x%02X>", b);
        names[T_BYTE0 + b] = byte_names[b];
        types[T_BYTE0 + b] = 6;
    }
    const char *normal[] = {"a", "b", " ", "ab", "STOP", "ST", "OP", "\xC3\xA9", "x", " hello"};
    for (int i = 0; i < 10; i++) {
        names[T_A + i] = normal[i];
        types[T_A + i] = 1;
    }
    for (int i = 0; i < N_VOCAB; i++) {
        lens[i] = strlen(names[i]);
        scores[i] = (float)-i;
    }
    snprintf(tok_path, sizeof(tok_path), "/tmp/test_gateway_tok_%d.gguf", (int)getpid());
    gguf_writer_t *w = gguf_writer_new();
    assert_non_null(w);
    assert_int_equal(gguf_writer_add_str(w, "general.architecture", "llama"), 0);
    assert_int_equal(gguf_writer_add_str(w, "tokenizer.ggml.model", "llama"), 0);
    assert_int_equal(gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", names, lens, N_VOCAB), 0);
    assert_int_equal(gguf_writer_add_arr_f32(w, "tokenizer.ggml.scores", scores, N_VOCAB), 0);
    assert_int_equal(gguf_writer_add_arr_i32(w, "tokenizer.ggml.token_type", types, N_VOCAB), 0);
    assert_int_equal(gguf_writer_add_u32(w, "tokenizer.ggml.bos_token_id", T_BOS), 0);
    assert_int_equal(gguf_writer_add_u32(w, "tokenizer.ggml.eos_token_id", T_EOS), 0);
    char err[256];
    assert_int_equal(gguf_writer_write(w, tok_path, err, sizeof(err)), 0);
    gguf_writer_destroy(&w);
    tok = tokenizer_load(tok_path, err, sizeof(err));
    if (!tok)
        fail_msg("tokenizer_load: %s", err);
    return 0;
}

static int teardown_tokenizer(void **state)
{
    (void)state;
    tokenizer_destroy(&tok);
    unlink(tok_path);
    return 0;
}

static stream_t *mk(const char *const *stops, int n)
{
    stream_t *s = stream_new(tok, T_A, T_EOS, stops, n);
    assert_non_null(s);
    return s;
}

static const char *out(stream_t *s)
{
    size_t len;
    const char *p = stream_out(s, &len);
    assert_int_equal(strlen(p), len);
    assert_true(api_utf8_valid(p, len));
    return p;
}

/* Completions' top_logprobs is an object keyed by the alternatives' texts: two that show the
 * same text (byte tokens as U+FFFD, BOS / EOS / <unk> as "") keep the more likely value,
 * so a greedy token's own value is still its entry's (it was overwritten by the second). */
static void test_logprobs_same_text_alternatives(void **state)
{
    (void)state;
    api_logprob e = {.text = "\xE6", .len = 1, .logprob = -0.5f, .n_top = 4};
    const char *texts[] = {"\xE6", "\xE7", "", "a"};
    const float vals[] = {-0.5f, -1.5f, -2.0f, -2.5f};
    for (int j = 0; j < 4; j++) {
        e.top_text[j] = texts[j];
        e.top_len[j] = strlen(texts[j]);
        e.top_logprob[j] = vals[j];
    }
    api_logprobs lp = {.e = &e, .n = 1, .top = 4};
    json_t *j = api_logprobs_json(API_COMPLETIONS, &lp);
    assert_non_null(j);
    json_t *top = json_array_get(json_object_get(j, "top_logprobs"), 0);
    assert_int_equal(json_object_size(top), 3);
    assert_true(json_real_value(json_object_get(top, "\xEF\xBF\xBD")) == -0.5);
    assert_true(json_real_value(json_object_get(top, "")) == -2.0);
    assert_true(json_real_value(json_object_get(top, "a")) == -2.5);
    json_decref(j);
}

static void test_stream_utf8_split(void **state)
{
    (void)state;
    stream_t *s = mk(NULL, 0);
    assert_int_equal(stream_push(s, T_BYTE0 + 0xC3), STREAM_CONTINUE);
    assert_string_equal(out(s), ""); /* half a character is never sent */
    assert_int_equal(stream_push(s, T_BYTE0 + 0xA9), STREAM_CONTINUE);
    assert_string_equal(out(s), "\xC3\xA9");
    stream_out_clear(s);
    /* a 4-byte character over four tokens */
    stream_push(s, T_BYTE0 + 0xF0);
    stream_push(s, T_BYTE0 + 0x9F);
    stream_push(s, T_BYTE0 + 0x98);
    assert_string_equal(out(s), "");
    stream_push(s, T_BYTE0 + 0x80);
    assert_string_equal(out(s), "\xF0\x9F\x98\x80");
    assert_int_equal(stream_n_tokens(s), 6);
    stream_destroy(&s);
    assert_null(s);
}

static void test_stream_utf8_malformed(void **state)
{
    (void)state;
    stream_t *s = mk(NULL, 0);
    stream_push(s, T_BYTE0 + 0xFF); /* never valid */
    assert_string_equal(out(s), "\xEF\xBF\xBD");
    stream_out_clear(s);
    stream_push(s, T_BYTE0 + 0xC3); /* lead byte, then a non-continuation */
    stream_push(s, T_A);
    assert_string_equal(out(s), "\xEF\xBF\xBD"
                                "a");
    stream_out_clear(s);
    stream_push(s, T_BYTE0 + 0xE2); /* incomplete at the end */
    stream_push(s, T_BYTE0 + 0x82);
    assert_string_equal(out(s), "");
    assert_int_equal(stream_finish(s), STREAM_CONTINUE);
    assert_string_equal(out(s), "\xEF\xBF\xBD");
    stream_destroy(&s);
}

static void test_stream_stop_spanning_tokens(void **state)
{
    (void)state;
    const char *stops[] = {"STOP"};
    stream_t *s = mk(stops, 1);
    assert_int_equal(stream_push(s, T_A), STREAM_CONTINUE);
    assert_int_equal(stream_push(s, T_ST), STREAM_CONTINUE);
    assert_string_equal(out(s), "a"); /* "ST" could start "STOP": held back */
    assert_int_equal(stream_push(s, T_OP), STREAM_STOP);
    assert_string_equal(out(s), "a"); /* the stop string is not sent */
    assert_int_equal(stream_stopped(s), 1);
    assert_int_equal(stream_n_tokens(s), 3);
    /* nothing after the stop */
    assert_int_equal(stream_push(s, T_B), STREAM_STOP);
    assert_int_equal(stream_finish(s), STREAM_STOP);
    assert_string_equal(out(s), "a");
    assert_int_equal(stream_n_tokens(s), 3);
    stream_destroy(&s);
}

static void test_stream_stop_inside_token(void **state)
{
    (void)state;
    const char *stops[] = {"zzz", "b"};
    stream_t *s = mk(stops, 2);
    assert_int_equal(stream_push(s, T_AB), STREAM_STOP); /* "ab": "a" then the stop */
    assert_string_equal(out(s), "a");
    stream_destroy(&s);
    /* the earliest match wins when several stops match */
    const char *stops2[] = {"OP", "ST"};
    s = mk(stops2, 2);
    assert_int_equal(stream_push(s, T_STOP), STREAM_STOP);
    assert_string_equal(out(s), "");
    stream_destroy(&s);
}

/* min_tokens: a stop string completed by one of the first min_tokens tokens is passed over
 * for good (vLLM checks stop strings only after them); one completed later ends the text. */
static void test_stream_stop_after_min_tokens(void **state)
{
    (void)state;
    const char *stops[] = {"STOP"};
    stream_t *s = mk(stops, 1);
    stream_set_min_tokens(s, 2);
    assert_int_equal(stream_push(s, T_STOP), STREAM_CONTINUE); /* token 1 */
    assert_int_equal(stream_push(s, T_ST), STREAM_CONTINUE);   /* token 2: "ST" held */
    assert_string_equal(out(s), "STOP");
    assert_int_equal(stream_push(s, T_OP), STREAM_STOP); /* token 3 completes "STOP" */
    assert_string_equal(out(s), "STOP");
    assert_int_equal(stream_n_tokens(s), 3);
    stream_destroy(&s);
    /* a stop wholly in text held back within the first min_tokens tokens (the "b" that may
     * start "bSTOP") never matches later */
    const char *stops2[] = {"b", "bSTOP"};
    s = mk(stops2, 2);
    stream_set_min_tokens(s, 1);
    assert_int_equal(stream_push(s, T_B), STREAM_CONTINUE); /* "b": held as "bSTOP"'s start */
    assert_int_equal(stream_push(s, T_A), STREAM_CONTINUE); /* the old "b" is passed over */
    assert_string_equal(out(s), "ba");
    assert_int_equal(stream_push(s, T_B), STREAM_STOP); /* a new "b" after min_tokens */
    assert_string_equal(out(s), "ba");
    stream_destroy(&s);
    /* the end of the stream (length) within min_tokens: no stop either */
    s = mk(stops, 1);
    stream_set_min_tokens(s, 5);
    assert_int_equal(stream_push(s, T_A), STREAM_CONTINUE);
    assert_int_equal(stream_push(s, T_STOP), STREAM_CONTINUE);
    assert_int_equal(stream_finish(s), STREAM_CONTINUE);
    assert_string_equal(out(s), "aSTOP");
    stream_destroy(&s);
}

static void test_stream_held_prefix_released(void **state)
{
    (void)state;
    const char *stops[] = {"STOP"};
    stream_t *s = mk(stops, 1);
    stream_push(s, T_A);
    stream_push(s, T_ST);
    assert_string_equal(out(s), "a");
    stream_push(s, T_X); /* "STx" is not a stop: released */
    assert_string_equal(out(s), "aSTx");
    stream_out_clear(s);
    stream_push(s, T_ST);
    assert_string_equal(out(s), "");
    assert_int_equal(stream_finish(s), STREAM_CONTINUE); /* ended by length */
    assert_string_equal(out(s), "ST");
    stream_destroy(&s);
}

static void test_stream_multibyte_stop(void **state)
{
    (void)state;
    const char *stops[] = {"\xC3\xA9"};
    stream_t *s = mk(stops, 1);
    stream_push(s, T_A);
    assert_int_equal(stream_push(s, T_BYTE0 + 0xC3), STREAM_CONTINUE);
    assert_int_equal(stream_push(s, T_BYTE0 + 0xA9), STREAM_STOP);
    assert_string_equal(out(s), "a");
    stream_destroy(&s);
}

static void test_stream_eos_and_bos_space(void **state)
{
    (void)state;
    stream_t *s = mk(NULL, 0);
    stream_push(s, T_X);
    assert_int_equal(stream_push(s, T_EOS), STREAM_STOP);
    assert_string_equal(out(s), "x");
    assert_int_equal(stream_n_tokens(s), 1); /* EOS is not counted */
    assert_int_equal(stream_stopped(s), 1);
    stream_destroy(&s);
    /* right after BOS the leading space of a piece is dropped (llama2.c's rule) */
    s = stream_new(tok, T_BOS, T_EOS, NULL, 0);
    stream_push(s, T_HELLO);
    stream_push(s, T_HELLO);
    assert_string_equal(out(s), "hello hello");
    stream_destroy(&s);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_validation_table),
        cmocka_unit_test(test_invalid_utf8),
        cmocka_unit_test(test_prompt_ids),
        cmocka_unit_test(test_batched_prompts_and_n),
        cmocka_unit_test(test_responses_input),
        cmocka_unit_test(test_text_chunk_matches_jansson),
        cmocka_unit_test(test_utf8_trim),
        cmocka_unit_test(test_error_quotes_cut_at_a_character),
        cmocka_unit_test(test_parsed_values),
        cmocka_unit_test(test_sampling_controls),
        cmocka_unit_test(test_chat_template),
        cmocka_unit_test(test_number_range_message),
        cmocka_unit_test(test_model_check),
        cmocka_unit_test(test_length_checks),
        cmocka_unit_test(test_formats),
        cmocka_unit_test(test_logprobs_same_text_alternatives),
        cmocka_unit_test(test_stream_utf8_split),
        cmocka_unit_test(test_stream_utf8_malformed),
        cmocka_unit_test(test_stream_stop_spanning_tokens),
        cmocka_unit_test(test_stream_stop_inside_token),
        cmocka_unit_test(test_stream_held_prefix_released),
        cmocka_unit_test(test_stream_stop_after_min_tokens),
        cmocka_unit_test(test_stream_multibyte_stop),
        cmocka_unit_test(test_stream_eos_and_bos_space),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("gateway_api", tests, setup_tokenizer, teardown_tokenizer);
}
