"""The ring reduce-scatter / allgather for stream-ordered transports, on any array backend.

Same algorithm and the same bytes as :mod:`giftcomm.collectives.ring` (so the result equals
``giftcomm.reference.simulate_allreduce`` bit for bit): chunk ``c`` of
``giftcomm.partition.chunk_bounds`` starts at rank ``c+1`` and travels right; each rank decodes
it, adds its own values in the accumulation dtype, re-encodes; the owner keeps the sum, encodes
it once, and those bytes travel P-1 hops unchanged; every rank decodes them.

The difference is the communication pattern: each hop queues its receive and its send and then
waits for both, one message per chunk per hop. That is what NCCL needs (a group of matching
send/recv per hop, stream-ordered: the host never blocks), and it also runs over the CUDA-aware
MPI transport and the device loopback. Slicing a chunk into several messages (pipelining the
codec with the transfers) changes speed, never bytes; it is left to the integrated ring.

Arrays: ``x`` NumPy or CuPy, float32/float64/float16 (bfloat16 on the device: convert with
giftcomm._xp.to_float32 first). The codec is giftcomm.cuda.codec for CuPy, giftcomm.codec for
NumPy (or pass ``codec=``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import _xp
from ..formats import Format, check_block, get_format, message_nbytes
from ..partition import accumulation_dtype, shared_chunk_bounds
from ..transport.base import Transport, wait_all

__all__ = ["allreduce", "allreduce_flat", "reduce_scatter", "allgather", "codec_for"]


def codec_for(x: Any) -> Any:
    """The codec module of an array's backend."""
    if _xp.array_module(x) is np:
        from .. import codec

        return codec
    from . import codec

    return codec


def _hop(codec: Any, xp: Any, recv: Any, local: Any, f: Format, block: int, out: Any, sum_out: Any) -> None:
    if local.dtype == np.float32:
        codec.decode_add_encode(recv, local, f, block, out=out, sum_out=sum_out)
        return
    total = codec.decode(recv, local.size, f, block).astype(local.dtype) + local
    codec.encode(total.astype(np.float32), f, block, out=out)
    if sum_out is not None:
        sum_out[...] = total


def reduce_scatter(t: Transport, x: Any, bounds: np.ndarray, f: Format, block: int, acc_t: np.dtype,
                   codec: Any = None) -> tuple[Any, Any]:
    """Ring reduce-scatter of the flat vector ``x``.

    Returns (sum, message): this rank's chunk summed over all ranks in ``acc_t`` (a new array of
    ``x``'s backend) and that sum encoded once (uint8 message of ``message_nbytes(count)``).
    """
    xp = _xp.array_module(x)
    codec = codec or codec_for(x)
    p, r = t.size, t.rank
    counts = np.diff(bounds)
    sizes = [message_nbytes(int(n), f, block) for n in counts]
    own = xp.empty(sizes[r], np.uint8)
    total = xp.empty(int(counts[r]), acc_t)

    def local(c: int) -> Any:
        part = x[int(bounds[c]) : int(bounds[c + 1])]
        return part if part.dtype == acc_t else part.astype(acc_t)

    if p == 1:
        total[...] = local(r)
        return total, codec.encode(total.astype(np.float32), f, block, out=own)
    right, left = (r + 1) % p, (r - 1) % p
    biggest = max(sizes)
    send = [xp.empty(biggest, np.uint8), xp.empty(biggest, np.uint8)]
    recv = xp.empty(biggest, np.uint8)
    c0 = left
    cur = send[0][: sizes[c0]]
    codec.encode(local(c0).astype(np.float32), f, block, out=cur)
    for step in range(p - 1):
        c = (r - step - 2) % p
        rbuf = recv[: sizes[c]]
        wait_all([t.irecv(rbuf, left, tag=step), t.isend(cur, right, tag=step)])
        if step == p - 2:
            _hop(codec, xp, rbuf, local(c), f, block, out=own, sum_out=total)
        else:
            cur = send[(step + 1) % 2][: sizes[c]]
            _hop(codec, xp, rbuf, local(c), f, block, out=cur, sum_out=None)
    return total, own


def allgather(t: Transport, own: Any, counts: np.ndarray, f: Format, block: int, codec: Any = None,
              out: Any = None) -> Any:
    """Ring allgather of one chunk message per rank, decoded into float32 (``out`` if given).

    ``own``: this rank's message of ``counts[rank]`` values. Returns all ``sum(counts)`` values in
    rank order, on ``own``'s backend.
    """
    xp = _xp.array_module(own)
    codec = codec or codec_for(own)
    p, r = t.size, t.rank
    sizes = [message_nbytes(int(n), f, block) for n in counts]
    offs = np.zeros(p + 1, np.int64)
    np.cumsum(sizes, out=offs[1:])
    elem = np.zeros(p + 1, np.int64)
    np.cumsum(counts, out=elem[1:])
    buf = xp.empty(max(int(offs[-1]), 1), np.uint8)
    slot = [buf[int(offs[c]) : int(offs[c + 1])] for c in range(p)]
    values = xp.empty(int(elem[-1]), np.float32) if out is None else out
    slot[r][...] = own
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        send_c, recv_c = (r - step) % p, (r - step - 1) % p
        wait_all([t.irecv(slot[recv_c], left, tag=step), t.isend(slot[send_c], right, tag=step)])
    for c in range(p):
        codec.decode(slot[c], int(counts[c]), f, block, out=values[int(elem[c]) : int(elem[c + 1])])
    return values


def allreduce_flat(t: Transport, flat: Any, f: Format, block: int, codec: Any = None, scatter: Any = None) -> Any:
    """The sum over the ranks of ``t`` of the contiguous 1-D ``flat`` (size > 0), decoded, as a new
    (size,) array of the accumulation dtype (float64 for float64 input, else float32).

    ``scatter``: the reduce-scatter, this module's ring by default; giftcomm.cuda.direct's takes
    the same arguments. Then the ring allgather of the owners' messages.
    """
    acc_t = accumulation_dtype(flat.dtype)
    bounds = shared_chunk_bounds(flat.size, t.size, block)
    _, own = (scatter or reduce_scatter)(t, flat, bounds, f, block, acc_t, codec)
    return allgather(t, own, np.diff(bounds), f, block, codec).astype(acc_t, copy=False)


def allreduce(t: Transport, x: Any, fmt: str | Format = "e4m3", block: int = 256, op: str = "sum",
              codec: Any = None, scatter: Any = None) -> Any:
    """Sum (or average) ``x`` over the ranks of ``t``: an array of ``x``'s shape, dtype, backend,
    equal bit for bit to ``giftcomm.reference.simulate_allreduce`` of all ranks' inputs
    (algorithm "ring"; "direct" with ``scatter=giftcomm.cuda.direct.reduce_scatter``).

    No cross-rank argument check here (the public API's ``agree`` step does that): every rank
    must pass the same size, dtype, fmt, block and op.
    """
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    f, block = get_format(fmt), check_block(block)
    xp = _xp.array_module(x)
    flat = xp.ascontiguousarray(x).reshape(-1)
    if flat.size == 0:
        return x.copy()
    values = allreduce_flat(t, flat, f, block, codec or codec_for(x), scatter)
    if op == "avg":
        values = values / values.dtype.type(t.size)
    return values.astype(x.dtype).reshape(x.shape)
