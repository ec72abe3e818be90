/* Linear layers over weights kept in GGUF's quantized blocks: y (m, n) = x (m, k) w^T (+ bias), x and y float32,
 * w row-major as llama.cpp stores it (row j is k / QK blocks of one type, ggml-quants.h's layouts unchanged), so a
 * replica holds the model at its file's size and a decode step reads 4.5 to 8.5 bits per weight instead of 16 or 32.
 *
 * Every weight is dequantized in registers to the float32 value gguf's dequantizers give (w = q d + m with one
 * rounding; every product q d of a block's quant and scale is exact in float32, so the fused multiply-add rounds
 * as gguf's d * q + m does), then multiplied with x in float32: no rounding of the activations, unlike llama.cpp's
 * int8 activations, so the model's tokens are the dequantized model's up to float32 summation order.
 *
 * One summation order for every output, whatever m, the batch around a row or the thread count: lane j (of 16) of
 * two accumulators sums x[k] w[k] for k = j mod 16 in increasing k, the first over even 16-weight groups and the
 * second over odd ones (two chains, so one row's decode is not bound by the multiply-add latency); the result is
 * the fixed tree reduce16(even + odd), plus bias. A row's result is the same alone or in any batch, on any number
 * of threads, and the same in the AVX-512 and AVX2 builds (same lanes, same tree); the portable build follows the
 * same order with fmaf.
 *
 * Few rows (decode): each thread streams its share of the weight rows once from memory, two output rows at a time,
 * each block dequantized once for up to DR rows of x. Many rows (a prompt): each thread dequantizes a group of its
 * weight rows once into a float32 panel that stays in L2, and every strip of x meets it there. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_linear.h"
#include "bf16.h"
#include "entry_points.h"
#include "ggml_blocks.h"
#include "parallel.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define SIMD 1
#else
#include <math.h>
#define SIMD 0
#endif

/* The library is built with -fassociative-math (clib.py), which lets GCC regroup the vector adds of AVX2's two-register
 * vectors and so change the summation order this file fixes; here every add stays where it is written. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-associative-math")
#endif


static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    /* IEEE half to single: normals and zeros by moving the fields, subnormals by scaling, inf/nan kept. */
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    float f;
    if (exp == 0) {
        f = (float)mant * (1.0f / 16777216.0f); /* mant 2^-24 */
        uint32_t bits;
        memcpy(&bits, &f, 4);
        bits |= sign;
        memcpy(&f, &bits, 4);
        return f;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7F800000u | (mant << 13) : ((exp + 112) << 23) | (mant << 13));
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* The 6-bit scale and min of sub-block s of a Q4_K / Q5_K super-block (ggml-quants.c get_scale_min_k4). */
static inline void scale_min_k4(const uint8_t *q, int s, int *sc, int *mn) {
    if (s < 4) {
        *sc = q[s] & 63, *mn = q[s + 4] & 63;
    } else {
        *sc = (q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4);
        *mn = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
    }
}

/* Group g (weights 16 g .. 16 g + 15) of a block: its affine map w = q d + m (*d, *m) and where its quants come
 * from. Shared by the vector and portable paths; only the unpacking of the 16 quants differs. */
static inline __attribute__((always_inline)) void group_affine(int type, const uint8_t *b, int g, float *d,
                                                                  float *m) {
    switch (type) {
    case Q4_0: *d = half_to_float(b), *m = -8 * *d; break;
    case Q4_1: *d = half_to_float(b), *m = half_to_float(b + 2); break;
    case Q5_0: *d = half_to_float(b), *m = -16 * *d; break;
    case Q5_1: *d = half_to_float(b), *m = half_to_float(b + 2); break;
    case Q8_0: *d = half_to_float(b), *m = 0; break;
    case Q4_K:
    case Q5_K: {
        int sc, mn;
        scale_min_k4(b + 4, g >> 1, &sc, &mn);
        *d = half_to_float(b) * (float)sc, *m = -(half_to_float(b + 2) * (float)mn);
        break;
    }
    case Q6_K: *d = half_to_float(b + 208) * (float)(int8_t)b[192 + g], *m = -32 * *d; break;
    default: *d = *m = 0;
    }
}

/* Whether a type's quants are signed bytes (Q8_0) rather than unsigned ones. */
#define SIGNED_QUANTS(type) ((type) == Q8_0)

#if SIMD
/* ---- The 16 quants of group g as 16 bytes (SSE, shared by AVX2 and AVX-512) ---- */

/* 0x10 in byte j where bit j of `bits` (16 bits) is set. */
static inline __m128i bits_to_0x10(uint32_t bits) {
    const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)bits),
                                            _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), _mm_set1_epi8(0x10));
}

static inline __m128i nibbles(__m128i v, int high) {
    return _mm_and_si128(high ? _mm_srli_epi16(v, 4) : v, _mm_set1_epi8(0x0F));
}

static inline __attribute__((always_inline)) __m128i group_quants(int type, const uint8_t *b, int g) {
    switch (type) {
    case Q4_0: return nibbles(_mm_loadu_si128((const __m128i *)(b + 2)), g);
    case Q4_1: return nibbles(_mm_loadu_si128((const __m128i *)(b + 4)), g);
    case Q5_0:
    case Q5_1: {
        const int off = type == Q5_0 ? 2 : 4;
        uint32_t qh;
        memcpy(&qh, b + off, 4);
        return _mm_or_si128(nibbles(_mm_loadu_si128((const __m128i *)(b + off + 4)), g), bits_to_0x10(qh >> (16 * g)));
    }
    case Q8_0: return _mm_loadu_si128((const __m128i *)(b + 2 + 16 * g));
    case Q4_K:
    case Q5_K: {
        /* Sub-block s = g / 2 of 32: chunk s / 2 of 32 bytes, its low nibbles for even s, high for odd. */
        const int s = g >> 1, half = g & 1;
        const uint8_t *qs = b + (type == Q4_K ? 16 : 48) + 32 * (s >> 1) + 16 * half;
        __m128i q = nibbles(_mm_loadu_si128((const __m128i *)qs), s & 1);
        if (type == Q5_K) { /* bit s of qh[l] is weight l's fifth bit; bring it to 0x10 within each byte */
            const __m128i qh = _mm_loadu_si128((const __m128i *)(b + 16 + 16 * half));
            const __m128i hb = s <= 4 ? _mm_slli_epi16(qh, 4 - s) : _mm_srli_epi16(qh, s - 4);
            q = _mm_or_si128(q, _mm_and_si128(hb, _mm_set1_epi8(0x10)));
        }
        return q;
    }
    case Q6_K: {
        /* Half n = g / 8 of 128; quarter i of 32 (q1..q4 of ggml's dequantize_row_q6_K), lanes l0 .. l0 + 15. */
        const int n = g >> 3, i = (g & 7) >> 1, l0 = 16 * (g & 1);
        const __m128i ql = _mm_loadu_si128((const __m128i *)(b + 64 * n + l0 + 32 * (i & 1)));
        const __m128i qh = _mm_loadu_si128((const __m128i *)(b + 128 + 32 * n + l0));
        const __m128i hb = _mm_and_si128(2 * i <= 4 ? _mm_slli_epi16(qh, 4 - 2 * i) : _mm_srli_epi16(qh, 2 * i - 4),
                                         _mm_set1_epi8(0x30));
        return _mm_or_si128(nibbles(ql, i >= 2), hb);
    }
    }
    return _mm_setzero_si128();
}

/* ---- A 16-lane float vector: one AVX-512 register or two AVX2 ones, the same lanes either way ---- */
#if defined(__AVX512F__)
/* Rows of x per decode strip: 2 outputs x 2 chains x DR rows of accumulators, 4 weight vectors, a row of x. */
#define DR 4
/* Prompt micro-tile: PR rows x PC outputs x 2 chains of accumulators. */
#define PR 4
#define PC 3
typedef __m512 v16;
static inline v16 v16_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v16_set1(float x) { return _mm512_set1_ps(x); }
static inline v16 v16_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v16_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
static inline v16 v16_fmadd(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v16_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v16_from_u8(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)); }
static inline v16 v16_from_s8(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }
static inline __m256 v16_fold(v16 v) { /* lanes j + (j + 8) */
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#else
#define DR 1
#define PR 2
#define PC 2
typedef struct {
    __m256 lo, hi;
} v16;
static inline v16 v16_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline v16 v16_set1(float x) { return (v16){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline v16 v16_load(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void v16_store(float *p, v16 v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
static inline v16 v16_fmadd(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline v16 v16_add(v16 a, v16 b) { return (v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline v16 v16_from_u8(__m128i q) {
    return (v16){_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)),
                 _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)))};
}
static inline v16 v16_from_s8(__m128i q) {
    return (v16){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                 _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
}
static inline __m256 v16_fold(v16 v) { return _mm256_add_ps(v.lo, v.hi); }
#endif

/* The fixed tree: (j, j + 8), then (j, j + 4), (j, j + 2), (j, j + 1). */
static inline float reduce16(v16 v) {
    const __m256 s8 = v16_fold(v);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* Group g of a block dequantized: q d + m in one rounding, gguf's value exactly (q d is exact). */
static inline __attribute__((always_inline)) v16 dequant16(int type, const uint8_t *b, int g) {
    float d, m;
    group_affine(type, b, g, &d, &m);
#if defined(__AVX512F__)
    if (type == Q4_0 || type == Q4_1) {
        /* A 4-bit block's 16 possible values q d + m (the same fused multiply-add, so the same bits), looked up by
         * each quant: one permute instead of widening to float and a multiply-add, and the block's two groups share
         * the table and the widened bytes (the low 4 bits of each 32-bit lane index the table). */
        const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_ps(d), _mm512_set1_ps(m));
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (type == Q4_0 ? 2 : 4))));
        return _mm512_permutexvar_ps(g ? _mm512_srli_epi32(q, 4) : q, table);
    }
#endif
    const __m128i q = group_quants(type, b, g);
    return v16_fmadd(SIGNED_QUANTS(type) ? v16_from_s8(q) : v16_from_u8(q), v16_set1(d), v16_set1(m));
}
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#else
/* ---- Portable: the same lanes and order in scalar code ---- */
#define DR 1
#define PR 1
#define PC 1
typedef struct {
    float l[16];
} v16;
static inline v16 v16_zero(void) { return (v16){{0}}; }
static inline v16 v16_load(const float *p) {
    v16 v;
    memcpy(v.l, p, sizeof v.l);
    return v;
}
static inline void v16_store(float *p, v16 v) { memcpy(p, v.l, sizeof v.l); }
static inline v16 v16_fmadd(v16 a, v16 b, v16 c) {
    for (int j = 0; j < 16; j++) c.l[j] = fmaf(a.l[j], b.l[j], c.l[j]);
    return c;
}
static inline v16 v16_add(v16 a, v16 b) {
    for (int j = 0; j < 16; j++) a.l[j] += b.l[j];
    return a;
}
static inline float reduce16(v16 v) {
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) v.l[j] += v.l[j + w];
    return v.l[0];
}
static inline v16 dequant16(int type, const uint8_t *b, int g) {
    float d, m;
    group_affine(type, b, g, &d, &m);
    int q[16];
    for (int j = 0; j < 16; j++) {
        switch (type) {
        case Q4_0: q[j] = (b[2 + j] >> (4 * g)) & 0xF; break;
        case Q4_1: q[j] = (b[4 + j] >> (4 * g)) & 0xF; break;
        case Q5_0:
        case Q5_1: {
            const int off = type == Q5_0 ? 2 : 4;
            const uint32_t qh = b[off] | (uint32_t)b[off + 1] << 8 | (uint32_t)b[off + 2] << 16 |
                                (uint32_t)b[off + 3] << 24;
            q[j] = ((b[off + 4 + j] >> (4 * g)) & 0xF) | (((qh >> (16 * g + j)) & 1) << 4);
            break;
        }
        case Q8_0: q[j] = (int8_t)b[2 + 16 * g + j]; break;
        case Q4_K:
        case Q5_K: {
            const int s = g >> 1, l = 16 * (g & 1) + j;
            q[j] = (b[(type == Q4_K ? 16 : 48) + 32 * (s >> 1) + l] >> (4 * (s & 1))) & 0xF;
            if (type == Q5_K) q[j] |= ((b[16 + l] >> s) & 1) << 4;
            break;
        }
        case Q6_K: {
            const int n = g >> 3, i = (g & 7) >> 1, l = 16 * (g & 1) + j;
            q[j] = ((b[64 * n + l + 32 * (i & 1)] >> (4 * (i >= 2))) & 0xF) | (((b[128 + 32 * n + l] >> (2 * i)) & 3) << 4);
            break;
        }
        }
    }
    v16 w;
    for (int j = 0; j < 16; j++) w.l[j] = fmaf((float)q[j], d, m);
    return w;
}
#define PREFETCH(p) ((void)(p))
#endif

/* How far ahead, in bytes of one weight row, a decode asks for the weight it streams from memory. */
#define MEMORY_AHEAD 512
/* Weight rows a thread dequantizes into its panel at once for a prompt (a multiple of PC). */
#define PANEL_ROWS (8 * PC)
/* Rows above which a batch takes the prompt path (dequantized panels) rather than the decode path. */
#ifndef PROMPT_MIN_ROWS
#define PROMPT_MIN_ROWS (2 * DR)
#endif
/* Multiply-adds per extra thread below which one thread does the whole layer. */
#define MIN_WORK_PER_THREAD (1 << 16)

/* Decode: rows [0, mr) of x (stride xs) against nr (1 or 2) weight rows w0, w1 of `blocks` blocks each; y[i][c]
 * (stride ys) = the row's sum + bias[c]. mr, nr and type are constants where this is inlined. */
static inline __attribute__((always_inline)) void decode_tile(int type, const uint8_t *w0, const uint8_t *w1,
                                                              int blocks, const float *x, int64_t xs, int mr, int nr,
                                                              float *y, int64_t ys, const float *bias) {
    const int qk = block_weights(type), bb = block_bytes(type);
    v16 acc[DR][2][2]; /* [row][output][chain] */
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < nr; c++) acc[i][c][0] = acc[i][c][1] = v16_zero();
    for (int blk = 0; blk < blocks; blk++) {
        const uint8_t *b0 = w0 + (int64_t)blk * bb, *b1 = nr > 1 ? w1 + (int64_t)blk * bb : 0;
        PREFETCH(b0 + MEMORY_AHEAD);
        if (nr > 1) PREFETCH(b1 + MEMORY_AHEAD);
        for (int g = 0; g < qk / 16; g++) {
            const v16 wa = dequant16(type, b0, g), wb = nr > 1 ? dequant16(type, b1, g) : wa;
            const int64_t kk = (int64_t)blk * qk + 16 * g;
            for (int i = 0; i < mr; i++) {
                const v16 xv = v16_load(x + i * xs + kk);
                acc[i][0][g & 1] = v16_fmadd(wa, xv, acc[i][0][g & 1]);
                if (nr > 1) acc[i][1][g & 1] = v16_fmadd(wb, xv, acc[i][1][g & 1]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < nr; c++)
            y[i * ys + c] = reduce16(v16_add(acc[i][c][0], acc[i][c][1])) + (bias ? bias[c] : 0.f);
}

/* Output rows [lo, hi) for a decode batch (m rows), pairs of weight rows, strips of DR rows of x each. */
static inline __attribute__((always_inline)) void decode_rows(int type, const float *x, int64_t xs,
                                                              const uint8_t *w, int64_t ws, const float *bias,
                                                              float *y, int64_t ys, int m, int k, int lo, int hi) {
    const int blocks = k / block_weights(type);
    for (int j = lo; j < hi; j += 2) {
        const int nr = hi - j >= 2 ? 2 : 1;
        const uint8_t *w0 = w + j * ws, *w1 = w0 + ws;
        const float *bj = bias ? bias + j : 0;
        for (int i0 = 0; i0 < m; i0 += DR) {
            const int mr = m - i0 < DR ? m - i0 : DR;
            const float *xi = x + i0 * xs;
            float *yi = y + i0 * ys + j;
#define DECODE_CASE(R)                                                                                                 \
    case R:                                                                                                            \
        if (nr == 2) decode_tile(type, w0, w1, blocks, xi, xs, R, 2, yi, ys, bj);                                      \
        else decode_tile(type, w0, w1, blocks, xi, xs, R, 1, yi, ys, bj);                                              \
        break;
            switch (mr) {
                DECODE_CASE(1)
#if DR >= 2
                DECODE_CASE(2)
                DECODE_CASE(3)
                DECODE_CASE(4)
#endif
            }
#undef DECODE_CASE
        }
    }
}

/* Prompt micro-tile: rows [0, mr) of x against pc rows of a dequantized panel (float32, row stride k), in decode's
 * order exactly (the panel holds the values decode_tile computes in registers). */
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t xs, const float *p, int k,
                                                             int mr, int pc, float *y, int64_t ys,
                                                             const float *bias) {
    v16 acc[PR][PC][2];
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < pc; c++) acc[i][c][0] = acc[i][c][1] = v16_zero();
    for (int kk = 0; kk < k; kk += 32) {
        for (int h = 0; h < 2; h++) {
            v16 wv[PC];
            for (int c = 0; c < pc; c++) wv[c] = v16_load(p + (int64_t)c * k + kk + 16 * h);
            for (int i = 0; i < mr; i++) {
                const v16 xv = v16_load(x + i * xs + kk + 16 * h);
                for (int c = 0; c < pc; c++) acc[i][c][h] = v16_fmadd(wv[c], xv, acc[i][c][h]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < pc; c++)
            y[i * ys + c] = reduce16(v16_add(acc[i][c][0], acc[i][c][1])) + (bias ? bias[c] : 0.f);
}

static void panel_strip(const float *x, int64_t xs, const float *p, int k, int mr, int pc, float *y, int64_t ys,
                        const float *bias) {
    if (mr == PR && pc == PC) panel_tile(x, xs, p, k, PR, PC, y, ys, bias);
    else panel_tile(x, xs, p, k, mr, pc, y, ys, bias); /* edges: a generic loop nest */
}

/* Output rows [lo, hi) for a prompt: groups of PANEL_ROWS weight rows dequantized once into `panel`, then every
 * PR-row strip of x against the group, PC rows at a time. */
static inline __attribute__((always_inline)) void prompt_rows(int type, const float *x, int64_t xs,
                                                              const uint8_t *w, int64_t ws, const float *bias,
                                                              float *y, int64_t ys, int m, int k, int lo, int hi,
                                                              float *panel) {
    const int qk = block_weights(type), bb = block_bytes(type), blocks = k / qk;
    for (int j0 = lo; j0 < hi; j0 += PANEL_ROWS) {
        const int rows = hi - j0 < PANEL_ROWS ? hi - j0 : PANEL_ROWS;
        for (int r = 0; r < rows; r++)
            for (int blk = 0; blk < blocks; blk++)
                for (int g = 0; g < qk / 16; g++)
                    v16_store(panel + (int64_t)r * k + blk * qk + 16 * g,
                              dequant16(type, w + (j0 + r) * ws + (int64_t)blk * bb, g));
        for (int i0 = 0; i0 < m; i0 += PR) {
            const int mr = m - i0 < PR ? m - i0 : PR;
            for (int c0 = 0; c0 < rows; c0 += PC) {
                const int pc = rows - c0 < PC ? rows - c0 : PC;
                panel_strip(x + i0 * xs, xs, panel + (int64_t)c0 * k, k, mr, pc, y + i0 * ys + j0 + c0, ys,
                            bias ? bias + j0 + c0 : 0);
            }
        }
    }
}

/* One instance of the kernel per block type, so that each type's unpacking is inlined into its loops. */
#define TYPE_KERNEL(T)                                                                                                 \
    static void rows_##T(const float *x, int64_t xs, const uint8_t *w, int64_t ws, const float *bias, float *y,       \
                         int64_t ys, int m, int k, int lo, int hi, float *panel) {                                     \
        if (panel) prompt_rows(T, x, xs, w, ws, bias, y, ys, m, k, lo, hi, panel);                                     \
        else decode_rows(T, x, xs, w, ws, bias, y, ys, m, k, lo, hi);                                                  \
    }
TYPE_KERNEL(Q4_0)
TYPE_KERNEL(Q4_1)
TYPE_KERNEL(Q5_0)
TYPE_KERNEL(Q5_1)
TYPE_KERNEL(Q8_0)
TYPE_KERNEL(Q4_K)
TYPE_KERNEL(Q5_K)
TYPE_KERNEL(Q6_K)

typedef void (*rows_fn)(const float *, int64_t, const uint8_t *, int64_t, const float *, float *, int64_t, int, int,
                        int, int, float *);
static rows_fn rows_for(int type) {
    switch (type) {
    case Q4_0: return rows_Q4_0;
    case Q4_1: return rows_Q4_1;
    case Q5_0: return rows_Q5_0;
    case Q5_1: return rows_Q5_1;
    case Q8_0: return rows_Q8_0;
    case Q4_K: return rows_Q4_K;
    case Q5_K: return rows_Q5_K;
    case Q6_K: return rows_Q6_K;
    default: return 0;
    }
}

/* Which path this build runs: 2 AVX-512, 1 AVX2 with FMA, 0 portable C. */
int linear_quant_isa(void) {
#if defined(__AVX512F__)
    return 2;
#elif SIMD
    return 1;
#else
    return 0;
#endif
}

/* Bytes of one weight row of k weights of `type` (a ggml type number); 0 where the type is not taken or k is not a
 * whole number of its blocks. */
int linear_quant_row_bytes(int type, int k) {
    const int qk = block_weights(type);
    return qk && k > 0 && k % qk == 0 ? k / qk * block_bytes(type) : 0;
}

/* y (m rows of stride y_stride, n columns) = x (m, k; row stride x_stride) w^T (+ bias), w n rows of w_stride bytes
 * of `type` blocks. Returns -1 on bad arguments or when the panel's memory cannot be had. */
int linear_quant_f32(const float *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, const float *bias, float *y,
                     int64_t y_stride, int m, int n, int k, int type, int threads) {
    const rows_fn rows = rows_for(type);
    const int row_bytes = linear_quant_row_bytes(type, k);
    if (!rows || !row_bytes || m <= 0 || n <= 0 || x_stride < k || w_stride < row_bytes || y_stride < n) return -1;
    /* A prompt pays one dequantization per weight into the panel; a decode batch dequantizes in registers once per
     * strip of DR rows, which for a few strips costs less than the panel's store and reload. */
    const int prompt = m > PROMPT_MIN_ROWS;
    int failed = 0;
    threads = threads_for(threads, (int64_t)m * n * k, MIN_WORK_PER_THREAD);
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        int lo, hi;
        /* Shares in whole pairs of rows, so that a row's pairing (and so its code path) does not depend on threads. */
        share((n + 1) / 2, thread_index(), thread_count(), &lo, &hi);
        lo *= 2, hi = 2 * hi < n ? 2 * hi : n;
        float *panel = prompt ? aligned_alloc(64, sizeof(float) * PANEL_ROWS * (size_t)k) : 0;
        if (prompt && !panel) failed = 1;
        else if (lo < hi) rows(x, x_stride, w, w_stride, bias, y, y_stride, m, k, lo, hi, panel);
        free(panel);
    }
    return failed ? -1 : 0;
}

/* ---- float32 to bfloat16 for dequantize_rows_bf16: bf16.h's f32_to_bf16 in every build, round to nearest even (a
 * NaN stays a NaN, its sign and top payload bits kept, quieted: | 0x40) ----
 *
 * AVX-512 BF16's vcvtne2ps2bf16 rounds the same way and quiets a NaN the same way (Intel's pseudocode: dest = src >>
 * 16, dest[6] = 1), but flushes float32 subnormals to a signed zero where the integer rule keeps a bfloat16 subnormal.
 * No weight is a float32 subnormal: every block's scales and offsets are float16 values times integers (6-bit scales,
 * quants), so integer multiples of 2^-24, and q d + m is one too, 0 or at least 2^-24 in magnitude, far above 2^-126.
 * So both give the same bits for every weight; tests/test_dequantize_bf16.py checks it on every float16 scale. */
#if SIMD && defined(__AVX512F__)
#if defined(__AVX512BF16__)
/* 32 weights (a, then b) as 32 bfloat16, in order. */
static inline __m512i bf16_round32(v16 a, v16 b) { return (__m512i)_mm512_cvtne2ps_pbh(b, a); }
#else
/* AVX-512F only: the rounding bias added in the integers, NaN lanes |= the quiet bit, the top halves narrowed. */
static inline __m256i bf16_round16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
static inline __m512i bf16_round32(v16 a, v16 b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(bf16_round16(a)), bf16_round16(b), 1);
}
#endif
static inline void bf16_store32(uint16_t *o, v16 a, v16 b) { _mm512_storeu_si512((void *)o, bf16_round32(a, b)); }
#elif SIMD
/* AVX2: 8 lanes rounded as AVX-512F's path does, each lane's bfloat16 in its low 16 bits. */
static inline __m256i bf16_round8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    return _mm256_srli_epi32(_mm256_blendv_epi8(r, quiet, nan), 16);
}
static inline __m256i bf16_round16(v16 v) { /* packus interleaves the 128-bit lanes; the permute puts them back */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_round8(v.lo), bf16_round8(v.hi)), 0xD8);
}
static inline void bf16_store32(uint16_t *o, v16 a, v16 b) {
    _mm256_storeu_si256((__m256i *)o, bf16_round16(a));
    _mm256_storeu_si256((__m256i *)(o + 16), bf16_round16(b));
}
#else
static inline void bf16_store32(uint16_t *o, v16 a, v16 b) {
    for (int i = 0; i < 16; i++) o[i] = f32_to_bf16(a.l[i]), o[16 + i] = f32_to_bf16(b.l[i]);
}
#endif

/* The 4- and 5-bit types, on AVX-512 with BW: 32 weights (groups g, g + 1, one scale and offset) as one lookup. The
 * 16 or 32 values q d + m their quants can take, the same fused multiply-add as dequant16 (so the same floats),
 * rounded once into a table of bfloat16, then vpermw picks each weight's entry by its quant: per 32 weights one
 * multiply-add, one rounding and one permute instead of widening, a multiply-add and a rounding per 16. */
#ifndef DEQUANT_TABLES
#define DEQUANT_TABLES 1
#endif
#if DEQUANT_TABLES && SIMD && defined(__AVX512F__) && defined(__AVX512BW__)
#define BF16_TABLES 1
static inline int table_entries(int type) {
    switch (type) {
    case Q4_0: case Q4_1: case Q4_K: return 16;
    case Q5_0: case Q5_1: case Q5_K: return 32;
    default: return 0;
    }
}
static inline __attribute__((always_inline)) void bf16_lookup32(int type, const uint8_t *b, int g, uint16_t *o) {
    float d, m;
    group_affine(type, b, g, &d, &m);
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 lo = _mm512_fmadd_ps(q, _mm512_set1_ps(d), _mm512_set1_ps(m));
    const __m512 hi = table_entries(type) > 16
                          ? _mm512_fmadd_ps(_mm512_add_ps(q, _mm512_set1_ps(16)), _mm512_set1_ps(d), _mm512_set1_ps(m))
                          : lo;
    /* The 32 quants' low 4 bits (a byte each, in order), then the fifth bits as a mask, bit j weight j's. */
    __m256i low;
    __mmask32 fifth = 0;
    if (type == Q4_K || type == Q5_K) { /* sub-block g / 2: 32 bytes, low nibbles for even ones, high for odd */
        const int sub = g >> 1;
        const __m256i qs = _mm256_loadu_si256((const __m256i *)(b + (type == Q4_K ? 16 : 48) + 32 * (sub >> 1)));
        low = _mm256_and_si256(sub & 1 ? _mm256_srli_epi16(qs, 4) : qs, _mm256_set1_epi8(0x0F));
        if (type == Q5_K) /* bit `sub` of qh[j] */
            fifth = _mm512_test_epi16_mask(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 16))),
                                           _mm512_set1_epi16((short)(1 << sub)));
    } else { /* weights 0-15 in the low nibbles of the block's 16 bytes, 16-31 in the high ones; qh just before */
        const int at = quants_at(type);
        const __m128i qs = _mm_loadu_si128((const __m128i *)(b + at));
        low = _mm256_inserti128_si256(_mm256_castsi128_si256(nibbles(qs, 0)), nibbles(qs, 1), 1);
        if (type == Q5_0 || type == Q5_1) {
            uint32_t qh;
            memcpy(&qh, b + at - 4, 4);
            fifth = qh;
        }
    }
    __m512i quants = _mm512_cvtepu8_epi16(low);
    if (table_entries(type) > 16) quants = _mm512_mask_add_epi16(quants, fifth, quants, _mm512_set1_epi16(16));
    _mm512_storeu_si512((void *)o, _mm512_permutexvar_epi16(quants, bf16_round32(lo, hi)));
}
#else
#define BF16_TABLES 0
#endif

/* Rows [lo, hi) of n weight rows dequantized: float32 (out32) or bfloat16 (out16, each block's groups in pairs,
 * rounded in registers and stored once). Inlined per type (below), so each type's unpacking is its own loop. */
static inline __attribute__((always_inline)) void dequant_rows(int type, const uint8_t *w, int64_t w_stride,
                                                               float *out32, uint16_t *out16, int k, int lo, int hi) {
    const int qk = block_weights(type), bb = block_bytes(type);
    for (int j = lo; j < hi; j++) {
        const uint8_t *row = w + j * w_stride;
        for (int blk = 0; blk < k / qk; blk++) {
            const uint8_t *b = row + (int64_t)blk * bb;
            const int64_t at = (int64_t)j * k + (int64_t)blk * qk;
            for (int g = 0; g < qk / 16; g += 2) {
#if BF16_TABLES
                if (out16 && table_entries(type)) {
                    bf16_lookup32(type, b, g, out16 + at + 16 * g);
                    continue;
                }
#endif
                const v16 lo16 = dequant16(type, b, g), hi16 = dequant16(type, b, g + 1);
                if (out16) {
                    bf16_store32(out16 + at + 16 * g, lo16, hi16);
                } else {
                    v16_store(out32 + at + 16 * g, lo16);
                    v16_store(out32 + at + 16 * g + 16, hi16);
                }
            }
        }
    }
}

#define DEQUANT_KERNEL(T)                                                                                              \
    static void dequant_rows_##T(const uint8_t *w, int64_t w_stride, float *out32, uint16_t *out16, int k, int lo,   \
                                 int hi) {                                                                             \
        dequant_rows(T, w, w_stride, out32, out16, k, lo, hi);                                                         \
    }
DEQUANT_KERNEL(Q4_0)
DEQUANT_KERNEL(Q4_1)
DEQUANT_KERNEL(Q5_0)
DEQUANT_KERNEL(Q5_1)
DEQUANT_KERNEL(Q8_0)
DEQUANT_KERNEL(Q4_K)
DEQUANT_KERNEL(Q5_K)
DEQUANT_KERNEL(Q6_K)

typedef void (*dequant_fn)(const uint8_t *, int64_t, float *, uint16_t *, int, int, int);
static dequant_fn dequant_for(int type) {
    switch (type) {
    case Q4_0: return dequant_rows_Q4_0;
    case Q4_1: return dequant_rows_Q4_1;
    case Q5_0: return dequant_rows_Q5_0;
    case Q5_1: return dequant_rows_Q5_1;
    case Q8_0: return dequant_rows_Q8_0;
    case Q4_K: return dequant_rows_Q4_K;
    case Q5_K: return dequant_rows_Q5_K;
    case Q6_K: return dequant_rows_Q6_K;
    default: return 0;
    }
}

/* The float32 values of n weight rows (dequantized exactly as the kernel reads them), out (n, k). */
int dequantize_rows_f32(const uint8_t *w, int64_t w_stride, float *out, int n, int k, int type) {
    const dequant_fn rows = dequant_for(type);
    if (!rows || !linear_quant_row_bytes(type, k) || n < 0) return -1;
    rows(w, w_stride, out, 0, k, 0, n);
    return 0;
}

/* Weights per extra thread below which dequantize_rows_bf16 keeps one thread (a few microseconds of work). */
#define MIN_DEQUANT_PER_THREAD (1 << 16)

/* The bfloat16 values (float32's rounded to nearest even, as torch rounds) of n weight rows, out (n, k): a bfloat16
 * prompt's GEMM operand, made for one call (kernels/quant.py). Rows are split over the threads in equal shares. */
int dequantize_rows_bf16(const uint8_t *w, int64_t w_stride, uint16_t *out, int n, int k, int type, int threads) {
    const dequant_fn rows = dequant_for(type);
    if (!rows || !linear_quant_row_bytes(type, k) || n < 0) return -1;
    threads = threads_for(threads, (int64_t)n * k, MIN_DEQUANT_PER_THREAD);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int lo, hi;
        share(n, thread_index(), thread_count(), &lo, &hi);
        rows(w, w_stride, 0, out, k, lo, hi);
    }
    return 0;
}

/* Weight rows per panel of the fused bfloat16 prompt path: one column group of the vdpbf16ps kernel (4 x 16). */
#define FUSED_ROWS 64

/* y (m, n) = x (m, k) w^T (+ bias), x, y and bias bfloat16, for a bfloat16 prompt: per 64 weight rows, a thread
 * dequantizes them to bfloat16 (dequantize_rows_bf16's values), packs them into the tiles both bfloat16 kernels read
 * and runs every row of x through them while they sit in L2 (the matrix engine's x packed into its 32 x 32 panels
 * once first). The layer is read once as blocks and never written out whole nor reordered, as dequantizing it for a
 * oneDNN GEMM did on every call. Threads split the panels; each output is the engine's dense kernel's on the layer's
 * bfloat16 values, whatever the thread count. The caller checks that the engine runs here. */
static int fused_bf16(Engine engine, const uint16_t *x, int64_t x_stride, const uint8_t *w, int64_t w_stride,
                      const uint16_t *bias, uint16_t *y, int64_t y_stride, int m, int n, int k, int type, int threads) {
    const dequant_fn rows = dequant_for(type);
    if (!rows || !linear_quant_row_bytes(type, k) || k % 32 || m <= 0 || n <= 0) return -1;
    const int panels = (n + FUSED_ROWS - 1) / FUSED_ROWS, rblocks = engine == MATRIX_ENGINE ? (m + 31) / 32 : 0;
    const int64_t panel = (int64_t)FUSED_ROWS * k;
    threads = threads_for(threads, panels, 2);
    uint16_t *xp = rblocks ? aligned_alloc(64, sizeof(uint16_t) * rblocks * 32 * k) : NULL;
    uint16_t *scratch = aligned_alloc(64, sizeof(uint16_t) * 2 * panel * threads);
    if (!scratch || (rblocks && !xp)) {
        free(xp), free(scratch);
        return -1;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        uint16_t *plain = scratch + 2 * panel * thread_index(), *tiles = plain + panel;
        int lo, hi;
#ifdef HAVE_AMX_LINEAR
        if (engine == MATRIX_ENGINE) {
            share(rblocks, thread_index(), thread_count(), &lo, &hi);
            pack_rows(x, x_stride, m, k, lo, hi, xp);
#pragma omp barrier
        }
#endif
        share(panels, thread_index(), thread_count(), &lo, &hi);
        for (int p = lo; p < hi; p++) {
            const int r0 = FUSED_ROWS * p, nr = n - r0 < FUSED_ROWS ? n - r0 : FUSED_ROWS;
            rows(w + (int64_t)r0 * w_stride, w_stride, 0, plain, k, 0, nr);
            dpbf16_pack_rows(plain, k, nr, k, tiles);
#ifdef HAVE_AMX_LINEAR
            if (engine == MATRIX_ENGINE) {
                column_blocks(xp, tiles, bias ? bias + r0 : NULL, y + r0, y_stride, m, nr, k, 0, (nr + 15) / 16);
                continue;
            }
#endif
            dpbf16_column_group(x, x_stride, tiles, k / 32, bias ? bias + r0 : NULL, y + r0, y_stride, m,
                                (nr + 15) / 16, nr);
        }
    }
    free(xp), free(scratch);
    return 0;
}

/* fused_bf16 on vdpbf16ps: -1 where the CPU lacks it (the caller dequantizes instead). */
int linear_quant_dpbf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, const uint16_t *bias,
                        uint16_t *y, int64_t y_stride, int m, int n, int k, int type, int threads) {
    if (!linear_dpbf16_available()) return -1;
    return fused_bf16(DOT_PRODUCTS, x, x_stride, w, w_stride, bias, y, y_stride, m, n, k, type, threads);
}

/* fused_bf16 on the matrix engine: -1 where this process may not use AMX (the caller dequantizes instead). */
int linear_quant_amx_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, const uint16_t *bias,
                          uint16_t *y, int64_t y_stride, int m, int n, int k, int type, int threads) {
    if (!amx_usable()) return -1;
    return fused_bf16(MATRIX_ENGINE, x, x_stride, w, w_stride, bias, y, y_stride, m, n, k, type, threads);
}
