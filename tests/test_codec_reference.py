"""The NumPy reference codec against its definition: ml_dtypes casts of the scaled values."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import ANY_BLOCK_FORMATS, PASS_THROUGH_FORMATS, UNKNOWN_FORMAT

from giftcomm.formats import FORMATS, bytes_per_value, get_format, message_nbytes, num_blocks, scales_offset
from giftcomm.reference import codec as ref

FP8 = ANY_BLOCK_FORMATS  # the FP8 formats with float32 block scales
ALL = list(FORMATS)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def scales_of(msg: np.ndarray, n: int, fmt: str) -> np.ndarray:
    return msg[scales_offset(n, get_format(fmt)):].view(np.float32)


def codes_of(msg: np.ndarray, n: int) -> np.ndarray:
    return msg[:n]


@pytest.mark.parametrize("fmt", FP8)
def test_named_edge_values_round_trip_exactly_with_unit_scale(fmt):
    """A block whose amax is the format's max has scale exactly 1, so representable values survive."""
    f = get_format(fmt)
    fi = ml_dtypes.finfo(f.wire_dtype)
    table = {
        "max": float(fi.max),
        "-max": -float(fi.max),
        "min normal": float(fi.smallest_normal),
        "smallest subnormal": float(fi.smallest_subnormal),
        "largest subnormal": float(fi.smallest_normal) - float(fi.smallest_subnormal),
        "one": 1.0,
        "negative zero": -0.0,
        "zero": 0.0,
    }
    x = np.array(list(table.values()), np.float32)
    msg = ref.encode(x, fmt, block=len(x))
    assert scales_of(msg, len(x), fmt)[0] == 1.0
    y = ref.decode(msg, len(x), fmt, block=len(x))
    for (name, v), got in zip(table.items(), y):
        assert bits(np.float32(v)) == bits(got), name


@pytest.mark.parametrize("fmt", FP8)
def test_ties_round_to_even_and_saturate(fmt):
    f = get_format(fmt)
    fi = ml_dtypes.finfo(f.wire_dtype)
    sub = float(fi.smallest_subnormal)
    one_ulp = float(fi.eps)  # spacing just above 1.0
    fmax = float(fi.max)
    x = np.array([fmax, 1 + one_ulp / 2, 1 + 1.5 * one_ulp, sub / 2, 1.5 * sub, -(1 + one_ulp / 2)], np.float32)
    want = [fmax, 1.0, 1 + 2 * one_ulp, 0.0, 2 * sub, -1.0]
    y = ref.decode(ref.encode(x, fmt, block=8), len(x), fmt, block=8)
    np.testing.assert_array_equal(y, np.array(want, np.float32))
    # saturation: after scaling, values are clipped to +-max (never NaN, never Inf)
    big = np.array([fmax, 3 * fmax, -5 * fmax], np.float32)
    msg = ref.encode(big, fmt, block=1)
    assert np.all(np.isfinite(ref.decode(msg, 3, fmt, block=1)))


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("n", [1, 3, 255, 256, 257, 1000])
@pytest.mark.parametrize("block", [1, 7, 32, 256])
def test_codes_equal_ml_dtypes_cast_of_scaled_values(rng, fmt, n, block):
    f = get_format(fmt)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-20, 20, n))).astype(np.float32)
    msg = ref.encode(x, fmt, block)
    assert msg.size == message_nbytes(n, fmt, block)
    scales = scales_of(msg, n, fmt)
    assert scales.size == num_blocks(n, block)
    for b in range(scales.size):
        part = x[b * block : (b + 1) * block]
        amax = np.max(np.abs(part))
        assert scales[b] == np.float32(amax) / np.float32(f.max_value)
        inv = np.float32(f.max_value) / np.float32(amax)
        want = np.clip(part * inv, -f.max_value, f.max_value).astype(f.wire_dtype).view(np.uint8)
        np.testing.assert_array_equal(codes_of(msg, n)[b * block : b * block + part.size], want)


@pytest.mark.parametrize("fmt", FP8)
def test_decoded_error_is_bounded_by_half_a_code_step(rng, fmt):
    f = get_format(fmt)
    fi = ml_dtypes.finfo(f.wire_dtype)
    x = rng.standard_normal(4096).astype(np.float32)
    y = ref.decode(ref.encode(x, fmt, 256), 4096, fmt, 256)
    amax = np.abs(x).reshape(-1, 256).max(axis=1, keepdims=True)
    scale = amax / f.max_value
    # relative half-ulp for normals, absolute half-subnormal-step for the rest (plus fp32 slack)
    bound = np.maximum(np.abs(x.reshape(-1, 256)) * float(fi.eps) / 2, scale * float(fi.smallest_subnormal) / 2)
    assert np.all(np.abs(y.reshape(-1, 256) - x.reshape(-1, 256)) <= bound * 1.0001 + 1e-30)


def test_all_zero_block_has_scale_one_and_keeps_signed_zeros():
    x = np.array([0.0, -0.0, 0.0, -0.0], np.float32)
    msg = ref.encode(x, "e4m3", 4)
    assert scales_of(msg, 4, "e4m3")[0] == 1.0
    np.testing.assert_array_equal(bits(ref.decode(msg, 4, "e4m3", 4)), bits(x))


def test_tiny_amax_block_flushes_to_signed_zero():
    f = get_format("e4m3")
    x = np.array([f.tiny_amax / 2, -f.tiny_amax / 4], np.float32)
    msg = ref.encode(x, "e4m3", 2)
    assert scales_of(msg, 2, "e4m3")[0] == 1.0
    np.testing.assert_array_equal(bits(ref.decode(msg, 2, "e4m3", 2)), bits(np.array([0.0, -0.0], np.float32)))


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_value_poisons_exactly_its_block(rng, fmt, bad):
    x = rng.standard_normal(40).astype(np.float32)
    x[13] = bad
    y = ref.decode(ref.encode(x, fmt, 8), 40, fmt, 8)
    assert np.all(np.isnan(y[8:16]))
    assert np.all(np.isfinite(y[:8])) and np.all(np.isfinite(y[16:]))


@pytest.mark.parametrize("fmt", PASS_THROUGH_FORMATS)
def test_pass_through_formats_are_plain_casts(rng, fmt):
    f = get_format(fmt)
    x = rng.standard_normal(1001).astype(np.float32)
    x[5] = np.nan
    msg = ref.encode(x, fmt)
    assert msg.size == 1001 * f.itemsize
    np.testing.assert_array_equal(msg, x.astype(f.wire_dtype).view(np.uint8))
    np.testing.assert_array_equal(bits(ref.decode(msg, 1001, fmt)), bits(x.astype(f.wire_dtype).astype(np.float32)))


def test_fused_hop_is_encode_of_fp32_sum(rng):
    a, b = rng.standard_normal(777).astype(np.float32), rng.standard_normal(777).astype(np.float32)
    msg = ref.encode(a, "e4m3", 32)
    want = ref.encode(ref.decode(msg, 777, "e4m3", 32) + b, "e4m3", 32)
    np.testing.assert_array_equal(ref.decode_add_encode(msg, b, "e4m3", 32), want)


def test_message_sizes_and_bytes_per_value():
    assert message_nbytes(256, "e4m3", 256) == 256 + 4
    assert message_nbytes(257, "e4m3", 256) == 260 + 8  # payload padded to 4, then two scales
    assert message_nbytes(10, "bf16") == 20 and message_nbytes(10, "fp32") == 40
    assert bytes_per_value("e4m3", 256) == pytest.approx(1 + 4 / 256)
    assert bytes_per_value("fp16") == 2


def test_bad_format_and_block_raise_value_error():
    with pytest.raises(ValueError, match="unknown format"):
        get_format(UNKNOWN_FORMAT)
    with pytest.raises(ValueError, match="block"):
        message_nbytes(10, "e4m3", 0)
    with pytest.raises(ValueError, match="bytes"):
        ref.decode(np.zeros(3, np.uint8), 10, "e4m3")
