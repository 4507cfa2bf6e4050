"""The FP8 block codec: encode, decode, and the fused hops of the ring.

Definitions live in :mod:`giftcomm.reference.codec` (plain NumPy, the ground truth). This module
runs the same operations through the native C kernels (``giftcomm._codec_native``, built by
``pip install``) when they are present, and through the reference otherwise (with a warning,
once). Both give bit-identical bytes.

All functions take 1-D float32 vectors and uint8 wire messages (see docs/wire-format.md).
"""
from __future__ import annotations

import os
import warnings

import numpy as np

from .formats import DEFAULT_BLOCK, Format, check_block, get_format, message_nbytes
from .reference import codec as _ref

try:  # the extension is optional: a missing compiler must not break the package
    from . import _codec_native as _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised only on a broken install
    _native = None

__all__ = ["encode", "decode", "decode_add_encode", "decode_accumulate", "native_available", "message_nbytes"]

_warned = False


def native_available() -> bool:
    """True when the native C kernels are loaded (and not disabled by GIFTCOMM_NATIVE=0)."""
    return _native is not None and os.environ.get("GIFTCOMM_NATIVE", "1") != "0"


def _use_native() -> bool:
    global _warned
    if native_available():
        return True
    if _native is None and not _warned:
        _warned = True
        warnings.warn(
            "giftcomm: native codec extension not built; using the NumPy reference codec (slow). "
            "Reinstall with a C compiler available: pip install -e .",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def _as_f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)


def _message_out(out: np.ndarray | None, nbytes: int) -> np.ndarray:
    if out is None:
        return np.empty(nbytes, np.uint8)
    if out.dtype != np.uint8 or out.size != nbytes or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous uint8 array of {nbytes} bytes")
    return out


def _check_message(message: np.ndarray, count: int, f: Format, block: int) -> np.ndarray:
    message = np.ascontiguousarray(message).reshape(-1).view(np.uint8)
    nbytes = message_nbytes(count, f, block)
    if message.size != nbytes:
        raise ValueError(f"a {f.name} message of {count} values has {nbytes} bytes, got {message.size}")
    return message


def encode(
    x: np.ndarray, fmt: str | Format = "e4m3", block: int = DEFAULT_BLOCK, out: np.ndarray | None = None
) -> np.ndarray:
    """Encode float32 values (any shape, read flat) into one wire message (uint8, 1-D).

    Values of other float dtypes are first cast to float32.
    """
    f, block = get_format(fmt), check_block(block)
    x = _as_f32(x)
    msg = _message_out(out, message_nbytes(x.size, f, block))
    if _use_native():
        _native.encode(x, msg, f.code, block)
        return msg
    return _ref.encode(x, f, block, out=msg)


def decode(
    message: np.ndarray, count: int, fmt: str | Format = "e4m3", block: int = DEFAULT_BLOCK,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Decode one wire message of ``count`` values into a float32 vector (``out`` if given)."""
    f, block = get_format(fmt), check_block(block)
    message = _check_message(message, count, f, block)
    if out is not None and (out.dtype != np.float32 or out.size != count or not out.flags.c_contiguous):
        raise ValueError(f"out must be a contiguous float32 array of {count} values")
    if _use_native():
        res = np.empty(count, np.float32) if out is None else out
        _native.decode(message, res, f.code, block)
        return res
    values = _ref.decode(message, count, f, block)
    if out is None:
        return values
    out[...] = values
    return out


def decode_add_encode(
    message: np.ndarray, local: np.ndarray, fmt: str | Format = "e4m3", block: int = DEFAULT_BLOCK,
    out: np.ndarray | None = None, sum_out: np.ndarray | None = None,
) -> np.ndarray:
    """One ring hop: ``encode(decode(message) + local)`` with the sum in float32.

    ``local``: float32 vector of the message's count. ``sum_out``: optional float32 vector that
    receives the float32 sum itself (the owner keeps it after the last hop).
    """
    f, block = get_format(fmt), check_block(block)
    local = _as_f32(local)
    message = _check_message(message, local.size, f, block)
    msg = _message_out(out, message_nbytes(local.size, f, block))
    if _use_native():
        _native.decode_add_encode(message, local, msg, sum_out, f.code, block)
        return msg
    with np.errstate(invalid="ignore", over="ignore"):
        total = _ref.decode(message, local.size, f, block) + local
    if sum_out is not None:
        sum_out[...] = total
    return _ref.encode(total, f, block, out=msg)


def decode_accumulate(
    message: np.ndarray, acc: np.ndarray, fmt: str | Format = "e4m3", block: int = DEFAULT_BLOCK
) -> np.ndarray:
    """``acc += decode(message)`` in place; ``acc`` is a contiguous float32 vector."""
    f, block = get_format(fmt), check_block(block)
    if acc.dtype != np.float32 or not acc.flags.c_contiguous:
        raise ValueError("acc must be a contiguous float32 array")
    message = _check_message(message, acc.size, f, block)
    if _use_native():
        _native.decode_accumulate(message, acc.reshape(-1), f.code, block)
        return acc
    with np.errstate(invalid="ignore", over="ignore"):
        acc += _ref.decode(message, acc.size, f, block).reshape(acc.shape)
    return acc
