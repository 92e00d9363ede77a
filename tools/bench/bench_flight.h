/*
 * bench_flight: one tidepool-bench request in flight, from its send to its record.
 *
 * Each request has its own evhttp connection and streams (`"stream": true` with usage):
 * chunks are parsed as SSE as they arrive and timed on arrival (bench_now_ns), so TTFT and
 * ITL are what a client sees. Everything a request holds lives in its flight, which ends
 * in exactly one place: success, HTTP error, connection error, error event, malformed
 * stream, timeout (--timeout-s) or interrupt. Ending fills the request's record (bench.h:
 * times, status, token counts from usage or else chunks and prompt words, the ITL samples
 * moved to the run's pool, the error message and its group in the summary) and counts it;
 * the flight's connection, timers and parser are then freed from a deferred event, never
 * inside a libevent callback of its own connection. The first failure of a run is logged
 * at once (log_warn). Loop thread only.
 */
#ifndef TP_BENCH_FLIGHT_H
#define TP_BENCH_FLIGHT_H

#include <stddef.h>

#include "bench.h"

#define BENCH_FLIGHT_SSE_MAX_BYTES (1u << 20) /* one SSE event, bytes */
#define BENCH_FLIGHT_ERRBODY_MAX 2048         /* kept of a non-200 body, bytes */
#define BENCH_FLIGHT_ITL_MAX (1u << 20)       /* ITL samples kept per request */

/* Called from the loop after a flight has been freed (b->n_live already decremented): the
 * dispatcher sends what may go now, or ends the loop. */
typedef void (*bench_flight_freed_fn)(bench *b);

/* Send request idx of b now: POST b->path to b->host_addr:b->port (Host: b->host_header)
 * with the body bench_workload_body builds for it, on b->base, under a deadline of
 * b->a.timeout_s. Sets the record's start time and phase and counts the request as sent
 * and in flight (b->n_sent, b->in_flight, b->peak_in_flight). Nothing is returned: any
 * failure, now or later, ends the request with a failed record (out of memory here
 * without a flight at all, then nothing is freed later and on_freed is not called).
 * Otherwise the flight joins b->active and b->n_live until on_freed(b) is called. */
void bench_flight_start(bench *b, size_t idx, bench_flight_freed_fn on_freed);

/* End every flight in b->active now as failed, BENCH_FAIL_INTERRUPTED, with the message
 * "interrupted (why)"; their teardown follows from the loop as usual. */
void bench_flight_interrupt_all(bench *b, const char *why);

#endif
