"""The plain calls' plan cache: repeated identical allreduces run as fast as persistent plans;
repeated reduce-scatters and allgathers skip their agreement (:func:`collective`).

A plain :func:`giftcomm.allreduce` whose signature this transport has seen before runs the
persistent plan (giftcomm.persistent) made the first time, instead of validating, agreeing and
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

from . import persistent
from .collectives import engine
from .collectives.layout import unknown_layout
from .options import CallOptions
from .transport import Transport

__all__ = ["PLAN_CACHE_SIZE", "signature", "allreduce", "reduce_scatter", "collective"]

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
    transforms may be rebuilt between calls: persistent.transformed_allreduce)."""
    if isinstance(opts, Exception):
        return engine.execute(t, engine.ALLREDUCE, x, out, opts, geometry, local_size)
    if geometry is not None:
        return persistent.transformed_allreduce(t, x, out, opts, geometry, local_size, explicit)
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
    result, plan = persistent.first_allreduce(t, x, out, opts, local_size, explicit, CACHED_MAX_BYTES, missed)
    if key is not None and plan is not None:
        _keep(cache, key, plan)
    return result


def collective(t: Transport, kind: engine.Kind, x: Any, out: Any, opts: CallOptions | Exception,
               explicit: bool = True) -> Any:
    """:func:`giftcomm.reduce_scatter` (``kind``: its layout's) or :func:`giftcomm.allgather` of
    ``x`` over ``t`` through the cache (collective): a repeated call with one signature runs the
    job agreed the first time (a :class:`~giftcomm.persistent.JobPlan`: its check words through
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
    result, made = persistent.first_collective(t, kind, x, out, opts, explicit, CACHED_MAX_BYTES, missed)
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


def _keep(cache: Any, key: Any, plan: Any) -> None:
    plan.used = next(_CLOCK)
    cache[key] = plan
    while len(cache) > PLAN_CACHE_SIZE:
        del cache[min(cache, key=lambda k: cache[k].used)]


_CLOCK = itertools.count()  # the order of the cached plans' last uses
