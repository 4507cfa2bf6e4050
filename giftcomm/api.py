"""The public collectives: allreduce, gift_allreduce, reduce_scatter, allgather.

Each call: validate locally, agree across ranks in one small collective (same exception on every
rank on bad input), then run the ring with FP8 (or pass-through) wire messages.
"""
from __future__ import annotations

from typing import Any, Protocol

import ml_dtypes
import numpy as np

from . import codec
from .collectives import ring
from .collectives.agree import DTYPE_CODES, OP_CODES, agree
from .formats import DEFAULT_BLOCK, Format, check_block, get_format
from .partition import accumulation_dtype, chunk_bounds
from .transport import Transport, resolve

__all__ = ["allreduce", "gift_allreduce", "reduce_scatter", "allgather", "GeometryLike"]

_FLOAT_DTYPES = {np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)}
_FIELDS = ("count", "dtype", "fmt", "block", "op", "slice", "geometry")


class GeometryLike(Protocol):
    """What gift_allreduce needs of a geometry (see giftcomm.geometry.Geometry)."""

    size: int
    is_identity: bool

    def forward(self, flat: np.ndarray) -> np.ndarray: ...
    def inverse(self, flat: np.ndarray) -> np.ndarray: ...
    def fingerprint(self) -> int: ...


def _check_array(x: Any, name: str = "x") -> np.ndarray:
    if hasattr(x, "__cuda_array_interface__") and not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: device arrays are not supported by the NumPy path")
    arr = np.asarray(x)
    if arr.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got dtype {arr.dtype}")
    return arr


def _check_slice(slice_elems: int) -> int:
    if isinstance(slice_elems, bool) or not isinstance(slice_elems, (int, np.integer)) or slice_elems < 1:
        raise ValueError(f"slice_elems must be a positive int, got {slice_elems!r}")
    return int(slice_elems)


def _check_op(op: str) -> int:
    if op not in OP_CODES:
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    return OP_CODES[op]


def _check_out(out: Any, shape: tuple, dtype: np.dtype) -> None:
    if out is None:
        return
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a NumPy array, got {type(out).__name__}")
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(f"out must have shape {shape} and dtype {dtype}, got {out.shape} {out.dtype}")
    if not out.flags.writeable:
        raise ValueError("out is read-only")


def _finish(values: np.ndarray, op: str, p: int, dtype: np.dtype, shape: tuple, out: np.ndarray | None) -> np.ndarray:
    """Apply ``avg``, cast to the caller's dtype and shape, write ``out`` if given."""
    if op == "avg":
        values = values / values.dtype.type(p)
    if out is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            out[...] = values.reshape(shape)
        return out
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(dtype, copy=False).reshape(shape)


def gift_allreduce(
    x: Any,
    geometry: GeometryLike | None = None,
    *,
    comm: Any = None,
    op: str = "sum",
    fmt: str | Format = "e4m3",
    block: int = DEFAULT_BLOCK,
    out: np.ndarray | None = None,
    slice_elems: int = ring.DEFAULT_SLICE_ELEMS,
) -> np.ndarray:
    """Allreduce ``x`` across ranks, quantizing in the geometry's coordinates.

    x: float32/float64/float16/bfloat16 array of any shape (read as a flat vector; not modified
    unless it is ``out``). geometry: None or an identity geometry gives exactly :func:`allreduce`;
    otherwise ``inverse(ring_sum(forward(x)))`` with the transform in float32 (then ``/ P`` for
    ``op="avg"``). Returns an array of x's shape and dtype (``out`` if given), bit-identical on
    every rank. Raises TypeError/ValueError on every rank when any rank's input is bad or the
    ranks disagree (count, dtype, fmt, block, op, geometry fingerprint).
    """
    t = resolve(comm)

    def prepare():
        arr = _check_array(x)
        f, b, opc = get_format(fmt), check_block(block), _check_op(op)
        _check_out(out, arr.shape, arr.dtype)
        geo = None if geometry is None or geometry.is_identity else geometry
        if geo is not None and geo.size != arr.size:
            raise ValueError(f"geometry covers {geo.size} elements but x has {arr.size}")
        sig = dict(count=arr.size, dtype=DTYPE_CODES[arr.dtype.name], fmt=f.code, block=b, op=opc,
                   slice=_check_slice(slice_elems),
                   geometry=0 if geo is None else geo.fingerprint())
        return (arr, f, b, geo), sig

    (arr, f, b, geo), _ = agree(t, "giftcomm.allreduce", prepare, _FIELDS, _FIELDS)
    n, p = arr.size, t.size
    flat = np.ascontiguousarray(arr).reshape(-1)
    if geo is not None:
        flat = np.ascontiguousarray(geo.forward(flat), dtype=np.float32)
    acc_t = accumulation_dtype(flat.dtype)
    if n == 0:
        return _finish(np.zeros(0, acc_t), op, p, arr.dtype, arr.shape, out)
    bounds = chunk_bounds(n, p, b)
    _, own = ring.reduce_scatter(t, flat, bounds, f, b, acc_t, slice_elems)
    total = ring.allgather(t, own, np.diff(bounds), f, b, slice_elems)
    if geo is not None:
        total = np.asarray(geo.inverse(total), dtype=np.float32)
    return _finish(total.astype(acc_t, copy=False), op, p, arr.dtype, arr.shape, out)


def allreduce(
    x: Any,
    *,
    comm: Any = None,
    op: str = "sum",
    fmt: str | Format = "e4m3",
    block: int = DEFAULT_BLOCK,
    out: np.ndarray | None = None,
    slice_elems: int = ring.DEFAULT_SLICE_ELEMS,
) -> np.ndarray:
    """Sum (or average) ``x`` over all ranks with FP8 wire messages and fp32 accumulation.

    x: float32/float64/float16/bfloat16 array, any shape and size. fmt: "e4m3", "e5m2" (block-
    scaled FP8) or "bf16", "fp16", "fp32" (raw values on the wire). block: elements per scale.
    comm: mpi4py communicator, giftcomm Transport, or None for MPI.COMM_WORLD. Returns an array of
    x's shape and dtype, bit-identical on every rank and equal to
    ``giftcomm.reference.simulate_allreduce`` of all ranks' inputs.
    """
    return gift_allreduce(x, None, comm=comm, op=op, fmt=fmt, block=block, out=out, slice_elems=slice_elems)


def reduce_scatter(
    x: Any,
    *,
    comm: Any = None,
    op: str = "sum",
    fmt: str | Format = "e4m3",
    block: int = DEFAULT_BLOCK,
    out: np.ndarray | None = None,
    slice_elems: int = ring.DEFAULT_SLICE_ELEMS,
) -> np.ndarray:
    """This rank's shard of the sum of ``x`` over all ranks (1-D, x's dtype).

    The shard is chunk ``rank`` of ``giftcomm.partition.chunk_bounds(x.size, P, block)`` of the
    flattened buffer: whole blocks, dealt out evenly. It is the owner's high-precision sum, not
    re-quantized, so ``allgather(reduce_scatter(x))`` equals ``allreduce(x)`` bit for bit for
    float32/float64 input and ``op="sum"``.
    """
    t = resolve(comm)

    def prepare():
        arr = _check_array(x)
        f, b, opc = get_format(fmt), check_block(block), _check_op(op)
        bounds = chunk_bounds(arr.size, t.size, b)
        shard_n = int(bounds[t.rank + 1] - bounds[t.rank])
        _check_out(out, (shard_n,), arr.dtype)
        sig = dict(count=arr.size, dtype=DTYPE_CODES[arr.dtype.name], fmt=f.code, block=b, op=opc,
                   slice=_check_slice(slice_elems), geometry=0)
        return (arr, f, b, bounds), sig

    (arr, f, b, bounds), _ = agree(t, "giftcomm.reduce_scatter", prepare, _FIELDS, _FIELDS)
    acc_t = accumulation_dtype(arr.dtype)
    shard_n = int(bounds[t.rank + 1] - bounds[t.rank])
    if arr.size == 0:
        return _finish(np.zeros(0, acc_t), op, t.size, arr.dtype, (0,), out)
    flat = np.ascontiguousarray(arr).reshape(-1)
    total, _ = ring.reduce_scatter(t, flat, bounds, f, b, acc_t, slice_elems)
    return _finish(total, op, t.size, arr.dtype, (shard_n,), out)


def allgather(
    shard: Any,
    *,
    comm: Any = None,
    fmt: str | Format = "e4m3",
    block: int = DEFAULT_BLOCK,
    out: np.ndarray | None = None,
    slice_elems: int = ring.DEFAULT_SLICE_ELEMS,
) -> np.ndarray:
    """Concatenate every rank's shard (read flat; lengths may differ) into one 1-D array.

    Each shard is encoded once by its owner; every rank decodes the same bytes, so the result is
    bit-identical everywhere. The inverse of :func:`reduce_scatter`'s layout.
    """
    t = resolve(comm)

    def prepare():
        arr = _check_array(shard, "shard")
        f, b = get_format(fmt), check_block(block)
        if out is not None:
            _check_out(out, out.shape if isinstance(out, np.ndarray) else (), arr.dtype)
            if out.ndim != 1:
                raise ValueError(f"out must be 1-D, got shape {out.shape}")
        sig = dict(count=arr.size, dtype=DTYPE_CODES[arr.dtype.name], fmt=f.code, block=b,
                   slice=_check_slice(slice_elems), out=-1 if out is None else out.size)
        return (arr, f, b), sig

    fields = ("count", "dtype", "fmt", "block", "slice", "out")
    (arr, f, b), table = agree(t, "giftcomm.allgather", prepare, fields, ("dtype", "fmt", "block", "slice"))
    counts = table[:, 0]
    total_n = int(counts.sum())
    out_sizes = table[:, fields.index("out")]
    wrong = [r for r, m in enumerate(out_sizes) if m not in (-1, total_n)]
    if wrong:  # every rank sees the same table, so every rank raises this
        raise ValueError(f"giftcomm.allgather: out on rank(s) {wrong} does not hold the {total_n} gathered values")
    flat = np.ascontiguousarray(arr).reshape(-1)
    sl = ring.slice_chunk(flat.size, f, b, slice_elems)
    own = ring.encode_sliced(flat, sl, f, b, np.empty(sl.nbytes, np.uint8))
    values = ring.allgather(t, own, counts, f, b, slice_elems)
    return _finish(values, "sum", t.size, arr.dtype, (total_n,), out)
