// gc_host_emu.cpp -- a serial CPU emulation of gc_codec.cu built from the very same scalar code
// (gc_fp8.cuh compiled as host C++: the portable FP8 conversion, the scale rule, the decode bit
// construction, the pass-through casts). tests/test_gpu_plumbing.py builds it with the host C++
// compiler (-ffp-contract=off) and checks it bit for bit against giftcomm.reference.codec.
// It emulates what each kernel computes per value and per block, not the kernels' parallel
// structure (teams, shuffles, vector loads), which only a GPU can run (tests/test_gpu.py).
// Format codes and facts: gc_formats.h (generated from giftcomm/formats.py; found with -Inative).
// `fmt` arguments are variant codes (giftcomm.formats.Format.variant_code).
#include "gc_formats.h"
#include "gc_fp8.cuh"
#include "gc_mx.cuh"

template <class F>
static void enc_block(const float* v, long long n, gc_u8* pout, float* sout) {
    gc_u32 m = 0;
    for (long long i = 0; i < n; ++i) m = gc_umax(m, gc_abs_bits(v[i]));
    const gc_scale<F> s = gc_scale<F>::from_amax_bits(m);
    for (long long i = 0; i < n; ++i) pout[i] = s.quantize(v[i]);
    *sout = s.scale;
}

static long long align4(long long n) { return (n + 3) / 4 * 4; }

template <class F>
static void encode_t(const float* x, long long n, int block, gc_u8* msg) {
    float* scales = reinterpret_cast<float*>(msg + align4(n));
    for (long long i = n; i < align4(n); ++i) msg[i] = 0;
    for (long long b = 0; b * block < n; ++b) {
        const long long lo = b * block, cnt = (n - lo < block) ? n - lo : block;
        enc_block<F>(x + lo, cnt, msg + lo, scales + b);
    }
}

template <class F>
static void decode_t(const gc_u8* msg, long long n, int block, float* out, int acc) {
    const float* scales = reinterpret_cast<const float*>(msg + align4(n));
    for (long long i = 0; i < n; ++i) {
        const float v = gc_mul(F::to_f32(msg[i]), scales[i / block]);
        out[i] = acc ? gc_add(out[i], v) : v;
    }
}

template <class F>
static void dae_t(const gc_u8* min, const float* local, long long n, int block, gc_u8* mout, float* sum_out) {
    const float* sin = reinterpret_cast<const float*>(min + align4(n));
    float* tmp = new float[n > 0 ? n : 1];
    for (long long i = 0; i < n; ++i) tmp[i] = gc_add(gc_mul(F::to_f32(min[i]), sin[i / block]), local[i]);
    if (sum_out)
        for (long long i = 0; i < n; ++i) sum_out[i] = tmp[i];
    encode_t<F>(tmp, n, block, mout);
    delete[] tmp;
}

template <class P>
static void pt_t(int op, const float* x, const gc_u16* win, gc_u16* wout, float* out, long long n) {
    for (long long i = 0; i < n; ++i) {
        if (op == 0) wout[i] = P::from_f32(x[i]);
        else if (op == 1) out[i] = P::to_f32(win[i]);
        else if (op == 2) out[i] = gc_add(out[i], P::to_f32(win[i]));
        else {
            const float s = gc_add(P::to_f32(win[i]), x[i]);
            wout[i] = P::from_f32(s);
            if (out) out[i] = s;
        }
    }
}

// fp32 pass-through (what gc_pt_fp32 computes per value; ops 0/1 are the host's device copies)
static void pt_f32(int op, const float* x, const float* win, float* wout, float* out, long long n) {
    for (long long i = 0; i < n; ++i) {
        if (op == 0) wout[i] = x[i];
        else if (op == 1) out[i] = win[i];
        else if (op == 2) out[i] = gc_add(out[i], win[i]);
        else {
            const float s = gc_add(win[i], x[i]);
            wout[i] = s;
            if (out) out[i] = s;
        }
    }
}

// ---- stochastic e4m3/e5m2 (what gc_{enc,dae}_big_sr_F compute per value) ----
template <class F>
static void sr8_t(const float* x, long long n, int block, gc_u8* msg, gc_u64 key, gc_u64 off) {
    float* scales = reinterpret_cast<float*>(msg + align4(n));
    for (long long i = n; i < align4(n); ++i) msg[i] = 0;
    for (long long b = 0; b * block < n; ++b) {
        const long long lo = b * block, cnt = (n - lo < block) ? n - lo : block;
        gc_u32 m = 0;
        for (long long i = 0; i < cnt; ++i) m = gc_umax(m, gc_abs_bits(x[lo + i]));
        const gc_scale<F> s = gc_scale<F>::from_amax_bits(m);
        for (long long i = 0; i < cnt; ++i)
            msg[lo + i] = gc_sr8<F>(x[lo + i], s.inv, s.finite, gc_rbits(key, off + (gc_u64)(lo + i)));
        scales[b] = s.scale;
    }
}

// ---- MX formats and nvfp4 (what gc_mx_enc_F / gc_mx_dec_F compute per block, group, value) ----
static int mx_ek(int fmt) { return GC_FMT_ELEM(GC_VARIANT_FORMAT(fmt)); }
static bool mx_packed(int fmt) { return GC_FMT_VALUE_BITS(GC_VARIANT_FORMAT(fmt)) == 4; }
static bool mx_nv(int fmt) { return GC_VARIANT_FORMAT(fmt) == GC_NVFP4; }
static bool mx_known(int fmt) {
    const int s = GC_FMT_SCALE(GC_VARIANT_FORMAT(fmt)), rule = GC_VARIANT_RULE(fmt);
    return (s == GC_SCALE_E8M0 && (rule == GC_RULE_CEIL || rule == GC_RULE_FLOOR)) || (s == GC_SCALE_NVFP4 && rule == 0);
}

struct mx_layout {
    gc_u8* pay;
    gc_u8* sc;
    float* gs;
};

static mx_layout mx_parts(int fmt, gc_u8* msg, long long n) {
    const long long pb = mx_packed(fmt) ? (n + 1) / 2 : n;
    mx_layout l{msg, msg + pb, 0};
    if (mx_nv(fmt)) {
        const long long nb = (n + 15) / 16;
        const long long goff = align4(pb + nb);
        for (long long i = pb + nb; i < goff; ++i) msg[i] = 0;
        l.gs = reinterpret_cast<float*>(msg + goff);
    }
    return l;
}

static void mx_encode_vals(int fmt, const float* v, long long n, gc_u8* msg, int sr, gc_u64 key, gc_u64 off) {
    const int ek = mx_ek(fmt);
    const mx_layout l = mx_parts(fmt, msg, n);
    gc_u8* codes = new gc_u8[n > 0 ? n : 1];
    if (mx_nv(fmt)) {
        for (long long g = 0; g * 1024 < n; ++g) {
            const long long g0 = g * 1024, gend = (n - g0 < 1024) ? n : g0 + 1024;
            gc_u32 f = 0;
            for (long long b0 = g0; b0 < gend; b0 += 16) {
                gc_u32 m = 0;
                for (long long i = b0; i < b0 + 16 && i < gend; ++i) m = gc_umax(m, gc_abs_bits(v[i]));
                f = gc_umax(f, m < GC_F32_INF_BITS ? m : 0u);
            }
            const gc_nv_group grp = gc_nv_group::from_bits(f);
            for (long long b0 = g0; b0 < gend; b0 += 16) {
                gc_u32 m = 0;
                for (long long i = b0; i < b0 + 16 && i < gend; ++i) m = gc_umax(m, gc_abs_bits(v[i]));
                float r;
                const gc_u32 bs = gc_nv_block(m, grp, &r);
                l.sc[b0 / 16] = (gc_u8)bs;
                for (long long i = b0; i < b0 + 16 && i < gend; ++i)
                    codes[i] = bs == 0x7Fu ? 0 : (gc_u8)gc_qelem(v[i], r, sr ? gc_rbits(key, off + (gc_u64)i) : 0u, GC_NVFP4_ELEM, sr != 0);
            }
            l.gs[g] = grp.s2;
        }
    } else {
        for (long long b0 = 0; b0 < n; b0 += 32) {
            const long long end = (n - b0 < 32) ? n : b0 + 32;
            gc_u32 m = 0;
            for (long long i = b0; i < end; ++i) m = gc_umax(m, gc_abs_bits(v[i]));
            const gc_u32 scode = gc_mx_scale_code(m, ek, GC_VARIANT_RULE(fmt));
            l.sc[b0 / 32] = (gc_u8)scode;
            for (long long i = b0; i < end; ++i)
                codes[i] = scode == 0xFFu ? (gc_u8)GC_EK_NAN(ek)
                                          : (gc_u8)gc_qelem(v[i], gc_mx_mult(scode), sr ? gc_rbits(key, off + (gc_u64)i) : 0u,
                                                            ek, sr != 0);
        }
    }
    if (ek == GC_ELEM_E2M1) {
        for (long long i = 0; i < n; i += 2)
            l.pay[i / 2] = (gc_u8)((codes[i] & 0xFu) | ((i + 1 < n ? codes[i + 1] & 0xFu : 0u) << 4));
    } else {
        for (long long i = 0; i < n; ++i) l.pay[i] = codes[i];
    }
    delete[] codes;
}

static float mx_value(int fmt, const gc_u8* msg, long long n, long long i) {
    const int ek = mx_ek(fmt);
    const long long pb = mx_packed(fmt) ? (n + 1) / 2 : n;
    const gc_u32 code = ek == GC_ELEM_E2M1 ? (gc_u32)((msg[i >> 1] >> (4 * (int)(i & 1))) & 0xFu) : (gc_u32)msg[i];
    if (mx_nv(fmt)) {
        const float* gs = reinterpret_cast<const float*>(msg + align4(pb + (n + 15) / 16));
        return gc_nv_value(code, msg[pb + i / 16], gs[i / 1024]);
    }
    return gc_mx_value(code, msg[pb + i / 32], ek);
}

extern "C" {
// MX formats and nvfp4 (variant codes of GC_NVFP4, GC_MXFP4, GC_MXFP8, GC_MXFP8_E5M2); sr: 0 nearest, 1 stochastic
int gc_emu_mx_encode(int fmt, const float* x, long long n, gc_u8* msg, int sr, gc_u64 key, gc_u64 off) {
    if (!mx_known(fmt)) return -1;
    mx_encode_vals(fmt, x, n, msg, sr, key, off);
    return 0;
}

int gc_emu_mx_decode(int fmt, const gc_u8* msg, long long n, float* out, int acc) {
    if (!mx_known(fmt)) return -1;
    for (long long i = 0; i < n; ++i) {
        const float v = mx_value(fmt, msg, n, i);
        out[i] = acc ? gc_add(out[i], v) : v;
    }
    return 0;
}

int gc_emu_mx_dae(int fmt, const gc_u8* min, const float* local, long long n, gc_u8* mout, float* sum_out, int sr,
                  gc_u64 key, gc_u64 off) {
    if (!mx_known(fmt)) return -1;
    float* tmp = new float[n > 0 ? n : 1];
    for (long long i = 0; i < n; ++i) tmp[i] = gc_add(mx_value(fmt, min, n, i), local[i]);
    if (sum_out)
        for (long long i = 0; i < n; ++i) sum_out[i] = tmp[i];
    mx_encode_vals(fmt, tmp, n, mout, sr, key, off);
    delete[] tmp;
    return 0;
}

// stochastic e4m3 / e5m2: encode, and decode-add-encode
// The FP8 rows with float32 scales: GC_F32_ROWS of gc_formats.h (element type gc_<name>), one
// `if (fmt == GC_<NAME>) ...; else` branch per row.
int gc_emu_sr8_encode(int fmt, const float* x, long long n, int block, gc_u8* msg, gc_u64 key, gc_u64 off) {
#define GC_EMU_SR8(N, L) if (fmt == GC_##N) sr8_t<gc_##L>(x, n, block, msg, key, off); else
    GC_F32_ROWS(GC_EMU_SR8) return -1;
    return 0;
}

int gc_emu_sr8_dae(int fmt, const gc_u8* min, const float* local, long long n, int block, gc_u8* mout, float* sum_out,
                   gc_u64 key, gc_u64 off) {
#define GC_EMU_IS8(N, L) fmt != GC_##N &&
    if (GC_F32_ROWS(GC_EMU_IS8) true) return -1;
    const float* sin = reinterpret_cast<const float*>(min + align4(n));
    float* tmp = new float[n > 0 ? n : 1];
    for (long long i = 0; i < n; ++i) {
#define GC_EMU_VAL8(N, L) fmt == GC_##N ? gc_##L::to_f32(min[i]) :
        const float d = GC_F32_ROWS(GC_EMU_VAL8) 0.0f;
        tmp[i] = gc_add(gc_mul(d, sin[i / block]), local[i]);
    }
    if (sum_out)
        for (long long i = 0; i < n; ++i) sum_out[i] = tmp[i];
    gc_emu_sr8_encode(fmt, tmp, n, block, mout, key, off);
    delete[] tmp;
    return 0;
}

// e4m3, e5m2 and the pass-through formats (codes: gc_formats.h). Return 0, or -1 for another code.
int gc_emu_encode(int fmt, const float* x, long long n, int block, gc_u8* msg) {
#define GC_EMU_ENC8(N, L) if (fmt == GC_##N) encode_t<gc_##L>(x, n, block, msg); else
    GC_F32_ROWS(GC_EMU_ENC8) if (fmt == GC_BF16) pt_t<gc_bf16>(0, x, 0, reinterpret_cast<gc_u16*>(msg), 0, n);
    else if (fmt == GC_FP16) pt_t<gc_fp16>(0, x, 0, reinterpret_cast<gc_u16*>(msg), 0, n);
    else if (fmt == GC_FP32) pt_f32(0, x, 0, reinterpret_cast<float*>(msg), 0, n);
    else return -1;
    return 0;
}

int gc_emu_decode(int fmt, const gc_u8* msg, long long n, int block, float* out, int acc) {
#define GC_EMU_DEC8(N, L) if (fmt == GC_##N) decode_t<gc_##L>(msg, n, block, out, acc); else
    GC_F32_ROWS(GC_EMU_DEC8) if (fmt == GC_BF16) pt_t<gc_bf16>(acc ? 2 : 1, 0, reinterpret_cast<const gc_u16*>(msg), 0, out, n);
    else if (fmt == GC_FP16) pt_t<gc_fp16>(acc ? 2 : 1, 0, reinterpret_cast<const gc_u16*>(msg), 0, out, n);
    else if (fmt == GC_FP32) pt_f32(acc ? 2 : 1, 0, reinterpret_cast<const float*>(msg), 0, out, n);
    else return -1;
    return 0;
}

int gc_emu_dae(int fmt, const gc_u8* min, const float* local, long long n, int block, gc_u8* mout, float* sum_out) {
#define GC_EMU_DAE8(N, L) if (fmt == GC_##N) dae_t<gc_##L>(min, local, n, block, mout, sum_out); else
    GC_F32_ROWS(GC_EMU_DAE8) if (fmt == GC_BF16) pt_t<gc_bf16>(3, local, reinterpret_cast<const gc_u16*>(min), reinterpret_cast<gc_u16*>(mout), sum_out, n);
    else if (fmt == GC_FP16) pt_t<gc_fp16>(3, local, reinterpret_cast<const gc_u16*>(min), reinterpret_cast<gc_u16*>(mout), sum_out, n);
    else if (fmt == GC_FP32) pt_f32(3, local, reinterpret_cast<const float*>(min), reinterpret_cast<float*>(mout), sum_out, n);
    else return -1;
    return 0;
}

// The portable float32 -> FP8 conversion alone, on values already within [-max, max].
int gc_emu_fp8_cast(int fmt, const float* v, long long n, gc_u8* out) {
    for (long long i = 0; i < n; ++i) {
#define GC_EMU_CAST8(N, L) if (fmt == GC_##N) out[i] = gc_##L::from_f32(v[i]); else
        GC_F32_ROWS(GC_EMU_CAST8) return -1;
    }
    return 0;
}
}
