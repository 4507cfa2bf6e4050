"""The owner's sum in a direct reduce-scatter: every rank's contribution, in rank order.

Shared by the direct algorithm over messages (giftcomm.collectives.direct) and over the shared
window (giftcomm.collectives.shared), on any array backend, so that both produce the bytes of
``giftcomm.reference.simulate_allreduce(..., algorithm="direct")``:
contributions 0..P-1 are added in that order into the accumulation dtype; rank 0's assigns
instead of adding; the owner's own values enter exactly, every other rank's come decoded from its
wire message (quantized once).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import _xp
from .wire import Wire


def _add_decoded(acc: Any, msg: Any, wire: Wire, first: bool) -> None:
    """``acc`` (=|+=) ``decode(msg)``; float32 accumulators decode straight into ``acc``."""
    if acc.dtype == np.float32:
        if first:
            wire.decode(msg, acc.size, out=acc)
        else:
            wire.accumulate(msg, acc)
        return
    values = _xp.astype(wire.decode(msg, acc.size), acc.dtype)
    if first:
        acc[...] = values
    else:
        acc += values


def sum_in_rank_order(acc: Any, nranks: int, rank: int, own: Any, message_of: Callable[[int], Any],
                      wire: Wire) -> Any:
    """Overwrite ``acc`` with the sum of ``nranks`` contributions to one chunk (or slice), in rank order.

    acc: (n,) contiguous float32 (float64 for float64 input) NumPy or CuPy array.
    own: (n,) this rank's values (any float dtype, same backend), added exactly.
    message_of(src): the wire message (uint8, ``wire.nbytes(n)``) of rank ``src``'s n values, for
    every ``src != rank``; called in rank order, so it may wait for the message to arrive.
    wire: the call's format and codec kernels. Returns acc.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        for src in range(nranks):
            if src != rank:
                _add_decoded(acc, message_of(src), wire, src == 0)
            elif src == 0:
                acc[...] = own
            else:
                _xp.add_inplace(acc, _xp.astype(own, acc.dtype, copy=False))
    return acc
