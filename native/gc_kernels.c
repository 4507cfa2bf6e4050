/* giftcomm native codec: instantiate the kernel template for each instruction set.
 *
 * generic: whatever the compiler targets by default (x86-64: SSE2). On x86-64 with gcc, two more
 * copies are compiled for AVX2 and AVX-512 (F/BW/VL/DQ, 512-bit vectors); gc_module.c picks one at
 * import with __builtin_cpu_supports. The same C source, compiled with -ffp-contract=off, gives the
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
#define GC_SUFFIX avx2
#define GC_ISA_NAME "avx2"
#include "gc_kernels.h"
#undef GC_SUFFIX
#undef GC_ISA_NAME
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512")
#define GC_SUFFIX avx512
#define GC_ISA_NAME "avx512"
#include "gc_kernels.h"
#undef GC_SUFFIX
#undef GC_ISA_NAME
#pragma GCC pop_options
#endif
