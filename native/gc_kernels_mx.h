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
