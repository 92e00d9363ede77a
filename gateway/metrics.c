/* metrics: see metrics.h. */
#include "metrics.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// --- bucket sets

/* vLLM: vllm:time_to_first_token_seconds */
static const double b_ttft[] = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
/* vLLM: vllm:inter_token_latency_seconds, vllm:request_time_per_output_token_seconds */
static const double b_itl[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                               0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
/* vLLM: e2e_request_latency, request_queue/prefill/decode/inference_time */
static const double b_request[] = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                   5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
/* tidepool: KV transfer sizes, 1 KiB .. 4 GiB by powers of 4 */
static const double b_bytes[] = {1024.0,     4096.0,      16384.0,      65536.0,
                                 262144.0,   1048576.0,   4194304.0,    16777216.0,
                                 67108864.0, 268435456.0, 1073741824.0, 4294967296.0};

#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))

const double *metrics_buckets(metrics_bucket_set_t set, int *n)
{
    switch (set) {
    case METRICS_BUCKETS_TTFT:
        *n = N_OF(b_ttft);
        return b_ttft;
    case METRICS_BUCKETS_ITL:
        *n = N_OF(b_itl);
        return b_itl;
    case METRICS_BUCKETS_REQUEST:
        *n = N_OF(b_request);
        return b_request;
    case METRICS_BUCKETS_BYTES:
        *n = N_OF(b_bytes);
        return b_bytes;
    case METRICS_BUCKETS_END:
        break;
    }
    *n = 0;
    return NULL;
}

// --- histogram

int metrics_histogram_init(metrics_histogram *h, const double *bounds, int n)
{
    memset(h, 0, sizeof(*h));
    if (!bounds || n < 1 || n > METRICS_MAX_BUCKETS)
        return -1;
    for (int i = 0; i < n; i++) {
        if (!isfinite(bounds[i]) || (i > 0 && bounds[i] <= bounds[i - 1]))
            return -1;
    }
    memcpy(h->bounds, bounds, (size_t)n * sizeof(double));
    h->n_bounds = n;
    return 0;
}

int metrics_histogram_init_set(metrics_histogram *h, metrics_bucket_set_t set)
{
    int n;
    const double *b = metrics_buckets(set, &n);
    return metrics_histogram_init(h, b, n);
}

int metrics_histogram_bucket(const metrics_histogram *h, double v)
{
    if (isnan(v))
        return h->n_bounds;
    int lo = 0, hi = h->n_bounds; /* answer in [lo, hi] */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (v <= h->bounds[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

void metrics_histogram_observe(metrics_histogram *h, double v)
{
    if (isnan(v))
        return;
    h->counts[metrics_histogram_bucket(h, v)]++;
    h->sum += v;
    h->count++;
}

// --- window

#define WIN_MIN 1e-6   /* lowest bin's upper edge */
#define WIN_RATIO 1.04 /* bin width: relative error of a bin's centre <= 2% */
#define WIN_BINS 590   /* log(1e4 / 1e-6) / log(1.04) ~ 587, plus under/overflow */

typedef struct {
    int64_t epoch; /* slot number (now_s / slot_s) its counts belong to; -1 = empty */
    uint64_t n;
    uint32_t bins[WIN_BINS];
} win_slot;

struct metrics_window {
    int n_slots;
    int64_t slot_us;
    win_slot *slots;
};

metrics_window *metrics_window_new(int window_s, int n_slots)
{
    if (n_slots < 1 || window_s < n_slots)
        return NULL;
    metrics_window *w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    w->slots = calloc((size_t)n_slots, sizeof(win_slot));
    if (!w->slots) {
        free(w);
        return NULL;
    }
    w->n_slots = n_slots;
    w->slot_us = (int64_t)window_s * 1000000 / n_slots;
    for (int i = 0; i < n_slots; i++)
        w->slots[i].epoch = -1;
    return w;
}

void metrics_window_destroy(metrics_window **pw)
{
    if (!pw || !*pw)
        return;
    free((*pw)->slots);
    free(*pw);
    *pw = NULL;
}

static int win_bin(double v)
{
    if (!(v > WIN_MIN))
        return 0;
    int b = 1 + (int)floor(log(v / WIN_MIN) / log(WIN_RATIO));
    return b >= WIN_BINS ? WIN_BINS - 1 : b;
}

/* The value a bin stands for: the geometric centre of its edges. */
static double win_bin_value(int b)
{
    if (b == 0)
        return WIN_MIN;
    return WIN_MIN * pow(WIN_RATIO, (double)b - 0.5);
}

static int slot_live(const metrics_window *w, const win_slot *s, int64_t now_us)
{
    int64_t cur = now_us / w->slot_us;
    return s->epoch >= 0 && s->epoch > cur - w->n_slots && s->epoch <= cur;
}

void metrics_window_observe(metrics_window *w, double v, int64_t now_us)
{
    if (isnan(v) || now_us < 0)
        return;
    int64_t epoch = now_us / w->slot_us;
    win_slot *s = &w->slots[epoch % w->n_slots];
    if (s->epoch != epoch) {
        memset(s->bins, 0, sizeof(s->bins));
        s->n = 0;
        s->epoch = epoch;
    }
    s->bins[win_bin(v)]++;
    s->n++;
}

uint64_t metrics_window_count(const metrics_window *w, int64_t now_us)
{
    uint64_t n = 0;
    for (int i = 0; i < w->n_slots; i++)
        if (slot_live(w, &w->slots[i], now_us))
            n += w->slots[i].n;
    return n;
}

double metrics_window_quantile(const metrics_window *w, double q, int64_t now_us)
{
    uint64_t n = metrics_window_count(w, now_us);
    if (n == 0 || isnan(q))
        return NAN;
    if (q < 0)
        q = 0;
    if (q > 1)
        q = 1;
    uint64_t rank = (uint64_t)ceil(q * (double)n); /* 1-based */
    if (rank < 1)
        rank = 1;
    uint64_t seen = 0;
    for (int b = 0; b < WIN_BINS; b++) {
        for (int i = 0; i < w->n_slots; i++)
            if (slot_live(w, &w->slots[i], now_us))
                seen += w->slots[i].bins[b];
        if (seen >= rank)
            return win_bin_value(b);
    }
    return win_bin_value(WIN_BINS - 1);
}

// --- exposition

void metrics_format_value(char *buf, size_t cap, double v)
{
    if (isnan(v)) {
        snprintf(buf, cap, "NaN");
    } else if (isinf(v)) {
        snprintf(buf, cap, v > 0 ? "+Inf" : "-Inf");
    } else if (v == floor(v) && fabs(v) < 9007199254740992.0) {
        snprintf(buf, cap, "%.0f", v);
    } else {
        for (int prec = 6; prec <= 17; prec++) { /* the shortest form that reads back */
            snprintf(buf, cap, "%.*g", prec, v);
            if (strtod(buf, NULL) == v)
                return;
        }
    }
}

/* Write s with the escapes of a label value (\\, \", \n) or of HELP text (\\, \n). */
static void write_escaped(FILE *f, const char *s, int quote)
{
    for (; *s; s++) {
        if (*s == '\\')
            fputs("\\\\", f);
        else if (*s == '\n')
            fputs("\\n", f);
        else if (quote && *s == '"')
            fputs("\\\"", f);
        else
            fputc(*s, f);
    }
}

void metrics_write_header(FILE *f, const char *name, const char *type, const char *help)
{
    fprintf(f, "# HELP %s ", name);
    write_escaped(f, help, 0);
    fprintf(f, "\n# TYPE %s %s\n", name, type);
}

static void write_labels(FILE *f, const metrics_label *labels, int n, const char *le)
{
    if (n == 0 && !le)
        return;
    fputc('{', f);
    for (int i = 0; i < n; i++) {
        fprintf(f, "%s%s=\"", i ? "," : "", labels[i].name);
        write_escaped(f, labels[i].value ? labels[i].value : "", 1);
        fputc('"', f);
    }
    if (le)
        fprintf(f, "%sle=\"%s\"", n ? "," : "", le);
    fputc('}', f);
}

void metrics_write_sample(FILE *f, const char *name, const char *suffix,
                          const metrics_label *labels, int n, double value)
{
    char v[64];
    metrics_format_value(v, sizeof(v), value);
    fprintf(f, "%s%s", name, suffix ? suffix : "");
    write_labels(f, labels, n, NULL);
    fprintf(f, " %s\n", v);
}

void metrics_write_histogram(FILE *f, const char *name, const metrics_label *labels, int n,
                             const metrics_histogram *h)
{
    uint64_t cum = 0;
    char le[64];
    for (int i = 0; i <= h->n_bounds; i++) {
        cum += h->counts[i];
        if (i < h->n_bounds)
            metrics_format_value(le, sizeof(le), h->bounds[i]);
        else
            snprintf(le, sizeof(le), "+Inf");
        fprintf(f, "%s_bucket", name);
        write_labels(f, labels, n, le);
        fprintf(f, " %llu\n", (unsigned long long)cum);
    }
    metrics_write_sample(f, name, "_sum", labels, n, h->sum);
    metrics_write_sample(f, name, "_count", labels, n, (double)h->count);
}
