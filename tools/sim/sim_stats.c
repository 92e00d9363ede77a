/*
 * sim_stats: mean and percentiles of tidepool-sim's samples (sim_stats.h). A percentile
 * selects its rank with quickselect (middle pivot, Hoare partition) and takes the next
 * rank as the minimum of the part above it.
 */
#include "sim_stats.h"

double sim_stats_mean(const double *v, size_t n)
{
    double t = 0;
    for (size_t i = 0; i < n; i++)
        t += v[i];
    return n ? t / (double)n : 0;
}

/* The k-th smallest of v[0..n) (0-based), reordering v: quickselect, O(n) expected and
 * deterministic (middle pivot). */
static double kth_smallest(double *v, size_t n, size_t k)
{
    size_t lo = 0, hi = n - 1;
    while (lo < hi) {
        double pivot = v[lo + (hi - lo) / 2];
        size_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] < pivot)
                i++;
            while (v[j] > pivot)
                j--;
            if (i <= j) {
                double t = v[i];
                v[i] = v[j];
                v[j] = t;
                i++;
                if (j == 0)
                    break;
                j--;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            return v[k];
    }
    return v[k];
}

double sim_stats_percentile(double *v, size_t n, double p)
{
    if (n == 0)
        return 0;
    double pos = p / 100.0 * (double)(n - 1);
    size_t lo = (size_t)pos;
    double a = kth_smallest(v, n, lo);
    if (lo + 1 >= n)
        return a;
    /* after the select, everything above lo is >= a: the next rank is their minimum */
    double b = v[lo + 1];
    for (size_t i = lo + 2; i < n; i++)
        if (v[i] < b)
            b = v[i];
    return a + (b - a) * (pos - (double)lo);
}
