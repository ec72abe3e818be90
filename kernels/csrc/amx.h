/* The matrix engine (AMX) as the CPU kernels use it: tile configuration and the permission to use it. */
#ifndef FASTGEN_AMX_H
#define FASTGEN_AMX_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Linux hands out the tile register state only to processes that ask for it; 1 where it did. */
static inline int amx_granted(void) {
    static int state = 0; /* 0: not asked yet, 1: granted, -1: refused */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return state == 1;
}

/* ldtilecfg of the whole 64-byte configuration. GCC 12's _tile_loadconfig tells the compiler it reads only the first
 * 8 bytes, so the stores of rows and column widths can be dropped as dead. */
static inline void load_tile_config(const TileConfig *cfg) { __asm__ volatile("ldtilecfg %0" ::"m"(*cfg)); }

#endif
#endif
