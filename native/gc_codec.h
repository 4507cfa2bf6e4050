/* giftcomm native CPU codec: shared declarations.
 *
 * Wire message for n values (see docs/wire-format.md, giftcomm/formats.py):
 *   block-scaled (e4m3, e5m2): [n code bytes][zero pad to a multiple of 4][ceil(n/block) float32 scales]
 *   mxfp8, mxfp8_e5m2: [n code bytes][ceil(n/32) E8M0 bytes]
 *   mxfp4: [ceil(n/2) packed E2M1 bytes, value 2j in the low nibble][ceil(n/32) E8M0 bytes]
 *   nvfp4: [ceil(n/2) packed E2M1 bytes][ceil(n/16) E4M3 bytes][zero pad to 4][ceil(n/1024) float32]
 *   pass-through (bf16, fp16): n little-endian 2-byte values; (fp32): n float32 values.
 *   adaptive rows: frames of choice bits, float32 super-scales and tier sections (gc_adaptive.h).
 *
 * Every kernel is bit-identical to giftcomm/reference/codec.py (NumPy + ml_dtypes). The kernels
 * are plain C written so that gcc auto-vectorizes them; native/gc_kernels.h is compiled once per
 * instruction set (generic, AVX2, AVX-512) and gc_dispatch.c picks one at import time.
 *
 * This file must be compiled with -ffp-contract=off and without -ffast-math: a fused multiply-add
 * or a flushed denormal changes bits.
 */
#ifndef GC_CODEC_H
#define GC_CODEC_H

#include <stddef.h>
#include <stdint.h>

/* Format codes and facts (GC_E4M3, GC_FMT_SCALE(code), GC_ELEM_EMAX(ek), ...): generated from
 * giftcomm/formats.py (python -m giftcomm.formats_header > native/gc_formats.h). A `fmt` argument
 * of the kernels below is a *variant* code (Format.variant_code): the format code in the low bits
 * (GC_VARIANT_FORMAT) and, for the E8M0 formats, the shared-exponent rule above them
 * (GC_VARIANT_RULE: GC_RULE_CEIL or GC_RULE_FLOOR). */
#include "gc_formats.h"
#include "gc_adaptive.h"

/* The formats these kernels implement: the table's native rows (GC_NATIVE_ROWS); gc_module.c
 * reports them (giftcomm.codec runs every other row of the table on the NumPy reference). */
#define GC_CASE_OF(N, L) case GC_##N:
static inline int gc_implemented(int code)
{
    switch (code) {
    GC_NATIVE_ROWS(GC_CASE_OF)
        return 1;
    default:
        return 0;
    }
}

/* Stochastic rounding: Philox4x32-10 key (k0 = key mod 2^32, k1 = key >> 32) and the element
 * index of value 0 of the message (offset). A NULL gc_rng means round to nearest even. */
typedef struct {
    uint32_t k0, k1;
    uint64_t offset;
} gc_rng;

#define GC_NVFP4_GROUP 1024u /* values per float32 group scale */
#define GC_CHUNK 1024u       /* values per chunk of the MX / nvfp4 kernels (a multiple of 32 and 16) */

#define GC_MAX_BLOCK (1u << 20)

/* Extra AVX2 / AVX-512 copies of the kernels: gcc (not clang, which lacks `#pragma GCC target`)
 * on x86-64. Elsewhere only the generic copy exists. Define GC_NO_X86_VARIANTS to disable. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(GC_NO_X86_VARIANTS)
#define GC_HAVE_X86_VARIANTS 1
#endif

/* One instruction-set variant of the four kernels. All sizes are element counts; `msg` pointers
 * are whole wire messages (payload, pad, scales); float pointers need no particular alignment.
 * `tmp` is scratch space of at least min(block, n) floats (only the scaled formats use it). */
typedef struct {
    const char *name;
    /* x: n float32 -> msg */
    void (*encode)(int fmt, const float *x, size_t n, uint8_t *msg, size_t block, const gc_rng *rng);
    /* msg -> out: n float32 */
    void (*decode)(int fmt, const uint8_t *msg, size_t n, float *out, size_t block);
    /* msg_out = encode(decode(msg_in) + local); sum_out (may be NULL) = the float32 sum */
    void (*decode_add_encode)(int fmt, const uint8_t *msg_in, const float *local, size_t n,
                              uint8_t *msg_out, float *sum_out, size_t block, float *tmp, const gc_rng *rng);
    /* acc += decode(msg) */
    void (*decode_accumulate)(int fmt, const uint8_t *msg, size_t n, float *acc, size_t block);
} gc_kernels;

extern const gc_kernels gc_kernels_generic;
#if defined(GC_HAVE_X86_VARIANTS)
extern const gc_kernels gc_kernels_avx2;
extern const gc_kernels gc_kernels_avx512;
extern const gc_kernels gc_kernels_avx512vbmi;

/* Lookup tables of the avx512vbmi decode (gc_kernels.c), filled by gc_lut8_init() before any
 * kernel runs: for FP8 magnitude codes m = 0..127 of e4m3 ([0]) and e5m2 ([1]), bytes 3 and 2 of
 * the decoded float32 (its low two bytes are always zero); and the byte order that makes the
 * in-lane unpacks emit values in order (see dec8_lut in gc_kernels.h). */
extern uint8_t gc_lut8_hi[2][128], gc_lut8_lo[2][128], gc_lut8_order[64];
void gc_lut8_init(void);
#endif

/* Bytes of the payload padded to 4 (scaled formats), i.e. the offset of the scales. */
static inline size_t gc_scales_offset(size_t n) { return (n + 3u) & ~(size_t)3u; }

/* MX / nvfp4 layout (fmt: a format code): payload bytes (= offset of the block scales), the fixed
 * block, and (nvfp4) the offset of the float32 group scales. */
static inline int gc_is_packed(int fmt) { return GC_FMT_VALUE_BITS(fmt) == 4; }
static inline size_t gc_payload_bytes(size_t n, int fmt) { return gc_is_packed(fmt) ? (n + 1u) / 2u : n; }
static inline size_t gc_fixed_block(int fmt) { return (size_t)GC_FMT_FIXED_BLOCK(fmt); }
static inline size_t gc_group_offset(size_t n)
{
    return (gc_payload_bytes(n, GC_NVFP4) + (n + GC_NVFP4_FIXED_BLOCK - 1u) / GC_NVFP4_FIXED_BLOCK + 3u) & ~(size_t)3u;
}

#endif
