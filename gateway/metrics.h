/*
 * metrics: Prometheus primitives for the gateway's figures, with no knowledge of what is
 * measured (that is stats.h).
 *
 *   - metrics_histogram: a histogram with fixed upper bounds (the `le` of each bucket,
 *     ascending, +Inf implied), counts per bucket, sum and count; observe is O(log n).
 *     The bucket sets are vLLM's (metrics_buckets()), so dashboards built for vLLM read
 *     tidepool's histograms the same way.
 *   - metrics_window: recent samples for percentiles (p50/p90/p99 over the last minute):
 *     a ring of time slots, each a log-spaced histogram (bins 4% wide from 1 us to 10^4 s),
 *     so memory is fixed whatever the rate and a quantile is within 2% of the true value.
 *   - exposition writers: the Prometheus text format 0.0.4 (HELP, TYPE, samples with
 *     labels; histograms as cumulative _bucket{le}, _sum, _count), label values and HELP
 *     text escaped as the format requires.
 *
 * Plain data, no allocation after set-up, no locking: one thread (the gateway's loop).
 */
#ifndef TP_GW_METRICS_H
#define TP_GW_METRICS_H

#include <stdint.h>
#include <stdio.h>

#define METRICS_MAX_BUCKETS 32 /* finite bounds of one histogram */

typedef struct {
    int n_bounds;                             /* finite bounds; bucket n_bounds is +Inf */
    double bounds[METRICS_MAX_BUCKETS];       /* ascending upper bounds (inclusive) */
    uint64_t counts[METRICS_MAX_BUCKETS + 1]; /* per bucket, not cumulative */
    double sum;                               /* sum of observed values */
    uint64_t count;                           /* observations */
} metrics_histogram;

/* The bucket sets in use (vLLM's boundaries where vLLM has the metric). */
typedef enum {
    METRICS_BUCKETS_TTFT = 0, /* seconds: time to first token, short phases (1 ms .. 2560 s) */
    METRICS_BUCKETS_ITL,      /* seconds: inter-token latency, time per output token */
    METRICS_BUCKETS_REQUEST,  /* seconds: e2e, queue, prefill, decode (0.3 s .. 7680 s) */
    METRICS_BUCKETS_BYTES,    /* bytes: powers of 4 from 1 KiB to 4 GiB */
    METRICS_BUCKETS_END
} metrics_bucket_set_t;

/* The bounds of a bucket set (static storage) and their number in *n. NULL for an unknown
 * set. */
const double *metrics_buckets(metrics_bucket_set_t set, int *n);

/* Reset h to no observations over the given bounds (copied; n in [1, METRICS_MAX_BUCKETS],
 * strictly ascending and finite). Returns 0, or -1 on bad bounds (h is then empty with no
 * finite bucket). */
int metrics_histogram_init(metrics_histogram *h, const double *bounds, int n);

/* The same over a bucket set. Returns 0 or -1 (unknown set). */
int metrics_histogram_init_set(metrics_histogram *h, metrics_bucket_set_t set);

/* The bucket v falls in: the first i with v <= bounds[i], or n_bounds (+Inf). NaN goes to
 * +Inf. */
int metrics_histogram_bucket(const metrics_histogram *h, double v);

/* Count one observation v (NaN is ignored). */
void metrics_histogram_observe(metrics_histogram *h, double v);

// --- windowed percentiles

typedef struct metrics_window metrics_window;

/* A window over the last window_s seconds in n_slots slots (window_s >= n_slots >= 1;
 * samples older than window_s, to within one slot, are forgotten). NULL on bad arguments
 * or out of memory. */
metrics_window *metrics_window_new(int window_s, int n_slots);

/* Free; takes NULL and NULLs *w. */
void metrics_window_destroy(metrics_window **w);

/* Add sample v (> 0; values <= 0 count in the lowest bin, NaN is ignored) at now_us
 * (monotonic microseconds, never decreasing between calls). */
void metrics_window_observe(metrics_window *w, double v, int64_t now_us);

/* Samples inside the window at now_us. */
uint64_t metrics_window_count(const metrics_window *w, int64_t now_us);

/* The q-quantile (q in [0, 1]) of the samples inside the window at now_us: the geometric
 * centre of the bin holding the sample of rank ceil(q * n) (within 2% of the true value
 * for values in [1e-6, 1e4]). NaN when the window is empty. */
double metrics_window_quantile(const metrics_window *w, double q, int64_t now_us);

// --- exposition (Prometheus text format 0.0.4)

/* One label of a sample. value is escaped on output. */
typedef struct {
    const char *name;
    const char *value;
} metrics_label;

/* The Content-Type of the text format. */
#define METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

/* "# HELP name help" and "# TYPE name type" (type: counter, gauge, histogram). */
void metrics_write_header(FILE *f, const char *name, const char *type, const char *help);

/* One sample line: name followed by suffix (may be NULL or ""), the labels (n may be 0)
 * and the value (integers without a fraction, +Inf / -Inf / NaN spelled as Prometheus
 * does). */
void metrics_write_sample(FILE *f, const char *name, const char *suffix,
                          const metrics_label *labels, int n, double value);

/* A histogram's series under name: name_bucket{labels, le} for every bound and +Inf
 * (cumulative counts), name_sum{labels}, name_count{labels}. */
void metrics_write_histogram(FILE *f, const char *name, const metrics_label *labels, int n,
                             const metrics_histogram *h);

/* Format v as the text format does (shortest round-trip representation) into buf. */
void metrics_format_value(char *buf, size_t cap, double v);

#endif
