/* float32 prompt rows over GGUF blocks through linear_f32.c's GEMM: each thread dequantizes its panels of 32 weight
 * rows (dequantize_rows_f32: the weights' own values, as the exact kernels multiply them) into linear_f32's panel
 * layout, NB panels at a time, and runs linear_f32's blocked loop on them while they sit in L2. The result is
 * linear_f32's on the dequantized layer, bit for bit (quantization none's float32 product), the layer never written
 * out whole.
 *
 * Why: the exact kernels (linear_quant.c) dequantize every weight again for every strip of rows and run at about half
 * of linear_f32's rate on a prompt (66 against 123 GFLOP/s over SmolLM2's layers at 430 rows, AMD Zen 3, 2 threads);
 * dequantizing a panel once per call costs a few percent of the GEMM from a few dozen rows. The replica takes it for
 * float32 prompt rows of layers that round float32 decode rows to int8 (kernels/quant.py: a CPU without bfloat16
 * arithmetic), where a row's result already depends on its batch's size; an asked-for float32 keeps the exact kernels
 * (the same bits in any batch). */
#include <stdint.h>
#include <stdlib.h>

#include "entry_points.h"
#include "linear_f32.h"

int linear_quant_panels_f32(const float *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, const float *bias,
                            float *y, int64_t y_stride, int m, int n, int k, int type, int threads) {
#ifdef LINEAR_F32_KERNELS
    if (m <= 0 || n <= 0 || k <= 0 || x_stride < k || y_stride < n || w_stride <= 0) return -1;
    const int panels = (n + NP - 1) / NP;
    int failed = 0;
    threads = threads_for(threads, (int64_t)m * n * k, MIN_WORK_PER_THREAD);
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        int lo, hi;
        share(panels, thread_index(), thread_count(), &lo, &hi);
        float *rows = malloc(sizeof(float) * NP * (size_t)k);
        float *packed = aligned_alloc(64, (sizeof(float) * NB * NP * (size_t)k + 63) / 64 * 64);
        failed = !rows || !packed;
        for (int g = lo; !failed && g < hi; g += NB) {
            const int g1 = hi - g < NB ? hi : g + NB;
            for (int p = g; !failed && p < g1; p++) {
                const int r0 = p * NP, nr = n - r0 < NP ? n - r0 : NP;
                failed = dequantize_rows_f32(w + (int64_t)r0 * w_stride, w_stride, rows, nr, k, type) != 0;
                float *panel = packed + (int64_t)(p - g) * k * NP; /* panel[kk][j] = w[r0 + j][kk], zero rows past n */
                for (int kk = 0; kk < k; kk++)
                    for (int j = 0; j < NP; j++) panel[(int64_t)kk * NP + j] = j < nr ? rows[(int64_t)j * k + kk] : 0.f;
            }
            if (failed) break;
            /* the group as a layer of its own, columns [g NP, g1 NP) of y, as linear_f32 runs one */
            const float *b = bias ? bias + g * NP : 0;
            if (m <= MR) decode_panels(x, x_stride, packed, b, y + g * NP, y_stride, m, n - g * NP, k, 0, g1 - g, 0, 0);
            else blocked_panels(x, x_stride, packed, b, y + g * NP, y_stride, m, n - g * NP, k, 0, g1 - g, 0, 0);
        }
        free(rows), free(packed);
    }
    return failed ? -1 : 0;
#else
    (void)x, (void)x_stride, (void)w, (void)w_stride, (void)bias, (void)y, (void)y_stride, (void)m, (void)n, (void)k,
        (void)type, (void)threads;
    return -1;
#endif
}
