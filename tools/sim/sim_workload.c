/*
 * sim_workload: trace files and the generators (phase shift, steady, shift) of tidepool-sim
 * (sim_workload.h). A trace is read whole, checked line by line and sorted once; the
 * generator draws each arrival when the simulator asks for it.
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

#include "sim_mem.h"
#include "sim_workload.h"

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

static int parse_class(const char *s, int *offline)
{
    while (isspace((unsigned char)*s))
        s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1]))
        n--;
    static const char *const on[] = {"online", "0", "default", "auto", "interactive"};
    static const char *const off[] = {"offline", "1", "flex", "batch"};
    if (n == 0) {
        *offline = 0;
        return 0;
    }
    for (size_t i = 0; i < sizeof(on) / sizeof(on[0]); i++)
        if (strlen(on[i]) == n && strncasecmp(s, on[i], n) == 0) {
            *offline = 0;
            return 0;
        }
    for (size_t i = 0; i < sizeof(off) / sizeof(off[0]); i++)
        if (strlen(off[i]) == n && strncasecmp(s, off[i], n) == 0) {
            *offline = 1;
            return 0;
        }
    return -1;
}

static int parse_double_field(const char *s, double *out)
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

/* One CSV line (modified in place). Returns 0, 1 for a header line, -1 with why. */
static int parse_csv_line(char *line, sim_workload_arrival *a, const char **why)
{
    char *f[5];
    int n = 0;
    char *p = line;
    while (n < 5) {
        f[n++] = p;
        char *c = strchr(p, ',');
        if (!c)
            break;
        *c = 0;
        p = c + 1;
    }
    if (n < 3 || n > 4) {
        *why = "want arrival_s,prompt_tokens,output_tokens[,class]";
        return -1;
    }
    double t, pt, ot;
    if (parse_double_field(f[0], &t) < 0) {
        *why = "arrival_s is not a number";
        return 1; /* maybe a header; the caller decides */
    }
    if (parse_double_field(f[1], &pt) < 0 || parse_double_field(f[2], &ot) < 0) {
        *why = "prompt_tokens / output_tokens are not numbers";
        return -1;
    }
    a->arrival_s = t;
    a->prompt = pt >= 0 && pt <= 1e9 ? (int)pt : -1;
    a->out = ot >= 0 && ot <= 1e9 ? (int)ot : -1;
    a->offline = 0;
    if (n == 4 && parse_class(f[3], &a->offline) < 0) {
        *why = "class must be online or offline";
        return -1;
    }
    return 0;
}

static int parse_json_line(const char *line, sim_workload_arrival *a, const char **why)
{
    json_error_t jerr;
    json_t *o = json_loads(line, 0, &jerr);
    int rc = -1;
    if (!o || !json_is_object(o)) {
        *why = "not a JSON object";
        goto out;
    }
    json_t *t = json_object_get(o, "arrival_s");
    json_t *pt = json_object_get(o, "prompt_tokens");
    json_t *ot = json_object_get(o, "output_tokens");
    if (!json_is_number(t) || !json_is_number(pt) || !json_is_number(ot)) {
        *why = "want numbers arrival_s, prompt_tokens, output_tokens";
        goto out;
    }
    a->arrival_s = json_number_value(t);
    double p = json_number_value(pt), q = json_number_value(ot);
    a->prompt = p >= 0 && p <= 1e9 ? (int)p : -1;
    a->out = q >= 0 && q <= 1e9 ? (int)q : -1;
    a->offline = 0;
    json_t *off = json_object_get(o, "offline");
    json_t *cls = json_object_get(o, "class");
    json_t *tier = json_object_get(o, "service_tier");
    if (off) {
        if (!json_is_boolean(off) && !json_is_integer(off)) {
            *why = "offline must be a boolean";
            goto out;
        }
        a->offline = json_is_true(off) || (json_is_integer(off) && json_integer_value(off));
    } else if (cls || tier) {
        json_t *s = cls ? cls : tier;
        if (!json_is_string(s) || parse_class(json_string_value(s), &a->offline) < 0) {
            *why = "class / service_tier must be online, offline or flex";
            goto out;
        }
    }
    rc = 0;
out:
    json_decref(o);
    return rc;
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
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, err_len, "%s: %s", path, strerror(errno));
        return -1;
    }
    arrival_line *v = NULL;
    size_t n = 0, cap = 0, lineno = 0, data_lines = 0;
    char *line = NULL;
    size_t line_cap = 0;
    ssize_t len;
    int rc = -1;
    while ((len = getline(&line, &line_cap, f)) >= 0) {
        lineno++;
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r'))
            line[--len] = 0;
        char *s = line;
        while (isspace((unsigned char)*s))
            s++;
        if (!*s || *s == '#')
            continue;
        sim_workload_arrival a;
        const char *why = NULL;
        int r = *s == '{' ? parse_json_line(s, &a, &why) : parse_csv_line(s, &a, &why);
        if (r == 1 && data_lines == 0) { /* CSV header */
            data_lines++;
            continue;
        }
        data_lines++;
        if (r != 0) {
            snprintf(err, err_len, "%s:%zu: %s", path, lineno, why);
            goto out;
        }
        if (!isfinite(a.arrival_s) || a.arrival_s < 0) {
            snprintf(err, err_len, "%s:%zu: arrival_s must be a finite number >= 0", path, lineno);
            goto out;
        }
        if (a.prompt < 1 || a.out < 1) {
            snprintf(err, err_len, "%s:%zu: prompt_tokens and output_tokens must be >= 1", path,
                     lineno);
            goto out;
        }
        if ((double)a.prompt + a.out > max_tokens) {
            snprintf(err, err_len,
                     "%s:%zu: prompt + output = %d tokens exceeds a worker's KV capacity (%.0f)",
                     path, lineno, a.prompt + a.out, max_tokens);
            goto out;
        }
        if (n == cap) {
            cap = cap ? 2 * cap : 1024;
            v = sim_mem_realloc(v, cap * sizeof(*v));
        }
        v[n].a = a;
        v[n].line = lineno;
        n++;
    }
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
    free(line);
    fclose(f);
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
