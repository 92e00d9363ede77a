/*
 * bench_trace: tidepool-bench --trace, a replay of the simulator's trace files
 * (tidepool-sim --trace, tools/sim/sim_workload.h) against any OpenAI-compatible server.
 *
 * Format (the simulator's, read the same way): one request per line, sorted by arrival on
 * load (stable: ties keep file order); blank lines and lines starting with # are skipped.
 *   CSV:   arrival_s,prompt_tokens,output_tokens[,class]   (a header line is allowed)
 *   JSONL: {"arrival_s": 0.5, "prompt_tokens": 900, "output_tokens": 40, "class": "online"}
 * class is "online" (default; also "0", "default", "auto", "interactive") or "offline"
 * ("1", "flex", "batch"; JSON "offline": true or "service_tier": "flex" too).
 *
 * Each request is sent at its arrival_s times --time-scale (open loop), its prompt as
 * exactly prompt_tokens token ids: BOS (when the model has one) and then a run of the
 * pool, real token ids of synthetic text that the server's own tokenizer produced (its
 * /tokenize, or the --prompt-tokenizer GGUF), starting at an offset drawn per request
 * from --seed so that prompts share no prefix; max_tokens = min_tokens = output_tokens
 * with "ignore_eos": true, so the answer has the trace's length; an offline request says
 * "service_tier": "flex" (tidepool's offline tier, docs/api.md).
 */
#ifndef TP_BENCH_TRACE_H
#define TP_BENCH_TRACE_H

#include <stddef.h>

#include "bench_args.h"

typedef struct bench_trace bench_trace_t;

/* One line of a trace. */
typedef struct {
    double arrival_s;         /* scaled by the time scale, seconds after the start */
    long long prompt_tokens;  /* >= 1 */
    long long output_tokens;  /* >= 1 */
    int offline;              /* 1: offline class */
    size_t line;              /* line number in the file (messages) */
} bench_trace_req;

/* Load the trace at path: every line checked (arrival_s finite >= 0, token counts integers
 * in [1, 1e9], a known class), sorted stably by arrival, arrival times multiplied by
 * time_scale (> 0), then the first max_reqs kept (0: all). Returns the trace (the
 * caller's), or NULL with a message naming the file and line in err. */
bench_trace_t *bench_trace_load(const char *path, double time_scale, size_t max_reqs,
                                char *err, size_t err_len);

/* Free; takes NULL and NULLs *t. */
void bench_trace_destroy(bench_trace_t **t);

/* Number of requests (>= 1) and request i (i < size; borrowed). */
size_t bench_trace_size(const bench_trace_t *t);
const bench_trace_req *bench_trace_at(const bench_trace_t *t, size_t i);

/* The longest prompt of the trace, in tokens. */
long long bench_trace_max_prompt(const bench_trace_t *t);

/* The arrival span the simulator divides goodput by: the last arrival, at least 1 s. */
double bench_trace_span_s(const bench_trace_t *t);

/* Check every request against the server's context window: prompt + output tokens <=
 * max_model_len (> 0). Returns 0, or -1 with a message in err that starts with the
 * number of the first line over it ("12: prompt + output = ..."). */
int bench_trace_check_context(const bench_trace_t *t, long long max_model_len, char *err,
                              size_t err_len);

/* Give the trace the token pool prompts are cut from: ids[0..n) (n >= 1, consumed: the
 * trace frees it) and the BOS id that starts each prompt (< 0: none). */
void bench_trace_set_pool(bench_trace_t *t, int *ids, size_t n, int bos);

/* The JSON body of request idx (the pool set): "model", "prompt" (token ids),
 * "max_tokens", "min_tokens", "ignore_eos", "stream" with usage, "temperature" and, for an
 * offline request, "service_tier": "flex". a gives the seed and temperature. Returns a
 * malloc'd compact JSON text (the caller's), or NULL on out of memory. */
char *bench_trace_body(const bench_trace_t *t, const bench_args *a, const char *model,
                       size_t idx);

#endif
