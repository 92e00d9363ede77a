/*
 * kernels_x86_vnni: the Q8_0 products of AVX-512 machines (kern_matmul at
 * KERN_ISA_AVX512: kern_x86_matmul_q8_avx512), bit-identical to kern_dot_q8_0 as every
 * kernel is (kernels.h).
 *
 * Routing: KERN_LAYOUT_Q8X8 matrices (what a loaded model has) at T = 1 .. 3 (batch 1
 * and the MTP verify shapes) run the VNNI tiles here; T >= 4 (batched decode, prefill)
 * and GGUF-layout matrices the pair-interleaved AVX-512 path (kernels_x86.c
 * kern_x86_matmul_avx512: from T = 8 1.8-4.4x the AVX2 kernels, and 1.6-1.9x this file's
 * 8-row x 3-token ymm tile, measured), GGUF at T = 1 the AVX2 kernel.
 *
 * The VNNI tiles, per row, token and 32-element block: the weights negated where the
 * activation quant x is negative (one masked subtraction: Q8X8 quants are in [-127, 127],
 * so no overflow), vpdpbusd(|x|, that) = the reference's exact integer sums p[k] of 4
 * products per lane (unsigned x signed bytes, no saturation: 4 * 127 * 127 fits), the
 * conversion and acc[k] = fma(d_w * d_x, (float)p[k], acc[k]); hsum8 as hsum8_ref. The
 * 8 rows' f16 scales come in one load and conversion per block and are multiplied by each
 * token's d_x once (the product the reference rounds). tile_z (whole groups) puts rows 2k
 * and 2k + 1 of a block in one 512-bit register (one 64-byte load; x broadcast to both
 * halves; the two rows' d_w * d_x put in the halves by one permutation): 5 instructions
 * per two rows and token where AVX2 needs 5 per row (the pair products and pair sums
 * separately), and the 8-row x 3-token tile's 12 accumulators fit the 32 registers, so
 * the verify pass reads each weight once, from memory, as batch 1 does. tile_vnni (1 row,
 * 256-bit) takes the rows of groups cut by a row range. Batch 1 and verify stream the
 * weights: software prefetch PF_V bytes ahead along the group's linear stream, as the
 * AVX2 tile_q8x8 (1024 and 2048 measured alike in noise).
 *
 * Measured on a 2-core AMD EPYC (Zen 4, shared, load average 7-12): L2-resident, one
 * thread, CPU time, against the AVX2 Q8X8 kernels: T = 1 1.54x, T = 2 2.22x, T = 3 1.96x
 * the rate; the 1B Q8_0 model's verify pass (`bench_engine --verify`) 3 tokens / 1 x1.12
 * against x1.39 on AVX2. Before this file, the pair-interleaved path at T = 2, 3 lost to
 * the AVX2 Q8X8 groups (time over T = 1: 1.82 / 2.41 against 1.14 / 1.52).
 */
#include "kernels_internal.h"

#ifdef KERN_HAVE_X86
#include <immintrin.h>

#define TGTV __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))
#define TILEV static inline __attribute__((always_inline)) TGTV

#ifndef PF_V
#define PF_V 1024 /* bytes ahead along a group's stream (batch 1, verify) */
#endif

/* R rows [rr, rr + R) of the group at g (quants from so) x NT tokens (xd, xs: token 0's
 * scales and quants, strides nb and n); results to out[t][i + r]. PF: prefetch distance
 * in bytes (0: none). */
TILEV void tile_vnni(const int R, const int NT, const int PF, const uint8_t *g, size_t so, int rr,
                     const float *xd, const int8_t *xs, int n, float *const *out, int i)
{
    const int nb = n / KERN_Q8_BLOCK;
    const __m256i zero = _mm256_setzero_si256();
    __m256 acc[8][4];
    float dd[4][8] __attribute__((aligned(32)));
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
            acc[r][t] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + (size_t)b * 16)));
        __m256i ax[4];
        __mmask32 neg[4];
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const __m256i xv = _mm256_loadu_si256(
                (const __m256i *)(xs + (size_t)t * n + (size_t)b * KERN_Q8_BLOCK));
            neg[t] = _mm256_movepi8_mask(xv);
            ax[t] = _mm256_abs_epi8(xv);
            _mm256_store_ps(dd[t], _mm256_mul_ps(dv, _mm256_set1_ps(xd[(size_t)t * nb + b])));
        }
        const uint8_t *q = g + so + (size_t)b * 256 + 32 * (size_t)rr;
        const float *dr = &dd[0][0] + (R == 8 ? 0 : rr);
        if (PF) {
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                _mm_prefetch((const char *)q + PF + 64 * k, _MM_HINT_T0);
            if ((b & 3) == 0)
                _mm_prefetch((const char *)g + (size_t)b * 16 + PF / 16, _MM_HINT_T0);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(q + 32 * r));
                const __m256i sw = _mm256_mask_sub_epi8(wv, neg[t], zero, wv);
                const __m256i p = _mm256_dpbusd_epi32(zero, ax[t], sw);
                acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(dr[8 * t + r]), _mm256_cvtepi32_ps(p),
                                            acc[r][t]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
            out[t][i + r] = kern_x86_hsum8(acc[r][t]);
}

/* Whole groups x NT <= 3 tokens on 512-bit registers: a register holds the 8 lanes of
 * rows 2k (low half) and 2k + 1 (high half) of a block, one 64-byte load; the token's
 * quants broadcast to both halves; the scales d_w * d_x of the two rows put in the two
 * halves by one permutation. The same operations per row and token as tile_vnni (so the
 * same bits), half the instructions. */
TILEV void tile_z(const int NT, const int PF, const uint8_t *g, size_t so, const float *xd,
                  const int8_t *xs, int n, float *const *out, int i)
{
    const int nb = n / KERN_Q8_BLOCK;
    const __m512i zero = _mm512_setzero_si512();
    __m512i idx[4];
    __m512 acc[4][3];
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        idx[k] = _mm512_inserti64x4(_mm512_set1_epi32(2 * k), _mm256_set1_epi32(2 * k + 1), 1);
#pragma GCC unroll 3
        for (int t = 0; t < NT; t++)
            acc[k][t] = _mm512_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + (size_t)b * 16)));
        __m512i ax[3];
        __mmask64 neg[3];
        __m512 dd[3];
#pragma GCC unroll 3
        for (int t = 0; t < NT; t++) {
            const __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                (const __m256i *)(xs + (size_t)t * n + (size_t)b * KERN_Q8_BLOCK)));
            neg[t] = _mm512_movepi8_mask(xv);
            ax[t] = _mm512_abs_epi8(xv);
            dd[t] =
                _mm512_castps256_ps512(_mm256_mul_ps(dv, _mm256_set1_ps(xd[(size_t)t * nb + b])));
        }
        const uint8_t *q = g + so + (size_t)b * 256;
        if (PF) {
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                _mm_prefetch((const char *)q + PF + 64 * k, _MM_HINT_T0);
            if ((b & 3) == 0)
                _mm_prefetch((const char *)g + (size_t)b * 16 + PF / 16, _MM_HINT_T0);
        }
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const __m512i wv = _mm512_loadu_si512((const void *)(q + 64 * k));
#pragma GCC unroll 3
            for (int t = 0; t < NT; t++) {
                const __m512i sw = _mm512_mask_sub_epi8(wv, neg[t], zero, wv);
                const __m512i p = _mm512_dpbusd_epi32(zero, ax[t], sw);
                acc[k][t] = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx[k], dd[t]),
                                            _mm512_cvtepi32_ps(p), acc[k][t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++)
#pragma GCC unroll 3
        for (int t = 0; t < NT; t++) {
            out[t][i + 2 * k] = kern_x86_hsum8(_mm512_castps512_ps256(acc[k][t]));
            out[t][i + 2 * k + 1] = kern_x86_hsum8(_mm512_extractf32x8_ps(acc[k][t], 1));
        }
}

#define DEFZ(NT, PF, NAME)                                                                         \
    static TGTV __attribute__((noinline)) void NAME(const uint8_t *g, size_t so, int rr,           \
                                                    const float *xd, const int8_t *xs, int n,      \
                                                    float *const *out, int i)                      \
    {                                                                                              \
        (void)rr;                                                                                  \
        tile_z(NT, PF, g, so, xd, xs, n, out, i);                                                  \
    }
DEFZ(1, PF_V, z1)
DEFZ(2, PF_V, z2)
DEFZ(3, PF_V, z3)

#define DEFV(R, NT, PF, NAME)                                                                      \
    static TGTV __attribute__((noinline)) void NAME(const uint8_t *g, size_t so, int rr,           \
                                                    const float *xd, const int8_t *xs, int n,      \
                                                    float *const *out, int i)                      \
    {                                                                                              \
        tile_vnni(R, NT, PF, g, so, rr, xd, xs, n, out, i);                                        \
    }
DEFV(1, 1, 0, v1_1)
DEFV(1, 2, 0, v1_2)
DEFV(1, 3, 0, v1_3)

typedef void (*v_fn)(const uint8_t *, size_t, int, const float *, const int8_t *, int,
                     float *const *, int);
static const v_fn v1[4] = {NULL, v1_1, v1_2, v1_3};
static const v_fn zt[4] = {NULL, z1, z2, z3};

/* Q8X8 products of rows [r0, r1) at T = 1 .. 3: whole groups in tile_z, the rows of
 * groups cut by r0 or r1 in 1-row tiles. */
static TGTV void matmul_q8x8_vnni(const kern_mat *w, const kern_act *a, int r0, int r1,
                                  float *const *out)
{
    const int n = a->n, T = a->T, nb = n / KERN_Q8_BLOCK;
    const size_t gs = kern_q8x8_gbytes(nb), so = kern_q8x8_sbytes(nb);
    const uint8_t *base = w->data;
    for (int i = r0; i < r1;) {
        const uint8_t *g = base + (size_t)(i / 8) * gs;
        if (i % 8 == 0 && i + 8 <= r1) {
            zt[T](g, so, 0, a->q_d, a->q_s, n, out, i);
            i += 8;
        } else {
            v1[T](g, so, i % 8, a->q_d, a->q_s, n, out, i);
            i++;
        }
    }
}

void kern_x86_matmul_q8_avx512(const kern_mat *w, const kern_act *a, int r0, int r1,
                               float *const *out, float *scratch)
{
    if (w->layout == KERN_LAYOUT_Q8X8 && a->T <= 3) {
        matmul_q8x8_vnni(w, a, r0, r1, out);
        return;
    }
    /* batch 1, or no packed pairs and no scratch to pack them into: AVX2 (the same bits) */
    if (a->T == 1 || (!scratch && !a->qp)) {
        if (w->layout == KERN_LAYOUT_Q8X8)
            kern_x86_matmul_q8x8_avx2(w, a, r0, r1, out);
        else
            kern_x86_matmul_q8_avx2(w, a, r0, r1, out);
        return;
    }
    kern_x86_matmul_avx512(w, a, r0, r1, out, scratch);
}

#endif /* KERN_HAVE_X86 */
