/*
 * kernels: see kernels.h.
 *
 * This file: the reference kernels (portable C, the definition of each order), the
 * run-time choice of instruction set, and the dispatch to the x86 kernels of
 * kernels_x86.c (AVX2 and AVX-512, compiled with target attributes whatever the build
 * flags, used only when cpuid says so).
 *
 * No FMA contraction: the build uses -std=c11, under which GCC does not contract a * b + c
 * (-ffp-contract=off); the EXACT order depends on it, and the tests compare every kernel
 * against the reference bit for bit.
 */
#include "kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels_internal.h"

static inline float f16_to_f32(const void *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return gguf_fp16_to_fp32(h);
}

const char *kern_order_name(kern_order order)
{
    return order == KERN_ORDER_FAST ? "fast" : "exact";
}

const char *kern_isa_name(kern_isa isa)
{
    return isa == KERN_ISA_AVX512 ? "avx512" : isa == KERN_ISA_AVX2 ? "avx2" : "scalar";
}

#ifdef KERN_HAVE_X86
#ifdef __clang__
#include <cpuid.h>
/* clang 14's __builtin_cpu_supports does not know "f16c" (the fuzzing build, make fuzz):
 * CPUID.1:ECX bit 29; the OS side is AVX's, checked with avx2 */
static int have_f16c(void)
{
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
}
#else
static int have_f16c(void)
{
    return __builtin_cpu_supports("f16c");
}
#endif
#endif

kern_isa kern_isa_detect(void)
{
#ifdef KERN_HAVE_X86
    /* libgcc's checks include the OS (XGETBV) enabling the AVX and AVX-512 state */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && have_f16c()) {
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
            __builtin_cpu_supports("avx512vnni"))
            return KERN_ISA_AVX512;
        return KERN_ISA_AVX2;
    }
#endif
    return KERN_ISA_SCALAR;
}

/* AVX-512 scratch: PACK_T tokens packed in pairs (floats, or Q8 bytes + pair scales);
 * the reference kernels: a row as floats. */
size_t kern_scratch_floats(int n)
{
    size_t f = (size_t)PACK_T * (size_t)n; /* float pairs */
    size_t q = (size_t)PACK_T * (size_t)n / 4 + (size_t)PACK_T * (size_t)n / 32 * 8; /* Q8 */
    return (f > q ? f : q) + 16; /* + alignment slack */
}

/* ------------------------------------------------------------------------------------- */
/* reference kernels */

float kern_dot_exact_f32(const float *w, const float *x, int n)
{
    float s = 0.0f;
    for (int j = 0; j < n; j++)
        s += w[j] * x[j];
    return s;
}

static inline float hsum8_ref(const float *a)
{
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

float kern_dot_fast_f32(const float *w, const float *x, int n)
{
    float acc[8] = {0};
    int n8 = n & ~7;
    for (int j = 0; j < n8; j += 8)
        for (int k = 0; k < 8; k++)
            acc[k] = fmaf(w[j + k], x[j + k], acc[k]);
    float s = hsum8_ref(acc);
    for (int j = n8; j < n; j++)
        s = fmaf(w[j], x[j], s);
    return s;
}

float kern_dot_q8_0(const void *w_blocks, const float *x_d, const int8_t *x_s, int n)
{
    const uint8_t *wb = w_blocks;
    float acc[8] = {0};
    for (int b = 0; b < n / KERN_Q8_BLOCK; b++, wb += KERN_Q8_BLOCK_BYTES) {
        const int8_t *wq = (const int8_t *)(wb + 2);
        const int8_t *xq = x_s + (size_t)b * KERN_Q8_BLOCK;
        float d = f16_to_f32(wb) * x_d[b];
        for (int k = 0; k < 8; k++) {
            int32_t p = 0;
            for (int e = 4 * k; e < 4 * k + 4; e++)
                p += (int32_t)wq[e] * (int32_t)xq[e];
            acc[k] = fmaf(d, (float)p, acc[k]);
        }
    }
    return hsum8_ref(acc);
}

// --- the Q8X8 layout (kernels.h)

size_t kern_q8x8_group_bytes(int cols)
{
    return kern_q8x8_gbytes(cols / KERN_Q8_BLOCK);
}

size_t kern_q8x8_bytes(int rows, int cols)
{
    if (rows < 8 || rows % 8 != 0 || cols < KERN_Q8_BLOCK || cols % KERN_Q8_BLOCK != 0)
        return 0;
    return (size_t)(rows / 8) * kern_q8x8_group_bytes(cols);
}

int kern_q8x8_pack(const kern_mat *src, void *dst, int g0, int g1, kern_mat *out)
{
    if (src->type != GGUF_TENSOR_Q8_0 || src->layout != KERN_LAYOUT_GGUF ||
        kern_q8x8_bytes(src->rows, src->cols) == 0 || g0 < 0 || g1 > src->rows / 8)
        return -1;
    const int nb = src->cols / KERN_Q8_BLOCK;
    const size_t ws = kern_row_bytes(src), gs = kern_q8x8_gbytes(nb), so = kern_q8x8_sbytes(nb);
    for (int g = g0; g < g1; g++) {
        /* no quant -128 (0x80): the Q8X8 kernels negate weights (kernels.h) */
        for (int r = 0; r < 8; r++) {
            const uint8_t *row = (const uint8_t *)src->data + ((size_t)g * 8 + r) * ws;
            for (int b = 0; b < nb; b++)
                if (memchr(row + (size_t)b * KERN_Q8_BLOCK_BYTES + 2, 0x80, KERN_Q8_BLOCK))
                    return -1;
        }
        uint8_t *o = (uint8_t *)dst + (size_t)g * gs;
        memset(o + (size_t)nb * 16, 0, so - (size_t)nb * 16); /* padding */
        for (int r = 0; r < 8; r++) {
            const uint8_t *row = (const uint8_t *)src->data + ((size_t)g * 8 + r) * ws;
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = row + (size_t)b * KERN_Q8_BLOCK_BYTES;
                memcpy(o + (size_t)b * 16 + 2 * r, blk, 2);
                memcpy(o + so + (size_t)b * 256 + 32 * r, blk + 2, KERN_Q8_BLOCK);
            }
        }
    }
    *out = *src;
    out->data = dst;
    out->layout = KERN_LAYOUT_Q8X8;
    return 0;
}

/* Row i of a Q8X8 matrix back in GGUF blocks (cols / 32 * 34 bytes at dst). */
static void q8x8_row(const kern_mat *w, int i, uint8_t *dst)
{
    const int nb = w->cols / KERN_Q8_BLOCK, r = i % 8;
    const uint8_t *g = (const uint8_t *)w->data + (size_t)(i / 8) * kern_q8x8_gbytes(nb);
    const size_t so = kern_q8x8_sbytes(nb);
    for (int b = 0; b < nb; b++) {
        memcpy(dst + (size_t)b * KERN_Q8_BLOCK_BYTES, g + (size_t)b * 16 + 2 * r, 2);
        memcpy(dst + (size_t)b * KERN_Q8_BLOCK_BYTES + 2, g + so + (size_t)b * 256 + 32 * r,
               KERN_Q8_BLOCK);
    }
}

void kern_row_gguf(const kern_mat *w, int i, void *dst)
{
    if (w->layout == KERN_LAYOUT_Q8X8)
        q8x8_row(w, i, dst);
    else
        memcpy(dst, (const uint8_t *)w->data + (size_t)i * kern_row_bytes(w), kern_row_bytes(w));
}

void kern_dequant_row(const kern_mat *w, int i, float *out)
{
    const uint8_t *row = (const uint8_t *)w->data + (size_t)i * kern_row_bytes(w);
    int n = w->cols;
    if (w->layout == KERN_LAYOUT_Q8X8) {
        const int nb = n / KERN_Q8_BLOCK;
        const uint8_t *g = (const uint8_t *)w->data + (size_t)(i / 8) * kern_q8x8_gbytes(nb);
        const size_t so = kern_q8x8_sbytes(nb);
        for (int b = 0; b < nb; b++) {
            float d = f16_to_f32(g + (size_t)b * 16 + 2 * (i % 8));
            const int8_t *q = (const int8_t *)(g + so + (size_t)b * 256 + 32 * (i % 8));
            for (int e = 0; e < KERN_Q8_BLOCK; e++)
                out[b * KERN_Q8_BLOCK + e] = d * (float)q[e];
        }
        return;
    }
    switch (w->type) {
    case GGUF_TENSOR_F32:
        memcpy(out, row, (size_t)n * sizeof(float));
        break;
    case GGUF_TENSOR_F16:
        for (int j = 0; j < n; j++)
            out[j] = f16_to_f32(row + 2 * (size_t)j);
        break;
    case GGUF_TENSOR_Q8_0:
        for (int b = 0; b < n / KERN_Q8_BLOCK; b++) {
            const uint8_t *blk = row + (size_t)b * KERN_Q8_BLOCK_BYTES;
            float d = f16_to_f32(blk);
            for (int e = 0; e < KERN_Q8_BLOCK; e++)
                out[b * KERN_Q8_BLOCK + e] = d * (float)((const int8_t *)(blk + 2))[e];
        }
        break;
    }
}

void kern_quantize_q8_0(const float *x, int n, void *dst)
{
    uint8_t *o = dst;
    for (int b = 0; b < n / KERN_Q8_BLOCK; b++, o += KERN_Q8_BLOCK_BYTES) {
        const float *xb = x + (size_t)b * KERN_Q8_BLOCK;
        float amax = 0.0f;
        for (int e = 0; e < KERN_Q8_BLOCK; e++)
            amax = fmaxf(amax, fabsf(xb[e]));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t h = gguf_fp32_to_fp16(d);
        memcpy(o, &h, 2);
        for (int e = 0; e < KERN_Q8_BLOCK; e++)
            ((int8_t *)(o + 2))[e] = (int8_t)roundf(xb[e] * id);
    }
}

static void quantize_act_ref(const float *x, int T, int n, float *q_d, int8_t *q_s)
{
    int nb = n / KERN_Q8_BLOCK;
    for (int t = 0; t < T; t++) {
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)t * n + (size_t)b * KERN_Q8_BLOCK;
            int8_t *qs = q_s + (size_t)t * n + (size_t)b * KERN_Q8_BLOCK;
            float amax = 0.0f;
            for (int e = 0; e < KERN_Q8_BLOCK; e++)
                amax = fmaxf(amax, fabsf(xb[e]));
            float d = amax / 127.0f;
            float id = d != 0.0f ? 1.0f / d : 0.0f;
            q_d[(size_t)t * nb + b] = d;
            for (int e = 0; e < KERN_Q8_BLOCK; e++)
                qs[e] = (int8_t)nearbyintf(xb[e] * id); /* ties to even, as cvtps2dq */
        }
    }
}

/* Weight row i as floats: the mapped row for F32, else widened into buf (F16). */
static const float *row_f32(const kern_mat *w, int i, float *buf)
{
    if (w->type == GGUF_TENSOR_F32)
        return (const float *)w->data + (size_t)i * (size_t)w->cols;
    kern_dequant_row(w, i, buf);
    return buf;
}

/* EXACT order (F16 weights on any isa, F32 without AVX2): four tokens at a time give four
 * independent chains. */
static void matmul_exact(const kern_mat *w, const kern_act *a, int r0, int r1, float *const *out,
                         float *scratch)
{
    const int n = a->n, T = a->T;
    for (int i = r0; i < r1; i++) {
        const float *wr = row_f32(w, i, scratch);
        int t = 0;
        for (; t + 4 <= T; t += 4) {
            const float *x0 = a->x + (size_t)t * n, *x1 = x0 + n, *x2 = x1 + n, *x3 = x2 + n;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            for (int j = 0; j < n; j++) {
                float wj = wr[j];
                s0 += wj * x0[j];
                s1 += wj * x1[j];
                s2 += wj * x2[j];
                s3 += wj * x3[j];
            }
            out[t][i] = s0;
            out[t + 1][i] = s1;
            out[t + 2][i] = s2;
            out[t + 3][i] = s3;
        }
        for (; t < T; t++)
            out[t][i] = kern_dot_exact_f32(wr, a->x + (size_t)t * n, n);
    }
}

static void matmul_fast_ref(const kern_mat *w, const kern_act *a, int r0, int r1, float *const *out,
                            float *scratch)
{
    for (int i = r0; i < r1; i++) {
        const float *wr = row_f32(w, i, scratch);
        for (int t = 0; t < a->T; t++)
            out[t][i] = kern_dot_fast_f32(wr, a->x + (size_t)t * a->n, a->n);
    }
}

/* Either layout: a Q8X8 row is gathered back into GGUF blocks in the scratch first. */
static void matmul_q8_ref(const kern_mat *w, const kern_act *a, int r0, int r1, float *const *out,
                          float *scratch)
{
    const int n = a->n, nb = n / KERN_Q8_BLOCK;
    const size_t rb = kern_row_bytes(w);
    for (int i = r0; i < r1; i++) {
        const uint8_t *wr = (const uint8_t *)w->data + (size_t)i * rb;
        if (w->layout == KERN_LAYOUT_Q8X8) {
            q8x8_row(w, i, (uint8_t *)scratch);
            wr = (const uint8_t *)scratch;
        }
        for (int t = 0; t < a->T; t++)
            out[t][i] = kern_dot_q8_0(wr, a->q_d + (size_t)t * nb, a->q_s + (size_t)t * n, n);
    }
}

/* ------------------------------------------------------------------------------------- */
/* attention helpers */

static void dot_rows_ref(kern_order order, const float *q, const float *k, size_t k_stride,
                         int n_rows, int n, float *out)
{
    for (int r = 0; r < n_rows; r++)
        out[r] = order == KERN_ORDER_FAST ? kern_dot_fast_f32(q, k + (size_t)r * k_stride, n)
                                          : kern_dot_exact_f32(q, k + (size_t)r * k_stride, n);
}

static void axpy_rows_ref(float *y, const float *a, const float *x, size_t x_stride, int n_rows,
                          int n)
{
    for (int r = 0; r < n_rows; r++) {
        const float *xr = x + (size_t)r * x_stride;
        float ar = a[r];
        for (int i = 0; i < n; i++)
            y[i] += ar * xr[i];
    }
}

void kern_dot_rows(kern_isa isa, kern_order order, const float *q, const float *k, size_t k_stride,
                   int n_rows, int n, float *out)
{
#ifdef KERN_HAVE_X86
    if (isa >= KERN_ISA_AVX2 && order == KERN_ORDER_FAST) {
        kern_x86_dot_rows_fast_avx2(q, k, k_stride, n_rows, n, out);
        return;
    }
#endif
    dot_rows_ref(order, q, k, k_stride, n_rows, n, out);
}

void kern_axpy_rows(kern_isa isa, float *y, const float *a, const float *x, size_t x_stride,
                    int n_rows, int n)
{
#ifdef KERN_HAVE_X86
    if (isa >= KERN_ISA_AVX2) {
        kern_x86_axpy_rows_avx2(y, a, x, x_stride, n_rows, n);
        return;
    }
#endif
    axpy_rows_ref(y, a, x, x_stride, n_rows, n);
}

void kern_dot_heads(kern_isa isa, kern_order order, const float *q, int nq, size_t q_stride,
                    const float *k, size_t k_stride, int n_rows, int n, float *out,
                    size_t out_stride)
{
#ifdef KERN_HAVE_X86
    if (isa >= KERN_ISA_AVX2 && order == KERN_ORDER_FAST && n % 8 == 0) {
        kern_x86_dot_heads_fast_avx2(q, nq, q_stride, k, k_stride, n_rows, n, out, out_stride);
        return;
    }
#endif
    for (int h = 0; h < nq; h++)
        kern_dot_rows(isa, order, q + (size_t)h * q_stride, k, k_stride, n_rows, n,
                      out + (size_t)h * out_stride);
}

void kern_axpy_heads(kern_isa isa, float *y, int nq, size_t y_stride, const float *a,
                     size_t a_stride, const float *x, size_t x_stride, int n_rows, int n)
{
#ifdef KERN_HAVE_X86
    if (isa >= KERN_ISA_AVX2 && n % 32 == 0) {
        kern_x86_axpy_heads_avx2(y, nq, y_stride, a, a_stride, x, x_stride, n_rows, n);
        return;
    }
#endif
    for (int h = 0; h < nq; h++)
        kern_axpy_rows(isa, y + (size_t)h * y_stride, a + (size_t)h * a_stride, x, x_stride,
                       n_rows, n);
}

/* ------------------------------------------------------------------------------------- */
/* dispatch */

/* Packed buffer: [floats: P * (n/8) * 16][Q8 bytes: P * (n/32) * 64][Q8 scales: P * (n/32)
 * * 16 floats], P = (T + 1) / 2 pairs, each region 64-byte aligned. */
static size_t up64(size_t b)
{
    return (b + 63) & ~(size_t)63;
}

size_t kern_pack_bytes(int T, int n)
{
    size_t P = ((size_t)T + 1) / 2, nb = (size_t)n / KERN_Q8_BLOCK;
    return up64(P * ((size_t)n / 8) * 16 * sizeof(float)) + up64(P * nb * 64) +
           up64(P * nb * 16 * sizeof(float)) + 64;
}

void kern_pack_bind(kern_isa isa, kern_act *a, int f32, int q8, void *buf)
{
    a->xp = NULL;
    a->qp = NULL;
    a->dp = NULL;
    if (isa < KERN_ISA_AVX512 || a->T < 2 || !buf)
        return;
    size_t P = ((size_t)a->T + 1) / 2, nb = (size_t)a->n / KERN_Q8_BLOCK;
    uint8_t *b = (uint8_t *)(((uintptr_t)buf + 63) & ~(uintptr_t)63);
    uint8_t *q = b + up64(P * ((size_t)a->n / 8) * 16 * sizeof(float));
    uint8_t *d = q + up64(P * nb * 64);
    if (f32)
        a->xp = (const float *)b;
    if (q8 && a->q_s) {
        a->qp = q;
        a->dp = (const float *)d;
    }
}

void kern_pack_act(kern_isa isa, const kern_act *a, int t0, int t1)
{
#ifdef KERN_HAVE_X86
    if (isa < KERN_ISA_AVX512 || t0 >= t1)
        return;
    const int n = a->n, nb = n / KERN_Q8_BLOCK, nt = t1 - t0;
    const size_t p0 = (size_t)t0 / 2;
    if (a->xp)
        kern_x86_pack_pairs_f32(a->x + (size_t)t0 * n, n, nt, (float *)a->xp + p0 * (n / 8) * 16);
    if (a->qp)
        kern_x86_pack_pairs_q8(a->q_d + (size_t)t0 * nb, a->q_s + (size_t)t0 * n, n, nt,
                               (uint8_t *)a->qp + p0 * nb * 64, (float *)a->dp + p0 * nb * 16);
#endif
}

void kern_matmul(kern_isa isa, kern_order order, const kern_mat *w, const kern_act *a, int r0,
                 int r1, float *const *out, float *scratch)
{
    if (r0 >= r1 || a->T < 1)
        return;
    const int q8 = w->type == GGUF_TENSOR_Q8_0;
    if (!q8 && order == KERN_ORDER_EXACT) {
#ifdef KERN_HAVE_X86
        if (isa >= KERN_ISA_AVX2 && w->type == GGUF_TENSOR_F32) {
            kern_x86_matmul_exact_avx2(w, a, r0, r1, out, scratch);
            return;
        }
#endif
        matmul_exact(w, a, r0, r1, out, scratch);
        return;
    }
#ifdef KERN_HAVE_X86
    if (isa == KERN_ISA_AVX512 && q8) {
        kern_x86_matmul_q8_avx512(w, a, r0, r1, out, scratch);
        return;
    }
    /* batch 1 is bound by memory bandwidth: the AVX2 kernels reach it. F32/F16 without
     * packed pairs and without a scratch to pack them into: AVX2 (the same bits). */
    if (isa == KERN_ISA_AVX512 && a->T >= 2) {
        if (a->xp && a->T >= F512_MIN_T) {
            kern_x86_matmul_fast_avx512(w, a, r0, r1, out);
            return;
        }
        if (scratch || a->xp) {
            kern_x86_matmul_avx512(w, a, r0, r1, out, scratch);
            return;
        }
    }
    if (isa >= KERN_ISA_AVX2) {
        if (q8 && w->layout == KERN_LAYOUT_Q8X8)
            kern_x86_matmul_q8x8_avx2(w, a, r0, r1, out);
        else if (q8)
            kern_x86_matmul_q8_avx2(w, a, r0, r1, out);
        else
            kern_x86_matmul_fast_avx2(w, a, r0, r1, out, scratch);
        return;
    }
#endif
    if (q8)
        matmul_q8_ref(w, a, r0, r1, out, scratch);
    else
        matmul_fast_ref(w, a, r0, r1, out, scratch);
}

void kern_quantize_act(kern_isa isa, const float *x, int T, int n, float *q_d, int8_t *q_s)
{
#ifdef KERN_HAVE_X86
    if (isa >= KERN_ISA_AVX2) {
        kern_x86_quantize_act_avx2(x, T, n, q_d, q_s);
        return;
    }
#endif
    quantize_act_ref(x, T, n, q_d, q_s);
}
