/*
 * cluster: the gateway's view of its workers and of every admitted request.
 *
 * Owns the ctl ROUTER socket (it binds; workers connect with DEALER sockets whose routing
 * id is their worker id) and speaks the ctl half of docs/protocol.md: REGISTER /
 * REGISTER_ACK, HEARTBEAT (an unknown worker is answered with BYE so it registers again),
 * BYE, PREFILL, CANCEL, TOKENS, FINISH, ERROR. A worker is dead after dead_after_ms
 * without a message, or as soon as a send to it fails (ZMQ_ROUTER_MANDATORY:
 * EHOSTUNREACH).
 *
 * Requests: cluster_submit() admits a tokenized prompt; it waits in a bounded FIFO until a
 * decode (or mixed) worker with room and a prefill (or mixed) worker are available, then
 * a PREFILL order goes to the prefill worker naming the decode worker. Load is tracked
 * locally as well as from heartbeats (prompt tokens sent to a prefill worker that has not
 * yet reported a token; KV blocks promised to a decode worker that has not yet reported),
 * so a burst does not all land on one worker between two heartbeats.
 *
 * Generated tokens reach the owner in order, exactly once, through cluster_callbacks,
 * whatever the workers repeat (TOKENS carry an index; ids below what is known are
 * dropped). When an attempt fails (ERROR with retry = 1, a dead worker, no progress for
 * request_timeout_ms), the request is re-run from prompt + tokens so far with max_tokens
 * reduced accordingly, so the owner sees one unbroken sequence; after max_retries
 * failures it ends with on_error. Every admitted request ends with exactly one on_finish
 * or on_error call, or with cluster_cancel() by its owner.
 *
 * Two tiers: online requests (interactive) and offline ones (service_tier "flex", batch
 * lines). The queue is two-level: offline requests are dispatched only when no online
 * request waits, and only while fewer than the tidal policy's offline_max_running
 * (policy.h, called every heartbeat_ms with the workers' and the queues' figures) run.
 * When the policy asks for preemption, the offline requests started last are cancelled on
 * their workers and re-queued with their tokens so far (re-run later like a retry: the
 * owner sees one unbroken sequence). Aging: an offline request waiting
 * policy.offline_max_wait_ms is promoted to the online queue (at most
 * offline_aging_per_worker per decode-capable worker at a time), so it is never starved
 * forever; a promoted request is not preempted. Offline requests never time out in the
 * queue (their owner bounds the wait); --request-timeout-ms still applies to their attempts.
 *
 * Runs entirely on the loop thread of the event_base it was created with; never blocks.
 */
#ifndef TP_GW_CLUSTER_H
#define TP_GW_CLUSTER_H

#include <stddef.h>
#include <stdint.h>

#include "curve.h"
#include "policy.h"
#include "protocol.h"

struct event_base;

typedef struct cluster cluster_t;

/* How the prefill worker of a request is chosen (--routing; docs/prefix-cache.md). */
typedef enum {
    /* the least cost: the prompt tokens it would compute there (those its prefix cache is
     * not believed to hold: HEARTBEAT "pfx" summaries) plus routing_load_weight times the
     * tokens it is expected to compute for the prompts sent to it (SGLang's cache-aware
     * router, Dynamo's KV-aware cost) */
    CLUSTER_ROUTING_CACHE_AWARE = 0,
    CLUSTER_ROUTING_LEAST_LOADED, /* the fewest queued prompt tokens */
} cluster_routing_t;

/* The name of a routing mode ("cache-aware", "least-loaded"), as --routing spells it. */
const char *cluster_routing_str(cluster_routing_t r);
/* Parse --routing's value into *out. 0, or -1 for another name (*out untouched). */
int cluster_routing_parse(const char *s, cluster_routing_t *out);

typedef struct {
    const char *ctl_bind;   /* ZeroMQ endpoint to bind, e.g. tcp://127.0.0.1:5557 */
    int heartbeat_ms;       /* interval told to workers in REGISTER_ACK */
    int dead_after_ms;      /* silence after which a worker is dead */
    int request_timeout_ms; /* no progress this long: retry (assigned) / 503 (queued) */
    int max_retries;        /* failed attempts re-run before giving up */
    int max_queue;          /* requests waiting for a worker before cluster_submit is FULL
                             * (online and offline requests each have a queue this long) */
    policy_params policy;   /* the tidal policy's knobs (offline admission, preemption and
                             * aging); decode_seqs_per_worker is replaced every tick by the
                             * decode-capable workers' mean max_seqs when there are any */
    int tidal;              /* 1: apply the policy's role changes (ROLE to the worker) */
    /* CURVE (docs/security.md): when curve is set (borrowed; copied by cluster_new) the
     * ctl ROUTER is a CURVE server with this key pair, and curve_auth (consumed by
     * cluster_new, also when it fails: the caller forgets its pointer) lists the worker
     * public keys admitted; the cluster's ZAP handler refuses every other. Both or none. */
    const curve_keypair *curve;
    curve_authlist_t *curve_auth;
    /* Registration checks: a REGISTER that does not match is refused (REGISTER_ACK with
     * PROTO_ERR_LAYOUT and the reason; the worker exits), listed by cluster_foreach_refused
     * and never routed to. */
    uint64_t model_fingerprint; /* the model's (model_config.fingerprint); 0 = not checked */
    int kv_block_size;      /* tokens per KV block every worker must use; 0 = pinned by the
                             * first worker accepted, released when no worker is registered */
    int n_vocab;            /* token ids a worker may send are in [0, n_vocab): a TOKENS
                             * message with any other id is dropped, logged and its attempt
                             * re-run elsewhere; 0 = not checked */
    cluster_routing_t routing; /* how a prefill worker is chosen (--routing) */
    double routing_load_weight; /* cache-aware: weight of a worker's expected queued prompt
                                 * tokens against the tokens a request would compute there
                                 * (--routing-load-weight) */
} cluster_params;

/* Defaults matching the gateway's flags. */
cluster_params cluster_default_params(void);

/* How the cluster reports on a request; ud is the pointer given to cluster_submit. */
typedef struct {
    /* n >= 1 new tokens, in order, never repeated, with their log-probabilities (lps: (n,)
     * borrowed for the call; NULL unless the job asked for them, and then never NULL).
     * Return 0 to continue, or 1 when the owner has completed the request itself (stop
     * string, EOS, enough tokens): the cluster then sends CANCEL to its workers, forgets
     * it, and calls nothing more. */
    int (*on_tokens)(void *ud, const int *tokens, const proto_logprob *lps, int n);
    /* Optional (NULL: none; a job with echo needs it): the log-probabilities lps (n,
     * borrowed) of prompt tokens [index, index + n) (tokens: their ids), index >= 1, as the
     * workers reported them; a retry may report some again (and positions past the original
     * prompt: the owner ignores what it does not need). */
    void (*on_prompt_logprobs)(void *ud, int index, const int *tokens, const proto_logprob *lps,
                               int n);
    /* The request ended normally; reason is proto_finish_t. Forgotten afterwards. */
    void (*on_finish)(void *ud, int reason);
    /* The request failed for good: an HTTP status (4xx/5xx), an OpenAI error type and
     * code, and a message. Forgotten afterwards. */
    void (*on_error)(void *ud, int status, const char *type, const char *code, const char *message);
} cluster_callbacks;

/* What the cluster learns about a request's timing, filled in as it happens when the job
 * names one (cluster_job.timing). Times are this gateway's monotonic clock (proto_now_us);
 * the workers' figures are durations each measured on one worker's own clock (TOKENS /
 * FINISH optional fields; 0 = not reported), never differences between two hosts'
 * clocks. On a retry the worker figures are those of the latest attempt. */
typedef struct {
    int64_t admit_us;                  /* cluster_submit */
    int64_t dispatch_us;               /* the first PREFILL sent (0 = none yet) */
    int64_t worker_queue_us;           /* prefill worker: PREFILL received -> batch start */
    int64_t prefill_us;                /* prefill worker: batch start -> first token */
    int64_t xfer_us;                   /* decode worker: KV transfer (0 = none, mixed) */
    uint64_t xfer_bytes;               /* decode worker: KV bytes received */
    int64_t step_us;                   /* decode worker: ready -> first decode step */
    int attempts;                      /* PREFILL orders sent */
    char prefill_worker[PROTO_ID_LEN]; /* the latest attempt's workers ("" = none yet) */
    char decode_worker[PROTO_ID_LEN];
} cluster_req_timing;

/* One request to run. */
typedef struct {
    const int *tokens; /* (n_tokens,) prompt ids, BOS included; copied */
    int n_tokens;
    int max_tokens;    /* >= 1 */
    float temperature; /* 0 = greedy */
    float top_p;
    int top_k;
    uint64_t rng; /* initial sampler state (sampler_seed_state) */
    int mtp_depth; /* the request's MTP depth + 1 (1..3 = depth 0..2); 0 = the workers' */
    const proto_sampling *samp; /* optional (NULL = none): logit processors, copied; the
                                 * workers decode such a request at MTP depth 0 */
    cluster_req_timing *timing; /* optional (NULL): borrowed until the request ends (its
                                 * on_finish / on_error, or cluster_cancel); zeroed and
                                 * filled by the cluster */
    int offline;                /* 1: offline tier (flex, batch), see the top comment */
    int logprobs;               /* 0, or log-probabilities with k alternatives + 1 (k <=
                                 * PROTO_MAX_TOP_LOGPROBS): every TOKENS must carry them */
    int echo;                   /* with logprobs: the prompt's too (cb->on_prompt_logprobs) */
    const cluster_callbacks *cb; /* optional: this request's callbacks instead of the
                                  * cluster's (borrowed; must outlive the request) */
} cluster_job;

typedef enum {
    CLUSTER_OK = 0,   /* admitted: callbacks will follow */
    CLUSTER_FULL = 1, /* the queue is full: answer 429 */
    CLUSTER_ERR = -1, /* bad job or out of memory */
} cluster_status_t;

/* Bind the ctl socket and start watching it and the worker timers on base. cb is copied.
 * Returns NULL with a message in err (e.g. the endpoint cannot be bound). */
cluster_t *cluster_new(struct event_base *base, const cluster_params *p,
                       const cluster_callbacks *cb, char *err, size_t errlen);

/* Fail every request still known (on_error 503, "shutting down"), close the socket and
 * free. Takes NULL; sets *c to NULL. */
void cluster_destroy(cluster_t **c);

/* Admit a request (see cluster_status_t). On CLUSTER_OK *rid is its id (for cancel and
 * logs); callbacks may come from the next loop iteration on, never from inside this call. */
cluster_status_t cluster_submit(cluster_t *c, const cluster_job *job, void *ud, uint64_t *rid);

/* The owner gives up on a request (client gone): CANCEL goes to its workers and it is
 * forgotten; no callback follows. Unknown rid: no-op. */
void cluster_cancel(cluster_t *c, uint64_t rid);
/* cluster_cancel for the cluster's own callbacks (which may run inside a walk of its
 * lists): no callback of rid follows from now on (its ud and timing are forgotten), and
 * the CANCEL goes out from the event loop right after. Unknown rid: no-op. */
void cluster_cancel_soon(cluster_t *c, uint64_t rid);

/* 1 when at least one prefill and one decode worker, or one mixed worker, are alive and
 * ready; else 0 with the reason in reason (cap bytes). */
int cluster_ready(const cluster_t *c, char *reason, size_t cap);

typedef struct {
    int n_prefill, n_decode, n_mixed; /* alive and ready workers by role */
    int n_draining;                   /* alive, draining */
    int n_queued;                     /* requests waiting for a worker (both tiers) */
    int n_running;                    /* requests assigned to workers (both tiers) */
    int n_offline_queued;             /* offline requests in the offline queue */
    int n_offline_running;            /* offline requests assigned (not promoted ones) */
    int n_promoted;                   /* offline requests promoted by aging, not yet ended */
    int offline_max_running;          /* the policy's last offline admission */
    uint64_t n_preempted;             /* preemptions since start */
    int n_changing;                   /* alive workers changing role (ROLE sent) */
    uint64_t n_role_changes;          /* role changes completed since start */
    uint64_t n_role_orders;           /* ROLE orders sent (policy and operator) */
    double last_role_change_ms;       /* order -> re-registered, the latest one (0 = none) */
    uint64_t n_refused;               /* worker processes refused at registration (another
                                       * model or block size), since start: each (id, pid)
                                       * counts once however often it sends REGISTER */
    int kv_block_size;                /* the block size workers must have (0 = none yet) */
} cluster_stats;

void cluster_get_stats(const cluster_t *c, cluster_stats *st);

/* One registered, alive worker as last reported (heartbeat figures) plus the gateway's own
 * view of what it has assigned to it. Strings are borrowed for the callback's duration. */
typedef struct {
    const char *id;
    int role;                     /* proto_role_t */
    int state;                    /* proto_state_t */
    const char *kv_endpoint;      /* "" for prefill workers */
    int pid;
    int kv_blocks_total, kv_blocks_free;
    int running, queued, queued_prompt_tokens;
    int n_assigned;               /* requests the gateway has assigned to it right now */
    double last_seen_ms_ago;
    int n_ctx, block_size, max_seqs;            /* from REGISTER */
    uint64_t tokens_in, tokens_out;             /* counters since the worker started */
    proto_kvx_counters kvx_tx, kvx_rx;          /* KV transfers sent / received */
    proto_spec_counters spec;                   /* speculative decoding */
    int changing;                 /* 1: a role change is in progress (ROLE sent) */
    int target_role;              /* when changing: proto_role_t it moves to */
    int emulated;                 /* 1: emulated accelerator (--emulate) */
    int mtp_depth;                /* from REGISTER: the MTP depth it serves (0 = none);
                                   * -1 = not reported */
    uint64_t n_role_changes;      /* from its heartbeat: role changes since it started */
    double role_change_ms;        /* from its heartbeat: its last change (0 = none) */
    proto_mig_counters mig;       /* from its heartbeat: live migrations out and in */
    uint64_t prefix_cache_queries; /* from its heartbeat: prompt tokens looked up in its
                                    * prefix cache since it started */
    uint64_t prefix_cache_hits;    /* of those, tokens found cached (not computed) */
    int prefix_blocks_believed;    /* cache-aware routing: its cached blocks as the gateway
                                    * believes them (last summary + prompts routed lately) */
    uint64_t n_preemptions;       /* from its heartbeat: sequences it preempted for KV blocks
                                   * (vLLM's num_preemptions) */
} cluster_worker_info;

/* Call fn for every alive worker, in registration order. */
void cluster_foreach_worker(const cluster_t *c,
                            void (*fn)(const cluster_worker_info *w, void *ud), void *ud);

/* A worker refused at registration (the last CLUSTER_MAX_REFUSED distinct worker ids, the
 * most recent first; an id that registers successfully later leaves the list). Strings
 * are borrowed for the callback's duration. */
#define CLUSTER_MAX_REFUSED 16
typedef struct {
    const char *id;
    int role;               /* proto_role_t, as it registered */
    int pid;                /* the latest refused process */
    const char *reason;     /* e.g. "KV block size 32, the cluster's is 16" */
    uint64_t n_refused;     /* processes with this id refused (distinct pids) */
    double last_ms_ago;     /* since its latest REGISTER */
} cluster_refused_info;

/* Call fn for every refused worker (see cluster_refused_info). */
void cluster_foreach_refused(const cluster_t *c,
                             void (*fn)(const cluster_refused_info *w, void *ud), void *ud);

/* Order worker id to change to role (PROTO_ROLE_PREFILL or PROTO_ROLE_DECODE): ROLE goes
 * to it and routing skips it until it registers again in the new role (it drains first:
 * docs/scheduler.md "Live role changes"). why names who ordered it (logs, events).
 * Returns 0 when ordered; -1 unknown worker; -2 refused with the reason in err (mixed
 * worker, already that role, already changing, not ready, or the last ready worker able
 * to do its current role); -3 bad role. */
int cluster_set_role(cluster_t *c, const char *id, int role, const char *why, char *err,
                     size_t errlen);

/* With tidal on (cluster_params.tidal): fn gives the policy the cluster's recent online
 * TTFT and TPOT p90 (ms; <= 0 = unknown) every tick, at now_us (proto_now_us). fn runs on
 * the loop thread and must not call back into the cluster. NULL: no latency signals. With
 * tidal off the policy gets none (its offline admission then depends on load alone, as
 * before). */
void cluster_set_latency_source(cluster_t *c,
                                void (*fn)(void *ud, int64_t now_us, double *ttft_p90_ms,
                                           double *tpot_p90_ms),
                                void *ud);

/* Seconds a client should wait before retrying after CLUSTER_FULL (>= 1). */
int cluster_retry_after_s(const cluster_t *c);

// --- events (for the stats socket)

typedef enum {
    CLUSTER_EV_WORKER_UP = 1, /* a worker registered */
    CLUSTER_EV_WORKER_DOWN,   /* a worker was removed: BYE, silent, unreachable (reason) */
    CLUSTER_EV_WORKER_ROLE,   /* a worker re-registered with another role (old_role) */
    CLUSTER_EV_WORKER_STATE,  /* a worker went ready <-> draining (state) */
    CLUSTER_EV_REQUEST_RETRY, /* an attempt of request rid failed and it is re-run (reason) */
    CLUSTER_EV_REQUEST_PREEMPT, /* offline request rid was preempted and re-queued (reason) */
    CLUSTER_EV_ROLE_CHANGE,   /* a role change was ordered (reason "ordered by ...", role =
                               * target, old_role) or completed (reason "done in N ms") */
    CLUSTER_EV_WORKER_REFUSED, /* a worker process was refused at registration (reason) */
} cluster_event_type_t;

/* One event; strings are borrowed for the observer's call. */
typedef struct {
    cluster_event_type_t type;
    const char *worker; /* worker id ("" when none) */
    int role;           /* proto_role_t, 0 when none */
    int old_role;       /* WORKER_ROLE: the previous role */
    int state;          /* proto_state_t, 0 when none */
    uint64_t rid;       /* REQUEST_RETRY, REQUEST_PREEMPT */
    const char *reason; /* "" when none */
} cluster_event;

/* Call fn(ev, ud) for every event from now on (fn NULL: none). fn runs on the loop thread
 * inside cluster code: it must not call back into the cluster. */
void cluster_set_observer(cluster_t *c, void (*fn)(const cluster_event *ev, void *ud), void *ud);

#endif
