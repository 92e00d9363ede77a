/*
 * sim_cluster: the simulated cluster (sim_cluster.h): requests, the gateway's queues and
 * dispatch, prefill batches, role changes, preemption, the policy tick, and the event loop
 * that runs them. Decode placement and decode steps are in sim_cluster_decode.c; both share
 * sim_cluster_internal.h.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "costmodel.h"
#include "log.h"
#include "policy.h"
#include "sim_cluster.h"
#include "sim_cluster_internal.h"
#include "sim_heap.h"
#include "sim_ideque.h"
#include "sim_ivec.h"
#include "sim_mem.h"
#include "sim_rng.h"
#include "sim_stats.h"
#include "sim_workload.h"

// --- requests ------------------------------------------------------------------------------

static int req_alloc(sim_cluster *s)
{
    if (s->free_head < 0) {
        int ncap = s->n_reqs ? 2 * s->n_reqs : 4096;
        s->reqs = sim_mem_realloc_aligned(s->reqs, (size_t)s->n_reqs * sizeof(sreq),
                                          (size_t)ncap * sizeof(sreq), 64);
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

static void req_release(sim_cluster *s, int id)
{
    sreq *r = &s->reqs[id];
    r->state = SIM_CLUSTER_RQ_FREE;
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

void sim_cluster_finish_req(sim_cluster *s, int id)
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
        s->output_tokens_done += r->out;
        s->online_done++;
        if (r->out > 1) /* it went through decode (counted when prefill ended) */
            s->online_decoding--;
    }
    req_release(s, id);
}

// --- prefill and dispatch ------------------------------------------------------------------

static int prefill_ready(const sim_cluster *s, int w)
{
    const sworker *x = &s->w[w];
    return x->role == POLICY_ROLE_PREFILL && !x->changing && !x->busy;
}

static int have_prefill_work(const sim_cluster *s)
{
    return s->q_on.n > 0 ||
           (!s->reserve_dispatch && s->q_off.n > 0 && s->offline_running < s->offline_limit);
}

/* Add request id's next chunk to worker w's batch: at most the chunk limit and the budget
 * left; the online prompt tokens it covers leave the count of queued ones. */
static void take_chunk(sim_cluster *s, sprompt *e, int *budget, double *tokens, double *pairs)
{
    int take = e->total - e->done;
    if (s->chunk_tokens > 0 && take > s->chunk_tokens)
        take = s->chunk_tokens;
    if (take > *budget)
        take = *budget;
    e->chunk = take;
    *budget -= take;
    *tokens += take;
    *pairs += costmodel_attn_pairs(take, e->done);
    if (e->counted) { /* counted in q_on_tokens (its prompt part) */
        int before = e->done < e->prompt ? e->done : e->prompt;
        int after = e->done + take < e->prompt ? e->done + take : e->prompt;
        s->q_on_tokens -= after - before;
    }
}

/* Start prompt id on worker w (it left its queue): its first chunk joins the batch. */
static void admit_prompt(sim_cluster *s, sworker *x, int id, int *budget, double *tokens,
                         double *pairs)
{
    if (x->prog.n == x->prog.cap) {
        int w = (int)(x - s->w);
        sprompt *inl = &s->prog_inl[(size_t)w * SIM_PROG_INLINE];
        x->prog.cap *= 2;
        if (x->prog.v == inl) {
            x->prog.v = sim_mem_realloc(NULL, (size_t)x->prog.cap * sizeof(sprompt));
            memcpy(x->prog.v, inl, (size_t)x->prog.n * sizeof(sprompt));
        } else {
            x->prog.v = sim_mem_realloc(x->prog.v, (size_t)x->prog.cap * sizeof(sprompt));
        }
    }
    sprompt *e = &x->prog.v[x->prog.n++];
    sreq *r = &s->reqs[id];
    *e = (sprompt){.id = id,
                   .done = 0,
                   .chunk = 0,
                   .total = r->prompt + r->gen,
                   .prompt = r->prompt,
                   .counted = s->reserve_dispatch || !r->offline,
                   .start_ms = s->now};
    r->state = SIM_CLUSTER_RQ_PREFILL;
    take_chunk(s, e, budget, tokens, pairs);
}

/* Worker w's next batch, as tidepool's prefill worker builds it (prefill_worker/
 * prefill_batch.c): the next chunk of every prompt being computed, in order, then queued
 * prompts (online first, then offline within the policy's limit) while the token budget
 * lasts, the last one's chunk cut to fit; at most max_seqs prompts. A worker changing role
 * admits none (it finishes the prompts it has begun). Nothing to do: it is listed idle. */
static void start_prefill(sim_cluster *s, int w)
{
    sworker *x = &s->w[w];
    double tokens = 0, pairs = 0;
    int budget = s->cm->prefill_token_budget, max_items = s->cm->max_seqs;
    int n = 0;
    for (; n < x->prog.n && n < max_items && budget > 0; n++)
        take_chunk(s, &x->prog.v[n], &budget, &tokens, &pairs);
    if (n == x->prog.n && !x->changing) {
        while (s->q_on.n > 0 && n < max_items && budget > 0) {
            int id = sim_ideque_pop_front(&s->q_on);
            if (!s->reserve_dispatch) /* else counted when dispatched */
                s->online_running++;
            admit_prompt(s, x, id, &budget, &tokens, &pairs);
            n++;
        }
        while (!s->reserve_dispatch && s->q_off.n > 0 && s->offline_running < s->offline_limit &&
               n < max_items && budget > 0) {
            int id = sim_ideque_pop_front(&s->q_off);
            s->offline_running++;
            admit_prompt(s, x, id, &budget, &tokens, &pairs);
            n++;
        }
    }
    x->n_batch = n;
    if (n == 0) {
        if (!x->idle_listed) {
            x->idle_listed = 1;
            sim_ivec_push(&s->idle_prefill, w);
        }
        return;
    }
    x->busy = 1;
    sim_cluster_worker_event(s, w, s->now + costmodel_prefill_ms(s->cm, tokens, pairs),
                             SIM_CLUSTER_EV_PREFILL_DONE, 0);
}

static void wake_prefill(sim_cluster *s)
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
void sim_cluster_dispatch(sim_cluster *s)
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
        int w = sim_cluster_choose_decode(s, r->need, 1);
        if (w < 0)
            break;
        sim_ideque_pop_front(q);
        sim_cluster_hold(s, id, w);
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

/* Worker w's batch ended: every prompt whose last chunk it held has its first token now
 * (TTFT) and its KV on the way to a decode worker, arriving layer by layer at
 * max(now + transfer / n_layer, its first chunk's start + transfer). */
static void on_prefill_done(sim_cluster *s, int w)
{
    sworker *x = &s->w[w];
    int freed = 0, kept = 0;
    for (int i = 0; i < x->n_batch; i++) { /* the cache misses of those done, at once */
        const sprompt *e = &x->prog.v[i];
        if (e->done + e->chunk >= e->total)
            __builtin_prefetch(&s->reqs[e->id], 1);
    }
    for (int i = 0; i < x->prog.n; i++) {
        sprompt e = x->prog.v[i];
        if (i < x->n_batch)
            e.done += e.chunk;
        e.chunk = 0;
        if (e.done < e.total) { /* more chunks to come */
            x->prog.v[kept++] = e;
            continue;
        }
        int id = e.id;
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
                sim_cluster_unreserve(s, id);
                freed = 1;
            }
            sim_cluster_finish_req(s, id);
            continue;
        }
        if (!r->offline)
            s->online_decoding++;
        double xfer = sim_cluster_kv_transfer_ms(s, r);
        double arrive = fmax(s->now + xfer / s->cm->n_layer, e.start_ms + xfer);
        if (r->worker >= 0 && sim_cluster_accepts(s, r->worker)) { /* reserved at dispatch */
            r->state = SIM_CLUSTER_RQ_XFER;
            sim_heap_push_aux(&s->ev, arrive, SIM_CLUSTER_EV_XFER_DONE, id, r->epoch, r->worker);
            continue;
        }
        if (r->worker >= 0) { /* its worker left decode meanwhile */
            sim_cluster_unreserve(s, id);
            freed = 1;
        }
        sim_cluster_place_decode(s, id, arrive, 0);
    }
    x->prog.n = kept;
    x->n_batch = 0;
    x->busy = 0;
    if (x->changing && kept == 0)
        sim_cluster_switch_start(s, w, 0);
    else
        start_prefill(s, w);
    if (freed) {
        sim_cluster_drain_pending(s, -1);
        sim_cluster_dispatch(s);
    }
}

// --- role changes, preemption, the policy tick ---------------------------------------------

void sim_cluster_switch_start(sim_cluster *s, int w, double extra_ms)
{
    s->w[w].changing = 2;
    sim_cluster_worker_event(s, w, s->now + extra_ms + s->switch_ms, SIM_CLUSTER_EV_SWITCH_DONE,
                             0);
}

static void begin_change(sim_cluster *s, int w, int to)
{
    sworker *x = &s->w[w];
    ASSERT(x->role != to && !x->changing);
    if (x->role == POLICY_ROLE_DECODE)
        sim_cluster_cut(s, w); /* the next boundary migrates or drains */
    x->changing = 1;
    x->target = to;
    s->changes++;
    if (x->role == POLICY_ROLE_DECODE) {
        sim_cluster_dec_list_remove(s, w);
        if (!x->stepping) /* idle: nothing to migrate or drain */
            sim_cluster_migrate_all(s, w);
    } else if (!x->busy) {
        sim_cluster_switch_start(s, w, 0);
    }
}

static void on_switch_done(sim_cluster *s, int w)
{
    sworker *x = &s->w[w];
    x->role = x->target;
    x->changing = 0;
    x->role_since_ms = s->now;
    if (x->role == POLICY_ROLE_DECODE) {
        x->step = 0;
        sim_cluster_dec_list_add(s, w);
        sim_cluster_drain_pending(s, w);
        sim_cluster_dispatch(s);
    } else {
        start_prefill(s, w);
    }
}

/* Preempt up to k offline sequences, latest joined first (least progress lost); they
 * restart later from prompt + tokens so far. */
static void preempt(sim_cluster *s, int k)
{
    while (k > 0 && s->off_dec.n > 0) {
        int id = s->off_dec.v[--s->off_dec.n];
        uint32_t epoch = (uint32_t)s->off_dec_epoch.v[--s->off_dec_epoch.n];
        sreq *r = &s->reqs[id];
        if (r->epoch != epoch || r->state != SIM_CLUSTER_RQ_RUNNING || !r->offline)
            continue;
        int w = r->worker;
        sim_cluster_cut(s, w); /* its batch changes at the boundary in progress */
        sim_cluster_take_out(s, id);
        r->state = SIM_CLUSTER_RQ_QUEUED;
        sim_ideque_push_front(&s->q_off, id);
        s->offline_running--;
        s->preemptions++;
        k--;
        sim_cluster_drain_pending(s, w);
    }
}

static int cmp_pair(const void *a, const void *b)
{
    const double *x = a, *y = b;
    return (x[0] > y[0]) - (x[0] < y[0]);
}

static void on_tick(sim_cluster *s)
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
            sim_cluster_settle(s, i); /* last_step_ms: the step in progress now */
            p->running = x->running + x->incoming.n;
            p->kv_blocks_used = (int)(s->room[i].kv_reserved / 16);
            p->kv_blocks_total = (int)(s->kv_cap / 16);
            p->decode_batch = x->running;
            if (x->running > 0) {
                p->tpot_p90_ms = x->last_step_ms;
                s->step_ms_buf[2 * np] = x->last_step_ms;
                s->step_ms_buf[2 * np + 1] = x->running;
                np++;
            }
        } else {
            p->running = x->prog.n;
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
         * wait for decode room, so they count as decoding; so does every dispatched request
         * from dispatch on, its prefill not yet done included (it holds its decode slot:
         * gateway/cluster_tidal.c counts the whole active list). */
        c->online_decoding = s->online_running + (int)s->q_gw.n;
        /* of them: prompts still at a prefill worker, and requests waiting for room */
        c->online_prefilling = s->online_running - s->online_decoding;
        c->online_wait_room = (int)s->q_gw.n;
    } else {
        c->oldest_wait_ms =
            s->q_on.n ? (int64_t)(s->now - s->reqs[sim_ideque_front(&s->q_on)].arrival_ms) : 0;
        c->online_queued = (int)s->q_on.n;
        c->online_decoding = s->online_decoding;
    }
    c->online_running = s->online_running;
    c->prompt_tokens_arrived = s->prompt_tokens_arrived;
    c->output_tokens_done = s->output_tokens_done;
    c->online_done = s->online_done;
    c->online_arrived = s->n_online;
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
    if (s->on_tick) {
        sim_cluster_tick t = {
            .now_ms = s->now,
            .out = &out,
            .queued_prompt_tokens = s->q_on_tokens,
            .online_decoding = s->online_decoding,
            .pending_online = s->pend_on.n,
            .offline_running = s->offline_running,
        };
        s->on_tick(s->tick_ctx, &t);
    }
    for (int i = 0; i < out.n_actions; i++)
        begin_change(s, out.actions[i].worker, out.actions[i].role);
    s->offline_limit = out.offline_max_running;
    if (out.offline_preempt > 0)
        preempt(s, out.offline_preempt);
    sim_cluster_dispatch(s);
    wake_prefill(s);

    if (s->arrivals_done && s->q_on.n == 0 && s->q_gw.n == 0 && s->online_running == 0)
        s->stop = 1;
    else if (s->now >= s->hard_end_ms)
        s->stop = 1;
    else
        sim_heap_push(&s->ev, s->now + s->tick_ms, SIM_CLUSTER_EV_TICK, 0, 0);
}

// --- arrivals and the run --------------------------------------------------------------------

/* The submitted request arrives now. */
static void on_arrival(sim_cluster *s)
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
    r->state = SIM_CLUSTER_RQ_QUEUED;
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
    sim_cluster_dispatch(s);
    wake_prefill(s);
}

void sim_cluster_submit(sim_cluster *s, const sim_workload_arrival *a)
{
    ASSERT(!s->next_pending && !s->arrivals_done && !s->over);
    ASSERT(a->prompt >= 1 && a->out >= 1);
    s->next = *a;
    s->next_pending = 1;
    s->arr_t_ms = a->arrival_s * 1e3;
    s->arr_seq = s->ev.next_seq++;
}

void sim_cluster_arrivals_done(sim_cluster *s)
{
    ASSERT(!s->next_pending);
    s->arrivals_done = 1;
}

/* The run is over: check the book-keeping and take the figures. */
static void finish_run(sim_cluster *s)
{
    /* Book-keeping invariants: counters never go negative; a run that ended because every
     * online request finished has none left anywhere. */
    ASSERT(s->online_running >= 0 && s->online_decoding >= 0 && s->offline_running >= 0);
    for (int i = 0; i < s->n_workers; i++)
        ASSERT(s->room[i].kv_reserved >= 0 && s->room[i].assigned >= 0 && s->w[i].running >= 0 &&
               s->w[i].ctx_sum >= 0);
    if (s->now < s->hard_end_ms) {
        ASSERT(s->online_running == 0 && s->online_decoding == 0 && s->q_on.n == 0 &&
               s->q_gw.n == 0);
        ASSERT((int64_t)s->n_fin == s->n_online);
    }

    sim_cluster_figures *f = &s->fig;
    memset(f, 0, sizeof(*f));
    f->n_online = s->n_online;
    f->n_offline = s->n_offline;
    f->n_finished = (int64_t)s->n_fin;
    f->n_good = s->n_good;
    f->n_offline_done = s->n_offline_done;
    f->offline_tokens = s->offline_tokens;
    f->changes = s->changes;
    f->preemptions = s->preemptions;
    f->end_ms = s->now;
    /* each mean before its percentile, which reorders the samples */
    f->ttft_mean_ms = sim_stats_mean(s->ttft, s->n_fin);
    f->ttft_p99_ms = sim_stats_percentile(s->ttft, s->n_fin, 99);
    f->tpot_mean_ms = sim_stats_mean(s->tpot, s->n_fin);
    f->tpot_p99_ms = sim_stats_percentile(s->tpot, s->n_fin, 99);
    for (int i = 0; i < s->n_workers; i++)
        f->final_prefill += s->w[i].role == POLICY_ROLE_PREFILL;
    s->over = 1;
}

/* The earliest event of the three sources (the workers' slots, the heap, the submitted
 * arrival), taken out into *e. Returns 0, or -1 when there is none. */
static int next_event(sim_cluster *s, sim_heap_event *e)
{
    const sim_heap_event *a = s->ev.n ? &s->ev.v[0] : NULL;
    const sim_heap_event *b = sim_heap_slot_top(&s->wev);
    int from_slot = b && (!a || sim_heap_event_before(b->t_ms, b->seq, a->t_ms, a->seq));
    const sim_heap_event *m = from_slot ? b : a;
    if (s->next_pending && (!m || sim_heap_event_before(s->arr_t_ms, s->arr_seq, m->t_ms, m->seq))) {
        *e = (sim_heap_event){.t_ms = s->arr_t_ms, .seq = s->arr_seq,
                              .type = SIM_CLUSTER_EV_ARRIVAL};
        return 0;
    }
    if (!m)
        return -1;
    int rc = from_slot ? sim_heap_slot_pop(&s->wev, e) : sim_heap_pop(&s->ev, e);
    /* what the next events will touch, fetched while this one runs */
    if (s->wev.n) {
        const sim_heap_event *t = sim_heap_slot_top(&s->wev);
        __builtin_prefetch(&s->w[t->id], 1);
        __builtin_prefetch((const char *)(&s->w[t->id] + 1) - 1, 1); /* it spans two lines */
        if (t->type == SIM_CLUSTER_EV_PREFILL_DONE) {
            const char *p = (const char *)&s->prog_inl[(size_t)t->id * SIM_PROG_INLINE];
            for (size_t k = 0; k < SIM_PROG_INLINE * sizeof(sprompt); k += 64)
                __builtin_prefetch(p + k, 1);
        } else if (t->type == SIM_CLUSTER_EV_STEP_DONE) { /* the finish heap's top levels */
            const char *p = (const char *)&s->fin_inl[(size_t)t->id * SIM_FIN_STRIDE];
            __builtin_prefetch(p, 1);
            __builtin_prefetch(p + 64, 1);
            __builtin_prefetch(&s->inc_inl[(size_t)t->id * SIM_INC_INLINE], 1);
        }
    }
    if (s->ev.n && s->ev.v[0].type == SIM_CLUSTER_EV_XFER_DONE) { /* the request, its worker */
        const sim_heap_event *t = &s->ev.v[0];
        __builtin_prefetch(&s->reqs[t->id], 1);
        __builtin_prefetch(&s->w[t->aux], 1);
        __builtin_prefetch((const char *)(&s->w[t->aux] + 1) - 1, 1);
        __builtin_prefetch(&s->inc_inl[(size_t)t->aux * SIM_INC_INLINE], 1);
    }
    return rc;
}

int sim_cluster_run(sim_cluster *s)
{
    if (s->over)
        return 0;
    ASSERT(s->next_pending || s->arrivals_done);
    if (!s->started) {
        s->started = 1;
        sim_heap_push(&s->ev, 0, SIM_CLUSTER_EV_TICK, 0, 0);
    }
    sim_heap_event e;
    while (!s->stop && next_event(s, &e) == 0) {
        s->now = e.t_ms;
        switch (e.type) {
        case SIM_CLUSTER_EV_ARRIVAL:
            s->next_pending = 0;
            on_arrival(s);
            return 1;
        case SIM_CLUSTER_EV_PREFILL_DONE:
            on_prefill_done(s, e.id);
            break;
        case SIM_CLUSTER_EV_XFER_DONE:
            sim_cluster_on_xfer_done(s, e.id, e.epoch);
            break;
        case SIM_CLUSTER_EV_STEP_DONE:
            sim_cluster_on_step_done(s, e.id, e.epoch);
            break;
        case SIM_CLUSTER_EV_SWITCH_DONE:
            on_switch_done(s, e.id);
            break;
        case SIM_CLUSTER_EV_TICK:
            on_tick(s);
            break;
        default:
            ASSERT(0);
        }
    }
    finish_run(s);
    return 0;
}

void sim_cluster_figures_get(const sim_cluster *s, sim_cluster_figures *out)
{
    ASSERT(s->over);
    *out = s->fig;
}

double sim_cluster_now_ms(const sim_cluster *s)
{
    return s->now;
}

int sim_cluster_worker_get(const sim_cluster *s, int w, sim_cluster_worker_info *out)
{
    if (w < 0 || w >= s->n_workers)
        return -1;
    const sworker *x = &s->w[w];
    memset(out, 0, sizeof(*out));
    out->role = x->role;
    out->changing = x->changing;
    out->busy = x->busy;
    out->batch = x->busy ? x->n_batch : 0;
    out->running = x->running;
    out->assigned = s->room[w].assigned;
    out->kv_reserved = s->room[w].kv_reserved;
    out->steps = x->step;
    return 0;
}

// --- life cycle ----------------------------------------------------------------------------

sim_cluster_params sim_cluster_default_params(void)
{
    return (sim_cluster_params){
        .policy = policy_default_params(),
        .n_workers = 8,
        .n_prefill = 4,
        .tidal = 1,
        .drain = 0,
        .reserve_dispatch = 0,
        .prefill_chunk_tokens = 512,
        .tick_ms = 1000,
        .switch_ms = 500,
        .ttft_slo_ms = 2000,
        .tpot_slo_ms = 50,
        .hard_end_ms = INFINITY,
        .seed = 1,
        .on_tick = NULL,
        .tick_ctx = NULL,
    };
}

sim_cluster *sim_cluster_new(const costmodel *cm, const sim_cluster_params *p)
{
    ASSERT(cm && p);
    ASSERT(p->n_workers >= 2 && p->n_prefill >= 0 && p->n_prefill <= p->n_workers);
    ASSERT(p->tick_ms > 0 && p->switch_ms >= 0);
    sim_cluster *s = sim_mem_realloc(NULL, sizeof(*s));
    memset(s, 0, sizeof(*s));
    s->cm = cm;
    s->sc = (sim_step_cost){
        .weight_bytes = costmodel_weight_bytes(cm),
        .kv_bytes_per_token = costmodel_kv_bytes_per_token(cm),
        .mem_bytes_per_s = cm->hbm_bytes_per_s * cm->mbu,
        .flops_per_seq = 2.0 * cm->n_params,
        .flops_per_pair = 4.0 * cm->n_layer * (double)cm->n_head * cm->head_dim,
        .flops_per_s = cm->peak_flops * cm->mfu_decode,
        .overhead_ms = cm->step_overhead_ms,
        .time_scale = cm->time_scale,
    };
    s->pp = p->policy;
    if (!p->tidal) {
        s->pp.max_changes = 0;
        s->pp.max_change_frac = 0;
    }
    int n_workers = p->n_workers;
    s->n_workers = n_workers;
    s->drain = p->drain;
    s->single_steps = p->single_steps;
    s->reserve_dispatch = p->reserve_dispatch;
    ASSERT(p->prefill_chunk_tokens >= 0);
    s->chunk_tokens = p->prefill_chunk_tokens;
    s->tick_ms = p->tick_ms;
    s->switch_ms = p->switch_ms;
    s->ttft_slo_ms = p->ttft_slo_ms;
    s->tpot_slo_ms = p->tpot_slo_ms;
    s->kv_cap = costmodel_kv_capacity_tokens(cm);
    s->hard_end_ms = p->hard_end_ms;
    s->on_tick = p->on_tick;
    s->tick_ctx = p->tick_ctx;
    s->free_head = -1;
    sim_rng_seed(&s->prng, p->seed ^ 0x5eed5eed5eedull);
    policy_state_init(&s->pst);
    s->w = sim_mem_realloc_aligned(NULL, 0, (size_t)n_workers * sizeof(sworker), 64);
    memset(s->w, 0, (size_t)n_workers * sizeof(sworker));
    s->room = sim_mem_realloc_aligned(NULL, 0, (size_t)n_workers * sizeof(sroom), 64);
    s->prog_inl = sim_mem_realloc_aligned(
        NULL, 0, (size_t)n_workers * SIM_PROG_INLINE * sizeof(sprompt), 64);
    s->fin_inl = sim_mem_realloc_aligned(
        NULL, 0, (size_t)n_workers * SIM_FIN_STRIDE * sizeof(sim_heap_fin_entry), 64);
    s->inc_inl = sim_mem_realloc_aligned(NULL, 0, (size_t)n_workers * SIM_INC_INLINE * sizeof(int),
                                         64);
    memset(s->room, 0, (size_t)n_workers * sizeof(sroom));
    sim_heap_slot_init(&s->wev, n_workers);
    s->dec_list = sim_mem_realloc(NULL, (size_t)n_workers * sizeof(int));
    s->pin = sim_mem_realloc(NULL, (size_t)n_workers * sizeof(policy_worker));
    s->step_ms_buf = sim_mem_realloc(NULL, (size_t)n_workers * 2 * sizeof(double));
    for (int i = 0; i < n_workers; i++) {
        sworker *x = &s->w[i];
        x->role = i < p->n_prefill ? POLICY_ROLE_PREFILL : POLICY_ROLE_DECODE;
        x->role_since_ms = -1e12; /* settled: the policy may move it at once */
        x->dec_pos = -1;
        x->fin_top = INT64_MAX;
        x->prog.v = &s->prog_inl[(size_t)i * SIM_PROG_INLINE];
        x->prog.cap = SIM_PROG_INLINE;
        x->fin = (sim_heap_fin){.v = &s->fin_inl[(size_t)i * SIM_FIN_STRIDE],
                                .cap = SIM_FIN_INLINE, .ext = 1};
        x->incoming = (sim_ivec){.v = &s->inc_inl[(size_t)i * SIM_INC_INLINE],
                                 .cap = SIM_INC_INLINE, .ext = 1};
        if (x->role == POLICY_ROLE_DECODE)
            sim_cluster_dec_list_add(s, i);
        else
            start_prefill(s, i); /* nothing queued yet: lists it as idle */
    }
    return s;
}

void sim_cluster_destroy(sim_cluster **c)
{
    sim_cluster *s = *c;
    if (!s)
        return;
    for (int i = 0; i < s->n_workers; i++) {
        if (s->w[i].prog.v != &s->prog_inl[(size_t)i * SIM_PROG_INLINE])
            free(s->w[i].prog.v);
        sim_ivec_free(&s->w[i].incoming);
        sim_heap_fin_free(&s->w[i].fin);
    }
    free(s->w);
    free(s->room);
    free(s->prog_inl);
    free(s->fin_inl);
    free(s->inc_inl);
    sim_heap_slot_free(&s->wev);
    free(s->dec_list);
    free(s->pin);
    free(s->step_ms_buf);
    free(s->reqs);
    sim_heap_free(&s->ev);
    sim_ideque_free(&s->q_on);
    sim_ideque_free(&s->q_off);
    sim_ideque_free(&s->q_gw);
    sim_ideque_free(&s->pend_on);
    sim_ideque_free(&s->pend_off);
    sim_ivec_free(&s->idle_prefill);
    sim_ivec_free(&s->off_dec);
    sim_ivec_free(&s->off_dec_epoch);
    free(s->ttft);
    free(s->tpot);
    free(s->win_ttft);
    free(s);
    *c = NULL;
}
