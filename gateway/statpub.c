/* statpub: see statpub.h. The snapshot is packed straight from stats and the cluster's
 * worker list; map sizes are counted by hand, so each map is written by one function whose
 * key count sits next to its keys.
 *
 * Sending: an XPUB socket with ZMQ_XPUB_NODROP, so a send that would exceed a subscriber's
 * high-water mark fails with EAGAIN instead of being dropped silently (a PUB socket
 * reports success and drops). What could not go out waits here: events in a bounded FIFO
 * (the oldest dropped and counted when it is full), the snapshot as a flag "one is due"
 * (a due snapshot is packed when it can be sent, so it is the newest state; ticks while
 * one is due are counted as conflated). Events go before the snapshot, so when a snapshot
 * leaves, every event up to its last_event_seq has left or is counted in events_dropped.
 * A retry timer flushes what waits while the socket is full.
 *
 * A subscriber that stops reading would so hold back every other one. Once the socket has
 * been full for stall_ms, each flush that still finds no room sends past it:
 * ZMQ_XPUB_NODROP is turned off for that send (libzmq reads it at every send), so the
 * full subscriber's copies are dropped by ZeroMQ while the others get theirs; such sends
 * are counted in stall_sends. libzmq then leaves the full subscriber out of later sends
 * until it has room again (its pipe is inactive), so those losses are not seen here: the
 * stalled subscriber sees them as gaps in its seq numbers. */
#include "statpub.h"

#include <errno.h>
#include <event2/event.h>
#include <math.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "log.h"

struct statpub {
    struct event_base *base;
    struct event *tick, *retry;
    void *zctx, *sock;
    curve_zap_t *zap; /* CURVE: the ZAP handler of zctx (NULL = plain) */
    stats_t *stats;
    const cluster_t *cluster;
    char *model;
    int interval_ms, retry_ms;
    char endpoint[PROTO_ENDPOINT_LEN];
    uint64_t seq;                 /* snapshots due so far (the snapshot stream's seq) */
    int snapshot_due;             /* 1: a snapshot waits for room */
    uint64_t sent;                /* messages handed to ZeroMQ */
    uint64_t events_dropped;      /* events dropped from a full queue */
    uint64_t snapshots_conflated; /* snapshots replaced by a newer one before they left */
    uint64_t last_event_seq;      /* the newest event published, queued or dropped */
    uint64_t stall_sends;         /* sends made past a stalled subscriber (it lost them) */
    int64_t stall_us;             /* wait before sending past a full subscriber; 0 = never */
    int64_t waiting_since_us;     /* since when some message has found no room (reset when
                                   * everything reached every subscriber); 0 = none */
    int lossy;                    /* 1 while sending past a stalled subscriber */
    int stall_logged;             /* the current stall was logged */
    msgpack_sbuffer *evq;         /* (ev_cap,) packed event bodies, a ring */
    int ev_cap, ev_head, ev_n;
    int subscribers;              /* from the XPUB's (un)subscription messages */
};

statpub_params statpub_default_params(void)
{
    statpub_params p = {.bind = "tcp://127.0.0.1:5558",
                        .interval_ms = 1000,
                        .sndhwm = STATPUB_SNDHWM,
                        .sndbuf = STATPUB_SNDBUF,
                        .event_queue = STATPUB_EVENT_QUEUE,
                        .stall_ms = STATPUB_STALL_MS,
                        .model_name = "tidepool"};
    return p;
}

// --- packing helpers

static void pk_key(msgpack_packer *pk, const char *k)
{
    size_t n = strlen(k);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, k, n);
}

static void pk_str(msgpack_packer *pk, const char *k, const char *v)
{
    pk_key(pk, k);
    size_t n = strlen(v);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, v, n);
}

static void pk_u64(msgpack_packer *pk, const char *k, uint64_t v)
{
    pk_key(pk, k);
    msgpack_pack_uint64(pk, v);
}

static void pk_i64(msgpack_packer *pk, const char *k, int64_t v)
{
    pk_key(pk, k);
    msgpack_pack_int64(pk, v);
}

/* A float, or nil when it is not a number (an empty percentile). */
static void pk_dbl(msgpack_packer *pk, const char *k, double v)
{
    pk_key(pk, k);
    if (isfinite(v))
        msgpack_pack_double(pk, v);
    else
        msgpack_pack_nil(pk);
}

static void pk_role(msgpack_packer *pk, const char *k, int role)
{
    pk_key(pk, k);
    if (role) {
        const char *r = proto_role_str(role);
        msgpack_pack_str(pk, strlen(r));
        msgpack_pack_str_body(pk, r, strlen(r));
    } else {
        msgpack_pack_nil(pk);
    }
}

/* {"p50", "p90", "p99" (ms, nil when empty), "n"} */
static void pk_pct(msgpack_packer *pk, const char *k, const stats_percentiles *p)
{
    pk_key(pk, k);
    msgpack_pack_map(pk, 4);
    pk_dbl(pk, "p50", p->p50 * 1000.0);
    pk_dbl(pk, "p90", p->p90 * 1000.0);
    pk_dbl(pk, "p99", p->p99 * 1000.0);
    pk_u64(pk, "n", p->n);
}

/* {"transfers", "bytes", "ms", "rejects", "timeouts", "aborts", "cancels"} */
static void pk_kvx(msgpack_packer *pk, const char *k, const proto_kvx_counters *c)
{
    pk_key(pk, k);
    msgpack_pack_map(pk, 7);
    pk_u64(pk, "transfers", c->n_ok);
    pk_u64(pk, "bytes", c->n_bytes);
    pk_dbl(pk, "ms", (double)c->total_us / 1000.0);
    pk_u64(pk, "rejects", c->n_rejected);
    pk_u64(pk, "timeouts", c->n_timeouts);
    pk_u64(pk, "aborts", c->n_aborted);
    pk_u64(pk, "cancels", c->n_cancelled);
}

/* {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos" [..],
 *  "mean_acceptance_length" (1 + accepted / drafts; nil without drafts)} */
static void pk_spec(msgpack_packer *pk, const proto_spec_counters *c)
{
    pk_key(pk, "spec");
    msgpack_pack_map(pk, 5);
    pk_u64(pk, "num_drafts", c->n_drafts);
    pk_u64(pk, "num_draft_tokens", c->n_draft_tokens);
    pk_u64(pk, "num_accepted_tokens", c->n_accepted_tokens);
    pk_key(pk, "accepted_per_pos");
    msgpack_pack_array(pk, PROTO_SPEC_MAX_POS);
    for (int i = 0; i < PROTO_SPEC_MAX_POS; i++)
        msgpack_pack_uint64(pk, c->accepted_per_pos[i]);
    pk_dbl(pk, "mean_acceptance_length",
           c->n_drafts ? 1.0 + (double)c->n_accepted_tokens / (double)c->n_drafts : NAN);
}

static void kvx_add(proto_kvx_counters *a, const proto_kvx_counters *b)
{
    a->n_ok += b->n_ok;
    a->n_bytes += b->n_bytes;
    a->total_us += b->total_us;
    a->n_rejected += b->n_rejected;
    a->n_timeouts += b->n_timeouts;
    a->n_aborted += b->n_aborted;
    a->n_cancelled += b->n_cancelled;
}

static void spec_add(proto_spec_counters *a, const proto_spec_counters *b)
{
    a->n_drafts += b->n_drafts;
    a->n_draft_tokens += b->n_draft_tokens;
    a->n_accepted_tokens += b->n_accepted_tokens;
    for (int i = 0; i < PROTO_SPEC_MAX_POS; i++)
        a->accepted_per_pos[i] += b->accepted_per_pos[i];
}

/* The body of an event (also each entry of a snapshot's "events"). */
static void pk_event(msgpack_packer *pk, const stats_event *ev, int with_header)
{
    msgpack_pack_map(pk, 10 + (with_header ? 2 : 0));
    if (with_header) {
        pk_u64(pk, "schema", STATPUB_SCHEMA);
        pk_str(pk, "type", "event");
    }
    pk_u64(pk, "seq", ev->seq);
    pk_i64(pk, "ts_ms", ev->ts_ms);
    pk_str(pk, "event", ev->type);
    pk_str(pk, "worker", ev->worker);
    pk_role(pk, "role", ev->role);
    pk_role(pk, "old_role", ev->old_role);
    pk_key(pk, "state");
    if (ev->state) {
        const char *st = stats_state_str(ev->state);
        msgpack_pack_str(pk, strlen(st));
        msgpack_pack_str_body(pk, st, strlen(st));
    } else {
        msgpack_pack_nil(pk);
    }
    pk_u64(pk, "rid", ev->rid);
    pk_i64(pk, "status", ev->status); /* request_error: the HTTP status; else 0 */
    pk_str(pk, "reason", ev->reason);
}

// --- the snapshot

typedef struct {
    cluster_worker_info info;
    char id[PROTO_ID_LEN];
    char kvep[PROTO_ENDPOINT_LEN];
} wcopy;

typedef struct {
    wcopy *v;
    int n, cap;
} wlist;

static void copy_worker(const cluster_worker_info *wi, void *ud)
{
    wlist *l = ud;
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 16;
        wcopy *v = realloc(l->v, (size_t)cap * sizeof(*v));
        if (!v)
            return;
        l->v = v;
        l->cap = cap;
    }
    wcopy *w = &l->v[l->n++];
    w->info = *wi;
    snprintf(w->id, sizeof(w->id), "%s", wi->id);
    snprintf(w->kvep, sizeof(w->kvep), "%s", wi->kv_endpoint);
    w->info.id = w->id;
    w->info.kv_endpoint = w->kvep;
}

static void pk_worker(msgpack_packer *pk, const stats_t *stats, const cluster_worker_info *w,
                      int64_t now_us)
{
    stats_worker_figures f;
    stats_get_worker(stats, w->id, now_us, &f);
    int used = w->kv_blocks_total - w->kv_blocks_free;
    msgpack_pack_map(pk, 27);
    pk_str(pk, "id", w->id);
    pk_role(pk, "role", w->role);
    pk_str(pk, "state", stats_state_str(w->state));
    pk_str(pk, "address", w->kv_endpoint);
    pk_i64(pk, "pid", w->pid);
    pk_i64(pk, "running", w->running);
    pk_i64(pk, "queued", w->queued);
    pk_i64(pk, "queued_prompt_tokens", w->queued_prompt_tokens);
    pk_i64(pk, "assigned", w->n_assigned);
    pk_i64(pk, "kv_blocks_total", w->kv_blocks_total);
    pk_i64(pk, "kv_blocks_used", used);
    pk_i64(pk, "kv_blocks_free", w->kv_blocks_free);
    pk_dbl(pk, "kv_usage", w->kv_blocks_total > 0 ? (double)used / w->kv_blocks_total : 0.0);
    pk_u64(pk, "tokens_in_total", w->tokens_in);
    pk_u64(pk, "tokens_out_total", w->tokens_out);
    pk_u64(pk, "prefix_cache_queries_total", w->prefix_cache_queries);
    pk_u64(pk, "prefix_cache_hits_total", w->prefix_cache_hits);
    pk_dbl(pk, "tokens_in_per_s", f.tokens_in_per_s);
    pk_dbl(pk, "tokens_out_per_s", f.tokens_out_per_s);
    pk_pct(pk, "ttft_ms", &f.ttft);
    pk_pct(pk, "tpot_ms", &f.tpot);
    pk_pct(pk, "itl_ms", &f.itl);
    pk_spec(pk, &w->spec);
    pk_key(pk, "kv_transfer");
    msgpack_pack_map(pk, 2);
    pk_kvx(pk, "send", &w->kvx_tx);
    pk_kvx(pk, "recv", &w->kvx_rx);
    pk_dbl(pk, "last_seen_ms", w->last_seen_ms_ago);
    pk_i64(pk, "max_seqs", w->max_seqs);
    pk_u64(pk, "num_preemptions", w->n_preemptions);
}

static void pk_gateway(msgpack_packer *pk, const stats_gateway_figures *g)
{
    pk_key(pk, "gateway");
    msgpack_pack_map(pk, 6);
    pk_dbl(pk, "uptime_s", g->uptime_s);
    pk_i64(pk, "started_ms", g->started_wall_ms);
    pk_key(pk, "requests");
    msgpack_pack_map(pk, 9);
    pk_u64(pk, "received", g->received);
    pk_u64(pk, "finished", g->finished);
    pk_u64(pk, "finished_stop", g->finished_stop);
    pk_u64(pk, "finished_length", g->finished_length);
    pk_u64(pk, "failed", g->failed_total);
    pk_u64(pk, "rejected", g->rejected);
    pk_u64(pk, "cancelled", g->cancelled);
    pk_i64(pk, "queued", g->queued);
    pk_i64(pk, "running", g->running);
    pk_key(pk, "http");
    msgpack_pack_map(pk, 8);
    pk_u64(pk, "2xx", g->http_2xx);
    pk_u64(pk, "4xx", g->http_4xx);
    pk_u64(pk, "5xx", g->http_5xx);
    pk_i64(pk, "connections", g->http_connections);
    pk_u64(pk, "connections_refused", g->http_events[STATS_HTTP_REFUSED]);
    pk_u64(pk, "header_timeouts", g->http_events[STATS_HTTP_HEADER_TIMEOUT]);
    pk_u64(pk, "body_timeouts", g->http_events[STATS_HTTP_BODY_TIMEOUT]);
    pk_u64(pk, "slow_clients", g->http_events[STATS_HTTP_SLOW_CLIENT]);
    pk_u64(pk, "prompt_tokens", g->prompt_tokens);
    pk_u64(pk, "generation_tokens", g->generation_tokens);
}

static void pk_cluster(msgpack_packer *pk, const stats_t *stats, const wlist *l, int64_t now_us)
{
    int by_role[4] = {0}, draining = 0;
    long running = 0, queued = 0, qtok = 0, kv_total = 0, kv_free = 0;
    proto_kvx_counters tx = {0}, rx = {0};
    proto_spec_counters spec = {0};
    uint64_t n_preempt = 0;
    for (int i = 0; i < l->n; i++) {
        const cluster_worker_info *w = &l->v[i].info;
        if (w->state != PROTO_STATE_READY)
            draining++;
        else if (w->role >= 1 && w->role <= 3)
            by_role[w->role]++;
        running += w->running;
        queued += w->queued;
        qtok += w->queued_prompt_tokens;
        kv_total += w->kv_blocks_total;
        kv_free += w->kv_blocks_free;
        kvx_add(&tx, &w->kvx_tx);
        kvx_add(&rx, &w->kvx_rx);
        spec_add(&spec, &w->spec);
        n_preempt += w->n_preemptions;
    }
    stats_worker_figures f;
    stats_get_cluster(stats, now_us, &f);
    pk_key(pk, "cluster");
    msgpack_pack_map(pk, 15);
    pk_key(pk, "workers");
    msgpack_pack_map(pk, 4);
    for (int r = PROTO_ROLE_PREFILL; r <= PROTO_ROLE_MIXED; r++)
        pk_i64(pk, proto_role_str(r), by_role[r]);
    pk_i64(pk, "draining", draining);
    pk_i64(pk, "running", running);
    pk_i64(pk, "queued", queued);
    pk_i64(pk, "queued_prompt_tokens", qtok);
    pk_i64(pk, "kv_blocks_total", kv_total);
    pk_i64(pk, "kv_blocks_used", kv_total - kv_free);
    pk_i64(pk, "kv_blocks_free", kv_free);
    pk_u64(pk, "num_preemptions", n_preempt);
    pk_dbl(pk, "tokens_in_per_s", f.tokens_in_per_s);
    pk_dbl(pk, "tokens_out_per_s", f.tokens_out_per_s);
    pk_pct(pk, "ttft_ms", &f.ttft);
    pk_pct(pk, "tpot_ms", &f.tpot);
    pk_pct(pk, "itl_ms", &f.itl);
    pk_spec(pk, &spec);
    pk_key(pk, "kv_transfer");
    msgpack_pack_map(pk, 2);
    pk_kvx(pk, "send", &tx);
    pk_kvx(pk, "recv", &rx);
}

int statpub_pack_snapshot(statpub_t *p, msgpack_sbuffer *sb, int64_t now_us)
{
    wlist l = {0};
    if (p->cluster)
        cluster_foreach_worker(p->cluster, copy_worker, &l);
    stats_gateway_figures g;
    stats_get_gateway(p->stats, p->cluster, &g);
    msgpack_packer pk;
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 14);
    pk_u64(&pk, "schema", STATPUB_SCHEMA);
    pk_str(&pk, "type", "snapshot");
    pk_u64(&pk, "seq", p->seq);
    pk_u64(&pk, "snapshots_conflated", p->snapshots_conflated);
    pk_u64(&pk, "events_dropped", p->events_dropped);
    pk_u64(&pk, "stall_sends", p->stall_sends);
    pk_u64(&pk, "last_event_seq", p->last_event_seq);
    pk_i64(&pk, "ts_ms", proto_wall_us() / 1000);
    pk_i64(&pk, "interval_ms", p->interval_ms);
    pk_str(&pk, "model", p->model);
    pk_gateway(&pk, &g);
    pk_cluster(&pk, p->stats, &l, now_us);
    pk_key(&pk, "workers");
    msgpack_pack_array(&pk, (size_t)l.n);
    for (int i = 0; i < l.n; i++)
        pk_worker(&pk, p->stats, &l.v[i].info, now_us);
    int n_ev = stats_n_events(p->stats);
    pk_key(&pk, "events");
    msgpack_pack_array(&pk, (size_t)n_ev);
    for (int i = 0; i < n_ev; i++)
        pk_event(&pk, stats_event_at(p->stats, i), 0);
    free(l.v);
    return sb->data ? 0 : -1;
}

// --- sending

/* Read the XPUB's subscription messages (a byte 1 or 0, then the topic) so they do not pile
 * up; count subscribers (subscriptions to "" or to a topic, each once). */
static void read_subscriptions(statpub_t *p)
{
    unsigned char buf[64];
    int n;
    while ((n = zmq_recv(p->sock, buf, sizeof(buf), ZMQ_DONTWAIT)) >= 0) {
        if (n >= 1 && buf[0] == 1)
            p->subscribers++;
        else if (n >= 1 && buf[0] == 0 && p->subscribers > 0)
            p->subscribers--;
    }
}

/* Send [topic, body] without blocking. Returns 0 when it went to every subscriber, -1 when
 * some subscriber's queue is full (EAGAIN: nobody got it; the caller keeps it) or on
 * another error (logged at debug; also kept). */
static int send_one(statpub_t *p, const char *topic, const char *body, size_t len)
{
    if (zmq_send(p->sock, topic, strlen(topic), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
        if (errno != EAGAIN)
            log_debug("stats: %s not published: %s", topic, zmq_strerror(errno));
        return -1;
    }
    /* after the first frame a multipart message goes whole (the high-water mark is checked
     * at its first frame) */
    zmq_send(p->sock, body, len, ZMQ_DONTWAIT);
    p->sent++;
    p->stall_sends += (uint64_t)p->lossy;
    return 0;
}

/* Turn ZMQ_XPUB_NODROP off (lossy 1) or back on (0). */
static void set_lossy(statpub_t *p, int lossy)
{
    int nodrop = !lossy;
    if (zmq_setsockopt(p->sock, ZMQ_XPUB_NODROP, &nodrop, sizeof(nodrop)) == 0)
        p->lossy = lossy;
}

/* Send what waits, oldest first: the queued events, then (snapshot: 1) the due snapshot,
 * packed now so it is the newest state. An event arrives from inside cluster code (stats'
 * sink), which the snapshot must not read half-changed: there the snapshot waits. */
static void send_waiting(statpub_t *p, int snapshot)
{
    while (p->ev_n > 0) {
        msgpack_sbuffer *b = &p->evq[p->ev_head];
        if (send_one(p, "event", b->data, b->size) < 0)
            break;
        msgpack_sbuffer_clear(b);
        p->ev_head = (p->ev_head + 1) % p->ev_cap;
        p->ev_n--;
    }
    if (snapshot && p->ev_n == 0 && p->snapshot_due) {
        msgpack_sbuffer sb;
        msgpack_sbuffer_init(&sb);
        if (statpub_pack_snapshot(p, &sb, proto_now_us()) == 0 &&
            send_one(p, "snapshot", sb.data, sb.size) == 0)
            p->snapshot_due = 0;
        msgpack_sbuffer_destroy(&sb);
    }
}

/* Send what waits to every subscriber; when that has found no room for stall_us, send it
 * past the full ones (lossy), and try every subscriber again at the next flush, so the
 * stall ends as soon as the slow one has room. Arms the retry timer when something is
 * left (the snapshot waits for it when called from the event sink: snapshot 0). */
static void flush(statpub_t *p, int snapshot)
{
    read_subscriptions(p);
    int64_t now = proto_now_us();
    send_waiting(p, snapshot);
    if (p->ev_n == 0 && !(snapshot && p->snapshot_due)) {
        p->waiting_since_us = 0; /* everything reached every subscriber */
        p->stall_logged = 0;
    } else {
        if (p->waiting_since_us == 0)
            p->waiting_since_us = now;
        if (p->stall_us > 0 && now - p->waiting_since_us >= p->stall_us) {
            if (!p->stall_logged)
                log_warn("stats: the socket has been full for %lld ms (a subscriber reads "
                         "too slowly or not at all); sending past it until it has room",
                         (long long)((now - p->waiting_since_us) / 1000));
            p->stall_logged = 1;
            set_lossy(p, 1);
            send_waiting(p, snapshot);
            set_lossy(p, 0);
        }
    }
    if ((p->ev_n > 0 || p->snapshot_due) && !evtimer_pending(p->retry, NULL)) {
        struct timeval tv = {p->retry_ms / 1000, (p->retry_ms % 1000) * 1000};
        evtimer_add(p->retry, &tv);
    }
}

static void on_retry(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    flush(arg, 1);
}

static void on_event(const stats_event *ev, void *ud)
{
    statpub_t *p = ud;
    if (p->ev_n == p->ev_cap) { /* full: the oldest goes (counted; the seq gap shows it) */
        msgpack_sbuffer_clear(&p->evq[p->ev_head]);
        p->ev_head = (p->ev_head + 1) % p->ev_cap;
        p->ev_n--;
        p->events_dropped++;
    }
    msgpack_sbuffer *b = &p->evq[(p->ev_head + p->ev_n) % p->ev_cap];
    msgpack_packer pk;
    msgpack_packer_init(&pk, b, msgpack_sbuffer_write);
    pk_event(&pk, ev, 1);
    if (b->data && b->size) {
        p->ev_n++;
    } else { /* out of memory: lost, and counted as such */
        msgpack_sbuffer_clear(b);
        p->events_dropped++;
    }
    p->last_event_seq = ev->seq;
    flush(p, 0);
}

static void on_tick(evutil_socket_t fd, short what, void *arg)
{
    statpub_t *p = arg;
    (void)fd;
    (void)what;
    stats_sample(p->stats, p->cluster, proto_now_us());
    p->seq++;
    if (p->snapshot_due) /* the previous one never left: this one replaces it */
        p->snapshots_conflated++;
    p->snapshot_due = 1;
    flush(p, 1);
}

statpub_t *statpub_new(struct event_base *base, const statpub_params *prm, stats_t *stats,
                       const cluster_t *c, char *err, size_t errlen)
{
    curve_authlist_t *auth = prm ? prm->curve_auth : NULL; /* ours now */
    if (!base || !prm || !prm->bind || !stats || prm->interval_ms < 10 || prm->sndhwm < 1 ||
        prm->sndbuf < 0 || prm->event_queue < 1 || prm->stall_ms < 0) {
        snprintf(err, errlen, "stats socket: invalid parameters");
        curve_authlist_destroy(&auth);
        return NULL;
    }
    if (!prm->curve != !auth) {
        snprintf(err, errlen, "stats socket: CURVE needs both a key pair and authorized keys");
        curve_authlist_destroy(&auth);
        return NULL;
    }
    statpub_t *p = calloc(1, sizeof(*p));
    if (!p) {
        snprintf(err, errlen, "out of memory");
        curve_authlist_destroy(&auth);
        return NULL;
    }
    p->base = base;
    p->stats = stats;
    p->cluster = c;
    p->interval_ms = prm->interval_ms;
    p->stall_us = (int64_t)prm->stall_ms * 1000;
    /* a tenth of the interval, 10 ms to 100 ms: a full socket is polled this often */
    p->retry_ms = prm->interval_ms / 10;
    if (p->retry_ms < 10)
        p->retry_ms = 10;
    if (p->retry_ms > 100)
        p->retry_ms = 100;
    p->model = strdup(prm->model_name ? prm->model_name : "");
    p->zctx = zmq_ctx_new();
    p->ev_cap = prm->event_queue;
    p->evq = calloc((size_t)p->ev_cap, sizeof(*p->evq));
    if (!p->model || !p->zctx || !p->evq) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    for (int i = 0; i < p->ev_cap; i++)
        msgpack_sbuffer_init(&p->evq[i]);
    if (prm->curve) { /* the handler first: the socket asks it from its first connection */
        char zerr[256];
        p->zap = curve_zap_start(p->zctx, &auth, zerr, sizeof(zerr));
        if (!p->zap) {
            snprintf(err, errlen, "stats socket: %s", zerr);
            goto fail;
        }
    }
    p->sock = zmq_socket(p->zctx, ZMQ_XPUB);
    int linger = 0, hwm = prm->sndhwm, nodrop = 1, sndbuf = prm->sndbuf;
    size_t len = sizeof(p->endpoint);
    if (!p->sock || zmq_setsockopt(p->sock, ZMQ_LINGER, &linger, sizeof(linger)) < 0 ||
        zmq_setsockopt(p->sock, ZMQ_SNDHWM, &hwm, sizeof(hwm)) < 0 ||
        zmq_setsockopt(p->sock, ZMQ_XPUB_NODROP, &nodrop, sizeof(nodrop)) < 0 ||
        (sndbuf > 0 && zmq_setsockopt(p->sock, ZMQ_SNDBUF, &sndbuf, sizeof(sndbuf)) < 0)) {
        snprintf(err, errlen, "stats socket: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (prm->curve && curve_setup_server(p->sock, prm->curve, CURVE_ZAP_DOMAIN_STATS) < 0) {
        snprintf(err, errlen, "cannot make the stats socket a CURVE server: %s",
                 zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (zmq_bind(p->sock, prm->bind) < 0) {
        snprintf(err, errlen, "cannot bind the stats socket to %s: %s", prm->bind,
                 zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (zmq_getsockopt(p->sock, ZMQ_LAST_ENDPOINT, p->endpoint, &len) < 0)
        snprintf(p->endpoint, sizeof(p->endpoint), "%s", prm->bind);
    p->tick = event_new(base, -1, EV_PERSIST, on_tick, p);
    p->retry = evtimer_new(base, on_retry, p);
    struct timeval tv = {prm->interval_ms / 1000, (prm->interval_ms % 1000) * 1000};
    if (!p->tick || !p->retry || event_add(p->tick, &tv) < 0) {
        snprintf(err, errlen, "stats socket: cannot add the timer");
        goto fail;
    }
    stats_set_event_sink(stats, on_event, p);
    return p;
fail:
    curve_authlist_destroy(&auth);
    statpub_destroy(&p);
    return NULL;
}

void statpub_destroy(statpub_t **pp)
{
    if (!pp || !*pp)
        return;
    statpub_t *p = *pp;
    if (p->tick)
        event_free(p->tick);
    if (p->retry)
        event_free(p->retry);
    if (p->stats)
        stats_set_event_sink(p->stats, NULL, NULL);
    if (p->sock)
        zmq_close(p->sock);
    curve_zap_stop(&p->zap); /* before the context, whose termination waits for it */
    if (p->zctx)
        zmq_ctx_term(p->zctx);
    for (int i = 0; p->evq && i < p->ev_cap; i++)
        msgpack_sbuffer_destroy(&p->evq[i]);
    free(p->evq);
    free(p->model);
    free(p);
    *pp = NULL;
}

const char *statpub_endpoint(const statpub_t *p)
{
    return p->endpoint;
}

void statpub_counts(const statpub_t *p, uint64_t *sent, uint64_t *dropped)
{
    *sent = p->sent;
    *dropped = p->events_dropped + p->snapshots_conflated;
}
