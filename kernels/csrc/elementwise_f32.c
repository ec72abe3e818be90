/* The elementwise work between the matrix multiplies, fused, for float32 activations on CPUs with AVX-512F or AVX2 with
 * FMA: residual add + RMSNorm, SiLU(gate) * up, and rotary embedding (full or partial) with the KV cache write. Torch
 * runs each as several passes over memory with a temporary per step; here every element is read once. Each row is
 * computed by one thread in one order, so results depend neither on the batch nor on the thread count.
 *
 * Rotary embedding does torch's arithmetic exactly (x1 cos - x2 sin with both products rounded), so it matches the
 * torch kernel, and Hugging Face, bit for bit. The norm sums its squares in an order of its own (16 lanes on AVX-512,
 * 8 on AVX2) and SiLU's exponential is a polynomial: both within a few float32 rounding steps of torch's.
 *
 * The functions are written once over `vf`, a register of LANES floats. Its products are rounded on their own (the
 * _round intrinsics on AVX-512, mul_exact8 on AVX2): plain vector products may be contracted into fused multiply-adds
 * by the compiler, which would round differently from torch. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

#include "parallel.h"
#include "vector_math.h"

int elementwise_f32_available(void) { return 1; }

/* Elements per extra thread below which a call stays on one thread (a decode batch's norms: waking a thread would
 * cost more than it saves). */
#define MIN_ELEMENTS_PER_THREAD 32768
#define ROWS_IN_PARALLEL _Pragma("omp parallel for num_threads(threads) if (threads > 1) schedule(static)")

#if defined(__AVX512F__)
#define LANES 16
#define EXACT _MM_FROUND_CUR_DIRECTION
typedef __m512 vf;
static inline __mmask16 first(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }
static inline vf load(const float *p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }
static inline void store(float *p, vf x, int n) { _mm512_mask_storeu_ps(p, first(n), x); }
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_round_ps(a, b, EXACT); }
static inline vf vsub_exact(vf a, vf b) { return _mm512_sub_round_ps(a, b, EXACT); }
static inline vf vadd_exact(vf a, vf b) { return _mm512_add_round_ps(a, b, EXACT); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline vf vsilu(vf x) { return silu_ps(x); }
static inline vf vgelu_tanh(vf x) { return gelu_tanh_ps(x); }
#else
#define LANES 8
typedef __m256 vf;
static inline __m256i first(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vf load(const float *p, int n) { return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first(n)); }
static inline void store(float *p, vf x, int n) {
    if (n >= 8) _mm256_storeu_ps(p, x);
    else _mm256_maskstore_ps(p, first(n), x);
}
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return mul_exact8(a, b); }
static inline vf vsub_exact(vf a, vf b) { return _mm256_sub_ps(a, b); } /* its operands are rounded products */
static inline vf vadd_exact(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline float vsum(vf a) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
static inline vf vsilu(vf x) { return silu_ps8(x); }
static inline vf vgelu_tanh(vf x) { return gelu_tanh_ps8(x); }
#endif

/* out = weight * (s * (1 / sqrt(mean(s^2) + eps))) with s = x + residual, stored to residual_out; without a residual
 * (NULL), s = x and nothing is stored. Rows of x have x_stride elements; the other tensors are contiguous. */
int add_rms_norm_f32(const float *x, const float *residual, const float *weight, float *out, float *residual_out,
                     int rows, int hidden, int64_t x_stride, float eps, int threads) {
    threads = threads_for(threads, (int64_t)rows * hidden, MIN_ELEMENTS_PER_THREAD);
    ROWS_IN_PARALLEL
    for (int r = 0; r < rows; r++) {
        const float *s_row = x + r * x_stride; /* where s lies once the first pass is done */
        vf squares = vzero();
        if (residual) {
            const float *xr = s_row, *rr = residual + (int64_t)r * hidden;
            float *sr = residual_out + (int64_t)r * hidden;
            for (int d = 0; d < hidden; d += LANES) {
                vf s = vadd(load(xr + d, hidden - d), load(rr + d, hidden - d));
                store(sr + d, s, hidden - d);
                squares = vfmadd(s, s, squares);
            }
            s_row = sr;
        } else {
            for (int d = 0; d < hidden; d += LANES) {
                vf s = load(s_row + d, hidden - d);
                squares = vfmadd(s, s, squares);
            }
        }
        vf inv = vset1(1.f / sqrtf(vsum(squares) / hidden + eps));
        float *o = out + (int64_t)r * hidden;
        for (int d = 0; d < hidden; d += LANES) {
            vf y = vmul(load(s_row + d, hidden - d), inv);
            store(o + d, vmul(load(weight + d, hidden - d), y), hidden - d);
        }
    }
    return 0;
}

/* out (rows, inter) = act(gate) * up, gate and up the two halves of each gate_up row (rows of in_stride elements):
 * silu_mul_f32 (SiLU) and gelu_tanh_mul_f32 (GeGLU, tanh GELU), each within a few ulp of torch's. */
#define DEFINE_GATED(NAME, ACT)                                                                                \
    int NAME(const float *gate_up, float *out, int rows, int inter, int64_t in_stride, int threads) {         \
        threads = threads_for(threads, (int64_t)rows * inter, MIN_ELEMENTS_PER_THREAD);                        \
        ROWS_IN_PARALLEL                                                                                       \
        for (int r = 0; r < rows; r++) {                                                                       \
            const float *gate = gate_up + r * in_stride, *up = gate + inter;                                   \
            float *o = out + (int64_t)r * inter;                                                               \
            for (int d = 0; d < inter; d += LANES) {                                                           \
                int n = inter - d;                                                                             \
                store(o + d, vmul(ACT(load(gate + d, n)), load(up + d, n)), n);                                \
            }                                                                                                  \
        }                                                                                                      \
        return 0;                                                                                              \
    }
DEFINE_GATED(silu_mul_f32, vsilu)
DEFINE_GATED(gelu_tanh_mul_f32, vgelu_tanh)

/* One head of one token rotated (rotate-half layout) as torch does it: out[i] = x1 cos - x2 sin, out[i + half] =
 * x2 cos + x1 sin for i < half, every product rounded, with cos_sin = (cos[half], sin[half]); dims from 2 half to
 * head_dim (partial rotary) are copied as they are. */
static inline void rotate(const float *x, const float *cos_sin, int half, int head_dim, float *out) {
    for (int i = 0; i < half; i += LANES) {
        int n = half - i;
        vf c = load(cos_sin + i, n), s = load(cos_sin + half + i, n);
        vf x1 = load(x + i, n), x2 = load(x + half + i, n);
        store(out + i, vsub_exact(vmul(x1, c), vmul(x2, s)), n);
        store(out + half + i, vadd_exact(vmul(x2, c), vmul(x1, s)), n);
    }
    if (head_dim > 2 * half) memcpy(out + 2 * half, x + 2 * half, sizeof(float) * (head_dim - 2 * half));
}

/* q (tokens, heads, head_dim) and k, v (tokens, kv_heads, head_dim), each with rows of row_stride elements (views into
 * the fused qkv projection), heads contiguous within a row. The first rotary_dim dims of each q and k head rotate by
 * cos_sin (positions, rotary_dim), the rest pass unrotated (partial rotary: Phi; rotary_dim = head_dim: all rotate;
 * 0, an empty table: none, OPT).
 * Rotated q goes to q_out (contiguous); rotated k and v go to their cache slots, caches (slots, kv_heads, head_dim). */
int rotary_write_kv_f32(const float *q, const float *k, const float *v, int64_t row_stride, const float *cos_sin,
                        const int64_t *positions, const int64_t *slots, float *q_out, float *k_cache, float *v_cache,
                        int tokens, int heads, int kv_heads, int head_dim, int rotary_dim, int threads) {
    const int half = rotary_dim / 2;
    if (rotary_dim % 2 || rotary_dim < 0 || rotary_dim > head_dim) return -1;
    threads = threads_for(threads, (int64_t)tokens * (heads + 2 * kv_heads) * head_dim, MIN_ELEMENTS_PER_THREAD);
    ROWS_IN_PARALLEL
    for (int t = 0; t < tokens; t++) {
        const float *cs = rotary_dim ? cos_sin + positions[t] * rotary_dim : cos_sin; /* never read when empty */
        for (int h = 0; h < heads; h++)
            rotate(q + t * row_stride + h * head_dim, cs, half, head_dim, q_out + ((int64_t)t * heads + h) * head_dim);
        float *kc = k_cache + slots[t] * kv_heads * head_dim, *vc = v_cache + slots[t] * kv_heads * head_dim;
        for (int h = 0; h < kv_heads; h++)
            rotate(k + t * row_stride + h * head_dim, cs, half, head_dim, kc + h * head_dim);
        memcpy(vc, v + t * row_stride, sizeof(float) * kv_heads * head_dim);
    }
    return 0;
}

#else
/* Without the instructions: every entry point exists (the loader binds them all) and declines. */
int elementwise_f32_available(void) { return 0; }
int add_rms_norm_f32(const float *x, const float *residual, const float *weight, float *out, float *residual_out,
                     int rows, int hidden, int64_t x_stride, float eps, int threads) {
    (void)x, (void)residual, (void)weight, (void)out, (void)residual_out, (void)rows, (void)hidden, (void)x_stride;
    (void)eps, (void)threads;
    return -1;
}
int silu_mul_f32(const float *gate_up, float *out, int rows, int inter, int64_t in_stride, int threads) {
    (void)gate_up, (void)out, (void)rows, (void)inter, (void)in_stride, (void)threads;
    return -1;
}
int gelu_tanh_mul_f32(const float *gate_up, float *out, int rows, int inter, int64_t in_stride, int threads) {
    (void)gate_up, (void)out, (void)rows, (void)inter, (void)in_stride, (void)threads;
    return -1;
}
int rotary_write_kv_f32(const float *q, const float *k, const float *v, int64_t row_stride, const float *cos_sin,
                        const int64_t *positions, const int64_t *slots, float *q_out, float *k_cache, float *v_cache,
                        int tokens, int heads, int kv_heads, int head_dim, int rotary_dim, int threads) {
    (void)q, (void)k, (void)v, (void)row_stride, (void)cos_sin, (void)positions, (void)slots, (void)q_out;
    (void)k_cache, (void)v_cache, (void)tokens, (void)heads, (void)kv_heads, (void)head_dim, (void)rotary_dim;
    (void)threads;
    return -1;
}
#endif
