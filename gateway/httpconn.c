/* httpconn: see httpconn.h. Each accepted connection has one conn_rec, from evhttp's
 * bufferevent callback (on_new_conn) to evhttp's close callback (on_closed), which frees it.
 * Its states: ATTACH (accepted; evhttp sets the connection up after the bufferevent
 * callback returns, so the record is bound to the evhttp_connection from a timer that
 * fires at once), WAIT (no byte of a request yet), HEAD and BODY (a request arriving, the
 * timer at its deadline), BUSY (the server has the request; no deadline). */
#include "httpconn.h"

#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "api.h"
#include "log.h"
#include "protocol.h"

typedef enum { C_ATTACH, C_WAIT, C_HEAD, C_BODY, C_BUSY } conn_state;

typedef struct conn_rec {
    struct httpconn *h;
    struct bufferevent *bev;
    struct evhttp_connection *evcon; /* NULL until attached */
    struct evbuffer_cb_entry *in_cb; /* on the bufferevent's input */
    struct event *timer;             /* attach, then the request's deadline */
    int fd;                          /* -1 until attached */
    conn_state state;
    int over_limit; /* accepted past max_connections: at attach the connection idle
                     * longest is closed for it, or (none idle) it is refused */
    /* the scanner, over the bytes of the current (or, while BUSY, the next) request */
    int seen;            /* some of it arrived */
    int head_done;       /* its header block's empty line arrived */
    size_t line_len;     /* bytes of the current line so far */
    int last_cr;         /* its last byte was '\r' */
    uint64_t body_bytes; /* bytes after the header block */
    size_t n_lines;      /* lines of the header block ended so far */
    char line0[128];     /* the start of its request line (NUL-terminated, no '\r') */
    size_t line0_len;
    char tail[24];       /* the end of its request line (no '\r'; not NUL-terminated) */
    size_t tail_len;
    int too_large;       /* its body passed its cap: refused on the next timer */
    int nul_in_head;     /* a NUL byte in its header block */
    int64_t t_start_us;  /* HEAD: its first byte; BODY: the end of its headers */
    int64_t t_idle_us;   /* WAIT: since when (the oldest idle one is closed first) */
    int served;          /* a reply went out on it (an idle keep-alive connection) */
    void (*close_cb)(struct evhttp_connection *, void *);
    void *close_arg;
    struct conn_rec *prev, *next;
} conn_rec;

typedef struct linger_s {
    struct httpconn *h;
    int fd;
    struct event *ev;
    size_t n_discarded;
    int64_t end_us;
    struct linger_s *prev, *next;
} linger_t;

struct httpconn {
    struct event_base *base;
    httpconn_params p;
    stats_t *stats;
    conn_rec *conns; /* every record */
    int n_open;
    conn_rec **by_fd; /* attached records by descriptor */
    int cap_fd;
    linger_t *lingering;
    int n_linger;
};

httpconn_params httpconn_default_params(void)
{
    httpconn_params p = {
        .max_connections = 4096, .header_timeout_s = 20, .body_timeout_s = 30,
        .body_min_rate = 1024};
    return p;
}

// --- records

static void set_gauge(struct httpconn *h)
{
    if (h->stats)
        stats_http_connections(h->stats, h->n_open);
}

static conn_rec *find(struct httpconn *h, struct evhttp_connection *conn)
{
    struct bufferevent *bev = conn ? evhttp_connection_get_bufferevent(conn) : NULL;
    int fd = bev ? (int)bufferevent_getfd(bev) : -1;
    if (fd < 0 || fd >= h->cap_fd || !h->by_fd[fd] || h->by_fd[fd]->evcon != conn)
        return NULL;
    return h->by_fd[fd];
}

static int index_fd(struct httpconn *h, conn_rec *r)
{
    if (r->fd >= h->cap_fd) {
        int cap = h->cap_fd ? h->cap_fd : 256;
        while (cap <= r->fd)
            cap *= 2;
        conn_rec **v = realloc(h->by_fd, (size_t)cap * sizeof(*v));
        if (!v)
            return -1;
        memset(v + h->cap_fd, 0, (size_t)(cap - h->cap_fd) * sizeof(*v));
        h->by_fd = v;
        h->cap_fd = cap;
    }
    h->by_fd[r->fd] = r;
    return 0;
}

/* Forget r (its connection is gone, or going: evhttp frees the bufferevent). */
static void release(conn_rec *r)
{
    struct httpconn *h = r->h;
    if (r->in_cb)
        evbuffer_remove_cb_entry(bufferevent_get_input(r->bev), r->in_cb);
    if (r->timer)
        event_free(r->timer);
    if (r->fd >= 0 && r->fd < h->cap_fd && h->by_fd[r->fd] == r)
        h->by_fd[r->fd] = NULL;
    if (r->prev)
        r->prev->next = r->next;
    else
        h->conns = r->next;
    if (r->next)
        r->next->prev = r->prev;
    h->n_open--;
    set_gauge(h);
    free(r);
}

// --- lingering close

static void linger_free(linger_t *l)
{
    struct httpconn *h = l->h;
    if (l->ev)
        event_free(l->ev);
    close(l->fd);
    if (l->prev)
        l->prev->next = l->next;
    else
        h->lingering = l->next;
    if (l->next)
        l->next->prev = l->prev;
    h->n_linger--;
    free(l);
}

static void on_linger(evutil_socket_t fd, short what, void *arg)
{
    linger_t *l = arg;
    char buf[4096];
    if (!(what & EV_READ) || proto_now_us() >= l->end_us) {
        linger_free(l);
        return;
    }
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n > 0) {
            l->n_discarded += (size_t)n;
            if (l->n_discarded < HTTPCONN_LINGER_BYTES)
                continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            return; /* more later (EV_PERSIST), until the time is up */
        }
        linger_free(l); /* EOF, an error, or enough */
        return;
    }
}

/* Send the n bytes at reply on fd (a connection evhttp is about to free and close) and
 * shut its writing side, keeping a duplicate of it open to discard what the client still
 * sends (see httpconn.h). The reply is small and the socket's send buffer empty: one
 * send() takes it. */
static void send_and_linger(struct httpconn *h, int fd, const char *reply, size_t n)
{
    int d = h->n_linger < HTTPCONN_MAX_LINGER ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
    ssize_t sent = send(fd, reply, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if ((size_t)(sent < 0 ? 0 : sent) < n)
        log_debug("http: a refusal reply was cut short (%zd of %zu bytes)", sent, n);
    shutdown(fd, SHUT_WR);
    if (d < 0)
        return;
    linger_t *l = calloc(1, sizeof(*l));
    struct timeval tv = {HTTPCONN_LINGER_MS / 1000, (HTTPCONN_LINGER_MS % 1000) * 1000};
    if (l)
        l->ev = event_new(h->base, d, EV_READ | EV_PERSIST, on_linger, l);
    if (!l || !l->ev || event_add(l->ev, &tv) < 0) {
        if (l && l->ev)
            event_free(l->ev);
        free(l);
        close(d);
        return;
    }
    l->h = h;
    l->fd = d;
    l->end_us = proto_now_us() + HTTPCONN_LINGER_MS * 1000LL;
    l->next = h->lingering;
    if (l->next)
        l->next->prev = l;
    h->lingering = l;
    h->n_linger++;
}

/* Answer r's connection with status and e's JSON body (and extra header lines, "" or
 * "Name: value\r\n"...), then free the connection in evhttp, which frees r (on_closed).
 * r must not be used after. */
static void refuse(conn_rec *r, const char *reason, const char *extra, const api_error *e)
{
    struct httpconn *h = r->h;
    char *body = api_error_json(e);
    char date[64] = "", head[512];
    time_t now = time(NULL);
    struct tm tm;
    if (gmtime_r(&now, &tm))
        strftime(date, sizeof(date), "%a, %d %b %Y %H:%M:%S GMT", &tm);
    const char *b = body ? body : "{\"error\":{\"message\":\"out of memory\"}}";
    int hn = snprintf(head, sizeof(head),
                      "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: "
                      "%zu\r\nDate: %s\r\nConnection: close\r\n%s\r\n",
                      e->status, reason, strlen(b), date, extra);
    size_t bn = strlen(b);
    char *reply = hn > 0 && (size_t)hn < sizeof(head) ? malloc((size_t)hn + bn) : NULL;
    if (reply) {
        memcpy(reply, head, (size_t)hn);
        memcpy(reply + hn, b, bn);
        send_and_linger(h, (int)bufferevent_getfd(r->bev), reply, (size_t)hn + bn);
        if (h->stats)
            stats_http_response(h->stats, e->status);
    }
    free(reply);
    free(body);
    evhttp_connection_free(r->evcon); /* runs on_closed: r is freed */
}

void httpconn_log_refusal(struct evhttp_connection *conn, const char *what)
{
    static int64_t last_us;
    static long n_quiet;
    int64_t now = proto_now_us();
    if (last_us && now - last_us < 1000000) {
        n_quiet++;
        return;
    }
    char *addr = NULL;
    ev_uint16_t port = 0;
    if (conn)
        evhttp_connection_get_peer(conn, &addr, &port);
    log_info("%s (client %s:%u; %ld more refused since the last such line)", what,
             addr ? addr : "?", (unsigned)port, n_quiet);
    last_us = now;
    n_quiet = 0;
}

// --- deadlines

static void arm(conn_rec *r, int64_t in_us)
{
    if (in_us < 0)
        in_us = 0;
    struct timeval tv = {(time_t)(in_us / 1000000), (suseconds_t)(in_us % 1000000)};
    evtimer_add(r->timer, &tv);
}

static int64_t body_deadline_us(const conn_rec *r)
{
    const httpconn_params *p = &r->h->p;
    int64_t credit = p->body_min_rate > 0 ? (int64_t)(r->body_bytes * 1000000 /
                                                      (uint64_t)p->body_min_rate)
                                          : 0;
    return r->t_start_us + p->body_timeout_s * 1000000LL + credit;
}

/* r (WAIT or HEAD) received what it has received: move it on and arm its deadline. */
static void advance(conn_rec *r, int64_t now)
{
    if (r->state == C_WAIT && r->seen) {
        r->state = C_HEAD;
        r->t_start_us = now;
        arm(r, r->h->p.header_timeout_s * 1000000LL);
    }
    if (r->state == C_HEAD && r->head_done) {
        r->state = C_BODY;
        r->t_start_us = now;
        arm(r, body_deadline_us(r) - now);
    }
}

static void scanner_reset(conn_rec *r)
{
    r->seen = r->head_done = r->last_cr = 0;
    r->line_len = 0;
    r->body_bytes = 0;
    r->n_lines = 0;
    r->line0_len = 0;
    r->line0[0] = 0;
    r->tail_len = 0;
    r->too_large = 0;
    r->nul_in_head = 0;
}

/* What the HTTP-version at the end of r's request line is (RFC 9112 2.3: "HTTP/" DIGIT
 * "." DIGIT): 0 for HTTP/1.0 and HTTP/1.1, HTTPCONN_REQ_VERSION for another well-formed one
 * ("HTTP/1.2", "HTTP/2.0", "HTTP/2"), HTTPCONN_REQ_BAD_VERSION for anything else ("HTTP/01.1",
 * "HTTP/1.01", "HTTP/-1.1", which libevent's sscanf("HTTP/%d.%d") takes). Trailing spaces
 * are dropped first, as libevent does. */
static int version_class(const conn_rec *r)
{
    size_t n = r->tail_len, b;
    while (n > 0 && r->tail[n - 1] == ' ')
        n--;
    for (b = n; b > 0 && r->tail[b - 1] != ' '; b--)
        ;
    if (b == 0) /* no space in the tail: no version, or one far too long */
        return HTTPCONN_REQ_BAD_VERSION;
    const char *v = r->tail + b;
    size_t len = n - b;
    if (len == 8 && (memcmp(v, "HTTP/1.1", 8) == 0 || memcmp(v, "HTTP/1.0", 8) == 0))
        return 0;
    int digit = len >= 6 && v[5] >= '0' && v[5] <= '9';
    if (memcmp(v, "HTTP/", len < 5 ? len : 5) == 0 && digit &&
        (len == 6 || (len == 8 && v[6] == '.' && v[7] >= '0' && v[7] <= '9')))
        return HTTPCONN_REQ_VERSION;
    return HTTPCONN_REQ_BAD_VERSION;
}

/* 1 if the request line in line0 is an upload (POST /v1/files, origin or absolute form). */
static int is_upload(const char *line)
{
    if (strncmp(line, "POST ", 5) != 0)
        return 0;
    const char *t = line + 5;
    if (strncmp(t, "http://", 7) == 0 || strncmp(t, "https://", 8) == 0) {
        t = strchr(strstr(t, "//") + 2, '/');
        if (!t)
            return 0;
    }
    static const char path[] = "/v1/files";
    size_t n = sizeof(path) - 1;
    return strncmp(t, path, n) == 0 && (t[n] == ' ' || t[n] == '?' || t[n] == 0);
}

/* The body limit of r's current request's route (0: none). */
static size_t body_limit(const conn_rec *r)
{
    const httpconn_params *p = &r->h->p;
    return is_upload(r->line0) ? p->upload_max_bytes : p->body_max_bytes;
}

/* The most body bytes r's current request may send before it is cut (UINT64_MAX: no cap). */
static uint64_t body_cap(const conn_rec *r)
{
    size_t limit = body_limit(r);
    return limit ? (uint64_t)limit + HTTPCONN_BODY_SLACK : UINT64_MAX;
}

/* r's body (BODY: being read by evhttp) passed its cap: refuse it from the timer (not from
 * inside the bufferevent's own callback, which evhttp_connection_free would pull out from
 * under libevent). */
static void check_cap(conn_rec *r)
{
    if (r->state == C_BODY && !r->too_large && r->body_bytes > body_cap(r)) {
        r->too_large = 1;
        arm(r, 0);
    }
}

/* Feed the client's next n bytes to r's scanner. evhttp reads lines ending in "\n" with an
 * optional "\r" before it (EVBUFFER_EOL_CRLF); the header block ends at the first empty
 * one. (An empty first line is a request evhttp refuses with 400.) */
static void scan(conn_rec *r, const unsigned char *p, size_t n)
{
    if (n)
        r->seen = 1;
    size_t i = 0;
    while (!r->head_done && i < n) {
        unsigned char ch = p[i++];
        if (ch == '\n') {
            if (r->line_len == 0 || (r->line_len == 1 && r->last_cr))
                r->head_done = 1;
            r->line_len = 0;
            r->last_cr = 0;
            r->n_lines++;
        } else {
            r->line_len++;
            r->last_cr = ch == '\r';
            r->nul_in_head |= ch == 0;
            if (r->n_lines == 0 && ch != '\r' && r->line0_len + 1 < sizeof(r->line0)) {
                r->line0[r->line0_len++] = (char)ch;
                r->line0[r->line0_len] = 0;
            }
            if (r->n_lines == 0 && ch != '\r') {
                if (r->tail_len == sizeof(r->tail))
                    memmove(r->tail, r->tail + 1, --r->tail_len);
                r->tail[r->tail_len++] = (char)ch;
            }
        }
    }
    r->body_bytes += n - i;
}

/* Scan the bytes of buf from offset on. */
static void scan_buffer(conn_rec *r, struct evbuffer *buf, size_t offset)
{
    struct evbuffer_ptr pos;
    if (evbuffer_ptr_set(buf, &pos, offset, EVBUFFER_PTR_SET) < 0)
        return;
    size_t left = evbuffer_get_length(buf) - offset;
    while (left > 0 && !r->head_done) {
        struct evbuffer_iovec v[8];
        int nv = evbuffer_peek(buf, (ev_ssize_t)left, &pos, v, 8);
        if (nv <= 0)
            break;
        size_t done = 0;
        for (int i = 0; i < nv && i < 8 && done < left; i++) {
            size_t len = v[i].iov_len < left - done ? v[i].iov_len : left - done;
            scan(r, v[i].iov_base, len);
            done += len;
        }
        left -= done;
        if (left && evbuffer_ptr_set(buf, &pos, done, EVBUFFER_PTR_ADD) < 0)
            break;
    }
    if (left) { /* past the header block: only counted */
        r->seen = 1;
        r->body_bytes += left;
    }
}

/* Bytes were added to (or drained from) a connection's input. New bytes are at its end. */
static void on_input(struct evbuffer *buf, const struct evbuffer_cb_info *info, void *arg)
{
    conn_rec *r = arg;
    if (!info->n_added)
        return;
    size_t len = evbuffer_get_length(buf);
    size_t n = info->n_added < len ? info->n_added : len;
    if (r->head_done) {
        r->seen = 1;
        r->body_bytes += n;
    } else {
        scan_buffer(r, buf, len - n);
    }
    if (r->state == C_WAIT || r->state == C_HEAD)
        advance(r, proto_now_us());
    check_cap(r);
}

// --- libevent's callbacks

static void on_closed(struct evhttp_connection *conn, void *arg)
{
    conn_rec *r = arg;
    void (*cb)(struct evhttp_connection *, void *) = r->close_cb;
    r->close_cb = NULL;
    if (cb)
        cb(conn, r->close_arg);
    release(r);
}

/* Close the connection that has been idle longest (WAIT: between requests, nothing of the
 * next one received; one that never had a request only after HTTPCONN_FRESH_MS, so that a
 * client's new connection is not closed before its request had time to arrive), except
 * self, to make room for a new one: a keep-alive connection
 * may be closed whenever it is idle (RFC 9112 9.8), so idle connections cannot hold every
 * slot; as nginx reuses its idle keep-alive connections when it runs out. 1 if one was
 * closed. */
static int evict_idle(struct httpconn *h, conn_rec *self)
{
    conn_rec *oldest = NULL;
    int64_t fresh_after = proto_now_us() - HTTPCONN_FRESH_MS * 1000LL;
    for (conn_rec *r = h->conns; r; r = r->next)
        if (r != self && r->state == C_WAIT && !r->over_limit &&
            (r->served || r->t_idle_us <= fresh_after) &&
            (!oldest || r->t_idle_us < oldest->t_idle_us))
            oldest = r;
    if (!oldest)
        return 0;
    log_debug("http: closing the connection idle for the longest (%.1f s) for a new one",
              (double)(proto_now_us() - oldest->t_idle_us) / 1e6);
    evhttp_connection_free(oldest->evcon); /* runs on_closed: oldest is freed */
    return 1;
}

/* The record's first timer: evhttp has set the connection up. */
static void attach(conn_rec *r)
{
    struct httpconn *h = r->h;
    bufferevent_data_cb rd = NULL, wr = NULL;
    bufferevent_event_cb ev = NULL;
    void *arg = NULL;
    bufferevent_getcb(r->bev, &rd, &wr, &ev, &arg);
    struct bufferevent *bev = r->bev;
    if (!rd && !ev) { /* evhttp freed it already (bufferevent_free clears the callbacks) */
        release(r);
        bufferevent_decref(bev); /* the last reference: closes the socket */
        return;
    }
    r->evcon = arg; /* evhttp's argument to its bufferevent callbacks is the connection */
    r->fd = (int)bufferevent_getfd(bev);
    if (r->fd >= 0 && index_fd(h, r) < 0)
        r->fd = -1; /* out of memory: not found by find(), still counted and closed */
    evhttp_connection_set_closecb(r->evcon, on_closed, r);
    r->state = C_WAIT;
    r->t_idle_us = proto_now_us();
    bufferevent_decref(bev); /* evhttp's own reference remains */
    if (r->over_limit && h->n_open > h->p.max_connections && evict_idle(h, r))
        r->over_limit = 0;
    if (r->over_limit) {
        char msg[200];
        snprintf(msg, sizeof(msg), "503: a connection over --max-connections (%d)",
                 h->p.max_connections);
        httpconn_log_refusal(r->evcon, msg);
        if (h->stats)
            stats_http_event(h->stats, STATS_HTTP_REFUSED);
        api_error e;
        api_error_set(&e, 503, "server_error", NULL, "too_many_connections",
                      "The server has too many connections open (--max-connections %d). "
                      "Please try again in 1s.",
                      h->p.max_connections);
        refuse(r, "Service Unavailable", "Retry-After: 1\r\n", &e);
        return;
    }
    advance(r, proto_now_us());
}

static void on_timer(evutil_socket_t fd, short what, void *arg)
{
    conn_rec *r = arg;
    (void)fd, (void)what;
    if (r->state == C_ATTACH) {
        attach(r);
        return;
    }
    struct httpconn *h = r->h;
    int64_t now = proto_now_us();
    api_error e;
    char msg[200];
    if (r->state == C_HEAD) {
        snprintf(msg, sizeof(msg), "408: request headers not received within %d s",
                 h->p.header_timeout_s);
        httpconn_log_refusal(r->evcon, msg);
        if (h->stats)
            stats_http_event(h->stats, STATS_HTTP_HEADER_TIMEOUT);
        api_error_set(&e, 408, "invalid_request_error", NULL, "request_timeout",
                      "The request's headers were not received within %d s of its first byte "
                      "(--http-header-timeout-s).",
                      h->p.header_timeout_s);
        refuse(r, "Request Timeout", "", &e);
    } else if (r->state == C_BODY && r->too_large) {
        int up = is_upload(r->line0);
        snprintf(msg, sizeof(msg), "413: a request body cut at %llu bytes (limit %zu)",
                 (unsigned long long)r->body_bytes, body_limit(r));
        httpconn_log_refusal(r->evcon, msg);
        api_error_set(&e, 413, "invalid_request_error", NULL,
                      up ? "file_too_large" : "request_too_large",
                      "The request body is more than %llu bytes; the limit is %zu bytes (%s).",
                      (unsigned long long)body_cap(r), body_limit(r),
                      up ? "--batch-max-file-bytes" : "--max-body-bytes");
        refuse(r, "Content Too Large", "", &e);
    } else if (r->state == C_BODY) {
        int64_t dl = body_deadline_us(r);
        if (now < dl) {
            arm(r, dl - now);
            return;
        }
        snprintf(msg, sizeof(msg), "408: request body not received in time (%llu bytes in %.1f s)",
                 (unsigned long long)r->body_bytes, (double)(now - r->t_start_us) / 1e6);
        httpconn_log_refusal(r->evcon, msg);
        if (h->stats)
            stats_http_event(h->stats, STATS_HTTP_BODY_TIMEOUT);
        if (h->p.body_min_rate > 0)
            api_error_set(&e, 408, "invalid_request_error", NULL, "request_timeout",
                          "The request's body was not received in time: it must arrive within "
                          "%d s of the headers, plus 1 s per %d bytes received "
                          "(--http-body-timeout-s, --http-body-min-rate).",
                          h->p.body_timeout_s, h->p.body_min_rate);
        else
            api_error_set(&e, 408, "invalid_request_error", NULL, "request_timeout",
                          "The request's body was not received within %d s of the headers "
                          "(--http-body-timeout-s).",
                          h->p.body_timeout_s);
        refuse(r, "Request Timeout", "", &e);
    }
}

/* evhttp_set_bevcb: a connection was accepted; its bufferevent is made here. */
static struct bufferevent *on_new_conn(struct event_base *base, void *arg)
{
    struct httpconn *h = arg;
    conn_rec *r = calloc(1, sizeof(*r));
    struct bufferevent *bev = r ? bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE) : NULL;
    if (r && bev) {
        r->timer = evtimer_new(base, on_timer, r);
        r->in_cb = evbuffer_add_cb(bufferevent_get_input(bev), on_input, r);
    }
    if (!r || !bev || !r->timer || !r->in_cb) { /* out of memory: evhttp's own, untracked */
        if (r && r->timer)
            event_free(r->timer);
        if (bev)
            bufferevent_free(bev);
        free(r);
        return NULL;
    }
    r->h = h;
    r->bev = bev;
    r->fd = -1;
    r->state = C_ATTACH;
    r->over_limit = h->n_open >= h->p.max_connections;
    /* held until attach, so that a connection evhttp gives up on before then (out of
     * memory) does not leave r with a freed bufferevent */
    bufferevent_incref(bev);
    r->next = h->conns;
    if (r->next)
        r->next->prev = r;
    h->conns = r;
    h->n_open++;
    set_gauge(h);
    event_active(r->timer, EV_TIMEOUT, 1);
    return bev;
}

// --- the interface

httpconn_t *httpconn_new(struct event_base *base, struct evhttp *http, const httpconn_params *p)
{
    if (!base || !http || !p || p->max_connections < 1 || p->header_timeout_s < 1 ||
        p->body_timeout_s < 1 || p->body_min_rate < 0)
        return NULL;
    struct httpconn *h = calloc(1, sizeof(*h));
    if (!h)
        return NULL;
    h->base = base;
    h->p = *p;
    evhttp_set_bevcb(http, on_new_conn, h);
    return h;
}

void httpconn_set_stats(httpconn_t *h, stats_t *stats)
{
    if (!h)
        return;
    h->stats = stats;
    set_gauge(h);
}

int httpconn_request_read(httpconn_t *h, struct evhttp_connection *conn)
{
    conn_rec *r = h ? find(h, conn) : NULL;
    if (!r)
        return 0;
    int seen = (r->nul_in_head ? HTTPCONN_REQ_NUL : 0) | version_class(r);
    r->state = C_BUSY;
    evtimer_del(r->timer);
    scanner_reset(r);
    scan_buffer(r, bufferevent_get_input(r->bev), 0); /* a pipelined next request */
    return seen;
}

int httpconn_request_version(httpconn_t *h, struct evhttp_connection *conn)
{
    conn_rec *r = h ? find(h, conn) : NULL;
    return r && r->state != C_BUSY && r->seen ? version_class(r) : 0;
}

void httpconn_reply_done(httpconn_t *h, struct evhttp_connection *conn)
{
    conn_rec *r = h ? find(h, conn) : NULL;
    if (!r || r->state != C_BUSY)
        return;
    r->state = C_WAIT;
    r->served = 1;
    r->t_idle_us = proto_now_us();
    advance(r, r->t_idle_us);
    check_cap(r); /* a pipelined request's body may be past its cap already */
}

void httpconn_set_close_cb(httpconn_t *h, struct evhttp_connection *conn,
                           void (*cb)(struct evhttp_connection *, void *), void *arg)
{
    conn_rec *r = h ? find(h, conn) : NULL;
    if (!r) { /* not tracked (out of memory at accept): evhttp's own callback */
        evhttp_connection_set_closecb(conn, cb, arg);
        return;
    }
    r->close_cb = cb;
    r->close_arg = cb ? arg : NULL;
}

int httpconn_n_open(const httpconn_t *h)
{
    return h ? h->n_open : 0;
}

void httpconn_destroy(httpconn_t **ph)
{
    if (!ph || !*ph)
        return;
    struct httpconn *h = *ph;
    while (h->lingering)
        linger_free(h->lingering);
    /* left: records evhttp freed before they were attached (evhttp_free) */
    while (h->conns) {
        struct bufferevent *bev = h->conns->bev;
        int attached = h->conns->state != C_ATTACH;
        if (attached) /* (none: evhttp_free closed them) its bufferevent is not ours */
            h->conns->in_cb = NULL;
        release(h->conns);
        if (!attached)
            bufferevent_decref(bev);
    }
    free(h->by_fd);
    free(h);
    *ph = NULL;
}
