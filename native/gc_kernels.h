/* giftcomm native codec: the kernels, as a template included once per instruction set.
 *
 * Before including, define GC_SUFFIX (an identifier: generic, avx2, avx512) and GC_ISA_NAME (a
 * string); gc_kernels.c wraps each inclusion in `#pragma GCC target(...)` so that gcc vectorizes
 * the same C source for that instruction set. The result is the object `gc_kernels_<suffix>`.
 *
 * Block-scaled formats work one block at a time: the block's amax (integer max of |bits|, which
 * orders non-negative floats and puts NaN above Inf), its scale, then the codes. The fused hop
 * decodes the block into block-local scratch, adds `local`, and encodes it while it is still in L1.
 */
#include "gc_codec.h"
#include "gc_scalar.h"

#define GC_CAT2(a, b) a##_##b
#define GC_CAT(a, b) GC_CAT2(a, b)
#define K(name) GC_CAT(name, GC_SUFFIX)

/* max |bits| of len float32 values, and the min at *least */
GC_INLINE uint32_t K(amax_bits)(const float *restrict x, size_t len, uint32_t *least)
{
    uint32_t m = 0, lo = 0xffffffffu;
    for (size_t i = 0; i < len; i++) {
        uint32_t a = gc_bits(x[i]) & 0x7fffffffu;
        m = a > m ? a : m;
        lo = a < lo ? a : lo;
    }
    *least = lo;
    return m;
}

/* Encode one block of len values whose max and min |bits| are m and lo: codes[len] and the scale
 * at scale_p. When even the smallest scaled value is a normal FP8 value (the usual case: no zero,
 * no value 2^6 times below the block's amax), the subnormal path is left out of the loop. */
GC_INLINE void K(enc8_block)(const float *restrict x, size_t len, uint8_t *restrict codes,
                             uint8_t *scale_p, uint32_t m, uint32_t lo, const int e5)
{
    if (m >= 0x7f800000u) { /* NaN or Inf in the block */
        memset(codes, 0x7f, len);
        gc_store_f32(scale_p, gc_float(0x7fc00000u));
        return;
    }
    float amax = gc_float(m), scale = 1.0f, inv = 1.0f;
    if (!(amax < GC8_TINY(e5))) {
        scale = amax / GC8_FMAX(e5);
        inv = GC8_FMAX(e5) / amax;
    }
    if ((gc_bits(gc_float(lo) * inv) & 0x7fffffffu) >= GC8_MINNORM(e5)) { /* |x| * inv rounds as x * inv */
        for (size_t i = 0; i < len; i++)
            codes[i] = (uint8_t)gc_q8_normal(gc_bits(x[i] * inv), e5);
    } else {
        for (size_t i = 0; i < len; i++)
            codes[i] = (uint8_t)gc_q8(gc_bits(x[i] * inv), e5);
    }
    gc_store_f32(scale_p, scale);
}

#if defined(GC_LUT8)
#include <immintrin.h>
/* Decode the first len - len % 64 codes of a block with a finite scale; returns that count.
 * Every FP8 value's float32 bits have zero low 16 bits, so a value is two looked-up bytes
 * (vpermi2b over the 128-entry tables, indexed by the code's low 7 bits) with the code's sign bit
 * ORed into the top one, then multiplied by the scale: bit-identical to gc_d8(code) * scale.
 * The codes are first put in gc_lut8_order, so the in-lane unpacks emit the values in order. */
GC_INLINE size_t K(dec8_lut)(const uint8_t *restrict codes, size_t len, float scale,
                             float *restrict out, const int e5)
{
    size_t whole = len & ~(size_t)63;
    const __m512i lo0 = _mm512_load_si512(gc_lut8_lo[e5]), lo1 = _mm512_load_si512(gc_lut8_lo[e5] + 64);
    const __m512i hi0 = _mm512_load_si512(gc_lut8_hi[e5]), hi1 = _mm512_load_si512(gc_lut8_hi[e5] + 64);
    const __m512i order = _mm512_load_si512(gc_lut8_order), sign = _mm512_set1_epi8((char)0x80);
    const __m512i zero = _mm512_setzero_si512();
    const __m512 s = _mm512_set1_ps(scale);
    for (size_t i = 0; i < whole; i += 64) {
        __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + i));
        __m512i lo = _mm512_permutex2var_epi8(lo0, c, lo1);
        __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, c, hi1), c, sign, 0xF8); /* a|b&c */
        __m512i w0 = _mm512_unpacklo_epi8(lo, hi), w1 = _mm512_unpackhi_epi8(lo, hi);
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, w0)), s));
        _mm512_storeu_ps(out + i + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, w0)), s));
        _mm512_storeu_ps(out + i + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, w1)), s));
        _mm512_storeu_ps(out + i + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, w1)), s));
    }
    return whole;
}
#define GC_LUT8_DECODE 1
#else
#define GC_LUT8_DECODE 0
#endif

/* Decode one block: out[i] = float(code) * scale (numpy's operand order for NaN results). */
GC_INLINE void K(dec8_block)(const uint8_t *restrict codes, size_t len, float scale,
                             float *restrict out, const int e5)
{
    if (gc_isnan(scale)) {
        float q = gc_quiet(scale);
        for (size_t i = 0; i < len; i++) {
            float v = gc_d8(codes[i], e5);
            out[i] = gc_isnan(v) ? v : q;
        }
        return;
    }
    size_t i0 = 0;
#if defined(GC_LUT8)
    i0 = K(dec8_lut)(codes, len, scale, out, e5);
#endif
    for (size_t i = i0; i < len; i++)
        out[i] = gc_d8(codes[i], e5) * scale;
}

/* Software prefetch of the float32 stream GC_PF_BYTES ahead, one hint per 64-byte line of this
 * block: it overlaps the next blocks' loads with this block's (compute-bound) encode pass. The
 * hint is T0 (all cache levels): a non-temporal hint (prefetchnta) made the fused hop up to 3x
 * slower on the AVX-512 development host (its lines were not kept where the next pass reads them). */
#ifndef GC_PREFETCH_AHEAD
#define GC_PF_BYTES 4096
#if defined(__GNUC__)
#define GC_PREFETCH_AHEAD(p, len, left)                                                         \
    do {                                                                                         \
        if ((left) * 4 > GC_PF_BYTES + (len) * 4)                                                \
            for (size_t pf_ = 0; pf_ < (len); pf_ += 16)                                         \
                __builtin_prefetch((const char *)((p) + pf_) + GC_PF_BYTES, 0, 3);               \
    } while (0)
#else
#define GC_PREFETCH_AHEAD(p, len, left) ((void)0)
#endif
#endif

#include "gc_kernels_mx.h"
#include "gc_kernels_ada.h"

GC_INLINE void K(encode8)(const float *x, size_t n, uint8_t *msg, size_t block, const int e5, const gc_rng *rng)
{
    size_t off = gc_scales_offset(n);
    memset(msg + n, 0, off - n);
    for (size_t i0 = 0, b = 0; i0 < n; i0 += block, b++) {
        size_t len = n - i0 < block ? n - i0 : block;
        uint32_t lo, m = K(amax_bits)(x + i0, len, &lo);
        if (rng)
            K(enc8sr_block)(x + i0, len, msg + i0, msg + off + 4 * b, m, rng->offset + i0, rng, e5);
        else
            K(enc8_block)(x + i0, len, msg + i0, msg + off + 4 * b, m, lo, e5);
    }
}

GC_INLINE void K(decode8)(const uint8_t *msg, size_t n, float *out, size_t block, const int e5)
{
    size_t off = gc_scales_offset(n);
    for (size_t i0 = 0, b = 0; i0 < n; i0 += block, b++) {
        size_t len = n - i0 < block ? n - i0 : block;
        K(dec8_block)(msg + i0, len, gc_load_f32(msg + off + 4 * b), out + i0, e5);
    }
}

GC_INLINE void K(dae8)(const uint8_t *msg_in, const float *local, size_t n, uint8_t *msg_out,
                       float *sum_out, size_t block, float *restrict tmp, const int e5, const gc_rng *rng)
{
    size_t off = gc_scales_offset(n);
    memset(msg_out + n, 0, off - n);
    for (size_t i0 = 0, b = 0; i0 < n; i0 += block, b++) {
        size_t len = n - i0 < block ? n - i0 : block;
        const uint8_t *c = msg_in + i0;
        const float *l = local + i0;
        float scale = gc_load_f32(msg_in + off + 4 * b);
        /* pass 1: sum into block-local scratch (or sum_out) and its max and min |bits|; everything of this
         * block is read from msg_in before msg_out is written (they may be the same buffer) */
        float *dst = sum_out ? sum_out + i0 : tmp;
        uint32_t m = 0, lo = 0xffffffffu;
        GC_PREFETCH_AHEAD(l, len, n - i0);
        if (GC_LUT8_DECODE || gc_isnan(scale)) { /* decode first: table lookups, or a NaN scale */
            K(dec8_block)(c, len, scale, tmp, e5);
            for (size_t i = 0; i < len; i++) {
                float s = gc_addf(tmp[i], l[i]);
                dst[i] = s;
                uint32_t a = gc_bits(s) & 0x7fffffffu;
                m = a > m ? a : m;
                lo = a < lo ? a : lo;
            }
        } else if (sum_out) {
            for (size_t i = 0; i < len; i++) {
                float s = gc_addf(gc_d8(c[i], e5) * scale, l[i]);
                dst[i] = s;
                uint32_t a = gc_bits(s) & 0x7fffffffu;
                m = a > m ? a : m;
                lo = a < lo ? a : lo;
            }
        } else {
            for (size_t i = 0; i < len; i++) {
                float s = gc_addf(gc_d8(c[i], e5) * scale, l[i]);
                tmp[i] = s;
                uint32_t a = gc_bits(s) & 0x7fffffffu;
                m = a > m ? a : m;
                lo = a < lo ? a : lo;
            }
        }
        /* pass 2: encode the block from L1 */
        if (rng)
            K(enc8sr_block)(dst, len, msg_out + i0, msg_out + off + 4 * b, m, rng->offset + i0, rng, e5);
        else
            K(enc8_block)(dst, len, msg_out + i0, msg_out + off + 4 * b, m, lo, e5);
    }
}

GC_INLINE void K(acc8)(const uint8_t *msg, size_t n, float *acc, size_t block, const int e5)
{
    size_t off = gc_scales_offset(n);
    for (size_t i0 = 0, b = 0; i0 < n; i0 += block, b++) {
        size_t len = n - i0 < block ? n - i0 : block;
        float scale = gc_load_f32(msg + off + 4 * b);
        const uint8_t *c = msg + i0;
        float *a = acc + i0;
        if (gc_isnan(scale)) {
            float q = gc_quiet(scale);
            for (size_t i = 0; i < len; i++) {
                float v = gc_d8(c[i], e5);
                a[i] = gc_addf(a[i], gc_isnan(v) ? v : q);
            }
        } else if (GC_LUT8_DECODE) { /* table decode into L1 scratch, then add */
            float buf[256];
            for (size_t j0 = 0; j0 < len; j0 += 256) {
                size_t m = len - j0 < 256 ? len - j0 : 256;
                K(dec8_block)(c + j0, m, scale, buf, e5);
                for (size_t i = 0; i < m; i++)
                    a[j0 + i] = gc_addf(a[j0 + i], buf[i]);
            }
        } else {
            for (size_t i = 0; i < len; i++)
                a[i] = gc_addf(a[i], gc_d8(c[i], e5) * scale);
        }
    }
}

/* ---- pass-through formats: element-wise, 2-byte payloads read and written with memcpy ---- */

GC_INLINE void K(encode16)(const float *restrict x, size_t n, uint8_t *restrict msg, const int fp16)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t u = gc_bits(x[i]);
        uint16_t h = (uint16_t)(fp16 ? gc_efp16(u) : gc_ebf16(u));
        memcpy(msg + 2 * i, &h, 2);
    }
}

GC_INLINE float K(load16)(const uint8_t *p, const int fp16)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return fp16 ? gc_dfp16(h) : gc_dbf16(h);
}

GC_INLINE void K(decode16)(const uint8_t *restrict msg, size_t n, float *restrict out, const int fp16)
{
    for (size_t i = 0; i < n; i++)
        out[i] = K(load16)(msg + 2 * i, fp16);
}

GC_INLINE void K(dae16)(const uint8_t *msg_in, const float *local, size_t n, uint8_t *msg_out,
                     float *sum_out, const int fp16)
{
    if (sum_out) {
        for (size_t i = 0; i < n; i++) {
            float s = gc_addf(K(load16)(msg_in + 2 * i, fp16), local[i]);
            sum_out[i] = s;
            uint16_t h = (uint16_t)(fp16 ? gc_efp16(gc_bits(s)) : gc_ebf16(gc_bits(s)));
            memcpy(msg_out + 2 * i, &h, 2);
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            float s = gc_addf(K(load16)(msg_in + 2 * i, fp16), local[i]);
            uint16_t h = (uint16_t)(fp16 ? gc_efp16(gc_bits(s)) : gc_ebf16(gc_bits(s)));
            memcpy(msg_out + 2 * i, &h, 2);
        }
    }
}

GC_INLINE void K(acc16)(const uint8_t *msg, size_t n, float *acc, const int fp16)
{
    for (size_t i = 0; i < n; i++)
        acc[i] = gc_addf(acc[i], K(load16)(msg + 2 * i, fp16));
}

GC_INLINE void K(dae32)(const uint8_t *msg_in, const float *local, size_t n, uint8_t *msg_out, float *sum_out)
{
    for (size_t i = 0; i < n; i++) {
        float s = gc_addf(gc_load_f32(msg_in + 4 * i), local[i]);
        if (sum_out)
            sum_out[i] = s;
        gc_store_f32(msg_out + 4 * i, s);
    }
}

GC_INLINE void K(acc32)(const uint8_t *msg, size_t n, float *acc)
{
    for (size_t i = 0; i < n; i++)
        acc[i] = gc_addf(acc[i], gc_load_f32(msg + 4 * i));
}

/* ---- entry points: dispatch on the variant code v (validated by the caller: gc_module.c); the
 * FP8 rows with float32 scales (GC_F32_ROWS), the MX rows (GC_E8M0_ROWS) and the adaptive rows
 * (GC_ADAPTIVE_ROWS; their spec from the slot in the variant code, gc_adaptive.h) come from the
 * generated table, gc_formats.h ---- */

static void K(encode)(int v, const float *x, size_t n, uint8_t *msg, size_t block, const gc_rng *rng)
{
    int fmt = GC_VARIANT_FORMAT(v);
    switch (fmt) {
#define GC_ENC8(N, L) case GC_##N: K(encode8)(x, n, msg, block, GC_##N##_ELEM, rng); break;
    GC_F32_ROWS(GC_ENC8)
    case GC_NVFP4: GC_E8M0_ROWS(GC_CASE_OF)
        K(encode_mx)(fmt, GC_VARIANT_RULE(v), x, n, msg, rng);
        break;
    case GC_BF16: K(encode16)(x, n, msg, 0); break;
    case GC_FP16: K(encode16)(x, n, msg, 1); break;
    case GC_FP32: memmove(msg, x, 4 * n); break;
    GC_ADAPTIVE_ROWS(GC_CASE_OF)
        if (gc_ada_spec_of(v))
            K(encode_ada)(gc_ada_spec_of(v), x, n, msg, block, rng);
        break;
    default: break;
    }
}

static void K(decode)(int v, const uint8_t *msg, size_t n, float *out, size_t block)
{
    int fmt = GC_VARIANT_FORMAT(v);
    switch (fmt) {
#define GC_DEC8(N, L) case GC_##N: K(decode8)(msg, n, out, block, GC_##N##_ELEM); break;
    GC_F32_ROWS(GC_DEC8)
    case GC_NVFP4: GC_E8M0_ROWS(GC_CASE_OF) K(decode_mx)(fmt, msg, n, out, 0); break;
    case GC_BF16: K(decode16)(msg, n, out, 0); break;
    case GC_FP16: K(decode16)(msg, n, out, 1); break;
    case GC_FP32: memmove(out, msg, 4 * n); break;
    GC_ADAPTIVE_ROWS(GC_CASE_OF)
        if (gc_ada_spec_of(v))
            K(decode_ada)(gc_ada_spec_of(v), msg, n, out, NULL, block, 0);
        break;
    default: break;
    }
}

static void K(decode_add_encode)(int v, const uint8_t *msg_in, const float *local, size_t n,
                                 uint8_t *msg_out, float *sum_out, size_t block, float *tmp, const gc_rng *rng)
{
    int fmt = GC_VARIANT_FORMAT(v);
    switch (fmt) {
#define GC_DAE8(N, L) case GC_##N: K(dae8)(msg_in, local, n, msg_out, sum_out, block, tmp, GC_##N##_ELEM, rng); break;
    GC_F32_ROWS(GC_DAE8)
    case GC_NVFP4: GC_E8M0_ROWS(GC_CASE_OF)
        K(dae_mx)(fmt, GC_VARIANT_RULE(v), msg_in, local, n, msg_out, sum_out, rng);
        break;
    case GC_BF16: K(dae16)(msg_in, local, n, msg_out, sum_out, 0); break;
    case GC_FP16: K(dae16)(msg_in, local, n, msg_out, sum_out, 1); break;
    case GC_FP32: K(dae32)(msg_in, local, n, msg_out, sum_out); break;
    GC_ADAPTIVE_ROWS(GC_CASE_OF)
        if (gc_ada_spec_of(v))
            K(dae_ada)(gc_ada_spec_of(v), msg_in, local, n, msg_out, sum_out, block, tmp, rng);
        break;
    default: break;
    }
}

static void K(decode_accumulate)(int v, const uint8_t *msg, size_t n, float *acc, size_t block)
{
    int fmt = GC_VARIANT_FORMAT(v);
    switch (fmt) {
#define GC_ACC8(N, L) case GC_##N: K(acc8)(msg, n, acc, block, GC_##N##_ELEM); break;
    GC_F32_ROWS(GC_ACC8)
    case GC_NVFP4: GC_E8M0_ROWS(GC_CASE_OF) K(decode_mx)(fmt, msg, n, acc, 1); break;
    case GC_BF16: K(acc16)(msg, n, acc, 0); break;
    case GC_FP16: K(acc16)(msg, n, acc, 1); break;
    case GC_FP32: K(acc32)(msg, n, acc); break;
    GC_ADAPTIVE_ROWS(GC_CASE_OF)
        if (gc_ada_spec_of(v))
            K(decode_ada)(gc_ada_spec_of(v), msg, n, acc, NULL, block, 1);
        break;
    default: break;
    }
}

const gc_kernels GC_CAT(gc_kernels, GC_SUFFIX) = {
    GC_ISA_NAME, K(encode), K(decode), K(decode_add_encode), K(decode_accumulate),
};

#undef K
#undef GC_ENC8
#undef GC_DEC8
#undef GC_DAE8
#undef GC_ACC8
#undef GC_CAT
#undef GC_CAT2
#undef GC_LUT8_DECODE
#undef GC_VEC_MX
#undef GC_BMV
#undef GC_E2M1_HI
#undef GC_E2M1_LO
#undef GV_I
#undef GV_F
#undef GV_W
#undef GV_SET1
#undef GV_SET1_64
#undef GV_SET1PS
#undef GV_ZERO
#undef GV_ADD
#undef GV_SUB
#undef GV_ADD64
#undef GV_AND
#undef GV_OR
#undef GV_XOR
#undef GV_XOR3
#undef GV_SRLI
#undef GV_SLLI
#undef GV_SRLV
#undef GV_SLLV
#undef GV_SRLI64
#undef GV_MINU
#undef GV_MAXU
#undef GV_MULU
#undef GV_SWAP
#undef GV_EVEN_ODD
#undef GV_IOTA2
#undef GV_LOADPS
#undef GV_MULPS
#undef GV_ADDPS
#undef GV_CASTI
#undef GV_CASTF
#undef GV_STOREI
