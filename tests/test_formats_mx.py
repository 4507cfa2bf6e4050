"""The microscaling and 4-bit wire formats (nvfp4, mxfp4, mxfp8, mxfp8_e5m2) and stochastic
rounding: the reference codec's rules (docs/wire-format.md) checked against ml_dtypes and against
independent re-statements, and the native C kernels against the reference bit for bit."""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from conftest import E8M0_FORMATS, FIXED_BLOCK_FORMATS, FORMAT_NAMES, FOUR_BIT_FORMATS, SCALED_FORMATS

from giftcomm import codec
from giftcomm.formats import FORMATS, SCALE_RULES, bytes_per_value, get_format, message_nbytes, num_blocks, resolve_block
from giftcomm.reference import codec as ref

NEW = FIXED_BLOCK_FORMATS
SCALED = SCALED_FORMATS
ROUNDINGS = ("nearest", "stochastic")
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)


def f32(v) -> np.ndarray:
    return np.array(v, dtype=np.float32)


def same_floats(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


def elem_codes(msg: np.ndarray, n: int, fmt: str) -> np.ndarray:
    f = get_format(fmt)
    payload, _ = ref.split_message(msg, n, f)
    if f.packed:
        return ref._unpack4(payload, n)
    return payload.view(np.uint8)


def edge_tables(fmt: str) -> dict[str, np.ndarray]:
    """Named edge vectors: every representable element value, ties, saturation, zeros, NaN/Inf."""
    f = get_format(fmt)
    t: dict[str, np.ndarray] = {}
    vals = np.arange(16 if f.packed else 256, dtype=np.uint8).view(f.wire_dtype).astype(np.float32)
    vals = vals[np.isfinite(vals)]
    pos = np.unique(vals[vals >= 0])
    t["all_codes"] = np.concatenate([vals, [f.max_value]]).astype(np.float32)
    mids = ((pos[:-1].astype(np.float64) + pos[1:]) / 2).astype(np.float32)
    t["ties"] = np.concatenate([mids, -mids, [f.max_value]]).astype(np.float32)
    t["near_ties"] = np.concatenate([np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e30)),
                                     [f.max_value]]).astype(np.float32)
    t["saturation"] = f32([f.max_value, f.max_value * 1.0001, -f.max_value * 1.3, 1.0, 7.5 * f.max_value])
    t["zeros"] = np.zeros(40, np.float32)
    t["neg_zeros"] = np.full(40, -0.0, np.float32)
    t["signed_zero"] = f32([-0.0, 0.0, -0.0, 1.0, -0.0])
    t["nan_block"] = f32([1.0, np.nan, 2.0, -3.0])
    t["inf_block"] = f32([1.0, np.inf, 2.0, -3.0])
    t["neg_inf_block"] = f32([-np.inf, 0.0, 5.0, 7.0])
    tiny = np.finfo(np.float32).smallest_subnormal
    t["f32_extremes"] = f32([np.finfo(np.float32).max, -np.finfo(np.float32).max, 1.0, tiny])
    t["f32_subnormals"] = f32([tiny, -tiny, tiny * 3, np.finfo(np.float32).tiny * 0.5])
    t["tiny_group"] = f32([2.0**-101, -2.0**-103, 0.0, -0.0, 2.0**-120])
    t["just_regular_group"] = f32([2.0**-100, -2.0**-110, 2.0**-130, -0.0])
    t["wide_dynamic_range"] = f32([3.0e4] + [1e-3] * 15 + [1e-9] * 16 + [-2e-20] * 16)
    t["huge"] = f32([3.0e38, -1.0e30, 2.0e20, 1.0])
    return t


# ------------------------------------------------------------------------- the format table
def test_blocks_and_sizes():
    assert resolve_block("nvfp4", None) == 16
    assert resolve_block("mxfp4", None) == 32 and resolve_block("mxfp8", None) == 32
    assert resolve_block("e4m3", None) == 256 and resolve_block("e4m3", 7) == 7
    for fmt, own in (("nvfp4", 16), ("mxfp4", 32), ("mxfp8", 32), ("mxfp8_e5m2", 32)):
        with pytest.raises(ValueError, match=f"fixed block of {own}"):
            resolve_block(fmt, 256)
        assert get_format(fmt).slice_unit(own) == (1024 if fmt == "nvfp4" else own)
    assert get_format("e4m3").slice_unit(256) == 256
    assert bytes_per_value("nvfp4") == 0.56640625
    assert bytes_per_value("mxfp4") == 0.53125
    assert bytes_per_value("mxfp8") == bytes_per_value("mxfp8_e5m2") == 1.03125
    # exact sizes: payload, block scales, (nvfp4) pad to 4 and one float32 per 1024 values
    assert message_nbytes(1024, "nvfp4") == 512 + 64 + 4
    assert message_nbytes(1025, "nvfp4") == 513 + 65 + 2 + 8
    assert message_nbytes(0, "nvfp4") == 0
    assert message_nbytes(33, "mxfp4") == 17 + 2
    assert message_nbytes(33, "mxfp8") == 33 + 2
    for n in (1, 2, 15, 16, 1000, 4096, 5000):
        for fmt in NEW:
            assert ref.encode(np.ones(n, np.float32), fmt).size == message_nbytes(n, fmt)
    assert len({f.code for f in FORMATS.values()}) == len(FORMATS)


def test_bad_rounding_raises():
    with pytest.raises(ValueError, match="stochastic rounding needs a block-scaled format"):
        ref.encode(np.ones(4, np.float32), "bf16", rounding="stochastic")
    with pytest.raises(ValueError, match="rounding must be one of"):
        ref.encode(np.ones(4, np.float32), "e4m3", rounding="up")
    with pytest.raises(ValueError, match="key"):
        ref.encode(np.ones(4, np.float32), "e4m3", rounding="stochastic", key=-1)


# ------------------------------------------------------------------------- Philox
def test_philox_known_answers():
    """Random123's kat_vectors for philox4x32_10."""
    def run(ctr, key):
        return [int(w[0]) for w in ref.philox4x32(tuple(np.array([c], np.uint64) for c in ctr), key)]

    assert run((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert run((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF)) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert run((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == [
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_philox_bits_use_the_64_bit_index_and_key():
    key, off = 0x0123456789ABCDEF, (1 << 32) - 3
    bits = ref.philox_bits(key, off, 6)
    for i in range(6):
        idx = off + i
        want = ref.philox4x32(tuple(np.array([w], np.uint64) for w in (idx & 0xFFFFFFFF, idx >> 32, 0, 0)),
                              (key & 0xFFFFFFFF, key >> 32))[0][0]
        assert bits[i] == want
    assert np.array_equal(ref.philox_bits(key, off + 2, 4), bits[2:])


# ------------------------------------------------------------------------- element conversions
@pytest.mark.parametrize("dt", [E2M1, E4M3, np.dtype(ml_dtypes.float8_e5m2)])
def test_integer_rounding_equals_ml_dtypes_cast(dt, rng):
    """The integer nearest-even rounding the C/CUDA kernels use equals ml_dtypes' cast on every
    representable value, every tie and its neighbours, and random float32 bit patterns in range."""
    mx = float(ml_dtypes.finfo(dt).max)
    vals = np.arange(16 if dt == E2M1 else 256, dtype=np.uint8).view(dt).astype(np.float32)
    pos = np.unique(vals[np.isfinite(vals) & (vals >= 0)])
    mids = ((pos[:-1].astype(np.float64) + pos[1:]) / 2).astype(np.float32)
    hi = int(np.float32(mx).view(np.uint32))
    y = np.concatenate([pos, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e30)),
                        rng.integers(0, hi + 1, 200_000).astype(np.uint32).view(np.float32),
                        np.arange(0, hi + 1, 1 << 15, dtype=np.uint32).view(np.float32)]).astype(np.float32)
    y = np.concatenate([y, -y])
    want = y.astype(dt).view(np.uint8) & np.uint8(0xF if dt == E2M1 else 0xFF)
    np.testing.assert_array_equal(ref.round_elements(y, dt), want)


@pytest.mark.parametrize("dt", [E2M1, E4M3, np.dtype(ml_dtypes.float8_e5m2)])
def test_stochastic_rounding_picks_a_neighbour_with_the_right_probability(dt, rng):
    vals = np.arange(16 if dt == E2M1 else 256, dtype=np.uint8).view(dt).astype(np.float32)
    grid = np.unique(vals[np.isfinite(vals)])
    y = rng.uniform(-grid[-1], grid[-1], 50_000).astype(np.float32)
    y = np.concatenate([y, grid, f32([-0.0, 0.0])])
    r = rng.integers(0, 1 << 32, y.size, dtype=np.uint64).astype(np.uint32)
    got = ref.round_elements(y, dt, r).view(dt) if dt != E2M1 else ref.round_elements(y, dt, r).view(E2M1)
    got = got.astype(np.float32)
    lo = grid[np.searchsorted(grid, y, side="right") - 1]
    up = grid[np.minimum(np.searchsorted(grid, y, side="left"), grid.size - 1)]
    assert np.all((got == lo) | (got == up))
    exact = np.isin(y, grid)
    assert np.array_equal(got[exact], y[exact])
    # zero never moves and keeps its sign
    z = ref.round_elements(f32([-0.0, 0.0]), dt, np.array([0xFFFFFFFF, 0xFFFFFFFF], np.uint32))
    assert z[0] == (0x8 if dt == E2M1 else 0x80) and z[1] == 0
    # the rule: up iff floor(frac * 2^32) + R >= 2^32; check it exactly for R = 0 and R = max
    assert np.array_equal(ref.round_elements(y, dt, np.zeros(y.size, np.uint32)),
                          ref.round_elements(np.where(exact, y, y), dt, np.zeros(y.size, np.uint32)))
    never = ref.round_elements(y, dt, np.zeros(y.size, np.uint32)).astype(np.int64)
    always = ref.round_elements(y, dt, np.full(y.size, 0xFFFFFFFF, np.uint32)).astype(np.int64)
    sign = 0x8 if dt == E2M1 else 0x80
    assert np.all(np.where(exact, always == never, (always & ~sign) - (never & ~sign) <= 1))


# ------------------------------------------------------------------------- scale rules
def mx_expected(x: np.ndarray, fmt: str, rule: str = "ceil") -> tuple[np.ndarray, np.ndarray]:
    """The MX scale rules re-stated with float64 log2 per block: (scale codes, element codes).
    floor: OCP MX v1.0, s = floor(log2(amax)) - emax; ceil: s = ceil(log2(amax / max)), the
    smallest power of two keeping amax / 2^s <= max; both clamped below at -127."""
    f = get_format(fmt)
    nb = num_blocks(x.size, 32)
    scodes = np.zeros(nb, np.uint8)
    ecodes = np.zeros(x.size, np.uint8)
    for b in range(nb):
        blk = x[32 * b : 32 * b + 32]
        if not np.all(np.isfinite(blk)):
            scodes[b] = 0xFF
            ecodes[32 * b : 32 * b + blk.size] = f.nan_code
            continue
        amax = float(np.max(np.abs(blk)))
        if amax == 0:
            s = -127
        elif rule == "floor":
            s = max(int(np.floor(np.log2(amax))) - f.emax, -127)
        else:  # in the top float32 binade, the floor exponent (a larger scale could decode to Inf)
            s = max(int(np.ceil(np.log2(amax / f.max_value))), -127)
            if amax >= 2.0**127:
                s = min(s, int(np.floor(np.log2(amax))) - f.emax)
        scodes[b] = np.float32(2.0**s).astype(E8M0).view(np.uint8)
        y = np.clip((blk.astype(np.float64) * 2.0**-s).astype(np.float32), -f.max_value, f.max_value)
        ecodes[32 * b : 32 * b + blk.size] = y.astype(f.wire_dtype).view(np.uint8) & (0xF if f.packed else 0xFF)
    return scodes, ecodes


@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.parametrize("fmt", E8M0_FORMATS)
def test_mx_scales_and_elements_follow_the_scale_rule(fmt, rule, rng):
    f = get_format(fmt).with_scale_rule(rule)
    x = (rng.standard_normal(32 * 48) * np.exp2(rng.uniform(-30, 30, 32 * 48))).astype(np.float32)
    x[5] = np.nan
    x[32 * 7 + 3] = -np.inf
    x[32 * 9 : 32 * 10] = 0.0
    x[32 * 11 : 32 * 12] = np.finfo(np.float32).smallest_subnormal * 3
    x[32 * 12 : 32 * 13] *= np.float32(2.0**-120)
    x[32 * 13 : 32 * 14] = np.float32(3e38)
    # the rules' edges: amax exactly max * 2^k (ceil: lands on max), one ulp above, a power of two,
    # just below the next power of two, the largest float32, the bottom of the E8M0 range
    edges = [f.max_value * 2.0**5, np.nextafter(np.float32(f.max_value * 2.0**5), np.float32(np.inf)), 2.0**7,
             np.nextafter(np.float32(2.0**8), np.float32(0)), np.finfo(np.float32).max, f.max_value * 2.0**-127,
             np.nextafter(np.float32(f.max_value * 2.0**-127), np.float32(1)), 2.0**-126]
    for j, amax in enumerate(edges):
        blk = x[32 * (14 + j) : 32 * (15 + j)]
        blk *= np.float32(amax) / np.float32(np.max(np.abs(blk))) / 2
        blk[j] = np.float32(amax) * (-1) ** j
    for n in (x.size, x.size - 7):
        msg = ref.encode(x[:n], f)
        _, scales = ref.split_message(msg, n, f)
        s_want, e_want = mx_expected(x[:n], fmt, rule)
        np.testing.assert_array_equal(scales, s_want)
        np.testing.assert_array_equal(elem_codes(msg, n, fmt), e_want)
        y = ref.decode(msg, n, fmt)
        bad = np.repeat(s_want == 0xFF, 32)[:n]
        assert np.all(np.isnan(y[bad])) and np.all(np.isfinite(y[~bad]))
        # decode is exact: element value times 2^s
        vals = elem_codes(msg, n, fmt).view(get_format(fmt).wire_dtype).astype(np.float64)
        sc = np.repeat(s_want.view(E8M0).astype(np.float64), 32)[:n]
        np.testing.assert_array_equal(y[~bad], (vals * sc)[~bad].astype(np.float32))


def test_nvfp4_two_level_scales(rng):
    n = 3000
    x = (rng.standard_normal(n) * np.exp2(rng.uniform(-12, 12, n))).astype(np.float32)
    x[40] = np.nan
    x[1030] = np.inf
    x[2048:2048 + 1024] = 0
    x[2048 + 100] = 2.0**-101  # a tiny group
    msg = ref.encode(x, "nvfp4")
    _, bs = ref.split_message(msg, n, get_format("nvfp4"))
    s2 = ref.group_scales(msg, n)
    assert s2.size == 3 and bs.size == num_blocks(n, 16)
    for g in range(3):
        part = x[g * 1024 : (g + 1) * 1024]
        fin = np.concatenate([np.abs(part[b:b + 16]) for b in range(0, part.size, 16)
                              if np.all(np.isfinite(part[b:b + 16]))])
        gmax = np.float32(fin.max())
        if gmax < 2.0**-100:
            assert s2[g] == 1 and np.all(bs[g * 64 : (g + 1) * 64] == 0)
            continue
        assert s2[g] == np.float32(gmax / np.float32(2688))
        blocks = bs[g * 64 : (g + 1) * 64]
        assert blocks[blocks != 0x7F].max() == 0x7E  # the largest block scale maps to 448
    # one NaN and one Inf poison exactly their blocks
    y = ref.decode(msg, n, "nvfp4")
    nan_at = np.flatnonzero(np.isnan(y))
    assert np.array_equal(nan_at, np.r_[32:48, 1024:1040])
    assert np.all(bs[[2, 64]] == 0x7F)
    # the tiny group decodes to signed zeros
    assert np.all(y[2048:] == 0)


def test_nvfp4_group_bytes_do_not_depend_on_slicing(rng):
    """Messages cut at multiples of 1024 values carry the same bytes as the whole message's
    corresponding parts (what the ring relies on)."""
    x = (rng.standard_normal(5000) * np.exp2(rng.uniform(-8, 8, 5000))).astype(np.float32)
    whole = ref.decode(ref.encode(x, "nvfp4", rounding="stochastic", key=9), x.size, "nvfp4")
    parts = [ref.decode(ref.encode(x[a:a + 2048], "nvfp4", rounding="stochastic", key=9, offset=a),
                        min(2048, x.size - a), "nvfp4") for a in range(0, x.size, 2048)]
    assert same_floats(np.concatenate(parts), whole)


@pytest.mark.parametrize("fmt", SCALED)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_edge_tables_decode_sanely(fmt, rounding):
    f = get_format(fmt)
    for name, v in edge_tables(fmt).items():
        msg = ref.encode(v, fmt, rounding=rounding, key=3)
        y = ref.decode(msg, v.size, fmt)
        b = resolve_block(f, None) if f.fixed_block else 256
        bad = np.zeros(v.size, bool)
        for s in range(0, v.size, b):
            bad[s:s + b] = not np.all(np.isfinite(v[s:s + b]))
        assert np.all(np.isnan(y[bad])), name
        assert np.all(np.isfinite(y[~bad])), name
        # signs survive (zeros included) wherever the value is not flushed; an adaptive row's
        # 2-bit tier has no zero (levels -3, -1, 1, 3 times its scale), and its unbiased
        # stochastic rounding sends a value below the inner level to -1 or +1: there (and only
        # there: |decoded| above |value|) the sign may flip
        crossing = (f.adaptive is not None and rounding == "stochastic") & (np.abs(y) > np.abs(v))
        keep = ~bad & (y != 0) & ~crossing
        assert np.all(np.signbit(y[keep]) == np.signbit(v[keep])), name
        zero_in = ~bad & (v == 0) & ~crossing
        assert np.all(np.signbit(y[zero_in]) == np.signbit(v[zero_in])), name
        if name == "all_codes" and f.scale_kind == "e8m0" and rounding == "nearest":
            # blocks holding the max have scale 2^0: their representable values survive exactly
            assert same_floats(y[-1:], v[-1:]) and (v.size > 32 or same_floats(y, v)), name


# ------------------------------------------------------------------------- unbiasedness
#: every scaled format at every scale rule it has
VARIANTS = [get_format(f).with_scale_rule(r) for f in SCALED
            for r in (SCALE_RULES if get_format(f).scale_kind == "e8m0" else SCALE_RULES[:1])]


def _variant_id(f) -> str:
    return f.name + (f"-{f.scale_rule}" if f.scale_rule else "")


def clamp_data(rng, n: int = 512) -> np.ndarray:
    """Components spread over three binades below each 32-value block's largest one, which has
    the mantissa 1.9 (above E4M3/E5M2's 1.75 and E2M1's 1.5): exactly the blocks whose top values
    OCP's floor rule clamps to the element max."""
    x = np.empty(n, np.float32)
    for b in range(0, n, 32):
        amax = 1.9 * 2.0 ** int(rng.integers(-4, 5))
        v = rng.standard_normal(32) * np.exp2(rng.uniform(-3, 0, 32))
        v *= 0.95 * amax / np.abs(v).max()
        v[rng.integers(32)] = amax * rng.choice([-1, 1])
        x[b:b + 32] = v
    return x


def stochastic_mean_error(f, x, K, monkeypatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(|mean of K stochastic quantizations - x|, its bound, the two rounding neighbours' gap
    step, nearest's |error|) per element. The mean of K roundings between lo and lo + step (mean
    y, variance <= step^2 / 4) has standard deviation <= step / (2 sqrt K); the bound is 6 sigma
    plus the deterministic part (the 2^-32-of-a-step truncation of the probability and the
    float32 roundings of x * r and code * d: a few ulp of x). A clamped element has step 0 and an
    error of its distance to max: far above the bound."""
    n = x.size
    dec = np.stack([ref.decode(ref.encode(x, f, rounding="stochastic", key=k), n, f) for k in range(K)])
    ends = []
    for bits in (0, 0xFFFFFFFF):  # random bits all 0 (never up) and all 1 (always up)
        monkeypatch.setattr(ref, "philox_bits", lambda key, off, m, b=bits: np.full(m, b, np.uint32))
        ends.append(ref.decode(ref.encode(x, f, rounding="stochastic"), n, f).astype(np.float64))
    monkeypatch.undo()
    assert np.all((dec == ends[0]) | (dec == ends[1]))
    step = np.abs(ends[1] - ends[0])
    err = np.abs(dec.astype(np.float64).mean(axis=0) - x)
    near = np.abs(ref.decode(ref.encode(x, f), n, f) - x)
    return err, 3 * step / np.sqrt(K) + 2.0**-20 * np.abs(x) + 1e-30, step, near


@pytest.mark.parametrize("f", VARIANTS, ids=_variant_id)
def test_stochastic_rounding_is_unbiased(f, rng, monkeypatch):
    """The mean of K stochastic quantizations (keys 0..K-1) of a fixed vector converges to it,
    element by element, on data built to hit the MX clamp. Holds for every format whose scales
    never clamp (e4m3, e5m2, nvfp4, the MX formats with mx_scale="ceil"); OCP's "floor" rule
    clamps the top of every block here, and the same bound catches it."""
    x = clamp_data(rng)
    err, tol, step, near = stochastic_mean_error(f, x, 400, monkeypatch)
    if f.scale_rule == "floor":
        clamped = (step == 0) & (err > tol)
        assert clamped.sum() >= x.size // 32, "the bound must catch the floor rule's clamp"
        return
    assert np.all(err <= tol), np.max(err - tol)
    # nearest is biased where the spacing is coarse; stochastic's total bias is far below it
    moving = step > 0
    assert err[moving].mean() < 0.25 * near[moving].mean()


@pytest.mark.parametrize("algorithm", ["direct", "ring"])
def test_mean_of_stochastic_allreduces_converges_without_clamp(algorithm, rng):
    """The check as a user runs it: the mean of 64 stochastic allreduces (P = 3,
    loopback) of fixed Gaussian vectors. Unbiased rounding leaves ~1/sqrt(64) of the noise of one
    call; measured relative L2 error of the mean / one nearest call: ~0.18 for every format
    with non-clamping scales, 0.27-0.55 for the MX formats with mx_scale="floor"."""
    import giftcomm as gc

    p, n, calls = 3, 4096, 64
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)

    def rel(y):
        return np.linalg.norm(y - exact) / np.linalg.norm(exact)

    for f in VARIANTS:
        def run(**kw):
            return gc.LoopbackGroup(p).run(lambda t: gc.allreduce(xs[t.rank], comm=t, fmt=f, algorithm=algorithm,
                                                                  **kw))[0]
        mean = np.mean([run(rounding="stochastic", seed=s) for s in range(calls)], axis=0)
        ratio = rel(mean) / rel(run())
        # measured over seeds: 0.17-0.19 unclamped; floor 0.27-0.55 (mxfp8_e5m2 on the ring lowest)
        if f.scale_rule == "floor":
            assert ratio > 0.235, (_variant_id(f), ratio)
        else:
            assert ratio < 0.235, (_variant_id(f), ratio)


def test_nearest_is_biased_for_small_components_stochastic_is_not():
    """A block of one large value and many components below half a step: nearest rounds them all
    to zero (mean error = their size), stochastic's mean recovers them."""
    for fmt in FOUR_BIT_FORMATS:
        x = np.full(32, 0.05, np.float32)
        x[0] = x[16] = 6.0  # every block: step at 0.05 is 0.5 (E2M1 subnormal spacing, scale 1)
        near = ref.decode(ref.encode(x, fmt), 32, fmt)
        assert np.all(near[x < 1] == 0)
        K = 2000
        mean = np.mean([ref.decode(ref.encode(x, fmt, rounding="stochastic", key=k), 32, fmt) for k in range(K)],
                       axis=0)
        # step 0.5 (times d/6 scale for nvfp4: <= 0.5): sigma of the mean <= 0.25 / sqrt(K)
        assert np.all(np.abs(mean[x < 1] - 0.05) <= 6 * 0.25 / np.sqrt(K))


def test_stochastic_rounding_is_reproducible_and_offset_shifts_the_stream(rng):
    x = rng.standard_normal(3000).astype(np.float32)
    for name in SCALED:
        fmt = get_format(name)
        if fmt.adaptive is not None:  # frames of 2 super-blocks: the vector spans several frames
            fmt = dataclasses.replace(fmt, adaptive=dataclasses.replace(fmt.adaptive, frame=2))
        a = ref.encode(x, fmt, rounding="stochastic", key=11)
        assert np.array_equal(a, ref.encode(x, fmt, rounding="stochastic", key=11))
        assert not np.array_equal(a, ref.encode(x, fmt, rounding="stochastic", key=12))
        unit = fmt.slice_unit(resolve_block(fmt, None))
        cut = 2 * unit if unit <= 1024 else unit
        assert cut < x.size, (name, cut)
        tail = ref.encode(x[cut:], fmt, rounding="stochastic", key=11, offset=cut)
        assert same_floats(ref.decode(tail, x.size - cut, fmt), ref.decode(a, x.size, fmt)[cut:])


# ------------------------------------------------------------------------- native C kernels
native_only = pytest.mark.skipif(not codec.native_variants(), reason="native codec extension not built")
LENGTHS = (0, 1, 2, 15, 16, 17, 31, 33, 1023, 1024, 1025, 2048 + 7, 5000)


def _check_native(x: np.ndarray, fmt: str, rounding: str, local: np.ndarray, what: str) -> None:
    n = x.size
    f = get_format(fmt)
    block = resolve_block(f, None)
    kw = dict(rounding=rounding, key=0xDEADBEEF12345678, offset=(1 << 32) - 5)
    key = kw["key"] if rounding == "stochastic" else None
    want = ref.encode(x, fmt, **kw)
    got = np.full(want.size, 0xAA, np.uint8)  # pads must be written
    codec.NativeKernels.encode(x, f, block, got, key, kw["offset"])
    assert np.array_equal(got, want), f"encode {what}: bytes {np.flatnonzero(got != want)[:8]}"
    dec = np.empty(n, np.float32)
    codec.NativeKernels.decode(want, n, f, block, dec)
    assert same_floats(dec, ref.decode(want, n, fmt)), f"decode {what}"
    acc = local.copy()
    codec.NativeKernels.decode_accumulate(want, acc, f, block)
    with np.errstate(invalid="ignore", over="ignore"):
        assert same_floats(acc, local + ref.decode(want, n, fmt)), f"accumulate {what}"
    s = np.empty(n, np.float32)
    out = np.full(want.size, 0x55, np.uint8)
    codec.NativeKernels.decode_add_encode(want, local, f, block, out, s, key, kw["offset"])
    with np.errstate(invalid="ignore", over="ignore"):
        total = ref.decode(want, n, fmt) + local
    assert same_floats(s, total), f"sum {what}"
    assert np.array_equal(out, ref.decode_add_encode(want, local, fmt, **kw)), f"decode_add_encode {what}"
    inplace = want.copy()  # msg_in is msg_out: allowed
    codec.NativeKernels.decode_add_encode(inplace, local, f, block, inplace, None, key, kw["offset"])
    assert np.array_equal(inplace, out), f"in place {what}"


@native_only
@pytest.mark.parametrize("fmt", SCALED)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_native_equals_reference_edge_tables(fmt, rounding, rng):
    for isa in codec.native_variants():
        codec.use_native_variant(isa)
        try:
            for name, v in edge_tables(fmt).items():
                local = rng.standard_normal(v.size).astype(np.float32)
                _check_native(v, fmt, rounding, local, f"{isa} {name}")
        finally:
            codec.use_native_variant(codec.native_variants()[0])


@native_only
@pytest.mark.parametrize("fmt", SCALED)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_native_equals_reference_random(fmt, rounding, rng):
    for isa in codec.native_variants():
        codec.use_native_variant(isa)
        try:
            for n in LENGTHS:
                x = (rng.standard_normal(n) * np.exp2(rng.uniform(-25, 25, n))).astype(np.float32)
                x[rng.random(n) < 0.01] = 0
                if n > 40:
                    x[rng.integers(0, n, 2)] = [np.nan, -np.inf]
                    x[n // 3 : n // 3 + 40] *= np.float32(2.0**-110)  # tiny blocks (and groups)
                local = (rng.standard_normal(n) * 3).astype(np.float32)
                _check_native(x, fmt, rounding, local, f"{isa} n={n}")
        finally:
            codec.use_native_variant(codec.native_variants()[0])


@native_only
def test_native_rejects_bad_blocks_and_rounding():
    from giftcomm import _codec_native as nat

    x = np.ones(64, np.float32)
    out = np.empty(message_nbytes(64, "nvfp4"), np.uint8)
    with pytest.raises(ValueError, match="fixed block of 16"):
        nat.encode(x, out, get_format("nvfp4").code, 32)
    with pytest.raises(ValueError, match="stochastic rounding needs a block-scaled format"):
        nat.encode(x, np.empty(128, np.uint8), get_format("bf16").code, 256, 1, 0)
    with pytest.raises(ValueError, match="key"):
        nat.encode(x, out, get_format("nvfp4").code, 16, -1, 0)


def test_public_codec_arguments():
    x = np.linspace(-1, 1, 100).astype(np.float32)
    with pytest.raises(ValueError, match="fixed block of 32"):
        codec.encode(x, "mxfp4", block=256)
    with pytest.raises(ValueError, match="stochastic rounding needs a block-scaled format"):
        codec.encode(x, "bf16", rounding="stochastic")
    with pytest.raises(ValueError, match="stochastic rounding needs a block-scaled format"):
        codec.decode_add_encode(codec.encode(x, "fp16"), x, "fp16", rounding="stochastic")
    with pytest.raises(ValueError, match="offset"):
        codec.encode(x, "e4m3", rounding="stochastic", offset=-1)
    for fmt in NEW:
        m = codec.encode(x, fmt, rounding="stochastic", key=3, offset=10)
        assert np.array_equal(m, ref.encode(x, fmt, rounding="stochastic", key=3, offset=10))
        assert m.size == message_nbytes(100, fmt) == message_nbytes(100, fmt, resolve_block(fmt, None))
        assert same_floats(codec.decode(m, 100, fmt), ref.decode(m, 100, fmt))


def test_ranks_that_disagree_on_the_scale_rule_all_raise(rng):
    from conftest import assert_same_error, outcomes

    x = rng.standard_normal(100).astype(np.float32)
    rules = ("ceil", "floor", "ceil")
    got = outcomes(3, lambda t: codec_allreduce(x, t, get_format("mxfp8").with_scale_rule(rules[t.rank])))
    assert_same_error(got, ValueError, "ranks disagree on fmt", "mxfp8 (mx_scale='floor')")


def codec_allreduce(x, t, f):
    import giftcomm as gc

    return gc.allreduce(x, comm=t, fmt=f)


def test_mx_scale_keyword_of_the_collectives(rng):
    """mx_scale= reaches the wire (floor and ceil give the reference's bytes of their rule), ranks
    passing different rules all raise, and a rule on a format without E8M0 scales raises the
    same ValueError on every rank, also when only one rank asks for it."""
    from conftest import assert_same_error, outcomes

    import giftcomm as gc
    from giftcomm.reference import simulate_allreduce

    xs = [(rng.standard_normal(1000) * 3).astype(np.float32) for _ in range(2)]
    for rule in SCALE_RULES:
        f = get_format("mxfp4").with_scale_rule(rule)
        got = gc.LoopbackGroup(2).run(lambda t: gc.allreduce(xs[t.rank], comm=t, fmt="mxfp4", mx_scale=rule,
                                                             algorithm="ring"))
        want = simulate_allreduce(xs, fmt=f, algorithm="ring")
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want)), rule
        shard = gc.LoopbackGroup(2).run(lambda t: gc.reduce_scatter(xs[t.rank], comm=t, fmt="mxfp8", mx_scale=rule))
        assert all(np.all(np.isfinite(s)) for s in shard)
    got = outcomes(2, lambda t: gc.allreduce(xs[t.rank], comm=t, fmt="mxfp8", mx_scale=("ceil", "floor")[t.rank]))
    assert_same_error(got, ValueError, "ranks disagree on fmt", "mx_scale='floor'")
    got = outcomes(2, lambda t: gc.allreduce(xs[t.rank], comm=t, fmt="e4m3", mx_scale=("floor", "ceil")[t.rank]))
    assert all(isinstance(e, ValueError) and "E8M0" in str(e) for e in got), got
    got = outcomes(2, lambda t: gc.allgather(xs[t.rank], comm=t, fmt="nvfp4", mx_scale="floor"))
    assert_same_error(got, ValueError, "mx_scale='floor' applies to the formats with E8M0 scales")


def test_scale_rule_option():
    from giftcomm.options import CallOptions

    assert CallOptions().mx_scale == "ceil"
    o = CallOptions.of(fmt="mxfp4", mx_scale="floor")
    assert o.format == get_format("mxfp4").with_scale_rule("floor") and o.format.variant_code != o.format.code
    assert CallOptions.of(fmt="mxfp8").format is get_format("mxfp8")
    assert CallOptions.of(fmt="nvfp4", mx_scale="ceil").format is get_format("nvfp4")  # the default: no effect
    # a Format variant given as fmt carries its rule into the record
    assert CallOptions.of(fmt=get_format("mxfp8").with_scale_rule("floor")).mx_scale == "floor"
    for fmt in (f for f in FORMAT_NAMES if f not in E8M0_FORMATS):
        with pytest.raises(ValueError, match=f"GiftState: mx_scale='floor' applies to the formats with E8M0 scales.*{fmt}"):
            CallOptions.of("GiftState", fmt=fmt, mx_scale="floor")
    with pytest.raises(ValueError, match="mx_scale must be one of 'ceil', 'floor'"):
        CallOptions.of(fmt="mxfp8", mx_scale="round")
    # the two rules give different bytes where a block's amax mantissa exceeds the element max's
    x = np.full(32, 1.9, np.float32)
    assert not np.array_equal(codec.encode(x, o.format), codec.encode(x, "mxfp4"))


@pytest.mark.mpi
def test_mx_scale_rules_over_mpi_and_plans():
    """Both rules under mpiexec: plain allreduce and a persistent plan (the one-shot plan takes
    the node-shared channel's native path, which encodes with the variant code) equal the
    simulation of their rule."""
    from mpi4py import MPI

    import giftcomm as gc
    from giftcomm.reference import simulate_allreduce

    comm = MPI.COMM_WORLD
    gen = np.random.default_rng(77)
    xs = [(gen.standard_normal(3000) * 5).astype(np.float32) for _ in range(comm.size)]
    for rule in SCALE_RULES:
        f = get_format("mxfp8").with_scale_rule(rule)
        for algorithm in ("ring", "oneshot"):
            want = simulate_allreduce(xs, fmt=f, algorithm=algorithm)[comm.rank]
            got = gc.allreduce(xs[comm.rank], comm=comm, fmt="mxfp8", mx_scale=rule, algorithm=algorithm)
            assert got.tobytes() == want.tobytes(), (rule, algorithm)
            plan = gc.plan_allreduce(xs[comm.rank], comm=comm, fmt="mxfp8", mx_scale=rule, algorithm=algorithm)
            for _ in range(2):
                assert plan(xs[comm.rank]).tobytes() == want.tobytes(), (rule, algorithm, "plan")
