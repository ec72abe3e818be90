/* Float32 linear layers for a few rows (decode batches) with AVX-512: y (m, n) = x (m, k) w^T (+ bias), w (n, k)
 * row-major as torch keeps it, no packing.
 *
 * Why not MKL's sgemm: at a few rows a layer is bound by reading its weight once, and sgemm reads it at that speed
 * for one or two rows but switches, from about four rows on, to a path that costs up to twice as much per step
 * (benchmarks/RESULTS.md). Here every weight row is read from memory once whatever m is: a block of NB consecutive
 * weight rows (contiguous, so the hardware prefetcher follows) meets every MB-row block of x while it sits in L1.
 *
 * Each output is one dot product summed in a fixed order (16 lanes over k, then the lanes), whatever m, the row's
 * place in the batch, or the thread count: a row's result does not depend on the batch around it.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "parallel.h"

#define MB 4 /* rows of x per block: MB x NB accumulators and NB weight vectors fit the 32 registers */
#define NB 4 /* weight rows per block */
#define MAX_ROWS 16
/* Multiply-adds per extra thread below which one thread does the whole layer (waking one costs microseconds). */
#define MIN_WORK_PER_THREAD (1 << 16)

/* out[i][j] = x row i . w row j for i < mb, j < nb; mb and nb are constants where this is inlined. */
static inline __attribute__((always_inline)) void dot_block(const float *x, int64_t x_stride, const float *w, int k,
                                                            int mb, int nb, float out[MB][NB]) {
    __m512 acc[MB][NB];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm512_setzero_ps();
    int kk = 0;
    for (; kk + 16 <= k; kk += 16) {
        __m512 wv[NB];
        for (int j = 0; j < nb; j++) wv[j] = _mm512_loadu_ps(w + (int64_t)j * k + kk);
        for (int i = 0; i < mb; i++) {
            const __m512 xv = _mm512_loadu_ps(x + (int64_t)i * x_stride + kk);
            for (int j = 0; j < nb; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (kk < k) { /* the last k % 16 columns: masked loads read zeros past the end */
        const __mmask16 mask = (__mmask16)((1u << (k - kk)) - 1);
        __m512 wv[NB];
        for (int j = 0; j < nb; j++) wv[j] = _mm512_maskz_loadu_ps(mask, w + (int64_t)j * k + kk);
        for (int i = 0; i < mb; i++) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + (int64_t)i * x_stride + kk);
            for (int j = 0; j < nb; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

/* Rows [0, m) of x against weight rows [lo, hi). */
static void columns(const float *x, int64_t x_stride, const float *w, const float *bias, float *y, int64_t y_stride,
                    int m, int k, int lo, int hi) {
    float out[MB][NB];
    for (int n0 = lo; n0 < hi; n0 += NB) {
        const int nb = hi - n0 < NB ? hi - n0 : NB;
        const float *wb = w + (int64_t)n0 * k;
        for (int i0 = 0; i0 < m; i0 += MB) {
            const int mb = m - i0 < MB ? m - i0 : MB;
            const float *xb = x + (int64_t)i0 * x_stride;
            /* Constant block shapes, so each call below is its own fully unrolled loop nest. */
            if (nb == NB) {
                switch (mb) {
                case 4: dot_block(xb, x_stride, wb, k, 4, NB, out); break;
                case 3: dot_block(xb, x_stride, wb, k, 3, NB, out); break;
                case 2: dot_block(xb, x_stride, wb, k, 2, NB, out); break;
                default: dot_block(xb, x_stride, wb, k, 1, NB, out); break;
                }
            } else {
                for (int j = 0; j < nb; j++) {
                    float one[MB][NB];
                    for (int i = 0; i < mb; i++) {
                        dot_block(xb + (int64_t)i * x_stride, x_stride, wb + (int64_t)j * k, k, 1, 1, one);
                        out[i][j] = one[0][0];
                    }
                }
            }
            for (int i = 0; i < mb; i++)
                for (int j = 0; j < nb; j++)
                    y[(int64_t)(i0 + i) * y_stride + n0 + j] = out[i][j] + (bias ? bias[n0 + j] : 0.0f);
        }
    }
}

int linear_f32_available(void) { return 1; }

int linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *y, int64_t y_stride, int m,
               int n, int k, int threads) {
    if (m <= 0 || m > MAX_ROWS || n <= 0 || k <= 0) return -1;
    const int blocks = (n + NB - 1) / NB;
    threads = threads_for(threads, (int64_t)m * n * k, MIN_WORK_PER_THREAD);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int lo, hi;
        share(blocks, thread_index(), thread_count(), &lo, &hi);
        hi = NB * hi < n ? NB * hi : n;
        if (NB * lo < hi) columns(x, x_stride, w, bias, y, y_stride, m, k, NB * lo, hi);
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
