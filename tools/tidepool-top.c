/*
 * tidepool-top: a terminal dashboard of a tidepool cluster, fed by the gateway's stats
 * socket (docs/stats.md).
 *
 *   tidepool-top --stats tcp://HOST:5558
 *
 * One row per worker (role, state, load, a KV-cache usage bar, tokens/s in and out, TTFT,
 * TPOT and ITL percentiles over the gateway's window, MTP acceptance), the cluster's totals,
 * the gateway's request counters, and the latest events. Keys: s cycles the sort column,
 * p pauses (the screen freezes, "PAUSED" shows, messages keep being read so the socket
 * never backs up), q quits.
 *
 * Design: one thread. A SUB socket and the terminal are polled together (zmq_poll on the
 * socket and fd 0); every message is decoded with msgpack-c; the newest snapshot is kept
 * (with the buffer it was decoded from) and the screen redrawn from it. Events are kept in
 * a ring, deduplicated by their sequence number, so those a snapshot carries (for a late
 * start) and those that arrive one by one merge into one list. Gaps in the sequence
 * numbers of the snapshots and of the events received one by one are counted and shown
 * with the publisher's own counts (snapshots_conflated, events_dropped): a dashboard that
 * fell behind says so. It reads everything waiting at each wake-up and keeps the newest
 * snapshot (docs/stats.md "Reading it").
 */
#include <errno.h>
#include <math.h>
#include <msgpack.h>
#include <ncurses.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "config.h"
#include "curve.h"
#include "hsmon.h"
#include "log.h"
#include "protocol.h"

#define MAX_EVENTS 64
#define POLL_MS 200
#define MAX_WORKERS 1024
#define HINT_AFTER_S 3.0 /* no snapshot this long after the start: say what may be wrong */

static char *opt_stats, *opt_curve_secret_key, *opt_curve_gateway_key;
static long long opt_events;

static const config_entry_t settings[] = {
    {"stats", CONFIG_STRING, &opt_stats, "tcp://127.0.0.1:5558", 0, 0,
     "the gateway's stats socket to subscribe to"},
    {"events", CONFIG_INT, &opt_events, "8", 0, MAX_EVENTS, "event lines shown at the bottom"},
    {"curve-secret-key", CONFIG_STRING, &opt_curve_secret_key, "", 0, 0,
     "CURVE: this subscriber's key pair file (tidepool-keygen; its public key among the "
     "gateway's --stats-authorized-keys); needs --curve-gateway-key; \"\" = plain"},
    {"curve-gateway-key", CONFIG_STRING, &opt_curve_gateway_key, "", 0, 0,
     "CURVE: the gateway's public key file (its .pub)"},
    {NULL, 0, NULL, NULL, 0, 0, NULL},
};

// --- msgpack access

static const msgpack_object *mp_get(const msgpack_object *map, const char *key)
{
    if (!map || map->type != MSGPACK_OBJECT_MAP)
        return NULL;
    size_t n = strlen(key);
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object *k = &map->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == n &&
            memcmp(k->via.str.ptr, key, n) == 0)
            return &map->via.map.ptr[i].val;
    }
    return NULL;
}

/* A number (NaN when absent, nil or not a number). */
static double mp_num(const msgpack_object *map, const char *key)
{
    const msgpack_object *o = mp_get(map, key);
    if (!o)
        return NAN;
    switch (o->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        return (double)o->via.u64;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        return (double)o->via.i64;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        return o->via.f64;
    default:
        return NAN;
    }
}

/* A sequence number: 1 and *out when key holds a number in [1, 2^64), else 0 (a message is
 * network input: a negative or huge float cast to uint64_t is undefined, and -5 read as
 * 2^64 - 5 hid every later event). */
static int mp_seq(const msgpack_object *map, const char *key, uint64_t *out)
{
    double v = mp_num(map, key);
    if (!(v >= 1 && v < 18446744073709551616.0))
        return 0;
    *out = (uint64_t)v;
    return 1;
}

/* A string copied into buf ("" when absent or not a string). */
static const char *mp_str(const msgpack_object *map, const char *key, char *buf, size_t cap)
{
    const msgpack_object *o = mp_get(map, key);
    buf[0] = 0;
    if (o && o->type == MSGPACK_OBJECT_STR) {
        size_t n = o->via.str.size < cap - 1 ? o->via.str.size : cap - 1;
        memcpy(buf, o->via.str.ptr, n);
        buf[n] = 0;
    }
    return buf;
}

// --- state

typedef struct {
    uint64_t seq;
    char line[512];
} event_line;

typedef struct {
    void *zctx, *sub;
    char *snap_buf; /* the buffer the snapshot was decoded from (strings point into it) */
    msgpack_unpacked snap;
    int have_snap;
    double snap_at; /* monotonic seconds when it arrived */
    event_line events[MAX_EVENTS];
    int ev_head, n_events;
    uint64_t last_ev_seq;
    uint64_t last_snap_seq, last_msg_ev_seq; /* the latest received (0 = none yet) */
    uint64_t snap_gaps, ev_gaps;             /* sequence numbers missed since the start */
    int paused, sort, quit;
    uint64_t n_msgs, n_bad;
    double started_at; /* monotonic seconds at the start */
    int curve;         /* CURVE keys were given */
    hsmon_t *hsmon;    /* handshake failures on the SUB socket (NULL: none watched) */
} top_t;

static const char *sort_names[] = {"id", "role", "load", "kv", "tok/s out", "ttft p99"};
#define N_SORTS 6

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void add_event(top_t *t, const msgpack_object *ev)
{
    uint64_t seq;
    if (!mp_seq(ev, "seq", &seq) || seq <= t->last_ev_seq)
        return;
    t->last_ev_seq = seq;
    char type[32], worker[PROTO_ID_LEN], role[16], state[16], reason[192], when[16];
    mp_str(ev, "event", type, sizeof(type));
    mp_str(ev, "worker", worker, sizeof(worker));
    mp_str(ev, "role", role, sizeof(role));
    mp_str(ev, "state", state, sizeof(state));
    mp_str(ev, "reason", reason, sizeof(reason));
    double ts_ms = mp_num(ev, "ts_ms"); /* [0, year 33658] or now */
    time_t secs = ts_ms >= 0 && ts_ms < 1e15 ? (time_t)(ts_ms / 1000) : time(NULL);
    struct tm tm;
    localtime_r(&secs, &tm);
    strftime(when, sizeof(when), "%H:%M:%S", &tm);
    int i = (t->ev_head + t->n_events) % MAX_EVENTS;
    if (t->n_events == MAX_EVENTS) {
        i = t->ev_head;
        t->ev_head = (t->ev_head + 1) % MAX_EVENTS;
    } else {
        t->n_events++;
    }
    event_line *e = &t->events[i];
    e->seq = seq;
    char detail[64] = "";
    if (strncmp(type, "request_", 8) == 0) {
        double rid = mp_num(ev, "rid"), status = mp_num(ev, "status");
        int n = snprintf(detail, sizeof(detail), "rid=%.0f", isnan(rid) ? 0.0 : rid);
        /* n is the untruncated length: a rid of 300 digits (the message is network input)
         * put " status" past the buffer */
        if (status > 0 && n >= 0 && (size_t)n < sizeof(detail))
            snprintf(detail + n, sizeof(detail) - (size_t)n, " status=%.0f", status);
    } else if (role[0]) {
        snprintf(detail, sizeof(detail), "(%s)%s%s", role,
                 strcmp(type, "worker_state") == 0 ? " -> " : "",
                 strcmp(type, "worker_state") == 0 ? state : "");
    }
    snprintf(e->line, sizeof(e->line), "%s  %-13s %s%s%s%s%s", when, type, worker,
             worker[0] && detail[0] ? " " : "", detail, reason[0] ? ": " : "", reason);
}

/* Decode one message. Returns 1 when the screen needs a redraw. */
static int on_message(top_t *t, const char *topic, size_t topic_len, const char *body, size_t len)
{
    t->n_msgs++;
    char *copy = malloc(len ? len : 1);
    if (!copy)
        return 0;
    memcpy(copy, body, len);
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    if (msgpack_unpack_next(&up, copy, len, &off) != MSGPACK_UNPACK_SUCCESS ||
        up.data.type != MSGPACK_OBJECT_MAP || mp_num(&up.data, "schema") != 1) {
        t->n_bad++;
        msgpack_unpacked_destroy(&up);
        free(copy);
        return 0;
    }
    uint64_t seq;
    int is_event = topic_len == 5 && memcmp(topic, "event", 5) == 0;
    uint64_t *last = is_event ? &t->last_msg_ev_seq : &t->last_snap_seq;
    if (mp_seq(&up.data, "seq", &seq)) { /* gaps: messages the publisher conflated or dropped */
        if (*last && seq > *last + 1)
            *(is_event ? &t->ev_gaps : &t->snap_gaps) += seq - *last - 1;
        if (seq > *last)
            *last = seq;
    }
    if (is_event) {
        add_event(t, &up.data);
        msgpack_unpacked_destroy(&up);
        free(copy);
        return !t->paused;
    }
    if (!(topic_len == 8 && memcmp(topic, "snapshot", 8) == 0)) {
        msgpack_unpacked_destroy(&up);
        free(copy);
        return 0;
    }
    const msgpack_object *evs = mp_get(&up.data, "events");
    if (evs && evs->type == MSGPACK_OBJECT_ARRAY)
        for (uint32_t i = 0; i < evs->via.array.size; i++)
            add_event(t, &evs->via.array.ptr[i]);
    if (t->paused) { /* keep what is on screen */
        msgpack_unpacked_destroy(&up);
        free(copy);
        return 0;
    }
    if (t->have_snap) {
        msgpack_unpacked_destroy(&t->snap);
        free(t->snap_buf);
    }
    t->snap = up;
    t->snap_buf = copy;
    t->have_snap = 1;
    t->snap_at = mono_s();
    return 1;
}

/* Receive every pending message. Returns 1 when a redraw is due. */
static int drain(top_t *t)
{
    int dirty = 0;
    for (int k = 0; k < 1000; k++) {
        zmq_msg_t topic, body;
        zmq_msg_init(&topic);
        if (zmq_msg_recv(&topic, t->sub, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&topic);
            break;
        }
        int more = zmq_msg_more(&topic);
        zmq_msg_init(&body);
        if (!more || zmq_msg_recv(&body, t->sub, 0) < 0) {
            t->n_bad++;
            zmq_msg_close(&topic);
            zmq_msg_close(&body);
            continue;
        }
        while (zmq_msg_more(&body)) { /* a longer message than ours: skip the rest */
            zmq_msg_t extra;
            zmq_msg_init(&extra);
            zmq_msg_recv(&extra, t->sub, 0);
            zmq_msg_close(&extra);
        }
        dirty |= on_message(t, zmq_msg_data(&topic), zmq_msg_size(&topic), zmq_msg_data(&body),
                            zmq_msg_size(&body));
        zmq_msg_close(&topic);
        zmq_msg_close(&body);
    }
    return dirty;
}

// --- drawing

static int color_ok;

static void fmt_num(char *buf, size_t cap, double v, const char *fmt)
{
    if (isnan(v))
        snprintf(buf, cap, "-");
    else
        snprintf(buf, cap, fmt, v);
}

/* "p50/p90/p99" in ms of a percentile map; "-" parts when empty. */
static void fmt_pct(char *buf, size_t cap, const msgpack_object *m, const char *key)
{
    const msgpack_object *p = mp_get(m, key);
    char a[16], b[16], c[16];
    fmt_num(a, sizeof(a), mp_num(p, "p50"), "%.1f");
    fmt_num(b, sizeof(b), mp_num(p, "p90"), "%.1f");
    fmt_num(c, sizeof(c), mp_num(p, "p99"), "%.1f");
    snprintf(buf, cap, "%s/%s/%s", a, b, c);
}

static void draw_bar(int y, int x, double frac, int width)
{
    if (isnan(frac) || frac < 0)
        frac = 0;
    if (frac > 1)
        frac = 1;
    int n = (int)lround(frac * width);
    int pair = frac < 0.7 ? 1 : frac < 0.9 ? 2 : 3;
    mvaddch(y, x, '[');
    if (color_ok)
        attron(COLOR_PAIR(pair));
    for (int i = 0; i < width; i++)
        mvaddch(y, x + 1 + i, i < n ? '#' : '.');
    if (color_ok)
        attroff(COLOR_PAIR(pair));
    mvaddch(y, x + 1 + width, ']');
}

static const msgpack_object *sort_workers_base;
static int sort_key;

static double worker_sort_value(const msgpack_object *w)
{
    switch (sort_key) {
    case 2:
        return mp_num(w, "running") + mp_num(w, "queued");
    case 3:
        return mp_num(w, "kv_usage");
    case 4:
        return mp_num(w, "tokens_out_per_s");
    case 5:
        return mp_num(mp_get(w, "ttft_ms"), "p99");
    }
    return 0;
}

static int cmp_workers(const void *a, const void *b)
{
    const msgpack_object *wa = &sort_workers_base[*(const int *)a];
    const msgpack_object *wb = &sort_workers_base[*(const int *)b];
    char sa[PROTO_ID_LEN], sb[PROTO_ID_LEN];
    if (sort_key == 0 || sort_key == 1) {
        int c = strcmp(mp_str(wa, sort_key ? "role" : "id", sa, sizeof(sa)),
                       mp_str(wb, sort_key ? "role" : "id", sb, sizeof(sb)));
        if (c)
            return c;
        return strcmp(mp_str(wa, "id", sa, sizeof(sa)), mp_str(wb, "id", sb, sizeof(sb)));
    }
    double va = worker_sort_value(wa), vb = worker_sort_value(wb);
    if (isnan(va))
        va = -1;
    if (isnan(vb))
        vb = -1;
    if (va != vb)
        return va < vb ? 1 : -1; /* largest first */
    return strcmp(mp_str(wa, "id", sa, sizeof(sa)), mp_str(wb, "id", sb, sizeof(sb)));
}

static void draw(top_t *t)
{
    erase();
    int rows = LINES, cols = COLS, y = 0;
    char buf[512];
    attron(A_REVERSE);
    mvhline(0, 0, ' ', cols);
    snprintf(buf, sizeof(buf), " tidepool-top  %s", opt_stats);
    mvaddnstr(0, 0, buf, cols);
    if (t->have_snap) {
        const msgpack_object *s = &t->snap.data;
        char model[128];
        double up = mp_num(mp_get(s, "gateway"), "uptime_s");
        if (!(up >= 0 && up < 1e9)) /* absent, or no sane uptime: (int) of it is undefined */
            up = 0;
        snprintf(buf, sizeof(buf), "model %s  up %02d:%02d:%02d  snapshot #%.0f",
                 mp_str(s, "model", model, sizeof(model)), (int)(up / 3600), (int)fmod(up / 60, 60),
                 (int)fmod(up, 60), mp_num(s, "seq"));
        int x = cols - (int)strlen(buf) - 1 - (t->paused ? 10 : 0);
        if (x > 40)
            mvaddnstr(0, x, buf, cols - x);
    }
    if (t->paused) {
        attron(A_BOLD);
        mvaddnstr(0, cols - 9 > 0 ? cols - 9 : 0, " PAUSED ", 8);
        attroff(A_BOLD);
    }
    attroff(A_REVERSE);
    y = 2;
    if (!t->have_snap) {
        snprintf(buf, sizeof(buf), "waiting for snapshots on %s ...", opt_stats);
        mvaddnstr(y++, 1, buf, cols - 1);
        double waited = mono_s() - t->started_at;
        if (waited >= HINT_AFTER_S) {
            char why[320];
            y++;
            snprintf(buf, sizeof(buf), "nothing received in %.0f s; likely causes:", waited);
            mvaddnstr(y++, 1, buf, cols - 1);
            if (t->hsmon && hsmon_last_failure(t->hsmon, why, sizeof(why))) {
                attron(A_BOLD);
                snprintf(buf, sizeof(buf), "- %s", why);
                mvaddnstr(y++, 1, buf, cols - 1);
                attroff(A_BOLD);
            }
            static const char *plain[] = {
                "- the gateway's stats socket uses CURVE (it has --curve-secret-key): give "
                "--curve-secret-key (this subscriber's key pair)",
                "  and --curve-gateway-key (the gateway's .pub), the public key among the "
                "gateway's --stats-authorized-keys;",
                NULL};
            static const char *curve[] = {
                "- this key is not among the gateway's --stats-authorized-keys (else its "
                "--curve-authorized-keys), or",
                "  --curve-gateway-key is not the gateway's public key, or its stats socket "
                "does not use CURVE;",
                NULL};
            for (const char **l = t->curve ? curve : plain; *l; l++)
                mvaddnstr(y++, 1, *l, cols - 1);
            snprintf(buf, sizeof(buf), "- the wrong endpoint: --stats must be the gateway's "
                     "--stats-bind (default tcp://127.0.0.1:5558; \"\" there = off), "
                     "reachable from here;");
            mvaddnstr(y++, 1, buf, cols - 1);
            mvaddnstr(y++, 1, "- no gateway running there yet.", cols - 1);
        }
    } else {
        const msgpack_object *s = &t->snap.data;
        const msgpack_object *g = mp_get(s, "gateway"), *rq = mp_get(g, "requests");
        const msgpack_object *http = mp_get(g, "http"), *c = mp_get(s, "cluster");
        const msgpack_object *cw = mp_get(c, "workers");
        double age = mono_s() - t->snap_at, interval = mp_num(s, "interval_ms") / 1000.0;
        snprintf(buf, sizeof(buf),
                 "requests  received %.0f  finished %.0f  failed %.0f  cancelled %.0f  "
                 "queued %.0f  running %.0f   http 4xx %.0f  5xx %.0f   tokens in %.0f  out %.0f",
                 mp_num(rq, "received"), mp_num(rq, "finished"), mp_num(rq, "failed"),
                 mp_num(rq, "cancelled"), mp_num(rq, "queued"), mp_num(rq, "running"),
                 mp_num(http, "4xx"), mp_num(http, "5xx"), mp_num(g, "prompt_tokens"),
                 mp_num(g, "generation_tokens"));
        mvaddnstr(y++, 1, buf, cols - 1);
        char ttft[48], tpot[48], itl[48];
        fmt_pct(ttft, sizeof(ttft), c, "ttft_ms");
        fmt_pct(tpot, sizeof(tpot), c, "tpot_ms");
        fmt_pct(itl, sizeof(itl), c, "itl_ms");
        snprintf(buf, sizeof(buf),
                 "cluster   %.0f prefill  %.0f decode  %.0f mixed  %.0f draining   tok/s in %.0f  "
                 "out %.0f   TTFT %s  TPOT %s  ITL %s ms (p50/p90/p99)",
                 mp_num(cw, "prefill"), mp_num(cw, "decode"), mp_num(cw, "mixed"),
                 mp_num(cw, "draining"), mp_num(c, "tokens_in_per_s"),
                 mp_num(c, "tokens_out_per_s"), ttft, tpot, itl);
        mvaddnstr(y++, 1, buf, cols - 1);
        double used = mp_num(c, "kv_blocks_used"), total = mp_num(c, "kv_blocks_total");
        mvaddnstr(y, 1, "KV cache ", cols - 1);
        draw_bar(y, 10, total > 0 ? used / total : 0, 30);
        snprintf(buf, sizeof(buf),
                 " %.0f/%.0f blocks   kv transfers %.0f  (rejects %.0f, "
                 "timeouts %.0f, aborts %.0f)%s",
                 used, total, mp_num(mp_get(mp_get(c, "kv_transfer"), "recv"), "transfers"),
                 mp_num(mp_get(mp_get(c, "kv_transfer"), "recv"), "rejects"),
                 mp_num(mp_get(mp_get(c, "kv_transfer"), "recv"), "timeouts"),
                 mp_num(mp_get(mp_get(c, "kv_transfer"), "recv"), "aborts"),
                 age > 3 * interval + 1 ? "   (stale)" : "");
        mvaddnstr(y++, 42, buf, cols - 43 > 0 ? cols - 43 : 0);
        double conflated = mp_num(s, "snapshots_conflated"), dropped = mp_num(s, "events_dropped");
        if (t->snap_gaps || t->ev_gaps || conflated > 0 || dropped > 0) {
            if (color_ok)
                attron(COLOR_PAIR(2));
            snprintf(buf, sizeof(buf),
                     "behind    missed %llu snapshots, %llu events   (publisher: %.0f snapshots "
                     "conflated, %.0f events dropped, for its slowest subscriber)",
                     (unsigned long long)t->snap_gaps, (unsigned long long)t->ev_gaps,
                     isnan(conflated) ? 0.0 : conflated, isnan(dropped) ? 0.0 : dropped);
            mvaddnstr(y++, 1, buf, cols - 1);
            if (color_ok)
                attroff(COLOR_PAIR(2));
        }
        y++;

        // workers
        attron(A_BOLD | A_UNDERLINE);
        snprintf(buf, sizeof(buf),
                 "%-20s %-7s %-8s %4s %4s %6s %-20s %8s %8s %-20s %-20s %-20s %5s", "WORKER",
                 "ROLE", "STATE", "RUN", "QUE", "QTOK", "KV", "IN/s", "OUT/s", "TTFT ms p50/90/99",
                 "TPOT ms p50/90/99", "ITL ms p50/90/99", "ACC");
        mvhline(y, 0, ' ', cols);
        mvaddnstr(y++, 1, buf, cols - 1);
        attroff(A_BOLD | A_UNDERLINE);
        const msgpack_object *ws = mp_get(s, "workers");
        int n = ws && ws->type == MSGPACK_OBJECT_ARRAY ? (int)ws->via.array.size : 0;
        if (n > MAX_WORKERS)
            n = MAX_WORKERS;
        static int order[MAX_WORKERS];
        for (int i = 0; i < n; i++)
            order[i] = i;
        sort_workers_base = n ? ws->via.array.ptr : NULL;
        sort_key = t->sort;
        qsort(order, (size_t)n, sizeof(int), cmp_workers);
        int room = rows - y - 3 - (int)opt_events;
        for (int k = 0; k < n && k < (room > 1 ? room : 1); k++) {
            const msgpack_object *w = &ws->via.array.ptr[order[k]];
            char id[PROTO_ID_LEN], role[16], state[16], in[16], out[16], acc[16];
            fmt_pct(ttft, sizeof(ttft), w, "ttft_ms");
            fmt_pct(tpot, sizeof(tpot), w, "tpot_ms");
            fmt_pct(itl, sizeof(itl), w, "itl_ms");
            fmt_num(in, sizeof(in), mp_num(w, "tokens_in_per_s"), "%.0f");
            fmt_num(out, sizeof(out), mp_num(w, "tokens_out_per_s"), "%.0f");
            fmt_num(acc, sizeof(acc), mp_num(mp_get(w, "spec"), "mean_acceptance_length"), "%.2f");
            snprintf(buf, sizeof(buf), "%-20.20s %-7s %-8s %4.0f %4.0f %6.0f",
                     mp_str(w, "id", id, sizeof(id)), mp_str(w, "role", role, sizeof(role)),
                     mp_str(w, "state", state, sizeof(state)), mp_num(w, "running"),
                     mp_num(w, "queued"), mp_num(w, "queued_prompt_tokens"));
            mvaddnstr(y, 1, buf, cols - 1);
            double kv = mp_num(w, "kv_usage");
            /* columns as in the heading: KV at 56 (bar and percentage), the rest at 77 */
            if (cols > 76) {
                draw_bar(y, 56, kv, 12);
                snprintf(buf, sizeof(buf), "%4.0f%%", isnan(kv) ? 0.0 : kv * 100);
                mvaddnstr(y, 71, buf, cols - 71);
            }
            snprintf(buf, sizeof(buf), "%8s %8s %-20s %-20s %-20s %5s", in, out, ttft, tpot, itl,
                     acc);
            if (cols > 77)
                mvaddnstr(y, 77, buf, cols - 77);
            y++;
        }
        if (n == 0)
            mvaddnstr(y++, 1, "(no workers registered)", cols - 1);
    }

    // events
    int ev_y = rows - 2 - (int)opt_events;
    if (ev_y < y + 1)
        ev_y = y + 1;
    attron(A_BOLD);
    mvaddnstr(ev_y++, 1, "EVENTS", cols - 1);
    attroff(A_BOLD);
    int shown = t->n_events < opt_events ? t->n_events : (int)opt_events;
    for (int i = t->n_events - shown; i < t->n_events && ev_y < rows - 1; i++)
        mvaddnstr(ev_y++, 1, t->events[(t->ev_head + i) % MAX_EVENTS].line, cols - 1);

    attron(A_REVERSE);
    mvhline(rows - 1, 0, ' ', cols);
    snprintf(buf, sizeof(buf), " s: sort (by %s)   p: %s   q: quit", sort_names[t->sort],
             t->paused ? "resume" : "pause");
    mvaddnstr(rows - 1, 0, buf, cols);
    attroff(A_REVERSE);
    refresh();
}

// --- main

int main(int argc, char **argv)
{
    int rc = config_load(settings, "tidepool-top", argc, argv);
    if (rc != 0)
        return rc > 0 ? 0 : 2;
    log_init("tidepool-top", LOG_LEVEL_WARN);
    curve_keypair me, gw;
    int curve_on = opt_curve_secret_key[0] || opt_curve_gateway_key[0];
    if (curve_on) {
        char err[512];
        if (!opt_curve_secret_key[0] || !opt_curve_gateway_key[0]) {
            snprintf(err, sizeof(err), "CURVE needs both --curve-secret-key and "
                                       "--curve-gateway-key");
        } else if (curve_key_load(opt_curve_secret_key, 1, &me, err, sizeof(err)) == 0 &&
                   curve_key_load(opt_curve_gateway_key, 0, &gw, err, sizeof(err)) == 0) {
            err[0] = 0;
        }
        if (err[0]) {
            fprintf(stderr, "tidepool-top: %s\n", err);
            config_free(settings);
            return 2;
        }
    }
    top_t t;
    memset(&t, 0, sizeof(t));
    t.zctx = zmq_ctx_new();
    t.sub = t.zctx ? zmq_socket(t.zctx, ZMQ_SUB) : NULL;
    /* a small queue: what waits is old; the publisher conflates snapshots for us */
    int linger = 0, hwm = 16;
    t.curve = curve_on;
    t.started_at = mono_s();
    /* the handshake monitor's findings go on the screen (a log line would garble it) */
    log_init("tidepool-top", LOG_LEVEL_ERROR);
    char herr[256];
    if (t.sub && !(t.hsmon = hsmon_start(t.zctx, t.sub, HSMON_CLIENT, curve_on, "stats", herr,
                                         sizeof(herr))))
        fprintf(stderr, "tidepool-top: %s (going on without it)\n", herr);
    if (!t.sub || (curve_on && curve_setup_client(t.sub, &me, gw.public_z85) < 0) ||
        zmq_setsockopt(t.sub, ZMQ_SUBSCRIBE, "", 0) < 0 ||
        zmq_setsockopt(t.sub, ZMQ_LINGER, &linger, sizeof(linger)) < 0 ||
        zmq_setsockopt(t.sub, ZMQ_RCVHWM, &hwm, sizeof(hwm)) < 0 ||
        zmq_connect(t.sub, opt_stats) < 0) {
        fprintf(stderr, "tidepool-top: cannot subscribe to %s: %s\n", opt_stats,
                zmq_strerror(zmq_errno()));
        hsmon_stop(&t.hsmon);
        if (t.sub)
            zmq_close(t.sub);
        if (t.zctx)
            zmq_ctx_term(t.zctx);
        config_free(settings);
        return 1;
    }
    initscr();
    cbreak();
    noecho();
    keypad(stdscr, TRUE);
    nodelay(stdscr, TRUE);
    curs_set(0);
    if (has_colors()) {
        start_color();
        use_default_colors();
        init_pair(1, COLOR_GREEN, -1);
        init_pair(2, COLOR_YELLOW, -1);
        init_pair(3, COLOR_RED, -1);
        color_ok = 1;
    }
    draw(&t);
    double last_draw = mono_s();
    while (!t.quit) {
        zmq_pollitem_t items[2] = {{t.sub, 0, ZMQ_POLLIN, 0}, {NULL, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(items, 2, POLL_MS) < 0 && zmq_errno() != EINTR)
            break;
        int dirty = drain(&t);
        int ch;
        while ((ch = getch()) != ERR) {
            if (ch == 'q' || ch == 'Q') {
                t.quit = 1;
            } else if (ch == 'p' || ch == 'P' || ch == ' ') {
                t.paused = !t.paused;
                dirty = 1;
            } else if (ch == 's' || ch == 'S') {
                t.sort = (t.sort + 1) % N_SORTS;
                dirty = 1;
            } else if (ch == KEY_RESIZE) {
                dirty = 1;
            }
        }
        /* redraw on news, and every second anyway (staleness) unless paused */
        if (!t.quit && (dirty || (!t.paused && mono_s() - last_draw > 1.0))) {
            draw(&t);
            last_draw = mono_s();
        }
    }
    endwin();
    if (t.have_snap) {
        msgpack_unpacked_destroy(&t.snap);
        free(t.snap_buf);
    }
    hsmon_stop(&t.hsmon);
    zmq_close(t.sub);
    zmq_ctx_term(t.zctx);
    config_free(settings);
    return 0;
}
