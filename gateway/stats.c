/* stats: see stats.h.
 *
 * Per-worker state (latency windows, counter samples for rates) sits in a small array of
 * entries found by id (a cluster has few workers; lookups are linear). Request-level
 * histograms and counters are fixed members. The Prometheus exposition is prometheus.c's; it
 * reads the figures through the accessors at the end of this file. */
#include "stats.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "metrics.h"

#define WIN_SLOTS 12         /* percentile window in 12 slots (5 s each for 60 s) */
#define RATE_SAMPLES 8       /* token-counter samples kept per worker */
#define RATE_SPAN_US 5000000 /* rates over at most the last 5 s of samples */

enum {
    H_TTFT,
    H_ITL,
    H_TPOT,
    H_E2E,
    H_QUEUE,
    H_PREFILL,
    H_DECODE,
    H_FIRST_STEP,
    H_XFER_S,
    H_XFER_BYTES,
    H_N
};

static const struct {
    const char *name;
    metrics_bucket_set_t set;
    const char *help;
} hist_defs[H_N] = {
    [H_TTFT] = {"time_to_first_token_seconds", METRICS_BUCKETS_TTFT,
                "Histogram of time to first token in seconds (gateway admission to the first "
                "token at the gateway)."},
    [H_ITL] = {"inter_token_latency_seconds", METRICS_BUCKETS_ITL,
               "Histogram of inter-token latency in seconds (between token messages of a "
               "request at the gateway)."},
    [H_TPOT] = {"request_time_per_output_token_seconds", METRICS_BUCKETS_ITL,
                "Histogram of time per output token in seconds, per request: (last token - "
                "first token) / (output tokens - 1)."},
    [H_E2E] = {"e2e_request_latency_seconds", METRICS_BUCKETS_REQUEST,
               "Histogram of e2e request latency in seconds (admission to the end)."},
    [H_QUEUE] = {"request_queue_time_seconds", METRICS_BUCKETS_REQUEST,
                 "Histogram of time spent waiting in seconds: the gateway's queue (admission "
                 "to PREFILL sent) plus the prefill worker's queue."},
    [H_PREFILL] = {"request_prefill_time_seconds", METRICS_BUCKETS_REQUEST,
                   "Histogram of time spent in prefill in seconds (the prefill worker's batch "
                   "start to its first token)."},
    [H_DECODE] = {"request_decode_time_seconds", METRICS_BUCKETS_REQUEST,
                  "Histogram of time spent in decode in seconds (first to last token at the "
                  "gateway)."},
    [H_FIRST_STEP] = {"request_first_decode_step_seconds", METRICS_BUCKETS_TTFT,
                      "Histogram of the first decode step in seconds (the decode worker: "
                      "sequence ready to its first decoded token)."},
    [H_XFER_S] = {"kv_transfer_seconds", METRICS_BUCKETS_TTFT,
                  "Histogram of KV transfer time in seconds (the decode worker: KV_BEGIN "
                  "accepted to the transfer verified)."},
    [H_XFER_BYTES] = {"kv_transfer_bytes", METRICS_BUCKETS_BYTES,
                      "Histogram of KV bytes transferred per request."},
};

typedef struct {
    int64_t t_us;
    uint64_t in, out;
} rate_sample;

typedef struct {
    char id[PROTO_ID_LEN];
    metrics_window *ttft, *tpot, *itl;
    rate_sample samples[RATE_SAMPLES]; /* ring, oldest at head */
    int head, n_samples;
    int64_t last_seen_us; /* alive in the cluster, or observed */
} stats_worker;

struct stats {
    char *model;
    int window_s;
    int64_t start_us, start_wall_ms;
    metrics_histogram hist[H_N];
    metrics_window *ttft, *tpot, *itl; /* every request */
    uint64_t received, rejected, finished_stop, finished_length, failed, cancelled;
    uint64_t prompt_tokens, generation_tokens;
    uint64_t offline_generation_tokens, offline_preemptions;
    uint64_t http_status[600]; /* by status code (100..599) */
    uint64_t http_events[STATS_HTTP_N];
    int http_connections;
    stats_worker **workers;
    int n_workers, cap_workers;
    stats_event events[STATS_MAX_EVENTS]; /* ring */
    int ev_head, n_events;
    uint64_t ev_seq;
    void (*sink)(const stats_event *ev, void *ud);
    void *sink_ud;
};

stats_params stats_default_params(void)
{
    stats_params p = {.model_name = "tidepool", .window_s = 60};
    return p;
}

const char *stats_state_str(int state)
{
    return state == PROTO_STATE_READY      ? "ready"
           : state == PROTO_STATE_DRAINING ? "draining"
           : state == PROTO_STATE_CHANGING ? "changing"
                                           : "?";
}

static metrics_window *new_window(int window_s)
{
    return metrics_window_new(window_s, window_s >= WIN_SLOTS ? WIN_SLOTS : window_s);
}

stats_t *stats_new(const stats_params *p)
{
    if (!p || p->window_s < 1 || !p->model_name)
        return NULL;
    stats_t *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->model = strdup(p->model_name);
    s->window_s = p->window_s;
    s->start_us = proto_now_us();
    s->start_wall_ms = proto_wall_us() / 1000;
    for (int i = 0; i < H_N; i++)
        metrics_histogram_init_set(&s->hist[i], hist_defs[i].set);
    s->ttft = new_window(p->window_s);
    s->tpot = new_window(p->window_s);
    s->itl = new_window(p->window_s);
    if (!s->model || !s->ttft || !s->tpot || !s->itl) {
        stats_destroy(&s);
        return NULL;
    }
    return s;
}

static void worker_free(stats_worker *w)
{
    metrics_window_destroy(&w->ttft);
    metrics_window_destroy(&w->tpot);
    metrics_window_destroy(&w->itl);
    free(w);
}

void stats_destroy(stats_t **ps)
{
    if (!ps || !*ps)
        return;
    stats_t *s = *ps;
    for (int i = 0; i < s->n_workers; i++)
        worker_free(s->workers[i]);
    free(s->workers);
    metrics_window_destroy(&s->ttft);
    metrics_window_destroy(&s->tpot);
    metrics_window_destroy(&s->itl);
    free(s->model);
    free(s);
    *ps = NULL;
}

static stats_worker *worker_find(const stats_t *s, const char *id)
{
    for (int i = 0; i < s->n_workers; i++)
        if (strcmp(s->workers[i]->id, id) == 0)
            return s->workers[i];
    return NULL;
}

/* The entry of worker id, created on first use; NULL for "" or out of memory. */
static stats_worker *worker_get(stats_t *s, const char *id, int64_t now_us)
{
    if (!id || !id[0])
        return NULL;
    stats_worker *w = worker_find(s, id);
    if (w) {
        w->last_seen_us = now_us;
        return w;
    }
    if (s->n_workers == s->cap_workers) {
        int cap = s->cap_workers ? s->cap_workers * 2 : 8;
        stats_worker **v = realloc(s->workers, (size_t)cap * sizeof(*v));
        if (!v)
            return NULL;
        s->workers = v;
        s->cap_workers = cap;
    }
    w = calloc(1, sizeof(*w));
    if (!w)
        return NULL;
    snprintf(w->id, sizeof(w->id), "%s", id);
    w->ttft = new_window(s->window_s);
    w->tpot = new_window(s->window_s);
    w->itl = new_window(s->window_s);
    if (!w->ttft || !w->tpot || !w->itl) {
        worker_free(w);
        return NULL;
    }
    w->last_seen_us = now_us;
    s->workers[s->n_workers++] = w;
    return w;
}

// --- HTTP and requests

void stats_http_response(stats_t *s, int status)
{
    if (status >= 100 && status < 600)
        s->http_status[status]++;
}

void stats_http_event(stats_t *s, stats_http_event_t e)
{
    if ((unsigned)e < STATS_HTTP_N)
        s->http_events[e]++;
}

void stats_http_connections(stats_t *s, int n_open)
{
    s->http_connections = n_open;
}

void stats_request_received(stats_t *s)
{
    s->received++;
}

void stats_request_rejected(stats_t *s)
{
    s->rejected++;
}

void stats_first_token(stats_t *s, const cluster_req_timing *t, int64_t now_us)
{
    double ttft = (double)(now_us - t->admit_us) / 1e6;
    metrics_histogram_observe(&s->hist[H_TTFT], ttft);
    metrics_window_observe(s->ttft, ttft, now_us);
    stats_worker *w = worker_get(s, t->prefill_worker, now_us);
    if (w)
        metrics_window_observe(w->ttft, ttft, now_us);
}

void stats_tokens(stats_t *s, const cluster_req_timing *t, double itl_s, int64_t now_us)
{
    metrics_histogram_observe(&s->hist[H_ITL], itl_s);
    metrics_window_observe(s->itl, itl_s, now_us);
    stats_worker *w = worker_get(s, t->decode_worker, now_us);
    if (w)
        metrics_window_observe(w->itl, itl_s, now_us);
}

void stats_breakdown_of(const stats_request *r, stats_breakdown *out)
{
    const cluster_req_timing *t = r->timing;
    out->queue_ms = out->prefill_ms = out->transfer_ms = out->first_decode_ms = -1;
    out->ttft_ms = out->e2e_ms = -1;
    if (!t)
        return;
    if (t->dispatch_us)
        out->queue_ms = (double)(t->dispatch_us - t->admit_us + t->worker_queue_us) / 1000.0;
    if (t->prefill_us)
        out->prefill_ms = (double)t->prefill_us / 1000.0;
    if (t->xfer_us)
        out->transfer_ms = (double)t->xfer_us / 1000.0;
    if (t->step_us)
        out->first_decode_ms = (double)t->step_us / 1000.0;
    if (r->t_first_us)
        out->ttft_ms = (double)(r->t_first_us - t->admit_us) / 1000.0;
    if (r->t_end_us)
        out->e2e_ms = (double)(r->t_end_us - t->admit_us) / 1000.0;
}

static void push_event(stats_t *s, stats_event *ev)
{
    ev->seq = ++s->ev_seq;
    ev->ts_ms = proto_wall_us() / 1000;
    int i = (s->ev_head + s->n_events) % STATS_MAX_EVENTS;
    if (s->n_events == STATS_MAX_EVENTS) {
        i = s->ev_head;
        s->ev_head = (s->ev_head + 1) % STATS_MAX_EVENTS;
    } else {
        s->n_events++;
    }
    s->events[i] = *ev;
    if (s->sink)
        s->sink(&s->events[i], s->sink_ud);
}

void stats_request_end(stats_t *s, const stats_request *r, stats_breakdown *out)
{
    stats_breakdown b;
    stats_breakdown_of(r, &b);
    if (out)
        *out = b;
    if (r->how == STATS_END_FINISHED || r->t_first_us) {
        s->prompt_tokens += (uint64_t)(r->n_prompt > 0 ? r->n_prompt : 0);
        s->generation_tokens += (uint64_t)(r->n_output > 0 ? r->n_output : 0);
        if (r->offline)
            s->offline_generation_tokens += (uint64_t)(r->n_output > 0 ? r->n_output : 0);
    }
    if (r->how == STATS_END_CANCELLED) {
        s->cancelled++;
        return;
    }
    if (r->how == STATS_END_FAILED) {
        s->failed++;
        stats_event ev = {.type = "request_error", .rid = r->rid, .status = r->status};
        if (r->timing) {
            snprintf(ev.worker, sizeof(ev.worker), "%s", r->timing->decode_worker);
        }
        snprintf(ev.reason, sizeof(ev.reason), "%s", r->error ? r->error : "");
        push_event(s, &ev);
        return;
    }
    if (r->finish_reason && strcmp(r->finish_reason, "stop") == 0)
        s->finished_stop++;
    else
        s->finished_length++;
    if (r->offline) /* its waits are by design: keep the online latency figures clean */
        return;
    const cluster_req_timing *t = r->timing;
    int64_t now = r->t_end_us ? r->t_end_us : proto_now_us();
    if (b.e2e_ms >= 0)
        metrics_histogram_observe(&s->hist[H_E2E], b.e2e_ms / 1000.0);
    if (b.queue_ms >= 0)
        metrics_histogram_observe(&s->hist[H_QUEUE], b.queue_ms / 1000.0);
    if (b.prefill_ms >= 0)
        metrics_histogram_observe(&s->hist[H_PREFILL], b.prefill_ms / 1000.0);
    if (b.first_decode_ms >= 0)
        metrics_histogram_observe(&s->hist[H_FIRST_STEP], b.first_decode_ms / 1000.0);
    if (b.transfer_ms >= 0) {
        metrics_histogram_observe(&s->hist[H_XFER_S], b.transfer_ms / 1000.0);
        metrics_histogram_observe(&s->hist[H_XFER_BYTES], (double)t->xfer_bytes);
    }
    if (r->t_first_us) {
        int64_t last = r->t_last_us ? r->t_last_us : r->t_first_us;
        metrics_histogram_observe(&s->hist[H_DECODE], (double)(last - r->t_first_us) / 1e6);
        if (r->n_output >= 2) {
            double tpot = (double)(last - r->t_first_us) / 1e6 / (r->n_output - 1);
            metrics_histogram_observe(&s->hist[H_TPOT], tpot);
            metrics_window_observe(s->tpot, tpot, now);
            stats_worker *w = t ? worker_get(s, t->decode_worker, now) : NULL;
            if (w)
                metrics_window_observe(w->tpot, tpot, now);
        }
    }
}

// --- events

void stats_set_event_sink(stats_t *s, void (*fn)(const stats_event *ev, void *ud), void *ud)
{
    s->sink = fn;
    s->sink_ud = ud;
}

void stats_on_cluster_event(const cluster_event *ce, void *ud)
{
    stats_t *s = ud;
    static const char *names[] = {
        [CLUSTER_EV_WORKER_UP] = "worker_up",         [CLUSTER_EV_WORKER_DOWN] = "worker_down",
        [CLUSTER_EV_WORKER_ROLE] = "worker_role",     [CLUSTER_EV_WORKER_STATE] = "worker_state",
        [CLUSTER_EV_REQUEST_RETRY] = "request_retry",
        [CLUSTER_EV_REQUEST_PREEMPT] = "request_preempt",
        [CLUSTER_EV_ROLE_CHANGE] = "role_change",
        [CLUSTER_EV_WORKER_REFUSED] = "worker_refused",
    };
    if ((int)ce->type < 1 || (int)ce->type >= (int)(sizeof(names) / sizeof(names[0])))
        return;
    if (ce->type == CLUSTER_EV_REQUEST_PREEMPT)
        s->offline_preemptions++;
    stats_event ev = {.type = names[ce->type],
                      .role = ce->role,
                      .old_role = ce->old_role,
                      .state = ce->state,
                      .rid = ce->rid};
    snprintf(ev.worker, sizeof(ev.worker), "%s", ce->worker ? ce->worker : "");
    snprintf(ev.reason, sizeof(ev.reason), "%s", ce->reason ? ce->reason : "");
    push_event(s, &ev);
}

int stats_n_events(const stats_t *s)
{
    return s->n_events;
}

const stats_event *stats_event_at(const stats_t *s, int i)
{
    if (i < 0 || i >= s->n_events)
        return NULL;
    return &s->events[(s->ev_head + i) % STATS_MAX_EVENTS];
}

// --- figures

typedef struct {
    stats_t *s;
    int64_t now_us;
} sample_ctx;

static void sample_worker(const cluster_worker_info *wi, void *ud)
{
    sample_ctx *sc = ud;
    stats_worker *w = worker_get(sc->s, wi->id, sc->now_us);
    if (!w)
        return;
    if (w->n_samples > 0) {
        const rate_sample *last = &w->samples[(w->head + w->n_samples - 1) % RATE_SAMPLES];
        if (wi->tokens_in < last->in || wi->tokens_out < last->out)
            w->n_samples = 0; /* the worker restarted: its counters began again */
    }
    rate_sample smp = {.t_us = sc->now_us, .in = wi->tokens_in, .out = wi->tokens_out};
    if (w->n_samples == RATE_SAMPLES) {
        w->samples[w->head] = smp;
        w->head = (w->head + 1) % RATE_SAMPLES;
    } else {
        w->samples[(w->head + w->n_samples) % RATE_SAMPLES] = smp;
        w->n_samples++;
    }
}

void stats_sample(stats_t *s, const cluster_t *c, int64_t now_us)
{
    sample_ctx sc = {s, now_us};
    if (c)
        cluster_foreach_worker(c, sample_worker, &sc);
    int64_t keep_us = (int64_t)s->window_s * 1000000;
    for (int i = 0; i < s->n_workers;) {
        if (now_us - s->workers[i]->last_seen_us > keep_us) {
            worker_free(s->workers[i]);
            s->workers[i] = s->workers[--s->n_workers];
        } else {
            i++;
        }
    }
}

void stats_get_gateway(const stats_t *s, const cluster_t *c, stats_gateway_figures *out)
{
    memset(out, 0, sizeof(*out));
    out->received = s->received;
    out->rejected = s->rejected;
    out->finished_stop = s->finished_stop;
    out->finished_length = s->finished_length;
    out->finished = s->finished_stop + s->finished_length;
    out->failed = s->failed;
    out->cancelled = s->cancelled;
    out->failed_total = s->failed + s->rejected;
    for (int st = 200; st < 600; st++) {
        if (st < 300)
            out->http_2xx += s->http_status[st];
        else if (st >= 400 && st < 500)
            out->http_4xx += s->http_status[st];
        else if (st >= 500)
            out->http_5xx += s->http_status[st];
    }
    out->http_connections = s->http_connections;
    memcpy(out->http_events, s->http_events, sizeof(out->http_events));
    out->prompt_tokens = s->prompt_tokens;
    out->generation_tokens = s->generation_tokens;
    out->offline_generation_tokens = s->offline_generation_tokens;
    out->offline_preemptions = s->offline_preemptions;
    if (c) {
        cluster_stats cs;
        cluster_get_stats(c, &cs);
        out->queued = cs.n_queued;
        out->running = cs.n_running;
        out->offline_queued = cs.n_offline_queued;
        out->offline_running = cs.n_offline_running;
    }
    out->uptime_s = (double)(proto_now_us() - s->start_us) / 1e6;
    out->started_wall_ms = s->start_wall_ms;
}

static void percentiles(const metrics_window *w, int64_t now_us, stats_percentiles *p)
{
    p->n = w ? metrics_window_count(w, now_us) : 0;
    p->p50 = w ? metrics_window_quantile(w, 0.5, now_us) : NAN;
    p->p90 = w ? metrics_window_quantile(w, 0.9, now_us) : NAN;
    p->p99 = w ? metrics_window_quantile(w, 0.99, now_us) : NAN;
}

static void worker_rates(const stats_worker *w, double *in, double *out)
{
    *in = *out = 0;
    if (w->n_samples < 2)
        return;
    const rate_sample *last = &w->samples[(w->head + w->n_samples - 1) % RATE_SAMPLES];
    const rate_sample *first = NULL;
    for (int i = 0; i < w->n_samples - 1; i++) {
        const rate_sample *r = &w->samples[(w->head + i) % RATE_SAMPLES];
        if (last->t_us - r->t_us <= RATE_SPAN_US) {
            first = r;
            break;
        }
    }
    if (!first)
        first = &w->samples[(w->head + w->n_samples - 2) % RATE_SAMPLES];
    double dt = (double)(last->t_us - first->t_us) / 1e6;
    if (dt <= 0)
        return;
    *in = (double)(last->in - first->in) / dt;
    *out = (double)(last->out - first->out) / dt;
}

void stats_get_worker(const stats_t *s, const char *id, int64_t now_us, stats_worker_figures *out)
{
    memset(out, 0, sizeof(*out));
    const stats_worker *w = worker_find(s, id);
    percentiles(w ? w->ttft : NULL, now_us, &out->ttft);
    percentiles(w ? w->tpot : NULL, now_us, &out->tpot);
    percentiles(w ? w->itl : NULL, now_us, &out->itl);
    if (w)
        worker_rates(w, &out->tokens_in_per_s, &out->tokens_out_per_s);
}

void stats_get_cluster(const stats_t *s, int64_t now_us, stats_worker_figures *out)
{
    memset(out, 0, sizeof(*out));
    percentiles(s->ttft, now_us, &out->ttft);
    percentiles(s->tpot, now_us, &out->tpot);
    percentiles(s->itl, now_us, &out->itl);
    int64_t fresh_us = 3 * RATE_SPAN_US;
    for (int i = 0; i < s->n_workers; i++) {
        const stats_worker *w = s->workers[i];
        if (w->n_samples == 0 ||
            now_us - w->samples[(w->head + w->n_samples - 1) % RATE_SAMPLES].t_us > fresh_us)
            continue; /* not sampled lately: gone */
        double in, o;
        worker_rates(w, &in, &o);
        out->tokens_in_per_s += in;
        out->tokens_out_per_s += o;
    }
}

// --- for the exposition (prometheus.h)

const char *stats_model_name(const stats_t *s)
{
    return s->model;
}

uint64_t stats_http_responses(const stats_t *s, int status)
{
    return status >= 100 && status < 600 ? s->http_status[status] : 0;
}

const metrics_histogram *stats_histogram(const stats_t *s, int i, const char **name,
                                         const char **help)
{
    if (i < 0 || i >= H_N)
        return NULL;
    *name = hist_defs[i].name;
    *help = hist_defs[i].help;
    return &s->hist[i];
}
