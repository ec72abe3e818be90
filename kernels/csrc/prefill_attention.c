/* Prompt-chunk attention on the CPU's matrix engine (AMX), bfloat16: the queries of one sequence's chunk against
 * all of its cached keys and values (the chunk's own included), causal, softmax in float32 over each 16-query tile's
 * whole score rows. Built with the other CPU kernels by kernels/cpu.py; prefill_attention_available() says whether this
 * CPU and kernel let a process use the tile registers (else torch's scaled_dot_product_attention serves).
 *
 * Per KV head the cached keys are first rearranged into the engine's right-operand layout (for each 16-key tile and
 * 32-dim chunk: 16 rows of dim pairs x 16 keys) and the values likewise (for each 32-key block and 16-dim chunk: 16
 * rows of key pairs x 16 dims); every query head of the group and every 16-query tile then reuses them. All eight
 * tile registers are 16 rows x 64 bytes: 0-1 scores (16 queries x 16 keys, float32), 2 left operand (queries, or
 * probabilities), 3 right operand, 4-7 probabilities x values (16 queries x 16 dims each, float32), accumulated over
 * every key block.
 *
 * With a sliding window of W keys (a query at position p sees keys p - W + 1 .. p, as kernels/attention.py's mask and
 * kernels/cpu.py's window_starts), only the keys some row of the chunk sees are rearranged: from the 32-key block
 * holding the first row's window start to len, the keys of that block before the start zero, as those past len are.
 * No key before the first row's window start is read: a sequence's table entries before its held blocks may name
 * blocks given back (they alias another block). A 16-query tile then skips the key blocks wholly before its first
 * row's window start, and each row's probabilities are zero for the keys before its own.
 *
 * With several threads, the threads first share the rearranging (32-key blocks of every KV head), then the 16-query
 * tiles of every head, dealt round-robin: a causal chunk's later tiles see more keys. Each tile is computed by one
 * thread in a fixed order: results do not depend on the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#include "amx.h"
#include "paged_cache.h"
#include "parallel.h"
#include "vector_math.h"

int prefill_attention_available(void) { return amx_granted(); }

/* Lanes j of the 16 keys t .. t + 15 with lo <= t + j < n. */
static inline __mmask16 keys_mask(int t, int lo, int n) {
    const int from = lo - t, to = n - t;
    const unsigned below = to >= 16 ? 0xffffu : to <= 0 ? 0u : (1u << to) - 1;
    const unsigned above = from <= 0 ? 0xffffu : from >= 16 ? 0u : 0xffffu << from;
    return (__mmask16)(below & above);
}

/* 16 bfloat16 values as float32. */
static inline __m512 widen(__m256i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

/* Scratch of one thread for query_tile: every score of a 16-query tile, and its probabilities as left operands. */
typedef struct {
    float *scores;     /* (16, stride) float32: row i, key 32 base + t (base: the first rearranged block) */
    uint16_t *probs;   /* per rearranged 32-key block one 16 x 32 bf16 tile */
    float *out;        /* (16, head_dim) float32 */
    uint16_t *q_pad;   /* (16, head_dim) bf16: a partial tile's rows, zero-padded */
    int stride;
} TileScratch;

/* One 16-query tile of one head: q rows (16, head_dim) bf16 (zero rows past the chunk), their positions
 * first_pos.., against keys [0, len), or a sliding window of `window` keys before each; kt, vv the head's rearranged
 * keys and values from the 32-key block `base` on; x->out (16, head_dim) float32 out, normalised.
 *
 * Exact softmax in three passes rather than an online one: all scores first (the tile's scores stay in L2), then
 * each row's max and probabilities, then p v with the accumulators held in tiles across every key block. Per 32-key
 * block that leaves no horizontal reductions, no rescaling of the output and no tile stores; those, not the matrix
 * products, had set the pace of the online version. Block indices (kb) count from `base`. */
static void query_tile(const uint16_t *q, int64_t q_stride, int first_pos, int len, int window, int base, int head_dim,
                       float scale, const uint16_t *kt, const uint16_t *vv, const TileScratch *x) {
    const int chunks32 = head_dim / 32, chunks16 = head_dim / 16, last_pos = first_pos + 15;
    /* key blocks some row sees: from the one holding the first row's window start to the one holding the last key */
    const int first_key = window && first_pos + 1 > window ? first_pos + 1 - window : 0;
    const int kb_lo = first_key / 32 - base, kb_hi = (last_pos < len - 1 ? last_pos : len - 1) / 32 + 1 - base;
    const int64_t row_bytes = (int64_t)x->stride * 4;
    for (int kb = kb_lo; kb < kb_hi; kb++) { /* scores = q k^T */
        _tile_zero(0);
        _tile_zero(1);
        for (int c = 0; c < chunks32; c++) {
            _tile_loadd(2, q + 32 * c, q_stride * 2);
            _tile_loadd(3, kt + ((int64_t)(2 * kb) * chunks32 + c) * 512, 64);
            _tile_dpbf16ps(0, 2, 3);
            _tile_loadd(3, kt + ((int64_t)(2 * kb + 1) * chunks32 + c) * 512, 64);
            _tile_dpbf16ps(1, 2, 3);
        }
        _tile_stored(0, x->scores + 32 * kb, row_bytes);
        _tile_stored(1, x->scores + 32 * kb + 16, row_bytes);
    }
    float inv_sum[16];
    for (int i = 0; i < 16; i++) { /* probabilities of row i over its keys [lo, n) (from base); zero elsewhere */
        const int pos = first_pos + i < len - 1 ? first_pos + i : len - 1; /* rows past the chunk: as its last */
        const int n = pos + 1 - 32 * base, lo = (window && pos + 1 > window ? pos + 1 - window : 0) - 32 * base;
        const float *row = x->scores + (int64_t)i * x->stride;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int t = lo / 16 * 16; t < n; t += 16)
            top = _mm512_max_ps(top, _mm512_maskz_loadu_ps(keys_mask(t, lo, n), row + t));
        const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top) * scale), scaled = _mm512_set1_ps(scale);
        __m512 sum = _mm512_setzero_ps();
        for (int kb = kb_lo; kb < kb_hi; kb++) {
            const int t = 32 * kb;
            const __mmask16 v0 = keys_mask(t, lo, n), v1 = keys_mask(t + 16, lo, n);
            uint16_t *p = x->probs + (int64_t)kb * 512 + 32 * i;
            if (!(v0 | v1)) { /* a block wholly before the row's window or past its position */
                _mm512_store_si512((__m512i *)p, _mm512_setzero_si512());
                continue;
            }
            __m512 e0 = _mm512_maskz_mov_ps(v0, exp_nonpositive(_mm512_fmsub_ps(_mm512_load_ps(row + t), scaled, shift)));
            __m512 e1 = _mm512_maskz_mov_ps(v1, exp_nonpositive(_mm512_fmsub_ps(_mm512_load_ps(row + t + 16), scaled, shift)));
            __m512bh packed = _mm512_cvtne2ps_pbh(e1, e0); /* 32 bf16: e0 then e1 */
            /* the sum is of the rounded probabilities that multiply the values, so the weights sum to one exactly */
            sum = _mm512_add_ps(sum, _mm512_add_ps(widen(_mm512_castsi512_si256((__m512i)packed)),
                                                   widen(_mm512_extracti64x4_epi64((__m512i)packed, 1))));
            _mm512_store_si512((__m512i *)p, (__m512i)packed);
        }
        const float total = _mm512_reduce_add_ps(sum);
        inv_sum[i] = total > 0.f ? 1.f / total : 0.f;
    }
    for (int d0 = 0; d0 < chunks16; d0 += 4) { /* out = p v, 64 dims at a time, accumulated in tiles 4-7 */
        const int parts = chunks16 - d0 < 4 ? chunks16 - d0 : 4;
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int kb = kb_lo; kb < kb_hi; kb++) {
            const uint16_t *vb = vv + ((int64_t)kb * chunks16 + d0) * 512;
            _tile_loadd(2, x->probs + (int64_t)kb * 512, 64);
            _tile_loadd(3, vb, 64);
            _tile_dpbf16ps(4, 2, 3);
            if (parts > 1) {
                _tile_loadd(3, vb + 512, 64);
                _tile_dpbf16ps(5, 2, 3);
            }
            if (parts > 2) {
                _tile_loadd(3, vb + 1024, 64);
                _tile_dpbf16ps(6, 2, 3);
            }
            if (parts > 3) {
                _tile_loadd(3, vb + 1536, 64);
                _tile_dpbf16ps(7, 2, 3);
            }
        }
        float *o = x->out + 16 * d0;
        const int64_t o_bytes = (int64_t)head_dim * 4;
        _tile_stored(4, o, o_bytes);
        if (parts > 1) _tile_stored(5, o + 16, o_bytes);
        if (parts > 2) _tile_stored(6, o + 32, o_bytes);
        if (parts > 3) _tile_stored(7, o + 48, o_bytes);
    }
    for (int i = 0; i < 16; i++) {
        __m512 inv = _mm512_set1_ps(inv_sum[i]);
        for (int d = 0; d < chunks16; d++)
            _mm512_store_ps(x->out + i * head_dim + 16 * d, _mm512_mul_ps(_mm512_load_ps(x->out + i * head_dim + 16 * d), inv));
    }
}

/* Keys [32 first, 32 last) of one KV head as right operands of q k^T: tile (t, c) holds keys 16t..16t+15, dims
 * 32c..32c+31, as 16 rows of dim pairs x 16 keys (a 16 x 16 transpose of 32-bit pairs), tiles counted from block
 * `base`; keys before lo or past len are zero, and not read. */
static void pack_keys(const uint16_t *k_cache, const CacheWalk *w, int lo, int len, int first, int last, int base,
                      int head_dim, uint16_t *kt) {
    const int chunks32 = head_dim / 32;
    uint32_t *out = (uint32_t *)kt;
    for (int t = 2 * first; t < 2 * last; t++)
        for (int n = 0; n < 16; n++) {
            int key = 16 * t + n;
            const uint32_t *src = key >= lo && key < len ? (const uint32_t *)(k_cache + token_offset(w, key)) : 0;
            for (int c = 0; c < chunks32; c++)
                for (int r = 0; r < 16; r++)
                    out[((int64_t)(t - 2 * base) * chunks32 + c) * 256 + r * 16 + n] = src ? src[16 * c + r] : 0;
        }
}

/* Values [32 first, 32 last) of one KV head as right operands of p v: tile (b, d) holds keys 32b..32b+31, dims
 * 16d..16d+15, as 16 rows of key pairs x 16 dims, tiles counted from block `base`; keys before lo or past len are
 * zero, and not read. */
static void pack_values(const uint16_t *v_cache, const CacheWalk *w, int lo, int len, int first, int last, int base,
                        int head_dim, uint16_t *vv) {
    const int chunks16 = head_dim / 16;
    uint16_t lanes[32]; /* lane 2n takes a[n], lane 2n+1 takes b[n] */
    for (int n = 0; n < 16; n++) lanes[2 * n] = (uint16_t)n, lanes[2 * n + 1] = (uint16_t)(32 + n);
    const __m512i interleave = _mm512_loadu_si512(lanes);
    for (int key = 32 * first; key < 32 * last; key += 2) {
        const uint16_t *a = key >= lo && key < len ? v_cache + token_offset(w, key) : 0;
        const uint16_t *b = key + 1 >= lo && key + 1 < len ? v_cache + token_offset(w, key + 1) : 0;
        uint16_t *dst = vv + ((int64_t)(key / 32 - base) * chunks16 * 16 + key % 32 / 2) * 32;
        for (int d = 0; d < chunks16; d++) {
            __m512i x = a ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a + 16 * d))) : _mm512_setzero_si512();
            __m512i y = b ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 16 * d))) : _mm512_setzero_si512();
            _mm512_storeu_si512((__m512i *)(dst + (int64_t)d * 512), _mm512_permutex2var_epi16(x, interleave, y));
        }
    }
}

/* One 16-query tile of head hq (its first query i0 of the chunk) -> out, with the head's packed keys and values
 * (from block base on). */
static void head_tile(const uint16_t *q, uint16_t *out, int64_t q_stride, int len, int chunk, int window, int base,
                      int hq, int i0, int head_dim, float scale, const uint16_t *kt, const uint16_t *vv,
                      const TileScratch *x) {
    const int rows = chunk - i0 < 16 ? chunk - i0 : 16;
    const uint16_t *qt = q + (int64_t)i0 * q_stride + (int64_t)hq * head_dim;
    int64_t stride = q_stride;
    if (rows < 16) { /* the chunk's last rows: pad to a whole tile */
        memset(x->q_pad, 0, sizeof(uint16_t) * 16 * head_dim);
        for (int i = 0; i < rows; i++) memcpy(x->q_pad + i * head_dim, qt + i * q_stride, 2 * head_dim);
        qt = x->q_pad, stride = head_dim;
    }
    query_tile(qt, stride, len - chunk + i0, len, window, base, head_dim, scale, kt, vv, x);
    for (int i = 0; i < rows; i++) {
        uint16_t *dst = out + (int64_t)(i0 + i) * q_stride + (int64_t)hq * head_dim;
        const float *o = x->out + i * head_dim;
        for (int d = 0; d < head_dim; d += 32)
            _mm512_storeu_si512((__m512i *)(dst + d),
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(o + d + 16), _mm512_load_ps(o + d)));
    }
}

/* One sequence's chunk: q, out (chunk, heads, head_dim) with rows of q_stride elements; the chunk's queries sit at
 * positions len-chunk .. len-1; caches (blocks, block_size, kv_heads, head_dim). window > 0: a query at position p
 * sees keys [p + 1 - window, p] only (a sliding window), and no key before the first query's window is read.
 * Returns 0, or -1 where this kernel does not apply (head_dim not a multiple of 64, no tile registers, no memory). */
int prefill_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
                           uint16_t *out, int64_t q_stride, int len, int chunk, int heads, int kv_heads, int head_dim,
                           int block_size, float scale, int window, int threads) {
    if (head_dim % 64 || head_dim > 256 || heads % kv_heads || chunk > len || window < 0 ||
        !prefill_attention_available())
        return -1;
    /* the first key some query sees, and the 32-key blocks from the one holding it: all that is rearranged */
    const int first_key = window && len - chunk + 1 > window ? len - chunk + 1 - window : 0, base = first_key / 32;
    const int group = heads / kv_heads, blocks = (len + 31) / 32 - base, qtiles = (chunk + 15) / 16;
    const int64_t row = (int64_t)kv_heads * head_dim, head_elems = (int64_t)blocks * 32 * head_dim;
    uint16_t *kt = aligned_alloc(64, sizeof(uint16_t) * kv_heads * head_elems);
    uint16_t *vv = aligned_alloc(64, sizeof(uint16_t) * kv_heads * head_elems);
    if (!kt || !vv) {
        free(kt);
        free(vv);
        return -1;
    }
    int status = 0;
    threads = threads_for(threads, (int64_t)heads * qtiles, 2);
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : status)
    {
        const int part = thread_index(), parts = thread_count();
        int lo, hi;
        share(kv_heads * blocks, part, parts, &lo, &hi);
        for (int u = lo; u < hi;) { /* this thread's 32-key blocks, a run within one head at a time */
            const int h = u / blocks, first = u % blocks, last = hi - h * blocks < blocks ? hi - h * blocks : blocks;
            const CacheWalk w = {table, row, (int64_t)h * head_dim, block_size};
            pack_keys(k_cache, &w, first_key, len, base + first, base + last, base, head_dim, kt + h * head_elems);
            pack_values(v_cache, &w, first_key, len, base + first, base + last, base, head_dim, vv + h * head_elems);
            u += last - first;
        }
#pragma omp barrier
        const int stride = blocks * 32;
        TileScratch x = {aligned_alloc(64, sizeof(float) * 16 * stride), aligned_alloc(64, sizeof(uint16_t) * 16 * stride),
                         aligned_alloc(64, sizeof(float) * 16 * head_dim), aligned_alloc(64, sizeof(uint16_t) * 16 * head_dim),
                         stride};
        if (x.scores && x.probs && x.out && x.q_pad) {
            TileConfig cfg = {0};
            cfg.palette = 1;
            for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
            load_tile_config(&cfg);
            for (int j = part; j < heads * qtiles; j += parts) {
                const int hq = j / qtiles, h = hq / group;
                head_tile(q, out, q_stride, len, chunk, window, base, hq, j % qtiles * 16, head_dim, scale,
                          kt + h * head_elems, vv + h * head_elems, &x);
            }
            _tile_release();
        } else {
            status = -1;
        }
        free(x.scores);
        free(x.probs);
        free(x.out);
        free(x.q_pad);
    }
    free(kt);
    free(vv);
    return status ? -1 : 0;
}

#else
int prefill_attention_available(void) { return 0; }

int prefill_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table,
                           uint16_t *out, int64_t q_stride, int len, int chunk, int heads, int kv_heads, int head_dim,
                           int block_size, float scale, int window, int threads) {
    (void)threads, (void)q, (void)k_cache, (void)v_cache, (void)table, (void)out, (void)q_stride, (void)len, (void)chunk;
    (void)heads, (void)kv_heads, (void)head_dim, (void)block_size, (void)scale, (void)window;
    return -1;
}
#endif
