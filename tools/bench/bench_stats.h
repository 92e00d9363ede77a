/*
 * bench_stats: summary statistics of latency samples, computed the way vLLM's
 * `bench serve` does with numpy, so that figures are comparable: mean, population standard
 * deviation (np.std, ddof 0), median (np.median) and percentiles with linear interpolation
 * between closest ranks (np.percentile's default: rank p/100 * (n - 1), counted from 0).
 * An empty sample gives zeros (vLLM's `np.mean(x or 0)`). No allocation, no state.
 */
#ifndef TP_BENCH_STATS_H
#define TP_BENCH_STATS_H

#include <stddef.h>

typedef struct {
    size_t n;                  /* number of samples */
    double mean, std, median;  /* same unit as the samples */
    double p90, p95, p99;
} bench_stats;

/* Percentile p (in [0, 100]) of sorted[0..n), ascending, n >= 1: numpy's linear method,
 * sorted[lo] + (sorted[lo + 1] - sorted[lo]) * frac with lo + frac = p / 100 * (n - 1). */
double bench_stats_percentile(const double *sorted, size_t n, double p);

/* Fill *out from the samples v[0..n) (n may be 0: all zeros). Sorts v in place
 * (ascending). */
void bench_stats_compute(double *v, size_t n, bench_stats *out);

#endif
