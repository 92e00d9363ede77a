/*
 * runtime: see runtime.h. This file is the role-independent part of a worker: the ctl
 * socket (messages to and from the gateway), registration and heartbeats, the role-change
 * protocol, the KV sender, and the loop that drives the attached roles. The settings,
 * signals and start-up are in worker.c.
 *
 * The loop: poll the ctl socket, the signalfd, the KV sender's sockets and the roles' own
 * (timeout 0 while a role has work, else until the next heartbeat or timer), handle
 * everything that arrived, then run one step of each attached role (prefill first). A
 * step never waits on the network: sends use ZMQ_DONTWAIT and a full or disconnected
 * socket drops the message with a log line. TOKENS and FINISH are gathered during an
 * iteration and go out as one BUNDLE before the next poll (runtime_flush_bundle).
 */
#include "runtime.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include "log.h"
#include "wire.h"

#define CTL_MAX_MSGS_PER_ITER 256 /* ctl messages handled per loop iteration */
#define CTL_SNDHWM 100000
#define CTL_LINGER_MS 1000   /* time to flush BYE at exit */
#define REGISTER_RETRY_MS 50 /* REGISTER not even sent (no connection yet) */
#define CTL_REOPEN_MIN_MS 1000  /* no REGISTER_ACK this long: reopen the ctl DEALER ... */
#define CTL_REOPEN_MAX_MS 10000 /* ... doubling the wait up to this */
#define MAX_POLL_ITEMS 256
#define HEALTH_MIN_INTERVAL_US 250000 /* health file rewrites at most this often, unchanged */
/* A decode role left behind by a change to prefill keeps its kv socket at least this long
 * after the order: a KV_BEGIN a prefill worker sent just before the gateway's MIGRATE
 * reached it may still be on the network. */
#define DECODE_LEAVE_LINGER_US 1000000

static int idle(runtime_t *rt);

/* rt->roles from rt->prefill and rt->decode (prefill first): after every attach/detach. */
static void roles_update(runtime_t *rt)
{
    rt->n_roles = 0;
    if (rt->prefill)
        rt->roles[rt->n_roles++] = (runtime_role){&prefill_role_ops, rt->prefill};
    if (rt->decode)
        rt->roles[rt->n_roles++] = (runtime_role){&decode_role_ops, rt->decode};
}

// --- messages to the gateway

/* Send on the ctl DEALER without ever blocking: wire_send() sends a DEALER's first frame
 * without ZMQ_DONTWAIT, so check ZMQ_POLLOUT (a connected pipe with room) first. */
static int ctl_send(runtime_t *rt, const proto_msg *m)
{
    runtime_flush_bundle(rt); /* what was gathered goes first */
    int ev = 0;
    size_t sz = sizeof(ev);
    if (zmq_getsockopt(rt->ctl, ZMQ_EVENTS, &ev, &sz) < 0 || !(ev & ZMQ_POLLOUT)) {
        errno = EAGAIN;
        return -1;
    }
    return wire_send(rt->ctl, NULL, 0, m, NULL, 0, ZMQ_DONTWAIT);
}

static void ctl_send_logged(runtime_t *rt, const proto_msg *m)
{
    if (ctl_send(rt, m) < 0)
        log_rwarn(m->rid, "%s to the gateway dropped: %s", proto_type_str(m->type),
                  zmq_strerror(errno));
}

static void set_timing(proto_msg *m, const runtime_timing *t)
{
    if (!t)
        return;
    m->queue_us = t->queue_us > 0 ? t->queue_us : 0;
    m->prefill_us = t->prefill_us > 0 ? t->prefill_us : 0;
    m->xfer_us = t->xfer_us > 0 ? t->xfer_us : 0;
    m->xfer_bytes = t->xfer_bytes;
    m->step_us = t->step_us > 0 ? t->step_us : 0;
}

void runtime_flush_bundle(runtime_t *rt)
{
    int n = rt->n_bundle;
    if (n == 0)
        return;
    rt->n_bundle = 0;
    const unsigned char *b = rt->bundle_buf;
    const size_t *off = rt->bundle_off;
    int rc = -1;
    /* No ZMQ_EVENTS check first (it costs two syscalls a step): the first frame
     * goes with ZMQ_DONTWAIT and fails with EAGAIN when the DEALER cannot take it, and
     * once it is taken the rest of the message is too. */
    if (n == 1) {
        rc = zmq_send(rt->ctl, b, off[1], ZMQ_DONTWAIT) < 0 ? -1 : 0;
    } else {
        /* a BUNDLE header, then each message as a frame; after the first frame ZeroMQ
         * takes the rest of a multipart message whole */
        char hdr[64];
        const void *h;
        size_t hlen;
        void *heap;
        proto_msg m;
        proto_msg_init(&m, PROTO_BUNDLE);
        m.ts_us = proto_wall_us();
        if (proto_encode_buf(&m, hdr, sizeof(hdr), &h, &hlen, &heap) == 0 &&
            zmq_send(rt->ctl, h, hlen, ZMQ_DONTWAIT | ZMQ_SNDMORE) == (int)hlen) {
            rc = 0;
            for (int i = 0; i < n && rc == 0; i++)
                if (zmq_send(rt->ctl, b + off[i], off[i + 1] - off[i],
                             i + 1 < n ? ZMQ_SNDMORE : 0) < 0)
                    rc = -1;
        }
        free(heap);
    }
    if (rc < 0)
        log_warn("%d TOKENS/FINISH message%s to the gateway dropped: %s", n, n > 1 ? "s" : "",
                 zmq_strerror(errno));
}

/* Gather m for the next runtime_flush_bundle (a full bundle is flushed first). */
static void bundle_add(runtime_t *rt, const proto_msg *m)
{
    char stack[1024];
    const void *h;
    size_t hlen;
    void *heap;
    if (proto_encode_buf(m, stack, sizeof(stack), &h, &hlen, &heap) < 0) {
        log_rwarn(m->rid, "%s to the gateway not encoded: dropped", proto_type_str(m->type));
        return;
    }
    if (rt->n_bundle == PROTO_BUNDLE_MAX)
        runtime_flush_bundle(rt);
    size_t used = rt->n_bundle ? rt->bundle_off[rt->n_bundle] : 0;
    if (used + hlen > rt->bundle_cap) {
        size_t cap = rt->bundle_cap ? rt->bundle_cap : 16384;
        while (cap < used + hlen)
            cap *= 2;
        unsigned char *nb = realloc(rt->bundle_buf, cap);
        if (!nb) {
            free(heap);
            log_rwarn(m->rid, "%s to the gateway dropped: out of memory",
                      proto_type_str(m->type));
            return;
        }
        rt->bundle_buf = nb;
        rt->bundle_cap = cap;
    }
    memcpy(rt->bundle_buf + used, h, hlen);
    free(heap);
    rt->bundle_off[rt->n_bundle] = used;
    rt->bundle_off[++rt->n_bundle] = used + hlen;
}

_Static_assert(SAMPLER_MAX_TOP_LOGPROBS == PROTO_MAX_TOP_LOGPROBS, "one limit of alternatives");

void runtime_send_tokens(runtime_t *rt, uint64_t rid, int index, const int *tokens, int n,
                         uint64_t rng, const runtime_timing *t, const sampler_logprob *lps)
{
    proto_msg m;
    proto_msg_init(&m, PROTO_TOKENS);
    proto_logprob plp[RUNTIME_MAX_LP_TOKENS];
    ASSERT(!lps || n <= RUNTIME_MAX_LP_TOKENS);
    for (int i = 0; lps && i < n; i++)
        runtime_logprob_to_proto(&plp[i], &lps[i]);
    m.lps = lps ? plp : NULL; /* borrowed for sending */
    m.rid = rid;
    m.index = index;
    m.rng = rng;
    m.tokens = (int *)tokens; /* borrowed for sending */
    m.n_tokens = n;
    m.ts_us = proto_wall_us();
    set_timing(&m, t);
    /* The first token goes at once (after what was gathered): it is the TTFT, and a
     * prefill worker's must reach the gateway before the decode worker, which gets it in
     * KV_END right after this, reports its own tokens (else the request could end first
     * and this message, with its prefill timing, would come for a finished request). */
    if (index == 0)
        ctl_send_logged(rt, &m);
    else
        bundle_add(rt, &m);
}

void runtime_logprob_to_proto(proto_logprob *dst, const sampler_logprob *src)
{
    dst->logprob = src->logprob;
    dst->n_top = src->n_top;
    memcpy(dst->top_ids, src->top_ids, sizeof(dst->top_ids));
    memcpy(dst->top_logprobs, src->top_logprobs, sizeof(dst->top_logprobs));
}

void runtime_send_prompt_logprobs(runtime_t *rt, uint64_t rid, int index, const int *tokens, int n,
                                  const proto_logprob *lps)
{
    proto_msg m;
    proto_msg_init(&m, PROTO_TOKENS);
    m.rid = rid;
    m.index = index;
    m.echo = 1;
    m.tokens = (int *)tokens; /* borrowed for sending */
    m.n_tokens = n;
    m.lps = (proto_logprob *)lps;
    m.ts_us = proto_wall_us();
    bundle_add(rt, &m);
}

void runtime_send_finish(runtime_t *rt, uint64_t rid, int reason, const runtime_timing *t)
{
    proto_msg m;
    proto_msg_init(&m, PROTO_FINISH);
    m.rid = rid;
    m.reason = reason;
    m.ts_us = proto_wall_us();
    set_timing(&m, t);
    bundle_add(rt, &m);
    log_rdebug(rid, "finished (%s)", reason == PROTO_FINISH_STOP ? "stop" : "length");
}

void runtime_send_error(runtime_t *rt, uint64_t rid, int code, int retry, const char *msg)
{
    proto_msg m;
    proto_msg_init(&m, PROTO_ERROR);
    m.rid = rid;
    m.code = code;
    m.retryable = retry;
    snprintf(m.message, sizeof(m.message), "%s", msg);
    m.ts_us = proto_wall_us();
    log_rinfo(rid, "error reported: %s (%s)%s", proto_err_str(code), msg,
              retry ? ", retryable" : "");
    ctl_send_logged(rt, &m);
}

static int send_register(runtime_t *rt)
{
    const worker_compute *cp = &rt->cp;
    proto_msg m;
    proto_msg_init(&m, PROTO_REGISTER);
    snprintf(m.worker_id, sizeof(m.worker_id), "%s", rt->wid);
    m.role = rt->role;
    if (!rt->decode_leaving) /* a decode role that is leaving takes no new KV */
        snprintf(m.kv_endpoint, sizeof(m.kv_endpoint), "%s", rt->kv_endpoint);
    if (rt->curve_on && m.kv_endpoint[0]) /* the key its kv ROUTER serves with */
        snprintf(m.kv_pubkey, sizeof(m.kv_pubkey), "%s", rt->curve.public_z85);
    m.fingerprint = cp->mc->fingerprint;
    m.pid = (int)getpid();
    m.n_ctx = cp->mc->n_ctx;
    m.block_size = cp->block_size;
    m.max_seqs = cp->max_items;
    m.kv_blocks_total = kvcache_n_blocks(cp->kv);
    m.kv_blocks_free = kvcache_n_free_blocks(cp->kv);
    m.emulated = cp->emu_on;
    m.mtp_depth = (cp->mtp ? cp->mtp_depth : 0) + 1;
    m.ts_us = proto_wall_us();
    int rc = ctl_send(rt, &m);
    if (rc < 0)
        log_debug("REGISTER not sent yet: %s", zmq_strerror(errno));
    rt->ctl_ok = rc == 0;
    return rc;
}

static void send_heartbeat(runtime_t *rt)
{
    proto_msg m;
    proto_msg_init(&m, PROTO_HEARTBEAT);
    snprintf(m.worker_id, sizeof(m.worker_id), "%s", rt->wid);
    m.role = rt->role;
    m.state = rt->draining      ? PROTO_STATE_DRAINING
              : rt->role_target ? PROTO_STATE_CHANGING
                                : PROTO_STATE_READY;
    m.role_change_us = rt->role_change_us;
    m.n_role_changes = rt->n_role_changes;
    for (runtime_role *r = rt->roles; r < rt->roles + rt->n_roles; r++)
        r->ops->load(r->st, &m); /* running, queued, kvx_rx */
    m.kv_blocks_total = kvcache_n_blocks(rt->cp.kv);
    m.kv_blocks_free = kvcache_n_free_blocks(rt->cp.kv);
    m.tokens_in = rt->tokens_in;
    m.tokens_out = rt->tokens_out;
    m.prefix_queries = rt->prefix_queries;
    m.prefix_hits = rt->prefix_hits;
    m.spec = rt->spec;
    m.mig = rt->mig;
    m.n_preemptions = rt->n_preemptions;
    if (rt->sender)
        kvx_sender_get_stats(rt->sender, &m.kvx_tx);
    m.emulated = rt->cp.emu_on;
    m.ts_us = proto_wall_us();
    rt->ctl_ok = ctl_send(rt, &m) == 0;
    if (!rt->ctl_ok)
        log_debug("HEARTBEAT not sent: %s", zmq_strerror(errno));
}

// --- the health file (--health-file)

/* Rewrite the health file, if one is set: a few "key=value" lines a container health
 * check reads (deploy/container/tidepool-health). time_ms (wall clock) shows the loop is
 * alive; registered=1 means the gateway acknowledged this worker's REGISTER and the last
 * REGISTER/HEARTBEAT went out on a connected ctl socket (0 while unregistered, after a BYE,
 * or while the gateway is unreachable); state is ready, changing (role change) or draining.
 * Written to PATH.tmp then renamed over PATH, so a reader sees a whole file. Called at every
 * heartbeat tick and when registration changes; an unchanged state is rewritten at most every
 * HEALTH_MIN_INTERVAL_US. A failure is logged once and never stops the worker. */
static void health_write(runtime_t *rt)
{
    const char *path = rt->set.health_file;
    if (!path || !*path)
        return;
    int64_t now = proto_now_us();
    char line[sizeof(rt->health_last)];
    const char *state = rt->draining ? "draining" : rt->role_target ? "changing" : "ready";
    snprintf(line, sizeof(line), "registered=%d\nstate=%s\nrole=%s\n", rt->registered && rt->ctl_ok,
             state, proto_role_str(rt->role));
    if (rt->health_us && now - rt->health_us < HEALTH_MIN_INTERVAL_US &&
        strcmp(line, rt->health_last) == 0)
        return;
    char tmp[4096];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp)) {
        if (!rt->health_err++)
            log_warn("--health-file %s: path too long", path);
        return;
    }
    char buf[1024];
    int n = snprintf(buf, sizeof(buf), "time_ms=%lld\n%sworker_id=%s\npid=%d\nheartbeat_ms=%d\n",
                     (long long)(proto_wall_us() / 1000), line, rt->wid, (int)getpid(), rt->hb_ms);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    int ok = fd >= 0 && write(fd, buf, (size_t)n) == n;
    int err = errno;
    if (fd >= 0 && close(fd) < 0 && ok)
        ok = 0, err = errno;
    if (ok && rename(tmp, path) < 0)
        ok = 0, err = errno;
    if (!ok) {
        if (!rt->health_err++)
            log_warn("--health-file %s: cannot write it: %s (not logged again)", path,
                     strerror(err));
        unlink(tmp);
        return;
    }
    rt->health_us = now;
    snprintf(rt->health_last, sizeof(rt->health_last), "%s", line);
}

// --- the ctl socket

/* Open the ctl DEALER to the gateway, with its handshake monitor. Returns 0, or -1
 * (logged). */
static int ctl_open(runtime_t *rt)
{
    rt->ctl = zmq_socket(rt->zctx, ZMQ_DEALER);
    int one = 1, linger = CTL_LINGER_MS, hwm = CTL_SNDHWM;
    if (!rt->ctl || zmq_setsockopt(rt->ctl, ZMQ_ROUTING_ID, rt->wid, strlen(rt->wid)) < 0 ||
        zmq_setsockopt(rt->ctl, ZMQ_IMMEDIATE, &one, sizeof(one)) < 0 ||
        zmq_setsockopt(rt->ctl, ZMQ_LINGER, &linger, sizeof(linger)) < 0 ||
        zmq_setsockopt(rt->ctl, ZMQ_SNDHWM, &hwm, sizeof(hwm)) < 0 ||
        (rt->curve_on && curve_setup_client(rt->ctl, &rt->curve, rt->curve_gateway_pub) < 0)) {
        log_error("cannot set up the ctl socket: %s", zmq_strerror(zmq_errno()));
        return -1;
    }
    char err[256];
    rt->ctl_mon = hsmon_start(rt->zctx, rt->ctl, HSMON_CLIENT, rt->curve_on, "ctl", err,
                              sizeof(err));
    if (!rt->ctl_mon) /* the worker works without: only the log lines are missing */
        log_warn("ctl socket: %s: failed handshakes are not logged on this connection", err);
    if (zmq_connect(rt->ctl, rt->set.gateway) < 0) {
        log_error("cannot connect the ctl socket to %s: %s", rt->set.gateway,
                  zmq_strerror(zmq_errno()));
        return -1;
    }
    return 0;
}

static void ctl_close(runtime_t *rt, int linger_ms)
{
    hsmon_stop(&rt->ctl_mon); /* before the socket it monitors */
    if (rt->ctl) {
        zmq_setsockopt(rt->ctl, ZMQ_LINGER, &linger_ms, sizeof(linger_ms));
        zmq_close(rt->ctl);
        rt->ctl = NULL;
    }
}

/* No REGISTER_ACK for ctl_backoff_ms: close the ctl DEALER and open a new one. libzmq 4.3.4
 * does not reconnect a connection whose handshake failed (a key the gateway's ZAP handler
 * refused, CURVE on one side only): that session ends for good, and only a new socket tries
 * again; so a worker refused now registers once the gateway admits it. The wait doubles
 * from CTL_REOPEN_MIN_MS to CTL_REOPEN_MAX_MS; each attempt is logged (one line per wait;
 * the handshake monitor logs why the handshake failed). */
static void ctl_reopen(runtime_t *rt, int64_t now)
{
    int next_ms = rt->ctl_backoff_ms * 2 < CTL_REOPEN_MAX_MS ? rt->ctl_backoff_ms * 2
                                                             : CTL_REOPEN_MAX_MS;
    log_warn("no REGISTER_ACK from the gateway at %s for %.0f s: opening a new ctl connection "
             "(next in %d s). Is the gateway running, and is worker id '%s' unique? (ZeroMQ "
             "refuses a second connection with an id in use)%s%s%s",
             rt->set.gateway, (double)(now - rt->unacked_since_us) / 1e6, next_ms / 1000,
             rt->wid, rt->curve_on ? " With CURVE: is this worker's public key " : "",
             rt->curve_on ? rt->curve.public_z85 : "",
             rt->curve_on ? " among the gateway's --curve-authorized-keys, its "
                            "--curve-gateway-key the gateway's, and the gateway CURVE too?"
                          : " (a gateway with CURVE refuses workers without keys)");
    ctl_close(rt, 0); /* not registered: no request of the gateway's is waiting on it */
    rt->n_ctl_reopens++;
    if (ctl_open(rt) < 0) {
        log_error("cannot reopen the ctl socket: leaving");
        exit(1);
    }
    rt->unacked_since_us = now;
    rt->ctl_backoff_ms = next_ms;
}

/* REGISTER until acknowledged, then HEARTBEAT, every hb_ms. */
static void heartbeat_tick(runtime_t *rt, int force)
{
    int64_t now = proto_now_us();
    if (!force && now < rt->next_hb_us)
        return;
    int delay_ms = rt->hb_ms;
    if (!rt->registered) {
        if (send_register(rt) < 0 && delay_ms > REGISTER_RETRY_MS)
            delay_ms = REGISTER_RETRY_MS;
        if (!rt->unacked_since_us)
            rt->unacked_since_us = now;
        else if (now - rt->unacked_since_us >= (int64_t)rt->ctl_backoff_ms * 1000)
            ctl_reopen(rt, now);
    } else {
        send_heartbeat(rt);
    }
    rt->next_hb_us = now + (int64_t)delay_ms * 1000;
    health_write(rt);
}

static void send_bye(runtime_t *rt)
{
    proto_msg m;
    proto_msg_init(&m, PROTO_BYE);
    snprintf(m.worker_id, sizeof(m.worker_id), "%s", rt->wid);
    snprintf(m.message, sizeof(m.message), "drained");
    m.ts_us = proto_wall_us();
    /* EAGAIN: the gateway is already gone (the launcher stops it first): nothing to tell */
    if (ctl_send(rt, &m) < 0)
        LOG_AT(errno == EAGAIN ? LOG_LEVEL_INFO : LOG_LEVEL_WARN, 0, "BYE not sent: %s",
               errno == EAGAIN ? "the gateway is not connected" : zmq_strerror(errno));
}

// --- services for the roles

int runtime_open_sender(runtime_t *rt)
{
    if (rt->sender)
        return 0;
    kvx_sender_params sp = kvx_sender_default_params();
    sp.fingerprint = rt->cp.mc->fingerprint;
    sp.lease_ms = (int)rt->set.lease_ms;
    sp.n_mtp = rt->cp.n_mtp;
    sp.pad_to_bytes_per_token = compute_kv_pad_bytes_per_token(&rt->cp); /* --emulate */
    sp.curve = rt->curve_on ? &rt->curve : NULL;
    rt->sender = kvx_sender_new(rt->zctx, rt->cp.kv, &sp);
    if (!rt->sender) {
        log_error("cannot create the KV sender");
        return -1;
    }
    return 0;
}

int runtime_decodes_locally(const runtime_t *rt)
{
    return rt->decode != NULL && !rt->decode_leaving;
}

int runtime_kv_watermark_blocks(const runtime_t *rt)
{
    return (int)(rt->set.kv_watermark * kvcache_n_blocks(rt->cp.kv));
}

void runtime_handoff_local(runtime_t *rt, runtime_handoff *h)
{
    if (rt->decode) {
        decode_role_ops.adopt(rt->decode, h);
        return;
    }
    runtime_send_error(rt, h->rid, PROTO_ERR_UNAVAILABLE, 1, "this worker does not decode");
    kvcache_seq_free(rt->cp.kv, h->seq);
    free(h->hand);
    free(h->ids);
    seqpen_destroy(&h->pen);
    memset(h, 0, sizeof(*h));
}

// --- live role change (docs/scheduler.md "Live role changes")

static void role_resume(runtime_t *rt)
{
    for (runtime_role *r = rt->roles; r < rt->roles + rt->n_roles; r++)
        if (r->ops->resume)
            r->ops->resume(r->st);
}

/* ROLE from the gateway: start draining towards role. Prefill -> decode: the prefill role
 * takes no new prompts (the gateway stopped sending them when it sent ROLE) and gives back
 * those not started yet; the batch and its transfers finish. Decode -> prefill: the gateway
 * sent a MIGRATE for every sequence here, and for those whose KV is still arriving, before
 * ROLE (decode_worker/migrate.c), or cancelled those it re-runs; a sequence still running
 * without an order finishes here. role_switch() runs once switch_ready(). */
static void on_role(runtime_t *rt, int role)
{
    if (role != PROTO_ROLE_PREFILL && role != PROTO_ROLE_DECODE) {
        log_warn("ROLE %s ignored: only prefill <-> decode changes are supported",
                 proto_role_str(role));
        return;
    }
    if (rt->draining) {
        log_warn("ROLE %s ignored: this worker is leaving", proto_role_str(role));
        return;
    }
    if (rt->role == PROTO_ROLE_MIXED) {
        log_warn("ROLE %s ignored: a mixed worker keeps its role", proto_role_str(role));
        rt->registered = 0; /* the gateway learns it did not change */
        heartbeat_tick(rt, 1);
        return;
    }
    if (role == (int)rt->role) { /* already there, or an order taken back while draining */
        log_info("ROLE %s: already %s%s", proto_role_str(role), proto_role_str(rt->role),
                 rt->role_target ? " (change called off)" : "");
        rt->role_target = 0;
        role_resume(rt);
        rt->registered = 0; /* REGISTER again: the gateway routes to it again */
        heartbeat_tick(rt, 1);
        return;
    }
    if (!rt->role_target)
        rt->role_order_us = proto_now_us();
    rt->role_target = (proto_role_t)role;
    /* the prefill role gives back its queue: only the batch being computed holds the change */
    for (runtime_role *r = rt->roles; r < rt->roles + rt->n_roles; r++)
        if (r->ops->begin_change)
            r->ops->begin_change(r->st);
    log_info("role change %s -> %s ordered: draining (%s)", proto_role_str(rt->role),
             proto_role_str(rt->role_target),
             rt->role == PROTO_ROLE_PREFILL
                 ? "finishing the batch and its transfers"
                 : "running sequences move where the gateway ordered (MIGRATE), KV still "
                   "arriving is moved on when it lands; the switch waits only for sequences "
                   "without an order");
    heartbeat_tick(rt, 1); /* state CHANGING right away */
}

/* The drain is complete: attach the role being moved to, detach the old one (and the KV
 * sender a decode worker does not need), and REGISTER again. When the new role cannot be
 * attached the worker stays in its role and registers again as it was. Decode -> prefill
 * switches once no sequence runs here (each is moving, or was taken back by the gateway):
 * the decode role stays attached, taking no new work, until the moves it started and the
 * KV transfers still arriving (moved on as they land) are over (decode_leave_check). */
static void role_switch(runtime_t *rt)
{
    proto_role_t from = rt->role, to = rt->role_target;
    rt->role_target = 0;
    int ok;
    if (to == PROTO_ROLE_DECODE) {
        /* a decode role still leaving from the last change is taken back as it is */
        ok = rt->decode != NULL || (rt->decode = decode_role_ops.attach(rt)) != NULL;
        if (ok) {
            if (rt->decode_leaving)
                decode_role_ops.resume(rt->decode);
            rt->decode_leaving = 0;
            prefill_role_ops.detach(&rt->prefill);
            kvx_sender_destroy(&rt->sender); /* idle: no transfer holds a sequence */
        }
    } else {
        /* the sender may exist already: migrations */
        ok = runtime_open_sender(rt) == 0 && (rt->prefill = prefill_role_ops.attach(rt)) != NULL;
        if (ok && decode_role_ops.idle(rt->decode)) {
            decode_role_ops.detach(&rt->decode);
        } else if (ok) {
            rt->decode_leaving = 1;
            rt->leave_idle_us = 0;
        }
    }
    roles_update(rt);
    if (!ok) {
        log_error("role change %s -> %s failed (see above): staying %s", proto_role_str(from),
                  proto_role_str(to), proto_role_str(from));
        role_resume(rt);
    } else {
        rt->role = to;
        char tag[32]; /* log lines name the new role (the pool's threads do not log) */
        snprintf(tag, sizeof(tag), "%s_worker", proto_role_str(to));
        log_init(tag, log_min_level);
        rt->role_change_us = proto_now_us() - rt->role_order_us;
        rt->n_role_changes++;
        log_info("role changed %s -> %s in %.1f ms%s%s%s", proto_role_str(from), proto_role_str(to),
                 (double)rt->role_change_us / 1000.0,
                 rt->decode_leaving ? " (the sequences still moving and the KV still arriving "
                                      "are moved on in the background)"
                                    : "",
                 to == PROTO_ROLE_DECODE ? ": kv at " : "",
                 to == PROTO_ROLE_DECODE ? rt->kv_endpoint : "");
    }
    rt->registered = 0; /* REGISTER with the new role (and kv endpoint) */
    heartbeat_tick(rt, 1);
}

/* Detach a decode role left behind by a change to prefill once its moves and incoming
 * transfers are over and DECODE_LEAVE_LINGER_US has passed since the order (not while a
 * change back to decode is under way). */
static void decode_leave_check(runtime_t *rt)
{
    if (!rt->decode_leaving || rt->role_target || !decode_role_ops.idle(rt->decode))
        return; /* (a change back to decode in progress takes it back as it is) */
    int64_t now = proto_now_us();
    if (!rt->leave_idle_us) {
        rt->leave_idle_us = now;
        log_info("decode role: every move and incoming transfer over %.1f ms after the order",
                 (double)(now - rt->role_order_us) / 1000.0);
    }
    if (now - rt->role_order_us < DECODE_LEAVE_LINGER_US)
        return;
    decode_role_ops.detach(&rt->decode);
    rt->decode_leaving = 0;
    roles_update(rt);
    log_info("decode role detached (kv socket closed)");
}

/* The change in progress can switch now: decode -> prefill once no sequence runs here
 * (moves and arriving KV go on in the background), prefill -> decode once idle. */
static int switch_ready(runtime_t *rt)
{
    if (rt->role == PROTO_ROLE_DECODE && rt->role_target == PROTO_ROLE_PREFILL)
        return !decode_role_ops.has_work(rt->decode);
    return idle(rt);
}

// --- messages from the gateway

static void on_ctl(runtime_t *rt, proto_msg *m, int n_frames)
{
    if (n_frames) {
        log_rwarn(m->rid, "dropped %s with %d unexpected payload frames", proto_type_str(m->type),
                  n_frames);
        return;
    }
    switch (m->type) {
    case PROTO_REGISTER_ACK:
        if (m->code != PROTO_ERR_NONE) { /* refused: a restart would be refused again */
            log_error("the gateway refused this worker (%s): %s; exiting with status %d "
                      "(not restarted by the launchers)",
                      proto_err_str(m->code), m->message[0] ? m->message : "no reason given",
                      RUNTIME_EXIT_REFUSED);
            rt->refused = 1;
            rt->registered = 0;
            return;
        }
        if (!rt->registered)
            log_info("registered with the gateway as %s (heartbeat %d ms)", rt->wid,
                     m->heartbeat_ms);
        rt->registered = 1;
        rt->unacked_since_us = 0;
        rt->ctl_backoff_ms = CTL_REOPEN_MIN_MS;
        rt->hb_ms = m->heartbeat_ms;
        rt->next_hb_us = proto_now_us() + (int64_t)rt->hb_ms * 1000;
        health_write(rt); /* registered now */
        return;
    case PROTO_BYE: /* the gateway does not know us (it restarted, or declared us dead) */
        log_info("gateway does not know this worker; registering again");
        rt->registered = 0;
        heartbeat_tick(rt, 1);
        return;
    case PROTO_ROLE:
        on_role(rt, m->role);
        return;
    case PROTO_CANCEL: {
        /* a request is in one role at a time: the decode role remembers a rid it did not
         * hold (its KV may still be on the way) */
        for (runtime_role *r = rt->roles; r < rt->roles + rt->n_roles; r++)
            if (r->ops->on_cancel(r->st, m->rid))
                break;
        return;
    }
    case PROTO_PREFILL:
    case PROTO_MIGRATE:
        break;
    default:
        log_rwarn(m->rid, "dropped unexpected %s from the gateway", proto_type_str(m->type));
        return;
    }
    for (runtime_role *r = rt->roles; r < rt->roles + rt->n_roles; r++)
        if (r->ops->on_msg(r->st, m))
            return;
    if (m->type == PROTO_PREFILL)
        runtime_send_error(rt, m->rid, PROTO_ERR_UNAVAILABLE, 1, "this is a decode worker");
    else if (rt->prefill) /* a prompt whose prefill started (its KV goes where it was going:
                           * that worker moves it on) or that is gone */
        log_rdebug(m->rid, "MIGRATE for a prompt not queued here: ignored");
    else
        log_rwarn(m->rid, "MIGRATE ignored: only a decode worker migrates its sequences");
}

// --- the loop

int runtime_open(runtime_t *rt)
{
    rt->zctx = zmq_ctx_new();
    rt->env = wire_envelope_new();
    if (!rt->zctx || !rt->env)
        return -1;
    if (rt->curve_on) { /* before the kv ROUTER binds: it asks this handler */
        char err[256];
        rt->zap = curve_zap_start(rt->zctx, &rt->curve_auth, err, sizeof(err));
        if (!rt->zap) {
            log_error("CURVE: %s", err);
            return -1;
        }
    }
    rt->ctl_backoff_ms = CTL_REOPEN_MIN_MS;
    if (ctl_open(rt) < 0)
        return -1; /* logged */
    if (rt->role != PROTO_ROLE_PREFILL)
        rt->decode = decode_role_ops.attach(rt);
    if (rt->role != PROTO_ROLE_DECODE && runtime_open_sender(rt) == 0)
        rt->prefill = prefill_role_ops.attach(rt);
    roles_update(rt);
    if ((rt->role != PROTO_ROLE_PREFILL && !rt->decode) ||
        (rt->role != PROTO_ROLE_DECODE && !rt->prefill))
        return -1; /* logged */
    return 0;
}

void runtime_close(runtime_t *rt, int fast)
{
    if (rt->set.health_file && *rt->set.health_file)
        unlink(rt->set.health_file);       /* a worker that is gone is not healthy */
    prefill_role_ops.detach(&rt->prefill); /* before the sender: it aborts its transfers */
    decode_role_ops.detach(&rt->decode);
    roles_update(rt);
    kvx_sender_destroy(&rt->sender);
    if (rt->ctl && !fast)
        runtime_flush_bundle(rt);
    ctl_close(rt, fast ? 0 : CTL_LINGER_MS);
    free(rt->bundle_buf);
    rt->bundle_buf = NULL;
    rt->bundle_cap = 0;
    rt->n_bundle = 0;
    wire_envelope_destroy(&rt->env);
    curve_zap_stop(&rt->zap); /* before the context: its socket would hold it */
    if (rt->zctx)
        zmq_ctx_term(rt->zctx); /* drops queued zero-copy frames: before the KV cache goes */
    rt->zctx = NULL;
}

/* Handle pending signals. Returns 1 when the worker must stop now (second signal). */
static int on_signals(runtime_t *rt)
{
    struct signalfd_siginfo si;
    int stop = 0;
    while (read(rt->sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
        if (rt->draining) {
            log_warn("signal %u again: exiting without draining", si.ssi_signo);
            stop = 1;
            continue;
        }
        log_info("signal %u: draining (finishing queued and running work), then leaving",
                 si.ssi_signo);
        rt->draining = 1;
        heartbeat_tick(rt, 1); /* tell the gateway right away */
    }
    return stop;
}

static int min_timeout(int a, int b)
{
    if (a < 0)
        return b;
    if (b < 0)
        return a;
    return a < b ? a : b;
}

/* No request, transfer or pinned sequence left in any role or in the sender. */
static int idle(runtime_t *rt)
{
    for (runtime_role *r = rt->roles; r < rt->roles + rt->n_roles; r++)
        if (!r->ops->idle(r->st))
            return 0;
    return !rt->sender || kvx_sender_n_active(rt->sender) == 0;
}

static int has_work(runtime_t *rt)
{
    for (runtime_role *r = rt->roles; r < rt->roles + rt->n_roles; r++)
        if (r->ops->has_work(r->st))
            return 1;
    return 0;
}

/* KV sender events go to the role whose transfer it was (none: cancelled meanwhile). */
static void on_sender_events(runtime_t *rt)
{
    kvx_event ev;
    while (rt->sender && kvx_sender_next_event(rt->sender, &ev)) {
        for (runtime_role *r = rt->roles; r < rt->roles + rt->n_roles; r++)
            if (r->ops->on_send_event(r->st, &ev))
                break;
    }
}

int runtime_run(runtime_t *rt)
{
    zmq_pollitem_t items[MAX_POLL_ITEMS];
    heartbeat_tick(rt, 1);
    for (;;) {
        int n = 0;
        items[n++] = (zmq_pollitem_t){.socket = rt->ctl, .events = ZMQ_POLLIN};
        items[n++] = (zmq_pollitem_t){.socket = NULL, .fd = rt->sigfd, .events = ZMQ_POLLIN};
        int timeout = has_work(rt) ? 0 : -1;
        if (timeout < 0) {
            int64_t until_hb = (rt->next_hb_us - proto_now_us() + 999) / 1000;
            timeout = until_hb < 0 ? 0 : (int)until_hb;
        }
        for (runtime_role *r = rt->roles; r < rt->roles + rt->n_roles; r++) {
            if (r->ops->pollitems)
                n += r->ops->pollitems(r->st, items + n, MAX_POLL_ITEMS - n);
            if (timeout > 0 && r->ops->next_timeout_ms)
                timeout = min_timeout(timeout, r->ops->next_timeout_ms(r->st));
        }
        if (rt->sender) {
            n += kvx_sender_pollitems(rt->sender, items + n, MAX_POLL_ITEMS - n);
            if (timeout > 0)
                timeout = min_timeout(timeout, kvx_sender_next_timeout_ms(rt->sender));
        }
        runtime_flush_bundle(rt); /* this iteration's TOKENS and FINISH: one message */
        /* Nothing reads the items' revents: every socket is read until EAGAIN below. So
         * with work to do (timeout 0) the poll would only cost its syscalls (two per
         * ZeroMQ socket, ~15 a step at batch 1, a tenth of a stories260K step): the poll
         * is for sleeping until something arrives. */
        if (timeout != 0 && zmq_poll(items, n, timeout) < 0) {
            if (zmq_errno() == EINTR)
                continue;
            log_error("zmq_poll: %s", zmq_strerror(zmq_errno()));
            return 1;
        }
        if (on_signals(rt))
            return 1;
        for (int i = 0; i < CTL_MAX_MSGS_PER_ITER; i++) {
            int rc = wire_recv(rt->ctl, 0, rt->env, ZMQ_DONTWAIT);
            if (rc == 0)
                break;
            if (rc == -2) {
                log_error("ctl recv: %s", zmq_strerror(errno));
                break;
            }
            if (rc == 1)
                on_ctl(rt, wire_envelope_msg(rt->env), wire_envelope_n_frames(rt->env));
        }
        wire_envelope_reset(rt->env);
        if (rt->refused)
            return RUNTIME_EXIT_REFUSED;
        for (runtime_role *r = rt->roles; r < rt->roles + rt->n_roles; r++)
            if (r->ops->process)
                r->ops->process(r->st); /* the decode role's kv socket and its events */
        if (rt->sender)
            kvx_sender_process(rt->sender);
        on_sender_events(rt);
        if (rt->role_target && !rt->draining && switch_ready(rt))
            role_switch(rt);
        decode_leave_check(rt);
        heartbeat_tick(rt, 0);
        if (rt->draining && idle(rt)) {
            log_info("drained: leaving");
            send_bye(rt);
            return 0;
        }
        int worked = 0;
        for (runtime_role *r = rt->roles; r < rt->roles + rt->n_roles; r++)
            worked |= r->ops->step(r->st);
        if (worked && rt->set.debug_step_delay_ms > 0) /* tests: make requests last */
            usleep((useconds_t)rt->set.debug_step_delay_ms * 1000);
    }
}
