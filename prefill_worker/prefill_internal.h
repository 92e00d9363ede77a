/*
 * prefill_internal: declarations shared by the prefill role's files: prefill.c (the role:
 * its requests, PREFILL orders, cancel, transfer outcomes, handing prompts back) and
 * prefill_batch.c (the batch step: chunked prefill, the MTP module pass, the KV sender
 * fed layer by layer, the first token). Not a public interface: the runtime sees the role
 * through prefill_role_ops (worker/runtime.h).
 */
#ifndef TP_PREFILL_INTERNAL_H
#define TP_PREFILL_INTERNAL_H

#include <stdint.h>

#include "runtime.h"

#define PREFILL_MAX_QUEUE 4096 /* PREFILL orders waiting; more are refused (retryable) */

typedef enum {
    PREQ_QUEUED = 1, /* PREFILL received, waiting for a batch; owns only its prompt */
    PREQ_PREFILLING, /* admitted (sequence reserved, KV_BEGIN sent); its prompt is computed
                      * one chunk per loop iteration, n_done tokens so far */
    PREQ_SENDING,    /* prefill done, KV in the hands of kvx; waiting for the outcome */
} preq_state_t;

/* One prompt. Memory: the prompt is owned until the prefill ran; the KV sequence from
 * admission until it leaves, unless a transfer started (xfer != 0): then kvx owns it and
 * frees it after the transfer, and the request only names it for the forward pass that
 * fills it. A prompt decoded here leaves with its sequence for the decode role
 * (runtime_handoff_local). */
/* An echo prompt's chunk at most (tokens): its logits are kept for every position, one
 * such prompt per batch, and a chunk's prompt log-probabilities are one TOKENS message. */
#define PREFILL_ECHO_CHUNK 64

typedef struct {
    uint64_t rid;
    preq_state_t state;
    int *prompt; /* (n_prompt,) token ids; NULL after the prefill */
    int n_prompt;
    int n_done;     /* PREQ_PREFILLING: prompt tokens whose KV is computed */
    int n_chunk;    /* prompt tokens in the batch being computed */
    int blk_sent;   /* transfer: blocks of every layer handed to kvx so far */
    int blk_upto;   /* transfer: blocks of every layer complete after the batch being computed */
    int max_tokens; /* generated tokens in total, first included */
    sampler_params sp;
    uint64_t rng;                 /* sampler state */
    char dep[PROTO_ENDPOINT_LEN]; /* decode endpoint; "" = decode here */
    char dpk[PROTO_KEY_LEN];      /* its CURVE public key (PREFILL "dpk"; "" = none) */
    uint64_t xfer;                /* kvx transfer id once KV_BEGIN went out, else 0 */
    int seq;                      /* kvcache sequence (-1 = none); lent to kvx when xfer != 0 */
    int64_t t_recv_us;            /* PREFILL received (proto_now_us) */
    int64_t t_order_us;           /* its place in the queue: admitted at the gateway (PREFILL
                                   * received less its age_us) */
    int64_t t_start_us;           /* its first prefill chunk started */
    int mtp_req;                  /* the request's MTP depth + 1 (0 = not set) */
    int mtp_depth;                /* drafts it may make per step: 0 = no module work */
    int priority;                 /* PREFILL "pri": 0 online, 1 offline (KV_BEGIN "pri") */
    int logprobs;                 /* PREFILL "lpk": 0, or k alternatives + 1 (KV_BEGIN "lpk") */
    int echo;                     /* PREFILL "echo" (with logprobs): report the log-probabilities
                                   * of prompt tokens 1.. too (every position's logits; no
                                   * prefix cache; chunks of PREFILL_ECHO_CHUNK) */
    float *hand; /* (2, dim) MTP hand-off state, filled by the module pass (owned; NULL when
                  * mtp_depth is 0) */
    seqpen_t *pen; /* PREFILL "samp": its sampling controls and ids (owned; NULL = none) */
} preq;

typedef struct {
    runtime_t *rt;
    preq **reqs; /* every prompt here, in arrival order (FIFO) */
    int n_reqs, cap_reqs;
    /* the last batch could not admit the queue's head: no admission is tried again until
     * a prompt leaves or the KV cache's free blocks change (blocked_free = the count then) */
    int blocked, blocked_free;
    /* the batch, sized at attach: (max_items,) items, (max_items, vocab) logits */
    model_seq_batch *batch;
    preq **batch_reqs;
    float *logits;
    float *lp_raw; /* (vocab,) a prompt's raw last logits, for its first token's logprobs */
    float *echo_logits;      /* (PREFILL_ECHO_CHUNK, vocab): an echo prompt's chunk, all rows */
    proto_logprob *echo_lps; /* (PREFILL_ECHO_CHUNK,) their log-probabilities, for TOKENS */
    int n_batch;
    /* MTP: (max_tokens, dim) hidden states h_0 of the batch's prompts, module pass items */
    float *hid;
    specdec_prefill_item *pitems;
    /* --prefix-cache: the summary of the cache every HEARTBEAT carries ("pfx", cache-aware
     * routing), rebuilt by load from (PROTO_PFX_MAX_HASHES,) scratch arrays */
    proto_prefix_summary *pfx;
    uint64_t *pfx_hash, *pfx_seed;
    int *pfx_la;
} prefill_role;

/* The prefix cache's chain seed of prompts run at MTP depth `depth` here (0 = no module
 * layers written): kvcache_prefix_seed(model fingerprint, salt), the salt the modules'
 * fingerprint + depth when depth > 0. The gateway learns it from the summary. */
uint64_t prefill_prefix_seed(const worker_compute *cp, int depth);

/* Remove r from the table and free it with whatever it owns (the one place a prompt's
 * memory is freed). A transfer in progress is aborted (kvx then frees its sequence). */
void prefill_req_remove(prefill_role *p, preq *r);
/* Whether admission waits (see blocked). */
int prefill_blocked(const prefill_role *p);

/* Run one prefill batch: the next chunk of every prompt being computed, and queued prompts
 * admitted while they fit (max_batch_tokens, KV blocks, sequence slots). Returns 1 if it
 * did work. (prefill_batch.c) */
int prefill_step(void *st);

#endif
