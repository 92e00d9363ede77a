/*
 * bench_workload: request bodies and arrival times of tidepool-bench (bench_workload.h).
 * The generator is splitmix64 used as a counter-based stream: (seed, stream, index) give
 * an independent state, so no draw depends on another request's.
 */
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bench_workload.h"

// --- random numbers (splitmix64: tiny, fast, good enough for workload shapes)

typedef struct {
    uint64_t s;
} rng_t;

static uint64_t rng_next(rng_t *r)
{
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* An independent stream for (seed, stream, index). */
static rng_t rng_stream(uint64_t seed, uint64_t stream, uint64_t index)
{
    rng_t r = {seed};
    r.s = rng_next(&r) ^ (stream * 0xD1B54A32D192ED03ull);
    r.s = rng_next(&r) ^ index;
    rng_next(&r);
    return r;
}

/* Uniform in [0, 1). */
static double rng_unit(rng_t *r)
{
    return (double)(rng_next(r) >> 11) * 0x1.0p-53;
}

/* Uniform integer in [lo, hi] (lo <= hi). */
static long long rng_range(rng_t *r, long long lo, long long hi)
{
    uint64_t span = (uint64_t)(hi - lo) + 1;
    return lo + (long long)(rng_next(r) % span);
}

enum {
    RNG_STREAM_REQUEST = 1,
    RNG_STREAM_ARRIVALS = 2,
    RNG_STREAM_SYSTEM = 3, /* multi-turn: the shared system prompt */
    RNG_STREAM_USER = 4,   /* multi-turn: user message j of conversation c */
    RNG_STREAM_REPLY = 5,  /* multi-turn: a synthetic reply (when the real one is missing) */
    RNG_STREAM_PREFIX = 6, /* shared-prefix: the prefix */
    RNG_STREAM_FILLER = 7, /* --trace: the text of the token pool */
};

// --- synthetic prompts

static const char *const words[64] = {
    "the", "a", "little", "girl", "boy", "cat", "dog", "sun", "tree", "ball", "red",
    "big", "happy", "sad", "day", "park", "ran", "saw", "played", "jumped", "and",
    "with", "to", "in", "was", "she", "he", "they", "friend", "mom", "home", "bird",
    "fish", "water", "sky", "blue", "green", "small", "went", "said", "looked", "found",
    "toy", "box", "car", "house", "garden", "flower", "apple", "cake", "rain", "night",
    "star", "moon", "bear", "rabbit", "duck", "hat", "shoe", "book", "door", "window",
    "road", "hill",
};

/* n_words words separated by single spaces. malloc'd; NULL on OOM. */
static char *words_text(rng_t *r, long long n_words, size_t *len)
{
    size_t cap = (size_t)n_words * 8 + 1, n = 0; /* longest word is 7 bytes, plus a space */
    char *s = malloc(cap);
    if (!s)
        return NULL;
    for (long long i = 0; i < n_words; i++) {
        const char *w = words[rng_next(r) % 64];
        size_t k = strlen(w);
        if (i > 0)
            s[n++] = ' ';
        memcpy(s + n, w, k);
        n += k;
    }
    s[n] = 0;
    *len = n;
    return s;
}

/* Number of whitespace-separated words in s (the estimate of a prompt's tokens when the
 * server reports no usage). */
static long long count_words(const char *s)
{
    long long n = 0;
    int in = 0;
    for (; *s; s++) {
        int sp = *s == ' ' || *s == '\n' || *s == '\t' || *s == '\r';
        if (!sp && !in)
            n++;
        in = !sp;
    }
    return n;
}

/* Words in a prompt string or in the string contents of a messages array. */
static long long json_words(const json_t *obj)
{
    const json_t *p = json_object_get(obj, "prompt");
    if (json_is_string(p))
        return count_words(json_string_value(p));
    long long n = 0;
    size_t i;
    const json_t *m;
    json_array_foreach(json_object_get(obj, "messages"), i, m) {
        const json_t *c = json_object_get(m, "content");
        if (json_is_string(c)) {
            n += count_words(json_string_value(c));
        } else if (json_is_array(c)) { /* content parts: [{"type": "text", "text": ...}] */
            size_t j;
            const json_t *part;
            json_array_foreach(c, j, part) {
                const json_t *t = json_object_get(part, "text");
                if (json_is_string(t))
                    n += count_words(json_string_value(t));
            }
        }
    }
    return n;
}

char *bench_workload_filler(long long seed, long long n_words, size_t *len)
{
    rng_t r = rng_stream((uint64_t)seed, RNG_STREAM_FILLER, 0);
    return words_text(&r, n_words, len);
}

// --- multi-turn and shared-prefix prompts

int bench_workload_multi_turn(const bench_args *a)
{
    return strcmp(a->workload, "multi-turn") == 0;
}

int bench_workload_shared_prefix(const bench_args *a)
{
    return strcmp(a->workload, "shared-prefix") == 0;
}

size_t bench_workload_n_requests(const bench_args *a)
{
    if (bench_workload_multi_turn(a))
        return (size_t)a->conversations * (size_t)a->turns;
    return (size_t)a->num_prompts;
}

long long bench_workload_after(const bench_args *a, size_t idx)
{
    if (!bench_workload_multi_turn(a) || idx < (size_t)a->conversations)
        return -1;
    return (long long)(idx - (size_t)a->conversations);
}

/* Words of one multi-turn user message: --input-len, or drawn from --input-len-range. */
static long long user_len(const bench_args *a, rng_t *r)
{
    return a->input_range[0] >= 0 ? rng_range(r, a->input_range[0], a->input_range[1])
                                  : a->input_len;
}

/* A json string of n words from stream (stream, index); NULL on OOM. */
static json_t *words_json(const bench_args *a, uint64_t stream, uint64_t index, long long n)
{
    rng_t r = rng_stream((uint64_t)a->seed, stream, index);
    size_t len;
    char *t = words_text(&r, n, &len);
    json_t *s = t ? json_stringn(t, len) : NULL;
    free(t);
    return s;
}

/* The messages of multi-turn request idx (turn t = idx / C of conversation c = idx % C):
 * the system prompt, then user and assistant messages of turns 0..t-1 (the replies those
 * requests received, via a->reply_of, else synthetic ones of max_tokens words), then user
 * message t. NULL on OOM. */
static json_t *multi_turn_messages(const bench_args *a, size_t idx, long long out)
{
    size_t C = (size_t)a->conversations, t = idx / C, c = idx % C;
    json_t *msgs = json_array();
    if (!msgs)
        return NULL;
    int ok = 1;
    if (a->system_len > 0)
        ok &= json_array_append_new(msgs, json_pack("{s:s, s:o*}", "role", "system", "content",
                                                    words_json(a, RNG_STREAM_SYSTEM, 0,
                                                               a->system_len))) == 0;
    for (size_t j = 0; ok && j <= t; j++) {
        uint64_t key = (uint64_t)c * (uint64_t)a->turns + j;
        rng_t lr = rng_stream((uint64_t)a->seed, RNG_STREAM_USER + 16, key);
        json_t *u = words_json(a, RNG_STREAM_USER, key, user_len(a, &lr));
        ok &= json_array_append_new(msgs, json_pack("{s:s, s:o*}", "role", "user", "content", u)) ==
              0;
        if (j == t)
            break;
        const char *reply = a->reply_of ? a->reply_of(a->reply_ctx, j * C + c) : NULL;
        json_t *rs = reply ? json_string(reply) : words_json(a, RNG_STREAM_REPLY, key, out);
        ok &= json_array_append_new(msgs, json_pack("{s:s, s:o*}", "role", "assistant",
                                                    "content", rs)) == 0;
    }
    if (!ok) {
        json_decref(msgs);
        return NULL;
    }
    return msgs;
}

/* messages as one completion prompt: the system text, then "\n\nUser: ..." and
 * "\nAssistant:" + the reply for each turn, ending with "\nAssistant:". NULL on OOM. */
static json_t *messages_prompt(const json_t *msgs)
{
    size_t cap = 256, n = 0, i;
    char *s = malloc(cap);
    const json_t *m;
    if (!s)
        return NULL;
    s[0] = 0;
    json_array_foreach(msgs, i, m) {
        const char *role = json_string_value(json_object_get(m, "role"));
        const char *text = json_string_value(json_object_get(m, "content"));
        const char *pre = strcmp(role, "system") == 0 ? ""
                          : strcmp(role, "user") == 0 ? (i ? "\n\nUser: " : "User: ")
                                                      : "\nAssistant:";
        size_t need = n + strlen(pre) + strlen(text) + 16;
        if (need > cap) {
            while (cap < need)
                cap *= 2;
            char *ns = realloc(s, cap);
            if (!ns) {
                free(s);
                return NULL;
            }
            s = ns;
        }
        n += (size_t)sprintf(s + n, "%s%s", pre, text);
    }
    strcpy(s + n, "\nAssistant:");
    json_t *j = json_string(s);
    free(s);
    return j;
}

// --- arrivals

int bench_workload_phase_shift(const bench_args *a)
{
    return strcmp(a->workload, "phase-shift") == 0;
}

int bench_workload_phase_at(const bench_args *a, double t_s)
{
    return (int)((long long)floor(t_s / a->phase_s) % 2);
}

double bench_workload_next_arrival(const bench_args *a, double t_s, double e)
{
    if (a->decode_rate <= 0 || !bench_workload_phase_shift(a))
        return t_s + e / a->request_rate;
    long long k = (long long)floor(t_s / a->phase_s);
    for (;;) { /* k counts phases; boundaries come from k, never from t_s / phase_s again */
        double rate = k % 2 ? a->decode_rate : a->request_rate;
        double end = (double)(k + 1) * a->phase_s;
        if (t_s + e / rate <= end)
            return t_s + e / rate;
        e -= (end - t_s) * rate;
        t_s = end;
        k++;
    }
}

size_t bench_workload_arrivals(const bench_args *a, double *arrival_s, size_t n)
{
    rng_t ar = rng_stream((uint64_t)a->seed, RNG_STREAM_ARRIVALS, 0);
    double t = 0;
    for (size_t i = 0; i < n; i++) {
        if (i > 0 && isfinite(a->request_rate))
            t = bench_workload_next_arrival(a, t, -log(1.0 - rng_unit(&ar)));
        if (a->duration_s > 0 && t >= a->duration_s)
            return i; /* request 0 arrives at 0 < duration_s: i >= 1 */
        arrival_s[i] = t;
    }
    return n;
}

// --- request bodies

char *bench_workload_body(const bench_args *a, const bench_dataset_t *ds, const char *model,
                          int chat, size_t idx, int phase, bench_workload_shape *shape)
{
    rng_t r = rng_stream((uint64_t)a->seed, RNG_STREAM_REQUEST, idx);
    /* Always draw both lengths, in this order, so the stream is the same in every mode. */
    long long in = a->input_range[0] >= 0 ? rng_range(&r, a->input_range[0], a->input_range[1])
                                          : a->input_len;
    long long out = a->output_range[0] >= 0
                        ? rng_range(&r, a->output_range[0], a->output_range[1])
                        : a->output_len;
    if (phase == BENCH_WORKLOAD_PHASE_PREFILL)
        out = a->phase_short_len;
    else if (phase == BENCH_WORKLOAD_PHASE_DECODE)
        in = a->phase_short_len;
    json_t *body;
    if (ds) {
        body = json_deep_copy(bench_dataset_item(ds, idx % bench_dataset_size(ds)));
        if (!body)
            return NULL;
        shape->prompt_words = json_words(body);
        const json_t *p = json_object_get(body, "prompt");
        if (chat && json_is_string(p)) {
            json_t *msgs = json_pack("[{s:s, s:O}]", "role", "user", "content", p);
            if (!msgs || json_object_set_new(body, "messages", msgs) < 0) {
                json_decref(body);
                return NULL;
            }
            json_object_del(body, "prompt");
        }
    } else if (bench_workload_multi_turn(a)) {
        json_t *msgs = multi_turn_messages(a, idx, out);
        if (!msgs)
            return NULL;
        body = json_pack("{s:o}", "messages", msgs);
        if (!body)
            return NULL;
        shape->prompt_words = json_words(body);
        if (!chat) {
            json_t *p = messages_prompt(msgs);
            if (!p || json_object_set_new(body, "prompt", p) < 0) {
                json_decref(body);
                return NULL;
            }
            json_object_del(body, "messages");
        }
    } else {
        size_t len;
        char *text = words_text(&r, in, &len);
        if (!text)
            return NULL;
        shape->prompt_words = in;
        json_t *s = json_stringn(text, len);
        free(text);
        json_t *pre = NULL;
        if (bench_workload_shared_prefix(a)) { /* the prefix, then the request's own words */
            uint64_t group = 0; /* --prefix-groups: which prefix, drawn per prompt */
            if (a->prefix_groups > 1) {
                rng_t gr = rng_stream((uint64_t)a->seed, RNG_STREAM_PREFIX + 16, idx);
                group = (uint64_t)rng_range(&gr, 0, a->prefix_groups - 1);
            }
            pre = words_json(a, RNG_STREAM_PREFIX, group, a->prefix_len);
            shape->prompt_words += a->prefix_len;
            if (pre && s && !chat) {
                size_t n = json_string_length(pre) + json_string_length(s) + 2;
                char *both = malloc(n);
                if (both)
                    snprintf(both, n, "%s %s", json_string_value(pre), json_string_value(s));
                json_decref(s);
                s = both ? json_string(both) : NULL;
                free(both);
                json_decref(pre);
                pre = NULL;
            } else if (!pre) {
                json_decref(s);
                return NULL;
            }
        }
        if (pre) /* chat: the prefix is a system message */
            body = json_pack("{s:[{s:s, s:o}, {s:s, s:o*}]}", "messages", "role", "system",
                             "content", pre, "role", "user", "content", s);
        else
            body = chat ? json_pack("{s:[{s:s, s:o*}]}", "messages", "role", "user", "content", s)
                        : json_pack("{s:o*}", "prompt", s);
        if (!body)
            return NULL;
    }
    const json_t *ptext = json_object_get(body, "prompt");
    if (a->tokenize && json_is_string(ptext)) { /* --prompt-tokenizer: ids instead */
        int *ids = NULL;
        size_t n_ids = 0;
        json_t *arr = NULL;
        if (a->tokenize(a->tokenize_ctx, json_string_value(ptext), json_string_length(ptext),
                        &ids, &n_ids) == 0 && (arr = json_array())) {
            for (size_t i = 0; i < n_ids; i++)
                if (json_array_append_new(arr, json_integer(ids[i])) < 0) {
                    json_decref(arr);
                    arr = NULL;
                    break;
                }
        }
        free(ids);
        if (!arr || json_object_set_new(body, "prompt", arr) < 0) {
            json_decref(body);
            return NULL;
        }
    }
    const json_t *mt = json_object_get(body, "max_tokens");
    const json_t *mct = json_object_get(body, "max_completion_tokens");
    int ok = 1;
    if (json_is_integer(mt))
        shape->max_tokens = json_integer_value(mt);
    else if (json_is_integer(mct))
        shape->max_tokens = json_integer_value(mct);
    else {
        shape->max_tokens = out;
        ok &= json_object_set_new(body, "max_tokens", json_integer(out)) == 0;
    }
    ok &= json_object_set_new(body, "model", json_string(model)) == 0;
    ok &= json_object_set_new(body, "stream", json_true()) == 0;
    ok &= json_object_set_new(body, "stream_options", json_pack("{s:b}", "include_usage", 1)) ==
          0;
    if (!json_object_get(body, "temperature"))
        ok &= json_object_set_new(body, "temperature", json_real(a->temperature)) == 0;
    if (a->ignore_eos)
        ok &= json_object_set_new(body, "ignore_eos", json_true()) == 0;
    char *text = ok ? json_dumps(body, JSON_COMPACT) : NULL;
    json_decref(body);
    return text;
}
