"""The vectorized Philox4x32-10 generator and the SIMD paths of the 4-bit formats (docs/native.md).

Native equals the NumPy reference bit for bit on every kernel variant this CPU has:
- stochastic rounding at element offsets where the generator takes its fast path (all counters
  of a chunk share the high word), its general path (a chunk across a multiple of 2^32 elements)
  and the 2^64 wrap, for the formats that use the generator through the word buffer (e4m3,
  mxfp8) and the fused 4-bit loops (nvfp4, mxfp4);
- whole 1024-value chunks (the SIMD paths) filled with every E2M1 value, tie and tie neighbour,
  signed zeros, saturation, non-finite and all-zero blocks, and a tiny nvfp4 group;
- the fused hop with msg_in is msg_out and sum_out is local on whole chunks.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import E8M0_FORMATS, FOUR_BIT_FORMATS, SCALED_SAMPLE, native_only, scale_rule_edges

from giftcomm import codec
from giftcomm.formats import Format, get_format, message_nbytes, resolve_block
from giftcomm.reference import codec as ref

pytestmark = pytest.mark.skipif(not codec.native_variants(), reason="native codec extension not built")

KEYS = (0x0123456789ABCDEF, 0, (1 << 64) - 1)
OFFSETS = (0, 1000, (1 << 32) - 5, (1 << 32) - 1024, (1 << 32) - 1030, (1 << 32) + 3, (1 << 33) - 2047,
           (1 << 64) - 3000, (1 << 64) - 1, 0x9E3779B97F4A7C15)
FORMATS = native_only(SCALED_SAMPLE)


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


def _each_variant():
    before = codec.native_variant()
    try:
        for isa in codec.native_variants():
            codec.use_native_variant(isa)
            yield isa
    finally:
        codec.use_native_variant(before)


def _check(x: np.ndarray, local: np.ndarray, fmt: str | Format, key: int | None, offset: int, what: str) -> None:
    """encode, decode, decode_accumulate and the fused hop (plain, sum_out, fully aliased)."""
    n, f = x.size, get_format(fmt)
    block = resolve_block(f, None)
    kw = dict(rounding="stochastic", key=key, offset=offset) if key is not None else {}
    want = ref.encode(x, fmt, **kw)
    with np.errstate(invalid="ignore", over="ignore"):
        total = ref.decode(want, n, fmt) + local
    want_hop = ref.encode(total, fmt, **kw)
    k = codec.NativeKernels
    for isa in _each_variant():
        got = np.full(want.size, 0xAA, np.uint8)
        k.encode(x, f, block, got, key, offset)
        assert np.array_equal(got, want), f"{isa} {what} encode: bytes {np.flatnonzero(got != want)[:8]}"
        dec = np.empty(n, np.float32)
        k.decode(want, n, f, block, dec)
        assert _bits_equal(dec, ref.decode(want, n, fmt)), f"{isa} {what} decode"
        acc = local.copy()
        k.decode_accumulate(want, acc, f, block)
        assert _bits_equal(acc, total), f"{isa} {what} accumulate"
        out, s = np.full(want.size, 0x55, np.uint8), np.empty(n, np.float32)
        k.decode_add_encode(want, local, f, block, out, s, key, offset)
        assert np.array_equal(out, want_hop), f"{isa} {what} hop: bytes {np.flatnonzero(out != want_hop)[:8]}"
        assert _bits_equal(s, total), f"{isa} {what} hop sum"
        out2 = np.full(want.size, 0x55, np.uint8)
        k.decode_add_encode(want, local, f, block, out2, None, key, offset)
        assert np.array_equal(out2, want_hop), f"{isa} {what} hop without sum_out"
        m, loc = want.copy(), local.copy()  # msg_in is msg_out, sum_out is local
        k.decode_add_encode(m, loc, f, block, m, loc, key, offset)
        assert np.array_equal(m, want_hop), f"{isa} {what} aliased hop"
        assert _bits_equal(loc, total), f"{isa} {what} aliased hop sum"


def _wide(rng: np.random.Generator, n: int) -> np.ndarray:
    """Per-32-value magnitudes from 2^-30 to 2^30, 1% zeros: values everywhere on the element grid."""
    x = rng.standard_normal(n) * np.repeat(np.exp2(rng.uniform(-30, 30, (n + 31) // 32)), 32)[:n]
    x[rng.random(n) < 0.01] = 0
    return x.astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("offset", OFFSETS)
def test_stochastic_at_counter_edges(fmt, offset):
    """Whole chunks and a partial one around 2^32 and 2^64 element indices; several keys."""
    rng = np.random.default_rng(offset % 1000003)
    n = 4 * 1024 + 37
    x, local = _wide(rng, n), (rng.standard_normal(n) * 4).astype(np.float32)
    for key in KEYS:
        _check(x, local, fmt, key, offset, f"{fmt} key={key:#x} offset={offset:#x}")


def _e2m1_edges() -> np.ndarray:
    """Every E2M1 magnitude, the ties between them and their float32 neighbours, both signs."""
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    v = np.concatenate([grid, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(7)),
                        np.nextafter(grid, np.float32(0)), np.nextafter(grid, np.float32(7)),
                        [6.0001, 7.0, 1e-30, 1.4e-45, 2.0**-33, 2.0**-32 * 3]]).astype(np.float32)
    return np.concatenate([v, -v])


def _tiled_chunks(rng: np.random.Generator, fmt: str) -> np.ndarray:
    """Four whole chunks: the edge values in every block at several block maxima, plus special blocks."""
    blk = resolve_block(fmt, None)
    edges = _e2m1_edges()
    n = 4 * 1024
    x = np.empty(n, np.float32)
    for b in range(n // blk):
        vals = rng.choice(edges, blk)
        vals[rng.integers(blk)] = 6.0  # a block maximum on the grid's top: the values land on the grid
        x[b * blk:(b + 1) * blk] = vals * np.float32(2.0 ** int(rng.integers(-20, 20)))
    x[5 * blk:6 * blk] = 0.0
    x[6 * blk:7 * blk] = -0.0
    x[7 * blk + 3] = np.nan
    x[9 * blk + 1] = -np.inf
    x[11 * blk:12 * blk] = np.float32(3.4e38)  # saturates
    x[1024:2048] *= np.float32(2.0**-110)  # a tiny nvfp4 group (all-zero scales), tiny MX blocks
    return x


@pytest.mark.parametrize("fmt", native_only(FOUR_BIT_FORMATS))
@pytest.mark.parametrize("key", (None, 0x5DEECE66D))
def test_whole_chunks_edge_values(fmt, key):
    rng = np.random.default_rng(19)
    x = _tiled_chunks(rng, fmt)
    local = (rng.standard_normal(x.size) * np.float32(2.0 ** -3)).astype(np.float32)
    _check(x, local, fmt, key, 77, f"{fmt} edges")
    # the sum of the hop lands on the edge values too: local = edges - decoded
    dec = ref.decode(ref.encode(x, fmt), x.size, fmt)
    with np.errstate(invalid="ignore", over="ignore"):
        local2 = (_tiled_chunks(rng, fmt) - dec).astype(np.float32)
    local2[~np.isfinite(local2)] = 0
    _check(x, local2, fmt, key, 77, f"{fmt} edge sums")


@pytest.mark.parametrize("fmt", native_only(FOUR_BIT_FORMATS))
def test_random_float32_patterns(fmt):
    """Finite float32 bit patterns of every exponent, whole chunks, both roundings."""
    rng = np.random.default_rng(7)
    n = 8 * 1024
    u = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    x = u.view(np.float32).copy()
    x[~np.isfinite(x)] = 1.0
    local = (rng.standard_normal(n) * 1e3).astype(np.float32)
    for key in (None, 12345):
        _check(x, local, fmt, key, 3 << 30, f"{fmt} patterns")


def test_message_sizes_unchanged():
    """The SIMD paths write exactly the reference's message (pads included) for odd sizes."""
    rng = np.random.default_rng(3)
    for fmt in native_only(FOUR_BIT_FORMATS):
        for n in (1024, 1025, 2047, 3 * 1024 + 17):
            x, local = _wide(rng, n), rng.standard_normal(n).astype(np.float32)
            assert message_nbytes(n, fmt) == ref.encode(x, fmt).size
            _check(x, local, fmt, None, 0, f"{fmt} n={n}")
            _check(x, local, fmt, 99, n, f"{fmt} n={n} stochastic")


@pytest.mark.parametrize("rule", ("ceil", "floor"))
@pytest.mark.parametrize("fmt", native_only(E8M0_FORMATS))
@pytest.mark.parametrize("key", (None, 0xC0FFEE))
def test_mx_scale_rules_equal_reference_on_every_variant(fmt, rule, key):
    """Both E8M0 scale rules: every variant (the scalar MX chunk and the AVX2 / AVX-512 mxfp4
    scales) equals the reference on blocks at the rules' edges, with either rounding."""
    rng = np.random.default_rng(hash((fmt, rule)) % 1000)
    f = get_format(fmt).with_scale_rule(rule)
    x = scale_rule_edges(rng, fmt)
    local = (x * np.float32(0.25) + rng.standard_normal(x.size).astype(np.float32)).astype(np.float32)
    _check(x, local, f, key, 5, f"{fmt} mx_scale={rule}")
    other = get_format(fmt).with_scale_rule("floor" if rule == "ceil" else "ceil")
    assert not np.array_equal(ref.encode(x, f), ref.encode(x, other))  # the edges tell the rules apart
