/* giftcomm native codec: the adaptive-precision rows (rules and layout: giftcomm/adaptive.py; bit for
 * bit the NumPy reference giftcomm/reference/adaptive.py), part of the per-instruction-set template
 * (included by gc_kernels.h after gc_kernels_mx.h, with K() defined).
 *
 * A message is frames of up to spec->frame super-blocks of `block` values. Encode of a frame: the
 * super-blocks' amax (max |bits|: NaN above Inf above the finite values), the rank thresholds of
 * the k8 and k8 + k4 largest (radix selection, ties to the lower index: gc_ada_threshold), then one
 * pass in index order writes each super-block's choice bits, super-scale and payload at its place
 * in its tier's section. Decode walks the choice bits the same way; a frame whose choice bits do
 * not give the row's tier counts decodes to NaN (gc_module.c refuses such a message with
 * ValueError before any kernel runs; the plan channel's trusted path gets NaN, never a read out
 * of bounds). Arithmetic is float32 in the reference's order; the INT2 stochastic rounding's
 * (y + 3) / 2 and the integer tiers' fraction bits are float64 as there.
 */
#include "gc_adaptive.h"

#ifndef GC_ADA_KINDS
#define GC_ADA_KINDS
/* element kinds of the scaled tiers: group (values per E4M3 scale), element bits, clip bound */
#define GC_ADA_INT8 0
#define GC_ADA_INT4 1
#define GC_ADA_E2M1 2
#define GC_ADA_INT2 3
#define GC_ADA_GROUP(k) ((k) == GC_ADA_INT8 || (k) == GC_ADA_INT2 ? 32u : 16u)
#define GC_ADA_BITS(k) ((k) == GC_ADA_INT8 ? 8u : (k) == GC_ADA_INT2 ? 2u : 4u)
#define GC_ADA_EMAX(k) ((k) == GC_ADA_INT8 ? 127.0f : (k) == GC_ADA_INT4 ? 7.0f : (k) == GC_ADA_E2M1 ? 6.0f : 3.0f)
#define GC_ADA_QNAN 0x7fc00000u
#endif

/* INT8 code (the int8's byte) of y in [-127, 127]: nearest (ties to even, exact for |y| < 2^23 by
 * the add-and-subtract of 2^23) or stochastic (floor(|y|) + 1 when the 32 truncated fraction bits
 * of |y| plus r carry out of 32 bits); the sign applied after (-0 gives 0) */
GC_INLINE uint32_t K(ada_qint)(float y, uint32_t r, const int sr)
{
    uint32_t u = gc_bits(y);
    float a = gc_float(u & 0x7fffffffu);
    uint32_t m;
    if (sr) {
        uint32_t fl = (uint32_t)a;
        uint32_t frac = (uint32_t)((double)(a - (float)fl) * 4294967296.0);
        m = fl + (uint32_t)(frac + r < frac);
    } else {
        m = (uint32_t)((a + 0x1p23f) - 0x1p23f);
    }
    return (u >> 31 ? 0u - m : m) & 0xffu;
}

/* INT2 midrise code (bit 1 the sign, bit 0 magnitude 3) of y in [-3, 3]: nearest (3 when |y| >= 2,
 * the sign of y), or stochastic on the level index of -3, -1, 1, 3: u = (y + 3) / 2 in float64 */
GC_INLINE uint32_t K(ada_qint2)(float y, uint32_t r, const int sr)
{
    uint32_t b = gc_bits(y);
    if (!sr)
        return ((b >> 31) << 1) | (uint32_t)((b & 0x7fffffffu) >= 0x40000000u);
    double u = ((double)y + 3.0) * 0.5;
    uint32_t fl = (uint32_t)u;
    uint32_t frac = (uint32_t)((u - (double)fl) * 4294967296.0);
    uint32_t level = fl + (uint32_t)(frac + r < frac);
    level = level < 3u ? level : 3u;
    return (0x1023u >> (4u * level)) & 0xfu; /* levels 0..3 -> codes 3, 2, 0, 1 */
}

/* element code of y (already clipped) of kind `kind` */
GC_INLINE uint32_t K(ada_qelem)(float y, uint32_t r, const int kind, const int sr)
{
    if (kind == GC_ADA_INT2)
        return K(ada_qint2)(y, r, sr);
    if (kind == GC_ADA_E2M1)
        return K(qelem)(y, 1.0f, r, GC_ELEM_E2M1, sr);
    return K(ada_qint)(y, r, sr);
}

/* The element codes of `len` values packed at p (value i at bits bits * (i % (8 / bits)) of byte
 * i / (8 / bits)) */
GC_INLINE void K(ada_pack)(const uint8_t *restrict c, size_t len, uint8_t *restrict p, const unsigned bits)
{
    if (bits == 8u) {
        memcpy(p, c, len);
    } else if (bits == 4u) {
        for (size_t j = 0; j < len / 2u; j++)
            p[j] = (uint8_t)((c[2 * j] & 0xfu) | (c[2 * j + 1] << 4));
    } else {
        for (size_t j = 0; j < len / 4u; j++)
            p[j] = (uint8_t)(c[4 * j] | (c[4 * j + 1] << 2) | (c[4 * j + 2] << 4) | (c[4 * j + 3] << 6));
    }
}

/* INT8 / INT4 nearest code of x * inv: min(|y|, emax) rounded (ties even), then the sign of y */
GC_INLINE uint32_t K(ada_rint)(float x, float inv, const float emax)
{
    uint32_t u = gc_bits(x * inv);
    float a = gc_float(u & 0x7fffffffu);
    a = a < emax ? a : emax;
    int32_t q = (int32_t)((a + 0x1p23f) - 0x1p23f), s = -(int32_t)(u >> 31);
    return (uint32_t)((q ^ s) - s);
}

/* One super-block of `block` values v (zero-padded; r: their random bits, or NULL for nearest) in a
 * scaled tier: the packed elements at pay, then the E4M3 scale bytes (NVFP4's two-level rule with
 * the super-block as its group, giftcomm.reference.adaptive._scaled_tier); returns the super-scale.
 * g16: the max |bits| of each 16 values of v. */
GC_INLINE float K(ada_scaled)(const float *restrict v, size_t block, const uint32_t *restrict g16,
                              const uint32_t *restrict r, uint8_t *restrict pay, const int kind)
{
    const size_t grp = GC_ADA_GROUP(kind), ng = block / grp, nel = block * GC_ADA_BITS(kind) / 8u;
    const float emax = GC_ADA_EMAX(kind);
    uint8_t *bsp = pay + nel;
    uint32_t gm[GC_ADA_MAX_BLOCK / 16u], bits = 0;
    for (size_t g = 0; g < ng; g++) {
        if (grp == 32u)
            gm[g] = g16[2 * g] > g16[2 * g + 1] ? g16[2 * g] : g16[2 * g + 1];
        else
            gm[g] = g16[g];
        bits = gm[g] > bits ? gm[g] : bits;
    }
    if (bits >= GC_INF_BITS) {
        memset(pay, 0, nel + ng);
        return gc_float(GC_ADA_QNAN);
    }
    float gf = gc_float(bits);
    int tiny = gf < 0x1p-100f;
    float gsafe = tiny ? 1.0f : gf;
    float s2 = tiny ? 1.0f : gsafe / (448.0f * emax), q2 = tiny ? 0.0f : 448.0f / gsafe;
    uint8_t codes[GC_ADA_MAX_BLOCK];
    float inv[GC_ADA_MAX_BLOCK / 16u];
    for (size_t g = 0; g < ng; g++) { /* the E4M3 scales of all groups at once (gcc vectorizes it) */
        uint32_t m = gm[g];
        float t = gc_float(m) * q2;
        t = t < 448.0f ? t : 448.0f;
        uint32_t bs = gc_q8(gc_bits(t), 0);
        bs += gc_d8(bs, 0) < t; /* round up: no element saturates */
        bs = bs ? bs : 1u;
        bs = m != 0 && !tiny ? bs : 0u;
        float d = gc_d8(bs, 0) * s2;
        inv[g] = bs ? 1.0f / (bs ? d : 1.0f) : 0.0f;
        bsp[g] = (uint8_t)bs;
    }
    if (!r) { /* nearest: one pass over the super-block with each value's multiplier */
        float iv[GC_ADA_MAX_BLOCK];
        for (size_t g = 0; g < ng; g++)
            for (size_t i = 0; i < grp; i++)
                iv[g * grp + i] = inv[g];
        if (kind == GC_ADA_INT2) {
            for (size_t i = 0; i < block; i++) {
                uint32_t u = gc_bits(v[i] * iv[i]);
                codes[i] = (uint8_t)(((u >> 31) << 1) | (uint32_t)((u & 0x7fffffffu) >= 0x40000000u));
            }
        } else if (kind == GC_ADA_E2M1) {
            for (size_t i = 0; i < block; i++) {
                float y = v[i] * iv[i];
                y = y < -emax ? -emax : (y > emax ? emax : y);
                codes[i] = (uint8_t)K(ada_qelem)(y, 0u, kind, 0);
            }
        } else {
            for (size_t i = 0; i < block; i++)
                codes[i] = (uint8_t)K(ada_rint)(v[i], iv[i], emax);
        }
    } else {
        for (size_t g = 0; g < ng; g++) { /* a group of scale 0 (zeros) keeps nearest codes: their signs */
            const float *restrict x = v + g * grp;
            const uint32_t *rg = r + g * grp;
            uint8_t *restrict c = codes + g * grp;
            const int sr = bsp[g] != 0;
            for (size_t i = 0; i < grp; i++) {
                float y = x[i] * inv[g];
                y = y < -emax ? -emax : (y > emax ? emax : y);
                c[i] = (uint8_t)(sr ? K(ada_qelem)(y, rg[i], kind, 1) : K(ada_qelem)(y, 0u, kind, 0));
            }
        }
    }
    K(ada_pack)(codes, block, pay, GC_ADA_BITS(kind));
    return s2;
}

/* One super-block in the E4M3 8-bit tier: the e4m3 row's rule with the super-block as its block
 * (a non-finite one: zero codes, super-scale NaN); returns the scale. */
GC_INLINE float K(ada_t8e4m3)(const float *restrict v, size_t block, const uint32_t *restrict g16,
                              const uint32_t *restrict r, uint8_t *restrict pay)
{
    uint32_t bits = 0;
    for (size_t g = 0; g < block / 16u; g++)
        bits = g16[g] > bits ? g16[g] : bits;
    if (bits >= GC_INF_BITS) {
        memset(pay, 0, block);
        return gc_float(GC_ADA_QNAN);
    }
    float amax = gc_float(bits), scale = 1.0f, inv = 1.0f;
    if (!(amax < GC8_TINY(0))) {
        scale = amax / 448.0f;
        inv = 448.0f / amax;
    }
    if (r) {
        for (size_t i = 0; i < block; i++) {
            float y = v[i] * inv;
            y = y < -448.0f ? -448.0f : (y > 448.0f ? 448.0f : y);
            pay[i] = (uint8_t)K(qelem)(y, 1.0f, r[i], GC_ELEM_E4M3, 1);
        }
    } else {
        for (size_t i = 0; i < block; i++)
            pay[i] = (uint8_t)gc_q8(gc_bits(v[i] * inv), 0);
    }
    return scale;
}

/* A frame that cannot be ranked (no scratch memory): every super-block non-finite (decodes to
 * NaN), the tiers in index order, so the failure shows and the layout stays valid. */
static void K(ada_nan_frame)(const gc_ada_spec *sp, size_t nsb, size_t block, uint8_t *fr)
{
    size_t k8, k4;
    gc_ada_counts(sp, nsb, block, &k8, &k4);
    size_t cb = gc_ada_choice_bytes(nsb);
    memset(fr, 0, gc_ada_frame_bytes(sp, nsb, block));
    for (size_t j = 0; j < nsb; j++) {
        uint32_t t = j < k8 ? GC_ADA_T8 : j < k8 + k4 ? GC_ADA_T4 : GC_ADA_T2;
        fr[j / 4u] |= (uint8_t)(t << (2u * (j % 4u)));
        gc_store_f32(fr + cb + 4u * j, gc_float(GC_ADA_QNAN));
    }
}

/* g16[g] = max |bits| of v[16 g .. 16 g + 15] for g < n16 (a multiple of 8); returns their max.
 * The SIMD variants reduce 8 (16) groups at once by the nvfp4 kernels' transpose-max. */
GC_INLINE uint32_t K(ada_g16)(const float *restrict v, size_t n16, uint32_t *restrict g16)
{
    size_t g = 0;
    uint32_t m = 0;
#if GC_VEC_MX && defined(GC_X512)
    if (n16 % 16u == 0) {
        const __m512i absm = GV_SET1(0x7fffffffu);
        __m512i mx = _mm512_setzero_si512();
        for (; g < n16; g += 16) {
            __m512i vv[16];
            for (int i = 0; i < 16; i++)
                vv[i] = _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(v + 16 * (g + (size_t)i))), absm);
            __m512i t = K(v_amax16)(vv);
            _mm512_storeu_si512((void *)(g16 + g), t);
            mx = _mm512_max_epu32(mx, t);
        }
        return _mm512_reduce_max_epu32(mx);
    }
#elif GC_VEC_MX && defined(GC_X256)
    const __m256i absm = GV_SET1(0x7fffffffu);
    __m256i mx = _mm256_setzero_si256();
    for (; g + 8 <= n16; g += 8) {
        __m256i vv[8];
        for (int i = 0; i < 8; i++) {
            const float *p = v + 16 * (g + (size_t)i);
            vv[i] = _mm256_max_epu32(_mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(p)), absm),
                                     _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(p + 8)), absm));
        }
        __m256i t = K(t8max)(vv);
        _mm256_storeu_si256((__m256i *)(void *)(g16 + g), t);
        mx = _mm256_max_epu32(mx, t);
    }
    m = K(hmax8)(mx);
#endif
    for (; g < n16; g++) {
        g16[g] = K(amax_plain)(v + 16 * g, 16);
        m = g16[g] > m ? g16[g] : m;
    }
    return m;
}

/* One frame: nsb super-blocks of x (len values; the last super-block zero-padded), random bits of
 * element idx0 + i (rng) or nearest, into fr. am: scratch of nsb * (1 + block / 16) words (each
 * super-block's amax, then the amax of every 16 values: the one pass over x before the ranking
 * finds them, the tiers' scales take them from there). */
static void K(ada_encode_frame)(const gc_ada_spec *sp, const float *x, size_t len, size_t nsb, size_t block,
                                uint8_t *fr, uint32_t *restrict am, const gc_rng *rng, uint64_t idx0)
{
    size_t k8, k4;
    const size_t n16 = block / 16u;
    uint32_t *restrict g16 = am + nsb;
    gc_ada_counts(sp, nsb, block, &k8, &k4);
    for (size_t j = 0; j < nsb; j++) {
        const float *v = x + j * block;
        uint32_t *gj = g16 + j * n16, m = 0;
        if (len - j * block >= block) {
            m = K(ada_g16)(v, n16, gj);
        } else { /* the partial last super-block: zeros past the count */
            size_t l = len - j * block;
            for (size_t g = 0; g < n16; g++) {
                gj[g] = 16 * g < l ? K(amax_plain)(v + 16 * g, l - 16 * g < 16 ? l - 16 * g : 16) : 0u;
                m = gj[g] > m ? gj[g] : m;
            }
        }
        am[j] = m;
    }
    uint32_t v8, v4;
    int64_t c8, c4;
    gc_ada_threshold(am, nsb, k8, &v8, &c8);
    gc_ada_threshold(am, nsb, k8 + k4, &v4, &c4);
    const size_t cb = gc_ada_choice_bytes(nsb), t8 = gc_ada_t8(sp, block), t4 = gc_ada_t4(block), t2 = gc_ada_t2(block);
    memset(fr, 0, cb);
    uint8_t *sec8 = fr + gc_ada_head(nsb), *sec4 = sec8 + k8 * t8, *sec2 = sec4 + k4 * t4;
    float buf[GC_ADA_MAX_BLOCK];
    uint32_t rb[GC_ADA_MAX_BLOCK];
    for (size_t j = 0; j < nsb; j++) {
        uint32_t a = am[j];
        int64_t jj = (int64_t)j;
        uint32_t tier = (a > v8 || (a == v8 && jj <= c8)) ? GC_ADA_T8
                        : (a > v4 || (a == v4 && jj <= c4)) ? GC_ADA_T4 : GC_ADA_T2;
        fr[j / 4u] |= (uint8_t)(tier << (2u * (j % 4u)));
        const float *v = x + j * block;
        size_t l = len - j * block < block ? len - j * block : block;
        if (l < block) { /* the partial last super-block: zeros past the count, random bits 0 */
            memcpy(buf, v, 4 * l);
            memset(buf + l, 0, 4 * (block - l));
            v = buf;
        }
        const uint32_t *r = NULL;
        if (rng) {
            K(rbits)(rng, idx0 + j * block, l, rb);
            memset(rb + l, 0, 4 * (block - l));
            r = rb;
        }
        const uint32_t *gj = g16 + j * n16;
        float s;
        if (tier == GC_ADA_T8) {
            s = sp->top_int8 ? K(ada_scaled)(v, block, gj, r, sec8, GC_ADA_INT8) : K(ada_t8e4m3)(v, block, gj, r, sec8);
            sec8 += t8;
        } else if (tier == GC_ADA_T4) {
            s = sp->mid_int4 ? K(ada_scaled)(v, block, gj, r, sec4, GC_ADA_INT4)
                             : K(ada_scaled)(v, block, gj, r, sec4, GC_ADA_E2M1);
            sec4 += t4;
        } else {
            s = K(ada_scaled)(v, block, gj, r, sec2, GC_ADA_INT2);
            sec2 += t2;
        }
        gc_store_f32(fr + cb + 4u * j, s);
    }
}

static void K(encode_ada)(const gc_ada_spec *sp, const float *x, size_t n, uint8_t *msg, size_t block, const gc_rng *rng)
{
    size_t nsb = (n + block - 1u) / block, most = nsb < sp->frame ? nsb : sp->frame;
    size_t words = most * (1u + block / 16u);
    uint32_t local[2048];
    uint32_t *am = words <= 2048u ? local : (uint32_t *)malloc(4u * words);
    for (size_t s0 = 0; s0 < nsb; s0 += sp->frame) {
        size_t m = nsb - s0 < sp->frame ? nsb - s0 : sp->frame;
        size_t i0 = s0 * block, len = n - i0 < m * block ? n - i0 : m * block;
        uint64_t idx0 = rng ? rng->offset + i0 : 0u;
        if (am)
            K(ada_encode_frame)(sp, x + i0, len, m, block, msg, am, rng, idx0);
        else
            K(ada_nan_frame)(sp, m, block, msg);
        msg += gc_ada_frame_bytes(sp, m, block);
    }
    if (am != local)
        free(am);
}

/* One super-block's `block` values from its payload (tier, super-scale s). */
GC_INLINE void K(ada_dec_sb)(const gc_ada_spec *sp, const uint8_t *restrict pay, uint32_t tier, float s, size_t block,
                             float *restrict out)
{
    if (tier == GC_ADA_T8 && !sp->top_int8) {
        for (size_t i = 0; i < block; i++)
            out[i] = gc_d8(pay[i], 0) * s;
        return;
    }
    const int kind = tier == GC_ADA_T8 ? GC_ADA_INT8 : tier == GC_ADA_T2 ? GC_ADA_INT2
                     : sp->mid_int4 ? GC_ADA_INT4 : GC_ADA_E2M1;
    const size_t grp = GC_ADA_GROUP(kind), nel = block * GC_ADA_BITS(kind) / 8u;
    if (!((gc_bits(s) & 0x7fffffffu) < GC_INF_BITS)) { /* a non-finite super-scale: NaN values */
        for (size_t i = 0; i < block; i++)
            out[i] = gc_float(GC_ADA_QNAN);
        return;
    }
    for (size_t g = 0; g < block / grp; g++) {
        float d = gc_d8(pay[nel + g], 0) * s;
        float *o = out + g * grp;
        size_t i0 = g * grp;
        if (kind == GC_ADA_INT8) {
            for (size_t i = 0; i < grp; i++)
                o[i] = (float)(int8_t)pay[i0 + i] * d;
        } else if (kind == GC_ADA_INT2) { /* code c: (1 + 2 (c & 1)) * (1 - (c & 2)) */
            const uint8_t *p = pay + i0 / 4u;
            for (size_t j = 0; j < grp / 4u; j++)
                for (unsigned k = 0; k < 4u; k++) {
                    int32_t c = (p[j] >> (2u * k)) & 3;
                    o[4 * j + k] = (float)((1 + 2 * (c & 1)) * (1 - (c & 2))) * d;
                }
        } else {
            const uint8_t *p = pay + i0 / 2u;
            for (size_t j = 0; j < grp / 2u; j++)
                for (unsigned k = 0; k < 2u; k++) {
                    uint32_t c = (uint32_t)(p[j] >> (4u * k)) & 0xfu;
                    float e = kind == GC_ADA_INT4 ? (float)((int32_t)(c ^ 8u) - 8) : gc_de2m1(c);
                    o[2 * j + k] = e * d;
                }
        }
    }
}

/* the decoded value v of an output slot: mode 0 out = v; 1 out = out + v; 2 out = v + add[i] */
GC_INLINE void K(ada_put)(float *restrict out, const float *add, const float *restrict v, size_t len, const int mode)
{
    for (size_t i = 0; i < len; i++)
        out[i] = mode == 0 ? v[i] : mode == 1 ? gc_addf(out[i], v[i]) : gc_addf(v[i], add[i]);
}

static void K(ada_decode_frame)(const gc_ada_spec *sp, const uint8_t *fr, size_t nsb, size_t len, size_t block,
                                float *out, const float *add, const int mode)
{
    float buf[GC_ADA_MAX_BLOCK];
    if (!gc_ada_frame_ok(sp, fr, nsb, block)) {
        for (size_t i = 0; i < block; i++)
            buf[i] = gc_float(GC_ADA_QNAN);
        for (size_t i0 = 0; i0 < len; i0 += block)
            K(ada_put)(out + i0, add ? add + i0 : NULL, buf, len - i0 < block ? len - i0 : block, mode);
        return;
    }
    size_t k8, k4;
    gc_ada_counts(sp, nsb, block, &k8, &k4);
    const size_t cb = gc_ada_choice_bytes(nsb), t8 = gc_ada_t8(sp, block), t4 = gc_ada_t4(block), t2 = gc_ada_t2(block);
    const uint8_t *sec8 = fr + gc_ada_head(nsb), *sec4 = sec8 + k8 * t8, *sec2 = sec4 + k4 * t4;
    for (size_t j = 0; j < nsb; j++) {
        uint32_t tier = (fr[j / 4u] >> (2u * (j % 4u))) & 3u;
        const uint8_t *p;
        if (tier == GC_ADA_T8) {
            p = sec8;
            sec8 += t8;
        } else if (tier == GC_ADA_T4) {
            p = sec4;
            sec4 += t4;
        } else {
            p = sec2;
            sec2 += t2;
        }
        size_t i0 = j * block, l = len - i0 < block ? len - i0 : block;
        if (mode == 0 && l == block) {
            K(ada_dec_sb)(sp, p, tier, gc_load_f32(fr + cb + 4u * j), block, out + i0);
        } else {
            K(ada_dec_sb)(sp, p, tier, gc_load_f32(fr + cb + 4u * j), block, buf);
            K(ada_put)(out + i0, add ? add + i0 : NULL, buf, l, mode);
        }
    }
}

/* mode: see K(ada_put) (add: mode 2's second operand, n values) */
static void K(decode_ada)(const gc_ada_spec *sp, const uint8_t *msg, size_t n, float *out, const float *add,
                          size_t block, const int mode)
{
    size_t nsb = (n + block - 1u) / block;
    for (size_t s0 = 0; s0 < nsb; s0 += sp->frame) {
        size_t m = nsb - s0 < sp->frame ? nsb - s0 : sp->frame;
        size_t i0 = s0 * block, len = n - i0 < m * block ? n - i0 : m * block;
        K(ada_decode_frame)(sp, msg, m, len, block, out + i0, add ? add + i0 : NULL, mode);
        msg += gc_ada_frame_bytes(sp, m, block);
    }
}

/* fused hop: the whole message is decoded and added first (its frames' tiers are chosen from all
 * of their sums), into sum_out or tmp (n floats), then encoded; msg_in may be msg_out, and
 * sum_out may be local (element-wise) */
static void K(dae_ada)(const gc_ada_spec *sp, const uint8_t *msg_in, const float *local, size_t n, uint8_t *msg_out,
                       float *sum_out, size_t block, float *tmp, const gc_rng *rng)
{
    float *dst = sum_out ? sum_out : tmp;
    K(decode_ada)(sp, msg_in, n, dst, local, block, 2);
    K(encode_ada)(sp, dst, n, msg_out, block, rng);
}
