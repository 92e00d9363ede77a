/* cluster_roles: live role changes and live migration (docs/scheduler.md "Live role
 * changes"). A worker ordered to change role (ROLE: by the operator through
 * cluster_set_role, or by the tidal policy) is out of routing until it registers again in
 * its new role; a decode worker leaving the role first moves the sequences it decodes to
 * other decode workers (MIGRATE). The cluster keeps at least one worker per role. */
#include <stdio.h>
#include <string.h>

#include "cluster_internal.h"
#include "log.h"
#include "protocol.h"

// --- live role changes

static void notify_role(cluster_t *c, const worker_t *w, int role, int old_role,
                        const char *reason)
{
    if (!c->observer)
        return;
    cluster_event ev = {.type = CLUSTER_EV_ROLE_CHANGE, .worker = w->id, .role = role,
                        .old_role = old_role, .state = w->state, .reason = reason};
    c->observer(&ev, c->observer_ud);
}

/* The worker to move r to from w (live migration): a ready decode or mixed worker other than
 * w with a kv endpoint, room for r's KV as pick() counts it (its tokens so far plus the
 * first step's headroom) and a free sequence slot by its own running count; the most free
 * blocks wins. NULL when none has room now (r then finishes on w). */
static worker_t *migration_target(cluster_t *c, const req_t *r, const worker_t *w)
{
    worker_t *best = NULL;
    long best_free = -1;
    int64_t now = proto_now_us();
    for (worker_t *d = c->workers; d; d = d->next) {
        if (d == w || !routable(c, d, now) || !d->kvep[0] || d->full ||
            (d->role != PROTO_ROLE_DECODE && d->role != PROTO_ROLE_MIXED))
            continue;
        /* KV: what is free and not promised to requests on their way (as routing counts);
         * sequence slots: the worker's own running count, not the gateway's assignments, so
         * that a prompt burst that reserved every slot for sequences still prefilling does
         * not hold a role change for seconds (one of those may then find no slot and be
         * re-run: a running sequence goes first) */
        long free_blocks = (long)d->kv_free - d->pending_blocks;
        if (free_blocks < blocks_needed(r, d) ||
            (d->max_seqs > 0 && d->running + d->moved_in >= d->max_seqs) ||
            (d->n_ctx > 0 && r->n_prompt + r->n_gen >= d->n_ctx))
            continue;
        if (free_blocks > best_free) {
            best_free = free_blocks;
            best = d;
        }
    }
    return best;
}

/* Send MIGRATE for r (wire rid) naming decode worker d to worker to. Returns 0 or -1 (the
 * send failed: `to` is flagged dead). */
static int send_migrate(cluster_t *c, worker_t *to, const req_t *r, const worker_t *d)
{
    proto_msg m;
    proto_msg_init(&m, PROTO_MIGRATE);
    m.rid = wire_rid(r);
    snprintf(m.decode_worker, sizeof(m.decode_worker), "%s", d->id);
    snprintf(m.decode_endpoint, sizeof(m.decode_endpoint), "%s", d->kvep);
    snprintf(m.decode_pubkey, sizeof(m.decode_pubkey), "%s", d->kvpk);
    return cluster_send_to(c, to, &m);
}

/* w is leaving the decode role: order it to move every request it decodes (or is about to
 * receive) to another decode worker (MIGRATE), which continues each at the next token
 * (docs/scheduler.md "Live role changes"). A request whose prompt its prefill worker has
 * not computed yet gets a MIGRATE there too: a prompt still queued there sends its KV to
 * the new decode worker directly (one that is being computed goes to w, which moves it on
 * when it lands). The request's decode worker becomes the target at once, its reservation
 * moves there, and w stays one of its workers (mw) until the target reports a token, so an
 * ERROR, FINISH or TOKENS from w still counts. A request no other decode worker has room
 * for is re-run from its tokens so far (as for a preemption: greedy and seeded output go on
 * unchanged), so that the change never waits for a sequence to finish. Returns the number
 * of moves ordered; *n_rerun gets the number of requests re-run. */
static int migrate_all(cluster_t *c, worker_t *w, int *n_rerun)
{
    int n = 0;
    req_t *next;
    *n_rerun = 0;
    for (req_t *r = c->active.head; r && !w->dead; r = next) {
        next = r->next;
        if (r->dw != w || r->pw == w || r->mw)
            continue;
        worker_t *d = migration_target(c, r, w);
        if (!d) {
            cluster_req_retry(c, r, 0,
                              "its decode worker is changing role and no other "
                              "decode worker has room for it now");
            (*n_rerun)++;
            continue;
        }
        if (send_migrate(c, w, r, d) < 0)
            break; /* w is flagged dead: its requests are re-run */
        if (r->pw && !r->p_started && !r->pw->dead)
            send_migrate(c, r->pw, r, d); /* a failure flags pw dead: r is re-run then */
        if (!r->d_started)
            w->pending_blocks -= r->d_blocks;
        w->n_decode--;
        if (r->pw != w)
            w->n_assigned--;
        r->mw = w;
        r->mw_started = r->d_started;
        r->dw = d;
        r->d_started = 0;
        r->d_blocks = blocks_needed(r, d);
        d->pending_blocks += r->d_blocks;
        d->moved_in++;
        d->n_decode++;
        d->n_assigned++;
        if (r->timing)
            snprintf(r->timing->decode_worker, sizeof(r->timing->decode_worker), "%s", d->id);
        c->n_migrate_orders++;
        n++;
        log_rinfo(r->rid, "migrating from %s to %s (%d generated)", w->id, d->id, r->n_gen);
    }
    return n;
}

void cluster_role_mark(worker_t *w, int role)
{
    w->changing = 1; /* out of routing (and of the migration targets) from here */
    w->target_role = role;
    w->state = PROTO_STATE_CHANGING;
}

/* Send ROLE to w and take it out of routing until it registers again. Returns 0 or -1
 * (the send failed: w is flagged dead). */
int cluster_role_order(cluster_t *c, worker_t *w, int role, const char *why)
{
    cluster_role_mark(w, role);
    w->assigned_role = role; /* also if it dies on the way: its next incarnation goes there */
    w->change_us = proto_now_us();
    /* the moves go before ROLE: when the worker reads ROLE, every sequence it runs has its
     * order (or was cancelled), so it can switch without waiting for more */
    int n_rerun = 0;
    int n_moves = w->role == PROTO_ROLE_DECODE ? migrate_all(c, w, &n_rerun) : 0;
    proto_msg m;
    proto_msg_init(&m, PROTO_ROLE);
    m.role = role;
    if (w->dead || cluster_send_to(c, w, &m) < 0)
        return -1; /* flagged dead: its requests are re-run */
    c->n_role_orders++;
    log_info("worker %s: role change %s -> %s ordered by %s (%d sequences migrating, %d "
             "re-run: no room elsewhere)",
             w->id, proto_role_str(w->role), proto_role_str(role), why, n_moves, n_rerun);
    char reason[96];
    snprintf(reason, sizeof(reason), "ordered by %s", why);
    notify_role(c, w, role, w->role, reason);
    return 0;
}

/* w registered again after ROLE (same process), in role `role`: the change is done (or the
 * worker could not make it and stayed). Nothing of its old role held it any more: a request
 * it prefilled is decoding elsewhere (its KV was accepted
 * before the worker went idle: the prefill worker is released from it); a request it is
 * moving away stays its (mw) until the target reports a token; a request still naming it as
 * decode worker never got there (its KV never came) and is re-run. */
void cluster_role_change_done(cluster_t *c, worker_t *w, int role)
{
    double ms = (double)(proto_now_us() - w->change_us) / 1000.0;
    req_t *next;
    /* (a worker that registers again in its old role kept whatever it was doing) */
    for (req_t *r = role != w->role ? c->active.head : NULL; r; r = next) {
        next = r->next;
        /* (a request it is moving keeps it as mw until the target reports a token: a decode
         * worker switches once its sequences are on their way, and a move that fails after
         * that is still its ERROR to report) */
        if (r->pw == w && r->dw != w) {
            if (!r->p_started)
                w->pending_qtok -= r->p_qtok;
            w->n_assigned--;
            r->pw = NULL;
        } else if (r->dw == w) {
            cluster_req_retry(c, r, 0, "its decode worker changed role");
        }
    }
    char reason[96];
    if (role == w->target_role) {
        c->n_role_changes++;
        c->last_role_change_ms = ms;
        snprintf(reason, sizeof(reason), "done in %.1f ms", ms);
        log_info("worker %s: role change %s -> %s done in %.1f ms", w->id, proto_role_str(w->role),
                 proto_role_str(role), ms);
    } else {
        snprintf(reason, sizeof(reason), "not made: still %s", proto_role_str(role));
        w->assigned_role = role;
        log_warn("worker %s: role change to %s not made: it registered again as %s", w->id,
                 proto_role_str(w->target_role), proto_role_str(role));
    }
    notify_role(c, w, role, w->role, reason);
}

/* Workers able to do role (ready ones, plus those changing to it; mixed counts for both),
 * not counting skip. */
int cluster_n_capable(const cluster_t *c, int role, const worker_t *skip)
{
    int n = 0;
    for (const worker_t *w = c->workers; w; w = w->next) {
        if (w == skip || w->dead)
            continue;
        int r = w->changing ? w->target_role : w->role;
        if (!w->changing && w->state != PROTO_STATE_READY)
            continue;
        n += r == role || r == PROTO_ROLE_MIXED;
    }
    return n;
}

int cluster_set_role(cluster_t *c, const char *id, int role, const char *why, char *err,
                     size_t errlen)
{
    if (role != PROTO_ROLE_PREFILL && role != PROTO_ROLE_DECODE) {
        snprintf(err, errlen, "role must be prefill or decode");
        return -3;
    }
    worker_t *w = worker_find(c, id, strlen(id));
    if (!w || w->dead) {
        snprintf(err, errlen, "no worker '%s'", id);
        return -1;
    }
    if (w->role == PROTO_ROLE_MIXED) {
        snprintf(err, errlen, "worker '%s' is mixed: it keeps its role", id);
        return -2;
    }
    if (w->changing) {
        snprintf(err, errlen, "worker '%s' is already changing to %s", id,
                 proto_role_str(w->target_role));
        return -2;
    }
    if (w->role == role) {
        snprintf(err, errlen, "worker '%s' is already %s", id, proto_role_str(role));
        return -2;
    }
    if (w->state != PROTO_STATE_READY) {
        snprintf(err, errlen, "worker '%s' is not ready (draining)", id);
        return -2;
    }
    if (cluster_n_capable(c, w->role, w) < 1) {
        snprintf(err, errlen, "worker '%s' is the last %s worker: the cluster keeps at least "
                 "one per role", id, proto_role_str(w->role));
        return -2;
    }
    if (cluster_role_order(c, w, role, why) < 0) {
        snprintf(err, errlen, "worker '%s' is unreachable", id);
        return -1;
    }
    return 0;
}
