/* Round-trip and malformed-input tests for every message of common/protocol.h. */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include <msgpack.h>

#include "protocol.h"
#include "wire.h"

static void fill(proto_msg *m, proto_type_t t)
{
    static int toks[] = {1, 403, 407, 261, 378};
    proto_msg_init(m, t);
    m->rid = 42;
    snprintf(m->worker_id, sizeof(m->worker_id), "decode-host-1");
    m->role = PROTO_ROLE_DECODE;
    m->state = PROTO_STATE_READY;
    snprintf(m->kv_endpoint, sizeof(m->kv_endpoint), "tcp://127.0.0.1:5560");
    m->fingerprint = 0xdeadbeefcafef00dull;
    m->pid = 1234;
    m->n_ctx = 512;
    m->block_size = 16;
    m->max_seqs = 64;
    m->kv_blocks_total = 2048;
    m->kv_blocks_free = 2000;
    m->running = 3;
    m->queued = 2;
    m->queued_prompt_tokens = 77;
    m->tokens_in = 1ull << 40;
    m->tokens_out = 5;
    m->heartbeat_ms = 500;
    m->tokens = toks;
    m->n_tokens = 5;
    m->index = 7;
    m->max_tokens = 48;
    m->temperature = 0.75f;
    m->top_p = 0.9f;
    m->top_k = 40;
    m->rng = UINT64_MAX;
    snprintf(m->decode_worker, sizeof(m->decode_worker), "decode-host-1");
    snprintf(m->decode_endpoint, sizeof(m->decode_endpoint), "ipc:///tmp/kv");
    m->reason = PROTO_FINISH_LENGTH;
    m->code = PROTO_ERR_CHECKSUM;
    m->retryable = 1;
    m->ok = 1;
    snprintf(m->message, sizeof(m->message), "checksum mismatch");
    m->xfer = 9;
    m->n_layer = 5;
    m->n_kv_head = 4;
    m->head_dim = 8;
    m->dtype = PROTO_DTYPE_F32;
    m->layer = 4;
    m->blk0 = 3;
    m->n_blocks = 2;
    m->n_kv_tokens = 17;
    m->mtp_depth = 3;
    m->n_mtp = 2;
    m->mtp_fp = 0xf26e0b476c7a31b6ull;
    m->n_hidden = 128;
    m->first_token = 432;
    m->checksum = 0x1234567890abcdefull;
    m->lease_ms = 5000;
    m->pad_bytes = PROTO_MAX_PAD; /* emulated KV size (KV_BEGIN "pad") */
    m->ts_us = -5;
    m->kvx_tx = (proto_kvx_counters){1, 2, 3, 4, 5, 6, 7};
    m->kvx_rx = (proto_kvx_counters){7, 8, UINT64_MAX, 0, 0, 9, 10};
    m->spec = (proto_spec_counters){10, 20, 15, {9, 6}};
    m->queue_us = 11;
    m->prefill_us = 1234567;
    m->xfer_us = 3000000000ll;
    m->xfer_bytes = 1ull << 33;
    m->step_us = 13;
    m->emulated = 1;
    m->role_change_us = 250000;
    m->n_role_changes = 3;
    m->prefix_queries = (1ull << 36) + 7;
    m->prefix_hits = 4096;
    m->mig = (proto_mig_counters){4, 1, 9000, 2};
    m->n_gen = 12;
    m->priority = 1;
    m->age_us = 12345678901LL;
    m->n_preemptions = 1ull << 35;
    /* sampling controls: PREFILL / KV_BEGIN "samp" */
    static proto_sampling samp = {.presence = -2.0f, .frequency = 0.5f, .repetition = 1.25f,
                                  .min_tokens = 3, .n_gen = 2, .n_bias = 2,
                                  .bias_ids = {6, 100000}, .bias = {-100.0f, 2.5f},
                                  .n_stop = 3, .stop_ids = {13, 0, 2}, .ignore_eos = 1};
    m->samp = &samp;
    /* log-probabilities: PREFILL / KV_BEGIN "lpk", TOKENS "lp" (one per token: 5) */
    m->logprobs = PROTO_MAX_TOP_LOGPROBS + 1;
    static proto_logprob lps[5];
    for (int i = 0; i < 5; i++) {
        lps[i] = (proto_logprob){.logprob = -0.25f * (float)i, .n_top = i == 4 ? 20 : i};
        for (int j = 0; j < lps[i].n_top; j++) {
            lps[i].top_ids[j] = 511 - j;
            lps[i].top_logprobs[j] = -1.5f * (float)j - 0.125f;
        }
    }
    m->lps = lps;
    m->echo = 1; /* PREFILL: report the prompt's too; TOKENS: these are prompt tokens */
    /* CURVE public keys (Z85): REGISTER "kvpk", PREFILL/MIGRATE "dpk" */
    snprintf(m->kv_pubkey, sizeof(m->kv_pubkey), "%s", "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7");
    snprintf(m->decode_pubkey, sizeof(m->decode_pubkey), "%s",
             "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID");
}

/* Every type encodes and decodes to the fields it carries, bit for bit. */
static void test_roundtrip_all_types(void **state)
{
    (void)state;
    for (int t = 1; t < PROTO_TYPE_END; t++) {
        if (strcmp(proto_type_str(t), "UNKNOWN") == 0)
            continue;
        proto_msg in, out;
        fill(&in, (proto_type_t)t);
        unsigned char *buf;
        size_t len;
        assert_int_equal(proto_encode(&in, &buf, &len), 0);
        char err[128];
        int rc = proto_decode(buf, len, &out, err, sizeof(err));
        if (rc != 0)
            fail_msg("%s: %s", proto_type_str(t), err);
        assert_int_equal(out.type, t);
        if (t == PROTO_PREFILL || t == PROTO_TOKENS || t == PROTO_KV_BEGIN) {
            assert_int_equal(out.n_tokens, 5);
            assert_memory_equal(out.tokens, in.tokens, 5 * sizeof(int));
        } else {
            assert_int_equal(out.n_tokens, 0);
        }
        if (t == PROTO_PREFILL || t == PROTO_KV_BEGIN) {
            assert_non_null(out.samp);
            assert_memory_equal(out.samp, in.samp, sizeof(*in.samp));
        } else {
            assert_null(out.samp);
        }
        assert_int_equal(out.logprobs,
                         t == PROTO_PREFILL || t == PROTO_KV_BEGIN ? PROTO_MAX_TOP_LOGPROBS + 1 : 0);
        assert_int_equal(out.echo, t == PROTO_PREFILL || t == PROTO_TOKENS);
        if (t == PROTO_TOKENS) {
            assert_non_null(out.lps);
            assert_memory_equal(out.lps, in.lps, 5 * sizeof(proto_logprob));
        } else {
            assert_null(out.lps);
        }
        if (t == PROTO_KV_END) {
            assert_int_equal(out.rid, 42);
            assert_int_equal(out.first_token, 432);
            assert_true(out.checksum == in.checksum);
            assert_true(out.rng == UINT64_MAX);
        }
        /* padding: optional, KV_BEGIN only */
        assert_true(out.pad_bytes == (t == PROTO_KV_BEGIN ? PROTO_MAX_PAD : 0));
        /* blk0: optional, KV_LAYER only */
        assert_int_equal(out.blk0, t == PROTO_KV_LAYER ? 3 : 0);
        /* MTP: the request's depth on PREFILL and KV_BEGIN, the served one on REGISTER; the
         * module layout on KV_BEGIN */
        assert_int_equal(out.mtp_depth,
                         t == PROTO_PREFILL || t == PROTO_KV_BEGIN || t == PROTO_REGISTER ? 3 : 0);
        assert_int_equal(out.n_mtp, t == PROTO_KV_BEGIN ? 2 : 0);
        assert_true(out.mtp_fp == (t == PROTO_KV_BEGIN ? in.mtp_fp : 0));
        assert_int_equal(out.n_hidden, t == PROTO_KV_BEGIN ? 128 : 0);
        /* live migration: KV_BEGIN "gen", HEARTBEAT "mig", MIGRATE's target */
        assert_int_equal(out.n_gen, t == PROTO_KV_BEGIN ? 12 : 0);
        assert_true(out.mig.n_out == (t == PROTO_HEARTBEAT ? 4u : 0u));
        assert_true(out.mig.out_us == (t == PROTO_HEARTBEAT ? 9000u : 0u));
        assert_true(out.mig.n_in == (t == PROTO_HEARTBEAT ? 2u : 0u));
        /* on-demand KV: the tier on PREFILL / KV_BEGIN, preemptions on HEARTBEAT */
        assert_int_equal(out.priority, t == PROTO_PREFILL || t == PROTO_KV_BEGIN ? 1 : 0);
        /* a retry's age: PREFILL only */
        assert_true(out.age_us == (t == PROTO_PREFILL ? 12345678901LL : 0));
        assert_true(out.n_preemptions == (t == PROTO_HEARTBEAT ? 1ull << 35 : 0u));
        if (t == PROTO_MIGRATE) {
            assert_int_equal(out.rid, 42);
            assert_string_equal(out.decode_worker, "decode-host-1");
            assert_string_equal(out.decode_endpoint, "ipc:///tmp/kv");
        }
        if (t == PROTO_HEARTBEAT) {
            assert_string_equal(out.worker_id, "decode-host-1");
            assert_true(out.tokens_in == 1ull << 40);
            assert_int_equal(out.kv_blocks_free, 2000);
            assert_int_equal(out.queued_prompt_tokens, 77);
        }
        if (t == PROTO_PREFILL) {
            assert_true(out.temperature == 0.75f);
            assert_true(out.top_p == 0.9f);
            assert_string_equal(out.decode_endpoint, "ipc:///tmp/kv");
        }
        if (t == PROTO_HEARTBEAT) {
            assert_memory_equal(&out.kvx_tx, &in.kvx_tx, sizeof(in.kvx_tx));
            assert_memory_equal(&out.kvx_rx, &in.kvx_rx, sizeof(in.kvx_rx));
            assert_memory_equal(&out.spec, &in.spec, sizeof(in.spec));
        } else {
            assert_true(out.kvx_tx.n_ok == 0 && out.spec.n_drafts == 0);
        }
        if (t == PROTO_TOKENS || t == PROTO_FINISH) {
            assert_true(out.queue_us == 11 && out.prefill_us == 1234567);
            assert_true(out.xfer_us == 3000000000ll && out.xfer_bytes == 1ull << 33);
            assert_true(out.step_us == 13);
        } else if (t == PROTO_KV_END) { /* the prefill's durations, for the first TOKENS */
            assert_true(out.queue_us == 11 && out.prefill_us == 1234567);
            assert_true(out.xfer_us == 0 && out.xfer_bytes == 0 && out.step_us == 0);
        } else {
            assert_true(out.queue_us == 0 && out.xfer_bytes == 0);
        }
        /* CURVE keys: optional, REGISTER (its kv key) and PREFILL / MIGRATE (the target's) */
        assert_string_equal(out.kv_pubkey, t == PROTO_REGISTER ? in.kv_pubkey : "");
        assert_string_equal(out.decode_pubkey,
                            t == PROTO_PREFILL || t == PROTO_MIGRATE ? in.decode_pubkey : "");
        if (t == PROTO_ROLE || t == PROTO_REGISTER || t == PROTO_HEARTBEAT)
            assert_int_equal(out.role, PROTO_ROLE_DECODE);
        assert_int_equal(out.emulated, t == PROTO_REGISTER || t == PROTO_HEARTBEAT);
        assert_true(out.role_change_us == (t == PROTO_HEARTBEAT ? 250000 : 0));
        assert_true(out.n_role_changes == (t == PROTO_HEARTBEAT ? 3u : 0u));
        assert_true(out.prefix_queries == (t == PROTO_HEARTBEAT ? (1ull << 36) + 7 : 0u));
        assert_true(out.prefix_hits == (t == PROTO_HEARTBEAT ? 4096u : 0u));
        assert_int_equal(out.ts_us, -5);
        free(buf);
        proto_msg_clear(&out);
    }
}

static int decode_packed(void (*build)(msgpack_packer *), char *err, size_t errlen)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    build(&pk);
    proto_msg m;
    int rc = proto_decode(sb.data, sb.size, &m, err, errlen);
    proto_msg_clear(&m);
    msgpack_sbuffer_destroy(&sb);
    return rc;
}

static void kv(msgpack_packer *pk, const char *k)
{
    msgpack_pack_str(pk, strlen(k));
    msgpack_pack_str_body(pk, k, strlen(k));
}

/* Keys in any order decode as in the encoder's order (the decoder searches the field table
 * from the field found last, wrapping): TOKENS with its keys reversed, t and v last, and
 * an unknown key and a duplicate in between. */
static void pack_tokens_reversed(msgpack_packer *pk, int dup)
{
    msgpack_pack_map(pk, dup ? 10 : 9);
    kv(pk, "ts"); msgpack_pack_int64(pk, 77);
    kv(pk, "zz_unknown"); msgpack_pack_int(pk, 1);
    kv(pk, "rng"); msgpack_pack_uint64(pk, 0xabcdefull);
    kv(pk, "index"); msgpack_pack_int(pk, 5);
    kv(pk, "tokens"); msgpack_pack_array(pk, 2); msgpack_pack_int(pk, 300);
    msgpack_pack_int(pk, 7);
    if (dup) {
        kv(pk, "index"); msgpack_pack_int(pk, 6);
    }
    kv(pk, "step_us"); msgpack_pack_int(pk, 9);
    kv(pk, "rid"); msgpack_pack_int(pk, 42);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_TOKENS);
}

static void test_any_key_order(void **state)
{
    (void)state;
    for (int dup = 0; dup < 2; dup++) {
        msgpack_sbuffer sb;
        msgpack_packer pk;
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        pack_tokens_reversed(&pk, dup);
        proto_msg m;
        char err[160];
        int rc = proto_decode(sb.data, sb.size, &m, err, sizeof(err));
        if (dup) {
            assert_int_equal(rc, -1);
            assert_string_equal(err, "TOKENS: duplicate field 'index'");
        } else {
            assert_int_equal(rc, 0);
            assert_int_equal(m.type, PROTO_TOKENS);
            assert_true(m.rid == 42 && m.index == 5 && m.rng == 0xabcdefull);
            assert_true(m.ts_us == 77 && m.step_us == 9);
            assert_int_equal(m.n_tokens, 2);
            assert_int_equal(m.tokens[0], 300);
            assert_int_equal(m.tokens[1], 7);
        }
        proto_msg_clear(&m);
        msgpack_sbuffer_destroy(&sb);
    }
}

static void b_not_map(msgpack_packer *pk) { msgpack_pack_array(pk, 0); }
static void b_bad_version(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 3);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_CANCEL);
    kv(pk, "v"); msgpack_pack_int(pk, 99);
    kv(pk, "rid"); msgpack_pack_int(pk, 1);
}
static void b_unknown_type(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 2);
    kv(pk, "t"); msgpack_pack_int(pk, 31);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
}
static void b_missing_rid(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 2);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_CANCEL);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
}
static void b_rid_zero(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 3);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_CANCEL);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "rid"); msgpack_pack_int(pk, 0);
}
static void b_rid_string(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 3);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_CANCEL);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "rid"); kv(pk, "7");
}
static void b_dup_field(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 4);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_CANCEL);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "rid"); msgpack_pack_int(pk, 1);
    kv(pk, "rid"); msgpack_pack_int(pk, 2);
}
static void b_negative_token(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 5);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_TOKENS);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "rid"); msgpack_pack_int(pk, 1);
    kv(pk, "index"); msgpack_pack_int(pk, 0);
    kv(pk, "tokens"); msgpack_pack_array(pk, 2); msgpack_pack_int(pk, 5); msgpack_pack_int(pk, -1);
}
static void b_long_string(msgpack_packer *pk)
{
    char big[PROTO_ID_LEN + 1];
    memset(big, 'a', sizeof(big));
    msgpack_pack_map(pk, 3);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_BYE);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "wid"); msgpack_pack_str(pk, sizeof(big)); msgpack_pack_str_body(pk, big, sizeof(big));
}
static void b_out_of_range(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 4);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_FINISH);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "rid"); msgpack_pack_int(pk, 1);
    kv(pk, "reason"); msgpack_pack_int(pk, 3);
}
static void b_blk0_out_of_range(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 7);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_KV_LAYER);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "rid"); msgpack_pack_int(pk, 1);
    kv(pk, "xfer"); msgpack_pack_int(pk, 2);
    kv(pk, "layer"); msgpack_pack_int(pk, 0);
    kv(pk, "n_blocks"); msgpack_pack_int(pk, 1);
    kv(pk, "blk0"); msgpack_pack_int(pk, PROTO_MAX_FRAMES);
}
static void b_prefill_mtp(msgpack_packer *pk, int mtp)
{
    msgpack_pack_map(pk, 12);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_PREFILL);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "rid"); msgpack_pack_int(pk, 1);
    kv(pk, "tokens"); msgpack_pack_array(pk, 1); msgpack_pack_int(pk, 1);
    kv(pk, "max_tokens"); msgpack_pack_int(pk, 4);
    kv(pk, "temp"); msgpack_pack_float(pk, 0.0f);
    kv(pk, "top_p"); msgpack_pack_float(pk, 1.0f);
    kv(pk, "top_k"); msgpack_pack_int(pk, 0);
    kv(pk, "rng"); msgpack_pack_int(pk, 7);
    kv(pk, "dw"); kv(pk, "d");
    kv(pk, "dep"); kv(pk, "");
    kv(pk, "mtp"); msgpack_pack_int(pk, mtp);
}
static void b_prefill_pri(msgpack_packer *pk, int pri)
{
    msgpack_pack_map(pk, 12);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_PREFILL);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "rid"); msgpack_pack_int(pk, 1);
    kv(pk, "tokens"); msgpack_pack_array(pk, 1); msgpack_pack_int(pk, 1);
    kv(pk, "max_tokens"); msgpack_pack_int(pk, 4);
    kv(pk, "temp"); msgpack_pack_float(pk, 0.0f);
    kv(pk, "top_p"); msgpack_pack_float(pk, 1.0f);
    kv(pk, "top_k"); msgpack_pack_int(pk, 0);
    kv(pk, "rng"); msgpack_pack_int(pk, 7);
    kv(pk, "dw"); kv(pk, "d");
    kv(pk, "dep"); kv(pk, "");
    kv(pk, "pri"); msgpack_pack_int(pk, pri);
}
static void b_pri_out_of_range(msgpack_packer *pk) { b_prefill_pri(pk, 2); }
static void b_pri_negative(msgpack_packer *pk) { b_prefill_pri(pk, -1); }
static void b_pri_offline(msgpack_packer *pk) { b_prefill_pri(pk, 1); }
static void b_mtp_out_of_range(msgpack_packer *pk) { b_prefill_mtp(pk, 4); }
static void b_mtp_negative(msgpack_packer *pk) { b_prefill_mtp(pk, -1); }
static void b_mtp_ok(msgpack_packer *pk) { b_prefill_mtp(pk, 1); }
static void b_blk0_negative(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 7);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_KV_LAYER);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "rid"); msgpack_pack_int(pk, 1);
    kv(pk, "xfer"); msgpack_pack_int(pk, 2);
    kv(pk, "layer"); msgpack_pack_int(pk, 0);
    kv(pk, "n_blocks"); msgpack_pack_int(pk, 1);
    kv(pk, "blk0"); msgpack_pack_int(pk, -1);
}
static void b_blk0_on_kv_end(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 8);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_KV_END);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "rid"); msgpack_pack_int(pk, 1);
    kv(pk, "xfer"); msgpack_pack_int(pk, 2);
    kv(pk, "first"); msgpack_pack_int(pk, 0);
    kv(pk, "cksum"); msgpack_pack_int(pk, 0);
    kv(pk, "rng"); msgpack_pack_int(pk, 0);
    kv(pk, "blk0"); msgpack_pack_int(pk, 1);
}
static void b_kv_begin_pad(msgpack_packer *pk, int64_t pad)
{
    msgpack_pack_map(pk, 3);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_KV_BEGIN);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "pad"); msgpack_pack_int64(pk, pad);
}
static void b_pad_negative(msgpack_packer *pk) { b_kv_begin_pad(pk, -1); }
static void b_pad_too_large(msgpack_packer *pk) { b_kv_begin_pad(pk, PROTO_MAX_PAD + 1); }
static void b_register_key(msgpack_packer *pk, const char *key)
{
    msgpack_pack_map(pk, 13);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_REGISTER);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "wid"); kv(pk, "d0");
    kv(pk, "role"); msgpack_pack_int(pk, PROTO_ROLE_DECODE);
    kv(pk, "kvep"); kv(pk, "tcp://127.0.0.1:5560");
    kv(pk, "fp"); msgpack_pack_int(pk, 1);
    kv(pk, "pid"); msgpack_pack_int(pk, 1);
    kv(pk, "n_ctx"); msgpack_pack_int(pk, 512);
    kv(pk, "bs"); msgpack_pack_int(pk, 16);
    kv(pk, "max_seqs"); msgpack_pack_int(pk, 8);
    kv(pk, "kv_total"); msgpack_pack_int(pk, 8);
    kv(pk, "kv_free"); msgpack_pack_int(pk, 8);
    kv(pk, "kvpk");
    if (key)
        kv(pk, key);
    else
        msgpack_pack_int(pk, 7);
}
/* 40 Z85 characters */
static void b_key_ok(msgpack_packer *pk) { b_register_key(pk, "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"); }
/* 39 characters */
static void b_key_short(msgpack_packer *pk) { b_register_key(pk, "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf"); }
/* 41 characters */
static void b_key_long(msgpack_packer *pk) { b_register_key(pk, "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7A"); }
/* a character outside the alphabet ('"' and ' ') */
static void b_key_charset(msgpack_packer *pk) { b_register_key(pk, "rq:rM>}U?@Lns47E1%kR.o@n%Fcmm L/@{H8]yf\""); }
/* "#####" is 85^5 - 1 > 2^32 - 1: no 4 bytes */
static void b_key_overflow(msgpack_packer *pk) { b_register_key(pk, "#####>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"); }
static void b_key_not_string(msgpack_packer *pk) { b_register_key(pk, NULL); }
/* KV_BEGIN with a "samp" of kind k: 0 too short, 1 presence 3, 2 bias 101, 3 counts
 * differ, 4 negative stop id, 5 a string penalty, 6 min_tokens negative, 7 flags 2 (not
 * a flag), 8 flags 1 (ignore_eos: valid) */
static void b_samp(msgpack_packer *pk, int k)
{
    msgpack_pack_map(pk, 3);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_KV_BEGIN);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "samp");
    msgpack_pack_array(pk, k == 0 ? 7 : k >= 7 ? 9 : 8);
    if (k == 5)
        kv(pk, "x");
    else
        msgpack_pack_float(pk, k == 1 ? 3.0f : 0.0f);
    msgpack_pack_float(pk, 0.0f);
    msgpack_pack_float(pk, 1.0f);
    msgpack_pack_int(pk, k == 6 ? -1 : 0);
    msgpack_pack_int(pk, 0);
    msgpack_pack_array(pk, 1);
    msgpack_pack_int(pk, 5);
    msgpack_pack_array(pk, k == 3 ? 2 : 1);
    msgpack_pack_float(pk, k == 2 ? 101.0f : 1.0f);
    if (k == 3)
        msgpack_pack_float(pk, 1.0f);
    if (k == 0)
        return;
    msgpack_pack_array(pk, 1);
    msgpack_pack_int(pk, k == 4 ? -3 : 2);
    if (k >= 7)
        msgpack_pack_int(pk, k == 7 ? 2 : 1);
}
static void b_samp_short(msgpack_packer *pk) { b_samp(pk, 0); }
static void b_samp_presence(msgpack_packer *pk) { b_samp(pk, 1); }
static void b_samp_bias(msgpack_packer *pk) { b_samp(pk, 2); }
static void b_samp_counts(msgpack_packer *pk) { b_samp(pk, 3); }
static void b_samp_stop(msgpack_packer *pk) { b_samp(pk, 4); }
static void b_samp_string(msgpack_packer *pk) { b_samp(pk, 5); }
static void b_samp_min(msgpack_packer *pk) { b_samp(pk, 6); }
static void b_samp_flags(msgpack_packer *pk) { b_samp(pk, 7); }
static void b_samp_ignore_eos(msgpack_packer *pk) { b_samp(pk, 8); }
/* TOKENS with two tokens and an "lp" of kind k: 0 valid, 1 one entry for two tokens, 2 a
 * positive logprob, 3 21 alternatives, 4 ids and logprobs differ in count, 5 an entry of 2,
 * 6 a negative id, 7 NaN */
static void b_lp(msgpack_packer *pk, int k)
{
    msgpack_pack_map(pk, 6);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_TOKENS);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "lp"); /* before "tokens": the count is checked once the header is read */
    int n = k == 1 ? 1 : 2;
    msgpack_pack_array(pk, (size_t)n);
    for (int e = 0; e < n; e++) {
        int top = e == 1 && k == 3 ? 21 : 2;
        msgpack_pack_array(pk, k == 5 && e == 1 ? 2 : 3);
        msgpack_pack_float(pk, e == 1 && k == 2 ? 0.5f : e == 1 && k == 7 ? NAN : -0.5f);
        msgpack_pack_array(pk, (size_t)top);
        for (int j = 0; j < top; j++)
            msgpack_pack_int(pk, e == 1 && k == 6 ? -1 : j);
        if (k == 5 && e == 1)
            continue;
        msgpack_pack_array(pk, (size_t)(k == 4 && e == 1 ? top - 1 : top));
        for (int j = 0; j < (k == 4 && e == 1 ? top - 1 : top); j++)
            msgpack_pack_float(pk, -1.0f - (float)j);
    }
    kv(pk, "rid"); msgpack_pack_int(pk, 1);
    kv(pk, "tokens"); msgpack_pack_array(pk, 2); msgpack_pack_int(pk, 7); msgpack_pack_int(pk, 8);
    kv(pk, "index"); msgpack_pack_int(pk, 0);
}
static void b_lp_ok(msgpack_packer *pk) { b_lp(pk, 0); }
static void b_lp_count(msgpack_packer *pk) { b_lp(pk, 1); }
static void b_lp_positive(msgpack_packer *pk) { b_lp(pk, 2); }
static void b_lp_21(msgpack_packer *pk) { b_lp(pk, 3); }
static void b_lp_lengths(msgpack_packer *pk) { b_lp(pk, 4); }
static void b_lp_short(msgpack_packer *pk) { b_lp(pk, 5); }
static void b_lp_negative_id(msgpack_packer *pk) { b_lp(pk, 6); }
static void b_lp_nan(msgpack_packer *pk) { b_lp(pk, 7); }
/* PREFILL "lpk" out of range (22) */
static void b_lpk_22(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 3);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_PREFILL);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "lpk"); msgpack_pack_int(pk, PROTO_MAX_TOP_LOGPROBS + 2);
}

static void b_ok_cancel(msgpack_packer *pk)
{
    msgpack_pack_map(pk, 4);
    kv(pk, "t"); msgpack_pack_int(pk, PROTO_CANCEL);
    kv(pk, "v"); msgpack_pack_int(pk, PROTO_VERSION);
    kv(pk, "rid"); msgpack_pack_int(pk, 1);
    kv(pk, "future_field"); msgpack_pack_int(pk, 1); /* unknown keys are ignored */
}

static void test_malformed_headers(void **state)
{
    (void)state;
    struct { const char *name; void (*build)(msgpack_packer *); int rc; const char *needle; } cases[] = {
        {"not a map", b_not_map, -1, "not a map"},
        {"bad version", b_bad_version, -1, "version"},
        {"unknown type", b_unknown_type, -1, "unknown message type"},
        {"missing rid", b_missing_rid, -1, "missing field 'rid'"},
        {"rid zero", b_rid_zero, -1, "rid"},
        {"rid string", b_rid_string, -1, "rid"},
        {"duplicate", b_dup_field, -1, "duplicate"},
        {"negative token", b_negative_token, -1, "token"},
        {"long string", b_long_string, -1, "too long"},
        {"out of range", b_out_of_range, -1, "reason"},
        {"blk0 out of range", b_blk0_out_of_range, -1, "blk0"},
        {"blk0 negative", b_blk0_negative, -1, "blk0"},
        {"blk0 ignored on KV_END", b_blk0_on_kv_end, 0, ""},
        {"mtp out of range", b_mtp_out_of_range, -1, "mtp"},
        {"mtp negative", b_mtp_negative, -1, "mtp"},
        {"mtp depth 0", b_mtp_ok, 0, ""},
        {"pri out of range", b_pri_out_of_range, -1, "pri"},
        {"pri negative", b_pri_negative, -1, "pri"},
        {"pri offline", b_pri_offline, 0, ""},
        {"pad negative", b_pad_negative, -1, "pad"},
        {"pad too large", b_pad_too_large, -1, "pad"},
        {"valid with unknown key", b_ok_cancel, 0, ""},
        {"curve key ok", b_key_ok, 0, ""},
        {"curve key short", b_key_short, -1, "kvpk"},
        {"curve key long", b_key_long, -1, "kvpk"},
        {"curve key charset", b_key_charset, -1, "kvpk"},
        {"curve key overflow", b_key_overflow, -1, "kvpk"},
        {"curve key not a string", b_key_not_string, -1, "kvpk"},
        {"samp short", b_samp_short, -1, "samp"},
        {"samp presence 3", b_samp_presence, -1, "samp"},
        {"samp bias 101", b_samp_bias, -1, "samp"},
        {"samp counts differ", b_samp_counts, -1, "samp"},
        {"samp negative stop id", b_samp_stop, -1, "samp"},
        {"samp string penalty", b_samp_string, -1, "samp"},
        {"samp min_tokens negative", b_samp_min, -1, "samp"},
        {"samp flags 2", b_samp_flags, -1, "flags"},
        /* flags 1 is a valid samp: decoding goes on to the required fields */
        {"samp ignore_eos", b_samp_ignore_eos, -1, "missing field 'rid'"},
        {"lp valid", b_lp_ok, 0, ""},
        {"lp one entry for two tokens", b_lp_count, -1, "1 'lp' entries for 2 tokens"},
        {"lp positive", b_lp_positive, -1, "lp"},
        {"lp 21 alternatives", b_lp_21, -1, "lp"},
        {"lp ids and values differ", b_lp_lengths, -1, "lp"},
        {"lp entry of 2", b_lp_short, -1, "lp"},
        {"lp negative id", b_lp_negative_id, -1, "lp"},
        {"lp NaN", b_lp_nan, -1, "lp"},
        {"lpk 22", b_lpk_22, -1, "lpk"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char err[160] = "";
        int rc = decode_packed(cases[i].build, err, sizeof(err));
        if (rc != cases[i].rc || strstr(err, cases[i].needle) == NULL)
            fail_msg("case '%s': rc %d err '%s'", cases[i].name, rc, err);
    }
}

/* proto_peek names the type and rid of a header proto_decode refuses (the gateway re-runs
 * the attempt whose TOKENS were lost), and of a good one; without both it says -1. */
static void test_peek_refused_header(void **state)
{
    (void)state;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 5); /* tokens before rid, an id past 2^31 */
    kv(&pk, "v"); msgpack_pack_int(&pk, PROTO_VERSION);
    kv(&pk, "tokens"); msgpack_pack_array(&pk, 1); msgpack_pack_uint64(&pk, 1ull << 32);
    kv(&pk, "t"); msgpack_pack_int(&pk, PROTO_TOKENS);
    kv(&pk, "index"); msgpack_pack_int(&pk, 0);
    kv(&pk, "rid"); msgpack_pack_uint64(&pk, 0x1234500000001ull);
    proto_msg m;
    char err[160];
    assert_int_equal(proto_decode(sb.data, sb.size, &m, err, sizeof(err)), -1);
    proto_type_t type;
    uint64_t rid;
    assert_int_equal(proto_peek(sb.data, sb.size, &type, &rid), 0);
    assert_int_equal(type, PROTO_TOKENS);
    assert_true(rid == 0x1234500000001ull);
    assert_int_equal(proto_peek(sb.data, sb.size - 1, &type, &rid), -1); /* truncated */
    assert_int_equal(type, 0);
    msgpack_sbuffer_clear(&sb);
    msgpack_pack_map(&pk, 2); /* no rid */
    kv(&pk, "t"); msgpack_pack_int(&pk, PROTO_TOKENS);
    kv(&pk, "v"); msgpack_pack_int(&pk, PROTO_VERSION);
    assert_int_equal(proto_peek(sb.data, sb.size, &type, &rid), -1);
    assert_int_equal(type, PROTO_TOKENS);
    assert_true(rid == 0);
    msgpack_sbuffer_destroy(&sb);
}

/* Every truncation of a valid header is rejected, never crashes. */
static void test_truncated_and_garbage(void **state)
{
    (void)state;
    proto_msg in, out;
    fill(&in, PROTO_KV_BEGIN);
    unsigned char *buf;
    size_t len;
    assert_int_equal(proto_encode(&in, &buf, &len), 0);
    char err[160];
    for (size_t n = 0; n < len; n++)
        assert_int_equal(proto_decode(buf, n, &out, err, sizeof(err)), -1);
    /* trailing garbage */
    unsigned char *longer = malloc(len + 1);
    memcpy(longer, buf, len);
    longer[len] = 0xc0;
    assert_int_equal(proto_decode(longer, len + 1, &out, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "trailing"));
    /* a map that claims 2^32-1 entries in a few bytes: rejected before any allocation */
    static const unsigned char huge[] = {0xdf, 0xff, 0xff, 0xff, 0xff, 0xa1, 't', 0x01};
    assert_int_equal(proto_decode(huge, sizeof(huge), &out, err, sizeof(err)), -1);
    static const unsigned char huge_str[] = {0x81, 0xdb, 0x7f, 0xff, 0xff, 0xff, 'x'};
    assert_int_equal(proto_decode(huge_str, sizeof(huge_str), &out, err, sizeof(err)), -1);
    /* random flips: decode or reject, never crash (ASan run checks memory) */
    srand(7);
    for (int it = 0; it < 2000; it++) {
        memcpy(longer, buf, len);
        longer[rand() % len] ^= (unsigned char)(1 + rand() % 255);
        if (proto_decode(longer, len, &out, err, sizeof(err)) == 0)
            proto_msg_clear(&out);
    }
    free(longer);
    free(buf);
}

/* Encoding refuses what it could not decode. */
static void test_encode_rejects(void **state)
{
    (void)state;
    proto_msg m;
    unsigned char *buf;
    size_t len;
    proto_msg_init(&m, (proto_type_t)999);
    assert_int_equal(proto_encode(&m, &buf, &len), -1);
    proto_msg_init(&m, PROTO_TOKENS);
    m.rid = 1;
    m.n_tokens = 3; /* tokens NULL */
    assert_int_equal(proto_encode(&m, &buf, &len), -1);
    /* a malformed CURVE key is never sent */
    fill(&m, PROTO_REGISTER);
    snprintf(m.kv_pubkey, sizeof(m.kv_pubkey), "%s", "not a key");
    assert_int_equal(proto_encode(&m, &buf, &len), -1);
    fill(&m, PROTO_PREFILL);
    snprintf(m.decode_pubkey, sizeof(m.decode_pubkey), "%s",
             "#####>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7");
    assert_int_equal(proto_encode(&m, &buf, &len), -1);
}

/* An optional field left unset is absent on the wire, not an out-of-range zero
 * (a KV_BEGIN_ACK reject without lease_ms must decode). */
static void test_optional_fields_unset(void **state)
{
    (void)state;
    proto_msg m, out;
    proto_msg_init(&m, PROTO_KV_BEGIN_ACK);
    m.rid = 3;
    m.xfer = 4;
    m.ok = 0;
    m.code = PROTO_ERR_NOSPACE;
    unsigned char *buf;
    size_t len;
    char err[128];
    assert_int_equal(proto_encode(&m, &buf, &len), 0);
    if (proto_decode(buf, len, &out, err, sizeof(err)) != 0)
        fail_msg("%s", err);
    assert_int_equal(out.code, PROTO_ERR_NOSPACE);
    assert_int_equal(out.lease_ms, 0);
    assert_int_equal(out.message[0], 0);
    free(buf);
}

/* ERROR PREEMPTED (a decode worker freed the sequence for KV blocks): code 10, retryable,
 * named "preempted"; the next code is unknown. An online PREFILL carries no "pri". */
static void test_error_preempted(void **state)
{
    (void)state;
    proto_msg m, out;
    unsigned char *buf;
    size_t len;
    char err[128];
    proto_msg_init(&m, PROTO_ERROR);
    m.rid = 77;
    m.code = PROTO_ERR_PREEMPTED;
    m.retryable = 1;
    snprintf(m.message, sizeof(m.message), "KV cache full: preempted");
    assert_int_equal(proto_encode(&m, &buf, &len), 0);
    if (proto_decode(buf, len, &out, err, sizeof(err)) != 0)
        fail_msg("%s", err);
    assert_int_equal(out.code, 10);
    assert_int_equal(out.retryable, 1);
    assert_string_equal(proto_err_str(out.code), "preempted");
    assert_string_equal(proto_err_str(11), "unknown");
    free(buf);
    int tok = 5;
    proto_msg_init(&m, PROTO_PREFILL);
    m.rid = 78;
    m.tokens = &tok;
    m.n_tokens = 1;
    m.max_tokens = 2;
    m.rng = 1;
    snprintf(m.decode_worker, sizeof(m.decode_worker), "d");
    assert_int_equal(proto_encode(&m, &buf, &len), 0);
    assert_null(memmem(buf, len, "pri", 3));
    if (proto_decode(buf, len, &out, err, sizeof(err)) != 0)
        fail_msg("%s", err);
    assert_int_equal(out.priority, 0);
    proto_msg_clear(&out);
    free(buf);
}

/* REGISTER_ACK: an acceptance has no code (the wire of before refusals existed); a refusal
 * carries code and msg (issue 12: a worker with another model or block size). */
static void test_register_ack_refusal(void **state)
{
    (void)state;
    proto_msg m, out;
    unsigned char *buf;
    size_t len;
    char err[128];
    proto_msg_init(&m, PROTO_REGISTER_ACK);
    m.heartbeat_ms = 200;
    assert_int_equal(proto_encode(&m, &buf, &len), 0);
    /* a map of t, v, hb_ms only: fixmap header 0x83 */
    assert_int_equal(buf[0], 0x83);
    if (proto_decode(buf, len, &out, err, sizeof(err)) != 0)
        fail_msg("%s", err);
    assert_int_equal(out.code, PROTO_ERR_NONE);
    assert_int_equal(out.message[0], 0);
    free(buf);
    m.code = PROTO_ERR_LAYOUT;
    snprintf(m.message, sizeof(m.message), "KV block size 32 tokens, the cluster's is 16");
    assert_int_equal(proto_encode(&m, &buf, &len), 0);
    assert_int_equal(buf[0], 0x85);
    if (proto_decode(buf, len, &out, err, sizeof(err)) != 0)
        fail_msg("%s", err);
    assert_int_equal(out.heartbeat_ms, 200);
    assert_int_equal(out.code, PROTO_ERR_LAYOUT);
    assert_string_equal(out.message, "KV block size 32 tokens, the cluster's is 16");
    free(buf);
}

/* A DEALER with no peer and ZMQ_DONTWAIT fails with EAGAIN instead of blocking. */
static void test_send_dontwait_no_peer(void **state)
{
    (void)state;
    void *ctx = zmq_ctx_new();
    void *dealer = zmq_socket(ctx, ZMQ_DEALER);
    proto_msg m;
    fill(&m, PROTO_CANCEL);
    assert_int_equal(wire_send(dealer, NULL, 0, &m, NULL, 0, ZMQ_DONTWAIT), -1);
    assert_int_equal(errno, EAGAIN);
    int linger = 0;
    zmq_setsockopt(dealer, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_close(dealer);
    zmq_ctx_term(ctx);
}

/* Send and receive over a real ZeroMQ pair, with payload frames and identities. */
static void test_send_recv_frames(void **state)
{
    (void)state;
    void *ctx = zmq_ctx_new();
    void *router = zmq_socket(ctx, ZMQ_ROUTER);
    void *dealer = zmq_socket(ctx, ZMQ_DEALER);
    assert_int_equal(zmq_bind(router, "inproc://proto-test"), 0);
    zmq_setsockopt(dealer, ZMQ_ROUTING_ID, "w1", 2);
    assert_int_equal(zmq_connect(dealer, "inproc://proto-test"), 0);

    proto_msg m;
    fill(&m, PROTO_KV_LAYER);
    zmq_msg_t frames[2];
    static const char a[] = "block-zero", b[] = "block-one!!";
    zmq_msg_init_size(&frames[0], sizeof(a));
    memcpy(zmq_msg_data(&frames[0]), a, sizeof(a));
    zmq_msg_init_size(&frames[1], sizeof(b));
    memcpy(zmq_msg_data(&frames[1]), b, sizeof(b));
    assert_int_equal(wire_send(dealer, NULL, 0, &m, frames, 2, 0), 0);

    wire_envelope *e = wire_envelope_new();
    assert_int_equal(wire_recv(router, 1, e, 0), 1);
    size_t idlen;
    const unsigned char *id = wire_envelope_identity(e, &idlen);
    assert_int_equal(idlen, 2);
    assert_memory_equal(id, "w1", 2);
    assert_int_equal(wire_envelope_msg(e)->type, PROTO_KV_LAYER);
    assert_int_equal(wire_envelope_msg(e)->layer, 4);
    assert_int_equal(wire_envelope_n_frames(e), 2);
    assert_int_equal(zmq_msg_size(wire_envelope_frame(e, 1)), sizeof(b));
    assert_memory_equal(zmq_msg_data(wire_envelope_frame(e, 1)), b, sizeof(b));

    /* reply through the identity */
    proto_msg r;
    fill(&r, PROTO_KV_RESULT);
    assert_int_equal(wire_send(router, id, idlen, &r, NULL, 0, 0), 0);
    assert_int_equal(wire_recv(dealer, 0, e, 0), 1);
    assert_int_equal(wire_envelope_msg(e)->type, PROTO_KV_RESULT);

    /* a malformed header is dropped with its payload, then the next message is fine */
    zmq_send(dealer, "junk", 4, ZMQ_SNDMORE);
    zmq_send(dealer, "payload", 7, 0);
    proto_msg c;
    fill(&c, PROTO_CANCEL);
    assert_int_equal(wire_send(dealer, NULL, 0, &c, NULL, 0, 0), 0);
    assert_int_equal(wire_recv(router, 1, e, 0), -1);
    assert_int_equal(wire_recv(router, 1, e, 0), 1);
    assert_int_equal(wire_envelope_msg(e)->type, PROTO_CANCEL);
    assert_int_equal(wire_recv(router, 1, e, ZMQ_DONTWAIT), 0);

    wire_envelope_destroy(&e);
    assert_null(e);
    zmq_close(dealer);
    zmq_close(router);
    zmq_ctx_term(ctx);
}

/* wire_send encodes headers on its stack and moves to the heap past 1 KiB: a PREFILL of
 * the largest prompt, and one on each side of the switch, arrive intact; an invalid
 * message is refused with EINVAL. */
static void test_send_header_sizes(void **state)
{
    (void)state;
    void *ctx = zmq_ctx_new();
    void *router = zmq_socket(ctx, ZMQ_ROUTER);
    void *dealer = zmq_socket(ctx, ZMQ_DEALER);
    assert_int_equal(zmq_bind(router, "inproc://proto-sizes"), 0);
    assert_int_equal(zmq_connect(dealer, "inproc://proto-sizes"), 0);
    int *toks = malloc(PROTO_MAX_TOKENS * sizeof(int));
    for (int i = 0; i < PROTO_MAX_TOKENS; i++)
        toks[i] = (i * 7919) % 100000;
    wire_envelope *e = wire_envelope_new();
    static const int sizes[] = {1, 150, 200, 300, PROTO_MAX_TOKENS};
    for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
        proto_msg m;
        fill(&m, PROTO_PREFILL);
        m.tokens = toks;
        m.n_tokens = sizes[k];
        assert_int_equal(wire_send(dealer, NULL, 0, &m, NULL, 0, 0), 0);
        assert_int_equal(wire_recv(router, 1, e, 0), 1);
        proto_msg *out = wire_envelope_msg(e);
        assert_int_equal(out->n_tokens, sizes[k]);
        assert_memory_equal(out->tokens, toks, (size_t)sizes[k] * sizeof(int));
        assert_string_equal(out->decode_endpoint, "ipc:///tmp/kv");
    }
    proto_msg bad;
    fill(&bad, PROTO_TOKENS);
    bad.tokens = NULL; /* n_tokens 5 without tokens */
    assert_int_equal(wire_send(dealer, NULL, 0, &bad, NULL, 0, 0), -1);
    assert_int_equal(errno, EINVAL);
    free(toks);
    wire_envelope_destroy(&e);
    zmq_close(dealer);
    zmq_close(router);
    zmq_ctx_term(ctx);
}

/* Counter arrays (kvx_tx, kvx_rx, spec): a shorter array leaves the rest zero, a longer
 * one (a newer peer) is read up to the known counters; non-integers and negative values
 * are refused, as are negative durations. Unset counters are not on the wire. */
static int decode_heartbeat_with(const char *key, int n, int64_t bad_at, char *err, size_t errlen,
                                 proto_msg *out)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    proto_msg m;
    fill(&m, PROTO_HEARTBEAT);
    memset(&m.kvx_tx, 0, sizeof(m.kvx_tx));
    memset(&m.kvx_rx, 0, sizeof(m.kvx_rx));
    memset(&m.spec, 0, sizeof(m.spec));
    unsigned char *buf;
    size_t len;
    assert_int_equal(proto_encode(&m, &buf, &len), 0);
    /* re-pack: the encoded map plus one more key (rewrite the map header count) */
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    assert_int_equal(msgpack_unpack_next(&up, (const char *)buf, len, &off),
                     MSGPACK_UNPACK_SUCCESS);
    const msgpack_object_map *map = &up.data.via.map;
    for (uint32_t i = 0; i < map->size; i++)
        assert_false(map->ptr[i].key.via.str.size == strlen(key) &&
                     memcmp(map->ptr[i].key.via.str.ptr, key, strlen(key)) == 0);
    msgpack_pack_map(&pk, map->size + 1);
    for (uint32_t i = 0; i < map->size; i++) {
        msgpack_pack_object(&pk, map->ptr[i].key);
        msgpack_pack_object(&pk, map->ptr[i].val);
    }
    kv(&pk, key);
    msgpack_pack_array(&pk, (size_t)n);
    for (int k = 0; k < n; k++) {
        if (k == bad_at)
            msgpack_pack_int(&pk, -1);
        else
            msgpack_pack_uint64(&pk, (uint64_t)(100 + k));
    }
    msgpack_unpacked_destroy(&up);
    free(buf);
    int rc = proto_decode(sb.data, sb.size, out, err, errlen);
    msgpack_sbuffer_destroy(&sb);
    return rc;
}

static void test_counter_arrays(void **state)
{
    (void)state;
    char err[128];
    proto_msg out;
    assert_int_equal(decode_heartbeat_with("kvx_tx", 3, -1, err, sizeof(err), &out), 0);
    assert_true(out.kvx_tx.n_ok == 100 && out.kvx_tx.n_bytes == 101);
    assert_true(out.kvx_tx.total_us == 102 && out.kvx_tx.n_rejected == 0);
    assert_true(out.kvx_tx.n_aborted == 0 && out.kvx_rx.n_ok == 0);
    proto_msg_clear(&out);
    assert_int_equal(decode_heartbeat_with("spec", 9, -1, err, sizeof(err), &out), 0);
    assert_true(out.spec.n_drafts == 100 && out.spec.accepted_per_pos[1] == 104);
    proto_msg_clear(&out);
    assert_int_equal(decode_heartbeat_with("kvx_rx", 6, 2, err, sizeof(err), &out), -1);
    assert_non_null(strstr(err, "kvx_rx"));
    assert_int_equal(decode_heartbeat_with("kvx_rx", 65, -1, err, sizeof(err), &out), -1);
    assert_int_equal(decode_heartbeat_with("kvx_rx", 0, -1, err, sizeof(err), &out), 0);
    proto_msg_clear(&out);

    /* a negative duration is refused */
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 4);
    kv(&pk, "t"); msgpack_pack_int(&pk, PROTO_FINISH);
    kv(&pk, "v"); msgpack_pack_int(&pk, PROTO_VERSION);
    kv(&pk, "rid"); msgpack_pack_int(&pk, 1);
    kv(&pk, "reason"); msgpack_pack_int(&pk, 1);
    assert_int_equal(proto_decode(sb.data, sb.size, &out, err, sizeof(err)), 0);
    proto_msg_clear(&out);
    msgpack_sbuffer_clear(&sb);
    msgpack_pack_map(&pk, 5);
    kv(&pk, "t"); msgpack_pack_int(&pk, PROTO_FINISH);
    kv(&pk, "v"); msgpack_pack_int(&pk, PROTO_VERSION);
    kv(&pk, "rid"); msgpack_pack_int(&pk, 1);
    kv(&pk, "reason"); msgpack_pack_int(&pk, 1);
    kv(&pk, "prefill_us"); msgpack_pack_int(&pk, -3);
    assert_int_equal(proto_decode(sb.data, sb.size, &out, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "prefill_us"));
    msgpack_sbuffer_destroy(&sb);
}

/* A HEARTBEAT with one more key `key` whose value val packs (the prefix cache counters are
 * left out of the encoded map first). Returns proto_decode's result. */
static int decode_heartbeat_key(const char *key, void (*val)(msgpack_packer *), char *err,
                                size_t errlen, proto_msg *out)
{
    proto_msg m;
    fill(&m, PROTO_HEARTBEAT);
    m.prefix_queries = m.prefix_hits = 0; /* zero counters are not on the wire */
    unsigned char *buf;
    size_t len;
    assert_int_equal(proto_encode(&m, &buf, &len), 0);
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    assert_int_equal(msgpack_unpack_next(&up, (const char *)buf, len, &off),
                     MSGPACK_UNPACK_SUCCESS);
    const msgpack_object_map *map = &up.data.via.map;
    msgpack_pack_map(&pk, map->size + 1);
    for (uint32_t i = 0; i < map->size; i++) {
        assert_false(map->ptr[i].key.via.str.size == strlen(key) &&
                     memcmp(map->ptr[i].key.via.str.ptr, key, strlen(key)) == 0);
        msgpack_pack_object(&pk, map->ptr[i].key);
        msgpack_pack_object(&pk, map->ptr[i].val);
    }
    kv(&pk, key);
    val(&pk);
    msgpack_unpacked_destroy(&up);
    free(buf);
    int rc = proto_decode(sb.data, sb.size, out, err, errlen);
    msgpack_sbuffer_destroy(&sb);
    return rc;
}

static void v_negative(msgpack_packer *pk) { msgpack_pack_int(pk, -1); }
static void v_string(msgpack_packer *pk) { kv(pk, "12"); }
static void v_big(msgpack_packer *pk) { msgpack_pack_uint64(pk, UINT64_MAX); }

/* HEARTBEAT pc_q / pc_hit (prefix cache counters): u64, absent = 0, anything else refused. */
static void test_prefix_cache_counters(void **state)
{
    (void)state;
    char err[128] = "";
    proto_msg out;
    assert_int_equal(decode_heartbeat_key("pc_q", v_big, err, sizeof(err), &out), 0);
    assert_true(out.prefix_queries == UINT64_MAX);
    assert_true(out.prefix_hits == 0);
    proto_msg_clear(&out);
    assert_int_equal(decode_heartbeat_key("pc_hit", v_negative, err, sizeof(err), &out), -1);
    assert_non_null(strstr(err, "pc_hit"));
    assert_int_equal(decode_heartbeat_key("pc_q", v_string, err, sizeof(err), &out), -1);
    assert_non_null(strstr(err, "pc_q"));
}

/* "pfx" values: one of each malformation, and a good one */
static void pfx_group(msgpack_packer *pk, uint64_t seed, int la, int n, uint64_t h0)
{
    msgpack_pack_array(pk, 3);
    msgpack_pack_uint64(pk, seed);
    msgpack_pack_int(pk, la);
    msgpack_pack_array(pk, (size_t)n);
    for (int k = 0; k < n; k++)
        msgpack_pack_uint64(pk, h0 + (uint64_t)k);
}
static void v_pfx_ok(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 2);
    pfx_group(pk, UINT64_MAX, 0, 3, 10);
    pfx_group(pk, 7, 2, 0, 0);
}
static void v_pfx_not_array(msgpack_packer *pk) { msgpack_pack_int(pk, 1); }
static void v_pfx_groups(msgpack_packer *pk)
{
    msgpack_pack_array(pk, PROTO_PFX_MAX_GROUPS + 1);
    for (int g = 0; g <= PROTO_PFX_MAX_GROUPS; g++)
        pfx_group(pk, 1, g % (PROTO_PFX_MAX_LOOKAHEAD + 1), 0, 0);
}
static void v_pfx_dup(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 2);
    pfx_group(pk, 1, 1, 1, 5);
    pfx_group(pk, 2, 1, 1, 6);
}
static void v_pfx_la(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 1);
    pfx_group(pk, 1, PROTO_PFX_MAX_LOOKAHEAD + 1, 1, 5);
}
static void v_pfx_la_negative(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 1);
    pfx_group(pk, 1, -1, 1, 5);
}
static void v_pfx_short(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 1);
    msgpack_pack_array(pk, 2);
    msgpack_pack_uint64(pk, 1);
    msgpack_pack_int(pk, 0);
}
static void v_pfx_hash(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 1);
    msgpack_pack_array(pk, 3);
    msgpack_pack_uint64(pk, 1);
    msgpack_pack_int(pk, 0);
    msgpack_pack_array(pk, 2);
    msgpack_pack_uint64(pk, 1);
    msgpack_pack_int(pk, -4);
}
static void v_pfx_seed(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 1);
    msgpack_pack_array(pk, 3);
    kv(pk, "seed");
    msgpack_pack_int(pk, 0);
    msgpack_pack_array(pk, 0);
}
static void v_pfx_too_many(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 2);
    pfx_group(pk, 1, 0, PROTO_PFX_MAX_HASHES, 0);
    pfx_group(pk, 2, 1, 1, 0);
}

/* HEARTBEAT "pfx" (the prefix summary of cache-aware routing): a round trip keeps every
 * group and hash in order; every malformation is refused, naming the field. */
static void test_prefix_summary(void **state)
{
    (void)state;
    static proto_prefix_summary px = {
        .n_groups = 3,
        .group = {{.seed = 11, .lookahead = 0, .n = 2}, {.seed = UINT64_MAX, .lookahead = 2, .n = 0},
                  {.seed = 0, .lookahead = 1, .n = 1}},
        .n_hashes = 3,
        .hashes = {0, UINT64_MAX, 42},
    };
    proto_msg m, out;
    fill(&m, PROTO_HEARTBEAT);
    m.pfx = &px;
    unsigned char *buf;
    size_t len;
    char err[160] = "";
    assert_int_equal(proto_encode(&m, &buf, &len), 0);
    assert_int_equal(proto_decode(buf, len, &out, err, sizeof(err)), 0);
    free(buf);
    assert_non_null(out.pfx);
    assert_int_equal(out.pfx->n_groups, 3);
    assert_int_equal(out.pfx->n_hashes, 3);
    for (int g = 0; g < 3; g++) {
        assert_true(out.pfx->group[g].seed == px.group[g].seed);
        assert_int_equal(out.pfx->group[g].lookahead, px.group[g].lookahead);
        assert_int_equal(out.pfx->group[g].n, px.group[g].n);
    }
    for (int k = 0; k < 3; k++)
        assert_true(out.pfx->hashes[k] == px.hashes[k]);
    proto_msg_clear(&out);
    /* an empty summary is a summary (no group: nothing cached, no seed) */
    static proto_prefix_summary empty;
    m.pfx = &empty;
    assert_int_equal(proto_encode(&m, &buf, &len), 0);
    assert_int_equal(proto_decode(buf, len, &out, err, sizeof(err)), 0);
    free(buf);
    assert_non_null(out.pfx);
    assert_int_equal(out.pfx->n_groups, 0);
    proto_msg_clear(&out);
    /* the encoder refuses a summary out of bounds */
    static proto_prefix_summary bad;
    bad = px;
    bad.group[2].lookahead = 0; /* lookahead twice */
    m.pfx = &bad;
    assert_int_equal(proto_encode(&m, &buf, &len), -1);
    bad = px;
    bad.n_hashes = 4; /* the groups hold 3 */
    assert_int_equal(proto_encode(&m, &buf, &len), -1);

    assert_int_equal(decode_heartbeat_key("pfx", v_pfx_ok, err, sizeof(err), &out), 0);
    assert_int_equal(out.pfx->n_groups, 2);
    assert_int_equal(out.pfx->n_hashes, 3);
    assert_true(out.pfx->group[0].seed == UINT64_MAX);
    assert_true(out.pfx->hashes[0] == 10 && out.pfx->hashes[2] == 12);
    assert_int_equal(out.pfx->group[1].lookahead, 2);
    assert_int_equal(out.pfx->group[1].n, 0);
    proto_msg_clear(&out);
    struct { const char *name; void (*val)(msgpack_packer *); const char *needle; } cases[] = {
        {"not an array", v_pfx_not_array, "at most 8 groups"},
        {"9 groups", v_pfx_groups, "at most 8 groups"},
        {"lookahead twice", v_pfx_dup, "share lookahead 1"},
        {"lookahead 5", v_pfx_la, "group 0 is not"},
        {"lookahead -1", v_pfx_la_negative, "group 0 is not"},
        {"group of 2", v_pfx_short, "group 0 is not"},
        {"negative hash", v_pfx_hash, "group 0 hash 1"},
        {"string seed", v_pfx_seed, "group 0 is not"},
        {"4097 hashes", v_pfx_too_many, "more than 4096 hashes"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        err[0] = 0;
        int rc = decode_heartbeat_key("pfx", cases[i].val, err, sizeof(err), &out);
        if (rc != -1 || !strstr(err, "'pfx'") || !strstr(err, cases[i].needle))
            fail_msg("case '%s': rc %d err '%s'", cases[i].name, rc, err);
        assert_null(out.pfx);
    }
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_all_types),
        cmocka_unit_test(test_malformed_headers),
        cmocka_unit_test(test_prefix_cache_counters),
        cmocka_unit_test(test_prefix_summary),
        cmocka_unit_test(test_any_key_order),
        cmocka_unit_test(test_truncated_and_garbage),
        cmocka_unit_test(test_peek_refused_header),
        cmocka_unit_test(test_encode_rejects),
        cmocka_unit_test(test_register_ack_refusal),
        cmocka_unit_test(test_send_recv_frames),
        cmocka_unit_test(test_send_header_sizes),
        cmocka_unit_test(test_optional_fields_unset),
        cmocka_unit_test(test_error_preempted),
        cmocka_unit_test(test_send_dontwait_no_peer),
        cmocka_unit_test(test_counter_arrays),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("protocol", tests, NULL, NULL);
}
