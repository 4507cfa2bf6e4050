"""Named edge-value tables and bit-exact comparisons, shared by the GPU tests, the CPU emulation
tests and perf/device_check.sh. Pure NumPy.

Comparison rule (docs/gpu.md): wire messages must be byte-identical, except that for the
pass-through formats (bf16, fp16) a NaN input may come out as a different NaN bit pattern (the
GPU's cvt writes the canonical NaN); decoded float32 vectors must be bit-identical except that
NaN must match NaN (payload and sign bits of NaN are not part of the contract).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from giftcomm.formats import get_format, num_blocks

__all__ = ["edge_vectors", "random_vector", "messages_equal", "floats_equal", "BLOCKS", "LENGTHS"]

#: block sizes exercised: team path (1..256, odd and even, power of two or not), cta path, big path
BLOCKS = (1, 2, 3, 7, 8, 32, 100, 256, 257, 1000, 4096, 4097, 10000)
#: lengths: empty, tiny, odd, partial last blocks
LENGTHS = (0, 1, 3, 5, 31, 255, 256, 257, 1023, 4099, 12345)


def _f32(vals) -> np.ndarray:
    return np.array(vals, dtype=np.float32)


def edge_vectors(fmt: str) -> dict[str, np.ndarray]:
    """Named float32 vectors of the edge cases of ``fmt`` (block-scaled formats get values that
    land, after scaling, on the format's max, min normal, smallest subnormal, ties, -0, the
    saturation boundary; plus NaN, Inf and tiny-amax blocks)."""
    f = get_format(fmt)
    t: dict[str, np.ndarray] = {}
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    t["zeros"] = np.zeros(64, np.float32)
    t["signed_zero"] = _f32([-0.0, 0.0, -0.0, 1.0, -0.0])
    t["nan_block"] = _f32([1.0, np.nan, 2.0, -3.0])
    t["inf_block"] = _f32([1.0, np.inf, 2.0, -3.0])
    t["neg_inf_block"] = _f32([-np.inf, 0.0, 5.0, 7.0])
    t["f32_extremes"] = _f32([np.finfo(np.float32).max, -np.finfo(np.float32).max, 1.0, tiny])
    t["f32_subnormals"] = _f32([tiny, -tiny, tiny * 3, np.finfo(np.float32).tiny * np.float32(0.5)])
    if f.scaled:
        wire = f.wire_dtype
        codes = np.arange(256, dtype=np.uint8).view(wire).astype(np.float32)
        finite = codes[np.isfinite(codes)]
        t["all_codes"] = finite  # every finite code value (amax = max: scale 1 exactly)
        mx = np.float32(f.max_value)
        fi = ml_dtypes.finfo(wire)
        sub = np.float32(fi.smallest_subnormal)
        mn = np.float32(fi.smallest_normal)
        # the max itself is in every vector, so inv == 1 and values are cast as they are
        t["max_min_normal_subnormal"] = _f32([mx, -mx, mn, -mn, sub, -sub, sub / 2, -sub / 2, sub * 1.5])
        mids = (finite[:-1].astype(np.float64) + finite[1:].astype(np.float64)) / 2
        t["ties"] = np.append(mids[np.isfinite(mids)].astype(np.float32), mx)
        nxt = np.nextafter(mids.astype(np.float32), np.float32(np.inf))
        prv = np.nextafter(mids.astype(np.float32), np.float32(-np.inf))
        t["near_ties"] = np.concatenate([nxt, prv, [mx]]).astype(np.float32)
        t["saturation"] = _f32([mx, mx * 1.0001, -mx * 1.03, np.nextafter(mx, np.float32(np.inf)), 1.0])
        lim = np.float32(f.max_value) * np.float32(2.0**-126)
        t["tiny_amax"] = _f32([lim * 0.5, -lim * 0.25, 0.0, -0.0, tiny])
        t["just_tiny_amax"] = _f32([np.nextafter(lim, np.float32(0)), lim * 0.5, -tiny])
        t["at_tiny_amax"] = _f32([lim, -lim * 0.5, lim * 0.01])
        t["scaled_block"] = _f32([3.0e-3, -1.7e-4, 2.5e-3, 1.0e-8, -2.9e-3, 0.0])
        t["huge_block"] = _f32([3.0e38, -1.0e30, 2.0e20, 1.0])
    else:
        t["rounding"] = _f32([1.0 + 2**-9, 1.0 + 2**-8 + 2**-9, 65504.0, 65520.0, 65519.0, 1e-8, 6e-5, 3e38])
    return t


def random_vector(rng: np.random.Generator, n: int, spread: float = 20.0) -> np.ndarray:
    """n float32 values, normal times a log-uniform magnitude (``2**±spread``), a few exact zeros."""
    x = rng.standard_normal(n) * np.exp2(rng.uniform(-spread, spread, n))
    x[rng.random(n) < 0.01] = 0.0
    return x.astype(np.float32)


def floats_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise: same float32 bits, or both NaN."""
    a = np.asarray(a, np.float32).reshape(-1)
    b = np.asarray(b, np.float32).reshape(-1)
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


def messages_equal(a: np.ndarray, b: np.ndarray, count: int, fmt: str, block: int) -> tuple[bool, str]:
    """(equal, first difference) for two wire messages of ``count`` values (rule above)."""
    f = get_format(fmt)
    a = np.asarray(a).reshape(-1).view(np.uint8)
    b = np.asarray(b).reshape(-1).view(np.uint8)
    if a.size != b.size:
        return False, f"sizes differ: {a.size} vs {b.size}"
    if f.scaled:
        bad = np.flatnonzero(a != b)
        if bad.size:
            i = int(bad[0])
            where = f"payload value {i}" if i < count else f"byte {i} (pad/scales, {num_blocks(count, block)} blocks)"
            return False, f"{bad.size} bytes differ; first at {where}: {a[i]:#04x} vs {b[i]:#04x}"
        return True, ""
    if f.name == "fp32":
        ok = floats_equal(a.view(np.float32), b.view(np.float32))
    else:
        va, vb = a.view(f.wire_dtype).astype(np.float32), b.view(f.wire_dtype).astype(np.float32)
        ok = (a.view(np.uint16) == b.view(np.uint16)) | (np.isnan(va) & np.isnan(vb))
    bad = np.flatnonzero(~ok)
    if bad.size:
        return False, f"{bad.size} values differ; first at {int(bad[0])}"
    return True, ""
