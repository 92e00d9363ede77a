/*
 * matvec_internal: what matvec.c and matvec_x86_512.c (its AVX-512 kernel) share. Not part
 * of the engine's interface.
 */
#ifndef TP_MATVEC_INTERNAL_H
#define TP_MATVEC_INTERNAL_H

#include "kernels_internal.h"
#include "matvec.h"

#ifdef KERN_HAVE_X86
/* matvec_exact_f32's products with AVX-512 (r0 % MATVEC_GROUP == 0): rows [r0, r1) of the
 * packed wp (n columns) x T tokens of x (T, n) into out[t][i], bit for bit matvec_ref's. */
void matvec_x86_exact_avx512(const float *wp, int n, const float *x, int T, int r0, int r1,
                             float *const *out);
#endif

#endif
