/*
 * tidepool-generate: run the engine alone, in-process (no gateway, no workers).
 *
 *   tidepool-generate --model GGUF --prompt TEXT --max-tokens N
 *                     [--temperature T] [--top-p P] [--top-k K] [--seed S] [--logprobs K]
 *
 * Prints the completion (the generated text only, not the prompt) to stdout and, on
 * stderr, the prompt token ids, the generated token ids and the decode speed; with
 * --logprobs K, one line "logprob <id> <lp> <id>:<lp> ..." per generated token first: the
 * token's log-softmax and the K most likely tokens', computed here in double from the raw
 * logits (a reference for the served logprobs, tests/integration/test_logprobs.py). The prompt
 * is encoded with BOS and prefilled in one forward pass; decoding then runs one token per
 * pass and stops at EOS or after N tokens. Used to compare against serving through the
 * gateway, which must give the same tokens for the same request.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvcache.h"
#include "model.h"
#include "sampler.h"
#include "tokenizer.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: tidepool-generate --model GGUF --prompt TEXT --max-tokens N\n"
               "                         [--temperature T] [--top-p P] [--top-k K] [--seed S]\n"
               "  --temperature  0 = greedy (default 0)\n"
               "  --top-p        nucleus mass in (0, 1] (default 1 = off)\n"
               "  --top-k        keep the K most likely tokens (default 0 = off)\n"
               "  --seed         random seed (default 0)\n"
               "  --logprobs     print each token's log-probability and the K most likely "
               "(0..20; default: none)\n");
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* "logprob <id> <lp> <id>:<lp> ..." on stderr: log-softmax of logits (n floats) in double,
 * the token's and the k largest (ties: the lower id first), computed independently of the
 * sampler's code. */
static void print_logprobs(const float *logits, int n, int token, int k)
{
    double mx = logits[0], sum = 0;
    for (int i = 1; i < n; i++)
        mx = logits[i] > mx ? logits[i] : mx;
    for (int i = 0; i < n; i++)
        sum += exp((double)logits[i] - mx);
    double lse = mx + log(sum);
    fprintf(stderr, "logprob %d %.9g", token, (double)logits[token] - lse);
    unsigned char used[65536] = {0};
    for (int j = 0; j < k && j < n && n <= 65536; j++) {
        int best = -1;
        for (int i = 0; i < n; i++)
            if (!used[i] && (best < 0 || logits[i] > logits[best]))
                best = i;
        used[best] = 1;
        fprintf(stderr, " %d:%.9g", best, (double)logits[best] - lse);
    }
    fprintf(stderr, "\n");
}

static int parse_num(const char *flag, const char *s, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) {
        fprintf(stderr, "tidepool-generate: %s: invalid value '%s' (range %g..%g)\n", flag, s, lo,
                hi);
        return -1;
    }
    *out = v;
    return 0;
}

int main(int argc, char **argv)
{
    const char *model_path = NULL, *prompt = NULL;
    double max_tokens = -1, temperature = 0, top_p = 1, top_k = 0, seed = 0, n_lp = -1;
    for (int i = 1; i < argc; i += 2) { /* every option takes a value */
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        } else if (!v) {
            bad = 1;
        } else if (strcmp(a, "--model") == 0) {
            model_path = v;
        } else if (strcmp(a, "--prompt") == 0) {
            prompt = v;
        } else if (strcmp(a, "--max-tokens") == 0) {
            bad = parse_num(a, v, 0, 1 << 24, &max_tokens);
        } else if (strcmp(a, "--temperature") == 0) {
            bad = parse_num(a, v, 0, 100, &temperature);
        } else if (strcmp(a, "--top-p") == 0) {
            bad = parse_num(a, v, 1e-9, 1, &top_p);
        } else if (strcmp(a, "--top-k") == 0) {
            bad = parse_num(a, v, 0, 1 << 24, &top_k);
        } else if (strcmp(a, "--seed") == 0) {
            bad = parse_num(a, v, 0, 1.8e19, &seed);
        } else if (strcmp(a, "--logprobs") == 0) {
            bad = parse_num(a, v, 0, 20, &n_lp);
        } else {
            bad = 1;
        }
        if (bad) {
            fprintf(stderr, "tidepool-generate: bad or incomplete argument: %s\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!model_path || !prompt || max_tokens < 0) {
        usage(stderr);
        return 2;
    }

    char err[512];
    int rc = 1;
    model_t *m = NULL;
    tokenizer_t *tok = NULL;
    model_ctx_t *ctx = NULL;
    kvcache_t *kv = NULL;
    sampler_t *smp = NULL;
    int *ptoks = NULL, *gen = NULL;
    float *logits = NULL, *raw = NULL;

    m = model_load(model_path, err, sizeof(err));
    if (!m) {
        fprintf(stderr, "tidepool-generate: %s\n", err);
        goto out;
    }
    tok = tokenizer_load(model_path, err, sizeof(err));
    if (!tok) {
        fprintf(stderr, "tidepool-generate: %s\n", err);
        goto out;
    }
    const model_config *c = model_get_config(m);
    size_t plen = strlen(prompt);
    int need = 0;
    ptoks = malloc((plen + 3) * sizeof(int));
    if (!ptoks)
        goto out;
    int n_prompt = tokenizer_encode(tok, prompt, plen, 1, ptoks, (int)plen + 3, &need);
    if (n_prompt < 1) {
        fprintf(stderr, "tidepool-generate: cannot encode the prompt\n");
        goto out;
    }
    int n_gen = (int)max_tokens;
    if (n_prompt + n_gen > c->n_ctx) {
        fprintf(stderr,
                "tidepool-generate: prompt (%d tokens) + max tokens (%d) exceed the "
                "context (%d)\n",
                n_prompt, n_gen, c->n_ctx);
        goto out;
    }
    kvcache_params kp = {
        .n_layer = c->n_layer,
        .n_kv_head = c->n_kv_head,
        .head_dim = c->head_dim,
        .block_size = 16,
        .n_blocks = (c->n_ctx + 15) / 16,
        .max_seqs = 1,
        .max_seq_len = c->n_ctx,
    };
    kv = kvcache_new(&kp);
    ctx = model_ctx_new(m, n_prompt);
    smp = sampler_new(c->vocab_size);
    gen = malloc(((size_t)n_gen + 1) * sizeof(int));
    logits = malloc((size_t)c->vocab_size * sizeof(float));
    raw = malloc((size_t)c->vocab_size * sizeof(float));
    if (!kv || !ctx || !smp || !gen || !logits || !raw) {
        fprintf(stderr, "tidepool-generate: out of memory\n");
        goto out;
    }
    int seq = kvcache_seq_new(kv);
    if (kvcache_seq_reserve(kv, seq, n_prompt + n_gen) != KVCACHE_OK)
        goto out;
    sampler_params sp = {
        .temperature = (float)temperature, .top_p = (float)top_p, .top_k = (int)top_k};
    uint64_t rng = sampler_seed_state((uint64_t)seed);

    model_seq_batch b = {.seq = seq,
                         .pos = 0,
                         .n_tokens = n_prompt,
                         .tokens = ptoks,
                         .logits_all = 0,
                         .logits = logits};
    if (n_gen > 0 && model_forward(ctx, kv, &b, 1, NULL, NULL) != 0) {
        fprintf(stderr, "tidepool-generate: forward pass failed\n");
        goto out;
    }
    int n_out = 0, prev = ptoks[n_prompt - 1];
    double t0 = now_s();
    while (n_out < n_gen) {
        if (n_lp >= 0) { /* the raw logits, before sampling transforms them in place */
            memcpy(raw, logits, (size_t)c->vocab_size * sizeof(float));
        }
        int next = sampler_sample(smp, &sp, &rng, logits);
        if (n_lp >= 0)
            print_logprobs(raw, c->vocab_size, next, (int)n_lp);
        gen[n_out++] = next;
        if (next == c->eos_id)
            break;
        size_t len;
        const char *piece = tokenizer_piece(tok, prev, next, &len);
        fwrite(piece, 1, len, stdout);
        fflush(stdout);
        prev = next;
        if (n_out == n_gen)
            break;
        b.pos = n_prompt + n_out - 1;
        b.n_tokens = 1;
        b.tokens = &gen[n_out - 1];
        if (model_forward(ctx, kv, &b, 1, NULL, NULL) != 0) {
            fprintf(stderr, "tidepool-generate: forward pass failed\n");
            goto out;
        }
    }
    double dt = now_s() - t0;
    printf("\n");
    fprintf(stderr, "prompt tokens (%d):", n_prompt);
    for (int i = 0; i < n_prompt; i++)
        fprintf(stderr, " %d", ptoks[i]);
    fprintf(stderr, "\ngenerated tokens (%d):", n_out);
    for (int i = 0; i < n_out; i++)
        fprintf(stderr, " %d", gen[i]);
    fprintf(stderr, "\ndecode: %d tokens in %.3f s, %.1f tokens/s\n", n_out, dt,
            dt > 0 ? (n_out > 1 ? n_out - 1 : n_out) / dt : 0.0);
    rc = 0;
out:
    free(logits);
    free(raw);
    free(gen);
    free(ptoks);
    sampler_destroy(&smp);
    model_ctx_destroy(&ctx);
    kvcache_destroy(&kv);
    tokenizer_destroy(&tok);
    model_destroy(&m);
    return rc;
}
