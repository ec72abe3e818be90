/* linear_q8.c's inner loop on AVX2 (AMD Zen 3, Intel Haswell to Skylake): the 32-value types' products with int8
 * activations where the CPU has no AVX-512 VNNI, included by linear_q8.c (its row_q8, row buffers and constants).
 *
 * The AVX-512 loop's 16 float lanes are two 8-lane halves here (a quad's blocks 0-1 and 2-3; a group's blocks 0-7 and
 * 8-15 for the m terms). Each int32 lane sums the products of the same 8 values (vpmaddubsw's pairs, then vpmaddwd's
 * pairs of pairs, where vpdpbusd sums fours: no int16 sum can saturate, 4 x 31 x 127 at most, and Q8_0's signed quants
 * go as |w| times x with w's sign, where VNNI flips their sign bits and starts lane 0 from -128 sum(q)), and the lanes
 * are scaled, added and reduced in the AVX-512 loop's order, by its tree (_mm512_reduce_add_ps's). Results are
 * independent of the batch and the thread count, as there. The K-quants are not read here (linear_q8_types). */
#ifndef FASTGEN_LINEAR_Q8_AVX2_H
#define FASTGEN_LINEAR_Q8_AVX2_H

/* 0xFF in byte i where bit i of bits is set, else 0. */
static inline __m256i bytes_of_bits(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

/* The quants of the quad at w, in the activations' order: lo[h] values 0-15 of blocks 2h and 2h + 1, hi[h] values
 * 16-31. Only its first `bytes` bytes are read, as in the AVX-512 loop. Q8_0's quants stay signed. */
static inline __attribute__((always_inline)) void quad_quants(int type, const uint8_t *w, int64_t bytes, __m256i lo[2],
                                                              __m256i hi[2]) {
    const int bb = block_bytes(type), at = quants_at(type);
    const int whole = bytes >= 4 * bb;
    if (type == Q8_0) {
        __m256i v[4];
        for (int j = 0; j < 4; j++)
            v[j] = whole || (j + 1) * bb <= bytes ? _mm256_loadu_si256((const __m256i *)(w + j * bb + at))
                                                  : _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            lo[h] = _mm256_permute2x128_si256(v[2 * h], v[2 * h + 1], 0x20);
            hi[h] = _mm256_permute2x128_si256(v[2 * h], v[2 * h + 1], 0x31);
        }
        return;
    }
    __m128i v[4];
    for (int j = 0; j < 4; j++)
        v[j] = whole || (j + 1) * bb <= bytes ? _mm_loadu_si128((const __m128i *)(w + j * bb + at)) : _mm_setzero_si128();
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) {
        const __m256i nibbles = _mm256_set_m128i(v[2 * h + 1], v[2 * h]);
        lo[h] = _mm256_and_si256(nibbles, low4);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(nibbles, 4), low4);
    }
    if (type == Q5_0 || type == Q5_1) { /* qh bit t: value t's fifth bit */
        uint32_t qh[4] = {0, 0, 0, 0};
        for (int j = 0; j < 4 && (whole || (j + 1) * bb <= bytes); j++) memcpy(&qh[j], w + j * bb + at - 4, 4);
        const __m256i fifth = _mm256_set1_epi8(0x10);
        for (int h = 0; h < 2; h++) {
            const uint32_t a = qh[2 * h], b = qh[2 * h + 1];
            lo[h] = _mm256_or_si256(lo[h], _mm256_and_si256(bytes_of_bits((a & 0xFFFF) | (b << 16)), fifth));
            hi[h] = _mm256_or_si256(hi[h], _mm256_and_si256(bytes_of_bits((a >> 16) | (b & 0xFFFF0000u)), fifth));
        }
    }
}

/* Per int32 lane, start + the 8 products of the values that lane of vpdpbusd's pair of products would sum: lo and hi
 * one half's quants (16 values of two blocks each), xl and xh the activations' at the same places. */
static inline __attribute__((always_inline)) __m256i half_dot(int type, __m256i lo, __m256i hi, const int8_t *xl,
                                                              const int8_t *xh, __m256i start) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)xl), b = _mm256_loadu_si256((const __m256i *)xh);
    const __m256i ones = _mm256_set1_epi16(1);
    if (type == Q8_0) /* |w| times x with w's sign: pairs up to 2 x 128 x 127, within int16 */
        return _mm256_add_epi32(
            start, _mm256_add_epi32(
                       _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(lo), _mm256_sign_epi8(a, lo)), ones),
                       _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(hi), _mm256_sign_epi8(b, hi)), ones)));
    return _mm256_add_epi32(
        start, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, a), _mm256_maddubs_epi16(hi, b)), ones));
}

/* The float16 in the low half of each int32 lane of v, as float32. */
static inline __m256 low_halves(__m256i v) {
    const __m256i h = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

/* _mm512_reduce_add_ps of the 16 lanes [lo | hi], by its tree. */
static inline float sum16(__m256 lo, __m256 hi) {
    const __m256 t = _mm256_add_ps(hi, lo);
    const __m128 u = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    const __m128 v = _mm_add_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(v) + _mm_cvtss_f32(_mm_shuffle_ps(v, v, 1));
}

/* acc[2 i + h] (i < MR) += x row i's products with half h of the quad (quad q of its group, whose 8 blocks' scales
 * are dw8), to float32, times the weights' and the row's scales. */
static inline __attribute__((always_inline)) void half_rows(int type, const row_q8 *x, int quad, int q, const int h,
                                                            __m256i lo, __m256i hi, __m256 dw8, __m256 *acc,
                                                            const int MR) {
    const __m256 scale = _mm256_permutevar8x32_ps(
        dw8, _mm256_add_epi32(_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_set1_epi32(4 * (q & 1) + 2 * h)));
    for (int i = 0; i < MR; i++) {
        const __m256i start = int_offset(type) ? _mm256_loadu_si256((const __m256i *)(x[i].init + 16 * quad + 8 * h))
                                               : _mm256_setzero_si256();
        const __m256i dot =
            half_dot(type, lo, hi, x[i].q + 128 * quad + 32 * h, x[i].q + 128 * quad + 64 + 32 * h, start);
        acc[2 * i + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                         _mm256_mul_ps(scale, _mm256_loadu_ps(x[i].lane_scale + 16 * quad + 8 * h)),
                                         acc[2 * i + h]);
    }
}

/* tile_dot of the AVX-512 loop (its comment says the order): acc[2 t + half] is the AVX-512 accumulator t's half. */
static inline __attribute__((always_inline)) void tile(int type, const uint8_t *w, int64_t ws, int blocks,
                                                       const row_q8 *x, float *out, const float *bias, const int WR,
                                                       const int MR) {
    const int bb = block_bytes(type);
    __m256 acc[2 * TILE_ROWS];
    for (int t = 0; t < 2 * WR * MR; t++) acc[t] = _mm256_setzero_ps();
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i at_block = _mm256_mullo_epi32(lane, _mm256_set1_epi32(bb));
    for (int g0 = 0; g0 < blocks; g0 += GROUP) {
        const int in_group = blocks - g0 < GROUP ? blocks - g0 : GROUP;
        __m256 dw[WROWS][2];
        for (int r = 0; r < WR; r++) {
            const uint8_t *base = w + r * ws + (int64_t)g0 * bb;
            dw[r][1] = _mm256_setzero_ps();
            for (int half = 0; half < 2 && 8 * half < in_group; half++) { /* the scales d (and offsets m) of blocks
                                                                           * 8 half to 8 half + 7, where there are */
                __m256i head; /* scalar loads where all 8 are there: vpgatherdd cost 10% at one row on a Zen 3 */
                if (in_group - 8 * half >= 8) {
                    const uint8_t *b = base + 8 * half * bb;
                    int32_t h[8];
                    for (int j = 0; j < 8; j++) memcpy(&h[j], b + j * bb, 4);
                    head = _mm256_setr_epi32(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]);
                } else {
                    const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(in_group - 8 * half), lane);
                    head = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)(base + 8 * half * bb),
                                                       at_block, valid, 1);
                }
                dw[r][half] = low_halves(head);
                if (has_m(type)) {
                    const __m256 mw = low_halves(_mm256_srli_epi32(head, 16));
                    for (int i = 0; i < MR; i++)
                        acc[2 * (r * MR + i) + half] =
                            _mm256_fmadd_ps(mw, _mm256_loadu_ps(x[i].sums + g0 + 8 * half), acc[2 * (r * MR + i) + half]);
                }
            }
            for (int l = 0; l < GROUP * bb; l += 64) _mm_prefetch((const char *)(base + PREFETCH_AHEAD + l), _MM_HINT_T0);
        }
        for (int q = 0; q < (in_group + 3) / 4; q++) {
            const int quad = (g0 >> 2) + q;
            const int whole = 4 * quad + 2 < blocks; /* else a last quad of one or two blocks: lanes 0-7 only */
            for (int r = 0; r < WR; r++) {
                __m256i lo[2], hi[2];
                quad_quants(type, w + r * ws + (int64_t)quad * 4 * bb, (int64_t)(blocks - 4 * quad) * bb, lo, hi);
                half_rows(type, x, quad, q, 0, lo[0], hi[0], dw[r][q >> 1], acc + 2 * r * MR, MR);
                if (whole) half_rows(type, x, quad, q, 1, lo[1], hi[1], dw[r][q >> 1], acc + 2 * r * MR, MR);
            }
        }
    }
    for (int r = 0; r < WR; r++)
        for (int i = 0; i < MR; i++)
            out[r * MR + i] = sum16(acc[2 * (r * MR + i)], acc[2 * (r * MR + i) + 1]) + (bias ? bias[r] : 0.f);
}
#endif
