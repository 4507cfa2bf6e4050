"""gift_allreduce with a geometry: both routes, ``inverse(sum(forward(x)))``.

The engine (giftcomm.collectives.engine) hands every agreed allreduce job with a geometry to
:func:`allreduce` (and checks the geometry in its agreement with :func:`prepare`). Two routes:

- **unfused** (host arrays, and device arrays with any other geometry): ``geometry.forward`` of
  the flat values into float32 (a failure on some rank raised on every rank), the agreed row's
  runner (giftcomm.collectives.runners) on them, ``geometry.inverse`` of the sum, then the
  plain finishing step (``avg``, dtype, ``out``);
- **fused** (:func:`takes`: a device (CuPy) array and a giftcomm Geometry whose non-identity
  segments all have low-rank or identity sides): the transform inside the codec kernels
  (giftcomm.geometry.fused; design: docs/gpu.md "Fused transform"), as below.

Everything here is decided by agreed values only (format, block, rounding, algorithm, the
geometry's fingerprint, which carries the route), so every rank takes the same route.

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
from typing import Any, Protocol

import numpy as np

from .. import _xp
from ..algorithms import BY_NAME
from ..algorithms.partition import accumulation_dtype, shared_chunk_bounds
from ..formats import Format
from ..transport import Transport
from . import call as calls
from . import doubling, hierarchical, oneshot, ring
from .agree import confirmed
from .call import Call, Job
from .hierarchical import check_uniform
from .runners import runner_of, scatter_of
from .wire import Wire
from .workspace import workspace_of

__all__ = ["GeometryLike", "prepare", "allreduce", "takes", "fused_encode", "FusedGift", "has_state", "state_of",
           "MAX_STATES"]


class GeometryLike(Protocol):
    """What gift_allreduce needs of a geometry (see giftcomm.geometry.Geometry)."""

    @property
    def size(self) -> int: ...  # read-only: Geometry's are properties
    @property
    def is_identity(self) -> bool: ...

    def forward(self, flat: Any) -> Any: ...
    def inverse(self, flat: Any) -> Any: ...
    def fingerprint(self) -> int: ...


def _word_geometry(word: str) -> str:
    """The error for a geometry given as a word (e.g. "paper") to a flat-buffer call."""
    return (f"giftcomm.gift_allreduce: geometry={word!r} names a method, not a map: a flat buffer has no layer "
            f"structure (layout) nor input covariances to build it from. Build the geometry and pass it, e.g. "
            f"geometry=Geometry.preset({word!r}, layout, factors) (giftcomm.geometry), or use an entry point that "
            f"captures them from the model (GradSync, ShardedGradSync, GiftState, GiftReduceScatter, the Lightning "
            f"callback: geometry={word!r})")


def prepare(call: Call, geometry: Any) -> Any:
    """This rank's check of gift_allreduce's ``geometry`` inside the agreement (its errors are
    raised on every rank): the geometry the job runs (None for none or an identity one), its
    fingerprint and route in ``call.sig["geometry"]``. ValueError for a word (``"paper"``) and for
    a geometry that does not cover the call's elements."""
    if isinstance(geometry, str):
        raise ValueError(_word_geometry(geometry))
    geo = None if geometry is None or geometry.is_identity else geometry
    if geo is not None:
        if geo.size != call.arr.size:
            raise ValueError(f"geometry covers {geo.size} elements but x has {call.arr.size}")
        # the route is part of what the ranks agree on: a rank with a host array (unfused transform)
        # and one with a device array (the fused kernels) would round differently
        call.sig["geometry"] = int(geo.fingerprint()) ^ int(takes(call.imp.device, geo))
    return geo


def allreduce(t: Transport, job: Job, call: Call, out: Any) -> Any:
    """Steps 2 and 3 of an agreed gift_allreduce whose job has a geometry (collective): the
    fused route where :func:`takes` says so, else the unfused one; finished like
    :func:`giftcomm.allreduce` (``avg``, the caller's dtype and shape, ``out`` or a new array).
    ``call``: the call's record (the job's own, or a persistent plan's call)."""
    geo, algorithm = job.geometry, job.algorithm
    assert geo is not None and algorithm is not None
    xp, n, shape = call.xp, call.arr.size, tuple(call.arr.shape)
    flat = calls.flat_values(call)
    if takes(call.imp.device, geo):
        return _fused(t, job, call, flat, out)
    with confirmed(t, "giftcomm.gift_allreduce: geometry.forward"):  # it can fail on some ranks: all learn it
        flat = _checked(_geometry_forward(t, geo, flat, xp), n, "geometry.forward")
    acc_t = accumulation_dtype(flat.dtype)
    if n == 0:
        return calls.finish(xp.zeros(0, acc_t), call, t.size, shape, out)
    into = calls.direct_out(call)
    total = runner_of(algorithm)(t, flat, call.wire(t.rank), acc_t, job.nodes, job.slice_n, into)
    total = _geometry_inverse(geo, total, xp)
    if into is None or total is not into:
        total = _xp.astype(total, acc_t, copy=False)  # on the device: no flush-to-zero (giftcomm._xp)
    return calls.finish_reduction(t.size, call, total, into, out, shape)


def _is_giftcomm_geometry(geo: Any) -> bool:
    from ..geometry import Geometry  # lazy: the geometry package is optional for plain allreduce

    return isinstance(geo, Geometry)


def _geometry_forward(t: Transport, geo: Any, flat: Any, xp: Any) -> Any:
    """``geo.forward(flat)`` as float32 of ``flat``'s backend; a giftcomm Geometry writes into a
    workspace buffer that is reused across calls (a fresh one costs page faults comparable to the
    transform itself)."""
    if _is_giftcomm_geometry(geo):
        buf = workspace_of(t, xp).get("gift_forward", 4 * flat.size).view(np.float32)
        return geo.forward(flat, out=buf)
    return xp.ascontiguousarray(xp.asarray(geo.forward(flat), dtype=np.float32))


def _checked(values: Any, n: int, what: str) -> Any:
    """``values`` when it is a float32 (n,) array, else ValueError naming ``what``."""
    if tuple(values.shape) != (n,) or values.dtype != np.float32:
        raise ValueError(f"{what} returned shape {tuple(values.shape)} dtype {values.dtype}; expected ({n},) float32")
    return values


def _geometry_inverse(geo: Any, total: Any, xp: Any) -> Any:
    """``geo.inverse(total)``; in place for a giftcomm Geometry (``total`` belongs to this call:
    the caller's ``out`` or a fresh result)."""
    if _is_giftcomm_geometry(geo):
        return geo.inverse(total, out=total)
    return _checked(xp.ascontiguousarray(xp.asarray(geo.inverse(total), dtype=np.float32)), total.size,
                    "geometry.inverse")


# ----------------------------------------------------------------------------- the fused route


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


def _fused(t: Transport, job: Job, call: Call, flat: Any, out: Any) -> Any:
    """The fused route of :func:`allreduce` (the inverse and ``avg`` done in the kernels)."""
    shape = tuple(call.arr.shape)
    if flat.size == 0:
        return calls.finish(call.xp.zeros(0, np.float32), call, t.size, shape, out)
    into = calls.direct_out(call)
    if not has_state(t, job.geometry, call.xp):  # alike on every rank: the same agreed calls made it
        # a failure on some ranks (the plans' upload: device memory) is raised on every rank
        with confirmed(t, "giftcomm.gift_allreduce: fused transform"):
            state_of(t, job.geometry, call.xp)
    total = _fused_sum(t, job, flat, call.wire(t.rank), call.op, into)
    if into is not None and total is into:
        return out
    return calls.finish(total, call, t.size, shape, out, op="sum")


def _fused_sum(t: Transport, job: Job, flat: Any, wire: Wire, op: str, into: Any) -> Any:
    """The fused route's float32 result of the flat vector ``flat`` (n > 0) with the job's
    geometry, algorithm, node layout and slice: inverse-transformed and (op="avg") divided by P,
    in ``into`` (a float32 (n,) view of the caller's ``out``) when given, else a new array."""
    geometry, row, nodes, slice_n = job.geometry, job.algorithm, job.nodes, job.slice_n
    assert row is not None
    algorithm = row.name
    xp, n = wire.xp, flat.size
    st = state_of(t, geometry, xp)
    ws = workspace_of(t, xp)
    x = _float32(t, flat, xp)
    dest = xp.empty(n, np.float32) if into is None else into
    divisor = float(t.size) if op == "avg" else None
    f32 = np.dtype(np.float32)
    if not fused_encode(algorithm, wire.fmt, wire.block, wire.seed):
        y = st.fwd.apply(x, ws.get("gift_y", 4 * n).view(np.float32))
        total = runner_of(row)(t, y, wire, f32, nodes, slice_n, ws.get("gift_sum", 4 * n).view(np.float32))
        return st.inv.apply(_xp.astype(total, f32, copy=False), dest, divisor)
    st.fwd.project(x)  # pass A and S: the projections every fused encode reads
    if row.fused == "nodes":
        assert row.cross is not None and nodes is not None
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
