"""The public collectives: allreduce, gift_allreduce, reduce_scatter, allgather.

One code path for every array: NumPy, CuPy, torch tensors (CPU or CUDA), JAX arrays and other
DLPack producers are imported zero-copy (giftcomm._xp) and the result goes back in the caller's
framework. Each call:

1. plans and validates on every rank, then agrees across ranks in one small collective
   (giftcomm.collectives.plan / agree): bad input on any rank raises the same exception on
   every rank;
2. runs the chosen algorithm (giftcomm.collectives) over the transport, with the codec kernels of
   the array's backend (native C or NumPy on the host, CUDA on the device); the transport's
   schedule (pipelined or grouped) decides how each hop's messages are posted;
3. applies ``avg``, casts to the input's dtype and writes ``out`` or returns a new array.
"""
from __future__ import annotations

import logging
from typing import Any, Protocol

import numpy as np

from .collectives import direct, doubling, hierarchical, oneshot, ring, shared
from .collectives import plan as planning
from .collectives.agree import agree, confirm
from .collectives.plan import ALGORITHMS, FIELDS, GATHER_FIELDS, GATHER_MATCH, MATCH, Call
from .collectives.wire import Wire
from .collectives.workspace import workspace_of
from .formats import Format
from .partition import accumulation_dtype, shared_chunk_bounds
from .transport import DEVICE, Transport, resolve
from . import _xp
from ._xp import is_device_array

__all__ = ["allreduce", "gift_allreduce", "reduce_scatter", "allgather", "GeometryLike", "ALGORITHMS"]

log = logging.getLogger("giftcomm")


class GeometryLike(Protocol):
    """What gift_allreduce needs of a geometry (see giftcomm.geometry.Geometry)."""

    size: int
    is_identity: bool

    def forward(self, flat: Any) -> Any: ...
    def inverse(self, flat: Any) -> Any: ...
    def fingerprint(self) -> int: ...


class held:
    """Hold ``t`` for one call (calls from several threads run one at a time; docs/api.md,
    Threads), with its waits' deadline set to ``timeout`` seconds when given."""

    __slots__ = ("_t", "_timeout", "_previous")

    def __init__(self, t: Transport, timeout: float | None) -> None:
        self._t, self._timeout = t, timeout
        self._previous: float = 0.0

    def __enter__(self) -> None:
        self._t.state.lock.acquire()
        if self._timeout is not None:
            self._previous, self._t.timeout = self._t.timeout, self._timeout

    def __exit__(self, *exc: object) -> None:
        if self._timeout is not None:
            self._t.timeout = self._previous
        self._t.state.lock.release()


def _allreduce_flat(t: Transport, flat: Any, wire: Wire, algorithm: str, nodes: np.ndarray, slice_elems: int,
                    out: Any = None) -> Any:
    """The sum of ``flat`` over all ranks, decoded (float32), by the chosen algorithm.

    ``out``: an optional float32 (size,) array the ring, direct and doubling algorithms decode
    into directly (no fresh result array: at 16 MiB its page faults cost more than the decode).
    """
    acc_t = accumulation_dtype(flat.dtype)
    bounds = shared_chunk_bounds(flat.size, t.size, wire.block)
    if t.shared_memory and t.memory != DEVICE and wire.xp is np and algorithm in ("ring", "direct"):
        total = shared.allreduce(t, flat, bounds, wire, acc_t, slice_elems, direct=algorithm == "direct", out=out)
        if total is not None:  # None: no room for the window (every rank alike); send messages
            return total
    if algorithm == "doubling":
        return doubling.allreduce(t, flat, wire, acc_t, out=out)
    if algorithm == "oneshot":
        return oneshot.allreduce(t, flat, wire, acc_t, out=out if acc_t == np.float32 else None)
    if algorithm.startswith("hierarchical"):
        inter = "direct" if algorithm == "hierarchical_direct" else "ring"
        return hierarchical.allreduce(t, flat, nodes, wire, acc_t, slice_elems, inter=inter)
    rs = direct.reduce_scatter if algorithm == "direct" else ring.reduce_scatter
    return ring.allreduce(t, flat, bounds, wire, acc_t, slice_elems, out=out, scatter=rs)


def _is_giftcomm_geometry(geo: GeometryLike) -> bool:
    from .geometry import Geometry  # lazy: the geometry package is optional for plain allreduce

    return isinstance(geo, Geometry)


def _geometry_forward(t: Transport, geo: GeometryLike, flat: Any, xp: Any) -> Any:
    """``geo.forward(flat)`` as float32 of ``flat``'s backend; a giftcomm Geometry writes into a
    workspace buffer that is reused across calls (a fresh one costs page faults comparable to the
    transform itself)."""
    if _is_giftcomm_geometry(geo):
        buf = workspace_of(t, xp).get("gift_forward", 4 * flat.size).view(np.float32)
        return geo.forward(flat, out=buf)  # type: ignore[call-arg]
    return xp.ascontiguousarray(xp.asarray(geo.forward(flat), dtype=np.float32))


def _checked(values: Any, n: int, what: str) -> Any:
    """``values`` when it is a float32 (n,) array, else ValueError naming ``what``."""
    if tuple(values.shape) != (n,) or values.dtype != np.float32:
        raise ValueError(f"{what} returned shape {tuple(values.shape)} dtype {values.dtype}; expected ({n},) float32")
    return values


def _geometry_inverse(geo: GeometryLike, total: Any, xp: Any) -> Any:
    """``geo.inverse(total)``; in place for a giftcomm Geometry (``total`` belongs to this call:
    the caller's ``out`` or a fresh result)."""
    if _is_giftcomm_geometry(geo):
        return geo.inverse(total, out=total)  # type: ignore[call-arg]
    return _checked(xp.ascontiguousarray(xp.asarray(geo.inverse(total), dtype=np.float32)), total.size,
                    "geometry.inverse")


def gift_allreduce(
    x: Any,
    geometry: GeometryLike | None = None,
    *,
    comm: Any = None,
    op: str = "sum",
    fmt: str | Format = "e4m3",
    block: int | None = None,
    out: Any = None,
    algorithm: str = "auto",
    local_size: int | None = None,
    slice_elems: int | None = None,
    rounding: str = "nearest",
    seed: int | None = None,
    timeout: float | None = None,
) -> Any:
    """Allreduce ``x`` across ranks, quantizing in the geometry's coordinates.

    x: float32/float64/float16/bfloat16 array of any shape (NumPy, CuPy, torch, JAX or another
    DLPack producer; read as a flat vector; not modified unless it is ``out``). geometry: None or
    an identity geometry gives exactly :func:`allreduce`; otherwise ``inverse(sum(forward(x)))``
    with the transform in float32 on x's backend (then ``/ P`` for ``op="avg"``). Returns an
    array of x's shape and dtype in x's framework (``out`` if given), bit-identical on every
    rank. Raises TypeError/ValueError on every rank when any rank's input is bad or the ranks
    disagree (count, dtype, fmt, block, op, slice, algorithm, local_size, geometry).
    """
    t = resolve(comm, device=is_device_array(x))
    with held(t, timeout):
        call, geo, chosen, nodes = agree_allreduce(t, planning.caller(), x, geometry, op, fmt, block, out, algorithm,
                                                   local_size, slice_elems, rounding, seed)
        return run_allreduce(t, call, geo, chosen, nodes, slice_elems or planning.auto_slice(t, max(call.arr.size, 1)),
                             out)


def agree_allreduce(t: Transport, caller: int, x: Any, geometry: GeometryLike | None, op: str, fmt: Any,
                    block: int | None, out: Any, algorithm: str, local_size: int | None, slice_elems: int | None,
                    rounding: str = "nearest", seed: int | None = None) -> tuple[Call, Any, str, np.ndarray]:
    """Validate and agree on one allreduce (collective): (call, geometry or None, the algorithm
    every rank runs, the node layout)."""
    nodes_box: list[np.ndarray] = []

    def prepare() -> tuple[tuple[Call, Any], dict[str, int]]:
        call = planning.validate(x, "x", fmt, block, op, slice_elems, rounding=rounding, seed=seed)
        call.sig["caller"] = caller
        planning.check_transport(t, call)
        planning.check_out(call, out, tuple(call.arr.shape))
        geo = None if geometry is None or geometry.is_identity else geometry
        if geo is not None:
            if geo.size != call.arr.size:
                raise ValueError(f"geometry covers {geo.size} elements but x has {call.arr.size}")
            call.sig["geometry"] = int(geo.fingerprint())
        nodes_box.append(planning.plan_algorithm(t, call, algorithm, local_size))
        call.sig["shared_memory"] = int(t.shared_memory)
        return (call, geo), call.sig

    (call, geo), table = agree(t, "giftcomm.allreduce", prepare, FIELDS, MATCH)
    chosen = planning.chosen_algorithm(table)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("allreduce rank %d/%d: %d %s values, fmt %s block %d, algorithm %s (asked %s), slice %s, "
                  "shared window %s, %s transport", t.rank, t.size, call.arr.size, call.imp.logical, call.fmt.name,
                  call.block, chosen, algorithm, slice_elems or "auto", bool(t.shared_memory), t.schedule)
    return call, geo, chosen, nodes_box[0]


def run_allreduce(t: Transport, call: Call, geo: Any, algorithm: str, nodes: np.ndarray, slice_n: int,
                  out: Any) -> Any:
    """Move the data of an agreed allreduce and finish it (avg, dtype, ``out`` or a new array)."""
    xp, n, shape = call.xp, call.arr.size, tuple(call.arr.shape)
    flat = planning.flat_values(call)
    if geo is not None:  # the forward transform can fail on some ranks: they all learn it
        flat = confirm(t, "giftcomm.gift_allreduce: geometry.forward",
                       lambda: _checked(_geometry_forward(t, geo, flat, xp), n, "geometry.forward"))
    if n == 0:
        return planning.finish(xp.zeros(0, accumulation_dtype(flat.dtype)), call, t.size, shape, out)
    into = planning.direct_out(call)
    total = _allreduce_flat(t, flat, call.wire(t.rank), algorithm, nodes, slice_n, into)
    if geo is not None:
        total = _geometry_inverse(geo, total, xp)
    if into is not None and total is into:
        if call.op == "avg":
            planning.divide(total, t.size)
        return out
    return planning.finish(_xp.astype(total, accumulation_dtype(flat.dtype), copy=False), call, t.size, shape, out)


def allreduce(
    x: Any,
    *,
    comm: Any = None,
    op: str = "sum",
    fmt: str | Format = "e4m3",
    block: int | None = None,
    out: Any = None,
    algorithm: str = "auto",
    local_size: int | None = None,
    slice_elems: int | None = None,
    rounding: str = "nearest",
    seed: int | None = None,
    timeout: float | None = None,
) -> Any:
    """Sum (or average) ``x`` over all ranks with FP8 wire messages and fp32 accumulation.

    x: float32/float64/float16/bfloat16 array, any shape and size, of any framework (NumPy, CuPy,
    torch CPU/CUDA, JAX; the result comes back in the same one). fmt: "e4m3", "e5m2" (block-scaled
    FP8), "mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4" (microscaling and 4-bit) or "bf16", "fp16",
    "fp32" (raw values on the wire). block: elements per scale (None: the format's own, 16 for
    nvfp4, 32 for MX, 256 otherwise; MX and nvfp4 take only their own). rounding: "nearest" or
    "stochastic" (scaled formats; unbiased, with ``seed``, an int identifying the call such as the
    training step: the same seed gives the same bytes on every run and rank). comm:
    mpi4py communicator (None: MPI.COMM_WORLD; device arrays then go over NCCL), or a giftcomm
    Transport. algorithm: "ring", "direct", "doubling", "hierarchical", "hierarchical_direct",
    "oneshot" (small messages: one exchange, each contribution quantized once) or "auto" (the
    cost model's choice among the first five); local_size: ranks per node for the hierarchical
    algorithms (default: from the transport). timeout: seconds each wait of this call may wait
    for its peers (default: the transport's, $GIFTCOMM_TIMEOUT; docs/robustness.md). Returns an
    array of x's shape and dtype, bit-identical on every rank and equal to
    ``giftcomm.reference.simulate_allreduce`` of all ranks' inputs with the same algorithm.
    """
    return gift_allreduce(x, None, comm=comm, op=op, fmt=fmt, block=block, out=out, algorithm=algorithm,
                          local_size=local_size, slice_elems=slice_elems, rounding=rounding, seed=seed,
                          timeout=timeout)


def reduce_scatter(
    x: Any,
    *,
    comm: Any = None,
    op: str = "sum",
    fmt: str | Format = "e4m3",
    block: int | None = None,
    out: Any = None,
    algorithm: str = "ring",
    slice_elems: int | None = None,
    rounding: str = "nearest",
    seed: int | None = None,
    timeout: float | None = None,
) -> Any:
    """This rank's shard of the sum of ``x`` over all ranks (1-D, x's dtype and framework).

    The shard is chunk ``rank`` of ``giftcomm.chunk_bounds(x.size, P, block)`` of the flattened
    buffer: whole blocks, dealt out evenly. It is the owner's high-precision sum, not re-quantized,
    so ``allgather(reduce_scatter(x))`` equals ``allreduce(x)`` (same algorithm) bit for bit for
    float32/float64 input and ``op="sum"``. algorithm: "ring", "direct" or "auto".
    """
    t = resolve(comm, device=is_device_array(x))
    with held(t, timeout):
        caller = planning.caller()

        def prepare() -> tuple[tuple[Call, np.ndarray], dict[str, int]]:
            call = planning.validate(x, "x", fmt, block, op, slice_elems, rounding=rounding, seed=seed)
            call.sig["caller"] = caller
            planning.check_transport(t, call)
            bounds = shared_chunk_bounds(call.arr.size, t.size, call.block)
            planning.check_out(call, out, (int(bounds[t.rank + 1] - bounds[t.rank]),))
            planning.plan_algorithm(t, call, algorithm, None, ("auto", "ring", "direct"))
            return (call, bounds), call.sig

        (call, bounds), table = agree(t, "giftcomm.reduce_scatter", prepare, FIELDS, MATCH)
        flat = planning.flat_values(call)
        acc_t = accumulation_dtype(flat.dtype)
        shard_shape = (int(bounds[t.rank + 1] - bounds[t.rank]),)
        if flat.size == 0:
            return planning.finish(call.xp.zeros(0, acc_t), call, t.size, shard_shape, out)
        rs = direct.reduce_scatter if planning.chosen_algorithm(table) == "direct" else ring.reduce_scatter
        total, _ = rs(t, flat, bounds, call.wire(t.rank), acc_t, slice_elems or planning.auto_slice(t, flat.size))
        return planning.finish(total, call, t.size, shard_shape, out)


def allgather(
    shard: Any,
    *,
    comm: Any = None,
    fmt: str | Format = "e4m3",
    block: int | None = None,
    out: Any = None,
    slice_elems: int | None = None,
    rounding: str = "nearest",
    seed: int | None = None,
    timeout: float | None = None,
) -> Any:
    """Concatenate every rank's shard (read flat; lengths may differ) into one 1-D array.

    Each shard is encoded once by its owner; every rank decodes the same bytes, so the result is
    bit-identical everywhere. The inverse of :func:`reduce_scatter`'s layout. ``out``: a 1-D
    array of the shard's dtype and framework holding all the gathered values.
    """
    t = resolve(comm, device=is_device_array(shard))
    with held(t, timeout):
        caller = planning.caller()

        def prepare() -> tuple[Call, dict[str, int]]:
            call = planning.validate(shard, "shard", fmt, block, None, slice_elems, reduces=False, rounding=rounding,
                                     seed=seed)
            call.sig["caller"] = caller
            planning.check_transport(t, call)
            planning.check_out(call, out, None)
            if call.out is not None and call.out.ndim != 1:
                raise ValueError(f"out must be 1-D, got shape {tuple(call.out.shape)}")
            sig = {k: call.sig.get(k, 0) for k in GATHER_FIELDS}
            sig["out"] = -1 if call.out is None else int(call.out.size)
            return call, sig

        call, table = agree(t, "giftcomm.allgather", prepare, GATHER_FIELDS, GATHER_MATCH)
        counts, total_n = planning.gathered_counts(table)
        flat, wire = planning.flat_values(call), call.wire(t.rank)
        slice_n = slice_elems or planning.auto_slice(t, total_n)
        sl = ring.slice_chunk(flat.size, wire.fmt, wire.block, slice_n)
        own = ring.encode_sliced(wire, flat, sl, wire.empty(sl.nbytes), int(counts[: t.rank].sum()))
        return planning.finish(ring.allgather(t, own, counts, wire, slice_n), call, t.size, (total_n,), out, op="sum")
