/*
 * bench_kvtransfer: the KV hand-off between two processes, against raw ZeroMQ, and how much
 * of a long prompt's transfer hides behind its prefill.
 *
 *   bench_kvtransfer [--quick] [--threads N] [--chunk N] [MODEL.gguf]
 *
 * 1. Throughput. The receiver is a forked child (kvx_receiver_t into its own kvcache);
 *    the parent sends with kvx_sender_t from a kvcache of the synthetic 1B-class layout
 *    (22 layers, 4 KV heads x 64, blocks of 16 tokens): one 1024-token prompt is 64 blocks
 *    per layer, 46.1 MB. A transfer is timed from kvx_send_begin() to the DONE event (the
 *    receiver verified the checksum and answered KV_RESULT ok), median of a few after a
 *    warm-up one. Next to it, raw ZeroMQ for the same bytes: a DEALER sends to a ROUTER in
 *    the child one multipart message per layer (a small header frame, then 64 zero-copy
 *    frames of one block each, pointing into the same pool), and the child answers one
 *    small frame after the last layer; timed from the first send to that answer. Over
 *    tcp://127.0.0.1 and ipc:// (a temp dir). kvx/raw is what the protocol costs: XXH64 on
 *    both sides, the receiver's copy into its blocks, and the messages around the layers.
 *
 * 1b. CURVE. The same kvx transfers to two receiving children, one plain and one a CURVE
 *    server (its ZAP handler admitting the sender's key: docs/security.md), from a plain
 *    and a CURVE sender, alternating plain / CURVE in one run (ABBA order, so that neither
 *    side always goes first on a shared machine); curve/plain is the throughput CURVE
 *    keeps (its cost: libsodium's XSalsa20-Poly1305 on every frame, both sides).
 *
 * 2. Overlap. With MODEL.gguf (a mid-size synthetic model made by tidepool-mkmodel, see
 *    tests/run_bench.sh) and a receiver child over tcp: (a) prefill of a prompt alone;
 *    (b) transfer alone of the same KV after the prefill; (c) prefill with the worker's
 *    layer-by-layer transfer (KV_BEGIN first, each layer's blocks handed to kvx from the
 *    forward pass's layer callback, KV_END after the last layer) until the receiver
 *    accepted. Hidden fraction = (a + b - c) / b: 1 when the transfer is entirely behind
 *    the compute, 0 when it adds its whole time. With one pass the last layer's transfer
 *    cannot hide (at best 1 - 1/n_layer). Then the same with the prompt in chunks of
 *    --chunk tokens, as a prefill worker computes it, each chunk sending the blocks it
 *    completed: (a') and (c') are (a) and (c) in chunks (smaller matrix products are
 *    slower, so c' is compared with a'); only the last chunk's last layer is exposed.
 *    Each (c) is also split: the tail from the end of the forward pass to the receiver's
 *    acceptance is the transfer time not hidden (1 - tail/b would be the hidden fraction
 *    if the transfer did not slow the compute), and c - tail - a is what the transfer
 *    (ZeroMQ's I/O thread, hashing, the receiver on the same machine) took from the
 *    compute. Compute threads default to the CPUs available minus one (at least one), so
 *    the receiving process and the I/O threads have a core, as when prefill and decode
 *    run on different hosts; --threads sets them.
 *
 * Numbers are ratios within one run on one (possibly shared) machine. The CPUs this
 * process may use (sched_getaffinity) and the CPU time / wall time of each measurement
 * are printed: sender, receiver, ZeroMQ I/O threads and compute threads share them.
 */
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "curve.h"
#include "kvcache.h"
#include "kvtransfer.h"
#include "log.h"
#include "model.h"
#include "protocol.h"

#define SYN_LAYERS 22
#define SYN_KV_HEADS 4
#define SYN_HEAD_DIM 64
#define SYN_BLOCK 16
#define SYN_TOKENS 1024
#define FP 0x74696465706f6f6cull /* any: both sides use it */
#define WAIT_MS 60000            /* give up on a transfer after this long */

typedef struct {
    int n_layer, n_kv_head, head_dim, block_size;
    int n_tokens; /* prompt tokens whose KV is sent */
    int max_len;  /* kvcache max_seq_len */
    uint64_t fp;
} layout;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* CPU seconds this process used (all threads). */
static double cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

static int cpus_available(void)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static kvcache_t *mk_cache(const layout *l, int n_blocks)
{
    kvcache_params p = {.n_layer = l->n_layer,
                        .n_kv_head = l->n_kv_head,
                        .head_dim = l->head_dim,
                        .block_size = l->block_size,
                        .n_blocks = n_blocks,
                        .max_seqs = 4,
                        .max_seq_len = l->max_len};
    return kvcache_new(&p);
}

static uint64_t kv_bytes(const layout *l)
{
    uint64_t blocks = (uint64_t)((l->n_tokens + l->block_size - 1) / l->block_size);
    return (uint64_t)l->n_layer * blocks * 2u * (uint64_t)l->block_size * (uint64_t)l->n_kv_head *
           (uint64_t)l->head_dim * sizeof(float);
}

// --- the receiving child

typedef enum { RX_KVX, RX_RAW } rx_mode;

typedef struct {
    pid_t pid;
    int stop_fd; /* parent's end: closing it tells the child to exit */
    char endpoint[PROTO_ENDPOINT_LEN];
} child_t;

/* CURVE set-up of a receiving child (NULL: plain): its key pair and the one sender key
 * its ZAP handler admits. */
typedef struct {
    curve_keypair server;
    char client_public[CURVE_Z85_LEN + 1];
} curve_rx;

/* The child's loop: receive until the parent closes stop_fd. RX_KVX: a kvx receiver that
 * frees every accepted sequence (a CURVE server when cv). RX_RAW: a ROUTER that reads
 * whole messages and answers "ok" after every n_layer of them. Never returns. */
static void child_run(rx_mode mode, const layout *l, const char *bind, int ep_fd, int stop_fd,
                      const curve_rx *cv)
{
    void *z = zmq_ctx_new();
    void *sock = NULL;
    kvcache_t *kv = NULL;
    kvx_receiver_t *r = NULL;
    curve_zap_t *zap = NULL;
    char ep[PROTO_ENDPOINT_LEN] = "";
    if (cv) {
        char err[256];
        curve_authlist_t *auth = NULL;
        if (curve_authlist_parse(&auth, cv->client_public, CURVE_Z85_LEN, "bench", err,
                                 sizeof(err)) < 0 ||
            !(zap = curve_zap_start(z, &auth, err, sizeof(err)))) {
            fprintf(stderr, "bench_kvtransfer: receiver: %s\n", err);
            _exit(1);
        }
    }
    if (mode == RX_KVX) {
        kv = mk_cache(l, 2 * ((l->n_tokens + l->block_size - 1) / l->block_size));
        kvx_receiver_params p = kvx_receiver_default_params();
        p.fingerprint = l->fp;
        p.lease_ms = WAIT_MS;
        p.curve = cv ? &cv->server : NULL;
        r = kv ? kvx_receiver_new(z, kv, bind, &p) : NULL;
        if (r)
            snprintf(ep, sizeof(ep), "%s", kvx_receiver_endpoint(r));
        sock = r ? kvx_receiver_socket(r) : NULL;
    } else {
        sock = zmq_socket(z, ZMQ_ROUTER);
        int hwm = 0, linger = 0;
        size_t len = sizeof(ep);
        zmq_setsockopt(sock, ZMQ_RCVHWM, &hwm, sizeof(hwm));
        zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof(linger));
        if (zmq_bind(sock, bind) < 0 || zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, ep, &len) < 0)
            ep[0] = 0;
    }
    if (write(ep_fd, ep, sizeof(ep)) != (ssize_t)sizeof(ep) || !ep[0])
        _exit(1);
    close(ep_fd);
    int n_msgs = 0;
    zmq_msg_t id, part;
    zmq_msg_init(&id);
    zmq_msg_init(&part);
    for (;;) {
        zmq_pollitem_t it[2] = {{sock, 0, ZMQ_POLLIN, 0}, {NULL, stop_fd, ZMQ_POLLIN, 0}};
        if (zmq_poll(it, 2, 1000) < 0 && zmq_errno() != EINTR)
            break;
        if (it[1].revents)
            break; /* EOF: the parent is done */
        if (mode == RX_KVX) {
            kvx_receiver_process(r);
            kvx_event ev;
            while (kvx_receiver_next_event(r, &ev)) {
                if (ev.type == KVX_EV_ACCEPTED)
                    kvcache_seq_free(kv, ev.seq);
                else
                    fprintf(stderr, "bench_kvtransfer: receiver: transfer failed: %s\n",
                            ev.message);
            }
            continue;
        }
        /* raw: drain whole messages without blocking */
        while (zmq_msg_recv(&id, sock, ZMQ_DONTWAIT) >= 0) {
            int more = 1;
            while (more) {
                zmq_msg_recv(&part, sock, 0);
                more = zmq_msg_more(&part);
            }
            if (++n_msgs % l->n_layer == 0) {
                zmq_msg_t reply;
                zmq_msg_init(&reply);
                zmq_msg_copy(&reply, &id);
                zmq_msg_send(&reply, sock, ZMQ_SNDMORE);
                zmq_send(sock, "ok", 2, 0);
            }
        }
    }
    zmq_msg_close(&id);
    zmq_msg_close(&part);
    if (mode == RX_KVX)
        kvx_receiver_destroy(&r);
    else
        zmq_close(sock);
    curve_zap_stop(&zap);
    zmq_ctx_term(z);
    kvcache_destroy(&kv);
    _exit(0);
}

/* Fork a receiving child bound at bind (a CURVE server when cv); its bound endpoint comes
 * back in c->endpoint. Call with no zmq context and no compute threads alive in this
 * process. */
static int child_start_curve(child_t *c, rx_mode mode, const layout *l, const char *bind,
                             const curve_rx *cv)
{
    int ep_pipe[2], stop_pipe[2];
    if (pipe(ep_pipe) < 0 || pipe(stop_pipe) < 0)
        return -1;
    fflush(stdout);
    fflush(stderr);
    c->pid = fork();
    if (c->pid < 0)
        return -1;
    if (c->pid == 0) {
        close(ep_pipe[0]);
        close(stop_pipe[1]);
        child_run(mode, l, bind, ep_pipe[1], stop_pipe[0], cv);
    }
    close(ep_pipe[1]);
    close(stop_pipe[0]);
    c->stop_fd = stop_pipe[1];
    ssize_t n = read(ep_pipe[0], c->endpoint, sizeof(c->endpoint));
    close(ep_pipe[0]);
    if (n != (ssize_t)sizeof(c->endpoint) || !c->endpoint[0]) {
        fprintf(stderr, "bench_kvtransfer: the receiver could not bind %s\n", bind);
        close(c->stop_fd);
        waitpid(c->pid, NULL, 0);
        return -1;
    }
    return 0;
}

static int child_start(child_t *c, rx_mode mode, const layout *l, const char *bind)
{
    return child_start_curve(c, mode, l, bind, NULL);
}

static int child_stop(child_t *c)
{
    int status = 0;
    close(c->stop_fd);
    waitpid(c->pid, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : -1;
}

// --- sending with kvx

typedef struct {
    void *zctx;
    kvcache_t *kv;
    kvx_sender_t *s;
    const char *endpoint;
    const char *server_key; /* CURVE: the receiver's public key (NULL: plain) */
    int seq;
    uint64_t xfer;
    int blk_sent, blk_upto; /* chunked sends: the blocks of the current chunk */
    double t_fwd_end;       /* when the last forward pass of an overlapped run ended */
} sender_t;

/* A sender to endpoint; with kp (and server_key, the receiver's public key) a CURVE one. */
static int sender_open_curve(sender_t *sd, kvcache_t *kv, const char *endpoint, uint64_t fp,
                             const curve_keypair *kp, const char *server_key)
{
    memset(sd, 0, sizeof(*sd));
    sd->zctx = zmq_ctx_new();
    sd->kv = kv;
    sd->endpoint = endpoint;
    sd->server_key = server_key;
    kvx_sender_params p = kvx_sender_default_params();
    p.fingerprint = fp;
    p.lease_ms = WAIT_MS;
    p.curve = kp;
    sd->s = kvx_sender_new(sd->zctx, kv, &p);
    return sd->s ? 0 : -1;
}

static int sender_open(sender_t *sd, kvcache_t *kv, const char *endpoint, uint64_t fp)
{
    return sender_open_curve(sd, kv, endpoint, fp, NULL, NULL);
}

static void sender_close(sender_t *sd)
{
    kvx_sender_destroy(&sd->s);
    zmq_ctx_term(sd->zctx);
}

/* A sequence of n_tokens tokens (capacity reserved, length set), or -1. */
static int seq_make(kvcache_t *kv, int n_tokens)
{
    int seq = kvcache_seq_new(kv);
    if (seq < 0 || kvcache_seq_reserve(kv, seq, n_tokens) != KVCACHE_OK)
        return -1;
    kvcache_seq_set_len(kv, seq, n_tokens);
    return seq;
}

static int xfer_begin(sender_t *sd, int seq, int n_tokens)
{
    kvx_begin_params bp = {.rid = 1,
                           .seq = seq,
                           .n_kv_tokens = n_tokens,
                           .max_tokens = 1,
                           .top_p = 1.0f,
                           .server_key = sd->server_key};
    sd->seq = seq;
    sd->xfer = kvx_send_begin(sd->s, sd->endpoint, &bp);
    sd->blk_sent = sd->blk_upto = 0;
    return sd->xfer ? 0 : -1;
}

/* Wait for the transfer's outcome: 0 on DONE (the receiver accepted), -1 on failure. */
static int xfer_wait(sender_t *sd)
{
    double t_end = now_s() + WAIT_MS / 1000.0;
    while (now_s() < t_end) {
        kvx_event ev;
        kvx_sender_process(sd->s);
        if (kvx_sender_next_event(sd->s, &ev)) {
            if (ev.type == KVX_EV_DONE)
                return 0;
            fprintf(stderr, "bench_kvtransfer: transfer failed: %s\n", ev.message);
            return -1;
        }
        zmq_pollitem_t it[8];
        zmq_poll(it, kvx_sender_pollitems(sd->s, it, 8), 1);
    }
    return -1;
}

/* The sequence is freed by kvx once ZeroMQ released its frames: wait for that. */
static void xfer_release(sender_t *sd)
{
    for (int i = 0; i < 20000 && kvx_sender_n_active(sd->s) > 0; i++) {
        kvx_sender_process(sd->s);
        usleep(100);
    }
}

/* One whole transfer of seq's n_tokens; returns seconds from KV_BEGIN to DONE, or -1. */
static double kvx_once(sender_t *sd, int n_tokens, int n_layer)
{
    int seq = seq_make(sd->kv, n_tokens);
    if (seq < 0)
        return -1;
    double t0 = now_s();
    if (xfer_begin(sd, seq, n_tokens) < 0) {
        kvcache_seq_free(sd->kv, seq);
        return -1;
    }
    for (int l = 0; l < n_layer; l++)
        kvx_send_layer(sd->s, sd->xfer, l);
    kvx_send_end(sd->s, sd->xfer, 1, 1);
    int rc = xfer_wait(sd);
    double dt = now_s() - t0;
    xfer_release(sd);
    return rc == 0 ? dt : -1;
}

// --- raw ZeroMQ

static void frame_free(void *data, void *hint)
{
    (void)data;
    atomic_fetch_sub_explicit((atomic_int *)hint, 1, memory_order_relaxed);
}

/* One "transfer" of seq's blocks as n_layer multipart messages; seconds to the answer. */
static double raw_once(void *dealer, kvcache_t *kv, int seq, int n_blocks, int n_layer,
                       atomic_int *pins)
{
    const int *blocks = kvcache_seq_blocks(kv, seq, NULL);
    size_t bytes = kvcache_block_bytes(kv);
    char hdr[64];
    memset(hdr, 'h', sizeof(hdr));
    double t0 = now_s();
    for (int l = 0; l < n_layer; l++) {
        if (zmq_send(dealer, hdr, sizeof(hdr), ZMQ_SNDMORE) < 0)
            return -1;
        for (int b = 0; b < n_blocks; b++) {
            zmq_msg_t m;
            atomic_fetch_add_explicit(pins, 1, memory_order_relaxed);
            zmq_msg_init_data(&m, kvcache_block_data(kv, l, blocks[b]), bytes, frame_free, pins);
            if (zmq_msg_send(&m, dealer, b + 1 < n_blocks ? ZMQ_SNDMORE : 0) < 0)
                return -1;
        }
    }
    char ok[4];
    if (zmq_recv(dealer, ok, sizeof(ok), 0) != 2)
        return -1;
    double dt = now_s() - t0;
    while (atomic_load(pins) > 0) /* frames released before the blocks are reused */
        usleep(50);
    return dt;
}

// --- part 1: throughput

static void fill_random(kvcache_t *kv, int n_blocks, int n_layer)
{
    uint64_t x = 0x9e3779b97f4a7c15ull;
    size_t n = kvcache_block_bytes(kv) / sizeof(float);
    for (int l = 0; l < n_layer; l++)
        for (int b = 0; b < n_blocks; b++) {
            float *d = kvcache_block_data(kv, l, b);
            for (size_t i = 0; i < n; i++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                d[i] = (float)(int64_t)(x >> 40) * 1e-6f;
            }
        }
}

/* Median seconds of reps transfers (after one warm-up) over bind, kvx or raw; cores in *cu. */
static double measure(rx_mode mode, const layout *l, const char *bind, int reps, double *cu)
{
    child_t c;
    if (child_start(&c, mode, l, bind) < 0)
        return -1;
    int n_blocks = (l->n_tokens + l->block_size - 1) / l->block_size;
    kvcache_t *kv = mk_cache(l, 2 * n_blocks);
    double times[32], wall = 0, cpu0 = 0;
    int ok = kv != NULL;
    if (ok)
        fill_random(kv, 2 * n_blocks, l->n_layer);
    if (mode == RX_KVX && ok) {
        sender_t sd;
        ok = sender_open(&sd, kv, c.endpoint, l->fp) == 0;
        for (int i = 0; ok && i <= reps; i++) {
            if (i == 1)
                cpu0 = cpu_s();
            double t = kvx_once(&sd, l->n_tokens, l->n_layer);
            ok = t > 0;
            if (i > 0) {
                times[i - 1] = t;
                wall += t;
            }
        }
        sender_close(&sd);
    } else if (ok) {
        void *z = zmq_ctx_new();
        void *d = zmq_socket(z, ZMQ_DEALER);
        int hwm = 0, linger = 0;
        zmq_setsockopt(d, ZMQ_SNDHWM, &hwm, sizeof(hwm));
        zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof(linger));
        atomic_int pins;
        atomic_init(&pins, 0);
        int seq = seq_make(kv, l->n_tokens);
        ok = seq >= 0 && zmq_connect(d, c.endpoint) == 0;
        for (int i = 0; ok && i <= reps; i++) {
            if (i == 1)
                cpu0 = cpu_s();
            double t = raw_once(d, kv, seq, n_blocks, l->n_layer, &pins);
            ok = t > 0;
            if (i > 0) {
                times[i - 1] = t;
                wall += t;
            }
        }
        zmq_close(d);
        zmq_ctx_term(z);
    }
    *cu = ok && wall > 0 ? (cpu_s() - cpu0) / wall : 0;
    kvcache_destroy(&kv);
    if (child_stop(&c) < 0)
        ok = 0;
    return ok ? median(times, reps) : -1;
}

static int bench_throughput(int reps)
{
    layout l = {SYN_LAYERS, SYN_KV_HEADS, SYN_HEAD_DIM, SYN_BLOCK, SYN_TOKENS, 2048, FP};
    double mb = (double)kv_bytes(&l) / 1e6;
    printf("KV transfer throughput, two processes: synthetic 1B-class layout (%d layers, %d KV "
           "heads x %d, blocks of %d tokens), %d-token prompt = %d blocks per layer, %.1f MB; "
           "median of %d after a warm-up\n",
           l.n_layer, l.n_kv_head, l.head_dim, l.block_size, l.n_tokens, l.n_tokens / l.block_size,
           mb, reps);
    printf("  transport    kvx GB/s (ms)       raw ZeroMQ GB/s (ms)  kvx/raw   [sender cores "
           "kvx / raw]\n");
    char dir[] = "/tmp/tidepool-bench-XXXXXX";
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    char ipc[128];
    snprintf(ipc, sizeof(ipc), "ipc://%s/kv", dir);
    const char *names[2] = {"tcp", "ipc"};
    const char *binds[2] = {"tcp://127.0.0.1:*", ipc};
    int rc = 0;
    for (int t = 0; t < 2; t++) {
        double ck = 0, cr = 0;
        double tk = measure(RX_KVX, &l, binds[t], reps, &ck);
        double tr = measure(RX_RAW, &l, binds[t], reps, &cr);
        if (tk <= 0 || tr <= 0) {
            printf("  %-10s failed\n", names[t]);
            rc = 1;
            continue;
        }
        printf("  %-10s %6.2f (%6.1f)     %6.2f (%6.1f)        %5.2f     [%.1f / %.1f]\n", names[t],
               mb / 1e3 / tk, tk * 1e3, mb / 1e3 / tr, tr * 1e3, tr / tk, ck, cr);
        fflush(stdout);
    }
    char sock[160];
    snprintf(sock, sizeof(sock), "%s/kv", dir);
    unlink(sock);
    rmdir(dir);
    return rc;
}

// --- part 1b: CURVE

/* Plain and CURVE kvx transfers to receivers bound at bind_plain and bind_curve,
 * alternating (ABBA), reps each after a warm-up of each. Prints one line; returns 0, or 1
 * when a transfer failed. */
static int bench_curve_one(const layout *l, const char *name, const char *bind_plain,
                           const char *bind_curve, int reps)
{
    char err[256];
    curve_keypair client;
    curve_rx cv;
    if (curve_keypair_new(&cv.server, err, sizeof(err)) < 0 ||
        curve_keypair_new(&client, err, sizeof(err)) < 0) {
        printf("  %-10s skipped: %s\n", name, err);
        return 0;
    }
    snprintf(cv.client_public, sizeof(cv.client_public), "%s", client.public_z85);
    child_t cp, cc;
    if (child_start_curve(&cp, RX_KVX, l, bind_plain, NULL) < 0)
        return 1;
    if (child_start_curve(&cc, RX_KVX, l, bind_curve, &cv) < 0) {
        child_stop(&cp);
        return 1;
    }
    int n_blocks = (l->n_tokens + l->block_size - 1) / l->block_size;
    kvcache_t *kv = mk_cache(l, 2 * n_blocks);
    sender_t sp = {0}, sc = {0};
    double tp[32], tc[32], wall[2] = {0}, cpu[2] = {0};
    int ok = kv && sender_open(&sp, kv, cp.endpoint, l->fp) == 0 &&
             sender_open_curve(&sc, kv, cc.endpoint, l->fp, &client, cv.server.public_z85) == 0;
    if (ok)
        fill_random(kv, 2 * n_blocks, l->n_layer);
    for (int i = 0; ok && i <= reps; i++) {
        for (int k = 0; k < 2 && ok; k++) {
            int curve = (i % 2) ^ k; /* ABBA: plain first on even rounds, CURVE on odd */
            double c0 = cpu_s();
            double t = kvx_once(curve ? &sc : &sp, l->n_tokens, l->n_layer);
            ok = t > 0;
            if (i > 0) { /* round 0 warms up both (connects, handshakes) */
                (curve ? tc : tp)[i - 1] = t;
                wall[curve] += t;
                cpu[curve] += cpu_s() - c0;
            }
        }
    }
    if (sp.s)
        sender_close(&sp);
    if (sc.s)
        sender_close(&sc);
    kvcache_destroy(&kv);
    /* cc first: it holds a copy of cp's stop pipe (forked after it) */
    if (child_stop(&cc) < 0)
        ok = 0;
    if (child_stop(&cp) < 0)
        ok = 0;
    memset(&client, 0, sizeof(client));
    if (!ok) {
        printf("  %-10s failed\n", name);
        return 1;
    }
    double mb = (double)kv_bytes(l) / 1e6, a = median(tp, reps), b = median(tc, reps);
    printf("  %-10s %6.2f (%6.1f)     %6.2f (%6.1f)         %5.2f     [%.1f / %.1f]\n", name,
           mb / 1e3 / a, a * 1e3, mb / 1e3 / b, b * 1e3, a / b, cpu[0] / wall[0],
           cpu[1] / wall[1]);
    fflush(stdout);
    return 0;
}

static int bench_curve(int reps)
{
    layout l = {SYN_LAYERS, SYN_KV_HEADS, SYN_HEAD_DIM, SYN_BLOCK, SYN_TOKENS, 2048, FP};
    printf("\nKV transfer with and without CURVE (the same %.1f MB transfers, alternating plain "
           "/ CURVE; median of %d each after a warm-up)\n",
           (double)kv_bytes(&l) / 1e6, reps);
    printf("  transport  plain GB/s (ms)     CURVE GB/s (ms)      curve/plain  [sender cores "
           "plain / CURVE]\n");
    char dir[] = "/tmp/tidepool-bench-XXXXXX";
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    char ipc[2][128], sock[128];
    snprintf(ipc[0], sizeof(ipc[0]), "ipc://%s/kv-plain", dir);
    snprintf(ipc[1], sizeof(ipc[1]), "ipc://%s/kv-curve", dir);
    int rc = bench_curve_one(&l, "tcp", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", reps);
    rc |= bench_curve_one(&l, "ipc", ipc[0], ipc[1], reps);
    for (int k = 0; k < 2; k++) {
        snprintf(sock, sizeof(sock), "%s/kv-%s", dir, k ? "curve" : "plain");
        unlink(sock);
    }
    rmdir(dir);
    return rc;
}

// --- part 2: overlap with a real prefill

/* The worker's layer callback: hand kvx the blocks this chunk completed in `layer`. */
static void on_layer(int layer, void *ud)
{
    sender_t *sd = ud;
    if (sd->blk_upto > sd->blk_sent)
        kvx_send_layer_blocks(sd->s, sd->xfer, layer, sd->blk_sent, sd->blk_upto - sd->blk_sent);
}

typedef struct {
    model_ctx_t *ctx;
    kvcache_t *kv;
    const int *toks;
    float *logits;
    int n_tokens, block_size;
} prefill_t;

/* Prefill the prompt into seq in chunks of `chunk` tokens; with sd, transfer as the worker
 * does (sd->xfer begun). Returns 0 or -1. */
static int prefill(prefill_t *p, int seq, int chunk, sender_t *sd)
{
    for (int pos = 0; pos < p->n_tokens; pos += chunk) {
        int n = p->n_tokens - pos < chunk ? p->n_tokens - pos : chunk;
        model_seq_batch it = {.seq = seq,
                              .pos = pos,
                              .n_tokens = n,
                              .tokens = p->toks + pos,
                              .logits_all = 0,
                              .logits = p->logits};
        if (sd) {
            sd->blk_upto = pos + n == p->n_tokens
                               ? (p->n_tokens + p->block_size - 1) / p->block_size
                               : (pos + n) / p->block_size;
        }
        if (model_forward(p->ctx, p->kv, &it, 1, sd ? on_layer : NULL, sd) < 0)
            return -1;
        if (sd)
            sd->blk_sent = sd->blk_upto;
    }
    if (sd)
        sd->t_fwd_end = now_s();
    return 0;
}

static int bench_overlap(const char *path, int reps, int n_threads, int chunk, int quick)
{
    char err[512];
    model_t *m = model_load(path, err, sizeof(err));
    if (!m) {
        fprintf(stderr, "bench_kvtransfer: %s\n", err);
        return 1;
    }
    const model_config *c = model_get_config(m);
    int n_tokens = c->n_ctx < SYN_TOKENS ? c->n_ctx : SYN_TOKENS;
    if (quick && n_tokens > 256)
        n_tokens = 256;
    if (chunk >= n_tokens)
        chunk = n_tokens / 2;
    layout l = {c->n_layer, c->n_kv_head, c->head_dim,   SYN_BLOCK,
                n_tokens,   c->n_ctx,     c->fingerprint};
    child_t ch;
    if (child_start(&ch, RX_KVX, &l, "tcp://127.0.0.1:*") < 0) { /* before any thread */
        model_destroy(&m);
        return 1;
    }
    int n_blocks = (n_tokens + SYN_BLOCK - 1) / SYN_BLOCK;
    model_ctx_params cp = model_ctx_default_params();
    cp.max_tokens = n_tokens;
    cp.n_threads = n_threads;
    prefill_t p = {.ctx = model_ctx_new_params(m, &cp),
                   .kv = mk_cache(&l, 2 * n_blocks),
                   .toks = NULL,
                   .logits = malloc((size_t)c->vocab_size * sizeof(float)),
                   .n_tokens = n_tokens,
                   .block_size = SYN_BLOCK};
    int *toks = malloc((size_t)n_tokens * sizeof(int));
    sender_t sd = {0};
    int rc = 1;
    if (!p.ctx || !p.kv || !p.logits || !toks || sender_open(&sd, p.kv, ch.endpoint, l.fp) < 0) {
        fprintf(stderr, "bench_kvtransfer: cannot set up the overlap run\n");
        goto out;
    }
    uint64_t x = 0x5eed;
    for (int i = 0; i < n_tokens; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        toks[i] = 3 + (int)(x % (uint64_t)(c->vocab_size - 3));
    }
    p.toks = toks;
    printf("\noverlap of transfer and prefill: %s (dim %d, %d layers, %d KV heads x %d), "
           "%d-token prompt, KV %.1f MB over tcp, %d compute threads (kernels %s); median of "
           "%d\n",
           path, c->dim, c->n_layer, c->n_kv_head, c->head_dim, n_tokens,
           (double)kv_bytes(&l) / 1e6, model_ctx_n_threads(p.ctx), model_ctx_kernel_name(p.ctx),
           reps);
    double ta[16], tb[16], tc[16], td[16], te[16], tail[2][16], cu[5] = {0};
    double c0[5] = {0}, w[5] = {0};
    for (int r = -1; r < reps; r++) { /* r = -1: warm-up (pages weights in, connects) */
        /* (a) prefill alone */
        int seq = kvcache_seq_new(p.kv);
        kvcache_seq_reserve(p.kv, seq, n_tokens);
        double t0 = now_s(), k0 = cpu_s();
        if (prefill(&p, seq, n_tokens, NULL) < 0)
            goto out;
        double a = now_s() - t0;
        c0[0] += cpu_s() - k0;
        /* (a') prefill alone, in chunks */
        int seq2 = kvcache_seq_new(p.kv);
        kvcache_seq_reserve(p.kv, seq2, n_tokens);
        t0 = now_s(), k0 = cpu_s();
        if (prefill(&p, seq2, chunk, NULL) < 0)
            goto out;
        double a2 = now_s() - t0;
        c0[4] += cpu_s() - k0;
        kvcache_seq_free(p.kv, seq2);
        /* (b) the same KV transferred alone, after the prefill */
        t0 = now_s(), k0 = cpu_s();
        if (xfer_begin(&sd, seq, n_tokens) < 0)
            goto out;
        for (int ly = 0; ly < c->n_layer; ly++)
            kvx_send_layer(sd.s, sd.xfer, ly);
        kvx_send_end(sd.s, sd.xfer, 1, 1);
        if (xfer_wait(&sd) < 0)
            goto out;
        double b = now_s() - t0;
        c0[1] += cpu_s() - k0;
        xfer_release(&sd);
        /* (c) one pass, layers sent from the layer callback; (c') in chunks */
        double cc[2];
        for (int k = 0; k < 2; k++) {
            seq = kvcache_seq_new(p.kv);
            kvcache_seq_reserve(p.kv, seq, n_tokens);
            t0 = now_s(), k0 = cpu_s();
            if (xfer_begin(&sd, seq, n_tokens) < 0 ||
                prefill(&p, seq, k == 0 ? n_tokens : chunk, &sd) < 0)
                goto out;
            kvx_send_end(sd.s, sd.xfer, 1, 1);
            if (xfer_wait(&sd) < 0)
                goto out;
            cc[k] = now_s() - t0;
            c0[2 + k] += cpu_s() - k0;
            if (r >= 0)
                tail[k][r] = now_s() - sd.t_fwd_end;
            xfer_release(&sd);
        }
        if (r < 0) {
            memset(c0, 0, sizeof(c0));
            continue;
        }
        ta[r] = a, tb[r] = b, tc[r] = cc[0], td[r] = cc[1], te[r] = a2;
        w[0] += a, w[1] += b, w[2] += cc[0], w[3] += cc[1], w[4] += a2;
    }
    for (int k = 0; k < 5; k++)
        cu[k] = w[k] > 0 ? c0[k] / w[k] : 0;
    double a = median(ta, reps), b = median(tb, reps), cv = median(tc, reps);
    double dv = median(td, reps), ev = median(te, reps);
    double t1 = median(tail[0], reps), t2 = median(tail[1], reps);
    printf("  (a) prefill alone                          : %8.1f ms  [%.1f cores]\n", a * 1e3,
           cu[0]);
    printf("  (b) transfer alone, after the prefill      : %8.1f ms  [%.1f cores]  %.2f GB/s\n",
           b * 1e3, cu[1], (double)kv_bytes(&l) / 1e9 / b);
    printf("  (c) prefill + layer-by-layer transfer      : %8.1f ms  [%.1f cores]  hidden "
           "(a+b-c)/b = %.2f (one pass: at best 1 - 1/%d = %.2f)\n",
           cv * 1e3, cu[2], (a + b - cv) / b, c->n_layer, 1.0 - 1.0 / c->n_layer);
    printf("        tail after the forward pass %.1f ms: 1 - tail/b = %.2f; compute slowed by "
           "%.1f ms\n",
           t1 * 1e3, 1.0 - t1 / b, (cv - t1 - a) * 1e3);
    printf("  (a') prefill alone, chunks of %4d tokens  : %8.1f ms  [%.1f cores]\n", chunk,
           ev * 1e3, cu[4]);
    printf("  (c') (c) in chunks of %4d tokens          : %8.1f ms  [%.1f cores]  hidden "
           "(a'+b-c')/b = %.2f\n",
           chunk, dv * 1e3, cu[3], (ev + b - dv) / b);
    printf("        tail after the forward pass %.1f ms: 1 - tail/b = %.2f; compute slowed by "
           "%.1f ms\n",
           t2 * 1e3, 1.0 - t2 / b, (dv - t2 - ev) * 1e3);
    rc = 0;
out:
    if (sd.s)
        sender_close(&sd);
    if (child_stop(&ch) < 0)
        rc = 1;
    free(toks);
    free(p.logits);
    kvcache_destroy(&p.kv);
    model_ctx_destroy(&p.ctx);
    model_destroy(&m);
    return rc;
}

int main(int argc, char **argv)
{
    int quick = 0, n_threads = cpus_available() - 1, chunk = 512, a = 1;
    for (; a < argc && strncmp(argv[a], "--", 2) == 0; a++) {
        if (strcmp(argv[a], "--quick") == 0)
            quick = 1;
        else if (strcmp(argv[a], "--threads") == 0 && a + 1 < argc)
            n_threads = atoi(argv[++a]);
        else if (strcmp(argv[a], "--chunk") == 0 && a + 1 < argc)
            chunk = atoi(argv[++a]);
        else
            break;
    }
    if (n_threads < 1)
        n_threads = 1;
    if (a < argc - 1 || (a < argc && argv[a][0] == '-') || chunk < 1) {
        fprintf(stderr, "usage: bench_kvtransfer [--quick] [--threads N] [--chunk N] "
                        "[MODEL.gguf]\n");
        return 2;
    }
    log_init("bench_kvtransfer", getenv("BENCH_DEBUG") ? LOG_LEVEL_DEBUG : LOG_LEVEL_ERROR);
    signal(SIGPIPE, SIG_IGN);
    printf("CPUs this process may use (sched_getaffinity): %d\n", cpus_available());
    int reps = quick ? 3 : 9;
    int rc = bench_throughput(reps);
    rc |= bench_curve(reps);
    if (a < argc)
        rc |= bench_overlap(argv[a], quick ? 1 : 3, n_threads, chunk, quick);
    return rc;
}
