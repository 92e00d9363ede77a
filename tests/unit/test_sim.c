/*
 * The computing parts of tidepool-sim (tools/sim/): the event heap and the finish-step
 * heap against a sorted reference (ties, growth, interleaved pushes and pops), the int
 * vector and deque against a plain model, the generator against values from an
 * independent Python implementation of xoshiro256** / splitmix64, the percentile
 * (quickselect) against sorting, the phase-shift workload (determinism, bounds by phase,
 * counts) and traces (formats, stable order, every refusal with file and line, the shape
 * statistics worked by hand). The simulated cluster: test_sim_cluster.c.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "sim_heap.h"
#include "sim_ideque.h"
#include "sim_ivec.h"
#include "sim_mem.h"
#include "sim_rng.h"
#include "sim_stats.h"
#include "sim_workload.h"

static void assert_close(double got, double want, double rel)
{
    if (!(fabs(got - want) <= rel * fmax(fabs(want), 1e-300)))
        fail_msg("got %.17g, want %.17g (rel %.1e)", got, want, rel);
}

// --- event heap

/* Equal times pop in insertion order; type, id and epoch come back with their event; an
 * empty heap says so and leaves *out alone. */
static void test_heap_order_and_ties(void **state)
{
    (void)state;
    sim_heap h = {0};
    const double t[] = {5, 1, 3, 1, 5, 0, 3, 1};
    for (int i = 0; i < 8; i++)
        sim_heap_push(&h, t[i], 100 + i, i, (uint32_t)(1000 + i));
    const int want[] = {5, 1, 3, 7, 2, 6, 0, 4}; /* by (time, insertion) */
    sim_heap_event e;
    for (int i = 0; i < 8; i++) {
        assert_int_equal(sim_heap_pop(&h, &e), 0);
        assert_int_equal(e.id, want[i]);
        assert_true(e.t_ms == t[want[i]]);
        assert_int_equal(e.type, 100 + want[i]);
        assert_int_equal(e.epoch, 1000 + want[i]);
        assert_int_equal(e.seq, want[i]);
    }
    e.id = -42;
    assert_int_equal(sim_heap_pop(&h, &e), -1);
    assert_int_equal(e.id, -42);
    /* sequence numbers keep counting after the heap empties */
    sim_heap_push(&h, 1, 0, 9, 0);
    assert_int_equal(sim_heap_pop(&h, &e), 0);
    assert_int_equal(e.seq, 8);
    sim_heap_free(&h);
    assert_null(h.v);
    assert_int_equal(h.n, 0);
}

typedef struct {
    double t;
    uint64_t seq;
} tkey;

static int tkey_cmp(const void *a, const void *b)
{
    const tkey *x = a, *y = b;
    if (x->t != y->t)
        return x->t < y->t ? -1 : 1;
    return (x->seq > y->seq) - (x->seq < y->seq);
}

/* 100000 random events with many ties, far past the first capacity: they pop in the
 * order of a sort by (time, insertion). Then interleaved pushes and pops, each pop the
 * minimum of what is in the heap (a linear scan of a plain list). */
static void test_heap_random_many(void **state)
{
    (void)state;
    enum { N = 100000, M = 6000 };
    sim_rng r;
    sim_rng_seed(&r, 99);
    sim_heap h = {0};
    tkey *ref = malloc(N * sizeof(*ref));
    assert_non_null(ref);
    for (int i = 0; i < N; i++) {
        double t = sim_rng_range(&r, 0, 999) * 0.5;
        ref[i] = (tkey){t, (uint64_t)i};
        sim_heap_push(&h, t, 0, i, 0);
    }
    assert_int_equal(h.n, N);
    assert_true(h.cap >= N);
    qsort(ref, N, sizeof(*ref), tkey_cmp);
    sim_heap_event e;
    for (int i = 0; i < N; i++) {
        assert_int_equal(sim_heap_pop(&h, &e), 0);
        if (e.t_ms != ref[i].t || e.seq != ref[i].seq)
            fail_msg("pop %d: got (%g, %llu), want (%g, %llu)", i, e.t_ms,
                     (unsigned long long)e.seq, ref[i].t, (unsigned long long)ref[i].seq);
        assert_int_equal(e.id, (int)e.seq);
    }
    assert_int_equal(sim_heap_pop(&h, &e), -1);
    sim_heap_free(&h);

    /* interleaved: three pushes, one pop; then drain */
    tkey *live = ref;
    int n_live = 0;
    uint64_t seq = h.next_seq; /* sequence numbers go on after a free */
    int pops = 0;
    for (int i = 0; i < M; i++) {
        double t = sim_rng_range(&r, 0, 99);
        sim_heap_push(&h, t, 0, 0, 0);
        live[n_live++] = (tkey){t, seq++};
        if (i % 3 == 2 || i >= M - 1) {
            int drain = i >= M - 1 ? n_live : 1;
            for (int k = 0; k < drain; k++) {
                int best = 0;
                for (int j = 1; j < n_live; j++)
                    if (tkey_cmp(&live[j], &live[best]) < 0)
                        best = j;
                assert_int_equal(sim_heap_pop(&h, &e), 0);
                assert_true(e.t_ms == live[best].t);
                assert_int_equal(e.seq, live[best].seq);
                live[best] = live[--n_live];
                pops++;
            }
        }
    }
    assert_int_equal(pops, M);
    assert_int_equal(h.n, 0);
    sim_heap_free(&h);
    free(ref);
}

/* The slot heap: one event per id, set again = replaced (earlier or later), popped in
 * (time, seq) order against a plain table of the live slots scanned for its minimum; the
 * type replaced comes back; an empty heap says so. 200 ids, 20000 random operations with
 * many ties in time, enough to fill every level of the 4-ary layout. */
static void test_slot_heap(void **state)
{
    (void)state;
    enum { N = 200, OPS = 20000 };
    sim_heap_slot h;
    sim_heap_slot_init(&h, N);
    sim_heap_event e;
    assert_int_equal(sim_heap_slot_pop(&h, &e), -1);
    assert_null(sim_heap_slot_top(&h));
    struct {
        int set, type;
        double t;
        uint64_t seq;
        uint32_t epoch;
    } ref[N];
    memset(ref, 0, sizeof(ref));
    sim_rng r;
    sim_rng_seed(&r, 5);
    uint64_t seq = 0;
    int pops = 0, replaced = 0;
    for (int i = 0; i < OPS; i++) {
        if (sim_rng_range(&r, 0, 2) > 0) { /* set (two in three) */
            int id = sim_rng_range(&r, 0, N - 1);
            double t = sim_rng_range(&r, 0, 50) * 0.25;
            int type = sim_rng_range(&r, 1, 6);
            int old = sim_heap_slot_set(&h, id, t, seq, type, (uint32_t)i);
            assert_int_equal(old, ref[id].set ? ref[id].type : 0);
            replaced += ref[id].set;
            ref[id].set = 1;
            ref[id].type = type;
            ref[id].t = t;
            ref[id].seq = seq++;
            ref[id].epoch = (uint32_t)i;
        } else {
            int best = -1;
            for (int j = 0; j < N; j++)
                if (ref[j].set && (best < 0 || ref[j].t < ref[best].t ||
                                   (ref[j].t == ref[best].t && ref[j].seq < ref[best].seq)))
                    best = j;
            if (best < 0) {
                assert_int_equal(sim_heap_slot_pop(&h, &e), -1);
                continue;
            }
            assert_true(sim_heap_slot_top(&h)->id == best);
            assert_int_equal(sim_heap_slot_pop(&h, &e), 0);
            assert_int_equal(e.id, best);
            assert_true(e.t_ms == ref[best].t);
            assert_int_equal(e.seq, ref[best].seq);
            assert_int_equal(e.type, ref[best].type);
            assert_int_equal(e.epoch, ref[best].epoch);
            ref[best].set = 0;
            pops++;
        }
    }
    int left = 0;
    for (int j = 0; j < N; j++)
        left += ref[j].set;
    assert_int_equal(h.n, left);
    assert_true(pops > 5000 && replaced > 5000);
    sim_heap_slot_free(&h);
    assert_null(h.v);
}

typedef struct {
    int64_t step;
    int req;
} fkey;

static int fkey_cmp(const void *a, const void *b)
{
    const fkey *x = a, *y = b;
    if (x->step != y->step)
        return x->step < y->step ? -1 : 1;
    return (x->req > y->req) - (x->req < y->req);
}

/* The finish heap: by step, ties by request id (not insertion), epoch carried; random
 * entries against a sort; n = 0 empties it. */
static void test_fin_heap(void **state)
{
    (void)state;
    sim_heap_fin h = {0};
    sim_heap_fin_push(&h, (sim_heap_fin_entry){7, 30, 1});
    sim_heap_fin_push(&h, (sim_heap_fin_entry){7, 10, 2});
    sim_heap_fin_push(&h, (sim_heap_fin_entry){3, 99, 3});
    sim_heap_fin_push(&h, (sim_heap_fin_entry){7, 20, 4});
    assert_int_equal(h.v[0].step, 3); /* the minimum is at the root */
    const int want_req[] = {99, 10, 20, 30}, want_epoch[] = {3, 2, 4, 1};
    for (int i = 0; i < 4; i++) {
        sim_heap_fin_entry e = sim_heap_fin_pop(&h);
        assert_int_equal(e.req, want_req[i]);
        assert_int_equal(e.epoch, want_epoch[i]);
    }
    assert_int_equal(h.n, 0);

    enum { N = 20000 };
    fkey *ref = malloc(N * sizeof(*ref));
    assert_non_null(ref);
    sim_rng r;
    sim_rng_seed(&r, 5);
    for (int i = 0; i < N; i++) {
        /* distinct (step, req) pairs: req = i */
        ref[i] = (fkey){sim_rng_range(&r, 0, 300), i};
        sim_heap_fin_push(&h, (sim_heap_fin_entry){ref[i].step, i, 0});
    }
    qsort(ref, N, sizeof(*ref), fkey_cmp);
    for (int i = 0; i < N; i++) {
        sim_heap_fin_entry e = sim_heap_fin_pop(&h);
        assert_int_equal(e.step, ref[i].step);
        assert_int_equal(e.req, ref[i].req);
    }
    assert_int_equal(h.n, 0);
    sim_heap_fin_push(&h, (sim_heap_fin_entry){1, 1, 0});
    h.n = 0; /* documented: empties it */
    sim_heap_fin_push(&h, (sim_heap_fin_entry){5, 2, 0});
    assert_int_equal(sim_heap_fin_pop(&h).req, 2);
    sim_heap_fin_free(&h);
    assert_null(h.v);
    free(ref);
}

// --- vector and deque

static void test_ivec(void **state)
{
    (void)state;
    sim_ivec a = {0};
    for (int i = 0; i < 1000; i++)
        sim_ivec_push(&a, i * 3);
    assert_int_equal(a.n, 1000);
    assert_true(a.cap >= 1000);
    for (int i = 0; i < 1000; i++)
        assert_int_equal(a.v[i], i * 3);
    a.n = 0;
    sim_ivec_push(&a, 7);
    assert_int_equal(a.n, 1);
    assert_int_equal(a.v[0], 7);
    sim_ivec_free(&a);
    assert_null(a.v);
    assert_int_equal(a.n, 0);
    sim_ivec_push(&a, 8); /* reusable */
    assert_int_equal(a.v[0], 8);
    sim_ivec_free(&a);
}

/* Lent buffers (tidepool-sim's per-worker blocks): an ivec and a finish heap that start in
 * the caller's buffer hold the same elements as owned ones through growth past it, the
 * heap the very same array (migration walks it in array order, so a lent block must not
 * change that order); the buffer is never freed (ASan would catch it) and left as it was
 * when outgrown. */
static void test_lent_buffers(void **state)
{
    (void)state;
    int buf[4] = {0};
    sim_ivec a = {.v = buf, .cap = 4, .ext = 1};
    for (int i = 0; i < 100; i++)
        sim_ivec_push(&a, i + 1);
    assert_int_equal(a.ext, 0);
    assert_true(a.v != buf);
    for (int i = 0; i < 100; i++)
        assert_int_equal(a.v[i], i + 1);
    assert_int_equal(buf[3], 4);
    sim_ivec_free(&a);
    sim_ivec b = {.v = buf, .cap = 4, .ext = 1};
    sim_ivec_push(&b, 9);
    assert_int_equal(buf[0], 9);
    sim_ivec_free(&b); /* must not free buf */
    assert_null(b.v);

    sim_heap_fin_entry fbuf[8];
    sim_heap_fin lent = {.v = fbuf, .cap = 8, .ext = 1}, own = {0};
    sim_rng r;
    sim_rng_seed(&r, 11);
    for (int i = 0; i < 3000; i++) {
        if (sim_rng_range(&r, 0, 2) > 0 || own.n == 0) {
            sim_heap_fin_entry e = {sim_rng_range(&r, 0, 40), sim_rng_range(&r, 0, 30),
                                    (uint32_t)i};
            sim_heap_fin_push(&lent, e);
            sim_heap_fin_push(&own, e);
        } else {
            sim_heap_fin_entry x = sim_heap_fin_pop(&lent), y = sim_heap_fin_pop(&own);
            assert_true(x.step == y.step && x.req == y.req && x.epoch == y.epoch);
        }
        assert_int_equal(lent.n, own.n);
        for (int k = 0; k < own.n; k++)
            assert_true(lent.v[k].step == own.v[k].step && lent.v[k].req == own.v[k].req &&
                        lent.v[k].epoch == own.v[k].epoch);
    }
    assert_true(own.n > 8 && lent.ext == 0);
    sim_heap_fin_free(&lent);
    sim_heap_fin_free(&own);
}

/* FIFO across growth while the ring is wrapped (head in the middle), pushes at the front,
 * and 200000 random operations against a plain model (an array with room on both sides). */
static void test_ideque(void **state)
{
    (void)state;
    sim_ideque d = {0};
    for (int i = 0; i < 200; i++)
        sim_ideque_push_back(&d, i);
    for (int i = 0; i < 150; i++)
        assert_int_equal(sim_ideque_pop_front(&d), i);
    for (int i = 200; i < 600; i++) /* wraps, then grows from a wrapped ring */
        sim_ideque_push_back(&d, i);
    assert_int_equal(d.n, 450);
    sim_ideque_push_front(&d, -1);
    sim_ideque_push_front(&d, -2);
    assert_int_equal(sim_ideque_front(&d), -2);
    assert_int_equal(sim_ideque_pop_front(&d), -2);
    assert_int_equal(sim_ideque_pop_front(&d), -1);
    for (int i = 150; i < 600; i++)
        assert_int_equal(sim_ideque_pop_front(&d), i);
    assert_int_equal(d.n, 0);
    sim_ideque_free(&d);
    assert_null(d.v);

    enum { OPS = 200000, MID = OPS + 8 };
    int *model = malloc((2 * MID) * sizeof(int));
    assert_non_null(model);
    size_t lo = MID, hi = MID; /* model[lo..hi) */
    sim_rng r;
    sim_rng_seed(&r, 17);
    for (int i = 0; i < OPS; i++) {
        int op = sim_rng_range(&r, 0, 9);
        if (op < 4) {
            sim_ideque_push_back(&d, i);
            model[hi++] = i;
        } else if (op < 6) {
            sim_ideque_push_front(&d, i);
            model[--lo] = i;
        } else if (hi > lo) {
            assert_int_equal(sim_ideque_front(&d), model[lo]);
            assert_int_equal(sim_ideque_pop_front(&d), model[lo]);
            lo++;
        }
        assert_int_equal(d.n, hi - lo);
    }
    while (hi > lo)
        assert_int_equal(sim_ideque_pop_front(&d), model[lo++]);
    sim_ideque_free(&d);
    free(model);
}

static void test_mem(void **state)
{
    (void)state;
    char *p = sim_mem_realloc(NULL, 0); /* never NULL */
    assert_non_null(p);
    p = sim_mem_realloc(p, 100);
    memset(p, 1, 100);
    p = sim_mem_realloc(p, 10000);
    assert_int_equal(p[99], 1);
    free(p);

    /* aligned: contents copied; a block of 2 MB or more aligned to 2 MB (huge pages) */
    char *q = sim_mem_realloc_aligned(NULL, 0, 1000, 64);
    assert_int_equal((uintptr_t)q % 64, 0);
    memset(q, 5, 1000);
    q = sim_mem_realloc_aligned(q, 1000, (size_t)3 << 20, 64);
    assert_int_equal((uintptr_t)q % ((uintptr_t)2 << 20), 0);
    assert_int_equal(q[0], 5);
    assert_int_equal(q[999], 5);
    q[((size_t)3 << 20) - 1] = 1;
    free(q);
}

// --- random numbers

/* First outputs of xoshiro256** seeded by splitmix64, from an independent Python
 * implementation (its splitmix64(0) gives the published 0xe220a8397b1dcdaf). A change
 * here changes every simulated run. */
static void test_rng_known_values(void **state)
{
    (void)state;
    static const struct {
        uint64_t seed, out[4];
    } want[] = {
        {0, {0x99ec5f36cb75f2b4ull, 0xbf6e1f784956452aull, 0x1a5f849d4933e6e0ull,
             0x6aa594f1262d2d2cull}},
        {42, {0x15780b2e0c2ec716ull, 0x6104d9866d113a7eull, 0xae17533239e499a1ull,
              0xecb8ad4703b360a1ull}},
        {0x5eed5eed5eedull ^ 1, {0x62542c7dc0def586ull, 0xe59c90555170dad0ull,
                                 0xedf0a1de4cb642acull, 0xf1695b17bf8fb311ull}},
    };
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        sim_rng r;
        sim_rng_seed(&r, want[i].seed);
        for (int k = 0; k < 4; k++)
            if (sim_rng_next(&r) != want[i].out[k])
                fail_msg("seed %llu output %d", (unsigned long long)want[i].seed, k);
    }
    /* uniform: [0, 1), the top 53 bits of the next output */
    sim_rng r;
    sim_rng_seed(&r, 0);
    assert_true(sim_rng_uniform(&r) == (double)(0x99ec5f36cb75f2b4ull >> 11) * 0x1.0p-53);
    double sum = 0;
    for (int i = 0; i < 100000; i++) {
        double u = sim_rng_uniform(&r);
        assert_true(u >= 0 && u < 1);
        sum += u;
    }
    assert_close(sum / 100000, 0.5, 0.01);
    /* ranges are inclusive and reach both ends */
    int seen[7] = {0};
    for (int i = 0; i < 10000; i++) {
        int x = sim_rng_range(&r, -3, 3);
        assert_true(x >= -3 && x <= 3);
        seen[x + 3]++;
    }
    for (int k = 0; k < 7; k++)
        assert_true(seen[k] > 1200 && seen[k] < 1650); /* 10000 / 7 = 1429 */
    assert_int_equal(sim_rng_range(&r, 5, 5), 5);
    /* a copy forks the sequence */
    sim_rng c = r;
    assert_true(sim_rng_next(&c) == sim_rng_next(&r));
}

// --- statistics

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* numpy's linear percentile on a sorted copy: the reference. */
static double ref_percentile(const double *sorted, size_t n, double p)
{
    double pos = p / 100.0 * (double)(n - 1);
    size_t lo = (size_t)floor(pos);
    size_t hi = lo + 1 < n ? lo + 1 : lo;
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - (double)lo);
}

/* 1..100 by hand (p90 90.1, p99 99.01, median 50.5), empty and single samples, then random
 * samples of every size up to 300 (distinct values, heavy duplicates, sorted and reversed
 * input) at many percentiles against the sort-based reference; the sample is only
 * reordered. */
static void test_stats_percentile(void **state)
{
    (void)state;
    double v[300], w[300], s[300];
    for (int i = 0; i < 100; i++)
        v[i] = 100 - i;
    assert_close(sim_stats_mean(v, 100), 50.5, 1e-12);
    assert_close(sim_stats_percentile(v, 100, 50), 50.5, 1e-12);
    assert_close(sim_stats_percentile(v, 100, 90), 90.1, 1e-12);
    assert_close(sim_stats_percentile(v, 100, 99), 99.01, 1e-12);
    assert_close(sim_stats_percentile(v, 100, 100), 100, 1e-12);
    assert_close(sim_stats_percentile(v, 100, 0), 1, 1e-12);
    assert_true(sim_stats_percentile(NULL, 0, 99) == 0);
    assert_true(sim_stats_mean(NULL, 0) == 0);
    double one = 3.5;
    assert_true(sim_stats_percentile(&one, 1, 99) == 3.5);

    static const double ps[] = {0, 1, 10, 25, 33.3, 50, 75, 90, 95, 99, 99.9, 100};
    sim_rng r;
    sim_rng_seed(&r, 2024);
    for (int n = 1; n <= 300; n++) {
        for (int kind = 0; kind < 4; kind++) {
            for (int i = 0; i < n; i++) {
                if (kind == 0)
                    v[i] = sim_rng_uniform(&r) * 1000;
                else if (kind == 1)
                    v[i] = sim_rng_range(&r, 0, 3); /* heavy duplicates */
                else
                    v[i] = kind == 2 ? i : n - i; /* sorted, reversed */
            }
            memcpy(s, v, (size_t)n * sizeof(double));
            qsort(s, (size_t)n, sizeof(double), cmp_double);
            for (size_t k = 0; k < sizeof(ps) / sizeof(ps[0]); k++) {
                memcpy(w, v, (size_t)n * sizeof(double));
                double got = sim_stats_percentile(w, (size_t)n, ps[k]);
                double want = ref_percentile(s, (size_t)n, ps[k]);
                if (fabs(got - want) > 1e-9 * fmax(1, fabs(want)))
                    fail_msg("n %d kind %d p %g: got %.17g, want %.17g", n, kind, ps[k], got,
                             want);
                qsort(w, (size_t)n, sizeof(double), cmp_double); /* a permutation of v */
                assert_memory_equal(w, s, (size_t)n * sizeof(double));
            }
        }
    }
}

// --- phase-shift workload

static int arrival_equal(const sim_workload_arrival *a, const sim_workload_arrival *b)
{
    return a->arrival_s == b->arrival_s && a->prompt == b->prompt && a->out == b->out &&
           a->offline == b->offline;
}

static int in_shape(const sim_workload_arrival *a, int kind)
{
    const sim_workload_shape *s = &sim_workload_shapes[kind];
    return a->prompt >= s->prompt_lo && a->prompt <= s->prompt_hi && a->out >= s->out_lo &&
           a->out <= s->out_hi;
}

/* The steady workloads: 50 req/s for 200 s, 10 % offline. Every online request of the
 * named shape (mix: both, each about half), every offline one of the offline shape; the
 * range ends reached; the same seed gives the same arrivals; the kinds parse by name. */
static void test_workload_steady(void **state)
{
    (void)state;
    sim_workload_kind kinds[] = {SIM_WORKLOAD_CONVERSATION, SIM_WORKLOAD_CODE, SIM_WORKLOAD_MIX};
    const char *names[] = {"conversation", "code", "mix"};
    for (int k = 0; k < 3; k++) {
        sim_workload_kind parsed;
        assert_int_equal(sim_workload_kind_parse(names[k], &parsed), 0);
        assert_int_equal(parsed, kinds[k]);
        sim_workload w, w2;
        sim_workload_steady(&w, kinds[k], 50, 200, 0.1, 5);
        sim_workload_steady(&w2, kinds[k], 50, 200, 0.1, 5);
        sim_workload_arrival a, b;
        int n = 0, n_off = 0, n_conv = 0, n_code = 0, lo = 0, hi = 0;
        double last = -1;
        while (sim_workload_next(&w, &a)) {
            assert_int_equal(sim_workload_next(&w2, &b), 1);
            assert_true(arrival_equal(&a, &b));
            assert_true(a.arrival_s > last && a.arrival_s < 200);
            last = a.arrival_s;
            n++;
            if (a.offline) {
                assert_true(in_shape(&a, SIM_WORKLOAD_SHAPE_OFFLINE));
                n_off++;
                continue;
            }
            int conv = in_shape(&a, SIM_WORKLOAD_SHAPE_CONVERSATION);
            int code = in_shape(&a, SIM_WORKLOAD_SHAPE_CODE);
            assert_true(conv || code);
            if (kinds[k] == SIM_WORKLOAD_CONVERSATION)
                assert_true(conv);
            if (kinds[k] == SIM_WORKLOAD_CODE)
                assert_true(code);
            n_conv += conv && !code;
            n_code += code && !conv;
            const sim_workload_shape *sh =
                &sim_workload_shapes[conv ? SIM_WORKLOAD_SHAPE_CONVERSATION : SIM_WORKLOAD_SHAPE_CODE];
            lo |= a.prompt == sh->prompt_lo;
            hi |= a.out == sh->out_hi;
        }
        assert_true(n > 9000 && n < 11000);
        assert_true(n_off > 700 && n_off < 1300);
        assert_true(lo && hi);
        if (kinds[k] == SIM_WORKLOAD_MIX)
            assert_true(n_conv > 3500 && n_code > 3500);
    }
    sim_workload_kind dummy;
    assert_int_equal(sim_workload_kind_parse("steady", &dummy), -1);
}

/* 20 req/s for 300 s in phases of 30 s, 20% offline: strictly increasing arrivals inside
 * the window, about 6000 of them, the same sequence for the same seed and another for
 * another seed, offline work of the offline shape, online work of its phase's shape (both
 * ends of a range reached), the offline share and the rate the same in both phases. */
static void test_workload_phase_shift(void **state)
{
    (void)state;
    assert_int_equal(sim_workload_shapes[SIM_WORKLOAD_SHAPE_PREFILL_HEAVY].prompt_lo, 512);
    assert_int_equal(sim_workload_shapes[SIM_WORKLOAD_SHAPE_DECODE_HEAVY].out_hi, 1536);
    assert_int_equal(sim_workload_shapes[SIM_WORKLOAD_SHAPE_OFFLINE].out_lo, 128);
    sim_workload w, w2, w3;
    sim_workload_phase_shift(&w, 20, 300, 30, 0.2, 42);
    sim_workload_phase_shift(&w2, 20, 300, 30, 0.2, 42);
    sim_workload_phase_shift(&w3, 20, 300, 30, 0.2, 43);
    assert_int_equal(w.is_trace, 0);
    assert_close(sim_workload_span_s(&w), 300, 1e-12);
    assert_int_equal(sim_workload_phase(&w, 0), 0);
    assert_int_equal(sim_workload_phase(&w, 29.999), 0);
    assert_int_equal(sim_workload_phase(&w, 30), 1);
    assert_int_equal(sim_workload_phase(&w, 59.9), 1);
    assert_int_equal(sim_workload_phase(&w, 60), 0);
    assert_int_equal(sim_workload_phase(&w, 290), 1);

    sim_workload_arrival a, b, c;
    double last = 0;
    int n = 0, n_off = 0, n_phase[2] = {0, 0}, same3 = 0;
    int min_out = 1 << 30, max_out = 0;
    int more3 = 1;
    while (sim_workload_next(&w, &a)) {
        assert_int_equal(sim_workload_next(&w2, &b), 1);
        assert_true(arrival_equal(&a, &b));
        if (more3 && (more3 = sim_workload_next(&w3, &c)))
            same3 += arrival_equal(&a, &c);
        assert_true(a.arrival_s > last && a.arrival_s < 300);
        last = a.arrival_s;
        n++;
        int phase = sim_workload_phase(&w, a.arrival_s);
        if (a.offline) {
            assert_int_equal(a.offline, 1);
            assert_true(in_shape(&a, SIM_WORKLOAD_SHAPE_OFFLINE));
            n_off++;
        } else {
            n_phase[phase]++;
            assert_true(in_shape(&a, phase == 0 ? SIM_WORKLOAD_SHAPE_PREFILL_HEAVY
                                                : SIM_WORKLOAD_SHAPE_DECODE_HEAVY));
            if (phase == 0) {
                min_out = a.out < min_out ? a.out : min_out;
                max_out = a.out > max_out ? a.out : max_out;
            }
        }
    }
    assert_int_equal(sim_workload_next(&w2, &b), 0); /* both end together */
    assert_int_equal(sim_workload_next(&w, &a), 0);  /* and stay ended */
    assert_true(n > 5600 && n < 6400);
    assert_close((double)n_off / n, 0.2, 0.1);
    assert_close((double)n_phase[0] / n_phase[1], 1, 0.1);
    assert_int_equal(min_out, 16);
    assert_int_equal(max_out, 64);
    assert_true(same3 < 5);

    /* no offline share: none; all offline: all */
    sim_workload_phase_shift(&w, 50, 20, 5, 0, 1);
    while (sim_workload_next(&w, &a))
        assert_int_equal(a.offline, 0);
    sim_workload_phase_shift(&w, 50, 20, 5, 1, 1);
    n = 0;
    while (sim_workload_next(&w, &a))
        n += a.offline;
    assert_true(n > 800 && n < 1200);
    sim_workload_free(&w); /* a generator: nothing to free */
}

// --- traces

static char tmpdir[] = "/tmp/test_sim_XXXXXX";

static const char *write_trace(const char *name, const char *text)
{
    static char path[128];
    snprintf(path, sizeof(path), "%s/%s", tmpdir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    return path;
}

/* CSV (header, comments, blank lines, CRLF, classes) and JSONL lines in one file, out of
 * order with ties: loaded sorted by arrival, ties in file order, classes mapped, every
 * record replayed once; a copy is an independent cursor; the span is the last arrival (at
 * least 1 s). */
static void test_trace_load(void **state)
{
    (void)state;
    const char *path = write_trace("t.csv", "arrival_s,prompt_tokens,output_tokens,class\n"
                                            "# a comment\n"
                                            "\n"
                                            "2.5,100,10,online\r\n"
                                            "0.5,200,20,offline\n"
                                            "  0.5 , 300 , 30 , FLEX \n"
                                            "1,400,40\n"
                                            "{\"arrival_s\": 0.5, \"prompt_tokens\": 500, "
                                            "\"output_tokens\": 50, \"service_tier\": \"flex\"}\n"
                                            "{\"arrival_s\": 3, \"prompt_tokens\": 600, "
                                            "\"output_tokens\": 60, \"offline\": true}\n"
                                            "{\"arrival_s\": 0, \"prompt_tokens\": 700, "
                                            "\"output_tokens\": 70, \"class\": \"online\"}\n"
                                            "4,800,80,1\n"
                                            "4,900,90,0\n");
    sim_workload w;
    char err[256];
    if (sim_workload_load_trace(&w, path, 1e6, err, sizeof(err)) != 0)
        fail_msg("%s", err);
    assert_int_equal(w.is_trace, 1);
    assert_int_equal(w.n_recs, 9);
    static const struct {
        double t;
        int prompt, out, offline;
    } want[] = {
        {0, 700, 70, 0},   {0.5, 200, 20, 1}, {0.5, 300, 30, 1},
        {0.5, 500, 50, 1}, {1, 400, 40, 0},   {2.5, 100, 10, 0},
        {3, 600, 60, 1},   {4, 800, 80, 1},   {4, 900, 90, 0},
    };
    sim_workload copy = w;
    sim_workload_arrival a;
    for (int i = 0; i < 9; i++) {
        assert_int_equal(sim_workload_next(&w, &a), 1);
        assert_true(a.arrival_s == want[i].t);
        assert_int_equal(a.prompt, want[i].prompt);
        assert_int_equal(a.out, want[i].out);
        assert_int_equal(a.offline, want[i].offline);
    }
    assert_int_equal(sim_workload_next(&w, &a), 0);
    assert_int_equal(sim_workload_next(&copy, &a), 1); /* the copy starts over */
    assert_int_equal(a.prompt, 700);
    assert_close(sim_workload_span_s(&w), 4, 1e-12);
    sim_workload_free(&w);
    assert_null(w.recs);

    path = write_trace("short.csv", "0.25,10,5\n");
    assert_int_equal(sim_workload_load_trace(&w, path, 1e6, err, sizeof(err)), 0);
    assert_close(sim_workload_span_s(&w), 1, 1e-12); /* at least 1 s */
    sim_workload_free(&w);
}

/* Every refusal names the file and the line (or the file alone) and the reason. */
static void test_trace_errors(void **state)
{
    (void)state;
    static const struct {
        const char *text, *want;
    } bad[] = {
        {"1,2\n", ":1: want arrival_s,prompt_tokens,output_tokens[,class]"},
        {"1,2,3,online,x\n", ":1: want arrival_s,prompt_tokens,output_tokens[,class]"},
        {"0,10,10\nsoon,10,10\n", ":2: arrival_s is not a number"},
        {"arrival,prompt,out\nhdr,again,x\n", ":2: arrival_s is not a number"},
        {"1,ten,10\n", ":1: prompt_tokens / output_tokens are not numbers"},
        {"1,10,10,sometimes\n", ":1: class must be online or offline"},
        {"-1,10,10\n", ":1: arrival_s must be a finite number >= 0"},
        {"nan,10,10\n", ":1: arrival_s must be a finite number >= 0"},
        {"\n\n1,0,10\n", ":3: prompt_tokens and output_tokens must be whole numbers in [1, 1e9]"},
        {"1,10,0\n", ":1: prompt_tokens and output_tokens must be whole numbers in [1, 1e9]"},
        {"1,600,500\n", ":1: prompt + output = 1100 tokens exceeds a worker's KV capacity (1000)"},
        {"{\"arrival_s\": 1}\n", ":1: want numbers arrival_s, prompt_tokens, output_tokens"},
        {"{nope\n", ":1: not a JSON object"},
        {"{\"arrival_s\": 1, \"prompt_tokens\": 5, \"output_tokens\": 5, \"offline\": \"y\"}\n",
         ":1: offline must be a boolean"},
        {"{\"arrival_s\": 1, \"prompt_tokens\": 5, \"output_tokens\": 5, \"class\": \"vip\"}\n",
         ":1: class / service_tier must be online, offline or flex"},
        {"# nothing\n\n", ": no requests"},
        {"arrival_s,prompt_tokens,output_tokens\n", ": no requests"},
    };
    char err[256];
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        const char *path = write_trace("bad.csv", bad[i].text);
        sim_workload w;
        err[0] = 0;
        assert_int_equal(sim_workload_load_trace(&w, path, 1000, err, sizeof(err)), -1);
        char want[256];
        snprintf(want, sizeof(want), "%s%s", path, bad[i].want);
        if (strcmp(err, want) != 0)
            fail_msg("case %zu: got '%s', want '%s'", i, err, want);
        sim_workload_free(&w);
    }
    sim_workload w;
    char path[160];
    snprintf(path, sizeof(path), "%s/missing.csv", tmpdir);
    assert_int_equal(sim_workload_load_trace(&w, path, 1000, err, sizeof(err)), -1);
    char want[256];
    snprintf(want, sizeof(want), "%s: No such file or directory", path);
    assert_string_equal(err, want);
}

/* Shape statistics by hand: online (100, 11) and (300, 30), an offline (1000, 1000)
 * ignored: mean prompt (100^2 + 300^2) / 400 = 250, mean context (11 * 105.5 + 30 * 315) /
 * 41. Only offline requests: the defaults, 512. A generator is sampled on a copy. */
static void test_shape_stats(void **state)
{
    (void)state;
    const char *path = write_trace("s.csv", "0,100,11\n1,1000,1000,offline\n2,300,30\n");
    sim_workload w;
    char err[256];
    assert_int_equal(sim_workload_load_trace(&w, path, 1e6, err, sizeof(err)), 0);
    sim_workload_arrival a;
    assert_int_equal(sim_workload_next(&w, &a), 1); /* the stats start from the beginning */
    double mp, mc;
    sim_workload_shape_stats(&w, &mp, &mc);
    assert_close(mp, 250, 1e-12);
    assert_close(mc, (11 * 105.5 + 30 * 315) / 41, 1e-12);
    assert_int_equal(w.pos, 1); /* untouched */
    sim_workload_free(&w);

    path = write_trace("o.csv", "0,100,10,offline\n");
    assert_int_equal(sim_workload_load_trace(&w, path, 1e6, err, sizeof(err)), 0);
    sim_workload_shape_stats(&w, &mp, &mc);
    assert_true(mp == 512 && mc == 512);
    sim_workload_free(&w);

    sim_workload g, before;
    sim_workload_phase_shift(&g, 10, 100, 10, 0, 3);
    memcpy(&before, &g, sizeof(g));
    sim_workload_shape_stats(&g, &mp, &mc);
    assert_memory_equal(&g, &before, sizeof(g));
    /* the generator's shapes: prompts 64..1536, so the weighted mean lies inside */
    assert_true(mp > 64 && mp < 1536 && mc > 64 && mc < 1536 + 768);
}

static int setup_dir(void **state)
{
    (void)state;
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown_dir(void **state)
{
    (void)state;
    static const char *const names[] = {"t.csv", "short.csv", "bad.csv", "s.csv", "o.csv"};
    char path[160];
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        snprintf(path, sizeof(path), "%s/%s", tmpdir, names[i]);
        unlink(path);
    }
    rmdir(tmpdir);
    return 0;
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_workload_steady),
        cmocka_unit_test(test_heap_order_and_ties),
        cmocka_unit_test(test_heap_random_many),
        cmocka_unit_test(test_slot_heap),
        cmocka_unit_test(test_fin_heap),
        cmocka_unit_test(test_ivec),
        cmocka_unit_test(test_lent_buffers),
        cmocka_unit_test(test_ideque),
        cmocka_unit_test(test_mem),
        cmocka_unit_test(test_rng_known_values),
        cmocka_unit_test(test_stats_percentile),
        cmocka_unit_test(test_workload_phase_shift),
        cmocka_unit_test(test_trace_load),
        cmocka_unit_test(test_trace_errors),
        cmocka_unit_test(test_shape_stats),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests_name("sim", tests, setup_dir, teardown_dir);
}
