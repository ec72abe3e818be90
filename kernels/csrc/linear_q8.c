/* Linear layers over GGUF blocks with int8 activations, llama.cpp's numerics: y (m, n) = x (m, k) w^T (+ bias) for a
 * few rows of x (a decode batch), w in its file's blocks (ggml-quants.h's layouts, as linear_quant.c reads them).
 *
 * Each 32-value block of a row of x is rounded to int8 with its own scale (dx = max |x| / 127, q = x / dx to nearest,
 * ties to even), as llama.cpp's q8_0/q8_1 activations are; the block's dot product with a weight block is then exact
 * in int32 (AVX-512 VNNI `vpdpbusd`, unsigned weight quants times signed activations), scaled once per block by
 * dw dx in float32, and a block type with an offset (Q4_0's -8 d, Q4_1's m, Q5's) adds offset times the activations'
 * block sum dx sum(q). The weights are read once, a few instructions per 64, so one row's pass runs near the memory
 * bandwidth, where linear_quant.c's exact float32 path (every weight dequantized to float) is bound by instructions.
 * The activations' rounding changes results by about a part in a thousand: the replica takes this path for bfloat16
 * activations only (already rounded to 8 significant bits), never for float32 ones, whose results stay exact.
 *
 * One order for every output whatever m or the thread count: per 16-lane accumulator, pairs of blocks in increasing
 * k, then a fixed reduction. Only the CPUs with AVX-512 VNNI (Ice Lake and later, Zen 4) build it;
 * linear_q8_available() says 0 elsewhere and the caller keeps the exact path. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "entry_points.h"
#include "parallel.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#include <immintrin.h>
#define Q8_PATH 1
#else
#define Q8_PATH 0
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-associative-math")
#endif

/* ggml type numbers taken here (ggml.h). */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8 };
/* Rows of x one pass over the weights serves; a batch of more rows is cut into strips of this many. */
#define MAX_ROWS 8
/* Blocks whose scales are fetched together (one gather), so 8 pairs of blocks. */
#define GROUP 16
#define MIN_WORK_PER_THREAD (1 << 16)
/* How far ahead of the group being read its lines are fetched (bytes; past a row's end: the next row's). */
#define PREFETCH_AHEAD 2048

static int block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    default: return 0;
    }
}

#if Q8_PATH
/* Where a block's 16 bytes of nibbles (or 32 quant bytes) start. */
static inline int quants_at(int type) { return type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : type == Q5_1 ? 8 : 2; }

/* One row of x as the kernel reads it. For every pair of blocks (A, B) 64 int8 values: for the 4- and 5-bit types
 * [A 0-15 | B 0-15 | A 16-31 | B 16-31], the order of the weights' low then high nibbles, for Q8_0 [A | B]; then per
 * pair 16 floats, the scale dx of the block each int32 lane of the dot product sums; then the blocks' sums
 * dx sum(q), for the types with an offset. Blocks past k are zeros, up to a whole group. */
typedef struct {
    int8_t *q;
    float *lane_scale;
    float *sums;
} row_q8;

static inline int nibble_order(int type) { return type != Q8_0; }

static void quantize_row(const float *x, int k, int type, row_q8 r, int padded_blocks) {
    const int blocks = k / 32;
    float dx[2] = {0, 0};
    for (int b = 0; b < padded_blocks; b++) {
        int8_t q[32] = {0};
        float d = 0;
        if (b < blocks) {
            const __m512 lo = _mm512_loadu_ps(x + 32 * b), hi = _mm512_loadu_ps(x + 32 * b + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            d = amax / 127.f;
            const __m512 id = _mm512_set1_ps(d != 0 ? 127.f / amax : 0.f);
            /* cvtps rounds to nearest, ties to even (the default MXCSR mode torch leaves alone) */
            _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, id))));
            _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, id))));
        }
        int sum = 0;
        for (int j = 0; j < 32; j++) sum += q[j];
        r.sums[b] = d * (float)sum;
        const int p = b >> 1, second = b & 1;
        int8_t *dst = r.q + 64 * p;
        if (nibble_order(type)) {
            memcpy(dst + 16 * second, q, 16);
            memcpy(dst + 32 + 16 * second, q + 16, 16);
        } else {
            memcpy(dst + 32 * second, q, 32);
        }
        dx[second] = d;
        if (second) {
            float *ls = r.lane_scale + 16 * p;
            for (int l = 0; l < 16; l++) ls[l] = dx[nibble_order(type) ? (l >> 2) & 1 : l >> 3];
        }
    }
}

/* The 64 weight quants of blocks a and b (b null past the row's end) in the activations' order, as unsigned bytes;
 * Q8_0's signed quants as their magnitudes, with *sign set where negative (the activation is negated there). */
static inline __attribute__((always_inline)) __m512i pair_quants(int type, const uint8_t *a, const uint8_t *b,
                                                                 __mmask64 *sign, const int permuted) {
    const int at = quants_at(type);
    if (type == Q8_0) {
        const __m256i qa = _mm256_loadu_si256((const __m256i *)(a + at));
        const __m256i qb = b ? _mm256_loadu_si256((const __m256i *)(b + at)) : _mm256_setzero_si256();
        const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1);
        *sign = _mm512_movepi8_mask(w);
        return _mm512_abs_epi8(w);
    }
#if defined(__AVX512VBMI__)
    if (permuted && (type == Q4_0 || type == Q4_1)) {
        /* Both blocks' nibbles in one masked load (B's start bb bytes after A's), set in place by one byte permute:
         * [A | B | A | B], the upper half shifted to its high nibbles. */
        const int bb = block_bytes(type);
        const __m512i idx = _mm512_set_epi8(
            bb + 15, bb + 14, bb + 13, bb + 12, bb + 11, bb + 10, bb + 9, bb + 8, bb + 7, bb + 6, bb + 5, bb + 4,
            bb + 3, bb + 2, bb + 1, bb, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, bb + 15, bb + 14, bb + 13,
            bb + 12, bb + 11, bb + 10, bb + 9, bb + 8, bb + 7, bb + 6, bb + 5, bb + 4, bb + 3, bb + 2, bb + 1, bb, 15,
            14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __mmask64 bytes = b ? ((__mmask64)1 << (bb + 16)) - 1 : 0xFFFF;
        const __m512i raw = _mm512_maskz_loadu_epi8(bytes, a + at);
        const __m512i w = _mm512_maskz_permutexvar_epi8(b ? ~(__mmask64)0 : 0x0000FFFF0000FFFFull, idx, raw);
        return _mm512_and_si512(_mm512_mask_srli_epi16(w, 0xFFFF0000u, w, 4), _mm512_set1_epi8(0x0F));
    }
#endif
    const __m128i na = _mm_loadu_si128((const __m128i *)(a + at));
    const __m128i nb = b ? _mm_loadu_si128((const __m128i *)(b + at)) : _mm_setzero_si128();
    const __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(na), nb, 1);
    __m512i w = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), _mm256_srli_epi16(lo, 4), 1),
                                 _mm512_set1_epi8(0x0F));
    if (type == Q5_0 || type == Q5_1) { /* qh bit j: weight j's fifth bit */
        uint32_t ha, hb = 0;
        memcpy(&ha, a + at - 4, 4);
        if (b) memcpy(&hb, b + at - 4, 4);
        const __mmask64 high = (uint64_t)(ha & 0xFFFF) | (uint64_t)(hb & 0xFFFF) << 16 | (uint64_t)(ha >> 16) << 32 |
                               (uint64_t)(hb >> 16) << 48;
        w = _mm512_mask_add_epi8(w, high, w, _mm512_set1_epi8(0x10));
    }
    return w;
}

/* Rows [0, mr) of quantized x against weight row w (`blocks` blocks): out[i] = the row's sum + bias. */
static inline __attribute__((always_inline)) void row_dot(int type, const uint8_t *w, int blocks, const row_q8 *x,
                                                          int mr, float *out, float bias) {
    const int bb = block_bytes(type);
    const int offset = type != Q8_0;
    __m512 acc[MAX_ROWS], acc_offset[MAX_ROWS];
    for (int i = 0; i < mr; i++) acc[i] = acc_offset[i] = _mm512_setzero_ps();
    const __m512i at_block = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(bb));
    const __m512i lanes = nibble_order(type) ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)
                                             : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int g0 = 0; g0 < blocks; g0 += GROUP) {
        const uint8_t *base = w + (int64_t)g0 * bb;
        const int in_group = blocks - g0 < GROUP ? blocks - g0 : GROUP;
        const __mmask16 valid = (__mmask16)((1u << in_group) - 1);
        /* The group's scales d (and offsets m) from the blocks' first 4 bytes, as float32. */
        const __m512i head = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, at_block, base, 1);
        const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
        if (offset) {
            const __m512 mw = type == Q4_1 || type == Q5_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)))
                              : _mm512_mul_ps(dw, _mm512_set1_ps(type == Q4_0 ? -8.f : -16.f));
            for (int i = 0; i < mr; i++) acc_offset[i] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(x[i].sums + g0), acc_offset[i]);
        }
        for (int l = 0; l < GROUP * bb; l += 64) _mm_prefetch((const char *)(base + PREFETCH_AHEAD + l), _MM_HINT_T0);
        for (int p = 0; p < (in_group + 1) / 2; p++) {
            const uint8_t *a = base + 2 * p * bb, *b = 2 * p + 1 < in_group ? a + bb : 0;
            __mmask64 sign = 0;
            const __m512i wq = pair_quants(type, a, b, &sign, 0);
            const __m512 scale = _mm512_permutexvar_ps(_mm512_add_epi32(lanes, _mm512_set1_epi32(2 * p)), dw);
            const int64_t pair = (g0 >> 1) + p;
            for (int i = 0; i < mr; i++) {
                __m512i xq = _mm512_loadu_si512(x[i].q + 64 * pair);
                if (type == Q8_0) xq = _mm512_mask_sub_epi8(xq, sign, _mm512_setzero_si512(), xq);
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, xq));
                acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_loadu_ps(x[i].lane_scale + 16 * pair)), scale, acc[i]);
            }
        }
    }
    for (int i = 0; i < mr; i++) out[i] = _mm512_reduce_add_ps(acc[i]) + _mm512_reduce_add_ps(acc_offset[i]) + bias;
}

/* One row of quantized x against WROWS weight rows (w, w + ws, ...): out[r] = row r's sum + bias[r]. Each output is
 * summed exactly as row_dot sums it (the same operations in the same order), so a row's result does not depend on
 * which of the two computed it; reading several weight rows at once shares the activations' loads and keeps more
 * memory streams in flight, which a single row's decode step is bound by. Q4_0/Q4_1 nibbles come in by one masked
 * load and one byte permute per pair of blocks (AVX-512 VBMI) instead of two loads and two inserts: a Zen 4's
 * one-row pass over the embedded model took 0.87x the time (2 threads). */
#ifndef WROWS
#define WROWS 4
#endif
static inline __attribute__((always_inline)) void rows_dot_one_x(int type, const uint8_t *w, int64_t ws, int blocks,
                                                                 const row_q8 *x, float *out, const float *bias) {
    const int bb = block_bytes(type);
    const int offset = type != Q8_0;
    __m512 acc[WROWS], acc_offset[WROWS], dw[WROWS];
    for (int r = 0; r < WROWS; r++) acc[r] = acc_offset[r] = _mm512_setzero_ps();
    const __m512i at_block = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(bb));
    const __m512i lanes = nibble_order(type) ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)
                                             : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int g0 = 0; g0 < blocks; g0 += GROUP) {
        const int in_group = blocks - g0 < GROUP ? blocks - g0 : GROUP;
        const __mmask16 valid = (__mmask16)((1u << in_group) - 1);
        for (int r = 0; r < WROWS; r++) {
            const uint8_t *base = w + r * ws + (int64_t)g0 * bb;
            const __m512i head = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, at_block, base, 1);
            dw[r] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
            if (offset) {
                const __m512 mw = type == Q4_1 || type == Q5_1
                                      ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)))
                                      : _mm512_mul_ps(dw[r], _mm512_set1_ps(type == Q4_0 ? -8.f : -16.f));
                acc_offset[r] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(x->sums + g0), acc_offset[r]);
            }
            for (int l = 0; l < GROUP * bb; l += 64) _mm_prefetch((const char *)(base + PREFETCH_AHEAD + l), _MM_HINT_T0);
        }
        for (int p = 0; p < (in_group + 1) / 2; p++) {
            const int64_t pair = (g0 >> 1) + p;
            const __m512i xq = _mm512_loadu_si512(x->q + 64 * pair);
            const __m512 lane_scale = _mm512_loadu_ps(x->lane_scale + 16 * pair);
            const __m512i at = _mm512_add_epi32(lanes, _mm512_set1_epi32(2 * p));
            for (int r = 0; r < WROWS; r++) {
                const uint8_t *a = w + r * ws + (int64_t)(g0 + 2 * p) * bb, *b = 2 * p + 1 < in_group ? a + bb : 0;
                __mmask64 sign = 0;
                const __m512i wq = pair_quants(type, a, b, &sign, 1);
                const __m512i xr = type == Q8_0 ? _mm512_mask_sub_epi8(xq, sign, _mm512_setzero_si512(), xq) : xq;
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, xr));
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, lane_scale), _mm512_permutexvar_ps(at, dw[r]), acc[r]);
            }
        }
    }
    for (int r = 0; r < WROWS; r++)
        out[r] = _mm512_reduce_add_ps(acc[r]) + _mm512_reduce_add_ps(acc_offset[r]) + (bias ? bias[r] : 0.f);
}

/* Output columns [lo, hi) for every row: y is float32, or bfloat16 where y_bf16. */
static void rows_dot(int type, const uint8_t *w, int64_t ws, const float *bias, const row_q8 *x, int m, void *y,
                     int y_bf16, int64_t ys, int k, int lo, int hi) {
    const int blocks = k / 32;
    float out[MAX_ROWS];
    if (m == 1) { /* one decode row: WROWS weight rows at a time */
        for (; lo + WROWS <= hi; lo += WROWS) {
            rows_dot_one_x(type, w + lo * ws, ws, blocks, x, out, bias ? bias + lo : 0);
            for (int r = 0; r < WROWS; r++) {
                if (y_bf16)
                    ((uint16_t *)y)[lo + r] = f32_to_bf16(out[r]);
                else
                    ((float *)y)[lo + r] = out[r];
            }
        }
    }
    for (int j = lo; j < hi; j++)
        for (int i0 = 0; i0 < m; i0 += MAX_ROWS) {
            const int mr = m - i0 < MAX_ROWS ? m - i0 : MAX_ROWS;
            const float bj = bias ? bias[j] : 0.f;
#define ROWS_CASE(R)                                                                                                   \
    case R: row_dot(type, w + j * ws, blocks, x + i0, R, out, bj); break;
            switch (mr) {
                ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
            }
#undef ROWS_CASE
            for (int i = 0; i < mr; i++) {
                const int64_t at = (int64_t)(i0 + i) * ys + j;
                if (y_bf16)
                    ((uint16_t *)y)[at] = f32_to_bf16(out[i]);
                else
                    ((float *)y)[at] = out[i];
            }
        }
}

/* One instance per type, so each type's unpacking is inlined into its loop. */
#define TYPE_ROWS(T)                                                                                                   \
    static void rows_##T(const uint8_t *w, int64_t ws, const float *bias, const row_q8 *x, int m, void *y,          \
                         int y_bf16, int64_t ys, int k, int lo, int hi) {                                              \
        rows_dot(T, w, ws, bias, x, m, y, y_bf16, ys, k, lo, hi);                                                      \
    }
TYPE_ROWS(Q4_0)
TYPE_ROWS(Q4_1)
TYPE_ROWS(Q5_0)
TYPE_ROWS(Q5_1)
TYPE_ROWS(Q8_0)
#endif

/* 1 where this build has the int8-activation path (AVX-512 VNNI), else 0. */
int linear_q8_available(void) { return Q8_PATH; }

/* Both entry points: x float32 or bfloat16 (x_bf16), y likewise. */
static int linear_q8(const void *x, int x_bf16, int64_t x_stride, const uint8_t *w, int64_t w_stride,
                     const float *bias, void *y, int y_bf16, int64_t y_stride, int m, int n, int k, int type,
                     int threads) {
    const int bb = block_bytes(type);
    if (!Q8_PATH || !bb || m <= 0 || n <= 0 || k <= 0 || k % 32 || x_stride < k || w_stride < (int64_t)k / 32 * bb ||
        y_stride < n)
        return -1;
#if Q8_PATH
    const int padded = (k / 32 + GROUP - 1) / GROUP * GROUP;
    const size_t row_bytes = (size_t)padded * 32 + sizeof(float) * (size_t)(8 * padded + padded);
    uint8_t *buffer = aligned_alloc(64, (row_bytes * (size_t)m + 63) / 64 * 64);
    row_q8 *rows = malloc(sizeof(row_q8) * (size_t)m);
    float *widened = x_bf16 ? malloc(sizeof(float) * (size_t)k) : 0;
    if (!buffer || !rows || (x_bf16 && !widened)) {
        free(buffer), free(rows), free(widened);
        return -1;
    }
    for (int i = 0; i < m; i++) {
        uint8_t *r = buffer + row_bytes * i;
        rows[i] = (row_q8){(int8_t *)r, (float *)(r + (size_t)padded * 32), (float *)(r + (size_t)padded * 64)};
        const float *xi = (const float *)x + i * x_stride;
        if (x_bf16) { /* bfloat16 is float32's top half: widening is exact */
            const uint16_t *xb = (const uint16_t *)x + i * x_stride;
            for (int j = 0; j < k; j += 16)
                _mm512_storeu_ps(widened + j, _mm512_castsi512_ps(_mm512_slli_epi32(
                                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xb + j))), 16)));
            xi = widened;
        }
        quantize_row(xi, k, type, rows[i], padded);
    }
    typedef void (*rows_fn)(const uint8_t *, int64_t, const float *, const row_q8 *, int, void *, int, int64_t, int,
                            int, int);
    const rows_fn run = type == Q4_0   ? rows_Q4_0
                        : type == Q4_1 ? rows_Q4_1
                        : type == Q5_0 ? rows_Q5_0
                        : type == Q5_1 ? rows_Q5_1
                                       : rows_Q8_0;
    threads = threads_for(threads, (int64_t)m * n * k, MIN_WORK_PER_THREAD);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int lo, hi;
        share(n, thread_index(), thread_count(), &lo, &hi);
        if (lo < hi) run(w, w_stride, bias, rows, m, y, y_bf16, y_stride, k, lo, hi);
    }
    free(buffer), free(rows), free(widened);
    return 0;
#else
    (void)x_bf16, (void)bias, (void)y, (void)y_bf16, (void)threads, (void)x, (void)w;
    return -1;
#endif
}

/* y (m rows of stride y_stride, n columns) = x (m, k; row stride x_stride) w^T (+ bias), x rounded to int8 per
 * 32-value block, w n rows of w_stride bytes of `type` blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0). Returns -1 on bad
 * arguments, a type not taken, a build without the path, or when its buffer cannot be had. */
int linear_q8_f32(const float *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, const float *bias, float *y,
                  int64_t y_stride, int m, int n, int k, int type, int threads) {
    return linear_q8(x, 0, x_stride, w, w_stride, bias, y, 0, y_stride, m, n, k, type, threads);
}

/* The same with x and y in bfloat16 (strides in elements; bias float32): a bfloat16 model's decode rows, with no
 * conversion on either side. */
int linear_q8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, const float *bias,
                   uint16_t *y, int64_t y_stride, int m, int n, int k, int type, int threads) {
    return linear_q8(x, 1, x_stride, w, w_stride, bias, y, 1, y_stride, m, n, k, type, threads);
}
