/*
 * The simulated cluster of tidepool-sim (tools/sim/sim_cluster.h): runs of decode steps
 * against one event per step, bit for bit; small runs on the a100 preset whose figures are
 * pinned exactly (a change that is meant to be a pure speed-up must leave them alone); and
 * a toy cost model whose times are worked by hand: one request's prefill, KV transfer and
 * decode steps, the prefill token budget batching the queue, and decode placement (most
 * free KV, a sequence that fits nowhere waits and is pulled by the worker that frees room).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "costmodel.h"
#include "policy.h"
#include "sim_cluster.h"
#include "sim_workload.h"

static void assert_close(double got, double want, double rel)
{
    if (!(fabs(got - want) <= rel * fmax(fabs(want), 1e-300)))
        fail_msg("got %.17g, want %.17g (rel %.1e)", got, want, rel);
}

/* A toy accelerator with round figures (costmodel.h's formulas):
 *   weights 5e8 params * 2 B = 1e9 B; KV 2 * 2 layers * 1 KV head * 125 * 1 B = 500 B/token;
 *   KV capacity (1.0005e9 - 1e9) / 500 = 1000 tokens; attention 4 * 2 * 1 * 125 = 1000
 *   FLOPs per (query, key) pair.
 *   prefill_ms(n, pairs) = max((1e9 n + 1000 pairs) / 1e12 s, 1e9 B / 5e11 B/s = 2 ms) + 5
 *                        = n + 1e-6 pairs + 5                    (n >= 2 tokens)
 *   step_ms(b, ctx)      = max(2 + 1e-6 ctx, b + 1e-6 ctx) + 3 = 5 + 1e-6 ctx   (b <= 2)
 *   transfer_ms(n)       = 0.5 + 1e3 * 500 n / 1e9 = 0.5 + 5e-4 n
 * 150 prompt tokens per prefill batch, 4 sequences per decode worker. */
static costmodel toy_costmodel(void)
{
    costmodel cm = {
        .name = "toy",
        .time_scale = 1,
        .peak_flops = 1e12,
        .hbm_bytes_per_s = 5e11,
        .hbm_bytes = 1.0005e9,
        .mfu_prefill = 1,
        .mfu_decode = 1,
        .mbu = 1,
        .mem_util = 1,
        .activation_bytes = 0,
        .prefill_overhead_ms = 5,
        .step_overhead_ms = 3,
        .link_bytes_per_s = 1e9,
        .link_latency_ms = 0.5,
        .n_params = 5e8,
        .bytes_per_param = 2,
        .n_layer = 2,
        .d_model = 250,
        .n_head = 1,
        .n_kv_head = 1,
        .head_dim = 125,
        .kv_bytes_per_elem = 1,
        .prefill_token_budget = 150,
        .max_seqs = 4,
    };
    char err[128];
    assert_int_equal(costmodel_check(&cm, err, sizeof(err)), 0);
    assert_true(costmodel_kv_capacity_tokens(&cm) == 1000);
    return cm;
}

/* A static split (no role change) of n workers, the first n_prefill prefill; tick 100 ms;
 * prompts in chunks of at most chunk tokens (0: only the batch budget). */
static sim_cluster *toy_cluster_chunked(const costmodel *cm, int n, int n_prefill,
                                        double tpot_slo_ms, int chunk)
{
    sim_cluster_params p = sim_cluster_default_params();
    p.prefill_chunk_tokens = chunk;
    char err[128];
    assert_int_equal(policy_params_check(&p.policy, err, sizeof(err)), 0);
    p.n_workers = n;
    p.n_prefill = n_prefill;
    p.tidal = 0;
    p.tick_ms = 100;
    p.tpot_slo_ms = tpot_slo_ms;
    return sim_cluster_new(cm, &p);
}

/* The same with the default chunk limit (512 tokens: more than the toy's budget). */
static sim_cluster *toy_cluster(const costmodel *cm, int n, int n_prefill, double tpot_slo_ms)
{
    return toy_cluster_chunked(cm, n, n_prefill, tpot_slo_ms, 512);
}

/* Submit an online request and run until it has arrived (the clock is at its time). */
static void toy_arrive(sim_cluster *c, double t_ms, int prompt, int out)
{
    sim_workload_arrival a = {.arrival_s = t_ms / 1e3, .prompt = prompt, .out = out};
    sim_cluster_submit(c, &a);
    assert_int_equal(sim_cluster_run(c), 1);
    assert_true(sim_cluster_now_ms(c) == t_ms);
}

static sim_cluster_worker_info toy_worker(const sim_cluster *c, int w)
{
    sim_cluster_worker_info x;
    assert_int_equal(sim_cluster_worker_get(c, w, &x), 0);
    return x;
}

/* Runs of decode steps (one event up to the next finish, cut by joins, preemptions and
 * role changes) give the same figures, bit for bit, as one event per step: tidal with
 * migration and with draining, offline preemption, reservation at dispatch, a static split;
 * a phase-shifting workload at 70% and 130% of capacity on the a100 preset. */
static void test_cluster_step_runs_exact(void **state)
{
    (void)state;
    costmodel cm;
    assert_int_equal(costmodel_preset("a100-llama3-8b", &cm), 0);
    struct {
        int n, tidal, drain, dispatch;
        double rate;
    } cases[] = {
        {16, 1, 0, 0, 60}, {16, 1, 1, 0, 60}, {16, 1, 0, 1, 110}, {12, 0, 0, 0, 90},
        {24, 1, 0, 0, 160}, {16, 1, 0, 0, 250}, {8, 1, 0, 1, 150}, {8, 1, 0, 0, 400},
    };
    int64_t preempted = 0;
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        sim_cluster_figures f[2];
        int64_t steps[2] = {0, 0};
        for (int single = 0; single < 2; single++) {
            sim_workload wl;
            sim_workload_phase_shift(&wl, cases[k].rate, 120, 30, 0.2, 7 + k);
            sim_cluster_params p = sim_cluster_default_params();
            p.n_workers = cases[k].n;
            p.n_prefill = cases[k].n / 2;
            p.tidal = cases[k].tidal;
            p.drain = cases[k].drain;
            p.reserve_dispatch = cases[k].dispatch;
            p.policy.min_role_ms = 5000;
            p.hard_end_ms = 400e3;
            p.single_steps = single;
            sim_cluster *c = sim_cluster_new(&cm, &p);
            sim_workload_arrival a;
            if (sim_workload_next(&wl, &a))
                sim_cluster_submit(c, &a);
            while (sim_cluster_run(c)) {
                if (sim_workload_next(&wl, &a))
                    sim_cluster_submit(c, &a);
                else
                    sim_cluster_arrivals_done(c);
            }
            sim_cluster_figures_get(c, &f[single]);
            for (int w = 0; w < p.n_workers; w++) {
                sim_cluster_worker_info x;
                assert_int_equal(sim_cluster_worker_get(c, w, &x), 0);
                steps[single] += x.steps;
            }
            sim_cluster_destroy(&c);
            sim_workload_free(&wl);
        }
        assert_true(f[0].n_finished > 1000);
        assert_int_equal(f[0].n_finished, f[1].n_finished);
        assert_int_equal(f[0].n_good, f[1].n_good);
        assert_int_equal(f[0].n_offline_done, f[1].n_offline_done);
        assert_int_equal(f[0].offline_tokens, f[1].offline_tokens);
        assert_int_equal(f[0].changes, f[1].changes);
        assert_int_equal(f[0].preemptions, f[1].preemptions);
        assert_int_equal(f[0].final_prefill, f[1].final_prefill);
        assert_true(f[0].end_ms == f[1].end_ms);
        assert_true(f[0].ttft_mean_ms == f[1].ttft_mean_ms);
        assert_true(f[0].ttft_p99_ms == f[1].ttft_p99_ms);
        assert_true(f[0].tpot_mean_ms == f[1].tpot_mean_ms);
        assert_true(f[0].tpot_p99_ms == f[1].tpot_p99_ms);
        assert_int_equal(steps[0], steps[1]);
        if (cases[k].tidal)
            assert_true(f[0].changes > 0);
        preempted += f[0].preemptions;
    }
    assert_true(preempted > 0); /* the preemption cut is exercised */
}

/* Run a phase-shift workload (rate req/s for 120 s, phases of 30 s, no offline work, seed 3)
 * on the a100 preset with parameters p; the figures and the decode steps of every worker
 * into *f and *steps. */
static void run_pinned(const sim_cluster_params *p, double rate, sim_cluster_figures *f,
                       int64_t *steps)
{
    costmodel cm;
    assert_int_equal(costmodel_preset("a100-llama3-8b", &cm), 0);
    sim_workload wl;
    sim_workload_phase_shift(&wl, rate, 120, 30, 0, 3);
    sim_cluster *c = sim_cluster_new(&cm, p);
    sim_workload_arrival a;
    if (sim_workload_next(&wl, &a))
        sim_cluster_submit(c, &a);
    while (sim_cluster_run(c)) {
        if (sim_workload_next(&wl, &a))
            sim_cluster_submit(c, &a);
        else
            sim_cluster_arrivals_done(c);
    }
    sim_cluster_figures_get(c, f);
    *steps = 0;
    for (int w = 0; w < p->n_workers; w++) {
        sim_cluster_worker_info x;
        assert_int_equal(sim_cluster_worker_get(c, w, &x), 0);
        *steps += x.steps;
    }
    sim_cluster_destroy(&c);
    sim_workload_free(&wl);
}

/* Static splits of 16 workers (no role change, no offline work: nothing here depends on
 * the policy's decisions), decode room reserved when prefill ends and at dispatch, near
 * capacity: their figures, exactly. A change to the model changes them (update the table,
 * saying why); a change meant as a pure speed-up must not. */
static void test_cluster_pinned_runs(void **state)
{
    (void)state;
    static const struct {
        int n_prefill, dispatch;
        double rate;
        int64_t n_online, n_finished, n_good, steps;
        double end_ms, ttft_mean, ttft_p99, tpot_mean, tpot_p99;
    } want[] = {
        /* chunked prefill (chunks of 512 tokens) since they were first pinned: SLO met
         * 8266, 8266, 7872 times, TTFT mean 579.4, 579.4, 107.4 ms before it */
        {8, 0, 75, 8985, 8985, 7734, 69734, 149000, 768.15636175618499, 3170.915393002479,
         18.567497642834628, 26.422953015032384},
        {8, 1, 75, 8985, 8985, 7734, 69665, 149000, 768.15636175618567, 3170.915393002479,
         18.573000273399085, 26.468910528387759},
        {10, 0, 75, 8985, 8985, 7875, 46309, 160000, 132.16813154282238, 712.44918800112691,
         44.986940558755485, 367.23585837432705},
    };
    int bad = 0;
    for (size_t k = 0; k < sizeof(want) / sizeof(want[0]); k++) {
        sim_cluster_params p = sim_cluster_default_params();
        p.n_workers = 16;
        p.n_prefill = want[k].n_prefill;
        p.tidal = 0;
        p.reserve_dispatch = want[k].dispatch;
        p.hard_end_ms = 400e3;
        sim_cluster_figures f;
        int64_t steps;
        run_pinned(&p, want[k].rate, &f, &steps);
        if (f.n_online != want[k].n_online || f.n_finished != want[k].n_finished ||
            f.n_good != want[k].n_good || steps != want[k].steps || f.end_ms != want[k].end_ms ||
            f.ttft_mean_ms != want[k].ttft_mean || f.ttft_p99_ms != want[k].ttft_p99 ||
            f.tpot_mean_ms != want[k].tpot_mean || f.tpot_p99_ms != want[k].tpot_p99) {
            print_message("case %zu: got {%d, %d, %.17g, %lld, %lld, %lld, %lld, %.17g, %.17g, "
                          "%.17g, %.17g, %.17g},\n",
                          k, want[k].n_prefill, want[k].dispatch, want[k].rate,
                          (long long)f.n_online, (long long)f.n_finished, (long long)f.n_good,
                          (long long)steps, f.end_ms, f.ttft_mean_ms, f.ttft_p99_ms,
                          f.tpot_mean_ms, f.tpot_p99_ms);
            bad++;
        }
        assert_int_equal(f.changes, 0);
        assert_int_equal(f.final_prefill, want[k].n_prefill);
    }
    assert_int_equal(bad, 0);
}

/* One request, prompt 100, output 11, on one prefill and one decode worker:
 *   prefill [0, 100 + 1e-6 * 5050 + 5 = 105.00505]: TTFT 105.00505 ms;
 *   KV of 101 tokens (the first output token's included): transfer 0.5 + 5e-4 * 101 =
 *   0.5505 ms, arriving layer by layer at max(105.00505 + 0.5505 / 2, 0 + 0.5505) =
 *   105.2803;
 *   10 decode steps over contexts 101..110: 10 * 5 + 1e-6 * 1055 = 50.001055 ms, done at
 *   155.281355; TPOT (155.281355 - 105.00505) / 10 = 5.0276305 ms;
 *   the run stops at the first tick after it, 200 ms.
 * In chunks of 60 tokens: [0, 60 + 1e-6 * 1830 + 5 = 65.00183], then 40 after 60 (pairs
 * 820 + 2400) to 65.00183 + 45.00322 = 110.00505 (one more batch overhead): TTFT
 * 110.00505, the KV (its transfer began with the first chunk, at 0) at max(110.00505 +
 * 0.27525, 0.5505) = 110.2803, done at 160.281355, the same TPOT. */
static void test_cluster_one_request(void **state)
{
    (void)state;
    const costmodel cm = toy_costmodel();
    for (int strict = 0; strict < 3; strict++) {
        /* TPOT 5.0276305 meets a 50 ms SLO, not a 5.02 ms one; 2: chunks of 60 */
        sim_cluster *c = strict < 2 ? toy_cluster(&cm, 2, 1, strict ? 5.02 : 50)
                                    : toy_cluster_chunked(&cm, 2, 1, 50, 60);
        double ttft = strict < 2 ? 105.00505 : 110.00505;
        toy_arrive(c, 0, 100, 11);
        sim_cluster_worker_info p = toy_worker(c, 0), d = toy_worker(c, 1);
        assert_int_equal(p.role, POLICY_ROLE_PREFILL);
        assert_true(p.busy && p.batch == 1);
        assert_int_equal(d.role, POLICY_ROLE_DECODE);
        assert_true(d.kv_reserved == 0 && d.assigned == 0);
        sim_cluster_arrivals_done(c);
        assert_int_equal(sim_cluster_run(c), 0);
        assert_int_equal(sim_cluster_run(c), 0); /* over stays over */
        sim_cluster_figures f;
        sim_cluster_figures_get(c, &f);
        assert_int_equal(f.n_online, 1);
        assert_int_equal(f.n_finished, 1);
        assert_int_equal(f.n_good, strict == 1 ? 0 : 1);
        assert_int_equal(f.n_offline, 0);
        assert_int_equal(f.changes, 0);
        assert_int_equal(f.final_prefill, 1);
        assert_close(f.ttft_mean_ms, ttft, 1e-12);
        assert_close(f.ttft_p99_ms, ttft, 1e-12);
        assert_close(f.tpot_mean_ms, 5.0276305, 1e-12);
        assert_close(f.tpot_p99_ms, 5.0276305, 1e-12);
        assert_true(f.end_ms == 200);
        d = toy_worker(c, 1);
        assert_true(d.steps == 10 && d.kv_reserved == 0 && d.assigned == 0 && d.running == 0);
        sim_cluster_worker_info none;
        assert_int_equal(sim_cluster_worker_get(c, 2, &none), -1);
        assert_int_equal(sim_cluster_worker_get(c, -1, &none), -1);
        sim_cluster_destroy(&c);
        assert_null(c);
        sim_cluster_destroy(&c); /* takes NULL */
    }
}

/* The prefill budget (150 tokens), chunked as tidepool's prefill worker does: an idle
 * worker starts at once; prompts queued while it is busy fill the next batch up to the
 * budget, the last one's chunk cut to fit, and a prompt's later chunks go first in the
 * batches after (a chunk of n tokens after d attends to n (n + 1) / 2 + d n pairs). Output
 * 1 token, so every request ends with its prefill (TPOT 0).
 *   R1 100 at 0:      batch [0, 105.00505]                                TTFT 105.00505
 *   R2 40 at 10, R3 100 at 20, R4 100 at 30: R2, R3 and R4's first 10 tokens, pairs
 *                     820 + 5050 + 55: 150 + 0.005925 + 5, ends 260.010975
 *                                                  TTFT R2 250.010975, R3 240.010975
 *   R5 200 at 40:     R4's last 90 (pairs 4095 + 900) and R5's first 60 (1830):
 *                     150 + 0.006825 + 5, ends 415.0178               TTFT R4 385.0178
 *                     R5's last 140 (pairs 9870 + 8400): 140 + 0.01827 + 5,
 *                     ends 560.03607                                  TTFT R5 520.03607
 * mean 1500.08087 / 5 = 300.016174; p99 at rank 3.96: 385.0178 + 0.96 * 135.01827 =
 * 514.6353392; the run stops at the tick of 600 ms. (Before prompts were chunked, a prompt
 * that did not fit waited for the next batch and one over the budget ran alone: mean
 * 284.015786.) */
static void test_cluster_prefill_batches(void **state)
{
    (void)state;
    const costmodel cm = toy_costmodel();
    sim_cluster *c = toy_cluster(&cm, 2, 1, 50);
    const int prompt[] = {100, 40, 100, 100, 200};
    for (int i = 0; i < 5; i++) {
        toy_arrive(c, 10.0 * i, prompt[i], 1);
        sim_cluster_worker_info p = toy_worker(c, 0);
        assert_true(p.busy && p.batch == 1); /* R1's, all along */
    }
    sim_cluster_arrivals_done(c);
    assert_int_equal(sim_cluster_run(c), 0);
    sim_cluster_figures f;
    sim_cluster_figures_get(c, &f);
    assert_int_equal(f.n_finished, 5);
    assert_int_equal(f.n_good, 5);
    assert_close(f.ttft_mean_ms, 300.016174, 1e-12);
    assert_close(f.ttft_p99_ms, 514.6353392, 1e-12);
    assert_true(f.tpot_mean_ms == 0 && f.tpot_p99_ms == 0);
    assert_true(f.end_ms == 600);
    sim_cluster_worker_info d = toy_worker(c, 1);
    assert_true(d.steps == 0); /* nothing was decoded */
    sim_cluster_destroy(&c);
}

/* Decode placement over two decode workers (1 and 2, KV 1000 tokens each), each request's
 * KV reserved for prompt + output when its prefill ends (prefill 105.00505 ms for 100
 * tokens); looked at when the next request arrives:
 *   A 100+500 = 600 at 0:    both free 1000, the first listed wins: w1 = 600
 *   B 100+200 = 300 at 200:  w2 (free 1000 against 400):            w2 = 300
 *   C 100+400 = 500 at 400:  does not fit w1 (400 free), w2 has 700: w2 = 800
 *   D 100+350 = 450 at 600:  fits nowhere (400, 200 free): waits
 *   at 800: still waiting (B's 199 steps of ~5.0003 ms from 305.28 end near 1300.4)
 *   at 1500: B finished on w2, freeing 300: D pulled there:        w2 = 500 + 450 = 950
 * (A ends near 2600 and C near 2500: both still running at 1500.) */
static void test_cluster_decode_placement(void **state)
{
    (void)state;
    const costmodel cm = toy_costmodel();
    sim_cluster *c = toy_cluster(&cm, 3, 1, 50);
    static const struct {
        double t_ms;
        int prompt, out;
        int64_t kv1, kv2; /* KV reserved on workers 1 and 2 once it has arrived */
        int assigned1, assigned2;
    } steps[] = {
        {0, 100, 500, 0, 0, 0, 0},       /* A */
        {200, 100, 200, 600, 0, 1, 0},   /* B */
        {400, 100, 400, 600, 300, 1, 1}, /* C */
        {600, 100, 350, 600, 800, 1, 2}, /* D */
        {800, 10, 1, 600, 800, 1, 2},    /* (D waits) */
        {1500, 10, 1, 600, 950, 1, 2},   /* (D on w2, B gone) */
    };
    for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++) {
        toy_arrive(c, steps[i].t_ms, steps[i].prompt, steps[i].out);
        sim_cluster_worker_info w1 = toy_worker(c, 1), w2 = toy_worker(c, 2);
        if (w1.kv_reserved != steps[i].kv1 || w2.kv_reserved != steps[i].kv2 ||
            w1.assigned != steps[i].assigned1 || w2.assigned != steps[i].assigned2)
            fail_msg("at %.0f ms: w1 %lld tokens / %d seqs, w2 %lld / %d; want %lld / %d, "
                     "%lld / %d",
                     steps[i].t_ms, (long long)w1.kv_reserved, w1.assigned,
                     (long long)w2.kv_reserved, w2.assigned, (long long)steps[i].kv1,
                     steps[i].assigned1, (long long)steps[i].kv2, steps[i].assigned2);
    }
    sim_cluster_arrivals_done(c);
    assert_int_equal(sim_cluster_run(c), 0);
    sim_cluster_figures f;
    sim_cluster_figures_get(c, &f);
    assert_int_equal(f.n_online, 6);
    assert_int_equal(f.n_finished, 6);
    for (int w = 1; w <= 2; w++) {
        sim_cluster_worker_info x = toy_worker(c, w);
        assert_true(x.kv_reserved == 0 && x.assigned == 0 && x.running == 0);
    }
    sim_cluster_destroy(&c);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cluster_step_runs_exact),
        cmocka_unit_test(test_cluster_pinned_runs),
        cmocka_unit_test(test_cluster_one_request),
        cmocka_unit_test(test_cluster_prefill_batches),
        cmocka_unit_test(test_cluster_decode_placement),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("sim_cluster", tests, NULL, NULL);
}
