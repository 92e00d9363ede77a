/*
 * bench_mtp: the MTP2 decode path, in-process (engine level: model + modules + specdec).
 *
 *   bench_mtp [--quick] [--isa avx2|avx512] [--rounds N] STORIES.gguf STORIES-MTP.gguf
 *             SYNTH-1B.gguf
 *
 * 1. Acceptance on held-out prompts (24 story openings that are neither reference prompts
 *    nor from the trainer's data): greedy draft-and-verify, 128 tokens per prompt, at depth
 *    1 and 2: mean acceptance length (vLLM's: 1 + accepted / drafts, i.e. tokens per
 *    draft-and-verify step), a1 = P(d1 accepted), a2 = P(d2 accepted | d1 accepted). The
 *    same at temperature 1 with rejection sampling and with one-hot drafts, for reference.
 *    Acceptance is measured with the default draft vocabulary (mtp.h: the FR-Spec subset
 *    head, max(256, vocab / 4) frequency-ranked tokens) and, for the greedy depth-2 runs,
 *    with the full head as well: what the cheaper head keeps.
 * 2. TPOT (time per output token of a sequence: decode time / tokens decoded per sequence)
 *    of the default model at depth 0, 1, 2, batch 1 and 16, greedy, 128 tokens, fastest of 7
 *    rounds over the depths (3 with --quick; three times as many at batch 1, whose rounds
 *    are short); the depth-2 / depth-0 ratio at batch 1 against
 *    the target (<= 0.7), the verify ratio (a forward pass of 2 and 3 tokens vs 1 at
 *    context 64), and the depth the adaptive controller (specdec_ctl, with costs
 *    measured here by specdec_measure_costs and the acceptance of part 1) picks at batch 1.
 * 3. On the synthetic 1B-class model (no trained modules exist for it): a side file of two
 *    modules shaped like trained ones (each block a copy of the model's last block, random
 *    eh_proj in the model's matrix type) is written once into --side-dir (default: this
 *    program's directory in the build tree; a valid NAME-mtp.gguf beside the model is
 *    used instead if there). Per instruction set
 *    (--isa X: X alone; without it, on an AVX-512 machine, AVX2 and AVX-512 contexts of the
 *    one loaded model side by side), N interleaved rounds (--rounds; default 3 with
 *    --quick, else 7), each: a module pass of one token with the full and the draft head,
 *    the pure verify ratio (a forward pass of 2 and 3 tokens vs 1; target <= 1.15 for 3;
 *    also in CPU seconds, which time slicing on a shared machine moves less than the wall
 *    time), the step cost at depth 1 and 2 relative to a plain decode step at batch 1
 *    (specdec_measure_costs), and where a depth-2 step's time goes (specdec profiling:
 *    module 1, module 2, verify, the rest, against a plain step); medians and ranges of
 *    the per-round ratios. From the acceptance of part 1, the speedup trained modules of
 *    that acceptance would give there: E_d / cost_d, E_1 = 1 + a1, E_2 = 1 + a1 + a1 a2
 *    (target >= 1.6 at depth 2, batch 1). Without --quick, one measurement at batch 1, 2, 4.
 *    The synthetic modules' drafts are almost never accepted, so their module passes are
 *    the shortest (module 1 over 1 position, module 2 over 2); trained ones that accept a
 *    drafts run a + 1 and a + 1 or a + 2.
 *
 * Numbers are ratios within one run on one (possibly shared) machine.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gguf.h"
#include "kernels.h"
#include "kvcache.h"
#include "model.h"
#include "mtp.h"
#include "sampler.h"
#include "specdec.h"
#include "tokenizer.h"

#define NGEN 128
#define MAXB 24

static const char *HELD_OUT[] = {
    "Sam had a red kite",
    "The little bird could not fly",
    "Mia found a shiny stone in the garden",
    "Ben and his dog went to the beach",
    "One morning, the sun was very bright",
    "Anna wanted to bake a cake for her mom",
    "There was a big tree near the house",
    "Tim saw a small frog in the pond",
    "The cat and the mouse were friends",
    "A boy named Max liked to paint",
    "It was a rainy day and Lucy was bored",
    "The old man had a funny hat",
    "Sara lost her favorite toy",
    "In the forest, there lived a happy bear",
    "Jack wanted to be a brave knight",
    "The train was very long and fast",
    "Emma and her brother built a sand castle",
    "A little fish swam in the blue sea",
    "The farmer had many cows and a pig",
    "Lily's mom gave her a new dress",
    "Tom was sad because it was cold outside",
    "The dragon was not scary at all",
    "Zoe liked to play with her ball",
    "Once there was a tiny car",
};
#define N_HELD ((int)(sizeof(HELD_OUT) / sizeof(HELD_OUT[0])))

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct {
    const model_t *m;
    const model_config *c;
    const mtp_t *mt;
    kvcache_t *kv;
    model_ctx_t *ctx;
    specdec_t *sd;
    sampler_t *smp;
    float *logits; /* (MAXB, vocab) */
    float *h0;     /* (max_tokens, dim) */
    int max_tokens;
} rig;

static int rig_init(rig *r, const model_t *m, const mtp_t *mt, int max_tokens, model_isa isa)
{
    memset(r, 0, sizeof(*r));
    r->m = m;
    r->c = model_get_config(m);
    r->mt = mt;
    r->max_tokens = max_tokens;
    const model_config *c = r->c;
    kvcache_params kp = {.n_layer = c->n_layer + (mt ? mtp_n_modules(mt) : 0),
                         .n_kv_head = c->n_kv_head,
                         .head_dim = c->head_dim,
                         .block_size = 16,
                         .n_blocks = MAXB * ((NGEN + 64 + 8) / 16 + 2) + 64,
                         .max_seqs = MAXB + 8,
                         .max_seq_len = c->n_ctx};
    r->kv = kvcache_new(&kp);
    model_ctx_params cp = model_ctx_default_params();
    cp.max_tokens = max_tokens;
    cp.max_isa = isa;
    r->ctx = model_ctx_new_params(m, &cp);
    r->sd = specdec_new(m, mt, MAXB + 8, MAXB, max_tokens);
    r->smp = sampler_new(c->vocab_size);
    r->logits = malloc((size_t)MAXB * c->vocab_size * sizeof(float));
    r->h0 = malloc((size_t)max_tokens * c->dim * sizeof(float));
    return r->kv && r->ctx && r->sd && r->smp && r->logits && r->h0 ? 0 : -1;
}

static void rig_free(rig *r)
{
    kvcache_destroy(&r->kv);
    model_ctx_destroy(&r->ctx);
    specdec_destroy(&r->sd);
    sampler_destroy(&r->smp);
    free(r->logits);
    free(r->h0);
}

typedef struct {
    long steps, drafted, accepted, emitted, a1_n, a1_ok, a2_n, a2_ok;
    double decode_s; /* wall time in specdec_step */
    long decoded;    /* tokens decoded (after the first), all sequences */
} run_stats;

/* Decode n prompts together, n_gen tokens each (stops early only at EOS), at `depth`. */
static int run(rig *r, int n, int **prompts, const int *np, int depth, const sampler_params *sp,
               uint64_t seed, run_stats *st)
{
    const model_config *c = r->c;
    const int D = c->dim, V = c->vocab_size;
    int seqs[MAXB], pos[MAXB], ngen[MAXB], last[MAXB], done[MAXB], idx[MAXB];
    uint64_t rng[MAXB];
    static float hand[MAXB][2 * 4096];
    model_seq_batch pb[MAXB];
    specdec_prefill_item pit[MAXB];
    specdec_item items[MAXB];
    if (n > MAXB || D > 4096)
        return -1;
    int rows = 0;
    for (int i = 0; i < n; i++) {
        seqs[i] = kvcache_seq_new(r->kv);
        if (seqs[i] < 0 ||
            kvcache_seq_reserve(r->kv, seqs[i], np[i] + NGEN + SPECDEC_MAX_DEPTH) != KVCACHE_OK)
            return -1;
        pb[i] = (model_seq_batch){.seq = seqs[i],
                                  .n_tokens = np[i],
                                  .tokens = prompts[i],
                                  .logits = r->logits + (size_t)i * V,
                                  .hidden = r->h0 + (size_t)rows * D,
                                  .hidden_all = 1};
        pit[i] = (specdec_prefill_item){.seq = seqs[i],
                                        .n_tokens = np[i],
                                        .prompt = prompts[i],
                                        .n_prompt = np[i],
                                        .h0 = r->h0 + (size_t)rows * D,
                                        .depth = depth,
                                        .hand = hand[i]};
        rows += np[i];
    }
    if (rows > r->max_tokens || model_forward(r->ctx, r->kv, pb, n, NULL, NULL) != 0)
        return -1;
    if (depth > 0 && specdec_prefill(r->sd, r->ctx, r->kv, pit, n) != 0)
        return -1;
    for (int i = 0; i < n; i++) {
        rng[i] = sampler_seed_state(seed + (uint64_t)i);
        last[i] = sampler_sample(r->smp, sp, &rng[i], r->logits + (size_t)i * V);
        pos[i] = np[i];
        ngen[i] = 1;
        done[i] = last[i] == c->eos_id;
        specdec_seq_start(r->sd, seqs[i], np[i], last[i], depth > 0 ? hand[i] : NULL, depth);
    }
    for (;;) {
        int m = 0;
        for (int i = 0; i < n; i++) {
            if (done[i])
                continue;
            int d = depth < NGEN - ngen[i] - 1 ? depth : NGEN - ngen[i] - 1;
            items[m] = (specdec_item){.seq = seqs[i],
                                      .pos = pos[i],
                                      .last = last[i],
                                      .depth = d,
                                      .sp = sp,
                                      .rng = &rng[i]};
            idx[m++] = i;
        }
        if (!m)
            break;
        double t0 = now_s();
        if (specdec_step(r->sd, r->ctx, r->kv, items, m) != 0)
            return -1;
        st->decode_s += now_s() - t0;
        for (int k = 0; k < m; k++) {
            int i = idx[k];
            const specdec_item *x = &items[k];
            st->steps++;
            st->drafted += x->n_drafted;
            st->accepted += x->n_accepted;
            st->emitted += x->n_tokens;
            if (x->n_drafted >= 1) {
                st->a1_n++;
                st->a1_ok += x->n_accepted >= 1;
            }
            if (x->n_drafted >= 2 && x->n_accepted >= 1) {
                st->a2_n++;
                st->a2_ok += x->n_accepted >= 2;
            }
            pos[i] += x->n_tokens;
            for (int j = 0; j < x->n_tokens && !done[i]; j++) {
                ngen[i]++;
                st->decoded++;
                last[i] = x->tokens[j];
                if (last[i] == c->eos_id || ngen[i] >= NGEN)
                    done[i] = 1;
            }
        }
    }
    for (int i = 0; i < n; i++)
        kvcache_seq_free(r->kv, seqs[i]);
    return 0;
}

/* A prompt sampled from the model itself: BOS, then n tokens at temperature 1 (stops
 * before a BOS/EOS). Returns its length. */
static int sampled_prefix(rig *r, uint64_t seed, int n, int *out)
{
    const model_config *c = r->c;
    sampler_params sp = {.temperature = 1.0f, .top_p = 1.0f};
    uint64_t rng = sampler_seed_state(seed);
    int seq = kvcache_seq_new(r->kv);
    if (seq < 0 || kvcache_seq_reserve(r->kv, seq, n + 1) != KVCACHE_OK)
        return -1;
    out[0] = c->bos_id;
    int len = 1;
    while (len < n + 1) {
        model_seq_batch b = {.seq = seq,
                             .pos = len - 1,
                             .n_tokens = 1,
                             .tokens = &out[len - 1],
                             .logits = r->logits};
        if (model_forward(r->ctx, r->kv, &b, 1, NULL, NULL) != 0)
            return -1;
        int t = sampler_sample(r->smp, &sp, &rng, r->logits);
        if (t == c->bos_id || t == c->eos_id)
            break;
        out[len++] = t;
    }
    kvcache_seq_free(r->kv, seq);
    return len;
}

/* Write a side file of two modules for model m (blocks copied from its last block, random
 * eh_proj at the scale of a trained one's, unit norms). */
static int write_synth_modules(const model_t *m, const char *path)
{
    const model_config *c = model_get_config(m);
    const gguf_t *g = model_gguf(m);
    const int D = c->dim, L = c->n_layer;
    gguf_writer_t *w = gguf_writer_new();
    float *eh = malloc((size_t)D * 2 * D * sizeof(float));
    float *ones = malloc((size_t)D * sizeof(float));
    char nm0[64];
    snprintf(nm0, sizeof(nm0), "blk.%d.attn_q.weight", L - 1);
    const gguf_tensor_info *q0 = gguf_find_tensor(g, nm0);
    /* eh_proj in the type of the model's matrices, as a quantized model ships its modules */
    gguf_tensor_type eh_type = q0 && q0->type == GGUF_TENSOR_Q8_0 && D % 32 == 0
                                   ? GGUF_TENSOR_Q8_0
                                   : GGUF_TENSOR_F32;
    void *ehq = eh_type == GGUF_TENSOR_Q8_0
                    ? malloc((size_t)D * (2 * D / 32) * KERN_Q8_BLOCK_BYTES)
                    : NULL;
    if (!w || !eh || !ones || (eh_type == GGUF_TENSOR_Q8_0 && !ehq))
        return -1;
    uint64_t s = 0x5eed;
    for (size_t i = 0; i < (size_t)D * 2 * D; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        eh[i] = ((float)((s >> 40) & 0xffff) / 65536.0f - 0.5f) * 0.04f;
    }
    for (int i = 0; ehq && i < D; i++)
        kern_quantize_q8_0(eh + (size_t)i * 2 * D, 2 * D,
                           (char *)ehq + (size_t)i * (2 * D / 32) * KERN_Q8_BLOCK_BYTES);
    for (int i = 0; i < D; i++)
        ones[i] = 1.0f;
    int rc = gguf_writer_add_str(w, "general.architecture", "llama");
    rc |= gguf_writer_add_str(w, "general.name", "synthetic-mtp");
    rc |= gguf_writer_add_u32(w, "llama.nextn_predict_layers", 2);
    rc |= gguf_writer_add_u32(w, "llama.block_count", (uint32_t)L);
    rc |= gguf_writer_add_u32(w, "llama.embedding_length", (uint32_t)D);
    rc |= gguf_writer_add_u32(w, "llama.feed_forward_length", (uint32_t)c->hidden_dim);
    rc |= gguf_writer_add_u32(w, "llama.attention.head_count", (uint32_t)c->n_head);
    rc |= gguf_writer_add_u32(w, "llama.attention.head_count_kv", (uint32_t)c->n_kv_head);
    static const char *blk[] = {"attn_norm", "attn_q",   "attn_k",   "attn_v", "attn_output",
                                "ffn_norm",  "ffn_gate", "ffn_down", "ffn_up"};
    char src[96], dst[96];
    uint64_t ne_eh[2] = {2 * (uint64_t)D, (uint64_t)D}, ne_v[1] = {(uint64_t)D};
    for (int k = 0; k < 2 && rc == 0; k++) {
        snprintf(dst, sizeof(dst), "blk.%d.nextn.eh_proj.weight", L + k);
        rc |= gguf_writer_add_tensor(w, dst, eh_type, 2, ne_eh, ehq ? ehq : (void *)eh);
        snprintf(dst, sizeof(dst), "blk.%d.nextn.enorm.weight", L + k);
        rc |= gguf_writer_add_tensor(w, dst, GGUF_TENSOR_F32, 1, ne_v, ones);
        snprintf(dst, sizeof(dst), "blk.%d.nextn.hnorm.weight", L + k);
        rc |= gguf_writer_add_tensor(w, dst, GGUF_TENSOR_F32, 1, ne_v, ones);
        for (size_t t = 0; t < sizeof(blk) / sizeof(blk[0]); t++) {
            snprintf(src, sizeof(src), "blk.%d.%s.weight", L - 1, blk[t]);
            snprintf(dst, sizeof(dst), "blk.%d.%s.weight", L + k, blk[t]);
            const gguf_tensor_info *ti = gguf_find_tensor(g, src);
            if (!ti) {
                rc = -1;
                break;
            }
            rc |= gguf_writer_add_tensor(w, dst, ti->type, ti->n_dims, ti->ne, ti->data);
        }
    }
    char err[512];
    if (rc == 0 && gguf_writer_write(w, path, err, sizeof(err)) != 0) {
        fprintf(stderr, "bench_mtp: %s\n", err);
        rc = -1;
    }
    gguf_writer_destroy(&w);
    free(eh);
    free(ehq);
    free(ones);
    return rc;
}

/* A module pass of one token at context 64 (module 1, logits wanted), with the full head
 * and with the draft head: fastest of reps interleaved rounds, seconds, into t[0], t[1];
 * then with the draft head over 2 and 3 positions (61 .. 63, the last one's logits), the
 * shapes a step's module passes take after accepted drafts, into t[2], t[3]. */
static void time_module_pass(rig *r, int reps, double t[4])
{
    const model_config *c = r->c;
    int seq = kvcache_seq_new(r->kv), toks[66];
    for (int i = 0; i < 66; i++)
        toks[i] = 3 + (i * 7919) % (c->vocab_size - 3);
    kvcache_seq_reserve(r->kv, seq, 66);
    model_seq_batch b = {.seq = seq, .n_tokens = 64, .tokens = toks, .logits = r->logits,
                         .hidden = r->h0, .hidden_all = 1};
    model_forward(r->ctx, r->kv, &b, 1, NULL, NULL);
    /* module 1's cache over 0..63 */
    b = (model_seq_batch){.seq = seq, .n_tokens = 64, .tokens = toks + 1, .hidden_in = r->h0};
    mtp_forward(r->ctx, r->kv, r->mt, 1, &b, 1);
    t[0] = t[1] = t[2] = t[3] = 1e30;
    for (int rep = 0; rep < reps; rep++) {
        for (int h = 0; h < 4; h++) {
            int nt = h < 2 ? 1 : h; /* tokens */
            b = (model_seq_batch){.seq = seq, .pos = 64 - nt, .n_tokens = nt,
                                  .tokens = toks + 65 - nt, .logits = r->logits,
                                  .hidden_in = r->h0 + (64 - nt) * (size_t)c->dim};
            double t0 = now_s();
            if (h)
                mtp_forward_draft(r->ctx, r->kv, r->mt, 1, &b, 1);
            else
                mtp_forward(r->ctx, r->kv, r->mt, 1, &b, 1);
            double dt = now_s() - t0;
            t[h] = dt < t[h] ? dt : t[h];
        }
    }
    kvcache_seq_free(r->kv, seq);
}

/* The side file at path has matrices of type want (its eh_proj: older bench runs wrote
 * F32 ones). */
static int side_type_ok(const char *path, int L, gguf_tensor_type want)
{
    char err[256], nm[64];
    gguf_t *g = gguf_open(path, err, sizeof(err));
    if (!g)
        return 0;
    snprintf(nm, sizeof(nm), "blk.%d.nextn.eh_proj.weight", L);
    const gguf_tensor_info *t = gguf_find_tensor(g, nm);
    int ok = t && t->type == want;
    gguf_close(&g);
    return ok;
}

/* A forward pass of 1, 2 and 3 tokens (logits of each) on one sequence at context 64:
 * the fastest of reps interleaved rounds, seconds, into t[1..3]. */
/* CPU seconds of this process (all threads; the pool's short spin waits included). */
static double cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Fastest pass of 1, 2, 3 tokens at context 64, interleaved rounds: wall seconds in t[n]
 * and, when cpu is not NULL, the least CPU seconds in cpu[n] (robust to time slicing on
 * a shared machine, where the wall fastest of a few rounds is not). */
static void time_verify(rig *r, int reps, double t[4], double cpu[4])
{
    const model_config *c = r->c;
    int seq = kvcache_seq_new(r->kv);
    int toks[64 + 3];
    for (int i = 0; i < 67; i++)
        toks[i] = 3 + (i * 7919) % (c->vocab_size - 3);
    kvcache_seq_reserve(r->kv, seq, 64 + 3);
    model_seq_batch b = {.seq = seq, .n_tokens = 64, .tokens = toks, .logits = r->logits};
    model_forward(r->ctx, r->kv, &b, 1, NULL, NULL);
    float *lg = malloc((size_t)3 * c->vocab_size * sizeof(float));
    /* short passes (a small model) are repeated within a round */
    const int inner = c->dim * c->n_layer < 4096 ? 50 : 1;
    t[0] = 0;
    t[1] = t[2] = t[3] = 1e30;
    if (cpu) {
        cpu[0] = 0;
        cpu[1] = cpu[2] = cpu[3] = 1e30;
    }
    for (int rep = 0; rep < reps; rep++) { /* interleaved rounds, fastest */
        for (int n = 1; n <= 3; n++) {
            double t0 = now_s(), c0 = cpu_s();
            for (int k = 0; k < inner; k++) {
                b = (model_seq_batch){.seq = seq,
                                      .pos = 64,
                                      .n_tokens = n,
                                      .tokens = toks + 64,
                                      .logits_all = 1,
                                      .logits = lg};
                model_forward(r->ctx, r->kv, &b, 1, NULL, NULL);
            }
            double dt = (now_s() - t0) / inner, dc = (cpu_s() - c0) / inner;
            t[n] = dt < t[n] ? dt : t[n];
            if (cpu)
                cpu[n] = dc < cpu[n] ? dc : cpu[n];
        }
    }
    free(lg);
    kvcache_seq_free(r->kv, seq);
}

static double ratio_or_nan(double a, double b)
{
    return b > 0 ? a / b : NAN;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of v[0..n) (sorts v). */
static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Where a step's time goes: one sequence of a 16-token random prompt (context 16 .. ~50),
 * n_steps greedy steps at `depth` with specdec profiling on; the profile into *out.
 * Returns 0 or -1. */
static int profile_steps(rig *r, int depth, int n_steps, specdec_profile *out)
{
    const model_config *c = r->c;
    enum { P = 16 };
    int toks[P], seq = kvcache_seq_new(r->kv);
    static float hand[2 * 4096];
    if (seq < 0 || c->dim > 4096 ||
        kvcache_seq_reserve(r->kv, seq, P + n_steps * (SPECDEC_MAX_DEPTH + 1) + 1) != KVCACHE_OK)
        return -1;
    for (int i = 0; i < P; i++)
        toks[i] = 3 + (i * 7919 + depth * 104729) % (c->vocab_size - 3);
    model_seq_batch b = {.seq = seq, .n_tokens = P, .tokens = toks, .logits = r->logits,
                         .hidden = r->h0, .hidden_all = 1};
    specdec_prefill_item pit = {.seq = seq, .n_tokens = P, .prompt = toks, .n_prompt = P,
                                .h0 = r->h0, .depth = depth, .hand = hand};
    int rc = -1;
    if (model_forward(r->ctx, r->kv, &b, 1, NULL, NULL) != 0 ||
        (depth > 0 && specdec_prefill(r->sd, r->ctx, r->kv, &pit, 1) != 0))
        goto done;
    sampler_params greedy = {.temperature = 0.0f, .top_p = 1.0f};
    uint64_t rng = 1;
    int last = sampler_sample(r->smp, &greedy, &rng, r->logits), pos = P;
    specdec_seq_start(r->sd, seq, P, last, depth > 0 ? hand : NULL, depth);
    for (int k = 0; k <= n_steps; k++) {
        specdec_item it = {.seq = seq, .pos = pos, .last = last, .depth = depth, .sp = &greedy,
                           .rng = &rng};
        if (k == 1)
            specdec_set_profiling(r->sd, 1); /* the first step untimed */
        if (specdec_step(r->sd, r->ctx, r->kv, &it, 1) != 0)
            goto done;
        pos += it.n_tokens;
        last = it.tokens[it.n_tokens - 1];
    }
    specdec_get_profile(r->sd, out);
    specdec_set_profiling(r->sd, 0);
    rc = 0;
done:
    kvcache_seq_free(r->kv, seq);
    return rc;
}

int main(int argc, char **argv)
{
    int quick = 0, a = 1, rounds_1b = 0;
    model_isa isa_opt = MODEL_ISA_AUTO;
    const char *side_dir = NULL;
    for (; a < argc; a++) {
        if (strcmp(argv[a], "--quick") == 0) {
            quick = 1;
        } else if (strcmp(argv[a], "--side-dir") == 0 && a + 1 < argc) {
            side_dir = argv[++a];
        } else if (strcmp(argv[a], "--isa") == 0 && a + 1 < argc &&
                   (strcmp(argv[a + 1], "avx2") == 0 || strcmp(argv[a + 1], "avx512") == 0)) {
            isa_opt = strcmp(argv[++a], "avx2") == 0 ? MODEL_ISA_AVX2 : MODEL_ISA_AVX512;
        } else if (strcmp(argv[a], "--rounds") == 0 && a + 1 < argc && atoi(argv[a + 1]) > 0) {
            rounds_1b = atoi(argv[++a]);
        } else {
            break;
        }
    }
    if (argc - a != 3) {
        fprintf(stderr, "usage: bench_mtp [--quick] [--isa avx2|avx512] [--rounds N] [--side-dir DIR] "
                        "STORIES.gguf STORIES-MTP.gguf SYNTH-1B.gguf\n");
        return 2;
    }
    if (rounds_1b == 0)
        rounds_1b = quick ? 3 : 7;
    const char *mpath = argv[a], *mtpath = argv[a + 1], *bigpath = argv[a + 2];
    char err[512];
    model_t *m = model_load(mpath, err, sizeof(err));
    mtp_t *mt = m ? mtp_load(m, mtpath, err, sizeof(err)) : NULL;
    tokenizer_t *tok = m ? tokenizer_load(mpath, err, sizeof(err)) : NULL;
    if (!m || !mt || !tok) {
        fprintf(stderr, "bench_mtp: %s\n", err);
        return 1;
    }
    const model_config *c = model_get_config(m);
    rig r;
    if (rig_init(&r, m, mt, 1024, isa_opt) != 0) {
        fprintf(stderr, "bench_mtp: out of memory\n");
        return 1;
    }
    int ptok[N_HELD][64], np[N_HELD], *pp[N_HELD];
    for (int i = 0; i < N_HELD; i++) {
        np[i] = tokenizer_encode(tok, HELD_OUT[i], strlen(HELD_OUT[i]), 1, ptok[i], 64, NULL);
        pp[i] = ptok[i];
        if (np[i] < 1)
            return 1;
    }

    /* prefixes sampled from the base (8..24 tokens, seeds the trainer did not use), the kind
     * of prompts its "unseen" figure was measured on */
    int stok[N_HELD][32], ns[N_HELD], *sp_[N_HELD];
    for (int i = 0; i < N_HELD; i++) {
        ns[i] = sampled_prefix(&r, 900001 + (uint64_t)i, 8 + (i * 7) % 17, stok[i]);
        sp_[i] = stok[i];
        if (ns[i] < 2)
            return 1;
    }

    /* 1. acceptance */
    const int dv = mtp_draft_vocab(mt);
    printf("== acceptance: %s + %s, %d tokens per prompt, draft vocabulary %d of %d\n", c->name,
           mtpath, NGEN, dv, c->vocab_size);
    printf("  %d held-out prompts (hand-written story openings):\n", N_HELD);
    sampler_params greedy = {.temperature = 0.0f, .top_p = 1.0f};
    sampler_params t1 = {.temperature = 1.0f, .top_p = 1.0f};
    double a1 = 0, a2 = 0, mal2 = 0;
    struct {
        const char *name;
        const sampler_params *sp;
        specdec_sampling mode;
        int depth;
    } acc_runs[] = {{"greedy", &greedy, SPECDEC_SAMPLE_REJECTION, 1},
                    {"greedy", &greedy, SPECDEC_SAMPLE_REJECTION, 2},
                    {"temperature 1, rejection sampling", &t1, SPECDEC_SAMPLE_REJECTION, 2},
                    {"temperature 1, one-hot drafts", &t1, SPECDEC_SAMPLE_ONEHOT, 2}};
    for (size_t k = 0; k < sizeof(acc_runs) / sizeof(acc_runs[0]); k++) {
        run_stats st = {0};
        specdec_set_sampling(r.sd, acc_runs[k].mode);
        if (run(&r, N_HELD, pp, np, acc_runs[k].depth, acc_runs[k].sp, 1, &st) != 0) {
            fprintf(stderr, "bench_mtp: decode failed\n");
            return 1;
        }
        double mal = 1.0 + (double)st.accepted / (double)st.steps;
        double p1 = ratio_or_nan((double)st.a1_ok, (double)st.a1_n);
        double p2 = ratio_or_nan((double)st.a2_ok, (double)st.a2_n);
        printf("  %-34s depth %d: mean acceptance length %.3f  (a1 %.3f, a2|a1 %.3f; %ld steps)\n",
               acc_runs[k].name, acc_runs[k].depth, mal, p1, acc_runs[k].depth > 1 ? p2 : NAN,
               st.steps);
        if (k == 1) {
            a1 = p1;
            a2 = p2;
            mal2 = mal;
        }
    }
    specdec_set_sampling(r.sd, SPECDEC_SAMPLE_REJECTION);
    printf("  %d prefixes of 8-24 tokens sampled from the base (seeds 900001..):\n", N_HELD);
    double mal2s = 0;
    for (int d = 1; d <= 2; d++) {
        run_stats st = {0};
        if (run(&r, N_HELD, sp_, ns, d, &greedy, 1, &st) != 0)
            return 1;
        double mal = 1.0 + (double)st.accepted / (double)st.steps;
        printf("  %-34s depth %d: mean acceptance length %.3f  (a1 %.3f, a2|a1 %.3f; %ld steps)\n",
               "greedy", d, mal, ratio_or_nan((double)st.a1_ok, (double)st.a1_n),
               d > 1 ? ratio_or_nan((double)st.a2_ok, (double)st.a2_n) : NAN, st.steps);
        if (d == 2)
            mal2s = mal;
    }
    printf("  target >= 2.4 at depth 2 (greedy): hand-written %.3f (%s), sampled %.3f (%s)\n", mal2,
           mal2 >= 2.4 ? "met" : "not met", mal2s, mal2s >= 2.4 ? "met" : "not met");
    /* what the draft vocabulary keeps: the same greedy depth-2 runs with the full head */
    if (dv < c->vocab_size) {
        double full[2];
        mtp_set_draft_vocab(mt, 0);
        for (int set = 0; set < 2; set++) {
            run_stats st = {0};
            if (run(&r, N_HELD, set ? sp_ : pp, set ? ns : np, 2, &greedy, 1, &st) != 0)
                return 1;
            full[set] = 1.0 + (double)st.accepted / (double)st.steps;
        }
        mtp_set_draft_vocab(mt, dv);
        printf("  full head (%d tokens), greedy depth 2: hand-written %.3f, sampled %.3f; the draft "
               "vocabulary keeps %.1f%% / %.1f%%\n",
               c->vocab_size, full[0], full[1], 100.0 * mal2 / full[0], 100.0 * mal2s / full[1]);
    }
    {
        double tm[4];
        time_module_pass(&r, quick ? 200 : 1000, tm);
        printf("  module pass (1 token, context 64): full head %.1f us, draft head %.1f us (x%.3f)\n",
               tm[0] * 1e6, tm[1] * 1e6, tm[1] / tm[0]);
    }

    /* 2. TPOT */
    printf("\n== TPOT: %s, engine-level decode loop, greedy, %d tokens per sequence, fastest of "
           "%d rounds\n",
           c->name, NGEN, quick ? 3 : 7);
    printf("  (batch 1: fastest of %d rounds: a round is short, and the machine may be shared)\n",
           quick ? 9 : 21);
    printf("  %-6s %-6s %10s %12s %14s %8s\n", "batch", "depth", "TPOT ms", "tokens/s",
           "tokens/step", "vs d0");
    int batches[2] = {1, 16};
    double tpot_ratio = 0;
    for (int bi = 0; bi < 2; bi++) {
        /* rounds over the depths (interleaved: a load change on a shared machine hits
         * every depth alike); the fastest run of each */
        double best[3] = {1e30, 1e30, 1e30}, tps[3] = {0}, tpstep[3] = {0};
        int rounds = (quick ? 3 : 7) * (batches[bi] == 1 ? 3 : 1);
        for (int rep = 0; rep < rounds; rep++) {
            for (int d = 0; d <= 2; d++) {
                run_stats st = {0};
                if (run(&r, batches[bi], pp, np, d, &greedy, 1, &st) != 0)
                    return 1;
                double tpot = st.decode_s / ((double)st.decoded / batches[bi]);
                if (tpot < best[d]) {
                    best[d] = tpot;
                    tps[d] = (double)st.decoded / st.decode_s;
                    tpstep[d] = (double)st.emitted / (double)st.steps;
                }
            }
        }
        for (int d = 0; d <= 2; d++)
            printf("  %-6d %-6d %10.4f %12.0f %14.2f %7.2fx\n", batches[bi], d, best[d] * 1e3,
                   tps[d], tpstep[d], best[0] / best[d]);
        if (bi == 0)
            tpot_ratio = best[2] / best[0];
    }
    printf("  TPOT depth 2 / depth 0 at batch 1: %.3f (target <= 0.7: %s)\n", tpot_ratio,
           tpot_ratio <= 0.7 ? "met" : "not met");
    {
        double tv[4];
        time_verify(&r, quick ? 9 : 21, tv, NULL);
        printf("  verify pass at batch 1, context 64: 1 token %.1f us; 2 tokens x%.3f; 3 tokens "
               "x%.3f\n",
               tv[1] * 1e6, tv[2] / tv[1], tv[3] / tv[1]);
    }
    /* the adaptive rule at batch 1 with this machine's measured costs and the acceptance
     * measured above (the worker measures the same at start-up) */
    {
        specdec_costs sc;
        if (specdec_measure_costs(r.sd, r.ctx, r.kv, 1, 250.0, &sc) == 0) {
            float prior[2] = {(float)a1, (float)a2};
            specdec_ctl ctl;
            int ctxs[3] = {sc.ctx_short, 128, sc.ctx_long};
            for (int ci = 0; ci < (sc.ctx_long ? 3 : 1); ci++) {
                specdec_ctl_init(&ctl, 2, prior);
                int dsel = specdec_ctl_depth_at(&ctl, &sc, 1, ctxs[ci]);
                double c1 = specdec_cost_at(&sc, 1, ctxs[ci], 1);
                double c2 = specdec_cost_at(&sc, 1, ctxs[ci], 2);
                printf("  adaptive rule at batch 1, context %3d: step cost d1 x%.3f, d2 x%.3f; "
                       "E1/C1 %.3f, E2/C2 %.3f -> depth %d\n",
                       ctxs[ci], c1, c2, specdec_ctl_expected(&ctl, 1) / c1,
                       specdec_ctl_expected(&ctl, 2) / c2, dsel);
            }
        }
    }
    rig_free(&r);

    /* 3. the 1B-class model */
    printf("\n== verify cost on %s\n", bigpath);
    model_t *big = model_load(bigpath, err, sizeof(err));
    if (!big) {
        fprintf(stderr, "bench_mtp: %s\n", err);
        return 1;
    }
    /* the side file: NAME-mtp.gguf beside the model if a valid one is there (an earlier
     * run's), else in --side-dir (default: this program's directory, i.e. the build tree),
     * written there once: never into a model directory that may be shared or read-only */
    char side[2200];
    snprintf(side, sizeof(side), "%.1000s", bigpath);
    char *dot = strrchr(side, '.');
    if (dot && strcmp(dot, ".gguf") == 0)
        *dot = '\0';
    strncat(side, "-mtp.gguf", sizeof(side) - strlen(side) - 1);
    char qn[64];
    snprintf(qn, sizeof(qn), "blk.%d.attn_q.weight", model_get_config(big)->n_layer - 1);
    const gguf_tensor_info *bq = gguf_find_tensor(model_gguf(big), qn);
    int big_layers = model_get_config(big)->n_layer;
    mtp_t *bmt = bq && side_type_ok(side, big_layers, bq->type)
                     ? mtp_load(big, side, err, sizeof(err))
                     : NULL;
    if (!bmt) {
        char dir[1024];
        const char *slash = strrchr(argv[0], '/');
        if (side_dir)
            snprintf(dir, sizeof(dir), "%.1000s", side_dir);
        else if (slash)
            snprintf(dir, sizeof(dir), "%.*s", (int)(slash - argv[0] > 1000 ? 1000 : slash - argv[0]),
                     argv[0]);
        else
            snprintf(dir, sizeof(dir), ".");
        const char *base = strrchr(side, '/');
        char name[1100];
        snprintf(name, sizeof(name), "%.1000s", base ? base + 1 : side);
        snprintf(side, sizeof(side), "%.1023s/%.1100s", dir, name);
        if (bq && side_type_ok(side, big_layers, bq->type))
            bmt = mtp_load(big, side, err, sizeof(err));
    }
    if (!bmt) {
        printf("  writing synthetic modules (trained-module shapes, random weights) to %s\n", side);
        if (write_synth_modules(big, side) != 0 || !(bmt = mtp_load(big, side, err, sizeof(err)))) {
            fprintf(stderr, "bench_mtp: %s\n", err);
            return 1;
        }
    }
    rig rb;
    if (rig_init(&rb, big, bmt, 256, isa_opt) != 0) {
        fprintf(stderr, "bench_mtp: out of memory (1B)\n");
        return 1;
    }
    const model_config *bc = model_get_config(big);
    printf("  %s: dim %d, %d layers, vocab %d, kernels %s, %d threads; modules %.0f MB each\n",
           bc->name, bc->dim, bc->n_layer, bc->vocab_size, model_ctx_kernel_name(rb.ctx),
           model_ctx_n_threads(rb.ctx), (double)mtp_matmul_bytes(bmt, 1) / 1e6);
    /* per instruction set (--isa X: X alone; else AVX2 and the best the CPU has, side by
     * side), interleaved rounds; each round: a module pass of one token with the full and
     * with the draft head, a forward pass of 1, 2 and 3 tokens, the step costs
     * (specdec_measure_costs at batch 1) and where a depth-2 step's time goes (specdec
     * profiling, against a plain step's); medians over the rounds of the per-round ratios */
    model_ctx_t *ctxs[2] = {rb.ctx, NULL};
    const char *names[2] = {model_ctx_kernel_name(rb.ctx), NULL};
    int n_isa = 1;
    if (isa_opt == MODEL_ISA_AUTO && kern_isa_detect() > KERN_ISA_AVX2) {
        model_ctx_params p2 = model_ctx_default_params();
        p2.max_tokens = 256;
        p2.max_isa = MODEL_ISA_AVX2;
        ctxs[0] = model_ctx_new_params(big, &p2);
        ctxs[1] = rb.ctx;
        if (!ctxs[0]) {
            fprintf(stderr, "bench_mtp: out of memory (1B)\n");
            return 1;
        }
        names[0] = model_ctx_kernel_name(ctxs[0]);
        names[1] = model_ctx_kernel_name(ctxs[1]);
        n_isa = 2;
    }
    enum { MAXR = 64, NQ = 20 };
    if (rounds_1b > MAXR)
        rounds_1b = MAXR;
    /* per isa, per round: 0 full-head module pass / 1-token pass, 1 draft-head one,
     * 2 draft / full, 3 verify 2/1, 4 verify 3/1, 5 CPU 3/1, 6 C1, 7 C2, 8 plain step ms,
     * 9..12 depth-2 step's module 1, module 2, verify, rest / plain step, 13 their sum,
     * 14 E1/C1, 15 E2/C2, 16 and 17 module pass of 2 and 3 tokens / 1, 18 C2 with the
     * module passes of the measured acceptance, 19 E2 / that */
    static double q[2][NQ][MAXR];
    double e1 = 1 + a1, e2 = 1 + a1 + a1 * a2;
    const int psteps = quick ? 6 : 12;
    for (int rep = 0; rep < rounds_1b; rep++) {
        for (int i = 0; i < n_isa; i++) {
            rb.ctx = ctxs[i];
            double tm[4], tv[4], cv[4];
            specdec_costs costs;
            specdec_profile p0, p2;
            time_module_pass(&rb, 1, tm);
            time_verify(&rb, 1, tv, cv);
            if (specdec_measure_costs(rb.sd, rb.ctx, rb.kv, 1, 20000.0, &costs) != 0 ||
                profile_steps(&rb, 2, psteps, &p2) != 0 || profile_steps(&rb, 0, psteps, &p0) != 0) {
                fprintf(stderr, "bench_mtp: cost measurement failed\n");
                return 1;
            }
            double plain = (p0.mod1_ms + p0.mod2_ms + p0.verify_ms + p0.rest_ms) / (double)p0.steps;
            double *v[NQ];
            for (int k = 0; k < NQ; k++)
                v[k] = &q[i][k][rep];
            *v[0] = tm[0] / tv[1];
            *v[1] = tm[1] / tv[1];
            *v[2] = tm[1] / tm[0];
            *v[3] = tv[2] / tv[1];
            *v[4] = tv[3] / tv[1];
            *v[5] = cv[3] / cv[1];
            *v[6] = costs.ratio[0][1];
            *v[7] = costs.ratio[0][2];
            *v[8] = costs.plain_ms[0];
            *v[9] = p2.mod1_ms / (double)p2.steps / plain;
            *v[10] = p2.mod2_ms / (double)p2.steps / plain;
            *v[11] = p2.verify_ms / (double)p2.steps / plain;
            *v[12] = p2.rest_ms / (double)p2.steps / plain;
            *v[13] = *v[9] + *v[10] + *v[11] + *v[12];
            *v[14] = e1 / costs.ratio[0][1];
            *v[15] = e2 / costs.ratio[0][2];
            /* the synthetic modules' steps accept nothing (module 1 over 1 position, module
             * 2 over 2); at the measured acceptance, after a step that accepted a drafts
             * module 1 runs a + 1 positions and module 2 2, 2, 3 (a = 0, 1, 2): the extra
             * module time, in module passes of 1, 2, 3 tokens (draft head) */
            double m1 = tm[1] / tv[1], m2 = tm[2] / tv[1], m3 = tm[3] / tv[1];
            double pa1 = a1 * (1 - a2), pa2 = a1 * a2;
            *v[16] = m2 / m1;
            *v[17] = m3 / m1;
            *v[18] = costs.ratio[0][2] + pa1 * (m2 - m1) + pa2 * ((m3 - m1) + (m3 - m2));
            *v[19] = e2 / *v[18];
        }
    }
    rb.ctx = ctxs[n_isa - 1];
    printf("  %d interleaved rounds per instruction set, medians [min - max] of per-round ratios;\n"
           "  E1 = %.3f, E2 = %.3f tokens/step (the acceptance measured above)\n",
           rounds_1b, e1, e2);
    double med[2][NQ], lo[2][NQ], hi[2][NQ];
    for (int i = 0; i < n_isa; i++)
        for (int k = 0; k < NQ; k++) {
            med[i][k] = median(q[i][k], rounds_1b); /* sorted: [0] and [n-1] are the range */
            lo[i][k] = q[i][k][0];
            hi[i][k] = q[i][k][rounds_1b - 1];
        }
    static const char *const lab[NQ] = {
        "module pass, full head / 1-token pass", "module pass, draft head / 1-token pass",
        "module pass, draft / full head", "verify pass 2 tokens / 1", "verify pass 3 tokens / 1",
        "verify pass 3 tokens / 1, CPU time", "whole depth-1 step / plain (C1)",
        "whole depth-2 step / plain (C2)", "plain step ms", "  d2 step: module 1 (+ checks)",
        "  d2 step: d1 draft + module 2", "  d2 step: d2 draft + verify",
        "  d2 step: accept, rollback, copies", "  d2 step: sum (profiled) / plain",
        "projected speedup depth 1 (E1/C1)", "projected speedup depth 2 (E2/C2)",
        "module pass (draft head) 2 tokens / 1", "module pass (draft head) 3 tokens / 1",
        "C2 at the measured acceptance's shapes", "projected speedup depth 2, those shapes"};
    for (int k = 0; k < NQ; k++) {
        printf("  %-42s", lab[k]);
        for (int i = 0; i < n_isa; i++)
            printf("  %s %7.3f [%.3f - %.3f]", names[i], med[i][k], lo[i][k], hi[i][k]);
        printf("\n");
    }
    for (int i = 0; i < n_isa; i++)
        printf("  projected MTP2 speedup at batch 1, %s: x%.2f (target >= 1.6: %s; x%.2f with the "
               "module passes of the measured acceptance); verify 3 / 1 x%.3f (target <= 1.15: "
               "%s)\n",
               names[i], med[i][15], med[i][15] >= 1.6 ? "met" : "not met", med[i][19], med[i][4],
               med[i][4] <= 1.15 ? "met" : "not met");
    if (!quick) {
        specdec_costs costs;
        if (specdec_measure_costs(rb.sd, rb.ctx, rb.kv, 4, 20000.0, &costs) != 0) {
            fprintf(stderr, "bench_mtp: cost measurement failed\n");
            return 1;
        }
        printf("  %s, one measurement per batch size:\n  %-6s %12s %10s %10s %12s %12s\n",
               names[n_isa - 1], "batch", "plain ms", "d1 cost", "d2 cost", "d1 speedup",
               "d2 speedup");
        for (int k = 0; k < costs.n; k++)
            printf("  %-6d %12.1f %9.3fx %9.3fx %11.2fx %11.2fx\n", costs.batch[k],
                   costs.plain_ms[k], costs.ratio[k][1], costs.ratio[k][2],
                   e1 / costs.ratio[k][1], e2 / costs.ratio[k][2]);
    }
    if (n_isa == 2)
        model_ctx_destroy(&ctxs[0]);
    rig_free(&rb);
    mtp_destroy(&bmt);
    model_destroy(&big);
    mtp_destroy(&mt);
    tokenizer_destroy(&tok);
    model_destroy(&m);
    return 0;
}
