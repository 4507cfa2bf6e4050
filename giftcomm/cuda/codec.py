"""The wire codec's CUDA kernels: :class:`CudaKernels`, the trusted kernels giftcomm.codec uses
for CuPy arrays (giftcomm.codec checks the arguments; nothing here does).

Same bytes as :mod:`giftcomm.reference.codec` bit for bit (NaN payload bits aside: a NaN stays a
NaN). Kernels: ``kernels/gc_codec.cu``; they run on CuPy's *current stream* and return without
synchronizing, so results are stream-ordered like any CuPy operation.

Arrays: ``x``, ``local``, ``acc``, ``sum_out``: contiguous 1-D float32 CuPy arrays;
``message``/``out``: contiguous 1-D uint8 CuPy arrays of ``giftcomm.message_nbytes(count, fmt,
block)`` bytes (docs/wire-format.md).

Kernel choice (all give the same bytes): encode, block <= 256: a team of 1..32 lanes of one warp
per scale block, 8 values per lane in registers (x read once: 5 bytes of traffic per value for
e4m3/e5m2); 256 < block <= 4096: one CTA per scale block, values in registers; block > 4096: two
passes (amax with atomics, then quantize: x read twice). 16-byte vector loads of x when block % 4
== 0 and the pointers are aligned. Stochastic rounding (``key`` not None): the same kernels'
``_sr`` variants, one pass up to block 4096.

Decode-add-encode (one ring hop), e4m3/e5m2: 16 consecutive values per lane (message and local
read once); block <= 512 a team of lanes per scale block, <= 8192 one CTA per block, above two
passes over 4096-value tiles; access width from block and pointers (16-byte payload and float4
accesses, 4-byte payload words and float4s, or single values), nearest or stochastic (gc_dae_*
and gc_dae_*_sr_*). e4m3/e5m2 decode and decode-accumulate: 16 values per thread (16- or 4-byte
payload loads, float4 stores). MX formats (mxfp8, mxfp8_e5m2, mxfp4) encode and decode-add-encode:
two lanes of 16 values per 32-value block, float4 loads and one 16- / 8-byte code store per lane
where aligned (gc_mx_enc_F); nvfp4: one warp per 1024-value group, x and the sums through a shared
tile, 16-byte payload loads and stores (gc_mx_enc_nvfp4); their decode and decode-accumulate: 8
values per thread, one scale read, 4-byte payload loads and float4 stores where aligned
(gc_mx_dec_F). fp32 pass-through: encode / decode are device copies, accumulate and
decode-add-encode run gc_pt_fp32 (not cupy.add: CuPy's elementwise kernels flush float32
subnormals, -ftz=true). Every float32 add / multiply / divide in the kernels is explicit non-.ftz
PTX (gc_fp8.cuh), so device bytes equal host bytes whatever NVRTC's -ftz flag. The Philox bits
of message value i use counter ``offset + i`` (docs/wire-format.md).
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..formats import FORMATS, SCALE_RULE_SHIFT, Format, group_scales_offset, num_blocks, num_groups, payload_nbytes, scales_offset
from . import _loader

__all__ = ["CudaKernels", "CUDA_FORMATS", "divide_inplace", "supports", "add_inplace", "add", "convert"]

CUDA_FORMATS = frozenset(name for name, f in FORMATS.items() if f.native and f.adaptive is None)
"""The formats kernels/gc_codec.cu has kernels for: the table's native rows (Format.native; its
entry points expand the generated row lists GC_F32_ROWS and GC_E8M0_ROWS, plus nvfp4 and the
pass-through rows; tests/test_format_table.py checks the compiled entry names) but the adaptive
ones, which have C kernels only. Any other row of the format table runs on the reference through
host copies (giftcomm.codec.CudaOrFallbackKernels)."""


def supports(f: Format) -> bool:
    """Whether the CUDA kernels implement format ``f``: a native row of the table other than the
    adaptive ones (its facts come from the table itself: the loader generates gc_formats.h from
    giftcomm.formats at load time)."""
    return f.native and f.adaptive is None and f.name in FORMATS

_THREADS = 256
_MAX_GRID = 1 << 20
_NULL = np.uint64(0)
TEAM_MAX_BLOCK = 256  # encode: team path up to here (8 values per lane) ...
CTA_MAX_BLOCK = 4096  # ... one CTA per scale block up to here, two passes above
DAE_VPT = 16  # decode-add-encode: values per lane
DAE_TEAM_MAX_BLOCK = 512  # decode-add-encode: team path up to here ...
DAE_CTA_MAX_BLOCK = 8192  # ... one CTA (<= 512 threads) per scale block up to here, two passes above
BIG_TILE = 4096  # values per work item of the two-pass path (256 threads; 16 per thread for decode-add-encode)


def _cp():
    import cupy

    return cupy


def _ptr(a: Any) -> int:
    return int(a.data.ptr)


def _parts(msg: Any, count: int, f: Format, block: int) -> tuple[Any, Any]:
    """(payload uint8 view, scales float32 view) of a block-scaled message; checks alignment."""
    cp = _cp()
    off = scales_offset(count, f)
    if (_ptr(msg) + off) % 4:
        raise ValueError("the scales of a wire message must be 4-byte aligned (message start % 4 == 0)")
    return msg[:count], msg[off : off + 4 * num_blocks(count, block)].view(cp.float32)


_scratch_local = threading.local()


def _amax_scratch(nb: int) -> Any:
    """``nb`` zeroed uint32 words for the big path's amax pass: one buffer per thread, device and
    stream, grown to the largest request and reused (no allocation in a call's steady state, so
    a call can be captured in a CUDA graph). Reuse is safe: the next call on the same stream
    zeroes it only after this call's kernels ran (stream order); other threads or streams get
    their own."""
    cp = _cp()
    bufs = getattr(_scratch_local, "bufs", None)
    if bufs is None:
        bufs = _scratch_local.bufs = {}
    key = (cp.cuda.Device().id, cp.cuda.get_current_stream().ptr)
    buf = bufs.get(key)
    if buf is None or buf.size < nb:
        buf = bufs[key] = cp.empty(max(nb, 2 * (0 if buf is None else buf.size), 64), cp.uint32)
    amax = buf[:nb]
    amax.fill(0)
    return amax


def _aligned(a: Any, name: str) -> Any:
    """``a`` unchanged; ValueError when its start is not 4-byte aligned (a float32 access there is a
    sticky CUDA fault that breaks the context, not an exception)."""
    if _ptr(a) % 4:
        raise ValueError(f"{name} must start at a 4-byte aligned address (device pointer {_ptr(a):#x})")
    return a


def _dec_vec(payload: Any, out: Any) -> np.int32:
    """The decode kernels' access width: 2 (16-byte payload loads), 1 (4-byte), 0 (bytes); the
    vector paths need a 16-byte aligned float32 ``out``."""
    if _ptr(out) % 16:
        return np.int32(0)
    return np.int32(2 if _ptr(payload) % 16 == 0 else 1 if _ptr(payload) % 4 == 0 else 0)


def _grid(items: int, per_cta: int = 1) -> int:
    return max(1, min(-(-items // per_cta), _MAX_GRID))


def _team_width(block: int, per_lane: int = 8) -> int:
    """The smallest power of two g with g * per_lane >= block (lanes of a team / threads of a CTA)."""
    g = 1
    while g * per_lane < block:
        g *= 2
    return g


def _encode_launch(f: Format, block: int, count: int, payload_out: Any, scales_out: Any, x: Any, pad: int,
                   key: int | None = None, offset: int = 0) -> None:
    """Launch the e4m3/e5m2 encode kernels; ``key`` given: stochastic rounding (block <=
    CTA_MAX_BLOCK: the one-pass ``_sr`` team / cta kernels; above: amax pass, then gc_enc_big_sr)."""
    nb = num_blocks(count, block)
    n64, b32, nb64, pad32 = np.int64(count), np.int32(block), np.int64(nb), np.int32(pad)
    head = (x, payload_out, scales_out)
    tail = () if key is None else (np.uint64(key), np.uint64(offset))
    if block <= CTA_MAX_BLOCK:
        vec = block % 4 == 0 and _ptr(x) % 16 == 0 and _ptr(payload_out) % 4 == 0
        suffix = ("_sr" if key is not None else "") + ("_vec_" if vec else "_") + f.name
        if block <= TEAM_MAX_BLOCK:
            g = _team_width(block)
            fn = _loader.get_function(f"gc_enc_team{suffix}")
            fn((_grid(nb, _THREADS // g),), (_THREADS,), head + (n64, b32, nb64, np.int32(g), pad32) + tail)
        else:
            threads = max(32, min(512, _team_width(block)))
            fn = _loader.get_function(f"gc_enc_cta{suffix}")
            fn((_grid(nb),), (threads,), head + (n64, b32, nb64, pad32) + tail)
        return
    splits = np.int32(-(-block // BIG_TILE))
    amax = _amax_scratch(nb)
    grid = (_grid(nb * int(splits)),)
    _loader.get_function(f"gc_enc_amax_{f.name}")(grid, (_THREADS,), (x, amax, n64, b32, nb64, splits))
    store = "gc_enc_big_" + ("sr_" if key is not None else "") + f.name
    _loader.get_function(store)(grid, (_THREADS,), (x, amax, payload_out, scales_out, n64, b32, nb64, splits, pad32) + tail)


def _dae_vec(block: int, pays: tuple[Any, ...], floats: tuple[Any, ...]) -> np.int32:
    """The decode-add-encode kernels' access width: 2 (16-byte payload and float4 accesses: block %
    16 == 0, every pointer 16-byte aligned), 1 (4-byte payload words and float4s: block % 4 == 0,
    payloads 4-byte and floats 16-byte aligned), 0 (one value at a time)."""
    if all(_ptr(a) % 16 == 0 for a in floats):
        if block % 16 == 0 and all(_ptr(a) % 16 == 0 for a in pays):
            return np.int32(2)
        if block % 4 == 0 and all(_ptr(a) % 4 == 0 for a in pays):
            return np.int32(1)
    return np.int32(0)


def _dae_launch(f: Format, block: int, count: int, pin: Any, sin: Any, local: Any, payload_out: Any, scales_out: Any,
                sum_out: Any, pad: int, key: int | None, offset: int) -> None:
    """Launch the e4m3/e5m2 decode-add-encode kernels (16 values per lane): block <=
    DAE_TEAM_MAX_BLOCK a team of lanes per scale block, <= DAE_CTA_MAX_BLOCK one CTA per block,
    above the two passes over 4096-value tiles; ``key`` given: the ``_sr_`` (stochastic) kernels."""
    nb = num_blocks(count, block)
    floats = (local,) if sum_out is None else (local, sum_out)
    vec = _dae_vec(block, (pin, payload_out), floats)
    n64, b32, nb64 = np.int64(count), np.int32(block), np.int64(nb)
    head = (pin, sin, local, payload_out, scales_out, _NULL if sum_out is None else sum_out, n64, b32, nb64)
    tail = (np.int32(pad), vec, np.uint64(0 if key is None else key), np.uint64(offset))
    rounding = "_" if key is None else "_sr_"
    if block <= DAE_TEAM_MAX_BLOCK:
        g = _team_width(block, DAE_VPT)
        _loader.get_function(f"gc_dae_team{rounding}{f.name}")(
            (_grid(nb, _THREADS // g),), (_THREADS,), head + (np.int32(g),) + tail)
    elif block <= DAE_CTA_MAX_BLOCK:
        _loader.get_function(f"gc_dae_cta{rounding}{f.name}")((_grid(nb),), (_team_width(block, DAE_VPT),), head + tail)
    else:
        splits = np.int32(-(-block // BIG_TILE))
        amax = _amax_scratch(nb)
        grid = (_grid(nb * int(splits)),)
        _loader.get_function(f"gc_dae_amax_{f.name}")(grid, (_THREADS,), (pin, sin, local, amax, n64, b32, nb64, splits, vec))
        _loader.get_function(f"gc_dae_big{rounding}{f.name}")(
            grid, (_THREADS,), (pin, sin, local, amax, payload_out, scales_out) + head[5:] + (splits,) + tail)


def _mx_parts(msg: Any, count: int, f: Format, zero_pad: bool = False) -> tuple[Any, Any, Any]:
    """(payload bytes, block-scale bytes, nvfp4 group scales float32 or NULL) of an MX / nvfp4
    message; zero_pad: zero nvfp4's pad bytes before the group scales (outputs)."""
    cp = _cp()
    pb = payload_nbytes(count, f)
    nb = num_blocks(count, f.default_block())
    gs: Any = _NULL
    if f.scale_kind == "nvfp4":
        off = group_scales_offset(count, f)
        if (_ptr(msg) + off) % 4:
            raise ValueError("the group scales of an nvfp4 message must be 4-byte aligned (message start % 4 == 0)")
        if zero_pad and off > pb + nb:
            msg[pb + nb : off] = 0
        gs = msg[off : off + 4 * num_groups(count)].view(cp.float32)
    return msg[:pb], msg[pb : pb + nb], gs


def _mx_encode(f: Format, count: int, x: Any, out: Any, key: int | None, offset: int, message: Any = None,
               sum_out: Any = None) -> None:
    pay, sc, gs = _mx_parts(out, count, f, zero_pad=True)
    ipay, isc, igs = (_NULL, _NULL, _NULL) if message is None else _mx_parts(message, count, f)
    units = num_groups(count) if f.scale_kind == "nvfp4" else num_blocks(count, f.default_block())
    warps = _THREADS // 32
    _loader.get_function(f"gc_mx_enc_{f.name}")(
        (_grid(units, warps),), (_THREADS,),
        (x, ipay, isc, igs, pay, sc, gs, _NULL if sum_out is None else sum_out, np.int32(message is not None),
         np.int64(count), np.int64(units), np.int32(key is not None), np.uint64(key or 0), np.uint64(offset),
         np.int32(f.variant_code >> SCALE_RULE_SHIFT)))


def _mx_decode(f: Format, count: int, message: Any, out: Any, acc: bool) -> None:
    ipay, isc, igs = _mx_parts(message, count, f)
    vec = np.int32(_ptr(out) % 16 == 0 and _ptr(ipay) % 4 == 0)
    _loader.get_function(f"gc_mx_dec_{f.name}")(
        (_grid(-(-count // 8), _THREADS),), (_THREADS,), (ipay, isc, igs, out, np.int64(count), np.int32(acc), vec))


def _pt_launch(f: Format, op: int, count: int, x: Any = None, win: Any = None, wout: Any = None, out: Any = None) -> None:
    """Pass-through kernels (bf16, fp16): op 0 encode, 1 decode, 2 accumulate, 3 decode-add-encode."""
    cp = _cp()
    for a in (win, wout):
        if a is not None and _ptr(a) % 2:
            raise ValueError(f"a {f.name} wire message must start at an even address")
    args = tuple(_NULL if a is None else a for a in (x, win, wout, out))
    u16 = lambda a: a if a is _NULL else a.view(cp.uint16)  # noqa: E731
    args = (args[0], u16(args[1]), u16(args[2]), args[3])
    _loader.get_function(f"gc_pt_{f.name}")((_grid(count, _THREADS),), (_THREADS,), (np.int32(op),) + args + (np.int64(count),))


def _pt_fp32(op: int, count: int, win: Any, out: Any, x: Any = None, wout: Any = None) -> None:
    """fp32 pass-through accumulate (op 2: out += win) and decode-add-encode (op 3: wout = win + x,
    out = the same sum when given) through gc_pt_fp32, whose add never flushes subnormals (cupy.add
    runs with -ftz=true). win / wout: the uint8 wire messages, 4-byte aligned."""
    cp = _cp()
    for a in (win, wout):
        if a is not None and _ptr(a) % 4:
            raise ValueError("a fp32 wire message must start at a 4-byte aligned address")
    f32 = lambda a: _NULL if a is None else (a.view(cp.float32) if a.dtype == cp.uint8 else a)  # noqa: E731
    ptrs = [a for a in (x, win, wout, out) if a is not None]
    vec = np.int32(all(_ptr(a) % 16 == 0 for a in ptrs))
    _loader.get_function("gc_pt_fp32")((_grid(-(-count // 4), _THREADS),), (_THREADS,),
                                       (np.int32(op), f32(x), f32(win), f32(wout), f32(out), np.int64(count), vec))


def divide_inplace(x: Any, d: float) -> Any:
    """``x /= float32(d)`` in place on a contiguous 1-D float32 CuPy array, IEEE float32 division
    without flush-to-zero (gc_div_f32): bit-equal to NumPy's ``x /= np.float32(d)``, which a CuPy
    elementwise divide (compiled with -ftz=true) is not for subnormal inputs or quotients. For the
    op="avg" step of the collectives on device arrays."""
    n = x.size
    if n:
        _loader.get_function("gc_div_f32")((_grid(n, _THREADS),), (_THREADS,), (x, np.float32(d), np.int64(n)))
    return x


def _flat32(a: Any, name: str) -> Any:
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise ValueError(f"{name} must be a contiguous float32 device array (got {a.dtype})")
    return a.reshape(-1)


def add_inplace(acc: Any, x: Any) -> Any:
    """``acc += x`` on contiguous float32 CuPy arrays of one size (gc_pt_fp32: IEEE float32 adds
    without flush-to-zero, unlike CuPy's ``+=``, compiled with -ftz=true). Returns acc."""
    a, b = _flat32(acc, "acc"), _flat32(x, "x")
    if a.size != b.size:
        raise ValueError(f"add_inplace: sizes differ ({a.size} vs {b.size})")
    if a.size:
        _pt_fp32(2, a.size, b, a)
    return acc


def add(a: Any, b: Any, out: Any = None) -> Any:
    """``a + b`` of contiguous float32 CuPy arrays of one size, without flush-to-zero (into ``out``,
    float32, when given)."""
    fa, fb = _flat32(a, "a"), _flat32(b, "b")
    if fa.size != fb.size:
        raise ValueError(f"add: sizes differ ({fa.size} vs {fb.size})")
    res = _cp().empty(a.shape, np.float32) if out is None else out
    if fa.size:
        _pt_fp32(3, fa.size, fa, None, x=fb, wout=_flat32(res, "out"))
    return res


def convert(x: Any, dtype: Any, out: Any = None) -> Any:
    """``x`` (contiguous float32 or float64 CuPy array) cast to float64 / float32 without
    flush-to-zero (gc_cvt_f32_f64: exact; gc_cvt_f64_f32: round to nearest even, subnormal results
    kept), into ``out`` when given; a CuPy ``astype`` between the two flushes subnormals."""
    dt = np.dtype(dtype)
    kernels = {(np.dtype(np.float32), np.dtype(np.float64)): "gc_cvt_f32_f64",
               (np.dtype(np.float64), np.dtype(np.float32)): "gc_cvt_f64_f32"}
    name = kernels.get((x.dtype, dt))
    if name is None or not x.flags.c_contiguous:
        raise ValueError(f"convert: float32 <-> float64 of a contiguous array only (got {x.dtype} -> {dt})")
    res = _cp().empty(x.shape, dt) if out is None else out
    n = x.size
    if n:
        _loader.get_function(name)((_grid(n, _THREADS),), (_THREADS,), (x.reshape(-1), res.reshape(-1), np.int64(n)))
    return res


class CudaKernels:
    """The four codec operations on CuPy arrays (checked by the caller)."""

    name = "cuda"

    @staticmethod
    def encode(x: Any, f: Format, block: int, out: Any, key: int | None = None, offset: int = 0) -> Any:
        n = x.size
        if n == 0:
            return out
        _aligned(x, "x")
        if f.scale_kind in ("e8m0", "nvfp4"):
            _mx_encode(f, n, x, out, key, offset)
            return out
        if not f.scaled:
            if f.name == "fp32":
                _aligned(out, "a fp32 wire message").view(_cp().float32)[...] = x
            else:
                _pt_launch(f, 0, n, x=x, wout=out)
            return out
        payload, scales = _parts(out, n, f, block)
        _encode_launch(f, block, n, payload, scales, x, scales_offset(n, f) - n, key, offset)
        return out

    @staticmethod
    def decode(message: Any, count: int, f: Format, block: int, out: Any) -> Any:
        cp = _cp()
        if count == 0:
            return out
        _aligned(out, "out")
        if f.scale_kind in ("e8m0", "nvfp4"):
            _mx_decode(f, count, message, out, False)
            return out
        if not f.scaled:
            if f.name == "fp32":
                out[...] = _aligned(message, "a fp32 wire message").view(cp.float32)
            else:
                _pt_launch(f, 1, count, win=message, out=out)
            return out
        payload, scales = _parts(message, count, f, block)
        _loader.get_function(f"gc_dec_{f.name}")(
            (_grid(-(-count // 16), _THREADS),), (_THREADS,),
            (payload, scales, out, np.int64(count), np.int32(block), _dec_vec(payload, out)))
        return out

    @staticmethod
    def decode_add_encode(message: Any, local: Any, f: Format, block: int, out: Any, sum_out: Any,
                          key: int | None = None, offset: int = 0) -> Any:
        n = local.size
        if n == 0:
            return out
        _aligned(local, "local")
        if sum_out is not None:
            _aligned(sum_out, "sum_out")
        if f.scale_kind in ("e8m0", "nvfp4"):
            _mx_encode(f, n, local, out, key, offset, message=message, sum_out=sum_out)
            return out
        if not f.scaled:
            if f.name == "fp32":
                _pt_fp32(3, n, message, sum_out, x=local, wout=out)
            else:
                _pt_launch(f, 3, n, x=local, win=message, wout=out, out=sum_out)
            return out
        pin, sin = _parts(message, n, f, block)
        payload, scales = _parts(out, n, f, block)
        _dae_launch(f, block, n, pin, sin, local, payload, scales, sum_out, scales_offset(n, f) - n, key, offset)
        return out

    @staticmethod
    def decode_accumulate(message: Any, acc: Any, f: Format, block: int) -> Any:
        n = acc.size
        if n == 0:
            return acc
        _aligned(acc, "acc")
        if f.scale_kind in ("e8m0", "nvfp4"):
            _mx_decode(f, n, message, acc, True)
            return acc
        if not f.scaled:
            if f.name == "fp32":
                _pt_fp32(2, n, message, acc)
            else:
                _pt_launch(f, 2, n, win=message, out=acc)
            return acc
        payload, scales = _parts(message, n, f, block)
        _loader.get_function(f"gc_acc_{f.name}")(
            (_grid(-(-n // 16), _THREADS),), (_THREADS,),
            (payload, scales, acc, np.int64(n), np.int32(block), _dec_vec(payload, acc)))
        return acc
