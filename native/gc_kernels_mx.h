/* giftcomm native codec: the microscaling / 4-bit formats (mxfp8, mxfp8_e5m2, mxfp4, nvfp4) and
 * stochastic rounding, as part of the per-instruction-set template (included by gc_kernels.h,
 * with K() defined). Rules: docs/wire-format.md and giftcomm/reference/codec.py, bit for bit.
 *
 * Element kinds (ek): 0 E4M3, 1 E5M2, 2 E2M1. The MX and nvfp4 kernels work in chunks of
 * GC_CHUNK = 1024 values (whole MX blocks; exactly one nvfp4 group), so that the random bits,
 * element codes and the fused hop's sums of a chunk stay in L1 in small stack arrays.
 */
#define GCE_M(ek) ((ek) == 0 ? 3 : (ek) == 1 ? 2 : 1)
#define GCE_EMIN(ek) ((ek) == 0 ? -6 : (ek) == 1 ? -14 : 0)
#define GCE_MAXB(ek) ((ek) == 0 ? 0x43e00000u : (ek) == 1 ? 0x47600000u : 0x40c00000u) /* 448, 57344, 6 */
#define GCE_SBIT(ek) ((ek) == 2 ? 3 : 7)
#define GCE_EMAX(ek) ((ek) == 0 ? 8u : (ek) == 1 ? 15u : 2u)
#define GCE_NAN(ek) ((ek) == 2 ? 0u : 0x7fu)
#define GC_INF_BITS 0x7f800000u

/* Philox bits of elements idx0 .. idx0 + len - 1 */
GC_INLINE void K(rbits)(const gc_rng *g, uint64_t idx0, size_t len, uint32_t *restrict r)
{
    const uint32_t k0 = g->k0, k1 = g->k1;
    for (size_t i = 0; i < len; i++) {
        uint64_t idx = idx0 + i;
        r[i] = gc_philox_w0((uint32_t)idx, (uint32_t)(idx >> 32), k0, k1);
    }
}

/* element code of fp32(x * mult), clipped to the element max, rounded (nearest or with bits r) */
GC_INLINE uint32_t K(qelem)(float x, float mult, uint32_t r, const int ek, const int sr)
{
    uint32_t u = gc_bits(x * mult);
    uint32_t a = u & 0x7fffffffu;
    a = a < GCE_MAXB(ek) ? a : GCE_MAXB(ek);
    return gc_qmag(a, r, GCE_M(ek), GCE_EMIN(ek), sr) | ((u >> 31) << GCE_SBIT(ek));
}

GC_INLINE uint32_t K(amax_plain)(const float *restrict x, size_t len)
{
    uint32_t m = 0;
    for (size_t i = 0; i < len; i++) {
        uint32_t a = gc_bits(x[i]) & 0x7fffffffu;
        m = a > m ? a : m;
    }
    return m;
}

/* codes[0..len) of x * mult */
GC_INLINE void K(qloop)(const float *restrict x, size_t len, float mult, const uint32_t *restrict r,
                        uint8_t *restrict codes, const int ek)
{
    if (r) {
        for (size_t i = 0; i < len; i++)
            codes[i] = (uint8_t)K(qelem)(x[i], mult, r[i], ek, 1);
    } else if (ek == 2) { /* E2M1 nearest-even by thresholds (ties 0.25, 1.25, 2.5, 5 go down) */
        for (size_t i = 0; i < len; i++) {
            float y = x[i] * mult;
            float a = gc_float(gc_bits(y) & 0x7fffffffu);
            uint32_t c = (uint32_t)(a > 0.25f) + (uint32_t)(a >= 0.75f) + (uint32_t)(a > 1.25f) + (uint32_t)(a >= 1.75f)
                         + (uint32_t)(a > 2.5f) + (uint32_t)(a >= 3.5f) + (uint32_t)(a > 5.0f);
            codes[i] = (uint8_t)(c | ((gc_bits(y) >> 28) & 8u));
        }
    } else { /* FP8 nearest: the FP8 kernels' conversion (clips, keeps the sign) */
        for (size_t i = 0; i < len; i++)
            codes[i] = (uint8_t)gc_q8(gc_bits(x[i] * mult), ek);
    }
}

GC_INLINE void K(pack4)(const uint8_t *restrict codes, size_t len, uint8_t *restrict pay)
{
    size_t h = len / 2;
    for (size_t j = 0; j < h; j++)
        pay[j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
    if (len & 1u)
        pay[h] = codes[len - 1];
}

/* e4m3/e5m2 block with stochastic rounding (the scale rule of enc8_block) */
GC_INLINE void K(enc8sr_block)(const float *restrict x, size_t len, uint8_t *restrict codes, uint8_t *scale_p,
                               uint32_t m, uint64_t idx0, const gc_rng *rng, const int e5)
{
    if (m >= GC_INF_BITS) {
        memset(codes, 0x7f, len);
        gc_store_f32(scale_p, gc_float(0x7fc00000u));
        return;
    }
    float amax = gc_float(m), scale = 1.0f, inv = 1.0f;
    if (!(amax < GC8_TINY(e5))) {
        scale = amax / GC8_FMAX(e5);
        inv = GC8_FMAX(e5) / amax;
    }
    uint32_t r[GC_CHUNK];
    for (size_t j0 = 0; j0 < len; j0 += GC_CHUNK) {
        size_t l = len - j0 < GC_CHUNK ? len - j0 : GC_CHUNK;
        K(rbits)(rng, idx0 + j0, l, r);
        K(qloop)(x + j0, l, inv, r, codes + j0, e5);
    }
    gc_store_f32(scale_p, scale);
}

/* ---- MX: one chunk of len <= GC_CHUNK values, value i0 of the message at x[0] ---- */
GC_INLINE void K(mx_chunk)(const float *restrict x, size_t len, uint8_t *restrict pay, uint8_t *restrict sc,
                           uint64_t idx0, const gc_rng *rng, const int ek)
{
    uint32_t r[GC_CHUNK];
    uint8_t tmpc[GC_CHUNK];
    uint8_t *codes = ek == 2 ? tmpc : pay;
    if (rng)
        K(rbits)(rng, idx0, len, r);
    for (size_t j0 = 0, b = 0; j0 < len; j0 += 32, b++) {
        size_t bl = len - j0 < 32 ? len - j0 : 32;
        uint32_t m = K(amax_plain)(x + j0, bl);
        if (m >= GC_INF_BITS) {
            sc[b] = 0xff;
            memset(codes + j0, (int)GCE_NAN(ek), bl);
            continue;
        }
        uint32_t e = m >> 23;
        uint32_t code = e > GCE_EMAX(ek) ? e - GCE_EMAX(ek) : 0u;
        sc[b] = (uint8_t)code;
        float mult = gc_float((254u - code) << 23);
        if (bl == 32)
            K(qloop)(x + j0, 32, mult, rng ? r + j0 : NULL, codes + j0, ek);
        else
            K(qloop)(x + j0, bl, mult, rng ? r + j0 : NULL, codes + j0, ek);
    }
    if (ek == 2)
        K(pack4)(tmpc, len, pay);
}

/* ---- nvfp4: one group of len <= 1024 values ---- */
GC_INLINE void K(nv_chunk)(const float *restrict x, size_t len, uint8_t *restrict pay, uint8_t *restrict sc,
                           uint8_t *gs, uint64_t idx0, const gc_rng *rng)
{
    uint32_t r[GC_CHUNK], bam[64];
    uint8_t codes[GC_CHUNK];
    float rr[64];
    size_t nb = (len + 15u) / 16u;
    if (rng)
        K(rbits)(rng, idx0, len, r);
    uint32_t g = 0;
    for (size_t b = 0; b < nb; b++) {
        size_t bl = len - 16 * b < 16 ? len - 16 * b : 16;
        uint32_t m = K(amax_plain)(x + 16 * b, bl);
        bam[b] = m;
        uint32_t f = m < GC_INF_BITS ? m : 0u;
        g = f > g ? f : g;
    }
    float gf = gc_float(g);
    int tiny = gf < 0x1p-100f;
    float s2 = tiny ? 1.0f : gf / 2688.0f, q2 = tiny ? 0.0f : 448.0f / gf;
    for (size_t b = 0; b < nb; b++) {
        uint32_t m = bam[b], bs = 0;
        float rb = 0.0f;
        if (m >= GC_INF_BITS) {
            bs = 0x7f;
        } else if (!tiny && m != 0) {
            float t = gc_float(m) * q2;
            t = t < 448.0f ? t : 448.0f;
            bs = gc_q8(gc_bits(t), 0);
            bs += gc_d8(bs, 0) < t;
            bs = bs ? bs : 1u;
            rb = 1.0f / (gc_d8(bs, 0) * s2);
        }
        sc[b] = (uint8_t)bs;
        rr[b] = rb;
    }
    for (size_t b = 0; b < nb; b++) {
        size_t bl = len - 16 * b < 16 ? len - 16 * b : 16;
        if (bam[b] >= GC_INF_BITS) {
            memset(codes + 16 * b, 0, bl);
        } else if (bl == 16) {
            K(qloop)(x + 16 * b, 16, rr[b], rng ? r + 16 * b : NULL, codes + 16 * b, 2);
        } else {
            K(qloop)(x + 16 * b, bl, rr[b], rng ? r + 16 * b : NULL, codes + 16 * b, 2);
        }
    }
    K(pack4)(codes, len, pay);
    gc_store_f32(gs, s2);
}

/* ---- decode of one chunk: out = v, or acc: out = out + v ---- */
GC_INLINE void K(mx_dec_chunk)(const uint8_t *restrict pay, const uint8_t *restrict sc, size_t len,
                               float *restrict out, const int ek, const int acc)
{
    const float qnan = gc_float(0x7fc00000u);
    for (size_t j0 = 0, b = 0; j0 < len; j0 += 32, b++) {
        size_t bl = len - j0 < 32 ? len - j0 : 32;
        uint32_t c = sc[b];
        float s = gc_de8m0(c);
        float *o = out + j0;
        if (c == 0xffu) {
            for (size_t i = 0; i < bl; i++)
                o[i] = acc ? gc_addf(o[i], qnan) : qnan;
        } else if (ek == 2) {
            const uint8_t *p = pay + j0 / 2;
            size_t h = bl / 2;
            for (size_t j = 0; j < h; j++) {
                float v0 = gc_de2m1(p[j]) * s, v1 = gc_de2m1((uint32_t)p[j] >> 4) * s;
                o[2 * j] = acc ? gc_addf(o[2 * j], v0) : v0;
                o[2 * j + 1] = acc ? gc_addf(o[2 * j + 1], v1) : v1;
            }
            if (bl & 1u) {
                float v = gc_de2m1(p[h]) * s;
                o[bl - 1] = acc ? gc_addf(o[bl - 1], v) : v;
            }
        } else {
            const uint8_t *p = pay + j0;
            for (size_t i = 0; i < bl; i++) {
                float v = gc_d8(p[i], ek) * s;
                o[i] = acc ? gc_addf(o[i], v) : v;
            }
        }
    }
}

GC_INLINE void K(nv_dec_chunk)(const uint8_t *restrict pay, const uint8_t *restrict sc, const uint8_t *gs,
                               size_t len, float *restrict out, const int acc)
{
    const float qnan = gc_float(0x7fc00000u);
    float s2 = gc_load_f32(gs);
    for (size_t j0 = 0, b = 0; j0 < len; j0 += 16, b++) {
        size_t bl = len - j0 < 16 ? len - j0 : 16;
        uint32_t c = sc[b];
        float d = gc_d8(c, 0) * s2;
        float *o = out + j0;
        if ((c & 0x7fu) == 0x7fu) {
            for (size_t i = 0; i < bl; i++)
                o[i] = acc ? gc_addf(o[i], qnan) : qnan;
            continue;
        }
        const uint8_t *p = pay + j0 / 2;
        size_t h = bl / 2;
        for (size_t j = 0; j < h; j++) {
            float v0 = gc_de2m1(p[j]) * d, v1 = gc_de2m1((uint32_t)p[j] >> 4) * d;
            o[2 * j] = acc ? gc_addf(o[2 * j], v0) : v0;
            o[2 * j + 1] = acc ? gc_addf(o[2 * j + 1], v1) : v1;
        }
        if (bl & 1u) {
            float v = gc_de2m1(p[h]) * d;
            o[bl - 1] = acc ? gc_addf(o[bl - 1], v) : v;
        }
    }
}

#if defined(GC_X512) && !defined(GC_NO_X512_MX)
/* ---- AVX-512 paths of the 4-bit formats (round to nearest, whole 1024-value chunks) ----
 *
 * Same arithmetic as the scalar code above, sixteen lanes at a time, so the bytes are identical:
 *   amax      per block, 16 blocks at once: a four-level transpose-and-max of 16 vectors
 *             (level k keeps, for each block, half as many partial maxima as level k - 1).
 *   scales    nvfp4's E4M3 block scales (round, bump up when below t, at least 1, 1 / (d * s2)) and
 *             MX's E8M0 exponents, for 16 blocks per vector.
 *   E2M1      round to nearest even by the FPU: |y| clipped to 6, plus a power of two whose ulp is
 *             the E2M1 step of |y|'s range (0.5 below 2, 1 below 4, 2 above), so the sum's low bits
 *             count the steps; equal to the thresholds of K(qloop) on every float32 (ties 0.25,
 *             1.25, 2.5, 5 go down, 0.75, 1.75, 3.5 up).
 *   nibbles   pack: 64-bit lanes c[2j] | c[2j+1] << 32, OR-shifted by 28, truncated to bytes
 *             (vpmovqb); unpack: low / high nibbles interleaved, widened, looked up in a 16-entry
 *             float table (vpermps) - E2M1 decodes exactly, so table[c] * d = gc_de2m1(c) * d.
 * The partial last chunk of a message and stochastic rounding take the scalar code.
 */
#include <immintrin.h>

#define GCV_I(v) _mm512_set1_epi32((int)(v))

GC_INLINE __m512i K(v_e2m1_rn)(__m512 y)
{
    __m512i u = _mm512_castps_si512(y);
    __m512i a = _mm512_min_epu32(_mm512_and_si512(u, GCV_I(0x7fffffffu)), GCV_I(0x40c00000u));
    /* magic 2^22, 2^23, 2^24 for |y| < 2, [2, 4), [4, 6]: its ulp is that range's E2M1 step */
    __m512i eb = _mm512_and_si512(_mm512_max_epu32(a, GCV_I(0x3f800000u)), GCV_I(0x7f800000u));
    __m512i sum = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a),
                                                    _mm512_castsi512_ps(_mm512_add_epi32(eb, GCV_I(22u << 23)))));
    /* steps k = sum - magic (low bits of sum); code = k + 2 * (e - 127), e = 127..129: mod 8,
     * sum + (eb >> 22) + 2; then the low 3 bits with the sign at bit 3 */
    __m512i c = _mm512_add_epi32(_mm512_add_epi32(sum, _mm512_srli_epi32(eb, 22)), GCV_I(2));
    return _mm512_ternarylogic_epi32(c, _mm512_srli_epi32(u, 28), GCV_I(7), 0xE4); /* c & 7 | s & ~7 */
}

/* 16 codes (int32 lanes, < 16) -> 8 bytes, value 2j in the low nibble */
GC_INLINE void K(v_pack16)(__m512i c, uint8_t *p)
{
    __m512i t = _mm512_or_si512(c, _mm512_srli_epi64(c, 28));
    _mm_storel_epi64((__m128i *)p, _mm512_cvtepi64_epi8(t));
}

/* 8 bytes -> the 16 E2M1 values */
GC_INLINE __m512 K(v_unpack16)(const uint8_t *p, __m512 tab)
{
    __m128i b = _mm_loadl_epi64((const __m128i *)p), m = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), tab);
}

GC_INLINE __m512 K(v_e2m1_table)(void)
{
    return _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
}

/* gc_addf on 16 lanes: a + b, a quieted where a is NaN */
GC_INLINE __m512 K(v_addf)(__m512 a, __m512 b)
{
    __m512 s = _mm512_add_ps(a, b);
    __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(s, nan, _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), GCV_I(0x400000u))));
}

GC_INLINE void K(v_store)(float *o, __m512 v, const int acc)
{
    _mm512_storeu_ps(o, acc ? K(v_addf)(_mm512_loadu_ps(o), v) : v);
}

/* one level of the transpose-max: p and q hold 16/g blocks of g partials each (g = 2 * half) */
GC_INLINE __m512i K(v_tmax)(__m512i p, __m512i q, const int half)
{
    __m512i ia;
    if (half == 8)
        ia = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    else if (half == 4)
        ia = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    else if (half == 2)
        ia = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    else
        ia = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    __m512i ib = _mm512_add_epi32(ia, GCV_I(half));
    return _mm512_max_epu32(_mm512_permutex2var_epi32(p, ia, q), _mm512_permutex2var_epi32(p, ib, q));
}

/* lane b = max of v[b]'s 16 lanes (v: 16 vectors of |bits|) */
GC_INLINE __m512i K(v_amax16)(__m512i v[16])
{
    for (int i = 0; i < 8; i++)
        v[i] = K(v_tmax)(v[2 * i], v[2 * i + 1], 8);
    for (int i = 0; i < 4; i++)
        v[i] = K(v_tmax)(v[2 * i], v[2 * i + 1], 4);
    for (int i = 0; i < 2; i++)
        v[i] = K(v_tmax)(v[2 * i], v[2 * i + 1], 2);
    return K(v_tmax)(v[0], v[1], 1);
}

/* gc_d8(c, 0) for codes c in 0 .. 0x7e (no sign, no NaN) */
GC_INLINE __m512 K(v_d8pos)(__m512i m)
{
    __m512i nb = _mm512_add_epi32(_mm512_slli_epi32(m, 20), GCV_I(120u << 23));
    __m512 sb = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(m, 20), GCV_I(121u << 23))),
                              _mm512_set1_ps(0x1p-6f));
    return _mm512_mask_blend_ps(_mm512_cmplt_epu32_mask(m, GCV_I(8)), _mm512_castsi512_ps(nb), sb);
}

/* gc_d8(c, 0) for any byte c */
GC_INLINE __m512 K(v_d8)(__m512i c)
{
    __m512i m = _mm512_and_si512(c, GCV_I(0x7f));
    __m512i b = _mm512_castps_si512(K(v_d8pos)(m));
    b = _mm512_mask_mov_epi32(b, _mm512_cmpeq_epi32_mask(m, GCV_I(0x7f)), GCV_I(0x7fc00000u));
    return _mm512_castsi512_ps(_mm512_or_si512(b, _mm512_slli_epi32(_mm512_and_si512(c, GCV_I(0x80)), 24)));
}

/* nvfp4 group of exactly 1024 values, nearest */
static void K(nv_group_x512)(const float *restrict x, uint8_t *restrict pay, uint8_t *restrict sc, uint8_t *gs)
{
    __m512i bm[4];
    const __m512i absm = GCV_I(0x7fffffffu), inf = GCV_I(GC_INF_BITS);
    for (int k = 0; k < 4; k++) {
        __m512i v[16];
        for (int i = 0; i < 16; i++)
            v[i] = _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x + 256 * k + 16 * i)), absm);
        bm[k] = K(v_amax16)(v);
    }
    __m512i gv = _mm512_setzero_si512();
    uint64_t nanb = 0;
    for (int k = 0; k < 4; k++) {
        __mmask16 bad = _mm512_cmpge_epu32_mask(bm[k], inf);
        nanb |= (uint64_t)bad << (16 * k);
        gv = _mm512_max_epu32(gv, _mm512_maskz_mov_epi32((__mmask16)~bad, bm[k]));
    }
    uint32_t g = _mm512_reduce_max_epu32(gv);
    float gf = gc_float(g);
    int tiny = gf < 0x1p-100f;
    float s2 = tiny ? 1.0f : gf / 2688.0f, q2 = tiny ? 0.0f : 448.0f / gf;
    float rr[64] __attribute__((aligned(64)));
    for (int k = 0; k < 4; k++) {
        __m512i m = bm[k];
        __m512 t = _mm512_min_ps(_mm512_mul_ps(_mm512_castsi512_ps(m), _mm512_set1_ps(q2)), _mm512_set1_ps(448.0f));
        __m512i a = _mm512_castps_si512(t);
        __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), GCV_I(1));
        __m512i rn = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, GCV_I(0x7ffffu)), odd), 20),
                                      GCV_I(120u << 3));
        __m512i rs = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(t, _mm512_set1_ps(16384.0f))), GCV_I(0x46800000u));
        __m512i bs = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(a, GCV_I(121u << 23)), rn, rs);
        bs = _mm512_mask_add_epi32(bs, _mm512_cmp_ps_mask(K(v_d8pos)(bs), t, _CMP_LT_OQ), bs, GCV_I(1));
        bs = _mm512_max_epu32(bs, GCV_I(1));
        __m512 rb = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(K(v_d8pos)(bs), _mm512_set1_ps(s2)));
        __mmask16 bad = (__mmask16)(nanb >> (16 * k));
        __mmask16 live = tiny ? 0 : (__mmask16)(~bad & _mm512_cmpneq_epi32_mask(m, _mm512_setzero_si512()));
        bs = _mm512_mask_mov_epi32(_mm512_maskz_mov_epi32(live, bs), bad, GCV_I(0x7f));
        _mm512_store_ps(rr + 16 * k, _mm512_maskz_mov_ps(live, rb));
        _mm_storeu_si128((__m128i *)(sc + 16 * k), _mm512_cvtepi32_epi8(bs));
    }
    for (int b = 0; b < 64; b++) {
        __m512i c = K(v_e2m1_rn)(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * b), _mm512_set1_ps(rr[b])));
        if ((nanb >> b) & 1u)
            c = _mm512_setzero_si512();
        K(v_pack16)(c, pay + 8 * b);
    }
    gc_store_f32(gs, s2);
}

/* mxfp4 chunk of exactly 1024 values (32 blocks), nearest */
static void K(mx4_chunk_x512)(const float *restrict x, uint8_t *restrict pay, uint8_t *restrict sc)
{
    const __m512i absm = GCV_I(0x7fffffffu), inf = GCV_I(GC_INF_BITS);
    uint32_t mult[32] __attribute__((aligned(64)));
    uint32_t nanb = 0;
    for (int k = 0; k < 2; k++) {
        __m512i v[16];
        for (int i = 0; i < 16; i++) {
            const float *p = x + 512 * k + 32 * i;
            v[i] = _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(p)), absm),
                                    _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(p + 16)), absm));
        }
        __m512i m = K(v_amax16)(v);
        __mmask16 bad = _mm512_cmpge_epu32_mask(m, inf);
        nanb |= (uint32_t)bad << (16 * k);
        __m512i code = _mm512_sub_epi32(_mm512_max_epu32(_mm512_srli_epi32(m, 23), GCV_I(GCE_EMAX(2))), GCV_I(GCE_EMAX(2)));
        _mm512_store_si512(mult + 16 * k, _mm512_slli_epi32(_mm512_sub_epi32(GCV_I(254), code), 23));
        code = _mm512_mask_mov_epi32(code, bad, GCV_I(0xff));
        _mm_storeu_si128((__m128i *)(sc + 16 * k), _mm512_cvtepi32_epi8(code));
    }
    for (int b = 0; b < 32; b++) {
        __m512 s = _mm512_castsi512_ps(_mm512_set1_epi32((int)mult[b]));
        __m512i c0 = K(v_e2m1_rn)(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * b), s));
        __m512i c1 = K(v_e2m1_rn)(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * b + 16), s));
        if ((nanb >> b) & 1u) {
            c0 = _mm512_setzero_si512();
            c1 = c0;
        }
        K(v_pack16)(c0, pay + 16 * b);
        K(v_pack16)(c1, pay + 16 * b + 8);
    }
}

/* nvfp4 group of exactly 1024 values: out = v, or out += v */
static void K(nv_dec_x512)(const uint8_t *restrict pay, const uint8_t *restrict sc, const uint8_t *gs,
                           float *restrict out, const int acc)
{
    const __m512 tab = K(v_e2m1_table)(), qnan = _mm512_castsi512_ps(GCV_I(0x7fc00000u));
    const __m512 s2 = _mm512_set1_ps(gc_load_f32(gs));
    float d[64] __attribute__((aligned(64)));
    uint64_t nanb = 0;
    for (int k = 0; k < 4; k++) {
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sc + 16 * k)));
        _mm512_store_ps(d + 16 * k, _mm512_mul_ps(K(v_d8)(c), s2));
        nanb |= (uint64_t)_mm512_cmpeq_epi32_mask(_mm512_and_si512(c, GCV_I(0x7f)), GCV_I(0x7f)) << (16 * k);
    }
    for (int b = 0; b < 64; b++) {
        __m512 v = _mm512_mul_ps(K(v_unpack16)(pay + 8 * b, tab), _mm512_set1_ps(d[b]));
        if ((nanb >> b) & 1u)
            v = qnan;
        K(v_store)(out + 16 * b, v, acc);
    }
}

/* mxfp4 chunk of exactly 1024 values */
static void K(mx4_dec_x512)(const uint8_t *restrict pay, const uint8_t *restrict sc, float *restrict out, const int acc)
{
    const __m512 tab = K(v_e2m1_table)(), qnan = _mm512_castsi512_ps(GCV_I(0x7fc00000u));
    for (int b = 0; b < 32; b++) {
        uint32_t c = sc[b];
        __m512 s = _mm512_set1_ps(gc_de8m0(c));
        __m512 v0 = _mm512_mul_ps(K(v_unpack16)(pay + 16 * b, tab), s);
        __m512 v1 = _mm512_mul_ps(K(v_unpack16)(pay + 16 * b + 8, tab), s);
        if (c == 0xffu) {
            v0 = qnan;
            v1 = qnan;
        }
        K(v_store)(out + 32 * b, v0, acc);
        K(v_store)(out + 32 * b + 16, v1, acc);
    }
}
#define GC_MX_X512 1
#else
#define GC_MX_X512 0
#endif

/* ---- whole messages: ek and packing from the format code ---- */
#define GC_MX_EK(fmt) ((fmt) == GC_MXFP8 ? 0 : (fmt) == GC_MXFP8E5 ? 1 : 2)

/* Pointers of chunk i0 (a multiple of GC_CHUNK) of a message of n values. */
#define GC_CHUNK_PTRS(fmt, msg, n, i0, pay, sc, gs)                                                        \
    uint8_t *pay = (msg) + (gc_is_packed(fmt) ? (i0) / 2u : (i0));                                        \
    uint8_t *sc = (msg) + gc_payload_bytes((n), (fmt)) + (i0) / gc_fixed_block(fmt);                      \
    uint8_t *gs = (fmt) == GC_NVFP4 ? (msg) + gc_group_offset(n) + 4u * ((i0) / GC_NVFP4_GROUP) : NULL

GC_INLINE void K(enc_chunk)(int fmt, const float *x, size_t len, uint8_t *pay, uint8_t *sc, uint8_t *gs,
                            uint64_t idx0, const gc_rng *rng)
{
#if GC_MX_X512
    if (len == GC_CHUNK && !rng && fmt == GC_NVFP4) {
        K(nv_group_x512)(x, pay, sc, gs);
        return;
    }
    if (len == GC_CHUNK && !rng && fmt == GC_MXFP4) {
        K(mx4_chunk_x512)(x, pay, sc);
        return;
    }
#endif
    switch (fmt) {
    case GC_NVFP4: K(nv_chunk)(x, len, pay, sc, gs, idx0, rng); break;
    case GC_MXFP4: K(mx_chunk)(x, len, pay, sc, idx0, rng, 2); break;
    case GC_MXFP8: K(mx_chunk)(x, len, pay, sc, idx0, rng, 0); break;
    default: K(mx_chunk)(x, len, pay, sc, idx0, rng, 1); break;
    }
}

GC_INLINE void K(dec_chunk)(int fmt, const uint8_t *pay, const uint8_t *sc, const uint8_t *gs, size_t len,
                            float *out, const int acc)
{
#if GC_MX_X512
    if (len == GC_CHUNK && fmt == GC_NVFP4) {
        K(nv_dec_x512)(pay, sc, gs, out, acc);
        return;
    }
    if (len == GC_CHUNK && fmt == GC_MXFP4) {
        K(mx4_dec_x512)(pay, sc, out, acc);
        return;
    }
#endif
    switch (fmt) {
    case GC_NVFP4: K(nv_dec_chunk)(pay, sc, gs, len, out, acc); break;
    case GC_MXFP4: K(mx_dec_chunk)(pay, sc, len, out, 2, acc); break;
    case GC_MXFP8: K(mx_dec_chunk)(pay, sc, len, out, 0, acc); break;
    default: K(mx_dec_chunk)(pay, sc, len, out, 1, acc); break;
    }
}

static void K(nvpad)(uint8_t *msg, size_t n)
{
    size_t a = gc_payload_bytes(n, GC_NVFP4) + (n + 15u) / 16u, b = gc_group_offset(n);
    memset(msg + a, 0, b - a);
}

static void K(encode_mx)(int fmt, const float *x, size_t n, uint8_t *msg, const gc_rng *rng)
{
    if (fmt == GC_NVFP4)
        K(nvpad)(msg, n);
    for (size_t i0 = 0; i0 < n; i0 += GC_CHUNK) {
        size_t len = n - i0 < GC_CHUNK ? n - i0 : GC_CHUNK;
        GC_CHUNK_PTRS(fmt, msg, n, i0, pay, sc, gs);
        K(enc_chunk)(fmt, x + i0, len, pay, sc, gs, rng ? rng->offset + i0 : 0u, rng);
    }
}

static void K(decode_mx)(int fmt, const uint8_t *msg, size_t n, float *out, const int acc)
{
    for (size_t i0 = 0; i0 < n; i0 += GC_CHUNK) {
        size_t len = n - i0 < GC_CHUNK ? n - i0 : GC_CHUNK;
        GC_CHUNK_PTRS(fmt, (uint8_t *)msg, n, i0, pay, sc, gs);
        K(dec_chunk)(fmt, pay, sc, gs, len, out + i0, acc);
    }
}

/* fused hop: per chunk, decode msg_in's chunk, add local, keep the sums in L1 (or sum_out) and
 * encode them into msg_out's chunk (which may be the same bytes: read before written) */
static void K(dae_mx)(int fmt, const uint8_t *msg_in, const float *local, size_t n, uint8_t *msg_out,
                      float *sum_out, const gc_rng *rng)
{
    float buf[GC_CHUNK];
    if (fmt == GC_NVFP4)
        K(nvpad)(msg_out, n);
    for (size_t i0 = 0; i0 < n; i0 += GC_CHUNK) {
        size_t len = n - i0 < GC_CHUNK ? n - i0 : GC_CHUNK;
        float *dst = sum_out ? sum_out + i0 : buf;
        {
            GC_CHUNK_PTRS(fmt, (uint8_t *)msg_in, n, i0, pay, sc, gs);
            K(dec_chunk)(fmt, pay, sc, gs, len, buf, 0);
        }
        const float *l = local + i0;
        for (size_t i = 0; i < len; i++)
            dst[i] = gc_addf(buf[i], l[i]);
        GC_CHUNK_PTRS(fmt, msg_out, n, i0, pay, sc, gs);
        K(enc_chunk)(fmt, dst, len, pay, sc, gs, rng ? rng->offset + i0 : 0u, rng);
    }
}
