"""Recursive doubling allreduce for small, latency-bound messages: log2(P) exchanges.

Let P2 be the largest power of two <= P. Ranks P2.. first fold their encoded vector into rank
r - P2 (which adds it to its own values). Then, for i = 0, 1, ...: partners r and r XOR 2^i
exchange their encoded partial sums and both compute ``decode(low) + decode(high)`` (the lower
rank's message first), so partners, and by induction whole groups, hold bit-identical sums. At
the end the sum is encoded once; every rank decodes those bytes (the folded ranks receive them).
Each value is quantized log2(P2) + 2 times (at most): for small messages, where latency and not
bytes dominate.
"""
from __future__ import annotations

import numpy as np

from .. import codec
from ..formats import Format, message_nbytes
from ..transport import Transport
from .workspace import workspace_of


def largest_power_of_two(p: int) -> int:
    """The largest power of two <= p (p >= 1)."""
    return 1 << (p.bit_length() - 1)


def _decoded(msg: np.ndarray, n: int, fmt: Format, block: int, acc_t: np.dtype) -> np.ndarray:
    return codec.decode(msg, n, fmt, block).astype(acc_t, copy=False)


def allreduce(t: Transport, x: np.ndarray, fmt: Format, block: int, acc_t: np.dtype) -> np.ndarray:
    """Sum of the flat vector ``x`` over all ranks, as float32 values decoded from one message."""
    p, r, n = t.size, t.rank, x.size
    p2 = largest_power_of_two(p)
    nbytes = message_nbytes(n, fmt, block)
    ws = workspace_of(t)
    mine, theirs = ws.get("rd_mine", nbytes), ws.get("rd_theirs", nbytes)
    acc = np.array(x, dtype=acc_t, copy=True)
    if r >= p2:  # fold into r - p2, then wait for the final message
        codec.encode(acc.astype(np.float32, copy=False), fmt, block, out=mine)
        t.isend(mine, r - p2, tag=0).wait()
        t.irecv(theirs, r - p2, tag=1).wait()
        return codec.decode(theirs, n, fmt, block)
    with np.errstate(invalid="ignore", over="ignore"):
        if r + p2 < p:
            t.irecv(theirs, r + p2, tag=0).wait()
            acc += _decoded(theirs, n, fmt, block, acc_t)
        dist = 1
        while dist < p2:
            partner = r ^ dist
            codec.encode(acc.astype(np.float32, copy=False), fmt, block, out=mine)
            t.sendrecv(mine, partner, theirs, partner, tag=2)
            low, high = (mine, theirs) if r < partner else (theirs, mine)
            acc = _decoded(low, n, fmt, block, acc_t) + _decoded(high, n, fmt, block, acc_t)
            dist *= 2
    codec.encode(acc.astype(np.float32, copy=False), fmt, block, out=mine)
    if r + p2 < p:
        t.isend(mine, r + p2, tag=1).wait()
    return codec.decode(mine, n, fmt, block)
