"""Pipelined ring reduce-scatter with in-ring FP8 requantization, and the ring allgather.

Chunk layout: :func:`giftcomm.algorithms.partition.chunk_bounds`. Chunk ``c`` starts at rank ``c+1`` and
travels right around the ring; each rank on the way decodes it, adds its own values in the
accumulation dtype and re-encodes it; rank ``c`` adds last and keeps the high-precision sum. In
the allgather, each owner's encoded chunk travels P-1 hops unchanged, so every rank decodes the
very same bytes.

Pipelining: every chunk is cut into slices of whole blocks, and each slice is its own wire
message. A slice received at hop ``s`` is decoded, summed, re-encoded and sent on as hop ``s+1``
at once, while the next slices are still in flight (nonblocking sends and receives). Because
slices are whole blocks of the buffer, the bytes of every block, and so the result, do not depend
on the slice size.

Schedules: over a PIPELINED transport (MPI, loopback, torch gloo) the receives of hop s+1 are
posted before hop s is worked on, and every slice is sent on as soon as it is encoded. Over a
GROUPED transport (NCCL, CUDA-aware MPI, the device loopback) operations only queue and a wait
issues the queue as one group, so each hop queues its receives and its sends and the first wait
issues them together; the hop's codec work then follows in stream order. The bytes, and so the
result, are the same either way.

Arrays: NumPy or CuPy (the :class:`~giftcomm.collectives.wire.Wire` of the call says which, and
brings that backend's codec kernels). Workspace (reused across calls, per transport and
backend): two receive and two send buffers of one chunk message each, the owner's chunk message,
and the allgather buffer of all P chunk messages. An allreduce (:func:`allreduce`) has the
reduce-scatter write the owner's message straight into its allgather slot. Slicing plans are
cached per layout (:func:`layout_of`)."""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .._xp import data_pointer
from ..formats import Format, message_nbytes
from ..transport import Request, Transport, wait_all
from ..transport.base import GROUPED
from .wire import Wire
from .workspace import workspace_of

DEFAULT_SLICE_ELEMS = 1 << 18  # 256K values: 1 MiB of float32, ~257 KiB of e4m3 per message
MIN_AUTO_SLICE, MAX_AUTO_SLICE = 1 << 16, 1 << 20
MIN_AUTO_SLICE_ONE_NODE = 1 << 18


def auto_slice_elems(n: int, nranks: int, one_node: bool = False) -> int:
    """The default slice: about a quarter of a chunk, between 64K and 1M values; when every rank
    is on one node, half a chunk, between 256K and 1M values.

    Measured (docs/performance.md): on shaped TCP links many small slices cost more in
    per-message overhead than they gain in overlap, one slice per chunk overlaps nothing; over
    shared memory a message costs little wire time to hide, so fewer, larger slices win.
    """
    share, least = (2, MIN_AUTO_SLICE_ONE_NODE) if one_node else (4, MIN_AUTO_SLICE)
    return int(min(max(n // max(nranks, 1) // share, least), MAX_AUTO_SLICE))


@dataclass(frozen=True)
class SlicedMessage:
    """The slices of one chunk: element offsets (into the chunk) and byte offsets (into its message).

    ``elems[k]:elems[k+1]`` are slice k's values; ``bytes[k]:bytes[k+1]`` its wire message (Python
    ints: the per-slice loops index with them). ``nslices`` slices, ``nbytes`` bytes in all.
    """

    elems: tuple[int, ...]
    bytes: tuple[int, ...]

    @property
    def nslices(self) -> int:
        return len(self.elems) - 1

    @property
    def nbytes(self) -> int:
        return self.bytes[-1]


@functools.lru_cache(maxsize=512)
def slice_chunk(count: int, fmt: Format, block: int, slice_elems: int) -> SlicedMessage:
    """Cut ``count`` values into slices of ``slice_elems`` rounded down to whole units (>= 1 unit):
    the format's ``slice_unit`` (its block; nvfp4's group of 1024 values), so that slicing never
    changes the bytes of a block or group.

    Cached: a training loop asks for the same few layouts on every call."""
    unit = fmt.slice_unit(block)
    step = max(slice_elems // unit, 1) * unit
    elems = [*range(0, count, step), count] if count else [0, 0]
    sizes = [message_nbytes(b - a, fmt, block) for a, b in zip(elems, elems[1:])]
    return SlicedMessage(tuple(elems), (0, *itertools.accumulate(sizes)))


@dataclass(frozen=True)
class RingLayout:
    """Every rank's chunk cut into slices, and where each chunk's message and values sit.

    ``slices[c]``: chunk c's :class:`SlicedMessage`; ``msg_offs[c]:msg_offs[c+1]``: chunk c's
    message in the allgather buffer (bytes); ``elem_offs[c]:elem_offs[c+1]``: its values in the
    gathered vector; ``biggest``: the largest chunk message (bytes), the size of a hop buffer.
    Arrays are read-only (the layout is cached and shared)."""

    slices: tuple[SlicedMessage, ...]
    msg_offs: np.ndarray
    elem_offs: np.ndarray
    biggest: int


@functools.lru_cache(maxsize=256)
def _ring_layout(counts_key: bytes, fmt: Format, block: int, slice_elems: int) -> RingLayout:
    counts = np.frombuffer(counts_key, np.int64)
    slices = tuple(slice_chunk(int(n), fmt, block, slice_elems) for n in counts)
    msg_offs = np.zeros(len(counts) + 1, np.int64)
    np.cumsum([s.nbytes for s in slices], out=msg_offs[1:])
    elem_offs = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=elem_offs[1:])
    msg_offs.flags.writeable = elem_offs.flags.writeable = False
    return RingLayout(slices, msg_offs, elem_offs, max(s.nbytes for s in slices))


def layout_of(counts: np.ndarray, fmt: Format, block: int, slice_elems: int) -> RingLayout:
    """The layout of chunks of ``counts`` values (int array, one length per rank). Cached, keyed
    by the counts' bytes: a training loop repeats a few layouts, and a tuple key costs more."""
    return _ring_layout(np.asarray(counts, np.int64).tobytes(), fmt, block, slice_elems)


def gather_slot(t: Transport, wire: Wire, layout: RingLayout) -> Any:
    """This rank's chunk message in the allgather workspace buffer, so that a reduce-scatter can
    write it in place (``own_out``) and :func:`allgather` need not copy it."""
    r = t.rank
    buf = workspace_of(t, wire.xp).get("gather", int(layout.msg_offs[-1]))
    return buf[layout.msg_offs[r] : layout.msg_offs[r + 1]]


def owner_buffer(t: Transport, wire: Wire, nbytes: int, own_out: Any) -> Any:
    """Where a reduce-scatter writes the owner's message: ``own_out`` when given, else the
    workspace buffer "owner" (valid until the next call)."""
    return workspace_of(t, wire.xp).get("owner", nbytes) if own_out is None else own_out


def encode_sliced(wire: Wire, values: Any, sl: SlicedMessage, out: Any, offset: int = 0) -> Any:
    """Encode a chunk's values (1-D, any float dtype) slice by slice into its sliced message ``out``
    (each slice cast to float32 on its own: no chunk-sized copy). ``offset``: the index of
    ``values[0]`` in the buffer (stochastic rounding's counter)."""
    for k in range(sl.nslices):
        a = int(sl.elems[k])
        wire.encode(values[a : sl.elems[k + 1]], out[sl.bytes[k] : sl.bytes[k + 1]], offset + a)
    return out


def local_part(x: Any, lo: int, hi: int, acc_t: np.dtype) -> Any:
    """``x[lo:hi]`` in the accumulation dtype (a view when it already is)."""
    part = x[lo:hi]
    return part if part.dtype == acc_t else part.astype(acc_t)


class Own:
    """This rank's values of the buffer as the reduce-scatters read them, by buffer range: today's
    path reads them from ``x`` (1-D, any float dtype) in the accumulation dtype ``acc_t``; the
    fused GIFT path (giftcomm.collectives.gift) computes its transformed values inside the codec
    kernels instead (same methods). ``lo``/``hi``: element indices of the buffer; the
    stochastic-rounding offset is ``lo``."""

    __slots__ = ("x", "wire", "acc_t")

    def __init__(self, x: Any, wire: Wire, acc_t: np.dtype) -> None:
        self.x, self.wire, self.acc_t = x, wire, acc_t

    def values(self, lo: int, hi: int) -> Any:
        """The values ``[lo, hi)`` (a view when already in the accumulation dtype)."""
        return local_part(self.x, lo, hi, self.acc_t)

    def encode(self, lo: int, hi: int, out: Any) -> None:
        """Encode the values ``[lo, hi)`` into the message ``out``."""
        self.wire.encode(self.values(lo, hi), out, lo)

    def hop(self, recv: Any, lo: int, hi: int, out: Any, sum_out: Any = None) -> None:
        """One ring hop: ``out`` = encode(decode(recv) + the values ``[lo, hi)``); the sum into
        ``sum_out`` when given."""
        self.wire.hop(recv, self.values(lo, hi), out=out, sum_out=sum_out, offset=lo)


def message_piece(buf: Any, sl: SlicedMessage, k: int) -> Any:
    """Slice ``k``'s wire message within the chunk message ``buf`` (a view)."""
    return buf[sl.bytes[k] : sl.bytes[k + 1]]


def reduce_scatter(
    t: Transport, x: Any, bounds: np.ndarray, wire: Wire, acc_t: np.dtype,
    slice_elems: int = DEFAULT_SLICE_ELEMS, keep_sum: bool = True, own_out: Any = None, own: Own | None = None,
) -> tuple[Any, Any]:
    """Pipelined ring reduce-scatter of the flat vector ``x`` (1-D, contiguous, any float dtype,
    ``wire.xp``'s backend).

    Returns (sum, message): this rank's chunk summed over all ranks in ``acc_t`` (a new array;
    None when ``keep_sum`` is False, which an allreduce uses to skip writing it), and that sum
    encoded once, slice by slice, into ``own_out`` (uint8, the message's size; by default a
    workspace view, valid until the next call). ``own``: where this rank's values come from
    (:class:`Own`; default: ``x``).
    """
    p, r, xp = t.size, t.rank, wire.xp
    own = Own(x, wire, acc_t) if own is None else own
    grouped = t.schedule == GROUPED
    counts = bounds[1:] - bounds[:-1]
    layout = layout_of(counts, wire.fmt, wire.block, slice_elems)
    slices, biggest = layout.slices, layout.biggest
    ws = workspace_of(t, xp)
    own_sl = slices[r]
    mine = owner_buffer(t, wire, own_sl.nbytes, own_out)
    lo_r = int(bounds[r])
    if p == 1:
        for k in range(own_sl.nslices):
            own.encode(lo_r + own_sl.elems[k], lo_r + own_sl.elems[k + 1], message_piece(mine, own_sl, k))
        hi_r = lo_r + int(counts[r])
        return (own.values(lo_r, hi_r).copy() if keep_sum else None), mine
    total = xp.empty(int(counts[r]), acc_t) if keep_sum else None
    right, left = (r + 1) % p, (r - 1) % p
    send_bufs = [ws.get("send0", biggest), ws.get("send1", biggest)]
    recv_bufs = [ws.get("recv0", biggest), ws.get("recv1", biggest)]
    sends: list[list[Request]] = [[], []]

    def post_receives(step: int) -> list[Request]:
        c = (r - step - 2) % p
        buf = recv_bufs[step % 2]
        return [t.irecv(message_piece(buf, slices[c], k), left, tag=step) for k in range(slices[c].nslices)]

    # Hop 0: encode our own values of chunk r-1 slice by slice, sending each as soon as it is ready.
    recvs = post_receives(0)
    c0 = left
    lo = int(bounds[c0])
    for k in range(slices[c0].nslices):
        a, b = slices[c0].elems[k], slices[c0].elems[k + 1]
        piece = message_piece(send_bufs[0], slices[c0], k)
        own.encode(lo + a, lo + b, piece)
        sends[0].append(t.isend(piece, right, tag=0))
    for step in range(p - 1):
        c = (r - step - 2) % p
        last = step == p - 2
        if grouped and step > 0:
            recvs = post_receives(step)  # queued beside this hop's sends; the first wait issues both
        nxt = [] if grouped or last else post_receives(step + 1)
        if not last:
            wait_all(sends[(step + 1) % 2])  # that send buffer was last used two hops ago
            sends[(step + 1) % 2] = []
        sl, lo = slices[c], int(bounds[c])
        for k in range(sl.nslices):
            recvs[k].wait()
            a, b = sl.elems[k], sl.elems[k + 1]
            recv = message_piece(recv_bufs[step % 2], sl, k)
            if last:
                own.hop(recv, lo + a, lo + b, message_piece(mine, sl, k), None if total is None else total[a:b])
            else:
                out = message_piece(send_bufs[(step + 1) % 2], sl, k)
                own.hop(recv, lo + a, lo + b, out)
                sends[(step + 1) % 2].append(t.isend(out, right, tag=step + 1))
        recvs = nxt
    wait_all(sends[0] + sends[1])
    return total, mine


def allgather(
    t: Transport, own: Any, counts: np.ndarray, wire: Wire,
    slice_elems: int = DEFAULT_SLICE_ELEMS, out: Any = None, decode: bool = True,
) -> Any:
    """Pipelined ring allgather of one sliced chunk message per rank, decoded into float32.

    ``own``: this rank's chunk message, sliced as :func:`slice_chunk` of ``counts[rank]``.
    Each received slice is forwarded at once and decoded while the next ones travel (on a GROUPED
    transport the forwards of a hop are issued with the next hop's receives). Returns the float32
    vector of all ``sum(counts)`` values in rank order (``out`` if given); ``decode=False``: the
    gathered wire instead (every chunk's message in rank order, :func:`layout_of`'s ``msg_offs``;
    a workspace view, valid until the next call), for a caller that decodes it itself.
    """
    p, r = t.size, t.rank
    layout = layout_of(counts, wire.fmt, wire.block, slice_elems)
    slices, offs, elem_offs = layout.slices, layout.msg_offs, layout.elem_offs
    buf = workspace_of(t, wire.xp).get("gather", int(offs[-1]))
    slots = [buf[offs[c] : offs[c + 1]] for c in range(p)]
    values = None if not decode else wire.xp.empty(int(elem_offs[-1]), np.float32) if out is None else out

    def decode_slice(c: int, k: int) -> None:
        if values is None:
            return
        sl, base = slices[c], int(elem_offs[c])
        a, b = base + sl.elems[k], base + sl.elems[k + 1]
        wire.decode(message_piece(slots[c], sl, k), int(b - a), out=values[a:b])

    right, left = (r + 1) % p, (r - 1) % p
    if own.nbytes and data_pointer(own) != data_pointer(slots[r]):  # not written in place (gather_slot)
        slots[r][...] = own
    sends: list[Request] = []
    if p > 1:
        sends = [t.isend(message_piece(slots[r], slices[r], k), right, tag=0) for k in range(slices[r].nslices)]
    for k in range(slices[r].nslices):
        decode_slice(r, k)
    for step in range(p - 1):
        c = (r - step - 1) % p
        sl = slices[c]
        recvs = [t.irecv(message_piece(slots[c], sl, k), left, tag=step) for k in range(sl.nslices)]
        for k in range(sl.nslices):
            recvs[k].wait()
            if step < p - 2:
                sends.append(t.isend(message_piece(slots[c], sl, k), right, tag=step + 1))
            decode_slice(c, k)
    wait_all(sends)
    return buf[: offs[-1]] if values is None else values


def allreduce(
    t: Transport, x: Any, bounds: np.ndarray, wire: Wire, acc_t: np.dtype,
    slice_elems: int = DEFAULT_SLICE_ELEMS, out: Any = None,
    scatter: Callable[..., tuple[Any, Any]] | None = None,
) -> Any:
    """Reduce-scatter (``scatter``: this module's :func:`reduce_scatter` by default, or the direct
    one) then :func:`allgather`: the decoded float32 sum of ``x`` (``out`` if given). The owner's
    message is written straight into its allgather slot, and its high-precision sum is not kept."""
    scatter = reduce_scatter if scatter is None else scatter
    counts = bounds[1:] - bounds[:-1]
    slot = gather_slot(t, wire, layout_of(counts, wire.fmt, wire.block, slice_elems))
    _, own = scatter(t, x, bounds, wire, acc_t, slice_elems, keep_sum=False, own_out=slot)
    return allgather(t, own, counts, wire, slice_elems, out=out)
