/*
 * cluster_internal: declarations shared by the files of the cluster module (cluster.h):
 * cluster.c (requests' life, workers, routing, timers, the public calls), cluster_msgs.c
 * (messages from workers on the ctl socket), cluster_roles.c (live role changes and live
 * migration) and cluster_tidal.c (the offline tier: aging and the tidal policy). Not a
 * public interface.
 */
#ifndef TP_GW_CLUSTER_INTERNAL_H
#define TP_GW_CLUSTER_INTERNAL_H

#include <event2/event.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cluster.h"
#include "evzmq.h"
#include "hsmon.h"
#include "protocol.h"
#include "wire.h"

#define N_BUCKETS 4096

#define CLUSTER_BAD_PEERS 8               /* failed KV links remembered per prefill worker */
#define CLUSTER_PAIR_PENALTY_US 1000000   /* first avoidance of a failed pair: 1 s, doubling */
#define CLUSTER_PAIR_PENALTY_MAX_US 30000000

/* cluster_route.c: what a worker's prefix cache is believed to hold */
typedef struct route_belief route_belief;
/* A prompt routed to a worker is believed cached there this many heartbeat intervals (or
 * as long as its summaries report it). */
#define CLUSTER_ROUTE_TTL_HB 10

typedef struct worker {
    struct worker *next;
    char id[PROTO_ID_LEN]; /* worker id == ZeroMQ routing id */
    size_t id_len;
    int role, state, pid;
    char kvep[PROTO_ENDPOINT_LEN];
    char kvpk[PROTO_KEY_LEN]; /* its kv ROUTER's CURVE public key (REGISTER; "" = none) */
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
    int pending_qtok;   /* prompt tokens sent as PREFILL, no token reported yet (cache-aware
                         * routing: those not believed cached there) */
    int pending_blocks; /* KV blocks promised as decode worker, no token reported yet */
    int n_decode;
    int moved_in;       /* MIGRATE orders naming it as target since its last heartbeat */       /* requests assigned with this worker as decode worker */
    int n_assigned;     /* requests assigned to it in any role */
    /* live role change: ROLE sent, routing skips it until it registers in target_role */
    int changing, target_role;
    int order_pending;      /* marked by this policy call, to be ordered (cluster_tidal.c) */
    int assigned_role;      /* the role it was last ordered to (0: none): restored when a
                             * new incarnation registers in another (cluster_msgs.c) */
    int64_t change_us;      /* when ROLE was sent */
    int emulated;           /* REGISTER / HEARTBEAT "emu" */
    int mtp_depth;          /* REGISTER "mtp": the depth it serves + 1; 0 = not reported */
    uint64_t n_role_changes; /* last heartbeat */
    int64_t role_change_us;  /* last heartbeat: its last change's duration */
    proto_mig_counters mig;  /* last heartbeat: live migrations */
    uint64_t pc_queries, pc_hits; /* last heartbeat: prefix cache tokens looked up / found */
    /* Decode workers this prefill worker recently failed to hand KV to (their link may be
     * down while both still reach the gateway): pick avoids the pair until `until_us`
     * when another pair can take the request (cluster_pair_failed / cluster_pair_ok). */
    struct {
        char id[PROTO_ID_LEN];
        size_t id_len; /* 0: free slot */
        int fails;     /* consecutive failures: the penalty doubles with each */
        int64_t until_us;
    } bad_peer[CLUSTER_BAD_PEERS];
    uint64_t n_preemptions;  /* last heartbeat: sequences it preempted (ERROR PREEMPTED) */
    route_belief *belief;    /* its prefix cache as believed (cluster_route.c; NULL = none) */
    int route_hit;           /* pick_pass scratch: prompt tokens expected cached here */
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
    int logprobs;  /* PREFILL "lpk": 0, or alternatives + 1 */
    int echo;      /* PREFILL "echo" (with logprobs) */
    proto_sampling *samp; /* PREFILL "samp" (owned; NULL = none); its n_gen is set to n_gen
                           * at each PREFILL (a retry's generated tokens) */
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
    int doomed;                  /* cluster_cancel_soon: cancelled at the next dispatch */
    /* the worker whose TOKENS it could not use (out of the vocabulary, undecodable): its
     * re-runs go elsewhere when another pair can take them (pick) */
    char shun[PROTO_ID_LEN];
    size_t shun_len;
    /* TOKENS (and the FINISH after them) from the decode worker that overtook the prefill
     * worker's first token: the two come over different connections, and with logprobs
     * the decode worker does not repeat that token. Held (owned: tokens, lps) until it
     * arrives, dropped with the attempt (cluster_req_detach); NULL = none. */
    proto_msg *held;
    int held_finish; /* FINISH reason + 1 held after them, 0 = none */
} req_t;

typedef struct {
    req_t *head, *tail;
    int n;
} rlist_t;

/* A CANCEL the gateway could not send: the attempt's worker was declared dead (cut off, or
 * silent) while it may still hold the attempt, which was re-run elsewhere. Kept until that
 * worker registers again (then sent) or the slot is reused. */
#define OWED_CANCELS 4096
/* attempts remembered as ended before their prefill worker's TOKENS arrived */
#define LATE_PREFILLS 256
typedef struct {
    char id[PROTO_ID_LEN];
    size_t id_len; /* 0: free slot */
    int pid;       /* the worker process that held the attempt */
    uint64_t rid;  /* wire rid of the attempt */
} owed_cancel;

/* The role a removed worker was last ordered to, for its next incarnation (restore_role in
 * cluster_msgs.c): a ring of REMEMBERED_ROLES, the oldest forgotten first. */
#define REMEMBERED_ROLES 256
typedef struct {
    char id[PROTO_ID_LEN]; /* "" = free slot */
    int role;
} remembered_role;

/* A worker id refused at registration (cluster_foreach_refused). */
typedef struct {
    char id[PROTO_ID_LEN]; /* "" = free slot */
    int role, pid;
    char reason[PROTO_MESSAGE_LEN];
    uint64_t n_refused;
    int64_t last_us;
} refused_worker;

struct cluster {
    struct event_base *base;
    cluster_params p;
    cluster_callbacks cb;
    void *zctx, *sock;
    curve_zap_t *zap; /* CURVE: the ZAP handler admitting the workers' keys (NULL = plain) */
    uint64_t *route_chain; /* (route_cap,) cluster_route.c scratch: a prompt's block hashes */
    int route_cap;
    hsmon_t *hsmon;   /* logs the ctl ROUTER's failed handshakes, with the peer address */
    evzmq_t *watch;
    wire_envelope *env;
    struct event *sweep_ev, *dispatch_ev;
    worker_t *workers;
    req_t *buckets[N_BUCKETS];
    rlist_t queue, active;
    rlist_t oqueue;     /* offline requests waiting (promoted ones move to queue) */
    int n_off_running;  /* offline, not promoted, on the active list */
    int n_promoted;     /* promoted by aging and not ended */
    int n_doomed;       /* cluster_cancel_soon calls since the last dispatch */
    uint64_t next_rid;
    /* the tidal policy (offline admission and preemption) */
    policy_state pstate;
    policy_worker *pworkers; /* scratch input, grown as workers come */
    int pworkers_cap;
    int64_t last_policy_us;
    int64_t online_prompt_tokens; /* online prompt tokens ever admitted */
    int64_t online_arrived;       /* online requests ever admitted */
    int64_t online_done;          /* online requests that finished (not failed) ... */
    int64_t online_output_tokens; /* ... and the tokens they generated */
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
    refused_worker refused[CLUSTER_MAX_REFUSED]; /* unordered; the oldest is reused */
    uint64_t n_refused;
    owed_cancel owed[OWED_CANCELS]; /* a ring: the oldest is dropped when full */
    int next_owed;
    uint64_t late[LATE_PREFILLS]; /* wire rids ended before their prefill's TOKENS: a ring */
    remembered_role roles[REMEMBERED_ROLES]; /* of removed workers: a ring */
    int next_role;
    int next_late;
};

// --- small helpers

static inline void list_push(rlist_t *l, req_t *r, int front)
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

static inline void list_remove(rlist_t *l, req_t *r)
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
static inline rlist_t *qlist(cluster_t *c, const req_t *r)
{
    return r->offline && !r->promoted ? &c->oqueue : &c->queue;
}

/* Workers see one rid per attempt: the request's id shifted left by WIRE_ATTEMPT_BITS,
 * plus the attempt number modulo 2^WIRE_ATTEMPT_BITS (request ids start at 1, so a wire
 * rid is never 0). */
#define WIRE_ATTEMPT_BITS 8
static inline uint64_t wire_rid(const req_t *r)
{
    return (r->rid << WIRE_ATTEMPT_BITS) | (r->attempt & ((1u << WIRE_ATTEMPT_BITS) - 1));
}

static inline req_t **bucket(cluster_t *c, uint64_t rid)
{
    return &c->buckets[(rid * 0x9E3779B97F4A7C15ull) >> 52];
}

static inline req_t *req_find(cluster_t *c, uint64_t rid)
{
    for (req_t *r = *bucket(c, rid); r; r = r->hnext)
        if (r->rid == rid)
            return r;
    return NULL;
}

/* Forget the held TOKENS/FINISH of r's attempt (req_t.held). */
static inline void req_drop_held(req_t *r)
{
    if (r->held) {
        proto_msg_clear(r->held);
        free(r->held);
        r->held = NULL;
    }
    r->held_finish = 0;
}

static inline void req_free(req_t *r)
{
    req_drop_held(r);
    free(r->tokens);
    free(r->samp);
    free(r);
}

static inline void req_shun(req_t *r, const worker_t *w)
{
    memcpy(r->shun, w->id, w->id_len);
    r->shun_len = w->id_len;
}

static inline int req_shuns(const req_t *r, const worker_t *w)
{
    return r->shun_len && r->shun_len == w->id_len && memcmp(r->shun, w->id, w->id_len) == 0;
}

static inline worker_t *worker_find(cluster_t *c, const void *id, size_t len)
{
    for (worker_t *w = c->workers; w; w = w->next)
        if (w->id_len == len && memcmp(w->id, id, len) == 0)
            return w;
    return NULL;
}

static inline void notify(cluster_t *c, cluster_event_type_t type, const worker_t *w,
                          uint64_t rid, const char *reason)
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

static inline void schedule_dispatch(cluster_t *c)
{
    event_active(c->dispatch_ev, EV_TIMEOUT, 0);
}

static inline int usable(const worker_t *w)
{
    return !w->dead && w->state == PROTO_STATE_READY;
}

/* Whether w may be given new work at now_us: usable and heard from within half of
 * dead_after_ms (at least two heartbeat intervals). A worker silent that long is probably
 * cut off like the one just declared dead (a partition takes several at once, found dead
 * one sweep after another): a re-run sent there would fail again a moment later, each time
 * costing the request one of its max_retries, until a partition of N workers lost it
 * (found by tests/netns/test_multihost.py). It gets work again with its next message. */
static inline int routable(const cluster_t *c, const worker_t *w, int64_t now_us)
{
    int64_t quiet_ms = c->p.dead_after_ms / 2;
    if (quiet_ms < 2 * (int64_t)c->p.heartbeat_ms)
        quiet_ms = 2 * (int64_t)c->p.heartbeat_ms;
    return usable(w) && now_us - w->last_seen_us <= quiet_ms * 1000;
}

/* Tokens a decode worker reserves for a sequence on top of the KV it receives: its first
 * step's verify, 1 + the deepest MTP draft (the worker's RUNTIME_KV_HEADROOM_TOKENS). */
#define KV_HEADROOM_TOKENS 3

/* KV blocks decode worker d reserves for r when it joins: its prompt and the tokens
 * generated so far plus the first step's headroom, capped at the context, as the worker
 * reserves it (kvtransfer; blocks on demand: it takes more as it generates, and preempts
 * when they run out, docs/kvtransfer.md "Reservations"). */
static inline int blocks_needed(const req_t *r, const worker_t *d)
{
    int bs = d->block_size > 0 ? d->block_size : 16;
    int tokens = r->n_prompt + r->n_gen + KV_HEADROOM_TOKENS;
    if (d->n_ctx > 0 && tokens > d->n_ctx)
        tokens = d->n_ctx;
    return (tokens + bs - 1) / bs;
}

// --- cluster.c: requests' life and workers

/* Send m to worker w; a failure flags w dead (and schedules a dispatch to reap it).
 * Returns 0 or -1. */
int cluster_send_to(cluster_t *c, worker_t *w, const proto_msg *m);
/* Undo the attempt's bookkeeping on its workers; cancel: also CANCEL it there (a worker
 * flagged dead is owed the CANCEL until it registers again: cluster_send_owed_cancels). */
void cluster_req_detach(cluster_t *c, req_t *r, int cancel);
/* Whether wire (a wire rid) names an attempt that ended without a CANCEL (at max_tokens or
 * EOS, by its decode worker) before its prefill worker's TOKENS arrived: the prefill
 * worker's late messages for it are expected, not a sign of a lost CANCEL. */
int cluster_late_prefill(const cluster_t *c, uint64_t wire);
/* w registered again as process pid: send it the CANCELs owed to that process (attempts it
 * held when it was declared dead, re-run elsewhere since) and forget those owed to an
 * earlier process with its id. */
void cluster_send_owed_cancels(cluster_t *c, worker_t *w, int pid);
/* Take r out of the hash and its list (the caller then reports and frees it). */
void cluster_req_unlink(cluster_t *c, req_t *r);
/* End r with on_error (HTTP status, OpenAI error type and code, message); frees r. */
void cluster_req_end_error(cluster_t *c, req_t *r, int status, const char *type,
                           const char *code, const char *msg);
/* End r with on_finish(reason), cancelling it on its workers if cancel; frees r. */
void cluster_req_end_finish(cluster_t *c, req_t *r, int reason, int cancel);
/* A KV hand-off from prefill worker p to decode worker d failed: avoid the pair for a
 * while (1 s, doubling per consecutive failure up to 30 s) when another pair can serve. */
void cluster_pair_failed(cluster_t *c, worker_t *p, const worker_t *d);
/* A hand-off from p to d succeeded: forget its failures. */
void cluster_pair_ok(worker_t *p, const worker_t *d);
/* The current attempt failed: re-queue r (at the head) to re-run from prompt + tokens so
 * far, or end it (max_retries reached when counts, or nothing left to generate). */
void cluster_req_retry(cluster_t *c, req_t *r, int counts, const char *why);
/* Cancel offline request r on its workers and put it back at the head of the offline
 * queue with its tokens so far. */
void cluster_req_preempt(cluster_t *c, req_t *r);
/* Re-run (or, where only its prefill part is gone, keep) every request w had. */
void cluster_worker_fail_requests(cluster_t *c, worker_t *w, const char *why);
/* Flag w dead, move its requests (cluster_worker_fail_requests), unlink and free it. */
void cluster_worker_remove(cluster_t *c, worker_t *w, const char *why);

// --- cluster_msgs.c: messages from workers

/* The ctl socket's evzmq callback (ud: the cluster): receive and handle one message. */
void cluster_on_ctl(void *sock, void *ud);

// --- cache-aware routing (cluster_route.c)

/* Replace w's belief by the summary of its last HEARTBEAT ("pfx"; NULL: none, the belief
 * is dropped), keeping what was routed to it lately. */
void cluster_route_summary(worker_t *w, const proto_prefix_summary *px);
/* Drop w's belief (a new process or role: its cache is gone); also frees it. */
void cluster_route_forget(worker_t *w);
/* Prompt tokens of r (its prompt and tokens so far) that w is believed to hold cached: a
 * multiple of w's block size, 0 without a belief. */
int cluster_route_expected_hit(cluster_t *c, const worker_t *w, const req_t *r);
/* r was routed to w: its full blocks are believed cached there from now on. */
void cluster_route_routed(cluster_t *c, worker_t *w, const req_t *r);
/* Block hashes w's belief holds now (GET /workers "prefix_blocks_believed"). */
int cluster_route_n_believed(const worker_t *w);

// --- cluster_roles.c: live role changes and live migration

/* Send ROLE to w (why: who ordered it, for the log) and take it out of routing until it
 * registers again; a decode worker's sequences are moved away (MIGRATE). Returns 0 or -1
 * (the send failed: w is flagged dead). */
int cluster_role_order(cluster_t *c, worker_t *w, int role, const char *why);
/* Take w out of routing and of the migration targets as changing to `role`, without
 * ordering it yet (cluster_role_order does, and marks it too): the workers one policy call
 * moves are all marked before the first is ordered. */
void cluster_role_mark(worker_t *w, int role);
/* w registered again after ROLE (same process), in role `role`: settle its requests and
 * count, log and report the change (done, or not made). Call before w->role is updated. */
void cluster_role_change_done(cluster_t *c, worker_t *w, int role);
/* Workers able to do role (ready ones, plus those changing to it; mixed counts for both),
 * not counting skip. */
int cluster_n_capable(const cluster_t *c, int role, const worker_t *skip);

// --- cluster_tidal.c: the offline tier

/* Aging: promote the offline requests that waited policy.offline_max_wait_ms to the
 * online queue, within the aging cap. now: proto_now_us(). */
void cluster_promote_aged(cluster_t *c, int64_t now);
/* Call the tidal policy once and apply its offline admission, preemption and (--tidal)
 * role changes. now: proto_now_us(). */
void cluster_policy_tick(cluster_t *c, int64_t now);

#endif
