/*
 * threadpool: a fixed set of compute threads that run one function together, fork/join
 * style, for the data-parallel steps of the forward pass (matmul rows, attention heads).
 *
 * threadpool_run(pool, fn, arg) runs fn(arg, i, n) on the calling thread (i = 0) and on
 * the workers (i in [1, n)) that start in time, and returns when every one that started
 * has returned. A worker that wakes after the caller has finished fn does not run it:
 * on a busy machine the caller does not wait for threads that get no CPU. So fn must
 * divide the work by claiming it (an atomic counter over chunks), never by thread index,
 * and results must not depend on which thread did which chunk; i is for per-thread
 * scratch.
 *
 * Between jobs the workers spin briefly on a generation counter (the steps of a forward
 * pass come back to back), then sleep on a condition variable, so an idle pool costs no
 * CPU. A pool of 1 thread creates no threads and runs fn inline.
 */
#ifndef TP_THREADPOOL_H
#define TP_THREADPOOL_H

typedef struct threadpool threadpool_t;

/* fn(arg, thread_index, n_threads). Must not call threadpool_run on the same pool. */
typedef void (*threadpool_fn)(void *arg, int thread_index, int n_threads);

/* Number of CPUs this process may run on (sched_getaffinity), at least 1. */
int threadpool_default_threads(void);

/* Start a pool of n_threads threads in total, counting the caller (n_threads - 1 are
 * created). n_threads <= 0 means threadpool_default_threads(). NULL on failure (out of
 * memory, pthread_create). */
threadpool_t *threadpool_new(int n_threads);

/* Stop and join the threads, free the pool; takes NULL; sets *pool to NULL. Must not run
 * concurrently with threadpool_run. */
void threadpool_destroy(threadpool_t **pool);

/* Threads in the pool, counting the caller. */
int threadpool_size(const threadpool_t *pool);

/* Workers (not counting the caller) not blocked on the pool's condition variable right
 * now: spinning between jobs, inside one, or on their way to sleep; 0 for a pool of 1.
 * Read without the lock, so a hint that may be stale by the time it is used. Waking a
 * sleeping worker on a machine whose other CPUs are busy usually preempts the caller
 * (the woken thread is placed on the caller's CPU): below some job size that costs more
 * than the job, so callers run short jobs inline when no worker is awake (model_forward's
 * PAR_WAKE_WORK). Thread-safe. */
int threadpool_awake(const threadpool_t *pool);

/* Run fn on the caller and the workers that start in time (see above); on return no
 * thread is inside fn and none will enter it. The pool is owned by one thread at a time:
 * calls to threadpool_run on one pool must not overlap. */
void threadpool_run(threadpool_t *pool, threadpool_fn fn, void *arg);

#endif
