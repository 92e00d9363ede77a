/* compute: see compute.h. */
#include "compute.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "protocol.h"

/* start-up measurement: batch sizes whose plain step is slower are not measured */
#define COST_MAX_STEP_MS 250.0

// --- emulated accelerator

/* Check --emulate and load its preset (logs the mode). Returns 0, or -1 on an unknown
 * preset (logged with the known ones). */
static int emu_setup(worker_compute *cp, const char *preset, int kv_pad)
{
    cp->emu_on = 0;
    cp->emu_kv_pad = kv_pad;
    if (!preset || !*preset)
        return 0;
    if (costmodel_preset(preset, &cp->emu) < 0) {
        char names[256] = "";
        for (const char *const *n = costmodel_preset_names(); *n; n++) {
            strncat(names, names[0] ? ", " : "", sizeof(names) - strlen(names) - 1);
            strncat(names, *n, sizeof(names) - strlen(names) - 1);
        }
        log_error("--emulate '%s': unknown preset (presets: %s)", preset, names);
        return -1;
    }
    cp->emu_on = 1;
    log_warn("EMULATED accelerator '%s': prefill and decode times are the cost model's "
             "(sleeps), not measurements; tokens come from the real model; KV transfers %s "
             "%llu bytes per token; the KV cache "
             "holds the emulated accelerator's %.0f tokens (token scale %g) unless --kv-blocks is "
             "set",
             cp->emu.name,
             kv_pad ? "are padded with zeros to the emulated model's"
                    : "carry the real model's KV only (--emulate-kv-pad false), not the emulated",
             (unsigned long long)costmodel_kv_bytes_per_token(&cp->emu),
             costmodel_kv_capacity_tokens(&cp->emu),
             cp->emu.token_scale > 0 ? cp->emu.token_scale : 1);
    return 0;
}

uint64_t compute_kv_pad_bytes_per_token(const worker_compute *cp)
{
    return cp->emu_on && cp->emu_kv_pad ? (uint64_t)costmodel_kv_bytes_per_token(&cp->emu) : 0;
}

/* Sleep until t0_us + ms (monotonic, proto_now_us). */
static void pad_until(int64_t t0_us, double ms)
{
    int64_t end = t0_us + (int64_t)(ms * 1000.0);
    for (;;) {
        int64_t left = end - proto_now_us();
        if (left <= 0)
            return;
        struct timespec ts = {.tv_sec = left / 1000000, .tv_nsec = (left % 1000000) * 1000};
        if (nanosleep(&ts, NULL) == 0)
            return;
        if (errno != EINTR)
            return;
    }
}

void compute_pad_prefill(const worker_compute *cp, const model_seq_batch *b, int m, int64_t t0_us)
{
    if (!cp->emu_on || m <= 0)
        return;
    double tokens = 0, pairs = 0;
    for (int i = 0; i < m; i++) {
        tokens += b[i].n_tokens;
        pairs += costmodel_attn_pairs(b[i].n_tokens, b[i].pos);
    }
    pad_until(t0_us, costmodel_prefill_ms(&cp->emu, tokens, pairs));
}

void compute_pad_decode(const worker_compute *cp, const specdec_item *items, int n, int64_t t0_us)
{
    if (!cp->emu_on || n <= 0)
        return;
    double ctx = 0;
    for (int i = 0; i < n; i++)
        ctx += items[i].pos + 1;
    pad_until(t0_us, costmodel_decode_step_ms(&cp->emu, n, ctx));
}

// --- MTP modules

/* Find and load the MTP modules per --mtp (before the KV cache exists: it gets n_mtp extra
 * layers). depth_set is --mtp-depth (0 = off). Returns 0 (cp->mtp may stay NULL: none), or
 * -1 after logging a bad file. */
static int mtp_setup_load(worker_compute *cp, const worker_settings *set, long long depth_set)
{
    const char *mode = set->mtp_setting && *set->mtp_setting ? set->mtp_setting : "auto";
    char err[512], path[1024];
    cp->mtp = NULL;
    cp->n_mtp = 0;
    if (strcmp(mode, "none") == 0 || depth_set == 0) {
        log_info("MTP: off (%s)", strcmp(mode, "none") == 0 ? "--mtp none" : "--mtp-depth 0");
        return 0;
    }
    if (strcmp(mode, "auto") == 0) {
        if (mtp_model_has_modules(cp->model)) {
            cp->mtp = mtp_load(cp->model, NULL, err, sizeof(err));
        } else if (mtp_default_path(cp->model, set->model_path, path, sizeof(path)) == 0) {
            cp->mtp = mtp_load(cp->model, path, err, sizeof(err));
        } else {
            log_info("MTP: the model has no modules and no side file was found "
                     "(models/mtp/%s-mtp.gguf): decoding without speculation",
                     cp->mc->name);
            return 0;
        }
    } else {
        cp->mtp = mtp_load(cp->model, mode, err, sizeof(err));
    }
    if (!cp->mtp) {
        log_error("cannot load the MTP modules: %s", err);
        return -1;
    }
    cp->n_mtp = mtp_n_modules(cp->mtp);
    float rate[2];
    int has_rate = mtp_acceptance_rate(cp->mtp, rate) == 0;
    log_info("MTP: %d modules from %s (fingerprint %016llx; trainer's acceptance %s%.3f, "
             "%.3f)",
             cp->n_mtp, mtp_path(cp->mtp), (unsigned long long)mtp_fingerprint(cp->mtp),
             has_rate ? "" : "unknown ", has_rate ? rate[0] : 0.0, has_rate ? rate[1] : 0.0);
    return 0;
}

/* With the model context ready: the draft-and-verify state, the controller's prior, and
 * (with modules) the verify-cost measurement. Returns 0, -1 (out of memory) or -2 (a bad
 * --mtp-sampling). */
static int mtp_setup_state(worker_compute *cp, const worker_settings *set, long long depth_set)
{
    cp->mtp_depth = cp->mtp ? (depth_set < 0                ? cp->n_mtp
                               : (int)depth_set < cp->n_mtp ? (int)depth_set
                                                            : cp->n_mtp)
                            : 0;
    cp->mtp_adaptive = set->mtp_adaptive;
    cp->sd = specdec_new(cp->model, cp->mtp, cp->max_items, cp->max_items, cp->max_tokens);
    if (!cp->sd) {
        log_error("out of memory allocating the MTP state");
        return -1;
    }
    /* each sequence's controller starts from the trainer's acceptance (else 0.6, 0.6) */
    cp->sd_prior[0] = cp->sd_prior[1] = 0.6f;
    if (cp->mtp)
        mtp_acceptance_rate(cp->mtp, cp->sd_prior);
    const char *smode = set->mtp_sampling && *set->mtp_sampling ? set->mtp_sampling : "rejection";
    if (strcmp(smode, "onehot") == 0) {
        specdec_set_sampling(cp->sd, SPECDEC_SAMPLE_ONEHOT);
    } else if (strcmp(smode, "rejection") != 0) {
        log_error("invalid --mtp-sampling '%s': want rejection or onehot", smode);
        return -2;
    }
    if (!cp->mtp || cp->mtp_depth == 0)
        return 0; /* mtp_setup_load logged why */
    /* the verify cost at a few batch sizes, on this machine, for the controllers (every
     * role: a prefill worker may be switched to decoding) */
    int max_b = cp->max_items < 64 ? cp->max_items : 64;
    if (!cp->mtp_adaptive) {
        log_info("MTP: depth %d, fixed (--mtp-adaptive off), %s sampling", cp->mtp_depth, smode);
        return 0;
    }
    if (specdec_measure_costs(cp->sd, cp->mctx, cp->kv, max_b, COST_MAX_STEP_MS, &cp->sd_costs) <
        0) {
        log_warn("MTP: could not measure the verify cost; assuming 1 + 0.1 per draft");
    } else {
        for (int k = 0; k < cp->sd_costs.n; k++) {
            log_info("MTP cost at batch %d: plain step %.2f ms; depth 1 x%.2f, depth 2 x%.2f",
                     cp->sd_costs.batch[k], cp->sd_costs.plain_ms[k], cp->sd_costs.ratio[k][1],
                     cp->sd_costs.ratio[k][2]);
            if (cp->sd_costs.has_long[k])
                log_info("MTP cost at batch %d, context %d: plain step %.2f ms; depth 1 x%.2f, "
                         "depth 2 x%.2f",
                         cp->sd_costs.batch[k], cp->sd_costs.ctx_long,
                         cp->sd_costs.plain_ms_long[k], cp->sd_costs.ratio_long[k][1],
                         cp->sd_costs.ratio_long[k][2]);
        }
    }
    specdec_ctl prior;
    specdec_ctl_init(&prior, cp->mtp_depth, cp->sd_prior);
    log_info("MTP: depth %d at most, adaptive, %s sampling; sequences start from acceptance "
             "%.3f, %.3f (expected %.2f tokens per step at depth %d)",
             cp->mtp_depth, smode, prior.acc[0], prior.acc[1],
             specdec_ctl_expected(&prior, cp->mtp_depth), cp->mtp_depth);
    return 0;
}

int compute_req_depth(const worker_compute *cp, int mtp_req)
{
    int d = cp->mtp ? cp->mtp_depth : 0;
    if (mtp_req > 0 && mtp_req - 1 < d)
        d = mtp_req - 1;
    return d;
}

// --- set-up

int compute_setup(worker_compute *cp, const worker_settings *set)
{
    memset(cp, 0, sizeof(*cp));
    if (emu_setup(cp, set->emulate, set->emulate_kv_pad) < 0)
        return -2;
    /* the cost model emits one token per sequence per step: no MTP when emulated */
    long long depth_set = cp->emu_on ? 0 : set->mtp_depth_set;
    char err[512];
    cp->model = model_load(set->model_path, err, sizeof(err));
    if (!cp->model) {
        log_error("cannot load the model: %s", err);
        return -1;
    }
    cp->mc = model_get_config(cp->model);
    const model_config *mc = cp->mc;
    if (mtp_setup_load(cp, set, depth_set) < 0)
        return -1;
    cp->block_size = (int)set->block_size;
    int per_seq = (mc->n_ctx + cp->block_size - 1) / cp->block_size;
    long long n_blocks = set->kv_blocks ? set->kv_blocks : set->max_seqs * per_seq;
    if (cp->emu_on && !set->kv_blocks) {
        /* the emulated accelerator's KV capacity for the emulated model, in blocks */
        double cap = costmodel_kv_capacity_tokens(&cp->emu);
        n_blocks = (long long)(cap / cp->block_size);
        if (n_blocks < 1 || n_blocks > INT_MAX) {
            log_error("--emulate '%s': a KV capacity of %.0f tokens is %lld blocks of %d "
                      "tokens (want 1 .. %d; --kv-blocks sets them)",
                      cp->emu.name, cap, n_blocks, cp->block_size, INT_MAX);
            return -2;
        }
        log_info("KV cache sized to the emulated accelerator's capacity: %.0f tokens, %lld "
                 "blocks of %d tokens (--kv-blocks overrides it)",
                 cap, n_blocks, cp->block_size);
    }
    kvcache_params kp = {.n_layer = mc->n_layer + cp->n_mtp, /* MTP modules' K/V last */
                         .n_kv_head = mc->n_kv_head,
                         .head_dim = mc->head_dim,
                         .block_size = cp->block_size,
                         .n_blocks = (int)n_blocks,
                         .max_seqs = (int)set->max_seqs,
                         .max_seq_len = mc->n_ctx};
    cp->kv = kvcache_new(&kp);
    if (!cp->kv) {
        log_error("cannot allocate the KV cache (%lld blocks of %d tokens)", n_blocks,
                  kp.block_size);
        return -1;
    }
    cp->max_items = (int)set->max_seqs;
    /* Prompts run in chunks of at most max_batch_tokens per pass (prefill_worker/), so the
     * scratch is sized for a batch, not for the context. */
    cp->max_tokens = (int)set->max_batch_tokens;
    if (cp->max_tokens < cp->max_items)
        cp->max_tokens = cp->max_items;
    model_ctx_params mp = model_ctx_default_params();
    mp.max_tokens = cp->max_tokens;
    mp.n_threads = (int)set->threads;
    cp->mctx = model_ctx_new_params(cp->model, &mp);
    cp->sampler = sampler_new(mc->vocab_size);
    if (!cp->mctx || !cp->sampler) {
        log_error("out of memory allocating the model's buffers");
        return -1;
    }
    int rc = mtp_setup_state(cp, set, depth_set);
    if (rc < 0)
        return rc;
    log_info("model %s: %s, %d layers, dim %d, vocab %d, context %d, fingerprint %016llx",
             set->model_path, mc->name, mc->n_layer, mc->dim, mc->vocab_size, mc->n_ctx,
             (unsigned long long)mc->fingerprint);
    log_info("KV cache: %d blocks of %d tokens (%zu bytes per block per layer), %d sequences",
             kp.n_blocks, kp.block_size, kvcache_block_bytes(cp->kv), kp.max_seqs);
    log_info("compute: %d threads (%s), kernels %s; prefill chunks of %lld tokens, batches of "
             "%d tokens",
             model_ctx_n_threads(cp->mctx), set->threads ? "--threads" : "CPUs available",
             model_ctx_kernel_name(cp->mctx), set->prefill_chunk_tokens, cp->max_tokens);
    return 0;
}

void compute_teardown(worker_compute *cp)
{
    sampler_destroy(&cp->sampler);
    specdec_destroy(&cp->sd);
    mtp_destroy(&cp->mtp);
    model_ctx_destroy(&cp->mctx);
    kvcache_destroy(&cp->kv);
    model_destroy(&cp->model);
}
