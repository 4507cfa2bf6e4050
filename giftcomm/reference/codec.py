"""Plain NumPy reference codec: the ground truth every fast path must equal bit for bit.

Definitions (for block-scaled FP8 formats; ``max`` is the format's largest finite value):

- A message covers ``count`` float32 values split into blocks of ``block`` elements (the last
  block may be partial).
- Per block, ``amax = max |x|`` in float32.
    - amax is NaN or Inf: the block is *non-finite*: scale = NaN, every code = ``nan_code``;
      it decodes to all NaN.
    - amax < ``tiny_amax`` (includes all-zero blocks): scale = 1, inv = 1.
    - otherwise: scale = fp32(amax / max), inv = fp32(max / amax).
- Each code is ``float8(clip(fp32(x * inv), -max, max))``: round to nearest even, saturating
  (the cast is ml_dtypes' float32 -> float8 cast).
- Decode: ``fp32(float32(code) * scale)``.
- Fused hop: ``encode(fp32(decode(message) + local))``.

Pass-through formats (bf16, fp16, fp32): encode is the float32 -> format cast (round to nearest
even; fp16 overflows to Inf like any IEEE cast), decode is the exact cast back to float32.
"""
from __future__ import annotations

import numpy as np

from ..formats import Format, check_block, get_format, message_nbytes, num_blocks, scales_offset

__all__ = ["encode", "decode", "decode_add_encode", "block_scales", "split_message"]


def split_message(message: np.ndarray, count: int, fmt: Format) -> tuple[np.ndarray, np.ndarray | None]:
    """Views of a message's payload (wire dtype, ``count``) and scales (float32) or None."""
    payload = message[: count * fmt.itemsize].view(fmt.wire_dtype)
    if not fmt.scaled:
        return payload, None
    off = scales_offset(count, fmt)
    return payload, message[off:].view(np.float32)


def block_scales(x: np.ndarray, fmt: Format, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-block (scale, inv, finite) for a float32 vector: float32, float32, bool arrays."""
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


def encode(x: np.ndarray, fmt: str | Format = "e4m3", block: int = 256, out: np.ndarray | None = None) -> np.ndarray:
    """Encode a 1-D float32 vector into one wire message (uint8, ``message_nbytes`` long)."""
    f = get_format(fmt)
    block = check_block(block)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    n = x.size
    nbytes = message_nbytes(n, f, block)
    msg = np.zeros(nbytes, np.uint8) if out is None else out
    if msg.dtype != np.uint8 or msg.size != nbytes:
        raise ValueError(f"out must be uint8 of {nbytes} bytes")
    payload, scales = split_message(msg, n, f)
    if not f.scaled:
        payload[...] = x.astype(f.wire_dtype)
        return msg
    if f.itemsize * n < scales_offset(n, f):
        msg[f.itemsize * n : scales_offset(n, f)] = 0
    scale, inv, finite = block_scales(x, f, block)
    fmax = np.float32(f.max_value)
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = x * np.repeat(inv, block)[:n]
        codes = np.clip(scaled, -fmax, fmax).astype(f.wire_dtype).view(np.uint8)
    bad = np.repeat(~finite, block)[:n]
    codes[bad] = f.nan_code
    payload.view(np.uint8)[...] = codes
    scales[...] = scale
    return msg


def decode(message: np.ndarray, count: int, fmt: str | Format = "e4m3", block: int = 256) -> np.ndarray:
    """Decode one wire message of ``count`` values into a new float32 vector."""
    f = get_format(fmt)
    block = check_block(block)
    message = np.asarray(message).reshape(-1).view(np.uint8)
    nbytes = message_nbytes(count, f, block)
    if message.size != nbytes:
        raise ValueError(f"a {f.name} message of {count} values has {nbytes} bytes, got {message.size}")
    payload, scales = split_message(message, count, f)
    values = payload.astype(np.float32)
    if f.scaled:
        with np.errstate(invalid="ignore", over="ignore"):
            values *= np.repeat(scales, block)[:count]
    return values


def decode_add_encode(
    message: np.ndarray, local: np.ndarray, fmt: str | Format = "e4m3", block: int = 256, out: np.ndarray | None = None
) -> np.ndarray:
    """One ring hop: ``encode(decode(message) + local)``, the sum in float32."""
    local = np.asarray(local, dtype=np.float32).reshape(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        total = decode(message, local.size, fmt, block) + local
    return encode(total, fmt, block, out=out)
