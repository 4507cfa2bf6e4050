/* giftcomm native codec: the adaptive-precision rows' layout (giftcomm/adaptive.py has the rules).
 *
 * An adaptive row's parameters (giftcomm.adaptive.AdaptiveSpec: budget in thousandths of a bit per
 * value, super-blocks per frame, the per-mille share of upgrade bytes spent on 8-bit tiers, the
 * 8-bit and 4-bit tiers' elements) are not compiled in: giftcomm.codec registers each spec it runs
 * with _codec_native._adaptive_slot(...) and passes the slot in the scale-rule bits of the variant
 * code (GC_VARIANT_RULE(v); slot 0 is never registered, so a bare adaptive code is refused).
 * The super-block is the format's fixed block (GC_FMT_FIXED_BLOCK), a multiple of
 * GC_ADA_BLOCK_MULTIPLE up to GC_ADA_MAX_BLOCK.
 */
#ifndef GC_ADAPTIVE_H
#define GC_ADAPTIVE_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gc_formats.h"

#define GC_ADA_T2 0u /* choice-bit codes (giftcomm.adaptive.TIER_*) */
#define GC_ADA_T4 1u
#define GC_ADA_T8 2u
#define GC_ADA_BLOCK_MULTIPLE 128u
#define GC_ADA_MAX_BLOCK 1024u
#define GC_ADA_SLOTS 64 /* registered specs, slot 0 unused */

typedef struct {
    uint32_t budget_mbits, frame, share8_permille;
    int top_int8; /* 8-bit tier: 0 E4M3 (float32 scale only), 1 INT8 (E4M3 scales per 32) */
    int mid_int4; /* 4-bit tier: 0 E2M1, 1 INT4 (both E4M3 scales per 16) */
} gc_ada_spec;

/* the registered specs (gc_module.c); a slot is written once, before its code is handed out */
extern gc_ada_spec gc_ada_specs[GC_ADA_SLOTS];
extern int gc_ada_nslots;

static inline const gc_ada_spec *gc_ada_spec_of(int v)
{
    int s = v >> GC_SCALE_RULE_SHIFT;
    return s >= 1 && s < gc_ada_nslots ? &gc_ada_specs[s] : (const gc_ada_spec *)0;
}

/* payload bytes (elements and element scales) of one super-block of `block` values per tier */
static inline size_t gc_ada_t8(const gc_ada_spec *s, size_t block) { return block + (s->top_int8 ? block / 32u : 0u); }
static inline size_t gc_ada_t4(size_t block) { return block / 2u + block / 16u; }
static inline size_t gc_ada_t2(size_t block) { return block / 4u + block / 32u; }
/* choice bits (padded to 4 bytes) and float32 super-scales of a frame of nsb super-blocks */
static inline size_t gc_ada_choice_bytes(size_t nsb) { return 4u * ((nsb + 15u) / 16u); }
static inline size_t gc_ada_head(size_t nsb) { return gc_ada_choice_bytes(nsb) + 4u * nsb; }

/* bytes of upgrades left after every super-block of the frame is at 2 bits (< 0: over budget) */
static inline int64_t gc_ada_avail(const gc_ada_spec *s, size_t nsb, size_t block)
{
    int64_t cap = (int64_t)((uint64_t)s->budget_mbits * nsb * block / 8000u);
    return cap - (int64_t)(gc_ada_head(nsb) + nsb * gc_ada_t2(block));
}

/* AdaptiveSpec.tier_counts: k8, k4 of a frame of nsb super-blocks (avail >= 0, checked at
 * registration for every frame size) */
static inline void gc_ada_counts(const gc_ada_spec *s, size_t nsb, size_t block, size_t *k8, size_t *k4)
{
    uint64_t t8 = gc_ada_t8(s, block), t4 = gc_ada_t4(block), t2 = gc_ada_t2(block);
    int64_t av = gc_ada_avail(s, nsb, block);
    uint64_t avail = av > 0 ? (uint64_t)av : 0u;
    uint64_t a8 = avail * s->share8_permille / (1000u * (t8 - t2));
    *k8 = a8 < nsb ? (size_t)a8 : nsb;
    uint64_t a4 = (avail - *k8 * (t8 - t2)) / (t4 - t2);
    *k4 = a4 < nsb - *k8 ? (size_t)a4 : nsb - *k8;
}

static inline size_t gc_ada_frame_bytes(const gc_ada_spec *s, size_t nsb, size_t block)
{
    size_t k8, k4;
    gc_ada_counts(s, nsb, block, &k8, &k4);
    return gc_ada_head(nsb) + k8 * gc_ada_t8(s, block) + k4 * gc_ada_t4(block) + (nsb - k8 - k4) * gc_ada_t2(block);
}

static inline size_t gc_ada_message_bytes(const gc_ada_spec *s, size_t n, size_t block)
{
    size_t nsb = (n + block - 1u) / block, full = nsb / s->frame, rest = nsb % s->frame;
    return full * gc_ada_frame_bytes(s, s->frame, block) + (rest ? gc_ada_frame_bytes(s, rest, block) : 0u);
}

/* Whether the choice bits of the frame at `fr` (nsb super-blocks) give the row's tier counts. */
static inline int gc_ada_frame_ok(const gc_ada_spec *s, const uint8_t *fr, size_t nsb, size_t block)
{
    size_t k8, k4, c[4] = {0, 0, 0, 0};
    gc_ada_counts(s, nsb, block, &k8, &k4);
    for (size_t j = 0; j < nsb; j++)
        c[(fr[j / 4u] >> (2u * (j % 4u))) & 3u]++;
    return c[GC_ADA_T8] == k8 && c[GC_ADA_T4] == k4 && c[GC_ADA_T2] == nsb - k8 - k4;
}

/* The first frame of a message of n values whose choice bits do not give the tier counts: its
 * super-block count in *nsb_bad and 1; 0 when every frame is right. */
static inline int gc_ada_find_corrupt(const gc_ada_spec *s, const uint8_t *msg, size_t n, size_t block, size_t *nsb_bad)
{
    size_t nsb = (n + block - 1u) / block;
    for (size_t j0 = 0; j0 < nsb; j0 += s->frame) {
        size_t m = nsb - j0 < s->frame ? nsb - j0 : s->frame;
        if (!gc_ada_frame_ok(s, msg, m, block)) {
            *nsb_bad = m;
            return 1;
        }
        msg += gc_ada_frame_bytes(s, m, block);
    }
    return 0;
}

/* The k-th largest (1 <= k <= n) of a[0..n) by radix selection on the bits, and *ties: how many
 * of the values equal to it are among the k largest. */
static inline uint32_t gc_ada_select(const uint32_t *a, size_t n, size_t k, size_t *ties)
{
    uint32_t prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        size_t hist[256];
        memset(hist, 0, sizeof hist);
        for (size_t i = 0; i < n; i++)
            if ((a[i] & mask) == prefix)
                hist[(a[i] >> shift) & 255u]++;
        int b = 255;
        for (; b > 0 && hist[b] < k; b--)
            k -= hist[b];
        prefix |= (uint32_t)b << shift;
        mask |= 255u << shift;
    }
    *ties = k;
    return prefix;
}

/* Rank threshold of the k largest of a[0..n) (ties: lower index first): element i is among them
 * exactly when a[i] > *v or (a[i] == *v and i <= *cut). k = 0: none (cut = -1 never reached). */
static inline void gc_ada_threshold(const uint32_t *a, size_t n, size_t k, uint32_t *v, int64_t *cut)
{
    *v = 0xffffffffu;
    *cut = -1;
    if (!k)
        return;
    size_t ties;
    *v = gc_ada_select(a, n, k, &ties);
    for (size_t i = 0; i < n; i++)
        if (a[i] == *v && --ties == 0) {
            *cut = (int64_t)i;
            break;
        }
}

#endif
