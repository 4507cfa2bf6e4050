// gc_codec.cu -- the giftcomm wire codec on the GPU (CuPy RawModule, NVRTC; checked by
// native/check_cuda.sh with nvcc -ptx for sm_80 and sm_90).
//
// Wire message of `count` values (docs/wire-format.md):
//   block-scaled (e4m3, e5m2): [count code bytes][0-3 zero pad bytes][ceil(count/block) float32 scales]
//   pass-through (bf16, fp16): [count 16-bit values]; fp32: [count float32 values] (encode and
//   decode are copies; accumulate and decode-add-encode: gc_pt_fp32)
// The host side (giftcomm/cuda/codec.py) passes the payload and scale pointers separately.
//
// Kernels for block-scaled formats, F in {e4m3, e5m2}:
//   gc_enc_team_F[_vec]        block <= 256: a team of G lanes (G a power of two <= 32, inside
//                              one warp) per scale block; each lane keeps 8 values in registers,
//                              so x is read once. Reduction: __shfl_xor_sync inside the team.
//   gc_enc_cta_F[_vec]         256 < block <= 4096: one CTA (blockDim = 32..512 threads, 8 values
//                              per thread in registers) per scale block; warp shuffles + shared.
//   gc_enc_amax_F, gc_enc_big_F   block > 4096: the block is split over several CTAs: pass 1
//                              reduces amax into a scratch array with atomicMax on the bits, pass 2
//                              reads the values again and quantizes.
//   gc_dae_{team,cta,amax,big}[_sr]_F   decode-add-encode (one ring hop): 16 consecutive values
//                              per lane (section "decode-add-encode" below).
//   gc_dec_F, gc_acc_F         decode (out = value) and decode-accumulate (acc += value):
//                              elementwise, 16 values per thread (16- or 4-byte payload loads).
// Adaptive-precision rows (ada4_5, ada4): gc_ada_keys, gc_ada_tiers, gc_ada_enc, gc_ada_choices,
// gc_ada_dec (gc_adaptive.cuh; the per-frame ranking's sort and prefix counts run in CuPy).
// The encode _vec variants need block % 4 == 0 and a 16-byte aligned x, a 4-byte aligned payload
// (the host checks).
//
// Sizes: count < 2^62 values; block in [1, 2^20]; index arithmetic is 64-bit.

#include "gc_formats.h"
#include "gc_fp8.cuh"
#include "gc_mx.cuh"
#include "gc_adaptive.cuh"

#define GC_VPT 8  // values per thread held in registers by the encode team / cta kernels

// Four consecutive values of x starting at i (16-byte aligned).
GC_DEV void gc_load4(const float* __restrict__ x, long long i, float* v) {
    const float4 q = *reinterpret_cast<const float4*>(x + i);
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}

// Index of value k (0..GC_VPT-1) of lane `lane` in a team of `width` lanes.
// Scalar layout: e = k*width + lane (coalesced).  Vector layout: e = (k/4*width + lane)*4 + k%4.
template <bool VEC>
GC_DEV int gc_elem(int k, int lane, int width) {
    return VEC ? ((k / 4) * width + lane) * 4 + (k % 4) : k * width + lane;
}

// Load a lane's values of one scale block (n values from `base`), return the lane's amax bits.
template <bool VEC>
GC_DEV gc_u32 gc_team_load(const float* __restrict__ x, long long base, int n, int lane, int width, float* v) {
    gc_u32 m = 0;
    if (VEC) {
#pragma unroll
        for (int k = 0; k < GC_VPT; k += 4) {
            const int e = gc_elem<true>(k, lane, width);
            if (e + 3 < n) {
                gc_load4(x, base + e, v + k);
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) v[k + j] = (e + j < n) ? x[base + e + j] : 0.0f;
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k < GC_VPT; ++k) {
            const int e = gc_elem<false>(k, lane, width);
            v[k] = (e < n) ? x[base + e] : 0.0f;
        }
    }
#pragma unroll
    for (int k = 0; k < GC_VPT; ++k) m = gc_umax(m, gc_abs_bits(v[k]));
    return m;
}

// One code: nearest (SR false) or stochastic with the Philox bits of message index idx (SR true).
template <class F, bool SR>
GC_DEV gc_u8 gc_q(const gc_scale<F>& s, float v, gc_u64 key, gc_u64 idx) {
    return SR ? gc_sr8<F>(v, s.inv, s.finite, gc_rbits(key, idx)) : s.quantize(v);
}

// Quantize and store a lane's values; SR: stochastic rounding, value i of the message with the
// bits of (key, offset + i).
template <class F, bool VEC, bool SR>
GC_DEV void gc_team_store(const gc_scale<F>& s, const float* v, long long base, int n, int lane, int width,
                          gc_u8* __restrict__ pout, gc_u64 key, gc_u64 offset) {
    if (VEC) {
#pragma unroll
        for (int k = 0; k < GC_VPT; k += 4) {
            const int e = gc_elem<true>(k, lane, width);
            if (e + 3 < n) {
                gc_u32 c = 0;
#pragma unroll
                for (int j = 0; j < 4; ++j) c |= (gc_u32)gc_q<F, SR>(s, v[k + j], key, offset + (gc_u64)(base + e + j)) << (8 * j);
                *reinterpret_cast<gc_u32*>(pout + base + e) = c;
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if (e + j < n) pout[base + e + j] = gc_q<F, SR>(s, v[k + j], key, offset + (gc_u64)(base + e + j));
                }
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k < GC_VPT; ++k) {
            const int e = gc_elem<false>(k, lane, width);
            if (e < n) pout[base + e] = gc_q<F, SR>(s, v[k], key, offset + (gc_u64)(base + e));
        }
    }
}

// Zero the 0-3 padding bytes between the payload and the scales (first CTA only).
GC_DEV void gc_zero_pad(gc_u8* __restrict__ pout, long long count, int pad) {
    if (blockIdx.x == 0 && (int)threadIdx.x < pad) pout[count + threadIdx.x] = 0;
}

// The member mask of a team of G lanes (a power of two <= 32) containing warp lane wl.
GC_DEV gc_u32 gc_team_mask(int G, gc_u32 wl) {
    return (G == 32) ? 0xFFFFFFFFu : (((1u << G) - 1u) << (wl & ~(gc_u32)(G - 1)));
}

// ---------------------------------------------------------------- encode: team path (block <= 256)
// blockDim.x = 256; G = lanes per scale block (power of two, 1..32, G*8 >= block).
template <class F, bool VEC, bool SR = false>
GC_DEV void gc_team_kernel(const float* __restrict__ x, gc_u8* __restrict__ pout, float* __restrict__ sout,
                           long long count, int block, long long nb, int G, int pad, gc_u64 key = 0, gc_u64 offset = 0) {
    gc_zero_pad(pout, count, pad);
    const int tid = threadIdx.x;
    const int lane = tid & (G - 1);
    const int teams = blockDim.x / G;
    const gc_u32 mask = gc_team_mask(G, tid & 31);
    for (long long b = (long long)blockIdx.x * teams + tid / G; b < nb; b += (long long)gridDim.x * teams) {
        const long long base = b * (long long)block;
        const long long left = count - base;
        const int n = left < block ? (int)left : block;
        float v[GC_VPT];
        gc_u32 m = gc_team_load<VEC>(x, base, n, lane, G, v);
        for (int o = G >> 1; o > 0; o >>= 1) m = gc_umax(m, __shfl_xor_sync(mask, m, o, G));
        const gc_scale<F> s = gc_scale<F>::from_amax_bits(m);
        gc_team_store<F, VEC, SR>(s, v, base, n, lane, G, pout, key, offset);
        if (lane == 0) sout[b] = s.scale;
    }
}

// ---------------------------------------------------------------- encode: cta path (256 < block <= 4096)
// blockDim.x = T, a multiple of 32 with T*8 >= block; one scale block per CTA iteration.
template <class F, bool VEC, bool SR = false>
GC_DEV void gc_cta_kernel(const float* __restrict__ x, gc_u8* __restrict__ pout, float* __restrict__ sout,
                          long long count, int block, long long nb, int pad, gc_u64 key = 0, gc_u64 offset = 0) {
    __shared__ gc_u32 red[32];
    gc_zero_pad(pout, count, pad);
    const int tid = threadIdx.x, T = blockDim.x;
    for (long long b = blockIdx.x; b < nb; b += gridDim.x) {
        const long long base = b * (long long)block;
        const long long left = count - base;
        const int n = left < block ? (int)left : block;
        float v[GC_VPT];
        gc_u32 m = gc_team_load<VEC>(x, base, n, tid, T, v);
        for (int o = 16; o > 0; o >>= 1) m = gc_umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
        if ((tid & 31) == 0) red[tid >> 5] = m;
        __syncthreads();
        m = 0;
        for (int w = 0; w < (T >> 5); ++w) m = gc_umax(m, red[w]);
        __syncthreads();  // red is rewritten by the next iteration
        const gc_scale<F> s = gc_scale<F>::from_amax_bits(m);
        gc_team_store<F, VEC, SR>(s, v, base, n, tid, T, pout, key, offset);
        if (tid == 0) sout[b] = s.scale;
    }
}

// ---------------------------------------------------------------- encode: big path (block > 4096)
// blockDim.x = 256; each work item (b, s) covers values [s*GC_BIG_TILE, (s+1)*GC_BIG_TILE) of
// scale block b; splits = ceil(block / GC_BIG_TILE). amax_bits: nb zeroed words of scratch.
#define GC_BIG_TILE 4096

// w / d for the work-item and block indices: a 32-bit division while w fits in 31 bits.
GC_DEV long long gc_block_of(long long i, int block) {
    return i < 0x7FFFFFFFLL ? (long long)((gc_u32)i / (gc_u32)block) : i / block;
}

template <class F>
GC_DEV void gc_big_amax_kernel(const float* __restrict__ x, gc_u32* __restrict__ amax_bits, long long count, int block,
                               long long nb, int splits) {
    __shared__ gc_u32 red[8];
    const int tid = threadIdx.x;
    for (long long w = blockIdx.x; w < nb * splits; w += gridDim.x) {
        const long long b = gc_block_of(w, splits);
        const int s = (int)(w - b * splits);
        const long long base = b * (long long)block;
        const long long left = count - base;
        const int n = left < block ? (int)left : block;
        const int lo = s * GC_BIG_TILE, hi = (lo + GC_BIG_TILE < n) ? lo + GC_BIG_TILE : n;
        gc_u32 m = 0;
        for (int e = lo + tid; e < hi; e += 256) m = gc_umax(m, gc_abs_bits(x[base + e]));
        for (int o = 16; o > 0; o >>= 1) m = gc_umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
        if ((tid & 31) == 0) red[tid >> 5] = m;
        __syncthreads();
        if (tid == 0) {
            for (int k = 1; k < 8; ++k) m = gc_umax(m, red[k]);
            atomicMax(amax_bits + b, m);
        }
        __syncthreads();
    }
}

// the second pass: nearest (SR false) or stochastic rounding
template <class F, bool SR>
GC_DEV void gc_big_store_kernel(const float* __restrict__ x, const gc_u32* __restrict__ amax_bits,
                                gc_u8* __restrict__ pout, float* __restrict__ sout, long long count, int block,
                                long long nb, int splits, int pad, gc_u64 key = 0, gc_u64 offset = 0) {
    gc_zero_pad(pout, count, pad);
    const int tid = threadIdx.x;
    for (long long w = blockIdx.x; w < nb * splits; w += gridDim.x) {
        const long long b = gc_block_of(w, splits);
        const int s = (int)(w - b * splits);
        const long long base = b * (long long)block;
        const long long left = count - base;
        const int n = left < block ? (int)left : block;
        const int lo = s * GC_BIG_TILE, hi = (lo + GC_BIG_TILE < n) ? lo + GC_BIG_TILE : n;
        const gc_scale<F> sc = gc_scale<F>::from_amax_bits(amax_bits[b]);
        for (int e = lo + tid; e < hi; e += 256) pout[base + e] = gc_q<F, SR>(sc, x[base + e], key, offset + (gc_u64)(base + e));
        if (s == 0 && tid == 0) sout[b] = sc.scale;
    }
}

// ---------------------------------------------------------------- decode-add-encode, e4m3/e5m2
// One ring hop: s = fp32(decode(pin, sin) + local) per value, s encoded into (pout, sout) and
// stored to sum_out when given (may be NULL). Each lane holds GC_DVPT = 16 consecutive values of
// one scale block in registers (message and local read once; lane l of a block takes its values
// [16l, 16l + 16)):
//   gc_dae_team[_sr]_F   block <= 512: a team of G lanes (power of two, 1..32, G*16 >= block,
//                        inside one warp) per scale block; amax by __shfl_xor_sync; blockDim 256.
//   gc_dae_cta[_sr]_F    512 < block <= 8192: one CTA of T threads (power of two, 64..512,
//                        T*16 >= block) per scale block; warp shuffles, then shared memory.
//   gc_dae_amax_F,       block > 8192: tiles of GC_BIG_TILE = 256 threads x 16 values; pass 1
//   gc_dae_big[_sr]_F    atomicMax of the amax bits into scratch, pass 2 reads again, quantizes.
// Access width `vec` (the host picks it): 2: block % 16 == 0 and every pointer 16-byte aligned:
// one 16-byte payload load, four float4 loads of local, one 16-byte payload store, four float4
// stores of the sums; 1: block % 4 == 0, payloads 4-byte and floats 16-byte aligned: a 4-byte
// payload load / store and a float4 per 4 values; 0: one value at a time. The input block's
// scale is read once per lane; no division per value (the big path: one per 4096-value tile).
#define GC_DVPT 16

// v[k] = fp32(decode(pin[i0 + k]) * s_in + local[i0 + k]) for k < m (m in 0..16, the values of
// one scale block whose input scale is s_in), 0 past m; returns the amax bits of v.
template <class F>
GC_DEV gc_u32 gc_dae_load(const gc_u8* __restrict__ pin, float s_in, const float* __restrict__ local, long long i0,
                          int m, int vec, float* v) {
    gc_u32 c[4] = {0u, 0u, 0u, 0u};  // payload bytes, value 4q + j in byte j of c[q]
    if (vec == 2 && m == GC_DVPT) {
        const uint4 q = *reinterpret_cast<const uint4*>(pin + i0);
        c[0] = q.x; c[1] = q.y; c[2] = q.z; c[3] = q.w;
#pragma unroll
        for (int q4 = 0; q4 < 4; ++q4) gc_load4(local, i0 + 4 * q4, v + 4 * q4);
    } else {
#pragma unroll
        for (int q4 = 0; q4 < 4; ++q4) {
            if (vec && 4 * q4 + 3 < m) {
                c[q4] = *reinterpret_cast<const gc_u32*>(pin + i0 + 4 * q4);
                gc_load4(local, i0 + 4 * q4, v + 4 * q4);
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int k = 4 * q4 + j;
                    v[k] = 0.0f;
                    if (k < m) {
                        c[q4] |= (gc_u32)pin[i0 + k] << (8 * j);
                        v[k] = local[i0 + k];
                    }
                }
            }
        }
    }
    gc_u32 a = 0;
#pragma unroll
    for (int k = 0; k < GC_DVPT; ++k) {
        if (k < m) v[k] = gc_add(gc_mul(F::to_f32((gc_u8)(c[k >> 2] >> (8 * (k & 3)))), s_in), v[k]);
        a = gc_umax(a, gc_abs_bits(v[k]));
    }
    return a;
}

// Quantize v[0..m) with scale s into pout[i0..), the sums into sum_out[i0..) when given; SR:
// stochastic rounding with the bits of (key, offset + message index).
template <class F, bool SR>
GC_DEV void gc_dae_store(const gc_scale<F>& s, const float* v, long long i0, int m, int vec, gc_u8* __restrict__ pout,
                         float* __restrict__ sum_out, gc_u64 key, gc_u64 offset) {
    gc_u32 c[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int k = 0; k < GC_DVPT; ++k) {
        if (k < m) c[k >> 2] |= (gc_u32)gc_q<F, SR>(s, v[k], key, offset + (gc_u64)(i0 + k)) << (8 * (k & 3));
    }
    if (vec == 2 && m == GC_DVPT) {
        uint4 q;
        q.x = c[0]; q.y = c[1]; q.z = c[2]; q.w = c[3];
        *reinterpret_cast<uint4*>(pout + i0) = q;
        if (sum_out) {
#pragma unroll
            for (int q4 = 0; q4 < 4; ++q4)
                *reinterpret_cast<float4*>(sum_out + i0 + 4 * q4) = make_float4(v[4 * q4], v[4 * q4 + 1], v[4 * q4 + 2], v[4 * q4 + 3]);
        }
        return;
    }
#pragma unroll
    for (int q4 = 0; q4 < 4; ++q4) {
        if (vec && 4 * q4 + 3 < m) {
            *reinterpret_cast<gc_u32*>(pout + i0 + 4 * q4) = c[q4];
            if (sum_out) *reinterpret_cast<float4*>(sum_out + i0 + 4 * q4) = make_float4(v[4 * q4], v[4 * q4 + 1], v[4 * q4 + 2], v[4 * q4 + 3]);
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int k = 4 * q4 + j;
                if (k < m) {
                    pout[i0 + k] = (gc_u8)(c[q4] >> (8 * j));
                    if (sum_out) sum_out[i0 + k] = v[k];
                }
            }
        }
    }
}

// the values of lane-slot e0 (0, 16, 32, ...) of a block of n values: min(max(n - e0, 0), 16)
GC_DEV int gc_dae_count(int n, int e0) { return n <= e0 ? 0 : (n - e0 < GC_DVPT ? n - e0 : GC_DVPT); }

template <class F, bool SR>
GC_DEV void gc_dae_team_kernel(const gc_u8* __restrict__ pin, const float* __restrict__ sin, const float* __restrict__ local,
                               gc_u8* __restrict__ pout, float* __restrict__ sout, float* __restrict__ sum_out,
                               long long count, int block, long long nb, int G, int pad, int vec, gc_u64 key,
                               gc_u64 offset) {
    gc_zero_pad(pout, count, pad);
    const int tid = threadIdx.x;
    const int lane = tid & (G - 1);
    const int teams = blockDim.x / G;
    const gc_u32 mask = gc_team_mask(G, tid & 31);
    for (long long b = (long long)blockIdx.x * teams + tid / G; b < nb; b += (long long)gridDim.x * teams) {
        const long long base = b * (long long)block;
        const long long left = count - base;
        const int n = left < block ? (int)left : block;
        const int m = gc_dae_count(n, lane * GC_DVPT);
        float v[GC_DVPT];
        gc_u32 a = gc_dae_load<F>(pin, sin[b], local, base + lane * GC_DVPT, m, vec, v);
        for (int o = G >> 1; o > 0; o >>= 1) a = gc_umax(a, __shfl_xor_sync(mask, a, o, G));
        const gc_scale<F> s = gc_scale<F>::from_amax_bits(a);
        gc_dae_store<F, SR>(s, v, base + lane * GC_DVPT, m, vec, pout, sum_out, key, offset);
        if (lane == 0) sout[b] = s.scale;
    }
}

template <class F, bool SR>
GC_DEV void gc_dae_cta_kernel(const gc_u8* __restrict__ pin, const float* __restrict__ sin, const float* __restrict__ local,
                              gc_u8* __restrict__ pout, float* __restrict__ sout, float* __restrict__ sum_out,
                              long long count, int block, long long nb, int pad, int vec, gc_u64 key, gc_u64 offset) {
    __shared__ gc_u32 red[16];  // blockDim.x <= 512: 16 warps
    gc_zero_pad(pout, count, pad);
    const int tid = threadIdx.x, T = blockDim.x;
    for (long long b = blockIdx.x; b < nb; b += gridDim.x) {
        const long long base = b * (long long)block;
        const long long left = count - base;
        const int n = left < block ? (int)left : block;
        const int m = gc_dae_count(n, tid * GC_DVPT);
        float v[GC_DVPT];
        gc_u32 a = gc_dae_load<F>(pin, sin[b], local, base + tid * GC_DVPT, m, vec, v);
        for (int o = 16; o > 0; o >>= 1) a = gc_umax(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
        if ((tid & 31) == 0) red[tid >> 5] = a;
        __syncthreads();
        a = 0;
        for (int w = 0; w < (T >> 5); ++w) a = gc_umax(a, red[w]);
        __syncthreads();  // red is rewritten by the next iteration
        const gc_scale<F> s = gc_scale<F>::from_amax_bits(a);
        gc_dae_store<F, SR>(s, v, base + tid * GC_DVPT, m, vec, pout, sum_out, key, offset);
        if (tid == 0) sout[b] = s.scale;
    }
}

// big path, blockDim.x = 256: work item w = (scale block b, tile t) covers values
// [t*GC_BIG_TILE, (t+1)*GC_BIG_TILE) of block b, thread tid its 16 from t*GC_BIG_TILE + 16 tid.
template <class F>
GC_DEV void gc_dae_amax_kernel(const gc_u8* __restrict__ pin, const float* __restrict__ sin, const float* __restrict__ local,
                               gc_u32* __restrict__ amax_bits, long long count, int block, long long nb, int splits,
                               int vec) {
    __shared__ gc_u32 red[8];
    const int tid = threadIdx.x;
    for (long long w = blockIdx.x; w < nb * splits; w += gridDim.x) {
        const long long b = gc_block_of(w, splits);
        const int e0 = (int)(w - b * splits) * GC_BIG_TILE + tid * GC_DVPT;
        const long long base = b * (long long)block;
        const long long left = count - base;
        const int m = gc_dae_count(left < block ? (int)left : block, e0);
        float v[GC_DVPT];
        gc_u32 a = gc_dae_load<F>(pin, sin[b], local, base + e0, m, vec, v);
        for (int o = 16; o > 0; o >>= 1) a = gc_umax(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
        if ((tid & 31) == 0) red[tid >> 5] = a;
        __syncthreads();
        if (tid == 0) {
            for (int k = 1; k < 8; ++k) a = gc_umax(a, red[k]);
            atomicMax(amax_bits + b, a);
        }
        __syncthreads();
    }
}

template <class F, bool SR>
GC_DEV void gc_dae_big_kernel(const gc_u8* __restrict__ pin, const float* __restrict__ sin, const float* __restrict__ local,
                              const gc_u32* __restrict__ amax_bits, gc_u8* __restrict__ pout, float* __restrict__ sout,
                              float* __restrict__ sum_out, long long count, int block, long long nb, int splits, int pad,
                              int vec, gc_u64 key, gc_u64 offset) {
    gc_zero_pad(pout, count, pad);
    const int tid = threadIdx.x;
    for (long long w = blockIdx.x; w < nb * splits; w += gridDim.x) {
        const long long b = gc_block_of(w, splits);
        const int t = (int)(w - b * splits);
        const int e0 = t * GC_BIG_TILE + tid * GC_DVPT;
        const long long base = b * (long long)block;
        const long long left = count - base;
        const int m = gc_dae_count(left < block ? (int)left : block, e0);
        const gc_scale<F> s = gc_scale<F>::from_amax_bits(amax_bits[b]);
        float v[GC_DVPT];
        gc_dae_load<F>(pin, sin[b], local, base + e0, m, vec, v);
        gc_dae_store<F, SR>(s, v, base + e0, m, vec, pout, sum_out, key, offset);
        if (t == 0 && tid == 0) sout[b] = s.scale;
    }
}

// ---------------------------------------------------------------- decode / decode-accumulate
// Each thread handles 16 consecutive values: the scale block of the first by one division (32-bit
// while the index fits in 31 bits), later block starts by comparison, so no 64-bit division per
// value. vec 2: one 16-byte payload load and four float4 stores (payload and out 16-byte
// aligned); vec 1: four 4-byte payload loads, four float4 stores (payload 4-byte, out 16-byte
// aligned); vec 0: one value at a time. The host picks vec from the pointers.
template <class F, bool ACC>
GC_DEV float gc_dec_step(float acc, gc_u8 code, float scale) {
    const float v = gc_mul(F::to_f32(code), scale);
    return ACC ? gc_add(acc, v) : v;
}

template <class F, bool ACC>
GC_DEV void gc_decode_kernel(const gc_u8* __restrict__ pin, const float* __restrict__ sin, float* __restrict__ out,
                             long long count, int block, int vec) {
    const long long groups = (count + 15) >> 4;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < groups;
         t += (long long)gridDim.x * blockDim.x) {
        const long long i0 = t << 4;
        long long b = gc_block_of(i0, block);
        long long next = (b + 1) * (long long)block;
        if (vec && i0 + 15 < count) {
            gc_u32 w[4];
            if (vec == 2) {
                const uint4 c = *reinterpret_cast<const uint4*>(pin + i0);
                w[0] = c.x; w[1] = c.y; w[2] = c.z; w[3] = c.w;
            } else {
#pragma unroll
                for (int q = 0; q < 4; ++q) w[q] = *reinterpret_cast<const gc_u32*>(pin + i0 + 4 * q);
            }
            float4* o = reinterpret_cast<float4*>(out + i0);
            float s = sin[b];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float4 r = ACC ? o[q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                float v[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if (i0 + 4 * q + j == next) { ++b; next += block; s = sin[b]; }
                    v[j] = gc_dec_step<F, ACC>(v[j], (gc_u8)(w[q] >> (8 * j)), s);
                }
                o[q] = make_float4(v[0], v[1], v[2], v[3]);
            }
        } else {
            for (int j = 0; j < 16 && i0 + j < count; ++j) {
                if (i0 + j == next) { ++b; next += block; }
                const float val = gc_mul(F::to_f32(pin[i0 + j]), sin[b]);
                out[i0 + j] = ACC ? gc_add(out[i0 + j], val) : val;
            }
        }
    }
}

// ---------------------------------------------------------------- pass-through (bf16, fp16)
// op 0: encode x -> wire.  op 1: decode wire -> out.  op 2: out += decode(wire).
// op 3: decode-add-encode: s = fp32(decode(win) + x); wout = encode(s); sum_out = s if given.
template <class P>
GC_DEV void gc_pt_kernel(int op, const float* __restrict__ x, const gc_u16* __restrict__ win, gc_u16* __restrict__ wout,
                         float* __restrict__ out, long long count) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        if (op == 0) {
            wout[i] = P::from_f32(x[i]);
        } else if (op == 1) {
            out[i] = P::to_f32(win[i]);
        } else if (op == 2) {
            out[i] = gc_add(out[i], P::to_f32(win[i]));
        } else {
            const float s = gc_add(P::to_f32(win[i]), x[i]);
            wout[i] = P::from_f32(s);
            if (out) out[i] = s;
        }
    }
}

// ---------------------------------------------------------------- entry points
#define GC_ENC_ARGS const float* __restrict__ x, gc_u8* __restrict__ pout, float* __restrict__ sout, long long count, int block, long long nb
#define GC_DAE_ARGS const gc_u8* __restrict__ pin, const float* __restrict__ sin, const float* __restrict__ local, \
    gc_u8* __restrict__ pout, float* __restrict__ sout, float* __restrict__ sum_out, long long count, int block, long long nb

#define GC_BLOCK_SCALED_ENTRIES(F, NAME)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) gc_enc_team_##NAME(GC_ENC_ARGS, int G, int pad) {              \
        gc_team_kernel<F, false>(x, pout, sout, count, block, nb, G, pad);                                            \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) gc_enc_team_vec_##NAME(GC_ENC_ARGS, int G, int pad) {          \
        gc_team_kernel<F, true>(x, pout, sout, count, block, nb, G, pad);                                             \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(512, 1) gc_enc_cta_##NAME(GC_ENC_ARGS, int pad) {                  \
        gc_cta_kernel<F, false>(x, pout, sout, count, block, nb, pad);                                                \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(512, 1) gc_enc_cta_vec_##NAME(GC_ENC_ARGS, int pad) {              \
        gc_cta_kernel<F, true>(x, pout, sout, count, block, nb, pad);                                                 \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) gc_enc_amax_##NAME(const float* __restrict__ x,               \
        gc_u32* __restrict__ amax_bits, long long count, int block, long long nb, int splits) {                      \
        gc_big_amax_kernel<F>(x, amax_bits, count, block, nb, splits);                                                \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) gc_enc_big_##NAME(const float* __restrict__ x,                \
        const gc_u32* __restrict__ amax_bits, gc_u8* __restrict__ pout, float* __restrict__ sout, long long count,   \
        int block, long long nb, int splits, int pad) {                                                              \
        gc_big_store_kernel<F, false>(x, amax_bits, pout, sout, count, block, nb, splits, pad);                       \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) gc_dae_amax_##NAME(const gc_u8* __restrict__ pin,             \
        const float* __restrict__ sin, const float* __restrict__ local, gc_u32* __restrict__ amax_bits,              \
        long long count, int block, long long nb, int splits, int vec) {                                             \
        gc_dae_amax_kernel<F>(pin, sin, local, amax_bits, count, block, nb, splits, vec);                             \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) gc_dec_##NAME(const gc_u8* __restrict__ pin,                  \
        const float* __restrict__ sin, float* __restrict__ out, long long count, int block, int vec) {              \
        gc_decode_kernel<F, false>(pin, sin, out, count, block, vec);                                                 \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) gc_acc_##NAME(const gc_u8* __restrict__ pin,                  \
        const float* __restrict__ sin, float* __restrict__ acc, long long count, int block, int vec) {              \
        gc_decode_kernel<F, true>(pin, sin, acc, count, block, vec);                                                  \
    }

// decode-add-encode, nearest (SRN _, SR false) or stochastic (SRN _sr_, SR true); key and
// offset are read by the stochastic kernels only
#define GC_DAE_ENTRIES(F, NAME, SRN, SR)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) gc_dae_team##SRN##NAME(GC_DAE_ARGS, int G, int pad, int vec, \
                                                                           gc_u64 key, gc_u64 offset) {              \
        gc_dae_team_kernel<F, SR>(pin, sin, local, pout, sout, sum_out, count, block, nb, G, pad, vec, key, offset);  \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(512, 1) gc_dae_cta##SRN##NAME(GC_DAE_ARGS, int pad, int vec,      \
                                                                             gc_u64 key, gc_u64 offset) {            \
        gc_dae_cta_kernel<F, SR>(pin, sin, local, pout, sout, sum_out, count, block, nb, pad, vec, key, offset);      \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) gc_dae_big##SRN##NAME(const gc_u8* __restrict__ pin,         \
        const float* __restrict__ sin, const float* __restrict__ local, const gc_u32* __restrict__ amax_bits,        \
        gc_u8* __restrict__ pout, float* __restrict__ sout, float* __restrict__ sum_out, long long count,            \
        int block, long long nb, int splits, int pad, int vec, gc_u64 key, gc_u64 offset) {                          \
        gc_dae_big_kernel<F, SR>(pin, sin, local, amax_bits, pout, sout, sum_out, count, block, nb, splits, pad, vec, \
                                 key, offset);                                                                       \
    }

// one set per FP8 row with float32 scales (GC_F32_ROWS of gc_formats.h; element type gc_<name>)
#define GC_F32_ROW_ENTRIES(N, L) GC_BLOCK_SCALED_ENTRIES(gc_##L, L)
#define GC_F32_ROW_DAE_ENTRIES(N, L) GC_DAE_ENTRIES(gc_##L, L, _, false) GC_DAE_ENTRIES(gc_##L, L, _sr_, true)
GC_F32_ROWS(GC_F32_ROW_ENTRIES)
GC_F32_ROWS(GC_F32_ROW_DAE_ENTRIES)

#define GC_PT_ENTRY(P, NAME)                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) gc_pt_##NAME(int op, const float* __restrict__ x,             \
        const gc_u16* __restrict__ win, gc_u16* __restrict__ wout, float* __restrict__ out, long long count) {       \
        gc_pt_kernel<P>(op, x, win, wout, out, count);                                                                \
    }

GC_PT_ENTRY(gc_bf16, bf16)
GC_PT_ENTRY(gc_fp16, fp16)

// fp32 pass-through (wire = the float32 values): op 2: out += win; op 3: s = win + x, wout = s,
// sum_out = s if given (ops 0/1 are plain copies, done by the host with a device memcpy). The add is
// gc_add (add.rn.f32, no .ftz), so a float32 subnormal sum is kept: CuPy's own elementwise add
// (cupy.add) is compiled with -ftz=true and flushed it on the H200 (2026-11-30). vec: every pointer
// 16-byte aligned (the host checks), 4 values per thread through float4.
GC_DEV void gc_pt_f32_one(int op, const float* __restrict__ x, const float* __restrict__ win, float* __restrict__ wout,
                          float* __restrict__ out, long long i) {
    if (op == 2) {
        out[i] = gc_add(out[i], win[i]);
    } else {
        const float s = gc_add(win[i], x[i]);
        wout[i] = s;
        if (out) out[i] = s;
    }
}

extern "C" __global__ void __launch_bounds__(256) gc_pt_fp32(int op, const float* __restrict__ x,
    const float* __restrict__ win, float* __restrict__ wout, float* __restrict__ out, long long count, int vec) {
    const long long groups = (count + 3) >> 2;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < groups;
         t += (long long)gridDim.x * blockDim.x) {
        const long long i0 = t << 2;
        if (vec && i0 + 3 < count) {
            const float4 w = *reinterpret_cast<const float4*>(win + i0);
            if (op == 2) {
                float4 a = *reinterpret_cast<const float4*>(out + i0);
                a.x = gc_add(a.x, w.x); a.y = gc_add(a.y, w.y); a.z = gc_add(a.z, w.z); a.w = gc_add(a.w, w.w);
                *reinterpret_cast<float4*>(out + i0) = a;
            } else {
                const float4 l = *reinterpret_cast<const float4*>(x + i0);
                const float4 r = make_float4(gc_add(w.x, l.x), gc_add(w.y, l.y), gc_add(w.z, l.z), gc_add(w.w, l.w));
                *reinterpret_cast<float4*>(wout + i0) = r;
                if (out) *reinterpret_cast<float4*>(out + i0) = r;
            }
        } else {
            for (int j = 0; j < 4 && i0 + j < count; ++j) gc_pt_f32_one(op, x, win, wout, out, i0 + j);
        }
    }
}

// x[i] = fp32(x[i] / d) in place (op="avg" of a collective's float32 result): div.rn.f32 without
// .ftz, so equal to NumPy's float32 division also where the quotient or x is subnormal (a CuPy
// elementwise divide, compiled with -ftz=true, flushes those). giftcomm.cuda.codec.divide_inplace.
extern "C" __global__ void __launch_bounds__(256) gc_div_f32(float* __restrict__ x, float d, long long count) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (long long)gridDim.x * blockDim.x)
        x[i] = gc_div(x[i], d);
}

// ---------------------------------------------------------------- stochastic rounding, e4m3/e5m2 encode
// Block <= 4096: the one-pass team / cta kernels (x read once, as for nearest); larger blocks: the
// big path's amax pass (gc_enc_amax_F) then gc_enc_big_sr_F. The element with message index i
// uses Philox bits (key, offset + i) (gc_mx.cuh, docs/wire-format.md).
#define GC_SR_ENC_ENTRIES(F, NAME)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) gc_enc_team_sr_##NAME(GC_ENC_ARGS, int G, int pad,           \
                                                                          gc_u64 key, gc_u64 offset) {                \
        gc_team_kernel<F, false, true>(x, pout, sout, count, block, nb, G, pad, key, offset);                         \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) gc_enc_team_sr_vec_##NAME(GC_ENC_ARGS, int G, int pad,       \
                                                                              gc_u64 key, gc_u64 offset) {            \
        gc_team_kernel<F, true, true>(x, pout, sout, count, block, nb, G, pad, key, offset);                          \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(512, 1) gc_enc_cta_sr_##NAME(GC_ENC_ARGS, int pad, gc_u64 key,     \
                                                                            gc_u64 offset) {                          \
        gc_cta_kernel<F, false, true>(x, pout, sout, count, block, nb, pad, key, offset);                             \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(512, 1) gc_enc_cta_sr_vec_##NAME(GC_ENC_ARGS, int pad, gc_u64 key, \
                                                                                gc_u64 offset) {                      \
        gc_cta_kernel<F, true, true>(x, pout, sout, count, block, nb, pad, key, offset);                              \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) gc_enc_big_sr_##NAME(const float* __restrict__ x,             \
        const gc_u32* __restrict__ amax_bits, gc_u8* __restrict__ pout, float* __restrict__ sout, long long count,   \
        int block, long long nb, int splits, int pad, gc_u64 key, gc_u64 offset) {                                   \
        gc_big_store_kernel<F, true>(x, amax_bits, pout, sout, count, block, nb, splits, pad, key, offset);           \
    }

#define GC_F32_ROW_SR_ENC_ENTRIES(N, L) GC_SR_ENC_ENTRIES(gc_##L, L)
GC_F32_ROWS(GC_F32_ROW_SR_ENC_ENTRIES)

// ---------------------------------------------------------------- MX formats and nvfp4
// Message parts: payload (codes; 4-bit formats packed, value 2j in the low nibble of byte j),
// block scales (one byte each: E8M0 for MX, E4M3 for nvfp4), nvfp4 group scales (float32, one per
// 1024 values; 4-byte aligned: the host checks). The 0-3 pad bytes before the group scales are
// zeroed by the host.
struct gc_mx_msg {
    const gc_u8* pay;
    const gc_u8* sc;
    const float* gs;
};

// decoded value i of a message
template <int EK, int NV>
GC_DEV float gc_mx_in(const gc_mx_msg& m, long long i) {
    const gc_u32 code = (EK == GC_ELEM_E2M1) ? ((gc_u32)(m.pay[i >> 1] >> (4 * (int)(i & 1))) & 0xFu) : (gc_u32)m.pay[i];
    if (NV) return gc_nv_value(code, m.sc[i >> 4], m.gs[i >> 10]);
    return gc_mx_value(code, m.sc[i >> 5], EK);
}

// MX encode / decode-add-encode (mxfp8, mxfp8_e5m2, mxfp4): two lanes per 32-value block, global
// lane h holding values [16h, 16h + 16) in registers (block h/2); the block amax by one
// __shfl_xor_sync with the partner lane; the even lane writes the scale byte. mode 1 adds the
// decoded input message: the lane's codes read as one 16-byte (8-bit codes) or 8-byte (4-bit) word,
// its block scale once. When x, sum_out and both payloads are aligned for it (checked here: 16
// bytes; 4-bit payloads 8), the lane's values move as float4s and its codes as one 16- / 8-byte
// store; else one value at a time. Codes packed in words: 8-bit: value k in byte k%4 of c[k/4];
// 4-bit: value k in nibble k%8 of c[k/8] (a little-endian 64-bit word = the payload's byte order:
// value 2j in the low nibble of byte j); a nibble past count stays 0.
template <int EK>
GC_DEV void gc_mx_enc_kernel(const float* __restrict__ x, gc_mx_msg in, gc_u8* __restrict__ pay, gc_u8* __restrict__ sc,
                             float* __restrict__ sum_out, int mode, long long count, long long nb, int sr, gc_u64 key,
                             gc_u64 offset, int rule) {
    const bool four = EK == GC_ELEM_E2M1;
    const int cb = four ? 4 : 8;  // bits per code
    const unsigned long long pa = four ? 7u : 15u;
    const bool vec = (((unsigned long long)x | (unsigned long long)sum_out) & 15u) == 0 &&
                     (((unsigned long long)pay | (unsigned long long)in.pay) & pa) == 0;
    const gc_u32 mask = 3u << (threadIdx.x & 30u);  // this lane and its partner
    for (long long h = (long long)blockIdx.x * blockDim.x + threadIdx.x; h < 2 * nb; h += (long long)gridDim.x * blockDim.x) {
        const long long i0 = h * 16;
        const long long left = count - i0;
        const int m = left <= 0 ? 0 : (left < 16 ? (int)left : 16);
        const bool full = vec && m == 16;
        float v[16];
        if (full) {
#pragma unroll
            for (int q = 0; q < 4; ++q) gc_load4(x, i0 + 4 * q, v + 4 * q);
        } else {
#pragma unroll
            for (int k = 0; k < 16; ++k) v[k] = k < m ? x[i0 + k] : 0.0f;
        }
        if (mode) {
            gc_u32 c[4] = {0u, 0u, 0u, 0u};
            if (full && four) {
                const gc_u64 w = *reinterpret_cast<const gc_u64*>(in.pay + (i0 >> 1));
                c[0] = (gc_u32)w;
                c[1] = (gc_u32)(w >> 32);
            } else if (full) {
                const uint4 q = *reinterpret_cast<const uint4*>(in.pay + i0);
                c[0] = q.x; c[1] = q.y; c[2] = q.z; c[3] = q.w;
            } else {
#pragma unroll
                for (int k = 0; k < 16; ++k) {
                    if (k < m) {
                        const gc_u32 code = four ? (gc_u32)(in.pay[(i0 + k) >> 1] >> (4 * (k & 1))) & 0xFu : (gc_u32)in.pay[i0 + k];
                        c[k * cb / 32] |= code << ((k * cb) & 31);
                    }
                }
            }
            const gc_u32 sin = m > 0 ? (gc_u32)in.sc[i0 >> 5] : 0u;
#pragma unroll
            for (int k = 0; k < 16; ++k) {
                const gc_u32 code = (c[k * cb / 32] >> ((k * cb) & 31)) & (four ? 0xFu : 0xFFu);
                if (k < m) v[k] = gc_add(gc_mx_value(code, sin, EK), v[k]);
            }
        }
        if (sum_out) {
            if (full) {
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    *reinterpret_cast<float4*>(sum_out + i0 + 4 * q) = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
            } else {
#pragma unroll
                for (int k = 0; k < 16; ++k) {
                    if (k < m) sum_out[i0 + k] = v[k];
                }
            }
        }
        gc_u32 a = 0;
#pragma unroll
        for (int k = 0; k < 16; ++k) a = gc_umax(a, gc_abs_bits(v[k]));
        a = gc_umax(a, __shfl_xor_sync(mask, a, 1));
        const gc_u32 scode = gc_mx_scale_code(a, EK, rule);
        const float mult = gc_mx_mult(scode);
        gc_u32 w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            if (k < m) {
                const gc_u32 code = scode == 0xFFu ? (gc_u32)GC_EK_NAN(EK)
                    : gc_qelem(v[k], mult, sr ? gc_rbits(key, offset + (gc_u64)(i0 + k)) : 0u, EK, sr != 0);
                w[k * cb / 32] |= (code & (four ? 0xFu : 0xFFu)) << ((k * cb) & 31);
            }
        }
        if (full && four) {
            *reinterpret_cast<gc_u64*>(pay + (i0 >> 1)) = (gc_u64)w[0] | ((gc_u64)w[1] << 32);
        } else if (full) {
            uint4 q;
            q.x = w[0]; q.y = w[1]; q.z = w[2]; q.w = w[3];
            *reinterpret_cast<uint4*>(pay + i0) = q;
        } else {
#pragma unroll
            for (int k = 0; k < 16; k += (four ? 2 : 1)) {  // byte k*cb/8 of the lane's codes
                if (k < m) pay[(i0 * cb + k * cb) >> 3] = (gc_u8)(w[k * cb / 32] >> ((k * cb) & 31));
            }
        }
        if ((h & 1) == 0) sc[h >> 1] = (gc_u8)scode;
    }
}

// nvfp4 encode / decode-add-encode: one warp per 1024-value group; lane l holds the 32 values of
// blocks 2l and 2l+1 in registers; the group amax (finite blocks only) by warp shuffles. x is read
// coalesced (instruction j: lanes read values 32j..32j+31 of the group) into a per-warp shared tile
// (rows padded to 33 floats: no bank conflicts either way), from which each lane takes its 32; the
// sums (sum_out) go back through the tile and out coalesced the same way. Each lane's 16 payload
// bytes come in (mode 1) and go out as one 16-byte access when the group is full and the payload
// 16-byte aligned.
#define GC_NV_ROW 33
// the per-warp tiles (a function of its own: one static array for the module)
GC_DEV float* gc_nv_tile() {
    __shared__ float tile[8 * 32 * GC_NV_ROW];  // blockDim.x <= 256: 8 warps, 33 KiB
    return tile;
}

GC_DEV void gc_nv_enc_kernel(const float* __restrict__ x, gc_mx_msg in, gc_u8* __restrict__ pay, gc_u8* __restrict__ sc,
                             float* __restrict__ gs, float* __restrict__ sum_out, int mode, long long count, long long ng,
                             int sr, gc_u64 key, gc_u64 offset) {
    const int lane = threadIdx.x & 31;
    float* tw = gc_nv_tile() + (threadIdx.x >> 5) * 32 * GC_NV_ROW;
    const bool pay16 = ((unsigned long long)pay & 15u) == 0;
    const bool ipay16 = ((unsigned long long)in.pay & 15u) == 0;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long g = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); g < ng; g += warps) {
        const long long g0 = g * 1024;
        const long long base = g0 + lane * 32;
#pragma unroll 8
        for (int j = 0; j < 32; ++j) {  // value e = 32j + lane of the group belongs to lane j, slot `lane`
            const long long i = g0 + 32 * j + lane;
            tw[j * GC_NV_ROW + lane] = i < count ? x[i] : 0.0f;
        }
        // mode 1: the lane's 32 input codes (value k in nibble k % 8 of ic[k / 8]: one 16-byte load
        // when the group is full and the input payload 16-byte aligned), its two block scales, the
        // group scale
        gc_u32 ic[4] = {0u, 0u, 0u, 0u}, ib[2] = {0u, 0u};
        float is2 = 0.0f;
        if (mode && base < count) {
            if (ipay16 && base + 31 < count) {
                const uint4 q = *reinterpret_cast<const uint4*>(in.pay + (base >> 1));
                ic[0] = q.x; ic[1] = q.y; ic[2] = q.z; ic[3] = q.w;
            } else {
#pragma unroll
                for (int k = 0; k < 32; k += 2) {
                    if (base + k < count) ic[k >> 3] |= (gc_u32)in.pay[(base + k) >> 1] << (4 * (k & 7));
                }
            }
            ib[0] = in.sc[base >> 4];
            if (base + 16 < count) ib[1] = in.sc[(base >> 4) + 1];
            is2 = in.gs[g];
        }
        __syncwarp();
        float v[32];
        gc_u32 m0 = 0, m1 = 0;
#pragma unroll
        for (int k = 0; k < 32; ++k) {
            const long long i = base + k;
            float t = 0.0f;
            if (i < count) {
                t = tw[lane * GC_NV_ROW + k];
                if (mode) t = gc_add(gc_nv_value((ic[k >> 3] >> (4 * (k & 7))) & 0xFu, ib[k >> 4], is2), t);
                if (sum_out) tw[lane * GC_NV_ROW + k] = t;  // this lane's own slot: read above, no barrier
            }
            v[k] = t;
            if (k < 16) m0 = gc_umax(m0, gc_abs_bits(t));
            else m1 = gc_umax(m1, gc_abs_bits(t));
        }
        __syncwarp();  // the sums in the tile are complete; the tile is rewritten by the next group
        if (sum_out) {  // back out as they came in: value 32j + lane of the group, coalesced
#pragma unroll 8
            for (int j = 0; j < 32; ++j) {
                const long long i = g0 + 32 * j + lane;
                if (i < count) sum_out[i] = tw[j * GC_NV_ROW + lane];
            }
            __syncwarp();
        }
        gc_u32 f = gc_umax(m0 < GC_F32_INF_BITS ? m0 : 0u, m1 < GC_F32_INF_BITS ? m1 : 0u);
        for (int o = 16; o > 0; o >>= 1) f = gc_umax(f, __shfl_xor_sync(0xFFFFFFFFu, f, o));
        const gc_nv_group grp = gc_nv_group::from_bits(f);
        float r[2];
        const gc_u32 bsc[2] = {gc_nv_block(m0, grp, &r[0]), gc_nv_block(m1, grp, &r[1])};
        gc_u32 w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int k = 0; k < 32; k += 2) {
            const long long i = base + k;
            const int h = k >> 4;
            gc_u32 c0 = 0, c1 = 0;
            if (bsc[h] != 0x7Fu && i < count) {
                c0 = gc_qelem(v[k], r[h], sr ? gc_rbits(key, offset + (gc_u64)i) : 0u, GC_NVFP4_ELEM, sr != 0);
                if (i + 1 < count) c1 = gc_qelem(v[k + 1], r[h], sr ? gc_rbits(key, offset + (gc_u64)(i + 1)) : 0u, GC_NVFP4_ELEM, sr != 0);
            }
            w[k >> 3] |= ((c0 & 0xFu) | ((c1 & 0xFu) << 4)) << (8 * ((k >> 1) & 3));
        }
        if (pay16 && base + 31 < count) {
            uint4 q;
            q.x = w[0]; q.y = w[1]; q.z = w[2]; q.w = w[3];
            *reinterpret_cast<uint4*>(pay + (base >> 1)) = q;
        } else {
            for (int k = 0; k < 32 && base + k < count; k += 2) pay[(base + k) >> 1] = (gc_u8)(w[k >> 3] >> (8 * ((k >> 1) & 3)));
        }
        if (base < count) sc[base >> 4] = (gc_u8)bsc[0];
        if (base + 16 < count) sc[(base >> 4) + 1] = (gc_u8)bsc[1];
        if (lane == 0) gs[g] = grp.s2;
    }
}

// MX / nvfp4 decode and decode-accumulate: 8 consecutive values per thread, which share one block
// scale (MX blocks are 32 values, nvfp4 blocks 16, groups 1024): the scale is read once; vec (the
// host checks: payload 4-byte, out 16-byte aligned): 4-byte payload loads (one for 4-bit codes,
// two for 8-bit) and two float4 stores; else one value at a time.
template <int EK, int NV, bool ACC>
GC_DEV void gc_mx_dec_kernel(gc_mx_msg in, float* __restrict__ out, long long count, int vec) {
    const long long groups = (count + 7) >> 3;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < groups; t += (long long)gridDim.x * blockDim.x) {
        const long long i0 = t << 3;
        if (vec && i0 + 7 < count) {
            const gc_u32 w0 = *reinterpret_cast<const gc_u32*>(in.pay + (EK == GC_ELEM_E2M1 ? (i0 >> 1) : i0));
            const gc_u32 w1 = (EK == GC_ELEM_E2M1) ? 0u : *reinterpret_cast<const gc_u32*>(in.pay + i0 + 4);
            const gc_u32 scode = NV ? (gc_u32)in.sc[i0 >> 4] : (gc_u32)in.sc[i0 >> 5];
            const float s2 = NV ? in.gs[i0 >> 10] : 0.0f;
            float v[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const gc_u32 code = (EK == GC_ELEM_E2M1) ? (w0 >> (4 * k)) & 0xFu : ((k < 4 ? w0 : w1) >> (8 * (k & 3))) & 0xFFu;
                v[k] = NV ? gc_nv_value(code, scode, s2) : gc_mx_value(code, scode, EK);
            }
            float4* o = reinterpret_cast<float4*>(out + i0);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float4 r = make_float4(v[4 * h], v[4 * h + 1], v[4 * h + 2], v[4 * h + 3]);
                if (ACC) {
                    const float4 a = o[h];
                    r = make_float4(gc_add(a.x, r.x), gc_add(a.y, r.y), gc_add(a.z, r.z), gc_add(a.w, r.w));
                }
                o[h] = r;
            }
        } else {
            for (int j = 0; j < 8 && i0 + j < count; ++j) {
                const float v = gc_mx_in<EK, NV>(in, i0 + j);
                out[i0 + j] = ACC ? gc_add(out[i0 + j], v) : v;
            }
        }
    }
}

// rule: the E8M0 formats' shared-exponent rule (GC_RULE_CEIL, GC_RULE_FLOOR); nvfp4 ignores it
#define GC_MX_ARGS_TAIL long long count, long long nb, int sr, gc_u64 key, gc_u64 offset, int rule
#define GC_MX_ENTRIES(EK, NV, NAME)                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) gc_mx_enc_##NAME(const float* __restrict__ x,                 \
        const gc_u8* __restrict__ ipay, const gc_u8* __restrict__ isc, const float* __restrict__ igs,                \
        gc_u8* __restrict__ pay, gc_u8* __restrict__ sc, float* __restrict__ gs, float* __restrict__ sum_out,        \
        int mode, GC_MX_ARGS_TAIL) {                                                                                  \
        const gc_mx_msg in{ipay, isc, igs};                                                                           \
        if (NV) gc_nv_enc_kernel(x, in, pay, sc, gs, sum_out, mode, count, nb, sr, key, offset);                     \
        else gc_mx_enc_kernel<EK>(x, in, pay, sc, sum_out, mode, count, nb, sr, key, offset, rule);                   \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) gc_mx_dec_##NAME(const gc_u8* __restrict__ ipay,              \
        const gc_u8* __restrict__ isc, const float* __restrict__ igs, float* __restrict__ out, long long count,      \
        int acc, int vec) {                                                                                           \
        const gc_mx_msg in{ipay, isc, igs};                                                                           \
        if (acc) gc_mx_dec_kernel<EK, NV, true>(in, out, count, vec);                                                 \
        else gc_mx_dec_kernel<EK, NV, false>(in, out, count, vec);                                                    \
    }

GC_MX_ENTRIES(GC_NVFP4_ELEM, 1, nvfp4)
// one set per MX row (GC_E8M0_ROWS of gc_formats.h)
#define GC_E8M0_ROW_ENTRIES(N, L) GC_MX_ENTRIES(GC_##N##_ELEM, 0, L)
GC_E8M0_ROWS(GC_E8M0_ROW_ENTRIES)

// ---------------------------------------------------------------- adaptive-precision rows
// 128 threads per CTA (gc_adaptive.cuh has the kernels' contract)
extern "C" __global__ void __launch_bounds__(128) gc_ada_keys(const float* __restrict__ x, gc_u64* __restrict__ keys,
                                                              long long count, int block, long long nsb, int frame,
                                                              int run) {
    gc_ada_keys_kernel(x, keys, count, block, nsb, frame, run);
}

extern "C" __global__ void __launch_bounds__(128) gc_ada_tiers(const gc_u64* __restrict__ sorted, gc_u8* __restrict__ tiers,
                                                               long long n, long long first, int frame, long long nsb,
                                                               int k8f, int k4f, int k8r, int k4r) {
    gc_ada_tiers_kernel(sorted, tiers, n, first, frame, nsb, k8f, k4f, k8r, k4r);
}

extern "C" __global__ void __launch_bounds__(128) gc_ada_enc(const float* __restrict__ x, const gc_u64* __restrict__ keys,
                                                             const gc_u8* __restrict__ tiers, const long long* __restrict__ off,
                                                             gc_u8* __restrict__ msg, long long count, int block,
                                                             long long nsb, int frame, long long fb, int sr, gc_u64 key,
                                                             gc_u64 offset) {
    gc_ada_enc_kernel(x, keys, tiers, off, msg, count, block, nsb, frame, fb, sr, key, offset);
}

extern "C" __global__ void __launch_bounds__(128) gc_ada_choices(const gc_u8* __restrict__ msg, gc_u8* __restrict__ tiers,
                                                                 long long nsb, int frame, long long fb) {
    gc_ada_choices_kernel(msg, tiers, nsb, frame, fb);
}

extern "C" __global__ void __launch_bounds__(128) gc_ada_dec(const gc_u8* __restrict__ msg, const gc_u8* __restrict__ tiers,
                                                             const long long* __restrict__ off, float* __restrict__ out,
                                                             long long count, int block, long long nsb, int frame,
                                                             long long fb, int acc) {
    gc_ada_dec_kernel(msg, tiers, off, out, count, block, nsb, frame, fb, acc);
}

// ---------------------------------------------------------------- float32 <-> float64 casts
// y = x converted (float32 -> float64 exactly; float64 -> float32 rounded to nearest even), for
// the collectives' float64 accumulation on device arrays (giftcomm._xp.astype): explicit
// cvt.f64.f32 / cvt.rn.f32.f64 without .ftz, where a CuPy astype (compiled with -ftz=true) reads a
// subnormal float32 as zero or writes a subnormal float32 result as zero.
extern "C" __global__ void __launch_bounds__(256) gc_cvt_f32_f64(const float* __restrict__ x, double* __restrict__ y,
                                                                 long long count) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (long long)gridDim.x * blockDim.x)
        y[i] = gc_f32_to_f64(x[i]);
}

extern "C" __global__ void __launch_bounds__(256) gc_cvt_f64_f32(const double* __restrict__ x, float* __restrict__ y,
                                                                 long long count) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (long long)gridDim.x * blockDim.x)
        y[i] = gc_f64_to_f32(x[i]);
}
