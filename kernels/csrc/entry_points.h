/* Prototypes of the entry points one kernel calls from another (decode_layer.c), included by their own sources too
 * so that the compiler holds both sides to one signature. */
#pragma once
#include <stdint.h>

int add_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *out,
                      uint16_t *residual_out, int rows, int hidden, int64_t x_stride, float eps, int threads);
int silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int inter, int64_t in_stride, int threads);
int rotary_write_kv_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t row_stride,
                         const float *cos_sin, const int64_t *positions, const int64_t *slots, uint16_t *q_out,
                         uint16_t *k_cache, uint16_t *v_cache, int tokens, int heads, int kv_heads, int head_dim,
                         int rotary_dim, int threads);
int decode_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *tables,
                          const int32_t *seq_lens, const int32_t *starts, uint16_t *out, int seqs, int heads,
                          int kv_heads, int head_dim, int block_size, int table_width, float scale, float softcap,
                          int threads);
int linear_q8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, const float *bias,
                   uint16_t *y, int64_t y_stride, int m, int n, int k, int type, int threads);
int linear_quant_f32(const float *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, const float *bias, float *y,
                     int64_t y_stride, int m, int n, int k, int type, int threads);
int silu_mul_f32(const float *gate_up, float *out, int rows, int inter, int64_t in_stride, int threads);
int add_rms_norm_f32(const float *x, const float *residual, const float *weight, float *out, float *residual_out,
                     int rows, int hidden, int64_t x_stride, float eps, int threads);
int rotary_write_kv_f32(const float *q, const float *k, const float *v, int64_t row_stride, const float *cos_sin,
                        const int64_t *positions, const int64_t *slots, float *q_out, float *k_cache, float *v_cache,
                        int tokens, int heads, int kv_heads, int head_dim, int rotary_dim, int threads);
int decode_attention_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *tables,
                         const int32_t *seq_lens, const int32_t *starts, float *out, int seqs, int heads, int kv_heads,
                         int head_dim, int block_size, int table_width, float scale, float softcap, int threads);
int dequantize_rows_f32(const uint8_t *w, int64_t w_stride, float *out, int n, int k, int type);
int linear_q8_f32(const float *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, const float *bias, float *y,
                  int64_t y_stride, int m, int n, int k, int type, int threads);
int elementwise_f32_available(void);
int elementwise_available(void);
int linear_q8_available(void);
int linear_amx_q8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, const float *bias,
                       uint16_t *y, int64_t y_stride, int m, int n, int k, int type, int threads);
int linear_amx_q8_available(void);
/* The vdpbf16ps linear kernel's parts (linear_dpbf16.c), for the quantized layers' fused prompt path
 * (linear_quant.c): a column group of at most 4 packed 16-column blocks against m rows, and rows packed into tiles. */
void dpbf16_column_group(const uint16_t *x, int64_t x_stride, const uint16_t *tiles, int kblocks, const uint16_t *bias,
                         uint16_t *y, int64_t y_stride, int m, int cols, int valid);
void dpbf16_pack_rows(const uint16_t *w, int64_t stride, int n, int k, uint16_t *tiles);
int linear_dpbf16_available(void);
