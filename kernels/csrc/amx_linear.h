/* The matrix engine's (AMX) bfloat16 GEMM pieces that csrc/linear.c's layers and csrc/moe_bf16.c's experts share:
 * x's rows packed into 32 x 32 panels, and column blocks of a packed weight (kernels/packed_bf16.py PackedLinear's
 * tiles) over every packed row. A row's outputs do not depend on the other rows: each is its own tile row's float32
 * sums over the 32-deep blocks in order, rounded to bfloat16 once, so a token gives the same bits alone or in a
 * batch, in a dense layer or an expert's group.
 *
 * Tiles: 0-3 accumulate (2 row tiles x 2 column tiles, 16 x 16 float32 each), 4-5 hold x (16 rows x 32), 6-7
 * the weight. k must be a multiple of 32 (the callers check). */
#ifndef FASTGEN_AMX_LINEAR_H
#define FASTGEN_AMX_LINEAR_H
#include <stdint.h>

/* The two GEMM engines of the dense bfloat16 layers, which the kernels built on them (experts, quantized prompts)
 * follow: AVX-512 BF16 dot products (csrc/linear_dpbf16.c) and the matrix engine (below, as csrc/linear.c). */
typedef enum { DOT_PRODUCTS, MATRIX_ENGINE } Engine;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_AMX_LINEAR 1
#include <immintrin.h>

#include "amx.h"

/* 1 where this build has the matrix engine's code and Linux granted this process the tile state. */
static inline int amx_usable(void) { return amx_granted(); }

/* Columns of the weight per pass over x: their tiles (AMX_CHUNK x 16 x k bf16) stay in L2 while every 32-row block of x
 * goes through them, so the weight is read from memory once whatever m is. */
#define AMX_CHUNK 16

/* Row blocks [first, last) of x (m, k) at row stride x_stride -> xp: per 32-row block and 32-deep block one 32 x 32
 * bf16 panel, rows past m zero, so each left-operand tile is 16 contiguous rows of 64 bytes. */
static inline void pack_rows(const uint16_t *x, int64_t x_stride, int m, int k, int first, int last, uint16_t *xp) {
    const int kblocks = k / 32;
    for (int r0 = 32 * first; r0 < 32 * last; r0 += 32)
        for (int kb = 0; kb < kblocks; kb++) {
            uint16_t *panel = xp + ((int64_t)(r0 / 32) * kblocks + kb) * 1024;
            for (int i = 0; i < 32; i++) {
                __m512i row = r0 + i < m ? _mm512_loadu_si512(x + (int64_t)(r0 + i) * x_stride + 32 * kb)
                                         : _mm512_setzero_si512();
                _mm512_store_si512(panel + 32 * i, row);
            }
        }
}

/* The accumulators of up to 32 rows x 32 columns (float32, stride 32) -> y rows, + bias, as bfloat16. */
static inline void write_rows(const float *c, int rows, int cols, const uint16_t *bias, uint16_t *y,
                              int64_t y_stride) {
    __mmask32 mask = cols >= 32 ? 0xffffffffu : (1u << cols) - 1;
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        __m512i wide = _mm512_maskz_loadu_epi16(mask, bias);
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(wide)), 16));
        b1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(wide, 1)), 16));
    }
    for (int i = 0; i < rows; i++) {
        __m512bh out = _mm512_cvtne2ps_pbh(_mm512_add_ps(_mm512_load_ps(c + 32 * i + 16), b1),
                                           _mm512_add_ps(_mm512_load_ps(c + 32 * i), b0));
        _mm512_mask_storeu_epi16(y + (int64_t)i * y_stride, mask, (__m512i)out);
    }
}

/* Column blocks [first, last) of y for every row: this thread's share. xp is x packed by pack_rows. */
static inline void column_blocks(const uint16_t *xp, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                                 int64_t y_stride, int m, int n, int k, int first, int last) {
    const int kblocks = k / 32, rblocks = (m + 31) / 32;
    const int64_t column_elems = (int64_t)kblocks * 512; /* one 16-column block of the weight */
    float c[32 * 32] __attribute__((aligned(64)));
    TileConfig cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    load_tile_config(&cfg);
    for (int n0 = first; n0 < last; n0 += AMX_CHUNK)
        for (int rb = 0; rb < rblocks; rb++) {
            const int r0 = 32 * rb, rows = m - r0 < 32 ? m - r0 : 32, two = rows > 16;
            const uint16_t *a = xp + (int64_t)rb * kblocks * 1024;
            for (int nb = n0; nb < n0 + AMX_CHUNK && nb < last; nb += 2) {
                const int pair = last - nb >= 2; /* a second column tile */
                const uint16_t *w0 = packed + nb * column_elems, *w1 = w0 + column_elems;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int kb = 0; kb < kblocks; kb++) {
                    _tile_loadd(4, a + kb * 1024, 64);
                    _tile_loadd(6, w0 + kb * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (pair) {
                        _tile_loadd(7, w1 + kb * 512, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (two) {
                        _tile_loadd(5, a + kb * 1024 + 512, 64);
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
}

#else
static inline int amx_usable(void) { return 0; }
#endif
#endif
