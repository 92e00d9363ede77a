/*
 * tidepool-sim: discrete-event simulation of a disaggregated tidepool cluster, driven by
 * the same tidal policy code the gateway runs (gateway/policy.c) and timed by the cost
 * model of a real accelerator (common/costmodel.c). Every figure it prints is *emulated*.
 *
 *   tidepool-sim --workers 8 --workload phase-shift [--duration-s S --rate R --seed S]
 *   tidepool-sim --workers 64 --trace FILE --policy static:24
 *   tidepool-sim --workers 8 --compare-static
 *   tidepool-sim --workers 16 --workload conversation|code|mix --load 0.8 --compare-static
 *
 * The simulated cluster (its queues, prefill batches, decode placement and steps, role
 * changes and the policy tick) is tools/sim/sim_cluster.h, which has the model; this file
 * holds the flags, feeds each run its arrivals (a trace, the phase-shift generator or a
 * steady one: sim_workload.h), and ranks and prints the runs. The same flags give the same output, byte for byte
 * (except the wall-time line on stderr).
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
#include "sim_cluster.h"
#include "sim_mem.h"
#include "sim_workload.h"

// --- settings ------------------------------------------------------------------------------

static long long opt_workers, opt_seed, opt_initial_prefill, opt_max_changes, opt_max_seqs,
    opt_max_batch_tokens, opt_min_per_role, opt_chunk_tokens;
static char *opt_trace, *opt_workload, *opt_policy, *opt_preset, *opt_role_change,
    *opt_decode_reserve;
static double opt_duration_s, opt_phase_s, opt_rate, opt_load, opt_offline_frac;
static double opt_ttft_slo_ms, opt_tpot_slo_ms, opt_tick_ms, opt_switch_ms;
static double opt_min_role_s, opt_window_s, opt_max_change_frac, opt_act_pressure, opt_band;
static double opt_smooth_s, opt_reverse_hold_s, opt_warmup_s, opt_target_pressure;
static int opt_compare_static, opt_verbose, opt_start_estimate, opt_decode_token_rate;
static int opt_capacity_moves, opt_donor_guard, opt_startup_fix, opt_startup_settle;

static const config_entry_t settings[] = {
    {"workers", CONFIG_INT, &opt_workers, "8", 2, 100000, "workers in the cluster"},
    {"trace", CONFIG_STRING, &opt_trace, NULL, 0, 0,
     "replay this trace (CSV arrival_s,prompt_tokens,output_tokens[,class] or JSONL)"},
    {"workload", CONFIG_STRING, &opt_workload, "phase-shift", 0, 0,
     "generated workload when no --trace: phase-shift | conversation | code | mix | shift (a "
     "day of --duration-s: code 15 % at night, 75 % in working hours, else conversation)"},
    {"duration-s", CONFIG_DOUBLE, &opt_duration_s, "600", 1, 1e7,
     "generated workloads: seconds of arrivals"},
    {"phase-s", CONFIG_DOUBLE, &opt_phase_s, "120", 1, 1e7,
     "phase-shift: seconds of each prefill-heavy / decode-heavy phase"},
    {"rate", CONFIG_DOUBLE, &opt_rate, "0", 0, 1e7,
     "generated workloads: arrivals per second (0 = --load times the cluster's estimated "
     "capacity)"},
    {"load", CONFIG_DOUBLE, &opt_load, "0.7", 0.01, 10,
     "generated workloads with --rate 0: offered load as a share of capacity"},
    {"offline-frac", CONFIG_DOUBLE, &opt_offline_frac, "0.1", 0, 1,
     "generated workloads: share of arrivals that are offline (flex / batch)"},
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
    {"prefill-chunk-tokens", CONFIG_INT, &opt_chunk_tokens, "512", 0, 100000000,
     "tokens of one prompt per prefill batch (the engine's --prefill-chunk-tokens): a longer "
     "prompt is computed over several batches; 0 = only --max-batch-tokens limits it"},
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
    {"capacity-moves", CONFIG_BOOL, &opt_capacity_moves, "true", 0, 0,
     "policy: moves that bring the gaining role's load pressure to 1 are not held back by the "
     "rate cap (as far as the donor stays within capacity)"},
    {"startup-fix", CONFIG_BOOL, &opt_startup_fix, "true", 0, 0,
     "policy: a capacity move may undo a change made in the warm-up at once (no reversal "
     "guard)"},
    {"startup-settle", CONFIG_BOOL, &opt_startup_settle, "true", 0, 0,
     "policy: in the warm-up a role that gained workers gains no more for smooth-s but by a "
     "capacity move"},
    {"donor-guard", CONFIG_BOOL, &opt_donor_guard, "true", 0, 0,
     "policy: no move leaves the donor's load pressure above 1 (or above the gainer's)"},
    {"start-from-estimate", CONFIG_BOOL, &opt_start_estimate, "true", 0, 0,
     "policy: once the first window of traffic is seen, move to the estimated split"},
    {"target-pressure", CONFIG_DOUBLE, &opt_target_pressure, "0.7", 0.01, 10,
     "policy: the estimate brings the busier role to this pressure (or the shared one)"},
    {"warmup-s", CONFIG_DOUBLE, &opt_warmup_s, "30", 0, 1e6,
     "policy: the first window of traffic (before it: no estimate, only pressure >= 1 moves)"},
    {"decode-token-rate", CONFIG_BOOL, &opt_decode_token_rate, "true", 0, 0,
     "policy: count decode load by output tokens/s against a worker's token rate (the cost "
     "model's), not by running sequences alone"},
    {"reverse-hold-s", CONFIG_DOUBLE, &opt_reverse_hold_s, "7.5", 0, 1e6,
     "policy: after a recent reversal, the rule must ask for another this long (doubling)"},
    {NULL, 0, NULL, NULL, 0, 0, NULL},
};

// --- arrivals and the run --------------------------------------------------------------------

typedef struct {
    char name[32];
    int64_t n_online, n_good, n_finished, n_offline, n_offline_done;
    double span_s, end_s, goodput, attain_pct;
    double ttft_mean, ttft_p99, tpot_mean, tpot_p99;
    double offline_rps, offline_tok_s;
    int64_t changes, preemptions;
    int final_prefill;
} sim_result;

/* --verbose: every decision that changes roles, and the pressures every 10 s. */
static void print_tick(void *ctx, const sim_cluster_tick *t)
{
    const policy_output *out = t->out;
    (void)ctx;
    if (out->n_actions > 0 || fmod(t->now_ms, 10000) < opt_tick_ms / 2)
        fprintf(stderr,
                "t=%7.1fs P=%d D=%d p_prefill=%.2f p_decode=%.2f queue=%lld tok decoding=%d "
                "pending=%zu offline run=%d limit=%d preempt=%d%s\n",
                t->now_ms / 1e3, out->n_prefill, out->n_decode, out->prefill_pressure,
                out->decode_pressure, (long long)t->queued_prompt_tokens, t->online_decoding,
                t->pending_online, t->offline_running, out->offline_max_running,
                out->offline_preempt,
                out->n_actions
                    ? (out->actions[0].role == POLICY_ROLE_PREFILL ? "  -> prefill" : "  -> decode")
                    : "");
}

/* Submit the workload's next arrival, or say there is none. */
static void submit_next(sim_cluster *c, sim_workload *wl)
{
    sim_workload_arrival a;
    if (sim_workload_next(wl, &a))
        sim_cluster_submit(c, &a);
    else
        sim_cluster_arrivals_done(c);
}

/* One simulation. n_prefill: initial prefill workers; tidal: whether roles may change. */
static void sim_run(const costmodel *cm, const policy_params *pp, const sim_workload *wl,
                    int n_workers, int n_prefill, int tidal, const char *name, sim_result *res)
{
    sim_workload w = *wl; /* a cursor of its own over the same arrivals */
    w.pos = 0;
    double span_s = sim_workload_span_s(wl);
    sim_cluster_params p = sim_cluster_default_params();
    p.policy = *pp;
    p.n_workers = n_workers;
    p.n_prefill = n_prefill;
    p.tidal = tidal;
    p.drain = strcmp(opt_role_change, "drain") == 0;
    p.reserve_dispatch = strcmp(opt_decode_reserve, "dispatch") == 0;
    p.prefill_chunk_tokens = (int)opt_chunk_tokens;
    p.tick_ms = opt_tick_ms;
    p.switch_ms = opt_switch_ms;
    p.ttft_slo_ms = opt_ttft_slo_ms;
    p.tpot_slo_ms = opt_tpot_slo_ms;
    p.hard_end_ms = (1.5 * span_s + 300) * 1e3; /* then unfinished requests count as missed */
    p.seed = (uint64_t)opt_seed;
    p.on_tick = opt_verbose ? print_tick : NULL;
    sim_cluster *c = sim_cluster_new(cm, &p);
    submit_next(c, &w);
    while (sim_cluster_run(c))
        submit_next(c, &w);
    sim_cluster_figures f;
    sim_cluster_figures_get(c, &f);
    sim_cluster_destroy(&c);

    memset(res, 0, sizeof(*res));
    snprintf(res->name, sizeof(res->name), "%s", name);
    res->n_online = f.n_online;
    res->n_good = f.n_good;
    res->n_finished = f.n_finished;
    res->n_offline = f.n_offline;
    res->n_offline_done = f.n_offline_done;
    res->span_s = span_s;
    res->end_s = f.end_ms / 1e3;
    res->goodput = (double)f.n_good / span_s;
    res->attain_pct = f.n_online ? 100.0 * (double)f.n_good / (double)f.n_online : 100;
    res->ttft_mean = f.ttft_mean_ms;
    res->ttft_p99 = f.ttft_p99_ms;
    res->tpot_mean = f.tpot_mean_ms;
    res->tpot_p99 = f.tpot_p99_ms;
    res->offline_rps = res->end_s > 0 ? (double)f.n_offline_done / res->end_s : 0;
    res->offline_tok_s = res->end_s > 0 ? (double)f.offline_tokens / res->end_s : 0;
    res->changes = f.changes;
    res->preemptions = f.preemptions;
    res->final_prefill = f.final_prefill;
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
    sim_workload_kind kind;
    if (opt_trace && *opt_trace) {
        if (sim_workload_load_trace(&wl, opt_trace, costmodel_kv_capacity_tokens(&cm), err,
                                sizeof(err)) < 0) {
            fprintf(stderr, "tidepool-sim: --trace: %s\n", err);
            goto out;
        }
        wl_name = opt_trace;
    } else if (sim_workload_kind_parse(opt_workload, &kind) == 0) {
        const sim_workload_shape *sh = sim_workload_shapes;
        if (rate <= 0) {
            /* --load times the capacity of the heavier phase (phase-shift) or of the mean
             * request (steady workloads), from the cost model */
            double ws;
            if (kind == SIM_WORKLOAD_PHASE_SHIFT)
                ws = fmax(shape_worker_s(&cm, &sh[SIM_WORKLOAD_SHAPE_PREFILL_HEAVY], opt_tpot_slo_ms),
                          shape_worker_s(&cm, &sh[SIM_WORKLOAD_SHAPE_DECODE_HEAVY], opt_tpot_slo_ms));
            else if (kind == SIM_WORKLOAD_MIX)
                ws = (shape_worker_s(&cm, &sh[SIM_WORKLOAD_SHAPE_CONVERSATION], opt_tpot_slo_ms) +
                      shape_worker_s(&cm, &sh[SIM_WORKLOAD_SHAPE_CODE], opt_tpot_slo_ms)) /
                     2;
            else if (kind == SIM_WORKLOAD_SHIFT) {
                /* the heavier of night (15 % code) and working hours (75 %) */
                double wc = shape_worker_s(&cm, &sh[SIM_WORKLOAD_SHAPE_CODE], opt_tpot_slo_ms);
                double wv = shape_worker_s(&cm, &sh[SIM_WORKLOAD_SHAPE_CONVERSATION], opt_tpot_slo_ms);
                ws = fmax(0.15 * wc + 0.85 * wv, 0.75 * wc + 0.25 * wv);
            }
            else
                ws = shape_worker_s(&cm,
                                    &sh[kind == SIM_WORKLOAD_CODE ? SIM_WORKLOAD_SHAPE_CODE
                                                                  : SIM_WORKLOAD_SHAPE_CONVERSATION],
                                    opt_tpot_slo_ms);
            rate = opt_load * n / ws;
            if (opt_offline_frac < 1)
                rate /= 1 - opt_offline_frac;
        }
        if (kind == SIM_WORKLOAD_PHASE_SHIFT)
            sim_workload_phase_shift(&wl, rate, opt_duration_s, opt_phase_s, opt_offline_frac,
                                     (uint64_t)opt_seed);
        else
            sim_workload_steady(&wl, kind, rate, opt_duration_s, opt_offline_frac,
                                (uint64_t)opt_seed);
        wl_name = opt_workload;
    } else {
        fprintf(stderr, "tidepool-sim: --workload: want phase-shift, conversation, code, mix or "
                        "shift (or give --trace)\n");
        goto out;
    }

    double mean_prompt, mean_ctx;
    sim_workload_shape_stats(&wl, &mean_prompt, &mean_ctx);
    policy_params pp = policy_default_params();
    pp.ttft_slo_ms = opt_ttft_slo_ms;
    pp.tpot_slo_ms = opt_tpot_slo_ms;
    pp.prefill_tokens_per_s = costmodel_prefill_tokens_per_s(&cm, mean_prompt);
    pp.decode_seqs_per_worker = costmodel_decode_batch_within(&cm, 0.8 * opt_tpot_slo_ms, mean_ctx);
    pp.decode_tokens_per_s =
        pp.decode_seqs_per_worker /
        (costmodel_decode_step_ms(&cm, pp.decode_seqs_per_worker,
                                  pp.decode_seqs_per_worker * mean_ctx) /
         1e3);
    pp.start_from_estimate = opt_start_estimate;
    pp.warmup_ms = (int64_t)(opt_warmup_s * 1e3);
    pp.target_pressure = opt_target_pressure;
    pp.capacity_moves = opt_capacity_moves;
    pp.donor_guard = opt_donor_guard;
    pp.startup_fix = opt_startup_fix;
    pp.startup_settle = opt_startup_settle;
    if (!opt_decode_token_rate)
        pp.decode_tokens_per_s = 0;
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
    else if (wl.kind == SIM_WORKLOAD_PHASE_SHIFT)
        printf("workload: phase-shift, %d workers, %.2f req/s (%.0f%% offline), %.0f s, "
               "phases of %.0f s, seed %lld\n",
               n, rate, 100 * opt_offline_frac, opt_duration_s, opt_phase_s, opt_seed);
    else
        printf("workload: %s (%s), %d workers, %.2f req/s (%.0f%% offline), %.0f s, seed "
               "%lld\n",
               wl_name, wl.kind == SIM_WORKLOAD_SHIFT ? "a day of the run's length" : "steady",
               n, rate, 100 * opt_offline_frac, opt_duration_s, opt_seed);
    printf("SLO: TTFT <= %.0f ms, TPOT <= %.0f ms; capacity estimates per worker: prefill "
           "%.0f tok/s, decode %.0f seqs, %.0f tok/s; KV %.0f tokens/worker\n",
           opt_ttft_slo_ms, opt_tpot_slo_ms, pp.prefill_tokens_per_s, pp.decode_seqs_per_worker,
           pp.decode_tokens_per_s,
           costmodel_kv_capacity_tokens(&cm));
    printf("engine: max-seqs %d, max-batch-tokens %d, prefill-chunk-tokens %lld; a decode worker "
           "leaving decode: %s; decode room reserved at %s; policy tick %.0f ms\n",
           cm.max_seqs, cm.prefill_token_budget, opt_chunk_tokens, opt_role_change,
           opt_decode_reserve, opt_tick_ms);

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
