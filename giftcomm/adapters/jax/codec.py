"""The wire codec in ``jax.numpy``: encode, decode and the fused ring hop, traceable under ``jax.jit``.

Bit-identical to giftcomm.reference.codec (its module docstring states the rules): for a static
element count ``n``, :func:`encode` returns the same ``uint8[message_nbytes(n)]`` wire message
as ``giftcomm.reference.codec.encode`` and :func:`decode` the same float32 values, for every row
of giftcomm.formats.FORMATS (both MX scale rules), nearest and stochastic rounding. Only 32-bit
integer and float32 operations are used (no x64): Philox4x32-10's 32x32 -> 64-bit products are
formed from 16-bit halves, element rounding is the reference's integer formulation
(``round_elements``), and element/scale decoding reads 256-entry tables built from ml_dtypes.

Stochastic rounding takes the Philox key as a pair of uint32 words (a traced ``uint32[2]`` or
Python ints: ``key_words``) and the element index of value 0 as a uint32 ``offset`` (traced or
int): indices must stay below 2**32 (the callers check). :func:`call_key_words` is
``giftcomm.reference.rounding.call_key`` on traced 64-bit seeds held as two uint32 words, so a
jitted step can pass its seed as an array argument (one compiled program for every step).

Bit identity relies on IEEE float32 multiply, divide and add without contraction into FMAs:
true of XLA:CPU (checked by tests/test_jax_jit.py); a device run must check it on GPU
(docs/adapters.md names the check).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ...formats import (
    NVFP4_GROUP,
    Format,
    get_format,
    group_scales_offset,
    message_nbytes,
    num_blocks,
    num_groups,
    payload_nbytes,
    resolve_block,
    scales_offset,
)
from ...reference import adaptive as _adaptive
from ...reference.codec import NVFP4_TINY, element_facts
from ...reference.rounding import mix64

__all__ = ["divisor", "encode", "decode", "decode_add_encode", "padded_nbytes", "philox_bits", "key_words", "mix64_words",
           "call_key_words", "PASS_DTYPES"]

#: the jnp dtype of each pass-through format
PASS_DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}

_U32 = jnp.uint32


def key_words(key: int) -> tuple[int, int]:
    """A 64-bit Philox key as (low word, high word)."""
    return key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF


def _add64(lo: Any, hi: Any, c: int) -> tuple[Any, Any]:
    """(lo, hi) + the 64-bit constant c, modulo 2**64."""
    cl, ch = key_words(c)
    s = lo + _U32(cl)
    return s, hi + _U32(ch) + (s < lo).astype(_U32)


def _xor_shr64(lo: Any, hi: Any, k: int) -> tuple[Any, Any]:
    """z ^ (z >> k) for 0 < k < 32, z = (lo, hi)."""
    return lo ^ ((lo >> _U32(k)) | (hi << _U32(32 - k))), hi ^ (hi >> _U32(k))


def _mul64(lo: Any, hi: Any, c: int) -> tuple[Any, Any]:
    """(lo, hi) * the 64-bit constant c, modulo 2**64."""
    cl, ch = key_words(c)
    h, low = _mulhilo(cl, lo)
    return low, h + lo * _U32(ch) + hi * _U32(cl)


def mix64_words(lo: Any, hi: Any) -> tuple[Any, Any]:
    """``giftcomm.reference.rounding.mix64`` (SplitMix64's finaliser) of the 64-bit values whose
    low and high uint32 words are ``lo`` and ``hi`` (arrays of one shape), as (low, high) words."""
    lo, hi = _add64(jnp.asarray(lo, _U32), jnp.asarray(hi, _U32), 0x9E3779B97F4A7C15)
    lo, hi = _mul64(*_xor_shr64(lo, hi, 30), 0xBF58476D1CE4E5B9)
    lo, hi = _mul64(*_xor_shr64(lo, hi, 27), 0x94D049BB133111EB)
    return _xor_shr64(lo, hi, 31)


def call_key_words(seed: Any, parties: Any) -> jax.Array:
    """uint32[len(parties), 2]: the Philox key words (low, high) of ``call_key(seed, party)``
    (stage 0) for every party, ``seed`` a traced or concrete value: an unsigned or signed
    integer scalar (taken modulo 2**32: a seed below 2**32) or ``uint32[2]`` words (low, high)
    of a 64-bit seed. ``parties``: Python ints (the devices' indices)."""
    s = jnp.asarray(seed)
    if s.shape == (2,):
        lo, hi = s[0].astype(_U32), s[1].astype(_U32)
    else:
        lo, hi = s.astype(_U32), _U32(0)
    slo, shi = mix64_words(lo, hi)
    party = np.array([key_words(mix64((int(q) & 0xFFFFFFFF) << 32)) for q in parties], np.uint32).reshape(-1, 2)
    klo, khi = mix64_words(slo ^ jnp.asarray(party[:, 0]), shi ^ jnp.asarray(party[:, 1]))
    return jnp.stack([klo, khi], axis=1)


def divisor(c: float, like: jax.Array) -> jax.Array:
    """The float32 constant ``c`` as an array of ``like``'s shape hidden from XLA's simplifier,
    which turns a division by a broadcast scalar into a multiply by its reciprocal (not
    correctly rounded): the reference divides."""
    return jax.lax.optimization_barrier(jnp.full(like.shape, c, jnp.float32))


def _exact(product: jax.Array) -> jax.Array:
    """``product`` (a multiply's result) behind an element-wise integer select, so that the
    compiler cannot contract the multiply with an add that uses it into one fused multiply-add
    (rounded once, not twice as the reference does): XLA:CPU does, and removes optimisation
    barriers before code generation. The select is an identity in practice: it swaps the NaN
    pattern 0xFFFFFFFF, which no decode produces, for another NaN."""
    bits = jax.lax.bitcast_convert_type(product, _U32)
    bits = jnp.where(bits == _U32(0xFFFFFFFF), _U32(0x7FC00001), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _mulhilo(a: int, b: Any) -> tuple[Any, Any]:
    """(high, low) 32-bit words of the 64-bit product of the constant ``a`` and uint32 ``b``."""
    lo = b * _U32(a)
    a0, a1 = a & 0xFFFF, a >> 16
    b0, b1 = b & _U32(0xFFFF), b >> _U32(16)
    p00, p01, p10, p11 = b0 * _U32(a0), b1 * _U32(a0), b0 * _U32(a1), b1 * _U32(a1)
    mid = (p00 >> _U32(16)) + (p01 & _U32(0xFFFF)) + (p10 & _U32(0xFFFF))
    hi = p11 + (p01 >> _U32(16)) + (p10 >> _U32(16)) + (mid >> _U32(16))
    return hi, lo


def philox_bits(key: Any, offset: Any, n: int) -> jax.Array:
    """uint32[n]: word 0 of Philox4x32-10 with key (k0, k1) = ``key`` and counter
    (offset + i, 0, 0, 0): giftcomm.reference.codec.philox_bits for indices below 2**32."""
    k = jnp.asarray(key, _U32)
    k0, k1 = k[0], k[1]
    c0 = jnp.arange(n, dtype=_U32) + jnp.asarray(offset, _U32)
    c1 = jnp.zeros_like(c0)
    c2 = jnp.zeros_like(c0)
    c3 = jnp.zeros_like(c0)
    for _ in range(10):
        h0, l0 = _mulhilo(0xD2511F53, c0)
        h1, l1 = _mulhilo(0xCD9E8D57, c2)
        c0, c1, c2, c3 = h1 ^ c1 ^ k0, l1, h0 ^ c3 ^ k1, l0
        k0 = k0 + _U32(0x9E3779B9)
        k1 = k1 + _U32(0xBB67AE85)
    return c0


def _round_elements(y: jax.Array, elem: str, rbits: jax.Array | None) -> jax.Array:
    """uint8 codes of clipped finite float32 ``y`` (reference ``round_elements``, in int32/uint32)."""
    mant, emin, bits = element_facts(np.dtype(elem))  # (mantissa bits, smallest normal exponent, bits)
    u = jax.lax.bitcast_convert_type(y.astype(jnp.float32), _U32)
    a = (u & _U32(0x7FFFFFFF)).astype(jnp.int32)
    ef = a >> 23
    sig = jnp.where(ef > 0, (a & 0x7FFFFF) | 0x800000, a)
    e = jnp.maximum(ef, 1) - 127
    d = 23 - mant + jnp.maximum(emin - e, 0)
    hi = sig >> jnp.minimum(d, 31)
    sl = jnp.where(d <= 32, 32 - d, 0)
    sr = jnp.where(d > 32, jnp.minimum(d - 32, 31), 0)
    sigu = sig.astype(_U32)
    lo = jnp.where(sl >= 32, _U32(0), sigu << jnp.minimum(sl, 31).astype(_U32)) >> sr.astype(_U32)
    if rbits is None:
        up = (lo > _U32(0x80000000)) | ((lo == _U32(0x80000000)) & ((hi & 1) == 1))
    else:
        up = (lo + rbits) < lo  # lo + bits >= 2**32: the 32-bit sum wraps
    code = hi + up.astype(jnp.int32) + (jnp.maximum(e - emin, 0) << mant)
    sign = (u >> _U32(31)).astype(jnp.int32) << (bits - 1)
    return (code | sign).astype(jnp.uint8)


@functools.lru_cache(maxsize=None)
def _value_table(dtype_name: str) -> np.ndarray:
    """float32[256]: the value of every code of an element (or E8M0 scale) format."""
    dt = np.dtype(getattr(ml_dtypes, dtype_name))
    codes = np.arange(256, dtype=np.uint8)
    if dt.itemsize == 1 and dtype_name != "float4_e2m1fn":
        return codes.view(dt).astype(np.float32)
    return (codes & 0xF).astype(np.uint8).view(dt).astype(np.float32)


def _values(codes: jax.Array, dtype_name: str) -> jax.Array:
    return jnp.asarray(_value_table(dtype_name))[codes.astype(jnp.int32)]


def _amax_bits(x: jax.Array, block: int, nb: int) -> jax.Array:
    a = jax.lax.bitcast_convert_type(x, _U32) & _U32(0x7FFFFFFF)
    a = jnp.pad(a, (0, nb * block - x.size))
    return a.reshape(nb, block).max(axis=1)


def _per_value(v: jax.Array, block: int, n: int) -> jax.Array:
    return jnp.repeat(v, block, total_repeat_length=v.size * block)[:n]


def _pack4(codes: jax.Array) -> jax.Array:
    c = codes & jnp.uint8(0xF)
    if c.size % 2:
        c = jnp.pad(c, (0, 1))
    return c[0::2] | (c[1::2] << jnp.uint8(4))


def _unpack4(payload: jax.Array, count: int) -> jax.Array:
    return jnp.stack([payload & jnp.uint8(0xF), payload >> jnp.uint8(4)], axis=1).reshape(-1)[:count]


def _bytes(v: jax.Array) -> jax.Array:
    """The little-endian bytes of a float32 / 16-bit vector (uint8)."""
    if v.dtype.itemsize == 1:
        return v.reshape(-1)
    return jax.lax.bitcast_convert_type(v, jnp.uint8).reshape(-1)


def _pad_to(parts: list[jax.Array], size: int) -> jax.Array:
    msg = jnp.concatenate([p.reshape(-1) for p in parts]) if parts else jnp.zeros(0, jnp.uint8)
    return jnp.pad(msg, (0, size - msg.size))


def _encode_f32(x, f, block, rbits):
    n = x.size
    nb = num_blocks(n, block)
    amax = jnp.pad(jnp.abs(x), (0, nb * block - n)).reshape(nb, block).max(axis=1)
    finite = jnp.isfinite(amax)
    fmax = jnp.float32(f.max_value)
    regular = finite & (amax >= f.tiny_amax)
    safe = jnp.where(regular, amax, fmax)
    scale = jnp.where(regular, safe / divisor(f.max_value, safe), jnp.float32(1))
    inv = jnp.where(regular, fmax / safe, jnp.float32(1))
    scale = jnp.where(finite, scale, jnp.float32(jnp.nan))
    bad = _per_value(~finite, block, n)
    y = jnp.clip(x * _per_value(inv, block, n), -fmax, fmax)
    y = jnp.where(bad, jnp.float32(0), y)
    codes = jnp.where(bad, jnp.uint8(f.nan_code), _round_elements(y, f.wire_dtype.name, rbits))
    return _pad_to([codes], scales_offset(n, f)), _bytes(scale)


def _e8m0_codes(m: jax.Array, f: Format) -> jax.Array:
    e = (m >> _U32(23)).astype(jnp.int32)
    if f.scale_rule == "ceil":
        max_mant = int(np.float32(f.max_value).view(np.uint32)) & 0x7FFFFF
        e = e + (((m & _U32(0x7FFFFF)) > _U32(max_mant)) & (m < _U32(0x7F000000))).astype(jnp.int32)
    return jnp.maximum(e - f.emax, 0)


def _encode_mx(x, f, block, rbits):
    n = x.size
    nb = num_blocks(n, block)
    m = _amax_bits(x, block, nb)
    finite = m < _U32(0x7F800000)
    code = _e8m0_codes(m, f)
    mult = jax.lax.bitcast_convert_type(((254 - jnp.where(finite, code, 0)) << 23).astype(_U32), jnp.float32)
    bad = _per_value(~finite, block, n)
    xs = jnp.where(bad, jnp.float32(0), x)
    fmax = jnp.float32(f.max_value)
    y = jnp.clip(xs * _per_value(mult, block, n), -fmax, fmax)
    codes = jnp.where(bad, jnp.uint8(f.nan_code), _round_elements(y, f.wire_dtype.name, rbits))
    payload = _pack4(codes) if f.packed else codes
    return payload, jnp.where(finite, code, 0xFF).astype(jnp.uint8)


def _encode_nvfp4(x, f, block, rbits):
    n = x.size
    nb, ng = num_blocks(n, block), num_groups(n)
    per = NVFP4_GROUP // block
    m = _amax_bits(x, block, nb)
    finite = m < _U32(0x7F800000)
    mf = jnp.where(finite, m, _U32(0))
    g = jax.lax.bitcast_convert_type(jnp.pad(mf, (0, ng * per - nb)).reshape(ng, per).max(axis=1), jnp.float32)
    tiny = g < NVFP4_TINY
    gsafe = jnp.where(tiny, jnp.float32(1), g)
    s2 = jnp.where(tiny, jnp.float32(1), gsafe / divisor(2688, gsafe))
    q2 = jnp.where(tiny, jnp.float32(0), jnp.float32(448) / gsafe)
    grp = np.arange(nb) // per
    amax = jax.lax.bitcast_convert_type(mf, jnp.float32)
    t = jnp.minimum(amax * q2[grp], jnp.float32(448))
    bs = _round_elements(t, "float8_e4m3fn", None)
    bs = bs + (_values(bs, "float8_e4m3fn") < t).astype(jnp.uint8)
    bs = jnp.where((amax > 0) & ~tiny[grp], jnp.maximum(bs, jnp.uint8(1)), jnp.uint8(0))
    d = _values(bs, "float8_e4m3fn") * s2[grp]
    r = jnp.where(bs > 0, jnp.float32(1) / jnp.where(bs > 0, d, jnp.float32(1)), jnp.float32(0))
    bs = jnp.where(finite, bs, jnp.uint8(0x7F))
    bad = _per_value(~finite, block, n)
    xs = jnp.where(bad, jnp.float32(0), x)
    y = jnp.clip(xs * _per_value(r, block, n), jnp.float32(-6), jnp.float32(6))
    codes = jnp.where(bad, jnp.uint8(0), _round_elements(y, "float4_e2m1fn", rbits))
    head = _pad_to([_pack4(codes), bs], group_scales_offset(n, f) - 0)
    return head, _bytes(s2)


def padded_nbytes(n: int, f: Format, block: int | None = None) -> int:
    """Bytes of :func:`encode`'s output for n values of format ``f`` when ``valid`` is given: the
    largest message of any prefix of them (``message_nbytes(n, ...)`` for every row but the
    adaptive ones, whose message bytes need not grow with the count)."""
    block = resolve_block(f, block)
    return message_nbytes(n, f, block) if f.adaptive is None else f.adaptive.max_message_nbytes(n, block)


def _adaptive_encode(x: jax.Array, f: Format, block: int, rbits: jax.Array | None, valid: Any) -> jax.Array:
    """An adaptive row's message of ``x[:valid]`` (``valid`` None: all of x), zero-filled to
    ``padded_nbytes(x.size)`` bytes when valid is given: the NumPy reference
    (giftcomm.reference.adaptive) through a host callback, fed the Philox bits computed here."""
    n = x.size
    nbytes = message_nbytes(n, f, block) if valid is None else padded_nbytes(n, f, block)

    def host(values: np.ndarray, valid_arr: np.ndarray, *bits: np.ndarray) -> np.ndarray:
        m = int(valid_arr)
        if not 0 <= m <= n:
            raise ValueError(f"{f.name}: {m} valid values of a chunk of {n}")
        msg = np.zeros(nbytes, np.uint8)
        _adaptive.encode(np.asarray(values, np.float32)[:m], f, block, msg, np.asarray(bits[0])[:m] if bits else None)
        return msg

    m = jnp.int32(n) if valid is None else jnp.asarray(valid, jnp.int32)
    args = (x, m) if rbits is None else (x, m, rbits)
    return jax.pure_callback(host, jax.ShapeDtypeStruct((nbytes,), jnp.uint8), *args)


def _adaptive_decode(message: jax.Array, count: int, f: Format, block: int, valid: Any) -> jax.Array:
    """An adaptive row's values of a message of ``valid`` values (None: ``count``), zero-filled
    to ``count``: the NumPy reference through a host callback."""
    def host(msg: np.ndarray, valid_arr: np.ndarray) -> np.ndarray:
        m = int(valid_arr)
        if not 0 <= m <= count:
            raise ValueError(f"{f.name}: {m} valid values of a chunk of {count}")
        out = np.zeros(count, np.float32)
        msg = np.asarray(msg, np.uint8)
        out[:m] = _adaptive.decode(msg[: message_nbytes(m, f, block)], m, f, block)
        return out

    m = jnp.int32(count) if valid is None else jnp.asarray(valid, jnp.int32)
    return jax.pure_callback(host, jax.ShapeDtypeStruct((count,), jnp.float32), message, m)


def encode(x: jax.Array, fmt: str | Format = "e4m3", block: int | None = None, *, rounding: str = "nearest",
           key: Any = (0, 0), offset: Any = 0, valid: Any = None) -> jax.Array:
    """The wire message (uint8[message_nbytes(x.size, fmt, block)]) of a float32 vector ``x``.

    ``key``: the Philox key as two uint32 words (``key_words(k)`` or a traced uint32[2]);
    ``offset``: the index of x[0] (int or traced uint32). Equal to the reference's bytes.
    ``valid``: None, or the (int or traced) count of leading values of x that are the message,
    the rest zero padding (the jit path's padded chunks): then uint8[padded_nbytes(x.size)]
    holding the message of ``x[:valid]`` (decode it with the same ``valid``). Every row but the
    adaptive ones encodes the padding as zero blocks, which decode to zeros and leave the
    leading values' decoding as is; an adaptive row's tiers depend on the count (its frames'
    budgets), so its message is that of ``x[:valid]`` alone."""
    f = get_format(fmt)
    block = resolve_block(f, block)
    x = jnp.asarray(x, jnp.float32).reshape(-1)
    n = x.size
    if not f.scaled:
        return _bytes(x.astype(PASS_DTYPES[f.name]))
    rbits = None if rounding == "nearest" else philox_bits(key, offset, n)
    if f.adaptive is not None:
        return _adaptive_encode(x, f, block, rbits, valid)
    if f.scale_kind == "f32":
        head, tail = _encode_f32(x, f, block, rbits)
    elif f.scale_kind == "e8m0":
        head, tail = _encode_mx(x, f, block, rbits)
    else:
        head, tail = _encode_nvfp4(x, f, block, rbits)
    msg = jnp.concatenate([head, tail])
    assert msg.size == message_nbytes(n, f, block), (f.name, n, msg.size)
    return msg


def decode(message: jax.Array, count: int, fmt: str | Format = "e4m3", block: int | None = None,
           valid: Any = None) -> jax.Array:
    """float32[count]: the values of one wire message (reference ``decode``, bit for bit).
    ``valid``: as for :func:`encode` (the message of the first ``valid`` values; the rest 0)."""
    f = get_format(fmt)
    block = resolve_block(f, block)
    message = message.reshape(-1)
    if not f.scaled:
        dt = PASS_DTYPES[f.name]
        width = jnp.dtype(dt).itemsize
        v = message[: count * width]
        v = v if width == 1 else jax.lax.bitcast_convert_type(v.reshape(count, width), dt)
        return v.astype(jnp.float32)
    if f.adaptive is not None:
        return _adaptive_decode(message, count, f, block, valid)
    nb = num_blocks(count, block)
    off = scales_offset(count, f)
    if f.packed:
        values = _values(_unpack4(message[: payload_nbytes(count, f)], count), "float4_e2m1fn")
    else:
        values = _values(message[:count], f.wire_dtype.name)
    if f.scale_kind == "f32":
        scales = jax.lax.bitcast_convert_type(message[off : off + 4 * nb].reshape(nb, 4), jnp.float32)
        return _exact(values * _per_value(scales, block, count))
    sc = message[off : off + nb]
    if f.scale_kind == "e8m0":
        s = _values(sc, "float8_e8m0fnu")
        bad = sc == 0xFF
    else:
        goff = group_scales_offset(count, f, block)
        s2 = jax.lax.bitcast_convert_type(message[goff : goff + 4 * num_groups(count)].reshape(-1, 4), jnp.float32)
        s = _values(sc, "float8_e4m3fn") * s2[np.arange(nb) // (NVFP4_GROUP // block)]
        bad = (sc & 0x7F) == 0x7F
    values = _exact(values * _per_value(s, block, count))
    return jnp.where(_per_value(bad, block, count), jnp.float32(jnp.nan), values)


def decode_add_encode(message: jax.Array, local: jax.Array, fmt: str | Format = "e4m3", block: int | None = None, *,
                      rounding: str = "nearest", key: Any = (0, 0), offset: Any = 0) -> jax.Array:
    """One ring hop: ``encode(decode(message) + local)``, the sum in float32."""
    local = jnp.asarray(local, jnp.float32).reshape(-1)
    return encode(decode(message, local.size, fmt, block) + local, fmt, block, rounding=rounding, key=key,
                  offset=offset)
