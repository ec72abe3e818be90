/* The elementwise work between the matrix multiplies, fused, for bfloat16 activations on CPUs with AVX-512
 * (and its bfloat16 conversions): residual add + RMSNorm, SiLU(gate) * up, and rotary embedding (full or
 * partial) with the KV cache write. Torch runs each of these as several passes over memory, with a conversion to
 * float32 and back in each; here every element is read once, computed in float32, and rounded to bfloat16 where
 * torch rounds, so results match the torch kernels to within a bfloat16 rounding step.
 *
 * Built with decode_attention.c by kernels/cpu.py; where the CPU lacks the instructions, elementwise_available()
 * returns 0 and torch serves.
 */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "entry_points.h"
#include "parallel.h"
#include "vector_math.h"

int elementwise_available(void) { return 1; }

/* Elements per extra thread below which a call stays on one thread (a decode batch's norms: waking a thread would
 * cost more than it saves). */
#define MIN_ELEMENTS_PER_THREAD 32768
#define ROWS_IN_PARALLEL _Pragma("omp parallel for num_threads(threads) if (threads > 1) schedule(static)")

static inline __mmask16 first(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

/* Up to 16 bfloat16 values from p (n of them; the rest read as 0) as float32. */
static inline __m512 load_bf16(const uint16_t *p, int n) {
    __m256i raw = _mm256_maskz_loadu_epi16(first(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* Rounds to bfloat16 (nearest even, as torch) and stores n of the 16 values at p. */
static inline void store_bf16(uint16_t *p, __m512 x, int n) {
    _mm256_mask_storeu_epi16(p, first(n), (__m256i)_mm512_cvtneps_pbh(x));
}

/* x rounded to bfloat16 and back: the value torch holds after a bfloat16 op. */
static inline __m512 round_bf16(__m512 x) {
    __m256i r = (__m256i)_mm512_cvtneps_pbh(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16));
}

/* out = weight * bf16(s * rsqrt(mean(s^2) + eps)) with s = bf16(x + residual), stored to residual_out; without a
 * residual (NULL), s = x and nothing is stored. Rows of x have x_stride elements; the other tensors are contiguous. */
int add_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *out,
                      uint16_t *residual_out, int rows, int hidden, int64_t x_stride, float eps, int threads) {
    threads = threads_for(threads, (int64_t)rows * hidden, MIN_ELEMENTS_PER_THREAD);
    ROWS_IN_PARALLEL
    for (int r = 0; r < rows; r++) {
        const uint16_t *s_row = x + r * x_stride; /* where s lies once the first pass is done */
        __m512 squares = _mm512_setzero_ps();
        if (residual) {
            const uint16_t *xr = s_row, *rr = residual + (int64_t)r * hidden;
            uint16_t *sr = residual_out + (int64_t)r * hidden;
            for (int d = 0; d < hidden; d += 16) {
                __m512 s = round_bf16(_mm512_add_ps(load_bf16(xr + d, hidden - d), load_bf16(rr + d, hidden - d)));
                store_bf16(sr + d, s, hidden - d);
                squares = _mm512_fmadd_ps(s, s, squares);
            }
            s_row = sr;
        } else {
            for (int d = 0; d < hidden; d += 16) {
                __m512 s = load_bf16(s_row + d, hidden - d);
                squares = _mm512_fmadd_ps(s, s, squares);
            }
        }
        __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(squares) / hidden + eps));
        uint16_t *o = out + (int64_t)r * hidden;
        for (int d = 0; d < hidden; d += 16) {
            __m512 y = round_bf16(_mm512_mul_ps(load_bf16(s_row + d, hidden - d), inv));
            store_bf16(o + d, _mm512_mul_ps(load_bf16(weight + d, hidden - d), y), hidden - d);
        }
    }
    return 0;
}

/* out (rows, inter) = bf16(act(gate)) * up, gate and up the two halves of each gate_up row (rows of in_stride
 * elements): silu_mul_bf16 (SiLU) and gelu_tanh_mul_bf16 (GeGLU, tanh GELU). */
#define DEFINE_GATED(NAME, ACT)                                                                                \
    int NAME(const uint16_t *gate_up, uint16_t *out, int rows, int inter, int64_t in_stride, int threads) {   \
        threads = threads_for(threads, (int64_t)rows * inter, MIN_ELEMENTS_PER_THREAD);                        \
        ROWS_IN_PARALLEL                                                                                       \
        for (int r = 0; r < rows; r++) {                                                                       \
            const uint16_t *gate = gate_up + r * in_stride, *up = gate + inter;                                \
            uint16_t *o = out + (int64_t)r * inter;                                                            \
            for (int d = 0; d < inter; d += 16) {                                                              \
                int n = inter - d;                                                                             \
                __m512 act = round_bf16(ACT(load_bf16(gate + d, n)));                                          \
                store_bf16(o + d, _mm512_mul_ps(act, load_bf16(up + d, n)), n);                                \
            }                                                                                                  \
        }                                                                                                      \
        return 0;                                                                                              \
    }
DEFINE_GATED(silu_mul_bf16, silu_ps)
DEFINE_GATED(gelu_tanh_mul_bf16, gelu_tanh_ps)

/* One head of one token rotated (rotate-half layout): out[i] = x1 cos - x2 sin, out[i + half] = x2 cos + x1 sin
 * for i < half, with cos_sin = (cos[half], sin[half]) in float32; dims from 2 half to head_dim (partial rotary) are
 * copied as they are. */
static inline void rotate(const uint16_t *x, const float *cos_sin, int half, int head_dim, uint16_t *out) {
    for (int i = 0; i < half; i += 16) {
        int n = half - i;
        __m512 c = _mm512_maskz_loadu_ps(first(n), cos_sin + i), s = _mm512_maskz_loadu_ps(first(n), cos_sin + half + i);
        __m512 x1 = load_bf16(x + i, n), x2 = load_bf16(x + half + i, n);
        store_bf16(out + i, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s)), n);
        store_bf16(out + half + i, _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s)), n);
    }
    for (int d = 2 * half; d < head_dim; d++) out[d] = x[d];
}

/* q (tokens, heads, head_dim) and k, v (tokens, kv_heads, head_dim), each with rows of row_stride elements
 * (views into the fused qkv projection), heads contiguous within a row. The first rotary_dim dims of each q and k
 * head rotate by cos_sin (positions, rotary_dim), the rest pass unrotated (partial rotary: Phi; rotary_dim =
 * head_dim: all rotate; 0, an empty table: none, OPT). Rotated q goes to q_out (contiguous); rotated k and v go to
 * their cache slots, caches (slots, kv_heads, head_dim). */
int rotary_write_kv_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t row_stride,
                         const float *cos_sin, const int64_t *positions, const int64_t *slots, uint16_t *q_out,
                         uint16_t *k_cache, uint16_t *v_cache, int tokens, int heads, int kv_heads, int head_dim,
                         int rotary_dim, int threads) {
    const int half = rotary_dim / 2;
    if (rotary_dim % 2 || rotary_dim < 0 || rotary_dim > head_dim) return -1;
    threads = threads_for(threads, (int64_t)tokens * (heads + 2 * kv_heads) * head_dim, MIN_ELEMENTS_PER_THREAD);
    ROWS_IN_PARALLEL
    for (int t = 0; t < tokens; t++) {
        const float *cs = rotary_dim ? cos_sin + positions[t] * rotary_dim : cos_sin; /* never read when empty */
        for (int h = 0; h < heads; h++)
            rotate(q + t * row_stride + h * head_dim, cs, half, head_dim, q_out + ((int64_t)t * heads + h) * head_dim);
        uint16_t *kc = k_cache + slots[t] * kv_heads * head_dim, *vc = v_cache + slots[t] * kv_heads * head_dim;
        for (int h = 0; h < kv_heads; h++)
            rotate(k + t * row_stride + h * head_dim, cs, half, head_dim, kc + h * head_dim);
        for (int d = 0; d < kv_heads * head_dim; d++) vc[d] = v[t * row_stride + d];
    }
    return 0;
}

/* Greedy sampling's argmax of each row of bf16 logits (rows, vocab) at row stride `stride`: the first index of the
 * largest value, as torch's max(dim). NaN never wins (torch's would); logits are finite or -inf here. */
int argmax_bf16(const uint16_t *x, int rows, int vocab, int64_t stride, int64_t *out, int threads) {
    const __m512i step = _mm512_set1_epi32(16);
    threads = threads_for(threads, (int64_t)rows * vocab, MIN_ELEMENTS_PER_THREAD);
    ROWS_IN_PARALLEL
    for (int r = 0; r < rows; r++) {
        const uint16_t *row = x + r * stride;
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i best_at = _mm512_set1_epi32(vocab); /* past the end: lanes that never saw a finite value */
        for (int i = 0; i < vocab; i += 16, at = _mm512_add_epi32(at, step)) {
            __mmask16 valid = vocab - i >= 16 ? 0xffff : (__mmask16)((1u << (vocab - i)) - 1);
            __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, row + i)), 16));
            __mmask16 better = _mm512_mask_cmp_ps_mask(valid, v, best, _CMP_GT_OQ);
            best = _mm512_mask_mov_ps(best, better, v);
            best_at = _mm512_mask_mov_epi32(best_at, better, at);
        }
        float top = _mm512_reduce_max_ps(best);
        __mmask16 winners = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
        int64_t first = _mm512_mask_reduce_min_epi32(winners, best_at);
        out[r] = first < vocab ? first : 0; /* a row of only -inf (or NaN): index 0, as torch gives for -inf */
    }
    return 0;
}

#else
/* Without the instructions: every entry point exists (the loader binds them all) and declines. */
int elementwise_available(void) { return 0; }
int add_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *out,
                      uint16_t *residual_out, int rows, int hidden, int64_t x_stride, float eps, int threads) {
    (void)x, (void)residual, (void)weight, (void)out, (void)residual_out, (void)rows, (void)hidden, (void)x_stride;
    (void)eps, (void)threads;
    return -1;
}
int silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int inter, int64_t in_stride, int threads) {
    (void)gate_up, (void)out, (void)rows, (void)inter, (void)in_stride, (void)threads;
    return -1;
}
int gelu_tanh_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int inter, int64_t in_stride, int threads) {
    (void)gate_up, (void)out, (void)rows, (void)inter, (void)in_stride, (void)threads;
    return -1;
}
int rotary_write_kv_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t row_stride,
                         const float *cos_sin, const int64_t *positions, const int64_t *slots, uint16_t *q_out,
                         uint16_t *k_cache, uint16_t *v_cache, int tokens, int heads, int kv_heads, int head_dim,
                         int rotary_dim, int threads) {
    (void)q, (void)k, (void)v, (void)row_stride, (void)cos_sin, (void)positions, (void)slots, (void)q_out;
    (void)k_cache, (void)v_cache, (void)tokens, (void)heads, (void)kv_heads, (void)head_dim, (void)rotary_dim;
    (void)threads;
    return -1;
}
int argmax_bf16(const uint16_t *x, int rows, int vocab, int64_t stride, int64_t *out, int threads) {
    (void)x, (void)rows, (void)vocab, (void)stride, (void)out, (void)threads;
    return -1;
}
#endif
