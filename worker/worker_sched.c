/*
 * worker_sched: the requests of a worker (see worker_internal.h for the states).
 *
 * Prefill: FIFO, chunked. One batch per loop iteration takes the next chunk (at most
 * prefill_chunk_tokens tokens) of every prompt being computed, then admits queued prompts
 * in order while KV blocks and sequence slots last, up to max_batch_tokens tokens in all
 * (the last prompt's chunk is cut to fit). A long prompt thus takes several iterations and
 * never stalls the loop: decode steps of a mixed worker, control messages and transfers
 * run between its chunks. Each chunk writes its KV into the prompt's one sequence at
 * positions [n_done, n_done + n_chunk); batch-invariant kernels make the result identical
 * to an unchunked pass. A transferred request sends KV_BEGIN when admitted, before its
 * first chunk, and the layer callback hands kvx, per layer, the blocks the chunk
 * completed (a block partly filled goes with the chunk that completes it, or with the
 * last chunk), so the transfer overlaps compute. Decode: every running sequence
 * advances by one token per step in one forward pass; sequences join (KV arrived, or a
 * local prefill finished) and leave (EOS, max_tokens, context full, cancel) between steps.
 *
 * KV reservations are worst case (prompt + max_tokens - 1, capped at the context), so a
 * running sequence never runs out of blocks mid-generation.
 *
 * Per-step work is planned once: the batch arrays (batch, batch_reqs), the logits buffer
 * (max_items, vocab) and the forward pass's scratch (model_ctx, max(max_batch_tokens,
 * max_items) tokens) are sized at start-up, a chunk's bookkeeping lives in its request
 * (n_done, n_chunk, blk_sent, blk_upto), and message headers are encoded on the stack
 * (wire_send), so the prefill and decode steps allocate nothing themselves. What still
 * allocates is per request, not per step (the prompt array, a transfer's record in kvx),
 * and inside ZeroMQ: its copy of each message over 33 bytes (TOKENS, FINISH) and one
 * record per zero-copy KV frame (checked with valgrind --tool=dhat on a mixed worker).
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

/* The request of a transfer: prefilling (a chunked prompt's transfer may fail before its
 * last chunk, e.g. KV_BEGIN rejected) or waiting for KV_RESULT. */
static wreq *req_find_xfer(const worker_t *w, uint64_t xfer)
{
    for (int i = 0; i < w->n_reqs; i++)
        if (w->reqs[i]->xfer == xfer &&
            (w->reqs[i]->state == WREQ_PREFILLING || w->reqs[i]->state == WREQ_SENDING ||
             w->reqs[i]->state == WREQ_MIGRATING))
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
    free(r->hand);
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
    if (w->draining || w->role_target) {
        worker_send_error(w, rid, PROTO_ERR_UNAVAILABLE, 1,
                          w->draining ? "worker is draining" : "worker is changing role");
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
    r->mtp_req = m->mtp_depth;
    r->mtp_depth = wmtp_req_depth(w, m->mtp_depth);
    if (r->mtp_depth > 0 && !(r->hand = calloc((size_t)specdec_hand_floats(w->sd), sizeof(float))))
        r->mtp_depth = 0; /* out of memory: this request runs without MTP */
    snprintf(r->dep, sizeof(r->dep), "%s", m->decode_endpoint);
    w->prefill_blocked = 0;
    log_rdebug(rid, "queued: %d prompt tokens, max_tokens %d, decode at %s", r->n_prompt,
               r->max_tokens, local ? "here" : r->dep);
}

int sched_hand_back_queued(worker_t *w)
{
    int n = 0;
    for (int i = 0; i < w->n_reqs;) {
        wreq *r = w->reqs[i];
        if (r->state != WREQ_QUEUED) {
            i++;
            continue;
        }
        worker_send_error(w, r->rid, PROTO_ERR_UNAVAILABLE, 1,
                          "worker is changing role: prompt handed back before it started");
        req_remove(w, r); /* shifts the table: i stays */
        n++;
    }
    return n;
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
    if (dropped) {
        log_rinfo(rid, "cancelled");
    } else if (w->receiver) { /* its KV may still be on the way here */
        w->tombstones[w->next_tombstone] = rid;
        w->next_tombstone = (w->next_tombstone + 1) % WORKER_TOMBSTONES;
    }
}

static int tombstoned(const worker_t *w, uint64_t rid)
{
    for (int i = 0; i < WORKER_TOMBSTONES; i++)
        if (w->tombstones[i] == rid)
            return 1;
    return 0;
}

// --- live migration (docs/scheduler.md "Live role changes")

/* Move running request r to the decode worker at dep: pause it (it leaves the decode
 * batch), hand its sequence to kvx and send every main layer's blocks of its pos tokens,
 * then KV_END with the token to feed next and the sampler state. KV_BEGIN "gen" tells the
 * receiver how far the attempt got, so it continues at the next token index; max_tokens
 * counts what is left. A sequence drafting with MTP takes its modules' KV layers and their
 * whole per-sequence state along (KV_END's frame, specdec_seq_export), so the receiver
 * drafts on where this worker stopped; a receiver without the same modules drops them and
 * decodes plainly (greedy output is the same either way). Returns 0 when the move started,
 * -1 when it could not (r keeps decoding here). */
static int migrate_start(worker_t *w, wreq *r, const char *dep)
{
    if (worker_open_sender(w) < 0)
        return -1;
    float *state = NULL;
    int n_state = 0;
    if (r->mtp_depth > 0 && w->mtp && specdec_seq_max_depth(w->sd, r->seq) > 0) {
        n_state = specdec_state_floats(w->sd);
        state = malloc((size_t)n_state * sizeof(float));
        if (!state || specdec_seq_export(w->sd, r->seq, r->pos, state) < 0) {
            free(state); /* the sequence moves without its module state */
            state = NULL;
            n_state = 0;
        }
    }
    int n_layer = w->mc->n_layer + (state ? w->n_mtp : 0);
    kvx_begin_params bp = {.rid = r->rid,
                           .seq = r->seq,
                           .n_kv_tokens = r->pos,
                           .max_tokens = r->max_tokens - r->n_gen + 1,
                           .temperature = r->sp.temperature,
                           .top_p = r->sp.top_p,
                           .top_k = r->sp.top_k,
                           .n_layer = n_layer,
                           .n_mtp = state ? w->n_mtp : 0,
                           .mtp_fp = state ? mtp_fingerprint(w->mtp) : 0,
                           .n_hidden = n_state,
                           .mtp = r->mtp_req,
                           .n_gen = r->n_gen};
    uint64_t xfer = kvx_send_begin(w->sender, dep, &bp);
    if (!xfer) {
        free(state);
        return -1;
    }
    r->xfer = xfer; /* kvx owns r->seq from here */
    r->state = WREQ_MIGRATING;
    r->t_mig_us = proto_now_us();
    snprintf(r->dep, sizeof(r->dep), "%s", dep);
    int ok = 1;
    for (int l = 0; l < n_layer && ok; l++)
        ok = kvx_send_layer(w->sender, xfer, l) == 0; /* a failure comes as an event */
    if (ok) /* the outcome comes as an event; the state is copied */
        kvx_send_end_mtp(w->sender, xfer, r->last, r->rng, state, n_state);
    free(state);
    log_rinfo(r->rid, "migrating to %s: %d tokens of KV%s, %d of %d generated", dep, r->pos,
              n_state ? " with the MTP state" : "", r->n_gen, r->max_tokens);
    return 0;
}

/* Carry out a MIGRATE order for r, or log why it stays. */
static void migrate(worker_t *w, wreq *r, const char *dep)
{
    if (migrate_start(w, r, dep) < 0) {
        w->mig.n_out_failed++;
        log_rwarn(r->rid, "cannot start migrating to %s: it keeps decoding here", dep);
    }
}

void sched_on_migrate(worker_t *w, const proto_msg *m)
{
    if (w->role != PROTO_ROLE_DECODE) {
        log_rwarn(m->rid, "MIGRATE ignored: only a decode worker migrates its sequences");
        return;
    }
    if (!m->decode_endpoint[0] || strcmp(m->decode_endpoint, w->kv_endpoint) == 0) {
        log_rwarn(m->rid, "MIGRATE ignored: target endpoint '%s' is %s", m->decode_endpoint,
                  m->decode_endpoint[0] ? "this worker" : "empty");
        return;
    }
    wreq *r = req_find(w, m->rid);
    if (r && r->state == WREQ_RUNNING) {
        migrate(w, r, m->decode_endpoint);
    } else if (r) {
        log_rinfo(m->rid, "MIGRATE ignored: already migrating");
    } else { /* its KV may still be on the way here: carry the order out when it lands */
        w->mig_pending[w->next_mig_pending].rid = m->rid;
        snprintf(w->mig_pending[w->next_mig_pending].dep, PROTO_ENDPOINT_LEN, "%s",
                 m->decode_endpoint);
        w->next_mig_pending = (w->next_mig_pending + 1) % WORKER_MIG_PENDING;
    }
}

/* A MIGRATE order kept for rid (its slot is cleared), or NULL. */
static const char *mig_pending_take(worker_t *w, uint64_t rid)
{
    for (int i = 0; i < WORKER_MIG_PENDING; i++) {
        if (w->mig_pending[i].rid == rid) {
            w->mig_pending[i].rid = 0;
            return w->mig_pending[i].dep;
        }
    }
    return NULL;
}

// --- kvx events

/* A sequence became ours to decode (KV arrived, or the local prefill finished): start it,
 * or end it right away when nothing is left to generate. */
static void start_decode(worker_t *w, wreq *r)
{
    r->state = WREQ_RUNNING;
    r->t_ready_us = proto_now_us();
    /* the module state of the first MTP step (the sequence id may have served another
     * request before: always reset) */
    if (r->hand_state) { /* migrated with its module state: drafting goes on */
        if (specdec_seq_import(w->sd, r->seq, r->pos, r->hand, r->mtp_depth) < 0)
            log_rwarn(r->rid, "the migrated MTP state does not fit the sequence: it decodes "
                              "without drafts");
    } else {
        specdec_seq_start(w->sd, r->seq, r->pos, r->first, r->hand, r->hand ? r->mtp_depth : 0);
    }
    specdec_ctl_init(&r->ctl, specdec_seq_max_depth(w->sd, r->seq), w->sd_prior);
    worker_timing t = {.xfer_us = r->xfer_us, .xfer_bytes = r->xfer_bytes};
    if (r->first == w->mc->eos_id) {
        worker_send_finish_timed(w, r->rid, PROTO_FINISH_STOP, &t);
        req_remove(w, r);
        return;
    }
    if (r->n_gen >= r->max_tokens || r->pos >= w->mc->n_ctx) {
        if (r->n_sent == 0) {
            worker_send_tokens_timed(w, r->rid, 0, &r->first, 1, r->rng, &t);
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
    if (tombstoned(w, ev->rid)) { /* cancelled before its KV arrived: nothing to decode */
        log_rinfo(ev->rid, "KV arrived for a cancelled request: freed");
        free(ev->hidden);
        kvcache_seq_free(w->kv, ev->seq);
        return;
    }
    wreq *old = req_find(w, ev->rid);
    if (old) {
        log_rwarn(ev->rid, "KV for a request already here: the old attempt is dropped");
        req_remove(w, old);
    }
    wreq *r = req_add(w, ev->rid);
    if (!r) {
        free(ev->hidden);
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
    if (ev->n_gen > 0) { /* migrated: tokens [0, n_gen) were reported by the other worker */
        r->n_gen = ev->n_gen;
        r->n_sent = ev->n_gen;
        r->max_tokens = ev->max_tokens + ev->n_gen - 1;
        w->mig.n_in++;
    }
    r->sp.temperature = ev->temperature;
    r->sp.top_p = ev->top_p > 0 ? ev->top_p : 1.0f;
    r->sp.top_k = ev->top_k;
    r->rng = ev->rng;
    r->mtp_req = ev->mtp;
    r->hand = ev->hidden; /* taken: NULL when the transfer had no (usable) module state */
    r->hand_state = ev->mtp_ok && ev->n_gen > 0 && ev->n_hidden == specdec_state_floats(w->sd);
    r->mtp_depth = ev->mtp_ok && (ev->n_hidden == specdec_hand_floats(w->sd) || r->hand_state)
                       ? wmtp_req_depth(w, ev->mtp)
                       : 0;
    r->state = WREQ_RUNNING;
    r->xfer_us = ev->n_gen > 0 ? 0 : ev->xfer_us; /* a move is not the request's hand-off */
    r->xfer_bytes = ev->n_gen > 0 ? 0 : ev->n_bytes;
    if (ev->first_token >= w->mc->vocab_size) {
        worker_send_error(w, r->rid, PROTO_ERR_PROTOCOL, 1, "first token out of vocabulary");
        req_remove(w, r);
        return;
    }
    log_rdebug(r->rid, "KV received: %d tokens in seq %d, %d generated, decoding", r->pos,
               r->seq, r->n_gen);
    int migrated = ev->n_gen > 0;
    uint64_t rid = r->rid;
    start_decode(w, r); /* may end r */
    if (migrated && (r = req_find(w, rid)) != NULL)
        r->t_ready_us = 0; /* its first step reports no hand-off timing */
    const char *dep = mig_pending_take(w, rid);
    if (dep && (r = req_find(w, rid)) != NULL && r->state == WREQ_RUNNING)
        migrate(w, r, dep); /* ordered to move on while its KV was on the way */
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
        int moving = r->state == WREQ_MIGRATING;
        if (ev.type == KVX_EV_DONE) {
            if (moving) {
                int64_t us = proto_now_us() - r->t_mig_us;
                w->mig.n_out++;
                w->mig.out_us += (uint64_t)us;
                log_rinfo(r->rid, "migrated to %s in %.1f ms", r->dep, (double)us / 1000.0);
            } else {
                log_rdebug(r->rid, "KV handed to %s", r->dep);
            }
            req_remove(w, r); /* aborting a finished transfer is a no-op */
            continue;
        }
        if (moving)
            w->mig.n_out_failed++;
        char msg[PROTO_MESSAGE_LEN];
        snprintf(msg, sizeof(msg), "KV %s to %.100s failed: %.120s",
                 moving ? "migration" : "transfer", r->dep, ev.message);
        worker_send_error(w, r->rid, ev.code ? ev.code : PROTO_ERR_INTERNAL, 1, msg);
        req_remove(w, r);
    }
}

// --- prefill

/* Layer `layer` of the batch is written: hand kvx the blocks each transferred prompt's
 * chunk completed in it, [blk_sent, blk_upto) (often none for a chunk smaller than a
 * block). */
static void on_layer(int layer, void *ud)
{
    worker_t *w = ud;
    for (int i = 0; i < w->n_batch; i++) {
        const wreq *r = w->batch_reqs[i];
        if (r->xfer && r->blk_upto > r->blk_sent)
            kvx_send_layer_blocks(w->sender, r->xfer, layer, r->blk_sent,
                                  r->blk_upto - r->blk_sent);
    }
}

/* Blocks of every layer complete once r's current chunk is computed: the full blocks, and
 * with the last chunk the partly filled last one too. */
static int blocks_complete(const worker_t *w, const wreq *r)
{
    int done = r->n_done + r->n_chunk;
    return done == r->n_prompt ? kvcache_blocks_for(w->kv, done) : done / (int)w->block_size;
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
    const int vocab = w->mc->vocab_size;
    const int chunk = (int)w->prefill_chunk_tokens;
    int n = 0, budget = (int)w->max_batch_tokens;
    /* Prompts being computed continue (they are ahead in arrival order), and queued ones
     * are admitted in order until one does not fit (FIFO: no overtaking) or the budget of
     * tokens is spent. */
    for (int i = 0; i < w->n_reqs && n < w->max_items && budget > 0; i++) {
        wreq *r = w->reqs[i];
        if (r->state == WREQ_QUEUED) {
            if (w->prefill_blocked)
                continue;
            if (admit(w, r) < 0) {
                w->prefill_blocked = 1; /* until a request leaves or kvx frees KV */
                continue;
            }
            r->n_done = 0;
            r->blk_sent = 0;
        } else if (r->state != WREQ_PREFILLING) {
            continue;
        }
        int take = r->n_prompt - r->n_done;
        take = take < chunk ? take : chunk;
        take = take < budget ? take : budget;
        r->n_chunk = take;
        budget -= take;
        w->batch_reqs[n++] = r;
    }
    if (n == 0)
        return 0;
    /* Start the transfers of newly admitted prompts before computing, so that layers
     * stream as they finish. */
    int64_t t_start = proto_now_us();
    int m = 0, hid_rows = 0;
    for (int i = 0; i < n; i++) {
        wreq *r = w->batch_reqs[i];
        int fresh = r->state == WREQ_QUEUED;
        r->state = WREQ_PREFILLING;
        if (fresh)
            r->t_start_us = t_start;
        if (fresh && r->dep[0] && r->max_tokens > 1) {
            int mtp = r->mtp_depth > 0; /* module layers and the hand-off state go along */
            kvx_begin_params bp = {.rid = r->rid,
                                   .seq = r->seq,
                                   .n_kv_tokens = r->n_prompt,
                                   .max_tokens = r->max_tokens,
                                   .temperature = r->sp.temperature,
                                   .top_p = r->sp.top_p,
                                   .top_k = r->sp.top_k,
                                   .n_layer = w->mc->n_layer + (mtp ? w->n_mtp : 0),
                                   .n_mtp = mtp ? w->n_mtp : 0,
                                   .mtp_fp = mtp ? mtp_fingerprint(w->mtp) : 0,
                                   .n_hidden = mtp ? specdec_hand_floats(w->sd) : 0,
                                   .mtp = r->mtp_req};
            r->xfer = kvx_send_begin(w->sender, r->dep, &bp);
            if (!r->xfer) {
                char msg[PROTO_MESSAGE_LEN];
                snprintf(msg, sizeof(msg), "cannot start a KV transfer to %.200s", r->dep);
                worker_send_error(w, r->rid, PROTO_ERR_UNAVAILABLE, 1, msg);
                req_remove(w, r); /* the sequence is still ours: freed here */
                continue;
            }
        }
        r->blk_upto = blocks_complete(w, r);
        log_rdebug(r->rid, "prefill chunk [%d, %d) of %d, KV blocks [%d, %d) to send", r->n_done,
                   r->n_done + r->n_chunk, r->n_prompt, r->blk_sent,
                   r->xfer ? r->blk_upto : r->blk_sent);
        w->batch_reqs[m] = r;
        w->batch[m] = (model_seq_batch){.seq = r->seq,
                                        .pos = r->n_done,
                                        .n_tokens = r->n_chunk,
                                        .tokens = r->prompt + r->n_done,
                                        .logits_all = 0,
                                        .logits = w->logits + (size_t)m * vocab};
        if (r->mtp_depth > 0) { /* h_0 of every position, for the MTP modules */
            w->batch[m].hidden = w->hid + (size_t)hid_rows * w->mc->dim;
            w->batch[m].hidden_all = 1;
            hid_rows += r->n_chunk;
        }
        m++;
    }
    w->n_batch = m;
    if (m == 0)
        return 1;
    if (model_forward(w->mctx, w->kv, w->batch, m, on_layer, w) < 0) {
        fail_batch(w, m, "prefill");
        return 1;
    }
    if (wmtp_prefill(w, m) < 0) { /* MTP modules over the chunks; their layers to kvx */
        fail_batch(w, m, "MTP prefill");
        return 1;
    }
    wemu_pad_prefill(w, m, t_start); /* --emulate: the cost model's time (worker_emu.c) */
    w->n_batch = 0;
    for (int i = 0; i < m; i++) {
        wreq *r = w->batch_reqs[i];
        r->n_done += r->n_chunk;
        r->blk_sent = r->blk_upto;
        w->tokens_in += (uint64_t)r->n_chunk;
        if (r->n_done < r->n_prompt)
            continue; /* its next chunk runs in the next loop iteration */
        int first = sampler_sample(w->sampler, &r->sp, &r->rng, w->batch[i].logits);
        worker_timing t = {.queue_us = r->t_start_us - r->t_recv_us,
                           .prefill_us = proto_now_us() - r->t_start_us};
        r->first = first;
        r->n_gen = 1;
        free(r->prompt);
        r->prompt = NULL;
        if (first == w->mc->eos_id) { /* nothing to decode: the EOS itself is not sent */
            worker_send_finish_timed(w, r->rid, PROTO_FINISH_STOP, &t);
            req_remove(w, r);
            continue;
        }
        worker_send_tokens_timed(w, r->rid, 0, &first, 1, r->rng, &t);
        r->n_sent = 1;
        w->tokens_out++;
        if (r->max_tokens <= 1) {
            worker_send_finish(w, r->rid, PROTO_FINISH_LENGTH);
            req_remove(w, r);
        } else if (r->xfer) {
            r->state = WREQ_SENDING;
            /* failure comes as an event */
            kvx_send_end_mtp(w->sender, r->xfer, first, r->rng, r->mtp_depth > 0 ? r->hand : NULL,
                             r->mtp_depth > 0 ? specdec_hand_floats(w->sd) : 0);
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
    int n = 0;
    for (int i = 0; i < w->n_reqs && n < w->max_items; i++)
        if (w->reqs[i]->state == WREQ_RUNNING)
            n++;
    if (n == 0)
        return 0;
    /* each sequence's MTP depth: its controller's (its acceptance, the batch size), or its
     * cap when not adaptive; no drafts past max_tokens (a step emits up to depth + 1) */
    int b = n;
    n = 0;
    for (int i = 0; i < w->n_reqs && n < w->max_items; i++) {
        wreq *r = w->reqs[i];
        if (r->state != WREQ_RUNNING)
            continue;
        int d = w->mtp_adaptive ? specdec_ctl_depth(&r->ctl, &w->sd_costs, b) : r->ctl.max_depth;
        if (d > r->max_tokens - r->n_gen - 1)
            d = r->max_tokens - r->n_gen - 1;
        w->batch_reqs[n] = r;
        w->sd_items[n] = (specdec_item){.seq = r->seq,
                                        .pos = r->pos,
                                        .last = r->last,
                                        .depth = d > 0 ? d : 0,
                                        .sp = &r->sp,
                                        .rng = &r->rng};
        n++;
    }
    /* draft with the modules, verify every sequence's [last, d1, d2] in one pass */
    int64_t t_step = proto_now_us();
    if (specdec_step(w->sd, w->mctx, w->kv, w->sd_items, n) < 0) {
        fail_batch(w, n, "decode");
        return 1;
    }
    wemu_pad_decode(w, n, t_step); /* --emulate: the cost model's time (worker_emu.c) */
    for (int i = 0; i < n; i++) {
        wreq *r = w->batch_reqs[i];
        const specdec_item *x = &w->sd_items[i];
        if (x->n_drafted > 0) {
            w->spec.n_drafts++;
            w->spec.n_draft_tokens += (uint64_t)x->n_drafted;
            w->spec.n_accepted_tokens += (uint64_t)x->n_accepted;
            for (int j = 0; j < x->n_accepted && j < PROTO_SPEC_MAX_POS; j++)
                w->spec.accepted_per_pos[j]++;
            specdec_ctl_observe(&r->ctl, x->n_drafted, x->n_accepted);
        }
        int out[SPECDEC_MAX_DEPTH + 2], k = 0, reason = 0;
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
        /* the emitted tokens in order, up to EOS (not sent), max_tokens or the context's
         * end: nothing after them is sent or counted */
        for (int j = 0; j < x->n_tokens && !reason; j++) {
            int t = x->tokens[j];
            r->pos++; /* the KV of the token before t is in the cache */
            if (t == w->mc->eos_id) {
                reason = PROTO_FINISH_STOP;
                break;
            }
            out[k++] = t;
            r->n_gen++;
            w->tokens_out++;
            r->last = t;
            if (r->n_gen >= r->max_tokens || r->pos >= w->mc->n_ctx)
                reason = PROTO_FINISH_LENGTH;
        }
        if (k)
            worker_send_tokens_timed(w, r->rid, r->n_sent, out, k, r->rng, tp);
        r->n_sent += k;
        if (reason) {
            worker_send_finish_timed(w, r->rid, reason, k ? NULL : tp);
            req_remove(w, r);
        }
    }
    return 1;
}

// --- figures

int sched_has_work(const worker_t *w)
{
    for (int i = 0; i < w->n_reqs; i++) {
        const wreq *r = w->reqs[i];
        if (r->state == WREQ_RUNNING || r->state == WREQ_PREFILLING ||
            (r->state == WREQ_QUEUED && !w->prefill_blocked))
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
            if (r->state == WREQ_PREFILLING) /* its prompt tokens still to compute */
                *queued_tokens += r->n_prompt - r->n_done;
        }
    }
}

int sched_idle(const worker_t *w)
{
    return w->n_reqs == 0 && (!w->receiver || kvx_receiver_n_active(w->receiver) == 0) &&
           (!w->sender || kvx_sender_n_active(w->sender) == 0);
}
