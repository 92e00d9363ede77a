/*
 * kvx_internal: helpers shared by the two halves of kvtransfer (kvx_sender.c,
 * kvx_receiver.c; common pieces in kvtransfer.c). Not a public interface.
 */
#ifndef TP_KVX_INTERNAL_H
#define TP_KVX_INTERNAL_H

#include <stdint.h>

#include "kvtransfer.h"
#include "wire.h"

#define KVX_MAX_MSGS_PER_CALL 4096 /* messages handled per socket per process() call */
#define KVX_PIN_POLL_MS 5          /* how often to look at pins of finished transfers */

/* A FIFO of events (ring buffer, grows by doubling). */
typedef struct {
    kvx_event *v;
    int head, n, cap;
} kvx_evq;

/* Append a copy of *ev. Returns 0, or -1 on out of memory (logged; the event is lost). */
int kvx_evq_push(kvx_evq *q, const kvx_event *ev);
/* Pop the oldest event into *ev. Returns 1, or 0 when empty. */
int kvx_evq_pop(kvx_evq *q, kvx_event *ev);
/* Zero *ev and set its header fields (seq = -1; msg copied, truncated, may be NULL). */
void kvx_ev_init(kvx_event *ev, kvx_event_type_t type, uint64_t rid, uint64_t xfer, int code,
                 const char *msg);

/* wire_send() with ZMQ_DONTWAIT that never blocks: on a socket without an identity frame
 * (DEALER) it first checks ZMQ_POLLOUT, because wire_send() sends such a socket's first
 * frame without ZMQ_DONTWAIT. frames are consumed in every case. Returns 0, or -1 with
 * errno (EAGAIN: queue full or no peer; EHOSTUNREACH: unknown ROUTER peer). */
int kvx_send_msg(void *sock, const void *id, size_t id_len, const proto_msg *m, zmq_msg_t *frames,
                 int n_frames);

/* Padding (docs/kvtransfer.md "Padding"): the bytes of the padding frame of a KV_LAYER
 * carrying blocks [blk0, blk0 + n) of `layer` in a transfer of n_layer layers of n_blocks
 * blocks that declared pad bytes in total. The pad is spread over the n_layer * n_blocks
 * (layer, block) pairs in order i = layer * n_blocks + block: floor(pad / N) each, one more
 * for i < pad % N; a message carries the sum over its blocks, so the messages of a
 * transfer add up to pad exactly. 0 when n_layer or n_blocks is < 1. */
uint64_t kvx_pad_bytes(uint64_t pad, int n_layer, int n_blocks, int layer, int blk0, int n);

/* n bytes of zeros, read-only, that live as long as the process (one anonymous mapping of
 * KVX_ZEROS_BYTES, mapped on first use, thread-safe, backed by the kernel's zero page: it
 * costs no memory): the data of zero-copy padding frames (zmq_msg_init_data without a free
 * function). NULL when n is larger than the mapping or it could not be made (the caller
 * then copies). */
const void *kvx_zeros(size_t n);
#define KVX_ZEROS_BYTES ((size_t)1 << 30)

/* Monotonic time ms from now, in microseconds. */
int64_t kvx_deadline_after(int ms);
/* Milliseconds (rounded up, >= 0) from now_us until deadline_us. */
int kvx_ms_until(int64_t deadline_us, int64_t now_us);

#endif
