/*
 * kvtransfer: see kvtransfer.h and docs/kvtransfer.md. The sender is in kvx_sender.c, the
 * receiver in kvx_receiver.c; this file holds what both use (event queue, non-blocking
 * send, lease arithmetic).
 */
#include "kvtransfer.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

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
    return wire_send(sock, id, id_len, m, frames, n_frames, ZMQ_DONTWAIT);
}

// --- padding

uint64_t kvx_pad_bytes(uint64_t pad, int n_layer, int n_blocks, int layer, int blk0, int n)
{
    if (n_layer < 1 || n_blocks < 1 || n < 1)
        return 0;
    uint64_t n_all = (uint64_t)n_layer * (uint64_t)n_blocks;
    uint64_t i0 = (uint64_t)layer * (uint64_t)n_blocks + (uint64_t)blk0, i1 = i0 + (uint64_t)n;
    uint64_t base = pad / n_all, rem = pad % n_all;
    return base * (i1 - i0) + (i1 < rem ? i1 : rem) - (i0 < rem ? i0 : rem);
}

static pthread_once_t zeros_once = PTHREAD_ONCE_INIT;
static const void *zeros; /* KVX_ZEROS_BYTES of read-only zeros, or NULL; never unmapped */

static void zeros_map(void)
{
    /* read-only private anonymous memory: every page is the kernel's zero page, so it
     * needs no RAM and no commit charge; only page tables as senders read it */
    void *p = mmap(NULL, KVX_ZEROS_BYTES, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) {
        log_warn("kvx: cannot map %zu bytes of zeros for padding frames (%s); padding is "
                 "copied",
                 KVX_ZEROS_BYTES, strerror(errno));
        return;
    }
    zeros = p;
}

const void *kvx_zeros(size_t n)
{
    pthread_once(&zeros_once, zeros_map);
    return zeros && n <= KVX_ZEROS_BYTES ? zeros : NULL;
}

// --- time

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
