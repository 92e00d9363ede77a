/*
 * worker_mtp: the MTP side of a worker (docs/mtp.md): finding and loading the modules,
 * the draft-and-verify state (specdec), the depth controller and its start-up cost
 * measurement, and the prefill's module pass (module K/V for the prompt, the hand-off
 * state, the module layers handed to kvx). The decode step itself is in worker_sched.c.
 *
 * KV layout: the cache has mc->n_layer + n_mtp layers; module k's K/V is layer
 * mc->n_layer + k - 1, in the same blocks as the sequence's main K/V, so reservations,
 * rollback and transfer treat them like any layer.
 */
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "worker_internal.h"

#define COST_MAX_STEP_MS                                                                           \
    250.0 /* start-up measurement: batch sizes whose plain step is                                 \
           * slower are not measured */

int wmtp_load(worker_t *w)
{
    const char *set = w->mtp_setting && *w->mtp_setting ? w->mtp_setting : "auto";
    char err[512], path[1024];
    w->mtp = NULL;
    w->n_mtp = 0;
    if (strcmp(set, "none") == 0 || w->mtp_depth_set == 0) {
        log_info("MTP: off (%s)", strcmp(set, "none") == 0 ? "--mtp none" : "--mtp-depth 0");
        return 0;
    }
    if (strcmp(set, "auto") == 0) {
        if (mtp_model_has_modules(w->model)) {
            w->mtp = mtp_load(w->model, NULL, err, sizeof(err));
        } else if (mtp_default_path(w->model, w->model_path, path, sizeof(path)) == 0) {
            w->mtp = mtp_load(w->model, path, err, sizeof(err));
        } else {
            log_info("MTP: the model has no modules and no side file was found "
                     "(models/mtp/%s-mtp.gguf): decoding without speculation",
                     w->mc->name);
            return 0;
        }
    } else {
        w->mtp = mtp_load(w->model, set, err, sizeof(err));
    }
    if (!w->mtp) {
        log_error("cannot load the MTP modules: %s", err);
        return -1;
    }
    w->n_mtp = mtp_n_modules(w->mtp);
    float rate[2];
    int has_rate = mtp_acceptance_rate(w->mtp, rate) == 0;
    log_info("MTP: %d modules from %s (fingerprint %016llx; trainer's acceptance %s%.3f, "
             "%.3f)",
             w->n_mtp, mtp_path(w->mtp), (unsigned long long)mtp_fingerprint(w->mtp),
             has_rate ? "" : "unknown ", has_rate ? rate[0] : 0.0, has_rate ? rate[1] : 0.0);
    return 0;
}

int wmtp_setup(worker_t *w)
{
    const model_config *mc = w->mc;
    int max_tokens = model_ctx_max_tokens(w->mctx);
    w->mtp_depth = w->mtp ? (w->mtp_depth_set < 0               ? w->n_mtp
                             : (int)w->mtp_depth_set < w->n_mtp ? (int)w->mtp_depth_set
                                                                : w->n_mtp)
                          : 0;
    w->sd = specdec_new(w->model, w->mtp, (int)w->max_seqs, w->max_items, max_tokens);
    w->sd_items = calloc((size_t)w->max_items, sizeof(*w->sd_items));
    w->sd_pitems = calloc((size_t)w->max_items, sizeof(*w->sd_pitems));
    if (w->mtp)
        w->hid = malloc((size_t)max_tokens * (size_t)mc->dim * sizeof(float));
    if (!w->sd || !w->sd_items || !w->sd_pitems || (w->mtp && !w->hid)) {
        log_error("out of memory allocating the MTP state");
        return -1;
    }
    /* each sequence's controller starts from the trainer's acceptance (else 0.6, 0.6) */
    w->sd_prior[0] = w->sd_prior[1] = 0.6f;
    if (w->mtp)
        mtp_acceptance_rate(w->mtp, w->sd_prior);
    const char *smode = w->mtp_sampling && *w->mtp_sampling ? w->mtp_sampling : "rejection";
    if (strcmp(smode, "onehot") == 0) {
        specdec_set_sampling(w->sd, SPECDEC_SAMPLE_ONEHOT);
    } else if (strcmp(smode, "rejection") != 0) {
        log_error("invalid --mtp-sampling '%s': want rejection or onehot", smode);
        return -1;
    }
    if (!w->mtp || w->mtp_depth == 0)
        return 0; /* wmtp_load logged why */
    /* the verify cost at a few batch sizes, on this machine, for the controllers (every
     * role: a prefill worker may be switched to decoding) */
    int max_b = w->max_items < 64 ? w->max_items : 64;
    if (!w->mtp_adaptive) {
        log_info("MTP: depth %d, fixed (--mtp-adaptive off), %s sampling", w->mtp_depth, smode);
        return 0;
    }
    if (specdec_measure_costs(w->sd, w->mctx, w->kv, max_b, COST_MAX_STEP_MS, &w->sd_costs) < 0) {
        log_warn("MTP: could not measure the verify cost; assuming 1 + 0.1 per draft");
    } else {
        for (int k = 0; k < w->sd_costs.n; k++)
            log_info("MTP cost at batch %d: plain step %.2f ms; depth 1 x%.2f, depth 2 x%.2f",
                     w->sd_costs.batch[k], w->sd_costs.plain_ms[k], w->sd_costs.ratio[k][1],
                     w->sd_costs.ratio[k][2]);
    }
    specdec_ctl prior;
    specdec_ctl_init(&prior, w->mtp_depth, w->sd_prior);
    log_info("MTP: depth %d at most, adaptive, %s sampling; sequences start from acceptance "
             "%.3f, %.3f (expected %.2f tokens per step at depth %d)",
             w->mtp_depth, smode, prior.acc[0], prior.acc[1],
             specdec_ctl_expected(&prior, w->mtp_depth), w->mtp_depth);
    return 0;
}

void wmtp_teardown(worker_t *w)
{
    specdec_destroy(&w->sd);
    free(w->sd_items);
    free(w->sd_pitems);
    free(w->hid);
    w->sd_items = NULL;
    w->sd_pitems = NULL;
    w->hid = NULL;
    mtp_destroy(&w->mtp);
}

int wmtp_req_depth(const worker_t *w, int mtp_req)
{
    int d = w->mtp ? w->mtp_depth : 0;
    if (mtp_req > 0 && mtp_req - 1 < d)
        d = mtp_req - 1;
    return d;
}

int wmtp_prefill(worker_t *w, int m)
{
    if (!w->mtp)
        return 0;
    int n = 0;
    for (int i = 0; i < m; i++) {
        const wreq *r = w->batch_reqs[i];
        const model_seq_batch *b = &w->batch[i];
        if (r->mtp_depth <= 0 || !b->hidden || !r->hand)
            continue;
        w->sd_pitems[n++] = (specdec_prefill_item){.seq = r->seq,
                                                   .pos = b->pos,
                                                   .n_tokens = b->n_tokens,
                                                   .prompt = r->prompt,
                                                   .n_prompt = r->n_prompt,
                                                   .h0 = b->hidden,
                                                   .depth = r->mtp_depth,
                                                   .hand = r->hand};
    }
    if (n && specdec_prefill(w->sd, w->mctx, w->kv, w->sd_pitems, n) < 0)
        return -1;
    /* the module layers' blocks this chunk completed go with the main layers' */
    for (int i = 0; i < m; i++) {
        const wreq *r = w->batch_reqs[i];
        if (!r->xfer || r->mtp_depth <= 0 || r->blk_upto <= r->blk_sent)
            continue;
        for (int k = 0; k < w->n_mtp; k++)
            kvx_send_layer_blocks(w->sender, r->xfer, mtp_kv_layer(w->mtp, k + 1), r->blk_sent,
                                  r->blk_upto - r->blk_sent);
    }
    return 0;
}
