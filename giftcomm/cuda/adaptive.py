"""Launch code of the adaptive-precision rows' CUDA kernels (kernels/gc_adaptive.cuh): the
table's ``ada4_5`` and ``ada4`` (an INT8 8-bit tier and an INT4 4-bit tier), bit for bit
:mod:`giftcomm.reference.adaptive` (NaN payload bits of decoded values aside).

Encode of ``count`` values (``nsb = ceil(count / block)`` super-blocks, frames of
``spec.frame``): gc_ada_keys gives each super-block a uint64 key that sorts a frame's
super-blocks by descending amax, ties by index; ``cupy.sort`` over runs of whole frames
(_RUN_FRAMES = 2**17 per run: the frame's number within its run takes the key's top 17 bits); gc_ada_tiers turns the sorted
ranks into choice codes; the tier-section byte offset of each super-block comes from per-frame
prefix counts (``cupy.cumsum``); gc_ada_enc writes the elements, element scales, super-scales
and choice bits. Decode: gc_ada_choices reads the choice codes, the per-frame tier counts are
checked against the row's (ValueError for a corrupt message: one host synchronisation per call),
the same offsets, then gc_ada_dec. Decode-add-encode and decode-accumulate compose these with
the float32 adds of giftcomm.cuda.codec (no flush to zero).

Arrays: ``x``, ``out`` values: contiguous 1-D float32 CuPy arrays, 4-byte aligned; messages:
contiguous 1-D uint8 CuPy arrays of ``spec.message_nbytes(count, block)`` bytes, any alignment
(the kernels move message bytes one at a time). Each call allocates its scratch (keys, choice
codes, offsets: 17 bytes per super-block, and the sort's).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..adaptive import TIER_T2, TIER_T4, TIER_T8, AdaptiveSpec
from ..formats import Format
from . import _loader

__all__ = ["supports", "encode", "decode"]

_THREADS = 128  # gc_adaptive.cuh: GC_ADA_THREADS
_MAX_GRID = 1 << 20
_RUN_FRAMES = 1 << 17  # frames per sort run (the key's frame field)


def supports(f: Format) -> bool:
    """Whether gc_adaptive.cuh implements adaptive row ``f``: an INT8 8-bit tier and an INT4
    4-bit tier (the table's ada4_5 and ada4)."""
    a = f.adaptive
    return a is not None and a.top == "int8" and a.mid == "int4"


def _cp() -> Any:
    import cupy

    return cupy


def _grid(items: int, per_cta: int = 1) -> tuple[int]:
    return (max(1, min(-(-items // per_cta), _MAX_GRID)),)


def _spec(f: Format) -> AdaptiveSpec:
    assert f.adaptive is not None  # callers dispatch on supports()
    return f.adaptive


def _frames(nsb: int, spec: AdaptiveSpec) -> list[tuple[int, int, int]]:
    """(first super-block, frames, super-blocks per frame) of the full frames and the partial one."""
    full, rest = divmod(nsb, spec.frame)
    parts = [(0, full, spec.frame)] if full else []
    return parts + [(full * spec.frame, 1, rest)] if rest else parts


def _offsets(tiers: Any, nsb: int, spec: AdaptiveSpec, block: int, check: bool) -> Any:
    """int64 message byte of each super-block's tier payload (the tier's section of its frame,
    index order within the tier), from the choice codes ``tiers`` (uint8, nsb). check: ValueError
    when a frame's codes do not give the row's tier counts (a corrupt message)."""
    cp = _cp()
    off = cp.empty(nsb, cp.int64)
    fb = spec.frame_nbytes(spec.frame, block)
    tb = dict(zip((TIER_T8, TIER_T4, TIER_T2), spec.tier_bytes(block)))
    for first, frames, per in _frames(nsb, spec):
        counts = dict(zip((TIER_T8, TIER_T4, TIER_T2), spec.tier_counts(per, block)))
        t = tiers[first : first + frames * per].reshape(frames, per)
        base = (cp.arange(frames, dtype=cp.int64) * fb + (first // spec.frame * fb + spec.head_bytes(per)))[:, None]
        acc = cp.zeros((frames, per), cp.int64)
        start, bad = 0, cp.zeros(frames, cp.bool_)
        for tier in (TIER_T8, TIER_T4, TIER_T2):
            m = (t == tier).astype(cp.int64)
            slot = cp.cumsum(m, axis=1)
            if check:
                bad |= slot[:, -1] != counts[tier]
            acc += m * (start + (slot - 1) * tb[tier])
            start += counts[tier] * tb[tier]
        if check and bool(bad.any()):
            k = tuple(counts[tier] for tier in (TIER_T8, TIER_T4, TIER_T2))
            raise ValueError(f"corrupt adaptive message: a frame's choice bits do not give {k} super-blocks "
                             f"at 8/4/2 bits")
        off[first : first + frames * per] = (acc + base).reshape(-1)
    return off


def _tiers(keys: Any, nsb: int, spec: AdaptiveSpec, block: int) -> Any:
    """uint8 choice code of each super-block from its gc_ada_keys key (sorted per run of frames)."""
    cp = _cp()
    tiers = cp.empty(nsb, cp.uint8)
    F = spec.frame
    k8f, k4f, _ = spec.tier_counts(F, block)
    k8r, k4r, _ = spec.tier_counts(nsb % F, block) if nsb % F else (0, 0, 0)
    run = _RUN_FRAMES * F
    fn = _loader.get_function("gc_ada_tiers")
    for lo in range(0, nsb, run):
        hi = min(nsb, lo + run)
        s = cp.sort(keys[lo:hi])
        fn(_grid(hi - lo, _THREADS), (_THREADS,), (s, tiers, np.int64(hi - lo), np.int64(lo), np.int32(F), np.int64(nsb),
                                                   np.int32(k8f), np.int32(k4f), np.int32(k8r), np.int32(k4r)))
    return tiers


def encode(x: Any, f: Format, block: int, out: Any, key: int | None, offset: int) -> Any:
    """Encode float32 ``x`` (count = x.size > 0) into message ``out``; ``key`` None: nearest,
    else stochastic rounding with the Philox bits of (key, offset + i) for value i."""
    cp = _cp()
    spec = _spec(f)
    n = x.size
    nsb = -(-n // block)
    keys = cp.empty(nsb, cp.uint64)
    head = (np.int64(n), np.int32(block), np.int64(nsb), np.int32(spec.frame))
    _loader.get_function("gc_ada_keys")(_grid(nsb), (_THREADS,), (x, keys) + head + (np.int32(_RUN_FRAMES),))
    tiers = _tiers(keys, nsb, spec, block)
    off = _offsets(tiers, nsb, spec, block, check=False)
    fb = np.int64(spec.frame_nbytes(spec.frame, block))
    _loader.get_function("gc_ada_enc")(
        _grid(nsb), (_THREADS,),
        (x, keys, tiers, off, out) + head + (fb, np.int32(key is not None), np.uint64(key or 0), np.uint64(offset)))
    return out


def decode(message: Any, count: int, f: Format, block: int, out: Any, acc: bool) -> Any:
    """Decode the message of ``count`` > 0 values into float32 ``out`` (acc: ``out +=``);
    ValueError when a frame's choice bits do not give the row's tier counts."""
    cp = _cp()
    spec = _spec(f)
    nsb = -(-count // block)
    fb = np.int64(spec.frame_nbytes(spec.frame, block))
    tiers = cp.empty(nsb, cp.uint8)
    _loader.get_function("gc_ada_choices")(_grid(nsb, _THREADS), (_THREADS,),
                                           (message, tiers, np.int64(nsb), np.int32(spec.frame), fb))
    off = _offsets(tiers, nsb, spec, block, check=True)
    _loader.get_function("gc_ada_dec")(
        _grid(nsb), (_THREADS,),
        (message, tiers, off, out, np.int64(count), np.int32(block), np.int64(nsb), np.int32(spec.frame), fb,
         np.int32(acc)))
    return out
