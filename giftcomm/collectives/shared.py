"""Zero-copy allreduce over a node-shared window: the ring's or the direct algorithm's bytes,
with no message copied.

When every rank is on one node (the transport offers :meth:`Transport.shared_window`), a rank
writes each wire message into its own part of the window and the rank that needs it decodes it
from there, in place. Messages over MPI cost a copy in and a copy out on top of the codec; here
the codec touches each message byte once on each side. Between the phases, one fence (a barrier
that orders memory) per hop replaces the receives.

The arithmetic is exactly that of giftcomm.collectives.ring (or .direct): the same chunks, slices,
hops in the same order, the same codec calls; so the result is bit-identical to the message path
and to ``giftcomm.reference.simulate_allreduce`` with the same algorithm.

Window layout, per rank, for chunk messages sliced as :func:`ring.layout_of`:
  ring:   [hop slot 0][hop slot 1][owner message], each slot as big as the largest chunk message.
          Hop s writes slot (s+1) % 2 while the right neighbour reads slot s % 2.
  direct: [message of chunk 0][chunk 1]...[chunk P-1] at the allgather offsets; chunk c's part
          holds this rank's contribution to chunk c, except the own chunk's, which holds the
          owner message.
Every write to a part of the window happens at least one fence after the last read of it (see
giftcomm/transport/shared_window.py), so repeated calls need no extra fence.
"""
from __future__ import annotations

import numpy as np

from ..transport import Transport
from ..transport.shared_window import SharedWindow
from .rank_order import sum_in_rank_order
from .ring import RingLayout, encode_sliced, layout_of, local_part, message_piece
from .wire import Wire
from .workspace import workspace_of


def window_nbytes(layout: RingLayout, direct: bool) -> int:
    """Bytes per rank of the window for one allreduce (the same on every rank)."""
    if direct:
        return int(layout.msg_offs[-1])
    return 3 * layout.biggest


def _ring_scatter(t: Transport, win: SharedWindow, x: np.ndarray, bounds: np.ndarray, layout: RingLayout,
                  wire: Wire, acc_t: np.dtype) -> list[np.ndarray]:
    """The ring reduce-scatter into the window; returns every rank's owner message (views)."""
    p, r = t.size, t.rank
    slices, views = layout.slices, win.views
    step = layout.biggest

    def part(q: int, i: int, c: int) -> np.ndarray:  # rank q's slot i, holding a message of chunk c
        return views[q][i * step : i * step + slices[c].nbytes]

    # encode_sliced casts slice by slice to float32 (no chunk-sized copy for 16-bit input)
    if p == 1:
        encode_sliced(wire, x[int(bounds[0]) : int(bounds[1])], slices[0], part(0, 2, 0), int(bounds[0]))
        return [part(0, 2, 0)]
    left = (r - 1) % p
    encode_sliced(wire, x[int(bounds[left]) : int(bounds[left + 1])], slices[left], part(r, 0, left), int(bounds[left]))
    win.fence()
    for s in range(p - 1):
        c = (r - s - 2) % p
        sl, lo = slices[c], int(bounds[c])
        recv = part(left, s % 2, c)
        dest = part(r, 2 if s == p - 2 else (s + 1) % 2, c)
        for k in range(sl.nslices):
            a, b = sl.elems[k], sl.elems[k + 1]
            wire.hop(message_piece(recv, sl, k), local_part(x, lo + a, lo + b, acc_t), out=message_piece(dest, sl, k),
                     offset=lo + a)
        win.fence()
    return [part(q, 2, q) for q in range(p)]


def _direct_scatter(t: Transport, win: SharedWindow, x: np.ndarray, bounds: np.ndarray, layout: RingLayout,
                    wire: Wire, acc_t: np.dtype) -> list[np.ndarray]:
    """The direct reduce-scatter into the window; returns every rank's owner message (views)."""
    p, r = t.size, t.rank
    slices, offs, views = layout.slices, layout.msg_offs, win.views

    def part(q: int, c: int) -> np.ndarray:  # rank q's part for chunk c
        return views[q][offs[c] : offs[c + 1]]

    for k in range(1, p):
        c = (r + k) % p
        encode_sliced(wire, x[int(bounds[c]) : int(bounds[c + 1])], slices[c], part(r, c), int(bounds[c]))
    if p > 1:
        win.fence()
    mine, lo = slices[r], int(bounds[r])
    widest = int(np.diff(mine.elems).max())
    acc = workspace_of(t).get("shared_sum", widest * acc_t.itemsize).view(acc_t)
    own = part(r, r)
    for j in range(mine.nslices):
        a, b = mine.elems[j], mine.elems[j + 1]
        total = acc[: b - a]
        sum_in_rank_order(total, p, r, x[lo + a : lo + b],
                          lambda src: message_piece(part(src, r), mine, j), wire)
        wire.encode(total, message_piece(own, mine, j), lo + a)
    win.fence()
    return [part(q, q) for q in range(p)]


def allreduce(
    t: Transport, x: np.ndarray, bounds: np.ndarray, wire: Wire, acc_t: np.dtype,
    slice_elems: int, direct: bool = False, out: np.ndarray | None = None,
) -> np.ndarray | None:
    """The decoded float32 sum of ``x`` (1-D, contiguous, any float dtype) over all ranks, by the
    ring (or, ``direct``, the direct) algorithm through ``t``'s shared window; ``out`` (float32,
    ``x.size``) if given. Collective. None, on every rank, when ``t`` has no window to give
    (``shared_memory`` off, or no room for the window): the caller then sends messages."""
    counts = bounds[1:] - bounds[:-1]
    layout = layout_of(counts, wire.fmt, wire.block, slice_elems)
    win = t.shared_window(window_nbytes(layout, direct))
    if win is None:
        return None
    scatter = _direct_scatter if direct else _ring_scatter
    owners = scatter(t, win, x, bounds, layout, wire, acc_t)
    values = np.empty(int(layout.elem_offs[-1]), np.float32) if out is None else out
    for i in range(t.size):
        c = (t.rank + i) % t.size  # own chunk first: it is still in cache
        elems, offs, base, msg = layout.slices[c].elems, layout.slices[c].bytes, int(layout.elem_offs[c]), owners[c]
        for k in range(len(elems) - 1):
            a, b = elems[k], elems[k + 1]
            wire.decode(msg[offs[k] : offs[k + 1]], b - a, out=values[base + a : base + b])
    return values
