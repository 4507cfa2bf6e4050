"""Element rounding of the NumPy reference: float32 values to the codes of an element format.

One integer formulation (what the C and CUDA kernels compute) serves every element dtype the
format rows name, nearest-even or stochastic with uint32 random bits; giftcomm.reference.codec
(and the adaptive rows' tiers, giftcomm.reference.adaptive) round through it.
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

__all__ = ["element_facts", "round_elements"]


@functools.lru_cache(maxsize=None)
def element_facts(elem: np.dtype) -> tuple[int, int, int]:
    """(mantissa bits, exponent of the smallest normal, total bits) of an element dtype (an
    ml_dtypes float type: float8_e4m3fn (3, -6, 8), float8_e5m2 (2, -14, 8), float4_e2m1fn
    (1, 0, 4), ...), from ``ml_dtypes.finfo``: any element a format row names works."""
    fi = ml_dtypes.finfo(np.dtype(elem))
    return int(fi.nmant), int(fi.minexp), int(fi.bits)


def round_elements(y: np.ndarray, elem: np.dtype, rbits: np.ndarray | None = None) -> np.ndarray:
    """Codes (uint8; 4-bit codes in the low nibble) of float32 values ``y`` already clipped to
    the element format's ±max (finite): nearest-even when ``rbits`` is None, else stochastic with
    the uint32 random bits ``rbits`` (giftcomm.reference.codec's docstring). This integer formulation is what the C
    and CUDA kernels compute; for nearest it equals ml_dtypes' cast (tests/test_formats_mx.py)."""
    mant, emin, bits = element_facts(np.dtype(elem))
    u = np.ascontiguousarray(y, dtype=np.float32).view(np.uint32)
    a = (u & np.uint32(0x7FFFFFFF)).astype(np.int64)
    ef = a >> 23
    sig = np.where(ef > 0, (a & 0x7FFFFF) | 0x800000, a)
    e = np.maximum(ef, 1) - 127
    d = 23 - mant + np.maximum(emin - e, 0)
    hi = sig >> np.minimum(d, 31)
    sl = np.where(d <= 32, 32 - d, 0)
    sr = np.where(d > 32, np.minimum(d - 32, 31), 0)
    lo = ((sig << sl) & 0xFFFFFFFF) >> sr
    if rbits is None:
        up = (lo > 0x80000000) | ((lo == 0x80000000) & ((hi & 1) == 1))
    else:
        up = lo + np.asarray(rbits, dtype=np.int64) >= (1 << 32)
    code = hi + up + (np.maximum(e - emin, 0) << mant)
    sign = (u >> np.uint32(31)).astype(np.int64) << (bits - 1)
    return (code | sign).astype(np.uint8)
