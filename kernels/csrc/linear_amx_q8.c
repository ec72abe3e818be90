/* Linear layers over GGUF blocks on the matrix engine's int8 products (AMX-INT8), llama.cpp's numerics, for a
 * bfloat16 batch of 5 to a few dozen rows (quant_linear's and decode_layer.c's, from AMX_INT8_MIN_ROWS): y (m, n) =
 * x (m, k) w^T (+ bias), w in its file's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), x rounded to int8 per 32-value block
 * exactly as linear_q8.c rounds it (q8_block.h).
 *
 * Why: past 8 rows linear_q8.c's VNNI loop is bound by its per-row work (two products, a conversion, a scale and an
 * FMA per row, weight row and 4 blocks), and the fused bfloat16 path (linear_quant.c) by dequantizing the whole layer
 * on every call; here one tile product computes 16 rows x 16 weight rows x one 32-value block exactly in int32 from
 * the blocks' own quants, and its scaling costs one conversion and one or two FMAs per row of 16 outputs
 * (benchmarks/cpu_kernels.py --quant-rows-only; kernels/quant.py AMX_INT8_MAX_ROWS has the crossover).
 *
 * The right tile (8 rows of 16 columns x 4 bytes: one block of 16 weight rows) comes from 16 loads, a transpose of
 * dwords and a nibble split: dword r of a row's 16 bytes of nibbles holds weights 4r..4r+3 in its low nibbles and
 * 16+4r.. in its high ones, which are the tile's rows r and r + 4, so x keeps its natural order. Q4_1/Q5_1 quants are
 * unsigned (tdpbsud) and add their offset m dx sum(q) per block; Q4_0/Q5_0 are taken minus their integer offset and
 * Q8_0 as they are, signed (tdpbssd), with no offset term. The group's tiles are built once and serve every 16-row
 * tile of x; the next group's weights are prefetched meanwhile.
 *
 * One order for every output whatever m or the thread count: per block in increasing k, the product term then the
 * offset term, each one FMA in float32; each output is its own (row, column) lane. Threads split the 16-column
 * groups. Built only where the compiler targets AMX-INT8; linear_amx_q8_available() says whether this process may
 * use it (Linux grants the tile state on request). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "entry_points.h"
#include "ggml_blocks.h"
#include "parallel.h"
#include "q8_block.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && defined(__AVX512F__) &&             \
    defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__F16C__)
#define AMX_Q8 1
#include <immintrin.h>

#include "amx.h"
#else
#define AMX_Q8 0
#endif


/* Weights per extra thread below which one thread runs the call. */
#define MIN_WORK_PER_THREAD (1 << 18)

int linear_amx_q8_available(void) {
#if AMX_Q8
    return amx_granted();
#else
    return 0;
#endif
}

#if AMX_Q8
/* Dwords [4 h, 4 h + 4) of 16 rows' 16-byte pieces (row j's at p + j ws) as 4 vectors: vector r holds dword 4 h + r of
 * rows 0-15 in order (a 16 x 4 transpose of dwords: rows into 128-bit lanes, a permute within each vector, then the
 * lanes across the 4). */
static inline __attribute__((always_inline)) void rows_to_columns(const uint8_t *p, int64_t ws, __m512i out[4]) {
    __m512i t[4];
    const __m512i by_dword = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (int j = 0; j < 4; j++) {
        const uint8_t *r = p + 4 * j * ws;
        __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)r));
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(r + ws)), 1);
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(r + 2 * ws)), 2);
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(r + 3 * ws)), 3);
        t[j] = _mm512_permutexvar_epi32(by_dword, z); /* lane r: dword r of rows 4 j .. 4 j + 3 */
    }
    const __m512i u0 = _mm512_shuffle_i32x4(t[0], t[1], 0x44), u1 = _mm512_shuffle_i32x4(t[0], t[1], 0xEE);
    const __m512i v0 = _mm512_shuffle_i32x4(t[2], t[3], 0x44), v1 = _mm512_shuffle_i32x4(t[2], t[3], 0xEE);
    out[0] = _mm512_shuffle_i32x4(u0, v0, 0x88);
    out[1] = _mm512_shuffle_i32x4(u0, v0, 0xDD);
    out[2] = _mm512_shuffle_i32x4(u1, v1, 0x88);
    out[3] = _mm512_shuffle_i32x4(u1, v1, 0xDD);
}

/* Block b of 16 weight rows (w, stride ws) as the right tile (512 bytes: row r, column j: weight row j's values
 * 4r..4r+3), its scales dw and Q4_1/Q5_1's offsets m per column. Q4_0's and Q5_0's quants are taken minus their
 * offset (signed, as Q8_0's), so only the types with a float offset have an offset term. */
static inline __attribute__((always_inline)) void weight_tile(int type, const uint8_t *w, int64_t ws, int b,
                                                              uint8_t *tile, float *dw, float *mw) {
    const int bb = block_bytes(type), at = quants_at(type);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)ws));
    const uint8_t *base = w + (int64_t)b * bb;
    const __m512i head = _mm512_i32gather_epi32(rows, base, 1); /* d (and m) of each row's block */
    _mm512_store_ps(dw, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head)));
    if (type == Q4_1 || type == Q5_1)
        _mm512_store_ps(mw, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16))));
    __m512i v[4];
    rows_to_columns(base + at, ws, v);
    if (type == Q8_0) {
        for (int r = 0; r < 4; r++) _mm512_store_si512((void *)(tile + 64 * r), v[r]);
        rows_to_columns(base + at + 16, ws, v);
        for (int r = 0; r < 4; r++) _mm512_store_si512((void *)(tile + 64 * (r + 4)), v[r]);
        return;
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512i qh = _mm512_setzero_si512();
    if (type == Q5_0 || type == Q5_1) qh = _mm512_i32gather_epi32(rows, base + at - 4, 1);
    for (int r = 0; r < 4; r++) {
        __m512i lo = _mm512_and_si512(v[r], low4), hi = _mm512_and_si512(_mm512_srli_epi16(v[r], 4), low4);
        if (type == Q5_0 || type == Q5_1) { /* qh bit t: value t's fifth bit; 4 bits -> bit 4 of 4 bytes */
            const __m512i spread = _mm512_set1_epi32(0x00204081), ones = _mm512_set1_epi32(0x01010101);
            const __m512i bl = _mm512_and_si512(_mm512_srli_epi32(qh, 4 * r), _mm512_set1_epi32(0xF));
            const __m512i bh = _mm512_and_si512(_mm512_srli_epi32(qh, 16 + 4 * r), _mm512_set1_epi32(0xF));
            lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_mullo_epi32(bl, spread), ones), 4));
            hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_mullo_epi32(bh, spread), ones), 4));
        }
        if (type == Q4_0 || type == Q5_0) { /* signed: q - 8, q - 16 */
            const __m512i offset = _mm512_set1_epi8(type == Q4_0 ? 8 : 16);
            lo = _mm512_sub_epi8(lo, offset), hi = _mm512_sub_epi8(hi, offset);
        }
        _mm512_store_si512((void *)(tile + 64 * r), lo);
        _mm512_store_si512((void *)(tile + 64 * (r + 4)), hi);
    }
}

/* x rows [lo, hi) rounded to int8 per block: quants (row stride k), per row and block dx and dx sum(q). */
static void quantize_rows(const uint16_t *x, int64_t xs, int k, int lo, int hi, int8_t *xq, float *dx, float *sx) {
    const int blocks = k / 32;
    float wide[32];
    for (int i = lo; i < hi; i++)
        for (int b = 0; b < blocks; b++) {
            const uint16_t *xb = x + i * xs + 32 * b;
            for (int h = 0; h < 2; h++) { /* bfloat16 is float32's top half: widening is exact */
                const __m256i half = _mm256_loadu_si256((const __m256i *)(xb + 16 * h));
                const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16);
                _mm512_storeu_ps(wide + 16 * h, _mm512_castsi512_ps(bits));
            }
            int8_t *q = xq + (int64_t)i * k + 32 * b;
            const float d = q8_block(wide, q);
            int sum = 0;
            for (int j = 0; j < 32; j++) sum += q[j];
            dx[(int64_t)i * blocks + b] = d;
            sx[(int64_t)i * blocks + b] = d * (float)sum;
        }
}

/* Blocks whose tile products are stored before they are scaled: the products run back to back, and the scaling reads
 * stores long done (a tile store read back at once stalls). */
#define CHUNK 16

/* acc[i] += row r0 + i's products of blocks b0 .. b0 + nb - 1 (stored in c) scaled by dw dx, + mw sx where offset, for
 * the first `rows` rows (a constant where it is inlined, so acc stays in registers). */
static inline __attribute__((always_inline)) void scale_products(const int32_t *c, const float *dw, const float *mw,
                                                                 const float *dx, const float *sx, int blocks, int r0,
                                                                 int b0, int nb, int offset, __m512 *acc,
                                                                 const int rows) {
    for (int b = b0; b < b0 + nb; b++) {
        const __m512 d = _mm512_load_ps(dw + 16 * b), mb = _mm512_load_ps(mw + 16 * b);
        const int32_t *cb = c + 256 * (b - b0);
#pragma GCC unroll 16
        for (int i = 0; i < rows; i++) {
            const int64_t at = (int64_t)(r0 + i) * blocks + b;
            const __m512 prod = _mm512_cvtepi32_ps(_mm512_load_si512(cb + 16 * i));
            acc[i] = _mm512_fmadd_ps(prod, _mm512_mul_ps(d, _mm512_set1_ps(dx[at])), acc[i]);
            if (offset) acc[i] = _mm512_fmadd_ps(mb, _mm512_set1_ps(sx[at]), acc[i]);
        }
    }
}

/* Output columns 16 g .. 16 g + 15 for every row, w their 16 weight rows: the group's block tiles once, then each
 * 16-row tile of x through them, CHUNK blocks of products at a time, then their scaling. */
static inline __attribute__((always_inline)) void column_group(int type, const uint8_t *w, int64_t ws,
                                                               const float *bias, const int8_t *xq, const float *dx,
                                                               const float *sx, int m, int n, int k, int g,
                                                               uint16_t *y, int64_t ys, uint8_t *tiles, float *dw,
                                                               float *mw, int32_t *c) {
    const int blocks = k / 32, cols = n - 16 * g < 16 ? n - 16 * g : 16, offset = type == Q4_1 || type == Q5_1;
    const int bb = block_bytes(type);
    for (int b = 0; b < blocks; b++) {
        weight_tile(type, w, ws, b, tiles + 512 * b, dw + 16 * b, mw + 16 * b);
        /* the next group's block b on its way while this group's products run (a prefetch does not fault where
         * there is no next group) */
        const uintptr_t next = (uintptr_t)w + (uintptr_t)(16 * ws) + (uintptr_t)b * bb;
        for (int r = 0; r < 16; r++) _mm_prefetch((const char *)(next + (uintptr_t)(r * ws)), _MM_HINT_T0);
    }
    const __mmask16 mask = (__mmask16)((1u << cols) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * g) : _mm512_setzero_ps();
    for (int r0 = 0; r0 < m; r0 += 16) {
        __m512 acc[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (int b0 = 0; b0 < blocks; b0 += CHUNK) {
            const int nb = blocks - b0 < CHUNK ? blocks - b0 : CHUNK;
            for (int b = b0; b < b0 + nb; b++) {
                _tile_loadd(0, xq + (int64_t)r0 * k + 32 * b, k);
                _tile_loadd(1, tiles + 512 * b, 64);
                _tile_zero(2);
                if (type == Q4_1 || type == Q5_1)
                    _tile_dpbsud(2, 0, 1);
                else
                    _tile_dpbssd(2, 0, 1);
                _tile_stored(2, c + 256 * (b - b0), 64);
            }
            /* rows inner: 16 independent sums in flight (one row's blocks in turn would wait on each FMA); a tile of
             * at most 8 live rows scales only those (the scaling, not the tile product, bounds a small batch; a
             * 4-row variant gained nothing: below 5 rows the tiles' making and products bound it) */
            if (m - r0 <= 8)
                scale_products(c, dw, mw, dx, sx, blocks, r0, b0, nb, offset, acc, 8);
            else
                scale_products(c, dw, mw, dx, sx, blocks, r0, b0, nb, offset, acc, 16);
        }
        for (int i = 0; i < 16 && r0 + i < m; i++) {
            const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i], bv));
            _mm256_mask_storeu_epi16(y + (int64_t)(r0 + i) * ys + 16 * g, mask, out);
        }
    }
}

#define TYPE_GROUP(T)                                                                                                  \
    static void group_##T(const uint8_t *w, int64_t ws, const float *bias, const int8_t *xq, const float *dx,        \
                          const float *sx, int m, int n, int k, int g, uint16_t *y, int64_t ys, uint8_t *tiles,      \
                          float *dw, float *mw, int32_t *c) {                                                          \
        column_group(T, w, ws, bias, xq, dx, sx, m, n, k, g, y, ys, tiles, dw, mw, c);                                \
    }
TYPE_GROUP(Q4_0)
TYPE_GROUP(Q4_1)
TYPE_GROUP(Q5_0)
TYPE_GROUP(Q5_1)
TYPE_GROUP(Q8_0)
#undef TYPE_GROUP
#endif

/* y (m rows of stride y_stride, n columns, bfloat16) = x (m, k, bfloat16; row stride x_stride) w^T (+ bias, float32),
 * x rounded to int8 per 32-value block, w n rows of w_stride bytes of `type` blocks. Returns -1 on bad arguments, a
 * type not taken, a build or process without AMX-INT8, or when its buffers cannot be had. */
int linear_amx_q8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, const float *bias,
                       uint16_t *y, int64_t y_stride, int m, int n, int k, int type, int threads) {
#if AMX_Q8
    const int bb = int8_block_bytes(type);
    if (!bb || m <= 0 || n <= 0 || k <= 0 || k % 32 || x_stride < k || w_stride < (int64_t)k / 32 * bb ||
        y_stride < n || !amx_granted())
        return -1;
    typedef void (*group_fn)(const uint8_t *, int64_t, const float *, const int8_t *, const float *, const float *,
                             int, int, int, int, uint16_t *, int64_t, uint8_t *, float *, float *, int32_t *);
    const group_fn group = type == Q4_0   ? group_Q4_0
                           : type == Q4_1 ? group_Q4_1
                           : type == Q5_0 ? group_Q5_0
                           : type == Q5_1 ? group_Q5_1
                                          : group_Q8_0;
    const int blocks = k / 32, padded = (m + 15) / 16 * 16, groups = (n + 15) / 16;
    threads = threads_for(threads, (int64_t)n * k, MIN_WORK_PER_THREAD);
    /* the weight's last group may have fewer than 16 rows: the gathers read rows past n, so a short group takes a
     * copy padded with zero blocks */
    const int short_rows = n % 16;
    const size_t scratch = (size_t)blocks * (512 + 2 * 16 * sizeof(float)) + CHUNK * 256 * sizeof(int32_t);
    int8_t *xq = aligned_alloc(64, ((size_t)padded * k + 63) / 64 * 64);
    float *dx = malloc(sizeof(float) * (size_t)padded * blocks), *sx = malloc(sizeof(float) * (size_t)padded * blocks);
    uint8_t *work = aligned_alloc(64, (scratch * threads + 63) / 64 * 64);
    uint8_t *tail = short_rows ? calloc(16, (size_t)w_stride) : NULL;
    if (!xq || !dx || !sx || !work || (short_rows && !tail)) {
        free(xq), free(dx), free(sx), free(work), free(tail);
        return -1;
    }
    if (short_rows) memcpy(tail, w + (int64_t)(n - short_rows) * w_stride, (size_t)short_rows * w_stride);
    memset(xq + (int64_t)m * k, 0, (size_t)(padded - m) * k);
    for (int i = m; i < padded; i++)
        for (int b = 0; b < blocks; b++) dx[(int64_t)i * blocks + b] = sx[(int64_t)i * blocks + b] = 0.f;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int lo, hi;
        share(m, thread_index(), thread_count(), &lo, &hi);
        quantize_rows(x, x_stride, k, lo, hi, xq, dx, sx);
#pragma omp barrier
        uint8_t *tiles = work + scratch * thread_index();
        float *dw = (float *)(tiles + (size_t)blocks * 512), *mw = dw + 16 * blocks;
        int32_t *c = (int32_t *)(mw + 16 * blocks);
        TileConfig cfg = {0};
        cfg.palette = 1;
        cfg.rows[0] = 16, cfg.colsb[0] = 32; /* x: 16 rows x one block */
        cfg.rows[1] = 8, cfg.colsb[1] = 64;  /* w: one block of 16 weight rows, 4 bytes a column */
        cfg.rows[2] = 16, cfg.colsb[2] = 64; /* 16 x 16 int32 */
        load_tile_config(&cfg);
        share(groups, thread_index(), thread_count(), &lo, &hi);
        for (int g = lo; g < hi; g++) {
            const int last = short_rows && g == groups - 1;
            group(last ? tail : w + (int64_t)16 * g * w_stride, w_stride, bias, xq, dx, sx, m, n, k, g, y, y_stride,
                  tiles, dw, mw, c);
        }
        _tile_release();
    }
    free(xq), free(dx), free(sx), free(work), free(tail);
    return 0;
#else
    (void)x, (void)x_stride, (void)w, (void)w_stride, (void)bias, (void)y, (void)y_stride, (void)m, (void)n, (void)k;
    (void)type, (void)threads;
    return -1;
#endif
}
