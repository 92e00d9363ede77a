/*
 * decode_internal: declarations shared by the decode role's files: decode.c (the role: KV
 * receiver and admission, continuous batching with the MTP2 draft-and-verify step, cancel
 * tombstones) and migrate.c (live migration of running sequences to another decode worker,
 * and the orders for sequences whose KV is still arriving). Not a public interface: the
 * runtime sees the role through decode_role_ops (worker/runtime.h).
 */
#ifndef TP_DECODE_INTERNAL_H
#define TP_DECODE_INTERNAL_H

#include <stdint.h>

#include "runtime.h"

typedef enum {
    DREQ_RUNNING = 1, /* decoding; owns kvcache sequence seq */
    DREQ_MIGRATING,   /* decoding paused: its KV is moving to another decode worker
                       * (MIGRATE; kvx owns seq); waiting for the outcome, then it leaves */
} dreq_state_t;

/* One sequence being decoded here. It owns its KV sequence until it leaves or a migration
 * starts (then kvx owns it and frees it after the transfer). */
typedef struct {
    uint64_t rid;
    dreq_state_t state;
    int seq;        /* kvcache sequence (-1 = none; kvx's while migrating) */
    int pos;        /* tokens whose KV is in the cache */
    int first;      /* the first generated token (from the prefill) */
    int last;       /* token to feed next */
    int n_gen;      /* tokens generated so far, first included */
    int n_sent;     /* generated tokens this worker reported (next TOKENS index) */
    int max_tokens; /* generated tokens in total, first included */
    int priority;   /* 0 online, 1 offline (PREFILL / KV_BEGIN "pri"): preempted first */
    int logprobs;   /* 0, or log-probabilities with k alternatives + 1 (KV_BEGIN "lpk"): each
                     * TOKENS carries them; the first token's travelled in the prefill's */
    sampler_params sp;
    uint64_t rng;                 /* sampler state */
    char dep[PROTO_ENDPOINT_LEN]; /* DREQ_MIGRATING: where it is moving */
    uint64_t xfer;                /* DREQ_MIGRATING: kvx transfer id */
    /* timing (proto_now_us of this worker; reported as durations, see runtime_timing) */
    int64_t t_ready_us;  /* ready to decode (KV accepted or local prefill done); 0 once the
                          * first decode step was reported */
    int64_t t_mig_us;    /* DREQ_MIGRATING: MIGRATE received */
    int64_t xfer_us;     /* KV transfer duration on the receiving side (0 = none) */
    int64_t queue_us, prefill_us; /* the prefill's durations, from KV_END (0 = none) */
    uint64_t xfer_bytes; /* KV payload bytes received */
    /* MTP */
    int mtp_req;     /* the request's MTP depth + 1 (0 = not set) */
    int mtp_depth;   /* drafts this sequence may make per step: 0 = no module work */
    float *hand;     /* (2, dim) hand-off state for its first decode step (owned; NULL without
                      * MTP), or, when hand_state, a migrated sequence's whole module state */
    int hand_state;  /* hand is specdec_state_floats() of specdec_seq_export (migrated) */
    specdec_ctl ctl; /* its depth controller (acceptance EWMAs) */
    seqpen_t *pen;   /* sampling controls and its ids so far, r->last included (owned; NULL =
                      * none): such a sequence decodes at depth 0 (docs/mtp.md) */
    /* prefix caching (docs/prefix-cache.md "The decode side"): ids[p] is the token whose KV
     * is at position p, for p < n_ids (== pos while tracked; room for cap_ids = n_ctx);
     * owned, NULL = not cached. When the sequence leaves, its full blocks are registered
     * under pfx_seed / pfx_la (those of generated tokens too when pfx_la is 0); kv_bad
     * (a failed forward pass) registers nothing. */
    int *ids;
    int n_ids, cap_ids;
    uint64_t pfx_seed;
    int pfx_la;
    int kv_bad;
} dreq;

#define DECODE_TOMBSTONES 256 /* cancelled rids remembered (a ring) */
#define DECODE_MIG_PENDING 256 /* MIGRATE orders kept for KV still arriving (a ring): a
                                * change to prefill orders one per request bound here, most
                                * of them re-targeted at their prefill worker instead */

typedef struct {
    runtime_t *rt;
    kvx_receiver_t *receiver; /* the kv ROUTER (bound at --kv-bind) */
    dreq **reqs;              /* every sequence here, in the order they started */
    int n_reqs, cap_reqs;
    /* the step, sized at attach: (max_items,) */
    dreq **batch_reqs;
    specdec_item *items;
    /* Recently cancelled rids this worker did not hold yet (a CANCEL can overtake the KV
     * hand-off): KV that arrives for one is freed at once instead of being decoded. Wire
     * rids are unique per attempt, so a retry is never mistaken for one. */
    uint64_t tombstones[DECODE_TOMBSTONES];
    int next_tombstone;
    /* MIGRATE orders for requests whose KV had not arrived yet: carried out on arrival */
    struct {
        uint64_t rid;
        char dep[PROTO_ENDPOINT_LEN];
        char dpk[PROTO_KEY_LEN]; /* its CURVE public key ("" = none) */
    } mig_pending[DECODE_MIG_PENDING];
    int next_mig_pending;
    int *step_depth; /* (max_items,) the step's MTP depths, before the batch is built */
} decode_role;

// --- decode.c
/* The sequence of request rid here (borrowed), or NULL. */
dreq *decode_req_find(const decode_role *d, uint64_t rid);
/* Remove r from the table and free it with whatever it owns (the one place a sequence's
 * memory is freed). A migration in progress is aborted (kvx then frees its sequence). */
void decode_req_remove(decode_role *d, dreq *r);

// --- migrate.c (docs/scheduler.md "Live role changes")
/* MIGRATE (decode worker): move running request m->rid, with its KV and its progress, to
 * the decode worker at m->decode_endpoint over kvtransfer; an order for a request whose KV
 * has not arrived yet is kept and carried out when it does. A move that cannot start
 * leaves the request decoding here; one that fails after it started is reported as a
 * retryable ERROR (the gateway re-runs it from its tokens so far). */
void decode_on_migrate(decode_role *d, const proto_msg *m);
/* A sequence that just started here (KV accepted): carry out a MIGRATE order kept for it. */
void decode_migrate_pending(decode_role *d, uint64_t rid);
/* A KV sender event: the outcome of one of this role's migrations. Returns 1 if it was
 * one, 0 otherwise. */
int decode_on_send_event(void *st, const kvx_event *ev);

#endif
