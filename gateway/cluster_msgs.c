/* cluster_msgs: the messages workers send the cluster on the ctl socket (cluster.h):
 * REGISTER, HEARTBEAT, TOKENS, FINISH, ERROR, BYE, one per call of cluster_on_ctl. A
 * message about a request counts only if it names the request's current attempt and
 * comes from one of its workers (attempt_of). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "cluster_internal.h"
#include "evzmq.h"
#include "log.h"
#include "protocol.h"

// --- messages from workers

/* Whether REGISTER m fits the cluster: the gateway's model (fingerprint) and the KV block
 * size every worker must share (KV_BEGIN's layout check on the decode side compares it, as
 * live migration between decode workers does; the rest of that layout is the model's).
 * self: the worker's current entry, if any (it does not pin the block size for itself).
 * Returns 0, or -1 with the reason in why. */
static int registration_check(const cluster_t *c, const proto_msg *m, const worker_t *self,
                              char *why, size_t cap)
{
    if (c->p.model_fingerprint && m->fingerprint != c->p.model_fingerprint) {
        snprintf(why, cap,
                 "model fingerprint %016llx, the gateway's model has %016llx (another model, "
                 "or another conversion of it)",
                 (unsigned long long)m->fingerprint,
                 (unsigned long long)c->p.model_fingerprint);
        return -1;
    }
    int want = c->p.kv_block_size;
    const char *by = "--kv-block-size";
    if (!want) {
        /* every live worker has the pinned size; name the one registered first (the list is
         * newest first, so the last live entry) */
        for (const worker_t *w = c->workers; w; w = w->next) {
            if (w != self && !w->dead) {
                want = w->block_size;
                by = w->id;
            }
        }
    }
    if (want && m->block_size != want) {
        snprintf(why, cap, "KV block size %d tokens, the cluster's is %d (%s%s)", m->block_size,
                 want, c->p.kv_block_size ? "" : "pinned by worker ", by);
        return -1;
    }
    return 0;
}

static refused_worker *refused_find(cluster_t *c, const char *id)
{
    for (refused_worker *r = c->refused; r < c->refused + CLUSTER_MAX_REFUSED; r++)
        if (r->id[0] && strcmp(r->id, id) == 0)
            return r;
    return NULL;
}

/* Refuse REGISTER m: answer REGISTER_ACK with PROTO_ERR_LAYOUT and the reason (the worker
 * exits, RUNTIME_EXIT_REFUSED), drop the id's current entry if it has one, and keep it in
 * the refused list. Logged, counted and published once per worker process (id and pid), so
 * a worker that sends REGISTER again (an older one that does not know refusals) is not
 * logged at every retry. */
static void refuse(cluster_t *c, const proto_msg *m, worker_t *w, const unsigned char *id,
                   size_t id_len, const char *why)
{
    int64_t now = proto_now_us();
    refused_worker *r = refused_find(c, m->worker_id);
    int fresh = !r || r->pid != m->pid;
    if (!r) { /* a free slot, or the one refused longest ago */
        r = c->refused;
        for (refused_worker *x = c->refused; x < c->refused + CLUSTER_MAX_REFUSED; x++) {
            if (!x->id[0]) {
                r = x;
                break;
            }
            if (x->last_us < r->last_us)
                r = x;
        }
        memset(r, 0, sizeof(*r));
        snprintf(r->id, sizeof(r->id), "%s", m->worker_id);
    }
    if (fresh) {
        if (!r->n_refused || strcmp(r->reason, why) != 0)
            log_warn("worker %s (%s, pid %d) refused: %s", m->worker_id, proto_role_str(m->role),
                     m->pid, why);
        else
            log_debug("worker %s (pid %d) refused again: %s", m->worker_id, m->pid, why);
        r->n_refused++;
        c->n_refused++;
    }
    r->role = m->role;
    r->pid = m->pid;
    r->last_us = now;
    snprintf(r->reason, sizeof(r->reason), "%s", why);
    if (w) /* it ran with a configuration that fitted: that process is gone */
        cluster_worker_remove(c, w, "registered again with a configuration that does not fit");
    if (fresh && c->observer) {
        cluster_event ev = {.type = CLUSTER_EV_WORKER_REFUSED, .worker = m->worker_id,
                            .role = m->role, .reason = why};
        c->observer(&ev, c->observer_ud);
    }
    proto_msg ack;
    proto_msg_init(&ack, PROTO_REGISTER_ACK);
    ack.heartbeat_ms = c->p.heartbeat_ms;
    ack.code = PROTO_ERR_LAYOUT;
    snprintf(ack.message, sizeof(ack.message), "%s", why);
    if (wire_send(c->sock, id, id_len, &ack, NULL, 0, ZMQ_DONTWAIT) < 0)
        log_debug("REGISTER_ACK (refusal) to %s: %s", m->worker_id, zmq_strerror(errno));
    evzmq_after_send(c->watch);
    if (w)
        schedule_dispatch(c);
}

/* A new incarnation of w registered in another role than the one it was last ordered to
 * (the launcher, compose and Kubernetes restart a worker in the role it was started with):
 * order it back, so that a role change made by an operator or the tidal policy outlives a
 * crash (a fresh-user trial's crash undid changes and left no decode worker). Not when that
 * would leave the role it registered in with no worker (the guard of cluster_set_role).
 * A worker removed (declared dead) before it came back is remembered by its id (c->roles).
 * same: the registration is the end of an ordered change. */
static void restore_role(cluster_t *c, worker_t *w, int same)
{
    int want = w->assigned_role;
    if (same || !want || want == w->role || w->role == PROTO_ROLE_MIXED ||
        (want != PROTO_ROLE_PREFILL && want != PROTO_ROLE_DECODE))
        return;
    if (cluster_n_capable(c, w->role, w) < 1) {
        log_warn("worker %s came back as %s, not %s as ordered before: it stays (the last %s "
                 "worker)",
                 w->id, proto_role_str(w->role), proto_role_str(want), proto_role_str(w->role));
        w->assigned_role = w->role;
        return;
    }
    log_info("worker %s came back as %s: restoring the role it was ordered to, %s", w->id,
             proto_role_str(w->role), proto_role_str(want));
    cluster_role_order(c, w, want, "restore after restart");
}

static void handle_register(cluster_t *c, const proto_msg *m, const unsigned char *id,
                            size_t id_len)
{
    if (strlen(m->worker_id) != id_len || memcmp(m->worker_id, id, id_len) != 0) {
        log_warn("REGISTER from routing id '%.*s' names worker '%s': ignored (the routing "
                 "id must be the worker id)",
                 (int)id_len, (const char *)id, m->worker_id);
        return;
    }
    if ((m->role == PROTO_ROLE_DECODE) && !m->kv_endpoint[0]) {
        log_warn("worker %s: decode worker without a kv endpoint: ignored", m->worker_id);
        return;
    }
    worker_t *w = worker_find(c, id, id_len);
    char why[PROTO_MESSAGE_LEN];
    if (registration_check(c, m, w, why, sizeof(why)) < 0) {
        refuse(c, m, w, id, id_len, why);
        return;
    }
    refused_worker *was = refused_find(c, m->worker_id);
    if (was) /* it fits now (restarted with the right settings) */
        memset(was, 0, sizeof(*was));
    int old_role = w ? w->role : 0, old_pid = w ? w->pid : 0;
    int ordered = w && w->changing && w->pid == m->pid; /* the end of a role change */
    if (ordered) {
        cluster_role_change_done(c, w, m->role);
    } else if (w && (w->pid != m->pid || w->role != m->role)) {
        /* a new incarnation (restart or role change): what the old one had is lost */
        cluster_worker_fail_requests(c, w, "worker re-registered");
    }
    if (w && (w->pid != m->pid || w->role != m->role))
        cluster_route_forget(w); /* another process or role: its prefix cache is not that */
    int is_new = !w;
    if (!w) {
        w = calloc(1, sizeof(*w));
        if (!w) {
            log_error("out of memory registering worker %s", m->worker_id);
            return;
        }
        memcpy(w->id, id, id_len);
        w->id_len = id_len;
        w->next = c->workers;
        c->workers = w;
        for (remembered_role *r = c->roles; r < c->roles + REMEMBERED_ROLES; r++) {
            if (r->id[0] && strcmp(r->id, w->id) == 0) { /* removed while ordered there */
                w->assigned_role = r->role;
                r->id[0] = '\0';
            }
        }
    }
    w->role = m->role;
    w->state = PROTO_STATE_READY;
    w->changing = 0;
    w->target_role = 0;
    w->emulated = m->emulated;
    w->mtp_depth = m->mtp_depth;
    w->pid = m->pid;
    snprintf(w->kvep, sizeof(w->kvep), "%s", m->kv_endpoint);
    snprintf(w->kvpk, sizeof(w->kvpk), "%s", m->kv_pubkey);
    w->n_ctx = m->n_ctx;
    w->block_size = m->block_size;
    w->max_seqs = m->max_seqs;
    w->kv_total = m->kv_blocks_total;
    w->kv_free = m->kv_blocks_free;
    w->last_seen_us = proto_now_us();
    if (is_new || old_role != w->role)
        w->role_since_us = w->last_seen_us;
    w->dead = 0;
    w->full = 0;
    log_info("worker %s %s: role %s, pid %d, kv %s%s%s, n_ctx %d, kv blocks %d/%d of %d "
             "tokens, max_seqs %d",
             w->id, is_new ? "registered" : "re-registered", proto_role_str(w->role), w->pid,
             w->kvep[0] ? w->kvep : "-", w->kvpk[0] ? " key " : "", w->kvpk, w->n_ctx,
             w->kv_free, w->kv_total, w->block_size, w->max_seqs);
    if (is_new || (old_role == w->role && old_pid != w->pid)) {
        notify(c, CLUSTER_EV_WORKER_UP, w, 0, is_new ? "registered" : "restarted");
    } else if (old_role != w->role && c->observer) {
        cluster_event ev = {.type = CLUSTER_EV_WORKER_ROLE, .worker = w->id, .role = w->role,
                            .old_role = old_role, .state = w->state,
                            .reason = ordered ? "role change" : "re-registered"};
        c->observer(&ev, c->observer_ud);
    }
    proto_msg ack;
    proto_msg_init(&ack, PROTO_REGISTER_ACK);
    ack.heartbeat_ms = c->p.heartbeat_ms;
    cluster_send_to(c, w, &ack);
    /* back after it was declared dead (cut off, or silent): drop what it held (before any
     * new attempt is routed to it: dispatch is deferred) */
    cluster_send_owed_cancels(c, w, w->pid);
    restore_role(c, w, ordered);
    schedule_dispatch(c);
}

static void send_bye(cluster_t *c, const unsigned char *id, size_t id_len, const char *wid)
{
    proto_msg m;
    proto_msg_init(&m, PROTO_BYE);
    snprintf(m.worker_id, sizeof(m.worker_id), "%s", wid);
    if (wire_send(c->sock, id, id_len, &m, NULL, 0, ZMQ_DONTWAIT) < 0)
        log_debug("BYE to %s: %s", wid, zmq_strerror(errno));
    evzmq_after_send(c->watch);
}

static void handle_heartbeat(cluster_t *c, worker_t *w, const proto_msg *m, const unsigned char *id,
                             size_t id_len)
{
    if (!w || w->dead) {
        log_info("heartbeat from unknown worker %s: asking it to register", m->worker_id);
        send_bye(c, id, id_len, m->worker_id);
        return;
    }
    /* while a role change is on, a heartbeat sent before the worker saw ROLE (still ready)
     * must not put it back into routing */
    int st = w->changing && m->state == PROTO_STATE_READY ? PROTO_STATE_CHANGING : m->state;
    int changed = w->state != st;
    const char *st_name = st == PROTO_STATE_DRAINING   ? "draining"
                          : st == PROTO_STATE_CHANGING ? "changing role"
                                                       : "ready";
    if (changed)
        log_info("worker %s is now %s", w->id, st_name);
    w->state = st;
    if (changed)
        notify(c, CLUSTER_EV_WORKER_STATE, w, 0, st_name);
    w->emulated = m->emulated;
    w->n_role_changes = m->n_role_changes;
    w->role_change_us = m->role_change_us;
    w->tok_in = m->tokens_in;
    w->tok_out = m->tokens_out;
    w->kvx_tx = m->kvx_tx;
    w->kvx_rx = m->kvx_rx;
    w->spec = m->spec;
    w->mig = m->mig;
    w->pc_queries = m->prefix_queries;
    w->pc_hits = m->prefix_hits;
    if (w->role == PROTO_ROLE_PREFILL || w->role == PROTO_ROLE_MIXED)
        cluster_route_summary(w, m->pfx);
    w->n_preemptions = m->n_preemptions;
    w->running = m->running;
    w->moved_in = 0; /* its running count includes what arrived */
    w->queued = m->queued;
    w->qtok = m->queued_prompt_tokens;
    w->kv_total = m->kv_blocks_total;
    w->kv_free = m->kv_blocks_free;
    w->full = 0;
    schedule_dispatch(c);
}

/* The request's current attempt, if the wire rid names it and the sender is one of its
 * workers. A message of an earlier attempt (a worker that was slow to see its CANCEL)
 * names another attempt and is ignored, so its tokens can never be taken for the new
 * attempt's. */
static req_t *attempt_of(cluster_t *c, uint64_t wire, worker_t *w)
{
    req_t *r = req_find(c, wire >> WIRE_ATTEMPT_BITS);
    if (!r || r->queued || !w || (r->pw != w && r->dw != w && r->mw != w) ||
        wire != wire_rid(r))
        return NULL;
    return r;
}

/* Keep the durations a worker of the current attempt reported (TOKENS, FINISH). */
static void note_timing(req_t *r, const worker_t *w, const proto_msg *m)
{
    cluster_req_timing *t = r->timing;
    if (!t)
        return;
    /* the decode worker forwards the prefill's durations (KV_END): its first TOKENS may
     * overtake the prefill worker's own, and end the request before that one arrives */
    if ((w == r->pw || (w == r->dw && !t->prefill_us)) && (m->queue_us || m->prefill_us)) {
        t->worker_queue_us = m->queue_us;
        t->prefill_us = m->prefill_us;
    }
    if (w == r->dw && (m->xfer_us || m->xfer_bytes))
        t->xfer_us = m->xfer_us, t->xfer_bytes = m->xfer_bytes;
    if (w == r->dw && m->step_us)
        t->step_us = m->step_us;
}

static void handle_tokens(cluster_t *c, worker_t *w, const proto_msg *m);

/* TOKENS m from r's decode worker start past what is known: when the prefill worker's
 * first token has not come yet (it travels over another connection, and the decode worker
 * repeats it only without logprobs), keep m (and what follows it in order) until it does,
 * instead of re-running the request. Returns 1 if held, 0 when the gap is a real loss. */
static int hold_tokens(req_t *r, const worker_t *w, const proto_msg *m)
{
    if (w != r->dw || !r->pw || r->pw == w || r->p_started || r->n_gen != r->base ||
        m->n_tokens < 1)
        return 0;
    proto_msg *h = r->held;
    if (h && (h->index + h->n_tokens != m->index || r->held_finish ||
              h->n_tokens + m->n_tokens > r->max_tokens || !h->lps != !m->lps))
        return 0;
    int n0 = h ? h->n_tokens : 0, n = n0 + m->n_tokens;
    int *tok = realloc(h ? h->tokens : NULL, (size_t)n * sizeof(int));
    if (!tok)
        return 0;
    if (!h) {
        h = calloc(1, sizeof(*h));
        if (!h) {
            free(tok);
            return 0;
        }
        proto_msg_init(h, PROTO_TOKENS);
        h->rid = m->rid;
        h->index = m->index;
        h->xfer_us = m->xfer_us, h->xfer_bytes = m->xfer_bytes, h->step_us = m->step_us;
        h->queue_us = m->queue_us, h->prefill_us = m->prefill_us;
        r->held = h;
    }
    h->tokens = tok;
    if (m->lps) {
        proto_logprob *lps = realloc(h->lps, (size_t)n * sizeof(*lps));
        if (!lps) {
            req_drop_held(r);
            return 0;
        }
        memcpy(lps + n0, m->lps, (size_t)m->n_tokens * sizeof(*lps));
        h->lps = lps;
    }
    memcpy(tok + n0, m->tokens, (size_t)m->n_tokens * sizeof(int));
    h->n_tokens = n;
    h->rng = m->rng;
    log_rdebug(r->rid, "TOKENS [%d, %d) from %s before the prefill worker's first token: held",
               m->index, m->index + m->n_tokens, w->id);
    return 1;
}

/* The prefill worker's first token came: hand r the decode worker's held TOKENS, then the
 * FINISH held after them. */
static void replay_held(cluster_t *c, req_t *r)
{
    proto_msg *h = r->held;
    int fin = r->held_finish;
    worker_t *dw = r->dw;
    uint64_t wire = h->rid;
    r->held = NULL;
    r->held_finish = 0;
    handle_tokens(c, dw, h);
    proto_msg_clear(h);
    free(h);
    /* r may have ended (max_tokens, a stop string): look its attempt up again */
    if (fin && (r = attempt_of(c, wire, dw)) != NULL)
        cluster_req_end_finish(c, r, fin - 1, 0);
}

static void handle_tokens(cluster_t *c, worker_t *w, const proto_msg *m)
{
    req_t *r = attempt_of(c, m->rid, w);
    if (!r && cluster_late_prefill(c, m->rid)) {
        /* the decode worker's TOKENS (they repeat the first token) ended it first: the
         * prefill worker ends its part by itself, a CANCEL would only turn its finished
         * transfer into a cancelled one */
        log_rdebug(m->rid, "TOKENS from %s after the request ended: ignored",
                   w ? w->id : "unknown worker");
        return;
    }
    if (!r) {
        /* an attempt the gateway gave up on (re-ran elsewhere, finished, or never knew:
         * its CANCEL was lost in a partition): the worker is told to stop it, so its KV is
         * freed at its next token instead of when it reaches max_tokens */
        log_rdebug(m->rid, "TOKENS from %s for no current attempt: cancelled there",
                   w ? w->id : "unknown worker");
        if (w && !w->dead) {
            proto_msg cm;
            proto_msg_init(&cm, PROTO_CANCEL);
            cm.rid = m->rid;
            cluster_send_to(c, w, &cm);
        }
        return;
    }
    for (int i = 0; c->p.n_vocab > 0 && i < m->n_tokens; i++) {
        if (m->tokens[i] < 0 || m->tokens[i] >= c->p.n_vocab) {
            /* a worker that produces ids outside the model's vocabulary is broken (the
             * registration check makes a wrong model unlikely): never turn them into text,
             * re-run the request elsewhere from what is known */
            char why[160];
            snprintf(why, sizeof(why), "TOKENS from %s hold id %d at %d, outside the vocabulary "
                     "of %d: dropped", w ? w->id : "unknown worker", m->tokens[i], i,
                     c->p.n_vocab);
            log_warn("%s", why);
            if (w)
                req_shun(r, w);
            cluster_req_retry(c, r, 1, why);
            return;
        }
    }
    if (m->echo) { /* the prompt's log-probabilities (echo): not generated tokens */
        if (r->echo && m->lps && m->index >= 1) {
            r->since_us = proto_now_us();
            r->cb->on_prompt_logprobs(r->ud, m->index, m->tokens, m->lps, m->n_tokens);
        } else {
            log_warn("TOKENS echo from %s for request %llu that did not ask for it (or without "
                     "lp): dropped", w ? w->id : "unknown worker", (unsigned long long)r->rid);
        }
        return;
    }
    if (r->logprobs && !m->lps) {
        /* asked for with the request: a worker that leaves them out is not serving it */
        char why[160];
        snprintf(why, sizeof(why), "TOKENS from %s without the log-probabilities asked for",
                 w ? w->id : "unknown worker");
        log_warn("%s", why);
        cluster_req_retry(c, r, 1, why);
        return;
    }
    if (w == r->pw && !r->p_started) {
        r->p_started = 1;
        w->pending_qtok -= r->p_qtok;
    }
    if (w == r->dw && !r->d_started) {
        r->d_started = 1;
        if (r->pw && r->pw != w)
            cluster_pair_ok(r->pw, w); /* its KV arrived: the link works */
        w->pending_blocks -= r->d_blocks;
    }
    if (w == r->dw && r->mw) { /* the new decode worker has it: the move is over */
        log_rdebug(r->rid, "migrated from %s to %s", r->mw->id, w->id);
        r->mw = NULL;
    }
    r->since_us = proto_now_us();
    note_timing(r, w, m);
    long start = (long)r->base + m->index;
    if (start > r->n_gen && hold_tokens(r, w, m))
        return;
    if (start > r->n_gen) { /* tokens in between were lost: re-run from what is known */
        char why[160];
        snprintf(why, sizeof(why), "TOKENS from %s start at %ld but only %d are known", w->id,
                 start, r->n_gen);
        /* a counted failure when the attempt brought no token at all: a worker that always
         * skips ahead would otherwise have the request re-run for ever */
        cluster_req_retry(c, r, r->n_gen == r->base, why);
        return;
    }
    int skip = (int)(r->n_gen - start);
    int n_new = m->n_tokens - skip;
    if (n_new <= 0)
        return;
    if (n_new > r->max_tokens - r->n_gen)
        n_new = r->max_tokens - r->n_gen;
    if (n_new <= 0)
        return;
    int *dst = r->tokens + r->n_prompt + r->n_gen;
    memcpy(dst, m->tokens + skip, (size_t)n_new * sizeof(int));
    r->n_gen += n_new;
    /* the sampler state after these tokens: a re-run (retry, preemption) continues the same
     * random stream from here (exact for plain decoding; docs/api.md "seed") */
    if (m->rng && skip + n_new == m->n_tokens)
        r->rng = m->rng;
    if (r->cb->on_tokens(r->ud, dst, r->logprobs ? m->lps + skip : NULL, n_new)) {
        /* the owner completed it (stop string, EOS, max_tokens). At max_tokens the workers
         * end it by themselves (they count too): a CANCEL would only turn their clean
         * finish into a cancellation in their logs and transfer counters. */
        cluster_req_detach(c, r, r->n_gen < r->max_tokens);
        cluster_req_unlink(c, r);
        req_free(r);
        return;
    }
    if (r->held && w == r->pw)
        replay_held(c, r);
}

/* A TOKENS message from w that could not be decoded (an id below 0 or past 2^31, a bad
 * field): its tokens are lost like those of an out-of-vocabulary message, so the attempt it
 * names is re-run from what is known now, not after --request-timeout-ms of silence. */
static void lost_tokens(cluster_t *c, worker_t *w, proto_type_t type, uint64_t wire)
{
    req_t *r = type == PROTO_TOKENS ? attempt_of(c, wire, w) : NULL;
    if (!r)
        return;
    char why[160];
    snprintf(why, sizeof(why), "malformed TOKENS from %s: dropped", w->id);
    log_warn("%s", why);
    req_shun(r, w);
    cluster_req_retry(c, r, 1, why);
}

static void handle_finish(cluster_t *c, worker_t *w, const proto_msg *m)
{
    req_t *r = attempt_of(c, m->rid, w);
    if (!r)
        return;
    if (r->held && w == r->dw && !r->held_finish) {
        r->held_finish = m->reason + 1; /* after the held TOKENS, once they can be used */
        return;
    }
    note_timing(r, w, m);
    /* A FINISH from the prefill worker (e.g. EOS as the first token) means the decode
     * worker, if another one, must not go on. */
    cluster_req_end_finish(c, r, m->reason, w != r->dw);
}

/* Codes a prefill worker's KV transfer ends with when the link to its decode worker (not
 * the request, not the prefill worker itself) is at fault. */
static int kv_link_error(int code)
{
    return code == PROTO_ERR_TIMEOUT || code == PROTO_ERR_UNAVAILABLE ||
           code == PROTO_ERR_CHECKSUM || code == PROTO_ERR_PROTOCOL;
}

static void handle_error(cluster_t *c, worker_t *w, const proto_msg *m)
{
    req_t *r = attempt_of(c, m->rid, w);
    if (!r)
        return;
    char why[PROTO_MESSAGE_LEN + 96];
    snprintf(why, sizeof(why), "worker %s: %s%s%s", w->id, proto_err_str(m->code),
             m->message[0] ? ": " : "", m->message);
    if (m->retryable) {
        if (w == r->mw) { /* the move failed (its KV is gone): re-run from its tokens */
            cluster_req_retry(c, r, 0, why);
        } else if (w->changing && w == r->pw && m->code == PROTO_ERR_UNAVAILABLE) {
            cluster_req_retry(c, r, 0, why); /* a prompt handed back by a role change */
        } else if (m->code == PROTO_ERR_NOSPACE) { /* load, not failure: wait for room */
            r->dw->full = 1;
            cluster_req_retry(c, r, 0, why);
        } else if (m->code == PROTO_ERR_PREEMPTED && w == r->dw) {
            /* the decode worker ran out of KV blocks and freed it: re-run by recomputation
             * from prompt + tokens so far, first in its queue, no failure counted; no new
             * decode work there until its next heartbeat shows what is free */
            log_rinfo(r->rid, "preempted by %s after %d generated tokens: re-queued", w->id,
                      r->n_gen);
            w->full = 1;
            cluster_req_retry(c, r, 0, why);
        } else {
            if (w == r->pw && r->dw && r->dw != w && !r->d_started && kv_link_error(m->code))
                cluster_pair_failed(c, w, r->dw); /* the prefill worker could not hand it over */
            cluster_req_retry(c, r, 1, why);
        }
    } else if (m->code == PROTO_ERR_BAD_REQUEST) {
        cluster_req_end_error(c, r, 400, "invalid_request_error", "bad_request", why);
    } else {
        cluster_req_end_error(c, r, 500, "server_error", "worker_error", why);
    }
}

/* BUNDLE: the TOKENS and FINISH messages a worker gathered in one loop iteration, each a
 * header of its own in a payload frame, decoded and validated like a message and handled in
 * order. Anything else in a bundle is malformed: logged and dropped (the rest is kept), and
 * so are frames past PROTO_BUNDLE_MAX. */
static void handle_bundle(cluster_t *c, worker_t *w, const unsigned char *id, size_t id_len)
{
    int n = wire_envelope_n_frames(c->env);
    if (n == 0)
        log_warn("empty BUNDLE from '%.*s': dropped", (int)id_len, (const char *)id);
    if (n > PROTO_BUNDLE_MAX) { /* a worker never sends more: handle the first ones */
        log_warn("BUNDLE from '%.*s' holds %d messages (at most %d): the last %d dropped",
                 (int)id_len, (const char *)id, n, PROTO_BUNDLE_MAX, n - PROTO_BUNDLE_MAX);
        n = PROTO_BUNDLE_MAX;
    }
    for (int i = 0; i < n; i++) {
        zmq_msg_t *f = wire_envelope_frame(c->env, i);
        proto_msg m;
        char err[160];
        if (proto_decode(zmq_msg_data(f), zmq_msg_size(f), &m, err, sizeof(err)) < 0) {
            log_warn("dropped message %d of a BUNDLE from '%.*s': %s", i, (int)id_len,
                     (const char *)id, err);
            if (proto_peek(zmq_msg_data(f), zmq_msg_size(f), &m.type, &m.rid) == 0)
                lost_tokens(c, w, m.type, m.rid);
            continue;
        }
        if (m.type == PROTO_TOKENS)
            handle_tokens(c, w, &m);
        else if (m.type == PROTO_FINISH)
            handle_finish(c, w, &m);
        else
            log_warn("dropped %s in a BUNDLE from '%.*s': only TOKENS and FINISH may be bundled",
                     proto_type_str(m.type), (int)id_len, (const char *)id);
        proto_msg_clear(&m);
    }
}

void cluster_on_ctl(void *sock, void *ud)
{
    cluster_t *c = ud;
    int rc = wire_recv(sock, 1, c->env, ZMQ_DONTWAIT);
    if (rc == -1) { /* malformed: dropped; lost tokens of a worker's attempt are re-run */
        size_t n;
        const unsigned char *from = wire_envelope_identity(c->env, &n);
        const proto_msg *lost = wire_envelope_msg(c->env);
        worker_t *w = n ? worker_find(c, from, n) : NULL;
        if (w && !w->dead)
            lost_tokens(c, w, lost->type, lost->rid);
        wire_envelope_reset(c->env);
        return;
    }
    if (rc <= 0) {
        if (rc == -2 && errno != EAGAIN)
            log_error("ctl receive: %s", zmq_strerror(errno));
        return;
    }
    size_t id_len;
    const unsigned char *id = wire_envelope_identity(c->env, &id_len);
    const proto_msg *m = wire_envelope_msg(c->env);
    worker_t *w = worker_find(c, id, id_len);
    if (w && !w->dead)
        w->last_seen_us = proto_now_us();
    switch (m->type) {
    case PROTO_REGISTER:
        handle_register(c, m, id, id_len);
        break;
    case PROTO_HEARTBEAT:
        handle_heartbeat(c, w, m, id, id_len);
        break;
    case PROTO_TOKENS:
        handle_tokens(c, w, m);
        break;
    case PROTO_FINISH:
        handle_finish(c, w, m);
        break;
    case PROTO_BUNDLE:
        handle_bundle(c, w, id, id_len);
        break;
    case PROTO_ERROR:
        handle_error(c, w, m);
        break;
    case PROTO_BYE:
        if (w) {
            log_info("worker %s says BYE", w->id);
            cluster_worker_remove(c, w, "left (BYE)");
            schedule_dispatch(c);
        }
        break;
    default:
        log_warn("unexpected %s on the ctl socket from '%.*s': dropped", proto_type_str(m->type),
                 (int)id_len, (const char *)id);
        break;
    }
    wire_envelope_reset(c->env);
}
