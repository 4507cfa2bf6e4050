"""The engine below the public collectives: one step sequence, a runner per algorithm.

Every call of allreduce, gift_allreduce, reduce_scatter and allgather (giftcomm.api), and every
persistent plan when it is made (giftcomm.persistent, which builds on this module; nothing here
calls up into the plans or the plan cache: docs/architecture.md, "Floors of a call"), runs the
same steps under the transport's lock (giftcomm.collectives.hold.held):

1. **validate and agree** (:func:`agree_call`): on every rank, the options (validated once into a
   :class:`~giftcomm.options.CallOptions` by giftcomm.options.call_options, before the agreement, so that
   its timeout governs it), the array, ``out``, the transport and the algorithm (auto: the cost
   model's choice) are checked into a :class:`~giftcomm.collectives.call.Job` inside one small collective
   (giftcomm.collectives.agree), so bad input on any rank raises the same exception on every rank;
2. **run** (:meth:`Kind.run`): the agreed algorithm's runner (the row's, :func:`runner_of`; its
   reduce-scatter for reduce_scatter, :func:`scatter_of`) moves the data with the codec kernels
   of the array's backend (the built-in rows name the runners below: ``run_ring``, ...);
3. **finish** (giftcomm.collectives.call.finish_reduction): ``avg``, the caller's dtype, ``out`` or a
   new array.

A :class:`Kind` is what differs between the collectives: its name in error messages, its agreed
fields, what it checks and plans beyond the shared checks, and how it runs.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .. import _xp
from ..algorithms import BY_NAME, Algorithm
from ..algorithms.partition import accumulation_dtype, shared_chunk_bounds
from ..options import CallOptions
from ..transport import DEVICE, Transport
from . import call as calls
from . import direct, doubling, gift, hierarchical, native, oneshot, ring, shared
from . import layout as scatter_layout
from .agree import agree, confirmed
from .call import FIELDS, GATHER_FIELDS, GATHER_MATCH, MATCH, Call, Job
from .hold import held
from .wire import Wire
from .workspace import workspace_of

__all__ = ["GeometryLike", "last_algorithm", "Kind", "ALLREDUCE", "REDUCE_SCATTER", "REDUCE_SCATTERS",
           "ALLGATHER", "prepare_call", "agree_call", "run_agreed", "execute", "run_allreduce", "runner_of",
           "scatter_of", "run_ring", "run_direct", "run_doubling", "run_hierarchical", "run_hierarchical_direct",
           "run_oneshot", "run_native"]

log = logging.getLogger("giftcomm")


class GeometryLike(Protocol):
    """What gift_allreduce needs of a geometry (see giftcomm.geometry.Geometry)."""

    @property
    def size(self) -> int: ...  # read-only: Geometry's are properties
    @property
    def is_identity(self) -> bool: ...

    def forward(self, flat: Any) -> Any: ...
    def inverse(self, flat: Any) -> Any: ...
    def fingerprint(self) -> int: ...


def last_algorithm(t: Transport) -> tuple[str, np.ndarray | None] | None:
    """(algorithm name, chunk bounds) of the last allreduce, gift_allreduce or reduce_scatter
    agreed on ``t`` (the same on every rank), or None before the first: what the call really
    ran, ``auto`` resolved. bounds: a reduce-scatter's agreed chunk bounds (P + 1 ints), None
    for an allreduce (its chunks are ``shared_chunk_bounds(n, P, block)``). Error feedback reads
    it to know which of a rank's values it encoded alone (giftcomm.collectives.feedback)."""
    return t.last_run


@dataclass(frozen=True)
class Kind:
    """One collective: ``what`` (the name its errors carry), ``arg`` (the input's name in
    messages), whether it reduces (has an op), its agreed ``fields`` (``match``: those every
    rank must have alike), ``prepare(t, job, out, geometry, local_size)`` (its own local checks,
    filling the job and the signature), ``agreed(t, job, table)`` (what it reads from every
    rank's fields) and ``run(t, job, out)``."""

    what: str
    arg: str
    reduces: bool
    fields: tuple[str, ...]
    match: tuple[str, ...]
    prepare: Callable[[Transport, Job, Any, Any, int | None], dict[str, int]]
    agreed: Callable[[Transport, Job, np.ndarray], None]
    run: Callable[[Transport, Job, Any], Any]


def prepare_call(t: Transport, kind: Kind, x: Any, out: Any, opts: CallOptions | Exception, geometry: Any = None,
                 local_size: int | None = None) -> tuple[Job, dict[str, int]] | Exception:
    """This rank's half of :func:`agree_call`: ``x``, ``out``, the options and the transport
    checked into a :class:`Job` and its signature (``kind.fields``), or the exception the checks
    raised (returned, not raised: every failure joins the agreement, so no rank is left waiting)."""
    try:
        if isinstance(opts, Exception):
            raise opts
        call = calls.validate(x, kind.arg, opts, reduces=kind.reduces)
        call.sig["caller"] = calls.caller()
        calls.check_transport(t, call)
        job = Job(call, opts)
        return job, kind.prepare(t, job, out, geometry, local_size)
    except Exception as exc:  # noqa: BLE001 - every rank raises it in the agreement
        return exc


def agree_call(t: Transport, kind: Kind, x: Any, out: Any, opts: CallOptions | Exception, geometry: Any = None,
               local_size: int | None = None) -> Job:
    """Validate ``x``, ``out`` and the options on this rank and agree across ranks (collective):
    the agreed :class:`Job`, or the same exception on every rank."""
    job, table = agree(t, kind.what, prepare_call(t, kind, x, out, opts, geometry, local_size), kind.fields,
                       kind.match)
    kind.agreed(t, job, table)
    return job


def run_agreed(t: Transport, kind: Kind, job: Job, out: Any, explicit: bool = True) -> Any:
    """Steps 2 and 3 of an agreed call (``kind.agreed`` applied): run and finish it, counted in
    giftcomm.stats (``explicit``: giftcomm.accounting.agreed) and left in ``t.last_slot``."""
    from .. import accounting  # lazy: it resolves communicators

    slot = accounting.agreed(t, job, explicit)
    result = kind.run(t, job, out)
    slot.calls += 1
    t.last_slot = slot  # what an adapter's accounting.Tally adds
    return result


def execute(t: Transport, kind: Kind, x: Any, out: Any, opts: CallOptions | Exception, geometry: Any = None,
            local_size: int | None = None, explicit: bool = True) -> Any:
    """One whole call of ``kind``: validate and agree, run, finish (collective); counted in
    giftcomm.stats (``explicit``: the caller named the format, giftcomm.accounting.agreed)."""
    with held(t, None if isinstance(opts, Exception) else opts.timeout):
        return run_agreed(t, kind, agree_call(t, kind, x, out, opts, geometry, local_size), out, explicit)


# ----------------------------------------------------------------------------- finishing


# ----------------------------------------------------------------------------- runners

Runner = Callable[[Transport, Any, Wire, Any, Any, int, Any], Any]
"""runner(t, flat, wire, acc_t, nodes, slice_n, out) -> the decoded sum of ``flat`` over all
ranks (float32, or float64 for float64 input; ``out``, a float32 (n,) array, when it could decode
into it)."""

def _scatter_gather(name: str) -> Runner:
    """Reduce-scatter of the row ``name`` then the ring allgather; through the transport's shared
    window on host memory over shared-memory transports (when there is room for it: else
    messages)."""

    def run(t: Transport, flat: Any, wire: Wire, acc_t: Any, nodes: Any, slice_n: int, out: Any) -> Any:
        scatter = scatter_of(name)
        bounds = shared_chunk_bounds(flat.size, t.size, wire.block)
        if t.shared_memory and t.memory != DEVICE and wire.xp is np:
            total = shared.allreduce(t, flat, bounds, wire, acc_t, slice_n, direct=scatter is direct.reduce_scatter,
                                     out=out)
            if total is not None:  # None: no room for the window (every rank alike); send messages
                return total
        return ring.allreduce(t, flat, bounds, wire, acc_t, slice_n, out=out, scatter=scatter)

    return run


def run_doubling(t: Transport, flat: Any, wire: Wire, acc_t: Any, nodes: Any, slice_n: int, out: Any) -> Any:
    """The ``doubling`` row's runner."""
    return doubling.allreduce(t, flat, wire, acc_t, out=out)


def run_oneshot(t: Transport, flat: Any, wire: Wire, acc_t: Any, nodes: Any, slice_n: int, out: Any) -> Any:
    """The ``oneshot`` row's runner."""
    return oneshot.allreduce(t, flat, wire, acc_t, out=out if acc_t == np.float32 else None)


def run_native(t: Transport, flat: Any, wire: Wire, acc_t: Any, nodes: Any, slice_n: int, out: Any) -> Any:
    """The ``native`` row's runner."""
    return native.allreduce(t, flat, wire, acc_t, out)


def _hierarchical(name: str) -> Runner:
    """fp32 inside nodes, the reduce-scatter of the row ``name``'s ``cross`` (and the ring
    allgather) across them."""

    def run(t: Transport, flat: Any, wire: Wire, acc_t: Any, nodes: Any, slice_n: int, out: Any) -> Any:
        cross = BY_NAME[name].cross
        assert cross is not None
        return hierarchical.allreduce(t, flat, nodes, wire, acc_t, slice_n, scatter=scatter_of(cross))

    return run


run_ring = _scatter_gather("ring")
"""The ``ring`` row's runner (the rows name their runners: giftcomm.algorithms)."""
run_direct = _scatter_gather("direct")
"""The ``direct`` row's runner."""
run_hierarchical = _hierarchical("hierarchical")
"""The ``hierarchical`` row's runner (its ``cross``: ring)."""
run_hierarchical_direct = _hierarchical("hierarchical_direct")
"""The ``hierarchical_direct`` row's runner (its ``cross``: direct)."""


def runner_of(algorithm: Algorithm) -> Runner:
    """The allreduce runner of a row (giftcomm.algorithms.Algorithm.part; its cache first)."""
    return algorithm.resolved.get("runner") or algorithm.part("runner")


def scatter_of(name: str) -> Callable[..., tuple[Any, Any]]:
    """The reduce-scatter of the row ``name`` (one with ``scatter``): ``(t, flat, bounds, wire,
    acc_t, slice_n) -> (total, shard)``. reduce_scatter runs it; so does the allreduce of that
    name, before the ring allgather, for giftcomm's own rows."""
    row = BY_NAME[name]
    return row.resolved.get("scatter_runner") or row.part("scatter_runner")


# ----------------------------------------------------------------------------- allreduce


def _is_giftcomm_geometry(geo: Any) -> bool:
    from ..geometry import Geometry  # lazy: the geometry package is optional for plain allreduce

    return isinstance(geo, Geometry)


def _geometry_forward(t: Transport, geo: Any, flat: Any, xp: Any) -> Any:
    """``geo.forward(flat)`` as float32 of ``flat``'s backend; a giftcomm Geometry writes into a
    workspace buffer that is reused across calls (a fresh one costs page faults comparable to the
    transform itself)."""
    if _is_giftcomm_geometry(geo):
        buf = workspace_of(t, xp).get("gift_forward", 4 * flat.size).view(np.float32)
        return geo.forward(flat, out=buf)
    return xp.ascontiguousarray(xp.asarray(geo.forward(flat), dtype=np.float32))


def _checked(values: Any, n: int, what: str) -> Any:
    """``values`` when it is a float32 (n,) array, else ValueError naming ``what``."""
    if tuple(values.shape) != (n,) or values.dtype != np.float32:
        raise ValueError(f"{what} returned shape {tuple(values.shape)} dtype {values.dtype}; expected ({n},) float32")
    return values


def _geometry_inverse(geo: Any, total: Any, xp: Any) -> Any:
    """``geo.inverse(total)``; in place for a giftcomm Geometry (``total`` belongs to this call:
    the caller's ``out`` or a fresh result)."""
    if _is_giftcomm_geometry(geo):
        return geo.inverse(total, out=total)
    return _checked(xp.ascontiguousarray(xp.asarray(geo.inverse(total), dtype=np.float32)), total.size,
                    "geometry.inverse")


def _word_geometry(word: str) -> str:
    """The error for a geometry given as a word (e.g. "paper") to a flat-buffer call."""
    return (f"giftcomm.gift_allreduce: geometry={word!r} names a method, not a map: a flat buffer has no layer "
            f"structure (layout) nor input covariances to build it from. Build the geometry and pass it, e.g. "
            f"geometry=Geometry.preset({word!r}, layout, factors) (giftcomm.geometry), or use an entry point that "
            f"captures them from the model (GradSync, ShardedGradSync, GiftState, GiftReduceScatter, the Lightning "
            f"callback: geometry={word!r})")


def _allreduce_prepare(t: Transport, job: Job, out: Any, geometry: Any, local_size: int | None) -> dict[str, int]:
    call = job.call
    calls.check_out(call, out, tuple(call.arr.shape))
    if isinstance(geometry, str):  # inside the agreement: every rank raises it
        raise ValueError(_word_geometry(geometry))
    geo = None if geometry is None or geometry.is_identity else geometry
    if geo is not None:
        if geo.size != call.arr.size:
            raise ValueError(f"geometry covers {geo.size} elements but x has {call.arr.size}")
        # the route is part of what the ranks agree on: a rank with a host array (unfused transform)
        # and one with a device array (the fused kernels) would round differently
        call.sig["geometry"] = int(geo.fingerprint()) ^ int(gift.takes(call.imp.device, geo))
    job.geometry = geo
    job.nodes = calls.plan_algorithm(t, call, job.opts.algorithm, local_size, native=job.opts.allow_native)
    call.sig["shared_memory"] = int(t.shared_memory)
    return call.sig


def _allreduce_agreed(t: Transport, job: Job, table: np.ndarray) -> None:
    call = job.call
    job.algorithm = calls.chosen_algorithm(table)
    t.last_run = (job.algorithm.name, None)
    job.slice_n = job.opts.slice_elems or calls.auto_slice(t, max(call.arr.size, 1))
    if log.isEnabledFor(logging.DEBUG):
        log.debug("allreduce rank %d/%d: %d %s values, fmt %s block %d, algorithm %s (asked %s), slice %s, "
                  "shared window %s, %s transport", t.rank, t.size, call.arr.size, call.imp.logical, call.fmt.name,
                  call.block, job.algorithm.name, job.opts.algorithm, job.opts.slice_elems or "auto",
                  bool(t.shared_memory), t.schedule)


def run_allreduce(t: Transport, job: Job, out: Any, call: Call | None = None) -> Any:
    """Steps 2 and 3 of an agreed allreduce: move the data with the agreed algorithm's runner
    (around the geometry's transforms when the job has one) and finish (avg, dtype, ``out``).
    ``call``: this call's record when it is not the job's own (a persistent plan's calls)."""
    call = job.call if call is None else call
    geo, algorithm = job.geometry, job.algorithm
    assert algorithm is not None
    xp, n, shape = call.xp, call.arr.size, tuple(call.arr.shape)
    flat = calls.flat_values(call)
    if geo is not None and gift.takes(call.imp.device, geo):
        return _run_fused(t, job, call, flat, out)
    if geo is not None:  # the forward transform can fail on some ranks: they all learn it
        with confirmed(t, "giftcomm.gift_allreduce: geometry.forward"):
            flat = _checked(_geometry_forward(t, geo, flat, xp), n, "geometry.forward")
    acc_t = accumulation_dtype(flat.dtype)
    if n == 0:
        return calls.finish(xp.zeros(0, acc_t), call, t.size, shape, out)
    into = calls.direct_out(call)
    total = runner_of(algorithm)(t, flat, call.wire(t.rank), acc_t, job.nodes, job.slice_n, into)
    if geo is not None:
        total = _geometry_inverse(geo, total, xp)
    if into is None or total is not into:
        total = _xp.astype(total, acc_t, copy=False)  # on the device: no flush-to-zero (giftcomm._xp)
    return calls.finish_reduction(t.size, call, total, into, out, shape)


def _run_fused(t: Transport, job: Job, call: Call, flat: Any, out: Any) -> Any:
    """gift_allreduce of a device array through the fused transform kernels
    (giftcomm.collectives.gift); the inverse and ``avg`` are done there."""
    assert job.algorithm is not None
    shape = tuple(call.arr.shape)
    if flat.size == 0:
        return calls.finish(call.xp.zeros(0, np.float32), call, t.size, shape, out)
    into = calls.direct_out(call)
    name = job.algorithm.name
    if not gift.has_state(t, job.geometry, call.xp):  # alike on every rank: the same agreed calls made it
        # a failure on some ranks (the plans' upload: device memory) is raised on every rank
        with confirmed(t, "giftcomm.gift_allreduce: fused transform"):
            gift.state_of(t, job.geometry, call.xp)
    total = gift.allreduce(t, job.geometry, name, runner_of(job.algorithm), scatter_of, flat, call.wire(t.rank), job.nodes, job.slice_n,
                           call.op, into)
    if into is not None and total is into:
        return out
    return calls.finish(total, call, t.size, shape, out, op="sum")


ALLREDUCE = Kind("giftcomm.allreduce", "x", True, FIELDS, MATCH, _allreduce_prepare, _allreduce_agreed,
                 run_allreduce)
"""allreduce and gift_allreduce (and the plans, when made)."""


# ----------------------------------------------------------------------------- reduce-scatter


def _scatter_prepare(t: Transport, job: Job, out: Any, geometry: Any, local_size: int | None,
                     layout: str = "blocks") -> dict[str, int]:
    call = job.call
    job.bounds = bounds = scatter_layout.plan_layout(call, t.size, layout)
    calls.check_out(call, out, (int(bounds[t.rank + 1] - bounds[t.rank]),))
    job.nodes = calls.plan_algorithm(t, call, job.opts.algorithm, None, True,
                                        native=job.opts.allow_native)
    return call.sig


def _scatter_agreed(t: Transport, job: Job, table: np.ndarray) -> None:
    job.algorithm = scatter_layout.chosen_algorithm(table)
    t.last_run = (job.algorithm.name, job.bounds)
    job.slice_n = job.opts.slice_elems or calls.auto_slice(t, job.call.arr.size)


def _scatter_run(t: Transport, job: Job, out: Any) -> Any:
    call, bounds = job.call, job.bounds
    assert bounds is not None and job.algorithm is not None
    flat = calls.flat_values(call)
    acc_t = accumulation_dtype(flat.dtype)
    shard_shape = (int(bounds[t.rank + 1] - bounds[t.rank]),)
    if flat.size == 0:
        return calls.finish(call.xp.zeros(0, acc_t), call, t.size, shard_shape, out)
    total, _ = scatter_of(job.algorithm.name)(t, flat, bounds, call.wire(t.rank), acc_t, job.slice_n)
    return calls.finish(total, call, t.size, shard_shape, out)


REDUCE_SCATTERS = {layout: Kind("giftcomm.reduce_scatter", "x", True, scatter_layout.SCATTER_FIELDS,
                                scatter_layout.SCATTER_MATCH, functools.partial(_scatter_prepare, layout=layout),
                                _scatter_agreed, _scatter_run) for layout in scatter_layout.LAYOUTS}
"""reduce_scatter, one Kind per shard layout (giftcomm.algorithms.partition.LAYOUTS); the layout is agreed."""
REDUCE_SCATTER = REDUCE_SCATTERS["blocks"]


# ----------------------------------------------------------------------------- allgather


def _gather_prepare(t: Transport, job: Job, out: Any, geometry: Any, local_size: int | None) -> dict[str, int]:
    call = job.call
    calls.check_out(call, out, None)
    if call.out is not None and call.out.ndim != 1:
        raise ValueError(f"out must be 1-D, got shape {tuple(call.out.shape)}")
    sig = {k: call.sig.get(k, 0) for k in GATHER_FIELDS}
    sig["out"] = -1 if call.out is None else int(call.out.size)
    return sig


def _gather_agreed(t: Transport, job: Job, table: np.ndarray) -> None:
    job.counts, job.total = calls.gathered_counts(table)
    job.slice_n = job.opts.slice_elems or calls.auto_slice(t, job.total)


def _gather_run(t: Transport, job: Job, out: Any) -> Any:
    call, counts = job.call, job.counts
    assert counts is not None
    flat, wire = calls.flat_values(call), call.wire(t.rank)
    sl = ring.slice_chunk(flat.size, wire.fmt, wire.block, job.slice_n)
    own = ring.encode_sliced(wire, flat, sl, wire.empty(sl.nbytes), int(counts[: t.rank].sum()))
    gathered = ring.allgather(t, own, counts, wire, job.slice_n)
    return calls.finish(gathered, call, t.size, (job.total,), out, op="sum")


ALLGATHER = Kind("giftcomm.allgather", "shard", False, GATHER_FIELDS, GATHER_MATCH, _gather_prepare, _gather_agreed,
                 _gather_run)
