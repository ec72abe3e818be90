/* A mixture-of-experts layer in bfloat16 in one call: y (tokens, hidden) = sum over each token's k slots of
 * weight * down_e(SiLU(gate_e x) * up_e x), kernels/moe.py's contract. Two entry points, one per GEMM engine, the
 * dense bfloat16 layers' two: moe_amx_bf16 on the matrix engine (Intel Xeon with AMX; csrc/amx_linear.h, as
 * csrc/linear.c), moe_dpbf16 on AVX-512 BF16 dot products (AMD Zen 4, Zen 5; csrc/linear_dpbf16.c).
 *
 * As moe.c does in float32: the (token, slot) pairs sorted by expert (stably) and their rows of x gathered, so each
 * expert's tokens are one matrix; every expert with tokens runs its gate/up weight (packed as a dense layer's,
 * kernels/packed_bf16.py PackedLinear) over its rows by column groups, then the elementwise kernel's SiLU(gate) * up,
 * then its down weight; an expert no token chose is never read, and each column group is streamed from memory once
 * per call whatever the rows routed to it. Last, each token's k outputs are scaled by their float32 weights, rounded
 * to bfloat16 and added slot by slot, as moe.combine does.
 *
 * Every product is the dense bfloat16 path's on that engine (its linear kernel, silu_mul_bf16, its linear kernel on
 * one token's row), so a token's result is bit for bit what that path and combine give it alone, whatever the batch,
 * its routing or the thread count. Threads split each phase by (expert, column group), weighed by the rows and weight
 * each holds. */
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_linear.h"
#include "bf16.h"
#include "entry_points.h"
#include "moe_groups.h"
#include "parallel.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
/* What streaming one column group's weight costs, in rows computed over it (as moe.c's MEMORY_ROWS): vdpbf16ps
 * computes a row at ~1/16 the cost of reading a group's weight, the matrix engine at ~1/64. */
#define MEMORY_ROWS_DPBF16 16
#define MEMORY_ROWS_AMX 64
#define MIN_WORK_PER_THREAD (1 << 16)

/* One GEMM of the layer for every expert with rows: out rows [start[e], start[e + 1]) (n columns) = the sorted rows
 * in (k columns, contiguous) times expert e's packed weight (w + e * w_stride). Called by every thread of the
 * region. The matrix engine packs each expert's rows into 32-row panels in xp first (expert e's from panel
 * panels[e]), a barrier between. */
static void expert_gemms(Engine engine, const uint16_t *in, int k, const uint16_t *w, int64_t w_stride, uint16_t *out,
                         int n, const int *start, const int *panels, int experts, uint16_t *xp) {
    const int part = thread_index(), parts = thread_count(), nblocks = (n + 15) / 16;
    /* a column group: 4 column blocks for linear_dpbf16.c's kernel, a pair for the matrix engine's */
    const int width = engine == MATRIX_ENGINE ? 2 : 4, groups = (nblocks + width - 1) / width;
    const int memory_rows = engine == MATRIX_ENGINE ? MEMORY_ROWS_AMX : MEMORY_ROWS_DPBF16;
    int lo, hi;
    (void)panels, (void)xp; /* the matrix engine's, which a build without AMX lacks */
#ifdef HAVE_AMX_LINEAR
    if (engine == MATRIX_ENGINE) {
        share(panels[experts], part, parts, &lo, &hi);
        for (int e = 0; e < experts; e++) {
            const int first = lo > panels[e] ? lo : panels[e], last = hi < panels[e + 1] ? hi : panels[e + 1];
            if (first < last)
                pack_rows(in + (int64_t)start[e] * k, k, start[e + 1] - start[e], k, first - panels[e],
                          last - panels[e], xp + (int64_t)panels[e] * 32 * k);
        }
#pragma omp barrier
    }
#endif
    int64_t total = 0, base = 0;
    for (int e = 0; e < experts; e++)
        if (start[e + 1] > start[e]) total += (int64_t)groups * (start[e + 1] - start[e] + memory_rows);
    for (int e = 0; e < experts; e++) {
        const int m = start[e + 1] - start[e];
        if (!m) continue;
        share_by_cost(total, part, parts, base, m + memory_rows, groups, &lo, &hi);
        base += (int64_t)groups * (m + memory_rows);
        const uint16_t *we = w + e * w_stride;
        uint16_t *oe = out + (int64_t)start[e] * n;
#ifdef HAVE_AMX_LINEAR
        if (engine == MATRIX_ENGINE) {
            if (lo < hi)
                column_blocks(xp + (int64_t)panels[e] * 32 * k, we, NULL, oe, n, m, n, k, width * lo,
                              width * hi < nblocks ? width * hi : nblocks);
            continue;
        }
#endif
        for (int g = lo; g < hi; g++) {
            const int nb = width * g, cols = nblocks - nb < width ? nblocks - nb : width;
            dpbf16_column_group(in + (int64_t)start[e] * k, k, we + (int64_t)nb * (k / 32) * 512, k / 32, NULL,
                                oe + 16 * nb, n, m, cols, n - 16 * nb);
        }
    }
}

/* x (tokens, hidden) bfloat16 at row stride x_stride; w13: per expert its gate/up weight (2 inter rows, gate then up)
 * in PackedLinear's tiles; w2: per expert its down weight (hidden rows) likewise; ids, weights (tokens, k); y (tokens,
 * hidden) bfloat16, contiguous; an id equal to `experts` is a slot another rank computes: it adds nothing. hidden and
 * inter multiples of 32. Returns -1 on bad arguments (an expert id out of range included) or without memory. */
static int moe_bf16(Engine engine, const uint16_t *x, int64_t x_stride, const uint16_t *w13, const uint16_t *w2,
                    const int64_t *ids, const float *weights, uint16_t *y, int tokens, int k, int experts, int hidden,
                    int inter, int threads) {
    if (tokens <= 0 || k <= 0 || experts <= 0 || hidden <= 0 || inter <= 0 || x_stride < hidden || hidden % 32 ||
        inter % 32 || !elementwise_available())
        return -1;
    if ((int64_t)tokens * k > INT_MAX) return -1;
    const int pairs = tokens * k;
    for (int i = 0; i < pairs; i++)
        if (ids[i] < 0 || ids[i] > experts) return -1;
    const int64_t stride13 = (int64_t)(2 * inter + 15) / 16 * 16 * hidden, stride2 = (int64_t)(hidden + 15) / 16 * 16 * inter;

    /* the pairs sorted by expert (moe_groups.h) */
    int *start = calloc((size_t)experts + 2, sizeof(int)), *at = malloc(sizeof(int) * pairs);
    int *row_token = malloc(sizeof(int) * pairs), *next = malloc(sizeof(int) * experts);
    int *panels = malloc(sizeof(int) * ((size_t)experts + 1));
    uint16_t *xs = malloc(sizeof(uint16_t) * pairs * hidden), *gu = malloc(sizeof(uint16_t) * pairs * 2 * inter);
    uint16_t *h = malloc(sizeof(uint16_t) * pairs * inter), *out = malloc(sizeof(uint16_t) * pairs * hidden);
    uint16_t *xp = NULL;
    if (start && at && row_token && next && panels) {
        group_pairs(ids, pairs, k, experts, start, at, row_token, next);
        panels[0] = 0;
        for (int e = 0; e < experts; e++) panels[e + 1] = panels[e] + (start[e + 1] - start[e] + 31) / 32;
        /* the matrix engine's panels: each expert's rows rounded up to 32, for x's and then h's width */
        if (engine == MATRIX_ENGINE)
            xp = aligned_alloc(64, 64 + sizeof(uint16_t) * panels[experts] * 32 * (hidden > inter ? hidden : inter));
    }
    if (!(start && at && row_token && next && panels && xs && gu && h && out && (xp || engine != MATRIX_ENGINE))) {
        free(start), free(at), free(row_token), free(next), free(panels), free(xs), free(gu), free(h), free(out);
        free(xp);
        return -1;
    }
    const int rows = start[experts];
    threads = threads_for(threads, (int64_t)pairs * 3 * inter * hidden, MIN_WORK_PER_THREAD);

#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int part = thread_index(), parts = thread_count();
        int lo, hi;
        share(rows, part, parts, &lo, &hi);
        for (int r = lo; r < hi; r++)
            memcpy(xs + (int64_t)r * hidden, x + row_token[r] * x_stride, sizeof(uint16_t) * hidden);
#pragma omp barrier
        expert_gemms(engine, xs, hidden, w13, stride13, gu, 2 * inter, start, panels, experts, xp);
#pragma omp barrier
        share(rows, part, parts, &lo, &hi);
        if (lo < hi) silu_mul_bf16(gu + (int64_t)lo * 2 * inter, h + (int64_t)lo * inter, hi - lo, inter, 2 * inter, 1);
#pragma omp barrier
        expert_gemms(engine, h, inter, w2, stride2, out, hidden, start, panels, experts, xp);
#pragma omp barrier
        share(tokens, part, parts, &lo, &hi);
        combine_bf16(out, at, weights, y, lo, hi, k, hidden);
    }
    free(start), free(at), free(row_token), free(next), free(panels), free(xs), free(gu), free(h), free(out), free(xp);
    return 0;
}

int moe_dpbf16_available(void) { return elementwise_available(); }

int moe_dpbf16(const uint16_t *x, int64_t x_stride, const uint16_t *w13, const uint16_t *w2, const int64_t *ids,
               const float *weights, uint16_t *y, int tokens, int k, int experts, int hidden, int inter, int threads) {
    return moe_bf16(DOT_PRODUCTS, x, x_stride, w13, w2, ids, weights, y, tokens, k, experts, hidden, inter, threads);
}

int moe_amx_bf16_available(void) { return elementwise_available() && amx_usable(); }

int moe_amx_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w13, const uint16_t *w2, const int64_t *ids,
                 const float *weights, uint16_t *y, int tokens, int k, int experts, int hidden, int inter, int threads) {
    if (!amx_usable()) return -1;
    return moe_bf16(MATRIX_ENGINE, x, x_stride, w13, w2, ids, weights, y, tokens, k, experts, hidden, inter, threads);
}

#else
/* Without AVX-512 BF16 neither engine is built: both entry points decline. */
static int declined(const uint16_t *x, int64_t x_stride, const uint16_t *w13, const uint16_t *w2, const int64_t *ids,
                    const float *weights, uint16_t *y, int tokens, int k, int experts, int hidden, int inter,
                    int threads) {
    (void)x, (void)x_stride, (void)w13, (void)w2, (void)ids, (void)weights, (void)y, (void)tokens, (void)k,
        (void)experts, (void)hidden, (void)inter, (void)threads;
    return -1;
}
int moe_dpbf16_available(void) { return 0; }
int moe_dpbf16(const uint16_t *x, int64_t x_stride, const uint16_t *w13, const uint16_t *w2, const int64_t *ids,
               const float *weights, uint16_t *y, int tokens, int k, int experts, int hidden, int inter, int threads) {
    return declined(x, x_stride, w13, w2, ids, weights, y, tokens, k, experts, hidden, inter, threads);
}
int moe_amx_bf16_available(void) { return 0; }
int moe_amx_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w13, const uint16_t *w2, const int64_t *ids,
                 const float *weights, uint16_t *y, int tokens, int k, int experts, int hidden, int inter, int threads) {
    return declined(x, x_stride, w13, w2, ids, weights, y, tokens, k, experts, hidden, inter, threads);
}
#endif
