"""The native C codec (giftcomm._codec_native) equals the NumPy reference codec bit for bit.

Messages are compared byte for byte. Decoded float32 vectors are compared as bit patterns, except
that NaN positions only need to agree (NaN payloads of decoded values are not part of the
contract); NaN payloads that reach a *message* (bf16, fp16, fp32 pass-through) are compared
exactly. Every test runs on every kernel variant this CPU supports (generic, avx2, avx512).

Random data comes from np.random.default_rng(seed) with a fresh seed per test, printed so that a
failure can be replayed (pytest shows captured output of failing tests).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import PASS_THROUGH_FORMATS, native_only

from giftcomm import _codec_native as native  # the build must have produced it
from giftcomm import codec
from giftcomm.formats import FORMATS, FORMATS_BY_CODE, SCALE_RULE_SHIFT, Format, message_nbytes, num_blocks, scales_offset
from giftcomm.reference import codec as ref

# the reference's float16 cast warns on overflow to Inf, which these tests do on purpose
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning"),
]

# the native formats that take any block (e4m3, e5m2, pass-through; a reference-only row is
# tests/test_format_table.py's); the fixed-block MX and nvfp4 formats:
# tests/test_formats_mx.py
FMT_NAMES = [name for name, f in FORMATS.items() if f.native and f.fixed_block is None]
FP8 = [f for f in FMT_NAMES if FORMATS[f].scaled]
SIZES = [0, 1, 3, 255, 256, 257, 1000, 4099]
BLOCKS = [1, 7, 32, 256, 1024]
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- helpers



@pytest.fixture
def rng(request):
    seed = int(np.random.SeedSequence().entropy % (1 << 63))
    print(f"{request.node.name}: seed={seed}")
    return np.random.default_rng(seed)


def f32bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def from_bits(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def assert_same_f32(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    """Equal float32 bit patterns, with NaN positions equal and NaN payloads ignored."""
    got, want = np.asarray(got, np.float32).reshape(-1), np.asarray(want, np.float32).reshape(-1)
    assert got.shape == want.shape, what
    gn, wn = np.isnan(got), np.isnan(want)
    bad = np.nonzero(gn != wn)[0]
    assert bad.size == 0, f"{what}: NaN positions differ at {bad[:8]}"
    diff = np.nonzero((f32bits(got) != f32bits(want)) & ~gn)[0]
    assert diff.size == 0, (
        f"{what}: {diff.size} values differ, first at {diff[:8]}: "
        f"got {[hex(v) for v in f32bits(got)[diff[:4]]]} want {[hex(v) for v in f32bits(want)[diff[:4]]]}"
    )


def assert_same_bytes(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    got, want = np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)
    assert got.shape == want.shape, f"{what}: {got.shape} vs {want.shape}"
    diff = np.nonzero(got != want)[0]
    assert diff.size == 0, f"{what}: {diff.size} bytes differ, first at {diff[:8]}: got {got[diff[:8]]} want {want[diff[:8]]}"


def assert_same_hop_message(got, want, msg_in, local, f: Format, block: int, what: str) -> None:
    """Fused-hop output equal byte for byte, except that where both the decoded input and local
    are NaN (pass-through formats) only NaN-ness must agree: which operand's NaN payload wins is
    not specified; NumPy itself takes the first operand in its SIMD body and the second in its
    loop tail, see docs/native.md."""
    n = local.size
    both = np.zeros(n, bool)
    if not f.scaled:
        both = np.isnan(ref.decode(msg_in, n, f, block)) & np.isnan(local)
    if not both.any():
        assert_same_bytes(got, want, what)
        return
    g = np.asarray(got).view(np.uint8)[: n * f.itemsize].view(f.wire_dtype)
    w = np.asarray(want).view(np.uint8)[: n * f.itemsize].view(f.wire_dtype)
    assert np.array_equal(g[~both].view(np.uint8), w[~both].view(np.uint8)), f"{what}: bytes differ"
    assert np.isnan(g[both].astype(np.float32)).all(), f"{what}: NaN + NaN must stay NaN"


def ref_dae(msg, local, f, block):
    with np.errstate(invalid="ignore", over="ignore"):
        total = ref.decode(msg, local.size, f, block) + local
    return ref.encode(total, f, block), total


def ref_acc(msg, acc, f, block):
    out = acc.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        out += ref.decode(msg, acc.size, f, block)
    return out


def check_all(x: np.ndarray, local: np.ndarray, f: Format, block: int, what: str = "") -> None:
    """All four native functions against the reference on one input (and its message)."""
    x = np.ascontiguousarray(x, np.float32)
    local = np.ascontiguousarray(local, np.float32)
    n = x.size
    nbytes = message_nbytes(n, f, block)
    with np.errstate(invalid="ignore", over="ignore"):
        want = ref.encode(x, f, block)
    got = np.full(nbytes, 0xA5, np.uint8)  # garbage, so padding must be written
    native.encode(x, got, f.code, block)
    assert_same_bytes(got, want, f"{what} encode")

    dec = np.empty(n, np.float32)
    native.decode(want, dec, f.code, block)
    assert_same_f32(dec, ref.decode(want, n, f, block), f"{what} decode")

    for with_sum in (False, True):
        out = np.full(nbytes, 0x5A, np.uint8)
        sum_out = np.empty(n, np.float32) if with_sum else None
        native.decode_add_encode(want, local, out, sum_out, f.code, block)
        want_msg, want_sum = ref_dae(want, local, f, block)
        assert_same_hop_message(out, want_msg, want, local, f, block, f"{what} decode_add_encode(sum_out={with_sum})")
        if with_sum:
            assert_same_f32(sum_out, want_sum, f"{what} decode_add_encode sum_out")

    acc = local.copy()
    native.decode_accumulate(want, acc, f.code, block)
    assert_same_f32(acc, ref_acc(want, local, f, block), f"{what} decode_accumulate")


# ---------------------------------------------------------------- edge-value tables


def fp8_table(f: Format) -> np.ndarray:
    """All finite non-negative values of an FP8 format, ascending, as float32."""
    vals = np.arange(256, dtype=np.uint8).view(f.wire_dtype).astype(np.float32)
    vals = np.unique(vals[np.isfinite(vals) & (vals >= 0)])
    return vals


def rounding_edges(grid: np.ndarray) -> np.ndarray:
    """Each grid value, each midpoint between neighbours (an RNE tie), and the float32 values
    one ulp either side of the grid values and the midpoints. Non-negative float32."""
    g = grid.astype(np.float64)
    mids = ((g[:-1] + g[1:]) / 2).astype(np.float32)  # exact in float32 for these grids
    assert np.array_equal(mids.astype(np.float64), (g[:-1] + g[1:]) / 2)
    pts = np.concatenate([grid, mids])
    up = np.nextafter(pts, np.float32(np.inf))
    down = np.nextafter(pts, np.float32(0))
    out = np.concatenate([pts, up, down]).astype(np.float32)
    return out[np.isfinite(out)]


def fp8_named_edges(f: Format) -> dict[str, np.ndarray]:
    """Named edge values, in units where the block scale is exactly 1 (amax == max)."""
    mx = np.float32(f.max_value)
    grid = fp8_table(f)
    sub = grid[1]  # smallest subnormal
    minnorm = np.float32(2.0**-6 if f.name == "e4m3" else 2.0**-14)
    return {
        "max": np.array([mx, np.nextafter(mx, np.float32(0))], np.float32),
        "min_normal": np.array([minnorm, np.nextafter(minnorm, np.float32(0)), np.nextafter(minnorm, mx)], np.float32),
        "smallest_subnormal": np.array([sub, sub * np.float32(1.5), sub * np.float32(2.5)], np.float32),
        "half_smallest_subnormal": np.array([sub / 2, np.nextafter(sub / 2, mx), np.nextafter(sub / 2, np.float32(0))], np.float32),
        "negative_zero": np.array([-0.0, 0.0], np.float32),
        "fp32_denormals": from_bits([1, 2, 0x7FFFFF, 0x400000]),
        "all_ties_and_neighbours": rounding_edges(grid),
    }


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_edge_table_scale_one(isa, fmt):
    """Blocks [max, v]: amax == max so scale == inv == 1 and v meets the cast itself."""
    f = FORMATS[fmt]
    mx = np.float32(f.max_value)
    for name, vals in fp8_named_edges(f).items():
        vals = np.concatenate([vals, -vals])
        x = np.empty(2 * vals.size, np.float32)
        x[0::2], x[1::2] = mx, vals
        check_all(x, x[::-1].copy(), f, 2, f"{fmt} {name} block 2")
        for block in (1, 7, 32, 256):
            check_all(x, -x, f, block, f"{fmt} {name} block {block}")
    # the codes themselves: every finite value v with scale 1 encodes to its own code
    grid = fp8_table(f)
    x = np.empty(2 * grid.size, np.float32)
    x[0::2], x[1::2] = mx, grid
    msg = np.empty(message_nbytes(x.size, f, 2), np.uint8)
    native.encode(x, msg, f.code, 2)
    codes = msg[1 : x.size : 2].view(f.wire_dtype).astype(np.float32)
    assert np.array_equal(codes, grid)


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_saturation_nonfinite_and_tiny_blocks(isa, fmt, rng):
    f = FORMATS[fmt]
    mx = np.float32(f.max_value)
    tiny = f.tiny_amax
    # amax values where fp32(amax * fp32(max / amax)) rounds above max: the clip must saturate
    amax = (rng.uniform(1, 2, 20000) * np.exp2(rng.integers(-60, 60, 20000))).astype(np.float32)
    inv = (mx / amax).astype(np.float32)
    over = amax[(amax * inv) > mx][:64]
    assert over.size > 0
    blocks = [np.array([a, -a, a / 3, -a / 1e3], np.float32) for a in over]
    # non-finite blocks: NaN (quiet, signalling, negative), +-Inf anywhere in the block
    specials = from_bits([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFA00000, 0x7F800000, 0xFF800000])
    for s in specials:
        blocks.append(np.array([1.0, s, -2.0, 0.0], np.float32))
        blocks.append(np.array([s, s, s, s], np.float32))
    # tiny-amax blocks (scale 1): below tiny, exactly tiny (regular), denormals, zeros, -0
    blocks += [
        np.array([np.nextafter(tiny, np.float32(0)), -tiny / 2, 1e-44, -0.0], np.float32),
        np.array([tiny, -tiny / 2, tiny / 3, 0.0], np.float32),
        np.array([-tiny, np.nextafter(tiny, mx), -1e-45, 1e-40], np.float32),
        from_bits([0x80000000, 0, 0x80000001, 0x00000001]),
        np.zeros(4, np.float32),
        np.array([-0.0, -0.0, -0.0, -0.0], np.float32),
        np.array([3.4e38, -3.4e38, 1.0, 1e-30], np.float32),  # fp32 max as amax
    ]
    x = np.concatenate(blocks)
    for block in (4, 1, 7, 32, 256):
        check_all(x, rng.standard_normal(x.size).astype(np.float32), f, block, f"{fmt} specials block {block}")


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_decode_every_code_and_random_scales(isa, fmt, rng):
    """Decode all 256 codes under scale 1, random scales, and NaN/Inf/denormal/zero scales;
    also decode_add_encode / decode_accumulate of such arbitrary messages."""
    f = FORMATS[fmt]
    codes = np.tile(np.arange(256, dtype=np.uint8), 8)
    n = codes.size
    block = 256
    scales = np.concatenate([
        np.ones(1, np.float32),
        from_bits([0x7FC00000, 0xFFC00001, 0x7F800000, 0x00000001, 0x80000000]),
        (rng.standard_normal(2) * 10.0 ** rng.uniform(-40, 38, 2)).astype(np.float32),
    ])
    msg = np.zeros(message_nbytes(n, f, block), np.uint8)
    msg[:n] = codes
    msg[scales_offset(n, f):].view(np.float32)[:] = scales
    dec = np.empty(n, np.float32)
    native.decode(msg, dec, f.code, block)
    assert_same_f32(dec, ref.decode(msg, n, f, block), f"{fmt} decode all codes")
    # scale 1: the decoded bits equal ml_dtypes' float32 values exactly, NaN bits included
    assert np.array_equal(f32bits(dec[:256]), f32bits(np.arange(256, dtype=np.uint8).view(f.wire_dtype).astype(np.float32)))
    local = (rng.standard_normal(n) * 100).astype(np.float32)
    for sum_out in (None, np.empty(n, np.float32)):
        out = np.empty_like(msg)
        native.decode_add_encode(msg, local, out, sum_out, f.code, block)
        want, total = ref_dae(msg, local, f, block)
        assert_same_bytes(out, want, f"{fmt} dae arbitrary message")
        if sum_out is not None:
            assert_same_f32(sum_out, total, f"{fmt} dae arbitrary message sum")
    acc = local.copy()
    native.decode_accumulate(msg, acc, f.code, block)
    assert_same_f32(acc, ref_acc(msg, local, f, block), f"{fmt} accumulate arbitrary message")


def test_fp8_random_bytes_messages(isa, rng):
    """Completely random messages (any code, any scale bits) through decode and the fused hop."""
    for fmt in FP8:
        f = FORMATS[fmt]
        for n, block in ((4099, 32), (1000, 7), (257, 256)):
            msg = rng.integers(0, 256, message_nbytes(n, f, block), dtype=np.uint8)
            local = rng.standard_normal(n).astype(np.float32)
            dec = np.empty(n, np.float32)
            native.decode(msg, dec, f.code, block)
            assert_same_f32(dec, ref.decode(msg, n, f, block), f"{fmt} random msg decode")
            out = np.empty_like(msg)
            native.decode_add_encode(msg, local, out, None, f.code, block)
            assert_same_bytes(out, ref_dae(msg, local, f, block)[0], f"{fmt} random msg dae")


# ---------------------------------------------------------------- 16-bit pass-through formats


def all16(f: Format) -> np.ndarray:
    """All 65536 values of a 16-bit format as float32 (ml_dtypes / numpy conversion)."""
    return np.arange(1 << 16, dtype=np.uint16).view(f.wire_dtype).astype(np.float32)


NAN_INPUTS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA00000, 0x7F80FFFF, 0x7FBFFFFF,
              0x7FFFFFFF, 0xFFFFFFFF, 0x7F812345, 0xFF802000, 0x7F801FFF, 0x7FC01000]


@pytest.mark.parametrize("fmt", [f for f in native_only(PASS_THROUGH_FORMATS) if FORMATS[f].value_bits == 16])
def test_16bit_exhaustive(isa, fmt, rng):
    """Every 16-bit pattern decodes exactly (NaN payload bits included); every rounding tie and
    neighbour, NaN payloads (signalling, negative), Inf, overflow and fp32 denormals encode to the
    bytes the reference gives."""
    f = FORMATS[fmt]
    with np.errstate(invalid="ignore", over="ignore"):
        vals = all16(f)
    msg = np.arange(1 << 16, dtype=np.uint16).view(np.uint8)
    dec = np.empty(1 << 16, np.float32)
    native.decode(msg, dec, f.code, 256)
    assert np.array_equal(f32bits(dec), f32bits(vals)), "decode of every 16-bit pattern"

    finite = np.unique(vals[np.isfinite(vals) & (vals >= 0)])
    edges = rounding_edges(finite)
    big = np.array([finite[-1], (np.float64(finite[-1]) * 1.0001), 65520.0, 65519.996, 3.4e38], np.float32)
    x = np.concatenate([edges, -edges, big, -big, from_bits(NAN_INPUTS), from_bits([0x7F800000, 0xFF800000]),
                        from_bits(rng.integers(0, 1 << 32, 5000, dtype=np.uint64).astype(np.uint32)),
                        from_bits([1, 0x80000001, 0x7FFFFF, 0x807FFFFF, 0x80000000])])
    rng.shuffle(x)
    local = from_bits(rng.integers(0, 1 << 32, x.size, dtype=np.uint64).astype(np.uint32))
    check_all(x, local, f, 256, f"{fmt} edges")
    # NaN + NaN in the fused hop (result: some NaN; payload not specified)
    m = from_bits(NAN_INPUTS * 2)
    l = from_bits(NAN_INPUTS[::-1] * 2)
    check_all(m, l, f, 256, f"{fmt} nan+nan")


def test_fp32_passthrough_bits(isa, rng):
    f = FORMATS["fp32"]
    x = from_bits(np.concatenate([rng.integers(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32),
                                  np.array(NAN_INPUTS, np.uint32)]))
    local = from_bits(np.concatenate([np.array(NAN_INPUTS[::-1], np.uint32),
                                      rng.integers(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32)]))
    check_all(x, local, f, 256, "fp32 random bits")
    # the message carries exact bits, NaN payloads included
    out = np.empty(4 * x.size, np.uint8)
    native.encode(x, out, f.code, 256)
    assert np.array_equal(out.view(np.uint32), f32bits(x))
    sum_out = np.empty(x.size, np.float32)
    native.decode_add_encode(out, local, out.copy(), sum_out, f.code, 256)
    with np.errstate(invalid="ignore", over="ignore"):
        want = x + local
    both = np.isnan(x) & np.isnan(local)
    assert np.array_equal(f32bits(sum_out)[~both], f32bits(want)[~both])
    # NaN + NaN: this implementation keeps the first operand's NaN (the message's), quieted
    assert np.array_equal(f32bits(sum_out)[both], f32bits(x)[both] | 0x400000)


# ---------------------------------------------------------------- random data, all sizes and blocks


def fp8_subnormal_heavy(rng, n: int, f: Format, block: int) -> np.ndarray:
    """Blocks whose amax is 1 and whose other values scale to FP8 subnormals (mostly)."""
    minnorm = 2.0**-6 if f.name == "e4m3" else 2.0**-14
    x = (rng.uniform(-1, 1, n) * minnorm / f.max_value).astype(np.float32)
    x[::block] = np.where(rng.random(x[::block].size) < 0.5, 1.0, -1.0)
    return x


def varied_magnitude(rng, n: int, block: int) -> np.ndarray:
    """Normal data with a different magnitude (10^-30 .. 10^30) in every block."""
    nb = max(num_blocks(n, block), 1)
    mag = np.repeat(10.0 ** rng.uniform(-30, 30, nb), block)[:n]
    return (rng.standard_normal(n) * mag).astype(np.float32)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("fmt", FMT_NAMES)
def test_random_all_functions(isa, fmt, n, block, rng):
    f = FORMATS[fmt]
    local = varied_magnitude(rng, n, block)
    check_all(varied_magnitude(rng, n, block), local, f, block, f"{fmt} varied n={n} block={block}")
    if f.scaled:
        x = fp8_subnormal_heavy(rng, n, f, block)
        if n >= 256 and block >= 32:
            msg = ref.encode(x, f, block)
            codes = msg[:n] & 0x7F
            sub = (codes < (8 if fmt == "e4m3" else 4)).mean()
            assert sub > 0.5, f"only {sub:.2f} of the codes are subnormal"
        check_all(x, fp8_subnormal_heavy(rng, n, f, block), f, block, f"{fmt} subnormal n={n} block={block}")
        # the fused hop's sum lands in the subnormal range too
        check_all(x, -x * np.float32(0.75), f, block, f"{fmt} cancel n={n} block={block}")


def test_aliasing_in_place_hop(isa, rng):
    """msg_in is msg_out and sum_out is local: the documented exact-aliasing case."""
    for fmt in FMT_NAMES:
        f = FORMATS[fmt]
        n, block = 4099, 32
        x = varied_magnitude(rng, n, block)
        local = varied_magnitude(rng, n, block)
        msg = ref.encode(x, f, block)
        want_msg, want_sum = ref_dae(msg, local, f, block)
        buf, loc = msg.copy(), local.copy()
        native.decode_add_encode(buf, loc, buf, loc, f.code, block)
        assert_same_bytes(buf, want_msg, f"{fmt} aliased msg")
        assert_same_f32(loc, want_sum, f"{fmt} aliased sum")


def test_unaligned_buffers(isa, rng):
    """Messages and float vectors at odd byte offsets inside larger buffers."""
    for fmt in FMT_NAMES:
        f = FORMATS[fmt]
        n, block = 1000, 7
        x = varied_magnitude(rng, n, block)
        want = ref.encode(x, f, block)
        raw = np.zeros(want.size + 1, np.uint8)
        out = raw[1:]
        native.encode(x, out, f.code, block)
        assert_same_bytes(out, want, f"{fmt} unaligned encode")
        fraw = np.zeros(4 * n + 4, np.uint8)
        dec = fraw[2 : 2 + 4 * n].view(np.float32)  # numpy allows unaligned views
        native.decode(out, dec, f.code, block)
        assert_same_f32(dec, ref.decode(want, n, f, block), f"{fmt} unaligned decode")


# ---------------------------------------------------------------- public API and fallback


@pytest.mark.parametrize("fmt", FMT_NAMES)
def test_public_api_uses_native_and_matches(fmt, rng, monkeypatch):
    monkeypatch.delenv("GIFTCOMM_NATIVE", raising=False)
    assert codec.native_available()
    f = FORMATS[fmt]
    n, block = 4099, 256
    x = varied_magnitude(rng, n, block).reshape(1, -1)  # any shape, read flat
    local = varied_magnitude(rng, n, block)
    msg = codec.encode(x, fmt, block)
    assert_same_bytes(msg, ref.encode(x.reshape(-1), f, block), "api encode")
    assert_same_f32(codec.decode(msg, n, fmt, block), ref.decode(msg, n, f, block), "api decode")
    sum_out = np.empty(n, np.float32)
    out = codec.decode_add_encode(msg, local, fmt, block, sum_out=sum_out)
    want_msg, want_sum = ref_dae(msg, local, f, block)
    assert_same_bytes(out, want_msg, "api decode_add_encode")
    assert_same_f32(sum_out, want_sum, "api sum_out")
    acc = local.copy()
    codec.decode_accumulate(msg, acc, fmt, block)
    assert_same_f32(acc, ref_acc(msg, local, f, block), "api decode_accumulate")
    # GIFTCOMM_NATIVE=0 forces the reference; same bytes, no warning (the extension exists)
    monkeypatch.setenv("GIFTCOMM_NATIVE", "0")
    assert not codec.native_available()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_same_bytes(codec.encode(x, fmt, block), msg, "GIFTCOMM_NATIVE=0 encode")
        assert_same_bytes(codec.decode_add_encode(msg, local, fmt, block), want_msg, "GIFTCOMM_NATIVE=0 dae")
    assert not [w for w in caught if "native codec" in str(w.message)]


# ---------------------------------------------------------------- argument checking


def test_bad_arguments_raise_value_error():
    f = FORMATS["e4m3"]
    x = np.ones(10, np.float32)
    msg = np.empty(message_nbytes(10, f, 4), np.uint8)
    native.encode(x, msg, 1, 4)
    with pytest.raises(ValueError, match="bytes"):
        native.encode(x, np.empty(msg.size + 1, np.uint8), 1, 4)
    with pytest.raises(ValueError, match="bytes"):
        native.decode(msg[:-1], np.empty(10, np.float32), 1, 4)
    with pytest.raises(ValueError, match="bytes"):
        native.decode(msg, np.empty(13, np.float32), 1, 4)  # 13 values: 32 bytes, not 24
    with pytest.raises(ValueError, match="bytes"):
        native.decode_add_encode(msg, np.ones(13, np.float32), msg.copy(), None, 1, 4)
    with pytest.raises(ValueError, match="bytes"):
        native.decode_add_encode(msg, x, np.empty(3, np.uint8), None, 1, 4)
    with pytest.raises(ValueError, match="sum_out"):
        native.decode_add_encode(msg, x, msg.copy(), np.empty(9, np.float32), 1, 4)
    with pytest.raises(ValueError, match="bytes"):
        native.decode_accumulate(msg, np.ones(13, np.float32), 1, 4)
    with pytest.raises(ValueError, match="not implemented by the native kernels"):
        native.encode(x, msg, max(FORMATS_BY_CODE) + 1, 4)  # a code no format has
    with pytest.raises(ValueError, match="fixed block of 32"):
        native.encode(x, msg, FORMATS["mxfp8_e5m2"].code, 4)
    with pytest.raises(ValueError, match="scale rule"):  # a scale rule on a format without E8M0 scales
        native.encode(x, msg, FORMATS["e4m3"].code | 1 << SCALE_RULE_SHIFT, 4)
    with pytest.raises(ValueError, match="block"):
        native.encode(x, msg, 1, 0)
    with pytest.raises(ValueError, match="block"):
        native.decode(msg, np.empty(10, np.float32), 1, (1 << 20) + 1)
    with pytest.raises(ValueError, match="float32"):
        native.encode(np.ones(10, np.float64), msg, 1, 4)
    with pytest.raises(ValueError, match="uint8"):
        native.encode(x, np.empty(msg.size // 4, np.float32), 1, 4)
    with pytest.raises((ValueError, BufferError, TypeError)):
        native.encode(x, bytes(msg.size), 1, 4)  # read-only output
    with pytest.raises((ValueError, BufferError)):
        native.decode(msg, np.empty(20, np.float32)[::2], 1, 4)  # not contiguous
    with pytest.raises(ValueError):
        native._set_isa("no-such-isa")


def test_gil_released_threads_agree(rng):
    """Several threads encoding at once give the same bytes as one thread."""
    from concurrent.futures import ThreadPoolExecutor

    f = FORMATS["e4m3"]
    xs = [varied_magnitude(rng, 1 << 16, 256) for _ in range(4)]
    want = [ref.encode(x, f, 256) for x in xs]

    def work(i):
        out = np.empty_like(want[i])
        for _ in range(20):
            native.encode(xs[i], out, f.code, 256)
        return out

    with ThreadPoolExecutor(4) as ex:
        for got, w in zip(ex.map(work, range(4)), want):
            assert_same_bytes(got, w, "threaded encode")


# ---------------------------------------------------------------- build properties


def test_no_fma_in_binary():
    """-ffp-contract=off must hold: no fused multiply-add instructions in the kernels."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.fail("objdump not found (binutils is needed to inspect the extension)")
    asm = subprocess.run([objdump, "-d", native.__file__], capture_output=True, text=True, check=True).stdout
    fma = [line for line in asm.splitlines() if "vfmadd" in line or "vfmsub" in line or "vfnmadd" in line]
    assert not fma, fma[:5]


def test_build_without_compiler_still_succeeds(tmp_path):
    """The extension is optional: with a failing compiler, setup.py build_ext succeeds without it."""
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    shutil.copytree(ROOT / "native", tmp_path / "native")
    env = dict(os.environ, CC="false", LDSHARED="false")
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", "lib", "--build-temp", "tmp"],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not list((tmp_path / "lib").rglob("_codec_native*")), "nothing should have been built"
    assert "building optional extension" in (r.stdout + r.stderr).lower() or "failed" in (r.stdout + r.stderr).lower()
