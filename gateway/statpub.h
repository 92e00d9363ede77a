/*
 * statpub: the gateway's stats socket. A ZeroMQ PUB socket (bound by the gateway; dashboards
 * such as tidepool-top connect SUB sockets) that carries two-frame messages:
 *
 *   ["snapshot", msgpack map]  every interval: the cluster as the gateway sees it (gateway
 *                              figures, cluster totals, one entry per worker, recent events)
 *   ["event",    msgpack map]  as it happens: worker up/down, role or state change, request
 *                              retry or error
 *
 * The schema is versioned (key "schema", STATPUB_SCHEMA) and documented in docs/stats.md.
 * Publishing never slows serving: the socket has a small send high-water mark, every send
 * is ZMQ_DONTWAIT, and a PUB socket drops messages for a subscriber that is absent or
 * behind. The socket has its own ZeroMQ context and is never read, so it needs no watcher
 * in the event loop. Loop thread only.
 */
#ifndef TP_GW_STATPUB_H
#define TP_GW_STATPUB_H

#include <stddef.h>
#include <stdint.h>

#include "cluster.h"
#include "stats.h"

#define STATPUB_SCHEMA 1

struct event_base;
struct msgpack_sbuffer;

typedef struct statpub statpub_t;

typedef struct {
    const char *bind;       /* ZeroMQ endpoint to bind, e.g. tcp://127.0.0.1:5558 */
    int interval_ms;        /* snapshot period (>= 10) */
    int sndhwm;             /* messages queued per subscriber before drops (>= 1) */
    const char *model_name; /* the served model (copied) */
} statpub_params;

/* Defaults: tcp://127.0.0.1:5558, 1000 ms, sndhwm 100. */
statpub_params statpub_default_params(void);

/* Bind the PUB socket, start the snapshot timer on base and subscribe to stats' events
 * (stats_set_event_sink). stats and c are borrowed and must outlive the publisher.
 * Returns NULL with a message in err when the endpoint cannot be bound or on out of
 * memory. */
statpub_t *statpub_new(struct event_base *base, const statpub_params *p, stats_t *stats,
                       const cluster_t *c, char *err, size_t errlen);

/* Stop the timer, detach from stats, close the socket (linger 0) and free. Takes NULL;
 * NULLs *p. */
void statpub_destroy(statpub_t **p);

/* The endpoint actually bound (ZMQ_LAST_ENDPOINT), borrowed. */
const char *statpub_endpoint(const statpub_t *p);

/* Pack one snapshot (the body of a "snapshot" message) at now_us into sb (appended).
 * Returns 0, or -1 when packing failed (out of memory). */
int statpub_pack_snapshot(statpub_t *p, struct msgpack_sbuffer *sb, int64_t now_us);

/* Messages handed to ZeroMQ and messages that could not be (since start). */
void statpub_counts(const statpub_t *p, uint64_t *sent, uint64_t *dropped);

#endif
