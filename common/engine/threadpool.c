/*
 * threadpool: see threadpool.h.
 *
 * One job at a time, numbered by a generation counter. threadpool_run publishes (fn,
 * arg), bumps `gen` and wakes sleepers, runs fn itself, then closes the job (`closed` =
 * its generation) and waits until no worker is inside it (`active` == 0). A worker that
 * sees a new generation g announces itself (active++), then runs fn only if the job is
 * still g and not closed; otherwise it backs off. So the caller never waits for a worker
 * that has not started yet (on a busy machine a woken thread may get a CPU only
 * milliseconds later, by when the caller has done all the chunks), only for one inside
 * fn. The announce/check and close/check pairs are sequentially consistent (Dekker): if
 * the caller saw active == 0 after closing, a late worker sees the close.
 *
 * Both waits spin first (SPIN_ITERS pause instructions, some tens of microseconds: the
 * next step of a forward pass usually follows within that) and then block on a
 * condition variable; every check-then-sleep happens under the mutex, and every change a
 * sleeper waits for is followed by a signal under the same mutex, so no wake-up is lost.
 * threadpool_awake reads the sleeper count without the lock: a hint for callers that
 * would rather run a short job inline than wake a thread for it.
 */
#include "threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#define SPIN_ITERS 2000

struct threadpool {
    int n_threads;
    pthread_t *threads; /* (n_threads - 1,) */
    int n_started;
    pthread_mutex_t mu;
    pthread_cond_t cv_start; /* workers: a new generation or stop */
    pthread_cond_t cv_done;  /* caller: active reached 0 */
    _Atomic uint64_t gen;    /* generation of the current job */
    _Atomic uint64_t closed; /* last generation closed to new workers */
    atomic_int active;       /* workers announced for the current job */
    atomic_int stop;
    atomic_int n_sleeping; /* workers blocked on cv_start (changed under mu) */
    int caller_sleeping;
    threadpool_fn fn; /* current job, published by the release of gen */
    void *arg;
};

typedef struct {
    threadpool_t *pool;
    int index;
} worker_arg;

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

int threadpool_default_threads(void)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n >= 1)
            return n;
    }
    return 1;
}

/* Wait for a generation after `seen` (or stop); returns it, or 0 on stop. */
static uint64_t wait_job(threadpool_t *pool, uint64_t seen)
{
    for (int i = 0; i < SPIN_ITERS; i++) {
        if (atomic_load_explicit(&pool->stop, memory_order_acquire))
            return 0;
        uint64_t g = atomic_load_explicit(&pool->gen, memory_order_acquire);
        if (g != seen)
            return g;
        cpu_relax();
    }
    pthread_mutex_lock(&pool->mu);
    uint64_t g;
    while ((g = atomic_load_explicit(&pool->gen, memory_order_acquire)) == seen &&
           !atomic_load_explicit(&pool->stop, memory_order_acquire)) {
        atomic_fetch_add_explicit(&pool->n_sleeping, 1, memory_order_relaxed);
        pthread_cond_wait(&pool->cv_start, &pool->mu);
        atomic_fetch_sub_explicit(&pool->n_sleeping, 1, memory_order_relaxed);
    }
    pthread_mutex_unlock(&pool->mu);
    return atomic_load_explicit(&pool->stop, memory_order_acquire) ? 0 : g;
}

static void leave(threadpool_t *pool)
{
    if (atomic_fetch_sub_explicit(&pool->active, 1, memory_order_acq_rel) == 1) {
        pthread_mutex_lock(&pool->mu);
        if (pool->caller_sleeping)
            pthread_cond_signal(&pool->cv_done);
        pthread_mutex_unlock(&pool->mu);
    }
}

static void *worker_main(void *p)
{
    worker_arg wa = *(worker_arg *)p;
    free(p);
    threadpool_t *pool = wa.pool;
    uint64_t seen = 0;
    for (;;) {
        uint64_t g = wait_job(pool, seen);
        if (g == 0)
            break;
        seen = g;
        atomic_fetch_add_explicit(&pool->active, 1, memory_order_seq_cst);
        if (atomic_load_explicit(&pool->gen, memory_order_seq_cst) != g ||
            atomic_load_explicit(&pool->closed, memory_order_seq_cst) >= g) {
            leave(pool); /* too late for job g */
            continue;
        }
        pool->fn(pool->arg, wa.index, pool->n_threads);
        leave(pool);
    }
    return NULL;
}

threadpool_t *threadpool_new(int n_threads)
{
    if (n_threads <= 0)
        n_threads = threadpool_default_threads();
    threadpool_t *pool = calloc(1, sizeof(*pool));
    if (!pool)
        return NULL;
    pool->n_threads = n_threads;
    atomic_init(&pool->gen, 0);
    atomic_init(&pool->closed, 0);
    atomic_init(&pool->active, 0);
    atomic_init(&pool->stop, 0);
    atomic_init(&pool->n_sleeping, 0);
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->cv_start, NULL);
    pthread_cond_init(&pool->cv_done, NULL);
    if (n_threads > 1) {
        pool->threads = calloc((size_t)n_threads - 1, sizeof(pthread_t));
        if (!pool->threads)
            goto fail;
        for (int i = 1; i < n_threads; i++) {
            worker_arg *wa = malloc(sizeof(*wa));
            if (!wa)
                goto fail;
            wa->pool = pool;
            wa->index = i;
            if (pthread_create(&pool->threads[i - 1], NULL, worker_main, wa) != 0) {
                free(wa);
                goto fail;
            }
            pool->n_started++;
        }
    }
    return pool;
fail:
    threadpool_destroy(&pool);
    return NULL;
}

void threadpool_destroy(threadpool_t **pp)
{
    if (!pp || !*pp)
        return;
    threadpool_t *pool = *pp;
    pthread_mutex_lock(&pool->mu);
    atomic_store_explicit(&pool->stop, 1, memory_order_release);
    pthread_cond_broadcast(&pool->cv_start);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->n_started; i++)
        pthread_join(pool->threads[i], NULL);
    pthread_cond_destroy(&pool->cv_start);
    pthread_cond_destroy(&pool->cv_done);
    pthread_mutex_destroy(&pool->mu);
    free(pool->threads);
    free(pool);
    *pp = NULL;
}

int threadpool_size(const threadpool_t *pool)
{
    return pool->n_threads;
}

int threadpool_awake(const threadpool_t *pool)
{
    if (pool->n_threads == 1)
        return 0;
    int asleep = atomic_load_explicit(&((threadpool_t *)pool)->n_sleeping, memory_order_relaxed);
    return pool->n_threads - 1 - asleep;
}

void threadpool_run(threadpool_t *pool, threadpool_fn fn, void *arg)
{
    if (pool->n_threads == 1) {
        fn(arg, 0, 1);
        return;
    }
    pool->fn = fn;
    pool->arg = arg;
    uint64_t g = atomic_load_explicit(&pool->gen, memory_order_relaxed) + 1;
    atomic_store_explicit(&pool->gen, g, memory_order_seq_cst);
    pthread_mutex_lock(&pool->mu);
    if (atomic_load_explicit(&pool->n_sleeping, memory_order_relaxed))
        pthread_cond_broadcast(&pool->cv_start);
    pthread_mutex_unlock(&pool->mu);

    fn(arg, 0, pool->n_threads);

    atomic_store_explicit(&pool->closed, g, memory_order_seq_cst);
    for (int i = 0; i < SPIN_ITERS; i++) {
        if (atomic_load_explicit(&pool->active, memory_order_seq_cst) == 0)
            return;
        cpu_relax();
    }
    pthread_mutex_lock(&pool->mu);
    while (atomic_load_explicit(&pool->active, memory_order_seq_cst) != 0) {
        pool->caller_sleeping = 1;
        pthread_cond_wait(&pool->cv_done, &pool->mu);
        pool->caller_sleeping = 0;
    }
    pthread_mutex_unlock(&pool->mu);
}
