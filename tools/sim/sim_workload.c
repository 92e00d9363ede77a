/*
 * sim_workload: trace files and the generators (phase shift, steady, shift) of tidepool-sim
 * (sim_workload.h). A trace is read whole, checked line by line and sorted once; the
 * generator draws each arrival when the simulator asks for it.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim_mem.h"
#include "sim_workload.h"
#include "traceline.h"

const sim_workload_shape sim_workload_shapes[SIM_WORKLOAD_N_SHAPES] = {
    [SIM_WORKLOAD_SHAPE_PREFILL_HEAVY] = {512, 1536, 16, 64},
    [SIM_WORKLOAD_SHAPE_DECODE_HEAVY] = {64, 192, 512, 1536},
    [SIM_WORKLOAD_SHAPE_OFFLINE] = {256, 768, 128, 384},
    [SIM_WORKLOAD_SHAPE_CONVERSATION] = {200, 1800, 100, 300},
    [SIM_WORKLOAD_SHAPE_CODE] = {500, 2500, 5, 30},
};

void sim_workload_steady(sim_workload *w, sim_workload_kind kind, double rate, double duration_s,
                         double offline_frac, uint64_t seed)
{
    sim_workload_phase_shift(w, rate, duration_s, duration_s, offline_frac, seed);
    w->kind = kind;
}

int sim_workload_kind_parse(const char *name, sim_workload_kind *kind)
{
    static const char *const names[] = {"phase-shift", "conversation", "code", "mix", "shift"};
    for (int i = 0; i < 5; i++)
        if (strcmp(name, names[i]) == 0) {
            *kind = (sim_workload_kind)i;
            return 0;
        }
    return -1;
}

void sim_workload_phase_shift(sim_workload *w, double rate, double duration_s, double phase_s,
                              double offline_frac, uint64_t seed)
{
    memset(w, 0, sizeof(*w));
    sim_rng_seed(&w->rng, seed);
    w->rate = rate;
    w->duration_s = duration_s;
    w->phase_s = phase_s;
    w->offline_frac = offline_frac;
}

double sim_workload_code_share(double t_s, double day_s)
{
    double h = fmod(t_s, day_s) / day_s * 24;
    if (h >= 9 && h < 17)
        return 0.75;
    if (h >= 7 && h < 9)
        return 0.15 + 0.6 * (h - 7) / 2;
    if (h >= 17 && h < 22)
        return 0.75 - 0.6 * (h - 17) / 5;
    return 0.15;
}

int sim_workload_phase(const sim_workload *w, double t_s)
{
    return (int)fmod(floor(t_s / w->phase_s), 2.0);
}

int sim_workload_next(sim_workload *w, sim_workload_arrival *a)
{
    if (w->is_trace) {
        if (w->pos >= w->n_recs)
            return 0;
        *a = w->recs[w->pos++];
        return 1;
    }
    w->t_s += -log(1.0 - sim_rng_uniform(&w->rng)) / w->rate;
    if (w->t_s >= w->duration_s)
        return 0;
    a->arrival_s = w->t_s;
    a->offline = sim_rng_uniform(&w->rng) < w->offline_frac;
    int kind;
    if (a->offline)
        kind = SIM_WORKLOAD_SHAPE_OFFLINE;
    else if (w->kind == SIM_WORKLOAD_CONVERSATION)
        kind = SIM_WORKLOAD_SHAPE_CONVERSATION;
    else if (w->kind == SIM_WORKLOAD_CODE)
        kind = SIM_WORKLOAD_SHAPE_CODE;
    else if (w->kind == SIM_WORKLOAD_MIX)
        kind = sim_rng_uniform(&w->rng) < 0.5 ? SIM_WORKLOAD_SHAPE_CONVERSATION
                                              : SIM_WORKLOAD_SHAPE_CODE;
    else if (w->kind == SIM_WORKLOAD_SHIFT)
        kind = sim_rng_uniform(&w->rng) < sim_workload_code_share(w->t_s, w->duration_s)
                   ? SIM_WORKLOAD_SHAPE_CODE
                   : SIM_WORKLOAD_SHAPE_CONVERSATION;
    else
        kind = sim_workload_phase(w, w->t_s) == 0 ? SIM_WORKLOAD_SHAPE_PREFILL_HEAVY
                                                  : SIM_WORKLOAD_SHAPE_DECODE_HEAVY;
    const sim_workload_shape *s = &sim_workload_shapes[kind];
    a->prompt = sim_rng_range(&w->rng, s->prompt_lo, s->prompt_hi);
    a->out = sim_rng_range(&w->rng, s->out_lo, s->out_hi);
    return 1;
}

double sim_workload_span_s(const sim_workload *w)
{
    if (!w->is_trace)
        return w->duration_s;
    double last = w->n_recs ? w->recs[w->n_recs - 1].arrival_s : 0;
    return last > 1 ? last : 1;
}

/* Sorted by (arrival, line): a stable order whatever qsort does with ties. */
typedef struct {
    sim_workload_arrival a;
    size_t line;
} arrival_line;

static int arrival_line_cmp(const void *x, const void *y)
{
    const arrival_line *a = x, *b = y;
    if (a->a.arrival_s != b->a.arrival_s)
        return a->a.arrival_s < b->a.arrival_s ? -1 : 1;
    return (a->line > b->line) - (a->line < b->line);
}

int sim_workload_load_trace(sim_workload *w, const char *path, double max_tokens, char *err,
                            size_t err_len)
{
    memset(w, 0, sizeof(*w));
    w->is_trace = 1;
    traceline_reader_t *rd = traceline_open(path, err, err_len);
    if (!rd)
        return -1;
    arrival_line *v = NULL;
    size_t n = 0, cap = 0;
    int rc = -1, got;
    traceline_req q;
    while ((got = traceline_next(rd, &q, err, err_len)) == 1) {
        if ((double)q.prompt_tokens + q.output_tokens > max_tokens) {
            snprintf(err, err_len,
                     "%s:%zu: prompt + output = %lld tokens exceeds a worker's KV capacity (%.0f)",
                     path, q.line, q.prompt_tokens + q.output_tokens, max_tokens);
            goto out;
        }
        if (n == cap) {
            cap = cap ? 2 * cap : 1024;
            v = sim_mem_realloc(v, cap * sizeof(*v));
        }
        v[n].a = (sim_workload_arrival){.arrival_s = q.arrival_s,
                                        .prompt = (int)q.prompt_tokens,
                                        .out = (int)q.output_tokens,
                                        .offline = q.offline};
        v[n].line = q.line;
        n++;
    }
    if (got < 0)
        goto out;
    if (n == 0) {
        snprintf(err, err_len, "%s: no requests", path);
        goto out;
    }
    qsort(v, n, sizeof(*v), arrival_line_cmp);
    w->recs = sim_mem_realloc(NULL, n * sizeof(*w->recs));
    for (size_t i = 0; i < n; i++)
        w->recs[i] = v[i].a;
    w->n_recs = n;
    rc = 0;
out:
    free(v);
    traceline_close(&rd);
    return rc;
}

void sim_workload_free(sim_workload *w)
{
    free(w->recs);
    w->recs = NULL;
}

void sim_workload_shape_stats(const sim_workload *w, double *mean_prompt, double *mean_ctx)
{
    sim_workload c = *w;
    c.pos = 0;
    double sp = 0, sp2 = 0, so = 0, soc = 0;
    sim_workload_arrival a;
    for (int i = 0; i < 200000 && sim_workload_next(&c, &a); i++) {
        if (a.offline)
            continue;
        sp += a.prompt;
        sp2 += (double)a.prompt * a.prompt;
        so += a.out;
        soc += a.out * (a.prompt + a.out / 2.0);
    }
    *mean_prompt = sp > 0 ? sp2 / sp : 512;
    *mean_ctx = so > 0 ? soc / so : 512;
}
