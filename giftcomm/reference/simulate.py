"""Single-process simulations of the collectives: every rank's inputs in, every rank's outputs out.

Written as plain loops over the algorithm's steps, independent of the distributed code, so that
the distributed result can be checked against them bit for bit (DESIGN invariant 2). With
``rounding="stochastic"`` every encode draws its bits as the algorithm's does
(giftcomm.reference.rounding: the call's seed, the encoding party and stage, the element's index
in the buffer).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .. import algorithms
from ..algorithms import AUTO, BY_NAME
from ..algorithms.partition import accumulation_dtype, chunk_bounds, shard_bounds
from ..cost.model import Topology, auto_algorithm
from ..formats import Format, check_rounding, get_format, resolve_block
from .baselines import BASELINE_WIRES, simulate_baseline_allreduce
from .codec import decode, encode
from .rounding import call_key

__all__ = ["simulate_allreduce", "simulate_gift_allreduce", "simulate_reduce_scatter", "simulate_allgather",
           "resolve_algorithm"]


@dataclass(frozen=True)
class _Wire:
    """The simulated wire: format, block and the call's stochastic-rounding seed (None: nearest)."""

    fmt: Format
    block: int
    seed: int | None = None

    @classmethod
    def of(cls, f: Format, block: int | None, rounding: str = "nearest", seed: int | None = None) -> "_Wire":
        check_rounding(rounding, f)
        if rounding == "stochastic" and seed is None:
            raise ValueError("stochastic rounding needs seed= (an int identifying the call)")
        return cls(f, resolve_block(f, block), seed if rounding == "stochastic" and f.scaled else None)

    def passthrough(self, fmt: Format) -> "_Wire":
        return _Wire(fmt, self.block, None)

    def encode(self, v: np.ndarray, party: int, offset: int, stage: int = 0) -> np.ndarray:
        if self.seed is None:
            return encode(v.astype(np.float32), self.fmt, self.block)
        return encode(v.astype(np.float32), self.fmt, self.block, rounding="stochastic",
                      key=call_key(self.seed, party, stage), offset=int(offset))

    def decode(self, msg: np.ndarray, n: int) -> np.ndarray:
        return decode(msg, n, self.fmt, self.block)

    def q(self, v: np.ndarray, party: int, offset: int, stage: int = 0) -> np.ndarray:
        """encode then decode (float32)."""
        return self.decode(self.encode(v, party, offset, stage), v.size)


def _flat_inputs(inputs: Sequence[np.ndarray]) -> tuple[list[np.ndarray], np.dtype, tuple]:
    if len(inputs) < 1:
        raise ValueError("need at least one rank's input")
    arrays = [np.asarray(x) for x in inputs]
    shape, dtype = arrays[0].shape, arrays[0].dtype
    for a in arrays:
        if a.size != arrays[0].size or a.dtype != dtype:
            raise ValueError("all ranks' inputs must have the same element count and dtype")
    return [a.reshape(-1) for a in arrays], dtype, shape


def _chunk_sums(flat: list[np.ndarray], w: _Wire, direct: bool = False, parties: Sequence[int] | None = None,
                base: int = 0, layout: str = "blocks") -> tuple[list[np.ndarray], np.ndarray]:
    """The owner's high-precision sum of each chunk after the ring (or ``direct``) reduce-scatter,
    and the chunk bounds. Ring: chunk c starts at rank c+1 and travels right, re-encoded at every
    hop; rank c adds last. Direct: the contributions in rank order, each other rank's quantized
    once, the owner's own exact. ``parties``: the ranks of the members (default 0..P-1);
    ``base``: the index of flat[q][0] in the buffer; ``layout``: the chunks' layout
    (giftcomm.algorithms.partition.shard_bounds; each chunk's messages count their blocks from its start)."""
    p = len(flat)
    parties = list(range(p)) if parties is None else list(parties)
    acc_t = accumulation_dtype(flat[0].dtype)
    bounds = shard_bounds(flat[0].size, p, w.block, layout)
    sums = []
    with np.errstate(invalid="ignore", over="ignore"):
        for c in range(p):
            lo, hi = bounds[c], bounds[c + 1]
            part = [x[lo:hi].astype(acc_t) for x in flat]
            if direct or p == 1:
                acc = part[0] if c == 0 else w.q(part[0], parties[0], base + lo).astype(acc_t)
                for src in range(1, p):
                    acc = acc + (part[src] if src == c else w.q(part[src], parties[src], base + lo).astype(acc_t))
            else:
                msg = w.encode(part[(c + 1) % p], parties[(c + 1) % p], base + lo)
                for k in range(2, p + 1):
                    acc = w.decode(msg, hi - lo).astype(acc_t) + part[(c + k) % p]
                    if k < p:
                        msg = w.encode(acc, parties[(c + k) % p], base + lo)
            sums.append(acc)
    return sums, bounds


def _gathered(sums: list[np.ndarray], bounds: np.ndarray, w: _Wire, acc_t: np.dtype,
              parties: Sequence[int] | None = None, base: int = 0) -> np.ndarray:
    """Each owner encodes its sum once; everybody decodes: the allgather's result."""
    parties = list(range(len(sums))) if parties is None else list(parties)
    result = np.empty(int(bounds[-1]), acc_t)
    for c, s in enumerate(sums):
        result[bounds[c] : bounds[c + 1]] = w.q(s, parties[c], base + bounds[c])
    return result


def _doubling_sum(flat: list[np.ndarray], w: _Wire) -> np.ndarray:
    """Recursive doubling (see giftcomm/collectives/doubling.py), rank by rank: round i's messages
    keyed by the group ``rank >> i``, stage 1 + i; a folded rank's by its rank, stage 0."""
    p = len(flat)
    acc_t = accumulation_dtype(flat[0].dtype)
    p2 = 1 << (p.bit_length() - 1)
    rounds = p2.bit_length() - 1
    with np.errstate(invalid="ignore", over="ignore"):
        acc = [flat[r].astype(acc_t) for r in range(p2)]
        for r in range(p - p2):
            acc[r] = acc[r] + w.q(flat[r + p2].astype(acc_t), r + p2, 0, 0).astype(acc_t)
        for i in range(rounds):
            dist = 1 << i
            acc = [w.q(acc[min(r, r ^ dist)], min(r, r ^ dist) >> i, 0, 1 + i).astype(acc_t)
                   + w.q(acc[max(r, r ^ dist)], max(r, r ^ dist) >> i, 0, 1 + i).astype(acc_t) for r in range(p2)]
    return w.q(acc[0], 0, 0, 1 + rounds).astype(acc_t)


def _hierarchical_sum(flat: list[np.ndarray], w: _Wire, local_size: int, local_fmt: Format, direct: bool) -> np.ndarray:
    """Node-local pass-through ring reduce-scatter, FP8 ring (``direct``: direct) reduce-scatter
    and allgather across nodes, node-local allgather."""
    p = len(flat)
    if local_size < 1 or p % local_size:
        raise ValueError(f"local_size={local_size} must divide the number of ranks ({p})")
    acc_t = accumulation_dtype(flat[0].dtype)
    nodes = [flat[j : j + local_size] for j in range(0, p, local_size)]
    local_bounds = chunk_bounds(flat[0].size, local_size, w.block)
    local = w.passthrough(local_fmt)
    node_sums = [_chunk_sums(members, local)[0] for members in nodes]
    result = np.empty(flat[0].size, acc_t)
    for lr in range(local_size):
        parties = [j + lr for j in range(0, p, local_size)]  # the ranks of cross group lr
        base = int(local_bounds[lr])
        sums, bounds = _chunk_sums([ns[lr] for ns in node_sums], w, direct, parties, base)
        chunk = _gathered(sums, bounds, w, acc_t, parties, base)
        # the node-local allgather carries these float32 values exactly (fp32 pass-through)
        result[local_bounds[lr] : local_bounds[lr + 1]] = chunk.astype(np.float32)
    return result


def _finish(values: np.ndarray, op: str, p: int, dtype: np.dtype) -> np.ndarray:
    if op == "avg":
        values = values / values.dtype.type(p)
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(dtype)


def simulate_gift_allreduce(
    inputs: Sequence[np.ndarray], geometry, fmt: str = "e4m3", block: int | None = None, op: str = "sum",
    algorithm: str = "auto", local_size: int | None = None, *, rounding: str = "nearest", seed: int | None = None,
) -> list[np.ndarray]:
    """Every rank's gift_allreduce output: forward on each rank (float32), the allreduce
    simulation of the transformed vectors, inverse of the sum, then ``/ P`` for avg.

    ``geometry``: anything with size, is_identity, forward(flat) and inverse(flat)
    (giftcomm.geometry.Geometry). None or an identity geometry simulates plain allreduce.
    """
    if geometry is None or geometry.is_identity:
        return simulate_allreduce(inputs, fmt, block, op, algorithm, local_size, rounding=rounding, seed=seed)
    flat, dtype, shape = _flat_inputs(inputs)
    p = len(flat)
    transformed = [np.asarray(geometry.forward(x), dtype=np.float32) for x in flat]
    summed = simulate_allreduce(transformed, fmt, block, "sum", algorithm, local_size, rounding=rounding, seed=seed)[0]
    back = np.asarray(geometry.inverse(summed), dtype=np.float32)
    out = _finish(back, op, p, dtype).reshape(shape)
    return [out.copy() for _ in range(p)]


def _oneshot_sum(flat: list[np.ndarray], w: _Wire) -> np.ndarray:
    """Every rank's vector encoded once and decoded, summed in rank order (the first assigned)."""
    acc_t = accumulation_dtype(flat[0].dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        parts = [w.q(x, r, 0).astype(acc_t) for r, x in enumerate(flat)]
        total = parts[0].copy()
        for part in parts[1:]:
            total += part
    return total


_NATIVE_KINDS = {"fp32": np.float32, "fp16": np.float16}


def _native_sum(flat: list[np.ndarray], w: _Wire) -> np.ndarray:
    """The transport's own allreduce as giftcomm defines it (giftcomm.collectives.native): each
    rank's values in the native type (a pass-through format's, rounded to nearest even; else the
    accumulation dtype), added in MPICH's recursive-doubling order -- ranks 2i and 2i+1 first
    for i < P - P2 (P2: the largest power of two <= P), then the P2 partial sums in adjacent
    pairs, level by level -- a 16-bit partial sum computed in float32 and rounded to its type."""
    acc_t = accumulation_dtype(flat[0].dtype)
    if w.fmt.scaled:
        kind: np.dtype = np.dtype(acc_t)
    else:
        kind = np.dtype(ml_dtypes.bfloat16) if w.fmt.name == "bf16" else np.dtype(_NATIVE_KINDS[w.fmt.name])
    with np.errstate(invalid="ignore", over="ignore"):
        parts = [x.astype(np.float32).astype(kind) if kind.itemsize == 2 else x.astype(kind) for x in flat]
        wide = kind.itemsize == 2

        def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            return (a.astype(np.float32) + b.astype(np.float32)).astype(kind) if wide else a + b

        p = len(parts)
        p2 = 1 << (p.bit_length() - 1)
        level = [add(parts[2 * i], parts[2 * i + 1]) for i in range(p - p2)] + parts[2 * (p - p2):]
        while len(level) > 1:
            level = [add(level[2 * j], level[2 * j + 1]) for j in range(len(level) // 2)]
        return level[0].astype(acc_t)


def simulate_reduce_scatter(
    inputs: Sequence[np.ndarray], fmt: str = "e4m3", block: int | None = None, op: str = "sum", algorithm: str = "ring",
    *, rounding: str = "nearest", seed: int | None = None, layout: str = "blocks", allow_native: bool = True,
) -> list[np.ndarray]:
    """Every rank's reduce_scatter shard (1-D, input dtype), from every rank's input.

    algorithm: a row of the algorithm table with ``scatter`` ("ring" or "direct": the
    reduce-scatter halves of those allreduces; "native"), or "auto" (the live call's choice,
    :func:`resolve_algorithm` with ``kind="reduce_scatter"``; allow_native: its option). layout: "blocks" or "equal", as for
    giftcomm.reduce_scatter.
    """
    w = _Wire.of(get_format(fmt), block, rounding, seed)
    flat, dtype, _ = _flat_inputs(inputs)
    if algorithm == AUTO:  # the live call's choice (allow_native: its option)
        algorithm = resolve_algorithm(AUTO, flat[0].size, len(flat), None, w.fmt, w.block, allow_native,
                                      kind="reduce_scatter")
    if algorithm not in algorithms.SCATTER_CHOICES[1:]:
        raise ValueError(f"reduce_scatter algorithm must be one of {', '.join(algorithms.SCATTER_CHOICES[1:])}, "
                         f"got {algorithm!r}")
    sums, _ = BY_NAME[algorithm].part("scatter_simulation")(flat, w, layout)
    return [_finish(s, op, len(flat), dtype) for s in sums]


def resolve_algorithm(algorithm: str, n: int, p: int, local_size: int | None, fmt: str | Format,
                      block: int | None = None, allow_native: bool = True, *, kind: str = "allreduce") -> str:
    """The algorithm a call with these arguments runs ("auto" resolved; another name as given):
    giftcomm.cost.model.auto_algorithm, the one decision every live call makes, on every transport
    (MPI with or without its shared-memory paths, torch.distributed, NCCL) and whether or not the
    call's plan is cached.

    n: values in the buffer. p: ranks. local_size: ranks per node (None: all ``p`` on one node,
    the layout of a single host; pass the transport's own on several nodes). fmt, block: the
    wire format (a Format or its name) and block (None: the format's own). allow_native: the call's option. kind:
    "allreduce" (also gift_allreduce and giftcomm.plan_allreduce) or "reduce_scatter" (chooses
    among its rows). The live call's choice is reported by
    ``giftcomm.collectives.engine.last_algorithm(transport)``."""
    allowed = algorithms.CHOICES if kind == "allreduce" else algorithms.SCATTER_CHOICES
    if kind not in ("allreduce", "reduce_scatter"):
        raise ValueError(f"kind must be 'allreduce' or 'reduce_scatter', got {kind!r}")
    if algorithm not in allowed:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {', '.join(allowed)}")
    if algorithm != AUTO:
        return algorithm
    k = local_size or p
    return auto_algorithm(n, Topology(p, p // k, k), get_format(fmt), resolve_block(fmt, block),
                          allow_native=allow_native, scatter=kind == "reduce_scatter")


def simulate_allreduce(
    inputs: Sequence[np.ndarray], fmt: str = "e4m3", block: int | None = None, op: str = "sum",
    algorithm: str = "auto", local_size: int | None = None, local_fmt: str = "fp32", *,
    rounding: str = "nearest", seed: int | None = None, allow_native: bool = True,
) -> list[np.ndarray]:
    """Every rank's allreduce output (input shape and dtype), from every rank's input.

    algorithm:
    - "ring": ring reduce-scatter with in-ring requantization, then the owner of each chunk
      encodes its sum once and every rank decodes those same bytes;
    - "direct": each contribution quantized once and summed by the chunk's owner in rank order,
      then the same allgather;
    - "doubling": recursive doubling (small messages);
    - "oneshot": every rank's vector quantized once, sent to every rank, summed by each in rank
      order (small messages);
    - "native": the transport's own allreduce, uncompressed (a pass-through format's values, else
      the accumulation dtype), added in MPICH's recursive-doubling order (:func:`_native_sum`);
    - "hierarchical" / "hierarchical_direct": nodes of ``local_size`` consecutive ranks;
      pass-through (``local_fmt``) ring reduce-scatter inside each node, ring / direct FP8
      allreduce of each node chunk across nodes, exact fp32 allgather inside each node;
    - "auto" (the default, as in giftcomm.allreduce): the cost model's choice for this size,
      rank count and node layout (:func:`resolve_algorithm`: what the live call runs).
    block: None gives the format's own block (giftcomm.formats.resolve_block). rounding, seed: as
    for giftcomm.allreduce.

    fmt may also name a baseline wire (giftcomm.reference.baselines.BASELINE_WIRES:
    "e5m2/tensor-nccl", "e5m2/tensor-local", "e4m3/tensor-nccl", "e4m3/tensor-local"): one scale
    per tensor and NCCL's FP8 ring sum; then algorithm must be "auto" or "ring", block None and
    rounding "nearest", and the "-local" wires give different outputs per rank.
    """
    if isinstance(fmt, str) and fmt in BASELINE_WIRES:
        if algorithm not in (AUTO, "ring") or block is not None or rounding != "nearest" or local_size is not None:
            raise ValueError(f"baseline wire {fmt!r} has its own ring order, one scale per tensor and rounding to "
                             "nearest: algorithm 'auto'/'ring', block None, rounding 'nearest', no local_size")
        return simulate_baseline_allreduce(inputs, fmt, op)
    w = _Wire.of(get_format(fmt), block, rounding, seed)
    local = get_format(local_fmt)
    flat, dtype, shape = _flat_inputs(inputs)
    p = len(flat)
    algorithm = resolve_algorithm(algorithm, flat[0].size, p, local_size, w.fmt, w.block, allow_native)
    acc_t = accumulation_dtype(dtype)
    if flat[0].size == 0:
        result = np.zeros(0, acc_t)
    else:
        result = BY_NAME[algorithm].part("simulation")(flat, w, local_size or p, local)
    out = _finish(result.astype(acc_t, copy=False), op, p, dtype).reshape(shape)
    return [out.copy() for _ in range(p)]


def simulate_allgather(shards: Sequence[np.ndarray], fmt: str = "e4m3", block: int | None = None, *,
                       rounding: str = "nearest", seed: int | None = None) -> list[np.ndarray]:
    """Every rank's allgather output: the concatenation of every shard, each encoded once by its
    owner (stochastic rounding: keyed by the owner, counted from the shard's place in the result)."""
    w = _Wire.of(get_format(fmt), block, rounding, seed)
    arrays = [np.asarray(s).reshape(-1) for s in shards]
    dtype = arrays[0].dtype
    starts = np.concatenate([[0], np.cumsum([a.size for a in arrays])])
    pieces = [w.q(a, r, int(starts[r])) for r, a in enumerate(arrays)]
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.concatenate(pieces).astype(dtype)
    return [out.copy() for _ in arrays]


Simulation = Callable[[list[np.ndarray], _Wire, int, Format], np.ndarray]
"""simulation(every rank's flat input, wire, local_size, local_fmt) -> the allreduce's sum
(the accumulation dtype, before ``avg``)."""

def scatter_ring(flat: list[np.ndarray], w: _Wire, layout: str = "blocks") -> tuple[list[np.ndarray], np.ndarray]:
    """The ``ring`` row's reduce-scatter: each owner's chunk sum (requantized along the ring)
    and the chunk bounds."""
    return _chunk_sums(flat, w, layout=layout)


def scatter_direct(flat: list[np.ndarray], w: _Wire, layout: str = "blocks") -> tuple[list[np.ndarray], np.ndarray]:
    """The ``direct`` row's reduce-scatter: each contribution quantized once, summed by the owner."""
    return _chunk_sums(flat, w, direct=True, layout=layout)


def scatter_native(flat: list[np.ndarray], w: _Wire, layout: str = "blocks") -> tuple[list[np.ndarray], np.ndarray]:
    """The ``native`` row's reduce-scatter: every rank's shard of the native allreduce (its
    reduce-scatter is the whole allreduce)."""
    total = _native_sum(flat, w)
    bounds = shard_bounds(flat[0].size, len(flat), w.block, layout)
    return [total[bounds[c] : bounds[c + 1]] for c in range(len(flat))], bounds


def _scatter_gather(name: str) -> Simulation:
    def sim(flat: list[np.ndarray], w: _Wire, local_size: int, local_fmt: Format) -> np.ndarray:
        sums, bounds = BY_NAME[name].part("scatter_simulation")(flat, w)
        return _gathered(sums, bounds, w, accumulation_dtype(flat[0].dtype))

    return sim


allreduce_ring = _scatter_gather("ring")
"""The ``ring`` row's simulation (the rows name their simulations: giftcomm.algorithms)."""
allreduce_direct = _scatter_gather("direct")
"""The ``direct`` row's simulation."""


def allreduce_doubling(flat: list[np.ndarray], w: _Wire, local_size: int, local_fmt: Format) -> np.ndarray:
    """The ``doubling`` row's simulation."""
    return _doubling_sum(flat, w)


def allreduce_hierarchical(flat: list[np.ndarray], w: _Wire, local_size: int, local_fmt: Format) -> np.ndarray:
    """The ``hierarchical`` row's simulation (ring across nodes)."""
    return _hierarchical_sum(flat, w, local_size, local_fmt, False)


def allreduce_hierarchical_direct(flat: list[np.ndarray], w: _Wire, local_size: int, local_fmt: Format) -> np.ndarray:
    """The ``hierarchical_direct`` row's simulation (direct across nodes)."""
    return _hierarchical_sum(flat, w, local_size, local_fmt, True)


def allreduce_oneshot(flat: list[np.ndarray], w: _Wire, local_size: int, local_fmt: Format) -> np.ndarray:
    """The ``oneshot`` row's simulation."""
    return _oneshot_sum(flat, w)


def allreduce_native(flat: list[np.ndarray], w: _Wire, local_size: int, local_fmt: Format) -> np.ndarray:
    """The ``native`` row's simulation (MPICH's recursive-doubling order)."""
    return _native_sum(flat, w)
