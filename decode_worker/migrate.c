/*
 * migrate: live migration of running sequences (docs/scheduler.md "Live role changes"). A
 * decode worker the gateway moves to the prefill role gets one MIGRATE per sequence it
 * decodes, naming a target decode worker. Between two decode steps the sequence pauses
 * (DREQ_MIGRATING: it leaves the batch), kvx sends every layer's blocks of its pos tokens
 * and KV_END with the token to feed next and the sampler state; KV_BEGIN "gen" tells the
 * target how far the attempt got, so it continues at the next token index (the receiving
 * side is decode.c's on_accepted). A sequence drafting with MTP takes its modules' KV
 * layers and their whole per-sequence state along (specdec_seq_export), so the target
 * drafts on where this worker stopped; a target without the same modules drops them and
 * decodes plainly (greedy output is the same either way).
 */
#include <stdlib.h>
#include <string.h>

#include "decode_internal.h"
#include "log.h"

/* Move running request r to the decode worker at dep. Returns 0 when the move started, -1
 * when it could not (r keeps decoding here). */
static int migrate_start(decode_role *d, dreq *r, const char *dep, const char *dpk)
{
    runtime_t *rt = d->rt;
    const worker_compute *cp = &rt->cp;
    if (runtime_open_sender(rt) < 0)
        return -1;
    float *state = NULL;
    int n_state = 0;
    if (r->mtp_depth > 0 && cp->mtp && specdec_seq_max_depth(cp->sd, r->seq) > 0) {
        n_state = specdec_state_floats(cp->sd);
        state = malloc((size_t)n_state * sizeof(float));
        if (!state || specdec_seq_export(cp->sd, r->seq, r->pos, state) < 0) {
            free(state); /* the sequence moves without its module state */
            state = NULL;
            n_state = 0;
        }
    }
    int n_layer = cp->mc->n_layer + (state ? cp->n_mtp : 0);
    kvx_begin_params bp = {.rid = r->rid,
                           .seq = r->seq,
                           .n_kv_tokens = r->pos,
                           .max_tokens = r->max_tokens - r->n_gen + 1,
                           .temperature = r->sp.temperature,
                           .top_p = r->sp.top_p,
                           .top_k = r->sp.top_k,
                           .n_layer = n_layer,
                           .n_mtp = state ? cp->n_mtp : 0,
                           .mtp_fp = state ? mtp_fingerprint(cp->mtp) : 0,
                           .n_hidden = n_state,
                           .mtp = r->mtp_req,
                           .n_gen = r->n_gen,
                           .priority = r->priority,
                           .logprobs = r->logprobs,
                           .server_key = dpk};
    proto_sampling samp;
    if (r->pen) { /* its ids so far, but r->last: KV_END carries that one */
        seqpen_export(r->pen, 1, &samp, &bp.hist, &bp.n_hist);
        bp.samp = &samp;
    }
    uint64_t xfer = kvx_send_begin(rt->sender, dep, &bp);
    if (!xfer) {
        free(state);
        return -1;
    }
    r->xfer = xfer; /* kvx owns r->seq from here */
    r->state = DREQ_MIGRATING;
    r->t_mig_us = proto_now_us();
    snprintf(r->dep, sizeof(r->dep), "%s", dep);
    int ok = 1;
    for (int l = 0; l < n_layer && ok; l++)
        ok = kvx_send_layer(rt->sender, xfer, l) == 0; /* a failure comes as an event */
    if (ok) /* the outcome comes as an event; the state is copied */
        kvx_send_end_mtp(rt->sender, xfer, r->last, r->rng, state, n_state);
    free(state);
    log_rinfo(r->rid, "migrating to %s: %d tokens of KV%s, %d of %d generated", dep, r->pos,
              n_state ? " with the MTP state" : "", r->n_gen, r->max_tokens);
    return 0;
}

/* Carry out a MIGRATE order for r, or log why it stays. */
static void migrate(decode_role *d, dreq *r, const char *dep, const char *dpk)
{
    if (migrate_start(d, r, dep, dpk) < 0) {
        d->rt->mig.n_out_failed++;
        log_rwarn(r->rid, "cannot start migrating to %s: it keeps decoding here", dep);
    }
}

void decode_on_migrate(decode_role *d, const proto_msg *m)
{
    if (d->rt->role != PROTO_ROLE_DECODE) {
        log_rwarn(m->rid, "MIGRATE ignored: only a decode worker migrates its sequences");
        return;
    }
    if (!m->decode_endpoint[0] || strcmp(m->decode_endpoint, d->rt->kv_endpoint) == 0) {
        log_rwarn(m->rid, "MIGRATE ignored: target endpoint '%s' is %s", m->decode_endpoint,
                  m->decode_endpoint[0] ? "this worker" : "empty");
        return;
    }
    dreq *r = decode_req_find(d, m->rid);
    if (r && r->state == DREQ_RUNNING) {
        migrate(d, r, m->decode_endpoint, m->decode_pubkey);
    } else if (r) {
        log_rinfo(m->rid, "MIGRATE ignored: already migrating");
    } else { /* its KV may still be on the way here: carry the order out when it lands */
        d->mig_pending[d->next_mig_pending].rid = m->rid;
        snprintf(d->mig_pending[d->next_mig_pending].dep, PROTO_ENDPOINT_LEN, "%s",
                 m->decode_endpoint);
        snprintf(d->mig_pending[d->next_mig_pending].dpk, PROTO_KEY_LEN, "%s",
                 m->decode_pubkey);
        d->next_mig_pending = (d->next_mig_pending + 1) % DECODE_MIG_PENDING;
    }
}

void decode_migrate_pending(decode_role *d, uint64_t rid)
{
    for (int i = 0; i < DECODE_MIG_PENDING; i++) {
        if (d->mig_pending[i].rid != rid)
            continue;
        d->mig_pending[i].rid = 0; /* the slot is free again */
        dreq *r = decode_req_find(d, rid);
        if (r && r->state == DREQ_RUNNING)
            migrate(d, r, d->mig_pending[i].dep, d->mig_pending[i].dpk);
        return;
    }
}

int decode_on_send_event(void *st, const kvx_event *ev)
{
    decode_role *d = st;
    dreq *r = NULL;
    for (int i = 0; i < d->n_reqs && !r; i++)
        if (d->reqs[i]->xfer == ev->xfer && d->reqs[i]->state == DREQ_MIGRATING)
            r = d->reqs[i];
    if (!r)
        return 0;
    if (ev->type == KVX_EV_DONE) {
        int64_t us = proto_now_us() - r->t_mig_us;
        d->rt->mig.n_out++;
        d->rt->mig.out_us += (uint64_t)us;
        log_rinfo(r->rid, "migrated to %s in %.1f ms", r->dep, (double)us / 1000.0);
        decode_req_remove(d, r); /* aborting a finished transfer is a no-op */
        return 1;
    }
    d->rt->mig.n_out_failed++;
    char msg[PROTO_MESSAGE_LEN];
    snprintf(msg, sizeof(msg), "KV migration to %.100s failed: %.120s", r->dep, ev->message);
    runtime_send_error(d->rt, r->rid, ev->code ? ev->code : PROTO_ERR_INTERNAL, 1, msg);
    decode_req_remove(d, r);
    return 1;
}
