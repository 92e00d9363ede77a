/*
 * sim_stats: the summary figures of tidepool-sim's samples (TTFT, TPOT), with the same
 * definitions as tidepool-bench (bench_stats.h) so simulated and measured figures compare:
 * percentiles interpolate linearly between closest ranks (numpy's default). The simulator
 * takes percentiles of large samples every tick, so they use a selection (O(n) expected)
 * instead of a sort.
 */
#ifndef TP_SIM_STATS_H
#define TP_SIM_STATS_H

#include <stddef.h>

/* Mean of v[0..n); 0 when n = 0. */
double sim_stats_mean(const double *v, size_t n);

/* Percentile p (in [0, 100]) of v[0..n): v_(lo) + (v_(lo+1) - v_(lo)) * frac, where v_(k)
 * is the k-th smallest (from 0) and lo + frac = p / 100 * (n - 1). 0 when n = 0. Reorders
 * v (deterministically: the same input gives the same order). */
double sim_stats_percentile(double *v, size_t n, double p);

#endif
