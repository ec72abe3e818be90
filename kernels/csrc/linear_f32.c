/* Float32 linear layers with AVX-512, or AVX2 with FMA: y (m, n) = x (m, k) w^T (+ bias), any number of rows, the
 * weight packed once at load into panels of 32 output features: packed[p][kk][j] = w[32 p + j][kk], n padded with
 * zero rows to a multiple of 32 (kernels/cpu.py pack_f32).
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
 * the weight ahead of use (two panels side by side for the smallest batches). A larger batch runs as BLIS does: k in
 * blocks of at most KC, and per block the thread's panels in groups of NB that stay in L2 while every MR-row strip of
 * x meets them, the strip's KC columns staying in L1 across the group. Each weight is read from memory once per
 * layer, x is read in place (no packing), and an output's partial sum goes to y between k blocks and comes back
 * unchanged, so the chain is the same as in one pass.
 *
 * The code is written once over a 16-lane vector (v16): one AVX-512 register, or two AVX2 registers. Every output's
 * chain is the same on both, so the two builds agree bit for bit; only the register budget differs (MR, PAIR_ROWS,
 * NB). SiLU(gate) * up on store (the gated panels) is built with AVX-512 only, where elementwise_f32.c's silu_mul,
 * which it must equal, runs too; elsewhere linear_f32_silu_mul_available() says no and the MLP takes two passes. */
#include <stdint.h>
#include <stdlib.h>

#include "linear_f32.h"

#ifdef LINEAR_F32_KERNELS
int linear_f32_available(void) { return 1; }

int linear_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y, int64_t y_stride,
               int m, int n, int k, int threads) {
    if (m <= 0 || n <= 0 || k <= 0 || x_stride < 1) return -1;
    threads = threads_for(threads, (int64_t)m * n * k, MIN_WORK_PER_THREAD);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int lo, hi;
        share((n + NP - 1) / NP, thread_index(), thread_count(), &lo, &hi);
        if (m <= MR) decode_panels(x, x_stride, packed, bias, y, y_stride, m, n, k, lo, hi, 0, 0);
        else blocked_panels(x, x_stride, packed, bias, y, y_stride, m, n, k, lo, hi, 0, 0);
    }
    return 0;
}

/* h (m, inter) = silu(x Wg^T) * (x Wu^T) for a gate and an up projection packed side by side: panel p holds gate
 * features 16 p + j in its first 16 lanes and the same up features in its last 16 (kernels/cpu.py pack_f32_gate_up),
 * inter padded with zero rows to a multiple of 16. Each gate and up output is summed in linear_f32's order and
 * silu(gate) * up is elementwise_f32's silu_mul, so h is theirs bit for bit, without the (m, 2 inter) products ever
 * going to memory. Returns -1 on bad arguments or when scratch memory cannot be had. */
int linear_f32_silu_mul_available(void) { return GATED; }

int linear_f32_silu_mul(const float *x, int64_t x_stride, const float *packed, float *h, int64_t h_stride, int m,
                        int inter, int k, int threads) {
    if (!GATED || m <= 0 || inter <= 0 || k <= 0 || x_stride < 1 || h_stride < inter) return -1;
    /* Sums between k blocks need a scratch (a group's panels for every row); one block needs none. */
    const int scratch = m > MR && k > KC;
    int failed = 0;
    threads = threads_for(threads, (int64_t)m * 2 * inter * k, MIN_WORK_PER_THREAD);
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        int lo, hi;
        share((inter + NP / 2 - 1) / (NP / 2), thread_index(), thread_count(), &lo, &hi);
        float *sums = scratch ? aligned_alloc(64, sizeof(float) * m * NB * NP) : 0;
        if (scratch && !sums) failed = 1;
        else if (m <= MR) decode_panels(x, x_stride, packed, 0, 0, 0, m, inter, k, lo, hi, h, h_stride);
        else blocked_panels(x, x_stride, packed, 0, sums, NB * NP, m, inter, k, lo, hi, h, h_stride);
        free(sums);
    }
    return failed ? -1 : 0;
}

#else
int linear_f32_available(void) { return 0; }
int linear_f32_silu_mul_available(void) { return 0; }
int linear_f32_silu_mul(const float *x, int64_t x_stride, const float *packed, float *h, int64_t h_stride, int m,
                        int inter, int k, int threads) {
    (void)x, (void)x_stride, (void)packed, (void)h, (void)h_stride, (void)m, (void)inter, (void)k, (void)threads;
    return -1;
}
int linear_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *y, int64_t y_stride,
               int m, int n, int k, int threads) {
    (void)x, (void)x_stride, (void)packed, (void)bias, (void)y, (void)y_stride, (void)m, (void)n, (void)k,
        (void)threads;
    return -1;
}
#endif
