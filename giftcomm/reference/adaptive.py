"""NumPy reference of the adaptive-precision rows (giftcomm.adaptive has the rules and the layout).

Arithmetic is float32 with round-to-nearest-even as in giftcomm.reference.codec; the element
rounding (nearest or stochastic with the Philox bits of element ``offset + i``) is that module's,
the INT2 midrise rounding is here. Values past ``count`` in the last super-block are encoded as
zeros with random bits 0.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..adaptive import (
    T2_GROUP,
    T2_MAX,
    T4_GROUP,
    T4_INT_MAX,
    T8_INT_GROUP,
    T8_INT_MAX,
    TIER_T2,
    TIER_T4,
    TIER_T8,
    AdaptiveSpec,
)
from ..formats import Format
from .elements import round_elements

__all__ = ["encode", "decode", "tiers_of", "int2_round"]

_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
_TINY = np.float32(2.0**-100)
_E4M3_TINY = np.float32(448.0 * 2.0**-126)


def _spec(f: Format) -> AdaptiveSpec:
    assert f.adaptive is not None  # callers dispatch on scale_kind == "adaptive"
    return f.adaptive


def _amax_bits(v: np.ndarray) -> np.ndarray:
    """Largest |bits| over the last axis (uint32): NaN above Inf above every finite value."""
    return (v.view(np.uint32) & np.uint32(0x7FFFFFFF)).max(axis=-1)


def _e4m3_value(codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.uint8).view(_E4M3).astype(np.float32)


def _cast(y: np.ndarray, elem: np.dtype, rbits: np.ndarray | None) -> np.ndarray:
    if rbits is None:
        return y.astype(elem).view(np.uint8)
    return round_elements(y, elem, rbits)


def int2_round(y: np.ndarray, rbits: np.ndarray | None) -> np.ndarray:
    """INT2 midrise codes (uint8: bit 1 the sign, bit 0 set for magnitude 3) of float32 values
    clipped to [-3, 3]. Nearest: magnitude 3 when ``|y| >= 2``, else 1, the sign of y (-0: -1).
    Stochastic with uint32 bits R, on the level index of the grid -3, -1, 1, 3: u = (y + 3) / 2
    in float64 (exact but for |y| < 2**-26 or so), L = floor(u) + 1 when the first 32 bits of
    frac(u) plus R reach 2**32 (L in 0..3, value 2L - 3: E[value] = y on all of [-3, 3])."""
    if rbits is None:
        sign = (y.view(np.uint32) >> np.uint32(31)).astype(np.uint8) << np.uint8(1)
        return sign | (np.abs(y) >= np.float32(2)).astype(np.uint8)
    u = (y.astype(np.float64) + 3.0) * 0.5
    fl = np.floor(u)
    frac = ((u - fl) * 2.0**32).astype(np.uint64)
    level = np.minimum(fl.astype(np.int64) + (frac + rbits.astype(np.uint64) >= np.uint64(1 << 32)), 3)
    return np.array([3, 2, 0, 1], np.uint8)[level]


def int8_round(y: np.ndarray, rbits: np.ndarray | None) -> np.ndarray:
    """INT8 codes (uint8 bytes of int8) of float32 values clipped to [-127, 127]: nearest (ties
    to even) or stochastic (``floor(|y|) + 1`` when the first 32 bits of frac(|y|) plus R reach
    2**32), the sign applied after."""
    a = np.abs(y)
    if rbits is None:
        m = np.rint(a)
    else:
        fl = np.floor(a)
        frac = ((a - fl).astype(np.float64) * 2.0**32).astype(np.uint64)
        m = fl + (frac + rbits.astype(np.uint64) >= np.uint64(1 << 32))
    return np.where(np.signbit(y), -m, m).astype(np.int8).view(np.uint8)


def _int2_value(codes: np.ndarray) -> np.ndarray:
    mag = np.where(codes & 1, np.float32(T2_MAX), np.float32(1))
    return np.where(codes & 2, -mag, mag).astype(np.float32)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack codes (m, n) of ``bits`` bits along the last axis, value k at bits ``bits * (k % per)``."""
    per = 8 // bits
    c = codes.reshape(*codes.shape[:-1], -1, per).astype(np.uint8)
    out = np.zeros(c.shape[:-1], np.uint8)
    for i in range(per):
        out |= c[..., i] << np.uint8(bits * i)
    return out


def _unpack(payload: np.ndarray, bits: int) -> np.ndarray:
    per = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    return np.stack([(payload >> np.uint8(bits * i)) & mask for i in range(per)], axis=-1).reshape(
        *payload.shape[:-1], -1)


def tiers_of(amax_bits: np.ndarray, counts: tuple[int, int, int]) -> np.ndarray:
    """Choice codes (uint8, shape of ``amax_bits``: (frames, n)) of each frame's super-blocks:
    the ``k8`` largest amax TIER_T8, the next ``k4`` TIER_T4, the rest TIER_T2; ties by index."""
    k8, k4, _ = counts
    order = np.argsort(-amax_bits.astype(np.int64), axis=-1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(order.shape[-1])[None, :], axis=-1)
    return np.where(rank < k8, TIER_T8, np.where(rank < k8 + k4, TIER_T4, TIER_T2)).astype(np.uint8)


def _scaled_tier(v: np.ndarray, r: np.ndarray | None, group: int, emax: float, super_div: float,
                 encode_elems) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """T4/T2: (element codes (m, B), E4M3 scale codes (m, B/group), super-scales (m,)) of
    super-blocks v (m, B): NVFP4's two-level rule with the super-block as its group."""
    m, b = v.shape
    bits = _amax_bits(v)
    finite = bits < 0x7F800000
    g = np.where(finite, bits, 0).astype(np.uint32).view(np.float32)
    tiny = g < _TINY
    gsafe = np.where(tiny, np.float32(1), g).astype(np.float32)
    s2 = np.where(tiny, np.float32(1), gsafe / np.float32(super_div)).astype(np.float32)
    q2 = np.where(tiny, np.float32(0), np.float32(448) / gsafe).astype(np.float32)
    vf = np.where(finite[:, None], v, np.float32(0)).astype(np.float32)
    amax = _amax_bits(vf.reshape(m, b // group, group)).view(np.float32)
    t = np.minimum(amax * q2[:, None], np.float32(448)).astype(np.float32)
    bs = t.astype(_E4M3).view(np.uint8).copy()
    bs = (bs + (_e4m3_value(bs) < t)).astype(np.uint8)  # round up: no element saturates
    bs = np.where((amax > 0) & ~tiny[:, None], np.maximum(bs, 1), 0).astype(np.uint8)
    d = (_e4m3_value(bs) * s2[:, None]).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(bs > 0, np.float32(1) / np.where(bs > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    y = np.clip(vf.reshape(m, b // group, group) * inv[..., None], np.float32(-emax), np.float32(emax))
    y = y.reshape(m, b).astype(np.float32)
    codes = encode_elems(y, None if r is None else r.reshape(m, b))
    if r is not None:  # a group of scale 0 decodes to zeros: nearest codes keep their signs
        zero = np.repeat(bs == 0, group, axis=1)
        codes = np.where(zero, encode_elems(y, None), codes).astype(np.uint8)
    s2 = np.where(finite, s2, np.float32(np.nan)).astype(np.float32)
    bs[~finite] = 0
    codes = np.where(finite[:, None], codes, np.uint8(0)).astype(np.uint8)
    return codes, bs, s2


def _t8(v: np.ndarray, r: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """T8: (E4M3 codes (m, B), float32 scales (m,)): the e4m3 row's rule, one block a super-block."""
    bits = _amax_bits(v)
    finite = bits < 0x7F800000
    amax = np.where(finite, bits, 0).astype(np.uint32).view(np.float32)
    regular = finite & (amax >= _E4M3_TINY)
    safe = np.where(regular, amax, np.float32(448)).astype(np.float32)
    scale = np.where(regular, safe / np.float32(448), np.float32(1)).astype(np.float32)
    inv = np.where(regular, np.float32(448) / safe, np.float32(1)).astype(np.float32)
    vf = np.where(finite[:, None], v, np.float32(0)).astype(np.float32)
    y = np.clip(vf * inv[:, None], np.float32(-448), np.float32(448)).astype(np.float32)
    codes = _cast(y, _E4M3, r)
    codes = np.where(finite[:, None], codes.reshape(v.shape), np.uint8(0)).astype(np.uint8)
    scale = np.where(finite, scale, np.float32(np.nan)).astype(np.float32)
    return codes, scale


def _e2m1_codes(y: np.ndarray, r: np.ndarray | None) -> np.ndarray:
    return _cast(y.reshape(-1), _E2M1, None if r is None else r.reshape(-1)).reshape(y.shape)


def _encode_frames(v: np.ndarray, r: np.ndarray | None, spec: AdaptiveSpec, block: int) -> np.ndarray:
    """Frames (m, frame_nbytes) of super-blocks v (m, n, block) float32, random bits r or None."""
    m, n, _ = v.shape
    counts = spec.tier_counts(n, block)
    tiers = tiers_of(_amax_bits(v), counts)
    out = np.zeros((m, spec.frame_nbytes(n, block)), np.uint8)
    choice = np.zeros((m, 4 * -(-n // 16)), np.uint8)
    choice[:, : -(-n // 4)] = _pack(np.pad(tiers, ((0, 0), (0, -n % 4))), 2)
    pos = choice.shape[1]
    out[:, :pos] = choice
    scales = np.zeros((m, n), np.float32)
    sections = []
    for tier, k in zip((TIER_T8, TIER_T4, TIER_T2), counts):
        if k == 0:
            continue
        sel = tiers == tier
        vt = v[sel].reshape(m * k, block)
        rt = None if r is None else r[sel].reshape(m * k, block)
        if tier == TIER_T8 and spec.top == "e4m3":
            codes, s = _t8(vt, rt)
            body = codes
        elif tier == TIER_T8:
            codes, bs, s = _scaled_tier(vt, rt, T8_INT_GROUP, float(T8_INT_MAX), 448.0 * T8_INT_MAX, int8_round)
            body = np.concatenate([codes, bs], axis=1)
        elif tier == TIER_T4 and spec.mid == "int4":
            codes, bs, s = _scaled_tier(vt, rt, T4_GROUP, float(T4_INT_MAX), 448.0 * T4_INT_MAX, int8_round)
            body = np.concatenate([_pack(codes & np.uint8(0xF), 4), bs], axis=1)
        elif tier == TIER_T4:
            codes, bs, s = _scaled_tier(vt, rt, T4_GROUP, 6.0, 2688.0, _e2m1_codes)
            body = np.concatenate([_pack(codes & np.uint8(0xF), 4), bs], axis=1)
        else:
            codes, bs, s = _scaled_tier(vt, rt, T2_GROUP, float(T2_MAX), 448.0 * T2_MAX, int2_round)
            body = np.concatenate([_pack(codes, 2), bs], axis=1)
        scales[sel] = s
        sections.append(body.reshape(m, -1))
    out[:, pos : pos + 4 * n] = scales.view(np.uint8)
    pos += 4 * n
    for body in sections:
        out[:, pos : pos + body.shape[1]] = body
        pos += body.shape[1]
    return out


def _frames(count: int, spec: AdaptiveSpec, block: int) -> list[tuple[int, int, int]]:
    """(first super-block, frames, super-blocks per frame) of the full frames and the partial one."""
    nsb = -(-count // block)
    full, rest = divmod(nsb, spec.frame)
    parts = [(0, full, spec.frame)] if full else []
    return parts + [(full * spec.frame, 1, rest)] if rest else parts


def encode(x: np.ndarray, f: Format, block: int, msg: np.ndarray, rbits: np.ndarray | None) -> None:
    """Encode float32 ``x`` (1-D) into ``msg`` (uint8, the message's bytes) by the rules of
    giftcomm.adaptive; ``rbits``: uint32 random bits per value (stochastic) or None (nearest)."""
    spec = _spec(f)
    n = x.size
    nsb = -(-n // block)
    v = np.zeros(nsb * block, np.float32)
    v[:n] = x
    r = None
    if rbits is not None:
        r = np.zeros(nsb * block, np.uint32)
        r[:n] = rbits
    pos = 0
    for first, frames, per in _frames(n, spec, block):
        lo, hi = first * block, (first + frames * per) * block
        enc = _encode_frames(v[lo:hi].reshape(frames, per, block),
                             None if r is None else r[lo:hi].reshape(frames, per, block), spec, block)
        msg[pos : pos + enc.size] = enc.reshape(-1)
        pos += enc.size


def _decode_frames(body: np.ndarray, n: int, spec: AdaptiveSpec, block: int) -> np.ndarray:
    """Values (m, n * block) float32 of frames ``body`` (m, frame_nbytes)."""
    m = body.shape[0]
    counts = spec.tier_counts(n, block)
    cb = 4 * -(-n // 16)
    tiers = _unpack(body[:, :cb], 2)[:, :n]
    for tier, k in zip((TIER_T8, TIER_T4, TIER_T2), counts):
        if m and not ((tiers == tier).sum(axis=1) == k).all():
            raise ValueError(f"corrupt adaptive message: a frame's choice bits do not give {counts} super-blocks "
                             f"at 8/4/2 bits")
    scales = body[:, cb : cb + 4 * n].copy().view(np.float32)
    pos = cb + 4 * n
    out = np.zeros((m, n, block), np.float32)
    t8, t4, t2 = spec.tier_bytes(block)
    with np.errstate(invalid="ignore", over="ignore"):
        for tier, k, tb in zip((TIER_T8, TIER_T4, TIER_T2), counts, (t8, t4, t2)):
            if k == 0:
                continue
            sec = body[:, pos : pos + k * tb].reshape(m * k, tb)
            pos += k * tb
            sel = tiers == tier
            s = scales[sel]
            if tier == TIER_T8 and spec.top == "e4m3":
                vals = sec.view(_E4M3).astype(np.float32) * s[:, None]
            else:
                group, bits = {TIER_T8: (T8_INT_GROUP, 8), TIER_T4: (T4_GROUP, 4), TIER_T2: (T2_GROUP, 2)}[tier]
                nel = block * bits // 8
                if bits == 8:
                    elem = sec[:, :nel].view(np.int8).astype(np.float32)
                else:
                    codes = _unpack(sec[:, :nel], bits)
                    if bits == 2:
                        elem = _int2_value(codes)
                    elif spec.mid == "int4":  # two's complement nibbles
                        elem = ((codes ^ np.uint8(8)).astype(np.float32) - np.float32(8)).astype(np.float32)
                    else:
                        elem = codes.view(_E2M1).astype(np.float32)
                d = (_e4m3_value(sec[:, nel:]) * s[:, None]).astype(np.float32)
                vals = (elem.reshape(m * k, block // group, group) * d[..., None]).reshape(m * k, block)
                vals[~np.isfinite(s)] = np.float32(np.nan)
            out[sel] = vals.astype(np.float32)
    return out.reshape(m, n * block)


def decode(message: np.ndarray, count: int, f: Format, block: int) -> np.ndarray:
    """Decode a message of ``count`` values (uint8, exactly its bytes) into new float32 values.
    ValueError when a frame's choice bits do not give the row's tier counts."""
    spec = _spec(f)
    nsb = -(-count // block)
    out = np.zeros(nsb * block, np.float32)
    pos = 0
    for first, frames, per in _frames(count, spec, block):
        fb = spec.frame_nbytes(per, block)
        body = message[pos : pos + frames * fb].reshape(frames, fb)
        pos += frames * fb
        out[first * block : (first + frames * per) * block] = _decode_frames(body, per, spec, block).reshape(-1)
    return out[:count]
