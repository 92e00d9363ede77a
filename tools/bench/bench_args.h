/*
 * bench_args: the flags of tidepool-bench, one table (name, kind, default, bounds, help)
 * that both the parser and --help read.
 *
 * Unlike the servers, the bench takes flags only (no TIDEPOOL_* environment, no config
 * file): a benchmark must be reproducible from its command line, which the result JSON
 * records, and names such as TIDEPOOL_MODEL (a model path for the launcher) mean something
 * else here. The one exception is the API key, a secret: --api-key, else TIDEPOOL_API_KEY,
 * else OPENAI_API_KEY (read by the program, not here); the result JSON hides it. `--name value` and `--name=value` are accepted; boolean flags take no value.
 * The parser reports usage errors on stderr with a message naming the flag (the program
 * then exits with status 2) and prints --help on stdout.
 */
#ifndef TP_BENCH_ARGS_H
#define TP_BENCH_ARGS_H

#include <stddef.h>

/* Indexes of bench_args.slo_ms. */
enum {
    BENCH_ARGS_SLO_TTFT = 0,
    BENCH_ARGS_SLO_TPOT = 1,
    BENCH_ARGS_SLO_E2EL = 2,
    BENCH_ARGS_N_SLO = 3,
};

/* The parsed flags. String fields point into argv or to the defaults' literals (borrowed:
 * argv must outlive the struct). */
typedef struct {
    const char *url;
    const char *endpoint;
    const char *api_key;     /* NULL: none given as a flag */
    const char *model;       /* NULL: first id of GET /v1/models */
    long long num_prompts;
    long long concurrency;   /* 0 = unlimited */
    double request_rate;     /* requests/s; INFINITY = all at once */
    long long seed;
    long long input_len;     /* words */
    long long output_len;    /* max_tokens */
    long long input_range[2];  /* [0] < 0: unset */
    long long output_range[2];
    const char *dataset;
    const char *workload;    /* "synthetic" | "phase-shift" | "multi-turn" | "shared-prefix" */
    long long conversations; /* multi-turn: conversations at once */
    long long turns;         /* multi-turn: user turns per conversation */
    long long system_len;    /* multi-turn: words of the system prompt all conversations share */
    long long prefix_len;    /* shared-prefix: words of the prefix every prompt starts with */
    long long prefix_groups; /* shared-prefix: distinct prefixes, one drawn per prompt */
    double phase_s;
    long long phase_short_len;
    double decode_rate;      /* phase-shift: requests/s of decode-heavy phases; 0 = request_rate */
    double duration_s;       /* arrivals stop this long after the start; 0 = no limit */
    const char *trace_out;   /* write every request's arrival and shape as a CSV trace */
    const char *trace;       /* replay this trace (bench_trace.h); NULL: none */
    double time_scale;       /* --trace: arrival times are multiplied by it */
    double offline_timeout_s; /* --trace: deadline of offline requests; 0 = timeout_s */
    double temperature;
    int ignore_eos;
    double slo_ms[BENCH_ARGS_N_SLO]; /* by BENCH_ARGS_SLO_*, in ms; < 0 = unset */
    const char *result_json;
    const char *plot;
    double timeout_s;
    int no_progress;
    int set_input_len, set_output_len; /* given explicitly (conflict checks) */
    int set_num_prompts, set_time_scale;
    const char *prompt_tokenizer;      /* GGUF file: send prompts as its token ids */
    /* Not a flag: set by the program when --prompt-tokenizer is given. Tokenizes len bytes
     * of text (BOS first, as the server would) into a malloc'd array (*ids, *n; the
     * caller frees). 0, or -1 (out of memory, tokenizer failure). */
    int (*tokenize)(void *ctx, const char *text, size_t len, int **ids, size_t *n);
    void *tokenize_ctx;
    /* Not a flag: set by the program for the multi-turn workload. The reply text request
     * idx received (borrowed, valid until the run ends), or NULL when it has none (failed,
     * not finished): the workload then puts a synthetic reply in the history. */
    const char *(*reply_of)(void *ctx, size_t idx);
    void *reply_ctx;
} bench_args;

/* The name of SLO k (BENCH_ARGS_SLO_*) as written in --goodput: "ttft", "tpot" or "e2el";
 * "?" for any other k. A static string. */
const char *bench_args_slo_name(int k);

/* Parse argv[1..argc) into *a, defaults first. Checks each value against its flag's kind
 * and bounds; cross-flag checks are the caller's. Returns 0, 1 when --help (or -h) was
 * printed on stdout, -1 on a usage error (message on stderr). */
int bench_args_parse(bench_args *a, int argc, char **argv);

#endif
