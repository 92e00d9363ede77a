/*
 * kvtransfer (kvx): the hand-off of one request's KV cache from a prefill worker to a decode
 * worker over the kv socket, as a specified state machine (docs/kvtransfer.md).
 *
 * Sender (prefill side, kvx_sender_t): one DEALER per decode endpoint, created lazily. A
 * transfer is KV_BEGIN, then KV_LAYER messages as the forward pass finishes each layer
 * (payload frames point into the kvcache pool: zero copies) -- one per layer, or, when the
 * prompt is computed in chunks, one per layer and chunk carrying the blocks that chunk
 * completed (a contiguous range starting at block blk0) -- then KV_END with the first
 * token, the sampler state and an XXH64 of every payload byte in order. The receiver answers
 * KV_BEGIN_ACK (ok or reject) and KV_RESULT (ok or NACK); either side may send KV_ABORT.
 *
 * Prefix caching (docs/prefix-cache.md "The decode side"): a KV_BEGIN may list the
 * prompt's full-block hashes with its ids (kvx_begin_params.block_hashes). A receiver
 * with a prefix cache shares the longest run of them it holds (confirmed on the ids,
 * pinned by the transfer's sequence) and answers KV_BEGIN_ACK "have"; the sender, which
 * then holds every range until the ACK, sends only blocks [have, n_blocks) of each layer.
 *
 * Receiver (decode side, kvx_receiver_t): one ROUTER. On KV_BEGIN it checks the model
 * fingerprint, the KV layout and its capacity, and reserves a sequence for the worst case
 * (the transferred tokens plus every token the request may still generate). KV_LAYER frames
 * are checked and copied into the reserved blocks, each block of each layer exactly once;
 * KV_END with every block of every layer received and a matching checksum hands the
 * sequence to the caller (KVX_EV_ACCEPTED).
 *
 * Ownership of KV memory (one owner at every moment):
 *   - sender: from a successful kvx_send_begin() the sequence belongs to kvx. The caller's
 *     forward pass may still write the blocks of each layer not yet handed to
 *     kvx_send_layer*(), and must not touch the sequence after kvx_send_end() or
 *     kvx_send_abort(). kvx frees it
 *     (kvcache_seq_free) once the transfer is over AND no payload frame that points into it
 *     is still held by ZeroMQ (pin count 0).
 *   - receiver: kvx owns the reserved sequence from an accepted KV_BEGIN until either it
 *     frees it (reject, NACK, abort, lease) or KVX_EV_ACCEPTED moves it to the caller, who
 *     then frees it with kvcache_seq_free() when decoding ends.
 *
 * Padding (emulated workers, kvx_sender_params.pad_to_bytes_per_token): a sender may make a
 * transfer weigh what the emulated model's KV would. KV_BEGIN then declares "pad" bytes in
 * total and every KV_LAYER carries one extra frame, last, of zeros: the share of its blocks
 * (docs/kvtransfer.md "Padding"), zero-copy from one read-only mapping shared by the
 * process. The receiver checks each padding frame's size exactly, counts it in the
 * transfer's bytes and drops it; the checksum covers the real KV only.
 *
 * Events (done, failed, accepted) are queued and pulled with kvx_*_next_event(), so no
 * callback ever re-enters the caller. Each side counts its transfers (completed, bytes,
 * time, rejects, timeouts, aborts, cancels) for the worker's heartbeat:
 * kvx_*_get_stats(). Leases use the monotonic clock (proto_now_us).
 * Threading: each object, its sockets and its kvcache belong to one thread. The only
 * cross-thread access is the atomic pin count, decremented by ZeroMQ's I/O thread.
 * Library code: logs through log.h only, never asserts on peer input.
 */
#ifndef TP_KVTRANSFER_H
#define TP_KVTRANSFER_H

#include <stdint.h>
#include <zmq.h>

#include "curve.h"
#include "kvcache.h"
#include "protocol.h"

typedef struct kvx_sender kvx_sender_t;
typedef struct kvx_receiver kvx_receiver_t;

typedef enum {
    KVX_EV_DONE = 1, /* sender: the receiver accepted the transfer (KV_RESULT ok) */
    KVX_EV_FAILED,   /* sender: transfer failed (code, message); receiver: transfer dropped */
    KVX_EV_ACCEPTED, /* receiver: a whole sequence arrived; its ownership moves to the caller */
} kvx_event_type_t;

/* One event. code is a proto_err_t. The ACCEPTED fields describe the arrived sequence:
 * seq is a sequence of the receiver's kvcache with length n_kv_tokens and capacity for
 * min(n_kv_tokens + headroom_tokens, max_seq_len) tokens (kvx_receiver_params): the caller
 * reserves more as the sequence grows. */
typedef struct {
    kvx_event_type_t type;
    uint64_t rid;
    uint64_t xfer;
    int code;
    char message[PROTO_MESSAGE_LEN];
    /* KVX_EV_ACCEPTED only */
    int seq;
    int n_kv_tokens;
    int first_token;
    uint64_t rng;
    int max_tokens;
    float temperature, top_p;
    int top_k;
    /* KVX_EV_DONE (sender) and KVX_EV_ACCEPTED (receiver): the transfer's duration on this
     * side's monotonic clock (sender: KV_BEGIN sent -> KV_RESULT ok; receiver: KV_BEGIN
     * accepted -> KV_END verified) and its payload bytes (padding frames included) */
    int64_t xfer_us;
    uint64_t n_bytes;
    /* KVX_EV_ACCEPTED: the prefill's durations KV_END carried (kvx_send_timing; 0 = none) */
    int64_t queue_us, prefill_us;
    /* KVX_EV_ACCEPTED, MTP (docs/kvtransfer.md): mtp is KV_BEGIN's requested depth + 1
     * (0 = not set); mtp_ok = 1 when the module layers were stored and the hand-off state
     * arrived: hidden, (n_hidden,) float32, malloc'd, owned by whoever pops the event (free
     * it). With mtp_ok = 0, hidden is NULL and the sequence has no module state. */
    int mtp;
    int mtp_ok;
    float *hidden;
    int n_hidden;
    /* KVX_EV_ACCEPTED: KV_BEGIN's "gen": 0 for a prefill hand-off; for a live migration,
     * the tokens the request's attempt generated before it moved, first_token included
     * (first_token is then the token to feed next, already reported at index n_gen - 1) */
    int n_gen;
    /* KVX_EV_ACCEPTED: KV_BEGIN's "pri": 0 online, 1 offline (preempted first) */
    int priority;
    /* KVX_EV_ACCEPTED: KV_BEGIN's "lpk": 0, or log-probabilities with k alternatives + 1 */
    int logprobs;
    /* KVX_EV_ACCEPTED: KV_BEGIN's sampling controls ("samp") and the sequence's ids so far
     * ("tokens": prompt then generated, first_token not included; n_hist of them), both
     * malloc'd and owned by whoever pops the event (free them); NULL / 0 when none */
    proto_sampling *samp;
    int *hist;
    int n_hist;
    /* KVX_EV_ACCEPTED, prefix caching (docs/prefix-cache.md): when KV_BEGIN listed block
     * hashes the receiver used (kvx_receiver_params.prefix_cache), pfx = 1, ids the n_ids
     * prompt ids (malloc'd, owned by whoever pops the event: free it), pfx_seed and pfx_la
     * the chain's seed and lookahead (kvcache_prefix_seed_mtp), and have_blocks the
     * leading blocks that were already cached here (shared, not transferred). The received
     * full blocks are registered in the cache already; the caller may register the blocks
     * of generated tokens under the same seed when the sequence ends. pfx = 0: ids NULL. */
    int pfx;
    int *ids;
    int n_ids;
    uint64_t pfx_seed;
    int pfx_la;
    int have_blocks;
} kvx_event;

// --- sender

typedef struct {
    uint64_t fingerprint; /* model fingerprint sent in KV_BEGIN */
    int lease_ms;         /* wait at most this long for KV_BEGIN_ACK and for KV_RESULT */
    int sndhwm;           /* messages queued per decode endpoint (ZMQ_SNDHWM) */
    int n_mtp;            /* the cache's last n_mtp layers are MTP module layers: a transfer
                           * that does not name its layers sends the others (default 0) */
    uint64_t pad_to_bytes_per_token; /* 0 (default): send the real KV only. Else (emulated
                           * workers: the emulated model's KV bytes per token, at most
                           * 2^24) every transfer also sends zero padding, so that its
                           * payload totals n_kv_tokens x this many bytes exactly (not
                           * padded when the real KV is already that large); see
                           * docs/kvtransfer.md "Padding" */
    const curve_keypair *curve; /* NULL (default): plain sockets. Else (borrowed for
                           * kvx_sender_new only; copied) every DEALER is a CURVE client
                           * with this key pair, and a transfer needs the receiver's public
                           * key (kvx_begin_params.server_key) */
} kvx_sender_params;

/* Defaults: lease 5000 ms, sndhwm 65536, no padding. */
kvx_sender_params kvx_sender_default_params(void);

/* A sender over the zmq context zctx (borrowed) reading KV from kv (borrowed; must outlive
 * the sender and, because queued frames point into it, the zmq context's termination).
 * Returns NULL on bad params or out of memory. */
kvx_sender_t *kvx_sender_new(void *zctx, kvcache_t *kv, const kvx_sender_params *p);

/* Close every DEALER (linger 0), drop every transfer (sequences of transfers still in
 * progress are freed), free the sender and NULL *s. Takes NULL. Frames still queued in
 * ZeroMQ keep only a reference-counted pin record alive, never the sender. */
void kvx_sender_destroy(kvx_sender_t **s);

/* The request a transfer carries. */
typedef struct {
    uint64_t rid;    /* request id (!= 0) */
    int seq;         /* sender kvcache sequence holding the KV */
    int n_kv_tokens; /* tokens whose KV is sent (>= 1; the prompt) */
    int max_tokens;  /* tokens to generate in total, first included (>= 1) */
    float temperature, top_p;
    int top_k;
    /* MTP (optional, zero = none): n_layer = layers to transfer, the first n_layer of the
     * cache (0 = every main layer: all but the sender's n_mtp module layers); n_mtp of
     * them, the last ones, are module layers, whose
     * fingerprint is mtp_fp; n_hidden = floats of the hand-off state kvx_send_end_mtp()
     * will send; mtp = the request's MTP depth + 1 (0 = not set), carried to the receiver */
    int n_layer;
    int n_mtp;
    uint64_t mtp_fp;
    int n_hidden;
    int mtp;
    /* live migration (optional, 0 = a prefill hand-off): the tokens the request's attempt
     * generated so far, KV_END's first_token included; max_tokens then counts the tokens
     * still to generate, first_token included (docs/kvtransfer.md "Migration") */
    int n_gen;
    int priority; /* the request's tier (KV_BEGIN "pri"): 0 online, 1 offline */
    int logprobs; /* KV_BEGIN "lpk": 0, or log-probabilities with k alternatives + 1 */
    /* sampling controls (optional, NULL = none; borrowed for the call): carried in KV_BEGIN
     * with the sequence's ids so far (hist, n_hist: prompt then generated, KV_END's
     * first_token not included), which the receiver's penalties count */
    const proto_sampling *samp;
    const int *hist;
    int n_hist;
    /* CURVE: the receiver's public key (Z85, as its REGISTER advertised it; NULL or "" =
     * none). Required by a CURVE sender, which refuses (logged) to send to a receiver
     * without one; ignored by a plain sender. */
    const char *server_key;
    /* prefix caching (optional, 0 = none; docs/prefix-cache.md): the chained hashes of the
     * prompt's leading full blocks (kvcache_prefix_hashes: n_block_hashes of them, at most
     * the transfer's blocks; more than PROTO_MAX_BLOCK_HASHES are cut to that), their key's
     * lookahead, and ids, the n_kv_tokens prompt ids they hash (borrowed for the call; with
     * samp they must equal hist, else no hash is listed). KV_BEGIN then lists them and the
     * sender waits for KV_BEGIN_ACK before any KV_LAYER: blocks the receiver already holds
     * ("have") are not sent. Not for a migration (n_gen > 0). */
    const uint64_t *block_hashes;
    int n_block_hashes;
    int lookahead;
    const int *ids;
} kvx_begin_params;

/* Start a transfer to the decode worker at endpoint: connect if needed (one DEALER per
 * endpoint and server key) and send KV_BEGIN.
 * On success returns the transfer id (!= 0) and the sequence now belongs to kvx (see the
 * top comment). Returns 0 when nothing was started (bad arguments: inactive sequence, a
 * CURVE sender without a valid p->server_key,
 * fewer blocks than n_kv_tokens needs, more than PROTO_MAX_FRAMES blocks, or more than
 * PROTO_MAX_FRAMES - 1 when padded; socket error; send queue full): the caller still owns
 * the sequence. */
uint64_t kvx_send_begin(kvx_sender_t *s, const char *endpoint, const kvx_begin_params *p);

/* Send blocks [blk0, blk0 + n_blocks) of the transfer's sequence in layer `layer` as one
 * KV_LAYER message whose n_blocks payload frames, each (2, block_size, kv_dim) float32,
 * point into the kvcache pool (no copy), and fold those bytes into the checksum (a padded
 * transfer adds its padding frame, not checksummed). Within a layer, ranges go in order
 * (blk0 = the blocks of that layer sent so far) and together cover the
 * blocks_for(n_kv_tokens) blocks; layers may interleave in any order. Call once
 * the forward pass has written those blocks of that layer completely: a block must not
 * change after it was handed over (a chunked prefill sends a block partly filled by one
 * chunk only when the next chunk completes it, or the prompt ends). Returns 0, or -1 when
 * the transfer is unknown or already over (a no-op: its outcome is or was reported by an
 * event) or the range is invalid: layer out of range, n_blocks < 1, blk0 not where the
 * layer's previous range ended, past the last block (the transfer then fails with
 * PROTO_ERR_INTERNAL). A send failure fails the transfer (PROTO_ERR_UNAVAILABLE, reported
 * as an event) and returns 0. */
int kvx_send_layer_blocks(kvx_sender_t *s, uint64_t xfer, int layer, int blk0, int n_blocks);

/* Send the blocks of layer `layer` not sent yet (the whole layer, blocks_for(n_kv_tokens)
 * of them, when none was): kvx_send_layer_blocks() from where the layer stands to its end.
 * Same returns; a layer already sent completely is refused as sent twice (-1,
 * PROTO_ERR_INTERNAL). */
int kvx_send_layer(kvx_sender_t *s, uint64_t xfer, int layer);

/* Send KV_END (first token, sampler state rng, checksum) and wait for KV_RESULT (at most
 * lease_ms). Every block of every layer must have been sent. Returns 0, or -1 when the
 * transfer is unknown or over (no-op) or not every block of every layer was sent (then it
 * fails with PROTO_ERR_INTERNAL). The outcome comes as KVX_EV_DONE or KVX_EV_FAILED. */
int kvx_send_end(kvx_sender_t *s, uint64_t xfer, int first_token, uint64_t rng);

/* kvx_send_end for a transfer begun with n_hidden > 0: KV_END carries hidden (n_hidden
 * floats, copied) as its one payload frame, folded into the checksum after the layers.
 * n_hidden must equal the one given to kvx_send_begin (else -1 and the transfer fails with
 * PROTO_ERR_INTERNAL). Same returns as kvx_send_end. */
int kvx_send_end_mtp(kvx_sender_t *s, uint64_t xfer, int first_token, uint64_t rng,
                     const float *hidden, int n_hidden);

/* Attach the prefill's durations (microseconds: queued on the worker, prompt computed; <= 0
 * = not known) to the transfer's KV_END, which the receiver reports as KVX_EV_ACCEPTED's
 * queue_us / prefill_us: the decode worker's first TOKENS then carries the request's whole
 * breakdown even when it reaches the gateway before the prefill worker's own TOKENS. Call
 * before kvx_send_end*(). Returns 0, or -1 when the transfer is unknown or no longer open. */
int kvx_send_timing(kvx_sender_t *s, uint64_t xfer, int64_t queue_us, int64_t prefill_us);

/* Abandon a transfer: send KV_ABORT (code PROTO_ERR_CANCELLED) to the receiver if it is
 * still in progress; no event follows. The sequence is freed by kvx once no frame pins it.
 * Idempotent; unknown or finished ids are ignored. */
void kvx_send_abort(kvx_sender_t *s, uint64_t xfer);

/* Fill up to cap poll items (ZMQ_POLLIN on each DEALER). Returns the number filled. */
int kvx_sender_pollitems(kvx_sender_t *s, zmq_pollitem_t *items, int cap);

/* Handle every pending reply (non-blocking), expire leases, and free the sequences of
 * finished transfers whose frames ZeroMQ has released. A transfer whose frames are still
 * queued lease_ms after it ended means its peer is not reading: that endpoint's DEALER is
 * closed (dropping the frames) and its other transfers fail with PROTO_ERR_UNAVAILABLE.
 * Call after every poll. Returns the number of events queued by this call. */
int kvx_sender_process(kvx_sender_t *s);

/* Milliseconds until kvx_sender_process() has timed work to do (a lease, or pins to
 * watch), -1 when nothing is pending. */
int kvx_sender_next_timeout_ms(const kvx_sender_t *s);

/* Pop the oldest event into *ev. Returns 1, or 0 when there is none. */
int kvx_sender_next_event(kvx_sender_t *s, kvx_event *ev);

/* Transfers kvx still tracks: in progress, or over but waiting for their frames to be
 * released (their sequences are not free yet). */
int kvx_sender_n_active(const kvx_sender_t *s);

/* Copy the sender's counters since it was created into *out: n_ok / n_bytes / total_us of
 * the transfers the receiver accepted (n_bytes: payload, padding included); n_rejected
 * (KV_BEGIN_ACK refused), n_timeouts (lease expired), n_cancelled (kvx_send_abort by the
 * caller, e.g. on a gateway CANCEL, or a KV_ABORT with code PROTO_ERR_CANCELLED from the
 * receiver), n_aborted (every other failure). Each transfer that started counts exactly
 * once, when it ends. */
void kvx_sender_get_stats(const kvx_sender_t *s, proto_kvx_counters *out);

// --- receiver

typedef struct {
    uint64_t fingerprint; /* must equal KV_BEGIN's fp */
    int lease_ms;         /* a transfer with no message for this long is aborted */
    int rcvhwm;           /* ZMQ_RCVHWM of the ROUTER */
    /* MTP (optional): the last n_mtp layers of the cache are module layers of modules with
     * fingerprint mtp_fp, whose hand-off state is n_hidden floats. A transfer whose main
     * layers match is accepted whatever modules it carries; its module layers and state
     * are kept only when it has at most n_mtp module layers, the same mtp_fp and n_hidden
     * (else dropped: the sequence decodes without MTP). */
    int n_mtp;
    uint64_t mtp_fp;
    int n_hidden;
    /* a migrated sequence (KV_BEGIN gen > 0) may carry instead the whole module state of
     * its decoding, n_hidden_mig floats (specdec_state_floats()); 0 = not accepted */
    int n_hidden_mig;
    /* KV reservation at KV_BEGIN (docs/kvtransfer.md "Reservations"): the transferred
     * tokens plus headroom_tokens (capped at the context), refused (NOSPACE) when fewer
     * than watermark_blocks blocks would stay free, unless the cache holds nothing else
     * (so a sequence that fits an empty cache is always admitted). Default 0 and 0. */
    int headroom_tokens;
    int watermark_blocks;
    /* NULL (default): a plain ROUTER. Else (borrowed for kvx_receiver_new only) a CURVE
     * server with this key pair's secret key and ZAP domain CURVE_ZAP_DOMAIN_KV: the
     * process's ZAP handler (curve_zap_start, on the same zmq context) decides which
     * senders are admitted */
    const curve_keypair *curve;
    /* automatic prefix caching (docs/prefix-cache.md): 1 = a KV_BEGIN that lists block
     * hashes ("bh", with the prompt's ids) gets the longest run of them this cache holds,
     * confirmed on the token ids, shared with the new sequence (refcount + 1 for the
     * transfer) and answered as KV_BEGIN_ACK "have": only the other blocks are sent; the
     * received full blocks are registered once the transfer is verified. 0 (default):
     * hashes are ignored (have = 0). */
    int prefix_cache;
} kvx_receiver_params;

/* Defaults: lease 5000 ms, rcvhwm 65536. */
kvx_receiver_params kvx_receiver_default_params(void);

/* Bind a ROUTER (linger 0, ZMQ_ROUTER_MANDATORY; CURVE server when p->curve) at endpoint
 * and receive into kv
 * (borrowed, must outlive the receiver). `tcp://host:*` picks a free port; the bound
 * endpoint is kvx_receiver_endpoint(). Returns NULL on bind failure (logged) or out of
 * memory. */
kvx_receiver_t *kvx_receiver_new(void *zctx, kvcache_t *kv, const char *endpoint,
                                 const kvx_receiver_params *p);

/* Close the socket, free the sequences of transfers in progress, free the receiver and
 * NULL *r. Takes NULL. Sequences already handed over (KVX_EV_ACCEPTED) are not touched. */
void kvx_receiver_destroy(kvx_receiver_t **r);

/* The endpoint actually bound (ZMQ_LAST_ENDPOINT), borrowed. */
const char *kvx_receiver_endpoint(const kvx_receiver_t *r);

/* The ROUTER socket, for zmq_poll (ZMQ_POLLIN) only; borrowed. */
void *kvx_receiver_socket(kvx_receiver_t *r);

/* When accepting is 0, every new KV_BEGIN is rejected with PROTO_ERR_UNAVAILABLE;
 * transfers in progress continue. Default 1. */
void kvx_receiver_set_accepting(kvx_receiver_t *r, int accepting);

/* Handle every pending message (non-blocking; at most a bounded number per call) and
 * expire leases. Returns the number of events queued by this call. */
int kvx_receiver_process(kvx_receiver_t *r);

/* Milliseconds until the next lease expires, -1 when no transfer is in progress. */
int kvx_receiver_next_timeout_ms(const kvx_receiver_t *r);

/* Pop the oldest event into *ev. Returns 1, or 0 when there is none. */
int kvx_receiver_next_event(kvx_receiver_t *r, kvx_event *ev);

/* Drop the transfer of request rid if one is in progress (gateway CANCEL): free its
 * blocks and send KV_ABORT (PROTO_ERR_CANCELLED) to the sender; no event follows.
 * Returns 1 if a transfer was dropped, 0 if none was in progress (idempotent). */
int kvx_receiver_abort(kvx_receiver_t *r, uint64_t rid);

/* Transfers in progress (each holds a reserved sequence). */
int kvx_receiver_n_active(const kvx_receiver_t *r);

/* Copy the receiver's counters since it was created into *out: n_ok / n_bytes / total_us
 * of the transfers handed over (KVX_EV_ACCEPTED; n_bytes: payload, padding included);
 * n_rejected (KV_BEGIN refused: layout, capacity, not accepting, duplicate id); n_timeouts
 * (lease expired); n_cancelled (kvx_receiver_abort, an abort with code PROTO_ERR_CANCELLED
 * from the sender, superseded by a new transfer of the same request); n_aborted (every
 * other drop: checksum or protocol error (a wrong padding frame too), KV_RESULT not
 * sent). */
void kvx_receiver_get_stats(const kvx_receiver_t *r, proto_kvx_counters *out);

#endif
