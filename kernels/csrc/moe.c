/* A mixture-of-experts layer in float32 in one call (kernels/moe.py holds the contract): y (tokens, hidden) = sum over
 * each token's k slots of weight * down_e(SiLU(gate_e x) * up_e x).
 *
 * The (token, slot) pairs are sorted by expert (stably, as moe.group_by_expert) and their rows of x gathered, so each
 * expert's tokens are one matrix. Then, on linear_f32.h's micro-kernels and packed panels: every expert with tokens
 * runs its gate/up panels over its rows, SiLU(gate) * up stored as they finish (gate and up packed side by side, as
 * pack_f32_gate_up packs them), then its down panels over those; an expert no token chose is never read. Each panel
 * is streamed from memory once per call whatever the number of rows routed to its expert (the decode path for up to
 * MR rows, the blocked one, keeping panel groups in L2 across all rows, above). Last, each token's k outputs are
 * scaled by their weights and added slot by slot, each product and sum rounded on its own, as moe.combine does.
 *
 * Every output sums in linear_f32's order, so a token's result is what the dense float32 path (linear_f32_silu_mul,
 * linear_f32, then combine) gives it alone, bit for bit, whatever the batch, its routing or the thread count.
 * With AVX2 only, where gate/up cannot be fused on store (linear_f32.c says why), the gate and up sums go to a
 * scratch and a scalar SiLU follows on the same thread: the sums are the same bits, SiLU within a few ulp of torch's.
 *
 * Threads split each phase by (expert, block of output panels), the blocks sized by the work each holds (rows and
 * weight streamed), so a decode step of a token or a few, whose work is a few experts' weights, keeps every core
 * busy. bfloat16 is not built here: the only bf16 GEMM kernel (linear.c) needs AMX, which most CPUs lack, and
 * elsewhere oneDNN per expert is what the torch reference already runs; kernels/cpu_moe.py leaves bf16 to it. */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linear_f32.h"
#include "moe_groups.h"

#ifdef LINEAR_F32_KERNELS
/* What streaming one panel's weight from memory costs, in rows of multiply-adds over it: the part of a panel's work
 * that does not shrink with its rows, when weighing experts of few and of many tokens against each other. */
#define MEMORY_ROWS 16

#if GATED
static inline v16 v16_mul_exact(v16 a, v16 b) { return _mm512_mul_round_ps(a, b, EXACT); }
static inline v16 v16_add_exact(v16 a, v16 b) { return _mm512_add_round_ps(a, b, EXACT); }
#else
/* The empty asm hides each result from the optimiser: the products are not contracted into fused multiply-adds and
 * the sums not reassociated (the library is built with -fassociative-math), so every rounding is combine's. */
static inline v16 v16_mul_exact(v16 a, v16 b) {
    v16 r = {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
    __asm__("" : "+x"(r.lo), "+x"(r.hi));
    return r;
}
static inline v16 v16_add_exact(v16 a, v16 b) {
    v16 r = {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
    __asm__("" : "+x"(r.lo), "+x"(r.hi));
    return r;
}

/* h = silu(gate) * up for gated panels [lo, hi) of rows whose gate and up sums lie in gu as the panels hold them
 * (per panel 16 gate then 16 up columns). */
static void silu_mul_panels(const float *gu, int64_t gu_stride, float *h, int64_t h_stride, int m, int inter, int lo,
                            int hi) {
    const int c1 = 16 * hi < inter ? 16 * hi : inter;
    for (int i = 0; i < m; i++)
        for (int c = 16 * lo; c < c1; c++) {
            const float *sums = gu + i * gu_stride + 32 * (c / 16) + c % 16; /* gate, and 16 further on up */
            h[i * h_stride + c] = sums[0] / (1.f + expf(-sums[0])) * sums[16];
        }
}
#endif

int moe_f32_available(void) { return 1; }

/* x (tokens, hidden) at row stride x_stride; w13: per expert ceil(inter / 16) gated panels of hidden steps (cpu_moe.py
 * pack_experts); w2: per expert ceil(hidden / 32) panels of inter steps; ids, weights (tokens, k); y (tokens, hidden),
 * contiguous; an id equal to `experts` is a slot another rank computes (expert parallelism): it adds nothing. Returns
 * -1 on bad arguments (an expert id out of range included) or when memory cannot be had. */
int moe_f32(const float *x, int64_t x_stride, const float *w13, const float *w2, const int64_t *ids,
            const float *weights, float *y, int tokens, int k, int experts, int hidden, int inter, int threads) {
    if (tokens <= 0 || k <= 0 || experts <= 0 || hidden <= 0 || inter <= 0 || x_stride < hidden) return -1;
    if ((int64_t)tokens * k > INT_MAX) return -1;
    const int pairs = tokens * k, p13 = (inter + NP / 2 - 1) / (NP / 2), p2 = (hidden + NP - 1) / NP;
    for (int i = 0; i < pairs; i++)
        if (ids[i] < 0 || ids[i] > experts) return -1;

    /* the pairs sorted by expert (moe_groups.h) */
    int *start = calloc((size_t)experts + 2, sizeof(int)), *at = malloc(sizeof(int) * pairs);
    int *row_token = malloc(sizeof(int) * pairs), *next = malloc(sizeof(int) * experts);
    float *xs = malloc(sizeof(float) * pairs * hidden), *h = malloc(sizeof(float) * pairs * inter);
    float *out = malloc(sizeof(float) * pairs * hidden);
    /* Per thread, the sums between k blocks of a gated panel group (AVX-512), or every row's gate/up sums (AVX2). */
    float *scratch = 0;
    int most = 0, failed = !(start && at && row_token && next && xs && h && out);
    if (!failed) {
        most = group_pairs(ids, pairs, k, experts, start, at, row_token, next);
    }
    threads = threads_for(threads, (int64_t)pairs * 3 * inter * hidden, MIN_WORK_PER_THREAD);
#if GATED
    const int64_t scratch_floats = most > MR && hidden > KC ? (int64_t)most * NB * NP : 0;
#else
    const int64_t gu_stride = (int64_t)p13 * NP, scratch_floats = (int64_t)most * gu_stride;
#endif
    if (!failed && scratch_floats) failed = !(scratch = malloc(sizeof(float) * scratch_floats * threads));
    if (failed) {
        free(start), free(at), free(row_token), free(next), free(xs), free(h), free(out), free(scratch);
        return -1;
    }

    /* Each phase's cost: per expert with tokens, its panels times (its rows + what streaming a panel costs). */
    int64_t cost13 = 0, cost2 = 0;
    for (int e = 0; e < experts; e++) {
        const int m = start[e + 1] - start[e];
        if (m) cost13 += (int64_t)p13 * (m + MEMORY_ROWS), cost2 += (int64_t)p2 * (m + MEMORY_ROWS);
    }

#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int part = thread_index(), parts = thread_count();
        float *mine = scratch ? scratch + scratch_floats * part : 0;
        int lo, hi;
        share(start[experts], part, parts, &lo, &hi);
        for (int r = lo; r < hi; r++)
            memcpy(xs + (int64_t)r * hidden, x + row_token[r] * x_stride, sizeof(float) * hidden);
#pragma omp barrier
        int64_t base = 0;
        for (int e = 0; e < experts; e++) {
            const int m = start[e + 1] - start[e];
            if (!m) continue;
            share_by_cost(cost13, part, parts, base, m + MEMORY_ROWS, p13, &lo, &hi);
            base += (int64_t)p13 * (m + MEMORY_ROWS);
            if (lo == hi) continue;
            const float *xe = xs + (int64_t)start[e] * hidden, *we = w13 + (int64_t)e * p13 * hidden * NP;
            float *he = h + (int64_t)start[e] * inter;
#if GATED
            if (m <= MR) decode_panels(xe, hidden, we, 0, 0, 0, m, inter, hidden, lo, hi, he, inter);
            else blocked_panels(xe, hidden, we, 0, mine, NB * NP, m, inter, hidden, lo, hi, he, inter);
#else
            /* The gated panels as plain ones: 32 sums each, 16 gate then 16 up. */
            if (m <= MR) decode_panels(xe, hidden, we, 0, mine, gu_stride, m, gu_stride, hidden, lo, hi, 0, 0);
            else blocked_panels(xe, hidden, we, 0, mine, gu_stride, m, gu_stride, hidden, lo, hi, 0, 0);
            silu_mul_panels(mine, gu_stride, he, inter, m, inter, lo, hi);
#endif
        }
#pragma omp barrier
        base = 0;
        for (int e = 0; e < experts; e++) {
            const int m = start[e + 1] - start[e];
            if (!m) continue;
            share_by_cost(cost2, part, parts, base, m + MEMORY_ROWS, p2, &lo, &hi);
            base += (int64_t)p2 * (m + MEMORY_ROWS);
            if (lo == hi) continue;
            const float *he = h + (int64_t)start[e] * inter, *we = w2 + (int64_t)e * p2 * inter * NP;
            float *oe = out + (int64_t)start[e] * hidden;
            if (m <= MR) decode_panels(he, inter, we, 0, oe, hidden, m, hidden, inter, lo, hi, 0, 0);
            else blocked_panels(he, inter, we, 0, oe, hidden, m, hidden, inter, lo, hi, 0, 0);
        }
#pragma omp barrier
        share(tokens, part, parts, &lo, &hi);
        for (int t = lo; t < hi; t++)
            for (int c = 0; c < hidden; c += 16) {
                const m16 mask = hidden - c >= 16 ? (m16)0xFFFF : (m16)((1u << (hidden - c)) - 1);
                v16 sum = v16_zero();
                for (int s = 0, first = 1; s < k; s++) {
                    const int i = t * k + s;
                    if (at[i] < 0) continue;
                    const v16 term = v16_mul_exact(v16_load_masked(mask, out + (int64_t)at[i] * hidden + c),
                                                   v16_set1(weights[i]));
                    sum = first ? term : v16_add_exact(sum, term);
                    first = 0;
                }
                v16_store_masked(y + (int64_t)t * hidden + c, mask, sum);
            }
    }
    free(start), free(at), free(row_token), free(next), free(xs), free(h), free(out), free(scratch);
    return 0;
}

#else
int moe_f32_available(void) { return 0; }
int moe_f32(const float *x, int64_t x_stride, const float *w13, const float *w2, const int64_t *ids,
            const float *weights, float *y, int tokens, int k, int experts, int hidden, int inter, int threads) {
    (void)x, (void)x_stride, (void)w13, (void)w2, (void)ids, (void)weights, (void)y, (void)tokens, (void)k,
        (void)experts, (void)hidden, (void)inter, (void)threads;
    return -1;
}
#endif
