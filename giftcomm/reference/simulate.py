"""Single-process simulations of the collectives: every rank's inputs in, every rank's outputs out.

Written as plain loops over the algorithm's steps, independent of the distributed code, so that
the distributed result can be checked against them bit for bit (DESIGN invariant 2).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..formats import check_block, get_format
from ..costmodel import Topology, choose
from ..partition import accumulation_dtype, chunk_bounds
from .codec import decode, encode

__all__ = ["simulate_allreduce", "simulate_gift_allreduce", "simulate_reduce_scatter", "simulate_allgather"]


def _flat_inputs(inputs: Sequence[np.ndarray]) -> tuple[list[np.ndarray], np.dtype, tuple]:
    if len(inputs) < 1:
        raise ValueError("need at least one rank's input")
    arrays = [np.asarray(x) for x in inputs]
    shape, dtype = arrays[0].shape, arrays[0].dtype
    for a in arrays:
        if a.size != arrays[0].size or a.dtype != dtype:
            raise ValueError("all ranks' inputs must have the same element count and dtype")
    return [a.reshape(-1) for a in arrays], dtype, shape


def _ring_chunk_sums(flat: list[np.ndarray], fmt: str, block: int) -> tuple[list[np.ndarray], np.ndarray]:
    """The owner's high-precision sum of each chunk, after the ring reduce-scatter."""
    p = len(flat)
    acc_t = accumulation_dtype(flat[0].dtype)
    bounds = chunk_bounds(flat[0].size, p, block)
    sums = []
    with np.errstate(invalid="ignore", over="ignore"):
        for c in range(p):
            lo, hi = bounds[c], bounds[c + 1]
            part = [x[lo:hi].astype(acc_t) for x in flat]
            if p == 1:
                sums.append(part[0])
                continue
            # Chunk c starts at rank c+1 and travels right; rank c adds last.
            msg = encode(part[(c + 1) % p].astype(np.float32), fmt, block)
            for k in range(2, p + 1):
                acc = decode(msg, hi - lo, fmt, block).astype(acc_t) + part[(c + k) % p]
                if k < p:
                    msg = encode(acc.astype(np.float32), fmt, block)
            sums.append(acc)
    return sums, bounds


def _direct_chunk_sums(flat: list[np.ndarray], fmt: str, block: int) -> tuple[list[np.ndarray], np.ndarray]:
    """The owner's sum of each chunk after the direct reduce-scatter: contributions in rank
    order, each other rank's quantized once, the owner's own exact."""
    p = len(flat)
    acc_t = accumulation_dtype(flat[0].dtype)
    bounds = chunk_bounds(flat[0].size, p, block)
    sums = []
    with np.errstate(invalid="ignore", over="ignore"):
        for c in range(p):
            lo, hi = bounds[c], bounds[c + 1]
            acc = None
            for src in range(p):
                part = flat[src][lo:hi].astype(np.float32)
                value = (flat[src][lo:hi].astype(acc_t) if src == c
                         else decode(encode(part, fmt, block), hi - lo, fmt, block).astype(acc_t))
                acc = value if acc is None else acc + value
            sums.append(acc)
    return sums, bounds


def _gathered(sums: list[np.ndarray], bounds: np.ndarray, fmt: str, block: int, acc_t: np.dtype) -> np.ndarray:
    """Each owner encodes its sum once; everybody decodes: the allgather's result."""
    result = np.empty(int(bounds[-1]), acc_t)
    for c, s in enumerate(sums):
        result[bounds[c] : bounds[c + 1]] = decode(encode(s.astype(np.float32), fmt, block), s.size, fmt, block)
    return result


def _doubling_sum(flat: list[np.ndarray], fmt: str, block: int) -> np.ndarray:
    """Recursive doubling (see giftcomm/collectives/doubling.py), rank by rank."""
    p, n = len(flat), flat[0].size
    acc_t = accumulation_dtype(flat[0].dtype)
    p2 = 1 << (p.bit_length() - 1)

    def q(v: np.ndarray) -> np.ndarray:
        return decode(encode(v.astype(np.float32), fmt, block), n, fmt, block).astype(acc_t)

    with np.errstate(invalid="ignore", over="ignore"):
        acc = [flat[r].astype(acc_t) for r in range(p2)]
        for r in range(p - p2):
            acc[r] = acc[r] + q(flat[r + p2])
        dist = 1
        while dist < p2:
            acc = [q(acc[min(r, r ^ dist)]) + q(acc[max(r, r ^ dist)]) for r in range(p2)]
            dist *= 2
    return q(acc[0])


def _hierarchical_sum(flat: list[np.ndarray], fmt: str, block: int, local_size: int,
                      local_fmt: str, inter: str) -> np.ndarray:
    """Node-local pass-through ring reduce-scatter, FP8 across nodes, node-local allgather."""
    p = len(flat)
    if local_size < 1 or p % local_size:
        raise ValueError(f"local_size={local_size} must divide the number of ranks ({p})")
    acc_t = accumulation_dtype(flat[0].dtype)
    nodes = [flat[j : j + local_size] for j in range(0, p, local_size)]
    local_bounds = chunk_bounds(flat[0].size, local_size, block)
    node_sums = [_ring_chunk_sums(members, local_fmt, block)[0] for members in nodes]
    result = np.empty(flat[0].size, acc_t)
    cross_sums = _direct_chunk_sums if inter == "direct" else _ring_chunk_sums
    for l in range(local_size):
        sums, bounds = cross_sums([ns[l] for ns in node_sums], fmt, block)
        chunk = _gathered(sums, bounds, fmt, block, acc_t)
        # the node-local allgather carries these float32 values exactly (fp32 pass-through)
        result[local_bounds[l] : local_bounds[l + 1]] = chunk.astype(np.float32)
    return result


def _finish(values: np.ndarray, op: str, p: int, dtype: np.dtype) -> np.ndarray:
    if op == "avg":
        values = values / values.dtype.type(p)
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(dtype)


def simulate_gift_allreduce(
    inputs: Sequence[np.ndarray], geometry, fmt: str = "e4m3", block: int = 256, op: str = "sum",
    algorithm: str = "auto", local_size: int | None = None,
) -> list[np.ndarray]:
    """Every rank's gift_allreduce output: forward on each rank (float32), the allreduce
    simulation of the transformed vectors, inverse of the sum, then ``/ P`` for avg.

    ``geometry``: anything with size, is_identity, forward(flat) and inverse(flat)
    (giftcomm.geometry.Geometry). None or an identity geometry simulates plain allreduce.
    """
    if geometry is None or geometry.is_identity:
        return simulate_allreduce(inputs, fmt, block, op, algorithm, local_size)
    flat, dtype, shape = _flat_inputs(inputs)
    p = len(flat)
    transformed = [np.asarray(geometry.forward(x), dtype=np.float32) for x in flat]
    summed = simulate_allreduce(transformed, fmt, block, "sum", algorithm, local_size)[0]
    back = np.asarray(geometry.inverse(summed), dtype=np.float32)
    out = _finish(back, op, p, dtype).reshape(shape)
    return [out.copy() for _ in range(p)]


def _oneshot_sum(flat: list[np.ndarray], fmt: str, block: int) -> np.ndarray:
    """Every rank's vector encoded once and decoded, summed in rank order (the first assigned)."""
    acc_t = accumulation_dtype(flat[0].dtype)
    n = flat[0].size
    with np.errstate(invalid="ignore", over="ignore"):
        parts = [decode(encode(x.astype(np.float32), fmt, block), n, fmt, block).astype(acc_t) for x in flat]
        total = parts[0].copy()
        for part in parts[1:]:
            total += part
    return total


def simulate_reduce_scatter(
    inputs: Sequence[np.ndarray], fmt: str = "e4m3", block: int = 256, op: str = "sum", algorithm: str = "ring"
) -> list[np.ndarray]:
    """Every rank's reduce_scatter shard (1-D, input dtype), from every rank's input.

    algorithm: "ring" or "direct" (the reduce-scatter halves of those allreduces).
    """
    get_format(fmt)
    block = check_block(block)
    if algorithm not in ("ring", "direct"):
        raise ValueError(f"reduce_scatter algorithm must be 'ring' or 'direct', got {algorithm!r}")
    flat, dtype, _ = _flat_inputs(inputs)
    sums, _ = (_direct_chunk_sums if algorithm == "direct" else _ring_chunk_sums)(flat, fmt, block)
    return [_finish(s, op, len(flat), dtype) for s in sums]


ALGORITHMS = ("auto", "ring", "direct", "doubling", "hierarchical", "hierarchical_direct", "oneshot")


def resolve_algorithm(algorithm: str, n: int, p: int, local_size: int | None, fmt: str, block: int) -> str:
    """The algorithm "auto" stands for: the cost model's choice for n values on p ranks, in
    nodes of ``local_size`` consecutive ranks (one node when None), as giftcomm.allreduce does."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    if algorithm != "auto":
        return algorithm
    k = local_size or p
    return choose(n, Topology(p, p // k, k), fmt, block)


def simulate_allreduce(
    inputs: Sequence[np.ndarray], fmt: str = "e4m3", block: int = 256, op: str = "sum",
    algorithm: str = "auto", local_size: int | None = None, local_fmt: str = "fp32",
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
    - "hierarchical" / "hierarchical_direct": nodes of ``local_size`` consecutive ranks;
      pass-through (``local_fmt``) ring reduce-scatter inside each node, ring / direct FP8
      allreduce of each node chunk across nodes, exact fp32 allgather inside each node;
    - "auto" (the default, as in giftcomm.allreduce): the cost model's choice for this size,
      rank count and node layout (giftcomm.costmodel.choose).
    """
    get_format(fmt)
    get_format(local_fmt)
    block = check_block(block)
    flat, dtype, shape = _flat_inputs(inputs)
    p = len(flat)
    algorithm = resolve_algorithm(algorithm, flat[0].size, p, local_size, get_format(fmt).name, block)
    acc_t = accumulation_dtype(dtype)
    if flat[0].size == 0:
        result = np.zeros(0, acc_t)
    elif algorithm == "ring":
        result = _gathered(*_ring_chunk_sums(flat, fmt, block), fmt, block, acc_t)
    elif algorithm == "direct":
        result = _gathered(*_direct_chunk_sums(flat, fmt, block), fmt, block, acc_t)
    elif algorithm == "doubling":
        result = _doubling_sum(flat, fmt, block)
    elif algorithm == "oneshot":
        result = _oneshot_sum(flat, fmt, block)
    else:
        inter = "direct" if algorithm == "hierarchical_direct" else "ring"
        result = _hierarchical_sum(flat, fmt, block, local_size or p, local_fmt, inter)
    out = _finish(result.astype(acc_t, copy=False), op, p, dtype).reshape(shape)
    return [out.copy() for _ in range(p)]


def simulate_allgather(shards: Sequence[np.ndarray], fmt: str = "e4m3", block: int = 256) -> list[np.ndarray]:
    """Every rank's allgather output: the concatenation of every shard, each encoded once."""
    get_format(fmt)
    block = check_block(block)
    arrays = [np.asarray(s).reshape(-1) for s in shards]
    dtype = arrays[0].dtype
    pieces = [decode(encode(a.astype(np.float32), fmt, block), a.size, fmt, block) for a in arrays]
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.concatenate(pieces).astype(dtype)
    return [out.copy() for _ in arrays]
