"""The algorithm table: one row per allreduce algorithm, the only place its facts are written.

A row holds the algorithm's name and fixed code (what travels in the agreed signature), whether
``algorithm="auto"`` may choose it, whether it is a reduce-scatter followed by the ring allgather
(so ``reduce_scatter`` can run its first half), whether it needs nodes of equal size, whether it
moves every rank's whole message in one exchange (a persistent plan then carries its check words
inside that exchange), its cost and error-growth formulas (docs/scaling.md writes them out),
which of a rank's own values it encodes alone (error feedback), the bytes each rank sends (the
stats), the row a hierarchical row runs across nodes and its route for the fused device
transform. Everything else reads the table and compares no algorithm names: the cost model's
``predict``/``error_growth``/``choose`` (giftcomm.cost.model), argument checking and the agreed
codes (giftcomm.collectives.call), error feedback (giftcomm.collectives.feedback), the stats
(giftcomm.accounting), the fused route (giftcomm.collectives.gift). The table sits on the
ground floor beside giftcomm.formats: it imports only formats, partition and machine.

Every row carries its data movement too (``runner``, ``scatter_runner``, ``simulation``,
``scatter_simulation``): a built-in row names its code in the floors above as a
``"module:function"`` reference (:meth:`Algorithm.part` imports it on first use, so this module
imports nothing above it), a row added with :func:`register` may carry the functions
themselves, so an experiment or a test adds an algorithm in one file
(tests/test_algorithm_row.py does).

Adding a built-in algorithm: its module under giftcomm/collectives/ (its runner, e.g. in
giftcomm.collectives.runners), its simulation in giftcomm.reference.simulate, and a row here
naming both (and docs/scaling.md).

The name lists (:data:`NAMES`, :data:`CHOICES`, :data:`SCATTER_CHOICES`) and :data:`TABLE`
are live views: a copy taken at import (``from giftcomm.algorithms import CHOICES``,
``giftcomm.api.ALGORITHMS``) sees the rows registered later.

One row is not giftcomm's own: ``native`` runs the transport's allreduce (MPI_Allreduce,
torch.distributed's all_reduce, ncclAllReduce) uncompressed (giftcomm.collectives.native).
``auto`` takes it only where it is predicted faster than every other row it may choose, and
never when the call says ``allow_native=False``.
"""
from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from ..formats import Format, bytes_per_value, message_nbytes
from .machine import Calibration, LinkCost, Topology, nic_share, overlapped
from .partition import shared_chunk_bounds

__all__ = ["Algorithm", "FUSED_ROUTES", "BUILT_IN", "register", "unregister", "TABLE", "NAMES", "CHOICES",
           "SCATTER_CHOICES", "AUTO", "AUTO_CODE", "BY_NAME", "BY_CODE", "CODES", "NATIVE", "row", "native_bytes"]

AUTO = "auto"
"""The ``algorithm=`` value that lets the cost model choose (giftcomm.cost.model.choose)."""
AUTO_CODE = 0

Time = Callable[[int, Topology, Format, int, Calibration], float]
Chunk = Callable[[int], tuple[int, int]]
Pieces = Callable[[int, int, int, Chunk], tuple[list[tuple[int, int]], int]]
Sent = Callable[[int, int, int, Format, int], int]

FUSED_ROUTES = ("scatter", "nodes", "rounds", "exchange")
"""How a row runs gift_allreduce's fused device transform (giftcomm.collectives.gift): "scatter"
(its reduce-scatter with the forward inside the encodes, then the ring allgather), "nodes" (the
forward inside the node-local fp32 ring, then ``cross`` across nodes), "rounds" (recursive
doubling's exchange rounds, the forward inside the first encode), "exchange" (one exchange of
every rank's whole vector, encoded once with the forward inside)."""


@dataclass(frozen=True)
class Algorithm:
    """One allreduce algorithm.

    name, code: how callers and the agreed signature name it (codes are fixed, never reused).
    auto: ``algorithm="auto"`` may choose it. scatter: it has a reduce-scatter that
    ``reduce_scatter(algorithm=name)`` runs (giftcomm's rows: a reduce-scatter then the ring
    allgather, and reduce_scatter runs the first half). needs_nodes: runs on nodes of
    equal size (``local_size`` or the transport's node layout). one_exchange: every rank's whole
    encoded vector travels in one exchange. time(n, topo, fmt, block, cal): predicted seconds of
    messages and codec for ``n`` float32 values of wire format ``fmt`` (a
    :class:`~giftcomm.formats.Format`, as every formula here takes it) and resolved ``block``
    (without the per-call overhead; ``inf`` where it cannot run). growth(topo): squared relative error in units of one quantization of one
    rank's values. quantizations(topo): how often a value is (re)quantized, at most. steps(p):
    sequential message steps on ``p`` ranks, each costing alpha + step_overhead (None: not a
    chain of such steps -- the hierarchical ones depend on the node layout, oneshot posts its
    messages at once; perf calibrate fits the per-step overheads on the other rows).
    channel_time: the prediction when a persistent plan's calls go through the node-shared
    channel (giftcomm.transport.channel), for rows whose data then moves differently (None: as
    ``time``). native: the transport's own collective, not giftcomm's wire (``auto`` takes it
    only where predicted faster than every other row, and only when the call allows it).
    own_pieces(n, p, rank, chunk): (pieces, stage) -- the element ranges [lo, hi) of its own
    (n,) values that ``rank`` encodes alone, unsummed, in a call over ``p`` ranks, and the wire
    stage they are keyed with (error feedback, giftcomm.collectives.feedback.own_pieces); ``chunk(c)`` is
    chunk c's [lo, hi) of the call's bounds. sent_bytes(n, p, rank, fmt, block): bytes of the
    messages ``rank`` sends on ``p`` > 1 ranks (giftcomm.accounting). cross: the row whose
    reduce-scatter a hierarchical row runs across nodes (None otherwise). fused: its route for
    gift_allreduce's fused device transform (:data:`FUSED_ROUTES`; None: none, the transform runs
    apart). runner, scatter_runner, simulation, scatter_simulation: its data movement -- the
    allreduce runner ``(t, flat, wire, acc_t, nodes, slice_n, out) -> total``, the reduce-scatter
    ``(t, flat, bounds, wire, acc_t, slice_n) -> (total, shard)`` (rows with ``scatter``), the
    reference simulations ``(flat, wire, local_size, local_fmt) -> sum`` and ``(flat, wire,
    layout) -> (sums, bounds)``: each a function or a ``"module:function"`` reference to it (the
    built-in rows: their code lives in the floors above), read through :meth:`part`; None where
    the row has none (the scatter pieces of a row without ``scatter``). jit_scatter: its
    reduce-scatter schedule inside ``jax.jit`` (giftcomm.adapters.jax.jit: ``(ring, chunks, lo,
    err, own_error) -> (this device's chunk sum, err)``; a function or a reference, read through
    :meth:`part`; None: the jit path does not run the row). chunk_messages(p): how many messages
    of one chunk (the jit path pads every chunk to the longest) each rank sends on ``p`` > 1
    ranks, for the rows the jit path runs (its byte count, giftcomm.adapters.jax.jit.wire_bytes; None otherwise).
    """

    name: str
    code: int
    auto: bool
    scatter: bool
    needs_nodes: bool
    one_exchange: bool
    time: Time
    growth: Callable[[Topology], float]
    quantizations: Callable[[Topology], int]
    steps: Callable[[int], int] | None
    own_pieces: Pieces
    sent_bytes: Sent
    channel_time: Time | None = None
    native: bool = False
    cross: str | None = None
    fused: str | None = None
    runner: Callable[..., Any] | str | None = None
    scatter_runner: Callable[..., Any] | str | None = None
    simulation: Callable[..., Any] | str | None = None
    scatter_simulation: Callable[..., Any] | str | None = None
    jit_scatter: Callable[..., Any] | str | None = None
    chunk_messages: Callable[[int], int] | None = None

    resolved: dict[str, Callable[..., Any]] = field(default_factory=dict, init=False, repr=False, compare=False)
    """The pieces :meth:`part` has resolved (a cache: read ``row.resolved.get(piece) or
    row.part(piece)`` on a hot path)."""

    def part(self, piece: str) -> Callable[..., Any]:
        """The row's ``piece`` ("runner", "scatter_runner", "simulation", "scatter_simulation",
        "jit_scatter") as a function: a ``"module:function"`` reference is imported on first use and kept.
        ValueError when the row has none."""
        got = self.resolved.get(piece)
        if got is None:
            ref = getattr(self, piece)
            if callable(ref):
                got = ref
            elif isinstance(ref, str) and ":" in ref:
                module, _, name = ref.partition(":")
                got = getattr(importlib.import_module(module), name)
            else:
                raise ValueError(f"algorithm {self.name!r} has no {piece}")
            self.resolved[piece] = got
        return got


T = TypeVar("T")


class Live(list[T]):  # a list: ``in`` and iteration stay C calls on the call path
    """A read-only view of one of the table's lists, updated in place by :func:`register` and
    :func:`unregister`: a copy of the view taken at import (``from giftcomm.algorithms import
    CHOICES``) sees the rows added later. Compares equal to a tuple or list of the same items."""

    def _set(self, items: Iterable[T]) -> None:
        list.clear(self)
        list.extend(self, items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (tuple, list)):
            return list.__eq__(self, list(other))
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("giftcomm.algorithms: the table's lists are read-only; use register() / unregister()")

    append = extend = insert = remove = pop = clear = sort = reverse = _read_only
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only


def _links(topo: Topology, cal: Calibration) -> tuple[LinkCost, LinkCost]:
    """(the link one stream uses, the link when every rank of a node sends across at once)."""
    link = cal.net if topo.nodes > 1 else cal.shm
    return link, LinkCost(link.alpha, link.beta * nic_share(cal, topo))


def _alltoall(topo: Topology, cal: Calibration) -> LinkCost:
    """The link of an all-to-all phase (every rank sends to P-1 peers at once): NICs shared, and
    across nodes only ``alltoall_efficiency`` of the link's bandwidth."""
    link, shared = _links(topo, cal)
    return shared if topo.nodes == 1 else LinkCost(shared.alpha, shared.beta / cal.alltoall_efficiency)


def _fused_rate(fmt: Format, cal: Calibration) -> float:
    """decode_add_encode values per second (raw formats: a plain add, ~4x faster)."""
    return cal.fused_rate if fmt.scaled else cal.fused_rate * 4


def _ring_steps(p: int) -> int:
    return 2 * (p - 1)


def _chunk_messages(p: int) -> int:
    """A reduce-scatter then the ring allgather: each of their steps sends one chunk message
    (ring: one per hop; direct: one to each other chunk's owner, then the allgather's hops)."""
    return _ring_steps(p)


def _ring_time(n: int, topo: Topology, fmt: Format, block: int, cal: Calibration) -> float:
    p, (link, _) = topo.ranks, _links(topo, cal)
    wire = 2 * (p - 1) / p * n * bytes_per_value(fmt, block) * link.beta
    codec = (p - 1) / p * n / _fused_rate(fmt, cal) + n / p / cal.encode_rate + n / cal.decode_rate
    return _ring_steps(p) * (link.alpha + cal.step_overhead) + overlapped(cal, wire, codec)


def _direct_time(n: int, topo: Topology, fmt: Format, block: int, cal: Calibration) -> float:
    """All-to-all reduce-scatter (NICs shared), then the ring allgather (one stream per node)."""
    p, (link, _), shared = topo.ranks, _links(topo, cal), _alltoall(topo, cal)
    wire = (p - 1) / p * n * bytes_per_value(fmt, block) * (shared.beta + link.beta)
    codec = n / cal.encode_rate + (p - 1) / p * n / cal.accumulate_rate + n / cal.decode_rate
    return _ring_steps(p) * (link.alpha + cal.step_overhead) + overlapped(cal, wire, codec)


def _largest_power_of_two(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def _doubling_steps(p: int) -> int:
    p2 = _largest_power_of_two(p)
    return p2.bit_length() - 1 + (2 if p2 != p else 0)


def _doubling_time(n: int, topo: Topology, fmt: Format, block: int, cal: Calibration) -> float:
    link, shared = _links(topo, cal)
    per_round = (link.alpha + cal.step_overhead + n * bytes_per_value(fmt, block) * shared.beta
                 + n / cal.encode_rate + 2 * n / cal.decode_rate)
    return _doubling_steps(topo.ranks) * per_round


def _oneshot_time(n: int, topo: Topology, fmt: Format, block: int, cal: Calibration) -> float:
    """One exchange: every rank posts its P-1 messages of the whole encoded vector at once, so
    one latency (alpha) and P-1 messages' software cost (step_overhead each); every rank sends
    at once (NICs shared); encode once, decode one message and accumulate P-1; not pipelined
    (wire + codec)."""
    p, (link, _), shared = topo.ranks, _links(topo, cal), _alltoall(topo, cal)
    wire = (p - 1) * n * bytes_per_value(fmt, block) * shared.beta
    codec = n / cal.encode_rate + n / cal.decode_rate + (p - 1) * n / cal.accumulate_rate
    return link.alpha + (p - 1) * cal.step_overhead + wire + codec


def _oneshot_channel_time(n: int, topo: Topology, fmt: Format, block: int, cal: Calibration) -> float:
    """Through a plan's node-shared channel: each rank encodes into its own slot, one handshake
    (a shared-memory latency, no message software), then decodes every other slot where it lies
    (P-1 messages' bytes read over the node's memory at the shm rate) and the codec work."""
    wire = (topo.ranks - 1) * n * bytes_per_value(fmt, block) * cal.shm.beta
    return cal.shm.alpha + wire + n / cal.encode_rate + n / cal.decode_rate + (topo.ranks - 1) * n / cal.accumulate_rate


def native_bytes(fmt: Format) -> int:
    """Bytes per value that ``algorithm="native"`` sums: a pass-through format's (bf16, fp16:
    2; fp32: 4), else 4 (the float32 values uncompressed; giftcomm.collectives.native)."""
    return 4 if fmt.scaled else fmt.itemsize


def _native_time(n: int, topo: Topology, fmt: Format, block: int, cal: Calibration) -> float:
    """The transport's own allreduce: ``native_alpha`` per call, and for the (P-1)/P share of
    the bytes each rank reduces, twice the link's time (its reduce-scatter and allgather halves)
    plus ``native_beta`` (its reduction and copies; ``native_half_beta`` for 16-bit values)."""
    p, (link, _) = topo.ranks, _links(topo, cal)
    b = native_bytes(fmt)
    return cal.native_alpha + (p - 1) / p * n * b * (2 * link.beta + (cal.native_beta if b == 4 else cal.native_half_beta))


def _hierarchical_time(inner: str) -> Time:
    def time(n: int, topo: Topology, fmt: Format, block: int, cal: Calibration) -> float:
        """fp32 ring reduce-scatter and allgather inside each node of L ranks; the ``inner``
        algorithm across the N nodes on 1/L of the buffer (the L cross-node rings of a node at
        once, sharing its NICs); ``inf`` without at least 2 nodes of at least 2 ranks."""
        if topo.nodes < 2 or topo.local_size < 2:
            return math.inf
        loc, nn = topo.local_size, topo.nodes
        local = 2 * ((loc - 1) * (cal.shm.alpha + cal.step_overhead) + (loc - 1) / loc * n * 4 * cal.shm.beta)
        cross_cal = replace(cal, net=LinkCost(cal.net.alpha, cal.net.beta * nic_share(cal, topo)), nics_per_node=0)
        return local + BY_NAME[inner].time(math.ceil(n / loc), Topology(nn, nn, 1), fmt, block, cross_cal)

    return time


def _ring_pieces(n: int, p: int, rank: int, chunk: Chunk) -> tuple[list[tuple[int, int]], int]:
    """Chunk ``rank - 1`` (hop 0; later hops carry partial sums)."""
    return [chunk((rank - 1) % p)], 0


def _direct_pieces(n: int, p: int, rank: int, chunk: Chunk) -> tuple[list[tuple[int, int]], int]:
    """Every chunk but its own (its owner sums that one in full precision); on one rank the lot."""
    return ([chunk(c) for c in range(p) if c != rank] if p > 1 else [(0, n)]), 0


def _doubling_pieces(n: int, p: int, rank: int, chunk: Chunk) -> tuple[list[tuple[int, int]], int]:
    """Everything when P is a power of two (round 0, stage 1) or the rank folds in (stage 0);
    nothing for a rank that first adds a folded rank's values."""
    p2 = _largest_power_of_two(p)
    if rank >= p2:
        return [(0, n)], 0
    return ([], 0) if rank + p2 < p else ([(0, n)], 1)


def _everything(n: int, p: int, rank: int, chunk: Chunk) -> tuple[list[tuple[int, int]], int]:
    """Its whole vector, encoded once."""
    return [(0, n)], 0


def _node_pieces(n: int, p: int, rank: int, chunk: Chunk) -> tuple[list[tuple[int, int]], int]:
    """Nothing (the node sums in fp32 before anything is encoded); on one rank the lot."""
    return ([(0, n)] if p == 1 else []), 0


def _nothing(n: int, p: int, rank: int, chunk: Chunk) -> tuple[list[tuple[int, int]], int]:
    """Nothing: the transport's own allreduce encodes nothing (with a 16-bit pass-through format
    its rounding is not compensated)."""
    return [], 0


def _ring_sent(n: int, p: int, rank: int, fmt: Format, block: int) -> int:
    """The reduce-scatter sends every chunk but the one this rank owns; the ring allgather every
    chunk but the next rank's (its own first, then what it received, up to that one). The
    hierarchical rows are counted so too (an estimate: they send float32 inside nodes and the
    compressed format across)."""
    b = shared_chunk_bounds(n, p, block)
    m = [message_nbytes(int(b[c + 1] - b[c]), fmt, block) for c in range(p)]
    return 2 * sum(m) - m[rank] - m[(rank + 1) % p]


def _doubling_sent(n: int, p: int, rank: int, fmt: Format, block: int) -> int:
    """Ranks >= P2 (the largest power of two <= P) fold their vector in, one message; the others
    exchange log2(P2) times, and send the result to their folded rank when they have one."""
    p2 = _largest_power_of_two(p)
    count = 1 if rank >= p2 else p2.bit_length() - 1 + (rank + p2 < p)
    return count * message_nbytes(n, fmt, block)


def _oneshot_sent(n: int, p: int, rank: int, fmt: Format, block: int) -> int:
    """P - 1 messages of the whole vector, each 8-byte aligned."""
    return (p - 1) * (-(-message_nbytes(n, fmt, block) // 8) * 8)


def _native_sent(n: int, p: int, rank: int, fmt: Format, block: int) -> int:
    """The transport's reduce-scatter and allgather halves of the values it sums."""
    return (2 * (p - 1) * n * native_bytes(fmt)) // p


def _nodes(topo: Topology) -> int:
    return topo.nodes if topo.nodes >= 1 else topo.ranks


# Error growth: each quantization of a partial sum of k contributions adds error variance ~ k
# (block scales follow the values) and the sum's variance is P, so the factor is (sum over
# quantizations of the partial sums' sizes) / P (checked against the simulation in
# perf/results/errors-study.md). P = 1 is 1 for every algorithm (giftcomm.cost.model.error_growth).
_TABLE: tuple[Algorithm, ...] = (
    # hops quantize sums of 1, 2, .., P-1 ranks, then the owner's sum once: (P + 1) / 2
    Algorithm("ring", 1, auto=True, scatter=True, needs_nodes=False, one_exchange=False, time=_ring_time,
              growth=lambda topo: (topo.ranks + 1) / 2, quantizations=lambda topo: topo.ranks, steps=_ring_steps,
              own_pieces=_ring_pieces, sent_bytes=_ring_sent, fused="scatter",
              runner="giftcomm.collectives.runners:run_ring", scatter_runner="giftcomm.collectives.ring:reduce_scatter",
              simulation="giftcomm.reference.simulate:allreduce_ring", scatter_simulation="giftcomm.reference.simulate:scatter_ring",
              jit_scatter="giftcomm.adapters.jax.jit:ring_scatter", chunk_messages=_chunk_messages),
    # P-1 single contributions, then the sum: 2 - 1/P
    Algorithm("direct", 2, auto=True, scatter=True, needs_nodes=False, one_exchange=False, time=_direct_time,
              growth=lambda topo: 2 - 1 / topo.ranks, quantizations=lambda topo: 2, steps=_ring_steps,
              own_pieces=_direct_pieces, sent_bytes=_ring_sent, fused="scatter",
              runner="giftcomm.collectives.runners:run_direct", scatter_runner="giftcomm.collectives.direct:reduce_scatter",
              simulation="giftcomm.reference.simulate:allreduce_direct", scatter_simulation="giftcomm.reference.simulate:scatter_direct",
              jit_scatter="giftcomm.adapters.jax.jit:direct_scatter", chunk_messages=_chunk_messages),
    # every level of the exchange tree quantizes groups whose sizes add up to P, log2(P2) levels
    # (P2: the largest power of two <= P), plus the folded ranks and the final message
    Algorithm("doubling", 3, auto=True, scatter=False, needs_nodes=False, one_exchange=False, time=_doubling_time,
              growth=lambda topo: (math.log2(_largest_power_of_two(topo.ranks)) + 1
                                   + (topo.ranks - _largest_power_of_two(topo.ranks)) / topo.ranks),
              quantizations=lambda topo: int(math.log2(_largest_power_of_two(topo.ranks))) + 2,
              steps=_doubling_steps, own_pieces=_doubling_pieces, sent_bytes=_doubling_sent, fused="rounds",
              runner="giftcomm.collectives.runners:run_doubling", simulation="giftcomm.reference.simulate:allreduce_doubling"),
    # fp32 inside nodes, the ring across N nodes: (N + 1) / 2
    Algorithm("hierarchical", 4, auto=True, scatter=False, needs_nodes=True, one_exchange=False,
              time=_hierarchical_time("ring"), growth=lambda topo: (_nodes(topo) + 1) / 2,
              quantizations=lambda topo: topo.nodes, steps=None, own_pieces=_node_pieces, sent_bytes=_ring_sent,
              cross="ring", fused="nodes",
              runner="giftcomm.collectives.runners:run_hierarchical", simulation="giftcomm.reference.simulate:allreduce_hierarchical"),
    # fp32 inside nodes, direct across N nodes: 2 - 1/N
    Algorithm("hierarchical_direct", 5, auto=True, scatter=False, needs_nodes=True, one_exchange=False,
              time=_hierarchical_time("direct"), growth=lambda topo: 2 - 1 / _nodes(topo),
              quantizations=lambda topo: 2, steps=None, own_pieces=_node_pieces, sent_bytes=_ring_sent,
              cross="direct", fused="nodes",
              runner="giftcomm.collectives.runners:run_hierarchical_direct",
              simulation="giftcomm.reference.simulate:allreduce_hierarchical_direct"),
    # every contribution quantized once, no sum re-quantized: P quantizations of one rank / P = 1
    Algorithm("oneshot", 6, auto=True, scatter=False, needs_nodes=False, one_exchange=True, time=_oneshot_time,
              growth=lambda topo: 1.0, quantizations=lambda topo: 1, steps=None,
              own_pieces=_everything, sent_bytes=_oneshot_sent, channel_time=_oneshot_channel_time, fused="exchange",
              runner="giftcomm.collectives.runners:run_oneshot", simulation="giftcomm.reference.simulate:allreduce_oneshot"),
    # the transport's own allreduce: nothing quantized (a scaled format sums float32 values); a
    # pass-through format rounds each rank's values once, and the transport rounds its partial
    # sums to that format (docs/scaling.md), counted as one quantization
    Algorithm("native", 7, auto=True, scatter=True, needs_nodes=False, one_exchange=False, time=_native_time,
              growth=lambda topo: 1.0, quantizations=lambda topo: 1, steps=None, own_pieces=_nothing,
              sent_bytes=_native_sent, native=True,
              runner="giftcomm.collectives.runners:run_native", scatter_runner="giftcomm.collectives.native:reduce_scatter",
              simulation="giftcomm.reference.simulate:allreduce_native", scatter_simulation="giftcomm.reference.simulate:scatter_native"),
)

TABLE: Live[Algorithm] = Live(_TABLE)
"""Every row, in table order (a live view: registered rows included)."""
NAMES: Live[str] = Live(a.name for a in _TABLE)
"""Every algorithm's name, in table order (``auto`` breaks ties in this order)."""
CHOICES: Live[str] = Live((AUTO, *NAMES))
"""What ``algorithm=`` of allreduce, gift_allreduce and plans accepts."""
SCATTER_CHOICES: Live[str] = Live((AUTO, *(a.name for a in _TABLE if a.scatter)))
"""What ``algorithm=`` of reduce_scatter accepts."""
BY_NAME: dict[str, Algorithm] = {a.name: a for a in _TABLE}
BY_CODE: dict[int, Algorithm] = {a.code: a for a in _TABLE}
assert len(BY_NAME) == len(BY_CODE) == len(_TABLE) and AUTO_CODE not in BY_CODE and AUTO not in BY_NAME


NATIVE = "native"
"""The row that runs the transport's own allreduce."""
assert BY_NAME[NATIVE].native and sum(a.native for a in TABLE) == 1
assert all(a.fused in (None, *FUSED_ROUTES) and (a.cross is None or BY_NAME[a.cross].scatter)
           and (a.jit_scatter is None) == (a.chunk_messages is None) for a in TABLE)

CODES: dict[str, int] = {AUTO: AUTO_CODE, **{a.name: a.code for a in _TABLE}}
"""The signature code of every ``algorithm=`` value."""


BUILT_IN: frozenset[str] = frozenset(NAMES)
"""The rows giftcomm ships (their data movement is code of the floors above, named by reference)."""


def register(algorithm: Algorithm) -> None:
    """Add a row to the table (an experiment, a test), in force for every entry point until
    :func:`unregister`: the collectives, plans, error feedback, the stats, the cost model (with
    ``auto=False`` ``auto`` never picks it) and the simulations read it from here. It brings its
    data movement (``runner``, ``simulation``; ``scatter_runner`` and ``scatter_simulation``
    with ``scatter``; functions or ``"module:function"`` references). ValueError for a name or
    code in use, or a missing piece. NAMES, CHOICES, SCATTER_CHOICES and TABLE (and every copy
    of them) show it at once."""
    global _TABLE
    a = algorithm
    if a.name in BY_NAME or a.name == AUTO or a.code in BY_CODE or a.code == AUTO_CODE:
        raise ValueError(f"register: the name {a.name!r} or code {a.code} is taken")
    missing = [f for f in ("runner", "simulation") + (("scatter_runner", "scatter_simulation") if a.scatter else ())
               if getattr(a, f) is None]
    if (a.jit_scatter is None) != (a.chunk_messages is None):
        missing.append("jit_scatter with chunk_messages")
    if missing or a.native or a.fused not in (None, *FUSED_ROUTES) or (a.cross is not None and not row(a.cross).scatter):
        raise ValueError(f"register: row {a.name!r} needs {', '.join(missing) or 'a valid fused route and cross'} "
                         "(and is not the native row)")
    _TABLE = (*_TABLE, a)
    _index()


def unregister(name: str) -> None:
    """Drop a row added with :func:`register` (ValueError for a built-in or unknown one)."""
    global _TABLE
    if name in BUILT_IN or name not in BY_NAME:
        raise ValueError(f"unregister: {name!r} is not a registered row")
    _TABLE = tuple(a for a in _TABLE if a.name != name)
    _index()


def _index() -> None:
    """Rebuild the lookups from the rows, in place (modules hold them)."""
    TABLE._set(_TABLE)
    NAMES._set(a.name for a in _TABLE)
    CHOICES._set((AUTO, *NAMES))
    SCATTER_CHOICES._set((AUTO, *(a.name for a in _TABLE if a.scatter)))
    BY_NAME.clear()
    BY_NAME.update((a.name, a) for a in _TABLE)
    BY_CODE.clear()
    BY_CODE.update((a.code, a) for a in _TABLE)
    CODES.clear()
    CODES.update({AUTO: AUTO_CODE, **{a.name: a.code for a in _TABLE}})


def row(name: str) -> Algorithm:
    """The row named ``name``; ValueError listing the names otherwise."""
    try:
        return BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(NAMES)}") from None
