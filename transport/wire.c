/* wire: see wire.h. */
#include "wire.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

int wire_send(void *sock, const void *identity, size_t identity_len, const proto_msg *m,
              zmq_msg_t *frames, int n_frames, int flags)
{
    char stack[1024];
    const void *hdr;
    size_t hlen;
    void *heap;
    int i = 0;
    if (proto_encode_buf(m, stack, sizeof(stack), &hdr, &hlen, &heap) < 0) {
        errno = EINVAL;
        goto fail;
    }
    if (identity && zmq_send(sock, identity, identity_len, flags | ZMQ_SNDMORE) < 0) {
        free(heap);
        goto fail;
    }
    /* After the first frame of a multipart message ZeroMQ delivers all or nothing, so
     * later frames never see EAGAIN from the HWM; the first frame keeps the caller's
     * ZMQ_DONTWAIT (it is the header when there is no identity frame). */
    int hflags = identity ? (flags & ~ZMQ_DONTWAIT) : flags;
    int rc = zmq_send(sock, hdr, hlen, hflags | (n_frames ? ZMQ_SNDMORE : 0));
    free(heap);
    if (rc < 0)
        goto fail;
    for (; i < n_frames; i++) {
        if (zmq_msg_send(&frames[i], sock, i + 1 < n_frames ? ZMQ_SNDMORE : 0) < 0)
            goto fail;
    }
    return 0;
fail : {
    int e = errno;
    for (; i < n_frames; i++)
        zmq_msg_close(&frames[i]);
    errno = e;
    return -1;
}
}

struct wire_envelope {
    unsigned char identity[256];
    size_t identity_len;
    proto_msg msg;
    int n_frames;
    zmq_msg_t frames[PROTO_MAX_FRAMES];
};

wire_envelope *wire_envelope_new(void)
{
    return calloc(1, sizeof(wire_envelope));
}

void wire_envelope_reset(wire_envelope *e)
{
    for (int i = 0; i < e->n_frames; i++)
        zmq_msg_close(&e->frames[i]);
    e->n_frames = 0;
    e->identity_len = 0;
    proto_msg_clear(&e->msg);
}

void wire_envelope_destroy(wire_envelope **pe)
{
    if (!pe || !*pe)
        return;
    wire_envelope_reset(*pe);
    free(*pe);
    *pe = NULL;
}

proto_msg *wire_envelope_msg(wire_envelope *e)
{
    return &e->msg;
}

const unsigned char *wire_envelope_identity(const wire_envelope *e, size_t *len)
{
    *len = e->identity_len;
    return e->identity;
}

int wire_envelope_n_frames(const wire_envelope *e)
{
    return e->n_frames;
}

zmq_msg_t *wire_envelope_frame(wire_envelope *e, int i)
{
    return (i >= 0 && i < e->n_frames) ? &e->frames[i] : NULL;
}

static int has_more(void *sock)
{
    int more = 0;
    size_t sz = sizeof(more);
    zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &sz);
    return more;
}

static void drain_rest(void *sock)
{
    while (has_more(sock)) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        zmq_msg_recv(&part, sock, 0);
        zmq_msg_close(&part);
    }
}

int wire_recv(void *sock, int router, wire_envelope *e, int flags)
{
    wire_envelope_reset(e);
    zmq_msg_t part;
    zmq_msg_init(&part);
    if (zmq_msg_recv(&part, sock, flags) < 0) {
        zmq_msg_close(&part);
        return errno == EAGAIN ? 0 : -2;
    }
    if (router) {
        size_t n = zmq_msg_size(&part);
        if (n > sizeof(e->identity) || !has_more(sock)) {
            zmq_msg_close(&part);
            drain_rest(sock);
            log_warn("dropped message: bad identity frame");
            return -1;
        }
        memcpy(e->identity, zmq_msg_data(&part), n);
        e->identity_len = n;
        zmq_msg_close(&part);
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, sock, 0) < 0) { /* rest of a multipart is already here */
            zmq_msg_close(&part);
            return -2;
        }
    }
    char err[160];
    int more = has_more(sock);
    int rc = proto_decode(zmq_msg_data(&part), zmq_msg_size(&part), &e->msg, err, sizeof(err));
    if (rc < 0) {
        /* what the header names, for the caller to act on a lost message (before part
         * is closed: it holds the bytes) */
        proto_peek(zmq_msg_data(&part), zmq_msg_size(&part), &e->msg.type, &e->msg.rid);
        zmq_msg_close(&part);
        drain_rest(sock);
        log_warn("dropped malformed message: %s", err);
        return -1;
    }
    zmq_msg_close(&part);
    while (more) {
        if (e->n_frames == PROTO_MAX_FRAMES) {
            drain_rest(sock);
            log_warn("dropped %s rid=%llu: more than %d payload frames",
                     proto_type_str(e->msg.type), (unsigned long long)e->msg.rid, PROTO_MAX_FRAMES);
            wire_envelope_reset(e);
            return -1;
        }
        zmq_msg_t *f = &e->frames[e->n_frames];
        zmq_msg_init(f);
        if (zmq_msg_recv(f, sock, 0) < 0) {
            zmq_msg_close(f);
            wire_envelope_reset(e);
            return -2;
        }
        e->n_frames++;
        more = has_more(sock);
    }
    return 1;
}
