"""The adapters' call options: one validated :class:`~giftcomm.options.CallOptions` per adapter
object, and per-step stochastic-rounding seeds (no framework imported).

Every adapter entry point (``GiftState``, ``GradSync``, ``allreduce_tree``, ``TreeSync``) takes
the core call's options as keywords (fmt, block=None meaning the format's own, rounding, seed,
algorithm, slice_elems, timeout) and builds them with ``CallOptions.of(owner, ...)``, so a bad
option raises when the object is built, with the owner's name in the message, on every rank that
built it.

A training loop reduces many buffers (buckets, pytrees) per step, step after step; each call with
``rounding="stochastic"`` needs its own seed, the same on every rank, so that the rounding noise of
different calls is independent and a rerun gives the same bytes. The adapters derive it from the
user's ``seed`` (an int in [0, 2**64); None counts as 0), the training step (the DDP hook's
iteration, ``GradSync.sync``'s step, ``TreeSync``'s call count) and the buffer's index within the
step (DDP's bucket index, GradSync's bucket index, 0 for a pytree)::

    call_seed = step_seed(seed, step, index)
"""
from __future__ import annotations

import logging
from typing import Any

from ..algorithms import AUTO, BY_NAME, NATIVE
from ..options import CallOptions
from ..reference.rounding import mix64

__all__ = ["step_options", "step_seed", "log_path"]

logger = logging.getLogger("giftcomm.adapters")

_MASK = (1 << 64) - 1


def step_seed(seed: int | None, step: int, index: int = 0) -> int:
    """The seed (an int in [0, 2**64)) of buffer ``index`` at training step ``step`` for the
    user's ``seed``: ``mix(mix(mix(seed) ^ step) ^ index)`` with splitmix64's finaliser, so
    neighbouring steps and buffers get unrelated values. Raises ValueError for a negative step
    or index."""
    if step < 0 or index < 0:
        raise ValueError(f"step_seed: step and index must be >= 0, got {step}, {index}")
    return mix64(mix64(mix64((seed or 0) & _MASK) ^ (int(step) & _MASK)) ^ (int(index) & _MASK))


def step_options(opts: CallOptions, step: int, index: int = 0) -> CallOptions:
    """The options of one collective call of buffer ``index`` at ``step``, passed whole
    (``api.gift_allreduce(x, options=step_options(o, step, i))``): ``opts`` with the seed derived
    by :func:`step_seed` under stochastic rounding (None under nearest)."""
    return opts.replace(seed=step_seed(opts.seed, step, index) if opts.rounding == "stochastic" else None)


def log_path(seen: set[int], owner: str, comm: Any, n: int, opts: CallOptions, device: bool = False) -> None:
    """Say at INFO on the "giftcomm.adapters" logger, once per buffer size (``n`` values; ``seen``
    holds the sizes already told), which path the last call over ``comm`` took -- the transport's
    own allreduce (``native``) or one of giftcomm's compressed algorithms -- and why: the option
    that forced it, or the cost model's predictions (giftcomm.cost.model.candidate_times) and the
    calibration they come from. Local: no communication."""
    if n in seen or not logger.isEnabledFor(logging.INFO):
        return
    from ..collectives import call as calls
    from ..collectives import engine
    from ..cost.calibration import load_calibration
    from ..cost.model import candidate_times
    from ..transport import resolve

    t = resolve(comm, device=device)
    last = engine.last_algorithm(t)
    if last is None:
        return
    seen.add(n)
    took = last[0]
    what = "the transport's own allreduce, uncompressed" if BY_NAME[took].native else f"giftcomm's {opts.fmt} wire"
    if opts.algorithm != AUTO:
        why = f"algorithm={opts.algorithm!r} asks for it"
    else:
        cal = load_calibration()
        times = candidate_times(n, calls.topology(t, None)[1], opts.fmt, opts.resolved_block, cal,
                                native=opts.allow_native)
        own = {a: s for a, s in times.items() if not BY_NAME[a].native}
        best = min(own, key=lambda a: own[a])
        native = (f"native {times[NATIVE] * 1e3:.3g} ms" if NATIVE in times
                  else "native not considered (allow_native=False)")
        ran = f"{took} {times[took] * 1e3:.3g} ms, " if took in own else ""
        why = (f"predicted: {ran}{native}, fastest compressed {best} {own[best] * 1e3:.3g} ms "
               f"(calibration: {cal.source})")
    logger.info("giftcomm %s: buffers of %d values take %s (%s); %s", owner, n, took, what, why)
