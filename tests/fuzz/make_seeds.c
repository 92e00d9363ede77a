/*
 * make_seeds: writes the seed corpora of the fuzzing harnesses (tests/fuzz/corpus/<name>/)
 * from the project's own encoders: protocol messages from proto_encode, GGUF files from
 * gguf_writer (fuzz_tiny_write), real request bodies, Batch API files, multipart uploads
 * and KV-transfer programs in fuzz_kvx's operation format. Deterministic: running it again
 * writes the same bytes (`make fuzz-seeds`; commit the result).
 *
 *   make_seeds [ROOT]    ROOT defaults to tests/fuzz/corpus
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz_common.h"
#include "protocol.h"

static const char *g_root = "tests/fuzz/corpus";

static void put(const char *harness, const char *name, const void *data, size_t n)
{
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", g_root, harness);
    if (mkdir(path, 0755) != 0 && errno != EEXIST) {
        perror(path);
        exit(1);
    }
    snprintf(path, sizeof(path), "%s/%s/%s", g_root, harness, name);
    FILE *f = fopen(path, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n) || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
}

/* A byte followed by a string (the harnesses whose byte 0 is a mode). */
static void put_mode(const char *harness, const char *name, int mode, const char *s)
{
    size_t n = strlen(s);
    unsigned char *b = malloc(n + 1);
    if (!b)
        exit(1);
    b[0] = (unsigned char)mode;
    memcpy(b + 1, s, n);
    put(harness, name, b, n + 1);
    free(b);
}

// --- protocol and wire

static int g_toks[5] = {1, 403, 2, 0, 511};
/* sampling controls (PREFILL / KV_BEGIN "samp") */
static proto_sampling g_samp = {.presence = 0.5f, .frequency = -1.25f, .repetition = 1.5f,
                                .min_tokens = 4, .n_gen = 2, .n_bias = 2,
                                .bias_ids = {432, 7}, .bias = {-100.0f, 2.5f},
                                .n_stop = 2, .stop_ids = {2, 13}};

/* log-probabilities (TOKENS "lp": one per token of g_toks) */
static proto_logprob g_lps[5] = {
    {.logprob = -0.03f, .n_top = 2, .top_ids = {432, 383}, .top_logprobs = {-0.03f, -3.5f}},
    {.logprob = -0.07f, .n_top = 1, .top_ids = {383}, .top_logprobs = {-0.07f}},
    {.logprob = -1.5f},
    {.logprob = -0.0f, .n_top = 3, .top_ids = {0, 1, 2}, .top_logprobs = {-1, -2, -3}},
    {.logprob = -20.0f, .n_top = 1, .top_ids = {511}, .top_logprobs = {-0.5f}},
};

/* a prefill worker's prefix summary (HEARTBEAT "pfx"): a depth-0 group of 3 blocks, an
 * empty depth-2 group */
static proto_prefix_summary g_pfx = {
    .n_groups = 2,
    .group = {{.seed = 0x9e3779b97f4a7c15ull, .lookahead = 0, .n = 3},
              {.seed = 0x1234, .lookahead = 2, .n = 0}},
    .n_hashes = 3,
    .hashes = {1, 0xffffffffffffffffull, 0x8000000000000000ull},
};

static int sample(proto_type_t t, proto_msg *m)
{
    proto_msg_init(m, t);
    m->rid = 42;
    m->ts_us = 1700000000000000;
    switch (t) {
    case PROTO_REGISTER:
    case PROTO_HEARTBEAT:
        snprintf(m->worker_id, sizeof(m->worker_id), "decode-1");
        snprintf(m->kv_endpoint, sizeof(m->kv_endpoint), "tcp://127.0.0.1:5560");
        m->role = PROTO_ROLE_DECODE;
        m->state = PROTO_STATE_READY;
        m->fingerprint = 0x0123456789abcdefull;
        m->pid = 1234;
        m->n_ctx = 512;
        m->block_size = 16;
        m->max_seqs = 64;
        m->kv_blocks_total = 1024;
        m->kv_blocks_free = 1000;
        m->running = 3;
        m->queued = 1;
        m->queued_prompt_tokens = 17;
        m->tokens_in = 100;
        m->tokens_out = 200;
        m->kvx_rx.n_ok = 5;
        m->kvx_rx.n_bytes = 1 << 20;
        m->spec.n_drafts = 9;
        m->mig.n_in = 1;
        m->emulated = 1;
        m->role_change_us = 1500;
        m->n_role_changes = 2;
        m->n_preemptions = 6;
        if (t == PROTO_REGISTER)
            m->mtp_depth = 3; /* the depth it serves + 1 */
        else
            m->pfx = &g_pfx;
        break;
    case PROTO_REGISTER_ACK:
        m->heartbeat_ms = 500;
        break;
    case PROTO_PREFILL:
    case PROTO_TOKENS:
        m->tokens = g_toks;
        m->n_tokens = 5;
        m->index = 3;
        m->max_tokens = 64;
        m->temperature = 0.8f;
        m->top_p = 0.95f;
        m->top_k = 40;
        m->rng = 99;
        m->mtp_depth = 3;
        m->priority = 1; /* PREFILL only */
        snprintf(m->decode_worker, sizeof(m->decode_worker), "decode-1");
        snprintf(m->decode_endpoint, sizeof(m->decode_endpoint), "tcp://127.0.0.1:5560");
        m->queue_us = 10;
        m->prefill_us = 2000;
        if (t == PROTO_PREFILL) {
            m->samp = &g_samp;
            m->logprobs = 6;
            m->echo = 1;
        } else {
            m->lps = g_lps;
        }
        break;
    case PROTO_MIGRATE:
        snprintf(m->decode_worker, sizeof(m->decode_worker), "decode-2");
        snprintf(m->decode_endpoint, sizeof(m->decode_endpoint), "tcp://127.0.0.1:5561");
        break;
    case PROTO_FINISH:
        m->reason = PROTO_FINISH_LENGTH;
        m->xfer_us = 300;
        m->xfer_bytes = 65536;
        m->step_us = 80;
        break;
    case PROTO_ERROR:
        m->code = PROTO_ERR_NOSPACE;
        m->retryable = 1;
        snprintf(m->message, sizeof(m->message), "no KV blocks free: \xc3\xa9t\xc3\xa9");
        break;
    case PROTO_BYE:
        snprintf(m->worker_id, sizeof(m->worker_id), "prefill-0");
        break;
    case PROTO_ROLE:
        m->role = PROTO_ROLE_MIXED;
        break;
    case PROTO_BUNDLE: /* no field of its own; the wire seed adds its frames */
        break;
    case PROTO_KV_BEGIN:
        m->xfer = 7;
        m->fingerprint = 0x0123456789abcdefull;
        m->block_size = 16;
        m->max_tokens = 32;
        m->temperature = 0;
        m->top_p = 1;
        m->n_layer = 7;
        m->n_kv_head = 8;
        m->head_dim = 8;
        m->dtype = PROTO_DTYPE_F32;
        m->n_blocks = 2;
        m->n_kv_tokens = 20;
        m->n_mtp = 2;
        m->mtp_fp = 0x55;
        m->n_hidden = 128;
        m->n_gen = 4;
        m->lease_ms = 5000;
        m->pad_bytes = 4096;
        m->mtp_depth = 2;
        m->priority = 1;
        m->logprobs = 3;
        m->samp = &g_samp;
        m->tokens = g_toks; /* the sequence's ids so far, with samp */
        m->n_tokens = 5;
        break;
    case PROTO_KV_BEGIN_ACK:
    case PROTO_KV_RESULT:
        m->xfer = 7;
        m->ok = 1;
        m->lease_ms = 5000;
        if (t == PROTO_KV_BEGIN_ACK)
            m->have_blocks = 1; /* the leading listed blocks the receiver holds */
        break;
    case PROTO_KV_LAYER:
        m->xfer = 7;
        m->layer = 3;
        m->blk0 = 1;
        m->n_blocks = 1;
        break;
    case PROTO_KV_END:
        m->xfer = 7;
        m->first_token = 12;
        m->checksum = 0xfeedfacecafebeefull;
        m->rng = 5;
        break;
    case PROTO_KV_ABORT:
        m->xfer = 7;
        m->code = PROTO_ERR_TIMEOUT;
        snprintf(m->message, sizeof(m->message), "lease expired");
        break;
    default:
        return -1;
    }
    return 0;
}

static void seeds_protocol(void)
{
    for (int t = 1; t < PROTO_TYPE_END; t++) {
        proto_msg m;
        if (sample((proto_type_t)t, &m) < 0)
            continue;
        unsigned char *b;
        size_t n;
        if (proto_encode(&m, &b, &n) != 0) {
            fprintf(stderr, "make_seeds: cannot encode %s\n", proto_type_str(t));
            exit(1);
        }
        char name[64];
        snprintf(name, sizeof(name), "%s", proto_type_str(t));
        put("protocol", name, b, n);
        /* the wire harness: [flags][u16 len][frame]...; ROUTER side with an identity and,
         * for KV_LAYER, two payload frames */
        int router = t >= PROTO_KV_BEGIN;
        unsigned char w[4096];
        size_t k = 0;
        w[k++] = (unsigned char)router;
        if (router) {
            w[k++] = 5, w[k++] = 0;
            memcpy(w + k, "\x00peer", 5);
            k += 5;
        }
        w[k++] = (unsigned char)(n & 0xff), w[k++] = (unsigned char)(n >> 8);
        memcpy(w + k, b, n);
        k += n;
        for (int f = 0; t == PROTO_KV_LAYER && f < 2; f++) {
            w[k++] = 16, w[k++] = 0;
            memset(w + k, 0x40 + f, 16);
            k += 16;
        }
        for (int f = 0; t == PROTO_BUNDLE && f < 2; f++) { /* a TOKENS and a FINISH */
            proto_msg in;
            unsigned char *fb;
            size_t fn;
            sample(f ? PROTO_FINISH : PROTO_TOKENS, &in);
            if (proto_encode(&in, &fb, &fn) != 0 || k + fn + 2 > sizeof(w))
                exit(1);
            w[k++] = (unsigned char)(fn & 0xff), w[k++] = (unsigned char)(fn >> 8);
            memcpy(w + k, fb, fn);
            k += fn;
            free(fb);
        }
        put("wire", name, w, k);
        free(b);
    }
    /* KV_BEGIN listing its prompt's full-block hashes (prefix caching) with the ids */
    static uint64_t hashes[2] = {0x1111222233334444ull, 0xfedcba9876543210ull};
    static int ids[20];
    for (int i = 0; i < 20; i++)
        ids[i] = 3 * i + 1;
    proto_msg m;
    sample(PROTO_KV_BEGIN, &m);
    m.samp = NULL;
    m.n_gen = 0;
    m.tokens = ids;
    m.n_tokens = 20;
    m.bhash = hashes;
    m.n_bhash = 1;
    m.block_lookahead = 2;
    unsigned char *b;
    size_t n;
    if (proto_encode(&m, &b, &n) != 0) {
        fprintf(stderr, "make_seeds: cannot encode KV_BEGIN with block hashes\n");
        exit(1);
    }
    put("protocol", "KV_BEGIN-hashes", b, n);
    free(b);
}

// --- request bodies, batch files, multipart

static void seeds_api(void)
{
    static const struct {
        int chat;
        const char *name, *body;
    } b[] = {
        {0, "completion", "{\"model\":\"stories260K\",\"prompt\":\"Once upon a time\","
                          "\"max_tokens\":48,\"temperature\":0}"},
        {0, "completion-full",
         "{\"prompt\":\"Hi\",\"max_tokens\":8,\"temperature\":1.5,\"top_p\":0.9,\"top_k\":40,"
         "\"seed\":-7,\"stop\":[\"\\n\",\"The end\"],\"stream\":true,\"stream_options\":"
         "{\"include_usage\":true},\"service_tier\":\"flex\",\"mtp_depth\":1,\"n\":1,"
         "\"best_of\":1,\"echo\":false,\"logprobs\":null,\"user\":\"u\"}"},
        {0, "completion-tokens", "{\"prompt\":[1,403,2],\"max_tokens\":4}"},
        {0, "completion-bad-type", "{\"prompt\":7,\"max_tokens\":\"x\"}"},
        {0, "completion-model-utf8",
         "{\"model\":\"\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9"
         "\xc3\xa9\xe6\xbc\xa2\xe5\xad\x97\",\"prompt\":\"x\"}"},
        {0, "completion-bad-json", "{\"prompt\": \"\xc3\xa9\xc3\xa9\", \"max_tokens\": }"},
        {0, "completion-tier", "{\"prompt\":\"a\",\"service_tier\":\"\xe2\x82\xac-tier\"}"},
        {1, "chat", "{\"model\":\"stories260K\",\"messages\":[{\"role\":\"system\",\"content\":"
                    "\"Be brief.\"},{\"role\":\"user\",\"content\":\"Tell me a story\"}],"
                    "\"max_tokens\":64,\"stream\":true}"},
        {1, "chat-parts", "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
                          "\"text\":\"Hello\"}]},{\"role\":\"assistant\",\"content\":\"Hi\"}],"
                          "\"max_completion_tokens\":5,\"stop\":\"x\"}"},
        {1, "chat-bad-role", "{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}"},
        {1, "chat-empty", "{\"messages\":[]}"},
        {1, "not-object", "[1,2,3]"},
        {0, "completion-tokens-nested", "{\"prompt\":[[1,403,2,0]],\"stream\":true}"},
        {0, "completion-logprobs", "{\"prompt\":\"Once\",\"logprobs\":5,\"stream\":true}"},
        {0, "completion-echo", "{\"prompt\":[1,403],\"logprobs\":2,\"echo\":true,\"n\":2,"
                               "\"best_of\":3}"},
        {1, "chat-logprobs", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                             "\"logprobs\":true,\"top_logprobs\":20}"},
    };
    for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++)
        put_mode("api", b[i].name, b[i].chat | (int)(i % 8) << 1, b[i].body);
}

static void seeds_batch(void)
{
    put_mode("batch_lines", "completions", 0,
             "{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":"
             "{\"prompt\":\"Once\",\"max_tokens\":4}}\n"
             "  {\"custom_id\":\"b\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":"
             "{\"prompt\":\"Upon\",\"max_tokens\":4,\"temperature\":0}}\r\n\n"
             "{\"custom_id\":\"a\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":"
             "{\"prompt\":\"dup\"}}\n");
    put_mode("batch_lines", "chat", 1,
             "{\"custom_id\":\"c1\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\","
             "\"body\":{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],"
             "\"max_tokens\":3}}\n");
    put_mode("batch_lines", "errors", 0,
             "not json\n"
             "{\"method\":\"POST\"}\n"
             "{\"custom_id\":\"x\",\"method\":\"GET\",\"url\":\"/v1/completions\",\"body\":{}}\n"
             "{\"custom_id\":\"y\",\"method\":\"POST\",\"url\":\"/v1/chat/completions\","
             "\"body\":{}}\n"
             "{\"custom_id\":\"z\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":7}\n"
             "{\"custom_id\":\"w\",\"method\":\"POST\",\"url\":\"/v1/completions\",\"body\":"
             "{\"prompt\":\"x\",\"model\":\"\xc3\xa9\xc3\xa9\xc3\xa9\",\"max_tokens\":-1}}\n"
             "\xff\xfe bad utf-8\n"
             "{\"custom_id\":\"\xe6\xbc\xa2\",\"method\":\"POST\",\"url\":\"/v1/completions\","
             "\"body\":{\"prompt\":\"\xe6\xbc\xa2\xe5\xad\x97\",\"stop\":[1]}}");
}

static void seeds_multipart(void)
{
    put("multipart", "upload",
        "multipart/form-data; boundary=----tp123\n"
        "preamble\r\n------tp123\r\n"
        "Content-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
        "------tp123  \r\n"
        "Content-Disposition: form-data; name=\"file\"; filename=\"in \\\"1\\\".jsonl\"\r\n"
        "Content-Type: application/jsonl\r\n\r\n"
        "{\"custom_id\":\"a\"}\n\r\n------tp123--\r\nepilogue",
        strlen("multipart/form-data; boundary=----tp123\n"
               "preamble\r\n------tp123\r\n"
               "Content-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
               "------tp123  \r\n"
               "Content-Disposition: form-data; name=\"file\"; filename=\"in \\\"1\\\".jsonl\"\r\n"
               "Content-Type: application/jsonl\r\n\r\n"
               "{\"custom_id\":\"a\"}\n\r\n------tp123--\r\nepilogue"));
    const char *q = "multipart/form-data; charset=utf-8; boundary=\"a b\"\n"
                    "--a b\r\nContent-Disposition: form-data; name=file; filename=x.jsonl\r\n"
                    "\r\nline\r\n--a b--";
    put("multipart", "quoted-boundary", q, strlen(q));
    const char *d = "\n--X\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n1\r\n--X\r\n"
                    "Content-Disposition: form-data; name=\"b\"\r\n\r\n\r\n--X--\r\n";
    put("multipart", "default-header", d, strlen(d));
}

// --- GGUF files

// --- the HTTP request's bytes (fuzz_http_wire: mode byte, then the bytes)

static void seeds_http_wire(void)
{
    static const char *const chunk[] = {"5",       "1a2B",       "0",  "5;name=value",
                                        "5 ; a = b ;c=\"x \\\" ;y\" ", "0x5", "+5", " 5", "zz",
                                        "5;=v",    "5;a=\"v",     "ffffffffffffffffff"};
    static const char *const target[] = {"/v1/models", "/v1/mo dels", "/v1/models?x=%zz",
                                         "/v1/models%4", "http://[::1]:8000/v1/models",
                                         "/v1/models?a=%20b&c=d~e;f=(g)*!$'+,:@/?", "/a#b"};
    static const char *const id[] = {"file-abc", "%66ile-abc", "file%2Fx", "file%00", "a%zz",
                                     "org%2Fname", "%"};
    char name[32];
    for (size_t i = 0; i < sizeof(chunk) / sizeof(chunk[0]); i++) {
        snprintf(name, sizeof(name), "chunk-%zu", i);
        put_mode("http_wire", name, 0, chunk[i]);
    }
    for (size_t i = 0; i < sizeof(target) / sizeof(target[0]); i++) {
        snprintf(name, sizeof(name), "target-%zu", i);
        put_mode("http_wire", name, 1, target[i]);
    }
    for (size_t i = 0; i < sizeof(id) / sizeof(id[0]); i++) {
        snprintf(name, sizeof(name), "id-%zu", i);
        put_mode("http_wire", name, i == 5 ? 2 + 3 * 6 : 2, id[i]); /* 20: "/" allowed */
    }
}

static void put_tiny(const char *harness, const char *name, const fuzz_tiny_spec *s)
{
    size_t n = 0;
    unsigned char *b = fuzz_tiny_bytes(s, &n);
    if (!b)
        exit(1);
    put(harness, name, b, n);
    free(b);
}

static void seeds_gguf(void)
{
    fuzz_tiny_spec s = fuzz_tiny_default();
    put_tiny("gguf", "tiny-f32", &s);
    put_tiny("model", "tiny-f32", &s);
    s.wtype = GGUF_TENSOR_F16;
    s.n_vocab = 12;
    put_tiny("gguf", "tiny-f16", &s);
    put_tiny("model", "tiny-f16", &s);
    s = fuzz_tiny_default();
    s.dim = 32;
    s.hidden_dim = 64;
    s.n_head = 4;
    s.n_kv_head = 2;
    s.n_layer = 2;
    s.n_vocab = 8;
    s.wtype = GGUF_TENSOR_Q8_0;
    s.with_output = 1;
    put_tiny("model", "tiny-q8-gqa", &s);
    s = fuzz_tiny_default();
    s.n_nextn = 1;
    put_tiny("model", "tiny-embedded-mtp", &s);
    /* MTP side files for fuzz_mtp's base (fuzz_tiny_default) */
    s = fuzz_tiny_default();
    s.with_base = 0;
    s.n_nextn = 2;
    put_tiny("mtp", "side-2", &s);
    s.n_nextn = 1;
    s.wtype = GGUF_TENSOR_F16;
    put_tiny("mtp", "side-1-f16", &s);
    /* a vocabulary without weights */
    s = fuzz_tiny_default();
    s.with_base = 0;
    s.with_tokenizer = 1;
    put_tiny("tokenizer_load", "vocab", &s);
    put_tiny("gguf", "vocab", &s);
}

static void seeds_tokenizer(void)
{
    put_mode("tokenizer", "story", 0,
             "Once upon a time, there was a little girl named Lily. She loved to play "
             "outside.\nOne day she saw a big, red ball.");
    put_mode("tokenizer", "utf8", 1, "caf\xc3\xa9 \xe6\xbc\xa2\xe5\xad\x97 \xf0\x9f\x98\x80 "
                                     "\xe2\x96\x81 tabs\tand  spaces ");
    static const unsigned char bytes[] = {0, 0xff, 0xfe, 0x80, 0xc3, 0x28, 0xe2, 0x82, 0x20,
                                          0x0a, 0x00, 0x7f, 0xf4, 0x90, 0x80, 0x80};
    put("tokenizer", "bytes", bytes, sizeof(bytes));
}

// --- KV transfer programs (fuzz_kvx's operation format)

static void seeds_kvx(void)
{
    /* one whole transfer: 3 tokens = 2 blocks, 2 main layers, then process */
    static const unsigned char whole[] = {
        1, 0, 0, 0, 2, 0, 4,        /* begin peer 0, xfer 1, rid 1, 3 tokens, flags 0 */
        2, 0, 0, 0, 0, 0, 2, 0, 17, /* layer 0 blocks [0, 2) */
        2, 0, 0, 0, 1, 0, 2, 0, 18, /* layer 1 */
        3, 0, 0, 0, 0,              /* end, right checksum */
        5};
    put("kvx", "whole", whole, sizeof(whole));
    /* chunked layers, MTP layer and hand-off state, a second peer's stray message */
    static const unsigned char mtp[] = {
        1, 1, 1, 1, 3, 8 | 16, 2,  /* begin peer 1, xfer 2, rid 2, 4 tokens = 2 blocks */
        5,
        2, 1, 1, 1, 0, 0, 1, 0, 1, /* layer 0 in two chunks */
        2, 1, 1, 1, 0, 1, 1, 0, 2,
        2, 1, 1, 1, 1, 0, 2, 0, 3, /* layer 1 */
        2, 0, 1, 1, 2, 0, 2, 0, 4, /* peer 0 meddles */
        2, 1, 1, 1, 2, 0, 2, 0, 4, /* the MTP layer */
        3, 1, 1, 1, 0, 5};         /* end with the hand-off state */
    put("kvx", "mtp-chunked", mtp, sizeof(mtp));
    /* padding, then a wrong checksum; an abort; a cancel; a rejected begin */
    static const unsigned char pad[] = {
        1, 0, 2, 2, 1, 64, 1, 2, 0, 2, 2, 0, 0, 1, 0, 9, 2, 0, 2, 2, 1, 0, 1, 0, 9,
        3, 0, 2, 2, 1, 5,
        1, 0, 3, 3, 7, 0, 3, 4, 0, 3, 3, 6, 5,
        1, 1, 0, 0, 2, 1 | 2, 1, 6, 0, 5};
    put("kvx", "padding-errors", pad, sizeof(pad));
    /* prefix caching: a prompt of 5 tokens (2 full blocks) sent whole, then one with the
     * same ids that the receiver holds but its last block of; a wrong hash; a migration
     * that lists hashes */
    static const unsigned char pfx[] = {
        7, 0, 0, 0, 4, 0, 1,        /* pbegin peer 0, xfer 1, rid 1, 5 tokens, base 1 */
        2, 0, 0, 0, 0, 0, 3, 0, 17, /* layer 0 blocks [0, 3) */
        2, 0, 0, 0, 1, 0, 3, 0, 18, /* layer 1 */
        3, 0, 0, 0, 0, 5,           /* end, right checksum; process */
        7, 0, 1, 1, 4, 0, 1,        /* the same prompt: blocks 0 and 1 are cached */
        2, 0, 1, 1, 0, 2, 1, 0, 19, /* layer 0 block 2 */
        2, 0, 1, 1, 1, 0, 1, 0, 19, /* layer 1 block 0: sent twice */
        5,
        7, 1, 2, 2, 4, 1, 1, 5,     /* a wrong hash: refused */
        7, 1, 3, 3, 4, 16 | 2, 2, 5}; /* lookahead 1 with MTP, migrated: refused */
    put("kvx", "prefix-cache", pfx, sizeof(pfx));
    /* a raw header (a KV_ABORT from proto_encode) */
    proto_msg m;
    sample(PROTO_KV_ABORT, &m);
    unsigned char *b;
    size_t n;
    if (proto_encode(&m, &b, &n) != 0 || n > 255)
        exit(1);
    unsigned char raw[300];
    size_t k = 0;
    raw[k++] = 0, raw[k++] = 0, raw[k++] = (unsigned char)n;
    memcpy(raw + k, b, n);
    k += n;
    raw[k++] = 1, raw[k++] = 3, raw[k++] = 'a', raw[k++] = 'b', raw[k++] = 'c', raw[k++] = 5;
    free(b);
    put("kvx", "raw", raw, k);
}

int main(int argc, char **argv)
{
    if (argc > 1)
        g_root = argv[1];
    if (mkdir(g_root, 0755) != 0 && errno != EEXIST) {
        perror(g_root);
        return 1;
    }
    seeds_protocol();
    seeds_api();
    seeds_batch();
    seeds_multipart();
    seeds_http_wire();
    seeds_gguf();
    seeds_tokenizer();
    seeds_kvx();
    return 0;
}
