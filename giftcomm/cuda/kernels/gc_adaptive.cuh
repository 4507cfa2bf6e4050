// gc_adaptive.cuh -- the adaptive-precision rows (giftcomm/adaptive.py: rules and wire layout;
// giftcomm/reference/adaptive.py: the NumPy reference, bit for bit) with an INT8 8-bit tier and an
// INT4 4-bit tier (AdaptiveSpec top = "int8", mid = "int4": the table's ada4_5 and ada4).
//
// A message of `count` values is nsb = ceil(count / block) super-blocks of `block` values (a
// multiple of 128; the last one zero-padded), cut into frames of F super-blocks (the last frame
// may be partial). Every kernel runs 128 threads per CTA, grid-stride; gc_ada_keys, gc_ada_enc and
// gc_ada_dec take one super-block per CTA iteration, thread t its values t, t + 128, ..., so a
// 32-value element group is one warp and a 16-value group half of one.
//   gc_ada_keys     the sort key of each super-block: (frame mod run) << 47 | (0x7FFFFFFF -
//                   amax bits) << 16 | index in frame (run <= 2^17: the host sorts runs of `run`
//                   whole frames). amax bits: max of |x| bits (NaN above Inf above every finite
//                   value), zero padding included. Ascending keys = each frame's super-blocks by
//                   descending amax, ties by index (the reference's rank).
//   gc_ada_tiers    from a sorted run of keys (whole frames): the choice code of each super-block
//                   (rank < k8: 2, < k8 + k4: 1, else 0; the counts of a full or the last frame).
//   gc_ada_enc      elements, element scales and super-scale of each super-block at its tier,
//                   into its tier section (byte offset `off`, from the host's per-frame prefix
//                   counts), and the frame's choice bits (one 4-byte word per 16 super-blocks,
//                   written by the CTA of the word's first super-block).
//   gc_ada_choices  decode: the choice code of each super-block from the message.
//   gc_ada_dec      decode (acc 0: out = value) or decode-accumulate (acc 1: out += value).
// The message is written and read one byte at a time (no alignment needed). Float arithmetic goes
// through gc_mul / gc_div / gc_add (gc_fp8.cuh: IEEE, no contraction, no flush to zero); the
// stochastic roundings use float64 exactly as the reference does (one add of 3.0 to a float32,
// which rounds only below 2^-26 or so, and multiplications by powers of two).
#pragma once
// needs gc_fp8.cuh and gc_mx.cuh included before it (gc_rbits, gc_e4m3)

#define GC_ADA_THREADS 128
#define GC_ADA_TIER_T2 0
#define GC_ADA_TIER_T4 1
#define GC_ADA_TIER_T8 2

// the facts of a tier: values per E4M3 element scale, element bits, largest element magnitude,
// super-scale divisor (448 * max)
struct gc_ada_tier {
    int group, bits;
    float emax, sdiv;
    static GC_HD gc_ada_tier of(int tier) {
        gc_ada_tier t;
        if (tier == GC_ADA_TIER_T8) { t.group = 32; t.bits = 8; t.emax = 127.0f; t.sdiv = 56896.0f; }
        else if (tier == GC_ADA_TIER_T4) { t.group = 16; t.bits = 4; t.emax = 7.0f; t.sdiv = 3136.0f; }
        else { t.group = 32; t.bits = 2; t.emax = 3.0f; t.sdiv = 1344.0f; }
        return t;
    }
};

// floor of a non-negative float32 below 2^23 from its bits (integer operations only: a float
// conversion instruction would take -ftz)
GC_HD int gc_ada_floor(gc_u32 a) {
    if (a < 0x3F800000u) return 0;
    return (int)(((a & 0x7FFFFFu) | 0x800000u) >> (150u - (a >> 23)));
}

// INT8 / INT4 code (the int8 byte; INT4 keeps its low nibble) of y in [-emax, emax]: |y| rounded
// to nearest even, or stochastically (floor(|y|) + 1 when the first 32 bits of frac(|y|) plus r
// reach 2^32), the sign of y applied after (-0 gives 0)
GC_HD gc_u32 gc_ada_int_code(float y, gc_u32 r, bool sr) {
    const gc_u32 u = gc_f2u(y);
    const float a = gc_u2f(u & 0x7FFFFFFFu);
    int m;
    if (!sr) {
        m = gc_rint_small(a);
    } else {
        const int fl = gc_ada_floor(u & 0x7FFFFFFFu);
        const gc_u64 frac = (gc_u64)(gc_f32_to_f64(gc_add(a, gc_u2f(gc_f2u((float)fl) ^ 0x80000000u))) * 4294967296.0);
        m = fl + (frac + (gc_u64)r >= 0x100000000ull ? 1 : 0);
    }
    return (gc_u32)(gc_u8)(signed char)((u >> 31) ? -m : m);
}

// INT2 midrise code (bit 1 the sign, bit 0 set for magnitude 3) of y in [-3, 3]: nearest (3 when
// |y| >= 2, else 1; the sign bit of y) or stochastic on the level index of -3, -1, 1, 3
GC_HD gc_u32 gc_ada_int2_code(float y, gc_u32 r, bool sr) {
    const gc_u32 u = gc_f2u(y);
    if (!sr) return ((u >> 31) << 1) | ((u & 0x7FFFFFFFu) >= 0x40000000u ? 1u : 0u);
    const double w = (gc_f32_to_f64(y) + 3.0) * 0.5;
    const int fl = (int)w;  // w in [0, 3]
    const gc_u64 frac = (gc_u64)((w - (double)fl) * 4294967296.0);
    int level = fl + (frac + (gc_u64)r >= 0x100000000ull ? 1 : 0);
    level = level < 3 ? level : 3;
    return (0x1023u >> (4 * level)) & 0xFu;  // level 0..3 -> codes 3, 2, 0, 1
}

// the element code of a tier
GC_HD gc_u32 gc_ada_code(int bits, float y, gc_u32 r, bool sr) {
    return bits == 2 ? gc_ada_int2_code(y, r, sr) : gc_ada_int_code(y, r, sr);
}

// the super-scale rule from a finite super-block amax g (bits): s2 (written), q2
struct gc_ada_super {
    float s2, q2;
    bool tiny;
    static GC_HD gc_ada_super from_bits(gc_u32 g, float sdiv) {
        gc_ada_super r;
        r.tiny = g < 0x0D800000u;  // 2^-100 (non-negative bits: an integer compare)
        r.s2 = r.tiny ? 1.0f : gc_div(gc_u2f(g), sdiv);
        r.q2 = r.tiny ? 0.0f : gc_div(448.0f, gc_u2f(g));
        return r;
    }
};

// E4M3 element-scale code of a group of amax bits m under the super-scale, rounded up so that no
// element saturates (0: a zero group or a tiny super-block), and the encode multiplier inv
GC_HD gc_u32 gc_ada_group_scale(gc_u32 m, const gc_ada_super& s, float* inv) {
    *inv = 0.0f;
    if (s.tiny || m == 0) return 0u;
    float t = gc_mul(gc_u2f(m), s.q2);
    t = gc_f2u(t) < 0x43E00000u ? t : 448.0f;  // min(t, 448) on the bits of t >= 0
    gc_u32 bs = gc_f32_to_fp8_sat_portable<3, 7, 0x7Eu>(t);  // as gc_nv_block
    bs += gc_f2u(gc_e4m3::to_f32((gc_u8)bs)) < gc_f2u(t) ? 1u : 0u;
    bs = bs ? bs : 1u;
    *inv = gc_div(1.0f, gc_mul(gc_e4m3::to_f32((gc_u8)bs), s.s2));
    return bs;
}

// the super-blocks of the frame holding super-block sb (F per full frame, nsb in all)
GC_DEV long long gc_ada_frame_len(long long sb, int F, long long nsb) {
    const long long first = sb - sb % F;
    return nsb - first < F ? nsb - first : F;
}

// max over the CTA of v (blockDim.x == GC_ADA_THREADS); red: 4 words of shared memory
GC_DEV gc_u32 gc_ada_cta_max(gc_u32 v, gc_u32* red) {
    for (int o = 16; o > 0; o >>= 1) v = gc_umax(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = gc_umax(gc_umax(red[0], red[1]), gc_umax(red[2], red[3]));
    __syncthreads();  // red is rewritten by the next iteration
    return v;
}

GC_DEV void gc_ada_keys_kernel(const float* __restrict__ x, gc_u64* __restrict__ keys, long long count, int block,
                               long long nsb, int F, int run) {
    __shared__ gc_u32 red[4];
    for (long long sb = blockIdx.x; sb < nsb; sb += gridDim.x) {
        const long long base = sb * (long long)block;
        gc_u32 m = 0;
        for (int e = threadIdx.x; e < block; e += GC_ADA_THREADS) {
            if (base + e < count) m = gc_umax(m, gc_abs_bits(x[base + e]));
        }
        m = gc_ada_cta_max(m, red);
        if (threadIdx.x == 0) {
            const long long f = sb / F;
            keys[sb] = ((gc_u64)(f % run) << 47) | ((gc_u64)(0x7FFFFFFFu - m) << 16) | (gc_u64)(sb - f * F);
        }
    }
}

// sorted: n keys of whole frames, the first of them super-block `first` (a multiple of F);
// counts: k8, k4 of a full frame, then of the last frame of nsb % F super-blocks (if any)
GC_DEV void gc_ada_tiers_kernel(const gc_u64* __restrict__ sorted, gc_u8* __restrict__ tiers, long long n,
                                long long first, int F, long long nsb, int k8f, int k4f, int k8r, int k4r) {
    for (long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x; p < n; p += (long long)gridDim.x * blockDim.x) {
        const gc_u64 k = sorted[p];
        const long long fr = (long long)(k >> 47);
        const long long sb = first + fr * F + (long long)(k & 0xFFFFu);
        const long long rank = p - fr * F;
        const bool full = gc_ada_frame_len(sb, F, nsb) == F;
        const long long k8 = full ? k8f : k8r, k4 = full ? k4f : k4r;
        tiers[sb] = (gc_u8)(rank < k8 ? GC_ADA_TIER_T8 : (rank < k8 + k4 ? GC_ADA_TIER_T4 : GC_ADA_TIER_T2));
    }
}

// fb: bytes of a full frame; off[sb]: the message byte of super-block sb's tier payload
GC_DEV void gc_ada_enc_kernel(const float* __restrict__ x, const gc_u64* __restrict__ keys, const gc_u8* __restrict__ tiers,
                              const long long* __restrict__ off, gc_u8* __restrict__ msg, long long count, int block,
                              long long nsb, int F, long long fb, int sr, gc_u64 key, gc_u64 offset) {
    const int tid = threadIdx.x;
    for (long long sb = blockIdx.x; sb < nsb; sb += gridDim.x) {
        const int tier = tiers[sb];
        const gc_ada_tier t = gc_ada_tier::of(tier);
        const gc_u32 g = 0x7FFFFFFFu - (gc_u32)((keys[sb] >> 16) & 0x7FFFFFFFu);
        const bool finite = g < GC_F32_INF_BITS;
        const gc_ada_super s = gc_ada_super::from_bits(finite ? g : 0u, t.sdiv);
        gc_u8* body = msg + off[sb];
        const int nel = block * t.bits / 8;  // element bytes; the element scales follow
        const int per = 8 / t.bits;          // codes per byte
        const long long base = sb * (long long)block;
        for (int e = tid; e < block; e += GC_ADA_THREADS) {  // uniform trip count: block % 128 == 0
            const long long i = base + e;
            const float v = (finite && i < count) ? x[i] : 0.0f;
            gc_u32 m = gc_abs_bits(v);
            for (int o = t.group >> 1; o > 0; o >>= 1) m = gc_umax(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
            float inv;
            gc_u32 bs = gc_ada_group_scale(m, s, &inv);
            const float y = gc_clip(gc_mul(v, inv), t.emax);
            const gc_u32 r = (sr && i < count) ? gc_rbits(key, offset + (gc_u64)i) : 0u;
            gc_u32 code = gc_ada_code(t.bits, y, r, sr && bs != 0);  // a zero-scale group: nearest codes
            if (!finite) code = bs = 0;
            gc_u32 w = (code & ((1u << t.bits) - 1u)) << (t.bits * (e % per));
            for (int o = 1; o < per; o <<= 1) w |= __shfl_xor_sync(0xFFFFFFFFu, w, o);
            if (e % per == 0) body[e / per] = (gc_u8)w;
            if (e % t.group == 0) body[nel + e / t.group] = (gc_u8)bs;
        }
        if (tid == 0) {
            const long long f = sb / F, j = sb - f * F;
            const long long n = gc_ada_frame_len(sb, F, nsb);
            gc_u8* head = msg + f * fb;
            const gc_u32 sc = finite ? gc_f2u(s.s2) : GC_F32_QNAN_BITS;
            gc_u8* sp = head + 4 * ((n + 15) / 16) + 4 * j;
            for (int b = 0; b < 4; ++b) sp[b] = (gc_u8)(sc >> (8 * b));
            if (j % 16 == 0) {  // the choice word of super-blocks j .. j + 15 (zero past n)
                gc_u32 cw = 0;
                for (int q = 0; q < 16 && j + q < n; ++q) cw |= (gc_u32)tiers[sb + q] << (2 * q);
                for (int b = 0; b < 4; ++b) head[j / 4 + b] = (gc_u8)(cw >> (8 * b));
            }
        }
    }
}

GC_DEV void gc_ada_choices_kernel(const gc_u8* __restrict__ msg, gc_u8* __restrict__ tiers, long long nsb, int F,
                                  long long fb) {
    for (long long sb = (long long)blockIdx.x * blockDim.x + threadIdx.x; sb < nsb; sb += (long long)gridDim.x * blockDim.x) {
        const long long f = sb / F, j = sb - f * F;
        tiers[sb] = (gc_u8)((msg[f * fb + j / 4] >> (2 * (j % 4))) & 3u);
    }
}

// decoded value of element e of a super-block (tier facts t, payload body, super-scale s2)
GC_DEV float gc_ada_value(const gc_ada_tier& t, const gc_u8* __restrict__ body, int e, int block, float s2) {
    const int per = 8 / t.bits;
    const gc_u32 c = ((gc_u32)body[e / per] >> (t.bits * (e % per))) & ((1u << t.bits) - 1u);
    float el;
    if (t.bits == 8) el = (float)(int)(signed char)(gc_u8)c;
    else if (t.bits == 4) el = (float)((int)(c ^ 8u) - 8);
    else el = (c & 2u) ? ((c & 1u) ? -3.0f : -1.0f) : ((c & 1u) ? 3.0f : 1.0f);
    const float d = gc_mul(gc_e4m3::to_f32(body[block * t.bits / 8 + e / t.group]), s2);
    return gc_mul(el, d);
}

GC_DEV void gc_ada_dec_kernel(const gc_u8* __restrict__ msg, const gc_u8* __restrict__ tiers, const long long* __restrict__ off,
                              float* __restrict__ out, long long count, int block, long long nsb, int F, long long fb,
                              int acc) {
    for (long long sb = blockIdx.x; sb < nsb; sb += gridDim.x) {
        const gc_ada_tier t = gc_ada_tier::of(tiers[sb]);
        const long long f = sb / F, j = sb - f * F;
        const gc_u8* sp = msg + f * fb + 4 * ((gc_ada_frame_len(sb, F, nsb) + 15) / 16) + 4 * j;
        const gc_u32 sbits = (gc_u32)sp[0] | ((gc_u32)sp[1] << 8) | ((gc_u32)sp[2] << 16) | ((gc_u32)sp[3] << 24);
        const bool finite = (sbits & 0x7FFFFFFFu) < GC_F32_INF_BITS;
        const gc_u8* body = msg + off[sb];
        const long long base = sb * (long long)block;
        for (int e = threadIdx.x; e < block && base + e < count; e += GC_ADA_THREADS) {
            const float v = finite ? gc_ada_value(t, body, e, block, gc_u2f(sbits)) : gc_u2f(GC_F32_QNAN_BITS);
            out[base + e] = acc ? gc_add(out[base + e], v) : v;
        }
    }
}
