"""Wire formats: the table of formats and the size of one wire message.

A *format* says how a float32 value travels on the wire:

- ``e4m3``: OCP FP8 E4M3 (``float8_e4m3fn``: max 448, no Inf, NaN code 0x7F), fp32 block scales.
- ``e5m2``: OCP FP8 E5M2 (``float8_e5m2``: max 57344), fp32 block scales.
- ``mxfp8``, ``mxfp8_e5m2``: OCP MX v1.0 MXFP8: E4M3 (E5M2) elements, one E8M0 power-of-two
  scale per 32 values.
- ``mxfp4``: OCP MX v1.0 MXFP4: E2M1 elements packed two per byte, one E8M0 scale per 32 values.
  The MX formats' shared exponent follows a scale rule (SCALE_RULES; ``Format.scale_rule``):
  "ceil" by default (no element saturates), OCP's "floor" as a variant (``with_scale_rule``).
- ``nvfp4``: NVIDIA NVFP4: E2M1 elements packed two per byte, one E4M3 scale per 16 values, and
  one float32 second-level scale per *group* of 64 blocks (1024 values) from the start of the
  message.
- ``bf16``, ``fp16``, ``fp32``: pass-through formats, raw values on the wire, no scales. They
  exist so that baselines run through the same collective code.

Messages for ``count`` values (docs/wire-format.md; nb = ceil(count/block), ng = ceil(count/1024))::

    e4m3, e5m2:         [count code bytes][pad to 4][nb float32 scales, LE]
    mxfp8, mxfp8_e5m2:  [count code bytes][nb E8M0 scale bytes]
    mxfp4:              [ceil(count/2) packed bytes][nb E8M0 scale bytes]
    nvfp4:              [ceil(count/2) packed bytes][nb E4M3 scale bytes][pad to 4][ng float32 LE]
    pass-through:       [count * itemsize bytes]

Packed 4-bit payloads: value 2j in the low nibble of byte j, value 2j+1 in the high nibble
(0 when count is odd).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np

from .adaptive import AdaptiveSpec

DEFAULT_BLOCK = 256
MAX_BLOCK = 1 << 20
#: values per NVFP4 second-level (float32) scale: 64 blocks of 16
NVFP4_GROUP = 1024

ROUNDINGS = ("nearest", "stochastic")

#: shared-exponent rules of the E8M0-scaled (MX) formats, the default first (docs/wire-format.md):
#: "ceil": the smallest power of two that keeps the block's amax within the element max (no value
#: saturates); "floor": OCP MX v1.0's ``floor(log2(amax)) - emax`` (values above max clamp).
SCALE_RULES = ("ceil", "floor")
#: a variant's code is ``code | rule index << SCALE_RULE_SHIFT`` (Format.variant_code)
SCALE_RULE_SHIFT = 8


@dataclass(frozen=True)
class Format:
    """One wire format.

    name: public name (``"e4m3"``...). code: small integer used in cross-rank signatures and by
    the native and CUDA kernels. wire_dtype: NumPy dtype of one element (``float4_e2m1fn`` for
    the 4-bit formats, one element per byte in NumPy; the wire packs two per byte).
    scaled: True for every block-scaled format (all but bf16/fp16/fp32).
    max_value: largest finite element magnitude (the scale target).
    nan_code: the element code written for every element of a non-finite block.
    value_bits: wire bits per element (4, 8, 16, 32).
    fixed_block: the block size the format defines (16 nvfp4, 32 MX), None when any block works.
    scale_kind: "f32" (e4m3/e5m2), "e8m0" (MX), "nvfp4" (E4M3 block scales + float32 group
    scales), "" for pass-through formats.
    emax: exponent of the element format's largest power of two (MX scale rule: 2 for E2M1,
    8 for E4M3, 15 for E5M2).
    scale_rule: the shared-exponent rule of an E8M0-scaled format (SCALE_RULES: "ceil", the
    default, or "floor"); "" for every other format. The rows of FORMATS carry the default;
    :meth:`with_scale_rule` gives the other variant.
    native: whether the C kernels (native/) and the CUDA kernels (giftcomm/cuda/kernels)
    implement this row (the adaptive rows: the C kernels with the row's AdaptiveSpec passed at
    run time, and the CUDA kernels of giftcomm.cuda.adaptive for the INT8/INT4-tier settings;
    giftcomm.cuda.codec.supports says which). True for every row of FORMATS today; False declares a *reference-only*
    row (a format landing Python-first): it runs everywhere (plain calls, plans, the simulation,
    error feedback, the adapters) on giftcomm.reference, host arrays directly and CuPy arrays
    through host copies, and the generated dispatch lists of ``native/gc_formats.h`` leave it out.

    The C and CUDA kernels read these facts from ``native/gc_formats.h``, generated from this
    table (:func:`giftcomm.formats_header.c_header`; ``python -m giftcomm.formats_header``), and
    dispatch over its generated row lists (``GC_NATIVE_ROWS``, ``GC_F32_ROWS``,
    ``GC_E8M0_ROWS``); a native row the compiled build lacks (a stale build) also runs on the
    reference (giftcomm.codec.native_formats).
    """

    name: str
    code: int
    wire_dtype: np.dtype
    scaled: bool
    max_value: float = 0.0
    nan_code: int = 0
    value_bits: int = 0
    fixed_block: int | None = None
    scale_kind: str = ""
    emax: int = 0
    scale_rule: str = ""
    native: bool = True
    adaptive: AdaptiveSpec | None = None

    @functools.cached_property
    def variant_code(self) -> int:
        """The code of this variant: ``code`` plus the scale rule's index shifted by
        SCALE_RULE_SHIFT (0 for the default rule, so the default variant's code is ``code``).
        What the native and CUDA kernels take and what the cross-rank signature compares."""
        rule = SCALE_RULES.index(self.scale_rule) if self.scale_rule else 0
        return self.code | rule << SCALE_RULE_SHIFT

    def with_scale_rule(self, rule: str) -> Format:
        """This format with shared-exponent rule ``rule`` ("ceil" or "floor"). ValueError for an
        unknown rule, or for a rule other than the default on a format without E8M0 scales."""
        if rule not in SCALE_RULES:
            raise ValueError(f"mx_scale must be one of {', '.join(map(repr, SCALE_RULES))}, got {rule!r}")
        if self.scale_kind != "e8m0":
            if rule == SCALE_RULES[0]:
                return self
            raise ValueError(f"mx_scale={rule!r} applies to the formats with E8M0 scales "
                             f"({', '.join(f.name for f in FORMATS.values() if f.scale_kind == 'e8m0')}); "
                             f"{self.name} has {_SCALE_WORDS.get(self.scale_kind, 'no')} scales")
        return self if rule == self.scale_rule else _variant(self, rule)

    @property
    def itemsize(self) -> int:
        """Bytes of one element in NumPy (1 for the 4-bit formats: see value_bits for the wire)."""
        return self.wire_dtype.itemsize

    @property
    def packed(self) -> bool:
        """True for the 4-bit formats (two elements per payload byte)."""
        return self.value_bits == 4

    @property
    def tiny_amax(self) -> np.float32:
        """e4m3/e5m2: block amax below which a block is encoded with scale 1 (flushes to signed zero).

        ``max_value * 2**-126``: the smallest amax for which both ``amax / max`` and
        ``max / amax`` are normal, finite float32 numbers.
        """
        return np.float32(self.max_value) * np.float32(2.0**-126)

    def default_block(self) -> int:
        """The block used when none is given: the format's own, else DEFAULT_BLOCK."""
        return self.fixed_block if self.fixed_block is not None else DEFAULT_BLOCK

    def slice_unit(self, block: int) -> int:
        """Values a message may be cut at without changing any byte of the buffer's encoding:
        ``block`` for every format except nvfp4, whose float32 scale covers a group of 1024
        values (64 blocks) counted from the start of the message, and the adaptive rows, whose
        tiers are chosen per frame of ``adaptive.frame`` blocks."""
        if self.adaptive is not None:
            return self.adaptive.frame * block
        return NVFP4_GROUP if self.scale_kind == "nvfp4" else block

    def scale_nbytes(self) -> int:
        """Bytes of one block scale on the wire (0 for pass-through formats)."""
        return {"f32": 4, "e8m0": 1, "nvfp4": 1, "adaptive": 4}.get(self.scale_kind, 0)


_E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_E5M2 = np.dtype(ml_dtypes.float8_e5m2)


#: the adaptive rows' super-block (their fixed block)
ADAPTIVE_BLOCK = 256


def _adaptive_row(name: str, code: int, spec: AdaptiveSpec) -> Format:
    """An adaptive-precision row (giftcomm.adaptive): uint8 wire bytes, no single element format."""
    spec.check_block(ADAPTIVE_BLOCK)
    return Format(name, code, np.dtype(np.uint8), True, 448.0, 0, 0, ADAPTIVE_BLOCK, "adaptive", 8, adaptive=spec)


#: the adaptive-precision rows (giftcomm.adaptive): per 256-value super-block 8 bits (INT8 with
#: E4M3 scales per 32), 4 bits (INT4, E4M3 scales per 16) or 2 bits (INT2), the largest blocks of a message by
#: amax first, within the named budget (bits/value, everything counted); frames of 65536 blocks:
#: the tiers are chosen over the whole message (up to 16M values); share8: measured on the
#: Llama-small gradients (docs/wire-format.md)
ADAPTIVE_ROWS = (
    _adaptive_row("ada4_5", 10, AdaptiveSpec(4500, 1 << 16, 600, "int8", "int4")),
    _adaptive_row("ada4", 11, AdaptiveSpec(4000, 1 << 16, 500, "int8", "int4")),
)

FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("e4m3", 1, _E4M3, True, 448.0, 0x7F, 8, None, "f32", 8),
        Format("e5m2", 2, _E5M2, True, 57344.0, 0x7F, 8, None, "f32", 15),
        Format("bf16", 3, np.dtype(ml_dtypes.bfloat16), False, value_bits=16),
        Format("fp16", 4, np.dtype(np.float16), False, value_bits=16),
        Format("fp32", 5, np.dtype(np.float32), False, value_bits=32),
        Format("nvfp4", 6, _E2M1, True, 6.0, 0x00, 4, 16, "nvfp4", 2),
        Format("mxfp4", 7, _E2M1, True, 6.0, 0x00, 4, 32, "e8m0", 2, "ceil"),
        Format("mxfp8", 8, _E4M3, True, 448.0, 0x7F, 8, 32, "e8m0", 8, "ceil"),
        Format("mxfp8_e5m2", 9, _E5M2, True, 57344.0, 0x7F, 8, 32, "e8m0", 15, "ceil"),
        *ADAPTIVE_ROWS,
    )
}
_SCALE_WORDS = {"f32": "float32", "nvfp4": "E4M3 and float32", "": "no"}


@functools.lru_cache(maxsize=256)
def _variant(f: Format, rule: str) -> Format:
    """One Format object per (row, rule): the kernels' per-format caches stay bounded."""
    return replace(f, scale_rule=rule)

#: formats by their integer code
FORMATS_BY_CODE: dict[int, Format] = {f.code: f for f in FORMATS.values()}


def describe_code(variant_code: int) -> str:
    """A signature's format code in words: the name, and the scale rule when not the default
    (``"mxfp8 (mx_scale='floor')"``); the number itself when no format has it."""
    f = FORMATS_BY_CODE.get(variant_code & ((1 << SCALE_RULE_SHIFT) - 1))
    rule = variant_code >> SCALE_RULE_SHIFT
    if f is None or rule >= len(SCALE_RULES) or (rule and f.scale_kind != "e8m0"):
        return str(variant_code)
    return f.name if not rule else f"{f.name} (mx_scale={SCALE_RULES[rule]!r})"


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


def resolve_block(fmt: str | Format, block: int | None = None) -> int:
    """The block size a call uses: ``block``, or when None the format's own (16 nvfp4, 32 for the
    MX formats) or DEFAULT_BLOCK (256). ValueError for an invalid block, or for a block other than
    its own given to a fixed-block format."""
    f = get_format(fmt)
    if block is None:
        return f.default_block()
    block = check_block(block)
    if f.fixed_block is not None and block != f.fixed_block:
        raise ValueError(f"format {f.name} has a fixed block of {f.fixed_block} values; got block={block} "
                         f"(pass block=None or block={f.fixed_block})")
    return block


def check_rounding(rounding: str, fmt: str | Format | None = None) -> str:
    """Validate a rounding mode ("nearest" or "stochastic"); stochastic needs a scaled format."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(map(repr, ROUNDINGS))}, got {rounding!r}")
    if rounding == "stochastic" and fmt is not None and not get_format(fmt).scaled:
        raise ValueError(f"stochastic rounding needs a block-scaled format; {get_format(fmt).name} is a "
                         "pass-through format (its values are cast with round-to-nearest-even)")
    return rounding


def check_key(key: int, name: str = "key") -> int:
    """Validate a stochastic-rounding key (``name``: what it is): an int in [0, 2**64)."""
    if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or not 0 <= int(key) < 1 << 64:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {key!r}")
    return int(key)


def check_offset(offset: int) -> int:
    """Validate an element-index offset of stochastic rounding: an int in [0, 2**64)."""
    return check_key(offset, "offset")


def num_blocks(count: int, block: int) -> int:
    """Number of scale blocks for ``count`` values (the last one may be partial)."""
    return -(-count // block)


def num_groups(count: int) -> int:
    """Number of NVFP4 second-level scale groups (1024 values each) for ``count`` values."""
    return -(-count // NVFP4_GROUP)


def payload_nbytes(count: int, fmt: Format) -> int:
    """Bytes of the payload part of a message, before any padding."""
    return (count + 1) // 2 if fmt.packed else count * fmt.itemsize


def scales_offset(count: int, fmt: Format) -> int:
    """Byte offset of the block scales: the payload padded to 4 bytes for e4m3/e5m2 (float32
    scales), the payload itself for the MX formats and nvfp4 (one byte per scale)."""
    p = payload_nbytes(count, fmt)
    return -(-p // 4) * 4 if fmt.scale_kind in ("f32", "") else p


def group_scales_offset(count: int, fmt: Format, block: int | None = None) -> int:
    """nvfp4: byte offset of the float32 group scales (after the E4M3 block scales, padded to 4)."""
    b = resolve_block(fmt, block)
    return -(-(scales_offset(count, fmt) + num_blocks(count, b)) // 4) * 4


def message_nbytes(count: int, fmt: str | Format = "e4m3", block: int | None = None) -> int:
    """Exact size in bytes of one wire message carrying ``count`` values (``block`` None: the
    format's default block, see resolve_block)."""
    try:
        return _message_nbytes(count, fmt, block)
    except TypeError:  # an unhashable argument: let the checks name it if it is fmt or block
        get_format(fmt)
        if block is not None:
            check_block(block)
        raise


@functools.lru_cache(maxsize=4096)
def _message_nbytes(count: int, fmt: str | Format, block: int | None) -> int:
    # cached: every codec call asks, with the few sizes a training loop repeats
    f = get_format(fmt)
    if not f.scaled:
        return payload_nbytes(count, f)
    block = resolve_block(f, block)
    if f.adaptive is not None:
        return f.adaptive.message_nbytes(count, block)
    nb = num_blocks(count, block)
    if f.scale_kind == "f32":
        return scales_offset(count, f) + 4 * nb
    if f.scale_kind == "e8m0":
        return scales_offset(count, f) + nb
    return group_scales_offset(count, f, block) + 4 * num_groups(count)


def bytes_per_value(fmt: str | Format = "e4m3", block: int | None = None) -> float:
    """Asymptotic wire bytes per value: element bits / 8 plus the scales' share (padding words
    of a message left out): 1 + 4/block (e4m3, e5m2), 1.03125 (mxfp8), 0.53125 (mxfp4),
    0.56640625 (nvfp4: 0.5 + 1/16 + 4/1024); an adaptive row: a message of whole frames'."""
    f = get_format(fmt)
    if not f.scaled:
        return float(f.itemsize)
    block = resolve_block(f, block)
    if f.adaptive is not None:
        return f.adaptive.bits_per_value(block) / 8
    extra = 4.0 / NVFP4_GROUP if f.scale_kind == "nvfp4" else 0.0
    return f.value_bits / 8 + f.scale_nbytes() / block + extra

