/* Decode attention over a paged KV cache on CPU: one query token per sequence, every query head of a KV
 * group served by a single pass over that group's cached keys and values (GQA), softmax in float32.
 * Built at first use by kernels/cpu.py with the machine's C compiler (-O3 -march=native). Cache layout:
 * (num_blocks, block_size, kv_heads, head_dim).
 *
 * The work is bound by reading the cache, and on one core the reads only overlap the arithmetic when they are
 * asked for well ahead: a Prefetcher walks the rows the kernel will read (each sequence's keys, then its values,
 * then the next sequence's) a few rows ahead of it, across block, pass and sequence boundaries.
 *
 * bfloat16 with AVX512-BF16 (head_dim a multiple of 16) reads the cache in place, 16 tokens at a time:
 * - scores: vdpbf16ps of the bf16 query with each cached key row (bf16 products are exact in float32); the 16
 *   dot products of a tile are reduced together by a transpose-add tree, so no token pays for a horizontal
 *   reduction of its own;
 * - values: each 32-element chunk of a value row splits into its even and odd elements as float32 by one shift
 *   and one mask, and every query head of the group accumulates both halves in registers; outputs are put back
 *   in order once per sequence.
 * float32 with AVX-512 reads the cache in place, each value vector loaded once for every query head of its group;
 * bf16 without AVX512-BF16 converts each 16-token tile to float32 once into a scratch
 * that stays in L1 and reduces the same way. Softmax runs on whole score rows with a vectorised exp. Elsewhere a
 * portable loop (one token at a time, online softmax) serves.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "paged_cache.h"
#include "entry_points.h"
#include "parallel.h"

#ifdef __AVX512F__
#include <immintrin.h>

#include "amx.h"
#include "vector_math.h"
#endif

/* Query heads per KV head: Falcon-7B has 71 on its one. The portable path keeps a block's scores for each on the
 * stack (MAX_GROUP MAX_BLOCK floats, 128 KiB). */
#define MAX_GROUP 128
#define MAX_HEADS 256
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256
#define TILE 16
/* Query heads of one KV group that share each value vector loaded (float32). */
#define GROUP_CHUNK 4

/* ---------------------------------------------------------------------------------------------------------- */
/* Portable path: one token at a time, online softmax rescaled once per block.                                 */

#define DEFINE_PORTABLE(NAME, T, LOAD)                                                                         \
    static void NAME##_portable(const float *q, const T *k_cache, const T *v_cache, const CacheWalk *w,        \
                                int len, int head_dim, int group, float scale, float softcap, float *out) {    \
        float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][MAX_BLOCK], kv[MAX_HEAD_DIM];                           \
        for (int g = 0; g < group; g++) {                                                                      \
            m[g] = -INFINITY;                                                                                  \
            l[g] = 0.f;                                                                                        \
            memset(out + g * head_dim, 0, sizeof(float) * head_dim);                                           \
        }                                                                                                      \
        for (int t0 = 0, n; t0 < len; t0 += n) { /* runs of consecutive rows: up to the end of a block */     \
            int room = w->block_size - (t0 + w->first) % w->block_size;                                        \
            n = len - t0 < room ? len - t0 : room;                                                             \
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
            if (softcap > 0.f) /* soft-capped scores (Gemma 2) */                                              \
                for (int g = 0; g < group; g++)                                                                \
                    for (int j = 0; j < n; j++) s[g][j] = softcap * tanhf(s[g][j] / softcap);                  \
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
/* AVX-512 paths.                                                                                              */
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

/* Asks for the cache rows the kernel will read, in its order (each sequence's keys, then its values, then the next
 * sequence), PREFETCH_ROWS rows before it reads them. Blocks are scattered, so the hardware prefetcher cannot see
 * past the end of one, and without this every pass and every sequence would start on cold misses. */
#define PREFETCH_ROWS 8
typedef struct {
    const char *k_cache, *v_cache;
    const int32_t *tables, *seq_lens, *starts; /* starts: each sequence's first token read, or NULL (0) */
    int seqs, table_width, block_size, row_bytes;
    int seq, pass, t; /* the next row to ask for */
} Prefetcher;

static inline void prefetch_row(Prefetcher *p) {
    while (p->seq < p->seqs && p->t >= p->seq_lens[p->seq]) { /* next pass, or next sequence */
        p->pass ^= 1;
        p->seq += p->pass == 0;
        p->t = p->starts && p->seq < p->seqs ? p->starts[p->seq] : 0;
    }
    if (p->seq >= p->seqs) return;
    CacheWalk rows = {p->tables + (int64_t)p->seq * p->table_width, 1, 0, p->block_size};
    const char *row = (p->pass ? p->v_cache : p->k_cache) + token_offset(&rows, p->t++) * p->row_bytes;
    for (int b = 0; b < p->row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
}

/* scores (heads, stride) -> softmax numerators in place over the first len entries; inv_sum[h] = 1 / their sum.
 * softcap > 0: the scores are soft-capped first (softcap_ps). */
static void softmax_rows(float *scores, int heads, int stride, int len, float softcap, float *inv_sum) {
    __mmask16 tail = (__mmask16)((1u << (len % 16 ? len % 16 : 16)) - 1);
    int last = (len - 1) / 16 * 16;
    for (int h = 0; h < heads; h++) {
        float *s = scores + h * stride;
        if (softcap > 0.f) /* rows are padded to whole tiles of 16 */
            for (int t = 0; t < len; t += 16) _mm512_storeu_ps(s + t, softcap_ps(_mm512_loadu_ps(s + t), softcap));
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int t = 0; t < last; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
        mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_loadu_ps(s + last));
        __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx)), total = _mm512_setzero_ps();
        for (int t = 0; t <= last; t += 16) {
            __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
            if (t == last) e = _mm512_maskz_mov_ps(tail, e);
            total = _mm512_add_ps(total, e);
            _mm512_storeu_ps(s + t, e);
        }
        inv_sum[h] = 1.f / _mm512_reduce_add_ps(total);
    }
}

/* ---- bfloat16 with AVX512-BF16: the cache is read in place. ---- */
#ifdef __AVX512BF16__
#define HAVE_AVX512_BF16 1

static inline __mmask32 first_n32(int n) { return n >= 32 ? 0xffffffffu : n <= 0 ? 0 : (1u << n) - 1; }
static inline __mmask16 first_n16(int n) { return n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* Where the score of head h for token t lies: base + (h / heads_per_block) * block_step + h % heads_per_block
 * + t * token_step. Head-major rows (one head per block, block_step = row stride, token_step 1) or, from the
 * matrix engine, token-major blocks of 16 columns (token_step 16) that each hold whole KV groups. */
typedef struct {
    float *base;
    int heads_per_block, block_step, token_step;
} ScoreLayout;

static inline float *score_at(const ScoreLayout *s, int h, int t) {
    return s->base + (int64_t)(h / s->heads_per_block) * s->block_step + h % s->heads_per_block + (int64_t)t * s->token_step;
}

/* Rows (element offsets into a layer's cache) of tokens t0 .. t0 + TILE - 1; rows past len repeat the first, whose
 * scores the softmax masks out. The prefetcher moves on by the rows really read. Returns how many those are. */
static inline int tile_rows(const CacheWalk *w, int t0, int len, int64_t rows[TILE], Prefetcher *pf) {
    int n = len - t0 < TILE ? len - t0 : TILE;
    for (int j = 0; j < n; j++) {
        rows[j] = token_offset(w, t0 + j);
        prefetch_row(pf);
    }
    for (int j = n; j < TILE; j++) rows[j] = rows[0];
    return n;
}

/* Scores, head-major (s->token_step 1), with vdpbf16ps of the bf16 query against each key row in place. */
static void scores_dpbf16(const uint16_t *q, const uint16_t *k_cache, const CacheWalk *w, int len, int heads,
                          int group, int head_dim, float scale, const ScoreLayout *s, Prefetcher *pf) {
    const int chunks = (head_dim + 31) / 32;
    const __m512 vscale = _mm512_set1_ps(scale);
    int64_t rows[TILE];
    for (int t0 = 0; t0 < len; t0 += TILE) {
        tile_rows(w, t0, len, rows, pf);
        for (int h = 0; h < heads; h++) {
            const uint16_t *k = k_cache + h / group * head_dim;
            __m512 a[TILE];
            for (int j = 0; j < TILE; j++) a[j] = _mm512_setzero_ps();
            for (int c = 0; c < chunks; c++) {
                __mmask32 mask = first_n32(head_dim - 32 * c);
                __m512bh qc = (__m512bh)_mm512_maskz_loadu_epi16(mask, q + h * head_dim + 32 * c);
                for (int j = 0; j < TILE; j++)
                    a[j] = _mm512_dpbf16_ps(a[j], qc, (__m512bh)_mm512_maskz_loadu_epi16(mask, k + rows[j] + 32 * c));
            }
            _mm512_storeu_ps(score_at(s, h, t0), _mm512_mul_ps(sum16(a), vscale));
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
/* Scores, token-major and unscaled, on the matrix engine: per 16-token tile and KV group, S^T (16 tokens x group)
 * = K (16 tokens x head_dim, loaded from the cache as it lies) x Q^T; qt holds Q^T of every group in the engine's
 * right-operand layout (per group and 32-dim chunk, 16 rows of dim pairs x 16 heads). Needs a tile never to cross a
 * block (block_size a multiple of 16) and head_dim a multiple of 32; rows past len are read but never used. The
 * caller has configured tiles 0 and 2 as 16 x (group * 4) bytes and tile 1 as 16 x 64. */
static void scores_amx(const uint16_t *k_cache, const CacheWalk *w, int len, int kv_heads, int group, int head_dim,
                       const uint32_t *qt, const ScoreLayout *s, Prefetcher *pf) {
    const int chunks = head_dim / 32, row_bytes = (int)w->token_stride * 2;
    for (int t0 = 0; t0 < len; t0 += TILE) {
        for (int j = t0; j < t0 + TILE && j < len; j++) prefetch_row(pf);
        const uint16_t *tile = k_cache + token_offset(w, t0);
        for (int g = 0; g < kv_heads; g++) {
            _tile_zero(0);
            for (int c = 0; c < chunks; c++) {
                _tile_loadd(1, tile + g * head_dim + 32 * c, row_bytes);
                _tile_loadd(2, qt + (g * chunks + c) * 256, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, score_at(s, g * group, t0), s->token_step * 4);
        }
    }
}

/* q (heads, head_dim) bf16 -> qt as scores_amx reads it. */
static void pack_queries(const uint16_t *q, int kv_heads, int group, int head_dim, uint32_t *qt) {
    const int chunks = head_dim / 32;
    uint32_t pair;
    for (int g = 0; g < kv_heads; g++)
        for (int c = 0; c < chunks; c++)
            for (int r = 0; r < 16; r++)
                for (int m = 0; m < group; m++) {
                    memcpy(&pair, q + (g * group + m) * head_dim + 32 * c + 2 * r, sizeof pair);
                    qt[((g * chunks + c) * 16 + r) * 16 + m] = pair;
                }
}

/* Token-major scores (unscaled) -> softmax numerators in place over tokens [0, len); inv_sum[h] = 1 / their sum. */
static void softmax_columns(const ScoreLayout *s, int heads, int len, float scale, float *inv_sum) {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int h0 = 0; h0 < heads; h0 += s->heads_per_block) {
        float *base = score_at(s, h0, 0), inv[16];
        __m512 mx = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
        for (int t = 0; t < len; t++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(base + 16 * t));
        for (int t = 0; t < len; t++) {
            __m512 e = exp_nonpositive(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(base + 16 * t), mx), vscale));
            total = _mm512_add_ps(total, e);
            _mm512_storeu_ps(base + 16 * t, e);
        }
        _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), total));
        for (int i = 0; i < s->heads_per_block && h0 + i < heads; i++) inv_sum[h0 + i] = inv[i];
    }
}
#else
#define HAVE_AMX 0
#endif

/* One 32-element chunk of every query head of one KV group: acc (G heads, acc_stride) holds each head's chunk as
 * [16 even elements | 16 odd elements] in float32; p the group's first softmax numerator of the tile (head h,
 * token j at p[h * head_step + j * token_step]). G is a constant at every call, so the 2 G accumulators live in
 * registers. */
static inline __attribute__((always_inline)) void values_chunk(const uint16_t *cache, const int64_t rows[TILE], int n,
                                                               int offset, __mmask32 mask, const float *p,
                                                               int head_step, int token_step, float *acc,
                                                               int acc_stride, const int G) {
    __m512 even[8], odd[8];
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int h = 0; h < G; h++) {
        even[h] = _mm512_loadu_ps(acc + h * acc_stride);
        odd[h] = _mm512_loadu_ps(acc + h * acc_stride + 16);
    }
    for (int j = 0; j < n; j++) {
        __m512i x = _mm512_maskz_loadu_epi16(mask, cache + rows[j] + offset);
        __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), hi = _mm512_castsi512_ps(_mm512_and_si512(x, high));
        for (int h = 0; h < G; h++) {
            __m512 pj = _mm512_set1_ps(p[h * head_step + j * token_step]);
            even[h] = _mm512_fmadd_ps(pj, lo, even[h]);
            odd[h] = _mm512_fmadd_ps(pj, hi, odd[h]);
        }
    }
    for (int h = 0; h < G; h++) {
        _mm512_storeu_ps(acc + h * acc_stride, even[h]);
        _mm512_storeu_ps(acc + h * acc_stride + 16, odd[h]);
    }
}

/* out = softmax numerators (in s) x v, divided by the sums. acc: scratch of heads * acc_stride floats. */
static void values_bf16(const uint16_t *v_cache, const CacheWalk *w, int len, int kv_heads, int group, int head_dim,
                        const ScoreLayout *s, const float *inv_sum, float *acc, float *out, Prefetcher *pf) {
    const int heads = kv_heads * group, chunks = (head_dim + 31) / 32, acc_stride = chunks * 32;
    const int head_step = s->heads_per_block == 1 ? s->block_step : 1;
    int64_t rows[TILE];
    memset(acc, 0, sizeof(float) * heads * acc_stride);
    for (int t0 = 0; t0 < len; t0 += TILE) {
        int n = tile_rows(w, t0, len, rows, pf);
        for (int g = 0; g < kv_heads; g++) {
            const float *p = score_at(s, g * group, t0);
            for (int c = 0; c < chunks; c++) {
                __mmask32 mask = first_n32(head_dim - 32 * c);
                int offset = g * head_dim + 32 * c;
                float *a = acc + g * group * acc_stride + 32 * c;
                switch (group) {
#define VALUES_CASE(G) \
    case G: values_chunk(v_cache, rows, n, offset, mask, p, head_step, s->token_step, a, acc_stride, G); break;
                    VALUES_CASE(1) VALUES_CASE(2) VALUES_CASE(3) VALUES_CASE(4)
                    VALUES_CASE(5) VALUES_CASE(6) VALUES_CASE(7) VALUES_CASE(8)
#undef VALUES_CASE
                default:
                    for (int h = 0; h < group; h++)
                        values_chunk(v_cache, rows, n, offset, mask, p + h * head_step, head_step, s->token_step,
                                     a + h * acc_stride, acc_stride, 1);
                }
            }
        }
    }
    const __m512i lo_index = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_index = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int h = 0; h < heads; h++) { /* [even | odd] back to element order, divided by the softmax sum */
        __m512 inv = _mm512_set1_ps(inv_sum[h]);
        for (int c = 0; c < chunks; c++) {
            const float *a = acc + h * acc_stride + 32 * c;
            __m512 even = _mm512_loadu_ps(a), odd = _mm512_loadu_ps(a + 16);
            float *o = out + h * head_dim + 32 * c;
            _mm512_mask_storeu_ps(o, first_n16(head_dim - 32 * c),
                                  _mm512_mul_ps(_mm512_permutex2var_ps(even, lo_index, odd), inv));
            _mm512_mask_storeu_ps(o + 16, first_n16(head_dim - 32 * c - 16),
                                  _mm512_mul_ps(_mm512_permutex2var_ps(even, hi_index, odd), inv));
        }
    }
}

/* One sequence, all heads, bfloat16 read in place. Scores from the matrix engine where `qt` is given (the caller
 * checked the shapes and configured the tiles), else by vdpbf16ps. */
static void bf16_in_place(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const CacheWalk *w,
                          int len, int kv_heads, int head_dim, int group, float scale, float softcap, float *scores,
                          int stride, uint32_t *qt, float *acc, float *out, Prefetcher *pf) {
    const int heads = kv_heads * group;
    float inv_sum[MAX_HEADS];
#if HAVE_AMX
    if (qt) {
        const int per_block = 16 / group * group;
        ScoreLayout s = {scores, per_block, stride * 16, 16};
        pack_queries(q, kv_heads, group, head_dim, qt);
        scores_amx(k_cache, w, len, kv_heads, group, head_dim, qt, &s, pf);
        softmax_columns(&s, heads, len, scale, inv_sum);
        values_bf16(v_cache, w, len, kv_heads, group, head_dim, &s, inv_sum, acc, out, pf);
        return;
    }
#endif
    ScoreLayout s = {scores, 1, stride, 1};
    scores_dpbf16(q, k_cache, w, len, heads, group, head_dim, scale, &s, pf);
    softmax_rows(scores, heads, stride, len, softcap, inv_sum);
    values_bf16(v_cache, w, len, kv_heads, group, head_dim, &s, inv_sum, acc, out, pf);
}
#else
#define HAVE_AVX512_BF16 0
#endif

/* ---- bfloat16 without AVX512-BF16: 16-token tiles converted to float32 once. ---- */

/* Rows t0..t0+n-1 (n <= 16) of one sequence's cache, every KV head (row = kv_heads * head_dim elements), into
 * tile (TILE, row) float32; missing rows are zero. */
static inline void load_tile_bf16(const uint16_t *cache, const CacheWalk *w, int t0, int n, int row, float *tile,
                                  Prefetcher *pf) {
    for (int j = 0; j < n; j++) {
        const uint16_t *src = cache + token_offset(w, t0 + j);
        prefetch_row(pf);
        for (int d = 0; d < row; d += 16) {
            __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + d)));
            _mm512_store_ps(tile + j * row + d, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
        }
    }
    if (n < TILE) memset(tile + n * row, 0, sizeof(float) * (TILE - n) * row);
}

/* One sequence, all heads: q (heads, head_dim) float32, already scaled; scores: scratch of heads * stride
 * floats; tile: scratch of TILE * kv_heads * head_dim floats, 64-byte aligned; out (heads, head_dim) float32.
 * Each tile holds every KV head's rows, so the cache is read as it lies in memory: whole rows, block by block. */
#define DEFINE_AVX512(NAME, T)                                                                                 \
    static void NAME##_avx512(const float *q, const T *k_cache, const T *v_cache, const CacheWalk *w, int len,  \
                              int kv_heads, int head_dim, int group, float softcap, float *scores, int stride,   \
                              float *tile, float *out, Prefetcher *pf) {                                        \
        const int row = kv_heads * head_dim, heads = kv_heads * group;                                          \
        for (int t0 = 0; t0 < len; t0 += TILE) { /* scores = q k^T */                                          \
            int n = len - t0 < TILE ? len - t0 : TILE;                                                          \
            load_tile_##NAME(k_cache, w, t0, n, row, tile, pf);                                                 \
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
        softmax_rows(scores, heads, stride, len, softcap, inv_sum);                                                      \
        memset(out, 0, sizeof(float) * heads * head_dim);                                                       \
        for (int t0 = 0; t0 < len; t0 += TILE) { /* out = p v */                                               \
            int n = len - t0 < TILE ? len - t0 : TILE;                                                          \
            load_tile_##NAME(v_cache, w, t0, n, row, tile, pf);                                                 \
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

/* ---- float32: the cache read in place. ---- */

/* Where tokens t0..t0+n-1 (n <= 16) of one sequence lie; rows past len repeat the first, whose scores the softmax
 * masks out. */
static inline void tile_rows_f32(const float *cache, const CacheWalk *w, int t0, int n, const float *rows[TILE],
                                 Prefetcher *pf) {
    for (int j = 0; j < n; j++) {
        rows[j] = cache + token_offset(w, t0 + j);
        prefetch_row(pf);
    }
    for (int j = n; j < TILE; j++) rows[j] = rows[0];
}

/* out (G heads of one KV group, rows head_dim apart) += p v over a tile of n tokens, p the first head's softmax
 * numerators (the others stride apart): each value vector is loaded once for the G heads, and each head sums its
 * even and its odd tokens in two chains, as the tiled path does. G is a constant where this is inlined. */
static inline __attribute__((always_inline)) void values_f32(const float *const rows[TILE], int n, int off,
                                                             int head_dim, const float *p, int stride, float *o,
                                                             int G) {
    for (int d = 0; d < head_dim; d += 16) {
        __m512 even[GROUP_CHUNK], odd[GROUP_CHUNK];
        for (int h = 0; h < G; h++) {
            even[h] = _mm512_loadu_ps(o + h * head_dim + d);
            odd[h] = _mm512_setzero_ps();
        }
        for (int j = 0; j < n - 1; j += 2) {
            const __m512 va = _mm512_loadu_ps(rows[j] + off + d), vb = _mm512_loadu_ps(rows[j + 1] + off + d);
            for (int h = 0; h < G; h++) {
                even[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * stride + j]), va, even[h]);
                odd[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * stride + j + 1]), vb, odd[h]);
            }
        }
        if (n & 1) {
            const __m512 va = _mm512_loadu_ps(rows[n - 1] + off + d);
            for (int h = 0; h < G; h++) even[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * stride + n - 1]), va, even[h]);
        }
        for (int h = 0; h < G; h++) _mm512_storeu_ps(o + h * head_dim + d, _mm512_add_ps(even[h], odd[h]));
    }
}

/* DEFINE_AVX512's contract for float32, reading each 16-token tile where it lies instead of copying it (tile is
 * NULL): a copy cost as much as the arithmetic, and the rows are float32 already. Same products, same sums. */
static void f32_avx512(const float *q, const float *k_cache, const float *v_cache, const CacheWalk *w, int len,
                       int kv_heads, int head_dim, int group, float softcap, float *scores, int stride, float *tile,
                       float *out, Prefetcher *pf) {
    (void)tile;
    const int heads = kv_heads * group;
    const float *rows[TILE];
    for (int t0 = 0; t0 < len; t0 += TILE) { /* scores = q k^T */
        tile_rows_f32(k_cache, w, t0, len - t0 < TILE ? len - t0 : TILE, rows, pf);
        for (int h = 0; h < heads; h++) {
            const int off = h / group * head_dim;
            const float *qh = q + h * head_dim;
            __m512 acc[TILE];
            for (int j = 0; j < TILE; j++) acc[j] = _mm512_setzero_ps();
            for (int d = 0; d < head_dim; d += 16) {
                __m512 qv = _mm512_loadu_ps(qh + d);
                for (int j = 0; j < TILE; j++)
                    acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows[j] + off + d), acc[j]);
            }
            _mm512_storeu_ps(scores + h * stride + t0, sum16(acc));
        }
    }
    float inv_sum[MAX_HEADS];
    softmax_rows(scores, heads, stride, len, softcap, inv_sum);
    memset(out, 0, sizeof(float) * heads * head_dim);
    for (int t0 = 0; t0 < len; t0 += TILE) { /* out = p v, up to GROUP_CHUNK heads of a group at a time */
        const int n = len - t0 < TILE ? len - t0 : TILE;
        tile_rows_f32(v_cache, w, t0, n, rows, pf);
        for (int h = 0, chunk; h < heads; h += chunk) { /* a group's last chunk may be short */
            chunk = group - h % group < GROUP_CHUNK ? group - h % group : GROUP_CHUNK;
            const float *p = scores + h * stride + t0;
            const int off = h / group * head_dim;
            float *o = out + h * head_dim;
            switch (chunk) {
            case 1: values_f32(rows, n, off, head_dim, p, stride, o, 1); break;
            case 2: values_f32(rows, n, off, head_dim, p, stride, o, 2); break;
            case 3: values_f32(rows, n, off, head_dim, p, stride, o, 3); break;
            default: values_f32(rows, n, off, head_dim, p, stride, o, 4); break;
            }
        }
    }
    for (int h = 0; h < heads; h++) {
        __m512 inv = _mm512_set1_ps(inv_sum[h]);
        for (int d = 0; d < head_dim; d += 16)
            _mm512_storeu_ps(out + h * head_dim + d, _mm512_mul_ps(_mm512_loadu_ps(out + h * head_dim + d), inv));
    }
}
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#define HAVE_AVX512_BF16 0
#endif

/* ---------------------------------------------------------------------------------------------------------- */
/* Entry points. q, out: (seqs, heads, head_dim) contiguous; tables: (seqs, table_width) int32. Row i attends to  */
/* tokens [starts[i], seq_lens[i]) (starts NULL: from 0; a sliding window starts later); softcap > 0 soft-caps  */
/* the scores (Gemma 2), 0 leaves them. Return 0, or -1 on sizes this kernel does not take (torch serves then). */

static int check(int heads, int kv_heads, int head_dim, int block_size) {
    if (kv_heads <= 0 || heads % kv_heads) return -1;
    return heads / kv_heads > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK ? -1 : 0;
}

/* The longest sequence, and at least 1: scratch sized from it is never empty. */
static int max_len(const int32_t *seq_lens, int seqs) {
    int m = 1;
    for (int i = 0; i < seqs; i++) m = seq_lens[i] > m ? seq_lens[i] : m;
    return m;
}

#if HAVE_AVX512
#define PREFETCHER_INIT(T)                                                                                     \
    Prefetcher pf = {(const char *)k_cache, (const char *)v_cache, tables, seq_lens, starts, last, table_width,   \
                     block_size, (int)(sizeof(T) * kv_heads * head_dim), first, 0, starts ? starts[first] : 0};  \
    for (int r = 0; r < PREFETCH_ROWS; r++) prefetch_row(&pf)
#define AVX512_CALL(NAME) \
    NAME##_avx512(qf, k_cache, v_cache, &w, len, kv_heads, head_dim, group, softcap, scores, stride, tile, of, &pf)
#else
#define PREFETCHER_INIT(T) (void)0
#define AVX512_CALL(NAME) (void)0
#endif

/* Sequences [first, last) through the AVX-512 path or the portable loop; COPIES_TILE: the AVX-512 path converts
 * each tile into a float32 scratch (bfloat16), else it reads the cache in place and needs none (float32). */
#define DEFINE_TILED(NAME, T, TO_F32, FROM_F32, COPIES_TILE)                                                   \
    static int tiled_##NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *tables,             \
                            const int32_t *seq_lens, const int32_t *starts, T *out, int first, int last,        \
                            int heads, int kv_heads, int head_dim, int block_size, int table_width, float scale, \
                            float softcap) {                                                                    \
        if (first >= last) return 0;                                                                            \
        int group = heads / kv_heads, vector = HAVE_AVX512 && head_dim % 16 == 0 && heads <= MAX_HEADS;        \
        int stride = (max_len(seq_lens + first, last - first) + TILE - 1) / TILE * TILE;                       \
        float *scores = NULL, *tile = NULL, *qf = NULL, *of = NULL;                                             \
        size_t tile_bytes = sizeof(float) * TILE * kv_heads * head_dim;                                        \
        if (vector) {                                                                                           \
            scores = malloc(sizeof(float) * (size_t)heads * stride);                                           \
            if (COPIES_TILE) tile = aligned_alloc(64, (tile_bytes + 63) / 64 * 64);                            \
        }                                                                                                       \
        qf = malloc(sizeof(float) * heads * head_dim);                                                          \
        of = malloc(sizeof(float) * heads * head_dim);                                                          \
        int status = (vector && (!scores || (COPIES_TILE && !tile))) || !qf || !of ? -1 : 0;                   \
        PREFETCHER_INIT(T);                                                                                     \
        for (int i = first; i < last && status == 0; i++) {                                                     \
            const T *qi = q + (int64_t)i * heads * head_dim;                                                    \
            T *oi = out + (int64_t)i * heads * head_dim;                                                        \
            const int start = starts ? starts[i] : 0, len = seq_lens[i] - start;                               \
            if (len <= 0) {                                                                                     \
                for (int x = 0; x < heads * head_dim; x++) oi[x] = FROM_F32(0.f);                              \
                continue;                                                                                       \
            }                                                                                                   \
            CacheWalk w = {tables + (int64_t)i * table_width, (int64_t)kv_heads * head_dim, 0, block_size, start}; \
            if (vector) {                                                                                       \
                for (int x = 0; x < heads * head_dim; x++) qf[x] = TO_F32(qi[x]) * scale;                      \
                AVX512_CALL(NAME);                                                                              \
            } else {                                                                                            \
                for (int x = 0; x < heads * head_dim; x++) qf[x] = TO_F32(qi[x]);                              \
                for (int h = 0; h < kv_heads; h++) {                                                            \
                    w.head_offset = (int64_t)h * head_dim;                                                      \
                    NAME##_portable(qf + h * group * head_dim, k_cache, v_cache, &w, len, head_dim, group,       \
                                    scale, softcap, of + h * group * head_dim);                                 \
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

#define IDENTITY(x) (x)
DEFINE_TILED(bf16, uint16_t, bf16_to_f32, f32_to_bf16, 1)
DEFINE_TILED(f32, float, IDENTITY, IDENTITY, 0)

#if HAVE_AVX512_BF16
/* Sequences [first, last) read in place; the matrix engine computes the scores where the shapes let it. */
static int in_place_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *tables,
                         const int32_t *seq_lens, const int32_t *starts, uint16_t *out, int first, int last,
                         int heads, int kv_heads, int head_dim, int block_size, int table_width, float scale,
                         float softcap) {
    if (first >= last) return 0;
    const int group = heads / kv_heads, stride = (max_len(seq_lens + first, last - first) + TILE - 1) / TILE * TILE;
    const int chunks = (head_dim + 31) / 32;
    int amx = HAVE_AMX && block_size % TILE == 0 && head_dim % 32 == 0 && group <= 16;
#if HAVE_AMX
    amx = amx && amx_granted();
#endif
    /* token-major scores: blocks of 16 columns, each holding 16 / group whole groups; zeroed, as columns no group
     * writes still go through the softmax */
    size_t score_floats = amx ? (size_t)((heads + 16 / group * group - 1) / (16 / group * group)) * stride * 16
                              : (size_t)heads * stride;
    float *scores = amx ? calloc(score_floats, sizeof(float)) : malloc(sizeof(float) * score_floats);
    float *acc = aligned_alloc(64, sizeof(float) * heads * chunks * 32);
    float *of = malloc(sizeof(float) * heads * head_dim);
    uint32_t *qt = amx ? aligned_alloc(64, sizeof(uint32_t) * kv_heads * chunks * 256) : NULL;
    int status = !scores || !acc || !of || (amx && !qt) ? -1 : 0;
#if HAVE_AMX
    if (amx && status == 0) {
        TileConfig cfg = {0};
        cfg.palette = 1;
        cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = 16;
        cfg.colsb[0] = cfg.colsb[2] = (uint16_t)(group * 4);
        cfg.colsb[1] = 64;
        load_tile_config(&cfg);
    }
#endif
    PREFETCHER_INIT(uint16_t);
    for (int i = first; i < last && status == 0; i++) {
        uint16_t *oi = out + (int64_t)i * heads * head_dim;
        const int start = starts ? starts[i] : 0, len = seq_lens[i] - start;
        if (len <= 0) {
            memset(oi, 0, sizeof(uint16_t) * heads * head_dim);
            continue;
        }
        CacheWalk w = {tables + (int64_t)i * table_width, (int64_t)kv_heads * head_dim, 0, block_size, start};
        /* the matrix engine's tiles must not cross a block, and its softmax does not soft-cap */
        uint32_t *qt_i = start % TILE == 0 && softcap == 0.f ? qt : NULL;
        bf16_in_place(q + (int64_t)i * heads * head_dim, k_cache, v_cache, &w, len, kv_heads, head_dim, group, scale,
                      softcap, scores, stride, qt_i, acc, of, &pf);
        for (int x = 0; x < heads * head_dim; x++) oi[x] = f32_to_bf16(of[x]);
    }
#if HAVE_AMX
    if (amx) _tile_release();
#endif
    free(scores);
    free(acc);
    free(of);
    free(qt);
    return status;
}
#endif

/* Sequences per thread: contiguous runs of about equal total length, so each thread's prefetcher walks its own
 * rows in order. cuts[p] is the first sequence of thread p; cuts[parts] = seqs. */
static void split_by_length(const int32_t *seq_lens, int seqs, int parts, int *cuts) {
    int64_t total = 0, seen = 0;
    for (int i = 0; i < seqs; i++) total += seq_lens[i] > 0 ? seq_lens[i] : 0;
    int p = 1;
    cuts[0] = 0;
    for (int i = 0; i < seqs && p < parts; i++) {
        seen += seq_lens[i] > 0 ? seq_lens[i] : 0;
        while (p < parts && seen * parts >= total * p) cuts[p++] = i + 1;
    }
    while (p <= parts) cuts[p++] = seqs;
}

/* Cached tokens per extra thread below which one thread serves the whole batch. */
#define MIN_TOKENS_PER_THREAD 256
#define MAX_THREADS 256

#define DECODE_IN_PARALLEL(RANGE_FN)                                                                           \
    do {                                                                                                       \
        int64_t tokens = 0;                                                                                     \
        for (int i = 0; i < seqs; i++) tokens += seq_lens[i] > 0 ? seq_lens[i] : 0;                           \
        threads = threads_for(threads < MAX_THREADS ? threads : MAX_THREADS, tokens, MIN_TOKENS_PER_THREAD);   \
        int cuts[MAX_THREADS + 1], status = 0;                                                                  \
        split_by_length(seq_lens, seqs, threads, cuts);                                                         \
        _Pragma("omp parallel for num_threads(threads) reduction(| : status) if (threads > 1)")               \
        for (int p = 0; p < threads; p++)                                                                       \
            status |= RANGE_FN(q, k_cache, v_cache, tables, seq_lens, starts, out, cuts[p], cuts[p + 1], heads,  \
                               kv_heads, head_dim, block_size, table_width, scale, softcap);                    \
        return status ? -1 : 0;                                                                                 \
    } while (0)

int decode_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *tables,
                          const int32_t *seq_lens, const int32_t *starts, uint16_t *out, int seqs, int heads,
                          int kv_heads, int head_dim, int block_size, int table_width, float scale, float softcap,
                          int threads) {
    if (check(heads, kv_heads, head_dim, block_size)) return -1;
#if HAVE_AVX512_BF16
    if (heads <= MAX_HEADS) DECODE_IN_PARALLEL(in_place_bf16);
#endif
    DECODE_IN_PARALLEL(tiled_bf16);
}

int decode_attention_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *tables,
                         const int32_t *seq_lens, const int32_t *starts, float *out, int seqs, int heads, int kv_heads,
                         int head_dim, int block_size, int table_width, float scale, float softcap, int threads) {
    if (check(heads, kv_heads, head_dim, block_size)) return -1;
    DECODE_IN_PARALLEL(tiled_f32);
}
