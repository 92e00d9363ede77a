/*
 * matvec: F32 matrix products in run.c's EXACT order vectorised across output rows
 * instead of across tokens, the EXACT-order attention helpers (scores, softmax,
 * weighted sums of values) vectorised across positions or heads, one decode token's
 * whole attention in one pass over its K and V rows, and expf bit for bit the
 * C library's, vectorised (the softmax and SwiGLU's exponentials: ~15% of a stories260K
 * step as libm calls).
 *
 * kern_matmul's EXACT kernel puts 8 tokens in the SIMD lanes: at batch 1 (a decode step)
 * 7 of its 8 lanes are idle, and on a small model (stories260K) the matrix products are
 * most of the step. Here the lanes are 8 output rows: the matrix is packed once (at
 * context creation) so that for each group of 8 rows the 8 elements of column j sit side
 * by side, and each lane runs run.c's serial chain s = s + w[j] * x[j] (j ascending, the
 * product and the sum each rounded: no FMA) for its own row. The result is bit-identical
 * to kern_dot_exact_f32 per output element (multiplication is commutative in IEEE 754,
 * and the chain is the same), so it changes no logits; the tests compare it with the
 * reference bit for bit. Up to three tokens share each pass over the packed rows; with
 * the transpose of kern_matmul's token tile saved too, on (rows, n) = (64, 64) .. (512, 64)
 * matrices it takes 0.1-0.2x the time of the token-lane kernel at T = 1 and 0.5-0.85x at
 * T = 16 .. 256 (AVX2, one thread). Without FMA (run.c rounds the product) the adds and
 * multiplies are the bound: a 3-token product costs ~2.1x a 1-token one (stories260K's
 * shapes), which no tiling can bring below ~2x.
 */
#ifndef TP_MATVEC_H
#define TP_MATVEC_H

#include <stddef.h>

#include "kernels.h"

/* Rows per group of the packed layout (the lanes of one AVX2 register). */
#define MATVEC_GROUP 8

/* Floats of the packed form of a (rows, n) matrix: ceil(rows / 8) * 8 * n. */
size_t matvec_packed_floats(int rows, int n);

/* Pack the row-major F32 matrix w (rows, n) into dst (matvec_packed_floats(rows, n)
 * floats, 32-byte aligned, caller-owned): group g, column j holds w[8g + e][j] at
 * dst[(g * n + j) * 8 + e], e in [0, 8), zero for rows >= rows. */
void matvec_pack_f32(const float *w, int rows, int n, float *dst);

/* out[t][i] = dot(W[i], x[t]) in the EXACT order (kern_dot_exact_f32, bit for bit) for
 * rows i in [r0, r1) and tokens t in [0, T), from the packed form wp of W (rows, n)
 * (matvec_pack_f32); x is (T, n), out holds T row pointers, each written at [r0, r1)
 * only. isa >= KERN_ISA_AVX2 uses the AVX2 kernel when r0 is a multiple of MATVEC_GROUP
 * (AVX-512 from T = 2: 16 rows per register, matvec_x86_512.c), otherwise the portable
 * reference (the same arithmetic). Thread-safe for
 * disjoint row ranges. */
void matvec_exact_f32(kern_isa isa, const float *wp, int rows, int n, const float *x, int T,
                      int r0, int r1, float *const *out);

/* Attention scores in the EXACT order for n_q query heads that share one K head:
 * out[h * out_stride + r] = dot(q + h * n, k + r * k_stride) (kern_dot_exact_f32, bit for
 * bit) for h in [0, n_q), r in [0, n_rows); n elements per row. With AVX2 and n % 8 == 0
 * the lanes are 8 positions (8 K rows transposed in registers, read once for all n_q
 * heads); otherwise, and for the last n_rows % 8 rows, the portable chain. */
void matvec_scores_exact(kern_isa isa, const float *q, int n_q, const float *k, size_t k_stride,
                         int n_rows, int n, float *out, size_t out_stride);

/* Attention's weighted sum of values for n_q query heads that share one V head, run.c's
 * order: for r ascending, y[h * n + i] = y[h * n + i] + a[h * a_stride + r] * x_r[i] with
 * x_r = x + r * x_stride, the product and the sum each rounded (kern_axpy_rows, bit for
 * bit), h in [0, n_q), i in [0, n), r in [0, n_rows). With AVX2, n % 8 == 0 and
 * n_q * n <= 64, the n_q heads' sums stay in registers and advance together (n_q * n / 8
 * independent chains instead of n / 8); otherwise kern_axpy_rows per head. */
void matvec_values(kern_isa isa, float *y, int n_q, const float *a, size_t a_stride,
                   const float *x, size_t x_stride, int n_rows, int n);

/* run.c's scaled softmax of one head's n >= 1 attention scores in place: x[i] = x[i] /
 * scale, then softmax with max subtraction (max_val = x[0]; x[i] > max_val replaces it),
 * x[i] = expf(x[i] - max_val) summed in order, then x[i] = x[i] / sum. The divisions and
 * the max run 8 lanes wide with AVX2 (each element's operation is the same; the max is the
 * same value: a lane keeps x > m ? x : m, as run.c's loop), the exponentials are
 * matvec_expf's (libm's expf, bit for bit) and their sum stays scalar and in order, so the
 * result is bit-identical to the scalar loop. */
void matvec_softmax(kern_isa isa, float *x, int n, float scale);

/* matvec_softmax of nr rows, row h (x + h * stride) of n0 + h / per >= 1 elements (the
 * query rows of a run of tokens: per = the query heads of a token), bit for bit: with AVX2
 * the rows' serial sums run 8 side by side (independent chains, each in position order)
 * instead of one after another. */
void matvec_softmax_rows(kern_isa isa, float *x, size_t stride, int nr, int n0, int per,
                         float scale);

/* One token's attention over n >= 1 positions of its sequence's paged K/V, every head,
 * run.c's order bit for bit: for head h (KV head h / kv_mul), the scores of
 * matvec_scores_exact over positions [0, n), matvec_softmax with scale, and y[h * hs + i]
 * the sum of a[r] * v_r[i] in position order from 0 (matvec_values). q is (n_head, hs); y
 * (n_head, hs) is written. Position r's K row (kv_dim floats, KV head g at g * hs) is at
 * pool + blocks[r / bs] * block_floats + (r % bs) * kv_dim and its V row bs * kv_dim floats
 * after it (kvcache.h's layout). att: scratch of n_head * ((n + 7) & ~7) floats, left
 * holding the probabilities (head h's row at h * ((n + 7) & ~7) with AVX2, h * n
 * otherwise). When matvec_attend_vector says so, each K and V row is read once for every
 * head (AVX2); otherwise the portable helpers head by head. Thread-safe. */
void matvec_attend_exact(kern_isa isa, const float *q, int n_head, int kv_mul, int hs,
                         const float *pool, const int *blocks, size_t block_floats, int bs,
                         size_t kv_dim, int n, float scale, float *att, float *y);

/* 1 if matvec_attend_exact takes its vector path for these shapes: isa >= AVX2, hs == 8,
 * n_head <= 8 a multiple of kv_mul, bs a multiple of 8. */
int matvec_attend_vector(kern_isa isa, int n_head, int kv_mul, int hs, int bs);

/* The attention of nq query rows that share one KV head, run.c's order bit for bit: row h
 * (query head h % kv_mul of token h / kv_mul of a run of consecutive tokens) attends to
 * positions [0, n_lo + h / kv_mul), n_lo >= 1 (a run of prefill or MTP-verify tokens, the
 * first at position n_lo - 1). For each row: scores q_h . k_r in the EXACT order, divided
 * by scale, run.c's softmax (max, expf(s - max) summed in position order, / sum), then
 * y[h * hs + i] = the sum of a[r] * v_r[i] in position order from 0. q is (nq, hs); y
 * (nq, hs) is written. K row r (hs floats) at pool + blocks[r / bs] * block_floats +
 * (r % bs) * kv_dim + koff, its V row bs * kv_dim floats after it (kvcache.h's layout).
 * att: scratch of 8 * (n_lo + (nq - 1) / kv_mul) floats. When matvec_attend_rows_vector
 * says so, the rows run in the 8 lanes (no transposes of K, every chain of the softmax
 * and values advancing 8 rows at a time); otherwise the portable helpers row by row.
 * Thread-safe. */
void matvec_attend_rows_exact(kern_isa isa, const float *q, int nq, int kv_mul, int hs,
                              const float *pool, const int *blocks, size_t block_floats, int bs,
                              size_t kv_dim, size_t koff, int n_lo, float scale, float *att,
                              float *y);

/* 1 if matvec_attend_rows_exact takes its vector path: isa >= AVX2, hs == 8, 1 <= nq <= 8,
 * and matvec_expf's vector path is in use (the C library's expf, matched). */
int matvec_attend_rows_vector(kern_isa isa, int nq, int hs);

/* y[i] = expf(x[i]) for i in [0, n), bit for bit the C library's expf (x and y may be the
 * same array). With AVX2 (and FMA) the lanes run glibc's expf algorithm (2.28 and later,
 * as its FMA build: the ARM optimized-routines method, k = round(x * 32 / ln 2), a 32-entry
 * table of 2^(i/32) and a degree-3 polynomial in double precision, the same operations
 * and fused multiply-adds) 4 wide; inputs with |x| >= 88 or not finite take libm's expf.
 * At first use the vector path is checked against libm's expf on a fixed sample of
 * inputs; if any differs (another C library), every call takes libm's expf. Thread-safe. */
void matvec_expf(kern_isa isa, const float *x, float *y, int n);

/* run.c's rmsnorm of T rows: for each t, with x_t = x + t * n and o_t = o + t * n, ss = the
 * serial sum of x_t[j] * x_t[j] (j ascending, product and sum each rounded), ss = ss / n,
 * ss = ss + eps, ss = 1.0f / sqrtf(ss), then o_t[j] = weight[j] * (ss * x_t[j]). With AVX2
 * and n % 8 == 0, 8 rows' chains run as the lanes of one register (8 columns transposed at
 * a time) and the last loop 8 columns wide: the same operations per element (IEEE
 * division and square root are correctly rounded in either form), so the same bits as the
 * scalar loop, which stays as the reference; its one chain of n dependent adds per row was
 * a twentieth of a 75-token stories260K prefill. o and x do not overlap. Thread-safe. */
void matvec_rmsnorm(kern_isa isa, float *o, const float *x, int T, int n, const float *weight,
                    float eps);

/* run.c's SwiGLU in place: h[i] = h[i] * (1 / (1 + expf(-h[i]))), then * h2[i], each
 * operation rounded in that order, i in [0, n); bit for bit the scalar loop with libm's
 * expf (AVX2: 8 lanes, matvec_expf's exponential). */
void matvec_swiglu(kern_isa isa, float *h, const float *h2, int n);

/* 1 if matvec_expf(isa, ...) takes the vector path (isa >= AVX2 on x86 and the first-use
 * check passed), 0 if it calls libm's expf. */
int matvec_expf_vector(kern_isa isa);

#endif
