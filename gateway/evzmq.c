/* evzmq: see evzmq.h. One persistent read event on ZMQ_FD; the callback loop drains
 * ZMQ_POLLIN up to a cap, then re-activates the event by hand if input remains. */
#include "evzmq.h"

#include <errno.h>
#include <event2/event.h>
#include <stdlib.h>
#include <zmq.h>

struct evzmq {
    void *sock; /* borrowed */
    struct event *ev;
    int max_per_cb;
    evzmq_recv_cb cb;
    void *ud;
};

static int has_input(void *sock)
{
    int events = 0;
    size_t sz = sizeof(events);
    if (zmq_getsockopt(sock, ZMQ_EVENTS, &events, &sz) < 0)
        return 0;
    return (events & ZMQ_POLLIN) != 0;
}

static void on_fd(evutil_socket_t fd, short what, void *arg)
{
    evzmq_t *z = arg;
    (void)fd;
    (void)what;
    for (int n = 0; n < z->max_per_cb; n++) {
        if (!has_input(z->sock))
            return;
        z->cb(z->sock, z->ud);
    }
    /* Cap reached: let other events run, then come back. */
    if (has_input(z->sock))
        event_active(z->ev, EV_READ, 0);
}

evzmq_t *evzmq_new(struct event_base *base, void *sock, int max_per_cb, evzmq_recv_cb cb, void *ud)
{
    int fd;
    size_t sz = sizeof(fd);
    if (!base || !sock || !cb || max_per_cb < 1) {
        errno = EINVAL;
        return NULL;
    }
    if (zmq_getsockopt(sock, ZMQ_FD, &fd, &sz) < 0)
        return NULL;
    evzmq_t *z = calloc(1, sizeof(*z));
    if (!z)
        return NULL;
    z->sock = sock;
    z->max_per_cb = max_per_cb;
    z->cb = cb;
    z->ud = ud;
    z->ev = event_new(base, fd, EV_READ | EV_PERSIST, on_fd, z);
    if (!z->ev || event_add(z->ev, NULL) < 0)
        goto fail;
    /* Messages may already be queued (the fd edge happened before we watched it). */
    event_active(z->ev, EV_READ, 0);
    return z;
fail:
    if (z->ev)
        event_free(z->ev);
    free(z);
    errno = ENOMEM;
    return NULL;
}

void evzmq_destroy(evzmq_t **pz)
{
    if (!pz || !*pz)
        return;
    event_free((*pz)->ev);
    free(*pz);
    *pz = NULL;
}

void evzmq_after_send(evzmq_t *z)
{
    if (z && has_input(z->sock))
        event_active(z->ev, EV_READ, 0);
}
