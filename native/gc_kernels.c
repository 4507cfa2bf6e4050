/* giftcomm native codec: instantiate the kernel template for each instruction set.
 *
 * generic: whatever the compiler targets by default (x86-64: SSE2). On x86-64 with gcc, three more
 * copies are compiled for AVX2, AVX-512 (F/BW/VL/DQ, 512-bit vectors) and AVX-512 plus VBMI (whose
 * FP8 decode is a byte-table lookup, GC_LUT8); gc_module.c picks one at import with
 * __builtin_cpu_supports. The same C source, compiled with -ffp-contract=off, gives the
 * same bits on every variant (the tests run all of them). FMA is deliberately not enabled.
 */
#include "gc_codec.h"

#define GC_SUFFIX generic
#define GC_ISA_NAME "generic"
#include "gc_kernels.h"
#undef GC_SUFFIX
#undef GC_ISA_NAME

#if defined(GC_HAVE_X86_VARIANTS)
#pragma GCC push_options
#pragma GCC target("avx2")
#define GC_X256 1
#define GC_SUFFIX avx2
#define GC_ISA_NAME "avx2"
#include "gc_kernels.h"
#undef GC_SUFFIX
#undef GC_ISA_NAME
#undef GC_X256
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512")
#define GC_X512 1
#define GC_SUFFIX avx512
#define GC_ISA_NAME "avx512"
#include "gc_kernels.h"
#undef GC_SUFFIX
#undef GC_ISA_NAME
#undef GC_X512
#pragma GCC pop_options

uint8_t gc_lut8_hi[2][128] __attribute__((aligned(64)));
uint8_t gc_lut8_lo[2][128] __attribute__((aligned(64)));
uint8_t gc_lut8_order[64] __attribute__((aligned(64)));

void gc_lut8_init(void)
{
    for (int e5 = 0; e5 < 2; e5++)
        for (uint32_t m = 0; m < 128; m++) {
            uint32_t b = gc_bits(gc_d8(m, e5)); /* the scalar decode, exact */
            gc_lut8_hi[e5][m] = (uint8_t)(b >> 24);
            gc_lut8_lo[e5][m] = (uint8_t)(b >> 16);
        }
    /* position 16*lane + 4*group + k takes code 16*group + 4*lane + k (a 4x4 transpose of 4-byte
     * groups): the unpacks then put code j's value at output j */
    for (int lane = 0; lane < 4; lane++)
        for (int group = 0; group < 4; group++)
            for (int k = 0; k < 4; k++)
                gc_lut8_order[16 * lane + 4 * group + k] = (uint8_t)(16 * group + 4 * lane + k);
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,prefer-vector-width=512")
#define GC_LUT8 1
#define GC_X512 1
#define GC_SUFFIX avx512vbmi
#define GC_ISA_NAME "avx512vbmi"
#include "gc_kernels.h"
#undef GC_SUFFIX
#undef GC_ISA_NAME
#undef GC_LUT8
#undef GC_X512
#pragma GCC pop_options
#endif
