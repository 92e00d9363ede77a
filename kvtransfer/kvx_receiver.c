/*
 * kvx_receiver: the decode side of kvtransfer (see kvtransfer.h, docs/kvtransfer.md).
 *
 * Transfers in progress sit in a singly linked list keyed by transfer id (a few dozen at
 * most: lookups are linear); each remembers the routing id of the peer that opened it,
 * and nothing from another peer is ever written into its blocks. Every frame is checked
 * before the first byte is copied. A layer may arrive in several KV_LAYER messages, each a
 * contiguous block range (chunked prefill): a bitmap of (layer, block) pairs accepts each
 * block exactly once, and KV_END requires all of them. A padded transfer's padding frames
 * (emulated KV size) are size-checked, counted and dropped, never copied.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "kvtransfer.h"
#include "kvx_internal.h"
#include "log.h"

typedef struct kvx_rx {
    uint64_t xfer, rid;
    unsigned char id[256]; /* the sender's routing id */
    size_t id_len;
    int seq; /* receiver kvcache sequence, owned by kvx while here */
    int n_kv_tokens, n_blocks, max_tokens;
    float temperature, top_p;
    int top_k;
    int n_layer;  /* layers transferred (KV_BEGIN n_layer) */
    int n_main;   /* of which main-model layers: stored at the same index */
    int keep_mtp; /* store the module layers and the hand-off state (compatible modules) */
    int n_hidden; /* floats of the hand-off state KV_END carries (0 = none) */
    int mtp;      /* the request's MTP depth + 1 (0 = not set) */
    int n_gen;    /* KV_BEGIN "gen" (0 = a prefill hand-off; > 0 = a migrated sequence) */
    int priority; /* KV_BEGIN "pri" */
    int logprobs; /* KV_BEGIN "lpk" */
    proto_sampling *samp; /* KV_BEGIN "samp" (copied; NULL = none) */
    int *hist;            /* KV_BEGIN "tokens" with samp (copied), n_hist ids */
    int n_hist;
    int n_got;    /* blocks received, every layer counted (complete: n_layer * n_blocks) */
    uint8_t *got; /* bitmap (n_layer * n_blocks bits): bit l * n_blocks + b = block b of
                   * layer l arrived */
    XXH64_state_t *hash;
    int64_t deadline_us; /* lease: last message + lease_ms */
    int64_t t0_us;       /* KV_BEGIN accepted (stats) */
    uint64_t n_bytes;    /* payload bytes received, padding included (stats) */
    uint64_t pad;        /* KV_BEGIN "pad": padding bytes in all (0 = none: KV_LAYER has no
                          * padding frame) */
    /* prefix caching: KV_BEGIN listed block hashes we use (pfx = 1): the prompt ids, the
     * chain's seed and lookahead, and the leading blocks shared from the cache (have; their
     * bits in got are set from the start, so a KV_LAYER for one is refused as sent twice) */
    int pfx;
    int *ids;
    int n_ids;
    uint64_t pfx_seed;
    int pfx_la;
    int have;
    struct kvx_rx *next;
} kvx_rx;

struct kvx_receiver {
    void *sock;
    kvcache_t *kv;
    kvx_receiver_params p;
    char endpoint[PROTO_ENDPOINT_LEN];
    int accepting;
    kvx_rx *xfers;
    int n_xfers;
    kvx_evq events;
    wire_envelope *env;
    proto_kvx_counters st;
};

kvx_receiver_params kvx_receiver_default_params(void)
{
    kvx_receiver_params p = {.fingerprint = 0, .lease_ms = 5000, .rcvhwm = 65536};
    return p;
}

kvx_receiver_t *kvx_receiver_new(void *zctx, kvcache_t *kv, const char *endpoint,
                                 const kvx_receiver_params *p)
{
    if (!zctx || !kv || !endpoint || !p || p->lease_ms <= 0 || p->rcvhwm < 0)
        return NULL;
    kvx_receiver_t *r = calloc(1, sizeof(*r));
    if (!r)
        return NULL;
    r->kv = kv;
    r->p = *p;
    r->accepting = 1;
    r->env = wire_envelope_new();
    r->sock = zmq_socket(zctx, ZMQ_ROUTER);
    if (!r->env || !r->sock)
        goto fail;
    int linger = 0, mandatory = 1, hwm = p->rcvhwm, shwm = 0;
    size_t len = sizeof(r->endpoint);
    if (zmq_setsockopt(r->sock, ZMQ_LINGER, &linger, sizeof(linger)) < 0 ||
        zmq_setsockopt(r->sock, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof(mandatory)) < 0 ||
        zmq_setsockopt(r->sock, ZMQ_RCVHWM, &hwm, sizeof(hwm)) < 0 ||
        zmq_setsockopt(r->sock, ZMQ_SNDHWM, &shwm, sizeof(shwm)) < 0)
        goto fail;
    if (p->curve && curve_setup_server(r->sock, p->curve, CURVE_ZAP_DOMAIN_KV) < 0) {
        log_error("kvx: cannot make the kv socket a CURVE server: %s",
                  zmq_strerror(zmq_errno()));
        goto fail;
    }
    r->p.curve = NULL; /* borrowed for the set-up only */
    if (zmq_bind(r->sock, endpoint) < 0) {
        log_error("kvx: cannot bind kv socket %s: %s", endpoint, zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (zmq_getsockopt(r->sock, ZMQ_LAST_ENDPOINT, r->endpoint, &len) < 0)
        snprintf(r->endpoint, sizeof(r->endpoint), "%s", endpoint);
    return r;
fail:
    kvx_receiver_destroy(&r);
    return NULL;
}

static void rx_free(kvx_receiver_t *r, kvx_rx *x, int free_seq)
{
    if (free_seq && x->seq >= 0)
        kvcache_seq_free(r->kv, x->seq);
    if (x->hash)
        XXH64_freeState(x->hash);
    free(x->got);
    free(x->samp);
    free(x->hist);
    free(x->ids);
    free(x);
}

void kvx_receiver_destroy(kvx_receiver_t **rp)
{
    if (!rp || !*rp)
        return;
    kvx_receiver_t *r = *rp;
    if (r->sock)
        zmq_close(r->sock);
    for (kvx_rx *x = r->xfers, *n; x; x = n) {
        n = x->next;
        rx_free(r, x, 1);
    }
    kvx_event ev;
    while (kvx_evq_pop(&r->events, &ev)) { /* events nobody popped: what they own */
        free(ev.hidden);
        free(ev.samp);
        free(ev.hist);
        free(ev.ids);
    }
    wire_envelope_destroy(&r->env);
    free(r->events.v);
    free(r);
    *rp = NULL;
}

const char *kvx_receiver_endpoint(const kvx_receiver_t *r)
{
    return r->endpoint;
}

void *kvx_receiver_socket(kvx_receiver_t *r)
{
    return r->sock;
}

void kvx_receiver_set_accepting(kvx_receiver_t *r, int accepting)
{
    r->accepting = accepting != 0;
}

static void rx_reply_have(kvx_receiver_t *r, const void *id, size_t id_len, proto_type_t type,
                          uint64_t rid, uint64_t xfer, int ok, int code, const char *msg,
                          int have, int *sent)
{
    proto_msg m;
    proto_msg_init(&m, type);
    m.have_blocks = have;
    m.rid = rid;
    m.xfer = xfer;
    m.ok = ok;
    m.code = code;
    snprintf(m.message, sizeof(m.message), "%s", msg ? msg : "");
    /* optional fields are always encoded, and lease_ms must be >= 1 to decode */
    m.lease_ms = r->p.lease_ms;
    int rc = kvx_send_msg(r->sock, id, id_len, &m, NULL, 0);
    if (rc < 0)
        log_rinfo(rid, "kvx: %s xfer=%llx not sent: %s", proto_type_str(type),
                  (unsigned long long)xfer, zmq_strerror(errno));
    if (sent)
        *sent = rc == 0;
}

static void rx_reply(kvx_receiver_t *r, const void *id, size_t id_len, proto_type_t type,
                     uint64_t rid, uint64_t xfer, int ok, int code, const char *msg, int *sent)
{
    rx_reply_have(r, id, id_len, type, rid, xfer, ok, code, msg, 0, sent);
}

static void rx_unlink(kvx_receiver_t *r, kvx_rx *x)
{
    for (kvx_rx **xp = &r->xfers; *xp; xp = &(*xp)->next) {
        if (*xp == x) {
            *xp = x->next;
            r->n_xfers--;
            return;
        }
    }
}

/* Drop a transfer in progress: free its blocks, optionally tell the sender (KV_ABORT, or
 * KV_RESULT NACK when answering KV_END), optionally report an event. */
static void rx_drop(kvx_receiver_t *r, kvx_rx *x, proto_type_t reply, int code, const char *msg,
                    int report)
{
    log_rinfo(x->rid, "kvx: transfer xfer=%llx dropped: %s (%s)", (unsigned long long)x->xfer,
              proto_err_str(code), msg);
    if (code == PROTO_ERR_TIMEOUT)
        r->st.n_timeouts++;
    else if (code == PROTO_ERR_CANCELLED)
        r->st.n_cancelled++;
    else
        r->st.n_aborted++;
    if (reply)
        rx_reply(r, x->id, x->id_len, reply, x->rid, x->xfer, 0, code, msg, NULL);
    if (report) {
        kvx_event ev;
        kvx_ev_init(&ev, KVX_EV_FAILED, x->rid, x->xfer, code, msg);
        kvx_evq_push(&r->events, &ev);
    }
    rx_unlink(r, x);
    rx_free(r, x, 1);
}

static kvx_rx *rx_find(const kvx_receiver_t *r, uint64_t xfer)
{
    for (kvx_rx *x = r->xfers; x; x = x->next)
        if (x->xfer == xfer)
            return x;
    return NULL;
}

static void rx_begin(kvx_receiver_t *r, const unsigned char *id, size_t id_len, const proto_msg *m)
{
    const kvcache_params *kp = kvcache_get_params(r->kv);
    char why[PROTO_MESSAGE_LEN];
    int code = PROTO_ERR_NONE;
    kvx_rx *old = rx_find(r, m->xfer);
    if (old) {
        if (old->id_len == id_len && memcmp(old->id, id, id_len) == 0)
            rx_drop(r, old, 0, PROTO_ERR_PROTOCOL, "duplicate KV_BEGIN", 1);
        rx_reply(r, id, id_len, PROTO_KV_BEGIN_ACK, m->rid, m->xfer, 0, PROTO_ERR_PROTOCOL,
                 "transfer id already in use", NULL);
        r->st.n_rejected++;
        return;
    }
    for (kvx_rx *x = r->xfers; x; x = x->next) {
        if (x->rid == m->rid) { /* a re-run of the request supersedes the old transfer */
            rx_drop(r, x, PROTO_KV_ABORT, PROTO_ERR_CANCELLED, "superseded by a new transfer", 1);
            break;
        }
    }
    if (!r->accepting) {
        code = PROTO_ERR_UNAVAILABLE;
        snprintf(why, sizeof(why), "receiver is not accepting transfers");
    } else if (m->fingerprint != r->p.fingerprint) {
        code = PROTO_ERR_LAYOUT;
        snprintf(why, sizeof(why), "model fingerprint %016llx, want %016llx",
                 (unsigned long long)m->fingerprint, (unsigned long long)r->p.fingerprint);
    } else if (m->n_mtp >= m->n_layer || m->n_layer - m->n_mtp != kp->n_layer - r->p.n_mtp ||
               m->n_kv_head != kp->n_kv_head || m->head_dim != kp->head_dim ||
               m->block_size != kp->block_size || m->dtype != PROTO_DTYPE_F32) {
        /* the main layers must match; MTP module layers are optional (see below) */
        code = PROTO_ERR_LAYOUT;
        snprintf(why, sizeof(why),
                 "layout main layers=%d n_kv_head=%d head_dim=%d bs=%d dtype=%d, want %d %d %d "
                 "%d %d",
                 m->n_layer - m->n_mtp, m->n_kv_head, m->head_dim, m->block_size, m->dtype,
                 kp->n_layer - r->p.n_mtp, kp->n_kv_head, kp->head_dim, kp->block_size,
                 PROTO_DTYPE_F32);
    } else if (m->n_kv_tokens > kp->max_seq_len) {
        code = PROTO_ERR_BAD_REQUEST;
        snprintf(why, sizeof(why), "%d tokens exceed the context of %d", m->n_kv_tokens,
                 kp->max_seq_len);
    } else if (m->n_blocks != kvcache_blocks_for(r->kv, m->n_kv_tokens)) {
        code = PROTO_ERR_PROTOCOL;
        snprintf(why, sizeof(why), "n_blocks %d does not match %d tokens", m->n_blocks,
                 m->n_kv_tokens);
    } else if (m->pad_bytes > 0 && m->n_blocks > PROTO_MAX_FRAMES - 1) {
        code = PROTO_ERR_PROTOCOL; /* a whole layer and its padding frame must fit */
        snprintf(why, sizeof(why), "padded transfer of %d blocks: at most %d", m->n_blocks,
                 PROTO_MAX_FRAMES - 1);
    } else if (m->n_bhash > 0 &&
               (m->n_gen > 0 || m->n_tokens != m->n_kv_tokens ||
                (long long)m->n_bhash * kp->block_size + m->block_lookahead > m->n_kv_tokens ||
                m->block_lookahead > m->n_mtp)) {
        /* listed blocks are full prompt blocks whose key (their tokens and the lookahead
         * after them) the prompt's ids hold; the lookahead is the module depth written */
        code = PROTO_ERR_PROTOCOL;
        snprintf(why, sizeof(why),
                 "%d block hashes (lookahead %d, %d module layers) with %d token ids for %d "
                 "tokens%s",
                 m->n_bhash, m->block_lookahead, m->n_mtp, m->n_tokens, m->n_kv_tokens,
                 m->n_gen > 0 ? " in a migration" : "");
    }
    if (code) {
        log_rinfo(m->rid, "kvx: KV_BEGIN xfer=%llx rejected: %s", (unsigned long long)m->xfer, why);
        rx_reply(r, id, id_len, PROTO_KV_BEGIN_ACK, m->rid, m->xfer, 0, code, why, NULL);
        r->st.n_rejected++;
        return;
    }
    /* MTP module layers and the hand-off state are kept when they are what our modules
     * would compute; otherwise they are received (checksummed) and dropped, and the
     * sequence decodes without MTP */
    int hid_ok = (m->n_hidden == r->p.n_hidden && r->p.n_hidden > 0) ||
                 (m->n_gen > 0 && m->n_hidden == r->p.n_hidden_mig && r->p.n_hidden_mig > 0);
    int keep_mtp = m->n_mtp > 0 && m->n_mtp <= r->p.n_mtp && m->mtp_fp == r->p.mtp_fp && hid_ok;
    /* Prefix caching: the listed blocks' hashes must be the ones our own chain gives their
     * ids (the seed is ours: the model's fingerprint and, when module K/V is in the blocks,
     * our modules' with the lookahead as depth). A block whose module layers we would not
     * store is not shareable: such a transfer is not cached. */
    int pfx = r->p.prefix_cache && m->n_bhash > 0 && (m->n_mtp == 0 ? m->block_lookahead == 0
                                                                     : keep_mtp &&
                                                                           m->block_lookahead > 0);
    uint64_t seed = 0;
    if (pfx) {
        seed = kvcache_prefix_seed_mtp(r->p.fingerprint, m->block_lookahead ? r->p.mtp_fp : 0,
                                       m->block_lookahead);
        uint64_t *hs = malloc((size_t)m->n_bhash * sizeof(uint64_t));
        int n = hs ? kvcache_prefix_hashes(r->kv, seed, m->block_lookahead, m->tokens,
                                           m->n_tokens, m->n_bhash, hs)
                   : 0;
        int bad = -1;
        for (int k = 0; hs && k < m->n_bhash && bad < 0; k++)
            if (k >= n || hs[k] != m->bhash[k])
                bad = k;
        free(hs);
        if (!hs || bad >= 0) {
            code = hs ? PROTO_ERR_PROTOCOL : PROTO_ERR_INTERNAL;
            if (hs)
                snprintf(why, sizeof(why), "block hash %d (%016llx) does not match its token ids",
                         bad, (unsigned long long)m->bhash[bad]);
            else
                snprintf(why, sizeof(why), "out of memory");
            log_rinfo(m->rid, "kvx: KV_BEGIN xfer=%llx rejected: %s", (unsigned long long)m->xfer,
                      why);
            rx_reply(r, id, id_len, PROTO_KV_BEGIN_ACK, m->rid, m->xfer, 0, code, why, NULL);
            r->st.n_rejected++;
            return;
        }
    }
    /* On demand (vLLM's rule): the transferred tokens plus the first decode step's headroom;
     * the decode role reserves the rest step by step and preempts when blocks run out. The
     * watermark keeps room for the running sequences to grow, except in an empty cache.
     * Blocks already cached (shared from the prefix cache, pinned by this sequence) need no
     * new block. */
    long long want = (long long)m->n_kv_tokens + r->p.headroom_tokens;
    int n_tokens = want > kp->max_seq_len ? kp->max_seq_len : (int)want;
    int n_free0 = kvcache_n_free_blocks(r->kv);
    int seq = kvcache_seq_new(r->kv), have = 0;
    if (seq >= 0 && pfx) {
        int got = kvcache_seq_attach_prefix(r->kv, seq, seed, m->block_lookahead, m->tokens,
                                            m->n_tokens, m->n_bhash * kp->block_size);
        have = got > 0 ? got / kp->block_size : 0;
    }
    int n_free = kvcache_n_free_blocks(r->kv);
    int wm = seq >= 0 && n_free0 < kvcache_n_blocks(r->kv) &&
             n_free - (kvcache_blocks_for(r->kv, n_tokens) - have) < r->p.watermark_blocks;
    kvcache_status_t st =
        seq < 0 || wm ? KVCACHE_NOSPACE : kvcache_seq_reserve(r->kv, seq, n_tokens);
    if (st != KVCACHE_OK) {
        if (seq >= 0)
            kvcache_seq_free(r->kv, seq); /* shared blocks go back to the cache */
        snprintf(why, sizeof(why), "%s: %d tokens need %d blocks, %d free (watermark %d)",
                 wm ? "below the watermark"
                    : seq < 0 ? "no free sequence slot" : kvcache_status_str(st),
                 n_tokens, kvcache_blocks_for(r->kv, n_tokens), n_free, r->p.watermark_blocks);
        code = st == KVCACHE_ERR ? PROTO_ERR_BAD_REQUEST : PROTO_ERR_NOSPACE;
        log_rinfo(m->rid, "kvx: KV_BEGIN xfer=%llx rejected: %s", (unsigned long long)m->xfer, why);
        rx_reply(r, id, id_len, PROTO_KV_BEGIN_ACK, m->rid, m->xfer, 0, code, why, NULL);
        r->st.n_rejected++;
        return;
    }
    kvx_rx *x = calloc(1, sizeof(*x));
    if (x) {
        x->got = calloc(((size_t)m->n_layer * (size_t)m->n_blocks + 7) / 8, 1);
        x->hash = XXH64_createState();
        x->ids = pfx ? malloc((size_t)m->n_tokens * sizeof(int)) : NULL;
    }
    if (!x || !x->got || !x->hash || (pfx && !x->ids) || id_len > sizeof(x->id)) {
        if (x)
            rx_free(r, x, 0);
        kvcache_seq_free(r->kv, seq);
        rx_reply(r, id, id_len, PROTO_KV_BEGIN_ACK, m->rid, m->xfer, 0, PROTO_ERR_INTERNAL,
                 "out of memory", NULL);
        r->st.n_rejected++;
        return;
    }
    XXH64_reset(x->hash, 0);
    x->xfer = m->xfer;
    x->rid = m->rid;
    memcpy(x->id, id, id_len);
    x->id_len = id_len;
    x->seq = seq;
    x->n_kv_tokens = m->n_kv_tokens;
    x->n_blocks = m->n_blocks;
    x->pad = (uint64_t)m->pad_bytes;
    x->n_layer = m->n_layer;
    x->n_main = m->n_layer - m->n_mtp;
    x->n_hidden = m->n_hidden;
    x->mtp = m->mtp_depth;
    x->n_gen = m->n_gen;
    x->priority = m->priority;
    x->logprobs = m->logprobs;
    x->keep_mtp = keep_mtp;
    if (pfx) {
        memcpy(x->ids, m->tokens, (size_t)m->n_tokens * sizeof(int));
        x->n_ids = m->n_tokens;
        x->pfx = 1;
        x->pfx_seed = seed;
        x->pfx_la = m->block_lookahead;
        x->have = have;
        for (int l = 0; l < x->n_layer; l++) /* the shared blocks count as arrived */
            for (int b = 0; b < have; b++) {
                size_t bit = (size_t)l * (size_t)x->n_blocks + (size_t)b;
                x->got[bit / 8] |= (uint8_t)(1u << (bit % 8));
            }
        x->n_got = have * x->n_layer;
    }
    if (m->n_mtp > 0 && !x->keep_mtp)
        log_rinfo(m->rid, "kvx: KV_BEGIN xfer=%llx: its %d MTP module layers (fingerprint "
                  "%016llx, %d hand-off floats) do not match ours (%d, %016llx, %d): dropped",
                  (unsigned long long)m->xfer, m->n_mtp, (unsigned long long)m->mtp_fp,
                  m->n_hidden, r->p.n_mtp, (unsigned long long)r->p.mtp_fp, r->p.n_hidden);
    if (m->samp) { /* the sequence's penalties count its tokens so far */
        x->samp = malloc(sizeof(*x->samp));
        x->hist = m->n_tokens ? malloc((size_t)m->n_tokens * sizeof(int)) : NULL;
        if (!x->samp || (m->n_tokens && !x->hist)) {
            rx_reply(r, id, id_len, PROTO_KV_BEGIN_ACK, m->rid, m->xfer, 0, PROTO_ERR_INTERNAL,
                     "out of memory", NULL);
            r->st.n_rejected++;
            rx_free(r, x, 1);
            return;
        }
        memcpy(x->samp, m->samp, sizeof(*x->samp));
        if (m->n_tokens)
            memcpy(x->hist, m->tokens, (size_t)m->n_tokens * sizeof(int));
        x->n_hist = m->n_tokens;
    }
    x->max_tokens = m->max_tokens;
    x->temperature = m->temperature;
    x->top_p = m->top_p;
    x->top_k = m->top_k;
    x->deadline_us = kvx_deadline_after(r->p.lease_ms);
    x->t0_us = proto_now_us();
    int sent = 0;
    rx_reply_have(r, id, id_len, PROTO_KV_BEGIN_ACK, m->rid, m->xfer, 1, 0, "", have, &sent);
    if (!sent) {
        r->st.n_aborted++; /* accepted, but the sender cannot know: it times out */
        rx_free(r, x, 1);
        return;
    }
    x->next = r->xfers;
    r->xfers = x;
    r->n_xfers++;
    log_rdebug(x->rid,
               "kvx: KV_BEGIN xfer=%llx accepted: %d tokens, seq %d reserved for %d, %llu "
               "bytes of padding, %d of %d listed blocks cached here",
               (unsigned long long)x->xfer, x->n_kv_tokens, seq, n_tokens,
               (unsigned long long)x->pad, have, m->n_bhash);
}

static int rx_got(const kvx_rx *x, int layer, int blk)
{
    size_t bit = (size_t)layer * (size_t)x->n_blocks + (size_t)blk;
    return (x->got[bit / 8] >> (bit % 8)) & 1;
}

static void rx_layer(kvx_receiver_t *r, kvx_rx *x, const proto_msg *m, wire_envelope *e)
{
    char why[PROTO_MESSAGE_LEN];
    int n_frames = wire_envelope_n_frames(e);
    size_t bytes = kvcache_block_bytes(r->kv);
    int b0 = m->blk0, nb = m->n_blocks;
    int n_pad = x->pad ? 1 : 0; /* a padded transfer: one padding frame after the blocks */
    why[0] = 0;
    if (m->layer < 0 || m->layer >= x->n_layer)
        snprintf(why, sizeof(why), "layer %d out of range", m->layer);
    else if (nb < 1 || n_frames != nb + n_pad)
        snprintf(why, sizeof(why), "layer %d: n_blocks %d with %d frames (%d padding)", m->layer,
                 nb, n_frames, n_pad);
    else if (b0 < 0 || b0 > x->n_blocks - nb)
        snprintf(why, sizeof(why), "layer %d: blocks [%d, %d) out of range: the transfer has %d",
                 m->layer, b0, b0 + nb, x->n_blocks);
    for (int i = 0; i < nb && !why[0]; i++)
        if (rx_got(x, m->layer, b0 + i))
            snprintf(why, sizeof(why), "layer %d: block %d sent twice", m->layer, b0 + i);
    for (int i = 0; i < nb && !why[0]; i++) {
        size_t n = zmq_msg_size(wire_envelope_frame(e, i));
        if (n != bytes)
            snprintf(why, sizeof(why), "layer %d frame %d: %zu bytes, want %zu", m->layer, i, n,
                     bytes);
    }
    /* the padding frame: exactly this range's share of KV_BEGIN's pad (docs/kvtransfer.md
     * "Padding"); counted, never read */
    uint64_t pad = 0;
    if (n_pad && !why[0]) {
        pad = kvx_pad_bytes(x->pad, x->n_layer, x->n_blocks, m->layer, b0, nb);
        size_t n = zmq_msg_size(wire_envelope_frame(e, nb));
        if ((uint64_t)n != pad)
            snprintf(why, sizeof(why), "layer %d blocks [%d, %d): padding frame of %zu bytes, "
                     "want %llu",
                     m->layer, b0, b0 + nb, n, (unsigned long long)pad);
    }
    if (why[0]) {
        rx_drop(r, x, PROTO_KV_ABORT, PROTO_ERR_PROTOCOL, why, 1);
        return;
    }
    const int *blocks = kvcache_seq_blocks(r->kv, x->seq, NULL);
    int store = m->layer < x->n_main || x->keep_mtp; /* module layers: see rx_begin */
    for (int i = 0; i < nb; i++) {
        const void *src = zmq_msg_data(wire_envelope_frame(e, i));
        XXH64_update(x->hash, src, bytes);
        if (store)
            memcpy(kvcache_block_data(r->kv, m->layer, blocks[b0 + i]), src, bytes);
        size_t bit = (size_t)m->layer * (size_t)x->n_blocks + (size_t)(b0 + i);
        x->got[bit / 8] |= (uint8_t)(1u << (bit % 8));
    }
    x->n_got += nb;
    x->n_bytes += (uint64_t)nb * bytes + pad;
    x->deadline_us = kvx_deadline_after(r->p.lease_ms);
}

static void rx_end(kvx_receiver_t *r, kvx_rx *x, const proto_msg *m, wire_envelope *e)
{
    char why[PROTO_MESSAGE_LEN];
    if (x->n_got != x->n_layer * x->n_blocks) {
        int l = 0, b = 0; /* the first block missing, for the log */
        for (int i = 0; i < x->n_layer * x->n_blocks; i++) {
            if (!rx_got(x, i / x->n_blocks, i % x->n_blocks)) {
                l = i / x->n_blocks;
                b = i % x->n_blocks;
                break;
            }
        }
        snprintf(why, sizeof(why),
                 "KV_END after %d of %d blocks (%d layers of %d): layer %d "
                 "block %d missing",
                 x->n_got, x->n_layer * x->n_blocks, x->n_layer, x->n_blocks, l, b);
        rx_drop(r, x, PROTO_KV_RESULT, PROTO_ERR_PROTOCOL, why, 1);
        return;
    }
    /* the MTP hand-off state: exactly one frame of n_hidden floats when announced */
    int n_frames = wire_envelope_n_frames(e);
    size_t hbytes = (size_t)x->n_hidden * sizeof(float);
    const void *hsrc = NULL;
    if (n_frames != (x->n_hidden ? 1 : 0) ||
        (n_frames && zmq_msg_size(wire_envelope_frame(e, 0)) != hbytes)) {
        snprintf(why, sizeof(why), "KV_END with %d payload frames (%zu bytes), want %d (%zu)",
                 n_frames, n_frames ? zmq_msg_size(wire_envelope_frame(e, 0)) : 0,
                 x->n_hidden ? 1 : 0, hbytes);
        rx_drop(r, x, PROTO_KV_RESULT, PROTO_ERR_PROTOCOL, why, 1);
        return;
    }
    if (n_frames) {
        hsrc = zmq_msg_data(wire_envelope_frame(e, 0));
        XXH64_update(x->hash, hsrc, hbytes);
        x->n_bytes += hbytes; /* payload bytes, as the sender counts them */
    }
    uint64_t sum = XXH64_digest(x->hash);
    if (sum != m->checksum) {
        snprintf(why, sizeof(why), "checksum %016llx, want %016llx", (unsigned long long)sum,
                 (unsigned long long)m->checksum);
        rx_drop(r, x, PROTO_KV_RESULT, PROTO_ERR_CHECKSUM, why, 1);
        return;
    }
    int sent = 0;
    rx_reply(r, x->id, x->id_len, PROTO_KV_RESULT, x->rid, x->xfer, 1, 0, "", &sent);
    if (!sent) { /* the sender would report a failure and the gateway re-run the request */
        rx_drop(r, x, 0, PROTO_ERR_UNAVAILABLE, "KV_RESULT could not be sent", 1);
        return;
    }
    kvcache_seq_set_len(r->kv, x->seq, x->n_kv_tokens);
    if (x->pfx) /* the received full blocks are final: later transfers share them */
        kvcache_seq_commit_prefix(r->kv, x->seq, x->pfx_seed, x->pfx_la, x->ids, x->n_ids);
    kvx_event ev;
    kvx_ev_init(&ev, KVX_EV_ACCEPTED, x->rid, x->xfer, PROTO_ERR_NONE, "");
    ev.seq = x->seq;
    ev.n_kv_tokens = x->n_kv_tokens;
    ev.first_token = m->first_token;
    ev.rng = m->rng;
    ev.max_tokens = x->max_tokens;
    ev.temperature = x->temperature;
    ev.top_p = x->top_p;
    ev.top_k = x->top_k;
    ev.xfer_us = proto_now_us() - x->t0_us;
    ev.queue_us = m->queue_us;
    ev.prefill_us = m->prefill_us;
    ev.n_bytes = x->n_bytes;
    ev.mtp = x->mtp;
    ev.n_gen = x->n_gen;
    ev.priority = x->priority;
    ev.logprobs = x->logprobs;
    ev.samp = x->samp; /* moved to the event */
    ev.hist = x->hist;
    ev.n_hist = x->n_hist;
    x->samp = NULL;
    x->hist = NULL;
    ev.pfx = x->pfx;
    ev.ids = x->ids; /* moved to the event */
    ev.n_ids = x->n_ids;
    ev.pfx_seed = x->pfx_seed;
    ev.pfx_la = x->pfx_la;
    ev.have_blocks = x->have;
    x->ids = NULL;
    if (x->keep_mtp && hsrc) {
        ev.hidden = malloc(hbytes);
        if (ev.hidden) { /* out of memory: the sequence just decodes without MTP */
            memcpy(ev.hidden, hsrc, hbytes);
            ev.n_hidden = x->n_hidden;
            ev.mtp_ok = 1;
        }
    }
    r->st.n_ok++;
    r->st.n_bytes += x->n_bytes;
    r->st.total_us += (uint64_t)ev.xfer_us;
    log_rdebug(x->rid, "kvx: transfer xfer=%llx complete: seq %d, %d tokens",
               (unsigned long long)x->xfer, x->seq, x->n_kv_tokens);
    if (kvx_evq_push(&r->events, &ev) < 0) {
        free(ev.hidden);
        free(ev.samp);
        free(ev.hist);
        free(ev.ids);
        rx_unlink(r, x);
        rx_free(r, x, 1);
        return;
    }
    rx_unlink(r, x);
    rx_free(r, x, 0); /* the sequence now belongs to the caller */
}

static void receiver_handle(kvx_receiver_t *r, wire_envelope *e)
{
    const proto_msg *m = wire_envelope_msg(e);
    size_t id_len;
    const unsigned char *id = wire_envelope_identity(e, &id_len);
    if (m->type == PROTO_KV_BEGIN) {
        if (wire_envelope_n_frames(e) != 0) {
            log_rwarn(m->rid, "kvx: dropped KV_BEGIN with payload frames");
            return;
        }
        rx_begin(r, id, id_len, m);
        return;
    }
    if (m->type != PROTO_KV_LAYER && m->type != PROTO_KV_END && m->type != PROTO_KV_ABORT) {
        log_rwarn(m->rid, "kvx: dropped unexpected %s on the kv ROUTER", proto_type_str(m->type));
        return;
    }
    kvx_rx *x = rx_find(r, m->xfer);
    if (!x) {
        log_rdebug(m->rid, "kvx: dropped %s for unknown or aborted xfer=%llx",
                   proto_type_str(m->type), (unsigned long long)m->xfer);
        return;
    }
    if (x->id_len != id_len || memcmp(x->id, id, id_len) != 0) {
        log_rwarn(m->rid, "kvx: dropped %s for xfer=%llx from another peer",
                  proto_type_str(m->type), (unsigned long long)m->xfer);
        return;
    }
    if (x->rid != m->rid) {
        rx_drop(r, x, PROTO_KV_ABORT, PROTO_ERR_PROTOCOL, "request id changed mid-transfer", 1);
        return;
    }
    switch (m->type) {
    case PROTO_KV_LAYER:
        rx_layer(r, x, m, e);
        return;
    case PROTO_KV_END:
        rx_end(r, x, m, e);
        return;
    default: /* KV_ABORT */
        rx_drop(r, x, 0, m->code ? m->code : PROTO_ERR_CANCELLED,
                m->message[0] ? m->message : "aborted by the sender", 1);
        return;
    }
}

int kvx_receiver_process(kvx_receiver_t *r)
{
    int before = r->events.n;
    for (int i = 0; i < KVX_MAX_MSGS_PER_CALL; i++) {
        int rc = wire_recv(r->sock, 1, r->env, ZMQ_DONTWAIT);
        if (rc == 0)
            break;
        if (rc == -2) {
            log_warn("kvx: recv on the kv ROUTER: %s", zmq_strerror(errno));
            break;
        }
        if (rc == 1)
            receiver_handle(r, r->env);
        wire_envelope_reset(r->env); /* release the frames (zero-copy pins on inproc) */
    }
    int64_t now = proto_now_us();
    for (kvx_rx *x = r->xfers, *n; x; x = n) {
        n = x->next;
        if (now >= x->deadline_us)
            rx_drop(r, x, PROTO_KV_ABORT, PROTO_ERR_TIMEOUT, "no progress within the lease", 1);
    }
    return r->events.n - before;
}

int kvx_receiver_next_timeout_ms(const kvx_receiver_t *r)
{
    int64_t now = proto_now_us();
    int best = -1;
    for (const kvx_rx *x = r->xfers; x; x = x->next) {
        int t = kvx_ms_until(x->deadline_us, now);
        if (best < 0 || t < best)
            best = t;
    }
    return best;
}

int kvx_receiver_next_event(kvx_receiver_t *r, kvx_event *ev)
{
    return kvx_evq_pop(&r->events, ev);
}

int kvx_receiver_abort(kvx_receiver_t *r, uint64_t rid)
{
    for (kvx_rx *x = r->xfers; x; x = x->next) {
        if (x->rid == rid) {
            rx_drop(r, x, PROTO_KV_ABORT, PROTO_ERR_CANCELLED, "cancelled", 0);
            return 1;
        }
    }
    return 0;
}

int kvx_receiver_n_active(const kvx_receiver_t *r)
{
    return r->n_xfers;
}

void kvx_receiver_get_stats(const kvx_receiver_t *r, proto_kvx_counters *out)
{
    *out = r->st;
}
