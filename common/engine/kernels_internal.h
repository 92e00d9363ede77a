/*
 * kernels_internal: what kernels.c (reference kernels, dispatch) and kernels_x86.c (the
 * AVX2 and AVX-512 kernels) share. Not part of the engine's interface.
 */
#ifndef TP_KERNELS_INTERNAL_H
#define TP_KERNELS_INTERNAL_H

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#define KERN_HAVE_X86 1
#endif

/* Tokens the AVX-512 kernels take at once (4 pairs); sizes the per-thread scratch. */
#define PACK_T 8

/* The FAST-order F32/F16 prefill kernel (kernels_x86.c, "FAST order prefill"): from
 * GB_MIN_T tokens, row superblocks of GB_MR rows x token blocks of GB_TB tokens. */
#ifndef GB_MIN_T
#define GB_MIN_T 8
#endif
#ifndef GB_MR
#define GB_MR 128
#endif
#ifndef GB_TB
#define GB_TB 12
#endif

/* Bytes of one weight row. */
static inline size_t kern_row_bytes(const kern_mat *w)
{
    return (size_t)gguf_tensor_nbytes(w->type, (uint64_t)w->cols);
}

/* KERN_LAYOUT_Q8X8 (kernels.h): bytes of a group's scale section, then of the group. */
static inline size_t kern_q8x8_sbytes(int nb)
{
    return ((size_t)nb * 16 + 63) & ~(size_t)63;
}
static inline size_t kern_q8x8_gbytes(int nb)
{
    return kern_q8x8_sbytes(nb) + (size_t)nb * 256;
}

#ifdef KERN_HAVE_X86
#include <immintrin.h>

/* The sum of a register's 8 floats in hsum8_ref's order (kernels.c):
 * ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)); every x86 kernel's row reduction. */
static inline __attribute__((always_inline, target("avx"))) float kern_x86_hsum8(__m256 v)
{
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
    return _mm_cvtss_f32(s1);
}

/* AVX2: EXACT-order F32 (scratch: kern_scratch_floats(n) floats), FAST-order F32/F16
 * (scratch: unused) and Q8_0
 * products of rows [r0, r1), all T tokens. */
void kern_x86_matmul_exact_avx2(const kern_mat *w, const kern_act *a, int r0, int r1,
                                float *const *out, float *scratch);
void kern_x86_matmul_fast_avx2(const kern_mat *w, const kern_act *a, int r0, int r1,
                               float *const *out, float *scratch);
void kern_x86_matmul_q8_avx2(const kern_mat *w, const kern_act *a, int r0, int r1,
                             float *const *out);
/* The same products for a KERN_LAYOUT_Q8X8 matrix. */
void kern_x86_matmul_q8x8_avx2(const kern_mat *w, const kern_act *a, int r0, int r1,
                               float *const *out);
/* AVX-512, T >= 2: F32/F16 (FAST) and Q8_0 (either layout); scratch: kern_scratch_floats(n) floats. */
void kern_x86_matmul_avx512(const kern_mat *w, const kern_act *a, int r0, int r1, float *const *out,
                            float *scratch);
/* AVX-512 (kernels_x86_vnni.c): Q8_0 products of rows [r0, r1), any T >= 1, either
 * layout; scratch: kern_scratch_floats(n) floats. */
void kern_x86_matmul_q8_avx512(const kern_mat *w, const kern_act *a, int r0, int r1,
                               float *const *out, float *scratch);
/* AVX-512, T >= 2, F32/F16 in the FAST order (kernels_x86_512f.c); needs a->xp (kern_pack_act's
 * token pairs for all T tokens). kern_matmul uses it from F512_MIN_T tokens (prefill), and
 * kern_x86_matmul_avx512 below that (batch decode), where they measured alike. */
#ifndef F512_MIN_T
#define F512_MIN_T 128
#endif
void kern_x86_matmul_fast_avx512(const kern_mat *w, const kern_act *a, int r0, int r1,
                                 float *const *out);
void kern_x86_quantize_act_avx2(const float *x, int T, int n, float *q_d, int8_t *q_s);
/* Interleave nt <= PACK_T tokens in pairs (layouts in kernels_x86.c). */
void kern_x86_pack_pairs_f32(const float *x, int n, int nt, float *xp);
void kern_x86_pack_pairs_q8(const float *xd, const int8_t *xs, int n, int nt, uint8_t *qp,
                            float *dp);
void kern_x86_dot_rows_fast_avx2(const float *q, const float *k, size_t k_stride, int n_rows, int n,
                                 float *out);
void kern_x86_axpy_rows_avx2(float *y, const float *a, const float *x, size_t x_stride, int n_rows,
                             int n);
/* kern_dot_heads (FAST order, n % 8 == 0) and kern_axpy_heads (n % 32 == 0). */
void kern_x86_dot_heads_fast_avx2(const float *q, int nq, size_t q_stride, const float *k,
                                  size_t k_stride, int n_rows, int n, float *out,
                                  size_t out_stride);
void kern_x86_axpy_heads_avx2(float *y, int nq, size_t y_stride, const float *a, size_t a_stride,
                              const float *x, size_t x_stride, int n_rows, int n);
#endif

#endif
