/*
 * test_cluster_tidal: what the gateway feeds the tidal policy (gateway/cluster_tidal.c,
 * docs/scheduler.md "How the gateway feeds the policy"). The online request counters the
 * decode token term and the capacity moves' standard error need (online_arrived,
 * online_done, output_tokens_done) are counted where a request is admitted and where it
 * finishes, online requests only, and reach policy_decide on every tick, as tidepool-sim
 * feeds them: before, the gateway left them 0, so its policy never saw an arrival rate.
 * And the workers one policy call moves leave routing together: no sequence migrates from
 * one of them to another.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "cluster_internal.h"
#include "policy.h"

static int n_finished;

static void on_finish(void *ud, int reason)
{
    (void)ud;
    (void)reason;
    n_finished++;
}

static const cluster_callbacks CB = {.on_finish = on_finish};

static cluster_t *new_cluster(void)
{
    cluster_t *c = calloc(1, sizeof(*c));
    assert_non_null(c);
    c->p.policy = policy_default_params();
    c->p.tidal = 1;
    policy_state_init(&c->pstate);
    return c;
}

/* An online (or offline) request that ran and generated n_gen tokens, on the active list. */
static req_t *running_req(cluster_t *c, uint64_t rid, int offline, int n_gen)
{
    req_t *r = calloc(1, sizeof(*r));
    assert_non_null(r);
    r->rid = rid;
    r->offline = offline;
    r->n_prompt = 100;
    r->n_gen = n_gen;
    r->max_tokens = n_gen;
    r->cb = &CB;
    list_push(&c->active, r, 0);
    if (offline)
        c->n_off_running++;
    return r;
}

/* Finishing counts online requests and their tokens; offline ones are not counted. */
static void test_finish_counts_online_output(void **state)
{
    (void)state;
    cluster_t *c = new_cluster();
    n_finished = 0;
    cluster_req_end_finish(c, running_req(c, 1, 0, 7), PROTO_FINISH_LENGTH, 0);
    cluster_req_end_finish(c, running_req(c, 2, 1, 50), PROTO_FINISH_LENGTH, 0);
    cluster_req_end_finish(c, running_req(c, 3, 0, 13), PROTO_FINISH_STOP, 0);
    assert_int_equal(n_finished, 3);
    assert_int_equal(c->online_done, 2);
    assert_int_equal(c->online_output_tokens, 20);
    assert_int_equal(c->n_off_running, 0);
    assert_null(c->active.head);
    free(c);
}

/* Each tick hands the counters to the policy: its state follows them (the rates it
 * derives are differences of these between calls). */
static void test_tick_feeds_the_counters(void **state)
{
    (void)state;
    cluster_t *c = new_cluster();
    c->online_prompt_tokens = 4000;
    c->online_arrived = 31;
    c->online_done = 12;
    c->online_output_tokens = 240;
    cluster_policy_tick(c, 1000000);
    assert_int_equal(c->pstate.n_calls, 1);
    assert_int_equal(c->pstate.last_prompt_tokens, 4000);
    assert_int_equal(c->pstate.first_arrived, 31);
    assert_int_equal(c->pstate.last_arrived, 31);
    assert_int_equal(c->pstate.last_done, 12);
    assert_int_equal(c->pstate.last_output_tokens, 240);
    /* one second later: 31 more requests, 10 more ended with 200 tokens */
    c->online_prompt_tokens = 8000;
    c->online_arrived = 62;
    c->online_done = 22;
    c->online_output_tokens = 440;
    cluster_policy_tick(c, 2000000);
    assert_int_equal(c->pstate.n_calls, 2);
    assert_int_equal(c->pstate.last_arrived, 62);
    assert_int_equal(c->pstate.last_done, 22);
    assert_int_equal(c->pstate.last_output_tokens, 440);
    /* the first rate sample seeds the rate (running mean): 31 req/s, 4000 tok/s */
    assert_true(c->pstate.sig.arrival_rate > 30.999 && c->pstate.sig.arrival_rate < 31.001);
    assert_true(c->pstate.sig.prompt_rate > 3999.9 && c->pstate.sig.prompt_rate < 4000.1);
    assert_true(c->pstate.sig.out_per_req > 19.999 && c->pstate.sig.out_per_req < 20.001);
    free(c->pworkers);
    free(c);
}

/* Decode room held from dispatch: every assigned online request and every request waiting
 * at the gateway (a prefill worker is up) counts as decoding, and of them the gateway names
 * the prompts not yet prefilled (no first token from the prefill worker) and the waiting
 * ones: 3 of 4 assigned still prefilling, 1 decoding, 2 waiting (policy.h 1d). */
static void test_tick_names_prefilling_and_waiting(void **state)
{
    (void)state;
    cluster_t *c = new_cluster();
    worker_t *wp = calloc(1, sizeof(*wp)), *wd = calloc(1, sizeof(*wd));
    assert_non_null(wp);
    assert_non_null(wd);
    wp->role = PROTO_ROLE_PREFILL;
    wp->state = wd->state = PROTO_STATE_READY;
    wd->role = PROTO_ROLE_DECODE;
    wd->max_seqs = 48;
    wp->next = wd;
    c->workers = wp;
    req_t *rs[6];
    for (int i = 0; i < 4; i++) {
        rs[i] = running_req(c, (uint64_t)(10 + i), 0, 0);
        rs[i]->pw = wp;
        rs[i]->dw = wd;
        rs[i]->p_started = i == 3;
    }
    for (int i = 4; i < 6; i++) {
        rs[i] = calloc(1, sizeof(*rs[i]));
        assert_non_null(rs[i]);
        list_push(&c->queue, rs[i], 0);
    }
    cluster_policy_tick(c, 1000000); /* the first call seeds the signals with this call's */
    assert_true(c->pstate.sig.decoding == 6);
    assert_true(c->pstate.sig.prefilling == 3);
    assert_true(c->pstate.sig.wait_room == 2);
    for (int i = 0; i < 6; i++)
        free(rs[i]);
    free(wp);
    free(wd);
    free(c->pworkers);
    free(c);
}

/* One policy call moving two decode workers to prefill (4:4, a flooded prefill queue, the
 * rate cap's 2): w4 and w5, the two cheapest (fewest running), go in one call. w5 has the
 * most free KV of the other decode workers, so w4's sequences would migrate there if w5
 * were still routable when w4 is ordered; they would then be on their way to a worker that
 * switches to prefill (the gateway re-runs such a sequence from its prompt: docs/tidal.md
 * "Session 12", 8 re-runs at code100's start-up). Every worker of the call is marked
 * first: each sequence of w4 and w5 migrates to w6 or w7. (ROLE and MIGRATE go to a ROUTER
 * with no peers: dropped, as the test only reads the gateway's bookkeeping.) */
static void test_one_call_moves_leave_together(void **state)
{
    (void)state;
    cluster_t *c = new_cluster();
    c->p.heartbeat_ms = 200;
    c->p.dead_after_ms = 10000;
    c->zctx = zmq_ctx_new();
    assert_non_null(c->zctx);
    c->sock = zmq_socket(c->zctx, ZMQ_ROUTER);
    assert_non_null(c->sock);
    assert_int_equal(zmq_bind(c->sock, "inproc://test-one-call"), 0);
    worker_t *w[8];
    int64_t now = proto_now_us();
    static const int kv_free[8] = {0, 0, 0, 0, 300, 1000, 500, 400};
    static const int running[8] = {0, 0, 0, 0, 1, 2, 10, 10};
    for (int i = 7; i >= 0; i--) { /* the list in index order: w0 first */
        w[i] = calloc(1, sizeof(*w[i]));
        assert_non_null(w[i]);
        snprintf(w[i]->id, sizeof(w[i]->id), "w%d", i);
        w[i]->id_len = strlen(w[i]->id);
        w[i]->role = i < 4 ? PROTO_ROLE_PREFILL : PROTO_ROLE_DECODE;
        w[i]->state = PROTO_STATE_READY;
        w[i]->last_seen_us = now;
        w[i]->role_since_us = now - 3600 * (int64_t)1000000;
        snprintf(w[i]->kvep, sizeof(w[i]->kvep), "tcp://127.0.0.1:%d", 9000 + i);
        w[i]->max_seqs = 48;
        w[i]->kv_total = 1000;
        w[i]->kv_free = i < 4 ? 1000 : kv_free[i];
        w[i]->running = running[i];
        w[i]->qtok = i < 4 ? 1000000 : 0; /* prefill's queue: far beyond its TTFT budget */
        w[i]->next = i < 7 ? w[i + 1] : NULL;
    }
    c->workers = w[0];
    req_t *rs[4];
    for (int i = 0; i < 4; i++) { /* two sequences decoding on each of w4 and w5 */
        rs[i] = running_req(c, (uint64_t)(20 + i), 0, 1);
        rs[i]->pw = w[0];
        rs[i]->dw = w[4 + i / 2];
        rs[i]->p_started = rs[i]->d_started = 1;
        rs[i]->dw->n_decode++;
        rs[i]->dw->n_assigned++;
    }
    cluster_policy_tick(c, now); /* seeds */
    assert_int_equal(c->pstate.n_changes, 0);
    cluster_policy_tick(c, now + 200000);
    assert_int_equal(c->pstate.n_changes, 2);
    assert_true(w[4]->changing && w[4]->target_role == PROTO_ROLE_PREFILL);
    assert_true(w[5]->changing && w[5]->target_role == PROTO_ROLE_PREFILL);
    assert_false(w[6]->changing || w[7]->changing);
    for (int i = 0; i < 4; i++) {
        if (rs[i]->dw != w[6] && rs[i]->dw != w[7])
            fail_msg("sequence %d of w%d migrates to %s, which leaves decode in the same call", i,
                     4 + i / 2, rs[i]->dw ? rs[i]->dw->id : "(none)");
        assert_ptr_equal(rs[i]->mw, w[4 + i / 2]);
    }
    for (int i = 0; i < 4; i++) {
        list_remove(&c->active, rs[i]);
        free(rs[i]);
    }
    for (int i = 0; i < 8; i++)
        free(w[i]);
    zmq_close(c->sock);
    zmq_ctx_term(c->zctx);
    free(c->pworkers);
    free(c);
}

/* The policy's role age: a worker never ordered to another role is settled (movable at
 * once, whatever min_role_ms), one that changed role counts from its new registration. A
 * cluster whose traffic began within min_role_ms of its workers' registration could not
 * move at all before (code100's emulated start-up, docs/tidal.md "Session 12"). */
static void test_role_age_of_fresh_and_moved_workers(void **state)
{
    (void)state;
    cluster_t *c = new_cluster();
    worker_t *fresh = calloc(1, sizeof(*fresh)), *moved = calloc(1, sizeof(*moved));
    assert_non_null(fresh);
    assert_non_null(moved);
    int64_t now = 100 * (int64_t)1000000;
    fresh->role = PROTO_ROLE_DECODE;
    moved->role = PROTO_ROLE_PREFILL;
    fresh->state = moved->state = PROTO_STATE_READY;
    fresh->role_since_us = now - 1000000; /* registered 1 s ago */
    moved->role_since_us = now - 2000000; /* its change ended 2 s ago */
    moved->assigned_role = PROTO_ROLE_PREFILL;
    fresh->next = moved;
    c->workers = fresh;
    cluster_policy_tick(c, now);
    assert_true(c->pworkers[0].role_age_ms >= 1000LL * 1000000); /* settled */
    assert_true(c->pworkers[0].role_age_ms >= c->p.policy.min_role_ms);
    assert_int_equal(c->pworkers[1].role_age_ms, 2000);
    free(fresh);
    free(moved);
    free(c->pworkers);
    free(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_finish_counts_online_output),
        cmocka_unit_test(test_tick_feeds_the_counters),
        cmocka_unit_test(test_tick_names_prefilling_and_waiting),
        cmocka_unit_test(test_one_call_moves_leave_together),
        cmocka_unit_test(test_role_age_of_fresh_and_moved_workers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
