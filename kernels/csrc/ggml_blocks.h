/* GGUF's block types as the CPU kernels read them: ggml.h's type numbers and ggml-quants.h's block layouts. */
#ifndef FASTGEN_GGML_BLOCKS_H
#define FASTGEN_GGML_BLOCKS_H

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

/* Weights per block and bytes per block of each type; 0 for a type not taken. */
static inline int block_weights(int type) {
    switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
    case Q4_K: case Q5_K: case Q6_K: return 256;
    default: return 0;
    }
}
static inline int block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

/* The 32-value types, whose blocks the int8-activation kernels read (linear_q8.c, linear_amx_q8.c): bytes per block,
 * 0 for any other type. */
static inline int int8_block_bytes(int type) { return block_weights(type) == 32 ? block_bytes(type) : 0; }

/* Where a 32-value block's quants start: after d, Q4_1/Q5_1's m and Q5's fifth bits qh (4 bytes just before). */
static inline int quants_at(int type) {
    return type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : type == Q5_1 ? 8 : 2;
}
#endif
