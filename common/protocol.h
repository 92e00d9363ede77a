/*
 * protocol: every message exchanged between tidepool processes, defined once.
 *
 * A message is a ZeroMQ multipart message: [identity (ROUTER side only)] [header] [payload
 * frames...]. The header is a msgpack map with short string keys; "t" is the message type
 * and "v" the protocol version (PROTO_VERSION). Payload frames are raw bytes (KV blocks),
 * sent without copies.
 *
 * To keep the wire format in one place, all message types share one flat C struct
 * (proto_msg); a field table says which keys each type requires and which it may carry.
 * The decoder checks types, ranges and lengths of every field and rejects anything else: a
 * malformed or truncated message is rejected by proto_decode (and logged and dropped by
 * wire_recv, transport/wire.h), never trusted.
 * Unknown keys are ignored (forward compatibility within a version).
 *
 * Sockets (see DESIGN.md):
 *   ctl: gateway ROUTER <-> worker DEALER: REGISTER, REGISTER_ACK, HEARTBEAT, PREFILL, CANCEL,
 *        TOKENS, FINISH, ERROR, BYE, ROLE, MIGRATE, BUNDLE (TOKENS and FINISH).
 *   kv:  decode worker ROUTER <-> prefill worker DEALER: KV_BEGIN, KV_BEGIN_ACK, KV_LAYER,
 *        KV_END, KV_RESULT, KV_ABORT (state machine in docs/kvtransfer.md).
 */
#ifndef TP_PROTOCOL_H
#define TP_PROTOCOL_H

#include <stddef.h>
#include <stdint.h>

#define PROTO_VERSION 1
#define PROTO_MAX_TOKENS 65536     /* token ids in one message */
#define PROTO_MAX_FRAMES 4096      /* payload frames in one message */
#define PROTO_BUNDLE_MAX 256       /* messages in one BUNDLE (at most PROTO_MAX_FRAMES) */
#define PROTO_MAX_HEADER 1048576   /* bytes of one msgpack header */
#define PROTO_ID_LEN 64            /* worker ids, NUL included */
#define PROTO_ENDPOINT_LEN 256     /* ZeroMQ endpoints, NUL included */
#define PROTO_MESSAGE_LEN 256      /* error text, NUL included */
#define PROTO_MAX_PAD (1ll << 48)  /* KV_BEGIN "pad": padding bytes of one transfer */
#define PROTO_MAX_BIAS 1024        /* "samp": logit_bias entries */
#define PROTO_MAX_STOP_IDS 64      /* "samp": stop_token_ids */
#define PROTO_KEY_LEN 41           /* a CURVE public key in Z85 text (40), NUL included */
#define PROTO_MAX_BLOCK_HASHES 1024 /* KV_BEGIN "bh": prompt blocks listed at most */
#define PROTO_MAX_LOOKAHEAD 4       /* KV_BEGIN "bla" (KVCACHE_MAX_LOOKAHEAD) */
#define PROTO_MAX_TOP_LOGPROBS 20  /* "lpk" / "lp": alternatives per token (OpenAI's limit) */
#define PROTO_PFX_MAX_GROUPS 8     /* "pfx": chain seeds in one prefix summary */
#define PROTO_PFX_MAX_HASHES 4096  /* "pfx": block hashes in one prefix summary, all groups */
#define PROTO_PFX_MAX_LOOKAHEAD 4  /* "pfx": key tokens past a block's end (the KV cache's) */

typedef enum {
    PROTO_REGISTER = 1,  /* worker -> gateway: I exist (id, role, capacity, kv endpoint) */
    PROTO_REGISTER_ACK,  /* gateway -> worker: registered; heartbeat_ms to use. With code
                          * != 0 (PROTO_ERR_LAYOUT) and msg: refused (another model or KV
                          * block size than the cluster's); the worker must not retry */
    PROTO_HEARTBEAT,     /* worker -> gateway: load figures */
    PROTO_PREFILL,       /* gateway -> prefill/mixed worker: run this request */
    PROTO_CANCEL,        /* gateway -> worker: drop request rid wherever it is */
    PROTO_TOKENS,        /* worker -> gateway: generated tokens [index, index + n) */
    PROTO_FINISH,        /* worker -> gateway: request ended (reason) */
    PROTO_ERROR,         /* worker -> gateway: request failed (code, message, retryable) */
    PROTO_BYE,           /* worker -> gateway: leaving after draining */
    PROTO_ROLE,          /* gateway -> worker: change to role (drain, switch, REGISTER again) */
    PROTO_MIGRATE,       /* gateway -> decode worker: move running request rid to decode
                          * worker dw at dep over the kv socket (live migration) */
    PROTO_BUNDLE,        /* worker -> gateway: several TOKENS / FINISH messages of one loop
                          * iteration in one ZeroMQ message, each a whole header as a payload
                          * frame, in order (PROTO_BUNDLE_MAX); no field of its own. Cuts
                          * the per-message cost of continuous batching (docs/protocol.md) */
    PROTO_KV_BEGIN = 32, /* prefill -> decode: reserve KV for a request */
    PROTO_KV_BEGIN_ACK,  /* decode -> prefill: ok, or rejected (code, message) */
    PROTO_KV_LAYER,      /* prefill -> decode: one layer's KV blocks as payload frames */
    PROTO_KV_END,        /* prefill -> decode: first token, checksum, sampler state */
    PROTO_KV_RESULT,     /* decode -> prefill: accepted (ok = 1) or NACK (code, message) */
    PROTO_KV_ABORT,      /* either way: abandon transfer xfer (idempotent) */
    PROTO_TYPE_END
} proto_type_t;

typedef enum {
    PROTO_ROLE_PREFILL = 1,
    PROTO_ROLE_DECODE = 2,
    PROTO_ROLE_MIXED = 3,
} proto_role_t;

typedef enum {
    PROTO_STATE_READY = 1,
    PROTO_STATE_DRAINING = 2,
    PROTO_STATE_CHANGING = 3, /* draining for a role change (ROLE); registers again after */
} proto_state_t;

typedef enum {
    PROTO_FINISH_STOP = 1,   /* EOS */
    PROTO_FINISH_LENGTH = 2, /* max_tokens or context end */
} proto_finish_t;

/* Error / reject codes (ERROR, KV_BEGIN_ACK, KV_RESULT, KV_ABORT, REGISTER_ACK). */
typedef enum {
    PROTO_ERR_NONE = 0,
    PROTO_ERR_NOSPACE = 1,     /* no KV blocks / sequence slots free now (retryable) */
    PROTO_ERR_LAYOUT = 2,      /* KV layout or model fingerprint mismatch */
    PROTO_ERR_CHECKSUM = 3,    /* KV payload checksum mismatch */
    PROTO_ERR_TIMEOUT = 4,     /* lease expired */
    PROTO_ERR_PROTOCOL = 5,    /* out-of-order or malformed message */
    PROTO_ERR_CANCELLED = 6,   /* cancelled by the gateway */
    PROTO_ERR_INTERNAL = 7,
    PROTO_ERR_BAD_REQUEST = 8, /* request invalid for this worker (too long, bad token) */
    PROTO_ERR_UNAVAILABLE = 9, /* peer unreachable, draining, or shutting down (retryable) */
    PROTO_ERR_PREEMPTED = 10,  /* ERROR: the decode worker ran out of KV blocks mid-generation
                                * and freed this sequence (retryable: the gateway re-runs it
                                * from prompt + tokens so far, not counted as a failure) */
} proto_err_t;

typedef enum { PROTO_DTYPE_F32 = 0, PROTO_DTYPE_F16 = 1 } proto_dtype_t;

/* KV-transfer counters of one side of a worker since it started: HEARTBEAT "kvx_tx" (the
 * sending side) and "kvx_rx" (the receiving side). On the wire: an array of unsigned
 * integers in member order (a longer array from a newer peer is read up to what is known).
 * Durations are measured on the reporting worker's own monotonic clock. */
typedef struct {
    uint64_t n_ok;       /* transfers completed (the receiver accepted the KV) */
    uint64_t n_bytes;    /* KV payload bytes of the completed transfers */
    uint64_t total_us;   /* sum of their durations (begin -> accepted), microseconds */
    uint64_t n_rejected; /* KV_BEGIN refused (no space, layout mismatch, not accepting) */
    uint64_t n_timeouts;  /* lease expired */
    uint64_t n_aborted;   /* any other failure: abort by the peer, NACK, connection reset */
    uint64_t n_cancelled; /* abandoned on purpose: gateway CANCEL, superseded, sender's abort */
} proto_kvx_counters;

#define PROTO_SPEC_MAX_POS 2 /* draft positions counted (MTP depth) */

/* Speculative-decoding counters of a decode worker since it started (HEARTBEAT "spec";
 * the same wire form as proto_kvx_counters). vLLM's definitions: a draft is one
 * draft-and-verify step of one sequence; mean acceptance length = 1 + accepted / drafts. */
typedef struct {
    uint64_t n_drafts;                             /* draft-and-verify steps */
    uint64_t n_draft_tokens;                       /* tokens drafted */
    uint64_t n_accepted_tokens;                    /* drafted tokens accepted */
    uint64_t accepted_per_pos[PROTO_SPEC_MAX_POS]; /* accepted at draft position i */
} proto_spec_counters;

/* Live-migration counters of a decode worker since it started (HEARTBEAT "mig"; the same
 * wire form as proto_kvx_counters): running sequences moved out to another decode worker
 * (docs/scheduler.md "Live role changes"), the time they took, and those moved in. */
typedef struct {
    uint64_t n_out;        /* sequences moved out (the receiver accepted them) */
    uint64_t n_out_failed; /* moves that failed (the request is re-run by the gateway) */
    uint64_t out_us;       /* sum of the successful moves' durations (MIGRATE -> accepted) */
    uint64_t n_in;         /* sequences moved in from another decode worker */
} proto_mig_counters;

/* A request's logit processors (PREFILL and KV_BEGIN "samp", optional; docs/protocol.md
 * "Sampling controls"): sent only when one is set. The sampler's definitions are
 * sampler.h's sampler_penalties. On the wire an array [presence, frequency, repetition,
 * min_tokens, n_gen, [bias ids], [biases], [stop ids], flags]: flags (bit 0 ignore_eos)
 * only when not 0, so an array of 8 is the same request without them. */
typedef struct {
    float presence, frequency; /* [-2, 2]; 0 = off */
    float repetition;          /* (0, 2]; 1 = off (0 on the wire is read as 1) */
    int min_tokens;            /* generated tokens before EOS / stop ids may come */
    int n_gen;                 /* PREFILL: of "tokens", the last n_gen were generated by the
                                * request's earlier attempts (a retry); KV_BEGIN: of its
                                * "tokens" (the sequence so far, KV_END's token not yet
                                * included), the generated ones */
    int n_bias;                /* [0, PROTO_MAX_BIAS] */
    int bias_ids[PROTO_MAX_BIAS];
    float bias[PROTO_MAX_BIAS]; /* [-100, 100] */
    int n_stop;                 /* [0, PROTO_MAX_STOP_IDS] */
    int stop_ids[PROTO_MAX_STOP_IDS];
    int ignore_eos;             /* 0 or 1: EOS never sampled (vLLM's ignore_eos) */
} proto_sampling;

/* One generated token's log-probabilities (TOKENS "lp", optional; docs/protocol.md
 * "Log-probabilities"): log-softmax of the model's raw logits (before any sampling
 * transform) at the position that produced it: the token's own, and the n_top most likely
 * tokens, most likely first (ties: the lower id first). On the wire an array
 * [logprob, [top ids], [top logprobs]]. */
typedef struct {
    float logprob;
    int n_top; /* [0, PROTO_MAX_TOP_LOGPROBS] */
    int top_ids[PROTO_MAX_TOP_LOGPROBS];
    float top_logprobs[PROTO_MAX_TOP_LOGPROBS];
} proto_logprob;

/* What a prefill (or mixed) worker's prefix cache holds (HEARTBEAT "pfx", optional;
 * docs/protocol.md, docs/prefix-cache.md "Cache-aware routing"): its cached blocks' chained
 * hashes (common/prefixhash.h) grouped by chain seed. Group g covers hashes[off, off + n)
 * with off the sum of the earlier groups' n; a group may be empty (the seed is still
 * worth knowing: the gateway hashes prompts with it). Bounded: a worker with more cached
 * blocks reports the PROTO_PFX_MAX_HASHES it is least likely to evict. Each heartbeat's
 * summary replaces the last. On the wire an array of [seed, lookahead, [hashes]]; the
 * lookaheads are distinct. */
typedef struct {
    int n_groups; /* [0, PROTO_PFX_MAX_GROUPS] */
    struct {
        uint64_t seed;
        int lookahead; /* [0, PROTO_PFX_MAX_LOOKAHEAD]: the MTP depth the blocks were keyed for */
        int n;         /* hashes of this group */
    } group[PROTO_PFX_MAX_GROUPS];
    int n_hashes; /* sum of the groups' n, [0, PROTO_PFX_MAX_HASHES] */
    uint64_t hashes[PROTO_PFX_MAX_HASHES];
} proto_prefix_summary;

/* One message. Which fields are meaningful depends on type; see the table in protocol.c
 * (and docs/protocol.md). tokens is owned by the struct after proto_decode/wire_recv
 * (free with proto_msg_clear); for sending it is borrowed. */
typedef struct {
    proto_type_t type;
    uint64_t rid;                        /* request id (gateway-assigned, != 0) */

    /* worker identity and capacity (REGISTER, HEARTBEAT) */
    char worker_id[PROTO_ID_LEN];
    int role;                            /* proto_role_t */
    int state;                           /* proto_state_t */
    char kv_endpoint[PROTO_ENDPOINT_LEN];/* decode/mixed: where its kv ROUTER listens */
    char kv_pubkey[PROTO_KEY_LEN];       /* REGISTER, optional: the CURVE public key of its
                                          * kv ROUTER (Z85; "" = not CURVE) */
    uint64_t fingerprint;                /* model fingerprint */
    int pid;
    int n_ctx;                           /* tokens */
    int block_size;                      /* tokens per KV block */
    int max_seqs;
    int kv_blocks_total, kv_blocks_free;
    int running, queued, queued_prompt_tokens;
    uint64_t tokens_in, tokens_out;      /* counters since start */
    proto_kvx_counters kvx_tx, kvx_rx;   /* HEARTBEAT, optional: KV transfers sent / received */
    proto_spec_counters spec;            /* HEARTBEAT, optional: speculative decoding */
    int heartbeat_ms;                    /* REGISTER_ACK (code, message: a refusal) */
    int emulated;                        /* REGISTER, HEARTBEAT, optional: 1 = emulated
                                          * accelerator (--emulate): compute is a sleep */
    int64_t role_change_us;              /* HEARTBEAT, optional: the last role change's
                                          * duration (ROLE received -> switched), us */
    uint64_t n_role_changes;             /* HEARTBEAT, optional: role changes since start */
    proto_mig_counters mig;              /* HEARTBEAT, optional: live migrations */
    uint64_t prefix_queries;             /* HEARTBEAT, optional: prompt tokens looked up in the
                                          * prefix cache since start */
    uint64_t prefix_hits;                /* HEARTBEAT, optional: of those, tokens found cached */
    uint64_t n_preemptions;              /* HEARTBEAT, optional: sequences this worker
                                          * preempted since start (ERROR PREEMPTED) */
    proto_prefix_summary *pfx;           /* HEARTBEAT, optional: the prefix cache's blocks
                                          * (NULL = not reported); owned like tokens */

    /* request (PREFILL, TOKENS, KV_BEGIN) */
    int *tokens;                         /* PREFILL: prompt ids; TOKENS: generated ids;
                                          * KV_BEGIN, optional (with samp): the sequence's
                                          * ids so far, prompt then generated */
    int n_tokens;
    int index;                           /* TOKENS: index of tokens[0] among generated */
    int max_tokens;                      /* tokens to generate in total (>= 1) */
    float temperature, top_p;
    int top_k;
    uint64_t rng;                        /* sampler state (sampler.h) */
    proto_sampling *samp;                /* PREFILL, KV_BEGIN, optional: logit processors
                                          * (NULL = none); owned like tokens */
    int logprobs;                        /* PREFILL, KV_BEGIN, optional ("lpk"): 0 = no
                                          * log-probabilities; k + 1 = each TOKENS carries
                                          * them with k alternatives (k <= 20) */
    proto_logprob *lps;                  /* TOKENS, optional ("lp"): (n_tokens,) one per
                                          * token, or NULL; owned like tokens */
    int echo;                            /* PREFILL, optional: 1 = also report the prompt's
                                          * own log-probabilities (needs logprobs); TOKENS,
                                          * optional: 1 = tokens are prompt tokens [index,
                                          * index + n) with their "lp" (echo), not generated */
    char decode_worker[PROTO_ID_LEN];    /* PREFILL: chosen decode worker ("" = local) */
    int64_t age_us;                      /* PREFILL, optional: how long ago the gateway
                                          * admitted the request (microseconds, >= 0): a
                                          * retried or handed-back prompt takes its place
                                          * in the worker's queue by arrival, not at its
                                          * end; 0 = just now */
    int priority;                        /* PREFILL, KV_BEGIN, optional: the request's tier,
                                          * 0 = online, 1 = offline (preempted first when a
                                          * decode worker runs out of KV blocks) */
    int mtp_depth;                       /* PREFILL, KV_BEGIN, optional: the request's MTP
                                          * depth + 1 (1..3 = depth 0..2); 0 = not set (the
                                          * worker's --mtp-depth). REGISTER, optional: the
                                          * depth the worker serves + 1 (1 = no MTP; 0 =
                                          * not reported) */
    char decode_endpoint[PROTO_ENDPOINT_LEN];
    char decode_pubkey[PROTO_KEY_LEN];   /* PREFILL, MIGRATE, optional: the CURVE public key
                                          * of the kv ROUTER at decode_endpoint (Z85; "" =
                                          * it advertised none) */

    /* results (FINISH, ERROR, KV_BEGIN_ACK, KV_RESULT, KV_ABORT) */
    int reason;                          /* proto_finish_t */
    int code;                            /* proto_err_t */
    int retryable;
    int ok;
    char message[PROTO_MESSAGE_LEN];

    /* KV transfer (KV_*) */
    uint64_t xfer;                       /* transfer id, unique per sender */
    int n_layer, n_kv_head, head_dim, dtype;
    int layer;                           /* KV_LAYER: layer index */
    int blk0;                            /* KV_LAYER, optional: index of the first block the
                                          * frames carry (default 0; a layer may come in
                                          * several messages of contiguous block ranges) */
    int n_blocks;                        /* KV_LAYER: payload frames; KV_BEGIN: blocks */
    int n_kv_tokens;                     /* KV_BEGIN: tokens whose KV is sent */
    int n_mtp;                           /* KV_BEGIN, optional: how many of the n_layer
                                          * layers are MTP-module layers (the last ones) */
    uint64_t mtp_fp;                     /* KV_BEGIN, optional: fingerprint of the modules */
    int n_hidden;                        /* KV_BEGIN, optional: floats of the MTP hand-off
                                          * state KV_END carries as its one payload frame */
    int n_gen;                           /* KV_BEGIN, optional: a migrated sequence: tokens
                                          * its attempt generated so far, KV_END's first
                                          * included (its TOKENS index is n_gen - 1); 0 =
                                          * a prefill hand-off (the first token) */
    int first_token;                     /* KV_END */
    uint64_t checksum;                   /* KV_END: XXH64 of all payload frames in order */
    int lease_ms;                        /* KV_BEGIN: receiver's lease */
    int64_t pad_bytes;                   /* KV_BEGIN, optional: zero padding the transfer
                                          * carries on top of its KV, in bytes (emulated
                                          * workers; docs/kvtransfer.md "Padding"): each
                                          * KV_LAYER then has one padding frame, last */
    int64_t ts_us;                       /* sender's clock, microseconds (timing) */
    uint64_t *bhash;                     /* KV_BEGIN, optional ("bh"): the chained prefix-cache
                                          * hashes of the prompt's leading full blocks
                                          * (docs/prefix-cache.md), n_bhash of them; then
                                          * "tokens" holds the n_kv_tok prompt ids they
                                          * hash; owned like tokens */
    int n_bhash;                         /* [0, PROTO_MAX_BLOCK_HASHES] */
    int block_lookahead;                 /* KV_BEGIN, optional ("bla"): tokens past a block's
                                          * end its key holds (the MTP depth its module K/V
                                          * was written for) */
    int have_blocks;                     /* KV_BEGIN_ACK, optional ("have"): the leading
                                          * listed blocks the receiver already holds; the
                                          * sender sends blocks [have, n_blocks) only */

    /* request timing (TOKENS, FINISH; optional, 0 = not reported): durations in
     * microseconds, each measured on the reporting worker's own clock, so they never
     * depend on clock offsets between hosts */
    int64_t queue_us;   /* prefill side: PREFILL received -> its batch started */
    int64_t prefill_us; /* prefill side: batch started -> first token sampled */
    int64_t xfer_us;    /* decode side: KV_BEGIN received -> transfer accepted */
    uint64_t xfer_bytes;/* decode side: KV payload bytes received */
    int64_t step_us;    /* decode side: sequence ready -> first decode step's token */
} proto_msg;

/* Zero the message (no allocation). */
void proto_msg_init(proto_msg *m, proto_type_t type);
/* Free owned arrays (tokens, samp, lps, bhash, pfx) and zero the struct. */
void proto_msg_clear(proto_msg *m);
const char *proto_type_str(int type);
/* The name of a role ("prefill", "decode", "mixed"; "unknown" otherwise): the one spelling
 * used in flags, logs, the HTTP API and the metrics. */
const char *proto_role_str(int role);
/* Parse a role name as proto_role_str prints it into *out. Returns 0, or -1 (NULL or
 * another name; *out untouched). */
int proto_role_parse(const char *s, proto_role_t *out);
const char *proto_err_str(int code);

/* Encode the header of m into a malloc'd buffer (*out, *len; caller frees).
 * Returns 0, or -1 if a required field is missing/invalid for the type. */
int proto_encode(const proto_msg *m, unsigned char **out, size_t *len);

/* Decode a header. On success returns 0 and fills *m (tokens allocated; clear with
 * proto_msg_clear). On any error returns -1, leaves *m cleared, and writes the reason
 * into err (errlen bytes). */
int proto_decode(const void *buf, size_t len, proto_msg *m, char *err, size_t errlen);

/* The type ('t') and request id ('rid') a header names, read leniently from a header
 * proto_decode refused (a malformed TOKENS must still be known as lost: the gateway re-runs
 * its attempt). 0 when both were found, else -1 (*type and *rid 0 where not found). */
int proto_peek(const void *buf, size_t len, proto_type_t *type, uint64_t *rid);

/* Encode the header of m into buf (cap bytes, the caller's: usually on its stack) and
 * return it in *out, *len; when it does not fit, it goes to a malloc'd buffer returned in
 * *heap as well (the caller frees *heap, which is NULL when buf sufficed). Encoding a usual
 * header this way allocates nothing. Returns 0, or -1 if a required field is missing or
 * invalid for the type (nothing to free). */
int proto_encode_buf(const proto_msg *m, void *buf, size_t cap, const void **out, size_t *len,
                     void **heap);

/* Current time, microseconds: monotonic (for timeouts) and wall clock (for reports). */
int64_t proto_now_us(void);
int64_t proto_wall_us(void);

#endif
