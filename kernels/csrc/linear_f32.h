/* The packed float32 layout and the micro-kernels of linear_f32.c (its opening comment says how they work), shared
 * with the kernels that run the same GEMMs in other arrangements (moe.c: each expert's gate/up and down over the
 * tokens routed to it). Every output's sum follows the one chain linear_f32.c documents, whichever file calls them, so
 * their results are the dense layers' bit for bit. LINEAR_F32_KERNELS is defined where the CPU runs them (AVX-512,
 * or AVX2 with FMA). */
#ifndef FASTGEN_LINEAR_F32_H
#define FASTGEN_LINEAR_F32_H
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define LINEAR_F32_KERNELS 1

#include <immintrin.h>

#include "parallel.h"

#if defined(__AVX512F__)
#include "vector_math.h"

#define GATED 1
/* Rows per micro-kernel: 2 MR accumulators, two weight vectors and a broadcast fill the 32 vector registers. */
#define MR 12
/* Rows up to which a decode batch streams two panels at once. */
#define PAIR_ROWS 4
/* Panels per group: NB KC 32 floats of weight stay in L2 while every strip of the batch meets them. */
#define NB 8

typedef __m512 v16;
typedef __mmask16 m16;
static inline v16 v16_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v16_set1(float x) { return _mm512_set1_ps(x); }
static inline v16 v16_load(const float *p) { return _mm512_loadu_ps(p); }
static inline v16 v16_load_masked(m16 m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }
static inline void v16_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
static inline void v16_store_masked(float *p, m16 m, v16 v) { _mm512_mask_storeu_ps(p, m, v); }
static inline v16 v16_fmadd(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v16_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
#else
#define GATED 0
/* 4 MR accumulators, a broadcast and the weight fill the 16 vector registers. */
#define MR 3
#define PAIR_ROWS 1
/* Half of AVX-512's: AVX2 CPUs have L2s of 256 KiB to 1 MiB. */
#define NB 4

typedef struct {
    __m256 lo, hi;
} v16;
typedef unsigned m16;
/* Lanes [8 half, 8 half + 8) of a 16-bit mask as an AVX2 mask: masked-off lanes are neither read nor written. */
static inline __m256i lanes(m16 m, int half) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)(m >> (8 * half))), bit), bit);
}
static inline v16 v16_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline v16 v16_set1(float x) { return (v16){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline v16 v16_load(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline v16 v16_load_masked(m16 m, const float *p) {
    return (v16){_mm256_maskload_ps(p, lanes(m, 0)), _mm256_maskload_ps(p + 8, lanes(m, 1))};
}
static inline void v16_store(float *p, v16 v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
static inline void v16_store_masked(float *p, m16 m, v16 v) {
    _mm256_maskstore_ps(p, lanes(m, 0), v.lo), _mm256_maskstore_ps(p + 8, lanes(m, 1), v.hi);
}
static inline v16 v16_fmadd(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline v16 v16_add(v16 a, v16 b) { return (v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
#endif

/* Output features per panel: two 16-lane vectors. */
#define NP 32
/* Most k steps per block: a strip's share of x (MR KC floats) stays in L1 beside the weight streaming through. */
#define KC 576
/* How far ahead, in k steps, a prompt's strip asks L1 for the weight it streams from L2. */
#define L2_AHEAD 8
/* How far ahead, in k steps of one panel, a decode batch asks for the weight it streams from memory (the hardware
 * prefetcher alone leaves memory idle between the short bursts of a few rows). */
#define MEMORY_AHEAD 32
/* Multiply-adds per extra thread below which one thread does the whole layer (waking one costs microseconds). */
#define MIN_WORK_PER_THREAD (1 << 16)
/* A product rounded on its own, never contracted into a multiply-add: silu(gate) * up as elementwise_f32.c has it. */
#define EXACT _MM_FROUND_CUR_DIRECTION

/* Rows [0, mr) of x (row i at a + i as) against k steps of one panel (b): y = the sums so far (none when `first`)
 * plus these steps, plus bias when given (the last block). Columns past n are masked off (m0, m1). The weight is
 * asked for `ahead` steps before use. mr and ahead are constants where this is inlined. A gated panel's last block
 * stores silu(gate) * up (its two halves) to h instead of its sums to y. */
static inline __attribute__((always_inline)) void strip(const float *a, int64_t as, const float *b, int k, float *y,
                                                        int64_t ys, int mr, m16 m0, m16 m1, int first,
                                                        const float *bias, int ahead, float *h, int64_t hs) {
    v16 acc[12][2]; /* the largest MR: mr, a constant, decides how many rows live in registers */
    for (int i = 0; i < mr; i++) {
        acc[i][0] = first ? v16_zero() : v16_load_masked(m0, y + i * ys);
        acc[i][1] = first ? v16_zero() : v16_load_masked(m1, y + i * ys + 16);
    }
    for (int kk = 0; kk < k; kk++) { /* the prefetches are hints: they never fault, past the end included */
        _mm_prefetch((const char *)(b + (int64_t)(kk + ahead) * NP), _MM_HINT_T0);
        _mm_prefetch((const char *)(b + (int64_t)(kk + ahead) * NP + 16), _MM_HINT_T0);
        const v16 b0 = v16_load(b + (int64_t)kk * NP), b1 = v16_load(b + (int64_t)kk * NP + 16);
        for (int i = 0; i < mr; i++) {
            const v16 x = v16_set1(a[i * as + kk]);
            acc[i][0] = v16_fmadd(x, b0, acc[i][0]);
            acc[i][1] = v16_fmadd(x, b1, acc[i][1]);
        }
    }
#if GATED
    if (h) {
        for (int i = 0; i < mr; i++)
            _mm512_mask_storeu_ps(h + i * hs, m0, _mm512_mul_round_ps(silu_ps(acc[i][0]), acc[i][1], EXACT));
        return;
    }
#else
    (void)h, (void)hs;
#endif
    const v16 c0 = bias ? v16_load_masked(m0, bias) : v16_zero();
    const v16 c1 = bias ? v16_load_masked(m1, bias + 16) : v16_zero();
    for (int i = 0; i < mr; i++) {
        v16_store_masked(y + i * ys, m0, bias ? v16_add(acc[i][0], c0) : acc[i][0]);
        v16_store_masked(y + i * ys + 16, m1, bias ? v16_add(acc[i][1], c1) : acc[i][1]);
    }
}

/* strip() with mr a constant: each case is its own unrolled loop nest with its accumulators in registers. The first
 * strip to meet a weight streams it from memory; the others find it in L2. */
#define STRIP_CASE(R)                                                                                                  \
    case R:                                                                                                            \
        if (from_memory) strip(a, as, b, k, y, ys, R, m0, m1, first, bias, MEMORY_AHEAD, h, hs);                       \
        else strip(a, as, b, k, y, ys, R, m0, m1, first, bias, L2_AHEAD, h, hs);                                       \
        break;
static void strip_rows(const float *a, int64_t as, const float *b, int k, float *y, int64_t ys, int mr, m16 m0, m16 m1,
                       int first, const float *bias, int from_memory, float *h, int64_t hs) {
    switch (mr) {
        STRIP_CASE(1) STRIP_CASE(2) STRIP_CASE(3) STRIP_CASE(4) STRIP_CASE(5) STRIP_CASE(6)
        STRIP_CASE(7) STRIP_CASE(8) STRIP_CASE(9) STRIP_CASE(10) STRIP_CASE(11) STRIP_CASE(12)
    }
}

/* A decode batch of at most PAIR_ROWS rows (of stride as) against two adjacent full panels at once: two weight
 * streams in flight instead of one, which a batch this small needs to keep memory busy. Each output's chain is
 * strip()'s, so results are the same bit for bit. mr is a constant where this is inlined. Gated panels store
 * silu(gate) * up to h instead of their sums to y. */
static inline __attribute__((always_inline)) void strip_pair(const float *a, int64_t as, const float *b, int k,
                                                             const float *bias, float *y, int64_t ys, int mr, float *h,
                                                             int64_t hs) {
    v16 acc[4][4]; /* the largest PAIR_ROWS */
    const float *b2 = b + (int64_t)k * NP;
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < 4; c++) acc[i][c] = v16_zero();
    for (int kk = 0; kk < k; kk++) {
        for (int c = 0; c < 2; c++) {
            _mm_prefetch((const char *)(b + (int64_t)(kk + MEMORY_AHEAD) * NP + 16 * c), _MM_HINT_T0);
            _mm_prefetch((const char *)(b2 + (int64_t)(kk + MEMORY_AHEAD) * NP + 16 * c), _MM_HINT_T0);
        }
        const v16 w[4] = {v16_load(b + (int64_t)kk * NP), v16_load(b + (int64_t)kk * NP + 16),
                          v16_load(b2 + (int64_t)kk * NP), v16_load(b2 + (int64_t)kk * NP + 16)};
        for (int i = 0; i < mr; i++) {
            const v16 x = v16_set1(a[i * as + kk]);
            for (int c = 0; c < 4; c++) acc[i][c] = v16_fmadd(x, w[c], acc[i][c]);
        }
    }
#if GATED
    if (h) {
        for (int i = 0; i < mr; i++)
            for (int c = 0; c < 2; c++)
                _mm512_storeu_ps(h + i * hs + 16 * c,
                                 _mm512_mul_round_ps(silu_ps(acc[i][2 * c]), acc[i][2 * c + 1], EXACT));
        return;
    }
#else
    (void)h, (void)hs;
#endif
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < 4; c++)
            v16_store(y + i * ys + 16 * c, bias ? v16_add(acc[i][c], v16_load(bias + 16 * c)) : acc[i][c]);
}

static void pair_rows(const float *a, int64_t as, const float *b, int k, const float *bias, float *y, int64_t ys,
                      int mr, float *h, int64_t hs) {
    switch (mr) {
    case 1: strip_pair(a, as, b, k, bias, y, ys, 1, h, hs); break;
    case 2: strip_pair(a, as, b, k, bias, y, ys, 2, h, hs); break;
    case 3: strip_pair(a, as, b, k, bias, y, ys, 3, h, hs); break;
    default: strip_pair(a, as, b, k, bias, y, ys, 4, h, hs); break;
    }
}

/* The outputs panel p covers, up to n: 32 columns of y, or, gated, 16 columns of h (gate and up in its halves). */
static inline int panel_width(int gated) { return gated ? NP / 2 : NP; }

static inline void panel_masks(int n, int p, int gated, m16 *m0, m16 *m1) {
    const int width = panel_width(gated), cols = n - p * width < width ? n - p * width : width;
    *m0 = cols >= 16 ? 0xFFFF : (m16)((1u << cols) - 1);
    *m1 = gated ? *m0 : cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (m16)((1u << (cols - 16)) - 1);
}

/* A decode batch (m <= MR) against panels [lo, hi), each streamed once from memory, two at a time where it helps.
 * Gated (h given): silu(gate) * up to h, y unused. */
static void decode_panels(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y,
                          int64_t y_stride, int m, int n, int k, int lo, int hi, float *h, int64_t h_stride) {
    const int width = panel_width(h != 0);
    for (int p = lo; p < hi; p++) {
        const float *b = packed + (int64_t)p * k * NP, *bp = bias ? bias + p * NP : 0;
        float *yp = h ? 0 : y + p * NP, *hp = h ? h + p * width : 0;
        if (m <= PAIR_ROWS && p + 1 < hi && n - (p + 1) * width >= width) {
            pair_rows(x, x_stride, b, k, bp, yp, y_stride, m, hp, h_stride);
            p++;
            continue;
        }
        m16 m0, m1;
        panel_masks(n, p, h != 0, &m0, &m1);
        strip_rows(x, x_stride, b, k, yp, y_stride, m, m0, m1, 1, bp, 1, hp, h_stride);
    }
}

/* Any batch against panels [lo, hi): groups of NB panels, then k blocks, then MR-row strips, then the group's panels.
 * The first strip to meet a group's block streams it from memory. Gated (h given), the sums between k blocks go to
 * y, a scratch holding one group's panels side by side (NB NP columns), and the last block writes h. */
static void blocked_panels(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y,
                           int64_t y_stride, int m, int n, int k, int lo, int hi, float *h, int64_t h_stride) {
    const int blocks = (k + KC - 1) / KC, kc = (k + blocks - 1) / blocks; /* equal blocks */
    const int width = panel_width(h != 0);
    for (int g = lo; g < hi; g += NB) {
        const int g1 = hi - g < NB ? hi : g + NB;
        for (int k0 = 0; k0 < k; k0 += kc) {
            const int steps = k - k0 < kc ? k - k0 : kc, first = k0 == 0, last = k0 + steps == k;
            for (int i0 = 0; i0 < m; i0 += MR) {
                const int mr = m - i0 < MR ? m - i0 : MR;
                for (int p = g; p < g1; p++) {
                    m16 m0, m1;
                    panel_masks(n, p, h != 0, &m0, &m1);
                    float *sums = !y ? 0 : y + (int64_t)i0 * y_stride + (h ? p - g : p) * NP;
                    strip_rows(x + (int64_t)i0 * x_stride + k0, x_stride, packed + ((int64_t)p * k + k0) * NP, steps,
                               sums, y_stride, mr, m0, m1, first, last && bias ? bias + p * NP : 0, i0 == 0,
                               last && h ? h + (int64_t)i0 * h_stride + p * width : 0, h_stride);
                }
            }
        }
    }
}

#endif
#endif
