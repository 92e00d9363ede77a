/*
 * bench/sse: an incremental parser for Server-Sent Events (text/event-stream), the framing
 * of OpenAI-style streamed responses. Part of tidepool-bench (included once by
 * tools/tidepool-bench.c; everything here is static).
 *
 * Bytes arrive in arbitrary pieces (sse_feed); each complete event (a run of lines ended
 * by a blank line) is handed to a callback with its "event:" name and its "data:" lines
 * joined by '\n'. Comment lines (":...") and other fields ("id:", "retry:") are ignored.
 * Lines end with "\n" or "\r\n" (a lone "\r" is not treated as a line end). Memory is
 * bounded: an event whose pending bytes exceed max_bytes stops the parser with an error,
 * so a server that never sends a line end cannot make the client grow without limit.
 */
#ifndef TP_BENCH_SSE_H
#define TP_BENCH_SSE_H

#include <stdlib.h>
#include <string.h>

/* Called once per complete event. event is "" when the event had no "event:" line; data
 * is NUL-terminated (n bytes, may contain '\n'). Return 0 to continue, non-zero to stop
 * (sse_feed then returns that value). */
typedef int (*sse_event_fn)(void *ctx, const char *event, const char *data, size_t n);

typedef struct {
    char *line;      /* the current, not yet terminated line */
    size_t n_line, cap_line;
    char *data;      /* "data:" payload of the current event, lines joined by '\n' */
    size_t n_data, cap_data;
    int has_data;    /* at least one "data:" line in the current event */
    char event[32];  /* "event:" name of the current event (truncated) */
    size_t max_bytes; /* bound on n_line + n_data */
} sse_parser;

#define SSE_ERR_TOO_LARGE (-1)
#define SSE_ERR_NOMEM (-2)

static void sse_init(sse_parser *p, size_t max_bytes)
{
    memset(p, 0, sizeof(*p));
    p->max_bytes = max_bytes;
}

static void sse_free(sse_parser *p)
{
    free(p->line);
    free(p->data);
    memset(p, 0, sizeof(*p));
}

/* Append n bytes to a growable buffer, keeping room for a NUL. 0 or SSE_ERR_NOMEM. */
static int sse_append(char **buf, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : 256;
        while (c < *len + n + 1)
            c *= 2;
        char *nb = realloc(*buf, c);
        if (!nb)
            return SSE_ERR_NOMEM;
        *buf = nb;
        *cap = c;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = 0;
    return 0;
}

/* Process one complete line (without its terminator). */
static int sse_line(sse_parser *p, const char *s, size_t n, sse_event_fn fn, void *ctx)
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
            return SSE_ERR_TOO_LARGE;
        if (p->has_data && sse_append(&p->data, &p->n_data, &p->cap_data, "\n", 1) < 0)
            return SSE_ERR_NOMEM;
        if (sse_append(&p->data, &p->n_data, &p->cap_data, val, val_len) < 0)
            return SSE_ERR_NOMEM;
        p->has_data = 1;
    } else if (name_len == 5 && memcmp(s, "event", 5) == 0) {
        size_t k = val_len < sizeof(p->event) - 1 ? val_len : sizeof(p->event) - 1;
        memcpy(p->event, val, k);
        p->event[k] = 0;
    }
    return 0;
}

/* Feed n bytes. Returns 0, the first non-zero callback return, SSE_ERR_TOO_LARGE or
 * SSE_ERR_NOMEM. After a non-zero return the parser must not be fed again. */
static int sse_feed(sse_parser *p, const char *buf, size_t n, sse_event_fn fn, void *ctx)
{
    while (n > 0) {
        const char *nl = memchr(buf, '\n', n);
        if (!nl) {
            if (p->n_line + n + p->n_data > p->max_bytes)
                return SSE_ERR_TOO_LARGE;
            return sse_append(&p->line, &p->n_line, &p->cap_line, buf, n);
        }
        size_t k = (size_t)(nl - buf);
        int rc;
        if (p->n_line == 0) {
            rc = sse_line(p, buf, k, fn, ctx);
        } else {
            if (p->n_line + k + p->n_data > p->max_bytes)
                return SSE_ERR_TOO_LARGE;
            if (sse_append(&p->line, &p->n_line, &p->cap_line, buf, k) < 0)
                return SSE_ERR_NOMEM;
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

/* End of stream: a last event that lacks its blank line is still dispatched (lenient;
 * servers that close right after "data: [DONE]\n" exist). Returns as sse_feed. */
static int sse_finish(sse_parser *p, sse_event_fn fn, void *ctx)
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

#endif
