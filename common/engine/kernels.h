/*
 * kernels: the matrix kernels of the forward pass, W (rows, n) applied to T activation
 * rows x (T, n), for F32, F16 and Q8_0 weights, and the dot products and weighted sums of
 * attention; each as a plain reference kernel (portable C) and AVX2 (+FMA, F16C) and
 * AVX-512 (+VNNI) ones chosen at run time (kern_isa_detect).
 *
 * Every output element out[t][i] = dot(W[i], x[t]) is computed by one thread, in one
 * fixed order of operations that depends only on (W row, x row, n): not on T, on the
 * tile a kernel happens to process it in, on the thread, or on the instruction set. The
 * SIMD kernels are bit-identical to the reference kernels (the tests check it), so a
 * prefill worker with AVX-512 and a decode worker with AVX2 or none still agree bit for
 * bit. Two orders are defined:
 *
 *  - KERN_ORDER_EXACT (F32, F16 weights): llama2.c run.c's order, s = 0; for j
 *    ascending: s = s + w[j] * x[j], the product and the sum each rounded to float (no
 *    FMA). Greedy output matches run.c exactly. F16 weights are widened to float first
 *    (exact). The AVX2 kernel (F32) puts 8 tokens, not 8 terms, in the lanes.
 *  - KERN_ORDER_FAST (F32, F16 weights): 8 partial sums, lane k = j mod 8 accumulating
 *    fma(w[j], x[j], acc[k]) for j < n8 = n - n mod 8; then
 *    s = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)); then s = fma(w[j], x[j], s)
 *    for the n mod 8 tail elements. AVX-512 holds two tokens' 8 lanes in one register.
 *
 * Q8_0 weights (GGUF blocks of 32: f16 scale d then 32 int8, 34 bytes; value = d * q)
 * always use the llama.cpp scheme: the activation row is quantized to int8 per block of
 * 32 with a float scale (kern_quantize_act: dx = amax / 127, q = nearbyint(x / dx)), the
 * block products are exact integer dot products, and 8 lanes accumulate
 * acc[k] = fma(d_w * d_x, (float)p[k], acc[k]) where p[k] is the integer sum of the
 * products of elements 4k .. 4k + 3 of the block; then the same 8-lane reduction. This
 * reads 1.06 bytes per weight instead of 2 or 4, and does 4x less float work.
 */
#ifndef TP_KERNELS_H
#define TP_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

#define KERN_Q8_BLOCK 32       /* elements per Q8_0 block */
#define KERN_Q8_BLOCK_BYTES 34 /* f16 scale + 32 int8 */

typedef enum {
    KERN_ORDER_EXACT = 0, /* run.c order (F32/F16 weights) */
    KERN_ORDER_FAST,      /* 8-lane FMA order (F32/F16 weights) */
} kern_order;

/* Instruction sets, in increasing order: a CPU that has one has those before it. */
typedef enum {
    KERN_ISA_SCALAR = 0, /* portable C reference kernels */
    KERN_ISA_AVX2,       /* AVX2 + FMA + F16C */
    KERN_ISA_AVX512,     /* + AVX-512 F/BW/DQ/VL/VNNI: two tokens per 512-bit register */
} kern_isa;

/* Where a matrix's bytes are. KERN_LAYOUT_GGUF: the file's, row-major (rows, cols), each
 * Q8_0 row its cols / 32 blocks of 34 bytes. KERN_LAYOUT_Q8X8 (Q8_0 only, rows % 8 == 0,
 * made at load by kern_q8x8_pack): rows in groups of 8, group g at data + g * gs,
 * gs = kern_q8x8_group_bytes(cols); in a group, the nb = cols / 32 block steps' scales
 * first, block b's 8 f16 scales (row 0 .. 7) at 16 * b, then, from S = that section
 * rounded up to 64 bytes, block b's 8 x 32 quants (row-major) at S + 256 * b. One linear
 * stream per group, 32-byte quant loads, 8 scales in one load (in the spirit of
 * llama.cpp's repacked Q8_0 x4/x8 layouts). The same numbers, so the same results. Its
 * quants are in [-127, 127] (kern_q8x8_pack refuses -128), which lets the batch-1 tile
 * sign the weights by the activations. */
typedef enum {
    KERN_LAYOUT_GGUF = 0,
    KERN_LAYOUT_Q8X8,
} kern_layout;

/* A weight matrix W (rows, cols): the product is W x. */
typedef struct {
    const void *data;
    gguf_tensor_type type; /* F32, F16 or Q8_0 (then cols % 32 == 0) */
    int rows, cols;
    kern_layout layout; /* GGUF (0) unless packed */
} kern_mat;

/* Activations for one matmul: T rows of n floats, and their Q8 form when the weights
 * are Q8_0 (filled by kern_quantize_act). Borrowed pointers, read-only to the kernels. */
typedef struct {
    const float *x;    /* (T, n) */
    const float *q_d;  /* (T, n / 32) block scales, or NULL */
    const int8_t *q_s; /* (T, n) quantized values, or NULL */
    int T, n;
    /* AVX-512 only, optional (set by kern_pack_bind, NULL otherwise): x and its Q8 form
     * interleaved in token pairs, packed once for all threads by kern_pack_act. */
    const float *xp;
    const uint8_t *qp;
    const float *dp;
} kern_act;

/* Best instruction set of this CPU (cpuid and OS support). Thread-safe. */
kern_isa kern_isa_detect(void);
/* "scalar", "avx2", "avx512" / "exact", "fast" (static strings). */
const char *kern_isa_name(kern_isa isa);
const char *kern_order_name(kern_order order);

/* Floats of per-thread scratch kern_matmul needs for rows of n elements. */
size_t kern_scratch_floats(int n);

/* out[t][i] = dot(W[i], a->x[t]) for rows i in [r0, r1) and t in [0, a->T), in the
 * order defined above (order is ignored for Q8_0, which needs a->q_d/q_s). out holds T
 * row pointers (each row is written at [r0, r1) only). scratch: kern_scratch_floats(n)
 * floats private to the calling thread (NULL is allowed in FAST order and for Q8_0, at a
 * cost: on AVX-512 without packed activations the AVX2 kernels run). Weight rows are read once per call: all T
 * tokens are applied to a block of rows while it is in cache. Thread-safe for disjoint
 * row ranges. */
void kern_matmul(kern_isa isa, kern_order order, const kern_mat *w, const kern_act *a, int r0,
                 int r1, float *const *out, float *scratch);

/* The AVX-512 kernels read activations interleaved in token pairs; without a packed
 * copy they pack per call and row block. For big T, pack once: kern_pack_bind points
 * a->xp (f32: for F32/F16 weights) and a->qp/dp (q8: for Q8_0 weights, a->q_s must be
 * set) into buf (kern_pack_bytes(a->T, a->n) bytes) or leaves them NULL when the isa
 * does not pack or T < 2; then kern_pack_act packs tokens [t0, t1) (t0 even; the Q8 form
 * must be ready for them), thread-safe for disjoint ranges. The packed form changes no
 * result. */
size_t kern_pack_bytes(int T, int n);
void kern_pack_bind(kern_isa isa, kern_act *a, int f32, int q8, void *buf);
void kern_pack_act(kern_isa isa, const kern_act *a, int t0, int t1);

/* Quantize T activation rows x (T, n), n % 32 == 0, to int8 blocks: q_d (T, n / 32),
 * q_s (T, n). Bit-identical for every isa. */
void kern_quantize_act(kern_isa isa, const float *x, int T, int n, float *q_d, int8_t *q_s);

/* Bytes of the KERN_LAYOUT_Q8X8 form of a Q8_0 matrix of rows x cols (a multiple of 64),
 * or 0 when it has none (rows % 8 or cols % 32 not 0). kern_q8x8_group_bytes: one group of
 * 8 rows. */
size_t kern_q8x8_bytes(int rows, int cols);
size_t kern_q8x8_group_bytes(int cols);

/* Repack rows [g0 * 8, g1 * 8) of src (Q8_0, GGUF layout) into dst (kern_q8x8_bytes of
 * the whole matrix, 64-byte aligned for aligned loads, the caller's), and describe the
 * result in *out (data = dst, layout Q8X8). Thread-safe for disjoint group ranges.
 * Returns 0, -1 when src has no Q8X8 form (*out untouched, dst's bytes undefined): the
 * wrong type or shape, or a quant of -128 in those rows (llama.cpp's and
 * kern_quantize_q8_0's quants are in [-127, 127]; the Q8X8 kernels multiply each weight
 * by the activation's sign, which -128 would overflow, so such a matrix keeps the GGUF
 * layout). */
int kern_q8x8_pack(const kern_mat *src, void *dst, int g0, int g1, kern_mat *out);

/* Row i of w in the file (GGUF) layout, from either layout, into dst (the caller's:
 * kern_row_bytes-sized, i.e. cols * 4 for F32, cols * 2 for F16, cols / 32 * 34 for Q8_0). */
void kern_row_gguf(const kern_mat *w, int i, void *dst);

/* Row i of w as n = w->cols floats into out (F32 copied, F16 widened, Q8_0 d * q; any
 * layout). */
void kern_dequant_row(const kern_mat *w, int i, float *out);

/* Quantize n floats (n % 32 == 0) to n / 32 GGUF Q8_0 blocks at dst (n / 32 * 34
 * bytes), as llama.cpp's quantize_row_q8_0_ref: d = amax / 127 stored as f16,
 * q = roundf(x / d). */
void kern_quantize_q8_0(const float *x, int n, void *dst);

/* Attention helpers over rows of a KV block. kern_dot_rows: out[r] = dot(q, k_r), k_r = k
 * + r * k_stride, r in [0, n_rows), n elements, in `order` (exactly kern_dot_exact_f32 or
 * kern_dot_fast_f32). kern_axpy_rows: for r ascending, y[i] = y[i] + a[r] * x_r[i] with
 * the product and the sum each rounded (no FMA): run.c's weighted sum of values, exact in
 * every isa. */
void kern_dot_rows(kern_isa isa, kern_order order, const float *q, const float *k, size_t k_stride,
                   int n_rows, int n, float *out);
void kern_axpy_rows(kern_isa isa, float *y, const float *a, const float *x, size_t x_stride,
                    int n_rows, int n);
/* The same for nq query heads that share the K/V rows (a KV head's query heads, the tokens
 * of a prefill run): kern_dot_heads: out[h * out_stride + r] = dot(q + h * q_stride, k_r),
 * bit for bit kern_dot_rows per head; kern_axpy_heads: kern_axpy_rows per head h on y + h *
 * y_stride with weights a + h * a_stride, bit for bit. With AVX2 (FAST order, n % 8 == 0;
 * axpy: n % 32 == 0) tiles of several heads share each K/V load; otherwise head by head. */
void kern_dot_heads(kern_isa isa, kern_order order, const float *q, int nq, size_t q_stride,
                    const float *k, size_t k_stride, int n_rows, int n, float *out,
                    size_t out_stride);
void kern_axpy_heads(kern_isa isa, float *y, int nq, size_t y_stride, const float *a,
                     size_t a_stride, const float *x, size_t x_stride, int n_rows, int n);

/* The single dot products of the reference kernels (n elements, orders above); exposed
 * for tests. q8: w_blocks are GGUF Q8_0 blocks, x_d/x_s an activation row quantized by
 * kern_quantize_act. */
float kern_dot_exact_f32(const float *w, const float *x, int n);
float kern_dot_fast_f32(const float *w, const float *x, int n);
float kern_dot_q8_0(const void *w_blocks, const float *x_d, const int8_t *x_s, int n);

#endif
