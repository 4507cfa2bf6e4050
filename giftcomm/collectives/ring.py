"""Ring reduce-scatter with in-ring FP8 requantization, and the ring allgather of FP8 messages.

Chunk layout: :func:`giftcomm.partition.chunk_bounds`. Chunk ``c`` starts at rank ``c+1`` and
travels right around the ring; each rank on the way decodes it, adds its own values in the
accumulation dtype and re-encodes it; rank ``c`` adds last and keeps the high-precision sum. In
the allgather, each owner's encoded message travels P-1 hops unchanged, so every rank decodes the
very same bytes.
"""
from __future__ import annotations

import numpy as np

from .. import codec
from ..formats import Format, message_nbytes
from ..transport import Transport
from .workspace import workspace_of


def _local(x: np.ndarray, lo: int, hi: int, acc_t: np.dtype) -> np.ndarray:
    part = x[lo:hi]
    return part if part.dtype == acc_t else part.astype(acc_t)


def _hop(recv: np.ndarray, local: np.ndarray, fmt: Format, block: int, out: np.ndarray, keep_sum: bool):
    """Decode ``recv``, add ``local`` (accumulation dtype), encode into ``out``; maybe return the sum."""
    if local.dtype == np.float32:
        total = np.empty(local.size, np.float32) if keep_sum else None
        codec.decode_add_encode(recv, local, fmt, block, out=out, sum_out=total)
        return total
    with np.errstate(invalid="ignore", over="ignore"):
        total = codec.decode(recv, local.size, fmt, block).astype(local.dtype) + local
        codec.encode(total.astype(np.float32), fmt, block, out=out)
    return total


def reduce_scatter(
    t: Transport, x: np.ndarray, bounds: np.ndarray, fmt: Format, block: int, acc_t: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Ring reduce-scatter of the flat vector ``x`` (1-D, contiguous, any float dtype).

    Returns (sum, message): this rank's chunk summed over all ranks in ``acc_t`` (a new array),
    and that sum encoded once (a workspace view, valid until the next collective).
    """
    p, r = t.size, t.rank
    counts = np.diff(bounds)
    ws = workspace_of(t)
    sizes = [message_nbytes(int(n), fmt, block) for n in counts]
    own = ws.get("owner", sizes[r])
    if p == 1:
        total = np.array(_local(x, 0, x.size, acc_t), copy=True)
        codec.encode(total.astype(np.float32, copy=False), fmt, block, out=own)
        return total, own
    right, left = (r + 1) % p, (r - 1) % p
    biggest = max(sizes)
    send_buf, recv_buf = ws.get("send", biggest), ws.get("recv", biggest)
    c = left
    send = codec.encode(_local(x, bounds[c], bounds[c + 1], acc_t).astype(np.float32, copy=False), fmt, block,
                        out=send_buf[: sizes[c]])
    total = None
    for step in range(p - 1):
        c = (r - step - 2) % p
        recv = recv_buf[: sizes[c]]
        t.sendrecv(send, right, recv, left)
        local = _local(x, bounds[c], bounds[c + 1], acc_t)
        last = step == p - 2
        send = send_buf[: sizes[c]] if not last else own
        total = _hop(recv, local, fmt, block, out=send, keep_sum=last)
    assert total is not None
    return total, own


def allgather_messages(
    t: Transport, own: np.ndarray, counts: np.ndarray, fmt: Format, block: int
) -> list[np.ndarray]:
    """Ring allgather of one wire message per rank (rank r's carries ``counts[r]`` values).

    Returns the P messages in rank order, as views of one workspace buffer.
    """
    p, r = t.size, t.rank
    sizes = np.array([message_nbytes(int(n), fmt, block) for n in counts], np.int64)
    offs = np.zeros(p + 1, np.int64)
    np.cumsum(sizes, out=offs[1:])
    buf = workspace_of(t).get("gather", int(offs[-1]))
    slots = [buf[offs[c] : offs[c + 1]] for c in range(p)]
    slots[r][...] = own
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        t.sendrecv(slots[(r - step) % p], right, slots[(r - step - 1) % p], left)
    return slots


def decode_all(messages: list[np.ndarray], counts: np.ndarray, fmt: Format, block: int) -> np.ndarray:
    """Decode the P messages of an allgather into one new float32 vector, in rank order."""
    out = np.empty(int(np.sum(counts)), np.float32)
    lo = 0
    for msg, n in zip(messages, counts):
        codec.decode(msg, int(n), fmt, block, out=out[lo : lo + int(n)])
        lo += int(n)
    return out
