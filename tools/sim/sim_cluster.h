/*
 * sim_cluster: the simulated disaggregated cluster of tidepool-sim, a discrete-event model
 * of tidepool's gateway, prefill and decode workers, timed by the cost model
 * (common/costmodel.h) and steered by the gateway's own tidal policy (gateway/policy.h).
 * Every figure it gives is *emulated*. docs/scheduler.md has the model in full:
 *
 *   - gateway: online and offline FIFO queues; online first; offline prompts start only
 *     while fewer than the policy's offline limit are running.
 *   - prefill worker: batches as tidepool's does (chunked prefill): each batch takes the
 *     next chunk (at most prefill_chunk_tokens) of every prompt it is computing, then
 *     prompts from the queue while the token budget (max-batch-tokens) lasts, the last
 *     one's chunk cut to fit, and takes costmodel_prefill_ms for its tokens and attention
 *     pairs (a chunk attends to the prompt's tokens before it); a long prompt thus spans
 *     several batches, and its first token (TTFT) is out at the end of its last chunk's.
 *     KV moves to a decode worker chosen then (most free KV of two random ones, else the
 *     best of all; with at most 16 decode workers always the best of all, the first listed
 *     on a tie), layer by layer: it arrives at max(end + transfer/n_layer, start of its
 *     first chunk + transfer).
 *   - decode worker: continuous batching; a step over the running sequences takes
 *     costmodel_decode_step_ms(batch, total context); arrivals join at step boundaries;
 *     KV is reserved for prompt + output. No room anywhere: the sequence waits (online
 *     first) and is pulled by the next worker that frees KV.
 *   - role change: a prefill worker finishes the prompts it has begun; a decode worker migrates its
 *     sequences (their KV over the link, one after another) at the next step boundary, or
 *     drains them; then either pays switch_ms before serving in the new role.
 *   - the policy runs every tick_ms (the first tick at time 0) on the figures a real
 *     gateway would see; preempted offline sequences restart later from prompt + tokens so
 *     far (recompute).
 *
 * The caller feeds the arrivals one at a time (sim_cluster_submit) and runs the events in
 * between (sim_cluster_run). Events are ordered by (time, insertion) (the workers' own in a
 * heap with one slot per worker, the others in a second heap, sharing one count of
 * insertions: sim_cluster_internal.h), so a run is deterministic: the same parameters and
 * arrivals give the same figures, bit for bit. Memory grows with the requests in the system; running out of it ends the program
 * (sim_mem.h). One cluster per run; not thread-safe.
 */
#ifndef TP_SIM_CLUSTER_H
#define TP_SIM_CLUSTER_H

#include <stddef.h>
#include <stdint.h>

#include "costmodel.h"
#include "policy.h"
#include "sim_workload.h"

typedef struct sim_cluster sim_cluster;

/* What the policy saw and decided at one tick (for --verbose). Borrowed for the call. */
typedef struct {
    double now_ms;                /* simulated time of the tick */
    const policy_output *out;     /* the decision, before its actions are applied */
    int64_t queued_prompt_tokens; /* online prompt tokens in the prefill queue */
    int online_decoding;          /* online sequences past prefill, not finished */
    size_t pending_online;        /* prefilled online sequences waiting for decode room */
    int offline_running;          /* offline requests admitted and not finished */
} sim_cluster_tick;

/* Called at every policy tick; must not call back into the cluster. */
typedef void (*sim_cluster_tick_fn)(void *ctx, const sim_cluster_tick *t);

typedef struct {
    /* The policy's parameters (valid: policy_params_check). With tidal = 0 the cluster
     * zeroes max_changes and max_change_frac: the split never changes. */
    policy_params policy;
    int n_workers;        /* >= 2 */
    int n_prefill;        /* workers in the prefill role at the start, the rest decode */
    int tidal;            /* 1: the policy may change roles; 0: a static split */
    int drain;            /* a decode worker leaving decode: 1 drains, 0 migrates */
    int reserve_dispatch; /* decode room reserved: 1 before prefill (at dispatch, as
                           * tidepool's gateway does), 0 when prefill ends */
    int prefill_chunk_tokens; /* tokens of one prompt per prefill batch (a worker's
                               * --prefill-chunk-tokens): a longer prompt is computed over
                               * several batches; 0 = only the batch budget limits it */
    double tick_ms;       /* policy interval, > 0 */
    double switch_ms;     /* role change cost after draining, >= 0 */
    double ttft_slo_ms;   /* a finished online request within both SLOs counts as good */
    double tpot_slo_ms;   /* (TPOT: its mean time per output token after the first) */
    double hard_end_ms;   /* the run stops at the first tick at or after this time (requests
                           * unfinished then count as missed); INFINITY = none */
    uint64_t seed;        /* the placement's random choices (a stream apart from the
                           * workload's) */
    int single_steps;     /* 1: one event per decode step; 0 (default): one event per run
                           * of steps between batch changes. Same figures bit for bit (the
                           * runs repeat the steps' sums); 1 is the reference the tests
                           * compare the runs against. */

    sim_cluster_tick_fn on_tick; /* NULL: none */
    void *tick_ctx;              /* passed to on_tick */
} sim_cluster_params;

/* The figures of a finished run. Times in ms, over the online requests that finished. */
typedef struct {
    int64_t n_online, n_offline;  /* arrived */
    int64_t n_finished, n_good;   /* online: finished; finished within both SLOs */
    int64_t n_offline_done;       /* offline requests finished */
    int64_t offline_tokens;       /* their output tokens */
    int64_t changes, preemptions; /* role changes begun; offline sequences preempted */
    double end_ms;                /* simulated time when the run stopped */
    double ttft_mean_ms, ttft_p99_ms, tpot_mean_ms, tpot_p99_ms; /* sim_stats definitions */
    int final_prefill; /* workers in the prefill role at the end */
} sim_cluster_figures;

/* One worker's state, for inspection. */
typedef struct {
    int role;            /* POLICY_ROLE_PREFILL | POLICY_ROLE_DECODE (the current one) */
    int changing;        /* 0, 1 = draining, 2 = switching */
    int busy;            /* prefill: a batch is running */
    int batch;           /* prefill: prompts in the running batch (a chunk of each) */
    int running;         /* decode: sequences in the batch */
    int assigned;        /* decode: sequences holding room here (running, joining, on
                          * their way) */
    int64_t kv_reserved; /* decode: KV tokens reserved */
    int64_t steps;       /* decode: steps completed in this role */
} sim_cluster_worker_info;

/* Defaults: the tool's (policy_default_params, 8 workers, 4 prefill, tidal, migrate,
 * reserve when prefill ends, chunks of 512 prompt tokens, tick 1000 ms, switch 500 ms, SLOs 2000 / 50 ms, no hard end,
 * seed 1, no tick callback). */
sim_cluster_params sim_cluster_default_params(void);

/* A cluster of p->n_workers idle workers at time 0 on cost model cm (borrowed: it must
 * outlive the cluster; KV capacity per worker is costmodel_kv_capacity_tokens(cm)).
 * Bad parameters are programmer errors (ASSERT). Never NULL (out of memory exits). The
 * result is the caller's: sim_cluster_destroy. */
sim_cluster *sim_cluster_new(const costmodel *cm, const sim_cluster_params *p);

/* Free everything; takes NULL and NULLs *c. */
void sim_cluster_destroy(sim_cluster **c);

/* The next request (copied): it arrives at a->arrival_s (seconds; not before the previous
 * one). One at a time: submit the next only after sim_cluster_run has returned 1 (ASSERT). */
void sim_cluster_submit(sim_cluster *c, const sim_workload_arrival *a);

/* No request comes after the last submitted: the run stops at the first tick that finds
 * every online request finished. */
void sim_cluster_arrivals_done(sim_cluster *c);

/* Run the events (the first call schedules the first policy tick at time 0, after an
 * arrival already submitted for time 0) up to and including the submitted arrival.
 * Returns 1 when that request has arrived (the clock is at its time: submit the next one
 * or call sim_cluster_arrivals_done), 0 when the run is over (sim_cluster_figures_get has
 * its figures; further calls return 0). Running out of events with a request still to
 * arrive cannot happen: the policy tick always comes back. */
int sim_cluster_run(sim_cluster *c);

/* The figures of the run; c's run must be over (sim_cluster_run returned 0, ASSERT). */
void sim_cluster_figures_get(const sim_cluster *c, sim_cluster_figures *out);

/* Simulated time (ms). */
double sim_cluster_now_ms(const sim_cluster *c);

/* Worker w's state into *out. Returns 0, or -1 when w is not a worker of c. */
int sim_cluster_worker_get(const sim_cluster *c, int w, sim_cluster_worker_info *out);

#endif
