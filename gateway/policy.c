/*
 * policy: the tidal rule (see policy.h and docs/scheduler.md).
 *
 * Design: signals are smoothed, not pressures. The raw figures (queued prompt tokens,
 * prompt-token arrival rate, online decoding sequences, KV use, latency p90s) go through an
 * EWMA with a time constant, and each call turns them into pressures with the *current*
 * worker counts, so a role change shows up in the pressures at once and a projected move
 * is just the same formula with one worker more or less.
 */
#include "policy.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "protocol.h"

_Static_assert((int)POLICY_ROLE_PREFILL == (int)PROTO_ROLE_PREFILL, "role values");
_Static_assert((int)POLICY_ROLE_DECODE == (int)PROTO_ROLE_DECODE, "role values");
_Static_assert((int)POLICY_ROLE_MIXED == (int)PROTO_ROLE_MIXED, "role values");
_Static_assert((int)POLICY_WORKER_READY == (int)PROTO_STATE_READY, "state values");
_Static_assert((int)POLICY_WORKER_DRAINING == (int)PROTO_STATE_DRAINING, "state values");

/* A role with no worker at all but some load has this pressure. */
#define PRESSURE_NO_CAPACITY 1e9

policy_params policy_default_params(void)
{
    return (policy_params){
        .ttft_slo_ms = 2000,
        .tpot_slo_ms = 50,
        .prefill_tokens_per_s = 10000,
        .decode_seqs_per_worker = 128,
        .queue_budget = 0.5,
        .kv_high = 0.9,
        .smooth_ms = 5000,
        .reverse_hold_ms = 7500,
        .act_pressure = 0.8,
        .band = 1.25,
        .min_role_ms = 30000,
        .max_changes = 2,
        .max_change_frac = 0.25,
        .window_ms = 10000,
        .min_per_role = 1,
        .start_from_estimate = 1,
        .capacity_moves = 1,
        .donor_guard = 1,
        .startup_fix = 1,
        .startup_settle = 1,
        .warmup_ms = 30000,
        .target_pressure = 0.7,
        .offline_target = 0.6,
        .preempt_pressure = 0.95,
        .offline_max_wait_ms = 60000,
        .offline_aging_per_worker = 1,
    };
}

int policy_params_check(const policy_params *p, char *err, size_t err_len)
{
#define CHECK(cond, what)                                                                          \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            snprintf(err, err_len, "policy: %s", what);                                            \
            return -1;                                                                             \
        }                                                                                          \
    } while (0)
    CHECK(p->ttft_slo_ms > 0, "ttft_slo_ms must be > 0");
    CHECK(p->tpot_slo_ms > 0, "tpot_slo_ms must be > 0");
    CHECK(p->prefill_tokens_per_s > 0, "prefill_tokens_per_s must be > 0");
    CHECK(p->decode_seqs_per_worker > 0, "decode_seqs_per_worker must be > 0");
    CHECK(p->decode_tokens_per_s >= 0, "decode_tokens_per_s must be >= 0");
    CHECK(p->queue_budget > 0 && p->queue_budget <= 1, "queue_budget must be in (0, 1]");
    CHECK(p->kv_high > 0 && p->kv_high <= 1, "kv_high must be in (0, 1]");
    CHECK(p->smooth_ms >= 0, "smooth_ms must be >= 0");
    CHECK(p->reverse_hold_ms >= 0 && p->reverse_hold_ms <= 86400000,
          "reverse_hold_ms must be in [0, 86400000]");
    CHECK(p->act_pressure > 0, "act_pressure must be > 0");
    CHECK(p->band >= 1, "band must be >= 1");
    CHECK(p->min_role_ms >= 0, "min_role_ms must be >= 0");
    CHECK(p->max_changes >= 0 && p->max_changes <= POLICY_MAX_HISTORY,
          "max_changes must be in [0, 1024]");
    CHECK(p->max_change_frac >= 0 && p->max_change_frac <= 1, "max_change_frac must be in [0, 1]");
    CHECK(p->window_ms > 0, "window_ms must be > 0");
    CHECK(p->min_per_role >= 1, "min_per_role must be >= 1");
    CHECK(p->target_pressure > 0 && p->target_pressure <= 10,
          "target_pressure must be in (0, 10]");
    CHECK(p->warmup_ms >= 0, "warmup_ms must be >= 0");
    CHECK(p->start_from_estimate == 0 || p->start_from_estimate == 1,
          "start_from_estimate must be 0 or 1");
    CHECK(p->capacity_moves == 0 || p->capacity_moves == 1, "capacity_moves must be 0 or 1");
    CHECK(p->donor_guard == 0 || p->donor_guard == 1, "donor_guard must be 0 or 1");
    CHECK(p->startup_fix == 0 || p->startup_fix == 1, "startup_fix must be 0 or 1");
    CHECK(p->startup_settle == 0 || p->startup_settle == 1, "startup_settle must be 0 or 1");
    CHECK(p->offline_target >= 0, "offline_target must be >= 0");
    CHECK(p->preempt_pressure > 0, "preempt_pressure must be > 0");
    CHECK(p->offline_max_wait_ms >= 0, "offline_max_wait_ms must be >= 0");
    CHECK(p->offline_aging_per_worker >= 0, "offline_aging_per_worker must be >= 0");
#undef CHECK
    return 0;
}

void policy_state_init(policy_state *st)
{
    memset(st, 0, sizeof(*st));
}

// --- pressures ---------------------------------------------------------------------------

/* One set of signals, and the capacities they were seen with (cap0). */
typedef struct {
    const policy_params *p;
    const policy_signals *st;
    double cap_p0, cap_d0; /* prefill / decode worker capacity (mixed = 0.5 each) */
    double act;            /* pressure a role needs to gain a worker */
} view;

/* The prefill load in workers at pressure 1 (the load terms at one worker): the queue's
 * drain time against the queue budget, and the prompt-token arrival rate. */
static double load_prefill(const view *v)
{
    const policy_params *p = v->p;
    const policy_signals *st = v->st;
    double q = 1e3 * st->queued_tokens / p->prefill_tokens_per_s / (p->queue_budget * p->ttft_slo_ms);
    return fmax(q, st->prompt_rate / p->prefill_tokens_per_s);
}

/* Decode's own sequences (policy.h 1d): those past their prefill, the part of the slots
 * prompts hold that prefill's spare capacity could use (1 - its load pressure r), and the
 * same share of the requests waiting for room. */
static double own_sequences(const view *v)
{
    const policy_signals *st = v->st;
    double dec = st->decoding, pre = fmin(st->prefilling, dec);
    double wait = fmin(st->wait_room, dec - pre);
    double past = dec - pre - wait, held = past + pre;
    double r = v->cap_p0 > 0 ? fmin(1.0, load_prefill(v) / v->cap_p0) : 1.0;
    double mine = past + pre * (1 - r);
    return mine + (held > 0 ? wait * mine / held : wait);
}

/* The decode load in workers at pressure 1: online sequences over the slots, KV use
 * (measured with cap_d0) and, with tokens set and decode_tokens_per_s known, requests/s
 * times the output tokens per ended request over a worker's token rate. The sequence count
 * under-counts a lightly loaded worker (its steps are short, its sequences done sooner);
 * the token term says how many workers full batches need. It is used where under-counting
 * decode hurts (the estimate, and decode as the donor of a move), not to make decode gain
 * workers or to hold back offline work: there it would take slack from prefill that a
 * turning tide needs (docs/tidal.md). */
static double load_decode_with(const view *v, int tokens, int own)
{
    const policy_params *p = v->p;
    const policy_signals *st = v->st;
    double u = (own ? own_sequences(v) : st->decoding) / p->decode_seqs_per_worker;
    if (tokens && p->decode_tokens_per_s > 0)
        u = fmax(u, st->arrival_rate * st->out_per_req / p->decode_tokens_per_s);
    return fmax(u, st->kv_frac / p->kv_high * v->cap_d0);
}

static double load_decode(const view *v, int tokens)
{
    return load_decode_with(v, tokens, 0);
}

/* Decode's load as the gainer of a move: its own sequences (policy.h 1d), no token term. */
static double load_decode_gain(const view *v)
{
    return load_decode_with(v, 0, 1);
}

/* Prefill pressure with cap prefill workers. Load terms scale with 1/cap exactly; the
 * latency terms (TTFT, oldest wait) were measured with cap_p0 and are projected the same
 * way, so a projected move changes every term consistently. */
static double pressure_prefill(const view *v, double cap)
{
    const policy_params *p = v->p;
    const policy_signals *st = v->st;
    double lat = fmax(st->ttft_ms, st->oldest_wait_ms) / p->ttft_slo_ms;
    if (cap <= 0)
        return (st->queued_tokens > 0 || st->prompt_rate > 0 || lat > 0) ? PRESSURE_NO_CAPACITY : 0;
    double scale = v->cap_p0 > 0 ? v->cap_p0 / cap : 1;
    return fmax(load_prefill(v) / cap, lat * scale);
}

/* Decode pressure with cap decode workers; tokens: count the token term (load_decode);
 * own: decode's own sequences (load_decode_gain). */
static double pressure_decode_with(const view *v, double cap, int tokens, int own)
{
    const policy_params *p = v->p;
    const policy_signals *st = v->st;
    double lat = st->tpot_ms / p->tpot_slo_ms;
    if (cap <= 0)
        return (st->decoding > 0 || st->arrival_rate > 0 || lat > 0 || st->kv_frac > 0)
                   ? PRESSURE_NO_CAPACITY
                   : 0;
    double scale = v->cap_d0 > 0 ? v->cap_d0 / cap : 1;
    return fmax(load_decode_with(v, tokens, own) / cap, lat * scale);
}

static double pressure_decode(const view *v, double cap)
{
    return pressure_decode_with(v, cap, 0, 0);
}

// --- inputs and smoothing ----------------------------------------------------------------

static int effective_role(const policy_worker *w)
{
    return w->changing ? w->target_role : w->role;
}

/* Counted at all: alive, and not leaving for good (draining without a role change). */
static int counted(const policy_worker *w)
{
    if (w->state == POLICY_WORKER_DOWN)
        return 0;
    if (w->state == POLICY_WORKER_DRAINING && !w->changing)
        return 0;
    return 1;
}

static int valid_role(int r)
{
    return r == POLICY_ROLE_PREFILL || r == POLICY_ROLE_DECODE || r == POLICY_ROLE_MIXED;
}

static int check_input(const policy_input *in)
{
    if (in->n_workers < 0 || (in->n_workers > 0 && !in->workers))
        return -1;
    for (int i = 0; i < in->n_workers; i++) {
        const policy_worker *w = &in->workers[i];
        if (!valid_role(w->role))
            return -1;
        if (w->changing && !valid_role(w->target_role))
            return -1;
        if (w->state != POLICY_WORKER_READY && w->state != POLICY_WORKER_DRAINING &&
            w->state != POLICY_WORKER_DOWN)
            return -1;
    }
    return 0;
}

static void ewma(double *x, double raw, double alpha)
{
    *x += alpha * (raw - *x);
}

/* When the traffic began (the call before the first that saw online work; the first call
 * until then): the rates' running mean and the warm-up count from here. */
static int64_t traffic_start(const policy_state *st)
{
    return st->traffic_seen ? st->traffic_ms : st->first_ms;
}

/* This call's raw signals into *raw, and folded into the EWMAs of st. */
static void observe(const policy_params *p, policy_state *st, const policy_input *in,
                    policy_signals *raw)
{
    const policy_cluster *c = &in->cluster;
    double q_tokens = (double)(c->queued_prompt_tokens > 0 ? c->queued_prompt_tokens : 0);
    double kv_used = 0, kv_total = 0;
    double ttft_sum = 0, ttft_n = 0, tpot_sum = 0, tpot_w = 0;
    for (int i = 0; i < in->n_workers; i++) {
        const policy_worker *w = &in->workers[i];
        if (w->state == POLICY_WORKER_DOWN)
            continue;
        if (w->queued_prompt_tokens > 0)
            q_tokens += (double)w->queued_prompt_tokens;
        if (w->role == POLICY_ROLE_DECODE || w->role == POLICY_ROLE_MIXED) {
            kv_used += w->kv_blocks_used > 0 ? w->kv_blocks_used : 0;
            kv_total += w->kv_blocks_total > 0 ? w->kv_blocks_total : 0;
            if (w->tpot_p90_ms > 0) {
                double wt = w->decode_batch > 1 ? w->decode_batch : 1;
                tpot_sum += w->tpot_p90_ms * wt;
                tpot_w += wt;
            }
        }
        if ((w->role == POLICY_ROLE_PREFILL || w->role == POLICY_ROLE_MIXED) &&
            w->ttft_p90_ms > 0) {
            ttft_sum += w->ttft_p90_ms;
            ttft_n += 1;
        }
    }
    double decoding = c->online_decoding > 0 ? c->online_decoding : 0;
    /* of them: holding room before their prefill ended, waiting for room (policy.h 1d) */
    double pre = c->online_prefilling > 0 ? c->online_prefilling : 0;
    double wait = c->online_wait_room > 0 ? c->online_wait_room : 0;
    if (pre + wait > decoding) { /* inconsistent figures: trust the total */
        double f = decoding / (pre + wait);
        pre *= f, wait *= f;
    }
    double offline = c->offline_running > 0 ? c->offline_running : 0;
    double share = decoding + offline > 0 ? decoding / (decoding + offline) : 1;
    memset(raw, 0, sizeof(*raw));
    raw->queued_tokens = q_tokens;
    raw->oldest_wait_ms = (double)(c->oldest_wait_ms > 0 ? c->oldest_wait_ms : 0);
    raw->ttft_ms = c->ttft_p90_ms > 0 ? c->ttft_p90_ms : (ttft_n > 0 ? ttft_sum / ttft_n : 0);
    raw->tpot_ms = c->tpot_p90_ms > 0 ? c->tpot_p90_ms : (tpot_w > 0 ? tpot_sum / tpot_w : 0);
    raw->decoding = decoding;
    raw->prefilling = pre;
    raw->wait_room = wait;
    raw->kv_frac = kv_total > 0 ? kv_used / kv_total * share : 0;
    int64_t dt = st->initialized ? in->now_ms - st->last_ms : 0;
    if (dt > 0) {
        int64_t d_tok = c->prompt_tokens_arrived - st->last_prompt_tokens;
        if (d_tok < 0) /* counter reset (gateway restart): no information this time */
            d_tok = 0;
        raw->prompt_rate = 1e3 * (double)d_tok / (double)dt;
        int64_t d_arr = c->online_arrived - st->last_arrived;
        raw->arrival_rate = d_arr > 0 ? 1e3 * (double)d_arr / (double)dt : 0;
    }

    if (!st->initialized) { /* seed the EWMAs; the rates are unknown until two calls */
        st->initialized = 1;
        st->first_ms = in->now_ms;
        st->last_ms = in->now_ms;
        st->last_prompt_tokens = c->prompt_tokens_arrived;
        st->last_output_tokens = c->output_tokens_done;
        st->last_arrived = c->online_arrived;
        st->first_arrived = c->online_arrived;
        st->last_done = c->online_done;
        st->sig = *raw;
        return;
    }
    if (dt <= 0) /* the same instant, or time going backwards: nothing elapsed */
        return;
    if (!st->traffic_seen && (c->prompt_tokens_arrived > st->last_prompt_tokens ||
                              c->online_arrived > st->last_arrived)) {
        /* the first online work, which arrived since the previous call: the rates' mean and
         * the warm-up start there, not at the first call (a gateway is up, and calling, for
         * seconds before its first request: a mean over that idle time lags the mix) */
        st->traffic_seen = 1;
        st->traffic_ms = st->last_ms;
    }
    st->last_ms = in->now_ms;
    st->last_prompt_tokens = c->prompt_tokens_arrived;
    int64_t d_done = c->online_done - st->last_done;
    int64_t d_out = c->output_tokens_done - st->last_output_tokens;
    st->last_output_tokens = c->output_tokens_done;
    st->last_arrived = c->online_arrived;
    st->last_done = c->online_done;
    double alpha = p->smooth_ms > 0 ? 1 - exp(-(double)dt / (double)p->smooth_ms) : 1;
    policy_signals *x = &st->sig;
    /* The rates start as the mean since the traffic began (the first sample seeds them, not
     * a blend with 0) and become the EWMA once that is the heavier weight: one noisy
     * first second does not stand for the first smooth_ms. */
    double elapsed = (double)(in->now_ms - traffic_start(st));
    double alpha_rate = elapsed > 0 ? fmax(alpha, (double)dt / elapsed) : 1;
    st->rates_seeded = 1;
    ewma(&x->prompt_rate, raw->prompt_rate, alpha_rate);
    ewma(&x->arrival_rate, raw->arrival_rate, alpha_rate);
    if (d_done > 0 && d_out >= 0) { /* output tokens per ended request, weighted by requests */
        double per = (double)d_out / (double)d_done;
        if (x->out_per_req <= 0)
            x->out_per_req = per;
        else
            ewma(&x->out_per_req, per, 1 - exp(-(double)d_done / 1000.0));
    }
    ewma(&x->queued_tokens, raw->queued_tokens, alpha);
    ewma(&x->oldest_wait_ms, raw->oldest_wait_ms, alpha);
    ewma(&x->ttft_ms, raw->ttft_ms, alpha);
    ewma(&x->tpot_ms, raw->tpot_ms, alpha);
    ewma(&x->decoding, raw->decoding, alpha);
    ewma(&x->prefilling, raw->prefilling, alpha);
    ewma(&x->wait_room, raw->wait_room, alpha);
    ewma(&x->kv_frac, raw->kv_frac, alpha);
}

// --- decision ------------------------------------------------------------------------------

/* Changes in the window ending now (drops older calls from the ring). */
static int recent_changes(const policy_params *p, policy_state *st, int64_t now)
{
    while (st->n_hist > 0) {
        int oldest = (st->hist_head - st->n_hist + POLICY_MAX_HISTORY) % POLICY_MAX_HISTORY;
        if (now - st->change_ms[oldest] < p->window_ms && now >= st->change_ms[oldest])
            break;
        st->recent -= st->change_n[oldest];
        st->n_hist--;
    }
    return st->recent;
}

/* k changes made now, one ring entry per call. A full ring moves its newest entry to now
 * and adds them there: those changes then leave the window later than they would, never
 * sooner (the cap stays safe). */
static void remember_changes(policy_state *st, int64_t now, int k)
{
    if (st->n_hist == POLICY_MAX_HISTORY) {
        int newest = (st->hist_head - 1 + POLICY_MAX_HISTORY) % POLICY_MAX_HISTORY;
        st->change_ms[newest] = now;
        st->change_n[newest] += k;
    } else {
        st->change_ms[st->hist_head] = now;
        st->change_n[st->hist_head] = k;
        st->hist_head = (st->hist_head + 1) % POLICY_MAX_HISTORY;
        st->n_hist++;
    }
    st->recent += k;
    st->n_changes += k;
}

/* Whether role `to` should gain a worker from the other role, on these signals: its
 * pressure reaches act_pressure and exceeds band times the donor's pressure after losing
 * one worker. */
static int gains(const view *v, int to, double cap_p, double cap_d)
{
    const policy_params *p = v->p;
    if (p->donor_guard) {
        /* the donor's load after the move (prefill: the prompt rate; decode: sequences and
         * KV, not the token term, which lags a turning tide) stays within capacity, or at
         * most the gainer's: moving a worker must not just move the backlog */
        double lp = v->st->prompt_rate / p->prefill_tokens_per_s;
        double lg = to == POLICY_ROLE_PREFILL ? lp : load_decode_gain(v);
        double lgive = to == POLICY_ROLE_PREFILL ? load_decode(v, 0) : lp;
        double cg = (to == POLICY_ROLE_PREFILL ? cap_p : cap_d) + 1;
        double cgive = (to == POLICY_ROLE_PREFILL ? cap_d : cap_p) - 1;
        double after_give = cgive > 0 ? lgive / cgive : (lgive > 0 ? PRESSURE_NO_CAPACITY : 0);
        if (after_give > fmax(1.0, lg / cg))
            return 0;
    }
    if (p->capacity_moves && p->donor_guard && to == POLICY_ROLE_DECODE && cap_d > 0 &&
        cap_p - 1 > 0) {
        /* decode beyond capacity by its own sequences (they wait for decode room; not the
         * slots prompts still at a prefill worker hold, policy.h 1d), prefill within it
         * after the move: decode gains without the band (the reverse move would need
         * prefill beyond capacity after it, which the donor guard forbids). Prefill needs
         * no such rule: its queue term grows until the band gives way. */
        double lp = v->st->prompt_rate / p->prefill_tokens_per_s;
        if (load_decode_gain(v) / cap_d > 1 && lp / (cap_p - 1) <= 1)
            return 1;
    }
    if (to == POLICY_ROLE_PREFILL) {
        double pp = pressure_prefill(v, cap_p);
        /* decode as the donor: its full need, tokens included */
        return pp >= v->act && pp > p->band * pressure_decode_with(v, cap_d - 1, 1, 0);
    }
    double pd = pressure_decode_with(v, cap_d, 0, 1); /* decode as the gainer: its own */
    return pd >= v->act && pd > p->band * pressure_prefill(v, cap_p - 1);
}

/* The higher of the two load pressures with n_p of total workers in prefill (lp, ld:
 * loads in workers at pressure 1). */
static double split_pressure(double lp, double ld, int n_p, double total)
{
    double pp = n_p > 0 ? lp / n_p : (lp > 0 ? PRESSURE_NO_CAPACITY : 0);
    double nd = total - n_p;
    double pd = nd > 0 ? ld / nd : (ld > 0 ? PRESSURE_NO_CAPACITY : 0);
    return fmax(pp, pd);
}

/* How long the rule must ask for a reversal before it happens: 0 at level 0, then
 * reverse_hold_ms, doubling per level. */
static int64_t reverse_hold(const policy_params *p, const policy_state *st)
{
    if (st->reverse_level <= 0)
        return 0;
    return p->reverse_hold_ms << (st->reverse_level - 1);
}

/* The move the rule asks for with these counts: POLICY_ROLE_PREFILL (a decode worker to
 * prefill), POLICY_ROLE_DECODE, or 0. The donor keeps min_per_role workers. */
static int wanted_move(const view *v, int n_p, int n_d, double cap_p, double cap_d)
{
    if (n_d - 1 >= v->p->min_per_role && gains(v, POLICY_ROLE_PREFILL, cap_p, cap_d))
        return POLICY_ROLE_PREFILL;
    if (n_p - 1 >= v->p->min_per_role && gains(v, POLICY_ROLE_DECODE, cap_p, cap_d))
        return POLICY_ROLE_DECODE;
    return 0;
}

/* How cheap worker w of role `from` is to move (a decode worker's running sequences must
 * migrate; a prefill worker's queue must drain): less first, lowest index on ties. 1 when
 * a is dearer than b. */
static int dearer(const policy_worker *a, const policy_worker *b, int from)
{
    double a1, a2, b1, b2;
    if (from == POLICY_ROLE_DECODE) {
        a1 = (double)a->running + a->queued, a2 = (double)a->kv_blocks_used;
        b1 = (double)b->running + b->queued, b2 = (double)b->kv_blocks_used;
    } else {
        a1 = (double)a->queued_prompt_tokens, a2 = (double)a->running + a->queued;
        b1 = (double)b->queued_prompt_tokens, b2 = (double)b->running + b->queued;
    }
    if (a1 != b1)
        return a1 > b1;
    if (a2 != b2)
        return a2 > b2;
    return a->index > b->index;
}

static void sift_down(const policy_worker *ws, int *h, int n, int i, int from)
{
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && dearer(&ws[h[l]], &ws[h[m]], from))
            m = l;
        if (r < n && dearer(&ws[h[r]], &ws[h[m]], from))
            m = r;
        if (m == i)
            return;
        int t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

/* The k cheapest workers of role `from` to move (ready, not changing, min_role_ms in their
 * role) into pos (positions in in->workers), cheapest first; returns how many there are
 * (<= k <= POLICY_MAX_ACTIONS). One pass with a heap of the k best: O(n log k). */
static int pick_candidates(const policy_params *p, const policy_input *in, int from, int k,
                           int *pos)
{
    const policy_worker *ws = in->workers;
    int n = 0;
    for (int i = 0; i < in->n_workers && k > 0; i++) {
        const policy_worker *w = &ws[i];
        if (w->role != from || w->state != POLICY_WORKER_READY || w->changing ||
            w->role_age_ms < p->min_role_ms)
            continue;
        if (n < k) { /* grow the max-heap (dearest on top) */
            int j = n++;
            pos[j] = i;
            while (j > 0 && dearer(&ws[pos[j]], &ws[pos[(j - 1) / 2]], from)) {
                int t = pos[j];
                pos[j] = pos[(j - 1) / 2];
                pos[(j - 1) / 2] = t;
                j = (j - 1) / 2;
            }
        } else if (dearer(&ws[pos[0]], w, from)) { /* cheaper than the dearest kept */
            pos[0] = i;
            sift_down(ws, pos, n, 0, from);
        }
    }
    for (int m = n - 1; m > 0; m--) { /* heap sort: cheapest first */
        int t = pos[0];
        pos[0] = pos[m];
        pos[m] = t;
        sift_down(ws, pos, m, 0, from);
    }
    return n;
}

int policy_decide(const policy_params *p, policy_state *st, const policy_input *in,
                  policy_output *out)
{
    memset(out, 0, sizeof(*out));
    char err[128];
    if (policy_params_check(p, err, sizeof(err)) < 0 || check_input(in) < 0)
        return -1;

    policy_signals raw;
    observe(p, st, in, &raw);

    /* Counts: min_per_role uses whole workers (mixed counts for both roles); capacity gives
     * a mixed worker half of each. A changing worker counts for its target role. */
    int n_p = 0, n_d = 0, n_counted = 0;
    double cap_p = 0, cap_d = 0;
    for (int i = 0; i < in->n_workers; i++) {
        const policy_worker *w = &in->workers[i];
        if (!counted(w))
            continue;
        n_counted++;
        switch (effective_role(w)) {
        case POLICY_ROLE_PREFILL:
            n_p++;
            cap_p += 1;
            break;
        case POLICY_ROLE_DECODE:
            n_d++;
            cap_d += 1;
            break;
        default:
            n_p++;
            n_d++;
            cap_p += 0.5;
            cap_d += 0.5;
            break;
        }
    }
    /* Before the first window of traffic is seen, only pressure at the SLO's edge moves a
     * worker: a start-up transient (an empty cluster filling) is not the mix. */
    int warm = st->rates_seeded && in->now_ms - traffic_start(st) >= p->warmup_ms;
    double act = warm ? p->act_pressure : fmax(p->act_pressure, 1.0);
    view vf = {.p = p, .st = &st->sig, .cap_p0 = cap_p, .cap_d0 = cap_d, .act = act};
    view vr = {.p = p, .st = &raw, .cap_p0 = cap_p, .cap_d0 = cap_d, .act = act};

    /* Rate cap: at most `cap` changes in any window_ms. */
    int cap = p->max_changes;
    int frac_cap = (int)floor(p->max_change_frac * n_counted);
    if (frac_cap > cap)
        cap = frac_cap;
    int allowed = cap - recent_changes(p, st, in->now_ms);
    if (allowed > POLICY_MAX_ACTIONS)
        allowed = POLICY_MAX_ACTIONS;
    if (allowed < 0)
        allowed = 0;

    /* Reversal guard. An "ask" is a call where the rule wants the opposite of the last
     * change's direction; asks in a row form an episode. Every reversal raises the level
     * (the hold doubles); every calm spell of 2 * min_role_ms between two episodes lowers
     * it by one. Load that keeps swinging keeps asking, so its hold only grows; a tide
     * that turns now and then finds the level back at 0 and is answered at once. */
    int want = wanted_move(&vf, n_p, n_d, cap_p, cap_d);
    int asking = st->last_dir && want && want != st->last_dir;
    if (asking && !st->reverse_holding) {
        st->reverse_holding = 1;
        st->reverse_since_ms = in->now_ms;
        int64_t calm = 2 * p->min_role_ms > 0 ? 2 * p->min_role_ms : 1;
        int64_t gap = in->now_ms - st->last_ask_end_ms;
        int64_t spells = gap > 0 ? gap / calm : 0;
        st->reverse_level = spells >= st->reverse_level ? 0 : st->reverse_level - (int)spells;
    } else if (!asking && st->reverse_holding) {
        st->reverse_holding = 0;
        st->last_ask_end_ms = in->now_ms;
    }

    /* The estimate (policy.h 2c): the load of each role in workers at pressure 1, and the
     * prefill capacity that gives both the same pressure. Known once the rates have been
     * seen for a window. */
    int seeded_now = st->n_calls++ == 0;
    /* the mix's steady need: rates, not a backlog (the rule's own steps drain a queue) */
    double lp = st->sig.prompt_rate / p->prefill_tokens_per_s, ld = load_decode(&vf, 1);
    out->est_prefill_workers = lp;
    out->est_decode_workers = ld;
    out->est_prefill = -1;
    int have_est = !seeded_now && warm && lp + ld > 0;
    int k_est = 0; /* > 0: decode workers to prefill; < 0: prefill workers to decode */
    if (have_est) {
        /* The busier role (by load pressure) gets the capacity that brings it to
         * target_pressure, or to the pressure both would share if that is higher; the
         * other keeps the rest, and with it the slack for a turning tide. */
        double total = cap_p + cap_d;
        double goal = fmax(p->target_pressure, (lp + ld) / total);
        int hot_p = lp * cap_d >= ld * cap_p;
        double need = (hot_p ? lp : ld) / goal, have = hot_p ? cap_p : cap_d;
        double d = need > have ? need - have : 0;
        double target = hot_p ? cap_p + d : cap_p - d;
        out->est_prefill = (int)lround(target);
        if ((lp + ld) / total > p->target_pressure) {
            /* Shared pressure: both roles at the same pressure, so round to the whole split
             * with the lower of the two (to the nearer one, on a tie). Rounding to the
             * nearer alone can leave the other role beyond capacity: 62.7 of 64 prefill
             * rounds to 63 and leaves 1.3 workers of decode load on one worker. */
            int alt = (double)out->est_prefill > target ? (int)floor(target) : (int)ceil(target);
            if (split_pressure(lp, ld, alt, total) < split_pressure(lp, ld, out->est_prefill, total))
                out->est_prefill = alt;
        }
        d = (double)out->est_prefill - (double)lround(cap_p); /* whole workers */
        k_est = (int)fmax(fmin(d, (double)(n_d - p->min_per_role)),
                          -(double)(n_p - p->min_per_role));
    }

    /* Direction and count. The rule decides whether; the estimate, when it agrees, how
     * many (else one at a time while the rule holds). The first call only seeds the
     * signals: one sample is not a trend. */
    int to = 0, k = 0;
    int lim = allowed;
    /* Capacity moves: the workers the gaining role needs for its load pressure to reach 1,
     * as far as the donor keeps its own load within capacity, are not held back by the
     * rate cap (below that, the gainer's backlog grows every second). */
    int k_capacity = 0;
    if (p->capacity_moves && want && cap > 0 && !seeded_now) {
        int to_p = want == POLICY_ROLE_PREFILL;
        double lg = to_p ? lp : load_decode_gain(&vf), lgive = to_p ? ld : lp;
        /* one standard error below the measured rate (a Poisson count of n arrivals) */
        double n_eff = (double)(in->cluster.online_arrived - st->first_arrived);
        n_eff = fmin(n_eff, st->sig.arrival_rate * 2e-3 * (double)p->smooth_ms);
        lg *= n_eff > 1 ? 1 - 1 / sqrt(n_eff) : 0;
        double cg = to_p ? cap_p : cap_d, cgive = to_p ? cap_d : cap_p;
        int ngive = to_p ? n_d : n_p;
        double k_need = ceil(lg - 1e-9) - cg;
        double keep = fmax((double)p->min_per_role, ceil(lgive - 1e-9));
        double k_room = fmin(cgive - keep, (double)ngive - p->min_per_role);
        double kc = fmin(k_need, k_room);
        if (kc > POLICY_MAX_ACTIONS)
            kc = POLICY_MAX_ACTIONS;
        k_capacity = kc > 0 ? (int)kc : 0;
        if (k_capacity > lim)
            lim = k_capacity;
    }
    if (lim > POLICY_MAX_ACTIONS)
        lim = POLICY_MAX_ACTIONS;
    if (!seeded_now && lim > 0) {
        to = want;
        if (to) {
            int np = n_p, nd = n_d;
            double cp = cap_p, cd = cap_d;
            while (k < lim && wanted_move(&vf, np, nd, cp, cd) == to) {
                k++;
                if (to == POLICY_ROLE_PREFILL)
                    np++, nd--, cp += 1, cd -= 1;
                else
                    nd++, np--, cd += 1, cp -= 1;
            }
            int ke = to == POLICY_ROLE_PREFILL ? k_est : -k_est;
            if (ke > k)
                k = ke;
        } else if (p->start_from_estimate && have_est && !st->est_started && k_est != 0) {
            /* start-up: the load terms alone, but only when one role is clearly busier */
            double cg = k_est > 0 ? cap_p : cap_d, cd = k_est > 0 ? cap_d : cap_p;
            double lg = k_est > 0 ? lp : ld, ldn = k_est > 0 ? ld : lp;
            if (cd - 1 > 0 && (cg <= 0 || lg / cg > p->band * ldn / (cd - 1))) {
                to = k_est > 0 ? POLICY_ROLE_PREFILL : POLICY_ROLE_DECODE;
                k = abs(k_est);
            }
        }
    }
    if (have_est)
        st->est_started = 1;
    /* Reversing the last change's direction needs min_role_ms since that change, and the
     * current ask episode to have lasted the hold of the reversal level. */
    int reversal = to && st->last_dir && to != st->last_dir;
    /* ... except a capacity move undoing a change made before warmup_ms: that change was
     * a start-up guess on a partial view of the mix (the long answers had not ended yet),
     * not a swing of the load */
    int startup_fix = reversal && k_capacity > 0 && p->startup_fix &&
                      st->last_change_ms - traffic_start(st) < p->warmup_ms;
    if (reversal && !startup_fix &&
        (in->now_ms - st->last_change_ms < p->min_role_ms || !st->reverse_holding ||
         in->now_ms - st->reverse_since_ms < reverse_hold(p, st)))
        to = 0;
    if (startup_fix && k > k_capacity)
        k = k_capacity;
    /* Start-up settle (policy.h 2e): before warmup_ms, a role that gained workers gains no
     * more for smooth_ms (the signals' time constant: the load that asked for the move must
     * be seen again with the new split) unless its capacity asks for them. A start-up move
     * is one move: made again 200-400 ms later on a view a little longer, it migrated the
     * sequences the first had moved a second time (docs/tidal.md "Session 12"). */
    if (to && !warm && p->startup_settle && to == st->last_dir &&
        in->now_ms - st->last_change_ms < p->smooth_ms) {
        if (k_capacity <= 0)
            to = 0;
        else if (k > k_capacity)
            k = k_capacity;
    }
    if (to) {
        int kmax = allowed > k_capacity ? allowed : k_capacity;
        if (k > kmax)
            k = kmax;
        int from = to == POLICY_ROLE_PREFILL ? POLICY_ROLE_DECODE : POLICY_ROLE_PREFILL;
        int pos[POLICY_MAX_ACTIONS];
        int m = pick_candidates(p, in, from, k, pos);
        for (int i = 0; i < m; i++) {
            out->actions[i].worker = in->workers[pos[i]].index;
            out->actions[i].role = to;
        }
        out->n_actions = m;
        if (m > 0) {
            remember_changes(st, in->now_ms, m);
            if (reversal) {
                st->reverse_holding = 0;
                st->last_ask_end_ms = in->now_ms;
                if (st->reverse_level < POLICY_MAX_REVERSE_LEVEL)
                    st->reverse_level++;
            }
            st->last_dir = to;
            st->last_change_ms = in->now_ms;
            if (to == POLICY_ROLE_PREFILL)
                n_p += m, n_d -= m, cap_p += m, cap_d -= m;
            else
                n_d += m, n_p -= m, cap_d += m, cap_p -= m;
        }
    }
    double pp = pressure_prefill(&vf, cap_p), pd = pressure_decode(&vf, cap_d);
    out->prefill_pressure = pp;
    out->decode_pressure = pd;
    out->n_prefill = n_p;
    out->n_decode = n_d;

    /* Offline admission: the spare decode capacity below offline_target; aging keeps a
     * trickle going while online load is below the preemption level. Fast attack, slow
     * release: the online pressure used is the larger of the smoothed and this call's raw
     * figures, so offline work yields at once when online load jumps but grows back only
     * as the smoothed signals come down. */
    double smoothed = fmax(pp, pd);
    double online = fmax(smoothed, fmax(pressure_prefill(&vr, cap_p), pressure_decode(&vr, cap_d)));
    const policy_cluster *cl = &in->cluster;
    double spare = p->offline_target - online;
    double limit = spare > 0 ? floor(spare * cap_d * p->decode_seqs_per_worker) : 0;
    if (online < p->preempt_pressure && cl->offline_queued > 0 &&
        cl->offline_oldest_wait_ms >= p->offline_max_wait_ms) {
        double floor_slots = (double)p->offline_aging_per_worker * n_d;
        if (limit < floor_slots)
            limit = floor_slots;
    }
    if (limit > 1e9)
        limit = 1e9;
    out->offline_max_running = (int)limit;
    /* Preemption wastes work, so it follows the smoothed pressure only. */
    if (smoothed >= p->preempt_pressure && cl->offline_running > out->offline_max_running)
        out->offline_preempt = cl->offline_running - out->offline_max_running;
    return 0;
}
