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

/* This part's units [*lo, *hi) of a job whose `units` units each cost `cost` and start at `base` in a sequence of
 * jobs costing `total` in all (a mixture of experts' phase: per expert with tokens, its column groups): those whose
 * start falls in part `part` of `parts` equal shares of the total. */
static inline void share_by_cost(int64_t total, int part, int parts, int64_t base, int64_t cost, int units, int *lo,
                                 int *hi) {
    const int64_t c0 = total * part / parts - base, c1 = total * (part + 1) / parts - base;
    const int64_t j0 = c0 <= 0 ? 0 : (c0 + cost - 1) / cost, j1 = c1 <= 0 ? 0 : (c1 + cost - 1) / cost;
    *lo = j0 < units ? (int)j0 : units;
    *hi = j1 < units ? (int)j1 : units;
}

/* A kernel's thread count: at most `threads`, and one where the work is below `min_work` per extra thread (waking
 * a thread costs a few microseconds; elementwise work on a decode batch is smaller than that). */
static inline int threads_for(int threads, int64_t work, int64_t min_work) {
    int64_t useful = work / (min_work > 0 ? min_work : 1);
    return threads < 1 ? 1 : useful < threads ? (useful < 1 ? 1 : (int)useful) : threads;
}
#endif
