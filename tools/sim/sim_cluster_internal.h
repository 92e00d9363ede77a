/*
 * sim_cluster_internal: the simulated cluster's state, shared by the files of the
 * sim_cluster module (sim_cluster.h): sim_cluster.c (the public calls, requests, prefill
 * and dispatch, role changes, preemption, the policy tick) and sim_cluster_decode.c
 * (decode placement and decode steps). Not a public interface.
 *
 * Requests live in one array reused through a free list; every place that refers to a
 * request (an event, a finish-heap entry, the list of offline sequences) carries the
 * request's epoch from then, and the request bumps its epoch whenever it leaves a place, so
 * stale references are recognized and skipped instead of searched for and removed.
 */
#ifndef TP_SIM_CLUSTER_INTERNAL_H
#define TP_SIM_CLUSTER_INTERNAL_H

#include <stdint.h>

#include "log.h"

#include "costmodel.h"
#include "policy.h"
#include "sim_cluster.h"
#include "sim_heap.h"
#include "sim_ideque.h"
#include "sim_ivec.h"
#include "sim_rng.h"
#include "sim_workload.h"

/* Event types (sim_heap_event.type). id is a worker, except for SIM_CLUSTER_EV_XFER_DONE
 * (a request, with its epoch) and the two that carry none (arrival, tick). */
enum {
    SIM_CLUSTER_EV_ARRIVAL = 1,
    SIM_CLUSTER_EV_PREFILL_DONE,
    SIM_CLUSTER_EV_XFER_DONE,
    SIM_CLUSTER_EV_STEP_DONE,
    SIM_CLUSTER_EV_SWITCH_DONE,
    SIM_CLUSTER_EV_TICK,
};

/* Where a request is (sreq.state). */
enum {
    SIM_CLUSTER_RQ_FREE = 0,
    SIM_CLUSTER_RQ_QUEUED,   /* at the gateway */
    SIM_CLUSTER_RQ_PREFILL,  /* in a prefill batch */
    SIM_CLUSTER_RQ_XFER,     /* KV on its way to a decode worker (reserved there) */
    SIM_CLUSTER_RQ_PENDING,  /* prefilled, waiting for room on a decode worker */
    SIM_CLUSTER_RQ_INCOMING, /* on its decode worker, joins at the next step boundary */
    SIM_CLUSTER_RQ_RUNNING,  /* in its decode worker's batch */
};

/* One request: 64 bytes, one cache line (the array is aligned to 64), since touching a
 * request is most of what an event costs at 10,000 workers. */
typedef struct {
    _Alignas(64) double arrival_ms; /* (the alignment pads the record to the full line) */
    double first_ms;                /* < 0: no token yet */
    int64_t s0;                  /* worker step when it joined the batch */
    int prompt, out;             /* tokens */
    int gen;                     /* tokens generated so far (the first included) */
    int worker;                  /* decode worker holding its reservation, -1 none */
    int need;                    /* KV tokens reserved: prompt + out */
    uint32_t epoch;              /* bumped whenever it leaves a place (stale entries) */
    int next_free;
    uint8_t offline, state;
} sreq;
_Static_assert(sizeof(sreq) == 64, "a request is one cache line");

/* A prompt being computed on a prefill worker, in chunks (prefill_worker/prefill_batch.c). */
typedef struct {
    int id;          /* the request */
    int done;        /* its tokens (prompt + tokens so far) computed */
    int chunk;       /* its tokens in the running batch, 0 none */
    int total;       /* tokens to compute: the request's prompt + gen (fixed meanwhile) */
    int prompt;      /* the request's prompt */
    int counted;     /* its prompt part is in sim_cluster.q_on_tokens */
    double start_ms; /* when its first chunk began (its KV transfer starts then) */
} sprompt; /* the request's fields a chunk needs, copied: a chunk touches no request */

/* A prefill worker's prompts being computed, in arrival order: a growable array that
 * starts in the worker's SIM_PROG_INLINE entries of sim_cluster.prog_inl (one block for
 * all workers, so the next event's prompts can be fetched from the worker's index alone),
 * moved to an allocation of its own when it outgrows them. */
typedef struct {
    sprompt *v;
    int n, cap;
} sprompts;
#define SIM_PROG_INLINE 8
/* Likewise each decode worker's finish heap and incoming list start in blocks of their own
 * (sim_cluster.fin_inl, .inc_inl: a worker's block found from its index). The finish
 * blocks are SIM_FIN_INLINE entries apart plus one line, so that the roots of 10,000 heaps
 * do not all fall in the same cache sets. */
#define SIM_FIN_INLINE 256
#define SIM_FIN_STRIDE (SIM_FIN_INLINE + 4)
#define SIM_INC_INLINE 16

/* A worker. The fields a decode step reads come first (one cache line); the KV room
 * placement looks at is apart, in sim_cluster.room, a compact array. */
typedef struct {
    /* decode: the step and its run */
    int stepping;
    int running;           /* sequences in the batch */
    int64_t step, ctx_sum; /* completed steps; context tokens of the running sequences */
    int64_t fin_top;       /* fin's earliest finish step, INT64_MAX when fin is empty */
    double last_step_ms;   /* the step in progress */
    /* Runs of steps (sim_cluster_decode.c): between two events that change a batch (a
     * sequence finishing, joining or leaving, a role change) its steps are known in
     * advance, so one STEP_DONE event stands for a run of them. step_t0 is when the step in
     * progress began (the last boundary passed), step_end the step count at the pending
     * event, step_epoch that event's epoch (a run cut short leaves a stale one). */
    double step_t0;
    int64_t step_end;
    uint32_t step_epoch;
    int changing; /* 0, 1 = draining, 2 = switching */
    int role;     /* POLICY_ROLE_PREFILL | POLICY_ROLE_DECODE */
    int target;   /* role it is changing to */
    double role_since_ms;
    int dec_pos;
    sim_heap_fin fin;
    sim_ivec incoming;
    /* prefill */
    int busy, idle_listed;
    int n_batch;      /* prompts in the running batch: prog.v[0 .. n_batch) */
    sprompts prog;    /* prompts being computed, in arrival order */
} sworker;

/* A decode worker's room (placement reads these for random workers: kept compact). */
typedef struct {
    int64_t kv_reserved; /* tokens */
    int assigned;        /* reserved here (running + incoming + in flight) */
} sroom;

/* costmodel_decode_step_ms's constants, computed once by the same expressions (so the
 * inline step time below is the function's, bit for bit): it runs for every decode step. */
typedef struct {
    double weight_bytes, kv_bytes_per_token, mem_bytes_per_s; /* bytes, bytes/s */
    double flops_per_seq, flops_per_pair, flops_per_s;
    double overhead_ms, time_scale;
} sim_step_cost;

struct sim_cluster {
    /* configuration */
    const costmodel *cm;
    sim_step_cost sc;
    policy_params pp;
    int n_workers;
    int drain;            /* --role-change drain */
    int single_steps;     /* sim_cluster_params.single_steps */
    int reserve_dispatch; /* --decode-reserve dispatch */
    int chunk_tokens;     /* sim_cluster_params.prefill_chunk_tokens, 0 = no limit */
    double tick_ms, switch_ms, ttft_slo_ms, tpot_slo_ms, kv_cap, hard_end_ms;
    sim_cluster_tick_fn on_tick;
    void *tick_ctx;
    /* clock and events: the workers' own events (a prefill batch, a run of decode steps, a
     * role switch: at most one pending per worker) in wev, the rest (transfers, the tick)
     * in ev, the submitted arrival apart (arr_*); all three ordered by one count of
     * sequence numbers (ev.next_seq), so the order is that of one heap. */
    double now;
    sim_heap ev;
    sim_heap_slot wev;
    double arr_t_ms;
    uint64_t arr_seq;
    int started, stop, over;
    /* requests */
    sreq *reqs;
    int n_reqs, free_head;
    sim_workload_arrival next; /* the submitted arrival */
    int next_pending;          /* next is submitted and has not arrived */
    int arrivals_done;
    /* workers and queues. q_on is the prefill queue. With reserve_dispatch, q_gw holds the
     * online requests waiting at the gateway for decode room, q_off the offline ones, and
     * q_on both kinds once dispatched (their decode room reserved). */
    sworker *w;
    sroom *room;
    sprompt *prog_inl; /* (n_workers, SIM_PROG_INLINE): where each worker's prompts start */
    sim_heap_fin_entry *fin_inl; /* (n_workers, SIM_FIN_STRIDE): finish heaps' first blocks */
    int *inc_inl;                /* (n_workers, SIM_INC_INLINE): incoming lists' */
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
    int64_t output_tokens_done; /* output tokens of online requests that finished */
    int64_t online_done;        /* online requests that finished */
    /* metrics */
    double *ttft, *tpot;
    size_t n_fin, cap_fin;
    double *win_ttft;
    size_t n_win, cap_win;
    int64_t n_online, n_good, n_offline, n_offline_done, offline_tokens, preemptions, changes;
    sim_cluster_figures fig; /* when over */
};

/* costmodel_decode_step_ms(cm, batch, ctx_tokens), inline, from s->sc. */
static inline double sim_cluster_step_ms(const sim_cluster *s, double batch, double ctx_tokens)
{
    const sim_step_cost *c = &s->sc;
    if (batch <= 0)
        return 0;
    if (ctx_tokens < 0)
        ctx_tokens = 0;
    double t_mem = (c->weight_bytes + c->kv_bytes_per_token * ctx_tokens) / c->mem_bytes_per_s;
    double t_compute = (c->flops_per_seq * batch + c->flops_per_pair * ctx_tokens) / c->flops_per_s;
    return (1e3 * (t_mem > t_compute ? t_mem : t_compute) + c->overhead_ms) * c->time_scale;
}

/* Worker w takes new sequences: a decode worker not changing role. */
static inline int sim_cluster_accepts(const sim_cluster *s, int w)
{
    return s->w[w].role == POLICY_ROLE_DECODE && !s->w[w].changing;
}

/* Worker w has room for a sequence of need KV tokens (and a slot). */
static inline int sim_cluster_fits(const sim_cluster *s, int w, int need)
{
    const sroom *x = &s->room[w];
    return x->kv_reserved + need <= s->kv_cap && x->assigned < s->cm->max_seqs;
}

/* Worker w's event (SIM_CLUSTER_EV_PREFILL_DONE, _STEP_DONE or _SWITCH_DONE) at t_ms: it
 * replaces the one w had, which must be a stale run of steps (ASSERT). */
static inline void sim_cluster_worker_event(sim_cluster *s, int w, double t_ms, int type,
                                            uint32_t epoch)
{
    int old = sim_heap_slot_set(&s->wev, w, t_ms, s->ev.next_seq++, type, epoch);
    ASSERT(old == 0 || old == SIM_CLUSTER_EV_STEP_DONE);
}

/* Time (ms) to move request r's KV (prompt + tokens so far) over the link. */
static inline double sim_cluster_kv_transfer_ms(const sim_cluster *s, const sreq *r)
{
    return costmodel_transfer_ms(s->cm, (double)r->prompt + r->gen);
}

// --- sim_cluster.c

/* Request id has all its tokens: count it in the figures and free it. */
void sim_cluster_finish_req(sim_cluster *s, int id);

/* With reserve_dispatch: move requests waiting at the gateway to the prefill queue while a
 * decode worker has room for them (else nothing). */
void sim_cluster_dispatch(sim_cluster *s);

/* Worker w starts switching roles: done (SIM_CLUSTER_EV_SWITCH_DONE) after extra_ms (its
 * migrations) + switch_ms. */
void sim_cluster_switch_start(sim_cluster *s, int w, double extra_ms);

// --- sim_cluster_decode.c

/* A decode worker with room for need tokens, or -1: the one with more free KV of two
 * random ones (all of them when there are at most 16), else, when scan is set and at most
 * once per KV-freeing event, the best of all. */
int sim_cluster_choose_decode(sim_cluster *s, int need, int scan);

/* Reserve room for request id on decode worker w (KV for prompt + output, one slot). */
void sim_cluster_hold(sim_cluster *s, int id, int w);

/* Give back request id's room on its worker; it leaves its place (epoch bumped). */
void sim_cluster_unreserve(sim_cluster *s, int id);

/* A prefilled (or migrating) sequence needs a decode worker; its KV can be there at
 * arrive_ms if one is found now, else it waits (at the front of its queue if front is
 * set), online first. */
void sim_cluster_place_decode(sim_cluster *s, int id, double arrive_ms, int front);

/* Room appeared (hint: the worker that freed it, or -1): admit waiting sequences. */
void sim_cluster_drain_pending(sim_cluster *s, int hint);

/* Worker w joins / leaves the list of decode workers that take new sequences. */
void sim_cluster_dec_list_add(sim_cluster *s, int w);
void sim_cluster_dec_list_remove(sim_cluster *s, int w);

/* Take a running (or joining) sequence out of its worker at a step boundary; its progress
 * is kept and its room given back. */
void sim_cluster_take_out(sim_cluster *s, int id);

/* Decode worker w, draining, hands its sequences to others (KV over the link, one after
 * another), then switches. */
void sim_cluster_migrate_all(sim_cluster *s, int w);

/* Events: decode worker w finished a step; request id's KV (from its epoch) arrived. */
void sim_cluster_on_step_done(sim_cluster *s, int w, uint32_t epoch);
/* Bring decode worker w's step count, context and step time up to the last step boundary
 * before now (the run of steps stays pending). */
void sim_cluster_settle(sim_cluster *s, int w);
/* settle, then end w's run at the boundary after now: the batch is about to change (a
 * sequence joins or leaves, a role change), which the next boundary must see. */
void sim_cluster_cut(sim_cluster *s, int w);
void sim_cluster_on_xfer_done(sim_cluster *s, int id, uint32_t epoch);

#endif
