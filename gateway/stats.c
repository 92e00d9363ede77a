/* stats: see stats.h.
 *
 * Per-worker state (latency windows, counter samples for rates) sits in a small array of
 * entries found by id (a cluster has few workers; lookups are linear). Request-level
 * histograms and counters are fixed members. The exposition walks the cluster's workers
 * once into a scratch array, then writes family by family. */
#include "stats.h"

#include <math.h>
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

// --- exposition

typedef struct {
    char id[PROTO_ID_LEN];
    int role, state;
    cluster_worker_info info; /* strings not valid: use id */
} winfo;

typedef struct {
    winfo *v;
    int n, cap;
} winfo_list;

static void collect(const cluster_worker_info *wi, void *ud)
{
    winfo_list *l = ud;
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 16;
        winfo *v = realloc(l->v, (size_t)cap * sizeof(*v));
        if (!v)
            return;
        l->v = v;
        l->cap = cap;
    }
    winfo *w = &l->v[l->n++];
    snprintf(w->id, sizeof(w->id), "%s", wi->id);
    w->role = wi->role;
    w->state = wi->state;
    w->info = *wi;
    w->info.id = NULL;
    w->info.kv_endpoint = NULL;
}

#define NAME(buf, suffix) snprintf(buf, sizeof(buf), STATS_PREFIX "%s", suffix)

/* A family of one gateway-level sample (label model_name). */
static void write_one(FILE *f, const stats_t *s, const char *name, const char *type,
                      const char *help, double v)
{
    char full[128];
    NAME(full, name);
    metrics_label l = {"model_name", s->model};
    metrics_write_header(f, full, type, help);
    metrics_write_sample(f, full, NULL, &l, 1, v);
}

typedef enum {
    W_RUNNING,
    W_QUEUED,
    W_QTOK,
    W_KV_USAGE,
    W_TOK_IN,
    W_TOK_OUT,
    W_SPEC_DRAFTS,
    W_SPEC_DRAFT_TOKENS,
    W_SPEC_ACCEPTED,
} wfield_t;

static double wvalue(const cluster_worker_info *w, wfield_t f)
{
    switch (f) {
    case W_RUNNING:
        return w->running;
    case W_QUEUED:
        return w->queued;
    case W_QTOK:
        return w->queued_prompt_tokens;
    case W_KV_USAGE:
        return w->kv_blocks_total > 0
                   ? (double)(w->kv_blocks_total - w->kv_blocks_free) / w->kv_blocks_total
                   : 0.0;
    case W_TOK_IN:
        return (double)w->tokens_in;
    case W_TOK_OUT:
        return (double)w->tokens_out;
    case W_SPEC_DRAFTS:
        return (double)w->spec.n_drafts;
    case W_SPEC_DRAFT_TOKENS:
        return (double)w->spec.n_draft_tokens;
    case W_SPEC_ACCEPTED:
        return (double)w->spec.n_accepted_tokens;
    }
    return 0;
}

static int decodes(int role)
{
    return role == PROTO_ROLE_DECODE || role == PROTO_ROLE_MIXED;
}

/* A per-worker family (labels model_name, worker, role); spec families only for workers
 * that decode. */
static void write_per_worker(FILE *f, const stats_t *s, const winfo_list *l, const char *name,
                             const char *type, const char *help, wfield_t field, int spec)
{
    char full[128];
    NAME(full, name);
    metrics_write_header(f, full, type, help);
    for (int i = 0; i < l->n; i++) {
        const winfo *w = &l->v[i];
        if (spec && !decodes(w->role))
            continue;
        metrics_label lb[3] = {
            {"model_name", s->model}, {"worker", w->id}, {"role", proto_role_str(w->role)}};
        metrics_write_sample(f, full, NULL, lb, 3, wvalue(&w->info, field));
    }
}

static void write_kvx(FILE *f, const stats_t *s, const winfo_list *l)
{
    static const char *results[] = {"ok", "rejected", "timeout", "aborted", "cancelled"};
    char transfers[128], bytes[128], secs[128];
    NAME(transfers, "kv_transfers_total");
    NAME(bytes, "worker_kv_transfer_bytes_total");
    NAME(secs, "worker_kv_transfer_seconds_total");
    for (int fam = 0; fam < 3; fam++) {
        const char *name = fam == 0 ? transfers : fam == 1 ? bytes : secs;
        metrics_write_header(
            f, name, "counter",
            fam == 0 ? "KV transfers that ended, by side (send: prefill, recv: decode) and result."
            : fam == 1 ? "KV payload bytes of completed transfers, by side."
                       : "Time spent in completed KV transfers, by side (each side's clock).");
        for (int i = 0; i < l->n; i++) {
            const winfo *w = &l->v[i];
            for (int side = 0; side < 2; side++) {
                if (side == 0 && w->role == PROTO_ROLE_DECODE && !w->info.kvx_tx.n_ok &&
                    !w->info.kvx_tx.n_rejected && !w->info.kvx_tx.n_timeouts &&
                    !w->info.kvx_tx.n_aborted && !w->info.kvx_tx.n_cancelled)
                    continue; /* a decode worker only receives, unless it migrated */
                if (side == 1 && w->role == PROTO_ROLE_PREFILL)
                    continue; /* a prefill worker only sends */
                const proto_kvx_counters *k = side == 0 ? &w->info.kvx_tx : &w->info.kvx_rx;
                metrics_label lb[5] = {{"model_name", s->model},
                                       {"worker", w->id},
                                       {"role", proto_role_str(w->role)},
                                       {"side", side == 0 ? "send" : "recv"},
                                       {"result", NULL}};
                if (fam == 1) {
                    metrics_write_sample(f, name, NULL, lb, 4, (double)k->n_bytes);
                } else if (fam == 2) {
                    metrics_write_sample(f, name, NULL, lb, 4, (double)k->total_us / 1e6);
                } else {
                    const uint64_t v[5] = {k->n_ok, k->n_rejected, k->n_timeouts, k->n_aborted,
                                           k->n_cancelled};
                    for (int r = 0; r < 5; r++) {
                        lb[4].value = results[r];
                        metrics_write_sample(f, name, NULL, lb, 5, (double)v[r]);
                    }
                }
            }
        }
    }
}

/* Role changes (the gateway's count and latest latency) and live migrations per worker
 * (docs/scheduler.md "Live role changes"). */
static void write_roles(FILE *f, const stats_t *s, const cluster_t *c, const winfo_list *l)
{
    cluster_stats cs = {0};
    if (c)
        cluster_get_stats(c, &cs);
    write_one(f, s, "role_changes_total", "counter",
              "Worker role changes completed (ordered -> registered in the new role).",
              (double)cs.n_role_changes);
    write_one(f, s, "role_change_last_seconds", "gauge",
              "Duration of the latest role change, ordered -> registered in the new role.",
              cs.last_role_change_ms / 1000.0);
    char full[128];
    NAME(full, "worker_migrations_total");
    metrics_write_header(f, full, "counter",
                         "Running sequences moved between decode workers (live migration), by "
                         "direction and result, as of the worker's last heartbeat.");
    for (int i = 0; i < l->n; i++) {
        const proto_mig_counters *m = &l->v[i].info.mig;
        if (!decodes(l->v[i].role) && !m->n_out && !m->n_out_failed && !m->n_in)
            continue;
        const struct {
            const char *dir, *result;
            uint64_t n;
        } v[3] = {{"out", "ok", m->n_out}, {"out", "failed", m->n_out_failed}, {"in", "ok", m->n_in}};
        for (int k = 0; k < 3; k++) {
            metrics_label lb[5] = {{"model_name", s->model},
                                   {"worker", l->v[i].id},
                                   {"role", proto_role_str(l->v[i].role)},
                                   {"direction", v[k].dir},
                                   {"result", v[k].result}};
            metrics_write_sample(f, full, NULL, lb, 5, (double)v[k].n);
        }
    }
}

void stats_write_metrics(const stats_t *s, const cluster_t *c, FILE *f)
{
    winfo_list l = {0};
    if (c)
        cluster_foreach_worker(c, collect, &l);
    stats_gateway_figures g;
    stats_get_gateway(s, c, &g);
    char full[128];
    metrics_label ml = {"model_name", s->model};

    // gateway
    write_one(f, s, "num_requests_running", "gauge",
              "Number of requests assigned to workers (prefilling, transferring or decoding).",
              g.running);
    write_one(f, s, "num_requests_waiting", "gauge",
              "Number of requests waiting in the gateway's queue for workers.", g.queued);
    write_one(f, s, "prompt_tokens_total", "counter",
              "Number of prompt tokens of the requests answered (usage.prompt_tokens).",
              (double)g.prompt_tokens);
    write_one(f, s, "generation_tokens_total", "counter",
              "Number of generated tokens of the requests answered (usage.completion_tokens).",
              (double)g.generation_tokens);
    NAME(full, "request_success_total");
    metrics_write_header(f, full, "counter",
                         "Count of successfully processed requests, by finish reason (abort: "
                         "the client went away).");
    const struct {
        const char *reason;
        uint64_t n;
    } fin[] = {{"stop", s->finished_stop}, {"length", s->finished_length}, {"abort", s->cancelled}};
    for (int i = 0; i < 3; i++) {
        metrics_label lb[2] = {ml, {"finished_reason", fin[i].reason}};
        metrics_write_sample(f, full, NULL, lb, 2, (double)fin[i].n);
    }
    write_one(f, s, "num_offline_requests_waiting", "gauge",
              "Offline requests (service_tier flex, batch lines) waiting in the gateway's "
              "offline queue.",
              g.offline_queued);
    write_one(f, s, "num_offline_requests_running", "gauge",
              "Offline requests assigned to workers (within the tidal policy's admission).",
              g.offline_running);
    write_one(f, s, "offline_generation_tokens_total", "counter",
              "Generated tokens of the offline requests answered (flex requests, batch lines).",
              (double)g.offline_generation_tokens);
    write_one(f, s, "offline_preemptions_total", "counter",
              "Offline requests preempted (cancelled on their workers and re-queued) because "
              "online load rose.",
              (double)g.offline_preemptions);
    write_one(f, s, "requests_received_total", "counter",
              "Completion requests received (POST /v1/completions, /v1/chat/completions).",
              (double)g.received);
    write_one(f, s, "request_failure_total", "counter",
              "Completion requests answered with an error, before or after admission.",
              (double)g.failed_total);
    NAME(full, "http_responses_total");
    metrics_write_header(f, full, "counter", "HTTP responses sent, by status code.");
    for (int st = 100; st < 600; st++) {
        if (!s->http_status[st])
            continue;
        char code[8];
        snprintf(code, sizeof(code), "%d", st);
        metrics_label lb[2] = {ml, {"code", code}};
        metrics_write_sample(f, full, NULL, lb, 2, (double)s->http_status[st]);
    }
    write_one(f, s, "gateway_start_time_seconds", "gauge",
              "Start time of the gateway, seconds since the epoch.",
              (double)s->start_wall_ms / 1000.0);
    for (int i = 0; i < H_N; i++) {
        NAME(full, hist_defs[i].name);
        metrics_write_header(f, full, "histogram", hist_defs[i].help);
        metrics_write_histogram(f, full, &ml, 1, &s->hist[i]);
    }

    // workers
    NAME(full, "workers");
    metrics_write_header(f, full, "gauge", "Alive workers by role and state.");
    for (int role = PROTO_ROLE_PREFILL; role <= PROTO_ROLE_MIXED; role++) {
        for (int st = PROTO_STATE_READY; st <= PROTO_STATE_CHANGING; st++) {
            int n = 0;
            for (int i = 0; i < l.n; i++)
                n += l.v[i].role == role && l.v[i].state == st;
            metrics_label lb[3] = {
                ml, {"role", proto_role_str(role)}, {"state", stats_state_str(st)}};
            metrics_write_sample(f, full, NULL, lb, 3, n);
        }
    }
    write_per_worker(f, s, &l, "kv_cache_usage_perc", "gauge",
                     "KV-cache usage of the worker. 1 means 100 percent usage.", W_KV_USAGE, 0);
    write_per_worker(f, s, &l, "worker_num_requests_running", "gauge",
                     "Sequences the worker holds (prefilling, transferring or decoding), as "
                     "of its last heartbeat.",
                     W_RUNNING, 0);
    write_per_worker(f, s, &l, "worker_num_requests_waiting", "gauge",
                     "Requests queued at the worker for prefill, as of its last heartbeat.",
                     W_QUEUED, 0);
    write_per_worker(f, s, &l, "worker_queued_prompt_tokens", "gauge",
                     "Prompt tokens queued at the worker, as of its last heartbeat.", W_QTOK, 0);
    write_per_worker(f, s, &l, "worker_prompt_tokens_total", "counter",
                     "Prompt tokens the worker prefilled since it started.", W_TOK_IN, 0);
    write_per_worker(f, s, &l, "worker_generation_tokens_total", "counter",
                     "Tokens the worker generated since it started.", W_TOK_OUT, 0);
    write_per_worker(f, s, &l, "spec_decode_num_drafts_total", "counter",
                     "Number of spec decoding drafts.", W_SPEC_DRAFTS, 1);
    write_per_worker(f, s, &l, "spec_decode_num_draft_tokens_total", "counter",
                     "Number of draft tokens.", W_SPEC_DRAFT_TOKENS, 1);
    write_per_worker(f, s, &l, "spec_decode_num_accepted_tokens_total", "counter",
                     "Number of accepted tokens.", W_SPEC_ACCEPTED, 1);
    NAME(full, "spec_decode_num_accepted_tokens_per_pos_total");
    metrics_write_header(f, full, "counter", "Accepted tokens per draft position.");
    for (int i = 0; i < l.n; i++) {
        if (!decodes(l.v[i].role))
            continue;
        for (int pos = 0; pos < PROTO_SPEC_MAX_POS; pos++) {
            char p[8];
            snprintf(p, sizeof(p), "%d", pos);
            metrics_label lb[4] = {
                ml, {"worker", l.v[i].id}, {"role", proto_role_str(l.v[i].role)}, {"position", p}};
            metrics_write_sample(f, full, NULL, lb, 4,
                                 (double)l.v[i].info.spec.accepted_per_pos[pos]);
        }
    }
    write_kvx(f, s, &l);
    write_roles(f, s, c, &l);
    free(l.v);
}
