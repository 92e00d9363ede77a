/*
 * wire: protocol messages (common/protocol.h) over ZeroMQ sockets. A message is one
 * multipart message: [identity (ROUTER side only)] [msgpack header] [payload frames...];
 * payload frames (KV blocks) go without copies. The codec in common/ knows nothing of
 * sockets; this module is the one place that frames, sends and receives messages, and the
 * one place that drops a malformed message with a log line (the decoder checks every
 * field, see proto_decode).
 *
 * Used by the gateway (ctl ROUTER), the worker runtime (ctl DEALER) and kvtransfer (kv
 * ROUTER/DEALERs). Not thread-safe beyond ZeroMQ's rule: one socket, one thread.
 */
#ifndef TP_WIRE_H
#define TP_WIRE_H

#include <stddef.h>
#include <zmq.h>

#include "protocol.h"

/* Send m as one multipart message on sock: [identity] header [payload frames].
 * identity may be NULL (DEALER/PUB). payload frames are consumed (zmq_msg_send semantics;
 * on failure they are closed). flags: 0 or ZMQ_DONTWAIT.
 * Returns 0, or -1 with errno (EAGAIN when the HWM is reached under ZMQ_DONTWAIT). */
int wire_send(void *sock, const void *identity, size_t identity_len, const proto_msg *m,
              zmq_msg_t *frames, int n_frames, int flags);

/* A received message: decoded header, identity (ROUTER sockets) and payload frames. */
typedef struct wire_envelope wire_envelope;
/* An envelope able to hold PROTO_MAX_FRAMES payload frames. NULL on out of memory. */
wire_envelope *wire_envelope_new(void);
/* Free e and whatever it holds. Takes NULL; sets *e to NULL. */
void wire_envelope_destroy(wire_envelope **e);
/* Release the frames and header of the last received message (done by the next recv). */
void wire_envelope_reset(wire_envelope *e);
/* The decoded header of the last message (borrowed; its tokens may be taken, see
 * proto_msg). */
proto_msg *wire_envelope_msg(wire_envelope *e);
/* The peer identity of the last message on a ROUTER socket (borrowed; *len bytes, 0 on
 * other sockets). */
const unsigned char *wire_envelope_identity(const wire_envelope *e, size_t *len);
/* Payload frames of the last message. */
int wire_envelope_n_frames(const wire_envelope *e);
/* Payload frame i (borrowed; valid until the next recv/reset). */
zmq_msg_t *wire_envelope_frame(wire_envelope *e, int i);

/* Receive one whole multipart message into e (previous contents released).
 * router: 1 if sock is a ROUTER (first frame is the peer identity). flags: 0 or
 * ZMQ_DONTWAIT. Returns 1 for a valid message, 0 when nothing is pending (EAGAIN),
 * -1 when a message was received but malformed (it is logged with the reason and fully
 * consumed; the caller just continues; the envelope's identity, and in its message only
 * the type and rid the header named if proto_peek found them, say what was lost), -2 on
 * socket error (errno set; ETERM on shutdown). */
int wire_recv(void *sock, int router, wire_envelope *e, int flags);

#endif
