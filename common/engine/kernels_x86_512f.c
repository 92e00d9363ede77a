/*
 * kernels_x86_512f: the AVX-512 FAST-order F32/F16 products for T >= 2 (prefill and
 * batch decode), behind kern_matmul; bit-identical to kern_dot_fast_f32 per output element.
 *
 * A 512-bit register holds the 8 lanes of one dot product for token t (low half) and for
 * token t + 1 (high half), against the same 8 weights in both halves (kern_pack_act's
 * token pairs: kernels_x86.c); lane k of a half runs the reference's chain
 * acc[k] = fma(w[j], x[j], acc[k]) over j = k mod 8, then hsum8_ref's reduction and the
 * n mod 8 tail with fmaf, so the tile shape and the instruction set change which dot
 * products run side by side, never the operations of one.
 *
 * With 32 registers the tile is R512 rows x NP512 token pairs (4 x 5: 20 accumulators, the
 * 5 pairs' activations and the weights in registers, no spills), against AVX2's 4 rows x
 * 3 tokens with 12 and the AVX-512 kernel before's 4 x 4 pairs. The loops are the AVX2
 * prefill's (kernels_x86.c "FAST order prefill"): row superblocks of MR512_BYTES of
 * weights, in them token blocks of TB512 tokens (their packed activations stay in L2
 * while the superblock's rows pass over them), in them R512-row tiles over every token
 * tile of the block. kern_matmul calls it from F512_MIN_T = 128 tokens (kernels_internal.h),
 * with packed activations (a->xp, as the forward pass packs them).
 *
 * Measured, the kernel alone (CPU time per call, medians of 3 alternating calls against
 * kern_x86_matmul_avx512 in one process; a loaded 2-core AMD EPYC family 26, whose 512-bit
 * FMA units make AVX-512 1.6-1.7x AVX2 here), F16, T = 512: 2048x2048 1.04-1.21x,
 * 2048x5632 1.12-1.23x, 5632x2048 1.07-1.20x the kernel before. Tried: 4 x 6 pairs
 * (token blocks of 12): alike; 4 x 4, 6 x 4, 8 x 3: 0.86-1.05x; superblocks of 256 or
 * 512 KB: 0.76-0.96x on 5632-wide rows, of every row: 0.64-0.9x; token blocks of 24:
 * 0.96-1.1x. At T = 16 .. 96 (batch decode, one token block) it measured 0.8-1.1x the
 * kernel before, which keeps those.
 */
#include "kernels_internal.h"

#ifdef KERN_HAVE_X86
#include <immintrin.h>
#include <math.h>
#include <string.h>

#define TGT512F __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
#define TILE512F static inline __attribute__((always_inline)) TGT512F

#ifndef R512
#define R512 4
#endif
#ifndef NP512
#define NP512 5
#endif
#ifndef MR512_BYTES
#define MR512_BYTES (4 << 20) /* weight bytes of a row superblock */
#endif
#ifndef TB512
#define TB512 10 /* even: token blocks start on a pair */
#endif

/* Weights 8s .. 8s + 7 of a row, in both halves. */
TILE512F __m512 w16(const uint8_t *row, int s, int f16)
{
    if (f16) {
        __m256 w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 16 * (size_t)s)));
        return _mm512_insertf32x8(_mm512_castps256_ps512(w), w, 1);
    }
    return _mm512_broadcast_f32x8(_mm256_loadu_ps((const float *)row + 8 * (size_t)s));
}

TILE512F float w1(const uint8_t *row, int j, int f16)
{
    if (f16) {
        uint16_t h;
        memcpy(&h, row + 2 * (size_t)j, 2);
        return _cvtsh_ss(h);
    }
    return ((const float *)row)[j];
}

/* R rows from wrow (stride ws bytes) x NP pairs from xp (the tile's first pair; pairs
 * steps * 16 floats apart); tokens [0, nt) of the tile, x: the tile's first token row. */
TILE512F void tile(const int R, const int NP, const int f16, const uint8_t *wrow, size_t ws,
                   const float *xp, const float *x, int n, int nt, float *const *out, int i)
{
    const int steps = n / 8, n8 = steps * 8;
    __m512 acc[8][8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int p = 0; p < NP; p++)
            acc[r][p] = _mm512_setzero_ps();
    for (int s = 0; s < steps; s++) {
        __m512 xv[8];
#pragma GCC unroll 8
        for (int p = 0; p < NP; p++)
            xv[p] = _mm512_load_ps(xp + ((size_t)p * steps + s) * 16);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m512 wv = w16(wrow + (size_t)r * ws, s, f16);
#pragma GCC unroll 8
            for (int p = 0; p < NP; p++)
                acc[r][p] = _mm512_fmadd_ps(wv, xv[p], acc[r][p]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int p = 0; p < NP; p++)
            for (int h = 0; h < 2 && 2 * p + h < nt; h++) {
                const int t = 2 * p + h;
                float sum = kern_x86_hsum8(h ? _mm512_extractf32x8_ps(acc[r][p], 1)
                                         : _mm512_castps512_ps256(acc[r][p]));
                const float *xt = x + (size_t)t * n;
                for (int j = n8; j < n; j++)
                    sum = fmaf(w1(wrow + (size_t)r * ws, j, f16), xt[j], sum);
                out[t][i + r] = sum;
            }
}

typedef void (*tile_fn)(const uint8_t *, size_t, const float *, const float *, int, int,
                        float *const *, int);

#define DEF_T(R, NP)                                                                               \
    static TGT512F __attribute__((noinline)) void t512_##R##_##NP##_0(                             \
        const uint8_t *w, size_t ws, const float *xp, const float *x, int n, int nt,               \
        float *const *out, int i)                                                                  \
    {                                                                                              \
        tile(R, NP, 0, w, ws, xp, x, n, nt, out, i);                                               \
    }                                                                                              \
    static TGT512F __attribute__((noinline)) void t512_##R##_##NP##_1(                             \
        const uint8_t *w, size_t ws, const float *xp, const float *x, int n, int nt,               \
        float *const *out, int i)                                                                  \
    {                                                                                              \
        tile(R, NP, 1, w, ws, xp, x, n, nt, out, i);                                               \
    }
#define DEF_R(R)                                                                                   \
    DEF_T(R, 1) DEF_T(R, 2) DEF_T(R, 3) DEF_T(R, 4) DEF_T(R, 5) DEF_T(R, 6) DEF_T(R, 7) DEF_T(R, 8)
DEF_R(R512)
#if R512 != 1
DEF_R(1)
#endif

#define TAB(R, F)                                                                                  \
    {                                                                                              \
        NULL, t512_##R##_1_##F, t512_##R##_2_##F, t512_##R##_3_##F, t512_##R##_4_##F,              \
            t512_##R##_5_##F, t512_##R##_6_##F, t512_##R##_7_##F, t512_##R##_8_##F                 \
    }
#define TAB2(R) TAB(R, 0), TAB(R, 1)
#define XTAB(R) TAB2(R)
/* [f16][pairs] */
static const tile_fn tiles_r[2][9] = {XTAB(R512)};
static const tile_fn tiles_1[2][9] = {XTAB(1)};

TGT512F void kern_x86_matmul_fast_avx512(const kern_mat *w, const kern_act *a, int r0, int r1,
                                         float *const *out)
{
    const int n = a->n, T = a->T, steps = n / 8, f16 = w->type == GGUF_TENSOR_F16;
    const size_t ws = kern_row_bytes(w), ps = (size_t)steps * 16; /* floats per pair */
    const uint8_t *base = w->data;
    const int tbs = T <= TB512 ? T + (T & 1) : TB512;
    int mr = (int)(MR512_BYTES / ws) / R512 * R512;
    mr = mr < 4 * R512 ? 4 * R512 : mr;
    for (int rs = r0; rs < r1; rs += mr) {
        const int re = rs + mr < r1 ? rs + mr : r1;
        for (int tb = 0; tb < T; tb += tbs) {
            const int te = tb + tbs < T ? tb + tbs : T;
            int i = rs;
            for (; i + R512 <= re; i += R512)
                for (int t = tb; t < te; t += 2 * NP512) {
                    const int nt = te - t < 2 * NP512 ? te - t : 2 * NP512;
                    tiles_r[f16][(nt + 1) / 2](base + (size_t)i * ws, ws,
                                               a->xp + (size_t)t / 2 * ps, a->x + (size_t)t * n, n,
                                               nt, out + t, i);
                }
            for (; i < re; i++)
                for (int t = tb; t < te; t += 2 * NP512) {
                    const int nt = te - t < 2 * NP512 ? te - t : 2 * NP512;
                    tiles_1[f16][(nt + 1) / 2](base + (size_t)i * ws, ws,
                                               a->xp + (size_t)t / 2 * ps, a->x + (size_t)t * n, n,
                                               nt, out + t, i);
                }
        }
    }
}

#endif /* KERN_HAVE_X86 */
