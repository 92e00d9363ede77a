/* protocol: see protocol.h. The wire format is driven by one field table: for each field,
 * its key, kind, offset in proto_msg, and the set of message types that require it. */
#include "protocol.h"

#include <errno.h>
#include <math.h>
#include <msgpack.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"

/* F_KEY: a CURVE public key, exactly 40 characters of Z85 (RFC 32) decoding to 32 bytes,
 * in a char[PROTO_KEY_LEN] */
/* F_SAMP: proto_msg.samp, a proto_sampling (protocol.h) */
/* F_LPS: proto_msg.lps, n_tokens proto_logprob (protocol.h) */
/* F_HASHES: proto_msg.bhash, n_bhash uint64_t (malloc'd, at most PROTO_MAX_BLOCK_HASHES);
 * F_PFX: proto_msg.pfx, a proto_prefix_summary (protocol.h) */
typedef enum {
    F_U64, F_I64, F_INT, F_FLOAT, F_STR, F_TOKENS, F_U64S, F_KEY, F_SAMP, F_LPS, F_HASHES, F_PFX
} field_kind_t;

#define MAX_U64S 64 /* F_U64S: longest array accepted; elements past the known ones are ignored */

#define T(x) (1ull << (x))
#define CTL_W (T(PROTO_REGISTER) | T(PROTO_HEARTBEAT))

typedef struct {
    const char *key;
    size_t key_len;        /* strlen(key): compared first when decoding */
    field_kind_t kind;
    size_t off;
    size_t size;           /* F_STR: buffer size; F_U64S: bytes of the uint64_t array */
    int64_t min, max;      /* F_INT / F_I64 range; F_FLOAT uses them as a range too */
    uint64_t required;     /* types that must carry it */
    uint64_t allowed;      /* types that may carry it (required implies allowed) */
} field_t;

#define FLD(k, kind, member, lo, hi, req, opt) \
    {k, sizeof(k) - 1, kind, offsetof(proto_msg, member), sizeof(((proto_msg *)0)->member), lo, hi, req, \
     (req) | (opt)}

#define KV_ALL (T(PROTO_KV_BEGIN) | T(PROTO_KV_BEGIN_ACK) | T(PROTO_KV_LAYER) | \
                T(PROTO_KV_END) | T(PROTO_KV_RESULT) | T(PROTO_KV_ABORT))
#define RID_TYPES (T(PROTO_PREFILL) | T(PROTO_MIGRATE) | T(PROTO_CANCEL) | T(PROTO_TOKENS) | \
                   T(PROTO_FINISH) | T(PROTO_ERROR) | KV_ALL)

static const field_t fields[] = {
    FLD("rid", F_U64, rid, 1, 0, RID_TYPES, 0),
    FLD("wid", F_STR, worker_id, 0, 0, CTL_W | T(PROTO_BYE), 0),
    FLD("role", F_INT, role, 1, 3, CTL_W | T(PROTO_ROLE), 0),
    FLD("state", F_INT, state, 1, 3, T(PROTO_HEARTBEAT), 0),
    FLD("kvep", F_STR, kv_endpoint, 0, 0, T(PROTO_REGISTER), 0),
    FLD("kvpk", F_KEY, kv_pubkey, 0, 0, 0, T(PROTO_REGISTER)),
    FLD("fp", F_U64, fingerprint, 0, 0, T(PROTO_REGISTER) | T(PROTO_KV_BEGIN), 0),
    FLD("pid", F_INT, pid, 0, INT32_MAX, T(PROTO_REGISTER), 0),
    FLD("n_ctx", F_INT, n_ctx, 1, 1 << 24, T(PROTO_REGISTER), 0),
    FLD("bs", F_INT, block_size, 1, 1 << 16, T(PROTO_REGISTER) | T(PROTO_KV_BEGIN), 0),
    FLD("max_seqs", F_INT, max_seqs, 0, 1 << 20, T(PROTO_REGISTER), 0),
    FLD("kv_total", F_INT, kv_blocks_total, 0, INT32_MAX, CTL_W, 0),
    FLD("kv_free", F_INT, kv_blocks_free, 0, INT32_MAX, CTL_W, 0),
    FLD("running", F_INT, running, 0, INT32_MAX, T(PROTO_HEARTBEAT), 0),
    FLD("queued", F_INT, queued, 0, INT32_MAX, T(PROTO_HEARTBEAT), 0),
    FLD("qtok", F_INT, queued_prompt_tokens, 0, INT32_MAX, T(PROTO_HEARTBEAT), 0),
    FLD("tok_in", F_U64, tokens_in, 0, 0, T(PROTO_HEARTBEAT), 0),
    FLD("tok_out", F_U64, tokens_out, 0, 0, T(PROTO_HEARTBEAT), 0),
    FLD("hb_ms", F_INT, heartbeat_ms, 1, 3600000, T(PROTO_REGISTER_ACK), 0),
    FLD("tokens", F_TOKENS, tokens, 0, 0, T(PROTO_PREFILL) | T(PROTO_TOKENS), T(PROTO_KV_BEGIN)),
    FLD("samp", F_SAMP, samp, 0, 0, 0, T(PROTO_PREFILL) | T(PROTO_KV_BEGIN)),
    FLD("index", F_INT, index, 0, INT32_MAX, T(PROTO_TOKENS), 0),
    FLD("max_tokens", F_INT, max_tokens, 1, 1 << 24, T(PROTO_PREFILL) | T(PROTO_KV_BEGIN), 0),
    FLD("temp", F_FLOAT, temperature, 0, 100, T(PROTO_PREFILL) | T(PROTO_KV_BEGIN), 0),
    FLD("top_p", F_FLOAT, top_p, 0, 1, T(PROTO_PREFILL) | T(PROTO_KV_BEGIN), 0),
    FLD("top_k", F_INT, top_k, 0, 1 << 24, T(PROTO_PREFILL) | T(PROTO_KV_BEGIN), 0),
    FLD("rng", F_U64, rng, 0, 0, T(PROTO_PREFILL) | T(PROTO_KV_END), T(PROTO_TOKENS)),
    FLD("dw", F_STR, decode_worker, 0, 0, T(PROTO_PREFILL) | T(PROTO_MIGRATE), 0),
    FLD("dep", F_STR, decode_endpoint, 0, 0, T(PROTO_PREFILL) | T(PROTO_MIGRATE), 0),
    FLD("dpk", F_KEY, decode_pubkey, 0, 0, 0, T(PROTO_PREFILL) | T(PROTO_MIGRATE)),
    FLD("mtp", F_INT, mtp_depth, 0, PROTO_SPEC_MAX_POS + 1, 0,
        T(PROTO_PREFILL) | T(PROTO_KV_BEGIN) | T(PROTO_REGISTER)),
    FLD("reason", F_INT, reason, 1, 2, T(PROTO_FINISH), 0),
    FLD("code", F_INT, code, 0, 100, T(PROTO_ERROR), T(PROTO_KV_BEGIN_ACK) |
        T(PROTO_KV_RESULT) | T(PROTO_KV_ABORT) | T(PROTO_REGISTER_ACK)),
    FLD("retry", F_INT, retryable, 0, 1, 0, T(PROTO_ERROR)),
    FLD("ok", F_INT, ok, 0, 1, T(PROTO_KV_BEGIN_ACK) | T(PROTO_KV_RESULT), 0),
    FLD("msg", F_STR, message, 0, 0, 0, T(PROTO_ERROR) | T(PROTO_KV_BEGIN_ACK) |
        T(PROTO_KV_RESULT) | T(PROTO_KV_ABORT) | T(PROTO_BYE) | T(PROTO_REGISTER_ACK)),
    FLD("xfer", F_U64, xfer, 1, 0, KV_ALL, 0),
    FLD("n_layer", F_INT, n_layer, 1, 4096, T(PROTO_KV_BEGIN), 0),
    FLD("n_kv_head", F_INT, n_kv_head, 1, 4096, T(PROTO_KV_BEGIN), 0),
    FLD("head_dim", F_INT, head_dim, 1, 65536, T(PROTO_KV_BEGIN), 0),
    FLD("dtype", F_INT, dtype, 0, 1, T(PROTO_KV_BEGIN), 0),
    FLD("layer", F_INT, layer, 0, 4095, T(PROTO_KV_LAYER), 0),
    FLD("blk0", F_INT, blk0, 0, PROTO_MAX_FRAMES - 1, 0, T(PROTO_KV_LAYER)),
    FLD("n_blocks", F_INT, n_blocks, 0, PROTO_MAX_FRAMES, T(PROTO_KV_LAYER) | T(PROTO_KV_BEGIN),
        0),
    FLD("n_kv_tok", F_INT, n_kv_tokens, 1, 1 << 24, T(PROTO_KV_BEGIN), 0),
    FLD("n_mtp", F_INT, n_mtp, 0, 64, 0, T(PROTO_KV_BEGIN)),
    FLD("mtp_fp", F_U64, mtp_fp, 0, 0, 0, T(PROTO_KV_BEGIN)),
    FLD("hid", F_INT, n_hidden, 0, 1 << 20, 0, T(PROTO_KV_BEGIN)),
    FLD("gen", F_INT, n_gen, 0, 1 << 24, 0, T(PROTO_KV_BEGIN)),
    FLD("first", F_INT, first_token, 0, INT32_MAX, T(PROTO_KV_END), 0),
    FLD("cksum", F_U64, checksum, 0, 0, T(PROTO_KV_END), 0),
    FLD("lease_ms", F_INT, lease_ms, 1, 3600000, 0, T(PROTO_KV_BEGIN) | T(PROTO_KV_BEGIN_ACK)),
    FLD("pad", F_I64, pad_bytes, 0, PROTO_MAX_PAD, 0, T(PROTO_KV_BEGIN)),
    FLD("ts", F_I64, ts_us, INT64_MIN, INT64_MAX, 0, ~0ull),
    FLD("kvx_tx", F_U64S, kvx_tx, 0, 0, 0, T(PROTO_HEARTBEAT)),
    FLD("kvx_rx", F_U64S, kvx_rx, 0, 0, 0, T(PROTO_HEARTBEAT)),
    FLD("spec", F_U64S, spec, 0, 0, 0, T(PROTO_HEARTBEAT)),
    FLD("queue_us", F_I64, queue_us, 0, INT64_MAX, 0,
        T(PROTO_TOKENS) | T(PROTO_FINISH) | T(PROTO_KV_END)),
    FLD("prefill_us", F_I64, prefill_us, 0, INT64_MAX, 0,
        T(PROTO_TOKENS) | T(PROTO_FINISH) | T(PROTO_KV_END)),
    FLD("xfer_us", F_I64, xfer_us, 0, INT64_MAX, 0, T(PROTO_TOKENS) | T(PROTO_FINISH)),
    FLD("xfer_bytes", F_U64, xfer_bytes, 0, 0, 0, T(PROTO_TOKENS) | T(PROTO_FINISH)),
    FLD("step_us", F_I64, step_us, 0, INT64_MAX, 0, T(PROTO_TOKENS) | T(PROTO_FINISH)),
    FLD("emu", F_INT, emulated, 0, 1, 0, CTL_W),
    FLD("role_us", F_I64, role_change_us, 0, INT64_MAX, 0, T(PROTO_HEARTBEAT)),
    FLD("n_role", F_U64, n_role_changes, 0, 0, 0, T(PROTO_HEARTBEAT)),
    FLD("mig", F_U64S, mig, 0, 0, 0, T(PROTO_HEARTBEAT)),
    FLD("pc_q", F_U64, prefix_queries, 0, 0, 0, T(PROTO_HEARTBEAT)),
    FLD("pc_hit", F_U64, prefix_hits, 0, 0, 0, T(PROTO_HEARTBEAT)),
    FLD("npre", F_U64, n_preemptions, 0, 0, 0, T(PROTO_HEARTBEAT)),
    FLD("pfx", F_PFX, pfx, 0, 0, 0, T(PROTO_HEARTBEAT)),
    FLD("pri", F_INT, priority, 0, 1, 0, T(PROTO_PREFILL) | T(PROTO_KV_BEGIN)),
    FLD("age_us", F_I64, age_us, 0, INT64_MAX, 0, T(PROTO_PREFILL)),
    FLD("lpk", F_INT, logprobs, 0, PROTO_MAX_TOP_LOGPROBS + 1, 0,
        T(PROTO_PREFILL) | T(PROTO_KV_BEGIN)),
    FLD("lp", F_LPS, lps, 0, 0, 0, T(PROTO_TOKENS)),
    FLD("echo", F_INT, echo, 0, 1, 0, T(PROTO_PREFILL) | T(PROTO_TOKENS)),
    FLD("bh", F_HASHES, bhash, 0, 0, 0, T(PROTO_KV_BEGIN)),
    FLD("bla", F_INT, block_lookahead, 0, PROTO_MAX_LOOKAHEAD, 0, T(PROTO_KV_BEGIN)),
    FLD("have", F_INT, have_blocks, 0, PROTO_MAX_BLOCK_HASHES, 0, T(PROTO_KV_BEGIN_ACK)),
};
#define N_FIELDS (sizeof(fields) / sizeof(fields[0]))
_Static_assert(sizeof(proto_kvx_counters) == 7 * sizeof(uint64_t), "counters are a u64 array");
_Static_assert(sizeof(proto_mig_counters) == 4 * sizeof(uint64_t), "counters are a u64 array");
_Static_assert(sizeof(proto_spec_counters) == (3 + PROTO_SPEC_MAX_POS) * sizeof(uint64_t),
               "counters are a u64 array");

static const char *type_names[] = {
    [PROTO_REGISTER] = "REGISTER",   [PROTO_REGISTER_ACK] = "REGISTER_ACK",
    [PROTO_HEARTBEAT] = "HEARTBEAT", [PROTO_PREFILL] = "PREFILL",
    [PROTO_CANCEL] = "CANCEL",       [PROTO_TOKENS] = "TOKENS",
    [PROTO_FINISH] = "FINISH",       [PROTO_ERROR] = "ERROR",
    [PROTO_BYE] = "BYE",             [PROTO_KV_BEGIN] = "KV_BEGIN",
    [PROTO_KV_BEGIN_ACK] = "KV_BEGIN_ACK", [PROTO_KV_LAYER] = "KV_LAYER",
    [PROTO_KV_END] = "KV_END",       [PROTO_KV_RESULT] = "KV_RESULT",
    [PROTO_KV_ABORT] = "KV_ABORT",   [PROTO_ROLE] = "ROLE",
    [PROTO_MIGRATE] = "MIGRATE",     [PROTO_BUNDLE] = "BUNDLE",
};

static int type_valid(int t)
{
    return t > 0 && t < PROTO_TYPE_END && t < (int)(sizeof(type_names) / sizeof(type_names[0])) &&
           type_names[t] != NULL;
}

const char *proto_type_str(int type)
{
    return type_valid(type) ? type_names[type] : "UNKNOWN";
}

const char *proto_err_str(int code)
{
    static const char *names[] = {"none",     "no_space",  "layout_mismatch", "checksum",
                                  "timeout",  "protocol",  "cancelled",       "internal",
                                  "bad_request", "unavailable", "preempted"};
    if (code < 0 || code >= (int)(sizeof(names) / sizeof(names[0])))
        return "unknown";
    return names[code];
}

const char *proto_role_str(int role)
{
    switch (role) {
    case PROTO_ROLE_PREFILL:
        return "prefill";
    case PROTO_ROLE_DECODE:
        return "decode";
    case PROTO_ROLE_MIXED:
        return "mixed";
    }
    return "unknown";
}

int proto_role_parse(const char *s, proto_role_t *out)
{
    static const proto_role_t roles[] = {PROTO_ROLE_PREFILL, PROTO_ROLE_DECODE, PROTO_ROLE_MIXED};
    for (size_t i = 0; s && i < sizeof(roles) / sizeof(roles[0]); i++) {
        if (strcmp(s, proto_role_str(roles[i])) == 0) {
            *out = roles[i];
            return 0;
        }
    }
    return -1;
}

void proto_msg_init(proto_msg *m, proto_type_t type)
{
    memset(m, 0, sizeof(*m));
    m->type = type;
}

void proto_msg_clear(proto_msg *m)
{
    free(m->tokens);
    free(m->samp);
    free(m->lps);
    free(m->bhash);
    free(m->pfx);
    memset(m, 0, sizeof(*m));
}

// --- CURVE keys (Z85 text, RFC 32; common/ cannot use libzmq's decoder)

static int key_valid(const char *s, size_t n)
{
    static const char z85[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                              ".-:+=^!/*?&<>()[]{}@%$#";
    if (n != PROTO_KEY_LEN - 1)
        return 0;
    for (size_t g = 0; g < n; g += 5) {
        uint64_t v = 0;
        for (size_t i = g; i < g + 5; i++) {
            const char *d = s[i] ? strchr(z85, s[i]) : NULL;
            if (!d)
                return 0;
            v = v * 85 + (uint64_t)(d - z85);
        }
        if (v > 0xffffffffull) /* five digits above 2^32 - 1 are no 4 bytes */
            return 0;
    }
    return 1;
}

// --- encoding

static int pack_str(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);
    return msgpack_pack_str(pk, n) || msgpack_pack_str_body(pk, s, n);
}

/* Whether field f goes on the wire for a message of type bit: required fields always;
 * optional ones only when set (non-zero number, non-empty string), so that an unset
 * optional field is absent rather than an out-of-range zero. */
static int field_encoded(const field_t *f, const proto_msg *m, uint64_t bit)
{
    if (f->required & bit)
        return 1;
    if (!(f->allowed & bit))
        return 0;
    const char *p = (const char *)m + f->off;
    switch (f->kind) {
    case F_U64:
        return *(const uint64_t *)p != 0;
    case F_I64:
        return *(const int64_t *)p != 0;
    case F_INT:
        return *(const int *)p != 0;
    case F_FLOAT:
        return *(const float *)p != 0.0f;
    case F_STR:
    case F_KEY:
        return p[0] != 0;
    case F_TOKENS:
        return m->n_tokens > 0;
    case F_SAMP:
        return m->samp != NULL;
    case F_LPS:
        return m->lps != NULL && m->n_tokens > 0;
    case F_HASHES:
        return m->n_bhash > 0;
    case F_PFX:
        return m->pfx != NULL;
    case F_U64S:
        for (size_t k = 0; k < f->size / sizeof(uint64_t); k++)
            if (((const uint64_t *)p)[k] != 0)
                return 1;
        return 0;
    }
    return 0;
}

/* Whether a prefix summary is within its bounds (protocol.h): group count, lookaheads
 * in range and distinct, group sizes summing to n_hashes. 0 or -1. */
static int pfx_check(const proto_prefix_summary *px)
{
    if (px->n_groups < 0 || px->n_groups > PROTO_PFX_MAX_GROUPS || px->n_hashes < 0 ||
        px->n_hashes > PROTO_PFX_MAX_HASHES)
        return -1;
    int sum = 0;
    for (int g = 0; g < px->n_groups; g++) {
        int la = px->group[g].lookahead;
        if (la < 0 || la > PROTO_PFX_MAX_LOOKAHEAD || px->group[g].n < 0)
            return -1;
        for (int j = 0; j < g; j++)
            if (px->group[j].lookahead == la)
                return -1;
        sum += px->group[g].n;
        if (sum > px->n_hashes)
            return -1;
    }
    return sum == px->n_hashes ? 0 : -1;
}

/* Pack the header of m through pk. Returns 0, or -1 if m is invalid for its type. */
static int encode_header(const proto_msg *m, msgpack_packer *pk)
{
    if (!type_valid(m->type))
        return -1;
    uint64_t bit = T(m->type);
    int n = 2;
    for (size_t i = 0; i < N_FIELDS; i++)
        if (field_encoded(&fields[i], m, bit))
            n++;
    if (m->n_tokens < 0 || m->n_tokens > PROTO_MAX_TOKENS || (m->n_tokens > 0 && !m->tokens))
        return -1;
    if (m->n_bhash < 0 || m->n_bhash > PROTO_MAX_BLOCK_HASHES || (m->n_bhash > 0 && !m->bhash))
        return -1;

    int rc = msgpack_pack_map(pk, (size_t)n);
    rc |= pack_str(pk, "t") | msgpack_pack_int(pk, m->type);
    rc |= pack_str(pk, "v") | msgpack_pack_int(pk, PROTO_VERSION);
    for (size_t i = 0; i < N_FIELDS && rc == 0; i++) {
        const field_t *f = &fields[i];
        if (!field_encoded(f, m, bit))
            continue;
        const char *p = (const char *)m + f->off;
        rc |= pack_str(pk, f->key);
        switch (f->kind) {
        case F_U64:
            rc |= msgpack_pack_uint64(pk, *(const uint64_t *)p);
            break;
        case F_I64:
            rc |= msgpack_pack_int64(pk, *(const int64_t *)p);
            break;
        case F_INT:
            rc |= msgpack_pack_int(pk, *(const int *)p);
            break;
        case F_FLOAT:
            rc |= msgpack_pack_float(pk, *(const float *)p);
            break;
        case F_STR:
            if (memchr(p, 0, f->size) == NULL)
                rc = -1;
            else
                rc |= pack_str(pk, p);
            break;
        case F_KEY:
            if (memchr(p, 0, f->size) == NULL || !key_valid(p, strlen(p)))
                rc = -1;
            else
                rc |= pack_str(pk, p);
            break;
        case F_TOKENS:
            rc |= msgpack_pack_array(pk, (size_t)m->n_tokens);
            for (int k = 0; k < m->n_tokens && rc == 0; k++)
                rc |= msgpack_pack_int(pk, m->tokens[k]);
            break;
        case F_HASHES:
            rc |= msgpack_pack_array(pk, (size_t)m->n_bhash);
            for (int k = 0; k < m->n_bhash && rc == 0; k++)
                rc |= msgpack_pack_uint64(pk, m->bhash[k]);
            break;
        case F_SAMP: {
            const proto_sampling *sa = m->samp;
            if (sa->n_bias < 0 || sa->n_bias > PROTO_MAX_BIAS || sa->n_stop < 0 ||
                sa->n_stop > PROTO_MAX_STOP_IDS) {
                rc = -1;
                break;
            }
            rc |= msgpack_pack_array(pk, sa->ignore_eos ? 9 : 8);
            rc |= msgpack_pack_float(pk, sa->presence) | msgpack_pack_float(pk, sa->frequency);
            rc |= msgpack_pack_float(pk, sa->repetition);
            rc |= msgpack_pack_int(pk, sa->min_tokens) | msgpack_pack_int(pk, sa->n_gen);
            rc |= msgpack_pack_array(pk, (size_t)sa->n_bias);
            for (int k = 0; k < sa->n_bias && rc == 0; k++)
                rc |= msgpack_pack_int(pk, sa->bias_ids[k]);
            rc |= msgpack_pack_array(pk, (size_t)sa->n_bias);
            for (int k = 0; k < sa->n_bias && rc == 0; k++)
                rc |= msgpack_pack_float(pk, sa->bias[k]);
            rc |= msgpack_pack_array(pk, (size_t)sa->n_stop);
            for (int k = 0; k < sa->n_stop && rc == 0; k++)
                rc |= msgpack_pack_int(pk, sa->stop_ids[k]);
            if (sa->ignore_eos)
                rc |= msgpack_pack_int(pk, 1);
            break;
        }
        case F_LPS:
            rc |= msgpack_pack_array(pk, (size_t)m->n_tokens);
            for (int k = 0; k < m->n_tokens && rc == 0; k++) {
                const proto_logprob *lp = &m->lps[k];
                if (lp->n_top < 0 || lp->n_top > PROTO_MAX_TOP_LOGPROBS || !isfinite(lp->logprob)) {
                    rc = -1;
                    break;
                }
                rc |= msgpack_pack_array(pk, 3) | msgpack_pack_float(pk, lp->logprob);
                rc |= msgpack_pack_array(pk, (size_t)lp->n_top);
                for (int j = 0; j < lp->n_top && rc == 0; j++)
                    rc |= msgpack_pack_int(pk, lp->top_ids[j]);
                rc |= msgpack_pack_array(pk, (size_t)lp->n_top);
                for (int j = 0; j < lp->n_top && rc == 0; j++)
                    rc |= msgpack_pack_float(pk, lp->top_logprobs[j]);
            }
            break;
        case F_PFX: {
            const proto_prefix_summary *px = m->pfx;
            if (pfx_check(px) < 0) {
                rc = -1;
                break;
            }
            rc |= msgpack_pack_array(pk, (size_t)px->n_groups);
            for (int g = 0, off = 0; g < px->n_groups && rc == 0; off += px->group[g++].n) {
                rc |= msgpack_pack_array(pk, 3) | msgpack_pack_uint64(pk, px->group[g].seed);
                rc |= msgpack_pack_int(pk, px->group[g].lookahead);
                rc |= msgpack_pack_array(pk, (size_t)px->group[g].n);
                for (int k = 0; k < px->group[g].n && rc == 0; k++)
                    rc |= msgpack_pack_uint64(pk, px->hashes[off + k]);
            }
            break;
        }
        case F_U64S:
            rc |= msgpack_pack_array(pk, f->size / sizeof(uint64_t));
            for (size_t k = 0; k < f->size / sizeof(uint64_t) && rc == 0; k++)
                rc |= msgpack_pack_uint64(pk, ((const uint64_t *)p)[k]);
            break;
        }
    }
    return rc != 0 ? -1 : 0;
}

int proto_encode(const proto_msg *m, unsigned char **out, size_t *len)
{
    *out = NULL;
    *len = 0;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    if (encode_header(m, &pk) < 0) {
        msgpack_sbuffer_destroy(&sb);
        return -1;
    }
    *out = (unsigned char *)sb.data; /* sbuffer memory is malloc'd: caller frees */
    *len = sb.size;
    return 0;
}

/* proto_encode_buf's header buffer: the caller's (on its stack), so that encoding a usual
 * header (every TOKENS of a decode step) allocates nothing; a larger one (a long PREFILL)
 * moves to the heap. */
typedef struct {
    char *data;
    size_t size, cap;
    char *heap; /* data when it outgrew the stack buffer, else NULL */
} hdr_buf;

static int hdr_buf_write(void *ud, const char *buf, size_t len)
{
    hdr_buf *b = ud;
    if (len > b->cap - b->size) {
        size_t cap = b->cap * 2 > b->size + len ? b->cap * 2 : b->size + len;
        char *p = realloc(b->heap, cap);
        if (!p)
            return -1;
        if (!b->heap)
            memcpy(p, b->data, b->size);
        b->heap = b->data = p;
        b->cap = cap;
    }
    memcpy(b->data + b->size, buf, len);
    b->size += len;
    return 0;
}

int proto_encode_buf(const proto_msg *m, void *buf, size_t cap, const void **out, size_t *len,
                     void **heap)
{
    hdr_buf hb = {buf, 0, cap, NULL};
    msgpack_packer pk;
    msgpack_packer_init(&pk, &hb, hdr_buf_write);
    *heap = NULL;
    if (encode_header(m, &pk) < 0) {
        free(hb.heap);
        *out = NULL;
        *len = 0;
        return -1;
    }
    *out = hb.data;
    *len = hb.size;
    *heap = hb.heap;
    return 0;
}

// --- decoding

static int fail(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t errlen, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

static int obj_int64(const msgpack_object *o, int64_t *v)
{
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (o->via.u64 > (uint64_t)INT64_MAX)
            return -1;
        *v = (int64_t)o->via.u64;
        return 0;
    }
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *v = o->via.i64;
        return 0;
    }
    return -1;
}

/* A number into *d (float or integer). 0 or -1. */
static int obj_num(const msgpack_object *o, double *d)
{
    int64_t iv;
    if (o->type == MSGPACK_OBJECT_FLOAT32 || o->type == MSGPACK_OBJECT_FLOAT64)
        *d = o->via.f64;
    else if (obj_int64(o, &iv) == 0)
        *d = (double)iv;
    else
        return -1;
    return isfinite(*d) ? 0 : -1;
}

/* "samp" (protocol.h proto_sampling) into a malloc'd struct. 0, or -1 with err. */
static int decode_samp(const msgpack_object *o, proto_msg *m, char *err, size_t errlen)
{
    if (o->type != MSGPACK_OBJECT_ARRAY || (o->via.array.size != 8 && o->via.array.size != 9))
        return fail(err, errlen, "field 'samp': want an array of 8 or 9");
    const msgpack_object *a = o->via.array.ptr;
    int64_t flags = 0;
    if (o->via.array.size == 9 && (obj_int64(&a[8], &flags) < 0 || flags < 0 || flags > 1))
        return fail(err, errlen, "field 'samp': element 8 (flags): want 0 or 1");
    double d[3];
    int64_t iv[2];
    for (int k = 0; k < 3; k++)
        if (obj_num(&a[k], &d[k]) < 0)
            return fail(err, errlen, "field 'samp': element %d is not a number", k);
    if (d[0] < -2 || d[0] > 2 || d[1] < -2 || d[1] > 2 || d[2] < 0 || d[2] > 2)
        return fail(err, errlen, "field 'samp': a penalty out of range");
    for (int k = 0; k < 2; k++)
        if (obj_int64(&a[3 + k], &iv[k]) < 0 || iv[k] < 0 || iv[k] > 1 << 24)
            return fail(err, errlen, "field 'samp': element %d: want an integer in [0, 2^24]",
                        3 + k);
    for (int k = 5; k < 8; k++)
        if (a[k].type != MSGPACK_OBJECT_ARRAY)
            return fail(err, errlen, "field 'samp': element %d is not an array", k);
    uint32_t nb = a[5].via.array.size, ns = a[7].via.array.size;
    if (nb > PROTO_MAX_BIAS || a[6].via.array.size != nb || ns > PROTO_MAX_STOP_IDS)
        return fail(err, errlen, "field 'samp': %u bias ids, %u biases, %u stop ids (at most "
                    "%d, equal counts, %d)", nb, a[6].via.array.size, ns, PROTO_MAX_BIAS,
                    PROTO_MAX_STOP_IDS);
    proto_sampling *sa = calloc(1, sizeof(*sa));
    if (!sa)
        return fail(err, errlen, "out of memory");
    sa->presence = (float)d[0];
    sa->frequency = (float)d[1];
    sa->repetition = d[2] > 0 ? (float)d[2] : 1.0f;
    sa->min_tokens = (int)iv[0];
    sa->n_gen = (int)iv[1];
    sa->ignore_eos = (int)(flags & 1);
    sa->n_bias = (int)nb;
    sa->n_stop = (int)ns;
    for (uint32_t k = 0; k < nb + ns; k++) {
        int64_t id;
        double b = 0;
        const msgpack_object *x = k < nb ? &a[5].via.array.ptr[k] : &a[7].via.array.ptr[k - nb];
        if (obj_int64(x, &id) < 0 || id < 0 || id > INT32_MAX ||
            (k < nb && (obj_num(&a[6].via.array.ptr[k], &b) < 0 || b < -100 || b > 100))) {
            free(sa);
            return fail(err, errlen, "field 'samp': bad %s %u", k < nb ? "bias" : "stop id",
                        k < nb ? k : k - nb);
        }
        if (k < nb) {
            sa->bias_ids[k] = (int)id;
            sa->bias[k] = (float)b;
        } else {
            sa->stop_ids[k - nb] = (int)id;
        }
    }
    free(m->samp);
    m->samp = sa;
    return 0;
}

/* A log-probability: finite, <= 0 (a little above 0 from rounding is accepted as 0). */
static int lp_value(const msgpack_object *o, float *out)
{
    double d;
    if (obj_num(o, &d) < 0 || d > 1e-3 || d < -1e30)
        return -1;
    *out = d > 0 ? 0.0f : (float)d;
    return 0;
}

/* "lp" (protocol.h proto_logprob, one per token) into a malloc'd array; its length is
 * checked against "tokens" once the whole header is read. 0, or -1 with err. */
static int decode_lps(const msgpack_object *o, proto_msg *m, int *n_lps, char *err,
                      size_t errlen)
{
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return fail(err, errlen, "field 'lp': want an array");
    uint32_t n = o->via.array.size;
    if (n == 0 || n > PROTO_MAX_TOKENS)
        return fail(err, errlen, "field 'lp': %u entries (want 1..%d)", n, PROTO_MAX_TOKENS);
    proto_logprob *lps = calloc(n, sizeof(*lps));
    if (!lps)
        return fail(err, errlen, "out of memory");
    for (uint32_t k = 0; k < n; k++) {
        const msgpack_object *e = &o->via.array.ptr[k];
        if (e->type != MSGPACK_OBJECT_ARRAY || e->via.array.size != 3)
            goto bad;
        const msgpack_object *a = e->via.array.ptr;
        if (lp_value(&a[0], &lps[k].logprob) < 0 || a[1].type != MSGPACK_OBJECT_ARRAY ||
            a[2].type != MSGPACK_OBJECT_ARRAY || a[1].via.array.size != a[2].via.array.size ||
            a[1].via.array.size > PROTO_MAX_TOP_LOGPROBS)
            goto bad;
        lps[k].n_top = (int)a[1].via.array.size;
        for (int j = 0; j < lps[k].n_top; j++) {
            int64_t id;
            if (obj_int64(&a[1].via.array.ptr[j], &id) < 0 || id < 0 || id > INT32_MAX ||
                lp_value(&a[2].via.array.ptr[j], &lps[k].top_logprobs[j]) < 0)
                goto bad;
            lps[k].top_ids[j] = (int)id;
        }
        continue;
    bad:
        free(lps);
        return fail(err, errlen, "field 'lp': entry %u is not [logprob <= 0, [<= %d ids], "
                    "[as many logprobs]]", k, PROTO_MAX_TOP_LOGPROBS);
    }
    free(m->lps);
    m->lps = lps;
    *n_lps = (int)n;
    return 0;
}

/* "pfx" (protocol.h proto_prefix_summary) into a malloc'd struct. 0, or -1 with err. */
static int decode_pfx(const msgpack_object *o, proto_msg *m, char *err, size_t errlen)
{
    if (o->type != MSGPACK_OBJECT_ARRAY || o->via.array.size > PROTO_PFX_MAX_GROUPS)
        return fail(err, errlen, "field 'pfx': want an array of at most %d groups",
                    PROTO_PFX_MAX_GROUPS);
    proto_prefix_summary *px = calloc(1, sizeof(*px));
    if (!px)
        return fail(err, errlen, "out of memory");
    uint32_t ng = o->via.array.size;
    for (uint32_t g = 0; g < ng; g++) {
        const msgpack_object *e = &o->via.array.ptr[g];
        int64_t la;
        if (e->type != MSGPACK_OBJECT_ARRAY || e->via.array.size != 3 ||
            e->via.array.ptr[0].type != MSGPACK_OBJECT_POSITIVE_INTEGER ||
            obj_int64(&e->via.array.ptr[1], &la) < 0 || la < 0 ||
            la > PROTO_PFX_MAX_LOOKAHEAD || e->via.array.ptr[2].type != MSGPACK_OBJECT_ARRAY) {
            free(px);
            return fail(err, errlen, "field 'pfx': group %u is not [seed, lookahead in [0, %d], "
                        "[hashes]]", g, PROTO_PFX_MAX_LOOKAHEAD);
        }
        const msgpack_object *hs = &e->via.array.ptr[2];
        uint32_t n = hs->via.array.size;
        if (n > (uint32_t)(PROTO_PFX_MAX_HASHES - px->n_hashes)) {
            free(px);
            return fail(err, errlen, "field 'pfx': more than %d hashes", PROTO_PFX_MAX_HASHES);
        }
        for (uint32_t j = 0; j < g; j++) {
            if (px->group[j].lookahead == (int)la) {
                free(px);
                return fail(err, errlen, "field 'pfx': groups %u and %u share lookahead %d", j,
                            g, (int)la);
            }
        }
        for (uint32_t k = 0; k < n; k++) {
            if (hs->via.array.ptr[k].type != MSGPACK_OBJECT_POSITIVE_INTEGER) {
                free(px);
                return fail(err, errlen, "field 'pfx': group %u hash %u is not an unsigned "
                            "integer", g, k);
            }
            px->hashes[px->n_hashes + (int)k] = hs->via.array.ptr[k].via.u64;
        }
        px->group[g].seed = e->via.array.ptr[0].via.u64;
        px->group[g].lookahead = (int)la;
        px->group[g].n = (int)n;
        px->n_hashes += (int)n;
        px->n_groups++;
    }
    free(m->pfx);
    m->pfx = px;
    return 0;
}

static int decode_field(const field_t *f, const msgpack_object *o, proto_msg *m, int *n_lps,
                        char *err, size_t errlen)
{
    char *p = (char *)m + f->off;
    int64_t iv;
    switch (f->kind) {
    case F_U64:
        if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
            return fail(err, errlen, "field '%s': want an unsigned integer", f->key);
        if (f->min > 0 && o->via.u64 < (uint64_t)f->min)
            return fail(err, errlen, "field '%s': must be >= %lld", f->key, (long long)f->min);
        *(uint64_t *)p = o->via.u64;
        return 0;
    case F_I64:
        if (obj_int64(o, &iv) < 0 || iv < f->min || iv > f->max)
            return fail(err, errlen, "field '%s': want an integer in [%lld, %lld]", f->key,
                        (long long)f->min, (long long)f->max);
        *(int64_t *)p = iv;
        return 0;
    case F_INT:
        if (obj_int64(o, &iv) < 0 || iv < f->min || iv > f->max)
            return fail(err, errlen, "field '%s': want an integer in [%lld, %lld]", f->key,
                        (long long)f->min, (long long)f->max);
        *(int *)p = (int)iv;
        return 0;
    case F_FLOAT: {
        double d;
        if (o->type == MSGPACK_OBJECT_FLOAT32 || o->type == MSGPACK_OBJECT_FLOAT64)
            d = o->via.f64;
        else if (obj_int64(o, &iv) == 0)
            d = (double)iv;
        else
            return fail(err, errlen, "field '%s': want a number", f->key);
        if (!isfinite(d) || d < (double)f->min || d > (double)f->max)
            return fail(err, errlen, "field '%s': out of range", f->key);
        *(float *)p = (float)d;
        return 0;
    }
    case F_STR:
        if (o->type != MSGPACK_OBJECT_STR)
            return fail(err, errlen, "field '%s': want a string", f->key);
        if (o->via.str.size >= f->size || memchr(o->via.str.ptr, 0, o->via.str.size))
            return fail(err, errlen, "field '%s': string too long or has NUL", f->key);
        memcpy(p, o->via.str.ptr, o->via.str.size);
        p[o->via.str.size] = 0;
        return 0;
    case F_KEY:
        if (o->type != MSGPACK_OBJECT_STR)
            return fail(err, errlen, "field '%s': want a string", f->key);
        if (!key_valid(o->via.str.ptr, o->via.str.size))
            return fail(err, errlen, "field '%s': not a CURVE key (40 Z85 characters)", f->key);
        memcpy(p, o->via.str.ptr, o->via.str.size);
        p[o->via.str.size] = 0;
        return 0;
    case F_TOKENS: {
        if (o->type != MSGPACK_OBJECT_ARRAY)
            return fail(err, errlen, "field '%s': want an array", f->key);
        uint32_t n = o->via.array.size;
        if (n > PROTO_MAX_TOKENS)
            return fail(err, errlen, "field '%s': %u tokens > %d", f->key, n, PROTO_MAX_TOKENS);
        int *toks = n ? malloc(n * sizeof(int)) : NULL;
        if (n && !toks)
            return fail(err, errlen, "out of memory");
        for (uint32_t k = 0; k < n; k++) {
            if (obj_int64(&o->via.array.ptr[k], &iv) < 0 || iv < 0 || iv > INT32_MAX) {
                free(toks);
                return fail(err, errlen, "field '%s': element %u is not a token id", f->key, k);
            }
            toks[k] = (int)iv;
        }
        free(m->tokens);
        m->tokens = toks;
        m->n_tokens = (int)n;
        return 0;
    }
    case F_HASHES: {
        if (o->type != MSGPACK_OBJECT_ARRAY)
            return fail(err, errlen, "field '%s': want an array", f->key);
        uint32_t n = o->via.array.size;
        if (n > PROTO_MAX_BLOCK_HASHES)
            return fail(err, errlen, "field '%s': %u hashes > %d", f->key, n,
                        PROTO_MAX_BLOCK_HASHES);
        uint64_t *hs = n ? malloc(n * sizeof(uint64_t)) : NULL;
        if (n && !hs)
            return fail(err, errlen, "out of memory");
        for (uint32_t k = 0; k < n; k++) {
            const msgpack_object *e = &o->via.array.ptr[k];
            if (e->type != MSGPACK_OBJECT_POSITIVE_INTEGER) {
                free(hs);
                return fail(err, errlen, "field '%s': element %u is not an unsigned integer",
                            f->key, k);
            }
            hs[k] = e->via.u64;
        }
        free(m->bhash);
        m->bhash = hs;
        m->n_bhash = (int)n;
        return 0;
    }
    case F_SAMP:
        return decode_samp(o, m, err, errlen);
    case F_LPS:
        return decode_lps(o, m, n_lps, err, errlen);
    case F_PFX:
        return decode_pfx(o, m, err, errlen);
    case F_U64S: {
        if (o->type != MSGPACK_OBJECT_ARRAY)
            return fail(err, errlen, "field '%s': want an array", f->key);
        uint32_t n = o->via.array.size;
        size_t known = f->size / sizeof(uint64_t);
        if (n > MAX_U64S)
            return fail(err, errlen, "field '%s': %u elements > %d", f->key, n, MAX_U64S);
        for (uint32_t k = 0; k < n; k++)
            if (o->via.array.ptr[k].type != MSGPACK_OBJECT_POSITIVE_INTEGER)
                return fail(err, errlen, "field '%s': element %u is not an unsigned integer",
                            f->key, k);
        for (uint32_t k = 0; k < n && k < known; k++)
            ((uint64_t *)p)[k] = o->via.array.ptr[k].via.u64;
        return 0;
    }
    }
    return -1;
}

static uint64_t be(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

/* Walk the msgpack encoding of buf without allocating and check that it is exactly one
 * well-formed object whose every container count and string length fits in the bytes
 * that remain. msgpack-c allocates from the declared counts before it reads the elements,
 * so a 20-byte header claiming a 2^32-entry map would otherwise cost gigabytes; after
 * this check every count is bounded by len. Returns 0 or -1. */
static int mp_check(const uint8_t *p, size_t len)
{
    size_t pos = 0;
    uint64_t need = 1; /* objects still to read */
    while (need > 0) {
        if (pos >= len)
            return -1;
        uint8_t tag = p[pos++];
        need--;
        uint64_t skip = 0, count = 0; /* payload bytes; child objects */
        int hdr = 0;                  /* bytes of length field after the tag */
        if (tag <= 0x7f || tag >= 0xe0 || tag == 0xc0 || tag == 0xc2 || tag == 0xc3) {
            continue;
        } else if (tag <= 0x8f) {
            count = 2u * (tag & 0x0f);
        } else if (tag <= 0x9f) {
            count = tag & 0x0f;
        } else if (tag <= 0xbf) {
            skip = tag & 0x1f;
        } else {
            switch (tag) {
            case 0xc4: case 0xd9: hdr = 1; break;        /* bin8, str8 */
            case 0xc5: case 0xda: hdr = 2; break;        /* bin16, str16 */
            case 0xc6: case 0xdb: hdr = 4; break;        /* bin32, str32 */
            case 0xc7: hdr = 1; skip = 1; break;         /* ext8: len, type */
            case 0xc8: hdr = 2; skip = 1; break;
            case 0xc9: hdr = 4; skip = 1; break;
            case 0xca: skip = 4; break;                  /* float32 */
            case 0xcb: skip = 8; break;                  /* float64 */
            case 0xcc: case 0xd0: skip = 1; break;
            case 0xcd: case 0xd1: skip = 2; break;
            case 0xce: case 0xd2: skip = 4; break;
            case 0xcf: case 0xd3: skip = 8; break;
            case 0xd4: skip = 2; break;                  /* fixext1..16: type + data */
            case 0xd5: skip = 3; break;
            case 0xd6: skip = 5; break;
            case 0xd7: skip = 9; break;
            case 0xd8: skip = 17; break;
            case 0xdc: case 0xde: hdr = 2; break;        /* array16, map16 */
            case 0xdd: case 0xdf: hdr = 4; break;        /* array32, map32 */
            default: return -1;                          /* 0xc1: never used */
            }
            if (hdr) {
                if (len - pos < (size_t)hdr)
                    return -1;
                uint64_t n = be(p + pos, hdr);
                pos += (size_t)hdr;
                if (tag == 0xdc || tag == 0xdd)
                    count = n;
                else if (tag == 0xde || tag == 0xdf)
                    count = 2 * n;
                else
                    skip += n;
            }
        }
        if (skip > len - pos)
            return -1;
        pos += (size_t)skip;
        if (count > len - pos) /* every element takes at least one byte */
            return -1;
        need += count;
        if (need > len - pos)
            return -1;
    }
    return pos == len ? 0 : -1;
}

int proto_decode(const void *buf, size_t len, proto_msg *m, char *err, size_t errlen)
{
    memset(m, 0, sizeof(*m));
    if (len == 0 || len > PROTO_MAX_HEADER)
        return fail(err, errlen, "header size %zu out of range", len);
    if (mp_check(buf, len) < 0)
        return fail(err, errlen, "header is not one well-formed msgpack object "
                                 "(truncated, trailing bytes, or counts beyond its size)");
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    int rc = -1;
    if (msgpack_unpack_next(&up, buf, len, &off) != MSGPACK_UNPACK_SUCCESS) {
        fail(err, errlen, "header is not valid msgpack");
        goto done;
    }
    if (off != len) {
        fail(err, errlen, "%zu trailing bytes after the header", len - off);
        goto done;
    }
    const msgpack_object *root = &up.data;
    if (root->type != MSGPACK_OBJECT_MAP) {
        fail(err, errlen, "header is not a map");
        goto done;
    }
    const msgpack_object_map *map = &root->via.map;
    int64_t type = -1, version = -1;
    for (uint32_t i = 0; i < map->size; i++) {
        const msgpack_object *k = &map->ptr[i].key;
        if (k->type != MSGPACK_OBJECT_STR || k->via.str.size != 1)
            continue;
        if (k->via.str.ptr[0] == 't' && obj_int64(&map->ptr[i].val, &type) < 0)
            type = -1;
        if (k->via.str.ptr[0] == 'v' && obj_int64(&map->ptr[i].val, &version) < 0)
            version = -1;
    }
    if (version != PROTO_VERSION) {
        fail(err, errlen, "protocol version %lld, want %d", (long long)version, PROTO_VERSION);
        goto done;
    }
    if (type < 0 || type > INT32_MAX || !type_valid((int)type)) {
        fail(err, errlen, "unknown message type %lld", (long long)type);
        goto done;
    }
    m->type = (proto_type_t)type;
    uint64_t bit = T(m->type);
    unsigned char seen[N_FIELDS] = {0}; /* fields decoded (a duplicate key is refused) */
    /* Keys are unique in the table and the encoder writes them in table order, so the
     * search for a key starts after the field found last and wraps: a header from
     * proto_encode costs one pass over the table, any other order is still found. */
    size_t hint = 0;
    int n_lps = 0; /* "lp" entries, checked against "tokens" at the end */
    for (uint32_t i = 0; i < map->size; i++) {
        const msgpack_object *k = &map->ptr[i].key;
        if (k->type != MSGPACK_OBJECT_STR) {
            fail(err, errlen, "%s: non-string key", proto_type_str(m->type));
            goto done;
        }
        if (k->via.str.size == 1 && (k->via.str.ptr[0] == 't' || k->via.str.ptr[0] == 'v'))
            continue; /* type and version, read above (no field has a 1-letter key) */
        for (size_t step = 0; step < N_FIELDS; step++) {
            size_t fi = hint + step < N_FIELDS ? hint + step : hint + step - N_FIELDS;
            const field_t *f = &fields[fi];
            if (f->key_len != k->via.str.size || f->key[0] != k->via.str.ptr[0] ||
                memcmp(f->key, k->via.str.ptr, k->via.str.size) != 0)
                continue;
            hint = fi + 1 < N_FIELDS ? fi + 1 : 0;
            if (!(f->allowed & bit))
                break; /* a key this type does not use: ignore */
            if (seen[fi]) {
                fail(err, errlen, "%s: duplicate field '%s'", proto_type_str(m->type), f->key);
                goto done;
            }
            if (decode_field(f, &map->ptr[i].val, m, &n_lps, err, errlen) < 0)
                goto done;
            seen[fi] = 1;
            break;
        }
    }
    for (size_t fi = 0; fi < N_FIELDS; fi++) {
        if ((fields[fi].required & bit) && !seen[fi]) {
            fail(err, errlen, "%s: missing field '%s'", proto_type_str(m->type), fields[fi].key);
            goto done;
        }
    }
    if (m->lps && n_lps != m->n_tokens) {
        fail(err, errlen, "%s: %d 'lp' entries for %d tokens", proto_type_str(m->type), n_lps,
             m->n_tokens);
        goto done;
    }
    rc = 0;
done:
    msgpack_unpacked_destroy(&up);
    if (rc < 0)
        proto_msg_clear(m); /* what the fields decoded so far allocated */
    return rc;
}

int proto_peek(const void *buf, size_t len, proto_type_t *type, uint64_t *rid)
{
    *type = 0;
    *rid = 0;
    if (len == 0 || len > PROTO_MAX_HEADER || mp_check(buf, len) < 0)
        return -1;
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    if (msgpack_unpack_next(&up, buf, len, &off) == MSGPACK_UNPACK_SUCCESS &&
        up.data.type == MSGPACK_OBJECT_MAP) {
        const msgpack_object_map *map = &up.data.via.map;
        for (uint32_t i = 0; i < map->size; i++) {
            const msgpack_object *k = &map->ptr[i].key, *v = &map->ptr[i].val;
            if (k->type != MSGPACK_OBJECT_STR || v->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
                continue;
            if (k->via.str.size == 1 && k->via.str.ptr[0] == 't' &&
                v->via.u64 <= INT32_MAX && type_valid((int)v->via.u64))
                *type = (proto_type_t)v->via.u64;
            else if (k->via.str.size == 3 && memcmp(k->via.str.ptr, "rid", 3) == 0)
                *rid = v->via.u64;
        }
    }
    msgpack_unpacked_destroy(&up);
    return *type && *rid ? 0 : -1;
}

int64_t proto_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int64_t proto_wall_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}
