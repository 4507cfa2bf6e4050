"""Direct (two-shot) reduce-scatter for stream-ordered transports, on any array backend.

Same bytes as :mod:`giftcomm.collectives.direct` (so ``giftcomm.reference.simulate_allreduce(...,
algorithm="direct")`` bit for bit): each rank encodes its values of the P-1 chunks of
``giftcomm.partition.chunk_bounds`` it does not own, once each, and sends each message to that
chunk's owner; the owner sums the P contributions in rank order
(:func:`giftcomm.collectives.rank_order.sum_in_rank_order`, shared with the host algorithm), its own
values exact; then it encodes its sum once, for the ring allgather (giftcomm.cuda.ring).

Communication: one batch, every receive and every send queued and then ``wait_all``: an
all-to-all of one FP8 message per peer. On NCCL that is one group on the current stream (the
host never blocks); it runs as well over the CUDA-aware MPI transport and the device loopback.

Arrays: ``x`` NumPy or CuPy, float32/float64/float16 (bfloat16 on the device: convert with
giftcomm._xp.to_float32 first); the codec is giftcomm.cuda.codec for CuPy, giftcomm.codec for NumPy.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import _xp
from ..collectives.rank_order import sum_in_rank_order
from ..formats import Format, message_nbytes
from ..transport.base import Transport, wait_all
from . import ring

__all__ = ["reduce_scatter", "allreduce"]


def reduce_scatter(t: Transport, x: Any, bounds: np.ndarray, f: Format, block: int, acc_t: np.dtype,
                   codec: Any = None) -> tuple[Any, Any]:
    """Direct reduce-scatter of the contiguous flat vector ``x`` (the arguments and results of
    :func:`giftcomm.cuda.ring.reduce_scatter`).

    Returns (sum, message): this rank's chunk summed over all ranks, a new (bounds[r+1]-bounds[r],)
    array of ``acc_t`` on ``x``'s backend, and that sum encoded once (uint8, ``message_nbytes``).
    """
    xp = _xp.array_module(x)
    codec = codec or ring.codec_for(x)
    p, r = t.size, t.rank
    sizes = [message_nbytes(int(n), f, block) for n in np.diff(bounds)]
    peers = [(r - k) % p for k in range(1, p)]  # sources, nearest first
    dests = [(r + k) % p for k in range(1, p)]
    inbox = xp.empty(max(sizes[r] * len(peers), 1), np.uint8)
    slot = {src: inbox[i * sizes[r] : (i + 1) * sizes[r]] for i, src in enumerate(peers)}
    outbox = xp.empty(max(sum(sizes[d] for d in dests), 1), np.uint8)
    reqs = [t.irecv(slot[src], src, tag=0) for src in peers]
    off = 0
    for dest in dests:
        msg = outbox[off : off + sizes[dest]]
        off += sizes[dest]
        part = x[int(bounds[dest]) : int(bounds[dest + 1])]
        codec.encode(part.astype(np.float32, copy=False), f, block, out=msg)
        reqs.append(t.isend(msg, dest, tag=0))
    wait_all(reqs)
    lo, hi = int(bounds[r]), int(bounds[r + 1])
    total = sum_in_rank_order(xp.empty(hi - lo, acc_t), p, r, x[lo:hi], slot.__getitem__, f, block, codec)
    own = codec.encode(total.astype(np.float32, copy=False), f, block, out=xp.empty(sizes[r], np.uint8))
    return total, own


def allreduce(t: Transport, x: Any, fmt: str | Format = "e4m3", block: int = 256, op: str = "sum",
              codec: Any = None) -> Any:
    """:func:`giftcomm.cuda.ring.allreduce` with this direct reduce-scatter: equal bit for bit to
    ``simulate_allreduce(inputs, fmt, block, op, algorithm="direct")``."""
    return ring.allreduce(t, x, fmt, block, op, codec, scatter=reduce_scatter)
