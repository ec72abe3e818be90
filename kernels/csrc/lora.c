/* The LoRA delta of every adapter in a step (punica's SGMV shape) in one call per layer part: kernels/lora.py's
 * contract, y[rows of each segment] += (x[rows] a[slot]^T) b[slot]^T. The torch version spends four small ops per
 * adapter per part (a gather, two matrix multiplies, a scatter-add); the arithmetic is a few percent of the base
 * layer's, so here each adapted row is one pass over its adapter's A and B, rows shared among the threads.
 *
 * Each row's shrunk vector (at most the slot's rank) and each output's sum stay in float32, and y is rounded once
 * (bfloat16: to nearest even). A row's result does not depend on the other rows or on the thread count. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "parallel.h"

/* The longest rank a slot may hold (the shrunk vector lives on the stack). */
#define MAX_RANK 256
/* Multiply-adds per extra thread below which one thread does it all. */
#define MIN_WORK_PER_THREAD (1 << 15)

/* One adapted row: shrunk = x A^T (rank), then y += shrunk B^T. T is float or uint16_t (bfloat16). */
#define ROW_KERNEL(NAME, T, LOAD, STORE)                                                                               \
    static void NAME(T *y, const T *x, const T *a, const T *b, int in, int out, int rank, int max_rank) {             \
        float shrunk[MAX_RANK];                                                                                        \
        for (int r = 0; r < rank; r++) {                                                                               \
            const T *ar = a + (int64_t)r * in;                                                                         \
            float s = 0.f;                                                                                             \
            for (int k = 0; k < in; k++) s += LOAD(x[k]) * LOAD(ar[k]);                                                \
            shrunk[r] = s;                                                                                             \
        }                                                                                                              \
        for (int o = 0; o < out; o++) {                                                                                \
            const T *bo = b + (int64_t)o * max_rank;                                                                   \
            float s = 0.f;                                                                                             \
            for (int r = 0; r < rank; r++) s += shrunk[r] * LOAD(bo[r]);                                               \
            y[o] = STORE(LOAD(y[o]) + s);                                                                              \
        }                                                                                                              \
    }

#define AS_IS(v) (v)
ROW_KERNEL(row_f32, float, AS_IS, AS_IS)
ROW_KERNEL(row_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* The segments' rows in [lo, hi) of `rows`: each under its segment's slot (segments: slots[s], starts[s], ends[s]). */
#define SGMV_BODY(ROW, T)                                                                                              \
    const T *xs = (const T *)x;                                                                                        \
    T *ys = (T *)y;                                                                                                    \
    const T *as = (const T *)a, *bs = (const T *)b;                                                                    \
    threads = threads_for(threads, (int64_t)total * (in + out) * max_rank, MIN_WORK_PER_THREAD);                      \
    _Pragma("omp parallel num_threads(threads) if (threads > 1)") {                                                    \
        int lo, hi;                                                                                                    \
        share(total, thread_index(), thread_count(), &lo, &hi);                                                        \
        for (int s = 0; s < segments; s++) {                                                                          \
            const int64_t slot = table[s], start = table[segments + s], end = table[2 * segments + s];                 \
            const int rank = ranks[slot];                                                                              \
            const T *as_ = as + slot * max_rank * (int64_t)in, *bs_ = bs + slot * (int64_t)out * max_rank;            \
            const int64_t first = start > lo ? start : lo, last = end < hi ? end : hi;                                 \
            for (int64_t i = first; rank > 0 && i < last; i++)                                                         \
                ROW(ys + rows[i] * y_stride, xs + rows[i] * x_stride, as_, bs_, in, out, rank, max_rank);              \
        }                                                                                                              \
    }

/* y (tokens rows of y_stride elements, fan_out columns) += the delta of every segment's rows; x (tokens, fan_in; row
 * stride x_stride), a (slots, max_rank, fan_in), b (slots, fan_out, max_rank) contiguous, zero beyond each slot's rank; rows (total)
 * the adapted rows grouped by segment; table (3, segments): slots, then starts, then ends, into rows; ranks (slots)
 * each slot's rank here (0: no delta). dtype: 0 float32, 1 bfloat16. -1 on arguments the kernel does not take. */
int lora_sgmv(void *y, int64_t y_stride, const void *x, int64_t x_stride, const void *a, const void *b,
              const int64_t *rows, const int64_t *table, const int32_t *ranks, int total, int segments, int slots,
              int fan_in, int fan_out, int max_rank, int dtype, int threads) {
    const int in = fan_in, out = fan_out;
    if (total < 0 || segments < 0 || in <= 0 || out <= 0 || max_rank <= 0 || max_rank > MAX_RANK) return -1;
    for (int s = 0; s < segments; s++) {
        const int64_t slot = table[s], start = table[segments + s], end = table[2 * segments + s];
        if (slot < 0 || slot >= slots || start < 0 || end < start || end > total) return -1;
        if (ranks[slot] < 0 || ranks[slot] > max_rank) return -1;
    }
    if (dtype == 0) {
        SGMV_BODY(row_f32, float)
    } else if (dtype == 1) {
        SGMV_BODY(row_bf16, uint16_t)
    } else {
        return -1;
    }
    return 0;
}
