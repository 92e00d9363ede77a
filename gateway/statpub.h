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
 * Publishing never slows serving: every send is ZMQ_DONTWAIT. A subscriber that reads
 * slowly sees the current state, not an ever older backlog, and loses no event silently:
 * the socket (XPUB, ZMQ_XPUB_NODROP) queues at most sndhwm messages per subscriber and a
 * small kernel buffer (sndbuf), and refuses more (EAGAIN); then snapshots are conflated
 * (the newest is sent when there is room, each one skipped counted in
 * "snapshots_conflated", its seq skipped) and events wait in a queue of event_queue (the
 * oldest dropped when full, counted in "events_dropped", its seq skipped). The slowest
 * subscriber paces all of them, up to stall_ms: then what waits is sent past it (counted
 * in "stall_sends"; libzmq then leaves it out until it has room, and it sees its losses
 * as seq gaps). The socket has its own ZeroMQ context; its subscription
 * messages are read when publishing, so it needs no watcher in the event loop. Loop
 * thread only.
 */
#ifndef TP_GW_STATPUB_H
#define TP_GW_STATPUB_H

#include <stddef.h>
#include <stdint.h>

#include "cluster.h"
#include "curve.h"
#include "stats.h"

#define STATPUB_SCHEMA 1
#define STATPUB_SNDHWM 4          /* messages queued in ZeroMQ per subscriber */
#define STATPUB_SNDBUF 4096       /* bytes: the socket's kernel send buffer (SO_SNDBUF) */
#define STATPUB_EVENT_QUEUE 1024  /* events waiting for room before the oldest is dropped */
#define STATPUB_STALL_MS 2000     /* a subscriber this long full is sent past */

struct event_base;
struct msgpack_sbuffer;

typedef struct statpub statpub_t;

typedef struct {
    const char *bind;       /* ZeroMQ endpoint to bind, e.g. tcp://127.0.0.1:5558 */
    int interval_ms;        /* snapshot period (>= 10) */
    int sndhwm;             /* messages queued in ZeroMQ per subscriber (>= 1) */
    int sndbuf;             /* kernel send buffer, bytes (ZMQ_SNDBUF; 0 = the OS default) */
    int event_queue;        /* events kept while the socket is full (>= 1) */
    int stall_ms;           /* a message waiting this long for a full subscriber is sent
                             * past it (the others get it, it does not); 0 = never: the
                             * slowest subscriber paces all, and loses nothing unreported */
    const char *model_name; /* the served model (copied) */
    /* CURVE (optional, NULL = plain): the socket is a CURVE server with this key pair
     * (borrowed for the call; ZAP domain CURVE_ZAP_DOMAIN_STATS), admitting only the
     * subscribers whose public keys are in curve_auth, which statpub_new consumes (freed
     * also on failure); both or neither */
    const curve_keypair *curve;
    curve_authlist_t *curve_auth;
} statpub_params;

/* Defaults: tcp://127.0.0.1:5558, 1000 ms, STATPUB_SNDHWM, STATPUB_SNDBUF,
 * STATPUB_EVENT_QUEUE, STATPUB_STALL_MS. */
statpub_params statpub_default_params(void);

/* Bind the PUB socket (with p->curve: a CURVE server, its own ZAP handler admitting
 * p->curve_auth's keys), start the snapshot timer on base and subscribe to stats' events
 * (stats_set_event_sink). stats and c are borrowed and must outlive the publisher.
 * Returns NULL with a message in err when the endpoint cannot be bound, CURVE cannot be
 * set up (one of curve and curve_auth without the other, libzmq without CURVE) or on out
 * of memory. */
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

/* Messages handed to ZeroMQ, and messages that never will be (events dropped plus
 * snapshots conflated), since start. */
void statpub_counts(const statpub_t *p, uint64_t *sent, uint64_t *dropped);

#endif
