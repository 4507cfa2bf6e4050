"""One-shot allreduce for small messages: every rank sends its encoded vector to every other
rank and each rank sums all P messages itself, in rank order.

Each contribution is quantized exactly once (the rank's own as well, so that every rank sums the
very same bytes in the same order: bit-identical results without a final re-encode). One
exchange (P-1 sends and receives per rank, one group on a GROUPED transport) instead of the
ring's 2(P-1) hops: for latency-bound sizes. The bytes moved per rank grow with P, so large
buffers belong to the ring or the direct algorithm.

A message may carry a small int64 header ahead of its payload (the persistent plans of
giftcomm.plans.persistent put the call's check word there, so that checking that every rank made the
same call costs no extra round trip). Host or device arrays; headers only on host buffers.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from .. import _xp
from ..transport import Transport, wait_all
from .wire import Wire
from .workspace import workspace_of


class Exchanged:
    """Every rank's message after :func:`exchange`: ``header(q)`` (int64 view) and
    ``message(q)`` (uint8 view) of rank q, valid until the next exchange on the transport."""

    def __init__(self, buf: Any, stride: int, head: int, nbytes: int) -> None:
        self.buf, self.stride, self.head, self.nbytes = buf, stride, head, nbytes

    def header(self, q: int) -> np.ndarray:
        return self.buf[q * self.stride : q * self.stride + self.head].view(np.int64)

    def headers(self) -> np.ndarray:
        """Every rank's header: an int64 (P, head/8) view (host buffers)."""
        rows = self.buf.view(np.int64).reshape(-1, self.stride // 8)
        return rows[:, : self.head // 8]

    def message(self, q: int) -> Any:
        lo = q * self.stride + self.head
        return self.buf[lo : lo + self.nbytes]


def exchange(t: Transport, x: Any, wire: Wire, header: np.ndarray | None = None,
             encode: Callable[[Any], None] | None = None) -> Exchanged:
    """Encode ``x`` (1-D, contiguous, any float dtype) behind ``header`` (int64, host arrays only)
    and swap messages with every other rank. ``encode(message)``: writes this rank's message
    instead (the fused GIFT path, giftcomm.collectives.gift)."""
    p, r = t.size, t.rank
    head = 0 if header is None else 8 * header.size
    nbytes = wire.nbytes(x.size)
    stride = -(-(head + nbytes) // 8) * 8  # every message (and its scales) 8-byte aligned
    buf = workspace_of(t, wire.xp).get("oneshot", stride * p)
    got = Exchanged(buf, stride, head, nbytes)
    if header is not None:
        got.header(r)[...] = header
    if encode is None:
        wire.encode(x, got.message(r))
    else:
        encode(got.message(r))
    mine = buf[r * stride : (r + 1) * stride]
    peers = [(r + k) % p for k in range(1, p)]
    reqs = [t.irecv(buf[q * stride : (q + 1) * stride], q, tag=0) for q in peers]
    reqs += [t.isend(mine, q, tag=0) for q in peers]
    wait_all(reqs)
    return got


def reduce(messages: Sequence[Any], n: int, wire: Wire, acc_t: np.dtype, out: Any = None) -> Any:
    """The sum of every rank's message (``n`` values each, in rank order) in ``acc_t``: float32
    accumulates into ``out`` (float32, n) when given."""
    with np.errstate(invalid="ignore", over="ignore"):
        if acc_t == np.float32:
            total = wire.decode(messages[0], n, out=out)
            for msg in messages[1:]:
                wire.accumulate(msg, total)
            return total
        total = _xp.astype(wire.decode(messages[0], n), acc_t)
        for msg in messages[1:]:
            total += _xp.astype(wire.decode(msg, n), acc_t)
        return total


def allreduce(t: Transport, x: Any, wire: Wire, acc_t: np.dtype, out: Any = None) -> Any:
    """The one-shot sum of ``x`` over all ranks (``out`` if given and float32)."""
    got = exchange(t, x, wire)
    return reduce([got.message(q) for q in range(t.size)], x.size, wire, acc_t, out)
