/* Float32 linear layers with AVX-512: y (m, n) = x (m, k) w^T (+ bias), any number of rows, the weight packed once at
 * load into panels of 32 output features: packed[p][kk][j] = w[32 p + j][kk], n padded with zero rows to a multiple
 * of 32 (kernels/cpu.py pack_f32).
 *
 * One summation order for every output: y[i][j] = fma(x[i][k-1], w[j][k-1], ... fma(x[i][1], w[j][1], x[i][0] w[j][0]))
 * in increasing k, one rounding per multiply-add, then + bias[j]. Nothing in that order depends on m, on the row's
 * place in its batch, on the block shape or on the thread count, so a row's result is bit for bit the same alone or
 * in any batch: a seeded request's tokens do not depend on which requests share its steps, and a stream resumed on
 * another replica continues as it would have. MKL's sgemm is not batch-invariant (its rows differ between fewer and
 * more than sixteen rows).
 *
 * The micro-kernel is an outer product: MR rows of x against one panel, one 16-lane accumulator per row and half
 * panel, so every accumulator is one output's sequential chain and nothing is reduced across lanes. Each thread takes
 * a share of the panels. A batch of at most MR rows (decode) streams each of its panels once from memory, asking for
 * the weight ahead of use (two panels side by side for the smallest batches); a larger batch is cut into chunks of
 * rows that stay in L2, packed into MR-row strips so the micro-kernel broadcasts from one sequential stream, and each
 * panel meets every strip of a chunk while it stays in L2, the next panel requested meanwhile. The whole k runs in
 * one pass: no partial sums are stored. */
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "parallel.h"

/* Output features per panel: two vectors. */
#define NP 32
/* Rows per micro-kernel: 2 MR accumulators, two weight vectors and a broadcast fill the 32 vector registers. */
#define MR 12
/* Bytes of x a chunk of rows may take: about a quarter of a core's L2, beside the panel streaming through it. */
#define X_CHUNK_BYTES (288 * 1024)
/* Rows up to which a decode batch streams two panels at once. */
#define PAIR_ROWS 4
/* How far ahead, in k steps of one panel, a decode batch asks for the weight (the hardware prefetcher alone leaves
 * memory idle between the short bursts of a few rows). */
#define PREFETCH_STEPS 32
/* Multiply-adds per extra thread below which one thread does the whole layer (waking one costs microseconds). */
#define MIN_WORK_PER_THREAD (1 << 16)

/* Rows [0, mr) of a strip against one panel (k steps of NP weights): the row-i value at step kk is a[i * as + kk * ak]
 * (a row-major x: as = its stride, ak = 1; a packed strip: as = 1, ak = MR). Columns past n are masked off (m0, m1).
 * `ahead` asks for the weight PREFETCH_STEPS steps ahead; `next`, when set, is `lines` cache lines of the next panel
 * to ask L2 for, one every four steps. mr, ak and ahead are constants where this is inlined. */
static inline __attribute__((always_inline)) void strip(const float *a, int64_t as, int64_t ak, const float *b, int k,
                                                        const float *bias, float *y, int64_t ys, int mr,
                                                        __mmask16 m0, __mmask16 m1, int ahead, const char *next,
                                                        int lines) {
    __m512 acc[MR][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int kk = 0; kk < k; kk++) {
        if (ahead) { /* a hint: it never faults, past the end included */
            _mm_prefetch((const char *)(b + (int64_t)(kk + PREFETCH_STEPS) * NP), _MM_HINT_T0);
            _mm_prefetch((const char *)(b + (int64_t)(kk + PREFETCH_STEPS) * NP + 16), _MM_HINT_T0);
        }
        if ((kk & 3) == 0 && (kk >> 2) < lines) _mm_prefetch(next + (int64_t)(kk >> 2) * 64, _MM_HINT_T1);
        const __m512 b0 = _mm512_loadu_ps(b + (int64_t)kk * NP), b1 = _mm512_loadu_ps(b + (int64_t)kk * NP + 16);
        for (int i = 0; i < mr; i++) {
            const __m512 x = _mm512_set1_ps(a[i * as + kk * ak]);
            acc[i][0] = _mm512_fmadd_ps(x, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(x, b1, acc[i][1]);
        }
    }
    const __m512 c0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 c1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    for (int i = 0; i < mr; i++) {
        _mm512_mask_storeu_ps(y + i * ys, m0, bias ? _mm512_add_ps(acc[i][0], c0) : acc[i][0]);
        _mm512_mask_storeu_ps(y + i * ys + 16, m1, bias ? _mm512_add_ps(acc[i][1], c1) : acc[i][1]);
    }
}

/* strip() with mr a constant: each case is its own unrolled loop nest with its accumulators in registers. A packed
 * strip (as == 0) is a prompt's; rows of x (as: their stride) are a decode batch's, which asks for its weight ahead. */
#define STRIP_CASE(R)                                                                                                  \
    case R:                                                                                                            \
        if (as == 0) strip(a, 1, MR, b, k, bias, y, ys, R, m0, m1, 0, next, lines);                                    \
        else strip(a, as, 1, b, k, bias, y, ys, R, m0, m1, 1, next, lines);                                            \
        break;
static void strip_rows(const float *a, int64_t as, const float *b, int k, const float *bias, float *y, int64_t ys,
                       int mr, __mmask16 m0, __mmask16 m1, const char *next, int lines) {
    switch (mr) {
        STRIP_CASE(1) STRIP_CASE(2) STRIP_CASE(3) STRIP_CASE(4) STRIP_CASE(5) STRIP_CASE(6)
        STRIP_CASE(7) STRIP_CASE(8) STRIP_CASE(9) STRIP_CASE(10) STRIP_CASE(11) STRIP_CASE(12)
    }
}

/* A decode batch of at most PAIR_ROWS rows (of stride as) against two adjacent full panels at once: two weight
 * streams in flight instead of one, which a batch this small needs to keep memory busy. Each output's chain is
 * strip()'s, so results are the same bit for bit. mr is a constant where this is inlined. */
static inline __attribute__((always_inline)) void strip_pair(const float *a, int64_t as, const float *b, int k,
                                                             const float *bias, float *y, int64_t ys, int mr) {
    __m512 acc[PAIR_ROWS][4];
    const float *b2 = b + (int64_t)k * NP;
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < 4; c++) acc[i][c] = _mm512_setzero_ps();
    for (int kk = 0; kk < k; kk++) {
        for (int c = 0; c < 2; c++) {
            _mm_prefetch((const char *)(b + (int64_t)(kk + PREFETCH_STEPS) * NP + 16 * c), _MM_HINT_T0);
            _mm_prefetch((const char *)(b2 + (int64_t)(kk + PREFETCH_STEPS) * NP + 16 * c), _MM_HINT_T0);
        }
        const __m512 w[4] = {_mm512_loadu_ps(b + (int64_t)kk * NP), _mm512_loadu_ps(b + (int64_t)kk * NP + 16),
                             _mm512_loadu_ps(b2 + (int64_t)kk * NP), _mm512_loadu_ps(b2 + (int64_t)kk * NP + 16)};
        for (int i = 0; i < mr; i++) {
            const __m512 x = _mm512_set1_ps(a[i * as + kk]);
            for (int c = 0; c < 4; c++) acc[i][c] = _mm512_fmadd_ps(x, w[c], acc[i][c]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < 4; c++)
            _mm512_storeu_ps(y + i * ys + 16 * c,
                             bias ? _mm512_add_ps(acc[i][c], _mm512_loadu_ps(bias + 16 * c)) : acc[i][c]);
}

static void pair_rows(const float *a, int64_t as, const float *b, int k, const float *bias, float *y, int64_t ys,
                      int mr) {
    switch (mr) {
    case 1: strip_pair(a, as, b, k, bias, y, ys, 1); break;
    case 2: strip_pair(a, as, b, k, bias, y, ys, 2); break;
    case 3: strip_pair(a, as, b, k, bias, y, ys, 3); break;
    default: strip_pair(a, as, b, k, bias, y, ys, 4); break;
    }
}

/* Rows [c0, c1) of x in MR-row strips, strip s at strips + s MR k: element (i, kk) at [kk MR + i]; a short last strip
 * leaves its missing rows unwritten (the micro-kernel never reads them). */
static void pack_rows(const float *x, int64_t x_stride, int k, int c0, int c1, float *strips) {
    for (int i0 = c0; i0 < c1; i0 += MR) {
        const int mr = c1 - i0 < MR ? c1 - i0 : MR;
        float *dst = strips + (int64_t)(i0 - c0) * k;
        for (int i = 0; i < mr; i++)
            for (int kk = 0; kk < k; kk++) dst[(int64_t)kk * MR + i] = x[(int64_t)(i0 + i) * x_stride + kk];
    }
}

/* Panels [lo, hi) for all m rows; `strips` (chunk * k floats) holds a chunk of packed rows when m > MR. */
static void panels(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y,
                   int64_t y_stride, int m, int n, int k, int lo, int hi, int chunk, float *strips) {
    for (int c0 = 0; c0 < m; c0 += chunk) {
        const int c1 = m - c0 < chunk ? m : c0 + chunk;
        if (strips) pack_rows(x, x_stride, k, c0, c1, strips);
        const int calls = (c1 - c0 + MR - 1) / MR;
        for (int p = lo; p < hi; p++) {
            if (!strips && m <= PAIR_ROWS && p + 1 < hi && n - (p + 1) * NP >= NP) {
                pair_rows(x, x_stride, packed + (int64_t)p * k * NP, k, bias ? bias + p * NP : 0, y + p * NP, y_stride,
                          m);
                p++;
                continue;
            }
            const int cols = n - p * NP < NP ? n - p * NP : NP;
            const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
            const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
            const float *b = packed + (int64_t)p * k * NP;
            /* The next panel, a share of its lines asked for by each strip, so it is in L2 when this one ends. */
            const char *next = (const char *)(b + (int64_t)k * NP);
            const int64_t lines = p + 1 < hi && calls > 1 ? (int64_t)k * NP / 16 : 0;
            for (int i0 = c0, s = 0; i0 < c1; i0 += MR, s++) {
                const int mr = c1 - i0 < MR ? c1 - i0 : MR;
                const int64_t l0 = lines * s / calls, l1 = lines * (s + 1) / calls;
                const float *a = strips ? strips + (int64_t)(i0 - c0) * k : x + (int64_t)i0 * x_stride;
                strip_rows(a, strips ? 0 : x_stride, b, k, bias ? bias + p * NP : 0,
                           y + (int64_t)i0 * y_stride + p * NP, y_stride, mr, m0, m1, next + l0 * 64, (int)(l1 - l0));
            }
        }
    }
}

int linear_f32_available(void) { return 1; }

int linear_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y, int64_t y_stride,
               int m, int n, int k, int threads) {
    if (m <= 0 || n <= 0 || k <= 0 || x_stride < 1) return -1;
    int chunk = (int)(X_CHUNK_BYTES / ((int64_t)k * (int64_t)sizeof(float))) / MR * MR;
    if (chunk < MR) chunk = MR;
    if (chunk > m) chunk = m;
    threads = threads_for(threads, (int64_t)m * n * k, MIN_WORK_PER_THREAD);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        int lo, hi;
        share((n + NP - 1) / NP, thread_index(), thread_count(), &lo, &hi);
        /* whole strips: the last one of a chunk may be short of rows but is laid out MR wide */
        const size_t bytes = (size_t)((chunk + MR - 1) / MR * MR) * k * sizeof(float);
        float *strips = m > MR ? aligned_alloc(64, (bytes + 63) / 64 * 64) : 0;
        if (m > MR && !strips) failed = 1;
        else if (lo < hi) panels(x, x_stride, packed, bias, y, y_stride, m, n, k, lo, hi, chunk, strips);
        free(strips);
    }
    return failed ? -1 : 0;
}

#else
int linear_f32_available(void) { return 0; }
int linear_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y, int64_t y_stride,
               int m, int n, int k, int threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)y, (void)y_stride, (void)m, (void)n, (void)k,
        (void)threads;
    return -1;
}
#endif
