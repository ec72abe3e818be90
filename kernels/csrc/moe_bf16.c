/* A mixture-of-experts layer in bfloat16 in one call, on AVX-512 BF16 dot products (vdpbf16ps) for CPUs without a
 * matrix engine (AMD Zen 4, Zen 5): y (tokens, hidden) = sum over each token's k slots of
 * weight * down_e(SiLU(gate_e x) * up_e x), kernels/moe.py's contract.
 *
 * As moe.c does in float32: the (token, slot) pairs sorted by expert (stably) and their rows of x gathered, so each
 * expert's tokens are one matrix; every expert with tokens runs its gate/up weight (packed as a dense layer's for
 * linear_dpbf16.c, kernels/cpu.py PackedLinear) over its rows by column groups, then the elementwise kernel's
 * SiLU(gate) * up, then its down weight; an expert no token chose is never read, and each column group is streamed
 * from memory once per call whatever the rows routed to it. Last, each token's k outputs are scaled by their float32
 * weights, rounded to bfloat16 and added slot by slot, as moe.combine does.
 *
 * Every product is the dense bfloat16 path's (linear_dpbf16, silu_mul_bf16, linear_dpbf16 on one token's row), so a
 * token's result is bit for bit what that path and combine give it alone, whatever the batch, its routing or the
 * thread count. Threads split each phase by (expert, column group), weighed by the rows and weight each holds. */
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "entry_points.h"
#include "moe_groups.h"
#include "parallel.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
/* linear_dpbf16.c's column group: 4 blocks of 16 columns. */
#define GROUP_COLUMNS 64
/* What streaming one column group's weight costs, in rows computed over it (as moe.c's MEMORY_ROWS). */
#define MEMORY_ROWS 16
#define MIN_WORK_PER_THREAD (1 << 16)

/* Rows [0, m) of y (n columns) = x w^T for the column groups [lo, hi) of packed weight tiles w (k = 32 kblocks). */
static void column_groups(const uint16_t *x, int64_t x_stride, const uint16_t *w, int kblocks, uint16_t *y,
                          int64_t y_stride, int m, int n, int lo, int hi) {
    const int nblocks = (n + 15) / 16;
    for (int g = lo; g < hi; g++) {
        const int nb = 4 * g, cols = nblocks - nb < 4 ? nblocks - nb : 4;
        dpbf16_column_group(x, x_stride, w + (int64_t)nb * kblocks * 512, kblocks, NULL, y + 16 * nb, y_stride, m,
                            cols, n - 16 * nb);
    }
}

int moe_dpbf16_available(void) { return elementwise_available(); }

/* x (tokens, hidden) bfloat16 at row stride x_stride; w13: per expert its gate/up weight (2 inter rows, gate then up)
 * in PackedLinear's tiles; w2: per expert its down weight (hidden rows) likewise; ids, weights (tokens, k); y (tokens,
 * hidden) bfloat16, contiguous; an id equal to `experts` is a slot another rank computes: it adds nothing. hidden and
 * inter multiples of 32. Returns -1 on bad arguments (an expert id out of range included) or without memory. */
int moe_dpbf16(const uint16_t *x, int64_t x_stride, const uint16_t *w13, const uint16_t *w2, const int64_t *ids,
               const float *weights, uint16_t *y, int tokens, int k, int experts, int hidden, int inter, int threads) {
    if (tokens <= 0 || k <= 0 || experts <= 0 || hidden <= 0 || inter <= 0 || x_stride < hidden || hidden % 32 ||
        inter % 32 || !elementwise_available())
        return -1;
    if ((int64_t)tokens * k > INT_MAX) return -1;
    const int pairs = tokens * k;
    for (int i = 0; i < pairs; i++)
        if (ids[i] < 0 || ids[i] > experts) return -1;
    const int g13 = ((2 * inter + 15) / 16 + 3) / 4, g2 = ((hidden + 15) / 16 + 3) / 4;
    const int64_t stride13 = (int64_t)(2 * inter + 15) / 16 * 16 * hidden, stride2 = (int64_t)(hidden + 15) / 16 * 16 * inter;

    /* the pairs sorted by expert (moe_groups.h) */
    int *start = calloc((size_t)experts + 2, sizeof(int)), *at = malloc(sizeof(int) * pairs);
    int *row_token = malloc(sizeof(int) * pairs), *next = malloc(sizeof(int) * experts);
    uint16_t *xs = malloc(sizeof(uint16_t) * pairs * hidden), *gu = malloc(sizeof(uint16_t) * pairs * 2 * inter);
    uint16_t *h = malloc(sizeof(uint16_t) * pairs * inter), *out = malloc(sizeof(uint16_t) * pairs * hidden);
    if (!(start && at && row_token && next && xs && gu && h && out)) {
        free(start), free(at), free(row_token), free(next), free(xs), free(gu), free(h), free(out);
        return -1;
    }
    group_pairs(ids, pairs, k, experts, start, at, row_token, next);
    const int rows = start[experts];
    int64_t cost13 = 0, cost2 = 0;
    for (int e = 0; e < experts; e++) {
        const int m = start[e + 1] - start[e];
        if (m) cost13 += (int64_t)g13 * (m + MEMORY_ROWS), cost2 += (int64_t)g2 * (m + MEMORY_ROWS);
    }
    threads = threads_for(threads, (int64_t)pairs * 3 * inter * hidden, MIN_WORK_PER_THREAD);

#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int part = thread_index(), parts = thread_count();
        int lo, hi;
        share(rows, part, parts, &lo, &hi);
        for (int r = lo; r < hi; r++)
            memcpy(xs + (int64_t)r * hidden, x + row_token[r] * x_stride, sizeof(uint16_t) * hidden);
#pragma omp barrier
        int64_t base = 0;
        for (int e = 0; e < experts; e++) {
            const int m = start[e + 1] - start[e];
            if (!m) continue;
            share_by_cost(cost13, part, parts, base, m + MEMORY_ROWS, g13, &lo, &hi);
            base += (int64_t)g13 * (m + MEMORY_ROWS);
            column_groups(xs + (int64_t)start[e] * hidden, hidden, w13 + e * stride13, hidden / 32,
                          gu + (int64_t)start[e] * 2 * inter, 2 * inter, m, 2 * inter, lo, hi);
        }
#pragma omp barrier
        share(rows, part, parts, &lo, &hi);
        if (lo < hi) silu_mul_bf16(gu + (int64_t)lo * 2 * inter, h + (int64_t)lo * inter, hi - lo, inter, 2 * inter, 1);
#pragma omp barrier
        base = 0;
        for (int e = 0; e < experts; e++) {
            const int m = start[e + 1] - start[e];
            if (!m) continue;
            share_by_cost(cost2, part, parts, base, m + MEMORY_ROWS, g2, &lo, &hi);
            base += (int64_t)g2 * (m + MEMORY_ROWS);
            column_groups(h + (int64_t)start[e] * inter, inter, w2 + e * stride2, inter / 32,
                          out + (int64_t)start[e] * hidden, hidden, m, hidden, lo, hi);
        }
#pragma omp barrier
        share(tokens, part, parts, &lo, &hi);
        for (int t = lo; t < hi; t++)
            for (int c = 0; c < hidden; c++) {
                /* combine's roundings: the float32 product to bfloat16, then each bfloat16 sum */
                uint16_t sum = 0;
                for (int s = 0, first = 1; s < k; s++) {
                    const int i = t * k + s;
                    if (at[i] < 0) continue;
                    const uint16_t term = f32_to_bf16(bf16_to_f32(out[(int64_t)at[i] * hidden + c]) * weights[i]);
                    sum = first ? term : f32_to_bf16(bf16_to_f32(sum) + bf16_to_f32(term));
                    first = 0;
                }
                y[(int64_t)t * hidden + c] = sum;
            }
    }
    free(start), free(at), free(row_token), free(next), free(xs), free(gu), free(h), free(out);
    return 0;
}

#else
int moe_dpbf16_available(void) { return 0; }
int moe_dpbf16(const uint16_t *x, int64_t x_stride, const uint16_t *w13, const uint16_t *w2, const int64_t *ids,
               const float *weights, uint16_t *y, int tokens, int k, int experts, int hidden, int inter, int threads) {
    (void)x, (void)x_stride, (void)w13, (void)w2, (void)ids, (void)weights, (void)y, (void)tokens, (void)k,
        (void)experts, (void)hidden, (void)inter, (void)threads;
    return -1;
}
#endif
