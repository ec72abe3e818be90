/* Float32 linear layers with AVX-512: y (m, n) = x (m, k) w^T (+ bias), w (n, k) row-major as torch keeps it, no
 * packing, any number of rows.
 *
 * One summation order for every output: lane l of a 16-lane accumulator takes the products at k = l, l + 16, ... in
 * increasing k, one fused multiply-add each; the lanes are then added by a fixed pairwise tree (l with l + 8, then
 * l + 4, l + 2, l + 1). Nothing in that order depends on m, on the row's place in its batch, on the block shape or
 * on the thread count, so a row's result is bit for bit the same alone or in any batch: a seeded request's tokens do
 * not depend on which requests share its steps, and a stream resumed on another replica continues as it would have.
 * MKL's sgemm is not batch-invariant (its rows differ between fewer and more than sixteen rows).
 *
 * Blocking: a block of NR consecutive weight rows (contiguous, so the hardware prefetcher follows) stays in L1 while
 * it meets every MR-row block of a chunk of x rows sized to stay in L2. For a decode batch the chunk is the whole
 * batch, so every weight row is read from memory once whatever m is; sgemm switches, from about four rows on, to a
 * path that costs up to twice as much per step (benchmarks/RESULTS.md).
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "parallel.h"

/* Bytes of x a chunk may take: about half of a core's L2, the rest for the weight blocks streaming through. */
#define X_CHUNK_BYTES (512 * 1024)
/* Rows above which a batch is a prompt's: x streams from L2 rather than the weight from memory. */
#define PROMPT_ROWS 16
/* Bytes of weight rows a block may keep in L1 beside the x rows streaming through. */
#define L1_WEIGHT_BYTES (32 * 1024)
/* How far ahead, in weight blocks, a one-block batch asks for the weight. */
#define PREFETCH_BLOCKS 2
/* Multiply-adds per extra thread below which one thread does the whole layer (waking one costs microseconds). */
#define MIN_WORK_PER_THREAD (1 << 16)

/* The 16 accumulators' lanes added by the pairwise tree, all 16 at once: lane l of the result is the sum of v[p(l)]
 * with p(l) = 4 (l % 4) + l / 4 (a 4 x 4 transpose). Every step adds lanes of one input only, so each result is
 * that input's tree sum whatever the other inputs hold. */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 v[16]) {
    __m512 s[8], t[4], u[2];
    for (int p = 0; p < 8; p++) /* lane j with j + 8: [v[2p] 8 lanes, v[2p + 1] 8 lanes] */
        s[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
    for (int q = 0; q < 4; q++) /* j with j + 4: quarter r holds v[4q + r], 4 lanes */
        t[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0xDD));
    for (int h = 0; h < 2; h++) /* j with j + 2: quarter r holds v[8h + r], v[8h + 4 + r], 2 lanes each */
        u[h] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * h], t[2 * h + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * h], t[2 * h + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* j with j + 1: quarter r holds v[r], v[4 + r], v[8 + r], v[12 + r] */
    return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* out[i * width + j] = x row i . w row j for i < mr, j < nr <= width (mr * width <= 16); `prefetch` asks for the
 * weight block PREFETCH_BLOCKS ahead meanwhile (where each block meets one block of x, the block's compute is too short
 * for the hardware prefetcher to keep memory busy). mr, nr, width and prefetch are constants where this is inlined, so each call site is its own fully unrolled loop nest with its accumulators in registers. */
static inline __attribute__((always_inline)) void dot_block(const float *x, int64_t x_stride, const float *w, int k,
                                                            int mr, int nr, int width, int prefetch, float out[16]) {
    __m512 acc[16];
    for (int l = 0; l < 16; l++) acc[l] = _mm512_setzero_ps();
    int kk = 0;
    for (; kk + 16 <= k; kk += 16) {
        __m512 wv[16];
        if (prefetch) /* the same line of the weight block PREFETCH_BLOCKS ahead: a hint, it never faults */
            for (int j = 0; j < nr; j++)
                _mm_prefetch((const char *)(w + (int64_t)(PREFETCH_BLOCKS * width + j) * k + kk), _MM_HINT_T0);
        for (int j = 0; j < nr; j++) wv[j] = _mm512_loadu_ps(w + (int64_t)j * k + kk);
        for (int i = 0; i < mr; i++) {
            const __m512 xv = _mm512_loadu_ps(x + (int64_t)i * x_stride + kk);
            for (int j = 0; j < nr; j++) acc[i * width + j] = _mm512_fmadd_ps(xv, wv[j], acc[i * width + j]);
        }
    }
    if (kk < k) { /* the last k % 16 columns: masked loads read zeros past the end */
        const __mmask16 mask = (__mmask16)((1u << (k - kk)) - 1);
        __m512 wv[16];
        for (int j = 0; j < nr; j++) wv[j] = _mm512_maskz_loadu_ps(mask, w + (int64_t)j * k + kk);
        for (int i = 0; i < mr; i++) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + (int64_t)i * x_stride + kk);
            for (int j = 0; j < nr; j++) acc[i * width + j] = _mm512_fmadd_ps(xv, wv[j], acc[i * width + j]);
        }
    }
    __m512 v[16]; /* in the order reduce16 transposes back */
    for (int l = 0; l < 16; l++) v[4 * (l % 4) + l / 4] = acc[l];
    _mm512_storeu_ps(out, reduce16(v));
}

static inline __attribute__((always_inline)) void store_block(const float out[16], const float *bias, float *y,
                                                              int64_t y_stride, int mr, int nr, int width) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[(int64_t)i * y_stride + j] = out[i * width + j] + (bias ? bias[j] : 0.0f);
}

/* Rows [0, m) of x against weight rows [lo, hi) in blocks of MR rows of x by NR weight rows (MR * NR == 16),
 * `chunk` rows of x at a time; a block short of rows or weight rows runs with fewer accumulators, never with padding
 * that would read past the tensors. MR and NR are constants where this is inlined. */
static inline __attribute__((always_inline)) void columns(const float *x, int64_t x_stride, const float *w,
                                                          const float *bias, float *y, int64_t y_stride, int m, int k,
                                                          int lo, int hi, int chunk, int MR, int NR) {
    float out[16];
    for (int c0 = 0; c0 < m; c0 += chunk) {
        const int c1 = m - c0 < chunk ? m : c0 + chunk;
        for (int n0 = lo; n0 < hi; n0 += NR) {
            const int nr = hi - n0 < NR ? hi - n0 : NR;
            const float *wb = w + (int64_t)n0 * k;
            const float *bb = bias ? bias + n0 : 0;
            for (int i0 = c0; i0 < c1; i0 += MR) {
                const int mr = c1 - i0 < MR ? c1 - i0 : MR;
                const float *xb = x + (int64_t)i0 * x_stride;
                float *yb = y + (int64_t)i0 * y_stride + n0;
                if (nr == NR) { /* constant block shapes: each call below is its own unrolled loop nest */
                    if (m <= MR) { /* the whole batch in one block: the weight streams from memory */
                        if (MR >= 4 && mr == 4) dot_block(xb, x_stride, wb, k, 4, NR, NR, 1, out);
                        else if (MR >= 3 && mr == 3) dot_block(xb, x_stride, wb, k, 3, NR, NR, 1, out);
                        else if (MR >= 2 && mr == 2) dot_block(xb, x_stride, wb, k, 2, NR, NR, 1, out);
                        else dot_block(xb, x_stride, wb, k, 1, NR, NR, 1, out);
                    } else if (MR >= 4 && mr == 4) dot_block(xb, x_stride, wb, k, 4, NR, NR, 0, out);
                    else if (MR >= 3 && mr == 3) dot_block(xb, x_stride, wb, k, 3, NR, NR, 0, out);
                    else if (MR >= 2 && mr == 2) dot_block(xb, x_stride, wb, k, 2, NR, NR, 0, out);
                    else dot_block(xb, x_stride, wb, k, 1, NR, NR, 0, out);
                    store_block(out, bb, yb, y_stride, mr, NR, NR);
                } else {
                    for (int j = 0; j < nr; j++)
                        for (int i = 0; i < mr; i++) {
                            dot_block(xb + (int64_t)i * x_stride, x_stride, wb + (int64_t)j * k, k, 1, 1, 1, 0, out);
                            store_block(out, bb ? bb + j : 0, yb + (int64_t)i * y_stride + j, y_stride, 1, 1, 1);
                        }
                }
            }
        }
    }
}

/* Four rows by four weight rows: a decode batch reads each weight row once, and, at prompt sizes, weights too long for
 * eight rows of them to stay in L1. */
static void columns_4x4(const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
                        int64_t y_stride, int m, int k, int lo, int hi, int chunk) {
    columns(x, x_stride, w, bias, y, y_stride, m, k, lo, hi, chunk, 4, 4);
}

/* Two rows by eight weight rows: at prompt sizes x streams from L2, and this shape reads half as much of it per
 * multiply-add as 4 x 4. */
static void columns_2x8(const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
                        int64_t y_stride, int m, int k, int lo, int hi, int chunk) {
    columns(x, x_stride, w, bias, y, y_stride, m, k, lo, hi, chunk, 2, 8);
}

int linear_f32_available(void) { return 1; }

int linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *y, int64_t y_stride, int m,
               int n, int k, int threads) {
    if (m <= 0 || n <= 0 || k <= 0) return -1;
    const int wide = m > PROMPT_ROWS && (int64_t)8 * k * (int64_t)sizeof(float) <= L1_WEIGHT_BYTES;
    const int nr = wide ? 8 : 4;
    int chunk = (int)(X_CHUNK_BYTES / ((int64_t)k * (int64_t)sizeof(float))) / 4 * 4;
    if (chunk < 4) chunk = 4;
    const int blocks = (n + nr - 1) / nr;
    threads = threads_for(threads, (int64_t)m * n * k, MIN_WORK_PER_THREAD);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int lo, hi;
        share(blocks, thread_index(), thread_count(), &lo, &hi);
        hi = nr * hi < n ? nr * hi : n;
        if (nr * lo < hi) {
            if (wide) columns_2x8(x, x_stride, w, bias, y, y_stride, m, k, nr * lo, hi, chunk);
            else columns_4x4(x, x_stride, w, bias, y, y_stride, m, k, nr * lo, hi, chunk);
        }
    }
    return 0;
}

#else
int linear_f32_available(void) { return 0; }
int linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *y, int64_t y_stride, int m,
               int n, int k, int threads) {
    (void)x, (void)x_stride, (void)w, (void)bias, (void)y, (void)y_stride, (void)m, (void)n, (void)k, (void)threads;
    return -1;
}
#endif
