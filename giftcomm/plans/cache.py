"""The plain calls' plan cache: repeated identical allreduces run as fast as persistent plans;
repeated reduce-scatters and allgathers skip their agreement (:func:`collective`).

Every call of the public collectives comes here from giftcomm.api, and each goes one way down:
a repeated call runs its cached plan; a miss agrees through the engine, makes the plan and
runs the agreed job (:func:`first_allreduce`, :func:`first_collective`); a call that is never
cached (a gift_allreduce with a geometry, stochastic rounding's reduce-scatters and allgathers,
options that failed their checks) is the engine's whole call (``engine.execute``).

A plain :func:`giftcomm.allreduce` whose signature this transport has seen before runs the
persistent plan (giftcomm.plans.persistent) made the first time, instead of validating, agreeing and
planning again. The signature (:func:`signature`) is everything the call's checks depend on:
the array's type, shape, dtype and device, ``out``'s (or None), the validated options and
``local_size``. The cache holds the :data:`PLAN_CACHE_SIZE` most recently used signatures per
transport (least recently used evicted first) and lives in the transport's state, so it is
released with the communicator (``Free``, :func:`giftcomm.release`).

Only plans whose calls go through the node-shared plan channel are cached (host arrays on one
node, the native channel built): each cached call's four check words travel in the channel
with the data, as a plan's do, its word flagged ``CACHED`` (giftcomm.transport.channel). A
rank that finds no plan meets its peers in the channel before it agrees (as every plain call
does: ``collectives.hold.held``), so a peer inside a cached plan sees a plain call and joins the
agreement: the agreement then raises the same "ranks disagree" error on every
rank when the signatures differ, or runs the call and caches its plan everywhere. A cached plan
is therefore never run against another signature: its word (the agreed signature and the plan's
number) differs from every other plan's, so ranks on different cached plans (made in different
calls) agree afresh, as after a miss. Results are those of the plan: bit-identical on every rank and equal to
``simulate_allreduce(..., algorithm=...)`` of the algorithm the agreement chose (``auto``: the
one decision of giftcomm.cost.model.auto_algorithm, whether or not the plan is cached).
"""
from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from .. import accounting as _stats
from ..collectives import engine
from ..collectives.hold import held
from ..collectives.layout import unknown_layout
from ..options import CallOptions
from ..transport import HOST, Transport
from . import persistent

__all__ = ["PLAN_CACHE_SIZE", "CACHED_MAX_BYTES", "signature", "allreduce", "reduce_scatter", "collective",
           "first_allreduce", "first_collective"]

PLAN_CACHE_SIZE = 32
"""Cached plans per transport (least recently used evicted first)."""
CACHED_MAX_BYTES = 1 << 20
"""Largest input (bytes) whose plan is cached: a plan keeps a zero buffer of its size, and above
this size the per-call planning is a small part of the call."""


def signature(x: Any, out: Any, opts: CallOptions, local_size: int | None) -> tuple[Any, ...] | None:
    """The cache key of an allreduce call (None: not cacheable, e.g. an object without shape
    and dtype; such a call is planned every time): x's and out's type, shape, dtype and device,
    the options and ``local_size``. Stochastic rounding's seed is left out: it varies per call and
    the plan takes it per call."""
    o = opts if opts.seed is None else opts.replace(seed=0)
    if type(x) is np.ndarray and (out is None or type(out) is np.ndarray) and (local_size is None or type(local_size) is int):
        # the common case, cheaply (~0.2 us)
        return (x.shape, x.dtype, None if out is None else (out.shape, out.dtype), o, local_size)
    try:
        key = ((type(x), tuple(x.shape), x.dtype, getattr(x, "device", None)),
               None if out is None else (type(out), tuple(out.shape), out.dtype, getattr(out, "device", None)),
               o, local_size)
        hash(key)
    except Exception:  # noqa: BLE001 - anything odd is simply not cached (the agreement checks it)
        return None
    return key


def allreduce(t: Transport, x: Any, out: Any, opts: CallOptions | Exception, local_size: int | None,
              explicit: bool = True, geometry: Any = None) -> Any:
    """:func:`giftcomm.allreduce` of ``x`` over ``t`` through the cache (collective), counted in
    giftcomm.stats (``explicit``: the caller named the format; its fallback to native is warned).
    ``geometry``: :func:`giftcomm.gift_allreduce`'s; a call with one is never cached (its
    transforms may be rebuilt between calls: :func:`~giftcomm.plans.persistent.plan_allreduce`
    with ``geometry=`` holds one for a fixed geometry), so every such call is the engine's whole
    call, agreed afresh."""
    if isinstance(opts, Exception) or geometry is not None:  # no plan: the engine's whole call, agreed afresh
        return engine.execute(t, engine.ALLREDUCE, x, out, opts, geometry, local_size, explicit)
    key = signature(x, out, opts, local_size)
    cache = t.state.plan_cache
    plan = None if key is None else cache.get(key)
    missed = False
    if plan is not None:
        plan.used = next(_CLOCK)  # least recently used is evicted first (_keep)
        try:
            result = plan(x, out, opts.seed, opts.timeout)  # counted in giftcomm.stats by the plan
            t.last_run = plan.last_run  # what engine.last_algorithm reports (error feedback, adapters)
            return result
        except persistent.Missed:  # a peer had no plan for its call: every rank agrees below (the MISS already seen)
            missed = True
    # after a miss every rank has met in the channel
    result, plan = first_allreduce(t, x, out, opts, local_size, explicit, CACHED_MAX_BYTES, missed)
    if key is not None and plan is not None:
        _keep(cache, key, plan)
    return result


def collective(t: Transport, kind: engine.Kind, x: Any, out: Any, opts: CallOptions | Exception,
               explicit: bool = True) -> Any:
    """:func:`giftcomm.reduce_scatter` (``kind``: its layout's) or :func:`giftcomm.allgather` of
    ``x`` over ``t`` through the cache (collective): a repeated call with one signature runs the
    job agreed the first time (a :class:`~giftcomm.plans.persistent.JobPlan`: its check words through
    the plans' channel instead of the agreement; the data moves as the agreed algorithm moves it).
    Stochastic rounding's calls (a seed per call) agree every time."""
    if isinstance(opts, Exception) or opts.seed is not None:
        return engine.execute(t, kind, x, out, opts, explicit=explicit)
    sig = signature(x, out, opts, None)
    key = None if sig is None else (id(kind), sig)
    cache = t.state.plan_cache
    plan = None if key is None else cache.get(key)
    missed = False
    if plan is not None:
        plan.used = next(_CLOCK)
        try:
            result = plan(x, out, opts)  # counted in giftcomm.stats by the plan
            if plan.last_run is not None:
                t.last_run = plan.last_run
            return result
        except persistent.Missed:  # a peer made a plain call (or another cached one): every rank agrees below
            missed = True
    result, made = first_collective(t, kind, x, out, opts, explicit, CACHED_MAX_BYTES, missed)
    if key is not None and made is not None:
        _keep(cache, key, made)
    return result


def reduce_scatter(t: Transport, x: Any, out: Any, layout: str, opts: CallOptions | Exception,
                   explicit: bool = True) -> Any:
    """:func:`giftcomm.reduce_scatter` of ``x`` over ``t`` with shard layout ``layout`` through
    the cache: :func:`collective` with the layout's Kind (engine.REDUCE_SCATTERS); an unknown
    layout becomes the call's error, raised on every rank by the agreement."""
    kind = engine.REDUCE_SCATTERS.get(layout) if isinstance(layout, str) else None
    if kind is None:
        kind, opts = engine.REDUCE_SCATTER, unknown_layout(layout)
    return collective(t, kind, x, out, opts, explicit)


def first_allreduce(t: Transport, x: Any, out: Any, opts: CallOptions, local_size: int | None, explicit: bool,
                    max_bytes: int, missed: bool) -> tuple[Any, persistent.AllreducePlan | None]:
    """A plain allreduce that also makes its plan for the cache (collective): agree
    (giftcomm.collectives.engine), count it in giftcomm.stats (``explicit``: the caller named the
    format), make the plan where the call goes through the node-shared channel (host arrays over
    shared memory, at most ``max_bytes``: alike on every rank), then run the agreed job. Returns
    (the result, the plan or None). ``missed``: a cached plan's call met plain calls on some rank,
    so every rank has met in the channel already."""
    with held(t, opts.timeout, plain=not missed):
        job = engine.agree_call(t, engine.ALLREDUCE, x, out, opts, None, local_size)
        slot = _stats.agreed(t, job, explicit)
        plan = None
        if t.shared_memory and t.memory == HOST and job.call.arr.nbytes <= max_bytes:  # alike on every rank
            plan = persistent.plan_of(t, job, cached=True)  # collective: before the run, which may fail on one rank
            plan.slot = slot
            if not plan.through_channel:
                plan = None
        result = engine.ALLREDUCE.run(t, job, out)
        slot.calls += 1
        t.last_slot = slot  # what an adapter's accounting.Tally adds
        return result, plan


def first_collective(t: Transport, kind: engine.Kind, x: Any, out: Any, opts: CallOptions, explicit: bool,
                     max_bytes: int, missed: bool) -> tuple[Any, persistent.JobPlan | None]:
    """A plain reduce-scatter (``kind``: its layout's) or allgather that also keeps its agreed job
    as a :class:`JobPlan` for the cache (collective), as :func:`first_allreduce` does:
    (the result, the job's plan or None)."""
    with held(t, opts.timeout, plain=not missed):
        job = engine.agree_call(t, kind, x, out, opts)
        slot = _stats.agreed(t, job, explicit)
        # the same decision on every rank: agreed sizes only (an allgather's shards may differ)
        nbytes = job.call.arr.itemsize * (job.total if job.counts is not None else job.call.arr.size)
        made = None
        if t.shared_memory and t.memory == HOST and nbytes <= max_bytes:
            made = persistent.job_plan_of(t, kind, job)  # collective: before the run, which may fail on one rank
            if made is not None:
                made.slot = slot
        result = kind.run(t, job, out)
        slot.calls += 1
        t.last_slot = slot  # what an adapter's accounting.Tally adds
        return result, made



def _keep(cache: Any, key: Any, plan: Any) -> None:
    plan.used = next(_CLOCK)
    cache[key] = plan
    while len(cache) > PLAN_CACHE_SIZE:
        del cache[min(cache, key=lambda k: cache[k].used)]


_CLOCK = itertools.count()  # the order of the cached plans' last uses
