/*
 * prefill: the prefill role (worker/runtime.h). It takes PREFILL orders into a FIFO queue,
 * computes the prompts in batches (prefill_batch.c), streams each prompt's KV to the decode
 * worker the gateway named while the layers are computed, samples the first token and
 * reports it. A prompt without a decode endpoint (a mixed worker) is handed to the decode
 * role of this process through the runtime instead.
 *
 * Requests here: PREQ_QUEUED -> PREQ_PREFILLING (admitted: a KV sequence reserved, the
 * transfer begun) -> PREQ_SENDING (computed; the transfer's outcome is awaited) -> gone
 * (KV accepted by the decode worker, handed to the local decode role, or failed: a
 * retryable ERROR lets the gateway run it elsewhere).
 *
 * Role changes: when the worker is ordered to become a decode worker, the prompts not
 * started yet go back to the gateway (retryable UNAVAILABLE, re-routed at once), so only
 * the batch being computed delays the change.
 */
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "prefill_internal.h"

// --- request table

static preq *req_find(const prefill_role *p, uint64_t rid)
{
    for (int i = 0; i < p->n_reqs; i++)
        if (p->reqs[i]->rid == rid)
            return p->reqs[i];
    return NULL;
}

static preq *req_add(prefill_role *p, uint64_t rid)
{
    if (p->n_reqs == p->cap_reqs) {
        int cap = p->cap_reqs ? p->cap_reqs * 2 : 64;
        preq **v = realloc(p->reqs, (size_t)cap * sizeof(*v));
        if (!v)
            return NULL;
        p->reqs = v;
        p->cap_reqs = cap;
    }
    preq *r = calloc(1, sizeof(*r));
    if (!r)
        return NULL;
    r->rid = rid;
    r->seq = -1;
    p->reqs[p->n_reqs++] = r;
    return r;
}

/* r (just added, last) moves ahead of the queued prompts admitted after it, so that a
 * retried or handed-back prompt is not served after prompts that arrived later (the
 * batch takes queued prompts in table order, prefill_step). Prompts being computed keep
 * their places: they are taken first anyway. */
static void queue_by_arrival(prefill_role *p, preq *r)
{
    int i = p->n_reqs - 1;
    while (i > 0 && p->reqs[i - 1]->state == PREQ_QUEUED &&
           p->reqs[i - 1]->t_order_us > r->t_order_us) {
        p->reqs[i] = p->reqs[i - 1];
        i--;
    }
    p->reqs[i] = r;
}

void prefill_req_remove(prefill_role *p, preq *r)
{
    if (r->xfer) {
        kvx_send_abort(p->rt->sender, r->xfer); /* no-op when the transfer is over */
        r->seq = -1;                            /* kvx owns it and frees it */
    }
    if (r->seq >= 0)
        kvcache_seq_free(p->rt->cp.kv, r->seq);
    for (int i = 0; i < p->n_reqs; i++) {
        if (p->reqs[i] == r) {
            memmove(&p->reqs[i], &p->reqs[i + 1], (size_t)(p->n_reqs - i - 1) * sizeof(preq *));
            p->n_reqs--;
            break;
        }
    }
    p->blocked = 0; /* resources were freed: the queue may move again */
    free(r->prompt);
    free(r->hand);
    seqpen_destroy(&r->pen);
    free(r);
}

int prefill_blocked(const prefill_role *p)
{
    return p->blocked && kvcache_n_free_blocks(p->rt->cp.kv) == p->blocked_free;
}

// --- orders

/* PREFILL (validated by the decoder; checked against the model here). */
static void on_prefill(prefill_role *p, proto_msg *m)
{
    runtime_t *rt = p->rt;
    const model_config *mc = rt->cp.mc;
    char why[PROTO_MESSAGE_LEN];
    uint64_t rid = m->rid;
    if (rt->draining || rt->role_target) {
        runtime_send_error(rt, rid, PROTO_ERR_UNAVAILABLE, 1,
                           rt->draining ? "worker is draining" : "worker is changing role");
        return;
    }
    if (m->n_tokens < 1 || m->n_tokens > mc->n_ctx) {
        snprintf(why, sizeof(why), "prompt of %d tokens does not fit the context of %d",
                 m->n_tokens, mc->n_ctx);
        runtime_send_error(rt, rid, PROTO_ERR_BAD_REQUEST, 0, why);
        return;
    }
    for (int i = 0; i < m->n_tokens; i++) {
        if (m->tokens[i] >= mc->vocab_size) {
            snprintf(why, sizeof(why), "token %d at %d is outside the vocabulary of %d",
                     m->tokens[i], i, mc->vocab_size);
            runtime_send_error(rt, rid, PROTO_ERR_BAD_REQUEST, 0, why);
            return;
        }
    }
    int local = m->decode_endpoint[0] == 0;
    if (local && !runtime_decodes_locally(rt)) {
        runtime_send_error(rt, rid, PROTO_ERR_UNAVAILABLE, 1,
                           "no decode endpoint given and this worker does not decode");
        return;
    }
    /* decoded here, the sequence grows block by block as it generates (preempted when the
     * cache runs out): only its prompt and the first step's tokens must fit */
    long long need = local ? (long long)m->n_tokens + RUNTIME_KV_HEADROOM_TOKENS : m->n_tokens;
    if (need > mc->n_ctx)
        need = mc->n_ctx;
    if (kvcache_blocks_for(rt->cp.kv, (int)need) > kvcache_n_blocks(rt->cp.kv)) {
        snprintf(why, sizeof(why), "%lld tokens need more KV blocks than the %d this worker has",
                 need, kvcache_n_blocks(rt->cp.kv));
        runtime_send_error(rt, rid, PROTO_ERR_BAD_REQUEST, 0, why);
        return;
    }
    preq *old = req_find(p, rid);
    if (old) {
        log_rwarn(rid, "PREFILL for a request already here: the old attempt is dropped");
        prefill_req_remove(p, old);
    }
    int queued = 0;
    for (int i = 0; i < p->n_reqs; i++)
        queued += p->reqs[i]->state == PREQ_QUEUED;
    if (queued >= PREFILL_MAX_QUEUE) {
        runtime_send_error(rt, rid, PROTO_ERR_NOSPACE, 1, "prefill queue full");
        return;
    }
    preq *r = req_add(p, rid);
    if (!r) {
        runtime_send_error(rt, rid, PROTO_ERR_INTERNAL, 1, "out of memory");
        return;
    }
    r->state = PREQ_QUEUED;
    r->t_recv_us = proto_now_us();
    r->t_order_us = m->age_us < r->t_recv_us ? r->t_recv_us - m->age_us : 0;
    queue_by_arrival(p, r);
    r->prompt = m->tokens; /* take the decoded array */
    r->n_prompt = m->n_tokens;
    m->tokens = NULL;
    m->n_tokens = 0;
    r->max_tokens = m->max_tokens;
    r->sp.temperature = m->temperature;
    r->sp.top_p = m->top_p > 0 ? m->top_p : 1.0f;
    r->sp.top_k = m->top_k;
    /* a zero state would stall xorshift: derive one from the request id */
    r->rng = m->rng ? m->rng : sampler_seed_state(rid);
    r->priority = m->priority;
    r->logprobs = m->logprobs;
    r->echo = m->echo && m->logprobs;
    r->mtp_req = m->mtp_depth;
    if (m->samp) {
        /* penalties count the prompt and what earlier attempts generated (the last
         * samp.n_gen ids); such a sequence decodes at depth 0 (docs/mtp.md) */
        r->pen = seqpen_new(m->samp, r->prompt, r->n_prompt, m->samp->n_gen,
                            r->n_prompt + r->max_tokens, rt->cp.mc->eos_id);
        if (!r->pen) {
            int bad = m->samp->n_gen > r->n_prompt;
            runtime_send_error(rt, rid, bad ? PROTO_ERR_BAD_REQUEST : PROTO_ERR_INTERNAL, !bad,
                               bad ? "samp: more generated tokens than tokens" : "out of memory");
            prefill_req_remove(p, r);
            return;
        }
        r->mtp_req = 1;
    }
    r->mtp_depth = compute_req_depth(&rt->cp, r->mtp_req);
    if (r->mtp_depth > 0 &&
        !(r->hand = calloc((size_t)specdec_hand_floats(rt->cp.sd), sizeof(float))))
        r->mtp_depth = 0; /* out of memory: this request runs without MTP */
    snprintf(r->dep, sizeof(r->dep), "%s", m->decode_endpoint);
    snprintf(r->dpk, sizeof(r->dpk), "%s", m->decode_pubkey);
    p->blocked = 0;
    log_rdebug(rid, "queued: %d prompt tokens, max_tokens %d, decode at %s", r->n_prompt,
               r->max_tokens, local ? "here" : r->dep);
}

/* MIGRATE (its decode worker is changing role, docs/scheduler.md "Migration"): a prompt
 * still queued here sends its KV to the new decode worker. Returns 0 when the prompt is not
 * here or already started (its KV goes to the old decode worker, which moves it on). */
static int on_migrate(prefill_role *p, const proto_msg *m)
{
    preq *r = req_find(p, m->rid);
    if (!r || r->state != PREQ_QUEUED || !r->dep[0] || !m->decode_endpoint[0])
        return 0;
    log_rinfo(r->rid, "decode worker changed before the prefill started: KV to %s, not %s",
              m->decode_endpoint, r->dep);
    snprintf(r->dep, sizeof(r->dep), "%s", m->decode_endpoint);
    snprintf(r->dpk, sizeof(r->dpk), "%s", m->decode_pubkey);
    return 1;
}

static int on_msg(void *st, proto_msg *m)
{
    if (m->type == PROTO_MIGRATE)
        return on_migrate(st, m);
    if (m->type != PROTO_PREFILL)
        return 0;
    on_prefill(st, m);
    return 1;
}

static int on_cancel(void *st, uint64_t rid)
{
    prefill_role *p = st;
    preq *r = req_find(p, rid);
    if (!r)
        return 0;
    prefill_req_remove(p, r);
    log_rinfo(rid, "cancelled");
    return 1;
}

/* A prefill worker changing role: give back every prompt not started yet. */
static void begin_change(void *st)
{
    prefill_role *p = st;
    int n = 0;
    for (int i = 0; i < p->n_reqs;) {
        preq *r = p->reqs[i];
        if (r->state != PREQ_QUEUED) {
            i++;
            continue;
        }
        runtime_send_error(p->rt, r->rid, PROTO_ERR_UNAVAILABLE, 1,
                           "worker is changing role: prompt handed back before it started");
        prefill_req_remove(p, r); /* shifts the table: i stays */
        n++;
    }
    if (n)
        log_info("role change: %d queued prompts handed back to the gateway", n);
}

/* The outcome of a prompt's KV transfer: it leaves either way; a failure is a retryable
 * ERROR (the gateway runs the request again elsewhere). */
static int on_send_event(void *st, const kvx_event *ev)
{
    prefill_role *p = st;
    preq *r = NULL;
    for (int i = 0; i < p->n_reqs && !r; i++)
        if (p->reqs[i]->xfer == ev->xfer)
            r = p->reqs[i];
    if (!r)
        return 0;
    if (ev->type == KVX_EV_DONE) {
        log_rdebug(r->rid, "KV handed to %s", r->dep);
        prefill_req_remove(p, r); /* aborting a finished transfer is a no-op */
        return 1;
    }
    char msg[PROTO_MESSAGE_LEN];
    snprintf(msg, sizeof(msg), "KV transfer to %.100s failed: %.120s", r->dep, ev->message);
    runtime_send_error(p->rt, r->rid, ev->code ? ev->code : PROTO_ERR_INTERNAL, 1, msg);
    prefill_req_remove(p, r);
    return 1;
}

// --- figures

static int has_work(const void *st)
{
    const prefill_role *p = st;
    for (int i = 0; i < p->n_reqs; i++) {
        const preq *r = p->reqs[i];
        if (r->state == PREQ_PREFILLING || (r->state == PREQ_QUEUED && !prefill_blocked(p)))
            return 1;
    }
    return 0;
}

_Static_assert(PROTO_PFX_MAX_LOOKAHEAD == KVCACHE_MAX_LOOKAHEAD, "summary lookaheads");

/* Fill p->pfx with what the prefix cache holds: one group per MTP depth a prompt may run
 * at here (0 .. the depth served), each with its seed and its blocks' hashes, the blocks
 * kvcache_prefix_blocks lists first (least likely to be evicted) when they are more than
 * PROTO_PFX_MAX_HASHES. */
static void prefix_summary(const prefill_role *p)
{
    const worker_compute *cp = &p->rt->cp;
    proto_prefix_summary *px = p->pfx;
    int n = kvcache_prefix_blocks(cp->kv, p->pfx_hash, p->pfx_seed, p->pfx_la,
                                  PROTO_PFX_MAX_HASHES);
    int depths = (cp->mtp ? cp->mtp_depth : 0) + 1;
    if (depths > PROTO_PFX_MAX_GROUPS)
        depths = PROTO_PFX_MAX_GROUPS;
    px->n_groups = px->n_hashes = 0;
    for (int d = 0; d < depths && d <= PROTO_PFX_MAX_LOOKAHEAD; d++) {
        uint64_t seed = prefill_prefix_seed(cp, d);
        int g = px->n_groups++, k0 = px->n_hashes;
        px->group[g].seed = seed;
        px->group[g].lookahead = d;
        for (int i = 0; i < n; i++)
            if (p->pfx_seed[i] == seed && p->pfx_la[i] == d)
                px->hashes[px->n_hashes++] = p->pfx_hash[i];
        px->group[g].n = px->n_hashes - k0;
    }
}

static void load(const void *st, proto_msg *hb)
{
    const prefill_role *p = st;
    if (p->pfx && p->rt->set.prefix_cache) {
        prefix_summary(p);
        hb->pfx = p->pfx; /* borrowed: send_heartbeat does not free it */
    }
    for (int i = 0; i < p->n_reqs; i++) {
        const preq *r = p->reqs[i];
        if (r->state == PREQ_QUEUED) {
            hb->queued++;
            hb->queued_prompt_tokens += r->n_prompt;
        } else {
            hb->running++;
            if (r->state == PREQ_PREFILLING) /* its prompt tokens still to compute */
                hb->queued_prompt_tokens += r->n_prompt - r->n_done;
        }
    }
}

static int idle(const void *st)
{
    const prefill_role *p = st;
    return p->n_reqs == 0;
}

// --- attach / detach

static void detach(void **pst)
{
    prefill_role *p = pst ? *pst : NULL;
    if (!p)
        return;
    while (p->n_reqs > 0)
        prefill_req_remove(p, p->reqs[p->n_reqs - 1]);
    free(p->reqs);
    free(p->batch);
    free(p->batch_reqs);
    free(p->logits);
    free(p->lp_raw);
    free(p->echo_logits);
    free(p->echo_lps);
    free(p->hid);
    free(p->pitems);
    free(p->pfx);
    free(p->pfx_hash);
    free(p->pfx_seed);
    free(p->pfx_la);
    free(p);
    *pst = NULL;
}

static void *attach(runtime_t *rt)
{
    const worker_compute *cp = &rt->cp;
    prefill_role *p = calloc(1, sizeof(*p));
    if (!p) {
        log_error("out of memory attaching the prefill role");
        return NULL;
    }
    p->rt = rt;
    p->batch = calloc((size_t)cp->max_items, sizeof(*p->batch));
    p->batch_reqs = calloc((size_t)cp->max_items, sizeof(*p->batch_reqs));
    p->logits = malloc((size_t)cp->max_items * (size_t)cp->mc->vocab_size * sizeof(float));
    p->pitems = calloc((size_t)cp->max_items, sizeof(*p->pitems));
    p->lp_raw = malloc((size_t)cp->mc->vocab_size * sizeof(float));
    p->echo_logits = malloc((size_t)PREFILL_ECHO_CHUNK * (size_t)cp->mc->vocab_size * sizeof(float));
    p->echo_lps = calloc(PREFILL_ECHO_CHUNK, sizeof(*p->echo_lps));
    if (cp->mtp)
        p->hid = malloc((size_t)cp->max_tokens * (size_t)cp->mc->dim * sizeof(float));
    if (rt->set.prefix_cache) {
        p->pfx = calloc(1, sizeof(*p->pfx));
        p->pfx_hash = malloc(PROTO_PFX_MAX_HASHES * sizeof(*p->pfx_hash));
        p->pfx_seed = malloc(PROTO_PFX_MAX_HASHES * sizeof(*p->pfx_seed));
        p->pfx_la = malloc(PROTO_PFX_MAX_HASHES * sizeof(*p->pfx_la));
    }
    int pfx_ok = !rt->set.prefix_cache || (p->pfx && p->pfx_hash && p->pfx_seed && p->pfx_la);
    if (!p->batch || !p->batch_reqs || !p->logits || !p->pitems || !p->lp_raw || !p->echo_logits || !p->echo_lps || (cp->mtp && !p->hid) || !pfx_ok) {
        log_error("out of memory allocating the prefill batch");
        void *st = p;
        detach(&st);
        return NULL;
    }
    return p;
}

const runtime_role_ops prefill_role_ops = {
    .attach = attach,
    .detach = detach,
    .on_msg = on_msg,
    .on_cancel = on_cancel,
    .on_send_event = on_send_event,
    .step = prefill_step,
    .has_work = has_work,
    .load = load,
    .idle = idle,
    .begin_change = begin_change,
};
