/* batch_download: GET /v1/files/{id}/content, streamed from the store (batch_internal.h).
 *
 * A file's content is sent a piece at a time: one piece (BATCH_DOWNLOAD_PIECES) is read from
 * the store (store_file_read: incremental BLOB I/O, no transaction held between pieces)
 * and queued on the connection, and the next one when it has been written to the socket
 * (libevent's write callback, evhttp_send_reply_chunk_with_cb), so a download holds one
 * piece, not the file. Until 3 Dec 2026 the whole file was read and queued: N slow
 * downloads of a big file held N copies. The reply has the file's Content-Length (no
 * chunked encoding); a piece that cannot be read (the file was deleted meanwhile) closes
 * the connection short of it. A download is freed when its last piece is queued, or by
 * its connection's close callback (httpconn_set_close_cb). */
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <stdio.h>
#include <stdlib.h>

#include "batch_internal.h"
#include "log.h"
#include "store.h"

/* A file's content being sent. */
typedef struct download {
    batch_t *b;
    struct evhttp_request *req;
    struct evhttp_connection *conn;
    char id[64];
    int64_t off, len; /* bytes queued so far; the file's size */
    size_t piece;     /* bytes read and queued at a time */
    struct download *prev, *next;
} download_t;

static void download_free(download_t *d)
{
    batch_t *b = d->b;
    if (d->prev)
        d->prev->next = d->next;
    else
        b->downloads = d->next;
    if (d->next)
        d->next->prev = d->prev;
    free(d);
}

/* The client left, or the download was cut: libevent frees the request when it is still
 * attached to the connection, else (detached after an error) leaves it to us. */
static void download_on_close(struct evhttp_connection *conn, void *arg)
{
    download_t *d = arg;
    (void)conn;
    log_debug("file %s: download closed after %lld of %lld bytes", d->id, (long long)d->off,
              (long long)d->len);
    if (evhttp_request_get_connection(d->req) == NULL)
        evhttp_request_free(d->req);
    download_free(d);
}

/* libevent reads from a connection while it writes a reply, to learn that the client
 * closed, and frees the connection at a FIN, which a client that only shut its sending
 * side after the request (shutdown(SHUT_WR)) sends too: its download was cut. A download
 * writes until it ends, so it learns of a closed client from a write that fails (a reset),
 * or of a stalled one from the write timeout (--http-timeout-s); reading stays off until
 * libevent reads the next request. Call after each call that queues a piece. */
static void no_read(struct evhttp_connection *conn)
{
    struct bufferevent *bev = evhttp_connection_get_bufferevent(conn);
    if (bev)
        bufferevent_disable(bev, EV_READ);
}

/* Queue d's next piece; after the last one, end the reply and free d. Also the write
 * callback: the piece before was written out. */
static void download_next(struct evhttp_connection *conn, void *arg)
{
    download_t *d = arg;
    (void)conn;
    size_t n = d->len - d->off < (int64_t)d->piece ? (size_t)(d->len - d->off) : d->piece;
    struct evbuffer *buf = evbuffer_new();
    struct evbuffer_iovec v;
    int rc = buf && evbuffer_reserve_space(buf, (ev_ssize_t)n, &v, 1) == 1
                 ? store_file_read(d->b->store, d->id, d->off, v.iov_base, n)
                 : -1;
    if (rc == 0) {
        v.iov_len = n;
        rc = evbuffer_commit_space(buf, &v, 1);
    }
    if (rc != 0) {
        log_warn("file %s: download cut after %lld of %lld bytes: %s", d->id, (long long)d->off,
                 (long long)d->len, rc > 0 ? "the file was deleted" : "cannot read it");
        if (buf)
            evbuffer_free(buf);
        evhttp_connection_free(d->conn); /* runs download_on_close: d is freed */
        return;
    }
    d->off += (int64_t)n;
    struct evhttp_request *req = d->req;
    if (d->off < d->len) {
        evhttp_send_reply_chunk_with_cb(req, buf, download_next, d);
        no_read(d->conn);
    } else { /* the last piece: libevent ends the reply once it is written */
        struct evhttp_connection *c = d->conn;
        httpconn_set_close_cb(d->b->conns, c, NULL, NULL);
        download_free(d);
        evhttp_send_reply_chunk(req, buf);
        no_read(c);
        evhttp_send_reply_end(req);
    }
    evbuffer_free(buf);
}

int batch_download_start(batch_t *b, struct evhttp_request *req, const store_file *f)
{
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    char len[32];
    snprintf(len, sizeof(len), "%lld", (long long)f->bytes);
    evhttp_add_header(h, "Content-Type", "application/octet-stream");
    evhttp_add_header(h, "Content-Length", len);
    if (f->bytes <= 0 || evhttp_request_get_command(req) == EVHTTP_REQ_HEAD) {
        evhttp_send_reply(req, 200, NULL, NULL); /* HEAD: the headers alone (RFC 9110 9.3.2) */
        return 0;
    }
    download_t *d = calloc(1, sizeof(*d));
    if (!d) {
        evhttp_clear_headers(h);
        return -1;
    }
    d->b = b;
    d->req = req;
    d->conn = evhttp_request_get_connection(req);
    d->len = f->bytes;
    int64_t piece = f->bytes / BATCH_DOWNLOAD_PIECES;
    d->piece = piece < BATCH_DOWNLOAD_MIN   ? BATCH_DOWNLOAD_MIN
               : piece > BATCH_DOWNLOAD_MAX ? BATCH_DOWNLOAD_MAX
                                            : (size_t)piece;
    snprintf(d->id, sizeof(d->id), "%s", f->id);
    d->next = b->downloads;
    if (d->next)
        d->next->prev = d;
    b->downloads = d;
    httpconn_set_close_cb(b->conns, d->conn, download_on_close, d);
    evhttp_send_reply_start(req, 200, "OK");
    download_next(d->conn, d);
    return 0;
}

void batch_download_cut_all(batch_t *b)
{
    while (b->downloads)
        evhttp_connection_free(b->downloads->conn); /* runs download_on_close */
}

