/*
 * worker_internal: declarations shared by worker.c (runtime: settings, sockets, loop,
 * registration, heartbeats, signals) and worker_sched.c (requests: queue, prefill batches,
 * decode steps, transfers, cancel). Not a public interface.
 */
#ifndef TP_WORKER_INTERNAL_H
#define TP_WORKER_INTERNAL_H

#include <stdint.h>

#include "costmodel.h"
#include "kvcache.h"
#include "kvtransfer.h"
#include "model.h"
#include "protocol.h"
#include "wire.h"
#include "mtp.h"
#include "sampler.h"
#include "specdec.h"

#define WORKER_MAX_QUEUE 4096 /* PREFILL orders waiting; more are refused (retryable) */

typedef enum {
    WREQ_QUEUED = 1, /* PREFILL received, waiting for a batch; owns only its prompt */
    WREQ_PREFILLING, /* admitted (sequence reserved, KV_BEGIN sent); its prompt is computed
                      * one chunk per loop iteration, n_done tokens so far */
    WREQ_SENDING,    /* prefill done, KV in the hands of kvx; waiting for KV_RESULT */
    WREQ_RUNNING,    /* decoding; owns kvcache sequence seq */
    WREQ_MIGRATING,  /* decoding paused: its KV is moving to another decode worker (MIGRATE;
                      * kvx owns seq); waiting for KV_RESULT, then it leaves */
} wreq_state_t;

/* One request known to this worker. Memory: the prompt is owned until the prefill ran.
 * The KV sequence is the request's from admission to a batch (freed when the request
 * leaves) unless a transfer started (xfer != 0): then kvx owns it and frees it after the
 * transfer, and the request only names it for the forward pass that fills it. */
typedef struct {
    uint64_t rid;
    wreq_state_t state;
    int *prompt; /* (n_prompt,) token ids; NULL after the prefill */
    int n_prompt;
    int n_done;   /* WREQ_PREFILLING: prompt tokens whose KV is computed */
    int n_chunk;  /* prompt tokens in the batch being computed */
    int blk_sent; /* transfer: blocks of every layer handed to kvx so far */
    int blk_upto; /* transfer: blocks of every layer complete after the batch being computed */
    int max_tokens; /* generated tokens in total, first included */
    sampler_params sp;
    uint64_t rng;                 /* sampler state */
    char dep[PROTO_ENDPOINT_LEN]; /* decode endpoint; "" = decode here */
    uint64_t xfer;                /* kvx transfer id once KV_BEGIN went out, else 0 */
    int seq;                      /* kvcache sequence (-1 = none); lent to kvx when xfer != 0 */
    int pos;                      /* WREQ_RUNNING: tokens whose KV is in the cache */
    int first;                    /* first generated token (from the prefill) */
    int last;                     /* WREQ_RUNNING: token to feed next */
    int n_gen;                    /* tokens generated so far, first included */
    int n_sent;                   /* generated tokens this worker reported (TOKENS index) */
    /* timing (proto_now_us of this worker; reported as durations, see worker_timing) */
    int64_t t_recv_us;   /* PREFILL received */
    int64_t t_start_us;  /* its first prefill chunk started */
    int64_t t_ready_us;  /* ready to decode (KV accepted or local prefill done); 0 once the
                          * first decode step was reported */
    int64_t t_mig_us;    /* WREQ_MIGRATING: MIGRATE received */
    int64_t xfer_us;     /* KV transfer duration on the receiving side (0 = none) */
    uint64_t xfer_bytes; /* KV payload bytes received */
    /* MTP (worker_mtp.c) */
    int mtp_req;   /* the request's MTP depth + 1 (PREFILL / KV_BEGIN "mtp"); 0 = not set */
    int mtp_depth; /* drafts this sequence may make per step: 0 = no module work */
    float *hand;   /* (2, dim) hand-off state for its first decode step (owned; NULL when
                    * mtp_depth is 0): filled by its prefill or taken from KV_END; or, when
                    * hand_state, a migrated sequence's whole module state */
    int hand_state; /* hand is specdec_state_floats() of specdec_seq_export (migrated) */
    specdec_ctl ctl; /* decoding: its depth controller (acceptance EWMAs) */
} wreq;

/* Durations a worker reports with a request's TOKENS or FINISH (proto_msg queue_us,
 * prefill_us, xfer_us, xfer_bytes, step_us; 0 = not reported), in microseconds of this
 * worker's clock. */
typedef struct {
    int64_t queue_us, prefill_us, xfer_us, step_us;
    uint64_t xfer_bytes;
} worker_timing;

typedef struct {
    /* settings (config table) */
    char *gateway, *model_path, *worker_id, *role_name, *kv_bind, *kv_advertise, *log_level;
    long long kv_blocks, block_size, max_seqs, max_batch_tokens, heartbeat_ms, lease_ms;
    long long debug_step_delay_ms;
    long long prefill_chunk_tokens; /* prompt tokens per sequence per forward pass */
    long long threads;              /* compute threads (0 = CPUs available) */
    char *emulate;                  /* --emulate: cost-model preset ("" = real compute) */
    int emu_on;                     /* emulated-accelerator mode (worker_emu.c) */
    costmodel emu;                  /* its preset */

    proto_role_t role;
    char wid[PROTO_ID_LEN];
    char kv_endpoint[PROTO_ENDPOINT_LEN]; /* advertised in REGISTER ("" for prefill) */

    void *zctx;
    void *ctl; /* DEALER to the gateway, routing id = wid */
    int sigfd;
    wire_envelope *env;

    model_t *model;
    const model_config *mc;
    model_ctx_t *mctx;
    kvcache_t *kv;
    sampler_t *sampler;
    int max_items;          /* sequences per forward pass (= max_seqs) */
    float *logits;          /* (max_items, vocab_size) */
    model_seq_batch *batch; /* (max_items,) */
    wreq **batch_reqs;      /* (max_items,) request of each batch item */
    int n_batch;

    kvx_sender_t *sender;     /* prefill, mixed */
    kvx_receiver_t *receiver; /* decode, mixed */

    wreq **reqs; /* every live request, in arrival order */
    int n_reqs, cap_reqs;
    int prefill_blocked; /* the last prefill attempt could not admit anything */
    /* Recently cancelled rids this worker did not hold yet (a CANCEL can overtake the KV
     * hand-off): KV that arrives for one is freed at once instead of being decoded. Wire
     * rids are unique per attempt, so a retry is never mistaken for one. A ring. */
#define WORKER_TOMBSTONES 256
    uint64_t tombstones[WORKER_TOMBSTONES];
    int next_tombstone;

    int registered;

    int64_t unacked_since_us; /* first REGISTER not acknowledged yet (0 = none) */
    int hb_ms;
    int64_t next_hb_us;
    int draining;
    /* live role change (ROLE from the gateway; worker.c): the role being moved to (0 =
     * none), when the order came, and the figures reported in HEARTBEAT */
    proto_role_t role_target;
    int64_t role_order_us;
    int64_t role_change_us; /* the last change's duration: ROLE received -> switched */
    uint64_t n_role_changes;
    uint64_t tokens_in, tokens_out;
    /* live migration (MIGRATE; worker_sched.c): counters for HEARTBEAT "mig", and the
     * MIGRATE orders for requests whose KV had not arrived yet (a ring: the order is
     * carried out when the KV is accepted) */
    proto_mig_counters mig;
#define WORKER_MIG_PENDING 64
    struct {
        uint64_t rid;
        char dep[PROTO_ENDPOINT_LEN];
    } mig_pending[WORKER_MIG_PENDING];
    int next_mig_pending;
    proto_spec_counters spec; /* speculative decoding (HEARTBEAT "spec"); zeros without MTP */

    /* MTP (worker_mtp.c): settings, the modules, the draft-and-verify state, the depth
     * controller, and scratch for the prefill's hidden states */
    char *mtp_setting;         /* --mtp: "auto" | "none" | a side file */
    long long mtp_depth_set;   /* --mtp-depth: -1 = 2 when modules are loaded */
    int mtp_adaptive;          /* --mtp-adaptive: lower the depth when it does not pay */
    char *mtp_sampling;        /* --mtp-sampling: rejection | onehot */
    mtp_t *mtp;                /* NULL: no modules */
    int n_mtp;                 /* modules loaded (their KV layers follow the main ones) */
    int mtp_depth;             /* the worker's depth (cap and default per request) */
    specdec_t *sd;             /* always (plain decoding is its depth-0 path) */
    specdec_costs sd_costs;    /* step cost by depth and batch size (decode/mixed) */
    float sd_prior[2];         /* acceptance each sequence's controller starts from */
    specdec_item *sd_items;    /* (max_items,) */
    specdec_prefill_item *sd_pitems; /* (max_items,) */
    float *hid;                /* (max_tokens, dim): prefill hidden states (h_0) */
} worker_t;

// --- worker.c: messages to the gateway (each logs and drops on failure)
/* TOKENS: generated tokens [index, index + n) of request rid (borrowed), the sampler state
 * rng after the last of them (so that a re-run elsewhere continues the same random stream),
 * and the request's durations t (NULL: none). */
void worker_send_tokens_timed(worker_t *w, uint64_t rid, int index, const int *tokens, int n,
                              uint64_t rng, const worker_timing *t);
void worker_send_finish(worker_t *w, uint64_t rid, int reason);
/* FINISH carrying the request's durations t (NULL: none). */
void worker_send_finish_timed(worker_t *w, uint64_t rid, int reason, const worker_timing *t);
void worker_send_error(worker_t *w, uint64_t rid, int code, int retry, const char *msg);

/* Create the KV sender if there is none (a decode worker creates it to migrate sequences).
 * Returns 0, or -1 (logged). */
int worker_open_sender(worker_t *w);

// --- worker_mtp.c
/* Find and load the MTP modules per --mtp (before the KV cache exists: it gets w->n_mtp
 * extra layers). Returns 0 (w->mtp may stay NULL: none), or -1 after logging a bad file. */
int wmtp_load(worker_t *w);
/* With the model context ready: the draft-and-verify state, the controller, and (decode
 * and mixed workers with modules) the verify-cost measurement. Returns 0 or -1. */
int wmtp_setup(worker_t *w);
void wmtp_teardown(worker_t *w);
/* The depth a request gets: the worker's, lowered by the request's (mtp_req = depth + 1,
 * 0 = not set); 0 without modules. */
int wmtp_req_depth(const worker_t *w, int mtp_req);
/* After the prefill forward pass over the batch (batch_reqs/batch[0..m)): run the modules
 * over the chunks of the requests with MTP and hand kvx their module-layer blocks. Returns
 * 0, or -1 when a module pass failed. */
int wmtp_prefill(worker_t *w, int m);

// --- worker_emu.c: emulated-accelerator mode (--emulate)
/* Check --emulate and load its preset (logs the mode). Returns 0, or -1 on an unknown
 * preset (logged with the known ones). */
int wemu_setup(worker_t *w);
/* After the prefill batch batch[0..m) that started at t0_us: sleep until the cost model's
 * prefill time has passed (no-op unless emulated). */
void wemu_pad_prefill(worker_t *w, int m, int64_t t0_us);
/* After the decode step over sd_items[0..n) that started at t0_us: the same. */
void wemu_pad_decode(worker_t *w, int n, int64_t t0_us);
/* The KV bytes per token of the emulated model (costmodel_kv_bytes_per_token), to which
 * the KV sender pads every transfer (kvx_sender_params.pad_to_bytes_per_token); 0 when
 * not emulated (no padding). */
uint64_t wemu_kv_bytes_per_token(const worker_t *w);

// --- worker_sched.c
/* Handle a PREFILL order (validated by the decoder; checked against the model here). */
void sched_on_prefill(worker_t *w, proto_msg *m);
/* Handle MIGRATE (decode worker): move running request m->rid, with its KV and its
 * progress, to the decode worker at m->decode_endpoint over kvtransfer; an order for a
 * request whose KV has not arrived yet is kept and carried out when it does. A move that
 * cannot start leaves the request decoding here; one that fails after it started is
 * reported as a retryable ERROR (the gateway re-runs it from its tokens so far). */
void sched_on_migrate(worker_t *w, const proto_msg *m);
/* A prefill worker changing role: give back every prompt not started yet (retryable ERROR
 * UNAVAILABLE: the gateway re-routes it at once, not counted as a failure) so that only
 * the batch being computed delays the change. Returns how many were given back. */
int sched_hand_back_queued(worker_t *w);
/* Handle CANCEL: drop rid wherever it is; unknown ids are ignored. */
void sched_on_cancel(worker_t *w, uint64_t rid);
/* Drain kvx events (sender and receiver). */
void sched_on_kvx_events(worker_t *w);
/* Run one prefill batch: the next chunk of every prompt being computed, and queued
 * prompts admitted while they fit (max_batch_tokens, KV blocks, sequence slots). Returns
 * 1 if it did work. */
int sched_prefill_step(worker_t *w);
/* Run one decode step over every running sequence. Returns 1 if it did work. */
int sched_decode_step(worker_t *w);
/* Whether a step would do work now (poll timeout 0). */
int sched_has_work(const worker_t *w);
/* Load figures for HEARTBEAT. */
void sched_load(const worker_t *w, int *running, int *queued, int *queued_tokens);
/* No request, transfer or pinned sequence left (drain complete). */
int sched_idle(const worker_t *w);
/* Free every request and its KV (shutdown). */
void sched_free_all(worker_t *w);

#endif
