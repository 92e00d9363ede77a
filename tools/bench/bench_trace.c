/*
 * bench_trace: trace files and their request bodies for tidepool-bench --trace
 * (bench_trace.h). The lines are read by tools/trace/traceline.h, the simulator's parser
 * too, so one file replays in both.
 */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_trace.h"
#include "traceline.h"

struct bench_trace {
    bench_trace_req *reqs;
    size_t n;
    int *pool; /* token ids prompts are cut from */
    size_t n_pool;
    int bos;   /* < 0: none */
};

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
    traceline_reader_t *rd = NULL;
    size_t cap = 0;
    int rc = -1, got;
    if (!t) {
        snprintf(err, err_len, "%s: out of memory", path);
        return NULL;
    }
    t->bos = -1;
    if (!(rd = traceline_open(path, err, err_len)))
        goto out;
    traceline_req q;
    while ((got = traceline_next(rd, &q, err, err_len)) == 1) {
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
        t->reqs[t->n++] = (bench_trace_req){.arrival_s = q.arrival_s,
                                            .prompt_tokens = q.prompt_tokens,
                                            .output_tokens = q.output_tokens,
                                            .offline = q.offline,
                                            .line = q.line};
    }
    if (got < 0)
        goto out;
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
    traceline_close(&rd);
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
