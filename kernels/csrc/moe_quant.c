/* A mixture-of-experts layer whose experts are quantized (a GGUF's blocks, or --quantization int8's Q8_0 rows:
 * kernels/cpu_moe.py QuantExperts) in one call, for the rows the dense quantized layers serve without a GEMM: any
 * float32 batch, and bfloat16 experts of fewer rows than the bfloat16 GEMM takes (a decode step's).
 *
 * The (token, slot) pairs are sorted by expert (moe_groups.h) and their rows of x gathered; then every expert with
 * rows runs the entry points the dense quantized layers call from Python, with the same arguments: its gate/up slabs
 * (kernels/quant.py run_slabs), SiLU(gate) * up (the elementwise kernel the dense MLP uses), its down slab; the
 * kernel chosen per expert as quant_linear chooses it for that many rows (float32: linear_quant_f32; bfloat16: int8
 * activations, linear_q8_bf16, for at most INT8_MAX_ROWS rows of types it reads, else float32 and rounded on the way
 * in and out). Last, each token's k outputs are scaled and added slot by slot with moe.combine's roundings. A token's
 * result is what the dense quantized path and combine give it alone, bit for bit, whatever the batch. What it saves
 * is the Python loop: a decode step of a model of many experts made ~10 calls per expert with tokens.
 *
 * Each expert's kernels split their weight rows over the threads (as one dense layer's call does): the experts run
 * one after another. An expert of more bfloat16 rows than that, or a CPU without the elementwise kernels, declines
 * the whole call (status 1), which the Python loop then serves. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "entry_points.h"
#include "moe_groups.h"

/* Per expert, MOE_QUANT_WIDTH int64s: the number of gate/up slabs (1 or 2), whether linear_q8_bf16 reads every
 * gate/up slab, whether it reads the down slab (kernels/quant.py QuantLinear.int8), two gate/up slabs, the down slab;
 * each slab (address of its blocks, bytes per row, first output row, rows, ggml type), as quant.py SlabCall. */
#define SLAB_FIELDS 5
#define GATE_UP_SLABS 2
#define HEAD_FIELDS 3
#define MOE_QUANT_WIDTH (HEAD_FIELDS + SLAB_FIELDS * (GATE_UP_SLABS + 1))
#define INT8_MAX_ROWS 8 /* kernels/quant.py INT8_MAX_ROWS */
enum { SLAB_BLOCKS, SLAB_STRIDE, SLAB_START, SLAB_ROWS, SLAB_TYPE };
enum { FLOAT32, INT8_BF16 }; /* the kernels of one projection's rows */

/* y[:, each slab's rows] = x (m, k) W^T, y of row stride y_stride (float32 or bfloat16 as the path's kernel writes). */
static int project(const int64_t *slabs, int count, int path, const void *x, int64_t x_stride, void *y,
                   int64_t y_stride, int m, int k, int threads) {
    for (int s = 0; s < count; s++) {
        const int64_t *slab = slabs + s * SLAB_FIELDS;
        const uint8_t *w = (const uint8_t *)(intptr_t)slab[SLAB_BLOCKS];
        const int start = (int)slab[SLAB_START], rows = (int)slab[SLAB_ROWS], type = (int)slab[SLAB_TYPE];
        const int status =
            path == INT8_BF16
                ? linear_q8_bf16((const uint16_t *)x, x_stride, w, slab[SLAB_STRIDE], 0, (uint16_t *)y + start,
                                 y_stride, m, rows, k, type, threads)
                : linear_quant_f32((const float *)x, x_stride, w, slab[SLAB_STRIDE], 0, (float *)y + start, y_stride,
                                   m, rows, k, type, threads);
        if (status) return status;
    }
    return 0;
}

static inline int64_t larger(int64_t a, int64_t b) { return a > b ? a : b; }

static void widen(const uint16_t *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = bf16_to_f32(x[i]);
}

static void narrow(const float *x, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_bf16(x[i]);
}

/* One projection of m rows x (k wide, bfloat16 where bf16) -> y (n wide, x's dtype) by the kernel quant_linear takes
 * for them: float32's; bfloat16 rows through int8 activations where int8, else float32's on the rows widened (into
 * f32) and rounded back (f32 + m k on). */
static int projection(const int64_t *slabs, int count, int bf16, int int8, const void *x, void *y, float *f32, int m,
                      int n, int k, int threads) {
    if (!bf16) return project(slabs, count, FLOAT32, x, k, y, n, m, k, threads);
    if (int8) return project(slabs, count, INT8_BF16, x, k, y, n, m, k, threads);
    float *xf = f32, *yf = f32 + (int64_t)m * k;
    widen(x, xf, (int64_t)m * k);
    if (project(slabs, count, FLOAT32, xf, k, yf, n, m, k, threads)) return -1;
    narrow(yf, y, (int64_t)m * n);
    return 0;
}

/* One expert's m rows xe (hidden wide, x's dtype) -> oe (m, hidden, x's dtype), through gu (m, 2 inter) and h (m,
 * inter); f32: room for m rows of max(hidden, inter) + max(2 inter, hidden) float32. */
static int expert(const int64_t *row, int bf16, const void *xe, void *gu, void *h, void *oe, float *f32, int m,
                  int hidden, int inter, int threads) {
    const int count = (int)row[0], int8_gate_up = bf16 && row[1] && m <= INT8_MAX_ROWS;
    const int int8_down = bf16 && row[2] && m <= INT8_MAX_ROWS;
    const int64_t *gate_up = row + HEAD_FIELDS, *down = gate_up + GATE_UP_SLABS * SLAB_FIELDS;
    if (projection(gate_up, count, bf16, int8_gate_up, xe, gu, f32, m, 2 * inter, hidden, threads)) return -1;
    if (bf16 ? silu_mul_bf16(gu, h, m, inter, 2 * inter, threads) : silu_mul_f32(gu, h, m, inter, 2 * inter, threads))
        return -1;
    return projection(down, 1, bf16, int8_down, h, oe, f32, m, hidden, inter, threads);
}

/* Whether the elementwise kernel of that dtype's SiLU (the dense MLP's) is built for this CPU. */
int moe_quant_available(int bf16) { return bf16 ? elementwise_available() : elementwise_f32_available(); }

/* y (tokens, hidden) = sum over each token's k slots of weight * down_e(SiLU(gate_e x) * up_e x), x (tokens, hidden)
 * at row stride x_stride, bfloat16 where bf16 else float32, y contiguous in x's dtype; table: experts rows of
 * MOE_QUANT_WIDTH (above); ids, weights (tokens, k), an id equal to `experts` a slot another rank computes (adds
 * nothing). gemm_rows: the fewest bfloat16 rows quant_linear hands to a bfloat16 GEMM (0: none). Returns 0, 1 where the call is declined (an expert of gemm_rows
 * bfloat16 rows or more, or no elementwise kernels here: nothing written), -1 on bad arguments or a kernel's
 * failure. */
int moe_quant(const void *x, int bf16, int64_t x_stride, const int64_t *table, const int64_t *ids,
              const float *weights, void *y, int tokens, int k, int experts, int hidden, int inter, int gemm_rows,
              int threads) {
    if (tokens <= 0 || k <= 0 || experts <= 0 || hidden <= 0 || inter <= 0 || x_stride < hidden) return -1;
    if (!moe_quant_available(bf16)) return 1;
    const int pairs = tokens * k;
    for (int i = 0; i < pairs; i++)
        if (ids[i] < 0 || ids[i] > experts) return -1;
    for (int e = 0; e < experts; e++)
        if (table[e * MOE_QUANT_WIDTH] < 1 || table[e * MOE_QUANT_WIDTH] > GATE_UP_SLABS) return -1;
    int *start = calloc((size_t)experts + 2, sizeof(int)), *at = malloc(sizeof(int) * pairs);
    int *row_token = malloc(sizeof(int) * pairs), *next = malloc(sizeof(int) * experts);
    if (!(start && at && row_token && next)) {
        free(start), free(at), free(row_token), free(next);
        return -1;
    }
    const int most = group_pairs(ids, pairs, k, experts, start, at, row_token, next);
    int status = bf16 && gemm_rows > 0 && most >= gemm_rows ? 1 : 0;
    const size_t size = bf16 ? sizeof(uint16_t) : sizeof(float), rows = (size_t)start[experts];
    /* grouped x, gate/up, the gated product, each pair's output; the exact bfloat16 path's float32 copies */
    char *xs = 0, *gu = 0, *h = 0, *out = 0;
    float *f32 = 0;
    if (!status) {
        xs = malloc(size * rows * hidden + 1), gu = malloc(size * rows * 2 * inter + 1);
        h = malloc(size * rows * inter + 1), out = malloc(size * rows * hidden + 1);
        const int64_t wide = larger(hidden, inter) + larger(2 * (int64_t)inter, hidden);
        if (bf16) f32 = malloc(sizeof(float) * (size_t)(most * wide) + 1);
        status = xs && gu && h && out && (!bf16 || f32) ? 0 : -1;
    }
    for (size_t r = 0; !status && r < rows; r++)
        memcpy(xs + size * r * hidden, (const char *)x + size * (size_t)row_token[r] * x_stride, size * hidden);
    for (int e = 0; !status && e < experts; e++) {
        const int m = start[e + 1] - start[e];
        if (!m) continue;
        const size_t at_row = (size_t)start[e];
        status = expert(table + (int64_t)e * MOE_QUANT_WIDTH, bf16, xs + size * at_row * hidden,
                        gu + size * at_row * 2 * inter, h + size * at_row * inter, out + size * at_row * hidden, f32,
                        m, hidden, inter, threads);
    }
    if (!status && bf16) combine_bf16((const uint16_t *)out, at, weights, (uint16_t *)y, 0, tokens, k, hidden);
    if (!status && !bf16) combine_f32((const float *)out, at, weights, (float *)y, 0, tokens, k, hidden);
    free(start), free(at), free(row_token), free(next), free(xs), free(gu), free(h), free(out), free(f32);
    return status;
}
