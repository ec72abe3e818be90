/* Splitting a kernel's work over threads. The library is built with -fopenmp and needs libgomp.so.1 by name; torch
 * has loaded its own copy by then, so these regions run on torch's intra-op threads (one pool, no second set of
 * threads spinning against them). Every output element is computed by exactly one thread in the same order
 * whatever the thread count, so results do not depend on it. Built without OpenMP, each kernel runs on one thread. */
#ifndef FASTGEN_PARALLEL_H
#define FASTGEN_PARALLEL_H
#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
static inline int thread_index(void) { return omp_get_thread_num(); }
static inline int thread_count(void) { return omp_get_num_threads(); }
#else
static inline int thread_index(void) { return 0; }
static inline int thread_count(void) { return 1; }
#endif

/* Part `part` of `parts` equal shares of [0, n): [*lo, *hi). */
static inline void share(int n, int part, int parts, int *lo, int *hi) {
    *lo = (int)((int64_t)n * part / parts);
    *hi = (int)((int64_t)n * (part + 1) / parts);
}

/* A kernel's thread count: at most `threads`, and one where the work is below `min_work` per extra thread (waking
 * a thread costs a few microseconds; elementwise work on a decode batch is smaller than that). */
static inline int threads_for(int threads, int64_t work, int64_t min_work) {
    int64_t useful = work / (min_work > 0 ? min_work : 1);
    return threads < 1 ? 1 : useful < threads ? (useful < 1 ? 1 : (int)useful) : threads;
}
#endif
