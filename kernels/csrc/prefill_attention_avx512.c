/* Prompt-chunk attention with AVX-512F, float32 compute, for CPUs without the matrix engine (AMX): the queries of
 * every prompt chunk of a batch against their sequences' cached keys and values (the chunks' own included), causal,
 * flash-attention style (online softmax over 16-key tiles). q and the caches are float32 or bfloat16; bfloat16 is
 * widened to float32 on load by a shift, so no AVX512-BF16 instruction is needed.
 *
 * A work unit is (sequence's chunk, tile of PF_QROWS queries, KV head): the tile's rows times the group's query heads,
 * up to PF_QROWS * group query vectors, against keys [0, position of the tile's last row]. Per 16-key tile:
 * - the tile's keys are converted to float32 and transposed into head_dim x 16 (scratch, L1), so the scores of one
 *   query vector are one zmm: sum over d of q[d] (broadcast) times row d of the transposed tile; 16 query vectors
 *   share each load of a transposed row;
 * - causal mask, online softmax (running max and sum per query vector; the output is rescaled when the max grows),
 *   16 query vectors at a time: their maxima from one transpose, their rescaling factors from one vector exp;
 * - out += p v, with the value rows (converted to float32 once per tile) as they lie in the cache.
 * Rows whose position lies before the key tile are skipped. Keys past a row's position get probability 0 exactly;
 * key slots past the tile's last key are zero, so no cache slot a sequence does not own is read.
 *
 * Work units are dealt to threads round-robin; each unit (so each output row) is computed by one thread, key tiles
 * in order: results do not depend on the thread count. Returns 0, or -1 for shapes it does not take (head_dim not a
 * multiple of 16 or above 256, group above 16, a chunk longer than its sequence, no AVX-512F, no memory); the caller
 * then attends each row as a decode.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_cache.h"
#include "parallel.h"

#define PF_MAX_HEAD_DIM 256
#define PF_MAX_GROUP 16
#define PF_TILE 16
/* Query rows per work unit: each key tile, widened and transposed once per unit, serves all of them. */
#define PF_QROWS 64
#define PF_QBLOCK 16 /* query vectors sharing each load of a transposed key row; softmax_block needs 16 */

#ifdef __AVX512F__
#include <immintrin.h>

#include "vector_math.h"

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline void store16_f32(float *p, __m512 x) { _mm512_storeu_ps(p, x); }
/* float32 -> bfloat16, round to nearest even as torch does; NaN stays NaN. */
static inline void store16_bf16(uint16_t *p, __m512 x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet)));
}

/* r[i] (row i of a 16 x 16 block) -> r[i] = column i. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* Scratch of one thread. */
typedef struct {
    float *q;       /* (nq, head_dim): the unit's query vectors, scaled; nq = 16 * group rounded up to PF_QBLOCK */
    float *o;       /* (nq, head_dim): unnormalised outputs */
    float *kt;      /* (head_dim, 16): the key tile transposed */
    float *v;       /* (16, head_dim): the value tile */
    float *m, *l;   /* (nq), (nq, 16): running max, and partial running sums */
} Scratch;

/* Scores of a block of PF_QBLOCK query vectors against the transposed key tile; q: the block as (head_dim,
 * PF_QBLOCK), so every broadcast is at a fixed offset from one pointer. */
static inline __attribute__((always_inline)) void scores_block(const float *q, const float *kt, int head_dim,
                                                               __m512 s[PF_QBLOCK]) {
    for (int b = 0; b < PF_QBLOCK; b++) s[b] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d++) {
        const __m512 k = _mm512_load_ps(kt + 16 * d);
        for (int b = 0; b < PF_QBLOCK; b++) s[b] = _mm512_fmadd_ps(_mm512_set1_ps(q[d * PF_QBLOCK + b]), k, s[b]);
    }
}

/* Online softmax of one block of PF_QBLOCK (= 16) query vectors over one key tile: query vector b sees the tile's
 * first valid[b] keys (none where valid[b] <= 0). m: the block's running maxima (16), l: its running sums, one
 * vector of partial sums per query vector (16 x 16), reduced only at the end. Out: probs[b] (zero past the valid
 * keys) and alpha[b], the factor the block's outputs are rescaled by. The maxima of all 16 query vectors come from
 * one transpose, so the rescaling factors are one vector exp. */
static inline __attribute__((always_inline)) void softmax_block(const __m512 s[PF_QBLOCK], const int *valid, float *m,
                                                                float *l, float probs[PF_QBLOCK][PF_TILE],
                                                                float *alpha) {
    __m512 t[16];
    __mmask16 keep[PF_QBLOCK];
    for (int b = 0; b < PF_QBLOCK; b++) {
        const int n = valid[b] < 0 ? 0 : valid[b];
        keep[b] = (__mmask16)((1u << n) - 1);
        t[b] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep[b], s[b]);
    }
    transpose16(t);
    __m512 top = t[0];
    for (int j = 1; j < 16; j++) top = _mm512_max_ps(top, t[j]);
    const __m512 m_old = _mm512_loadu_ps(m), m_new = _mm512_max_ps(m_old, top);
    /* a query vector that has seen no key yet keeps m = -inf; 0 stands in for it, so no -inf - -inf */
    const __m512 shift = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                                            _mm512_setzero_ps());
    const __m512 a = exp_nonpositive(_mm512_sub_ps(m_old, shift));
    _mm512_storeu_ps(m, m_new);
    _mm512_storeu_ps(alpha, a);
    float shifts[16];
    _mm512_storeu_ps(shifts, shift);
    for (int b = 0; b < PF_QBLOCK; b++) {
        const __m512 p = _mm512_maskz_mov_ps(keep[b], exp_nonpositive(_mm512_sub_ps(s[b], _mm512_set1_ps(shifts[b]))));
        _mm512_store_ps(probs[b], p);
        _mm512_storeu_ps(l + 16 * b, _mm512_fmadd_ps(_mm512_loadu_ps(l + 16 * b), _mm512_set1_ps(alpha[b]), p));
    }
}

/* For 4 query vectors b: o[b] (head_dim) = alpha[b] * o[b] + sum_j p[b][j] v[j], j < n; 4 x 64 dims at a time in
 * registers, each value load shared by the 4. */
static inline __attribute__((always_inline)) void accumulate4(float *o, const float p[4][PF_TILE], const float *alpha,
                                                              int n, const float *v, int head_dim) {
    for (int c0 = 0; c0 < head_dim; c0 += 64) {
        const int chunks = (head_dim - c0) / 16 < 4 ? (head_dim - c0) / 16 : 4;
        __m512 acc[4][4];
        for (int b = 0; b < 4; b++) {
            const __m512 a = _mm512_set1_ps(alpha[b]);
            for (int c = 0; c < 4; c++)
                acc[b][c] = c < chunks ? _mm512_mul_ps(_mm512_load_ps(o + b * head_dim + c0 + 16 * c), a)
                                       : _mm512_setzero_ps();
        }
        for (int j = 0; j < n; j++) {
            const float *vj = v + j * head_dim + c0;
            __m512 vv[4];
            for (int c = 0; c < 4; c++) vv[c] = c < chunks ? _mm512_load_ps(vj + 16 * c) : _mm512_setzero_ps();
            for (int b = 0; b < 4; b++) {
                const __m512 pj = _mm512_set1_ps(p[b][j]);
                for (int c = 0; c < 4; c++)
                    if (c < chunks) acc[b][c] = _mm512_fmadd_ps(pj, vv[c], acc[b][c]);
            }
        }
        for (int b = 0; b < 4; b++)
            for (int c = 0; c < 4; c++)
                if (c < chunks) _mm512_store_ps(o + b * head_dim + c0 + 16 * c, acc[b][c]);
    }
}

#define DEFINE_UNIT(NAME, T)                                                                                      \
    /* Query rows [i0, i0 + rows) of a chunk whose first row sits at position first_pos, heads of KV head h: q, out \
     * point at row i0 (rows of heads * head_dim elements). */                                                    \
    static void unit_##NAME(const T *q, T *out, const T *k_cache, const T *v_cache, const CacheWalk *w,           \
                            int first_pos, int rows, int heads, int group, int h, int head_dim, float scale,      \
                            const Scratch *x) {                                                                   \
        const int nq = (rows * group + PF_QBLOCK - 1) / PF_QBLOCK * PF_QBLOCK, last_pos = first_pos + rows - 1;   \
        const int64_t row = (int64_t)heads * head_dim;                                                            \
        const __m512 scaled = _mm512_set1_ps(scale);                                                              \
        memset(x->q, 0, sizeof(float) * nq * head_dim);                                                           \
        for (int r = 0; r < rows; r++) /* query vector v = r * group + g, in blocks of (head_dim, PF_QBLOCK) */  \
            for (int g = 0; g < group; g++) {                                                                     \
                const int v = r * group + g;                                                                      \
                const T *src = q + r * row + (int64_t)(h * group + g) * head_dim;                                 \
                float *dst = x->q + (int64_t)(v / PF_QBLOCK) * head_dim * PF_QBLOCK + v % PF_QBLOCK;              \
                float f[16];                                                                                      \
                for (int d0 = 0; d0 < head_dim; d0 += 16) {                                                       \
                    _mm512_storeu_ps(f, _mm512_mul_ps(load16_##NAME(src + d0), scaled));                          \
                    for (int d = 0; d < 16; d++) dst[(d0 + d) * PF_QBLOCK] = f[d];                                \
                }                                                                                                 \
            }                                                                                                     \
        memset(x->o, 0, sizeof(float) * nq * head_dim);                                                           \
        for (int v = 0; v < nq; v++) x->m[v] = -INFINITY;                                                         \
        memset(x->l, 0, sizeof(float) * 16 * nq);                                                                 \
        for (int t0 = 0; t0 <= last_pos; t0 += PF_TILE) {                                                         \
            const int n = last_pos + 1 - t0 < PF_TILE ? last_pos + 1 - t0 : PF_TILE;                              \
            int64_t at[PF_TILE];                                                                                  \
            for (int j = 0; j < n; j++) at[j] = token_offset(w, t0 + j);                                          \
            for (int d0 = 0; d0 < head_dim; d0 += 16) { /* keys -> kt, values -> v, as float32 */                 \
                __m512 k[16];                                                                                     \
                for (int j = 0; j < PF_TILE; j++) {                                                               \
                    if (j < n) {                                                                                  \
                        k[j] = load16_##NAME(k_cache + at[j] + d0);                                               \
                        _mm512_store_ps(x->v + j * head_dim + d0, load16_##NAME(v_cache + at[j] + d0));           \
                    } else {                                                                                      \
                        k[j] = _mm512_setzero_ps();                                                               \
                        _mm512_store_ps(x->v + j * head_dim + d0, k[j]);                                          \
                    }                                                                                             \
                }                                                                                                 \
                transpose16(k);                                                                                   \
                for (int d = 0; d < 16; d++) _mm512_store_ps(x->kt + 16 * (d0 + d), k[d]);                        \
            }                                                                                                     \
            for (int v0 = 0; v0 < nq; v0 += PF_QBLOCK) {                                                          \
                if (first_pos + (v0 + PF_QBLOCK - 1) / group < t0) continue; /* all rows of the block precede it */ \
                __m512 s[PF_QBLOCK];                                                                              \
                scores_block(x->q + (int64_t)v0 * head_dim, x->kt, head_dim, s);                                  \
                float probs[PF_QBLOCK][PF_TILE] __attribute__((aligned(64))), alpha[PF_QBLOCK];                   \
                int valid[PF_QBLOCK]; /* keys of the tile each query vector sees */                               \
                for (int b = 0; b < PF_QBLOCK; b++) {                                                             \
                    const int r = (v0 + b) / group;                                                               \
                    valid[b] = r >= rows ? 0 : first_pos + r - t0 + 1 < n ? first_pos + r - t0 + 1 : n;           \
                }                                                                                                 \
                softmax_block(s, valid, x->m + v0, x->l + (int64_t)16 * v0, probs, alpha);                        \
                for (int b = 0; b < PF_QBLOCK; b += 4)                                                            \
                    accumulate4(x->o + (int64_t)(v0 + b) * head_dim, probs + b, alpha + b, n, x->v, head_dim);    \
            }                                                                                                     \
        }                                                                                                         \
        for (int r = 0; r < rows; r++)                                                                            \
            for (int g = 0; g < group; g++) {                                                                     \
                const int v = r * group + g;                                                                      \
                const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(x->l + 16 * v)));    \
                T *dst = out + r * row + (int64_t)(h * group + g) * head_dim;                                     \
                for (int d = 0; d < head_dim; d += 16)                                                            \
                    store16_##NAME(dst + d, _mm512_mul_ps(_mm512_loadu_ps(x->o + (int64_t)v * head_dim + d), inv)); \
            }                                                                                                     \
    }

DEFINE_UNIT(f32, float)
DEFINE_UNIT(bf16, uint16_t)

/* Query tiles (PF_QROWS rows) of sequence i's chunk. */
static inline int query_tiles(const int32_t *query_start, int i) {
    return (query_start[i + 1] - query_start[i] + PF_QROWS - 1) / PF_QROWS;
}

/* Work below which one more thread is not worth waking: query vectors x keys x head_dim multiply-adds. */
#define PF_MIN_WORK_PER_THREAD (1 << 18)

#define DEFINE_ENTRY(NAME, T)                                                                                      \
    static int run_##NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *tables,                    \
                          const int32_t *query_start, const int32_t *seq_lens, T *out, int seqs, int heads,         \
                          int kv_heads, int head_dim, int block_size, int table_width, float scale, int threads) {  \
        if (seqs <= 0) return 0;                                                                                    \
        if (kv_heads <= 0 || heads % kv_heads || heads / kv_heads > PF_MAX_GROUP || head_dim <= 0 ||               \
            head_dim % 16 || head_dim > PF_MAX_HEAD_DIM || block_size <= 0)                                         \
            return -1;                                                                                              \
        const int group = heads / kv_heads;                                                                         \
        int64_t work = 0;                                                                                           \
        for (int i = 0; i < seqs; i++) {                                                                            \
            const int chunk = query_start[i + 1] - query_start[i];                                                  \
            if (chunk < 0 || chunk > seq_lens[i]) return -1;                                                        \
            work += (int64_t)chunk * seq_lens[i];                                                                   \
        }                                                                                                           \
        /* units in a fixed order: sequence, KV head (its keys and values stay in cache for the next unit), tile */ \
        int64_t *first_unit = malloc(sizeof(int64_t) * (seqs + 1));                                                 \
        if (!first_unit) return -1;                                                                                 \
        first_unit[0] = 0;                                                                                          \
        for (int i = 0; i < seqs; i++)                                                                              \
            first_unit[i + 1] = first_unit[i] + query_tiles(query_start, i) * kv_heads;                            \
        const int64_t total = first_unit[seqs];                                                                     \
        if (total == 0) {                                                                                           \
            free(first_unit);                                                                                       \
            return 0;                                                                                               \
        }                                                                                                           \
        threads = threads_for(threads, work * heads * head_dim, PF_MIN_WORK_PER_THREAD);                           \
        threads = threads > total ? (int)total : threads;                                                           \
        const int nq = (PF_QROWS * group + PF_QBLOCK - 1) / PF_QBLOCK * PF_QBLOCK;                                   \
        const int64_t row = (int64_t)heads * head_dim;                                                              \
        int status = 0;                                                                                             \
        _Pragma("omp parallel num_threads(threads) if (threads > 1) reduction(| : status)")                        \
        {                                                                                                           \
            const int part = thread_index(), parts = thread_count();                                                \
            Scratch x = {aligned_alloc(64, sizeof(float) * nq * head_dim),                                          \
                         aligned_alloc(64, sizeof(float) * nq * head_dim),                                          \
                         aligned_alloc(64, sizeof(float) * PF_TILE * head_dim),                                     \
                         aligned_alloc(64, sizeof(float) * PF_TILE * head_dim), malloc(sizeof(float) * nq),         \
                         malloc(sizeof(float) * 16 * nq)};                                                          \
            if (x.q && x.o && x.kt && x.v && x.m && x.l) {                                                          \
                int i = 0;                                                                                          \
                for (int64_t u = part; u < total; u += parts) {                                                     \
                    while (u >= first_unit[i + 1]) i++;                                                             \
                    const int64_t local = u - first_unit[i];                                                        \
                    const int qtiles = query_tiles(query_start, i);                                                 \
                    const int h = (int)(local / qtiles), tile = (int)(local % qtiles);                              \
                    const int chunk = query_start[i + 1] - query_start[i], i0 = tile * PF_QROWS;                     \
                    const int rows = chunk - i0 < PF_QROWS ? chunk - i0 : PF_QROWS;                                   \
                    const CacheWalk w = {tables + (int64_t)i * table_width, (int64_t)kv_heads * head_dim,           \
                                         (int64_t)h * head_dim, block_size};                                        \
                    const int64_t at = ((int64_t)query_start[i] + i0) * row;                                        \
                    unit_##NAME(q + at, out + at, k_cache, v_cache, &w, seq_lens[i] - chunk + i0, rows, heads,      \
                                group, h, head_dim, scale, &x);                                                     \
                }                                                                                                   \
            } else {                                                                                                \
                status = -1;                                                                                        \
            }                                                                                                       \
            free(x.q);                                                                                              \
            free(x.o);                                                                                              \
            free(x.kt);                                                                                             \
            free(x.v);                                                                                              \
            free(x.m);                                                                                              \
            free(x.l);                                                                                              \
        }                                                                                                           \
        free(first_unit);                                                                                           \
        return status ? -1 : 0;                                                                                     \
    }

DEFINE_ENTRY(f32, float)
DEFINE_ENTRY(bf16, uint16_t)

#define HAVE_PF_AVX512 1
#else
#define HAVE_PF_AVX512 0
#endif

/* q, out: (tokens, heads, head_dim) contiguous; sequence i's chunk is rows [query_start[i], query_start[i + 1]), the
 * last of its seq_lens[i] tokens; tables: (seqs, table_width) int32; caches (blocks, block_size, kv_heads,
 * head_dim). */
int prefill_attention_avx512_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *tables,
                                 const int32_t *query_start, const int32_t *seq_lens, float *out, int seqs, int heads,
                                 int kv_heads, int head_dim, int block_size, int table_width, float scale,
                                 int threads) {
#if HAVE_PF_AVX512
    return run_f32(q, k_cache, v_cache, tables, query_start, seq_lens, out, seqs, heads, kv_heads, head_dim,
                   block_size, table_width, scale, threads);
#else
    (void)q, (void)k_cache, (void)v_cache, (void)tables, (void)query_start, (void)seq_lens, (void)out, (void)seqs;
    (void)heads, (void)kv_heads, (void)head_dim, (void)block_size, (void)table_width, (void)scale, (void)threads;
    return -1;
#endif
}

int prefill_attention_avx512_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                  const int32_t *tables, const int32_t *query_start, const int32_t *seq_lens,
                                  uint16_t *out, int seqs, int heads, int kv_heads, int head_dim, int block_size,
                                  int table_width, float scale, int threads) {
#if HAVE_PF_AVX512
    return run_bf16(q, k_cache, v_cache, tables, query_start, seq_lens, out, seqs, heads, kv_heads, head_dim,
                    block_size, table_width, scale, threads);
#else
    (void)q, (void)k_cache, (void)v_cache, (void)tables, (void)query_start, (void)seq_lens, (void)out, (void)seqs;
    (void)heads, (void)kv_heads, (void)head_dim, (void)block_size, (void)table_width, (void)scale, (void)threads;
    return -1;
#endif
}
