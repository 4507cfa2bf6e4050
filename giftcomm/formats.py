"""Wire formats: the table of formats and the size of one wire message.

A *format* says how a float32 value travels on the wire:

- ``e4m3``: OCP FP8 E4M3 (``float8_e4m3fn``: max 448, no Inf, NaN code 0x7F), block-scaled.
- ``e5m2``: OCP FP8 E5M2 (``float8_e5m2``: max 57344), block-scaled.
- ``bf16``, ``fp16``, ``fp32``: pass-through formats, raw values on the wire, no scales. They
  exist so that baselines run through the same collective code.

One wire message for ``count`` values (see docs/wire-format.md)::

    block-scaled:  [payload: count bytes][pad to 4 bytes][scales: ceil(count/block) float32 LE]
    pass-through:  [payload: count * itemsize bytes]
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import ml_dtypes
import numpy as np

DEFAULT_BLOCK = 256
MAX_BLOCK = 1 << 20


@dataclass(frozen=True)
class Format:
    """One wire format.

    name: public name (``"e4m3"``...). code: small integer used in cross-rank signatures.
    wire_dtype: NumPy dtype of one payload element. scaled: True for block-scaled FP8.
    max_value: largest finite magnitude (FP8 only; used as the scale target).
    nan_code: the byte written for every element of a non-finite block (FP8 only).
    """

    name: str
    code: int
    wire_dtype: np.dtype
    scaled: bool
    max_value: float = 0.0
    nan_code: int = 0

    @property
    def itemsize(self) -> int:
        return self.wire_dtype.itemsize

    @property
    def tiny_amax(self) -> np.float32:
        """Block amax below which a block is encoded with scale 1 (flushes to signed zero).

        ``max_value * 2**-126``: the smallest amax for which both ``amax / max`` and
        ``max / amax`` are normal, finite float32 numbers.
        """
        return np.float32(self.max_value) * np.float32(2.0**-126)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("e4m3", 1, np.dtype(ml_dtypes.float8_e4m3fn), True, 448.0, 0x7F),
        Format("e5m2", 2, np.dtype(ml_dtypes.float8_e5m2), True, 57344.0, 0x7F),
        Format("bf16", 3, np.dtype(ml_dtypes.bfloat16), False),
        Format("fp16", 4, np.dtype(np.float16), False),
        Format("fp32", 5, np.dtype(np.float32), False),
    )
}


def get_format(fmt: str | Format) -> Format:
    """Look a format up by name; raise ValueError naming the known ones."""
    if isinstance(fmt, Format):
        return fmt
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unknown format {fmt!r}; known formats: {', '.join(FORMATS)}") from None


def check_block(block: int) -> int:
    """Validate a block size (elements per scale): an int in [1, 2**20]."""
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
        raise ValueError(f"block must be an int, got {block!r}")
    if not 1 <= block <= MAX_BLOCK:
        raise ValueError(f"block must be between 1 and {MAX_BLOCK}, got {block}")
    return int(block)


def num_blocks(count: int, block: int) -> int:
    """Number of scale blocks for ``count`` values (the last one may be partial)."""
    return -(-count // block)


def payload_nbytes(count: int, fmt: str | Format) -> int:
    """Bytes of the payload part of a message, before any padding."""
    return count * get_format(fmt).itemsize


def scales_offset(count: int, fmt: str | Format) -> int:
    """Byte offset of the scales in a block-scaled message (payload padded to 4 bytes)."""
    return -(-payload_nbytes(count, fmt) // 4) * 4


def message_nbytes(count: int, fmt: str | Format = "e4m3", block: int = DEFAULT_BLOCK) -> int:
    """Exact size in bytes of one wire message carrying ``count`` values."""
    try:
        return _message_nbytes(count, fmt, block)
    except TypeError:  # an unhashable argument: let the checks name it if it is fmt or block
        get_format(fmt)
        check_block(block)
        raise


@functools.lru_cache(maxsize=4096)
def _message_nbytes(count: int, fmt: str | Format, block: int) -> int:
    # cached: every codec call asks, with the few sizes a training loop repeats
    f = get_format(fmt)
    if not f.scaled:
        return payload_nbytes(count, f)
    return scales_offset(count, f) + 4 * num_blocks(count, check_block(block))


def bytes_per_value(fmt: str | Format = "e4m3", block: int = DEFAULT_BLOCK) -> float:
    """Asymptotic wire bytes per value: itemsize plus the scale overhead (4 bytes per block)."""
    f = get_format(fmt)
    return f.itemsize + (4.0 / check_block(block) if f.scaled else 0.0)
