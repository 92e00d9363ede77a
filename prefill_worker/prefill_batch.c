/*
 * prefill_batch: the prefill role's step (prefill_step): one batch of prompt chunks
 * through the model.
 *
 * FIFO, chunked. One batch per loop iteration takes the next chunk (at most
 * prefill_chunk_tokens tokens) of every prompt being computed, then admits queued prompts
 * in order while KV blocks and sequence slots last, up to max_batch_tokens tokens in all
 * (the last prompt's chunk is cut to fit). A long prompt thus takes several iterations and
 * never stalls the loop: decode steps of a mixed worker, control messages and transfers
 * run between its chunks. Each chunk writes its KV into the prompt's one sequence at
 * positions [n_done, n_done + n_chunk); batch-invariant kernels make the result identical
 * to an unchunked pass. A transferred prompt sends KV_BEGIN when admitted, before its
 * first chunk, and the layer callback hands kvx, per layer, the blocks the chunk completed
 * (a block partly filled goes with the chunk that completes it, or with the last chunk),
 * so the transfer overlaps compute. With MTP modules the modules run over each chunk too
 * (their K/V, and the hand-off state the decode side's first draft needs).
 *
 * KV reservations: a transferred prompt reserves its prompt's blocks; one decoded here
 * reserves its prompt plus the first decode step's tokens (RUNTIME_KV_HEADROOM_TOKENS) and
 * leaves --kv-watermark free: the decode role takes blocks as it generates and preempts
 * when they run out (decode_worker/decode.c).
 *
 * Automatic prefix caching (--prefix-cache, docs/prefix-cache.md): at admission the
 * prompt's longest run of cached full blocks (kvcache_seq_attach_prefix) is shared with
 * its sequence and computing starts after it (n_done = the cached tokens; at least the last
 * prompt token is always computed, for its logits, so a shared block is never written).
 * KV_BEGIN lists the prompt's full-block hashes and the decode worker's ACK says which
 * leading blocks it holds already: kvx sends only the others (the cached ones it does send
 * go with the first chunk; docs/prefix-cache.md "The decode side"); a prompt decoded here
 * hands its ids to the decode role, which caches the generated tokens' blocks too. Once
 * the prompt is computed its full blocks are registered
 * (kvcache_seq_commit_prefix). The key of a block is seeded by the model's fingerprint and,
 * when the MTP modules ran over the prompt, their fingerprint and depth: a module's K/V at
 * position t depends on the token t + k, so such a block's key also holds the depth tokens
 * after it (lookahead), and the prompt computes at least its last two tokens (the module
 * pass must see position n_prompt - 2 for the hand-off state).
 *
 * The step allocates nothing: the batch arrays, the logits (max_items, vocab) and the
 * forward pass's scratch are sized at attach and start-up, a chunk's bookkeeping lives in
 * its request (n_done, n_chunk, blk_sent, blk_upto), and message headers are encoded on
 * the stack (wire_send).
 */
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "prefill_internal.h"

/* Layer `layer` of the batch is written: hand kvx the blocks each transferred prompt's
 * chunk completed in it, [blk_sent, blk_upto) (often none for a chunk smaller than a
 * block). */
static void on_layer(int layer, void *ud)
{
    prefill_role *p = ud;
    for (int i = 0; i < p->n_batch; i++) {
        const preq *r = p->batch_reqs[i];
        if (r->xfer && r->blk_upto > r->blk_sent)
            kvx_send_layer_blocks(p->rt->sender, r->xfer, layer, r->blk_sent,
                                  r->blk_upto - r->blk_sent);
    }
}

/* Blocks of every layer complete once r's current chunk is computed: the full blocks, and
 * with the last chunk the partly filled last one too. */
static int blocks_complete(const prefill_role *p, const preq *r)
{
    int done = r->n_done + r->n_chunk;
    return done == r->n_prompt ? kvcache_blocks_for(p->rt->cp.kv, done)
                               : done / p->rt->cp.block_size;
}

/* The prefix cache's key of r's blocks: the chain seed and the lookahead (tokens after a
 * block that its KV depends on: the MTP depth the module pass writes). */
static uint64_t prefix_key(const prefill_role *p, const preq *r, int *lookahead)
{
    const worker_compute *cp = &p->rt->cp;
    int depth = r->mtp_depth < cp->n_mtp ? r->mtp_depth : cp->n_mtp;
    if (!cp->mtp || depth < 0)
        depth = 0;
    *lookahead = depth;
    return prefill_prefix_seed(cp, depth);
}

uint64_t prefill_prefix_seed(const worker_compute *cp, int depth)
{
    /* one definition for prefill, decode and the gateway's routing (kvcache.h) */
    int mtp = depth > 0 && cp->mtp;
    return kvcache_prefix_seed_mtp(cp->mc->fingerprint, mtp ? mtp_fingerprint(cp->mtp) : 0,
                                   mtp ? depth : 0);
}

/* Admit r into the batch: a sequence with room for its prompt (and, when decoded here, for
 * its first decode step, leaving --kv-watermark free unless the cache is otherwise empty:
 * the decode role takes more blocks as it generates), its cached prefix shared (r->n_done =
 * the cached tokens). Returns 0, or -1 when the cache is full now. */
static int admit(prefill_role *p, preq *r)
{
    runtime_t *rt = p->rt;
    kvcache_t *kv = rt->cp.kv;
    int local = r->dep[0] == 0;
    long long need = local ? (long long)r->n_prompt + RUNTIME_KV_HEADROOM_TOKENS : r->n_prompt;
    if (need > rt->cp.mc->n_ctx)
        need = rt->cp.mc->n_ctx;
    int n_free = kvcache_n_free_blocks(kv);
    if (local && n_free < kvcache_n_blocks(kv) &&
        n_free - kvcache_blocks_for(kv, (int)need) < runtime_kv_watermark_blocks(rt))
        return -1;
    int seq = kvcache_seq_new(kv);
    if (seq < 0)
        return -1;
    int cached = 0;
    if (rt->set.prefix_cache && !r->echo) { /* echo: every position's logits are needed */
        int la = 0;
        uint64_t seed = prefix_key(p, r, &la);
        /* the last token (the logits) and, with MTP, the one before are computed */
        int max_cached = r->n_prompt - 1 - (la > 0);
        cached = kvcache_seq_attach_prefix(kv, seq, seed, la, r->prompt, r->n_prompt, max_cached);
        if (cached < 0)
            cached = 0;
    }
    if (kvcache_seq_reserve(kv, seq, (int)need) != KVCACHE_OK) {
        kvcache_seq_free(kv, seq); /* shared blocks go back to the cache */
        return -1;
    }
    r->seq = seq;
    r->n_done = cached;
    if (rt->set.prefix_cache) {
        rt->prefix_queries += (uint64_t)r->n_prompt;
        rt->prefix_hits += (uint64_t)cached;
        if (cached)
            log_rdebug(r->rid, "prefix cache: %d of %d prompt tokens cached", cached, r->n_prompt);
    }
    return 0;
}

/* Fail every prompt of the current batch (the forward pass refused it). */
static void fail_batch(prefill_role *p, int n, const char *what)
{
    for (int i = 0; i < n; i++) {
        preq *r = p->batch_reqs[i];
        log_rerror(r->rid, "%s forward pass failed", what);
        runtime_send_error(p->rt, r->rid, PROTO_ERR_INTERNAL, 1, "forward pass failed");
        prefill_req_remove(p, r);
    }
    p->n_batch = 0;
}

/* After the forward pass over batch_reqs/batch[0..m): run the MTP modules over the chunks
 * of the prompts with MTP and hand kvx their module-layer blocks. Returns 0, or -1 when a
 * module pass failed. */
static int mtp_pass(prefill_role *p, int m)
{
    const worker_compute *cp = &p->rt->cp;
    if (!cp->mtp)
        return 0;
    int n = 0;
    for (int i = 0; i < m; i++) {
        const preq *r = p->batch_reqs[i];
        const model_seq_batch *b = &p->batch[i];
        if (r->mtp_depth <= 0 || !b->hidden || !r->hand)
            continue;
        p->pitems[n++] = (specdec_prefill_item){.seq = r->seq,
                                                .pos = b->pos,
                                                .n_tokens = b->n_tokens,
                                                .prompt = r->prompt,
                                                .n_prompt = r->n_prompt,
                                                .h0 = b->hidden,
                                                .depth = r->mtp_depth,
                                                .hand = r->hand};
    }
    if (n && specdec_prefill(cp->sd, cp->mctx, cp->kv, p->pitems, n) < 0)
        return -1;
    /* the module layers' blocks this chunk completed go with the main layers' */
    for (int i = 0; i < m; i++) {
        const preq *r = p->batch_reqs[i];
        if (!r->xfer || r->mtp_depth <= 0 || r->blk_upto <= r->blk_sent)
            continue;
        for (int k = 0; k < cp->n_mtp; k++)
            kvx_send_layer_blocks(p->rt->sender, r->xfer, mtp_kv_layer(cp->mtp, k + 1), r->blk_sent,
                                  r->blk_upto - r->blk_sent);
    }
    return 0;
}

/* Start the KV transfer of r, newly admitted, to its decode worker (KV_BEGIN). Returns 0,
 * or -1 after failing the request (retryable) and freeing it. */
static int transfer_begin(prefill_role *p, preq *r)
{
    const worker_compute *cp = &p->rt->cp;
    int mtp = r->mtp_depth > 0; /* module layers and the hand-off state go along */
    kvx_begin_params bp = {.rid = r->rid,
                           .seq = r->seq,
                           .n_kv_tokens = r->n_prompt,
                           .max_tokens = r->max_tokens,
                           .temperature = r->sp.temperature,
                           .top_p = r->sp.top_p,
                           .top_k = r->sp.top_k,
                           .n_layer = cp->mc->n_layer + (mtp ? cp->n_mtp : 0),
                           .n_mtp = mtp ? cp->n_mtp : 0,
                           .mtp_fp = mtp ? mtp_fingerprint(cp->mtp) : 0,
                           .n_hidden = mtp ? specdec_hand_floats(cp->sd) : 0,
                           .mtp = r->mtp_req,
                           .priority = r->priority,
                           .logprobs = r->logprobs,
                           .server_key = r->dpk};
    proto_sampling samp;
    if (r->pen) { /* the decode worker's penalties count the prompt (+ earlier attempts) */
        seqpen_export(r->pen, 0, &samp, &bp.hist, &bp.n_hist);
        bp.samp = &samp;
    }
    /* prefix caching: KV_BEGIN lists the prompt's full-block hashes, and only the blocks
     * the decode worker lacks are sent (docs/prefix-cache.md "The decode side") */
    uint64_t hashes[PROTO_MAX_BLOCK_HASHES];
    if (p->rt->set.prefix_cache) {
        uint64_t seed = prefix_key(p, r, &bp.lookahead);
        bp.n_block_hashes = kvcache_prefix_hashes(cp->kv, seed, bp.lookahead, r->prompt,
                                                  r->n_prompt, PROTO_MAX_BLOCK_HASHES, hashes);
        bp.block_hashes = hashes;
        bp.ids = r->prompt;
    }
    r->xfer = kvx_send_begin(p->rt->sender, r->dep, &bp);
    if (r->xfer)
        return 0;
    char msg[PROTO_MESSAGE_LEN];
    snprintf(msg, sizeof(msg), "cannot start a KV transfer to %.200s", r->dep);
    runtime_send_error(p->rt, r->rid, PROTO_ERR_UNAVAILABLE, 1, msg);
    prefill_req_remove(p, r); /* the sequence is still ours: freed here */
    return -1;
}

/* Echo: r's chunk of positions [pos, pos + n) is computed with every row's logits in
 * p->echo_logits: row j gives prompt token pos + j + 1 its log-probabilities (the last
 * row, the first generated token's, is prompt_done's); report them (TOKENS "echo"). */
static void echo_chunk(prefill_role *p, const preq *r, int pos, int n)
{
    const int vocab = p->rt->cp.mc->vocab_size;
    int k = 0;
    for (int j = 0; j < n && pos + j + 1 < r->n_prompt; j++, k++) {
        sampler_logprob lp;
        sampler_logprobs(p->echo_logits + (size_t)j * vocab, vocab, r->prompt[pos + j + 1],
                         r->logprobs - 1, &lp);
        runtime_logprob_to_proto(&p->echo_lps[k], &lp);
    }
    if (k > 0)
        runtime_send_prompt_logprobs(p->rt, r->rid, pos + 1, r->prompt + pos + 1, k, p->echo_lps);
}

/* r's whole prompt is computed and its first token sampled from logits: report it, then
 * finish the transfer, hand the sequence to the local decode role, or end the request. */
static void prompt_done(prefill_role *p, preq *r, float *logits)
{
    runtime_t *rt = p->rt;
    const worker_compute *cp = &rt->cp;
    if (rt->set.prefix_cache) { /* the prompt's full blocks are final: later prompts share them */
        int la = 0;
        uint64_t seed = prefix_key(p, r, &la);
        kvcache_seq_commit_prefix(cp->kv, r->seq, seed, la, r->prompt, r->n_prompt);
    }
    /* log-probabilities are those of the raw distribution: the logits are kept before
     * penalties and sampling transform them in place */
    sampler_logprob lp;
    if (r->logprobs)
        memcpy(p->lp_raw, logits, (size_t)cp->mc->vocab_size * sizeof(float));
    if (r->pen)
        seqpen_apply(r->pen, cp->sampler, logits);
    int first = sampler_sample(cp->sampler, &r->sp, &r->rng, logits);
    if (r->logprobs)
        sampler_logprobs(p->lp_raw, cp->mc->vocab_size, first, r->logprobs - 1, &lp);
    runtime_timing t = {.queue_us = r->t_start_us - r->t_recv_us,
                        .prefill_us = proto_now_us() - r->t_start_us};
    int *prompt = r->prompt; /* kept for a local hand-off with prefix caching, else freed */
    r->prompt = NULL;
    if (!rt->set.prefix_cache || r->xfer || r->max_tokens <= 1 || first == cp->mc->eos_id) {
        free(prompt);
        prompt = NULL;
    }
    if (first == cp->mc->eos_id) { /* nothing to decode: the EOS itself is not sent */
        runtime_send_finish(rt, r->rid, PROTO_FINISH_STOP, &t);
        prefill_req_remove(p, r);
        return;
    }
    runtime_send_tokens(rt, r->rid, 0, &first, 1, r->rng, &t, r->logprobs ? &lp : NULL);
    rt->tokens_out++;
    if (r->pen)
        seqpen_push(r->pen, first);
    if (r->pen && seqpen_is_stop(r->pen, first)) { /* a stop_token_id: sent, then the end */
        runtime_send_finish(rt, r->rid, PROTO_FINISH_STOP, NULL);
        prefill_req_remove(p, r);
    } else if (r->max_tokens <= 1) {
        runtime_send_finish(rt, r->rid, PROTO_FINISH_LENGTH, NULL);
        prefill_req_remove(p, r);
    } else if (r->xfer) {
        r->state = PREQ_SENDING;
        kvx_send_timing(rt->sender, r->xfer, t.queue_us, t.prefill_us);
        /* failure comes as an event */
        kvx_send_end_mtp(rt->sender, r->xfer, first, r->rng, r->mtp_depth > 0 ? r->hand : NULL,
                         r->mtp_depth > 0 ? specdec_hand_floats(cp->sd) : 0);
    } else { /* decoded here: the sequence and the MTP state go to the decode role */
        runtime_handoff h = {.rid = r->rid,
                             .seq = r->seq,
                             .pos = r->n_prompt,
                             .first = first,
                             .max_tokens = r->max_tokens,
                             .sp = r->sp,
                             .rng = r->rng,
                             .mtp_req = r->mtp_req,
                             .mtp_depth = r->mtp_depth,
                             .priority = r->priority,
                             .logprobs = r->logprobs,
                             .hand = r->hand,
                             .pen = r->pen,
                             .ids = prompt,
                             .n_ids = prompt ? r->n_prompt : 0};
        prompt = NULL;
        if (h.ids) /* the decode role registers the generated tokens' blocks under it */
            h.pfx_seed = prefix_key(p, r, &h.pfx_la);
        r->seq = -1;
        r->hand = NULL;
        r->pen = NULL;
        prefill_req_remove(p, r);
        runtime_handoff_local(rt, &h);
    }
    free(prompt); /* a stop token ended it: not handed over */
}

int prefill_step(void *st)
{
    prefill_role *p = st;
    runtime_t *rt = p->rt;
    const worker_compute *cp = &rt->cp;
    const int vocab = cp->mc->vocab_size;
    const int chunk = (int)rt->set.prefill_chunk_tokens;
    int n = 0, budget = (int)rt->set.max_batch_tokens;
    int blocked = prefill_blocked(p);
    int echo_taken = 0; /* an echo prompt's chunk is in the batch (one at most) */
    /* Prompts being computed continue (they are ahead in arrival order), then queued
     * online prompts, then queued offline ones (priority 1: flex and Batch API work waits
     * for online prompts that came after it, as vLLM's priority scheduling orders them),
     * each in arrival order until one does not fit (FIFO within a tier: no overtaking) or
     * the budget of tokens is spent. Pass 0 is the running prompts, 1 online, 2 offline. */
    int stop = 0;
    for (int pass = 0; pass < 3 && !stop; pass++) {
        for (int i = 0; i < p->n_reqs && n < cp->max_items && budget > 0; i++) {
            preq *r = p->reqs[i];
            if (pass == 0 ? r->state != PREQ_PREFILLING
                          : r->state != PREQ_QUEUED || (r->priority > 0) != (pass == 2))
                continue;
            if (r->echo && echo_taken) {
                stop = 1; /* the next batch takes it (FIFO: nothing after it either) */
                break;
            }
            if (r->state == PREQ_QUEUED) {
                if (blocked)
                    continue;
                if (admit(p, r) < 0) { /* until a prompt leaves or the free blocks change */
                    blocked = p->blocked = 1;
                    p->blocked_free = kvcache_n_free_blocks(cp->kv);
                    continue;
                }
                r->blk_sent = 0; /* cached blocks, if any, go with the first chunk */
            }
            int take = r->n_prompt - r->n_done;
            take = take < chunk ? take : chunk;
            if (r->echo) {
                take = take < PREFILL_ECHO_CHUNK ? take : PREFILL_ECHO_CHUNK;
                echo_taken = 1;
            }
            take = take < budget ? take : budget;
            r->n_chunk = take;
            budget -= take;
            p->batch_reqs[n++] = r;
        }
    }
    if (n == 0)
        return 0;
    /* Start the transfers of newly admitted prompts before computing, so that layers
     * stream as they finish. */
    int64_t t_start = proto_now_us();
    int m = 0, hid_rows = 0;
    for (int i = 0; i < n; i++) {
        preq *r = p->batch_reqs[i];
        int fresh = r->state == PREQ_QUEUED;
        r->state = PREQ_PREFILLING;
        if (fresh)
            r->t_start_us = t_start;
        if (fresh && r->dep[0] && r->max_tokens > 1 && transfer_begin(p, r) < 0)
            continue;
        r->blk_upto = blocks_complete(p, r);
        log_rdebug(r->rid, "prefill chunk [%d, %d) of %d, KV blocks [%d, %d) to send", r->n_done,
                   r->n_done + r->n_chunk, r->n_prompt, r->blk_sent,
                   r->xfer ? r->blk_upto : r->blk_sent);
        p->batch_reqs[m] = r;
        p->batch[m] = (model_seq_batch){.seq = r->seq,
                                        .pos = r->n_done,
                                        .n_tokens = r->n_chunk,
                                        .tokens = r->prompt + r->n_done,
                                        .logits_all = r->echo,
                                        .logits = r->echo ? p->echo_logits
                                                          : p->logits + (size_t)m * vocab};
        if (r->mtp_depth > 0) { /* h_0 of every position, for the MTP modules */
            p->batch[m].hidden = p->hid + (size_t)hid_rows * cp->mc->dim;
            p->batch[m].hidden_all = 1;
            hid_rows += r->n_chunk;
        }
        m++;
    }
    p->n_batch = m;
    if (m == 0)
        return 1;
    if (model_forward(cp->mctx, cp->kv, p->batch, m, on_layer, p) < 0) {
        fail_batch(p, m, "prefill");
        return 1;
    }
    if (mtp_pass(p, m) < 0) { /* MTP modules over the chunks; their layers to kvx */
        fail_batch(p, m, "MTP prefill");
        return 1;
    }
    compute_pad_prefill(cp, p->batch, m, t_start); /* --emulate: the cost model's time */
    p->n_batch = 0;
    for (int i = 0; i < m; i++) {
        preq *r = p->batch_reqs[i];
        r->n_done += r->n_chunk;
        r->blk_sent = r->blk_upto;
        rt->tokens_in += (uint64_t)r->n_chunk;
        float *last = p->batch[i].logits;
        if (r->echo) {
            echo_chunk(p, r, r->n_done - r->n_chunk, r->n_chunk);
            last = p->echo_logits + (size_t)(r->n_chunk - 1) * vocab;
        }
        if (r->n_done == r->n_prompt) /* else its next chunk runs in the next iteration */
            prompt_done(p, r, last);
    }
    return 1;
}
