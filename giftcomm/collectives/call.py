"""One collective call's record and the steps around it: the :class:`Call` (one rank's validated
call) and the :class:`Job` (the agreed call), validation, the transport check, topology, slice,
algorithm choice, the fields every rank must agree on and the finishing step (avg, dtype, out).

The engine (giftcomm.collectives.engine) builds a :class:`Call` on each rank from the validated
:class:`~giftcomm.options.CallOptions` inside the agreement step (giftcomm.collectives.agree),
so that a bad argument on any rank raises the same exception on every rank; then it hands the
call's :class:`~giftcomm.collectives.wire.Wire`, flat values and chosen algorithm (a row of
giftcomm.algorithms) to the algorithm's runner. Any array giftcomm takes — NumPy, CuPy, torch (CPU or
CUDA), JAX, any DLPack producer — goes through the same steps (giftcomm._xp imports it
zero-copy); the result goes back in the caller's framework.
"""
from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _xp, algorithms
from ..algorithms import AUTO, BY_CODE, BY_NAME, CODES, Algorithm
from ..cost.model import Topology, auto_algorithm
from ..formats import Format
from ..options import CallOptions
from ..transport.base import ANY, DEVICE, GROUPED, HOST, PIPELINED, Transport
from .agree import DTYPE_CODES, OP_CODES
from .hierarchical import check_uniform, contiguous_nodes
from .ring import auto_slice_elems
from .wire import Wire

__all__ = ["FIELDS", "MATCH", "GATHER_FIELDS", "GATHER_MATCH", "Call", "Job", "validate", "check_out",
           "check_transport", "topology", "plan_algorithm", "chosen_algorithm", "auto_slice", "flat_values",
           "direct_out", "finish", "finish_reduction", "divide", "gathered_counts", "positive_int", "caller"]

FIELDS = ("count", "dtype", "fmt", "block", "op", "slice", "geometry", "algorithm", "local_size", "shared_memory",
          "caller", "rounding", "seed", "allow_native", "chosen")
"""The agreed signature of allreduce / gift_allreduce / reduce_scatter, one int64 each."""
MATCH = FIELDS[:-1]
"""Fields every rank must have alike ("chosen" may differ: auto on different calibrations; rank 0's wins)."""
GATHER_MATCH = ("dtype", "fmt", "block", "slice", "caller", "rounding", "seed")
GATHER_FIELDS = (*GATHER_MATCH, "count", "out")
"""allgather's agreed signature (count: this rank's shard length; out: its out's size, -1 if none)."""


@dataclass
class Call:
    """One rank's validated call.

    imp: the imported input (``imp.array``: NumPy or CuPy, any shape, sharing the caller's
    memory; bfloat16 on the device as uint16 bits). fmt, block, op: the wire format and
    reduction. sig: this rank's signature (:data:`FIELDS` -> int). out: the imported ``out``
    array (the caller's memory) or None. seed: the stochastic-rounding seed, None for nearest.
    """

    imp: _xp.Imported
    fmt: Format
    block: int
    op: str
    sig: dict[str, int]
    out: Any = None
    seed: int | None = None

    @property
    def arr(self) -> Any:
        return self.imp.array

    @property
    def xp(self) -> Any:
        return self.imp.xp

    def wire(self, rank: int) -> Wire:
        """The call's wire format bound to its backend's codec kernels, encoding as ``rank``."""
        return Wire.of(self.fmt, self.block, self.xp, self.seed, party=rank)


class Job:
    """One agreed call: the call record, its options, the algorithm every rank runs (None for
    allgather), the node layout, the geometry (gift_allreduce) or None, the pipelining slice,
    and the chunk bounds (reduce-scatter) or every rank's shard length and their total
    (allgather). A plain class
    with class-level defaults: it is made on every call, and only what a kind sets is written."""

    algorithm: Algorithm | None = None
    nodes: np.ndarray | None = None
    geometry: Any = None
    slice_n: int = 0
    bounds: np.ndarray | None = None
    counts: np.ndarray | None = None
    total: int = 0

    def __init__(self, call: Call, opts: CallOptions) -> None:
        self.call, self.opts = call, opts


def positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def import_checked(x: Any, name: str) -> _xp.Imported:
    """``x`` imported zero-copy; TypeError for dtypes giftcomm does not take and for masked
    arrays (their mask would be ignored)."""
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name} is a masked array; giftcomm would ignore its mask: pass "
                        f"{name}.filled(0) (or another fill value) instead")
    try:
        return _xp.import_array(x)
    except ValueError:
        raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got dtype "
                        f"{getattr(x, 'dtype', type(x).__name__)}") from None


def validate(x: Any, name: str, opts: CallOptions, reduces: bool = True) -> Call:
    """The checks every collective shares, on top of the validated options: ``x`` is an array
    giftcomm takes, and stochastic rounding has its seed (``reduces`` False: allgather, whose
    signature has no op); raises TypeError/ValueError."""
    imp = import_checked(x, name)
    f = opts.format
    seed = opts.seed if opts.rounding == "stochastic" else None
    if opts.rounding == "stochastic" and seed is None:
        raise ValueError("rounding='stochastic' needs seed= (an int identifying the call, e.g. the training step)")
    sig = dict.fromkeys(FIELDS, 0)
    sig.update(count=int(imp.array.size), dtype=DTYPE_CODES[imp.logical], fmt=f.variant_code, block=opts.resolved_block,
               op=OP_CODES[opts.op] if reduces else 0, slice=opts.slice_elems or 0,
               rounding=int(seed is not None), seed=0 if seed is None else seed - (1 << 64) * (seed >= 1 << 63),
               allow_native=int(opts.allow_native))
    return Call(imp, f, sig["block"], opts.op, sig, seed=seed)


def caller() -> int:
    """The caller field of the signature: a hash of the calling thread's name. Calls are matched
    across ranks by that name (the API holds the transport's lock for the whole call, so calls
    from several threads of one process run one at a time), so calls from differently named
    threads that pair up across ranks raise on every rank instead of mixing their data."""
    name = threading.current_thread().name
    word = _CALLERS.get(name)
    if word is None:
        if len(_CALLERS) > 1024:  # threads named per task: keep the memo small
            _CALLERS.clear()
        word = _CALLERS[name] = zlib.crc32(name.encode())
    return word


_CALLERS: dict[str, int] = {}  # caller()'s memo by thread name


def check_out(call: Call, out: Any, shape: tuple[int, ...] | None) -> None:
    """Import ``out`` into ``call.out`` after checking it: an array of the input's kind (host or
    device; not JAX, whose arrays are immutable), the input's dtype and ``shape`` (None: any),
    writable."""
    if out is None:
        return
    o = import_checked(out, "out")
    if o.device != call.imp.device or o.source == "jax":
        where = "a CUDA" if call.imp.device else "a host (NumPy or CPU torch)"
        raise TypeError(f"out must be {where} array, like the input; got {type(out).__name__}")
    got = tuple(o.array.shape)
    if (shape is not None and got != shape) or o.logical != call.imp.logical:
        raise ValueError(f"out must have shape {shape} and dtype {call.imp.logical}, got {got} {o.logical}")
    if not o.device and not o.array.flags.writeable:
        raise ValueError("out is read-only")
    call.out = o.array


def check_transport(t: Transport, call: Call) -> None:
    """The transport can move this array's buffers and runs a schedule the algorithms know
    (TypeError naming both, before data moves)."""
    if t.schedule not in (PIPELINED, GROUPED):
        raise TypeError(f"{type(t).__name__}.schedule is {t.schedule!r}; giftcomm's algorithms run "
                        f"{PIPELINED!r} or {GROUPED!r} schedules")
    need = DEVICE if call.imp.device else HOST
    if t.memory not in (need, ANY):
        raise TypeError(f"{type(t).__name__} moves {t.memory} buffers but the input is a {need} array; pass "
                        f"{'a device transport (NCCL, CUDA-aware MPI)' if call.imp.device else 'host arrays'}")


def topology(t: Transport, local_size: int | None) -> tuple[np.ndarray, Topology]:
    """The node of every rank and the Topology (local_size 0: uneven nodes); kept in the
    transport's state per ``local_size``, since the layout of a communicator does not change."""
    if local_size is not None:
        local_size = positive_int(local_size, "local_size")
    cache = t.state.topology
    if local_size not in cache:
        nodes = t.node_ids() if local_size is None else contiguous_nodes(t.size, local_size)
        cache[local_size] = nodes, Topology.of(nodes)
    return cache[local_size]


def plan_algorithm(t: Transport, call: Call, algorithm: str, local_size: int | None,
                   scatter: bool = False, native: bool = True) -> np.ndarray:
    """Validate ``algorithm``/``local_size``, record the choice (auto:
    giftcomm.cost.model.auto_algorithm of the call's size, format and block on the node layout,
    among the reduce-scatter rows with ``scatter``; ``native``: the call's allow_native) in the
    signature; returns the node layout."""
    allowed = algorithms.SCATTER_CHOICES if scatter else algorithms.CHOICES  # read now: registered rows count
    if algorithm not in allowed:
        raise ValueError(f"algorithm must be one of {', '.join(allowed)}; got {algorithm!r}")
    nodes, topo = topology(t, local_size)
    chosen = algorithm
    if algorithm == AUTO:
        chosen = auto_algorithm(call.arr.size, topo, call.fmt, call.block, allow_native=native,
                                scatter=scatter)
    elif topo.local_size == 0 and BY_NAME[algorithm].needs_nodes:
        check_uniform(nodes)  # raises, naming the node sizes
    call.sig.update(algorithm=CODES[algorithm], local_size=local_size or 0, chosen=CODES[chosen])
    return nodes


def chosen_algorithm(table: np.ndarray) -> Algorithm:
    """The algorithm rank 0 chose (every rank runs that one), from the agreed table."""
    return BY_CODE[int(table[0, FIELDS.index("chosen")])]


def auto_slice(t: Transport, n: int) -> int:
    """The pipelining slice for ``n`` values over ``t`` (ring.auto_slice_elems; one node per the
    transport's own node layout)."""
    return auto_slice_elems(n, t.size, one_node=topology(t, None)[1].nodes == 1)


def flat_values(call: Call) -> Any:
    """The input as a contiguous (size,) array of its backend: bfloat16 on the device widened to
    float32 (exact), other dtypes as they are (no copy when already contiguous)."""
    arr = call.arr
    if call.imp.device and call.imp.logical == "bfloat16":
        arr = _xp.to_float32(arr, "bfloat16")
    return call.xp.ascontiguousarray(arr).reshape(-1)


def direct_out(call: Call) -> Any:
    """``out`` as a flat float32 view the collective can decode into, or None when it cannot (no
    out, another dtype, not contiguous)."""
    out = call.out
    if out is None or out.dtype != np.float32 or not out.flags.c_contiguous:
        return None
    return out.reshape(-1)


def finish(values: Any, call: Call, p: int, shape: tuple[int, ...], out: Any, op: str | None = None) -> Any:
    """Apply ``avg`` (a division by P in ``values``' dtype), cast to the input's dtype (bfloat16
    on the device: bits, rounded to nearest even) and ``shape``; write ``out`` (returned as the
    caller passed it) or return the result in the caller's framework."""
    if (op or call.op) == "avg":
        values = divide(values.copy(), p)  # a new array: values may share memory with the caller's
    with np.errstate(over="ignore", invalid="ignore"):
        if call.out is not None:
            if call.imp.device and call.imp.logical == "bfloat16":
                call.out[...] = _xp.from_float32(values, "bfloat16").reshape(shape)
            else:
                call.out[...] = values.reshape(shape)
            return out
        if call.imp.logical == "bfloat16" and call.imp.device:
            result = _xp.from_float32(values, "bfloat16")
        else:
            result = values.astype(call.arr.dtype, copy=False)
    return _xp.export_like(result.reshape(shape), call.imp)


def finish_reduction(p: int, call: Call, total: Any, into: Any, out: Any, shape: tuple[int, ...]) -> Any:
    """Step 3 of a reduction over ``p`` ranks: ``avg`` and the caller's dtype and shape, into
    ``out`` or a new array. ``into``: the float32 view of ``out`` the runner decoded into (None
    when it could not), so ``total is into`` needs only the division."""
    if into is not None and total is into:
        if call.op == "avg":
            divide(total, p)
        return out
    return finish(total, call, p, shape, out)


def divide(values: Any, p: int) -> Any:
    """``values /= P`` in place, in ``values``' dtype (float32 or float64); float32 device arrays
    through giftcomm's non-flushing kernel, since CuPy's own divide flushes subnormals (it is
    compiled with -ftz=true), so that device results equal host results bit for bit."""
    xp = _xp.array_module(values)
    if xp is not np and values.dtype == np.float32:
        from ..cuda.codec import divide_inplace

        return divide_inplace(values, p)
    values /= values.dtype.type(p)
    return values


def gathered_counts(table: np.ndarray) -> tuple[np.ndarray, int]:
    """Every rank's shard length and their total, from allgather's agreed table. Raises
    ValueError when a rank's ``out`` does not hold the total: every rank sees the same table, so
    every rank raises it."""
    counts = table[:, GATHER_FIELDS.index("count")]
    total_n = int(counts.sum())
    wrong = [r for r, m in enumerate(table[:, GATHER_FIELDS.index("out")]) if m not in (-1, total_n)]
    if wrong:
        raise ValueError(f"giftcomm.allgather: out on rank(s) {wrong} does not hold the {total_n} gathered values")
    return counts, total_n
