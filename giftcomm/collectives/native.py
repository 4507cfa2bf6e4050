"""The ``native`` row of the algorithm table: the transport's own allreduce, uncompressed.

What is summed (:func:`kind_of`): a pass-through format names the values' type -- ``fp32``
float32, ``bf16`` bfloat16, ``fp16`` float16 (each rank's values rounded to it, nearest even;
the transport adds in that type, a 16-bit partial sum rounded at every addition); any
block-scaled format (``e4m3``, the default, and the others) means no compression at all: the
values in the accumulation dtype (float32; float64 for float64 input). So ``algorithm="auto"``
with ``fmt="e4m3"`` that takes the native path returns the float32 sum, and
``fmt="bf16", algorithm="native"`` is the transport's bf16 allreduce.

Which allreduce: :meth:`giftcomm.transport.Transport.native_sum` -- MPI_Allreduce, torch's
``all_reduce`` (gloo or NCCL), ``ncclAllReduce``; the loopback and other transports without a
collective of their own add the gathered arrays in MPICH's recursive-doubling order. The order
of the additions is the transport's: ``giftcomm.reference.simulate_allreduce(...,
algorithm="native")`` defines the result as that recursive-doubling order, which MPICH's
MPI_Allreduce follows (checked for MPICH 5.0 at P = 2..5 from 16 bytes to 16 MiB; docs/api.md,
Native path); gloo's ring and NCCL add in other orders, within (P - 1) units of rounding of the
sum of magnitudes.

Bit-identical on every rank (DESIGN invariant 1): the transports do not promise it, so the
first call of each (count, kind) on a transport checks it -- a 64-bit BLAKE2b digest of the
result from every rank (one allgather of an int64). Equal digests: that (count, kind) is
trusted from then on (MPICH, gloo and NCCL compute each element in one fixed tree or ring, so it
stays so). Different: rank 0's result is broadcast to every rank, on that call and on every later
one of that (count, kind), and one warning says so. The check costs, once per size, one pass
over the result (BLAKE2b: about 1 GB/s) and one small allgather.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any

import numpy as np

from .. import _xp
from ..formats import Format
from ..transport import Transport
from .wire import Wire

__all__ = ["kind_of", "allreduce", "reduce_scatter"]

log = logging.getLogger("giftcomm")

_PASS_THROUGH = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def kind_of(fmt: Format, acc_t: Any) -> str:
    """What the native path sums for wire format ``fmt`` and accumulation dtype ``acc_t``: a
    pass-through format's type, else "float32" (or "float64" for float64 input)."""
    if not fmt.scaled:
        return _PASS_THROUGH[fmt.name]
    return "float64" if np.dtype(acc_t) == np.float64 else "float32"


_WIDE = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}


def _as_kind(flat: Any, kind: str) -> Any:
    """``flat`` (float32 or float64; host bfloat16 or float16 as they are) as a contiguous array of
    ``kind`` (device bfloat16: uint16 bits), rounded to nearest even (to a 16-bit kind through
    float32, as the reference does); ``flat`` itself when it already is one (the transports only
    read it)."""
    wide = _WIDE.get(kind)
    if wide is not None and flat.dtype == wide:  # the common case, cheaply (dtype.name costs ~1 us)
        return flat
    if flat.dtype.name == ("bfloat16" if kind == "bfloat16" else np.dtype(kind).name):
        return flat
    if wide is not None:
        return _xp.astype(flat, np.dtype(kind))
    wide = _xp.astype(flat, np.float32, copy=False)
    return _xp.from_float32(wide, "bfloat16") if kind == "bfloat16" else _xp.astype(wide, np.float16)


def _widened(total: Any, kind: str, acc_t: Any) -> Any:
    """The native sum as the accumulation dtype (bfloat16 bits widened exactly)."""
    if total.dtype == acc_t:
        return total
    if kind == "bfloat16" and total.dtype == np.uint16:
        total = _xp.to_float32(total, "bfloat16")
    return _xp.astype(total, acc_t, copy=False)


def _digest(total: Any) -> int:
    host = total.get() if hasattr(total, "get") and not isinstance(total, np.ndarray) else total
    data = np.ascontiguousarray(host).view(np.uint8)
    return int.from_bytes(hashlib.blake2b(data.data, digest_size=8).digest(), "little", signed=True)


def _same_everywhere(t: Transport, total: Any, kind: str) -> Any:
    """``total`` made identical on every rank: checked once per (count, kind) (module docstring),
    rank 0's broadcast where the check failed."""
    key = (int(total.size), kind)
    trusted = t.state.native.get(key)
    if trusted is None:
        table = t.allgather_int64(np.array([_digest(total)], np.int64))[:, 0]
        trusted = t.state.native[key] = bool((table == table[0]).all())
        if not trusted:
            log.warning("giftcomm: the transport's own allreduce (%s) of %d %s values gave the ranks different "
                        "bytes; rank 0's result is broadcast on this and every later call of this size",
                        type(t).__name__, total.size, kind)
    if not trusted:
        t.native_broadcast(total, 0)
    return total


def allreduce(t: Transport, flat: Any, wire: Wire, acc_t: Any, into: Any = None) -> Any:
    """The native sum over all ranks of ``flat`` (this rank's (n,) values, not modified), as
    ``acc_t`` (float32 or float64): the same bytes on every rank. ``into``: a float32 (n,) array
    (the caller's ``out``) the transport sums into when the kind is float32 (no copy), else
    unused; the result is then ``into`` itself."""
    kind = kind_of(wire.fmt, acc_t)
    values = _as_kind(flat, kind)
    target = into if into is not None and kind == "float32" and into.dtype == np.float32 else None
    if target is not None and _xp.array_module(target).may_share_memory(target, values):  # out=x: no aliasing
        target = None
    total = _same_everywhere(t, t.native_sum(values, kind, target), kind)
    return _widened(total, kind, acc_t)


def reduce_scatter(t: Transport, flat: Any, bounds: np.ndarray, wire: Wire, acc_t: Any,
                   slice_n: int = 0) -> tuple[Any, None]:
    """This rank's chunk ``[bounds[rank], bounds[rank + 1])`` of :func:`allreduce` (the
    transport's whole allreduce: its reduce-scatter alone would add in another order), and
    None (the shape of the other rows' reduce-scatters)."""
    total = allreduce(t, flat, wire, acc_t)
    return total[int(bounds[t.rank]) : int(bounds[t.rank + 1])].copy(), None
