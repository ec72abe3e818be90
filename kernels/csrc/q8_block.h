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
#endif
#endif
