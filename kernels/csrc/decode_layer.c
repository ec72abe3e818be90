/* One pre-norm decoder layer of Llama's form (RMSNorm, fused q/k/v, rotary, paged attention, o, RMSNorm, SiLU-gated
 * MLP) over GGUF blocks, for a decode batch of bfloat16 rows (one query token per sequence), in one call.
 *
 * It calls the kernels the model calls one by one from Python, with the same arguments in the same order
 * (add_rms_norm_bf16, linear_q8_bf16, rotary_write_kv_bf16, decode_attention_bf16, silu_mul_bf16), so its results are
 * theirs bit for bit. What it saves is the Python between them: a decode step of a small model spends as long in
 * ~10 module calls, tensor allocations and ctypes conversions a layer as in its weights' reads
 * (kernels/decode_layer.py decides when a layer takes this path). A decode batch of amx_rows rows or more
 * takes the linear layers' int8 products on AMX-INT8 tiles (linear_amx_q8.c, the same rounding of the activations;
 * the 32-value types only) where the process may use them: the module path would run such a batch as a bfloat16
 * GEMM, which keeps prompt rows (a first token's outsized activations) off int8. */
#include <stdint.h>
#include <stdlib.h>

#include "entry_points.h"
#include "ggml_blocks.h"

/* A projection of m rows: on AMX-INT8 tiles from amx_rows rows (0: never) where its type is a 32-value one, else
 * VNNI's loop. */
static int decode_linear(const uint16_t *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, uint16_t *y,
                         int64_t y_stride, int m, int n, int k, int type, int amx_rows, int threads) {
    if (amx_rows > 0 && m >= amx_rows && int8_block_bytes(type) && linear_amx_q8_available())
        return linear_amx_q8_bf16(x, x_stride, w, w_stride, 0, y, y_stride, m, n, k, type, threads);
    return linear_q8_bf16(x, x_stride, w, w_stride, 0, y, y_stride, m, n, k, type, threads);
}

/* out (m, hidden) = the layer's MLP output and residual_out (m, hidden) the residual stream after attention, for
 * x (m, hidden), the previous layer's output, and residual (m, hidden) the stream before it (NULL in the first
 * layer, whose stream is x): what DecoderLayer.forward returns. Weights: the two norms' (hidden,) bfloat16, then each
 * projection's blocks (rows of *_stride bytes, a linear_q8 type): qkv ((heads + 2 kv_heads) head_dim rows: its first
 * qkv_rows, the rest from qkv_rest, of another type, as llama.cpp's K-quant mixes give v more bits than q and k; no
 * rest where qkv_rows is all of them), o (hidden rows), gate_up (2 intermediate rows, gate then up), down (hidden
 * rows). The attention's arguments are decode_attention_bf16's and rotary_write_kv_bf16's; amx_rows is decode_linear's.
 * Returns -1 where a kernel declines (nothing is left half done that a second run of the same layer would not redo:
 * the caches' slots are written with the same values). */
int decode_layer_q8_bf16(const uint16_t *x, const uint16_t *residual, uint16_t *out, uint16_t *residual_out, int m,
                         int hidden, const uint16_t *input_norm, const uint16_t *post_norm, float eps,
                         const uint8_t *qkv, int64_t qkv_stride, int qkv_type, int qkv_rows,
                         const uint8_t *qkv_rest, int64_t qkv_rest_stride, int qkv_rest_type, const uint8_t *o,
                         int64_t o_stride, int o_type, const uint8_t *gate_up, int64_t gate_up_stride,
                         int gate_up_type, const uint8_t *down, int64_t down_stride, int down_type, int intermediate,
                         int heads, int kv_heads, int head_dim, float scale, const float *cos_sin, const int64_t *positions,
                         const int64_t *slots, uint16_t *k_cache, uint16_t *v_cache, const int32_t *tables,
                         const int32_t *seq_lens, int block_size, int table_width, int amx_rows, int threads) {
    const int q_width = heads * head_dim, qkv_width = (heads + 2 * kv_heads) * head_dim;
    if (m <= 0 || hidden <= 0 || heads <= 0 || kv_heads <= 0 || head_dim <= 0 || intermediate <= 0 ||
        qkv_rows <= 0 || qkv_rows > qkv_width || !elementwise_available() || !linear_q8_available())
        return -1;
    /* bfloat16 scratch, per row: the normed input, q/k/v, rotated q, the attention's output, o's output, the
     * stream after attention, the normed stream, gate/up, the gated product */
    const size_t per_row = (size_t)hidden + qkv_width + 2 * (size_t)q_width + 2 * (size_t)hidden + hidden +
                           3 * (size_t)intermediate;
    uint16_t *scratch = malloc(sizeof(uint16_t) * per_row * (size_t)m);
    if (!scratch) return -1;
    uint16_t *normed = scratch, *qkv_out = normed + (size_t)m * hidden, *q_rot = qkv_out + (size_t)m * qkv_width;
    uint16_t *attn = q_rot + (size_t)m * q_width, *o_out = attn + (size_t)m * q_width;
    uint16_t *stream = o_out + (size_t)m * hidden, *normed2 = stream + (size_t)m * hidden;
    uint16_t *gu = normed2 + (size_t)m * hidden, *h = gu + (size_t)m * 2 * intermediate;
    /* the first layer has no residual stream yet: the norm reads x alone, and the stream is x */
    int status = add_rms_norm_bf16(x, residual, input_norm, normed, residual ? stream : 0, m, hidden, hidden, eps,
                                   threads);
    const uint16_t *stream_in = residual ? stream : x;
    status = status ? status
                    : decode_linear(normed, hidden, qkv, qkv_stride, qkv_out, qkv_width, m, qkv_rows, hidden, qkv_type,
                                    amx_rows, threads);
    if (qkv_rows < qkv_width)
        status = status ? status
                        : decode_linear(normed, hidden, qkv_rest, qkv_rest_stride, qkv_out + qkv_rows, qkv_width, m,
                                        qkv_width - qkv_rows, hidden, qkv_rest_type, amx_rows, threads);
    /* one token's row stride is never read: the Python path passes 0 there, and so does this */
    status = status ? status
                    : rotary_write_kv_bf16(qkv_out, qkv_out + q_width, qkv_out + q_width + kv_heads * head_dim,
                                           m > 1 ? qkv_width : 0, cos_sin, positions, slots, q_rot, k_cache, v_cache,
                                           m, heads, kv_heads, head_dim, head_dim, threads);
    status = status ? status
                    : decode_attention_bf16(q_rot, k_cache, v_cache, tables, seq_lens, 0, attn, m, heads, kv_heads,
                                            head_dim, block_size, table_width, scale, 0.f, threads);
    status = status ? status
                    : decode_linear(attn, q_width, o, o_stride, o_out, hidden, m, hidden, q_width, o_type, amx_rows,
                                    threads);
    status = status ? status
                    : add_rms_norm_bf16(o_out, stream_in, post_norm, normed2, residual_out, m, hidden, hidden, eps,
                                        threads);
    status = status ? status
                    : decode_linear(normed2, hidden, gate_up, gate_up_stride, gu, 2 * intermediate, m, 2 * intermediate,
                                    hidden, gate_up_type, amx_rows, threads);
    status = status ? status : silu_mul_bf16(gu, h, m, intermediate, 2 * intermediate, threads);
    status = status ? status
                    : decode_linear(h, intermediate, down, down_stride, out, hidden, m, hidden, intermediate, down_type,
                                    amx_rows, threads);
    free(scratch);
    return status ? -1 : 0;
}
