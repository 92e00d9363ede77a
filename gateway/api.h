/*
 * api: the OpenAI-compatible request/response formats of the gateway, with no I/O.
 *
 * api_parse() turns a request body into an api_request or an api_error (HTTP status plus
 * the OpenAI error object fields); api_check_model() and api_check_length() finish the
 * validation once the served model and the prompt's token count are known. The
 * api_format_*() functions build response bodies and SSE chunk payloads with jansson,
 * except api_format_text_chunk (the per-token path), which writes the same bytes directly.
 * Everything here is pure (no globals, no sockets), so the whole validation table is
 * unit-tested at this level (tests/unit/test_gateway_api.c). See docs/api.md for the
 * rules these functions implement.
 */
#ifndef TP_GW_API_H
#define TP_GW_API_H

#include <stddef.h>
#include <stdint.h>

#include "protocol.h" /* proto_sampling */

#define API_MAX_STOP 4         /* stop strings per request (OpenAI's limit) */
#define API_MAX_STOP_BYTES 256 /* bytes per stop string */
#define API_MAX_PROMPT_IDS 1048576 /* token ids of one token-id prompt */
#define API_MAX_TOKEN_ID 0x7fffffff /* largest id parsed (the vocabulary is checked later) */
#define API_MAX_N 128          /* "n": choices per prompt (OpenAI's limit) */
#define API_MAX_PROMPTS 256    /* prompts of one batched completions request */
#define API_MAX_CHOICES 256    /* prompts x n: sequences one request runs */
#define API_MAX_TOP_LOGPROBS_CHAT 20 /* chat "top_logprobs" (OpenAI's limit) */
#define API_MAX_LOGPROBS_COMPLETIONS 5 /* completions "logprobs" (OpenAI's limit) */

typedef enum {
    API_COMPLETIONS = 0, /* POST /v1/completions */
    API_CHAT = 1,        /* POST /v1/chat/completions */
    API_RESPONSES = 2,   /* POST /v1/responses (text; responses.h formats its answers) */
} api_kind_t;

/* One prompt of a batched completions request: text (BOS added at tokenization) or token
 * ids (used as given), as api_request's first-prompt fields. */
typedef struct {
    char *text;   /* NULL for a token-id prompt */
    size_t len;   /* bytes of text */
    int *ids;     /* NULL for a text prompt */
    int n_ids;
} api_prompt;

/* A validated request. Strings are owned (free with api_request_free). */
typedef struct {
    api_kind_t kind;
    char *model;              /* requested model name; NULL when absent */
    char *prompt;             /* completions: the prompt; chat: the rendered template */
    size_t prompt_len;        /* bytes of prompt (valid UTF-8, no NUL) */
    int *prompt_ids;          /* completions: a token-id prompt ("prompt": [ids] or [[ids]]),
                               * used as given (no BOS added, ids >= 0; their range is
                               * checked against the vocabulary at admission); NULL = text */
    int n_prompt_ids;         /* ids in prompt_ids (>= 1 when set) */
    int n_prompts;            /* prompts (>= 1): the one above, then prompts_rest[0..n-2]
                               * (completions with "prompt" an array of several strings or
                               * token-id arrays); read them with api_request_prompt */
    api_prompt *prompts_rest; /* owned; NULL when n_prompts == 1 */
    int n;                    /* "n": choices per prompt, 1..API_MAX_N (n x n_prompts <=
                               * API_MAX_CHOICES) */
    int best_of;              /* completions "best_of": sequences run per prompt, n..API_MAX_N
                               * (x n_prompts <= API_MAX_CHOICES; not with stream when > n),
                               * of which the n with the highest cumulative log-probability
                               * are returned; = n when absent (and for chat) */
    int store;                /* responses: "store" (accepted; nothing is ever stored) */
    char *instructions;       /* responses: "instructions" (NUL-terminated; NULL = absent),
                               * also rendered into prompt as a system message */
    int max_tokens;           /* >= 1, or -1 when absent (api_check_length fills it) */
    double temperature;       /* [0, 2]; default 1 */
    double top_p;             /* (0, 1]; default 1 */
    int top_k;                /* >= 0; 0 = off (-1 is accepted as off) */
    int has_seed;             /* seed given? */
    uint64_t seed;            /* the seed's two's-complement bits */
    char *stop[API_MAX_STOP]; /* non-empty UTF-8 strings */
    int n_stop;
    int stream;        /* 1: SSE */
    int include_usage; /* stream_options.include_usage */
    int echo;          /* completions "echo": the prompt (and with logprobs its tokens' log-
                        * probabilities, the first null) before the completion; not streamed */
    int offline;       /* service_tier "flex": the offline tier ("auto", "default": online) */
    int mtp_depth;     /* extension "mtp_depth": 0..2 MTP drafts per step at most; -1 absent */
    int logprobs;      /* 0: none; k + 1: every generated token's log-probability and its k
                        * most likely alternatives (chat "logprobs": true with
                        * "top_logprobs": k, 0..20; completions "logprobs": k, 0..5) */
    proto_sampling *samp; /* presence_penalty, frequency_penalty, repetition_penalty,
                           * logit_bias, min_tokens, stop_token_ids (docs/api.md "Sampling
                           * controls"); owned; NULL when none is set (all defaults). Token
                           * ids are >= 0; their range is checked against the vocabulary at
                           * admission (api_check_sampling) */
} api_request;

/* An error reply: HTTP status and the fields of OpenAI's {"error": {...}} object.
 * type/param/code are static strings (param and code may be NULL = JSON null). */
typedef struct {
    int status;
    const char *type;
    const char *param;
    const char *code;
    char message[512];
} api_error;

/* Fill e (message printf-style, truncated to fit, then made valid UTF-8 with
 * api_utf8_trim, so that the error object can always be built). Returns -1 so callers can
 * `return api_error_set(...)`. */
int api_error_set(api_error *e, int status, const char *type, const char *param, const char *code,
                  const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* 1 if the n bytes at s are well-formed UTF-8 (no overlongs, no surrogates, <= U+10FFFF),
 * else 0. */
int api_utf8_valid(const char *s, size_t n);

/* Make the NUL-terminated s valid UTF-8 in place: a character cut short at the end (text
 * truncated at a byte count, e.g. by "%.200s") is dropped, and every byte that starts no
 * well-formed sequence becomes '?'. Valid text is left unchanged. */
void api_utf8_trim(char *s);

/* Parse and validate a body of len bytes (need not be NUL-terminated) for endpoint kind.
 * On success returns 0 and fills *out (free with api_request_free). On bad input returns
 * -1, fills *err (4xx) and leaves *out empty. Unknown fields are ignored. Chat messages
 * are rendered into out->prompt with the plain template of docs/api.md. */
int api_parse(api_kind_t kind, const char *body, size_t len, api_request *out, api_error *err);

/* Prompt i (0 <= i < r->n_prompts) of r as a view into r (borrowed, valid while r is). */
api_prompt api_request_prompt(const api_request *r, int i);

/* Free the strings of r and zero it. Takes an already-freed (zeroed) request. */
void api_request_free(api_request *r);

/* Check r->model against the served name (absent = the served model). 0, or -1 with a
 * 404 model_not_found in *err. */
int api_check_model(const api_request *r, const char *served_model, api_error *err);

/* Check the prompt's token count n_prompt (BOS included; a token-id prompt: its ids, at
 * least one) against the context n_ctx (tokens)
 * and settle max_tokens: absent → n_ctx - n_prompt. Returns 0, or -1 with a 400 in *err
 * (empty prompt, prompt >= n_ctx, n_prompt + max_tokens > n_ctx; the message names the
 * numbers). */
int api_check_length(api_request *r, int n_prompt, int n_ctx, api_error *err);

/* Check r's token ids in logit_bias and stop_token_ids against the vocabulary (vocab ids).
 * 0, or -1 with a 400 invalid_value naming the field and the id in *err. */
int api_check_sampling(const api_request *r, int vocab, api_error *err);

/* The error body {"error":{"message","type","param","code"}}. malloc'd; NULL on OOM. */
char *api_error_json(const api_error *e);

/* What every response of one request shares. */
typedef struct {
    api_kind_t kind;
    const char *id;    /* "cmpl-..." / "chatcmpl-..." */
    int64_t created;   /* unix seconds */
    const char *model; /* served model name */
    int include_usage; /* streaming: chunks carry "usage": null, then a usage chunk */
    const char *service_tier; /* "flex" / "default" in every body and chunk; NULL = none */
    int index;         /* chunks: the choice's "index" (n x prompt + i); 0 for one choice */
} api_response_info;

/* One generated token's log-probabilities, as the answer shows them (docs/api.md
 * "Log-probabilities"). Token texts are the bytes the token adds to the text (borrowed; any
 * bytes: shown as UTF-8 with U+FFFD for bytes that are no whole character, and as the raw
 * "bytes" in chat). */
typedef struct {
    const char *text;
    size_t len;
    int null_logprob; /* 1: no value (echo's first prompt token): logprob and top null */
    float logprob;
    int n_top; /* alternatives, most likely first */
    const char *top_text[API_MAX_TOP_LOGPROBS_CHAT];
    size_t top_len[API_MAX_TOP_LOGPROBS_CHAT];
    float top_logprob[API_MAX_TOP_LOGPROBS_CHAT];
} api_logprob;

/* The log-probabilities of n consecutive tokens of one choice (all of them, or a chunk's). */
typedef struct {
    const api_logprob *e; /* (n,) borrowed */
    int n;
    int top;              /* alternatives asked for (entries show at most this many) */
    int text_offset;      /* completions: text_offset of e[0] (characters of the choice's
                           * text before it) */
} api_logprobs;

/* The "logprobs" object of a choice for kind: chat {"content": [{token, logprob, bytes,
 * top_logprobs: [{token, logprob, bytes}]}], "refusal": null}; completions {tokens,
 * token_logprobs, top_logprobs: [{token: logprob}], text_offset} (OpenAI's shapes). A new
 * jansson object (the caller's); NULL on out of memory. */
struct json_t *api_logprobs_json(api_kind_t kind, const api_logprobs *lp);

/* Characters (code points, U+FFFD for each byte that starts no whole character) of n bytes
 * shown as a token's text: what a token adds to completions' text_offset. */
int api_token_chars(const char *s, size_t n);

/* One choice of a non-streaming answer: len bytes of valid UTF-8 text, its finish reason. */
typedef struct {
    const char *text;
    size_t len;
    const char *finish_reason;
    const api_logprobs *logprobs; /* NULL: "logprobs": null */
} api_choice;

/* finish reasons as OpenAI spells them */
#define API_FINISH_STOP "stop"
#define API_FINISH_LENGTH "length"

/* Non-streaming response body (text: len bytes of valid UTF-8). malloc'd; NULL on OOM or
 * invalid UTF-8. */
char *api_format_response(const api_response_info *info, const char *text, size_t len,
                          const char *finish_reason, int n_prompt, int n_completion);

/* The same body with n >= 1 choices, "index" 0..n-1 in order (batched prompts, "n"). */
char *api_format_response_n(const api_response_info *info, const api_choice *choices, int n,
                            int n_prompt, int n_completion);

/* One SSE chunk payload (without "data: ") for choice info->index. text may be NULL (no content); finish_reason
 * NULL while streaming; role_chunk = 1 gives chat's first delta {"role":"assistant",
 * "content":""}. malloc'd; NULL on OOM or invalid UTF-8. */
char *api_format_chunk(const api_response_info *info, const char *text, size_t len,
                       const char *finish_reason, int role_chunk);

/* The per-token path of streaming: the same payload as api_format_chunk(info, text, len,
 * NULL, 0), byte for byte, written without jansson or allocation into out, which has room
 * for api_text_chunk_bound(info, len) bytes (a bound: every string escaped at 6 bytes a
 * byte, plus the fixed part). NUL-terminated. Returns its length, or 0 when text is not
 * valid UTF-8 (api_format_chunk's NULL; nothing to send). */
size_t api_text_chunk_bound(const api_response_info *info, size_t len);

/* api_format_chunk with the log-probabilities of the chunk's tokens (lp NULL: null; a chat
 * chunk with no text and lp set carries an empty delta). malloc'd; NULL on OOM or invalid
 * UTF-8. */
char *api_format_chunk_logprobs(const api_response_info *info, const char *text, size_t len,
                                const char *finish_reason, const api_logprobs *lp);
size_t api_format_text_chunk(const api_response_info *info, const char *text, size_t len,
                             char *out);

/* The final usage chunk (choices: [], usage: {...}). malloc'd; NULL on OOM. */
char *api_format_usage_chunk(const api_response_info *info, int n_prompt, int n_completion);

struct json_t;
/* The JSON type of v as an error message names it ("an object", "a string", "null", ...):
 * a static string. */
const char *api_json_type_name(const struct json_t *v);

/* The model card of GET /v1/models/{id} (and each entry of the list): id, object, created
 * (unix seconds), owned_by, root, max_model_len (the context length, tokens, as vLLM's
 * card) and mtp_depth (the MTP drafts per step the workers serve at most; mtp_depth < 0
 * gives null: no worker reported one). A new jansson object (the caller's); NULL on OOM. */
struct json_t *api_model_card(const char *model, int64_t created, int n_ctx, int mtp_depth);

/* GET /v1/models body listing one model (api_model_card). malloc'd; NULL on OOM. */
char *api_format_models(const char *model, int64_t created, int n_ctx, int mtp_depth);

#endif
