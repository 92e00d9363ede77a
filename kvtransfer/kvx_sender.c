/*
 * kvx_sender: the prefill side of kvtransfer (see kvtransfer.h, docs/kvtransfer.md).
 *
 * Transfers sit in a singly linked list (at most a few dozen: lookups are linear), peers
 * (one DEALER per decode endpoint) in another. Zero-copy frames: each transfer has a pin
 * record, a reference count shared with ZeroMQ. The transfer holds one reference and every
 * payload frame in flight holds one (released by ZeroMQ's free callback, on its I/O
 * thread); the last one to let go frees the record, so frames may outlive the transfer and
 * the sender without touching freed memory. The sequence is freed only when the transfer
 * is over and the count is back to 1 (no frame in flight). Padding frames (emulated KV
 * size) point into a process-wide read-only mapping of zeros and pin nothing.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "kvtransfer.h"
#include "kvx_internal.h"
#include "log.h"

// --- pins

typedef struct {
    atomic_int refs; /* 1 (the transfer) + payload frames ZeroMQ still holds */
} kvx_pin;

static kvx_pin *pin_new(void)
{
    kvx_pin *p = malloc(sizeof(*p));
    if (p)
        atomic_init(&p->refs, 1);
    return p;
}

static void pin_put(kvx_pin *p)
{
    if (atomic_fetch_sub_explicit(&p->refs, 1, memory_order_acq_rel) == 1)
        free(p);
}

/* ZeroMQ free callback of a zero-copy payload frame (I/O thread or caller's thread). */
static void pin_frame_free(void *data, void *hint)
{
    (void)data;
    pin_put(hint);
}

static int pin_frames(kvx_pin *p)
{
    return atomic_load_explicit(&p->refs, memory_order_acquire) - 1;
}

// --- transfers

typedef struct kvx_peer {
    char endpoint[PROTO_ENDPOINT_LEN];
    char server_key[CURVE_Z85_LEN + 1]; /* CURVE: the receiver's public key ("" = plain) */
    void *sock; /* DEALER, linger 0 */
    int stale;  /* a send or a lease failed since the last message from the receiver */
    struct kvx_peer *next;
} kvx_peer;

typedef enum {
    SX_OPEN,      /* KV_BEGIN sent; layers being sent; waiting for KV_BEGIN_ACK until acked */
    SX_ENDED,     /* KV_END sent; waiting for KV_RESULT */
    SX_RELEASING, /* over; the sequence is freed once no frame pins it */
} sx_state_t;

typedef struct kvx_sx {
    uint64_t xfer, rid;
    kvx_peer *peer; /* NULL once the peer's socket was reset */
    int seq;        /* sender kvcache sequence, owned by kvx */
    int n_kv_tokens;
    int n_blocks; /* blocks per layer sent */
    sx_state_t state;
    int acked;
    int n_sent;      /* layers sent completely */
    int *next_blk;   /* (n_layer,) blocks of each layer sent so far: ranges go in order */
    int n_layer;     /* layers transferred: the first n_layer of the cache */
    int n_hidden;    /* floats of the MTP hand-off state KV_END carries (0 = none) */
    int64_t queue_us, prefill_us; /* the prefill's durations KV_END carries (0 = none) */
    XXH64_state_t *hash;
    kvx_pin *pin;
    int64_t deadline_us; /* lease (0 = none) */
    int64_t over_us;     /* when it entered SX_RELEASING */
    int64_t t0_us;       /* KV_BEGIN sent (stats) */
    uint64_t n_bytes;    /* payload bytes handed to ZeroMQ, padding included (stats) */
    uint64_t pad;        /* padding bytes of the transfer (KV_BEGIN "pad"; 0 = none) */
    int rejected;        /* KV_BEGIN_ACK refused it (stats) */
    /* prefix caching: KV_BEGIN listed n_listed block hashes, so nothing is sent before
     * KV_BEGIN_ACK (wait_ack): until it comes, handed-over ranges only advance next_blk and
     * a KV_END is kept (end_pending: its token, state and hand-off floats); the ACK's
     * "have" leading blocks are never sent, the rest goes out on the ACK */
    int wait_ack;
    int n_listed;
    int have;
    int end_pending;
    int end_first;
    uint64_t end_rng;
    float *end_hidden; /* (n_hidden,) copied, or NULL */
    struct kvx_sx *next;
} kvx_sx;

struct kvx_sender {
    void *zctx;
    kvcache_t *kv;
    kvx_sender_params p;
    uint64_t next_xfer;
    kvx_peer *peers;
    kvx_sx *xfers;
    int n_xfers;
    kvx_evq events;
    wire_envelope *env;
    zmq_msg_t *frames; /* (PROTO_MAX_FRAMES,) scratch for one KV_LAYER */
    proto_kvx_counters st;
    int use_curve;       /* DEALERs are CURVE clients with key pair curve */
    curve_keypair curve;
};

kvx_sender_params kvx_sender_default_params(void)
{
    kvx_sender_params p = {.fingerprint = 0, .lease_ms = 5000, .sndhwm = 65536};
    return p;
}

kvx_sender_t *kvx_sender_new(void *zctx, kvcache_t *kv, const kvx_sender_params *p)
{
    if (!zctx || !kv || !p || p->lease_ms <= 0 || p->sndhwm < 0 || p->n_mtp < 0 ||
        p->n_mtp >= kvcache_get_params(kv)->n_layer || p->pad_to_bytes_per_token > (1u << 24))
        return NULL;
    kvx_sender_t *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->zctx = zctx;
    s->kv = kv;
    s->p = *p;
    s->p.curve = NULL; /* borrowed: copied here */
    if (p->curve) {
        if (!curve_z85_valid(p->curve->public_z85) || !curve_z85_valid(p->curve->secret_z85)) {
            free(s);
            return NULL;
        }
        s->use_curve = 1;
        s->curve = *p->curve;
    }
    /* Transfer ids unique across senders (the receiver keys on them): random high bits. */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t seed = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^
                    ((uint64_t)getpid() << 40) ^ (uint64_t)(uintptr_t)s;
    s->next_xfer = (XXH64(&seed, sizeof(seed), 0) & ~0xffffffffull) | 1;
    s->env = wire_envelope_new();
    s->frames = calloc(PROTO_MAX_FRAMES, sizeof(zmq_msg_t));
    if (!s->env || !s->frames) {
        kvx_sender_destroy(&s);
        return NULL;
    }
    return s;
}

static void peer_close(kvx_peer *pe)
{
    if (pe->sock)
        zmq_close(pe->sock);
    pe->sock = NULL;
}

static void sx_free(kvx_sender_t *s, kvx_sx *x, int free_seq)
{
    if (free_seq && x->seq >= 0)
        kvcache_seq_free(s->kv, x->seq);
    if (x->hash)
        XXH64_freeState(x->hash);
    if (x->pin)
        pin_put(x->pin);
    free(x->next_blk);
    free(x->end_hidden);
    free(x);
}

void kvx_sender_destroy(kvx_sender_t **sp)
{
    if (!sp || !*sp)
        return;
    kvx_sender_t *s = *sp;
    for (kvx_peer *pe = s->peers, *n; pe; pe = n) {
        n = pe->next;
        peer_close(pe);
        free(pe);
    }
    /* Frames still queued keep their pin records alive (refcount), not the sequences: the
     * kvcache must outlive the zmq context's termination. */
    for (kvx_sx *x = s->xfers, *n; x; x = n) {
        n = x->next;
        sx_free(s, x, 1);
    }
    wire_envelope_destroy(&s->env);
    free(s->frames);
    free(s->events.v);
    memset(&s->curve, 0, sizeof(s->curve)); /* the secret key */
    free(s);
    *sp = NULL;
}

static void peer_drop(kvx_sender_t *s, kvx_peer *pe, const char *why);

/* The DEALER to endpoint whose receiver has public key server_key ("" for a plain
 * sender): a receiver restarted with another key gets a new DEALER, and so does one whose
 * connection failed (stale). */
static kvx_peer *peer_get(kvx_sender_t *s, const char *endpoint, const char *server_key)
{
    for (kvx_peer *pe = s->peers; pe; pe = pe->next) {
        if (strcmp(pe->endpoint, endpoint) != 0 || strcmp(pe->server_key, server_key) != 0)
            continue;
        if (!pe->stale)
            return pe;
        /* libzmq 4.3.4 does not reconnect after a failed handshake (the receiver's ZAP
         * handler refused our key): the DEALER would stay dead though the receiver now
         * admits us. A new one connects afresh. */
        peer_drop(s, pe, "the last transfer there failed: opening a new connection");
        break;
    }
    if (strlen(endpoint) >= PROTO_ENDPOINT_LEN || !*endpoint)
        return NULL;
    kvx_peer *pe = calloc(1, sizeof(*pe));
    if (!pe)
        return NULL;
    snprintf(pe->endpoint, sizeof(pe->endpoint), "%s", endpoint);
    snprintf(pe->server_key, sizeof(pe->server_key), "%s", server_key);
    pe->sock = zmq_socket(s->zctx, ZMQ_DEALER);
    int linger = 0, hwm = s->p.sndhwm, rhwm = 0;
    if (!pe->sock || zmq_setsockopt(pe->sock, ZMQ_LINGER, &linger, sizeof(linger)) < 0 ||
        zmq_setsockopt(pe->sock, ZMQ_SNDHWM, &hwm, sizeof(hwm)) < 0 ||
        zmq_setsockopt(pe->sock, ZMQ_RCVHWM, &rhwm, sizeof(rhwm)) < 0 ||
        (s->use_curve && curve_setup_client(pe->sock, &s->curve, server_key) < 0) ||
        zmq_connect(pe->sock, endpoint) < 0) {
        log_warn("kvx: cannot connect to %s: %s", endpoint, zmq_strerror(zmq_errno()));
        peer_close(pe);
        free(pe);
        return NULL;
    }
    log_debug("kvx: connected to decode endpoint %s", endpoint);
    pe->next = s->peers;
    s->peers = pe;
    return pe;
}

static kvx_sx *sx_find(const kvx_sender_t *s, uint64_t xfer)
{
    for (kvx_sx *x = s->xfers; x; x = x->next)
        if (x->xfer == xfer)
            return x;
    return NULL;
}

static void sx_send_abort(kvx_sx *x, int code, const char *msg)
{
    if (!x->peer)
        return;
    proto_msg m;
    proto_msg_init(&m, PROTO_KV_ABORT);
    m.rid = x->rid;
    m.xfer = x->xfer;
    m.code = code;
    snprintf(m.message, sizeof(m.message), "%s", msg);
    if (kvx_send_msg(x->peer->sock, NULL, 0, &m, NULL, 0) < 0)
        log_rdebug(x->rid, "kvx: KV_ABORT xfer=%llx not sent: %s", (unsigned long long)x->xfer,
                   zmq_strerror(errno));
}

/* Move a live transfer to SX_RELEASING. */
static void sx_over(kvx_sx *x)
{
    x->state = SX_RELEASING;
    x->deadline_us = 0;
    x->over_us = proto_now_us();
    if (x->hash) {
        XXH64_freeState(x->hash);
        x->hash = NULL;
    }
}

/* The transfer failed: report it, tell the receiver if asked, and release. */
static void sx_fail(kvx_sender_t *s, kvx_sx *x, int code, const char *msg, int tell_peer)
{
    if (x->state == SX_RELEASING)
        return;
    if (x->rejected)
        s->st.n_rejected++;
    else if (code == PROTO_ERR_TIMEOUT)
        s->st.n_timeouts++;
    else if (code == PROTO_ERR_CANCELLED)
        s->st.n_cancelled++;
    else
        s->st.n_aborted++;
    log_rinfo(x->rid, "kvx: transfer xfer=%llx to %s failed: %s (%s)", (unsigned long long)x->xfer,
              x->peer ? x->peer->endpoint : "(reset)", proto_err_str(code), msg);
    if (tell_peer)
        sx_send_abort(x, code, msg);
    kvx_event ev;
    kvx_ev_init(&ev, KVX_EV_FAILED, x->rid, x->xfer, code, msg);
    kvx_evq_push(&s->events, &ev);
    sx_over(x);
}

/* Close pe's socket (dropping queued frames, which releases their pins), fail whatever
 * was still going there, and forget pe; why is logged. */
static void peer_drop(kvx_sender_t *s, kvx_peer *pe, const char *why)
{
    log_warn("kvx: decode endpoint %s: %s", pe->endpoint, why);
    for (kvx_sx *x = s->xfers; x; x = x->next) {
        if (x->peer != pe)
            continue;
        if (x->state != SX_RELEASING)
            sx_fail(s, x, PROTO_ERR_UNAVAILABLE, "decode endpoint connection reset", 0);
        x->peer = NULL;
    }
    for (kvx_peer **pp = &s->peers; *pp; pp = &(*pp)->next) {
        if (*pp == pe) {
            *pp = pe->next;
            break;
        }
    }
    peer_close(pe);
    free(pe);
}

/* Padding of a transfer (docs/kvtransfer.md "Padding"): what makes its payload (n_layer
 * layers of n_blocks blocks, and the MTP hand-off state) total n_kv_tokens x
 * pad_to_bytes_per_token bytes; 0 when not padding or the real payload is that large. */
static uint64_t send_pad_bytes(const kvx_sender_t *s, int n_kv_tokens, int n_layer, int n_blocks,
                               int n_hidden)
{
    if (!s->p.pad_to_bytes_per_token)
        return 0;
    uint64_t want = (uint64_t)n_kv_tokens * s->p.pad_to_bytes_per_token;
    uint64_t real = (uint64_t)n_layer * (uint64_t)n_blocks * kvcache_block_bytes(s->kv) +
                    (uint64_t)n_hidden * sizeof(float);
    return want > real ? want - real : 0;
}

uint64_t kvx_send_begin(kvx_sender_t *s, const char *endpoint, const kvx_begin_params *bp)
{
    const kvcache_params *kp = kvcache_get_params(s->kv);
    if (!endpoint || !bp || bp->rid == 0 || bp->n_kv_tokens < 1 || bp->max_tokens < 1 ||
        !kvcache_seq_active(s->kv, bp->seq))
        return 0;
    int need = kvcache_blocks_for(s->kv, bp->n_kv_tokens), have = 0;
    kvcache_seq_blocks(s->kv, bp->seq, &have);
    if (need > have || need > PROTO_MAX_FRAMES) {
        log_rwarn(bp->rid, "kvx: cannot send %d tokens: %d blocks held, %d needed (max %d)",
                  bp->n_kv_tokens, have, need, PROTO_MAX_FRAMES);
        return 0;
    }
    int n_layer = bp->n_layer ? bp->n_layer : kp->n_layer - s->p.n_mtp;
    if (n_layer < 1 || n_layer > kp->n_layer || bp->n_mtp < 0 || bp->n_mtp >= n_layer ||
        bp->n_hidden < 0 || bp->n_hidden > (1 << 20) || bp->mtp < 0 ||
        bp->mtp > PROTO_SPEC_MAX_POS + 1 || bp->n_gen < 0 || bp->n_gen > (1 << 24))
        return 0;
    int n_listed = bp->n_block_hashes > 0 && bp->n_gen == 0 ? bp->n_block_hashes : 0;
    if (n_listed && (!bp->block_hashes || !bp->ids || bp->lookahead < 0 ||
                     bp->lookahead > PROTO_MAX_LOOKAHEAD || bp->n_kv_tokens > PROTO_MAX_TOKENS ||
                     (long long)n_listed * kp->block_size + bp->lookahead > bp->n_kv_tokens))
        return 0;
    if (n_listed > PROTO_MAX_BLOCK_HASHES) /* bounded: the leading ones */
        n_listed = PROTO_MAX_BLOCK_HASHES;
    if (n_listed && bp->samp &&
        (!bp->hist || bp->n_hist != bp->n_kv_tokens ||
         memcmp(bp->hist, bp->ids, (size_t)bp->n_kv_tokens * sizeof(int)) != 0))
        n_listed = 0; /* "tokens" carries the penalties' ids: they must be the prompt's */
    uint64_t pad = send_pad_bytes(s, bp->n_kv_tokens, n_layer, need, bp->n_hidden);
    if (pad && (need > PROTO_MAX_FRAMES - 1 || pad > (uint64_t)PROTO_MAX_PAD)) {
        log_rwarn(bp->rid, "kvx: cannot pad %d tokens: %d blocks (max %d), %llu bytes of padding",
                  bp->n_kv_tokens, need, PROTO_MAX_FRAMES - 1, (unsigned long long)pad);
        return 0;
    }
    const char *key = "";
    if (s->use_curve) {
        key = bp->server_key ? bp->server_key : "";
        if (!curve_z85_valid(key)) {
            log_rwarn(bp->rid, "kvx: refusing to send KV to %s: this worker uses CURVE and "
                      "that decode worker advertised %s", endpoint,
                      key[0] ? "a malformed key" : "no CURVE key");
            return 0;
        }
    }
    kvx_peer *pe = peer_get(s, endpoint, key);
    if (!pe)
        return 0;
    kvx_sx *x = calloc(1, sizeof(*x));
    if (!x)
        return 0;
    x->seq = -1; /* not ours until KV_BEGIN is out */
    x->n_layer = n_layer;
    x->n_hidden = bp->n_hidden;
    x->next_blk = calloc((size_t)n_layer, sizeof(int));
    x->hash = XXH64_createState();
    x->pin = pin_new();
    if (!x->next_blk || !x->hash || !x->pin) {
        sx_free(s, x, 0);
        return 0;
    }
    XXH64_reset(x->hash, 0);
    x->xfer = s->next_xfer++;
    x->rid = bp->rid;
    x->peer = pe;
    x->n_kv_tokens = bp->n_kv_tokens;
    x->n_blocks = need;
    x->pad = pad;
    x->wait_ack = n_listed > 0;
    x->n_listed = n_listed;

    proto_msg m;
    proto_msg_init(&m, PROTO_KV_BEGIN);
    m.rid = x->rid;
    m.xfer = x->xfer;
    m.fingerprint = s->p.fingerprint;
    m.n_layer = n_layer;
    m.n_mtp = bp->n_mtp;
    m.mtp_fp = bp->mtp_fp;
    m.n_hidden = bp->n_hidden;
    m.mtp_depth = bp->mtp;
    m.n_gen = bp->n_gen;
    m.priority = bp->priority ? 1 : 0;
    m.logprobs = bp->logprobs;
    m.n_kv_head = kp->n_kv_head;
    m.head_dim = kp->head_dim;
    m.dtype = PROTO_DTYPE_F32;
    m.block_size = kp->block_size;
    m.n_blocks = need;
    m.n_kv_tokens = bp->n_kv_tokens;
    m.max_tokens = bp->max_tokens;
    m.temperature = bp->temperature;
    m.top_p = bp->top_p;
    m.top_k = bp->top_k;
    m.samp = (proto_sampling *)bp->samp; /* borrowed for the send */
    m.tokens = bp->samp ? (int *)bp->hist : NULL;
    m.n_tokens = bp->samp && bp->hist ? bp->n_hist : 0;
    if (n_listed) {
        m.bhash = (uint64_t *)bp->block_hashes; /* borrowed for the send */
        m.n_bhash = n_listed;
        m.block_lookahead = bp->lookahead;
        m.tokens = (int *)bp->ids;
        m.n_tokens = bp->n_kv_tokens;
    }
    m.lease_ms = s->p.lease_ms;
    m.pad_bytes = (int64_t)pad;
    m.ts_us = proto_wall_us();
    if (kvx_send_msg(pe->sock, NULL, 0, &m, NULL, 0) < 0) {
        log_rwarn(x->rid, "kvx: KV_BEGIN to %s not sent: %s", endpoint, zmq_strerror(errno));
        pe->stale = 1; /* no connection: the next transfer opens a new one */
        sx_free(s, x, 0);
        return 0;
    }
    x->seq = bp->seq;
    x->state = SX_OPEN;
    x->t0_us = proto_now_us();
    x->deadline_us = kvx_deadline_after(s->p.lease_ms);
    x->next = s->xfers;
    s->xfers = x;
    s->n_xfers++;
    log_rdebug(x->rid, "kvx: KV_BEGIN xfer=%llx to %s: %d tokens, %d blocks/layer, %llu bytes "
               "of padding, %d block hashes listed",
               (unsigned long long)x->xfer, endpoint, x->n_kv_tokens, need,
               (unsigned long long)pad, n_listed);
    return x->xfer;
}

/* A padding frame of n zero bytes: zero-copy from kvx_zeros() (no free function: the
 * zeros outlive every frame), or a copy when n is past the shared mapping. Returns 0, or
 * -1 out of memory. */
static int pad_frame(zmq_msg_t *f, size_t n)
{
    if (n == 0)
        return zmq_msg_init(f);
    const void *z = kvx_zeros(n);
    if (z) /* ZeroMQ only reads the data of a frame it sends */
        return zmq_msg_init_data(f, (void *)z, n, NULL, NULL);
    if (zmq_msg_init_size(f, n) < 0)
        return -1;
    memset(zmq_msg_data(f), 0, n);
    return 0;
}

/* Send blocks [blk0, blk0 + n_blocks) of layer `layer` of x as one KV_LAYER (zero-copy
 * frames, checksummed in order; a padded transfer adds their padding share). Failures fail
 * the transfer. Returns 0, or -1 when the transfer failed. */
static int sx_send_range(kvx_sender_t *s, kvx_sx *x, int layer, int blk0, int n_blocks)
{
    if (!x->peer) {
        sx_fail(s, x, PROTO_ERR_UNAVAILABLE, "decode endpoint connection reset", 0);
        return -1;
    }
    const int *blocks = kvcache_seq_blocks(s->kv, x->seq, NULL);
    size_t bytes = kvcache_block_bytes(s->kv);
    int n = 0;
    for (; n < n_blocks; n++) {
        void *data = kvcache_block_data(s->kv, layer, blocks[blk0 + n]);
        XXH64_update(x->hash, data, bytes);
        atomic_fetch_add_explicit(&x->pin->refs, 1, memory_order_relaxed);
        if (zmq_msg_init_data(&s->frames[n], data, bytes, pin_frame_free, x->pin) < 0) {
            pin_put(x->pin);
            break;
        }
    }
    /* padding: one more frame, its blocks' share, zero-copy from the shared zeros (no pin:
     * they live as long as the process); not in the checksum */
    uint64_t pad = x->pad ? kvx_pad_bytes(x->pad, x->n_layer, x->n_blocks, layer, blk0, n_blocks)
                          : 0;
    int n_frames = n_blocks + (x->pad ? 1 : 0);
    if (n < n_blocks || (x->pad && pad_frame(&s->frames[n_blocks], (size_t)pad) < 0)) {
        for (int i = 0; i < n; i++)
            zmq_msg_close(&s->frames[i]); /* releases their pins */
        sx_fail(s, x, PROTO_ERR_INTERNAL, "out of memory", 1);
        return -1;
    }
    x->n_bytes += (uint64_t)n_blocks * bytes + pad;
    proto_msg m;
    proto_msg_init(&m, PROTO_KV_LAYER);
    m.rid = x->rid;
    m.xfer = x->xfer;
    m.layer = layer;
    m.blk0 = blk0;
    m.n_blocks = n_blocks;
    if (kvx_send_msg(x->peer->sock, NULL, 0, &m, s->frames, n_frames) < 0) {
        char msg[PROTO_MESSAGE_LEN];
        snprintf(msg, sizeof(msg), "KV_LAYER not sent: %s", zmq_strerror(errno));
        x->peer->stale = 1;
        sx_fail(s, x, PROTO_ERR_UNAVAILABLE, msg, 1);
        return -1;
    }
    return 0;
}

static void sender_handle(kvx_sender_t *s, kvx_peer *pe, const proto_msg *m, int n_frames);

/* Handle every reply pending on pe's DEALER (non-blocking). */
static void peer_recv(kvx_sender_t *s, kvx_peer *pe)
{
    for (int i = 0; i < KVX_MAX_MSGS_PER_CALL && pe->sock; i++) {
        int rc = wire_recv(pe->sock, 0, s->env, ZMQ_DONTWAIT);
        if (rc == 0)
            break;
        if (rc == -2) {
            log_warn("kvx: recv on %s: %s", pe->endpoint, zmq_strerror(errno));
            break;
        }
        if (rc == 1) {
            pe->stale = 0; /* the receiver talks to us: the connection works */
            sender_handle(s, pe, wire_envelope_msg(s->env), wire_envelope_n_frames(s->env));
        }
    }
    wire_envelope_reset(s->env);
}

int kvx_send_layer_blocks(kvx_sender_t *s, uint64_t xfer, int layer, int blk0, int n_blocks)
{
    kvx_sx *x = sx_find(s, xfer);
    if (!x || x->state != SX_OPEN)
        return -1;
    if (layer < 0 || layer >= x->n_layer || n_blocks < 1 || blk0 != x->next_blk[layer] ||
        blk0 + n_blocks > x->n_blocks) {
        log_rerror(x->rid,
                   "kvx: send_layer(%d) blocks [%d, +%d): invalid, out of order or "
                   "already sent",
                   layer, blk0, n_blocks);
        sx_fail(s, x, PROTO_ERR_INTERNAL, "layer blocks sent twice, out of order or out of range",
                1);
        return -1;
    }
    if (!x->peer) {
        sx_fail(s, x, PROTO_ERR_UNAVAILABLE, "decode endpoint connection reset", 0);
        return 0;
    }
    x->next_blk[layer] += n_blocks;
    if (x->next_blk[layer] == x->n_blocks)
        x->n_sent++;
    if (x->wait_ack && !x->acked) {
        /* KV_BEGIN listed hashes: the range waits for KV_BEGIN_ACK, which may be here
         * already (the forward pass runs between two polls of the loop): on it, the
         * blocks handed over so far that the receiver lacks go out (sender_handle) */
        peer_recv(s, x->peer);
        return 0;
    }
    int from = blk0 > x->have ? blk0 : x->have; /* blocks the receiver holds are not sent */
    if (blk0 + n_blocks > from)
        sx_send_range(s, x, layer, from, blk0 + n_blocks - from);
    return 0;
}

int kvx_send_layer(kvx_sender_t *s, uint64_t xfer, int layer)
{
    kvx_sx *x = sx_find(s, xfer);
    if (!x || x->state != SX_OPEN)
        return -1;
    int from = layer >= 0 && layer < x->n_layer ? x->next_blk[layer] : 0;
    /* a layer already sent whole asks for 0 blocks: refused as a second send */
    return kvx_send_layer_blocks(s, xfer, layer, from, x->n_blocks - from);
}

int kvx_send_end(kvx_sender_t *s, uint64_t xfer, int first_token, uint64_t rng)
{
    return kvx_send_end_mtp(s, xfer, first_token, rng, NULL, 0);
}

/* Send KV_END of x (its hand-off state, if any, as its one frame, checksummed after the
 * layers) and wait for KV_RESULT. Failures fail the transfer. */
static void sx_send_end_now(kvx_sender_t *s, kvx_sx *x, int first_token, uint64_t rng,
                            const float *hidden, int n_hidden)
{
    if (!x->peer) {
        sx_fail(s, x, PROTO_ERR_UNAVAILABLE, "decode endpoint connection reset", 0);
        return;
    }
    zmq_msg_t frame;
    int n_frames = 0;
    if (n_hidden) {
        size_t bytes = (size_t)n_hidden * sizeof(float);
        if (zmq_msg_init_size(&frame, bytes) < 0) {
            sx_fail(s, x, PROTO_ERR_INTERNAL, "out of memory", 1);
            return;
        }
        memcpy(zmq_msg_data(&frame), hidden, bytes);
        XXH64_update(x->hash, hidden, bytes);
        x->n_bytes += bytes;
        n_frames = 1;
    }
    proto_msg m;
    proto_msg_init(&m, PROTO_KV_END);
    m.rid = x->rid;
    m.xfer = x->xfer;
    m.first_token = first_token;
    m.checksum = XXH64_digest(x->hash);
    m.rng = rng;
    m.queue_us = x->queue_us;
    m.prefill_us = x->prefill_us;
    m.ts_us = proto_wall_us();
    if (kvx_send_msg(x->peer->sock, NULL, 0, &m, n_frames ? &frame : NULL, n_frames) < 0) {
        char msg[PROTO_MESSAGE_LEN];
        snprintf(msg, sizeof(msg), "KV_END not sent: %s", zmq_strerror(errno));
        x->peer->stale = 1;
        sx_fail(s, x, PROTO_ERR_UNAVAILABLE, msg, 1);
        return;
    }
    x->state = SX_ENDED;
    x->deadline_us = kvx_deadline_after(s->p.lease_ms);
}

int kvx_send_end_mtp(kvx_sender_t *s, uint64_t xfer, int first_token, uint64_t rng,
                     const float *hidden, int n_hidden)
{
    kvx_sx *x = sx_find(s, xfer);
    if (!x || x->state != SX_OPEN || x->end_pending)
        return -1;
    if (x->n_sent != x->n_layer) {
        log_rerror(x->rid, "kvx: send_end with %d of %d layers sent completely", x->n_sent,
                   x->n_layer);
        sx_fail(s, x, PROTO_ERR_INTERNAL, "KV_END before every layer was sent", 1);
        return -1;
    }
    if (n_hidden != x->n_hidden || (n_hidden && !hidden)) {
        log_rerror(x->rid, "kvx: send_end with %d hand-off floats, KV_BEGIN announced %d",
                   n_hidden, x->n_hidden);
        sx_fail(s, x, PROTO_ERR_INTERNAL, "KV_END hand-off state does not match KV_BEGIN", 1);
        return -1;
    }
    if (!x->peer) {
        sx_fail(s, x, PROTO_ERR_UNAVAILABLE, "decode endpoint connection reset", 0);
        return 0;
    }
    if (x->wait_ack && !x->acked) { /* KV_END follows the missing blocks, on the ACK */
        if (n_hidden) {
            x->end_hidden = malloc((size_t)n_hidden * sizeof(float));
            if (!x->end_hidden) {
                sx_fail(s, x, PROTO_ERR_INTERNAL, "out of memory", 1);
                return 0;
            }
            memcpy(x->end_hidden, hidden, (size_t)n_hidden * sizeof(float));
        }
        x->end_pending = 1;
        x->end_first = first_token;
        x->end_rng = rng;
        peer_recv(s, x->peer); /* the ACK may be here already */
        return 0;
    }
    sx_send_end_now(s, x, first_token, rng, hidden, n_hidden);
    return 0;
}

int kvx_send_timing(kvx_sender_t *s, uint64_t xfer, int64_t queue_us, int64_t prefill_us)
{
    kvx_sx *x = sx_find(s, xfer);
    if (!x || x->state != SX_OPEN)
        return -1;
    x->queue_us = queue_us > 0 ? queue_us : 0;
    x->prefill_us = prefill_us > 0 ? prefill_us : 0;
    return 0;
}

/* KV_BEGIN_ACK ok for a transfer that listed hashes: the receiver holds its first `have`
 * blocks; send the other blocks handed over so far, and KV_END if it was kept. */
static void sx_acked(kvx_sender_t *s, kvx_sx *x, int have)
{
    x->have = have;
    for (int l = 0; l < x->n_layer && x->state == SX_OPEN; l++)
        if (x->next_blk[l] > have)
            sx_send_range(s, x, l, have, x->next_blk[l] - have);
    if (x->state == SX_OPEN && x->end_pending) {
        x->end_pending = 0;
        sx_send_end_now(s, x, x->end_first, x->end_rng, x->end_hidden, x->n_hidden);
        free(x->end_hidden);
        x->end_hidden = NULL;
    }
}

void kvx_send_abort(kvx_sender_t *s, uint64_t xfer)
{
    kvx_sx *x = sx_find(s, xfer);
    if (!x || x->state == SX_RELEASING)
        return;
    log_rdebug(x->rid, "kvx: transfer xfer=%llx aborted by the caller",
               (unsigned long long)x->xfer);
    s->st.n_cancelled++;
    sx_send_abort(x, PROTO_ERR_CANCELLED, "aborted by the sender");
    sx_over(x);
}

int kvx_sender_pollitems(kvx_sender_t *s, zmq_pollitem_t *items, int cap)
{
    int n = 0;
    for (kvx_peer *pe = s->peers; pe && n < cap; pe = pe->next) {
        items[n].socket = pe->sock;
        items[n].fd = 0;
        items[n].events = ZMQ_POLLIN;
        items[n].revents = 0;
        n++;
    }
    return n;
}

static void sender_handle(kvx_sender_t *s, kvx_peer *pe, const proto_msg *m, int n_frames)
{
    kvx_sx *x = sx_find(s, m->xfer);
    if (!x || x->peer != pe || x->rid != m->rid || x->state == SX_RELEASING) {
        log_rdebug(m->rid, "kvx: dropped %s for unknown or finished xfer=%llx",
                   proto_type_str(m->type), (unsigned long long)m->xfer);
        return;
    }
    if (n_frames != 0) {
        log_rwarn(m->rid, "kvx: dropped %s with %d unexpected payload frames",
                  proto_type_str(m->type), n_frames);
        return;
    }
    int code = m->code ? m->code : PROTO_ERR_INTERNAL;
    switch (m->type) {
    case PROTO_KV_BEGIN_ACK:
        if (!m->ok) {
            x->rejected = 1;
            sx_fail(s, x, code, m->message[0] ? m->message : "rejected by the receiver", 0);
            return;
        }
        if (x->acked || m->have_blocks > x->n_listed) {
            sx_fail(s, x, PROTO_ERR_PROTOCOL,
                    x->acked ? "a second KV_BEGIN_ACK" : "KV_BEGIN_ACK has more blocks than listed",
                    1);
            return;
        }
        x->acked = 1;
        if (x->state == SX_OPEN)
            x->deadline_us = 0; /* our own compute paces the layers; the receiver has a lease */
        if (x->wait_ack && x->state == SX_OPEN)
            sx_acked(s, x, m->have_blocks);
        return;
    case PROTO_KV_RESULT:
        if (!m->ok) {
            sx_fail(s, x, code, m->message[0] ? m->message : "NACK from the receiver", 0);
            return;
        }
        if (x->state != SX_ENDED) {
            sx_fail(s, x, PROTO_ERR_PROTOCOL, "KV_RESULT ok before KV_END", 1);
            return;
        }
        log_rdebug(x->rid, "kvx: transfer xfer=%llx accepted", (unsigned long long)x->xfer);
        kvx_event ev;
        kvx_ev_init(&ev, KVX_EV_DONE, x->rid, x->xfer, PROTO_ERR_NONE, "");
        ev.xfer_us = proto_now_us() - x->t0_us;
        ev.n_bytes = x->n_bytes;
        s->st.n_ok++;
        s->st.n_bytes += x->n_bytes;
        s->st.total_us += (uint64_t)ev.xfer_us;
        kvx_evq_push(&s->events, &ev);
        sx_over(x);
        return;
    case PROTO_KV_ABORT:
        sx_fail(s, x, m->code ? m->code : PROTO_ERR_CANCELLED,
                m->message[0] ? m->message : "aborted by the receiver", 0);
        return;
    default:
        log_rwarn(m->rid, "kvx: dropped unexpected %s on a kv DEALER", proto_type_str(m->type));
        return;
    }
}

/* The endpoint is not taking our frames: close its socket and fail what was going there. */
static void peer_reset(kvx_sender_t *s, kvx_peer *pe)
{
    peer_drop(s, pe, "not reading; resetting the connection");
}

int kvx_sender_process(kvx_sender_t *s)
{
    int before = s->events.n;
    for (kvx_peer *pe = s->peers; pe; pe = pe->next)
        peer_recv(s, pe);
    int64_t now = proto_now_us();
    for (kvx_sx *x = s->xfers; x; x = x->next) {
        if (x->state != SX_RELEASING && x->deadline_us && now >= x->deadline_us) {
            if (x->peer) /* silence: maybe a handshake that failed for good */
                x->peer->stale = 1;
            sx_fail(s, x, PROTO_ERR_TIMEOUT,
                    x->state == SX_OPEN ? "no KV_BEGIN_ACK within the lease"
                                        : "no KV_RESULT within the lease",
                    1);
        }
    }
    /* Release finished transfers whose frames are gone; reset peers that sit on frames. */
    for (kvx_sx **xp = &s->xfers; *xp;) {
        kvx_sx *x = *xp;
        if (x->state != SX_RELEASING) {
            xp = &x->next;
            continue;
        }
        if (pin_frames(x->pin) == 0) {
            log_rdebug(x->rid, "kvx: xfer=%llx released, sequence %d freed",
                       (unsigned long long)x->xfer, x->seq);
            *xp = x->next;
            s->n_xfers--;
            sx_free(s, x, 1);
            continue;
        }
        if (x->peer && now - x->over_us >= (int64_t)s->p.lease_ms * 1000)
            peer_reset(s, x->peer);
        xp = &x->next;
    }
    return s->events.n - before;
}

int kvx_sender_next_timeout_ms(const kvx_sender_t *s)
{
    int64_t now = proto_now_us();
    int best = -1;
    for (const kvx_sx *x = s->xfers; x; x = x->next) {
        int t;
        if (x->state == SX_RELEASING)
            t = KVX_PIN_POLL_MS;
        else if (x->deadline_us)
            t = kvx_ms_until(x->deadline_us, now);
        else
            continue;
        if (best < 0 || t < best)
            best = t;
    }
    return best;
}

int kvx_sender_next_event(kvx_sender_t *s, kvx_event *ev)
{
    return kvx_evq_pop(&s->events, ev);
}

int kvx_sender_n_active(const kvx_sender_t *s)
{
    return s->n_xfers;
}

void kvx_sender_get_stats(const kvx_sender_t *s, proto_kvx_counters *out)
{
    *out = s->st;
}
