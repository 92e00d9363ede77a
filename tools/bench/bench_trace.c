/*
 * bench_trace: trace files and their request bodies for tidepool-bench --trace
 * (bench_trace.h). The parser accepts exactly what tidepool-sim's does (the two are kept
 * apart by the layer rules: tools/bench sees common only), so one file replays in both.
 */
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/types.h>

#include "bench_trace.h"

struct bench_trace {
    bench_trace_req *reqs;
    size_t n;
    int *pool; /* token ids prompts are cut from */
    size_t n_pool;
    int bos;   /* < 0: none */
};

// --- parsing (the rules of tools/sim/sim_workload.c)

static int parse_class(const char *s, int *offline)
{
    while (isspace((unsigned char)*s))
        s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1]))
        n--;
    static const char *const on[] = {"online", "0", "default", "auto", "interactive"};
    static const char *const off[] = {"offline", "1", "flex", "batch"};
    *offline = 0;
    if (n == 0)
        return 0;
    for (size_t i = 0; i < sizeof(on) / sizeof(on[0]); i++)
        if (strlen(on[i]) == n && strncasecmp(s, on[i], n) == 0)
            return 0;
    for (size_t i = 0; i < sizeof(off) / sizeof(off[0]); i++)
        if (strlen(off[i]) == n && strncasecmp(s, off[i], n) == 0) {
            *offline = 1;
            return 0;
        }
    return -1;
}

static int parse_double(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    while (isspace((unsigned char)*end))
        end++;
    if (errno || end == s || *end)
        return -1;
    *out = v;
    return 0;
}

/* A token count: a whole number in [1, 1e9]. */
static int tokens_ok(double v, long long *out)
{
    if (!(v >= 1 && v <= 1e9) || v != floor(v))
        return -1;
    *out = (long long)v;
    return 0;
}

/* One CSV line (modified in place). 0, 1 when arrival_s is not a number (a header, if it
 * is the first line), -1 with why. */
static int parse_csv(char *line, bench_trace_req *q, const char **why)
{
    char *f[5];
    int n = 0;
    for (char *p = line; n < 5;) {
        f[n++] = p;
        char *c = strchr(p, ',');
        if (!c)
            break;
        *c = 0;
        p = c + 1;
    }
    double t, pt, ot;
    if (n < 3 || n > 4) {
        *why = "want arrival_s,prompt_tokens,output_tokens[,class]";
        return -1;
    }
    if (parse_double(f[0], &t) < 0) {
        *why = "arrival_s is not a number";
        return 1;
    }
    if (parse_double(f[1], &pt) < 0 || parse_double(f[2], &ot) < 0) {
        *why = "prompt_tokens / output_tokens are not numbers";
        return -1;
    }
    if (tokens_ok(pt, &q->prompt_tokens) < 0 || tokens_ok(ot, &q->output_tokens) < 0) {
        *why = "prompt_tokens and output_tokens must be whole numbers in [1, 1e9]";
        return -1;
    }
    q->arrival_s = t;
    if (parse_class(n == 4 ? f[3] : "", &q->offline) < 0) {
        *why = "class must be online or offline";
        return -1;
    }
    return 0;
}

static int parse_json(const char *line, bench_trace_req *q, const char **why)
{
    json_error_t jerr;
    json_t *o = json_loads(line, 0, &jerr);
    int rc = -1;
    if (!json_is_object(o)) {
        *why = "not a JSON object";
        goto out;
    }
    const json_t *t = json_object_get(o, "arrival_s");
    const json_t *pt = json_object_get(o, "prompt_tokens");
    const json_t *ot = json_object_get(o, "output_tokens");
    if (!json_is_number(t) || !json_is_number(pt) || !json_is_number(ot)) {
        *why = "want numbers arrival_s, prompt_tokens, output_tokens";
        goto out;
    }
    if (tokens_ok(json_number_value(pt), &q->prompt_tokens) < 0 ||
        tokens_ok(json_number_value(ot), &q->output_tokens) < 0) {
        *why = "prompt_tokens and output_tokens must be whole numbers in [1, 1e9]";
        goto out;
    }
    q->arrival_s = json_number_value(t);
    q->offline = 0;
    const json_t *off = json_object_get(o, "offline");
    const json_t *cls = json_object_get(o, "class");
    const json_t *tier = json_object_get(o, "service_tier");
    if (off) {
        if (!json_is_boolean(off) && !json_is_integer(off)) {
            *why = "offline must be a boolean";
            goto out;
        }
        q->offline = json_is_true(off) || (json_is_integer(off) && json_integer_value(off));
    } else if (cls || tier) {
        const json_t *s = cls ? cls : tier;
        if (!json_is_string(s) || parse_class(json_string_value(s), &q->offline) < 0) {
            *why = "class / service_tier must be online, offline or flex";
            goto out;
        }
    }
    rc = 0;
out:
    json_decref(o);
    return rc;
}

static int req_cmp(const void *x, const void *y)
{
    const bench_trace_req *a = x, *b = y;
    if (a->arrival_s != b->arrival_s)
        return a->arrival_s < b->arrival_s ? -1 : 1;
    return (a->line > b->line) - (a->line < b->line);
}

bench_trace_t *bench_trace_load(const char *path, double time_scale, size_t max_reqs,
                                char *err, size_t err_len)
{
    bench_trace_t *t = calloc(1, sizeof(*t));
    FILE *f = t ? fopen(path, "r") : NULL;
    char *line = NULL;
    size_t line_cap = 0, cap = 0, lineno = 0, data_lines = 0;
    ssize_t len;
    int rc = -1;
    if (!t) {
        snprintf(err, err_len, "%s: out of memory", path);
        return NULL;
    }
    t->bos = -1;
    if (!f) {
        snprintf(err, err_len, "%s: %s", path, strerror(errno));
        goto out;
    }
    while ((len = getline(&line, &line_cap, f)) >= 0) {
        lineno++;
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r'))
            line[--len] = 0;
        char *s = line;
        while (isspace((unsigned char)*s))
            s++;
        if (!*s || *s == '#')
            continue;
        bench_trace_req q = {0};
        const char *why = "?";
        int r = *s == '{' ? parse_json(s, &q, &why) : parse_csv(s, &q, &why);
        if (r == 1 && data_lines++ == 0)
            continue; /* a CSV header */
        data_lines++;
        if (r != 0) {
            snprintf(err, err_len, "%s:%zu: %s", path, lineno, why);
            goto out;
        }
        if (!isfinite(q.arrival_s) || q.arrival_s < 0) {
            snprintf(err, err_len, "%s:%zu: arrival_s must be a finite number >= 0", path,
                     lineno);
            goto out;
        }
        q.line = lineno;
        if (t->n == cap) {
            size_t nc = cap ? 2 * cap : 1024;
            bench_trace_req *nr = realloc(t->reqs, nc * sizeof(*nr));
            if (!nr) {
                snprintf(err, err_len, "%s: out of memory", path);
                goto out;
            }
            t->reqs = nr;
            cap = nc;
        }
        t->reqs[t->n++] = q;
    }
    if (ferror(f)) {
        snprintf(err, err_len, "%s: read error", path);
        goto out;
    }
    if (t->n == 0) {
        snprintf(err, err_len, "%s: no requests", path);
        goto out;
    }
    qsort(t->reqs, t->n, sizeof(*t->reqs), req_cmp);
    for (size_t i = 0; i < t->n; i++)
        t->reqs[i].arrival_s *= time_scale;
    if (max_reqs > 0 && max_reqs < t->n)
        t->n = max_reqs;
    rc = 0;
out:
    free(line);
    if (f)
        fclose(f);
    if (rc < 0)
        bench_trace_destroy(&t);
    return t;
}

void bench_trace_destroy(bench_trace_t **t)
{
    if (!t || !*t)
        return;
    free((*t)->reqs);
    free((*t)->pool);
    free(*t);
    *t = NULL;
}

size_t bench_trace_size(const bench_trace_t *t)
{
    return t->n;
}

const bench_trace_req *bench_trace_at(const bench_trace_t *t, size_t i)
{
    return &t->reqs[i];
}

long long bench_trace_max_prompt(const bench_trace_t *t)
{
    long long m = 0;
    for (size_t i = 0; i < t->n; i++)
        if (t->reqs[i].prompt_tokens > m)
            m = t->reqs[i].prompt_tokens;
    return m;
}

double bench_trace_span_s(const bench_trace_t *t)
{
    double last = t->reqs[t->n - 1].arrival_s;
    return last > 1 ? last : 1;
}

int bench_trace_check_context(const bench_trace_t *t, long long max_model_len, char *err,
                              size_t err_len)
{
    for (size_t i = 0; i < t->n; i++) {
        const bench_trace_req *q = &t->reqs[i];
        if (q->prompt_tokens + q->output_tokens > max_model_len) {
            snprintf(err, err_len,
                     "%zu: prompt + output = %lld tokens exceeds the server's context "
                     "window (max_model_len %lld); scale the trace's token counts down "
                     "(docs/workloads.md)",
                     q->line, q->prompt_tokens + q->output_tokens, max_model_len);
            return -1;
        }
    }
    return 0;
}

void bench_trace_set_pool(bench_trace_t *t, int *ids, size_t n, int bos)
{
    free(t->pool);
    t->pool = ids;
    t->n_pool = n;
    t->bos = bos;
}

// --- request bodies

/* splitmix64: the offset of request idx into the pool, its own stream of the seed. */
static uint64_t mix(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

char *bench_trace_body(const bench_trace_t *t, const bench_args *a, const char *model,
                       size_t idx)
{
    const bench_trace_req *q = &t->reqs[idx];
    json_t *ids = json_array();
    json_t *body = ids ? json_object() : NULL;
    int ok = body != NULL;
    long long k = 0;
    if (ok && t->bos >= 0) {
        ok &= json_array_append_new(ids, json_integer(t->bos)) == 0;
        k++;
    }
    size_t off = (size_t)(mix(mix((uint64_t)a->seed) ^ (0x7472616365ull + idx)) % t->n_pool);
    for (; ok && k < q->prompt_tokens; k++, off = (off + 1) % t->n_pool)
        ok &= json_array_append_new(ids, json_integer(t->pool[off])) == 0;
    if (!ok) {
        json_decref(ids);
        json_decref(body);
        return NULL;
    }
    ok &= json_object_set_new(body, "model", json_string(model)) == 0;
    ok &= json_object_set_new(body, "prompt", ids) == 0;
    ok &= json_object_set_new(body, "max_tokens", json_integer(q->output_tokens)) == 0;
    ok &= json_object_set_new(body, "min_tokens", json_integer(q->output_tokens)) == 0;
    ok &= json_object_set_new(body, "ignore_eos", json_true()) == 0;
    ok &= json_object_set_new(body, "temperature", json_real(a->temperature)) == 0;
    ok &= json_object_set_new(body, "stream", json_true()) == 0;
    ok &= json_object_set_new(body, "stream_options", json_pack("{s:b}", "include_usage", 1)) ==
          0;
    if (q->offline)
        ok &= json_object_set_new(body, "service_tier", json_string("flex")) == 0;
    char *text = ok ? json_dumps(body, JSON_COMPACT) : NULL;
    json_decref(body);
    return text;
}
