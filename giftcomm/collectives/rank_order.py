"""The owner's sum in a direct reduce-scatter: every rank's contribution, in rank order.

Shared by the host direct algorithm (giftcomm.collectives.direct, slice by slice) and the
stream-ordered one (giftcomm.cuda.direct, one chunk at a time), on any array backend, so that
both produce the bytes of ``giftcomm.reference.simulate_allreduce(..., algorithm="direct")``:
contributions 0..P-1 are added in that order into the accumulation dtype; rank 0's assigns
instead of adding; the owner's own values enter exactly, every other rank's come decoded from its
wire message (quantized once).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..formats import Format


def _add_decoded(acc: Any, msg: Any, fmt: Format, block: int, first: bool, codec: Any) -> None:
    """``acc`` (=|+=) ``decode(msg)``; float32 accumulators decode straight into ``acc``."""
    if acc.dtype == np.float32:
        if first:
            codec.decode(msg, acc.size, fmt, block, out=acc)
        else:
            codec.decode_accumulate(msg, acc, fmt, block)
        return
    values = codec.decode(msg, acc.size, fmt, block).astype(acc.dtype)
    if first:
        acc[...] = values
    else:
        acc += values


def sum_in_rank_order(acc: Any, nranks: int, rank: int, own: Any, message_of: Callable[[int], Any],
                      fmt: Format, block: int, codec: Any) -> Any:
    """Overwrite ``acc`` with the sum of ``nranks`` contributions to one chunk (or slice), in rank order.

    acc: (n,) contiguous float32 (float64 for float64 input) NumPy or CuPy array.
    own: (n,) this rank's values (any float dtype, same backend), added exactly.
    message_of(src): the wire message (uint8, ``message_nbytes(n, fmt, block)``) of rank
    ``src``'s n values, for every ``src != rank``; called in rank order, so it may wait for the
    message to arrive. codec: giftcomm.codec (NumPy) or giftcomm.cuda.codec (CuPy). Returns acc.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        for src in range(nranks):
            if src != rank:
                _add_decoded(acc, message_of(src), fmt, block, src == 0, codec)
            elif src == 0:
                acc[...] = own
            else:
                acc += own.astype(acc.dtype, copy=False)
    return acc
