/* The LoRA delta of every adapter in a step (punica's SGMV shape) in one call per layer part: kernels/lora.py's
 * contract, y[rows of each segment] += (x[rows] a[slot]^T) b[slot]^T. The torch version spends four small ops per
 * adapter per part (a gather, two matrix multiplies, a scatter-add); here every segment of the step is done in one
 * call, its delta added straight into y (no other output is written).
 *
 * bfloat16 on CPUs with AMX (fan_in a multiple of 32): both products on the matrix engine, in two phases over the
 * segments' 16-row blocks, shared among the threads.
 * - shrink: s = x A^T (16 rows x rank) per block, float32 accumulation; x's rows are read in place when a block's 16
 *   rows are consecutive (prompt chunks), else gathered. A and B are read in tile order: as kernels/cpu_lora.py keeps
 *   them beside the slots (dtype 2: tiled once per adapter load), else packed here per call, each slot's A once per
 *   thread and B 64 columns at a time as a thread first needs them (dtype 1: the contract's layouts alone).
 * - s is split into two bfloat16 parts, s = hi + lo (hi = s rounded, lo = the rest rounded): the expand multiplies
 *   both by B, so the shrunk vector keeps about 16 bits of mantissa (as close to float32 as the delta needs) at one
 *   more tile product per output tile.
 * - expand: y[rows] += (hi + lo) B^T per block and 64 output columns; y is read, and rounded to bfloat16 (to nearest
 *   even), once.
 * Every element comes from the same tile products in the same order wherever its row sits in the batch, whatever the
 * other rows and the thread count.
 *
 * Otherwise (float32; no AMX; fan_in not a multiple of 32) each adapted row is one pass over its adapter's A and B,
 * rows shared among the threads: the shrunk vector and each output's sum in float32, y rounded once; bfloat16 rows
 * in 16-lane vectors where there is AVX-512 (8 ranks' dot products at once, b transposed 16 outputs at a time): on a
 * Zen 4, 4 adapters cost 23% of the base's throughput against 29% with the scalar loops. A row's result
 * does not depend on the other rows or on the thread count on either path. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "parallel.h"

/* The longest rank a slot may hold (the row kernel's shrunk vector lives on its stack). */
#define MAX_RANK 256
/* Multiply-adds per extra thread below which one thread does it all (the row kernel). */
#define MIN_WORK_PER_THREAD (1 << 15)

/* One adapted row: shrunk = x A^T (rank), then y += shrunk B^T. T is float or uint16_t (bfloat16). */
#define ROW_KERNEL(NAME, T, LOAD, STORE)                                                                               \
    static void NAME(T *y, const T *x, const T *a, const T *b, int in, int out, int rank, int max_rank) {             \
        float shrunk[MAX_RANK];                                                                                        \
        for (int r = 0; r < rank; r++) {                                                                               \
            const T *ar = a + (int64_t)r * in;                                                                         \
            float s = 0.f;                                                                                             \
            for (int k = 0; k < in; k++) s += LOAD(x[k]) * LOAD(ar[k]);                                                \
            shrunk[r] = s;                                                                                             \
        }                                                                                                              \
        for (int o = 0; o < out; o++) {                                                                                \
            const T *bo = b + (int64_t)o * max_rank;                                                                   \
            float s = 0.f;                                                                                             \
            for (int r = 0; r < rank; r++) s += shrunk[r] * LOAD(bo[r]);                                               \
            y[o] = STORE(LOAD(y[o]) + s);                                                                              \
        }                                                                                                              \
    }

#define AS_IS(v) (v)
ROW_KERNEL(row_f32, float, AS_IS, AS_IS)

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "vector_math.h"

static inline __m512 widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

/* float32 -> bfloat16, to nearest even (f32_to_bf16's rounding; a NaN stays a quiet NaN). */
static inline __m256i narrow16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(rounded);
}

/* One adapted bfloat16 row on AVX-512 (CPUs without AMX): the shrink 8 ranks at a time as 16-lane dot products over
 * fan_in, each lane sum then reduced in a fixed order; the expand 16 outputs at a time, their rows of b transposed
 * so that each rank is one vector multiplied by its shrunk value. The row kernel's sums, reordered for 16 lanes. */
static void row_bf16(uint16_t *y, const uint16_t *x, const uint16_t *a, const uint16_t *b, int in, int out, int rank,
                     int max_rank) {
    float shrunk[MAX_RANK];
    for (int r0 = 0; r0 < rank; r0 += 8) {
        const int nr = rank - r0 < 8 ? rank - r0 : 8;
        __m512 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
        for (int k = 0; k < in; k += 16) {
            const __mmask16 m = in - k >= 16 ? 0xFFFF : (__mmask16)((1u << (in - k)) - 1);
            const __m512 xv = widen16(_mm256_maskz_loadu_epi16(m, x + k));
            for (int j = 0; j < nr; j++)
                acc[j] = _mm512_fmadd_ps(xv, widen16(_mm256_maskz_loadu_epi16(m, a + (int64_t)(r0 + j) * in + k)), acc[j]);
        }
        for (int j = 0; j < nr; j++) shrunk[r0 + j] = _mm512_reduce_add_ps(acc[j]);
    }
    for (int o0 = 0; o0 < out; o0 += 16) {
        const int no = out - o0 < 16 ? out - o0 : 16;
        __m512 acc = _mm512_setzero_ps();
        for (int r0 = 0; r0 < rank; r0 += 16) {
            const int nr = rank - r0 < 16 ? rank - r0 : 16;
            const __mmask16 rm = nr == 16 ? 0xFFFF : (__mmask16)((1u << nr) - 1);
            __m512 t[16];
            for (int i = 0; i < 16; i++)
                t[i] = i < no ? widen16(_mm256_maskz_loadu_epi16(rm, b + (int64_t)(o0 + i) * max_rank + r0))
                              : _mm512_setzero_ps();
            transpose16_ps(t);
            for (int j = 0; j < nr; j++) acc = _mm512_fmadd_ps(_mm512_set1_ps(shrunk[r0 + j]), t[j], acc);
        }
        const __mmask16 om = no == 16 ? 0xFFFF : (__mmask16)((1u << no) - 1);
        const __m512 sum = _mm512_add_ps(widen16(_mm256_maskz_loadu_epi16(om, y + o0)), acc);
        _mm256_mask_storeu_epi16(y + o0, om, narrow16(sum));
    }
}
#else
ROW_KERNEL(row_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
#endif

/* The segments' rows in [lo, hi) of `rows`: each under its segment's slot (segments: slots[s], starts[s], ends[s]). */
#define SGMV_BODY(ROW, T)                                                                                              \
    const T *xs = (const T *)x;                                                                                        \
    T *ys = (T *)y;                                                                                                    \
    const T *as = (const T *)a, *bs = (const T *)b;                                                                    \
    threads = threads_for(threads, (int64_t)total * (in + out) * max_rank, MIN_WORK_PER_THREAD);                      \
    _Pragma("omp parallel num_threads(threads) if (threads > 1)") {                                                    \
        int lo, hi;                                                                                                    \
        share(total, thread_index(), thread_count(), &lo, &hi);                                                        \
        for (int s = 0; s < segments; s++) {                                                                          \
            const int64_t slot = table[s], start = table[segments + s], end = table[2 * segments + s];                 \
            const int rank = ranks[slot];                                                                              \
            const T *as_ = as + slot * max_rank * (int64_t)in, *bs_ = bs + slot * (int64_t)out * max_rank;            \
            const int64_t first = start > lo ? start : lo, last = end < hi ? end : hi;                                 \
            for (int64_t i = first; rank > 0 && i < last; i++)                                                         \
                ROW(ys + rows[i] * y_stride, xs + rows[i] * x_stride, as_, bs_, in, out, rank, max_rank);              \
        }                                                                                                              \
    }

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BW__)
#include <immintrin.h>

#include "amx.h"
#include "vector_math.h"

/* Output column tiles (16 columns each) per unit of the expand: one accumulator tile each. */
#define UNIT_TILES 4
/* Expand units (16 rows x 64 columns) per extra thread below which one thread does it all: a unit is a fraction of
 * a microsecond, waking a thread a few. */
#define MIN_UNITS_PER_THREAD 16

/* Up to 16 adapted rows of one segment: rows[first, first + count). */
typedef struct {
    int segment, first, count;
} Block;

/* v[i] (row i of a 16 x 16 block of 32-bit lanes) -> v[i] = column i. */
static inline void transpose16(__m512i v[16]) {
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_castsi512_ps(v[i]);
    transpose16_ps(r);
    for (int i = 0; i < 16; i++) v[i] = _mm512_castps_si512(r[i]);
}

/* The call's shapes. Rank runs in K blocks of kb ranks (the expand's depth per tile product: the rank itself up to
 * 32, else 32), kp = kblocks * kb of them stored per row of s; the shrink makes rank tiles of 16. */
typedef struct {
    int in, out, max_rank, kb, kblocks, kp, rank16, col_tiles, chunks;
} Shape;

/* Rank tiles [0, tiles) of one slot's A (max_rank, in) as right operands of x A^T: tile (t, c) holds ranks 16t..16t+15,
 * inputs 32c..32c+31, as 16 rows of input pairs x 16 ranks; ranks past max_rank zero. (kernels/cpu_lora.py's
 * tile_order makes the same layout for every slot and rank tile.) */
static void pack_a(const uint16_t *a, const Shape *sh, int tiles, uint16_t *ap) {
    const int chunks32 = sh->in / 32;
    for (int t = 0; t < tiles; t++)
        for (int c = 0; c < chunks32; c++) {
            __m512i v[16];
            for (int n = 0; n < 16; n++)
                v[n] = 16 * t + n < sh->max_rank ? _mm512_loadu_si512(a + (int64_t)(16 * t + n) * sh->in + 32 * c)
                                                 : _mm512_setzero_si512();
            transpose16(v);
            uint16_t *dst = ap + ((int64_t)t * chunks32 + c) * 512;
            for (int r = 0; r < 16; r++) _mm512_storeu_si512(dst + 32 * r, v[r]);
        }
}

/* Column tiles [tile0, tile0 + tiles) of one slot's B (out, max_rank) as right operands of s B^T: tile (j, k) holds
 * columns 16 (tile0 + j)..+15, ranks kb k..kb (k + 1) - 1, as kb / 2 rows of rank pairs x 16 columns; columns past
 * out and ranks past max_rank zero. (kernels/cpu_lora.py's tile_order: the same for every slot and column tile.) */
static void pack_b(const uint16_t *b, const Shape *sh, int tile0, int tiles, int kblocks, uint16_t *bp) {
    for (int j = 0; j < tiles; j++)
        for (int k = 0; k < kblocks; k++) {
            const int valid = sh->max_rank - sh->kb * k < sh->kb ? sh->max_rank - sh->kb * k : sh->kb;
            const __mmask32 mask = valid >= 32 ? 0xffffffffu : (1u << valid) - 1;
            __m512i v[16];
            for (int n = 0; n < 16; n++) {
                const int col = 16 * (tile0 + j) + n;
                v[n] = col < sh->out ? _mm512_maskz_loadu_epi16(mask, b + (int64_t)col * sh->max_rank + sh->kb * k)
                                     : _mm512_setzero_si512();
            }
            transpose16(v);
            uint16_t *dst = bp + ((int64_t)j * sh->kblocks + k) * sh->kb * 16;
            for (int r = 0; r < sh->kb / 2; r++) _mm512_storeu_si512(dst + 32 * r, v[r]);
        }
}

/* Scratch of one thread: its segment's packed A, a block's gathered rows, its float32 s, and B packed. */
typedef struct {
    uint16_t *ap, *xg, *bp;
    float *s;
    int *packed; /* per column chunk: the segment whose B bp holds there (-1: none) */
} Scratch;

#define ZERO_TILES(n)                                                                                                  \
    do {                                                                                                               \
        _tile_zero(0);                                                                                                 \
        if ((n) > 1) _tile_zero(1);                                                                                    \
        if ((n) > 2) _tile_zero(2);                                                                                    \
        if ((n) > 3) _tile_zero(3);                                                                                    \
    } while (0)

/* s = x[block rows] A^T for one block into hi and lo (16 x kp bfloat16 each, rows past count zero). Tiles: 0-3
 * accumulate four rank tiles, 4 holds x, 6-7 A. */
static void shrink_block(const uint16_t *x, int64_t x_stride, const int64_t *rows, const Block *blk, int rank,
                         const Shape *sh, const uint16_t *a_tiles, const Scratch *sc, uint16_t *hi, uint16_t *lo) {
    const int chunks32 = sh->in / 32, tiles = (rank + 15) / 16;
    int direct = blk->count == 16;
    for (int i = 1; direct && i < 16; i++) direct = rows[blk->first + i] == rows[blk->first] + i;
    const uint16_t *xs = sc->xg;
    int64_t stride = (int64_t)sh->in * 2;
    if (direct) {
        xs = x + rows[blk->first] * x_stride;
        stride = x_stride * 2;
    } else {
        for (int i = 0; i < 16; i++) {
            uint16_t *dst = sc->xg + (int64_t)i * sh->in;
            if (i < blk->count)
                memcpy(dst, x + rows[blk->first + i] * x_stride, sizeof(uint16_t) * sh->in);
            else
                memset(dst, 0, sizeof(uint16_t) * sh->in);
        }
    }
    memset(sc->s, 0, sizeof(float) * 16 * sh->rank16);
    for (int t0 = 0; t0 < tiles; t0 += 4) {
        const int n = tiles - t0 < 4 ? tiles - t0 : 4;
        const uint16_t *ap = a_tiles + (int64_t)t0 * chunks32 * 512;
        ZERO_TILES(n);
        for (int c = 0; c < chunks32; c++) {
            _tile_loadd(4, xs + 32 * c, stride);
            _tile_loadd(6, ap + c * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (n > 1) {
                _tile_loadd(7, ap + ((int64_t)chunks32 + c) * 512, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (n > 2) {
                _tile_loadd(6, ap + ((int64_t)2 * chunks32 + c) * 512, 64);
                _tile_dpbf16ps(2, 4, 6);
            }
            if (n > 3) {
                _tile_loadd(7, ap + ((int64_t)3 * chunks32 + c) * 512, 64);
                _tile_dpbf16ps(3, 4, 7);
            }
        }
        const int64_t row_bytes = (int64_t)sh->rank16 * 4;
        _tile_stored(0, sc->s + 16 * t0, row_bytes);
        if (n > 1) _tile_stored(1, sc->s + 16 * (t0 + 1), row_bytes);
        if (n > 2) _tile_stored(2, sc->s + 16 * (t0 + 2), row_bytes);
        if (n > 3) _tile_stored(3, sc->s + 16 * (t0 + 3), row_bytes);
    }
    for (int i = 0; i < 16; i++)
        for (int r0 = 0; r0 < sh->kp; r0 += 16) {
            const int width = sh->kp - r0 < 16 ? sh->kp - r0 : 16;
            const __mmask16 mask = width == 16 ? 0xffff : (__mmask16)((1u << width) - 1);
            const float *si = sc->s + (int64_t)i * sh->rank16 + r0;
            const __m512 v = r0 < sh->rank16 ? _mm512_loadu_ps(si) : _mm512_setzero_ps();
            const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
            const __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, widen16(h)));
            _mm256_mask_storeu_epi16(hi + (int64_t)i * sh->kp + r0, mask, h);
            _mm256_mask_storeu_epi16(lo + (int64_t)i * sh->kp + r0, mask, l);
        }
}

/* y[block rows, columns of tiles tile0..tile0 + tiles - 1] += (hi + lo) B^T, B's tiles packed in bp. Tiles: 0-3
 * accumulate, 4 holds hi, 5 lo, 6-7 B. */
static void expand_unit(uint16_t *y, int64_t y_stride, const int64_t *rows, const Block *blk, const uint16_t *hi,
                        const uint16_t *lo, int kblocks, int tile0, int tiles, const Shape *sh, const uint16_t *bp) {
    float c[4][256] __attribute__((aligned(64)));
    const int64_t s_bytes = (int64_t)sh->kp * 2, b_tile = (int64_t)sh->kb * 16;
    ZERO_TILES(tiles);
    for (int k = 0; k < kblocks; k++) {
        _tile_loadd(4, hi + sh->kb * k, s_bytes);
        _tile_loadd(5, lo + sh->kb * k, s_bytes);
        _tile_loadd(6, bp + k * b_tile, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(0, 5, 6);
        if (tiles > 1) {
            _tile_loadd(7, bp + ((int64_t)sh->kblocks + k) * b_tile, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(1, 5, 7);
        }
        if (tiles > 2) {
            _tile_loadd(6, bp + ((int64_t)2 * sh->kblocks + k) * b_tile, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
        }
        if (tiles > 3) {
            _tile_loadd(7, bp + ((int64_t)3 * sh->kblocks + k) * b_tile, 64);
            _tile_dpbf16ps(3, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c[0], 64);
    if (tiles > 1) _tile_stored(1, c[1], 64);
    if (tiles > 2) _tile_stored(2, c[2], 64);
    if (tiles > 3) _tile_stored(3, c[3], 64);
    for (int j = 0; j < tiles; j++) {
        const int col = 16 * (tile0 + j), width = sh->out - col < 16 ? sh->out - col : 16;
        const __mmask16 mask = width == 16 ? 0xffff : (__mmask16)((1u << width) - 1);
        for (int i = 0; i < blk->count; i++) {
            uint16_t *yr = y + rows[blk->first + i] * y_stride + col;
            const __m512 sum = _mm512_add_ps(widen16(_mm256_maskz_loadu_epi16(mask, yr)), _mm512_load_ps(c[j] + 16 * i));
            _mm256_mask_storeu_epi16(yr, mask, (__m256i)_mm512_cvtneps_pbh(sum));
        }
    }
}

/* The bfloat16 delta on AMX; -1 where it cannot run (no AMX granted, fan_in not a multiple of 32, no memory), and
 * the caller takes the row kernel. */
static int sgmv_amx(uint16_t *y, int64_t y_stride, const uint16_t *x, int64_t x_stride, const uint16_t *a,
                    const uint16_t *b, const int64_t *rows, const int64_t *table, const int32_t *ranks, int segments,
                    int in, int out, int max_rank, int tiled, int threads) {
    if (in % 32 || !amx_granted()) return -1;
    Shape sh;
    sh.in = in, sh.out = out, sh.max_rank = max_rank;
    sh.kb = max_rank <= 32 ? (max_rank + 1) / 2 * 2 : 32;
    sh.kblocks = (max_rank + sh.kb - 1) / sh.kb;
    sh.kp = sh.kblocks * sh.kb;
    sh.rank16 = (max_rank + 15) / 16 * 16;
    sh.col_tiles = (out + 15) / 16;
    sh.chunks = (sh.col_tiles + UNIT_TILES - 1) / UNIT_TILES;
    int blocks = 0;
    for (int s = 0; s < segments; s++)
        if (ranks[table[s]] > 0) blocks += (int)((table[2 * segments + s] - table[segments + s] + 15) / 16);
    if (blocks == 0) return 0;
    const int64_t s_elems = (int64_t)16 * sh.kp; /* one block's hi (or lo) */
    const int64_t a_slot = (int64_t)sh.rank16 * in, b_slot = (int64_t)sh.col_tiles * 16 * sh.kp; /* tiled forms */
    const int64_t ap_elems = tiled ? 0 : a_slot, xg_elems = (int64_t)16 * in;
    const int64_t bp_elems = tiled ? 0 : (int64_t)sh.chunks * UNIT_TILES * sh.kp * 16;
    const int64_t sf_elems = (int64_t)16 * sh.rank16;
    const int64_t scratch_bytes = (2 * (ap_elems + xg_elems + bp_elems) + 4 * sf_elems + 4 * sh.chunks + 63) / 64 * 64;
    const size_t index_bytes = (sizeof(Block) * blocks + sizeof(int) * 2 * (segments + 1) + 63) / 64 * 64;
    const int64_t units = (int64_t)blocks * sh.chunks;
    threads = threads_for(threads, units, MIN_UNITS_PER_THREAD);
    char *memory = aligned_alloc(64, index_bytes + 2 * 2 * s_elems * blocks + scratch_bytes * threads);
    if (!memory) return -1;
    Block *block = (Block *)memory;
    /* Per segment: its first block and its first expand unit (none where its rank is 0); one more entry closes the
     * last. A segment's units go block by block, each block over all the column chunks. */
    int *seg_block = (int *)(block + blocks), *seg_unit = seg_block + segments + 1;
    uint16_t *shrunk = (uint16_t *)(memory + index_bytes); /* per block: hi, then lo */
    char *scratch = (char *)(shrunk + 2 * s_elems * blocks);
    int n = 0, u = 0;
    for (int s = 0; s < segments; s++) {
        seg_block[s] = n, seg_unit[s] = u;
        const int64_t start = table[segments + s], end = table[2 * segments + s];
        if (ranks[table[s]] <= 0) continue;
        for (int64_t i = start; i < end; i += 16) block[n++] = (Block){s, (int)i, end - i < 16 ? (int)(end - i) : 16};
        u += (n - seg_block[s]) * sh.chunks;
    }
    seg_block[segments] = n, seg_unit[segments] = u;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int me = thread_index();
        char *mine = scratch + scratch_bytes * me;
        Scratch sc;
        sc.ap = (uint16_t *)mine;
        sc.xg = sc.ap + ap_elems;
        sc.bp = sc.xg + xg_elems;
        sc.s = (float *)(sc.bp + bp_elems);
        sc.packed = (int *)(sc.s + sf_elems);
        TileConfig cfg = {0};
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
        load_tile_config(&cfg);
        int lo, hi, packed = -1;
        const uint16_t *a_tiles = sc.ap;
        share(blocks, me, thread_count(), &lo, &hi);
        for (int i = lo; i < hi; i++) {
            const int s = block[i].segment;
            const int64_t slot = table[s];
            const int rank = ranks[slot];
            if (tiled) {
                a_tiles = a + slot * a_slot;
            } else if (s != packed) {
                pack_a(a + slot * max_rank * (int64_t)in, &sh, (rank + 15) / 16, sc.ap);
                packed = s;
            }
            uint16_t *h = shrunk + 2 * s_elems * i;
            shrink_block(x, x_stride, rows, &block[i], rank, &sh, a_tiles, &sc, h, h + s_elems);
        }
#pragma omp barrier
        /* The expand: s tiles are 16 rows x kb ranks, B tiles kb / 2 rank pairs x 16 columns. */
        cfg.colsb[4] = cfg.colsb[5] = (uint16_t)(2 * sh.kb);
        cfg.rows[6] = cfg.rows[7] = (uint8_t)(sh.kb / 2);
        load_tile_config(&cfg);
        share((int)units, me, thread_count(), &lo, &hi);
        for (int c = 0; c < sh.chunks; c++) sc.packed[c] = -1;
        int s = 0;
        for (int unit = lo; unit < hi; unit++) {
            while (unit >= seg_unit[s + 1]) s++;
            /* Untiled, B is packed a chunk at a time as a thread first needs it for the segment, and kept. */
            const int local = unit - seg_unit[s], chunk = local % sh.chunks, i = seg_block[s] + local / sh.chunks;
            const int64_t slot = table[s];
            const int kblocks = (ranks[slot] + sh.kb - 1) / sh.kb;
            const int tile0 = chunk * UNIT_TILES;
            const int tiles = sh.col_tiles - tile0 < UNIT_TILES ? sh.col_tiles - tile0 : UNIT_TILES;
            const int64_t first_tile = (int64_t)tile0 * sh.kblocks * sh.kb * 16;
            const uint16_t *bp = tiled ? b + slot * b_slot + first_tile : sc.bp + first_tile;
            if (!tiled && sc.packed[chunk] != s) {
                pack_b(b + slot * (int64_t)out * max_rank, &sh, tile0, tiles, kblocks, sc.bp + first_tile);
                sc.packed[chunk] = s;
            }
            const uint16_t *h = shrunk + 2 * s_elems * i;
            expand_unit(y, y_stride, rows, &block[i], h, h + s_elems, kblocks, tile0, tiles, &sh, bp);
        }
        _tile_release();
    }
    free(memory);
    return 0;
}
#else
static int sgmv_amx(uint16_t *y, int64_t y_stride, const uint16_t *x, int64_t x_stride, const uint16_t *a,
                    const uint16_t *b, const int64_t *rows, const int64_t *table, const int32_t *ranks, int segments,
                    int in, int out, int max_rank, int tiled, int threads) {
    (void)y, (void)y_stride, (void)x, (void)x_stride, (void)a, (void)b, (void)rows, (void)table, (void)ranks;
    (void)segments, (void)in, (void)out, (void)max_rank, (void)tiled, (void)threads;
    return -1;
}
#endif

/* y (tokens rows of y_stride elements, fan_out columns) += the delta of every segment's rows; x (tokens, fan_in; row
 * stride x_stride), a (slots, max_rank, fan_in), b (slots, fan_out, max_rank) contiguous, zero beyond each slot's
 * rank; rows (total) the adapted rows grouped by segment, each at most once; table (3, segments): slots, then starts,
 * then ends, into rows; ranks (slots) each slot's rank here (0: no delta). dtype: 0 float32, 1 bfloat16, 2 bfloat16
 * with a and b in tile order (kernels/cpu_lora.py's tile_order; on AMX only, fan_in a multiple of 32). -1 on arguments
 * the kernel does not take. */
int lora_sgmv(void *y, int64_t y_stride, const void *x, int64_t x_stride, const void *a, const void *b,
              const int64_t *rows, const int64_t *table, const int32_t *ranks, int total, int segments, int slots,
              int fan_in, int fan_out, int max_rank, int dtype, int threads) {
    const int in = fan_in, out = fan_out;
    if (total < 0 || segments < 0 || in <= 0 || out <= 0 || max_rank <= 0 || max_rank > MAX_RANK) return -1;
    for (int s = 0; s < segments; s++) {
        const int64_t slot = table[s], start = table[segments + s], end = table[2 * segments + s];
        if (slot < 0 || slot >= slots || start < 0 || end < start || end > total) return -1;
        if (ranks[slot] < 0 || ranks[slot] > max_rank) return -1;
    }
    if (dtype == 0) {
        SGMV_BODY(row_f32, float)
    } else if (dtype == 1) {
        if (sgmv_amx(y, y_stride, x, x_stride, a, b, rows, table, ranks, segments, in, out, max_rank, 0, threads) == 0)
            return 0;
        SGMV_BODY(row_bf16, uint16_t)
    } else if (dtype == 2) { /* a and b tiled: only the AMX path reads them */
        return sgmv_amx(y, y_stride, x, x_stride, a, b, rows, table, ranks, segments, in, out, max_rank, 1, threads);
    } else {
        return -1;
    }
    return 0;
}
