// gc_fused.cu -- the GIFT low-rank transform fused into the e4m3/e5m2 codec (CuPy RawModule
// "fused", NVRTC). Host side: giftcomm/cuda/fused.py; host model of the same operation order:
// giftcomm/cuda/fused_model.py; design: docs/gpu.md "Fused transform".
//
// A low-rank / identity segment (m x n row-major at buffer offset `start`) is
//   Y = cc X + L1 U_R^T + U_L R2,   L1 = ldr * P,  R2 = rdl * Q + (dldr * W) U_R^T,
//   P = X U_R (m x kR),  Q = U_L^T X (kL x n),  W = U_L^T P (kL x kR).
// Segments of one shape group (same m, n, kL, kR; B of them) are batched; their parameters and
// products live in one float32 pool (row-major stacks):
//   ur (B, n, kR)  ul (B, m, kL)  ldr (B, kR)  rdl (B, kL)  dldr (B, kL, kR)
//   P (B, m, kR)   Q (B, kL, n)   Wd (B, kL, kR) = dldr * W   L1 (B, m, kR)   R2t (B, n, kL)
// The element kernels find the segment of buffer index e in a piece table: pstart (NP + 1
// sorted int64 starts, pstart[NP] = N) and per piece 8 int64 `rec`: [start, n, kL, kR, o_L1,
// o_UR, o_UL, o_R2t] (pool offsets of the segment's own stacks); n == 0: identity piece (copy);
// `pcc` (NP float32): cc.
//
// Precision: every product and sum is gc_mul / gc_add (mul.rn / add.rn, no FMA, no .ftz) in an
// order fixed by the shapes alone (see each kernel), so every rank gets the same bits.

#include "gc_formats.h"
#include "gc_fp8.cuh"

#define GC_FZ_RT 8  // accumulators per thread (rank tile) in the projection kernels

// ---------------------------------------------------------------- value sources
// Value at buffer index e: a float32 buffer, or a block-scaled wire message covering [0, N).
struct gc_fz_f32 {
    const float* __restrict__ x;
    GC_DEV float at(long long e) const { return x[e]; }
};

// A wire: NM block-scaled messages back to back in `buf` (one message of all N values, or the
// ring allgather's slices of every chunk), each covering a range of whole scale blocks of the
// buffer. `mtab` (3 NM + 1 int64): the NM + 1 sorted element starts (mtab[NM] = N), then each
// message's payload byte offset in `buf`, then its scales' byte offset (4-byte aligned).
template <class F>
struct gc_fz_wire {
    const gc_u8* __restrict__ buf;
    const long long* __restrict__ mtab;
    int nm;
    int block;
    GC_DEV float at(long long e) const {
        int lo = 0, hi = nm;  // message lo with mtab[lo] <= e < mtab[lo + 1] (binary search)
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (mtab[mid] <= e) lo = mid; else hi = mid;
        }
        const long long off = e - mtab[lo];
        const float* sc = reinterpret_cast<const float*>(buf + mtab[2 * nm + 1 + lo]);
        return gc_mul(F::to_f32(buf[mtab[nm + 1 + lo] + off]), sc[off / block]);
    }
};

// ---------------------------------------------------------------- pass A: P = X U_R
// One warp per (segment b, row i); lane l sums j = l, l + 32, ... in order (GC_FZ_RT ranks at a
// time), then a fixed xor butterfly (offsets 16, 8, 4, 2, 1); lane 0 writes.
template <class SRC>
GC_DEV void gc_fz_proj_p(SRC src, const long long* __restrict__ starts, const float* __restrict__ ur,
                         float* __restrict__ P, int B, int m, int n, int kR) {
    const int lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < (long long)B * m; w += warps) {
        const long long b = w / m, i = w - b * m;
        const long long row = starts[b] + i * n;
        const float* u = ur + b * (long long)n * kR;
        for (int r0 = 0; r0 < kR; r0 += GC_FZ_RT) {
            float acc[GC_FZ_RT];
#pragma unroll
            for (int t = 0; t < GC_FZ_RT; ++t) acc[t] = 0.0f;
            for (int j = lane; j < n; j += 32) {
                const float v = src.at(row + j);
#pragma unroll
                for (int t = 0; t < GC_FZ_RT; ++t)
                    if (r0 + t < kR) acc[t] = gc_add(acc[t], gc_mul(v, u[(long long)j * kR + r0 + t]));
            }
#pragma unroll
            for (int t = 0; t < GC_FZ_RT; ++t)
                for (int o = 16; o > 0; o >>= 1) acc[t] = gc_add(acc[t], __shfl_xor_sync(0xFFFFFFFFu, acc[t], o));
            if (lane == 0)
#pragma unroll
                for (int t = 0; t < GC_FZ_RT; ++t)
                    if (r0 + t < kR) P[(b * m + i) * kR + r0 + t] = acc[t];
        }
    }
}

// ---------------------------------------------------------------- pass A: Q = U_L^T X
// One thread per (segment b, column j, rank tile); rows i = 0..m-1 summed in order (consecutive
// threads take consecutive columns: coalesced reads of X).
template <class SRC>
GC_DEV void gc_fz_proj_q(SRC src, const long long* __restrict__ starts, const float* __restrict__ ul,
                         float* __restrict__ Q, int B, int m, int n, int kL) {
    const int tiles = (kL + GC_FZ_RT - 1) / GC_FZ_RT;
    const long long total = (long long)B * tiles * n;
    for (long long t0 = (long long)blockIdx.x * blockDim.x + threadIdx.x; t0 < total; t0 += (long long)gridDim.x * blockDim.x) {
        const long long j = t0 % n, bt = t0 / n, b = bt / tiles;
        const int s0 = (int)(bt - b * tiles) * GC_FZ_RT;
        const float* u = ul + b * (long long)m * kL;
        float acc[GC_FZ_RT];
#pragma unroll
        for (int t = 0; t < GC_FZ_RT; ++t) acc[t] = 0.0f;
        for (int i = 0; i < m; ++i) {
            const float v = src.at(starts[b] + (long long)i * n + j);
#pragma unroll
            for (int t = 0; t < GC_FZ_RT; ++t)
                if (s0 + t < kL) acc[t] = gc_add(acc[t], gc_mul(u[(long long)i * kL + s0 + t], v));
        }
#pragma unroll
        for (int t = 0; t < GC_FZ_RT; ++t)
            if (s0 + t < kL) Q[(b * kL + s0 + t) * n + j] = acc[t];
    }
}

#define GC_FZ_PROJ_ARGS const long long* __restrict__ starts, const float* __restrict__ u, float* __restrict__ out, \
    int B, int m, int n, int k

extern "C" __global__ void __launch_bounds__(256) gc_fz_proj_p_f32(const float* __restrict__ x, GC_FZ_PROJ_ARGS) {
    gc_fz_proj_p(gc_fz_f32{x}, starts, u, out, B, m, n, k);
}
extern "C" __global__ void __launch_bounds__(256) gc_fz_proj_q_f32(const float* __restrict__ x, GC_FZ_PROJ_ARGS) {
    gc_fz_proj_q(gc_fz_f32{x}, starts, u, out, B, m, n, k);
}
#define GC_FZ_WIRE_PROJ(F, NAME)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256) gc_fz_proj_p_##NAME(const gc_u8* __restrict__ buf,              \
        const long long* __restrict__ mtab, int nm, int block, GC_FZ_PROJ_ARGS) {                                      \
        gc_fz_proj_p(gc_fz_wire<F>{buf, mtab, nm, block}, starts, u, out, B, m, n, k);                                  \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) gc_fz_proj_q_##NAME(const gc_u8* __restrict__ buf,              \
        const long long* __restrict__ mtab, int nm, int block, GC_FZ_PROJ_ARGS) {                                      \
        gc_fz_proj_q(gc_fz_wire<F>{buf, mtab, nm, block}, starts, u, out, B, m, n, k);                                  \
    }
// one set per FP8 row with float32 scales (GC_F32_ROWS of gc_formats.h; element type gc_<name>)
#define GC_FZ_ROW_WIRE_PROJ(N, L) GC_FZ_WIRE_PROJ(gc_##L, L)
GC_F32_ROWS(GC_FZ_ROW_WIRE_PROJ)

// ---------------------------------------------------------------- pass S: the small factors
// Items [0, B kL kR): Wd[b,s,r] = dldr[b,s,r] * (sum_i ul[b,i,s] P[b,i,r], i in order);
// items [B kL kR, B kL kR + B m kR): L1[b,i,r] = ldr[b,r] * P[b,i,r].
extern "C" __global__ void __launch_bounds__(256) gc_fz_small(const float* __restrict__ P, const float* __restrict__ ul,
    const float* __restrict__ ldr, const float* __restrict__ dldr, float* __restrict__ Wd, float* __restrict__ L1,
    int B, int m, int kL, int kR) {
    const long long nw = (long long)B * kL * kR, total = nw + (long long)B * m * kR;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += (long long)gridDim.x * blockDim.x) {
        if (t < nw) {
            const long long b = t / ((long long)kL * kR);
            const int s = (int)((t / kR) % kL), r = (int)(t % kR);
            float acc = 0.0f;
            for (int i = 0; i < m; ++i)
                acc = gc_add(acc, gc_mul(ul[(b * m + i) * kL + s], P[(b * m + i) * kR + r]));
            Wd[t] = gc_mul(dldr[t], acc);
        } else {
            const long long q = t - nw, b = q / ((long long)m * kR);
            L1[q] = gc_mul(ldr[b * kR + q % kR], P[q]);
        }
    }
}

// R2t[b,j,s] = rdl[b,s] * Q[b,s,j], then + Wd[b,s,r] * ur[b,j,r] for r = 0..kR-1 in order.
extern "C" __global__ void __launch_bounds__(256) gc_fz_r2(const float* __restrict__ Q, const float* __restrict__ ur,
    const float* __restrict__ rdl, const float* __restrict__ Wd, float* __restrict__ R2t, int B, int n, int kL, int kR) {
    const long long total = (long long)B * n * kL;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += (long long)gridDim.x * blockDim.x) {
        const int s = (int)(t % kL);
        const long long bj = t / kL, b = bj / n, j = bj - b * n;
        float acc = gc_mul(rdl[b * kL + s], Q[(b * kL + s) * n + j]);
        for (int r = 0; r < kR; ++r) acc = gc_add(acc, gc_mul(Wd[(b * kL + s) * kR + r], ur[(b * n + j) * kR + r]));
        R2t[t] = acc;
    }
}

// ---------------------------------------------------------------- the update of one element
struct gc_fz_table {
    const long long* __restrict__ pstart;  // NP + 1
    const long long* __restrict__ rec;     // NP x 8
    const float* __restrict__ pcc;         // NP
    const float* __restrict__ pool;
    int np;

    // piece p with pstart[p] <= e < pstart[p + 1] (binary search)
    GC_DEV int piece(long long e) const {
        int lo = 0, hi = np;
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (pstart[mid] <= e) lo = mid; else hi = mid;
        }
        return lo;
    }

    // y = cc x + (sum_r L1[i,r] U_R[j,r], r in order, then + U_L[i,s] R2t[j,s], s in order)
    GC_DEV float apply(long long e, float x) const {
        const int p = piece(e);
        const long long* r = rec + 8 * (long long)p;
        const long long n = r[1];
        if (n == 0) return x;
        const long long off = e - r[0], i = off / n, j = off - i * n;
        const int kL = (int)r[2], kR = (int)r[3];
        const float* l1 = pool + r[4] + i * kR;
        const float* urr = pool + r[5] + j * kR;
        const float* ull = pool + r[6] + i * kL;
        const float* r2 = pool + r[7] + j * kL;
        float acc = 0.0f;
        for (int t = 0; t < kR; ++t) acc = gc_add(acc, gc_mul(l1[t], urr[t]));
        for (int t = 0; t < kL; ++t) acc = gc_add(acc, gc_mul(ull[t], r2[t]));
        return gc_add(gc_mul(pcc[p], x), acc);
    }
};

#define GC_FZ_TABLE_ARGS const long long* __restrict__ pstart, const long long* __restrict__ rec, \
    const float* __restrict__ pcc, const float* __restrict__ pool, int np

// ---------------------------------------------------------------- fused encode
// Message of `count` values = Y[lo, lo + count) (MODE 0), or one ring hop (MODE 1): the incoming
// message's decoded values plus Y, summed in float32 (gc_codec.cu's decode-add-encode order:
// fp32(decode + local)). A team of G lanes per scale block (block <= 256, G*8 >= block), values
// in registers (scalar layout e = k G + lane), amax by xor shuffles in the team, gc_fp8.cuh's
// scale rule and rounding: the bytes of giftcomm.reference.encode of the same float32 values.
// y_out (may be NULL): the float32 values encoded.
template <class F, int MODE>
GC_DEV void gc_fz_enc(const float* __restrict__ x, long long lo, const gc_u8* __restrict__ pin, const float* __restrict__ sin,
                      gc_u8* __restrict__ pout, float* __restrict__ sout, float* __restrict__ y_out, long long count,
                      int block, long long nb, int G, int pad, gc_fz_table tab) {
    if (blockIdx.x == 0 && (int)threadIdx.x < pad) pout[count + threadIdx.x] = 0;
    const int tid = threadIdx.x, lane = tid & (G - 1), teams = blockDim.x / G;
    const gc_u32 wl = tid & 31;
    const gc_u32 mask = (G == 32) ? 0xFFFFFFFFu : (((1u << G) - 1u) << (wl & ~(gc_u32)(G - 1)));
    for (long long b = (long long)blockIdx.x * teams + tid / G; b < nb; b += (long long)gridDim.x * teams) {
        const long long base = b * (long long)block, left = count - base;
        const int n = left < block ? (int)left : block;
        float v[8];
        gc_u32 m = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int e = k * G + lane;
            float y = 0.0f;
            if (e < n) {
                const long long g = lo + base + e;
                y = tab.apply(g, x[g]);
                if (MODE == 1) y = gc_add(gc_mul(F::to_f32(pin[base + e]), sin[b]), y);
            }
            v[k] = y;
            m = gc_umax(m, gc_abs_bits(y));
        }
        for (int o = G >> 1; o > 0; o >>= 1) m = gc_umax(m, __shfl_xor_sync(mask, m, o, G));
        const gc_scale<F> s = gc_scale<F>::from_amax_bits(m);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int e = k * G + lane;
            if (e < n) {
                pout[base + e] = s.quantize(v[k]);
                if (y_out) y_out[base + e] = v[k];
            }
        }
        if (lane == 0) sout[b] = s.scale;
    }
}

// ---------------------------------------------------------------- fused fp32 pass-through
// The node-local ring of the hierarchical algorithms: the message is the float32 values themselves.
// MODE 0: out = Y[lo, lo + count); MODE 1 (a hop): out = in + Y, one float32 add (gc_pt_fp32's
// decode-add-encode: fp32(decode + local)). y_out (may be NULL): the values written.
template <int MODE>
GC_DEV void gc_fz_pt(const float* __restrict__ x, long long lo, const float* __restrict__ in, float* __restrict__ out,
                     float* __restrict__ y_out, long long count, gc_fz_table tab) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < count; e += (long long)gridDim.x * blockDim.x) {
        float y = tab.apply(lo + e, x[lo + e]);
        if (MODE == 1) y = gc_add(in[e], y);
        out[e] = y;
        if (y_out) y_out[e] = y;
    }
}

extern "C" __global__ void __launch_bounds__(256) gc_fz_enc_fp32(const float* __restrict__ x, long long lo,
    float* __restrict__ out, float* __restrict__ y_out, long long count, GC_FZ_TABLE_ARGS) {
    gc_fz_pt<0>(x, lo, 0, out, y_out, count, gc_fz_table{pstart, rec, pcc, pool, np});
}
extern "C" __global__ void __launch_bounds__(256) gc_fz_dae_fp32(const float* __restrict__ x, long long lo,
    const float* __restrict__ in, float* __restrict__ out, float* __restrict__ y_out, long long count,
    GC_FZ_TABLE_ARGS) {
    gc_fz_pt<1>(x, lo, in, out, y_out, count, gc_fz_table{pstart, rec, pcc, pool, np});
}

// ---------------------------------------------------------------- fused inverse decode / apply
// out[e] = cc z + update at buffer index lo + e (z: the decoded wire value, or x[lo + e]); avg
// (has_div): then / div (gc_div, the order of giftcomm's unfused path: inverse, then op="avg").
// Elementwise.
template <class SRC>
GC_DEV void gc_fz_apply(SRC src, float* __restrict__ out, long long lo, long long count, float div, int has_div,
                        gc_fz_table tab) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < count; e += (long long)gridDim.x * blockDim.x) {
        float y = tab.apply(lo + e, src.at(lo + e));
        if (has_div) y = gc_div(y, div);
        out[e] = y;
    }
}

extern "C" __global__ void __launch_bounds__(256) gc_fz_apply_f32(const float* __restrict__ x, float* __restrict__ out,
    long long lo, long long count, float div, int has_div, GC_FZ_TABLE_ARGS) {
    gc_fz_apply(gc_fz_f32{x}, out, lo, count, div, has_div, gc_fz_table{pstart, rec, pcc, pool, np});
}

#define GC_FZ_CODEC_ENTRIES(F, NAME)                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) gc_fz_enc_##NAME(const float* __restrict__ x, long long lo,     \
        gc_u8* __restrict__ pout, float* __restrict__ sout, float* __restrict__ y_out, long long count, int block,   \
        long long nb, int G, int pad, GC_FZ_TABLE_ARGS) {                                                              \
        gc_fz_enc<F, 0>(x, lo, 0, 0, pout, sout, y_out, count, block, nb, G, pad,                                     \
                        gc_fz_table{pstart, rec, pcc, pool, np});                                                      \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) gc_fz_dae_##NAME(const float* __restrict__ x, long long lo,     \
        const gc_u8* __restrict__ pin, const float* __restrict__ sin, gc_u8* __restrict__ pout,                       \
        float* __restrict__ sout, float* __restrict__ y_out, long long count, int block, long long nb, int G,         \
        int pad, GC_FZ_TABLE_ARGS) {                                                                                   \
        gc_fz_enc<F, 1>(x, lo, pin, sin, pout, sout, y_out, count, block, nb, G, pad,                                 \
                        gc_fz_table{pstart, rec, pcc, pool, np});                                                      \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) gc_fz_dec_##NAME(const gc_u8* __restrict__ buf,                 \
        const long long* __restrict__ mtab, int nm, int block, float* __restrict__ out, long long count, float div,   \
        int has_div, GC_FZ_TABLE_ARGS) {                                                                               \
        gc_fz_apply(gc_fz_wire<F>{buf, mtab, nm, block}, out, 0, count, div, has_div,                                 \
                    gc_fz_table{pstart, rec, pcc, pool, np});                                                          \
    }
#define GC_FZ_ROW_CODEC_ENTRIES(N, L) GC_FZ_CODEC_ENTRIES(gc_##L, L)
GC_F32_ROWS(GC_FZ_ROW_CODEC_ENTRIES)
