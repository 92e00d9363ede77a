/*
 * bench_args: the flag table of tidepool-bench and its parser (bench_args.h). Each entry
 * names the field it fills by offset, so the parser, the defaults and --help are one
 * table.
 */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_args.h"

typedef enum {
    ARG_STRING, /* const char * (points into argv or the default literal) */
    ARG_INT,    /* long long, bounds [min, max] */
    ARG_DOUBLE, /* double, bounds [min, max], finite */
    ARG_BOOL,   /* int, set to 1 by the bare flag */
    ARG_RANGE,  /* long long[2] "a:b", a <= b, bounds [min, max] */
    ARG_RATE,   /* double, "inf" or a number in (0, max] */
    ARG_SLO,    /* repeatable "ttft:MS" | "tpot:MS" | "e2el:MS" (several may be joined by
                   ',' or ' '); double[3] in ms, < 0 = unset */
} arg_kind_t;

static const char *const slo_names[BENCH_ARGS_N_SLO] = {"ttft", "tpot", "e2el"};

const char *bench_args_slo_name(int k)
{
    return k >= 0 && k < BENCH_ARGS_N_SLO ? slo_names[k] : "?";
}

typedef struct {
    const char *name;
    arg_kind_t kind;
    size_t off;          /* offset of the field in bench_args */
    const char *def;     /* default as text, NULL = none */
    double min, max;
    const char *metavar;
    const char *help;
} arg_entry;

#define ARG_OFF(f) offsetof(bench_args, f)

static const arg_entry arg_table[] = {
    {"url", ARG_STRING, ARG_OFF(url), "http://127.0.0.1:8000", 0, 0, "URL",
     "server root (http only); the request path is its path + --endpoint"},
    {"endpoint", ARG_STRING, ARG_OFF(endpoint), "/v1/completions", 0, 0, "PATH",
     "/v1/completions or /v1/chat/completions (chat if it ends in chat/completions)"},
    {"api-key", ARG_STRING, ARG_OFF(api_key), NULL, 0, 0, "KEY",
     "send Authorization: Bearer KEY (default: $TIDEPOOL_API_KEY, else $OPENAI_API_KEY; "
     "hidden in --result-json)"},
    {"model", ARG_STRING, ARG_OFF(model), NULL, 0, 0, "NAME",
     "model name to send; default: the first id of GET /v1/models"},
    {"num-prompts", ARG_INT, ARG_OFF(num_prompts), "100", 1, 1000000, "N",
     "number of requests"},
    {"concurrency", ARG_INT, ARG_OFF(concurrency), "0", 0, 1000000, "C",
     "at most C requests in flight (0 = unlimited); alone: a closed loop of C clients"},
    {"max-concurrency", ARG_INT, ARG_OFF(concurrency), NULL, 0, 1000000, "C",
     "same as --concurrency (vLLM's name)"},
    {"request-rate", ARG_RATE, ARG_OFF(request_rate), "inf", 0, 1e9, "R",
     "Poisson arrivals at R requests/s; inf = all at once"},
    {"seed", ARG_INT, ARG_OFF(seed), "0", 0, 9.0e18, "S",
     "seed of every random choice (lengths, words, arrivals): same seed, same requests"},
    {"input-len", ARG_INT, ARG_OFF(input_len), "128", 1, 10000000, "N",
     "synthetic prompt length in words (tokens per word depend on the tokenizer: "
     "about 2.4 with stories260K, 1 with large vocabularies)"},
    {"output-len", ARG_INT, ARG_OFF(output_len), "128", 1, 10000000, "N",
     "max_tokens of each request"},
    {"input-len-range", ARG_RANGE, ARG_OFF(input_range), NULL, 1, 10000000, "A:B",
     "prompt length uniform in [A, B] words (instead of --input-len)"},
    {"output-len-range", ARG_RANGE, ARG_OFF(output_range), NULL, 1, 10000000, "A:B",
     "max_tokens uniform in [A, B] (instead of --output-len)"},
    {"dataset", ARG_STRING, ARG_OFF(dataset), NULL, 0, 0, "FILE",
     "JSONL prompts: {\"prompt\": ..., \"max_tokens\": N} or {\"messages\": [...]} per line"},
    {"workload", ARG_STRING, ARG_OFF(workload), "synthetic", 0, 0, "NAME",
     "synthetic | phase-shift (alternating prefill-heavy / decode-heavy phases) | "
     "multi-turn (chats that resend their history: --conversations, --turns, "
     "--system-len) | shared-prefix (prompts sharing --prefix-len words)"},
    {"conversations", ARG_INT, ARG_OFF(conversations), "8", 1, 100000, "N",
     "multi-turn: N conversations run side by side (the run has N x --turns requests)"},
    {"turns", ARG_INT, ARG_OFF(turns), "5", 1, 10000, "T",
     "multi-turn: user turns per conversation; turn t is sent once turn t - 1 of its "
     "conversation ended and resends the conversation so far, replies included"},
    {"system-len", ARG_INT, ARG_OFF(system_len), "64", 0, 10000000, "N",
     "multi-turn: words of the system prompt every conversation starts with (0 = none)"},
    {"prefix-len", ARG_INT, ARG_OFF(prefix_len), "256", 1, 10000000, "N",
     "shared-prefix: words of the prefix every prompt starts with (each then has "
     "--input-len words of its own)"},
    {"prefix-groups", ARG_INT, ARG_OFF(prefix_groups), "1", 1, 1000000, "G",
     "shared-prefix: G distinct prefixes (of --prefix-len words each); each prompt draws "
     "one at random (SGLang's generated-shared-prefix groups)"},
    {"phase-seconds", ARG_DOUBLE, ARG_OFF(phase_s), "10", 0.001, 1e6, "S",
     "phase-shift: length of each phase"},
    {"phase-short-len", ARG_INT, ARG_OFF(phase_short_len), "16", 1, 10000000, "N",
     "phase-shift: the short side (output of prefill-heavy, prompt of decode-heavy)"},
    {"decode-rate", ARG_DOUBLE, ARG_OFF(decode_rate), "0", 0, 1e9, "R",
     "phase-shift: Poisson arrivals at R requests/s during the decode-heavy phases (0 = "
     "--request-rate); needs a finite --request-rate"},
    {"duration-s", ARG_DOUBLE, ARG_OFF(duration_s), "0", 0, 1e9, "S",
     "no arrival at or after S seconds (0 = no limit; needs a finite --request-rate); "
     "--num-prompts is then an upper bound"},
    {"trace", ARG_STRING, ARG_OFF(trace), NULL, 0, 0, "FILE",
     "replay a tidepool-sim trace (CSV arrival_s,prompt_tokens,output_tokens[,class] or "
     "JSONL) open-loop: prompts of exactly prompt_tokens token ids (the server's /tokenize, "
     "or --prompt-tokenizer), output_tokens generated (ignore_eos, min_tokens), offline "
     "lines as service_tier flex; --num-prompts then keeps the first N (docs/workloads.md)"},
    {"time-scale", ARG_DOUBLE, ARG_OFF(time_scale), "1", 1e-6, 1e6, "X",
     "--trace: multiply every arrival time by X (0.5 replays twice as fast)"},
    {"offline-timeout-s", ARG_DOUBLE, ARG_OFF(offline_timeout_s), "0", 0, 1e7, "S",
     "--trace: offline requests fail S s after they were sent (queued offline work may wait "
     "long; 0 = --timeout-s)"},
    {"trace-out", ARG_STRING, ARG_OFF(trace_out), NULL, 0, 0, "FILE",
     "after the run, write every request as a CSV line arrival_s,prompt_tokens,"
     "output_tokens,class (the trace format of tidepool-sim --trace)"},
    {"temperature", ARG_DOUBLE, ARG_OFF(temperature), "0", 0, 2, "T",
     "sampling temperature sent with every request"},
    {"ignore-eos", ARG_BOOL, ARG_OFF(ignore_eos), NULL, 0, 0, NULL,
     "send \"ignore_eos\": true (vLLM extension): generate exactly max_tokens"},
    {"prompt-tokenizer", ARG_STRING, ARG_OFF(prompt_tokenizer), NULL, 0, 0, "GGUF",
     "send each prompt as the token ids of this model file's tokenizer (BOS first) instead "
     "of text: two servers that tokenize the same text differently then get the same "
     "prompts (completions endpoint only)"},
    {"goodput", ARG_SLO, ARG_OFF(slo_ms), NULL, 0, 1e12, "M:MS",
     "SLO for goodput, M = ttft | tpot | e2el, in ms; for several, repeat the flag or "
     "list them after it (--goodput ttft:500 tpot:50)"},
    {"result-json", ARG_STRING, ARG_OFF(result_json), NULL, 0, 0, "FILE",
     "write the summary and per-request records as JSON"},
    {"plot", ARG_STRING, ARG_OFF(plot), NULL, 0, 0, "FILE.png",
     "plot latency over time with gnuplot (skipped with a message if it is missing)"},
    {"timeout-s", ARG_DOUBLE, ARG_OFF(timeout_s), "600", 0.001, 1e7, "S",
     "a request not complete S seconds after it was sent fails (bounds the run)"},
    {"no-progress", ARG_BOOL, ARG_OFF(no_progress), NULL, 0, 0, NULL,
     "no progress bar (it is drawn on stderr only when stderr is a terminal)"},
    {NULL, 0, 0, NULL, 0, 0, NULL, NULL},
};

/* Print text from column col, wrapped at 80 columns, continuation lines at column 31. */
static void args_wrap(FILE *f, const char *text, int col)
{
    while (*text) {
        int room = 80 - col, n = (int)strlen(text);
        if (n > room) {
            n = room;
            while (n > 0 && text[n] != ' ')
                n--;
            if (n == 0)
                n = room;
        }
        fprintf(f, "%.*s\n", n, text);
        text += n;
        while (*text == ' ')
            text++;
        if (*text)
            fprintf(f, "%31s", "");
        col = 31;
    }
}

static void args_help(FILE *f)
{
    fprintf(f, "usage: tidepool-bench [--flag value ...]\n\n"
               "Load-test client for an OpenAI-compatible server (tidepool, vLLM,\n"
               "llama-server): streams every request and reports TTFT, TPOT, ITL, E2EL and\n"
               "throughput like vLLM's `bench serve`. Flags only (no config file; from the\n"
               "environment only the API key). See docs/bench.md.\n\n");
    for (const arg_entry *e = arg_table; e->name; e++) {
        char left[64], text[512];
        snprintf(left, sizeof(left), "--%s%s%s", e->name, e->metavar ? " " : "",
                 e->metavar ? e->metavar : "");
        snprintf(text, sizeof(text), "%s%s%s%s", e->help, e->def ? " (default: " : "",
                 e->def ? e->def : "", e->def ? ")" : "");
        fprintf(f, "  %-28s ", left);
        args_wrap(f, text, 31);
    }
    fprintf(f, "  %-28s %s\n", "--help", "print this help");
}

static int args_fail(const char *name, const char *val, const char *want)
{
    fprintf(stderr, "tidepool-bench: invalid value '%s' for --%s: %s (see --help)\n", val,
            name, want);
    return -1;
}

static int args_int(const char *s, long long *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end)
        return -1;
    *out = v;
    return 0;
}

static int args_slo(const arg_entry *e, double *slo, const char *val)
{
    char buf[256];
    if (strlen(val) >= sizeof(buf))
        return args_fail(e->name, val, "too long");
    strcpy(buf, val);
    char *save = NULL;
    int n = 0;
    for (char *tok = strtok_r(buf, ", ", &save); tok; tok = strtok_r(NULL, ", ", &save)) {
        char *colon = strchr(tok, ':');
        if (!colon)
            return args_fail(e->name, val, "want ttft:MS, tpot:MS or e2el:MS");
        *colon = 0;
        int k = -1;
        for (int i = 0; i < BENCH_ARGS_N_SLO; i++)
            if (strcmp(tok, slo_names[i]) == 0)
                k = i;
        char *end;
        errno = 0;
        double ms = strtod(colon + 1, &end);
        if (k < 0 || errno || end == colon + 1 || *end || !isfinite(ms) || ms <= 0)
            return args_fail(e->name, val, "want ttft:MS, tpot:MS or e2el:MS with MS > 0");
        slo[k] = ms;
        n++;
    }
    return n > 0 ? 0 : args_fail(e->name, val, "want ttft:MS, tpot:MS or e2el:MS");
}

static int args_set(const arg_entry *e, bench_args *a, const char *val)
{
    void *p = (char *)a + e->off;
    char *end;
    switch (e->kind) {
    case ARG_STRING:
        *(const char **)p = val;
        return 0;
    case ARG_BOOL:
        *(int *)p = 1;
        return 0;
    case ARG_INT: {
        long long v;
        if (args_int(val, &v) < 0 || v < e->min || (double)v > e->max) {
            char want[96];
            snprintf(want, sizeof(want), "want an integer in [%.0f, %.0f]", e->min, e->max);
            return args_fail(e->name, val, want);
        }
        *(long long *)p = v;
        return 0;
    }
    case ARG_DOUBLE: {
        errno = 0;
        double v = strtod(val, &end);
        if (errno || end == val || *end || !isfinite(v) || v < e->min || v > e->max) {
            char want[96];
            snprintf(want, sizeof(want), "want a number in [%g, %g]", e->min, e->max);
            return args_fail(e->name, val, want);
        }
        *(double *)p = v;
        return 0;
    }
    case ARG_RATE: {
        if (strcmp(val, "inf") == 0) {
            *(double *)p = INFINITY;
            return 0;
        }
        errno = 0;
        double v = strtod(val, &end);
        if (errno || end == val || *end || !isfinite(v) || v <= 0 || v > e->max)
            return args_fail(e->name, val, "want 'inf' or a rate > 0 in requests/s");
        *(double *)p = v;
        return 0;
    }
    case ARG_RANGE: {
        long long *r = p;
        char buf[64];
        const char *colon = strchr(val, ':');
        if (!colon || (size_t)(colon - val) >= sizeof(buf))
            return args_fail(e->name, val, "want A:B");
        memcpy(buf, val, (size_t)(colon - val));
        buf[colon - val] = 0;
        long long lo, hi;
        if (args_int(buf, &lo) < 0 || args_int(colon + 1, &hi) < 0 || lo < e->min ||
            (double)hi > e->max || lo > hi) {
            char want[96];
            snprintf(want, sizeof(want), "want A:B with %.0f <= A <= B <= %.0f", e->min,
                     e->max);
            return args_fail(e->name, val, want);
        }
        r[0] = lo;
        r[1] = hi;
        return 0;
    }
    case ARG_SLO:
        return args_slo(e, p, val);
    }
    return -1;
}

int bench_args_parse(bench_args *a, int argc, char **argv)
{
    memset(a, 0, sizeof(*a));
    a->input_range[0] = a->output_range[0] = -1;
    for (int k = 0; k < BENCH_ARGS_N_SLO; k++)
        a->slo_ms[k] = -1;
    for (const arg_entry *e = arg_table; e->name; e++)
        if (e->def && args_set(e, a, e->def) < 0)
            return -1;
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i];
        if (strcmp(s, "--help") == 0 || strcmp(s, "-h") == 0) {
            args_help(stdout);
            return 1;
        }
        if (strncmp(s, "--", 2) != 0) {
            fprintf(stderr, "tidepool-bench: unexpected argument '%s' (see --help)\n", s);
            return -1;
        }
        s += 2;
        const char *eq = strchr(s, '=');
        size_t len = eq ? (size_t)(eq - s) : strlen(s);
        const arg_entry *e = arg_table;
        for (; e->name; e++)
            if (strlen(e->name) == len && strncmp(e->name, s, len) == 0)
                break;
        if (!e->name) {
            fprintf(stderr, "tidepool-bench: unknown flag '%s' (see --help)\n", argv[i]);
            return -1;
        }
        const char *val;
        if (e->kind == ARG_BOOL) {
            if (eq) {
                fprintf(stderr, "tidepool-bench: --%s takes no value\n", e->name);
                return -1;
            }
            val = "1";
        } else if (eq) {
            val = eq + 1;
        } else if (i + 1 < argc) {
            val = argv[++i];
        } else {
            fprintf(stderr, "tidepool-bench: --%s needs a value (see --help)\n", e->name);
            return -1;
        }
        if (args_set(e, a, val) < 0)
            return -1;
        /* vLLM style: --goodput ttft:500 tpot:50 (values up to the next flag) */
        while (e->kind == ARG_SLO && !eq && i + 1 < argc && argv[i + 1][0] != '-' &&
               strchr(argv[i + 1], ':'))
            if (args_set(e, a, argv[++i]) < 0)
                return -1;
        if (strcmp(e->name, "input-len") == 0)
            a->set_input_len = 1;
        if (strcmp(e->name, "output-len") == 0)
            a->set_output_len = 1;
        if (strcmp(e->name, "num-prompts") == 0)
            a->set_num_prompts = 1;
        if (strcmp(e->name, "time-scale") == 0)
            a->set_time_scale = 1;
    }
    return 0;
}
