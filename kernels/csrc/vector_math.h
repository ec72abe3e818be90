/* Vector math shared by the CPU kernels (AVX-512; AVX2 for the float32 elementwise kernels). */
#ifndef FASTGEN_VECTOR_MATH_H
#define FASTGEN_VECTOR_MATH_H

/* exp_nonpositive's constants, one set for its AVX-512 and AVX2 forms, which must agree bit for bit: log2(e), ln 2
 * split in two (its high part exact in few bits, so n ln2_hi is exact), and the polynomial's coefficients, highest
 * degree first. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693145751953125f
#define EXP_LN2_LO 1.428606765330187e-06f
static const float EXP_POLY[7] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

#ifdef __AVX512F__
#include <immintrin.h>

/* e^x for x <= 0 (softmax after the max is subtracted): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p of
 * degree 6; relative error ~2e-7, and 0 for x below about -87 (-inf included). */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
    return _mm512_scalef_ps(p, n);
}

/* silu(g) = g sigmoid(g), the sigmoid from e = exp(-|g|), which cannot overflow: 1/(1+e) for g >= 0, e/(1+e) below.
 * The product is rounded on its own (no contraction into an FMA), so every kernel that uses this agrees bit for bit. */
static inline __m512 silu_ps(__m512 g) {
    const __m512 one = _mm512_set1_ps(1.f);
    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, e));
    sig = _mm512_mask_mul_ps(sig, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), sig, e);
    return _mm512_mul_round_ps(g, sig, _MM_FROUND_CUR_DIRECTION);
}

/* tanh(y) from e = exp(-2|y|), which cannot overflow: sign(y) (1 - e) / (1 + e); absolute error ~1e-7. */
static inline __m512 tanh_ps(__m512 y) {
    const __m512 one = _mm512_set1_ps(1.f);
    __m512 e = exp_nonpositive(_mm512_mul_ps(_mm512_set1_ps(-2.f), _mm512_abs_ps(y)));
    __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    return _mm512_mask_sub_ps(t, _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_setzero_ps(), t);
}

/* cap * tanh(x / cap): attention logit soft-capping (Gemma 2). */
static inline __m512 softcap_ps(__m512 x, float cap) {
    return _mm512_mul_ps(tanh_ps(_mm512_div_ps(x, _mm512_set1_ps(cap))), _mm512_set1_ps(cap));
}

/* GELU, tanh approximation (GeGLU's gate: gelu_pytorch_tanh): x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
static inline __m512 gelu_tanh_ps(__m512 x) {
    __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x), _mm512_mul_ps(x, x), x);
    __m512 t = tanh_ps(_mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), inner));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(_mm512_set1_ps(1.f), t));
}

/* r[i] (row i of a 16 x 16 block of 32-bit lanes) -> r[i] = column i. */
static inline void transpose16_ps(__m512 r[16]) {
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

#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The same functions on 8 lanes for AVX2 (no AVX-512), the same operations in the same order, so the same bits: where
 * AVX-512 has an instruction AVX2 lacks, the replacement computes the same value. */

/* A product rounded on its own: the empty asm keeps the compiler from contracting it into a fused multiply-add. */
static inline __m256 mul_exact8(__m256 a, __m256 b) {
    __m256 p = _mm256_mul_ps(a, b);
    __asm__("" : "+x"(p));
    return p;
}

static inline __m256 abs8(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), x); }

/* exp_nonpositive on 8 lanes. scalef (p 2^n, one rounding) as two products by powers of two: the first, by
 * 2^(n - n/2) >= 2^-75, is exact; the second rounds once, as scalef does, into the subnormals too. */
static inline __m256 exp_nonpositive8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-104.f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
    const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half),
                                                                            _mm256_set1_epi32(127)), 23));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    return mul_exact8(mul_exact8(p, a), b);
}

static inline __m256 silu_ps8(__m256 g) {
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    __m256 e = exp_nonpositive8(_mm256_sub_ps(zero, abs8(g)));
    __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, e));
    sig = _mm256_blendv_ps(sig, mul_exact8(sig, e), _mm256_cmp_ps(g, zero, _CMP_LT_OQ));
    return mul_exact8(g, sig);
}

static inline __m256 tanh_ps8(__m256 y) {
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    __m256 e = exp_nonpositive8(mul_exact8(_mm256_set1_ps(-2.f), abs8(y)));
    __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    return _mm256_blendv_ps(t, _mm256_sub_ps(zero, t), _mm256_cmp_ps(y, zero, _CMP_LT_OQ));
}

static inline __m256 gelu_tanh_ps8(__m256 x) {
    __m256 inner = _mm256_fmadd_ps(mul_exact8(_mm256_set1_ps(0.044715f), x), mul_exact8(x, x), x);
    __m256 t = tanh_ps8(mul_exact8(_mm256_set1_ps(0.7978845608028654f), inner));
    return mul_exact8(mul_exact8(_mm256_set1_ps(0.5f), x), _mm256_add_ps(_mm256_set1_ps(1.f), t));
}
#endif

#endif
