/*
 * fuzz_wire: wire_recv (transport/wire.c), the multi-frame envelope parsing, on arbitrary
 * multipart messages sent over an inproc ZeroMQ PAIR (the parser sees a real socket; the
 * ROUTER identity frame is simulated by router = 1).
 *
 * Input: byte 0 = flags (bit 0: parse as a ROUTER socket; bit 1: append bytes 1-2 (LE)
 * more empty frames, to cross PROTO_MAX_FRAMES); then frames as [u16 LE length][bytes]
 * (the last one cut to what remains). Properties: wire_recv consumes the whole message
 * whatever it returns (nothing is left on the socket); a valid message has every frame
 * after the header as a payload frame; sending it back with wire_send and receiving it
 * again gives the same message and payloads.
 */
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "fuzz_common.h"
#include "protocol.h"
#include "wire.h"

static void *g_ctx, *g_a, *g_b; /* a sends to b */
static wire_envelope *g_env, *g_env2;

static void setup(void)
{
    fuzz_quiet();
    g_ctx = zmq_ctx_new();
    g_a = zmq_socket(g_ctx, ZMQ_PAIR);
    g_b = zmq_socket(g_ctx, ZMQ_PAIR);
    int zero = 0;
    FUZZ_CHECK(g_ctx && g_a && g_b);
    zmq_setsockopt(g_a, ZMQ_SNDHWM, &zero, sizeof(zero));
    zmq_setsockopt(g_b, ZMQ_RCVHWM, &zero, sizeof(zero));
    zmq_setsockopt(g_b, ZMQ_SNDHWM, &zero, sizeof(zero));
    zmq_setsockopt(g_a, ZMQ_RCVHWM, &zero, sizeof(zero));
    FUZZ_CHECK(zmq_bind(g_b, "inproc://fuzz-wire") == 0);
    FUZZ_CHECK(zmq_connect(g_a, "inproc://fuzz-wire") == 0);
    g_env = wire_envelope_new();
    g_env2 = wire_envelope_new();
    FUZZ_CHECK(g_env && g_env2);
}

static int nothing_pending(void *s)
{
    zmq_msg_t m;
    zmq_msg_init(&m);
    int rc = zmq_msg_recv(&m, s, ZMQ_DONTWAIT);
    zmq_msg_close(&m);
    return rc < 0 && zmq_errno() == EAGAIN;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int ready;
    if (!ready) {
        setup();
        ready = 1;
    }
    if (size < 1)
        return 0;
    int router = data[0] & 1;
    size_t extra = 0, pos = 1;
    if ((data[0] & 2) && size >= 3) {
        extra = (size_t)(data[1] | data[2] << 8) % (PROTO_MAX_FRAMES + 16);
        pos = 3;
    }
    /* count the frames first: the last one is sent without ZMQ_SNDMORE */
    size_t n_frames = 0;
    for (size_t p = pos; p < size;) {
        size_t n = p + 2 <= size ? (size_t)(data[p] | data[p + 1] << 8) : 0;
        p += 2;
        if (n > size - (p < size ? p : size))
            n = p < size ? size - p : 0;
        p += n;
        n_frames++;
    }
    size_t total = n_frames + extra, sent = 0;
    if (total == 0)
        return 0;
    for (size_t p = pos; p < size;) {
        size_t n = p + 2 <= size ? (size_t)(data[p] | data[p + 1] << 8) : 0;
        p += 2;
        if (n > size - (p < size ? p : size))
            n = p < size ? size - p : 0;
        sent++;
        FUZZ_CHECK(zmq_send(g_a, n ? (const void *)(data + p) : (const void *)"", n, sent < total ? ZMQ_SNDMORE : 0) >= 0);
        p += n;
    }
    for (size_t i = 0; i < extra; i++) {
        sent++;
        FUZZ_CHECK(zmq_send(g_a, "", 0, sent < total ? ZMQ_SNDMORE : 0) >= 0);
    }
    int rc = wire_recv(g_b, router, g_env, ZMQ_DONTWAIT);
    FUZZ_CHECK(rc == 1 || rc == -1);
    FUZZ_CHECK(nothing_pending(g_b));
    if (rc == 1) {
        size_t id_len;
        const unsigned char *id = wire_envelope_identity(g_env, &id_len);
        int nf = wire_envelope_n_frames(g_env);
        FUZZ_CHECK((size_t)nf == total - 1 - (size_t)router);
        FUZZ_CHECK(router || id_len == 0);
        /* back through wire_send: the same message arrives */
        zmq_msg_t frames[PROTO_MAX_FRAMES];
        for (int i = 0; i < nf; i++) {
            zmq_msg_init(&frames[i]);
            FUZZ_CHECK(zmq_msg_copy(&frames[i], wire_envelope_frame(g_env, i)) == 0);
        }
        FUZZ_CHECK(wire_send(g_b, router ? id : NULL, id_len, wire_envelope_msg(g_env), frames,
                             nf, 0) == 0);
        FUZZ_CHECK(wire_recv(g_a, router, g_env2, ZMQ_DONTWAIT) == 1);
        FUZZ_CHECK(nothing_pending(g_a));
        size_t id_len2;
        const unsigned char *id2 = wire_envelope_identity(g_env2, &id_len2);
        FUZZ_CHECK(id_len2 == id_len && memcmp(id, id2, id_len) == 0);
        FUZZ_CHECK(wire_envelope_n_frames(g_env2) == nf);
        for (int i = 0; i < nf; i++) {
            zmq_msg_t *f1 = wire_envelope_frame(g_env, i), *f2 = wire_envelope_frame(g_env2, i);
            FUZZ_CHECK(zmq_msg_size(f1) == zmq_msg_size(f2));
            FUZZ_CHECK(memcmp(zmq_msg_data(f1), zmq_msg_data(f2), zmq_msg_size(f1)) == 0);
        }
        proto_msg *a = wire_envelope_msg(g_env), *b = wire_envelope_msg(g_env2);
        FUZZ_CHECK(a->type == b->type && a->rid == b->rid && a->n_tokens == b->n_tokens);
        wire_envelope_reset(g_env2);
    }
    wire_envelope_reset(g_env);
    return 0;
}
