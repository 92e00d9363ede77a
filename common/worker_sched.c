/*
 * worker_sched: the requests of a worker (see worker_internal.h for the states).
 *
 * Prefill: FIFO; one batch per loop iteration takes queued prompts up to max_batch_tokens
 * (always at least one) while KV blocks and sequence slots last, sends KV_BEGIN for each
 * transferred request before the forward pass, and hands every finished layer to kvx from
 * the layer callback, so the transfer overlaps compute. Decode: every running sequence
 * advances by one token per step in one forward pass; sequences join (KV arrived, or a
 * local prefill finished) and leave (EOS, max_tokens, context full, cancel) between steps.
 *
 * KV reservations are worst case (prompt + max_tokens - 1, capped at the context), so a
 * running sequence never runs out of blocks mid-generation.
 */
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "worker_internal.h"

// --- request table

static wreq *req_find(const worker_t *w, uint64_t rid)
{
    for (int i = 0; i < w->n_reqs; i++)
        if (w->reqs[i]->rid == rid)
            return w->reqs[i];
    return NULL;
}

static wreq *req_find_xfer(const worker_t *w, uint64_t xfer)
{
    for (int i = 0; i < w->n_reqs; i++)
        if (w->reqs[i]->state == WREQ_SENDING && w->reqs[i]->xfer == xfer)
            return w->reqs[i];
    return NULL;
}

static wreq *req_add(worker_t *w, uint64_t rid)
{
    if (w->n_reqs == w->cap_reqs) {
        int cap = w->cap_reqs ? w->cap_reqs * 2 : 64;
        wreq **v = realloc(w->reqs, (size_t)cap * sizeof(*v));
        if (!v)
            return NULL;
        w->reqs = v;
        w->cap_reqs = cap;
    }
    wreq *r = calloc(1, sizeof(*r));
    if (!r)
        return NULL;
    r->rid = rid;
    r->seq = -1;
    w->reqs[w->n_reqs++] = r;
    return r;
}

/* Remove r from the table and free it with whatever it owns (the one place a request's
 * memory is freed). A transfer in progress is aborted (kvx then frees its sequence). */
static void req_remove(worker_t *w, wreq *r)
{
    if (r->xfer) {
        kvx_send_abort(w->sender, r->xfer); /* no-op when the transfer is over */
        r->seq = -1;                        /* kvx owns it and frees it */
    }
    if (r->seq >= 0)
        kvcache_seq_free(w->kv, r->seq);
    for (int i = 0; i < w->n_reqs; i++) {
        if (w->reqs[i] == r) {
            memmove(&w->reqs[i], &w->reqs[i + 1], (size_t)(w->n_reqs - i - 1) * sizeof(wreq *));
            w->n_reqs--;
            break;
        }
    }
    w->prefill_blocked = 0; /* resources were freed: the queue may move again */
    free(r->prompt);
    free(r);
}

void sched_free_all(worker_t *w)
{
    while (w->n_reqs > 0)
        req_remove(w, w->reqs[w->n_reqs - 1]);
    free(w->reqs);
    w->reqs = NULL;
    w->cap_reqs = 0;
}

// --- orders

void sched_on_prefill(worker_t *w, proto_msg *m)
{
    const model_config *mc = w->mc;
    char why[PROTO_MESSAGE_LEN];
    uint64_t rid = m->rid;
    if (w->role == PROTO_ROLE_DECODE) {
        worker_send_error(w, rid, PROTO_ERR_UNAVAILABLE, 1, "this is a decode worker");
        return;
    }
    if (w->draining) {
        worker_send_error(w, rid, PROTO_ERR_UNAVAILABLE, 1, "worker is draining");
        return;
    }
    if (m->n_tokens < 1 || m->n_tokens > mc->n_ctx) {
        snprintf(why, sizeof(why), "prompt of %d tokens does not fit the context of %d",
                 m->n_tokens, mc->n_ctx);
        worker_send_error(w, rid, PROTO_ERR_BAD_REQUEST, 0, why);
        return;
    }
    for (int i = 0; i < m->n_tokens; i++) {
        if (m->tokens[i] >= mc->vocab_size) {
            snprintf(why, sizeof(why), "token %d at %d is outside the vocabulary of %d",
                     m->tokens[i], i, mc->vocab_size);
            worker_send_error(w, rid, PROTO_ERR_BAD_REQUEST, 0, why);
            return;
        }
    }
    int local = m->decode_endpoint[0] == 0;
    long long need = local ? (long long)m->n_tokens + m->max_tokens - 1 : m->n_tokens;
    if (need > mc->n_ctx)
        need = mc->n_ctx;
    if (kvcache_blocks_for(w->kv, (int)need) > kvcache_n_blocks(w->kv)) {
        snprintf(why, sizeof(why), "%lld tokens need more KV blocks than the %d this worker has",
                 need, kvcache_n_blocks(w->kv));
        worker_send_error(w, rid, PROTO_ERR_BAD_REQUEST, 0, why);
        return;
    }
    wreq *old = req_find(w, rid);
    if (old) {
        log_rwarn(rid, "PREFILL for a request already here: the old attempt is dropped");
        req_remove(w, old);
    }
    int queued = 0;
    for (int i = 0; i < w->n_reqs; i++)
        queued += w->reqs[i]->state == WREQ_QUEUED;
    if (queued >= WORKER_MAX_QUEUE) {
        worker_send_error(w, rid, PROTO_ERR_NOSPACE, 1, "prefill queue full");
        return;
    }
    wreq *r = req_add(w, rid);
    if (!r) {
        worker_send_error(w, rid, PROTO_ERR_INTERNAL, 1, "out of memory");
        return;
    }
    r->state = WREQ_QUEUED;
    r->t_recv_us = proto_now_us();
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
    snprintf(r->dep, sizeof(r->dep), "%s", m->decode_endpoint);
    w->prefill_blocked = 0;
    log_rdebug(rid, "queued: %d prompt tokens, max_tokens %d, decode at %s", r->n_prompt,
               r->max_tokens, local ? "here" : r->dep);
}

void sched_on_cancel(worker_t *w, uint64_t rid)
{
    int dropped = 0;
    wreq *r = req_find(w, rid);
    if (r) {
        req_remove(w, r);
        dropped = 1;
    }
    if (w->receiver && kvx_receiver_abort(w->receiver, rid))
        dropped = 1;
    if (dropped)
        log_rinfo(rid, "cancelled");
}

// --- kvx events

/* A sequence became ours to decode (KV arrived, or the local prefill finished): start it,
 * or end it right away when nothing is left to generate. */
static void start_decode(worker_t *w, wreq *r)
{
    r->state = WREQ_RUNNING;
    r->t_ready_us = proto_now_us();
    worker_timing t = {.xfer_us = r->xfer_us, .xfer_bytes = r->xfer_bytes};
    if (r->first == w->mc->eos_id) {
        worker_send_finish_timed(w, r->rid, PROTO_FINISH_STOP, &t);
        req_remove(w, r);
        return;
    }
    if (r->n_gen >= r->max_tokens || r->pos >= w->mc->n_ctx) {
        if (r->n_sent == 0) {
            worker_send_tokens_timed(w, r->rid, 0, &r->first, 1, &t);
            r->n_sent = 1;
            worker_send_finish(w, r->rid, PROTO_FINISH_LENGTH);
        } else {
            worker_send_finish_timed(w, r->rid, PROTO_FINISH_LENGTH, &t);
        }
        req_remove(w, r);
    }
}

static void on_accepted(worker_t *w, const kvx_event *ev)
{
    wreq *old = req_find(w, ev->rid);
    if (old) {
        log_rwarn(ev->rid, "KV for a request already here: the old attempt is dropped");
        req_remove(w, old);
    }
    wreq *r = req_add(w, ev->rid);
    if (!r) {
        kvcache_seq_free(w->kv, ev->seq);
        worker_send_error(w, ev->rid, PROTO_ERR_INTERNAL, 1, "out of memory");
        return;
    }
    r->seq = ev->seq; /* ownership moves from kvx to this request */
    r->pos = ev->n_kv_tokens;
    r->first = ev->first_token;
    r->last = ev->first_token;
    r->n_gen = 1;
    r->n_sent = 0; /* the first TOKENS repeats the first token at index 0 */
    r->max_tokens = ev->max_tokens;
    r->sp.temperature = ev->temperature;
    r->sp.top_p = ev->top_p > 0 ? ev->top_p : 1.0f;
    r->sp.top_k = ev->top_k;
    r->rng = ev->rng;
    r->state = WREQ_RUNNING;
    r->xfer_us = ev->xfer_us;
    r->xfer_bytes = ev->n_bytes;
    if (ev->first_token >= w->mc->vocab_size) {
        worker_send_error(w, r->rid, PROTO_ERR_PROTOCOL, 1, "first token out of vocabulary");
        req_remove(w, r);
        return;
    }
    log_rdebug(r->rid, "KV received: %d tokens in seq %d, decoding", r->pos, r->seq);
    start_decode(w, r);
}

void sched_on_kvx_events(worker_t *w)
{
    kvx_event ev;
    while (w->receiver && kvx_receiver_next_event(w->receiver, &ev)) {
        if (ev.type == KVX_EV_ACCEPTED)
            on_accepted(w, &ev);
        else
            log_rinfo(ev.rid, "incoming KV transfer dropped: %s (%s)", proto_err_str(ev.code),
                      ev.message);
    }
    while (w->sender && kvx_sender_next_event(w->sender, &ev)) {
        wreq *r = req_find_xfer(w, ev.xfer);
        if (!r)
            continue; /* cancelled meanwhile */
        if (ev.type == KVX_EV_DONE) {
            log_rdebug(r->rid, "KV handed to %s", r->dep);
            req_remove(w, r); /* aborting a finished transfer is a no-op */
            continue;
        }
        char msg[PROTO_MESSAGE_LEN];
        snprintf(msg, sizeof(msg), "KV transfer to %.100s failed: %.120s", r->dep, ev.message);
        worker_send_error(w, r->rid, ev.code ? ev.code : PROTO_ERR_INTERNAL, 1, msg);
        req_remove(w, r);
    }
}

// --- prefill

static void on_layer(int layer, void *ud)
{
    worker_t *w = ud;
    for (int i = 0; i < w->n_batch; i++)
        if (w->batch_reqs[i]->xfer)
            kvx_send_layer(w->sender, w->batch_reqs[i]->xfer, layer);
}

/* Admit r into the batch: a sequence with room for its prompt (and, when decoded here, for
 * every token it may generate). Returns 0, or -1 when the cache is full now. */
static int admit(worker_t *w, wreq *r)
{
    int local = r->dep[0] == 0;
    long long need = local ? (long long)r->n_prompt + r->max_tokens - 1 : r->n_prompt;
    if (need > w->mc->n_ctx)
        need = w->mc->n_ctx;
    int seq = kvcache_seq_new(w->kv);
    if (seq < 0)
        return -1;
    if (kvcache_seq_reserve(w->kv, seq, (int)need) != KVCACHE_OK) {
        kvcache_seq_free(w->kv, seq);
        return -1;
    }
    r->seq = seq;
    return 0;
}

/* Fail every request of the current batch (the forward pass refused it). */
static void fail_batch(worker_t *w, int n, const char *what)
{
    for (int i = 0; i < n; i++) {
        wreq *r = w->batch_reqs[i];
        log_rerror(r->rid, "%s forward pass failed", what);
        worker_send_error(w, r->rid, PROTO_ERR_INTERNAL, 1, "forward pass failed");
        req_remove(w, r);
    }
    w->n_batch = 0;
}

int sched_prefill_step(worker_t *w)
{
    if (w->prefill_blocked)
        return 0;
    const int vocab = w->mc->vocab_size;
    int n = 0, tokens = 0;
    for (int i = 0; i < w->n_reqs && n < w->max_items; i++) {
        wreq *r = w->reqs[i];
        if (r->state != WREQ_QUEUED)
            continue;
        if (n > 0 && tokens + r->n_prompt > w->max_batch_tokens)
            break;
        if (admit(w, r) < 0)
            break;
        tokens += r->n_prompt;
        w->batch_reqs[n++] = r;
    }
    if (n == 0) {
        w->prefill_blocked = 1; /* until a request leaves or kvx frees KV */
        return 0;
    }
    /* Start the transfers before computing, so that layers stream as they finish. */
    int m = 0;
    for (int i = 0; i < n; i++) {
        wreq *r = w->batch_reqs[i];
        if (r->dep[0] && r->max_tokens > 1) {
            kvx_begin_params bp = {.rid = r->rid,
                                   .seq = r->seq,
                                   .n_kv_tokens = r->n_prompt,
                                   .max_tokens = r->max_tokens,
                                   .temperature = r->sp.temperature,
                                   .top_p = r->sp.top_p,
                                   .top_k = r->sp.top_k};
            r->xfer = kvx_send_begin(w->sender, r->dep, &bp);
            if (!r->xfer) {
                char msg[PROTO_MESSAGE_LEN];
                snprintf(msg, sizeof(msg), "cannot start a KV transfer to %.200s", r->dep);
                worker_send_error(w, r->rid, PROTO_ERR_UNAVAILABLE, 1, msg);
                req_remove(w, r); /* the sequence is still ours: freed here */
                continue;
            }
        }
        w->batch_reqs[m] = r;
        w->batch[m] = (model_seq_batch){.seq = r->seq,
                                        .pos = 0,
                                        .n_tokens = r->n_prompt,
                                        .tokens = r->prompt,
                                        .logits_all = 0,
                                        .logits = w->logits + (size_t)m * vocab};
        m++;
    }
    w->n_batch = m;
    if (m == 0)
        return 1;
    int64_t t_start = proto_now_us();
    if (model_forward(w->mctx, w->kv, w->batch, m, on_layer, w) < 0) {
        fail_batch(w, m, "prefill");
        return 1;
    }
    w->n_batch = 0;
    for (int i = 0; i < m; i++) {
        wreq *r = w->batch_reqs[i];
        w->tokens_in += (uint64_t)r->n_prompt;
        int first = sampler_sample(w->sampler, &r->sp, &r->rng, w->batch[i].logits);
        worker_timing t = {.queue_us = t_start - r->t_recv_us,
                           .prefill_us = proto_now_us() - t_start};
        r->first = first;
        r->n_gen = 1;
        free(r->prompt);
        r->prompt = NULL;
        if (first == w->mc->eos_id) { /* nothing to decode: the EOS itself is not sent */
            worker_send_finish_timed(w, r->rid, PROTO_FINISH_STOP, &t);
            req_remove(w, r);
            continue;
        }
        worker_send_tokens_timed(w, r->rid, 0, &first, 1, &t);
        r->n_sent = 1;
        w->tokens_out++;
        if (r->max_tokens <= 1) {
            worker_send_finish(w, r->rid, PROTO_FINISH_LENGTH);
            req_remove(w, r);
        } else if (r->xfer) {
            r->state = WREQ_SENDING;
            kvx_send_end(w->sender, r->xfer, first, r->rng); /* failure comes as an event */
        } else {
            r->pos = r->n_prompt;
            r->last = first;
            start_decode(w, r);
        }
    }
    return 1;
}

// --- decode

int sched_decode_step(worker_t *w)
{
    const int vocab = w->mc->vocab_size;
    int n = 0;
    for (int i = 0; i < w->n_reqs && n < w->max_items; i++) {
        wreq *r = w->reqs[i];
        if (r->state != WREQ_RUNNING)
            continue;
        w->batch_reqs[n] = r;
        w->batch[n] = (model_seq_batch){.seq = r->seq,
                                        .pos = r->pos,
                                        .n_tokens = 1,
                                        .tokens = &r->last,
                                        .logits_all = 0,
                                        .logits = w->logits + (size_t)n * vocab};
        n++;
    }
    if (n == 0)
        return 0;
    if (model_forward(w->mctx, w->kv, w->batch, n, NULL, NULL) < 0) {
        fail_batch(w, n, "decode");
        return 1;
    }
    for (int i = 0; i < n; i++) {
        wreq *r = w->batch_reqs[i];
        r->pos++;
        int t = sampler_sample(w->sampler, &r->sp, &r->rng, w->batch[i].logits);
        int out[2], k = 0;
        /* the first decode step reports the transfer and its own latency */
        worker_timing tm = {0}, *tp = NULL;
        if (r->t_ready_us) {
            tm = (worker_timing){.xfer_us = r->xfer_us, .xfer_bytes = r->xfer_bytes,
                                 .step_us = proto_now_us() - r->t_ready_us};
            tp = &tm;
            r->t_ready_us = 0;
        }
        if (r->n_sent == 0)
            out[k++] = r->first; /* the first TOKENS repeats the prefill's token */
        if (t == w->mc->eos_id) {
            if (k)
                worker_send_tokens_timed(w, r->rid, 0, out, k, tp);
            worker_send_finish_timed(w, r->rid, PROTO_FINISH_STOP, k ? NULL : tp);
            req_remove(w, r);
            continue;
        }
        out[k++] = t;
        r->n_gen++;
        w->tokens_out++;
        worker_send_tokens_timed(w, r->rid, r->n_sent, out, k, tp);
        r->n_sent += k;
        if (r->n_gen >= r->max_tokens || r->pos >= w->mc->n_ctx) {
            worker_send_finish(w, r->rid, PROTO_FINISH_LENGTH);
            req_remove(w, r);
        } else {
            r->last = t;
        }
    }
    return 1;
}

// --- figures

int sched_has_work(const worker_t *w)
{
    for (int i = 0; i < w->n_reqs; i++) {
        const wreq *r = w->reqs[i];
        if (r->state == WREQ_RUNNING || (r->state == WREQ_QUEUED && !w->prefill_blocked))
            return 1;
    }
    return 0;
}

void sched_load(const worker_t *w, int *running, int *queued, int *queued_tokens)
{
    *running = *queued = *queued_tokens = 0;
    for (int i = 0; i < w->n_reqs; i++) {
        const wreq *r = w->reqs[i];
        if (r->state == WREQ_QUEUED) {
            (*queued)++;
            *queued_tokens += r->n_prompt;
        } else {
            (*running)++;
        }
    }
}

int sched_idle(const worker_t *w)
{
    return w->n_reqs == 0 && (!w->receiver || kvx_receiver_n_active(w->receiver) == 0) &&
           (!w->sender || kvx_sender_n_active(w->sender) == 0);
}
