/* One pre-norm decoder layer of Llama's form (RMSNorm, fused q/k/v, rotary, paged attention, o, RMSNorm, SiLU-gated
 * MLP) over GGUF blocks, for a decode batch of bfloat16 rows (one query token per sequence), in one call; or of
 * float32 rows where the layers round float32 decode rows to int8 (decode_layer_q8_f32: AVX2 hosts, Zen 3).
 *
 * It calls the kernels the model calls one by one from Python, with the same arguments in the same order
 * (add_rms_norm_bf16, linear_q8_bf16, rotary_write_kv_bf16, decode_attention_bf16, silu_mul_bf16), so its results are
 * theirs bit for bit. What it saves is the Python between them: a decode step of a small model spends as long in
 * ~10 module calls, tensor allocations and ctypes conversions a layer as in its weights' reads
 * (kernels/decode_layer.py decides when a layer takes this path). A decode batch of amx_rows rows or more
 * takes the linear layers' int8 products on AMX-INT8 tiles (linear_amx_q8.c, the same rounding of the activations;
 * the 32-value types only) where the process may use them: the module path would run such a batch as a bfloat16
 * GEMM, which keeps prompt rows (a first token's outsized activations) off int8. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "entry_points.h"
#include "ggml_blocks.h"

/* The kernels one element type's layer calls, as the model calls them from Python (float32 activations where the
 * layers round decode rows to int8, QuantLinear.float32_int8: the CPUs without bfloat16 arithmetic). */
typedef struct {
    size_t element; /* bytes per activation */
    int (*add_rms_norm)(const void *x, const void *residual, const void *weight, void *out, void *residual_out,
                        int rows, int hidden, int64_t x_stride, float eps, int threads);
    int (*linear)(const void *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, void *y, int64_t y_stride,
                  int m, int n, int k, int type, int amx_rows, int threads);
    int (*rotary_write_kv)(const void *q, const void *k, const void *v, int64_t row_stride, const float *cos_sin,
                           const int64_t *positions, const int64_t *slots, void *q_out, void *k_cache, void *v_cache,
                           int tokens, int heads, int kv_heads, int head_dim, int rotary_dim, int threads);
    int (*attention)(const void *q, const void *k_cache, const void *v_cache, const int32_t *tables,
                     const int32_t *seq_lens, const int32_t *starts, void *out, int seqs, int heads, int kv_heads,
                     int head_dim, int block_size, int table_width, float scale, float softcap, int threads);
    int (*silu_mul)(const void *gate_up, void *out, int rows, int inter, int64_t in_stride, int threads);
} layer_kernels;

/* A bfloat16 projection of m rows: on AMX-INT8 tiles from amx_rows rows (0: never) where its type is a 32-value one,
 * else VNNI's loop. */
static int linear_bf16(const void *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, void *y, int64_t y_stride,
                       int m, int n, int k, int type, int amx_rows, int threads) {
    if (amx_rows > 0 && m >= amx_rows && int8_block_bytes(type) && linear_amx_q8_available())
        return linear_amx_q8_bf16(x, x_stride, w, w_stride, 0, y, y_stride, m, n, k, type, threads);
    return linear_q8_bf16(x, x_stride, w, w_stride, 0, y, y_stride, m, n, k, type, threads);
}

/* A float32 projection: int8 activations on VNNI's or AVX2's loop (no AMX path takes float32). */
static int linear_f32(const void *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, void *y, int64_t y_stride,
                      int m, int n, int k, int type, int amx_rows, int threads) {
    (void)amx_rows;
    return linear_q8_f32(x, x_stride, w, w_stride, 0, y, y_stride, m, n, k, type, threads);
}

/* Each kernel behind the table's untyped pointers. */
#define NORM(T, name)                                                                                                  \
    static int norm_##T(const void *x, const void *residual, const void *weight, void *out, void *residual_out,      \
                        int rows, int hidden, int64_t x_stride, float eps, int threads) {                            \
        return name(x, residual, weight, out, residual_out, rows, hidden, x_stride, eps, threads);                    \
    }
#define ROTARY(T, name)                                                                                                \
    static int rotary_##T(const void *q, const void *k, const void *v, int64_t row_stride, const float *cos_sin,     \
                          const int64_t *positions, const int64_t *slots, void *q_out, void *k_cache, void *v_cache,  \
                          int tokens, int heads, int kv_heads, int head_dim, int rotary_dim, int threads) {           \
        return name(q, k, v, row_stride, cos_sin, positions, slots, q_out, k_cache, v_cache, tokens, heads, kv_heads, \
                    head_dim, rotary_dim, threads);                                                                   \
    }
#define ATTENTION(T, name)                                                                                             \
    static int attention_##T(const void *q, const void *k_cache, const void *v_cache, const int32_t *tables,         \
                             const int32_t *seq_lens, const int32_t *starts, void *out, int seqs, int heads,          \
                             int kv_heads, int head_dim, int block_size, int table_width, float scale, float softcap, \
                             int threads) {                                                                           \
        return name(q, k_cache, v_cache, tables, seq_lens, starts, out, seqs, heads, kv_heads, head_dim, block_size,  \
                    table_width, scale, softcap, threads);                                                            \
    }
#define SILU(T, name)                                                                                                  \
    static int silu_##T(const void *gate_up, void *out, int rows, int inter, int64_t in_stride, int threads) {       \
        return name(gate_up, out, rows, inter, in_stride, threads);                                                   \
    }
NORM(bf16, add_rms_norm_bf16)
NORM(f32, add_rms_norm_f32)
ROTARY(bf16, rotary_write_kv_bf16)
ROTARY(f32, rotary_write_kv_f32)
ATTENTION(bf16, decode_attention_bf16)
ATTENTION(f32, decode_attention_f32)
SILU(bf16, silu_mul_bf16)
SILU(f32, silu_mul_f32)
#undef NORM
#undef ROTARY
#undef ATTENTION
#undef SILU

static const layer_kernels BF16 = {2, norm_bf16, linear_bf16, rotary_bf16, attention_bf16, silu_bf16};
static const layer_kernels F32 = {4, norm_f32, linear_f32, rotary_f32, attention_f32, silu_f32};

/* The layer in K's element type: decode_layer_q8_bf16's arguments, the activations, norms and caches in that type. */
static int decode_layer(const layer_kernels *K, const void *x, const void *residual, void *out, void *residual_out,
                        int m, int hidden, const void *input_norm, const void *post_norm, float eps, const uint8_t *qkv,
                        int64_t qkv_stride, int qkv_type, int qkv_rows, const uint8_t *qkv_rest,
                        int64_t qkv_rest_stride, int qkv_rest_type, const uint8_t *o, int64_t o_stride, int o_type,
                        const uint8_t *gate_up, int64_t gate_up_stride, int gate_up_type, const uint8_t *down,
                        int64_t down_stride, int down_type, int intermediate, int heads, int kv_heads, int head_dim,
                        float scale, const float *cos_sin, const int64_t *positions, const int64_t *slots,
                        void *k_cache, void *v_cache, const int32_t *tables, const int32_t *seq_lens, int block_size,
                        int table_width, int amx_rows, int threads) {
    const int q_width = heads * head_dim, qkv_width = (heads + 2 * kv_heads) * head_dim;
    if (m <= 0 || hidden <= 0 || heads <= 0 || kv_heads <= 0 || head_dim <= 0 || intermediate <= 0 ||
        qkv_rows <= 0 || qkv_rows > qkv_width || !linear_q8_available())
        return -1;
    /* scratch, per row: the normed input, q/k/v, rotated q, the attention's output, o's output, the stream after
     * attention, the normed stream, gate/up, the gated product */
    const size_t per_row = (size_t)hidden + qkv_width + 2 * (size_t)q_width + 2 * (size_t)hidden + hidden +
                           3 * (size_t)intermediate;
    char *scratch = malloc(K->element * per_row * (size_t)m);
    if (!scratch) return -1;
#define AT(base, elements) ((char *)(base) + K->element * (size_t)(elements))
    char *normed = scratch, *qkv_out = AT(normed, (size_t)m * hidden), *q_rot = AT(qkv_out, (size_t)m * qkv_width);
    char *attn = AT(q_rot, (size_t)m * q_width), *o_out = AT(attn, (size_t)m * q_width);
    char *stream = AT(o_out, (size_t)m * hidden), *normed2 = AT(stream, (size_t)m * hidden);
    char *gu = AT(normed2, (size_t)m * hidden), *h = AT(gu, (size_t)m * 2 * intermediate);
    /* the first layer has no residual stream yet: the norm reads x alone, and the stream is x */
    int status = K->add_rms_norm(x, residual, input_norm, normed, residual ? stream : 0, m, hidden, hidden, eps,
                                 threads);
    const void *stream_in = residual ? (const void *)stream : x;
    status = status ? status
                    : K->linear(normed, hidden, qkv, qkv_stride, qkv_out, qkv_width, m, qkv_rows, hidden, qkv_type,
                                amx_rows, threads);
    if (qkv_rows < qkv_width)
        status = status ? status
                        : K->linear(normed, hidden, qkv_rest, qkv_rest_stride, AT(qkv_out, qkv_rows), qkv_width, m,
                                    qkv_width - qkv_rows, hidden, qkv_rest_type, amx_rows, threads);
    /* one token's row stride is never read: the Python path passes 0 there, and so does this */
    status = status ? status
                    : K->rotary_write_kv(qkv_out, AT(qkv_out, q_width), AT(qkv_out, q_width + kv_heads * head_dim),
                                         m > 1 ? qkv_width : 0, cos_sin, positions, slots, q_rot, k_cache, v_cache, m,
                                         heads, kv_heads, head_dim, head_dim, threads);
    status = status ? status
                    : K->attention(q_rot, k_cache, v_cache, tables, seq_lens, 0, attn, m, heads, kv_heads, head_dim,
                                   block_size, table_width, scale, 0.f, threads);
    status = status ? status
                    : K->linear(attn, q_width, o, o_stride, o_out, hidden, m, hidden, q_width, o_type, amx_rows, threads);
    status = status ? status
                    : K->add_rms_norm(o_out, stream_in, post_norm, normed2, residual_out, m, hidden, hidden, eps,
                                      threads);
    status = status ? status
                    : K->linear(normed2, hidden, gate_up, gate_up_stride, gu, 2 * intermediate, m, 2 * intermediate,
                                hidden, gate_up_type, amx_rows, threads);
    status = status ? status : K->silu_mul(gu, h, m, intermediate, 2 * intermediate, threads);
    status = status ? status
                    : K->linear(h, intermediate, down, down_stride, out, hidden, m, hidden, intermediate, down_type,
                                amx_rows, threads);
#undef AT
    free(scratch);
    return status ? -1 : 0;
}

/* out (m, hidden) = the layer's MLP output and residual_out (m, hidden) the residual stream after attention, for
 * x (m, hidden), the previous layer's output, and residual (m, hidden) the stream before it (NULL in the first
 * layer, whose stream is x): what DecoderLayer.forward returns. Weights: the two norms' (hidden,) bfloat16, then each
 * projection's blocks (rows of *_stride bytes, a linear_q8 type): qkv ((heads + 2 kv_heads) head_dim rows: its first
 * qkv_rows, the rest from qkv_rest, of another type, as llama.cpp's K-quant mixes give v more bits than q and k; no
 * rest where qkv_rows is all of them), o (hidden rows), gate_up (2 intermediate rows, gate then up), down (hidden
 * rows). The attention's arguments are decode_attention_bf16's and rotary_write_kv_bf16's; amx_rows is linear_bf16's.
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
    if (!elementwise_available()) return -1;
    return decode_layer(&BF16, x, residual, out, residual_out, m, hidden, input_norm, post_norm, eps, qkv, qkv_stride,
                        qkv_type, qkv_rows, qkv_rest, qkv_rest_stride, qkv_rest_type, o, o_stride, o_type, gate_up,
                        gate_up_stride, gate_up_type, down, down_stride, down_type, intermediate, heads, kv_heads,
                        head_dim, scale, cos_sin, positions, slots, k_cache, v_cache, tables, seq_lens, block_size,
                        table_width, amx_rows, threads);
}

/* The same layer in float32 (activations, norms and caches), its projections on int8 activations as the module path
 * takes them for layers that round float32 decode rows (linear_q8_f32; amx_rows not read). */
int decode_layer_q8_f32(const float *x, const float *residual, float *out, float *residual_out, int m, int hidden,
                        const float *input_norm, const float *post_norm, float eps, const uint8_t *qkv,
                        int64_t qkv_stride, int qkv_type, int qkv_rows, const uint8_t *qkv_rest,
                        int64_t qkv_rest_stride, int qkv_rest_type, const uint8_t *o, int64_t o_stride, int o_type,
                        const uint8_t *gate_up, int64_t gate_up_stride, int gate_up_type, const uint8_t *down,
                        int64_t down_stride, int down_type, int intermediate, int heads, int kv_heads, int head_dim,
                        float scale, const float *cos_sin, const int64_t *positions, const int64_t *slots,
                        float *k_cache, float *v_cache, const int32_t *tables, const int32_t *seq_lens, int block_size,
                        int table_width, int amx_rows, int threads) {
    if (!elementwise_f32_available()) return -1;
    return decode_layer(&F32, x, residual, out, residual_out, m, hidden, input_norm, post_norm, eps, qkv, qkv_stride,
                        qkv_type, qkv_rows, qkv_rest, qkv_rest_stride, qkv_rest_type, o, o_stride, o_type, gate_up,
                        gate_up_stride, gate_up_type, down, down_stride, down_type, intermediate, heads, kv_heads,
                        head_dim, scale, cos_sin, positions, slots, k_cache, v_cache, tables, seq_lens, block_size,
                        table_width, amx_rows, threads);
}
