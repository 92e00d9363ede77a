/*
 * bench/workload: what each request of tidepool-bench asks for. Part of tidepool-bench
 * (included once; everything is static).
 *
 * Every random choice comes from --seed through counter-based streams: request i draws
 * its lengths and words from its own generator (seed, i), and the Poisson arrival times
 * from another (seed, "arrivals"), so request i is the same whatever the timing, the
 * concurrency or the order in which requests finish. Synthetic prompts are words drawn
 * from a fixed list of 64 short, common English words (1-2 tokens each with most
 * tokenizers); lengths are counted in words, and the exact token count comes back in the
 * server's usage. A dataset (JSONL) gives prompts or chat messages instead; its lines are
 * used in file order, cycling when --num-prompts exceeds the number of lines.
 */
#ifndef TP_BENCH_WORKLOAD_H
#define TP_BENCH_WORKLOAD_H

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

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

enum { RNG_STREAM_REQUEST = 1, RNG_STREAM_ARRIVALS = 2 };

// --- synthetic prompts

static const char *const workload_words[64] = {
    "the", "a", "little", "girl", "boy", "cat", "dog", "sun", "tree", "ball", "red",
    "big", "happy", "sad", "day", "park", "ran", "saw", "played", "jumped", "and",
    "with", "to", "in", "was", "she", "he", "they", "friend", "mom", "home", "bird",
    "fish", "water", "sky", "blue", "green", "small", "went", "said", "looked", "found",
    "toy", "box", "car", "house", "garden", "flower", "apple", "cake", "rain", "night",
    "star", "moon", "bear", "rabbit", "duck", "hat", "shoe", "book", "door", "window",
    "road", "hill",
};

/* n_words words separated by single spaces. malloc'd; NULL on OOM. */
static char *workload_words_text(rng_t *r, long long n_words, size_t *len)
{
    size_t cap = (size_t)n_words * 8 + 1, n = 0; /* longest word is 7 bytes, plus a space */
    char *s = malloc(cap);
    if (!s)
        return NULL;
    for (long long i = 0; i < n_words; i++) {
        const char *w = workload_words[rng_next(r) % 64];
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
static long long workload_count_words(const char *s)
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

// --- dataset

typedef struct {
    json_t **items; /* one object per line, owned */
    size_t n;
} dataset_t;

static void dataset_free(dataset_t *ds)
{
    for (size_t i = 0; i < ds->n; i++)
        json_decref(ds->items[i]);
    free(ds->items);
    ds->items = NULL;
    ds->n = 0;
}

/* Words in a prompt string or in the string contents of a messages array. */
static long long workload_json_words(const json_t *obj)
{
    const json_t *p = json_object_get(obj, "prompt");
    if (json_is_string(p))
        return workload_count_words(json_string_value(p));
    long long n = 0;
    size_t i;
    const json_t *m;
    json_array_foreach(json_object_get(obj, "messages"), i, m) {
        const json_t *c = json_object_get(m, "content");
        if (json_is_string(c)) {
            n += workload_count_words(json_string_value(c));
        } else if (json_is_array(c)) { /* content parts: [{"type": "text", "text": ...}] */
            size_t j;
            const json_t *part;
            json_array_foreach(c, j, part) {
                const json_t *t = json_object_get(part, "text");
                if (json_is_string(t))
                    n += workload_count_words(json_string_value(t));
            }
        }
    }
    return n;
}

/* Load at most max_items lines of a JSONL file. Each non-blank line must be an object
 * with a string "prompt" or a non-empty array "messages" (the latter only for chat), and
 * an optional integer "max_tokens" >= 1. Returns 0, or -1 with a message naming the file
 * and line on stderr. */
static int dataset_load(const char *path, size_t max_items, int chat, dataset_t *ds)
{
    memset(ds, 0, sizeof(*ds));
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "tidepool-bench: %s: cannot open: %s\n", path, strerror(errno));
        return -1;
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    long lineno = 0;
    size_t cap_items = 0;
    int rc = -1;
    while (ds->n < max_items && (len = getline(&line, &cap, f)) >= 0) {
        lineno++;
        ssize_t k = 0;
        while (k < len && (line[k] == ' ' || line[k] == '\t' || line[k] == '\n' ||
                           line[k] == '\r'))
            k++;
        if (k == len)
            continue;
        json_error_t je;
        json_t *o = json_loadb(line, (size_t)len, 0, &je);
        if (!o || !json_is_object(o)) {
            fprintf(stderr, "tidepool-bench: %s:%ld: not a JSON object%s%s\n", path, lineno,
                    o ? "" : ": ", o ? "" : je.text);
            json_decref(o);
            goto out;
        }
        const json_t *p = json_object_get(o, "prompt"), *m = json_object_get(o, "messages");
        const json_t *mt = json_object_get(o, "max_tokens");
        const char *bad = NULL;
        if (!json_is_string(p) && !(json_is_array(m) && json_array_size(m) > 0))
            bad = "needs a string \"prompt\" or a non-empty array \"messages\"";
        else if (!json_is_string(p) && !chat)
            bad = "\"messages\" needs a chat endpoint (--endpoint /v1/chat/completions)";
        else if (mt && (!json_is_integer(mt) || json_integer_value(mt) < 1))
            bad = "\"max_tokens\" must be an integer >= 1";
        if (bad) {
            fprintf(stderr, "tidepool-bench: %s:%ld: %s\n", path, lineno, bad);
            json_decref(o);
            goto out;
        }
        if (ds->n == cap_items) {
            size_t nc = cap_items ? cap_items * 2 : 64;
            json_t **ni = realloc(ds->items, nc * sizeof(*ni));
            if (!ni) {
                fprintf(stderr, "tidepool-bench: %s: out of memory\n", path);
                json_decref(o);
                goto out;
            }
            ds->items = ni;
            cap_items = nc;
        }
        ds->items[ds->n++] = o;
    }
    if (ferror(f)) {
        fprintf(stderr, "tidepool-bench: %s: read error\n", path);
        goto out;
    }
    if (ds->n == 0) {
        fprintf(stderr, "tidepool-bench: %s: no prompts in the file\n", path);
        goto out;
    }
    rc = 0;
out:
    free(line);
    fclose(f);
    if (rc < 0)
        dataset_free(ds);
    return rc;
}

// --- arrivals

/* The arrival after time t_s (finite --request-rate), given e, a draw of the exponential
 * distribution of mean 1. A Poisson process; with phase-shift and --decode-rate its rate
 * changes at every phase boundary, and e is spent across phases at each phase's rate (the
 * inversion method for a piecewise-constant rate), so the process stays Poisson within
 * every phase. */
static double workload_next_arrival(const bench_args *a, double t_s, double e)
{
    if (a->decode_rate <= 0 || strcmp(a->workload, "phase-shift") != 0)
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

// --- request bodies

typedef struct {
    long long prompt_words; /* words in the prompt (the estimate of its tokens) */
    long long max_tokens;   /* -1 when the body does not set it */
} req_shape;

enum { PHASE_NONE = -1, PHASE_PREFILL = 0, PHASE_DECODE = 1 };

/* The JSON body of request idx (phase: PHASE_* for the phase-shift workload). Returns a
 * malloc'd compact JSON text, or NULL on OOM. */
static char *workload_body(const bench_args *a, const dataset_t *ds, const char *model,
                           int chat, size_t idx, int phase, req_shape *shape)
{
    rng_t r = rng_stream((uint64_t)a->seed, RNG_STREAM_REQUEST, idx);
    /* Always draw both lengths, in this order, so the stream is the same in every mode. */
    long long in = a->input_range[0] >= 0 ? rng_range(&r, a->input_range[0], a->input_range[1])
                                          : a->input_len;
    long long out = a->output_range[0] >= 0
                        ? rng_range(&r, a->output_range[0], a->output_range[1])
                        : a->output_len;
    if (phase == PHASE_PREFILL)
        out = a->phase_short_len;
    else if (phase == PHASE_DECODE)
        in = a->phase_short_len;
    json_t *body;
    if (ds && ds->n > 0) {
        body = json_deep_copy(ds->items[idx % ds->n]);
        if (!body)
            return NULL;
        shape->prompt_words = workload_json_words(body);
        const json_t *p = json_object_get(body, "prompt");
        if (chat && json_is_string(p)) {
            json_t *msgs = json_pack("[{s:s, s:O}]", "role", "user", "content", p);
            if (!msgs || json_object_set_new(body, "messages", msgs) < 0) {
                json_decref(body);
                return NULL;
            }
            json_object_del(body, "prompt");
        }
    } else {
        size_t len;
        char *text = workload_words_text(&r, in, &len);
        if (!text)
            return NULL;
        shape->prompt_words = in;
        json_t *s = json_stringn(text, len);
        free(text);
        body = chat ? json_pack("{s:[{s:s, s:o}]}", "messages", "role", "user", "content", s)
                    : json_pack("{s:o}", "prompt", s);
        if (!body)
            return NULL;
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

#endif
