/*
 * tokenizer: see tokenizer.h.
 *
 * The pieces are copied out of the GGUF file into one arena at load (U+2581 "▁" is turned
 * back into a plain space, so files written by llama.cpp's converter work too), with a
 * vocabulary sorted by bytes for bsearch lookup. encode() follows run.c exactly: optional
 * BOS, a dummy-prefix " " when the text is non-empty, one lookup per UTF-8 codepoint
 * (falling back to the <0xXX> byte tokens, or to <unk> when the vocabulary has none),
 * then repeatedly merge the adjacent pair whose concatenation is in the vocabulary with the
 * highest score (leftmost on ties). Instead of re-looking-up every pair after each merge
 * as run.c does, the merge candidate of each adjacent pair is cached and only the two
 * pairs touching a merge are recomputed: same choices, O(n) per merge instead of O(n)
 * lookups.
 */
#include "tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"

enum {
    TOKTYPE_NORMAL = 1,
    TOKTYPE_UNKNOWN = 2,
    TOKTYPE_CONTROL = 3,
    TOKTYPE_USER = 4,
    TOKTYPE_UNUSED = 5,
    TOKTYPE_BYTE = 6,
};

struct tokenizer {
    int n_vocab;
    char **piece;      /* (n_vocab,) NUL-terminated, into arena */
    size_t *piece_len; /* (n_vocab,) */
    float *score;      /* (n_vocab,) */
    int *type;         /* (n_vocab,) TOKTYPE_* */
    int *byte_val;     /* (n_vocab,) the byte of a byte token, else -1 */
    int *sorted;       /* (n_vocab,) ids sorted by (bytes, id) */
    int byte_id[256];  /* id of the <0xXX> token of each byte, or -1 */
    size_t max_len;    /* longest piece in bytes */
    int bos, eos, unk;
    char *arena;
    unsigned char bytes[256]; /* bytes[b] == b: storage for byte-token pieces */
};

static void set_err(char *err, size_t errlen, const char *path, const char *msg)
{
    if (err && errlen)
        snprintf(err, errlen, "%s: %s", path, msg);
}

/* "<0xXX>" with two hex digits: returns the byte, else -1. */
static int parse_byte_piece(const char *s, size_t n)
{
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>')
        return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d;
        if (c >= '0' && c <= '9')
            d = c - '0';
        else if (c >= 'A' && c <= 'F')
            d = c - 'A' + 10;
        else if (c >= 'a' && c <= 'f')
            d = c - 'a' + 10;
        else
            return -1;
        v = v * 16 + d;
    }
    return v;
}

static int cmp_bytes(const char *a, size_t na, const char *b, size_t nb)
{
    size_t n = na < nb ? na : nb;
    int c = memcmp(a, b, n);
    if (c != 0)
        return c;
    return na < nb ? -1 : na > nb ? 1 : 0;
}

static int cmp_ids(const void *a, const void *b, void *ctx)
{
    const tokenizer_t *sort_ctx = ctx;
    int ia = *(const int *)a, ib = *(const int *)b;
    int c = cmp_bytes(sort_ctx->piece[ia], sort_ctx->piece_len[ia], sort_ctx->piece[ib],
                      sort_ctx->piece_len[ib]);
    return c != 0 ? c : (ia > ib) - (ia < ib);
}

/* Lowest id whose piece equals s[0..n), or -1. */
static int lookup(const tokenizer_t *t, const char *s, size_t n)
{
    int lo = 0, hi = t->n_vocab; /* first index with piece >= s */
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        int id = t->sorted[mid];
        if (cmp_bytes(t->piece[id], t->piece_len[id], s, n) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < t->n_vocab) {
        int id = t->sorted[lo];
        if (cmp_bytes(t->piece[id], t->piece_len[id], s, n) == 0)
            return id;
    }
    return -1;
}

tokenizer_t *tokenizer_load(const char *path, char *err, size_t errlen)
{
    char gerr[512];
    gguf_t *g = gguf_open(path, gerr, sizeof(gerr));
    if (!g) {
        if (err && errlen)
            snprintf(err, errlen, "%s", gerr);
        return NULL;
    }
    tokenizer_t *t = tokenizer_load_gguf(g, err, errlen);
    gguf_close(&g);
    return t;
}

tokenizer_t *tokenizer_load_gguf(const gguf_t *g, char *err, size_t errlen)
{
    const char *path = gguf_path(g);
    tokenizer_t *t = NULL;
    const char **ptrs = NULL;
    size_t *lens = NULL;
    int32_t *types = NULL;
    const char *model;
    size_t model_len;
    if (gguf_get_str(g, "tokenizer.ggml.model", &model, &model_len) == 0 &&
        cmp_bytes(model, model_len, "llama", 5) != 0) {
        set_err(err, errlen, path, "tokenizer.ggml.model is not \"llama\" (unsupported)");
        goto fail;
    }
    gguf_type et;
    uint64_t n;
    if (gguf_get_arr_info(g, "tokenizer.ggml.tokens", &et, &n) != 0 || et != GGUF_TYPE_STRING) {
        set_err(err, errlen, path, "missing tokenizer.ggml.tokens (array of strings)");
        goto fail;
    }
    if (n < 3 || n > (1u << 24)) {
        set_err(err, errlen, path, "tokenizer.ggml.tokens has a bad length");
        goto fail;
    }
    t = calloc(1, sizeof(*t));
    ptrs = malloc(n * sizeof(*ptrs));
    lens = malloc(n * sizeof(*lens));
    if (!t || !ptrs || !lens)
        goto oom;
    t->n_vocab = (int)n;
    t->piece = calloc(n, sizeof(char *));
    t->piece_len = calloc(n, sizeof(size_t));
    t->score = calloc(n, sizeof(float));
    t->type = calloc(n, sizeof(int));
    t->byte_val = calloc(n, sizeof(int));
    t->sorted = calloc(n, sizeof(int));
    if (!t->piece || !t->piece_len || !t->score || !t->type || !t->byte_val || !t->sorted)
        goto oom;
    gguf_get_arr_str(g, "tokenizer.ggml.tokens", ptrs, lens, n);
    size_t total = 0;
    for (uint64_t i = 0; i < n; i++)
        total += lens[i] + 1;
    t->arena = malloc(total ? total : 1);
    if (!t->arena)
        goto oom;

    /* pieces, with U+2581 (e2 96 81) -> ' ' */
    char *ap = t->arena;
    for (uint64_t i = 0; i < n; i++) {
        size_t o = 0;
        for (size_t j = 0; j < lens[i]; j++) {
            if (j + 2 < lens[i] && (unsigned char)ptrs[i][j] == 0xe2 &&
                (unsigned char)ptrs[i][j + 1] == 0x96 && (unsigned char)ptrs[i][j + 2] == 0x81) {
                ap[o++] = ' ';
                j += 2;
            } else {
                ap[o++] = ptrs[i][j];
            }
        }
        ap[o] = '\0';
        t->piece[i] = ap;
        t->piece_len[i] = o;
        if (o > t->max_len)
            t->max_len = o;
        ap += o + 1;
    }

    if (gguf_get_arr_info(g, "tokenizer.ggml.scores", NULL, NULL) == 0 &&
        gguf_get_arr_f32(g, "tokenizer.ggml.scores", t->score, n) != 0) {
        set_err(err, errlen, path, "tokenizer.ggml.scores is not an f32 array of vocab size");
        goto fail;
    }
    int32_t v;
    t->bos = gguf_get_i32(g, "tokenizer.ggml.bos_token_id", &v) == 0 ? v : 1;
    t->eos = gguf_get_i32(g, "tokenizer.ggml.eos_token_id", &v) == 0 ? v : 2;
    t->unk = gguf_get_i32(g, "tokenizer.ggml.unknown_token_id", &v) == 0 ? v : 0;
    if (t->bos < 0 || t->bos >= (int)n || t->eos < 0 || t->eos >= (int)n || t->unk < 0 ||
        t->unk >= (int)n) {
        set_err(err, errlen, path, "BOS/EOS/unknown token id out of the vocabulary");
        goto fail;
    }
    int have_types = gguf_get_arr_info(g, "tokenizer.ggml.token_type", NULL, NULL) == 0;
    if (have_types) {
        types = malloc(n * sizeof(int32_t));
        if (!types)
            goto oom;
        if (gguf_get_arr_i32(g, "tokenizer.ggml.token_type", types, n) != 0) {
            set_err(err, errlen, path,
                    "tokenizer.ggml.token_type is not an int array of "
                    "vocab size");
            goto fail;
        }
    }
    for (int i = 0; i < 256; i++) {
        t->byte_id[i] = -1;
        t->bytes[i] = (unsigned char)i;
    }
    for (int i = 0; i < (int)n; i++) {
        int ty = have_types ? types[i] : TOKTYPE_NORMAL;
        int b = parse_byte_piece(t->piece[i], t->piece_len[i]);
        if (!have_types) {
            if (i == t->unk)
                ty = TOKTYPE_UNKNOWN;
            else if (i == t->bos || i == t->eos)
                ty = TOKTYPE_CONTROL;
            else if (b >= 0)
                ty = TOKTYPE_BYTE;
        }
        if (b >= 0 && (ty == TOKTYPE_BYTE || ty == TOKTYPE_NORMAL)) {
            ty = TOKTYPE_BYTE;
            if (t->byte_id[b] < 0)
                t->byte_id[b] = i;
        } else {
            b = -1;
        }
        t->type[i] = ty;
        t->byte_val[i] = b;
        t->sorted[i] = i;
    }
    qsort_r(t->sorted, n, sizeof(int), cmp_ids, t);

    free(types);
    free(ptrs);
    free(lens);
    return t;
oom:
    set_err(err, errlen, path, "out of memory loading the tokenizer");
fail:
    free(types);
    free(ptrs);
    free(lens);
    tokenizer_destroy(&t);
    return NULL;
}

void tokenizer_destroy(tokenizer_t **tp)
{
    if (!tp || !*tp)
        return;
    tokenizer_t *t = *tp;
    free(t->piece);
    free(t->piece_len);
    free(t->score);
    free(t->type);
    free(t->byte_val);
    free(t->sorted);
    free(t->arena);
    free(t);
    *tp = NULL;
}

int tokenizer_vocab_size(const tokenizer_t *t)
{
    return t->n_vocab;
}

int tokenizer_bos(const tokenizer_t *t)
{
    return t->bos;
}

int tokenizer_eos(const tokenizer_t *t)
{
    return t->eos;
}

/* Merge candidate of the pair (a, b): the id of piece(a)+piece(b), or -1. */
static int pair_lookup(const tokenizer_t *t, int a, int b, char *buf)
{
    size_t la = t->piece_len[a], lb = t->piece_len[b];
    if (la + lb > t->max_len)
        return -1;
    memcpy(buf, t->piece[a], la);
    memcpy(buf + la, t->piece[b], lb);
    return lookup(t, buf, la + lb);
}

/* Append the ids for one unknown codepoint (byte fallback). */
static int fallback(const tokenizer_t *t, const unsigned char *s, size_t n, int *toks, int k)
{
    int all_bytes = 1;
    for (size_t i = 0; i < n; i++)
        if (t->byte_id[s[i]] < 0)
            all_bytes = 0;
    if (!all_bytes) { /* no byte tokens (e.g. tok105): one <unk> per codepoint */
        toks[k++] = t->unk;
        return k;
    }
    for (size_t i = 0; i < n; i++)
        toks[k++] = t->byte_id[s[i]];
    return k;
}

int tokenizer_encode(const tokenizer_t *t, const char *text, size_t len, int add_bos, int *out,
                     int cap, int *needed)
{
    /* at most: BOS + dummy prefix + one id per byte */
    size_t max_toks = len + 2;
    int *toks = malloc(max_toks * sizeof(int));
    int *cand = malloc(max_toks * sizeof(int)); /* cand[i]: merge id of (toks[i], toks[i+1]) */
    char *buf = malloc(2 * t->max_len + 8);
    int k = 0;
    if (!toks || !cand || !buf) {
        free(toks);
        free(cand);
        free(buf);
        return -1;
    }
    if (add_bos)
        toks[k++] = t->bos;
    if (len > 0) {
        int sp = lookup(t, " ", 1);
        if (sp >= 0)
            toks[k++] = sp;
        else
            k = fallback(t, (const unsigned char *)" ", 1, toks, k);
    }
    const unsigned char *s = (const unsigned char *)text;
    unsigned char cp[8];
    size_t cp_len = 0;
    for (size_t i = 0; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            cp_len = 0;
        cp[cp_len++] = s[i];
        unsigned char next = i + 1 < len ? s[i + 1] : 0;
        if ((next & 0xC0) == 0x80 && cp_len < 4)
            continue;
        int id = lookup(t, (const char *)cp, cp_len);
        if (id >= 0)
            toks[k++] = id;
        else
            k = fallback(t, cp, cp_len, toks, k);
        cp_len = 0;
    }

    /* merges run on the text's ids only: BOS is never merged into a piece, whatever
     * pieces the vocabulary has (one spelling "<s>" + text would otherwise swallow it) */
    int bos_n = add_bos ? 1 : 0;
    toks += bos_n;
    k -= bos_n;
    for (int i = 0; i + 1 < k; i++)
        cand[i] = pair_lookup(t, toks[i], toks[i + 1], buf);
    for (;;) {
        float best_score = -1e10f;
        int best_idx = -1;
        for (int i = 0; i + 1 < k; i++) {
            if (cand[i] >= 0 && t->score[cand[i]] > best_score) {
                best_score = t->score[cand[i]];
                best_idx = i;
            }
        }
        if (best_idx < 0)
            break;
        toks[best_idx] = cand[best_idx];
        for (int i = best_idx + 1; i + 1 < k; i++)
            toks[i] = toks[i + 1];
        for (int i = best_idx + 1; i + 2 < k; i++)
            cand[i] = cand[i + 1];
        k--;
        if (best_idx > 0)
            cand[best_idx - 1] = pair_lookup(t, toks[best_idx - 1], toks[best_idx], buf);
        if (best_idx + 1 < k)
            cand[best_idx] = pair_lookup(t, toks[best_idx], toks[best_idx + 1], buf);
    }

    free(cand);
    free(buf);
    toks -= bos_n;
    k += bos_n;
    if (needed)
        *needed = k;
    if (k > cap) {
        free(toks);
        return -1;
    }
    memcpy(out, toks, (size_t)k * sizeof(int));
    free(toks);
    return k;
}

const char *tokenizer_piece(const tokenizer_t *t, int prev, int id, size_t *len)
{
    *len = 0;
    if (id < 0 || id >= t->n_vocab)
        return "";
    int ty = t->type[id];
    if (ty == TOKTYPE_CONTROL || ty == TOKTYPE_UNKNOWN || ty == TOKTYPE_UNUSED)
        return "";
    if (t->byte_val[id] >= 0) {
        *len = 1;
        return (const char *)&t->bytes[t->byte_val[id]];
    }
    const char *p = t->piece[id];
    size_t n = t->piece_len[id];
    if (prev == t->bos && n > 0 && p[0] == ' ') {
        p++;
        n--;
    }
    *len = n;
    return p;
}
