/* giftcomm native codec: the microscaling / 4-bit formats (mxfp8, mxfp8_e5m2, mxfp4, nvfp4) and
 * stochastic rounding, as part of the per-instruction-set template (included by gc_kernels.h,
 * with K() defined). Rules: docs/wire-format.md and giftcomm/reference/codec.py, bit for bit.
 *
 * Element kinds (ek): GC_ELEM_E4M3, GC_ELEM_E5M2, GC_ELEM_E2M1 and their facts (GC_ELEM_*(ek)) come
 * from gc_formats.h, generated from giftcomm/formats.py. The MX and nvfp4 kernels work in chunks of
 * GC_CHUNK = 1024 values (whole MX blocks; exactly one nvfp4 group), so that the random bits,
 * element codes and the fused hop's sums of a chunk stay in L1 in small stack arrays.
 */
#define GC_INF_BITS 0x7f800000u


/* ---- SIMD layer of the AVX-512 (GC_X512) and AVX2 (GC_X256) variants ----
 *
 * GV_* are the few integer / float operations that the vector Philox generator and the E2M1
 * rounding need, as 16-lane AVX-512 or 8-lane AVX2 intrinsics (GV_W lanes of 32 bits), so that
 * both variants run the same code. The generic variant has none of it and uses the scalar code.
 */
#if (defined(GC_X512) || defined(GC_X256)) && !defined(GC_NO_VEC_MX)
#include <immintrin.h>
#define GC_VEC_MX 1

#if defined(GC_X512)
#define GV_I __m512i
#define GV_F __m512
#define GV_W 16
#define GV_SET1(v) _mm512_set1_epi32((int)(v))
#define GV_SET1_64(v) _mm512_set1_epi64((long long)(v))
#define GV_SET1PS(v) _mm512_set1_ps(v)
#define GV_ZERO() _mm512_setzero_si512()
#define GV_ADD(a, b) _mm512_add_epi32(a, b)
#define GV_SUB(a, b) _mm512_sub_epi32(a, b)
#define GV_ADD64(a, b) _mm512_add_epi64(a, b)
#define GV_AND(a, b) _mm512_and_si512(a, b)
#define GV_OR(a, b) _mm512_or_si512(a, b)
#define GV_XOR(a, b) _mm512_xor_si512(a, b)
#define GV_XOR3(a, b, c) _mm512_ternarylogic_epi32(a, b, c, 0x96)
#define GV_SRLI(a, n) _mm512_srli_epi32(a, n)
#define GV_SLLI(a, n) _mm512_slli_epi32(a, n)
#define GV_SRLV(a, n) _mm512_srlv_epi32(a, n)
#define GV_SLLV(a, n) _mm512_sllv_epi32(a, n)
#define GV_SRLI64(a, n) _mm512_srli_epi64(a, n)
#define GV_MINU(a, b) _mm512_min_epu32(a, b)
#define GV_MAXU(a, b) _mm512_max_epu32(a, b)
#define GV_MULU(a, b) _mm512_mul_epu32(a, b)
#define GV_SWAP(a) _mm512_shuffle_epi32(a, _MM_PERM_CDAB)
#define GV_EVEN_ODD(e, o) _mm512_mask_shuffle_epi32(e, (__mmask16)0xAAAA, o, _MM_PERM_CDAB)
#define GV_IOTA2() _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14)
#define GV_LOADPS(p) _mm512_loadu_ps(p)
#define GV_MULPS(a, b) _mm512_mul_ps(a, b)
#define GV_ADDPS(a, b) _mm512_add_ps(a, b)
#define GV_CASTI(f) _mm512_castps_si512(f)
#define GV_CASTF(i) _mm512_castsi512_ps(i)
#define GV_STOREI(p, v) _mm512_storeu_si512((void *)(p), v)

/* c + 1 where s < lo (unsigned): the carry out of lo + r when s = lo + r */
GC_INLINE __m512i K(v_addc)(__m512i c, __m512i s, __m512i lo)
{
    return _mm512_mask_add_epi32(c, _mm512_cmplt_epu32_mask(s, lo), c, GV_SET1(1));
}

/* (c & 7) | the sign bit of u at bit 3 */
GC_INLINE __m512i K(v_sign4)(__m512i c, __m512i u)
{
    return _mm512_ternarylogic_epi32(c, _mm512_srli_epi32(u, 28), GV_SET1(7), 0xE4); /* c & 7 | s & ~7 */
}

/* bits of min(|y|, 6) (vrangeps: the smaller magnitude, sign cleared) */
GC_INLINE __m512i K(v_absclip6)(__m512 y)
{
    return _mm512_castps_si512(_mm512_range_ps(y, _mm512_set1_ps(6.0f), 0x0A));
}

/* entry e & 15 of a 16-word table whose entries 15, 0, 1 are t15, t0, t1 */
GC_INLINE __m512i K(v_lut3)(__m512i e, uint32_t t15, uint32_t t0, uint32_t t1)
{
    return _mm512_permutexvar_epi32(e, _mm512_setr_epi32((int)t0, (int)t1, 0, 0, 0, 0, 0, 0,
                                                         0, 0, 0, 0, 0, 0, 0, (int)t15));
}
#else /* GC_X256 */
#define GV_I __m256i
#define GV_F __m256
#define GV_W 8
#define GV_SET1(v) _mm256_set1_epi32((int)(v))
#define GV_SET1_64(v) _mm256_set1_epi64x((long long)(v))
#define GV_SET1PS(v) _mm256_set1_ps(v)
#define GV_ZERO() _mm256_setzero_si256()
#define GV_ADD(a, b) _mm256_add_epi32(a, b)
#define GV_SUB(a, b) _mm256_sub_epi32(a, b)
#define GV_ADD64(a, b) _mm256_add_epi64(a, b)
#define GV_AND(a, b) _mm256_and_si256(a, b)
#define GV_OR(a, b) _mm256_or_si256(a, b)
#define GV_XOR(a, b) _mm256_xor_si256(a, b)
#define GV_XOR3(a, b, c) _mm256_xor_si256(_mm256_xor_si256(a, b), c)
#define GV_SRLI(a, n) _mm256_srli_epi32(a, n)
#define GV_SLLI(a, n) _mm256_slli_epi32(a, n)
#define GV_SRLV(a, n) _mm256_srlv_epi32(a, n)
#define GV_SLLV(a, n) _mm256_sllv_epi32(a, n)
#define GV_SRLI64(a, n) _mm256_srli_epi64(a, n)
#define GV_MINU(a, b) _mm256_min_epu32(a, b)
#define GV_MAXU(a, b) _mm256_max_epu32(a, b)
#define GV_MULU(a, b) _mm256_mul_epu32(a, b)
#define GV_SWAP(a) _mm256_shuffle_epi32(a, 0xB1)
#define GV_EVEN_ODD(e, o) _mm256_blend_epi32(e, _mm256_shuffle_epi32(o, 0xB1), 0xAA)
#define GV_IOTA2() _mm256_setr_epi64x(0, 2, 4, 6)
#define GV_LOADPS(p) _mm256_loadu_ps(p)
#define GV_MULPS(a, b) _mm256_mul_ps(a, b)
#define GV_ADDPS(a, b) _mm256_add_ps(a, b)
#define GV_CASTI(f) _mm256_castps_si256(f)
#define GV_CASTF(i) _mm256_castsi256_ps(i)
#define GV_STOREI(p, v) _mm256_storeu_si256((__m256i *)(void *)(p), v)

GC_INLINE __m256i K(v_addc)(__m256i c, __m256i s, __m256i lo)
{
    /* s >= lo (no carry): -1, else 0; so c + 1 + that */
    __m256i nc = _mm256_cmpeq_epi32(_mm256_max_epu32(s, lo), s);
    return _mm256_add_epi32(_mm256_add_epi32(c, GV_SET1(1)), nc);
}

GC_INLINE __m256i K(v_sign4)(__m256i c, __m256i u)
{
    return _mm256_or_si256(_mm256_and_si256(c, GV_SET1(7)), _mm256_and_si256(_mm256_srli_epi32(u, 28), GV_SET1(8)));
}

GC_INLINE __m256i K(v_absclip6)(__m256 y)
{
    return _mm256_min_epu32(_mm256_and_si256(_mm256_castps_si256(y), GV_SET1(0x7fffffffu)), GV_SET1(0x40c00000u));
}

/* entry e & 7 of an 8-word table whose entries 7, 0, 1 are t15, t0, t1 (15 & 7 = 7) */
GC_INLINE __m256i K(v_lut3)(__m256i e, uint32_t t15, uint32_t t0, uint32_t t1)
{
    return _mm256_permutevar8x32_epi32(_mm256_setr_epi32((int)t0, (int)t1, 0, 0, 0, 0, 0, (int)t15), e);
}
#endif

/* Philox rounds r0+1 .. 9 on the state (c0, c1, c2, c3) left by round r0 with keys k0, k1 of
 * round r0, then round 10, of which only word 0 is kept. */
GC_INLINE GV_I K(vphilox_tail)(GV_I c0, GV_I c1, GV_I c2, GV_I c3, uint32_t k0, uint32_t k1, int r0)
{
    const GV_I m0 = GV_SET1(0xD2511F53u), m1 = GV_SET1(0xCD9E8D57u);
    for (int r = r0; r < 9; r++) {
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
        GV_I p0 = GV_MULU(c0, m0), p1 = GV_MULU(c2, m1);
        c0 = GV_XOR3(GV_SWAP(p1), c1, GV_SET1(k0));
        c2 = GV_XOR3(GV_SWAP(p0), c3, GV_SET1(k1));
        c1 = p1;
        c3 = p0;
    }
    k0 += 0x9E3779B9u;
    return GV_XOR3(GV_SWAP(GV_MULU(c2, m1)), c1, GV_SET1(k0));
}

/* Philox4x32-10 (gc_philox_w0) on one half of the lanes: the counters are 64-bit lanes (c0 in the
 * low word, c1 the high word), the state words sit in the low 32 bits of 64-bit lanes. mul_epu32
 * reads only those low words and gives the whole 64-bit product, whose high word the 32-bit swap
 * brings down; the high words of the state are never read, so they may hold anything. */
GC_INLINE GV_I K(vphilox_half)(GV_I ctr, uint32_t k0, uint32_t k1)
{
    /* round 1: c2 = c3 = 0, so M1 * c2 = 0 */
    GV_I p0 = GV_MULU(ctr, GV_SET1(0xD2511F53u));
    GV_I c0 = GV_XOR(GV_SRLI64(ctr, 32), GV_SET1(k0));
    GV_I c2 = GV_XOR(GV_SWAP(p0), GV_SET1(k1));
    GV_I c1 = GV_ZERO(), c3 = p0;
    return K(vphilox_tail)(c0, c1, c2, c3, k0, k1, 1);
}

/* word 0 of Philox4x32-10 for counters idx .. idx + GV_W - 1 (mod 2^64): lane i = gc_philox_w0 of
 * idx + i. Even and odd elements run as two half-width streams, merged at the end. */
GC_INLINE GV_I K(vphilox)(uint64_t idx, uint32_t k0, uint32_t k1)
{
    GV_I base = GV_ADD64(GV_SET1_64(idx), GV_IOTA2());
    GV_I e = K(vphilox_half)(base, k0, k1);
    GV_I o = K(vphilox_half)(GV_ADD64(base, GV_SET1_64(1)), k0, k1);
    return GV_EVEN_ODD(e, o);
}

/* The same when every counter's high word is h (no 2^32 boundary among them; the usual case):
 * then round 1's new c0 = h ^ k0 is one scalar for all lanes, round 2's M0 * c0 one scalar
 * product, and its low word round 3's c3, so rounds 1-3 need 3 multiplies instead of 5 per half.
 * ctr: the low words of the even elements' counters in the low words of 64-bit lanes. */
GC_INLINE GV_I K(vphilox_half_u)(GV_I ctr, uint32_t h, uint32_t k0, uint32_t k1)
{
    const GV_I m0 = GV_SET1(0xD2511F53u), m1 = GV_SET1(0xCD9E8D57u);
    /* round 1: c1 = h, c2 = c3 = 0 */
    GV_I p0 = GV_MULU(ctr, m0), p1;
    uint32_t s0 = h ^ k0;
    GV_I c2 = GV_XOR(GV_SWAP(p0), GV_SET1(k1));
    GV_I c3 = p0;
    /* round 2: c0 = s0, c1 = 0 */
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
    uint64_t q = (uint64_t)s0 * 0xD2511F53u;
    p1 = GV_MULU(c2, m1);
    GV_I c0 = GV_XOR(GV_SWAP(p1), GV_SET1(k0));
    c2 = GV_XOR(c3, GV_SET1((uint32_t)(q >> 32) ^ k1));
    GV_I c1 = p1;
    /* round 3: c3 = low word of q */
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
    p0 = GV_MULU(c0, m0);
    p1 = GV_MULU(c2, m1);
    c0 = GV_XOR3(GV_SWAP(p1), c1, GV_SET1(k0));
    c2 = GV_XOR(GV_SWAP(p0), GV_SET1((uint32_t)q ^ k1));
    c1 = p1;
    c3 = p0;
    return K(vphilox_tail)(c0, c1, c2, c3, k0, k1, 3);
}

/* GV_W words for counters (h << 32) + the low words in ctr (even elements; odd = ctr + 1) */
GC_INLINE GV_I K(vphilox_u)(GV_I ctr, uint32_t h, uint32_t k0, uint32_t k1)
{
    GV_I e = K(vphilox_half_u)(ctr, h, k0, k1);
    GV_I o = K(vphilox_half_u)(GV_ADD64(ctr, GV_SET1_64(1)), h, k0, k1);
    return GV_EVEN_ODD(e, o);
}

/* whether counters idx0 .. idx0 + len - 1 (len >= 1) share their high word */
GC_INLINE int K(same_hi)(uint64_t idx0, size_t len)
{
    return ((idx0 ^ (idx0 + (len - 1u))) >> 32) == 0;
}

/* E2M1 code (sign at bit 3) of y, round to nearest even: gc_qmag(min(|y|, 6), -, 1, 0, 0). The FPU
 * rounds: a = min(|y|, 6) plus a magic number whose ulp is the E2M1 step of a's range (2^22: step
 * 0.5 below 2; 2^23: step 1 in [2, 4); 2^24: step 2 in [4, 6]), so the sum's low bits count the
 * steps k. The magic is raised by 2R ulps (R = the range, 0..2; an even number of ulps, so ties
 * still go to an even k), which makes the sum's low 3 bits k + 2R = the code. The range comes
 * from max(a, 1)'s exponent 127..129, whose low bits index a three-entry table. */
GC_INLINE GV_I K(v_e2m1_rn)(GV_F y)
{
    GV_I a = K(v_absclip6)(y);
    GV_I magic = K(v_lut3)(GV_SRLI(GV_MAXU(a, GV_SET1(0x3f800000u)), 23), 0x4a800000u, 0x4b000002u, 0x4b800004u);
    GV_I sum = GV_CASTI(GV_ADDPS(GV_CASTF(a), GV_CASTF(magic)));
    return K(v_sign4)(sum, GV_CASTI(y));
}

/* E2M1 code of y rounded stochastically with the random words r: gc_qmag(min(|y|, 6), r, 1, 0, 1)
 * lane for lane. With t = the magic sum above but truncated instead of rounded (AVX-512's embedded
 * rounding), its low bits are the code of floor(a / step) and rem = a - (t - magic) the exact
 * remainder; F = rem * 2^32 / step (a power of two, exact) truncated to an integer is the scalar
 * code's 32 fraction bits, and the code goes up where F + r carries out of 32 bits. AVX2 has no
 * truncating add: it runs the scalar integer formula (vector shifts by 32 or more give 0, as the
 * scalar code's clamped shifts do for these operands; for a float32-subnormal a both give 0). */
#if defined(GC_X512)
GC_INLINE __m512i K(v_e2m1_sr)(__m512 y, __m512i r)
{
    __m512 a = _mm512_range_ps(y, _mm512_set1_ps(6.0f), 0x0A);
    __m512i e = _mm512_srli_epi32(_mm512_max_epu32(_mm512_castps_si512(a), GV_SET1(0x3f800000u)), 23);
    __m512 magic = _mm512_castsi512_ps(K(v_lut3)(e, 0x4a800000u, 0x4b000002u, 0x4b800004u));
    __m512 t = _mm512_add_round_ps(a, magic, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m512 rem = _mm512_sub_ps(a, _mm512_sub_ps(t, magic));
    __m512 scale = _mm512_castsi512_ps(K(v_lut3)(e, 0x50000000u, 0x4f800000u, 0x4f000000u)); /* 2^33, 2^32, 2^31 */
    __m512i f = _mm512_cvttps_epu32(_mm512_mul_ps(rem, scale));
    __m512i c = K(v_addc)(_mm512_castps_si512(t), _mm512_add_epi32(f, r), f);
    return K(v_sign4)(c, _mm512_castps_si512(y));
}
#else
GC_INLINE GV_I K(v_e2m1_sr)(GV_F y, GV_I r)
{
    GV_I a = K(v_absclip6)(y);
    GV_I ef = GV_SRLI(a, 23);
    GV_I sig = GV_OR(GV_AND(a, GV_SET1(0x7fffffu)), GV_SET1(0x800000u)); /* ef = 0: any sig gives 0 below */
    GV_I em = GV_MINU(ef, GV_SET1(127));                                  /* d = 22 + (127 - em) */
    GV_I hi = GV_SRLV(sig, GV_SUB(GV_SET1(149), em));
    GV_I lo = GV_OR(GV_SLLV(sig, GV_SUB(em, GV_SET1(117))), GV_SRLV(sig, GV_SUB(GV_SET1(117), em)));
    GV_I c = GV_ADD(hi, GV_SLLI(GV_SUB(ef, em), 1));                      /* + (max(e, 0) << 1) */
    c = K(v_addc)(c, GV_ADD(lo, r), lo);
    return K(v_sign4)(c, GV_CASTI(y));
}
#endif
#else
#define GC_VEC_MX 0
#endif

/* Philox bits of elements idx0 .. idx0 + len - 1 */
GC_INLINE void K(rbits)(const gc_rng *g, uint64_t idx0, size_t len, uint32_t *restrict r)
{
    const uint32_t k0 = g->k0, k1 = g->k1;
    size_t i = 0;
#if GC_VEC_MX
    if (len >= GV_W && K(same_hi)(idx0, len)) {
        GV_I ctr = GV_ADD64(GV_SET1_64(idx0), GV_IOTA2());
        for (; i + GV_W <= len; i += GV_W) {
            GV_STOREI(r + i, K(vphilox_u)(ctr, (uint32_t)(idx0 >> 32), k0, k1));
            ctr = GV_ADD64(ctr, GV_SET1_64(GV_W));
        }
    }
    for (; i + GV_W <= len; i += GV_W)
        GV_STOREI(r + i, K(vphilox)(idx0 + i, k0, k1));
#endif
    for (; i < len; i++) {
        uint64_t idx = idx0 + i;
        r[i] = gc_philox_w0((uint32_t)idx, (uint32_t)(idx >> 32), k0, k1);
    }
}

/* element code of fp32(x * mult), clipped to the element max, rounded (nearest or with bits r) */
GC_INLINE uint32_t K(qelem)(float x, float mult, uint32_t r, const int ek, const int sr)
{
    uint32_t u = gc_bits(x * mult);
    uint32_t a = u & 0x7fffffffu;
    a = a < GC_ELEM_MAXB(ek) ? a : GC_ELEM_MAXB(ek);
    return gc_qmag(a, r, GC_ELEM_MANT(ek), GC_ELEM_EMIN(ek), sr) | ((u >> 31) << GC_ELEM_SBIT(ek));
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
    } else if (ek == GC_ELEM_E2M1) { /* E2M1 nearest-even by thresholds (ties 0.25, 1.25, 2.5, 5 go down) */
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
                           uint64_t idx0, const gc_rng *rng, const int ek, const int rule)
{
    uint32_t r[GC_CHUNK];
    uint8_t tmpc[GC_CHUNK];
    uint8_t *codes = ek == GC_ELEM_E2M1 ? tmpc : pay;
    if (rng)
        K(rbits)(rng, idx0, len, r);
    for (size_t j0 = 0, b = 0; j0 < len; j0 += 32, b++) {
        size_t bl = len - j0 < 32 ? len - j0 : 32;
        uint32_t m = K(amax_plain)(x + j0, bl);
        if (m >= GC_INF_BITS) {
            sc[b] = 0xff;
            memset(codes + j0, (int)GC_ELEM_NAN(ek), bl);
            continue;
        }
        uint32_t code = gc_e8m0_code(m, ek, rule);
        sc[b] = (uint8_t)code;
        float mult = gc_float((254u - code) << 23);
        if (bl == 32)
            K(qloop)(x + j0, 32, mult, rng ? r + j0 : NULL, codes + j0, ek);
        else
            K(qloop)(x + j0, bl, mult, rng ? r + j0 : NULL, codes + j0, ek);
    }
    if (ek == GC_ELEM_E2M1)
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
        } else if (ek == GC_ELEM_E2M1) {
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

#if GC_VEC_MX
/* Prefetch hints for the next chunk of a decode, at value i of this one: its output line of 16
 * floats (read by the accumulate, written by the decode), and a payload line every 128 values.
 * The streams are sequential, but the hardware prefetchers alone leave the kernels waiting on
 * L3 (up to 1.5x slower on the development host). A prefetch never faults, also past the end. */
GC_INLINE void K(v_prefetch_next)(const uint8_t *pay, const float *out, size_t i)
{
    __builtin_prefetch(out + GC_CHUNK + i, 1, 3);
    if (i % 128 == 0)
        __builtin_prefetch(pay + GC_CHUNK / 2 + i / 2, 0, 3);
}

/* the same for the fused hop: its input payload, local and the sums (when sum_out) */
GC_INLINE void K(v_prefetch_hop)(const uint8_t *pay, const float *l, const float *dst, size_t i)
{
    __builtin_prefetch(l + GC_CHUNK + i, 0, 3);
    __builtin_prefetch(dst + GC_CHUNK + i, 1, 3);
    if (i % 128 == 0)
        __builtin_prefetch(pay + GC_CHUNK / 2 + i / 2, 0, 3);
}

#define GC_BMV 8 /* vectors of block amax per chunk: at most 64 blocks / 8 lanes */

/* ---- SIMD paths of the 4-bit formats: whole 1024-value chunks, both roundings ----
 *
 * Same arithmetic as the scalar code above, GV_W lanes at a time, so the bytes are identical.
 * Encode is two passes over the chunk (in L1):
 *   scales    per-block amax for many blocks at once by a transpose-and-max of one vector of |bits|
 *             per block (each level keeps, for each block, half as many partial maxima), then
 *             nvfp4's E4M3 block scales (round, bump up when below t, at least 1, 1 / (d * s2)) or
 *             MX's E8M0 exponents, one vector of blocks at a time, into a per-block multiplier;
 *   elements  4 vectors per step: x * multiplier, rounded to E2M1 (K(v_e2m1_rn), or K(v_e2m1_sr)
 *             with the words of K(vphilox) for the same element indices), NaN blocks zeroed, and
 *             the 4 GV_W codes packed into nibbles (two packus steps to bytes in a known order, the
 *             pairs ORed into one byte, then one permute puts the bytes in message order).
 * Decode looks the 16 E2M1 values up in a table (exact, so table[c] * d = gc_de2m1(c) * d) and
 * multiplies by the block scale. The partial last chunk of a message takes the scalar code.
 */
#if defined(GC_X512)

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
    __m512i ib = _mm512_add_epi32(ia, GV_SET1(half));
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
    __m512i nb = _mm512_add_epi32(_mm512_slli_epi32(m, 20), GV_SET1(120u << 23));
    __m512 sb = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(m, 20), GV_SET1(121u << 23))),
                              _mm512_set1_ps(0x1p-6f));
    return _mm512_mask_blend_ps(_mm512_cmplt_epu32_mask(m, GV_SET1(8)), _mm512_castsi512_ps(nb), sb);
}

/* gc_d8(c, 0) for any byte c */
GC_INLINE __m512 K(v_d8)(__m512i c)
{
    __m512i m = _mm512_and_si512(c, GV_SET1(0x7f));
    __m512i b = _mm512_castps_si512(K(v_d8pos)(m));
    b = _mm512_mask_mov_epi32(b, _mm512_cmpeq_epi32_mask(m, GV_SET1(0x7f)), GV_SET1(0x7fc00000u));
    return _mm512_castsi512_ps(_mm512_or_si512(b, _mm512_slli_epi32(_mm512_and_si512(c, GV_SET1(0x80)), 24)));
}

/* block amax (|bits|) of an nvfp4 group: bm[k] lane i = block 16 k + i */
GC_INLINE void K(nv_amax)(const float *restrict x, __m512i bm[GC_BMV])
{
    const __m512i absm = GV_SET1(0x7fffffffu);
    for (int k = 0; k < 4; k++) {
        __m512i v[16];
        for (int i = 0; i < 16; i++)
            v[i] = _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x + 256 * k + 16 * i)), absm);
        bm[k] = K(v_amax16)(v);
    }
}

/* nvfp4 group from its block amax: block scales sc[64], group scale gs, multipliers rr[64];
 * returns the non-finite blocks as bits */
GC_INLINE uint64_t K(nv_scales_bm)(const __m512i bm[GC_BMV], uint8_t *restrict sc, uint8_t *gs, float *restrict rr)
{
    const __m512i inf = GV_SET1(GC_INF_BITS);
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
    for (int k = 0; k < 4; k++) {
        __m512i m = bm[k];
        __m512 t = _mm512_min_ps(_mm512_mul_ps(_mm512_castsi512_ps(m), _mm512_set1_ps(q2)), _mm512_set1_ps(448.0f));
        /* the smallest E4M3 value >= t: the scalar code's round-to-nearest plus the bump up is the
         * ceiling, integer for normal results, a round-up magic add below 2^-6 */
        __m512i a = _mm512_castps_si512(t);
        __m512i rn = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(a, GV_SET1(0xfffffu)), 20), GV_SET1(120u << 3));
        __m512i rs = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_round_ps(t, _mm512_set1_ps(16384.0f),
                                                                              _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC)),
                                      GV_SET1(0x46800000u));
        __m512i bs = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(a, GV_SET1(121u << 23)), rn, rs);
        bs = _mm512_max_epu32(bs, GV_SET1(1));
        __m512 rb = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(K(v_d8pos)(bs), _mm512_set1_ps(s2)));
        __mmask16 bad = (__mmask16)(nanb >> (16 * k));
        __mmask16 live = tiny ? 0 : (__mmask16)(~bad & _mm512_cmpneq_epi32_mask(m, _mm512_setzero_si512()));
        bs = _mm512_mask_mov_epi32(_mm512_maskz_mov_epi32(live, bs), bad, GV_SET1(0x7f));
        _mm512_store_ps(rr + 16 * k, _mm512_maskz_mov_ps(live, rb));
        _mm_storeu_si128((__m128i *)(sc + 16 * k), _mm512_cvtepi32_epi8(bs));
    }
    gc_store_f32(gs, s2);
    return nanb;
}

/* block amax of an mxfp4 chunk (32 blocks): bm[k] lane i = block 16 k + i */
GC_INLINE void K(mx4_amax)(const float *restrict x, __m512i bm[GC_BMV])
{
    const __m512i absm = GV_SET1(0x7fffffffu);
    for (int k = 0; k < 2; k++) {
        __m512i v[16];
        for (int i = 0; i < 16; i++) {
            const float *p = x + 512 * k + 32 * i;
            v[i] = _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(p)), absm),
                                    _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(p + 16)), absm));
        }
        bm[k] = K(v_amax16)(v);
    }
}

/* mxfp4 chunk from its block amax: E8M0 scales sc[32], multipliers mult[32]; returns the
 * non-finite blocks as bits */
GC_INLINE uint64_t K(mx4_scales_bm)(const __m512i bm[GC_BMV], uint8_t *restrict sc, float *restrict mult, const int rule)
{
    const __m512i inf = GV_SET1(GC_INF_BITS);
    uint64_t nanb = 0;
    for (int k = 0; k < 2; k++) {
        __m512i m = bm[k];
        __mmask16 bad = _mm512_cmpge_epu32_mask(m, inf);
        nanb |= (uint64_t)bad << (16 * k);
        __m512i e = _mm512_srli_epi32(m, 23);
        if (rule == GC_RULE_CEIL) /* gc_e8m0_code: + 1 where the mantissa field exceeds the max's, below the top binade */
            e = _mm512_mask_add_epi32(e, _mm512_cmpgt_epu32_mask(_mm512_and_si512(m, GV_SET1(0x7fffffu)),
                                                                 GV_SET1(GC_ELEM_MAXMANT(GC_ELEM_E2M1)))
                                             & _mm512_cmplt_epu32_mask(m, GV_SET1(0x7f000000u)), e, GV_SET1(1));
        __m512i code = _mm512_sub_epi32(_mm512_max_epu32(e, GV_SET1(GC_ELEM_EMAX(GC_ELEM_E2M1))), GV_SET1(GC_ELEM_EMAX(GC_ELEM_E2M1)));
        _mm512_store_si512(mult + 16 * k, _mm512_slli_epi32(_mm512_sub_epi32(GV_SET1(254), code), 23));
        code = _mm512_mask_mov_epi32(code, bad, GV_SET1(0xff));
        _mm_storeu_si128((__m128i *)(sc + 16 * k), _mm512_cvtepi32_epi8(code));
    }
    return nanb;
}

#if defined(GC_LUT8)
/* byte j of the packed output (codes 2j, 2j+1 of the 64) sits at this byte of the packus result:
 * block k = j / 8, pair q = j % 8 -> 16 * (q / 2) + 4 * k + 2 * (q % 2) */
static const uint8_t K(pack_order)[64] __attribute__((aligned(64))) = {
    0, 2, 16, 18, 32, 34, 48, 50, 4, 6, 20, 22, 36, 38, 52, 54,
    8, 10, 24, 26, 40, 42, 56, 58, 12, 14, 28, 30, 44, 46, 60, 62,
    0, 2, 16, 18, 32, 34, 48, 50, 4, 6, 20, 22, 36, 38, 52, 54,
    8, 10, 24, 26, 40, 42, 56, 58, 12, 14, 28, 30, 44, 46, 60, 62};
#endif

/* 64 codes (c[v] lane i = code 16 v + i, each < 16) -> 32 bytes, code 2j in the low nibble of byte j.
 * packus_epi32 then packus_epi16 leave, in 128-bit lane L, codes 4L..4L+3 of c[0], c[1], c[2], c[3]
 * as four 4-byte groups; ORing each 16-bit word with itself >> 4 puts a pair's byte in its low byte. */
GC_INLINE void K(v_pack4)(const __m512i c[4], uint8_t *p)
{
    __m512i b = _mm512_packus_epi16(_mm512_packus_epi32(c[0], c[1]), _mm512_packus_epi32(c[2], c[3]));
    b = _mm512_or_si512(b, _mm512_srli_epi16(b, 4));
#if defined(GC_LUT8)
    b = _mm512_permutexvar_epi8(_mm512_load_si512(K(pack_order)), b);
    _mm256_storeu_si256((__m256i *)p, _mm512_castsi512_si256(b));
#else
    /* 4-byte group 4L + k -> 4k + L, then the low byte of every word */
    b = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), b);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi16_epi8(b));
#endif
}

/* 8 bytes -> the 16 E2M1 values: lane i gets the 4-byte half holding nibble i, shifted down by
 * 4 * (i % 8); vpermps reads only the low 4 bits of the index */
GC_INLINE __m512 K(v_unpack16)(const uint8_t *p, __m512 tab)
{
    __m512i b = _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i *)p));
    __m512i w = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), b);
    __m512i c = _mm512_srlv_epi32(w, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28));
    return _mm512_permutexvar_ps(c, tab);
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
    return _mm512_mask_mov_ps(s, nan, _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), GV_SET1(0x400000u))));
}

GC_INLINE void K(v_store)(float *o, __m512 v, const int acc)
{
    _mm512_storeu_ps(o, acc ? K(v_addf)(_mm512_loadu_ps(o), v) : v);
}

/* the decode scales d[64] = gc_d8(sc) * s2 of an nvfp4 group; returns its NaN blocks as bits */
GC_INLINE uint64_t K(nv_dscales)(const uint8_t *restrict sc, const uint8_t *gs, float *restrict d)
{
    const __m512 s2 = _mm512_set1_ps(gc_load_f32(gs));
    uint64_t nanb = 0;
    for (int k = 0; k < 4; k++) {
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sc + 16 * k)));
        _mm512_store_ps(d + 16 * k, _mm512_mul_ps(K(v_d8)(c), s2));
        nanb |= (uint64_t)_mm512_cmpeq_epi32_mask(_mm512_and_si512(c, GV_SET1(0x7f)), GV_SET1(0x7f)) << (16 * k);
    }
    return nanb;
}

/* nvfp4 group of exactly 1024 values: out = v, or out += v */
static void K(nv_dec_v)(const uint8_t *restrict pay, const uint8_t *restrict sc, const uint8_t *gs,
                        float *restrict out, const int acc)
{
    const __m512 tab = K(v_e2m1_table)(), qnan = _mm512_castsi512_ps(GV_SET1(0x7fc00000u));
    float d[64] __attribute__((aligned(64)));
    uint64_t nanb = K(nv_dscales)(sc, gs, d);
    for (int b = 0; b < 64; b++) {
        K(v_prefetch_next)(pay, out, 16 * b);
        __m512 v = _mm512_mul_ps(K(v_unpack16)(pay + 8 * b, tab), _mm512_set1_ps(d[b]));
        if ((nanb >> b) & 1u)
            v = qnan;
        K(v_store)(out + 16 * b, v, acc);
    }
}

/* mxfp4 chunk of exactly 1024 values */
static void K(mx4_dec_v)(const uint8_t *restrict pay, const uint8_t *restrict sc, float *restrict out, const int acc)
{
    const __m512 tab = K(v_e2m1_table)(), qnan = _mm512_castsi512_ps(GV_SET1(0x7fc00000u));
    for (int b = 0; b < 32; b++) {
        K(v_prefetch_next)(pay, out, 32 * b);
        K(v_prefetch_next)(pay, out, 32 * b + 16);
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

/* Pass 1 of the fused hop on a whole chunk: dst = gc_addf(decode(msg_in's chunk), l), and the
 * block amax of dst (as K(nv_amax) / K(mx4_amax) of dst) while the sums are in registers. The
 * decoded operand is finite outside NaN blocks, where gc_addf is a plain add (a NaN in l comes
 * out quieted either way); a NaN block's sums are gc_addf(qNaN, l) = the quiet NaN. */
GC_INLINE void K(nv_dae1)(const uint8_t *restrict pay, const uint8_t *restrict sc, const uint8_t *gs,
                          const float *l, float *dst, __m512i bm[GC_BMV])
{
    const __m512 tab = K(v_e2m1_table)(), qnan = _mm512_castsi512_ps(GV_SET1(0x7fc00000u));
    const __m512i absm = GV_SET1(0x7fffffffu);
    float d[64] __attribute__((aligned(64)));
    uint64_t nanb = K(nv_dscales)(sc, gs, d);
    for (int k = 0; k < 4; k++) {
        __m512i v[16];
        for (int i = 0; i < 16; i++) {
            int b = 16 * k + i;
            K(v_prefetch_hop)(pay, l, dst, 16 * (size_t)b);
            __m512 e = _mm512_mul_ps(K(v_unpack16)(pay + 8 * b, tab), _mm512_set1_ps(d[b]));
            __m512 t = _mm512_add_ps(e, _mm512_loadu_ps(l + 16 * b));
            if ((nanb >> b) & 1u)
                t = qnan;
            _mm512_storeu_ps(dst + 16 * b, t);
            v[i] = _mm512_and_si512(_mm512_castps_si512(t), absm);
        }
        bm[k] = K(v_amax16)(v);
    }
}

GC_INLINE void K(mx4_dae1)(const uint8_t *restrict pay, const uint8_t *restrict sc, const float *l, float *dst,
                           __m512i bm[GC_BMV])
{
    const __m512 tab = K(v_e2m1_table)(), qnan = _mm512_castsi512_ps(GV_SET1(0x7fc00000u));
    const __m512i absm = GV_SET1(0x7fffffffu);
    for (int k = 0; k < 2; k++) {
        __m512i v[16];
        for (int i = 0; i < 16; i++) {
            int b = 16 * k + i;
            uint32_t c = sc[b];
            __m512 s = _mm512_set1_ps(gc_de8m0(c)), e[2];
            K(v_prefetch_hop)(pay, l, dst, 32 * (size_t)b);
            K(v_prefetch_hop)(pay, l, dst, 32 * (size_t)b + 16);
            e[0] = _mm512_mul_ps(K(v_unpack16)(pay + 16 * b, tab), s);
            e[1] = _mm512_mul_ps(K(v_unpack16)(pay + 16 * b + 8, tab), s);
            __m512i a = _mm512_setzero_si512();
            for (int h = 0; h < 2; h++) {
                __m512 t = c == 0xffu ? qnan : _mm512_add_ps(e[h], _mm512_loadu_ps(l + 32 * b + 16 * h));
                _mm512_storeu_ps(dst + 32 * b + 16 * h, t);
                a = _mm512_max_epu32(a, _mm512_and_si512(_mm512_castps_si512(t), absm));
            }
            v[i] = a;
        }
        bm[k] = K(v_amax16)(v);
    }
}

#else /* GC_X256 */

/* lane j = max of v[j]'s 8 lanes (unsigned), for 8 vectors: pairs of 32-bit, then 64-bit
 * interleaves (in-lane), then the two 128-bit halves */
GC_INLINE __m256i K(t8max)(const __m256i v[8])
{
    __m256i t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = _mm256_max_epu32(_mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        u[i] = _mm256_max_epu32(_mm256_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm256_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    return _mm256_max_epu32(_mm256_permute2x128_si256(u[0], u[1], 0x20), _mm256_permute2x128_si256(u[0], u[1], 0x31));
}

GC_INLINE uint32_t K(hmax8)(__m256i v)
{
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(m);
}

GC_INLINE __m256i K(v_abs)(const float *p)
{
    return _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(p)), GV_SET1(0x7fffffffu));
}

/* gc_d8(c, 0) for codes c in 0 .. 0x7e (no sign, no NaN) */
GC_INLINE __m256 K(v_d8pos)(__m256i m)
{
    __m256i s = _mm256_slli_epi32(m, 20);
    __m256i nb = _mm256_add_epi32(s, GV_SET1(120u << 23));
    __m256 sb = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_add_epi32(s, GV_SET1(121u << 23))), _mm256_set1_ps(0x1p-6f));
    return _mm256_blendv_ps(_mm256_castsi256_ps(nb), sb, _mm256_castsi256_ps(_mm256_cmpgt_epi32(GV_SET1(8), m)));
}

/* gc_d8(c, 0) for any byte c */
GC_INLINE __m256 K(v_d8)(__m256i c)
{
    __m256i m = _mm256_and_si256(c, GV_SET1(0x7f));
    __m256i b = _mm256_castps_si256(K(v_d8pos)(m));
    b = _mm256_blendv_epi8(b, GV_SET1(0x7fc00000u), _mm256_cmpeq_epi32(m, GV_SET1(0x7f)));
    return _mm256_castsi256_ps(_mm256_or_si256(b, _mm256_slli_epi32(_mm256_and_si256(c, GV_SET1(0x80)), 24)));
}

/* 4 vectors of 8 values 0..255 -> 32 bytes in order */
GC_INLINE void K(v_bytes32)(__m256i b0, __m256i b1, __m256i b2, __m256i b3, uint8_t *p)
{
    __m256i t = _mm256_packus_epi16(_mm256_packus_epi32(b0, b1), _mm256_packus_epi32(b2, b3));
    _mm256_storeu_si256((__m256i *)p, _mm256_permutevar8x32_epi32(t, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

GC_INLINE void K(nv_amax)(const float *restrict x, __m256i bm[GC_BMV])
{
    for (int k = 0; k < 8; k++) {
        __m256i v[8];
        for (int i = 0; i < 8; i++) {
            const float *p = x + 128 * k + 16 * i;
            v[i] = _mm256_max_epu32(K(v_abs)(p), K(v_abs)(p + 8));
        }
        bm[k] = K(t8max)(v);
    }
}

GC_INLINE uint64_t K(nv_scales_bm)(const __m256i bm[GC_BMV], uint8_t *restrict sc, uint8_t *gs, float *restrict rr)
{
    const __m256i fin = GV_SET1(0x7f7fffffu), zero = _mm256_setzero_si256();
    __m256i gv = zero;
    uint64_t nanb = 0;
    for (int k = 0; k < 8; k++) {
        __m256i bad = _mm256_cmpgt_epi32(bm[k], fin); /* |bits| < 2^31: signed compare */
        nanb |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(bad)) << (8 * k);
        gv = _mm256_max_epu32(gv, _mm256_andnot_si256(bad, bm[k]));
    }
    float gf = gc_float(K(hmax8)(gv));
    int tiny = gf < 0x1p-100f;
    float s2 = tiny ? 1.0f : gf / 2688.0f, q2 = tiny ? 0.0f : 448.0f / gf;
    __m256i bsv[8];
    for (int k = 0; k < 8; k++) {
        __m256i m = bm[k];
        __m256 t = _mm256_min_ps(_mm256_mul_ps(_mm256_castsi256_ps(m), _mm256_set1_ps(q2)), _mm256_set1_ps(448.0f));
        /* the smallest E4M3 value >= t (see the AVX-512 code); below 2^-6, ceil(t * 2^9) */
        __m256i a = _mm256_castps_si256(t);
        __m256i rn = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_add_epi32(a, GV_SET1(0xfffffu)), 20), GV_SET1(120u << 3));
        __m256i rs = _mm256_cvttps_epi32(_mm256_ceil_ps(_mm256_mul_ps(t, _mm256_set1_ps(512.0f))));
        __m256i bs = _mm256_blendv_epi8(rn, rs, _mm256_cmpgt_epi32(GV_SET1(121u << 23), a));
        bs = _mm256_max_epi32(bs, GV_SET1(1));
        __m256 rb = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(K(v_d8pos)(bs), _mm256_set1_ps(s2)));
        __m256i bad = _mm256_cmpgt_epi32(m, fin);
        __m256i live = tiny ? zero : _mm256_andnot_si256(_mm256_or_si256(bad, _mm256_cmpeq_epi32(m, zero)), GV_SET1(-1));
        bsv[k] = _mm256_or_si256(_mm256_and_si256(live, bs), _mm256_and_si256(bad, GV_SET1(0x7f)));
        _mm256_store_ps(rr + 8 * k, _mm256_and_ps(_mm256_castsi256_ps(live), rb));
    }
    K(v_bytes32)(bsv[0], bsv[1], bsv[2], bsv[3], sc);
    K(v_bytes32)(bsv[4], bsv[5], bsv[6], bsv[7], sc + 32);
    gc_store_f32(gs, s2);
    return nanb;
}

GC_INLINE void K(mx4_amax)(const float *restrict x, __m256i bm[GC_BMV])
{
    for (int k = 0; k < 4; k++) {
        __m256i v[8];
        for (int i = 0; i < 8; i++) {
            const float *p = x + 256 * k + 32 * i;
            v[i] = _mm256_max_epu32(_mm256_max_epu32(K(v_abs)(p), K(v_abs)(p + 8)),
                                    _mm256_max_epu32(K(v_abs)(p + 16), K(v_abs)(p + 24)));
        }
        bm[k] = K(t8max)(v);
    }
}

GC_INLINE uint64_t K(mx4_scales_bm)(const __m256i bm[GC_BMV], uint8_t *restrict sc, float *restrict mult, const int rule)
{
    const __m256i fin = GV_SET1(0x7f7fffffu);
    __m256i cv[4];
    uint64_t nanb = 0;
    for (int k = 0; k < 4; k++) {
        __m256i m = bm[k];
        __m256i bad = _mm256_cmpgt_epi32(m, fin);
        nanb |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(bad)) << (8 * k);
        __m256i e = _mm256_srli_epi32(m, 23);
        if (rule == GC_RULE_CEIL) /* gc_e8m0_code: + 1 (subtract -1) where the mantissa field exceeds the max's
                                   * below the top binade (|bits| < 2^31: signed compares are exact) */
            e = _mm256_sub_epi32(e, _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_and_si256(m, GV_SET1(0x7fffffu)),
                                                                         GV_SET1(GC_ELEM_MAXMANT(GC_ELEM_E2M1))),
                                                      _mm256_cmpgt_epi32(GV_SET1(0x7f000000u), m)));
        __m256i code = _mm256_sub_epi32(_mm256_max_epu32(e, GV_SET1(GC_ELEM_EMAX(GC_ELEM_E2M1))), GV_SET1(GC_ELEM_EMAX(GC_ELEM_E2M1)));
        _mm256_store_si256((__m256i *)(void *)(mult + 8 * k), _mm256_slli_epi32(_mm256_sub_epi32(GV_SET1(254), code), 23));
        cv[k] = _mm256_blendv_epi8(code, GV_SET1(0xff), bad);
    }
    K(v_bytes32)(cv[0], cv[1], cv[2], cv[3], sc);
    return nanb;
}

/* 32 codes (c[v] lane i = code 8 v + i, each < 16) -> 16 bytes, code 2j in the low nibble of byte j.
 * After the packus steps, 128-bit half h holds codes 4h..4h+3 of c[0], c[1], c[2], c[3] as 4-byte
 * groups; the pairs ORed into bytes, the even bytes gathered (8 per half, 2 per group), and the
 * 2-byte units of the two halves interleaved. */
GC_INLINE void K(v_pack4)(const __m256i c[4], uint8_t *p)
{
    __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    b = _mm256_or_si256(b, _mm256_srli_epi16(b, 4));
    b = _mm256_shuffle_epi8(b, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1,
                                                0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1));
    _mm_storeu_si128((__m128i *)p, _mm_unpacklo_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

/* bytes 3 and 2 of the E2M1 values' float32 bits (the low two are zero), by code (sign at bit 3) */
#define GC_E2M1_HI 0x00, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40, -0x80, -0x41, -0x41, -0x41, -0x40, -0x40, -0x40, -0x40
#define GC_E2M1_LO 0x00, 0x00, -0x80, -0x40, 0x00, 0x40, -0x80, -0x40, 0x00, 0x00, -0x80, -0x40, 0x00, 0x40, -0x80, -0x40

/* 16 bytes -> the 32 E2M1 values in v[0..3]. The codes are ordered so that 128-bit half h holds
 * 4-code groups h, 2 + h, 4 + h, 6 + h; the two looked-up bytes of a value, interleaved into words
 * and then into the top of 32-bit lanes (zero low words), then come out in order. */
GC_INLINE void K(v_unpack32)(const uint8_t *p, __m256 v[4])
{
    const __m128i m = _mm_set1_epi8(0x0f);
    const __m256i th = _mm256_setr_epi8(GC_E2M1_HI, GC_E2M1_HI), tl = _mm256_setr_epi8(GC_E2M1_LO, GC_E2M1_LO);
    const __m256i z = _mm256_setzero_si256();
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    __m256i c = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(lo, hi)), _mm_unpackhi_epi8(lo, hi), 1);
    c = _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    __m256i h = _mm256_shuffle_epi8(th, c), l = _mm256_shuffle_epi8(tl, c);
    __m256i wa = _mm256_unpacklo_epi8(l, h), wb = _mm256_unpackhi_epi8(l, h);
    v[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, wa));
    v[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, wa));
    v[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, wb));
    v[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, wb));
}

GC_INLINE __m256 K(v_addf)(__m256 a, __m256 b)
{
    __m256 s = _mm256_add_ps(a, b);
    __m256 q = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(a), GV_SET1(0x400000u)));
    return _mm256_blendv_ps(s, q, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}

GC_INLINE void K(v_store)(float *o, __m256 v, const int acc)
{
    _mm256_storeu_ps(o, acc ? K(v_addf)(_mm256_loadu_ps(o), v) : v);
}

GC_INLINE uint64_t K(nv_dscales)(const uint8_t *restrict sc, const uint8_t *gs, float *restrict d)
{
    const __m256 s2 = _mm256_set1_ps(gc_load_f32(gs));
    uint64_t nanb = 0;
    for (int k = 0; k < 8; k++) {
        __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8 * k)));
        _mm256_store_ps(d + 8 * k, _mm256_mul_ps(K(v_d8)(c), s2));
        __m256i nan = _mm256_cmpeq_epi32(_mm256_and_si256(c, GV_SET1(0x7f)), GV_SET1(0x7f));
        nanb |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(nan)) << (8 * k);
    }
    return nanb;
}

static void K(nv_dec_v)(const uint8_t *restrict pay, const uint8_t *restrict sc, const uint8_t *gs,
                        float *restrict out, const int acc)
{
    const __m256 qnan = _mm256_castsi256_ps(GV_SET1(0x7fc00000u));
    float d[64] __attribute__((aligned(32)));
    uint64_t nanb = K(nv_dscales)(sc, gs, d);
    for (int b = 0; b < 64; b += 2) {
        __m256 v[4];
        K(v_prefetch_next)(pay, out, 16 * b);
        K(v_prefetch_next)(pay, out, 16 * b + 16);
        K(v_unpack32)(pay + 8 * b, v);
        __m256 d0 = _mm256_set1_ps(d[b]), d1 = _mm256_set1_ps(d[b + 1]);
        v[0] = _mm256_mul_ps(v[0], d0);
        v[1] = _mm256_mul_ps(v[1], d0);
        v[2] = _mm256_mul_ps(v[2], d1);
        v[3] = _mm256_mul_ps(v[3], d1);
        if ((nanb >> b) & 3u) {
            if ((nanb >> b) & 1u)
                v[0] = v[1] = qnan;
            if ((nanb >> b) & 2u)
                v[2] = v[3] = qnan;
        }
        for (int i = 0; i < 4; i++)
            K(v_store)(out + 16 * b + 8 * i, v[i], acc);
    }
}

static void K(mx4_dec_v)(const uint8_t *restrict pay, const uint8_t *restrict sc, float *restrict out, const int acc)
{
    const __m256 qnan = _mm256_castsi256_ps(GV_SET1(0x7fc00000u));
    for (int b = 0; b < 32; b++) {
        uint32_t c = sc[b];
        __m256 s = _mm256_set1_ps(gc_de8m0(c)), v[4];
        K(v_prefetch_next)(pay, out, 32 * b);
        K(v_prefetch_next)(pay, out, 32 * b + 16);
        K(v_unpack32)(pay + 16 * b, v);
        for (int i = 0; i < 4; i++)
            v[i] = c == 0xffu ? qnan : _mm256_mul_ps(v[i], s);
        for (int i = 0; i < 4; i++)
            K(v_store)(out + 32 * b + 8 * i, v[i], acc);
    }
}

GC_INLINE void K(nv_dae1)(const uint8_t *restrict pay, const uint8_t *restrict sc, const uint8_t *gs,
                          const float *l, float *dst, __m256i bm[GC_BMV])
{
    const __m256 qnan = _mm256_castsi256_ps(GV_SET1(0x7fc00000u));
    const __m256i absm = GV_SET1(0x7fffffffu);
    float d[64] __attribute__((aligned(32)));
    uint64_t nanb = K(nv_dscales)(sc, gs, d);
    for (int k = 0; k < 8; k++) {
        __m256i v[8];
        for (int i = 0; i < 8; i += 2) {
            int b = 8 * k + i;
            __m256 e[4];
            K(v_prefetch_hop)(pay, l, dst, 16 * (size_t)b);
            K(v_prefetch_hop)(pay, l, dst, 16 * (size_t)b + 16);
            K(v_unpack32)(pay + 8 * b, e);
            for (int j = 0; j < 4; j++) {
                int bj = b + (j >> 1);
                __m256 t = _mm256_add_ps(_mm256_mul_ps(e[j], _mm256_set1_ps(d[bj])), _mm256_loadu_ps(l + 16 * b + 8 * j));
                if ((nanb >> bj) & 1u)
                    t = qnan;
                _mm256_storeu_ps(dst + 16 * b + 8 * j, t);
                e[j] = t;
            }
            v[i] = _mm256_max_epu32(_mm256_and_si256(_mm256_castps_si256(e[0]), absm),
                                    _mm256_and_si256(_mm256_castps_si256(e[1]), absm));
            v[i + 1] = _mm256_max_epu32(_mm256_and_si256(_mm256_castps_si256(e[2]), absm),
                                        _mm256_and_si256(_mm256_castps_si256(e[3]), absm));
        }
        bm[k] = K(t8max)(v);
    }
}

GC_INLINE void K(mx4_dae1)(const uint8_t *restrict pay, const uint8_t *restrict sc, const float *l, float *dst,
                           __m256i bm[GC_BMV])
{
    const __m256 qnan = _mm256_castsi256_ps(GV_SET1(0x7fc00000u));
    const __m256i absm = GV_SET1(0x7fffffffu);
    for (int k = 0; k < 4; k++) {
        __m256i v[8];
        for (int i = 0; i < 8; i++) {
            int b = 8 * k + i;
            uint32_t c = sc[b];
            __m256 s = _mm256_set1_ps(gc_de8m0(c)), e[4];
            K(v_prefetch_hop)(pay, l, dst, 32 * (size_t)b);
            K(v_prefetch_hop)(pay, l, dst, 32 * (size_t)b + 16);
            K(v_unpack32)(pay + 16 * b, e);
            __m256i a = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                __m256 t = c == 0xffu ? qnan : _mm256_add_ps(_mm256_mul_ps(e[j], s), _mm256_loadu_ps(l + 32 * b + 8 * j));
                _mm256_storeu_ps(dst + 32 * b + 8 * j, t);
                a = _mm256_max_epu32(a, _mm256_and_si256(_mm256_castps_si256(t), absm));
            }
            v[i] = a;
        }
        bm[k] = K(t8max)(v);
    }
}
#endif /* GC_X256 */

/* E2M1 codes of one whole chunk with multipliers mult[block] (blocks of 1 << bsh values), the
 * blocks set in nanb all-zero codes, packed into pay[512]. Rounding sr: 0 nearest; 1 stochastic
 * with the Philox words of elements idx0 + i, whose counters share the high word; 2 the same for
 * any counters. */
GC_INLINE void K(v_e2m1_chunk)(const float *restrict x, const float *restrict mult, const int bsh, uint64_t nanb,
                               uint8_t *restrict pay, uint64_t idx0, uint32_t k0, uint32_t k1, const int sr,
                               size_t pf)
{
    const uint64_t step_blocks = ((uint64_t)1 << ((4 * GV_W) >> bsh)) - 1u;
    const uint32_t h = (uint32_t)(idx0 >> 32);
    GV_I ctr = GV_ADD64(GV_SET1_64(idx0), GV_IOTA2());
    for (size_t j = 0; j < GC_CHUNK; j += 4 * GV_W) {
        GV_I c[4];
        for (int v = 0; v < 4; v++) {
            size_t o = j + (size_t)v * GV_W;
            if (pf && v * GV_W % 16 == 0) /* the chunk pf values ahead, one 64-byte line per 16 values */
                __builtin_prefetch(x + pf + o, 0, 3);
            GV_F y = GV_MULPS(GV_LOADPS(x + o), GV_SET1PS(mult[o >> bsh]));
            if (sr == 1) {
                c[v] = K(v_e2m1_sr)(y, K(vphilox_u)(ctr, h, k0, k1));
                ctr = GV_ADD64(ctr, GV_SET1_64(GV_W));
            } else if (sr == 2) {
                c[v] = K(v_e2m1_sr)(y, K(vphilox)(idx0 + o, k0, k1));
            } else {
                c[v] = K(v_e2m1_rn)(y);
            }
        }
        if ((nanb >> (j >> bsh)) & step_blocks)
            for (int v = 0; v < 4; v++)
                if ((nanb >> ((j + (size_t)v * GV_W) >> bsh)) & 1u)
                    c[v] = GV_ZERO();
        K(v_pack4)(c, pay + j / 2);
    }
}

/* the element pass of a chunk with either rounding */
GC_INLINE void K(v_e2m1_pass)(const float *restrict x, const float *restrict mult, const int bsh, uint64_t nanb,
                              uint8_t *restrict pay, uint64_t idx0, const gc_rng *rng, size_t pf)
{
    if (!rng)
        K(v_e2m1_chunk)(x, mult, bsh, nanb, pay, 0, 0, 0, 0, pf);
    else if (K(same_hi)(idx0, GC_CHUNK))
        K(v_e2m1_chunk)(x, mult, bsh, nanb, pay, idx0, rng->k0, rng->k1, 1, pf);
    else /* the chunk straddles a multiple of 2^32 elements */
        K(v_e2m1_chunk)(x, mult, bsh, nanb, pay, idx0, rng->k0, rng->k1, 2, pf);
}

/* encode of a whole chunk; bm: its block amax, when the caller has them */
static void K(nv_group_v)(const float *restrict x, uint8_t *restrict pay, uint8_t *restrict sc, uint8_t *gs,
                          uint64_t idx0, const gc_rng *rng, const GV_I *bm_in)
{
    float rr[64] __attribute__((aligned(64)));
    GV_I bm[GC_BMV];
    if (!bm_in) {
        K(nv_amax)(x, bm);
        bm_in = bm;
    }
    uint64_t nanb = K(nv_scales_bm)(bm_in, sc, gs, rr);
    K(v_e2m1_pass)(x, rr, 4, nanb, pay, idx0, rng, bm_in == bm ? GC_CHUNK : 0);
}

static void K(mx4_chunk_v)(const float *restrict x, uint8_t *restrict pay, uint8_t *restrict sc,
                           uint64_t idx0, const gc_rng *rng, const GV_I *bm_in, const int rule)
{
    float mult[32] __attribute__((aligned(64)));
    GV_I bm[GC_BMV];
    if (!bm_in) {
        K(mx4_amax)(x, bm);
        bm_in = bm;
    }
    uint64_t nanb = K(mx4_scales_bm)(bm_in, sc, mult, rule);
    K(v_e2m1_pass)(x, mult, 5, nanb, pay, idx0, rng, bm_in == bm ? GC_CHUNK : 0);
}
#endif /* GC_VEC_MX */

/* ---- whole messages: ek and packing from the format code (fmt: a format code; rule: the
 * E8M0 formats' shared-exponent rule, GC_RULE_CEIL or GC_RULE_FLOOR) ---- */

/* Pointers of chunk i0 (a multiple of GC_CHUNK) of a message of n values. */
#define GC_CHUNK_PTRS(fmt, msg, n, i0, pay, sc, gs)                                                        \
    uint8_t *pay = (msg) + (gc_is_packed(fmt) ? (i0) / 2u : (i0));                                        \
    uint8_t *sc = (msg) + gc_payload_bytes((n), (fmt)) + (i0) / gc_fixed_block(fmt);                      \
    uint8_t *gs = (fmt) == GC_NVFP4 ? (msg) + gc_group_offset(n) + 4u * ((i0) / GC_NVFP4_GROUP) : NULL

GC_INLINE void K(enc_chunk)(int fmt, int rule, const float *x, size_t len, uint8_t *pay, uint8_t *sc, uint8_t *gs,
                            uint64_t idx0, const gc_rng *rng)
{
#if GC_VEC_MX
    if (len == GC_CHUNK && fmt == GC_NVFP4) {
        K(nv_group_v)(x, pay, sc, gs, idx0, rng, NULL);
        return;
    }
    if (len == GC_CHUNK && fmt == GC_MXFP4) {
        K(mx4_chunk_v)(x, pay, sc, idx0, rng, NULL, rule);
        return;
    }
#endif
    switch (fmt) {
    case GC_NVFP4: K(nv_chunk)(x, len, pay, sc, gs, idx0, rng); break;
#define GC_MX_ENC(N, L) case GC_##N: K(mx_chunk)(x, len, pay, sc, idx0, rng, GC_##N##_ELEM, rule); break;
    GC_E8M0_ROWS(GC_MX_ENC)
#undef GC_MX_ENC
    default: break;
    }
}

GC_INLINE void K(dec_chunk)(int fmt, const uint8_t *pay, const uint8_t *sc, const uint8_t *gs, size_t len,
                            float *out, const int acc)
{
#if GC_VEC_MX
    if (len == GC_CHUNK && fmt == GC_NVFP4) {
        K(nv_dec_v)(pay, sc, gs, out, acc);
        return;
    }
    if (len == GC_CHUNK && fmt == GC_MXFP4) {
        K(mx4_dec_v)(pay, sc, out, acc);
        return;
    }
#endif
    switch (fmt) {
    case GC_NVFP4: K(nv_dec_chunk)(pay, sc, gs, len, out, acc); break;
#define GC_MX_DEC(N, L) case GC_##N: K(mx_dec_chunk)(pay, sc, len, out, GC_##N##_ELEM, acc); break;
    GC_E8M0_ROWS(GC_MX_DEC)
#undef GC_MX_DEC
    default: break;
    }
}

static void K(nvpad)(uint8_t *msg, size_t n)
{
    size_t a = gc_payload_bytes(n, GC_NVFP4) + (n + GC_NVFP4_FIXED_BLOCK - 1u) / GC_NVFP4_FIXED_BLOCK, b = gc_group_offset(n);
    memset(msg + a, 0, b - a);
}

static void K(encode_mx)(int fmt, int rule, const float *x, size_t n, uint8_t *msg, const gc_rng *rng)
{
    if (fmt == GC_NVFP4)
        K(nvpad)(msg, n);
    for (size_t i0 = 0; i0 < n; i0 += GC_CHUNK) {
        size_t len = n - i0 < GC_CHUNK ? n - i0 : GC_CHUNK;
        GC_CHUNK_PTRS(fmt, msg, n, i0, pay, sc, gs);
        K(enc_chunk)(fmt, rule, x + i0, len, pay, sc, gs, rng ? rng->offset + i0 : 0u, rng);
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
static void K(dae_mx)(int fmt, int rule, const uint8_t *msg_in, const float *local, size_t n, uint8_t *msg_out,
                      float *sum_out, const gc_rng *rng)
{
    float buf[GC_CHUNK];
    if (fmt == GC_NVFP4)
        K(nvpad)(msg_out, n);
    for (size_t i0 = 0; i0 < n; i0 += GC_CHUNK) {
        size_t len = n - i0 < GC_CHUNK ? n - i0 : GC_CHUNK;
        float *dst = sum_out ? sum_out + i0 : buf;
#if GC_VEC_MX
        if (len == GC_CHUNK && gc_is_packed(fmt)) { /* one pass decodes, adds and finds the block amax */
            GV_I bm[GC_BMV];
            const gc_rng *r = rng;
            uint64_t idx0 = rng ? rng->offset + i0 : 0u;
            {
                GC_CHUNK_PTRS(fmt, (uint8_t *)msg_in, n, i0, pay, sc, gs);
                if (fmt == GC_NVFP4)
                    K(nv_dae1)(pay, sc, gs, local + i0, dst, bm);
                else
                    K(mx4_dae1)(pay, sc, local + i0, dst, bm);
            }
            GC_CHUNK_PTRS(fmt, msg_out, n, i0, pay, sc, gs);
            if (fmt == GC_NVFP4)
                K(nv_group_v)(dst, pay, sc, gs, idx0, r, bm);
            else
                K(mx4_chunk_v)(dst, pay, sc, idx0, r, bm, rule);
            continue;
        }
#endif
        {
            GC_CHUNK_PTRS(fmt, (uint8_t *)msg_in, n, i0, pay, sc, gs);
            K(dec_chunk)(fmt, pay, sc, gs, len, buf, 0);
        }
        const float *l = local + i0;
        GC_PREFETCH_AHEAD(l, len, n - i0); /* the next chunk of local (4 KiB ahead) */
        for (size_t i = 0; i < len; i++)
            dst[i] = gc_addf(buf[i], l[i]);
        GC_CHUNK_PTRS(fmt, msg_out, n, i0, pay, sc, gs);
        K(enc_chunk)(fmt, rule, dst, len, pay, sc, gs, rng ? rng->offset + i0 : 0u, rng);
    }
}
