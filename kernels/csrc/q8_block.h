/* One 32-value block of activations rounded to int8, as llama.cpp's q8_0 rounds them: dx = max |x| / 127, q = x / dx
 * to nearest (ties to even, the MXCSR mode torch leaves alone), saturated. The int8-activation kernels (linear_q8.c on
 * VNNI, linear_amx_q8.c on the matrix engine) share it, so both round a row alike. */
#ifndef FASTGEN_Q8_BLOCK_H
#define FASTGEN_Q8_BLOCK_H
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <stdint.h>

/* The block's scale dx; its 32 quants into q. */
static inline float q8_block(const float *x, int8_t *q) {
    const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 127.f;
    const __m512 id = _mm512_set1_ps(d != 0 ? 127.f / amax : 0.f);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, id))));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, id))));
    return d;
}
#elif defined(__AVX2__)
#include <immintrin.h>
#include <stdint.h>

/* The same on AVX2: the same maximum (exact in any order), products, rounding and saturation. */
static inline float q8_block(const float *x, int8_t *q) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(x + 8 * j), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const float d = amax / 127.f;
    const __m256 id = _mm256_set1_ps(d != 0 ? 127.f / amax : 0.f);
    __m256i i[4];
    for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
    /* saturating packs leave 4-value runs in the order 0, 2, 4, 6, 1, 3, 5, 7 */
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return d;
}
#endif
#endif
