/* Linear layers over GGUF blocks with int8 activations, llama.cpp's numerics: y (m, n) = x (m, k) w^T (+ bias) for a
 * few rows of x (a decode batch), w in its file's blocks (ggml-quants.h's layouts, as linear_quant.c reads them).
 *
 * Each 32-value block of a row of x is rounded to int8 with its own scale (dx = max |x| / 127, q = x / dx to nearest,
 * ties to even), as llama.cpp's q8_0/q8_1 activations are; the block's dot product with a weight block is then exact
 * in int32 (AVX-512 VNNI `vpdpbusd`, unsigned weight quants times signed activations; a type whose offset is an
 * integer, Q4_0's 8, Q5_0's 16 and Q8_0's 128 once its sign bit is flipped, starts the sum at -offset sum(q)), scaled
 * once per block by dw dx in float32, and a block type with a float offset (Q4_1's and Q5_1's m) adds m times the
 * activations' block sum dx sum(q).
 *
 * The inner loop takes a quad of 4 blocks: two VNNI products, each int32 lane summing 8 products of one block, then
 * one conversion, one scale product and one FMA for all 4 blocks, where a pass by pairs of blocks paid those three per
 * pair; with Q8_0 read without its sign trick, the file's layers took 0.85-0.91x the time at 1 to 8 rows on a Zen 4
 * (the embedded file's layers, 2 threads, 31 alternating passes). One row's pass reads its weights at about two thirds
 * of the memory bandwidth there; linear_quant.c's exact float32 path (every weight dequantized to float) is bound by
 * instructions.
 * The K-quants (Q4_K, Q5_K, Q6_K: 256-value super-blocks) take the same activations: a super-block is two quads of
 * 32-value blocks, its quants set in the quads' order by two permutes per quad; Q4_K/Q5_K scale each 32 values by
 * d sc and subtract dmin m dx sum(q) per sub-block, and Q6_K, whose 16-value halves each have a scale, takes the two
 * VNNI products of a quad apart, each started from -32 times its half's activation sum.
 * The activations' rounding changes results by about a part in a thousand: the replica takes this path for bfloat16
 * activations only (already rounded to 8 significant bits), never for float32 ones, whose results stay exact.
 *
 * One order for every output whatever m or the thread count: per 16-lane accumulator, quads of blocks in increasing
 * k, then a fixed reduction. The CPUs with AVX-512 VNNI (Ice Lake and later, Zen 4) build it; those with AVX2 alone
 * (Zen 3, Haswell to Skylake) build linear_q8_avx2.h's loop for the 32-value types, in the same lanes and order;
 * linear_q8_types() says which types a build reads (none elsewhere: the caller keeps the exact path). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "entry_points.h"
#include "ggml_blocks.h"
#include "parallel.h"
#include "q8_block.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512DQ__) && defined(__F16C__)
#include <immintrin.h>
#define Q8_PATH 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define Q8_PATH 2
#else
#define Q8_PATH 0
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-associative-math")
#endif

/* Rows of x one pass over the weights serves; a batch of more rows is cut into strips of this many (AVX2: two
 * accumulators a row in 16 registers). A strip's weight row is read from memory once: the next strip finds it in L1. */
#if Q8_PATH == 1
#define TILE_ROWS 8
#else
#define TILE_ROWS 4
#endif
/* Weight rows one decode row's pass reads at a time. */
#ifndef WROWS
#define WROWS 2
#endif
/* Blocks whose scales are fetched together (one gather), so 4 quads. */
#define GROUP 16
#define MIN_WORK_PER_THREAD (1 << 16)
/* How far ahead of the group being read its lines are fetched (bytes; past a row's end: the next row's). */
#define PREFETCH_AHEAD 2048

/* Whether this build reads the type: the AVX-512 loop every one, AVX2's the 32-value ones, none without either. */
static inline int reads(int type) {
    return Q8_PATH == 1 ? block_weights(type) != 0 : Q8_PATH == 2 && block_weights(type) == 32;
}

#if Q8_PATH

/* The offset a type's unsigned quants carry (weight = d (q - offset)): Q4_0's 8, Q5_0's 16, and Q8_0's 128, whose
 * signed quants are read with their sign bit flipped, so VNNI's unsigned-by-signed product takes them (AVX2 moves
 * their sign onto the activations instead: no offset); 0 for the types with a float offset m (Q4_1, Q5_1), added per
 * block as m dx sum(q). */
static inline int int_offset(int type) {
    return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q8_0 ? (Q8_PATH == 1 ? 128 : 0) : type == Q6_K ? 32 : 0;
}
static inline int has_m(int type) { return type == Q4_1 || type == Q5_1; }

/* One row of x as the kernel reads it, by quads of 4 blocks (128 values), the unit of one pass of the inner loop:
 * q holds per quad [blocks 0-3's values 0-15 | blocks 0-3's values 16-31], the order of the weights' low then high
 * nibbles (16 bytes a block); per quad 16 floats, lane_scale, the scale dx of the block each int32 lane of the dot
 * product sums (lanes 4b to 4b + 3: block b); per quad 16 int32, init, each block's -offset sum(q) in its first lane,
 * which starts the dot product so it comes out exact for the types with an integer offset (Q6_K: -32 sum(q) of values
 * 0-15 only, init_hi the same for values 16-31, as its halves are scaled apart); per block its dx sum(q), for the
 * types with an m. Blocks past k are zeros, up to a whole group. */
typedef struct {
    int8_t *q;
    float *lane_scale;
    int32_t *init;
    int32_t *init_hi;
    float *sums;
} row_q8;

/* Bytes of one row's buffer for padded_blocks blocks (a multiple of GROUP): per block 32 quants, 4 lanes each of
 * lane_scale, init and init_hi, one sum. */
static size_t row_bytes(int padded_blocks) { return (size_t)padded_blocks * (32 + 3 * 16 + 4); }

static void quantize_row(const float *x, int k, int type, row_q8 r, int padded_blocks) {
    const int blocks = k / 32;
    for (int b = 0; b < padded_blocks; b++) {
        int8_t q[32] = {0};
        const float d = b < blocks ? q8_block(x + 32 * b, q) : 0.f;
        int lo_sum = 0, hi_sum = 0;
        for (int j = 0; j < 16; j++) lo_sum += q[j], hi_sum += q[16 + j];
        r.sums[b] = d * (float)(lo_sum + hi_sum);
        const int quad = b >> 2, j = b & 3;
        memcpy(r.q + 128 * quad + 16 * j, q, 16);
        memcpy(r.q + 128 * quad + 64 + 16 * j, q + 16, 16);
        for (int c = 0; c < 4; c++) {
            r.lane_scale[16 * quad + 4 * j + c] = d;
            r.init[16 * quad + 4 * j + c] = c == 0 ? -int_offset(type) * (type == Q6_K ? lo_sum : lo_sum + hi_sum) : 0;
            r.init_hi[16 * quad + 4 * j + c] = c == 0 ? -int_offset(type) * hi_sum : 0;
        }
    }
}

#if Q8_PATH == 1
/* The 128 unsigned quants of the quad at w in the activations' order. Only its first `bytes` bytes are read (past the
 * row's last block the quants are fillers, 0 or Q8_0's 128, multiplying the zeros x holds past k). Each block's 16
 * (Q8_0: 32) bytes by its own load, set in place by inserts: a byte permute of two 64-byte loads (AVX-512 VBMI) took
 * 1.1-1.3x the time on a Zen 4, where it is slow. */
static inline __attribute__((always_inline)) void quad_quants(int type, const uint8_t *w, int64_t bytes, __m512i *lo,
                                                              __m512i *hi) {
    const int bb = block_bytes(type), at = quants_at(type);
    const int whole = bytes >= 4 * bb;
    if (type == Q8_0) { /* [A | B], [C | D] to [A, B, C, D values 0-15], [values 16-31]; sign bits flipped */
        __m256i v[4];
        for (int j = 0; j < 4; j++)
            v[j] = whole || (j + 1) * bb <= bytes ? _mm256_loadu_si256((const __m256i *)(w + j * bb + at))
                                                  : _mm256_setzero_si256();
        const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(v[0]), v[1], 1);
        const __m512i cd = _mm512_inserti64x4(_mm512_castsi256_si512(v[2]), v[3], 1);
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        *lo = _mm512_xor_si512(_mm512_shuffle_i64x2(ab, cd, 0x88), flip);
        *hi = _mm512_xor_si512(_mm512_shuffle_i64x2(ab, cd, 0xDD), flip);
        return;
    }
    __m128i v[4];
    for (int j = 0; j < 4; j++)
        v[j] = whole || (j + 1) * bb <= bytes ? _mm_loadu_si128((const __m128i *)(w + j * bb + at))
                                              : _mm_setzero_si128();
    const __m512i nibbles = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(v[0]), v[1], 1)),
        _mm256_inserti128_si256(_mm256_castsi128_si256(v[2]), v[3], 1), 1);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    *lo = _mm512_and_si512(nibbles, low4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(nibbles, 4), low4);
    if (type == Q5_0 || type == Q5_1) { /* qh bit t: value t's fifth bit */
        uint64_t mlo = 0, mhi = 0;
        for (int j = 0; j < 4 && (whole || (j + 1) * bb <= bytes); j++) {
            uint32_t qh;
            memcpy(&qh, w + j * bb + at - 4, 4);
            mlo |= (uint64_t)(qh & 0xFFFF) << 16 * j;
            mhi |= (uint64_t)(qh >> 16) << 16 * j;
        }
        const __m512i fifth = _mm512_set1_epi8(0x10);
        *lo = _mm512_mask_add_epi8(*lo, (__mmask64)mlo, *lo, fifth);
        *hi = _mm512_mask_add_epi8(*hi, (__mmask64)mhi, *hi, fifth);
    }
}

/* acc[i] (i < MR) += x row i's int32 dot product with a quad's quants (lo: the blocks' values 0-15, hi: 16-31; started
 * from the row's init where with_init), to float32, times scale (the weights' per lane) and the row's lane scales. */
static inline __attribute__((always_inline)) void quad_rows(const row_q8 *x, int quad, __m512i lo, __m512i hi,
                                                            __m512 scale, int with_init, __m512 *acc, const int MR) {
    for (int i = 0; i < MR; i++) {
        const __m512i start = with_init ? _mm512_loadu_si512(x[i].init + 16 * quad) : _mm512_setzero_si512();
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, lo, _mm512_loadu_si512(x[i].q + 128 * quad)),
                                                hi, _mm512_loadu_si512(x[i].q + 128 * quad + 64));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                 _mm512_mul_ps(scale, _mm512_loadu_ps(x[i].lane_scale + 16 * quad)), acc[i]);
    }
}

/* out[t] = acc[t]'s lanes summed in a fixed order, + bias[t / MR] where there is one. */
static inline __attribute__((always_inline)) void tile_out(const __m512 *acc, float *out, const float *bias,
                                                           const int WR, const int MR) {
    for (int r = 0; r < WR; r++)
        for (int i = 0; i < MR; i++) out[r * MR + i] = _mm512_reduce_add_ps(acc[r * MR + i]) + (bias ? bias[r] : 0.f);
}

/* WR weight rows (w, w + ws, ...) against MR rows of quantized x: out[r * MR + i] = the dot product of weight row r
 * and x row i, + bias[r]. Every output is summed by the same operations in the same order whatever WR and MR, so a
 * row's result does not depend on its batch, on the thread count, or on which tile computed it: per group of 16
 * blocks its m offsets (Q4_1, Q5_1), then per quad the exact int32 dot product of each block's 32 values (two VNNI
 * products, started from the integer offset's term) to float32, times dw dx per lane, in increasing k, then one
 * fixed reduction. */
static inline __attribute__((always_inline)) void tile_dot(int type, const uint8_t *w,
                                                           int64_t ws, int blocks, const row_q8 *x, float *out,
                                                           const float *bias, const int WR, const int MR) {
    const int bb = block_bytes(type);
    __m512 acc[TILE_ROWS]; /* [r * MR + i]: WR MR <= TILE_ROWS (fixed sizes, so the compiler keeps them in registers) */
    for (int t = 0; t < WR * MR; t++) acc[t] = _mm512_setzero_ps();
    const __m512i at_block = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(bb));
    const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int g0 = 0; g0 < blocks; g0 += GROUP) {
        const int in_group = blocks - g0 < GROUP ? blocks - g0 : GROUP;
        const __mmask16 valid = (__mmask16)((1u << in_group) - 1);
        __m512 dw[WROWS];
        for (int r = 0; r < WR; r++) {
            const uint8_t *base = w + r * ws + (int64_t)g0 * bb;
            /* the group's scales d (and offsets m) from the blocks' first 4 bytes, as float32 */
            const __m512i head = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, at_block, base, 1);
            dw[r] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
            if (has_m(type)) {
                const __m512 mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
                for (int i = 0; i < MR; i++)
                    acc[r * MR + i] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(x[i].sums + g0), acc[r * MR + i]);
            }
            for (int l = 0; l < GROUP * bb; l += 64) _mm_prefetch((const char *)(base + PREFETCH_AHEAD + l), _MM_HINT_T0);
        }
        for (int q = 0; q < (in_group + 3) / 4; q++) {
            const int quad = (g0 >> 2) + q;
            const __m512i lanes = _mm512_add_epi32(quarter, _mm512_set1_epi32(4 * q));
            for (int r = 0; r < WR; r++) {
                __m512i lo, hi;
                quad_quants(type, w + r * ws + (int64_t)quad * 4 * bb, (int64_t)(blocks - 4 * quad) * bb, &lo, &hi);
                const __m512 scale = _mm512_permutexvar_ps(lanes, dw[r]);
                if (4 * quad + 2 >= blocks) { /* a last quad of one or two blocks: their lanes, the lower half */
                    for (int i = 0; i < MR; i++) {
                        const __m256i start = int_offset(type) ? _mm256_maskz_loadu_epi32(0xFF, x[i].init + 16 * quad)
                                                               : _mm256_setzero_si256();
                        const __m256i dot = _mm256_dpbusd_epi32(
                            _mm256_dpbusd_epi32(start, _mm512_castsi512_si256(lo),
                                                _mm256_loadu_si256((const __m256i *)(x[i].q + 128 * quad))),
                            _mm512_castsi512_si256(hi),
                            _mm256_loadu_si256((const __m256i *)(x[i].q + 128 * quad + 64)));
                        const __m256 sum = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(dot),
                            _mm256_mul_ps(_mm512_castps512_ps256(scale), _mm256_loadu_ps(x[i].lane_scale + 16 * quad)),
                            _mm512_castps512_ps256(acc[r * MR + i]));
                        acc[r * MR + i] = _mm512_insertf32x8(acc[r * MR + i], sum, 0);
                    }
                    continue;
                }
                quad_rows(x, quad, lo, hi, scale, int_offset(type), acc + r * MR, MR);
            }
        }
    }
    tile_out(acc, out, bias, WR, MR);
}

/* ---- K-quants: super-blocks of 256 values, two quads of 32-value blocks each ---- */

/* A Q4_K/Q5_K super-block's 8 sub-block scales d sc_s in lanes 0-7 and mins dmin m_s in lanes 8-15 (its 12 bytes of
 * 6-bit fields unpacked four at a time, as get_scale_min_k4 reads them one by one); Q6_K's 16 scales d sc_j. */
static inline __attribute__((always_inline)) __m512 k_scales(int type, const uint8_t *b) {
    uint16_t h[2];
    if (type == Q6_K) {
        memcpy(h, b + 208, 2);
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(sc), _mm512_set1_ps(_cvtsh_ss(h[0])));
    }
    memcpy(h, b, 4);
    uint32_t s[3], u[4];
    memcpy(s, b + 4, 12);
    u[0] = s[0] & 0x3F3F3F3F;                                                 /* scales 0-3 */
    u[1] = (s[2] & 0x0F0F0F0F) | (((s[0] >> 6) & 0x03030303) << 4);          /* scales 4-7 */
    u[2] = s[1] & 0x3F3F3F3F;                                                 /* mins 0-3 */
    u[3] = ((s[2] >> 4) & 0x0F0F0F0F) | (((s[1] >> 6) & 0x03030303) << 4);   /* mins 4-7 */
    /* set from registers: a 16-byte load of the 4 words just stored would wait on a failed store forward */
    const __m128i bytes = _mm_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3]);
    const __m512 fields = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
    const __m512 d_dmin = _mm512_insertf32x8(_mm512_set1_ps(_cvtsh_ss(h[0])), _mm256_set1_ps(_cvtsh_ss(h[1])), 1);
    return _mm512_mul_ps(fields, d_dmin);
}

/* 64 copies of 1 << bit in 128-bit lane j, for bit = first + j. */
static inline __m512i lane_bits(int first) {
    const long long one = 0x0101010101010101LL;
    return _mm512_setr_epi64(one << first, one << first, one << (first + 1), one << (first + 1), one << (first + 2),
                             one << (first + 2), one << (first + 3), one << (first + 3));
}

/* The 128 unsigned quants of quad h (0, 1) of the K-quant super-block at b in the activations' order: lo values 0-15
 * of its 4 blocks, hi values 16-31. Q4_K/Q5_K: 64 bytes of nibbles, low ones sub-blocks 4h and 4h + 2, high ones
 * 4h + 1 and 4h + 3 (a 128-bit lane each per 16 values), set in order by a permute of 128-bit lanes; Q5_K's fifth bit
 * of value l of sub-block s is bit s of qh[l]. Q6_K's half h: ql's low nibbles are its blocks 0 and 1, the high ones
 * 2 and 3, and bits 2j, 2j + 1 of qh[l] the top two bits of value l of block j. */
static inline __attribute__((always_inline)) void k_quad_quants(int type, const uint8_t *b, int h, __m512i *lo,
                                                                __m512i *hi) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i q = _mm512_loadu_si512(b + (type == Q6_K ? 0 : type == Q4_K ? 16 : 48) + 64 * h);
    const __m512i n0 = _mm512_and_si512(q, low4), n1 = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
    if (type == Q6_K) {
        *lo = _mm512_permutex2var_epi64(n0, _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), n1);
        *hi = _mm512_permutex2var_epi64(n0, _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15), n1);
        /* per 128-bit lane j, 16-bit shifts bringing bits 2j, 2j + 1 of each byte to bits 4, 5 (no bit of the
         * neighbouring byte lands there) */
        const long long by4 = 0x0004000400040004LL, by2 = 0x0002000200020002LL;
        const __m512i left = _mm512_setr_epi64(by4, by4, by2, by2, 0, 0, 0, 0);
        const __m512i right = _mm512_setr_epi64(0, 0, 0, 0, 0, 0, by2, by2);
        const __m512i top2 = _mm512_set1_epi8(0x30);
        for (int half = 0; half < 2; half++) {
            const __m512i qh = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(b + 128 + 32 * h + 16 * half)));
            const __m512i bits = _mm512_and_si512(_mm512_srlv_epi16(_mm512_sllv_epi16(qh, left), right), top2);
            if (half) *hi = _mm512_or_si512(*hi, bits);
            else *lo = _mm512_or_si512(*lo, bits);
        }
        return;
    }
    *lo = _mm512_permutex2var_epi64(n0, _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), n1);
    *hi = _mm512_permutex2var_epi64(n0, _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15), n1);
    if (type == Q5_K) {
        const __m512i fifth = _mm512_set1_epi8(0x10), bit = lane_bits(4 * h);
        const __m512i qh_lo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(b + 16)));
        const __m512i qh_hi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(b + 32)));
        *lo = _mm512_mask_add_epi8(*lo, _mm512_test_epi8_mask(qh_lo, bit), *lo, fifth);
        *hi = _mm512_mask_add_epi8(*hi, _mm512_test_epi8_mask(qh_hi, bit), *hi, fifth);
    }
}

/* tile_dot for the K-quants, supers super-blocks a row, in the same fixed order: per super-block its mins (Q4_K,
 * Q5_K), then per quad the int32 products to float32 times the lanes' scales (Q6_K: each half's product apart). */
static inline __attribute__((always_inline)) void tile_dot_k(int type, const uint8_t *w, int64_t ws, int supers,
                                                             const row_q8 *x, float *out, const float *bias,
                                                             const int WR, const int MR) {
    const int bb = block_bytes(type);
    __m512 acc[TILE_ROWS];
    for (int t = 0; t < WR * MR; t++) acc[t] = _mm512_setzero_ps();
    const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int s = 0; s < supers; s++) {
        for (int r = 0; r < WR; r++) {
            const uint8_t *b = w + r * ws + (int64_t)s * bb;
            for (int l = 0; l < bb; l += 64) _mm_prefetch((const char *)(b + PREFETCH_AHEAD + l), _MM_HINT_T0);
            const __m512 scales = k_scales(type, b);
            if (type != Q6_K) { /* - dmin m_s dx sum(q) for the 8 sub-blocks: the mins to lanes 0-7 */
                const __m512 mins = _mm512_maskz_permutexvar_ps(
                    0xFF, _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0), scales);
                for (int i = 0; i < MR; i++)
                    acc[r * MR + i] =
                        _mm512_fnmadd_ps(mins, _mm512_maskz_loadu_ps(0xFF, x[i].sums + 8 * s), acc[r * MR + i]);
            }
            for (int h = 0; h < 2; h++) {
                const int quad = 2 * s + h;
                __m512i lo, hi;
                k_quad_quants(type, b, h, &lo, &hi);
                if (type == Q6_K) { /* values 0-15 of block j: scale 8h + 2j; 16-31: 8h + 2j + 1 */
                    const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(8 * h), _mm512_add_epi32(quarter, quarter));
                    const __m512 s_lo = _mm512_permutexvar_ps(at, scales);
                    const __m512 s_hi = _mm512_permutexvar_ps(_mm512_add_epi32(at, _mm512_set1_epi32(1)), scales);
                    for (int i = 0; i < MR; i++) {
                        const __m512 xs = _mm512_loadu_ps(x[i].lane_scale + 16 * quad);
                        const __m512i d_lo = _mm512_dpbusd_epi32(_mm512_loadu_si512(x[i].init + 16 * quad), lo,
                                                                 _mm512_loadu_si512(x[i].q + 128 * quad));
                        const __m512i d_hi = _mm512_dpbusd_epi32(_mm512_loadu_si512(x[i].init_hi + 16 * quad), hi,
                                                                 _mm512_loadu_si512(x[i].q + 128 * quad + 64));
                        acc[r * MR + i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d_lo), _mm512_mul_ps(s_lo, xs),
                                                          acc[r * MR + i]);
                        acc[r * MR + i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d_hi), _mm512_mul_ps(s_hi, xs),
                                                          acc[r * MR + i]);
                    }
                    continue;
                }
                const __m512 scale = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(4 * h), quarter), scales);
                quad_rows(x, quad, lo, hi, scale, 0, acc + r * MR, MR);
            }
        }
    }
    tile_out(acc, out, bias, WR, MR);
}

/* A tile of either family of types: the 32-value blocks' loop, or the K-quants'. */
static inline __attribute__((always_inline)) void tile(int type, const uint8_t *w, int64_t ws, int blocks,
                                                       const row_q8 *x, float *out, const float *bias, const int WR,
                                                       const int MR) {
    if (block_weights(type) == 256)
        tile_dot_k(type, w, ws, blocks / 8, x, out, bias, WR, MR);
    else
        tile_dot(type, w, ws, blocks, x, out, bias, WR, MR);
}
#else
#include "linear_q8_avx2.h"
#endif

static inline void store(void *y, int y_bf16, int64_t at, float v) {
    if (y_bf16)
        ((uint16_t *)y)[at] = f32_to_bf16(v);
    else
        ((float *)y)[at] = v;
}

/* Output columns [lo, hi) for every row: y is float32, or bfloat16 where y_bf16. One decode row reads WROWS weight
 * rows at a time (more memory streams in flight, which a single row's pass is bound by); a batch, a weight row at a
 * time against up to TILE_ROWS rows. */
static void rows_dot(int type, const uint8_t *w, int64_t ws, const float *bias, const row_q8 *x, int m, void *y,
                     int y_bf16, int64_t ys, int k, int lo, int hi) {
    const int blocks = k / 32;
    float out[WROWS * TILE_ROWS];
    if (m == 1) {
        for (; lo + WROWS <= hi; lo += WROWS) {
            tile(type, w + lo * ws, ws, blocks, x, out, bias ? bias + lo : 0, WROWS, 1);
            for (int r = 0; r < WROWS; r++) store(y, y_bf16, lo + r, out[r]);
        }
    }
    for (int j = lo; j < hi; j++)
        for (int i0 = 0; i0 < m; i0 += TILE_ROWS) {
            const int mr = m - i0 < TILE_ROWS ? m - i0 : TILE_ROWS;
            const float *bj = bias ? bias + j : 0;
#define ROWS_CASE(R)                                                                                                   \
    case R: tile(type, w + j * ws, ws, blocks, x + i0, out, bj, 1, R); break;
            switch (mr) {
                ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
#if TILE_ROWS > 4
                ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
#endif
            }
#undef ROWS_CASE
            for (int i = 0; i < mr; i++) store(y, y_bf16, (int64_t)(i0 + i) * ys + j, out[i]);
        }
}

/* One instance per type, so each type's unpacking is inlined into its loop. */
#define TYPE_ROWS(T)                                                                                                   \
    static void rows_##T(const uint8_t *w, int64_t ws, const float *bias, const row_q8 *x, int m, void *y,          \
                         int y_bf16, int64_t ys, int k, int lo, int hi) {                                              \
        rows_dot(T, w, ws, bias, x, m, y, y_bf16, ys, k, lo, hi);                                                      \
    }
TYPE_ROWS(Q4_0)
TYPE_ROWS(Q4_1)
TYPE_ROWS(Q5_0)
TYPE_ROWS(Q5_1)
TYPE_ROWS(Q8_0)
#if Q8_PATH == 1
TYPE_ROWS(Q4_K)
TYPE_ROWS(Q5_K)
TYPE_ROWS(Q6_K)
#endif
#endif

/* 1 where this build has the int8-activation path (AVX-512 VNNI, or AVX2 for the 32-value types), else 0. */
int linear_q8_available(void) { return Q8_PATH != 0; }

/* The types this build reads, bit t set for ggml type t (types number below 31). */
int linear_q8_types(void) {
    int types = 0;
    for (int t = 0; t < 31; t++)
        if (reads(t)) types |= 1 << t;
    return types;
}

/* Both entry points: x float32 or bfloat16 (x_bf16), y likewise. */
static int linear_q8(const void *x, int x_bf16, int64_t x_stride, const uint8_t *w, int64_t w_stride,
                     const float *bias, void *y, int y_bf16, int64_t y_stride, int m, int n, int k, int type,
                     int threads) {
    const int bw = block_weights(type), bb = block_bytes(type);
    if (!reads(type) || m <= 0 || n <= 0 || k <= 0 || k % bw || x_stride < k ||
        w_stride < (int64_t)k / bw * bb || y_stride < n)
        return -1;
#if Q8_PATH
    const int padded = (k / 32 + GROUP - 1) / GROUP * GROUP;
    const size_t bytes = row_bytes(padded);
    uint8_t *buffer = aligned_alloc(64, (bytes * (size_t)m + 63) / 64 * 64);
    row_q8 *rows = malloc(sizeof(row_q8) * (size_t)m);
    float *widened = x_bf16 ? malloc(sizeof(float) * (size_t)k) : 0;
    if (!buffer || !rows || (x_bf16 && !widened)) {
        free(buffer), free(rows), free(widened);
        return -1;
    }
    for (int i = 0; i < m; i++) {
        uint8_t *r = buffer + bytes * i;
        rows[i] = (row_q8){(int8_t *)r, (float *)(r + (size_t)padded * 32), (int32_t *)(r + (size_t)padded * 48),
                           (int32_t *)(r + (size_t)padded * 64), (float *)(r + (size_t)padded * 80)};
        const float *xi = (const float *)x + i * x_stride;
        if (x_bf16) { /* bfloat16 is float32's top half: widening is exact */
            const uint16_t *xb = (const uint16_t *)x + i * x_stride;
#if Q8_PATH == 1
            for (int j = 0; j < k; j += 16)
                _mm512_storeu_ps(widened + j, _mm512_castsi512_ps(_mm512_slli_epi32(
                                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xb + j))), 16)));
#else
            for (int j = 0; j < k; j += 8)
                _mm256_storeu_ps(widened + j,
                                 _mm256_castsi256_ps(_mm256_slli_epi32(
                                     _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(xb + j))), 16)));
#endif
            xi = widened;
        }
        quantize_row(xi, k, type, rows[i], padded);
    }
    typedef void (*rows_fn)(const uint8_t *, int64_t, const float *, const row_q8 *, int, void *, int, int64_t, int,
                            int, int);
    const rows_fn run = type == Q4_0   ? rows_Q4_0
                        : type == Q4_1 ? rows_Q4_1
                        : type == Q5_0 ? rows_Q5_0
                        : type == Q5_1 ? rows_Q5_1
#if Q8_PATH == 1
                        : type == Q4_K ? rows_Q4_K
                        : type == Q5_K ? rows_Q5_K
                        : type == Q6_K ? rows_Q6_K
#endif
                                       : rows_Q8_0;
    threads = threads_for(threads, (int64_t)m * n * k, MIN_WORK_PER_THREAD);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int lo, hi;
        share(n, thread_index(), thread_count(), &lo, &hi);
        if (lo < hi) run(w, w_stride, bias, rows, m, y, y_bf16, y_stride, k, lo, hi);
    }
    free(buffer), free(rows), free(widened);
    return 0;
#else
    (void)x_bf16, (void)bias, (void)y, (void)y_bf16, (void)threads, (void)x, (void)w;
    return -1;
#endif
}

/* y (m rows of stride y_stride, n columns) = x (m, k; row stride x_stride) w^T (+ bias), x rounded to int8 per
 * 32-value block, w n rows of w_stride bytes of `type` blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).
 * Returns -1 on bad arguments, a type not taken, a build without the path, or when its buffer cannot be had. */
int linear_q8_f32(const float *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, const float *bias, float *y,
                  int64_t y_stride, int m, int n, int k, int type, int threads) {
    return linear_q8(x, 0, x_stride, w, w_stride, bias, y, 0, y_stride, m, n, k, type, threads);
}

/* The same with x and y in bfloat16 (strides in elements; bias float32): a bfloat16 model's decode rows, with no
 * conversion on either side. */
int linear_q8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, int64_t w_stride, const float *bias,
                   uint16_t *y, int64_t y_stride, int m, int n, int k, int type, int threads) {
    return linear_q8(x, 1, x_stride, w, w_stride, bias, y, 1, y_stride, m, n, k, type, threads);
}
