"""The public collectives: allreduce, gift_allreduce, reduce_scatter, allgather.

Each call: validate locally, agree across ranks in one small collective (the same exception on
every rank on bad input), pick the algorithm, then move FP8 (or pass-through) wire messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import ml_dtypes
import numpy as np

from .collectives import direct, doubling, hierarchical, ring, shared
from .collectives.agree import DTYPE_CODES, OP_CODES, agree
from .costmodel import Topology, choose
from .device_api import device_allgather, device_allreduce, device_reduce_scatter, is_device_input
from .formats import DEFAULT_BLOCK, Format, check_block, get_format
from .partition import accumulation_dtype, shared_chunk_bounds
from .collectives.workspace import workspace_of
from .transport import Transport, resolve

__all__ = ["allreduce", "gift_allreduce", "reduce_scatter", "allgather", "GeometryLike", "ALGORITHMS"]

_FLOAT_DTYPES = {np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)}
_DTYPE_CODE = {d: DTYPE_CODES[d.name] for d in _FLOAT_DTYPES}  # by dtype: dtype.name costs ~5 us a call
ALGORITHMS = ("auto", "ring", "direct", "doubling", "hierarchical", "hierarchical_direct")
_ALGO_CODES = {name: code for code, name in enumerate(ALGORITHMS)}
_FIELDS = ("count", "dtype", "fmt", "block", "op", "slice", "geometry", "algorithm", "local_size", "shared_memory",
           "chosen")
_MATCH = _FIELDS[:-1]  # "chosen" may differ (auto on different calibrations): rank 0's choice wins


class GeometryLike(Protocol):
    """What gift_allreduce needs of a geometry (see giftcomm.geometry.Geometry)."""

    size: int
    is_identity: bool

    def forward(self, flat: np.ndarray) -> np.ndarray: ...
    def inverse(self, flat: np.ndarray) -> np.ndarray: ...
    def fingerprint(self) -> int: ...


@dataclass
class _Call:
    """A validated call: the input array, format, block and the rest of the signature."""

    arr: np.ndarray
    fmt: Format
    block: int
    sig: dict[str, int]


def _check_array(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x)  # device arrays never get here: each public function routes them first
    if arr.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got dtype {arr.dtype}")
    return arr


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_out(out: Any, shape: tuple | None, dtype: np.dtype) -> None:
    """``out`` must be a writable NumPy array of ``dtype`` (and ``shape`` unless None)."""
    if out is None:
        return
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a NumPy array, got {type(out).__name__}")
    if (shape is not None and out.shape != shape) or out.dtype != dtype:
        raise ValueError(f"out must have shape {shape} and dtype {dtype}, got {out.shape} {out.dtype}")
    if not out.flags.writeable:
        raise ValueError("out is read-only")


def _validate(x: Any, name: str, fmt: Any, block: Any, op: str | None, slice_elems: Any) -> _Call:
    """The checks every collective shares; raises TypeError/ValueError (caught by ``agree``)."""
    arr = _check_array(x, name)
    f, b = get_format(fmt), check_block(block)
    if op is not None and op not in OP_CODES:
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    sig = dict(count=arr.size, dtype=_DTYPE_CODE[arr.dtype], fmt=f.code, block=b,
               op=OP_CODES.get(op, 0),
               slice=0 if slice_elems is None else _positive_int(slice_elems, "slice_elems"),
               geometry=0, algorithm=0, local_size=0, shared_memory=0, chosen=0)
    return _Call(arr, f, b, sig)


def _node_layout(t: Transport, local_size: int | None) -> np.ndarray:
    if local_size is None:
        return t.node_ids()
    return hierarchical.contiguous_nodes(t.size, _positive_int(local_size, "local_size"))


def _topology(t: Transport, local_size: int | None) -> tuple[np.ndarray, Topology]:
    """The node of every rank and the Topology (local_size 0: uneven nodes); kept on the
    transport per ``local_size``, since the layout of a communicator does not change."""
    if local_size is not None:
        local_size = _positive_int(local_size, "local_size")
    cache = t.__dict__.setdefault("_giftcomm_topology", {})
    if local_size not in cache:
        nodes = _node_layout(t, local_size)
        groups = hierarchical.node_groups(nodes)
        uniform = len({len(g) for g in groups}) == 1
        cache[local_size] = nodes, Topology(t.size, len(groups), len(groups[0]) if uniform else 0)
    return cache[local_size]


def _plan_algorithm(t: Transport, call: _Call, algorithm: str, local_size: int | None,
                    allowed: tuple[str, ...]) -> np.ndarray:
    """Validate ``algorithm``/``local_size``, record the choice in the signature; the node layout."""
    if algorithm not in allowed:
        raise ValueError(f"algorithm must be one of {', '.join(allowed)}; got {algorithm!r}")
    nodes, topo = _topology(t, local_size)
    if algorithm.startswith("hierarchical") and topo.local_size == 0:
        hierarchical.check_uniform(nodes)  # raises, naming the node sizes
    chosen = algorithm
    if algorithm == "auto":
        chosen = choose(call.arr.size, topo, call.fmt.name, call.block)
        chosen = chosen if chosen in allowed else "ring"
    call.sig.update(algorithm=_ALGO_CODES[algorithm], local_size=local_size or 0, chosen=_ALGO_CODES[chosen])
    return nodes


def _finish(values: np.ndarray, op: str, p: int, dtype: np.dtype, shape: tuple, out: np.ndarray | None) -> np.ndarray:
    """Apply ``avg``, cast to the caller's dtype and shape, write ``out`` if given."""
    if op == "avg":
        values = values / values.dtype.type(p)
    with np.errstate(over="ignore", invalid="ignore"):
        if out is not None:
            out[...] = values.reshape(shape)
            return out
        return values.astype(dtype, copy=False).reshape(shape)


def _auto_slice(t: Transport, n: int) -> int:
    """The pipelining slice for ``n`` values over ``t`` (ring.auto_slice_elems; one node per the
    transport's own node layout, kept by :func:`_topology`)."""
    return ring.auto_slice_elems(n, t.size, one_node=_topology(t, None)[1].nodes == 1)


def _allreduce_flat(t: Transport, flat: np.ndarray, fmt: Format, block: int, algorithm: str,
                    nodes: np.ndarray, slice_elems: int, out: np.ndarray | None = None) -> np.ndarray:
    """The sum of ``flat`` over all ranks, decoded (float32), by the chosen algorithm.

    ``out``: an optional float32 (size,) array the ring and direct algorithms decode into
    directly (no fresh result array: at 16 MiB its page faults cost more than the decode).
    """
    acc_t = accumulation_dtype(flat.dtype)
    bounds = shared_chunk_bounds(flat.size, t.size, block)
    if t.shared_memory and algorithm in ("ring", "direct"):
        total = shared.allreduce(t, flat, bounds, fmt, block, acc_t, slice_elems, direct=algorithm == "direct", out=out)
        if total is not None:  # None: no room for the window (every rank alike); send messages
            return total
    if algorithm == "doubling":
        return doubling.allreduce(t, flat, fmt, block, acc_t)
    if algorithm.startswith("hierarchical"):
        inter = "direct" if algorithm == "hierarchical_direct" else "ring"
        return hierarchical.allreduce(t, flat, nodes, fmt, block, acc_t, slice_elems, inter=inter)
    rs = direct.reduce_scatter if algorithm == "direct" else ring.reduce_scatter
    return ring.allreduce(t, flat, bounds, fmt, block, acc_t, slice_elems, out=out, scatter=rs)


def _direct_out(out: np.ndarray | None) -> np.ndarray | None:
    """``out`` as a flat float32 view the collective can decode into, or None when it cannot
    (no out, another dtype, not contiguous)."""
    if out is None or out.dtype != np.float32 or not out.flags.c_contiguous:
        return None
    return out.reshape(-1)


def _is_giftcomm_geometry(geo: GeometryLike) -> bool:
    from .geometry import Geometry  # lazy: the geometry package is optional for plain allreduce

    return isinstance(geo, Geometry)


def _geometry_forward(t: Transport, geo: GeometryLike, flat: np.ndarray) -> np.ndarray:
    """``geo.forward(flat)`` as float32; a giftcomm Geometry writes into a workspace buffer that
    is reused across calls (a fresh one costs page faults comparable to the transform itself,
    perf/results/gift-cost.md)."""
    if _is_giftcomm_geometry(geo):
        return geo.forward(flat, out=workspace_of(t).get("gift_forward", 4 * flat.size).view(np.float32))
    return np.ascontiguousarray(geo.forward(flat), dtype=np.float32)


def _geometry_inverse(geo: GeometryLike, total: np.ndarray) -> np.ndarray:
    """``geo.inverse(total)``; in place for a giftcomm Geometry (``total`` belongs to this call:
    the caller's ``out`` or a fresh result)."""
    if _is_giftcomm_geometry(geo):
        return geo.inverse(total, out=total)
    return np.asarray(geo.inverse(total), dtype=np.float32)


def gift_allreduce(
    x: Any,
    geometry: GeometryLike | None = None,
    *,
    comm: Any = None,
    op: str = "sum",
    fmt: str | Format = "e4m3",
    block: int = DEFAULT_BLOCK,
    out: np.ndarray | None = None,
    algorithm: str = "auto",
    local_size: int | None = None,
    slice_elems: int | None = None,
) -> np.ndarray:
    """Allreduce ``x`` across ranks, quantizing in the geometry's coordinates.

    x: float32/float64/float16/bfloat16 array of any shape (read as a flat vector; not modified
    unless it is ``out``). geometry: None or an identity geometry gives exactly :func:`allreduce`;
    otherwise ``inverse(sum(forward(x)))`` with the transform in float32 (then ``/ P`` for
    ``op="avg"``). Returns an array of x's shape and dtype (``out`` if given), bit-identical on
    every rank. Raises TypeError/ValueError on every rank when any rank's input is bad or the
    ranks disagree (count, dtype, fmt, block, op, slice, algorithm, local_size, geometry).
    """
    if is_device_input(x):
        return device_allreduce(x, geometry, comm, op, fmt, block, out, algorithm, local_size, slice_elems)
    t = resolve(comm)
    nodes_box: list[np.ndarray] = []

    def prepare():
        call = _validate(x, "x", fmt, block, op, slice_elems)
        _check_out(out, call.arr.shape, call.arr.dtype)
        geo = None if geometry is None or geometry.is_identity else geometry
        if geo is not None:
            if geo.size != call.arr.size:
                raise ValueError(f"geometry covers {geo.size} elements but x has {call.arr.size}")
            call.sig["geometry"] = int(geo.fingerprint())
        nodes_box.append(_plan_algorithm(t, call, algorithm, local_size, ALGORITHMS))
        call.sig["shared_memory"] = int(t.shared_memory)
        return (call, geo), call.sig

    (call, geo), table = agree(t, "giftcomm.allreduce", prepare, _FIELDS, _MATCH)
    chosen = ALGORITHMS[int(table[0, _FIELDS.index("chosen")])]
    arr, p = call.arr, t.size
    flat = np.ascontiguousarray(arr).reshape(-1)
    if geo is not None:
        flat = _geometry_forward(t, geo, flat)
    acc_t = accumulation_dtype(flat.dtype)
    if arr.size == 0:
        return _finish(np.zeros(0, acc_t), op, p, arr.dtype, arr.shape, out)
    slice_n = slice_elems or _auto_slice(t, arr.size)
    direct_out = _direct_out(out)
    total = _allreduce_flat(t, flat, call.fmt, call.block, chosen, nodes_box[0], slice_n, direct_out)
    if geo is not None:
        total = _geometry_inverse(geo, total)
    if direct_out is not None and total is direct_out:
        if op == "avg":
            total /= np.float32(p)
        return out
    return _finish(total.astype(acc_t, copy=False), op, p, arr.dtype, arr.shape, out)


def allreduce(
    x: Any,
    *,
    comm: Any = None,
    op: str = "sum",
    fmt: str | Format = "e4m3",
    block: int = DEFAULT_BLOCK,
    out: np.ndarray | None = None,
    algorithm: str = "auto",
    local_size: int | None = None,
    slice_elems: int | None = None,
) -> np.ndarray:
    """Sum (or average) ``x`` over all ranks with FP8 wire messages and fp32 accumulation.

    x: float32/float64/float16/bfloat16 array, any shape and size. fmt: "e4m3", "e5m2" (block-
    scaled FP8) or "bf16", "fp16", "fp32" (raw values on the wire). block: elements per scale.
    comm: mpi4py communicator, giftcomm Transport, or None for MPI.COMM_WORLD. algorithm: "ring",
    "direct", "doubling", "hierarchical", "hierarchical_direct" or "auto" (cost model);
    local_size: ranks per node for the hierarchical algorithms (default: from the MPI library).
    Returns an array of x's shape and dtype, bit-identical on every rank and equal to
    ``giftcomm.reference.simulate_allreduce`` of all ranks' inputs with the same algorithm.
    """
    return gift_allreduce(x, None, comm=comm, op=op, fmt=fmt, block=block, out=out, algorithm=algorithm,
                          local_size=local_size, slice_elems=slice_elems)


def reduce_scatter(
    x: Any,
    *,
    comm: Any = None,
    op: str = "sum",
    fmt: str | Format = "e4m3",
    block: int = DEFAULT_BLOCK,
    out: np.ndarray | None = None,
    algorithm: str = "ring",
    slice_elems: int | None = None,
) -> np.ndarray:
    """This rank's shard of the sum of ``x`` over all ranks (1-D, x's dtype).

    The shard is chunk ``rank`` of ``giftcomm.chunk_bounds(x.size, P, block)`` of the flattened
    buffer: whole blocks, dealt out evenly. It is the owner's high-precision sum, not re-quantized,
    so ``allgather(reduce_scatter(x))`` equals ``allreduce(x)`` (same algorithm) bit for bit for
    float32/float64 input and ``op="sum"``. algorithm: "ring", "direct" or "auto".
    """
    if is_device_input(x):
        return device_reduce_scatter(x, comm, op, fmt, block, out, algorithm, slice_elems)
    t = resolve(comm)

    def prepare():
        call = _validate(x, "x", fmt, block, op, slice_elems)
        bounds = shared_chunk_bounds(call.arr.size, t.size, call.block)
        _check_out(out, (int(bounds[t.rank + 1] - bounds[t.rank]),), call.arr.dtype)
        _plan_algorithm(t, call, algorithm, None, ("auto", "ring", "direct"))
        return (call, bounds), call.sig

    (call, bounds), table = agree(t, "giftcomm.reduce_scatter", prepare, _FIELDS, _MATCH)
    chosen = ALGORITHMS[int(table[0, _FIELDS.index("chosen")])]
    arr = call.arr
    acc_t = accumulation_dtype(arr.dtype)
    shard_n = int(bounds[t.rank + 1] - bounds[t.rank])
    if arr.size == 0:
        return _finish(np.zeros(0, acc_t), op, t.size, arr.dtype, (0,), out)
    rs = direct.reduce_scatter if chosen == "direct" else ring.reduce_scatter
    slice_n = slice_elems or _auto_slice(t, arr.size)
    total, _ = rs(t, np.ascontiguousarray(arr).reshape(-1), bounds, call.fmt, call.block, acc_t, slice_n)
    return _finish(total, op, t.size, arr.dtype, (shard_n,), out)


_GATHER_FIELDS = ("count", "dtype", "fmt", "block", "slice", "out")  # allgather's agreed signature
_GATHER_MATCH = ("dtype", "fmt", "block", "slice")


def _gathered_counts(table: np.ndarray) -> tuple[np.ndarray, int]:
    """Every rank's shard length and their total, from allgather's agreed table (host and device
    path). Raises ValueError when a rank's ``out`` does not hold the total: every rank sees the
    same table, so every rank raises it."""
    counts = table[:, 0]
    total_n = int(counts.sum())
    wrong = [r for r, m in enumerate(table[:, _GATHER_FIELDS.index("out")]) if m not in (-1, total_n)]
    if wrong:
        raise ValueError(f"giftcomm.allgather: out on rank(s) {wrong} does not hold the {total_n} gathered values")
    return counts, total_n


def allgather(
    shard: Any,
    *,
    comm: Any = None,
    fmt: str | Format = "e4m3",
    block: int = DEFAULT_BLOCK,
    out: np.ndarray | None = None,
    slice_elems: int | None = None,
) -> np.ndarray:
    """Concatenate every rank's shard (read flat; lengths may differ) into one 1-D array.

    Each shard is encoded once by its owner; every rank decodes the same bytes, so the result is
    bit-identical everywhere. The inverse of :func:`reduce_scatter`'s layout. ``out``: a 1-D
    array of the shard's dtype holding all the gathered values.
    """
    if is_device_input(shard):
        return device_allgather(shard, comm, fmt, block, out, slice_elems)
    t = resolve(comm)

    def prepare():
        call = _validate(shard, "shard", fmt, block, None, slice_elems)
        _check_out(out, None, call.arr.dtype)
        if out is not None and out.ndim != 1:
            raise ValueError(f"out must be 1-D, got shape {out.shape}")
        sig = {k: call.sig.get(k, 0) for k in _GATHER_FIELDS}
        sig["out"] = -1 if out is None else out.size
        return call, sig

    call, table = agree(t, "giftcomm.allgather", prepare, _GATHER_FIELDS, _GATHER_MATCH)
    counts, total_n = _gathered_counts(table)
    flat = np.ascontiguousarray(call.arr).reshape(-1)
    slice_n = slice_elems or _auto_slice(t, total_n)
    sl = ring.slice_chunk(flat.size, call.fmt, call.block, slice_n)
    own = ring.encode_sliced(flat, sl, call.fmt, call.block, np.empty(sl.nbytes, np.uint8))
    values = ring.allgather(t, own, counts, call.fmt, call.block, slice_n)
    return _finish(values, "sum", t.size, call.arr.dtype, (total_n,), out)
