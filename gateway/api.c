/* api: see api.h. Validation follows OpenAI's error conventions: 400
 * invalid_request_error with the offending parameter in "param" and a short machine code
 * in "code" (invalid_type, invalid_value, missing_required_parameter, ...). */
#include "api.h"

#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define INVALID "invalid_request_error"

int api_error_set(api_error *e, int status, const char *type, const char *param, const char *code,
                  const char *fmt, ...)
{
    e->status = status;
    e->type = type;
    e->param = param;
    e->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof(e->message), fmt, ap);
    va_end(ap);
    api_utf8_trim(e->message); /* a quoted input cut at a byte count may end mid-character */
    return -1;
}

/* Length of the well-formed UTF-8 sequence at s[0..n) (no overlongs, no surrogates,
 * <= U+10FFFF): 1..4, 0 when it is malformed, -1 when it is cut short by the end. */
static int utf8_seq(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    if (c < 0x80)
        return 1;
    int len;
    unsigned min;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2, min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3, min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4, min = 0x10000;
    } else {
        return 0;
    }
    unsigned cp = c & (0x7F >> len);
    for (int k = 1; k < len; k++) {
        if ((size_t)k >= n)
            return -1;
        if ((s[k] & 0xC0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return len;
}

int api_utf8_valid(const char *str, size_t n)
{
    const unsigned char *s = (const unsigned char *)str;
    for (size_t i = 0; i < n;) {
        int k = utf8_seq(s + i, n - i);
        if (k <= 0)
            return 0;
        i += (size_t)k;
    }
    return 1;
}

void api_utf8_trim(char *str)
{
    unsigned char *s = (unsigned char *)str;
    size_t n = strlen(str);
    for (size_t i = 0; i < n;) {
        int k = utf8_seq(s + i, n - i);
        if (k < 0) { /* a character cut by the end: drop its start */
            s[i] = 0;
            return;
        }
        if (k == 0) {
            s[i++] = '?';
            continue;
        }
        i += (size_t)k;
    }
}

void api_request_free(api_request *r)
{
    free(r->model);
    free(r->prompt);
    free(r->prompt_ids);
    for (int i = 0; i + 1 < r->n_prompts && r->prompts_rest; i++) {
        free(r->prompts_rest[i].text);
        free(r->prompts_rest[i].ids);
    }
    free(r->prompts_rest);
    free(r->instructions);
    for (int i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r->samp);
    memset(r, 0, sizeof(*r));
}

// --- field helpers

const char *api_json_type_name(const struct json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return "an object";
    case JSON_ARRAY:
        return "an array";
    case JSON_STRING:
        return "a string";
    case JSON_INTEGER:
        return "an integer";
    case JSON_REAL:
        return "a number";
    case JSON_TRUE:
    case JSON_FALSE:
        return "a boolean";
    case JSON_NULL:
        return "null";
    }
    return "?";
}

static int type_error(api_error *e, const char *param, const char *want, const json_t *v)
{
    return api_error_set(e, 400, INVALID, param, "invalid_type",
                         "Invalid type for '%s': expected %s, but got %s instead.", param, want,
                         api_json_type_name(v));
}

/* A present, non-null field, or NULL. */
static json_t *field(json_t *root, const char *key)
{
    json_t *v = json_object_get(root, key);
    return (v && !json_is_null(v)) ? v : NULL;
}

static int get_bool(json_t *root, const char *key, int *out, api_error *e)
{
    json_t *v = field(root, key);
    if (!v)
        return 0;
    if (!json_is_boolean(v))
        return type_error(e, key, "a boolean", v);
    *out = json_is_true(v);
    return 0;
}

/* d in buf (cap bytes) with the fewest significant digits that read back as d (as JSON
 * encoders and Python's repr write it): %g alone keeps 6, so 2.0000001 showed as "2". */
static const char *shortest_g(char *buf, size_t cap, double d)
{
    for (int prec = 6; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, d);
        if (strtod(buf, NULL) == d)
            break;
    }
    return buf;
}

/* A number in [lo, hi] (lo_open: lo excluded). */
static int get_number(json_t *root, const char *key, double lo, int lo_open, double hi, double *out,
                      api_error *e)
{
    json_t *v = field(root, key);
    if (!v)
        return 0;
    if (!json_is_number(v))
        return type_error(e, key, "a number", v);
    double d = json_number_value(v);
    char got[32];
    if (!isfinite(d) || d > hi || (lo_open ? d <= lo : d < lo))
        return api_error_set(e, 400, INVALID, key, "invalid_value",
                             "'%s' must be %s %g and <= %g, got %s.", key, lo_open ? ">" : ">=", lo,
                             hi, shortest_g(got, sizeof(got), d));
    *out = d;
    return 0;
}

/* An integer (JSON integer, not 1.5 nor "10"). *present = 1 when given. */
static int get_int(json_t *root, const char *key, json_int_t *out, int *present, api_error *e)
{
    json_t *v = field(root, key);
    *present = 0;
    if (!v)
        return 0;
    if (!json_is_integer(v))
        return type_error(e, key, "an integer", v);
    *out = json_integer_value(v);
    *present = 1;
    return 0;
}

/* A value that means "feature on" for a parameter we do not implement. */
static int is_set(const json_t *v)
{
    if (!v || json_is_null(v) || json_is_false(v))
        return 0;
    if (json_is_integer(v))
        return json_integer_value(v) != 0;
    return 1;
}

static char *dup_n(const char *s, size_t n)
{
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

// --- prompt / messages

/* A token-id prompt: a non-empty array of integers in [0, API_MAX_TOKEN_ID]. 1 if v is one
 * (*out filled), 0 if v is not meant as one (empty, or a string or array first), -1 with e
 * set (an element not such an integer: 1.5, true and null too, named as such). which: the
 * prompt's place in a batch (-1: not batched), for the messages. */
static int parse_prompt_ids(json_t *v, int which, api_prompt *out, api_error *e)
{
    size_t n = json_array_size(v);
    json_t *first = json_array_get(v, 0);
    if (n == 0 || json_is_string(first) || json_is_array(first))
        return 0;
    char where[32] = "";
    if (which >= 0)
        snprintf(where, sizeof(where), " (prompt %d)", which);
    if (n > API_MAX_PROMPT_IDS)
        return api_error_set(e, 400, INVALID, "prompt", "invalid_value",
                             "'prompt' holds %zu token ids%s; at most %d are accepted.", n, where,
                             API_MAX_PROMPT_IDS);
    int *ids = malloc(n * sizeof(int));
    if (!ids)
        return api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(v, i);
        json_int_t id = json_is_integer(t) ? json_integer_value(t) : -1;
        if (id < 0 || id > API_MAX_TOKEN_ID) {
            free(ids);
            return api_error_set(e, 400, INVALID, "prompt", "invalid_value",
                                 "'prompt' as token ids must hold integers in [0, %d]; "
                                 "element %zu%s is not one.",
                                 API_MAX_TOKEN_ID, i, where);
        }
        ids[i] = (int)id;
    }
    out->ids = ids;
    out->n_ids = (int)n;
    return 1;
}

/* One prompt: a non-empty string, or (in an array) a non-empty array of token ids. */
static int parse_one_prompt(json_t *v, int which, api_prompt *out, api_error *e)
{
    if (json_is_array(v)) {
        int rc = parse_prompt_ids(v, which, out, e);
        if (rc)
            return rc < 0 ? -1 : 0;
        if (which < 0 && json_array_size(v) == 0)
            return api_error_set(e, 400, INVALID, "prompt", "invalid_value",
                                 "'prompt' must not be empty.");
        return api_error_set(e, 400, INVALID, "prompt", "invalid_value",
                             "'prompt[%d]' must be a non-empty string or a non-empty array of "
                             "token ids.",
                             which < 0 ? 0 : which);
    }
    if (!json_is_string(v)) {
        if (which < 0)
            return type_error(e, "prompt", "a string", v);
        return api_error_set(e, 400, INVALID, "prompt", "invalid_type",
                             "'prompt' must be a string, an array of token ids, or an array of "
                             "these; element %d is %s.",
                             which, api_json_type_name(v));
    }
    if (json_string_length(v) == 0) {
        if (which < 0)
            return api_error_set(e, 400, INVALID, "prompt", "invalid_value",
                                 "'prompt' must not be empty.");
        return api_error_set(e, 400, INVALID, "prompt", "invalid_value",
                             "'prompt[%d]' must not be empty.", which);
    }
    out->text = dup_n(json_string_value(v), json_string_length(v));
    if (!out->text)
        return api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    out->len = json_string_length(v);
    return 0;
}

/* "prompt": a string, an array of token ids, or an array of 1..API_MAX_PROMPTS of these
 * (a batch: one choice, or n, per prompt). */
static int parse_prompt(json_t *root, api_request *r, api_error *e)
{
    json_t *v = field(root, "prompt");
    if (!v)
        return api_error_set(e, 400, INVALID, "prompt", "missing_required_parameter",
                             "Missing required parameter: 'prompt'.");
    api_prompt first = {0};
    r->n_prompts = 1;
    if (!json_is_array(v)) {
        if (parse_one_prompt(v, -1, &first, e) < 0)
            return -1;
    } else {
        int rc = parse_prompt_ids(v, -1, &first, e); /* [ids] */
        if (rc < 0)
            return -1;
        if (rc == 0) {
            size_t n = json_array_size(v);
            if (n == 0)
                return api_error_set(e, 400, INVALID, "prompt", "invalid_value",
                                     "'prompt' must not be empty.");
            if (n > API_MAX_PROMPTS)
                return api_error_set(e, 400, INVALID, "prompt", "invalid_value",
                                     "'prompt' holds %zu prompts; at most %d are accepted in "
                                     "one request.",
                                     n, API_MAX_PROMPTS);
            if (n > 1 && !(r->prompts_rest = calloc(n - 1, sizeof(api_prompt))))
                return api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
            for (size_t i = 0; i < n; i++) {
                api_prompt *p = i == 0 ? &first : &r->prompts_rest[i - 1];
                if (parse_one_prompt(json_array_get(v, i), n > 1 ? (int)i : -1, p, e) < 0) {
                    free(first.text);
                    free(first.ids);
                    return -1; /* (prompts_rest: api_request_free) */
                }
                r->n_prompts = (int)i + 1;
            }
        }
    }
    r->prompt = first.text;
    r->prompt_len = first.len;
    r->prompt_ids = first.ids;
    r->n_prompt_ids = first.n_ids;
    return 0;
}

api_prompt api_request_prompt(const api_request *r, int i)
{
    if (i > 0)
        return r->prompts_rest[i - 1];
    api_prompt p = {r->prompt, r->prompt_len, r->prompt_ids, r->n_prompt_ids};
    return p;
}

/* Append n bytes to a growing buffer. */
typedef struct {
    char *p;
    size_t len, cap;
} buf_t;

static int buf_add(buf_t *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p)
            return -1;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
    return 0;
}

/* Whether t is the type of a content part of OpenAI's API that this server does not serve
 * (chat's or, responses, the Responses API's): refused with unsupported_value, as OpenAI
 * answers a value its API knows and the model cannot take; an unknown type, or a text part
 * without its text, is invalid_value. */
static int part_unsupported(const char *t, int responses)
{
    static const char *const chat[] = {"image_url", "input_audio", "file", "refusal"};
    static const char *const resp[] = {"input_image", "input_file", "input_audio", "refusal"};
    const char *const *v = responses ? resp : chat;
    for (size_t k = 0; k < 4; k++)
        if (strcmp(t, v[k]) == 0)
            return 1;
    return 0;
}

/* The chat template (docs/api.md): "<role>: <content>\n" per message, then "assistant:".
 * msgs: chat's "messages" or the Responses API's "input" list (param names it); parts of
 * a content array are {"type": "text"} (chat) or "input_text" / "output_text"
 * (responses). instructions (responses; may be NULL) comes first as a system message. */
static int render_messages(json_t *msgs, const char *param, const char *instructions,
                           size_t instructions_len, api_request *r, api_error *e)
{
    static const char *roles[] = {"system", "developer", "user", "assistant"};
    int responses = r->kind == API_RESPONSES;
    buf_t b = {0};
    size_t i;
    json_t *m;
    int oom = 0;
    if (instructions) {
        oom |= buf_add(&b, "system: ", 8);
        oom |= buf_add(&b, instructions, instructions_len);
        oom |= buf_add(&b, "\n", 1);
    }
    json_array_foreach(msgs, i, m)
    {
        if (!json_is_object(m)) {
            free(b.p);
            return api_error_set(e, 400, INVALID, param, "invalid_type",
                                 "Invalid type for '%s[%zu]': expected an object, but "
                                 "got %s instead.",
                                 param, i, api_json_type_name(m));
        }
        json_t *type = json_object_get(m, "type");
        if (responses && type &&
            !(json_is_string(type) && strcmp(json_string_value(type), "message") == 0)) {
            free(b.p);
            return api_error_set(e, 400, INVALID, param, "unsupported_value",
                                 "'%s[%zu].type' must be 'message': other input items (tool "
                                 "calls, files, images) are not supported by this server.",
                                 param, i);
        }
        json_t *role = json_object_get(m, "role");
        size_t k;
        for (k = 0; role && json_is_string(role) && k < 4; k++)
            if (strcmp(json_string_value(role), roles[k]) == 0)
                break;
        if (!role || !json_is_string(role) || k == 4) {
            free(b.p);
            return api_error_set(e, 400, INVALID, param, "invalid_value",
                                 "'%s[%zu].role' must be one of 'system', 'developer', "
                                 "'user', 'assistant'.",
                                 param, i);
        }
        json_t *content = json_object_get(m, "content");
        oom |= buf_add(&b, json_string_value(role), strlen(json_string_value(role)));
        oom |= buf_add(&b, ": ", 2);
        if (content && json_is_string(content)) {
            oom |= buf_add(&b, json_string_value(content), json_string_length(content));
        } else if (content && json_is_array(content) && json_array_size(content) == 0) {
            free(b.p); /* OpenAI's answer to an empty content array */
            return api_error_set(e, 400, INVALID, param, "empty_array",
                                 "Invalid '%s[%zu].content': empty array. Expected an array "
                                 "with minimum length 1, but got an empty array instead.",
                                 param, i);
        } else if (content && json_is_array(content)) {
            size_t j;
            json_t *part;
            json_array_foreach(content, j, part)
            {
                json_t *pt = json_object_get(part, "type");
                json_t *text = json_object_get(part, "text");
                const char *t = json_is_string(pt) ? json_string_value(pt) : "";
                int ok = responses ? strcmp(t, "input_text") == 0 || strcmp(t, "output_text") == 0
                                   : strcmp(t, "text") == 0;
                if (json_is_object(part) && part_unsupported(t, responses)) {
                    free(b.p);
                    return api_error_set(e, 400, INVALID, param, "unsupported_value",
                                         "'%s[%zu].content[%zu]' is a '%s' part: only text "
                                         "parts {\"type\": \"%s\", \"text\": ...} are "
                                         "supported by this server (no image, audio or file "
                                         "input).",
                                         param, i, j, t, responses ? "input_text" : "text");
                }
                if (!json_is_object(part) || !ok || !json_is_string(text)) {
                    free(b.p);
                    return api_error_set(e, 400, INVALID, param, "invalid_value",
                                         "'%s[%zu].content[%zu]' must be a text part "
                                         "{\"type\": \"%s\", \"text\": ...}.",
                                         param, i, j, responses ? "input_text" : "text");
                }
                oom |= buf_add(&b, json_string_value(text), json_string_length(text));
            }
        } else {
            free(b.p);
            return api_error_set(e, 400, INVALID, param, "invalid_type",
                                 "'%s[%zu].content' must be a string or an array of "
                                 "text parts.",
                                 param, i);
        }
        oom |= buf_add(&b, "\n", 1);
    }
    oom |= buf_add(&b, "assistant:", 10);
    if (oom) {
        free(b.p);
        return api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    r->prompt = b.p;
    r->prompt_len = b.len;
    r->n_prompts = 1;
    return 0;
}

static int parse_messages(json_t *root, api_request *r, api_error *e)
{
    json_t *msgs = field(root, "messages");
    if (!msgs)
        return api_error_set(e, 400, INVALID, "messages", "missing_required_parameter",
                             "Missing required parameter: 'messages'.");
    if (!json_is_array(msgs))
        return type_error(e, "messages", "an array", msgs);
    if (json_array_size(msgs) == 0)
        return api_error_set(e, 400, INVALID, "messages", "invalid_value",
                             "'messages' must contain at least one message.");
    return render_messages(msgs, "messages", NULL, 0, r, e);
}

/* The Responses API's "input" (a string: one user message; or a list of messages) and
 * "instructions" (a system message first), rendered with the chat template. */
static int parse_input(json_t *root, api_request *r, api_error *e)
{
    json_t *in = field(root, "input"), *ins = field(root, "instructions");
    if (!in)
        return api_error_set(e, 400, INVALID, "input", "missing_required_parameter",
                             "Missing required parameter: 'input'.");
    if (ins && !json_is_string(ins))
        return type_error(e, "instructions", "a string", ins);
    const char *is = ins ? json_string_value(ins) : NULL;
    size_t il = ins ? json_string_length(ins) : 0;
    if (is && !(r->instructions = dup_n(is, il)))
        return api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    if (json_is_string(in)) {
        if (json_string_length(in) == 0)
            return api_error_set(e, 400, INVALID, "input", "invalid_value",
                                 "'input' must not be empty.");
        json_t *msgs = json_pack("[{s:s, s:O}]", "role", "user", "content", in);
        if (!msgs)
            return api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        int rc = render_messages(msgs, "input", is, il, r, e);
        json_decref(msgs);
        return rc;
    }
    if (!json_is_array(in))
        return type_error(e, "input", "a string or an array of messages", in);
    if (json_array_size(in) == 0)
        return api_error_set(e, 400, INVALID, "input", "invalid_value",
                             "'input' must contain at least one message.");
    return render_messages(in, "input", is, il, r, e);
}

/* The Responses API fields this server does not serve: a clear 400 each. */
static int check_responses_fields(json_t *root, api_request *r, api_error *e)
{
    json_t *v;
    if (field(root, "previous_response_id"))
        return api_error_set(e, 400, INVALID, "previous_response_id", "unsupported_parameter",
                             "'previous_response_id' is not supported by this server: responses "
                             "are not stored; send the whole conversation in 'input'.");
    if (field(root, "conversation"))
        return api_error_set(e, 400, INVALID, "conversation", "unsupported_parameter",
                             "'conversation' is not supported by this server: send the whole "
                             "conversation in 'input'.");
    if ((v = field(root, "tools")) && !(json_is_array(v) && json_array_size(v) == 0))
        return api_error_set(e, 400, INVALID, "tools", "unsupported_parameter",
                             "'tools' is not supported by this server.");
    if (is_set(field(root, "background")))
        return api_error_set(e, 400, INVALID, "background", "unsupported_parameter",
                             "'background' is not supported by this server.");
    if ((v = field(root, "text"))) {
        json_t *f = json_is_object(v) ? json_object_get(v, "format") : NULL;
        json_t *t = f && json_is_object(f) ? json_object_get(f, "type") : NULL;
        if (!json_is_object(v) ||
            (f && !json_is_null(f) &&
             !(json_is_string(t) && strcmp(json_string_value(t), "text") == 0)))
            return api_error_set(e, 400, INVALID, "text", "unsupported_parameter",
                                 "Only plain text output ('text': {'format': {'type': 'text'}}) "
                                 "is supported by this server.");
    }
    r->store = 1; /* OpenAI's default; nothing is stored either way (docs/api.md) */
    return get_bool(root, "store", &r->store, e);
}

/* Chat's output-shaping fields this server cannot honour (it writes free text, calls no
 * tools, has no audio): each one set to anything but its default is a 400
 * unsupported_parameter naming it, instead of a 200 that silently ignores it. The defaults
 * stay accepted: response_format {"type": "text"}, tool_choice / function_call "none" or
 * "auto" (there are no tools, so both mean text), modalities ["text"], audio null. */
static int check_chat_fields(json_t *root, api_error *e)
{
    json_t *v;
    if ((v = field(root, "response_format"))) {
        json_t *t = json_is_object(v) ? json_object_get(v, "type") : NULL;
        if (!json_is_object(v))
            return type_error(e, "response_format", "an object", v);
        if (!(json_is_string(t) && strcmp(json_string_value(t), "text") == 0))
            return api_error_set(e, 400, INVALID, "response_format", "unsupported_parameter",
                                 "Only 'response_format' {'type': 'text'} is supported by this "
                                 "server (no JSON mode, no structured outputs); got type "
                                 "'%.64s'.",
                                 json_is_string(t) ? json_string_value(t) : "(none)");
    }
    static const char *choices[] = {"tool_choice", "function_call"};
    for (size_t i = 0; i < 2; i++) {
        if (!(v = field(root, choices[i])))
            continue;
        if (!json_is_string(v) && !json_is_object(v))
            return type_error(e, choices[i], "a string or an object", v);
        const char *s = json_is_string(v) ? json_string_value(v) : NULL;
        if (s && (strcmp(s, "none") == 0 || strcmp(s, "auto") == 0))
            continue;
        if (s && strcmp(s, "required") != 0)
            return api_error_set(e, 400, INVALID, choices[i], "invalid_value",
                                 "'%s' must be 'none', 'auto', 'required' or an object, got "
                                 "'%.64s'.",
                                 choices[i], s);
        return api_error_set(e, 400, INVALID, choices[i], "unsupported_parameter",
                             "'%s' %s is not supported by this server: it calls no tools; "
                             "only 'none' and 'auto' (plain text) are.",
                             choices[i], s ? "'required'" : "naming a function");
    }
    if ((v = field(root, "modalities"))) {
        if (!json_is_array(v))
            return type_error(e, "modalities", "an array of strings", v);
        size_t i;
        json_t *m;
        json_array_foreach(v, i, m)
        {
            if (!json_is_string(m))
                return type_error(e, "modalities", "an array of strings", m);
            if (strcmp(json_string_value(m), "text") != 0)
                return api_error_set(e, 400, INVALID, "modalities", "unsupported_parameter",
                                     "Only the 'text' modality is supported by this server, got "
                                     "'%.64s'.",
                                     json_string_value(m));
        }
    }
    if (field(root, "audio"))
        return api_error_set(e, 400, INVALID, "audio", "unsupported_parameter",
                             "'audio' output is not supported by this server: only the 'text' "
                             "modality is.");
    return 0;
}

static int parse_stop(json_t *root, api_request *r, api_error *e)
{
    json_t *v = field(root, "stop");
    if (!v)
        return 0;
    json_t *one[1] = {v};
    json_t **items = one;
    size_t n = 1;
    json_t *arr_items[API_MAX_STOP];
    if (json_is_array(v)) {
        n = json_array_size(v);
        if (n > API_MAX_STOP)
            return api_error_set(e, 400, INVALID, "stop", "invalid_value",
                                 "'stop' may hold at most %d strings, got %zu.", API_MAX_STOP, n);
        for (size_t i = 0; i < n; i++)
            arr_items[i] = json_array_get(v, i);
        items = arr_items;
    } else if (!json_is_string(v)) {
        return type_error(e, "stop", "a string or an array of strings", v);
    }
    for (size_t i = 0; i < n; i++) {
        if (!json_is_string(items[i]))
            return type_error(e, "stop", "a string or an array of strings", items[i]);
        size_t len = json_string_length(items[i]);
        if (len == 0 || len > API_MAX_STOP_BYTES)
            return api_error_set(e, 400, INVALID, "stop", "invalid_value",
                                 "each stop string must be 1 to %d bytes long, got %zu.",
                                 API_MAX_STOP_BYTES, len);
        r->stop[r->n_stop] = dup_n(json_string_value(items[i]), len);
        if (!r->stop[r->n_stop])
            return api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        r->n_stop++;
    }
    return 0;
}

/* The sampling controls (docs/api.md "Sampling controls") into r->samp, allocated when one
 * differs from its default. vLLM's ranges: presence and frequency [-2, 2], repetition
 * (0, 2], logit_bias values [-100, 100] (OpenAI's), min_tokens >= 0 and <= max_tokens;
 * ignore_eos (vLLM's extension) a boolean. */
static int parse_sampling(json_t *root, api_request *r, api_error *e)
{
    proto_sampling s = {.repetition = 1.0f};
    double pres = 0, freq = 0, rep = 1;
    json_int_t iv;
    int present;
    if (get_number(root, "presence_penalty", -2, 0, 2, &pres, e) ||
        get_number(root, "frequency_penalty", -2, 0, 2, &freq, e) ||
        get_number(root, "repetition_penalty", 0, 1, 2, &rep, e))
        return -1;
    s.presence = (float)pres;
    s.frequency = (float)freq;
    s.repetition = (float)rep;
    int ignore_eos = 0;
    if (get_int(root, "min_tokens", &iv, &present, e) || get_bool(root, "ignore_eos", &ignore_eos, e))
        return -1;
    s.ignore_eos = ignore_eos;
    if (present) {
        if (iv < 0 || (r->max_tokens > 0 && iv > r->max_tokens) || iv > 1 << 24)
            return api_error_set(e, 400, INVALID, "min_tokens", "invalid_value",
                                 "'min_tokens' must be >= 0 and at most max_tokens, got %lld.",
                                 (long long)iv);
        s.min_tokens = (int)iv;
    }
    json_t *v = field(root, "logit_bias");
    if (v) {
        if (!json_is_object(v))
            return type_error(e, "logit_bias", "an object mapping token ids to numbers", v);
        if (json_object_size(v) > PROTO_MAX_BIAS)
            return api_error_set(e, 400, INVALID, "logit_bias", "invalid_value",
                                 "'logit_bias' may hold at most %d entries, got %zu.",
                                 PROTO_MAX_BIAS, json_object_size(v));
        const char *key;
        json_t *b;
        json_object_foreach(v, key, b)
        {
            /* canonical decimal only ("0", "17"): "01", "+1", " 1", "1e2" would name a
             * token by another spelling (and "1" and "01" could both be given) */
            size_t kl = strspn(key, "0123456789");
            int canonical = kl > 0 && key[kl] == '\0' && kl <= 10 && (key[0] != '0' || kl == 1);
            long long id = canonical ? strtoll(key, NULL, 10) : -1;
            if (!canonical || id > API_MAX_TOKEN_ID)
                return api_error_set(e, 400, INVALID, "logit_bias", "invalid_value",
                                     "'logit_bias' keys must be token ids (decimal integers "
                                     ">= 0 without sign, spaces or leading zeros), got "
                                     "'%.32s'.",
                                     key);
            double d = json_is_number(b) ? json_number_value(b) : NAN;
            if (!isfinite(d) || d < -100 || d > 100)
                return api_error_set(e, 400, INVALID, "logit_bias", "invalid_value",
                                     "'logit_bias' values must be numbers in [-100, 100]; token "
                                     "%lld has %s.",
                                     id, json_is_number(b) ? "one out of range" : "no number");
            s.bias_ids[s.n_bias] = (int)id;
            s.bias[s.n_bias++] = (float)d;
        }
    }
    if ((v = field(root, "stop_token_ids"))) {
        if (!json_is_array(v))
            return type_error(e, "stop_token_ids", "an array of token ids", v);
        if (json_array_size(v) > PROTO_MAX_STOP_IDS)
            return api_error_set(e, 400, INVALID, "stop_token_ids", "invalid_value",
                                 "'stop_token_ids' may hold at most %d ids, got %zu.",
                                 PROTO_MAX_STOP_IDS, json_array_size(v));
        size_t i;
        json_t *x;
        json_array_foreach(v, i, x)
        {
            if (!json_is_integer(x) || json_integer_value(x) < 0 ||
                json_integer_value(x) > API_MAX_TOKEN_ID)
                return api_error_set(e, 400, INVALID, "stop_token_ids", "invalid_value",
                                     "'stop_token_ids[%zu]' must be a token id (an integer >= "
                                     "0).",
                                     i);
            s.stop_ids[s.n_stop++] = (int)json_integer_value(x);
        }
    }
    if (s.presence == 0 && s.frequency == 0 && s.repetition == 1.0f && s.min_tokens == 0 &&
        s.n_bias == 0 && s.n_stop == 0 && !s.ignore_eos)
        return 0;
    r->samp = malloc(sizeof(*r->samp));
    if (!r->samp)
        return api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    *r->samp = s;
    return 0;
}

int api_check_sampling(const api_request *r, int vocab, api_error *err)
{
    if (!r->samp)
        return 0;
    for (int i = 0; i < r->samp->n_bias; i++)
        if (r->samp->bias_ids[i] >= vocab)
            return api_error_set(err, 400, INVALID, "logit_bias", "invalid_value",
                                 "'logit_bias' names token %d; the vocabulary has %d tokens.",
                                 r->samp->bias_ids[i], vocab);
    for (int i = 0; i < r->samp->n_stop; i++)
        if (r->samp->stop_ids[i] >= vocab)
            return api_error_set(err, 400, INVALID, "stop_token_ids", "invalid_value",
                                 "'stop_token_ids' names token %d; the vocabulary has %d "
                                 "tokens.",
                                 r->samp->stop_ids[i], vocab);
    return 0;
}

/* Chat: "logprobs" (boolean) and "top_logprobs" (0..20, only with "logprobs": true);
 * completions: "logprobs" (0..5). Into r->logprobs (0, or alternatives + 1). */
static int parse_logprobs(json_t *root, api_request *r, api_error *e)
{
    json_int_t iv = 0;
    int present = 0;
    if (r->kind == API_CHAT) {
        int on = 0;
        if (get_bool(root, "logprobs", &on, e) || get_int(root, "top_logprobs", &iv, &present, e))
            return -1;
        if (present && !on)
            return api_error_set(e, 400, INVALID, "top_logprobs", "invalid_value",
                                 "'top_logprobs' requires 'logprobs' to be true.");
        if (present && (iv < 0 || iv > API_MAX_TOP_LOGPROBS_CHAT))
            return api_error_set(e, 400, INVALID, "top_logprobs", "invalid_value",
                                 "'top_logprobs' must be an integer from 0 to %d, got %lld.",
                                 API_MAX_TOP_LOGPROBS_CHAT, (long long)iv);
        r->logprobs = on ? (int)iv + 1 : 0;
    } else if (r->kind == API_COMPLETIONS) {
        if (get_int(root, "logprobs", &iv, &present, e))
            return -1;
        if (present && (iv < 0 || iv > API_MAX_LOGPROBS_COMPLETIONS))
            return api_error_set(e, 400, INVALID, "logprobs", "invalid_value",
                                 "'logprobs' must be an integer from 0 to %d, got %lld.",
                                 API_MAX_LOGPROBS_COMPLETIONS, (long long)iv);
        r->logprobs = present ? (int)iv + 1 : 0;
        if (get_bool(root, "echo", &r->echo, e))
            return -1;
    }
    return 0;
}

static int parse_fields(json_t *root, api_request *r, api_error *e)
{
    json_t *v;
    json_int_t iv;
    int present;

    if ((v = field(root, "model"))) {
        if (!json_is_string(v))
            return type_error(e, "model", "a string", v);
        r->model = dup_n(json_string_value(v), json_string_length(v));
        if (!r->model)
            return api_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    int rc = r->kind == API_COMPLETIONS ? parse_prompt(root, r, e)
             : r->kind == API_CHAT      ? parse_messages(root, r, e)
                                        : parse_input(root, r, e);
    if (rc || (r->kind == API_RESPONSES && check_responses_fields(root, r, e)) ||
        (r->kind == API_CHAT && check_chat_fields(root, e)))
        return -1;

    /* max_tokens; chat also takes max_completion_tokens (which wins when both are given);
     * the Responses API max_output_tokens */
    const char *mt_key = r->kind == API_RESPONSES ? "max_output_tokens" : "max_tokens";
    if (r->kind == API_CHAT && field(root, "max_completion_tokens"))
        mt_key = "max_completion_tokens";
    r->max_tokens = -1;
    if (get_int(root, mt_key, &iv, &present, e))
        return -1;
    if (present) {
        if (iv < 1 || iv > 1 << 24)
            return api_error_set(e, 400, INVALID, mt_key, "invalid_value",
                                 "'%s' must be at least 1 (and at most the context length), "
                                 "got %lld.",
                                 mt_key, (long long)iv);
        r->max_tokens = (int)iv;
    }

    r->temperature = 1.0;
    r->top_p = 1.0;
    if (get_number(root, "temperature", 0, 0, 2, &r->temperature, e) ||
        get_number(root, "top_p", 0, 1, 1, &r->top_p, e))
        return -1;
    if (get_int(root, "top_k", &iv, &present, e))
        return -1;
    if (present) {
        if (iv < -1 || iv > 1 << 24)
            return api_error_set(e, 400, INVALID, "top_k", "invalid_value",
                                 "'top_k' must be -1 or 0 (off) or a positive integer, got "
                                 "%lld.",
                                 (long long)iv);
        r->top_k = iv < 0 ? 0 : (int)iv;
    }
    if (get_int(root, "seed", &iv, &present, e))
        return -1;
    if (present) {
        r->has_seed = 1;
        r->seed = (uint64_t)iv;
    }
    if (parse_stop(root, r, e) || get_bool(root, "stream", &r->stream, e))
        return -1;
    if ((v = field(root, "stream_options"))) {
        if (!json_is_object(v))
            return type_error(e, "stream_options", "an object", v);
        json_t *iu = json_object_get(v, "include_usage");
        if (iu && !json_is_null(iu) && !json_is_boolean(iu))
            return type_error(e, "stream_options", "a boolean include_usage", iu);
        r->include_usage = iu && json_is_true(iu);
        /* as OpenAI and vLLM: a client that forgot "stream" would get no usage chunk */
        if (!r->stream && r->kind != API_RESPONSES)
            return api_error_set(e, 400, INVALID, "stream_options", "invalid_value",
                                 "'stream_options' is only allowed when 'stream' is true.");
    }
    if ((v = field(root, "service_tier"))) {
        if (!json_is_string(v))
            return type_error(e, "service_tier", "a string", v);
        const char *t = json_string_value(v);
        if (strcmp(t, "flex") == 0)
            r->offline = 1;
        else if (strcmp(t, "auto") != 0 && strcmp(t, "default") != 0)
            return api_error_set(e, 400, INVALID, "service_tier", "invalid_value",
                                 "'service_tier' must be 'auto', 'default' or 'flex', got "
                                 "'%.64s'.",
                                 t);
    }
    r->mtp_depth = -1;
    if (get_int(root, "mtp_depth", &iv, &present, e))
        return -1;
    if (present) {
        if (iv < 0 || iv > 2)
            return api_error_set(e, 400, INVALID, "mtp_depth", "invalid_value",
                                 "'mtp_depth' must be 0, 1 or 2, got %lld.", (long long)iv);
        r->mtp_depth = (int)iv;
    }
    r->n = 1;
    if (r->kind != API_RESPONSES && get_int(root, "n", &iv, &present, e))
        return -1;
    if (r->kind != API_RESPONSES && present) {
        if (iv < 1 || iv > API_MAX_N)
            return api_error_set(e, 400, INVALID, "n", "invalid_value",
                                 "'n' must be an integer from 1 to %d, got %lld.", API_MAX_N,
                                 (long long)iv);
        r->n = (int)iv;
        if ((long long)r->n * r->n_prompts > API_MAX_CHOICES)
            return api_error_set(e, 400, INVALID, "n", "invalid_value",
                                 "%d prompts with n = %d ask for %lld choices; at most %d are "
                                 "served in one request.",
                                 r->n_prompts, r->n, (long long)r->n * r->n_prompts,
                                 API_MAX_CHOICES);
    }
    if ((v = field(root, "user")) && !json_is_string(v))
        return type_error(e, "user", "a string", v);
    if (parse_sampling(root, r, e))
        return -1;

    if (parse_logprobs(root, r, e))
        return -1;

    /* Features we cannot honour are refused rather than silently ignored: logprobs are
     * parsed above for chat and completions (top_logprobs is chat's alone). */
    static const char *unsupported[] = {"logprobs", "top_logprobs", "echo",
                                        "suffix",   "tools",        "functions"};
    for (size_t i = 0; i < sizeof(unsupported) / sizeof(unsupported[0]); i++) {
        if ((i == 0 && r->kind != API_RESPONSES) || (i == 1 && r->kind == API_CHAT) ||
            (i == 2 && r->kind == API_COMPLETIONS))
            continue;
        v = json_object_get(root, unsupported[i]);
        if (is_set(v) && !(json_is_object(v) && json_object_size(v) == 0) &&
            !(json_is_array(v) && json_array_size(v) == 0))
            return api_error_set(e, 400, INVALID, unsupported[i], "unsupported_parameter",
                                 "'%s' is not supported by this server.", unsupported[i]);
    }
    /* best_of (completions): best_of sequences per prompt, the n with the highest
     * cumulative log-probability returned (OpenAI's and vLLM's rule); not streamed */
    r->best_of = r->n;
    if (r->kind == API_COMPLETIONS && get_int(root, "best_of", &iv, &present, e))
        return -1;
    if (r->kind != API_COMPLETIONS || !present)
        return 0;
    if (iv < r->n)
        return api_error_set(e, 400, INVALID, "best_of", "invalid_value",
                             "'best_of' must be at least 'n' (%d), got %lld.", r->n, (long long)iv);
    if (iv > API_MAX_N || iv * r->n_prompts > API_MAX_CHOICES)
        return api_error_set(e, 400, INVALID, "best_of", "invalid_value",
                             "'best_of' must be at most %d and %d prompts x best_of at most %d; "
                             "got best_of = %lld.", API_MAX_N, r->n_prompts, API_MAX_CHOICES,
                             (long long)iv);
    if (iv > r->n && r->stream)
        return api_error_set(e, 400, INVALID, "best_of", "invalid_value",
                             "'best_of' greater than 'n' cannot be streamed (the best choices "
                             "are known at the end); got best_of = %lld with n = %d.",
                             (long long)iv, r->n);
    r->best_of = (int)iv;
    return 0;
}

int api_parse(api_kind_t kind, const char *body, size_t len, api_request *out, api_error *err)
{
    memset(out, 0, sizeof(*out));
    out->kind = kind;
    if (!api_utf8_valid(body, len))
        return api_error_set(err, 400, INVALID, NULL, "invalid_encoding",
                             "The request body is not valid UTF-8.");
    json_error_t jerr;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
    if (!root)
        return api_error_set(err, 400, INVALID, NULL, "invalid_json",
                             "We could not parse the JSON body of your request (%s at line "
                             "%d, column %d).",
                             jerr.text, jerr.line, jerr.column);
    int rc = 0;
    if (!json_is_object(root))
        rc = api_error_set(err, 400, INVALID, NULL, "invalid_type",
                           "The request body must be a JSON object, got %s.", api_json_type_name(root));
    else
        rc = parse_fields(root, out, err);
    json_decref(root);
    if (rc) {
        api_request_free(out);
        out->kind = kind;
    }
    return rc;
}

int api_check_model(const api_request *r, const char *served_model, api_error *err)
{
    if (!r->model || strcmp(r->model, served_model) == 0)
        return 0;
    return api_error_set(err, 404, INVALID, "model", "model_not_found",
                         "The model '%.200s' does not exist; this server serves '%.200s'.",
                         r->model, served_model);
}

int api_check_length(api_request *r, int n_prompt, int n_ctx, api_error *err)
{
    const char *pkey = r->kind == API_CHAT        ? "messages"
                       : r->kind == API_RESPONSES ? "input"
                                                  : "prompt";
    if (r->prompt_ids ? n_prompt < 1 : (r->prompt_len == 0 || n_prompt <= 1))
        return api_error_set(err, 400, INVALID, pkey, "invalid_value",
                             "The prompt must not be empty.");
    if (n_prompt >= n_ctx)
        return api_error_set(err, 400, INVALID, pkey, "context_length_exceeded",
                             "This model's maximum context length is %d tokens, but the "
                             "prompt is %d tokens (at least one token must be left for the "
                             "completion).",
                             n_ctx, n_prompt);
    if (r->max_tokens < 0) {
        r->max_tokens = n_ctx - n_prompt;
        /* parse_sampling could check min_tokens only against a max_tokens given */
        if (r->samp && r->samp->min_tokens > r->max_tokens)
            return api_error_set(err, 400, INVALID, "min_tokens", "invalid_value",
                                 "'min_tokens' must be >= 0 and at most max_tokens, got %d; "
                                 "without max_tokens at most the %d tokens the context leaves "
                                 "after the prompt of %d tokens.",
                                 r->samp->min_tokens, r->max_tokens, n_prompt);
        return 0;
    }
    if ((long long)n_prompt + r->max_tokens > n_ctx)
        return api_error_set(err, 400, INVALID,
                             r->kind == API_CHAT        ? "max_completion_tokens"
                             : r->kind == API_RESPONSES ? "max_output_tokens"
                                                        : "max_tokens",
                             "context_length_exceeded",
                             "This model's maximum context length is %d tokens. However, you "
                             "requested %lld tokens (%d in the prompt, %d for the completion). "
                             "Please reduce the prompt or max_tokens.",
                             n_ctx, (long long)n_prompt + r->max_tokens, n_prompt, r->max_tokens);
    return 0;
}

// --- formatting

static char *dump(json_t *root)
{
    if (!root)
        return NULL;
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}

char *api_error_json(const api_error *e)
{
    json_t *inner = json_pack("{s:s, s:s, s:s?, s:s?}", "message", e->message, "type",
                              e->type ? e->type : INVALID, "param", e->param, "code", e->code);
    if (!inner)
        return NULL;
    return dump(json_pack("{s:o}", "error", inner));
}

static json_t *usage_obj(int n_prompt, int n_completion)
{
    return json_pack("{s:i, s:i, s:i}", "prompt_tokens", n_prompt, "completion_tokens",
                     n_completion, "total_tokens", n_prompt + n_completion);
}

/* json_stringn_nocheck would accept invalid UTF-8; json_stringn validates. */
static json_t *text_or_null(const char *text, size_t len)
{
    return text ? json_stringn(text, len) : json_null();
}

int api_token_chars(const char *s, size_t n)
{
    int chars = 0;
    for (size_t i = 0; i < n; chars++) {
        int k = utf8_seq((const unsigned char *)s + i, n - i);
        i += k > 0 ? (size_t)k : 1;
    }
    return chars;
}

/* A token's bytes as a JSON string: whole characters as they are, every other byte as
 * U+FFFD. NULL on out of memory. */
static json_t *token_string(const char *s, size_t n)
{
    if (n == 0)
        return json_string("");
    char stack[256] = "", *buf = n * 3 <= sizeof(stack) ? stack : malloc(n * 3 + 1);
    if (!buf)
        return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        int k = utf8_seq((const unsigned char *)s + i, n - i);
        if (k > 0) {
            memcpy(buf + o, s + i, (size_t)k);
            o += (size_t)k;
            i += (size_t)k;
        } else {
            memcpy(buf + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
    }
    json_t *t = json_stringn(buf, o);
    if (buf != stack)
        free(buf);
    return t;
}

static json_t *token_bytes(const char *s, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++)
        if (json_array_append_new(a, json_integer((unsigned char)s[i])) < 0) {
            json_decref(a);
            return NULL;
        }
    return a;
}

/* A log-probability as JSON: -inf (a token the model gives probability 0) is not JSON;
 * OpenAI and vLLM show -9999.0 there. */
static json_t *lp_real(float v)
{
    return json_real(isfinite(v) ? (double)v : -9999.0);
}

/* chat: {token, logprob, bytes} */
static json_t *chat_token(const char *s, size_t n, float lp)
{
    return json_pack("{s:o, s:o, s:o}", "token", token_string(s, n), "logprob", lp_real(lp),
                     "bytes", token_bytes(s, n));
}

json_t *api_logprobs_json(api_kind_t kind, const api_logprobs *lp)
{
    int top = lp->top;
    if (kind == API_CHAT) {
        json_t *content = json_array();
        for (int i = 0; content && i < lp->n; i++) {
            const api_logprob *x = &lp->e[i];
            json_t *alts = json_array();
            for (int j = 0; alts && j < x->n_top && j < top; j++)
                if (json_array_append_new(alts, chat_token(x->top_text[j], x->top_len[j],
                                                           x->top_logprob[j])) < 0) {
                    json_decref(alts);
                    alts = NULL;
                }
            json_t *one = chat_token(x->text, x->len, x->logprob);
            if (!one || !alts || json_object_set_new(one, "top_logprobs", alts) < 0 ||
                json_array_append_new(content, one) < 0) {
                json_decref(one);
                json_decref(content);
                content = NULL;
            }
        }
        return content ? json_pack("{s:o, s:n}", "content", content, "refusal") : NULL;
    }
    json_t *tokens = json_array(), *lps = json_array(), *tops = json_array(),
           *offs = json_array();
    int off = lp->text_offset, ok = tokens && lps && tops && offs;
    for (int i = 0; ok && i < lp->n; i++) {
        const api_logprob *x = &lp->e[i];
        if (x->null_logprob) { /* echo's first prompt token */
            ok = json_array_append_new(tokens, token_string(x->text, x->len)) == 0 &&
                 json_array_append_new(lps, json_null()) == 0 &&
                 json_array_append_new(tops, json_null()) == 0 &&
                 json_array_append_new(offs, json_integer(off)) == 0;
            off += api_token_chars(x->text, x->len);
            continue;
        }
        json_t *d = json_object();
        for (int j = 0; d && j < x->n_top && j < top; j++) {
            /* alternatives that show the same text (byte tokens as U+FFFD, BOS and EOS as
             * ""): the first, most likely, keeps the key */
            json_t *k = token_string(x->top_text[j], x->top_len[j]);
            if (!k || (!json_object_get(d, json_string_value(k)) &&
                       json_object_set_new(d, json_string_value(k), lp_real(x->top_logprob[j]))))
                ok = 0;
            json_decref(k);
        }
        ok = ok && d && json_array_append_new(tokens, token_string(x->text, x->len)) == 0 &&
             json_array_append_new(lps, lp_real(x->logprob)) == 0 &&
             json_array_append_new(tops, d) == 0 &&
             json_array_append_new(offs, json_integer(off)) == 0;
        off += api_token_chars(x->text, x->len);
    }
    if (!ok) {
        json_decref(tokens);
        json_decref(lps);
        json_decref(tops);
        json_decref(offs);
        return NULL;
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", tokens, "token_logprobs", lps,
                     "top_logprobs", tops, "text_offset", offs);
}

static json_t *logprobs_or_null(api_kind_t kind, const api_logprobs *lp)
{
    return lp ? api_logprobs_json(kind, lp) : json_null();
}

char *api_format_response_n(const api_response_info *info, const api_choice *choices, int n,
                            int n_prompt, int n_completion)
{
    json_t *arr = json_array();
    if (!arr)
        return NULL;
    for (int i = 0; i < n; i++) {
        const api_choice *ch = &choices[i];
        json_t *t = json_stringn(ch->text ? ch->text : "", ch->text ? ch->len : 0);
        if (!t) {
            json_decref(arr);
            return NULL;
        }
        json_t *choice;
        json_t *lp = logprobs_or_null(info->kind, ch->logprobs);
        if (info->kind == API_CHAT)
            choice = json_pack("{s:i, s:{s:s, s:o}, s:o, s:s}", "index", i, "message", "role",
                               "assistant", "content", t, "logprobs", lp, "finish_reason",
                               ch->finish_reason);
        else
            choice = json_pack("{s:i, s:o, s:o, s:s}", "index", i, "text", t, "logprobs", lp,
                               "finish_reason", ch->finish_reason);
        if (!choice || json_array_append_new(arr, choice) < 0) {
            json_decref(arr);
            return NULL;
        }
    }
    json_t *root = json_pack("{s:s, s:s, s:I, s:s, s:o, s:o}", "id", info->id, "object",
                             info->kind == API_CHAT ? "chat.completion" : "text_completion",
                             "created", (json_int_t)info->created, "model", info->model, "choices",
                             arr, "usage", usage_obj(n_prompt, n_completion));
    if (root && info->service_tier)
        json_object_set_new(root, "service_tier", json_string(info->service_tier));
    return dump(root);
}

char *api_format_response(const api_response_info *info, const char *text, size_t len,
                          const char *finish_reason, int n_prompt, int n_completion)
{
    api_choice ch = {text, len, finish_reason, NULL};
    return api_format_response_n(info, &ch, 1, n_prompt, n_completion);
}

static char *format_chunk(const api_response_info *info, const char *text, size_t len,
                          const char *finish_reason, int role_chunk, const api_logprobs *lp);

char *api_format_chunk(const api_response_info *info, const char *text, size_t len,
                       const char *finish_reason, int role_chunk)
{
    return format_chunk(info, text, len, finish_reason, role_chunk, NULL);
}

char *api_format_chunk_logprobs(const api_response_info *info, const char *text, size_t len,
                                const char *finish_reason, const api_logprobs *lp)
{
    return format_chunk(info, text, len, finish_reason, 0, lp);
}

static char *format_chunk(const api_response_info *info, const char *text, size_t len,
                          const char *finish_reason, int role_chunk, const api_logprobs *lp)
{
    json_t *choice;
    if (info->kind == API_CHAT) {
        json_t *delta = json_object();
        if (!delta)
            return NULL;
        if (role_chunk) {
            json_object_set_new(delta, "role", json_string("assistant"));
            json_object_set_new(delta, "content", json_string(""));
        } else if (text) {
            json_t *t = json_stringn(text, len);
            if (!t) {
                json_decref(delta);
                return NULL;
            }
            json_object_set_new(delta, "content", t);
        }
        choice = json_pack("{s:i, s:o, s:o, s:s?}", "index", info->index, "delta", delta,
                           "logprobs", logprobs_or_null(info->kind, lp), "finish_reason",
                           finish_reason);
    } else {
        json_t *t = text_or_null(text ? text : "", text ? len : 0);
        if (!t)
            return NULL;
        choice = json_pack("{s:i, s:o, s:o, s:s?}", "index", info->index, "text", t, "logprobs",
                           logprobs_or_null(info->kind, lp), "finish_reason", finish_reason);
    }
    if (!choice)
        return NULL;
    json_t *root =
        json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", info->id, "object",
                  info->kind == API_CHAT ? "chat.completion.chunk" : "text_completion", "created",
                  (json_int_t)info->created, "model", info->model, "choices", choice);
    if (root && info->service_tier)
        json_object_set_new(root, "service_tier", json_string(info->service_tier));
    if (root && info->include_usage)
        json_object_set_new(root, "usage", json_null());
    return dump(root);
}

// --- content chunks without jansson (the per-token path of streaming)

/* Append s (n bytes of valid UTF-8) as a JSON string, quotes included, escaped exactly as
 * json_dumps does with no flags: \" \\ \b \f \n \r \t, other bytes below 0x20 as
 * \u00XX (upper-case hex), everything else as is. dst has room for 6 n + 2 bytes. */
static char *put_json_string(char *dst, const char *s, size_t n)
{
    static const char hex[] = "0123456789ABCDEF";
    *dst++ = '"';
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch >= 0x20 && ch != '"' && ch != '\\') {
            *dst++ = (char)ch;
            continue;
        }
        *dst++ = '\\';
        switch (ch) {
        case '"': *dst++ = '"'; break;
        case '\\': *dst++ = '\\'; break;
        case '\b': *dst++ = 'b'; break;
        case '\f': *dst++ = 'f'; break;
        case '\n': *dst++ = 'n'; break;
        case '\r': *dst++ = 'r'; break;
        case '\t': *dst++ = 't'; break;
        default:
            memcpy(dst, "u00", 3);
            dst[3] = hex[ch >> 4];
            dst[4] = hex[ch & 15];
            dst += 5;
        }
    }
    *dst++ = '"';
    return dst;
}

static char *put(char *dst, const char *s, size_t n)
{
    memcpy(dst, s, n);
    return dst + n;
}
#define PUT_LIT(d, lit) put(d, lit, sizeof(lit) - 1)

size_t api_text_chunk_bound(const api_response_info *info, size_t len)
{
    size_t st = info->service_tier ? strlen(info->service_tier) : 0;
    return 224 + 6 * (strlen(info->id) + strlen(info->model) + st + len);
}

size_t api_format_text_chunk(const api_response_info *info, const char *text, size_t len,
                             char *out)
{
    if (!api_utf8_valid(text, len))
        return 0;
    int chat = info->kind == API_CHAT;
    char *d = out;
    d = PUT_LIT(d, "{\"id\":");
    d = put_json_string(d, info->id, strlen(info->id));
    d = chat ? PUT_LIT(d, ",\"object\":\"chat.completion.chunk\",\"created\":")
             : PUT_LIT(d, ",\"object\":\"text_completion\",\"created\":");
    d += sprintf(d, "%" PRId64, info->created);
    d = PUT_LIT(d, ",\"model\":");
    d = put_json_string(d, info->model, strlen(info->model));
    d = PUT_LIT(d, ",\"choices\":[{\"index\":");
    d += sprintf(d, "%d", info->index);
    d = chat ? PUT_LIT(d, ",\"delta\":{\"content\":") : PUT_LIT(d, ",\"text\":");
    d = put_json_string(d, text, len);
    if (chat)
        *d++ = '}';
    d = PUT_LIT(d, ",\"logprobs\":null,\"finish_reason\":null}]");
    if (info->service_tier) {
        d = PUT_LIT(d, ",\"service_tier\":");
        d = put_json_string(d, info->service_tier, strlen(info->service_tier));
    }
    if (info->include_usage)
        d = PUT_LIT(d, ",\"usage\":null");
    *d++ = '}';
    *d = 0;
    return (size_t)(d - out);
}

char *api_format_usage_chunk(const api_response_info *info, int n_prompt, int n_completion)
{
    json_t *root = json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", info->id, "object",
                             info->kind == API_CHAT ? "chat.completion.chunk" : "text_completion",
                             "created", (json_int_t)info->created, "model", info->model,
                             "choices", "usage", usage_obj(n_prompt, n_completion));
    if (root && info->service_tier)
        json_object_set_new(root, "service_tier", json_string(info->service_tier));
    return dump(root);
}

json_t *api_model_card(const char *model, int64_t created, int n_ctx, int mtp_depth)
{
    return json_pack("{s:s, s:s, s:I, s:s, s:s, s:i, s:o}", "id", model, "object", "model",
                     "created", (json_int_t)created, "owned_by", "tidepool", "root", model,
                     "max_model_len", n_ctx, "mtp_depth",
                     mtp_depth < 0 ? json_null() : json_integer(mtp_depth));
}

char *api_format_models(const char *model, int64_t created, int n_ctx, int mtp_depth)
{
    json_t *card = api_model_card(model, created, n_ctx, mtp_depth);
    return dump(card ? json_pack("{s:s, s:[o]}", "object", "list", "data", card) : NULL);
}
