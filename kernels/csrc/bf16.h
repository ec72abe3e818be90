/* Scalar bfloat16 <-> float32, as torch converts: a bfloat16 is a float32's top half (widening is exact), and
 * narrowing rounds to nearest even, a NaN staying a quiet NaN. */
#ifndef FASTGEN_BF16_H
#define FASTGEN_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1)) >> 16);
}
#endif
