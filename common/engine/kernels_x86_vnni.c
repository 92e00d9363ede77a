/*
 * kernels_x86_vnni: the Q8_0 kernels of AVX-512 machines (kern_matmul's Q8_0 products at
 * KERN_ISA_AVX512), bit-identical to kern_dot_q8_0 as every kernel is (kernels.h).
 *
 * Routing, measured on a 2-core AMD EPYC (Zen 4) with `bench_engine --kern` (avx2 and
 * avx512 side by side, alternating, medians): the pair-interleaved AVX-512 path
 * (kern_x86_matmul_avx512, kernels_x86.c) lost to the AVX2 Q8X8 token-by-token groups at
 * T = 2, 3 (time over T = 1: 1.82 / 2.41 against 1.14 / 1.52 on 2048-wide rows), and won
 * from T = 8 (1.8-4.4x); so Q8X8 matrices at T <= 3 take the AVX2 Q8X8 kernels.
 */
#include "kernels_internal.h"

#ifdef KERN_HAVE_X86

void kern_x86_matmul_q8_avx512(const kern_mat *w, const kern_act *a, int r0, int r1,
                               float *const *out, float *scratch)
{
    if (w->layout == KERN_LAYOUT_Q8X8 && a->T <= 3) {
        kern_x86_matmul_q8x8_avx2(w, a, r0, r1, out);
        return;
    }
    if (a->T == 1) {
        kern_x86_matmul_q8_avx2(w, a, r0, r1, out);
        return;
    }
    kern_x86_matmul_avx512(w, a, r0, r1, out, scratch);
}

#endif /* KERN_HAVE_X86 */
