/*
 * sim_cluster_decode: where prefilled sequences go and how decode workers step them
 * (sim_cluster_internal.h). Placement reserves KV for prompt + output on one decode worker
 * (the most free of two random ones, else at most one full scan per KV-freeing event, so
 * a cluster with no room anywhere is not scanned again until room appears); a worker steps
 * its batch with costmodel_decode_step_ms, sequences joining at step boundaries; each
 * worker's finish heap gives the step after which a sequence has all its tokens, so a step
 * costs O(log n) per finished sequence, not O(batch). Between two changes of a batch (a
 * sequence finishing, joining or leaving; a role change) its steps are known, so one event
 * stands for the run of steps up to the next finish: the run's end time is the same sum of
 * step times the step-by-step events made, and an event that changes the batch mid-run cuts
 * it at the next boundary (sim_cluster_cut). 2x fewer events at 10,000 workers; the figures
 * are bit-identical to one event per step (tested).
 */
#include <stdint.h>

#include "costmodel.h"
#include "log.h"
#include "policy.h"
#include "sim_cluster_internal.h"
#include "sim_heap.h"
#include "sim_ideque.h"
#include "sim_ivec.h"
#include "sim_rng.h"

// --- decode placement ----------------------------------------------------------------------

/* A decode worker with room for need tokens: the one with more free KV of two random
 * ones, else (at most once per KV-freeing event, when scan is set) the best of all. */
int sim_cluster_choose_decode(sim_cluster *s, int need, int scan)
{
    if (s->n_dec == 0)
        return -1;
    int best = -1;
    int64_t best_free = -1;
    if (s->n_dec <= 16) {
        for (int i = 0; i < s->n_dec; i++) {
            int w = s->dec_list[i];
            int64_t f = (int64_t)s->kv_cap - s->room[w].kv_reserved;
            if (sim_cluster_fits(s, w, need) && f > best_free)
                best = w, best_free = f;
        }
        return best;
    }
    for (int k = 0; k < 2; k++) {
        int w = s->dec_list[sim_rng_next(&s->prng) % (uint64_t)s->n_dec];
        int64_t f = (int64_t)s->kv_cap - s->room[w].kv_reserved;
        if (sim_cluster_fits(s, w, need) && f > best_free)
            best = w, best_free = f;
    }
    if (best >= 0 || !scan)
        return best;
    if (s->scan_failed && s->scan_fail_epoch == s->free_epoch)
        return -1;
    for (int i = 0; i < s->n_dec; i++) {
        int w = s->dec_list[i];
        int64_t f = (int64_t)s->kv_cap - s->room[w].kv_reserved;
        if (sim_cluster_fits(s, w, need) && f > best_free)
            best = w, best_free = f;
    }
    if (best < 0) {
        s->scan_failed = 1;
        s->scan_fail_epoch = s->free_epoch;
    }
    return best;
}

/* Reserve room for request id on decode worker w: KV for prompt + output, one slot. */
void sim_cluster_hold(sim_cluster *s, int id, int w)
{
    sreq *r = &s->reqs[id];
    s->room[w].kv_reserved += r->need;
    s->room[w].assigned++;
    r->worker = w;
}

static void reserve(sim_cluster *s, int id, int w, double arrive_ms)
{
    sreq *r = &s->reqs[id];
    sim_cluster_hold(s, id, w);
    r->state = SIM_CLUSTER_RQ_XFER;
    sim_heap_push_aux(&s->ev, arrive_ms, SIM_CLUSTER_EV_XFER_DONE, id, r->epoch, w);
}

void sim_cluster_unreserve(sim_cluster *s, int id)
{
    sreq *r = &s->reqs[id];
    sroom *x = &s->room[r->worker];
    x->kv_reserved -= r->need;
    x->assigned--;
    r->worker = -1;
    r->epoch++;
    s->free_epoch++;
}

/* A prefilled (or migrating) sequence needs a decode worker; its KV can be there at
 * arrive_ms if one is found now. Waiting sequences keep their order, online first. */
void sim_cluster_place_decode(sim_cluster *s, int id, double arrive_ms, int front)
{
    sreq *r = &s->reqs[id];
    int blocked = r->offline ? (s->pend_on.n || s->pend_off.n) : s->pend_on.n > 0;
    int w = blocked ? -1 : sim_cluster_choose_decode(s, r->need, 1);
    if (w >= 0) {
        reserve(s, id, w, arrive_ms);
        return;
    }
    r->state = SIM_CLUSTER_RQ_PENDING;
    r->worker = -1;
    sim_ideque *q = r->offline ? &s->pend_off : &s->pend_on;
    if (front)
        sim_ideque_push_front(q, id);
    else
        sim_ideque_push_back(q, id);
}

/* Room appeared (hint: the worker that freed it, or -1): admit waiting sequences. */
void sim_cluster_drain_pending(sim_cluster *s, int hint)
{
    for (;;) {
        sim_ideque *q = s->pend_on.n ? &s->pend_on : (s->pend_off.n ? &s->pend_off : NULL);
        if (!q)
            return;
        int id = sim_ideque_front(q);
        int need = s->reqs[id].need;
        int w = (hint >= 0 && sim_cluster_accepts(s, hint) && sim_cluster_fits(s, hint, need))
                    ? hint
                    : sim_cluster_choose_decode(s, need, 0);
        if (w < 0)
            return;
        sim_ideque_pop_front(q);
        reserve(s, id, w, s->now + sim_cluster_kv_transfer_ms(s, &s->reqs[id]));
    }
}

void sim_cluster_dec_list_add(sim_cluster *s, int w)
{
    s->w[w].dec_pos = s->n_dec;
    s->dec_list[s->n_dec++] = w;
    s->free_epoch++;
}

void sim_cluster_dec_list_remove(sim_cluster *s, int w)
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

/* Longest run of steps one event stands for (bounds the work of a settle). */
#define MAX_RUN 4096

void sim_cluster_settle(sim_cluster *s, int w)
{
    sworker *x = &s->w[w];
    if (!x->stepping || x->step + 1 >= x->step_end)
        return;
    /* the same sums the step-by-step events made: t_(j+1) = t_j + step_ms(j) */
    while (x->step + 1 < x->step_end) {
        double t = x->step_t0 + x->last_step_ms;
        if (!(t < s->now))
            break;
        x->step_t0 = t;
        x->step++;
        x->ctx_sum += x->running;
        x->last_step_ms = sim_cluster_step_ms(s, x->running, (double)x->ctx_sum);
    }
}

void sim_cluster_cut(sim_cluster *s, int w)
{
    sworker *x = &s->w[w];
    sim_cluster_settle(s, w);
    if (!x->stepping || x->step + 1 >= x->step_end)
        return;
    x->step_end = x->step + 1;
    sim_cluster_worker_event(s, w, x->step_t0 + x->last_step_ms, SIM_CLUSTER_EV_STEP_DONE,
                             ++x->step_epoch);
}

static void start_step(sim_cluster *s, int w)
{
    sworker *x = &s->w[w];
    for (int i = 0; i < x->incoming.n; i++)
        __builtin_prefetch(&s->reqs[x->incoming.v[i]], 1);
    for (int i = 0; i < x->incoming.n; i++) {
        int id = x->incoming.v[i];
        sreq *r = &s->reqs[id];
        r->state = SIM_CLUSTER_RQ_RUNNING;
        r->s0 = x->step;
        int64_t fin_step = x->step + (r->out - r->gen);
        sim_heap_fin_push(&x->fin, (sim_heap_fin_entry){fin_step, id, r->epoch});
        if (fin_step < x->fin_top)
            x->fin_top = fin_step;
        x->ctx_sum += r->prompt + r->gen;
        x->running++;
        if (r->offline) {
            sim_ivec_push(&s->off_dec, id);
            sim_ivec_push(&s->off_dec_epoch, (int)r->epoch);
        }
    }
    x->incoming.n = 0;
    if (x->running > 0) {
        /* the steps up to the next sequence's finish are known: one event for the run (a
         * join, a preemption or a role change cuts it short: sim_cluster_cut) */
        int64_t run = x->fin.n > 0 ? x->fin_top - x->step : 1;
        if (run < 1)
            run = 1;
        if (run > MAX_RUN)
            run = MAX_RUN;
        if (s->single_steps)
            run = 1;
        x->last_step_ms = sim_cluster_step_ms(s, x->running, (double)x->ctx_sum);
        x->step_t0 = s->now;
        x->step_end = x->step + run;
        double t = s->now + x->last_step_ms;
        int64_t ctx = x->ctx_sum;
        for (int64_t j = 1; j < run; j++) {
            ctx += x->running;
            t += sim_cluster_step_ms(s, x->running, (double)ctx);
        }
        sim_cluster_worker_event(s, w, t, SIM_CLUSTER_EV_STEP_DONE, ++x->step_epoch);
        x->stepping = 1;
    } else {
        x->stepping = 0;
    }
}

/* Take a running sequence out of its worker at a step boundary; its progress is kept. */
void sim_cluster_take_out(sim_cluster *s, int id)
{
    sreq *r = &s->reqs[id];
    sworker *x = &s->w[r->worker];
    if (r->state == SIM_CLUSTER_RQ_RUNNING) {
        int64_t done = x->step - r->s0;
        x->ctx_sum -= r->prompt + r->gen + done;
        x->running--;
        r->gen += (int)done;
    }
    sim_cluster_unreserve(s, id);
}

/* A draining decode worker hands its sequences to others (KV over the link, one after
 * another), then switches. */
void sim_cluster_migrate_all(sim_cluster *s, int w)
{
    sworker *x = &s->w[w];
    double t_acc = 0;
    for (int i = 0; i < x->fin.n; i++) {
        sim_heap_fin_entry e = x->fin.v[i];
        sreq *r = &s->reqs[e.req];
        if (r->epoch != e.epoch || r->state != SIM_CLUSTER_RQ_RUNNING || r->worker != w)
            continue;
        sim_cluster_take_out(s, e.req);
        t_acc += sim_cluster_kv_transfer_ms(s, r);
        sim_cluster_place_decode(s, e.req, s->now + t_acc, 1);
    }
    for (int i = 0; i < x->incoming.n; i++) {
        int id = x->incoming.v[i];
        sim_cluster_take_out(s, id);
        t_acc += sim_cluster_kv_transfer_ms(s, &s->reqs[id]);
        sim_cluster_place_decode(s, id, s->now + t_acc, 1);
    }
    x->fin.n = 0;
    x->fin_top = INT64_MAX;
    x->incoming.n = 0;
    x->running = 0;
    x->ctx_sum = 0;
    x->stepping = 0;
    sim_cluster_switch_start(s, w, t_acc);
}

void sim_cluster_on_step_done(sim_cluster *s, int w, uint32_t epoch)
{
    sworker *x = &s->w[w];
    if (epoch != x->step_epoch || !x->stepping)
        return; /* a run that was cut short */
    /* the run's boundaries before this one changed nothing but the counts */
    int64_t mid = x->step_end - 1 - x->step;
    x->step += mid;
    x->ctx_sum += mid * x->running;
    x->step++;
    x->ctx_sum += x->running;
    int freed = 0;
    while (x->fin_top <= x->step) {
        __builtin_prefetch(&s->reqs[x->fin.v[0].req], 1); /* while the heap sifts */
        sim_heap_fin_entry e = sim_heap_fin_pop(&x->fin);
        x->fin_top = x->fin.n > 0 ? x->fin.v[0].step : INT64_MAX;
        sreq *r = &s->reqs[e.req];
        if (r->epoch != e.epoch || r->state != SIM_CLUSTER_RQ_RUNNING || r->worker != w)
            continue;
        x->ctx_sum -= r->prompt + r->out;
        x->running--;
        s->room[w].kv_reserved -= r->need;
        s->room[w].assigned--;
        r->gen = r->out;
        sim_cluster_finish_req(s, e.req);
        freed = 1;
    }
    if (x->changing && !s->drain) {
        sim_cluster_migrate_all(s, w);
        return;
    }
    if (x->changing && x->running == 0 && x->incoming.n == 0) { /* drained */
        x->stepping = 0;
        sim_cluster_switch_start(s, w, 0);
    } else {
        start_step(s, w);
    }
    if (freed) {
        s->free_epoch++;
        sim_cluster_drain_pending(s, w);
        sim_cluster_dispatch(s);
    }
}

void sim_cluster_on_xfer_done(sim_cluster *s, int id, uint32_t epoch)
{
    sreq *r = &s->reqs[id];
    if (r->epoch != epoch || r->state != SIM_CLUSTER_RQ_XFER)
        return;
    int w = r->worker;
    if (!sim_cluster_accepts(s, w)) { /* its worker left decode meanwhile: send it elsewhere */
        sim_cluster_unreserve(s, id);
        sim_cluster_place_decode(s, id, s->now + sim_cluster_kv_transfer_ms(s, r), 1);
        return;
    }
    r->state = SIM_CLUSTER_RQ_INCOMING;
    sim_cluster_cut(s, w); /* it joins at the next boundary */
    sim_ivec_push(&s->w[w].incoming, id);
    if (!s->w[w].stepping)
        start_step(s, w);
}
