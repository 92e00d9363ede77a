/*
 * prometheus: GET /metrics, the gateway's figures in the Prometheus text format (0.0.4),
 * vLLM's metric names under the PROMETHEUS_PREFIX prefix, in Prometheus's naming (no colon,
 * base units, _total on counters: promtool check metrics is silent; docs/stats.md lists
 * every family, its labels and the vLLM name it follows).
 *
 * Request-level families (counters, histograms) come from the stats (stats.h); worker
 * families (load, KV cache, token counters, speculative decoding, KV transfers,
 * migrations) from the workers' last heartbeats, read from the cluster when asked. The
 * text is written with metrics.h's writers. Loop thread only (it reads the cluster).
 */
#ifndef TP_GW_PROMETHEUS_H
#define TP_GW_PROMETHEUS_H

#include <stdio.h>

#include "cluster.h"
#include "stats.h"

#define PROMETHEUS_PREFIX "tidepool_" /* prefix of every metric name */

/* Write every metric to f (stdio errors are left in ferror(f)). s is borrowed; c may be
 * NULL (no worker series; the gateway's queue figures are 0). Uses a scratch array for
 * the workers: out of memory leaves worker series out, never fails the rest. */
void prometheus_write(const stats_t *s, const cluster_t *c, FILE *f);

#endif
