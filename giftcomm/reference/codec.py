"""Plain NumPy reference codec: the ground truth every fast path must equal bit for bit.

All arithmetic is float32 with round-to-nearest-even unless said otherwise; ``amax`` of a block
is the largest ``|x|`` compared on the float32 bit patterns (NaN above Inf). The rules
(docs/wire-format.md has the same text, with the byte layouts):

**e4m3 / e5m2** (float32 block scales; ``max`` = 448 / 57344):

- amax NaN or Inf: the block is *non-finite*: scale = NaN, every code = 0x7F; decodes to NaN.
- amax < ``max * 2**-126`` (includes all-zero blocks): scale = 1, inv = 1.
- otherwise: scale = fp32(amax / max), inv = fp32(max / amax).
- element: ``y = clip(fp32(x * inv), -max, max)``, code = round(y) (see *Rounding*).
- decode: ``fp32(float32(code) * scale)``.

**mxfp8 / mxfp8_e5m2 / mxfp4** (OCP MX v1.0 layout; 32 values per E8M0 scale; ``emax`` = 8
(E4M3), 15 (E5M2), 2 (E2M1), the exponent of the element format's largest power of two; ``E`` =
the biased float32 exponent field of the block's amax):

- amax NaN or Inf: scale code 0xFF (E8M0 NaN), every element code ``nan_code`` (0x7F for the
  FP8 elements, 0 for E2M1, which has no NaN: the scale carries it); decodes to NaN.
- otherwise the shared exponent ``s`` (scale code ``s + 127``) by the format's rule
  (``Format.scale_rule``, the call option ``mx_scale``):

  - ``"ceil"`` (default): the smallest power of two that keeps the block's amax within the
    element max, ``s = ceil(log2(amax / max))``: scale code ``max(E - emax + c, 0)`` with
    ``c = 1`` when amax's float32 mantissa field exceeds max's (amax > max * 2**(E-127-emax)),
    else 0 (exact: a block whose amax is max times a power of two lands exactly on max). No
    element saturates, so stochastic rounding stays unbiased.
  - ``"floor"``: OCP MX v1.0's ``s = floor(log2(amax)) - emax``: scale code ``max(E - emax, 0)``.
    Values at or above ``max * 2**s`` (up to the top quarter of the top binade) saturate to ±max.

  Range ends: zero and float32-subnormal blocks get code 0 (2^-127) under both rules. In the top
  float32 binade (E = 254) ceil keeps the floor code: the next element value above such an amax,
  times the larger scale, would be beyond the float32 max (it would decode to Inf), so there, and
  only there, the largest values saturate under ceil too. The code is never the NaN code 0xFF.
- element: ``y = clip(fp32(x * 2**-s), -max, max)`` (the multiply is exact unless the result is
  a float32 subnormal), code = round(y).
- decode: ``fp32(element * 2**s)`` (exact).

**nvfp4** (E2M1 elements, E4M3 scale per 16 values, float32 scale per group of 1024 values =
64 blocks, groups counted from the start of the message, the last one possibly partial):

- non-finite block (amax NaN/Inf): block scale code 0x7F (E4M3 NaN), elements 0; decodes to NaN.
  The group scale ignores such blocks: one bad value poisons only its own 16-value block.
- group: ``g`` = the largest amax of the group's finite blocks.
    - ``g < 2**-100`` (includes all-zero groups): *tiny* group: group scale 1.0, every finite
      block scale code 0, every element signed zero.
    - otherwise: group scale ``s2 = fp32(g / 2688)`` (2688 = 6 * 448) and ``q2 = fp32(448 / g)``.
- block (finite, in a regular group): ``t = min(fp32(amax * q2), 448)``, code ``bs`` = the
  smallest E4M3 value >= t (rounded *up*, so that the block's amax lands at or below 6 and
  no element saturates: stochastic rounding stays unbiased), at least 1 (2^-9, the smallest
  subnormal) when amax > 0; an all-zero block has bs = 0.
  Decode scale ``d = fp32(E4M3value(bs) * s2)``; encode multiplier ``r = fp32(1 / d)`` (0 when
  bs = 0).
- element: ``y = clip(fp32(x * r), -6, 6)``, code = round(y).
- decode: ``fp32(E2M1value(code) * d)`` (``d`` recomputed from the wire).

**Rounding** of the element ``y`` (already clipped, finite) to the element format:

- ``nearest``: round to nearest, ties to even: exactly ml_dtypes' float32 cast
  (``float8_e4m3fn``, ``float8_e5m2``, ``float4_e2m1fn``); -0 keeps its sign.
- ``stochastic`` with a 64-bit ``key`` and element index ``offset + i`` (i counted from the start
  of the message): ``R`` = word 0 of Philox4x32-10 with key (key mod 2^32, key >> 32) and counter
  (idx mod 2^32, idx >> 32, 0, 0). Let ``u = |y| / step`` where ``step`` is the element format's
  spacing at ``|y|`` (the subnormal spacing below the smallest normal), and ``F`` = the first 32
  bits of frac(u) (truncated). The magnitude is ``floor(u) + 1`` when ``F + R >= 2**32``, else
  ``floor(u)``: it rounds up with probability F / 2^32, so E[result] = |y| up to 2^-32 of a
  step. Exact grid values (F = 0), zeros (-0 keeps its sign) and ±max never move; there is no
  overflow because y is clipped to ±max first (values beyond max, possible only under the MX
  ``floor`` rule, saturate deterministically: a bias). Scales are always chosen as above (nearest),
  independently of the rounding of the elements.

Fused hop: ``encode(fp32(decode(message) + local))`` with the same rounding, key and offset.

Pass-through formats (bf16, fp16, fp32): encode is the float32 -> format cast (round to nearest
even; fp16 overflows to Inf like any IEEE cast), decode is the exact cast back to float32.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..formats import (
    NVFP4_GROUP,
    Format,
    check_key,
    check_offset,
    check_rounding,
    get_format,
    group_scales_offset,
    message_nbytes,
    num_blocks,
    num_groups,
    payload_nbytes,
    resolve_block,
    scales_offset,
)
from . import adaptive as _adaptive
from .elements import element_facts, round_elements

__all__ = ["encode", "decode", "decode_add_encode", "block_scales", "e8m0_codes", "split_message", "philox4x32",
           "philox_bits", "round_elements", "element_facts"]

_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
_E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
_M32 = np.uint64(0xFFFFFFFF)
#: nvfp4: groups whose largest finite block amax is below this are encoded as zeros
NVFP4_TINY = np.float32(2.0**-100)



# ------------------------------------------------------------------------- Philox4x32-10
_PH_M0, _PH_M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_PH_W0, _PH_W1 = 0x9E3779B9, 0xBB67AE85


def philox4x32(counter: tuple, key: tuple[int, int], rounds: int = 10) -> tuple[np.ndarray, ...]:
    """Philox4x32-``rounds`` (Salmon et al., SC'11; the Random123 definition): four uint32 arrays
    (counter words, broadcast) and a key of two uint32 ints -> the four output words (uint32)."""
    c = [np.asarray(w, dtype=np.uint64) & _M32 for w in counter]
    c = list(np.broadcast_arrays(*c))
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for _ in range(rounds):
        p0 = _PH_M0 * c[0]
        p1 = _PH_M1 * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & _M32, (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1),
             p0 & _M32]
        k0 = (k0 + _PH_W0) & 0xFFFFFFFF
        k1 = (k1 + _PH_W1) & 0xFFFFFFFF
    return tuple(w.astype(np.uint32) for w in c)


def philox_bits(key: int, offset: int, n: int) -> np.ndarray:
    """The 32 random bits of elements ``offset .. offset + n - 1`` (uint32[n]): word 0 of
    Philox4x32-10 with key (key mod 2^32, key >> 32), counter (idx mod 2^32, idx >> 32, 0, 0)."""
    key, offset = check_key(key), check_offset(offset)
    idx = (np.arange(n, dtype=np.uint64) + np.uint64(offset))  # wraps modulo 2^64
    zero = np.zeros(1, np.uint64)
    return philox4x32((idx & _M32, idx >> np.uint64(32), zero, zero), (key & 0xFFFFFFFF, key >> 32))[0]


def _cast(y: np.ndarray, elem: np.dtype, rbits: np.ndarray | None) -> np.ndarray:
    """Element codes (uint8) of clipped float32 values: ml_dtypes' cast (nearest) or stochastic."""
    if rbits is None:
        return y.astype(elem).view(np.uint8)
    return round_elements(y, elem, rbits)


def _pack4(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes two per byte, value 2j in the low nibble of byte j."""
    c = codes.astype(np.uint8) & np.uint8(0xF)
    if c.size % 2:
        c = np.append(c, np.uint8(0))
    return c[0::2] | (c[1::2] << np.uint8(4))


def _unpack4(payload: np.ndarray, count: int) -> np.ndarray:
    out = np.empty(2 * payload.size, np.uint8)
    out[0::2] = payload & np.uint8(0xF)
    out[1::2] = payload >> np.uint8(4)
    return out[:count]


def _amax_bits(x: np.ndarray, block: int, nb: int) -> np.ndarray:
    """Per-block max of |bits| (uint32): orders |x| and puts NaN above Inf."""
    a = np.zeros(nb * block, np.uint32)
    a[: x.size] = x.view(np.uint32) & np.uint32(0x7FFFFFFF)
    return a.reshape(nb, block).max(axis=1) if nb else np.zeros(0, np.uint32)


def _e4m3_value(codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.uint8).view(_E4M3).astype(np.float32)


# ------------------------------------------------------------------------- messages
def split_message(message: np.ndarray, count: int, fmt: Format,
                  block: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Views of a message's payload and block scales.

    e4m3/e5m2 and pass-through: (payload in the wire dtype, ``count``; float32 scales or None).
    MX formats and nvfp4: (payload bytes, uint8; scale bytes, uint8). nvfp4's group scales:
    :func:`group_scales`.
    """
    f = get_format(fmt)
    if not f.scaled:
        return message[: count * f.itemsize].view(f.wire_dtype), None
    off = scales_offset(count, f)
    if f.scale_kind == "f32":
        return message[:count].view(f.wire_dtype), message[off:].view(np.float32)
    nb = num_blocks(count, resolve_block(f, block))
    return message[: payload_nbytes(count, f)], message[off : off + nb]


def group_scales(message: np.ndarray, count: int) -> np.ndarray:
    """The float32 group scales of an nvfp4 message (a view)."""
    off = group_scales_offset(count, get_format("nvfp4"))
    return message[off : off + 4 * num_groups(count)].view(np.float32)


def block_scales(x: np.ndarray, fmt: Format, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """e4m3/e5m2: per-block (scale, inv, finite) for a float32 vector: float32, float32, bool arrays."""
    n = x.size
    nb = num_blocks(n, block)
    padded = np.zeros(nb * block, np.float32)
    padded[:n] = np.abs(x)
    with np.errstate(invalid="ignore"):
        amax = padded.reshape(nb, block).max(axis=1)
    finite = np.isfinite(amax)
    fmax = np.float32(fmt.max_value)
    regular = finite & (amax >= fmt.tiny_amax)
    safe = np.where(regular, amax, fmax).astype(np.float32)
    scale = np.where(regular, safe / fmax, np.float32(1)).astype(np.float32)
    inv = np.where(regular, fmax / safe, np.float32(1)).astype(np.float32)
    scale[~finite] = np.float32(np.nan)
    return scale, inv, finite


def _rounding_bits(rounding: str, key: int, offset: int, n: int) -> np.ndarray | None:
    return None if rounding == "nearest" else philox_bits(key, offset, n)


def _encode_f32(x, f, block, msg, rbits):
    n = x.size
    payload, scales = split_message(msg, n, f)
    assert scales is not None  # a scaled format
    msg[n : scales_offset(n, f)] = 0
    scale, inv, finite = block_scales(x, f, block)
    fmax = np.float32(f.max_value)
    bad = np.repeat(~finite, block)[:n]
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.clip(x * np.repeat(inv, block)[:n], -fmax, fmax)
    y[bad] = 0
    codes = _cast(y, f.wire_dtype, rbits)
    codes[bad] = f.nan_code
    payload.view(np.uint8)[...] = codes
    scales[...] = scale


def _encode_mx(x, f, block, msg, rbits):
    n = x.size
    nb = num_blocks(n, block)
    m = _amax_bits(x, block, nb)
    finite = m < 0x7F800000
    code = e8m0_codes(m, f)
    mult = ((254 - np.where(finite, code, 0)) << 23).astype(np.uint32).view(np.float32)
    bad = np.repeat(~finite, block)[:n]
    xs = np.where(bad, np.float32(0), x)
    fmax = np.float32(f.max_value)
    with np.errstate(over="ignore"):
        y = np.clip(xs * np.repeat(mult, block)[:n], -fmax, fmax)
    codes = _cast(y, f.wire_dtype, rbits)
    codes[bad] = f.nan_code
    payload, scales = split_message(msg, n, f, block)
    assert scales is not None  # a scaled format
    payload[...] = _pack4(codes) if f.packed else codes
    scales[...] = np.where(finite, code, 0xFF).astype(np.uint8)


def e8m0_codes(amax_bits: np.ndarray, f: Format) -> np.ndarray:
    """E8M0 scale codes (int64) of blocks with finite amax bits ``amax_bits`` (uint32) under the
    format's shared-exponent rule (module docstring): floor ``max(E - emax, 0)``; ceil one more
    where amax's mantissa field exceeds the element max's, i.e. where amax > max * 2**(E - 127 - emax),
    except in the top float32 binade (E = 254)."""
    e = (amax_bits >> np.uint32(23)).astype(np.int64)
    if f.scale_rule == "ceil":
        max_mant = int(np.float32(f.max_value).view(np.uint32)) & 0x7FFFFF
        e = e + (((amax_bits & np.uint32(0x7FFFFF)) > max_mant) & (amax_bits < np.uint32(0x7F000000)))
    return np.maximum(e - f.emax, 0)


def _encode_nvfp4(x, f, block, msg, rbits):
    n = x.size
    nb, ng = num_blocks(n, block), num_groups(n)
    per = NVFP4_GROUP // block
    m = _amax_bits(x, block, nb)
    finite = m < 0x7F800000
    mf = np.where(finite, m, np.uint32(0))
    gm = np.zeros(ng * per, np.uint32)
    gm[:nb] = mf
    g = gm.reshape(ng, per).max(axis=1).view(np.float32)
    tiny = g < NVFP4_TINY
    gsafe = np.where(tiny, np.float32(1), g).astype(np.float32)
    s2 = np.where(tiny, np.float32(1), gsafe / np.float32(2688)).astype(np.float32)
    q2 = np.where(tiny, np.float32(0), np.float32(448) / gsafe).astype(np.float32)
    grp = np.arange(nb) // per
    amax = mf.view(np.float32)
    t = np.minimum(amax * q2[grp], np.float32(448)).astype(np.float32)
    bs = t.astype(_E4M3).view(np.uint8).copy()
    bs = (bs + (_e4m3_value(bs) < t)).astype(np.uint8)  # round up: the block's amax never saturates
    bs = np.where((amax > 0) & ~tiny[grp], np.maximum(bs, 1), 0).astype(np.uint8)
    d = (_e4m3_value(bs) * s2[grp]).astype(np.float32)
    with np.errstate(divide="ignore"):
        r = np.where(bs > 0, np.float32(1) / np.where(bs > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    bs[~finite] = 0x7F
    bad = np.repeat(~finite, block)[:n]
    xs = np.where(bad, np.float32(0), x)
    y = np.clip(xs * np.repeat(r, block)[:n], np.float32(-6), np.float32(6))
    codes = _cast(y, f.wire_dtype, rbits)
    codes[bad] = 0
    payload, scales = split_message(msg, n, f, block)
    assert scales is not None  # a scaled format
    payload[...] = _pack4(codes)
    scales[...] = bs
    off = scales_offset(n, f) + nb
    msg[off : group_scales_offset(n, f)] = 0
    group_scales(msg, n)[...] = s2


def encode(x: np.ndarray, fmt: str | Format = "e4m3", block: int | None = None, out: np.ndarray | None = None, *,
           rounding: str = "nearest", key: int = 0, offset: int = 0) -> np.ndarray:
    """Encode a 1-D float32 vector into one wire message (uint8, ``message_nbytes`` long).

    ``block`` None: the format's own block (resolve_block). ``rounding="stochastic"``: Philox
    bits keyed by ``key`` for element indices ``offset + i`` (module docstring)."""
    f = get_format(fmt)
    block = resolve_block(f, block)
    check_rounding(rounding, f)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    n = x.size
    nbytes = message_nbytes(n, f, block)
    msg = np.zeros(nbytes, np.uint8) if out is None else out
    if msg.dtype != np.uint8 or msg.size != nbytes:
        raise ValueError(f"out must be uint8 of {nbytes} bytes")
    if not f.scaled:
        msg[: n * f.itemsize].view(f.wire_dtype)[...] = x.astype(f.wire_dtype)
        return msg
    rbits = _rounding_bits(rounding, key, offset, n)
    if f.adaptive is not None:
        _adaptive.encode(x, f, block, msg, rbits)
    elif f.scale_kind == "f32":
        _encode_f32(x, f, block, msg, rbits)
    elif f.scale_kind == "e8m0":
        _encode_mx(x, f, block, msg, rbits)
    else:
        _encode_nvfp4(x, f, block, msg, rbits)
    return msg


def decode(message: np.ndarray, count: int, fmt: str | Format = "e4m3", block: int | None = None) -> np.ndarray:
    """Decode one wire message of ``count`` values into a new float32 vector."""
    f = get_format(fmt)
    block = resolve_block(f, block)
    message = np.asarray(message).reshape(-1).view(np.uint8)
    nbytes = message_nbytes(count, f, block)
    if message.size != nbytes:
        raise ValueError(f"a {f.name} message of {count} values has {nbytes} bytes, got {message.size}")
    if f.adaptive is not None:
        return _adaptive.decode(message, count, f, block)
    payload, scales = split_message(message, count, f, block)
    if f.packed:
        values = _unpack4(payload, count).view(_E2M1).astype(np.float32)
    else:
        values = payload.view(f.wire_dtype).astype(np.float32)
    if not f.scaled:
        return values
    assert scales is not None  # every scaled format's message carries block scales
    with np.errstate(invalid="ignore", over="ignore"):
        if f.scale_kind == "f32":
            values *= np.repeat(scales, block)[:count]
            return values
        if f.scale_kind == "e8m0":
            s = scales.view(_E8M0).astype(np.float32)
            bad = scales == 0xFF
        else:
            nb = num_blocks(count, block)
            s2 = group_scales(message, count)
            s = (_e4m3_value(scales) * s2[np.arange(nb) // (NVFP4_GROUP // block)]).astype(np.float32)
            bad = (scales & 0x7F) == 0x7F
        values *= np.repeat(s, block)[:count]
    values[np.repeat(bad, block)[:count]] = np.float32(np.nan)
    return values


def decode_add_encode(message: np.ndarray, local: np.ndarray, fmt: str | Format = "e4m3", block: int | None = None,
                      out: np.ndarray | None = None, *, rounding: str = "nearest", key: int = 0,
                      offset: int = 0) -> np.ndarray:
    """One ring hop: ``encode(decode(message) + local)``, the sum in float32."""
    local = np.asarray(local, dtype=np.float32).reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        total = decode(message, local.size, fmt, block) + local
    return encode(total, fmt, block, out=out, rounding=rounding, key=key, offset=offset)
