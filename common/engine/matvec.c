/*
 * matvec: see matvec.h. The reference kernel is the definition (one chain per output
 * element over the packed layout); the AVX2 kernel runs four groups of 8 rows at once
 * (four independent chains per lane hide the latency of the adds) for two tokens at a
 * time (the weight loads shared), compiled with a target
 * attribute whatever the build flags and used only when the caller's isa says so. No FMA
 * contraction: -std=c11 builds with -ffp-contract=off, and the intrinsics are separate
 * multiplies and adds.
 */
#include "matvec.h"

#include <math.h>
#include <string.h>

#include "kernels_internal.h"

#ifdef KERN_HAVE_X86
#include <immintrin.h>
#endif

size_t matvec_packed_floats(int rows, int n)
{
    return (size_t)((rows + MATVEC_GROUP - 1) / MATVEC_GROUP) * MATVEC_GROUP * (size_t)n;
}

void matvec_pack_f32(const float *w, int rows, int n, float *dst)
{
    const int G = (rows + MATVEC_GROUP - 1) / MATVEC_GROUP;
    for (int g = 0; g < G; g++)
        for (int j = 0; j < n; j++)
            for (int e = 0; e < MATVEC_GROUP; e++) {
                int i = g * MATVEC_GROUP + e;
                dst[((size_t)g * n + j) * MATVEC_GROUP + e] = i < rows ? w[(size_t)i * n + j] : 0.0f;
            }
}

static void matvec_ref(const float *wp, int n, const float *x, int T, int r0, int r1,
                       float *const *out)
{
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * n;
        for (int i = r0; i < r1; i++) {
            const float *col = wp + (size_t)(i / MATVEC_GROUP) * n * MATVEC_GROUP + i % MATVEC_GROUP;
            float s = 0.0f;
            for (int j = 0; j < n; j++)
                s += col[(size_t)j * MATVEC_GROUP] * xt[j];
            out[t][i] = s;
        }
    }
}

#ifdef KERN_HAVE_X86
#define TGT __attribute__((target("avx2,fma,f16c")))

/* Lanes of acc to out[i, i + 8), clipped at r1. */
static TGT inline void store_group(float *o, int i, int r1, __m256 acc)
{
    if (i + MATVEC_GROUP <= r1) {
        _mm256_storeu_ps(o + i, acc);
        return;
    }
    float lanes[MATVEC_GROUP] __attribute__((aligned(32)));
    _mm256_store_ps(lanes, acc);
    for (int e = 0; i + e < r1; e++)
        o[i + e] = lanes[e];
}

static TGT void matvec_avx2(const float *wp, int n, const float *x, int T, int r0, int r1,
                            float *const *out)
{
    const size_t gs = (size_t)n * MATVEC_GROUP; /* floats per group */
    int t = 0;
    /* two tokens at a time share the weight loads: 4 groups x 2 tokens = 8 chains */
    for (; t + 2 <= T; t += 2) {
        const float *xa = x + (size_t)t * n, *xb = xa + n;
        float *oa = out[t], *ob = out[t + 1];
        int i = r0;
        for (; i + 3 * MATVEC_GROUP < r1; i += 4 * MATVEC_GROUP) {
            const float *w0 = wp + (size_t)(i / MATVEC_GROUP) * gs;
            const float *w1 = w0 + gs, *w2 = w1 + gs, *w3 = w2 + gs;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int j = 0; j < n; j++) {
                __m256 va = _mm256_broadcast_ss(xa + j), vb = _mm256_broadcast_ss(xb + j);
                size_t o8 = (size_t)j * MATVEC_GROUP;
                __m256 g0 = _mm256_load_ps(w0 + o8), g1 = _mm256_load_ps(w1 + o8);
                __m256 g2 = _mm256_load_ps(w2 + o8), g3 = _mm256_load_ps(w3 + o8);
                a0 = _mm256_add_ps(a0, _mm256_mul_ps(g0, va));
                a1 = _mm256_add_ps(a1, _mm256_mul_ps(g1, va));
                a2 = _mm256_add_ps(a2, _mm256_mul_ps(g2, va));
                a3 = _mm256_add_ps(a3, _mm256_mul_ps(g3, va));
                b0 = _mm256_add_ps(b0, _mm256_mul_ps(g0, vb));
                b1 = _mm256_add_ps(b1, _mm256_mul_ps(g1, vb));
                b2 = _mm256_add_ps(b2, _mm256_mul_ps(g2, vb));
                b3 = _mm256_add_ps(b3, _mm256_mul_ps(g3, vb));
            }
            store_group(oa, i, r1, a0);
            store_group(oa, i + MATVEC_GROUP, r1, a1);
            store_group(oa, i + 2 * MATVEC_GROUP, r1, a2);
            store_group(oa, i + 3 * MATVEC_GROUP, r1, a3);
            store_group(ob, i, r1, b0);
            store_group(ob, i + MATVEC_GROUP, r1, b1);
            store_group(ob, i + 2 * MATVEC_GROUP, r1, b2);
            store_group(ob, i + 3 * MATVEC_GROUP, r1, b3);
        }
        for (; i < r1; i += MATVEC_GROUP) {
            const float *w0 = wp + (size_t)(i / MATVEC_GROUP) * gs;
            __m256 a0 = _mm256_setzero_ps(), b0 = a0;
            for (int j = 0; j < n; j++) {
                __m256 g0 = _mm256_load_ps(w0 + (size_t)j * MATVEC_GROUP);
                a0 = _mm256_add_ps(a0, _mm256_mul_ps(g0, _mm256_broadcast_ss(xa + j)));
                b0 = _mm256_add_ps(b0, _mm256_mul_ps(g0, _mm256_broadcast_ss(xb + j)));
            }
            store_group(oa, i, r1, a0);
            store_group(ob, i, r1, b0);
        }
    }
    for (; t < T; t++) {
        const float *xt = x + (size_t)t * n;
        float *o = out[t];
        int i = r0;
        for (; i + 3 * MATVEC_GROUP < r1; i += 4 * MATVEC_GROUP) {
            const float *w0 = wp + (size_t)(i / MATVEC_GROUP) * gs;
            const float *w1 = w0 + gs, *w2 = w1 + gs, *w3 = w2 + gs;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int j = 0; j < n; j++) {
                __m256 xv = _mm256_broadcast_ss(xt + j);
                size_t o8 = (size_t)j * MATVEC_GROUP;
                a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_load_ps(w0 + o8), xv));
                a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_load_ps(w1 + o8), xv));
                a2 = _mm256_add_ps(a2, _mm256_mul_ps(_mm256_load_ps(w2 + o8), xv));
                a3 = _mm256_add_ps(a3, _mm256_mul_ps(_mm256_load_ps(w3 + o8), xv));
            }
            store_group(o, i, r1, a0);
            store_group(o, i + MATVEC_GROUP, r1, a1);
            store_group(o, i + 2 * MATVEC_GROUP, r1, a2);
            store_group(o, i + 3 * MATVEC_GROUP, r1, a3);
        }
        for (; i < r1; i += MATVEC_GROUP) {
            const float *w0 = wp + (size_t)(i / MATVEC_GROUP) * gs;
            __m256 a0 = _mm256_setzero_ps();
            for (int j = 0; j < n; j++)
                a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_load_ps(w0 + (size_t)j * MATVEC_GROUP),
                                                     _mm256_broadcast_ss(xt + j)));
            store_group(o, i, r1, a0);
        }
    }
}
#endif

static void scores_ref(const float *q, int n_q, const float *k, size_t k_stride, int r0,
                       int n_rows, int n, float *out, size_t out_stride)
{
    for (int h = 0; h < n_q; h++)
        for (int r = r0; r < n_rows; r++) {
            const float *qh = q + (size_t)h * n, *kr = k + (size_t)r * k_stride;
            float s = 0.0f;
            for (int j = 0; j < n; j++)
                s += qh[j] * kr[j];
            out[(size_t)h * out_stride + r] = s;
        }
}

#ifdef KERN_HAVE_X86
/* Transpose 8 rows of 8 floats: on return r[j] holds element j of rows 0..7. */
static TGT inline void transpose8(__m256 r[8])
{
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* Rows [0, n_rows & ~7): up to 4 heads per pass over the K rows. */
static TGT int scores_avx2(const float *q, int n_q, const float *k, size_t k_stride, int n_rows,
                           int n, float *out, size_t out_stride)
{
    const int R = n_rows & ~7;
    for (int h0 = 0; h0 < n_q; h0 += 4) {
        const int nh = n_q - h0 < 4 ? n_q - h0 : 4;
        for (int r = 0; r < R; r += 8) {
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                             _mm256_setzero_ps()};
            for (int j0 = 0; j0 < n; j0 += 8) {
                __m256 col[8];
                for (int e = 0; e < 8; e++)
                    col[e] = _mm256_loadu_ps(k + (size_t)(r + e) * k_stride + j0);
                transpose8(col);
                for (int h = 0; h < nh; h++) {
                    const float *qh = q + (size_t)(h0 + h) * n + j0;
                    for (int j = 0; j < 8; j++)
                        acc[h] = _mm256_add_ps(acc[h],
                                               _mm256_mul_ps(_mm256_broadcast_ss(qh + j), col[j]));
                }
            }
            for (int h = 0; h < nh; h++)
                _mm256_storeu_ps(out + (size_t)(h0 + h) * out_stride + r, acc[h]);
        }
    }
    return R;
}
#endif

#ifdef KERN_HAVE_X86
/* na = n_q * (n / 8) <= 8 accumulators, kept in registers (constant-bound loops with
 * guards, fully unrolled). */
static TGT void values_avx2(float *y, int n_q, const float *a, size_t a_stride, const float *x,
                            size_t x_stride, int n_rows, int n)
{
    const int nc = n / 8, na = n_q * nc;
    __m256 acc[8];
    const float *ah[8];
    int off[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        acc[k] = k < na ? _mm256_loadu_ps(y + (size_t)k * 8) : _mm256_setzero_ps();
        ah[k] = a + (size_t)(k < na ? k / nc : 0) * a_stride; /* head of accumulator k */
        off[k] = k < na ? (k % nc) * 8 : 0;                  /* its columns */
    }
    for (int r = 0; r < n_rows; r++) {
        const float *xr = x + (size_t)r * x_stride;
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++)
            if (k < na)
                acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(_mm256_broadcast_ss(ah[k] + r),
                                                             _mm256_loadu_ps(xr + off[k])));
    }
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++)
        if (k < na)
            _mm256_storeu_ps(y + (size_t)k * 8, acc[k]);
}
#endif

void matvec_values(kern_isa isa, float *y, int n_q, const float *a, size_t a_stride,
                   const float *x, size_t x_stride, int n_rows, int n)
{
#ifdef KERN_HAVE_X86
    if (isa >= KERN_ISA_AVX2 && n % 8 == 0 && n_q * n <= 64) {
        values_avx2(y, n_q, a, a_stride, x, x_stride, n_rows, n);
        return;
    }
#endif
    for (int h = 0; h < n_q; h++)
        kern_axpy_rows(isa, y + (size_t)h * n, a + (size_t)h * a_stride, x, x_stride, n_rows, n);
}

#ifdef KERN_HAVE_X86
static TGT void div_avx2(float *x, int n, float d)
{
    const __m256 dv = _mm256_set1_ps(d);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_div_ps(_mm256_loadu_ps(x + i), dv));
    for (; i < n; i++)
        x[i] /= d;
}

static TGT float max_avx2(const float *x, int n)
{
    float m = x[0];
    int i = 0;
    if (n >= 8) {
        __m256 mv = _mm256_set1_ps(x[0]);
        for (; i + 8 <= n; i += 8)
            mv = _mm256_max_ps(_mm256_loadu_ps(x + i), mv); /* x > m ? x : m */
        float lanes[8] __attribute__((aligned(32)));
        _mm256_store_ps(lanes, mv);
        for (int e = 0; e < 8; e++)
            if (lanes[e] > m)
                m = lanes[e];
    }
    for (; i < n; i++)
        if (x[i] > m)
            m = x[i];
    return m;
}
#endif

void matvec_softmax(kern_isa isa, float *x, int n, float scale)
{
#ifdef KERN_HAVE_X86
    if (isa >= KERN_ISA_AVX2) {
        div_avx2(x, n, scale);
        float max_val = max_avx2(x, n), sum = 0.0f;
        for (int i = 0; i < n; i++) {
            x[i] = expf(x[i] - max_val);
            sum += x[i];
        }
        div_avx2(x, n, sum);
        return;
    }
#endif
    (void)isa;
    for (int i = 0; i < n; i++)
        x[i] /= scale;
    float max_val = x[0];
    for (int i = 1; i < n; i++)
        if (x[i] > max_val)
            max_val = x[i];
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - max_val);
        sum += x[i];
    }
    for (int i = 0; i < n; i++)
        x[i] /= sum;
}

void matvec_scores_exact(kern_isa isa, const float *q, int n_q, const float *k, size_t k_stride,
                         int n_rows, int n, float *out, size_t out_stride)
{
    int r0 = 0;
#ifdef KERN_HAVE_X86
    if (isa >= KERN_ISA_AVX2 && n % 8 == 0)
        r0 = scores_avx2(q, n_q, k, k_stride, n_rows, n, out, out_stride);
#endif
    (void)isa;
    scores_ref(q, n_q, k, k_stride, r0, n_rows, n, out, out_stride);
}

void matvec_exact_f32(kern_isa isa, const float *wp, int rows, int n, const float *x, int T,
                      int r0, int r1, float *const *out)
{
    if (r1 > rows)
        r1 = rows;
    if (r0 >= r1 || T < 1)
        return;
#ifdef KERN_HAVE_X86
    if (isa >= KERN_ISA_AVX2 && r0 % MATVEC_GROUP == 0) {
        matvec_avx2(wp, n, x, T, r0, r1, out);
        return;
    }
#endif
    (void)isa;
    matvec_ref(wp, n, x, T, r0, r1, out);
}
