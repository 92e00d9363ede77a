/*
 * kvtransfer: see kvtransfer.h and docs/kvtransfer.md. The sender is in kvx_sender.c, the
 * receiver in kvx_receiver.c; this file holds what both use (event queue, non-blocking
 * send, lease arithmetic).
 */
#include "kvtransfer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvx_internal.h"
#include "log.h"

// --- events

int kvx_evq_push(kvx_evq *q, const kvx_event *ev)
{
    if (q->n == q->cap) {
        int cap = q->cap ? q->cap * 2 : 16;
        kvx_event *v = malloc((size_t)cap * sizeof(*v));
        if (!v) {
            log_rerror(ev->rid, "kvx: out of memory queueing an event; event lost");
            return -1;
        }
        for (int i = 0; i < q->n; i++)
            v[i] = q->v[(q->head + i) % q->cap];
        free(q->v);
        q->v = v;
        q->head = 0;
        q->cap = cap;
    }
    q->v[(q->head + q->n) % q->cap] = *ev;
    q->n++;
    return 0;
}

int kvx_evq_pop(kvx_evq *q, kvx_event *ev)
{
    if (q->n == 0)
        return 0;
    *ev = q->v[q->head];
    q->head = (q->head + 1) % q->cap;
    q->n--;
    return 1;
}

void kvx_ev_init(kvx_event *ev, kvx_event_type_t type, uint64_t rid, uint64_t xfer, int code,
                 const char *msg)
{
    memset(ev, 0, sizeof(*ev));
    ev->type = type;
    ev->rid = rid;
    ev->xfer = xfer;
    ev->code = code;
    ev->seq = -1;
    snprintf(ev->message, sizeof(ev->message), "%s", msg ? msg : "");
}

// --- sockets

int kvx_send_msg(void *sock, const void *id, size_t id_len, const proto_msg *m, zmq_msg_t *frames,
                 int n_frames)
{
    if (!id) {
        int ev = 0;
        size_t sz = sizeof(ev);
        if (zmq_getsockopt(sock, ZMQ_EVENTS, &ev, &sz) < 0 || !(ev & ZMQ_POLLOUT)) {
            for (int i = 0; i < n_frames; i++)
                zmq_msg_close(&frames[i]);
            errno = EAGAIN;
            return -1;
        }
    }
    return proto_send(sock, id, id_len, m, frames, n_frames, ZMQ_DONTWAIT);
}

int64_t kvx_deadline_after(int ms)
{
    return proto_now_us() + (int64_t)ms * 1000;
}

int kvx_ms_until(int64_t deadline_us, int64_t now_us)
{
    int64_t d = deadline_us - now_us;
    if (d <= 0)
        return 0;
    return (int)((d + 999) / 1000);
}
