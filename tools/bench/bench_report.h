/*
 * bench_report: the figures of a finished tidepool-bench run: the summary block (vLLM
 * `bench serve` layout and definitions), the result JSON, the gnuplot plot and the
 * tidepool-sim trace. Runs after the event loop, so it may block (file writes, gnuplot);
 * problems are reported on stderr with the file's name.
 *
 * Definitions (docs/bench.md has the long form), over successful requests only:
 *   TTFT  request sent -> first non-empty content chunk
 *   ITL   gap between consecutive content chunks (all requests' gaps pooled)
 *   TPOT  (E2EL - TTFT) / (output_tokens - 1), requests with output_tokens > 1
 *   E2EL  request sent -> response complete
 *   goodput: successful requests that meet every SLO given (--goodput), per second
 *   duration = first request sent -> last request ended; throughputs divide by it.
 */
#ifndef TP_BENCH_REPORT_H
#define TP_BENCH_REPORT_H

#include <stddef.h>
#include <stdio.h>

#include "bench.h"
#include "bench_stats.h"

#define BENCH_REPORT_ALL_PHASES (-2) /* bench_report_compute: every record */

/* The figures of a set of records. */
typedef struct {
    size_t completed, failed, good;      /* requests: successful, failed, meeting the SLOs */
    long long total_input, total_output; /* tokens of the successful requests */
    size_t n_prompt_estimated, n_output_estimated; /* token counts not from usage */
    bench_stats ttft, tpot, itl, e2el;   /* ms */
} bench_report_metrics;

/* Figures over the records of b whose phase is phase (BENCH_WORKLOAD_PHASE_*), or over all
 * with BENCH_REPORT_ALL_PHASES. Returns 0, or -1 on out of memory. */
int bench_report_compute(const bench *b, int phase, bench_report_metrics *m);

/* The figures of a --trace run, as tidepool-sim computes them. An online request meets the
 * SLOs when it succeeded with TTFT (and E2EL) counted from its arrival, not from its send,
 * and TPOT within every SLO given; requests that failed or were not sent count as missed. */
typedef struct {
    size_t n_online, online_good;  /* online requests; those meeting the SLOs */
    double attainment_pct;         /* 100 * online_good / n_online (100 with none) */
    double span_s;                 /* the last arrival, at least 1 s */
    double goodput;                /* online_good / span_s, the simulator's goodput */
    size_t n_offline, offline_completed;
    long long offline_output_tokens; /* of the completed offline requests */
} bench_report_trace_metrics;

/* The trace figures of b's records (any run; span_s is 1 without a trace). */
void bench_report_trace_figures(const bench *b, bench_report_trace_metrics *t);

/* Print the summary block of m to f, then the phases (phases[0] prefill-heavy, [1]
 * decode-heavy) when phases is not NULL, the error groups and notes. */
void bench_report_print(const bench *b, const bench_report_metrics *m,
                        const bench_report_metrics *phases, FILE *f);

/* Write --result-json (atomically: a temporary file, then rename): the figures, the run's
 * settings with argv[1..argc), the phases when not NULL, and every record. Returns 0, or
 * -1 with a message naming the file. */
int bench_report_json(const bench *b, const bench_report_metrics *m,
                      const bench_report_metrics *phases, int argc, char **argv);

/* --plot: latency over time with gnuplot. Returns 0 when the PNG was written or gnuplot is
 * missing (a message says so), -1 on failure (message). */
int bench_report_plot(const bench *b);

/* --trace-out: every request (sent or not) as a tidepool-sim trace line
 * arrival_s,prompt_tokens,output_tokens,class, so the simulator can replay exactly this
 * load. prompt_tokens is the server's usage count; a request without one (it failed or was
 * not sent) gets its words times the run's tokens per word (over requests with usage; 1
 * when none had usage), which a comment line reports. output_tokens is max_tokens as sent
 * (what --ignore-eos generates), else the tokens received, at least 1. Written atomically
 * (a temporary file, then rename). Returns 0, or -1 with a message naming the file. */
int bench_report_trace(const bench *b);

#endif
