/* cluster: see cluster.h. This file holds the requests' life, the workers' removal,
 * routing, the timers and the public calls; cluster_msgs.c handles the messages from
 * workers, cluster_roles.c live role changes and migration, cluster_tidal.c the offline
 * tier's aging and the tidal policy (cluster_internal.h: what they share).
 *
 * Data: a list of workers (few), a hash of requests by rid, and two intrusive lists of
 * requests: the FIFO of those waiting for workers and the list of those assigned. A
 * worker found dead is only flagged where it is found (the flag keeps it out of
 * routing); the dispatch event and the sweep timer reap flagged workers, re-running their
 * requests, so no list is changed while it is being walked. Dispatch itself runs from a
 * deferred event, never inside the caller of cluster_submit or a message handler.
 *
 * Offline tier: a second FIFO (oqueue) that dispatch reads only when the online queue is
 * empty, up to the policy's offline_max_running (n_off_running counts the offline requests
 * on the active list; promoted ones count as online). The policy runs from the sweep timer
 * every heartbeat_ms (cluster_tidal.c). */
#include "cluster.h"

#include <errno.h>
#include <event2/event.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "cluster_internal.h"
#include "evzmq.h"
#include "log.h"
#include "protocol.h"

#define MAX_MSGS_PER_CB 256
#define SWEEP_MS 100
#define DISPATCH_SCAN_MAX 64 /* queued requests tried per dispatch after a miss */

// --- small helpers

cluster_params cluster_default_params(void)
{
    cluster_params p = {
        .ctl_bind = "tcp://127.0.0.1:5557",
        .heartbeat_ms = 500,
        .dead_after_ms = 1500,
        .request_timeout_ms = 60000,
        .max_retries = 3,
        .max_queue = 1024,
        .routing = CLUSTER_ROUTING_CACHE_AWARE,
        .routing_load_weight = 0.25,
        .policy = policy_default_params(),
    };
    return p;
}

const char *cluster_routing_str(cluster_routing_t r)
{
    return r == CLUSTER_ROUTING_LEAST_LOADED ? "least-loaded" : "cache-aware";
}

int cluster_routing_parse(const char *s, cluster_routing_t *out)
{
    static const cluster_routing_t all[] = {CLUSTER_ROUTING_CACHE_AWARE,
                                            CLUSTER_ROUTING_LEAST_LOADED};
    for (size_t i = 0; s && i < sizeof(all) / sizeof(all[0]); i++) {
        if (strcmp(s, cluster_routing_str(all[i])) == 0) {
            *out = all[i];
            return 0;
        }
    }
    return -1;
}

static void active_add(cluster_t *c, req_t *r)
{
    list_push(&c->active, r, 0);
    if (r->offline && !r->promoted)
        c->n_off_running++;
}

static void active_remove(cluster_t *c, req_t *r)
{
    list_remove(&c->active, r);
    if (r->offline && !r->promoted)
        c->n_off_running--;
}

static void hash_remove(cluster_t *c, req_t *r)
{
    for (req_t **pp = bucket(c, r->rid); *pp; pp = &(*pp)->hnext) {
        if (*pp == r) {
            *pp = r->hnext;
            return;
        }
    }
}

/* Send m to worker w. A failure flags w dead (ROUTER_MANDATORY: EHOSTUNREACH when the
 * peer is gone; EAGAIN when its queue is full, which we treat the same way: a worker
 * that does not read its orders is not serving). Returns 0 or -1. */
int cluster_send_to(cluster_t *c, worker_t *w, const proto_msg *m)
{
    int rc = wire_send(c->sock, w->id, w->id_len, m, NULL, 0, ZMQ_DONTWAIT);
    evzmq_after_send(c->watch);
    if (rc < 0) {
        if (!w->dead)
            log_rwarn(m->rid, "send %s to worker %s failed (%s): worker declared dead",
                      proto_type_str(m->type), w->id, zmq_strerror(errno));
        if (!w->dead)
            snprintf(w->why, sizeof(w->why), "worker %s unreachable (%s)", w->id,
                     zmq_strerror(errno));
        w->dead = 1;
        schedule_dispatch(c);
        return -1;
    }
    return 0;
}

/* A worker declared dead may only be cut off: it then goes on with the attempts it holds
 * (a decode worker decodes them to max_tokens, holding their KV blocks) while they are
 * re-run elsewhere, and registers again once the network heals. Its CANCELs are kept for
 * then (found by tests/netns/test_multihost.py: after a 5 s partition of the gateway both
 * decode workers still ran every attempt the gateway had re-run). */
static void owe_cancel(cluster_t *c, const worker_t *w, uint64_t rid)
{
    owed_cancel *o = &c->owed[c->next_owed];
    c->next_owed = (c->next_owed + 1) % OWED_CANCELS;
    memcpy(o->id, w->id, w->id_len);
    o->id_len = w->id_len;
    o->pid = w->pid;
    o->rid = rid;
}

static void send_cancel(cluster_t *c, worker_t *w, uint64_t rid)
{
    if (!w)
        return;
    if (w->dead) {
        owe_cancel(c, w, rid);
        return;
    }
    proto_msg m;
    proto_msg_init(&m, PROTO_CANCEL);
    m.rid = rid;
    if (cluster_send_to(c, w, &m) < 0) /* just lost (flagged dead now) */
        owe_cancel(c, w, rid);
}

void cluster_send_owed_cancels(cluster_t *c, worker_t *w, int pid)
{
    int n = 0;
    for (owed_cancel *o = c->owed; o < c->owed + OWED_CANCELS && !w->dead; o++) {
        if (!o->id_len || o->id_len != w->id_len || memcmp(o->id, w->id, w->id_len) != 0)
            continue;
        if (o->pid != pid) { /* another process with this id never had the attempt */
            o->id_len = 0;
            continue;
        }
        proto_msg m;
        proto_msg_init(&m, PROTO_CANCEL);
        m.rid = o->rid;
        if (cluster_send_to(c, w, &m) < 0)
            break; /* gone again (flagged dead): the rest stay owed, this one too */
        o->id_len = 0;
        n++;
    }
    if (n)
        log_info("worker %s: %d CANCELs sent that were owed since it was declared dead (its "
                 "attempts then were re-run elsewhere)",
                 w->id, n);
}

// --- request life

/* Undo the attempt's bookkeeping on its workers; optionally CANCEL it there. */
void cluster_req_detach(cluster_t *c, req_t *r, int cancel)
{
    if (r->pw) {
        if (!r->p_started)
            r->pw->pending_qtok -= r->p_qtok;
        r->pw->n_assigned--;
    }
    if (r->dw) {
        if (!r->d_started)
            r->dw->pending_blocks -= r->d_blocks;
        r->dw->n_decode--;
        if (r->dw != r->pw)
            r->dw->n_assigned--;
    }
    if (!cancel && r->pw && r->dw && r->pw != r->dw && !r->p_started) {
        /* ended by the decode worker before the prefill worker's TOKENS arrived */
        c->late[c->next_late] = wire_rid(r);
        c->next_late = (c->next_late + 1) % LATE_PREFILLS;
    }
    if (cancel) {
        send_cancel(c, r->pw, wire_rid(r));
        if (r->dw != r->pw)
            send_cancel(c, r->dw, wire_rid(r));
        if (r->mw && r->mw != r->pw && r->mw != r->dw)
            send_cancel(c, r->mw, wire_rid(r));
    }
    r->pw = r->dw = r->mw = NULL;
    r->p_qtok = r->d_blocks = 0;
    req_drop_held(r);
}

int cluster_late_prefill(const cluster_t *c, uint64_t wire)
{
    for (int i = 0; wire && i < LATE_PREFILLS; i++)
        if (c->late[i] == wire)
            return 1;
    return 0;
}

/* Take r out of every table (the caller then reports and frees it). */
void cluster_req_unlink(cluster_t *c, req_t *r)
{
    hash_remove(c, r);
    if (r->queued)
        list_remove(qlist(c, r), r);
    else
        active_remove(c, r);
    if (r->promoted)
        c->n_promoted--;
}

void cluster_req_end_error(cluster_t *c, req_t *r, int status, const char *type,
                           const char *code, const char *msg)
{
    cluster_req_detach(c, r, 1);
    cluster_req_unlink(c, r);
    log_rwarn(r->rid, "request failed: %s", msg);
    r->cb->on_error(r->ud, status, type, code, msg);
    req_free(r);
}

void cluster_req_end_finish(cluster_t *c, req_t *r, int reason, int cancel)
{
    cluster_req_detach(c, r, cancel);
    cluster_req_unlink(c, r);
    log_rdebug(r->rid, "finished (%s) after %d tokens",
               reason == PROTO_FINISH_STOP ? "stop" : "length", r->n_gen);
    if (!r->offline) { /* the tidal policy's decode token term (cluster_policy_tick) */
        c->online_done++;
        c->online_output_tokens += r->n_gen;
    }
    r->cb->on_finish(r->ud, reason);
    req_free(r);
}

/* The current attempt failed: re-run r from prompt + tokens so far, or give up. counts: 0
 * for failures that say nothing about the request (a worker out of room). */
void cluster_req_retry(cluster_t *c, req_t *r, int counts, const char *why)
{
    if (counts && ++r->retries > c->p.max_retries) {
        char msg[PROTO_MESSAGE_LEN + 96];
        snprintf(msg, sizeof(msg), "the request failed %d times; last error: %s", r->retries, why);
        cluster_req_end_error(c, r, 503, "server_error", "worker_failure", msg);
        return;
    }
    if (r->n_gen >= r->max_tokens) { /* everything was generated: nothing to re-run */
        cluster_req_end_finish(c, r, PROTO_FINISH_LENGTH, 1);
        return;
    }
    log_rinfo(r->rid, "retrying (attempt %d) from %d prompt + %d generated tokens: %s",
              r->retries + 1, r->n_prompt, r->n_gen, why);
    notify(c, CLUSTER_EV_REQUEST_RETRY, NULL, r->rid, why);
    cluster_req_detach(c, r, 1);
    active_remove(c, r);
    r->queued = 1;
    r->since_us = proto_now_us();
    list_push(qlist(c, r), r, 1);
    schedule_dispatch(c);
}

/* Online load needs the room: cancel offline request r on its workers and put it back at
 * the head of the offline queue with its tokens so far (re-run later like a retry). */
void cluster_req_preempt(cluster_t *c, req_t *r)
{
    c->n_preempted++;
    log_rinfo(r->rid, "offline request preempted after %d generated tokens: re-queued",
              r->n_gen);
    notify(c, CLUSTER_EV_REQUEST_PREEMPT, NULL, r->rid, "online load");
    cluster_req_detach(c, r, 1);
    active_remove(c, r);
    r->queued = 1;
    r->since_us = proto_now_us();
    list_push(&c->oqueue, r, 1);
}

/* Flag w dead and re-run everything it had. */
void cluster_worker_fail_requests(cluster_t *c, worker_t *w, const char *why)
{
    req_t *next;
    for (req_t *r = c->active.head; r; r = next) {
        next = r->next;
        if (r->pw == w && r->dw != w && (r->d_started || (r->mw && r->mw_started))) {
            /* its part is done: the decode worker has the KV and is generating, so the
             * request goes on there; re-running it would only waste work (and, when
             * sampling, change the answer mid-stream) */
            w->n_assigned--;
            r->pw = NULL;
        } else if (r->pw == w || r->dw == w || r->mw == w) {
            /* (a worker that died moving r away: whether its KV arrived is unknown) */
            cluster_req_retry(c, r, 1, why);
        }
    }
}

void cluster_worker_remove(cluster_t *c, worker_t *w, const char *why)
{
    char reason[160];
    snprintf(reason, sizeof(reason), "%s", why); /* why may point into w */
    LOG_AT(w->dead ? LOG_LEVEL_WARN : LOG_LEVEL_INFO, 0, "worker %s (%s, pid %d) removed: %s",
           w->id, proto_role_str(w->role), w->pid, reason);
    w->dead = 1; /* out of routing while its requests move */
    notify(c, CLUSTER_EV_WORKER_DOWN, w, 0, reason);
    cluster_worker_fail_requests(c, w, reason);
    for (worker_t **pp = &c->workers; *pp; pp = &(*pp)->next) {
        if (*pp == w) {
            *pp = w->next;
            break;
        }
    }
    if (w->assigned_role) { /* for its next incarnation (restore_role) */
        remembered_role *m = &c->roles[c->next_role];
        c->next_role = (c->next_role + 1) % REMEMBERED_ROLES;
        snprintf(m->id, sizeof(m->id), "%s", w->id);
        m->role = w->assigned_role;
    }
    cluster_route_forget(w);
    free(w);
}

static void reap_dead(cluster_t *c)
{
    worker_t *next;
    for (worker_t *w = c->workers; w; w = next) {
        next = w->next;
        if (w->dead)
            cluster_worker_remove(c, w, w->why[0] ? w->why : "declared dead");
    }
}

// --- routing

static int bad_peer_slot(const worker_t *p, const worker_t *d)
{
    for (int i = 0; i < CLUSTER_BAD_PEERS; i++)
        if (p->bad_peer[i].id_len == d->id_len && !memcmp(p->bad_peer[i].id, d->id, d->id_len))
            return i;
    return -1;
}

void cluster_pair_failed(cluster_t *c, worker_t *p, const worker_t *d)
{
    (void)c;
    int i = bad_peer_slot(p, d);
    if (i < 0) { /* a free slot, else the one whose penalty ends first */
        i = 0;
        for (int j = 0; j < CLUSTER_BAD_PEERS; j++) {
            if (!p->bad_peer[j].id_len) {
                i = j;
                break;
            }
            if (p->bad_peer[j].until_us < p->bad_peer[i].until_us)
                i = j;
        }
        memcpy(p->bad_peer[i].id, d->id, d->id_len);
        p->bad_peer[i].id_len = d->id_len;
        p->bad_peer[i].fails = 0;
    }
    int fails = ++p->bad_peer[i].fails;
    int64_t pen = CLUSTER_PAIR_PENALTY_US;
    for (int k = 1; k < fails && pen < CLUSTER_PAIR_PENALTY_MAX_US; k++)
        pen *= 2;
    if (pen > CLUSTER_PAIR_PENALTY_MAX_US)
        pen = CLUSTER_PAIR_PENALTY_MAX_US;
    p->bad_peer[i].until_us = proto_now_us() + pen;
    log_warn("KV hand-off %s -> %s failed (%d in a row): the pair is avoided for %lld ms when "
             "another can serve", p->id, d->id, fails, (long long)(pen / 1000));
}

void cluster_pair_ok(worker_t *p, const worker_t *d)
{
    int i = bad_peer_slot(p, d);
    if (i >= 0) {
        p->bad_peer[i].id_len = 0;
        p->bad_peer[i].fails = 0;
    }
}

static int pair_avoided(const worker_t *p, const worker_t *d, int64_t now)
{
    if (p == d)
        return 0;
    int i = bad_peer_slot(p, d);
    return i >= 0 && p->bad_peer[i].until_us > now;
}

/* Choose (prefill, decode) for r: the decode/mixed worker must have room (KV blocks free
 * per its last heartbeat minus blocks promised since, a free sequence slot); among the
 * prefill workers that can feed it (pure prefill workers, or the mixed worker itself),
 * the one of least cost wins: its queued prompt tokens, plus with cache-aware routing the
 * tokens of r it would compute (those its prefix cache is not believed to hold,
 * cluster_route.c), so a prompt goes where its prefix is unless that worker's queue costs
 * more than computing the prefix again elsewhere; ties go to the decode worker with the
 * fewest sequences assigned, then the most free blocks (blocks are taken on demand: what a
 * worker has free now says little about what its sequences will take, and a burst of
 * requests would all go to the emptiest one until its next heartbeat). Returns 0 or -1
 * (nothing fits now). */
static int pick_pass(cluster_t *c, const req_t *r, worker_t **pw, worker_t **dw, int *never,
                     int avoid, int *n_avoided, int *n_busy)
{
    long best_load = -1, best_free = -1;
    int best_seqs = -1;
    int total = r->n_prompt + r->n_gen;
    int n_decoders = 0, n_could_fit = 0;
    int64_t now = proto_now_us();
    int cache_aware = c->p.routing == CLUSTER_ROUTING_CACHE_AWARE;
    for (worker_t *p = c->workers; p; p = p->next)
        p->route_hit = cache_aware && (p->role == PROTO_ROLE_PREFILL ||
                                       p->role == PROTO_ROLE_MIXED)
                           ? cluster_route_expected_hit(c, p, r)
                           : 0;
    for (worker_t *d = c->workers; d; d = d->next) {
        if (!usable(d) || (d->role != PROTO_ROLE_DECODE && d->role != PROTO_ROLE_MIXED))
            continue;
        n_decoders++;
        if (d->kv_total >= blocks_needed(r, d))
            n_could_fit++;
        if (!routable(c, d, now))
            continue;
        if (d->n_ctx > 0 && total >= d->n_ctx)
            continue;
        long free_blocks = (long)d->kv_free - d->pending_blocks;
        /* no room now: only counted (pairs not avoided that will take r once it frees) */
        int busy = d->full || free_blocks < blocks_needed(r, d) ||
                   (d->max_seqs > 0 && d->n_decode >= d->max_seqs);
        if (busy && (!avoid || d->kv_total < blocks_needed(r, d)))
            continue;
        for (worker_t *p = c->workers; p; p = p->next) {
            if (!routable(c, p, now))
                continue;
            if (p != d && (p->role != PROTO_ROLE_PREFILL || !d->kvep[0]))
                continue;
            if (p == d && p->role != PROTO_ROLE_MIXED)
                continue;
            if (p->n_ctx > 0 && total >= p->n_ctx)
                continue;
            if (avoid && (pair_avoided(p, d, now) || req_shuns(r, p) || req_shuns(r, d))) {
                *n_avoided += !busy;
                continue;
            }
            if (busy) {
                (*n_busy)++;
                continue;
            }
            /* least-loaded: its queued prompt tokens (the last heartbeat's, or those sent
             * since when more); cache-aware: the tokens it would compute for r, plus
             * --routing-load-weight times those it is expected to compute for what it
             * was sent (pending_qtok counts those: try_assign), not its queue's raw prompt
             * tokens, which would push a prompt away from the worker whose cache makes its
             * queue cheap. The weight is below 1 because queued prompts are computed
             * together, in one batch: each delays a new one by less than its own cost */
            long load = cache_aware ? (long)(c->p.routing_load_weight * p->pending_qtok) +
                                          total - p->route_hit
                        : p->qtok > p->pending_qtok ? p->qtok
                                                    : p->pending_qtok;
            if (best_load < 0 || load < best_load ||
                (load == best_load && d->n_decode < best_seqs) ||
                (load == best_load && d->n_decode == best_seqs && free_blocks > best_free)) {
                best_load = load;
                best_seqs = d->n_decode;
                best_free = free_blocks;
                *pw = p;
                *dw = d;
            }
        }
    }
    /* no decode worker could ever hold it, even empty: waiting would never end */
    *never = n_decoders > 0 && n_could_fit == 0;
    return best_load < 0 ? -1 : 0;
}

/* pick_pass avoiding pairs whose KV hand-offs failed lately, and the worker whose tokens r
 * could not use; when only such pairs could
 * take r, one of them (a link may have healed; waiting would only delay the request). A
 * pair not avoided whose decode worker has no room just now is waited for instead: sent
 * over the failed link, r would likely fail again after a lease and lose a retry. */
static int pick(cluster_t *c, const req_t *r, worker_t **pw, worker_t **dw, int *never)
{
    int n_avoided = 0, n_busy = 0;
    if (pick_pass(c, r, pw, dw, never, 1, &n_avoided, &n_busy) == 0)
        return 0;
    if (!n_avoided || n_busy)
        return -1;
    return pick_pass(c, r, pw, dw, never, 0, &n_avoided, &n_busy);
}

/* Try to start an attempt for queued request r. Returns 1 when assigned, 0 when nothing
 * fits now, -1 when the PREFILL could not be sent (the worker is flagged dead; r stays
 * queued), -2 when r's prompt and tokens so far need more KV blocks than any decode worker
 * has in total. */
static int try_assign(cluster_t *c, req_t *r)
{
    worker_t *pw = NULL, *dw = NULL;
    int never = 0;
    if (pick(c, r, &pw, &dw, &never) < 0)
        return never ? -2 : 0;
    proto_msg m;
    proto_msg_init(&m, PROTO_PREFILL);
    r->attempt++;
    m.rid = wire_rid(r);
    m.tokens = r->tokens;
    m.n_tokens = r->n_prompt + r->n_gen;
    m.max_tokens = r->max_tokens - r->n_gen;
    m.temperature = r->temperature;
    m.top_p = r->top_p;
    m.top_k = r->top_k;
    m.rng = r->rng;
    m.mtp_depth = r->mtp_depth;
    m.logprobs = r->logprobs;
    m.echo = r->echo;
    m.priority = r->offline && !r->promoted; /* preempted first on the decode worker */
    /* a retry (a worker failed, or handed the prompt back in a role change) queues by its
     * arrival at the worker, ahead of prompts admitted after it (FCFS, as vLLM's queue) */
    int64_t age = proto_now_us() - r->enq_us;
    m.age_us = age > 0 ? age : 0;
    if (r->samp) { /* the penalties count what earlier attempts generated, too */
        r->samp->n_gen = r->n_gen;
        m.samp = r->samp;
    }
    snprintf(m.decode_worker, sizeof(m.decode_worker), "%s", dw->id);
    snprintf(m.decode_endpoint, sizeof(m.decode_endpoint), "%s", pw == dw ? "" : dw->kvep);
    snprintf(m.decode_pubkey, sizeof(m.decode_pubkey), "%s", pw == dw ? "" : dw->kvpk);
    m.ts_us = proto_wall_us();
    if (cluster_send_to(c, pw, &m) < 0)
        return -1;
    list_remove(qlist(c, r), r);
    r->queued = 0;
    active_add(c, r);
    r->pw = pw;
    r->dw = dw;
    r->base = r->n_gen;
    r->p_started = r->d_started = 0;
    /* cache-aware: the tokens pw is expected to compute (its cache holds the rest) */
    r->p_qtok = m.n_tokens - (c->p.routing == CLUSTER_ROUTING_CACHE_AWARE ? pw->route_hit : 0);
    r->d_blocks = blocks_needed(r, dw);
    pw->pending_qtok += r->p_qtok;
    pw->n_assigned++;
    dw->pending_blocks += r->d_blocks;
    dw->n_decode++;
    if (dw != pw)
        dw->n_assigned++;
    r->since_us = proto_now_us();
    if (c->p.routing == CLUSTER_ROUTING_CACHE_AWARE)
        cluster_route_routed(c, pw, r); /* computed there, its blocks will be cached */
    if (r->timing) {
        if (!r->timing->dispatch_us)
            r->timing->dispatch_us = r->since_us;
        r->timing->attempts++;
        snprintf(r->timing->prefill_worker, sizeof(r->timing->prefill_worker), "%s", pw->id);
        snprintf(r->timing->decode_worker, sizeof(r->timing->decode_worker), "%s", dw->id);
    }
    log_rdebug(r->rid, "assigned: prefill %s (%d tokens believed cached), decode %s (%d tokens, "
               "max_tokens %d)", pw->id, pw->route_hit, dw->id, m.n_tokens, m.max_tokens);
    return 1;
}

/* Assign what fits from queue l (offline: within the policy's admission). */
static void dispatch_list(cluster_t *c, rlist_t *l, int offline)
{
    int misses = 0;
    req_t *next;
    for (req_t *r = l->head; r && misses < DISPATCH_SCAN_MAX; r = next) {
        next = r->next;
        if (offline && c->n_off_running >= c->offline_max_running)
            break;
        int rc = try_assign(c, r);
        if (rc == -2 && r->n_gen > 0) {
            /* preempted once it had outgrown every decode worker's whole cache: like the
             * context's end, it ends with what it generated */
            log_rinfo(r->rid, "%d prompt + %d generated tokens no longer fit any decode "
                              "worker's KV cache: finished (length)",
                      r->n_prompt, r->n_gen);
            cluster_req_end_finish(c, r, PROTO_FINISH_LENGTH, 1);
            continue;
        }
        if (rc == -2) {
            char msg[256];
            int most = 0, bs = 16;
            for (const worker_t *d = c->workers; d; d = d->next)
                if (usable(d) && (d->role == PROTO_ROLE_DECODE || d->role == PROTO_ROLE_MIXED) &&
                    d->kv_total > most) {
                    most = d->kv_total;
                    bs = d->block_size > 0 ? d->block_size : 16;
                }
            snprintf(msg, sizeof(msg),
                     "This request's prompt of %d tokens needs KV cache for %d tokens, but the "
                     "largest decode worker holds %d tokens (%d blocks of %d). Shorten the "
                     "prompt.",
                     r->n_prompt, r->n_prompt + KV_HEADROOM_TOKENS, most * bs, most, bs);
            cluster_req_end_error(c, r, 400, "invalid_request_error", "kv_cache_capacity_exceeded",
                                  msg);
            continue;
        }
        if (rc < 0) { /* a worker just died: its requests move; start over */
            reap_dead(c);
            next = l->head;
            misses++;
        } else if (rc == 0) {
            misses++;
        }
    }
}

/* The requests cluster_cancel_soon gave up on: CANCELled on their workers, forgotten. */
static void cancel_doomed(cluster_t *c)
{
    rlist_t *lists[] = {&c->active, &c->queue, &c->oqueue};
    c->n_doomed = 0;
    for (size_t i = 0; i < sizeof(lists) / sizeof(lists[0]); i++) {
        req_t *next;
        for (req_t *r = lists[i]->head; r; r = next) {
            next = r->next;
            if (!r->doomed)
                continue;
            log_rinfo(r->rid, "cancelled by its owner after %d tokens", r->n_gen);
            cluster_req_detach(c, r, 1);
            cluster_req_unlink(c, r);
            req_free(r);
        }
    }
}

/* Online first; offline only when no online request waits. */
static void dispatch(cluster_t *c)
{
    if (c->n_doomed)
        cancel_doomed(c);
    reap_dead(c);
    dispatch_list(c, &c->queue, 0);
    if (!c->queue.head)
        dispatch_list(c, &c->oqueue, 1);
}

static void on_dispatch(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    dispatch(arg);
}

// --- timers

static void on_sweep(evutil_socket_t fd, short what, void *arg)
{
    cluster_t *c = arg;
    (void)fd;
    (void)what;
    int64_t now = proto_now_us();
    for (worker_t *w = c->workers; w; w = w->next) {
        if (!w->dead && now - w->last_seen_us > (int64_t)c->p.dead_after_ms * 1000) {
            log_warn("worker %s silent for %lld ms: declared dead", w->id,
                     (long long)(now - w->last_seen_us) / 1000);
            snprintf(w->why, sizeof(w->why), "worker %s silent for %lld ms", w->id,
                     (long long)(now - w->last_seen_us) / 1000);
            w->dead = 1;
        }
    }
    reap_dead(c);
    int64_t limit = (int64_t)c->p.request_timeout_ms * 1000;
    req_t *next;
    for (req_t *r = c->active.head; r; r = next) {
        next = r->next;
        if (now - r->since_us > limit) {
            char why[160];
            snprintf(why, sizeof(why), "no progress from worker %s for %d ms",
                     r->pw ? r->pw->id : "?", c->p.request_timeout_ms);
            cluster_req_retry(c, r, 1, why);
        }
    }
    for (req_t *r = c->queue.head; r; r = next) {
        next = r->next;
        if (!r->offline && now - r->since_us > limit) {
            char msg[160];
            snprintf(msg, sizeof(msg), "no worker could take the request within %d ms",
                     c->p.request_timeout_ms);
            cluster_req_end_error(c, r, 503, "server_error", "no_worker_available", msg);
        }
    }
    cluster_promote_aged(c, now);
    if (now - c->last_policy_us >= (int64_t)c->p.heartbeat_ms * 1000) {
        c->last_policy_us = now;
        cluster_policy_tick(c, now);
    }
    dispatch(c);
}

// --- public

cluster_t *cluster_new(struct event_base *base, const cluster_params *p,
                       const cluster_callbacks *cb, char *err, size_t errlen)
{
    cluster_t *c = calloc(1, sizeof(*c));
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    c->base = base;
    c->p = *p;
    c->p.curve = NULL; /* borrowed; the list is the ZAP handler's below */
    c->p.curve_auth = NULL;
    curve_authlist_t *auth = p->curve_auth;
    c->cb = *cb;
    c->next_rid = ((uint64_t)time(NULL) << 20) | 1; /* distinct across gateway restarts */
    if (policy_params_check(&p->policy, err, errlen) < 0 || (!p->curve != !auth)) {
        if (!p->curve != !auth)
            snprintf(err, errlen, "CURVE needs both a key pair and authorized keys");
        curve_authlist_destroy(&auth);
        free(c);
        return NULL;
    }
    policy_state_init(&c->pstate);
    c->zctx = zmq_ctx_new();
    c->env = wire_envelope_new();
    if (!c->zctx || !c->env) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    if (p->curve) { /* the handler first: the ROUTER asks it from its first connection */
        c->zap = curve_zap_start(c->zctx, &auth, err, errlen);
        if (!c->zap)
            goto fail;
    }
    c->sock = zmq_socket(c->zctx, ZMQ_ROUTER);
    if (!c->sock) {
        snprintf(err, errlen, "zmq_socket: %s", zmq_strerror(errno));
        goto fail;
    }
    int one = 1, zero = 0, hwm = 100000, hb_ivl = 1000, hb_timeout = 3000;
    zmq_setsockopt(c->sock, ZMQ_ROUTER_MANDATORY, &one, sizeof(one));
    /* No ROUTER_HANDOVER: a second process connecting with a worker id that is in use is
     * refused by ZeroMQ, instead of silently stealing the id from the live worker (whose
     * replies would then go nowhere). A worker that dies frees its id when its connection
     * closes; one cut off by the network, within hb_timeout by ZMTP heartbeats. */
    zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_IVL, &hb_ivl, sizeof(hb_ivl));
    zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_TIMEOUT, &hb_timeout, sizeof(hb_timeout));
    zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(c->sock, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(c->sock, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    if (p->curve && curve_setup_server(c->sock, p->curve, CURVE_ZAP_DOMAIN_CTL) < 0) {
        snprintf(err, errlen, "cannot make the ctl socket a CURVE server: %s",
                 zmq_strerror(errno));
        goto fail;
    }
    /* before the bind: a worker without a key, or with the wrong gateway key, fails the
     * handshake before the ZAP handler is asked; only the socket monitor sees it */
    c->hsmon = hsmon_start(c->zctx, c->sock, HSMON_SERVER, p->curve != NULL, "ctl", err, errlen);
    if (!c->hsmon)
        goto fail;
    if (zmq_bind(c->sock, p->ctl_bind) < 0) {
        snprintf(err, errlen, "cannot bind the ctl socket to %s: %s", p->ctl_bind,
                 zmq_strerror(errno));
        goto fail;
    }
    c->watch = evzmq_new(base, c->sock, MAX_MSGS_PER_CB, cluster_on_ctl, c);
    c->sweep_ev = event_new(base, -1, EV_PERSIST, on_sweep, c);
    c->dispatch_ev = event_new(base, -1, 0, on_dispatch, c);
    struct timeval tv = {0, SWEEP_MS * 1000};
    if (!c->watch || !c->sweep_ev || !c->dispatch_ev || event_add(c->sweep_ev, &tv) < 0) {
        snprintf(err, errlen, "cannot set up the ctl socket's events");
        goto fail;
    }
    return c;
fail:
    curve_authlist_destroy(&auth); /* not handed to a handler */
    cluster_destroy(&c);
    return NULL;
}

void cluster_destroy(cluster_t **pc)
{
    if (!pc || !*pc)
        return;
    cluster_t *c = *pc;
    while (c->active.head)
        cluster_req_end_error(c, c->active.head, 503, "server_error", "shutting_down",
                      "the server is shutting down");
    while (c->queue.head)
        cluster_req_end_error(c, c->queue.head, 503, "server_error", "shutting_down",
                      "the server is shutting down");
    while (c->oqueue.head)
        cluster_req_end_error(c, c->oqueue.head, 503, "server_error", "shutting_down",
                      "the server is shutting down");
    while (c->workers) {
        worker_t *w = c->workers;
        c->workers = w->next;
        cluster_route_forget(w);
        free(w);
    }
    free(c->route_chain);
    evzmq_destroy(&c->watch);
    if (c->sweep_ev)
        event_free(c->sweep_ev);
    if (c->dispatch_ev)
        event_free(c->dispatch_ev);
    hsmon_stop(&c->hsmon); /* before its socket closes */
    if (c->sock)
        zmq_close(c->sock);
    curve_zap_stop(&c->zap); /* before the context, whose termination waits for it */
    if (c->zctx)
        zmq_ctx_term(c->zctx);
    wire_envelope_destroy(&c->env);
    free(c->pworkers);
    free(c);
    *pc = NULL;
}

cluster_status_t cluster_submit(cluster_t *c, const cluster_job *job, void *ud, uint64_t *rid)
{
    if (job->n_tokens < 1 || job->max_tokens < 1 ||
        job->n_tokens + job->max_tokens > PROTO_MAX_TOKENS)
        return CLUSTER_ERR;
    req_t *r = calloc(1, sizeof(*r));
    if (!r)
        return CLUSTER_ERR;
    r->tokens = malloc((size_t)(job->n_tokens + job->max_tokens) * sizeof(int));
    if (!r->tokens) {
        free(r);
        return CLUSTER_ERR;
    }
    memcpy(r->tokens, job->tokens, (size_t)job->n_tokens * sizeof(int));
    if (job->samp) {
        if (!(r->samp = malloc(sizeof(*r->samp)))) {
            free(r->tokens);
            free(r);
            return CLUSTER_ERR;
        }
        *r->samp = *job->samp;
        r->samp->n_gen = 0;
    }
    r->rid = c->next_rid++;
    r->ud = ud;
    r->n_prompt = job->n_tokens;
    r->max_tokens = job->max_tokens;
    r->temperature = job->temperature;
    r->top_p = job->top_p;
    r->top_k = job->top_k;
    r->rng = job->rng;
    r->mtp_depth = job->mtp_depth >= 0 && job->mtp_depth <= PROTO_SPEC_MAX_POS + 1 ? job->mtp_depth
                                                                                : 0;
    r->logprobs = job->logprobs >= 0 && job->logprobs <= PROTO_MAX_TOP_LOGPROBS + 1 ? job->logprobs
                                                                                 : 0;
    r->queued = 1;
    r->since_us = proto_now_us();
    r->enq_us = r->since_us;
    r->timing = job->timing;
    r->cb = job->cb ? job->cb : &c->cb;
    r->echo = r->logprobs && job->echo && r->cb->on_prompt_logprobs;
    r->offline = job->offline != 0;
    if (r->timing) {
        memset(r->timing, 0, sizeof(*r->timing));
        r->timing->admit_us = r->since_us;
    }
    r->hnext = *bucket(c, r->rid);
    *bucket(c, r->rid) = r;
    rlist_t *q = qlist(c, r);
    list_push(q, r, 0);
    *rid = r->rid;
    if (!r->offline) {
        c->online_prompt_tokens += r->n_prompt;
        c->online_arrived++;
    }
    /* Start at once when nobody is ahead, so a burst does not fill the queue with
     * requests that have somewhere to go; only a request that must wait counts against
     * max_queue. An offline request also needs an empty online queue and an offline slot. */
    if (q->head == r &&
        (!r->offline || (!c->queue.head && c->n_off_running < c->offline_max_running)))
        try_assign(c, r);
    if (r->queued && q->n > c->p.max_queue) {
        cluster_req_unlink(c, r);
        req_free(r);
        return CLUSTER_FULL;
    }
    if (r->queued)
        schedule_dispatch(c);
    return CLUSTER_OK;
}

void cluster_cancel(cluster_t *c, uint64_t rid)
{
    req_t *r = req_find(c, rid);
    if (!r)
        return;
    log_rinfo(rid, "cancelled by the client after %d tokens", r->n_gen);
    cluster_req_detach(c, r, 1);
    cluster_req_unlink(c, r);
    req_free(r);
}

/* The callbacks of a request cluster_cancel_soon gave up on: its next tokens end it. */
static int dropped_tokens(void *ud, const int *tokens, const proto_logprob *lps, int n)
{
    (void)ud, (void)tokens, (void)lps, (void)n;
    return 1;
}

static void dropped_finish(void *ud, int reason)
{
    (void)ud, (void)reason;
}

static void dropped_error(void *ud, int status, const char *type, const char *code,
                          const char *msg)
{
    (void)ud, (void)status, (void)type, (void)code, (void)msg;
}

static const cluster_callbacks dropped_callbacks = {.on_tokens = dropped_tokens,
                                                    .on_prompt_logprobs = NULL,
                                                    .on_finish = dropped_finish,
                                                    .on_error = dropped_error};

void cluster_cancel_soon(cluster_t *c, uint64_t rid)
{
    req_t *r = req_find(c, rid);
    if (!r || r->doomed)
        return;
    r->doomed = 1;
    r->cb = &dropped_callbacks;
    r->ud = NULL;
    r->timing = NULL;
    c->n_doomed++;
    schedule_dispatch(c);
}

void cluster_get_stats(const cluster_t *c, cluster_stats *st)
{
    memset(st, 0, sizeof(*st));
    for (const worker_t *w = c->workers; w; w = w->next) {
        if (w->dead)
            continue;
        if (w->state != PROTO_STATE_READY)
            st->n_draining++;
        else if (w->role == PROTO_ROLE_PREFILL)
            st->n_prefill++;
        else if (w->role == PROTO_ROLE_DECODE)
            st->n_decode++;
        else if (w->role == PROTO_ROLE_MIXED)
            st->n_mixed++;
    }
    st->n_queued = c->queue.n + c->oqueue.n;
    st->n_running = c->active.n;
    st->n_offline_queued = c->oqueue.n;
    st->n_offline_running = c->n_off_running;
    st->n_promoted = c->n_promoted;
    st->offline_max_running = c->offline_max_running;
    st->n_preempted = c->n_preempted;
    for (const worker_t *w = c->workers; w; w = w->next)
        st->n_changing += !w->dead && w->changing;
    st->n_role_changes = c->n_role_changes;
    st->n_role_orders = c->n_role_orders;
    st->last_role_change_ms = c->last_role_change_ms;
    st->n_refused = c->n_refused;
    st->kv_block_size = c->p.kv_block_size;
    for (const worker_t *w = c->workers; w && !st->kv_block_size; w = w->next)
        if (!w->dead)
            st->kv_block_size = w->block_size;
}

void cluster_foreach_refused(const cluster_t *c,
                             void (*fn)(const cluster_refused_info *w, void *ud), void *ud)
{
    int64_t now = proto_now_us();
    const refused_worker *order[CLUSTER_MAX_REFUSED];
    int n = 0;
    for (const refused_worker *r = c->refused; r < c->refused + CLUSTER_MAX_REFUSED; r++) {
        if (!r->id[0])
            continue;
        int i = n++; /* insertion sort, the most recent first */
        while (i > 0 && order[i - 1]->last_us < r->last_us) {
            order[i] = order[i - 1];
            i--;
        }
        order[i] = r;
    }
    for (int i = 0; i < n; i++) {
        const refused_worker *r = order[i];
        cluster_refused_info info = {.id = r->id, .role = r->role, .pid = r->pid,
                                     .reason = r->reason, .n_refused = r->n_refused,
                                     .last_ms_ago = (double)(now - r->last_us) / 1000.0};
        fn(&info, ud);
    }
}

void cluster_foreach_worker(const cluster_t *c,
                            void (*fn)(const cluster_worker_info *w, void *ud), void *ud)
{
    int64_t now = proto_now_us();
    for (const worker_t *w = c->workers; w; w = w->next) {
        if (w->dead)
            continue;
        cluster_worker_info info = {
            .id = w->id, .role = w->role, .state = w->state, .kv_endpoint = w->kvep,
            .pid = w->pid, .kv_blocks_total = w->kv_total, .kv_blocks_free = w->kv_free,
            .running = w->running, .queued = w->queued, .queued_prompt_tokens = w->qtok,
            .n_assigned = w->n_assigned,
            .last_seen_ms_ago = (double)(now - w->last_seen_us) / 1000.0,
            .n_ctx = w->n_ctx, .block_size = w->block_size, .max_seqs = w->max_seqs,
            .tokens_in = w->tok_in, .tokens_out = w->tok_out,
            .kvx_tx = w->kvx_tx, .kvx_rx = w->kvx_rx, .spec = w->spec,
            .changing = w->changing, .target_role = w->target_role, .emulated = w->emulated,
            .mtp_depth = w->mtp_depth - 1,
            .n_role_changes = w->n_role_changes,
            .role_change_ms = (double)w->role_change_us / 1000.0,
            .mig = w->mig,
            .prefix_cache_queries = w->pc_queries, .prefix_cache_hits = w->pc_hits,
            .prefix_blocks_believed = cluster_route_n_believed(w),
            .n_preemptions = w->n_preemptions,
        };
        fn(&info, ud);
    }
}

int cluster_ready(const cluster_t *c, char *reason, size_t cap)
{
    cluster_stats st;
    cluster_get_stats(c, &st);
    if (st.n_mixed > 0 || (st.n_prefill > 0 && st.n_decode > 0))
        return 1;
    if (st.n_prefill == 0 && st.n_decode == 0)
        snprintf(reason, cap, "no workers registered");
    else if (st.n_prefill == 0)
        snprintf(reason, cap, "no prefill worker (%d decode)", st.n_decode);
    else
        snprintf(reason, cap, "no decode worker (%d prefill)", st.n_prefill);
    return 0;
}

void cluster_set_latency_source(cluster_t *c,
                                void (*fn)(void *ud, int64_t now_us, double *ttft_p90_ms,
                                           double *tpot_p90_ms),
                                void *ud)
{
    c->lat_fn = fn;
    c->lat_ud = ud;
}

void cluster_set_observer(cluster_t *c, void (*fn)(const cluster_event *ev, void *ud), void *ud)
{
    c->observer = fn;
    c->observer_ud = ud;
}

int cluster_retry_after_s(const cluster_t *c)
{
    (void)c;
    return 1;
}
