/* Linear layers on the CPU's matrix engine (AMX), bfloat16: y (m, n) = x (m, k) w^T (+ bias), float32
 * accumulation, rounded to bfloat16 once at the end. Built with the other CPU kernels by kernels/cpu.py.
 *
 * Why not oneDNN: at decode sizes (a few to a few dozen rows) a layer is bound by reading its weight, and oneDNN
 * streams a weight at about half the memory bandwidth one core gets. Here the weight is packed once, at load,
 * into the order the kernel reads it (kernels/cpu.py pack_linear): per 16-column block nb and 32-deep block kb one
 * 16 x 16-dword tile, dword c of row r = (w[16 nb + c][32 kb + 2 r], w[16 nb + c][32 kb + 2 r + 1]), tiles of a
 * column block consecutive. A pass over the weight is then two sequential reads that the hardware prefetcher
 * follows (software prefetching measured no better, or worse).
 *
 * Tiles: 0-3 accumulate (2 row tiles x 2 column tiles, 16 x 16 float32 each), 4-5 hold x (16 rows x 32), 6-7
 * the weight. Rows past m are padded through a zeroed copy; k must be a multiple of 32 (the caller checks).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#include "amx.h"

/* The accumulators of up to 32 rows x 32 columns (float32, stride 32) -> y rows, + bias, as bfloat16. */
static void write_rows(const float *c, int rows, int cols, const uint16_t *bias, uint16_t *y, int64_t y_stride) {
    __m512 b[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int h = 0; h < 2 && bias; h++) {
        __mmask16 mask = cols - 16 * h >= 16 ? 0xffff : cols - 16 * h <= 0 ? 0 : (__mmask16)((1u << (cols - 16 * h)) - 1);
        b[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + 16 * h)), 16));
    }
    for (int i = 0; i < rows; i++)
        for (int h = 0; h < 2; h++) {
            int left = cols - 16 * h;
            if (left <= 0) break;
            __mmask16 mask = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + 32 * i + 16 * h), b[h]));
            _mm256_mask_storeu_epi16(y + (int64_t)i * y_stride + 16 * h, mask, (__m256i)out);
        }
}

int linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                int64_t y_stride, int m, int n, int k) {
    if (k % 32 || k <= 0 || m <= 0 || n <= 0 || !amx_granted()) return -1;
    const int kblocks = k / 32, nblocks = (n + 15) / 16;
    const int64_t tile_elems = 512, column_elems = (int64_t)kblocks * tile_elems; /* one 16-column block */
    uint16_t *pad = aligned_alloc(64, sizeof(uint16_t) * 32 * k);
    float *c = aligned_alloc(64, sizeof(float) * 32 * 32);
    if (!pad || !c) {
        free(pad);
        free(c);
        return -1;
    }
    const int tail = m % 32; /* rows of the last, partial 32-row block: read from a zero-padded copy */
    memset(pad, 0, sizeof(uint16_t) * 32 * k);
    for (int i = 0; i < tail; i++) memcpy(pad + (int64_t)i * k, x + (int64_t)(m - tail + i) * x_stride, sizeof(uint16_t) * k);
    TileConfig cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    load_tile_config(&cfg);
    for (int nb = 0; nb < nblocks; nb += 2) {
        const int pair = nblocks - nb >= 2; /* a second column tile */
        const uint16_t *w0 = packed + nb * column_elems, *w1 = w0 + column_elems;
        for (int r0 = 0; r0 < m; r0 += 32) {
            const int rows = m - r0 < 32 ? m - r0 : 32, two = rows > 16;
            const int padded = rows < 32; /* the last rows, copied once into pad */
            const uint16_t *a = padded ? pad : x + (int64_t)r0 * x_stride;
            const int64_t stride = padded ? k : x_stride;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int kb = 0; kb < kblocks; kb++) {
                _tile_loadd(4, a + 32 * kb, stride * 2);
                _tile_loadd(6, w0 + kb * tile_elems, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (pair) {
                    _tile_loadd(7, w1 + kb * tile_elems, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two) {
                    _tile_loadd(5, a + 16 * stride + 32 * kb, stride * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    if (pair) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c, 128);
            _tile_stored(1, c + 16, 128);
            _tile_stored(2, c + 16 * 32, 128);
            _tile_stored(3, c + 16 * 32 + 16, 128);
            const int cols = n - 16 * nb < 32 ? n - 16 * nb : 32;
            write_rows(c, rows, cols, bias ? bias + 16 * nb : NULL, y + (int64_t)r0 * y_stride + 16 * nb, y_stride);
        }
    }
    _tile_release();
    free(pad);
    free(c);
    return 0;
}

#else
int linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                int64_t y_stride, int m, int n, int k) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)y, (void)y_stride, (void)m, (void)n, (void)k;
    return -1;
}
#endif
