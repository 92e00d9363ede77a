/*
 * worker: see worker.h. This file is the runtime: settings, start-up, the zmq_poll loop,
 * registration and heartbeats with the gateway, signals and draining. The requests
 * themselves (queue, prefill batches, decode steps, transfers) are in worker_sched.c.
 *
 * The loop: poll the sockets and the signalfd (timeout 0 while a step has work, else until
 * the next heartbeat or lease), handle everything that arrived, then run at most one
 * prefill batch and one decode step. A step never waits on the network: sends use
 * ZMQ_DONTWAIT and a full or disconnected socket drops the message with a log line.
 */
#include "worker.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include "config.h"
#include "log.h"
#include "worker_internal.h"

#define CTL_MAX_MSGS_PER_ITER 256 /* ctl messages handled per loop iteration */
#define CTL_SNDHWM 100000
#define CTL_LINGER_MS 1000   /* time to flush BYE at exit */
#define REGISTER_RETRY_MS 50 /* REGISTER not even sent (no connection yet) */
#define MAX_POLL_ITEMS 256

// --- messages to the gateway

/* Send on the ctl DEALER without ever blocking: wire_send() sends a DEALER's first frame
 * without ZMQ_DONTWAIT, so check ZMQ_POLLOUT (a connected pipe with room) first. */
static int ctl_send(worker_t *w, const proto_msg *m)
{
    int ev = 0;
    size_t sz = sizeof(ev);
    if (zmq_getsockopt(w->ctl, ZMQ_EVENTS, &ev, &sz) < 0 || !(ev & ZMQ_POLLOUT)) {
        errno = EAGAIN;
        return -1;
    }
    return wire_send(w->ctl, NULL, 0, m, NULL, 0, ZMQ_DONTWAIT);
}

static void ctl_send_logged(worker_t *w, const proto_msg *m)
{
    if (ctl_send(w, m) < 0)
        log_rwarn(m->rid, "%s to the gateway dropped: %s", proto_type_str(m->type),
                  zmq_strerror(errno));
}

static void set_timing(proto_msg *m, const worker_timing *t)
{
    if (!t)
        return;
    m->queue_us = t->queue_us > 0 ? t->queue_us : 0;
    m->prefill_us = t->prefill_us > 0 ? t->prefill_us : 0;
    m->xfer_us = t->xfer_us > 0 ? t->xfer_us : 0;
    m->xfer_bytes = t->xfer_bytes;
    m->step_us = t->step_us > 0 ? t->step_us : 0;
}

void worker_send_tokens_timed(worker_t *w, uint64_t rid, int index, const int *tokens, int n,
                              uint64_t rng, const worker_timing *t)
{
    proto_msg m;
    proto_msg_init(&m, PROTO_TOKENS);
    m.rid = rid;
    m.index = index;
    m.rng = rng;
    m.tokens = (int *)tokens; /* borrowed for sending */
    m.n_tokens = n;
    m.ts_us = proto_wall_us();
    set_timing(&m, t);
    ctl_send_logged(w, &m);
}

void worker_send_finish_timed(worker_t *w, uint64_t rid, int reason, const worker_timing *t)
{
    proto_msg m;
    proto_msg_init(&m, PROTO_FINISH);
    m.rid = rid;
    m.reason = reason;
    m.ts_us = proto_wall_us();
    set_timing(&m, t);
    ctl_send_logged(w, &m);
    log_rdebug(rid, "finished (%s)", reason == PROTO_FINISH_STOP ? "stop" : "length");
}

void worker_send_finish(worker_t *w, uint64_t rid, int reason)
{
    worker_send_finish_timed(w, rid, reason, NULL);
}

void worker_send_error(worker_t *w, uint64_t rid, int code, int retry, const char *msg)
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
    ctl_send_logged(w, &m);
}

static int send_register(worker_t *w)
{
    proto_msg m;
    proto_msg_init(&m, PROTO_REGISTER);
    snprintf(m.worker_id, sizeof(m.worker_id), "%s", w->wid);
    m.role = w->role;
    snprintf(m.kv_endpoint, sizeof(m.kv_endpoint), "%s", w->kv_endpoint);
    m.fingerprint = w->mc->fingerprint;
    m.pid = (int)getpid();
    m.n_ctx = w->mc->n_ctx;
    m.block_size = (int)w->block_size;
    m.max_seqs = (int)w->max_seqs;
    m.kv_blocks_total = kvcache_n_blocks(w->kv);
    m.kv_blocks_free = kvcache_n_free_blocks(w->kv);
    m.emulated = w->emu_on;
    m.ts_us = proto_wall_us();
    int rc = ctl_send(w, &m);
    if (rc < 0)
        log_debug("REGISTER not sent yet: %s", zmq_strerror(errno));
    return rc;
}

static void send_heartbeat(worker_t *w)
{
    proto_msg m;
    proto_msg_init(&m, PROTO_HEARTBEAT);
    snprintf(m.worker_id, sizeof(m.worker_id), "%s", w->wid);
    m.role = w->role;
    m.state = w->draining      ? PROTO_STATE_DRAINING
              : w->role_target ? PROTO_STATE_CHANGING
                               : PROTO_STATE_READY;
    m.role_change_us = w->role_change_us;
    m.n_role_changes = w->n_role_changes;
    sched_load(w, &m.running, &m.queued, &m.queued_prompt_tokens);
    m.kv_blocks_total = kvcache_n_blocks(w->kv);
    m.kv_blocks_free = kvcache_n_free_blocks(w->kv);
    m.tokens_in = w->tokens_in;
    m.tokens_out = w->tokens_out;
    if (w->sender)
        kvx_sender_get_stats(w->sender, &m.kvx_tx);
    if (w->receiver)
        kvx_receiver_get_stats(w->receiver, &m.kvx_rx);
    m.spec = w->spec;
    m.mig = w->mig;
    m.emulated = w->emu_on;
    m.ts_us = proto_wall_us();
    if (ctl_send(w, &m) < 0)
        log_debug("HEARTBEAT not sent: %s", zmq_strerror(errno));
}

/* REGISTER until acknowledged, then HEARTBEAT, every hb_ms. */
static void heartbeat_tick(worker_t *w, int force)
{
    int64_t now = proto_now_us();
    if (!force && now < w->next_hb_us)
        return;
    int delay_ms = w->hb_ms;
    if (!w->registered) {
        if (send_register(w) < 0 && delay_ms > REGISTER_RETRY_MS)
            delay_ms = REGISTER_RETRY_MS;
        if (!w->unacked_since_us)
            w->unacked_since_us = now;
        else if (now - w->unacked_since_us > 5000000) {
            log_warn("no REGISTER_ACK from the gateway at %s for 5 s: is it running, and is "
                     "worker id '%s' unique? (ZeroMQ refuses a second connection with an id "
                     "in use)", w->gateway, w->wid);
            w->unacked_since_us = now;
        }
    } else {
        send_heartbeat(w);
    }
    w->next_hb_us = now + (int64_t)delay_ms * 1000;
}

static void on_role(worker_t *w, int role);

static void on_ctl(worker_t *w, proto_msg *m, int n_frames)
{
    if (n_frames) {
        log_rwarn(m->rid, "dropped %s with %d unexpected payload frames", proto_type_str(m->type),
                  n_frames);
        return;
    }
    switch (m->type) {
    case PROTO_REGISTER_ACK:
        if (!w->registered)
            log_info("registered with the gateway as %s (heartbeat %d ms)", w->wid,
                     m->heartbeat_ms);
        w->registered = 1;
        w->unacked_since_us = 0;
        w->hb_ms = m->heartbeat_ms;
        w->next_hb_us = proto_now_us() + (int64_t)w->hb_ms * 1000;
        return;
    case PROTO_BYE: /* the gateway does not know us (it restarted, or declared us dead) */
        log_info("gateway does not know this worker; registering again");
        w->registered = 0;
        heartbeat_tick(w, 1);
        return;
    case PROTO_PREFILL:
        sched_on_prefill(w, m);
        return;
    case PROTO_CANCEL:
        sched_on_cancel(w, m->rid);
        return;
    case PROTO_ROLE:
        on_role(w, m->role);
        return;
    case PROTO_MIGRATE:
        sched_on_migrate(w, m);
        return;
    default:
        log_rwarn(m->rid, "dropped unexpected %s from the gateway", proto_type_str(m->type));
        return;
    }
}

// --- start-up and shutdown

static int setup_model(worker_t *w)
{
    char err[512];
    w->model = model_load(w->model_path, err, sizeof(err));
    if (!w->model) {
        log_error("cannot load the model: %s", err);
        return -1;
    }
    w->mc = model_get_config(w->model);
    const model_config *mc = w->mc;
    if (wmtp_load(w) < 0)
        return -1;
    int per_seq = (int)((mc->n_ctx + w->block_size - 1) / w->block_size);
    if (w->kv_blocks == 0)
        w->kv_blocks = w->max_seqs * per_seq;
    kvcache_params kp = {.n_layer = mc->n_layer + w->n_mtp, /* MTP modules' K/V last */
                         .n_kv_head = mc->n_kv_head,
                         .head_dim = mc->head_dim,
                         .block_size = (int)w->block_size,
                         .n_blocks = (int)w->kv_blocks,
                         .max_seqs = (int)w->max_seqs,
                         .max_seq_len = mc->n_ctx};
    w->kv = kvcache_new(&kp);
    if (!w->kv) {
        log_error("cannot allocate the KV cache (%lld blocks of %d tokens)", w->kv_blocks,
                  kp.block_size);
        return -1;
    }
    w->max_items = (int)w->max_seqs;
    /* Prompts run in chunks of at most max_batch_tokens per pass (worker_sched.c), so the
     * scratch is sized for a batch, not for the context. */
    int max_tokens = (int)w->max_batch_tokens;
    if (max_tokens < w->max_items)
        max_tokens = w->max_items;
    model_ctx_params cp = model_ctx_default_params();
    cp.max_tokens = max_tokens;
    cp.n_threads = (int)w->threads;
    w->mctx = model_ctx_new_params(w->model, &cp);
    w->sampler = sampler_new(mc->vocab_size);
    w->logits = malloc((size_t)w->max_items * (size_t)mc->vocab_size * sizeof(float));
    w->batch = calloc((size_t)w->max_items, sizeof(*w->batch));
    w->batch_reqs = calloc((size_t)w->max_items, sizeof(*w->batch_reqs));
    if (!w->mctx || !w->sampler || !w->logits || !w->batch || !w->batch_reqs) {
        log_error("out of memory allocating the model's buffers");
        return -1;
    }
    if (wmtp_setup(w) < 0)
        return -1;
    log_info("model %s: %s, %d layers, dim %d, vocab %d, context %d, fingerprint %016llx",
             w->model_path, mc->name, mc->n_layer, mc->dim, mc->vocab_size, mc->n_ctx,
             (unsigned long long)mc->fingerprint);
    log_info("KV cache: %d blocks of %d tokens (%zu bytes per block per layer), %d sequences",
             kp.n_blocks, kp.block_size, kvcache_block_bytes(w->kv), kp.max_seqs);
    log_info("compute: %d threads (%s), kernels %s; prefill chunks of %lld tokens, batches of "
             "%d tokens",
             model_ctx_n_threads(w->mctx), w->threads ? "--threads" : "CPUs available",
             model_ctx_kernel_name(w->mctx), w->prefill_chunk_tokens, max_tokens);
    return 0;
}

/* The kv ROUTER of a decode/mixed worker (bound at --kv-bind) and the endpoint it
 * advertises. Returns 0 or -1 (logged). */
static int open_receiver(worker_t *w)
{
    kvx_receiver_params rp = kvx_receiver_default_params();
    rp.fingerprint = w->mc->fingerprint;
    rp.lease_ms = (int)w->lease_ms;
    if (w->mtp) {
        rp.n_mtp = w->n_mtp;
        rp.mtp_fp = mtp_fingerprint(w->mtp);
        rp.n_hidden = specdec_hand_floats(w->sd);
        rp.n_hidden_mig = specdec_state_floats(w->sd);
    }
    w->receiver = kvx_receiver_new(w->zctx, w->kv, w->kv_bind, &rp);
    if (!w->receiver)
        return -1; /* logged */
    const char *ep = w->kv_advertise && *w->kv_advertise ? w->kv_advertise
                                                         : kvx_receiver_endpoint(w->receiver);
    snprintf(w->kv_endpoint, sizeof(w->kv_endpoint), "%s", ep);
    if (strstr(w->kv_endpoint, "//0.0.0.0:") || strstr(w->kv_endpoint, "//*:"))
        log_warn("kv endpoint %s is not reachable by peers: set --kv-advertise", w->kv_endpoint);
    log_info("kv socket bound at %s (advertised %s)", kvx_receiver_endpoint(w->receiver),
             w->kv_endpoint);
    return 0;
}

/* The kv sender of a prefill/mixed worker. Returns 0 or -1 (logged). */
static int open_sender(worker_t *w)
{
    kvx_sender_params sp = kvx_sender_default_params();
    sp.fingerprint = w->mc->fingerprint;
    sp.lease_ms = (int)w->lease_ms;
    sp.n_mtp = w->n_mtp;
    sp.pad_to_bytes_per_token = wemu_kv_bytes_per_token(w); /* --emulate: the emulated KV size */
    w->sender = kvx_sender_new(w->zctx, w->kv, &sp);
    if (!w->sender) {
        log_error("cannot create the KV sender");
        return -1;
    }
    return 0;
}

int worker_open_sender(worker_t *w)
{
    return w->sender ? 0 : open_sender(w);
}

static int setup_sockets(worker_t *w)
{
    w->zctx = zmq_ctx_new();
    w->env = wire_envelope_new();
    if (!w->zctx || !w->env)
        return -1;
    w->ctl = zmq_socket(w->zctx, ZMQ_DEALER);
    int one = 1, linger = CTL_LINGER_MS, hwm = CTL_SNDHWM;
    if (!w->ctl || zmq_setsockopt(w->ctl, ZMQ_ROUTING_ID, w->wid, strlen(w->wid)) < 0 ||
        zmq_setsockopt(w->ctl, ZMQ_IMMEDIATE, &one, sizeof(one)) < 0 ||
        zmq_setsockopt(w->ctl, ZMQ_LINGER, &linger, sizeof(linger)) < 0 ||
        zmq_setsockopt(w->ctl, ZMQ_SNDHWM, &hwm, sizeof(hwm)) < 0 ||
        zmq_connect(w->ctl, w->gateway) < 0) {
        log_error("cannot connect the ctl socket to %s: %s", w->gateway, zmq_strerror(zmq_errno()));
        return -1;
    }
    if (w->role != PROTO_ROLE_PREFILL && open_receiver(w) < 0)
        return -1; /* logged */
    if (w->role != PROTO_ROLE_DECODE && open_sender(w) < 0)
        return -1;
    return 0;
}

// --- live role change (docs/scheduler.md "Live role changes")

/* ROLE from the gateway: start draining towards role. Prefill -> decode: no new prompts
 * (sched_on_prefill refuses them; the gateway stopped sending them when it sent ROLE),
 * prompts not started yet go back to the gateway, the batch and its transfers finish. Decode -> prefill: the running sequences, and those whose
 * KV is still arriving, move to other decode workers as the MIGRATE orders that follow say
 * (worker_sched.c); any without an order finish here. role_switch() runs once the worker
 * is idle. */
static void on_role(worker_t *w, int role)
{
    if (role != PROTO_ROLE_PREFILL && role != PROTO_ROLE_DECODE) {
        log_warn("ROLE %s ignored: only prefill <-> decode changes are supported",
                 proto_role_str(role));
        return;
    }
    if (w->draining) {
        log_warn("ROLE %s ignored: this worker is leaving", proto_role_str(role));
        return;
    }
    if (w->role == PROTO_ROLE_MIXED) {
        log_warn("ROLE %s ignored: a mixed worker keeps its role", proto_role_str(role));
        w->registered = 0; /* the gateway learns it did not change */
        heartbeat_tick(w, 1);
        return;
    }
    if (role == (int)w->role) { /* already there, or an order taken back while draining */
        log_info("ROLE %s: already %s%s", proto_role_str(role), proto_role_str(w->role),
                 w->role_target ? " (change called off)" : "");
        w->role_target = 0;
        if (w->receiver)
            kvx_receiver_set_accepting(w->receiver, 1);
        w->registered = 0; /* REGISTER again: the gateway routes to it again */
        heartbeat_tick(w, 1);
        return;
    }
    if (!w->role_target)
        w->role_order_us = proto_now_us();
    w->role_target = (proto_role_t)role;
    if (w->role == PROTO_ROLE_PREFILL) { /* only the batch being computed holds the change */
        int n = sched_hand_back_queued(w);
        if (n)
            log_info("role change: %d queued prompts handed back to the gateway", n);
    }
    /* A decode worker keeps accepting the KV already on its way (the gateway routes nothing
     * new to it): the MIGRATE orders that follow ROLE move those sequences on as they land,
     * which is cheaper than refusing them (a refusal makes the gateway prefill again). */
    log_info("role change %s -> %s ordered: draining (%s)", proto_role_str(w->role),
             proto_role_str(w->role_target),
             w->role == PROTO_ROLE_PREFILL
                 ? "finishing the batch and its transfers"
                 : "no new KV; running sequences move where the gateway orders (MIGRATE), "
                   "the others finish here");
    heartbeat_tick(w, 1); /* state CHANGING right away */
}

/* The drain is complete: become role_target (open the kv socket it needs, close the one it
 * no longer needs) and REGISTER again. When the new socket cannot be opened the worker
 * stays in its role and registers again as it was. */
static void role_switch(worker_t *w)
{
    proto_role_t from = w->role, to = w->role_target;
    w->role_target = 0;
    int ok;
    if (to == PROTO_ROLE_DECODE) {
        ok = open_receiver(w) == 0;
        if (ok) {
            kvx_sender_destroy(&w->sender); /* idle: no transfer holds a sequence */
        }
    } else {
        ok = worker_open_sender(w) == 0; /* it may exist already: migrations */
        if (ok) {
            kvx_receiver_destroy(&w->receiver);
            w->kv_endpoint[0] = 0;
        }
    }
    if (!ok) {
        log_error("role change %s -> %s failed (see above): staying %s", proto_role_str(from),
                  proto_role_str(to), proto_role_str(from));
        if (w->receiver)
            kvx_receiver_set_accepting(w->receiver, 1);
    } else {
        w->role = to;
        char tag[32]; /* log lines name the new role (the pool's threads do not log) */
        snprintf(tag, sizeof(tag), "%s_worker", proto_role_str(to));
        log_init(tag, log_min_level);
        w->role_change_us = proto_now_us() - w->role_order_us;
        w->n_role_changes++;
        log_info("role changed %s -> %s in %.1f ms%s%s", proto_role_str(from), proto_role_str(to),
                 (double)w->role_change_us / 1000.0, w->kv_endpoint[0] ? ": kv at " : "",
                 w->kv_endpoint);
    }
    w->prefill_blocked = 0;
    w->registered = 0; /* REGISTER with the new role (and kv endpoint) */
    heartbeat_tick(w, 1);
}

static void teardown(worker_t *w, int fast)
{
    sched_free_all(w);
    kvx_sender_destroy(&w->sender);
    kvx_receiver_destroy(&w->receiver);
    if (w->ctl) {
        if (fast) {
            int linger = 0;
            zmq_setsockopt(w->ctl, ZMQ_LINGER, &linger, sizeof(linger));
        }
        zmq_close(w->ctl);
    }
    wire_envelope_destroy(&w->env);
    if (w->zctx)
        zmq_ctx_term(w->zctx); /* drops queued zero-copy frames: before the KV cache goes */
    if (w->sigfd > 0)
        close(w->sigfd);
    free(w->logits);
    free(w->batch);
    free(w->batch_reqs);
    sampler_destroy(&w->sampler);
    wmtp_teardown(w);
    model_ctx_destroy(&w->mctx);
    kvcache_destroy(&w->kv);
    model_destroy(&w->model);
}

/* Handle pending signals. Returns 1 when the worker must stop now (second signal). */
static int on_signals(worker_t *w)
{
    struct signalfd_siginfo si;
    int stop = 0;
    while (read(w->sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
        if (w->draining) {
            log_warn("signal %u again: exiting without draining", si.ssi_signo);
            stop = 1;
            continue;
        }
        log_info("signal %u: draining (finishing queued and running work), then leaving",
                 si.ssi_signo);
        w->draining = 1;
        heartbeat_tick(w, 1); /* tell the gateway right away */
    }
    return stop;
}

static void send_bye(worker_t *w)
{
    proto_msg m;
    proto_msg_init(&m, PROTO_BYE);
    snprintf(m.worker_id, sizeof(m.worker_id), "%s", w->wid);
    snprintf(m.message, sizeof(m.message), "drained");
    m.ts_us = proto_wall_us();
    /* EAGAIN: the gateway is already gone (the launcher stops it first): nothing to tell */
    if (ctl_send(w, &m) < 0)
        LOG_AT(errno == EAGAIN ? LOG_LEVEL_INFO : LOG_LEVEL_WARN, 0, "BYE not sent: %s",
               errno == EAGAIN ? "the gateway is not connected" : zmq_strerror(errno));
}

static int min_timeout(int a, int b)
{
    if (a < 0)
        return b;
    if (b < 0)
        return a;
    return a < b ? a : b;
}

/* The loop. Returns the exit status. */
static int run(worker_t *w)
{
    zmq_pollitem_t items[MAX_POLL_ITEMS];
    int last_free = kvcache_n_free_blocks(w->kv);
    heartbeat_tick(w, 1);
    for (;;) {
        int n = 0;
        items[n++] = (zmq_pollitem_t){.socket = w->ctl, .events = ZMQ_POLLIN};
        items[n++] = (zmq_pollitem_t){.socket = NULL, .fd = w->sigfd, .events = ZMQ_POLLIN};
        if (w->receiver)
            items[n++] =
                (zmq_pollitem_t){.socket = kvx_receiver_socket(w->receiver), .events = ZMQ_POLLIN};
        if (w->sender)
            n += kvx_sender_pollitems(w->sender, items + n, MAX_POLL_ITEMS - n);
        int timeout = 0;
        if (!sched_has_work(w)) {
            int64_t until_hb = (w->next_hb_us - proto_now_us() + 999) / 1000;
            timeout = until_hb < 0 ? 0 : (int)until_hb;
            if (w->sender)
                timeout = min_timeout(timeout, kvx_sender_next_timeout_ms(w->sender));
            if (w->receiver)
                timeout = min_timeout(timeout, kvx_receiver_next_timeout_ms(w->receiver));
        }
        if (zmq_poll(items, n, timeout) < 0) {
            if (zmq_errno() == EINTR)
                continue;
            log_error("zmq_poll: %s", zmq_strerror(zmq_errno()));
            return 1;
        }
        if (on_signals(w))
            return 1;
        for (int i = 0; i < CTL_MAX_MSGS_PER_ITER; i++) {
            int rc = wire_recv(w->ctl, 0, w->env, ZMQ_DONTWAIT);
            if (rc == 0)
                break;
            if (rc == -2) {
                log_error("ctl recv: %s", zmq_strerror(errno));
                break;
            }
            if (rc == 1)
                on_ctl(w, wire_envelope_msg(w->env), wire_envelope_n_frames(w->env));
        }
        wire_envelope_reset(w->env);
        if (w->receiver)
            kvx_receiver_process(w->receiver);
        if (w->sender)
            kvx_sender_process(w->sender);
        sched_on_kvx_events(w);
        int free_now = kvcache_n_free_blocks(w->kv);
        if (free_now != last_free) {
            w->prefill_blocked = 0; /* KV was freed (or taken): let the queue try again */
            last_free = free_now;
        }
        if (w->role_target && !w->draining && sched_idle(w))
            role_switch(w);
        heartbeat_tick(w, 0);
        if (w->draining && sched_idle(w)) {
            log_info("drained: leaving");
            send_bye(w);
            return 0;
        }
        int worked = sched_prefill_step(w);
        worked |= sched_decode_step(w);
        if (worked && w->debug_step_delay_ms > 0) /* tests: make requests last */
            usleep((useconds_t)w->debug_step_delay_ms * 1000);
    }
}

int worker_main(proto_role_t default_role, int argc, char **argv)
{
    worker_t w;
    memset(&w, 0, sizeof(w));
    w.sigfd = -1;
    const config_entry_t table[] = {
        {"gateway", CONFIG_STRING, &w.gateway, "tcp://127.0.0.1:5557", 0, 0,
         "gateway ctl endpoint to connect to"},
        {"model", CONFIG_STRING, &w.model_path, "build/models/stories260K.gguf", 0, 0,
         "GGUF model file"},
        {"worker-id", CONFIG_STRING, &w.worker_id, NULL, 0, 0,
         "worker id, also its ctl routing id (unset: <role>-<hostname>-<pid>)"},
        {"role", CONFIG_STRING, &w.role_name, NULL, 0, 0,
         "prefill | decode | mixed (unset: the program's own role)"},
        {"kv-bind", CONFIG_STRING, &w.kv_bind, "tcp://127.0.0.1:5560", 0, 0,
         "decode/mixed: kv socket to bind (tcp://HOST:* picks a free port); a prefill worker "
         "binds it when it changes to decode (ROLE)"},
        {"kv-advertise", CONFIG_STRING, &w.kv_advertise, NULL, 0, 0,
         "decode/mixed: kv endpoint announced to the gateway (unset: the bound one)"},
        {"kv-blocks", CONFIG_INT, &w.kv_blocks, "0", 0, 1e9,
         "KV cache blocks (0 = max-seqs full contexts)"},
        {"block-size", CONFIG_INT, &w.block_size, "16", 1, 4096, "tokens per KV block"},
        {"max-seqs", CONFIG_INT, &w.max_seqs, "64", 1, 65536,
         "sequences in the KV cache (running plus in transfer) and per batch"},
        {"max-batch-tokens", CONFIG_INT, &w.max_batch_tokens, "2048", 1, 1 << 24,
         "prompt tokens per prefill forward pass, over every prompt of the batch"},
        {"prefill-chunk-tokens", CONFIG_INT, &w.prefill_chunk_tokens, "512", 1, 1 << 24,
         "prompt tokens of one sequence per forward pass: a longer prompt is computed in "
         "chunks, one per loop iteration"},
        {"threads", CONFIG_INT, &w.threads, "0", 0, 1024,
         "compute threads, the loop thread included (0 = the CPUs this process may use)"},
        {"mtp", CONFIG_STRING, &w.mtp_setting, "auto", 0, 0,
         "MTP modules: auto (the model file's, else models/mtp/<name>-mtp.gguf beside the "
         "model, in the working directory or the build's repository) | none | a side file"},
        {"mtp-depth", CONFIG_INT, &w.mtp_depth_set, "-1", -1, 2,
         "MTP drafts per decode step at most, and the default of requests (-1 = 2 when "
         "modules are loaded; 0 = off); the worker lowers it when it does not pay"},
        {"mtp-adaptive", CONFIG_BOOL, &w.mtp_adaptive, "true", 0, 0,
         "lower a sequence's MTP depth when its acceptance and the batch size make "
         "verification not pay (docs/mtp.md); off: always --mtp-depth"},
        {"mtp-sampling", CONFIG_STRING, &w.mtp_sampling, "rejection", 0, 0,
         "MTP with temperature > 0: rejection (drafts sampled from the modules, speculative "
         "rejection sampling) | onehot (argmax drafts: seeded output identical at any depth)"},
        {"heartbeat-ms", CONFIG_INT, &w.heartbeat_ms, "500", 10, 3600000,
         "heartbeat interval until the gateway sets one"},
        {"lease-ms", CONFIG_INT, &w.lease_ms, "5000", 10, 3600000,
         "KV transfer lease: silence after which a transfer is aborted"},
        {"emulate", CONFIG_STRING, &w.emulate, "", 0, 0,
         "emulated accelerator: a cost-model preset (a100-llama3-8b, h100-llama3-8b; "
         "PRESET:dilate=K runs it K times slower): each prefill/decode step is padded to "
         "its time and each KV transfer to its bytes; tokens come from the real model; MTP "
         "off (docs/scheduler.md); \"\" = real compute"},
        {"debug-step-delay-ms", CONFIG_INT, &w.debug_step_delay_ms, "0", 0, 10000,
         "testing only: sleep this long after every compute step"},
        {"log-level", CONFIG_STRING, &w.log_level, "info", 0, 0, "debug | info | warn | error"},
        {NULL, 0, NULL, NULL, 0, 0, NULL},
    };
    const char *program = default_role == PROTO_ROLE_DECODE ? "decode_worker" : "prefill_worker";
    int rc = config_load(table, program, argc, argv);
    if (rc != 0) {
        config_free(table);
        return rc == 1 ? 0 : 2;
    }
    rc = 2;
    w.role = default_role;
    log_level_t level;
    if (w.role_name && *w.role_name && proto_role_parse(w.role_name, &w.role) < 0) {
        fprintf(stderr, "%s: invalid --role '%s': want prefill, decode or mixed\n", program,
                w.role_name);
        goto out;
    }
    if (w.mtp_sampling && strcmp(w.mtp_sampling, "rejection") != 0 &&
        strcmp(w.mtp_sampling, "onehot") != 0) {
        fprintf(stderr, "%s: invalid --mtp-sampling '%s': want rejection or onehot\n", program,
                w.mtp_sampling);
        goto out;
    }
    if (log_level_parse(w.log_level, &level) < 0) {
        fprintf(stderr, "%s: invalid --log-level '%s'\n", program, w.log_level);
        goto out;
    }
    char log_role[32];
    snprintf(log_role, sizeof(log_role), "%s_worker", proto_role_str(w.role));
    log_init(log_role, level);
    if (w.worker_id && *w.worker_id) {
        if (strlen(w.worker_id) >= PROTO_ID_LEN) {
            log_error("--worker-id is longer than %d bytes", PROTO_ID_LEN - 1);
            goto out;
        }
        snprintf(w.wid, sizeof(w.wid), "%s", w.worker_id);
    } else {
        char host[256] = "localhost";
        gethostname(host, sizeof(host) - 1);
        snprintf(w.wid, sizeof(w.wid), "%s-%.40s-%d", proto_role_str(w.role), host, (int)getpid());
    }
    w.hb_ms = (int)w.heartbeat_ms;
    config_log(table);

    /* Signals go to the signalfd only: block them before any thread (zmq's) exists. */
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    signal(SIGPIPE, SIG_IGN);
    if (sigprocmask(SIG_BLOCK, &mask, NULL) < 0 ||
        (w.sigfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC)) < 0) {
        log_error("signalfd: %s", strerror(errno));
        rc = 1;
        goto out;
    }
    if (wemu_setup(&w) < 0) {
        rc = 2;
        goto out;
    }
    if (w.emu_on)
        w.mtp_depth_set = 0; /* the cost model emits one token per sequence per step */
    if (setup_model(&w) < 0 || setup_sockets(&w) < 0) {
        rc = 1;
        teardown(&w, 1);
        goto out;
    }
    log_info("worker %s (%s) up: gateway %s, pid %d", w.wid, proto_role_str(w.role), w.gateway,
             (int)getpid());
    rc = run(&w);
    teardown(&w, rc != 0);
    log_info("exit %d", rc);
out:
    config_free(table);
    return rc;
}
