/* cluster_tidal: the offline tier's aging and the tidal policy (policy.h), both run from
 * the sweep timer: offline requests that waited too long are promoted to the online
 * queue, and every heartbeat_ms the policy gets the workers' and the queues' figures and
 * sets the offline admission, preempts offline requests and (--tidal) changes roles. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cluster_internal.h"
#include "log.h"
#include "protocol.h"

// --- offline tier: aging and the tidal policy

/* Aging: promote offline requests that waited policy.offline_max_wait_ms to the online
 * queue, at most offline_aging_per_worker per decode-capable worker at a time (and at
 * least one), so offline work is never starved forever whatever the online load. */
void cluster_promote_aged(cluster_t *c, int64_t now)
{
    int n_dec = 0;
    for (const worker_t *w = c->workers; w; w = w->next)
        n_dec += usable(w) && (w->role == PROTO_ROLE_DECODE || w->role == PROTO_ROLE_MIXED);
    int cap = c->p.policy.offline_aging_per_worker * n_dec;
    if (cap < 1)
        cap = 1;
    int64_t wait_us = c->p.policy.offline_max_wait_ms * 1000;
    while (c->oqueue.head && c->n_promoted < cap && now - c->oqueue.head->enq_us >= wait_us) {
        req_t *r = c->oqueue.head;
        list_remove(&c->oqueue, r);
        r->promoted = 1;
        c->n_promoted++;
        r->since_us = now;
        list_push(&c->queue, r, 0);
        log_rinfo(r->rid, "offline request waited %lld ms: promoted to the online queue",
                  (long long)(now - r->enq_us) / 1000);
        schedule_dispatch(c);
    }
}

/* One policy call on the figures the gateway has; applies the offline admission and
 * preemption, and with --tidal its role changes (through cluster_role_order()). */
void cluster_policy_tick(cluster_t *c, int64_t now)
{
    int n = 0, have_prefill = 0, n_dec = 0;
    long seqs = 0;
    for (const worker_t *w = c->workers; w; w = w->next)
        n++;
    if (n > c->pworkers_cap) {
        policy_worker *v = realloc(c->pworkers, (size_t)n * sizeof(*v));
        if (!v)
            return;
        c->pworkers = v;
        c->pworkers_cap = n;
    }
    int i = 0;
    for (const worker_t *w = c->workers; w; w = w->next, i++) {
        policy_worker *pw = &c->pworkers[i];
        memset(pw, 0, sizeof(*pw));
        pw->index = i;
        pw->role = w->role;
        pw->state = w->dead                           ? POLICY_WORKER_DOWN
                    : w->state == PROTO_STATE_READY ? POLICY_WORKER_READY
                                                    : POLICY_WORKER_DRAINING;
        /* A worker still in the role it registered in (never ordered to another) has no
         * change to settle: min_role_ms does not hold it. Counted from its registration, a
         * cluster started just before its traffic could not move for min_role_ms (3 s in
         * tidal-bench: code100's start-up move waited for it, in two calls; docs/tidal.md
         * "Session 12"); tidepool-sim's workers start settled too. */
        pw->role_age_ms = w->assigned_role ? (now - w->role_since_us) / 1000 : INT64_MAX / 4;
        pw->changing = w->changing;
        pw->target_role = w->target_role;
        pw->running = w->running;
        pw->queued = w->queued;
        pw->queued_prompt_tokens = w->qtok;
        pw->kv_blocks_total = w->kv_total;
        pw->kv_blocks_used = w->kv_total - w->kv_free;
        pw->decode_batch = w->running;
        if (usable(w) && (w->role == PROTO_ROLE_PREFILL || w->role == PROTO_ROLE_MIXED))
            have_prefill = 1;
        if (usable(w) && (w->role == PROTO_ROLE_DECODE || w->role == PROTO_ROLE_MIXED) &&
            w->max_seqs > 0) {
            n_dec++;
            seqs += w->max_seqs;
        }
    }
    policy_input in = {.now_ms = now / 1000, .workers = c->pworkers, .n_workers = n};
    policy_cluster *cl = &in.cluster;
    int decoding = 0;
    for (const req_t *r = c->active.head; r; r = r->next) {
        if (r->offline && !r->promoted)
            continue;
        cl->online_running++;
        /* every assigned request holds a decode slot and KV from dispatch on, before its
         * prefill starts: that is decode demand (a prompt burst otherwise hides it) ... */
        decoding++;
        /* ... but until its first token its prompt is prefill's work, not decode's: the
         * policy does not count it as decode's own shortage (policy.h 1d) */
        if (r->pw && !r->p_started)
            cl->online_prefilling++;
    }
    /* A request waits here only when no decode worker has room, unless there is no prefill
     * worker at all: only then is it a prefill shortage (docs/scheduler.md). */
    if (have_prefill) {
        decoding += c->queue.n;
        cl->online_wait_room = c->queue.n;
    } else {
        cl->online_queued = c->queue.n;
        for (const req_t *r = c->queue.head; r; r = r->next)
            cl->queued_prompt_tokens += r->n_prompt + r->n_gen;
        if (c->queue.head)
            cl->oldest_wait_ms = (now - c->queue.head->since_us) / 1000;
    }
    cl->online_decoding = decoding;
    if (c->p.tidal && c->lat_fn)
        c->lat_fn(c->lat_ud, now, &cl->ttft_p90_ms, &cl->tpot_p90_ms);
    cl->prompt_tokens_arrived = c->online_prompt_tokens;
    cl->online_arrived = c->online_arrived;
    cl->online_done = c->online_done;
    cl->output_tokens_done = c->online_output_tokens;
    cl->offline_queued = c->oqueue.n;
    cl->offline_running = c->n_off_running;
    int64_t oldest = now;
    for (const req_t *r = c->oqueue.head; r; r = r->next)
        if (r->enq_us < oldest)
            oldest = r->enq_us;
    cl->offline_oldest_wait_ms = (now - oldest) / 1000;
    policy_params pp = c->p.policy;
    if (n_dec > 0)
        pp.decode_seqs_per_worker = (double)seqs / n_dec;
    policy_output out;
    if (policy_decide(&pp, &c->pstate, &in, &out) < 0) {
        if (!c->policy_failed)
            log_error("the tidal policy refused its input: offline admission stays at %d",
                      c->offline_max_running);
        c->policy_failed = 1;
        return;
    }
    const policy_signals *sg = &c->pstate.sig;
    log_debug("tidal policy: prompt %.0f tok/s, %.1f req/s, queued %.0f tok, decoding %.1f "
              "(prefilling %.1f, waiting %.1f), %.1f output tokens per request; TTFT p90 %.0f "
              "ms, oldest wait %.0f ms, TPOT p90 %.0f ms; pressure prefill %.2f decode %.2f; "
              "load prefill %.2f decode %.2f; %d actions",
              sg->prompt_rate, sg->arrival_rate, sg->queued_tokens, sg->decoding, sg->prefilling,
              sg->wait_room, sg->out_per_req, sg->ttft_ms, sg->oldest_wait_ms, sg->tpot_ms,
              out.prefill_pressure, out.decode_pressure, out.est_prefill_workers,
              out.est_decode_workers, out.n_actions);
    if (out.offline_max_running != c->offline_max_running)
        log_debug("offline admission %d -> %d (pressure prefill %.2f decode %.2f; offline "
                  "running %d, queued %d)",
                  c->offline_max_running, out.offline_max_running, out.prefill_pressure,
                  out.decode_pressure, c->n_off_running, c->oqueue.n);
    c->offline_max_running = out.offline_max_running;
    /* Preempt the offline requests started last: the least work is lost. */
    int k = out.offline_preempt;
    req_t *prev;
    for (req_t *r = c->active.tail; r && k > 0; r = prev) {
        prev = r->prev;
        if (r->offline && !r->promoted) {
            cluster_req_preempt(c, r);
            k--;
        }
    }
    if (out.offline_max_running > c->n_off_running && c->oqueue.head)
        schedule_dispatch(c);
    /* Role changes (--tidal): by draining, see cluster_role_order(); never the last of a
     * role. Every worker this call moves is taken out of routing before any of them is
     * ordered: a sequence migrated off one decode worker must not land on another that
     * leaves in the same call (it would still be on its way there when that one switches,
     * and be re-run from its prompt: docs/tidal.md "Session 12"). */
    int n_marked = 0;
    for (int a = 0; c->p.tidal && a < out.n_actions; a++) {
        worker_t *w = c->workers;
        for (int j = 0; w && j < out.actions[a].worker; j++)
            w = w->next;
        int role = out.actions[a].role;
        if (!w || w->dead || w->changing || w->role == PROTO_ROLE_MIXED || w->role == role ||
            w->state != PROTO_STATE_READY || cluster_n_capable(c, w->role, w) < 1 ||
            (role != PROTO_ROLE_PREFILL && role != PROTO_ROLE_DECODE))
            continue;
        cluster_role_mark(w, role);
        w->order_pending = 1;
        n_marked++;
    }
    if (n_marked > 0)
        log_info("the tidal policy moves %d worker(s): prefill %d, decode %d after (pressure "
                 "prefill %.2f decode %.2f; load in workers prefill %.2f decode %.2f; estimate "
                 "%d prefill)",
                 n_marked, out.n_prefill, out.n_decode, out.prefill_pressure, out.decode_pressure,
                 out.est_prefill_workers, out.est_decode_workers, out.est_prefill);
    for (worker_t *w = c->workers; w && n_marked > 0; w = w->next) {
        if (!w->order_pending)
            continue;
        w->order_pending = 0;
        n_marked--;
        cluster_role_order(c, w, w->target_role, "the tidal policy");
    }
}
