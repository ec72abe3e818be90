/* Linear layers by AVX-512 BF16 dot products (vdpbf16ps), for CPUs that have them and no matrix engine (AMD Zen 4
 * and 5): y (m, n) = x (m, k) w^T (+ bias), float32 accumulation, rounded to bfloat16 once at the end.
 *
 * Why not oneDNN: a decode step reads every weight once for a few rows, and oneDNN's packed bfloat16 GEMV streams
 * it at about 70% of the host's read bandwidth (Zen 5, 2026-12-05). The weight here is in the AMX kernel's packed
 * order (kernels/cpu.py PackedLinear): per 16-column block nb and 32-deep block kb, 16 rows of 16 dwords, dword c of
 * row r = (w[16 nb + c][32 kb + 2 r], w[16 nb + c][32 kb + 2 r + 1]), the blocks of a column block consecutive.
 * Each 64-byte row is one vdpbf16ps operand against x's pair (32 kb + 2 r) broadcast: the weight is read in order,
 * once per row block of x, by as many sequential streams as a call has column blocks.
 *
 * A call computes up to ROWS rows x COLS column blocks in registers (24 accumulators); over more rows the COLS
 * column blocks (COLS x 32 k bytes) stay in L2 while every row block goes through them, so the weight is read from
 * memory once whatever m is. Threads split the column groups; each output is one fixed chain of dot products in k
 * order, so a row's result does not depend on the rows beside it or the thread count.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "entry_points.h"
#include "parallel.h"
#include "vector_math.h"

#define ROWS 6
#define COLS 4

/* rows x cols blocks of y from rows of x and cols consecutive 16-column blocks of the packed weight; `valid` of the
 * cols x 16 columns exist (the last block may be partial). */
static inline __attribute__((always_inline)) void block(const uint16_t *x, int64_t x_stride, const uint16_t *w,
                                                         int64_t column_elems, int kblocks, const uint16_t *bias,
                                                         uint16_t *y, int64_t y_stride, int valid, const int rows,
                                                         const int cols) {
    __m512 acc[ROWS][COLS];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) acc[i][j] = _mm512_setzero_ps();
    for (int kb = 0; kb < kblocks; kb++) {
        const uint16_t *t = w + (int64_t)kb * 512;
        const uint16_t *xk = x + 32 * kb;
        for (int r = 0; r < 16; r++) {
            __m512bh wv[COLS];
            for (int j = 0; j < cols; j++) wv[j] = (__m512bh)_mm512_loadu_si512(t + j * column_elems + 32 * r);
            for (int i = 0; i < rows; i++) {
                int32_t pair;
                memcpy(&pair, xk + i * x_stride + 2 * r, sizeof pair);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
                for (int j = 0; j < cols; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
            }
        }
    }
    for (int j = 0; j < cols; j++) {
        const int left = valid - 16 * j;
        const __mmask16 mask = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
        const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + 16 * j)), 16))
                              : _mm512_setzero_ps();
        for (int i = 0; i < rows; i++)
            _mm256_mask_storeu_epi16(y + i * y_stride + 16 * j, mask,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b)));
    }
}

typedef void (*BlockFn)(const uint16_t *, int64_t, const uint16_t *, int64_t, int, const uint16_t *, uint16_t *,
                        int64_t, int);

#define BLOCK(R, C)                                                                                                  \
    static void block_##R##_##C(const uint16_t *x, int64_t xs, const uint16_t *w, int64_t ce, int kb,                \
                                const uint16_t *bias, uint16_t *y, int64_t ys, int valid) {                          \
        block(x, xs, w, ce, kb, bias, y, ys, valid, R, C);                                                           \
    }
#define BLOCKS_OF(R) BLOCK(R, 1) BLOCK(R, 2) BLOCK(R, 3) BLOCK(R, 4)
BLOCKS_OF(1)
BLOCKS_OF(2)
BLOCKS_OF(3)
BLOCKS_OF(4)
BLOCKS_OF(5)
BLOCKS_OF(6)
#define ROW_OF(R) {block_##R##_1, block_##R##_2, block_##R##_3, block_##R##_4}
static const BlockFn BLOCKS[ROWS][COLS] = {ROW_OF(1), ROW_OF(2), ROW_OF(3), ROW_OF(4), ROW_OF(5), ROW_OF(6)};

/* Rows [0, m) of y for one column group: cols (at most COLS) 16-column blocks of packed tiles, `valid` columns. */
void dpbf16_column_group(const uint16_t *x, int64_t x_stride, const uint16_t *tiles, int kblocks, const uint16_t *bias,
                         uint16_t *y, int64_t y_stride, int m, int cols, int valid) {
    for (int r0 = 0; r0 < m; r0 += ROWS) {
        const int rows = m - r0 < ROWS ? m - r0 : ROWS;
        BLOCKS[rows - 1][cols - 1](x + (int64_t)r0 * x_stride, x_stride, tiles, (int64_t)kblocks * 512, kblocks, bias,
                                   y + (int64_t)r0 * y_stride, y_stride, valid);
    }
}

/* n (at most 16 COLS) weight rows (bfloat16, row stride `stride`, k a multiple of 32) -> their packed tiles, rows
 * past n zero: one 16 x 16 transpose of dwords (weight pairs) per tile. */
void dpbf16_pack_rows(const uint16_t *w, int64_t stride, int n, int k, uint16_t *tiles) {
    const int kblocks = k / 32;
    for (int nb = 0; 16 * nb < n; nb++)
        for (int kb = 0; kb < kblocks; kb++) {
            __m512 r[16];
            for (int c = 0; c < 16; c++)
                r[c] = 16 * nb + c < n ? _mm512_loadu_ps(w + (16 * nb + c) * stride + 32 * kb) : _mm512_setzero_ps();
            transpose16_ps(r);
            for (int row = 0; row < 16; row++)
                _mm512_store_ps(tiles + ((int64_t)nb * kblocks + kb) * 512 + 32 * row, r[row]);
        }
}

/* Column groups per extra thread below which one thread does the whole layer. */
#define MIN_GROUPS_PER_THREAD 2

int linear_dpbf16_available(void) { return 1; }

int linear_dpbf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                  int64_t y_stride, int m, int n, int k, int threads) {
    if (k % 32 || k <= 0 || m <= 0 || n <= 0) return -1;
    const int kblocks = k / 32, nblocks = (n + 15) / 16, groups = (nblocks + COLS - 1) / COLS;
    const int64_t column_elems = (int64_t)kblocks * 512;
    threads = threads_for(threads, groups, MIN_GROUPS_PER_THREAD);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int lo, hi;
        share(groups, thread_index(), thread_count(), &lo, &hi);
        for (int g = lo; g < hi; g++) {
            const int nb = COLS * g, cols = nblocks - nb < COLS ? nblocks - nb : COLS;
            dpbf16_column_group(x, x_stride, packed + nb * column_elems, kblocks, bias ? bias + 16 * nb : NULL,
                                y + 16 * nb, y_stride, m, cols, n - 16 * nb);
        }
    }
    return 0;
}

#else
void dpbf16_column_group(const uint16_t *x, int64_t x_stride, const uint16_t *tiles, int kblocks, const uint16_t *bias,
                         uint16_t *y, int64_t y_stride, int m, int cols, int valid) {
    (void)x, (void)x_stride, (void)tiles, (void)kblocks, (void)bias, (void)y, (void)y_stride, (void)m, (void)cols,
        (void)valid;
}

void dpbf16_pack_rows(const uint16_t *w, int64_t stride, int n, int k, uint16_t *tiles) {
    (void)w, (void)stride, (void)n, (void)k, (void)tiles;
}

int linear_dpbf16_available(void) { return 0; }

int linear_dpbf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                  int64_t y_stride, int m, int n, int k, int threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)y, (void)y_stride, (void)m, (void)n, (void)k, (void)threads;
    return -1;
}
#endif
