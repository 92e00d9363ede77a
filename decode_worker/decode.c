/*
 * decode: the decode role (worker/runtime.h). It binds the kv socket, receives each
 * request's KV from a prefill worker (kvtransfer: checked against the model, the layout and
 * the checksums before it is accepted), and decodes every running sequence by continuous
 * batching: one step per loop iteration advances all of them in one forward pass, and
 * sequences join (KV accepted, a local prefill handed over, a migrated sequence arrived)
 * and leave (EOS, max_tokens, the context's end, a cancel, a migration) between steps.
 *
 * The step is MTP2 draft-and-verify (common/engine/specdec.h, docs/mtp.md): each sequence's
 * modules draft up to its depth (its controller lowers it when drafting does not pay at
 * this acceptance and batch size), and one pass of the main model verifies [last, d1, d2]
 * for every sequence at once; greedy output is identical to plain decoding. Each step sends
 * the tokens it emitted to the gateway (TOKENS), in order, up to EOS, max_tokens or the
 * context's end.
 *
 * KV blocks on demand (vLLM's rule, docs/kvtransfer.md "Reservations"): a sequence joins
 * with blocks for its transferred tokens plus the first step's (KV_BEGIN, a local prefill,
 * a migration; new ones leave --kv-watermark free), and before every step each sequence of
 * the batch reserves what this step's verify writes, 1 + its MTP depth tokens. When the
 * cache cannot give them, the step preempts: the newest offline sequence, else the newest
 * online one, is freed and reported as ERROR PREEMPTED (retryable), after the TOKENS it
 * emitted; the gateway re-runs it from prompt + tokens so far with the sampler state of
 * the last TOKENS (recomputation: greedy and seeded output go on unchanged) and counts no
 * failure. The step allocates nothing (the batch arrays are sized at attach).
 *
 * Prefix caching (--prefix-cache, docs/prefix-cache.md "The decode side"): the receiver
 * shares the prompt blocks this cache already holds (KV_BEGIN's hashes, confirmed on the
 * ids) so only the others travel, and registers the received ones; each sequence keeps its
 * token ids, and when it leaves, its full blocks are registered with them, the generated
 * tokens' too when it has no MTP module state (commit_blocks).
 */
#include <stdlib.h>
#include <string.h>

#include "decode_internal.h"
#include "log.h"

// --- request table

dreq *decode_req_find(const decode_role *d, uint64_t rid)
{
    for (int i = 0; i < d->n_reqs; i++)
        if (d->reqs[i]->rid == rid)
            return d->reqs[i];
    return NULL;
}

static dreq *req_add(decode_role *d, uint64_t rid)
{
    if (d->n_reqs == d->cap_reqs) {
        int cap = d->cap_reqs ? d->cap_reqs * 2 : 64;
        dreq **v = realloc(d->reqs, (size_t)cap * sizeof(*v));
        if (!v)
            return NULL;
        d->reqs = v;
        d->cap_reqs = cap;
    }
    dreq *r = calloc(1, sizeof(*r));
    if (!r)
        return NULL;
    r->rid = rid;
    r->seq = -1;
    d->reqs[d->n_reqs++] = r;
    return r;
}

/* Register r's full blocks in the prefix cache before its KV is freed: a later transfer (or,
 * on a mixed worker, a later prompt) that starts with the same tokens shares them. Without
 * module K/V (pfx_la 0) every full block whose tokens are known counts, the generated
 * tokens' too, so a chat's next turn finds its history and the reply; with MTP only the
 * prompt's blocks (registered when the KV arrived, or by the prefill role): the modules'
 * K/V of the last generated positions may still be deferred (specdec's catch-up). */
static void commit_blocks(decode_role *d, dreq *r)
{
    kvcache_t *kv = d->rt->cp.kv;
    if (!r->ids || r->seq < 0 || r->kv_bad || r->pfx_la > 0 || !d->rt->set.prefix_cache)
        return;
    int n = r->n_ids < r->pos ? r->n_ids : r->pos;
    if (kvcache_seq_len(kv, r->seq) > n) /* past pos: KV of tokens not emitted */
        kvcache_seq_set_len(kv, r->seq, n);
    int added = kvcache_seq_commit_prefix(kv, r->seq, r->pfx_seed, 0, r->ids, n);
    if (added > 0)
        log_rdebug(r->rid, "prefix cache: %d more blocks of its %d tokens registered", added, n);
}

void decode_req_remove(decode_role *d, dreq *r)
{
    if (r->xfer) {
        kvx_send_abort(d->rt->sender, r->xfer); /* no-op when the transfer is over */
        r->seq = -1;                            /* kvx owns it and frees it */
    }
    commit_blocks(d, r);
    if (r->seq >= 0)
        kvcache_seq_free(d->rt->cp.kv, r->seq);
    for (int i = 0; i < d->n_reqs; i++) {
        if (d->reqs[i] == r) {
            memmove(&d->reqs[i], &d->reqs[i + 1], (size_t)(d->n_reqs - i - 1) * sizeof(dreq *));
            d->n_reqs--;
            break;
        }
    }
    free(r->hand);
    free(r->ids);
    seqpen_destroy(&r->pen);
    free(r);
}

/* r tracks its ids for the prefix cache from the n prompt ids (borrowed): room for the
 * context. Out of memory just leaves it uncached. */
static void track_ids(const decode_role *d, dreq *r, const int *ids, int n, uint64_t seed,
                      int la)
{
    int cap = d->rt->cp.mc->n_ctx;
    if (!ids || n < 1 || n > cap || !(r->ids = malloc((size_t)cap * sizeof(int))))
        return;
    memcpy(r->ids, ids, (size_t)n * sizeof(int));
    r->n_ids = n;
    r->cap_ids = cap;
    r->pfx_seed = seed;
    r->pfx_la = la;
}

// --- joining

/* A sequence became ours to decode (KV arrived, or the local prefill finished): start it,
 * or end it right away when nothing is left to generate. */
static void start_decode(decode_role *d, dreq *r)
{
    runtime_t *rt = d->rt;
    const worker_compute *cp = &rt->cp;
    r->state = DREQ_RUNNING;
    r->t_ready_us = proto_now_us();
    /* the module state of the first MTP step (the sequence id may have served another
     * request before: always reset) */
    if (r->hand_state) { /* migrated with its module state: drafting goes on */
        if (specdec_seq_import(cp->sd, r->seq, r->pos, r->hand, r->mtp_depth) < 0)
            log_rwarn(r->rid, "the migrated MTP state does not fit the sequence: it decodes "
                              "without drafts");
    } else {
        specdec_seq_start(cp->sd, r->seq, r->pos, r->first, r->hand, r->hand ? r->mtp_depth : 0);
    }
    specdec_ctl_init(&r->ctl, specdec_seq_max_depth(cp->sd, r->seq), cp->sd_prior);
    runtime_timing t = {.queue_us = r->queue_us,
                        .prefill_us = r->prefill_us,
                        .xfer_us = r->xfer_us,
                        .xfer_bytes = r->xfer_bytes};
    if (r->first == cp->mc->eos_id) {
        runtime_send_finish(rt, r->rid, PROTO_FINISH_STOP, &t);
        decode_req_remove(d, r);
        return;
    }
    if (r->n_gen >= r->max_tokens || r->pos >= cp->mc->n_ctx) {
        if (r->n_sent == 0) {
            runtime_send_tokens(rt, r->rid, 0, &r->first, 1, r->rng, &t, NULL);
            r->n_sent = 1;
            runtime_send_finish(rt, r->rid, PROTO_FINISH_LENGTH, NULL);
        } else {
            runtime_send_finish(rt, r->rid, PROTO_FINISH_LENGTH, &t);
        }
        decode_req_remove(d, r);
    }
}

static int tombstoned(const decode_role *d, uint64_t rid)
{
    for (int i = 0; i < DECODE_TOMBSTONES; i++)
        if (d->tombstones[i] == rid)
            return 1;
    return 0;
}

/* A new sequence for rid, replacing an older attempt still here. NULL on out of memory. */
static dreq *req_new(decode_role *d, uint64_t rid)
{
    dreq *old = decode_req_find(d, rid);
    if (old) {
        log_rwarn(rid, "KV for a request already here: the old attempt is dropped");
        decode_req_remove(d, old);
    }
    return req_add(d, rid);
}

/* The receiver accepted a transfer (a prompt's KV, or a migrated sequence). */
static void on_accepted(decode_role *d, const kvx_event *ev)
{
    runtime_t *rt = d->rt;
    const worker_compute *cp = &rt->cp;
    if (tombstoned(d, ev->rid)) { /* cancelled before its KV arrived: nothing to decode */
        log_rinfo(ev->rid, "KV arrived for a cancelled request: freed");
        free(ev->hidden);
        free(ev->samp);
        free(ev->hist);
        free(ev->ids);
        kvcache_seq_free(cp->kv, ev->seq);
        return;
    }
    dreq *r = req_new(d, ev->rid);
    seqpen_t *pen = NULL;
    int has_samp = ev->samp != NULL;
    if (r && has_samp) { /* its ids so far, then the token KV_END carried */
        pen = seqpen_new(ev->samp, ev->hist, ev->n_hist, ev->samp->n_gen,
                         ev->n_hist + 1 + ev->max_tokens + ev->n_gen, cp->mc->eos_id);
        if (pen)
            seqpen_push(pen, ev->first_token);
    }
    free(ev->samp); /* copied into pen */
    free(ev->hist);
    if (r && ev->pfx && ev->n_gen == 0 && ev->n_ids == ev->n_kv_tokens)
        track_ids(d, r, ev->ids, ev->n_ids, ev->pfx_seed, ev->pfx_la);
    free(ev->ids);
    if (!r || (has_samp && !pen)) {
        free(ev->hidden);
        if (r) {
            r->seq = -1;
            decode_req_remove(d, r);
        }
        kvcache_seq_free(cp->kv, ev->seq);
        runtime_send_error(rt, ev->rid, PROTO_ERR_INTERNAL, 1, "out of memory");
        return;
    }
    r->pen = pen;
    r->seq = ev->seq; /* ownership moves from kvx to this request */
    r->pos = ev->n_kv_tokens;
    r->first = ev->first_token;
    r->last = ev->first_token;
    r->n_gen = 1;
    r->n_sent = 0; /* the first TOKENS repeats the first token at index 0 */
    r->max_tokens = ev->max_tokens;
    r->priority = ev->priority;
    r->logprobs = ev->logprobs;
    if (r->logprobs)
        r->n_sent = 1; /* the prefill's TOKENS carried the first token and its logprobs */
    int migrated = ev->n_gen > 0;
    if (migrated) { /* tokens [0, n_gen) were reported by the other worker */
        r->n_gen = ev->n_gen;
        r->n_sent = ev->n_gen;
        r->max_tokens = ev->max_tokens + ev->n_gen - 1;
        d->rt->mig.n_in++;
    }
    r->sp.temperature = ev->temperature;
    r->sp.top_p = ev->top_p > 0 ? ev->top_p : 1.0f;
    r->sp.top_k = ev->top_k;
    r->rng = ev->rng;
    r->mtp_req = ev->mtp;
    r->hand = ev->hidden; /* taken: NULL when the transfer had no (usable) module state */
    r->hand_state = ev->mtp_ok && migrated && ev->n_hidden == specdec_state_floats(cp->sd);
    r->mtp_depth = ev->mtp_ok && !pen &&
                           (ev->n_hidden == specdec_hand_floats(cp->sd) || r->hand_state)
                       ? compute_req_depth(cp, ev->mtp)
                       : 0;
    r->state = DREQ_RUNNING;
    r->xfer_us = migrated ? 0 : ev->xfer_us; /* a move is not the request's hand-off */
    r->queue_us = migrated ? 0 : ev->queue_us;
    r->prefill_us = migrated ? 0 : ev->prefill_us;
    r->xfer_bytes = migrated ? 0 : ev->n_bytes;
    if (ev->first_token >= cp->mc->vocab_size) {
        runtime_send_error(rt, r->rid, PROTO_ERR_PROTOCOL, 1, "first token out of vocabulary");
        decode_req_remove(d, r);
        return;
    }
    log_rdebug(r->rid, "KV received: %d tokens in seq %d (%d blocks were cached here), %d "
               "generated, decoding",
               r->pos, r->seq, ev->have_blocks, r->n_gen);
    uint64_t rid = r->rid;
    start_decode(d, r); /* may end r */
    if (migrated && (r = decode_req_find(d, rid)) != NULL)
        r->t_ready_us = 0;          /* its first step reports no hand-off timing */
    decode_migrate_pending(d, rid); /* ordered to move on while its KV was on the way */
}

/* A mixed worker's own prefill finished: decode it here (runtime_handoff_local). */
static void adopt(void *st, runtime_handoff *h)
{
    decode_role *d = st;
    dreq *r = req_new(d, h->rid);
    if (!r) {
        kvcache_seq_free(d->rt->cp.kv, h->seq);
        free(h->hand);
        free(h->ids);
        seqpen_destroy(&h->pen);
        runtime_send_error(d->rt, h->rid, PROTO_ERR_INTERNAL, 1, "out of memory");
        memset(h, 0, sizeof(*h));
        return;
    }
    r->seq = h->seq;
    r->pos = h->pos;
    r->first = r->last = h->first;
    r->n_gen = 1;
    r->n_sent = 1; /* the prefill reported the first token */
    r->max_tokens = h->max_tokens;
    r->priority = h->priority;
    r->logprobs = h->logprobs;
    r->sp = h->sp;
    r->rng = h->rng;
    r->mtp_req = h->mtp_req;
    r->mtp_depth = h->pen ? 0 : h->mtp_depth;
    r->hand = h->hand;
    r->pen = h->pen;
    if (h->ids && h->n_ids == h->pos)
        track_ids(d, r, h->ids, h->n_ids, h->pfx_seed, h->pfx_la);
    free(h->ids);
    memset(h, 0, sizeof(*h));
    start_decode(d, r);
}

static void process(void *st)
{
    decode_role *d = st;
    kvx_receiver_process(d->receiver);
    kvx_event ev;
    while (kvx_receiver_next_event(d->receiver, &ev)) {
        if (ev.type == KVX_EV_ACCEPTED)
            on_accepted(d, &ev);
        else
            log_rinfo(ev.rid, "incoming KV transfer dropped: %s (%s)", proto_err_str(ev.code),
                      ev.message);
    }
}

// --- orders

static int on_msg(void *st, proto_msg *m)
{
    if (m->type != PROTO_MIGRATE)
        return 0;
    decode_on_migrate(st, m);
    return 1;
}

static int on_cancel(void *st, uint64_t rid)
{
    decode_role *d = st;
    int dropped = 0;
    dreq *r = decode_req_find(d, rid);
    if (r) {
        decode_req_remove(d, r);
        dropped = 1;
    }
    if (kvx_receiver_abort(d->receiver, rid))
        dropped = 1;
    if (dropped) {
        log_rinfo(rid, "cancelled");
    } else { /* its KV may still be on the way here */
        d->tombstones[d->next_tombstone] = rid;
        d->next_tombstone = (d->next_tombstone + 1) % DECODE_TOMBSTONES;
    }
    return dropped;
}

/* A change to prefill was called off or failed: accept KV again. */
static void resume(void *st)
{
    decode_role *d = st;
    kvx_receiver_set_accepting(d->receiver, 1);
}

// --- the step

/* Fail every sequence of the step (the forward pass refused it). */
static void fail_step(decode_role *d, int n)
{
    for (int i = 0; i < n; i++) {
        dreq *r = d->batch_reqs[i];
        log_rerror(r->rid, "decode forward pass failed");
        r->kv_bad = 1; /* its KV is not registered in the prefix cache */
        runtime_send_error(d->rt, r->rid, PROTO_ERR_INTERNAL, 1, "forward pass failed");
        decode_req_remove(d, r);
    }
}

/* Account for item x's drafts (HEARTBEAT "spec", its depth controller). */
static void count_drafts(decode_role *d, dreq *r, const specdec_item *x)
{
    if (x->n_drafted <= 0)
        return;
    d->rt->spec.n_drafts++;
    d->rt->spec.n_draft_tokens += (uint64_t)x->n_drafted;
    d->rt->spec.n_accepted_tokens += (uint64_t)x->n_accepted;
    for (int j = 0; j < x->n_accepted && j < PROTO_SPEC_MAX_POS; j++)
        d->rt->spec.accepted_per_pos[j]++;
    specdec_ctl_observe(&r->ctl, x->n_drafted, x->n_accepted);
}

/* Report what step item x emitted for r, and end r when it is done. */
static void emit(decode_role *d, dreq *r, const specdec_item *x)
{
    runtime_t *rt = d->rt;
    const model_config *mc = rt->cp.mc;
    int out[RUNTIME_MAX_LP_TOKENS], k = 0, reason = 0;
    sampler_logprob lps[RUNTIME_MAX_LP_TOKENS];
    /* the first decode step reports the transfer and its own latency */
    runtime_timing tm = {0}, *tp = NULL;
    if (r->t_ready_us) {
        tm = (runtime_timing){.queue_us = r->queue_us,
                              .prefill_us = r->prefill_us,
                              .xfer_us = r->xfer_us,
                              .xfer_bytes = r->xfer_bytes,
                              .step_us = proto_now_us() - r->t_ready_us};
        tp = &tm;
        r->t_ready_us = 0;
    }
    if (r->n_sent == 0)
        out[k++] = r->first; /* the first TOKENS repeats the prefill's token */
    /* the emitted tokens in order, up to EOS (not sent), max_tokens or the context's end:
     * nothing after them is sent or counted */
    for (int j = 0; j < x->n_tokens && !reason; j++) {
        int t = x->tokens[j];
        if (r->ids && r->n_ids == r->pos && r->n_ids < r->cap_ids)
            r->ids[r->n_ids++] = r->last; /* the token whose KV is at position pos */
        r->pos++; /* the KV of the token before t is in the cache */
        if (t == mc->eos_id) {
            reason = PROTO_FINISH_STOP;
            break;
        }
        if (r->logprobs)
            lps[k] = x->lps[j];
        out[k++] = t;
        r->n_gen++;
        rt->tokens_out++;
        r->last = t;
        if (r->pen) {
            seqpen_push(r->pen, t);
            if (seqpen_is_stop(r->pen, t)) { /* a stop_token_id: sent, then the end */
                reason = PROTO_FINISH_STOP;
                break;
            }
        }
        if (r->n_gen >= r->max_tokens || r->pos >= mc->n_ctx)
            reason = PROTO_FINISH_LENGTH;
    }
    if (k)
        runtime_send_tokens(rt, r->rid, r->n_sent, out, k, r->rng, tp,
                            r->logprobs ? lps : NULL);
    r->n_sent += k;
    if (reason) {
        runtime_send_finish(rt, r->rid, reason, k ? NULL : tp);
        decode_req_remove(d, r);
    }
}

/* specdec_item.penalize: a sequence's sampling controls (ud: its seqpen_t). */
static void penalize(void *ud, sampler_t *s, float *logits)
{
    seqpen_apply(ud, s, logits);
}

/* The sequence to preempt when blocks run out: the newest running offline one, else the
 * newest running online one (vLLM preempts the lowest priority, then the latest arrival). */
static dreq *preempt_victim(const decode_role *d)
{
    for (int pri = 1; pri >= 0; pri--)
        for (int i = d->n_reqs - 1; i >= 0; i--)
            if (d->reqs[i]->state == DREQ_RUNNING && (d->reqs[i]->priority ? 1 : 0) == pri)
                return d->reqs[i];
    return NULL;
}

/* Free r's KV and hand it back to the gateway to be re-run by recomputation (ERROR
 * PREEMPTED, retryable; everything it generated was reported by earlier steps). */
static void preempt(decode_role *d, dreq *r, int need_blocks)
{
    runtime_t *rt = d->rt;
    rt->n_preemptions++;
    int n_off = 0; /* offline sequences still running (0 when an online one goes) */
    for (int i = 0; i < d->n_reqs; i++)
        n_off += d->reqs[i] != r && d->reqs[i]->state == DREQ_RUNNING && d->reqs[i]->priority;
    log_rinfo(r->rid, "preempted (%s, %d tokens in seq %d, %d generated; %d offline running): "
                      "%d KV blocks needed, %d free",
              r->priority ? "offline" : "online", r->pos, r->seq, r->n_gen, n_off, need_blocks,
              kvcache_n_free_blocks(rt->cp.kv));
    runtime_send_error(rt, r->rid, PROTO_ERR_PREEMPTED, 1,
                       "KV cache full: preempted, re-run from its tokens so far");
    decode_req_remove(d, r);
}

/* Before a step: every sequence of the batch (the first max_items running ones) reserves
 * the KV this step writes, pos + 1 + its depth tokens (capped at the context); short of
 * blocks it drafts less, and when even [last] does not fit, sequences are preempted
 * (preempt_victim) until it fits or it was preempted itself. d->step_depth[] gets each
 * one's depth. Returns the batch size b (0 = nothing runs). */
static int reserve_step(decode_role *d)
{
    const worker_compute *cp = &d->rt->cp;
    const int n_ctx = cp->mc->n_ctx;
again:;
    int b = 0;
    for (int i = 0; i < d->n_reqs && b < cp->max_items; i++)
        b += d->reqs[i]->state == DREQ_RUNNING;
    int n = 0;
    for (int i = 0; i < d->n_reqs && n < cp->max_items; i++) {
        dreq *r = d->reqs[i];
        if (r->state != DREQ_RUNNING)
            continue;
        /* its MTP depth: its controller's (its acceptance, the batch size), or its cap
         * when not adaptive; no drafts past max_tokens (a step emits up to depth + 1). A
         * sampled request that gave "mtp_depth" keeps it: its tokens depend on its depths,
         * and the controller's costs are this worker's start-up timings, so a seed would
         * give other tokens on another worker (docs/api.md "seed") */
        int pinned = r->mtp_req > 0 && r->sp.temperature > 0;
        int depth = cp->mtp_adaptive && !pinned
                        ? specdec_ctl_depth_at(&r->ctl, &cp->sd_costs, b, r->pos)
                        : r->ctl.max_depth;
        if (depth > r->max_tokens - r->n_gen - 1)
            depth = r->max_tokens - r->n_gen - 1;
        if (r->pen)
            depth = 0; /* penalties: the verifier's one token per step (docs/mtp.md) */
        if (depth < 0)
            depth = 0;
        int need = r->pos + 1 + depth > n_ctx ? n_ctx : r->pos + 1 + depth;
        kvcache_status_t st = kvcache_seq_reserve(cp->kv, r->seq, need);
        if (st == KVCACHE_NOSPACE && depth > 0) {
            /* drafts are optional: verify only [last] (and the drafts the blocks it has
             * hold) before preempting anyone; greedy output is the same at any depth */
            int need0 = r->pos + 1 > n_ctx ? n_ctx : r->pos + 1;
            st = kvcache_seq_reserve(cp->kv, r->seq, need0);
            int room = kvcache_seq_capacity(cp->kv, r->seq) - r->pos - 1;
            if (st == KVCACHE_OK && room < depth)
                depth = room > 0 ? room : 0;
        }
        if (st == KVCACHE_NOSPACE) {
            dreq *v = preempt_victim(d);
            ASSERT(v != NULL); /* r itself is running */
            int blocks = kvcache_blocks_for(cp->kv, r->pos + 1) -
                         kvcache_blocks_for(cp->kv, kvcache_seq_capacity(cp->kv, r->seq));
            preempt(d, v, blocks);
            goto again; /* the batch changed (its size sets the depths): start over; what
                         * the others reserved stays theirs */
        }
        if (st != KVCACHE_OK) /* beyond the context: the forward pass refuses it */
            depth = 0;
        d->step_depth[n++] = depth;
    }
    return n;
}

/* One decode step over every running sequence. Returns 1 if it did work. */
static int step(void *st)
{
    decode_role *d = st;
    const worker_compute *cp = &d->rt->cp;
    int b = reserve_step(d);
    if (b == 0)
        return 0;
    int n = 0;
    for (int i = 0; i < d->n_reqs && n < cp->max_items; i++) {
        dreq *r = d->reqs[i];
        if (r->state != DREQ_RUNNING)
            continue;
        d->batch_reqs[n] = r;
        d->items[n] = (specdec_item){.seq = r->seq,
                                     .pos = r->pos,
                                     .last = r->last,
                                     .depth = d->step_depth[n],
                                     .sp = &r->sp,
                                     .rng = &r->rng,
                                     .penalize = r->pen ? penalize : NULL,
                                     .penalize_ud = r->pen,
                                     .n_logprobs = r->logprobs};
        n++;
    }
    /* draft with the modules, verify every sequence's [last, d1, d2] in one pass */
    int64_t t_step = proto_now_us();
    if (specdec_step(cp->sd, cp->mctx, cp->kv, d->items, n) < 0) {
        fail_step(d, n);
        return 1;
    }
    compute_pad_decode(cp, d->items, n, t_step); /* --emulate: the cost model's time */
    for (int i = 0; i < n; i++) {
        count_drafts(d, d->batch_reqs[i], &d->items[i]);
        emit(d, d->batch_reqs[i], &d->items[i]);
    }
    return 1;
}

// --- figures

static int has_work(const void *st)
{
    const decode_role *d = st;
    for (int i = 0; i < d->n_reqs; i++)
        if (d->reqs[i]->state == DREQ_RUNNING)
            return 1;
    return 0;
}

static void load(const void *st, proto_msg *hb)
{
    const decode_role *d = st;
    hb->running += d->n_reqs;
    kvx_receiver_get_stats(d->receiver, &hb->kvx_rx);
}

static int idle(const void *st)
{
    const decode_role *d = st;
    return d->n_reqs == 0 && kvx_receiver_n_active(d->receiver) == 0;
}

static int pollitems(void *st, zmq_pollitem_t *items, int cap)
{
    decode_role *d = st;
    if (cap < 1)
        return 0;
    items[0] = (zmq_pollitem_t){.socket = kvx_receiver_socket(d->receiver), .events = ZMQ_POLLIN};
    return 1;
}

static int next_timeout_ms(void *st)
{
    decode_role *d = st;
    return kvx_receiver_next_timeout_ms(d->receiver);
}

// --- attach / detach

static void detach(void **pst)
{
    decode_role *d = pst ? *pst : NULL;
    if (!d)
        return;
    while (d->n_reqs > 0)
        decode_req_remove(d, d->reqs[d->n_reqs - 1]);
    free(d->reqs);
    kvx_receiver_destroy(&d->receiver);
    d->rt->kv_endpoint[0] = 0;
    free(d->batch_reqs);
    free(d->items);
    free(d->step_depth);
    free(d);
    *pst = NULL;
}

/* The kv ROUTER (bound at --kv-bind) and the endpoint REGISTER advertises. Returns 0 or -1
 * (logged). */
static int open_receiver(decode_role *d)
{
    runtime_t *rt = d->rt;
    const worker_compute *cp = &rt->cp;
    kvx_receiver_params rp = kvx_receiver_default_params();
    rp.fingerprint = cp->mc->fingerprint;
    rp.lease_ms = (int)rt->set.lease_ms;
    if (cp->mtp) {
        rp.n_mtp = cp->n_mtp;
        rp.mtp_fp = mtp_fingerprint(cp->mtp);
        rp.n_hidden = specdec_hand_floats(cp->sd);
        rp.n_hidden_mig = specdec_state_floats(cp->sd);
    }
    rp.headroom_tokens = RUNTIME_KV_HEADROOM_TOKENS;
    rp.watermark_blocks = runtime_kv_watermark_blocks(rt);
    rp.curve = rt->curve_on ? &rt->curve : NULL; /* senders admitted by rt's ZAP handler */
    rp.prefix_cache = (int)rt->set.prefix_cache;
    d->receiver = kvx_receiver_new(rt->zctx, cp->kv, rt->set.kv_bind, &rp);
    if (!d->receiver)
        return -1; /* logged */
    const char *adv = rt->set.kv_advertise;
    const char *ep = adv && *adv ? adv : kvx_receiver_endpoint(d->receiver);
    snprintf(rt->kv_endpoint, sizeof(rt->kv_endpoint), "%s", ep);
    if (strstr(rt->kv_endpoint, "//0.0.0.0:") || strstr(rt->kv_endpoint, "//*:"))
        log_warn("kv endpoint %s is not reachable by peers: set --kv-advertise", rt->kv_endpoint);
    log_info("kv socket bound at %s (advertised %s)", kvx_receiver_endpoint(d->receiver),
             rt->kv_endpoint);
    return 0;
}

static void *attach(runtime_t *rt)
{
    decode_role *d = calloc(1, sizeof(*d));
    if (!d) {
        log_error("out of memory attaching the decode role");
        return NULL;
    }
    d->rt = rt;
    d->batch_reqs = calloc((size_t)rt->cp.max_items, sizeof(*d->batch_reqs));
    d->items = calloc((size_t)rt->cp.max_items, sizeof(*d->items));
    d->step_depth = calloc((size_t)rt->cp.max_items, sizeof(*d->step_depth));
    if (!d->batch_reqs || !d->items || !d->step_depth)
        log_error("out of memory allocating the decode batch");
    if (!d->batch_reqs || !d->items || !d->step_depth || open_receiver(d) < 0) {
        void *st = d;
        detach(&st);
        return NULL;
    }
    return d;
}

const runtime_role_ops decode_role_ops = {
    .attach = attach,
    .detach = detach,
    .on_msg = on_msg,
    .on_cancel = on_cancel,
    .on_send_event = decode_on_send_event,
    .pollitems = pollitems,
    .next_timeout_ms = next_timeout_ms,
    .process = process,
    .step = step,
    .has_work = has_work,
    .load = load,
    .idle = idle,
    .resume = resume,
    .adopt = adopt,
};
