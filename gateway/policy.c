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
} view;

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
    double tok_s = cap * p->prefill_tokens_per_s;
    double wait_ms = 1e3 * st->queued_tokens / tok_s;
    double q = wait_ms / (p->queue_budget * p->ttft_slo_ms);
    double u = st->prompt_rate / tok_s;
    double scale = v->cap_p0 > 0 ? v->cap_p0 / cap : 1;
    return fmax(fmax(q, u), lat * scale);
}

static double pressure_decode(const view *v, double cap)
{
    const policy_params *p = v->p;
    const policy_signals *st = v->st;
    double lat = st->tpot_ms / p->tpot_slo_ms;
    double kv = st->kv_frac / p->kv_high;
    if (cap <= 0)
        return (st->decoding > 0 || lat > 0 || kv > 0) ? PRESSURE_NO_CAPACITY : 0;
    double u = st->decoding / (cap * p->decode_seqs_per_worker);
    double scale = v->cap_d0 > 0 ? v->cap_d0 / cap : 1;
    return fmax(u, fmax(kv, lat) * scale);
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
    double offline = c->offline_running > 0 ? c->offline_running : 0;
    double share = decoding + offline > 0 ? decoding / (decoding + offline) : 1;
    memset(raw, 0, sizeof(*raw));
    raw->queued_tokens = q_tokens;
    raw->oldest_wait_ms = (double)(c->oldest_wait_ms > 0 ? c->oldest_wait_ms : 0);
    raw->ttft_ms = c->ttft_p90_ms > 0 ? c->ttft_p90_ms : (ttft_n > 0 ? ttft_sum / ttft_n : 0);
    raw->tpot_ms = c->tpot_p90_ms > 0 ? c->tpot_p90_ms : (tpot_w > 0 ? tpot_sum / tpot_w : 0);
    raw->decoding = decoding;
    raw->kv_frac = kv_total > 0 ? kv_used / kv_total * share : 0;
    int64_t dt = st->initialized ? in->now_ms - st->last_ms : 0;
    if (dt > 0) {
        int64_t d_tok = c->prompt_tokens_arrived - st->last_prompt_tokens;
        if (d_tok < 0) /* counter reset (gateway restart): no information this time */
            d_tok = 0;
        raw->prompt_rate = 1e3 * (double)d_tok / (double)dt;
    }

    if (!st->initialized) { /* seed both EWMAs; the arrival rate is unknown until two calls */
        st->initialized = 1;
        st->last_ms = in->now_ms;
        st->last_prompt_tokens = c->prompt_tokens_arrived;
        st->sig = *raw;
        return;
    }
    if (dt <= 0) /* the same instant, or time going backwards: nothing elapsed */
        return;
    st->last_ms = in->now_ms;
    st->last_prompt_tokens = c->prompt_tokens_arrived;
    double alpha = p->smooth_ms > 0 ? 1 - exp(-(double)dt / (double)p->smooth_ms) : 1;
    policy_signals *x = &st->sig;
    ewma(&x->queued_tokens, raw->queued_tokens, alpha);
    ewma(&x->oldest_wait_ms, raw->oldest_wait_ms, alpha);
    ewma(&x->prompt_rate, raw->prompt_rate, alpha);
    ewma(&x->ttft_ms, raw->ttft_ms, alpha);
    ewma(&x->tpot_ms, raw->tpot_ms, alpha);
    ewma(&x->decoding, raw->decoding, alpha);
    ewma(&x->kv_frac, raw->kv_frac, alpha);
}

// --- decision ------------------------------------------------------------------------------

/* Changes in the window ending now (drops older entries from the ring). */
static int recent_changes(const policy_params *p, policy_state *st, int64_t now)
{
    while (st->n_hist > 0) {
        int oldest = (st->hist_head - st->n_hist + POLICY_MAX_HISTORY) % POLICY_MAX_HISTORY;
        if (now - st->change_ms[oldest] < p->window_ms && now >= st->change_ms[oldest])
            break;
        st->n_hist--;
    }
    return st->n_hist;
}

static void remember_change(policy_state *st, int64_t now)
{
    st->change_ms[st->hist_head] = now;
    st->hist_head = (st->hist_head + 1) % POLICY_MAX_HISTORY;
    if (st->n_hist < POLICY_MAX_HISTORY)
        st->n_hist++;
    st->n_changes++;
}

/* Whether role `to` should gain a worker from the other role, on these signals: its
 * pressure reaches act_pressure and exceeds band times the donor's pressure after losing
 * one worker. */
static int gains(const view *v, int to, double cap_p, double cap_d)
{
    const policy_params *p = v->p;
    if (to == POLICY_ROLE_PREFILL) {
        double pp = pressure_prefill(v, cap_p);
        return pp >= p->act_pressure && pp > p->band * pressure_decode(v, cap_d - 1);
    }
    double pd = pressure_decode(v, cap_d);
    return pd >= p->act_pressure && pd > p->band * pressure_prefill(v, cap_p - 1);
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

static int already_chosen(const policy_output *out, int index)
{
    for (int i = 0; i < out->n_actions; i++)
        if (out->actions[i].worker == index)
            return 1;
    return 0;
}

/* The cheapest worker of role `from` to move: ready, settled, least work in hand (a decode
 * worker's running sequences must migrate; a prefill worker's queue must drain), lowest
 * index on ties. Returns its position in in->workers, or -1. */
static int pick_candidate(const policy_params *p, const policy_input *in, const policy_output *out,
                          int from)
{
    int best = -1;
    double best_k1 = 0, best_k2 = 0;
    for (int i = 0; i < in->n_workers; i++) {
        const policy_worker *w = &in->workers[i];
        if (w->role != from || w->state != POLICY_WORKER_READY || w->changing)
            continue;
        if (w->role_age_ms < p->min_role_ms)
            continue;
        if (already_chosen(out, w->index))
            continue;
        double k1, k2;
        if (from == POLICY_ROLE_DECODE) {
            k1 = (double)w->running + w->queued;
            k2 = (double)w->kv_blocks_used;
        } else {
            k1 = (double)w->queued_prompt_tokens;
            k2 = (double)w->running + w->queued;
        }
        if (best < 0 || k1 < best_k1 || (k1 == best_k1 && k2 < best_k2) ||
            (k1 == best_k1 && k2 == best_k2 && w->index < in->workers[best].index)) {
            best = i;
            best_k1 = k1;
            best_k2 = k2;
        }
    }
    return best;
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
    view vf = {.p = p, .st = &st->sig, .cap_p0 = cap_p, .cap_d0 = cap_d};
    view vr = {.p = p, .st = &raw, .cap_p0 = cap_p, .cap_d0 = cap_d};

    /* Rate cap: at most `cap` changes in any window_ms. */
    int cap = p->max_changes;
    int frac_cap = (int)floor(p->max_change_frac * n_counted);
    if (frac_cap > cap)
        cap = frac_cap;
    if (cap > POLICY_MAX_HISTORY)
        cap = POLICY_MAX_HISTORY;
    int allowed = cap - recent_changes(p, st, in->now_ms);
    if (allowed > POLICY_MAX_ACTIONS)
        allowed = POLICY_MAX_ACTIONS;

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

    /* One worker at a time, re-projecting both pressures after each move. The first call
     * only seeds the signals: one sample is not a trend. */
    int seeded_now = st->n_calls++ == 0;
    while (!seeded_now && out->n_actions < allowed) {
        int to = wanted_move(&vf, n_p, n_d, cap_p, cap_d);
        if (!to)
            break;
        /* Reversing the last change's direction needs min_role_ms since that change, and
         * the current ask episode to have lasted the hold of the reversal level. */
        int reversal = st->last_dir && to != st->last_dir;
        if (reversal && (in->now_ms - st->last_change_ms < p->min_role_ms || !st->reverse_holding ||
                         in->now_ms - st->reverse_since_ms < reverse_hold(p, st)))
            break;
        int from = to == POLICY_ROLE_PREFILL ? POLICY_ROLE_DECODE : POLICY_ROLE_PREFILL;
        int c = pick_candidate(p, in, out, from);
        if (c < 0)
            break;
        out->actions[out->n_actions].worker = in->workers[c].index;
        out->actions[out->n_actions].role = to;
        out->n_actions++;
        remember_change(st, in->now_ms);
        if (reversal) {
            st->reverse_holding = 0;
            st->last_ask_end_ms = in->now_ms;
            if (st->reverse_level < POLICY_MAX_REVERSE_LEVEL)
                st->reverse_level++;
        }
        st->last_dir = to;
        st->last_change_ms = in->now_ms;
        if (to == POLICY_ROLE_PREFILL) {
            n_p++, n_d--, cap_p += 1, cap_d -= 1;
        } else {
            n_d++, n_p--, cap_d += 1, cap_p -= 1;
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
