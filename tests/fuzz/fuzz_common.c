/* fuzz_common: see fuzz_common.h. */
#include "fuzz_common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"

void fuzz_fail(const char *expr, const char *file, int line)
{
    fprintf(stderr, "fuzz check failed: %s (%s:%d)\n", expr, file, line);
    abort();
}

void fuzz_quiet(void)
{
    log_min_level = (log_level_t)(LOG_LEVEL_ERROR + 1);
}

void *fuzz_aligned_copy(const uint8_t *data, size_t size)
{
    void *p = NULL;
    if (posix_memalign(&p, 4096, size ? size : 1) != 0)
        fuzz_fail("posix_memalign", __FILE__, __LINE__);
    if (size)
        memcpy(p, data, size);
    return p;
}

unsigned char *fuzz_read_file(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    unsigned char *b = NULL;
    size_t cap = 0, len = 0;
    for (;;) {
        if (len == cap) {
            cap = cap ? cap * 2 : 65536;
            unsigned char *nb = realloc(b, cap);
            if (!nb) {
                free(b);
                fclose(f);
                return NULL;
            }
            b = nb;
        }
        size_t got = fread(b + len, 1, cap - len, f);
        len += got;
        if (got == 0)
            break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(b);
        return NULL;
    }
    *n = len;
    return b;
}

const char *fuzz_model_path(void)
{
    const char *p = getenv("TIDEPOOL_TEST_MODEL");
    if (!p || !*p)
        p = "build/models/stories260K.gguf";
    if (access(p, R_OK) != 0) {
        fprintf(stderr, "fuzz: the default model %s is missing (run `make` first, from the "
                        "repository root)\n", p);
        abort();
    }
    return p;
}

fuzz_tiny_spec fuzz_tiny_default(void)
{
    fuzz_tiny_spec s = {.dim = 8, .hidden_dim = 16, .n_layer = 1, .n_head = 2, .n_kv_head = 1,
                        .n_ctx = 16, .n_vocab = 16, .wtype = GGUF_TENSOR_F32, .with_base = 1};
    return s;
}

// --- the synthetic model

typedef struct {
    gguf_writer_t *w;
    gguf_tensor_type wtype;
    void **bufs; /* tensor data, borrowed by the writer until it writes */
    int n_bufs, cap_bufs;
    uint32_t rng;
    int rc;
} tiny;

static float next_val(tiny *t)
{
    t->rng = t->rng * 1664525u + 1013904223u;
    return ((float)(t->rng >> 8) / (float)(1u << 24) - 0.5f) * 0.5f;
}

static void *keep(tiny *t, size_t n)
{
    if (t->n_bufs == t->cap_bufs) {
        t->cap_bufs = t->cap_bufs ? 2 * t->cap_bufs : 64;
        void **nb = realloc(t->bufs, (size_t)t->cap_bufs * sizeof(void *));
        if (!nb)
            fuzz_fail("out of memory", __FILE__, __LINE__);
        t->bufs = nb;
    }
    void *p = calloc(1, n ? n : 1);
    if (!p)
        fuzz_fail("out of memory", __FILE__, __LINE__);
    t->bufs[t->n_bufs++] = p;
    return p;
}

/* A vector (F32, ones plus noise) or a matrix (rows, cols) of t->wtype. */
static void add(tiny *t, const char *name, int cols, int rows)
{
    uint64_t ne[2] = {(uint64_t)cols, (uint64_t)(rows ? rows : 1)};
    gguf_tensor_type ty = rows ? t->wtype : GGUF_TENSOR_F32;
    uint64_t n = ne[0] * ne[1];
    void *d = keep(t, (size_t)gguf_tensor_nbytes(ty, n));
    if (ty == GGUF_TENSOR_F32) {
        for (uint64_t i = 0; i < n; i++)
            ((float *)d)[i] = (rows ? 0.0f : 1.0f) + next_val(t);
    } else if (ty == GGUF_TENSOR_F16) {
        for (uint64_t i = 0; i < n; i++)
            ((uint16_t *)d)[i] = gguf_fp32_to_fp16(next_val(t));
    } else { /* Q8_0: blocks of an f16 scale and 32 int8 */
        uint8_t *b = d;
        for (uint64_t k = 0; k < n / 32; k++, b += 34) {
            uint16_t h = gguf_fp32_to_fp16(0.01f);
            memcpy(b, &h, 2);
            for (int i = 0; i < 32; i++)
                b[2 + i] = (uint8_t)(int8_t)((int)(next_val(t) * 200.0f));
        }
    }
    t->rc |= gguf_writer_add_tensor(t->w, name, ty, rows ? 2 : 1, ne, d);
}

static void add_block(tiny *t, const fuzz_tiny_spec *s, int l, int nextn)
{
    char nm[96];
    int kv_dim = s->n_kv_head * (s->dim / s->n_head);
#define NM(x) (snprintf(nm, sizeof(nm), "blk.%d." x ".weight", l), nm)
    if (nextn) {
        add(t, NM("nextn.hnorm"), s->dim, 0);
        add(t, NM("nextn.enorm"), s->dim, 0);
        add(t, NM("nextn.eh_proj"), 2 * s->dim, s->dim);
    }
    add(t, NM("attn_norm"), s->dim, 0);
    add(t, NM("attn_q"), s->dim, s->dim);
    add(t, NM("attn_k"), s->dim, kv_dim);
    add(t, NM("attn_v"), s->dim, kv_dim);
    add(t, NM("attn_output"), s->dim, s->dim);
    add(t, NM("ffn_norm"), s->dim, 0);
    add(t, NM("ffn_gate"), s->dim, s->hidden_dim);
    add(t, NM("ffn_down"), s->hidden_dim, s->dim);
    add(t, NM("ffn_up"), s->dim, s->hidden_dim);
#undef NM
}

static void add_tokenizer(tiny *t)
{
    static const char *merges[6] = {"\xe2\x96\x81", "a", "b", "ab", "\xe2\x96\x81" "a",
                                    "\xe2\x96\x81" "ab"};
    enum { N = FUZZ_TINY_TOKENIZER_VOCAB };
    static char bytes[256][8];
    const char *strs[N];
    size_t lens[N];
    float scores[N];
    strs[0] = "<unk>", strs[1] = "<s>", strs[2] = "</s>";
    for (int i = 0; i < 256; i++) {
        snprintf(bytes[i], sizeof(bytes[i]), "<0x%02X>", i);
        strs[3 + i] = bytes[i];
    }
    for (int i = 0; i < 6; i++)
        strs[259 + i] = merges[i];
    for (int i = 0; i < N; i++) {
        lens[i] = strlen(strs[i]);
        scores[i] = i < 259 ? 0.0f : (float)(-(i - 259));
    }
    t->rc |= gguf_writer_add_str(t->w, "tokenizer.ggml.model", "llama");
    t->rc |= gguf_writer_add_arr_str(t->w, "tokenizer.ggml.tokens", strs, lens, N);
    t->rc |= gguf_writer_add_arr_f32(t->w, "tokenizer.ggml.scores", scores, N);
    t->rc |= gguf_writer_add_u32(t->w, "tokenizer.ggml.bos_token_id", 1);
    t->rc |= gguf_writer_add_u32(t->w, "tokenizer.ggml.eos_token_id", 2);
    t->rc |= gguf_writer_add_u32(t->w, "tokenizer.ggml.unknown_token_id", 0);
}

int fuzz_tiny_write(const char *path, const fuzz_tiny_spec *s)
{
    tiny t = {.w = gguf_writer_new(), .wtype = s->wtype, .rng = 12345};
    if (!t.w)
        return -1;
    int vocab = s->with_tokenizer ? FUZZ_TINY_TOKENIZER_VOCAB : s->n_vocab;
    gguf_writer_t *w = t.w;
    t.rc |= gguf_writer_add_str(w, "general.architecture", "llama");
    t.rc |= gguf_writer_add_str(w, "general.name", s->with_base ? "tiny" : "tiny-mtp");
    t.rc |= gguf_writer_add_u32(w, "llama.context_length", (uint32_t)s->n_ctx);
    t.rc |= gguf_writer_add_u32(w, "llama.embedding_length", (uint32_t)s->dim);
    t.rc |= gguf_writer_add_u32(w, "llama.feed_forward_length", (uint32_t)s->hidden_dim);
    t.rc |= gguf_writer_add_u32(w, "llama.block_count",
                                (uint32_t)(s->n_layer + (s->with_base ? s->n_nextn : 0)));
    t.rc |= gguf_writer_add_u32(w, "llama.attention.head_count", (uint32_t)s->n_head);
    t.rc |= gguf_writer_add_u32(w, "llama.attention.head_count_kv", (uint32_t)s->n_kv_head);
    t.rc |= gguf_writer_add_u32(w, "llama.rope.dimension_count", (uint32_t)(s->dim / s->n_head));
    t.rc |= gguf_writer_add_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    t.rc |= gguf_writer_add_f32(w, "llama.rope.freq_base", 10000.0f);
    t.rc |= gguf_writer_add_str(w, "tidepool.rope.pairing", "adjacent");
    if (s->n_nextn) {
        static const float rate[2] = {0.5f, 0.25f};
        t.rc |= gguf_writer_add_u32(w, "llama.nextn_predict_layers", (uint32_t)s->n_nextn);
        t.rc |= gguf_writer_add_str(w, "tidepool.mtp.rope_position", "hidden");
        t.rc |= gguf_writer_add_str(w, "tidepool.mtp.hidden_input", "pre_final_norm");
        t.rc |= gguf_writer_add_str(w, "tidepool.mtp.head", "shared");
        t.rc |= gguf_writer_add_arr_f32(w, "tidepool.mtp.acceptance_rate", rate, 2);
    }
    if (s->with_tokenizer)
        add_tokenizer(&t);
    if (s->with_base) {
        add(&t, "token_embd.weight", s->dim, vocab);
        for (int l = 0; l < s->n_layer; l++)
            add_block(&t, s, l, 0);
        add(&t, "output_norm.weight", s->dim, 0);
        if (s->with_output)
            add(&t, "output.weight", s->dim, vocab);
    }
    for (int k = 0; k < s->n_nextn; k++)
        add_block(&t, s, s->n_layer + k, 1);
    char err[512] = "";
    int rc = t.rc ? -1 : gguf_writer_write(w, path, err, sizeof(err));
    if (rc != 0)
        fprintf(stderr, "fuzz: cannot write %s: %s\n", path, t.rc ? "bad spec" : err);
    gguf_writer_destroy(&t.w);
    for (int i = 0; i < t.n_bufs; i++)
        free(t.bufs[i]);
    free(t.bufs);
    return rc;
}

unsigned char *fuzz_tiny_bytes(const fuzz_tiny_spec *s, size_t *n)
{
    char path[] = "/tmp/tidepool-fuzz-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0)
        return NULL;
    close(fd);
    unsigned char *b = fuzz_tiny_write(path, s) == 0 ? fuzz_read_file(path, n) : NULL;
    unlink(path);
    return b;
}
