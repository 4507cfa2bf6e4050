// gc_host_emu.cpp -- a serial CPU emulation of gc_codec.cu built from the very same scalar code
// (gc_fp8.cuh compiled as host C++: the portable FP8 conversion, the scale rule, the decode bit
// construction, the pass-through casts). tests/test_gpu_plumbing.py builds it with the host C++
// compiler (-ffp-contract=off) and checks it bit for bit against giftcomm.reference.codec.
// It emulates what each kernel computes per value and per block, not the kernels' parallel
// structure (teams, shuffles, vector loads), which only a GPU can run (tests/test_gpu.py).
#include "gc_fp8.cuh"

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

extern "C" {
// fmt codes: giftcomm.formats (1 e4m3, 2 e5m2, 3 bf16, 4 fp16). Return 0, or -1 for a bad code.
int gc_emu_encode(int fmt, const float* x, long long n, int block, gc_u8* msg) {
    if (fmt == 1) encode_t<gc_e4m3>(x, n, block, msg);
    else if (fmt == 2) encode_t<gc_e5m2>(x, n, block, msg);
    else if (fmt == 3) pt_t<gc_bf16>(0, x, 0, reinterpret_cast<gc_u16*>(msg), 0, n);
    else if (fmt == 4) pt_t<gc_fp16>(0, x, 0, reinterpret_cast<gc_u16*>(msg), 0, n);
    else return -1;
    return 0;
}

int gc_emu_decode(int fmt, const gc_u8* msg, long long n, int block, float* out, int acc) {
    if (fmt == 1) decode_t<gc_e4m3>(msg, n, block, out, acc);
    else if (fmt == 2) decode_t<gc_e5m2>(msg, n, block, out, acc);
    else if (fmt == 3) pt_t<gc_bf16>(acc ? 2 : 1, 0, reinterpret_cast<const gc_u16*>(msg), 0, out, n);
    else if (fmt == 4) pt_t<gc_fp16>(acc ? 2 : 1, 0, reinterpret_cast<const gc_u16*>(msg), 0, out, n);
    else return -1;
    return 0;
}

int gc_emu_dae(int fmt, const gc_u8* min, const float* local, long long n, int block, gc_u8* mout, float* sum_out) {
    if (fmt == 1) dae_t<gc_e4m3>(min, local, n, block, mout, sum_out);
    else if (fmt == 2) dae_t<gc_e5m2>(min, local, n, block, mout, sum_out);
    else if (fmt == 3) pt_t<gc_bf16>(3, local, reinterpret_cast<const gc_u16*>(min), reinterpret_cast<gc_u16*>(mout), sum_out, n);
    else if (fmt == 4) pt_t<gc_fp16>(3, local, reinterpret_cast<const gc_u16*>(min), reinterpret_cast<gc_u16*>(mout), sum_out, n);
    else return -1;
    return 0;
}

// The portable float32 -> FP8 conversion alone, on values already within [-max, max].
int gc_emu_fp8_cast(int fmt, const float* v, long long n, gc_u8* out) {
    for (long long i = 0; i < n; ++i) {
        if (fmt == 1) out[i] = gc_e4m3::from_f32(v[i]);
        else if (fmt == 2) out[i] = gc_e5m2::from_f32(v[i]);
        else return -1;
    }
    return 0;
}
}
