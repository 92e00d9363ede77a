/*
 * bench_sse: the Server-Sent Events parser (bench_sse.h). Complete lines are processed in
 * place from the caller's buffer; only a line split across pieces is copied (into line),
 * and the data of the event being built accumulates in data. Both buffers grow by
 * doubling and are bounded by max_bytes together.
 */
#include <stdlib.h>
#include <string.h>

#include "bench_sse.h"

struct bench_sse {
    char *line;      /* the current, not yet terminated line */
    size_t n_line, cap_line;
    char *data;      /* "data:" payload of the current event, lines joined by '\n' */
    size_t n_data, cap_data;
    int has_data;    /* at least one "data:" line in the current event */
    char event[32];  /* "event:" name of the current event (truncated) */
    size_t max_bytes; /* bound on n_line + n_data */
};

bench_sse_t *bench_sse_new(size_t max_bytes)
{
    bench_sse_t *p = calloc(1, sizeof(*p));
    if (p)
        p->max_bytes = max_bytes;
    return p;
}

void bench_sse_destroy(bench_sse_t **pp)
{
    if (!pp || !*pp)
        return;
    free((*pp)->line);
    free((*pp)->data);
    free(*pp);
    *pp = NULL;
}

/* Append n bytes to a growable buffer, keeping room for a NUL. 0 or BENCH_SSE_ERR_NOMEM. */
static int buf_append(char **buf, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : 256;
        while (c < *len + n + 1)
            c *= 2;
        char *nb = realloc(*buf, c);
        if (!nb)
            return BENCH_SSE_ERR_NOMEM;
        *buf = nb;
        *cap = c;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = 0;
    return 0;
}

/* Process one complete line (without its terminator). */
static int sse_line(bench_sse_t *p, const char *s, size_t n, bench_sse_event_fn fn, void *ctx)
{
    if (n > 0 && s[n - 1] == '\r')
        n--;
    if (n == 0) { /* blank line: dispatch */
        int rc = 0;
        if (p->has_data)
            rc = fn(ctx, p->event, p->data ? p->data : "", p->n_data);
        p->n_data = 0;
        if (p->data)
            p->data[0] = 0;
        p->has_data = 0;
        p->event[0] = 0;
        return rc;
    }
    if (s[0] == ':')
        return 0;
    const char *colon = memchr(s, ':', n);
    size_t name_len = colon ? (size_t)(colon - s) : n;
    const char *val = colon ? colon + 1 : s + n;
    size_t val_len = (size_t)(s + n - val);
    if (val_len > 0 && val[0] == ' ') {
        val++;
        val_len--;
    }
    if (name_len == 4 && memcmp(s, "data", 4) == 0) {
        if (p->n_data + val_len + 1 > p->max_bytes)
            return BENCH_SSE_ERR_TOO_LARGE;
        if (p->has_data && buf_append(&p->data, &p->n_data, &p->cap_data, "\n", 1) < 0)
            return BENCH_SSE_ERR_NOMEM;
        if (buf_append(&p->data, &p->n_data, &p->cap_data, val, val_len) < 0)
            return BENCH_SSE_ERR_NOMEM;
        p->has_data = 1;
    } else if (name_len == 5 && memcmp(s, "event", 5) == 0) {
        size_t k = val_len < sizeof(p->event) - 1 ? val_len : sizeof(p->event) - 1;
        memcpy(p->event, val, k);
        p->event[k] = 0;
    }
    return 0;
}

int bench_sse_feed(bench_sse_t *p, const char *buf, size_t n, bench_sse_event_fn fn, void *ctx)
{
    while (n > 0) {
        const char *nl = memchr(buf, '\n', n);
        if (!nl) {
            if (p->n_line + n + p->n_data > p->max_bytes)
                return BENCH_SSE_ERR_TOO_LARGE;
            return buf_append(&p->line, &p->n_line, &p->cap_line, buf, n);
        }
        size_t k = (size_t)(nl - buf);
        int rc;
        if (p->n_line == 0) {
            rc = sse_line(p, buf, k, fn, ctx);
        } else {
            if (p->n_line + k + p->n_data > p->max_bytes)
                return BENCH_SSE_ERR_TOO_LARGE;
            if (buf_append(&p->line, &p->n_line, &p->cap_line, buf, k) < 0)
                return BENCH_SSE_ERR_NOMEM;
            rc = sse_line(p, p->line, p->n_line, fn, ctx);
            p->n_line = 0;
        }
        if (rc != 0)
            return rc;
        buf += k + 1;
        n -= k + 1;
    }
    return 0;
}

int bench_sse_finish(bench_sse_t *p, bench_sse_event_fn fn, void *ctx)
{
    int rc = 0;
    if (p->n_line > 0) {
        rc = sse_line(p, p->line, p->n_line, fn, ctx);
        p->n_line = 0;
    }
    if (rc == 0 && p->has_data)
        rc = sse_line(p, "", 0, fn, ctx);
    return rc;
}
