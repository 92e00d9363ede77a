/* stream: see stream.h. Three buffers: raw (bytes of an incomplete UTF-8 character, at most
 * 3), held (valid text that may still become part of a stop string) and out (released). */
#include "stream.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    char *p;
    size_t len, cap;
} sbuf_t;

struct stream {
    const tokenizer_t *tok;
    int prev;
    int eos;
    char *stops[8];
    size_t stop_len[8];
    int n_stops;
    unsigned char raw[8];
    size_t n_raw;
    sbuf_t held, out;
    int n_tokens;
    int min_tokens; /* stop strings count only when completed by a later token (vLLM's) */
    size_t held_old; /* held.len before the current token's bytes */
    int done;    /* finished (stop, EOS or stream_finish) */
    int stopped; /* finished by STREAM_STOP */
};

static int sbuf_add(sbuf_t *b, const void *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 128;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p)
            return -1;
        b->p = p;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
    return 0;
}

/* Drop the first n bytes of b. */
static void sbuf_shift(sbuf_t *b, size_t n)
{
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
    b->p[b->len] = 0;
}

stream_t *stream_new(const tokenizer_t *tok, int prev_token, int eos, const char *const *stops,
                     int n_stops)
{
    stream_t *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->tok = tok;
    s->prev = prev_token;
    s->eos = eos;
    for (int i = 0; i < n_stops && s->n_stops < 8; i++) {
        if (!stops[i] || !stops[i][0])
            continue;
        s->stops[s->n_stops] = strdup(stops[i]);
        if (!s->stops[s->n_stops])
            goto fail;
        s->stop_len[s->n_stops] = strlen(stops[i]);
        s->n_stops++;
    }
    if (sbuf_add(&s->held, "", 0) < 0 || sbuf_add(&s->out, "", 0) < 0)
        goto fail;
    return s;
fail:
    stream_destroy(&s);
    return NULL;
}

void stream_destroy(stream_t **ps)
{
    if (!ps || !*ps)
        return;
    stream_t *s = *ps;
    for (int i = 0; i < s->n_stops; i++)
        free(s->stops[i]);
    free(s->held.p);
    free(s->out.p);
    free(s);
    *ps = NULL;
}

/* Length of the UTF-8 sequence a lead byte starts: 1..4, or 0 for a byte that cannot
 * start one (continuation byte, 0xC0/0xC1, 0xF5..0xFF). */
static int utf8_seq_len(unsigned char c)
{
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF)
        return 2;
    if (c >= 0xE0 && c <= 0xEF)
        return 3;
    if (c >= 0xF0 && c <= 0xF4)
        return 4;
    return 0;
}

/* Whether byte k (1-based) of a sequence starting with lead may be b: continuation bytes,
 * with the tighter second-byte ranges that exclude overlongs, surrogates and > U+10FFFF. */
static int utf8_cont_ok(unsigned char lead, int k, unsigned char b)
{
    if ((b & 0xC0) != 0x80)
        return 0;
    if (k != 1)
        return 1;
    if (lead == 0xE0)
        return b >= 0xA0;
    if (lead == 0xED)
        return b <= 0x9F;
    if (lead == 0xF0)
        return b >= 0x90;
    if (lead == 0xF4)
        return b <= 0x8F;
    return 1;
}

static const char REPLACEMENT[] = "\xEF\xBF\xBD"; /* U+FFFD */

/* Move complete characters from raw bytes into held; with final = 1 an incomplete tail
 * becomes U+FFFD. */
static int feed_bytes(stream_t *s, const unsigned char *p, size_t n, int final)
{
    for (size_t i = 0; i < n || (final && s->n_raw);) {
        if (i < n) {
            unsigned char c = p[i];
            if (s->n_raw == 0) {
                int len = utf8_seq_len(c);
                i++;
                if (len == 1) {
                    if (sbuf_add(&s->held, &c, 1) < 0)
                        return -1;
                } else if (len == 0) {
                    if (sbuf_add(&s->held, REPLACEMENT, 3) < 0)
                        return -1;
                } else {
                    s->raw[s->n_raw++] = c;
                }
                continue;
            }
            int need = utf8_seq_len(s->raw[0]);
            if (utf8_cont_ok(s->raw[0], (int)s->n_raw, c)) {
                s->raw[s->n_raw++] = c;
                i++;
                if ((int)s->n_raw == need) {
                    if (sbuf_add(&s->held, s->raw, s->n_raw) < 0)
                        return -1;
                    s->n_raw = 0;
                }
                continue;
            }
            /* c cannot continue the sequence: the partial one is malformed; c is then
             * looked at again as a fresh lead byte. */
        }
        if (sbuf_add(&s->held, REPLACEMENT, 3) < 0)
            return -1;
        s->n_raw = 0;
    }
    return 0;
}

/* Search held for the earliest stop string; release what is certain. A stop string counts
 * only when it ends in the current token's text (one wholly in the text held back before
 * it was passed over, within the first min_tokens tokens) and after min_tokens tokens. */
static stream_status_t settle(stream_t *s, int final)
{
    size_t best = (size_t)-1;
    for (int k = 0; k < s->n_stops && s->n_tokens > s->min_tokens; k++) {
        size_t from = s->held_old + 1 > s->stop_len[k] ? s->held_old + 1 - s->stop_len[k] : 0;
        const char *m = memmem(s->held.p + from, s->held.len - from, s->stops[k], s->stop_len[k]);
        if (m && (size_t)(m - s->held.p) < best)
            best = (size_t)(m - s->held.p);
    }
    if (best != (size_t)-1) {
        if (sbuf_add(&s->out, s->held.p, best) < 0)
            return STREAM_ERR;
        s->held.len = 0;
        s->held.p[0] = 0;
        s->n_raw = 0;
        s->done = s->stopped = 1;
        return STREAM_STOP;
    }
    /* Hold back the longest tail of held that is a proper prefix of a stop string. It
     * starts on a character boundary: held is valid UTF-8 and so are the stops. */
    size_t keep = 0;
    if (!final) {
        for (int k = 0; k < s->n_stops; k++) {
            size_t max = s->stop_len[k] - 1;
            if (max > s->held.len)
                max = s->held.len;
            for (size_t t = max; t > keep; t--) {
                if (memcmp(s->held.p + s->held.len - t, s->stops[k], t) == 0) {
                    keep = t;
                    break;
                }
            }
        }
    }
    size_t release = s->held.len - keep;
    if (release) {
        if (sbuf_add(&s->out, s->held.p, release) < 0)
            return STREAM_ERR;
        sbuf_shift(&s->held, release);
    }
    return STREAM_CONTINUE;
}

stream_status_t stream_push(stream_t *s, int token)
{
    if (s->done)
        return s->stopped ? STREAM_STOP : STREAM_CONTINUE;
    if (s->eos >= 0 && token == s->eos) { /* ends the answer; not counted (as workers do) */
        s->prev = token;
        if (stream_finish(s) == STREAM_ERR)
            return STREAM_ERR;
        s->stopped = 1;
        return STREAM_STOP;
    }
    s->n_tokens++;
    size_t len = 0;
    const char *piece = tokenizer_piece(s->tok, s->prev, token, &len);
    s->prev = token;
    s->held_old = s->held.len;
    if (feed_bytes(s, (const unsigned char *)piece, len, 0) < 0)
        return STREAM_ERR;
    return settle(s, 0);
}

stream_status_t stream_finish(stream_t *s)
{
    if (s->done)
        return s->stopped ? STREAM_STOP : STREAM_CONTINUE;
    s->held_old = s->held.len;
    if (feed_bytes(s, NULL, 0, 1) < 0)
        return STREAM_ERR;
    stream_status_t st = settle(s, 1);
    s->done = 1;
    return st;
}

const char *stream_out(const stream_t *s, size_t *len)
{
    *len = s->out.len;
    return s->out.p;
}

void stream_out_clear(stream_t *s)
{
    s->out.len = 0;
    s->out.p[0] = 0;
}

char *stream_text_of(const tokenizer_t *tok, int prev_token, const int *ids, int n, size_t *len)
{
    stream_t *s = stream_new(tok, prev_token, -1, NULL, 0);
    if (!s)
        return NULL;
    int rc = 0;
    for (int i = 0; i < n && rc != STREAM_ERR; i++)
        rc = stream_push(s, ids[i]);
    if (rc != STREAM_ERR)
        rc = stream_finish(s);
    char *t = NULL;
    if (rc != STREAM_ERR && (t = s->out.p) != NULL) {
        *len = s->out.len;
        s->out.p = NULL; /* the caller's now */
    }
    stream_destroy(&s);
    return t;
}

void stream_set_min_tokens(stream_t *s, int min_tokens)
{
    s->min_tokens = min_tokens;
}

int stream_n_tokens(const stream_t *s)
{
    return s->n_tokens;
}

int stream_stopped(const stream_t *s)
{
    return s->stopped;
}
