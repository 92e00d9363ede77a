/*
 * matvec: see matvec.h. The reference kernel is the definition (one chain per output
 * element over the packed layout); the AVX2 kernel runs tiles of groups x tokens, each
 * tile's weight loads shared by its tokens: 6 tokens x 2 groups while six tokens are left
 * (12 chains), 3 tokens x 2 groups (a 3-token MTP verify pass in one sweep over the
 * weights), 2 x 4, 1 x 8 (6-8 independent chains: enough for the add latency, and no
 * register spills), then narrower tiles for the last groups. matvec_attend_exact is one
 * decode token's whole attention (every head, one pass over its K and V rows).
 * Compiled with a target attribute whatever the build flags and used only when the
 * caller's isa says so. No FMA contraction: -std=c11 builds with -ffp-contract=off, and
 * the intrinsics are separate multiplies and adds.
 */
#include "matvec.h"

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "matvec_internal.h"

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

/* One tile: NG <= 2 groups of 8 rows (from row i) x NT <= 3 tokens (from token t), NG * NT
 * independent chains; the NG weight loads of a column are shared by the NT tokens.
 * Constant NG, NT (always inlined) keep the accumulators in registers. */
static TGT inline __attribute__((always_inline)) void
tile(const float *wp, size_t gs, int n, const float *x, float *const *out, int t, int i, int r1,
     const int NG, const int NT)
{
    const float *w0 = wp + (size_t)(i / MATVEC_GROUP) * gs;
    const float *xt[3];
    __m256 acc[4][3];
#pragma GCC unroll 3
    for (int u = 0; u < NT; u++)
        xt[u] = x + (size_t)(t + u) * n;
#pragma GCC unroll 4
    for (int g = 0; g < NG; g++)
#pragma GCC unroll 3
        for (int u = 0; u < NT; u++)
            acc[g][u] = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
        __m256 xv[3];
#pragma GCC unroll 3
        for (int u = 0; u < NT; u++)
            xv[u] = _mm256_broadcast_ss(xt[u] + j);
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) {
            __m256 wv = _mm256_load_ps(w0 + (size_t)g * gs + (size_t)j * MATVEC_GROUP);
#pragma GCC unroll 3
            for (int u = 0; u < NT; u++)
                acc[g][u] = _mm256_add_ps(acc[g][u], _mm256_mul_ps(wv, xv[u]));
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < NG; g++)
#pragma GCC unroll 3
        for (int u = 0; u < NT; u++)
            store_group(out[t + u], i + g * MATVEC_GROUP, r1, acc[g][u]);
}

/* 8 groups x 1 token (64 rows, 8 chains: a T = 1 pass is bound by the adds' throughput,
 * not by their latency), written out: the generic tile spills at this size. */
static TGT __attribute__((noinline)) void tile8x1(const float *wp, size_t gs, int n, const float *x, float *o, int i,
                        int r1)
{
    const float *w = wp + (size_t)(i / MATVEC_GROUP) * gs;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0;
    for (int j = 0; j < n; j++) {
        const __m256 xv = _mm256_broadcast_ss(x + j);
        const float *c = w + (size_t)j * MATVEC_GROUP;
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_load_ps(c), xv));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_load_ps(c + gs), xv));
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(_mm256_load_ps(c + 2 * gs), xv));
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(_mm256_load_ps(c + 3 * gs), xv));
        a4 = _mm256_add_ps(a4, _mm256_mul_ps(_mm256_load_ps(c + 4 * gs), xv));
        a5 = _mm256_add_ps(a5, _mm256_mul_ps(_mm256_load_ps(c + 5 * gs), xv));
        a6 = _mm256_add_ps(a6, _mm256_mul_ps(_mm256_load_ps(c + 6 * gs), xv));
        a7 = _mm256_add_ps(a7, _mm256_mul_ps(_mm256_load_ps(c + 7 * gs), xv));
    }
    store_group(o, i, r1, a0);
    store_group(o, i + 8, r1, a1);
    store_group(o, i + 16, r1, a2);
    store_group(o, i + 24, r1, a3);
    store_group(o, i + 32, r1, a4);
    store_group(o, i + 40, r1, a5);
    store_group(o, i + 48, r1, a6);
    store_group(o, i + 56, r1, a7);
}

/* 4 groups x 2 tokens (8 chains, the weight loads shared by the pair), written out. */
static TGT __attribute__((noinline)) void tile4x2(const float *wp, size_t gs, int n, const float *xa, float *oa, float *ob,
                        int i, int r1)
{
    const float *w = wp + (size_t)(i / MATVEC_GROUP) * gs, *xb = xa + n;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int j = 0; j < n; j++) {
        const __m256 va = _mm256_broadcast_ss(xa + j), vb = _mm256_broadcast_ss(xb + j);
        const float *c = w + (size_t)j * MATVEC_GROUP;
        const __m256 g0 = _mm256_load_ps(c), g1 = _mm256_load_ps(c + gs);
        const __m256 g2 = _mm256_load_ps(c + 2 * gs), g3 = _mm256_load_ps(c + 3 * gs);
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
    store_group(oa, i + 8, r1, a1);
    store_group(oa, i + 16, r1, a2);
    store_group(oa, i + 24, r1, a3);
    store_group(ob, i, r1, b0);
    store_group(ob, i + 8, r1, b1);
    store_group(ob, i + 16, r1, b2);
    store_group(ob, i + 24, r1, b3);
}

/* 2 groups x 6 tokens (12 chains; per column 2 weight loads and 6 broadcasts for 12
 * products, where the 2 x 3 tile's 5 loads and loop overhead serve 6: at T >= 6 the
 * 2 x 3 tile was a quarter of a stories260K step), written out. */
static TGT __attribute__((noinline)) void tile2x6(const float *wp, size_t gs, int n, const float *x,
                                                  float *const *out, int t, int i, int r1)
{
    const float *w = wp + (size_t)(i / MATVEC_GROUP) * gs;
    const float *x0 = x + (size_t)t * n;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
    for (int j = 0; j < n; j++) {
        const float *c = w + (size_t)j * MATVEC_GROUP;
        const __m256 g0 = _mm256_load_ps(c), g1 = _mm256_load_ps(c + gs);
        __m256 v = _mm256_broadcast_ss(x0 + j);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(g0, v));
        b0 = _mm256_add_ps(b0, _mm256_mul_ps(g1, v));
        v = _mm256_broadcast_ss(x0 + n + j);
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(g0, v));
        b1 = _mm256_add_ps(b1, _mm256_mul_ps(g1, v));
        v = _mm256_broadcast_ss(x0 + 2 * (size_t)n + j);
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(g0, v));
        b2 = _mm256_add_ps(b2, _mm256_mul_ps(g1, v));
        v = _mm256_broadcast_ss(x0 + 3 * (size_t)n + j);
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(g0, v));
        b3 = _mm256_add_ps(b3, _mm256_mul_ps(g1, v));
        v = _mm256_broadcast_ss(x0 + 4 * (size_t)n + j);
        a4 = _mm256_add_ps(a4, _mm256_mul_ps(g0, v));
        b4 = _mm256_add_ps(b4, _mm256_mul_ps(g1, v));
        v = _mm256_broadcast_ss(x0 + 5 * (size_t)n + j);
        a5 = _mm256_add_ps(a5, _mm256_mul_ps(g0, v));
        b5 = _mm256_add_ps(b5, _mm256_mul_ps(g1, v));
    }
    const int i1 = i + MATVEC_GROUP;
    store_group(out[t], i, r1, a0);
    store_group(out[t + 1], i, r1, a1);
    store_group(out[t + 2], i, r1, a2);
    store_group(out[t + 3], i, r1, a3);
    store_group(out[t + 4], i, r1, a4);
    store_group(out[t + 5], i, r1, a5);
    if (i1 < r1) {
        store_group(out[t], i1, r1, b0);
        store_group(out[t + 1], i1, r1, b1);
        store_group(out[t + 2], i1, r1, b2);
        store_group(out[t + 3], i1, r1, b3);
        store_group(out[t + 4], i1, r1, b4);
        store_group(out[t + 5], i1, r1, b5);
    }
}

/* The generic tiles as separate functions: one register allocation each (inlined into
 * one function, GCC spilled the accumulators of the wide tiles). */
#define TILE_FN(NG, NT)                                                                    \
    static TGT __attribute__((noinline)) void tile##NG##x##NT(                             \
        const float *wp, size_t gs, int n, const float *x, float *const *out, int t, int i,  \
        int r1)                                                                            \
    {                                                                                      \
        tile(wp, gs, n, x, out, t, i, r1, NG, NT);                                         \
    }
TILE_FN(4, 1)
TILE_FN(2, 1)
TILE_FN(2, 2)
TILE_FN(2, 3)
TILE_FN(1, 1)
TILE_FN(1, 2)
TILE_FN(1, 3)

/* Rows [r0, r1) for the NT tokens from t: wide tiles first (8 groups at NT = 1, 4 at
 * NT = 2, 2 at NT = 3: 6-8 chains, enough for a 3-cycle add latency and two adds a
 * cycle), then 2 and 1 group(s) (the last may be partial). */
static TGT inline __attribute__((always_inline)) void
rows_nt(const float *wp, size_t gs, int n, const float *x, float *const *out, int t, int r0,
        int r1, const int NT)
{
    int i = r0;
    if (NT == 1)
        for (; i + 7 * MATVEC_GROUP < r1; i += 8 * MATVEC_GROUP)
            tile8x1(wp, gs, n, x + (size_t)t * n, out[t], i, r1);
    if (NT == 1)
        for (; i + 3 * MATVEC_GROUP < r1; i += 4 * MATVEC_GROUP)
            tile4x1(wp, gs, n, x, out, t, i, r1);
    if (NT == 2)
        for (; i + 3 * MATVEC_GROUP < r1; i += 4 * MATVEC_GROUP)
            tile4x2(wp, gs, n, x + (size_t)t * n, out[t], out[t + 1], i, r1);
    for (; i + MATVEC_GROUP < r1; i += 2 * MATVEC_GROUP)
        (NT == 1 ? tile2x1 : NT == 2 ? tile2x2 : tile2x3)(wp, gs, n, x, out, t, i, r1);
    for (; i < r1; i += MATVEC_GROUP)
        (NT == 1 ? tile1x1 : NT == 2 ? tile1x2 : tile1x3)(wp, gs, n, x, out, t, i, r1);
}

static TGT void matvec_avx2(const float *wp, int n, const float *x, int T, int r0, int r1,
                            float *const *out)
{
    const size_t gs = (size_t)n * MATVEC_GROUP; /* floats per group */
    int t = 0;
    /* six tokens at a time while six are left: 2-group tiles, then one group */
    for (; T - t >= 6; t += 6) {
        int i = r0;
        for (; i + MATVEC_GROUP < r1; i += 2 * MATVEC_GROUP)
            tile2x6(wp, gs, n, x, out, t, i, r1);
        for (; i < r1; i += MATVEC_GROUP) {
            tile1x3(wp, gs, n, x, out, t, i, r1);
            tile1x3(wp, gs, n, x, out, t + 3, i, r1);
        }
    }
    /* three tokens at a time share the weight loads (a 3-token verify pass in one sweep),
     * pairs for the last 2 or 4 (two pairs beat a triple and a single), then one */
    for (; T - t >= 3 && T - t != 4; t += 3)
        rows_nt(wp, gs, n, x, out, t, r0, r1, 3);
    for (; t + 2 <= T; t += 2)
        rows_nt(wp, gs, n, x, out, t, r0, r1, 2);
    if (t < T)
        rows_nt(wp, gs, n, x, out, t, r0, r1, 1);
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
    if (n == 8) { /* one column block: each head's chain ends in it, so every head shares
                   * one transpose (a verify run's 2-8 heads) */
        for (int r = 0; r < R; r += 8) {
            __m256 col[8];
            for (int e = 0; e < 8; e++)
                col[e] = _mm256_loadu_ps(k + (size_t)(r + e) * k_stride);
            transpose8(col);
            for (int h = 0; h < n_q; h++) {
                const float *qh = q + (size_t)h * 8;
                __m256 acc = _mm256_setzero_ps();
                for (int j = 0; j < 8; j++)
                    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(qh + j), col[j]));
                _mm256_storeu_ps(out + (size_t)h * out_stride + r, acc);
            }
        }
        return R;
    }
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
    kern_axpy_heads(isa, y, n_q, (size_t)n, a, a_stride, x, x_stride, n_rows, n);
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

static TGT void sub_avx2(float *x, int n, float m)
{
    const __m256 mv = _mm256_set1_ps(m);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    for (; i < n; i++)
        x[i] = x[i] - m;
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

// --- expf, glibc's algorithm 4 lanes wide

#ifdef KERN_HAVE_X86
/* glibc's __exp2f_data (sysdeps/ieee754/flt-32/e_exp2f_data.c): tab[i] =
 * asuint64(2^(i/32)) - (i << 47), invln2_scaled = 32 / ln 2, poly_scaled, shift = 0x1.8p52 */
static const uint64_t EXP2F_TAB[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540};
#define EXP2F_INVLN2N 0x40471547652b82feULL
#define EXP2F_C0 0x3ebc6af84b912394ULL
#define EXP2F_C1 0x3f2ebfce50fac4f3ULL
#define EXP2F_C2 0x3f962e42ff0c52d6ULL
#define EXP2F_SHIFT 0x4338000000000000ULL

static TGT inline __m256d bits_pd(uint64_t b)
{
    return _mm256_castsi256_pd(_mm256_set1_epi64x((long long)b));
}

/* 4 lanes of glibc's expf main path (|x| < 88): the operations of its FMA build in order:
 * z = fma(InvLn2N, xd, SHIFT), kd = z - SHIFT, r = fma(InvLn2N, xd, -kd),
 * s = tab[ki % 32] + (ki << 47), y = fma(fma(C0, r, C1), r * r, fma(C2, r, 1)) * s. */
static TGT inline __m128 expf4(__m128 x)
{
    const __m256d xd = _mm256_cvtps_pd(x), inv = bits_pd(EXP2F_INVLN2N);
    const __m256d shift = bits_pd(EXP2F_SHIFT);
    const __m256d kds = _mm256_fmadd_pd(inv, xd, shift);
    const __m256i ki = _mm256_castpd_si256(kds);
    const __m256d kd = _mm256_sub_pd(kds, shift);
    const __m256d r = _mm256_fmsub_pd(inv, xd, kd);
    const __m256d z = _mm256_fmadd_pd(r, bits_pd(EXP2F_C0), bits_pd(EXP2F_C1));
    const __m256d r2 = _mm256_mul_pd(r, r);
    __m256d y = _mm256_fmadd_pd(r, bits_pd(EXP2F_C2), _mm256_set1_pd(1.0));
    y = _mm256_fmadd_pd(z, r2, y);
    const __m256i idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
    __m256i t = _mm256_i64gather_epi64((const long long *)EXP2F_TAB, idx, 8);
    t = _mm256_add_epi64(t, _mm256_slli_epi64(ki, 47));
    return _mm256_cvtpd_ps(_mm256_mul_pd(y, _mm256_castsi256_pd(t)));
}

/* glibc's expf returns +0 below this (log(0x1p-150), its __math_uflowf), -inf included */
#define EXPF_UFLOW -0x1.9fe368p6f

/* 8 lanes of expf: expf4 on each half. Of the lanes glibc's special-case test (top12(x) &
 * 0x7ff >= top12(88.0f)) sends to its slow path, those below EXPF_UFLOW get its +0 here
 * and those in [EXPF_UFLOW, -88] its main path, which it falls through to (the softmax's
 * scores far below the row's max: taking libm's expf for them was ~13% of a stories260K
 * prefill); only NaN and x >= 88 call libm's expf. */
static TGT inline __m256 expf8(__m256 v)
{
    const __m256i top = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(v), 20),
                                         _mm256_set1_epi32(0x7ff));
    const __m256 special = _mm256_castsi256_ps(_mm256_cmpgt_epi32(top, _mm256_set1_epi32(0x42a)));
    const __m128 lo = expf4(_mm256_castps256_ps128(v)), hi = expf4(_mm256_extractf128_ps(v, 1));
    __m256 y = _mm256_set_m128(hi, lo);
    if (__builtin_expect(_mm256_movemask_ps(special) != 0, 0)) {
        /* x < EXPF_UFLOW (false for NaN): +0 */
        y = _mm256_andnot_ps(_mm256_cmp_ps(v, _mm256_set1_ps(EXPF_UFLOW), _CMP_LT_OQ), y);
        /* NaN or x >= 88 (x <= -88 is not: its sign bit is set): libm */
        const int slow = _mm256_movemask_ps(_mm256_and_ps(
            special, _mm256_or_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q),
                                  _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GT_OQ))));
        if (slow) {
            float in[8], out[8];
            _mm256_storeu_ps(in, v);
            _mm256_storeu_ps(out, y);
            for (int e = 0; e < 8; e++)
                if (slow >> e & 1)
                    out[e] = expf(in[e]);
            y = _mm256_loadu_ps(out);
        }
    }
    return y;
}

static TGT void expf_avx2(const float *x, float *y, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, expf8(_mm256_loadu_ps(x + i)));
    if (i < n) { /* the tail through the vector path too (padded with zeros) */
        float in[8] = {0}, out[8];
        memcpy(in, x + i, (size_t)(n - i) * sizeof(float));
        expf_avx2(in, out, 8);
        memcpy(y + i, out, (size_t)(n - i) * sizeof(float));
    }
}

/* 1: the vector path matches this libm's expf on the sample; -1: it does not; 0: unknown */
static atomic_int expf_state;

static int expf_vector_ok(void)
{
    int st = atomic_load_explicit(&expf_state, memory_order_relaxed);
    if (st)
        return st > 0;
    /* a fixed sample: a sweep of [-104, 89], the region softmax uses most, [-20, 0], and the
     * 128 floats on each side of the underflow bounds of glibc's expf (EXPF_UFLOW, its +0;
     * log(0x1p-149), its optional __math_may_uflowf) and of -88: expf8 takes these lanes
     * itself */
    enum { N = 4096, B = 256 };
    float x[N + 3 * B], got[N + 3 * B];
    for (int i = 0; i < N / 2; i++) {
        x[i] = -104.0f + 193.0f * (float)i / (float)(N / 2);
        x[N / 2 + i] = -20.0f * (float)i / (float)(N / 2) - 1e-7f * (float)(i % 7);
    }
    const float bounds[3] = {EXPF_UFLOW, -0x1.9d1d9ep6f, -88.0f};
    for (int b = 0; b < 3; b++)
        for (int i = 0; i < B; i++) {
            uint32_t u;
            memcpy(&u, &bounds[b], sizeof(u));
            u = u - B / 2 + (uint32_t)i;
            memcpy(&x[N + b * B + i], &u, sizeof(u));
        }
    expf_avx2(x, got, N + 3 * B);
    st = 1;
    for (int i = 0; i < N + 3 * B; i++) {
        float want = expf(x[i]);
        if (memcmp(&want, &got[i], sizeof(float)) != 0)
            st = -1;
    }
    atomic_store_explicit(&expf_state, st, memory_order_relaxed);
    return st > 0;
}
#endif

int matvec_expf_vector(kern_isa isa)
{
#ifdef KERN_HAVE_X86
    return isa >= KERN_ISA_AVX2 && expf_vector_ok();
#else
    (void)isa;
    return 0;
#endif
}

void matvec_expf(kern_isa isa, const float *x, float *y, int n)
{
#ifdef KERN_HAVE_X86
    if (isa >= KERN_ISA_AVX2 && expf_vector_ok()) {
        expf_avx2(x, y, n);
        return;
    }
#endif
    (void)isa;
    for (int i = 0; i < n; i++)
        y[i] = expf(x[i]);
}

/* The definition: run.c's rmsnorm, row by row (the MTP modules' norms use it too). */
static void rmsnorm_ref(float *o, const float *x, int T, int n, const float *weight, float eps)
{
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * n;
        float *ot = o + (size_t)t * n;
        float ss = 0.0f;
        for (int j = 0; j < n; j++)
            ss += xt[j] * xt[j];
        ss /= n;
        ss += eps;
        ss = 1.0f / sqrtf(ss);
        for (int j = 0; j < n; j++)
            ot[j] = weight[j] * (ss * xt[j]);
    }
}

#ifdef KERN_HAVE_X86
/* rmsnorm_ref with 8 rows' sums in the lanes (a partial last group: zero rows, unused). */
static TGT void rmsnorm_avx2(float *o, const float *x, int T, int n, const float *weight, float eps)
{
    for (int t0 = 0; t0 < T; t0 += 8) {
        const int nt = T - t0 < 8 ? T - t0 : 8;
        const float *x0 = x + (size_t)t0 * n;
        __m256 ss = _mm256_setzero_ps();
        for (int j0 = 0; j0 < n; j0 += 8) {
            __m256 col[8];
#pragma GCC unroll 8
            for (int e = 0; e < 8; e++)
                col[e] = e < nt ? _mm256_loadu_ps(x0 + (size_t)e * n + j0) : _mm256_setzero_ps();
            transpose8(col);
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++)
                ss = _mm256_add_ps(ss, _mm256_mul_ps(col[k], col[k]));
        }
        ss = _mm256_div_ps(ss, _mm256_set1_ps((float)n));
        ss = _mm256_add_ps(ss, _mm256_set1_ps(eps));
        ss = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_sqrt_ps(ss));
        float s8[8] __attribute__((aligned(32)));
        _mm256_store_ps(s8, ss);
        for (int e = 0; e < nt; e++) {
            const float *xt = x0 + (size_t)e * n;
            float *ot = o + (size_t)(t0 + e) * n;
            const __m256 se = _mm256_set1_ps(s8[e]);
            for (int j = 0; j < n; j += 8)
                _mm256_storeu_ps(ot + j, _mm256_mul_ps(_mm256_loadu_ps(weight + j),
                                                       _mm256_mul_ps(se, _mm256_loadu_ps(xt + j))));
        }
    }
}
#endif

void matvec_rmsnorm(kern_isa isa, float *o, const float *x, int T, int n, const float *weight,
                    float eps)
{
#ifdef KERN_HAVE_X86
    if (isa >= KERN_ISA_AVX2 && n % 8 == 0) {
        rmsnorm_avx2(o, x, T, n, weight, eps);
        return;
    }
#endif
    (void)isa;
    rmsnorm_ref(o, x, T, n, weight, eps);
}

#ifdef KERN_HAVE_X86
static TGT void swiglu_avx2(float *h, const float *h2, int n)
{
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(h + i);
        const __m256 e = expf8(_mm256_xor_ps(v, sign)); /* expf(-val) */
        v = _mm256_mul_ps(v, _mm256_div_ps(one, _mm256_add_ps(one, e)));
        _mm256_storeu_ps(h + i, _mm256_mul_ps(v, _mm256_loadu_ps(h2 + i)));
    }
    for (; i < n; i++) { /* libm's expf: the same bits as expf8 (expf_vector_ok) */
        float val = h[i];
        val *= (1.0f / (1.0f + expf(-val)));
        val *= h2[i];
        h[i] = val;
    }
}
#endif

void matvec_swiglu(kern_isa isa, float *h, const float *h2, int n)
{
#ifdef KERN_HAVE_X86
    if (isa >= KERN_ISA_AVX2 && expf_vector_ok()) {
        swiglu_avx2(h, h2, n);
        return;
    }
#endif
    (void)isa;
    for (int i = 0; i < n; i++) {
        float val = h[i];
        val *= (1.0f / (1.0f + expf(-val)));
        val *= h2[i];
        h[i] = val;
    }
}

void matvec_softmax(kern_isa isa, float *x, int n, float scale)
{
#ifdef KERN_HAVE_X86
    if (isa >= KERN_ISA_AVX2) {
        div_avx2(x, n, scale);
        float max_val = max_avx2(x, n), sum = 0.0f;
        sub_avx2(x, n, max_val);
        matvec_expf(isa, x, x, n); /* libm's expf, bit for bit */
        for (int i = 0; i < n; i++)
            sum += x[i];
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

void matvec_softmax_rows(kern_isa isa, float *x, size_t stride, int nr, int n0, int per,
                         float scale)
{
#ifdef KERN_HAVE_X86
    if (isa >= KERN_ISA_AVX2) {
        for (int h0 = 0; h0 < nr; h0 += 8) {
            const int m = nr - h0 < 8 ? nr - h0 : 8;
            float *row[8];
            int len[8];
            for (int k = 0; k < m; k++) {
                row[k] = x + (size_t)(h0 + k) * stride;
                len[k] = n0 + (h0 + k) / per;
                div_avx2(row[k], len[k], scale);
                const float max_val = max_avx2(row[k], len[k]);
                sub_avx2(row[k], len[k], max_val);
                matvec_expf(isa, row[k], row[k], len[k]);
            }
            /* the rows' serial sums side by side (8 independent chains, each in position
             * order) over the positions all of them have, then each one's own tail */
            float sum[8] = {0};
            int common = len[0];
            if (m == 8) {
                for (int k = 1; k < 8; k++)
                    common = len[k] < common ? len[k] : common;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f, s4 = 0.0f, s5 = 0.0f, s6 = 0.0f,
                      s7 = 0.0f;
                for (int i = 0; i < common; i++) {
                    s0 += row[0][i];
                    s1 += row[1][i];
                    s2 += row[2][i];
                    s3 += row[3][i];
                    s4 += row[4][i];
                    s5 += row[5][i];
                    s6 += row[6][i];
                    s7 += row[7][i];
                }
                sum[0] = s0, sum[1] = s1, sum[2] = s2, sum[3] = s3;
                sum[4] = s4, sum[5] = s5, sum[6] = s6, sum[7] = s7;
            } else
                common = 0;
            for (int k = 0; k < m; k++) {
                float sk = sum[k];
                for (int i = common; i < len[k]; i++)
                    sk += row[k][i];
                div_avx2(row[k], len[k], sk);
            }
        }
        return;
    }
#endif
    for (int h = 0; h < nr; h++)
        matvec_softmax(isa, x + (size_t)h * stride, n0 + h / per, scale);
}

// --- one decode token's attention, every head in one pass over its K and V rows

/* One query row qh (hs floats) over positions [0, n) of its KV head (columns at koff):
 * matvec_scores_exact's chains block by block, run.c's softmax and the values summed in
 * position order (the portable helpers above) into yh (hs floats); a: n floats of scratch. */
static void attend_head_ref(const float *qh, int hs, const float *pool, const int *blocks,
                            size_t block_floats, int bs, size_t kv_dim, size_t koff, int n,
                            float scale, float *a, float *yh)
{
    for (int s0 = 0; s0 < n; s0 += bs) {
        const float *kb = pool + (size_t)blocks[s0 / bs] * block_floats + koff;
        scores_ref(qh, 1, kb, kv_dim, 0, n - s0 < bs ? n - s0 : bs, hs, a + s0, 0);
    }
    matvec_softmax(KERN_ISA_SCALAR, a, n, scale);
    memset(yh, 0, (size_t)hs * sizeof(float));
    for (int r = 0; r < n; r++) {
        const float *vr = pool + (size_t)blocks[r / bs] * block_floats + (size_t)bs * kv_dim +
                          (size_t)(r % bs) * kv_dim + koff;
        for (int i = 0; i < hs; i++)
            yh[i] += a[r] * vr[i];
    }
}

/* The definition: attend_head_ref per head. */
static void attend_ref(const float *q, int n_head, int kv_mul, int hs, const float *pool,
                       const int *blocks, size_t block_floats, int bs, size_t kv_dim, int n,
                       float scale, float *att, float *y)
{
    for (int h = 0; h < n_head; h++)
        attend_head_ref(q + (size_t)h * hs, hs, pool, blocks, block_floats, bs, kv_dim,
                        (size_t)(h / kv_mul) * hs, n, scale, att + (size_t)h * n,
                        y + (size_t)h * hs);
}

#ifdef KERN_HAVE_X86
/* hs == 8, n_head <= 8, bs % 8 == 0. Scores: 8 positions in the lanes, each 8-row slab's
 * K rows read once for every KV head (8 columns each, transposed in registers), so both
 * cache lines of a row are used together; the softmax of all heads at once: the
 * divisions, max and subtraction per head 8 lanes wide, one expf call over every head's
 * padded row, and the sums of the heads as the lanes of one register (8 transposed
 * positions at a time, added in position order: each lane is its head's serial sum, and
 * the zeros of the padding leave a positive sum unchanged); the values: each V row read
 * once for every head, one register of sums per head. */
static TGT void attend_avx2(const float *q, int n_head, int kv_mul, const float *pool,
                            const int *blocks, size_t block_floats, int bs, size_t kv_dim, int n,
                            float scale, float *att, float *y)
{
    const int n_kv = n_head / kv_mul, S = (n + 7) & ~7; /* S: floats per head's row in att */
    for (int r0 = 0; r0 < n; r0 += 8) {
        const float *kb =
            pool + (size_t)blocks[r0 / bs] * block_floats + (size_t)(r0 % bs) * kv_dim;
        const int nr = n - r0 < 8 ? n - r0 : 8;
        for (int g = 0; g < n_kv; g++) {
            __m256 col[8];
#pragma GCC unroll 8
            for (int e = 0; e < 8; e++)
                col[e] = e < nr ? _mm256_loadu_ps(kb + (size_t)e * kv_dim + (size_t)g * 8)
                                : _mm256_setzero_ps();
            transpose8(col);
            for (int u = 0; u < kv_mul; u++) {
                const float *qh = q + (size_t)(g * kv_mul + u) * 8;
                __m256 acc = _mm256_setzero_ps();
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++)
                    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_broadcast_ss(qh + j), col[j]));
                _mm256_storeu_ps(att + (size_t)(g * kv_mul + u) * S + r0, acc);
            }
        }
    }
    for (int h = 0; h < n_head; h++) {
        float *a = att + (size_t)h * S;
        div_avx2(a, n, scale);
        const float m = max_avx2(a, n);
        sub_avx2(a, n, m);
        for (int i = n; i < S; i++)
            a[i] = 0.0f; /* expf(0): no special case in the padding */
    }
    matvec_expf(KERN_ISA_AVX2, att, att, n_head * S);
    for (int h = 0; h < n_head; h++)
        for (int i = n; i < S; i++)
            att[(size_t)h * S + i] = 0.0f;
    __m256 sum = _mm256_setzero_ps();
    for (int i0 = 0; i0 < S; i0 += 8) {
        __m256 rows[8];
#pragma GCC unroll 8
        for (int h = 0; h < 8; h++)
            rows[h] = h < n_head ? _mm256_loadu_ps(att + (size_t)h * S + i0) : _mm256_setzero_ps();
        transpose8(rows);
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++)
            sum = _mm256_add_ps(sum, rows[k]);
    }
    float sums[8] __attribute__((aligned(32)));
    _mm256_store_ps(sums, sum);
    for (int h = 0; h < n_head; h++)
        div_avx2(att + (size_t)h * S, n, sums[h]);
    __m256 acc[8];
    const float *ah[8];
    int off[8];
#pragma GCC unroll 8
    for (int h = 0; h < 8; h++) {
        acc[h] = _mm256_setzero_ps();
        ah[h] = att + (size_t)(h < n_head ? h : 0) * S;
        off[h] = h < n_head ? h / kv_mul * 8 : 0;
    }
    for (int s0 = 0; s0 < n; s0 += bs) {
        const float *vb = pool + (size_t)blocks[s0 / bs] * block_floats + (size_t)bs * kv_dim;
        const int rows = n - s0 < bs ? n - s0 : bs;
        for (int r = 0; r < rows; r++) {
            const float *vr = vb + (size_t)r * kv_dim;
#pragma GCC unroll 8
            for (int h = 0; h < 8; h++)
                if (h < n_head)
                    acc[h] =
                        _mm256_add_ps(acc[h], _mm256_mul_ps(_mm256_broadcast_ss(ah[h] + s0 + r),
                                                            _mm256_loadu_ps(vr + off[h])));
        }
    }
#pragma GCC unroll 8
    for (int h = 0; h < 8; h++)
        if (h < n_head)
            _mm256_storeu_ps(y + (size_t)h * 8, acc[h]);
}
#endif

// --- a run of consecutive tokens' attention, its query rows in the lanes

/* The definition: row h (query head h % kv_mul of token h / kv_mul) over positions
 * [0, n_lo + h / kv_mul), as attend_ref's head: run.c's scores, softmax and values. */
static void attend_rows_ref(const float *q, int nq, int kv_mul, int hs, const float *pool,
                            const int *blocks, size_t block_floats, int bs, size_t kv_dim,
                            size_t koff, int n_lo, float scale, float *att, float *y)
{
    for (int h = 0; h < nq; h++)
        attend_head_ref(q + (size_t)h * hs, hs, pool, blocks, block_floats, bs, kv_dim, koff,
                        n_lo + h / kv_mul, scale, att, y + (size_t)h * hs);
}

#ifdef KERN_HAVE_X86
/* hs == 8, nq <= 8: lane h is row h's serial chains throughout. Per position r, the score
 * of every row is sum_j qt[j] * k_r[j] (qt: the rows transposed once, so no K transpose),
 * / scale, and the running max lane by lane (m = s > m ? s : m, run.c's test); then
 * expf(s - m) and the sum, one add per position per lane; then a = e / sum and the
 * values y[h][i] = y[h][i] + a[h] * v_r[i] as 8 registers (one per i) transposed at the
 * end. Positions [n_lo, n_hi) belong to some rows only: there the other lanes keep their
 * max, get e = 0 (their sum, >= 1, is unchanged by it) and keep their values (blend). */
static TGT void attend_rows_avx2(const float *q, int nq, int kv_mul, const float *pool,
                                 const int *blocks, size_t block_floats, int bs, size_t kv_dim,
                                 size_t koff, int n_lo, float scale, float *att, float *y)
{
    const int n_hi = n_lo + (nq - 1) / kv_mul;
    __m256 qt[8];
    int lens[8];
#pragma GCC unroll 8
    for (int h = 0; h < 8; h++) {
        qt[h] = h < nq ? _mm256_loadu_ps(q + (size_t)h * 8) : _mm256_setzero_ps();
        lens[h] = h < nq ? n_lo + h / kv_mul : n_lo;
    }
    transpose8(qt);
    const __m256i len = _mm256_loadu_si256((const __m256i *)lens);
    const __m256 sv = _mm256_set1_ps(scale);
    __m256 m = _mm256_setzero_ps();
    for (int s0 = 0; s0 < n_hi; s0 += bs) {
        const float *kb = pool + (size_t)blocks[s0 / bs] * block_floats + koff;
        const int re = n_hi - s0 < bs ? n_hi : s0 + bs;
        for (int r = s0; r < re; r++) {
            const float *k = kb + (size_t)(r - s0) * kv_dim;
            __m256 s = _mm256_setzero_ps();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                s = _mm256_add_ps(s, _mm256_mul_ps(qt[j], _mm256_broadcast_ss(k + j)));
            s = _mm256_div_ps(s, sv);
            _mm256_storeu_ps(att + (size_t)r * 8, s);
            if (r == 0)
                m = s;
            else if (r < n_lo)
                m = _mm256_max_ps(s, m); /* s > m ? s : m */
            else
                m = _mm256_blendv_ps(
                    m, _mm256_max_ps(s, m),
                    _mm256_castsi256_ps(_mm256_cmpgt_epi32(len, _mm256_set1_epi32(r))));
        }
    }
    __m256 sum = _mm256_setzero_ps();
    for (int r = 0; r < n_hi; r++) {
        __m256 d = _mm256_sub_ps(_mm256_loadu_ps(att + (size_t)r * 8), m);
        __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(len, _mm256_set1_epi32(r)));
        if (r >= n_lo)
            d = _mm256_and_ps(d, valid); /* expf(0) in the lanes past their row */
        __m256 e = expf8(d);
        if (r >= n_lo)
            e = _mm256_and_ps(e, valid);
        _mm256_storeu_ps(att + (size_t)r * 8, e);
        sum = _mm256_add_ps(sum, e);
    }
    __m256 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        acc[i] = _mm256_setzero_ps();
    /* the positions of every row (no mask: 8 sums, a and a broadcast in registers) */
    for (int s0 = 0; s0 < n_lo; s0 += bs) {
        const float *vb = pool + (size_t)blocks[s0 / bs] * block_floats + (size_t)bs * kv_dim + koff;
        const int re = n_lo - s0 < bs ? n_lo : s0 + bs;
        for (int r = s0; r < re; r++) {
            const float *v = vb + (size_t)(r - s0) * kv_dim;
            const __m256 a = _mm256_div_ps(_mm256_loadu_ps(att + (size_t)r * 8), sum);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(a, _mm256_broadcast_ss(v + i)));
        }
    }
    for (int r = n_lo; r < n_hi; r++) { /* then those of some rows only */
        const float *v = pool + (size_t)blocks[r / bs] * block_floats + (size_t)bs * kv_dim +
                         (size_t)(r % bs) * kv_dim + koff;
        const __m256 a = _mm256_div_ps(_mm256_loadu_ps(att + (size_t)r * 8), sum);
        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(len, _mm256_set1_epi32(r)));
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
            acc[i] = _mm256_blendv_ps(
                acc[i], _mm256_add_ps(acc[i], _mm256_mul_ps(a, _mm256_broadcast_ss(v + i))), valid);
    }
    transpose8(acc);
    for (int h = 0; h < nq; h++)
        _mm256_storeu_ps(y + (size_t)h * 8, acc[h]);
}
#endif

int matvec_attend_rows_vector(kern_isa isa, int nq, int hs)
{
#ifdef KERN_HAVE_X86
    return isa >= KERN_ISA_AVX2 && hs == 8 && nq >= 1 && nq <= 8 && expf_vector_ok();
#else
    (void)isa, (void)nq, (void)hs;
    return 0;
#endif
}

void matvec_attend_rows_exact(kern_isa isa, const float *q, int nq, int kv_mul, int hs,
                              const float *pool, const int *blocks, size_t block_floats, int bs,
                              size_t kv_dim, size_t koff, int n_lo, float scale, float *att,
                              float *y)
{
#ifdef KERN_HAVE_X86
    if (matvec_attend_rows_vector(isa, nq, hs)) {
        attend_rows_avx2(q, nq, kv_mul, pool, blocks, block_floats, bs, kv_dim, koff, n_lo, scale,
                         att, y);
        return;
    }
#endif
    attend_rows_ref(q, nq, kv_mul, hs, pool, blocks, block_floats, bs, kv_dim, koff, n_lo, scale,
                    att, y);
}

int matvec_attend_vector(kern_isa isa, int n_head, int kv_mul, int hs, int bs)
{
#ifdef KERN_HAVE_X86
    return isa >= KERN_ISA_AVX2 && hs == 8 && n_head <= 8 && kv_mul >= 1 && n_head % kv_mul == 0 &&
           bs % 8 == 0;
#else
    (void)isa, (void)n_head, (void)kv_mul, (void)hs, (void)bs;
    return 0;
#endif
}

void matvec_attend_exact(kern_isa isa, const float *q, int n_head, int kv_mul, int hs,
                         const float *pool, const int *blocks, size_t block_floats, int bs,
                         size_t kv_dim, int n, float scale, float *att, float *y)
{
#ifdef KERN_HAVE_X86
    if (matvec_attend_vector(isa, n_head, kv_mul, hs, bs)) {
        attend_avx2(q, n_head, kv_mul, pool, blocks, block_floats, bs, kv_dim, n, scale, att, y);
        return;
    }
#endif
    attend_ref(q, n_head, kv_mul, hs, pool, blocks, block_floats, bs, kv_dim, n, scale, att, y);
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
    if (isa >= KERN_ISA_AVX512 && T >= 2 && r0 % MATVEC_GROUP == 0) {
        matvec_x86_exact_avx512(wp, n, x, T, r0, r1, out);
        return;
    }
    if (isa >= KERN_ISA_AVX2 && r0 % MATVEC_GROUP == 0) {
        matvec_avx2(wp, n, x, T, r0, r1, out);
        return;
    }
#endif
    (void)isa;
    matvec_ref(wp, n, x, T, r0, r1, out);
}
