/*
 * fuzz_kvx: the KV receiver (kvtransfer/kvx_receiver.c): KV_BEGIN / KV_LAYER / KV_END /
 * KV_ABORT handling, driven through its real kv ROUTER by two DEALER peers on inproc.
 *
 * The input is a program of operations, so that the fuzzer reaches deep states (a whole
 * transfer, chunked layers, MTP layers, padding, checksums) instead of spending itself on
 * msgpack syntax. Each operation is an opcode byte followed by its argument bytes (missing
 * bytes read as 0):
 *   0 raw     peer, u8 length, header bytes, u8 frames, each u8 length + bytes
 *   1 begin   peer, xfer, rid, tokens, flags (bit: wrong fp/bs/n_blocks, MTP layer, hand-off
 *             state, migrated, padding, accepting off), max_tokens
 *   2 layer   peer, xfer, rid, layer, blk0, n_blocks, flags (bit: wrong frame size, no or
 *             bad padding frame), a byte that fills the blocks
 *   3 end     peer, xfer, rid, flags (bit: wrong checksum, no or bad hand-off frame)
 *   4 abort   peer, xfer, rid, code
 *   5 process run kvx_receiver_process, then take its events and the peers' replies
 *   6 cancel  rid (kvx_receiver_abort)
 *   7 pbegin  peer, xfer, rid, tokens, flags (bit: a wrong hash, lookahead 1 with the MTP
 *             layer, one id too few, hashes past the full blocks, migrated), id base: a
 *             KV_BEGIN listing its full blocks' prefix-cache hashes with its ids (the
 *             receiver caches: later ones share what earlier ones left, and their layers
 *             for shared blocks are refused as sent twice)
 * The harness keeps, per transfer id, the XXH64 a real sender would send, so KV_END can be
 * right. Properties: no crash, leak or undefined behaviour; every reply decodes; an
 * accepted sequence is active with the length announced, and its prompt ids come with it
 * exactly when its hashes were used; once the caller has freed the accepted sequences and
 * destroyed the receiver, every KV block is free again (cached ones count as free; the
 * cache is flushed between inputs).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>
#include <zmq.h>

#include "fuzz_common.h"
#include "kvcache.h"
#include "kvtransfer.h"
#include "kvx_internal.h"
#include "protocol.h"
#include "wire.h"

enum { N_LAYER = 3, N_MTP = 1, KV_HEADS = 1, HEAD_DIM = 2, BS = 2, N_BLOCKS = 8, MAX_SEQS = 3,
       MAX_LEN = 8, N_HIDDEN = 4, N_XFER = 4 };
#define FP 0x1234u
#define MTP_FP 0x55u

static void *g_zctx;
static wire_envelope *g_env;

typedef struct {
    const uint8_t *p;
    size_t n, pos;
} reader;

static unsigned rd(reader *r)
{
    return r->pos < r->n ? r->p[r->pos++] : 0;
}

typedef struct {
    kvcache_t *kv;
    kvx_receiver_t *r;
    void *peer[2];
    XXH64_state_t *hash[N_XFER + 1]; /* the checksum a sender of xfer i would send */
    int n_layer[N_XFER + 1], n_blocks[N_XFER + 1], n_hidden[N_XFER + 1];
    int64_t pad[N_XFER + 1];
    int owner[N_XFER + 1]; /* the peer that began it: the receiver ignores the other one */
    int accepted[MAX_SEQS * 4];
    int n_accepted;
} state;

static void send_msg(state *s, int peer, const proto_msg *m, zmq_msg_t *frames, int n)
{
    /* a full queue is a state the receiver must live with: drop quietly */
    (void)wire_send(s->peer[peer], NULL, 0, m, frames, n, ZMQ_DONTWAIT);
}

static void frame_of(zmq_msg_t *f, size_t n, int fill)
{
    FUZZ_CHECK(zmq_msg_init_size(f, n) == 0);
    memset(zmq_msg_data(f), fill, n);
}

static void take_events(state *s)
{
    kvx_event ev;
    while (kvx_receiver_next_event(s->r, &ev)) {
        if (ev.type == KVX_EV_ACCEPTED) {
            FUZZ_CHECK(kvcache_seq_active(s->kv, ev.seq));
            FUZZ_CHECK(kvcache_seq_len(s->kv, ev.seq) == ev.n_kv_tokens);
            FUZZ_CHECK(ev.mtp_ok ? ev.hidden != NULL && ev.n_hidden > 0 : ev.hidden == NULL);
            FUZZ_CHECK(s->n_accepted < (int)(sizeof(s->accepted) / sizeof(s->accepted[0])));
            FUZZ_CHECK(ev.pfx ? ev.ids != NULL && ev.n_ids == ev.n_kv_tokens
                              : ev.ids == NULL && ev.have_blocks == 0);
            FUZZ_CHECK(ev.have_blocks * BS <= ev.n_kv_tokens);
            s->accepted[s->n_accepted++] = ev.seq;
            free(ev.hidden);
            free(ev.ids);
        } else {
            FUZZ_CHECK(ev.type == KVX_EV_FAILED && ev.hidden == NULL && ev.ids == NULL);
        }
    }
    /* what the real owner does with an accepted sequence once it has decoded it */
    while (s->n_accepted > 0)
        kvcache_seq_free(s->kv, s->accepted[--s->n_accepted]);
    for (int p = 0; p < 2; p++) {
        int rc;
        while ((rc = wire_recv(s->peer[p], 0, g_env, ZMQ_DONTWAIT)) != 0) {
            FUZZ_CHECK(rc == 1); /* every reply of the receiver is well-formed */
            wire_envelope_reset(g_env);
        }
    }
}

static void op_raw(state *s, reader *in)
{
    int peer = rd(in) & 1;
    size_t hl = rd(in);
    uint8_t hdr[256];
    for (size_t i = 0; i < hl; i++)
        hdr[i] = (uint8_t)rd(in);
    int nf = (int)(rd(in) % 8);
    if (zmq_send(s->peer[peer], hdr, hl, ZMQ_DONTWAIT | (nf ? ZMQ_SNDMORE : 0)) < 0)
        return;
    for (int f = 0; f < nf; f++) {
        uint8_t b[256];
        size_t n = rd(in);
        for (size_t i = 0; i < n; i++)
            b[i] = (uint8_t)rd(in);
        zmq_send(s->peer[peer], b, n, f + 1 < nf ? ZMQ_SNDMORE : 0);
    }
}

static void op_begin(state *s, reader *in)
{
    int peer = rd(in) & 1;
    int xfer = 1 + (int)(rd(in) % N_XFER);
    proto_msg m;
    proto_msg_init(&m, PROTO_KV_BEGIN);
    m.xfer = (uint64_t)xfer;
    m.rid = 1 + rd(in) % 4;
    m.n_kv_tokens = 1 + (int)(rd(in) % (MAX_LEN + 2));
    unsigned fl = rd(in);
    m.max_tokens = 1 + (int)(rd(in) % 8);
    m.fingerprint = (fl & 1) ? FP + 1 : FP;
    m.block_size = (fl & 2) ? BS + 1 : BS;
    m.n_blocks = (m.n_kv_tokens + BS - 1) / BS + ((fl & 4) ? 1 : 0);
    m.n_mtp = (fl & 8) ? N_MTP : 0;
    m.n_layer = N_LAYER - N_MTP + m.n_mtp;
    m.mtp_fp = (fl & 8) ? MTP_FP : 0;
    m.n_hidden = (fl & 16) ? N_HIDDEN : 0;
    m.n_gen = (fl & 32) ? 2 : 0;
    m.pad_bytes = (fl & 64) ? 1000 : 0;
    m.n_kv_head = KV_HEADS;
    m.head_dim = HEAD_DIM;
    m.dtype = PROTO_DTYPE_F32;
    m.lease_ms = 5000;
    m.temperature = 1.0f;
    m.top_p = 1.0f;
    kvx_receiver_set_accepting(s->r, !(fl & 128));
    send_msg(s, peer, &m, NULL, 0);
    XXH64_reset(s->hash[xfer], 0);
    s->owner[xfer] = peer;
    s->n_layer[xfer] = m.n_layer;
    s->n_blocks[xfer] = m.n_blocks;
    s->n_hidden[xfer] = m.n_hidden;
    s->pad[xfer] = m.pad_bytes;
}

static void op_pbegin(state *s, reader *in)
{
    int peer = rd(in) & 1;
    int xfer = 1 + (int)(rd(in) % N_XFER);
    proto_msg m;
    proto_msg_init(&m, PROTO_KV_BEGIN);
    m.xfer = (uint64_t)xfer;
    m.rid = 1 + rd(in) % 4;
    m.n_kv_tokens = 1 + (int)(rd(in) % (MAX_LEN + 2));
    unsigned fl = rd(in);
    int base = (int)(rd(in) % 4); /* prompts of one base share their ids */
    int la = (fl & 2) ? 1 : 0;
    m.max_tokens = 4;
    m.fingerprint = FP;
    m.block_size = BS;
    m.n_blocks = (m.n_kv_tokens + BS - 1) / BS;
    m.n_mtp = la ? N_MTP : 0;
    m.n_layer = N_LAYER - N_MTP + m.n_mtp;
    m.mtp_fp = la ? MTP_FP : 0;
    m.n_hidden = la ? N_HIDDEN : 0;
    m.n_gen = (fl & 16) ? 2 : 0;
    m.n_kv_head = KV_HEADS;
    m.head_dim = HEAD_DIM;
    m.dtype = PROTO_DTYPE_F32;
    m.lease_ms = 5000;
    m.top_p = 1.0f;
    int ids[MAX_LEN + 2];
    for (int i = 0; i < m.n_kv_tokens; i++)
        ids[i] = 10 * base + i;
    uint64_t hs[MAX_LEN];
    int n = kvcache_prefix_hashes(s->kv, kvcache_prefix_seed_mtp(FP, la ? MTP_FP : 0, la), la,
                                  ids, m.n_kv_tokens, MAX_LEN / BS, hs);
    if (fl & 8)
        hs[n++] = 7; /* one block past the full ones */
    if (n == 0)
        hs[n++] = 9;
    if (fl & 1)
        hs[0] ^= 1;
    m.bhash = hs;
    m.n_bhash = n;
    m.block_lookahead = la;
    m.tokens = ids;
    m.n_tokens = m.n_kv_tokens - ((fl & 4) ? 1 : 0);
    send_msg(s, peer, &m, NULL, 0);
    XXH64_reset(s->hash[xfer], 0);
    s->owner[xfer] = peer;
    s->n_layer[xfer] = m.n_layer;
    s->n_blocks[xfer] = m.n_blocks;
    s->n_hidden[xfer] = m.n_hidden;
    s->pad[xfer] = 0;
}

static void op_layer(state *s, reader *in)
{
    int peer = rd(in) & 1;
    int xfer = 1 + (int)(rd(in) % N_XFER);
    proto_msg m;
    proto_msg_init(&m, PROTO_KV_LAYER);
    m.xfer = (uint64_t)xfer;
    m.rid = 1 + rd(in) % 4;
    m.layer = (int)(rd(in) % (N_LAYER + 1));
    m.blk0 = (int)(rd(in) % (N_BLOCKS + 1));
    m.n_blocks = (int)(rd(in) % (N_BLOCKS + 1));
    unsigned fl = rd(in);
    int fill = (int)rd(in);
    size_t bytes = (size_t)BS * 2 * KV_HEADS * HEAD_DIM * sizeof(float);
    zmq_msg_t frames[N_BLOCKS + 1];
    int nf = 0;
    for (int i = 0; i < m.n_blocks; i++) {
        size_t n = (fl & 1) && i == 0 ? bytes - 4 : bytes;
        frame_of(&frames[nf++], n, fill + i);
        if (peer == s->owner[xfer])
            XXH64_update(s->hash[xfer], zmq_msg_data(&frames[nf - 1]), n);
    }
    if (s->pad[xfer] && !(fl & 2)) {
        uint64_t pad = kvx_pad_bytes((uint64_t)s->pad[xfer], s->n_layer[xfer], s->n_blocks[xfer],
                                     m.layer, m.blk0, m.n_blocks);
        frame_of(&frames[nf++], (size_t)pad + ((fl & 4) ? 1 : 0), 0);
    }
    send_msg(s, peer, &m, frames, nf);
}

static void op_end(state *s, reader *in)
{
    int peer = rd(in) & 1;
    int xfer = 1 + (int)(rd(in) % N_XFER);
    proto_msg m;
    proto_msg_init(&m, PROTO_KV_END);
    m.xfer = (uint64_t)xfer;
    m.rid = 1 + rd(in) % 4;
    unsigned fl = rd(in);
    m.first_token = 5;
    m.rng = 42;
    zmq_msg_t frames[1];
    int nf = 0;
    if (s->n_hidden[xfer] && !(fl & 2)) {
        size_t n = (size_t)s->n_hidden[xfer] * sizeof(float) + ((fl & 4) ? 4 : 0);
        frame_of(&frames[nf++], n, 0x3f);
        if (peer == s->owner[xfer])
            XXH64_update(s->hash[xfer], zmq_msg_data(&frames[0]), n);
    }
    m.checksum = XXH64_digest(s->hash[xfer]);
    if (fl & 1)
        m.checksum ^= 1;
    send_msg(s, peer, &m, frames, nf);
}

static void op_abort(state *s, reader *in)
{
    int peer = rd(in) & 1;
    proto_msg m;
    proto_msg_init(&m, PROTO_KV_ABORT);
    m.xfer = 1 + (uint64_t)(rd(in) % N_XFER);
    m.rid = 1 + rd(in) % 4;
    m.code = (int)(rd(in) % 10);
    snprintf(m.message, sizeof(m.message), "fuzz");
    send_msg(s, peer, &m, NULL, 0);
}

/* The receiver, its cache and the two peers live for the process (making them per input
 * costs more than the input); each input starts from an idle receiver with every block
 * free, and leaves it so (checked). */
static state g_s;
static unsigned long g_n_recv;

static void receiver_up(state *s)
{
    char ep[64];
    snprintf(ep, sizeof(ep), "inproc://fuzz-kvx-%lu", g_n_recv++);
    kvx_receiver_params p = kvx_receiver_default_params();
    p.fingerprint = FP;
    p.n_mtp = N_MTP;
    p.mtp_fp = MTP_FP;
    p.n_hidden = N_HIDDEN;
    p.n_hidden_mig = N_HIDDEN;
    p.prefix_cache = 1;
    s->r = kvx_receiver_new(g_zctx, s->kv, ep, &p);
    FUZZ_CHECK(s->r != NULL);
    for (int i = 0; i < 2; i++) {
        s->peer[i] = zmq_socket(g_zctx, ZMQ_DEALER);
        int linger = 0;
        char id[3] = {'p', (char)('0' + i), 0};
        FUZZ_CHECK(s->peer[i] != NULL);
        zmq_setsockopt(s->peer[i], ZMQ_LINGER, &linger, sizeof(linger));
        zmq_setsockopt(s->peer[i], ZMQ_ROUTING_ID, id, 2);
        FUZZ_CHECK(zmq_connect(s->peer[i], ep) == 0);
    }
}

static void receiver_down(state *s)
{
    kvx_receiver_destroy(&s->r);
    for (int i = 0; i < 2; i++)
        zmq_close(s->peer[i]);
}

static void setup(state *s)
{
    fuzz_quiet();
    g_zctx = zmq_ctx_new();
    g_env = wire_envelope_new();
    FUZZ_CHECK(g_zctx && g_env);
    kvcache_params kp = {N_LAYER, KV_HEADS, HEAD_DIM, BS, N_BLOCKS, MAX_SEQS, MAX_LEN};
    s->kv = kvcache_new(&kp);
    FUZZ_CHECK(s->kv != NULL);
    for (int x = 1; x <= N_XFER; x++) {
        s->hash[x] = XXH64_createState();
        FUZZ_CHECK(s->hash[x] != NULL);
    }
    receiver_up(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    state *s = &g_s;
    if (!s->kv)
        setup(s);
    for (int x = 1; x <= N_XFER; x++) {
        XXH64_reset(s->hash[x], 0);
        s->n_layer[x] = s->n_blocks[x] = s->n_hidden[x] = s->owner[x] = 0;
        s->pad[x] = 0;
    }
    kvx_receiver_set_accepting(s->r, 1);
    reader in = {data, size, 0};
    int n_ops = 0;
    while (in.pos < in.n && n_ops++ < 256) {
        switch (rd(&in) % 8) {
        case 0: op_raw(s, &in); break;
        case 1: op_begin(s, &in); break;
        case 2: op_layer(s, &in); break;
        case 3: op_end(s, &in); break;
        case 4: op_abort(s, &in); break;
        case 5:
            kvx_receiver_process(s->r);
            take_events(s);
            break;
        case 7: op_pbegin(s, &in); break;
        default: kvx_receiver_abort(s->r, 1 + rd(&in) % 4); break;
        }
    }
    kvx_receiver_process(s->r);
    take_events(s);
    /* back to idle: cancel what is in progress (the gateway's CANCEL does this); a transfer
     * under a request id the cancels do not reach (a raw header) costs a new receiver */
    for (uint64_t rid = 1; rid <= 4; rid++)
        while (kvx_receiver_abort(s->r, rid))
            ;
    take_events(s);
    if (kvx_receiver_n_active(s->r) > 0) {
        receiver_down(s);
        receiver_up(s);
    }
    FUZZ_CHECK(kvcache_n_free_blocks(s->kv) == N_BLOCKS); /* nothing leaked in the cache */
    kvcache_prefix_flush(s->kv); /* the next input starts from an empty prefix cache */
    return 0;
}
