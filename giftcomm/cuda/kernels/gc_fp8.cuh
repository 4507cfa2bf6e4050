// gc_fp8.cuh -- scalar building blocks of the giftcomm GPU codec.
//
// Everything here is one value at a time and compiles three ways:
//   * NVRTC (CuPy RawModule; no standard headers available),
//   * nvcc -ptx (native/check_cuda.sh),
//   * a plain host C++ compiler (gc_host_emu.cpp: the CPU emulation used by
//     tests/test_gpu_plumbing.py to check these rules against giftcomm.reference.codec).
//
// Definitions: giftcomm/reference/codec.py (bit for bit). Per scale block:
//   amax = max |x| (float32)
//   amax NaN/Inf            -> scale NaN (0x7FC00000), every code nan_code (0x7F)
//   amax < max * 2^-126     -> scale 1, inv 1
//   else                    -> scale = fp32(amax / max), inv = fp32(max / amax)   (IEEE division)
//   code = float8(clip(fp32(x * inv), -max, max))   round to nearest even, saturating
//   decode = fp32(float32(code) * scale)
// All float arithmetic goes through gc_mul / gc_div / gc_add, which on the device are inline PTX
// `mul.rn.f32` / `div.rn.f32` / `add.rn.f32` WITHOUT the .ftz modifier: correctly rounded, never
// contracted into an FMA, and keeping float32 subnormals whatever the compiler's -ftz flag says
// (CuPy compiles its own elementwise kernels with -ftz=true and recent versions append it to
// RawModule options; the intrinsics __fadd_rn/__fmul_rn would follow that flag
// and become add.rn.ftz.f32). tests/test_gpu_plumbing.py compiles this with nvcc -ftz=true and
// checks the PTX has no .ftz on any add/mul/div. The loader still asks NVRTC for --ftz=false.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define GC_HD __host__ __device__ __forceinline__
#define GC_DEV __device__ __forceinline__
#else
#include <string.h>
#define GC_HD inline
#define GC_DEV inline
#endif

typedef unsigned int gc_u32;
typedef unsigned short gc_u16;
typedef unsigned char gc_u8;

// ---------------------------------------------------------------- bit casts and IEEE ops
GC_HD gc_u32 gc_f2u(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    gc_u32 u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

GC_HD float gc_u2f(gc_u32 u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

// Correctly rounded (round to nearest even) float32 multiply, divide, add: never contracted, never
// flushed to zero (explicit non-.ftz PTX on the device; see the header comment).
GC_HD float gc_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));  // no .ftz: subnormals kept
    return r;
#else
    volatile float r = a * b;
    return r;
#endif
}

GC_HD float gc_div(float a, float b) {
#if defined(__CUDA_ARCH__)
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));  // no .ftz: subnormals kept
    return r;
#else
    volatile float r = a / b;
    return r;
#endif
}

GC_HD float gc_add(float a, float b) {
#if defined(__CUDA_ARCH__)
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));  // no .ftz: subnormals kept
    return r;
#else
    volatile float r = a + b;
    return r;
#endif
}

// float32 -> float64 (exact) and float64 -> float32 (round to nearest even), never flushing a
// float32 subnormal (explicit non-.ftz cvt on the device; see the header comment).
GC_HD double gc_f32_to_f64(float a) {
#if defined(__CUDA_ARCH__)
    double r;
    asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(a));  // no .ftz: a subnormal a is kept
    return r;
#else
    return (double)a;
#endif
}

GC_HD float gc_f64_to_f32(double a) {
#if defined(__CUDA_ARCH__)
    float r;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(a));  // no .ftz: a subnormal result is kept
    return r;
#else
    volatile float r = (float)a;
    return r;
#endif
}

// np.clip(v, -m, m) for a finite m > 0; keeps -0 and NaN. Compares bit patterns (integers), so no
// float compare or min/max instruction can flush a subnormal v under -ftz=true.
GC_HD float gc_clip(float v, float m) {
    const gc_u32 u = gc_f2u(v), a = u & 0x7FFFFFFFu, mb = gc_f2u(m);
    return (a > mb && a <= 0x7F800000u) ? gc_u2f((u & 0x80000000u) | mb) : v;
}

// Round a non-negative float32 to the nearest integer, ties to even (exact for the small values
// it is used on: at most 8 here).
GC_HD int gc_rint_small(float q) {
#if defined(__CUDA_ARCH__)
    int r;
    asm("cvt.rni.s32.f32 %0, %1;" : "=r"(r) : "f"(q));  // no .ftz (a subnormal q rounds to 0 anyway)
    return r;
#else
    int i = (int)q;            // truncation: q >= 0
    float frac = q - (float)i; // exact: q < 2^23
    if (frac > 0.5f || (frac == 0.5f && (i & 1))) ++i;
    return i;
#endif
}

#define GC_F32_INF_BITS 0x7F800000u
#define GC_F32_QNAN_BITS 0x7FC00000u
#define GC_TWO_M126 1.1754943508222875e-38f  // 2^-126, exact in float32

// ---------------------------------------------------------------- FP8 formats
// Portable float32 -> FP8 conversion for |v| <= max (the value is clipped before): round to
// nearest even, saturating to max. MANT = mantissa bits, BIAS = exponent bias, MAXCODE = the
// code of the largest finite value. Normal results come from rounding the float32 bit pattern;
// subnormal results (|v| < 2^(1-BIAS)) from rounding |v| / 2^(1-BIAS-MANT) to an integer, which
// is exact (multiplication by a power of two) and lands on the first normal code when it rounds
// up to 2^MANT.
template <int MANT, int BIAS, gc_u32 MAXCODE>
GC_HD gc_u8 gc_f32_to_fp8_sat_portable(float v) {
    const gc_u32 u = gc_f2u(v);
    const gc_u32 sign = (u >> 24) & 0x80u;
    const gc_u32 a = u & 0x7FFFFFFFu;
    const gc_u32 min_normal_bits = (gc_u32)(127 + 1 - BIAS) << 23;
    gc_u32 code;
    if (a >= min_normal_bits) {
        const int drop = 23 - MANT;
        const gc_u32 r = (a + ((1u << (drop - 1)) - 1u) + ((a >> drop) & 1u)) >> drop;
        code = r - ((gc_u32)(127 - BIAS) << MANT);
        if (code > MAXCODE) code = MAXCODE;
    } else {
        // |v| * 2^(BIAS - 1 + MANT): the value in units of the smallest subnormal.
        const float unit_inv = gc_u2f((gc_u32)(127 + BIAS - 1 + MANT) << 23);
        code = (gc_u32)gc_rint_small(gc_mul(gc_u2f(a), unit_inv));
    }
    return (gc_u8)(sign | code);
}

struct gc_e4m3 {
    static constexpr int MANT = 3, EMIN = -6, EK = 0;  // mantissa bits, smallest normal 2^EMIN
    static constexpr float MAX = 448.0f;
    static constexpr gc_u8 NAN_CODE = 0x7F;
    static constexpr int CODE = 1;

    // float32 (already clipped to [-448, 448]) -> e4m3fn code, RNE, saturating.
    static GC_HD gc_u8 from_f32(float v) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
        unsigned short r;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
        return (gc_u8)(r & 0xFFu);
#else
        return gc_f32_to_fp8_sat_portable<3, 7, 0x7Eu>(v);
#endif
    }

    // e4m3fn code -> float32, exact (bit construction). 0x7F / 0xFF are NaN.
    static GC_HD float to_f32(gc_u8 c) {
        const gc_u32 sign = (gc_u32)(c & 0x80u) << 24;
        const gc_u32 e = (c >> 3) & 0xFu;
        const gc_u32 m = c & 0x7u;
        if ((c & 0x7Fu) == 0x7Fu) return gc_u2f(sign | GC_F32_QNAN_BITS);
        if (e == 0) {  // subnormal: m * 2^-9, exact
            return gc_u2f(sign | gc_f2u(gc_mul((float)m, 0.001953125f)));
        }
        return gc_u2f(sign | ((e + 120u) << 23) | (m << 20));
    }
};

struct gc_e5m2 {
    static constexpr int MANT = 2, EMIN = -14, EK = 1;
    static constexpr float MAX = 57344.0f;
    static constexpr gc_u8 NAN_CODE = 0x7F;
    static constexpr int CODE = 2;

    static GC_HD gc_u8 from_f32(float v) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
        unsigned short r;
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
        return (gc_u8)(r & 0xFFu);
#else
        return gc_f32_to_fp8_sat_portable<2, 15, 0x7Bu>(v);
#endif
    }

    // e5m2 code -> float32, exact: e5m2 is the high byte of an IEEE binary16.
    static GC_HD float to_f32(gc_u8 c) {
        const gc_u32 sign = (gc_u32)(c & 0x80u) << 24;
        const gc_u32 e = (c >> 2) & 0x1Fu;
        const gc_u32 m = c & 0x3u;
        if (e == 0x1Fu) return gc_u2f(sign | (m ? GC_F32_QNAN_BITS : GC_F32_INF_BITS));
        if (e == 0) {  // subnormal: m * 2^-16, exact
            return gc_u2f(sign | gc_f2u(gc_mul((float)m, 1.52587890625e-05f)));
        }
        return gc_u2f(sign | ((e + 112u) << 23) | (m << 21));
    }
};

// Per-block scale rule. amax_bits: max over the block of (bits(x) & 0x7FFFFFFF), compared as
// unsigned integers, which orders non-negative floats like their values and puts NaN above Inf.
template <class F>
struct gc_scale {
    float scale;  // written to the wire
    float inv;    // what the values are multiplied by
    bool finite;

    static GC_HD gc_scale from_amax_bits(gc_u32 amax_bits) {
        gc_scale s;
        if (amax_bits >= GC_F32_INF_BITS) {
            s.scale = gc_u2f(GC_F32_QNAN_BITS);
            s.inv = 1.0f;
            s.finite = false;
            return s;
        }
        const float amax = gc_u2f(amax_bits);
        s.finite = true;
        if (amax_bits < gc_f2u(F::MAX * GC_TWO_M126)) {  // amax < max * 2^-126 (bits: no float compare)
            s.scale = 1.0f;
            s.inv = 1.0f;
        } else {
            s.scale = gc_div(amax, F::MAX);
            s.inv = gc_div(F::MAX, amax);
        }
        return s;
    }

    GC_HD gc_u8 quantize(float x) const {
        if (!finite) return F::NAN_CODE;
        return F::from_f32(gc_clip(gc_mul(x, inv), F::MAX));
    }
};

GC_HD gc_u32 gc_abs_bits(float x) { return gc_f2u(x) & 0x7FFFFFFFu; }
GC_HD gc_u32 gc_umax(gc_u32 a, gc_u32 b) { return a > b ? a : b; }

// ---------------------------------------------------------------- pass-through formats
// bfloat16: RNE on the bit pattern (overflow goes to Inf like IEEE); NaN -> quiet NaN, sign kept.
struct gc_bf16 {
    static constexpr int CODE = 3;
    typedef gc_u16 storage;
    static GC_HD gc_u16 from_f32(float v) {
        const gc_u32 u = gc_f2u(v);
        if ((u & 0x7FFFFFFFu) > GC_F32_INF_BITS) return (gc_u16)(((u >> 16) & 0x8000u) | 0x7FC0u);
        return (gc_u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
    static GC_HD float to_f32(gc_u16 h) { return gc_u2f((gc_u32)h << 16); }
};

// IEEE binary16: hardware cvt on the device; the same rounding in software on the host.
struct gc_fp16 {
    static constexpr int CODE = 4;
    typedef gc_u16 storage;
    static GC_HD gc_u16 from_f32(float v) {
#if defined(__CUDA_ARCH__)
        unsigned short r;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
        return r;
#else
        const gc_u32 u = gc_f2u(v);
        const gc_u32 sign = (u >> 16) & 0x8000u;
        const gc_u32 a = u & 0x7FFFFFFFu;
        if (a > GC_F32_INF_BITS) return (gc_u16)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
        if (a >= 0x477FF000u) return (gc_u16)(sign | 0x7C00u);  // rounds to >= 65520: Inf
        if (a >= 0x38800000u) {                                 // normal half (>= 2^-14)
            const gc_u32 r = (a + 0xFFFu + ((a >> 13) & 1u)) >> 13;
            return (gc_u16)(sign | (r - (112u << 10)));
        }
        // subnormal half: |v| / 2^-24 rounded to nearest even (may reach 0x400, the min normal)
        const float q = gc_mul(gc_u2f(a), 16777216.0f);
        return (gc_u16)(sign | (gc_u32)gc_rint_small_big(q));
#endif
    }
#if !defined(__CUDA_ARCH__)
    static inline gc_u32 gc_rint_small_big(float q) {
        gc_u32 i = (gc_u32)q;
        float frac = q - (float)i;
        if (frac > 0.5f || (frac == 0.5f && (i & 1u))) ++i;
        return i;
    }
#endif
    static GC_HD float to_f32(gc_u16 h) {
#if defined(__CUDA_ARCH__)
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
#else
        const gc_u32 sign = (gc_u32)(h & 0x8000u) << 16;
        const gc_u32 e = (h >> 10) & 0x1Fu;
        const gc_u32 m = h & 0x3FFu;
        if (e == 0x1Fu) return gc_u2f(sign | GC_F32_INF_BITS | (m << 13) | (m ? 0x400000u : 0u));
        if (e == 0) return gc_u2f(sign | gc_f2u(gc_mul((float)m, 5.9604644775390625e-08f)));
        return gc_u2f(sign | ((e + 112u) << 23) | (m << 13));
#endif
    }
};
