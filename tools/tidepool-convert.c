/*
 * tidepool-convert: llama2.c checkpoint + tokenizer -> GGUF.
 *
 *   tidepool-convert --checkpoint PATH --tokenizer PATH --out PATH [--name NAME] [--f16]
 *
 * Input: the legacy (version 0) llama2.c checkpoint: 7 int32 (dim, hidden_dim, n_layers,
 * n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size means the classifier is
 * not shared with the embedding), then fp32 weights in run.c order: token_embedding
 * (vocab, dim), rms_att (L, dim), wq (L, dim, dim), wk (L, kv_dim, dim), wv (L, kv_dim,
 * dim), wo (L, dim, dim), rms_ffn (L, dim), w1 (L, hidden, dim), w2 (L, dim, hidden),
 * w3 (L, hidden, dim), rms_final (dim), freq_cis_real and freq_cis_imag (seq_len,
 * head_size / 2 each; skipped), then wcls (vocab, dim) when unshared. The file size must
 * match the header exactly. The tokenizer file: u32 max_token_length, then per token f32
 * score, i32 length, bytes.
 *
 * Output tensors use llama.cpp's names. The Q/K weights are stored exactly as in the
 * checkpoint (NOT permuted the way llama.cpp's HF converter does): llama2.c checkpoints
 * are in Meta's layout, where RoPE rotates adjacent pairs (i, i + 1) of each head, which
 * is what our engine (and run.c) does; the file says so with tidepool.rope.pairing =
 * "adjacent". The output is written atomically (temporary file, fsync, rename).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "gguf.h"

typedef struct {
    int32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
} ckpt_config;

static void usage(FILE *f)
{
    fprintf(f, "usage: tidepool-convert --checkpoint PATH --tokenizer PATH --out PATH "
               "[--name NAME] [--f16]\n"
               "  Convert a llama2.c (version 0) checkpoint and tokenizer.bin to GGUF.\n"
               "  --f16   store the 2-D weight matrices as F16 (norms stay F32)\n");
}

/* Read a whole file. Returns NULL with a message on failure. */
static unsigned char *read_file(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "tidepool-convert: %s: cannot open: %s\n", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fprintf(stderr, "tidepool-convert: %s: not a regular file\n", path);
        fclose(f);
        return NULL;
    }
    size_t n = (size_t)st.st_size;
    unsigned char *buf = malloc(n ? n : 1);
    if (!buf || fread(buf, 1, n, f) != n) {
        fprintf(stderr, "tidepool-convert: %s: read failed\n", path);
        free(buf);
        fclose(f);
        return NULL;
    }
    fclose(f);
    *size = n;
    return buf;
}

typedef struct {
    gguf_writer_t *w;
    int f16;
    uint16_t **halves; /* F16 copies to free after writing */
    int n_halves;
} conv;

/* Add a weight matrix (rows, cols), converting to F16 if asked. */
static int add_mat(conv *cv, const char *name, const float *data, uint64_t rows, uint64_t cols)
{
    uint64_t ne[2] = {cols, rows};
    if (!cv->f16)
        return gguf_writer_add_tensor(cv->w, name, GGUF_TENSOR_F32, 2, ne, data);
    uint64_t n = rows * cols;
    uint16_t *h = malloc(n * sizeof(uint16_t));
    if (!h)
        return -1;
    for (uint64_t i = 0; i < n; i++)
        h[i] = gguf_fp32_to_fp16(data[i]);
    cv->halves[cv->n_halves++] = h;
    return gguf_writer_add_tensor(cv->w, name, GGUF_TENSOR_F16, 2, ne, h);
}

static int add_vec(conv *cv, const char *name, const float *data, uint64_t n)
{
    return gguf_writer_add_tensor(cv->w, name, GGUF_TENSOR_F32, 1, &n, data);
}

int main(int argc, char **argv)
{
    gguf_writer_cleanup_on_signals(); /* no stray <out>.tmp.<pid> when interrupted */
    const char *ckpt_path = NULL, *tok_path = NULL, *out_path = NULL, *name = NULL;
    int f16 = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--f16") == 0) {
            f16 = 1;
        } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        } else if (i + 1 < argc && strcmp(a, "--checkpoint") == 0) {
            ckpt_path = argv[++i];
        } else if (i + 1 < argc && strcmp(a, "--tokenizer") == 0) {
            tok_path = argv[++i];
        } else if (i + 1 < argc && strcmp(a, "--out") == 0) {
            out_path = argv[++i];
        } else if (i + 1 < argc && strcmp(a, "--name") == 0) {
            name = argv[++i];
        } else {
            fprintf(stderr, "tidepool-convert: unknown or incomplete argument: %s\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!ckpt_path || !tok_path || !out_path) {
        usage(stderr);
        return 2;
    }

    int rc = 1;
    size_t ck_size = 0, tok_size = 0;
    unsigned char *ck = NULL, *tk = NULL;
    const char **pieces = NULL;
    size_t *piece_lens = NULL;
    float *scores = NULL;
    int32_t *types = NULL;
    conv cv = {0};

    ck = read_file(ckpt_path, &ck_size);
    if (!ck)
        goto out;
    ckpt_config c;
    if (ck_size < sizeof(c)) {
        fprintf(stderr,
                "tidepool-convert: %s: truncated checkpoint (%zu bytes, header needs "
                "%zu)\n",
                ckpt_path, ck_size, sizeof(c));
        goto out;
    }
    memcpy(&c, ck, sizeof(c));
    int shared = c.vocab_size > 0;
    int64_t vocab = c.vocab_size < 0 ? -(int64_t)c.vocab_size : c.vocab_size;
    if (c.dim <= 0 || c.hidden_dim <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 ||
        vocab <= 0 || c.seq_len <= 0 || c.dim > (1 << 16) || c.hidden_dim > (1 << 18) ||
        c.n_layers > 1024 || vocab > (1 << 22) || c.seq_len > (1 << 22) || c.dim % c.n_heads != 0 ||
        c.n_heads % c.n_kv_heads != 0 || (c.dim / c.n_heads) % 2 != 0) {
        fprintf(stderr,
                "tidepool-convert: %s: not a llama2.c checkpoint (bad header: dim %d hidden %d "
                "layers %d heads %d kv_heads %d vocab %d seq_len %d)\n",
                ckpt_path, c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size,
                c.seq_len);
        goto out;
    }
    uint64_t dim = (uint64_t)c.dim, hid = (uint64_t)c.hidden_dim, L = (uint64_t)c.n_layers;
    uint64_t hs = dim / (uint64_t)c.n_heads, kv_dim = hs * (uint64_t)c.n_kv_heads;
    uint64_t V = (uint64_t)vocab;
    uint64_t n_floats = V * dim + L * dim + L * dim * dim + 2 * L * dim * kv_dim + L * dim * dim +
                        L * dim + 3 * L * dim * hid + dim + (uint64_t)c.seq_len * hs +
                        (shared ? 0 : V * dim);
    uint64_t want = sizeof(c) + n_floats * 4;
    if (ck_size != want) {
        fprintf(stderr,
                "tidepool-convert: %s: %s checkpoint: the header implies %llu bytes, the "
                "file has %zu\n",
                ckpt_path, ck_size < want ? "truncated" : "size mismatch in",
                (unsigned long long)want, ck_size);
        goto out;
    }

    /* tokenizer */
    tk = read_file(tok_path, &tok_size);
    if (!tk)
        goto out;
    pieces = calloc(V, sizeof(*pieces));
    piece_lens = calloc(V, sizeof(*piece_lens));
    scores = calloc(V, sizeof(*scores));
    types = calloc(V, sizeof(*types));
    if (!pieces || !piece_lens || !scores || !types) {
        fprintf(stderr, "tidepool-convert: out of memory\n");
        goto out;
    }
    size_t off = 4;
    uint32_t max_len;
    if (tok_size < 4) {
        fprintf(stderr, "tidepool-convert: %s: truncated tokenizer file\n", tok_path);
        goto out;
    }
    memcpy(&max_len, tk, 4);
    for (uint64_t i = 0; i < V; i++) {
        int32_t len;
        if (tok_size - off < 8) {
            fprintf(stderr,
                    "tidepool-convert: %s: truncated tokenizer file at token %llu of "
                    "%llu\n",
                    tok_path, (unsigned long long)i, (unsigned long long)V);
            goto out;
        }
        memcpy(&scores[i], tk + off, 4);
        memcpy(&len, tk + off + 4, 4);
        off += 8;
        if (len < 0 || (uint32_t)len > max_len || (size_t)len > tok_size - off) {
            fprintf(stderr, "tidepool-convert: %s: bad length %d of token %llu (max %u)\n",
                    tok_path, len, (unsigned long long)i, max_len);
            goto out;
        }
        pieces[i] = (const char *)tk + off;
        piece_lens[i] = (size_t)len;
        off += (size_t)len;
        /* 1 normal, 2 unknown, 3 control, 6 byte */
        int is_byte = len == 6 && memcmp(pieces[i], "<0x", 3) == 0 && pieces[i][5] == '>';
        types[i] = i == 0 ? 2 : (i == 1 || i == 2) ? 3 : is_byte ? 6 : 1;
    }
    if (off != tok_size) {
        fprintf(stderr,
                "tidepool-convert: %s: %zu trailing bytes after %llu tokens (does the "
                "tokenizer match the checkpoint's vocab size?)\n",
                tok_path, tok_size - off, (unsigned long long)V);
        goto out;
    }

    /* metadata */
    cv.w = gguf_writer_new();
    cv.f16 = f16;
    cv.halves = calloc(16 * L + 16, sizeof(uint16_t *));
    if (!cv.w || !cv.halves) {
        fprintf(stderr, "tidepool-convert: out of memory\n");
        goto out;
    }
    gguf_writer_t *w = cv.w;
    int err = 0;
    err |= gguf_writer_add_str(w, "general.architecture", "llama");
    err |= gguf_writer_add_str(w, "general.name", name ? name : "llama2c");
    err |= gguf_writer_add_u32(w, "general.alignment", GGUF_DEFAULT_ALIGNMENT);
    err |= gguf_writer_add_u32(w, "general.file_type", f16 ? 1 : 0);
    err |= gguf_writer_add_u32(w, "llama.context_length", (uint32_t)c.seq_len);
    err |= gguf_writer_add_u32(w, "llama.embedding_length", (uint32_t)dim);
    err |= gguf_writer_add_u32(w, "llama.block_count", (uint32_t)L);
    err |= gguf_writer_add_u32(w, "llama.feed_forward_length", (uint32_t)hid);
    err |= gguf_writer_add_u32(w, "llama.attention.head_count", (uint32_t)c.n_heads);
    err |= gguf_writer_add_u32(w, "llama.attention.head_count_kv", (uint32_t)c.n_kv_heads);
    err |= gguf_writer_add_u32(w, "llama.rope.dimension_count", (uint32_t)hs);
    err |= gguf_writer_add_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    err |= gguf_writer_add_f32(w, "llama.rope.freq_base", 10000.0f);
    err |= gguf_writer_add_str(w, "tidepool.rope.pairing", "adjacent");
    err |= gguf_writer_add_str(w, "tokenizer.ggml.model", "llama");
    err |= gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", pieces, piece_lens, V);
    err |= gguf_writer_add_arr_f32(w, "tokenizer.ggml.scores", scores, V);
    err |= gguf_writer_add_arr_i32(w, "tokenizer.ggml.token_type", types, V);
    err |= gguf_writer_add_u32(w, "tokenizer.ggml.bos_token_id", 1);
    err |= gguf_writer_add_u32(w, "tokenizer.ggml.eos_token_id", 2);
    err |= gguf_writer_add_u32(w, "tokenizer.ggml.unknown_token_id", 0);

    /* weights, in run.c order */
    const float *p = (const float *)(ck + sizeof(c));
    const float *emb = p;
    p += V * dim;
    const float *rms_att = p;
    p += L * dim;
    const float *wq = p;
    p += L * dim * dim;
    const float *wk = p;
    p += L * kv_dim * dim;
    const float *wv = p;
    p += L * kv_dim * dim;
    const float *wo = p;
    p += L * dim * dim;
    const float *rms_ffn = p;
    p += L * dim;
    const float *w1 = p;
    p += L * hid * dim;
    const float *w2 = p;
    p += L * dim * hid;
    const float *w3 = p;
    p += L * hid * dim;
    const float *rms_final = p;
    p += dim;
    p += (uint64_t)c.seq_len * hs; /* freq_cis_real + freq_cis_imag (seq_len, hs/2) each */
    const float *wcls = shared ? NULL : p;

    err |= add_mat(&cv, "token_embd.weight", emb, V, dim);
    for (uint64_t l = 0; l < L; l++) {
        char nm[96];
#define NM(s) (snprintf(nm, sizeof(nm), "blk.%llu." s ".weight", (unsigned long long)l), nm)
        err |= add_vec(&cv, NM("attn_norm"), rms_att + l * dim, dim);
        err |= add_mat(&cv, NM("attn_q"), wq + l * dim * dim, dim, dim);
        err |= add_mat(&cv, NM("attn_k"), wk + l * kv_dim * dim, kv_dim, dim);
        err |= add_mat(&cv, NM("attn_v"), wv + l * kv_dim * dim, kv_dim, dim);
        err |= add_mat(&cv, NM("attn_output"), wo + l * dim * dim, dim, dim);
        err |= add_vec(&cv, NM("ffn_norm"), rms_ffn + l * dim, dim);
        err |= add_mat(&cv, NM("ffn_gate"), w1 + l * hid * dim, hid, dim);
        err |= add_mat(&cv, NM("ffn_down"), w2 + l * dim * hid, dim, hid);
        err |= add_mat(&cv, NM("ffn_up"), w3 + l * hid * dim, hid, dim);
#undef NM
    }
    err |= add_vec(&cv, "output_norm.weight", rms_final, dim);
    if (wcls)
        err |= add_mat(&cv, "output.weight", wcls, V, dim);
    if (err) {
        fprintf(stderr, "tidepool-convert: out of memory building %s\n", out_path);
        goto out;
    }
    char errbuf[512];
    if (gguf_writer_write(w, out_path, errbuf, sizeof(errbuf)) != 0) {
        fprintf(stderr, "tidepool-convert: %s\n", errbuf);
        goto out;
    }
    fprintf(stderr,
            "tidepool-convert: wrote %s: dim %d hidden %d layers %d heads %d/%d vocab %llu "
            "ctx %d %s classifier, %s\n",
            out_path, c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads,
            (unsigned long long)V, c.seq_len, shared ? "shared" : "separate", f16 ? "F16" : "F32");
    rc = 0;
out:
    for (int i = 0; i < cv.n_halves; i++)
        free(cv.halves[i]);
    free(cv.halves);
    gguf_writer_destroy(&cv.w);
    free(pieces);
    free(piece_lens);
    free(scores);
    free(types);
    free(ck);
    free(tk);
    return rc;
}
