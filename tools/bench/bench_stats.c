/*
 * bench_stats: mean, standard deviation and numpy-style percentiles of a sample
 * (bench_stats.h). The sample is sorted once; every percentile is then O(1).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench_stats.h"

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double bench_stats_percentile(const double *sorted, size_t n, double p)
{
    double pos = p / 100.0 * (double)(n - 1);
    size_t lo = (size_t)floor(pos);
    size_t hi = lo + 1 < n ? lo + 1 : lo;
    double frac = pos - (double)lo;
    return sorted[lo] + (sorted[hi] - sorted[lo]) * frac;
}

void bench_stats_compute(double *v, size_t n, bench_stats *d)
{
    memset(d, 0, sizeof(*d));
    d->n = n;
    if (n == 0)
        return;
    qsort(v, n, sizeof(*v), cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    d->mean = sum / (double)n;
    double ss = 0;
    for (size_t i = 0; i < n; i++)
        ss += (v[i] - d->mean) * (v[i] - d->mean);
    d->std = sqrt(ss / (double)n);
    d->median = bench_stats_percentile(v, n, 50);
    d->p90 = bench_stats_percentile(v, n, 90);
    d->p95 = bench_stats_percentile(v, n, 95);
    d->p99 = bench_stats_percentile(v, n, 99);
}
