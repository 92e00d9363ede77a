/*
 * bench_engine: throughput of the engine's forward pass, in-process, per model file.
 *
 *   bench_engine [--threads N] [--kernel auto|exact|fast] [--isa scalar|avx2|avx512]
 *                [--quick | --tg | --pp [--pp-tokens N] | --batched | --roof | --verify]
 *                MODEL.gguf...
 *   bench_engine [--threads N] [--isa avx2|avx512] --kern
 *
 * For each model: prefill of one 128-token prompt, and of four 128-token prompts in one
 * call (best of a few runs), and of one 512-token prompt (one run on the 1B-class models);
 * batch-1 decode at context ~64 (rate from the median step); aggregate decode at batch 1, 8
 * and 32 with every sequence at context 64, time-sliced (bench_decode_mix: chunks of 32
 * tokens of each batch size in turn, tokens / wall summed over each size's chunks, with the
 * CPU time per token and the fraction of steps preempted; the 64-token context is
 * prefilled once and its KV blocks copied to the other sequences, so setting up costs one
 * prefill); batch 8 again on one thread (thread scaling); the read-bandwidth roofline of
 * batch-1 decode, which only reads the weights: the read bandwidth (read_pass: the engine's
 * thread count streaming through a 1 GiB buffer; on the 1B-class models one pass before
 * each batch-1 step and their median, side by side with the steps; on small models, whose
 * weights stay in cache, the best of 5 just before the run) divided by the weight bytes a
 * step reads (model_matmul_bytes), and the fraction of that bound achieved. Numbers are
 * for comparing within one run on one machine: the ratios are the result, not the
 * absolute rates. Prompts are random token ids (seeded); the model's output is not
 * checked here (the unit tests do that).
 *
 * --tg: batch-1 decode only, one line per model, "tg MODEL TOK/S" (tokens/s from the
 * median of 32 steps, 64 for small models, at context 64 as above), for the side-by-side
 * runs against llama-bench in tests/run_bench.sh.
 *
 * --batched: aggregate decode only, lines "bd MODEL B TOK/S cpu_us_per_token US preempted
 * F" for B = 1, 8, 32 (the time-sliced decode rows above), for the side-by-side runs
 * against llama-batched-bench (tests/run_bench.sh peer_batched).
 *
 * --roof: batch-1 decode only, each step preceded by a streaming read of 1 GiB with the
 * engine's thread count (32 steps, 64 for small models), one line per model "roof MODEL
 * TOK/S tok/s, bound B tok/s (...): F%": medians of both, and the fraction of the read
 * bound the forward pass reaches, measured side by side.
 *
 * --pp: prefill of one 512-token prompt only, "pp MODEL TOK/S cores C" (after a warm-up
 * prefill of the same length, as llama-bench's; best of 3, one run for the 1B-class models; C: CPU seconds over wall seconds of
 * that run, the share of the machine it had), for the pp512 side by side; --pp-tokens N
 * (1..512): an N-token prompt instead (llama-bench's ppN).
 *
 * --verify: the MTP verify shapes at batch 1 (bench_verify): passes of 1, 2 and 3 tokens
 * at context 64, lines "verify MODEL ISA: 1 token MS ms; 2 tokens xR2, 3 tokens xR3 (CPU
 * time ...)"; without --isa on an AVX-512 machine, avx2 and avx512 contexts of the same
 * loaded model side by side, interleaved, and their time ratios.
 *
 * --kern: no model; the Q8_0 kernels alone (bench_kern) per instruction set (--isa X: X
 * alone; else avx2 and avx512 side by side when the CPU has AVX-512) on ~300 MB random
 * matrices (2048- and 5632-wide rows), GGUF layout against the Q8X8 one loaded model
 * matrices get (kernels.h), with a streaming read of as many bytes, alternating, medians:
 * T = 1 GB/s and the fraction of the read rate, the kernel's own roofline without the
 * rest of a forward pass; T = 2, 3 on the same matrices (the MTP verify shapes) as time
 * over the same kernel's T = 1; the Q8X8 products on a 256 KB slice that stays in L2 (the
 * compute alone), with the CPU seconds of each run over the streamed T = 1 run's (the
 * many short L2 runs include the pool's wake-ups and spins: an upper bound); and the
 * batched and prefill shapes (T = 8, 16, 32, 64) in both layouts. Also per isa, robust to a
 * shared machine (kb_l1_ns): the Q8X8 products of one 8-row group kept in cache, on one
 * thread, the minimum CPU time over KL_REPS runs, in ns per row, block and token, beside
 * one core's share of the streamed T = 1 pass per row and block; their ratio at T = 3 is
 * the verify pass's floor on that machine (compute and memory overlapped perfectly).
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <stdatomic.h>

#include "kernels.h"
#include "kvcache.h"
#include "model.h"
#include "threadpool.h"
#include "tokenizer.h"

#define CTX 64
#define PROMPT 128
#define PP_LONG 512 /* llama-bench's pp512 */

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

/* CPU seconds the calling thread used. */
static double thread_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* --- read bandwidth: the bound of a batch-1 decode step, which only reads weights ---- */

#define RB_BYTES ((size_t)1 << 30) /* far larger than the LLC (32 MiB here) */
#define RB_REPS 5

typedef struct {
    const uint64_t *p;
    size_t n; /* uint64 words of this thread's slice */
    pthread_barrier_t *start;
    uint64_t sum;
} rb_slice;

#if defined(__x86_64__)
/* Sum of the slice as 64-bit lanes, 256-bit loads, four independent accumulators. */
__attribute__((target("avx2"))) static uint64_t rb_sum_avx2(const uint64_t *p, size_t n)
{
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(p + i + 4)));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *)(p + i + 8)));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *)(p + i + 12)));
    }
    a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t l[4];
    _mm256_storeu_si256((__m256i *)l, a0);
    uint64_t s = l[0] + l[1] + l[2] + l[3];
    for (; i < n; i++)
        s += p[i];
    return s;
}
#endif

static uint64_t rb_sum(const uint64_t *p, size_t n)
{
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx2"))
        return rb_sum_avx2(p, n);
#endif
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += p[i];
        s1 += p[i + 1];
        s2 += p[i + 2];
        s3 += p[i + 3];
    }
    for (; i < n; i++)
        s0 += p[i];
    return s0 + s1 + s2 + s3;
}

static void *rb_thread(void *arg)
{
    rb_slice *s = arg;
    pthread_barrier_wait(s->start);
    s->sum = rb_sum(s->p, s->n);
    return NULL;
}

/* A 1 GiB buffer for read_pass, paged in with distinct values; NULL when out of memory. */
static uint64_t *rb_buffer(void)
{
    uint64_t *buf = aligned_alloc(64, RB_BYTES);
    if (buf)
        for (size_t i = 0; i < RB_BYTES / sizeof(uint64_t); i++)
            buf[i] = i;
    return buf;
}

/* One streaming read of buf (rb_buffer) by n_threads threads (1..64), each summing its
 * contiguous slice with wide loads; the time runs from the threads' common start to the
 * last one's end. Returns the rate in bytes/s; exits when a thread cannot be started. */
static double read_pass(const uint64_t *buf, int n_threads)
{
    const size_t words = RB_BYTES / sizeof(uint64_t), per = words / (size_t)n_threads / 16 * 16;
    uint64_t total = 0;
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)n_threads + 1);
    rb_slice sl[64];
    pthread_t th[64];
    for (int i = 0; i < n_threads; i++) {
        sl[i] = (rb_slice){buf + (size_t)i * per, per, &start, 0};
        if (pthread_create(&th[i], NULL, rb_thread, &sl[i]) != 0) {
            fprintf(stderr, "bench_engine: cannot start a thread\n");
            exit(1); /* the ones started wait at the barrier: end the process */
        }
    }
    pthread_barrier_wait(&start);
    double t0 = now_s();
    for (int i = 0; i < n_threads; i++) {
        pthread_join(th[i], NULL);
        total += sl[i].sum;
    }
    double dt = now_s() - t0;
    pthread_barrier_destroy(&start);
    volatile uint64_t sink = total; /* the sums are used */
    (void)sink;
    return (double)per * n_threads * sizeof(uint64_t) / dt;
}

static int clamp_threads(int n_threads)
{
    return n_threads < 1 ? 1 : n_threads > 64 ? 64 : n_threads;
}

/* Read bandwidth in bytes/s with n_threads threads (the engine's count): read_pass over a
 * 1 GiB buffer, best of RB_REPS. Returns 0 when the buffer cannot be had. */
static double read_bandwidth(int n_threads)
{
    uint64_t *buf = rb_buffer();
    if (!buf)
        return 0;
    double best = 0;
    for (int r = 0; r < RB_REPS; r++) {
        double bw = read_pass(buf, clamp_threads(n_threads));
        if (bw > best)
            best = bw;
    }
    free(buf);
    return best;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint64_t rng_state = 0x5eed;

/* --- the Q8_0 kernels alone, per instruction set and layout, side by side ------------ */

/* Random bytes for Q8_0 blocks, never 0x80: quants in [-127, 127] as a quantizer writes
 * them (kern_q8x8_pack refuses -128); the callers then set the scales. */
static void rand_q8(uint8_t *w, size_t bytes)
{
    for (size_t i = 0; i < bytes; i++) {
        w[i] = (uint8_t)((rng_state = rng_state * 6364136223846793005ULL + 1) >> 56);
        if (w[i] == 0x80)
            w[i] = 0x81;
    }
}

/* One kern_matmul over all rows by the pool in 16-row chunks (as the model's), each
 * thread with its own scratch (kern_scratch_floats(n) floats at scratch + ti * scr). */
typedef struct {
    kern_isa isa;
    const kern_mat *w;
    const kern_act *a;
    float *const *out;
    float *scratch;
    size_t scr;
    int chunk;
    atomic_int next;
} kb_job;

static void kb_worker(void *arg, int ti, int nth)
{
    kb_job *j = arg;
    (void)nth;
    for (;;) {
        int r0 = atomic_fetch_add(&j->next, 1) * j->chunk;
        if (r0 >= j->w->rows)
            break;
        int r1 = r0 + j->chunk < j->w->rows ? r0 + j->chunk : j->w->rows;
        kern_matmul(j->isa, KERN_ORDER_FAST, j->w, j->a, r0, r1, j->out,
                    j->scratch + (size_t)ti * j->scr);
    }
}

typedef struct {
    const uint64_t *p;
    size_t words;
    int nth;
    uint64_t sum[64];
} kb_rb;

static void kb_rb_worker(void *arg, int ti, int nth)
{
    kb_rb *r = arg;
    size_t per = r->words / (size_t)nth / 16 * 16;
    r->sum[ti] = rb_sum(r->p + (size_t)ti * per, per);
}

#define KB_TMAX 64
/* The activations of KB_TMAX tokens (n wide) and their Q8 form; NULL on out of memory. */
typedef struct {
    float *x, *qd;
    int8_t *qs;
    float *o;
    float *outp[KB_TMAX];
    float *scratch;
    size_t scr;
} kb_bufs;

static int kb_bufs_new(kb_bufs *k, int n, int rows, int n_threads)
{
    const int nb = n / KERN_Q8_BLOCK;
    k->x = malloc((size_t)KB_TMAX * n * sizeof(float));
    k->qd = malloc((size_t)KB_TMAX * nb * sizeof(float));
    k->qs = malloc((size_t)KB_TMAX * n);
    k->o = malloc((size_t)KB_TMAX * rows * sizeof(float));
    k->scr = kern_scratch_floats(n);
    k->scratch = malloc(k->scr * sizeof(float) * (size_t)n_threads);
    if (!k->x || !k->qd || !k->qs || !k->o || !k->scratch)
        return -1;
    for (int i = 0; i < KB_TMAX * n; i++)
        k->x[i] = (float)((i * 7) % 17) - 8.0f + 0.01f * (float)(i % 13);
    kern_quantize_act(KERN_ISA_SCALAR, k->x, KB_TMAX, n, k->qd, k->qs);
    for (int t = 0; t < KB_TMAX; t++)
        k->outp[t] = k->o + (size_t)t * rows;
    return 0;
}

static void kb_bufs_free(kb_bufs *k)
{
    free(k->x);
    free(k->qd);
    free(k->qs);
    free(k->o);
    free(k->scratch);
}

static double kb_run(threadpool_t *pool, kb_bufs *k, kern_isa isa, const kern_mat *w, int T)
{
    kern_act a = {.x = k->x, .q_d = k->qd, .q_s = k->qs, .T = T, .n = w->cols};
    kb_job j = {isa, w, &a, k->outp, k->scratch, k->scr, 16, 0};
    double t0 = now_s();
    threadpool_run(pool, kb_worker, &j);
    return now_s() - t0;
}

/* The compute alone, robust to a shared machine: the first group (8 rows) of the Q8X8
 * matrix w, which stays in L1 or L2 after the first call, times T tokens on the calling
 * thread, many calls per run; the minimum over KL_REPS runs of the thread's CPU time (time
 * slices lost to other processes, and their cache evictions, only ever add). Returns ns per
 * row, block and token. */
#define KL_REPS 61
static double kb_l1_ns(kb_bufs *k, kern_isa isa, const kern_mat *w, int T)
{
    kern_mat g = *w;
    g.rows = 8;
    const int nb = w->cols / KERN_Q8_BLOCK, iters = (1 << 17) / (nb * T); /* ~1 ms a run */
    kern_act a = {.x = k->x, .q_d = k->qd, .q_s = k->qs, .T = T, .n = w->cols};
    double best = 1e30;
    for (int rep = 0; rep < KL_REPS; rep++) {
        double c0 = thread_cpu_s();
        for (int it = 0; it < iters; it++)
            kern_matmul(isa, KERN_ORDER_FAST, &g, &a, 0, 8, k->outp, k->scratch);
        double c = thread_cpu_s() - c0;
        best = c < best ? c : best;
    }
    return best / ((double)iters * 8 * nb * T) * 1e9;
}

/* A random Q8_0 matrix (rows, n), scales 0.01, and its Q8X8 form; 0, -1 on failure. */
static int kb_mats(int rows, int n, uint8_t **w, uint8_t **wx, kern_mat *mg, kern_mat *mx)
{
    const int nb = n / KERN_Q8_BLOCK;
    const size_t bytes = (size_t)rows * nb * KERN_Q8_BLOCK_BYTES;
    *w = malloc(bytes);
    *wx = aligned_alloc(64, kern_q8x8_bytes(rows, n));
    if (!*w || !*wx)
        return -1;
    rand_q8(*w, bytes);
    uint16_t h = gguf_fp32_to_fp16(0.01f);
    for (size_t r = 0; r < (size_t)rows * nb; r++)
        memcpy(*w + r * KERN_Q8_BLOCK_BYTES, &h, 2);
    *mg = (kern_mat){*w, GGUF_TENSOR_Q8_0, rows, n, KERN_LAYOUT_GGUF};
    return kern_q8x8_pack(mg, *wx, 0, rows / 8, mx);
}

/* Batched and prefill shapes: T = 8, 16, 32, 64 tokens x a 2048 x 2048 matrix (4.4 MB,
 * the L3) per isa and layout, alternating, medians: G multiply-adds per second. */
static int bench_kern_pp(threadpool_t *pool, int n_threads, const kern_isa *isas, int n_isa)
{
    const int n = 2048, rows = 2048, Ts[4] = {8, 16, 32, 64};
    uint8_t *w = NULL, *wx = NULL;
    kern_mat m[2];
    kb_bufs k;
    if (kb_mats(rows, n, &w, &wx, &m[0], &m[1]) != 0 || kb_bufs_new(&k, n, rows, n_threads) != 0)
        return 1;
    enum { REPS = 11 };
    for (int ti = 0; ti < 4; ti++) {
        const int T = Ts[ti];
        double t[2][2][REPS]; /* isa, layout */
        for (int rep = 0; rep < REPS; rep++)
            for (int i = 0; i < n_isa; i++)
                for (int l = 0; l < 2; l++)
                    t[i][l][rep] = kb_run(pool, &k, isas[i], &m[l], T);
        printf("kern q8_0 T=%d n=%d %d threads, G multiply-adds/s:", T, n, n_threads);
        double g[2][2];
        for (int i = 0; i < n_isa; i++)
            for (int l = 0; l < 2; l++) {
                qsort(t[i][l], REPS, sizeof(double), cmp_double);
                g[i][l] = (double)rows * n * T / t[i][l][REPS / 2] / 1e9;
                printf(" %s %s %.2f", kern_isa_name(isas[i]), l ? "Q8X8" : "GGUF", g[i][l]);
            }
        if (n_isa == 2)
            printf("; %s / %s: GGUF %.2fx, Q8X8 %.2fx", kern_isa_name(isas[1]),
                   kern_isa_name(isas[0]), g[1][0] / g[0][0], g[1][1] / g[0][1]);
        printf("\n");
    }
    kb_bufs_free(&k);
    free(w);
    free(wx);
    return 0;
}

/* --kern: for n = 2048 and 5632 wide rows, a ~300 MB Q8_0 matrix (random) in the GGUF and
 * the Q8X8 layout; per isa and layout its T = 1, 2, 3 products streamed from memory and a
 * streaming read of as many bytes, alternating REPS times, medians: T = 1 GB/s and its
 * fraction of the read rate, T = 2 and 3 (the MTP verify shapes) as time over the same
 * kernel's T = 1; then the same Q8X8 products on a 256 KB slice that stays in L2 (the
 * compute alone) in CPU seconds (robust to time slicing) over the streamed T = 1 run's:
 * T = 3's compute over T = 1's stream bounds the verify ratio from below; then
 * bench_kern_pp. isas: the instruction sets to compare (1 or 2). Returns 0, 1 on out of
 * memory. */
static int bench_kern(int n_threads, const kern_isa *isas, int n_isa)
{
    const int ns[2] = {2048, 5632};
    threadpool_t *pool = threadpool_new(n_threads);
    if (!pool)
        return 1;
    for (int ni = 0; ni < 2; ni++) {
        const int n = ns[ni], nb = n / KERN_Q8_BLOCK;
        const int rows = (int)(((size_t)300 << 20) / ((size_t)nb * KERN_Q8_BLOCK_BYTES)) / 16 * 16;
        const size_t bytes = (size_t)rows * nb * KERN_Q8_BLOCK_BYTES;
        uint8_t *w = NULL, *wx = NULL;
        kern_mat m[2];
        kb_bufs k;
        uint64_t *rb = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (!rb || kb_mats(rows, n, &w, &wx, &m[0], &m[1]) != 0 ||
            kb_bufs_new(&k, n, rows, n_threads) != 0)
            return 1;
        memset(rb, 1, (bytes + 63) / 64 * 64);
        /* the compute alone: the first KW rows of the Q8X8 matrix (256 KB, in each core's
         * L2), rows / KW times over: as many block products as the streamed runs */
        const int kw = (int)(((size_t)256 << 10) / ((size_t)nb * KERN_Q8_BLOCK_BYTES)) / 16 * 16;
        kern_mat mw = m[1];
        mw.rows = kw;
        enum { REPS = 15 };
        /* per isa: [layout][T - 1] streamed, [2][T - 1] L2-resident Q8X8; then the read */
        double t[2][3][3][REPS], c[2][3][3][REPS], tr[REPS];
        for (int rep = 0; rep < REPS; rep++) {
            for (int i = 0; i < n_isa; i++)
                for (int v = 0; v < 3; v++)
                    for (int T = 1; T <= 3; T++) {
                        double c0 = cpu_s(), d = 0;
                        if (v < 2)
                            d = kb_run(pool, &k, isas[i], &m[v], T);
                        else
                            for (int r2 = 0; r2 < rows / kw; r2++)
                                d += kb_run(pool, &k, isas[i], &mw, T);
                        t[i][v][T - 1][rep] = d;
                        c[i][v][T - 1][rep] = cpu_s() - c0;
                    }
            double t0 = now_s();
            kb_rb r = {rb, bytes / 8, n_threads, {0}};
            threadpool_run(pool, kb_rb_worker, &r);
            tr[rep] = now_s() - t0;
            volatile uint64_t sink = r.sum[0];
            (void)sink;
        }
        qsort(tr, REPS, sizeof(double), cmp_double);
        const double read = (double)bytes / tr[REPS / 2] / 1e9;
        double gb1[2][2];
        printf("kern q8_0 n=%d %d threads (%.0f MB), read %.2f GB/s\n", n, n_threads, bytes / 1e6,
               read);
        for (int i = 0; i < n_isa; i++) {
            double tm[3][3], cm[3][3];
            for (int v = 0; v < 3; v++)
                for (int T = 0; T < 3; T++) {
                    qsort(t[i][v][T], REPS, sizeof(double), cmp_double);
                    qsort(c[i][v][T], REPS, sizeof(double), cmp_double);
                    tm[v][T] = t[i][v][T][REPS / 2];
                    cm[v][T] = c[i][v][T][REPS / 2];
                }
            for (int v = 0; v < 2; v++) {
                gb1[i][v] = (double)bytes / tm[v][0] / 1e9;
                printf("kern q8_0 n=%d %-6s %s: T=1 %.2f GB/s (%.0f%% of read); time over T=1: "
                       "T=2 %.2f, T=3 %.2f\n",
                       n, kern_isa_name(isas[i]), v ? "Q8X8" : "GGUF", gb1[i][v],
                       100 * gb1[i][v] / read, tm[v][1] / tm[v][0], tm[v][2] / tm[v][0]);
            }
            printf("kern q8_0 n=%d %-6s Q8X8 CPU time over the T=1 stream: T=2 stream %.2f, T=3 "
                   "stream %.2f; compute alone (L2-resident) T=1 %.2f, T=2 %.2f, T=3 %.2f\n",
                   n, kern_isa_name(isas[i]), cm[1][1] / cm[1][0], cm[1][2] / cm[1][0],
                   cm[2][0] / cm[1][0], cm[2][1] / cm[1][0], cm[2][2] / cm[1][0]);
            /* one core's share of the streamed T = 1 pass, per row and block */
            const double s1 = tm[1][0] * n_threads / ((double)rows * nb) * 1e9;
            double l1[3];
            for (int T = 1; T <= 3; T++)
                l1[T - 1] = kb_l1_ns(&k, isas[i], &m[1], T);
            printf("kern q8_0 n=%d %-6s Q8X8 compute, one group in cache, min CPU: T=1 %.3f, T=2 "
                   "%.3f, T=3 %.3f ns per row, block and token; T=1 stream %.3f ns per row and "
                   "block per core; T=3 compute / T=1 stream %.2f\n",
                   n, kern_isa_name(isas[i]), l1[0], l1[1], l1[2], s1, 3 * l1[2] / s1);
        }
        if (n_isa == 2)
            printf("kern q8_0 n=%d T=1 %s / %s: GGUF %.2fx, Q8X8 %.2fx\n", n,
                   kern_isa_name(isas[1]), kern_isa_name(isas[0]), gb1[1][0] / gb1[0][0],
                   gb1[1][1] / gb1[0][1]);
        kb_bufs_free(&k);
        free(w);
        free(wx);
        free(rb);
    }
    int rc = bench_kern_pp(pool, n_threads, isas, n_isa);
    threadpool_destroy(&pool);
    return rc;
}

static int rand_tok(int vocab)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return 3 + (int)(rng_state % (uint64_t)(vocab - 3));
}

typedef struct {
    const model_t *m;
    const model_config *c;
    kvcache_t *kv;
    model_ctx_t *ctx;
    float *logits; /* (32, vocab) */
    int *toks;     /* (4 * PROMPT,) */
} bench;

/* Prefill n_seq prompts of len tokens in one call; returns tokens/s (best of reps) and
 * in *cores the CPUs used during that run (CPU time / wall time). */
static double bench_prefill(bench *b, int n_seq, int len, int reps, double *cores)
{
    double best = 1e30;
    model_seq_batch items[4];
    for (int r = 0; r < reps; r++) {
        int seqs[4];
        for (int s = 0; s < n_seq; s++) {
            seqs[s] = kvcache_seq_new(b->kv);
            if (seqs[s] < 0 || kvcache_seq_reserve(b->kv, seqs[s], len) != KVCACHE_OK)
                return -1;
            for (int i = 0; i < len; i++)
                b->toks[s * len + i] = rand_tok(b->c->vocab_size);
            items[s] = (model_seq_batch){
                seqs[s], 0,    len,  b->toks + s * len, 0, b->logits + (size_t)s * b->c->vocab_size,
                NULL,    0, NULL};
        }
        double t0 = now_s(), c0 = cpu_s();
        if (model_forward(b->ctx, b->kv, items, n_seq, NULL, NULL) != 0)
            return -1;
        double dt = now_s() - t0;
        if (dt < best) {
            best = dt;
            *cores = (cpu_s() - c0) / dt;
        }
        for (int s = 0; s < n_seq; s++)
            kvcache_seq_free(b->kv, seqs[s]);
    }
    return (double)n_seq * len / best;
}


/* Decode `steps` steps of B sequences at context CTX (after a one-token warm-up step);
 * returns tokens/s from the median step time (B tokens per step; the median, because the
 * machine may be shared), and in *cores the CPUs used over the timed steps. With rbuf
 * (rb_buffer), each step is preceded by a read_pass with the context's thread count, and
 * *bw gets their median rate (bytes/s): the roofline then compares medians of runs taken
 * side by side, alternating (a best-of read against a median step overstated the bound on
 * a shared machine); *cores then also counts the read passes. */
static double bench_decode_rb(bench *b, model_ctx_t *ctx, int B, int steps, double *cores,
                              const uint64_t *rbuf, double *bw)
{
    double rates[64];
    int seqs[32];
    int L = b->c->n_layer;
    double times[64];
    if (steps > 64)
        steps = 64;
    /* one prefilled context, copied block by block into the others */
    for (int s = 0; s < B; s++) {
        seqs[s] = kvcache_seq_new(b->kv);
        if (seqs[s] < 0 || kvcache_seq_reserve(b->kv, seqs[s], CTX + steps + 1) != KVCACHE_OK)
            return -1;
    }
    for (int i = 0; i < CTX; i++)
        b->toks[i] = rand_tok(b->c->vocab_size);
    model_seq_batch p = {seqs[0], 0, CTX, b->toks, 0, b->logits, NULL, 0, NULL};
    if (model_forward(ctx, b->kv, &p, 1, NULL, NULL) != 0)
        return -1;
    int nb;
    const int *src = kvcache_seq_blocks(b->kv, seqs[0], &nb);
    int used = kvcache_blocks_for(b->kv, CTX);
    for (int s = 1; s < B; s++) {
        const int *dst = kvcache_seq_blocks(b->kv, seqs[s], NULL);
        for (int l = 0; l < L; l++)
            for (int k = 0; k < used; k++)
                memcpy(kvcache_block_data(b->kv, l, dst[k]), kvcache_block_data(b->kv, l, src[k]),
                       kvcache_block_bytes(b->kv));
        kvcache_seq_set_len(b->kv, seqs[s], CTX);
    }
    model_seq_batch items[32];
    int tok[32];
    double wall = 0, c_start = 0;
    for (int step = 0; step <= steps; step++) {
        if (step == 1)
            c_start = cpu_s();
        for (int s = 0; s < B; s++) {
            tok[s] = rand_tok(b->c->vocab_size);
            items[s] = (model_seq_batch){
                seqs[s], CTX + step, 1, &tok[s], 0, b->logits + (size_t)s * b->c->vocab_size,
                NULL,    0,          NULL};
        }
        if (rbuf && step > 0)
            rates[step - 1] = read_pass(rbuf, clamp_threads(model_ctx_n_threads(ctx)));
        double t0 = now_s();
        if (model_forward(ctx, b->kv, items, B, NULL, NULL) != 0)
            return -1;
        if (step > 0) {
            times[step - 1] = now_s() - t0;
            wall += times[step - 1];
        }
    }
    *cores = (cpu_s() - c_start) / wall;
    for (int s = 0; s < B; s++)
        kvcache_seq_free(b->kv, seqs[s]);
    qsort(times, (size_t)steps, sizeof(double), cmp_double);
    if (rbuf) {
        qsort(rates, (size_t)steps, sizeof(double), cmp_double);
        *bw = rates[steps / 2];
    }
    return (double)B / times[steps / 2];
}

/* Aggregate decode at the batch sizes Bs[0..nB) (each <= MIX_MAX_B), time-sliced: `rounds`
 * rounds, each one chunk of MIX_MAX_B / B steps (MIX_MAX_B tokens) of every size in turn,
 * every step at context CTX exactly (the sequences are cut back to CTX before each step,
 * which then rewrites position CTX). rate[i]: tokens / the wall time summed over size i's
 * chunks; cpu_us[i]: CPU microseconds (all threads) per token; preempt[i]: the fraction of
 * its steps during which the calling thread was switched out involuntarily. Chunks of about
 * equal length share the machine's load of the moment alike; a median step does not: a
 * batch-32 step of stories260K (~2 ms) is longer than a scheduler slice, so on a shared
 * machine most such steps contain a preemption and almost no batch-1 step (~0.07 ms) does,
 * and the median-step rate fell from batch 8 to 32 while the CPU time per token did not
 * (docs/bench.md). 0, or -1 when the cache or a forward pass fails. */
#define MIX_MAX_B 32
static int bench_decode_mix(bench *b, model_ctx_t *ctx, const int *Bs, int nB, int rounds,
                            double *rate, double *cpu_us, double *preempt)
{
    int seqs[3 * MIX_MAX_B], first[4], n_seq = 0;
    int L = b->c->n_layer;
    if (nB > 3)
        return -1;
    for (int i = 0; i < nB; i++) {
        if (Bs[i] < 1 || Bs[i] > MIX_MAX_B)
            return -1;
        first[i] = n_seq;
        n_seq += Bs[i];
    }
    first[nB] = n_seq;
    int rc = -1, made = 0;
    for (; made < n_seq; made++) {
        seqs[made] = kvcache_seq_new(b->kv);
        if (seqs[made] < 0)
            goto out;
        if (kvcache_seq_reserve(b->kv, seqs[made], CTX + 1) != KVCACHE_OK) {
            made++;
            goto out;
        }
    }
    /* one prefilled context, copied block by block into the others */
    for (int i = 0; i < CTX; i++)
        b->toks[i] = rand_tok(b->c->vocab_size);
    model_seq_batch p = {seqs[0], 0, CTX, b->toks, 0, b->logits, NULL, 0, NULL};
    if (model_forward(ctx, b->kv, &p, 1, NULL, NULL) != 0)
        goto out;
    const int *src = kvcache_seq_blocks(b->kv, seqs[0], NULL);
    int used = kvcache_blocks_for(b->kv, CTX);
    for (int s = 1; s < n_seq; s++) {
        const int *dst = kvcache_seq_blocks(b->kv, seqs[s], NULL);
        for (int l = 0; l < L; l++)
            for (int k = 0; k < used; k++)
                memcpy(kvcache_block_data(b->kv, l, dst[k]), kvcache_block_data(b->kv, l, src[k]),
                       kvcache_block_bytes(b->kv));
        kvcache_seq_set_len(b->kv, seqs[s], CTX);
    }
    double wall[3] = {0}, cpu[3] = {0};
    long steps[3] = {0}, cut[3] = {0};
    model_seq_batch items[MIX_MAX_B];
    int tok[MIX_MAX_B];
    for (int r = -1; r < rounds; r++) { /* round -1: warm-up, not counted */
        for (int i = 0; i < nB; i++) {
            const int B = Bs[i], k_steps = MIX_MAX_B / B;
            for (int k = 0; k < k_steps; k++) {
                for (int s = 0; s < B; s++) {
                    int sq = seqs[first[i] + s];
                    kvcache_seq_set_len(b->kv, sq, CTX);
                    tok[s] = rand_tok(b->c->vocab_size);
                    items[s] = (model_seq_batch){
                        sq,   CTX, 1, &tok[s], 0, b->logits + (size_t)s * b->c->vocab_size,
                        NULL, 0,   NULL};
                }
                struct rusage ru0, ru1;
                getrusage(RUSAGE_THREAD, &ru0);
                double t0 = now_s(), c0 = cpu_s();
                if (model_forward(ctx, b->kv, items, B, NULL, NULL) != 0)
                    goto out;
                double dw = now_s() - t0, dc = cpu_s() - c0;
                getrusage(RUSAGE_THREAD, &ru1);
                if (r < 0)
                    continue;
                wall[i] += dw;
                cpu[i] += dc;
                steps[i]++;
                cut[i] += ru1.ru_nivcsw != ru0.ru_nivcsw;
            }
        }
    }
    for (int i = 0; i < nB; i++) {
        double toks = (double)steps[i] * Bs[i];
        rate[i] = toks / wall[i];
        cpu_us[i] = cpu[i] * 1e6 / toks;
        preempt[i] = (double)cut[i] / (double)steps[i];
    }
    rc = 0;
out:
    for (int s = 0; s < made; s++)
        if (seqs[s] >= 0)
            kvcache_seq_free(b->kv, seqs[s]);
    return rc;
}

static double bench_decode(bench *b, model_ctx_t *ctx, int B, int steps, double *cores)
{
    return bench_decode_rb(b, ctx, B, steps, cores, NULL, NULL);
}

/* --verify: the MTP verify shapes at batch 1: one sequence at context CTX, a forward pass
 * of 1, 2 and 3 tokens (logits of each, as specdec's verify), per context of ctxs[0..nc)
 * (one per isa), all interleaved round by round, `rounds` rounds; prints per context the
 * median 1-token pass (wall ms) and the 2- and 3-token passes over it (medians of the
 * per-round ratios, wall and CPU seconds), and with two contexts the second's passes over
 * the first's. 0, -1 when a pass fails. */
static int bench_verify(bench *b, model_ctx_t *const *ctxs, const char *const *names, int nc,
                        int rounds, const char *path)
{
    enum { MAXR = 64 };
    int seq = kvcache_seq_new(b->kv);
    if (seq < 0 || rounds > MAXR || kvcache_seq_reserve(b->kv, seq, CTX + 3) != KVCACHE_OK)
        return -1;
    for (int i = 0; i < CTX + 3; i++)
        b->toks[i] = rand_tok(b->c->vocab_size);
    model_seq_batch p = {seq, 0, CTX, b->toks, 0, b->logits, NULL, 0, NULL};
    if (model_forward(ctxs[0], b->kv, &p, 1, NULL, NULL) != 0)
        return -1;
    double w[2][4][MAXR], c[2][4][MAXR];
    for (int r = -1; r < rounds; r++) /* round -1: warm-up */
        for (int k = 0; k < nc; k++)
            for (int n = 1; n <= 3; n++) {
                model_seq_batch v = {.seq = seq,
                                     .pos = CTX,
                                     .n_tokens = n,
                                     .tokens = b->toks + CTX,
                                     .logits_all = 1,
                                     .logits = b->logits};
                double t0 = now_s(), c0 = cpu_s();
                if (model_forward(ctxs[k], b->kv, &v, 1, NULL, NULL) != 0)
                    return -1;
                if (r >= 0) {
                    w[k][n][r] = now_s() - t0;
                    c[k][n][r] = cpu_s() - c0;
                }
            }
    kvcache_seq_free(b->kv, seq);
    double med[2][4], rw[2][4], rc[2][4], x[MAXR];
    for (int k = 0; k < nc; k++)
        for (int n = 1; n <= 3; n++) {
            for (int r = 0; r < rounds; r++)
                x[r] = w[k][n][r];
            qsort(x, (size_t)rounds, sizeof(double), cmp_double);
            med[k][n] = x[rounds / 2];
            for (int r = 0; r < rounds; r++)
                x[r] = w[k][n][r] / w[k][1][r];
            qsort(x, (size_t)rounds, sizeof(double), cmp_double);
            rw[k][n] = x[rounds / 2];
            for (int r = 0; r < rounds; r++)
                x[r] = c[k][n][r] / c[k][1][r];
            qsort(x, (size_t)rounds, sizeof(double), cmp_double);
            rc[k][n] = x[rounds / 2];
        }
    for (int k = 0; k < nc; k++)
        printf("verify %s %s: 1 token %.2f ms; 2 tokens x%.3f, 3 tokens x%.3f (CPU time x%.3f, "
               "x%.3f)\n",
               path, names[k], med[k][1] * 1e3, rw[k][2], rw[k][3], rc[k][2], rc[k][3]);
    if (nc == 2) {
        printf("verify %s %s / %s time:", path, names[1], names[0]);
        for (int n = 1; n <= 3; n++) {
            for (int r = 0; r < rounds; r++)
                x[r] = w[1][n][r] / w[0][n][r];
            qsort(x, (size_t)rounds, sizeof(double), cmp_double);
            printf(" %d token%s x%.3f", n, n > 1 ? "s" : "", x[rounds / 2]);
        }
        printf("\n");
    }
    return 0;
}

static const char *weight_type(const model_t *m, const model_config *c)
{
    /* by bytes per weight of the matrices */
    double per =
        (double)model_matmul_bytes(m) /
        ((double)c->n_layer * (2.0 * c->dim * c->dim + 2.0 * c->dim * c->n_kv_head * c->head_dim +
                               3.0 * c->dim * c->hidden_dim) +
         (double)c->vocab_size * c->dim);
    return per > 3 ? "F32" : per > 1.5 ? "F16" : "Q8_0";
}

/* Prompt tokenization of the model's tokenizer: the time to encode n bytes of story text
 * with tokenizer_encode and with the reference merge loop (tokenizer_encode_ref), best of
 * 3 each, alternating; prints both and their ratio. Returns 0, -1 when the model has no
 * tokenizer (nothing printed) or on out of memory. */
static int bench_tokenizer(const char *path, size_t n)
{
    char err[256];
    tokenizer_t *t = tokenizer_load(path, err, sizeof(err));
    if (!t)
        return -1;
    static const char story[] = "Once upon a time, Tom and Sue went to the park. They saw a "
                                "big red ball and played all day. ";
    char *text = malloc(n);
    int *ids = malloc((n + 2) * sizeof(int));
    if (!text || !ids) {
        free(text);
        free(ids);
        tokenizer_destroy(&t);
        return -1;
    }
    for (size_t i = 0; i < n; i++)
        text[i] = story[i % (sizeof(story) - 1)];
    double best[2] = {1e30, 1e30};
    int k = 0;
    for (int rep = 0; rep < 3; rep++) {
        for (int side = 0; side < 2; side++) {
            double t0 = now_s();
            k = side == 0 ? tokenizer_encode(t, text, n, 1, ids, (int)n + 2, NULL)
                          : tokenizer_encode_ref(t, text, n, 1, ids, (int)n + 2, NULL);
            double dt = now_s() - t0;
            if (dt < best[side])
                best[side] = dt;
        }
    }
    char label[64];
    snprintf(label, sizeof(label), "tokenize a %zu KiB prompt", n / 1024);
    printf("  %-31s: %9.2f ms    (%d ids; run.c's O(n^2) merge loop %.1f ms: %.1fx)\n", label,
           best[0] * 1e3, k, best[1] * 1e3, best[1] / best[0]);
    free(text);
    free(ids);
    tokenizer_destroy(&t);
    return 0;
}

static int usage(void)
{
    fprintf(stderr,
            "usage: bench_engine [--threads N] [--kernel auto|exact|fast] "
            "[--isa scalar|avx2|avx512] [--quick | --tg | --pp | --batched | --roof | --verify] "
            "[--pp-tokens N] "
            "MODEL.gguf... | --kern\n");
    return 2;
}

/* One of names (NULL-ended) as its index, or -1. */
static int pick(const char *s, const char *const *names)
{
    for (int i = 0; names[i]; i++)
        if (strcmp(s, names[i]) == 0)
            return i;
    return -1;
}

int main(int argc, char **argv)
{
    model_ctx_params cp = model_ctx_default_params();
    int quick = 0, tg = 0, pp = 0, kern = 0, batched = 0, roof = 0, verify = 0, pp_len = PP_LONG;
    int first = 1;
    static const char *const kernels[] = {"auto", "exact", "fast", NULL};
    static const char *const isas[] = {"auto", "scalar", "avx2", "avx512", NULL};
    static const model_kernel kernel_of[] = {MODEL_KERNEL_AUTO, MODEL_KERNEL_EXACT,
                                             MODEL_KERNEL_FAST};
    static const model_isa isa_of[] = {MODEL_ISA_AUTO, MODEL_ISA_SCALAR, MODEL_ISA_AVX2,
                                       MODEL_ISA_AVX512};
    for (; first < argc && strncmp(argv[first], "--", 2) == 0; first++) {
        const char *o = argv[first], *v = first + 1 < argc ? argv[first + 1] : NULL;
        if (strcmp(o, "--quick") == 0) {
            quick = 1;
        } else if (strcmp(o, "--tg") == 0) {
            tg = 1;
        } else if (strcmp(o, "--batched") == 0) {
            batched = 1;
        } else if (strcmp(o, "--pp") == 0) {
            pp = 1;
        } else if (strcmp(o, "--kern") == 0) {
            kern = 1;
        } else if (strcmp(o, "--roof") == 0) {
            roof = 1;
        } else if (strcmp(o, "--verify") == 0) {
            verify = 1;
        } else if (strcmp(o, "--pp-tokens") == 0 && v) {
            char *end;
            errno = 0;
            long n = strtol(v, &end, 10);
            if (end == v || *end || errno || n < 1 || n > 4 * PROMPT) {
                fprintf(stderr, "bench_engine: --pp-tokens '%s': not a count in [1, %d]\n", v,
                        4 * PROMPT);
                return usage();
            }
            pp_len = (int)n;
            first++;
        } else if (strcmp(o, "--threads") == 0 && v) {
            char *end;
            errno = 0;
            long n = strtol(v, &end, 10);
            if (end == v || *end || errno || n < 0 || n > 1024) { /* 0: one a CPU */
                fprintf(stderr, "bench_engine: --threads '%s': not a count in [0, 1024]\n", v);
                return usage();
            }
            cp.n_threads = (int)n;
            first++;
        } else if (strcmp(o, "--isa") == 0 && v && pick(v, isas) >= 0) {
            cp.max_isa = isa_of[pick(v, isas)];
            first++;
        } else if (strcmp(o, "--kernel") == 0 && v && pick(v, kernels) >= 0) {
            cp.kernel = kernel_of[pick(v, kernels)];
            first++;
        } else {
            if (v && (strcmp(o, "--isa") == 0 || strcmp(o, "--kernel") == 0))
                fprintf(stderr, "bench_engine: %s '%s': unknown\n", o, v);
            return usage();
        }
    }
    if (quick + tg + pp + batched + kern + roof + verify > 1 ||
        (kern ? first < argc : first == argc))
        return usage(); /* one mode; models, or --kern alone */
    if (kern) {
        /* --isa X: X alone (at most what the CPU has); else every SIMD isa it has */
        kern_isa best = kern_isa_detect(), kisas[2];
        int n_isa = 0;
        if (cp.max_isa != MODEL_ISA_AUTO) {
            kern_isa want = (kern_isa)((int)cp.max_isa - 1); /* MODEL_ISA_x = KERN_ISA_x + 1 */
            kisas[n_isa++] = want < best ? want : best;
        } else {
            if (best == KERN_ISA_AVX512)
                kisas[n_isa++] = KERN_ISA_AVX2;
            kisas[n_isa++] = best;
        }
        return bench_kern(cp.n_threads > 0 ? cp.n_threads : threadpool_default_threads(), kisas,
                          n_isa);
    }
    int rc = 0;
    for (int a = first; a < argc; a++) {
        char err[512];
        double t_load = now_s();
        model_t *m = model_load(argv[a], err, sizeof(err));
        if (!m) {
            fprintf(stderr, "bench_engine: %s\n", err);
            rc = 1;
            continue;
        }
        t_load = now_s() - t_load;
        bench b = {.m = m, .c = model_get_config(m)};
        const model_config *c = b.c;
        int big = model_matmul_bytes(m) > ((uint64_t)256 << 20);
        cp.max_tokens = 4 * PROMPT;
        kvcache_params kp = {c->n_layer, c->n_kv_head, c->head_dim, 16, 0, 48, c->n_ctx};
        kp.n_blocks = 4 * PROMPT / 16 + 32 * ((CTX + 64) / 16 + 1);
        b.kv = kvcache_new(&kp);
        b.ctx = model_ctx_new_params(m, &cp);
        b.logits = malloc((size_t)32 * c->vocab_size * sizeof(float));
        b.toks = malloc(4 * PROMPT * sizeof(int));
        if (!b.kv || !b.ctx || !b.logits || !b.toks || c->n_ctx < PROMPT) {
            fprintf(stderr, "bench_engine: %s: cannot set up (memory, or context < %d)\n", argv[a],
                    PROMPT);
            rc = 1;
            goto next;
        }
        double bytes = (double)model_matmul_bytes(m);
        if (pp) {
            double cores;
            /* warm-up: the same prompt length, as llama-bench's warm-up run, so that the
             * timed run finds the KV cache and activations paged in as a serving worker
             * does (an 8-token warm-up left 3% of the Q8_0 pp512 in first-touch page
             * clearing) */
            bench_prefill(&b, 1, pp_len, 1, &cores);
            double r = bench_prefill(&b, 1, pp_len, big ? 1 : 3, &cores);
            if (r < 0) {
                fprintf(stderr, "bench_engine: %s: forward pass failed\n", argv[a]);
                rc = 1;
            } else {
                printf("pp %s %.3f cores %.2f\n", argv[a], r, cores);
            }
            goto next;
        }
        if (verify) {
            /* --isa X: X alone; else avx2 and the best isa side by side when they differ */
            model_ctx_t *ctxs[2] = {b.ctx, NULL};
            const char *names[2] = {model_ctx_kernel_name(b.ctx), NULL};
            int nc = 1;
            if (cp.max_isa == MODEL_ISA_AUTO && kern_isa_detect() > KERN_ISA_AVX2) {
                model_ctx_params p2 = cp;
                p2.max_isa = MODEL_ISA_AVX2;
                ctxs[0] = model_ctx_new_params(m, &p2);
                ctxs[1] = b.ctx;
                names[0] = kern_isa_name(KERN_ISA_AVX2);
                names[1] = kern_isa_name(kern_isa_detect());
                nc = ctxs[0] ? 2 : 0;
            }
            if (nc == 0 || bench_verify(&b, ctxs, names, nc, big ? 15 : 63, argv[a]) != 0) {
                fprintf(stderr, "bench_engine: %s: forward pass failed\n", argv[a]);
                rc = 1;
            }
            if (nc == 2)
                model_ctx_destroy(&ctxs[0]);
            goto next;
        }
        if (roof) {
            double cores, bw = 0;
            bench_prefill(&b, 1, 8, 1, &cores); /* warm-up */
            uint64_t *rbuf = rb_buffer();
            double d = rbuf ? bench_decode_rb(&b, b.ctx, 1, big ? 32 : 64, &cores, rbuf, &bw) : -1;
            free(rbuf);
            if (d < 0) {
                fprintf(stderr, "bench_engine: %s: forward pass failed\n", argv[a]);
                rc = 1;
            } else {
                printf("roof %s %.3f tok/s, bound %.3f tok/s (%.2f GB/s read / %.1f MB): %.1f%%\n",
                       argv[a], d, bw / bytes, bw / 1e9, bytes / 1e6, 100.0 * d * bytes / bw);
            }
            goto next;
        }
        if (tg) {
            double cores;
            bench_prefill(&b, 1, 8, 1, &cores); /* warm-up */
            double d = bench_decode(&b, b.ctx, 1, big ? 32 : 64, &cores);
            if (d < 0) {
                fprintf(stderr, "bench_engine: %s: forward pass failed\n", argv[a]);
                rc = 1;
            } else {
                printf("tg %s %.3f\n", argv[a], d);
            }
            goto next;
        }
        if (batched) {
            double cores;
            bench_prefill(&b, 1, 8, 1, &cores); /* warm-up */
            const int Bs[] = {1, 8, 32};
            double r[3], cpu[3], cut[3];
            if (bench_decode_mix(&b, b.ctx, Bs, 3, big ? 2 : 64, r, cpu, cut) != 0) {
                fprintf(stderr, "bench_engine: %s: forward pass failed\n", argv[a]);
                rc = 1;
                goto next;
            }
            for (int i = 0; i < 3; i++)
                printf("bd %s %d %.3f cpu_us_per_token %.2f preempted %.2f\n", argv[a], Bs[i],
                       r[i], cpu[i], cut[i]);
            goto next;
        }
        printf("\n%s: %s, %s weights (%.1f MB read per forward pass), dim %d, %d layers, "
               "kernels %s, %d threads, loaded in %.1f s\n",
               argv[a], c->name, weight_type(m, c), bytes / 1e6, c->dim, c->n_layer,
               model_ctx_kernel_name(b.ctx), model_ctx_n_threads(b.ctx), t_load);
        int reps = quick ? 1 : big ? 2 : 5;
        int dsteps1 = big ? (quick ? 3 : 15) : 64;
        /* warm-up: page in the weights, grow the threads' stacks */
        double cu[7] = {0};
        bench_prefill(&b, 1, 8, 1, &cu[0]);
        double p1 = bench_prefill(&b, 1, PROMPT, reps, &cu[0]);
        double p4 = bench_prefill(&b, 4, PROMPT, reps, &cu[1]);
        double p512 = bench_prefill(&b, 1, PP_LONG, big ? 1 : reps, &cu[6]);
        /* the bound is measured side by side with the batch-1 run it bounds, a read pass
         * before each step (the machine may be shared: its bandwidth changes by the
         * minute); the best-of read rate is printed for reference. A small model's
         * weights stay in cache: its bound is only that best-of rate. */
        double bw_best = read_bandwidth(model_ctx_n_threads(b.ctx)), bw = bw_best;
        uint64_t *rbuf = big ? rb_buffer() : NULL;
        double d1 = rbuf ? bench_decode_rb(&b, b.ctx, 1, dsteps1, &cu[2], rbuf, &bw)
                         : bench_decode(&b, b.ctx, 1, dsteps1, &cu[2]);
        free(rbuf);
        /* aggregate decode, time-sliced (bench_decode_mix): batch 1, 8, 32 side by side */
        const int Bs[] = {1, 8, 32};
        double mr[3], mcpu[3], mcut[3];
        int rounds = big ? (quick ? 1 : 2) : (quick ? 16 : 64);
        int mix = bench_decode_mix(&b, b.ctx, Bs, 3, rounds, mr, mcpu, mcut);
        /* thread scaling where it is compute-bound: batch 8 on one thread */
        double d8_1 = -1, c8_1 = 0, x8_1 = 0;
        if (model_ctx_n_threads(b.ctx) > 1) {
            model_ctx_params one = cp;
            one.n_threads = 1;
            model_ctx_t *c1 = model_ctx_new_params(m, &one);
            if (!c1 || bench_decode_mix(&b, c1, &Bs[1], 1, rounds, &d8_1, &c8_1, &x8_1) != 0)
                d8_1 = -1;
            model_ctx_destroy(&c1);
        }
        if (p1 < 0 || p4 < 0 || p512 < 0 || d1 < 0 || mix != 0) {
            fprintf(stderr, "bench_engine: %s: forward pass failed\n", argv[a]);
            rc = 1;
            goto next;
        }
        double bound = bw / bytes;
        printf("  (cores: CPU time / wall time of the run; below the thread count when the "
               "machine is shared)\n");
        printf("  prefill 1 x %d tokens          : %9.1f tok/s  %21s [%.1f cores]\n", PROMPT, p1,
               "", cu[0]);
        printf(
            "  prefill 4 x %d tokens, 1 call  : %9.1f tok/s  (%5.2fx of 1 prompt)  [%.1f cores]\n",
            PROMPT, p4, p4 / p1, cu[1]);
        printf("  prefill 1 x %d tokens          : %9.1f tok/s  %21s [%.1f cores]\n", PP_LONG, p512,
               "", cu[6]);
        printf("  decode batch  1, ctx %d        : %9.1f tok/s  (median step) %7s [%.1f cores]\n",
               CTX, d1, "", cu[2]);
        printf("  (decode batch 1 / 8 / 32 time-sliced, tokens / wall: chunks of 32 tokens of "
               "each in turn, %d rounds)\n",
               rounds);
        for (int i = 0; i < 3; i++)
            printf("  decode batch %2d, ctx %d        : %9.1f tok/s  (%5.2fx of batch 1)   "
                   "[%.1f us CPU/token, %.0f%% of steps preempted]\n",
                   Bs[i], CTX, mr[i], mr[i] / mr[0], mcpu[i], 100.0 * mcut[i]);
        if (d8_1 > 0)
            printf("  decode batch  8, 1 thread      : %9.1f tok/s  (%d threads: %4.2fx)    [%.1f "
                   "us CPU/token]\n",
                   d8_1, model_ctx_n_threads(b.ctx), mr[1] / d8_1, c8_1);
        printf("  batch-1 decode read roofline   : %9.1f tok/s  (%.2f GB/s read / %.1f MB); "
               "achieved %.0f%%\n",
               bound, bw / 1e9, bytes / 1e6, 100.0 * d1 / bound);
        printf("  (read bandwidth: %d threads streaming through 1 GiB before each batch-1 step, "
               "median; best of %d before the run: %.2f GB/s, %.0f%%)\n",
               model_ctx_n_threads(b.ctx), RB_REPS, bw_best / 1e9,
               100.0 * d1 / (bw_best / bytes));
        bench_tokenizer(argv[a], quick ? 8192 : 32768);
    next:
        free(b.logits);
        free(b.toks);
        model_ctx_destroy(&b.ctx);
        kvcache_destroy(&b.kv);
        model_destroy(&m);
        fflush(stdout);
    }
    return rc;
}
