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
 *
 * When no piece of the vocabulary has a space after its first byte (SentencePiece's
 * split_by_whitespace vocabularies, stories260K's among them), no merge can join a symbol
 * to a following one that starts with a space: the text falls into independent chunks,
 * each starting at such a symbol, whose merges are those the whole-text loop makes in
 * them (the loop's choice at any moment is the best pair of some chunk, and a chunk's
 * pairs change only by its own merges), so each chunk is merged alone and a chunk seen
 * before in the same text (a repeated word) is copied from a per-call cache. Same ids as
 * run.c's loop (tested against it, also by the tokenizer fuzzing harness); a 1 MiB prompt
 * no longer holds the gateway's event loop for seconds.
 */
#include "tokenizer.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

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
    int split_spaces;  /* no piece has ' ' after its first byte: merge chunk by chunk */
    int one_byte[256]; /* lookup() of each 1-byte string, for the per-codepoint pass */
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
    t->split_spaces = 1;
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
        if (o > 1 && memchr(ap + 1, ' ', o - 1))
            t->split_spaces = 0; /* a merge may join "x" and " y": one chunk */
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
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        t->one_byte[b] = lookup(t, &c, 1);
    }

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

/* The ids of text before any merge: [BOS], the dummy prefix " ", then one id per
 * codepoint (byte fallback for codepoints not in the vocabulary). toks has room for len + 2;
 * returns the count. */
static int initial_ids(const tokenizer_t *t, const char *text, size_t len, int add_bos,
                       int *toks)
{
    int k = 0;
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
        int id = cp_len == 1 ? t->one_byte[cp[0]] : lookup(t, (const char *)cp, cp_len);
        if (id >= 0)
            toks[k++] = id;
        else
            k = fallback(t, cp, cp_len, toks, k);
        cp_len = 0;
    }
    return k;
}

/* Scores at or below this never merge (nor NaN): the reference loop's starting best. */
#define MERGE_FLOOR -1e10f

/* The reference merge loop (llama2.c's run.c): repeatedly merge the adjacent pair whose
 * merged piece scores highest, the leftmost on a tie. O(k^2). toks (k ids) is rewritten in
 * place; returns the new count, or -1 when out of memory. */
static int merge_naive(const tokenizer_t *t, int *toks, int k, char *buf)
{
    int *cand = malloc(((size_t)k + 1) * sizeof(int)); /* cand[i]: merge of toks[i], [i+1] */
    if (!cand)
        return -1;
    for (int i = 0; i + 1 < k; i++)
        cand[i] = pair_lookup(t, toks[i], toks[i + 1], buf);
    for (;;) {
        float best_score = MERGE_FLOOR;
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
    return k;
}

/* A candidate merge of the symbols at positions left and right (their ids then: ltok,
 * rtok) into id, of score score. */
typedef struct {
    float score;
    int left, right, ltok, rtok, id;
} merge_cand;

/* Heap order: the higher score first, the leftmost on a tie (the reference's choice). */
static int cand_before(const merge_cand *a, const merge_cand *b)
{
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static void heap_push(merge_cand *h, int *n, merge_cand c)
{
    int i = (*n)++;
    while (i > 0 && cand_before(&c, &h[(i - 1) / 2])) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = c;
}

static merge_cand heap_pop(merge_cand *h, int *n)
{
    merge_cand top = h[0], last = h[--*n];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= *n)
            break;
        if (c + 1 < *n && cand_before(&h[c + 1], &h[c]))
            c++;
        if (!cand_before(&h[c], &last))
            break;
        h[i] = h[c];
        i = c;
    }
    if (*n > 0)
        h[i] = last;
    return top;
}

/* Push the merge of the symbols at l and r, when there is one that may be chosen. */
static void push_pair(const tokenizer_t *t, merge_cand *h, int *n, const int *toks, int l,
                      int r, char *buf)
{
    int id = pair_lookup(t, toks[l], toks[r], buf);
    if (id >= 0 && t->score[id] > MERGE_FLOOR)
        heap_push(h, n, (merge_cand){t->score[id], l, r, toks[l], toks[r], id});
}

/* The same merges as merge_naive, in O(k log k): the symbols form a linked list over their
 * first positions and the candidates wait in a heap, each checked when it comes out (its
 * two symbols still adjacent with the ids it was made from: a symbol's piece only grows,
 * so an id never comes back). Positions keep the text's order, so "leftmost" is the
 * smallest left position, as in the reference. Returns the new count, or -1 when out of
 * memory. */
static int merge_heap(const tokenizer_t *t, int *toks, int k, char *buf)
{
    if (k < 2)
        return k;
    int *next = malloc((size_t)k * sizeof(int)), *prev = malloc((size_t)k * sizeof(int));
    /* k - 1 pairs at first, then at most 2 new ones per merge (k - 1 merges) */
    merge_cand *h = malloc(3 * (size_t)k * sizeof(merge_cand));
    if (!next || !prev || !h) {
        free(next);
        free(prev);
        free(h);
        return -1;
    }
    int n = 0;
    for (int i = 0; i < k; i++) {
        next[i] = i + 1 < k ? i + 1 : -1;
        prev[i] = i - 1;
    }
    for (int i = 0; i + 1 < k; i++)
        push_pair(t, h, &n, toks, i, i + 1, buf);
    while (n > 0) {
        merge_cand c = heap_pop(h, &n);
        if (toks[c.left] != c.ltok || toks[c.right] != c.rtok || next[c.left] != c.right)
            continue; /* stale: one of its symbols merged since */
        toks[c.left] = c.id;
        toks[c.right] = -1; /* gone */
        next[c.left] = next[c.right];
        if (next[c.right] >= 0)
            prev[next[c.right]] = c.left;
        if (prev[c.left] >= 0)
            push_pair(t, h, &n, toks, prev[c.left], c.left, buf);
        if (next[c.left] >= 0)
            push_pair(t, h, &n, toks, c.left, next[c.left], buf);
    }
    int m = 0;
    for (int i = 0; i >= 0; i = next[i])
        toks[m++] = toks[i];
    free(next);
    free(prev);
    free(h);
    return m;
}

/* The chunks merge_chunks has merged in one text: open addressing over XXH3 of a chunk's
 * symbol ids before merging; each entry points at its key and its merged ids in one arena. */
typedef struct {
    uint64_t hash;
    int key, n_key, val, n_val; /* offsets into arena; n_key 0: empty slot */
} chunk_entry;

typedef struct {
    chunk_entry *slot;
    int cap, used; /* cap a power of two */
    int *arena;
    size_t arena_n, arena_cap;
} chunk_cache;

/* Chunks longer than this (in symbols) are merged without the cache. */
#define CHUNK_CACHE_MAX 64

static chunk_entry *cache_find(chunk_cache *c, uint64_t h, const int *key, int n)
{
    for (int i = (int)(h & (uint64_t)(c->cap - 1));; i = (i + 1) & (c->cap - 1)) {
        chunk_entry *e = &c->slot[i];
        if (e->n_key == 0 || (e->hash == h && e->n_key == n &&
                              memcmp(c->arena + e->key, key, (size_t)n * sizeof(int)) == 0))
            return e;
    }
}

/* Append n ids to the arena; its offset, or -1 when out of memory. */
static long cache_store(chunk_cache *c, const int *ids, int n)
{
    if (c->arena_n + (size_t)n > c->arena_cap) {
        size_t cap = c->arena_cap ? 2 * c->arena_cap : 4096;
        while (cap < c->arena_n + (size_t)n)
            cap *= 2;
        int *a = realloc(c->arena, cap * sizeof(int));
        if (!a)
            return -1;
        c->arena = a, c->arena_cap = cap;
    }
    memcpy(c->arena + c->arena_n, ids, (size_t)n * sizeof(int));
    c->arena_n += (size_t)n;
    return (long)(c->arena_n - (size_t)n);
}

/* Remember chunk key (n ids) merged into val (m ids); 0, or -1 when out of memory (the
 * cache then stays as it was: a miss next time, not a wrong answer). */
static int cache_put(chunk_cache *c, uint64_t h, const int *key, int n, const int *val, int m)
{
    if (2 * (c->used + 1) > c->cap) {
        int cap = c->cap ? 2 * c->cap : 1024;
        chunk_entry *ns = calloc((size_t)cap, sizeof(*ns)), *old = c->slot;
        if (!ns)
            return -1;
        int ocap = c->cap;
        c->slot = ns, c->cap = cap;
        for (int i = 0; i < ocap; i++)
            if (old[i].n_key)
                *cache_find(c, old[i].hash, c->arena + old[i].key, old[i].n_key) = old[i];
        free(old);
    }
    long k = cache_store(c, key, n), v = k < 0 ? -1 : cache_store(c, val, m);
    if (v < 0)
        return -1;
    *cache_find(c, h, key, n) = (chunk_entry){h, (int)k, n, (int)v, m};
    c->used++;
    return 0;
}

/* merge_heap's result, chunk by chunk when the vocabulary allows (the file's comment):
 * chunks start at each symbol whose piece starts with a space. Returns the new count, or
 * -1 when out of memory. */
static int merge_chunks(const tokenizer_t *t, int *toks, int k, char *buf)
{
    if (!t->split_spaces)
        return merge_heap(t, toks, k, buf);
    chunk_cache c = {0};
    int key[CHUNK_CACHE_MAX], out = 0, rc = 0;
    for (int s = 0; s < k;) {
        int e = s + 1;
        while (e < k && t->piece[toks[e]][0] != ' ')
            e++;
        int n = e - s, m;
        if (n > CHUNK_CACHE_MAX) {
            m = merge_heap(t, toks + s, n, buf);
        } else {
            uint64_t h = XXH3_64bits(toks + s, (size_t)n * sizeof(int));
            chunk_entry *hit = c.cap ? cache_find(&c, h, toks + s, n) : NULL;
            if (hit && hit->n_key) {
                m = hit->n_val;
                memcpy(toks + s, c.arena + hit->val, (size_t)m * sizeof(int));
            } else {
                memcpy(key, toks + s, (size_t)n * sizeof(int));
                m = merge_heap(t, toks + s, n, buf);
                if (m >= 0)
                    cache_put(&c, h, key, n, toks + s, m); /* a failure only costs a miss */
            }
        }
        if (m < 0) {
            rc = -1;
            break;
        }
        memmove(toks + out, toks + s, (size_t)m * sizeof(int));
        out += m;
        s = e;
    }
    free(c.slot);
    free(c.arena);
    return rc < 0 ? -1 : out;
}

/* tokenizer_encode with merge as the merge loop. */
static int encode_with(const tokenizer_t *t, const char *text, size_t len, int add_bos,
                       int *out, int cap, int *needed,
                       int (*merge)(const tokenizer_t *, int *, int, char *))
{
    /* at most: BOS + dummy prefix + one id per byte */
    int *toks = malloc((len + 2) * sizeof(int));
    char *buf = malloc(2 * t->max_len + 8);
    if (!toks || !buf) {
        free(toks);
        free(buf);
        return -1;
    }
    int k = initial_ids(t, text, len, add_bos, toks);
    /* merges run on the text's ids only: BOS is never merged into a piece, whatever
     * pieces the vocabulary has (one spelling "<s>" + text would otherwise swallow it) */
    int bos_n = add_bos ? 1 : 0;
    int m = merge(t, toks + bos_n, k - bos_n, buf);
    free(buf);
    if (m < 0) {
        free(toks);
        return -1;
    }
    k = m + bos_n;
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

int tokenizer_encode(const tokenizer_t *t, const char *text, size_t len, int add_bos, int *out,
                     int cap, int *needed)
{
    return encode_with(t, text, len, add_bos, out, cap, needed, merge_chunks);
}

int tokenizer_encode_ref(const tokenizer_t *t, const char *text, size_t len, int add_bos,
                         int *out, int cap, int *needed)
{
    return encode_with(t, text, len, add_bos, out, cap, needed, merge_naive);
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
