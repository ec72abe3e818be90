/* How the CPU kernels address the paged KV cache: (num_blocks, block_size, kv_heads, head_dim) per layer. */
#ifndef FASTGEN_PAGED_CACHE_H
#define FASTGEN_PAGED_CACHE_H
#include <stdint.h>

/* Where one sequence (and one KV head, or all of them) reads its cache: element offset of token t is
 * table[p / block_size] * block_size + p % block_size rows of token_stride elements, plus head_offset, where
 * p = first + t: a walk that skips the first `first` tokens (those before a sliding window) counts from there. */
typedef struct {
    const int32_t *table;
    int64_t token_stride, head_offset;
    int block_size;
    int first;
} CacheWalk;

static inline int64_t token_offset(const CacheWalk *w, int t) {
    t += w->first;
    int b = t / w->block_size;
    return ((int64_t)w->table[b] * w->block_size + t % w->block_size) * w->token_stride + w->head_offset;
}

#endif
