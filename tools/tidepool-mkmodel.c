/*
 * tidepool-mkmodel: write a Llama-shaped GGUF with random weights, for benchmarks.
 *
 *   tidepool-mkmodel --out PATH [--preset 1b] [--dim N] [--hidden-dim N] [--layers N]
 *                    [--heads N] [--kv-heads N] [--vocab N] [--ctx N]
 *                    [--type f32|f16|q8_0] [--seed N] [--name NAME]
 *
 * The weights are uniform in [-a, a] with a = sqrt(3 / fan_in) (unit-variance outputs
 * for unit-variance inputs, so activations stay finite through any depth), the norm
 * weights are 1; a given seed gives the same file. The 2-D matrices take --type (norms stay
 * F32); the classifier is a separate output.weight. The tokenizer is a synthetic
 * byte-level vocabulary: <unk>, <s>, </s>, the 256 byte tokens <0x00>..<0xFF>, then
 * filler pieces "▁t<id>" up to --vocab, so the gateway can load and use it (every text
 * encodes through byte fallback). The file is written atomically; each tensor is generated
 * straight into its final type, so memory use is the file size.
 *
 * Preset 1b: dim 2048, 22 layers, 32 heads, 4 KV heads, FFN 5632, vocab 32000, ctx 2048
 * (the TinyLlama-1.1B shape): 2.2 GB at F16, 1.2 GB at Q8_0.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "kernels.h"

typedef struct {
    int dim, hidden_dim, layers, heads, kv_heads, vocab, ctx;
    gguf_tensor_type type;
    uint64_t seed;
    const char *out, *name;
} mk_opts;

static void usage(FILE *f)
{
    fprintf(f, "usage: tidepool-mkmodel --out PATH [--preset 1b] [--dim N] [--hidden-dim N]\n"
               "                        [--layers N] [--heads N] [--kv-heads N] [--vocab N]\n"
               "                        [--ctx N] [--type f32|f16|q8_0] [--seed N] [--name NAME]\n"
               "  Write a GGUF with random (seeded) weights of a Llama shape, for benchmarks.\n"
               "  defaults: dim 256, hidden-dim 768, layers 4, heads 8, kv-heads 4, vocab 512,\n"
               "  ctx 512, type f32, seed 1. --preset 1b: dim 2048, hidden-dim 5632, layers 22,\n"
               "  heads 32, kv-heads 4, vocab 32000, ctx 2048 (flags after it override).\n");
}

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform in [-a, a). */
static float uniform(uint64_t *s, float a)
{
    return ((float)(splitmix64(s) >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * a;
}

/* One matrix (rows, cols) in type, generated row by row from its own seed. NULL on OOM. */
static void *make_mat(gguf_tensor_type type, int rows, int cols, uint64_t seed, float *row)
{
    size_t rb = (size_t)gguf_tensor_nbytes(type, (uint64_t)cols);
    uint8_t *data = malloc(rb * (size_t)rows);
    if (!data)
        return NULL;
    float a = sqrtf(3.0f / (float)cols);
    uint64_t s = seed;
    for (int i = 0; i < rows; i++) {
        for (int j = 0; j < cols; j++)
            row[j] = uniform(&s, a);
        uint8_t *dst = data + (size_t)i * rb;
        if (type == GGUF_TENSOR_F32) {
            memcpy(dst, row, rb);
        } else if (type == GGUF_TENSOR_F16) {
            for (int j = 0; j < cols; j++) {
                uint16_t h = gguf_fp32_to_fp16(row[j]);
                memcpy(dst + 2 * (size_t)j, &h, 2);
            }
        } else {
            kern_quantize_q8_0(row, cols, dst);
        }
    }
    return data;
}

static int parse_int(const char *flag, const char *v, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) {
        fprintf(stderr, "tidepool-mkmodel: %s: invalid value '%s' (range %ld..%ld)\n", flag, v, lo,
                hi);
        return -1;
    }
    *out = x;
    return 0;
}

static int parse_args(int argc, char **argv, mk_opts *o)
{
    *o = (mk_opts){256, 768, 4, 8, 4, 512, 512, GGUF_TENSOR_F32, 1, NULL, NULL};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            exit(0);
        }
        const char *v = i + 1 < argc ? argv[++i] : NULL;
        long x = 0;
        int bad = !v;
        if (bad) {
        } else if (strcmp(a, "--out") == 0) {
            o->out = v;
        } else if (strcmp(a, "--name") == 0) {
            o->name = v;
        } else if (strcmp(a, "--preset") == 0) {
            if (strcmp(v, "1b") == 0) {
                o->dim = 2048;
                o->hidden_dim = 5632;
                o->layers = 22;
                o->heads = 32;
                o->kv_heads = 4;
                o->vocab = 32000;
                o->ctx = 2048;
            } else {
                fprintf(stderr, "tidepool-mkmodel: unknown preset '%s' (known: 1b)\n", v);
                bad = 1;
            }
        } else if (strcmp(a, "--type") == 0) {
            if (strcmp(v, "f32") == 0)
                o->type = GGUF_TENSOR_F32;
            else if (strcmp(v, "f16") == 0)
                o->type = GGUF_TENSOR_F16;
            else if (strcmp(v, "q8_0") == 0)
                o->type = GGUF_TENSOR_Q8_0;
            else
                bad = 1;
        } else if (strcmp(a, "--seed") == 0) {
            bad = parse_int(a, v, 0, 1L << 62, &x) != 0;
            o->seed = (uint64_t)x;
        } else {
            struct {
                const char *flag;
                int *dst;
                long lo, hi;
            } ints[] = {
                {"--dim", &o->dim, 2, 1 << 16},        {"--hidden-dim", &o->hidden_dim, 1, 1 << 18},
                {"--layers", &o->layers, 1, 1024},     {"--heads", &o->heads, 1, 1024},
                {"--kv-heads", &o->kv_heads, 1, 1024}, {"--vocab", &o->vocab, 259, 1 << 20},
                {"--ctx", &o->ctx, 1, 1 << 20},
            };
            int found = 0;
            for (size_t k = 0; k < sizeof(ints) / sizeof(ints[0]); k++) {
                if (strcmp(a, ints[k].flag) == 0) {
                    found = 1;
                    bad = parse_int(a, v, ints[k].lo, ints[k].hi, &x) != 0;
                    *ints[k].dst = (int)x;
                }
            }
            bad |= !found;
        }
        if (bad) {
            fprintf(stderr, "tidepool-mkmodel: bad or incomplete argument: %s\n", a);
            usage(stderr);
            return -1;
        }
    }
    if (!o->out) {
        usage(stderr);
        return -1;
    }
    if (o->dim % o->heads != 0 || o->heads % o->kv_heads != 0 || (o->dim / o->heads) % 2 != 0) {
        fprintf(stderr, "tidepool-mkmodel: dim must split into heads of even size, and heads "
                        "into kv-heads\n");
        return -1;
    }
    if (o->type == GGUF_TENSOR_Q8_0 && (o->dim % 32 != 0 || o->hidden_dim % 32 != 0)) {
        fprintf(stderr, "tidepool-mkmodel: q8_0 needs dim and hidden-dim multiples of 32\n");
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    gguf_writer_cleanup_on_signals(); /* no stray <out>.tmp.<pid> when interrupted */
    mk_opts o;
    if (parse_args(argc, argv, &o) != 0)
        return 2;
    const int V = o.vocab, dim = o.dim, hid = o.hidden_dim, L = o.layers;
    const int hs = dim / o.heads, kv_dim = o.kv_heads * hs;
    int rc = 1;
    gguf_writer_t *w = gguf_writer_new();
    int n_bufs = 0, cap_bufs = 16 + 9 * L;
    void **bufs = calloc((size_t)cap_bufs, sizeof(void *));
    float *row = malloc((size_t)(dim > hid ? dim : hid) * sizeof(float));
    float *ones = malloc((size_t)dim * sizeof(float));
    const char **pieces = calloc((size_t)V, sizeof(char *));
    size_t *plens = calloc((size_t)V, sizeof(size_t));
    float *scores = calloc((size_t)V, sizeof(float));
    int32_t *types = calloc((size_t)V, sizeof(int32_t));
    char *arena = malloc((size_t)V * 16);
    if (!w || !bufs || !row || !ones || !pieces || !plens || !scores || !types || !arena) {
        fprintf(stderr, "tidepool-mkmodel: out of memory\n");
        goto out;
    }
    for (int i = 0; i < dim; i++)
        ones[i] = 1.0f;

    /* vocabulary: control, bytes, fillers. Text encodes to byte tokens only (the pieces
     * of byte tokens are "<0xXX>", whose concatenations are in no piece, so nothing
     * merges); the fillers decode to " t<id>". */
    char *ap = arena;
    for (int i = 0; i < V; i++) {
        int n;
        if (i < 3) {
            static const char *ctl[3] = {"<unk>", "<s>", "</s>"};
            n = snprintf(ap, 16, "%s", ctl[i]);
            types[i] = i == 0 ? 2 : 3;
        } else if (i < 259) {
            n = snprintf(ap, 16, "<0x%02X>", i - 3);
            types[i] = 6;
        } else {
            n = snprintf(ap, 16, "\xe2\x96\x81t%d", i);
            types[i] = 1;
            scores[i] = -(float)i;
        }
        pieces[i] = ap;
        plens[i] = (size_t)n;
        ap += n + 1;
    }

    int err = 0;
    err |= gguf_writer_add_str(w, "general.architecture", "llama");
    err |= gguf_writer_add_str(w, "general.name", o.name ? o.name : "tidepool-synthetic");
    err |= gguf_writer_add_u32(w, "general.alignment", GGUF_DEFAULT_ALIGNMENT);
    err |= gguf_writer_add_u32(w, "general.file_type",
                               o.type == GGUF_TENSOR_F32   ? 0
                               : o.type == GGUF_TENSOR_F16 ? 1
                                                           : 7);
    err |= gguf_writer_add_u32(w, "llama.context_length", (uint32_t)o.ctx);
    err |= gguf_writer_add_u32(w, "llama.embedding_length", (uint32_t)dim);
    err |= gguf_writer_add_u32(w, "llama.block_count", (uint32_t)L);
    err |= gguf_writer_add_u32(w, "llama.feed_forward_length", (uint32_t)hid);
    err |= gguf_writer_add_u32(w, "llama.attention.head_count", (uint32_t)o.heads);
    err |= gguf_writer_add_u32(w, "llama.attention.head_count_kv", (uint32_t)o.kv_heads);
    err |= gguf_writer_add_u32(w, "llama.rope.dimension_count", (uint32_t)hs);
    err |= gguf_writer_add_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    err |= gguf_writer_add_f32(w, "llama.rope.freq_base", 10000.0f);
    err |= gguf_writer_add_str(w, "tidepool.rope.pairing", "adjacent");
    err |= gguf_writer_add_str(w, "tokenizer.ggml.model", "llama");
    err |= gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", pieces, plens, (uint64_t)V);
    err |= gguf_writer_add_arr_f32(w, "tokenizer.ggml.scores", scores, (uint64_t)V);
    err |= gguf_writer_add_arr_i32(w, "tokenizer.ggml.token_type", types, (uint64_t)V);
    err |= gguf_writer_add_u32(w, "tokenizer.ggml.bos_token_id", 1);
    err |= gguf_writer_add_u32(w, "tokenizer.ggml.eos_token_id", 2);
    err |= gguf_writer_add_u32(w, "tokenizer.ggml.unknown_token_id", 0);

    uint64_t seed = o.seed * 0x100000001b3ULL + 12345;
#define ADD_MAT(nm, rows, cols)                                                                    \
    do {                                                                                           \
        void *d = make_mat(o.type, (rows), (cols), splitmix64(&seed), row);                        \
        if (!d) {                                                                                  \
            fprintf(stderr, "tidepool-mkmodel: out of memory\n");                                  \
            goto out;                                                                              \
        }                                                                                          \
        bufs[n_bufs++] = d;                                                                        \
        uint64_t ne[2] = {(uint64_t)(cols), (uint64_t)(rows)};                                     \
        err |= gguf_writer_add_tensor(w, (nm), o.type, 2, ne, d);                                  \
    } while (0)
#define ADD_NORM(nm)                                                                               \
    do {                                                                                           \
        uint64_t ne1 = (uint64_t)dim;                                                              \
        err |= gguf_writer_add_tensor(w, (nm), GGUF_TENSOR_F32, 1, &ne1, ones);                    \
    } while (0)

    ADD_MAT("token_embd.weight", V, dim);
    char nm[96];
    for (int l = 0; l < L; l++) {
#define NM(s) (snprintf(nm, sizeof(nm), "blk.%d." s ".weight", l), nm)
        ADD_NORM(NM("attn_norm"));
        ADD_MAT(NM("attn_q"), dim, dim);
        ADD_MAT(NM("attn_k"), kv_dim, dim);
        ADD_MAT(NM("attn_v"), kv_dim, dim);
        ADD_MAT(NM("attn_output"), dim, dim);
        ADD_NORM(NM("ffn_norm"));
        ADD_MAT(NM("ffn_gate"), hid, dim);
        ADD_MAT(NM("ffn_down"), dim, hid);
        ADD_MAT(NM("ffn_up"), hid, dim);
#undef NM
    }
    ADD_NORM("output_norm.weight");
    ADD_MAT("output.weight", V, dim);
    if (err) {
        fprintf(stderr, "tidepool-mkmodel: cannot build the file (out of memory?)\n");
        goto out;
    }
    char werr[1024];
    if (gguf_writer_write(w, o.out, werr, sizeof(werr)) != 0) {
        fprintf(stderr, "tidepool-mkmodel: %s\n", werr);
        goto out;
    }
    rc = 0;
out:
    for (int i = 0; i < n_bufs; i++)
        free(bufs[i]);
    free(bufs);
    free(row);
    free(ones);
    free(pieces);
    free(plens);
    free(scores);
    free(types);
    free(arena);
    gguf_writer_destroy(&w);
    return rc;
}
