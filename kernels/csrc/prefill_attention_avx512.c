/* Prompt-chunk attention with AVX-512F, float32 compute, for CPUs without the matrix engine (AMX): the queries of
 * every prompt chunk of a batch against their sequences' cached keys and values (the chunks' own included), causal,
 * flash-attention style (online softmax over tiles of PF_KEYS keys). q and the caches are float32 or bfloat16;
 * bfloat16 is widened to float32 on load by a shift, so no AVX512-BF16 instruction is needed.
 *
 * A work unit is (sequence's chunk, tile of PF_QROWS queries, KV head): the tile's rows times the group's query heads,
 * the unit's query vectors, against keys [0, position of the tile's last row] — with a sliding window of W keys, from
 * the key tile holding the first row's first visible key (position - W + 1), keys before a row's window masked as
 * those past its position are. Per key tile:
 * - the tile's keys are converted to float32 and transposed into head_dim x PF_KEYS, its values converted as they lie
 *   (scratch), once for all the unit's query vectors;
 * - scores as a matrix product: PF_QV query vectors at a time against the whole tile, each vector's PF_KEYS scores in
 *   four registers, each load of a transposed key row shared by the PF_QV vectors;
 * - causal mask, online softmax per query vector (running max and sum; the output is rescaled when the max grows);
 * - out = alpha out + p v as a matrix product: PF_QV query vectors at a time, each value load shared by them.
 * PF_QV query vectors at a time go through all three steps, so their scores are still in L1 when their softmax and
 * their update read them. Query vectors whose row lies before the key tile, or whose window starts after it, are
 * skipped (they would see no key of it, which leaves their sums exactly as they are). Keys past a row's position
 * get probability 0 exactly; key slots past the tile's last key are zero, so no cache slot a sequence does not own
 * is read.
 *
 * Work units are handed out in order to whichever thread is free (units differ in cost: a causal tile's keys grow
 * with its position, so dealing them round-robin left one thread the costlier half); each unit (so each output row)
 * is computed by one thread, key tiles in order: results do not depend on the thread count or on which thread.
 * Returns 0, or -1 for shapes it does not take (head_dim not a multiple of 16 or above 256, group above 16, a chunk
 * longer than its sequence, no AVX-512F, no memory); the caller then attends each row as a decode.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_cache.h"
#include "parallel.h"

#define PF_MAX_HEAD_DIM 256
#define PF_MAX_GROUP 16
/* Query rows per work unit: each key tile, widened and transposed once per unit, serves all of them. */
#define PF_QROWS 64
#define PF_KEYS 64 /* keys per tile: four vectors of scores per query vector */
#define PF_QV 6    /* query vectors per micro-kernel: 6 x 4 accumulators */

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

/* Scratch of one thread. */
typedef struct {
    float *q;     /* (nq, head_dim): the unit's query vectors, scaled, vector v = row * group + head in group */
    float *o;     /* (nq, head_dim): unnormalised outputs */
    float *s;     /* (nq, PF_KEYS): one key tile's scores, then its probabilities */
    float *kt;    /* (head_dim, PF_KEYS): the key tile transposed */
    float *v;     /* (PF_KEYS, head_dim): the value tile */
    float *m, *l; /* (nq) each: running max and running sum */
    float *alpha; /* (nq): this tile's rescaling factor of each query vector's output */
} Scratch;

/* Scores of mr query vectors (rows of q, head_dim apart) against the transposed key tile, into rows of s: an outer
 * product, PF_KEYS keys (four vectors) per query vector in registers, each key load shared by the mr vectors. */
static inline __attribute__((always_inline)) void scores_rows(const float *q, const float *kt, int head_dim, float *s,
                                                              int mr) {
    __m512 acc[PF_QV][4];
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < 4; c++) acc[i][c] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d++) {
        __m512 k[4];
        for (int c = 0; c < 4; c++) k[c] = _mm512_load_ps(kt + d * PF_KEYS + 16 * c);
        for (int i = 0; i < mr; i++) {
            const __m512 x = _mm512_set1_ps(q[i * head_dim + d]);
            for (int c = 0; c < 4; c++) acc[i][c] = _mm512_fmadd_ps(x, k[c], acc[i][c]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < 4; c++) _mm512_store_ps(s + i * PF_KEYS + 16 * c, acc[i][c]);
}

/* o (mr rows, head_dim apart) = alpha * o + p v over the tile's first n keys, `chunks` vectors of dims at a time: an
 * outer product, each value load shared by the mr query vectors. */
static inline __attribute__((always_inline)) void update_rows(float *o, const float *p, const float *alpha, int n,
                                                              const float *v, int head_dim, int mr, int chunks) {
    for (int c0 = 0; c0 < head_dim; c0 += 16 * chunks) {
        __m512 acc[PF_QV][4];
        for (int i = 0; i < mr; i++) {
            const __m512 a = _mm512_set1_ps(alpha[i]);
            for (int c = 0; c < chunks; c++)
                acc[i][c] = _mm512_mul_ps(_mm512_load_ps(o + i * head_dim + c0 + 16 * c), a);
        }
        for (int j = 0; j < n; j++) {
            __m512 vv[4];
            for (int c = 0; c < chunks; c++) vv[c] = _mm512_load_ps(v + j * head_dim + c0 + 16 * c);
            for (int i = 0; i < mr; i++) {
                const __m512 pj = _mm512_set1_ps(p[i * PF_KEYS + j]);
                for (int c = 0; c < chunks; c++) acc[i][c] = _mm512_fmadd_ps(pj, vv[c], acc[i][c]);
            }
        }
        for (int i = 0; i < mr; i++)
            for (int c = 0; c < chunks; c++) _mm512_store_ps(o + i * head_dim + c0 + 16 * c, acc[i][c]);
    }
}

/* The two micro-kernels with mr (and the dims per pass) constants: each case its own unrolled loop nest. */
#define PF_CASE(R)                                                                                                     \
    case R:                                                                                                            \
        if (scores) scores_rows(q, kt, head_dim, s, R);                                                                \
        else if (head_dim % 64 == 0) update_rows(o, s, alpha, n, v, head_dim, R, 4);                                   \
        else update_rows(o, s, alpha, n, v, head_dim, R, 1);                                                           \
        break;
static void micro(int scores, const float *q, const float *kt, float *s, float *o, const float *alpha, int n,
                  const float *v, int head_dim, int mr) {
    switch (mr) { PF_CASE(1) PF_CASE(2) PF_CASE(3) PF_CASE(4) PF_CASE(5) PF_CASE(6) }
}

/* Online softmax of query vector v's scores over the tile's first `valid` keys (1 <= valid <= PF_KEYS), in place:
 * s becomes the probabilities (0 past the valid keys), m and l the running max and sum, *alpha the factor the
 * vector's earlier output is rescaled by. */
static inline void softmax_row(float *s, int lo, int valid, float *m, float *l, float *alpha) {
    __m512 x[4];
    __mmask16 keep[4];
    for (int c = 0; c < 4; c++) {
        const int left = valid - 16 * c, before = lo - 16 * c; /* keys [lo, valid) of this vector's 16 */
        keep[c] = left >= 16 ? (__mmask16)0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        keep[c] &= before <= 0 ? (__mmask16)0xffff : before >= 16 ? 0 : (__mmask16)(0xffffu << before);
        x[c] = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), keep[c], s + 16 * c);
    }
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
    const float m_new = *m > top ? *m : top; /* finite: the tile holds at least one valid key */
    const __m512 shift = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < 4; c++) {
        const __m512 p = _mm512_maskz_mov_ps(keep[c], exp_nonpositive(_mm512_sub_ps(x[c], shift)));
        _mm512_store_ps(s + 16 * c, p);
        sum = _mm512_add_ps(sum, p);
    }
    /* 0 for the first keys a vector sees (m = -inf); exactly 1, without the call, while the max holds */
    *alpha = *m == m_new ? 1.f : expf(*m - m_new);
    *l = *l * *alpha + _mm512_reduce_add_ps(sum);
    *m = m_new;
}

#define DEFINE_UNIT(NAME, T)                                                                                      \
    /* Query rows [i0, i0 + rows) of a chunk whose first row sits at position first_pos, heads of KV head h: q, out \
     * point at row i0 (rows of heads * head_dim elements). */                                                    \
    static void unit_##NAME(const T *q, T *out, const T *k_cache, const T *v_cache, const CacheWalk *w,           \
                            int first_pos, int rows, int heads, int group, int h, int head_dim, float scale,      \
                            int window, const Scratch *x) {                                                       \
        const int nq = rows * group, last_pos = first_pos + rows - 1;                                             \
        /* a window's first key tile: the one holding the first row's first visible key */                       \
        const int first_key = window && first_pos + 1 > window ? first_pos + 1 - window : 0;                      \
        const int64_t row = (int64_t)heads * head_dim;                                                            \
        const __m512 scaled = _mm512_set1_ps(scale);                                                              \
        for (int r = 0; r < rows; r++)                                                                            \
            for (int g = 0; g < group; g++) {                                                                     \
                const T *src = q + r * row + (int64_t)(h * group + g) * head_dim;                                 \
                float *dst = x->q + (int64_t)(r * group + g) * head_dim;                                          \
                for (int d = 0; d < head_dim; d += 16)                                                            \
                    _mm512_store_ps(dst + d, _mm512_mul_ps(load16_##NAME(src + d), scaled));                      \
            }                                                                                                     \
        memset(x->o, 0, sizeof(float) * nq * head_dim);                                                           \
        for (int v = 0; v < nq; v++) x->m[v] = -INFINITY, x->l[v] = 0.f;                                          \
        for (int t0 = first_key / PF_KEYS * PF_KEYS; t0 <= last_pos; t0 += PF_KEYS) {                             \
            const int n = last_pos + 1 - t0 < PF_KEYS ? last_pos + 1 - t0 : PF_KEYS;                              \
            for (int j0 = 0; j0 < PF_KEYS; j0 += 16) { /* keys -> kt, values -> v, as float32; zeros past n */    \
                int64_t at[16];                                                                                   \
                for (int j = 0; j < 16; j++) at[j] = j0 + j < n ? token_offset(w, t0 + j0 + j) : -1;              \
                for (int d0 = 0; d0 < head_dim; d0 += 16) {                                                       \
                    __m512 k[16];                                                                                 \
                    for (int j = 0; j < 16; j++) {                                                                \
                        const __m512 vv = at[j] < 0 ? _mm512_setzero_ps() : load16_##NAME(v_cache + at[j] + d0); \
                        k[j] = at[j] < 0 ? _mm512_setzero_ps() : load16_##NAME(k_cache + at[j] + d0);             \
                        _mm512_store_ps(x->v + (j0 + j) * head_dim + d0, vv);                                     \
                    }                                                                                             \
                    transpose16_ps(k);                                                                            \
                    for (int d = 0; d < 16; d++) _mm512_store_ps(x->kt + (d0 + d) * PF_KEYS + j0, k[d]);          \
                }                                                                                                 \
            }                                                                                                     \
            /* rows before the tile, and rows whose window starts past it, see none of its keys: their vectors   \
             * are skipped (exactly as if attended) */                                                            \
            const int v0 = (t0 > first_pos ? t0 - first_pos : 0) * group;                                         \
            const int past = window ? (t0 + n + window - 1 - first_pos) * group : nq;                             \
            const int v1 = past < nq ? past : nq;                                                                 \
            for (int v = v0; v < v1; v += PF_QV) {                                                                \
                const int mr = v1 - v < PF_QV ? v1 - v : PF_QV;                                                   \
                micro(1, x->q + (int64_t)v * head_dim, x->kt, x->s + (int64_t)v * PF_KEYS, 0, 0, 0, 0, head_dim, mr); \
                for (int u = v; u < v + mr; u++) {                                                                \
                    const int seen = first_pos + u / group - t0 + 1, lo = window ? seen - window : 0;                  \
                    softmax_row(x->s + (int64_t)u * PF_KEYS, lo, seen < n ? seen : n, x->m + u, x->l + u,         \
                                x->alpha + u);                                                                    \
                }                                                                                                 \
                micro(0, 0, 0, x->s + (int64_t)v * PF_KEYS, x->o + (int64_t)v * head_dim, x->alpha + v, n, x->v,   \
                      head_dim, mr);                                                                              \
            }                                                                                                     \
        }                                                                                                         \
        for (int r = 0; r < rows; r++)                                                                            \
            for (int g = 0; g < group; g++) {                                                                     \
                const int v = r * group + g;                                                                      \
                const __m512 inv = _mm512_set1_ps(1.f / x->l[v]);                                                 \
                T *dst = out + r * row + (int64_t)(h * group + g) * head_dim;                                     \
                for (int d = 0; d < head_dim; d += 16)                                                            \
                    store16_##NAME(dst + d, _mm512_mul_ps(_mm512_load_ps(x->o + (int64_t)v * head_dim + d), inv)); \
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
                          int kv_heads, int head_dim, int block_size, int table_width, float scale, int window,     \
                          int threads) {                                                                            \
        if (seqs <= 0) return 0;                                                                                    \
        if (kv_heads <= 0 || heads % kv_heads || heads / kv_heads > PF_MAX_GROUP || head_dim <= 0 ||               \
            head_dim % 16 || head_dim > PF_MAX_HEAD_DIM || block_size <= 0 || window < 0)                           \
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
        const int nq = PF_QROWS * group;                                                                            \
        const int64_t row = (int64_t)heads * head_dim;                                                              \
        int status = 0;                                                                                             \
        _Pragma("omp parallel num_threads(threads) if (threads > 1) reduction(| : status)")                        \
        {                                                                                                           \
            Scratch x = {aligned_alloc(64, sizeof(float) * nq * head_dim),                                          \
                         aligned_alloc(64, sizeof(float) * nq * head_dim),                                          \
                         aligned_alloc(64, sizeof(float) * nq * PF_KEYS),                                           \
                         aligned_alloc(64, sizeof(float) * PF_KEYS * head_dim),                                     \
                         aligned_alloc(64, sizeof(float) * PF_KEYS * head_dim), malloc(sizeof(float) * nq),         \
                         malloc(sizeof(float) * nq), malloc(sizeof(float) * nq)};                                   \
            /* every thread takes part in the loop (a worksharing loop must be met by all); one without scratch \
             * computes nothing and the call fails, so the caller attends the rows another way */                 \
            const int ok = x.q && x.o && x.s && x.kt && x.v && x.m && x.l && x.alpha;                               \
            status |= !ok;                                                                                          \
            int i = 0;                                                                                              \
            _Pragma("omp for schedule(dynamic, 1)")                                                                 \
            for (int64_t u = 0; u < total; u++) {                                                                  \
                if (!ok) continue;                                                                                  \
                if (u < first_unit[i]) i = 0;                                                                       \
                while (u >= first_unit[i + 1]) i++;                                                                 \
                const int64_t local = u - first_unit[i];                                                            \
                const int qtiles = query_tiles(query_start, i);                                                     \
                const int h = (int)(local / qtiles), tile = (int)(local % qtiles);                                  \
                const int chunk = query_start[i + 1] - query_start[i], i0 = tile * PF_QROWS;                        \
                const int rows = chunk - i0 < PF_QROWS ? chunk - i0 : PF_QROWS;                                     \
                const CacheWalk w = {tables + (int64_t)i * table_width, (int64_t)kv_heads * head_dim,               \
                                     (int64_t)h * head_dim, block_size};                                            \
                const int64_t at = ((int64_t)query_start[i] + i0) * row;                                            \
                unit_##NAME(q + at, out + at, k_cache, v_cache, &w, seq_lens[i] - chunk + i0, rows, heads,          \
                            group, h, head_dim, scale, window, &x);                                                 \
            }                                                                                                       \
            free(x.q);                                                                                              \
            free(x.s);                                                                                              \
            free(x.alpha);                                                                                          \
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
 * head_dim). window > 0: a row at position p sees keys [p + 1 - window, p] only (a sliding window). */
int prefill_attention_avx512_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *tables,
                                 const int32_t *query_start, const int32_t *seq_lens, float *out, int seqs, int heads,
                                 int kv_heads, int head_dim, int block_size, int table_width, float scale, int window,
                                 int threads) {
#if HAVE_PF_AVX512
    return run_f32(q, k_cache, v_cache, tables, query_start, seq_lens, out, seqs, heads, kv_heads, head_dim,
                   block_size, table_width, scale, window, threads);
#else
    (void)q, (void)k_cache, (void)v_cache, (void)tables, (void)query_start, (void)seq_lens, (void)out, (void)seqs;
    (void)heads, (void)kv_heads, (void)head_dim, (void)block_size, (void)table_width, (void)scale, (void)window;
    (void)threads;
    return -1;
#endif
}

int prefill_attention_avx512_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                  const int32_t *tables, const int32_t *query_start, const int32_t *seq_lens,
                                  uint16_t *out, int seqs, int heads, int kv_heads, int head_dim, int block_size,
                                  int table_width, float scale, int window, int threads) {
#if HAVE_PF_AVX512
    return run_bf16(q, k_cache, v_cache, tables, query_start, seq_lens, out, seqs, heads, kv_heads, head_dim,
                    block_size, table_width, scale, window, threads);
#else
    (void)q, (void)k_cache, (void)v_cache, (void)tables, (void)query_start, (void)seq_lens, (void)out, (void)seqs;
    (void)heads, (void)kv_heads, (void)head_dim, (void)block_size, (void)table_width, (void)scale, (void)window;
    (void)threads;
    return -1;
#endif
}
