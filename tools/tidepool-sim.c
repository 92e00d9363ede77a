/*
 * tidepool-sim: discrete-event simulation of a disaggregated tidepool cluster, driven by
 * the same tidal policy code the gateway runs (gateway/policy.c) and timed by the cost
 * model of a real accelerator (common/costmodel.c). Every figure it prints is *emulated*.
 *
 *   tidepool-sim --workers 8 --workload phase-shift [--duration-s S --rate R --seed S]
 *   tidepool-sim --workers 64 --trace FILE --policy static:24
 *   tidepool-sim --workers 8 --compare-static
 *
 * Model (docs/scheduler.md has the details):
 *   - gateway: online and offline FIFO queues; online first; offline prompts start only
 *     while fewer than the policy's offline limit are running.
 *   - prefill worker: when idle, takes prompts from the queue up to the token budget (a
 *     longer prompt runs alone) and computes them for costmodel_prefill_ms; the first token
 *     (TTFT) is out at the end of the batch. KV moves to a decode worker chosen then (most
 *     free KV of two random ones, else the best of all), layer by layer: it arrives at
 *     max(end + transfer/n_layer, start + transfer).
 *   - decode worker: continuous batching; a step over the running sequences takes
 *     costmodel_decode_step_ms(batch, total context); arrivals join at step boundaries;
 *     KV is reserved for prompt + output. No room anywhere: the sequence waits (online
 *     first) and is pulled by the next worker that frees KV.
 *   - role change: a prefill worker finishes its batch; a decode worker migrates its
 *     sequences (their KV over the link, one after another) at the next step boundary;
 *     then either pays switch-ms before serving in the new role.
 *   - the policy runs every tick-ms on the figures a real gateway would see; preempted
 *     offline sequences restart later from prompt + tokens so far (recompute).
 * Events sit in one binary heap (O(log n) each) ordered by (time, insertion), so a run is
 * deterministic: the same flags give the same output, byte for byte.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "config.h"
#include "costmodel.h"
#include "log.h"
/* The gateway's own policy (linked from libgateway.a): the simulator runs exactly the
 * code the gateway runs. */
#include "policy.h"
#include "sim_heap.h"
#include "sim_ideque.h"
#include "sim_ivec.h"
#include "sim_mem.h"
#include "sim_rng.h"
#include "sim_stats.h"
#include "sim_workload.h"

// --- settings ------------------------------------------------------------------------------

static long long opt_workers, opt_seed, opt_initial_prefill, opt_max_changes, opt_max_seqs,
    opt_max_batch_tokens, opt_min_per_role;
static char *opt_trace, *opt_workload, *opt_policy, *opt_preset, *opt_role_change,
    *opt_decode_reserve;
static double opt_duration_s, opt_phase_s, opt_rate, opt_load, opt_offline_frac;
static double opt_ttft_slo_ms, opt_tpot_slo_ms, opt_tick_ms, opt_switch_ms;
static double opt_min_role_s, opt_window_s, opt_max_change_frac, opt_act_pressure, opt_band;
static double opt_smooth_s, opt_reverse_hold_s;
static int opt_compare_static, opt_verbose;

static const config_entry_t settings[] = {
    {"workers", CONFIG_INT, &opt_workers, "8", 2, 100000, "workers in the cluster"},
    {"trace", CONFIG_STRING, &opt_trace, NULL, 0, 0,
     "replay this trace (CSV arrival_s,prompt_tokens,output_tokens[,class] or JSONL)"},
    {"workload", CONFIG_STRING, &opt_workload, "phase-shift", 0, 0,
     "generated workload when no --trace: phase-shift"},
    {"duration-s", CONFIG_DOUBLE, &opt_duration_s, "600", 1, 1e7,
     "phase-shift: seconds of arrivals"},
    {"phase-s", CONFIG_DOUBLE, &opt_phase_s, "120", 1, 1e7,
     "phase-shift: seconds of each prefill-heavy / decode-heavy phase"},
    {"rate", CONFIG_DOUBLE, &opt_rate, "0", 0, 1e7,
     "phase-shift: arrivals per second (0 = --load times the cluster's estimated capacity)"},
    {"load", CONFIG_DOUBLE, &opt_load, "0.7", 0.01, 10,
     "phase-shift with --rate 0: offered load as a share of capacity"},
    {"offline-frac", CONFIG_DOUBLE, &opt_offline_frac, "0.1", 0, 1,
     "phase-shift: share of arrivals that are offline (flex / batch)"},
    {"seed", CONFIG_INT, &opt_seed, "1", 0, 9e18, "random seed of the generated workload"},
    {"ttft-slo-ms", CONFIG_DOUBLE, &opt_ttft_slo_ms, "2000", 1, 1e7, "time-to-first-token SLO"},
    {"tpot-slo-ms", CONFIG_DOUBLE, &opt_tpot_slo_ms, "50", 1, 1e7, "time-per-output-token SLO"},
    {"policy", CONFIG_STRING, &opt_policy, "tidal", 0, 0,
     "tidal, or static:P (P prefill workers, the rest decode, never changed)"},
    {"compare-static", CONFIG_BOOL, &opt_compare_static, "false", 0, 0,
     "run tidal and static splits (all for <= 20 workers, else 10%..90%), rank by goodput"},
    {"verbose", CONFIG_BOOL, &opt_verbose, "false", 0, 0,
     "print every policy decision that changes roles, and pressures every 10 s, to stderr"},
    {"initial-prefill", CONFIG_INT, &opt_initial_prefill, "0", 0, 100000,
     "tidal: prefill workers at the start (0 = half)"},
    {"preset", CONFIG_STRING, &opt_preset, "a100-llama3-8b", 0, 0,
     "cost model preset: a100-llama3-8b | h100-llama3-8b, optionally with :dilate=K (K "
     "times slower, 1 <= K <= 1000)"},
    {"max-seqs", CONFIG_INT, &opt_max_seqs, "0", 0, 1000000,
     "sequences per decode worker (the engine's --max-seqs; 0 = the preset's)"},
    {"max-batch-tokens", CONFIG_INT, &opt_max_batch_tokens, "0", 0, 100000000,
     "prompt tokens per prefill batch (the engine's --max-batch-tokens; 0 = the preset's)"},
    {"role-change", CONFIG_STRING, &opt_role_change, "migrate", 0, 0,
     "a decode worker leaving decode: migrate (its sequences move to other decode workers) "
     "| drain (it takes no new sequence and finishes its own)"},
    {"decode-reserve", CONFIG_STRING, &opt_decode_reserve, "prefill", 0, 0,
     "when a request's decode worker is chosen and its KV reserved: prefill (when its "
     "prefill ends) | dispatch (before its prefill, as tidepool's gateway does: requests wait "
     "at the gateway, before their first token, while no decode worker has room)"},
    {"tick-ms", CONFIG_DOUBLE, &opt_tick_ms, "1000", 10, 1e6, "policy decision interval"},
    {"switch-ms", CONFIG_DOUBLE, &opt_switch_ms, "500", 0, 1e7,
     "role change cost after draining (reconfiguration)"},
    {"min-role-s", CONFIG_DOUBLE, &opt_min_role_s, "30", 0, 1e6, "policy: min time in a role"},
    {"max-changes", CONFIG_INT, &opt_max_changes, "2", 0, 1024,
     "policy: role changes per window (or max-change-frac of workers if larger)"},
    {"max-change-frac", CONFIG_DOUBLE, &opt_max_change_frac, "0.25", 0, 1,
     "policy: role changes per window as a share of the workers"},
    {"window-s", CONFIG_DOUBLE, &opt_window_s, "10", 0.001, 1e6, "policy: rate-cap window"},
    {"min-per-role", CONFIG_INT, &opt_min_per_role, "1", 1, 100000,
     "policy: workers that always stay prefill and decode"},
    {"act-pressure", CONFIG_DOUBLE, &opt_act_pressure, "0.8", 0.01, 100,
     "policy: pressure a role needs before it gains a worker"},
    {"band", CONFIG_DOUBLE, &opt_band, "1.25", 1, 100,
     "policy: hysteresis band (gainer > band * donor's projected pressure)"},
    {"smooth-s", CONFIG_DOUBLE, &opt_smooth_s, "5", 0, 1e6,
     "policy: time constant of the EWMA signals"},
    {"reverse-hold-s", CONFIG_DOUBLE, &opt_reverse_hold_s, "7.5", 0, 1e6,
     "policy: after a recent reversal, the rule must ask for another this long (doubling)"},
    {NULL, 0, NULL, NULL, 0, 0, NULL},
};

// --- simulation state ----------------------------------------------------------------------

enum { EV_ARRIVAL = 1, EV_PREFILL_DONE, EV_XFER_DONE, EV_STEP_DONE, EV_SWITCH_DONE, EV_TICK };

enum {
    RQ_FREE = 0,
    RQ_QUEUED,   /* at the gateway */
    RQ_PREFILL,  /* in a prefill batch */
    RQ_XFER,     /* KV on its way to a decode worker (reserved there) */
    RQ_PENDING,  /* prefilled, waiting for room on a decode worker */
    RQ_INCOMING, /* on its decode worker, joins at the next step boundary */
    RQ_RUNNING,  /* in its decode worker's batch */
};

typedef struct {
    double arrival_ms, first_ms; /* first_ms < 0: no token yet */
    int prompt, out;             /* tokens */
    int gen;                     /* tokens generated so far (the first included) */
    int worker;                  /* decode worker holding its reservation, -1 none */
    int64_t s0;                  /* worker step when it joined the batch */
    int need;                    /* KV tokens reserved: prompt + out */
    uint32_t epoch;              /* bumped whenever it leaves a place (stale entries) */
    uint8_t offline, state;
    int next_free;
} sreq;

typedef struct {
    int role;     /* POLICY_ROLE_PREFILL | POLICY_ROLE_DECODE */
    int target;   /* role it is changing to */
    int changing; /* 0, 1 = draining, 2 = switching */
    double role_since_ms;
    /* prefill */
    int busy, idle_listed;
    sim_ivec batch;
    double batch_start_ms;
    /* decode */
    int stepping, dec_pos;
    int64_t step, ctx_sum; /* completed steps; context tokens of the running sequences */
    int running, assigned; /* in the batch; reserved here (running + incoming + in flight) */
    int64_t kv_reserved;   /* tokens */
    sim_heap_fin fin;
    sim_ivec incoming;
    double last_step_ms;
} sworker;

typedef struct {
    char name[32];
    int64_t n_online, n_good, n_finished, n_offline, n_offline_done;
    double span_s, end_s, goodput, attain_pct;
    double ttft_mean, ttft_p99, tpot_mean, tpot_p99;
    double offline_rps, offline_tok_s;
    int64_t changes, preemptions;
    int final_prefill;
} sim_result;

typedef struct {
    /* configuration */
    const costmodel *cm;
    policy_params pp;
    int n_workers, tidal;
    int drain;            /* --role-change drain */
    int reserve_dispatch; /* --decode-reserve dispatch */
    double tick_ms, switch_ms, ttft_slo_ms, tpot_slo_ms, kv_cap, hard_end_ms;
    /* clock and events */
    double now;
    sim_heap ev;
    int stop;
    /* requests */
    sreq *reqs;
    int n_reqs, free_head;
    sim_workload wl;
    sim_workload_arrival next;
    int arrivals_done;
    /* workers and queues. q_on is the prefill queue. With reserve_dispatch, q_gw holds the
     * online requests waiting at the gateway for decode room, q_off the offline ones, and
     * q_on both kinds once dispatched (their decode room reserved). */
    sworker *w;
    sim_ideque q_on, q_off, q_gw, pend_on, pend_off;
    int64_t q_on_tokens;
    sim_ivec idle_prefill;
    int *dec_list, n_dec;
    sim_ivec off_dec, off_dec_epoch; /* offline sequences that joined a decode batch (lazy) */
    uint64_t free_epoch, scan_fail_epoch;
    int scan_failed;
    sim_rng prng;
    /* policy */
    policy_state pst;
    policy_worker *pin;
    double *step_ms_buf; /* (n_workers, 2): step ms, batch */
    int offline_limit;
    /* counters */
    int online_running, online_decoding, offline_running;
    int64_t prompt_tokens_arrived;
    /* metrics */
    double *ttft, *tpot;
    size_t n_fin, cap_fin;
    double *win_ttft;
    size_t n_win, cap_win;
    int64_t n_online, n_good, n_offline, n_offline_done, offline_tokens, preemptions, changes;
} sim;

static void dispatch(sim *s);

// --- requests ------------------------------------------------------------------------------

static int req_alloc(sim *s)
{
    if (s->free_head < 0) {
        int ncap = s->n_reqs ? 2 * s->n_reqs : 4096;
        s->reqs = sim_mem_realloc(s->reqs, (size_t)ncap * sizeof(sreq));
        for (int i = ncap - 1; i >= s->n_reqs; i--) {
            memset(&s->reqs[i], 0, sizeof(sreq));
            s->reqs[i].next_free = s->free_head;
            s->free_head = i;
        }
        s->n_reqs = ncap;
    }
    int id = s->free_head;
    s->free_head = s->reqs[id].next_free;
    return id;
}

static void req_release(sim *s, int id)
{
    sreq *r = &s->reqs[id];
    r->state = RQ_FREE;
    r->epoch++;
    r->next_free = s->free_head;
    s->free_head = id;
}

static void dpush(double **v, size_t *n, size_t *cap, double x)
{
    if (*n == *cap) {
        *cap = *cap ? 2 * *cap : 4096;
        *v = sim_mem_realloc(*v, *cap * sizeof(double));
    }
    (*v)[(*n)++] = x;
}

static void finish_req(sim *s, int id)
{
    sreq *r = &s->reqs[id];
    if (r->offline) {
        s->n_offline_done++;
        s->offline_tokens += r->out;
        s->offline_running--;
    } else {
        double ttft = r->first_ms - r->arrival_ms;
        double tpot = r->out > 1 ? (s->now - r->first_ms) / (r->out - 1) : 0;
        if (s->n_fin == s->cap_fin) {
            s->cap_fin = s->cap_fin ? 2 * s->cap_fin : 4096;
            s->ttft = sim_mem_realloc(s->ttft, s->cap_fin * sizeof(double));
            s->tpot = sim_mem_realloc(s->tpot, s->cap_fin * sizeof(double));
        }
        s->ttft[s->n_fin] = ttft;
        s->tpot[s->n_fin] = tpot;
        s->n_fin++;
        if (ttft <= s->ttft_slo_ms && tpot <= s->tpot_slo_ms)
            s->n_good++;
        s->online_running--;
        if (r->out > 1) /* it went through decode (counted when prefill ended) */
            s->online_decoding--;
    }
    req_release(s, id);
}

// --- decode placement ----------------------------------------------------------------------

static int accepts(const sim *s, int w)
{
    return s->w[w].role == POLICY_ROLE_DECODE && !s->w[w].changing;
}

static int fits(const sim *s, int w, int need)
{
    const sworker *x = &s->w[w];
    return x->kv_reserved + need <= s->kv_cap && x->assigned < s->cm->max_seqs;
}

/* A decode worker with room for need tokens: the one with more free KV of two random
 * ones, else (at most once per KV-freeing event, when scan is set) the best of all. */
static int choose_decode(sim *s, int need, int scan)
{
    if (s->n_dec == 0)
        return -1;
    int best = -1;
    int64_t best_free = -1;
    if (s->n_dec <= 16) {
        for (int i = 0; i < s->n_dec; i++) {
            int w = s->dec_list[i];
            int64_t f = (int64_t)s->kv_cap - s->w[w].kv_reserved;
            if (fits(s, w, need) && f > best_free)
                best = w, best_free = f;
        }
        return best;
    }
    for (int k = 0; k < 2; k++) {
        int w = s->dec_list[sim_rng_next(&s->prng) % (uint64_t)s->n_dec];
        int64_t f = (int64_t)s->kv_cap - s->w[w].kv_reserved;
        if (fits(s, w, need) && f > best_free)
            best = w, best_free = f;
    }
    if (best >= 0 || !scan)
        return best;
    if (s->scan_failed && s->scan_fail_epoch == s->free_epoch)
        return -1;
    for (int i = 0; i < s->n_dec; i++) {
        int w = s->dec_list[i];
        int64_t f = (int64_t)s->kv_cap - s->w[w].kv_reserved;
        if (fits(s, w, need) && f > best_free)
            best = w, best_free = f;
    }
    if (best < 0) {
        s->scan_failed = 1;
        s->scan_fail_epoch = s->free_epoch;
    }
    return best;
}

/* Reserve room for request id on decode worker w: KV for prompt + output, one slot. */
static void hold(sim *s, int id, int w)
{
    sreq *r = &s->reqs[id];
    s->w[w].kv_reserved += r->need;
    s->w[w].assigned++;
    r->worker = w;
}

static void reserve(sim *s, int id, int w, double arrive_ms)
{
    sreq *r = &s->reqs[id];
    hold(s, id, w);
    r->state = RQ_XFER;
    sim_heap_push(&s->ev, arrive_ms, EV_XFER_DONE, id, r->epoch);
}

static void unreserve(sim *s, int id)
{
    sreq *r = &s->reqs[id];
    sworker *x = &s->w[r->worker];
    x->kv_reserved -= r->need;
    x->assigned--;
    r->worker = -1;
    r->epoch++;
    s->free_epoch++;
}

static double kv_transfer_ms(const sim *s, const sreq *r)
{
    return costmodel_transfer_ms(s->cm, (double)r->prompt + r->gen);
}

/* A prefilled (or migrating) sequence needs a decode worker; its KV can be there at
 * arrive_ms if one is found now. Waiting sequences keep their order, online first. */
static void place_decode(sim *s, int id, double arrive_ms, int front)
{
    sreq *r = &s->reqs[id];
    int blocked = r->offline ? (s->pend_on.n || s->pend_off.n) : s->pend_on.n > 0;
    int w = blocked ? -1 : choose_decode(s, r->need, 1);
    if (w >= 0) {
        reserve(s, id, w, arrive_ms);
        return;
    }
    r->state = RQ_PENDING;
    r->worker = -1;
    sim_ideque *q = r->offline ? &s->pend_off : &s->pend_on;
    if (front)
        sim_ideque_push_front(q, id);
    else
        sim_ideque_push_back(q, id);
}

/* Room appeared (hint: the worker that freed it, or -1): admit waiting sequences. */
static void drain_pending(sim *s, int hint)
{
    for (;;) {
        sim_ideque *q = s->pend_on.n ? &s->pend_on : (s->pend_off.n ? &s->pend_off : NULL);
        if (!q)
            return;
        int id = sim_ideque_front(q);
        int need = s->reqs[id].need;
        int w = (hint >= 0 && accepts(s, hint) && fits(s, hint, need)) ? hint
                                                                       : choose_decode(s, need, 0);
        if (w < 0)
            return;
        sim_ideque_pop_front(q);
        reserve(s, id, w, s->now + kv_transfer_ms(s, &s->reqs[id]));
    }
}

static void dec_list_add(sim *s, int w)
{
    s->w[w].dec_pos = s->n_dec;
    s->dec_list[s->n_dec++] = w;
    s->free_epoch++;
}

static void dec_list_remove(sim *s, int w)
{
    int pos = s->w[w].dec_pos;
    if (pos < 0)
        return;
    int last = s->dec_list[--s->n_dec];
    s->dec_list[pos] = last;
    s->w[last].dec_pos = pos;
    s->w[w].dec_pos = -1;
}

// --- decode steps --------------------------------------------------------------------------

static void start_step(sim *s, int w)
{
    sworker *x = &s->w[w];
    for (int i = 0; i < x->incoming.n; i++) {
        int id = x->incoming.v[i];
        sreq *r = &s->reqs[id];
        r->state = RQ_RUNNING;
        r->s0 = x->step;
        sim_heap_fin_push(&x->fin, (sim_heap_fin_entry){x->step + (r->out - r->gen), id, r->epoch});
        x->ctx_sum += r->prompt + r->gen;
        x->running++;
        if (r->offline) {
            sim_ivec_push(&s->off_dec, id);
            sim_ivec_push(&s->off_dec_epoch, (int)r->epoch);
        }
    }
    x->incoming.n = 0;
    if (x->running > 0) {
        x->last_step_ms = costmodel_decode_step_ms(s->cm, x->running, (double)x->ctx_sum);
        sim_heap_push(&s->ev, s->now + x->last_step_ms, EV_STEP_DONE, w, 0);
        x->stepping = 1;
    } else {
        x->stepping = 0;
    }
}

static void switch_start(sim *s, int w, double extra_ms)
{
    s->w[w].changing = 2;
    sim_heap_push(&s->ev, s->now + extra_ms + s->switch_ms, EV_SWITCH_DONE, w, 0);
}

/* Take a running sequence out of its worker at a step boundary; its progress is kept. */
static void take_out(sim *s, int id)
{
    sreq *r = &s->reqs[id];
    sworker *x = &s->w[r->worker];
    if (r->state == RQ_RUNNING) {
        int64_t done = x->step - r->s0;
        x->ctx_sum -= r->prompt + r->gen + done;
        x->running--;
        r->gen += (int)done;
    }
    unreserve(s, id);
}

/* A draining decode worker hands its sequences to others (KV over the link, one after
 * another), then switches. */
static void migrate_all(sim *s, int w)
{
    sworker *x = &s->w[w];
    double t_acc = 0;
    for (int i = 0; i < x->fin.n; i++) {
        sim_heap_fin_entry e = x->fin.v[i];
        sreq *r = &s->reqs[e.req];
        if (r->epoch != e.epoch || r->state != RQ_RUNNING || r->worker != w)
            continue;
        take_out(s, e.req);
        t_acc += kv_transfer_ms(s, r);
        place_decode(s, e.req, s->now + t_acc, 1);
    }
    for (int i = 0; i < x->incoming.n; i++) {
        int id = x->incoming.v[i];
        take_out(s, id);
        t_acc += kv_transfer_ms(s, &s->reqs[id]);
        place_decode(s, id, s->now + t_acc, 1);
    }
    x->fin.n = 0;
    x->incoming.n = 0;
    x->running = 0;
    x->ctx_sum = 0;
    x->stepping = 0;
    switch_start(s, w, t_acc);
}

static void on_step_done(sim *s, int w)
{
    sworker *x = &s->w[w];
    x->step++;
    x->ctx_sum += x->running;
    int freed = 0;
    while (x->fin.n > 0 && x->fin.v[0].step <= x->step) {
        sim_heap_fin_entry e = sim_heap_fin_pop(&x->fin);
        sreq *r = &s->reqs[e.req];
        if (r->epoch != e.epoch || r->state != RQ_RUNNING || r->worker != w)
            continue;
        x->ctx_sum -= r->prompt + r->out;
        x->running--;
        x->kv_reserved -= r->need;
        x->assigned--;
        r->gen = r->out;
        finish_req(s, e.req);
        freed = 1;
    }
    if (x->changing && !s->drain) {
        migrate_all(s, w);
        return;
    }
    if (x->changing && x->running == 0 && x->incoming.n == 0) { /* drained */
        x->stepping = 0;
        switch_start(s, w, 0);
    } else {
        start_step(s, w);
    }
    if (freed) {
        s->free_epoch++;
        drain_pending(s, w);
        dispatch(s);
    }
}

static void on_xfer_done(sim *s, int id, uint32_t epoch)
{
    sreq *r = &s->reqs[id];
    if (r->epoch != epoch || r->state != RQ_XFER)
        return;
    int w = r->worker;
    if (!accepts(s, w)) { /* its worker left the decode role meanwhile: send it elsewhere */
        unreserve(s, id);
        place_decode(s, id, s->now + kv_transfer_ms(s, r), 1);
        return;
    }
    r->state = RQ_INCOMING;
    sim_ivec_push(&s->w[w].incoming, id);
    if (!s->w[w].stepping)
        start_step(s, w);
}

// --- prefill -------------------------------------------------------------------------------

static int prefill_ready(const sim *s, int w)
{
    const sworker *x = &s->w[w];
    return x->role == POLICY_ROLE_PREFILL && !x->changing && !x->busy;
}

static int have_prefill_work(const sim *s)
{
    return s->q_on.n > 0 ||
           (!s->reserve_dispatch && s->q_off.n > 0 && s->offline_running < s->offline_limit);
}

static void start_prefill(sim *s, int w)
{
    sworker *x = &s->w[w];
    double tokens = 0, pairs = 0;
    int budget = s->cm->prefill_token_budget;
    x->batch.n = 0;
    while (s->q_on.n > 0) {
        sreq *r = &s->reqs[sim_ideque_front(&s->q_on)];
        int pt = r->prompt + r->gen;
        if (x->batch.n > 0 && tokens + pt > budget)
            break;
        int id = sim_ideque_pop_front(&s->q_on);
        s->q_on_tokens -= r->prompt;
        if (!s->reserve_dispatch) /* else counted when dispatched */
            s->online_running++;
        r->state = RQ_PREFILL;
        sim_ivec_push(&x->batch, id);
        tokens += pt;
        pairs += costmodel_attn_pairs(pt, 0);
    }
    while (!s->reserve_dispatch && s->q_off.n > 0 && s->offline_running < s->offline_limit) {
        sreq *r = &s->reqs[sim_ideque_front(&s->q_off)];
        int pt = r->prompt + r->gen;
        if (x->batch.n > 0 && tokens + pt > budget)
            break;
        int id = sim_ideque_pop_front(&s->q_off);
        s->offline_running++;
        r->state = RQ_PREFILL;
        sim_ivec_push(&x->batch, id);
        tokens += pt;
        pairs += costmodel_attn_pairs(pt, 0);
    }
    if (x->batch.n == 0) {
        if (!x->idle_listed) {
            x->idle_listed = 1;
            sim_ivec_push(&s->idle_prefill, w);
        }
        return;
    }
    x->busy = 1;
    x->batch_start_ms = s->now;
    sim_heap_push(&s->ev, s->now + costmodel_prefill_ms(s->cm, tokens, pairs), EV_PREFILL_DONE, w,
                  0);
}

static void wake_prefill(sim *s)
{
    while (s->idle_prefill.n > 0 && have_prefill_work(s)) {
        int w = s->idle_prefill.v[--s->idle_prefill.n];
        s->w[w].idle_listed = 0;
        if (prefill_ready(s, w))
            start_prefill(s, w);
    }
}

/* --decode-reserve dispatch: move requests waiting at the gateway to the prefill queue while
 * a decode worker has room for them, reserving it now, as tidepool's gateway does: online
 * first (FIFO, after the prefilled sequences waiting for room), offline only when no online
 * request waits and within the policy's offline limit. */
static void dispatch(sim *s)
{
    if (!s->reserve_dispatch)
        return;
    int moved = 0;
    for (;;) {
        sim_ideque *q = NULL;
        if (s->q_gw.n > 0)
            q = s->pend_on.n == 0 ? &s->q_gw : NULL;
        else if (s->q_off.n > 0 && s->offline_running < s->offline_limit && s->pend_on.n == 0 &&
                 s->pend_off.n == 0)
            q = &s->q_off;
        if (!q)
            break;
        int id = sim_ideque_front(q);
        sreq *r = &s->reqs[id];
        int w = choose_decode(s, r->need, 1);
        if (w < 0)
            break;
        sim_ideque_pop_front(q);
        hold(s, id, w);
        if (r->offline)
            s->offline_running++;
        else
            s->online_running++;
        s->q_on_tokens += r->prompt;
        sim_ideque_push_back(&s->q_on, id);
        moved = 1;
    }
    if (moved)
        wake_prefill(s);
}

static void on_prefill_done(sim *s, int w)
{
    sworker *x = &s->w[w];
    int freed = 0;
    for (int i = 0; i < x->batch.n; i++) {
        int id = x->batch.v[i];
        sreq *r = &s->reqs[id];
        if (r->first_ms < 0) {
            r->first_ms = s->now;
            if (!r->offline)
                dpush(&s->win_ttft, &s->n_win, &s->cap_win, r->first_ms - r->arrival_ms);
        }
        if (r->gen < 1)
            r->gen = 1;
        if (r->gen >= r->out) {
            if (r->worker >= 0) { /* its room, reserved at dispatch */
                unreserve(s, id);
                freed = 1;
            }
            finish_req(s, id);
            continue;
        }
        if (!r->offline)
            s->online_decoding++;
        double xfer = kv_transfer_ms(s, r);
        double arrive = fmax(s->now + xfer / s->cm->n_layer, x->batch_start_ms + xfer);
        if (r->worker >= 0 && accepts(s, r->worker)) { /* reserved at dispatch */
            r->state = RQ_XFER;
            sim_heap_push(&s->ev, arrive, EV_XFER_DONE, id, r->epoch);
            continue;
        }
        if (r->worker >= 0) { /* its worker left decode meanwhile */
            unreserve(s, id);
            freed = 1;
        }
        place_decode(s, id, arrive, 0);
    }
    x->batch.n = 0;
    x->busy = 0;
    if (x->changing)
        switch_start(s, w, 0);
    else
        start_prefill(s, w);
    if (freed) {
        drain_pending(s, -1);
        dispatch(s);
    }
}

// --- role changes, preemption, the policy tick ---------------------------------------------

static void begin_change(sim *s, int w, int to)
{
    sworker *x = &s->w[w];
    ASSERT(x->role != to && !x->changing);
    x->changing = 1;
    x->target = to;
    s->changes++;
    if (x->role == POLICY_ROLE_DECODE) {
        dec_list_remove(s, w);
        if (!x->stepping) /* idle: nothing to migrate or drain */
            migrate_all(s, w);
    } else if (!x->busy) {
        switch_start(s, w, 0);
    }
}

static void on_switch_done(sim *s, int w)
{
    sworker *x = &s->w[w];
    x->role = x->target;
    x->changing = 0;
    x->role_since_ms = s->now;
    if (x->role == POLICY_ROLE_DECODE) {
        x->step = 0;
        dec_list_add(s, w);
        drain_pending(s, w);
        dispatch(s);
    } else {
        start_prefill(s, w);
    }
}

/* Preempt up to k offline sequences, latest joined first (least progress lost); they
 * restart later from prompt + tokens so far. */
static void preempt(sim *s, int k)
{
    while (k > 0 && s->off_dec.n > 0) {
        int id = s->off_dec.v[--s->off_dec.n];
        uint32_t epoch = (uint32_t)s->off_dec_epoch.v[--s->off_dec_epoch.n];
        sreq *r = &s->reqs[id];
        if (r->epoch != epoch || r->state != RQ_RUNNING || !r->offline)
            continue;
        int w = r->worker;
        take_out(s, id);
        r->state = RQ_QUEUED;
        sim_ideque_push_front(&s->q_off, id);
        s->offline_running--;
        s->preemptions++;
        k--;
        drain_pending(s, w);
    }
}

static int cmp_pair(const void *a, const void *b)
{
    const double *x = a, *y = b;
    return (x[0] > y[0]) - (x[0] < y[0]);
}

static void on_tick(sim *s)
{
    int n = s->n_workers, np = 0;
    for (int i = 0; i < n; i++) {
        sworker *x = &s->w[i];
        policy_worker *p = &s->pin[i];
        memset(p, 0, sizeof(*p));
        p->index = i;
        p->role = x->role;
        p->state = x->changing ? POLICY_WORKER_DRAINING : POLICY_WORKER_READY;
        p->changing = x->changing != 0;
        p->target_role = x->changing ? x->target : 0;
        p->role_age_ms = (int64_t)(s->now - x->role_since_ms);
        if (x->role == POLICY_ROLE_DECODE) {
            p->running = x->running + x->incoming.n;
            p->kv_blocks_used = (int)(x->kv_reserved / 16);
            p->kv_blocks_total = (int)(s->kv_cap / 16);
            p->decode_batch = x->running;
            if (x->running > 0) {
                p->tpot_p90_ms = x->last_step_ms;
                s->step_ms_buf[2 * np] = x->last_step_ms;
                s->step_ms_buf[2 * np + 1] = x->running;
                np++;
            }
        } else {
            p->running = x->batch.n;
        }
    }
    /* TPOT p90 over the sequences being decoded: each decode worker's step time, weighted
     * by its batch. */
    double tpot_p90 = 0;
    if (np > 0) {
        qsort(s->step_ms_buf, (size_t)np, 2 * sizeof(double), cmp_pair);
        double total = 0, acc = 0;
        for (int i = 0; i < np; i++)
            total += s->step_ms_buf[2 * i + 1];
        for (int i = 0; i < np; i++) {
            acc += s->step_ms_buf[2 * i + 1];
            if (acc >= 0.9 * total) {
                tpot_p90 = s->step_ms_buf[2 * i];
                break;
            }
        }
    }
    policy_input in = {.now_ms = (int64_t)s->now, .workers = s->pin, .n_workers = n};
    policy_cluster *c = &in.cluster;
    c->queued_prompt_tokens = s->q_on_tokens;
    if (s->reserve_dispatch) {
        /* What tidepool's gateway reports: prompts are queued at the prefill workers (their
         * tokens come with heartbeats, not their wait), and requests waiting at the gateway
         * wait for decode room, so they count as decoding. */
        c->online_decoding = s->online_decoding + (int)s->q_gw.n;
    } else {
        c->oldest_wait_ms =
            s->q_on.n ? (int64_t)(s->now - s->reqs[sim_ideque_front(&s->q_on)].arrival_ms) : 0;
        c->online_queued = (int)s->q_on.n;
        c->online_decoding = s->online_decoding;
    }
    c->online_running = s->online_running;
    c->prompt_tokens_arrived = s->prompt_tokens_arrived;
    c->offline_queued = (int)s->q_off.n;
    c->offline_running = s->offline_running;
    c->offline_oldest_wait_ms =
        s->q_off.n ? (int64_t)(s->now - s->reqs[sim_ideque_front(&s->q_off)].arrival_ms) : 0;
    c->ttft_p90_ms = sim_stats_percentile(s->win_ttft, s->n_win, 90);
    c->tpot_p90_ms = tpot_p90;
    s->n_win = 0;

    policy_output out;
    int rc = policy_decide(&s->pp, &s->pst, &in, &out);
    ASSERT(rc == 0);
    if (opt_verbose && (out.n_actions > 0 || fmod(s->now, 10000) < s->tick_ms / 2))
        fprintf(stderr,
                "t=%7.1fs P=%d D=%d p_prefill=%.2f p_decode=%.2f queue=%lld tok decoding=%d "
                "pending=%zu offline run=%d limit=%d preempt=%d%s\n",
                s->now / 1e3, out.n_prefill, out.n_decode, out.prefill_pressure,
                out.decode_pressure, (long long)s->q_on_tokens, s->online_decoding, s->pend_on.n,
                s->offline_running, out.offline_max_running, out.offline_preempt,
                out.n_actions
                    ? (out.actions[0].role == POLICY_ROLE_PREFILL ? "  -> prefill" : "  -> decode")
                    : "");
    for (int i = 0; i < out.n_actions; i++)
        begin_change(s, out.actions[i].worker, out.actions[i].role);
    s->offline_limit = out.offline_max_running;
    if (out.offline_preempt > 0)
        preempt(s, out.offline_preempt);
    dispatch(s);
    wake_prefill(s);

    if (s->arrivals_done && s->q_on.n == 0 && s->q_gw.n == 0 && s->online_running == 0)
        s->stop = 1;
    else if (s->now >= s->hard_end_ms)
        s->stop = 1;
    else
        sim_heap_push(&s->ev, s->now + s->tick_ms, EV_TICK, 0, 0);
}

// --- arrivals and the run --------------------------------------------------------------------

static void schedule_next_arrival(sim *s)
{
    if (sim_workload_next(&s->wl, &s->next))
        sim_heap_push(&s->ev, s->next.arrival_s * 1e3, EV_ARRIVAL, 0, 0);
    else
        s->arrivals_done = 1;
}

static void on_arrival(sim *s)
{
    int id = req_alloc(s);
    sreq *r = &s->reqs[id];
    uint32_t epoch = r->epoch;
    memset(r, 0, sizeof(*r));
    r->epoch = epoch;
    r->arrival_ms = s->now;
    r->first_ms = -1;
    r->prompt = s->next.prompt;
    r->out = s->next.out;
    r->need = r->prompt + r->out;
    r->offline = (uint8_t)s->next.offline;
    r->worker = -1;
    r->state = RQ_QUEUED;
    if (r->offline) {
        s->n_offline++;
        sim_ideque_push_back(&s->q_off, id);
    } else {
        s->n_online++;
        s->prompt_tokens_arrived += r->prompt;
        if (s->reserve_dispatch) {
            sim_ideque_push_back(&s->q_gw, id);
        } else {
            s->q_on_tokens += r->prompt;
            sim_ideque_push_back(&s->q_on, id);
        }
    }
    dispatch(s);
    wake_prefill(s);
    schedule_next_arrival(s);
}

/* One simulation. n_prefill: initial prefill workers; tidal: whether roles may change. */
static void sim_run(const costmodel *cm, const policy_params *pp, const sim_workload *wl,
                    int n_workers, int n_prefill, int tidal, const char *name, sim_result *res)
{
    sim s;
    memset(&s, 0, sizeof(s));
    s.cm = cm;
    s.pp = *pp;
    if (!tidal) {
        s.pp.max_changes = 0;
        s.pp.max_change_frac = 0;
    }
    s.n_workers = n_workers;
    s.tidal = tidal;
    s.drain = strcmp(opt_role_change, "drain") == 0;
    s.reserve_dispatch = strcmp(opt_decode_reserve, "dispatch") == 0;
    s.tick_ms = opt_tick_ms;
    s.switch_ms = opt_switch_ms;
    s.ttft_slo_ms = opt_ttft_slo_ms;
    s.tpot_slo_ms = opt_tpot_slo_ms;
    s.kv_cap = costmodel_kv_capacity_tokens(cm);
    s.wl = *wl;
    s.wl.pos = 0;
    double span_s = sim_workload_span_s(wl);
    s.hard_end_ms = (1.5 * span_s + 300) * 1e3; /* then unfinished requests count as missed */
    s.free_head = -1;
    sim_rng_seed(&s.prng, (uint64_t)opt_seed ^ 0x5eed5eed5eedull);
    policy_state_init(&s.pst);
    s.w = sim_mem_realloc(NULL, (size_t)n_workers * sizeof(sworker));
    memset(s.w, 0, (size_t)n_workers * sizeof(sworker));
    s.dec_list = sim_mem_realloc(NULL, (size_t)n_workers * sizeof(int));
    s.pin = sim_mem_realloc(NULL, (size_t)n_workers * sizeof(policy_worker));
    s.step_ms_buf = sim_mem_realloc(NULL, (size_t)n_workers * 2 * sizeof(double));
    for (int i = 0; i < n_workers; i++) {
        sworker *x = &s.w[i];
        x->role = i < n_prefill ? POLICY_ROLE_PREFILL : POLICY_ROLE_DECODE;
        x->role_since_ms = -1e12; /* settled: the policy may move it at once */
        x->dec_pos = -1;
        if (x->role == POLICY_ROLE_DECODE)
            dec_list_add(&s, i);
        else
            start_prefill(&s, i); /* nothing queued yet: lists it as idle */
    }
    schedule_next_arrival(&s);
    sim_heap_push(&s.ev, 0, EV_TICK, 0, 0);

    sim_heap_event e;
    while (!s.stop && sim_heap_pop(&s.ev, &e) == 0) {
        s.now = e.t_ms;
        switch (e.type) {
        case EV_ARRIVAL:
            on_arrival(&s);
            break;
        case EV_PREFILL_DONE:
            on_prefill_done(&s, e.id);
            break;
        case EV_XFER_DONE:
            on_xfer_done(&s, e.id, e.epoch);
            break;
        case EV_STEP_DONE:
            on_step_done(&s, e.id);
            break;
        case EV_SWITCH_DONE:
            on_switch_done(&s, e.id);
            break;
        case EV_TICK:
            on_tick(&s);
            break;
        default:
            ASSERT(0);
        }
    }

    /* Book-keeping invariants: counters never go negative; a run that ended because every
     * online request finished has none left anywhere. */
    ASSERT(s.online_running >= 0 && s.online_decoding >= 0 && s.offline_running >= 0);
    for (int i = 0; i < n_workers; i++)
        ASSERT(s.w[i].kv_reserved >= 0 && s.w[i].assigned >= 0 && s.w[i].running >= 0 &&
               s.w[i].ctx_sum >= 0);
    if (s.now < s.hard_end_ms) {
        ASSERT(s.online_running == 0 && s.online_decoding == 0 && s.q_on.n == 0 && s.q_gw.n == 0);
        ASSERT((int64_t)s.n_fin == s.n_online);
    }

    memset(res, 0, sizeof(*res));
    snprintf(res->name, sizeof(res->name), "%s", name);
    res->n_online = s.n_online;
    res->n_good = s.n_good;
    res->n_finished = (int64_t)s.n_fin;
    res->n_offline = s.n_offline;
    res->n_offline_done = s.n_offline_done;
    res->span_s = span_s;
    res->end_s = s.now / 1e3;
    res->goodput = (double)s.n_good / span_s;
    res->attain_pct = s.n_online ? 100.0 * (double)s.n_good / (double)s.n_online : 100;
    res->ttft_mean = sim_stats_mean(s.ttft, s.n_fin);
    res->ttft_p99 = sim_stats_percentile(s.ttft, s.n_fin, 99);
    res->tpot_mean = sim_stats_mean(s.tpot, s.n_fin);
    res->tpot_p99 = sim_stats_percentile(s.tpot, s.n_fin, 99);
    res->offline_rps = res->end_s > 0 ? (double)s.n_offline_done / res->end_s : 0;
    res->offline_tok_s = res->end_s > 0 ? (double)s.offline_tokens / res->end_s : 0;
    res->changes = s.changes;
    res->preemptions = s.preemptions;
    for (int i = 0; i < n_workers; i++)
        res->final_prefill += s.w[i].role == POLICY_ROLE_PREFILL;

    for (int i = 0; i < n_workers; i++) {
        sim_ivec_free(&s.w[i].batch);
        sim_ivec_free(&s.w[i].incoming);
        sim_heap_fin_free(&s.w[i].fin);
    }
    free(s.w);
    free(s.dec_list);
    free(s.pin);
    free(s.step_ms_buf);
    free(s.reqs);
    sim_heap_free(&s.ev);
    sim_ideque_free(&s.q_on);
    sim_ideque_free(&s.q_off);
    sim_ideque_free(&s.q_gw);
    sim_ideque_free(&s.pend_on);
    sim_ideque_free(&s.pend_off);
    sim_ivec_free(&s.idle_prefill);
    sim_ivec_free(&s.off_dec);
    sim_ivec_free(&s.off_dec_epoch);
    free(s.ttft);
    free(s.tpot);
    free(s.win_ttft);
}

// --- main ----------------------------------------------------------------------------------

/* Worker-seconds one online request of this shape costs (prefill + decode share), from the
 * cost model: the basis of the automatic rate. */
static double shape_worker_s(const costmodel *cm, const sim_workload_shape *sh, double tpot_slo_ms)
{
    double p = (sh->prompt_lo + sh->prompt_hi) / 2.0, o = (sh->out_lo + sh->out_hi) / 2.0;
    double ws_p = p / costmodel_prefill_tokens_per_s(cm, p);
    double ctx = p + o / 2;
    int b = costmodel_decode_batch_within(cm, 0.8 * tpot_slo_ms, ctx);
    double tok_s = b / (costmodel_decode_step_ms(cm, b, b * ctx) / 1e3);
    return ws_p + (o - 1) / tok_s;
}

static void print_header_row(void)
{
    printf("%-14s %8s %7s %9s %9s %9s %9s %7s %8s %8s %7s %7s\n", "policy", "goodput", "SLO",
           "TTFT", "TTFT", "TPOT", "TPOT", "role", "offline", "offline", "preempt", "final");
    printf("%-14s %8s %7s %9s %9s %9s %9s %7s %8s %8s %7s %7s\n", "", "req/s", "met %", "mean ms",
           "p99 ms", "mean ms", "p99 ms", "changes", "req/s", "tok/s", "", "P:D");
}

static void print_row(const sim_result *r, int n_workers)
{
    char pd[24];
    snprintf(pd, sizeof(pd), "%d:%d", r->final_prefill, n_workers - r->final_prefill);
    printf("%-14s %8.2f %7.2f %9.1f %9.1f %9.2f %9.2f %7lld %8.2f %8.0f %7lld %7s\n", r->name,
           r->goodput, r->attain_pct, r->ttft_mean, r->ttft_p99, r->tpot_mean, r->tpot_p99,
           (long long)r->changes, r->offline_rps, r->offline_tok_s, (long long)r->preemptions, pd);
}

static int result_rank_cmp(const void *a, const void *b)
{
    const sim_result *x = a, *y = b;
    if (x->goodput != y->goodput)
        return x->goodput > y->goodput ? -1 : 1;
    if (x->attain_pct != y->attain_pct)
        return x->attain_pct > y->attain_pct ? -1 : 1;
    int xt = strcmp(x->name, "tidal") == 0, yt = strcmp(y->name, "tidal") == 0;
    if (xt != yt)
        return xt ? -1 : 1;
    return strcmp(x->name, y->name);
}

static double wall_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    log_init("tidepool-sim", LOG_LEVEL_WARN);
    int rc = config_load(settings, "tidepool-sim", argc, argv);
    if (rc != 0) {
        config_free(settings);
        return rc == 1 ? 0 : 2;
    }
    int status = 2;
    sim_workload wl;
    memset(&wl, 0, sizeof(wl));
    sim_result *results = NULL;
    costmodel cm;
    char err[512];
    int n = (int)opt_workers;

    if (costmodel_preset(opt_preset, &cm) < 0) {
        fprintf(stderr,
                "tidepool-sim: --preset: unknown preset '%s' (want a100-llama3-8b or "
                "h100-llama3-8b, optionally with :dilate=K, 1 <= K <= 1000)\n",
                opt_preset);
        goto out;
    }
    if (opt_max_seqs > 0)
        cm.max_seqs = (int)opt_max_seqs;
    if (opt_max_batch_tokens > 0)
        cm.prefill_token_budget = (int)opt_max_batch_tokens;
    if (strcmp(opt_role_change, "migrate") != 0 && strcmp(opt_role_change, "drain") != 0) {
        fprintf(stderr, "tidepool-sim: --role-change: want migrate or drain, not '%s'\n",
                opt_role_change);
        goto out;
    }
    if (strcmp(opt_decode_reserve, "prefill") != 0 && strcmp(opt_decode_reserve, "dispatch") != 0) {
        fprintf(stderr, "tidepool-sim: --decode-reserve: want prefill or dispatch, not '%s'\n",
                opt_decode_reserve);
        goto out;
    }
    if (costmodel_check(&cm, err, sizeof(err)) < 0) {
        fprintf(stderr, "tidepool-sim: %s\n", err);
        goto out;
    }
    int static_p = -1;
    if (strncmp(opt_policy, "static:", 7) == 0) {
        char *end;
        long v = strtol(opt_policy + 7, &end, 10);
        if (end == opt_policy + 7 || *end || v < 1 || v > n - 1) {
            fprintf(stderr, "tidepool-sim: --policy: static:P needs 1 <= P <= %d\n", n - 1);
            goto out;
        }
        static_p = (int)v;
    } else if (strcmp(opt_policy, "tidal") != 0) {
        fprintf(stderr, "tidepool-sim: --policy: want tidal or static:P, not '%s'\n", opt_policy);
        goto out;
    }
    if (opt_initial_prefill > n - 1) {
        fprintf(stderr, "tidepool-sim: --initial-prefill must be <= %d\n", n - 1);
        goto out;
    }

    double rate = opt_rate;
    const char *wl_name;
    if (opt_trace && *opt_trace) {
        if (sim_workload_load_trace(&wl, opt_trace, costmodel_kv_capacity_tokens(&cm), err,
                                sizeof(err)) < 0) {
            fprintf(stderr, "tidepool-sim: --trace: %s\n", err);
            goto out;
        }
        wl_name = opt_trace;
    } else if (strcmp(opt_workload, "phase-shift") == 0) {
        if (rate <= 0) {
            const sim_workload_shape *sh = sim_workload_shapes;
            double wa = shape_worker_s(&cm, &sh[SIM_WORKLOAD_SHAPE_PREFILL_HEAVY], opt_tpot_slo_ms);
            double wb = shape_worker_s(&cm, &sh[SIM_WORKLOAD_SHAPE_DECODE_HEAVY], opt_tpot_slo_ms);
            rate = opt_load * n / fmax(wa, wb);
            if (opt_offline_frac < 1)
                rate /= 1 - opt_offline_frac;
        }
        sim_workload_phase_shift(&wl, rate, opt_duration_s, opt_phase_s, opt_offline_frac,
                             (uint64_t)opt_seed);
        wl_name = "phase-shift";
    } else {
        fprintf(stderr, "tidepool-sim: --workload: want phase-shift (or give --trace)\n");
        goto out;
    }

    double mean_prompt, mean_ctx;
    sim_workload_shape_stats(&wl, &mean_prompt, &mean_ctx);
    policy_params pp = policy_default_params();
    pp.ttft_slo_ms = opt_ttft_slo_ms;
    pp.tpot_slo_ms = opt_tpot_slo_ms;
    pp.prefill_tokens_per_s = costmodel_prefill_tokens_per_s(&cm, mean_prompt);
    pp.decode_seqs_per_worker = costmodel_decode_batch_within(&cm, 0.8 * opt_tpot_slo_ms, mean_ctx);
    pp.min_role_ms = (int64_t)(opt_min_role_s * 1e3);
    pp.max_changes = (int)opt_max_changes;
    pp.max_change_frac = opt_max_change_frac;
    pp.min_per_role = (int)opt_min_per_role;
    pp.window_ms = (int64_t)(opt_window_s * 1e3);
    if (pp.window_ms < 1)
        pp.window_ms = 1;
    pp.act_pressure = opt_act_pressure;
    pp.band = opt_band;
    pp.smooth_ms = (int64_t)(opt_smooth_s * 1e3);
    pp.reverse_hold_ms = (int64_t)(opt_reverse_hold_s * 1e3);
    if (policy_params_check(&pp, err, sizeof(err)) < 0) {
        fprintf(stderr, "tidepool-sim: %s\n", err);
        goto out;
    }

    printf("tidepool-sim: EMULATED results (cost model %s; no accelerator was used)\n", cm.name);
    if (wl.is_trace)
        printf("workload: trace %s, %zu requests over %.0f s, %d workers\n", wl_name, wl.n_recs,
               sim_workload_span_s(&wl), n);
    else
        printf("workload: phase-shift, %d workers, %.2f req/s (%.0f%% offline), %.0f s, "
               "phases of %.0f s, seed %lld\n",
               n, rate, 100 * opt_offline_frac, opt_duration_s, opt_phase_s, opt_seed);
    printf("SLO: TTFT <= %.0f ms, TPOT <= %.0f ms; capacity estimates per worker: prefill "
           "%.0f tok/s, decode %.0f seqs; KV %.0f tokens/worker\n",
           opt_ttft_slo_ms, opt_tpot_slo_ms, pp.prefill_tokens_per_s, pp.decode_seqs_per_worker,
           costmodel_kv_capacity_tokens(&cm));
    printf("engine: max-seqs %d, max-batch-tokens %d; a decode worker leaving decode: %s; decode "
           "room reserved at %s; policy tick %.0f ms\n",
           cm.max_seqs, cm.prefill_token_budget, opt_role_change, opt_decode_reserve, opt_tick_ms);

    int tidal_p = opt_initial_prefill > 0 ? (int)opt_initial_prefill : n / 2;
    int n_runs = 0;
    results = sim_mem_realloc(NULL, (size_t)(n + 2) * sizeof(sim_result));
    double t0 = wall_s();
    if (opt_compare_static) {
        sim_run(&cm, &pp, &wl, n, tidal_p, 1, "tidal", &results[n_runs++]);
        int last = 0;
        for (int k = 1; k < n; k++) {
            int p;
            if (n <= 20) {
                p = k;
            } else {
                if (k > 9)
                    break;
                p = (int)lround(k * n / 10.0);
                if (p < 1)
                    p = 1;
                if (p > n - 1)
                    p = n - 1;
                if (p == last)
                    continue;
            }
            last = p;
            char name[32];
            snprintf(name, sizeof(name), "static:%d", p);
            sim_run(&cm, &pp, &wl, n, p, 0, name, &results[n_runs++]);
        }
        qsort(results, (size_t)n_runs, sizeof(sim_result), result_rank_cmp);
    } else if (static_p > 0) {
        char name[32];
        snprintf(name, sizeof(name), "static:%d", static_p);
        sim_run(&cm, &pp, &wl, n, static_p, 0, name, &results[n_runs++]);
    } else {
        sim_run(&cm, &pp, &wl, n, tidal_p, 1, "tidal", &results[n_runs++]);
    }
    double wall = wall_s() - t0;

    printf("requests: %lld online, %lld offline; simulated %.0f s\n",
           (long long)results[0].n_online, (long long)results[0].n_offline, results[0].end_s);
    print_header_row();
    for (int i = 0; i < n_runs; i++)
        print_row(&results[i], n);
    if (opt_compare_static) {
        const sim_result *best_static = NULL, *tidal = NULL;
        for (int i = 0; i < n_runs; i++) {
            if (strcmp(results[i].name, "tidal") == 0)
                tidal = &results[i];
            else if (!best_static)
                best_static = &results[i];
        }
        int rank = 1; /* 1 + the runs with strictly more goodput: ties share a rank */
        for (int i = 0; i < n_runs; i++)
            rank += results[i].goodput > tidal->goodput;
        printf("tidal ranks %d of %d by goodput; best static %s: %.2f req/s, tidal %.2f req/s "
               "(%+.1f%%)\n",
               rank, n_runs, best_static->name, best_static->goodput, tidal->goodput,
               best_static->goodput > 0
                   ? 100 * (tidal->goodput - best_static->goodput) / best_static->goodput
                   : 0);
    }
    fflush(stdout);
    fprintf(stderr, "tidepool-sim: %d run(s) in %.2f s wall\n", n_runs, wall);
    status = 0;
out:
    free(results);
    sim_workload_free(&wl);
    config_free(settings);
    return status;
}
