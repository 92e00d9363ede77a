/*
 * MTP tests: module loading (side file, modules inside the model file, bad files), the
 * module forward against the trainer's reference values (models/mtp/stories260K-mtp.ref.json,
 * PyTorch fp32), the speculative-decoding rule (its output distribution is p, for greedy
 * and sampled drafts, with top-k and top-p), the batched draft-and-verify step (greedy
 * output identical at depth 0, 1 and 2, single and batched; deferred module catch-up gives
 * the same module KV; chunked prefill gives the same hand-off), a statistical test that
 * sampled output with MTP has the main model's distribution, and the depth controller.
 *
 * Tolerances: reference floats (h_0, logits, h_1) within 1e-4 absolute + 1e-4 relative
 * (the C engine and PyTorch sum in different orders; observed ~1e-6); argmax ids exact
 * where the reference's top1-top2 margin is > 1e-3. Engine-vs-engine comparisons are
 * bit-exact (batch invariance).
 *
 * The model comes from $TIDEPOOL_TEST_MODEL (default build/models/stories260K.gguf), the
 * modules from models/mtp/ (run from the repository root, as tests/run_tests.sh does).
 *
 *   test_mtp [case-name-filter]
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
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

#define MTP_PATH "models/mtp/stories260K-mtp.gguf"
#define REF_PATH "models/mtp/stories260K-mtp.ref.json"
#define TOL_ABS 1e-4
#define TOL_REL 1e-4
#define MARGIN 1e-3

static char model_path[1024];
static char tmpdir[256];
static model_t *g_model;
static mtp_t *g_mtp;
static tokenizer_t *g_tok;
static json_t *g_ref;

static const char *PROMPTS[] = {"Once upon a time", "Tom and Sue went to the"};

// --- helpers

static int close_enough(double got, double want)
{
    return fabs(got - want) <= TOL_ABS + TOL_REL * fabs(want);
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

static int encode(const char *text, int *out, int cap)
{
    int n = tokenizer_encode(g_tok, text, strlen(text), 1, out, cap, NULL);
    assert_true(n >= 1);
    return n;
}

typedef struct {
    kvcache_t *kv;
    model_ctx_t *ctx;
    specdec_t *sd;
    sampler_t *smp;
    float *logits; /* (max_seqs, vocab) */
    float *h0;     /* (max_tokens, dim) */
    int max_seqs;
} rig;

static void rig_init(rig *r, const mtp_t *mt, int max_seqs, int max_tokens)
{
    const model_config *c = model_get_config(g_model);
    int per_seq = (c->n_ctx + 15) / 16;
    kvcache_params kp = {.n_layer = c->n_layer + (mt ? mtp_n_modules(mt) : 0),
                         .n_kv_head = c->n_kv_head,
                         .head_dim = c->head_dim,
                         .block_size = 16,
                         .n_blocks = per_seq * max_seqs,
                         .max_seqs = max_seqs,
                         .max_seq_len = c->n_ctx};
    r->kv = kvcache_new(&kp);
    r->ctx = model_ctx_new(g_model, max_tokens);
    r->sd = specdec_new(g_model, mt, max_seqs, max_seqs, max_tokens);
    r->smp = sampler_new(c->vocab_size);
    r->logits = malloc((size_t)max_seqs * c->vocab_size * sizeof(float));
    r->h0 = malloc((size_t)max_tokens * c->dim * sizeof(float));
    r->max_seqs = max_seqs;
    assert_non_null(r->kv);
    assert_non_null(r->ctx);
    assert_non_null(r->sd);
    assert_non_null(r->smp);
    assert_non_null(r->logits);
    assert_non_null(r->h0);
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
    long steps, drafted, accepted, emitted;
} dec_stats;

/* Decode n sequences together through specdec_step, each from its prompt (the worker's
 * flow: one batched prefill with hidden_all, specdec_prefill, first token sampled from
 * the prefill logits, then steps). depth[i]: the sequence's max depth and the depth asked
 * each step; a depth_fn, when given, overrides the depth asked per step. Generates up to
 * n_gen tokens per sequence (first included), stopping after EOS (kept). out[i] gets the
 * tokens, n_out[i] their count. */
typedef int (*depth_fn)(int seq_index, int step);

static void decode(rig *r, int n, const int *const *prompts, const int *n_prompt, const int *depth,
                   depth_fn dfn, const sampler_params *sp, const uint64_t *seeds, int n_gen,
                   int **out, int *n_out, dec_stats *st)
{
    const model_config *c = model_get_config(g_model);
    const int D = c->dim, V = c->vocab_size;
    assert_true(n <= r->max_seqs);
    int seqs[64], pos[64], done[64];
    uint64_t rng[64];
    float hand[64][2 * 64];
    assert_true(n <= 64 && D <= 64);
    model_seq_batch pb[64];
    specdec_prefill_item pit[64];
    int rows = 0;
    for (int i = 0; i < n; i++) {
        seqs[i] = kvcache_seq_new(r->kv);
        assert_true(seqs[i] >= 0);
        int need = n_prompt[i] + n_gen + SPECDEC_MAX_DEPTH;
        if (need > c->n_ctx)
            need = c->n_ctx;
        assert_int_equal(kvcache_seq_reserve(r->kv, seqs[i], need), KVCACHE_OK);
        pb[i] = (model_seq_batch){.seq = seqs[i],
                                  .n_tokens = n_prompt[i],
                                  .tokens = prompts[i],
                                  .logits = r->logits + (size_t)i * V,
                                  .hidden = r->h0 + (size_t)rows * D,
                                  .hidden_all = 1};
        pit[i] = (specdec_prefill_item){.seq = seqs[i],
                                        .n_tokens = n_prompt[i],
                                        .prompt = prompts[i],
                                        .n_prompt = n_prompt[i],
                                        .h0 = r->h0 + (size_t)rows * D,
                                        .depth = depth[i],
                                        .hand = hand[i]};
        rows += n_prompt[i];
    }
    assert_int_equal(model_forward(r->ctx, r->kv, pb, n, NULL, NULL), 0);
    assert_int_equal(specdec_prefill(r->sd, r->ctx, r->kv, pit, n), 0);
    specdec_item items[64];
    int idx[64];
    for (int i = 0; i < n; i++) {
        rng[i] = sampler_seed_state(seeds ? seeds[i] : 1);
        int first = sampler_sample(r->smp, sp, &rng[i], r->logits + (size_t)i * V);
        out[i][0] = first;
        n_out[i] = 1;
        pos[i] = n_prompt[i];
        done[i] = first == c->eos_id || n_gen <= 1;
        specdec_seq_start(r->sd, seqs[i], n_prompt[i], first, hand[i], depth[i]);
    }
    for (int step = 0;; step++) {
        int m = 0;
        for (int i = 0; i < n; i++) {
            if (done[i])
                continue;
            int d = dfn ? dfn(i, step) : depth[i];
            int left = n_gen - n_out[i] - 1;
            if (d > left)
                d = left;
            items[m] = (specdec_item){.seq = seqs[i],
                                      .pos = pos[i],
                                      .last = out[i][n_out[i] - 1],
                                      .depth = d,
                                      .sp = sp,
                                      .rng = &rng[i]};
            idx[m++] = i;
        }
        if (m == 0)
            break;
        assert_int_equal(specdec_step(r->sd, r->ctx, r->kv, items, m), 0);
        for (int k = 0; k < m; k++) {
            int i = idx[k];
            specdec_item *x = &items[k];
            assert_int_equal(kvcache_seq_len(r->kv, seqs[i]), pos[i] + x->n_tokens);
            if (st) {
                st->steps++;
                st->drafted += x->n_drafted;
                st->accepted += x->n_accepted;
                st->emitted += x->n_tokens;
            }
            pos[i] += x->n_tokens;
            for (int j = 0; j < x->n_tokens && !done[i]; j++) {
                out[i][n_out[i]++] = x->tokens[j];
                if (x->tokens[j] == c->eos_id || n_out[i] >= n_gen)
                    done[i] = 1;
            }
        }
    }
    for (int i = 0; i < n; i++)
        kvcache_seq_free(r->kv, seqs[i]);
}

/* Plain greedy generation with model_forward, one token per pass (the reference). */
static int plain_greedy(const int *prompt, int np, int n_gen, int *out)
{
    const model_config *c = model_get_config(g_model);
    rig r;
    rig_init(&r, NULL, 1, c->n_ctx);
    int seq = kvcache_seq_new(r.kv);
    assert_int_equal(kvcache_seq_reserve(r.kv, seq, np + n_gen), KVCACHE_OK);
    model_seq_batch b = {.seq = seq, .n_tokens = np, .tokens = prompt, .logits = r.logits};
    assert_int_equal(model_forward(r.ctx, r.kv, &b, 1, NULL, NULL), 0);
    int n = 0;
    for (;;) {
        out[n] = argmax(r.logits, c->vocab_size);
        n++;
        if (out[n - 1] == c->eos_id || n == n_gen)
            break;
        b = (model_seq_batch){.seq = seq,
                              .pos = np + n - 1,
                              .n_tokens = 1,
                              .tokens = &out[n - 1],
                              .logits = r.logits};
        assert_int_equal(model_forward(r.ctx, r.kv, &b, 1, NULL, NULL), 0);
    }
    rig_free(&r);
    return n;
}

static json_t *ref_get(const char *key)
{
    json_t *v = json_object_get(g_ref, key);
    if (!v)
        fail_msg("reference JSON has no '%s'", key);
    return v;
}

// --- group setup

static int group_setup(void **state)
{
    const char *env = getenv("TIDEPOOL_TEST_MODEL");
    snprintf(model_path, sizeof(model_path), "%s",
             env && *env ? env : "build/models/stories260K.gguf");
    char err[512];
    g_model = model_load(model_path, err, sizeof(err));
    if (!g_model) {
        fprintf(stderr, "%s\n", err);
        return -1;
    }
    g_tok = tokenizer_load(model_path, err, sizeof(err));
    g_mtp = mtp_load(g_model, MTP_PATH, err, sizeof(err));
    if (!g_tok || !g_mtp) {
        fprintf(stderr, "%s\n", err);
        return -1;
    }
    json_error_t je;
    g_ref = json_load_file(REF_PATH, 0, &je);
    if (!g_ref) {
        fprintf(stderr, "%s: %s (line %d)\n", REF_PATH, je.text, je.line);
        return -1;
    }
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/tp_test_mtp.XXXXXX");
    if (!mkdtemp(tmpdir))
        return -1;
    return 0;
}

static int group_teardown(void **state)
{
    mtp_destroy(&g_mtp);
    model_destroy(&g_model);
    tokenizer_destroy(&g_tok);
    json_decref(g_ref);
    char cmd[512];
    if (tmpdir[0]) {
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
        if (system(cmd) != 0)
            fprintf(stderr, "cannot remove %s\n", tmpdir);
    }
    return 0;
}

// --- loading

static void test_mtp_load(void **state)
{
    const model_config *c = model_get_config(g_model);
    assert_int_equal(mtp_n_modules(g_mtp), 2);
    assert_int_equal(mtp_kv_layer(g_mtp, 1), c->n_layer);
    assert_int_equal(mtp_kv_layer(g_mtp, 2), c->n_layer + 1);
    assert_true(mtp_fingerprint(g_mtp) != 0);
    assert_string_equal(mtp_path(g_mtp), MTP_PATH);
    assert_false(mtp_model_has_modules(g_model));
    float rate[2];
    assert_int_equal(mtp_acceptance_rate(g_mtp, rate), 0);
    assert_true(rate[0] > 0.5f && rate[0] <= 1.0f && rate[1] > 0.5f && rate[1] <= 1.0f);
    /* dim*2*dim + 4 dim^2-ish block: the counted bytes are the F32 matrices */
    int dim = c->dim, kvd = c->n_kv_head * c->head_dim, hid = c->hidden_dim;
    uint64_t want =
        4ull * (2ull * dim * dim + 2ull * dim * dim + 2ull * kvd * dim + 3ull * hid * dim);
    assert_int_equal(mtp_matmul_bytes(g_mtp, 1), want);
    /* the default side file is found from the model's name */
    char path[1024];
    assert_int_equal(mtp_default_path(g_model, model_path, path, sizeof(path)), 0);
    assert_non_null(strstr(path, "stories260K-mtp.gguf"));
    /* a second load gives the same fingerprint */
    char err[256];
    mtp_t *again = mtp_load(g_model, path, err, sizeof(err));
    assert_non_null(again);
    assert_true(mtp_fingerprint(again) == mtp_fingerprint(g_mtp));
    mtp_destroy(&again);
    assert_null(again);
    mtp_destroy(NULL);
}

/* Variants of the side file for the error cases. */
typedef struct {
    int dim;             /* llama.embedding_length written (0: the real one) */
    const char *head;    /* tidepool.mtp.head (NULL: "shared") */
    int head_u32;        /* write tidepool.mtp.head as a number instead (wrong type) */
    int no_nextn;        /* leave out llama.nextn_predict_layers */
    const char *skip;    /* tensor left out */
    const char *reshape; /* tensor written with a wrong shape */
    int embed_base;      /* write a whole model: base tensors + modules, block_count 7 */
    const int32_t *draft_vocab; /* tidepool.mtp.draft_vocab (n_draft_vocab ids), or NULL */
    int n_draft_vocab;
} variant;

static void write_variant(const char *path, const variant *v)
{
    const model_config *c = model_get_config(g_model);
    char err[256];
    gguf_t *side = gguf_open(MTP_PATH, err, sizeof(err));
    assert_non_null(side);
    gguf_t *base = v->embed_base ? gguf_open(model_path, err, sizeof(err)) : NULL;
    gguf_writer_t *w = gguf_writer_new();
    assert_non_null(w);
    int rc = gguf_writer_add_str(w, "general.architecture", "llama");
    rc |= gguf_writer_add_str(w, "general.name", v->embed_base ? "combined" : "variant");
    if (!v->no_nextn)
        rc |= gguf_writer_add_u32(w, "llama.nextn_predict_layers", 2);
    rc |= gguf_writer_add_u32(w, "llama.block_count", c->n_layer + (v->embed_base ? 2 : 0));
    rc |= gguf_writer_add_u32(w, "llama.context_length", c->n_ctx);
    rc |= gguf_writer_add_u32(w, "llama.embedding_length", v->dim ? v->dim : c->dim);
    rc |= gguf_writer_add_u32(w, "llama.feed_forward_length", c->hidden_dim);
    rc |= gguf_writer_add_u32(w, "llama.attention.head_count", c->n_head);
    rc |= gguf_writer_add_u32(w, "llama.attention.head_count_kv", c->n_kv_head);
    rc |= gguf_writer_add_str(w, "tidepool.rope.pairing", "adjacent");
    if (v->head_u32)
        rc |= gguf_writer_add_u32(w, "tidepool.mtp.head", 7);
    else
        rc |= gguf_writer_add_str(w, "tidepool.mtp.head", v->head ? v->head : "shared");
    if (v->draft_vocab)
        rc |= gguf_writer_add_arr_i32(w, "tidepool.mtp.draft_vocab", v->draft_vocab,
                                      (uint64_t)v->n_draft_vocab);
    assert_int_equal(rc, 0);
    uint64_t bad_ne[2] = {7, 3};
    static float bad_data[21];
    gguf_t *srcs[2] = {base, side};
    for (int s = 0; s < 2; s++) {
        if (!srcs[s])
            continue;
        for (int i = 0; i < gguf_n_tensors(srcs[s]); i++) {
            const gguf_tensor_info *t = gguf_tensor(srcs[s], i);
            if (v->skip && strcmp(t->name, v->skip) == 0)
                continue;
            if (v->reshape && strcmp(t->name, v->reshape) == 0)
                rc |= gguf_writer_add_tensor(w, t->name, GGUF_TENSOR_F32, 2, bad_ne, bad_data);
            else
                rc |= gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data);
        }
    }
    assert_int_equal(rc, 0);
    assert_int_equal(gguf_writer_write(w, path, err, sizeof(err)), 0);
    gguf_writer_destroy(&w);
    gguf_close(&side);
    gguf_close(&base);
}

static void expect_load_error(const variant *v, const char *needle)
{
    char path[400], err[512];
    snprintf(path, sizeof(path), "%s/variant.gguf", tmpdir);
    write_variant(path, v);
    mtp_t *mt = mtp_load(g_model, path, err, sizeof(err));
    if (mt)
        fail_msg("loaded a bad file (want an error with '%s')", needle);
    if (!strstr(err, path) || !strstr(err, needle))
        fail_msg("error '%s' does not name the file and '%s'", err, needle);
}

static void test_mtp_load_errors(void **state)
{
    char path[400], err[512];
    /* the writer itself produces a loadable file */
    snprintf(path, sizeof(path), "%s/good.gguf", tmpdir);
    write_variant(path, &(variant){0});
    mtp_t *mt = mtp_load(g_model, path, err, sizeof(err));
    assert_non_null(mt);
    assert_true(mtp_fingerprint(mt) == mtp_fingerprint(g_mtp));
    mtp_destroy(&mt);

    expect_load_error(&(variant){.dim = 32}, "llama.embedding_length");
    expect_load_error(&(variant){.head = "own"}, "tidepool.mtp.head");
    /* a semantics key of the wrong type: the message says so (it printed a buffer that
     * was never written) */
    expect_load_error(&(variant){.head_u32 = 1}, "tidepool.mtp.head is not a string");
    expect_load_error(&(variant){.no_nextn = 1}, "no MTP modules");
    expect_load_error(&(variant){.skip = "blk.6.ffn_up.weight"}, "blk.6.ffn_up.weight");
    expect_load_error(&(variant){.reshape = "blk.5.nextn.eh_proj.weight"},
                      "blk.5.nextn.eh_proj.weight");
    /* not a file, not a GGUF */
    assert_null(mtp_load(g_model, "/nonexistent/mtp.gguf", err, sizeof(err)));
    assert_non_null(strstr(err, "/nonexistent/mtp.gguf"));
    snprintf(path, sizeof(path), "%s/junk.gguf", tmpdir);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs("not a gguf file at all", f);
    fclose(f);
    assert_null(mtp_load(g_model, path, err, sizeof(err)));
    assert_non_null(strstr(err, path));
    /* the model file has no modules of its own */
    assert_null(mtp_load(g_model, NULL, err, sizeof(err)));
    assert_non_null(strstr(err, "no MTP modules"));
}

/* Modules stored in the model file itself (llama.cpp layout: block_count counts them). */
static void test_mtp_in_model_file(void **state)
{
    char path[400], err[512];
    snprintf(path, sizeof(path), "%s/combined.gguf", tmpdir);
    write_variant(path, &(variant){.embed_base = 1});
    model_t *m = model_load(path, err, sizeof(err));
    if (!m)
        fail_msg("%s", err);
    const model_config *c = model_get_config(m);
    assert_int_equal(c->n_layer, model_get_config(g_model)->n_layer);
    assert_true(mtp_model_has_modules(m));
    mtp_t *mt = mtp_load(m, NULL, err, sizeof(err));
    if (!mt)
        fail_msg("%s", err);
    assert_int_equal(mtp_n_modules(mt), 2);
    assert_true(mtp_fingerprint(mt) == mtp_fingerprint(g_mtp));
    assert_string_equal(mtp_path(mt), path);
    mtp_destroy(&mt);
    model_destroy(&m);
}

// --- the forward pass against the reference

static void test_mtp_reference(void **state)
{
    const model_config *c = model_get_config(g_model);
    const int D = c->dim, V = c->vocab_size;
    json_t *jt = ref_get("tokens");
    int T = (int)json_array_size(jt);
    assert_true(T >= 10 && T <= 64);
    int toks[64];
    for (int i = 0; i < T; i++)
        toks[i] = (int)json_integer_value(json_array_get(jt, i));
    rig r;
    rig_init(&r, g_mtp, 2, 256);
    int seq = kvcache_seq_new(r.kv);
    assert_int_equal(kvcache_seq_reserve(r.kv, seq, T), KVCACHE_OK);
    float *logits = malloc((size_t)T * V * sizeof(float));
    float *h0 = malloc((size_t)T * D * sizeof(float));
    float *h1 = malloc((size_t)T * D * sizeof(float));
    float *l1 = malloc((size_t)T * V * sizeof(float));
    float *l2 = malloc((size_t)T * V * sizeof(float));
    float *one = malloc((size_t)V * sizeof(float));
    float *h1b = malloc((size_t)D * sizeof(float));
    assert_non_null(logits);
    assert_non_null(h0);
    assert_non_null(h1);
    assert_non_null(l1);
    assert_non_null(l2);
    assert_non_null(one);
    assert_non_null(h1b);

    /* main model: argmax and h_0 at every position */
    model_seq_batch b = {
        .seq = seq, .n_tokens = T, .tokens = toks, .logits_all = 1, .logits = logits, .hidden = h0};
    assert_int_equal(model_forward(r.ctx, r.kv, &b, 1, NULL, NULL), 0);
    json_t *ma = ref_get("main_argmax"), *jh0 = ref_get("h0");
    double worst = 0;
    for (int i = 0; i < T; i++) {
        assert_int_equal(argmax(logits + (size_t)i * V, V),
                         json_integer_value(json_array_get(ma, i)));
        json_t *row = json_array_get(jh0, i);
        for (int j = 0; j < D; j++) {
            double want = json_real_value(json_array_get(row, j));
            double got = h0[(size_t)i * D + j];
            if (fabs(got - want) > worst)
                worst = fabs(got - want);
            if (!close_enough(got, want))
                fail_msg("h0[%d][%d] = %.7g, reference %.7g", i, j, got, want);
        }
    }
    print_message("h0: max abs diff %.2e over %d positions\n", worst, T);

    /* module 1, teacher-forced: (h_0[i], t[i+1]) at i = 0 .. T-2, in one batch item */
    int n1 = T - 1;
    b = (model_seq_batch){.seq = seq,
                          .n_tokens = n1,
                          .tokens = toks + 1,
                          .logits_all = 1,
                          .logits = l1,
                          .hidden = h1,
                          .hidden_in = h0};
    assert_int_equal(mtp_forward(r.ctx, r.kv, g_mtp, 1, &b, 1), 0);
    /* module 2, teacher-forced: (h_1[i], t[i+2]) at i = 0 .. T-3 */
    int n2 = T - 2;
    b = (model_seq_batch){.seq = seq,
                          .n_tokens = n2,
                          .tokens = toks + 2,
                          .logits_all = 1,
                          .logits = l2,
                          .hidden_in = h1};
    assert_int_equal(mtp_forward(r.ctx, r.kv, g_mtp, 2, &b, 1), 0);
    assert_int_equal(kvcache_seq_len(r.kv, seq), T); /* modules never move the length */

    struct {
        const char *am, *mg;
        const float *lg;
        int n;
    } sets[2] = {{"mtp1_argmax", "mtp1_margin", l1, n1}, {"mtp2_argmax", "mtp2_margin", l2, n2}};
    for (int s = 0; s < 2; s++) {
        json_t *am = ref_get(sets[s].am), *mg = ref_get(sets[s].mg);
        assert_int_equal((int)json_array_size(am), sets[s].n);
        int compared = 0;
        for (int i = 0; i < sets[s].n; i++) {
            if (json_real_value(json_array_get(mg, i)) <= MARGIN)
                continue;
            compared++;
            int got = argmax(sets[s].lg + (size_t)i * V, V);
            if (got != json_integer_value(json_array_get(am, i)))
                fail_msg("%s[%d] = %d, reference %lld", sets[s].am, i, got,
                         (long long)json_integer_value(json_array_get(am, i)));
        }
        assert_true(compared > sets[s].n / 2);
    }
    /* probed floats: h_1 and the logits, first 8 at a few positions */
    struct {
        const char *key;
        const float *base;
        int stride;
    } probes[3] = {
        {"h1_first8", h1, D}, {"mtp1_logits_first8", l1, V}, {"mtp2_logits_first8", l2, V}};
    for (int p = 0; p < 3; p++) {
        json_t *obj = ref_get(probes[p].key);
        const char *k;
        json_t *row;
        json_object_foreach(obj, k, row)
        {
            int i = atoi(k);
            for (int j = 0; j < 8; j++) {
                double want = json_real_value(json_array_get(row, j));
                double got = probes[p].base[(size_t)i * probes[p].stride + j];
                if (!close_enough(got, want))
                    fail_msg("%s[%d][%d] = %.7g, reference %.7g", probes[p].key, i, j, got, want);
            }
        }
    }

    /* module 2's draft at i: (h_1[i], mtp1_argmax[i]) over the real history s < i; then the
     * entry at i is rewritten from the real token, as the serving loop does */
    json_t *da = ref_get("mtp2_draft_argmax"), *dm = ref_get("mtp2_draft_margin");
    json_t *dl = ref_get("mtp2_draft_logits_first8");
    for (int i = 0; i < n1; i++) {
        int d1 = (int)json_integer_value(json_array_get(ref_get("mtp1_argmax"), i));
        b = (model_seq_batch){.seq = seq,
                              .pos = i,
                              .n_tokens = 1,
                              .tokens = &d1,
                              .logits = one,
                              .hidden_in = h1 + (size_t)i * D};
        assert_int_equal(mtp_forward(r.ctx, r.kv, g_mtp, 2, &b, 1), 0);
        if (json_real_value(json_array_get(dm, i)) > MARGIN)
            assert_int_equal(argmax(one, V), json_integer_value(json_array_get(da, i)));
        char key[16];
        snprintf(key, sizeof(key), "%d", i);
        json_t *row = json_object_get(dl, key);
        for (int j = 0; row && j < 8; j++)
            if (!close_enough(one[j], json_real_value(json_array_get(row, j))))
                fail_msg("mtp2_draft_logits[%d][%d] = %.7g, reference %.7g", i, j, one[j],
                         json_real_value(json_array_get(row, j)));
        if (i < n2) {
            b = (model_seq_batch){.seq = seq,
                                  .pos = i,
                                  .n_tokens = 1,
                                  .tokens = toks + i + 2,
                                  .logits = one,
                                  .hidden_in = h1 + (size_t)i * D};
            assert_int_equal(mtp_forward(r.ctx, r.kv, g_mtp, 2, &b, 1), 0);
            /* one position at a time = the batched pass, bit for bit */
            assert_memory_equal(one, l2 + (size_t)i * V, (size_t)V * sizeof(float));
        }
    }
    /* module 1 one position at a time, and h_1 out of a single-token pass */
    for (int i = 0; i < n1; i += 7) {
        b = (model_seq_batch){.seq = seq,
                              .pos = i,
                              .n_tokens = 1,
                              .tokens = toks + i + 1,
                              .logits = one,
                              .hidden = h1b,
                              .hidden_in = h0 + (size_t)i * D};
        assert_int_equal(mtp_forward(r.ctx, r.kv, g_mtp, 1, &b, 1), 0);
        assert_memory_equal(one, l1 + (size_t)i * V, (size_t)V * sizeof(float));
        assert_memory_equal(h1b, h1 + (size_t)i * D, (size_t)D * sizeof(float));
    }
    /* invalid calls */
    b = (model_seq_batch){.seq = seq, .n_tokens = 1, .tokens = toks, .logits = one};
    assert_int_equal(mtp_forward(r.ctx, r.kv, g_mtp, 1, &b, 1), -1); /* no hidden_in */
    b.hidden_in = h0;
    assert_int_equal(mtp_forward(r.ctx, r.kv, g_mtp, 3, &b, 1), -1); /* no module 3 */
    b.pos = T + 1;
    assert_int_equal(mtp_forward(r.ctx, r.kv, g_mtp, 1, &b, 1), -1); /* beyond the length */
    free(logits);
    free(h0);
    free(h1);
    free(l1);
    free(l2);
    free(one);
    free(h1b);
    rig_free(&r);
}

// --- the rule

/* Chi-square statistic of counts against probabilities p over n categories, merging the
 * categories with expected count < 5 into one; *df gets the degrees of freedom. */
static double chi2(const long *counts, const double *p, int n, long total, int *df)
{
    double stat = 0, rest_e = 0, rest_o = 0;
    int k = 0;
    *df = 0;
    for (int i = 0; i < n; i++) {
        double e = p[i] * (double)total;
        if (e < 5) {
            rest_e += e;
            rest_o += (double)counts[i];
            if (p[i] == 0 && counts[i] > 0) {
                *df = 1;
                return INFINITY; /* an impossible outcome */
            }
            continue;
        }
        stat += ((double)counts[i] - e) * ((double)counts[i] - e) / e;
        k++;
    }
    if (rest_e >= 5) {
        stat += (rest_o - rest_e) * (rest_o - rest_e) / rest_e;
        k++;
    }
    *df = k - 1;
    return stat;
}

/* Upper bound of chi-square with df degrees of freedom at p ~ 1e-4 (Wilson-Hilferty). */
static double chi2_crit(int df)
{
    double z = 3.72, a = 2.0 / (9.0 * df);
    double x = 1.0 - a + z * sqrt(a);
    return df * x * x * x;
}

static void test_specdec_rule(void **state)
{
    enum { NV = 8 };
    sampler_t *s = sampler_new(NV);
    assert_non_null(s);
    const float tl[2][NV] = {{2.0f, 1.5f, 0.2f, -1.0f, 0.7f, 0.1f, -0.5f, 1.0f},
                             {0.3f, 2.2f, 1.9f, -0.2f, 0.0f, 0.9f, 0.4f, -1.5f}};
    const float dl[2][NV] = {{0.5f, 2.0f, 1.0f, 0.0f, 0.7f, -1.0f, 0.2f, 0.3f},
                             {1.0f, 0.1f, 2.5f, 0.3f, -0.4f, 1.2f, 0.0f, 0.1f}};
    const sampler_params sps[4] = {{.temperature = 1.0f, .top_p = 1.0f},
                                   {.temperature = 0.7f, .top_p = 1.0f, .top_k = 4},
                                   {.temperature = 1.3f, .top_p = 0.8f},
                                   {.temperature = 0.9f, .top_p = 0.9f, .top_k = 5}};
    const long N = 200000;
    for (int v = 0; v < 4; v++) {
        const sampler_params *sp = &sps[v];
        /* exact distributions: first token p0; second token p1 (independent of the first
         * here: fixed target logits) */
        float tmp[NV], p[2][NV];
        for (int k = 0; k < 2; k++) {
            memcpy(tmp, tl[k], sizeof(tmp));
            sampler_probs(s, sp, tmp, p[k]);
            float sum = 0;
            for (int i = 0; i < NV; i++)
                sum += p[k][i];
            assert_true(fabsf(sum - 1.0f) < 1e-5f);
        }
        long c1[NV] = {0}, c2[NV] = {0}, n2 = 0, acc = 0;
        uint64_t rng = sampler_seed_state(100 + (uint64_t)v);
        for (long t = 0; t < N; t++) {
            float q[2][NV], lg[2][NV], target[3][NV], scratch[NV];
            int drafts[2], out[3], a;
            memcpy(lg, dl, sizeof(lg));
            drafts[0] = specdec_draft(s, NV, sp, &rng, lg[0], q[0]);
            drafts[1] = specdec_draft(s, NV, sp, &rng, lg[1], q[1]);
            memcpy(target[0], tl[0], sizeof(tl[0]));
            memcpy(target[1], tl[1], sizeof(tl[1]));
            memcpy(target[2], tl[0], sizeof(tl[0]));
            int n = specdec_accept(s, NV, sp, &rng, drafts, &q[0][0], 2, &target[0][0], scratch,
                                   out, &a);
            assert_int_equal(n, a + 1);
            for (int j = 0; j < a; j++)
                assert_int_equal(out[j], drafts[j]);
            c1[out[0]]++;
            acc += a;
            if (n >= 2) {
                c2[out[1]]++;
                n2++;
            }
        }
        double e1[NV], e2[NV];
        for (int i = 0; i < NV; i++) {
            e1[i] = p[0][i];
            e2[i] = p[1][i];
        }
        int df1, df2;
        double s1 = chi2(c1, e1, NV, N, &df1), s2 = chi2(c2, e2, NV, n2, &df2);
        print_message("params %d: accepted %.3f per step, chi2 %.1f (df %d), %.1f (df %d)\n", v,
                      (double)acc / N, s1, df1, s2, df2);
        assert_true(s1 < chi2_crit(df1));
        assert_true(s2 < chi2_crit(df2));
    }
    /* greedy: drafts are argmaxes; accepted exactly while they match the target's */
    sampler_params g = {.temperature = 0.0f, .top_p = 1.0f};
    float lg[NV], target[3][NV], scratch[NV];
    int out[3], a;
    uint64_t rng = 5;
    memcpy(lg, tl[0], sizeof(lg));
    int d0 = specdec_draft(s, NV, &g, &rng, lg, NULL);
    assert_int_equal(d0, 0);
    assert_int_equal(rng, 5); /* greedy draws nothing */
    int drafts[2] = {0, 1};
    memcpy(target[0], tl[0], sizeof(tl[0])); /* argmax 0: d1 accepted */
    memcpy(target[1], tl[1], sizeof(tl[1])); /* argmax 1: d2 accepted */
    memcpy(target[2], tl[1], sizeof(tl[1])); /* bonus: 1 */
    assert_int_equal(
        specdec_accept(s, NV, &g, &rng, drafts, NULL, 2, &target[0][0], scratch, out, &a), 3);
    assert_int_equal(a, 2);
    assert_int_equal(out[0], 0);
    assert_int_equal(out[1], 1);
    assert_int_equal(out[2], 1);
    drafts[0] = 3; /* rejected at once: the target's argmax instead */
    memcpy(target[0], tl[0], sizeof(tl[0]));
    assert_int_equal(
        specdec_accept(s, NV, &g, &rng, drafts, NULL, 2, &target[0][0], scratch, out, &a), 1);
    assert_int_equal(a, 0);
    assert_int_equal(out[0], 0);
    assert_int_equal(rng, 5);
    sampler_destroy(&s);
}

// --- the step

static int g_prompt_toks[2][64], g_prompt_n[2];

static void encode_prompts(void)
{
    for (int i = 0; i < 2; i++)
        g_prompt_n[i] = encode(PROMPTS[i], g_prompt_toks[i], 64);
}

static void test_specdec_greedy_equivalence(void **state)
{
    const model_config *c = model_get_config(g_model);
    enum { NG = 96 };
    encode_prompts();
    /* the JSON's tokens are BOS + "Once upon a time" + the greedy continuation */
    json_t *jt = ref_get("tokens");
    int pl = (int)json_integer_value(ref_get("prompt_len"));
    assert_int_equal(pl, g_prompt_n[0]);
    int ref[2][NG], nref[2];
    for (int p = 0; p < 2; p++)
        nref[p] = plain_greedy(g_prompt_toks[p], g_prompt_n[p], NG, ref[p]);
    for (int i = pl; i < (int)json_array_size(jt); i++)
        assert_int_equal(ref[0][i - pl], json_integer_value(json_array_get(jt, i)));
    sampler_params sp = {.temperature = 0.0f, .top_p = 1.0f};
    rig r;
    rig_init(&r, g_mtp, 16, c->n_ctx);
    int buf[16][NG], *outs[16], nout[16];
    for (int i = 0; i < 16; i++)
        outs[i] = buf[i];
    /* one sequence at a time, at each depth */
    for (int d = 0; d <= 2; d++) {
        for (int p = 0; p < 2; p++) {
            const int *pr = g_prompt_toks[p];
            dec_stats st = {0};
            decode(&r, 1, &pr, &g_prompt_n[p], &d, NULL, &sp, NULL, NG, outs, nout, &st);
            assert_int_equal(nout[0], nref[p]);
            assert_memory_equal(outs[0], ref[p], (size_t)nref[p] * sizeof(int));
            if (d > 0)
                print_message("depth %d, prompt %d: %ld steps, mean acceptance length %.2f\n", d, p,
                              st.steps, (double)st.emitted / (double)st.steps);
            else
                assert_int_equal(st.drafted, 0);
        }
    }
    /* a prompt of BOS alone: no module position in the prefill, h_1[-1] does not exist */
    {
        int bos = c->bos_id, one = 1, two = 2, refb[NG];
        const int *pr = &bos;
        int nrb = plain_greedy(&bos, 1, NG, refb);
        dec_stats st = {0};
        decode(&r, 1, &pr, &one, &two, NULL, &sp, NULL, NG, outs, nout, &st);
        assert_int_equal(nout[0], nrb);
        assert_memory_equal(outs[0], refb, (size_t)nrb * sizeof(int));
        assert_true(st.accepted > 0);
    }
    /* batched: 12 sequences with mixed depths and both prompts in every step */
    const int *prs[12];
    int nps[12], depths[12];
    for (int i = 0; i < 12; i++) {
        prs[i] = g_prompt_toks[i % 2];
        nps[i] = g_prompt_n[i % 2];
        depths[i] = (i / 2) % 3;
    }
    dec_stats st = {0};
    decode(&r, 12, prs, nps, depths, NULL, &sp, NULL, NG, outs, nout, &st);
    for (int i = 0; i < 12; i++) {
        assert_int_equal(nout[i], nref[i % 2]);
        assert_memory_equal(outs[i], ref[i % 2], (size_t)nref[i % 2] * sizeof(int));
    }
    assert_true(st.accepted > 0);
    rig_free(&r);
}

/* Reference log-softmax of logits (n floats) in double: the value at token, and the k
 * largest ids (ties: the lower id) and values. */
static double ref_logprobs(const float *logits, int n, int token, int k, int *ids, double *vals)
{
    double mx = logits[0], sum = 0;
    for (int i = 1; i < n; i++)
        mx = logits[i] > mx ? logits[i] : mx;
    for (int i = 0; i < n; i++)
        sum += exp((double)logits[i] - mx);
    double lse = mx + log(sum);
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < n; i++) {
            int used = 0;
            for (int q = 0; q < j; q++)
                used |= ids[q] == i;
            if (!used && (best < 0 || logits[i] > logits[best]))
                best = i;
        }
        ids[j] = best;
        vals[j] = (double)logits[best] - lse;
    }
    return (double)logits[token] - lse;
}

/* specdec_logprobs: +50 on token 7 (ud unused): the sampler picks it, the logprobs must not
 * see it */
static void force_7(void *ud, sampler_t *s, float *logits)
{
    (void)ud;
    (void)s;
    logits[7] += 50.0f;
}

/* Log-probabilities: sampler_logprobs on model_forward's logits equals a log-softmax in
 * double (1e-6), and those specdec_step reports for every emitted token, at depth 0 and 2,
 * equal the reference of plain greedy decoding (model_forward one token per pass) within
 * 1e-4, with the same top ids: per position, from the verify logits, never the drafts'. A
 * penalised step reports the raw distribution, not the penalised one. */
static void test_specdec_logprobs(void **state)
{
    const model_config *c = model_get_config(g_model);
    const int V = c->vocab_size;
    enum { NG = 40, K = 5 };
    encode_prompts();
    const int *pr = g_prompt_toks[0];
    int np = g_prompt_n[0];
    /* the reference: plain greedy, one token per pass */
    int ref_tok[NG], ref_ids[NG][K];
    double ref_lp[NG], ref_vals[NG][K];
    float *ref_logits1 = malloc((size_t)V * sizeof(float)); /* logits at the second token */
    assert_non_null(ref_logits1);
    {
        rig r;
        rig_init(&r, NULL, 1, c->n_ctx);
        int seq = kvcache_seq_new(r.kv);
        assert_int_equal(kvcache_seq_reserve(r.kv, seq, np + NG), KVCACHE_OK);
        model_seq_batch b = {.seq = seq, .n_tokens = np, .tokens = pr, .logits = r.logits};
        assert_int_equal(model_forward(r.ctx, r.kv, &b, 1, NULL, NULL), 0);
        for (int n = 0; n < NG; n++) {
            ref_tok[n] = argmax(r.logits, V);
            ref_lp[n] = ref_logprobs(r.logits, V, ref_tok[n], K, ref_ids[n], ref_vals[n]);
            sampler_logprob lp;
            sampler_logprobs(r.logits, V, ref_tok[n], K, &lp);
            assert_true(fabs(lp.logprob - ref_lp[n]) <= 1e-6);
            assert_int_equal(lp.n_top, K);
            assert_int_equal(lp.top_ids[0], ref_tok[n]); /* greedy: the emitted is the top */
            for (int j = 0; j < K; j++) {
                assert_int_equal(lp.top_ids[j], ref_ids[n][j]);
                assert_true(fabs(lp.top_logprobs[j] - ref_vals[n][j]) <= 1e-6);
            }
            if (n == 1)
                memcpy(ref_logits1, r.logits, (size_t)V * sizeof(float));
            b = (model_seq_batch){.seq = seq,
                                  .pos = np + n,
                                  .n_tokens = 1,
                                  .tokens = &ref_tok[n],
                                  .logits = r.logits};
            assert_int_equal(model_forward(r.ctx, r.kv, &b, 1, NULL, NULL), 0);
        }
        rig_free(&r);
    }
    assert_true(ref_tok[1] != 7);
    sampler_params sp = {.temperature = 0.0f, .top_p = 1.0f};
    for (int d = 0; d <= 2; d += 2) {
        rig r;
        rig_init(&r, g_mtp, 1, c->n_ctx);
        int seq = kvcache_seq_new(r.kv);
        assert_int_equal(kvcache_seq_reserve(r.kv, seq, np + NG + SPECDEC_MAX_DEPTH), KVCACHE_OK);
        float hand[2 * 64];
        assert_true(c->dim <= 64);
        model_seq_batch pb = {.seq = seq, .n_tokens = np, .tokens = pr, .logits = r.logits,
                              .hidden = r.h0, .hidden_all = 1};
        specdec_prefill_item pit = {.seq = seq, .n_tokens = np, .prompt = pr, .n_prompt = np,
                                    .h0 = r.h0, .depth = 2, .hand = hand};
        assert_int_equal(model_forward(r.ctx, r.kv, &pb, 1, NULL, NULL), 0);
        assert_int_equal(specdec_prefill(r.sd, r.ctx, r.kv, &pit, 1), 0);
        int toks[NG + SPECDEC_MAX_DEPTH + 1], n = 1, pos = np;
        toks[0] = argmax(r.logits, V);
        assert_int_equal(toks[0], ref_tok[0]);
        specdec_seq_start(r.sd, seq, np, toks[0], hand, 2);
        uint64_t rng = 1;
        long accepted = 0;
        while (n < NG) {
            specdec_item it = {.seq = seq, .pos = pos, .last = toks[n - 1], .depth = d,
                               .sp = &sp, .rng = &rng, .n_logprobs = K + 1};
            assert_int_equal(specdec_step(r.sd, r.ctx, r.kv, &it, 1), 0);
            accepted += it.n_accepted;
            pos += it.n_tokens;
            for (int j = 0; j < it.n_tokens && n < NG; j++, n++) {
                const sampler_logprob *lp = &it.lps[j];
                toks[n] = it.tokens[j];
                assert_int_equal(toks[n], ref_tok[n]);
                if (fabs(lp->logprob - ref_lp[n]) > 1e-4)
                    fail_msg("depth %d token %d: logprob %.7f, reference %.7f", d, n,
                             (double)lp->logprob, ref_lp[n]);
                assert_int_equal(lp->n_top, K);
                for (int q = 0; q < K; q++) {
                    assert_int_equal(lp->top_ids[q], ref_ids[n][q]);
                    assert_true(fabs(lp->top_logprobs[q] - ref_vals[n][q]) <= 1e-4);
                }
            }
        }
        if (d > 0)
            assert_true(accepted > 0); /* drafts were accepted: several positions per step */
        rig_free(&r);
    }
    /* penalised (depth 0): the sampler sees +50 on token 7 and emits it; the logprobs are
     * those of the raw distribution at that position */
    {
        rig r;
        rig_init(&r, NULL, 1, c->n_ctx);
        int seq = kvcache_seq_new(r.kv);
        assert_int_equal(kvcache_seq_reserve(r.kv, seq, np + 4), KVCACHE_OK);
        model_seq_batch b = {.seq = seq, .n_tokens = np, .tokens = pr, .logits = r.logits};
        assert_int_equal(model_forward(r.ctx, r.kv, &b, 1, NULL, NULL), 0);
        specdec_seq_start(r.sd, seq, np, ref_tok[0], NULL, 0);
        uint64_t rng = 1;
        specdec_item it = {.seq = seq, .pos = np, .last = ref_tok[0], .depth = 0, .sp = &sp,
                           .rng = &rng, .penalize = force_7, .n_logprobs = 3};
        assert_int_equal(specdec_step(r.sd, r.ctx, r.kv, &it, 1), 0);
        assert_int_equal(it.n_tokens, 1);
        assert_int_equal(it.tokens[0], 7);
        int ids[2];
        double vals[2];
        double want = ref_logprobs(ref_logits1, V, 7, 2, ids, vals);
        assert_true(fabs(it.lps[0].logprob - want) <= 1e-4);
        assert_true(it.lps[0].logprob < -1.0f); /* not the penalised ~0 */
        assert_int_equal(it.lps[0].n_top, 2);
        assert_int_equal(it.lps[0].top_ids[0], ref_tok[1]);
        assert_int_equal(it.lps[0].top_ids[1], ids[1]);
        rig_free(&r);
    }
    free(ref_logits1);
}

/* The draft vocabulary (FR-Spec): the ranking is a permutation with EOS and BOS first; the
 * subset head's logits are bit-identical to the full head's at its tokens (teacher-forced,
 * both modules, every position); greedy output through specdec is plain greedy at any
 * draft vocabulary, and a smaller one accepts fewer drafts. */
static void test_mtp_draft_vocab(void **state)
{
    const model_config *c = model_get_config(g_model);
    const int V = c->vocab_size, D = c->dim;
    assert_int_equal(mtp_draft_vocab(g_mtp), mtp_default_draft_vocab(g_mtp));
    assert_int_equal(mtp_default_draft_vocab(g_mtp), 256); /* max(256, 512 / 4) */
    const int *ids = mtp_draft_ids(g_mtp);
    char *seen = calloc((size_t)V, 1);
    assert_non_null(seen);
    for (int i = 0; i < V; i++) {
        assert_true(ids[i] >= 0 && ids[i] < V);
        assert_false(seen[ids[i]]);
        seen[ids[i]] = 1;
    }
    free(seen);
    assert_int_equal(ids[0], c->eos_id);
    assert_int_equal(ids[1], c->bos_id);
    /* a measured list in the file comes first (duplicates and bad ids dropped), then EOS,
     * BOS and the tokenizer's ranking as before */
    {
        static const int32_t list[] = {300, 7, 300, -5, 9999, 2};
        char path[400], err[512];
        snprintf(path, sizeof(path), "%s/draft_vocab.gguf", tmpdir);
        write_variant(path, &(variant){.draft_vocab = list, .n_draft_vocab = 6});
        mtp_t *mt = mtp_load(g_model, path, err, sizeof(err));
        if (!mt)
            fail_msg("%s", err);
        const int *r2 = mtp_draft_ids(mt);
        assert_int_equal(r2[0], 300);
        assert_int_equal(r2[1], 7);
        assert_int_equal(r2[2], 2);
        assert_int_equal(c->eos_id, 2);
        assert_int_equal(r2[3], c->bos_id);
        /* then the same order as without the list, minus the tokens already placed */
        for (int i = 2, j = 4; i < V; i++) {
            if (ids[i] == 300 || ids[i] == 7)
                continue;
            assert_int_equal(r2[j], ids[i]);
            j++;
        }
        mtp_destroy(&mt);
    }

    /* teacher-forced module logits, full head vs draft head of K tokens */
    encode_prompts();
    enum { NG = 40 };
    int toks[64 + NG];
    int T = plain_greedy(g_prompt_toks[0], g_prompt_n[0], NG, toks + g_prompt_n[0]);
    memcpy(toks, g_prompt_toks[0], (size_t)g_prompt_n[0] * sizeof(int));
    T += g_prompt_n[0];
    rig r;
    rig_init(&r, g_mtp, 1, c->n_ctx);
    int seq = kvcache_seq_new(r.kv);
    assert_int_equal(kvcache_seq_reserve(r.kv, seq, T), KVCACHE_OK);
    float *h0 = malloc((size_t)T * D * sizeof(float)), *h1 = malloc((size_t)T * D * sizeof(float));
    float *full = malloc((size_t)T * V * sizeof(float)), *sub = malloc((size_t)T * V * sizeof(float));
    float *lg = malloc((size_t)T * V * sizeof(float));
    assert_true(h0 && h1 && full && sub && lg);
    model_seq_batch b = {.seq = seq, .n_tokens = T, .tokens = toks, .logits_all = 1, .logits = lg,
                         .hidden = h0};
    assert_int_equal(model_forward(r.ctx, r.kv, &b, 1, NULL, NULL), 0);
    const int Ks[] = {256, 64, 0};
    for (size_t ki = 0; ki < sizeof(Ks) / sizeof(Ks[0]); ki++) {
        assert_int_equal(mtp_set_draft_vocab(g_mtp, Ks[ki]), 0);
        int K = mtp_draft_vocab(g_mtp);
        assert_int_equal(K, Ks[ki] ? Ks[ki] : V);
        const int *map = mtp_draft_map(g_mtp);
        assert_true(Ks[ki] ? map == ids : map == NULL);
        for (int k = 1; k <= 2; k++) {
            const float *hin = k == 1 ? h0 : h1;
            int n = T - k;
            b = (model_seq_batch){.seq = seq, .n_tokens = n, .tokens = toks + k, .logits_all = 1,
                                  .logits = full, .hidden = k == 1 ? h1 : NULL, .hidden_in = hin};
            assert_int_equal(mtp_forward(r.ctx, r.kv, g_mtp, k, &b, 1), 0);
            b.logits = sub;
            b.hidden = NULL;
            assert_int_equal(mtp_forward_draft(r.ctx, r.kv, g_mtp, k, &b, 1), 0);
            for (int i = 0; i < n; i++)
                for (int j = 0; j < K; j++) {
                    float want = full[(size_t)i * V + (map ? map[j] : j)];
                    float got = sub[(size_t)i * K + j];
                    if (memcmp(&want, &got, sizeof(float)) != 0)
                        fail_msg("K %d module %d position %d draft %d: %a vs %a", K, k, i, j,
                                 (double)got, (double)want);
                }
        }
    }
    rig_free(&r);
    free(h0);
    free(h1);
    free(full);
    free(sub);
    free(lg);

    /* through specdec: the output of plain greedy decoding whatever the draft vocabulary */
    sampler_params sp = {.temperature = 0.0f, .top_p = 1.0f};
    enum { NGEN = 96 };
    long acc[3] = {0};
    for (size_t ki = 0; ki < sizeof(Ks) / sizeof(Ks[0]); ki++) {
        assert_int_equal(mtp_set_draft_vocab(g_mtp, Ks[ki]), 0);
        for (int p = 0; p < 2; p++) {
            int ref[NGEN], nref = plain_greedy(g_prompt_toks[p], g_prompt_n[p], NGEN, ref);
            int buf[NGEN], *o = buf, no, two = 2;
            const int *pr = g_prompt_toks[p];
            dec_stats st = {0};
            rig_init(&r, g_mtp, 2, c->n_ctx);
            decode(&r, 1, &pr, &g_prompt_n[p], &two, NULL, &sp, NULL, NGEN, &o, &no, &st);
            rig_free(&r);
            assert_int_equal(no, nref);
            assert_memory_equal(buf, ref, (size_t)nref * sizeof(int));
            acc[ki] += st.accepted;
        }
        print_message("draft vocabulary %d: %ld drafts accepted\n", Ks[ki] ? Ks[ki] : V, acc[ki]);
    }
    assert_true(acc[1] < acc[0] && acc[1] < acc[2]);
    assert_int_equal(mtp_set_draft_vocab(g_mtp, mtp_default_draft_vocab(g_mtp)), 0);
}

/* depth per step: nothing for the first 20 steps (catch-up deferred, then forced at 16
 * rows), then 2 */
static int late_depth(int i, int step)
{
    return step < 20 ? 0 : 2;
}

static int zero_depth(int i, int step)
{
    return 0;
}

/* Module KV after deferred catch-up equals the KV of catching up every step. */
/* The MTP modules' and the draft head's F32 matrices are matvec-packed at load and used by
 * contexts that use packed matrices (EXACT, AVX2+): module logits and hidden rows bit for
 * bit those of the scalar kernels, at T = 1 (a draft step) and T = n (teacher forcing),
 * with the full head and the draft head. */
static void test_mtp_packed_modules(void **state)
{
    (void)state;
    if (kern_isa_detect() < KERN_ISA_AVX2)
        skip();
    const model_config *c = model_get_config(g_model);
    const int V = c->vocab_size, D = c->dim;
    encode_prompts();
    enum { NG = 24 };
    int toks[64 + NG];
    int T = plain_greedy(g_prompt_toks[1], g_prompt_n[1], NG, toks + g_prompt_n[1]);
    memcpy(toks, g_prompt_toks[1], (size_t)g_prompt_n[1] * sizeof(int));
    T += g_prompt_n[1];
    rig r[2];
    rig_init(&r[0], g_mtp, 1, c->n_ctx);
    rig_init(&r[1], g_mtp, 1, c->n_ctx);
    model_ctx_destroy(&r[1].ctx); /* the reference: scalar kernels, no packed copies */
    model_ctx_params p = model_ctx_default_params();
    p.max_tokens = c->n_ctx;
    p.max_isa = MODEL_ISA_SCALAR;
    r[1].ctx = model_ctx_new_params(g_model, &p);
    assert_non_null(r[1].ctx);
    float *h0[2], *h1[2], *lg[2];
    for (int s = 0; s < 2; s++) {
        h0[s] = malloc((size_t)T * D * sizeof(float));
        h1[s] = malloc((size_t)T * D * sizeof(float));
        lg[s] = malloc((size_t)T * V * sizeof(float));
        assert_true(h0[s] && h1[s] && lg[s]);
        int seq = kvcache_seq_new(r[s].kv);
        assert_int_equal(seq, 0);
        assert_int_equal(kvcache_seq_reserve(r[s].kv, seq, T), KVCACHE_OK);
        model_seq_batch b = {.seq = seq, .n_tokens = T, .tokens = toks, .logits_all = 1,
                             .logits = lg[s], .hidden = h0[s]};
        assert_int_equal(model_forward(r[s].ctx, r[s].kv, &b, 1, NULL, NULL), 0);
    }
    assert_memory_equal(h0[0], h0[1], (size_t)T * D * sizeof(float));
    const int Ks[] = {0, 256};
    for (size_t ki = 0; ki < 2; ki++) {
        assert_int_equal(mtp_set_draft_vocab(g_mtp, Ks[ki]), 0);
        const int K = mtp_draft_vocab(g_mtp);
        for (int k = 1; k <= 2; k++) {
            /* teacher-forced over the sequence, then one token at the end */
            const int spans[2][2] = {{0, T - k - 1}, {T - k - 1, 1}};
            for (int sp = 0; sp < 2; sp++) {
                const int j0 = spans[sp][0], n = spans[sp][1];
                for (int s = 0; s < 2; s++) {
                    model_seq_batch b = {.seq = 0,
                                         .pos = j0,
                                         .n_tokens = n,
                                         .tokens = toks + j0 + k,
                                         .logits_all = 1,
                                         .logits = lg[s],
                                         .hidden = k == 1 ? h1[s] + (size_t)j0 * D : NULL,
                                         .hidden_in = (k == 1 ? h0[s] : h1[s]) + (size_t)j0 * D};
                    int rc = ki ? mtp_forward_draft(r[s].ctx, r[s].kv, g_mtp, k, &b, 1)
                                : mtp_forward(r[s].ctx, r[s].kv, g_mtp, k, &b, 1);
                    assert_int_equal(rc, 0);
                }
                if (memcmp(lg[0], lg[1], (size_t)n * K * sizeof(float)) != 0)
                    fail_msg("K %d module %d span %d: packed logits differ from scalar", K, k,
                             sp);
                if (k == 1)
                    assert_memory_equal(h1[0] + (size_t)j0 * D, h1[1] + (size_t)j0 * D,
                                        (size_t)n * D * sizeof(float));
            }
        }
    }
    assert_int_equal(mtp_set_draft_vocab(g_mtp, mtp_default_draft_vocab(g_mtp)), 0);
    for (int s = 0; s < 2; s++) {
        rig_free(&r[s]);
        free(h0[s]);
        free(h1[s]);
        free(lg[s]);
    }
}

static void test_specdec_deferred_catchup(void **state)
{
    const model_config *c = model_get_config(g_model);
    enum { NG = 60 };
    encode_prompts();
    sampler_params sp = {.temperature = 0.0f, .top_p = 1.0f};
    int two = 2;
    const int *pr = g_prompt_toks[0];
    int ref[NG], nref = plain_greedy(pr, g_prompt_n[0], NG, ref);
    int a[NG], *oa = a, na;
    rig r;
    rig_init(&r, g_mtp, 4, c->n_ctx);
    /* run 1: always at depth 2; run 2: depth 0 for 20 steps, then 2. Same greedy output;
     * after both, module 1's cache at every position both wrote is bit-identical */
    dec_stats st1 = {0}, st2 = {0};
    decode(&r, 1, &pr, &g_prompt_n[0], &two, NULL, &sp, NULL, NG, &oa, &na, &st1);
    assert_int_equal(na, nref);
    assert_memory_equal(a, ref, (size_t)nref * sizeof(int));
    /* keep copies of module KV: decode frees its sequences, so re-run without freeing by
     * comparing against a second rig */
    rig r2;
    rig_init(&r2, g_mtp, 4, c->n_ctx);
    decode(&r2, 1, &pr, &g_prompt_n[0], &two, late_depth, &sp, NULL, NG, &oa, &na, &st2);
    assert_int_equal(na, nref);
    assert_memory_equal(a, ref, (size_t)nref * sizeof(int));
    assert_true(st2.accepted > 0);
    /* both rigs used sequence 0's blocks 0.. in order: compare the module layers over the
     * positions every run has real entries for (all but the last few) */
    int L = c->n_layer, kvd = c->n_kv_head * c->head_dim;
    int upto = g_prompt_n[0] + NG - 8;
    for (int layer = L; layer < L + 2; layer++) {
        for (int pos = 0; pos < upto; pos++) {
            int blk = pos / 16, off = pos % 16;
            const float *k1 = kvcache_block_data(r.kv, layer, blk) + (size_t)off * kvd;
            const float *k2 = kvcache_block_data(r2.kv, layer, blk) + (size_t)off * kvd;
            if (memcmp(k1, k2, (size_t)kvd * sizeof(float)) != 0)
                fail_msg("module %d K differs at position %d", layer - L + 1, pos);
        }
    }
    /* depth 0 all the way: output still right (catch-up forced every 16 positions) */
    decode(&r2, 1, &pr, &g_prompt_n[0], &two, zero_depth, &sp, NULL, NG, &oa, &na, NULL);
    assert_memory_equal(a, ref, (size_t)nref * sizeof(int));
    rig_free(&r);
    rig_free(&r2);
}

/* One step of seq at *pos on rig r at depth d: tokens emitted appended to out, drafts
 * and acceptances recorded. */
static void one_step(rig *r, int seq, int *pos, int *out, int *n_out, int d,
                     const sampler_params *sp, uint64_t *rng, int *drafted, int *accepted)
{
    specdec_item it = {.seq = seq, .pos = *pos, .last = out[*n_out - 1], .depth = d, .sp = sp,
                       .rng = rng};
    assert_int_equal(specdec_step(r->sd, r->ctx, r->kv, &it, 1), 0);
    *pos += it.n_tokens;
    for (int j = 0; j < it.n_tokens; j++)
        out[(*n_out)++] = it.tokens[j];
    *drafted = it.n_drafted;
    *accepted = it.n_accepted;
}

/* Live migration of the module state (specdec_seq_export / import): a sequence decoded for a
 * while on rig A, its KV (main and module layers) copied block by block to rig B and its
 * state exported and imported there, continues on B exactly as on A: the same tokens, the
 * same drafts accepted at every step (sampled, so the drafts matter), bit for bit. A state
 * that does not fit the sequence is refused and the sequence decodes plainly. */
static void test_specdec_state_migration(void **state)
{
    const model_config *c = model_get_config(g_model);
    const int V = c->vocab_size;
    encode_prompts();
    const int *pr = g_prompt_toks[1];
    int np = g_prompt_n[1];
    sampler_params sp = {.temperature = 0.8f, .top_p = 0.95f};
    rig a, b;
    rig_init(&a, g_mtp, 2, c->n_ctx);
    rig_init(&b, g_mtp, 2, c->n_ctx);
    enum { NG = 80, MOVE_AT = 9 };
    int sa = kvcache_seq_new(a.kv), sb = kvcache_seq_new(b.kv);
    assert_int_equal(kvcache_seq_reserve(a.kv, sa, np + NG + 4), KVCACHE_OK);
    assert_int_equal(kvcache_seq_reserve(b.kv, sb, np + NG + 4), KVCACHE_OK);
    float hand[2 * 64];
    model_seq_batch pb = {.seq = sa, .n_tokens = np, .tokens = pr, .logits = a.logits,
                          .hidden = a.h0, .hidden_all = 1};
    assert_int_equal(model_forward(a.ctx, a.kv, &pb, 1, NULL, NULL), 0);
    specdec_prefill_item pit = {.seq = sa, .n_tokens = np, .prompt = pr, .n_prompt = np,
                                .h0 = a.h0, .depth = 2, .hand = hand};
    assert_int_equal(specdec_prefill(a.sd, a.ctx, a.kv, &pit, 1), 0);
    uint64_t rng = sampler_seed_state(7);
    int out[NG + 8], n_out = 1, pos = np, dr, ac;
    out[0] = sampler_sample(a.smp, &sp, &rng, a.logits);
    specdec_seq_start(a.sd, sa, np, out[0], hand, 2);
    for (int s = 0; s < MOVE_AT; s++)
        one_step(&a, sa, &pos, out, &n_out, s % 3 == 2 ? 0 : 2, &sp, &rng, &dr, &ac);
    /* move: every block of every layer (main and modules), then the state */
    int nba, nbb;
    const int *ba = kvcache_seq_blocks(a.kv, sa, &nba), *bb = kvcache_seq_blocks(b.kv, sb, &nbb);
    int need = kvcache_blocks_for(a.kv, pos);
    assert_true(nba >= need && nbb >= need);
    for (int layer = 0; layer < c->n_layer + mtp_n_modules(g_mtp); layer++)
        for (int k = 0; k < need; k++)
            memcpy(kvcache_block_data(b.kv, layer, bb[k]), kvcache_block_data(a.kv, layer, ba[k]),
                   kvcache_block_bytes(a.kv));
    kvcache_seq_set_len(b.kv, sb, pos);
    int nf = specdec_state_floats(a.sd);
    float *st = malloc((size_t)nf * sizeof(float));
    assert_non_null(st);
    assert_int_equal(specdec_seq_export(a.sd, sa, pos + 1, st), -1); /* out of step */
    assert_int_equal(specdec_seq_export(a.sd, sa, pos, st), 0);
    /* a state that does not fit is refused: plain decoding */
    assert_int_equal(specdec_seq_import(b.sd, sb, pos + 1, st, 2), -1);
    assert_int_equal(specdec_seq_max_depth(b.sd, sb), 0);
    st[1] += 100.0f;
    assert_int_equal(specdec_seq_import(b.sd, sb, pos, st, 2), -1);
    st[1] -= 100.0f;
    assert_int_equal(specdec_seq_import(b.sd, sb, pos, st, 2), 0);
    assert_int_equal(specdec_seq_max_depth(b.sd, sb), 2);
    /* both go on from the same sampler state */
    uint64_t rng_b = rng;
    int out_b[NG + 8], n_b = n_out, pos_b = pos;
    memcpy(out_b, out, (size_t)n_out * sizeof(int));
    long acc_total = 0;
    while (n_out < NG) {
        int da, aa, db, abb;
        one_step(&a, sa, &pos, out, &n_out, 2, &sp, &rng, &da, &aa);
        one_step(&b, sb, &pos_b, out_b, &n_b, 2, &sp, &rng_b, &db, &abb);
        assert_int_equal(da, db);
        assert_int_equal(aa, abb);
        acc_total += aa;
        assert_int_equal(n_out, n_b);
        assert_memory_equal(out, out_b, (size_t)n_out * sizeof(int));
    }
    assert_true(rng == rng_b);
    assert_true(acc_total > 0); /* the drafts did something */
    (void)V;
    free(st);
    rig_free(&a);
    rig_free(&b);
}

/* Prefill in chunks gives the same module KV and hand-off state as one pass. */
static void test_specdec_prefill_chunked(void **state)
{
    const model_config *c = model_get_config(g_model);
    const int D = c->dim, kvd = c->n_kv_head * c->head_dim;
    int toks[40];
    json_t *jt = ref_get("tokens");
    for (int i = 0; i < 40; i++)
        toks[i] = (int)json_integer_value(json_array_get(jt, i % json_array_size(jt)));
    const int P = 23;
    float hand[2][2 * 64];
    rig r;
    rig_init(&r, g_mtp, 2, 256);
    int seqs[2];
    for (int k = 0; k < 2; k++) {
        seqs[k] = kvcache_seq_new(r.kv);
        assert_int_equal(kvcache_seq_reserve(r.kv, seqs[k], P), KVCACHE_OK);
    }
    /* one pass */
    model_seq_batch b = {.seq = seqs[0],
                         .n_tokens = P,
                         .tokens = toks,
                         .logits = r.logits,
                         .hidden = r.h0,
                         .hidden_all = 1};
    assert_int_equal(model_forward(r.ctx, r.kv, &b, 1, NULL, NULL), 0);
    specdec_prefill_item it = {.seq = seqs[0],
                               .n_tokens = P,
                               .prompt = toks,
                               .n_prompt = P,
                               .h0 = r.h0,
                               .depth = 2,
                               .hand = hand[0]};
    assert_int_equal(specdec_prefill(r.sd, r.ctx, r.kv, &it, 1), 0);
    /* chunks of 7, 7, 7, 2 (the last chunk holds P-1 but not P-2) */
    for (int a = 0; a < P; a += 7) {
        int n = P - a < 7 ? P - a : 7;
        b = (model_seq_batch){.seq = seqs[1],
                              .pos = a,
                              .n_tokens = n,
                              .tokens = toks + a,
                              .logits = r.logits,
                              .hidden = r.h0,
                              .hidden_all = 1};
        assert_int_equal(model_forward(r.ctx, r.kv, &b, 1, NULL, NULL), 0);
        it = (specdec_prefill_item){.seq = seqs[1],
                                    .pos = a,
                                    .n_tokens = n,
                                    .prompt = toks,
                                    .n_prompt = P,
                                    .h0 = r.h0,
                                    .depth = 2,
                                    .hand = hand[1]};
        assert_int_equal(specdec_prefill(r.sd, r.ctx, r.kv, &it, 1), 0);
    }
    assert_memory_equal(hand[0], hand[1], 2 * (size_t)D * sizeof(float));
    int nb;
    const int *b0 = kvcache_seq_blocks(r.kv, seqs[0], &nb);
    const int *b1 = kvcache_seq_blocks(r.kv, seqs[1], NULL);
    for (int layer = c->n_layer; layer < c->n_layer + 2; layer++) {
        int upto = layer == c->n_layer ? P - 1 : P - 2; /* positions the prefill fills */
        for (int pos = 0; pos < upto; pos++) {
            const float *k0 =
                kvcache_block_data(r.kv, layer, b0[pos / 16]) + (size_t)(pos % 16) * kvd;
            const float *k1 =
                kvcache_block_data(r.kv, layer, b1[pos / 16]) + (size_t)(pos % 16) * kvd;
            assert_memory_equal(k0, k1, (size_t)kvd * sizeof(float));
        }
    }
    rig_free(&r);
}

/* Sampled output with MTP has the main model's distribution: the first three generated
 * tokens of many seeded samples at temperature 1, at depth 0 and at depth 2, against the
 * exact probabilities (chi-square over the NCAT likeliest 3-token outcomes plus "other",
 * at p ~ 1e-4), and the total-variation distance between the two empirical distributions
 * (within twice its expected value under equal distributions). The prompt "Lily and" has
 * a spread continuation (the 40 likeliest outcomes hold ~76% of the mass) on which drafts
 * are often rejected (~0.65 drafts accepted per step), so the residual draws are
 * exercised as much as the acceptances. */
#define NSAMP 8192
#define NCAT 40

typedef struct {
    int t[3];
    double p;
} tri;

static void test_specdec_sampling_distribution(void **state)
{
    const model_config *c = model_get_config(g_model);
    const int V = c->vocab_size;
    int prompt[16];
    int np = encode("Lily and", prompt, 16);
    sampler_params sp = {.temperature = 1.0f, .top_p = 1.0f};
    /* exact probabilities of 3-token outcomes, the likeliest NCAT by beam search */
    rig r;
    rig_init(&r, NULL, 4, c->n_ctx);
    float *pr = malloc((size_t)V * sizeof(float)), *tmp = malloc((size_t)V * sizeof(float));
    float *p1 = malloc((size_t)V * sizeof(float));
    assert_non_null(pr);
    assert_non_null(tmp);
    assert_non_null(p1);
    tri cats[NCAT];
    int nc = 0;
    int seq = kvcache_seq_new(r.kv);
    assert_int_equal(kvcache_seq_reserve(r.kv, seq, np + 3), KVCACHE_OK);
    int ctx_t[24];
    memcpy(ctx_t, prompt, (size_t)np * sizeof(int));
    model_seq_batch b = {.seq = seq, .n_tokens = np, .tokens = prompt, .logits = r.logits};
    assert_int_equal(model_forward(r.ctx, r.kv, &b, 1, NULL, NULL), 0);
    memcpy(tmp, r.logits, (size_t)V * sizeof(float));
    sampler_probs(r.smp, &sp, tmp, p1);
    for (int a = 0; a < V; a++) {
        if (p1[a] < 1e-4f)
            continue;
        ctx_t[np] = a;
        b = (model_seq_batch){
            .seq = seq, .pos = np, .n_tokens = 1, .tokens = &ctx_t[np], .logits = r.logits};
        assert_int_equal(model_forward(r.ctx, r.kv, &b, 1, NULL, NULL), 0);
        float p2[512];
        memcpy(tmp, r.logits, (size_t)V * sizeof(float));
        sampler_probs(r.smp, &sp, tmp, p2);
        for (int bb = 0; bb < V; bb++) {
            if ((double)p1[a] * p2[bb] < 1e-4)
                continue;
            ctx_t[np + 1] = bb;
            b = (model_seq_batch){.seq = seq,
                                  .pos = np + 1,
                                  .n_tokens = 1,
                                  .tokens = &ctx_t[np + 1],
                                  .logits = r.logits};
            assert_int_equal(model_forward(r.ctx, r.kv, &b, 1, NULL, NULL), 0);
            memcpy(tmp, r.logits, (size_t)V * sizeof(float));
            sampler_probs(r.smp, &sp, tmp, pr);
            for (int cc = 0; cc < V; cc++) {
                double p = (double)p1[a] * p2[bb] * pr[cc];
                if (p < 2e-4)
                    continue;
                int slot = nc < NCAT ? nc++ : -1;
                if (slot < 0) { /* replace the smallest if this one is larger */
                    int mi = 0;
                    for (int k = 1; k < NCAT; k++)
                        if (cats[k].p < cats[mi].p)
                            mi = k;
                    if (cats[mi].p >= p)
                        continue;
                    slot = mi;
                }
                cats[slot] = (tri){{a, bb, cc}, p};
            }
        }
    }
    rig_free(&r);
    assert_true(nc >= 10);
    double covered = 0;
    for (int k = 0; k < nc; k++)
        covered += cats[k].p;
    /* sample at depth 0 and depth 2 */
    long counts[2][NCAT + 1];
    memset(counts, 0, sizeof(counts));
    rig_init(&r, g_mtp, 64, c->n_ctx);
    int buf[64][4], *outs[64], nout[64];
    const int *prs[64];
    int nps[64], depths[64];
    uint64_t seeds[64];
    dec_stats st2 = {0}, st1h = {0};
    int(*plain)[4] = calloc(NSAMP, sizeof(*plain)); /* depth-0 tokens, by seed */
    assert_non_null(plain);
    for (int i = 0; i < 64; i++) {
        outs[i] = buf[i];
        prs[i] = prompt;
        nps[i] = np;
    }
    /* di 0: depth 0; 1: depth 2, rejection sampling (other seeds); 2: depth 2 with one-hot
     * drafts and the depth-0 seeds, which must give the depth-0 tokens exactly */
    for (int di = 0; di < 3; di++) {
        specdec_set_sampling(r.sd, di == 2 ? SPECDEC_SAMPLE_ONEHOT : SPECDEC_SAMPLE_REJECTION);
        for (int s0 = 0; s0 < NSAMP; s0 += 64) {
            for (int i = 0; i < 64; i++) {
                depths[i] = di ? 2 : 0;
                seeds[i] = (uint64_t)(1000003 * (di == 1) + s0 + i + 1);
                memset(buf[i], 0xff, sizeof(buf[i]));
            }
            /* 4 tokens, so that the first decode step may draft 2 */
            decode(&r, 64, prs, nps, depths, NULL, &sp, seeds, 4, outs, nout,
                   di == 1   ? &st2
                   : di == 2 ? &st1h
                             : NULL);
            for (int i = 0; i < 64; i++) {
                if (di == 0)
                    memcpy(plain[s0 + i], buf[i], sizeof(buf[i]));
                if (di == 2) {
                    assert_memory_equal(plain[s0 + i], buf[i], sizeof(buf[i]));
                    continue;
                }
                int k = 0;
                if (nout[i] >= 3)
                    for (; k < nc; k++)
                        if (!memcmp(cats[k].t, buf[i], 3 * sizeof(int)))
                            break;
                counts[di][nout[i] >= 3 ? k : nc]++;
            }
        }
    }
    free(plain);
    print_message("depth 2 with one-hot drafts: the depth-0 tokens; %.2f drafts accepted per "
                  "step\n",
                  (double)st1h.accepted / (double)st1h.steps);
    rig_free(&r);
    double e[NCAT + 1];
    for (int k = 0; k < nc; k++)
        e[k] = cats[k].p;
    e[nc] = 1.0 - covered;
    double tv = 0;
    for (int k = 0; k <= nc; k++)
        tv += fabs((double)counts[0][k] - (double)counts[1][k]) / NSAMP;
    tv /= 2;
    for (int di = 0; di < 2; di++) {
        int df;
        double s = chi2(counts[di], e, nc + 1, NSAMP, &df);
        print_message("depth %d: %d samples, %d categories (%.1f%% of the mass), chi2 %.1f "
                      "(df %d, limit %.1f)\n",
                      di * 2, NSAMP, nc + 1, 100 * covered, s, df, chi2_crit(df));
        assert_true(s < chi2_crit(df));
    }
    print_message("TV distance depth 0 vs 2: %.4f; depth 2 accepted %.2f drafts per step\n", tv,
                  (double)st2.accepted / (double)st2.steps);
    /* E|X - Y| / N for two binomial counts ~ sqrt(2 p (1 - p) / N) sqrt(2 / pi) */
    double etv = 0;
    for (int k = 0; k <= nc; k++)
        etv += 0.5 * sqrt(4.0 * e[k] * (1.0 - e[k]) / (M_PI * NSAMP));
    print_message("TV expected under equal distributions: %.4f\n", etv);
    assert_true(tv < 2 * etv);
    assert_true(st2.accepted > 0);
    free(pr);
    free(tmp);
    free(p1);
}

// --- the controller

static void test_specdec_ctl(void **state)
{
    specdec_ctl c;
    float good[2] = {0.9f, 0.9f}, bad[2] = {0.05f, 0.05f};
    specdec_ctl_init(&c, 2, good);
    /* costs: cheap verify at batch 1, three times the plain step at batch 64 */
    specdec_costs costs = {.n = 2, .batch = {1, 64}};
    double r1[3] = {1, 1.1, 1.2}, r64[3] = {1, 2.0, 3.0};
    memcpy(costs.ratio[0], r1, sizeof(r1));
    memcpy(costs.ratio[1], r64, sizeof(r64));
    assert_true(fabs(specdec_cost(&costs, 32, 2) - (1.2 + 1.8 * 31.0 / 63.0)) < 1e-9);
    assert_true(fabs(specdec_cost(&costs, 200, 1) - 2.0) < 1e-9);
    assert_true(fabs(specdec_cost(NULL, 1, 2) - 1.2) < 1e-9);
    assert_true(fabs(specdec_ctl_expected(&c, 2) - (1 + 0.9 + 0.81)) < 1e-6);
    assert_int_equal(specdec_ctl_depth(&c, &costs, 1), 2);
    /* at batch 64: E_2 / 3 = 0.90 < E_1 / 2 = 0.95 < E_0 = 1: plain, probing at 2 once in
     * SPECDEC_PROBE_STEPS steps */
    int n2 = 0;
    for (int i = 0; i < 4 * SPECDEC_PROBE_STEPS; i++)
        n2 += specdec_ctl_depth(&c, &costs, 64) == 2;
    assert_int_equal(c.depth, 0);
    assert_int_equal(n2, 4);
    /* hysteresis: a gain under 5% does not move it */
    specdec_costs flat = {.n = 1, .batch = {1}};
    double rf[3] = {1, 1.9 / 1.03, 10};
    memcpy(flat.ratio[0], rf, sizeof(rf));
    specdec_ctl_init(&c, 1, good); /* depth 1: E_1 = 1.9, cost 1.9 / 1.03 -> gain 3% */
    c.depth = 0;
    c.probe_in = 1000;
    assert_int_equal(specdec_ctl_depth(&c, &flat, 1), 0);
    flat.ratio[0][1] = 1.9 / 1.08; /* 8%: it moves */
    assert_int_equal(specdec_ctl_depth(&c, &flat, 1), 1);
    /* acceptance falls: depth 0 even at batch 1 */
    specdec_ctl_init(&c, 2, good);
    for (int i = 0; i < 100; i++)
        specdec_ctl_observe(&c, 2, 0);
    assert_true(c.acc[0] < 0.01);
    assert_int_equal(specdec_ctl_depth(&c, &costs, 1), 0);
    /* and recovers (the probes keep observing) */
    for (int i = 0; i < 100; i++)
        specdec_ctl_observe(&c, 2, 2);
    assert_true(c.acc[0] > 0.99 && c.acc[1] > 0.9);
    assert_int_equal(specdec_ctl_depth(&c, &costs, 1), 2);
    /* a2 counts only steps where d1 was accepted */
    specdec_ctl_init(&c, 2, bad);
    for (int i = 0; i < 200; i++)
        specdec_ctl_observe(&c, 2, 0);
    assert_true(fabs(c.acc[1] - 0.05) < 1e-9);
    specdec_ctl_init(&c, 0, NULL);
    assert_int_equal(specdec_ctl_depth(&c, &costs, 1), 0);
    /* the context: the long context's ratios where measured, linear in between, clamped */
    costs.ctx_short = 16;
    costs.ctx_long = 400;
    costs.has_long[0] = 1;
    double l1[3] = {1, 1.5, 3.0};
    memcpy(costs.ratio_long[0], l1, sizeof(l1));
    assert_true(fabs(specdec_cost_at(&costs, 1, 16, 2) - 1.2) < 1e-9);
    assert_true(fabs(specdec_cost_at(&costs, 1, 400, 2) - 3.0) < 1e-9);
    assert_true(fabs(specdec_cost_at(&costs, 1, 208, 2) - 2.1) < 1e-9);
    assert_true(fabs(specdec_cost_at(&costs, 1, 5000, 1) - 1.5) < 1e-9);
    assert_true(fabs(specdec_cost_at(&costs, 1, 0, 1) - 1.1) < 1e-9);
    assert_true(fabs(specdec_cost_at(&costs, 1, -1, 2) - 1.2) < 1e-9);
    assert_true(fabs(specdec_cost_at(&costs, 1, 400, 0) - 1.0) < 1e-9);
    /* batch 64 has no long measurement: its short ratio at every context */
    assert_true(fabs(specdec_cost_at(&costs, 64, 400, 2) - 3.0) < 1e-9);
    assert_true(fabs(specdec_cost_at(&costs, 32, 400, 2) - 3.0) < 1e-9);
    /* E_2 = 2.71, E_1 = 1.9: depth 2 at a short context, 1 at a long one (E_1 / 1.5 = 1.27
     * > E_2 / 3 = 0.90), and specdec_ctl_depth is the short context's */
    specdec_ctl_init(&c, 2, good);
    c.probe_in = 1000;
    assert_int_equal(specdec_ctl_depth_at(&c, &costs, 1, 16), 2);
    assert_int_equal(specdec_ctl_depth_at(&c, &costs, 1, 400), 1);
    assert_int_equal(specdec_ctl_depth(&c, &costs, 1), 2);
}

/* The measured costs are sane: ratios >= ~1 and growing with depth at larger batches. */
/* specdec profiling: off by default (nothing counted); on: every step call counted, the
 * three passes' shares positive, the sum within the decode's wall time, the output the
 * plain greedy one; off again: the figures kept; on again: from zero. */
static double wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static void test_specdec_profile(void **state)
{
    const model_config *c = model_get_config(g_model);
    enum { NG = 40 };
    encode_prompts();
    sampler_params sp = {.temperature = 0.0f, .top_p = 1.0f};
    int two = 2;
    const int *pr = g_prompt_toks[1];
    int ref[NG], nref = plain_greedy(pr, g_prompt_n[1], NG, ref);
    int a[NG], *oa = a, na;
    rig r;
    rig_init(&r, g_mtp, 4, c->n_ctx);
    specdec_profile p;
    dec_stats st = {0};
    decode(&r, 1, &pr, &g_prompt_n[1], &two, NULL, &sp, NULL, NG, &oa, &na, &st);
    specdec_get_profile(r.sd, &p);
    assert_int_equal(p.steps, 0);
    assert_true(p.mod1_ms == 0.0 && p.mod2_ms == 0.0 && p.verify_ms == 0.0 && p.rest_ms == 0.0);

    specdec_set_profiling(r.sd, 1);
    dec_stats st2 = {0};
    double t0 = wall_ms();
    decode(&r, 1, &pr, &g_prompt_n[1], &two, NULL, &sp, NULL, NG, &oa, &na, &st2);
    double wall = wall_ms() - t0;
    assert_int_equal(na, nref);
    assert_memory_equal(a, ref, (size_t)nref * sizeof(int));
    specdec_get_profile(r.sd, &p);
    assert_int_equal(p.steps, st2.steps); /* one sequence: one item per call */
    assert_true(st2.accepted > 0);
    assert_true(p.mod1_ms > 0 && p.mod2_ms > 0 && p.verify_ms > 0 && p.rest_ms >= 0);
    assert_true(p.mod1_ms + p.mod2_ms + p.verify_ms + p.rest_ms <= wall);

    specdec_set_profiling(r.sd, 0);
    decode(&r, 1, &pr, &g_prompt_n[1], &two, NULL, &sp, NULL, NG, &oa, &na, NULL);
    specdec_profile p2;
    specdec_get_profile(r.sd, &p2);
    assert_memory_equal(&p2, &p, sizeof(p));
    specdec_set_profiling(r.sd, 1);
    specdec_get_profile(r.sd, &p2);
    assert_int_equal(p2.steps, 0);
    assert_true(p2.verify_ms == 0.0);
    specdec_set_profiling(r.sd, 0);
    rig_free(&r);
}

static void test_specdec_measure(void **state)
{
    const model_config *c = model_get_config(g_model);
    rig r;
    rig_init(&r, g_mtp, 16, c->n_ctx);
    int free0 = kvcache_n_free_blocks(r.kv);
    specdec_costs costs;
    assert_int_equal(specdec_measure_costs(r.sd, r.ctx, r.kv, 16, 1000.0, &costs), 0);
    assert_int_equal(kvcache_n_free_blocks(r.kv), free0);
    assert_int_equal(costs.n, 5); /* 1, 2, 4, 8, 16 */
    for (int k = 0; k < costs.n; k++) {
        print_message("batch %2d: plain %.3f ms, depth 1 x%.2f, depth 2 x%.2f\n", costs.batch[k],
                      costs.plain_ms[k], costs.ratio[k][1], costs.ratio[k][2]);
        assert_true(costs.ratio[k][0] == 1.0);
        assert_true(costs.ratio[k][1] > 0.3 && costs.ratio[k][2] > 0.3);
        /* and at the long context for the small batches (the rig has room) */
        assert_int_equal(costs.has_long[k], costs.batch[k] <= SPECDEC_COST_LONG_MAX_BATCH);
        if (!costs.has_long[k])
            continue;
        print_message("   context %d: plain %.3f ms, depth 1 x%.2f, depth 2 x%.2f\n",
                      costs.ctx_long, costs.plain_ms_long[k], costs.ratio_long[k][1],
                      costs.ratio_long[k][2]);
        assert_true(costs.ratio_long[k][0] == 1.0);
        assert_true(costs.ratio_long[k][1] > 0.3 && costs.ratio_long[k][2] > 0.3);
    }
    assert_int_equal(costs.ctx_short, 16);
    assert_int_equal(costs.ctx_long, SPECDEC_COST_CTX_LONG);
    rig_free(&r);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mtp_load),
        cmocka_unit_test(test_mtp_load_errors),
        cmocka_unit_test(test_mtp_in_model_file),
        cmocka_unit_test(test_mtp_reference),
        cmocka_unit_test(test_mtp_draft_vocab),
        cmocka_unit_test(test_mtp_packed_modules),
        cmocka_unit_test(test_specdec_rule),
        cmocka_unit_test(test_specdec_greedy_equivalence),
        cmocka_unit_test(test_specdec_deferred_catchup),
        cmocka_unit_test(test_specdec_prefill_chunked),
        cmocka_unit_test(test_specdec_state_migration),
        cmocka_unit_test(test_specdec_sampling_distribution),
        cmocka_unit_test(test_specdec_ctl),
        cmocka_unit_test(test_specdec_logprobs),
        cmocka_unit_test(test_specdec_measure),
        cmocka_unit_test(test_specdec_profile),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("mtp", tests, group_setup, group_teardown);
}
