/*
 * kvtransfer: every edge of the hand-off state machine (docs/kvtransfer.md).
 *
 * One zmq context, inproc:// sockets, two kvcaches (sender and receiver) with a small
 * synthetic layout whose blocks are filled with known values (exact in float32). Misbehaving
 * peers are raw DEALER/ROUTER sockets speaking the protocol by hand. After every path the
 * free KV blocks of both caches must be back to their starting values.
 *
 *   test_kvtransfer [case-name-pattern]
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>
#include <xxhash.h>
#include <zmq.h>

#include "kvcache.h"
#include "kvtransfer.h"
#include "log.h"
#include "protocol.h"
#include "wire.h"

#define NL 3    /* layers */
#define NKH 2   /* kv heads */
#define HD 4    /* head dim */
#define BS 4    /* tokens per block */
#define NBLK 32 /* blocks per cache */
#define MAXSEQ 8
#define MAXLEN 64
#define HEADROOM 3 /* receiver headroom_tokens, as a worker sets it (1 + MTP depth 2) */
#define FP 0x1234abcd5678ef01ull

static int endpoint_counter;

typedef struct {
    void *zctx;
    kvcache_t *kvs, *kvr; /* sender, receiver */
    kvx_sender_t *s;
    kvx_receiver_t *r;
    char ep[64];
    int free_s0, free_r0;
    wire_envelope *env;
    kvx_sender_t *s2; /* a second sender (own layout or lease), destroyed by teardown */
    kvcache_t *kv2;
    void *raw[8]; /* raw peer sockets, closed by teardown (a failed assert skips the test's
                   * own cleanup, and zmq_ctx_term would wait for them forever) */
} fx_t;

static kvcache_t *mk_kv(int n_layer, int n_kv_head, int head_dim, int bs, int n_blocks)
{
    kvcache_params p = {.n_layer = n_layer,
                        .n_kv_head = n_kv_head,
                        .head_dim = head_dim,
                        .block_size = bs,
                        .n_blocks = n_blocks,
                        .max_seqs = MAXSEQ,
                        .max_seq_len = MAXLEN};
    kvcache_t *kv = kvcache_new(&p);
    assert_non_null(kv);
    return kv;
}

static kvx_sender_t *mk_sender(fx_t *f, kvcache_t *kv, int lease_ms)
{
    kvx_sender_params p = kvx_sender_default_params();
    p.fingerprint = FP;
    p.lease_ms = lease_ms;
    kvx_sender_t *s = kvx_sender_new(f->zctx, kv, &p);
    assert_non_null(s);
    return s;
}

/* (Re)create the receiver on a fresh endpoint, keeping watermark_blocks free. */
static void mk_receiver_wm(fx_t *f, uint64_t fp, int lease_ms, int watermark_blocks)
{
    kvx_receiver_destroy(&f->r);
    snprintf(f->ep, sizeof(f->ep), "inproc://kvx-test-%d", ++endpoint_counter);
    kvx_receiver_params p = kvx_receiver_default_params();
    p.fingerprint = fp;
    p.lease_ms = lease_ms;
    p.headroom_tokens = HEADROOM;
    p.watermark_blocks = watermark_blocks;
    f->r = kvx_receiver_new(f->zctx, f->kvr, f->ep, &p);
    assert_non_null(f->r);
    assert_string_equal(kvx_receiver_endpoint(f->r), f->ep);
}

static void mk_receiver(fx_t *f, uint64_t fp, int lease_ms)
{
    mk_receiver_wm(f, fp, lease_ms, 0);
}

static int setup(void **state)
{
    fx_t *f = calloc(1, sizeof(*f));
    f->zctx = zmq_ctx_new();
    f->kvs = mk_kv(NL, NKH, HD, BS, NBLK);
    f->kvr = mk_kv(NL, NKH, HD, BS, NBLK);
    f->s = mk_sender(f, f->kvs, 2000);
    mk_receiver(f, FP, 2000);
    f->free_s0 = kvcache_n_free_blocks(f->kvs);
    f->free_r0 = kvcache_n_free_blocks(f->kvr);
    f->env = wire_envelope_new();
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fx_t *f = *state;
    kvx_sender_destroy(&f->s);
    kvx_sender_destroy(&f->s2);
    kvx_receiver_destroy(&f->r);
    wire_envelope_destroy(&f->env);
    for (int i = 0; i < 8; i++)
        if (f->raw[i])
            zmq_close(f->raw[i]);
    zmq_ctx_term(f->zctx);
    kvcache_destroy(&f->kv2);
    kvcache_destroy(&f->kvs);
    kvcache_destroy(&f->kvr);
    free(f);
    return 0;
}

// --- data

static float val(int seed, int layer, int blk, int i)
{
    return (float)(seed * 100000 + layer * 10000 + blk * 100 + i);
}

static int block_floats(const kvcache_t *kv)
{
    return (int)(kvcache_block_bytes(kv) / sizeof(float));
}

static void fill_seq(kvcache_t *kv, int seq, int seed)
{
    int nb;
    const int *blocks = kvcache_seq_blocks(kv, seq, &nb);
    const kvcache_params *p = kvcache_get_params(kv);
    for (int l = 0; l < p->n_layer; l++)
        for (int b = 0; b < nb; b++) {
            float *d = kvcache_block_data(kv, l, blocks[b]);
            for (int i = 0; i < block_floats(kv); i++)
                d[i] = val(seed, l, b, i);
        }
}

/* 1 when the first n_blocks blocks of seq hold the values of seed, in every layer. */
static int seq_holds(kvcache_t *kv, int seq, int seed, int n_blocks)
{
    int nb;
    const int *blocks = kvcache_seq_blocks(kv, seq, &nb);
    if (nb < n_blocks)
        return 0;
    for (int l = 0; l < kvcache_get_params(kv)->n_layer; l++)
        for (int b = 0; b < n_blocks; b++) {
            float *d = kvcache_block_data(kv, l, blocks[b]);
            for (int i = 0; i < block_floats(kv); i++)
                if (d[i] != val(seed, l, b, i))
                    return 0;
        }
    return 1;
}

static int make_seq(kvcache_t *kv, int n_tokens, int seed)
{
    int seq = kvcache_seq_new(kv);
    assert_true(seq >= 0);
    assert_int_equal(kvcache_seq_reserve(kv, seq, n_tokens), KVCACHE_OK);
    fill_seq(kv, seq, seed);
    kvcache_seq_set_len(kv, seq, n_tokens);
    return seq;
}

// --- driving

static void pump_once(fx_t *f)
{
    if (f->r)
        kvx_receiver_process(f->r);
    if (f->s)
        kvx_sender_process(f->s);
}

static void pump(fx_t *f)
{
    for (int i = 0; i < 10; i++) {
        pump_once(f);
        usleep(300);
    }
}

static int sender_event(fx_t *f, kvx_sender_t *s, kvx_event *ev)
{
    for (int i = 0; i < 2000; i++) {
        if (kvx_sender_next_event(s, ev))
            return 1;
        pump_once(f);
        if (s != f->s)
            kvx_sender_process(s);
        usleep(1000);
    }
    return 0;
}

static int receiver_event(fx_t *f, kvx_event *ev)
{
    for (int i = 0; i < 2000; i++) {
        if (kvx_receiver_next_event(f->r, ev))
            return 1;
        pump_once(f);
        usleep(1000);
    }
    return 0;
}

static uint64_t begin(fx_t *f, kvx_sender_t *s, uint64_t rid, int seq, int n_kv, int max_tokens)
{
    kvx_begin_params bp = {.rid = rid,
                           .seq = seq,
                           .n_kv_tokens = n_kv,
                           .max_tokens = max_tokens,
                           .temperature = 0.5f,
                           .top_p = 0.9f,
                           .top_k = 40};
    uint64_t x = kvx_send_begin(s, f->ep, &bp);
    assert_true(x != 0);
    return x;
}

static void send_all(kvx_sender_t *s, uint64_t x)
{
    for (int l = 0; l < NL; l++)
        assert_int_equal(kvx_send_layer(s, x, l), 0);
}

/* Everything back to the start: no transfer, every block free on both sides. */
static void assert_all_free(fx_t *f)
{
    for (int i = 0; i < 200 && (kvx_sender_n_active(f->s) || kvx_receiver_n_active(f->r)); i++)
        pump(f);
    assert_int_equal(kvx_sender_n_active(f->s), 0);
    assert_int_equal(kvx_receiver_n_active(f->r), 0);
    assert_int_equal(kvcache_n_free_blocks(f->kvs), f->free_s0);
    assert_int_equal(kvcache_n_free_blocks(f->kvr), f->free_r0);
}

static void expect_failed(fx_t *f, kvx_sender_t *s, uint64_t x, int code)
{
    kvx_event ev;
    assert_true(sender_event(f, s, &ev));
    assert_int_equal(ev.type, KVX_EV_FAILED);
    assert_true(ev.xfer == x);
    assert_int_equal(ev.code, code);
}

// --- raw peers

static void *raw_socket(fx_t *f, int type, const char *connect_to)
{
    void *sock = zmq_socket(f->zctx, type);
    int linger = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof(linger));
    for (int i = 0; i < 8; i++) {
        if (!f->raw[i]) {
            f->raw[i] = sock;
            break;
        }
    }
    if (type == ZMQ_DEALER)
        assert_int_equal(zmq_connect(sock, connect_to), 0);
    else
        assert_int_equal(zmq_bind(sock, connect_to), 0);
    return sock;
}

static void raw_close(fx_t *f, void *sock)
{
    for (int i = 0; i < 8; i++)
        if (f->raw[i] == sock)
            f->raw[i] = NULL;
    zmq_close(sock);
}

/* Wait (pumping kvx) for a message on a raw socket. */
static int raw_recv(fx_t *f, void *sock, int router, int timeout_ms)
{
    for (int i = 0; i < timeout_ms; i++) {
        pump_once(f);
        int rc = wire_recv(sock, router, f->env, ZMQ_DONTWAIT);
        if (rc == 1)
            return 1;
        usleep(1000);
    }
    return 0;
}

static void raw_begin_msg(proto_msg *m, uint64_t rid, uint64_t xfer, int n_kv, int max_tokens)
{
    proto_msg_init(m, PROTO_KV_BEGIN);
    m->rid = rid;
    m->xfer = xfer;
    m->fingerprint = FP;
    m->n_layer = NL;
    m->n_kv_head = NKH;
    m->head_dim = HD;
    m->dtype = PROTO_DTYPE_F32;
    m->block_size = BS;
    m->n_blocks = (n_kv + BS - 1) / BS;
    m->n_kv_tokens = n_kv;
    m->max_tokens = max_tokens;
    m->top_p = 1.0f;
    m->lease_ms = 1000; /* optional, but always encoded: must be valid */
}

/* Send KV_BEGIN from a raw DEALER and return the ACK's ok. */
static int raw_begin(fx_t *f, void *sock, uint64_t rid, uint64_t xfer, int n_kv)
{
    proto_msg m;
    raw_begin_msg(&m, rid, xfer, n_kv, 4);
    assert_int_equal(wire_send(sock, NULL, 0, &m, NULL, 0, 0), 0);
    assert_true(raw_recv(f, sock, 0, 2000));
    proto_msg *a = wire_envelope_msg(f->env);
    assert_int_equal(a->type, PROTO_KV_BEGIN_ACK);
    return a->ok;
}

/* Copies of layer `layer` of a sender sequence as frames; optional hash update. */
static int raw_frames(fx_t *f, int seq, int layer, int n, size_t bytes, zmq_msg_t *frames,
                      XXH64_state_t *h)
{
    int nb;
    const int *blocks = kvcache_seq_blocks(f->kvs, seq, &nb);
    for (int i = 0; i < n; i++) {
        zmq_msg_init_size(&frames[i], bytes);
        memset(zmq_msg_data(&frames[i]), 0, bytes);
        size_t k = bytes < kvcache_block_bytes(f->kvs) ? bytes : kvcache_block_bytes(f->kvs);
        memcpy(zmq_msg_data(&frames[i]), kvcache_block_data(f->kvs, layer, blocks[i % nb]), k);
        if (h)
            XXH64_update(h, zmq_msg_data(&frames[i]), bytes);
    }
    return n;
}

static void raw_layer(fx_t *f, void *sock, uint64_t rid, uint64_t xfer, int seq, int layer,
                      int n_hdr, int n_frames, size_t bytes, XXH64_state_t *h)
{
    zmq_msg_t frames[16];
    raw_frames(f, seq, layer < NL ? layer : 0, n_frames, bytes, frames, h);
    proto_msg m;
    proto_msg_init(&m, PROTO_KV_LAYER);
    m.rid = rid;
    m.xfer = xfer;
    m.layer = layer;
    m.n_blocks = n_hdr;
    assert_int_equal(wire_send(sock, NULL, 0, &m, frames, n_frames, 0), 0);
}

/* Blocks [blk0, blk0 + n) of layer `layer` of a sender sequence as one KV_LAYER (the
 * range is not checked here: the receiver must). */
static void raw_range(fx_t *f, void *sock, uint64_t rid, uint64_t xfer, int seq, int layer,
                      int blk0, int n, XXH64_state_t *h)
{
    zmq_msg_t frames[16];
    size_t bytes = kvcache_block_bytes(f->kvs);
    int nb;
    const int *blocks = kvcache_seq_blocks(f->kvs, seq, &nb);
    for (int i = 0; i < n; i++) {
        zmq_msg_init_size(&frames[i], bytes);
        memcpy(zmq_msg_data(&frames[i]), kvcache_block_data(f->kvs, layer, blocks[(blk0 + i) % nb]),
               bytes);
        if (h)
            XXH64_update(h, zmq_msg_data(&frames[i]), bytes);
    }
    proto_msg m;
    proto_msg_init(&m, PROTO_KV_LAYER);
    m.rid = rid;
    m.xfer = xfer;
    m.layer = layer;
    m.blk0 = blk0;
    m.n_blocks = n;
    assert_int_equal(wire_send(sock, NULL, 0, &m, frames, n, 0), 0);
}

static void raw_end(void *sock, uint64_t rid, uint64_t xfer, uint64_t cksum)
{
    proto_msg m;
    proto_msg_init(&m, PROTO_KV_END);
    m.rid = rid;
    m.xfer = xfer;
    m.first_token = 7;
    m.checksum = cksum;
    assert_int_equal(wire_send(sock, NULL, 0, &m, NULL, 0, 0), 0);
}

/* The receiver answered the raw DEALER with `type` and `code`, and kept nothing. */
static void expect_raw_reply(fx_t *f, void *sock, proto_type_t type, int code)
{
    assert_true(raw_recv(f, sock, 0, 2000));
    proto_msg *a = wire_envelope_msg(f->env);
    assert_int_equal(a->type, type);
    assert_int_equal(a->ok, 0);
    assert_int_equal(a->code, code);
    kvx_event ev;
    assert_true(receiver_event(f, &ev));
    assert_int_equal(ev.type, KVX_EV_FAILED);
    assert_int_equal(ev.code, code);
}

// --- happy paths

/* A whole transfer of n_kv tokens; checks every byte and the accounting. */
static void transfer_ok(fx_t *f, int n_kv, int max_tokens, const int *order)
{
    int seed = n_kv % 50 + 1;
    int seq = make_seq(f->kvs, n_kv, seed);
    uint64_t x = begin(f, f->s, 42, seq, n_kv, max_tokens);
    for (int l = 0; l < NL; l++)
        assert_int_equal(kvx_send_layer(f->s, x, order ? order[l] : l), 0);
    /* the prefill's durations ride on KV_END (even layers only: absent is 0) */
    if (n_kv % 2 == 0)
        assert_int_equal(kvx_send_timing(f->s, x, 1234, 56789), 0);
    assert_int_equal(kvx_send_end(f->s, x, 99, 0xfeedull), 0);
    assert_int_equal(kvx_send_timing(f->s, x, 1, 1), -1); /* ended: no longer open */
    kvx_event ev;
    assert_true(receiver_event(f, &ev));
    assert_int_equal(ev.type, KVX_EV_ACCEPTED);
    assert_true(ev.rid == 42 && ev.xfer == x);
    assert_true(ev.queue_us == (n_kv % 2 == 0 ? 1234 : 0));
    assert_true(ev.prefill_us == (n_kv % 2 == 0 ? 56789 : 0));
    assert_int_equal(ev.n_kv_tokens, n_kv);
    assert_int_equal(ev.first_token, 99);
    assert_true(ev.rng == 0xfeedull);
    assert_int_equal(ev.max_tokens, max_tokens);
    assert_true(ev.temperature == 0.5f && ev.top_p == 0.9f && ev.top_k == 40);
    int nb = kvcache_blocks_for(f->kvr, n_kv);
    assert_true(seq_holds(f->kvr, ev.seq, seed, nb));
    assert_int_equal(kvcache_seq_len(f->kvr, ev.seq), n_kv);
    /* on demand: the transferred tokens and the first step's headroom, not max_tokens */
    int want = n_kv + HEADROOM > MAXLEN ? MAXLEN : n_kv + HEADROOM;
    assert_int_equal(kvcache_seq_capacity(f->kvr, ev.seq), kvcache_blocks_for(f->kvr, want) * BS);
    assert_int_equal(kvx_receiver_n_active(f->r), 0); /* handed over */
    kvx_event sev;
    assert_true(sender_event(f, f->s, &sev));
    assert_int_equal(sev.type, KVX_EV_DONE);
    assert_true(sev.xfer == x);
    kvcache_seq_free(f->kvr, ev.seq); /* the caller's now */
    assert_all_free(f);
}

static void test_happy_path(void **state)
{
    transfer_ok(*state, 37, 5, NULL);
}

static void test_one_token(void **state)
{
    transfer_ok(*state, 1, 1, NULL);
}

static void test_exact_block_multiple(void **state)
{
    transfer_ok(*state, 4 * BS, 3, NULL);
}

static void test_capacity_capped_at_context(void **state)
{
    transfer_ok(*state, 62, 1000, NULL); /* 62 + 3 > 64: 16 blocks */
}

static void test_layers_out_of_order(void **state)
{
    int order[NL] = {2, 0, 1};
    transfer_ok(*state, 9, 2, order);
}

static void test_concurrent_transfers(void **state)
{
    fx_t *f = *state;
    int sa = make_seq(f->kvs, 10, 3), sb = make_seq(f->kvs, 21, 4);
    uint64_t xa = begin(f, f->s, 1, sa, 10, 2), xb = begin(f, f->s, 2, sb, 21, 2);
    for (int l = 0; l < NL; l++) {
        kvx_send_layer(f->s, xb, l);
        kvx_send_layer(f->s, xa, l);
    }
    kvx_send_end(f->s, xb, 5, 1);
    kvx_send_end(f->s, xa, 6, 2);
    kvx_event e1, e2;
    assert_true(receiver_event(f, &e1));
    assert_true(receiver_event(f, &e2));
    kvx_event *ea = e1.rid == 1 ? &e1 : &e2, *eb = e1.rid == 1 ? &e2 : &e1;
    assert_int_equal(ea->type, KVX_EV_ACCEPTED);
    assert_int_equal(eb->type, KVX_EV_ACCEPTED);
    assert_true(seq_holds(f->kvr, ea->seq, 3, 3));
    assert_true(seq_holds(f->kvr, eb->seq, 4, 6));
    kvx_event d1, d2;
    assert_true(sender_event(f, f->s, &d1));
    assert_true(sender_event(f, f->s, &d2));
    assert_int_equal(d1.type, KVX_EV_DONE);
    assert_int_equal(d2.type, KVX_EV_DONE);
    kvcache_seq_free(f->kvr, ea->seq);
    kvcache_seq_free(f->kvr, eb->seq);
    assert_all_free(f);
}

// --- rejects at KV_BEGIN

static void test_reject_nospace(void **state)
{
    fx_t *f = *state;
    int s1 = make_seq(f->kvs, 60, 1), s2 = make_seq(f->kvs, 60, 2), s3 = make_seq(f->kvs, 4, 3);
    uint64_t x1 = begin(f, f->s, 1, s1, 60, 5); /* 60 + 3 tokens: 16 blocks */
    uint64_t x2 = begin(f, f->s, 2, s2, 60, 5); /* the other 16 */
    pump(f);
    assert_int_equal(kvcache_n_free_blocks(f->kvr), 0);
    uint64_t x3 = begin(f, f->s, 3, s3, 4, 2);
    expect_failed(f, f->s, x3, PROTO_ERR_NOSPACE);
    assert_int_equal(kvx_receiver_n_active(f->r), 2);
    kvx_send_abort(f->s, x1);
    kvx_send_abort(f->s, x2);
    assert_all_free(f);
}

/* The watermark: a new sequence must leave watermark_blocks free, except in an empty cache
 * (there it is admitted whatever it leaves, so a prompt that fits is never refused for
 * good); max_tokens plays no part. */
static void test_reject_watermark(void **state)
{
    fx_t *f = *state;
    mk_receiver_wm(f, FP, 2000, 20);
    int s1 = make_seq(f->kvs, 60, 1), s2 = make_seq(f->kvs, 4, 2);
    uint64_t x1 = begin(f, f->s, 1, s1, 60, 100000); /* 16 blocks of 32: 16 left < 20 */
    pump(f);
    assert_int_equal(kvcache_n_free_blocks(f->kvr), NBLK - 16);
    uint64_t x2 = begin(f, f->s, 2, s2, 4, 1); /* 2 blocks: 14 would be left */
    expect_failed(f, f->s, x2, PROTO_ERR_NOSPACE);
    assert_int_equal(kvx_receiver_n_active(f->r), 1);
    kvx_send_abort(f->s, x1);
    assert_all_free(f);
    /* with x1 gone the cache is empty again: the same request is admitted */
    s2 = make_seq(f->kvs, 4, 2);
    x2 = begin(f, f->s, 3, s2, 4, 1);
    pump(f);
    assert_int_equal(kvcache_n_free_blocks(f->kvr), NBLK - 2);
    kvx_send_abort(f->s, x2);
    assert_all_free(f);
}

static void test_reject_no_sequence_slot(void **state)
{
    fx_t *f = *state;
    uint64_t x[MAXSEQ + 1];
    for (int i = 0; i <= MAXSEQ; i++) {
        int seq = kvcache_seq_new(f->kvs);
        if (seq < 0) { /* the sender ran out first: use a second cache */
            break;
        }
        kvcache_seq_reserve(f->kvs, seq, 1);
        kvcache_seq_set_len(f->kvs, seq, 1);
        x[i] = begin(f, f->s, (uint64_t)i + 1, seq, 1, 1);
    }
    pump(f);
    assert_int_equal(kvx_receiver_n_active(f->r), MAXSEQ);
    /* a ninth transfer from another sender: no slot left */
    kvcache_t *kv2 = f->kv2 = mk_kv(NL, NKH, HD, BS, 4);
    kvx_sender_t *s2 = f->s2 = mk_sender(f, kv2, 2000);
    int seq = make_seq(kv2, 2, 9);
    uint64_t x9 = begin(f, s2, 99, seq, 2, 2);
    expect_failed(f, s2, x9, PROTO_ERR_NOSPACE);
    for (int i = 0; i < MAXSEQ; i++)
        kvx_send_abort(f->s, x[i]);
    for (int i = 0; i < 50 && kvx_sender_n_active(s2); i++)
        pump(f), kvx_sender_process(s2);
    assert_int_equal(kvcache_n_free_blocks(kv2), 4);
    assert_all_free(f);
}

static void test_reject_fingerprint(void **state)
{
    fx_t *f = *state;
    mk_receiver(f, FP ^ 1, 2000);
    int seq = make_seq(f->kvs, 5, 1);
    uint64_t x = begin(f, f->s, 7, seq, 5, 3);
    send_all(f->s, x); /* sent before the reject is read: dropped by the receiver */
    expect_failed(f, f->s, x, PROTO_ERR_LAYOUT);
    assert_int_equal(kvx_send_end(f->s, x, 1, 1), -1); /* over: no-op */
    assert_all_free(f);
}

static void check_layout_reject(fx_t *f, int n_layer, int n_kv_head, int head_dim, int bs)
{
    kvx_sender_destroy(&f->s2);
    kvcache_destroy(&f->kv2);
    kvcache_t *kv = f->kv2 = mk_kv(n_layer, n_kv_head, head_dim, bs, 8);
    kvx_sender_t *s = f->s2 = mk_sender(f, kv, 2000);
    int seq = make_seq(kv, 5, 1);
    uint64_t x = begin(f, s, 7, seq, 5, 3);
    for (int l = 0; l < n_layer; l++)
        kvx_send_layer(s, x, l);
    expect_failed(f, s, x, PROTO_ERR_LAYOUT);
    for (int i = 0; i < 50 && kvx_sender_n_active(s); i++)
        pump(f), kvx_sender_process(s);
    assert_int_equal(kvx_sender_n_active(s), 0);
    assert_int_equal(kvcache_n_free_blocks(kv), 8);
    assert_all_free(f);
}

static void test_reject_layout_n_layer(void **state)
{
    check_layout_reject(*state, NL + 1, NKH, HD, BS);
}

static void test_reject_layout_n_kv_head(void **state)
{
    check_layout_reject(*state, NL, NKH + 1, HD, BS);
}

static void test_reject_layout_head_dim(void **state)
{
    check_layout_reject(*state, NL, NKH, HD * 2, BS);
}

static void test_reject_layout_block_size(void **state)
{
    check_layout_reject(*state, NL, NKH, HD, BS * 2);
}

static void test_reject_layout_dtype(void **state)
{
    fx_t *f = *state;
    void *d = raw_socket(f, ZMQ_DEALER, f->ep);
    proto_msg m;
    raw_begin_msg(&m, 5, 55, 8, 2);
    m.dtype = PROTO_DTYPE_F16;
    assert_int_equal(wire_send(d, NULL, 0, &m, NULL, 0, 0), 0);
    assert_true(raw_recv(f, d, 0, 2000));
    assert_int_equal(wire_envelope_msg(f->env)->ok, 0);
    assert_int_equal(wire_envelope_msg(f->env)->code, PROTO_ERR_LAYOUT);
    /* n_blocks that does not match n_kv_tokens */
    raw_begin_msg(&m, 6, 56, 8, 2);
    m.n_blocks = 3;
    assert_int_equal(wire_send(d, NULL, 0, &m, NULL, 0, 0), 0);
    assert_true(raw_recv(f, d, 0, 2000));
    assert_int_equal(wire_envelope_msg(f->env)->code, PROTO_ERR_PROTOCOL);
    /* longer than the context */
    raw_begin_msg(&m, 7, 57, MAXLEN + 1, 2);
    assert_int_equal(wire_send(d, NULL, 0, &m, NULL, 0, 0), 0);
    assert_true(raw_recv(f, d, 0, 2000));
    assert_int_equal(wire_envelope_msg(f->env)->code, PROTO_ERR_BAD_REQUEST);
    raw_close(f, d);
    assert_all_free(f);
}

static void test_reject_not_accepting(void **state)
{
    fx_t *f = *state;
    kvx_receiver_set_accepting(f->r, 0);
    int seq = make_seq(f->kvs, 5, 1);
    uint64_t x = begin(f, f->s, 7, seq, 5, 3);
    expect_failed(f, f->s, x, PROTO_ERR_UNAVAILABLE);
    assert_all_free(f);
}

// --- bad transfers (raw sender)

static void test_checksum_mismatch(void **state)
{
    fx_t *f = *state;
    int seq = make_seq(f->kvs, 8, 1);
    void *d = raw_socket(f, ZMQ_DEALER, f->ep);
    assert_true(raw_begin(f, d, 9, 90, 8));
    XXH64_state_t *h = XXH64_createState();
    XXH64_reset(h, 0);
    raw_layer(f, d, 9, 90, seq, 0, 2, 2, kvcache_block_bytes(f->kvs), h);
    raw_layer(f, d, 9, 90, seq, 1, 2, 2, kvcache_block_bytes(f->kvs), h);
    /* layer 2 with one corrupted byte, checksum over the good bytes */
    zmq_msg_t frames[2];
    raw_frames(f, seq, 2, 2, kvcache_block_bytes(f->kvs), frames, h);
    ((unsigned char *)zmq_msg_data(&frames[1]))[17] ^= 0x40;
    proto_msg m;
    proto_msg_init(&m, PROTO_KV_LAYER);
    m.rid = 9;
    m.xfer = 90;
    m.layer = 2;
    m.n_blocks = 2;
    assert_int_equal(wire_send(d, NULL, 0, &m, frames, 2, 0), 0);
    raw_end(d, 9, 90, XXH64_digest(h));
    XXH64_freeState(h);
    expect_raw_reply(f, d, PROTO_KV_RESULT, PROTO_ERR_CHECKSUM);
    kvcache_seq_free(f->kvs, seq);
    raw_close(f, d);
    assert_all_free(f);
}

/* A KV_LAYER the receiver must refuse: the transfer is aborted and its blocks freed. */
static void check_bad_layer(fx_t *f, int layer, int n_hdr, int n_frames, size_t bytes,
                            int dup_first)
{
    int seq = make_seq(f->kvs, 8, 1);
    void *d = raw_socket(f, ZMQ_DEALER, f->ep);
    assert_true(raw_begin(f, d, 9, 91, 8));
    assert_int_equal(kvx_receiver_n_active(f->r), 1);
    if (dup_first)
        raw_layer(f, d, 9, 91, seq, layer, 2, 2, kvcache_block_bytes(f->kvs), NULL);
    raw_layer(f, d, 9, 91, seq, layer, n_hdr, n_frames, bytes, NULL);
    expect_raw_reply(f, d, PROTO_KV_ABORT, PROTO_ERR_PROTOCOL);
    /* anything later for that transfer is dropped */
    raw_layer(f, d, 9, 91, seq, 1, 2, 2, kvcache_block_bytes(f->kvs), NULL);
    raw_end(d, 9, 91, 0);
    pump(f);
    kvx_event ev;
    assert_false(kvx_receiver_next_event(f->r, &ev));
    kvcache_seq_free(f->kvs, seq);
    raw_close(f, d);
    assert_all_free(f);
}

static void test_wrong_frame_size(void **state)
{
    fx_t *f = *state;
    check_bad_layer(f, 0, 2, 2, kvcache_block_bytes(f->kvs) - 4, 0);
    check_bad_layer(f, 0, 2, 2, kvcache_block_bytes(f->kvs) + 4, 0);
}

static void test_wrong_n_blocks(void **state)
{
    fx_t *f = *state;
    size_t b = kvcache_block_bytes(f->kvs);
    /* (fewer blocks than the layer, header and frames agreeing, is a valid partial range:
     * see test_range_*) */
    check_bad_layer(f, 0, 0, 0, b, 0); /* an empty range */
    check_bad_layer(f, 0, 3, 3, b, 0); /* more */
    check_bad_layer(f, 0, 2, 1, b, 0); /* header and frames disagree */
}

static void test_duplicate_layer(void **state)
{
    fx_t *f = *state;
    check_bad_layer(f, 1, 2, 2, kvcache_block_bytes(f->kvs), 1);
}

static void test_layer_out_of_range(void **state)
{
    fx_t *f = *state;
    check_bad_layer(f, NL, 2, 2, kvcache_block_bytes(f->kvs), 0);
}

static void test_end_before_all_layers(void **state)
{
    fx_t *f = *state;
    int seq = make_seq(f->kvs, 8, 1);
    void *d = raw_socket(f, ZMQ_DEALER, f->ep);
    assert_true(raw_begin(f, d, 9, 92, 8));
    XXH64_state_t *h = XXH64_createState();
    XXH64_reset(h, 0);
    raw_layer(f, d, 9, 92, seq, 0, 2, 2, kvcache_block_bytes(f->kvs), h);
    raw_layer(f, d, 9, 92, seq, 1, 2, 2, kvcache_block_bytes(f->kvs), h);
    raw_end(d, 9, 92, XXH64_digest(h));
    XXH64_freeState(h);
    expect_raw_reply(f, d, PROTO_KV_RESULT, PROTO_ERR_PROTOCOL);
    kvcache_seq_free(f->kvs, seq);
    raw_close(f, d);
    assert_all_free(f);
}

// --- layers in several messages (chunked prefill): block ranges

/* The real sender: each layer in ranges of 3, 1 and 6 blocks (37 tokens = 10 blocks),
 * layers interleaved as a chunked prefill sends them; the receiver gets every byte. */
static void test_range_coverage_complete(void **state)
{
    fx_t *f = *state;
    int seq = make_seq(f->kvs, 37, 5);
    uint64_t x = begin(f, f->s, 42, seq, 37, 4);
    static const int cuts[] = {0, 3, 4, 10};
    for (int c = 0; c < 3; c++)
        for (int l = 0; l < NL; l++)
            assert_int_equal(kvx_send_layer_blocks(f->s, x, l, cuts[c], cuts[c + 1] - cuts[c]), 0);
    assert_int_equal(kvx_send_end(f->s, x, 99, 7), 0);
    kvx_event ev;
    assert_true(receiver_event(f, &ev));
    assert_int_equal(ev.type, KVX_EV_ACCEPTED);
    assert_int_equal(ev.n_kv_tokens, 37);
    assert_true(seq_holds(f->kvr, ev.seq, 5, 10));
    assert_true(ev.n_bytes == (uint64_t)NL * 10 * kvcache_block_bytes(f->kvs));
    kvx_event sev;
    assert_true(sender_event(f, f->s, &sev));
    assert_int_equal(sev.type, KVX_EV_DONE);
    kvcache_seq_free(f->kvr, ev.seq);
    assert_all_free(f);

    /* a partial layer finished by kvx_send_layer (the rest of it) */
    seq = make_seq(f->kvs, 9, 6);
    x = begin(f, f->s, 43, seq, 9, 2);
    for (int l = 0; l < NL; l++) {
        assert_int_equal(kvx_send_layer_blocks(f->s, x, l, 0, 1), 0);
        assert_int_equal(kvx_send_layer(f->s, x, l), 0);
    }
    assert_int_equal(kvx_send_end(f->s, x, 1, 1), 0);
    assert_true(receiver_event(f, &ev));
    assert_int_equal(ev.type, KVX_EV_ACCEPTED);
    assert_true(seq_holds(f->kvr, ev.seq, 6, 3));
    assert_true(sender_event(f, f->s, &sev));
    assert_int_equal(sev.type, KVX_EV_DONE);
    kvcache_seq_free(f->kvr, ev.seq);
    assert_all_free(f);
}

/* On the wire, ranges of a layer may come in any order: a raw sender sends the blocks of
 * each layer back to front, one message per block. */
static void test_range_any_order_on_the_wire(void **state)
{
    fx_t *f = *state;
    int seq = make_seq(f->kvs, 11, 7); /* 3 blocks */
    void *d = raw_socket(f, ZMQ_DEALER, f->ep);
    assert_true(raw_begin(f, d, 9, 93, 11));
    XXH64_state_t *h = XXH64_createState();
    XXH64_reset(h, 0);
    for (int l = 0; l < NL; l++)
        for (int b = 2; b >= 0; b--)
            raw_range(f, d, 9, 93, seq, l, b, 1, h);
    raw_end(d, 9, 93, XXH64_digest(h));
    XXH64_freeState(h);
    kvx_event ev;
    assert_true(receiver_event(f, &ev));
    assert_int_equal(ev.type, KVX_EV_ACCEPTED);
    assert_true(seq_holds(f->kvr, ev.seq, 7, 3));
    assert_true(raw_recv(f, d, 0, 2000)); /* KV_RESULT ok */
    assert_int_equal(wire_envelope_msg(f->env)->type, PROTO_KV_RESULT);
    assert_int_equal(wire_envelope_msg(f->env)->ok, 1);
    wire_envelope_reset(f->env);
    kvcache_seq_free(f->kvr, ev.seq);
    kvcache_seq_free(f->kvs, seq);
    raw_close(f, d);
    assert_all_free(f);
}

/* A range that repeats a block already received (even partly) aborts the transfer, and
 * nothing of it is written. */
static void test_range_overlap_rejected(void **state)
{
    fx_t *f = *state;
    for (int variant = 0; variant < 2; variant++) {
        int seq = make_seq(f->kvs, 11, 1);
        void *d = raw_socket(f, ZMQ_DEALER, f->ep);
        assert_true(raw_begin(f, d, 9, 94 + variant, 11));
        raw_range(f, d, 9, 94 + variant, seq, 1, 0, 2, NULL); /* blocks 0, 1 */
        if (variant == 0)
            raw_range(f, d, 9, 94, seq, 1, 1, 2, NULL); /* 1 again, with 2 */
        else
            raw_range(f, d, 9, 95, seq, 1, 0, 1, NULL); /* 0 again */
        expect_raw_reply(f, d, PROTO_KV_ABORT, PROTO_ERR_PROTOCOL);
        kvcache_seq_free(f->kvs, seq);
        raw_close(f, d);
        assert_all_free(f);
    }
}

/* KV_END with a block missing in one layer (a gap between two ranges) is refused: NACK
 * PROTOCOL, blocks freed. */
static void test_range_gap_at_end_rejected(void **state)
{
    fx_t *f = *state;
    int seq = make_seq(f->kvs, 11, 1); /* 3 blocks */
    void *d = raw_socket(f, ZMQ_DEALER, f->ep);
    assert_true(raw_begin(f, d, 9, 96, 11));
    XXH64_state_t *h = XXH64_createState();
    XXH64_reset(h, 0);
    for (int l = 0; l < NL; l++) {
        raw_range(f, d, 9, 96, seq, l, 0, 1, h);
        if (l != 1) /* layer 1 lacks block 1 */
            raw_range(f, d, 9, 96, seq, l, 1, 1, h);
        raw_range(f, d, 9, 96, seq, l, 2, 1, h);
    }
    raw_end(d, 9, 96, XXH64_digest(h));
    XXH64_freeState(h);
    expect_raw_reply(f, d, PROTO_KV_RESULT, PROTO_ERR_PROTOCOL);
    kvcache_seq_free(f->kvs, seq);
    raw_close(f, d);
    assert_all_free(f);
}

/* A range past the transfer's blocks aborts it. */
static void test_range_out_of_bounds(void **state)
{
    fx_t *f = *state;
    static const int cases[][2] = {{2, 2}, {3, 1}, {1, 3}}; /* (blk0, n) of a 3-block layer */
    for (int c = 0; c < 3; c++) {
        int seq = make_seq(f->kvs, 11, 1);
        void *d = raw_socket(f, ZMQ_DEALER, f->ep);
        assert_true(raw_begin(f, d, 9, 97 + (uint64_t)c, 11));
        raw_range(f, d, 9, 97 + (uint64_t)c, seq, 0, cases[c][0], cases[c][1], NULL);
        expect_raw_reply(f, d, PROTO_KV_ABORT, PROTO_ERR_PROTOCOL);
        kvcache_seq_free(f->kvs, seq);
        raw_close(f, d);
        assert_all_free(f);
    }
}

/* The sender refuses ranges that are out of order, empty or past the end (caller bugs):
 * the transfer fails with INTERNAL and everything is freed. */
static void test_range_sender_misuse(void **state)
{
    fx_t *f = *state;
    static const int cases[][2] = {{1, 1}, {0, 0}, {0, 4}}; /* (blk0, n) for 3 blocks */
    for (int c = 0; c < 3; c++) {
        int seq = make_seq(f->kvs, 11, 1);
        uint64_t x = begin(f, f->s, 50 + (uint64_t)c, seq, 11, 2);
        assert_int_equal(kvx_send_layer_blocks(f->s, x, 0, cases[c][0], cases[c][1]), -1);
        expect_failed(f, f->s, x, PROTO_ERR_INTERNAL);
        kvx_event ev;
        assert_true(receiver_event(f, &ev)); /* its KV_ABORT */
        assert_int_equal(ev.type, KVX_EV_FAILED);
        assert_all_free(f);
    }
    /* END with a layer only partly sent */
    int seq = make_seq(f->kvs, 11, 1);
    uint64_t x = begin(f, f->s, 60, seq, 11, 2);
    for (int l = 0; l < NL; l++)
        assert_int_equal(kvx_send_layer_blocks(f->s, x, l, 0, l == 2 ? 2 : 3), 0);
    assert_int_equal(kvx_send_end(f->s, x, 1, 1), -1);
    expect_failed(f, f->s, x, PROTO_ERR_INTERNAL);
    kvx_event ev;
    assert_true(receiver_event(f, &ev));
    assert_all_free(f);
}

static void test_malformed_header(void **state)
{
    fx_t *f = *state;
    void *d = raw_socket(f, ZMQ_DEALER, f->ep);
    zmq_send(d, "\xc1garbage", 8, 0);   /* not msgpack */
    zmq_send(d, "\x81\xa1t\x22", 4, 0); /* KV_LAYER without version/fields */
    proto_msg m;
    proto_msg_init(&m, PROTO_KV_LAYER); /* unknown transfer, with a frame */
    m.rid = 3;
    m.xfer = 12345;
    m.layer = 0;
    m.n_blocks = 1;
    zmq_msg_t fr;
    zmq_msg_init_size(&fr, kvcache_block_bytes(f->kvr));
    memset(zmq_msg_data(&fr), 0xff, kvcache_block_bytes(f->kvr));
    assert_int_equal(wire_send(d, NULL, 0, &m, &fr, 1, 0), 0);
    proto_msg_init(&m, PROTO_TOKENS); /* a valid message of the wrong kind */
    m.rid = 3;
    assert_int_equal(wire_send(d, NULL, 0, &m, NULL, 0, 0), 0);
    pump(f);
    kvx_event ev;
    assert_false(kvx_receiver_next_event(f->r, &ev));
    raw_close(f, d);
    assert_all_free(f);
    /* the receiver still works */
    transfer_ok(f, 6, 2, NULL);
}

// --- leases

static void test_lease_receiver(void **state)
{
    fx_t *f = *state;
    mk_receiver(f, FP, 80);
    int seq = make_seq(f->kvs, 10, 1);
    uint64_t x = begin(f, f->s, 4, seq, 10, 3);
    kvx_send_layer(f->s, x, 0); /* then the sender stalls */
    pump(f);
    assert_int_equal(kvx_receiver_n_active(f->r), 1);
    assert_true(kvx_receiver_next_timeout_ms(f->r) <= 80);
    usleep(120 * 1000);
    kvx_event ev;
    assert_true(receiver_event(f, &ev));
    assert_int_equal(ev.type, KVX_EV_FAILED);
    assert_int_equal(ev.code, PROTO_ERR_TIMEOUT);
    assert_int_equal(kvcache_n_free_blocks(f->kvr), f->free_r0);
    /* the sender learns it through KV_ABORT */
    expect_failed(f, f->s, x, PROTO_ERR_TIMEOUT);
    assert_int_equal(kvx_send_layer(f->s, x, 1), -1);
    assert_all_free(f);
}

static void test_lease_sender(void **state)
{
    fx_t *f = *state;
    /* a receiver that reads but never answers */
    snprintf(f->ep, sizeof(f->ep), "inproc://kvx-silent-%d", ++endpoint_counter);
    void *silent = raw_socket(f, ZMQ_ROUTER, f->ep);
    kvx_sender_t *s = f->s2 = mk_sender(f, f->kvs, 80);
    int seq = make_seq(f->kvs, 10, 1);
    uint64_t x = begin(f, s, 4, seq, 10, 3);
    send_all(s, x);
    assert_true(kvx_sender_next_timeout_ms(s) <= 80);
    usleep(120 * 1000);
    expect_failed(f, s, x, PROTO_ERR_TIMEOUT);
    /* the silent peer got BEGIN, 3 layers, then KV_ABORT(TIMEOUT); reading releases the
     * zero-copy frames, and only then is the sequence freed */
    int n = 0, aborted = 0;
    while (raw_recv(f, silent, 1, 50)) {
        n++;
        proto_msg *m = wire_envelope_msg(f->env);
        if (m->type == PROTO_KV_ABORT)
            aborted = m->code == PROTO_ERR_TIMEOUT;
    }
    wire_envelope_reset(f->env);
    assert_int_equal(n, 1 + NL + 1);
    assert_true(aborted);
    for (int i = 0; i < 100 && kvx_sender_n_active(s); i++)
        pump(f), kvx_sender_process(s);
    assert_int_equal(kvx_sender_n_active(s), 0);

    /* ACK arrives but KV_RESULT never does: the lease runs from KV_END */
    seq = make_seq(f->kvs, 10, 1);
    x = begin(f, s, 5, seq, 10, 3);
    assert_true(raw_recv(f, silent, 1, 1000));
    size_t id_len;
    unsigned char id[256];
    memcpy(id, wire_envelope_identity(f->env, &id_len), 256);
    proto_msg a;
    proto_msg_init(&a, PROTO_KV_BEGIN_ACK);
    a.rid = 5;
    a.xfer = x;
    a.ok = 1;
    a.lease_ms = 1000;
    assert_int_equal(wire_send(silent, id, id_len, &a, NULL, 0, 0), 0);
    for (int i = 0; i < 20; i++)
        kvx_sender_process(s), usleep(1000);
    assert_int_equal(kvx_sender_next_timeout_ms(s), -1); /* acked: no lease while computing */
    send_all(s, x);
    kvx_send_end(s, x, 3, 3);
    usleep(120 * 1000);
    expect_failed(f, s, x, PROTO_ERR_TIMEOUT);
    while (raw_recv(f, silent, 1, 50))
        ;
    wire_envelope_reset(f->env);
    for (int i = 0; i < 100 && kvx_sender_n_active(s); i++)
        pump(f), kvx_sender_process(s);
    assert_int_equal(kvx_sender_n_active(s), 0);
    raw_close(f, silent);
    assert_int_equal(kvcache_n_free_blocks(f->kvs), f->free_s0);
}

/* A receiver that NACKs, and one that says ok before KV_END. */
static void test_sender_result_nack(void **state)
{
    fx_t *f = *state;
    snprintf(f->ep, sizeof(f->ep), "inproc://kvx-nack-%d", ++endpoint_counter);
    void *rr = raw_socket(f, ZMQ_ROUTER, f->ep);
    for (int variant = 0; variant < 2; variant++) {
        int seq = make_seq(f->kvs, 6, 1);
        uint64_t x = begin(f, f->s, 8, seq, 6, 3);
        send_all(f->s, x);
        if (variant == 0)
            kvx_send_end(f->s, x, 1, 1);
        int got_end = 0;
        size_t id_len = 0;
        unsigned char id[256];
        while (raw_recv(f, rr, 1, 50)) {
            got_end |= wire_envelope_msg(f->env)->type == PROTO_KV_END;
            memcpy(id, wire_envelope_identity(f->env, &id_len), 256);
        }
        assert_int_equal(got_end, variant == 0);
        assert_true(id_len > 0);
        proto_msg m;
        proto_msg_init(&m, PROTO_KV_RESULT);
        m.rid = 8;
        m.xfer = x;
        m.ok = variant == 0 ? 0 : 1;
        m.code = variant == 0 ? PROTO_ERR_CHECKSUM : 0;
        assert_int_equal(wire_send(rr, id, id_len, &m, NULL, 0, 0), 0);
        expect_failed(f, f->s, x, variant == 0 ? PROTO_ERR_CHECKSUM : PROTO_ERR_PROTOCOL);
        while (raw_recv(f, rr, 1, 20))
            ; /* the KV_ABORT of variant 1 */
        wire_envelope_reset(f->env);
    }
    raw_close(f, rr);
    assert_all_free(f);
}

// --- aborts

static void test_abort_from_sender(void **state)
{
    fx_t *f = *state;
    int seq = make_seq(f->kvs, 10, 1);
    uint64_t x = begin(f, f->s, 4, seq, 10, 3);
    kvx_send_layer(f->s, x, 0);
    pump(f);
    assert_int_equal(kvx_receiver_n_active(f->r), 1);
    kvx_send_abort(f->s, x);
    kvx_send_abort(f->s, x);      /* twice */
    kvx_send_abort(f->s, 0xabcd); /* unknown */
    assert_int_equal(kvx_send_layer(f->s, x, 1), -1);
    assert_int_equal(kvx_send_end(f->s, x, 1, 1), -1);
    kvx_event ev;
    assert_true(receiver_event(f, &ev));
    assert_int_equal(ev.type, KVX_EV_FAILED);
    assert_int_equal(ev.code, PROTO_ERR_CANCELLED);
    pump(f);
    assert_false(kvx_sender_next_event(f->s, &ev)); /* no event for the caller's own abort */
    assert_all_free(f);
}

static void test_abort_from_receiver(void **state)
{
    fx_t *f = *state;
    int seq = make_seq(f->kvs, 10, 1);
    uint64_t x = begin(f, f->s, 4, seq, 10, 3);
    kvx_send_layer(f->s, x, 0);
    pump(f);
    assert_int_equal(kvx_receiver_abort(f->r, 4), 1);
    assert_int_equal(kvx_receiver_abort(f->r, 4), 0); /* twice */
    assert_int_equal(kvx_receiver_abort(f->r, 777), 0);
    assert_int_equal(kvcache_n_free_blocks(f->kvr), f->free_r0);
    expect_failed(f, f->s, x, PROTO_ERR_CANCELLED);
    assert_int_equal(kvx_send_layer(f->s, x, 1), -1);
    kvx_send_abort(f->s, x); /* after the fact: no-op */
    assert_all_free(f);
}

/* Each side counts every transfer once when it ends: completed (bytes, time), rejected,
 * cancelled; and the DONE / ACCEPTED events carry the transfer's time and size. */
static void test_stats_counters(void **state)
{
    fx_t *f = *state;
    proto_kvx_counters cs, cr;
    kvx_sender_get_stats(f->s, &cs);
    kvx_receiver_get_stats(f->r, &cr);
    assert_true(cs.n_ok == 0 && cr.n_ok == 0 && cs.n_bytes == 0 && cr.n_cancelled == 0);

    int seq = make_seq(f->kvs, 37, 1);
    uint64_t x = begin(f, f->s, 42, seq, 37, 5);
    send_all(f->s, x);
    assert_int_equal(kvx_send_end(f->s, x, 99, 1), 0);
    kvx_event ev, sev;
    assert_true(receiver_event(f, &ev));
    assert_int_equal(ev.type, KVX_EV_ACCEPTED);
    assert_true(sender_event(f, f->s, &sev));
    assert_int_equal(sev.type, KVX_EV_DONE);
    uint64_t bytes = (uint64_t)NL * (uint64_t)kvcache_blocks_for(f->kvs, 37) *
                     kvcache_block_bytes(f->kvs);
    assert_true(ev.n_bytes == bytes && sev.n_bytes == bytes);
    assert_true(ev.xfer_us >= 0 && sev.xfer_us > 0);
    kvcache_seq_free(f->kvr, ev.seq);
    kvx_sender_get_stats(f->s, &cs);
    kvx_receiver_get_stats(f->r, &cr);
    assert_true(cs.n_ok == 1 && cs.n_bytes == bytes && cs.total_us == (uint64_t)sev.xfer_us);
    assert_true(cr.n_ok == 1 && cr.n_bytes == bytes && cr.total_us == (uint64_t)ev.xfer_us);

    /* cancelled by the sender's caller: both sides count a cancel */
    seq = make_seq(f->kvs, 10, 2);
    x = begin(f, f->s, 43, seq, 10, 3);
    kvx_send_layer(f->s, x, 0);
    pump(f);
    kvx_send_abort(f->s, x);
    assert_true(receiver_event(f, &ev));
    assert_int_equal(ev.type, KVX_EV_FAILED);
    /* cancelled by the receiver (gateway CANCEL on the decode side) */
    seq = make_seq(f->kvs, 10, 3);
    x = begin(f, f->s, 44, seq, 10, 3);
    kvx_send_layer(f->s, x, 0);
    pump(f);
    assert_int_equal(kvx_receiver_abort(f->r, 44), 1);
    expect_failed(f, f->s, x, PROTO_ERR_CANCELLED);
    assert_all_free(f);
    kvx_sender_get_stats(f->s, &cs);
    kvx_receiver_get_stats(f->r, &cr);
    assert_true(cs.n_cancelled == 2 && cr.n_cancelled == 2);
    assert_true(cs.n_ok == 1 && cr.n_ok == 1 && cs.n_aborted == 0 && cr.n_aborted == 0);

    /* rejected at KV_BEGIN: fingerprint mismatch */
    mk_receiver(f, FP + 1, 2000);
    seq = make_seq(f->kvs, 5, 4);
    x = begin(f, f->s, 45, seq, 5, 2);
    expect_failed(f, f->s, x, PROTO_ERR_LAYOUT);
    kvx_sender_get_stats(f->s, &cs);
    kvx_receiver_get_stats(f->r, &cr);
    assert_true(cs.n_rejected == 1 && cr.n_rejected == 1 && cs.n_timeouts == 0);
    assert_all_free(f);
}

/* Frames of an aborted transfer that were already on the way must be dropped, and must not
 * touch the blocks the receiver gave to another transfer meanwhile. */
static void test_late_frames_after_abort(void **state)
{
    fx_t *f = *state;
    int sa = make_seq(f->kvs, 12, 11), sb = make_seq(f->kvs, 12, 22);
    uint64_t xa = begin(f, f->s, 1, sa, 12, 1);
    kvx_send_layer(f->s, xa, 0);
    kvx_receiver_process(f->r);  /* A reserved, layer 0 written */
    kvx_receiver_abort(f->r, 1); /* A's blocks are free again (KV_ABORT not read yet) */
    uint64_t xb = begin(f, f->s, 2, sb, 12, 1);
    kvx_receiver_process(f->r);  /* B reserved: it gets A's old blocks */
    kvx_send_layer(f->s, xa, 1); /* late: the sender has not seen the abort */
    kvx_send_layer(f->s, xa, 2);
    send_all(f->s, xb);
    kvx_send_end(f->s, xb, 1, 1);
    kvx_send_end(f->s, xa, 1, 1);
    kvx_event ev;
    assert_true(receiver_event(f, &ev));
    assert_int_equal(ev.type, KVX_EV_ACCEPTED);
    assert_true(ev.rid == 2);
    assert_true(seq_holds(f->kvr, ev.seq, 22, 3));
    pump(f);
    kvx_event other;
    assert_false(kvx_receiver_next_event(f->r, &other));
    kvx_event e1, e2;
    assert_true(sender_event(f, f->s, &e1));
    assert_true(sender_event(f, f->s, &e2));
    kvx_event *fa = e1.xfer == xa ? &e1 : &e2, *fb = e1.xfer == xa ? &e2 : &e1;
    assert_int_equal(fa->type, KVX_EV_FAILED);
    assert_int_equal(fa->code, PROTO_ERR_CANCELLED);
    assert_int_equal(fb->type, KVX_EV_DONE);
    kvcache_seq_free(f->kvr, ev.seq);
    assert_all_free(f);
}

/* A peer that did not open a transfer cannot write into it. */
static void test_foreign_peer_frames_dropped(void **state)
{
    fx_t *f = *state;
    int seq = make_seq(f->kvs, 8, 5);
    uint64_t x = begin(f, f->s, 3, seq, 8, 2);
    pump(f);
    void *d = raw_socket(f, ZMQ_DEALER, f->ep);
    int bogus = make_seq(f->kvs, 8, 6);
    raw_layer(f, d, 3, x, bogus, 0, 2, 2, kvcache_block_bytes(f->kvs), NULL);
    raw_end(d, 3, x, 0);
    proto_msg m;
    proto_msg_init(&m, PROTO_KV_ABORT);
    m.rid = 3;
    m.xfer = x;
    assert_int_equal(wire_send(d, NULL, 0, &m, NULL, 0, 0), 0);
    pump(f);
    assert_int_equal(kvx_receiver_n_active(f->r), 1);
    send_all(f->s, x);
    kvx_send_end(f->s, x, 1, 1);
    kvx_event ev;
    assert_true(receiver_event(f, &ev));
    assert_int_equal(ev.type, KVX_EV_ACCEPTED);
    assert_true(seq_holds(f->kvr, ev.seq, 5, 2));
    kvcache_seq_free(f->kvr, ev.seq);
    kvcache_seq_free(f->kvs, bogus);
    raw_close(f, d);
    assert_all_free(f);
}

/* A second transfer of the same request (a retry) replaces the first. */
static void test_same_rid_supersedes(void **state)
{
    fx_t *f = *state;
    int s1 = make_seq(f->kvs, 8, 1), s2 = make_seq(f->kvs, 8, 2);
    uint64_t x1 = begin(f, f->s, 6, s1, 8, 2);
    kvx_send_layer(f->s, x1, 0);
    pump(f);
    uint64_t x2 = begin(f, f->s, 6, s2, 8, 2);
    send_all(f->s, x2);
    kvx_send_end(f->s, x2, 1, 1);
    kvx_event ev;
    assert_true(receiver_event(f, &ev));
    assert_int_equal(ev.type, KVX_EV_FAILED); /* the old one */
    assert_true(ev.xfer == x1);
    assert_true(receiver_event(f, &ev));
    assert_int_equal(ev.type, KVX_EV_ACCEPTED);
    assert_true(ev.xfer == x2);
    assert_true(seq_holds(f->kvr, ev.seq, 2, 2));
    kvcache_seq_free(f->kvr, ev.seq);
    kvx_event se;
    assert_true(sender_event(f, f->s, &se));
    assert_true(sender_event(f, f->s, &se));
    assert_all_free(f);
}

/* Misuse by the caller: bad begin arguments, a layer twice, END before every layer. */
static void test_sender_misuse(void **state)
{
    fx_t *f = *state;
    int seq = make_seq(f->kvs, 8, 1);
    kvx_begin_params bp = {.rid = 1, .seq = seq, .n_kv_tokens = 9, .max_tokens = 1};
    assert_true(kvx_send_begin(f->s, f->ep, &bp) == 0); /* more tokens than blocks */
    bp.n_kv_tokens = 8;
    bp.seq = MAXSEQ - 1; /* inactive */
    assert_true(kvx_send_begin(f->s, f->ep, &bp) == 0);
    bp.seq = seq;
    bp.rid = 0;
    assert_true(kvx_send_begin(f->s, f->ep, &bp) == 0);
    assert_int_equal(kvcache_seq_active(f->kvs, seq), 1); /* still the caller's */
    uint64_t x = begin(f, f->s, 1, seq, 8, 2);
    kvx_send_layer(f->s, x, 0);
    assert_int_equal(kvx_send_layer(f->s, x, 0), -1);
    expect_failed(f, f->s, x, PROTO_ERR_INTERNAL);
    int seq2 = make_seq(f->kvs, 8, 1);
    x = begin(f, f->s, 2, seq2, 8, 2);
    kvx_send_layer(f->s, x, 0);
    assert_int_equal(kvx_send_end(f->s, x, 1, 1), -1);
    expect_failed(f, f->s, x, PROTO_ERR_INTERNAL);
    kvx_event ev;
    for (int i = 0; i < 2; i++) /* the receiver saw KV_ABORTs */
        assert_true(receiver_event(f, &ev));
    assert_all_free(f);
}

// --- MTP: module layers and the hand-off state (docs/kvtransfer.md)

#define NMTP 2                      /* module layers after the NL main ones */
#define MFP 0x6d7470f00dull         /* module fingerprint */
#define NHID 6                      /* hand-off floats */

/* Replace the fixture's caches with NL + NMTP layers; the receiver knows modules
 * (n_mtp, fp, n_hidden) as given. */
static void mtp_fixture(fx_t *f, int r_n_mtp, uint64_t r_fp, int r_n_hidden)
{
    kvx_sender_destroy(&f->s);
    kvx_receiver_destroy(&f->r);
    kvcache_destroy(&f->kvs);
    kvcache_destroy(&f->kvr);
    f->kvs = mk_kv(NL + NMTP, NKH, HD, BS, NBLK);
    f->kvr = mk_kv(NL + r_n_mtp, NKH, HD, BS, NBLK);
    f->s = mk_sender(f, f->kvs, 2000);
    snprintf(f->ep, sizeof(f->ep), "inproc://kvx-test-%d", ++endpoint_counter);
    kvx_receiver_params p = kvx_receiver_default_params();
    p.fingerprint = FP;
    p.lease_ms = 2000;
    p.n_mtp = r_n_mtp;
    p.mtp_fp = r_fp;
    p.n_hidden = r_n_hidden;
    f->r = kvx_receiver_new(f->zctx, f->kvr, f->ep, &p);
    assert_non_null(f->r);
    f->free_s0 = kvcache_n_free_blocks(f->kvs);
    f->free_r0 = kvcache_n_free_blocks(f->kvr);
}

/* Transfer 9 tokens with the module layers (or only the main ones) and the hand-off state;
 * returns the ACCEPTED event (the caller frees ev->hidden and the sequence). */
static void mtp_transfer(fx_t *f, int with_modules, kvx_event *ev)
{
    const float hid[NHID] = {1.5f, -2.0f, 3.25f, 0.0f, 1e-3f, -7.0f};
    int seq = make_seq(f->kvs, 9, 3);
    kvx_begin_params bp = {.rid = 77,
                           .seq = seq,
                           .n_kv_tokens = 9,
                           .max_tokens = 4,
                           .top_p = 1.0f,
                           .n_layer = with_modules ? NL + NMTP : NL,
                           .n_mtp = with_modules ? NMTP : 0,
                           .mtp_fp = with_modules ? MFP : 0,
                           .n_hidden = with_modules ? NHID : 0,
                           .mtp = 3};
    uint64_t x = kvx_send_begin(f->s, f->ep, &bp);
    assert_true(x != 0);
    for (int l = 0; l < bp.n_layer; l++)
        assert_int_equal(kvx_send_layer(f->s, x, l), 0);
    if (with_modules)
        assert_int_equal(kvx_send_end_mtp(f->s, x, 5, 11, hid, NHID), 0);
    else
        assert_int_equal(kvx_send_end(f->s, x, 5, 11), 0);
    assert_true(receiver_event(f, ev));
    assert_int_equal(ev->type, KVX_EV_ACCEPTED);
    assert_int_equal(ev->mtp, 3);
    if (ev->mtp_ok) {
        assert_int_equal(ev->n_hidden, NHID);
        assert_memory_equal(ev->hidden, hid, sizeof(hid));
    }
    kvx_event sev;
    assert_true(sender_event(f, f->s, &sev));
    assert_int_equal(sev.type, KVX_EV_DONE);
}

/* Block 0 of seq in layer l holds the sender's values (seed 3). */
static int layer_holds(kvcache_t *kv, int seq, int l)
{
    const int *blocks = kvcache_seq_blocks(kv, seq, NULL);
    const float *d = kvcache_block_data(kv, l, blocks[0]);
    for (int i = 0; i < block_floats(kv); i++)
        if (d[i] != val(3, l, 0, i))
            return 0;
    return 1;
}

static void test_mtp_transfer(void **state)
{
    fx_t *f = *state;
    mtp_fixture(f, NMTP, MFP, NHID);
    kvx_event ev;
    mtp_transfer(f, 1, &ev);
    assert_int_equal(ev.mtp_ok, 1);
    assert_true(seq_holds(f->kvr, ev.seq, 3, 3)); /* every layer, modules included */
    free(ev.hidden);
    kvcache_seq_free(f->kvr, ev.seq);
    assert_all_free(f);
}

/* Modules the receiver does not have (another fingerprint, fewer layers, another state
 * size): the main layers are taken, the module layers and the state dropped. */
static void test_mtp_modules_dropped(void **state)
{
    fx_t *f = *state;
    const struct {
        int n_mtp;
        uint64_t fp;
        int n_hidden;
    } cases[] = {{NMTP, MFP ^ 1, NHID}, {1, MFP, NHID}, {NMTP, MFP, NHID + 1}, {0, 0, 0}};
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        mtp_fixture(f, cases[c].n_mtp, cases[c].fp, cases[c].n_hidden);
        kvx_event ev;
        mtp_transfer(f, 1, &ev);
        assert_int_equal(ev.mtp_ok, 0);
        assert_null(ev.hidden);
        for (int l = 0; l < NL; l++)
            assert_true(layer_holds(f->kvr, ev.seq, l));
        for (int l = NL; l < NL + cases[c].n_mtp; l++) /* untouched: still zero */
            assert_false(layer_holds(f->kvr, ev.seq, l));
        kvcache_seq_free(f->kvr, ev.seq);
        assert_all_free(f);
    }
}

/* A transfer of the main layers only (a request without MTP) to a worker with modules. */
static void test_mtp_main_layers_only(void **state)
{
    fx_t *f = *state;
    mtp_fixture(f, NMTP, MFP, NHID);
    kvx_event ev;
    mtp_transfer(f, 0, &ev);
    assert_int_equal(ev.mtp_ok, 0);
    assert_null(ev.hidden);
    for (int l = 0; l < NL; l++)
        assert_true(layer_holds(f->kvr, ev.seq, l));
    kvcache_seq_free(f->kvr, ev.seq);
    /* a sender that knows its cache's module layers sends the main ones by default; a
     * layer such a transfer does not carry is a caller bug */
    kvx_sender_destroy(&f->s);
    kvx_sender_params sp = kvx_sender_default_params();
    sp.fingerprint = FP;
    sp.n_mtp = NMTP;
    f->s = kvx_sender_new(f->zctx, f->kvs, &sp);
    assert_non_null(f->s);
    int seq = make_seq(f->kvs, 9, 3);
    kvx_begin_params bp = {.rid = 78, .seq = seq, .n_kv_tokens = 9, .max_tokens = 4,
                           .top_p = 1.0f};
    uint64_t x = kvx_send_begin(f->s, f->ep, &bp);
    assert_true(x != 0);
    assert_int_equal(kvx_send_layer(f->s, x, NL), -1);
    expect_failed(f, f->s, x, PROTO_ERR_INTERNAL);
    assert_true(receiver_event(f, &ev)); /* the receiver hears KV_ABORT */
    assert_int_equal(ev.type, KVX_EV_FAILED);
    assert_all_free(f);
}

/* The main layers must match: a sender whose layers are split otherwise is refused. */
static void test_mtp_layout_main_mismatch(void **state)
{
    fx_t *f = *state;
    mtp_fixture(f, NMTP, MFP, NHID);
    int seq = make_seq(f->kvs, 5, 1);
    kvx_begin_params bp = {.rid = 8, .seq = seq, .n_kv_tokens = 5, .max_tokens = 2,
                           .top_p = 1.0f, .n_layer = NL + NMTP, .n_mtp = 1, .mtp_fp = MFP,
                           .n_hidden = NHID};
    uint64_t x = kvx_send_begin(f->s, f->ep, &bp);
    assert_true(x != 0);
    expect_failed(f, f->s, x, PROTO_ERR_LAYOUT);
    /* bad MTP params never start */
    bp.n_mtp = NL + NMTP;
    assert_true(kvx_send_begin(f->s, f->ep, &bp) == 0);
    bp.n_mtp = 0;
    bp.n_layer = NL + NMTP + 1;
    assert_true(kvx_send_begin(f->s, f->ep, &bp) == 0);
    kvcache_seq_free(f->kvs, seq);
    assert_all_free(f);
}

/* KV_END must carry exactly the announced state: the sender refuses a mismatch, the
 * receiver NACKs a KV_END without it. */
static void test_mtp_hidden_mismatch(void **state)
{
    fx_t *f = *state;
    mtp_fixture(f, NMTP, MFP, NHID);
    int seq = make_seq(f->kvs, 5, 1);
    kvx_begin_params bp = {.rid = 9, .seq = seq, .n_kv_tokens = 5, .max_tokens = 2,
                           .top_p = 1.0f, .n_layer = NL + NMTP, .n_mtp = NMTP, .mtp_fp = MFP,
                           .n_hidden = NHID};
    uint64_t x = kvx_send_begin(f->s, f->ep, &bp);
    for (int l = 0; l < NL + NMTP; l++)
        assert_int_equal(kvx_send_layer(f->s, x, l), 0);
    assert_int_equal(kvx_send_end(f->s, x, 1, 1), -1); /* no state: refused */
    expect_failed(f, f->s, x, PROTO_ERR_INTERNAL);
    kvx_event ev;
    assert_true(receiver_event(f, &ev)); /* the receiver hears KV_ABORT */
    assert_int_equal(ev.type, KVX_EV_FAILED);
    /* a raw peer announcing a state and not sending it */
    void *d = raw_socket(f, ZMQ_DEALER, f->ep);
    proto_msg m;
    raw_begin_msg(&m, 10, 100, 4, 2);
    m.n_layer = NL + NMTP;
    m.n_mtp = NMTP;
    m.mtp_fp = MFP;
    m.n_hidden = NHID;
    assert_int_equal(wire_send(d, NULL, 0, &m, NULL, 0, 0), 0);
    assert_true(raw_recv(f, d, 0, 2000));
    assert_int_equal(wire_envelope_msg(f->env)->ok, 1);
    XXH64_state_t *h = XXH64_createState();
    XXH64_reset(h, 0);
    int rseq = make_seq(f->kvs, 4, 2);
    for (int l = 0; l < NL + NMTP; l++)
        raw_range(f, d, 10, 100, rseq, l, 0, 1, h);
    raw_end(d, 10, 100, XXH64_digest(h));
    XXH64_freeState(h);
    expect_raw_reply(f, d, PROTO_KV_RESULT, PROTO_ERR_PROTOCOL);
    raw_close(f, d);
    kvcache_seq_free(f->kvs, rseq);
    assert_all_free(f);
}

// --- padding (emulated KV size; docs/kvtransfer.md "Padding")

#define BLK_BYTES ((uint64_t)2 * BS * NKH * HD * sizeof(float)) /* 256 */

/* A sender that pads every transfer to bytes_per_token (f->s2, destroyed by teardown). */
static kvx_sender_t *mk_pad_sender(fx_t *f, uint64_t bytes_per_token)
{
    kvx_sender_params p = kvx_sender_default_params();
    p.fingerprint = FP;
    p.lease_ms = 2000;
    p.pad_to_bytes_per_token = bytes_per_token;
    kvx_sender_destroy(&f->s2);
    f->s2 = kvx_sender_new(f->zctx, f->kvs, &p);
    assert_non_null(f->s2);
    return f->s2;
}

/* The padding a KV_LAYER of blocks [blk0, blk0 + n) of `layer` must carry, computed block
 * by block from the rule (pad / N each, one more for the first pad % N pairs). */
static uint64_t want_pad(uint64_t pad, int n_blocks, int layer, int blk0, int n)
{
    uint64_t n_all = (uint64_t)NL * (uint64_t)n_blocks, sum = 0;
    for (int b = blk0; b < blk0 + n; b++) {
        uint64_t i = (uint64_t)layer * (uint64_t)n_blocks + (uint64_t)b;
        sum += pad / n_all + (i < pad % n_all ? 1 : 0);
    }
    return sum;
}

/* Let the extra sender release its finished transfers, then check every block is free. */
static void assert_all_free_s2(fx_t *f)
{
    for (int i = 0; i < 200 && f->s2 && kvx_sender_n_active(f->s2); i++) {
        kvx_sender_process(f->s2);
        pump(f);
    }
    if (f->s2)
        assert_int_equal(kvx_sender_n_active(f->s2), 0);
    assert_all_free(f);
}

/* Padded transfers through the real receiver: the bytes both sides count are
 * n_kv_tokens x bytes_per_token exactly (real KV + padding), the KV arrives intact, and a
 * transfer whose real KV is already that large is not padded. */
static void test_pad_counted_bytes_exact(void **state)
{
    fx_t *f = *state;
    static const struct {
        int n_kv;
        uint64_t per_tok, want;
    } cases[] = {
        {37, 1000, 37000},      /* 10 blocks: real 7680 + pad 29320 */
        {5, 308, 1540},         /* 2 blocks: real 1536 + pad 4 (< 6 pairs: empty frames) */
        {1, 131072, 131072},    /* a100-llama3-8b's bytes per token, one token */
        {37, 1, NL * 10 * 256}, /* real KV larger than asked: not padded */
    };
    uint64_t total = 0;
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        kvx_sender_t *s = mk_pad_sender(f, cases[c].per_tok);
        int n_kv = cases[c].n_kv, seed = (int)c + 3;
        int seq = make_seq(f->kvs, n_kv, seed);
        uint64_t x = begin(f, s, 50 + c, seq, n_kv, 3);
        int nb = kvcache_blocks_for(f->kvs, n_kv);
        for (int l = 0; l < NL; l++) { /* in two ranges when it can: as a chunked prefill */
            if (nb > 1)
                assert_int_equal(kvx_send_layer_blocks(s, x, l, 0, 1), 0);
            assert_int_equal(kvx_send_layer(s, x, l), 0);
        }
        assert_int_equal(kvx_send_end(s, x, 5, 6), 0);
        kvx_event ev, sev;
        assert_true(receiver_event(f, &ev));
        assert_int_equal(ev.type, KVX_EV_ACCEPTED);
        assert_true(seq_holds(f->kvr, ev.seq, seed, nb));
        assert_true(sender_event(f, s, &sev));
        assert_int_equal(sev.type, KVX_EV_DONE);
        assert_true(ev.n_bytes == cases[c].want);
        assert_true(sev.n_bytes == cases[c].want);
        total += cases[c].want;
        proto_kvx_counters cs, cr;
        kvx_sender_get_stats(s, &cs);
        kvx_receiver_get_stats(f->r, &cr);
        assert_true(cs.n_ok == 1 && cs.n_bytes == cases[c].want);
        assert_true(cr.n_ok == c + 1 && cr.n_bytes == total && cr.n_aborted == 0);
        kvcache_seq_free(f->kvr, ev.seq);
        assert_all_free_s2(f);
    }
    /* more than 2^24 bytes per token is refused */
    kvx_sender_params p = kvx_sender_default_params();
    p.pad_to_bytes_per_token = (1u << 24) + 1;
    assert_null(kvx_sender_new(f->zctx, f->kvs, &p));
}

/* One whole message read from a raw ROUTER. */
typedef struct {
    unsigned char id[256];
    size_t id_len;
    unsigned char hdr[4096];
    size_t hdr_len;
    proto_msg m;
    int n_frames;
    size_t sizes[16];
    int last_zero; /* every byte of the last payload frame is 0 */
} wire_msg;

static int wire_more(void *sock)
{
    int more = 0;
    size_t sz = sizeof(more);
    zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &sz);
    return more;
}

/* Read the next message on a raw ROUTER (pumping kvx meanwhile). Returns 1, or 0 if none
 * came within 2 s. */
static int fx_wire_recv(fx_t *f, void *router, wire_msg *w)
{
    memset(w, 0, sizeof(*w));
    zmq_msg_t part;
    int got = 0;
    for (int i = 0; i < 2000 && !got; i++) {
        pump_once(f);
        if (f->s2)
            kvx_sender_process(f->s2);
        zmq_msg_init(&part);
        got = zmq_msg_recv(&part, router, ZMQ_DONTWAIT) >= 0;
        if (!got) {
            zmq_msg_close(&part);
            usleep(1000);
        }
    }
    if (!got)
        return 0;
    w->id_len = zmq_msg_size(&part);
    assert_true(w->id_len <= sizeof(w->id) && wire_more(router));
    memcpy(w->id, zmq_msg_data(&part), w->id_len);
    zmq_msg_close(&part);
    zmq_msg_init(&part);
    assert_true(zmq_msg_recv(&part, router, 0) >= 0);
    w->hdr_len = zmq_msg_size(&part);
    assert_true(w->hdr_len <= sizeof(w->hdr));
    memcpy(w->hdr, zmq_msg_data(&part), w->hdr_len);
    zmq_msg_close(&part);
    char err[160];
    assert_int_equal(proto_decode(w->hdr, w->hdr_len, &w->m, err, sizeof(err)), 0);
    while (wire_more(router)) {
        zmq_msg_init(&part);
        assert_true(zmq_msg_recv(&part, router, 0) >= 0);
        assert_true(w->n_frames < 16);
        size_t n = zmq_msg_size(&part);
        const unsigned char *d = zmq_msg_data(&part);
        w->sizes[w->n_frames++] = n;
        w->last_zero = 1;
        for (size_t k = 0; k < n; k++)
            if (d[k])
                w->last_zero = 0;
        zmq_msg_close(&part);
    }
    return 1;
}

/* 1 when the msgpack header has the key "pad" (fixstr of 3). */
static int wire_has_pad_key(const wire_msg *w)
{
    return memmem(w->hdr, w->hdr_len, "\xa3pad", 4) != NULL;
}

/* Answer a raw-captured transfer as a receiver would: KV_BEGIN_ACK ok, KV_RESULT ok. */
static void wire_reply(void *router, const wire_msg *w, proto_type_t type)
{
    proto_msg m;
    proto_msg_init(&m, type);
    m.rid = w->m.rid;
    m.xfer = w->m.xfer;
    m.ok = 1;
    m.lease_ms = 1000;
    assert_int_equal(wire_send(router, w->id, w->id_len, &m, NULL, 0, 0), 0);
}

/* Run one transfer of n_kv tokens from sender s to a raw ROUTER, each layer in the ranges
 * cuts[0..n_cuts] (block indices), and check every message on the wire: KV_BEGIN's "pad"
 * (absent when want_pad_total is 0), every KV_LAYER's frames (one padding frame of exactly
 * its share, all zeros, when padded; none otherwise). Returns the payload bytes seen. */
static uint64_t wire_transfer(fx_t *f, kvx_sender_t *s, int n_kv, const int *cuts, int n_cuts,
                              uint64_t want_pad_total)
{
    char ep[64];
    snprintf(ep, sizeof(ep), "inproc://kvx-wire-%d", ++endpoint_counter);
    void *router = raw_socket(f, ZMQ_ROUTER, ep);
    int seq = make_seq(f->kvs, n_kv, 2);
    int nb = kvcache_blocks_for(f->kvs, n_kv);
    kvx_begin_params bp = {.rid = 77, .seq = seq, .n_kv_tokens = n_kv, .max_tokens = 2};
    uint64_t x = kvx_send_begin(s, ep, &bp);
    assert_true(x != 0);
    for (int c = 0; c < n_cuts; c++)
        for (int l = 0; l < NL; l++)
            assert_int_equal(kvx_send_layer_blocks(s, x, l, cuts[c], cuts[c + 1] - cuts[c]), 0);
    assert_int_equal(kvx_send_end(s, x, 1, 2), 0);

    wire_msg w;
    assert_true(fx_wire_recv(f, router, &w));
    assert_int_equal(w.m.type, PROTO_KV_BEGIN);
    assert_int_equal(w.n_frames, 0);
    assert_true((uint64_t)w.m.pad_bytes == want_pad_total);
    assert_int_equal(wire_has_pad_key(&w), want_pad_total > 0);
    wire_reply(router, &w, PROTO_KV_BEGIN_ACK);
    uint64_t seen = 0, pad_seen = 0;
    for (int i = 0; i < n_cuts * NL; i++) {
        assert_true(fx_wire_recv(f, router, &w));
        assert_int_equal(w.m.type, PROTO_KV_LAYER);
        int n = w.m.n_blocks;
        assert_int_equal(w.n_frames, n + (want_pad_total ? 1 : 0));
        for (int k = 0; k < n; k++)
            assert_true(w.sizes[k] == BLK_BYTES);
        seen += (uint64_t)n * BLK_BYTES;
        if (want_pad_total) {
            uint64_t share = want_pad(want_pad_total, nb, w.m.layer, w.m.blk0, n);
            assert_true(w.sizes[n] == share);
            assert_true(w.last_zero);
            seen += share;
            pad_seen += share;
        }
        proto_msg_clear(&w.m);
    }
    assert_true(fx_wire_recv(f, router, &w));
    assert_int_equal(w.m.type, PROTO_KV_END);
    assert_int_equal(w.n_frames, 0);
    assert_true(pad_seen == want_pad_total);
    wire_reply(router, &w, PROTO_KV_RESULT);
    kvx_event sev;
    assert_true(sender_event(f, s, &sev));
    assert_int_equal(sev.type, KVX_EV_DONE);
    assert_true(sev.n_bytes == seen);
    raw_close(f, router);
    assert_all_free_s2(f);
    return seen;
}

/* The padded wire, message by message: KV_BEGIN declares the padding, each KV_LAYER (a
 * chunked prefill's ranges 3, 1, 6 of 10 blocks) carries its share as one zero frame,
 * and the shares add up to n_kv_tokens x bytes_per_token exactly. */
static void test_pad_wire_exact(void **state)
{
    fx_t *f = *state;
    kvx_sender_t *s = mk_pad_sender(f, 1000);
    static const int cuts[] = {0, 3, 4, 10};
    uint64_t real = (uint64_t)NL * 10 * BLK_BYTES; /* 37 tokens = 10 blocks */
    assert_true(wire_transfer(f, s, 37, cuts, 3, 37 * 1000 - real) == 37 * 1000);
    static const int whole[] = {0, 10};
    assert_true(wire_transfer(f, s, 37, whole, 1, 37 * 1000 - real) == 37 * 1000);
}

/* Without padding the wire is exactly the old one: no "pad" key, n_blocks frames per
 * KV_LAYER, the real KV's bytes; also from a padding sender whose real KV is already as
 * large as asked. */
static void test_pad_absent_wire_unchanged(void **state)
{
    fx_t *f = *state;
    static const int cuts[] = {0, 3, 4, 10};
    uint64_t real = (uint64_t)NL * 10 * BLK_BYTES;
    assert_true(wire_transfer(f, f->s, 37, cuts, 3, 0) == real);
    kvx_sender_t *s = mk_pad_sender(f, 1); /* 37 bytes asked, 7680 real */
    assert_true(wire_transfer(f, s, 37, cuts, 3, 0) == real);
}

/* A raw padded KV_LAYER: blocks [blk0, blk0 + n) of `layer`, then n_pad frames of pad_size
 * zero bytes. h (optional) hashes the blocks only, as the checksum covers the real KV. */
static void raw_range_pad(fx_t *f, void *sock, uint64_t xfer, int seq, int layer, int blk0,
                          int n, size_t pad_size, int n_pad, XXH64_state_t *h)
{
    zmq_msg_t frames[16];
    int nb;
    const int *blocks = kvcache_seq_blocks(f->kvs, seq, &nb);
    for (int i = 0; i < n; i++) {
        zmq_msg_init_size(&frames[i], BLK_BYTES);
        memcpy(zmq_msg_data(&frames[i]), kvcache_block_data(f->kvs, layer, blocks[blk0 + i]),
               BLK_BYTES);
        if (h)
            XXH64_update(h, zmq_msg_data(&frames[i]), BLK_BYTES);
    }
    for (int i = n; i < n + n_pad; i++) {
        zmq_msg_init_size(&frames[i], pad_size);
        memset(zmq_msg_data(&frames[i]), 0, pad_size);
    }
    proto_msg m;
    proto_msg_init(&m, PROTO_KV_LAYER);
    m.rid = 9;
    m.xfer = xfer;
    m.layer = layer;
    m.blk0 = blk0;
    m.n_blocks = n;
    assert_int_equal(wire_send(sock, NULL, 0, &m, frames, n + n_pad, 0), 0);
}

static int raw_begin_pad(fx_t *f, void *sock, uint64_t xfer, int n_kv, int64_t pad)
{
    proto_msg m;
    raw_begin_msg(&m, 9, xfer, n_kv, 4);
    m.pad_bytes = pad;
    assert_int_equal(wire_send(sock, NULL, 0, &m, NULL, 0, 0), 0);
    assert_true(raw_recv(f, sock, 0, 2000));
    proto_msg *a = wire_envelope_msg(f->env);
    assert_int_equal(a->type, PROTO_KV_BEGIN_ACK);
    return a->ok;
}

/* The receiver checks padding frames exactly: a transfer declaring pad = 1000 over 8
 * tokens (2 blocks x 3 layers: shares 167, 167, 167, 167, 166, 166) is accepted with
 * frames of exactly those sizes and a checksum over the KV only, and counts
 * 1536 + 1000 bytes; a padding frame one byte off, missing or doubled aborts it
 * (KV_ABORT PROTOCOL), frees its blocks and counts nothing. */
static void test_pad_wrong_size_rejected(void **state)
{
    fx_t *f = *state;
    int seq = make_seq(f->kvs, 8, 1);
    void *d = raw_socket(f, ZMQ_DEALER, f->ep);
    /* exact: accepted */
    assert_true(raw_begin_pad(f, d, 300, 8, 1000));
    XXH64_state_t *h = XXH64_createState();
    XXH64_reset(h, 0);
    for (int l = 0; l < NL; l++)
        raw_range_pad(f, d, 300, seq, l, 0, 2, (size_t)want_pad(1000, 2, l, 0, 2), 1, h);
    raw_end(d, 9, 300, XXH64_digest(h));
    XXH64_freeState(h);
    kvx_event ev;
    assert_true(receiver_event(f, &ev));
    assert_int_equal(ev.type, KVX_EV_ACCEPTED);
    assert_true(ev.n_bytes == 3 * 2 * BLK_BYTES + 1000);
    assert_true(seq_holds(f->kvr, ev.seq, 1, 2));
    assert_true(raw_recv(f, d, 0, 2000)); /* KV_RESULT ok */
    assert_int_equal(wire_envelope_msg(f->env)->type, PROTO_KV_RESULT);
    assert_int_equal(wire_envelope_msg(f->env)->ok, 1);
    kvcache_seq_free(f->kvr, ev.seq);

    /* wrong: one byte more, one less, no padding frame, two padding frames, a padding
     * frame on layer 1 after a good layer 0 */
    static const struct {
        int delta, n_pad, layer;
    } bad[] = {{1, 1, 0}, {-1, 1, 0}, {0, 0, 0}, {0, 2, 0}, {1, 1, 1}};
    for (int v = 0; v < 5; v++) {
        uint64_t xfer = 301 + (uint64_t)v;
        assert_true(raw_begin_pad(f, d, xfer, 8, 1000));
        if (bad[v].layer == 1)
            raw_range_pad(f, d, xfer, seq, 0, 0, 2, (size_t)want_pad(1000, 2, 0, 0, 2), 1, NULL);
        size_t share = (size_t)want_pad(1000, 2, bad[v].layer, 0, 2);
        raw_range_pad(f, d, xfer, seq, bad[v].layer, 0, 2, share + (size_t)bad[v].delta,
                      bad[v].n_pad, NULL);
        expect_raw_reply(f, d, PROTO_KV_ABORT, PROTO_ERR_PROTOCOL);
        assert_int_equal(kvx_receiver_n_active(f->r), 0);
    }
    /* an unpadded transfer's KV_LAYER with a frame too many is refused as before */
    assert_true(raw_begin(f, d, 9, 310, 8));
    raw_range_pad(f, d, 310, seq, 0, 0, 2, 10, 1, NULL);
    expect_raw_reply(f, d, PROTO_KV_ABORT, PROTO_ERR_PROTOCOL);
    proto_kvx_counters cr;
    kvx_receiver_get_stats(f->r, &cr);
    assert_true(cr.n_ok == 1 && cr.n_bytes == 3 * 2 * BLK_BYTES + 1000 && cr.n_aborted == 6);
    kvcache_seq_free(f->kvs, seq);
    raw_close(f, d);
    assert_all_free(f);
}

// --- prefix caching: only the blocks the receiver lacks are sent (docs/prefix-cache.md)

#define PFX_SEED kvcache_prefix_seed_mtp(FP, 0, 0)

/* A receiver whose KV_BEGIN with block hashes shares its cached blocks. */
static void mk_receiver_pfx(fx_t *f)
{
    kvx_receiver_destroy(&f->r);
    snprintf(f->ep, sizeof(f->ep), "inproc://kvx-test-%d", ++endpoint_counter);
    kvx_receiver_params p = kvx_receiver_default_params();
    p.fingerprint = FP;
    p.lease_ms = 2000;
    p.headroom_tokens = HEADROOM;
    p.prefix_cache = 1;
    f->r = kvx_receiver_new(f->zctx, f->kvr, f->ep, &p);
    assert_non_null(f->r);
}

/* Prompt ids: the first `shared` are common to every prompt, the rest depend on tag. */
static void pfx_ids(int *ids, int n, int shared, int tag)
{
    for (int i = 0; i < n; i++)
        ids[i] = i < shared ? 100 + i : 1000 * tag + i;
}

/* Begin a transfer of n_kv tokens of seq (ids) listing its full blocks' hashes. */
static uint64_t begin_pfx(fx_t *f, uint64_t rid, int seq, const int *ids, int n_kv,
                          const uint64_t *hs_override)
{
    uint64_t hs[MAXLEN / BS];
    int n_hs = kvcache_prefix_hashes(f->kvs, PFX_SEED, 0, ids, n_kv, MAXLEN / BS, hs);
    assert_int_equal(n_hs, n_kv / BS);
    kvx_begin_params bp = {.rid = rid,
                           .seq = seq,
                           .n_kv_tokens = n_kv,
                           .max_tokens = 4,
                           .top_p = 1.0f,
                           .block_hashes = hs_override ? hs_override : hs,
                           .n_block_hashes = n_hs,
                           .ids = ids};
    uint64_t x = kvx_send_begin(f->s, f->ep, &bp);
    assert_true(x != 0);
    return x;
}

/* Sender seq (n_kv tokens, KV of seed) to the receiver, every layer and KV_END handed to
 * kvx at once (before the ACK could come); returns the ACCEPTED event (the caller frees
 * ev->seq and ev->ids) after checking the sender's DONE carries the same bytes. */
static void xfer_pfx(fx_t *f, uint64_t rid, const int *ids, int n_kv, int seed, kvx_event *ev)
{
    int seq = make_seq(f->kvs, n_kv, seed);
    uint64_t x = begin_pfx(f, rid, seq, ids, n_kv, NULL);
    send_all(f->s, x);
    assert_int_equal(kvx_send_end(f->s, x, 5, 6), 0);
    assert_int_equal(kvx_send_end(f->s, x, 5, 6), -1); /* KV_END kept once */
    assert_true(receiver_event(f, ev));
    assert_int_equal(ev->type, KVX_EV_ACCEPTED);
    assert_int_equal(ev->first_token, 5);
    assert_true(ev->rng == 6);
    assert_int_equal(ev->pfx, 1);
    assert_int_equal(ev->n_ids, n_kv);
    assert_memory_equal(ev->ids, ids, (size_t)n_kv * sizeof(int));
    assert_true(ev->pfx_seed == PFX_SEED);
    assert_int_equal(ev->pfx_la, 0);
    kvx_event sev;
    assert_true(sender_event(f, f->s, &sev));
    assert_int_equal(sev.type, KVX_EV_DONE);
    assert_true(sev.n_bytes == ev->n_bytes);
}

/* The second prompt shares 3 full blocks with the first: the receiver holds them (they
 * were registered when the first arrived), answers have = 3, and only blocks 3 and 4 of
 * each layer travel; its sequence holds the first prompt's KV in the shared blocks and
 * the second's in the rest. */
static void test_prefix_sends_missing_blocks(void **state)
{
    fx_t *f = *state;
    mk_receiver_pfx(f);
    size_t bb = kvcache_block_bytes(f->kvr);
    int a[14], b[18];
    pfx_ids(a, 14, 13, 1);
    pfx_ids(b, 18, 13, 2);
    kvx_event ev;
    xfer_pfx(f, 1, a, 14, 3, &ev);
    assert_int_equal(ev.have_blocks, 0);
    assert_true(ev.n_bytes == (uint64_t)NL * 4 * bb);
    assert_true(seq_holds(f->kvr, ev.seq, 3, 4));
    assert_int_equal(kvcache_n_cached_blocks(f->kvr), 3); /* its full blocks, registered */
    int a_blocks[3];
    memcpy(a_blocks, kvcache_seq_blocks(f->kvr, ev.seq, NULL), sizeof(a_blocks));
    kvcache_seq_free(f->kvr, ev.seq);
    free(ev.ids);
    assert_int_equal(kvcache_n_lru_blocks(f->kvr), 3);

    xfer_pfx(f, 2, b, 18, 4, &ev);
    assert_int_equal(ev.have_blocks, 3);
    assert_true(ev.n_bytes == (uint64_t)NL * 2 * bb); /* blocks 3 and 4 only */
    const int *blk = kvcache_seq_blocks(f->kvr, ev.seq, NULL);
    for (int k = 0; k < 3; k++) {
        assert_int_equal(blk[k], a_blocks[k]); /* shared, pinned by the sequence */
        assert_int_equal(kvcache_block_refcount(f->kvr, blk[k]), 1);
    }
    assert_int_equal(kvcache_n_lru_blocks(f->kvr), 0);
    for (int l = 0; l < NL; l++)
        for (int k = 0; k < 5; k++) {
            const float *d = kvcache_block_data(f->kvr, l, blk[k]);
            for (int i = 0; i < block_floats(f->kvr); i++)
                assert_true(d[i] == val(k < 3 ? 3 : 4, l, k, i));
        }
    assert_int_equal(kvcache_n_cached_blocks(f->kvr), 4); /* + b's block 3 */
    kvcache_seq_free(f->kvr, ev.seq);
    free(ev.ids);
    assert_all_free(f);
}

/* Every listed block cached and the prompt a whole number of blocks: no block of any
 * layer is sent, KV_END alone completes the transfer. */
static void test_prefix_all_blocks_cached(void **state)
{
    fx_t *f = *state;
    mk_receiver_pfx(f);
    int a[16];
    pfx_ids(a, 16, 16, 1);
    kvx_event ev;
    xfer_pfx(f, 1, a, 16, 3, &ev);
    kvcache_seq_free(f->kvr, ev.seq);
    free(ev.ids);
    xfer_pfx(f, 2, a, 16, 9, &ev);
    assert_int_equal(ev.have_blocks, 4);
    assert_true(ev.n_bytes == 0);
    assert_true(seq_holds(f->kvr, ev.seq, 3, 4)); /* the first transfer's KV */
    kvcache_seq_free(f->kvr, ev.seq);
    free(ev.ids);
    assert_all_free(f);
}

/* A receiver without prefix caching ignores the hashes: have = 0, every block travels,
 * nothing is registered; the event has no ids. */
static void test_prefix_receiver_off(void **state)
{
    fx_t *f = *state;
    int a[14];
    pfx_ids(a, 14, 14, 1);
    for (int rep = 0; rep < 2; rep++) {
        int seq = make_seq(f->kvs, 14, 3);
        uint64_t x = begin_pfx(f, 1 + (uint64_t)rep, seq, a, 14, NULL);
        send_all(f->s, x);
        assert_int_equal(kvx_send_end(f->s, x, 5, 6), 0);
        kvx_event ev;
        assert_true(receiver_event(f, &ev));
        assert_int_equal(ev.type, KVX_EV_ACCEPTED);
        assert_int_equal(ev.pfx, 0);
        assert_null(ev.ids);
        assert_int_equal(ev.have_blocks, 0);
        assert_true(ev.n_bytes == (uint64_t)NL * 4 * kvcache_block_bytes(f->kvr));
        assert_true(seq_holds(f->kvr, ev.seq, 3, 4));
        kvcache_seq_free(f->kvr, ev.seq);
        kvx_event sev;
        assert_true(sender_event(f, f->s, &sev));
        assert_int_equal(sev.type, KVX_EV_DONE);
    }
    assert_int_equal(kvcache_n_cached_blocks(f->kvr), 0);
    assert_all_free(f);
}

/* Hashes that are not those of the ids: KV_BEGIN refused (protocol), nothing kept. */
static void test_prefix_hash_mismatch_rejected(void **state)
{
    fx_t *f = *state;
    mk_receiver_pfx(f);
    int a[14];
    pfx_ids(a, 14, 14, 1);
    uint64_t hs[3];
    assert_int_equal(kvcache_prefix_hashes(f->kvs, PFX_SEED, 0, a, 14, 3, hs), 3);
    hs[1] ^= 1;
    int seq = make_seq(f->kvs, 14, 3);
    uint64_t x = begin_pfx(f, 1, seq, a, 14, hs);
    send_all(f->s, x);
    expect_failed(f, f->s, x, PROTO_ERR_PROTOCOL);
    assert_int_equal(kvcache_n_cached_blocks(f->kvr), 0);
    assert_all_free(f);
}

/* Every hash forced to 0 on both sides: hashes collide, but a cached block is shared only
 * when its token ids match, so a prompt with other ids shares nothing and gets its own KV. */
static void test_prefix_collision_confirmed_on_ids(void **state)
{
    fx_t *f = *state;
    mk_receiver_pfx(f);
    kvcache_set_hash_bits(f->kvs, 0);
    kvcache_set_hash_bits(f->kvr, 0);
    int a[14], b[14];
    pfx_ids(a, 14, 0, 1);
    pfx_ids(b, 14, 0, 2);
    kvx_event ev;
    xfer_pfx(f, 1, a, 14, 3, &ev);
    kvcache_seq_free(f->kvr, ev.seq);
    free(ev.ids);
    xfer_pfx(f, 2, b, 14, 4, &ev);
    assert_int_equal(ev.have_blocks, 0);
    assert_true(seq_holds(f->kvr, ev.seq, 4, 4));
    kvcache_seq_free(f->kvr, ev.seq);
    free(ev.ids);
    xfer_pfx(f, 3, a, 14, 5, &ev); /* a again: its blocks are found, on their ids */
    assert_int_equal(ev.have_blocks, 3);
    kvcache_seq_free(f->kvr, ev.seq);
    free(ev.ids);
    assert_all_free(f);
}

/* A transfer that shares cached blocks and is then cancelled (by the sender, by the
 * receiver) or times out: its pins go, the blocks stay cached and free, none leaks. */
static void test_prefix_abort_releases_pins(void **state)
{
    fx_t *f = *state;
    mk_receiver_pfx(f);
    int a[14];
    pfx_ids(a, 14, 14, 1);
    kvx_event ev;
    xfer_pfx(f, 1, a, 14, 3, &ev);
    kvcache_seq_free(f->kvr, ev.seq);
    free(ev.ids);
    for (int how = 0; how < 2; how++) {
        int seq = make_seq(f->kvs, 14, 3);
        uint64_t x = begin_pfx(f, 10 + (uint64_t)how, seq, a, 14, NULL);
        assert_int_equal(kvx_send_layer(f->s, x, 0), 0);
        pump(f);
        assert_int_equal(kvx_receiver_n_active(f->r), 1);
        assert_int_equal(kvcache_n_lru_blocks(f->kvr), 0); /* pinned by the transfer */
        if (how == 0) {
            kvx_send_abort(f->s, x);
            assert_true(receiver_event(f, &ev));
            assert_int_equal(ev.type, KVX_EV_FAILED);
        } else {
            assert_int_equal(kvx_receiver_abort(f->r, 11), 1);
            expect_failed(f, f->s, x, PROTO_ERR_CANCELLED);
        }
        assert_int_equal(kvcache_n_lru_blocks(f->kvr), 3);
        assert_int_equal(kvcache_n_cached_blocks(f->kvr), 3);
        assert_all_free(f);
    }
}

/* The receiver evicted the cached blocks (another sequence took every block) before the
 * next transfer: have = 0, every block travels again, the KV is the new transfer's. */
static void test_prefix_evicted(void **state)
{
    fx_t *f = *state;
    mk_receiver_pfx(f);
    int a[14];
    pfx_ids(a, 14, 14, 1);
    kvx_event ev;
    xfer_pfx(f, 1, a, 14, 3, &ev);
    kvcache_seq_free(f->kvr, ev.seq);
    free(ev.ids);
    assert_int_equal(kvcache_n_cached_blocks(f->kvr), 3);
    int hog = kvcache_seq_new(f->kvr);
    assert_int_equal(kvcache_seq_reserve(f->kvr, hog, NBLK * BS > MAXLEN ? MAXLEN : NBLK * BS),
                     KVCACHE_OK);
    int rest = kvcache_seq_new(f->kvr); /* the remaining blocks, LRU ones evicted last */
    assert_int_equal(kvcache_seq_reserve(f->kvr, rest, kvcache_n_free_blocks(f->kvr) * BS),
                     KVCACHE_OK);
    assert_int_equal(kvcache_n_cached_blocks(f->kvr), 0);
    kvcache_seq_free(f->kvr, hog);
    kvcache_seq_free(f->kvr, rest);
    xfer_pfx(f, 2, a, 14, 4, &ev);
    assert_int_equal(ev.have_blocks, 0);
    assert_true(ev.n_bytes == (uint64_t)NL * 4 * kvcache_block_bytes(f->kvr));
    assert_true(seq_holds(f->kvr, ev.seq, 4, 4));
    kvcache_seq_free(f->kvr, ev.seq);
    free(ev.ids);
    assert_all_free(f);
}

/* On the wire: KV_BEGIN carries bh (the hashes), the prompt ids and no KV_LAYER before
 * the ACK; an ACK claiming more blocks than were listed fails the transfer (protocol),
 * and a valid one gets exactly the missing blocks, then KV_END. */
static void test_prefix_wire_and_bad_ack(void **state)
{
    fx_t *f = *state;
    kvx_receiver_destroy(&f->r);
    snprintf(f->ep, sizeof(f->ep), "inproc://kvx-test-%d", ++endpoint_counter);
    void *router = raw_socket(f, ZMQ_ROUTER, f->ep);
    int a[14];
    pfx_ids(a, 14, 14, 1);
    uint64_t hs[3];
    assert_int_equal(kvcache_prefix_hashes(f->kvs, PFX_SEED, 0, a, 14, 3, hs), 3);
    for (int bad = 1; bad >= 0; bad--) {
        int seq = make_seq(f->kvs, 14, 3);
        uint64_t x = begin_pfx(f, 7, seq, a, 14, NULL);
        send_all(f->s, x);
        assert_int_equal(kvx_send_end(f->s, x, 5, 6), 0);
        assert_true(raw_recv(f, router, 1, 2000));
        proto_msg *m = wire_envelope_msg(f->env);
        assert_int_equal(m->type, PROTO_KV_BEGIN);
        assert_int_equal(m->n_bhash, 3);
        assert_memory_equal(m->bhash, hs, sizeof(hs));
        assert_int_equal(m->n_tokens, 14);
        assert_memory_equal(m->tokens, a, sizeof(a));
        assert_int_equal(m->block_lookahead, 0);
        size_t id_len = 0;
        unsigned char id[256];
        const unsigned char *idp = wire_envelope_identity(f->env, &id_len);
        assert_true(id_len > 0 && id_len <= sizeof(id));
        memcpy(id, idp, id_len);
        usleep(20000);
        assert_int_equal(wire_recv(router, 1, f->env, ZMQ_DONTWAIT), 0); /* nothing yet */
        proto_msg ack;
        proto_msg_init(&ack, PROTO_KV_BEGIN_ACK);
        ack.rid = 7;
        ack.xfer = x;
        ack.ok = 1;
        ack.lease_ms = 1000;
        ack.have_blocks = bad ? 4 : 2;
        assert_int_equal(wire_send(router, id, id_len, &ack, NULL, 0, 0), 0);
        if (bad) {
            expect_failed(f, f->s, x, PROTO_ERR_PROTOCOL);
            assert_true(raw_recv(f, router, 1, 2000)); /* KV_ABORT */
            assert_int_equal(wire_envelope_msg(f->env)->type, PROTO_KV_ABORT);
            continue;
        }
        for (int l = 0; l < NL; l++) { /* blocks 2 and 3 of every layer, in order */
            assert_true(raw_recv(f, router, 1, 2000));
            m = wire_envelope_msg(f->env);
            assert_int_equal(m->type, PROTO_KV_LAYER);
            assert_int_equal(m->layer, l);
            assert_int_equal(m->blk0, 2);
            assert_int_equal(m->n_blocks, 2);
            assert_int_equal(wire_envelope_n_frames(f->env), 2);
        }
        assert_true(raw_recv(f, router, 1, 2000));
        assert_int_equal(wire_envelope_msg(f->env)->type, PROTO_KV_END);
        kvx_send_abort(f->s, x);
    }
    raw_close(f, router);
    for (int i = 0; i < 200 && kvx_sender_n_active(f->s); i++)
        pump(f);
    assert_int_equal(kvx_sender_n_active(f->s), 0);
    assert_int_equal(kvcache_n_free_blocks(f->kvs), f->free_s0);
    mk_receiver(f, FP, 2000); /* for teardown */
}

/* Hashes without the ids, or more of them than the prompt's full blocks: refused by the
 * sender (nothing started; the caller still owns the sequence). */
static void test_prefix_sender_bad_args(void **state)
{
    fx_t *f = *state;
    int a[14];
    pfx_ids(a, 14, 14, 1);
    uint64_t hs[4] = {1, 2, 3, 4};
    int seq = make_seq(f->kvs, 14, 3);
    kvx_begin_params bp = {.rid = 1, .seq = seq, .n_kv_tokens = 14, .max_tokens = 4,
                           .block_hashes = hs, .n_block_hashes = 3};
    assert_true(kvx_send_begin(f->s, f->ep, &bp) == 0); /* no ids */
    bp.ids = a;
    bp.n_block_hashes = 4; /* 16 tokens > 14 */
    assert_true(kvx_send_begin(f->s, f->ep, &bp) == 0);
    bp.n_block_hashes = 3;
    bp.lookahead = 3; /* 12 + 3 > 14 */
    assert_true(kvx_send_begin(f->s, f->ep, &bp) == 0);
    kvcache_seq_free(f->kvs, seq);
    assert_all_free(f);
}

int main(int argc, char **argv)
{
    log_init("test_kvtransfer", LOG_LEVEL_ERROR);
    const struct CMUnitTest tests[] = {
#define T(name) cmocka_unit_test_setup_teardown(name, setup, teardown)
        T(test_prefix_sends_missing_blocks),
        T(test_prefix_all_blocks_cached),
        T(test_prefix_receiver_off),
        T(test_prefix_hash_mismatch_rejected),
        T(test_prefix_collision_confirmed_on_ids),
        T(test_prefix_abort_releases_pins),
        T(test_prefix_evicted),
        T(test_prefix_wire_and_bad_ack),
        T(test_prefix_sender_bad_args),
        T(test_mtp_transfer),
        T(test_mtp_modules_dropped),
        T(test_mtp_main_layers_only),
        T(test_mtp_layout_main_mismatch),
        T(test_mtp_hidden_mismatch),
        T(test_happy_path),
        T(test_one_token),
        T(test_exact_block_multiple),
        T(test_capacity_capped_at_context),
        T(test_layers_out_of_order),
        T(test_concurrent_transfers),
        T(test_reject_nospace),
        T(test_reject_watermark),
        T(test_reject_no_sequence_slot),
        T(test_reject_fingerprint),
        T(test_reject_layout_n_layer),
        T(test_reject_layout_n_kv_head),
        T(test_reject_layout_head_dim),
        T(test_reject_layout_block_size),
        T(test_reject_layout_dtype),
        T(test_reject_not_accepting),
        T(test_checksum_mismatch),
        T(test_wrong_frame_size),
        T(test_wrong_n_blocks),
        T(test_duplicate_layer),
        T(test_layer_out_of_range),
        T(test_end_before_all_layers),
        T(test_range_coverage_complete),
        T(test_range_any_order_on_the_wire),
        T(test_range_overlap_rejected),
        T(test_range_gap_at_end_rejected),
        T(test_range_out_of_bounds),
        T(test_range_sender_misuse),
        T(test_malformed_header),
        T(test_lease_receiver),
        T(test_lease_sender),
        T(test_sender_result_nack),
        T(test_abort_from_sender),
        T(test_abort_from_receiver),
        T(test_late_frames_after_abort),
        T(test_foreign_peer_frames_dropped),
        T(test_same_rid_supersedes),
        T(test_sender_misuse),
        T(test_stats_counters),
        T(test_pad_counted_bytes_exact),
        T(test_pad_wire_exact),
        T(test_pad_absent_wire_unchanged),
        T(test_pad_wrong_size_rejected),
#undef T
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("kvtransfer", tests, NULL, NULL);
}
