/*
 * kernels_x86: the AVX2 (+FMA, F16C) and AVX-512 (F/BW/DQ/VL/VNNI) kernels behind
 * kernels.h, each bit-identical to its reference in kernels.c. Functions carry target
 * attributes, so this file builds with the project's flags and the code runs only where
 * kern_isa_detect() found the instructions.
 *
 * The AVX2 FAST and Q8_0 kernels compute a tile of R weight rows x NT tokens at once
 * (R * NT independent 8-lane accumulators hide the FMA latency, each weight vector loaded
 * is used NT times, each activation vector R times); the tile shape changes which dot
 * products run side by side, never the operations of one dot product. For prefill the
 * rows are taken in blocks that stay in cache while every token passes over them, so
 * each weight byte comes from memory once per call; F32/F16 prefill (T >= 8) runs row
 * superblocks x token blocks ("FAST order prefill" below) so that a block of activations
 * stays in L2 for many rows. Q8X8 prefill (T >= 16) runs whole 8-row groups one token at a
 * time (q8x8_pp).
 *
 * The AVX-512 kernels at the end (two tokens per register) take every T >= 2 on an AVX-512
 * CPU, F32/F16 prefill from F512_MIN_T tokens excepted: kernels_x86_512f.c (larger tiles
 * and the prefill's blocking). On the AVX-512 machine (AMD EPYC family 26, 512-bit FMA
 * units) the AVX-512 F16 products ran 1.6-1.7x the AVX2 ones at T = 8 .. 512 and ~1.1x
 * at T = 2, 3 (the kernels alone, CPU time; docs/bench.md).
 *
 * Q8_0 matrices repacked at load (KERN_LAYOUT_Q8X8, kernels.h) have their own tiles
 * (tile_q8x8): a group of 8 rows is one linear stream, its 8 scales one load per block;
 * at T = 2, 3 (the MTP verify pass) whole groups run token by token (q8x8_group_tok).
 */
#include "kernels_internal.h"

#ifdef KERN_HAVE_X86
#include <immintrin.h>
#include <math.h>
#include <string.h>

/* Batch-1 decode streams the weights from memory with one row tile per step; software
 * prefetch this many bytes ahead in each row raised a single core's rate by ~7% (F16)
 * and ~30% (Q8_0, whose 34-byte blocks the hardware prefetcher follows less well) on
 * the development machine (tests/bench). Prefill tiles stream from L2 and do not. */
#define PF_FAST 512
#define PF_Q8 512
/* Q8_0 rows of at most PF_LIN_ROW bytes prefetch linearly, PF_LIN bytes ahead
 * (tile_q8_lin): on a 2-core AMD EPYC (AVX2), 1.3x the per-row prefetch's rate on
 * 2048-wide rows streamed from memory by 2 threads (a kernel loop, alternating runs), and
 * no better than it on 5632-wide ones, which keep the per-row prefetch; distances from 12
 * to 64 KB measured alike, 16 KB keeps the overshoot past a row range small. */
#define PF_LIN 16384
#define PF_LIN_ROW 4096

#define ROW_BLOCK 16 /* rows per L2-resident block in prefill (Q8_0; F32/F16 at T < GB_MIN_T) */
/* Q8X8 prefill from Q8_PP_T tokens: Q8_PP_ROWS rows at a time under every token */
#ifndef Q8_PP_T
#define Q8_PP_T 16
#endif
#ifndef Q8_PP_ROWS
#define Q8_PP_ROWS 16
#endif

#define TGT __attribute__((target("avx2,fma,f16c")))
#define TILE static inline __attribute__((always_inline)) TGT

TILE __m256 load_w8(const uint8_t *row, int j, int f16)
{
    if (f16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * (size_t)j)));
    return _mm256_loadu_ps((const float *)row + j);
}

TILE float load_w1(const uint8_t *row, int j, int f16)
{
    if (f16) {
        uint16_t h;
        memcpy(&h, row + 2 * (size_t)j, 2);
        return _cvtsh_ss(h);
    }
    return ((const float *)row)[j];
}

/* FAST order, R rows from wrow (stride ws bytes) x NT tokens from x (stride n). */
TILE void tile_fast(const int R, const int NT, const int f16, const uint8_t *wrow, size_t ws,
                    const float *x, int n, float *const *out, int i)
{
    const int pf = NT == 1 ? PF_FAST : 0;
    __m256 acc[8][3];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int t = 0; t < NT; t++)
            acc[r][t] = _mm256_setzero_ps();
    const int n8 = n & ~7;
    for (int j = 0; j < n8; j += 8) {
        __m256 xv[3];
#pragma GCC unroll 3
        for (int t = 0; t < NT; t++)
            xv[t] = _mm256_loadu_ps(x + (size_t)t * n + j);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            if (pf && (j & 15) == 0)
                _mm_prefetch((const char *)(wrow + (size_t)r * ws) + (f16 ? 2 : 4) * j + pf,
                             _MM_HINT_T0);
            __m256 wv = load_w8(wrow + (size_t)r * ws, j, f16);
#pragma GCC unroll 3
            for (int t = 0; t < NT; t++)
                acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
#pragma GCC unroll 3
        for (int t = 0; t < NT; t++) {
            float s = kern_x86_hsum8(acc[r][t]);
            const float *xt = x + (size_t)t * n;
            for (int j = n8; j < n; j++)
                s = fmaf(load_w1(wrow + (size_t)r * ws, j, f16), xt[j], s);
            out[t][i + r] = s;
        }
    }
}

/* Q8_0: R rows x NT tokens; xd/xs: token 0's scales and quants (strides nb, n). The
 * integer lane sums p[k] = sum of |w| * (x with the sign of w) over elements 4k..4k+3 are
 * exact: maddubs pairs cannot saturate (|w| <= 128, |x| <= 127). */
TILE void tile_q8(const int R, const int NT, const uint8_t *wrow, size_t ws, const float *xd,
                  const int8_t *xs, int n, float *const *out, int i)
{
    const int nb = n / KERN_Q8_BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[8][3];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int t = 0; t < NT; t++)
            acc[r][t] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i xv[3];
        __m256 dx[3];
#pragma GCC unroll 3
        for (int t = 0; t < NT; t++) {
            xv[t] = _mm256_loadu_si256(
                (const __m256i *)(xs + (size_t)t * n + (size_t)b * KERN_Q8_BLOCK));
            dx[t] = _mm256_broadcast_ss(xd + (size_t)t * nb + b);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = wrow + (size_t)r * ws + (size_t)b * KERN_Q8_BLOCK_BYTES;
            if (NT == 1)
                _mm_prefetch((const char *)blk + PF_Q8, _MM_HINT_T0);
            uint16_t h;
            memcpy(&h, blk, 2);
            __m256 dw = _mm256_set1_ps(_cvtsh_ss(h));
            __m256i wv = _mm256_loadu_si256((const __m256i *)(blk + 2));
            __m256i aw = _mm256_sign_epi8(wv, wv);
#pragma GCC unroll 3
            for (int t = 0; t < NT; t++) {
                __m256i sx = _mm256_sign_epi8(xv[t], wv);
                __m256i p16 = _mm256_maddubs_epi16(aw, sx);
                __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
                acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx[t]), p, acc[r][t]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int t = 0; t < NT; t++)
            out[t][i + r] = kern_x86_hsum8(acc[r][t]);
}

/* Q8_0 at batch 1 with short rows: one token, R rows whose 34-byte blocks are read side
 * by side, R streams of ws bytes each. When ws is short (a 2048-wide row is 2176 bytes)
 * the hardware prefetchers never ramp up on streams that short, and a prefetch a few
 * lines ahead in each row (tile_q8) comes too late; so the prefetch runs linearly over
 * the rows' contiguous bytes, PF_LIN bytes ahead of the tile's consumption (R rows x 34
 * bytes per block step: 5 lines), into the next tiles, and stops at the end of the
 * caller's row range (lim: bytes from wrow to it). Products and order are tile_q8's:
 * acc[k] = fma(dw * dx, (float)p[k], acc[k]) block by block. */
TILE void tile_q8_lin(const int R, const uint8_t *wrow, size_t ws, size_t lim, const float *xd,
                      const int8_t *xs, int n, float *const *out, int i)
{
    const int nb = n / KERN_Q8_BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xs + (size_t)b * KERN_Q8_BLOCK));
        const __m256 dx = _mm256_broadcast_ss(xd + b);
        const size_t pf = (size_t)b * R * KERN_Q8_BLOCK_BYTES + PF_LIN;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = wrow + (size_t)r * ws + (size_t)b * KERN_Q8_BLOCK_BYTES;
            if (r * 64 < R * KERN_Q8_BLOCK_BYTES + 64 && pf + 64 * (size_t)r < lim)
                _mm_prefetch((const char *)wrow + pf + 64 * (size_t)r, _MM_HINT_T0);
            uint16_t h;
            memcpy(&h, blk, 2);
            __m256 d = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(h)), dx);
            __m256i wv = _mm256_loadu_si256((const __m256i *)(blk + 2));
            __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
            __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
            acc[r] = _mm256_fmadd_ps(d, p, acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        out[0][i + r] = kern_x86_hsum8(acc[r]);
}

static TGT __attribute__((noinline)) void q8lin_8(const uint8_t *w, size_t ws, size_t lim,
                                                  const float *xd, const int8_t *xs, int n,
                                                  float *const *out, int i)
{
    tile_q8_lin(8, w, ws, lim, xd, xs, n, out, i);
}

#define DEF_FAST(R, NT, F16)                                                                       \
    static TGT __attribute__((noinline)) void fast_##R##_##NT##_##F16(                             \
        const uint8_t *w, size_t ws, const float *x, int n, float *const *out, int i)              \
    {                                                                                              \
        tile_fast(R, NT, F16, w, ws, x, n, out, i);                                                \
    }
#define DEF_FAST_ALL(F16)                                                                          \
    DEF_FAST(8, 1, F16)                                                                            \
    DEF_FAST(4, 3, F16)                                                                            \
    DEF_FAST(4, 2, F16)                                                                            \
    DEF_FAST(4, 1, F16)                                                                            \
    DEF_FAST(1, 3, F16)                                                                            \
    DEF_FAST(1, 2, F16)                                                                            \
    DEF_FAST(1, 1, F16)
DEF_FAST_ALL(0)
DEF_FAST_ALL(1)

#define DEF_Q8(R, NT)                                                                              \
    static TGT __attribute__((noinline)) void q8_##R##_##NT(const uint8_t *w, size_t ws,           \
                                                            const float *xd, const int8_t *xs,     \
                                                            int n, float *const *out, int i)       \
    {                                                                                              \
        tile_q8(R, NT, w, ws, xd, xs, n, out, i);                                                  \
    }
DEF_Q8(8, 1)
DEF_Q8(4, 3)
DEF_Q8(4, 2)
DEF_Q8(4, 1)
DEF_Q8(1, 3)
DEF_Q8(1, 2)
DEF_Q8(1, 1)

typedef void (*fast_fn)(const uint8_t *, size_t, const float *, int, float *const *, int);
typedef void (*q8_fn)(const uint8_t *, size_t, const float *, const int8_t *, int, float *const *,
                      int);

static const fast_fn fast_r4[2][4] = {
    {NULL, fast_4_1_0, fast_4_2_0, fast_4_3_0},
    {NULL, fast_4_1_1, fast_4_2_1, fast_4_3_1},
};
static const fast_fn fast_r1[2][4] = {
    {NULL, fast_1_1_0, fast_1_2_0, fast_1_3_0},
    {NULL, fast_1_1_1, fast_1_2_1, fast_1_3_1},
};
static const q8_fn q8_r4[4] = {NULL, q8_4_1, q8_4_2, q8_4_3};
static const q8_fn q8_r1[4] = {NULL, q8_1_1, q8_1_2, q8_1_3};

/* --- FAST order prefill: row superblocks x token blocks ------------------------------
 * From GB_MIN_T tokens the FAST kernel loops as llama.cpp's tinyBLAS gemm does around
 * the same 4-row x 3-token register tile over whole rows (tile_fast, F16 converted in
 * the tile): row superblocks of GB_MR rows, in them token blocks of GB_TB tokens (their
 * activations, 96 KB at n = 2048, stay in L2 while every 4-row tile of the superblock
 * passes over them), in them 4-row tiles (a tile's F16 rows, 16 KB, stay in L1 for the
 * block's token tiles). The tiles are the unblocked kernel's, so the order is too.
 *
 * Measured against the alternatives on the 1B shapes (T = 512; 2048x2048, 5632x2048,
 * 2048x5632; CPU time, alternating, medians; docs/bench.md): F16 rows widened 8 at a time
 * into the scratch with every token tile over them (the kernel before): 0.70x; a
 * GEMM-blocked kernel with 16-row panels widened into L1, 256-column blocks and the
 * 8-lane accumulators kept in memory between them: 0.75-0.8x (widening cold lines and
 * the accumulator traffic cost more than the L1 panel saves). Superblocks of 32, 64 (48
 * tokens) and 128 rows (12 tokens): 0.75x, 0.95x, 1x. */
static TGT void matmul_fast_prefill(const kern_mat *w, const kern_act *a, int r0, int r1,
                                    float *const *out)
{
    const int n = a->n, T = a->T, f16 = w->type == GGUF_TENSOR_F16;
    const size_t ws = kern_row_bytes(w);
    const uint8_t *base = w->data;
    for (int rs = r0; rs < r1; rs += GB_MR) {
        const int re = rs + GB_MR < r1 ? rs + GB_MR : r1;
        for (int tb = 0; tb < T; tb += GB_TB) {
            const int te = tb + GB_TB < T ? tb + GB_TB : T;
            int i = rs;
            for (; i + 4 <= re; i += 4)
                for (int t = tb; t < te; t += 3)
                    fast_r4[f16][te - t < 3 ? te - t : 3](base + (size_t)i * ws, ws,
                                                          a->x + (size_t)t * n, n, out + t, i);
            for (; i < re; i++)
                for (int t = tb; t < te; t += 3)
                    fast_r1[f16][te - t < 3 ? te - t : 3](base + (size_t)i * ws, ws,
                                                          a->x + (size_t)t * n, n, out + t, i);
        }
    }
}

TGT void kern_x86_matmul_fast_avx2(const kern_mat *w, const kern_act *a, int r0, int r1,
                                   float *const *out, float *scratch)
{
    const int n = a->n, T = a->T, f16 = w->type == GGUF_TENSOR_F16;
    const size_t ws = kern_row_bytes(w);
    const uint8_t *base = w->data;
    if (T >= GB_MIN_T) {
        matmul_fast_prefill(w, a, r0, r1, out);
        return;
    }
    if (T == 1) {
        int i = r0;
        for (; i + 8 <= r1; i += 8)
            (f16 ? fast_8_1_1 : fast_8_1_0)(base + (size_t)i * ws, ws, a->x, n, out, i);
        for (; i < r1; i++)
            fast_r1[f16][1](base + (size_t)i * ws, ws, a->x, n, out, i);
        return;
    }
    for (int rb = r0; rb < r1; rb += ROW_BLOCK) {
        int re = rb + ROW_BLOCK < r1 ? rb + ROW_BLOCK : r1;
        for (int t = 0; t < T; t += 3) {
            int nt = T - t < 3 ? T - t : 3;
            const float *xt = a->x + (size_t)t * n;
            int i = rb;
            for (; i + 4 <= re; i += 4)
                fast_r4[f16][nt](base + (size_t)i * ws, ws, xt, n, out + t, i);
            for (; i < re; i++)
                fast_r1[f16][nt](base + (size_t)i * ws, ws, xt, n, out + t, i);
        }
    }
}

TGT void kern_x86_matmul_q8_avx2(const kern_mat *w, const kern_act *a, int r0, int r1,
                                 float *const *out)
{
    const int n = a->n, T = a->T, nb = n / KERN_Q8_BLOCK;
    const size_t ws = kern_row_bytes(w);
    const uint8_t *base = w->data;
    if (T == 1) {
        int i = r0;
        if (ws <= PF_LIN_ROW) {
            /* the first PF_LIN bytes at once: the tiles' prefetch starts PF_LIN ahead */
            const size_t lead = (size_t)(r1 - r0) * ws < PF_LIN ? (size_t)(r1 - r0) * ws : PF_LIN;
            for (size_t o = 0; o < lead; o += 64)
                _mm_prefetch((const char *)base + (size_t)r0 * ws + o, _MM_HINT_T0);
            for (; i + 8 <= r1; i += 8)
                q8lin_8(base + (size_t)i * ws, ws, (size_t)(r1 - i) * ws, a->q_d, a->q_s, n, out,
                        i);
        }
        for (; i + 8 <= r1; i += 8)
            q8_8_1(base + (size_t)i * ws, ws, a->q_d, a->q_s, n, out, i);
        for (; i < r1; i++)
            q8_1_1(base + (size_t)i * ws, ws, a->q_d, a->q_s, n, out, i);
        return;
    }
    for (int rb = r0; rb < r1; rb += ROW_BLOCK) {
        int re = rb + ROW_BLOCK < r1 ? rb + ROW_BLOCK : r1;
        for (int t = 0; t < T; t += 3) {
            int nt = T - t < 3 ? T - t : 3;
            const float *xd = a->q_d + (size_t)t * nb;
            const int8_t *xs = a->q_s + (size_t)t * n;
            int i = rb;
            for (; i + 4 <= re; i += 4)
                q8_r4[nt](base + (size_t)i * ws, ws, xd, xs, n, out + t, i);
            for (; i < re; i++)
                q8_r1[nt](base + (size_t)i * ws, ws, xd, xs, n, out + t, i);
        }
    }
}

/* --- Q8_0 in the Q8X8 layout (kernels.h) ----------------------------------------------
 * R rows (8: a whole group; 4: half of one, from row rr; 1) x NT tokens of the group at g
 * (quants from so). Per block step one load and one conversion give the 8 rows' scales;
 * they are multiplied by each token's activation scale once (dd: d_w * d_x, the product
 * the reference rounds) and broadcast per row from there. At NT = 1 the integer products
 * are |x| * (w with the sign of x), |x| taken once per block for all R rows (tile_q8 takes
 * |w| per row): the same exact w * x, so the same p[k], one instruction fewer per row and
 * block (6 -> 5; `bench_engine --kern`, T = 1, 2048-wide: 1.35x the GGUF kernel's rate
 * instead of 1.19x, two alternating runs); maddubs pairs cannot saturate and the sign
 * cannot overflow because x and (kern_q8x8_pack) w are in [-127, 127]. At NT = 2, 3 the
 * 3 extra |x| registers spill (the 4 x 3 tile already uses 16): prefill measured 0.90-1.06x
 * the GGUF kernel with it against 0.99-1.25x without, so those tiles keep |w|. Order as
 * tile_q8's:
 * acc[k] = fma(d_w * d_x, (float)p[k], acc[k]) block by block. PF: software prefetch
 * distance in bytes along the group's linear stream (0: none). */
TILE void tile_q8x8(const int R, const int NT, const int PF, const uint8_t *g, size_t so, int rr,
                    const float *xd, const int8_t *xs, int n, float *const *out, int i)
{
    const int nb = n / KERN_Q8_BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[8][3];
    float dd[3][8] __attribute__((aligned(32)));
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int t = 0; t < NT; t++)
            acc[r][t] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i xv[3], ax[3];
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + (size_t)b * 16)));
#pragma GCC unroll 3
        for (int t = 0; t < NT; t++) {
            xv[t] = _mm256_loadu_si256(
                (const __m256i *)(xs + (size_t)t * n + (size_t)b * KERN_Q8_BLOCK));
            if (NT == 1)
                ax[t] = _mm256_sign_epi8(xv[t], xv[t]);
            _mm256_store_ps(dd[t], _mm256_mul_ps(dv, _mm256_broadcast_ss(xd + (size_t)t * nb + b)));
        }
        const uint8_t *q = g + so + (size_t)b * 256 + 32 * (size_t)rr;
        if (PF) {
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                _mm_prefetch((const char *)q + PF + 64 * k, _MM_HINT_T0);
            if ((b & 3) == 0)
                _mm_prefetch((const char *)g + (size_t)b * 16 + PF / 16, _MM_HINT_T0);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(q + 32 * r));
            __m256i aw = NT == 1 ? wv : _mm256_sign_epi8(wv, wv);
#pragma GCC unroll 3
            for (int t = 0; t < NT; t++) {
                __m256i p16 = NT == 1 ? _mm256_maddubs_epi16(ax[t], _mm256_sign_epi8(wv, xv[t]))
                                      : _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv[t], wv));
                __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
                acc[r][t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&dd[t][rr + r]), p, acc[r][t]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int t = 0; t < NT; t++)
            out[t][i + r] = kern_x86_hsum8(acc[r][t]);
}

/* Batch-1 prefetch distance along a group's stream: `bench_engine --kern` (2 threads, 300 MB
 * matrices, alternating, medians) measured 1024 and 2048 alike, 4096 and none slower on
 * 5632-wide rows (none: 0.85x). Against the GGUF kernels there: 1.1-1.3x on 2048-wide rows,
 * 0.95-1.15x (noise) on 5632-wide ones. */
#ifndef PF_X8
#define PF_X8 1024
#endif

#define DEF_Q8X8(R, NT, PF)                                                                        \
    static TGT __attribute__((noinline)) void q8x8_##R##_##NT(const uint8_t *g, size_t so, int rr, \
                                                              const float *xd, const int8_t *xs,   \
                                                              int n, float *const *out, int i)     \
    {                                                                                              \
        tile_q8x8(R, NT, PF, g, so, rr, xd, xs, n, out, i);                                        \
    }
DEF_Q8X8(8, 1, PF_X8)
DEF_Q8X8(4, 3, 0)
DEF_Q8X8(4, 2, 0)
DEF_Q8X8(4, 1, 0)
DEF_Q8X8(1, 3, 0)
DEF_Q8X8(1, 2, 0)
DEF_Q8X8(1, 1, 0)
/* Prefill (T >= Q8_PP_T): the batch-1 tile's shape, a whole group x one token, without
 * its prefetch (the group is in cache for every token after the first). Against the 4 x 3
 * tile (q8x8_4_3), whose 12 accumulators, 3 activation and 2 weight registers spill
 * (AVX2 has 16), and which takes |w| per row and token tile: the 8 accumulators, x, |x|
 * and the 8 scales stay in registers, |x| is taken once per block for 8 rows. */
static TGT __attribute__((noinline)) void q8x8_pp(const uint8_t *g, size_t so, int rr,
                                                  const float *xd, const int8_t *xs, int n,
                                                  float *const *out, int i)
{
    tile_q8x8(8, 1, 0, g, so, rr, xd, xs, n, out, i);
}

/* T = 2, 3 (the MTP verify shapes) on whole groups: the 8-row 1-token tile, run once per
 * token over chunks of Q8X8_CHUNK blocks (4 KB of quants, in L1), the accumulators kept in
 * memory between chunks. Against the 4-row x 3-token tile (16 instructions per row and
 * block: |w| per row, then a sign, the pair products, the pair sums, the conversion and
 * the FMA per token; 12 accumulators, 3 activations and the weights fill the 16 ymm
 * registers), this takes |x| once per token and block and does 5 per row and token (15
 * per row and block at T = 3) without spills; the weights come from L1 for the second and
 * third token. The first two passes prefetch the block PF_X8T blocks ahead, lines 0-1 and
 * 2-3 (scales with the first), so the memory stream runs under two thirds of the compute
 * rather than one. Measured in a scratch harness (two threads, 300 MB matrices, T = 3,
 * CPU seconds, medians of alternating runs, loaded machine): 74-77 against 86-92 ms per
 * pass, and 57-58 against 64-70 ms on an L2-resident slice (the compute alone). Per row
 * and token the same operations in the same order as tile_q8x8 (acc[k] = fma(d_w * d_x,
 * (float)p[k], acc[k]) block by block, then hsum8): the same bits. */
#define Q8X8_CHUNK 16
#ifndef Q8X8_TOK_T
#define Q8X8_TOK_T 3 /* up to this T (T = 4 not measured in the streaming case) */
#endif
#define PF_X8T 16
TILE void tile_q8x8_tok(const int PFL0, const int PFN, const uint8_t *g, size_t so, const float *xd,
                        const int8_t *xs, int b0, int b1, __m256 *accio)
{
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[8];
    float dd[8] __attribute__((aligned(32)));
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++)
        acc[r] = accio[r];
    for (int b = b0; b < b1; b++) {
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + (size_t)b * 16)));
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xs + (size_t)b * KERN_Q8_BLOCK));
        const __m256i ax = _mm256_sign_epi8(xv, xv);
        _mm256_store_ps(dd, _mm256_mul_ps(dv, _mm256_broadcast_ss(xd + b)));
        const uint8_t *q = g + so + (size_t)b * 256;
        if (PFN) {
#pragma GCC unroll 4
            for (int k = 0; k < PFN; k++)
                _mm_prefetch((const char *)q + 256 * PF_X8T + 64 * (PFL0 + k), _MM_HINT_T0);
            if (PFL0 == 0 && (b & 3) == 0)
                _mm_prefetch((const char *)g + (size_t)(b + PF_X8T) * 16, _MM_HINT_T0);
        }
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(q + 32 * r));
            __m256i p16 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xv));
            __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
            acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&dd[r]), p, acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++)
        accio[r] = acc[r];
}

#define DEF_Q8X8T(NAME, PFL0, PFN)                                                                 \
    static TGT __attribute__((noinline)) void NAME(const uint8_t *g, size_t so, const float *xd,   \
                                                   const int8_t *xs, int b0, int b1, __m256 *acc)  \
    {                                                                                              \
        tile_q8x8_tok(PFL0, PFN, g, so, xd, xs, b0, b1, acc);                                      \
    }
DEF_Q8X8T(q8x8t_a, 0, 2)
DEF_Q8X8T(q8x8t_b, 2, 2)
DEF_Q8X8T(q8x8t_n, 0, 0)

/* Rows [i, i + 8) (a whole group at g) x T = 2 .. Q8X8_TOK_T tokens. */
static TGT void q8x8_group_tok(const uint8_t *g, size_t so, const float *xd, const int8_t *xs,
                               int n, int T, float *const *out, int i)
{
    const int nb = n / KERN_Q8_BLOCK;
    __m256 acc[Q8X8_TOK_T][8];
    for (int t = 0; t < T; t++)
        for (int r = 0; r < 8; r++)
            acc[t][r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b += Q8X8_CHUNK) {
        const int e = b + Q8X8_CHUNK < nb ? b + Q8X8_CHUNK : nb;
        q8x8t_a(g, so, xd, xs, b, e, acc[0]);
        q8x8t_b(g, so, xd + nb, xs + n, b, e, acc[1]);
        for (int t = 2; t < T; t++)
            q8x8t_n(g, so, xd + (size_t)t * nb, xs + (size_t)t * n, b, e, acc[t]);
    }
    for (int t = 0; t < T; t++)
        for (int r = 0; r < 8; r++)
            out[t][i + r] = kern_x86_hsum8(acc[t][r]);
}

typedef void (*q8x8_fn)(const uint8_t *, size_t, int, const float *, const int8_t *, int,
                        float *const *, int);
static const q8x8_fn q8x8_r4[4] = {NULL, q8x8_4_1, q8x8_4_2, q8x8_4_3};
static const q8x8_fn q8x8_r1[4] = {NULL, q8x8_1_1, q8x8_1_2, q8x8_1_3};

TGT void kern_x86_matmul_q8x8_avx2(const kern_mat *w, const kern_act *a, int r0, int r1,
                                   float *const *out)
{
    const int n = a->n, T = a->T, nb = n / KERN_Q8_BLOCK;
    const size_t gs = kern_q8x8_gbytes(nb), so = kern_q8x8_sbytes(nb);
    const uint8_t *base = w->data;
#define GRP(i) (base + (size_t)((i) / 8) * gs)
    if (T == 1) {
        /* the tile prefetches PF_X8 bytes ahead of its quants: the range's first group's
         * scales and first PF_X8 bytes of quants here (a chunk of the forward pass starts
         * where the other thread's stream, not this one's, was) */
        if (r0 + 8 <= r1)
            for (size_t o = 0; o < so + PF_X8 && o < gs; o += 64)
                _mm_prefetch((const char *)GRP(r0) + o, _MM_HINT_T0);
        int i = r0;
        for (; i < r1 && i % 8 != 0; i++)
            q8x8_1_1(GRP(i), so, i % 8, a->q_d, a->q_s, n, out, i);
        for (; i + 8 <= r1; i += 8)
            q8x8_8_1(GRP(i), so, 0, a->q_d, a->q_s, n, out, i);
        for (; i < r1; i++)
            q8x8_1_1(GRP(i), so, i % 8, a->q_d, a->q_s, n, out, i);
        return;
    }
    if (T <= Q8X8_TOK_T) { /* whole groups token by token, the rest in 1-row tiles */
        for (int i = r0; i < r1;) {
            if (i % 8 == 0 && i + 8 <= r1) {
                q8x8_group_tok(GRP(i), so, a->q_d, a->q_s, n, T, out, i);
                i += 8;
                continue;
            }
            for (int t = 0; t < T; t += 3)
                q8x8_r1[T - t < 3 ? T - t : 3](GRP(i), so, i % 8, a->q_d + (size_t)t * nb,
                                               a->q_s + (size_t)t * n, n, out + t, i);
            i++;
        }
        return;
    }
    if (T >= Q8_PP_T) {
        /* prefill: whole groups, one token at a time (q8x8_pp), Q8_PP_ROWS rows (in L1 or
         * L2) under every token of the call before the next rows */
        for (int rb = r0; rb < r1; rb += Q8_PP_ROWS) {
            int re = rb + Q8_PP_ROWS < r1 ? rb + Q8_PP_ROWS : r1;
            for (int t = 0; t < T; t++) {
                const float *xd = a->q_d + (size_t)t * nb;
                const int8_t *xs = a->q_s + (size_t)t * n;
                int i = rb;
                for (; i < re && i % 8 != 0; i++)
                    q8x8_1_1(GRP(i), so, i % 8, xd, xs, n, out + t, i);
                for (; i + 8 <= re; i += 8)
                    q8x8_pp(GRP(i), so, 0, xd, xs, n, out + t, i);
                for (; i < re; i++)
                    q8x8_1_1(GRP(i), so, i % 8, xd, xs, n, out + t, i);
            }
        }
        return;
    }
    for (int rb = r0; rb < r1; rb += ROW_BLOCK) {
        int re = rb + ROW_BLOCK < r1 ? rb + ROW_BLOCK : r1;
        for (int t = 0; t < T; t += 3) {
            int nt = T - t < 3 ? T - t : 3;
            const float *xd = a->q_d + (size_t)t * nb;
            const int8_t *xs = a->q_s + (size_t)t * n;
            int i = rb;
            for (; i < re && i % 4 != 0; i++)
                q8x8_r1[nt](GRP(i), so, i % 8, xd, xs, n, out + t, i);
            for (; i + 4 <= re; i += 4)
                q8x8_r4[nt](GRP(i), so, i % 8, xd, xs, n, out + t, i);
            for (; i < re; i++)
                q8x8_r1[nt](GRP(i), so, i % 8, xd, xs, n, out + t, i);
        }
    }
#undef GRP
}

TGT void kern_x86_quantize_act_avx2(const float *x, int T, int n, float *q_d, int8_t *q_s)
{
    const int nb = n / KERN_Q8_BLOCK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int t = 0; t < T; t++) {
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)t * n + (size_t)b * KERN_Q8_BLOCK;
            __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
            __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
            __m256 m = _mm256_max_ps(
                _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            float amax = _mm_cvtss_f32(m4);
            float d = amax / 127.0f;
            float id = d != 0.0f ? 1.0f / d : 0.0f;
            q_d[(size_t)t * nb + b] = d;
            __m256 vid = _mm256_set1_ps(id);
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vid));
            __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vid));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vid));
            __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vid));
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            p = _mm256_permutevar8x32_epi32(p, perm);
            _mm256_storeu_si256((__m256i *)(q_s + (size_t)t * n + (size_t)b * KERN_Q8_BLOCK), p);
        }
    }
}

/* EXACT order (run.c) for F32 weights: the lanes are 8 tokens, not 8 terms of one dot
 * product, so every lane runs run.c's chain s = s + w[j] * x[j] with j ascending (mul,
 * then add: no FMA). The token tile is transposed into the scratch (x^T: n x 8, missing
 * tokens zero, their lanes dropped); each weight element is broadcast to the 8 lanes.
 * R rows at a time give R independent chains. */
TILE void tile_exact(const int R, const float *w, size_t n_w, const float *xt, int n, int nt,
                     float *const *out, int i)
{
    __m256 acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        acc[r] = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
        __m256 xv = _mm256_load_ps(xt + (size_t)j * 8);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_add_ps(acc[r],
                                   _mm256_mul_ps(_mm256_broadcast_ss(w + (size_t)r * n_w + j), xv));
    }
    float lanes[8] __attribute__((aligned(32)));
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        _mm256_store_ps(lanes, acc[r]);
        for (int t = 0; t < nt; t++)
            out[t][i + r] = lanes[t];
    }
}

static TGT __attribute__((noinline)) void exact_8(const float *w, size_t n_w, const float *xt,
                                                  int n, int nt, float *const *out, int i)
{
    tile_exact(8, w, n_w, xt, n, nt, out, i);
}

static TGT __attribute__((noinline)) void exact_1(const float *w, size_t n_w, const float *xt,
                                                  int n, int nt, float *const *out, int i)
{
    tile_exact(1, w, n_w, xt, n, nt, out, i);
}

TGT void kern_x86_matmul_exact_avx2(const kern_mat *w, const kern_act *a, int r0, int r1,
                                    float *const *out, float *scratch)
{
    const int n = a->n, T = a->T;
    const float *base = w->data;
    float *xt = (float *)(((uintptr_t)scratch + 31) & ~(uintptr_t)31);
    for (int t0 = 0; t0 < T; t0 += 8) {
        int nt = T - t0 < 8 ? T - t0 : 8;
        for (int j = 0; j < n; j++)
            for (int e = 0; e < 8; e++)
                xt[(size_t)j * 8 + e] = e < nt ? a->x[(size_t)(t0 + e) * n + j] : 0.0f;
        int i = r0;
        for (; i + 8 <= r1; i += 8)
            exact_8(base + (size_t)i * n, (size_t)n, xt, n, nt, out + t0, i);
        for (; i < r1; i++)
            exact_1(base + (size_t)i * n, (size_t)n, xt, n, nt, out + t0, i);
    }
}

/* --- AVX-512: two tokens per register ------------------------------------------------
 * A 512-bit register holds the 8 lanes of one dot product for token t (low half) and for
 * token t + 1 (high half), against the same weight row broadcast to both halves: the
 * same 8-lane order as the AVX2 and reference kernels, twice the work per instruction.
 * The activations of up to PACK_T tokens are first interleaved in pairs into the
 * thread's scratch (8 floats of t, 8 of t + 1, ...), for one row block at a time. Q8_0
 * uses VNNI (vpdpbusd: unsigned x signed bytes, 4 products summed per int32 lane, exact)
 * with the activation bytes offset to unsigned (x + 128) and the offset taken back by
 * starting the sum at -128 * (sum of the 4 weights): the lane sums are the same integers
 * as the reference's. */
#define TGT512                                                                                     \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))
#define TILE512 static inline __attribute__((always_inline)) TGT512
#define ROW_BLOCK512 64

/* Interleave tokens [0, nt) of x (stride n) into pairs: xp[(p * steps + s) * 16 + h * 8 + e]
 * = x[2p + h][8s + e] (a missing odd token repeats its partner; its result is dropped). */
TGT512 void kern_x86_pack_pairs_f32(const float *x, int n, int nt, float *xp)
{
    const int steps = n / 8;
    for (int p = 0; p < (nt + 1) / 2; p++) {
        const float *a = x + (size_t)(2 * p) * n;
        const float *b = 2 * p + 1 < nt ? a + n : a;
        float *o = xp + (size_t)p * steps * 16;
        for (int s = 0; s < steps; s++) {
            __m512 v = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a + 8 * s)),
                                          _mm256_loadu_ps(b + 8 * s), 1);
            _mm512_store_ps(o + 16 * s, v);
        }
    }
}

/* Q8 pairs: qp[(p * nb + b) * 64 + h * 32 + e] = xs[2p + h][32b + e] + 128 (unsigned);
 * dp[(p * nb + b) * 16 + h * 8 + e] = xd[2p + h][b]. */
TGT512 void kern_x86_pack_pairs_q8(const float *xd, const int8_t *xs, int n, int nt, uint8_t *qp,
                                   float *dp)
{
    const int nb = n / KERN_Q8_BLOCK;
    const __m256i off = _mm256_set1_epi8((char)0x80);
    for (int p = 0; p < (nt + 1) / 2; p++) {
        int t1 = 2 * p + 1 < nt ? 2 * p + 1 : 2 * p;
        const int8_t *a = xs + (size_t)(2 * p) * n, *b = xs + (size_t)t1 * n;
        const float *da = xd + (size_t)(2 * p) * nb, *db = xd + (size_t)t1 * nb;
        for (int k = 0; k < nb; k++) {
            uint8_t *o = qp + ((size_t)p * nb + k) * 64;
            _mm256_storeu_si256(
                (__m256i *)o,
                _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(a + 32 * k)), off));
            _mm256_storeu_si256(
                (__m256i *)(o + 32),
                _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 32 * k)), off));
            __m512 d = _mm512_insertf32x8(_mm512_set1_ps(da[k]), _mm256_set1_ps(db[k]), 1);
            _mm512_store_ps(dp + ((size_t)p * nb + k) * 16, d);
        }
    }
}

TILE512 __m512 load_w16(const uint8_t *row, int s, int f16)
{
    if (f16)
        return _mm512_cvtph_ps(
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(row + 16 * (size_t)s))));
    return _mm512_broadcast_f32x8(_mm256_loadu_ps((const float *)row + 8 * (size_t)s));
}

/* FAST order, R rows x NP token pairs (tokens [0, nt) of this tile). */
TILE512 void tile512_fast(const int R, const int NP, const int f16, const uint8_t *wrow, size_t ws,
                          const float *xp, const float *x, int n, int nt, float *const *out, int i)
{
    const int steps = n / 8, n8 = steps * 8;
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++)
            acc[r][p] = _mm512_setzero_ps();
    for (int s = 0; s < steps; s++) {
        __m512 xv[4];
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++)
            xv[p] = _mm512_load_ps(xp + ((size_t)p * steps + s) * 16);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m512 wv = load_w16(wrow + (size_t)r * ws, s, f16);
#pragma GCC unroll 4
            for (int p = 0; p < NP; p++)
                acc[r][p] = _mm512_fmadd_ps(wv, xv[p], acc[r][p]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++) {
            for (int h = 0; h < 2; h++) {
                int t = 2 * p + h;
                if (t >= nt)
                    break;
                __m256 half =
                    h ? _mm512_extractf32x8_ps(acc[r][p], 1) : _mm512_castps512_ps256(acc[r][p]);
                float sum = kern_x86_hsum8(half);
                const float *xt = x + (size_t)t * n;
                for (int j = n8; j < n; j++)
                    sum = fmaf(load_w1(wrow + (size_t)r * ws, j, f16), xt[j], sum);
                out[t][i + r] = sum;
            }
        }
    }
}

/* Q8_0, R rows x NP token pairs; row r's block b: quants at wq + r * qr + b * qb, f16 scale
 * at wd + r * dr + b * db (either layout). */
typedef struct {
    const uint8_t *wq, *wd;
    size_t qr, qb, dr, db;
} q8_addr;

TILE512 void tile512_q8(const int R, const int NP, const q8_addr *ad, const uint8_t *qp,
                        const float *dp, int n, int nt, float *const *out, int i)
{
    const int nb = n / KERN_Q8_BLOCK;
    const __m512i ones = _mm512_set1_epi8(1);
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++)
            acc[r][p] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i xv[4];
        __m512 dv[4];
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++) {
            xv[p] = _mm512_load_si512((const void *)(qp + ((size_t)p * nb + b) * 64));
            dv[p] = _mm512_load_ps(dp + ((size_t)p * nb + b) * 16);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            uint16_t h;
            memcpy(&h, ad->wd + (size_t)r * ad->dr + (size_t)b * ad->db, 2);
            __m512 dw = _mm512_set1_ps(_cvtsh_ss(h));
            __m512i wv = _mm512_broadcast_i32x8(_mm256_loadu_si256(
                (const __m256i *)(ad->wq + (size_t)r * ad->qr + (size_t)b * ad->qb)));
            __m512i wsum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, wv);
            __m512i base = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(wsum, 7));
#pragma GCC unroll 4
            for (int p = 0; p < NP; p++) {
                __m512 pf = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(base, xv[p], wv));
                acc[r][p] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dv[p]), pf, acc[r][p]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++)
            for (int h = 0; h < 2 && 2 * p + h < nt; h++)
                out[2 * p + h][i + r] = kern_x86_hsum8(h ? _mm512_extractf32x8_ps(acc[r][p], 1)
                                                     : _mm512_castps512_ps256(acc[r][p]));
}

#define DEF512(R, NP)                                                                              \
    static TGT512 __attribute__((noinline)) void f512_##R##_##NP(                                  \
        int f16, const uint8_t *w, size_t ws, const float *xp, const float *x, int n, int nt,      \
        float *const *out, int i)                                                                  \
    {                                                                                              \
        if (f16)                                                                                   \
            tile512_fast(R, NP, 1, w, ws, xp, x, n, nt, out, i);                                   \
        else                                                                                       \
            tile512_fast(R, NP, 0, w, ws, xp, x, n, nt, out, i);                                   \
    }                                                                                              \
    static TGT512 __attribute__((noinline)) void q512_##R##_##NP(                                  \
        const q8_addr *ad, const uint8_t *qp, const float *dp, int n, int nt, float *const *out,   \
        int i)                                                                                     \
    {                                                                                              \
        tile512_q8(R, NP, ad, qp, dp, n, nt, out, i);                                              \
    }
DEF512(4, 4)
DEF512(4, 3)
DEF512(4, 2)
DEF512(4, 1)
DEF512(1, 4)
DEF512(1, 3)
DEF512(1, 2)
DEF512(1, 1)

typedef void (*f512_fn)(int, const uint8_t *, size_t, const float *, const float *, int, int,
                        float *const *, int);
typedef void (*q512_fn)(const q8_addr *, const uint8_t *, const float *, int, int, float *const *,
                        int);
static const f512_fn f512_r4[5] = {NULL, f512_4_1, f512_4_2, f512_4_3, f512_4_4};
static const f512_fn f512_r1[5] = {NULL, f512_1_1, f512_1_2, f512_1_3, f512_1_4};
static const q512_fn q512_r4[5] = {NULL, q512_4_1, q512_4_2, q512_4_3, q512_4_4};
static const q512_fn q512_r1[5] = {NULL, q512_1_1, q512_1_2, q512_1_3, q512_1_4};

/* Addresses of row i's blocks (and the rows after it in the same tile). */
static q8_addr q8_rows(const kern_mat *w, int i)
{
    const int nb = w->cols / KERN_Q8_BLOCK;
    const uint8_t *base = w->data;
    if (w->layout == KERN_LAYOUT_Q8X8) {
        const uint8_t *g = base + (size_t)(i / 8) * kern_q8x8_gbytes(nb);
        return (q8_addr){g + kern_q8x8_sbytes(nb) + 32 * (size_t)(i % 8), g + 2 * (size_t)(i % 8),
                         32, 256, 2, 16};
    }
    const size_t ws = kern_row_bytes(w);
    const uint8_t *row = base + (size_t)i * ws;
    return (q8_addr){row + 2, row, ws, KERN_Q8_BLOCK_BYTES, ws, KERN_Q8_BLOCK_BYTES};
}

static void *align64(void *p)
{
    return (void *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
}

/* T >= 2: row blocks of ROW_BLOCK512 rows (in L2), token tiles of PACK_T, row tiles. The
 * pairs come from the activations packed by kern_pack_act when the caller did, else are
 * packed here per row block into the thread's scratch. (Splitting the columns too, to
 * keep the packed activations in L1, measured no faster: not done.) */
TGT512 void kern_x86_matmul_avx512(const kern_mat *w, const kern_act *a, int r0, int r1,
                                   float *const *out, float *scratch)
{
    const int n = a->n, T = a->T, nb = n / KERN_Q8_BLOCK, steps = n / 8;
    const int q8 = w->type == GGUF_TENSOR_Q8_0, f16 = w->type == GGUF_TENSOR_F16;
    const int packed = q8 ? a->qp != NULL : a->xp != NULL;
    const int x8 = w->layout == KERN_LAYOUT_Q8X8;
    const size_t ws = kern_row_bytes(w);
    const uint8_t *base = w->data;
    /* no pointer arithmetic on a NULL scratch (the caller packed the activations) */
    float *xp = scratch ? align64(scratch) : NULL;
    uint8_t *qp = (uint8_t *)xp;
    float *dp = qp ? (float *)(qp + (size_t)PACK_T / 2 * nb * 64) : NULL;
    for (int rb = r0; rb < r1; rb += ROW_BLOCK512) {
        int re = rb + ROW_BLOCK512 < r1 ? rb + ROW_BLOCK512 : r1;
        for (int t = 0; t < T; t += PACK_T) {
            int nt = T - t < PACK_T ? T - t : PACK_T;
            int np = (nt + 1) / 2;
            if (packed) {
                size_t p0 = (size_t)t / 2;
                if (q8) {
                    qp = (uint8_t *)a->qp + p0 * nb * 64;
                    dp = (float *)a->dp + p0 * nb * 16;
                } else {
                    xp = (float *)a->xp + p0 * steps * 16;
                }
            } else if (q8) {
                kern_x86_pack_pairs_q8(a->q_d + (size_t)t * nb, a->q_s + (size_t)t * n, n, nt, qp,
                                       dp);
            } else {
                kern_x86_pack_pairs_f32(a->x + (size_t)t * n, n, nt, xp);
            }
            const float *xt = a->x + (size_t)t * n;
            int i = rb;
            if (q8) {
                /* a 4-row tile stays within one Q8X8 group */
                for (; x8 && i < re && i % 4 != 0; i++) {
                    q8_addr ad = q8_rows(w, i);
                    q512_r1[np](&ad, qp, dp, n, nt, out + t, i);
                }
                for (; i + 4 <= re; i += 4) {
                    q8_addr ad = q8_rows(w, i);
                    q512_r4[np](&ad, qp, dp, n, nt, out + t, i);
                }
                for (; i < re; i++) {
                    q8_addr ad = q8_rows(w, i);
                    q512_r1[np](&ad, qp, dp, n, nt, out + t, i);
                }
                continue;
            }
            for (; i + 4 <= re; i += 4)
                f512_r4[np](f16, base + (size_t)i * ws, ws, xp, xt, n, nt, out + t, i);
            for (; i < re; i++)
                f512_r1[np](f16, base + (size_t)i * ws, ws, xp, xt, n, nt, out + t, i);
        }
    }
}

/* --- attention helpers ------------------------------------------------------------ */

/* FAST order, four rows at a time (independent chains). */
TGT void kern_x86_dot_rows_fast_avx2(const float *q, const float *k, size_t k_stride, int n_rows,
                                     int n, float *out)
{
    const int n8 = n & ~7;
    int r = 0;
    for (; r + 4 <= n_rows; r += 4) {
        const float *k0 = k + (size_t)r * k_stride, *k1 = k0 + k_stride, *k2 = k1 + k_stride,
                    *k3 = k2 + k_stride;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int j = 0; j < n8; j += 8) {
            __m256 qv = _mm256_loadu_ps(q + j);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + j), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + j), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + j), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + j), a3);
        }
        float s0 = kern_x86_hsum8(a0), s1 = kern_x86_hsum8(a1), s2 = kern_x86_hsum8(a2), s3 = kern_x86_hsum8(a3);
        for (int j = n8; j < n; j++) {
            s0 = fmaf(q[j], k0[j], s0);
            s1 = fmaf(q[j], k1[j], s1);
            s2 = fmaf(q[j], k2[j], s2);
            s3 = fmaf(q[j], k3[j], s3);
        }
        out[r] = s0;
        out[r + 1] = s1;
        out[r + 2] = s2;
        out[r + 3] = s3;
    }
    for (; r < n_rows; r++) {
        const float *kr = k + (size_t)r * k_stride;
        __m256 a0 = _mm256_setzero_ps();
        for (int j = 0; j < n8; j += 8)
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(kr + j), a0);
        float s0 = kern_x86_hsum8(a0);
        for (int j = n8; j < n; j++)
            s0 = fmaf(q[j], kr[j], s0);
        out[r] = s0;
    }
}

/* The 8 row sums of v[0..8), each in kern_x86_hsum8's order ((a0 + a4) + (a2 + a6)) + ((a1
 * + a5) + (a3 + a7)), as the 8 lanes of one register (lane k: v[k]'s): the halves of two
 * registers added in one instruction, then the pairs, then the last add, so 8 sums cost ~12
 * instructions instead of ~40. Addition commutes, so each lane's bits are hsum8's. */
static inline __attribute__((always_inline)) TGT __m256 hsum8x8(const __m256 v[8])
{
    __m256 t[4]; /* t[p] = [lo(v[2p]) + hi(v[2p]) | lo(v[2p+1]) + hi(v[2p+1])] */
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++)
        t[p] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x31));
    /* u = [x0 + x2, x1 + x3] of each 4-lane sum: [u0 u2 | u1 u3] (2 lanes each) */
    const __m256 u0 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x44),
                                    _mm256_shuffle_ps(t[0], t[1], 0xEE));
    const __m256 u1 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], 0x44),
                                    _mm256_shuffle_ps(t[2], t[3], 0xEE));
    /* [s0 s2 s4 s6 | s1 s3 s5 s7] */
    const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(u0, u1, 0x88), _mm256_shuffle_ps(u0, u1, 0xDD));
    return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Scores of nq query rows (q_stride apart) against n_rows K rows in the FAST order
 * (kern_dot_fast_f32 per score, bit for bit): tiles of 2 query rows x 4 K rows (8 chains;
 * per 8 columns 6 loads for 8 FMAs, where one query row x 4 K rows loads 5 for 4), their 8
 * sums reduced together (hsum8x8). n % 8 == 0. */
TGT void kern_x86_dot_heads_fast_avx2(const float *q, int nq, size_t q_stride, const float *k,
                                      size_t k_stride, int n_rows, int n, float *out,
                                      size_t out_stride)
{
    int h = 0;
    const int R4 = n_rows & ~3;
    for (; h + 2 <= nq; h += 2) {
        const float *q0 = q + (size_t)h * q_stride, *q1 = q0 + q_stride;
        float *o0 = out + (size_t)h * out_stride, *o1 = o0 + out_stride;
        for (int r = 0; r < R4; r += 4) {
            const float *k0 = k + (size_t)r * k_stride;
            __m256 acc[8];
#pragma GCC unroll 8
            for (int e = 0; e < 8; e++)
                acc[e] = _mm256_setzero_ps();
            for (int j = 0; j < n; j += 8) {
                const __m256 a = _mm256_loadu_ps(q0 + j), b = _mm256_loadu_ps(q1 + j);
#pragma GCC unroll 4
                for (int e = 0; e < 4; e++) {
                    const __m256 kv = _mm256_loadu_ps(k0 + (size_t)e * k_stride + j);
                    acc[e] = _mm256_fmadd_ps(a, kv, acc[e]);
                    acc[4 + e] = _mm256_fmadd_ps(b, kv, acc[4 + e]);
                }
            }
            const __m256 sums = hsum8x8(acc);
            _mm_storeu_ps(o0 + r, _mm256_castps256_ps128(sums));
            _mm_storeu_ps(o1 + r, _mm256_extractf128_ps(sums, 1));
        }
        if (R4 < n_rows) {
            kern_x86_dot_rows_fast_avx2(q0, k + (size_t)R4 * k_stride, k_stride, n_rows - R4, n,
                                        o0 + R4);
            kern_x86_dot_rows_fast_avx2(q1, k + (size_t)R4 * k_stride, k_stride, n_rows - R4, n,
                                        o1 + R4);
        }
    }
    if (h < nq)
        kern_x86_dot_rows_fast_avx2(q + (size_t)h * q_stride, k, k_stride, n_rows, n,
                                    out + (size_t)h * out_stride);
}

/* NH heads x 32 columns from i0 of kern_x86_axpy_heads_avx2: 4 * NH sums in registers, each
 * V load shared by the NH heads. */
static inline __attribute__((always_inline)) TGT void
axpy_heads_tile(const int NH, float *y, size_t y_stride, const float *a, size_t a_stride,
                const float *x, size_t x_stride, int n_rows, int i0)
{
    __m256 acc[3][4];
#pragma GCC unroll 3
    for (int h = 0; h < NH; h++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++)
            acc[h][c] = _mm256_loadu_ps(y + (size_t)h * y_stride + i0 + 8 * c);
    for (int r = 0; r < n_rows; r++) {
        const float *xr = x + (size_t)r * x_stride + i0;
        __m256 v[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++)
            v[c] = _mm256_loadu_ps(xr + 8 * c);
#pragma GCC unroll 3
        for (int h = 0; h < NH; h++) {
            const __m256 ar = _mm256_broadcast_ss(a + (size_t)h * a_stride + r);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++)
                acc[h][c] = _mm256_add_ps(acc[h][c], _mm256_mul_ps(ar, v[c]));
        }
    }
#pragma GCC unroll 3
    for (int h = 0; h < NH; h++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++)
            _mm256_storeu_ps(y + (size_t)h * y_stride + i0 + 8 * c, acc[h][c]);
}

/* kern_x86_axpy_rows_avx2 for nq heads at once (head h: y + h * y_stride, weights a + h *
 * a_stride, the same rows x): 3 heads x 32 columns per pass over the rows (12 sums; per row
 * 4 loads and 3 broadcasts for 24 operations, where one head loads 8 for 16). n % 32 == 0.
 * Per element the same operations in the same order. */
TGT void kern_x86_axpy_heads_avx2(float *y, int nq, size_t y_stride, const float *a,
                                  size_t a_stride, const float *x, size_t x_stride, int n_rows,
                                  int n)
{
    for (int i0 = 0; i0 < n; i0 += 32) {
        int h = 0;
        for (; h + 3 <= nq; h += 3)
            axpy_heads_tile(3, y + (size_t)h * y_stride, y_stride, a + (size_t)h * a_stride,
                            a_stride, x, x_stride, n_rows, i0);
        if (nq - h == 2)
            axpy_heads_tile(2, y + (size_t)h * y_stride, y_stride, a + (size_t)h * a_stride,
                            a_stride, x, x_stride, n_rows, i0);
        else if (nq - h == 1)
            axpy_heads_tile(1, y + (size_t)h * y_stride, y_stride, a + (size_t)h * a_stride,
                            a_stride, x, x_stride, n_rows, i0);
    }
}

/* y stays in registers for 64 elements at a time while the rows stream by. */
TGT void kern_x86_axpy_rows_avx2(float *y, const float *a, const float *x, size_t x_stride,
                                 int n_rows, int n)
{
    const int n8 = n & ~7;
    for (int i0 = 0; i0 < n8; i0 += 64) {
        int m = (n8 - i0) / 8 < 8 ? (n8 - i0) / 8 : 8;
        __m256 acc[8];
        for (int v = 0; v < 8; v++)
            acc[v] = v < m ? _mm256_loadu_ps(y + i0 + 8 * v) : _mm256_setzero_ps();
        for (int r = 0; r < n_rows; r++) {
            const float *xr = x + (size_t)r * x_stride + i0;
            __m256 ar = _mm256_set1_ps(a[r]);
            if (m == 8) {
#pragma GCC unroll 8
                for (int v = 0; v < 8; v++)
                    acc[v] = _mm256_add_ps(acc[v], _mm256_mul_ps(ar, _mm256_loadu_ps(xr + 8 * v)));
            } else {
                for (int v = 0; v < m; v++)
                    acc[v] = _mm256_add_ps(acc[v], _mm256_mul_ps(ar, _mm256_loadu_ps(xr + 8 * v)));
            }
        }
        for (int v = 0; v < m; v++)
            _mm256_storeu_ps(y + i0 + 8 * v, acc[v]);
    }
    if (n8 < n)
        for (int r = 0; r < n_rows; r++) {
            const float *xr = x + (size_t)r * x_stride;
            for (int i = n8; i < n; i++)
                y[i] += a[r] * xr[i];
        }
}

#endif /* KERN_HAVE_X86 */
