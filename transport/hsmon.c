/* hsmon: see hsmon.h. The thread reads monitor events (two frames: 6 bytes of event
 * number (uint16) and value (uint32), then the endpoint), keeps the peer address of each
 * open fd in a small table, remembers the last handshake failure and logs it when the
 * connection's fd is disconnected. Sockets are created, bound and connected by the starting
 * thread, then used only by the monitor's thread (pthread_create is the memory barrier). */
#include "hsmon.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <zmq.h>

#include "log.h"

#define HSMON_MAX_FDS 64 /* open connections whose peer address is remembered */
#define HSMON_EVENTS                                                                       \
    (ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED |                   \
     ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |          \
     ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)

typedef struct {
    int fd; /* -1: free */
    char addr[64];
} hsmon_conn;

struct hsmon {
    void *sock;     /* the monitored socket (the owner's) */
    void *mon;      /* PAIR connected to the monitor endpoint; the thread's */
    void *ctl_in;   /* PAIR, the thread's end of the stop channel */
    void *ctl_out;  /* PAIR, the owner's end */
    pthread_t thread;
    int started, monitoring;
    hsmon_side_t side;
    int curve; /* sock is a CURVE server or client */
    char label[32];
    atomic_uint_fast64_t n_failed, n_unlogged;
    pthread_mutex_t last_mu; /* guards last_why: written by the thread, read by the owner */
    char last_why[320];      /* the latest failure as logged ("" = none yet) */
    /* the thread's */
    hsmon_conn conns[HSMON_MAX_FDS];
    int next_slot;
    uint16_t pending_event; /* last handshake failure not logged yet (0: none) */
    uint32_t pending_value;
    char pending_endpoint[128];
    int64_t window_start_us;
    int window_lines;
    uint64_t window_dropped;
};

static void peer_addr(int fd, char *buf, size_t cap)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof(ss);
    snprintf(buf, cap, "an unknown address");
    if (getpeername(fd, (struct sockaddr *)&ss, &len) < 0)
        return;
    char host[INET6_ADDRSTRLEN];
    if (ss.ss_family == AF_INET) {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
        inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
        snprintf(buf, cap, "%s:%u", host, (unsigned)ntohs(a->sin_port));
    } else if (ss.ss_family == AF_INET6) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
        inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
        snprintf(buf, cap, "[%s]:%u", host, (unsigned)ntohs(a->sin6_port));
    } else if (ss.ss_family == AF_UNIX) {
        snprintf(buf, cap, "a local (ipc) peer");
    }
}

static hsmon_conn *conn_find(hsmon_t *m, int fd)
{
    for (int i = 0; i < HSMON_MAX_FDS; i++)
        if (m->conns[i].fd == fd)
            return &m->conns[i];
    return NULL;
}

/* Whether a line may be logged now (rate limit); logs the count of the window before. */
static int may_log(hsmon_t *m)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t now = (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
    if (now - m->window_start_us >= (int64_t)HSMON_LOG_WINDOW_S * 1000000) {
        if (m->window_dropped)
            log_warn("%s: %llu more failed handshakes in the last %d s not logged", m->label,
                     (unsigned long long)m->window_dropped, HSMON_LOG_WINDOW_S);
        m->window_start_us = now;
        m->window_lines = 0;
        m->window_dropped = 0;
    }
    if (m->window_lines >= HSMON_LOG_BURST) {
        m->window_dropped++;
        atomic_fetch_add(&m->n_unlogged, 1);
        return 0;
    }
    m->window_lines++;
    return 1;
}

/* The likely cause of a failure, as seen from m's side. */
static const char *why(const hsmon_t *m, uint16_t event, uint32_t value, char *buf, size_t cap)
{
    int server = m->side == HSMON_SERVER;
    if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
        snprintf(buf, cap, "%s (ZAP status %u)",
                 server ? "the client's key is not authorized"
                        : "the server refused this process's CURVE key: is its public key "
                          "among the server's --curve-authorized-keys?",
                 (unsigned)value);
    } else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL && !server && !m->curve &&
               (value == EPIPE || value == ECONNRESET)) {
        /* a CURVE server drops a plain client's greeting at once: on a loaded host its
         * close can reach the client before the mechanism mismatch does, every attempt */
        snprintf(buf, cap, "the server closed the connection during the handshake (errno %u: "
                 "%s): if it uses CURVE, this process does not (give it --curve-secret-key "
                 "and --curve-gateway-key, the server's public key)",
                 (unsigned)value, zmq_strerror((int)value));
    } else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) {
        snprintf(buf, cap, "no detail (errno %u: %s)", (unsigned)value, zmq_strerror((int)value));
    } else if (value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) {
        const char *s;
        if (server)
            s = m->curve ? "the client does not use CURVE (a worker started without "
                           "--curve-secret-key?)"
                         : "the client uses CURVE and this process does not (give both sides "
                           "keys, or neither)";
        else
            s = m->curve ? "the server does not use CURVE (a gateway started without "
                           "--curve-secret-key?)"
                         : "the server uses CURVE and this process does not (give it "
                           "--curve-secret-key and --curve-gateway-key, the "
                           "server's public key)";
        snprintf(buf, cap, "%s", s);
    } else if (value == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC) {
        snprintf(buf, cap, "%s",
                 server ? "cryptographic error (the client's --curve-gateway-key is not this "
                          "process's public key?)"
                        : "cryptographic error (is --curve-gateway-key the server's public key?)");
    } else {
        snprintf(buf, cap, "protocol error 0x%x (not ZeroMQ, or another ZeroMQ version or "
                 "mechanism)", (unsigned)value);
    }
    return buf;
}

static void log_failure(hsmon_t *m, const char *addr)
{
    char buf[256];
    pthread_mutex_lock(&m->last_mu);
    if (m->side == HSMON_SERVER)
        snprintf(m->last_why, sizeof(m->last_why), "handshake from %s failed: %s", addr,
                 why(m, m->pending_event, m->pending_value, buf, sizeof(buf)));
    else
        snprintf(m->last_why, sizeof(m->last_why), "handshake with %s failed: %s",
                 m->pending_endpoint, why(m, m->pending_event, m->pending_value, buf,
                                          sizeof(buf)));
    pthread_mutex_unlock(&m->last_mu);
    if (m->side == HSMON_SERVER && m->pending_event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
        atomic_fetch_add(&m->n_unlogged, 1); /* the ZAP handler logged it, with the key */
    } else if (may_log(m)) {
        if (m->side == HSMON_SERVER)
            log_warn("%s: handshake from %s on %s failed: %s", m->label, addr,
                     m->pending_endpoint, why(m, m->pending_event, m->pending_value, buf,
                                              sizeof(buf)));
        else
            log_warn("%s: handshake with %s failed: %s", m->label, m->pending_endpoint,
                     why(m, m->pending_event, m->pending_value, buf, sizeof(buf)));
    }
    m->pending_event = 0;
}

static void on_event(hsmon_t *m, uint16_t event, uint32_t value, const char *endpoint)
{
    if (event == ZMQ_EVENT_ACCEPTED || event == ZMQ_EVENT_CONNECTED) {
        hsmon_conn *c = conn_find(m, (int)value);
        if (!c)
            c = conn_find(m, -1);
        if (!c) { /* full: reuse slots in turn */
            c = &m->conns[m->next_slot];
            m->next_slot = (m->next_slot + 1) % HSMON_MAX_FDS;
        }
        c->fd = (int)value;
        peer_addr(c->fd, c->addr, sizeof(c->addr));
        return;
    }
    if (event == ZMQ_EVENT_DISCONNECTED) {
        hsmon_conn *c = conn_find(m, (int)value);
        if (m->pending_event)
            log_failure(m, c ? c->addr : "an unknown address");
        if (c)
            c->fd = -1;
        return;
    }
    /* a handshake failure: logged at the disconnection that follows (the peer's address) */
    atomic_fetch_add(&m->n_failed, 1);
    if (m->pending_event)
        log_failure(m, "an unknown address"); /* two failures before a disconnection */
    m->pending_event = event;
    m->pending_value = value;
    snprintf(m->pending_endpoint, sizeof(m->pending_endpoint), "%s", endpoint);
}

static void *hsmon_thread(void *arg)
{
    hsmon_t *m = arg;
    for (;;) {
        zmq_pollitem_t items[2] = {{m->mon, 0, ZMQ_POLLIN, 0}, {m->ctl_in, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(items, 2, -1) < 0) {
            if (zmq_errno() == EINTR)
                continue;
            break; /* ETERM */
        }
        if (items[1].revents & ZMQ_POLLIN)
            break;
        if (!(items[0].revents & ZMQ_POLLIN))
            continue;
        zmq_msg_t f1, f2;
        zmq_msg_init(&f1);
        zmq_msg_init(&f2);
        int ok = zmq_msg_recv(&f1, m->mon, 0) >= 0 && zmq_msg_more(&f1) &&
                 zmq_msg_recv(&f2, m->mon, 0) >= 0;
        if (ok && zmq_msg_size(&f1) == 6) {
            const uint8_t *d = zmq_msg_data(&f1);
            uint16_t event;
            uint32_t value;
            memcpy(&event, d, 2);
            memcpy(&value, d + 2, 4);
            char ep[128];
            size_t n = zmq_msg_size(&f2) < sizeof(ep) - 1 ? zmq_msg_size(&f2) : sizeof(ep) - 1;
            memcpy(ep, zmq_msg_data(&f2), n);
            ep[n] = 0;
            on_event(m, event, value, ep);
        }
        while (ok && zmq_msg_more(&f2)) { /* not the 4.3 format: drain */
            zmq_msg_close(&f2);
            zmq_msg_init(&f2);
            if (zmq_msg_recv(&f2, m->mon, 0) < 0)
                break;
        }
        zmq_msg_close(&f1);
        zmq_msg_close(&f2);
    }
    int zero = 0;
    zmq_setsockopt(m->mon, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_close(m->mon);
    zmq_close(m->ctl_in);
    m->mon = m->ctl_in = NULL;
    return NULL;
}

hsmon_t *hsmon_start(void *zctx, void *sock, hsmon_side_t side, int curve, const char *label,
                     char *err, size_t errlen)
{
    hsmon_t *m = calloc(1, sizeof(*m));
    if (!m) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    pthread_mutex_init(&m->last_mu, NULL);
    m->sock = sock;
    m->side = side;
    m->curve = curve;
    snprintf(m->label, sizeof(m->label), "%s", label);
    for (int i = 0; i < HSMON_MAX_FDS; i++)
        m->conns[i].fd = -1;
    char mon_ep[64], ctl_ep[64];
    /* a counter, not the address: a monitor freed and another allocated at the same
     * address would find the old inproc names still bound (libzmq unbinds them later) */
    static atomic_uint_fast64_t n_started;
    unsigned long long id = (unsigned long long)atomic_fetch_add(&n_started, 1);
    snprintf(mon_ep, sizeof(mon_ep), "inproc://tidepool-hsmon-%llu", id);
    snprintf(ctl_ep, sizeof(ctl_ep), "inproc://tidepool-hsmon-stop-%llu", id);
    int zero = 0;
    if (zmq_socket_monitor(sock, mon_ep, HSMON_EVENTS) < 0) {
        snprintf(err, errlen, "handshake monitor: %s", zmq_strerror(zmq_errno()));
        pthread_mutex_destroy(&m->last_mu);
        free(m);
        return NULL;
    }
    m->monitoring = 1;
    m->mon = zmq_socket(zctx, ZMQ_PAIR);
    m->ctl_in = zmq_socket(zctx, ZMQ_PAIR);
    m->ctl_out = zmq_socket(zctx, ZMQ_PAIR);
    if (!m->mon || !m->ctl_in || !m->ctl_out || zmq_connect(m->mon, mon_ep) < 0 ||
        zmq_bind(m->ctl_in, ctl_ep) < 0 || zmq_connect(m->ctl_out, ctl_ep) < 0) {
        snprintf(err, errlen, "handshake monitor: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    zmq_setsockopt(m->ctl_out, ZMQ_LINGER, &zero, sizeof(zero));
    if (pthread_create(&m->thread, NULL, hsmon_thread, m) != 0) {
        snprintf(err, errlen, "handshake monitor: cannot start its thread");
        goto fail;
    }
    m->started = 1;
    return m;
fail:
    hsmon_stop(&m);
    return NULL;
}

void hsmon_get_stats(const hsmon_t *m, hsmon_stats *out)
{
    out->n_failed = atomic_load(&((hsmon_t *)m)->n_failed);
    out->n_unlogged = atomic_load(&((hsmon_t *)m)->n_unlogged);
}

int hsmon_last_failure(hsmon_t *m, char *buf, size_t cap)
{
    pthread_mutex_lock(&m->last_mu);
    int have = m->last_why[0] != 0;
    snprintf(buf, cap, "%s", m->last_why);
    pthread_mutex_unlock(&m->last_mu);
    return have;
}

void hsmon_stop(hsmon_t **mp)
{
    if (!mp || !*mp)
        return;
    hsmon_t *m = *mp;
    if (m->monitoring)
        zmq_socket_monitor(m->sock, NULL, 0); /* libzmq closes its end */
    if (m->started) {
        zmq_send(m->ctl_out, "", 0, 0);
        pthread_join(m->thread, NULL);
    } else {
        int zero = 0;
        if (m->mon) {
            zmq_setsockopt(m->mon, ZMQ_LINGER, &zero, sizeof(zero));
            zmq_close(m->mon);
        }
        if (m->ctl_in)
            zmq_close(m->ctl_in);
    }
    if (m->ctl_out)
        zmq_close(m->ctl_out);
    pthread_mutex_destroy(&m->last_mu);
    free(m);
    *mp = NULL;
}
