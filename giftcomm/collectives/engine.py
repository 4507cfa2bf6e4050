"""The engine below the public collectives: one step sequence for every collective.

Every call of allreduce, gift_allreduce, reduce_scatter and allgather without a plan goes
api -> the plans (giftcomm.plans: the plan cache runs a repeated call's plan, and a call it
cannot cache comes here through :func:`execute`) -> this module; a persistent plan is made
here too (:func:`agree_call`) and its calls run :func:`run_allreduce`. Nothing here calls up
into the plans or the plan cache (docs/architecture.md, "Floors of a call"). Every call runs the
same steps under the transport's lock (giftcomm.collectives.hold.held):

1. **validate and agree** (:func:`agree_call`): on every rank, the options (validated once into a
   :class:`~giftcomm.options.CallOptions` by giftcomm.options.call_options, before the agreement, so that
   its timeout governs it), the array, ``out``, the transport and the algorithm (auto: the cost
   model's choice) are checked into a :class:`~giftcomm.collectives.call.Job` inside one small collective
   (giftcomm.collectives.agree), so bad input on any rank raises the same exception on every rank;
2. **run** (:meth:`Kind.run`): the agreed algorithm's runner (the row's,
   giftcomm.collectives.runners.runner_of; its reduce-scatter for reduce_scatter,
   ``runners.scatter_of``) moves the data with the codec kernels of the array's backend; a
   gift_allreduce with a geometry runs the GIFT routes (giftcomm.collectives.gift);
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
from typing import Any

import numpy as np

from .. import _xp
from ..algorithms.partition import accumulation_dtype
from ..options import CallOptions
from ..transport import Transport
from . import call as calls
from . import gift, ring
from . import layout as scatter_layout
from .agree import agree
from .call import FIELDS, GATHER_FIELDS, GATHER_MATCH, MATCH, Call, Job
from .hold import held
from .runners import runner_of, scatter_of

__all__ = ["last_algorithm", "Kind", "ALLREDUCE", "REDUCE_SCATTER", "REDUCE_SCATTERS", "ALLGATHER", "prepare_call",
           "agree_call", "run_agreed", "execute", "run_allreduce"]

log = logging.getLogger("giftcomm")


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


# ----------------------------------------------------------------------------- allreduce


def _allreduce_prepare(t: Transport, job: Job, out: Any, geometry: Any, local_size: int | None) -> dict[str, int]:
    call = job.call
    calls.check_out(call, out, tuple(call.arr.shape))
    job.geometry = gift.prepare(call, geometry)  # inside the agreement: every rank raises its errors
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
    and finish (avg, dtype, ``out``); a job with a geometry runs the GIFT routes
    (giftcomm.collectives.gift). ``call``: this call's record when it is not the job's own (a
    persistent plan's calls)."""
    call = job.call if call is None else call
    if job.geometry is not None:
        return gift.allreduce(t, job, call, out)
    algorithm = job.algorithm
    assert algorithm is not None
    xp, n, shape = call.xp, call.arr.size, tuple(call.arr.shape)
    flat = calls.flat_values(call)
    acc_t = accumulation_dtype(flat.dtype)
    if n == 0:
        return calls.finish(xp.zeros(0, acc_t), call, t.size, shape, out)
    into = calls.direct_out(call)
    total = runner_of(algorithm)(t, flat, call.wire(t.rank), acc_t, job.nodes, job.slice_n, into)
    if into is None or total is not into:
        total = _xp.astype(total, acc_t, copy=False)  # on the device: no flush-to-zero (giftcomm._xp)
    return calls.finish_reduction(t.size, call, total, into, out, shape)


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
