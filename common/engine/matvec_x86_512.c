/*
 * matvec_x86_512: the AVX-512 kernel of matvec_exact_f32 (matvec.h): EXACT order, 16
 * output rows per 512-bit register.
 *
 * The packed layout (matvec_pack_f32) keeps 8-row groups, group g's column j at
 * wp[(g * n + j) * 8 ..]; a register holds column j of two groups, g in the low half and
 * g + 1 in the high half (two 256-bit loads), and each of its 16 lanes runs its row's
 * chain s = s + w[j] * x[j] (j ascending, the product and the sum each rounded: separate
 * multiply and add, no FMA), exactly as the AVX2 kernel and matvec_ref do: the same bits,
 * half the arithmetic instructions. Tiles: P group pairs x NT tokens (P * NT chains; the
 * pair loads of a column shared by the tokens); a last odd group runs in a 256-bit
 * register.
 *
 * Measured against the AVX2 kernel (CPU time, medians of 9 alternating runs in one
 * process, stories260K's shapes 32 .. 512 rows x 64 .. 172 columns; AMD EPYC family 26,
 * 512-bit units): T = 3, 8, 32: 1.7-2.0x. T = 1: 0.90-1.00x (a 64-row matrix has 4
 * chains of 16 rows against AVX2's 8 of 8, both bound by the add latency; an 8-pair tile
 * for the 512-row classifier measured 0.90x too), so matvec_exact_f32 keeps AVX2 at T = 1.
 */
#include "matvec_internal.h"

#ifdef KERN_HAVE_X86
#include <immintrin.h>

/* Tokens per tile at most (tile16's 4 x NT accumulators, NT broadcasts and the weight
 * register fit the 32 zmm registers at NT = 6). */
#define MV512_NT_MAX 6

#define TGT512M __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))

/* Lanes [0, 16) of acc to o[i, i + 16), clipped at r1. */
static TGT512M inline __attribute__((always_inline)) void store16(float *o, int i, int r1,
                                                                  __m512 acc)
{
    const int m = r1 - i < 16 ? r1 - i : 16;
    _mm512_mask_storeu_ps(o + i, (__mmask16)((1u << m) - 1), acc);
}

/* P pairs of groups from row i (groups i / 8 .. i / 8 + 2P - 1 exist) x NT tokens from t. */
static TGT512M inline __attribute__((always_inline)) void tile16(const float *wp, size_t gs, int n,
                                                                 const float *x, float *const *out,
                                                                 int t, int i, int r1, const int P,
                                                                 const int NT)
{
    const float *w0 = wp + (size_t)(i / MATVEC_GROUP) * gs;
    const float *xt[MV512_NT_MAX];
    __m512 acc[4][MV512_NT_MAX];
#pragma GCC unroll 6
    for (int u = 0; u < NT; u++)
        xt[u] = x + (size_t)(t + u) * n;
#pragma GCC unroll 8
    for (int p = 0; p < P; p++)
#pragma GCC unroll 6
        for (int u = 0; u < NT; u++)
            acc[p][u] = _mm512_setzero_ps();
    for (int j = 0; j < n; j++) {
        __m512 xv[MV512_NT_MAX];
#pragma GCC unroll 6
        for (int u = 0; u < NT; u++)
            xv[u] = _mm512_set1_ps(xt[u][j]);
#pragma GCC unroll 8
        for (int p = 0; p < P; p++) {
            const float *c = w0 + (size_t)(2 * p) * gs + (size_t)j * MATVEC_GROUP;
            const __m512 wv = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(c)),
                                                 _mm256_load_ps(c + gs), 1);
#pragma GCC unroll 6
            for (int u = 0; u < NT; u++)
                acc[p][u] = _mm512_add_ps(acc[p][u], _mm512_mul_ps(wv, xv[u]));
        }
    }
#pragma GCC unroll 8
    for (int p = 0; p < P; p++)
#pragma GCC unroll 6
        for (int u = 0; u < NT; u++)
            store16(out[t + u], i + 16 * p, r1, acc[p][u]);
}

/* One group (8 rows from i) x NT tokens, 256-bit. */
static TGT512M inline __attribute__((always_inline)) void tile8(const float *wp, size_t gs, int n,
                                                                const float *x, float *const *out,
                                                                int t, int i, int r1, const int NT)
{
    const float *w0 = wp + (size_t)(i / MATVEC_GROUP) * gs;
    __m256 acc[MV512_NT_MAX];
#pragma GCC unroll 6
    for (int u = 0; u < NT; u++)
        acc[u] = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
        const __m256 wv = _mm256_load_ps(w0 + (size_t)j * MATVEC_GROUP);
#pragma GCC unroll 6
        for (int u = 0; u < NT; u++)
            acc[u] = _mm256_add_ps(
                acc[u], _mm256_mul_ps(wv, _mm256_broadcast_ss(x + (size_t)(t + u) * n + j)));
    }
    const int m = r1 - i < 8 ? r1 - i : 8;
#pragma GCC unroll 6
    for (int u = 0; u < NT; u++)
        _mm256_mask_storeu_ps(out[t + u] + i, (__mmask8)((1u << m) - 1), acc[u]);
}

#define T16(P, NT)                                                                                 \
    static TGT512M __attribute__((noinline)) void t16_##P##_##NT(                                  \
        const float *wp, size_t gs, int n, const float *x, float *const *out, int t, int i,        \
        int r1)                                                                                    \
    {                                                                                              \
        tile16(wp, gs, n, x, out, t, i, r1, P, NT);                                                \
    }
#define T8(NT)                                                                                     \
    static TGT512M                                                                                 \
        __attribute__((noinline)) void t8_##NT(const float *wp, size_t gs, int n, const float *x,  \
                                               float *const *out, int t, int i, int r1)            \
    {                                                                                              \
        tile8(wp, gs, n, x, out, t, i, r1, NT);                                                    \
    }
T16(4, 1)
T16(4, 2)
T16(4, 3)
T16(2, 1)
T16(2, 2)
T16(2, 3)
T16(1, 1)
T16(1, 2)
T16(1, 3)
T16(4, 6)
T16(2, 6)
T16(1, 6)
T8(1)
T8(2)
T8(3)
T8(6)

typedef void (*mv_fn)(const float *, size_t, int, const float *, float *const *, int, int, int);
static const mv_fn t16_4[7] = {NULL, t16_4_1, t16_4_2, t16_4_3, NULL, NULL, t16_4_6};
static const mv_fn t16_2[7] = {NULL, t16_2_1, t16_2_2, t16_2_3, NULL, NULL, t16_2_6};
static const mv_fn t16_1[7] = {NULL, t16_1_1, t16_1_2, t16_1_3, NULL, NULL, t16_1_6};
static const mv_fn t8_[7] = {NULL, t8_1, t8_2, t8_3, NULL, NULL, t8_6};

/* Rows [r0, r1) for NT tokens from t: 4, 2, 1 pairs of groups while their last group
 * starts before r1 (the packing pads a group's rows with zeros), then one group. */
static TGT512M void rows16(const float *wp, size_t gs, int n, const float *x, float *const *out,
                           int t, int r0, int r1, int NT)
{
    int i = r0;
    for (; i + 7 * MATVEC_GROUP < r1; i += 8 * MATVEC_GROUP)
        t16_4[NT](wp, gs, n, x, out, t, i, r1);
    for (; i + 3 * MATVEC_GROUP < r1; i += 4 * MATVEC_GROUP)
        t16_2[NT](wp, gs, n, x, out, t, i, r1);
    for (; i + MATVEC_GROUP < r1; i += 2 * MATVEC_GROUP)
        t16_1[NT](wp, gs, n, x, out, t, i, r1);
    if (i < r1)
        t8_[NT](wp, gs, n, x, out, t, i, r1);
}

TGT512M void matvec_x86_exact_avx512(const float *wp, int n, const float *x, int T, int r0, int r1,
                                     float *const *out)
{
    const size_t gs = (size_t)n * MATVEC_GROUP; /* floats per group */
    int t = 0;
    /* sextets while 6 or more are left (the pair loads and inserts of a column shared by
     * twice the tokens); then as the AVX2 kernel: triples, pairs for the last 2 or 4,
     * then one */
    for (; T - t >= 6; t += 6)
        rows16(wp, gs, n, x, out, t, r0, r1, 6);
    for (; T - t >= 3 && T - t != 4; t += 3)
        rows16(wp, gs, n, x, out, t, r0, r1, 3);
    for (; t + 2 <= T; t += 2)
        rows16(wp, gs, n, x, out, t, r0, r1, 2);
    if (t < T)
        rows16(wp, gs, n, x, out, t, r0, r1, 1);
}

#endif /* KERN_HAVE_X86 */
