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

from typing import Any

from ..options import CallOptions
from ..reference.rounding import mix64

__all__ = ["call_kwargs", "step_seed"]

_MASK = (1 << 64) - 1


def step_seed(seed: int | None, step: int, index: int = 0) -> int:
    """The seed (an int in [0, 2**64)) of buffer ``index`` at training step ``step`` for the
    user's ``seed``: ``mix(mix(mix(seed) ^ step) ^ index)`` with splitmix64's finaliser, so
    neighbouring steps and buffers get unrelated values. Raises ValueError for a negative step
    or index."""
    if step < 0 or index < 0:
        raise ValueError(f"step_seed: step and index must be >= 0, got {step}, {index}")
    return mix64(mix64(mix64((seed or 0) & _MASK) ^ (int(step) & _MASK)) ^ (int(index) & _MASK))


def call_kwargs(opts: CallOptions, step: int, index: int = 0) -> dict[str, Any]:
    """The keywords of one collective call of buffer ``index`` at ``step``: the options, with the
    seed derived by :func:`step_seed` under stochastic rounding (None under nearest)."""
    kw = opts.as_kwargs()
    kw["seed"] = step_seed(opts.seed, step, index) if opts.rounding == "stochastic" else None
    return kw
