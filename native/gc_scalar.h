/* giftcomm native codec: element-wise conversions, shared by every instruction-set variant.
 *
 * Each function converts one value with integer bit manipulation (plus one exact float add or
 * subtract for subnormal results), written without branches so that gcc turns the loops that call
 * them into SIMD code. All of them are exact re-statements of the reference (NumPy/ml_dtypes):
 *
 *   gc_q8      float32 bits (finite, already scaled) -> FP8 code: clip to +-max, round to nearest
 *              even (subnormal FP8 results included), keep the sign of zero.
 *   gc_q8_normal  the same for |value| >= the smallest normal FP8 value only (no subnormal path).
 *   gc_d8      FP8 code -> float32 (exact; NaN codes give ml_dtypes' +-0x7FC00000, e5m2 Inf codes Inf).
 *   gc_ebf16   float32 bits -> bfloat16 bits: round to nearest even; NaN -> sign|0x7FC0 (as ml_dtypes).
 *   gc_dbf16   bfloat16 bits -> float32 (shift).
 *   gc_efp16   float32 bits -> IEEE half bits: round to nearest even, overflow to Inf; NaN keeps the
 *              sign and the top 10 payload bits, 0x7C01 if those are zero (as numpy's astype).
 *   gc_dfp16   half bits -> float32 (exact; NaN payload shifted, not quieted, as numpy).
 *   gc_addf    a + b in float32; when a is NaN the result is a quieted (x86 SSE semantics: the first
 *              NaN operand wins), so the result does not depend on how the compiler orders operands.
 */
#ifndef GC_SCALAR_H
#define GC_SCALAR_H

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__)
#define GC_INLINE static inline __attribute__((always_inline))
#else
#define GC_INLINE static inline
#endif

GC_INLINE uint32_t gc_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
GC_INLINE float gc_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

#include "gc_formats.h"

/* FP8 conversion constants; e5 = the element kind: GC_ELEM_E4M3 (0, float8_e4m3fn) or GC_ELEM_E5M2
 * (1). The largest value and the smallest normal come from the format table (gc_formats.h); the
 * rest are the conversion's own derived constants. */
#define GC8_MAXBITS(e5) GC_ELEM_MAXB(e5)                            /* 448, 57344 */
#define GC8_MINNORM(e5) ((uint32_t)(127 + GC_ELEM_EMIN(e5)) << 23)  /* 2^-6, 2^-14 */
/* the FP8 code below reads e5 as a flag: e4m3 must be kind 0 and e5m2 kind 1 */
typedef char gc_fp8_kinds_check[(GC_ELEM_E4M3 == 0 && GC_ELEM_E5M2 == 1) ? 1 : -1];
#define GC8_SHIFT(e5) ((e5) ? 21u : 20u)                      /* fp32 mantissa bits dropped */
#define GC8_EBIAS(e5) ((e5) ? (112u << 2) : (120u << 3))      /* (127 - bias) << mantissa bits */
#define GC8_MAGIC(e5) ((e5) ? 128.0f : 16384.0f)              /* 2^23 * smallest subnormal */
#define GC8_MAGICBITS(e5) ((e5) ? 0x43000000u : 0x46800000u)
#define GC8_FMAX(e5) ((e5) ? 57344.0f : 448.0f)
#define GC8_TINY(e5) ((e5) ? 0x1.cp-111f : 0x1.cp-118f)       /* max * 2^-126, exact */

/* the normal-result path of gc_q8 alone: right for |y| >= the smallest normal FP8 value */
GC_INLINE uint32_t gc_q8_rn(uint32_t a, const int e5)
{
    /* round the fp32 mantissa to 3 (2) bits, nearest even, then rebias */
    return ((a + ((1u << (GC8_SHIFT(e5) - 1u)) - 1u) + ((a >> GC8_SHIFT(e5)) & 1u)) >> GC8_SHIFT(e5))
           - GC8_EBIAS(e5);
}

GC_INLINE uint32_t gc_q8_normal(uint32_t u, const int e5)
{
    uint32_t a = u & 0x7fffffffu;
    a = a < GC8_MAXBITS(e5) ? a : GC8_MAXBITS(e5);
    return gc_q8_rn(a, e5) | ((u >> 24) & 0x80u);
}

GC_INLINE uint32_t gc_q8(uint32_t u, const int e5)
{
    uint32_t s = (u >> 24) & 0x80u;
    uint32_t a = u & 0x7fffffffu;
    a = a < GC8_MAXBITS(e5) ? a : GC8_MAXBITS(e5); /* clip(-max, max); no NaN reaches here */
    uint32_t rn = gc_q8_rn(a, e5);
    /* subnormal FP8 result: adding 2^23 * step rounds a to a multiple of the subnormal step (RNE,
     * done by the FPU); the low bits are then the code. Reaching 2^-6 (2^-14) gives the smallest
     * normal code, so the two paths meet exactly. */
    uint32_t rs = gc_bits(gc_float(a) + GC8_MAGIC(e5)) - GC8_MAGICBITS(e5);
    return (a < GC8_MINNORM(e5) ? rs : rn) | s;
}

GC_INLINE float gc_d8(uint32_t c, const int e5)
{
    uint32_t m = c & 0x7fu, s = (c & 0x80u) << 24, b;
    if (e5) {
        uint32_t nb = (m << 21) + (112u << 23);
        /* subnormal: 2^-14 * (1 + m/4) - 2^-14 = m * 2^-16, exact, never an fp32 denormal */
        uint32_t sb = gc_bits(gc_float((m << 21) + (113u << 23)) - 0x1p-14f);
        b = m < 4u ? sb : nb;
        b = m == 0x7cu ? 0x7f800000u : b;
        b = m > 0x7cu ? 0x7fc00000u : b;
    } else {
        uint32_t nb = (m << 20) + (120u << 23);
        uint32_t sb = gc_bits(gc_float((m << 20) + (121u << 23)) - 0x1p-6f);
        b = m < 8u ? sb : nb;
        b = m == 0x7fu ? 0x7fc00000u : b;
    }
    return gc_float(b | s);
}

GC_INLINE uint32_t gc_ebf16(uint32_t u)
{
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = ((u >> 16) & 0x8000u) | 0x7fc0u;
    return (u & 0x7fffffffu) > 0x7f800000u ? nan : r;
}

GC_INLINE float gc_dbf16(uint32_t h) { return gc_float(h << 16); }

GC_INLINE uint32_t gc_efp16(uint32_t u)
{
    uint32_t s = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    uint32_t rn = ((a + 0xfffu + ((a >> 13) & 1u)) >> 13) - (112u << 10);
    rn = a >= 0x477ff000u ? 0x7c00u : rn;                           /* >= 65520 rounds to Inf */
    uint32_t rs = gc_bits(gc_float(a) + 0.5f) - 0x3f000000u;        /* subnormal: step 2^-24 */
    uint32_t r = a < 0x38800000u ? rs : rn;
    uint32_t nan = 0x7c00u | ((a >> 13) & 0x3ffu);
    nan = nan == 0x7c00u ? 0x7c01u : nan;
    r = a > 0x7f800000u ? nan : r;
    return r | s;
}

GC_INLINE float gc_dfp16(uint32_t h)
{
    uint32_t s = (h & 0x8000u) << 16;
    uint32_t o = (h & 0x7fffu) << 13;
    uint32_t e = o & 0x0f800000u;
    uint32_t nb = o + (112u << 23);
    nb = e == 0x0f800000u ? nb + (112u << 23) : nb;                 /* Inf/NaN: exponent 255 */
    uint32_t sb = gc_bits(gc_float(o + (113u << 23)) - 0x1p-14f);   /* subnormal: exact */
    return gc_float((e == 0u ? sb : nb) | s);
}

GC_INLINE float gc_addf(float a, float b)
{
    uint32_t ua = gc_bits(a);
    float s = a + b;
    return (ua & 0x7fffffffu) > 0x7f800000u ? gc_float(ua | 0x400000u) : s;
}

GC_INLINE int gc_isnan(float a) { return (gc_bits(a) & 0x7fffffffu) > 0x7f800000u; }
GC_INLINE float gc_quiet(float a) { return gc_float(gc_bits(a) | 0x400000u); }

GC_INLINE float gc_load_f32(const uint8_t *p) { float f; memcpy(&f, p, 4); return f; }
GC_INLINE void gc_store_f32(uint8_t *p, float f) { memcpy(p, &f, 4); }

/* ---- microscaling / 4-bit formats and stochastic rounding (docs/wire-format.md) ----
 *
 *   gc_philox_w0  word 0 of Philox4x32-10 (Random123 definition) for counter (c0, c1, 0, 0) and
 *                 key (k0, k1): the 32 random bits of one element.
 *   gc_qmag       magnitude code of a finite float32 |y| (bits a, already clipped to the element
 *                 format's max) in an element format with `mant` mantissa bits whose smallest
 *                 normal is 2^emin: u = |y| / step as an integer part hi and 32 truncated fraction
 *                 bits lo; nearest: up when lo > 1/2, or lo = 1/2 and hi odd (RNE, = ml_dtypes'
 *                 cast); stochastic: up when lo + r >= 2^32 (probability lo / 2^32). The code of the
 *                 magnitude is hi + up + (max(e - emin, 0) << mant), which carries into the exponent
 *                 field exactly like the format does.
 *   gc_de2m1      E2M1 code (low 4 bits) -> float32, exact.
 */
GC_INLINE uint32_t gc_philox_w0(uint32_t c0, uint32_t c1, uint32_t k0, uint32_t k1)
{
    uint32_t c2 = 0, c3 = 0;
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0;
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c0;
}

GC_INLINE uint32_t gc_qmag(uint32_t a, uint32_t r, const int mant, const int emin, const int sr)
{
    uint32_t ef = a >> 23;
    uint32_t sig = ef ? ((a & 0x7fffffu) | 0x800000u) : a;
    int32_t e = (int32_t)(ef ? ef : 1u) - 127;
    int32_t under = emin - e;
    under = under > 0 ? under : 0;
    uint32_t d = (uint32_t)(23 - mant + under);
    uint32_t hi = sig >> (d < 31u ? d : 31u);
    uint32_t sl = d <= 32u ? 32u - d : 0u;
    uint32_t sh = d > 32u ? (d - 32u < 31u ? d - 32u : 31u) : 0u;
    uint32_t lo = (sig << sl) >> sh;
    uint32_t up = sr ? (uint32_t)(lo + r < lo) : (uint32_t)((lo > 0x80000000u) | ((lo == 0x80000000u) & hi));
    int32_t ex = e - emin;
    ex = ex > 0 ? ex : 0;
    return hi + up + ((uint32_t)ex << mant);
}

GC_INLINE float gc_de2m1(uint32_t c)
{
    uint32_t m = c & 7u;
    uint32_t nb = (((m >> 1) + 126u) << 23) | ((m & 1u) << 22);
    uint32_t b = m < 2u ? (m ? 0x3f000000u : 0u) : nb;
    return gc_float(b | ((c & 8u) << 28));
}

/* E8M0 scale code of a block whose amax (float32 bits m) is finite, for element kind ek and
 * shared-exponent rule `rule` (docs/wire-format.md). E = the biased float32 exponent of amax.
 * GC_RULE_FLOOR (OCP MX v1.0): max(E - emax, 0). GC_RULE_CEIL: the smallest power of two that keeps
 * amax / scale <= the element max: one more than floor exactly when amax's mantissa field exceeds
 * the element max's (amax > max * 2^(E - 127 - emax)), except in the top float32 binade (E = 254,
 * m < 0x7f000000 fails), where the larger scale's next element value above amax would decode past
 * the float32 max; 0 (2^-127) at the bottom of the range under both rules. */
GC_INLINE uint32_t gc_e8m0_code(uint32_t m, const int ek, const int rule)
{
    uint32_t e = (m >> 23) + (uint32_t)(rule == GC_RULE_CEIL && (m & 0x7fffffu) > GC_ELEM_MAXMANT(ek) && m < 0x7f000000u);
    return e > GC_ELEM_EMAX(ek) ? e - GC_ELEM_EMAX(ek) : 0u;
}

/* E8M0 code -> float32 (2^(code-127); code 0 is the float32 subnormal 2^-127; 0xFF NaN) */
GC_INLINE float gc_de8m0(uint32_t c)
{
    uint32_t b = c ? c << 23 : 0x400000u;
    return gc_float(c == 0xffu ? 0x7fc00000u : b);
}

#endif
