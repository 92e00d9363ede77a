/*
 * sim_mem: realloc or exit (sim_mem.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "sim_mem.h"

void *sim_mem_realloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q) {
        fprintf(stderr, "tidepool-sim: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return q;
}

/* Huge pages for the big arrays: at 10,000 workers the finish heaps and the requests span
 * tens of MB touched at random, and with 4 KB pages nearly every touch was a TLB miss. */
#define HUGE_PAGE ((size_t)2 << 20)

void *sim_mem_realloc_aligned(void *p, size_t old_n, size_t n, size_t align)
{
    void *q = NULL;
    int huge = n >= HUGE_PAGE;
    if (huge && align < HUGE_PAGE)
        align = HUGE_PAGE;
    if (posix_memalign(&q, align, n ? n : 1) != 0) {
        fprintf(stderr, "tidepool-sim: out of memory (%zu bytes)\n", n);
        exit(1);
    }
#ifdef MADV_HUGEPAGE
    if (huge) /* advice only: without it the pages are small */
        (void)madvise(q, n & ~(HUGE_PAGE - 1), MADV_HUGEPAGE);
#endif
    if (p)
        memcpy(q, p, old_n < n ? old_n : n);
    free(p);
    return q;
}
