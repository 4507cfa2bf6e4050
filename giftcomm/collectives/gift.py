"""gift_allreduce on device arrays with the GIFT transform in the fused kernels (giftcomm.geometry.fused;
design: docs/gpu.md "Fused transform").

Taken by the engine (giftcomm.collectives.engine.run_allreduce) for a device (CuPy) array and a
giftcomm Geometry whose non-identity segments all have low-rank or identity sides
(:func:`takes`); host arrays and other geometries keep the unfused path (``geometry.forward`` /
``inverse``). Everything here is decided by agreed values only (format, block, rounding,
algorithm, the geometry's fingerprint), so every rank takes the same route.

Forward (the transformed values Y are never written where the route says "fused"):

=====================  ==========================================================================
ring, direct           fused: hop 0's encode (ring) / every encode of own values (direct) is the
                       fused encode of Y; the ring's later hops are fused decode-add-encodes (Y of
                       the chunk passing by computed in the hop); direct's owner adds its own Y
                       (``FusedPlan.values``) unquantized, as in the plain direct algorithm
oneshot                fused: the one encode of the whole buffer
doubling               fused: each rank's first message is the fused encode of its Y, or, on a
                       rank a folded one adds into, the fused decode-add-encode of the folded
                       rank's message and its Y; the later rounds' sums are the plain ones
hierarchical(_direct)  fused into the node-local fp32 ring (any cross-node format): its hop 0
                       writes this rank's Y of a chunk as the fp32 message, its hops add Y to the
                       received float32 values (gc_fz_enc_fp32 / gc_fz_dae_fp32), so the node sum
                       is of transformed values and the inter-node encode is the plain codec's
                       (fusing that encode itself would need every member's projections summed
                       in the node: not built)
=====================  ==========================================================================

The fused FP8 encode exists for e4m3 / e5m2, rounding to nearest, block <= 256; with any other
format, block or stochastic rounding, ring, direct, oneshot and doubling take the unfused route
of the same kernels' arithmetic (Y written by ``FusedPlan.apply``), so the device path has one
host model whatever the route.

Inverse: ring and direct gather the chunk messages without decoding them, then the fused inverse
decode reads the gathered wire twice (pass A over the decoded values, then decode + update +
``/ P`` for op="avg") into the result; the other rows (and the unfused formats) sum into a
float32 buffer (hierarchical: the node-local allgather's) and the inverse is ``FusedPlan.apply``
of it (with the division).

Host model: ``giftcomm.reference.simulate_gift_allreduce`` with
``giftcomm.geometry.fused_model.ModelGeometry(geometry)``, the transforms of the kernels' operation
order, equals this path bit for bit.

State: :class:`FusedGift` (the forward and inverse plans of one geometry, the wire tables of the
gathered layouts) is kept in the transport's state (``TransportState.fused``, a few geometries,
least recently used dropped, released with the transport); buffers are the transport's
workspaces. A repeated call allocates nothing on the device and never waits on it (the only
allocation is the result when no ``out`` is given).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from .. import _xp
from ..algorithms import BY_NAME
from ..algorithms.partition import shared_chunk_bounds
from ..formats import Format
from ..transport import Transport
from . import doubling, hierarchical, oneshot, ring
from .hierarchical import check_uniform
from .wire import Wire
from .workspace import workspace_of

__all__ = ["takes", "fused_encode", "FusedGift", "has_state", "state_of", "allreduce", "MAX_STATES"]

MAX_STATES = 4
"""Geometries whose device state a transport keeps (a training loop refreshes its geometry now
and then: the old one's state is dropped)."""


def takes(device: bool, geometry: Any) -> bool:
    """Whether gift_allreduce of a device array with ``geometry`` runs here: a giftcomm Geometry
    with low-rank or identity sides on every segment (giftcomm.geometry.fused_model.supports)."""
    if not device:
        return False
    from ..geometry import Geometry
    from ..geometry.fused_model import supports

    return isinstance(geometry, Geometry) and supports(geometry)


def fused_encode(algorithm: str, fmt: Format, block: int, seed: int | None) -> bool:
    """Whether the forward transform runs inside the encodes for this call (else Y is written):
    the row's ``fused`` route (giftcomm.algorithms) says where -- "nodes" inside the node-local
    fp32 ring (any format); the others inside the FP8 encodes (e4m3 / e5m2, rounding to nearest,
    block <= 256); a row without a route never."""
    from ..geometry.fused import FORMATS, MAX_BLOCK

    route = BY_NAME[algorithm].fused
    if route == "nodes":
        return True
    return route is not None and fmt.name in FORMATS and block <= MAX_BLOCK and seed is None


class FusedGift:
    """The device state of one geometry: ``fwd``, ``inv`` (giftcomm.geometry.fused.FusedPlan) and
    the wire tables of the gathered layouts (per chunk bounds, format, block and slice)."""

    def __init__(self, geometry: Any, xp: Any) -> None:
        from ..geometry.fused import FusedPlan

        self.fwd, self.inv = FusedPlan(geometry, xp), FusedPlan(geometry, xp, inverse=True)
        self.xp = xp
        self._tables: dict[tuple, Any] = {}

    def gathered_table(self, bounds: np.ndarray, fmt: Format, block: int, slice_n: int) -> Any:
        """The wire table of the ring allgather's buffer for chunks ``bounds``: every slice of
        every chunk, in rank order (made once per layout)."""
        key = (bounds.tobytes(), fmt.name, block, slice_n)
        table = self._tables.get(key)
        if table is None:
            from ..geometry.fused import wire_table

            lay = ring.layout_of(np.diff(bounds), fmt, block, slice_n)
            starts, offsets = [], []
            for c, sl in enumerate(lay.slices):
                for k in range(sl.nslices):
                    if sl.elems[k + 1] > sl.elems[k]:
                        starts.append(int(bounds[c]) + sl.elems[k])
                        offsets.append(int(lay.msg_offs[c]) + sl.bytes[k])
            if len(self._tables) >= 16:
                self._tables.clear()
            table = self._tables[key] = wire_table(self.xp, [*starts, int(bounds[-1])], offsets, fmt, block)
        return table


def _key(geometry: Any, xp: Any) -> tuple[int, str]:
    return int(geometry.fingerprint()), xp.__name__


def has_state(t: Transport, geometry: Any, xp: Any) -> bool:
    """Whether the transport keeps the state of ``geometry`` (every rank alike: the same agreed
    calls made and dropped it)."""
    return _key(geometry, xp) in t.state.fused


def state_of(t: Transport, geometry: Any, xp: Any) -> FusedGift:
    """The transport's :class:`FusedGift` of ``geometry`` on backend ``xp`` (made on first use)."""
    states: OrderedDict = t.state.fused
    key = _key(geometry, xp)
    st = states.get(key)
    if st is None:
        while len(states) >= MAX_STATES:
            states.popitem(last=False)
        st = states[key] = FusedGift(geometry, xp)
    else:
        states.move_to_end(key)
    return st


class FusedOwn(ring.Own):
    """This rank's transformed values Y for the reduce-scatters, computed inside the codec
    kernels from the float32 input ``x`` (after ``plan.project(x)``); ``scratch``: float32
    room for one slice of Y (direct's owner values)."""

    __slots__ = ("plan", "scratch")

    def __init__(self, plan: Any, x: Any, wire: Wire, scratch: Any) -> None:
        super().__init__(x, wire, np.dtype(np.float32))
        self.plan, self.scratch = plan, scratch

    def values(self, lo: int, hi: int) -> Any:
        return self.plan.values(self.x, lo, hi - lo, self.scratch[: hi - lo])

    def encode(self, lo: int, hi: int, out: Any) -> None:
        self.plan.encode(self.x, lo, hi - lo, self.wire.fmt, self.wire.block, out)

    def hop(self, recv: Any, lo: int, hi: int, out: Any, sum_out: Any = None) -> None:
        self.plan.decode_add_encode(self.x, lo, hi - lo, recv, self.wire.fmt, self.wire.block, out, y_out=sum_out)


def _float32(t: Transport, flat: Any, xp: Any) -> Any:
    """``flat`` as contiguous float32 (the transform reads float32, as giftcomm.geometry does):
    itself, or cast into a workspace buffer without flush-to-zero."""
    if flat.dtype == np.float32:
        return flat
    buf = workspace_of(t, xp).get("gift_x32", 4 * flat.size).view(np.float32)
    if flat.dtype == np.float64:
        from ..cuda.codec import convert

        return convert(flat, np.float32, out=buf)
    buf[...] = flat  # float16: exact in float32
    return buf


def allreduce(t: Transport, geometry: Any, algorithm: str, runner: Any, scatter_of: Any, flat: Any, wire: Wire,
              nodes: Any, slice_n: int, op: str, into: Any) -> Any:
    """The whole device gift_allreduce of the flat vector ``flat`` (n > 0): the float32 result,
    inverse-transformed and (op="avg") divided by P, in ``into`` (a float32 (n,) view of the
    caller's ``out``) when given, else a new array. ``runner``: the algorithm's engine runner
    (the unfused route's data movement); ``scatter_of(name)``: the reduce-scatter of a row
    (giftcomm.collectives.engine.scatter_of)."""
    xp, n = wire.xp, flat.size
    st = state_of(t, geometry, xp)
    ws = workspace_of(t, xp)
    x = _float32(t, flat, xp)
    dest = xp.empty(n, np.float32) if into is None else into
    divisor = float(t.size) if op == "avg" else None
    f32 = np.dtype(np.float32)
    if not fused_encode(algorithm, wire.fmt, wire.block, wire.seed):
        y = st.fwd.apply(x, ws.get("gift_y", 4 * n).view(np.float32))
        total = runner(t, y, wire, f32, nodes, slice_n, ws.get("gift_sum", 4 * n).view(np.float32))
        return st.inv.apply(_xp.astype(total, f32, copy=False), dest, divisor)
    st.fwd.project(x)  # pass A and S: the projections every fused encode reads
    row = BY_NAME[algorithm]
    if row.fused == "nodes":
        assert row.cross is not None
        local_n = int(np.diff(shared_chunk_bounds(n, check_uniform(nodes), wire.block)).max())
        scratch = ws.get("gift_own", 4 * local_n).view(np.float32)
        total = hierarchical.allreduce(t, x, nodes, wire, f32, slice_n,
                                       scatter=scatter_of(row.cross),
                                       local_own=lambda local_wire: FusedOwn(st.fwd, x, local_wire, scratch))
        return st.inv.apply(total, dest, divisor)
    if row.fused == "rounds":
        own = FusedOwn(st.fwd, x, wire, ws.get("gift_own", 0).view(np.float32))  # no owner values
        total = doubling.allreduce(t, x, wire, f32, out=ws.get("gift_sum", 4 * n).view(np.float32), own=own)
        return st.inv.apply(total, dest, divisor)
    if row.fused == "exchange":
        fmt, block = wire.fmt, wire.block
        got = oneshot.exchange(t, x, wire, encode=lambda msg: st.fwd.encode(x, 0, n, fmt, block, msg))
        total = oneshot.reduce([got.message(q) for q in range(t.size)], n, wire, f32,
                               out=ws.get("gift_sum", 4 * n).view(np.float32))
        return st.inv.apply(total, dest, divisor)
    bounds = shared_chunk_bounds(n, t.size, wire.block)
    counts = np.diff(bounds)
    lay = ring.layout_of(counts, wire.fmt, wire.block, slice_n)
    scratch = ws.get("gift_own", 4 * max(max(s.elems[k + 1] - s.elems[k] for k in range(s.nslices))
                                         for s in lay.slices)).view(np.float32)
    own = FusedOwn(st.fwd, x, wire, scratch)
    _, mine = scatter_of(algorithm)(t, x, bounds, wire, f32, slice_n, keep_sum=False,
                                  own_out=ring.gather_slot(t, wire, lay), own=own)
    gathered = ring.allgather(t, mine, counts, wire, slice_n, decode=False)
    table = st.gathered_table(bounds, wire.fmt, wire.block, slice_n)
    st.inv.project_wire(gathered, wire.fmt, wire.block, table)
    return st.inv.decode(gathered, wire.fmt, wire.block, dest, divisor, table)
