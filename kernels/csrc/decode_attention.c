/* Decode attention over a paged KV cache on CPU: one query token per sequence, every query head of a KV
 * group served by a single pass over that group's cached keys and values (GQA), online softmax in float32.
 * Built at first use by kernels/cpu.py with the machine's C compiler (-O3 -march=native), so the inner loops
 * are vectorised for whatever CPU runs it. Cache layout: (num_blocks, block_size, kv_heads, head_dim).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 64
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* One (sequence, kv head): q rows (group, head_dim) in float32 -> out rows in float32. Walks the block table
 * block by block (no division per token); softmax rescaling happens once per block. */
#define DEFINE_KERNEL(NAME, T, LOAD)                                                                          \
    static void NAME##_one(const float *q, const T *k_cache, const T *v_cache, const int32_t *table, int len,  \
                           int block_size, int kv_heads, int kv_head, int head_dim, int group, float scale,     \
                           float *out) {                                                                         \
        float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_BLOCK], kv[MAX_HEAD_DIM];                            \
        const int64_t token_stride = (int64_t)kv_heads * head_dim;                                              \
        for (int g = 0; g < group; g++) {                                                                       \
            m[g] = -INFINITY;                                                                                   \
            l[g] = 0.f;                                                                                         \
            memset(out + g * head_dim, 0, sizeof(float) * head_dim);                                            \
        }                                                                                                       \
        for (int b = 0, t0 = 0; t0 < len; b++, t0 += block_size) {                                              \
            int n = len - t0 < block_size ? len - t0 : block_size;                                              \
            int64_t first = ((int64_t)table[b] * block_size) * token_stride + (int64_t)kv_head * head_dim;      \
            const T *k = k_cache + first, *v = v_cache + first;                                                 \
            for (int j = 0; j < n; j++, k += token_stride) {                                                    \
                for (int d = 0; d < head_dim; d++) kv[d] = LOAD(k[d]);                                          \
                for (int g = 0; g < group; g++) {                                                               \
                    const float *qg = q + g * head_dim;                                                         \
                    float dot = 0.f;                                                                            \
                    for (int d = 0; d < head_dim; d++) dot += qg[d] * kv[d];                                    \
                    s[g][j] = dot * scale;                                                                      \
                }                                                                                               \
            }                                                                                                   \
            for (int g = 0; g < group; g++) {                                                                   \
                float block_max = m[g];                                                                         \
                for (int j = 0; j < n; j++) block_max = s[g][j] > block_max ? s[g][j] : block_max;              \
                float correction = expf(m[g] - block_max);                                                      \
                float *og = out + g * head_dim;                                                                 \
                l[g] *= correction;                                                                             \
                for (int d = 0; d < head_dim; d++) og[d] *= correction;                                         \
                for (int j = 0; j < n; j++) {                                                                   \
                    s[g][j] = expf(s[g][j] - block_max);                                                        \
                    l[g] += s[g][j];                                                                            \
                }                                                                                               \
                m[g] = block_max;                                                                               \
            }                                                                                                   \
            for (int j = 0; j < n; j++, v += token_stride) {                                                    \
                for (int d = 0; d < head_dim; d++) kv[d] = LOAD(v[d]);                                          \
                for (int g = 0; g < group; g++) {                                                               \
                    float p = s[g][j], *og = out + g * head_dim;                                                \
                    for (int d = 0; d < head_dim; d++) og[d] += p * kv[d];                                      \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (int g = 0; g < group; g++) {                                                                       \
            float inv = 1.f / l[g], *og = out + g * head_dim;                                                   \
            for (int d = 0; d < head_dim; d++) og[d] *= inv;                                                    \
        }                                                                                                       \
    }

#define LOAD_BF16(x) bf16_to_f32(x)
#define LOAD_F32(x) (x)
DEFINE_KERNEL(bf16, uint16_t, LOAD_BF16)
DEFINE_KERNEL(f32, float, LOAD_F32)

/* q, out: (seqs, heads, head_dim) contiguous; tables: (seqs, table_width) int32; returns 0, or -1 on bad sizes. */
int decode_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int32_t *tables, const int32_t *seq_lens, uint16_t *out, int seqs, int heads,
                          int kv_heads, int head_dim, int block_size, int table_width, float scale) {
    int group = heads / kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK) return -1;
    float qf[MAX_GROUP * MAX_HEAD_DIM], of[MAX_GROUP * MAX_HEAD_DIM];
    for (int i = 0; i < seqs; i++)
        for (int h = 0; h < kv_heads; h++) {
            int64_t base = ((int64_t)i * heads + (int64_t)h * group) * head_dim;
            for (int x = 0; x < group * head_dim; x++) qf[x] = bf16_to_f32(q[base + x]);
            bf16_one(qf, k_cache, v_cache, tables + (int64_t)i * table_width, seq_lens[i], block_size, kv_heads, h,
                     head_dim, group, scale, of);
            for (int x = 0; x < group * head_dim; x++) out[base + x] = f32_to_bf16(of[x]);
        }
    return 0;
}

int decode_attention_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *tables,
                         const int32_t *seq_lens, float *out, int seqs, int heads, int kv_heads, int head_dim,
                         int block_size, int table_width, float scale) {
    int group = heads / kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK) return -1;
    for (int i = 0; i < seqs; i++)
        for (int h = 0; h < kv_heads; h++) {
            int64_t base = ((int64_t)i * heads + (int64_t)h * group) * head_dim;
            f32_one(q + base, k_cache, v_cache, tables + (int64_t)i * table_width, seq_lens[i], block_size, kv_heads,
                    h, head_dim, group, scale, out + base);
        }
    return 0;
}
