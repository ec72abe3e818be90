/* Linear layers on the CPU's matrix engine (AMX), bfloat16: y (m, n) = x (m, k) w^T (+ bias), float32
 * accumulation, rounded to bfloat16 once at the end. Built with the other CPU kernels by kernels/cpu.py.
 *
 * Why not oneDNN: at decode sizes (a few to a few dozen rows) a layer is bound by reading its weight, and oneDNN
 * streams a weight at ~3/4 of the bandwidth one core gets. Here the weight is packed once, at load, into the order
 * the kernel reads it (kernels/cpu.py pack_linear): per 16-column block nb and 32-deep block kb one 16 x 16-dword
 * tile, dword c of row r = (w[16 nb + c][32 kb + 2 r], w[16 nb + c][32 kb + 2 r + 1]), the tiles of a column block
 * consecutive. A pass over the weight is then sequential reads that the hardware prefetcher follows (software
 * prefetching measured no better, or worse). At prefill sizes the kernel keeps up with oneDNN: x is packed once
 * into 32 x 32 panels, and AMX_CHUNK column blocks of the weight stay in L2 while every 32-row block goes through
 * them (csrc/amx_linear.h, which csrc/moe_bf16.c's experts share).
 *
 * With several threads, each packs a share of x's row blocks and then computes a share of the column blocks (the
 * weight is read once in all, each part by one thread).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#include "amx_linear.h"
#include "parallel.h"

/* Column pairs per extra thread below which one thread does the whole layer. */
#define MIN_PAIRS_PER_THREAD 4

int linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                int64_t y_stride, int m, int n, int k, int threads) {
    if (k % 32 || k <= 0 || m <= 0 || n <= 0 || !amx_granted()) return -1;
    const int nblocks = (n + 15) / 16, rblocks = (m + 31) / 32, pairs = (nblocks + 1) / 2;
    uint16_t *xp = aligned_alloc(64, sizeof(uint16_t) * rblocks * 32 * k);
    if (!xp) return -1;
    threads = threads_for(threads, pairs, MIN_PAIRS_PER_THREAD);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int lo, hi;
        share(rblocks, thread_index(), thread_count(), &lo, &hi);
        pack_rows(x, x_stride, m, k, lo, hi, xp);
#pragma omp barrier
        share(pairs, thread_index(), thread_count(), &lo, &hi);
        if (lo < hi) column_blocks(xp, packed, bias, y, y_stride, m, n, k, 2 * lo, 2 * hi < nblocks ? 2 * hi : nblocks);
    }
    free(xp);
    return 0;
}

#else
int linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                int64_t y_stride, int m, int n, int k, int threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)y, (void)y_stride, (void)m, (void)n, (void)k, (void)threads;
    return -1;
}
#endif
