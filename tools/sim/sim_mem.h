/*
 * sim_mem: allocation for tidepool-sim. The simulator is a tool, not a server: running out
 * of memory ends it with a message rather than threading an error through every push.
 */
#ifndef TP_SIM_MEM_H
#define TP_SIM_MEM_H

#include <stddef.h>

/* realloc(p, n) (n = 0 is treated as 1, so the result is never NULL). On failure prints
 * "tidepool-sim: out of memory (N bytes)" on stderr and exits with status 1. The result
 * is the caller's (free()). */
void *sim_mem_realloc(void *p, size_t n);

/* Like sim_mem_realloc, the result aligned to align bytes (a power of two, a multiple of
 * sizeof(void *)): p (NULL, or a result of this call) holds old_n bytes, which are
 * copied (min(old_n, n)), and is freed. The result is the caller's (free()). Blocks of
 * 2 MB or more are aligned to 2 MB and advised to use transparent huge pages (fewer TLB
 * misses for arrays touched at random). */
void *sim_mem_realloc_aligned(void *p, size_t old_n, size_t n, size_t align);

#endif
