/*
 * hsmon: a handshake monitor. It logs why ZeroMQ handshakes on one socket failed (CURVE or
 * not, wrong key, key refused by the peer's ZAP handler), with the peer's address, at most
 * HSMON_LOG_BURST lines per HSMON_LOG_WINDOW_S seconds (the number not logged is logged
 * when the next window opens). docs/security.md "What happens".
 *
 * libzmq 4.3 reports a failed handshake on the socket monitor (zmq_socket_monitor) as
 * ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL / _AUTH / _NO_DETAIL, whose address is the socket's
 * own endpoint for a bound socket, not the peer's. The peer's address is therefore taken
 * with getpeername() on the fd of the ZMQ_EVENT_ACCEPTED (or _CONNECTED) event, and the
 * failure is logged at the ZMQ_EVENT_DISCONNECTED of that fd, which follows it.
 *
 * The monitor is a thread with the monitor's inproc PAIR socket and a PAIR that carries the
 * stop order, like the ZAP handler (transport/curve.c). Library code: logs through log.h;
 * returns errors as text.
 */
#ifndef TP_HSMON_H
#define TP_HSMON_H

#include <stddef.h>
#include <stdint.h>

#define HSMON_LOG_BURST 10    /* log lines at most ... */
#define HSMON_LOG_WINDOW_S 10 /* ... per this many seconds */

typedef struct hsmon hsmon_t;

/* Which side of the handshake the monitored socket is: the messages name the likely
 * causes from that side. */
typedef enum {
    HSMON_SERVER = 1, /* a bound socket (the gateway's ctl ROUTER): failures of its clients */
    HSMON_CLIENT = 2, /* a connecting socket (a worker's ctl DEALER) */
} hsmon_side_t;

/* Counters since the monitor started (thread-safe copies). */
typedef struct {
    uint64_t n_failed;   /* handshakes failed (any of the three events) */
    uint64_t n_unlogged; /* failures not logged (rate limit, or _AUTH on a server, which
                            the ZAP handler logs) */
} hsmon_stats;

/* Start monitoring sock (borrowed; a socket of zctx, used by the calling thread; call
 * hsmon_stop before closing it) for handshake failures. curve: whether sock is set up for
 * CURVE (the causes named depend on it). label names the socket in the log lines (e.g.
 * "ctl"). Returns the monitor (the caller's), or NULL with the reason in err. */
hsmon_t *hsmon_start(void *zctx, void *sock, hsmon_side_t side, int curve, const char *label,
                     char *err, size_t errlen);

/* Counters, copied into *out. */
void hsmon_get_stats(const hsmon_t *m, hsmon_stats *out);

/* The latest handshake failure, as the log line says it ("handshake with ENDPOINT failed:
 * the likely cause"), whether it was logged or not (rate limit, log level), copied into buf
 * (cap bytes, cut). For a program that shows it rather than logs it (tidepool-top).
 * Returns 1 when there was one, 0 (buf "") when none yet. Thread-safe. */
int hsmon_last_failure(hsmon_t *m, char *buf, size_t cap);

/* Stop monitoring (from the thread that owns sock), stop and join the thread, free the
 * monitor, NULL *m. Takes NULL. Call before zmq_ctx_term. */
void hsmon_stop(hsmon_t **m);

#endif
