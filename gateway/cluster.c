/* cluster: see cluster.h.
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
 * every heartbeat_ms; its role changes are not applied yet (docs/scheduler.md). */
#include "cluster.h"

#include <errno.h>
#include <event2/event.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "evzmq.h"
#include "log.h"
#include "protocol.h"

#define N_BUCKETS 4096
#define MAX_MSGS_PER_CB 256
#define SWEEP_MS 100
#define DISPATCH_SCAN_MAX 64 /* queued requests tried per dispatch after a miss */

typedef struct worker {
    struct worker *next;
    char id[PROTO_ID_LEN]; /* worker id == ZeroMQ routing id */
    size_t id_len;
    int role, state, pid;
    char kvep[PROTO_ENDPOINT_LEN];
    int n_ctx, block_size, max_seqs;
    int kv_total, kv_free, running, queued, qtok; /* last heartbeat */
    uint64_t tok_in, tok_out;                     /* last heartbeat: counters */
    proto_kvx_counters kvx_tx, kvx_rx;
    proto_spec_counters spec;
    int64_t last_seen_us;
    int64_t role_since_us; /* registered in its current role (the policy's role age) */
    int dead;           /* flagged; reaped by the next sweep or dispatch */
    char why[160];      /* why it was flagged dead */
    int full;           /* a NOSPACE came back: no decode work until the next heartbeat */
    int pending_qtok;   /* prompt tokens sent as PREFILL, no token reported yet */
    int pending_blocks; /* KV blocks promised as decode worker, no token reported yet */
    int n_decode;       /* requests assigned with this worker as decode worker */
    int n_assigned;     /* requests assigned to it in any role */
    /* live role change: ROLE sent, routing skips it until it registers in target_role */
    int changing, target_role;
    int64_t change_us;      /* when ROLE was sent */
    int emulated;           /* REGISTER / HEARTBEAT "emu" */
    uint64_t n_role_changes; /* last heartbeat */
    int64_t role_change_us;  /* last heartbeat: its last change's duration */
    proto_mig_counters mig;  /* last heartbeat: live migrations */
} worker_t;

typedef struct req {
    struct req *hnext;
    struct req *prev, *next; /* queue or active list */
    uint64_t rid;
    void *ud;
    int *tokens; /* (n_prompt + max_tokens,) prompt then generated */
    int n_prompt, n_gen, max_tokens;
    float temperature, top_p;
    int top_k;
    uint64_t rng;
    int mtp_depth; /* PREFILL "mtp": depth + 1, 0 = not set */
    worker_t *pw, *dw; /* current attempt (NULL while queued) */
    worker_t *mw;      /* live migration: the decode worker moving it to dw (MIGRATE sent),
                        * until dw reports a token or mw changed role; NULL otherwise */
    int mw_started;    /* mw had reported a token when the move was ordered (its KV had
                        * landed there: the prefill worker's part was done) */
    int base;          /* n_gen when the attempt started */
    int p_started, d_started;
    int p_qtok, d_blocks; /* what this attempt added to pw/dw pending counters */
    int retries;
    unsigned attempt; /* attempts started; its low 8 bits go into the wire rid */
    int64_t since_us; /* queued since, or last progress while assigned */
    int queued;       /* on the queue (else on the active list) */
    cluster_req_timing *timing; /* the owner's, optional */
    const cluster_callbacks *cb; /* the job's, or the cluster's */
    int offline;                 /* offline tier */
    int promoted;                /* offline, promoted by aging: queued and run as online */
    int64_t enq_us;              /* admitted (offline aging) */
} req_t;

typedef struct {
    req_t *head, *tail;
    int n;
} rlist_t;

struct cluster {
    struct event_base *base;
    cluster_params p;
    cluster_callbacks cb;
    void *zctx, *sock;
    evzmq_t *watch;
    proto_envelope *env;
    struct event *sweep_ev, *dispatch_ev;
    worker_t *workers;
    req_t *buckets[N_BUCKETS];
    rlist_t queue, active;
    rlist_t oqueue;     /* offline requests waiting (promoted ones move to queue) */
    int n_off_running;  /* offline, not promoted, on the active list */
    int n_promoted;     /* promoted by aging and not ended */
    uint64_t next_rid;
    /* the tidal policy (offline admission and preemption) */
    policy_state pstate;
    policy_worker *pworkers; /* scratch input, grown as workers come */
    int pworkers_cap;
    int64_t last_policy_us;
    int64_t online_prompt_tokens; /* online prompt tokens ever admitted */
    int offline_max_running;
    uint64_t n_preempted;
    int policy_failed; /* logged once */
    uint64_t n_role_changes, n_role_orders;
    double last_role_change_ms;
    uint64_t n_migrate_orders; /* MIGRATE sent */
    void (*lat_fn)(void *ud, int64_t now_us, double *ttft_p90_ms, double *tpot_p90_ms);
    void *lat_ud;
    void (*observer)(const cluster_event *ev, void *ud);
    void *observer_ud;
};

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
        .policy = policy_default_params(),
    };
    return p;
}

static const char *role_str(int role)
{
    return role == PROTO_ROLE_PREFILL  ? "prefill"
           : role == PROTO_ROLE_DECODE ? "decode"
           : role == PROTO_ROLE_MIXED  ? "mixed"
                                       : "?";
}

static void list_push(rlist_t *l, req_t *r, int front)
{
    r->prev = r->next = NULL;
    if (!l->head) {
        l->head = l->tail = r;
    } else if (front) {
        r->next = l->head;
        l->head->prev = r;
        l->head = r;
    } else {
        r->prev = l->tail;
        l->tail->next = r;
        l->tail = r;
    }
    l->n++;
}

static void list_remove(rlist_t *l, req_t *r)
{
    if (r->prev)
        r->prev->next = r->next;
    else
        l->head = r->next;
    if (r->next)
        r->next->prev = r->prev;
    else
        l->tail = r->prev;
    r->prev = r->next = NULL;
    l->n--;
}

/* The queue r waits in: online (and promoted offline) requests, or offline ones. */
static rlist_t *qlist(cluster_t *c, const req_t *r)
{
    return r->offline && !r->promoted ? &c->oqueue : &c->queue;
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

/* Workers see one rid per attempt: the request's id shifted left by WIRE_ATTEMPT_BITS,
 * plus the attempt number modulo 2^WIRE_ATTEMPT_BITS (request ids start at 1, so a wire
 * rid is never 0). */
#define WIRE_ATTEMPT_BITS 8
static uint64_t wire_rid(const req_t *r)
{
    return (r->rid << WIRE_ATTEMPT_BITS) | (r->attempt & ((1u << WIRE_ATTEMPT_BITS) - 1));
}

static req_t **bucket(cluster_t *c, uint64_t rid)
{
    return &c->buckets[(rid * 0x9E3779B97F4A7C15ull) >> 52];
}

static req_t *req_find(cluster_t *c, uint64_t rid)
{
    for (req_t *r = *bucket(c, rid); r; r = r->hnext)
        if (r->rid == rid)
            return r;
    return NULL;
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

static worker_t *worker_find(cluster_t *c, const void *id, size_t len)
{
    for (worker_t *w = c->workers; w; w = w->next)
        if (w->id_len == len && memcmp(w->id, id, len) == 0)
            return w;
    return NULL;
}

static void notify(cluster_t *c, cluster_event_type_t type, const worker_t *w, uint64_t rid,
                   const char *reason)
{
    if (!c->observer)
        return;
    cluster_event ev = {.type = type,
                        .worker = w ? w->id : "",
                        .role = w ? w->role : 0,
                        .state = w ? w->state : 0,
                        .rid = rid,
                        .reason = reason ? reason : ""};
    c->observer(&ev, c->observer_ud);
}

static void schedule_dispatch(cluster_t *c)
{
    event_active(c->dispatch_ev, EV_TIMEOUT, 0);
}

/* Send m to worker w. A failure flags w dead (ROUTER_MANDATORY: EHOSTUNREACH when the
 * peer is gone; EAGAIN when its queue is full, which we treat the same way: a worker
 * that does not read its orders is not serving). Returns 0 or -1. */
static int send_to(cluster_t *c, worker_t *w, const proto_msg *m)
{
    int rc = proto_send(c->sock, w->id, w->id_len, m, NULL, 0, ZMQ_DONTWAIT);
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

static void send_cancel(cluster_t *c, worker_t *w, uint64_t rid)
{
    if (!w || w->dead)
        return;
    proto_msg m;
    proto_msg_init(&m, PROTO_CANCEL);
    m.rid = rid;
    send_to(c, w, &m);
}

// --- request life

/* Undo the attempt's bookkeeping on its workers; optionally CANCEL it there. */
static void req_detach(cluster_t *c, req_t *r, int cancel)
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
    if (cancel) {
        send_cancel(c, r->pw, wire_rid(r));
        if (r->dw != r->pw)
            send_cancel(c, r->dw, wire_rid(r));
        if (r->mw && r->mw != r->pw && r->mw != r->dw)
            send_cancel(c, r->mw, wire_rid(r));
    }
    r->pw = r->dw = r->mw = NULL;
    r->p_qtok = r->d_blocks = 0;
}

/* Take r out of every table (the caller then reports and frees it). */
static void req_unlink(cluster_t *c, req_t *r)
{
    hash_remove(c, r);
    if (r->queued)
        list_remove(qlist(c, r), r);
    else
        active_remove(c, r);
    if (r->promoted)
        c->n_promoted--;
}

static void req_free(req_t *r)
{
    free(r->tokens);
    free(r);
}

static void req_end_error(cluster_t *c, req_t *r, int status, const char *type, const char *code,
                          const char *msg)
{
    req_detach(c, r, 1);
    req_unlink(c, r);
    log_rwarn(r->rid, "request failed: %s", msg);
    r->cb->on_error(r->ud, status, type, code, msg);
    req_free(r);
}

static void req_end_finish(cluster_t *c, req_t *r, int reason, int cancel)
{
    req_detach(c, r, cancel);
    req_unlink(c, r);
    log_rdebug(r->rid, "finished (%s) after %d tokens",
               reason == PROTO_FINISH_STOP ? "stop" : "length", r->n_gen);
    r->cb->on_finish(r->ud, reason);
    req_free(r);
}

/* The current attempt failed: re-run r from prompt + tokens so far, or give up. counts: 0
 * for failures that say nothing about the request (a worker out of room). */
static void req_retry(cluster_t *c, req_t *r, int counts, const char *why)
{
    if (counts && ++r->retries > c->p.max_retries) {
        char msg[PROTO_MESSAGE_LEN + 96];
        snprintf(msg, sizeof(msg), "the request failed %d times; last error: %s", r->retries, why);
        req_end_error(c, r, 503, "server_error", "worker_failure", msg);
        return;
    }
    if (r->n_gen >= r->max_tokens) { /* everything was generated: nothing to re-run */
        req_end_finish(c, r, PROTO_FINISH_LENGTH, 1);
        return;
    }
    log_rinfo(r->rid, "retrying (attempt %d) from %d prompt + %d generated tokens: %s",
              r->retries + 1, r->n_prompt, r->n_gen, why);
    notify(c, CLUSTER_EV_REQUEST_RETRY, NULL, r->rid, why);
    req_detach(c, r, 1);
    active_remove(c, r);
    r->queued = 1;
    r->since_us = proto_now_us();
    list_push(qlist(c, r), r, 1);
    schedule_dispatch(c);
}

/* Online load needs the room: cancel offline request r on its workers and put it back at
 * the head of the offline queue with its tokens so far (re-run later like a retry). */
static void req_preempt(cluster_t *c, req_t *r)
{
    c->n_preempted++;
    log_rinfo(r->rid, "offline request preempted after %d generated tokens: re-queued",
              r->n_gen);
    notify(c, CLUSTER_EV_REQUEST_PREEMPT, NULL, r->rid, "online load");
    req_detach(c, r, 1);
    active_remove(c, r);
    r->queued = 1;
    r->since_us = proto_now_us();
    list_push(&c->oqueue, r, 1);
}

/* Flag w dead and re-run everything it had. */
static void worker_fail_requests(cluster_t *c, worker_t *w, const char *why)
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
            req_retry(c, r, 1, why);
        }
    }
}

static void worker_remove(cluster_t *c, worker_t *w, const char *why)
{
    char reason[160];
    snprintf(reason, sizeof(reason), "%s", why); /* why may point into w */
    LOG_AT(w->dead ? LOG_LEVEL_WARN : LOG_LEVEL_INFO, 0, "worker %s (%s, pid %d) removed: %s",
           w->id, role_str(w->role), w->pid, reason);
    w->dead = 1; /* out of routing while its requests move */
    notify(c, CLUSTER_EV_WORKER_DOWN, w, 0, reason);
    worker_fail_requests(c, w, reason);
    for (worker_t **pp = &c->workers; *pp; pp = &(*pp)->next) {
        if (*pp == w) {
            *pp = w->next;
            break;
        }
    }
    free(w);
}

static void reap_dead(cluster_t *c)
{
    worker_t *next;
    for (worker_t *w = c->workers; w; w = next) {
        next = w->next;
        if (w->dead)
            worker_remove(c, w, w->why[0] ? w->why : "declared dead");
    }
}

// --- routing

static int usable(const worker_t *w)
{
    return !w->dead && w->state == PROTO_STATE_READY;
}

/* KV blocks decode worker d reserves for r: the worst case, prompt + max_tokens - 1
 * tokens capped at the context, exactly as the worker reserves it (kvtransfer). */
static int blocks_needed(const req_t *r, const worker_t *d)
{
    int bs = d->block_size > 0 ? d->block_size : 16;
    int tokens = r->n_prompt + r->max_tokens - 1;
    if (d->n_ctx > 0 && tokens > d->n_ctx)
        tokens = d->n_ctx;
    return (tokens + bs - 1) / bs;
}

/* Choose (prefill, decode) for r: the decode/mixed worker must have room (KV blocks free
 * per its last heartbeat minus blocks promised since, a free sequence slot); among the
 * prefill workers that can feed it (pure prefill workers, or the mixed worker itself),
 * the one with the least queued prompt tokens wins; ties go to the decode worker with
 * the most free blocks. Returns 0 or -1 (nothing fits now). */
static int pick(cluster_t *c, const req_t *r, worker_t **pw, worker_t **dw, int *never)
{
    long best_load = -1, best_free = -1;
    int total = r->n_prompt + r->n_gen;
    int n_decoders = 0, n_could_fit = 0;
    for (worker_t *d = c->workers; d; d = d->next) {
        if (!usable(d) || (d->role != PROTO_ROLE_DECODE && d->role != PROTO_ROLE_MIXED))
            continue;
        n_decoders++;
        if (d->kv_total >= blocks_needed(r, d))
            n_could_fit++;
        if (d->full)
            continue;
        if (d->n_ctx > 0 && total >= d->n_ctx)
            continue;
        long free_blocks = (long)d->kv_free - d->pending_blocks;
        if (free_blocks < blocks_needed(r, d))
            continue;
        if (d->max_seqs > 0 && d->n_decode >= d->max_seqs)
            continue;
        for (worker_t *p = c->workers; p; p = p->next) {
            if (!usable(p))
                continue;
            if (p != d && (p->role != PROTO_ROLE_PREFILL || !d->kvep[0]))
                continue;
            if (p == d && p->role != PROTO_ROLE_MIXED)
                continue;
            if (p->n_ctx > 0 && total >= p->n_ctx)
                continue;
            long load = p->qtok > p->pending_qtok ? p->qtok : p->pending_qtok;
            if (best_load < 0 || load < best_load ||
                (load == best_load && free_blocks > best_free)) {
                best_load = load;
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

/* Try to start an attempt for queued request r. Returns 1 when assigned, 0 when nothing
 * fits now, -1 when the PREFILL could not be sent (the worker is flagged dead; r stays
 * queued), -2 when r needs more KV blocks than any decode worker has in total. */
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
    snprintf(m.decode_worker, sizeof(m.decode_worker), "%s", dw->id);
    snprintf(m.decode_endpoint, sizeof(m.decode_endpoint), "%s", pw == dw ? "" : dw->kvep);
    m.ts_us = proto_wall_us();
    if (send_to(c, pw, &m) < 0)
        return -1;
    list_remove(qlist(c, r), r);
    r->queued = 0;
    active_add(c, r);
    r->pw = pw;
    r->dw = dw;
    r->base = r->n_gen;
    r->p_started = r->d_started = 0;
    r->p_qtok = m.n_tokens;
    r->d_blocks = blocks_needed(r, dw);
    pw->pending_qtok += r->p_qtok;
    pw->n_assigned++;
    dw->pending_blocks += r->d_blocks;
    dw->n_decode++;
    if (dw != pw)
        dw->n_assigned++;
    r->since_us = proto_now_us();
    if (r->timing) {
        if (!r->timing->dispatch_us)
            r->timing->dispatch_us = r->since_us;
        r->timing->attempts++;
        snprintf(r->timing->prefill_worker, sizeof(r->timing->prefill_worker), "%s", pw->id);
        snprintf(r->timing->decode_worker, sizeof(r->timing->decode_worker), "%s", dw->id);
    }
    log_rdebug(r->rid, "assigned: prefill %s, decode %s (%d tokens, max_tokens %d)", pw->id, dw->id,
               m.n_tokens, m.max_tokens);
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
                     "This request needs KV cache for %d tokens (prompt %d + max_tokens %d - 1), "
                     "but the largest decode worker holds %d tokens (%d blocks of %d). Lower "
                     "max_tokens or the prompt length.",
                     r->n_prompt + r->max_tokens - 1, r->n_prompt, r->max_tokens, most * bs, most,
                     bs);
            req_end_error(c, r, 400, "invalid_request_error", "kv_cache_capacity_exceeded", msg);
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

/* Online first; offline only when no online request waits. */
static void dispatch(cluster_t *c)
{
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

// --- live role changes

static void notify_role(cluster_t *c, const worker_t *w, int role, int old_role,
                        const char *reason)
{
    if (!c->observer)
        return;
    cluster_event ev = {.type = CLUSTER_EV_ROLE_CHANGE, .worker = w->id, .role = role,
                        .old_role = old_role, .state = w->state, .reason = reason};
    c->observer(&ev, c->observer_ud);
}

/* The decode worker to move r to from w (live migration): a ready decode worker other than
 * w with a kv endpoint, room for r's worst case (as pick() counts it) and a sequence slot;
 * the most free blocks wins. NULL when none has room now (r then finishes on w). */
static worker_t *migration_target(cluster_t *c, const req_t *r, const worker_t *w)
{
    worker_t *best = NULL;
    long best_free = -1;
    for (worker_t *d = c->workers; d; d = d->next) {
        if (d == w || !usable(d) || d->role != PROTO_ROLE_DECODE || !d->kvep[0] || d->full)
            continue;
        long free_blocks = (long)d->kv_free - d->pending_blocks;
        if (free_blocks < blocks_needed(r, d) ||
            (d->max_seqs > 0 && d->n_decode >= d->max_seqs) ||
            (d->n_ctx > 0 && r->n_prompt + r->n_gen >= d->n_ctx))
            continue;
        if (free_blocks > best_free) {
            best_free = free_blocks;
            best = d;
        }
    }
    return best;
}

/* w is leaving the decode role: order it to move every request it decodes (or is about to
 * receive) to another decode worker (MIGRATE), which continues each at the next token
 * (docs/scheduler.md "Live role changes"). The request's decode worker becomes the target
 * at once, its reservation moves there, and w stays one of its workers (mw) until the
 * target reports a token, so an ERROR, FINISH or TOKENS from w still counts. Requests no
 * worker has room for finish on w. Returns the number of MIGRATE orders sent. */
static int migrate_all(cluster_t *c, worker_t *w)
{
    int n = 0;
    for (req_t *r = c->active.head; r && !w->dead; r = r->next) {
        if (r->dw != w || r->pw == w || r->mw)
            continue;
        worker_t *d = migration_target(c, r, w);
        if (!d)
            continue;
        proto_msg m;
        proto_msg_init(&m, PROTO_MIGRATE);
        m.rid = wire_rid(r);
        snprintf(m.decode_worker, sizeof(m.decode_worker), "%s", d->id);
        snprintf(m.decode_endpoint, sizeof(m.decode_endpoint), "%s", d->kvep);
        if (send_to(c, w, &m) < 0)
            break; /* w is flagged dead: its requests are re-run */
        if (!r->d_started)
            w->pending_blocks -= r->d_blocks;
        w->n_decode--;
        if (r->pw != w)
            w->n_assigned--;
        r->mw = w;
        r->mw_started = r->d_started;
        r->dw = d;
        r->d_started = 0;
        r->d_blocks = blocks_needed(r, d);
        d->pending_blocks += r->d_blocks;
        d->n_decode++;
        d->n_assigned++;
        if (r->timing)
            snprintf(r->timing->decode_worker, sizeof(r->timing->decode_worker), "%s", d->id);
        c->n_migrate_orders++;
        n++;
        log_rinfo(r->rid, "migrating from %s to %s (%d generated)", w->id, d->id, r->n_gen);
    }
    return n;
}

/* Send ROLE to w and take it out of routing until it registers again. Returns 0 or -1
 * (the send failed: w is flagged dead). */
static int role_order(cluster_t *c, worker_t *w, int role, const char *why)
{
    proto_msg m;
    proto_msg_init(&m, PROTO_ROLE);
    m.role = role;
    if (send_to(c, w, &m) < 0)
        return -1;
    w->changing = 1;
    w->target_role = role;
    w->change_us = proto_now_us();
    w->state = PROTO_STATE_CHANGING;
    c->n_role_orders++;
    int n_moves = w->role == PROTO_ROLE_DECODE ? migrate_all(c, w) : 0;
    log_info("worker %s: role change %s -> %s ordered by %s (%d sequences migrating)", w->id,
             role_str(w->role), role_str(role), why, n_moves);
    char reason[96];
    snprintf(reason, sizeof(reason), "ordered by %s", why);
    notify_role(c, w, role, w->role, reason);
    return 0;
}

/* w registered again after ROLE (same process), in role `role`: the change is done (or the
 * worker could not make it and stayed). It drained first, so what it still has here is
 * finished on its side: a request it prefilled is decoding elsewhere (its KV was accepted
 * before the worker went idle: the prefill worker is released from it); a request it was
 * to decode whose KV never came (refused while draining) is re-run. */
static void role_change_done(cluster_t *c, worker_t *w, int role)
{
    double ms = (double)(proto_now_us() - w->change_us) / 1000.0;
    req_t *next;
    /* (a worker that registers again in its old role kept whatever it was doing) */
    for (req_t *r = role != w->role ? c->active.head : NULL; r; r = next) {
        next = r->next;
        if (r->mw == w) /* moved: it went idle only once every move was over */
            r->mw = NULL;
        if (r->pw == w && r->dw != w) {
            if (!r->p_started)
                w->pending_qtok -= r->p_qtok;
            w->n_assigned--;
            r->pw = NULL;
        } else if (r->dw == w) {
            req_retry(c, r, 0, "its decode worker changed role");
        }
    }
    char reason[96];
    if (role == w->target_role) {
        c->n_role_changes++;
        c->last_role_change_ms = ms;
        snprintf(reason, sizeof(reason), "done in %.1f ms", ms);
        log_info("worker %s: role change %s -> %s done in %.1f ms", w->id, role_str(w->role),
                 role_str(role), ms);
    } else {
        snprintf(reason, sizeof(reason), "not made: still %s", role_str(role));
        log_warn("worker %s: role change to %s not made: it registered again as %s", w->id,
                 role_str(w->target_role), role_str(role));
    }
    notify_role(c, w, role, w->role, reason);
}

/* Workers able to do role (ready ones, plus those changing to it; mixed counts for both),
 * not counting skip. */
static int n_capable(const cluster_t *c, int role, const worker_t *skip)
{
    int n = 0;
    for (const worker_t *w = c->workers; w; w = w->next) {
        if (w == skip || w->dead)
            continue;
        int r = w->changing ? w->target_role : w->role;
        if (!w->changing && w->state != PROTO_STATE_READY)
            continue;
        n += r == role || r == PROTO_ROLE_MIXED;
    }
    return n;
}

int cluster_set_role(cluster_t *c, const char *id, int role, const char *why, char *err,
                     size_t errlen)
{
    if (role != PROTO_ROLE_PREFILL && role != PROTO_ROLE_DECODE) {
        snprintf(err, errlen, "role must be prefill or decode");
        return -3;
    }
    worker_t *w = worker_find(c, id, strlen(id));
    if (!w || w->dead) {
        snprintf(err, errlen, "no worker '%s'", id);
        return -1;
    }
    if (w->role == PROTO_ROLE_MIXED) {
        snprintf(err, errlen, "worker '%s' is mixed: it keeps its role", id);
        return -2;
    }
    if (w->changing) {
        snprintf(err, errlen, "worker '%s' is already changing to %s", id,
                 role_str(w->target_role));
        return -2;
    }
    if (w->role == role) {
        snprintf(err, errlen, "worker '%s' is already %s", id, role_str(role));
        return -2;
    }
    if (w->state != PROTO_STATE_READY) {
        snprintf(err, errlen, "worker '%s' is not ready (draining)", id);
        return -2;
    }
    if (n_capable(c, w->role, w) < 1) {
        snprintf(err, errlen, "worker '%s' is the last %s worker: the cluster keeps at least "
                 "one per role", id, role_str(w->role));
        return -2;
    }
    if (role_order(c, w, role, why) < 0) {
        snprintf(err, errlen, "worker '%s' is unreachable", id);
        return -1;
    }
    return 0;
}

// --- messages from workers

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
    int old_role = w ? w->role : 0, old_pid = w ? w->pid : 0;
    int ordered = w && w->changing && w->pid == m->pid; /* the end of a role change */
    if (ordered) {
        role_change_done(c, w, m->role);
    } else if (w && (w->pid != m->pid || w->role != m->role)) {
        /* a new incarnation (restart or role change): what the old one had is lost */
        worker_fail_requests(c, w, "worker re-registered");
    }
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
    }
    w->role = m->role;
    w->state = PROTO_STATE_READY;
    w->changing = 0;
    w->target_role = 0;
    w->emulated = m->emulated;
    w->pid = m->pid;
    snprintf(w->kvep, sizeof(w->kvep), "%s", m->kv_endpoint);
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
    log_info("worker %s %s: role %s, pid %d, kv %s, n_ctx %d, kv blocks %d/%d of %d tokens, "
             "max_seqs %d",
             w->id, is_new ? "registered" : "re-registered", role_str(w->role), w->pid,
             w->kvep[0] ? w->kvep : "-", w->n_ctx, w->kv_free, w->kv_total, w->block_size,
             w->max_seqs);
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
    send_to(c, w, &ack);
    schedule_dispatch(c);
}

static void send_bye(cluster_t *c, const unsigned char *id, size_t id_len, const char *wid)
{
    proto_msg m;
    proto_msg_init(&m, PROTO_BYE);
    snprintf(m.worker_id, sizeof(m.worker_id), "%s", wid);
    if (proto_send(c->sock, id, id_len, &m, NULL, 0, ZMQ_DONTWAIT) < 0)
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
    w->running = m->running;
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
    if (w == r->pw && (m->queue_us || m->prefill_us)) {
        t->worker_queue_us = m->queue_us;
        t->prefill_us = m->prefill_us;
    }
    if (w == r->dw && (m->xfer_us || m->xfer_bytes))
        t->xfer_us = m->xfer_us, t->xfer_bytes = m->xfer_bytes;
    if (w == r->dw && m->step_us)
        t->step_us = m->step_us;
}

static void handle_tokens(cluster_t *c, worker_t *w, const proto_msg *m)
{
    req_t *r = attempt_of(c, m->rid, w);
    if (!r) {
        log_rdebug(m->rid, "TOKENS from %s for no current attempt: ignored",
                   w ? w->id : "unknown worker");
        return;
    }
    if (w == r->pw && !r->p_started) {
        r->p_started = 1;
        w->pending_qtok -= r->p_qtok;
    }
    if (w == r->dw && !r->d_started) {
        r->d_started = 1;
        w->pending_blocks -= r->d_blocks;
    }
    if (w == r->dw && r->mw) { /* the new decode worker has it: the move is over */
        log_rdebug(r->rid, "migrated from %s to %s", r->mw->id, w->id);
        r->mw = NULL;
    }
    r->since_us = proto_now_us();
    note_timing(r, w, m);
    long start = (long)r->base + m->index;
    if (start > r->n_gen) { /* tokens in between were lost: re-run from what is known */
        char why[160];
        snprintf(why, sizeof(why), "TOKENS from %s start at %ld but only %d are known", w->id,
                 start, r->n_gen);
        req_retry(c, r, 0, why);
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
    if (r->cb->on_tokens(r->ud, dst, n_new)) {
        /* the owner completed it (stop string, EOS, max_tokens). At max_tokens the workers
         * end it by themselves (they count too): a CANCEL would only turn their clean
         * finish into a cancellation in their logs and transfer counters. */
        req_detach(c, r, r->n_gen < r->max_tokens);
        req_unlink(c, r);
        req_free(r);
    }
}

static void handle_finish(cluster_t *c, worker_t *w, const proto_msg *m)
{
    req_t *r = attempt_of(c, m->rid, w);
    if (!r)
        return;
    note_timing(r, w, m);
    /* A FINISH from the prefill worker (e.g. EOS as the first token) means the decode
     * worker, if another one, must not go on. */
    req_end_finish(c, r, m->reason, w != r->dw);
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
            req_retry(c, r, 0, why);
        } else if (m->code == PROTO_ERR_NOSPACE) { /* load, not failure: wait for room */
            r->dw->full = 1;
            req_retry(c, r, 0, why);
        } else {
            req_retry(c, r, 1, why);
        }
    } else if (m->code == PROTO_ERR_BAD_REQUEST) {
        req_end_error(c, r, 400, "invalid_request_error", "bad_request", why);
    } else {
        req_end_error(c, r, 500, "server_error", "worker_error", why);
    }
}

static void on_ctl(void *sock, void *ud)
{
    cluster_t *c = ud;
    int rc = proto_recv(sock, 1, c->env, ZMQ_DONTWAIT);
    if (rc <= 0) {
        if (rc == -2 && errno != EAGAIN)
            log_error("ctl receive: %s", zmq_strerror(errno));
        return;
    }
    size_t id_len;
    const unsigned char *id = proto_envelope_identity(c->env, &id_len);
    const proto_msg *m = proto_envelope_msg(c->env);
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
    case PROTO_ERROR:
        handle_error(c, w, m);
        break;
    case PROTO_BYE:
        if (w) {
            log_info("worker %s says BYE", w->id);
            worker_remove(c, w, "left (BYE)");
            schedule_dispatch(c);
        }
        break;
    default:
        log_warn("unexpected %s on the ctl socket from '%.*s': dropped", proto_type_str(m->type),
                 (int)id_len, (const char *)id);
        break;
    }
    proto_envelope_reset(c->env);
}

// --- offline tier: aging and the tidal policy

/* Aging: promote offline requests that waited policy.offline_max_wait_ms to the online
 * queue, at most offline_aging_per_worker per decode-capable worker at a time (and at
 * least one), so offline work is never starved forever whatever the online load. */
static void promote_aged(cluster_t *c, int64_t now)
{
    int n_dec = 0;
    for (const worker_t *w = c->workers; w; w = w->next)
        n_dec += usable(w) && (w->role == PROTO_ROLE_DECODE || w->role == PROTO_ROLE_MIXED);
    int cap = c->p.policy.offline_aging_per_worker * n_dec;
    if (cap < 1)
        cap = 1;
    int64_t wait_us = c->p.policy.offline_max_wait_ms * 1000;
    while (c->oqueue.head && c->n_promoted < cap && now - c->oqueue.head->enq_us >= wait_us) {
        req_t *r = c->oqueue.head;
        list_remove(&c->oqueue, r);
        r->promoted = 1;
        c->n_promoted++;
        r->since_us = now;
        list_push(&c->queue, r, 0);
        log_rinfo(r->rid, "offline request waited %lld ms: promoted to the online queue",
                  (long long)(now - r->enq_us) / 1000);
        schedule_dispatch(c);
    }
}

/* One policy call on the figures the gateway has; applies the offline admission and
 * preemption (role changes are left to the role-change machinery, not wired yet). */
static void policy_tick(cluster_t *c, int64_t now)
{
    int n = 0, have_prefill = 0, n_dec = 0;
    long seqs = 0;
    for (const worker_t *w = c->workers; w; w = w->next)
        n++;
    if (n > c->pworkers_cap) {
        policy_worker *v = realloc(c->pworkers, (size_t)n * sizeof(*v));
        if (!v)
            return;
        c->pworkers = v;
        c->pworkers_cap = n;
    }
    int i = 0;
    for (const worker_t *w = c->workers; w; w = w->next, i++) {
        policy_worker *pw = &c->pworkers[i];
        memset(pw, 0, sizeof(*pw));
        pw->index = i;
        pw->role = w->role;
        pw->state = w->dead                           ? POLICY_WORKER_DOWN
                    : w->state == PROTO_STATE_READY ? POLICY_WORKER_READY
                                                    : POLICY_WORKER_DRAINING;
        pw->role_age_ms = (now - w->role_since_us) / 1000;
        pw->changing = w->changing;
        pw->target_role = w->target_role;
        pw->running = w->running;
        pw->queued = w->queued;
        pw->queued_prompt_tokens = w->qtok;
        pw->kv_blocks_total = w->kv_total;
        pw->kv_blocks_used = w->kv_total - w->kv_free;
        pw->decode_batch = w->running;
        if (usable(w) && (w->role == PROTO_ROLE_PREFILL || w->role == PROTO_ROLE_MIXED))
            have_prefill = 1;
        if (usable(w) && (w->role == PROTO_ROLE_DECODE || w->role == PROTO_ROLE_MIXED) &&
            w->max_seqs > 0) {
            n_dec++;
            seqs += w->max_seqs;
        }
    }
    policy_input in = {.now_ms = now / 1000, .workers = c->pworkers, .n_workers = n};
    policy_cluster *cl = &in.cluster;
    int decoding = 0;
    for (const req_t *r = c->active.head; r; r = r->next) {
        if (r->offline && !r->promoted)
            continue;
        cl->online_running++;
        decoding += r->p_started || r->d_started;
    }
    /* A request waits here only when no decode worker has room, unless there is no prefill
     * worker at all: only then is it a prefill shortage (docs/scheduler.md). */
    if (have_prefill) {
        decoding += c->queue.n;
    } else {
        cl->online_queued = c->queue.n;
        for (const req_t *r = c->queue.head; r; r = r->next)
            cl->queued_prompt_tokens += r->n_prompt + r->n_gen;
        if (c->queue.head)
            cl->oldest_wait_ms = (now - c->queue.head->since_us) / 1000;
    }
    cl->online_decoding = decoding;
    if (c->p.tidal && c->lat_fn)
        c->lat_fn(c->lat_ud, now, &cl->ttft_p90_ms, &cl->tpot_p90_ms);
    cl->prompt_tokens_arrived = c->online_prompt_tokens;
    cl->offline_queued = c->oqueue.n;
    cl->offline_running = c->n_off_running;
    int64_t oldest = now;
    for (const req_t *r = c->oqueue.head; r; r = r->next)
        if (r->enq_us < oldest)
            oldest = r->enq_us;
    cl->offline_oldest_wait_ms = (now - oldest) / 1000;
    policy_params pp = c->p.policy;
    if (n_dec > 0)
        pp.decode_seqs_per_worker = (double)seqs / n_dec;
    policy_output out;
    if (policy_decide(&pp, &c->pstate, &in, &out) < 0) {
        if (!c->policy_failed)
            log_error("the tidal policy refused its input: offline admission stays at %d",
                      c->offline_max_running);
        c->policy_failed = 1;
        return;
    }
    if (out.offline_max_running != c->offline_max_running)
        log_debug("offline admission %d -> %d (pressure prefill %.2f decode %.2f; offline "
                  "running %d, queued %d)",
                  c->offline_max_running, out.offline_max_running, out.prefill_pressure,
                  out.decode_pressure, c->n_off_running, c->oqueue.n);
    c->offline_max_running = out.offline_max_running;
    /* Preempt the offline requests started last: the least work is lost. */
    int k = out.offline_preempt;
    req_t *prev;
    for (req_t *r = c->active.tail; r && k > 0; r = prev) {
        prev = r->prev;
        if (r->offline && !r->promoted) {
            req_preempt(c, r);
            k--;
        }
    }
    if (out.offline_max_running > c->n_off_running && c->oqueue.head)
        schedule_dispatch(c);
    /* Role changes (--tidal): by draining, see role_order(); never the last of a role. */
    for (int a = 0; c->p.tidal && a < out.n_actions; a++) {
        worker_t *w = c->workers;
        for (int j = 0; w && j < out.actions[a].worker; j++)
            w = w->next;
        int role = out.actions[a].role;
        if (!w || w->dead || w->changing || w->role == PROTO_ROLE_MIXED || w->role == role ||
            w->state != PROTO_STATE_READY || n_capable(c, w->role, w) < 1 ||
            (role != PROTO_ROLE_PREFILL && role != PROTO_ROLE_DECODE))
            continue;
        role_order(c, w, role, "the tidal policy");
    }
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
            req_retry(c, r, 1, why);
        }
    }
    for (req_t *r = c->queue.head; r; r = next) {
        next = r->next;
        if (!r->offline && now - r->since_us > limit) {
            char msg[160];
            snprintf(msg, sizeof(msg), "no worker could take the request within %d ms",
                     c->p.request_timeout_ms);
            req_end_error(c, r, 503, "server_error", "no_worker_available", msg);
        }
    }
    promote_aged(c, now);
    if (now - c->last_policy_us >= (int64_t)c->p.heartbeat_ms * 1000) {
        c->last_policy_us = now;
        policy_tick(c, now);
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
    c->cb = *cb;
    c->next_rid = ((uint64_t)time(NULL) << 20) | 1; /* distinct across gateway restarts */
    if (policy_params_check(&p->policy, err, errlen) < 0) {
        free(c);
        return NULL;
    }
    policy_state_init(&c->pstate);
    c->zctx = zmq_ctx_new();
    c->env = proto_envelope_new();
    if (!c->zctx || !c->env) {
        snprintf(err, errlen, "out of memory");
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
    if (zmq_bind(c->sock, p->ctl_bind) < 0) {
        snprintf(err, errlen, "cannot bind the ctl socket to %s: %s", p->ctl_bind,
                 zmq_strerror(errno));
        goto fail;
    }
    c->watch = evzmq_new(base, c->sock, MAX_MSGS_PER_CB, on_ctl, c);
    c->sweep_ev = event_new(base, -1, EV_PERSIST, on_sweep, c);
    c->dispatch_ev = event_new(base, -1, 0, on_dispatch, c);
    struct timeval tv = {0, SWEEP_MS * 1000};
    if (!c->watch || !c->sweep_ev || !c->dispatch_ev || event_add(c->sweep_ev, &tv) < 0) {
        snprintf(err, errlen, "cannot set up the ctl socket's events");
        goto fail;
    }
    return c;
fail:
    cluster_destroy(&c);
    return NULL;
}

void cluster_destroy(cluster_t **pc)
{
    if (!pc || !*pc)
        return;
    cluster_t *c = *pc;
    while (c->active.head)
        req_end_error(c, c->active.head, 503, "server_error", "shutting_down",
                      "the server is shutting down");
    while (c->queue.head)
        req_end_error(c, c->queue.head, 503, "server_error", "shutting_down",
                      "the server is shutting down");
    while (c->oqueue.head)
        req_end_error(c, c->oqueue.head, 503, "server_error", "shutting_down",
                      "the server is shutting down");
    while (c->workers) {
        worker_t *w = c->workers;
        c->workers = w->next;
        free(w);
    }
    evzmq_destroy(&c->watch);
    if (c->sweep_ev)
        event_free(c->sweep_ev);
    if (c->dispatch_ev)
        event_free(c->dispatch_ev);
    if (c->sock)
        zmq_close(c->sock);
    if (c->zctx)
        zmq_ctx_term(c->zctx);
    proto_envelope_destroy(&c->env);
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
    r->queued = 1;
    r->since_us = proto_now_us();
    r->enq_us = r->since_us;
    r->timing = job->timing;
    r->cb = job->cb ? job->cb : &c->cb;
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
    if (!r->offline)
        c->online_prompt_tokens += r->n_prompt;
    /* Start at once when nobody is ahead, so a burst does not fill the queue with
     * requests that have somewhere to go; only a request that must wait counts against
     * max_queue. An offline request also needs an empty online queue and an offline slot. */
    if (q->head == r &&
        (!r->offline || (!c->queue.head && c->n_off_running < c->offline_max_running)))
        try_assign(c, r);
    if (r->queued && q->n > c->p.max_queue) {
        req_unlink(c, r);
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
    req_detach(c, r, 1);
    req_unlink(c, r);
    req_free(r);
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
            .n_role_changes = w->n_role_changes,
            .role_change_ms = (double)w->role_change_us / 1000.0,
            .mig = w->mig,
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
