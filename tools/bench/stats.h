/*
 * bench/stats: summary statistics of latency samples, computed the way vLLM's
 * `bench serve` does with numpy, so that figures are comparable: mean, population standard
 * deviation (np.std, ddof 0), median (np.median) and percentiles with linear interpolation
 * between closest ranks (np.percentile's default). An empty sample gives zeros (vLLM's
 * `np.mean(x or 0)`). Part of tidepool-bench (included once; everything is static).
 */
#ifndef TP_BENCH_STATS_H
#define TP_BENCH_STATS_H

#include <math.h>
#include <stdlib.h>

typedef struct {
    size_t n;                  /* number of samples */
    double mean, std, median;  /* same unit as the samples */
    double p90, p95, p99;
} dist_t;

static int stats_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* p in [0, 100] of sorted[0..n) (n >= 1), numpy's linear method. */
static double stats_percentile_sorted(const double *sorted, size_t n, double p)
{
    double pos = p / 100.0 * (double)(n - 1);
    size_t lo = (size_t)floor(pos);
    size_t hi = lo + 1 < n ? lo + 1 : lo;
    double frac = pos - (double)lo;
    return sorted[lo] + (sorted[hi] - sorted[lo]) * frac;
}

/* Fill *d from v[0..n); sorts v in place. */
static void stats_dist(double *v, size_t n, dist_t *d)
{
    memset(d, 0, sizeof(*d));
    d->n = n;
    if (n == 0)
        return;
    qsort(v, n, sizeof(*v), stats_cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    d->mean = sum / (double)n;
    double ss = 0;
    for (size_t i = 0; i < n; i++)
        ss += (v[i] - d->mean) * (v[i] - d->mean);
    d->std = sqrt(ss / (double)n);
    d->median = stats_percentile_sorted(v, n, 50);
    d->p90 = stats_percentile_sorted(v, n, 90);
    d->p95 = stats_percentile_sorted(v, n, 95);
    d->p99 = stats_percentile_sorted(v, n, 99);
}

#endif
