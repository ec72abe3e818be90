/* The (token, slot) pairs of a mixture-of-experts layer sorted by expert, as both MoE kernels (moe.c, moe_bf16.c) and
 * kernels/moe.py group_by_expert order them: stably, so each expert's rows keep the tokens' order. */
#ifndef FASTGEN_MOE_GROUPS_H
#define FASTGEN_MOE_GROUPS_H
#include <stdint.h>

#include "bf16.h"

/* Pair i (token i / k, slot i % k, expert ids[i]) goes to row at[i] of the sorted order, which holds token
 * row_token[at[i]]; expert e's rows are [start[e], start[e + 1]); a slot of another rank's expert (id = experts)
 * has no row (at[i] = -1). start: experts + 2 zeros; next: experts ints of scratch. Returns the most rows of one
 * expert. */
static inline int group_pairs(const int64_t *ids, int pairs, int k, int experts, int *start, int *at, int *row_token,
                              int *next) {
    int most = 0;
    for (int i = 0; i < pairs; i++) start[ids[i] + 1]++;
    for (int e = 0; e < experts; e++) {
        most = start[e + 1] > most ? start[e + 1] : most;
        start[e + 1] += start[e];
        next[e] = start[e];
    }
    for (int i = 0; i < pairs; i++) {
        at[i] = ids[i] < experts ? next[ids[i]]++ : -1;
        if (at[i] >= 0) row_token[at[i]] = i / k;
    }
    return most;
}

/* y's tokens [lo, hi) = each token's k slot outputs (rows at[t k + s] of out, hidden wide; none where at is -1) scaled
 * by their weights and added slot by slot with moe.combine's bfloat16 roundings: the float32 product to bfloat16,
 * then each bfloat16 sum. */
static inline void combine_bf16(const uint16_t *out, const int *at, const float *weights, uint16_t *y, int lo, int hi,
                                int k, int hidden) {
    for (int t = lo; t < hi; t++)
        for (int c = 0; c < hidden; c++) {
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

/* combine_bf16 in float32, each product and sum rounded on its own: the empty asm hides each result from the
 * optimiser, so products are not contracted into fused multiply-adds nor sums reassociated (the library is built
 * with -fassociative-math). Scalar: moe.c has the vector form for its own panels. */
static inline void combine_f32(const float *out, const int *at, const float *weights, float *y, int lo, int hi, int k,
                               int hidden) {
    for (int t = lo; t < hi; t++)
        for (int c = 0; c < hidden; c++) {
            float sum = 0.f;
            for (int s = 0, first = 1; s < k; s++) {
                const int i = t * k + s;
                if (at[i] < 0) continue;
                float term = out[(int64_t)at[i] * hidden + c] * weights[i];
                __asm__("" : "+x"(term));
                sum = first ? term : sum + term;
                __asm__("" : "+x"(sum));
                first = 0;
            }
            y[(int64_t)t * hidden + c] = sum;
        }
}
#endif
