"""The wire codec: encode, decode, and the fused hops of the ring, on any array backend.

Two layers:

- the public functions here (:func:`encode`, :func:`decode`, :func:`decode_add_encode`,
  :func:`decode_accumulate`) check their arguments (format, block, dtypes, sizes, backends) and
  run the kernels of the input's backend;
- :func:`kernels_for` gives a backend's *trusted* kernels, which check nothing: the collectives
  validate a call once and then run the per-slice hot loop on them. Host arrays get the native C
  kernels (``giftcomm._codec_native``, built by ``pip install``) or, without them, the NumPy
  reference (with a warning, once); CuPy arrays get the CUDA kernels (giftcomm.cuda.codec).
  Per format: a format of the table that the native build (native_formats) or the CUDA kernels
  (giftcomm.cuda.codec.supports) do not implement runs on the NumPy reference, logged once per
  format, so a new format can land in Python first (docs/native.md).

Every backend equals :mod:`giftcomm.reference.codec` bit for bit. Values are 1-D float32 vectors;
messages are 1-D uint8 arrays of ``message_nbytes(count, fmt, block)`` bytes
(docs/wire-format.md). ``block=None`` means the format's own block (16 nvfp4, 32 for the MX
formats, 256 otherwise); a fixed-block format given another block raises ValueError.

Rounding: ``rounding="nearest"`` (default) or ``"stochastic"`` for every block-scaled format, with
a 64-bit ``key`` and the element index ``offset + i`` of value i of the message as the counter of
Philox4x32-10 (docs/wire-format.md). The trusted kernels take ``key=None`` for nearest.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Protocol

import numpy as np

from . import config
from ._xp import array_module, data_pointer
from .formats import (
    FORMATS,
    SCALE_RULE_SHIFT,
    Format,
    check_key,
    check_offset,
    check_rounding,
    get_format,
    message_nbytes,
    resolve_block,
)
from .reference import codec as _ref


def _load_native() -> Any:
    """The C extension (types: giftcomm/_codec_native.pyi), or None: it is optional, a missing
    compiler must not break the package. Typed Any: NativeKernels calls it only where
    native_supports says it is there."""
    try:
        from . import _codec_native
    except ImportError:  # pragma: no cover - exercised only on a broken install
        return None
    return _codec_native


_native = _load_native()

__all__ = ["encode", "decode", "decode_add_encode", "decode_accumulate", "native_available", "native_formats",
           "native_supports", "native_code", "message_nbytes", "Kernels", "kernels_for", "native_variant", "native_variants",
           "use_native_variant"]


class Kernels(Protocol):
    """One backend's trusted codec kernels. Arguments are already checked: 1-D contiguous arrays
    of the backend, float32 values, uint8 messages and outputs of the right sizes, the block
    resolved (resolve_block). ``key``: None (round to nearest even) or the stochastic-rounding
    key, an int in [0, 2**64), with ``offset`` the element index of value 0 of the message."""

    name: str

    def encode(self, x: Any, f: Format, block: int, out: Any, key: int | None = None, offset: int = 0) -> Any: ...
    def decode(self, message: Any, count: int, f: Format, block: int, out: Any) -> Any: ...
    def decode_add_encode(self, message: Any, local: Any, f: Format, block: int, out: Any,
                          sum_out: Any, key: int | None = None, offset: int = 0) -> Any: ...
    def decode_accumulate(self, message: Any, acc: Any, f: Format, block: int) -> Any: ...


#: id(f) -> (f, whether the native kernels run f, the code they take for it: native_code): one
#: entry per Format object seen (the table's rows and their interned scale-rule variants); keyed by
#: identity, the per-call check is one lookup
_native_support: dict[int, tuple[Format, bool, int]] = {}


def native_formats() -> frozenset[str]:
    """Names of the formats the native C kernels implement in this build, with the facts of this
    table (giftcomm.formats_header.format_facts as compiled; a stale build's changed row is left
    out). Empty without the extension. The others run on the NumPy reference (native_supports)."""
    from .formats_header import format_facts  # here: `python -m giftcomm.formats_header` imports giftcomm

    if _native is None:
        return frozenset()
    compiled = _native._formats()
    return frozenset(name for name, f in FORMATS.items() if f.native and compiled.get(name) == format_facts(f))


def native_supports(f: Format) -> bool:
    """Whether the native kernels run format ``f`` (any scale rule): a row declared native
    (Format.native) whose facts this build compiled; when not, the host kernels run it on the
    reference, logging that once per format."""
    hit = _native_support.get(id(f))
    if hit is not None:
        return hit[1]
    from .formats_header import format_facts

    ok = f.native and _native is not None and _native._formats().get(f.name) == format_facts(f)
    code = f.variant_code
    if ok and f.adaptive is not None:
        code, ok = _adaptive_code(f)
    if len(_native_support) < 1024:  # bounded: Format objects made outside the table are few
        _native_support[id(f)] = (f, ok, code)
    if not ok and _native is not None and f.name not in _native_logged:
        _native_logged.add(f.name)
        logging.getLogger("giftcomm").warning(
            "giftcomm: format %s is not native %s; running it on the NumPy reference codec (slow)", f.name,
            "in this build of giftcomm._codec_native" if f.native else "(a reference-only row: Format.native is False)")
    return ok


_native_logged: set[str] = set()


def _adaptive_code(f: Format) -> tuple[int, bool]:
    """An adaptive row's native code: its spec (giftcomm.adaptive.AdaptiveSpec) registered with the
    C kernels, whose slot rides in the scale-rule bits of the code; (variant_code, False) when the
    kernels refuse the spec (it then runs on the reference)."""
    spec = f.adaptive
    assert spec is not None and f.fixed_block is not None  # an adaptive row: its super-block is its fixed block
    try:
        slot = _native._adaptive_slot(spec.budget_mbits, spec.frame, spec.share8_permille, spec.top, spec.mid,
                                      f.fixed_block)
    except ValueError:
        return f.variant_code, False
    return f.code | slot << SCALE_RULE_SHIFT, True


def native_code(f: Format) -> int:
    """The format code the native kernels take for ``f``: its variant code (Format.variant_code),
    for an adaptive row with the slot of its spec, registered with the kernels on first use (so a
    row's budget, frame, share and tiers come from its AdaptiveSpec, none compiled in). Only for a
    format the native kernels run (native_supports)."""
    hit = _native_support.get(id(f))
    if hit is None:
        native_supports(f)
        hit = _native_support.get(id(f))
    if hit is None:  # the cache is full: ask again (registering an equal spec gives the same slot)
        return _adaptive_code(f)[0] if f.adaptive is not None and _native is not None else f.variant_code
    return hit[2]


class NativeKernels:
    """The C kernels (AVX-512 / AVX2 / portable variants, chosen at import); a format they do not
    implement (native_supports) runs on the reference kernels."""

    name = "native"

    @staticmethod
    def encode(x: np.ndarray, f: Format, block: int, out: np.ndarray, key: int | None = None,
               offset: int = 0) -> np.ndarray:
        if not native_supports(f):
            return ReferenceKernels.encode(x, f, block, out, key, offset)
        _native.encode(x, out, native_code(f), block, key, offset)
        return out

    @staticmethod
    def decode(message: np.ndarray, count: int, f: Format, block: int, out: np.ndarray) -> np.ndarray:
        if not native_supports(f):
            return ReferenceKernels.decode(message, count, f, block, out)
        _native.decode(message, out, native_code(f), block)
        return out

    @staticmethod
    def decode_add_encode(message: np.ndarray, local: np.ndarray, f: Format, block: int, out: np.ndarray,
                          sum_out: np.ndarray | None, key: int | None = None, offset: int = 0) -> np.ndarray:
        if not native_supports(f):
            return ReferenceKernels.decode_add_encode(message, local, f, block, out, sum_out, key, offset)
        _native.decode_add_encode(message, local, out, sum_out, native_code(f), block, key, offset)
        return out

    @staticmethod
    def decode_accumulate(message: np.ndarray, acc: np.ndarray, f: Format, block: int) -> np.ndarray:
        if not native_supports(f):
            return ReferenceKernels.decode_accumulate(message, acc, f, block)
        _native.decode_accumulate(message, acc, native_code(f), block)
        return acc


class ReferenceKernels:
    """The NumPy reference (giftcomm.reference.codec), for hosts without the C extension."""

    name = "reference"

    @staticmethod
    def encode(x: np.ndarray, f: Format, block: int, out: np.ndarray, key: int | None = None,
               offset: int = 0) -> np.ndarray:
        return _ref.encode(x, f, block, out=out, **_ref_rounding(key, offset))

    @staticmethod
    def decode(message: np.ndarray, count: int, f: Format, block: int, out: np.ndarray) -> np.ndarray:
        out[...] = _ref.decode(message, count, f, block)
        return out

    @staticmethod
    def decode_add_encode(message: np.ndarray, local: np.ndarray, f: Format, block: int, out: np.ndarray,
                          sum_out: np.ndarray | None, key: int | None = None, offset: int = 0) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):
            total = _ref.decode(message, local.size, f, block) + local
        if sum_out is not None:
            sum_out[...] = total
        return _ref.encode(total, f, block, out=out, **_ref_rounding(key, offset))

    @staticmethod
    def decode_accumulate(message: np.ndarray, acc: np.ndarray, f: Format, block: int) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):
            acc += _ref.decode(message, acc.size, f, block)
        return acc


class DeviceFallbackKernels:
    """A CuPy backend's kernels for a format the CUDA kernels do not implement
    (giftcomm.cuda.codec.supports): the reference kernels on host copies, the results copied back
    into the device outputs (correct, slow: every call synchronizes the stream)."""

    name = "cuda-reference"

    @staticmethod
    def encode(x: Any, f: Format, block: int, out: Any, key: int | None = None, offset: int = 0) -> Any:
        out.set(ReferenceKernels.encode(x.get(), f, block, np.empty(out.size, np.uint8), key, offset))
        return out

    @staticmethod
    def decode(message: Any, count: int, f: Format, block: int, out: Any) -> Any:
        out.set(ReferenceKernels.decode(message.get(), count, f, block, np.empty(count, np.float32)))
        return out

    @staticmethod
    def decode_add_encode(message: Any, local: Any, f: Format, block: int, out: Any, sum_out: Any,
                          key: int | None = None, offset: int = 0) -> Any:
        s = None if sum_out is None else np.empty(local.size, np.float32)
        out.set(ReferenceKernels.decode_add_encode(message.get(), local.get(), f, block, np.empty(out.size, np.uint8),
                                                   s, key, offset))
        if sum_out is not None:
            sum_out.set(s)
        return out

    @staticmethod
    def decode_accumulate(message: Any, acc: Any, f: Format, block: int) -> Any:
        acc.set(ReferenceKernels.decode_accumulate(message.get(), acc.get(), f, block))
        return acc


class CudaOrFallbackKernels:
    """The CuPy backend: giftcomm.cuda.codec.CudaKernels for the formats they implement, the
    reference on host copies (DeviceFallbackKernels) for the others, logged once per format."""

    name = "cuda"

    @staticmethod
    def _for(f: Format) -> Any:
        from .cuda import codec as cuda_codec

        if cuda_codec.supports(f):
            return cuda_codec.CudaKernels
        if f.name not in _cuda_fallback_logged:
            _cuda_fallback_logged.add(f.name)
            logging.getLogger("giftcomm").warning(
                "giftcomm: format %s has no CUDA kernels; running it on the NumPy reference codec through host "
                "copies (slow)", f.name)
        return DeviceFallbackKernels

    @classmethod
    def encode(cls, x: Any, f: Format, block: int, out: Any, key: int | None = None, offset: int = 0) -> Any:
        return cls._for(f).encode(x, f, block, out, key, offset)

    @classmethod
    def decode(cls, message: Any, count: int, f: Format, block: int, out: Any) -> Any:
        return cls._for(f).decode(message, count, f, block, out)

    @classmethod
    def decode_add_encode(cls, message: Any, local: Any, f: Format, block: int, out: Any, sum_out: Any,
                          key: int | None = None, offset: int = 0) -> Any:
        return cls._for(f).decode_add_encode(message, local, f, block, out, sum_out, key, offset)

    @classmethod
    def decode_accumulate(cls, message: Any, acc: Any, f: Format, block: int) -> Any:
        return cls._for(f).decode_accumulate(message, acc, f, block)


_cuda_fallback_logged: set[str] = set()


def _ref_rounding(key: int | None, offset: int) -> dict:
    if key is None:
        return {}
    return {"rounding": "stochastic", "key": key, "offset": offset}


def _key_of(f: Format, rounding: str, key: Any, offset: Any) -> int | None:
    """The trusted kernels' key (None: nearest), after checking rounding, key and offset."""
    check_rounding(rounding, f)
    check_offset(offset)
    return check_key(key) if rounding == "stochastic" else None


_warned = False


def native_available() -> bool:
    """True when the native C kernels are loaded (and not disabled by GIFTCOMM_NATIVE=0)."""
    return _native is not None and config.flag("GIFTCOMM_NATIVE")


def native_variant() -> str | None:
    """The native kernel variant in use ("avx512vbmi", "avx512", "avx2", "generic"), None when
    the extension is not built."""
    return None if _native is None else _native._isa()


def native_variants() -> list[str]:
    """The native kernel variants this CPU can run, best first ([] without the extension)."""
    return [] if _native is None else list(_native._isas())


def use_native_variant(name: str) -> None:
    """Switch the native kernels to variant ``name`` (benchmarks and tests; all give the same
    bytes). ValueError for a variant this CPU cannot run; RuntimeError without the extension."""
    if _native is None:
        raise RuntimeError("the native codec extension is not built")
    _native._set_isa(name)


def kernels_for(xp: Any, cached: bool = False) -> Kernels:
    """The trusted kernels for arrays of backend ``xp`` (``numpy`` or ``cupy``). Reads
    GIFTCOMM_NATIVE now, or with ``cached`` (the collectives, once a call) at most once a second
    (config.cached_flag)."""
    global _warned
    if xp is not np:
        return CudaOrFallbackKernels
    if _native is not None and (config.cached_flag if cached else config.flag)("GIFTCOMM_NATIVE"):
        return NativeKernels
    if _native is None and not _warned:
        _warned = True
        msg = ("giftcomm: native codec extension not built; using the NumPy reference codec (slow). "
               "Reinstall with a C compiler available: pip install -e .")
        logging.getLogger("giftcomm").warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return ReferenceKernels


# ------------------------------------------------------------------------- argument checks
def _values(xp: Any, x: Any) -> Any:
    """``x`` as a contiguous 1-D float32 array of backend ``xp`` (a view when it already is)."""
    return xp.ascontiguousarray(xp.asarray(x), dtype=np.float32).reshape(-1)


def _same_backend(xp: Any, a: Any, name: str) -> Any:
    if a is not None and array_module(a) is not xp:
        raise TypeError(f"{name} must be an array of the input's backend ({xp.__name__}), got {type(a).__name__}")
    return a


def _message_out(xp: Any, out: Any, nbytes: int) -> Any:
    if out is None:
        return xp.empty(nbytes, np.uint8)
    _same_backend(xp, out, "out")
    if out.dtype != np.uint8 or out.size != nbytes or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous uint8 array of {nbytes} bytes")
    return out.reshape(-1)


def _values_out(xp: Any, out: Any, count: int, name: str) -> Any:
    _same_backend(xp, out, name)
    if out.dtype != np.float32 or out.size != count or not out.flags.c_contiguous:
        raise ValueError(f"{name} must be a contiguous float32 array of {count} values")
    return out.reshape(-1)


def _check_message(xp: Any, message: Any, count: int, f: Format, block: int) -> Any:
    _same_backend(xp, message, "message")
    message = xp.ascontiguousarray(message).reshape(-1).view(np.uint8)
    nbytes = message_nbytes(count, f, block)
    if message.size != nbytes:
        raise ValueError(f"a {f.name} message of {count} values has {nbytes} bytes, got {message.size}")
    return message


def _overlap(a: Any, b: Any) -> bool:
    if a.nbytes == 0 or b.nbytes == 0:
        return False
    pa, pb = data_pointer(a), data_pointer(b)
    return pa < pb + b.nbytes and pb < pa + a.nbytes


# ------------------------------------------------------------------------- public functions
def encode(x: Any, fmt: str | Format = "e4m3", block: int | None = None, out: Any = None, *,
           rounding: str = "nearest", key: int = 0, offset: int = 0) -> Any:
    """Encode values (any shape, read flat; other float dtypes are cast to float32) into one
    wire message (uint8, 1-D, the input's backend; ``out`` if given).

    ``rounding="stochastic"``: unbiased rounding of the elements with Philox4x32-10 bits keyed by
    ``key`` (int in [0, 2**64)) for element indices ``offset + i``; ValueError for a pass-through
    format (bf16, fp16, fp32)."""
    f, block = get_format(fmt), resolve_block(fmt, block)
    k = _key_of(f, rounding, key, offset)
    xp = array_module(x)
    x = _values(xp, x)
    msg = _message_out(xp, out, message_nbytes(x.size, f, block))
    kernels_for(xp).encode(x, f, block, msg, k, int(offset))
    return msg


def decode(message: Any, count: int, fmt: str | Format = "e4m3", block: int | None = None, out: Any = None) -> Any:
    """Decode one wire message of ``count`` values into a float32 vector (``out`` if given)."""
    f, block = get_format(fmt), resolve_block(fmt, block)
    xp = array_module(message)
    message = _check_message(xp, message, count, f, block)
    res = xp.empty(count, np.float32) if out is None else _values_out(xp, out, count, "out")
    kernels_for(xp).decode(message, count, f, block, res)
    return res if out is None else out


def decode_add_encode(message: Any, local: Any, fmt: str | Format = "e4m3", block: int | None = None,
                      out: Any = None, sum_out: Any = None, *, rounding: str = "nearest", key: int = 0,
                      offset: int = 0) -> Any:
    """One ring hop: ``encode(decode(message) + local)`` with the sum in float32.

    ``local``: float32 vector of the message's count. ``sum_out``: optional float32 vector that
    receives the float32 sum itself (the owner keeps it after the last hop). ``out`` must not
    overlap ``message``. ``rounding``, ``key``, ``offset``: as :func:`encode`, for the re-encode.
    """
    f, block = get_format(fmt), resolve_block(fmt, block)
    k = _key_of(f, rounding, key, offset)
    xp = array_module(local)
    local = _values(xp, local)
    message = _check_message(xp, message, local.size, f, block)
    msg = _message_out(xp, out, message_nbytes(local.size, f, block))
    if sum_out is not None:
        sum_out = _values_out(xp, sum_out, local.size, "sum_out")
    if _overlap(msg, message):
        raise ValueError("out must not overlap message")
    kernels_for(xp).decode_add_encode(message, local, f, block, msg, sum_out, k, int(offset))
    return msg


def decode_accumulate(message: Any, acc: Any, fmt: str | Format = "e4m3", block: int | None = None) -> Any:
    """``acc += decode(message)`` in place; ``acc`` is a contiguous float32 vector."""
    f, block = get_format(fmt), resolve_block(fmt, block)
    xp = array_module(acc)
    if acc.dtype != np.float32 or not acc.flags.c_contiguous:
        raise ValueError("acc must be a contiguous float32 array")
    message = _check_message(xp, message, acc.size, f, block)
    kernels_for(xp).decode_accumulate(message, acc.reshape(-1), f, block)
    return acc
