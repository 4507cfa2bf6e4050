// gc_mx.cuh -- scalar building blocks of the microscaling / 4-bit formats (mxfp8, mxfp8_e5m2,
// mxfp4, nvfp4) and of stochastic rounding, for the GPU kernels (gc_codec.cu) and the host
// emulation (gc_host_emu.cpp). Same rules, bit for bit, as giftcomm/reference/codec.py and the
// native C codec (native/gc_scalar.h, native/gc_kernels_mx.h); docs/wire-format.md states them.
//
// Element kinds EK (GC_ELEM_E4M3, GC_ELEM_E5M2, GC_ELEM_E2M1) and their facts come from gc_formats.h,
// generated from giftcomm/formats.py (the loader serves it to NVRTC; nvcc and the host emulation
// find native/gc_formats.h with -Inative).
#pragma once
// needs gc_formats.h and gc_fp8.cuh included before it (the loader inlines headers once per #include,
// so no nested include)

typedef unsigned long long gc_u64;

#define GC_EK_M(ek) GC_ELEM_MANT(ek)
#define GC_EK_EMIN(ek) GC_ELEM_EMIN(ek)
#define GC_EK_MAXB(ek) GC_ELEM_MAXB(ek)
#define GC_EK_SBIT(ek) GC_ELEM_SBIT(ek)
#define GC_EK_EMAX(ek) GC_ELEM_EMAX(ek)
#define GC_EK_NAN(ek) GC_ELEM_NAN(ek)

// word 0 of Philox4x32-10 (Random123), counter (c0, c1, 0, 0), key (k0, k1)
GC_HD gc_u32 gc_philox_w0(gc_u32 c0, gc_u32 c1, gc_u32 k0, gc_u32 k1) {
    gc_u32 c2 = 0, c3 = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int r = 0; r < 10; ++r) {
        const gc_u64 p0 = (gc_u64)0xD2511F53u * c0;
        const gc_u64 p1 = (gc_u64)0xCD9E8D57u * c2;
        const gc_u32 n0 = (gc_u32)(p1 >> 32) ^ c1 ^ k0;
        const gc_u32 n2 = (gc_u32)(p0 >> 32) ^ c3 ^ k1;
        c1 = (gc_u32)p1;
        c3 = (gc_u32)p0;
        c0 = n0;
        c2 = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c0;
}

GC_HD gc_u32 gc_rbits(gc_u64 key, gc_u64 idx) {
    return gc_philox_w0((gc_u32)idx, (gc_u32)(idx >> 32), (gc_u32)key, (gc_u32)(key >> 32));
}

// magnitude code of |y| (bits a, finite, <= the element max): nearest-even (sr = 0) or
// stochastic with 32 random bits r (up when frac32 + r >= 2^32)
GC_HD gc_u32 gc_qmag(gc_u32 a, gc_u32 r, int mant, int emin, bool sr) {
    const gc_u32 ef = a >> 23;
    const gc_u32 sig = ef ? ((a & 0x7FFFFFu) | 0x800000u) : a;
    const int e = (int)(ef ? ef : 1u) - 127;
    int under = emin - e;
    under = under > 0 ? under : 0;
    const gc_u32 d = (gc_u32)(23 - mant + under);
    const gc_u32 hi = sig >> (d < 31u ? d : 31u);
    const gc_u32 sl = d <= 32u ? 32u - d : 0u;
    const gc_u32 sh = d > 32u ? (d - 32u < 31u ? d - 32u : 31u) : 0u;
    const gc_u32 lo = (sig << sl) >> sh;
    const gc_u32 up = sr ? (gc_u32)(lo + r < lo) : (gc_u32)((lo > 0x80000000u) | ((lo == 0x80000000u) & hi));
    int ex = e - emin;
    ex = ex > 0 ? ex : 0;
    return hi + up + ((gc_u32)ex << mant);
}

// element code of fp32(x * mult), clipped to the element max, rounded
GC_HD gc_u32 gc_qelem(float x, float mult, gc_u32 r, int ek, bool sr) {
    const gc_u32 u = gc_f2u(gc_mul(x, mult));
    gc_u32 a = u & 0x7FFFFFFFu;
    a = a < GC_EK_MAXB(ek) ? a : GC_EK_MAXB(ek);
    return gc_qmag(a, r, GC_EK_M(ek), GC_EK_EMIN(ek), sr) | ((u >> 31) << GC_EK_SBIT(ek));
}

GC_HD float gc_de2m1(gc_u32 c) {
    const gc_u32 m = c & 7u;
    const gc_u32 nb = (((m >> 1) + 126u) << 23) | ((m & 1u) << 22);
    const gc_u32 b = m < 2u ? (m ? 0x3F000000u : 0u) : nb;
    return gc_u2f(b | ((c & 8u) << 28));
}

GC_HD float gc_de8m0(gc_u32 c) { return gc_u2f(c == 0xFFu ? GC_F32_QNAN_BITS : (c ? c << 23 : 0x400000u)); }

GC_HD float gc_elem_f32(gc_u32 code, int ek) {
    return ek == GC_ELEM_E2M1 ? gc_de2m1(code) : (ek == GC_ELEM_E4M3 ? gc_e4m3::to_f32((gc_u8)code) : gc_e5m2::to_f32((gc_u8)code));
}

// MX scale from the block's amax bits: code (0xFF non-finite) and the encode multiplier 2^-s.
// rule GC_RULE_FLOOR (OCP MX v1.0): max(E - emax, 0), E the biased float32 exponent of amax;
// GC_RULE_CEIL: one more where amax's mantissa field exceeds the element max's, so amax / scale <= max,
// except in the top float32 binade (m >= 0x7F000000) (native/gc_scalar.h gc_e8m0_code, the same text)
GC_HD gc_u32 gc_mx_scale_code(gc_u32 m, int ek, int rule) {
    if (m >= GC_F32_INF_BITS) return 0xFFu;
    const gc_u32 e = (m >> 23) + (gc_u32)(rule == GC_RULE_CEIL && (m & 0x7FFFFFu) > GC_ELEM_MAXMANT(ek) && m < 0x7F000000u);
    return e > GC_EK_EMAX(ek) ? e - GC_EK_EMAX(ek) : 0u;
}
GC_HD float gc_mx_mult(gc_u32 code) { return gc_u2f((254u - (code == 0xFFu ? 254u : code)) << 23); }

// decoded MX value (canonical NaN for a non-finite block)
GC_HD float gc_mx_value(gc_u32 code, gc_u32 scode, int ek) {
    if (scode == 0xFFu) return gc_u2f(GC_F32_QNAN_BITS);
    return gc_mul(gc_elem_f32(code, ek), gc_de8m0(scode));
}

// nvfp4 group rule from the largest finite block amax g (bits): s2 (written) and q2
struct gc_nv_group {
    float s2, q2;
    bool tiny;
    static GC_HD gc_nv_group from_bits(gc_u32 g) {
        gc_nv_group r;
        const float gf = gc_u2f(g);
        r.tiny = g < 0x0D800000u;  // gf < 2^-100 (g: non-negative bits; an integer compare: no -ftz effect)
        r.s2 = r.tiny ? 1.0f : gc_div(gf, 2688.0f);
        r.q2 = r.tiny ? 0.0f : gc_div(448.0f, gf);
        return r;
    }
};

// nvfp4 block scale code and encode multiplier r from the block's amax bits m
GC_HD gc_u32 gc_nv_block(gc_u32 m, const gc_nv_group& g, float* r) {
    *r = 0.0f;
    if (m >= GC_F32_INF_BITS) return 0x7Fu;
    if (g.tiny || m == 0) return 0u;
    float t = gc_mul(gc_u2f(m), g.q2);
    t = gc_f2u(t) < 0x43E00000u ? t : 448.0f;  // min(t, 448) on the bits of t >= 0 (no min.ftz)
    gc_u32 bs = gc_f32_to_fp8_sat_portable<3, 7, 0x7Eu>(t);
    bs += gc_f2u(gc_e4m3::to_f32((gc_u8)bs)) < gc_f2u(t) ? 1u : 0u;  // both >= 0: bits order like values
    bs = bs ? bs : 1u;
    *r = gc_div(1.0f, gc_mul(gc_e4m3::to_f32((gc_u8)bs), g.s2));
    return bs;
}

// decoded nvfp4 value from its E2M1 code, block scale code and group scale
GC_HD float gc_nv_value(gc_u32 code, gc_u32 bs, float s2) {
    if ((bs & 0x7Fu) == 0x7Fu) return gc_u2f(GC_F32_QNAN_BITS);
    return gc_mul(gc_de2m1(code), gc_mul(gc_e4m3::to_f32((gc_u8)bs), s2));
}

// e4m3/e5m2 stochastic element: y = clip(x * inv) rounded with bits r; NaN code for a non-finite block
template <class F>
GC_HD gc_u8 gc_sr8(float x, float inv, bool finite, gc_u32 r) {
    if (!finite) return F::NAN_CODE;
    return (gc_u8)gc_qelem(x, inv, r, F::EK, true);
}
