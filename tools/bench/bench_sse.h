/*
 * bench_sse: an incremental parser for Server-Sent Events (text/event-stream), the framing
 * of OpenAI-style streamed responses.
 *
 * Bytes arrive in arbitrary pieces (bench_sse_feed); each complete event (a run of lines
 * ended by a blank line) is handed to a callback with its "event:" name and its "data:"
 * lines joined by '\n'. An event without a "data:" line is not dispatched. Comment lines
 * (":...") and other fields ("id:", "retry:") are ignored. Lines end with "\n" or "\r\n"
 * (a lone "\r" is not treated as a line end); one space after the field's colon is
 * dropped. Memory is bounded: an event whose pending bytes exceed max_bytes stops the
 * parser with an error, so a server that never sends a line end cannot make the client
 * grow without limit. Within that bound, how the bytes are split into pieces never changes
 * the events (near it, a line split across pieces counts against the bound sooner).
 * One parser per stream; not thread-safe.
 */
#ifndef TP_BENCH_SSE_H
#define TP_BENCH_SSE_H

#include <stddef.h>

typedef struct bench_sse bench_sse_t;

/* Called once per complete event. event is "" when the event had no "event:" line (else
 * its value, truncated to 31 bytes); data is NUL-terminated (n bytes, may contain '\n').
 * Both are borrowed for the call. Return 0 to continue, a positive value to stop
 * (bench_sse_feed / bench_sse_finish then return it). */
typedef int (*bench_sse_event_fn)(void *ctx, const char *event, const char *data, size_t n);

#define BENCH_SSE_ERR_TOO_LARGE (-1) /* an event's pending bytes exceeded max_bytes */
#define BENCH_SSE_ERR_NOMEM (-2)     /* out of memory */

/* A parser whose pending bytes (the unterminated line plus the current event's data) stay
 * within max_bytes. NULL on out of memory. */
bench_sse_t *bench_sse_new(size_t max_bytes);

/* Free; takes NULL and NULLs *p. */
void bench_sse_destroy(bench_sse_t **p);

/* Feed n bytes, calling fn(ctx, ...) for each event they complete. Returns 0, the first
 * non-zero return of fn, BENCH_SSE_ERR_TOO_LARGE or BENCH_SSE_ERR_NOMEM. After a non-zero
 * return the parser must not be fed again. */
int bench_sse_feed(bench_sse_t *p, const char *buf, size_t n, bench_sse_event_fn fn, void *ctx);

/* End of stream: a last line without its line end is processed, and a last event that
 * lacks its blank line is still dispatched (lenient; servers that close right after
 * "data: [DONE]\n" exist). Returns as bench_sse_feed. */
int bench_sse_finish(bench_sse_t *p, bench_sse_event_fn fn, void *ctx);

#endif
