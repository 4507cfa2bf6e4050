"""Recursive doubling allreduce for small, latency-bound messages: log2(P) exchanges.

Let P2 be the largest power of two <= P. Ranks P2.. first fold their encoded vector into rank
r - P2 (which adds it to its own values). Then, for i = 0, 1, ...: partners r and r XOR 2^i
exchange their encoded partial sums and both compute ``decode(low) + decode(high)`` (the lower
rank's message first), so partners, and by induction whole groups, hold bit-identical sums. At
the end the sum is encoded once; every rank decodes those bytes (the folded ranks receive them).
Each value is quantized log2(P2) + 2 times (at most): for small messages, where latency and not
bytes dominate. Every exchange is a single send/receive pair that is waited on at once, so it runs
on PIPELINED and GROUPED transports alike; NumPy or CuPy arrays.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import _xp
from ..transport import Transport
from .ring import Own
from .wire import Wire
from .workspace import workspace_of


def _decoded(wire: Wire, msg: Any, n: int, acc_t: np.dtype) -> Any:
    return _xp.astype(wire.decode(msg, n), acc_t, copy=False)


def allreduce(t: Transport, x: Any, wire: Wire, acc_t: np.dtype, out: Any = None, own: Own | None = None) -> Any:
    """Sum of the flat vector ``x`` over all ranks, as float32 values decoded from one message
    (into ``out``, a float32 array of ``x.size``, when given).

    Stochastic rounding: round i's messages are keyed by the group ``rank >> i`` (the ranks that
    hold one partial sum encode it alike), stage 1 + i; a folded rank's first message by its
    rank, stage 0. ``own`` (ring.Own, rounding to nearest only): writes this rank's first message
    from its own values (the fused GIFT path: its values are computed in the encode) instead of
    ``x``; a rank that a folded rank adds into gets it as a hop (decode(folded) + own values)."""
    p, r, n = t.size, t.rank, x.size
    p2 = 1 << (p.bit_length() - 1)  # the largest power of two <= P
    nbytes = wire.nbytes(n)
    ws = workspace_of(t, wire.xp)
    mine, theirs = ws.get("rd_mine", nbytes), ws.get("rd_theirs", nbytes)
    acc = _xp.astype(x, acc_t, copy=True) if own is None else None
    rounds = p2.bit_length() - 1
    if r >= p2:  # fold into r - p2, then wait for the final message
        if own is None:
            wire.at(party=wire.party, stage=0).encode(acc, mine)
        else:
            own.encode(0, n, mine)
        t.isend(mine, r - p2, tag=0).wait()
        t.irecv(theirs, r - p2, tag=1).wait()
        return wire.decode(theirs, n, out)
    with np.errstate(invalid="ignore", over="ignore"):
        if r + p2 < p:
            t.irecv(theirs, r + p2, tag=0).wait()
            if own is None:
                _xp.add_inplace(acc, _decoded(wire, theirs, n, acc_t))
        if own is not None:  # the first message: own values (plus the folded rank's), encoded in one pass
            if r + p2 < p:
                own.hop(theirs, 0, n, mine)
            else:
                own.encode(0, n, mine)
            if rounds == 0:  # P = 1: that message is the final one
                return wire.decode(mine, n, out)
        for i in range(rounds):
            partner = r ^ (1 << i)
            if acc is not None:
                wire.at(party=r >> i, stage=1 + i).encode(acc, mine)
            t.sendrecv(mine, partner, theirs, partner, tag=2)
            low, high = (mine, theirs) if r < partner else (theirs, mine)
            acc = _xp.add(_decoded(wire, low, n, acc_t), _decoded(wire, high, n, acc_t))
    wire.at(party=0, stage=1 + rounds).encode(acc, mine)
    if r + p2 < p:
        t.isend(mine, r + p2, tag=1).wait()
    return wire.decode(mine, n, out)
