/* The (token, slot) pairs of a mixture-of-experts layer sorted by expert, as both MoE kernels (moe.c, moe_bf16.c) and
 * kernels/moe.py group_by_expert order them: stably, so each expert's rows keep the tokens' order. */
#ifndef FASTGEN_MOE_GROUPS_H
#define FASTGEN_MOE_GROUPS_H
#include <stdint.h>

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
#endif
