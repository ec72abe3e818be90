/* Decode attention over a paged KV cache on CPU: one query token per sequence, every query head of a KV
 * group served by a single pass over that group's cached keys and values (GQA), softmax in float32.
 * Built at first use by kernels/cpu.py with the machine's C compiler (-O3 -march=native). Cache layout:
 * (num_blocks, block_size, kv_heads, head_dim).
 *
 * With AVX-512 (and head_dim a multiple of 16) keys and values are taken 16 tokens at a time: each tile is
 * converted to float32 once into a small scratch that stays in L1, and every query head of the group reads it
 * from there. The 16 dot products of a tile are reduced together by a transpose-add tree, so no token pays for a
 * horizontal reduction of its own; softmax runs on whole score rows with a vectorised exp. Elsewhere a portable
 * loop (one token at a time, online softmax) serves.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_cache.h"

#ifdef __AVX512F__
#include <immintrin.h>

#include "vector_math.h"
#endif

#define MAX_GROUP 64
#define MAX_HEADS 256
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256
#define TILE 16

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

/* ---------------------------------------------------------------------------------------------------------- */
/* Portable path: one token at a time, online softmax rescaled once per block.                                 */

#define DEFINE_PORTABLE(NAME, T, LOAD)                                                                         \
    static void NAME##_portable(const float *q, const T *k_cache, const T *v_cache, const CacheWalk *w,        \
                                int len, int head_dim, int group, float scale, float *out) {                   \
        float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_BLOCK], kv[MAX_HEAD_DIM];                           \
        for (int g = 0; g < group; g++) {                                                                      \
            m[g] = -INFINITY;                                                                                  \
            l[g] = 0.f;                                                                                        \
            memset(out + g * head_dim, 0, sizeof(float) * head_dim);                                           \
        }                                                                                                      \
        for (int t0 = 0; t0 < len; t0 += w->block_size) {                                                      \
            int n = len - t0 < w->block_size ? len - t0 : w->block_size;                                       \
            int64_t first = token_offset(w, t0);                                                               \
            const T *k = k_cache + first, *v = v_cache + first;                                                \
            for (int j = 0; j < n; j++, k += w->token_stride) {                                                \
                for (int d = 0; d < head_dim; d++) kv[d] = LOAD(k[d]);                                         \
                for (int g = 0; g < group; g++) {                                                              \
                    const float *qg = q + g * head_dim;                                                        \
                    float dot = 0.f;                                                                           \
                    for (int d = 0; d < head_dim; d++) dot += qg[d] * kv[d];                                   \
                    s[g][j] = dot * scale;                                                                     \
                }                                                                                              \
            }                                                                                                  \
            for (int g = 0; g < group; g++) {                                                                  \
                float block_max = m[g];                                                                        \
                for (int j = 0; j < n; j++) block_max = s[g][j] > block_max ? s[g][j] : block_max;             \
                float correction = expf(m[g] - block_max);                                                     \
                float *og = out + g * head_dim;                                                                \
                l[g] *= correction;                                                                            \
                for (int d = 0; d < head_dim; d++) og[d] *= correction;                                        \
                for (int j = 0; j < n; j++) {                                                                  \
                    s[g][j] = expf(s[g][j] - block_max);                                                       \
                    l[g] += s[g][j];                                                                           \
                }                                                                                              \
                m[g] = block_max;                                                                              \
            }                                                                                                  \
            for (int j = 0; j < n; j++, v += w->token_stride) {                                                \
                for (int d = 0; d < head_dim; d++) kv[d] = LOAD(v[d]);                                         \
                for (int g = 0; g < group; g++) {                                                              \
                    float p = s[g][j], *og = out + g * head_dim;                                               \
                    for (int d = 0; d < head_dim; d++) og[d] += p * kv[d];                                     \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int g = 0; g < group; g++) {                                                                      \
            float inv = 1.f / l[g], *og = out + g * head_dim;                                                  \
            for (int d = 0; d < head_dim; d++) og[d] *= inv;                                                   \
        }                                                                                                      \
    }

#define LOAD_BF16(x) bf16_to_f32(x)
#define LOAD_F32(x) (x)
DEFINE_PORTABLE(bf16, uint16_t, LOAD_BF16)
DEFINE_PORTABLE(f32, float, LOAD_F32)

/* ---------------------------------------------------------------------------------------------------------- */
/* AVX-512 path.                                                                                               */
#ifdef __AVX512F__

/* Sixteen vectors in, their sixteen horizontal sums out (lane j = sum of a[j]), by a transpose-add tree. */
static inline __m512 sum16(const __m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per lane: the lane's partial sums of four inputs */
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* lanes pairwise: [X01, X23, Y01, Y23] */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Rows t0..t0+n-1 (n <= 16) of one sequence's cache, every KV head (row = kv_heads * head_dim elements), into
 * tile (TILE, row) float32; missing rows are zero. Also asks for the rows two tiles ahead: blocks are scattered,
 * so the hardware prefetcher cannot see past the end of a block. */
static inline void load_tile_bf16(const uint16_t *cache, const CacheWalk *w, int t0, int n, int len, int row,
                                  float *tile) {
    for (int j = 0; j < n; j++) {
        const uint16_t *src = cache + token_offset(w, t0 + j);
        for (int d = 0; d < row; d += 16) {
            __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + d)));
            _mm512_store_ps(tile + j * row + d, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
        }
    }
    if (n < TILE) memset(tile + n * row, 0, sizeof(float) * (TILE - n) * row);
    for (int j = t0 + 2 * TILE; j < t0 + 3 * TILE && j < len; j++) {
        const char *ahead = (const char *)(cache + token_offset(w, j));
        for (int b = 0; b < row * 2; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
}

static inline void load_tile_f32(const float *cache, const CacheWalk *w, int t0, int n, int len, int row,
                                 float *tile) {
    for (int j = 0; j < n; j++) memcpy(tile + j * row, cache + token_offset(w, t0 + j), sizeof(float) * row);
    if (n < TILE) memset(tile + n * row, 0, sizeof(float) * (TILE - n) * row);
    for (int j = t0 + 2 * TILE; j < t0 + 3 * TILE && j < len; j++) {
        const char *ahead = (const char *)(cache + token_offset(w, j));
        for (int b = 0; b < row * 4; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
}

/* One sequence, all heads: q (heads, head_dim) float32, already scaled; scores: scratch of heads * stride
 * floats; tile: scratch of TILE * kv_heads * head_dim floats, 64-byte aligned; out (heads, head_dim) float32.
 * Each tile holds every KV head's rows, so the cache is read as it lies in memory: whole rows, block by block. */
#define DEFINE_AVX512(NAME, T)                                                                                 \
    static void NAME##_avx512(const float *q, const T *k_cache, const T *v_cache, const CacheWalk *w, int len,  \
                              int kv_heads, int head_dim, int group, float *scores, int stride, float *tile,     \
                              float *out) {                                                                     \
        const int row = kv_heads * head_dim, heads = kv_heads * group;                                          \
        for (int t0 = 0; t0 < len; t0 += TILE) { /* scores = q k^T */                                          \
            int n = len - t0 < TILE ? len - t0 : TILE;                                                          \
            load_tile_##NAME(k_cache, w, t0, n, len, row, tile);                                                \
            for (int h = 0; h < heads; h++) {                                                                   \
                const float *k = tile + h / group * head_dim, *qh = q + h * head_dim;                           \
                __m512 acc[TILE];                                                                               \
                for (int j = 0; j < TILE; j++) acc[j] = _mm512_setzero_ps();                                    \
                for (int d = 0; d < head_dim; d += 16) {                                                        \
                    __m512 qv = _mm512_loadu_ps(qh + d);                                                        \
                    for (int j = 0; j < TILE; j++)                                                              \
                        acc[j] = _mm512_fmadd_ps(qv, _mm512_load_ps(k + j * row + d), acc[j]);                  \
                }                                                                                               \
                _mm512_storeu_ps(scores + h * stride + t0, sum16(acc));                                         \
            }                                                                                                   \
        }                                                                                                       \
        float inv_sum[MAX_HEADS];                                                                               \
        __mmask16 tail = (__mmask16)((1u << (len % TILE ? len % TILE : TILE)) - 1);                             \
        int last = (len - 1) / TILE * TILE;                                                                     \
        for (int h = 0; h < heads; h++) { /* softmax numerators, in place */                                   \
            float *s = scores + h * stride;                                                                     \
            __m512 mx = _mm512_set1_ps(-INFINITY);                                                              \
            for (int t = 0; t < last; t += TILE) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));                \
            mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_loadu_ps(s + last));                                   \
            __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx)), total = _mm512_setzero_ps();                   \
            for (int t = 0; t <= last; t += TILE) {                                                             \
                __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));                           \
                if (t == last) p = _mm512_maskz_mov_ps(tail, p);                                                \
                total = _mm512_add_ps(total, p);                                                                \
                _mm512_storeu_ps(s + t, p);                                                                     \
            }                                                                                                   \
            inv_sum[h] = 1.f / _mm512_reduce_add_ps(total);                                                     \
        }                                                                                                       \
        memset(out, 0, sizeof(float) * heads * head_dim);                                                       \
        for (int t0 = 0; t0 < len; t0 += TILE) { /* out = p v */                                               \
            int n = len - t0 < TILE ? len - t0 : TILE;                                                          \
            load_tile_##NAME(v_cache, w, t0, n, len, row, tile);                                                \
            for (int h = 0; h < heads; h++) {                                                                   \
                const float *p = scores + h * stride + t0, *v = tile + h / group * head_dim;                    \
                float *o = out + h * head_dim;                                                                  \
                for (int d = 0; d < head_dim; d += 16) {                                                        \
                    __m512 even = _mm512_loadu_ps(o + d), odd = _mm512_setzero_ps();                            \
                    for (int j = 0; j < n - 1; j += 2) {                                                        \
                        even = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_load_ps(v + j * row + d), even);    \
                        odd = _mm512_fmadd_ps(_mm512_set1_ps(p[j + 1]), _mm512_load_ps(v + (j + 1) * row + d), odd); \
                    }                                                                                           \
                    if (n & 1) even = _mm512_fmadd_ps(_mm512_set1_ps(p[n - 1]), _mm512_load_ps(v + (n - 1) * row + d), even); \
                    _mm512_storeu_ps(o + d, _mm512_add_ps(even, odd));                                          \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (int h = 0; h < heads; h++) {                                                                       \
            __m512 inv = _mm512_set1_ps(inv_sum[h]);                                                            \
            for (int d = 0; d < head_dim; d += 16)                                                              \
                _mm512_storeu_ps(out + h * head_dim + d, _mm512_mul_ps(_mm512_loadu_ps(out + h * head_dim + d), inv)); \
        }                                                                                                       \
    }

DEFINE_AVX512(bf16, uint16_t)
DEFINE_AVX512(f32, float)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

/* ---------------------------------------------------------------------------------------------------------- */
/* Entry points. q, out: (seqs, heads, head_dim) contiguous; tables: (seqs, table_width) int32. Return 0, or -1  */
/* on sizes this kernel does not take (the caller then uses torch).                                            */

static int check(int heads, int kv_heads, int head_dim, int block_size) {
    if (kv_heads <= 0 || heads % kv_heads) return -1;
    return heads / kv_heads > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK ? -1 : 0;
}

static int max_len(const int32_t *seq_lens, int seqs) {
    int m = 0;
    for (int i = 0; i < seqs; i++) m = seq_lens[i] > m ? seq_lens[i] : m;
    return m;
}

#define DEFINE_ENTRY(NAME, T, TO_F32, FROM_F32)                                                                \
    int decode_attention_##NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *tables,         \
                                const int32_t *seq_lens, T *out, int seqs, int heads, int kv_heads, int head_dim, \
                                int block_size, int table_width, float scale) {                                 \
        if (check(heads, kv_heads, head_dim, block_size)) return -1;                                           \
        int group = heads / kv_heads, vector = HAVE_AVX512 && head_dim % 16 == 0 && heads <= MAX_HEADS;        \
        int stride = (max_len(seq_lens, seqs) + TILE - 1) / TILE * TILE;                                       \
        float *scores = NULL, *tile = NULL, *qf = NULL, *of = NULL;                                             \
        size_t tile_bytes = sizeof(float) * TILE * kv_heads * head_dim;                                        \
        if (vector) {                                                                                           \
            scores = malloc(sizeof(float) * (size_t)heads * stride);                                           \
            tile = aligned_alloc(64, (tile_bytes + 63) / 64 * 64);                                              \
        }                                                                                                       \
        qf = malloc(sizeof(float) * heads * head_dim);                                                          \
        of = malloc(sizeof(float) * heads * head_dim);                                                          \
        int status = (vector && (!scores || !tile)) || !qf || !of ? -1 : 0;                                    \
        for (int i = 0; i < seqs && status == 0; i++) {                                                         \
            const T *qi = q + (int64_t)i * heads * head_dim;                                                    \
            T *oi = out + (int64_t)i * heads * head_dim;                                                        \
            const int32_t *table = tables + (int64_t)i * table_width;                                           \
            if (seq_lens[i] <= 0) {                                                                             \
                for (int x = 0; x < heads * head_dim; x++) oi[x] = FROM_F32(0.f);                              \
                continue;                                                                                       \
            }                                                                                                   \
            if (vector) {                                                                                       \
                CacheWalk w = {table, (int64_t)kv_heads * head_dim, 0, block_size};                            \
                for (int x = 0; x < heads * head_dim; x++) qf[x] = TO_F32(qi[x]) * scale;                      \
                AVX512_CALL(NAME);                                                                              \
            } else {                                                                                            \
                for (int x = 0; x < heads * head_dim; x++) qf[x] = TO_F32(qi[x]);                              \
                for (int h = 0; h < kv_heads; h++) {                                                            \
                    CacheWalk w = {table, (int64_t)kv_heads * head_dim, (int64_t)h * head_dim, block_size};    \
                    NAME##_portable(qf + h * group * head_dim, k_cache, v_cache, &w, seq_lens[i], head_dim, group, \
                                    scale, of + h * group * head_dim);                                          \
                }                                                                                               \
            }                                                                                                   \
            for (int x = 0; x < heads * head_dim; x++) oi[x] = FROM_F32(of[x]);                                \
        }                                                                                                       \
        free(scores);                                                                                           \
        free(tile);                                                                                             \
        free(qf);                                                                                               \
        free(of);                                                                                               \
        return status;                                                                                          \
    }

#if HAVE_AVX512
#define AVX512_CALL(NAME) NAME##_avx512(qf, k_cache, v_cache, &w, seq_lens[i], kv_heads, head_dim, group, scores, stride, tile, of)
#else
#define AVX512_CALL(NAME) (void)0
#endif
#define IDENTITY(x) (x)
DEFINE_ENTRY(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ENTRY(f32, float, IDENTITY, IDENTITY)
