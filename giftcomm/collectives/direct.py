"""Direct (two-shot) reduce-scatter: every contribution quantized once, summed by the owner.

Each rank encodes its values of every other rank's chunk once and sends them straight to that
chunk's owner (an all-to-all of FP8 messages, in slices). The owner sums the P contributions in
rank order in the accumulation dtype (collectives/rank_order.py, shared with the shared-window
path); its own values enter unquantized. One quantization per value instead of the ring's P-1
requantizations, for the same bytes on the wire. The allgather that follows is the ring's
(collectives/ring.py).

Schedules: every receive is posted first, then every slice is encoded and sent; the owner sums
slice by slice as contributions arrive. On a GROUPED transport the first wait issues all of it as
one group (an all-to-all), and the sums follow in stream order. NumPy or CuPy arrays.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..transport import Request, Transport, wait_all
from .rank_order import sum_in_rank_order
from .ring import DEFAULT_SLICE_ELEMS, Own, encode_sliced, layout_of, owner_buffer
from .wire import Wire
from .workspace import workspace_of


def reduce_scatter(
    t: Transport, x: Any, bounds: np.ndarray, wire: Wire, acc_t: np.dtype,
    slice_elems: int = DEFAULT_SLICE_ELEMS, keep_sum: bool = True, own_out: Any = None, own: Own | None = None,
) -> tuple[Any, Any]:
    """Direct reduce-scatter of the flat vector ``x``; returns (sum, owner message) like the ring's
    (sum None when ``keep_sum`` is False: it is then summed in a reused workspace buffer; the
    message goes to ``own_out`` when given). ``own``: where this rank's values come from
    (ring.Own; default: ``x``)."""
    p, r, xp = t.size, t.rank, wire.xp
    own = Own(x, wire, acc_t) if own is None else own
    counts = np.diff(bounds)
    slices = layout_of(counts, wire.fmt, wire.block, slice_elems).slices
    mine = slices[r]
    ws = workspace_of(t, xp)
    inbox = ws.get("direct_in", mine.nbytes * max(p - 1, 1))
    outbox = ws.get("direct_out", sum(s.nbytes for c, s in enumerate(slices) if c != r))
    # Post every receive first: contributions to our chunk from each other rank, in slices.
    peers = [(r - k) % p for k in range(1, p)]
    slot = {src: inbox[i * mine.nbytes : (i + 1) * mine.nbytes] for i, src in enumerate(peers)}
    recvs = {src: [t.irecv(slot[src][mine.bytes[k] : mine.bytes[k + 1]], src, tag=k) for k in range(mine.nslices)]
             for src in peers}
    # Encode and send our values of every other chunk, nearest destination first.
    sends: list[Request] = []
    off = 0
    for k in range(1, p):
        dest = (r + k) % p
        sl, lo = slices[dest], int(bounds[dest])
        msg = outbox[off : off + sl.nbytes]
        off += sl.nbytes
        for j in range(sl.nslices):
            a, b = sl.elems[j], sl.elems[j + 1]
            piece = msg[sl.bytes[j] : sl.bytes[j + 1]]
            own.encode(lo + a, lo + b, piece)
            sends.append(t.isend(piece, dest, tag=j))
    # Sum the contributions in rank order, slice by slice, as they arrive.
    n_r = int(counts[r])
    total = xp.empty(n_r, acc_t) if keep_sum else ws.get("direct_sum", n_r * acc_t.itemsize).view(acc_t)
    lo_r = int(bounds[r])

    def arrived(src: int, j: int) -> Any:
        recvs[src][j].wait()
        return slot[src][mine.bytes[j] : mine.bytes[j + 1]]

    for j in range(mine.nslices):
        a, b = mine.elems[j], mine.elems[j + 1]
        sum_in_rank_order(total[a:b], p, r, own.values(lo_r + a, lo_r + b), lambda src: arrived(src, j), wire)
    wait_all(sends)
    own_msg = encode_sliced(wire, total, mine, owner_buffer(t, wire, mine.nbytes, own_out), lo_r)
    return (total if keep_sum else None), own_msg
