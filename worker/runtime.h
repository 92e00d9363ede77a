/*
 * runtime: the contract between the worker runtime (worker/) and the two roles it drives,
 * prefill (prefill_worker/prefill.c) and decode (decode_worker/decode.c).
 *
 * The runtime owns what does not depend on the role: the settings, the compute state (model,
 * KV cache, sampler, MTP modules; worker/compute.h), the ctl socket to the gateway,
 * registration and heartbeats, signals and drain, the role-change protocol, the KV sender
 * (prefill transfers and decode migrations both use it) and the loop. A role is a state
 * struct of its own behind a table of operations (runtime_role_ops): the runtime attaches
 * it, hands it the messages and events that are its own, runs its step once per loop
 * iteration and asks it for its load figures. A prefill worker has the prefill role
 * attached, a decode worker the decode role, a mixed worker both; a role change attaches
 * the new role and detaches the old one once the worker is idle.
 *
 * The roles never see each other: a mixed worker's prompt decoded where it was computed
 * goes from the prefill role to the decode role through runtime_handoff_local().
 *
 * Everything runs on the loop thread; no operation blocks (sends use ZMQ_DONTWAIT and drop
 * with a log line when a peer cannot take them).
 */
#ifndef TP_RUNTIME_H
#define TP_RUNTIME_H

#include <stdint.h>

#include "compute.h"
#include "curve.h"
#include "hsmon.h"
#include "settings.h"
#include "kvtransfer.h"
#include "protocol.h"
#include "sampler.h"
#include "seqpen.h"

typedef struct runtime runtime_t;

/* Exit status of a worker the gateway refused at registration (REGISTER_ACK with a code:
 * another model or KV block size than the cluster's): EX_CONFIG of sysexits.h. Launchers do
 * not restart a worker that exited with it (a restart would be refused again). */
#define RUNTIME_EXIT_REFUSED 78

/* KV blocks on demand (docs/kvtransfer.md "Reservations"): a sequence joining a decode role
 * (KV_BEGIN, a local prefill, a migration) reserves its transferred tokens plus this many,
 * what its first decode step verifies at most (1 + the deepest MTP draft); every later
 * step reserves what it needs itself, and preempts when blocks run out. */
#define RUNTIME_KV_HEADROOM_TOKENS (1 + SPECDEC_MAX_DEPTH)

/* A sequence whose prompt was computed here and that is decoded here (mixed worker): what
 * the prefill role hands the decode role. The KV sequence and `hand` move with it. */
typedef struct {
    uint64_t rid;
    int seq;        /* kvcache sequence holding the prompt's KV (owned from here) */
    int pos;        /* tokens whose KV is in the cache (the prompt) */
    int first;      /* the first generated token (already reported, TOKENS index 0) */
    int max_tokens; /* generated tokens in total, first included */
    sampler_params sp;
    uint64_t rng;  /* sampler state after the first token */
    int mtp_req;   /* the request's MTP depth + 1 (0 = not set) */
    int mtp_depth; /* drafts it may make per step (0 = no module work) */
    int priority;  /* PREFILL "pri": 0 online, 1 offline (preempted first) */
    int logprobs;  /* PREFILL "lpk": 0, or log-probabilities with k alternatives + 1 */
    float *hand;   /* (2, dim) MTP hand-off state (owned from here; NULL without MTP) */
    seqpen_t *pen; /* sampling controls and ids so far, first included (owned from here;
                    * NULL = none) */
    int *ids;      /* prefix caching: the prompt's n_ids ids (malloc'd, owned from here; NULL
                    * = the cache is off): the decode role registers the sequence's blocks
                    * under pfx_seed / pfx_la when it ends (docs/prefix-cache.md) */
    int n_ids;
    uint64_t pfx_seed;
    int pfx_la;
} runtime_handoff;

/* A role's operations. Every one runs on the loop thread and gets the state its attach
 * returned. Optional ones may be NULL. */
typedef struct {
    /* Create the role's state on rt (sockets it owns included). NULL on failure (logged). */
    void *(*attach)(runtime_t *rt);
    /* Free the state and everything it still holds (requests, their KV, its sockets); NULL
     * *st. Called when the role is idle (role change) or at shutdown (anything goes). */
    void (*detach)(void **st);
    /* A ctl message that may be the role's (PREFILL, MIGRATE). Returns 1 if it took it
     * (m's tokens may be taken), 0 if the message is not for this role. */
    int (*on_msg)(void *st, proto_msg *m);
    /* CANCEL rid: drop it wherever it is in this role. Returns 1 if it held it. */
    int (*on_cancel)(void *st, uint64_t rid);
    /* A KV sender event (kvx_sender_next_event). Returns 1 if the transfer was this
     * role's, 0 to offer it to the other role. */
    int (*on_send_event)(void *st, const kvx_event *ev);
    /* Optional: the role's own sockets for zmq_poll (items, at most cap); returns how many. */
    int (*pollitems)(void *st, zmq_pollitem_t *items, int cap);
    /* Optional: ms until the role's next timer (-1 = none). */
    int (*next_timeout_ms)(void *st);
    /* Optional: after every poll: serve the role's own sockets and their events. */
    void (*process)(void *st);
    /* Run one step (a prefill batch, a decode step). Returns 1 if it did work. */
    int (*step)(void *st);
    /* Whether a step would do work now (the loop then polls with timeout 0). */
    int (*has_work)(const void *st);
    /* Add the role's figures to a HEARTBEAT (running, queued, queued_prompt_tokens, kvx_rx). */
    void (*load)(const void *st, proto_msg *hb);
    /* No request, transfer or pinned sequence of this role left. */
    int (*idle)(const void *st);
    /* Optional: a role change away from this role was ordered (ROLE): stop taking new work
     * and give back what has not started. */
    void (*begin_change)(void *st);
    /* Optional: the change was called off or failed: take work again. */
    void (*resume)(void *st);
    /* Decode role only: take a sequence computed here (runtime_handoff_local). */
    void (*adopt)(void *st, runtime_handoff *h);
} runtime_role_ops;

/* An attached role: its operations and its state. */
typedef struct {
    const runtime_role_ops *ops;
    void *st;
} runtime_role;

/* The two roles (defined in prefill_worker/ and decode_worker/). */
extern const runtime_role_ops prefill_role_ops;
extern const runtime_role_ops decode_role_ops;

/* The runtime's state. The roles read settings, compute, role, draining, role_target,
 * wid, zctx and sender, and write kv_endpoint (the decode role: its bound kv socket) and
 * the counters; the rest is the runtime's own (worker.c). */
struct runtime {
    worker_settings set;
    worker_compute cp; /* model, KV cache, sampler, MTP, emulation (compute.h) */

    proto_role_t role;        /* the role it registers with */
    proto_role_t role_target; /* a role change in progress: the role being moved to, else 0 */
    int draining;             /* SIGTERM: finish the work, then leave */
    /* decode -> prefill done, the decode role still attached until the moves it started
     * and the KV transfers still arriving are over (then detached); it takes no new work */
    int decode_leaving;
    char wid[PROTO_ID_LEN];
    char kv_endpoint[PROTO_ENDPOINT_LEN]; /* advertised in REGISTER ("" = none) */
    void *zctx;
    kvx_sender_t *sender; /* NULL until a role needs it (runtime_open_sender) */
    /* CURVE (--curve-*; docs/security.md): curve_on = the ctl DEALER, the kv ROUTER and
     * the kv DEALERs use key pair curve; the kv ROUTER admits the keys of curve_auth (the
     * ZAP handler owns it once started) */
    int curve_on;
    curve_keypair curve;
    char curve_gateway_pub[CURVE_Z85_LEN + 1];
    curve_authlist_t *curve_auth;
    curve_zap_t *zap;
    /* counters since start (HEARTBEAT), kept across role changes */
    uint64_t tokens_in, tokens_out; /* prompt tokens computed, tokens generated */
    uint64_t prefix_queries;        /* prompt tokens looked up in the prefix cache */
    uint64_t prefix_hits;           /* of those, tokens found cached (not computed) */
    proto_mig_counters mig;         /* live migrations out and in (decode role) */
    uint64_t n_preemptions;         /* sequences preempted for KV blocks (decode role;
                                     * HEARTBEAT "npre", vLLM's num_preemptions) */
    proto_spec_counters spec;       /* speculative decoding (decode role; zeros without MTP) */

    /* runtime only */
    void *ctl; /* DEALER to the gateway, routing id = wid */
    hsmon_t *ctl_mon; /* logs the ctl DEALER's failed handshakes */
    int ctl_backoff_ms; /* reopen the ctl DEALER after this long without REGISTER_ACK */
    uint64_t n_ctl_reopens;
    int sigfd;
    struct wire_envelope *env;
    void *prefill, *decode; /* attached role states (NULL = not attached) */
    runtime_role roles[2];  /* the attached roles, prefill first */
    int n_roles;
    int registered;
    int refused;              /* the gateway refused the REGISTER: leave (RUNTIME_EXIT_REFUSED) */
    int64_t unacked_since_us; /* first REGISTER on this ctl DEALER not acknowledged yet
                                 (0 = none) */
    int hb_ms;
    int64_t next_hb_us;
    int64_t role_order_us;  /* when the change in progress was ordered */
    int64_t role_change_us; /* the last change's duration: ROLE received -> switched */
    int64_t leave_idle_us;  /* decode_leaving: when its moves and transfers were all over
                             * (0 = not yet) */
    uint64_t n_role_changes;
    int ctl_ok;           /* the last REGISTER/HEARTBEAT went out (the gateway is connected) */
    int64_t health_us;    /* last write of the health file (--health-file; 0 = none yet) */
    char health_last[64]; /* its state line then (rewritten early when it changes) */
    int health_err;       /* a write failed (logged once) */
    /* TOKENS and FINISH of this loop iteration, encoded, sent as one BUNDLE before the
     * next poll (or before any other ctl message, which keeps the order): headers back to
     * back in bundle_buf, message i at [bundle_off[i], bundle_off[i + 1]) */
    unsigned char *bundle_buf;
    size_t bundle_cap;
    size_t bundle_off[PROTO_BUNDLE_MAX + 1];
    int n_bundle;
};

/* Durations a worker reports with a request's TOKENS or FINISH (proto_msg queue_us,
 * prefill_us, xfer_us, xfer_bytes, step_us; 0 = not reported), in microseconds of this
 * worker's clock. */
typedef struct {
    int64_t queue_us, prefill_us, xfer_us, step_us;
    uint64_t xfer_bytes;
} runtime_timing;

// --- messages to the gateway (each logs and drops when the ctl socket cannot take it)
// TOKENS and FINISH are gathered and go out together, as one BUNDLE, before the loop polls
// again (runtime_flush_bundle): one ZeroMQ message per decode step, not one per sequence.
// TOKENS at index 0 (a request's first token) go at once, after what was gathered.

/* TOKENS: generated tokens [index, index + n) of request rid (borrowed), the sampler state
 * rng after the last of them (so that a re-run elsewhere continues the same random stream),
 * and the request's durations t (NULL: none). lps: NULL, or (n,) the tokens'
 * log-probabilities (borrowed; TOKENS "lp"), n <= RUNTIME_MAX_LP_TOKENS then. */
#define RUNTIME_MAX_LP_TOKENS (SPECDEC_MAX_DEPTH + 2)
void runtime_send_tokens(runtime_t *rt, uint64_t rid, int index, const int *tokens, int n,
                         uint64_t rng, const runtime_timing *t, const sampler_logprob *lps);
/* FINISH with reason PROTO_FINISH_STOP or _LENGTH and durations t (NULL: none). */
void runtime_send_finish(runtime_t *rt, uint64_t rid, int reason, const runtime_timing *t);
/* TOKENS "echo": the log-probabilities lps (n, borrowed) of prompt tokens [index, index + n)
 * of request rid (tokens: those ids, borrowed), gathered like decode TOKENS (so they reach
 * the gateway before the first generated token, sent at once after them). */
void runtime_send_prompt_logprobs(runtime_t *rt, uint64_t rid, int index, const int *tokens, int n,
                                  const proto_logprob *lps);
/* Copy a sampler's log-probabilities into their wire form. */
void runtime_logprob_to_proto(proto_logprob *dst, const sampler_logprob *src);
/* Send the gathered TOKENS and FINISH now: one alone as itself, several as one BUNDLE (its
 * frames in the order they were gathered). The loop calls it before every poll, and every
 * other message to the gateway flushes first. A full or disconnected socket drops them
 * (logged, as for every ctl message). */
void runtime_flush_bundle(runtime_t *rt);
/* ERROR: code PROTO_ERR_*, retry 1 when the gateway may re-run the request elsewhere; msg
 * is copied (cut at PROTO_MESSAGE_LEN). */
void runtime_send_error(runtime_t *rt, uint64_t rid, int code, int retry, const char *msg);

// --- services for the roles

/* Create the KV sender if there is none (the prefill role sends prompts' KV, the decode
 * role migrates sequences). Returns 0, or -1 (logged). */
int runtime_open_sender(runtime_t *rt);
/* Whether a decode role is attached here (a PREFILL without a decode endpoint can be
 * decoded locally). */
int runtime_decodes_locally(const runtime_t *rt);
/* Hand a sequence computed here to the decode role (ownership of h->seq and h->hand moves;
 * *h is left empty). Without a decode role the request fails with a retryable error and
 * its KV is freed. */
void runtime_handoff_local(runtime_t *rt, runtime_handoff *h);

/* KV blocks of --kv-watermark: int(watermark * the cache's blocks), as vLLM counts it. */
int runtime_kv_watermark_blocks(const runtime_t *rt);

// --- the program (worker.c drives these)

/* Open the ctl socket to the gateway and attach the roles of rt->role (prefill, decode or
 * both). Returns 0, or -1 (logged). */
int runtime_open(runtime_t *rt);
/* The loop, until drained (returns 0), a second signal or a fatal socket error (1), or the
 * gateway refused the registration (RUNTIME_EXIT_REFUSED, the reason logged). */
int runtime_run(runtime_t *rt);
/* Detach the roles, close the sockets (fast: without lingering to flush) and the zmq
 * context. Takes a partly opened rt. The compute state is the caller's. */
void runtime_close(runtime_t *rt, int fast);

#endif
